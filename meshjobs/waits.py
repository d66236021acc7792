"""Why a job's pending items wait: every reason the table knows, said the same way everywhere.

Theory of operation. An item waits for a lease while anything in `JobTable._apply_lease`'s
test (or the leader's `place`) keeps it back. `reasons` walks those conditions in the order a
user acts on them and says each that holds, as (code, words): the job held, its dependencies,
its pool held or drained (fleet-wide, or where), its submitter's quota, its own `max_leases`,
items backing off after a failure and, when nothing else holds it, a free slot in its pool
(with how many items are ahead of it in the leader's order). Placement (no alive member
matches its selector) needs the leader's view of who is alive, so the HTTP edge adds it
(`placement.waiting_for`) and `merge` puts it in place of the slot.

The record of `GET /jobs/{id}` (and the job page's) carries them as `waiting_for` (the words,
joined by "; ") and `waiting_reasons` (a list of {reason, says}); a job with nothing pending, or
one that has ended, has neither.

Rule 1: pure. No IO, clock or threads: the table and the time (`now_ms`, the reader's) come in.
Rule 2: bounded. Names listed are cut at `limits.waiting_names_shown_max`; the count of items
        ahead walks the ready jobs of one pool once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from meshjobs import limits, quotas
from meshjobs.fleetctl import ALL

if TYPE_CHECKING:
    from meshjobs.table import Job, JobTable

# The codes of `waiting_reasons`, in the order they are said.
CODES = ("job_held", "dependencies", "pool_held", "pool_drained", "quota", "max_leases",
         "backoff", "placement", "slot")
DEP_WORDS = {"ok": "ends done", "end": "ends", "fail": "fails or is cancelled"}


def _names(names: list[str]) -> str:
    shown = names[:limits.waiting_names_shown_max]
    more = len(names) - len(shown)
    return ", ".join(shown) + (f" and {more} more" if more > 0 else "")


def reasons(table: JobTable, job: Job, now_ms: int) -> list[tuple[str, str]]:
    """(code, words) of each reason `job`'s pending items wait, in CODES order; [] when it has
    none pending or has ended."""
    if job.finished_ms or not job.n_pending:
        return []
    out: list[tuple[str, str]] = []
    if job.hold:
        out.append(("job_held", f"job held: nothing of it starts until released "
                                f"(meshctl job tone {job.id} --release)"))
    if job.waiting_on:
        parents = [f"job {p} until it {DEP_WORDS.get(on, on)}" for p, on in job.waiting_on.items()]
        out.append(("dependencies", f"dependencies: {_names(parents)}"))
    ctl, pool = table.ctl, job.pool
    blocked = bool(out)
    for code, kept, verb, undo in (("pool_held", ctl.held, "held", "release"),
                                   ("pool_drained", ctl.drained_pools, "drained", "undrain")):
        if (pool, ALL) in kept:
            out.append((code, f"pool {pool!r} {verb} fleet-wide (meshctl pool {undo} {pool})"))
            blocked = True
        else:
            where = sorted(m for p, m in kept if p == pool and m != ALL)
            if where:
                out.append((code, f"pool {pool!r} {verb} on member(s) {_names(where)} "
                                  f"(meshctl pool {undo} {pool} --member M)"))
    limit = job.running_items_max
    if limit is not None:
        n = quotas.running_items(table, job.submitted_by)
        if n >= limit:
            out.append(("quota", f"quota: {job.submitted_by} has {n} item(s) running, its "
                                 f"running_items_max of {limit} (items start as those end)"))
            blocked = True
    if job.max_leases is not None and job.n_leased >= job.max_leases:
        out.append(("max_leases", f"max_leases: {job.n_leased} of its items leased, the most it "
                                  f"allows at once (meshctl job tone {job.id} --max-leases N)"))
        blocked = True
    waits = [t for i, t in job.not_before.items() if t > now_ms]
    if waits:
        out.append(("backoff", f"backoff: {len(waits)} item(s) wait to be tried again after a "
                               f"failure, the next in {(min(waits) - now_ms) / 1000:.1f} s"))
        blocked = blocked or len(waits) == job.n_pending
    if not blocked:
        ahead = items_ahead(table, job)
        out.append(("slot", f"a free slot in pool {pool!r}"
                            + (f" ({ahead} item(s) ahead of it)" if ahead else
                               " (no item ahead of it: it starts at the leader's next round)")))
    return out


def items_ahead(table: JobTable, job: Job) -> int:
    """Items waiting for a lease in `job`'s pool that the leader leases before its own: of
    ready jobs of higher priority, or of the same priority submitted earlier."""
    key = (-job.priority, job.seq)
    return sum(j.n_pending for j in table.ready.values()
               if j.pool == job.pool and j is not job and (-j.priority, j.seq) < key)


def fields(table: JobTable, job: Job, now_ms: int) -> dict[str, Any]:
    """The record fields of `job`'s reasons: `waiting_for` and `waiting_reasons` (none when it
    waits for nothing)."""
    why = reasons(table, job, now_ms)
    if not why:
        return {}
    return {"waiting_for": "; ".join(w for _c, w in why),
            "waiting_reasons": [{"reason": c, "says": w} for c, w in why]}


def merge(record: dict, placed: str | None) -> dict:
    """`record` with the placement reason (from the leader's view of the fleet; None: none)
    in place of a free slot's."""
    if placed is None:
        return record
    kept = [r for r in record.get("waiting_reasons") or []
            if isinstance(r, dict) and r.get("reason") != "slot"]
    kept.append({"reason": "placement", "says": placed})
    kept.sort(key=lambda r: CODES.index(r["reason"]) if r.get("reason") in CODES else len(CODES))
    return {**record, "waiting_for": "; ".join(str(r.get("says")) for r in kept),
            "waiting_reasons": kept}
