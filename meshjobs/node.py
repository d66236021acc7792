"""The job node: one member's decisions, as a pure state machine.

Theory of operation. The node reads the committed job table and takes events: control requests,
committed entries (with their outcomes), changes of the Raft view, ends of items the driver ran,
and ticks of time. It answers with effects: entries to propose, answers to clients, items to run
or cut, blobs to pin or unpin. The jobs thread (`jobsd.py`) feeds it and carries its effects out
through the durability gate: every effect but a proposal waits until the journal it depends on is
fsynced.

Rule 1: pure. No IO, threads, clocks or randomness: time comes in events, ids come from the
        injected `random.Random`.
Rule 2: level-triggered. After every batch of events, `take()` compares what the table says with
        what this member is doing (items leased to it and not running, runs whose lease is gone,
        leases of incarnations that are gone, pending items and free slots) and emits what closes
        the gap. An effect that is lost (a proposal that never commits, a frame that never arrives)
        is made again later; the table, deduplicating by request id and lease epoch, makes a
        repeat harmless.
Rule 3: only the leader proposes leases, revokes and results, and only while it is ready (its
        table holds every committed entry of its term).
Rule 4: a change is answered only once its entry is applied; a read is answered from the table.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import blake3
import msgpack

from meshjobs import limits
from meshjobs.control import Answer, ControlError, parse_request
from meshjobs.table import DONE, FAILED, TIMEOUT, JobTable

# --- events -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Tick:
    now_ms: int


@dataclass(frozen=True)
class Ctl:
    token: int
    req: Any


@dataclass(frozen=True)
class Applied:
    index: int
    entry: Any
    outcome: dict


@dataclass(frozen=True)
class View:
    term: int = 0
    leader: str | None = None
    is_leader: bool = False
    ready: bool = False  # leader: its table holds every committed entry of its term


@dataclass(frozen=True)
class Pressure:
    """The blob store holds more payload bytes in memory than it may (on), or drained (off)."""

    on: bool


@dataclass(frozen=True)
class ItemEnded:
    job_id: str
    index: int
    epoch: int
    state: str  # done | failed | timeout | cut
    rc: int | None
    signal: int | None
    stdout: str | None
    stderr: str | None
    started_ms: int
    ended_ms: int
    error: str | None = None


# --- effects ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Propose:
    entry: dict


@dataclass(frozen=True)
class Reply:
    token: int
    answer: Answer


@dataclass(frozen=True)
class Run:
    job_id: str
    index: int
    epoch: int
    argv: list[str]
    env: dict[str, str]
    cwd: str | None
    stdin: str | None
    runtime_s: float | None


@dataclass(frozen=True)
class Cut:
    job_id: str
    index: int
    epoch: int


@dataclass(frozen=True)
class Pin:
    owner: str
    digests: tuple[str, ...]


@dataclass(frozen=True)
class Unpin:
    owner: str


@dataclass(frozen=True)
class UnpinAllBut:
    keep: frozenset[str]


@dataclass
class _Change:
    tokens: list[int]
    deadline_ms: int
    op: str
    job_id: str | None


@dataclass
class Pool:
    name: str
    kind: str = "command"
    slots: int = 1
    runtime_s: float | None = None


@dataclass
class NodeConfig:
    member: str
    boot: str  # this incarnation of the member; leases name it
    pools: dict[str, Pool] = field(default_factory=dict)
    keep_s: float | None = None  # retention: forget finished jobs older than this
    keep_jobs: int | None = None  # retention: keep at most this many finished jobs


def spec_digest(spec: dict, items: list[bytes | None]) -> bytes:
    """What makes two submits "the same job": everything but the id, items included."""
    body = msgpack.packb([sorted((k, v) for k, v in spec.items() if k != "id"), items],
                         use_bin_type=True)
    return blake3.blake3(body).digest()


class JobNode:
    """One member's job node. Feed it with `step`, collect its effects with `take`."""

    def __init__(self, table: JobTable, config: NodeConfig, rng: random.Random) -> None:
        self.table = table
        self.cfg = config
        self.rng = rng
        self.now_ms = 0
        self.view = View()
        self._out: list[Any] = []
        self._changes: dict[str, _Change] = {}
        self._waiters: dict[str, list[tuple[int, bool, int]]] = {}
        self._inflight: dict[tuple[str, int], tuple[int, str]] = {}  # grant -> (proposed ms, pool)
        self._running: dict[tuple[str, int, int], bool] = {}  # run -> ended
        self._results: dict[tuple[str, int, int], list] = {}
        self._results_sent: dict[tuple[str, int, int], int] = {}
        self._revoking: dict[tuple[str, int, int], int] = {}
        self._was_ready = False
        self._pressure = False
        self._expiring: dict[str, int] = {}
        self._next_housekeeping_ms = 0
        self.counts: dict[str, int] = {}

    # --- stepping ---------------------------------------------------------------------------

    def step(self, ev: Any) -> None:
        if isinstance(ev, Tick):
            if ev.now_ms > self.now_ms:
                self.now_ms = ev.now_ms
        elif isinstance(ev, Ctl):
            self._ctl(ev.token, ev.req)
        elif isinstance(ev, Applied):
            self._applied(ev)
        elif isinstance(ev, View):
            self.view = ev
        elif isinstance(ev, ItemEnded):
            self._ended(ev)
        elif isinstance(ev, Pressure):
            self._pressure = ev.on
            self._count("pressure_on" if ev.on else "pressure_off")
        else:
            raise AssertionError(f"unknown event {ev!r}")

    def take(self) -> list[Any]:
        """Reconcile, then hand over every effect made since the last call."""
        self._reconcile()
        out, self._out = self._out, []
        return out

    def next_deadline_ms(self) -> int | None:
        """When the node next needs a tick even if nothing happens."""
        ds = [c.deadline_ms for c in self._changes.values()]
        ds += [w[2] for ws in self._waiters.values() for w in ws]
        due = self.table.next_due_ms(self.now_ms)
        if due is not None:
            ds.append(due)
        return min(ds) if ds else None

    def _count(self, name: str, n: int = 1) -> None:
        self.counts[name] = self.counts.get(name, 0) + n

    def _reply(self, token: int, status: int, body: Any) -> None:
        self._out.append(Reply(token, Answer(status, body)))

    # --- control ------------------------------------------------------------------------------

    def _ctl(self, token: int, raw: Any) -> None:
        try:
            req = parse_request(raw)
        except ControlError as e:
            self._count("ctl_bad")
            self._out.append(Reply(token, e.answer()))
            return
        op = req["op"]
        self._count("ctl_" + op)
        if op == "get":
            self._get(token, req)
        elif op == "list":
            self._reply(token, 200, [self.table.record(j) for j in self.table.jobs.values()
                                     if (req["state"] is None or j.state == req["state"])
                                     and (req["tag"] is None or req["tag"] in j.tags)])
        elif op == "fleet":
            self._reply(token, 200, self.fleet())
        elif op == "health":
            self._reply(token, 200, self.health())
        elif op == "metrics":
            self._reply(token, 200, self.metrics())
        else:
            self._change(token, req)

    def _get(self, token: int, req: dict) -> None:
        job = self.table.jobs.get(req["id"])
        if job is None:
            self._not_found(token, req["id"])
            return
        if req["wait_ms"] and not job.finished:
            self._waiters.setdefault(job.id, []).append(
                (token, req["items"], self.now_ms + req["wait_ms"]))
            return
        self._reply(token, 200, self.table.record(job, items=req["items"]))

    def _not_found(self, token: int, job_id: str) -> None:
        if job_id in self.table.forgotten:
            self._reply(token, 404, {"error": f"job {job_id} was forgotten"})
        else:
            self._reply(token, 404, {"error": f"no job {job_id} (see `meshctl jobs`)"})

    def _change(self, token: int, req: dict) -> None:
        rid = req["rid"]
        if rid in self._changes:  # the same change asked again while it is in flight
            self._changes[rid].tokens.append(token)
            return
        seen = self.table.rids.get(rid)
        if seen is not None:  # already applied: answer as then
            self._answer_change(token, req["op"], req.get("id"), seen)
            return
        if not (self.view.is_leader and self.view.ready):
            self._count("ctl_no_leader")
            self._reply(token, 503, {"error": "this member cannot commit changes now (no leader, "
                                              "or the leader is still starting): try again shortly"})
            return
        if len(self._changes) >= limits.ctl_pending_max:
            self._reply(token, 503, {"error": "too many changes in flight: try again shortly"})
            return
        op = req["op"]
        entry: dict[str, Any] = {"k": op, "rid": rid, "t": self.now_ms}
        if op == "submit":
            job_id = self._submit_entry(token, req, entry)
            if job_id is None:
                return
        else:
            job_id = req["id"]
            if job_id not in self.table.jobs:
                self._not_found(token, job_id)
                return
            entry["id"] = job_id
            if op == "tone":
                for k in ("priority", "hold", "max_leases"):
                    if k in req:
                        entry[k] = req[k]
        self._changes[rid] = _Change([token], self.now_ms + limits.ctl_commit_ms_max, op, job_id)
        self._out.append(Propose(entry))

    def _submit_entry(self, token: int, req: dict, entry: dict) -> str | None:
        spec = dict(req["spec"])
        pools = self.cfg.pools
        if spec["pool"] not in pools:
            self._reply(token, 400, {"error": f"unknown pool {spec['pool']!r}: this fleet has "
                                              f"{', '.join(sorted(pools)) or 'no pools'}"})
            return None
        items = [None if d is None else bytes.fromhex(d) for d in req["items"]]
        digest = spec_digest(spec, items)
        job_id = spec.pop("id")
        if job_id is None:
            job_id = self._new_id()
        elif job_id in self.table.forgotten:
            self._reply(token, 409, {"error": f"job id {job_id} was used by a job that is now "
                                              "forgotten; submit with another id"})
            return None
        else:
            job = self.table.jobs.get(job_id)
            if job is not None:
                if job.digest == digest:
                    self._reply(token, 200, self.table.record(job))
                else:
                    self._reply(token, 409, {"error": f"a different job with id {job_id} exists; "
                                                      "submit with another id or the same spec"})
                return None
        entry.update({"id": job_id, "spec": spec, "dg": digest, "items": items})
        return job_id

    def _new_id(self) -> str:
        while True:
            job_id = f"{self.now_ms // 1000:x}-{self.rng.getrandbits(32):08x}"
            if job_id not in self.table.jobs and job_id not in self.table.forgotten and all(
                c.job_id != job_id for c in self._changes.values()
            ):
                return job_id

    def _answer_change(self, token: int, op: str, job_id: str | None, outcome: dict) -> None:
        if not outcome.get("ok"):
            self._reply(token, outcome.get("status", 409), {"error": outcome.get("error", "refused")})
            return
        job_id = outcome.get("id", job_id)
        job = self.table.jobs.get(job_id) if job_id is not None else None
        if op == "forget":
            self._reply(token, 200, {"id": job_id, "forgotten": True})
        elif job is None:
            self._not_found(token, job_id or "")
        else:
            self._reply(token, 201 if outcome.get("new") else 200, self.table.record(job))

    # --- committed entries --------------------------------------------------------------------

    def _applied(self, ev: Applied) -> None:
        e, out = ev.entry, ev.outcome
        if not isinstance(e, dict):
            return
        kind = e.get("k")
        rid = e.get("rid")
        if rid is not None and rid in self._changes:
            ch = self._changes.pop(rid)
            for token in ch.tokens:
                self._answer_change(token, ch.op, ch.job_id, out)
        if not out.get("ok"):
            return
        if kind == "submit" and out.get("new"):
            digests = tuple(sorted({d.hex() for d in e["items"] if d is not None}))
            if digests:
                self._out.append(Pin(e["id"], digests))
        elif kind == "lease":
            for g in e["g"]:
                self._inflight.pop((g[0], g[1]), None)
        elif kind == "result":
            for r in e["r"]:
                key = (r[0], r[1], r[2])
                self._results.pop(key, None)
                self._results_sent.pop(key, None)
        elif kind == "revoke":
            for lease in e["l"]:
                self._revoking.pop(tuple(lease), None)
        elif kind == "forget":
            self._out.append(Unpin(e["id"]))
        elif kind == "expire":
            for job_id in out["expired"]:
                self._expiring.pop(job_id, None)
                self._out.append(Unpin(job_id))

    def _ended(self, ev: ItemEnded) -> None:
        key = (ev.job_id, ev.index, ev.epoch)
        if key not in self._running:
            self._count("ends_unknown")
            return
        self._running[key] = True
        outs = tuple(d for d in (ev.stdout, ev.stderr) if d is not None)
        if outs:
            self._out.append(Pin(ev.job_id, outs))
        if ev.state == "cut":
            return
        code = {"done": DONE, "failed": FAILED, "timeout": TIMEOUT}.get(ev.state)
        if code is None:
            raise AssertionError(f"driver reported unknown state {ev.state!r}")
        self._results[key] = [
            ev.job_id, ev.index, ev.epoch, code, ev.rc, ev.signal,
            None if ev.stdout is None else bytes.fromhex(ev.stdout),
            None if ev.stderr is None else bytes.fromhex(ev.stderr),
            ev.started_ms, ev.ended_ms,
        ]

    # --- reconciling --------------------------------------------------------------------------

    def _reconcile(self) -> None:
        now = self.now_ms
        for rid, ch in list(self._changes.items()):
            if ch.deadline_ms <= now:
                del self._changes[rid]
                self._count("ctl_timeouts")
                for token in ch.tokens:
                    self._reply(token, 503, {
                        "error": "the change was not committed in time (no leader or no quorum); "
                                 "it may still be applied: retry with the same request id"})
        self._answer_waiters()
        if self.view.is_leader and self.view.ready:
            if not self._was_ready:
                self._was_ready = True
                self._out.append(UnpinAllBut(frozenset(self.table.jobs)))
            self._propose_revokes()
            self._propose_leases()
            self._propose_results()
            self._propose_expiry()
        self._follow_own_leases()

    def _answer_waiters(self) -> None:
        if not self._waiters:
            return
        now = self.now_ms
        for job_id in list(self._waiters):
            job = self.table.jobs.get(job_id)
            ws = self._waiters[job_id]
            keep = []
            for token, items, deadline in ws:
                if job is None:
                    self._not_found(token, job_id)
                elif job.finished or deadline <= now:
                    self._reply(token, 200, self.table.record(job, items=items))
                else:
                    keep.append((token, items, deadline))
            if keep:
                self._waiters[job_id] = keep
            else:
                del self._waiters[job_id]

    def _live(self, member: str, boot: str) -> bool:
        return member == self.cfg.member and boot == self.cfg.boot

    def _propose_revokes(self) -> None:
        now = self.now_ms
        dead = []
        for (jid, i), (member, boot) in self.table.leased.items():
            if self._live(member, boot):
                continue
            key = (jid, i, self.table.jobs[jid].epoch[i])
            sent = self._revoking.get(key)
            if sent is not None and now - sent < limits.proposal_retry_ms:
                continue
            self._revoking[key] = now
            dead.append(list(key))
            if len(dead) >= limits.lease_batch_max:
                break
        if dead:
            self._count("revokes_proposed", len(dead))
            self._out.append(Propose({"k": "revoke", "t": now, "l": dead}))

    def _propose_leases(self) -> None:
        now = self.now_ms
        for key, (sent, _pool) in list(self._inflight.items()):
            if now - sent >= limits.proposal_retry_ms:
                del self._inflight[key]
        used: dict[str, int] = {}
        for (jid, _i), (member, _boot) in self.table.leased.items():
            if member == self.cfg.member:
                pool = self.table.jobs[jid].pool
                used[pool] = used.get(pool, 0) + 1
        for _sent, pool in self._inflight.values():
            used[pool] = used.get(pool, 0) + 1
        grants = []
        # Under blob backpressure this member takes no new leases until the store drains.
        pools = () if self._pressure else self.cfg.pools.values()
        for pool in pools:
            free = min(pool.slots - used.get(pool.name, 0), limits.lease_batch_max - len(grants))
            if free <= 0:
                continue
            for jid, i in self.table.pick(pool.name, free, now, set(self._inflight)):
                self._inflight[(jid, i)] = (now, pool.name)
                grants.append([jid, i, self.cfg.member, self.cfg.boot])
        if grants:
            self._count("leases_proposed", len(grants))
            self._out.append(Propose({"k": "lease", "t": now, "g": grants}))

    def _propose_results(self) -> None:
        now = self.now_ms
        rows = []
        for key, row in self._results.items():
            sent = self._results_sent.get(key)
            if sent is not None and now - sent < limits.proposal_retry_ms:
                continue
            self._results_sent[key] = now
            rows.append(row)
            if len(rows) >= limits.result_batch_max:
                break
        if rows:
            self._count("results_proposed", len(rows))
            self._out.append(Propose({"k": "result", "t": now, "r": rows}))

    def _propose_expiry(self) -> None:
        """Retention: forget the oldest finished jobs past `keep_s` or beyond `keep_jobs`."""
        now = self.now_ms
        keep_s, keep_jobs = self.cfg.keep_s, self.cfg.keep_jobs
        if now < self._next_housekeeping_ms or (keep_s is None and keep_jobs is None):
            return
        self._next_housekeeping_ms = now + limits.publish_ms
        finished = self.table.finished
        excess = len(finished) - keep_jobs if keep_jobs is not None else 0
        cutoff = now - int(keep_s * 1000) if keep_s is not None else None
        ids = []
        for job_id, finished_ms in finished.items():  # oldest first
            if len(ids) >= limits.lease_batch_max:
                break
            if excess <= 0 and (cutoff is None or finished_ms > cutoff):
                break
            excess -= 1
            sent = self._expiring.get(job_id)
            if sent is None or now - sent >= limits.proposal_retry_ms:
                self._expiring[job_id] = now
                ids.append(job_id)
        if ids:
            self._count("expiries_proposed", len(ids))
            self._out.append(Propose({"k": "expire", "t": now, "ids": ids}))

    def _follow_own_leases(self) -> None:
        table = self.table
        for key, ended in list(self._running.items()):
            if not table.lease_current(*key):
                del self._running[key]
                self._results.pop(key, None)
                self._results_sent.pop(key, None)
                if not ended:
                    self._out.append(Cut(*key))
        # A lease naming this incarnation's boot id was made after this process started, so it
        # is safe to run whatever the member's role; leases of earlier boots are revoked.
        for jid, i, epoch, boot in table.leases_of(self.cfg.member):
            key = (jid, i, epoch)
            if boot != self.cfg.boot or key in self._running:
                continue
            job = table.jobs[jid]
            pool = self.cfg.pools.get(job.pool)
            runtime = job.runtime_s
            if pool is not None and pool.runtime_s is not None:
                runtime = pool.runtime_s if runtime is None else min(runtime, pool.runtime_s)
            stdin = job.stdin[i]
            self._running[key] = False
            self._count("runs_started")
            self._out.append(Run(jid, i, epoch, list(job.argv), dict(job.env), job.cwd,
                                 None if stdin is None else stdin.hex(), runtime))

    # --- reads ----------------------------------------------------------------------------------

    def fleet(self) -> dict:
        running = sum(1 for ended in self._running.values() if not ended)
        return {
            "term": self.view.term,
            "leader": self.view.leader,
            "members": [{
                "name": self.cfg.member,
                "role": "leader" if self.view.is_leader else "follower",
                "alive": True,
                "pools": {p.name: {"kind": p.kind, "slots": p.slots} for p in self.cfg.pools.values()},
                "slots": sum(p.slots for p in self.cfg.pools.values()),
                "running": running,
                "blob_pressure": self._pressure,
                "last_seen": self.now_ms / 1000.0,
            }],
        }

    def health(self) -> dict:
        return {
            "ok": True,
            "member": self.cfg.member,
            "leader": self.view.leader,
            "is_leader": self.view.is_leader,
            "ready": self.view.ready,
            "term": self.view.term,
            "applied_index": self.table.applied_index,
            "jobs": len(self.table.jobs),
        }

    def metrics(self) -> dict:
        m: dict[str, float] = {"table_" + k: v for k, v in self.table.counts.items()}
        m.update({"node_" + k: v for k, v in self.counts.items()})
        m["jobs"] = len(self.table.jobs)
        m["jobs_forgotten_total"] = len(self.table.forgotten)
        m["items_leased"] = len(self.table.leased)
        m["items_running"] = sum(1 for ended in self._running.values() if not ended)
        m["changes_in_flight"] = len(self._changes)
        m["raft_term"] = self.view.term
        m["is_leader"] = 1 if self.view.is_leader else 0
        m["applied_index"] = self.table.applied_index
        return m

