"""Unit tests of what each identity holds in the job table (meshjobs/quotas.py): the counters
per-identity quotas are judged by, kept by the appliers and rebuilt on load."""

from __future__ import annotations

import msgpack

from meshjobs import quotas
from meshjobs.table import DONE, JobTable
from tests.helpers import Log, row


def roundtrip(table: JobTable) -> JobTable:
    s = msgpack.unpackb(msgpack.packb(table.to_state(), use_bin_type=True), raw=False,
                        strict_map_key=False)
    return JobTable.from_state(s)


def test_holds_follow_submit_lease_result_cancel_forget_rerun() -> None:
    """Rule: an identity holds the items of its jobs not finished (pending or leased) and,
    apart, those leased; each applier keeps both; nothing held, no entry; a snapshot loads
    the same counts."""
    log = Log()
    log.submit("a1", n=3, submitted_by="alice")
    log.submit("b1", n=2, dg=b"dg-2", submitted_by="bob")
    log.submit("o1", n=1, dg=b"dg-3")  # from before identities: "anonymous"
    t = log.table
    assert quotas.pending_items(t, "alice") == 3 and quotas.pending_items(t, "bob") == 2
    assert quotas.pending_items(t, "anonymous") == 1
    _, epoch = log.lease(("a1", 0), ("a1", 1))
    assert quotas.running_items(t, "alice") == 2 and quotas.pending_items(t, "alice") == 3
    log.result(row("a1", 0, epoch, DONE))
    assert quotas.running_items(t, "alice") == 1 and quotas.pending_items(t, "alice") == 2
    assert roundtrip(t).holds == t.holds
    log.op("cancel", "a1")
    assert quotas.pending_items(t, "alice") == 0 and "alice" not in t.holds
    log.op("rerun", "a1")
    assert quotas.pending_items(t, "alice") == 3
    log.op("cancel", "a1")
    log.op("forget", "a1")
    assert "alice" not in t.holds and quotas.pending_items(t, "bob") == 2
    t.check()


def test_planted_drift_is_caught_by_check() -> None:
    """check() recounts the holds: a counter that drifted from the jobs is caught."""
    log = Log()
    log.submit("a1", n=2, submitted_by="alice")
    log.table.holds["alice"][0] += 1
    try:
        log.table.check()
    except AssertionError as e:
        assert "holds" in str(e)
    else:
        raise AssertionError("drift not caught")


def test_running_items_max_bounds_pick_place_and_lease() -> None:
    """Rule: an item of a job that records its submitter's running_items_max is picked,
    placed and leased only while the submitter has fewer items leased (over all its jobs,
    counting those in flight); others' jobs are not held back; a snapshot keeps the field."""
    log = Log()
    log.submit("a1", n=3, submitted_by="alice", running_items_max=2)
    log.submit("a2", n=2, dg=b"dg-2", submitted_by="alice", running_items_max=2)
    log.submit("b1", n=2, dg=b"dg-3", submitted_by="bob")
    t = log.table
    assert t.pick("default", 10, 0, set()) == [("a1", 0), ("a1", 1), ("b1", 0), ("b1", 1)]
    assert [p[:2] for p in t.place("default", {"m1": 10}, 10, 0, {("a2", 0)})] == [
        ("a1", 0), ("b1", 0), ("b1", 1)]  # one of alice's in flight already
    out, _ = log.lease(("a1", 0), ("a2", 0), ("a1", 1))
    assert out["granted"] == 2 and out["refused"] == 1
    assert quotas.running_items(t, "alice") == 2
    assert t.pick("default", 10, 0, set()) == [("b1", 0), ("b1", 1)]
    assert roundtrip(t).jobs["a1"].running_items_max == 2
    assert roundtrip(t).jobs["b1"].running_items_max is None
