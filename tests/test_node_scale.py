"""The job node with many workers (issue 16): reports and keep-alives that do not grow into
chatter, new entries coalesced per worker, whole tables rationed, and a new leader that catches
workers up from its ring of recent entries rather than with a whole table each."""

from __future__ import annotations

import random
from typing import Any

from meshjobs import limits
from meshjobs.compact import pack_items
from meshjobs.control import parse_request
from meshjobs.node import (
    Applied,
    FrameIn,
    JobNode,
    NodeConfig,
    Pool,
    Pressure,
    Send,
    Tick,
    View,
    spec_digest,
)
from meshjobs.table import JobTable
from tests.helpers import Fleet1, submitted, worker_node

T0 = 1_700_000_000_000


def _sends(effects: list[Any], ftype: str, to: str | None = None) -> list[Send]:
    return [e for e in effects if isinstance(e, Send) and e.ftype == ftype
            and (to is None or e.to == to)]


def _have(pos: int = 0, slots: int = 0, boot: str = "wb") -> dict:
    return {"boot": boot, "role": "worker", "pos": pos, "pools": {"default": slots}}


def _submit_entry(job_id: str, t: int = T0) -> dict:
    req = parse_request({"op": "submit", "rid": "r" + job_id, "spec": {"argv": ["x"]},
                         "items": [None]})
    spec = dict(req["spec"])
    spec.pop("id")
    return {"k": "submit", "rid": "r" + job_id, "t": t, "id": job_id, "spec": spec,
            "dg": spec_digest(spec, [None]), **pack_items([None])}


def test_worker_reports_to_its_leader_on_change_or_keepalive() -> None:
    """Rule: a member that knows its leader reports (F_JOB_HAVE) at once when the leader is new
    or something but its position and running items changed, and otherwise every
    have_keepalive_ms, not every have_ms (200 workers would send 800 frames a second)."""
    cfg = NodeConfig(member="w1", boot="wb", pools={"default": Pool("default", slots=1)},
                     role="worker", voters=("v1", "v2", "v3"))
    node = JobNode(JobTable(), cfg, random.Random(3))
    node.step(Tick(T0))
    node.step(View())
    node.take()
    now = T0
    node.step(FrameIn("v1", "F_JOB_STATE", {"term": 3, "leader": "v1", "prev": 0, "entries": []}))
    assert _sends(node.take(), "F_JOB_HAVE", "v1"), "a new leader is told at once"
    reports = 0
    while now + limits.have_ms // 2 < T0 + limits.have_keepalive_ms:
        now += limits.have_ms // 2
        node.step(Tick(now))
        node.step(FrameIn("v1", "F_JOB_STATE", {"term": 3, "leader": "v1", "prev": 0,
                                                "entries": []}))
        reports += len(_sends(node.take(), "F_JOB_HAVE"))
    assert reports == 0, "nothing new: no report before the keep-alive"
    node.step(Tick(T0 + limits.have_keepalive_ms))
    assert len(_sends(node.take(), "F_JOB_HAVE", "v1")) == 1, "the keep-alive"
    node.step(Pressure(True))
    [have] = _sends(node.take(), "F_JOB_HAVE", "v1")
    assert have.body["pressure"] is True, "a change is reported at once"


def test_leader_keepalive_and_entries_coalesced_per_worker() -> None:
    """Rule: a caught-up worker hears from the leader every state_keepalive_ms; new entries go
    to it at most every state_push_ms, and at once when they lease items to it."""
    f = Fleet1(slots=0)
    f.node.step(FrameIn("w1", "F_JOB_HAVE", _have()))
    assert len(_sends(f.take(), "F_JOB_STATE", "w1")) == 1
    start = f.now
    keepalives = 0
    while f.now + limits.have_ms // 2 < start + limits.state_keepalive_ms:
        f.tick(limits.have_ms // 2)
        f.node.step(FrameIn("w1", "F_JOB_HAVE", _have()))
        keepalives += len(_sends(f.take(), "F_JOB_STATE", "w1"))
    assert keepalives == 0, "caught up: no frame before the keep-alive"
    f.tick(start + limits.state_keepalive_ms - f.now)
    assert len(_sends(f.take(), "F_JOB_STATE", "w1")) == 1
    # Entries the worker has no lease in wait up to state_push_ms, several in one frame.
    submitted(f, token=1, job_id="ja", rid="a")
    submitted(f, token=2, job_id="jb", rid="b")
    assert not _sends(f.take(), "F_JOB_STATE", "w1")
    f.tick(limits.state_push_ms)
    [state] = _sends(f.take(), "F_JOB_STATE", "w1")
    assert [e[1]["es"][0]["id"] for e in state.body["entries"]] == ["ja", "jb"]
    # A lease to the worker goes at once.
    f.node.step(FrameIn("w1", "F_JOB_HAVE", _have(pos=f.table.applied_index, slots=1)))
    f.tick(1)
    assert not _sends(f.take(), "F_JOB_STATE", "w1")
    [lease] = f.pending_of("lease")
    assert lease["g"][0][2] == "w1"
    f.commit_pending()
    [state] = _sends(f.take(), "F_JOB_STATE", "w1")
    assert any(sub["k"] == "lease" for _i, e in state.body["entries"] for sub in e["es"])


def test_whole_tables_are_rationed_and_built_once() -> None:
    """Rule: a leader sends at most state_snapshots_max whole tables per state_resend_ms, all
    of one round share one table built once; the workers that wait are told who leads and get
    theirs later."""
    f = Fleet1(slots=0)
    for k in range(3):
        submitted(f, token=k + 1, job_id=f"j{k}", rid=f"r{k}")  # before any worker: no ring
    names = [f"w{k}" for k in range(limits.state_snapshots_max + 2)]
    for n in names:
        f.node.step(FrameIn(n, "F_JOB_HAVE", _have(boot=n + "b")))
    sent = _sends(f.take(), "F_JOB_STATE")
    snaps = [s for s in sent if "snapshot" in s.body]
    assert len(snaps) == limits.state_snapshots_max
    assert all(s.body["snapshot"] is snaps[0].body["snapshot"] for s in snaps), "built once"
    assert f.node.counts.get("state_snapshots_waiting", 0) == 2
    assert all("snapshot" not in s.body and s.body["leader"] == "m1" for s in sent
               if s not in snaps), "the others are told who leads"
    f.tick(limits.state_resend_ms)
    installed = {s.to for s in snaps}
    for n in names:
        pos = f.table.applied_index if n in installed else 0
        f.node.step(FrameIn(n, "F_JOB_HAVE", _have(pos=pos, boot=n + "b")))
    later = [s for s in _sends(f.take(), "F_JOB_STATE") if "snapshot" in s.body]
    assert len(later) == 2 and {s.to for s in later} == set(names) - {s.to for s in snaps}


def test_new_leader_catches_workers_up_from_its_ring() -> None:
    """Rule: a voter of a fleet of several keeps recent entries while it follows, once a lease
    went to a worker member, so that when it comes to lead, a worker a little behind is sent
    entries, not a whole table (after a failover 200 workers would each be sent one at once)."""
    cfg = NodeConfig(member="v2", boot="v2b", role="voter", voters=("v1", "v2", "v3"))
    table = JobTable()
    node = JobNode(table, cfg, random.Random(1))
    node.step(Tick(T0))
    node.step(View(term=1, leader="v1", is_leader=False, ready=False))
    for k in range(6):
        prev = table.applied_index
        es = [_submit_entry(f"j{k}")]
        if k == 0:
            es.append({"k": "lease", "t": T0, "g": [["j0", 0, "w1", "w1b"]]})
        e = {"k": "batch", "t": T0, "p": k, "es": es}
        node.step(Applied(k + 1, e, table.apply(e, k + 1), prev))
    node.take()
    assert node.ring.entries, "a follower keeps the ring once workers have leases"
    node.step(Tick(T0 + 2_000))
    node.step(View(term=2, leader="v2", is_leader=True, ready=True))
    node.step(FrameIn("w1", "F_JOB_HAVE", _have(pos=3)))
    [state] = _sends(node.take(), "F_JOB_STATE", "w1")
    assert "snapshot" not in state.body
    assert state.body["prev"] == 3 and [i for i, _e in state.body["entries"]] == [4, 5, 6]
    assert node.counts.get("state_snapshots_sent", 0) == 0


def test_worker_that_loses_its_leader_asks_the_voters_at_once() -> None:
    """Rule: a worker that has not heard from its leader for dead_ms reports to every voter
    within have_ms (to learn who leads now), not at its next keep-alive up to
    have_keepalive_ms later."""
    node = worker_node(T0)
    now = T0 + limits.member_dead_ms - limits.have_keepalive_ms // 2
    node.step(Tick(now))
    assert _sends(node.take(), "F_JOB_HAVE", "v1"), "the keep-alive to the leader"
    node.step(Tick(T0 + limits.member_dead_ms + 1))
    asked = {s.to for s in _sends(node.take(), "F_JOB_HAVE")}
    assert node.counts.get("leader_lost") == 1
    node.step(Tick(T0 + limits.member_dead_ms + 1 + limits.have_ms))
    asked |= {s.to for s in _sends(node.take(), "F_JOB_HAVE")}
    assert asked == {"v1", "v2", "v3"}, asked
