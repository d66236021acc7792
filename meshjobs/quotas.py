"""What each identity holds in the job table: the counters per-identity quotas are judged by.

Theory of operation. Every job names its submitter (`Job.submitted_by`, meshjobs/identity.py).
The table keeps, per submitter, how many of its jobs' items are not finished yet (pending or
leased: `pending`, what `pending_items_max` bounds) and how many are leased now (`leased`, what
`running_items_max` bounds). The appliers keep the counters as items move (`moved`), as jobs
are submitted (`submitted`) and dropped (`dropped`), so that a leader judging a submit or a
lease against a quota reads one dict entry, never a scan of the jobs. The counters are derived:
not part of a snapshot, rebuilt on load (`rebuild`), and `check` recounts them.

Rule 1: pure, as the table: no IO, clock or randomness.
Rule 2: an identity holding nothing has no entry (the dict stays as small as the active
        submitters).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from meshjobs.table import Job, JobTable

PENDING_AT = 0  # index of the not-finished count (pending + leased) in a holds row
LEASED_AT = 1  # index of the leased count


def _add(tbl: JobTable, who: str, pending: int, leased: int) -> None:
    row = tbl.holds.get(who)
    if row is None:
        row = tbl.holds[who] = [0, 0]
    row[PENDING_AT] += pending
    row[LEASED_AT] += leased
    if row[PENDING_AT] < 0 or row[LEASED_AT] < 0:
        raise AssertionError(f"identity {who} holds {row}: a count went below zero")
    if row == [0, 0]:
        del tbl.holds[who]


def submitted(tbl: JobTable, job: Job) -> None:
    """A new job: its items are all pending."""
    if job.n_pending or job.n_leased:
        _add(tbl, job.submitted_by, job.n_pending + job.n_leased, job.n_leased)


def moved(tbl: JobTable, job: Job, was_open: bool, is_open: bool, was_leased: bool,
          is_leased: bool) -> None:
    """One item of `job` moved: open means pending or leased (not finished)."""
    dp = int(is_open) - int(was_open)
    dl = int(is_leased) - int(was_leased)
    if dp or dl:
        _add(tbl, job.submitted_by, dp, dl)


def dropped(tbl: JobTable, job: Job) -> None:
    """A job forgotten or expired: what it still held (normally nothing) is let go."""
    if job.n_pending or job.n_leased:
        _add(tbl, job.submitted_by, -(job.n_pending + job.n_leased), -job.n_leased)


def rebuild(tbl: JobTable) -> None:
    tbl.holds = {}
    for job in tbl.jobs.values():
        submitted(tbl, job)


def pending_items(tbl: JobTable, who: str) -> int:
    """Items of `who`'s jobs not finished yet (pending or leased)."""
    row = tbl.holds.get(who)
    return row[PENDING_AT] if row else 0


def running_items(tbl: JobTable, who: str) -> int:
    """Items of `who`'s jobs leased now."""
    row = tbl.holds.get(who)
    return row[LEASED_AT] if row else 0


def check(tbl: JobTable) -> None:
    want: dict[str, list[int]] = {}
    for job in tbl.jobs.values():
        if job.n_pending or job.n_leased:
            row = want.setdefault(job.submitted_by, [0, 0])
            row[PENDING_AT] += job.n_pending + job.n_leased
            row[LEASED_AT] += job.n_leased
    assert tbl.holds == want, "per-identity holds and jobs disagree"
