"""A new worker's whole table as the leader's latest dump (issue 26, point 5): the leader's node
asks its edge to send the dump file with the entries after it (`SendDump`) instead of building
and packing the table on the jobs thread, asks for a new dump when its ring of recent entries
no longer reaches back to the latest one (`WantDump`), and a worker checks what it got whole
before it installs it (node/follow.py)."""

from __future__ import annotations

from typing import Any

from meshjobs import dumpbytes, limits
from meshjobs.node import DumpReady, FrameIn, Send, SendDump, WantDump
from meshjobs.table import JobTable
from tests.helpers import Fleet1, submitted, worker_node

T0 = 1_700_000_000_000


def _have(pos: int = 0, boot: str = "wb", dumps: bool = True) -> dict:
    body: dict[str, Any] = {"boot": boot, "role": "worker", "pos": pos, "pools": {"default": 0}}
    if dumps:
        body["dumps"] = True
    return body


def _dump_of(table: JobTable) -> bytes:
    """The bytes of a dump file of `table`, as the dump writer writes one."""
    pos = table.applied_index
    body = dumpbytes.payload(table.to_state(), (b"", pos, 1), (b"", pos - 1, 1), ["v1"])
    return dumpbytes.header(body) + body


def _state_sends(effects: list[Any]) -> list[Send]:
    return [e for e in effects if isinstance(e, Send) and e.ftype == "F_JOB_STATE"]


def _leader_with_dump(jobs_before: int = 3, jobs_after: int = 2) -> tuple[Fleet1, bytes, int]:
    """A leader whose table had `jobs_before` jobs when its dump was written, and that learnt
    of a worker then (so that its ring holds what came after the dump, not what came before)."""
    f = Fleet1(slots=0)
    for k in range(jobs_before):
        submitted(f, token=k + 1, job_id=f"j{k}", rid=f"r{k}")
    f.node.step(FrameIn("wx", "F_JOB_HAVE", _have(pos=f.table.applied_index, boot="wxb")))
    f.take()
    dump, at = _dump_of(f.table), f.table.applied_index
    f.node.step(DumpReady(at))
    for k in range(jobs_before, jobs_before + jobs_after):
        submitted(f, token=k + 1, job_id=f"j{k}", rid=f"r{k}")
    f.take()
    return f, dump, at


def test_a_new_worker_is_sent_the_dump_and_the_entries_after_it() -> None:
    """Rule: a worker that takes dumps and is behind the ring gets `SendDump`: the position of
    the latest dump and the committed entries after it; no table is built for it."""
    f, _dump, at = _leader_with_dump()
    f.tick(limits.state_push_ms)
    f.node.step(FrameIn("w1", "F_JOB_HAVE", _have()))
    out = f.take()
    [sent] = [e for e in out if isinstance(e, SendDump)]
    assert sent.to == "w1" and sent.body["prev"] == at and sent.body["leader"] == "m1"
    assert [i for i, _e in sent.body["entries"]][-1] == f.table.applied_index
    assert all(i > at for i, _e in sent.body["entries"])
    assert not [s for s in _state_sends(out) if s.to == "w1" and "snapshot" in s.body]
    assert f.node.counts.get("state_dumps_sent") == 1
    assert f.node.counts.get("state_snapshots_sent", 0) == 0


def test_a_worker_that_does_not_take_dumps_gets_the_table() -> None:
    """Rule: an older worker (its reports say nothing of dumps) is sent the table as before."""
    f, _dump, _at = _leader_with_dump()
    f.tick(limits.state_push_ms)
    f.node.step(FrameIn("w1", "F_JOB_HAVE", _have(dumps=False)))
    out = f.take()
    assert not [e for e in out if isinstance(e, SendDump)]
    [sent] = [s for s in _state_sends(out) if s.to == "w1"]
    assert "snapshot" in sent.body


def test_a_dump_the_ring_does_not_reach_back_to_is_replaced_first() -> None:
    """Rule: when the ring no longer reaches back to the latest dump, a new dump is asked for
    (at most every state_resend_ms), the worker waits for it (no table built meanwhile), and
    gets it once it is written."""
    f = Fleet1(slots=0)
    for k in range(3):
        submitted(f, token=k + 1, job_id=f"j{k}", rid=f"r{k}")  # no worker known: no ring
    f.node.step(DumpReady(1))
    f.node.step(FrameIn("w1", "F_JOB_HAVE", _have()))
    out = f.take()
    assert [e for e in out if isinstance(e, WantDump)]
    assert not [e for e in out if isinstance(e, SendDump)]
    assert not [s for s in _state_sends(out) if "snapshot" in s.body]
    f.tick(limits.state_push_ms)
    f.node.step(FrameIn("w1", "F_JOB_HAVE", _have()))
    assert not [e for e in f.take() if isinstance(e, WantDump)], "asked once per state_resend_ms"
    f.node.step(DumpReady(f.table.applied_index))
    f.tick(limits.state_keepalive_ms)
    f.node.step(FrameIn("w1", "F_JOB_HAVE", _have()))
    [sent] = [e for e in f.take() if isinstance(e, SendDump)]
    assert sent.body["prev"] == f.table.applied_index and sent.body["entries"] == []


def _deliver(worker: Any, sent: SendDump, dump: bytes) -> list[Any]:
    """What the leader's edge sends and the worker's links deliver: the body with the dump."""
    worker.step(FrameIn("v1", "F_JOB_STATE", {**sent.body, "term": 3, "leader": "v1",
                                             "dump": dump}))
    return worker.take()


def _sent(f: Fleet1) -> SendDump:
    f.tick(limits.state_push_ms)
    f.node.step(FrameIn("w1", "F_JOB_HAVE", _have()))
    [sent] = [e for e in f.take() if isinstance(e, SendDump)]
    return sent


def test_a_worker_installs_the_dump_and_applies_the_entries_after_it() -> None:
    """Rule: the worker checks the dump whole, installs it and applies the entries after it:
    its table is the leader's."""
    f, dump, _at = _leader_with_dump()
    w = worker_node(T0)
    _deliver(w, _sent(f), dump)
    assert w.counts.get("state_dumps_installed") == 1
    assert w.table.applied_index == f.table.applied_index
    assert sorted(w.table.jobs) == sorted(f.table.jobs)
    assert w.follower.caught_up and w.follower.in_step()


def test_a_newer_dump_than_meant_skips_what_it_holds() -> None:
    """Rule: the file the edge read may be a newer dump than the node meant: the entries it
    holds already are skipped, the rest applied."""
    f, old, _at = _leader_with_dump()
    sent = _sent(f)
    # A dump of the leader's table as it was after the first entry sent.
    mid = JobTable.from_state(dumpbytes.parse(old, "test", "").state)
    first, entry = sent.body["entries"][0]
    mid.apply(entry, first)
    w = worker_node(T0)
    _deliver(w, sent, _dump_of(mid))
    assert w.counts.get("state_dumps_installed") == 1
    assert w.table.applied_index == f.table.applied_index
    assert sorted(w.table.jobs) == sorted(f.table.jobs)


def test_a_damaged_dump_is_not_installed() -> None:
    """Rule: remote garbage is counted and dropped: a dump with a flipped byte, cut short, or
    not a dump at all, leaves the worker's table as it was."""
    f, dump, _at = _leader_with_dump()
    sent = _sent(f)
    flipped = bytearray(dump)
    flipped[len(dump) // 2] ^= 0x20
    for bad in (bytes(flipped), dump[:-7], b"not a dump", 17):
        w = worker_node(T0)
        before = w.table.applied_index
        _deliver(w, sent, bad)  # type: ignore[arg-type]
        assert w.counts.get("frames_bad_state") == 1, bad[:20] if isinstance(bad, bytes) else bad
        assert w.table.applied_index == before and not w.table.jobs
        assert w.counts.get("state_dumps_installed", 0) == 0


def test_a_dump_never_takes_a_table_backwards() -> None:
    """Rule: a dump older than the worker's table, or older than the leader meant, is refused:
    a table never goes back to an earlier position."""
    f, dump, _at = _leader_with_dump()
    sent = _sent(f)
    w = worker_node(T0)
    _deliver(w, sent, dump)
    at = w.table.applied_index
    _deliver(w, SendDump("w1", {**sent.body, "prev": 0, "entries": []}), dump)
    assert w.counts.get("state_dumps_stale") == 1 and w.table.applied_index == at
    w2 = worker_node(T0)
    _deliver(w2, SendDump("w1", {**sent.body, "prev": at + 50, "entries": []}), dump)
    assert w2.counts.get("state_dumps_stale") == 1 and not w2.table.jobs


def test_entries_that_do_not_follow_the_dump_are_not_applied() -> None:
    """Rule: entries that start at or before the dump's position, or out of order, are garbage;
    entries after a newer dump that none of them ends are not applied (the worker asks)."""
    f, dump, at = _leader_with_dump()
    sent = _sent(f)
    entries = sent.body["entries"]
    w = worker_node(T0)
    _deliver(w, SendDump("w1", {**sent.body, "entries": [[at, entries[0][1]], *entries]}), dump)
    assert w.counts.get("frames_bad_state") == 1 and not w.table.jobs
    w = worker_node(T0)
    _deliver(w, SendDump("w1", {**sent.body, "entries": entries[::-1]}), dump)
    assert w.counts.get("frames_bad_state") == 1 and not w.table.jobs
    # A dump newer than meant whose position is none of the entries' indexes (indexes skip
    # the log's no-ops): where the entries after it follow on is not known.
    (i1, e1), (_i2, e2) = entries[:2]
    newer = JobTable.from_state(dumpbytes.parse(dump, "test", "").state)
    newer.apply(e1, i1 + 1)
    w = worker_node(T0)
    _deliver(w, SendDump("w1", {**sent.body, "entries": [[i1, e1], [i1 + 2, e2]]}),
             _dump_of(newer))
    assert w.counts.get("state_dumps_installed") == 1 and w.counts.get("state_gaps") == 1
    assert w.table.applied_index == i1 + 1
    # What the entries show exists: the table is behind it, not fresh.
    assert not w.follower.in_step()


def test_a_dump_that_does_not_come_is_waited_for_no_longer() -> None:
    """Rule: dumps may fail for a while (a full disk, say): a worker waits for the new dump
    asked for up to state_dump_wait_ms, then is sent the table built on the leader."""
    f = Fleet1(slots=0)
    for k in range(3):
        submitted(f, token=k + 1, job_id=f"j{k}", rid=f"r{k}")
    f.node.step(DumpReady(1))
    f.node.step(FrameIn("w1", "F_JOB_HAVE", _have()))
    assert [e for e in f.take() if isinstance(e, WantDump)]
    f.tick(limits.state_dump_wait_ms)
    f.node.step(FrameIn("w1", "F_JOB_HAVE", _have()))
    out = f.take()
    assert [s for s in _state_sends(out) if s.to == "w1" and "snapshot" in s.body]
    assert not [e for e in out if isinstance(e, SendDump)]
