"""A new worker joins a fleet whose table is large (issue 26, point 5): the leader sends it the
dump its forked writer already wrote, from a thread of its own, at the pace the link takes it,
with the entries after it; the worker checks it and installs it. Real meshd processes."""

from __future__ import annotations

import os

import pytest

from meshjobs import limits
from tests.helpers import make_fleet, start_all, submit_big_entry, wait_until

pytestmark = pytest.mark.fleet


def _jobs(m) -> dict[str, dict]:
    status, page = m.request("GET", "/jobs?limit=1000")
    assert status == 200 and len(page) < 1000, page
    return {j["id"]: j for j in page}


def test_a_new_worker_gets_a_table_larger_than_the_link_queue_from_the_dump(tmp_path) -> None:
    """A table whose snapshot is larger than a link's queue and its wait room together (16
    MiB): built and packed as one body, it could never be queued to a worker (the batch was
    cut, and sent again, for ever). Sent as the dump file in parts that wait for room, the
    worker gets it, with the jobs submitted after the dump, and its table is the leader's."""
    members = make_fleet(str(tmp_path), voters=1, workers=1)
    v1, w1 = members
    try:
        start_all([v1])
        big = [submit_big_entry(v1)["id"] for _ in range(4)]
        wait_until(lambda: v1.metrics().get("meshjobs_dumps_written_total", 0) >= 1, 120,
                   what="a dump written")
        dump = os.path.getsize(os.path.join(v1.data, "raft.dump"))
        assert dump > limits.link_queue_bytes_max * 2, dump
        status, after = v1.request("POST", "/jobs", {"argv": ["true"], "hold": True})
        assert status == 201, after
        start_all([w1])
        want = _jobs(v1)
        assert set(big) | {after["id"]} <= set(want)

        def caught_up() -> bool:
            status, h = w1.request("GET", "/healthz")
            return status == 200 and h.get("jobs") == len(want) and h.get("fresh") is True

        wait_until(caught_up, 240, what="the new worker's table caught up")
        got = _jobs(w1)
        assert {k: (j["state"], j["items_total"]) for k, j in got.items()} == \
            {k: (j["state"], j["items_total"]) for k, j in want.items()}
        m = v1.metrics()
        assert m.get("meshjobs_node_state_dumps_sent_total", 0) >= 1
        assert m.get("meshjobs_dumps_sent_total", 0) >= 1
        assert m.get("meshjobs_node_state_snapshots_sent_total", 0) == 0, \
            "no table built and packed on the leader's jobs thread"
        assert w1.metrics().get("meshjobs_node_state_dumps_installed_total", 0) >= 1
    finally:
        for m in members:
            m.stop()
