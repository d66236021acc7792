"""Scale, part 1: 5 voters and 200 worker members in one process, over the real node code.

    python bench/scale.py sim [--voters 5] [--workers 200] [--jobs 3] [--seconds 30]
                              [--catchup-jobs 100000] [--seed 1]

Every member runs a real `JobNode` over a real `JobTable`; around them this harness plays the
links, Raft, the driver and the clients, on a simulated clock (1 ms rounds):

- Links: every frame body is really msgpack-encoded (its bytes are counted per frame type) and
  decoded at the other end. A member's frames leave through one egress of `--link-mbit` (the
  bytes it sends queue behind each other: 200 snapshots at once take 200 times as long), then
  `LINK_LATENCY_MS`. No loss: this measures cost, `meshjobs/sim.py` checks safety under faults.
- Raft: the leader's proposals commit in order `COMMIT_MS` after they are logged and are applied
  on every voter; a killed leader is replaced after `ELECTION_MS` by the next live voter (its
  uncommitted tail is lost; clients retry with the same request id).
- Driver: an item runs 50 ms to 30 s (log-uniform) and ends done.
- Clients: a steady stream of `--jobs` submits per simulated second, each of 1..100 items, sent
  to a voter (forwarded to the leader when it does not lead), retried after a refusal or 10 s.

Figures: the leader's CPU per simulated second (`time.process_time` around its step, ready and
advance, packing its frames included), frames and bytes per second of each frame type, lease
latency (from the moment an item could be leased, its submit committed and a slot free in the
fleet, to the worker's Run), a new worker's catch-up on a table of `--catchup-jobs` jobs, and
a leader failover at that size with 200 workers (the 200 are then thin stand-ins that follow
the leader's frames without a table of their own: 200 tables of 100,000 jobs do not fit in one
process; the leader and voters are real).
"""

from __future__ import annotations

import argparse
import heapq
import math
import os
import random
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import msgpack

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from meshjobs import limits  # noqa: E402
from meshjobs.compact import entry_item_count, pack_items  # noqa: E402
from meshjobs.control import Answer, parse_request  # noqa: E402
from meshjobs.node import (  # noqa: E402
    Applied,
    CopyBlobs,
    Ctl,
    Cut,
    DumpReady,
    FetchBlobs,
    FrameIn,
    ItemEnded,
    JobNode,
    NodeConfig,
    Pin,
    Pool,
    Reply,
    Run,
    Send,
    SendDump,
    Tick,
    Unpin,
    UnpinAllBut,
    View,
    WantDump,
    advance,
    dispatch,
    spec_digest,
)
from meshjobs.node.events import Exit, Notify  # noqa: E402
from meshjobs.table import DONE, JobTable  # noqa: E402

T0_MS = 1_700_000_000_000
COMMIT_MS = 3  # a proposal commits this long after the leader logs it (a round trip and fsync)
ELECTION_MS = 1_500  # a killed leader is replaced this long after
LINK_LATENCY_MS = 1
CLIENT_RETRY_MS = 500
CLIENT_TIMEOUT_MS = 10_000
RUN_MS = (50, 30_000)
FRAME_TYPES = ("F_JOB_STATE", "F_JOB_HAVE", "F_LEASE", "F_RESULT", "F_CTL", "F_CTL_REPLY")


def _pack(x: Any) -> bytes:
    return msgpack.packb(x, use_bin_type=True)


def _unpack(raw: bytes) -> Any:
    return msgpack.unpackb(raw, raw=False, strict_map_key=False, use_list=True)


def pct(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    v = sorted(values)
    return v[min(len(v) - 1, int(round(p / 100 * (len(v) - 1))))]


@dataclass
class Member:
    name: str
    role: str
    slots: int = 0
    alive: bool = False
    inc: int = 0
    boot: str = ""
    table: Any = None
    node: Any = None
    inbox: list = field(default_factory=list)
    wake_ms: int = 0
    pos: int = 0  # voters: entries of the log applied
    view_sent: View | None = None
    running: dict = field(default_factory=dict)  # (job, i, epoch) -> heap seq of its end
    cpu_s: float = 0.0
    thin: bool = False
    dump: bytes | None = None  # voters: the dump file (its bytes), when there is one


@dataclass
class Client:
    cid: int
    req: dict
    items: int
    acked: bool = False
    job_id: str | None = None
    next_ms: int = 0
    deadline_ms: int = 0
    inflight: tuple | None = None


class Thin:
    """A worker stand-in that follows the leader's F_JOB_STATE without a table: it keeps only
    its position and reports it (F_JOB_HAVE) as a worker with no pools. What the leader spends
    on it is what it spends on a real worker's table; the worker's own cost is not counted."""

    def __init__(self, name: str, boot: str) -> None:
        self.name, self.boot = name, boot
        self.pos = 0
        self.leader: str | None = None
        self.next_have_ms = 0

    def frame(self, peer: str, ftype: str, body: Any) -> None:
        if ftype != "F_JOB_STATE" or not isinstance(body, dict):
            return
        if body.get("leader") == peer:
            self.leader = peer
        if "snapshot" in body:
            self.pos = body["index"]
        elif "dump" in body:
            entries = body.get("entries") or []
            self.pos = entries[-1][0] if entries else body["prev"]
        elif body.get("prev") == self.pos and body.get("entries"):
            self.pos = body["entries"][-1][0]
        elif body.get("prev") is not None and body.get("prev") != self.pos:
            self.next_have_ms = 0

    def have(self) -> dict:
        return {"boot": self.boot, "role": "worker", "pos": self.pos, "pools": {},
                "pressure": False, "disk_full": False, "blob_bytes": 0, "running": 0}


class ScaleSim:
    """The fleet. Build it, `run_until(ms)`, read its figures."""

    def __init__(self, voters: int = 5, workers: int = 200, seed: int = 1,
                 jobs_per_s: float = 3.0, link_mbit: float = 1000.0,
                 node_cls: type[JobNode] = JobNode, run_ms: tuple[int, int] = RUN_MS,
                 items_max: int = 100) -> None:
        self.rng = random.Random(seed)
        self.run_ms, self.items_max = run_ms, items_max
        self.node_cls = node_cls
        self.now = T0_MS
        self.voters = tuple(f"v{k}" for k in range(1, voters + 1))
        self.members: dict[str, Member] = {}
        self.thin: dict[str, Thin] = {}
        self.heap: list = []
        self.seq = 0
        self.bytes_per_ms = link_mbit * 1e6 / 8 / 1000
        self.egress: dict[str, float] = {}
        self.jobs_per_s = jobs_per_s
        self.load_on = True
        # Raft, modelled.
        self.term = 1
        self.leader: str | None = None
        self.ready_pos = 0
        self.election_at = self.now
        self.tail: deque[tuple[bytes, int]] = deque()
        self.log: list[tuple[int, bytes]] = []
        self.last_index = 0
        # Figures.
        self.frames: dict[str, list[int]] = {}  # ftype -> [frames, bytes]
        self.leader_cpu_s = 0.0
        self.pack_cpu_s: dict[str, float] = {}
        self.unpack_cpu_s: dict[str, float] = {}
        # CPU of the dump sender (meshjobs/dumpsend.py: a thread of its own, off the jobs
        # thread): counted apart from the leader's jobs-thread CPU.
        self.sender_cpu_s = 0.0
        self._sender_step_s = 0.0
        self.lease_ms: list[int] = []
        self.first_lease_ms: int | None = None  # first lease committed since `watch_from`
        self.first_run_ms: int | None = None
        self.watch_from: int | None = None
        self.runs_total = 0
        self.runs_again = 0
        self.ran: set[tuple[str, int]] = set()
        # Lease latency: items committed and waiting, those a free slot is there for (since when).
        self.waiting: deque[tuple[str, int]] = deque()
        self.eligible: dict[tuple[str, int], int] = {}
        self.seen_jobs: set[str] = set()
        self.running_total = 0
        # Clients.
        self.clients: list[Client] = []
        self.asked: dict[tuple, Client] = {}
        self.tokens = 0
        self.next_job_ms = self.now
        for name in self.voters:
            self.members[name] = Member(name, "voter")
            self._start(self.members[name])
        for k in range(1, workers + 1):
            self.add_worker(f"w{k:03d}", self.rng.randint(2, 8))

    # --- members -----------------------------------------------------------------------------

    def add_worker(self, name: str, slots: int) -> Member:
        m = self.members[name] = Member(name, "worker", slots)
        self._start(m)
        return m

    def add_thin(self, name: str) -> Thin:
        t = self.thin[name] = Thin(name, f"{name}.1")
        return t

    def _start(self, m: Member) -> None:
        m.inc += 1
        m.boot = f"{m.name}.{m.inc}"
        m.inbox, m.running, m.view_sent = [], {}, None
        m.table = JobTable()
        if m.role == "worker":
            m.inbox.append(View())
            pools = {"default": Pool("default", slots=m.slots)}
        else:
            pools = {}
            m.pos = 0
            for index, raw in self.log:
                prev = m.table.applied_index
                e = _unpack(raw)
                m.inbox.append(Applied(index, e, m.table.apply(e, index), prev))
                m.pos += 1
        cfg = NodeConfig(member=m.name, boot=m.boot, pools=pools, role=m.role,
                         voters=self.voters, dead_ms=limits.member_dead_ms)
        m.node = self.node_cls(m.table, cfg, random.Random(self.rng.getrandbits(64)))
        m.alive = True
        m.wake_ms = self.now

    def kill(self, name: str) -> None:
        m = self.members[name]
        m.alive = False
        for key in m.running:
            self.running_total -= 1
            self.ran.discard(key[:2])
        m.running = {}
        if name == self.leader:
            self.leader = None
            self.election_at = self.now + ELECTION_MS
            self.tail.clear()

    def _step(self, m: Member) -> None:
        node = m.node
        lead = m.name == self.leader
        t0 = time.process_time()
        self._sender_step_s = 0.0
        if m.role == "voter":
            view = self._view(m)
            if view != m.view_sent:
                m.view_sent = view
                node.step(view)
        node.step(Tick(self.now))
        inbox, m.inbox = m.inbox, []
        for ev in inbox:
            node.step(ev)
        advance(node.ready(), persist=lambda e: self._persist(m, e), sync=lambda: None,
                release=lambda eff: dispatch(eff, self._effects, m))
        dt = time.process_time() - t0 - self._sender_step_s
        m.cpu_s += dt
        if lead:
            self.leader_cpu_s += dt
        deadline = node.next_deadline_ms()
        wake = self.now + limits.publish_ms
        m.wake_ms = wake if deadline is None else max(self.now + 1, min(wake, deadline))

    @property
    def _effects(self) -> dict:
        return {
            Reply: lambda eff, m: self._reply(m, eff.token, eff.answer),
            Send: self._send,
            Run: self._run,
            Cut: self._cut,
            CopyBlobs: lambda eff, m: None,
            FetchBlobs: lambda eff, m: None,
            Pin: lambda eff, m: None,
            Unpin: lambda eff, m: None,
            UnpinAllBut: lambda eff, m: None,
            Notify: lambda eff, m: None,
            Exit: lambda eff, m: None,
            SendDump: self._send_dump,
            WantDump: lambda eff, m: None,  # a dump is there from the start (big_fleet)
        }

    def _send_dump(self, eff: SendDump, m: Member) -> None:
        """The dump sender's work (another thread of the member): the file's bytes with the
        node's body, packed and sent; its CPU is not the jobs thread's."""
        t0 = time.process_time()
        assert m.dump is not None
        self._send(Send(eff.to, "F_JOB_STATE", {**eff.body, "dump": m.dump}, table=True), m,
                   counted=False)
        spent = time.process_time() - t0
        self.sender_cpu_s += spent
        self._sender_step_s += spent

    # --- Raft, modelled ------------------------------------------------------------------------

    def _view(self, m: Member) -> View:
        if self.leader == m.name:
            return View(self.term, m.name, True, m.pos >= self.ready_pos)
        return View(self.term, self.leader, False, False)

    def _persist(self, m: Member, entry: dict) -> None:
        if m.name != self.leader:
            return
        self.tail.append((_pack(entry), self.now + COMMIT_MS))

    def _raft(self) -> None:
        if self.leader is None and self.now >= self.election_at:
            live = [v for v in self.voters if self.members[v].alive]
            if len(live) * 2 > len(self.voters):
                self.leader = live[0]
                self.term += 1
                self.last_index += 1  # the new leader's no-op
                self.ready_pos = len(self.log)
        if self.leader is None:
            return
        fresh = False
        while self.tail and self.tail[0][1] <= self.now:
            raw = self.tail.popleft()[0]
            self.last_index += 1
            self.log.append((self.last_index, raw))
            self._committed(_unpack(raw))
            fresh = True
        if not fresh and all(self.members[v].pos == len(self.log) for v in self.voters
                             if self.members[v].alive):
            return
        for v in self.voters:
            m = self.members[v]
            if not m.alive:
                continue
            for index, raw in self.log[m.pos:]:
                e = _unpack(raw)
                prev = m.table.applied_index
                m.inbox.append(Applied(index, e, m.table.apply(e, index), prev))
            m.pos = len(self.log)

    def _committed(self, e: dict) -> None:
        """What the harness notes of a committed entry: submits (for lease latency) and leases
        (for the failover's time to the first lease)."""
        for sub in e.get("es", ()) if e.get("k") == "batch" else (e,):
            if sub.get("k") == "submit" and sub.get("id") not in self.seen_jobs:
                self.seen_jobs.add(sub["id"])
                for i in range(entry_item_count(sub)):
                    self.waiting.append((sub["id"], i))
                self._rebalance()
            elif (sub.get("k") == "lease" and self.watch_from is not None
                  and self.first_lease_ms is None):
                self.first_lease_ms = self.now - self.watch_from

    # --- the fleet's slots, for lease latency --------------------------------------------------

    def _slots(self) -> int:
        return sum(m.slots for m in self.members.values() if m.alive and m.role == "worker")

    def _rebalance(self) -> None:
        free = self._slots() - self.running_total - len(self.eligible)
        while free > 0 and self.waiting:
            key = self.waiting.popleft()
            if key not in self.ran:
                self.eligible[key] = self.now
                free -= 1

    # --- links ---------------------------------------------------------------------------------

    def _send(self, eff: Send, m: Member, counted: bool = True) -> None:
        t0 = time.process_time()
        raw = _pack(eff.body)
        if counted:
            self.pack_cpu_s[m.name] = self.pack_cpu_s.get(m.name, 0.0) + time.process_time() - t0
        f = self.frames.setdefault(eff.ftype, [0, 0])
        f[0] += 1
        f[1] += len(raw)
        start = max(self.egress.get(m.name, 0.0), float(self.now))
        self.egress[m.name] = start + len(raw) / self.bytes_per_ms
        at = int(math.ceil(self.egress[m.name])) + LINK_LATENCY_MS
        dst = self.members.get(eff.to)
        body = eff.body if eff.to in self.thin else raw
        self._at(at, "frame", (m.name, m.inc, eff.to, dst.inc if dst else 0, eff.ftype, body))

    def _at(self, t: int, kind: str, payload: Any) -> int:
        self.seq += 1
        heapq.heappush(self.heap, (t, self.seq, kind, payload))
        return self.seq

    def _due(self) -> None:
        while self.heap and self.heap[0][0] <= self.now:
            _t, seq, kind, p = heapq.heappop(self.heap)
            if kind == "frame":
                src, src_inc, dst, dst_inc, ftype, raw = p
                if dst in self.thin:
                    self.thin[dst].frame(src, ftype, raw)
                    continue
                s, d = self.members.get(src), self.members.get(dst)
                if d is None or not d.alive or d.inc != dst_inc or (
                        s is not None and (not s.alive or s.inc != src_inc)):
                    continue
                t0 = time.process_time()
                body = _unpack(raw)
                self.unpack_cpu_s[dst] = self.unpack_cpu_s.get(dst, 0.0) + time.process_time() - t0
                d.inbox.append(FrameIn(src, ftype, body))
            elif kind == "end":
                name, inc, ev = p
                m = self.members[name]
                key = (ev.job_id, ev.index, ev.epoch)
                if not m.alive or m.inc != inc or m.running.get(key) != seq:
                    continue
                del m.running[key]
                self.running_total -= 1
                m.inbox.append(ev)
                self._rebalance()

    def _thin_reports(self) -> None:
        if not self.thin or self.leader is None:
            return
        for t in self.thin.values():
            if self.now >= t.next_have_ms:
                t.next_have_ms = self.now + limits.have_keepalive_ms
                # (A real worker finds a new leader within dead_ms through the voters' hints;
                # a stand-in is told at once.)
                to = self.leader
                raw = _pack(t.have())
                f = self.frames.setdefault("F_JOB_HAVE", [0, 0])
                f[0] += 1
                f[1] += len(raw)
                d = self.members[to]
                self._at(self.now + LINK_LATENCY_MS, "frame",
                         (t.name, 0, to, d.inc, "F_JOB_HAVE", raw))

    # --- the driver ----------------------------------------------------------------------------

    def _run(self, eff: Run, m: Member) -> None:
        key = (eff.job_id, eff.index, eff.epoch)
        self.runs_total += 1
        if self.watch_from is not None and self.first_run_ms is None:
            self.first_run_ms = self.now - self.watch_from
        item = (eff.job_id, eff.index)
        if item in self.ran:
            self.runs_again += 1
        self.ran.add(item)
        since = self.eligible.pop(item, None)
        if since is not None:
            self.lease_ms.append(self.now - since)
        else:
            try:
                self.waiting.remove(item)
            except ValueError:
                pass
        lo, hi = self.run_ms
        run_ms = int(math.exp(self.rng.uniform(math.log(lo), math.log(hi))))
        ev = ItemEnded(eff.job_id, eff.index, eff.epoch, "done", 0, None, None, None,
                       self.now, self.now + run_ms)
        m.running[key] = self._at(self.now + run_ms, "end", (m.name, m.inc, ev))
        self.running_total += 1

    def _cut(self, eff: Cut, m: Member) -> None:
        key = (eff.job_id, eff.index, eff.epoch)
        if m.running.pop(key, None) is None:
            return
        ev = ItemEnded(eff.job_id, eff.index, eff.epoch, "cut", None, 15, None, None,
                       self.now, self.now)
        m.running[key] = self._at(self.now + 5, "end", (m.name, m.inc, ev))

    # --- clients -------------------------------------------------------------------------------

    def _new_client(self) -> None:
        cid = len(self.clients)
        n = self.rng.randint(1, self.items_max)
        req = {"op": "submit", "rid": f"s{cid}", "spec": {"argv": ["sim", str(cid)]},
               "items": [None] * n}
        self.clients.append(Client(cid, req, n, next_ms=self.now))

    def _clients(self) -> None:
        if self.load_on and self.jobs_per_s > 0:
            while self.next_job_ms <= self.now:
                self._new_client()
                self.next_job_ms += max(1, int(self.rng.expovariate(self.jobs_per_s) * 1000))
        for c in self.clients:
            if c.acked:
                continue
            if c.inflight is not None and self.now < c.deadline_ms:
                continue
            if c.inflight is not None:
                self.asked.pop(c.inflight, None)
                c.inflight = None
                c.next_ms = self.now
            if self.now < c.next_ms:
                continue
            live = [v for v in self.voters if self.members[v].alive]
            to = self.members[self.leader if self.leader else self.rng.choice(live)]
            self.tokens += 1
            c.inflight = (to.name, to.inc, self.tokens)
            c.deadline_ms = self.now + CLIENT_TIMEOUT_MS
            self.asked[c.inflight] = c
            to.inbox.append(Ctl(self.tokens, c.req))

    def _reply(self, m: Member, token: int, answer: Answer) -> None:
        c = self.asked.pop((m.name, m.inc, token), None)
        if c is None:
            return
        c.inflight = None
        status, body = answer
        if status in (200, 201):
            c.acked = True
            c.job_id = body["id"]
        else:
            c.next_ms = self.now + CLIENT_RETRY_MS

    # --- driving -------------------------------------------------------------------------------

    def step(self) -> None:
        self.now += 1
        self._due()
        self._raft()
        self._clients()
        self._thin_reports()
        for m in self.members.values():
            if m.alive and (m.inbox or self.now >= m.wake_ms):
                self._step(m)

    def run_until(self, t_ms: int) -> None:
        while self.now < t_ms:
            self.step()

    def run_while(self, busy: Any, ms_max: int) -> bool:
        """Step while `busy()`; False if still busy after `ms_max`."""
        end = self.now + ms_max
        while busy():
            if self.now >= end:
                return False
            self.step()
        return True

    # --- reading -------------------------------------------------------------------------------

    def leader_table(self) -> JobTable:
        assert self.leader is not None
        return self.members[self.leader].table

    def settled(self) -> bool:
        """Every client acknowledged, its job finished, every member's table at the log's end."""
        if self.leader is None or not all(c.acked for c in self.clients):
            return False
        t = self.leader_table()
        if not all(t.jobs[c.job_id].finished for c in self.clients if c.job_id in t.jobs):
            return False
        last = self.log[-1][0] if self.log else 0
        return all(m.table.applied_index >= last for m in self.members.values() if m.alive)

    def reset_figures(self) -> None:
        self.frames = {}
        self.leader_cpu_s = 0.0
        self.lease_ms = []
        self.pack_cpu_s, self.unpack_cpu_s = {}, {}
        self.sender_cpu_s = 0.0
        for m in self.members.values():
            m.cpu_s = 0.0


def build_table(jobs: int, t_ms: int = T0_MS) -> tuple[JobTable, float]:
    """A table of `jobs` finished jobs of one item each (submitted, leased, done), built by
    applying entries as a leader would commit them; and the CPU seconds it took."""
    t0 = time.process_time()
    table = JobTable()
    req = parse_request({"op": "submit", "rid": "r", "spec": {"argv": ["sim", "x"]}, "items": [None]})
    spec = dict(req["spec"])
    spec.pop("id")
    dg = spec_digest(spec, [None])
    idx = 0
    step = 1000
    for b in range(0, jobs, step):
        ids = [f"big{j:07d}" for j in range(b, min(jobs, b + step))]
        idx += 1
        table.apply({"k": "batch", "t": t_ms, "p": idx, "es": [
            {"k": "submit", "rid": "r" + j, "t": t_ms, "id": j, "spec": spec, "dg": dg,
             **pack_items([None])} for j in ids]}, idx)
        idx += 1
        table.apply({"k": "lease", "t": t_ms, "g": [[j, 0, "w001", "w001.1"] for j in ids]}, idx)
        ep = idx
        idx += 1
        table.apply({"k": "result", "t": t_ms, "r": [[j, 0, ep, DONE, 0, None, None, None,
                                                      t_ms, t_ms + 5] for j in ids]}, idx)
    return table, time.process_time() - t0


def copy_table(table: JobTable) -> JobTable:
    return JobTable.from_state(_unpack(_pack(table.to_state())))


# --- the measurements ------------------------------------------------------------------------


def steady(args: argparse.Namespace) -> dict:
    sim = ScaleSim(args.voters, args.workers, args.seed, args.jobs, args.link_mbit)
    warm = 5_000
    sim.run_until(T0_MS + warm)
    sim.reset_figures()
    t_wall = time.monotonic()
    sim.run_until(T0_MS + warm + args.seconds * 1000)
    wall = time.monotonic() - t_wall
    secs = args.seconds
    out = {"sim": sim, "secs": secs, "wall_s": wall, "leader_cpu_per_s": sim.leader_cpu_s / secs,
           "frames": {k: (v[0] / secs, v[1] / secs) for k, v in sim.frames.items()},
           "lease_p50": pct(sim.lease_ms, 50), "lease_p99": pct(sim.lease_ms, 99),
           "leases": len(sim.lease_ms), "runs": sim.runs_total,
           "worker_cpu_per_s": sum(m.cpu_s for m in sim.members.values()
                                   if m.role == "worker") / secs}
    # An idle fleet: what keeps 200 workers in touch with nothing to do.
    sim.load_on = False
    sim.run_while(lambda: not sim.settled(), 120_000)
    sim.reset_figures()
    sim.run_until(sim.now + 10_000)
    out["idle_frames"] = {k: (v[0] / 10, v[1] / 10) for k, v in sim.frames.items()}
    out["idle_leader_cpu_per_s"] = sim.leader_cpu_s / 10
    return out


def big_fleet(args: argparse.Namespace, workers: int) -> tuple[ScaleSim, dict]:
    """Voters with a table of `--catchup-jobs` finished jobs (no entries in anyone's ring),
    and, unless `--no-dumps`, a dump of it in each voter's folder (as after a compaction)."""
    table, build_s = build_table(args.catchup_jobs)
    sim = ScaleSim(args.voters, workers, args.seed, 0.0, args.link_mbit)
    dump = None
    if not args.no_dumps:
        from meshjobs import dumpbytes

        pos = table.applied_index
        body = dumpbytes.payload(table.to_state(), (b"", pos, 1), (b"", pos - 1, 1), [])
        dump = dumpbytes.header(body) + body
    for k, v in enumerate(sim.voters):
        m = sim.members[v]
        m.table.load(table if k == 0 else copy_table(table))
        if dump is not None:
            m.dump = dump
            m.inbox.append(DumpReady(table.applied_index))
    sim.last_index = table.applied_index
    sim.run_until(sim.now + 3_000)
    return sim, {"build_s": build_s}


def catchup(args: argparse.Namespace) -> dict:
    sim, out = big_fleet(args, 0)
    sim.reset_figures()
    start = sim.now
    w = sim.add_worker("wnew", 4)
    done = sim.run_while(lambda: w.table.applied_index < sim.leader_table().applied_index
                         or not w.table.jobs, 600_000)
    out.update({"ok": done, "ms": sim.now - start, "leader_cpu_s": sim.leader_cpu_s,
                "leader_pack_s": sim.pack_cpu_s.get(sim.leader or "", 0.0),
                "sender_cpu_s": sim.sender_cpu_s,
                "worker_cpu_s": w.cpu_s + sim.unpack_cpu_s.get("wnew", 0.0),
                "bytes": sum(v[1] for k, v in sim.frames.items() if k == "F_JOB_STATE"),
                "jobs": len(w.table.jobs)})
    return out


def failover(args: argparse.Namespace) -> dict:
    """200 thin workers caught up with a table of --catchup-jobs, plus one real worker with
    slots; the leader is killed; jobs are submitted right after. Time to the first lease
    committed and the first Run, and the bytes and CPU the new leader spends on the workers."""
    sim, out = big_fleet(args, 0)
    applied = sim.leader_table().applied_index
    for k in range(1, args.workers + 1):
        # Following the leader already (they would have caught up one by one as they joined).
        sim.add_thin(f"t{k:03d}").pos = applied
    real = sim.add_worker("wreal", 8)
    ok = sim.run_while(lambda: real.table.applied_index < applied or any(
        t.pos < applied for t in sim.thin.values()), 900_000)
    old = sim.leader
    sim.reset_figures()
    sim.watch_from = sim.now
    sim.kill(old)
    for _ in range(3):
        sim._new_client()
    sim.run_while(lambda: sim.first_run_ms is None, 900_000)
    new = sim.leader
    window = sim.now - sim.watch_from
    out.update({"caught_up_before": ok, "first_lease_ms": sim.first_lease_ms,
                "first_run_ms": sim.first_run_ms, "window_ms": window,
                "leader_cpu_s": sim.leader_cpu_s,
                "state_bytes": sim.frames.get("F_JOB_STATE", [0, 0])[1],
                "state_frames": sim.frames.get("F_JOB_STATE", [0, 0])[0],
                "snapshots": sim.members[new].node.counts.get("state_snapshots_sent", 0)})
    return out


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="scale.py sim", description=__doc__.split("\n\n")[0])
    ap.add_argument("--voters", type=int, default=5)
    ap.add_argument("--workers", type=int, default=200)
    ap.add_argument("--jobs", type=float, default=3.0, help="submits per simulated second")
    ap.add_argument("--seconds", type=int, default=30, help="simulated seconds measured")
    ap.add_argument("--catchup-jobs", type=int, default=100_000)
    ap.add_argument("--link-mbit", type=float, default=1000.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--only", choices=("steady", "catchup", "failover"), action="append")
    ap.add_argument("--no-dumps", action="store_true",
                    help="voters have no dump: a new worker is sent the table built and packed "
                         "on the leader's jobs thread (the path before dumps were sent)")
    args = ap.parse_args(argv)
    parts = args.only or ["steady", "catchup", "failover"]
    from bench.common import machine
    print(f"# scale sim: {args.voters} voters, {args.workers} workers, {args.jobs} jobs/s, "
          f"{args.seconds} s simulated")
    if "steady" in parts:
        s = steady(args)
        print(f"\n## Steady load ({s['runs']} runs, {s['wall_s']:.0f} s of wall time)\n")
        print("| figure | value |\n|---|---|")
        print(f"| leader CPU per simulated s | {s['leader_cpu_per_s'] * 1000:.1f} ms |")
        print(f"| all workers' CPU per simulated s | {s['worker_cpu_per_s'] * 1000:.1f} ms |")
        print(f"| lease latency p50 / p99 ({s['leases']} leases) | {s['lease_p50']:.0f} ms / "
              f"{s['lease_p99']:.0f} ms |")
        print(f"| idle leader CPU per s | {s['idle_leader_cpu_per_s'] * 1000:.1f} ms |")
        print("\n| frame | frames/s (load) | bytes/s (load) | frames/s (idle) | bytes/s (idle) |")
        print("|---|---|---|---|---|")
        for ft in FRAME_TYPES:
            a = s["frames"].get(ft, (0, 0))
            b = s["idle_frames"].get(ft, (0, 0))
            print(f"| {ft} | {a[0]:.0f} | {a[1]:,.0f} | {b[0]:.0f} | {b[1]:,.0f} |")
    if "catchup" in parts:
        c = catchup(args)
        print(f"\n## A new worker catches up on {args.catchup_jobs:,} jobs\n")
        print("| figure | value |\n|---|---|")
        print(f"| caught up | {c['ok']} ({c['jobs']:,} jobs) |")
        print(f"| simulated time | {c['ms']:,} ms |")
        print(f"| bytes (F_JOB_STATE) | {c['bytes']:,} |")
        print(f"| leader jobs-thread CPU (table built and packed, or dump asked for) | "
              f"{c['leader_cpu_s'] * 1000:.0f} ms |")
        print(f"| leader dump sender CPU (off the jobs thread) | {c['sender_cpu_s'] * 1000:.0f} ms |")
        print(f"| worker CPU (unpacked, loaded) | {c['worker_cpu_s'] * 1000:.0f} ms |")
    if "failover" in parts:
        f = failover(args)
        print(f"\n## Leader failover, {args.workers} workers following {args.catchup_jobs:,} "
              "jobs\n")
        print("| figure | value |\n|---|---|")
        print(f"| workers caught up before | {f['caught_up_before']} |")
        print(f"| first lease committed after the kill | {f['first_lease_ms']} ms |")
        print(f"| first Run at a worker after the kill | {f['first_run_ms']} ms |")
        print(f"| new leader CPU until then | {f['leader_cpu_s'] * 1000:,.0f} ms |")
        print(f"| F_JOB_STATE frames / bytes until then | {f['state_frames']} / "
              f"{f['state_bytes']:,} |")
        print(f"| snapshots sent by the new leader | {f['snapshots']} |")
    print(f"\nmachine: {machine()}; load average {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
