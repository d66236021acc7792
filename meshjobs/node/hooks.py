"""The node's side of operators' orders (pools held or drained, members drained or stopped:
see meshjobs/fleetctl.py for what each means) and of jobs' finish hooks.

Orders: the leader turns an order into an entry (a stop names the member's current boot id),
leases nothing an order forbids (`Orders.room`), and every member starts no leased item of a
pool held on it (`Orders.may_start`). A member ordered to stop exits (the `Exit` effect) once its runs
have ended and their results are committed, or once its grace is over.

Finish hooks: when an entry ends a job that has a `notify` URL, the leader (only it) hands the
job's final record to the edge (the `Notify` effect), keyed by job id and version. A new leader
hands on again every such job that ended within `notify_retry_s_max` before it came to lead:
the old leader may have died before its notice got through. So a notice is delivered at least
once, and may come twice across a failover; the key tells a receiver it is the same.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from meshjobs import limits
from meshjobs.control import Answer
from meshjobs.fleetctl import pools_view
from meshjobs.node.events import Exit, NodeConfig, Notify
from meshjobs.node.feed import named_jobs
from meshjobs.node.heard import Hearing


class Orders:
    """A part of the node: pool and member orders as this member carries them out. It owns
    whether its exit was asked for; it is given the config, the table, the boot id the leader
    knows of each member, the node's counter and the way out for its `Exit` effect."""

    def __init__(self, cfg: NodeConfig, table: Any, boot_of: Callable[[str], str],
                 count: Callable[[str], None], emit: Callable[[Any], None]) -> None:
        self.cfg = cfg
        self.table = table
        self._boot_of = boot_of
        self._count = count
        self._emit = emit
        self.exit_sent = False

    # --- orders, at the leader ----------------------------------------------------------------

    def _known_members(self, members: Iterable[str]) -> set[str]:
        ctl = self.table.ctl
        return ({self.cfg.member} | set(self.cfg.voters) | set(members)
                | set(ctl.drained) | set(ctl.stops))

    def entry(self, req: dict, entry: dict, offered: set[str], members: Iterable[str],
              hearing: Hearing | None = None, now_ms: int = 0) -> Answer | None:
        """Fill in the entry of a pool or member order (`offered`: the pools some member
        offers; `members`: those the leader knows of); the refusal when it is refused. While
        the leader has not heard from the fleet yet (`hearing`, node/heard.py), a pool or
        member it does not know, or a member to stop that has not reported, is "not known
        yet" (503), not refused: it may only not have reported yet."""
        known = self._known_members(members)
        if req["op"] == "pool":
            pool, member = req["pool"], req["member"]
            if pool not in offered and pool not in self.table.ctl.pools_named():
                if hearing is not None:
                    return hearing.answer(f"whether some member offers pool {pool!r}", now_ms)
                pools = ", ".join(sorted(offered)) or "no pools"
                return Answer(404, {"error": f"unknown pool {pool!r}: this fleet has {pools} "
                                             "(see meshctl pools)"})
            if member is not None and member not in known:
                if hearing is not None:
                    return hearing.answer(f"whether member {member!r} is in this fleet", now_ms)
                return Answer(404, {"error": f"no member {member!r} in this fleet (see "
                                             "meshctl fleet)"})
            entry.update({"a": req["action"], "pool": pool})
            if member is not None:
                entry["member"] = member
            if "slots" in req:
                entry["slots"] = req["slots"]
            return None
        name = req["name"]
        if name not in known:
            if hearing is not None:
                return hearing.answer(f"whether member {name!r} is in this fleet", now_ms)
            return Answer(404, {"error": f"no member {name!r} in this fleet (see meshctl "
                                         "fleet)"})
        entry.update({"a": req["action"], "name": name})
        if req["action"] == "stop":
            boot = self._boot_of(name)
            if not boot and hearing is not None:
                return hearing.answer(f"which run of member {name} to stop", now_ms)
            if not boot:
                return Answer(409, {"error": f"member {name} has not reported to the leader "
                                             "since it came to lead (is it running?): see "
                                             "meshctl fleet, and try again"})
            entry["boot"] = boot
            if req.get("grace_s") is not None:
                entry["grace_ms"] = int(req["grace_s"] * 1000)
        return None

    @staticmethod
    def answer(outcome: dict) -> Answer:
        """The answer to a committed pool or member order."""
        if not outcome.get("ok"):
            return Answer(outcome.get("status", 409), {"error": outcome.get("error", "refused")})
        # "fp" is the table's note of the request a replayed outcome answered, not the answer.
        return Answer(200, {k: v for k, v in outcome.items() if k not in ("ok", "fp")})

    def room(self, room: dict[str, dict[str, int]]) -> None:
        """No room on members drained or stopping, nor in pools held or drained on them."""
        ctl = self.table.ctl
        if not ctl.active():
            return
        for name in list(room):
            if ctl.closed(name, self._boot_of(name)):
                del room[name]
                continue
            pools = room[name]
            for pool in pools:
                if ctl.pool_held(pool, name) or ctl.pool_drained(pool, name):
                    pools[pool] = 0

    # --- orders, at every member ----------------------------------------------------------------

    def may_start(self, job: Any) -> bool:
        """Whether this member may start a leased item of `job` now."""
        ctl = self.table.ctl
        return not ctl.active() or not (ctl.pool_held(job.pool, self.cfg.member)
                                        or ctl.stopping(self.cfg.member, self.cfg.boot))

    def stop_check(self, running: int, results_waiting: bool, now_ms: int) -> None:
        """Exit when ordered to stop: once every run has ended and its result is committed, or
        once the grace is over (the edge then cuts what still runs)."""
        ctl = self.table.ctl
        if self.exit_sent or not ctl.stops or not ctl.stopping(self.cfg.member, self.cfg.boot):
            return
        _boot, t, grace_ms = ctl.stops[self.cfg.member]
        if not running and not results_waiting:
            why = "ordered to stop (meshctl member stop): its running items have ended"
        elif grace_ms is not None and now_ms >= t + grace_ms:
            why = (f"ordered to stop (meshctl member stop): the grace of {grace_ms / 1000:g} s "
                   f"is over; {running} running item(s) cut, to be leased again elsewhere")
        else:
            return
        self.exit_sent = True
        self._count("stop_ordered_exits")
        self._emit(Exit(why))

    def fleet_rows(self, members: dict[str, dict]) -> None:
        """Each member's row in the fleet view says whether it is drained or stopping, and
        gives its pools' effective slots (`pool slots` orders over its config)."""
        ctl = self.table.ctl
        for name, row in members.items():
            row["drained"] = name in ctl.drained
            boot = self._boot_of(name)
            row["stopping"] = bool(boot) and ctl.stopping(name, boot)
            if ctl.slots and row.get("pools"):
                row["pools"] = ctl.effective(name, row["pools"])
                row["slots"] = sum(row["pools"].values())

    def slots_here(self, pool: Any) -> int:
        """How many items of `pool` (a configured pool) this member runs at once: its effective
        slots; with slots set to 0, its configured ones, so that what was leased before runs
        to its end as in a drain (the leader leases nothing more here)."""
        n = self.table.ctl.slots_of(pool.name, self.cfg.member, pool.slots)
        return n if n > 0 else pool.slots

    def pools(self, fleet: dict) -> dict:
        """Per pool, fleet-wide: slots, free, running, pending, held and drained (GET /pools),
        from the fleet view `fleet`."""
        leased: dict[str, dict[str, int]] = {}
        jobs = self.table.jobs
        for (jid, _i), (member, _boot) in self.table.leased.items():
            by = leased.setdefault(jobs[jid].pool, {})
            by[member] = by.get(member, 0) + 1
        pending: dict[str, int] = {}
        for j in self.table.ready.values():
            pending[j.pool] = pending.get(j.pool, 0) + j.n_pending
        return pools_view(fleet, self.table.ctl, leased, pending)


class Notices:
    """A part of the node: finish hooks (see above). It owns the keys of the notices handed on
    and the reign whose ends it handed on again; it is given the table, the node's counter and
    the way out for its `Notify` effects. Only the leader calls it."""

    def __init__(self, table: Any, count: Callable[[str], None],
                 emit: Callable[[Any], None]) -> None:
        self.table = table
        self._count = count
        self._emit = emit
        self.handed: dict[str, None] = {}  # keys of notices handed on, oldest first
        self.reign = -1  # the term whose jobs ended before it were handed on again

    def ends(self, kind: Any, e: dict, out: dict, index: int) -> None:
        """Hand on the end of every job with a finish hook this entry ended."""
        for job_id in named_jobs(kind, e, out):
            job = self.table.jobs.get(job_id)
            if job is not None and job.notify is not None and job.finished and job.version == index:
                self._notice(job)

    def replay(self, term: int, now_ms: int) -> None:
        """A new reign hands on again the ends of the last `notify_retry_s_max` (see above)."""
        if self.reign == term:
            return
        self.reign = term
        since = now_ms - limits.notify_retry_s_max * 1000
        jobs = self.table.jobs
        looked = 0
        for job_id in reversed(self.table.finished):
            job = jobs[job_id]
            looked += 1
            if job.finished_ms < since or looked > limits.notify_sent_max:
                break
            if job.notify is not None:
                self._count("notify_replayed")
                self._notice(job)

    def _notice(self, job: Any) -> None:
        key = f"{job.id}.{job.version}"
        if key in self.handed:
            return
        self.handed[key] = None
        while len(self.handed) > limits.notify_sent_max:
            del self.handed[next(iter(self.handed))]
        self._count("notify_handed")
        self._emit(Notify(job.notify, key, self.table.final_record(job)))
