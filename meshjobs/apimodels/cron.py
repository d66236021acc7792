"""Schedules (/cron)."""

from __future__ import annotations

from typing import Annotated, Any, Literal, NotRequired

from pydantic import Field, with_config

# pydantic needs typing_extensions' TypedDict before Python 3.12 (and TypeAliasType for named
# aliases before 3.12's `type` statement).
from typing_extensions import TypedDict

from meshjobs import limits
from meshjobs.apimodels.jobs import CLOSED, SubmitSpec

# --- schedules (/cron) --------------------------------------------------------------------------

CatchUp = Literal["latest", "none"]
Overlap = Literal["allow", "skip"]


@with_config(CLOSED)
class CronPut(TypedDict):
    spec: Annotated[str, Field(min_length=1, max_length=limits.cron_spec_chars_max, description=(
        "Five cron fields (minute hour day-of-month month day-of-week, UTC; *, lists, ranges, "
        "steps, names like mon or jan; when both day fields are restricted either matches), "
        "`@every 30s` (s, m, h, d: due at the multiples since the epoch), or @hourly, @daily, "
        "@weekly, @monthly, @yearly."))]
    job: Annotated[SubmitSpec, Field(description="The job spec of each run: as POST /jobs "
                                                 "takes, without id, items, names or after.")]
    catch_up: NotRequired[Annotated[CatchUp, Field(json_schema_extra={"default": "latest"})]]
    overlap: NotRequired[Annotated[Overlap, Field(json_schema_extra={"default": "allow"})]]
    replace: NotRequired[Annotated[bool, Field(json_schema_extra={"default": True}, description=(
        "false: a different schedule of this name is a 409, not replaced."))]]


@with_config(CLOSED)
class Cron(TypedDict):
    name: str
    spec: str
    job: Annotated[dict[str, Any], Field(description="The job spec of each run.")]
    catch_up: CatchUp
    overlap: Overlap
    paused: bool
    created_at: float
    next_due: Annotated[float | None, Field(description="The next due time (seconds since the "
                                                        "epoch); null when paused.")]
    last_due: float | None
    last_job: Annotated[str | None, Field(description="The id of the last run fired.")]
    fired: int
    skipped: Annotated[int, Field(description="Runs passed over (overlap skip).")]
    version: int
    owner: NotRequired[Annotated[str, Field(description=(
        "Who made it (the submitter of its runs): only it and admins may change it."))]]


@with_config(CLOSED)
class CronList(TypedDict):
    crons: Annotated[list[Cron], Field(description="Every schedule, oldest first.")]


@with_config(CLOSED)
class CronRemoved(TypedDict):
    name: str
    removed: Literal[True]
