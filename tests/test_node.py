"""Tests of the job node (meshjobs/node.py), driven directly as the pure state machine it is.

A tiny "fleet of one" harness stands in for Raft: it takes the node's effects, applies every
proposed entry to a real `JobTable` at the next log index (after a msgpack round trip, as the log
would carry it), and steps the node with `Applied`. Time moves only by `Tick`.
"""

from __future__ import annotations

import random
from typing import Any

import pytest

from meshjobs import limits, webui
from meshjobs.compact import entry_items
from meshjobs.control import Answer
from meshjobs.node import (
    BlobsCopied,
    CopyBlobs,
    Ctl,
    DiskFull,
    FetchBlobs,
    FrameIn,
    ItemEnded,
    JobNode,
    NodeConfig,
    PeerLink,
    Pool,
    Pressure,
    Propose,
    Reply,
    Send,
    Tick,
    View,
    spec_digest,
)
from meshjobs.table import JobTable, backoff_ms
from tests.helpers import DIGEST_OUT, T0, Fleet1, spec, submit_req, submitted

# --- control ----------------------------------------------------------------------------------


def test_submit_answered_only_after_applied() -> None:
    """Rule 4: a submit is answered (201, the job record) only once its entry is applied."""
    f = Fleet1()
    f.ctl(1, submit_req(n=2, tags=["t"]))
    f.take()
    assert 1 not in f.replies
    [entry] = f.pending_of("submit")
    assert entry["k"] == "submit" and entry["rid"] == "r1" and entry["id"] == "j1"
    # Free slots and nothing older waiting: the job's items are leased in the same entry.
    [batch] = f.batches
    assert [e["k"] for e in batch["es"]] == ["submit", "lease"]
    assert [g[:2] for g in batch["es"][1]["g"]] == [["j1", 0], ["j1", 1]]
    assert entry["t"] == f.now and entry_items(entry) == [None, None] and "id" not in entry["spec"]
    f.tick(10)
    f.take()
    assert 1 not in f.replies
    f.pending.remove(entry)
    f.commit(entry)
    f.take()
    ans = f.answer(1)
    assert ans.status == 201
    assert ans.body["id"] == "j1" and ans.body["items_total"] == 2 and ans.body["tags"] == ["t"]
    assert ans.body == f.table.record(f.table.jobs["j1"])


def test_submit_without_id_gets_one() -> None:
    """submit: without an id the node makes one from the injected generator (same seed, same id)."""
    ids = []
    for _ in range(2):
        f = Fleet1(seed=42)
        f.ctl(1, submit_req(job_id=None))
        f.settle()
        ids.append(f.answer(1).body["id"])
    assert ids[0] == ids[1] and ids[0] in f.table.jobs


def test_a_member_behind_never_says_no_such_job() -> None:
    """Rule: a member that has just started and not caught up (View.behind; a worker: no state
    from the leader yet) answers 503, not 404, for a job it does not know, and for the job list
    and bulk reads; once caught up, 404 as before, and it stays caught up."""
    f = Fleet1()
    f.node = JobNode(JobTable(), NodeConfig(member="m1", boot="b1"), random.Random(1))
    f.node.step(View(term=3, leader="m1", is_leader=True, ready=False, behind=True))
    asks = [{"op": "get", "id": "j1"}, {"op": "list", "state": None, "tag": None, "limit": 5},
            {"op": "bulk", "action": "status", "ids": ["j1"]}]
    for token, ask in enumerate(asks, 1):
        f.ctl(token, ask)
    f.take()
    for token in range(1, len(asks) + 1):
        ans = f.answer(token)
        assert ans.status == 503 and "catching up" in ans.body["error"], ans
        assert "try again" in ans.body["error"]
    f.node.step(View(term=3, leader="m1", is_leader=True, ready=True, behind=False))
    f.node.step(View(term=4, leader=None))  # a later election: stale reads are ordinary again
    f.ctl(9, {"op": "get", "id": "j1"})
    f.take()
    assert f.answer(9).status == 404
    worker = JobNode(JobTable(), NodeConfig(member="w1", boot="b", role="worker", voters={"m1": "x"}),
                     random.Random(1))
    worker.step(View())
    worker.step(Ctl(1, {"op": "get", "id": "j1"}))
    assert [e.answer.status for e in worker.take() if isinstance(e, Reply)] == [503]


def test_get_unknown_and_forgotten() -> None:
    """get: an unknown job is 404; a forgotten one 404 saying it was forgotten."""
    f = Fleet1()
    f.ctl(1, {"op": "get", "id": "nope"})
    f.take()
    assert f.answer(1).status == 404
    submitted(f, token=2)
    f.ctl(3, {"op": "cancel", "rid": "c", "id": "j1"})
    f.settle()
    assert f.answer(3).status == 200 and f.answer(3).body["state"] == "cancelled"
    f.ctl(4, {"op": "forget", "rid": "f", "id": "j1"})
    f.settle()
    assert f.answer(4) == Answer(200, {"id": "j1", "forgotten": True})
    f.ctl(5, {"op": "get", "id": "j1"})
    f.take()
    ans = f.answer(5)
    assert ans.status == 404 and "forgotten" in ans.body["error"]
    f.ctl(6, {"op": "cancel", "rid": "c2", "id": "j1"})
    f.take()
    assert f.answer(6).status == 404 and not f.pending


def test_get_and_list_read_the_table() -> None:
    """get and list are answered at once from the table, with items when asked."""
    f = Fleet1()
    submitted(f, n=2, tags=["x"])
    f.ctl(2, {"op": "get", "id": "j1", "items": True})
    f.ctl(3, {"op": "list", "tag": "x"})
    f.ctl(4, {"op": "list", "tag": "y"})
    f.ctl(5, {"op": "list", "state": "done"})
    f.take()
    assert [it["index"] for it in f.answer(2).body["items"]] == [0, 1]
    assert [r["id"] for r in f.answer(3).body] == ["j1"]
    assert f.answer(4).body == [] and f.answer(5).body == []


def test_list_filters_by_pool() -> None:
    """list with a pool answers only the jobs of that pool (with or without a page); a bad pool
    name is refused before it reaches the table."""
    f = Fleet1(pools={"default": Pool("default", slots=1), "gpu": Pool("gpu", slots=1)})
    submitted(f, token=10, rid="r0", job_id="j0", pool="gpu")
    submitted(f, token=11, rid="r1", job_id="j1")
    f.ctl(1, {"op": "list", "pool": "gpu"})
    f.ctl(2, {"op": "list", "pool": "default", "limit": 5})
    f.ctl(3, {"op": "list", "pool": "<script>"})
    f.take()
    assert [r["id"] for r in f.answer(1).body] == ["j0"]
    assert [r["id"] for r in f.answer(2).body["jobs"]] == ["j1"]
    assert f.answer(3).status == 400 and "bad pool name" in f.answer(3).body["error"]


def test_list_pages_newest_first() -> None:
    """list with a limit answers a page newest first and the cursor of the next; `after`
    starts below it; without a limit the old answer (every job, oldest first) stays."""
    f = Fleet1()
    for i in range(5):
        submitted(f, token=10 + i, rid=f"r{i}", job_id=f"j{i}", tags=["x"] if i != 2 else [])
    f.ctl(1, {"op": "list", "limit": 2})
    f.take()
    page = f.answer(1).body
    assert [r["id"] for r in page["jobs"]] == ["j4", "j3"] and page["next"] is not None
    f.ctl(2, {"op": "list", "limit": 2, "after": page["next"], "tag": "x"})
    f.take()
    page = f.answer(2).body
    assert [r["id"] for r in page["jobs"]] == ["j1", "j0"] and page["next"] is None
    f.ctl(3, {"op": "list", "limit": 5})
    f.take()
    assert f.answer(3).body["next"] is None and len(f.answer(3).body["jobs"]) == 5
    f.ctl(4, {"op": "list"})
    f.take()
    assert [r["id"] for r in f.answer(4).body] == ["j0", "j1", "j2", "j3", "j4"]


def test_submit_names_kept_and_digested() -> None:
    """names (item file names) are part of the spec: kept on the job, shown with its items,
    and a resubmit with other names is another job (the spec digest covers them)."""
    f = Fleet1()
    submitted(f, n=2, names=["a.txt", "b.txt"])
    f.ctl(2, {"op": "get", "id": "j1", "items": True})
    f.ctl(3, {"op": "get", "id": "j1"})
    f.take()
    assert f.answer(2).body["names"] == ["a.txt", "b.txt"] and "names" not in f.answer(3).body
    f.ctl(4, submit_req(rid="r2", n=2, names=["a.txt", "c.txt"]))
    f.take()
    assert f.answer(4).status == 409 and not f.pending_of("submit")


@pytest.mark.parametrize("req", [
    None, [], {}, {"op": "nope"},
    {"op": "list", "limit": 0}, {"op": "list", "limit": 1001}, {"op": "list", "limit": "5"},
    {"op": "list", "limit": True}, {"op": "list", "limit": 2, "after": 3},
    {"op": "list", "limit": 2, "after": "-1"}, {"op": "list", "after": "x"},
    {"op": "list", "after": "1" * 21}, {"op": "list", "after": "\uff11"},
    {"op": "submit", "rid": "r", "spec": {"argv": ["x"], "names": ["a", "b"]}, "items": [None]},
    {"op": "submit", "rid": "r", "spec": {"argv": ["x"], "names": ["a/b"]}, "items": [None]},
    {"op": "submit", "rid": "r", "spec": {"argv": ["x"], "names": ["\udc80"]}, "items": [None]},
    {"op": "submit", "rid": "r", "spec": {"argv": ["x"], "names": "a"}, "items": [None]}, {"op": "submit", "rid": "r", "spec": {}, "items": [None]},
    {"op": "submit", "spec": {"argv": ["x"]}, "items": [None]},
    {"op": "submit", "rid": "r", "spec": {"argv": ["x"]}, "items": []},
    {"op": "submit", "rid": "r", "spec": {"argv": ["x"]}, "items": ["zz"]},
    {"op": "submit", "rid": "r", "spec": {"argv": ["x"], "priority": True}, "items": [None]},
    {"op": "submit", "rid": "r", "spec": {"argv": ["x"], "bogus": 1}, "items": [None]},
    {"op": "cancel", "rid": "r", "id": "a b"}, {"op": "forget", "rid": "r"},
    {"op": "cancel", "rid": "bad rid", "id": "j1"},
    {"op": "tone", "rid": "r", "id": "j1", "priority": "1"},
    {"op": "tone", "rid": "r", "id": "j1"},
    {"op": "get", "id": "j1", "wait_ms": -1}, {"op": "list", "state": "weird"},
])
def test_bad_request_400_without_proposing(req: Any) -> None:
    """Bad requests are answered 400 and nothing is proposed."""
    f = Fleet1()
    submitted(f)
    f.settle()
    before = len(f.proposed)
    f.ctl(9, req)
    f.take()
    assert f.answer(9).status == 400
    assert "error" in f.answer(9).body
    assert len(f.proposed) == before


def test_unknown_pool_400() -> None:
    """submit: a pool this fleet does not have is 400, naming the pools it has."""
    f = Fleet1()
    f.ctl(1, submit_req(pool="gpu"))
    f.take()
    ans = f.answer(1)
    assert ans.status == 400 and "default" in ans.body["error"] and not f.pending


@pytest.mark.parametrize("view", [
    View(term=2, leader="m2", is_leader=False, ready=False),
    View(term=2, leader=None, is_leader=False, ready=False),
    View(term=2, leader="m1", is_leader=True, ready=False),
])
def test_not_leader_503(view: View) -> None:
    """Rule 3: a member that is not a ready leader answers changes 503 and proposes nothing;
    reads are still served from its table."""
    f = Fleet1()
    submitted(f)
    f.settle()
    f.node.step(view)
    before = len(f.proposed)
    reqs = [submit_req(rid="s2", job_id="j2"), {"op": "cancel", "rid": "c", "id": "j1"},
            {"op": "forget", "rid": "f", "id": "j1"},
            {"op": "tone", "rid": "t", "id": "j1", "priority": 3}]
    for token, req in enumerate(reqs, start=10):
        f.ctl(token, req)
    f.ctl(20, {"op": "get", "id": "j1"})
    effects = f.take()
    forwarded = [e for e in effects if isinstance(e, Send) and e.ftype == "F_CTL"]
    if view.leader is not None and not view.is_leader:
        # Another member leads: each change goes to it as F_CTL, answered when it replies.
        assert [e.to for e in forwarded] == [view.leader] * len(reqs)
        assert [e.body["rid"] for e in forwarded] == [r["rid"] for r in reqs]
        for token in range(10, 10 + len(reqs)):
            assert token not in f.replies
    else:
        assert not forwarded
        for token in range(10, 10 + len(reqs)):
            assert f.answer(token).status == 503
    assert f.answer(20).status == 200
    assert len(f.proposed) == before


def test_change_not_applied_in_time_503() -> None:
    """A change not applied within ctl_commit_ms_max is answered 503 (and only once)."""
    f = Fleet1()
    f.ctl(1, submit_req())
    f.take()
    [entry] = f.pending_of("submit")
    f.pending.clear()  # lost: never committed in time
    assert f.node.next_deadline_ms() == f.now + limits.ctl_commit_ms_max
    f.tick(limits.ctl_commit_ms_max - 1)
    f.take()
    assert 1 not in f.replies
    f.tick(1)
    f.take()
    assert f.answer(1).status == 503
    # Committed late after all: no second answer to the first token; a retry with the same
    # request id is answered as the change went.
    f.commit(entry)
    f.take()
    assert f.answer(1).status == 503
    f.ctl(2, submit_req())
    f.take()
    assert f.answer(2).status == 201 and not f.pending_of("submit")


def test_same_rid_twice_one_proposal() -> None:
    """The same request id twice in flight: one proposal, both tokens answered alike."""
    f = Fleet1()
    f.ctl(1, submit_req(rid="r7", job_id=None))
    f.ctl(2, submit_req(rid="r7", job_id=None))
    f.take()
    assert len(f.pending_of("submit")) == 1
    f.settle()
    a, b = f.answer(1), f.answer(2)
    assert a.status == b.status == 201 and a.body["id"] == b.body["id"]
    assert len(f.table.jobs) == 1
    assert len([e for e in f.proposed if e["k"] == "submit"]) == 1


def test_rid_reused_for_another_request_422() -> None:
    """A request id bound to one fingerprint, reused with another while the first is in flight
    or after it applied, is refused with 422 and proposes nothing; the same fingerprint joins
    the first change."""
    f = Fleet1()
    f.ctl(1, {**submit_req(rid="K", job_id="a"), "fp": "a" * 32})
    f.ctl(2, {"op": "cancel", "rid": "K", "fp": "b" * 32, "id": "a"})  # in flight: refused
    f.ctl(3, {**submit_req(rid="K", job_id="a"), "fp": "a" * 32})  # the same request: joins
    f.take()
    assert f.answer(2).status == 422 and "Idempotency-Key" in f.answer(2).body["error"]
    assert len(f.pending_of("submit")) == 1 and not f.pending_of("cancel")
    f.settle()
    assert f.answer(1).status == f.answer(3).status == 201
    before = len(f.proposed)
    f.ctl(4, {"op": "tone", "rid": "K", "fp": "c" * 32, "id": "a", "priority": 7})  # applied: refused
    f.ctl(5, {"op": "cancel", "rid": "K", "fp": "zz"})  # not a fingerprint: 400
    f.take()
    assert f.answer(4).status == 422 and f.answer(5).status == 400
    assert len(f.proposed) == before and f.table.jobs["a"].priority == 0
    assert f.node.counts["ctl_rid_reused"] == 2


def test_idempotent_submit() -> None:
    """submit: the same id and spec again is 200 with the same job; another spec is 409; a
    forgotten id is 409; none of them proposes."""
    f = Fleet1()
    first = submitted(f, rid="a", n=2, priority=3)
    before = len(f.proposed)
    f.ctl(2, submit_req(rid="b", n=2, priority=3))
    f.ctl(3, submit_req(rid="c", n=2, priority=4))
    f.ctl(4, submit_req(rid="d", n=3, priority=3))
    f.take()
    assert f.answer(2).status == 200 and f.answer(2).body["id"] == first["id"]
    assert f.answer(3).status == 409 and f.answer(4).status == 409
    assert len(f.proposed) == before
    assert f.table.jobs["j1"].digest == spec_digest(_normal_spec(priority=3), [None, None])


def _normal_spec(**kw: Any) -> dict:
    from meshjobs.control import parse_submit

    # A request without `by` is the member's own (parse_by): its jobs name "local".
    return {**parse_submit({"argv": ["echo", "hi"], "id": "j1", **kw}), "submitted_by": "local"}


def test_submit_of_forgotten_id_409() -> None:
    """submit: an id that was forgotten is refused 409 at once."""
    f = Fleet1()
    submitted(f)
    for token, req in ((2, {"op": "cancel", "rid": "c", "id": "j1"}),
                       (3, {"op": "forget", "rid": "f", "id": "j1"})):
        f.ctl(token, req)
        f.settle()
    before = len(f.proposed)
    f.ctl(4, submit_req(rid="again"))
    f.take()
    assert f.answer(4).status == 409 and "forgotten" in f.answer(4).body["error"]
    assert len(f.proposed) == before


def test_tone_answered_with_record() -> None:
    """tone: applied, then answered 200 with the changed record."""
    f = Fleet1()
    submitted(f)
    f.ctl(2, {"op": "tone", "rid": "t", "id": "j1", "priority": 9, "hold": True})
    f.settle()
    body = f.answer(2).body
    assert f.answer(2).status == 200 and body["priority"] == 9 and body["state"] == "held"


# --- leases, runs and results -------------------------------------------------------------------


def test_leases_up_to_free_slots_and_runs_after_lease() -> None:
    """Leases are proposed up to the free slots only; Run effects come after the lease is applied."""
    f = Fleet1(slots=2)
    submitted(f, n=5)
    [lease] = f.pending_of("lease")
    assert len(lease["g"]) == 2 and all(g[2:] == ["m1", "b1"] for g in lease["g"])
    assert f.runs == []
    f.take()
    assert f.pending_of("lease") == [lease], "no second lease while the first is in flight"
    f.commit_pending()
    epoch = f.index
    f.take()
    assert [(r.job_id, r.index, r.epoch) for r in f.runs] == [("j1", 0, epoch), ("j1", 1, epoch)]
    assert f.runs[0].argv == ["echo", "hi"] and f.runs[0].stdin is None
    assert not f.pending
    f.tick(limits.proposal_retry_ms * 2)
    f.take()
    assert not f.pending and len(f.runs) == 2, "full slots: nothing more leased, nothing rerun"
    f.end(f.runs[0])
    f.take()
    # The ended item's slot is free at once: the next lease goes with its result, in one entry.
    assert [e["k"] for e in f.pending] == ["lease", "result"]
    assert [e["k"] for e in f.batches[-1]["es"]] == ["lease", "result"]
    [lease2] = f.pending_of("lease")
    assert [g[:2] for g in lease2["g"]] == [["j1", 2]]


def test_item_end_to_job_done_answers_waiter() -> None:
    """ItemEnded -> result proposal -> job done -> the long-poll waiter is answered."""
    f = Fleet1()
    submitted(f, n=1)
    f.ctl(2, {"op": "get", "id": "j1", "wait_ms": 60_000, "items": True})
    f.settle()
    assert 2 not in f.replies
    [run] = f.runs
    f.tick(100)
    f.end(run, "done", 0)
    f.take()
    [res] = f.pending_of("result")
    assert res["r"][0][:4] == ["j1", 0, run.epoch, 2]
    assert 2 not in f.replies
    f.commit_pending()
    f.take()
    ans = f.answer(2)
    assert ans.status == 200 and ans.body["state"] == "done"
    assert ans.body["items"][0]["stdout"] == DIGEST_OUT
    assert f.cuts == [] and not f.pending
    f.ctl(3, {"op": "get", "id": "j1", "wait_ms": 60_000})
    f.take()
    assert f.answer(3).body["state"] == "done", "a finished job is answered at once"


def test_item_that_could_not_start_says_why() -> None:
    """An item whose program could not start ends failed with no rc, signal or outputs; the
    driver's reason goes with its result into the table (cut to item_error_chars_max) and the
    item record shows it as `error`."""
    f = Fleet1()
    submitted(f, n=2)
    f.settle()
    run0, run1 = f.runs
    why = "no such program '/no/such/prog' on member: install it or fix the job's argv"
    f.node.step(ItemEnded(run0.job_id, run0.index, run0.epoch, "failed", None, None, None, None,
                          f.now, f.now, why))
    f.node.step(ItemEnded(run1.job_id, run1.index, run1.epoch, "failed", None, None, None, None,
                          f.now, f.now, "x" * (limits.item_error_chars_max + 50)))
    f.settle()
    f.ctl(9, {"op": "get", "id": "j1", "items": True})
    f.take()
    body = f.answer(9).body
    assert body["state"] == "failed"
    it0, it1 = body["items"]
    assert it0["error"] == why and it0["rc"] is None and it0["stdout"] is None
    assert it1["error"] == "x" * limits.item_error_chars_max


def test_failed_item_retried_after_backoff() -> None:
    """A failed item with retries left is leased and run again once its backoff is over."""
    f = Fleet1(slots=1)
    submitted(f, n=1, retries=1)
    f.settle()
    [run] = f.runs
    f.end(run, "failed", 1)
    f.settle()
    assert f.table.jobs["j1"].st[0] == 0 and len(f.runs) == 1
    assert f.node.next_deadline_ms() == f.now + backoff_ms(1)
    f.tick(backoff_ms(1))
    f.settle()
    assert len(f.runs) == 2 and f.runs[1].epoch > run.epoch
    f.end(f.runs[1], "done", 0)
    f.settle()
    assert f.table.jobs["j1"].state == "done"


def test_waiter_answered_at_deadline() -> None:
    """A long-poll waiter of a job that does not finish is answered at its deadline."""
    f = Fleet1()
    submitted(f, n=1)
    f.settle()
    f.ctl(2, {"op": "get", "id": "j1", "wait_ms": 5000})
    f.take()
    assert f.node.next_deadline_ms() == f.now + 5000
    f.tick(4999)
    f.take()
    assert 2 not in f.replies
    f.tick(1)
    f.take()
    ans = f.answer(2)
    assert ans.status == 200 and ans.body["state"] == "running"


def test_waiter_of_forgotten_job_404() -> None:
    """A long-poll waiter whose job is forgotten meanwhile is answered 404."""
    f = Fleet1()
    submitted(f, n=1)
    f.ctl(2, {"op": "get", "id": "j1", "wait_ms": 60_000})
    f.take()
    # Cancel and forget in one batch, so the waiter sees the job gone rather than ended.
    f.ctl(3, {"op": "cancel", "rid": "c", "id": "j1"})
    f.take()
    f.commit_pending()
    f.ctl(4, {"op": "forget", "rid": "f", "id": "j1"})
    f.commit({"k": "forget", "rid": "f", "t": f.now, "id": "j1"})
    f.take()
    assert f.answer(2).status == 404
    assert f.answer(4).status == 200


def test_lease_of_other_boot_revoked_then_released() -> None:
    """A lease naming an earlier boot of this member is revoked, then leased under a new epoch."""
    f = Fleet1()
    f.commit({"k": "submit", "t": f.now, "id": "j1",
              "spec": {k: v for k, v in _normal_spec().items() if k != "id"},
              "dg": b"x", "items": [None]})
    old = f.commit({"k": "lease", "t": f.now, "g": [["j1", 0, "m1", "b0"]]})
    f.take()
    assert f.runs == [], "a lease of an earlier boot is never run"
    [rev] = f.pending_of("revoke")
    assert rev["l"] == [["j1", 0, old]]
    assert not f.pending_of("lease")
    f.commit_pending()
    f.take()
    [lease] = f.pending_of("lease")
    assert lease["g"] == [["j1", 0, "m1", "b1"]]
    f.commit_pending()
    f.take()
    [run] = f.runs
    assert run.epoch > old and (run.job_id, run.index) == ("j1", 0)


def test_cancel_running_job_cuts() -> None:
    """cancel of a running job: a Cut for each running item, and a 200 cancelled record."""
    f = Fleet1(slots=2)
    submitted(f, n=3)
    f.settle()
    assert len(f.runs) == 2
    f.ctl(2, {"op": "cancel", "rid": "c", "id": "j1"})
    f.settle()
    assert sorted((c.job_id, c.index, c.epoch) for c in f.cuts) == \
        sorted((r.job_id, r.index, r.epoch) for r in f.runs)
    assert f.answer(2).status == 200 and f.answer(2).body["state"] == "cancelled"
    # The cut items' ends (as the driver reports them) propose no result.
    for run in f.runs:
        f.node.step(ItemEnded(run.job_id, run.index, run.epoch, "cut", None, 15, None, None,
                              f.now, f.now))
    f.take()
    assert not f.pending_of("result")


def test_cancel_finished_job_409() -> None:
    """cancel of a job that already ended is answered with the table's 409."""
    f = Fleet1()
    submitted(f)
    f.ctl(2, {"op": "cancel", "rid": "c1", "id": "j1"})
    f.settle()
    f.ctl(3, {"op": "cancel", "rid": "c2", "id": "j1"})
    f.settle()
    assert f.answer(3).status == 409


def test_next_deadline_never_in_the_past() -> None:
    """next_deadline_ms names a time still to come once the node's effects are taken (a past
    deadline makes the jobs thread wake at once, again and again)."""
    f = Fleet1(slots=1)
    submitted(f, n=2, retries=1)
    f.settle()
    [run] = f.runs
    f.end(run, "failed", 1)
    f.settle()  # item 0 backs off; item 1 takes the only slot
    assert len(f.runs) == 2
    f.tick(backoff_ms(1) + 1000)
    f.settle()
    deadline = f.node.next_deadline_ms()
    assert deadline is None or deadline > f.now


def test_blob_pressure_stops_leases_until_it_drains() -> None:
    """Backpressure: while the blob store holds too many payload bytes (Pressure on) the member
    takes no new leases, though slots are free and items pending; once it drains, it does."""
    f = Fleet1(slots=2)
    f.node.step(Pressure(True))
    submitted(f, n=3)
    f.settle()
    assert not [e for e in f.proposed if e["k"] == "lease"]
    assert f.node.fleet()["members"][0]["blob_pressure"] is True
    f.node.step(Pressure(False))
    f.settle()
    leases = [g for e in f.proposed if e["k"] == "lease" for g in e["g"]]
    assert len(leases) == 2  # the two free slots


def test_changes_arriving_together_share_one_entry() -> None:
    """Changes that arrive in one round are proposed as one batch entry (one Raft round and one
    fsync for all), and each is answered once the batch is applied."""
    f = Fleet1()
    f.ctl(1, submit_req(rid="a", job_id="ja"))
    f.ctl(2, submit_req(rid="b", job_id="jb"))
    f.ctl(3, submit_req(rid="c", job_id="jc"))
    f.take()
    [batch] = f.batches
    assert [e["k"] for e in batch["es"]] == ["submit", "submit", "submit", "lease"]
    assert [e["id"] for e in batch["es"][:3]] == ["ja", "jb", "jc"]
    assert [g[:2] for g in batch["es"][3]["g"]] == [["ja", 0], ["jb", 0]]
    f.settle()
    assert [f.answer(t).status for t in (1, 2, 3)] == [201, 201, 201]
    assert set(f.table.jobs) == {"ja", "jb", "jc"}


# --- leasing ahead ----------------------------------------------------------------------------


def _leased_to_me(f: Fleet1) -> int:
    return sum(1 for m, _b in f.table.leased.values() if m == "m1")


def test_short_items_are_leased_ahead_and_run_slots_at_a_time() -> None:
    """Once a pool's items are known to be short, a member is leased more items than it has
    slots; it runs only its slots at a time, and starts the next leased item the moment one
    ends, with no Raft round in between."""
    f = Fleet1(slots=1)
    submitted(f, n=200)
    f.settle()
    assert _leased_to_me(f) == 1, "no history of run times yet: nothing leased ahead"
    [run] = f.runs
    f.end(run, ran_ms=5)
    f.settle()
    ahead = -(-limits.lease_ahead_ms // 5)
    assert f.node.leadership.ahead("default") == ahead
    assert _leased_to_me(f) == 1 + ahead
    assert len(f.runs) == 2 and f.node.metrics()["items_running"] == 1, "one slot: one runs"
    # The next run starts as the current one ends, in the same round that proposes its result.
    f.end(f.runs[-1], ran_ms=5)
    f.take()
    assert len(f.runs) == 3 and f.runs[-1].index == 2
    assert [e["k"] for e in f.pending] == ["lease", "result"]


def test_long_items_are_not_leased_ahead() -> None:
    """Items that run longer than lease_ahead_run_ms_max are leased to free slots only, so none
    waits behind a long item on a busy member while another member could take it."""
    f = Fleet1(slots=2)
    submitted(f, n=20)
    f.settle()
    for _ in range(3):
        f.end(f.runs[-1], ran_ms=limits.lease_ahead_run_ms_max + 1)
        f.settle()
    assert f.node.leadership.ahead("default") == 0
    assert _leased_to_me(f) == 2 and f.node.metrics()["items_running"] == 2


def test_result_waiting_for_copies_keeps_its_slot() -> None:
    """An ended item frees its slot for a new lease only once its result may be proposed: one
    whose outputs are still being copied holds it, so a member whose copies fail takes no more
    work than its slots."""
    f = Fleet1(slots=1, voters=("m1", "m2"), blob_copies=2)
    f.node.step(PeerLink("m2", True))
    submitted(f, n=5)
    f.settle()
    [run] = f.runs
    f.end(run)
    effects = f.take()
    assert any(isinstance(e, CopyBlobs) and e.to == "m2" for e in effects)
    assert not f.pending, "no result and no new lease while the outputs are not copied"
    f.node.step(BlobsCopied("m2", (DIGEST_OUT,)))
    f.take()
    assert [e["k"] for e in f.pending] == ["lease", "result"]


def test_one_entry_per_round_whatever_the_leader_proposes() -> None:
    """Changes, leases and results of one round are one batch entry, the changes first."""
    f = Fleet1(slots=1)
    submitted(f, token=1, n=2)
    f.settle()
    f.end(f.runs[-1])
    f.ctl(2, submit_req(rid="r2", job_id="j2"))
    effects = f.take()
    props = [e for e in effects if isinstance(e, Propose)]
    assert len(props) == 1 and props[0].entry["k"] == "batch"
    assert [e["k"] for e in props[0].entry["es"]] == ["submit", "lease", "result"]


def test_changes_wait_while_entries_are_in_flight(monkeypatch: pytest.MonkeyPatch) -> None:
    """While changes_in_flight_max entries are in flight, new changes wait and go together in
    the next one once one is applied; an entry lost for proposal_wait_ms holds nothing back
    any more."""
    monkeypatch.setattr(limits, "changes_in_flight_max", 1)
    f = Fleet1(slots=0)
    f.ctl(1, submit_req(rid="a", job_id="ja"))
    f.take()
    assert len(f.batches) == 1
    f.ctl(2, submit_req(rid="b", job_id="jb"))
    f.ctl(3, submit_req(rid="c", job_id="jc"))
    f.tick(1)
    f.take()
    assert len(f.batches) == 1, "nothing more proposed while the first entry is in flight"
    f.commit_pending()
    f.take()
    assert len(f.batches) == 2 and [e["id"] for e in f.batches[1]["es"]] == ["jb", "jc"]
    assert f.answer(1).status == 201
    f.pending.clear()  # the second entry is lost
    f.ctl(4, submit_req(rid="d", job_id="jd"))
    f.tick(limits.proposal_wait_ms - 1)
    f.take()
    assert len(f.batches) == 2
    assert f.node.next_deadline_ms() == f.now + 1
    f.tick(1)
    f.take()
    assert len(f.batches) == 3 and [e["id"] for e in f.batches[2]["es"]] == ["jd"]


def test_catch_up_ring_only_with_workers_and_bounded_by_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """The recent entries kept to catch worker members up are kept only while the leader knows
    of workers, and are bounded by item rows as well as by entries (a decoded entry of
    thousands of rows is large)."""
    monkeypatch.setattr(limits, "state_ring_rows_max", 50)
    f = Fleet1(slots=0)
    submitted(f, token=1, job_id="ja", rid="a", n=10)
    assert not f.node.ring.entries, "no workers: no ring"
    f.node.step(FrameIn("w1", "F_JOB_HAVE", {"boot": "wb", "role": "worker", "pos": 0,
                                             "pools": {"default": 0}}))
    for k in range(8):
        submitted(f, token=10 + k, job_id=f"j{k}", rid=f"r{k}", n=10)
    ring = f.node.ring.entries
    assert ring and f.node.ring.rows <= 50
    assert sum(r[3] for r in ring) == f.node.ring.rows
    assert all(ring[k][1] == ring[k + 1][0] for k in range(len(ring) - 1)), "entries follow"


def test_leader_duties_wait_for_the_entry_in_flight_changes_do_not() -> None:
    """The leader's own leases and results wait while its entry is in flight (they go together
    in the next one); a change a client waits for goes at once, up to changes_in_flight_max."""
    f = Fleet1(slots=1)
    submitted(f, token=1, n=3)
    f.settle()
    [run] = f.runs
    f.ctl(2, submit_req(rid="r2", job_id="j2"))
    f.take()
    assert [e["k"] for e in f.batches[-1]["es"]] == ["submit"]
    f.end(run)
    f.take()
    assert [e["k"] for e in f.batches[-1]["es"]] == ["submit"], "result waits for the entry"
    f.commit_pending()
    f.take()
    assert [e["k"] for e in f.batches[-1]["es"]] == ["lease", "result"]


# --- a full disk --------------------------------------------------------------------------------


def test_full_disk_is_read_only_until_space_is_back() -> None:
    """A full disk (DiskFull on): the member takes no new leases and refuses submits with 507
    naming the disk; reads are answered; health says read_only and not ok, /fleet says
    disk_full. Once space is back (DiskFull off) it leases and takes submits again."""
    f = Fleet1(slots=2)
    submitted(f, token=1, n=3, job_id="j1", rid="r1")
    f.pending.clear()  # the leases proposed with the submit are lost
    f.node.step(DiskFull(True, 1234))
    n0 = len(f.proposed)
    for _ in range(5):  # long past the time a lost lease is proposed again
        f.tick(limits.proposal_wait_ms)
        f.settle()
    assert not [e for e in f.proposed[n0:] if e["k"] == "lease"]
    f.ctl(2, submit_req(rid="r2", job_id="j2"))
    f.take()
    refused = f.answer(2)
    assert refused.status == 507 and "disk" in refused.body["error"]
    assert "1234 bytes free" in refused.body["error"] and "free space" in refused.body["error"]
    assert "j2" not in f.table.jobs and not f.pending_of("submit")
    f.ctl(3, {"op": "get", "id": "j1"})
    f.ctl(4, {"op": "health"})
    f.ctl(5, {"op": "fleet"})
    f.take()
    assert f.answer(3).status == 200
    health = f.answer(4).body
    assert (health["ok"], health["state"], health["disk_full"], health["disk_free_bytes"]) == (
        False, "read_only", True, 1234)
    assert f.answer(5).body["members"][0]["disk_full"] is True
    assert f.node.metrics()["disk_full"] == 1
    f.node.step(DiskFull(False, 10 << 30))
    f.tick(1)
    f.settle()
    assert len([g for e in f.proposed[n0:] if e["k"] == "lease" for g in e["g"]]) == 2
    f.ctl(6, submit_req(rid="r6", job_id="j6"))
    f.settle()
    assert f.answer(6).status == 201
    f.ctl(7, {"op": "health"})
    f.take()
    assert (f.answer(7).body["ok"], f.answer(7).body["state"]) == (True, "ok")


def test_leader_leases_nothing_to_a_member_whose_disk_is_full() -> None:
    """A member that reports a full disk (F_JOB_HAVE disk_full) is given no leases, though it
    reports free slots; /fleet shows its disk_full."""
    f = Fleet1(slots=0)
    have = {"boot": "wb", "role": "worker", "pos": 0, "pools": {"default": 4}, "disk_full": True}
    f.node.step(FrameIn("w1", "F_JOB_HAVE", have))
    submitted(f, token=1, n=2)
    f.settle()
    assert not [e for e in f.proposed if e["k"] == "lease"]
    [w1] = [m for m in f.node.fleet()["members"] if m["name"] == "w1"]
    assert w1["disk_full"] is True
    f.node.step(FrameIn("w1", "F_JOB_HAVE", {**have, "disk_full": False}))
    f.settle()
    assert {g[2] for e in f.proposed if e["k"] == "lease" for g in e["g"]} == {"w1"}


def test_follower_with_a_full_disk_reports_it_and_offers_no_slots() -> None:
    """A member that does not lead reports disk_full and no pools to the leader."""
    f = Fleet1(slots=2)
    f.node.step(View(term=2, leader="m2", is_leader=False, ready=False))
    f.node.step(DiskFull(True, 0))
    f.tick(1_000)
    haves = [e for e in f.take() if isinstance(e, Send) and e.ftype == "F_JOB_HAVE"]
    assert haves and haves[-1].body["disk_full"] is True and haves[-1].body["pools"] == {}


# --- blob copies ------------------------------------------------------------------------------


def test_inputs_copies_asked_with_a_spare_at_once() -> None:
    """A submit's inputs are asked of blob_copies - 1 members and copy_spares more in the same
    round, and the first confirmation (blob_copies - 1 = 1) lets the submit go on: a member
    that never answers (its link still looks up) does not hold it back."""
    f = Fleet1(voters=("m1", "m2", "m3"), blob_copies=2)
    for peer in ("m2", "m3"):
        f.node.step(PeerLink(peer, True))
    req = submit_req(rid="in1")
    req["items"] = ["cd" * 32]
    f.ctl(1, req)
    effects = f.take()
    asked = sorted(e.to for e in effects if isinstance(e, CopyBlobs))
    assert asked == ["m2", "m3"], "both candidates asked at once"
    assert not f.pending_of("submit")
    f.tick(30)
    f.node.step(BlobsCopied("m3", ("cd" * 32,)))  # m2 (first by name) stays silent
    f.take()
    assert len(f.pending_of("submit")) == 1, "the first confirmation is enough"
    f.commit_pending()
    f.take()
    assert f.answer(1).status == 201


def test_output_copies_asked_with_a_spare_and_reasked_later() -> None:
    """A result's outputs: the member needed and a spare are asked at once; one that stays
    silent is asked again after proposal_retry_ms, never sooner; the first confirmation
    releases the result."""
    f = Fleet1(slots=1, voters=("m1", "m2", "m3"), blob_copies=2)
    for peer in ("m2", "m3"):
        f.node.step(PeerLink(peer, True))
    submitted(f, n=1)
    f.settle()
    [run] = f.runs
    f.end(run)
    assert sorted(e.to for e in f.take() if isinstance(e, CopyBlobs)) == ["m2", "m3"]
    f.tick(limits.proposal_retry_ms - 1)
    assert not [e for e in f.take() if isinstance(e, CopyBlobs)]
    f.tick(1)
    assert sorted(e.to for e in f.take() if isinstance(e, CopyBlobs)) == ["m2", "m3"]
    f.node.step(BlobsCopied("m2", (DIGEST_OUT,)))
    f.take()
    assert [e["k"] for e in f.pending] == ["result"]


# --- a worker's freshness ---------------------------------------------------------------------


def _worker(now: int) -> JobNode:
    cfg = NodeConfig(member="w1", boot="wb", pools={"default": Pool("default", slots=1)},
                     role="worker", voters=("v1", "v2", "v3"))
    node = JobNode(JobTable(), cfg, random.Random(3))
    node.step(Tick(now))
    node.step(View())
    node.take()
    return node


def test_worker_fresh_only_from_the_leader_itself() -> None:
    """A worker's table is fresh only while frames from the member it believes leads (at the
    current term) arrive: a follower's hint of who leads, however often it comes, does not make
    it fresh, nor keep it fresh once the leader has gone quiet."""
    now = 1_700_000_000_000
    node = _worker(now)
    # A follower's hint names the leader: the worker reports there, but is not fresh.
    node.step(FrameIn("v2", "F_JOB_STATE", {"term": 3, "leader": "v1", "voters": ["v1", "v2", "v3"]}))
    effects = node.take()
    h = node.health()
    assert h["leader"] == "v1" and not h["fresh"] and not h["ready"]
    assert any(isinstance(e, Send) and e.to == "v1" and e.ftype == "F_JOB_HAVE"
               for e in effects + (node.step(Tick(now + limits.have_ms)) or node.take()))
    # The leader's own frame: fresh.
    node.step(FrameIn("v1", "F_JOB_STATE", {"term": 3, "leader": "v1", "prev": 0, "entries": []}))
    node.take()
    assert node.health()["fresh"] and node.health()["ready"]
    # Cut off from the leader alone: only the follower's hints come. Not fresh after dead_ms.
    t = now + limits.have_ms
    while t < now + 2 * limits.member_dead_ms:
        t += limits.have_ms
        node.step(Tick(t))
        node.step(FrameIn("v2", "F_JOB_STATE", {"term": 3, "leader": "v1"}))
        node.take()
    h = node.health()
    assert not h["fresh"], h
    assert node.counts.get("state_hints", 0) > 0


def test_worker_ignores_a_hint_that_contradicts_its_leader() -> None:
    """A hint at the worker's own term never replaces the leader it hears from itself."""
    now = 1_700_000_000_000
    node = _worker(now)
    node.step(FrameIn("v1", "F_JOB_STATE", {"term": 4, "leader": "v1", "prev": 0, "entries": []}))
    node.step(FrameIn("v2", "F_JOB_STATE", {"term": 4, "leader": "v3"}))
    node.take()
    h = node.health()
    assert h["leader"] == "v1" and h["fresh"]


def _submit_entry(job_id: str) -> dict:
    return {"k": "submit", "t": T0, "id": job_id, "spec": spec(argv=["true"]),
            "dg": b"dg-" + job_id.encode(), "items": [None]}


def _list(node: JobNode, token: int) -> Answer:
    node.step(Ctl(token, {"op": "list", "limit": 10}))
    [answer] = [e.answer for e in node.take() if isinstance(e, Reply) and e.token == token]
    return answer


def _cut_off(node: JobNode, now: int) -> int:
    """Let the worker hear nothing for twice dead_ms, in steps of have_ms; the time then."""
    t = now
    while t < now + 2 * limits.member_dead_ms:
        t += limits.have_ms
        node.step(Tick(t))
        node.take()
    return t


def test_worker_cut_off_answers_its_first_read_from_its_table() -> None:
    """Issue 26 point 2: a worker that holds the leader's table and is then cut off from every
    voter answers a job list from that table (200), saying it is not fresh, even when that list
    is the first it is asked for: it has not just started. It was answered 503 ("has just
    started"), as long as no frame of the leader came."""
    now = 1_700_000_000_000
    node = _worker(now)
    node.step(FrameIn("v1", "F_JOB_STATE", {"term": 3, "leader": "v1", "prev": 0,
                                            "entries": [[1, _submit_entry("j1")]]}))
    node.take()
    assert node.health()["fresh"]
    t = _cut_off(node, now)
    assert node.health()["leader"] is None and not node.health()["fresh"]
    answer = _list(node, 7)
    assert answer.status == 200, answer
    assert [j["id"] for j in answer.body["jobs"]] == ["j1"] and answer.body["fresh"] is False
    # A voter tells it of a new leader (an election while it was cut off): still its table.
    node.step(FrameIn("v3", "F_JOB_STATE", {"term": 4, "leader": "v2"}))
    node.take()
    assert node.health()["leader"] == "v2"
    answer = _list(node, 8)
    assert answer.status == 200 and answer.body["fresh"] is False, answer
    # The new leader's own frame, in step with its table: fresh again.
    node.step(Tick(t + 1))
    node.step(FrameIn("v2", "F_JOB_STATE", {"term": 4, "leader": "v2", "prev": 1,
                                            "entries": [[2, _submit_entry("j2")]]}))
    node.take()
    answer = _list(node, 9)
    assert answer.body["fresh"] is True and [j["id"] for j in answer.body["jobs"]] == ["j2", "j1"]


def test_worker_shown_entries_it_lacks_is_not_fresh_until_they_come() -> None:
    """A frame of the leader that starts past the worker's table (frames lost on a link that
    went silent, say) tells it it is behind: it answers from its table, not fresh, until the
    missing entries come. It was fresh as soon as any frame of the leader came."""
    now = 1_700_000_000_000
    node = _worker(now)
    node.step(FrameIn("v1", "F_JOB_STATE", {"term": 3, "leader": "v1", "prev": 0,
                                            "entries": [[1, _submit_entry("j1")]]}))
    node.take()
    node.step(FrameIn("v1", "F_JOB_STATE", {"term": 3, "leader": "v1", "prev": 3,
                                            "entries": [[4, _submit_entry("j3")]]}))
    effects = node.take()
    assert node.counts.get("state_gaps") == 1
    assert any(isinstance(e, Send) and e.to == "v1" and e.ftype == "F_JOB_HAVE"
               for e in effects + (node.step(Tick(now + 1)) or node.take()))
    assert not node.health()["fresh"]
    answer = _list(node, 5)
    assert answer.status == 200 and answer.body["fresh"] is False, answer
    # A keep-alive that ends where its table is does not undo what the gap showed.
    node.step(FrameIn("v1", "F_JOB_STATE", {"term": 3, "leader": "v1", "prev": 1,
                                            "entries": []}))
    node.take()
    assert not node.health()["fresh"]
    node.step(FrameIn("v1", "F_JOB_STATE", {"term": 3, "leader": "v1", "prev": 1, "entries": [
        [2, _submit_entry("j2")], [4, _submit_entry("j3")]]}))
    node.take()
    assert node.health()["fresh"] and _list(node, 6).body["fresh"] is True


def test_worker_that_has_not_caught_up_since_it_started_cannot_list_yet() -> None:
    """A worker starts with an empty table: until the leader's frames have put its table in
    step once, an empty list would deny jobs that exist; it answers 503 (try again), also when
    the first frame it gets shows it entries it lacks."""
    now = 1_700_000_000_000
    node = _worker(now)
    assert _list(node, 1).status == 503
    node.step(FrameIn("v1", "F_JOB_STATE", {"term": 3, "leader": "v1", "prev": 4,
                                            "entries": [[5, _submit_entry("j1")]]}))
    node.take()
    answer = _list(node, 2)
    assert answer.status == 503 and "has just started" in answer.body["error"], answer
    node.step(FrameIn("v1", "F_JOB_STATE", {"term": 3, "leader": "v1", "prev": 0,
                                            "entries": [[5, _submit_entry("j1")]]}))
    node.take()
    answer = _list(node, 3)
    assert answer.status == 200 and answer.body["fresh"] is True, answer


# --- copies lost with a member ----------------------------------------------------------------


def _have(f: Fleet1, peer: str) -> None:
    f.node.step(FrameIn(peer, "F_JOB_HAVE", {"boot": peer + "b", "role": "voter", "pos": 0,
                                             "pools": {}}))


def _live_for(f: Fleet1, ms: int, reporting: tuple[str, ...]) -> list[Any]:
    """Let `ms` pass in steps of have_ms, the `reporting` members reporting each time."""
    effects: list[Any] = []
    for _ in range(ms // limits.have_ms + 1):
        f.tick(limits.have_ms)
        for peer in reporting:
            _have(f, peer)
        effects += f.take()
        f.commit_pending()
    return effects


def test_result_names_its_copies_and_a_lost_holder_is_replaced() -> None:
    """A result row names the members that confirmed copies of its outputs, and the table keeps
    them (the item record's `copies`). When one of them is lost (not heard from for lost_ms),
    the leader, holding the outputs itself, copies them to another member, once."""
    f = Fleet1(slots=1, voters=("m1", "m2", "m3"), blob_copies=2, lost_ms=20_000)
    for peer in ("m2", "m3"):
        f.node.step(PeerLink(peer, True))
        _have(f, peer)
    submitted(f, n=1)
    f.settle()
    [run] = f.runs
    f.end(run)
    f.take()
    f.node.step(BlobsCopied("m3", (DIGEST_OUT,)))
    f.settle()
    [res] = [e for e in f.proposed if e["k"] == "result"]
    assert res["r"][0][10:] == [None, ["m3"]]
    assert f.table.item_record(f.table.jobs["j1"], 0)["copies"] == ["m3"]
    # m3 goes quiet; m2 keeps reporting. Nothing happens before lost_ms.
    effects = _live_for(f, 19_000, ("m2",))
    assert not [e for e in effects if isinstance(e, CopyBlobs | FetchBlobs)]
    effects = _live_for(f, 2_000, ("m2",))
    assert [(e.to, e.owner, e.digests) for e in effects if isinstance(e, CopyBlobs)] == [
        ("m2", "j1", (DIGEST_OUT,))]
    f.node.step(BlobsCopied("m2", (DIGEST_OUT,)))
    effects = _live_for(f, 5_000, ("m2",))
    assert not [e for e in effects if isinstance(e, CopyBlobs | FetchBlobs)], "asked once"
    assert f.node.counts["recopies_done"] == 1


def test_lost_holder_of_anothers_outputs_makes_the_leader_fetch_them() -> None:
    """Outputs the leader does not hold, whose copy was on a member now lost: the leader fetches
    them from the member that ran the item (FetchBlobs), becoming the second holder."""
    f = Fleet1(slots=0, voters=("m1", "m2", "m3"), blob_copies=2, lost_ms=20_000)
    for peer in ("m2", "m3"):
        f.node.step(PeerLink(peer, True))
    f.node.step(FrameIn("m2", "F_JOB_HAVE", {"boot": "m2b", "role": "voter", "pos": 0,
                                             "pools": {"default": 1}}))
    f.node.step(FrameIn("m3", "F_JOB_HAVE", {"boot": "m3b", "role": "voter", "pos": 0,
                                             "pools": {}}))
    submitted(f, n=1)
    f.settle()
    [(jid, i, epoch)] = [(j, i, f.table.jobs[j].epoch[i]) for (j, i) in f.table.leased]
    row = [jid, i, epoch, 2, 0, None, bytes.fromhex(DIGEST_OUT), None, f.now - 5, f.now,
           None, ["m3"]]
    f.node.step(FrameIn("m2", "F_RESULT", {"r": [row]}))
    f.settle()
    assert f.table.jobs["j1"].state == "done"
    assert f.table.item_record(f.table.jobs["j1"], 0)["copies"] == ["m3"]
    effects = _live_for(f, 21_000, ("m2",))
    assert [(e.owner, e.digests) for e in effects if isinstance(e, FetchBlobs)] == [
        ("j1", (DIGEST_OUT,))]
    assert not [e for e in effects if isinstance(e, CopyBlobs)]
    # The fetch is not confirmed (no holder answered then): it is asked again, not given up.
    effects = _live_for(f, limits.recopy_retry_ms + limits.have_ms, ("m2",))
    assert [(e.owner, e.digests) for e in effects if isinstance(e, FetchBlobs)] == [
        ("j1", (DIGEST_OUT,))]
    assert f.node.counts["recopies_retried"] == 1


def test_copies_asked_of_no_more_than_needed_plus_spares() -> None:
    """In a larger fleet not every member is asked for every copy: blob_copies - 1 plus
    copy_spares at a time, spread over the members by owner; when one's link goes down,
    another is asked in its place at once."""
    others = ("m2", "m3", "m4", "m5", "m6")
    f = Fleet1(voters=("m1", *others), blob_copies=2)
    for peer in others:
        f.node.step(PeerLink(peer, True))
    firsts = set()
    for k in range(6):
        req = submit_req(rid=f"in{k}", job_id=f"j{k}")
        req["items"] = [f"{k:02x}" * 32]
        f.ctl(k + 1, req)
        asked = [e.to for e in f.take() if isinstance(e, CopyBlobs)]
        assert len(asked) == 1 + limits.copy_spares, asked
        firsts.add(asked[0])
    assert len(firsts) > 1, "copies spread over the members"
    f.node.step(PeerLink(asked[0], False))
    again = [e.to for e in f.take() if isinstance(e, CopyBlobs) and e.owner == "j5"]
    assert len(again) == 1 and again[0] not in asked, again


# --- one key, two requests --------------------------------------------------------------------

FP_CANCEL, FP_SUBMIT = "c" * 32, "5" * 32


def test_change_waiting_under_a_key_another_request_committed_is_refused() -> None:
    """A leader whose table lags the log takes a cancel under a key (request id) that a submit
    already used: when the submit's entry is applied, the waiting cancel is refused (422), never
    answered with the submit's outcome (the simulator found this)."""
    f = Fleet1()
    f.ctl(1, {"op": "cancel", "rid": "k1", "fp": FP_CANCEL, "id": "j1"})
    f.take()
    assert f.pending_of("cancel")
    f.pending.clear()
    # The submit under k1, committed before the cancel reached the log (its entry arrives now).
    entry = {"k": "submit", "rid": "k1", "fp": FP_SUBMIT, "t": f.now, "id": "j1",
             "spec": _normal_spec(), "dg": b"d", "items": [None]}
    f.commit(entry)
    f.take()
    ans = f.answer(1)
    assert ans.status == 422, ans


def test_late_reply_to_an_earlier_request_under_the_key_is_ignored() -> None:
    """A member forwarded a change; a late F_CTL_REPLY for another request under the same key
    (its fingerprint differs) does not answer it."""
    f = Fleet1()
    f.node.step(View(term=2, leader="m2", is_leader=False, ready=False))
    f.ctl(1, {"op": "cancel", "rid": "k1", "fp": FP_CANCEL, "id": "j1"})
    f.take()
    f.node.step(FrameIn("m2", "F_CTL_REPLY", {"rid": "k1", "fp": FP_SUBMIT, "status": 201,
                                              "body": {"id": "j1"}, "index": 0}))
    f.take()
    assert 1 not in f.replies
    assert f.node.counts["ctl_replies_of_another_request"] == 1
    f.node.step(FrameIn("m2", "F_CTL_REPLY", {"rid": "k1", "fp": FP_CANCEL, "status": 200,
                                              "body": {"id": "j1"}, "index": 0}))
    f.take()
    assert f.answer(1).status == 200


# --- the fleet view from any member -----------------------------------------------------------


def test_fleet_view_is_asked_of_the_leader() -> None:
    """Only the leader hears every member's reports: a member that does not lead asks it for
    the fleet view (F_CTL) and answers with what the leader says; unanswered within
    fleet_ask_ms, or with no leader known, it answers its own view (marked partial when it
    asked in vain)."""
    f = Fleet1(voters=("m1", "m2", "m3"))
    f.node.step(View(term=3, leader="m2", is_leader=False, ready=True))
    f.ctl(1, {"op": "fleet"})
    [ask] = [e for e in f.take() if isinstance(e, Send) and e.ftype == "F_CTL"]
    assert ask.to == "m2" and ask.body["req"] == {"op": "fleet"} and ask.body["rid"].startswith("#")
    assert 1 not in f.replies
    view = {"term": 3, "leader": "m2", "members": [{"name": n, "role": "x", "alive": True}
                                                   for n in ("m1", "m2", "m3", "w1")]}
    f.node.step(FrameIn("m2", "F_CTL_REPLY", {"rid": ask.body["rid"], "fp": None, "status": 200,
                                              "body": view, "index": 0}))
    f.take()
    assert f.answer(1) == Answer(200, view)
    # The leader does not answer: after fleet_ask_ms, this member's own view, said partial.
    f.ctl(2, {"op": "fleet"})
    f.take()
    f.tick(limits.fleet_ask_ms + 1)
    f.take()
    own = f.answer(2)
    assert own.status == 200 and own.body["partial"] is True
    assert {m["name"] for m in own.body["members"]} >= {"m1", "m2", "m3"}
    # No leader known: its own view at once, asking nobody.
    f.node.step(View(term=4, leader=None, is_leader=False, ready=False))
    f.ctl(3, {"op": "fleet"})
    effects = f.take()
    assert not [e for e in effects if isinstance(e, Send) and e.ftype == "F_CTL"]
    assert f.answer(3).status == 200 and "partial" not in f.answer(3).body


def test_leader_answers_a_forwarded_fleet_ask_with_its_view() -> None:
    """At the leader, a fleet view asked by another member (F_CTL) is answered with the
    leader's own view in an F_CTL_REPLY, never asked further."""
    f = Fleet1(voters=("m1", "m2", "m3"))
    f.node.step(FrameIn("m2", "F_CTL", {"rid": "#fleet.m2.1", "req": {"op": "fleet"}}))
    [reply] = [e for e in f.take() if isinstance(e, Send) and e.ftype == "F_CTL_REPLY"]
    assert reply.to == "m2" and reply.body["rid"] == "#fleet.m2.1" and reply.body["status"] == 200
    assert reply.body["body"]["leader"] == "m1" and "partial" not in reply.body["body"]


def test_no_known_holder_left_fetch_then_copy_on() -> None:
    """Every holder the table names is lost: the leader fetches the outputs (a spare may hold
    them), and once it holds them it copies them on, so that blob_copies members hold them
    again, not just the leader."""
    f = Fleet1(slots=0, voters=("m1", "m2", "m3", "m4", "m5"), blob_copies=2, lost_ms=20_000)
    for peer in ("m2", "m3", "m4"):
        f.node.step(PeerLink(peer, True))
        _have(f, peer)
    f.node.step(FrameIn("m2", "F_JOB_HAVE", {"boot": "m2b", "role": "voter", "pos": 0,
                                             "pools": {"default": 1}}))
    submitted(f, n=1)
    f.settle()
    [(jid, i, epoch)] = [(j, i, f.table.jobs[j].epoch[i]) for (j, i) in f.table.leased]
    row = [jid, i, epoch, 2, 0, None, bytes.fromhex(DIGEST_OUT), None, f.now - 5, f.now,
           None, ["m3"]]
    f.node.step(FrameIn("m2", "F_RESULT", {"r": [row]}))
    f.settle()
    assert f.table.item_record(f.table.jobs["j1"], 0)["copies"] == ["m3"]
    effects = _live_for(f, 21_000, ("m4",))  # m2 (ran it) and m3 (its copy) are lost
    assert [(e.owner, e.digests) for e in effects if isinstance(e, FetchBlobs)] == [
        ("j1", (DIGEST_OUT,))]
    assert f.node.counts["recopies_no_known_holder"] == 1
    f.node.step(BlobsCopied("m1", (DIGEST_OUT,)))  # the fetch found a copy: m1 holds it now
    effects = f.take()
    assert [(e.to, e.digests) for e in effects if isinstance(e, CopyBlobs)] == [
        ("m4", (DIGEST_OUT,))]
    assert "recopies_done" not in f.node.counts
    f.node.step(BlobsCopied("m4", (DIGEST_OUT,)))
    f.take()
    assert f.node.counts["recopies_done"] == 1 and not f.node.recopies.asked


def test_a_follower_asks_the_leader_before_no_such_job() -> None:
    """A follower learns of a commit a heartbeat after the leader answered the submit: for a job
    it does not know, it asks the leader (F_CTL) and says what the leader says, once its own
    table has the job (the record's version is the index it waits for); the leader's 404 is
    passed on; unanswered within fleet_ask_ms, or with no leader known, its own 404."""
    f = Fleet1(voters=("m1", "m2", "m3"))
    f.node.step(View(term=3, leader="m2", is_leader=False, ready=True))
    f.ctl(1, {"op": "get", "id": "j1"})
    [ask] = [e for e in f.take() if isinstance(e, Send) and e.ftype == "F_CTL"]
    assert ask.to == "m2" and ask.body["req"]["op"] == "get" and ask.body["rid"].startswith("#")
    assert 1 not in f.replies
    rec = {"id": "j1", "state": "queued", "version": 1}
    f.node.step(FrameIn("m2", "F_CTL_REPLY", {"rid": ask.body["rid"], "fp": None, "status": 200,
                                              "body": rec, "index": 1}))
    f.take()
    assert 1 not in f.replies  # parked until this member's table has entry 1
    lead = Fleet1(voters=("m1", "m2", "m3"))  # the submit as the leader made it
    lead.ctl(9, submit_req())
    lead.take()
    [entry] = lead.pending_of("submit")
    f.commit(entry)
    f.take()
    assert f.answer(1) == Answer(200, rec)
    f.ctl(2, {"op": "get", "id": "nope"})
    [ask] = [e for e in f.take() if isinstance(e, Send) and e.ftype == "F_CTL"]
    f.node.step(FrameIn("m2", "F_CTL_REPLY", {"rid": ask.body["rid"], "fp": None, "status": 404,
                                              "body": {"error": "no job nope"}, "index": 0}))
    f.take()
    assert f.answer(2).status == 404
    f.ctl(3, {"op": "get", "id": "gone"})
    f.take()
    f.tick(limits.fleet_ask_ms + 1)
    f.take()
    assert f.answer(3).status == 404 and "no job gone" in f.answer(3).body["error"]
    f.node.step(View(term=4, leader=None, is_leader=False, ready=False))
    f.ctl(4, {"op": "get", "id": "nope"})
    assert not [e for e in f.take() if isinstance(e, Send) and e.ftype == "F_CTL"]
    assert f.answer(4).status == 404


def test_leader_answers_a_forwarded_get_with_the_records_version() -> None:
    """At the leader, a job asked by another member is answered with its record and, as the
    index to wait for, its version; an unknown job 404, never asked further."""
    f = Fleet1(voters=("m1", "m2", "m3"))
    submitted(f, token=1)
    f.node.step(FrameIn("m2", "F_CTL", {"rid": "#get.m2.1", "req": {"op": "get", "id": "j1"}}))
    f.node.step(FrameIn("m2", "F_CTL", {"rid": "#get.m2.2", "req": {"op": "get", "id": "no"}}))
    replies = [e for e in f.take() if isinstance(e, Send) and e.ftype == "F_CTL_REPLY"]
    by = {r.body["rid"]: r.body for r in replies}
    assert by["#get.m2.1"]["status"] == 200
    assert by["#get.m2.1"]["index"] == by["#get.m2.1"]["body"]["version"] > 0
    assert by["#get.m2.2"]["status"] == 404
    assert not [e for e in f.take() if isinstance(e, Send) and e.ftype == "F_CTL"]


def _rows(f: Fleet1) -> dict[str, dict]:
    return {m["name"]: m for m in f.node.fleet()["members"]}


def test_fleet_says_down_and_never_drops_a_member_across_a_reign() -> None:
    """A member past `dead_ms` is `down` (since it was last heard); a new leader lists every
    member it heard from or its table names as `not_heard_yet` until `dead_ms` into its reign,
    then `down`: none drops out of the list during an election (issue 27, point 5)."""
    f = Fleet1(voters=("m1", "m2", "m3"))
    dead = f.node.cfg.dead_ms
    have = {"boot": "wb", "role": "worker", "pos": 0, "pools": {"default": 2}}
    f.node.step(FrameIn("w1", "F_JOB_HAVE", have))
    f.node.step(FrameIn("m2", "F_JOB_HAVE", {**have, "role": "voter", "boot": "b2"}))
    f.tick(1)
    rows = _rows(f)
    assert (rows["w1"]["status"], rows["w1"]["alive"]) == ("alive", True)
    assert (rows["m3"]["status"], rows["m3"]["alive"]) == ("not_heard_yet", None)
    heard_w1 = f.now - 1
    f.tick(dead + 1)  # nobody reported since
    rows = _rows(f)
    assert (rows["w1"]["status"], rows["w1"]["alive"]) == ("down", False)
    assert rows["w1"]["down_since"] == heard_w1 / 1000
    assert rows["m3"]["status"] == "down" and rows["m3"]["down_since"] is not None
    assert rows["m1"]["status"] == "alive"
    assert webui.alive_words(rows["w1"]).startswith("down since ")

    # An election: this member leads again in a new term; its reports are dropped.
    f.node.step(View(term=2, leader=None, is_leader=False, ready=False))
    f.tick(1)
    f.node.step(View(term=3, leader="m1", is_leader=True, ready=True))
    f.tick(1)
    rows = _rows(f)
    assert set(rows) == {"m1", "m2", "m3", "w1"}, rows
    assert {rows[n]["status"] for n in ("m2", "m3", "w1")} == {"not_heard_yet"}
    assert webui.alive_words(rows["w1"]) == "not heard yet"
    f.node.step(FrameIn("w1", "F_JOB_HAVE", have))
    f.tick(1)
    assert _rows(f)["w1"]["status"] == "alive"
    f.tick(dead)
    rows = _rows(f)
    assert set(rows) == {"m1", "m2", "m3", "w1"}
    assert rows["m2"]["status"] == "down" and rows["m2"]["down_since"] == (
        pytest.approx(rows["m2"]["last_seen"]))


def test_a_member_that_does_not_lead_says_unknown_not_down() -> None:
    """Only the leader hears the reports: a member's own (partial) view calls the others
    `unknown`, never down."""
    f = Fleet1(voters=("m1", "m2"))
    f.node.step(View(term=2, leader=None, is_leader=False, ready=False))
    f.tick(f.node.cfg.dead_ms + 1)
    rows = _rows(f)
    assert (rows["m2"]["status"], rows["m2"]["alive"], rows["m2"]["down_since"]) == (
        "unknown", None, None)
    assert webui.alive_words(rows["m2"]) == "unknown"
