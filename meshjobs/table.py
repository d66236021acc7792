"""The job table: the replicated state of a fleet.

Theory of operation. Every change to a job is an entry that the leader proposes and a majority
commits; every member applies the committed entries, in log order, to its own `JobTable`. The
table is therefore a pure, deterministic function of the committed log: the same entries in the
same order give the same table on every member, in the simulator and after a restart.

Rule 1: pure. No IO, clock, randomness or threads. Time comes in as the entry's `t` (stamped by
        the proposer, milliseconds since the epoch); the lease epoch is the entry's log index,
        handed in by the caller of `apply`.
Rule 2: `apply` is total. An entry that cannot be applied as it stands (an unknown job, a stale
        lease epoch, a malformed body) becomes a recorded refusal: a returned outcome and a
        counter, never an exception. pysyncobj stops applying for good after an exception in a
        replicated method, so a refusal is the only safe answer to remote garbage.
Rule 3: a broken invariant of the table's own making does raise: that is a bug, and a member
        that runs on with a table it cannot trust is worse than one that stops.
Rule 4: one transition table (`TRANSITIONS`) says which item state each entry kind may move an
        item from and to; every move goes through `_move`, which checks it.
Rule 5: a forgotten job id does not come back while its tombstone is kept: tombstones are part
        of the state and of every snapshot, in the order the jobs were forgotten, and only the
        newest `limits.forgotten_ids_max` are kept (the oldest is dropped first). An id whose
        tombstone was dropped reads as unknown, and a submit may use it again.
Rule 6: dependencies are decided when a parent ends, never later. A job submitted with
        `after` waits (state "waiting", nothing of it leased) on each parent not yet ended; when
        a parent ends, in the apply of the entry that ended it, each edge to it is settled: the
        condition holds (the dependent waits on one parent fewer, and runs once it waits on
        none) or it never can (the dependent ends "dep_failed", its items cancelled unrun, and
        its own dependents are settled in turn). A parent that has ended already is settled at
        the submit. So a finished job has no dependents waiting on it, and expiring or
        forgetting it changes nothing for them; parents exist at the submit and are older
        than the job, so the edges cannot form a cycle.

Rule 7: ages are measured in committed time, never against one member's wall clock. Each
        batch carries `c`, its proposer's reckoning of committed time, and `cb`, the proposer's
        boot id (an entry from an older member has neither: its `t` stands for `c`). The table
        keeps `clock_ms`, the greatest `c` applied, so committed time never goes backwards,
        and `stamp_ms`/`stamp_by`, the last batch's. A job's `finished_clock_ms` is `clock_ms`
        when it ended; retention compares that with the leader's committed time. The leader
        reckons committed time as the node's `CommittedClock` does (meshjobs/node/clock.py):
        from the last stamp another member made, plus the time its own monotonic clock has
        measured since it applied it, so a leader whose wall clock is minutes off changes no
        job's age. `finished_ms` (and every other `t`) stays the proposer's wall clock: what
        people are shown, and what schedules and backoffs are reckoned in.

Items live in per-job parallel arrays (compact: a finished item costs a few dozen bytes) and a
per-job queue of pending indexes: an item whose lease is revoked goes back to the head of that
queue, as in goq; new and retried items keep their order.
"""

from __future__ import annotations

from array import array
from collections import deque
from collections.abc import Callable
from typing import Any

from blobstore.digest import EMPTY_DIGEST
from meshjobs import cron, identity, limits, placement, quotas, reruns
from meshjobs.compact import ItemQueue, entry_items
from meshjobs.control import ANONYMOUS, ITEM_STATES, JOB_FINAL_STATES, ControlError, parse_submit
from meshjobs.fleetctl import CtlRefused, FleetCtl

# Item states, stored as one byte each.
PENDING, LEASED, DONE, FAILED, TIMEOUT, CANCELLED = range(6)
ITEM_STATE_NAMES = ITEM_STATES  # their names (control.py), in code order
ITEM_STATE_CODES = {name: code for code, name in enumerate(ITEM_STATE_NAMES)}
FINAL = frozenset({DONE, FAILED, TIMEOUT, CANCELLED})

# Which entry kind may move an item from which state to which: the only legal item moves.
TRANSITIONS: dict[str, frozenset[tuple[int, int]]] = {
    "lease": frozenset({(PENDING, LEASED)}),
    "result": frozenset({(LEASED, DONE), (LEASED, FAILED), (LEASED, TIMEOUT), (LEASED, PENDING)}),
    "revoke": frozenset({(LEASED, PENDING)}),
    "cancel": frozenset({(PENDING, CANCELLED), (LEASED, CANCELLED)}),
    # A finished job run again (meshjobs.reruns): its ended items wait for a lease once more.
    "rerun": frozenset({(DONE, PENDING), (FAILED, PENDING), (TIMEOUT, PENDING),
                        (CANCELLED, PENDING)}),
}

RC_NONE = -(2**31)  # "no exit code" in the rc array
_EMPTY = bytes.fromhex(EMPTY_DIGEST)  # the digest of the empty payload, raw
# The parent's final states that satisfy each condition of `after` (control.DEP_CONDITIONS).
DEP_SATISFIED = {
    "ok": frozenset({"done"}),
    "end": frozenset(JOB_FINAL_STATES),
    "fail": frozenset({"failed", "cancelled", "dep_failed"}),
}
RID_REUSED = ("this Idempotency-Key was used before for a different request (another method, "
              "path or body): a retry must repeat the same request; use a new key for a new one")


class Refused(Exception):
    """An entry (or part of one) that cannot be applied; becomes a recorded refusal."""

    def __init__(self, status: int, message: str, reason: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.reason = reason


def backoff_ms(fails: int) -> int:
    """How long a failed item waits before its next try (exponential, capped)."""
    return min(limits.retry_backoff_ms_base * (2 ** max(0, fails - 1)), limits.retry_backoff_ms_max)


class Job:
    """One job: its spec and knobs, and its items as parallel arrays."""

    __slots__ = (
        "id", "seq", "argv", "pool", "env", "cwd", "retries", "runtime_s", "tags", "priority",
        "hold", "max_leases", "digest", "submitted_ms", "finished_ms", "finished_clock_ms",
        "cancelled", "n",
        "st", "attempts", "fails", "epoch", "member", "rc", "sig", "stdin", "out", "err",
        "started_ms", "ended_ms", "not_before", "queue", "n_pending", "n_leased", "n_done",
        "n_failed", "n_cancelled", "started", "errors", "held", "names", "version",
        "user", "inherit_env",
        "after", "waiting_on", "dep_failed",
        "selector", "pins",
        "notify",
        "restart", "restart_delay_s", "resubmit", "stdout_path", "stderr_path",
        "run", "restarts", "resubmits", "due_ms", "due_why", "past",
        "rerun_times", "due_capped",
        "submitted_by", "run_as", "running_items_max",
        "tries",
    )

    def __init__(self, job_id: str, seq: int, spec: dict, digest: bytes, stdin: list, t: int) -> None:
        n = len(stdin)
        self.id = job_id
        self.seq = seq
        self.argv: list[str] = spec["argv"]
        self.pool: str = spec["pool"]
        self.env: dict[str, str] = spec["env"]
        self.cwd: str | None = spec["cwd"]
        self.retries: int = spec["retries"]
        self.runtime_s: float | None = spec["runtime_s"]
        self.tags: list[str] = spec["tags"]
        self.priority: int = spec["priority"]
        self.hold: bool = spec["hold"]
        self.max_leases: int | None = spec["max_leases"]
        self.names: list[str] | None = spec.get("names")  # input file names, when given
        # The user its items run as ("name", "uid" or "uid:gid"); None: the pool's default on
        # the member that runs an item, or meshd's own user.
        self.user: str | None = spec.get("user")
        self.inherit_env: bool = spec.get("inherit_env", False)  # meshd's whole environment
        self.after: list[dict[str, str]] | None = spec.get("after")  # its parents, when given
        # The parents not ended yet -> the condition waited for, in the order of `after`
        # (None when it waits on none); and whether it ended because one can never hold.
        self.waiting_on: dict[str, str] | None = None
        self.dep_failed = False
        # Placement (placement.py): the members its items may go to (spec "member"; None: any),
        # and for a fan-out ("*") the member each item is pinned to, from the submit entry.
        self.selector: str | None = spec.get("member")
        self.pins: list[str] | None = None
        self.notify: str | None = spec.get("notify")  # the URL its end is POSTed to
        # Re-runs (meshjobs.reruns): what the spec asks for, which run this is (1: the first),
        # the automatic re-runs used, the one due (when, why) and summaries of earlier runs.
        self.restart: int | str | None = spec.get("restart")
        self.restart_delay_s: float | None = spec.get("restart_delay_s")
        self.resubmit: int | None = spec.get("resubmit")
        self.stdout_path: str | None = spec.get("stdout")  # items' stdout also written here
        self.stderr_path: str | None = spec.get("stderr")
        # Who submitted it (an identity's name; jobs from before identities: "anonymous"), and
        # the users its submitter's jobs may run as (None: any, the member's own among them).
        self.submitted_by: str = spec.get("submitted_by", ANONYMOUS)
        self.run_as: list[str] | None = spec.get("run_as")
        # Its submitter's running_items_max when it was submitted (None: no limit): an item of
        # it is leased only while the submitter has fewer items leased (quotas.running_items).
        self.running_items_max: int | None = spec.get("running_items_max")
        self.run = 1
        self.restarts = 0
        self.resubmits = 0
        self.due_ms = 0
        self.due_why: str | None = None
        self.past: list[dict] | None = None
        # The entry times of its last automatic re-runs (reruns.py Rule 6), and whether the
        # one due waits for them.
        self.rerun_times: list[int] | None = None
        self.due_capped = False
        self.digest = digest
        self.submitted_ms = t
        self.finished_ms = 0
        # Committed time (Rule 7) when it ended: what its age is measured from.
        self.finished_clock_ms = 0
        self.cancelled = False
        self.n = n
        self.st = bytearray(n)  # PENDING
        self.attempts = array("I", bytes(4 * n))
        self.fails = array("I", bytes(4 * n))
        self.epoch = array("Q", bytes(8 * n))
        self.member: list[str | None] = [None] * n
        self.rc = array("i", [RC_NONE]) * n
        self.sig = bytearray(n)
        self.stdin: list[bytes | None] = stdin
        self.out: list[bytes | None] = [None] * n
        self.err: list[bytes | None] = [None] * n
        self.started_ms = array("Q", bytes(8 * n))
        self.ended_ms = array("Q", bytes(8 * n))
        self.not_before: dict[int, int] = {}
        self.queue = ItemQueue(n)
        self.n_pending = n
        self.n_leased = 0
        self.n_done = 0
        self.n_failed = 0
        self.n_cancelled = 0
        self.started = False  # any item ever leased: "running" rather than "queued"
        # Why an item's last try failed without running (item index -> a short text), when it
        # did: most items never have one, so the dict is made only for the first.
        self.errors: dict[int, str] | None = None
        # Why each of an item's earlier attempts ended without its final result (item index ->
        # (attempt, member, why, entry time ms), oldest first, the last
        # `limits.item_attempts_kept_max`): a lease lost with its member, a failure tried
        # again, a run ended before the job ran again. Made for the first item that has one.
        self.tries: dict[int, list[tuple[int, str | None, str, int]]] | None = None
        # The other members that confirmed a copy of each item's outputs when its result was
        # committed (the member that ran it holds them too): made for the first item that has
        # some, one shared tuple per set of members.
        self.held: list[tuple[str, ...] | None] | None = None
        # The log index of the last committed entry that changed the job: the same on every
        # member, so a client may carry it from one member to the next (`?since=`).
        self.version = 0

    @property
    def finished(self) -> bool:
        return self.finished_ms != 0

    @property
    def state(self) -> str:
        if self.cancelled:
            return "cancelled"
        if self.dep_failed:
            return "dep_failed"
        if self.finished_ms:
            return "failed" if self.n_failed else "done"
        if self.waiting_on:
            return "waiting"
        if self.hold:
            return "held"
        if not self.started:
            return "queued"
        return "running"

    def spec_fields(self) -> dict:
        return {
            "argv": self.argv, "pool": self.pool, "env": self.env, "cwd": self.cwd,
            "retries": self.retries, "runtime_s": self.runtime_s, "tags": self.tags,
            "priority": self.priority, "hold": self.hold, "max_leases": self.max_leases,
            **({} if self.names is None else {"names": self.names}),
            **({} if self.user is None else {"user": self.user}),
            **({"inherit_env": True} if self.inherit_env else {}),
            **({} if self.after is None else {"after": self.after}),
            **({} if self.selector is None else {"member": self.selector}),
            **({} if self.notify is None else {"notify": self.notify}),
            **{k: v for k, v in (("restart", self.restart), ("resubmit", self.resubmit),
                                 ("restart_delay_s", self.restart_delay_s),
                                 ("stdout", self.stdout_path), ("stderr", self.stderr_path))
               if v is not None},
            # Only when named, so that a spec from before identities stays as it was.
            **({} if self.submitted_by == ANONYMOUS else {"submitted_by": self.submitted_by}),
            **({} if self.run_as is None else {"run_as": self.run_as}),
            **({} if self.running_items_max is None
               else {"running_items_max": self.running_items_max}),
        }


class JobTable:
    """The replicated job table. `apply(entry, index)` is the only way it changes."""

    def __init__(self) -> None:
        self.jobs: dict[str, Job] = {}
        # Tombstones of forgotten job ids, oldest first (a dict: ordered, and quick to test).
        self.forgotten: dict[str, None] = {}
        self.seq = 0
        self.applied_index = 0
        # (job id, item index) -> (member, boot) of every item now leased.
        self.leased: dict[tuple[str, int], tuple[str, str]] = {}
        # Request id -> outcome of the change it named, so a retried change is not applied twice.
        self.rids: dict[str, dict] = {}
        self.counts: dict[str, int] = {}
        # Finished jobs in the order they finished, each with its finished_clock_ms: what
        # retention forgets first. Derived from the jobs (rebuilt on load), so it is not part
        # of a snapshot.
        self.finished: dict[str, int] = {}
        # Committed time (Rule 7): the greatest stamp applied, and the last stamp and its
        # proposer's boot id ("" for an entry from an older member).
        self.clock_ms = 0
        self.stamp_ms = 0
        self.stamp_by = ""
        # Jobs with items waiting for a lease and not held: what `pick` looks at, so that the
        # leader's every round does not walk all the jobs. Derived too (rebuilt on load).
        self.ready: dict[str, Job] = {}
        # Parent id -> the jobs waiting on it (in submit order): the reverse of every waiting
        # job's `waiting_on`. Derived too (rebuilt on load from the jobs' `waiting_on`).
        self.dependents: dict[str, dict[str, None]] = {}
        # Pools held or drained and members drained or stopped by command (meshjobs/fleetctl.py).
        self.ctl = FleetCtl()
        # Job id -> when its automatic re-run is due (meshjobs.reruns). Derived (rebuilt on load).
        self.due: dict[str, int] = {}
        self._names: dict[str, str] = {}
        self._helds: dict[tuple[str, ...], tuple[str, ...]] = {}
        self._texts: dict[str, str] = {}  # one object per distinct item error text
        # A checker's hook (the simulator's oracle): called with each entry of a batch before
        # (outcome None) and after it is applied. Never set in a member.
        self.observe: Callable[[Any, dict | None], None] | None = None
        # The member's hook for its history file: called with a job's final record, why
        # ("forget" or "expire"), the entry's time and its log index, just before the job is
        # dropped. It must not block (the member hands the record to a bounded queue). Not
        # part of the state.
        self.on_forget: Callable[[dict, str, int, int], None] | None = None
        # Schedules by name (meshjobs/cron.py), in the order they were added.
        self.crons: dict[str, cron.Cron] = {}
        # Submitter -> [items not finished, items leased] (meshjobs/quotas.py). Derived
        # (rebuilt on load).
        self.holds: dict[str, list[int]] = {}

    # --- applying entries -------------------------------------------------------------------

    def apply(self, entry: object, index: int) -> dict:
        """Apply one committed entry at log index `index`; return its outcome (never raises on
        a bad entry: the outcome says it was refused)."""
        if index <= self.applied_index:
            raise AssertionError(f"entry index {index} not after {self.applied_index}")
        self.applied_index = index
        self._count("entries")
        return self._apply_one(entry, index, nested=False)

    def _apply_one(self, entry: object, index: int, nested: bool) -> dict:
        kind = entry.get("k") if isinstance(entry, dict) else None
        if nested and kind == "batch":
            return self._refuse(Refused(400, "a batch inside a batch", "malformed"))
        if not isinstance(kind, str) or kind not in _APPLIERS:
            return self._refuse(Refused(400, "malformed entry", "malformed"))
        t = entry.get("t")
        if isinstance(t, bool) or not isinstance(t, int) or t < 0:
            return self._refuse(Refused(400, "entry without a time stamp", "malformed"))
        if not nested:
            stamp = self.stamp_of(entry, t)
            if stamp is None:
                return self._refuse(Refused(400, "malformed committed time stamp", "malformed"))
            before = (self.clock_ms, self.stamp_ms, self.stamp_by)
            # Before the entry is applied: a job it ends ends at this committed time.
            self.stamp_ms, self.stamp_by = stamp
            self.clock_ms = max(self.clock_ms, stamp[0])
            outcome = self._apply_checked(entry, index, t, kind, nested)
            if not outcome.get("ok"):
                # Rule 2: a refused entry changes nothing, its stamp included.
                self.clock_ms, self.stamp_ms, self.stamp_by = before
            return outcome
        return self._apply_checked(entry, index, t, kind, nested)

    def _apply_checked(self, entry: dict, index: int, t: int, kind: str, nested: bool) -> dict:
        """`_apply_one` of an entry whose kind and time stamp are known good."""
        rid = entry.get("rid")
        fp = entry.get("fp")
        if rid is not None:
            if not isinstance(rid, str) or len(rid) > limits.rid_chars_max:
                return self._refuse(Refused(400, "malformed request id", "malformed"))
            if fp is not None and (not isinstance(fp, str) or len(fp) > limits.rid_chars_max):
                return self._refuse(Refused(400, "malformed request fingerprint", "malformed"))
            seen = self.rids.get(rid)
            if seen is not None:
                if fp is not None and seen.get("fp") not in (None, fp):
                    # The key names another change: applying nothing and answering that
                    # change's outcome would tell the client its request was done.
                    return self._refuse(Refused(422, RID_REUSED, "rid_reused"))
                self._count("duplicate_rids")
                return seen
        try:
            outcome = _APPLIERS[kind](self, entry, index, t)
        except Refused as r:
            outcome = self._refuse(r)
        if rid is not None:
            # The outcome is remembered with the fingerprint its key is bound to; without the
            # dependents it changed (a retry changes none, and a cancel that ends a long chain
            # would keep every id of it in every snapshot).
            kept = {k: v for k, v in outcome.items() if k != "deps"} if "deps" in outcome else outcome
            self.rids[rid] = kept if fp is None else {**kept, "fp": fp}
            while len(self.rids) > limits.rids_remembered_max:
                del self.rids[next(iter(self.rids))]
        return outcome

    def stamp_of(self, e: dict, t: int) -> tuple[int, str] | None:
        """The committed time an entry brings and who stamped it (Rule 7): its `c` and `cb`,
        or, from a member of an older version, its own `t` and ""; None when malformed."""
        c, by = e.get("c"), e.get("cb")
        if c is None and by is None:
            return t, ""
        if not _is_int(c) or c < 0 or not isinstance(by, str) or len(by) > limits.boot_chars_max:
            return None
        return c, by

    def _refuse(self, r: Refused) -> dict:
        self._count("refused_" + r.reason)
        return {"ok": False, "status": r.status, "error": r.message, "reason": r.reason}

    def _count(self, name: str, n: int = 1) -> None:
        self.counts[name] = self.counts.get(name, 0) + n

    def _owned(self, e: dict, owner: str, what: str) -> None:
        """Refuses (403, naming the owner) a change by an identity that may not change what
        `owner` submitted (meshjobs/identity.py Rule 1): the entry's `by` and `br` (its role)
        are the request's. An entry without them (from before identities, or the leader's own)
        may change anything."""
        by, role = e.get("by"), e.get("br")
        if by is None:
            return
        if not isinstance(by, str) or not isinstance(role, str):
            raise Refused(400, "malformed identity", "malformed")
        if not identity.may_change(by, role, owner):
            raise Refused(403, identity.not_owner(what, owner, by)["error"], "not_owner")

    def _job(self, job_id: object) -> Job:
        if not isinstance(job_id, str):
            raise Refused(400, "malformed job id", "malformed")
        job = self.jobs.get(job_id)
        if job is None:
            if job_id in self.forgotten:
                raise Refused(404, f"job {job_id} was forgotten", "forgotten")
            raise Refused(404, f"no job {job_id}", "unknown_job")
        return job

    def _move(self, kind: str, job: Job, i: int, to: int) -> None:
        frm = job.st[i]
        if (frm, to) not in TRANSITIONS[kind]:
            raise AssertionError(f"illegal item move {kind}: {frm}->{to} for {job.id}[{i}]")
        job.st[i] = to
        job.version = self.applied_index
        quotas.moved(self, job, frm in (PENDING, LEASED), to in (PENDING, LEASED),
                     frm == LEASED, to == LEASED)
        for state, d in ((frm, -1), (to, +1)):
            if state == PENDING:
                job.n_pending += d
            elif state == LEASED:
                job.n_leased += d
            elif state == DONE:
                job.n_done += d
            elif state in (FAILED, TIMEOUT):
                job.n_failed += d
            else:
                job.n_cancelled += d
        if frm == PENDING:
            q = job.queue
            if q and q[0] == i:
                q.popleft()
            else:
                q.remove(i)
            job.not_before.pop(i, None)
        if frm == LEASED:
            del self.leased[(job.id, i)]
        if frm == PENDING or to == PENDING:
            self._ready(job)

    def _name(self, member: str) -> str:
        """One string object per member name, however many items name it (a decoded entry
        brings a new copy with every grant)."""
        name = self._names.get(member)
        if name is None:
            if len(self._names) >= limits.member_names_max:
                return member
            name = self._names[member] = member
        return name

    def _holders(self, names: tuple[str, ...]) -> tuple[str, ...]:
        """One tuple object per set of holders, however many items name it."""
        held = self._helds.get(names)
        if held is None:
            if len(self._helds) >= limits.member_names_max:
                return tuple(self._name(n) for n in names)
            held = self._helds[names] = tuple(self._name(n) for n in names)
        return held

    def _text(self, text: str) -> str:
        """One string object per distinct item text (errors, attempt reasons), up to a bound."""
        if len(self._texts) < limits.member_names_max or text in self._texts:
            return self._texts.setdefault(text, text)
        return text

    def note_attempt(self, job: Job, i: int, why: str, t: int) -> None:
        """Item `i`'s current attempt ended without its final result, for `why`: kept with the
        member it had (once per attempt; the oldest dropped past the limit)."""
        a = job.attempts[i]
        if a == 0:
            return  # never leased: no attempt to speak of
        tries = job.tries if job.tries is not None else {}
        kept = tries.get(i)
        if kept is None:
            kept = tries[i] = []
        elif kept[-1][0] >= a:
            return  # already said (a pending item cancelled, then run again)
        kept.append((a, job.member[i], self._text(why[:limits.item_error_chars_max]), t))
        del kept[:-limits.item_attempts_kept_max]
        job.tries = tries

    def _ready(self, job: Job) -> None:
        if job.n_pending and not job.hold and not job.waiting_on:
            self.ready[job.id] = job
        else:
            self.ready.pop(job.id, None)

    def _finish_if_done(self, job: Job, t: int) -> bool:
        if not job.finished_ms and job.n_done + job.n_failed + job.n_cancelled == job.n:
            self._mark_finished(job, t)
            reruns.schedule(self, job)
            return True
        return False

    def _mark_finished(self, job: Job, t: int) -> None:
        """`job` ends now: at the entry's wall time `t` (shown) and at committed time (its age,
        Rule 7)."""
        job.finished_ms = max(t, 1)
        job.finished_clock_ms = self.clock_ms
        self.finished[job.id] = job.finished_clock_ms

    # --- dependencies (Rule 6) ----------------------------------------------------------------

    def _ended(self, job: Job, index: int, t: int) -> list[str]:
        """`job` has just ended: settle every edge to it, and to each dependent that ends
        dep_failed in turn (a worklist, not recursion: chains may be long). Returns the ids of
        the dependents it changed, in the order they changed."""
        changed: list[str] = []
        work = deque([job])
        while work:
            parent = work.popleft()
            kids = self.dependents.pop(parent.id, None)
            if not kids:
                continue
            state = parent.state
            for kid_id in kids:
                kid = self.jobs[kid_id]
                waits = kid.waiting_on
                if waits is None or parent.id not in waits:
                    raise AssertionError(f"{kid_id} listed as waiting on {parent.id}, but is not")
                on = waits.pop(parent.id)
                if self._holds(state, on):
                    # Its record changed (one parent fewer in waiting_on) even when it still
                    # waits: a new version, and the feed names it.
                    kid.version = index
                    changed.append(kid_id)
                    if not waits:
                        kid.waiting_on = None
                        self._ready(kid)
                        self._count("jobs_released")
                else:
                    self._dep_fail(kid, index, t)
                    changed.append(kid_id)
                    work.append(kid)
        return changed

    def _holds(self, parent_state: str, on: str) -> bool:
        """Whether a parent that ended in `parent_state` satisfies the condition `on`."""
        return parent_state in DEP_SATISFIED[on]

    def _unwait(self, job: Job) -> None:
        """`job` waits on nothing any more (it ended): out of its parents' dependents."""
        for parent_id in job.waiting_on or ():
            kids = self.dependents[parent_id]
            del kids[job.id]
            if not kids:
                del self.dependents[parent_id]
        job.waiting_on = None

    def _dep_fail(self, job: Job, index: int, t: int) -> None:
        """A condition of `job` can never hold: it ends dep_failed, its items cancelled unrun."""
        self._unwait(job)
        for i in range(job.n):
            if job.st[i] in (PENDING, LEASED):
                self._move("cancel", job, i, CANCELLED)
                job.ended_ms[i] = t
        job.dep_failed = True
        job.version = index
        self._mark_finished(job, t)
        self._count("jobs_dep_failed")

    def _apply_batch(self, e: dict, index: int, t: int) -> dict:
        """Many control changes in one entry (the leader batches what arrives together): each
        applied in order as if it were an entry of its own at this index."""
        es = e.get("es")
        if not isinstance(es, list) or not es or len(es) > limits.ctl_batch_max:
            raise Refused(400, "malformed batch", "malformed")
        observe = self.observe
        if observe is None:
            return {"ok": True, "outcomes": [self._apply_one(sub, index, nested=True) for sub in es]}
        outcomes = []
        for sub in es:
            observe(sub, None)
            outcomes.append(self._apply_one(sub, index, nested=True))
            observe(sub, outcomes[-1])
        return {"ok": True, "outcomes": outcomes}

    def _apply_submit(self, e: dict, index: int, t: int) -> dict:
        job_id = e.get("id")
        spec = e.get("spec")
        digest = e.get("dg")
        if not isinstance(job_id, str) or not job_id or len(job_id) > limits.job_id_chars_max:
            raise Refused(400, "malformed job id", "malformed")
        if not isinstance(spec, dict) or not _spec_ok(spec):
            raise Refused(400, "malformed job spec", "malformed")
        if not isinstance(digest, bytes) or ("items" in e and (
                not isinstance(e["items"], list) or not e["items"])) or (
                "items" not in e and "ip" not in e):
            raise Refused(400, "malformed submit", "malformed")
        # Items come one payload each (`items`, older members) or compact (`ip` with `n` or
        # `ix`, meshjobs/compact.py); either way one object per distinct payload.
        stdin = entry_items(e)
        if stdin is None:
            raise Refused(400, "malformed item list", "malformed")
        if job_id in self.forgotten:
            raise Refused(409, f"job id {job_id} was used by a job that is now forgotten; "
                               "submit with another id", "forgotten")
        old = self.jobs.get(job_id)
        if old is not None:
            if old.digest == digest:
                return {"ok": True, "id": job_id, "new": False}
            raise Refused(409, f"a different job with id {job_id} exists; submit with another id "
                               "or the same spec", "conflict")
        pins = e.get("on")
        if (spec.get("member") == placement.FANOUT) != (pins is not None) or (
                pins is not None and not placement.fanout_ok(pins, len(stdin))):
            # A fan-out names its members, one per item, in the entry; no other job does.
            raise Refused(400, "malformed fan-out member list", "malformed")
        after = spec.get("after") or []
        for dep in after:
            parent_id = dep["id"]
            if parent_id == job_id:
                raise Refused(400, f"job {job_id} cannot wait for itself: remove it from after",
                              "bad_after")
            if parent_id not in self.jobs:
                gone = ("was forgotten" if parent_id in self.forgotten
                        else "does not exist (see `meshctl jobs`)")
                raise Refused(400, f"job {parent_id} named in after {gone}: a job may wait only "
                                   "for jobs the fleet has; submit the parent first, or drop it",
                              "bad_after")
        self.seq += 1
        job = self.jobs[job_id] = Job(job_id, self.seq, spec, digest, stdin, t)
        job.version = index
        if pins is not None:
            job.pins = [self._name(m) for m in pins]
        impossible = False
        for dep in after:
            parent = self.jobs[dep["id"]]
            if not parent.finished:
                if job.waiting_on is None:
                    job.waiting_on = {}
                job.waiting_on[parent.id] = dep["on"]
                self.dependents.setdefault(parent.id, {})[job_id] = None
            elif not self._holds(parent.state, dep["on"]):
                impossible = True  # settled at the submit: the parent ended the wrong way
        quotas.submitted(self, job)
        self._count("jobs_submitted")
        self._count("items_submitted", len(stdin))
        if impossible:
            self._dep_fail(job, index, t)
        self._ready(job)
        return {"ok": True, "id": job_id, "new": True}

    def _apply_lease(self, e: dict, index: int, t: int) -> dict:
        grants = e.get("g")
        if not isinstance(grants, list) or len(grants) > limits.lease_batch_max:
            raise Refused(400, "malformed lease", "malformed")
        granted = refused = 0
        for g in grants:
            if not (isinstance(g, list) and len(g) == 4 and isinstance(g[0], str)
                    and _is_int(g[1]) and isinstance(g[2], str) and isinstance(g[3], str)):
                refused += 1
                continue
            job = self.jobs.get(g[0])
            i = g[1]
            if (job is None or not 0 <= i < job.n or job.st[i] != PENDING or job.hold
                    or job.waiting_on or job.not_before.get(i, 0) > t
                    or (job.max_leases is not None and job.n_leased >= job.max_leases)
                    or (job.running_items_max is not None and quotas.running_items(
                        self, job.submitted_by) >= job.running_items_max)):
                refused += 1
                continue
            if job.selector is not None and not placement.allows(job.selector, job.pins, i, g[2]):
                # A stale or buggy leader may not place an item where its job does not go.
                refused += 1
                self._count("leases_refused_placement")
                continue
            if self.ctl.refuses(job.pool, g[2], g[3]):
                # A pool held or drained there, or a member drained or stopping (fleetctl.py).
                refused += 1
                continue
            self._move("lease", job, i, LEASED)
            job.epoch[i] = index
            job.attempts[i] += 1
            job.member[i] = self._name(g[2])
            job.started = True
            job.started_ms[i] = t
            job.ended_ms[i] = 0
            self.leased[(job.id, i)] = (g[2], g[3])
            granted += 1
        self._count("leases_granted", granted)
        self._count("leases_refused", refused)
        return {"ok": True, "granted": granted, "refused": refused}

    def _apply_result(self, e: dict, index: int, t: int) -> dict:
        results = e.get("r")
        if not isinstance(results, list) or len(results) > limits.result_batch_max:
            raise Refused(400, "malformed result", "malformed")
        accepted = refused = 0
        deps: list[str] = []
        for r in results:
            if not _result_ok(r):
                refused += 1
                continue
            job_id, i, epoch, state, rc, sig, out, err, started, ended = r[:10]
            job = self.jobs.get(job_id)
            if job is None or not 0 <= i < job.n or job.st[i] != LEASED or job.epoch[i] != epoch:
                # A late result of a revoked lease, or a duplicate: never a second result.
                refused += 1
                continue
            job.rc[i] = RC_NONE if rc is None else rc
            job.sig[i] = sig or 0
            # The empty output is by far the most common: one shared object, not 65 bytes each.
            job.out[i] = _EMPTY if out == _EMPTY else out
            job.err[i] = _EMPTY if err == _EMPTY else err
            job.started_ms[i] = started
            job.ended_ms[i] = ended
            error = r[10] if len(r) > 10 else None
            holders = tuple(r[11]) if len(r) > 11 else None
            if holders or job.held is not None:
                if job.held is None:
                    job.held = [None] * job.n
                job.held[i] = self._holders(holders) if holders else None
            if error is not None:
                if job.errors is None:
                    job.errors = {}
                # An array whose program is missing fails every item with the same text: one
                # string object for them all.
                job.errors[i] = self._texts.setdefault(error, error) if (
                    len(self._texts) < limits.member_names_max or error in self._texts) else error
            elif job.errors is not None and job.errors.pop(i, None) is not None and not job.errors:
                job.errors = None
            if state == DONE:
                self._move("result", job, i, DONE)
            else:
                job.fails[i] += 1
                if job.fails[i] <= job.retries:
                    self.note_attempt(job, i, f"{_failed_words(state, rc, sig, error, job.runtime_s)}; tried "
                                              f"again (retry {job.fails[i]} of {job.retries})", t)
                    self._move("result", job, i, PENDING)
                    job.queue.append(i)
                    job.not_before[i] = t + backoff_ms(job.fails[i])
                    self._count("items_retried")
                else:
                    self._move("result", job, i, state)
            accepted += 1
            if self._finish_if_done(job, t):
                deps += self._ended(job, index, t)
        self._count("results_accepted", accepted)
        self._count("results_refused", refused)
        out = {"ok": True, "accepted": accepted, "refused": refused}
        if deps:
            # Dependents this entry changed (released, ended, or waiting on fewer parents),
            # each once: the feed names them.
            out["deps"] = list(dict.fromkeys(deps))
        return out

    def _apply_revoke(self, e: dict, index: int, t: int) -> dict:
        leases = e.get("l")
        if not isinstance(leases, list) or len(leases) > limits.lease_batch_max:
            raise Refused(400, "malformed revoke", "malformed")
        # Why each lease is revoked, in the order of "l" (from newer leaders; None or missing:
        # not said): kept as the reason its attempt ended.
        whys = e.get("w")
        if not isinstance(whys, list) or len(whys) != len(leases):
            whys = [None] * len(leases)
        revoked = 0
        for lease, why in zip(reversed(leases), reversed(whys), strict=True):
            if not (isinstance(lease, list) and len(lease) == 3 and isinstance(lease[0], str)
                    and _is_int(lease[1]) and _is_int(lease[2])):
                continue
            job = self.jobs.get(lease[0])
            i = lease[1]
            if job is None or not 0 <= i < job.n or job.st[i] != LEASED or job.epoch[i] != lease[2]:
                continue
            if not isinstance(why, str) or not why:
                why = f"lease revoked: member {job.member[i] or '?'} lost"
            self.note_attempt(job, i, why, t)
            self._move("revoke", job, i, PENDING)
            job.queue.appendleft(i)  # back to the head of the line
            job.member[i] = None
            revoked += 1
        self._count("leases_revoked", revoked)
        return {"ok": True, "revoked": revoked}

    def _apply_cancel(self, e: dict, index: int, t: int) -> dict:
        job = self._job(e.get("id"))
        self._owned(e, job.submitted_by, f"job {job.id}")
        if job.finished and job.due_ms:
            # A cancel stops restarting (meshjobs.reruns, Rule 4): the due re-run is dropped.
            reruns.unschedule(self, job)
            job.version = index
            self._count("reruns_stopped")
            return {"ok": True, "id": job.id}
        if job.finished:
            raise Refused(409, f"job {job.id} has already ended ({job.state}); nothing to cancel",
                          "finished")
        for i in range(job.n):
            if job.st[i] in (PENDING, LEASED):
                self._move("cancel", job, i, CANCELLED)
                job.ended_ms[i] = t
        self._unwait(job)
        job.cancelled = True
        job.version = index
        self._mark_finished(job, t)
        self._count("jobs_cancelled")
        deps = list(dict.fromkeys(self._ended(job, index, t)))
        return {"ok": True, "id": job.id, **({"deps": deps} if deps else {})}

    def _apply_forget(self, e: dict, index: int, t: int) -> dict:
        job = self._job(e.get("id"))
        self._owned(e, job.submitted_by, f"job {job.id}")
        kids = self.dependents.get(job.id)
        if kids:
            shown = ", ".join(list(kids)[:10]) + (f" and {len(kids) - 10} more" if len(kids) > 10 else "")
            raise Refused(409, f"job {job.id} is {job.state} and job(s) {shown} wait for it: "
                               "cancel them first, or let it end (forgetting it then loses "
                               "nothing they need)", "has_dependents")
        if not job.finished:
            raise Refused(409, f"job {job.id} is {job.state}: cancel it first "
                               f"(meshctl job cancel {job.id})", "not_finished")
        self._forget(job, "forget", t)
        return {"ok": True, "id": job.id}

    def _forget(self, job: Job, why: str, t: int) -> None:
        if self.on_forget is not None:
            self.on_forget(self.final_record(job), why, t, self.applied_index)
        quotas.dropped(self, job)
        del self.jobs[job.id]
        del self.finished[job.id]
        self.ready.pop(job.id, None)
        self.due.pop(job.id, None)
        self.forgotten[job.id] = None
        self._count("jobs_forgotten")
        while len(self.forgotten) > limits.forgotten_ids_max:
            del self.forgotten[next(iter(self.forgotten))]
            self._count("tombstones_dropped")

    def _apply_expire(self, e: dict, index: int, t: int) -> dict:
        """Retention: forget finished jobs the leader found too old or too many. A job that is
        not finished (or already gone) is passed over: the entry may be stale."""
        ids = e.get("ids")
        if not isinstance(ids, list) or len(ids) > limits.lease_batch_max:
            raise Refused(400, "malformed expire", "malformed")
        expired = []
        for job_id in ids:
            job = self.jobs.get(job_id) if isinstance(job_id, str) else None
            if job is not None and job.finished and not job.due_ms:  # a due re-run keeps it
                self._forget(job, "expire", t)
                expired.append(job_id)
        self._count("jobs_expired", len(expired))
        return {"ok": True, "expired": expired}

    def _apply_bulk(self, e: dict, index: int, t: int) -> dict:
        """One change (cancel, forget or tone) to many jobs, in one entry: each job's change is
        applied as if it were an entry of its own, so that a failover never applies half of a
        bulk request. The outcome answers per job: [id, answer, why], where answer is
        "changed", "already_final", "no_such_job" or "refused" (why: the refusal's words)."""
        op, ids = e.get("op"), e.get("ids")
        if (op not in ("cancel", "forget", "tone") or not isinstance(ids, list) or not ids
                or len(ids) > limits.bulk_jobs_max):
            raise Refused(400, "malformed bulk change", "malformed")
        fields = e.get("set") or {}
        if not isinstance(fields, dict) or (op == "tone") != bool(fields) or not set(fields) <= {
                "priority", "hold", "max_leases"}:
            raise Refused(400, "malformed bulk change", "malformed")
        rows = []
        who = {k: e[k] for k in ("by", "br") if k in e}
        for job_id in ids:
            out = self._apply_one({"k": op, "t": t, "id": job_id, **fields, **who}, index,
                                  nested=True)
            if out.get("ok"):
                rows.append([job_id, "changed", None])
            elif out.get("reason") == "not_owner":
                rows.append([job_id, "not_owner", out.get("error")])
            elif out.get("reason") in ("unknown_job", "forgotten"):
                rows.append([job_id, "no_such_job", None])
            elif out.get("reason") == "finished":
                rows.append([job_id, "already_final", None])
            else:
                rows.append([job_id, "refused", out.get("error")])
        self._count("bulk_changes")
        nxt = e.get("nx")  # the cursor of the filter's next page, handed back to the client
        skipped = e.get("so")  # jobs the filter matched that the caller may not change
        return {"ok": True, "op": op, "rows": rows,
                **({"skipped_not_owner": skipped} if _is_int(skipped) and skipped > 0 else {}),
                "next": nxt if isinstance(nxt, str) and len(nxt) <= limits.jobs_cursor_chars_max
                else None}

    def _apply_tone(self, e: dict, index: int, t: int) -> dict:
        job = self._job(e.get("id"))
        self._owned(e, job.submitted_by, f"job {job.id}")
        if job.finished:
            raise Refused(409, f"job {job.id} has already ended ({job.state})", "finished")
        changes = {}
        if "priority" in e:
            p = e["priority"]
            if isinstance(p, bool) or not isinstance(p, int) or abs(p) > limits.priority_abs_max:
                raise Refused(400, "malformed priority", "malformed")
            changes["priority"] = p
        if "hold" in e:
            if not isinstance(e["hold"], bool):
                raise Refused(400, "malformed hold", "malformed")
            changes["hold"] = e["hold"]
        if "max_leases" in e:
            ml = e["max_leases"]
            if ml is not None and (isinstance(ml, bool) or not isinstance(ml, int) or ml < 1):
                raise Refused(400, "malformed max_leases", "malformed")
            changes["max_leases"] = ml
        if not changes:
            raise Refused(400, "nothing to change", "malformed")
        for k, v in changes.items():
            setattr(job, k, v)
        job.version = index
        self._ready(job)
        return {"ok": True, "id": job.id}

    def _apply_pool(self, e: dict, index: int, t: int) -> dict:
        """Hold, release, drain or undrain a pool, fleet-wide or on one member (fleetctl.py)."""
        try:
            return self.ctl.apply_pool(e)
        except CtlRefused as r:
            raise Refused(r.status, r.message, "bad_order") from None

    def _apply_member(self, e: dict, index: int, t: int) -> dict:
        """Drain, undrain or stop a member (fleetctl.py)."""
        try:
            return self.ctl.apply_member(e, t)
        except CtlRefused as r:
            raise Refused(r.status, r.message, "bad_order") from None
    def _apply_cron(self, e: dict, index: int, t: int) -> dict:
        """A schedule added (or replaced), removed, paused or resumed; or one of its due runs
        fired by the leader (meshjobs/cron.py): the fire names only the schedule and the due
        time, which must be the one `cron.due` gives at the entry's time, so that a repeat, a
        second leader or a stale entry fires nothing."""
        op, name = e.get("op"), e.get("name")
        if not isinstance(name, str) or not cron.NAME_RE.fullmatch(name):
            raise Refused(400, "malformed schedule name", "malformed")
        c = self.crons.get(name)
        if op == "fire":
            d = e.get("due")
            if not _is_int(d) or c is None or not cron.fire_ok(c, d, t):
                self._count("cron_fires_stale")
                raise Refused(409, f"schedule {name} has no run due at {d} now", "cron_stale")
            return self._cron_fire(c, d, index, t)
        if op not in ("add", "rm", "pause", "resume"):
            raise Refused(400, "malformed schedule change", "malformed")
        if c is not None:
            self._owned(e, c.owner, f"schedule {name}")
        if op != "add":
            if c is None:
                raise Refused(404, f"no schedule {name} (see `meshctl cron list`)", "unknown_cron")
            if op == "rm":
                del self.crons[name]
                self._count("crons_removed")
                return {"ok": True, "cron": name, "removed": True}
            if (op == "pause") != c.paused:
                c.paused = op == "pause"
                # Due times while it was paused are not fired when it is resumed.
                c.done_ms = max(c.done_ms, t)
                c.version = index
            return {"ok": True, "cron": name}
        spec, job, catch_up, overlap = e.get("spec"), e.get("job"), e.get("catch_up"), e.get("overlap")
        try:
            ok = (isinstance(spec, str) and cron.Schedule.parse(spec).text == spec
                  and isinstance(job, dict) and cron.parse_job(job, committed=True) == job
                  and catch_up in cron.CATCH_UP and overlap in cron.OVERLAP)
        except (ControlError, cron.CronError):
            ok = False
        if not ok:
            raise Refused(400, "malformed schedule", "malformed")
        if c is not None:
            if c.same(spec, job, catch_up, overlap):
                return {"ok": True, "cron": name, "new": False}
            if e.get("replace") is not True:
                raise Refused(409, f"a different schedule named {name} exists: remove it first "
                                   f"(meshctl cron rm {name}), or replace it (--replace)", "conflict")
        elif len(self.crons) >= limits.cron_schedules_max:
            raise Refused(409, f"the fleet has {len(self.crons)} schedules, the most it keeps: "
                               "remove some (meshctl cron rm NAME)", "too_many")
        new = cron.Cron(name, spec, job, catch_up, overlap, created_ms=t, done_ms=t, version=index)
        if c is not None:
            # A replaced schedule keeps its history and whether it is paused; runs due before
            # the replacement are not fired by it.
            new.created_ms, new.paused = c.created_ms, c.paused
            new.last_due_ms, new.last_id, new.fired, new.skipped = (
                c.last_due_ms, c.last_id, c.fired, c.skipped)
            new.done_ms = max(c.done_ms, t)
        self.crons[name] = new
        self._count("crons_added" if c is None else "crons_replaced")
        return {"ok": True, "cron": name, "new": c is None}

    def _cron_fire(self, c: cron.Cron, d: int, index: int, t: int) -> dict:
        c.done_ms = d
        c.version = index
        last = self.jobs.get(c.last_id) if c.last_id is not None else None
        if c.overlap == "skip" and last is not None and not last.finished:
            c.skipped += 1
            self._count("cron_runs_skipped")
            return {"ok": True, "cron": c.name, "due": d, "skipped": "overlap"}
        job_id = cron.run_id(c.name, d)
        c.last_due_ms, c.last_id = d, job_id
        if job_id in self.jobs or job_id in self.forgotten:
            # Fired before (a replaced schedule's cursor went back? never: it only grows); the
            # id is taken, so a second job is never made.
            return {"ok": True, "cron": c.name, "due": d, "id": job_id, "new": False}
        c.fired += 1
        self._count("cron_runs_fired")
        out = self._apply_submit({"id": job_id, "spec": c.job, "dg": cron.job_digest(c.job),
                                  "items": [None]}, index, t)
        return {**out, "cron": c.name, "due": d}

    # --- reading ------------------------------------------------------------------------------

    def pick(self, pool: str, count: int, now_ms: int, skip: set[tuple[str, int]],
             member: str | None = None) -> list[tuple[str, int]]:
        """The next `count` items to lease in `pool`: priority first, then submit order, then
        each job's queue order; items in `skip` (already being proposed) are passed over. With
        `member`, only items that may go to that member (placement)."""
        if count <= 0:
            return []
        ready = [j for j in self.ready.values() if j.pool == pool]
        if member is not None:
            ready = [j for j in ready if j.pins is not None or placement.matches(j.selector, member)]
        ready.sort(key=lambda j: (-j.priority, j.seq))
        picked: list[tuple[str, int]] = []
        running: dict[str, int] = {}
        for job in ready:
            room = count - len(picked)
            if job.max_leases is not None:
                inflight = sum(1 for k in skip if k[0] == job.id)
                room = min(room, job.max_leases - job.n_leased - inflight)
            room = min(room, self._running_room(job, running, skip))
            for i in job.queue:
                if room <= 0:
                    break
                if (job.id, i) in skip or job.not_before.get(i, 0) > now_ms:
                    continue
                if member is not None and job.pins is not None and job.pins[i] != member:
                    continue
                picked.append((job.id, i))
                room -= 1
                if job.submitted_by in running:
                    running[job.submitted_by] += 1
            if len(picked) >= count:
                break
        return picked

    def place(self, pool: str, room: dict[str, int], count: int, now_ms: int,
              skip: set[tuple[str, int]], prefer: str = "") -> list[tuple[str, int, str]]:
        """The next items to lease in `pool`, in `pick`'s order, each with the member that
        takes it: of the members its job may go to (placement), the one with the most room
        left in `room` (member -> free slots in the pool, charged here), then `prefer`, then the
        greatest name. At most `count` items; an item no member with room may take waits (the
        items after it are still looked at)."""
        if count <= 0:
            return []
        left = sum(n for n in room.values() if n > 0)
        ready = [j for j in self.ready.values() if j.pool == pool]
        ready.sort(key=lambda j: (-j.priority, j.seq))
        picked: list[tuple[str, int, str]] = []
        matching: dict[str, list[str]] = {}
        running: dict[str, int] = {}

        def best(names: Any) -> str | None:
            return max((n for n in names if room.get(n, 0) > 0),
                       key=lambda n: (room[n], n == prefer, n), default=None)

        for job in ready:
            if len(picked) >= count or left <= 0:
                break
            quota = count - len(picked)
            if job.max_leases is not None:
                inflight = sum(1 for k in skip if k[0] == job.id)
                quota = min(quota, job.max_leases - job.n_leased - inflight)
            quota = min(quota, self._running_room(job, running, skip))
            names: Any = room
            if job.selector is not None and job.pins is None:
                names = matching.get(job.selector)
                if names is None:  # once per selector and round, however many jobs name it
                    names = matching[job.selector] = [
                        n for n in room if placement.matches(job.selector, n)]
            for i in job.queue:
                if quota <= 0 or left <= 0:
                    break
                if (job.id, i) in skip or job.not_before.get(i, 0) > now_ms:
                    continue
                member = best((job.pins[i],) if job.pins is not None else names)
                if member is None:
                    if job.pins is None:
                        break  # none of its members has room: no other item of it goes either
                    continue
                room[member] -= 1
                left -= 1
                picked.append((job.id, i, member))
                quota -= 1
                if job.submitted_by in running:
                    running[job.submitted_by] += 1
        return picked

    def _running_room(self, job: Job, running: dict[str, int], skip: set[tuple[str, int]]) -> int:
        """How many more items of `job` its submitter's running_items_max lets lease now:
        `running` holds, per submitter looked at in this pick, its leased items plus those in
        flight (`skip`) and picked so far; counted once per submitter and pick."""
        limit = job.running_items_max
        if limit is None:
            return limits.items_max
        who = job.submitted_by
        n = running.get(who)
        if n is None:
            n = running[who] = quotas.running_items(self, who) + sum(
                1 for k in skip if (j := self.jobs.get(k[0])) is not None and j.submitted_by == who)
        return limit - n

    def next_due_ms(self, now_ms: int) -> int | None:
        """The earliest time still to come at which a backed-off item becomes leasable, if any
        (a backoff already over needs no wake-up: the item waits for a slot like any other)."""
        due = [t for j in self.ready.values() if j.not_before
               for t in j.not_before.values() if t > now_ms]
        return min(due) if due else None

    def members_named(self) -> set[str]:
        """The members this table has named since it was made or loaded: those its items ran
        on or were leased or pinned to, or that held copies of their outputs (up to
        `limits.member_names_max` of them), and those its orders name. A new leader waits to
        hear from them before it answers about the members (node/heard.py)."""
        return set(self._names) | self.ctl.members_named()

    def leases_of(self, member: str) -> list[tuple[str, int, int, str]]:
        """(job id, index, epoch, boot) of every item leased to `member`."""
        return [(jid, i, self.jobs[jid].epoch[i], boot)
                for (jid, i), (m, boot) in self.leased.items() if m == member]

    def lease_current(self, job_id: str, i: int, epoch: int) -> bool:
        job = self.jobs.get(job_id)
        return job is not None and 0 <= i < job.n and job.st[i] == LEASED and job.epoch[i] == epoch

    def record(self, job: Job, items: bool | str = False) -> dict:
        """A job as clients see it: the job record of `GET /jobs/{id}`. `items="copy"`: its
        "items" is an `ItemRows` copy, for the sender to turn into the list (`materialize`)."""
        rec = {
            "id": job.id,
            "state": job.state,
            "version": job.version,
            "submitted_by": job.submitted_by,
            "priority": job.priority,
            "hold": job.hold,
            "tags": list(job.tags),
            "pool": job.pool,
            "argv": list(job.argv),
            "env": dict(job.env),
            "cwd": job.cwd,
            "user": job.user,
            "inherit_env": job.inherit_env,
            "retries": job.retries,
            "runtime_s": job.runtime_s,
            "max_leases": job.max_leases,
            "items_total": job.n,
            "items_done": job.n_done,
            "items_failed": job.n_failed,
            "items_cancelled": job.n_cancelled,
            "items_running": job.n_leased,
            "items_pending": job.n_pending,
            # Items with earlier attempts said (items[].earlier_attempts): a lease lost, a retry.
            "items_tried_before": len(job.tries) if job.tries else 0,
            "submitted_at": job.submitted_ms / 1000.0,
            "finished_at": job.finished_ms / 1000.0 if job.finished_ms else None,
        }
        if job.selector is not None:
            # Where its items may go; a fan-out's members (item i runs on member i) and those
            # of them whose item still waits for a lease.
            rec["member"] = job.selector
            if job.pins is not None:
                rec["members"] = list(job.pins)
                rec["pending_members"] = [job.pins[i] for i in sorted(job.queue)]
        if job.after is not None:
            # The parents it names, and those of them it still waits for (empty once it runs).
            rec["after"] = [dict(d) for d in job.after]
            rec["waiting_on"] = [{"id": p, "on": on} for p, on in (job.waiting_on or {}).items()]
        if job.notify is not None:
            rec["notify"] = job.notify
        rec.update({k: v for k, v in job.spec_fields().items()
                    if k in ("restart", "restart_delay_s", "resubmit", "stdout", "stderr")})
        rec.update(reruns.record_fields(job))
        if items:
            rec["items"] = (ItemRows(job) if items == "copy"
                            else [self.item_record(job, i) for i in range(job.n)])
            if job.names is not None:
                rec["names"] = list(job.names)
        return rec

    def final_record(self, job: Job) -> dict:
        """A job's record as its history keeps it: the record, and a summary of its items (how
        many ended in each state, and the members that ran them)."""
        rec = self.record(job)
        states: dict[str, int] = {}
        for code in job.st:
            name = ITEM_STATE_NAMES[code]
            states[name] = states.get(name, 0) + 1
        rec["items_summary"] = {"states": states,
                                "members": sorted({m for m in job.member if m is not None})}
        return rec

    def item_record(self, job: Job, i: int) -> dict:
        return _item_record(job, i)

    # --- snapshots ------------------------------------------------------------------------------

    def to_state(self) -> dict:
        """Everything the table is, as msgpack-able plain data (for the full dump)."""
        jobs = []
        for j in self.jobs.values():
            row = [
                j.id, j.seq, j.spec_fields(), j.digest, j.submitted_ms, j.finished_ms,
                j.cancelled, j.n, bytes(j.st), j.attempts.tobytes(), j.fails.tobytes(),
                j.epoch.tobytes(), j.member, j.rc.tobytes(), bytes(j.sig), j.stdin, j.out, j.err,
                j.started_ms.tobytes(), j.ended_ms.tobytes(), list(j.not_before.items()),
                list(j.queue), j.started,
            ]
            if j.errors or j.held is not None:
                # Only jobs that have some: rows of the others stay small.
                row.append(sorted(j.errors.items()) if j.errors else [])
            if j.held is not None:
                row.append([list(h) if h else None for h in j.held])
            jobs.append(row)
        return {
            "v": 1,
            "jobs": jobs,
            "forgotten": list(self.forgotten),
            "seq": self.seq,
            "applied_index": self.applied_index,
            "leased": [[k[0], k[1], v[0], v[1]] for k, v in self.leased.items()],
            "rids": list(self.rids.items()),
            "counts": self.counts,
            # Each job's version, in the order of "jobs" (a list of its own, so that a
            # snapshot made before versions existed still loads).
            "versions": [j.version for j in self.jobs.values()],
            # Dependencies: each waiting job's parents not ended yet (in order), and the jobs
            # that ended dep_failed. Only when some job has them, so that a snapshot of a
            # table without dependencies is as it was.
            **({"waits": [[j.id, list(j.waiting_on.items())] for j in self.jobs.values()
                          if j.waiting_on]} if self.dependents else {}),
            **({"dep_failed": [j.id for j in self.jobs.values() if j.dep_failed]}
               if any(j.dep_failed for j in self.jobs.values()) else {}),
            # Earlier attempts' reasons, item by item. Only when some job has them (a snapshot
            # from before them loads without).
            **({"tries": [[j.id, [[i, [list(x) for x in kept]] for i, kept in j.tries.items()]]
                          for j in self.jobs.values() if j.tries]}
               if any(j.tries for j in self.jobs.values()) else {}),
            # Fan-outs: each one's members, item by item. Only when some job has them.
            **({"pins": [[j.id, j.pins] for j in self.jobs.values() if j.pins is not None]}
               if any(j.pins is not None for j in self.jobs.values()) else {}),
            # Pool and member orders, only when there are some (as dependencies).
            **({"ctl": self.ctl.to_state()} if self.ctl.active() else {}),
            **reruns.to_state(self),
            # Schedules, only when there are some (a snapshot without them is as it was).
            **({"crons": [c.row() for c in self.crons.values()]} if self.crons else {}),
            # Committed time (Rule 7): the greatest stamp, the last stamp and its proposer, and
            # each job's committed time at its end, in the order of "jobs" (0: not ended).
            "clock": [self.clock_ms, self.stamp_ms, self.stamp_by],
            "finished_clock": [j.finished_clock_ms for j in self.jobs.values()],
        }

    @classmethod
    def from_state(cls, s: dict) -> JobTable:
        if not isinstance(s, dict) or s.get("v") != 1:
            raise ValueError("not a job table snapshot of format 1")
        t = cls()
        for row in s["jobs"]:
            (jid, seq, spec, digest, sub, fin, canc, n, st, att, fails, ep, member, rc, sig,
             stdin, out, err, started, ended, nb, queue, ever) = row[:23]
            shared: dict[bytes, bytes] = {}
            j = Job(jid, seq, spec, digest,
                    [None if d is None else shared.setdefault(d, d) for d in stdin], sub)
            j.finished_ms = fin
            j.cancelled = canc
            j.st = bytearray(st)
            j.attempts = array("I", att)
            j.fails = array("I", fails)
            j.epoch = array("Q", ep)
            j.member = [None if m is None else t._name(m) for m in member]
            j.rc = array("i", rc)
            j.sig = bytearray(sig)
            j.out = [_EMPTY if d == _EMPTY else d for d in out]
            j.err = [_EMPTY if d == _EMPTY else d for d in err]
            j.started_ms = array("Q", started)
            j.ended_ms = array("Q", ended)
            j.not_before = {int(k): v for k, v in nb}
            j.queue = ItemQueue.of(queue)
            j.started = ever
            if len(row) > 23 and row[23]:
                j.errors = {int(i): t._texts.setdefault(e, e) for i, e in row[23]}
            if len(row) > 24:
                j.held = [t._holders(tuple(h)) if h else None for h in row[24]]
            j.n_pending = st.count(PENDING)
            j.n_leased = st.count(LEASED)
            j.n_done = st.count(DONE)
            j.n_failed = st.count(FAILED) + st.count(TIMEOUT)
            j.n_cancelled = st.count(CANCELLED)
            if j.n != n:
                raise ValueError(f"snapshot job {jid}: {j.n} items, header says {n}")
            t.jobs[jid] = j
        t.forgotten = dict.fromkeys(s["forgotten"])
        t.seq = s["seq"]
        t.applied_index = s["applied_index"]
        t.leased = {(a, b): (c, d) for a, b, c, d in s["leased"]}
        t.rids = dict((k, v) for k, v in s["rids"])
        t.counts = dict(s["counts"])
        versions = s.get("versions")
        if versions is None:
            # A snapshot from before versions: every job counts as changed at the snapshot's
            # index (later changes still come with higher ones).
            versions = [t.applied_index] * len(t.jobs)
        if len(versions) != len(t.jobs):
            raise ValueError(f"snapshot has {len(versions)} job versions for {len(t.jobs)} jobs")
        for j, v in zip(t.jobs.values(), versions, strict=True):
            j.version = v
        for jid, waits in s.get("waits", ()):
            j = t.jobs[jid]
            j.waiting_on = {p: on for p, on in waits}
            for p in j.waiting_on:
                t.dependents.setdefault(p, {})[jid] = None
        for jid in s.get("dep_failed", ()):
            t.jobs[jid].dep_failed = True
        for jid, rows in s.get("tries", ()):
            t.jobs[jid].tries = {int(i): [(a, None if m is None else t._name(m), t._text(w), at)
                                          for a, m, w, at in kept] for i, kept in rows}
        for jid, pins in s.get("pins", ()):
            t.jobs[jid].pins = [t._name(m) for m in pins]
        t.ctl = FleetCtl.from_state(s.get("ctl"))
        quotas.rebuild(t)
        reruns.from_state(t, s)
        for row in s.get("crons", ()):
            c = cron.Cron.from_row(row)
            t.crons[c.name] = c
        clock = s.get("clock")
        ended = s.get("finished_clock")
        if clock is None:
            # A snapshot from before committed time (Rule 7): the times its entries carried
            # were their proposers' wall clocks, and so stand for committed time.
            ended = [j.finished_ms for j in t.jobs.values()]
            last = max([j.submitted_ms for j in t.jobs.values()] + ended + [0])
            clock = [last, last, ""]
        if not (isinstance(clock, list) and len(clock) == 3 and isinstance(ended, list)
                and len(ended) == len(t.jobs)):
            raise ValueError("snapshot's committed time does not fit its jobs")
        t.clock_ms, t.stamp_ms, t.stamp_by = clock
        for j, c in zip(t.jobs.values(), ended, strict=True):
            j.finished_clock_ms = c
        for j in sorted((j for j in t.jobs.values() if j.finished_ms),
                        key=lambda j: (j.finished_clock_ms, j.seq)):
            t.finished[j.id] = j.finished_clock_ms
        for j in t.jobs.values():
            t._ready(j)
        t.check()
        return t

    def load(self, other: JobTable) -> None:
        """Become `other` (a snapshot was installed); the member's hook stays."""
        hook = self.on_forget
        self.__dict__.update(other.__dict__)
        self.on_forget = hook

    # --- invariants -----------------------------------------------------------------------------

    def check(self) -> None:
        """Check every invariant of the table; raise AssertionError on the first broken one."""
        leased_seen = set()
        for jid, j in self.jobs.items():
            assert jid not in self.forgotten, f"job {jid} is both live and forgotten"
            assert len(j.st) == j.n == len(j.stdin) == len(j.out) == len(j.attempts), jid
            counts = [j.st.count(s) for s in range(6)]
            assert sum(counts) == j.n, f"{jid}: an item in no state"
            assert counts[PENDING] == j.n_pending, f"{jid}: pending count"
            assert counts[LEASED] == j.n_leased, f"{jid}: leased count"
            assert counts[DONE] == j.n_done, f"{jid}: done count"
            assert counts[FAILED] + counts[TIMEOUT] == j.n_failed, f"{jid}: failed count"
            assert counts[CANCELLED] == j.n_cancelled, f"{jid}: cancelled count"
            q = list(j.queue)
            assert len(q) == len(set(q)) == j.n_pending, f"{jid}: queue holds each pending item once"
            assert all(j.st[i] == PENDING for i in q), f"{jid}: queue holds a non-pending item"
            for i in range(j.n):
                if j.st[i] == LEASED:
                    assert (jid, i) in self.leased, f"{jid}[{i}] leased but not in the lease map"
                    leased_seen.add((jid, i))
            assert j.held is None or len(j.held) == j.n, f"{jid}: holders of no item"
            for i, kept in (j.tries or {}).items():
                assert 0 < len(kept) <= limits.item_attempts_kept_max and 0 <= i < j.n, \
                    f"{jid}[{i}]: earlier attempts kept"
                nums = [k[0] for k in kept]
                assert nums == list(range(nums[0], nums[0] + len(nums))), \
                    f"{jid}[{i}]: earlier attempts {nums} not in order"
                assert nums[-1] <= j.attempts[i] and (j.st[i] != LEASED or nums[-1] < j.attempts[i]), \
                    f"{jid}[{i}]: an earlier attempt {nums[-1]} not before attempt {j.attempts[i]}"
            if j.errors is not None:
                assert j.errors, f"{jid}: an empty error dict is kept as None"
                assert all(0 <= i < j.n and isinstance(e, str) for i, e in j.errors.items()), \
                    f"{jid}: an item error of no item"
            assert 0 < j.version <= self.applied_index, f"{jid}: version {j.version} out of the log"
            done = j.n_done + j.n_failed + j.n_cancelled == j.n
            assert bool(j.finished_ms) == (done or j.cancelled), f"{jid}: finished mark"
            if j.waiting_on is not None:
                assert j.waiting_on, f"{jid}: an empty waiting_on is kept as None"
                assert not j.finished_ms and not j.started and not j.n_leased, \
                    f"{jid}: waiting, yet ended or leased"
                assert not j.dep_failed and not j.cancelled, f"{jid}: waiting, yet ended"
                after = {d["id"]: d["on"] for d in j.after or ()}
                for p, on in j.waiting_on.items():
                    assert after.get(p) == on, f"{jid}: waits on {p}:{on}, not in its after"
                    parent = self.jobs.get(p)
                    assert parent is not None and not parent.finished_ms, \
                        f"{jid}: waits on {p}, which has ended or is gone"
                    assert parent.seq < j.seq, f"{jid}: waits on a younger job {p} (a cycle?)"
                    assert jid in self.dependents.get(p, {}), f"{jid}: not among {p}'s dependents"
            if j.dep_failed:
                assert j.finished_ms and not j.cancelled and j.after, f"{jid}: dep_failed mark"
                assert j.n_cancelled == j.n, f"{jid}: dep_failed with items that ran"
            assert (j.pins is not None) == (j.selector == placement.FANOUT), f"{jid}: fan-out pins"
            if j.selector is not None:
                assert j.pins is None or len(j.pins) == j.n, f"{jid}: a pin per item"
                for i in range(j.n):
                    m = j.member[i]
                    assert m is None or placement.allows(j.selector, j.pins, i, m), \
                        f"{jid}[{i}] ran on {m}, which its member selector does not allow"
        assert leased_seen == set(self.leased), "lease map and item states disagree"
        assert set(self.finished) == {jid for jid, j in self.jobs.items() if j.finished_ms}, \
            "finished index and jobs disagree"
        for jid, c in self.finished.items():
            assert c == self.jobs[jid].finished_clock_ms <= self.clock_ms, \
                f"{jid}: ended at committed time {c}, after the table's {self.clock_ms}"
        assert self.stamp_ms <= self.clock_ms, "the last stamp is past committed time"
        assert set(self.ready) == {jid for jid, j in self.jobs.items()
                                   if j.n_pending and not j.hold and not j.waiting_on}, \
            "ready index and jobs disagree"
        for p, kids in self.dependents.items():
            assert kids, f"an empty dependents entry for {p}"
            for kid in kids:
                waits = self.jobs[kid].waiting_on if kid in self.jobs else None
                assert waits is not None and p in waits, f"{kid} listed as waiting on {p}, but is not"
        assert all(self.jobs[jid] is j for jid, j in self.ready.items()), "ready index holds a stale job"
        self.ctl.check()
        reruns.check(self)
        quotas.check(self)
        assert len(self.crons) <= limits.cron_schedules_max, "more schedules than the limit"
        for name, c in self.crons.items():
            assert c.name == name and cron.NAME_RE.fullmatch(name), f"schedule {name}: its name"
            assert c.catch_up in cron.CATCH_UP and c.overlap in cron.OVERLAP, f"schedule {name}"
            assert c.created_ms <= c.done_ms, f"schedule {name}: cursor before its creation"
            assert c.last_due_ms <= c.done_ms, f"schedule {name}: fired past its cursor"
            assert c.last_id is None or c.last_id == cron.run_id(name, c.last_due_ms), \
                f"schedule {name}: its last run's id is not made of its due time"
            assert 0 < c.version <= self.applied_index, f"schedule {name}: version out of the log"


def _item_record(job: Any, i: int) -> dict:
    rc = job.rc[i]
    rec = {
        "index": i,
        "state": ITEM_STATE_NAMES[job.st[i]],
        "attempts": job.attempts[i],
        "member": job.member[i],
        "epoch": job.epoch[i] or None,
        "rc": None if rc == RC_NONE else rc,
        "signal": job.sig[i] or None,
        "stdin": _hex(job.stdin[i]),
        "stdout": _hex(job.out[i]),
        "stderr": _hex(job.err[i]),
        "error": job.errors.get(i) if job.errors is not None else None,
        # Members other than `member` that held a copy of the outputs when they committed.
        "copies": list(job.held[i] or ()) if job.held is not None else [],
        # Why its earlier attempts ended (the last limits.item_attempts_kept_max), oldest first.
        "earlier_attempts": [{"attempt": a, "member": m, "why": w, "at": at / 1000.0}
                             for a, m, w, at in (job.tries.get(i, ()) if job.tries else ())],
        "started_at": job.started_ms[i] / 1000.0 if job.started_ms[i] else None,
        "ended_at": job.ended_ms[i] / 1000.0 if job.ended_ms[i] else None,
    }
    if job.pins is not None:
        rec["for_member"] = job.pins[i]  # a fan-out's item: the member it is for
    return rec


class ItemRows:
    """A job's items as they were when it was read, for a record's "items" built elsewhere.

    The jobs thread copies the job's per-item columns (C-level copies of arrays, bytes and
    lists: a few milliseconds for 100,000 items) instead of building one dict per item (half a
    second at 100,000 items, the jobs thread stopped meanwhile); whoever sends the record builds
    the dicts from the copy, a slice at a time (`records`). They are the dicts `item_record`
    makes, of the job as it was when copied: later changes to the job are not in them."""

    __slots__ = ("n", "st", "attempts", "member", "epoch", "rc", "sig", "stdin", "out", "err",
                 "errors", "held", "started_ms", "ended_ms", "pins", "tries")

    def __init__(self, job: Job) -> None:
        self.n = job.n
        self.st = bytes(job.st)
        self.attempts = job.attempts[:]
        self.member = job.member[:]
        self.epoch = job.epoch[:]
        self.rc = job.rc[:]
        self.sig = bytes(job.sig)
        self.stdin = job.stdin[:]
        self.out = job.out[:]
        self.err = job.err[:]
        self.errors = dict(job.errors) if job.errors is not None else None
        self.held = job.held[:] if job.held is not None else None  # tuples: shared, not copied
        self.started_ms = job.started_ms[:]
        self.ended_ms = job.ended_ms[:]
        self.pins = job.pins[:] if job.pins is not None else None
        self.tries = ({i: kept[:] for i, kept in job.tries.items()}
                      if job.tries is not None else None)

    def __len__(self) -> int:
        return self.n

    def records(self, lo: int = 0, hi: int | None = None) -> list[dict]:
        """The item records of items lo..hi-1 (all by default)."""
        hi = self.n if hi is None else min(hi, self.n)
        return [_item_record(self, i) for i in range(max(0, lo), hi)]


def materialize(body: Any) -> Any:
    """`body` with an `ItemRows` under "items" turned into the list of item records (the body
    itself when it has none)."""
    if isinstance(body, dict) and isinstance(body.get("items"), ItemRows):
        return {**body, "items": body["items"].records()}
    return body


def _hex(d: bytes | None) -> str | None:
    return None if d is None else d.hex()


def _spec_ok(spec: dict) -> bool:
    """A committed spec passes the same checks a client's does, and is already normalized."""
    if "id" in spec or "items" in spec:
        return False
    try:
        norm = parse_submit(spec, committed=True)
    except ControlError:
        return False
    # Of the same types too: a client's 3.0 is normalized to 3 before it is proposed, so a
    # committed 3.0 (equal to 3 in Python) was not.
    return norm == {**spec, "id": None} and all(type(norm[k]) is type(v) for k, v in spec.items())


def _failed_words(state: int, rc: int | None, sig: int | None, error: str | None,
                  runtime_s: float | None) -> str:
    """How a failed attempt ended, in words (its error when the result says one)."""
    if error:
        return error
    if state == TIMEOUT:
        return "timeout: killed after its runtime limit" + (
            f" of {runtime_s:g} s" if runtime_s is not None else "")
    if sig:
        return f"killed by signal {sig}"
    return f"exit {rc}" if rc is not None else "failed"


def _is_int(x: Any) -> bool:
    return type(x) is int  # not bool, not float: remote garbage must not pass as a number


def _result_ok(r: Any) -> bool:
    """A result row: job, index, epoch, state, rc, signal, stdout, stderr, started, ended and,
    when the item could not run (or the driver says why it failed), an eleventh field: why; and
    a twelfth (the eleventh then may be None): the other members that hold its outputs."""
    return (
        isinstance(r, list) and 10 <= len(r) <= 12
        and (len(r) == 10 or (r[10] is None and len(r) == 12) or (
            isinstance(r[10], str) and 0 < len(r[10]) <= limits.item_error_chars_max))
        and (len(r) < 12 or (isinstance(r[11], list) and len(r[11]) <= limits.result_holders_max
                             and all(isinstance(m, str) and 0 < len(m) <= 64 for m in r[11])))
        and isinstance(r[0], str) and _is_int(r[1]) and _is_int(r[2])
        and _is_int(r[3]) and r[3] in (DONE, FAILED, TIMEOUT)
        and (r[4] is None or (_is_int(r[4]) and -(2**31) < r[4] < 2**31))
        and (r[5] is None or (_is_int(r[5]) and 0 <= r[5] < 256))
        and (r[6] is None or (isinstance(r[6], bytes) and len(r[6]) == 32))
        and (r[7] is None or (isinstance(r[7], bytes) and len(r[7]) == 32))
        and _is_int(r[8]) and _is_int(r[9]) and 0 <= r[8] < 2**63 and 0 <= r[9] < 2**63
    )


_APPLIERS = {
    "submit": JobTable._apply_submit,
    "lease": JobTable._apply_lease,
    "result": JobTable._apply_result,
    "revoke": JobTable._apply_revoke,
    "cancel": JobTable._apply_cancel,
    "forget": JobTable._apply_forget,
    "tone": JobTable._apply_tone,
    "expire": JobTable._apply_expire,
    "batch": JobTable._apply_batch,
    "bulk": JobTable._apply_bulk,
    "pool": JobTable._apply_pool,
    "member": JobTable._apply_member,
    "rerun": reruns.apply_rerun,
    "cron": JobTable._apply_cron,
}
