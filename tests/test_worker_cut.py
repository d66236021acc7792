"""A worker member cut off from every voter keeps answering reads from its table (issue 26,
point 2), on real members: 3 voters and 1 worker, the worker in a network namespace of its own.

What was seen: a worker isolated for 8 s answered `GET /jobs` with 503 ("has just started") at
once, and still after the heal, while voters cut off the same way answered from their tables.
The worker held its table all along; what refused was the gate of a member that has just
started, opened only when a read came while the leader's frames were arriving. A worker now
answers from its table, says in the answer whether that table is fresh (`X-Meshjobs-Fresh`, as
`/healthz?fresh=1` tells), and is fresh again once the leader's entries reach it after the heal.

The cut drops every packet in or out of the worker's namespace but its HTTP port's (the test
asks it), as a pulled cable would: nothing is refused or reset, connections go silent. Where
namespaces cannot be made, the namespace test is skipped (saying why) and the one that stops
every voter with SIGSTOP still runs: the worker is cut off from every voter just the same.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from collections.abc import Iterator

import pytest

from tests.helpers import (
    Meshd,
    Netns,
    fleet_running,
    leader_of,
    make_fleet,
    netns_unavailable,
    wait_until,
)

CUT_S = 8.0  # how long the worker is cut off, as in the report
ANYONE = "[auth]\nallow_anonymous = true\n"  # HTTP beyond loopback, in a test's own namespace


def _list(m: Meshd) -> tuple[int, str | None, list | dict]:
    """GET /jobs of `m`: (status, its X-Meshjobs-Fresh header, body)."""
    status, headers, raw = m.raw_request("GET", "/jobs", headers={"Accept": "application/json"},
                                         timeout_s=10)
    return status, headers.get("X-Meshjobs-Fresh"), json.loads(raw)


def _ids(body: list | dict) -> set[str]:
    return {j["id"] for j in body} if isinstance(body, list) else set()


def _health(m: Meshd) -> dict:
    status, h = m.request("GET", "/healthz", timeout_s=10)
    assert status == 200, (status, h)
    return h


def _submit(m: Meshd) -> str:
    status, rec = m.request("POST", "/jobs", {"argv": ["true"]})
    assert status == 201, (status, rec)
    return rec["id"]


def _holds(w: Meshd, n_jobs: int) -> bool:
    """The worker's table holds `n_jobs` jobs and follows the leader: asked of /healthz, not of
    /jobs, so that its first read of the job list comes while it is cut off."""
    h = _health(w)
    return h["fresh"] and h["jobs"] == n_jobs


def _reads_through(w: Meshd, until: float, have: set[str]) -> int:
    """Read the worker's job list until `until` (monotonic): every answer is a 200 from its
    table (holding `have`) that says it is not fresh. The number of reads."""
    n = 0
    while True:
        status, fresh, body = _list(w)
        assert status == 200, (status, body)
        assert fresh == "false", (fresh, body)
        assert have <= _ids(body), (have, body)
        n += 1
        if time.monotonic() >= until:
            return n
        time.sleep(0.2)  # sleep-ok: the pace of reads through a cut of fixed length


def _fresh_with(w: Meshd, job_id: str) -> bool:
    status, fresh, body = _list(w)
    assert status == 200, (status, body)
    return fresh == "true" and job_id in _ids(body)


@pytest.fixture
def netns() -> Iterator[Netns]:
    why = netns_unavailable()
    if why is not None:
        pytest.skip(f"the worker needs a network namespace of its own: {why} (the SIGSTOP test "
                    "of this module cuts it off without one)")
    with Netns() as ns:
        yield ns


@pytest.fixture
def cut_fleet(netns, tmp_path) -> Iterator[list[Meshd]]:
    """3 voters here and worker w1 in `netns`, started; stopped by pid afterwards."""
    voters = {n: netns.outer for n in ("v1", "v2", "v3")}
    fleet = make_fleet(str(tmp_path), voters=3, workers=1, dead_ms=3000, extra=ANYONE,
                       hosts={**voters, "w1": netns.inner})
    fleet[3].prefix = netns.prefix
    yield from fleet_running(fleet)


@pytest.fixture
def fleet(tmp_path) -> Iterator[list[Meshd]]:
    """3 voters and worker w1 on loopback, started; stopped by pid afterwards."""
    yield from fleet_running(make_fleet(str(tmp_path), voters=3, workers=1, dead_ms=3000))


def test_worker_cut_off_in_its_namespace_answers_reads_and_catches_up(netns, cut_fleet) -> None:
    w = cut_fleet[3]
    leader = leader_of(cut_fleet[:3])
    before = _submit(leader)
    wait_until(lambda: _holds(w, 1), what="the worker holding the job submitted before")
    try:
        netns.cut(reachable=(int(w.url.rsplit(":", 1)[1]),))
        until = time.monotonic() + CUT_S
        # Cut off: the worker no longer hears the leader (dead_ms), and says so.
        wait_until(lambda: not _health(w)["fresh"], what="the worker knowing it is cut off")
        meanwhile = _submit(leader)  # the voters still make a majority
        assert _reads_through(w, until, {before}) > 1
    finally:
        netns.heal()
    # Healed: the worker hears the leader again, catches up and says its reads are fresh.
    wait_until(lambda: _fresh_with(w, meanwhile),
               what="the healed worker fresh, with the job submitted while it was cut off")
    assert _health(w)["fresh"]


def test_worker_with_every_voter_stopped_answers_reads_and_catches_up(fleet) -> None:
    """The same cut made without namespaces: every voter stopped (SIGSTOP) for CUT_S, its
    connections silent; then continued (SIGCONT)."""
    w = fleet[3]
    leader = leader_of(fleet[:3])
    before = _submit(leader)
    wait_until(lambda: _holds(w, 1), what="the worker holding the job submitted before")
    stopped: list[int] = []
    try:
        for v in fleet[:3]:
            os.kill(v.pid, signal.SIGSTOP)
            stopped.append(v.pid)
        until = time.monotonic() + CUT_S
        wait_until(lambda: not _health(w)["fresh"], what="the worker knowing it is cut off")
        assert _reads_through(w, until, {before}) > 1
    finally:
        for pid in stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
    after = _submit(leader_of(fleet[:3]))
    wait_until(lambda: _fresh_with(w, after),
               what="the worker fresh again, with a job submitted since the voters went on")
