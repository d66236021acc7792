"""A model-based test of the job table (meshjobs/table.py) with hypothesis.

A `RuleBasedStateMachine` drives a real `JobTable` with random submits (ids from a small pool, so
conflicts and forgotten ids happen), leases (of picked and of random items), results (under
current and stale epochs), revokes, cancels, forgets, tones, garbage entries and snapshot round
trips, and keeps a simple model of what the table must hold. Some submits wait for other jobs
(`after`): the model settles dependents the plainest way, to a fixpoint after each entry. After every step the table's own
check passes and agrees with the model: item states, epochs, queues, backoffs, tombstones and
counters.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgpack
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from meshjobs import limits
from meshjobs.table import ITEM_STATE_NAMES, JobTable, backoff_ms

# Ids are six characters or more so that garbage (short strings) never names a real job.
JOB_IDS = ["job-aa", "job-bb", "job-cc", "job-dd", "job-ee", "job-ff"]
RIDS = ["rid-0", "rid-1", "rid-2", "rid-3"]
POOLS = ["default", "gpu"]
KINDS = ["submit", "lease", "result", "revoke", "cancel", "forget", "tone", "rerun"]
FINAL = {"done", "failed", "timeout", "cancelled"}
SATISFIED = {"ok": {"done"}, "end": {"done", "failed", "cancelled", "dep_failed"},
             "fail": {"failed", "cancelled", "dep_failed"}}
CODES = {"done": 2, "failed": 3, "timeout": 4}
# Tombstones kept while the machine runs (limits.forgotten_ids_max, made small so that the
# oldest are dropped and their ids submitted again within a run).
FORGOTTEN_MAX = 2


@dataclass
class MItem:
    state: str = "pending"
    epoch: int = 0
    attempts: int = 0
    fails: int = 0
    error: str | None = None  # why its last try failed without running
    copies: tuple[str, ...] = ()  # the other members that held its outputs at its last result
    tried: list[int] = field(default_factory=list)  # earlier attempts said (the last kept)

    def note(self) -> None:
        """Its current attempt ended without its result: said once, the oldest dropped."""
        if self.attempts and (not self.tried or self.tried[-1] < self.attempts):
            self.tried = (self.tried + [self.attempts])[-limits.item_attempts_kept_max:]


@dataclass
class MJob:
    seq: int
    digest: bytes
    pool: str
    retries: int
    priority: int
    hold: bool
    max_leases: int | None
    items: list[MItem]
    queue: list[int]
    not_before: dict[int, int] = field(default_factory=dict)
    finished_ms: int = 0
    cancelled: bool = False
    started: bool = False
    waiting_on: dict[str, str] = field(default_factory=dict)
    dep_failed: bool = False
    run: int = 1  # a finished job run again (`rerun`) counts up
    after: list[dict] = field(default_factory=list)  # its parents, as submitted
    who: str = "anonymous"  # its submitter
    running_items_max: int | None = None  # the submitter's, recorded at the submit

    def n(self, state: str) -> int:
        return sum(1 for it in self.items if it.state == state)

    @property
    def state(self) -> str:
        if self.cancelled:
            return "cancelled"
        if self.dep_failed:
            return "dep_failed"
        if self.finished_ms:
            return "failed" if self.n("failed") + self.n("timeout") else "done"
        if self.waiting_on:
            return "waiting"
        if self.hold:
            return "held"
        return "running" if self.started else "queued"


class Model:
    """What the table must be, kept the simplest way."""

    def __init__(self) -> None:
        self.jobs: dict[str, MJob] = {}
        self.forgotten: list[str] = []  # oldest first, at most FORGOTTEN_MAX
        self.rids: dict[str, dict] = {}
        self.counts: dict[str, int] = {}
        self.seq = 0
        # Every result the table committed: (job, item, epoch).
        self.accepted: set[tuple[str, int, int]] = set()

    def count(self, name: str, n: int = 1) -> None:
        if n:
            self.counts[name] = self.counts.get(name, 0) + n

    def refuse(self, status: int, reason: str) -> dict:
        self.count("refused_" + reason)
        return {"ok": False, "status": status, "reason": reason}

    def lookup(self, job_id: str) -> MJob | dict:
        job = self.jobs.get(job_id)
        if job is None:
            return self.refuse(404, "forgotten" if job_id in self.forgotten else "unknown_job")
        return job

    def apply(self, e: dict, index: int) -> dict:
        """The outcome the table must give for a well-formed entry `e` (ours, not garbage)."""
        self.count("entries")
        rid = e.get("rid")
        if rid is not None and rid in self.rids:
            self.count("duplicate_rids")
            return self.rids[rid]
        out = getattr(self, "_" + e["k"])(e, index, e["t"])
        changed = self.settle(e["t"])
        if changed and out.get("ok"):
            out["deps"] = changed
        if rid is not None:
            self.rids[rid] = {k: v for k, v in out.items() if k != "deps"}
        return out

    def settle(self, t: int) -> list[str]:
        """Dependents whose parents have ended: released, or dep_failed; until nothing moves.
        Returns the jobs changed (their order is the table's business: compared as a set)."""
        changed: list[str] = []
        moved = True
        while moved:
            moved = False
            for jid, j in self.jobs.items():
                for p in list(j.waiting_on):
                    parent = self.jobs[p]
                    if not parent.finished_ms:
                        continue
                    on = j.waiting_on.pop(p)
                    if parent.state not in SATISFIED[on]:
                        self.dep_fail(j, t)
                        changed.append(jid)
                        moved = True
                        break
                    changed.append(jid)
                    if not j.waiting_on:
                        self.count("jobs_released")
        return changed

    def dep_fail(self, j: MJob, t: int) -> None:
        j.waiting_on.clear()
        for it in j.items:
            it.state = "cancelled"
        j.queue.clear()
        j.not_before.clear()
        j.dep_failed = True
        j.finished_ms = max(t, 1)
        self.count("jobs_dep_failed")

    def _submit(self, e: dict, index: int, t: int) -> dict:
        job_id = e["id"]
        if job_id in self.forgotten:
            return self.refuse(409, "forgotten")
        old = self.jobs.get(job_id)
        if old is not None:
            if old.digest == e["dg"]:
                return {"ok": True, "id": job_id, "new": False}
            return self.refuse(409, "conflict")
        s = e["spec"]
        after = s.get("after") or []
        if any(d["id"] == job_id or d["id"] not in self.jobs for d in after):
            return self.refuse(400, "bad_after")
        n = len(e["items"])
        self.seq += 1
        job = self.jobs[job_id] = MJob(self.seq, e["dg"], s["pool"], s["retries"],
                                       s["priority"], s["hold"], s["max_leases"],
                                       [MItem() for _ in range(n)], list(range(n)))
        job.after = list(after)
        job.who = s.get("submitted_by", "anonymous")
        job.running_items_max = s.get("running_items_max")
        self.count("jobs_submitted")
        self.count("items_submitted", n)
        for d in after:
            parent = self.jobs[d["id"]]
            if not parent.finished_ms:
                job.waiting_on[d["id"]] = d["on"]
            elif parent.state not in SATISFIED[d["on"]]:
                job.dep_failed = True
        if job.dep_failed:
            self.dep_fail(job, t)
        return {"ok": True, "id": job_id, "new": True}

    def _lease(self, e: dict, index: int, t: int) -> dict:
        granted = refused = 0
        for jid, i, _member, _boot in e["g"]:
            job = self.jobs.get(jid)
            if (job is None or not 0 <= i < len(job.items) or job.items[i].state != "pending"
                    or job.hold or job.waiting_on or job.not_before.get(i, 0) > t
                    or (job.max_leases is not None and job.n("leased") >= job.max_leases)
                    or (job.running_items_max is not None
                        and self.running(job.who) >= job.running_items_max)):
                refused += 1
                continue
            it = job.items[i]
            it.state, it.epoch, it.attempts = "leased", index, it.attempts + 1
            job.queue.remove(i)
            job.not_before.pop(i, None)
            job.started = True
            granted += 1
        self.count("leases_granted", granted)
        self.count("leases_refused", refused)
        return {"ok": True, "granted": granted, "refused": refused}

    def _result(self, e: dict, index: int, t: int) -> dict:
        accepted = refused = 0
        for r in e["r"]:
            jid, i, epoch, code = r[0], r[1], r[2], r[3]
            job = self.jobs.get(jid)
            if (job is None or not 0 <= i < len(job.items) or job.items[i].state != "leased"
                    or job.items[i].epoch != epoch):
                refused += 1
                continue
            assert (jid, i, epoch) not in self.accepted, "model: two results under one epoch"
            self.accepted.add((jid, i, epoch))
            it = job.items[i]
            it.error = r[10] if len(r) > 10 else None
            it.copies = tuple(r[11]) if len(r) > 11 else ()
            state = ITEM_STATE_NAMES[code]
            if state == "done":
                it.state = "done"
            else:
                it.fails += 1
                if it.fails <= job.retries:
                    it.note()
                    it.state = "pending"
                    job.queue.append(i)
                    job.not_before[i] = t + backoff_ms(it.fails)
                    self.count("items_retried")
                else:
                    it.state = state
            accepted += 1
            if not job.finished_ms and all(x.state in FINAL for x in job.items):
                job.finished_ms = max(t, 1)
        self.count("results_accepted", accepted)
        self.count("results_refused", refused)
        return {"ok": True, "accepted": accepted, "refused": refused}

    def _revoke(self, e: dict, index: int, t: int) -> dict:
        revoked = 0
        for jid, i, epoch in reversed(e["l"]):
            job = self.jobs.get(jid)
            if (job is None or not 0 <= i < len(job.items) or job.items[i].state != "leased"
                    or job.items[i].epoch != epoch):
                continue
            job.items[i].note()
            job.items[i].state = "pending"
            job.queue.insert(0, i)
            revoked += 1
        self.count("leases_revoked", revoked)
        return {"ok": True, "revoked": revoked}

    def _cancel(self, e: dict, index: int, t: int) -> dict:
        job = self.lookup(e["id"])
        if isinstance(job, dict):
            return job
        if job.finished_ms:
            return self.refuse(409, "finished")
        for it in job.items:
            if it.state in ("pending", "leased"):
                it.state = "cancelled"
        job.queue.clear()
        job.not_before.clear()
        job.waiting_on.clear()
        job.cancelled = True
        job.finished_ms = max(t, 1)
        self.count("jobs_cancelled")
        return {"ok": True, "id": e["id"]}

    def _forget(self, e: dict, index: int, t: int) -> dict:
        job = self.lookup(e["id"])
        if isinstance(job, dict):
            return job
        if any(e["id"] in j.waiting_on for j in self.jobs.values()):
            return self.refuse(409, "has_dependents")
        if not job.finished_ms:
            return self.refuse(409, "not_finished")
        del self.jobs[e["id"]]
        self.forgotten.append(e["id"])
        self.count("jobs_forgotten")
        if len(self.forgotten) > FORGOTTEN_MAX:
            del self.forgotten[0]
            self.count("tombstones_dropped")
        return {"ok": True, "id": e["id"]}

    def _tone(self, e: dict, index: int, t: int) -> dict:
        job = self.lookup(e["id"])
        if isinstance(job, dict):
            return job
        if job.finished_ms:
            return self.refuse(409, "finished")
        p = e.get("priority", 0)
        ml = e.get("max_leases")
        if (not {"priority", "hold", "max_leases"} & set(e)
                or isinstance(p, bool) or not isinstance(p, int) or abs(p) > limits.priority_abs_max
                or ("hold" in e and not isinstance(e["hold"], bool))
                or (ml is not None and (isinstance(ml, bool) or not isinstance(ml, int) or ml < 1))):
            return self.refuse(400, "malformed")
        for k in ("priority", "hold", "max_leases"):
            if k in e:
                setattr(job, k, e[k])
        return {"ok": True, "id": e["id"]}

    def _rerun(self, e: dict, index: int, t: int) -> dict:
        """A finished job (not dep_failed) runs again: its items (all, or those that failed,
        timed out or were cancelled) back to pending, in index order, with new tries."""
        job = self.lookup(e["id"])
        if isinstance(job, dict):
            return job
        if not job.finished_ms:
            return self.refuse(409, "not_finished")
        if job.dep_failed:
            return self.refuse(409, "dep_failed")
        waits = {}
        if not any(it.attempts for it in job.items):
            # Never ran (cancelled while it waited): judged again as at a submit.
            for d in job.after:
                parent = self.jobs.get(d["id"])
                if parent is None:
                    return self.refuse(409, "bad_after")
                if not parent.finished_ms:
                    waits[d["id"]] = d["on"]
                elif parent.state not in SATISFIED[d["on"]]:
                    return self.refuse(409, "dep_failed")
        again = [i for i, it in enumerate(job.items) if not e.get("failed_only")
                 or it.state in ("failed", "timeout", "cancelled")]
        if not again:
            return self.refuse(409, "nothing_to_rerun")
        for i in again:
            it = job.items[i]
            it.note()
            it.state, it.fails, it.error, it.copies = "pending", 0, None, ()
            job.queue.append(i)
        job.finished_ms, job.cancelled, job.started = 0, False, False
        job.waiting_on = waits
        job.run += 1
        self.count("jobs_rerun_rerun")
        self.count("items_rerun", len(again))
        return {"ok": True, "id": e["id"], "run": job.run, "items": len(again)}

    def pick(self, pool: str, count: int, now: int, skip: set) -> list[tuple[str, int]]:
        ready = sorted(((jid, j) for jid, j in self.jobs.items()
                        if j.pool == pool and j.queue and not j.hold and not j.finished_ms
                        and not j.waiting_on),
                       key=lambda x: (-x[1].priority, x[1].seq))
        picked: list[tuple[str, int]] = []
        for jid, job in ready:
            room = count - len(picked)
            if job.max_leases is not None:
                room = min(room, job.max_leases - job.n("leased")
                           - sum(1 for k in skip if k[0] == jid))
            if job.running_items_max is not None:
                room = min(room, job.running_items_max - self.running(job.who)
                           - sum(1 for k in [*skip, *picked] if (o := self.jobs.get(k[0])) is not None and o.who == job.who))
            for i in job.queue:
                if room <= 0:
                    break
                if (jid, i) not in skip and job.not_before.get(i, 0) <= now:
                    picked.append((jid, i))
                    room -= 1
        return picked[:count]

    def running(self, who: str) -> int:
        """The items of `who`'s jobs leased now (quotas.running_items)."""
        return sum(j.n("leased") for j in self.jobs.values() if j.who == who)


def normal(out: dict) -> dict:
    """An outcome without its message (the model does not predict the wording), and the
    dependents it changed as a set (the model does not predict their order)."""
    return {k: sorted(set(v)) if k == "deps" else v for k, v in out.items() if k != "error"}


def comparable_state(table: JobTable) -> Any:
    s = table.to_state()
    for k in ("counts", "applied_index", "rids", "clock"):  # committed time moves as the index
        s.pop(k)
    return msgpack.unpackb(msgpack.packb(s, use_bin_type=True), raw=False, strict_map_key=False)


junk = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats()
    | st.text(max_size=5) | st.binary(max_size=40),
    lambda inner: st.lists(inner, max_size=4)
    | st.dictionaries(st.text(max_size=4), inner, max_size=4),
    max_leaves=12,
)
garbage_dict = st.fixed_dictionaries(
    {"k": st.sampled_from(KINDS) | junk},
    optional={"t": st.integers(0, 2**40) | junk, "rid": st.sampled_from(RIDS) | junk,
              "id": junk, "spec": junk, "dg": junk, "items": junk, "g": junk, "r": junk,
              "l": junk, "priority": junk, "hold": junk, "max_leases": junk,
              "failed_only": junk, "auto": junk, "run": junk},
)
# A lease, result or revoke whose rows are junk (the body is a list, the rows are not).
garbage_rows = st.builds(
    lambda k, rows, t: {"k": k, "t": t, {"lease": "g", "result": "r", "revoke": "l"}[k]: rows},
    st.sampled_from(["lease", "result", "revoke"]), st.lists(junk, max_size=4), st.integers(0, 2**40),
)


garbage = junk | garbage_dict | garbage_rows

GARBAGE_COUNTS = {"entries", "duplicate_rids", "leases_refused", "results_refused",
                  "leases_granted", "results_accepted", "leases_revoked"}


class TableMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.table = JobTable()
        self.model = Model()
        self.index = 0
        self.now = 1_000_000
        self.epochs: dict[tuple[str, int], int] = {}
        self._forgotten_max = limits.forgotten_ids_max
        limits.forgotten_ids_max = FORGOTTEN_MAX

    def teardown(self) -> None:
        limits.forgotten_ids_max = self._forgotten_max

    # --- plumbing ---------------------------------------------------------------------------

    def apply(self, entry: dict, gap: int = 1) -> dict:
        self.index += gap
        expected = self.model.apply(entry, self.index)
        got = self.table.apply(entry, self.index)
        assert normal(got) == normal(expected), (entry, got, expected)
        return got

    def job_ids(self) -> list[str]:
        return sorted(self.model.jobs)

    def leased(self) -> list[tuple[str, int, int]]:
        return [(jid, i, it.epoch) for jid, j in sorted(self.model.jobs.items())
                for i, it in enumerate(j.items) if it.state == "leased"]

    # --- rules ------------------------------------------------------------------------------

    @rule(ms=st.integers(0, 3000))
    def tick(self, ms: int) -> None:
        self.now += ms

    @rule(job_id=st.sampled_from(JOB_IDS), variant=st.integers(0, 1), n=st.integers(1, 4),
          pool=st.sampled_from(POOLS), retries=st.integers(0, 2), priority=st.integers(-1, 1),
          hold=st.booleans(), max_leases=st.sampled_from([None, 1, 2]),
          rid=st.sampled_from([None, None, None, *RIDS]),
          after=st.sampled_from([[]] * 3) | st.lists(
              st.tuples(st.sampled_from(JOB_IDS), st.sampled_from(["ok", "end", "fail"])),
              max_size=3, unique_by=lambda d: d[0]))
    def submit(self, job_id: str, variant: int, n: int, pool: str, retries: int, priority: int,
               hold: bool, max_leases: int | None, rid: str | None,
               after: list[tuple[str, str]]) -> None:
        # The digest is what makes two submits the same job; the variant picks one of two.
        spec = {"argv": ["x", str(variant)], "pool": pool, "env": {}, "cwd": None,
                "retries": retries, "runtime_s": None, "tags": [], "priority": priority,
                "hold": hold, "max_leases": max_leases,
                **({"user": "nobody", "inherit_env": True, "submitted_by": "alice",
                    "running_items_max": 1} if variant else {})}
        if after:
            spec["after"] = [{"id": p, "on": on} for p, on in after]
        e = {"k": "submit", "t": self.now, "id": job_id, "spec": spec,
             "dg": f"{job_id}/{variant}/{after}".encode(), "items": [None] * n}
        if rid is not None:
            e["rid"] = rid
        self.apply(e, gap=1)

    @precondition(lambda self: self.model.jobs)
    @rule(data=st.data(), n=st.integers(1, 3), hold=st.booleans())
    def submit_dependent(self, data: st.DataObject, n: int, hold: bool) -> None:
        """A job that waits for jobs the table has (the other submit rule mostly names ids that
        are taken or parents that are not there)."""
        free = [j for j in JOB_IDS if j not in self.model.jobs and j not in self.model.forgotten]
        if not free:
            return
        job_id = data.draw(st.sampled_from(free))
        parents = data.draw(st.lists(st.sampled_from(sorted(self.model.jobs)), min_size=1,
                                     max_size=3, unique=True))
        after = [{"id": p, "on": data.draw(st.sampled_from(["ok", "end", "fail"]))}
                 for p in parents]
        spec = {"argv": ["x"], "pool": "default", "env": {}, "cwd": None, "retries": 0,
                "runtime_s": None, "tags": [], "priority": 0, "hold": hold, "max_leases": None,
                "after": after}
        self.apply({"k": "submit", "t": self.now, "id": job_id, "spec": spec,
                    "dg": f"{job_id}/dep/{after}".encode(), "items": [None] * n})

    @rule(pool=st.sampled_from(POOLS), count=st.integers(1, 5), gap=st.integers(1, 3),
          member=st.sampled_from(["m1", "m2"]), skip_first=st.booleans())
    def lease_picked(self, pool: str, count: int, gap: int, member: str, skip_first: bool) -> None:
        skip: set[tuple[str, int]] = set()
        if skip_first:
            first = self.table.pick(pool, 1, self.now, set())
            skip = set(first)
        picked = self.table.pick(pool, count, self.now, skip)
        assert picked == self.model.pick(pool, count, self.now, skip)
        assert len(picked) <= count and not (set(picked) & skip)
        if picked:
            out = self.apply({"k": "lease", "t": self.now,
                              "g": [[j, i, member, "b1"] for j, i in picked]}, gap)
            # pick offers only what a lease at the same time grants.
            assert out["granted"] == len(picked)

    @rule(data=st.data(), member=st.sampled_from(["m1", "m2"]))
    def lease_random(self, data: st.DataObject, member: str) -> None:
        grants = data.draw(st.lists(st.tuples(st.sampled_from(JOB_IDS), st.integers(-1, 4)),
                                    min_size=1, max_size=4))
        self.apply({"k": "lease", "t": self.now, "g": [[j, i, member, "b1"] for j, i in grants]})

    @precondition(lambda self: self.leased())
    @rule(data=st.data(), state=st.sampled_from(["done", "failed", "timeout"]),
          stale=st.booleans())
    def result_leased(self, data: st.DataObject, state: str, stale: bool) -> None:
        rows = []
        for jid, i, epoch in data.draw(st.lists(st.sampled_from(self.leased()), min_size=1,
                                               max_size=3)):
            if stale:
                epoch = data.draw(st.integers(0, self.index + 2).filter(lambda x, e=epoch: x != e))
            row = [jid, i, epoch, CODES[state], 0 if state == "done" else 1, None, None,
                   None, self.now, self.now]
            # Some failures could not start at all, and say why.
            why = data.draw(st.sampled_from([None, None, "could not start 'x'", "no input"]))
            copies = data.draw(st.sampled_from([None, None, ["m2"], ["m2", "m3"]]))
            if why is not None and state != "done":
                row.append(why)
            if copies is not None:
                row += [None, copies] if len(row) == 10 else [copies]
            rows.append(row)
        self.apply({"k": "result", "t": self.now, "r": rows})

    @rule(job_id=st.sampled_from(JOB_IDS), i=st.integers(-1, 4), back=st.integers(0, 30),
          state=st.sampled_from(["done", "failed", "timeout"]))
    def result_random(self, job_id: str, i: int, back: int, state: str) -> None:
        row = [job_id, i, max(0, self.index - back), CODES[state], None, None, None, None, 0, 0]
        self.apply({"k": "result", "t": self.now, "r": [row]})

    @precondition(lambda self: self.leased())
    @rule(data=st.data(), stale=st.booleans())
    def revoke(self, data: st.DataObject, stale: bool) -> None:
        # A prefix of a shuffle of every lease: several items of one job often, in any order.
        perm = data.draw(st.permutations(self.leased()))
        leases = perm[:data.draw(st.integers(1, len(perm)))]
        rows = [[j, i, e - 1 if stale else e] for j, i, e in leases]
        self.apply({"k": "revoke", "t": self.now, "l": rows})

    @rule(kind=st.sampled_from(["cancel", "forget"]), job_id=st.sampled_from(JOB_IDS),
          rid=st.sampled_from([None, None, None, *RIDS]))
    def cancel_or_forget(self, kind: str, job_id: str, rid: str | None) -> None:
        e: dict[str, Any] = {"k": kind, "t": self.now, "id": job_id}
        if rid is not None:
            e["rid"] = rid
        self.apply(e)

    @rule(job_id=st.sampled_from(JOB_IDS), failed_only=st.booleans(),
          rid=st.sampled_from([None, None, None, *RIDS]))
    def rerun(self, job_id: str, failed_only: bool, rid: str | None) -> None:
        e: dict[str, Any] = {"k": "rerun", "t": self.now, "id": job_id, "failed_only": failed_only}
        if rid is not None:
            e["rid"] = rid
        self.apply(e)

    @rule(job_id=st.sampled_from(JOB_IDS),
          fields=st.fixed_dictionaries({}, optional={
              "priority": st.integers(-2, 2) | st.sampled_from([True, "1", 10**7]),
              "hold": st.booleans() | st.sampled_from([0, None]),
              "max_leases": st.sampled_from([None, 1, 2, 3, 0, True])}))
    def tone(self, job_id: str, fields: dict) -> None:
        self.apply({"k": "tone", "t": self.now, "id": job_id, **fields})

    @rule(entry=garbage)
    def garbage(self, entry: Any) -> None:
        """Junk must become a refusal (or a no-op), never an exception, and change no state."""
        before = comparable_state(self.table)
        counts_before = dict(self.table.counts)
        self.index += 1
        rid = entry.get("rid") if isinstance(entry, dict) else None
        t = entry.get("t") if isinstance(entry, dict) else None
        well_stamped = (isinstance(entry, dict) and entry.get("k") in KINDS
                        and isinstance(t, int) and not isinstance(t, bool) and t >= 0
                        and isinstance(rid, str) and len(rid) <= limits.rid_chars_max)
        out = self.table.apply(entry, self.index)
        assert isinstance(out, dict) and isinstance(out.get("ok"), bool)
        assert comparable_state(self.table) == before
        if well_stamped and rid in self.model.rids:
            assert out == self.model.rids[rid] or normal(out) == normal(self.model.rids[rid])
        elif well_stamped:
            self.model.rids[rid] = out
        delta = {k: v - counts_before.get(k, 0) for k, v in self.table.counts.items()
                 if v != counts_before.get(k, 0)}
        assert delta.pop("entries") == 1
        for k, v in delta.items():
            assert k in GARBAGE_COUNTS or k.startswith("refused_"), (k, entry)
            assert k not in ("leases_granted", "results_accepted", "leases_revoked"), (k, entry)
            self.model.count(k, v)
        self.model.count("entries")
        if not out["ok"]:
            assert out["status"] in (400, 404, 409)

    @rule()
    def snapshot(self) -> None:
        raw = msgpack.packb(self.table.to_state(), use_bin_type=True)
        t2 = JobTable.from_state(msgpack.unpackb(raw, raw=False, strict_map_key=False))
        assert msgpack.packb(t2.to_state(), use_bin_type=True) == raw
        self.table = t2

    # --- invariants ----------------------------------------------------------------------------

    @invariant()
    def table_checks(self) -> None:
        self.table.check()

    @invariant()
    def agrees_with_model(self) -> None:
        t, m = self.table, self.model
        assert set(t.jobs) == set(m.jobs)
        assert list(t.forgotten) == m.forgotten
        assert not (set(t.jobs) & set(t.forgotten)), "a forgotten id reappeared"
        for jid, mj in m.jobs.items():
            j = t.jobs[jid]
            states = [ITEM_STATE_NAMES[s] for s in j.st]
            assert states == [it.state for it in mj.items], jid
            # Every item in exactly one state: the counters partition the items.
            assert j.n_pending + j.n_leased + j.n_done + j.n_failed + j.n_cancelled == j.n
            assert list(j.queue) == mj.queue, jid
            assert j.not_before == mj.not_before, jid
            assert list(j.attempts) == [it.attempts for it in mj.items], jid
            assert {i: [k[0] for k in kept] for i, kept in (j.tries or {}).items()} == \
                {i: it.tried for i, it in enumerate(mj.items) if it.tried}, jid
            assert j.state == mj.state, jid
            assert dict(j.waiting_on or {}) == mj.waiting_on, jid
            assert j.finished_ms == mj.finished_ms, jid
            assert j.run == mj.run, jid
            assert (j.errors or {}) == {i: it.error for i, it in enumerate(mj.items) if it.error}
            assert j.errors != {}, "an empty error dict is kept as None"
            held = [tuple(h or ()) for h in j.held] if j.held is not None else [()] * j.n
            assert held == [it.copies for it in mj.items], jid
            for i, it in enumerate(mj.items):
                if it.state == "leased":
                    assert j.epoch[i] == it.epoch and (jid, i) in t.leased
        assert {k: v for k, v in t.counts.items() if v} == m.counts

    @invariant()
    def epochs_never_go_back(self) -> None:
        # A job forgotten and gone: its id may come back (once its tombstone is dropped) as a
        # new job, whose epochs start again.
        for key in [k for k in self.epochs if k[0] not in self.table.jobs]:
            del self.epochs[key]
        for jid, j in self.table.jobs.items():
            for i in range(j.n):
                last = self.epochs.get((jid, i), 0)
                assert j.epoch[i] >= last, (jid, i)
                self.epochs[(jid, i)] = j.epoch[i]

    @invariant()
    def versions_grow_with_changes(self) -> None:
        """A job's version is the log index of an entry that changed it: it never goes back,
        it grows whenever what a client sees of the job changes, and it is not ahead of the
        table."""
        seen = getattr(self, "_versions", {})
        now = {}
        for jid, j in self.table.jobs.items():
            rec = self.table.record(j, items=True)
            version = rec.pop("version")
            assert 0 < version <= self.table.applied_index, (jid, version)
            old = seen.get((jid, j.seq))
            if old is not None:
                assert version >= old[0], (jid, "version went back")
                if rec != old[1]:
                    assert version > old[0], (jid, "changed without a new version")
            now[(jid, j.seq)] = (version, rec)
        self._versions = now

    @invariant()
    def one_result_per_epoch(self) -> None:
        assert self.table.counts.get("results_accepted", 0) == len(self.model.accepted)


TableMachine.TestCase.settings = settings(
    max_examples=200, stateful_step_count=50, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
test_table_model = TableMachine.TestCase
