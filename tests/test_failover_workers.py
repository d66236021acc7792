"""Worker members across a leader failover, at the job node (pure, in process).

What a fleet of 3 voters and 30 workers with 100,000 items showed (bench/scale_real.py): a new
leader sent each worker the whole table, again every report until the worker had loaded it,
and the jobs thread, which also ticks Raft, stalled long enough for elections to follow one
another (term 43 after one kill, 80 s with next to no item run); and workers still reporting to
the dead leader had their leases revoked and their items run twice. These tests hold the fixes.
"""

from __future__ import annotations

import random
import types
from typing import Any

import msgpack
import pytest

from meshjobs import jobsd, limits
from meshjobs.frames import Assembler, FrameType
from meshjobs.node import Applied, FrameIn, JobNode, NodeConfig, Pool, Send, Tick, View
from meshjobs.table import JobTable
from tests.helpers import T0, Fleet1, LinksMember, spec, submitted, wait_until, worker_node

NOW = 1_700_000_000_000
VOTERS = ("v1", "v2", "v3")


def _have(pos: int, boot: str = "wb") -> dict:
    return {"boot": boot, "role": "worker", "pos": pos, "pools": {"default": 1}}


def _states(effects: list[Any], to: str | None = None) -> list[Send]:
    return [e for e in effects if isinstance(e, Send) and e.ftype == "F_JOB_STATE"
            and (to is None or e.to == to)]


def _voter(member: str = "v2") -> JobNode:
    cfg = NodeConfig(member=member, boot=member + "b", pools={"default": Pool("default", slots=0)},
                     role="voter", voters=VOTERS)
    node = JobNode(JobTable(), cfg, random.Random(5))
    node.step(Tick(NOW))
    node.step(View(term=1, leader="v1", is_leader=False, ready=True))
    node.take()
    return node


def _commit(node: JobNode, entry: dict) -> int:
    """Apply `entry` to the node's table at the next index and tell the node, as Raft would."""
    table = node.table
    prev = table.applied_index
    index = prev + 1
    out = table.apply(entry, index)
    node.step(Applied(index, entry, out, prev))
    return index


def _submit(job_id: str, n: int) -> dict:
    return {"k": "submit", "t": T0, "id": job_id, "spec": spec(argv=["true"]), "dg": b"dg-" + job_id.encode(),
            "items": [None] * n}


def test_a_new_leader_catches_workers_up_with_entries_not_the_whole_table() -> None:
    """Rule: a voter keeps the recent entries once a lease went to a member that is not a
    voter (the fleet has workers), though it does not lead; so when it comes to lead, a worker
    a little behind is sent the entries it lacks, not the whole table."""
    node = _voter("v2")
    _commit(node, _submit("ja", 3))
    _commit(node, {"k": "lease", "t": T0, "g": [["ja", 0, "w1", "wb"]]})
    at_worker = _commit(node, _submit("jb", 2))
    _commit(node, _submit("jc", 2))
    last = _commit(node, {"k": "lease", "t": T0, "g": [["jc", 1, "w1", "wb"]]})
    assert node.ring.entries, "a follower voter keeps the ring once the fleet has workers"

    node.step(View(term=2, leader="v2", is_leader=True, ready=True))
    node.step(FrameIn("w1", "F_JOB_HAVE", _have(at_worker)))
    node.step(Tick(NOW + limits.have_ms))
    [sent] = _states(node.take(), "w1")
    assert "snapshot" not in sent.body
    assert sent.body["prev"] == at_worker
    assert [e[0] for e in sent.body["entries"]] == list(range(at_worker + 1, last + 1))


def test_a_voter_of_a_fleet_without_workers_keeps_no_ring() -> None:
    """Leases to voters only: a follower voter keeps no entries for workers there are none of."""
    node = _voter("v2")
    _commit(node, _submit("ja", 2))
    _commit(node, {"k": "lease", "t": T0, "g": [["ja", 0, "v1", "v1b"], ["ja", 1, "v3", "v3b"]]})
    _commit(node, _submit("jb", 2))
    assert not node.ring.entries


def _snapshots(f: Fleet1) -> list[Send]:
    return [s for s in _states(f.take()) if "snapshot" in s.body]


def test_the_whole_table_is_not_sent_again_while_the_worker_loads_it() -> None:
    """Rule: a worker sent the whole table and still reporting the position before it is sent
    it again only after state_snapshot_resend_ms (it may still be arriving or loading); entries
    lost so are sent again after state_resend_ms, as before."""
    f = Fleet1(slots=0)
    submitted(f, token=1, job_id="ja", rid="a", n=5)
    f.node.step(FrameIn("w1", "F_JOB_HAVE", _have(0)))
    f.tick(1)
    assert len(_snapshots(f)) == 1
    sent = 1
    t = 0
    while t + limits.have_ms < limits.state_snapshot_resend_ms:
        f.node.step(FrameIn("w1", "F_JOB_HAVE", _have(0)))
        f.tick(limits.have_ms)
        t += limits.have_ms
        sent += len(_snapshots(f))
    assert t > 2 * limits.state_resend_ms
    assert sent == 1, "not sent again while it may still be loading"
    f.tick(limits.state_snapshot_resend_ms - t)
    f.node.step(FrameIn("w1", "F_JOB_HAVE", _have(0)))
    f.tick(1)
    assert len(_snapshots(f)) == 1, "sent again once it had time enough"


def test_workers_behind_in_the_same_round_share_one_snapshot_body() -> None:
    """Rule: the whole table is made once per round for every worker that needs it (one body:
    the jobs thread packs a body it sends to many members once)."""
    f = Fleet1(slots=0)
    submitted(f, token=1, job_id="ja", rid="a", n=5)
    for w in ("w1", "w2", "w3"):
        f.node.step(FrameIn(w, "F_JOB_HAVE", _have(0, boot=w + "b")))
    f.tick(1)
    snaps = _snapshots(f)
    assert sorted(s.to for s in snaps) == ["w1", "w2", "w3"]
    assert snaps[0].body is snaps[1].body is snaps[2].body


def _worker() -> JobNode:
    return worker_node(NOW, VOTERS)


def _haves(node: JobNode, now: int) -> set[str]:
    node.step(Tick(now))
    return {e.to for e in node.take() if isinstance(e, Send) and e.ftype == "F_JOB_HAVE"}


def test_a_worker_asks_the_voters_who_leads_once_the_leader_is_quiet() -> None:
    """Rule: a worker that has not heard the leader for leader_quiet_ms (well under dead_ms)
    sends its reports to the voters too; a voter's answer naming a newer leader turns its
    reports there, before that leader's grace for unheard members runs out."""
    node = _worker()
    assert _haves(node, NOW + limits.have_keepalive_ms) == {"v1"}, "the leader talks: only to it"
    quiet = NOW + limits.leader_quiet_ms + 1  # at once, not at the next keep-alive
    assert quiet - NOW < limits.member_dead_ms
    assert _haves(node, quiet) == {"v1", "v2", "v3"}
    node.step(FrameIn("v2", "F_JOB_STATE", {"term": 4, "leader": "v2", "voters": list(VOTERS)}))
    at_once = {e.to for e in node.take() if isinstance(e, Send) and e.ftype == "F_JOB_HAVE"}
    assert at_once == {"v2"}, "a new leader named: reported to at once"
    node.step(FrameIn("v2", "F_JOB_STATE", {"term": 4, "leader": "v2", "prev": 0, "entries": []}))
    node.take()
    assert _haves(node, quiet + limits.have_keepalive_ms) == {"v2"}, "the new leader talks: only to it"


def test_a_table_body_sent_to_many_members_is_packed_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rule: the jobs thread packs (and cuts into parts) a table body it sends to member after
    member once; each member gets every part and puts the whole body back together."""
    packs: list[int] = []

    def packb(obj: Any, **kw: Any) -> bytes:
        packs.append(1)
        return msgpack.packb(obj, **kw)
    monkeypatch.setattr(jobsd, "msgpack", types.SimpleNamespace(packb=packb))
    leader, workers = LinksMember("v1"), [LinksMember("w1"), LinksMember("w2")]
    try:
        for w in workers:
            leader.links.connect(w.name, w.address)
            wait_until(lambda w=w: leader.up(w.name), what=f"v1 -> {w.name} up")
        jobs = jobsd.JobsThread(JobNode(JobTable(), NodeConfig(member="v1", boot="b1"),
                                        random.Random(1)), None, None, None, links=leader.links)
        body = {"term": 2, "leader": "v1", "snapshot": {"blob": bytes(range(256)) * 20_000},
                "index": 7}  # 5 MB: more than one frame
        for w in workers:
            jobs._send(Send(w.name, "F_JOB_STATE", body, table=True))
        assert len(packs) == 1
        for w in workers:
            parts = wait_until(lambda w=w: (lambda got: len(got) >= 2 and got)(
                w.got("v1", FrameType.F_JOB_STATE)), what=f"{w.name} gets the parts")
            assembler = Assembler()
            whole = [assembler.add("v1", p) for p in parts]
            assert whole[-1] == body and all(x is None for x in whole[:-1])
    finally:
        for m in (leader, *workers):
            m.stop()
