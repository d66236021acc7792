"""Many jobs at once (POST /jobs/cancel, forget, tone, status) and the history."""

from __future__ import annotations

from typing import Annotated, Literal, NotRequired

from pydantic import ConfigDict, Field, with_config

# pydantic needs typing_extensions' TypedDict before Python 3.12 (and TypeAliasType for named
# aliases before 3.12's `type` statement).
from typing_extensions import TypedDict

from meshjobs import limits
from meshjobs.apimodels.jobs import CLOSED, JOB_ID_PATTERN, POOL_PATTERN, Job

# --- many jobs at once (POST /jobs/cancel, /jobs/forget, /jobs/tone, /jobs/status) ------------

@with_config(ConfigDict(extra="forbid", json_schema_extra={"minProperties": 1}))
class Filter(TypedDict, total=False):
    """Jobs that match every key given."""

    tag: Annotated[str, Field(min_length=1, max_length=limits.tag_chars_max)]
    state: Literal["queued", "held", "running", "done", "failed", "cancelled"]
    pool: Annotated[str, Field(pattern=POOL_PATTERN)]
    member: Annotated[str, Field(pattern=POOL_PATTERN, description=(
        "Jobs with an item that ran or runs on this member."))]


_IDS = Annotated[list[Annotated[str, Field(pattern=JOB_ID_PATTERN)]],
                 Field(min_length=1, max_length=limits.bulk_jobs_max)]
# Either ids or a filter, never both, and a next-page cursor only with a filter.
_IDS_OR_FILTER = ConfigDict(extra="forbid", json_schema_extra={"oneOf": [
    {"required": ["ids"], "not": {"anyOf": [{"required": ["filter"]}, {"required": ["after"]}]}},
    {"required": ["filter"], "not": {"required": ["ids"]}}]})
_AFTER = Annotated[str, Field(description="The `next` cursor of the answer before: the "
                                          "filter's next page.")]
_DRY_RUN = Annotated[bool, Field(description="Answer what would change; change nothing.")]


@with_config(_IDS_OR_FILTER)
class BulkStatus(TypedDict, total=False):
    """Either ids or filter, not both."""

    ids: _IDS
    filter: Filter
    after: _AFTER


@with_config(_IDS_OR_FILTER)
class BulkChange(TypedDict, total=False):
    """Either ids or filter, not both (cancel, forget)."""

    ids: _IDS
    filter: Filter
    after: _AFTER
    dry_run: _DRY_RUN


@with_config(CLOSED)
class ToneSet(TypedDict, total=False):
    priority: Annotated[int, Field(ge=-limits.priority_abs_max, le=limits.priority_abs_max)]
    hold: bool
    max_leases: Annotated[int | None, Field(ge=1, le=limits.max_leases_max)]


@with_config(_IDS_OR_FILTER)
class BulkTone(TypedDict, total=False):
    """Either ids or filter, not both."""

    ids: _IDS
    filter: Filter
    after: _AFTER
    dry_run: _DRY_RUN
    set: ToneSet


@with_config(CLOSED)
class BulkResult(TypedDict):
    id: str
    answer: Literal["changed", "would_change", "already_final", "no_such_job", "refused",
                    "found", "not_owner"]
    status: NotRequired[Annotated[int, Field(description="403 for a job of another owner.")]]
    state: NotRequired[Annotated[str, Field(description="The job's state now, if it exists.")]]
    error: NotRequired[Annotated[str, Field(description="Why it was refused.")]]
    job: NotRequired[Job]


@with_config(CLOSED)
class BulkAnswer(TypedDict):
    """One result per job."""

    action: Literal["cancel", "forget", "tone", "status"]
    dry_run: bool
    matched: int
    counts: dict[str, int]
    next: Annotated[str | None, Field(description="The cursor of the filter's next page (pass "
                                                  "it as `after`).")]
    results: list[BulkResult]
    skipped_not_owner: NotRequired[Annotated[int, Field(description=(
        "Jobs the filter matched that the caller may not change (another owner's): left "
        "alone."))]]


# --- history (GET /history) ---------------------------------------------------------------------

@with_config(CLOSED)
class ItemsSummary(TypedDict):
    states: Annotated[dict[str, int], Field(description="How many items ended in each state.")]
    members: Annotated[list[str], Field(description="The members that ran them.")]


@with_config(CLOSED)
class FinalJob(Job):
    """A job's final record, as the history keeps it: the record and a summary of its items."""

    items_summary: ItemsSummary


@with_config(CLOSED)
class HistoryRecord(TypedDict):
    at: Annotated[float, Field(description="When the job was dropped (seconds).")]
    why: Annotated[Literal["forget", "expire", "rerun", "restart", "resubmit"], Field(
        description="forget or expire: the job was dropped; rerun, restart or resubmit: the "
                    "record is of its earlier run, which ended (the job runs again).")]
    index: Annotated[int, Field(description="The log index of the entry.")]
    member: str
    job: FinalJob


@with_config(CLOSED)
class History(TypedDict):
    order: Literal["newest_first"]
    member: str
    records: list[HistoryRecord]
    skipped_lines: Annotated[int, Field(description="Damaged lines skipped (a torn last line "
                                                    "after a crash).")]
    more: bool
    dropped: Annotated[int, Field(description="Records this member dropped since it started "
                                              "(writer queue full).")]
