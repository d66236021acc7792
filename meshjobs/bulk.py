"""Many jobs at once: which jobs a bulk request names, and what it answers for each.

Theory of operation. A bulk request (`control.parse_bulk`) names jobs by a list of ids or by a
filter. A change (cancel, forget, tone) is resolved by the leader against its committed table
and committed as one `bulk` entry naming the ids it resolved to (`JobTable._apply_bulk`), so
that every member applies the same jobs' changes, all or none, and a retry under the same
request id answers what the first one did. A status, and a change's dry run, are reads: the
member asked answers from its own committed table.

Rule 1: pure. No IO, clock or randomness.
Rule 2: bounded. One request touches at most `limits.bulk_jobs_max` jobs: more ids are refused
        (400) by the parser; a filter that matches more answers the oldest ones and a cursor
        (`next`) for the rest, which the client passes back as `after`.
Rule 3: one answer per job, in the order the request named them (a filter: submit order), each
        one of ANSWERS.
"""

from __future__ import annotations

from typing import Any

from meshjobs import identity, limits
from meshjobs.table import Job, JobTable

# What a bulk change answers for one job. A dry run says "would_change" for "changed".
# "not_owner": a job named by id that the caller may not change (403, meshjobs/identity.py).
ANSWERS = ("changed", "would_change", "already_final", "no_such_job", "refused", "found",
           "not_owner")


def matches(job: Job, flt: dict) -> bool:
    """Whether a job passes every key of a bulk filter."""
    if "tag" in flt and flt["tag"] not in job.tags:
        return False
    if "state" in flt and job.state != flt["state"]:
        return False
    if "pool" in flt and job.pool != flt["pool"]:
        return False
    return "member" not in flt or flt["member"] in job.member


def resolve(table: JobTable, req: dict) -> tuple[list[str], str | None]:
    """The job ids a bulk request names, and the cursor of the next page (None: no more).
    A list of ids is taken as given (the table answers for unknown ones); a filter takes the
    matching jobs oldest first, after the cursor, at most `bulk_jobs_max` of them."""
    ids, nxt, _ = resolve_owned(table, req)
    return ids, nxt


def resolve_owned(table: JobTable, req: dict) -> tuple[list[str], str | None, int]:
    """As `resolve`, and a change's filter takes only the jobs its caller may change
    (meshjobs/identity.py Rule 1; a status takes all): the third value is how many matching
    jobs of others it left alone."""
    if "ids" in req:
        return list(req["ids"]), None, 0
    flt, after = req["filter"], req.get("after")
    by, role = req.get("by"), req.get("by_role")
    owned_only = req.get("action") != "status" and by is not None
    picked: list[Job] = []
    skipped = 0
    for job in sorted(table.jobs.values(), key=lambda j: j.seq):
        if (after is not None and job.seq <= after) or not matches(job, flt):
            continue
        if owned_only and not identity.may_change(by, role, job.submitted_by):
            skipped += 1
            continue
        if len(picked) == limits.bulk_jobs_max:
            return [j.id for j in picked], str(picked[-1].seq), skipped
        picked.append(job)
    return [j.id for j in picked], None, skipped


def predict(table: JobTable, action: str, job_id: str, fields: dict,
            by: tuple[str, str] | None = None) -> list[Any]:
    """What a change would answer for one job now: [id, answer, why] (a dry run's row), for
    the caller `by` (name, role; None: anyone)."""
    job = table.jobs.get(job_id)
    if job is None:
        return [job_id, "no_such_job", None]
    if by is not None and not identity.may_change(by[0], by[1], job.submitted_by):
        return [job_id, "not_owner", identity.not_owner(f"job {job_id}", job.submitted_by,
                                                        by[0])["error"]]
    if action in ("cancel", "tone") and job.finished:
        return [job_id, "already_final", None]
    if action == "forget" and not job.finished:
        return [job_id, "refused", f"job {job_id} is {job.state}: cancel it first "
                                   f"(meshctl job cancel {job_id})"]
    return [job_id, "would_change", None]


def answer(table: JobTable, action: str, rows: list, dry_run: bool, nxt: str | None,
           skipped: int = 0) -> dict:
    """The body of a bulk answer: one result per job (with its state now, when it still
    exists), a count of each answer, the cursor of the next page, and how many jobs the
    filter matched that the caller may not change (`skipped_not_owner`, left alone)."""
    results = []
    counts: dict[str, int] = {}
    for job_id, what, why in rows:
        counts[what] = counts.get(what, 0) + 1
        res: dict[str, Any] = {"id": job_id, "answer": what}
        job = table.jobs.get(job_id)
        if job is not None:
            res["state"] = job.state
        if why:
            res["error"] = why
        if what == "not_owner":
            res["status"] = 403
        results.append(res)
    return {"action": action, "dry_run": dry_run, "matched": len(rows), "counts": counts,
            "results": results, "next": nxt, "skipped_not_owner": skipped}


def status(table: JobTable, req: dict) -> dict:
    """A bulk status: each named job's record ("found"), or "no_such_job"."""
    ids, nxt = resolve(table, req)
    results = []
    counts: dict[str, int] = {}
    for job_id in ids:
        job = table.jobs.get(job_id)
        what = "no_such_job" if job is None else "found"
        counts[what] = counts.get(what, 0) + 1
        res: dict[str, Any] = {"id": job_id, "answer": what}
        if job is not None:
            res["job"] = table.record(job)
        results.append(res)
    return {"action": "status", "dry_run": False, "matched": len(ids), "counts": counts,
            "results": results, "next": nxt}


def dry_run(table: JobTable, req: dict) -> dict:
    """A bulk change's dry run: what each named job would answer, changing nothing."""
    ids, nxt, skipped = resolve_owned(table, req)
    by = (req["by"], req["by_role"]) if req.get("by") is not None else None
    rows = [predict(table, req["action"], i, req.get("set") or {}, by) for i in ids]
    return answer(table, req["action"], rows, True, nxt, skipped)


def entry(req: dict, ids: list[str], nxt: str | None, now_ms: int, skipped: int = 0) -> dict:
    """The committed entry of a bulk change (rid and fp bind it to the client's request)."""
    e: dict[str, Any] = {"k": "bulk", "rid": req["rid"], "t": now_ms, "op": req["action"],
                         "ids": ids}
    if req.get("fp") is not None:
        e["fp"] = req["fp"]
    if req.get("set"):
        e["set"] = dict(req["set"])
    if nxt is not None:
        e["nx"] = nxt
    if req.get("by") is not None:
        e.update(by=req["by"], br=req["by_role"])
    if skipped:
        e["so"] = skipped
    return e
