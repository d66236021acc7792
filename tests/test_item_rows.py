"""A job's item records for GET /jobs/ID?items are built by the HTTP edge, not the jobs thread.

Rule (table.ItemRows, node `_get`, http `_record_json`): a 100,000-item job's records took the
jobs thread half a second to build and the HTTP thread as long again to encode in one call, and
the member answered nothing else meanwhile. A local client that asks with `copy_items` gets the
job's item columns copied (`ItemRows`); the edge builds and encodes the records a slice at a time.
The records are the same dicts as before, of the job as it was when read; a peer that forwarded
the request still gets the list.
"""

from __future__ import annotations

import json

from meshjobs import limits
from meshjobs.control import parse_request
from meshjobs.node import FrameIn
from meshjobs.table import ItemRows, materialize
from tests.helpers import Fleet1, submit_req


def _job(f: Fleet1):
    """A job of 3 items, leased to the fleet of one's slots."""
    f.ctl(1, submit_req(n=3))
    f.settle()
    return f.table, f.table.jobs["j1"]


def test_copy_gives_the_same_records_as_the_table() -> None:
    """ItemRows.records() is exactly [item_record(job, i) for each item], whole or by slices."""
    f = Fleet1()
    t, job = _job(f)
    rows = ItemRows(job)
    want = [t.item_record(job, i) for i in range(job.n)]
    assert len(rows) == job.n
    assert rows.records() == want
    assert rows.records(0, 2) + rows.records(2, 99) == want
    assert rows.records(5, 9) == []
    assert t.record(job, items="copy")["items"].records() == t.record(job, items=True)["items"]
    assert materialize(t.record(job, items="copy")) == t.record(job, items=True)
    assert materialize({"id": "x"}) == {"id": "x"}


def test_copy_keeps_the_rest_of_the_record() -> None:
    """A record with its items copied has every other key of the record with items (the
    items' names among them)."""
    f = Fleet1()
    f.ctl(1, submit_req(n=2, names=["a", "b"]))
    f.settle()
    t, job = f.table, f.table.jobs["j1"]
    copied, listed = t.record(job, items="copy"), t.record(job, items=True)
    assert copied["names"] == ["a", "b"]
    assert set(copied) == set(listed)


def test_copy_is_the_job_as_it_was_read() -> None:
    """Changes to the job after the copy (its items leased, ended) are not in the copy."""
    f = Fleet1(slots=0)
    f.ctl(1, submit_req(n=2))
    f.settle()
    job = f.table.jobs["j1"]
    rows = ItemRows(job)
    before = rows.records()
    job.st[0] = 2
    job.rc[0] = 3
    job.member[0] = "elsewhere"
    assert rows.records() == before


def test_get_with_copy_items_answers_a_copy_for_a_local_client() -> None:
    """The jobs thread answers a local `get` with copy_items with the columns copied, not a
    list of dicts; without it, the list as before."""
    f = Fleet1()
    f.ctl(1, submit_req(n=3))
    f.settle()
    f.ctl(2, {"op": "get", "id": "j1", "items": True, "copy_items": True})
    f.ctl(3, {"op": "get", "id": "j1", "items": True})
    f.settle()
    copied, listed = f.answer(2).body, f.answer(3).body
    assert isinstance(copied["items"], ItemRows)
    assert isinstance(listed["items"], list)
    assert materialize(copied) == listed


def test_copy_items_is_a_flag_or_nothing() -> None:
    """parse_request keeps copy_items only when it is exactly true (remote garbage otherwise
    drops it: the answer is the list)."""
    base = {"op": "get", "id": "j1", "items": True}
    assert parse_request({**base, "copy_items": True})["copy_items"] is True
    for junk in (1, "yes", [True], None, False):
        assert "copy_items" not in parse_request({**base, "copy_items": junk})
    assert "copy_items" not in parse_request(base)


def test_a_peer_gets_the_list() -> None:
    """A `get` forwarded by a peer (F_CTL) with copy_items is answered with the list: an
    ItemRows never leaves the member."""
    f = Fleet1()
    f.ctl(1, submit_req(n=2))
    f.settle()
    f.node.step(FrameIn("m2", "F_CTL", {"rid": "#get.m2.1", "req": {
        "op": "get", "id": "j1", "items": True, "copy_items": True, "wait_ms": 0}}))
    sends = [e for e in f.take() if getattr(e, "ftype", None) == "F_CTL_REPLY"]
    assert sends, "the peer got no answer"
    body = sends[-1].body["body"]
    assert isinstance(body["items"], list)
    assert body["items"] == [f.table.item_record(f.table.jobs["j1"], i) for i in range(2)]


def test_http_items_of_a_job_bigger_than_a_slice(meshd) -> None:
    """GET /jobs/ID?items=1 of a job of more items than one slice: valid JSON, every item in
    order; the rest of the record is the record without items."""
    n = limits.items_json_slice_max * 2 + 7
    st, job = meshd.request("POST", "/jobs", {"argv": ["true"], "items": [""] * n, "hold": True})
    assert st == 201, job
    job_id = job["id"]
    st, headers, raw = meshd.raw_request("GET", f"/jobs/{job_id}?items=1")
    assert st == 200 and headers["Content-Type"].startswith("application/json")
    rec = json.loads(raw)
    assert [it["index"] for it in rec["items"]] == list(range(n))
    assert all(it["state"] == "pending" and it["attempts"] == 0 for it in rec["items"])
    assert rec["items_total"] == n and rec["id"] == job_id
    st, plain = meshd.request("GET", f"/jobs/{job_id}")
    assert st == 200 and "items" not in plain
    assert {k: v for k, v in rec.items() if k != "items"} == plain
