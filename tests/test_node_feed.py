"""Tests of the node's feed of committed changes (meshjobs/node/feed.py) and of reads that wait
for a job's next version (`get` with `since`), driven as the pure state machine the node is."""

from __future__ import annotations

from typing import Any

import pytest

from meshjobs import limits
from meshjobs.node import View
from meshjobs.table import JobTable
from tests.helpers import Fleet1, submit_req, submitted


def changes(f: Fleet1, token: int, since: int | None, wait_ms: int = 0, **filters: Any) -> None:
    req: dict[str, Any] = {"op": "changes", "since": since, "wait_ms": wait_ms}
    req.update({k: list(v) for k, v in filters.items()})
    f.ctl(token, req)
    f.take()


def test_get_since_answers_on_the_next_version() -> None:
    """get with since: answered at once when the job's version is past `since`, else at the
    next change of the job (an item leased, an item ended), not only at its end."""
    f = Fleet1()
    rec = submitted(f, n=2)
    v0 = rec["version"]
    assert v0 == f.table.jobs["j1"].version > 0
    f.ctl(2, {"op": "get", "id": "j1", "wait_ms": 60_000, "since": v0 - 1})
    f.take()
    assert f.answer(2).body["version"] == v0, "a version past since: answered at once"
    f.ctl(3, {"op": "get", "id": "j1", "wait_ms": 60_000, "since": v0})
    f.take()
    assert 3 not in f.replies
    f.settle()  # the items are leased
    body = f.answer(3).body
    assert body["version"] > v0 and body["items_running"] == 2 and body["state"] == "running"
    f.ctl(4, {"op": "get", "id": "j1", "wait_ms": 60_000, "since": body["version"]})
    f.take()
    assert 4 not in f.replies
    f.end(f.runs[0])
    f.settle()
    one = f.answer(4).body
    assert one["state"] == "running" and one["items_done"] == 1 and one["version"] > body["version"]
    # Without since, a wait still lasts until the job ends.
    f.ctl(5, {"op": "get", "id": "j1", "wait_ms": 60_000})
    f.take()
    assert 5 not in f.replies
    f.end(f.runs[1])
    f.settle()
    assert f.answer(5).body["state"] == "done"
    # A finished job is answered at once, whatever since says.
    f.ctl(6, {"op": "get", "id": "j1", "wait_ms": 60_000, "since": 10**9})
    f.take()
    assert f.answer(6).body["state"] == "done"


@pytest.mark.parametrize("since", [-1, "3", 1.5, True, limits.version_max + 1])
def test_get_bad_since_400(since: Any) -> None:
    """get: a since that is not a version (negative, not an integer, too large) is 400."""
    f = Fleet1()
    f.ctl(1, {"op": "get", "id": "j1", "since": since})
    f.take()
    ans = f.answer(1)
    assert ans.status == 400 and "since" in ans.body["error"]


def test_changes_sends_each_changed_job_in_version_order() -> None:
    """changes: every job changed after since, its current record once, in version order; the
    answer's version is the table's applied index."""
    f = Fleet1()
    changes(f, 1, None)
    start = f.answer(1).body
    assert start == {"version": f.table.applied_index, "reset": False, "events": []}
    submitted(f, token=2, rid="a", job_id="j1", n=1)
    submitted(f, token=3, rid="b", job_id="j2", n=1, tags=["x"])
    f.settle()
    changes(f, 4, start["version"])
    body = f.answer(4).body
    assert [e["data"]["id"] for e in body["events"]] == ["j1", "j2"] or \
        [e["data"]["id"] for e in body["events"]] == ["j2", "j1"]
    versions = [e["version"] for e in body["events"]]
    assert versions == sorted(versions)
    for e in body["events"]:
        assert e["event"] == "job"
        assert e["data"] == f.table.record(f.table.jobs[e["data"]["id"]])
        assert e["version"] == e["data"]["version"]
    assert body["version"] == f.table.applied_index and not body["reset"]
    # Nothing new: no wait answers at once and empty; a wait waits.
    changes(f, 5, body["version"])
    assert f.answer(5).body["events"] == []
    changes(f, 6, body["version"], wait_ms=10_000, tags=["x"])
    assert 6 not in f.replies
    f.end(f.runs[0])  # j1's item (no tag x): not for this waiter
    f.settle()
    assert 6 not in f.replies
    assert f.node.next_deadline_ms() is not None
    f.end(f.runs[1])
    f.settle()
    [ev] = f.answer(6).body["events"]
    assert ev["data"]["id"] == "j2" and ev["data"]["state"] == "done"


def test_changes_filters_and_forget() -> None:
    """changes: filters by job id, tag, state and pool (any value of a filter, every filter);
    a forgotten job comes as `forget` with the version of the entry that forgot it."""
    f = Fleet1()
    changes(f, 1, None)
    v = f.answer(1).body["version"]
    submitted(f, token=2, rid="a", job_id="j1", n=1, tags=["x"])
    submitted(f, token=3, rid="b", job_id="j2", n=1, tags=["y"], hold=True)
    f.settle()
    cases: list[tuple[dict, set[str]]] = [
        ({"jobs": ["j2"]}, {"j2"}),
        ({"tags": ["x", "z"]}, {"j1"}),
        ({"states": ["held"]}, {"j2"}),
        ({"states": ["running", "held"]}, {"j1", "j2"}),
        ({"pools": ["default"]}, {"j1", "j2"}),
        ({"pools": ["gpu"]}, set()),
        ({"tags": ["x"], "states": ["held"]}, set()),
    ]
    for token, (filters, want) in enumerate(cases, start=10):
        changes(f, token, v, **filters)
        got = {e["data"]["id"] for e in f.answer(token).body["events"]}
        assert got == want, filters
    f.ctl(4, {"op": "cancel", "rid": "c", "id": "j2"})
    f.settle()
    before = f.table.applied_index
    f.ctl(5, {"op": "forget", "rid": "f", "id": "j2"})
    f.settle()
    assert f.answer(5).status == 200
    changes(f, 6, before, jobs=["j2"])
    [ev] = f.answer(6).body["events"]
    assert ev["event"] == "forget" and ev["data"] == {"id": "j2", "version": ev["version"]}
    assert before < ev["version"] <= f.table.applied_index


def test_changes_reset_when_the_ring_no_longer_holds_since() -> None:
    """changes: a since older than what the ring holds (trimmed to events_ring_changes_max, or
    a snapshot installed) is answered `reset` with the current version."""
    f = Fleet1()
    old = limits.events_ring_changes_max
    limits.events_ring_changes_max = 3
    try:
        submitted(f, token=1, rid="a", job_id="j1", n=4)
        f.settle()
        for run in list(f.runs):
            f.end(run)
        f.settle()
    finally:
        limits.events_ring_changes_max = old
    changes(f, 2, 0)
    body = f.answer(2).body
    assert body == {"version": f.table.applied_index, "reset": True, "events": []}
    changes(f, 3, f.table.applied_index - 1)
    assert not f.answer(3).body["reset"]
    # A snapshot installed (the table jumps without entries): everything before it resets.
    now = f.table.applied_index
    copy = JobTable.from_state(f.table.to_state())
    copy.applied_index = now + 10
    f.table.load(copy)
    changes(f, 4, now)
    assert f.answer(4).body["reset"]
    changes(f, 5, now + 10)
    assert f.answer(5).body == {"version": now + 10, "reset": False, "events": []}


def test_changes_answer_is_bounded_and_resumes() -> None:
    """changes: at most events_answer_max events in one answer, cut between versions; the
    answer's version is where the next call goes on, and no job is skipped."""
    f = Fleet1(slots=0)
    f.node.step(View(term=1, leader="m1", is_leader=True, ready=True))
    changes(f, 1, None)
    v = f.answer(1).body["version"]
    for k in range(7):
        submitted(f, token=100 + k, rid=f"r{k}", job_id=f"j{k}", n=1)
    old = limits.events_answer_max
    limits.events_answer_max = 3
    try:
        seen: list[str] = []
        token = 200
        while True:
            changes(f, token, v)
            body = f.answer(token).body
            token += 1
            assert len(body["events"]) <= 3
            if not body["events"]:
                break
            seen += [e["data"]["id"] for e in body["events"]]
            v = body["version"]
    finally:
        limits.events_answer_max = old
    assert sorted(seen) == [f"j{k}" for k in range(7)]


@pytest.mark.parametrize("req", [
    {"since": -1}, {"since": "1"}, {"wait_ms": -5}, {"jobs": "j1"}, {"jobs": []},
    {"jobs": ["bad id!"]}, {"states": ["sleeping"]}, {"pools": ["a b"]}, {"tags": [7]},
    {"tags": ["t"] * (limits.events_filter_values_max + 1)},
    {"since": limits.version_max + 1},
])
def test_changes_bad_requests_400(req: dict) -> None:
    """changes: malformed since, wait or filters are 400, never a crash."""
    f = Fleet1()
    f.ctl(1, {"op": "changes", **req})
    f.take()
    assert f.answer(1).status == 400


def test_changes_waiters_bounded() -> None:
    """changes: at most events_waiters_max long-polls wait at once; more are 503."""
    f = Fleet1()
    changes(f, 1, None)
    v = f.answer(1).body["version"]
    old = limits.events_waiters_max
    limits.events_waiters_max = 2
    try:
        for token in (2, 3, 4):
            changes(f, token, v, wait_ms=60_000)
    finally:
        limits.events_waiters_max = old
    assert 2 not in f.replies and 3 not in f.replies
    assert f.answer(4).status == 503
    f.ctl(5, submit_req(rid="z", job_id="jz"))
    f.settle()
    assert f.answer(2).body["events"][0]["data"]["id"] == "jz"
    assert f.answer(3).body["events"][0]["data"]["id"] == "jz"


def test_changes_since_ahead_of_this_member_waits() -> None:
    """changes: a since past this member's table (the client came from a member further on)
    waits for changes after it, and sends nothing it already had."""
    f = Fleet1()
    submitted(f, token=1, rid="a", job_id="j1", n=1)
    f.settle()
    ahead = f.table.applied_index + 2
    changes(f, 2, ahead, wait_ms=60_000)
    f.end(f.runs[0])
    f.settle()  # the result lands at an index at or below `ahead`
    assert 2 not in f.replies or all(e["version"] > ahead for e in f.answer(2).body["events"])
    submitted(f, token=3, rid="b", job_id="j2", n=1)
    f.settle()
    events = f.answer(2).body["events"]
    assert events and all(e["version"] > ahead for e in events)
