"""Re-running finished jobs: the `rerun` entry of the job table, and automatic re-runs.

Theory of operation. A finished job runs again under the same id when a committed `rerun` entry
says so. A client asks for one (`meshctl job rerun ID [--failed-only]`, POST /jobs/{id}/rerun):
its items (all of them, or with `failed_only` those that ended failed, timeout or cancelled)
go back to pending with their attempt counts kept, so that the next lease of each is a new
attempt number; the job is queued again. The job's spec may also ask for automatic re-runs:
`restart` (N or "forever": again each time it ends done) and `resubmit` (N: again, whole, when
it ends done or failed, the seed's "resubmit to the submit node": placed afresh on the fleet),
each after `restart_delay_s`. When a job with one ends, the apply of the entry that ended it
records when the re-run is due (`due_ms`, from the entry's time) and why; the leader proposes
the `rerun` entry once that time has come on its clock. The entry names the run it ends (`run`),
so a second proposal of it (a retry, or a new leader after a failover) is refused as stale:
a failover neither skips a due re-run (the due time is in the table) nor doubles it.

Rule 1: pure, as the table: no IO, clock or randomness; time is the entry's `t`.
Rule 2: what ran before is kept: the job's record keeps a summary of each earlier run (the last
        `limits.job_runs_kept_max`), and the table's history hook gets the whole record of the
        run that ends (why "rerun", "restart" or "resubmit"), as for a forgotten job.
Rule 3: only a finished job reruns: done, failed or cancelled. A dep_failed job never ran and
        its parents can never satisfy it: it is refused (submit a new job instead). Dependents
        already settled by the job's earlier end stay settled; jobs that wait on it now are
        settled when this run ends.
Rule 4: a cancel stops restarting: a cancelled job is never re-run automatically, and a cancel
        of a finished job whose re-run is due drops that re-run (the job keeps its state).
        A rerun by hand starts the policy again (the counts of re-runs used are kept, so
        `restart` N never runs more than N automatic restarts in the job's life).
Rule 6: re-runs are bounded in time: each automatic re-run waits at least
        `limits.restart_delay_s_min` after the end (a spec committed before that minimum
        existed, with a shorter `restart_delay_s`, waits the minimum), and a job has at most
        `limits.restarts_per_minute_max` automatic re-runs (restart and resubmit together) in
        any `limits.restarts_window_ms`: the times of its last ones are kept in the table
        (`rerun_times`, part of a snapshot), and past the cap the next one is due when the
        oldest of them leaves the window. The record says so (`rerun_wait`). Both rules are
        judged by the apply, from entry times, so every member and any leader agree.
Rule 5: a job that waited for parents and was cancelled before its items ever ran is judged
        again at a rerun, as at a submit: it waits again for the parents not ended, and a parent
        that ended the wrong way (or was forgotten) refuses the rerun. A job whose items ran
        had its parents' consent once; that stands.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from meshjobs import limits

if TYPE_CHECKING:
    from meshjobs.table import Job, JobTable

AUTO = ("restart", "resubmit")
RERUN_FROM = ("done", "failed", "cancelled")  # the job states a rerun by hand starts from


def restarts_left(job: Job) -> bool:
    return job.restart == "forever" or (job.restart is not None and job.restarts < job.restart)


def resubmits_left(job: Job) -> bool:
    return job.resubmit is not None and job.resubmits < job.resubmit


def schedule(tbl: JobTable, job: Job) -> None:
    """`job` has just ended (not by a cancel): when its spec asks for it, record the automatic
    re-run that is now due, and when."""
    if job.cancelled or job.dep_failed:
        return
    state = job.state
    why = None
    if state == "done" and restarts_left(job):
        why = "restart"
    elif state in ("done", "failed") and resubmits_left(job):
        why = "resubmit"
    if why is None:
        return
    job.due_ms, job.due_capped = due_after_end(job)
    job.due_why = why
    tbl.due[job.id] = job.due_ms


def delay_ms(job: Job) -> int:
    """The wait before an automatic re-run of `job` (Rule 6: never under the minimum)."""
    return round(max(job.restart_delay_s or 0.0, limits.restart_delay_s_min) * 1000)


def due_after_end(job: Job) -> tuple[int, bool]:
    """When the automatic re-run of a job that has just ended is due, and whether the cap of
    re-runs per minute (Rule 6) put it later than its delay did."""
    due = job.finished_ms + delay_ms(job)
    times = job.rerun_times or ()
    cap = limits.restarts_per_minute_max
    if len(times) >= cap:
        allowed = times[-cap] + limits.restarts_window_ms
        if allowed > due:
            return allowed, True
    return due, False


def unschedule(tbl: JobTable, job: Job) -> None:
    job.due_ms = 0
    job.due_why = None
    job.due_capped = False
    tbl.due.pop(job.id, None)


def summary(job: Job) -> dict:
    """An earlier run of a job as its record keeps it."""
    return {"run": job.run, "state": job.state, "finished_at": job.finished_ms / 1000.0,
            "items_done": job.n_done, "items_failed": job.n_failed,
            "items_cancelled": job.n_cancelled}


def apply_rerun(tbl: JobTable, e: dict, index: int, t: int) -> dict:
    """The `rerun` entry: {"id", "failed_only"} from a client, or {"id", "auto", "run"} from the
    leader when an automatic re-run is due."""
    from meshjobs.table import CANCELLED, FAILED, ITEM_STATE_NAMES, PENDING, TIMEOUT, Refused

    job = tbl._job(e.get("id"))
    tbl._owned(e, job.submitted_by, f"job {job.id}")
    auto = e.get("auto")
    failed_only = e.get("failed_only", False)
    if not isinstance(failed_only, bool):
        raise Refused(400, "malformed rerun", "malformed")
    if auto is not None:
        run = e.get("run")
        if auto not in AUTO or type(run) is not int or failed_only:
            raise Refused(400, "malformed rerun", "malformed")
        if not job.due_ms or job.due_why != auto or run != job.run or job.due_ms > t:
            # Proposed twice (a retry, a failover), or no longer due (cancelled, rerun by hand).
            raise Refused(409, f"job {job.id}: this {auto} of run {run} is not due (any more)",
                          "stale_rerun")
    else:
        if not job.finished:
            raise Refused(409, f"job {job.id} is {job.state}: only a finished job (done, failed "
                               f"or cancelled) runs again; wait for it to end (meshctl job wait "
                               f"{job.id}) or cancel it first (meshctl job cancel {job.id})",
                          "not_finished")
        if job.dep_failed:
            raise Refused(409, f"job {job.id} ended dep_failed: its parents can never satisfy "
                               "it, so it does not run again; submit a new job (without the "
                               "failed parents in --after)", "dep_failed")
    waits = _judge_after(tbl, job)
    again = [i for i in range(job.n)
             if not failed_only or job.st[i] in (FAILED, TIMEOUT, CANCELLED)]
    if not again:
        raise Refused(409, f"job {job.id} has no failed, timed-out or cancelled items: nothing "
                           "to run again with --failed-only; rerun it whole (without "
                           "--failed-only)", "nothing_to_rerun")
    why = auto or "rerun"
    if tbl.on_forget is not None:
        tbl.on_forget(tbl.final_record(job), why, t, tbl.applied_index)
    past = job.past if job.past is not None else []
    past.append({**summary(job), "then": why})
    del past[:-limits.job_runs_kept_max]
    job.past = past
    for i in again:
        # Its last attempt ended as the run did: said, so every attempt before the next has
        # its reason (a cancelled item that never ran has none).
        tbl.note_attempt(job, i, f"ended {ITEM_STATE_NAMES[job.st[i]]} in run {job.run}; the "
                                 f"job ran again ({why})", t)
        tbl._move("rerun", job, i, PENDING)
        job.queue.append(i)
        job.fails[i] = 0
        job.rc[i] = _rc_none()
        job.sig[i] = 0
        job.out[i] = job.err[i] = None
        job.member[i] = None
        job.started_ms[i] = job.ended_ms[i] = 0
        if job.held is not None:
            job.held[i] = None
        if job.errors is not None:
            job.errors.pop(i, None)
    if job.errors is not None and not job.errors:
        job.errors = None
    if job.held is not None and not any(job.held):
        job.held = None
    if auto == "restart":
        job.restarts += 1
    elif auto == "resubmit":
        job.resubmits += 1
    if auto is not None:
        times = job.rerun_times if job.rerun_times is not None else []
        times.append(t)
        del times[:-limits.restarts_per_minute_max]
        job.rerun_times = times
    unschedule(tbl, job)
    job.run += 1
    job.cancelled = False
    job.started = False
    job.finished_ms = 0
    job.finished_clock_ms = 0
    del tbl.finished[job.id]
    if waits:
        job.waiting_on = waits
        for parent_id in waits:
            tbl.dependents.setdefault(parent_id, {})[job.id] = None
    job.version = index
    tbl._ready(job)
    tbl._count("jobs_rerun_" + why)
    tbl._count("items_rerun", len(again))
    return {"ok": True, "id": job.id, "run": job.run, "items": len(again)}


def _judge_after(tbl: JobTable, job: Job) -> dict[str, str] | None:
    """A job with parents whose items never ran (it was cancelled while it waited) is judged
    again as at a submit (Rule 5): it waits again on each parent not ended; a parent that ended
    the wrong way, or is gone, refuses the rerun. A job whose items ran was allowed by its
    parents once: that stands."""
    from meshjobs.table import Refused

    if not job.after or any(job.attempts):
        return None
    waits: dict[str, str] = {}
    for dep in job.after:
        parent_id, on = dep["id"], dep["on"]
        parent = tbl.jobs.get(parent_id)
        if parent is None:
            raise Refused(409, f"job {job.id} never ran, and its parent {parent_id} is gone "
                               "(forgotten), so its condition cannot be judged any more; submit "
                               "a new job without it in --after", "bad_after")
        if not parent.finished:
            waits[parent_id] = on
        elif not tbl._holds(parent.state, on):
            raise Refused(409, f"job {job.id} never ran, and its parent {parent_id} ended "
                               f"{parent.state}, which can never satisfy {on}; submit a new job "
                               "without it in --after", "dep_failed")
    return waits or None


def _rc_none() -> int:
    from meshjobs.table import RC_NONE

    return RC_NONE


def record_fields(job: Job) -> dict:
    """What a job's record says of its runs (only for jobs that can or did run again)."""
    if job.run == 1 and job.restart is None and job.resubmit is None:
        return {}
    return {
        "run": job.run,
        "restarts": job.restarts,
        "resubmits": job.resubmits,
        "rerun_due_at": job.due_ms / 1000.0 if job.due_ms else None,
        "rerun_due_why": job.due_why,
        # Why the due re-run waits longer than its delay: the job used its automatic re-runs
        # of the minute (Rule 6); None otherwise.
        "rerun_wait": "restarts_per_minute_max" if job.due_ms and job.due_capped else None,
        "previous_runs": [dict(p) for p in job.past or ()],
    }


def to_state(tbl: JobTable) -> dict:
    """The re-run state of a snapshot: only jobs that have some, so that a table without re-runs
    snapshots as it did."""
    rows = []
    for j in tbl.jobs.values():
        if j.run != 1 or j.due_ms or j.restarts or j.resubmits:
            row = [j.id, j.run, j.restarts, j.resubmits, j.due_ms, j.due_why, j.past]
            if j.rerun_times:
                # Rule 6's times, only for jobs that re-ran automatically (a row of seven
                # fields, as before them, loads with none).
                row.extend([list(j.rerun_times), j.due_capped])
            rows.append(row)
    return {"reruns": rows} if rows else {}


def from_state(tbl: JobTable, s: dict) -> None:
    for row in s.get("reruns", ()):
        jid, run, restarts, resubmits, due_ms, due_why, past = row[:7]
        j = tbl.jobs[jid]
        j.run, j.restarts, j.resubmits = run, restarts, resubmits
        j.due_ms, j.due_why = due_ms, due_why
        j.past = None if past is None else [dict(p) for p in past]
        if len(row) > 7:
            j.rerun_times = [int(x) for x in row[7]]
            j.due_capped = bool(row[8]) and bool(due_ms)
        if due_ms:
            tbl.due[jid] = due_ms


def check(tbl: JobTable) -> None:
    """The re-run invariants: a due re-run only for a finished job not cancelled, that has one
    left; never more automatic re-runs than asked; the due index agrees with the jobs."""
    for jid, j in tbl.jobs.items():
        assert j.run >= 1 + j.restarts + j.resubmits, f"{jid}: fewer runs than re-runs"
        if j.restart != "forever":
            assert j.restarts <= (j.restart or 0), f"{jid}: restarted {j.restarts} times"
        assert j.resubmits <= (j.resubmit or 0), f"{jid}: resubmitted {j.resubmits} times"
        if j.due_ms:
            assert j.finished_ms and not j.cancelled and not j.dep_failed, \
                f"{jid}: a re-run due for a job that has not ended so"
            assert j.due_why in AUTO, f"{jid}: a re-run due for no reason"
            assert (restarts_left(j) if j.due_why == "restart" else resubmits_left(j)), \
                f"{jid}: a {j.due_why} due with none left"
        else:
            assert j.due_why is None, f"{jid}: a reason for a re-run not due"
        assert j.past is None or 0 < len(j.past) <= limits.job_runs_kept_max, f"{jid}: past runs"
        times = j.rerun_times or []
        assert len(times) <= min(limits.restarts_per_minute_max, j.restarts + j.resubmits), \
            f"{jid}: more re-run times than re-runs"
        assert times == sorted(times), f"{jid}: re-run times out of order"
        if j.due_ms:
            # (Not checked against the delay: a snapshot made before the minimum existed may
            # hold a re-run due sooner, and must still load.)
            cap = limits.restarts_per_minute_max
            assert len(times) < cap or j.due_ms >= times[-cap] + limits.restarts_window_ms, \
                f"{jid}: a re-run due past {cap} in a minute"
        else:
            assert not j.due_capped, f"{jid}: a cap on a re-run not due"
    assert tbl.due == {jid: j.due_ms for jid, j in tbl.jobs.items() if j.due_ms}, \
        "due index and jobs disagree"


def due_now(tbl: JobTable, now_ms: int) -> list[dict]:
    """The `rerun` entries the leader proposes now: each due re-run whose time has come (the
    caller keeps them from being proposed again before they can commit)."""
    out: list[dict[str, Any]] = []
    for jid, due in tbl.due.items():
        if due <= now_ms:
            j = tbl.jobs[jid]
            out.append({"k": "rerun", "t": now_ms, "id": jid, "auto": j.due_why, "run": j.run})
    return out


def next_due_ms(tbl: JobTable, now_ms: int) -> int | None:
    """The earliest due re-run still to come, for the leader's wake-up."""
    later = [d for d in tbl.due.values() if d > now_ms]
    return min(later) if later else None
