"""Jobs: a job spec (POST /jobs), a job record and its items, errors, payloads."""

from __future__ import annotations

from typing import Annotated, Any, Literal, NotRequired, Required

from pydantic import ConfigDict, Field, with_config

# pydantic needs typing_extensions' TypedDict before Python 3.12 (and TypeAliasType for named
# aliases before 3.12's `type` statement).
from typing_extensions import TypeAliasType, TypedDict

from meshjobs import limits
from meshjobs.control import ITEM_STATES, JOB_STATES, RESERVED_JOB_IDS

CLOSED = ConfigDict(extra="forbid")  # an answer or body with no keys but its own

# What the server's parsers take (meshjobs/control.py, placement.py), as the document's
# patterns: a client generating requests from the document gets no 400 for a value it allows.
JOB_ID_PATTERN = rf"^[A-Za-z0-9._-]{{1,{limits.job_id_chars_max}}}$"
POOL_PATTERN = rf"^[A-Za-z0-9._-]{{1,{limits.pool_chars_max}}}$"
SELECTOR_PATTERN = (rf"^[A-Za-z0-9._\-*?\[\]!]{{1,{limits.member_selector_chars_max}}}$")
POOL_AT_PATTERN = (rf"^[A-Za-z0-9._-]{{1,{limits.pool_chars_max}}}"
                   rf"(@[A-Za-z0-9._\-*?\[\]!]{{1,{limits.member_selector_chars_max}}})?$")
OPEN = ConfigDict(extra="allow")

JobState = Literal[JOB_STATES]  # type: ignore[valid-type]
ItemState = Literal[ITEM_STATES]  # type: ignore[valid-type]
DepCondition = Literal["ok", "end", "fail"]

Digest = TypeAliasType("Digest", Annotated[str, Field(
    pattern="^[0-9a-f]{64}$", description="A blob's blake3-256 digest, lowercase hex.")])


@with_config(CLOSED)
class PayloadB64(TypedDict):
    b64: Annotated[str, Field(json_schema_extra={"contentEncoding": "base64"})]


@with_config(CLOSED)
class PayloadBlob(TypedDict):
    blob: Digest


ItemPayload = TypeAliasType("ItemPayload", Annotated[str | PayloadB64 | PayloadBlob, Field(
    description="One item's stdin: text (sent as UTF-8), raw bytes in base64, or a stored "
                "blob.")])


@with_config(CLOSED)
class AfterObject(TypedDict):
    id: str
    on: NotRequired[Annotated[DepCondition, Field(json_schema_extra={"default": "ok"})]]


After = TypeAliasType("After", Annotated[
    Annotated[str, Field(pattern="^[A-Za-z0-9._-]{1,128}(:(ok|end|fail))?$")] | AfterObject,
    Field(description="One parent of a job and what it must do: ok (it ended done; the "
                      "default), end (it ended, any way), fail (it ended failed, timed out, "
                      "cancelled or dep_failed).")])


@with_config(OPEN)
class Error(TypedDict):
    """Every error answer."""

    error: Annotated[str, Field(description="What went wrong and what to do.")]


@with_config(CLOSED)
class Forgotten(TypedDict):
    """The answer of DELETE /jobs/{id}."""

    id: str
    forgotten: Literal[True]


# --- a job spec (POST /jobs) -------------------------------------------------------------------

def _nullable(t: Any, **kw: Any) -> Any:
    """An optional key of a request that may also be null (null: the default)."""
    default = kw.pop("default", None)
    extra = kw.pop("json_schema_extra", {}) | ({} if default is None else {"default": default})
    return NotRequired[Annotated[t | None, Field(json_schema_extra=extra or None, **kw)]]


@with_config(CLOSED)
class SubmitSpec(TypedDict, total=False):
    argv: Required[Annotated[list[str], Field(
        min_length=1, max_length=limits.argv_items_max,
        json_schema_extra={"prefixItems": [{"type": "string", "minLength": 1}]},
        description="The program (not empty) and its arguments.")]]
    id: _nullable(Annotated[str, Field(pattern=JOB_ID_PATTERN)],
                  json_schema_extra={"not": {"enum": list(RESERVED_JOB_IDS)}}, description=(
        "The job id; made up when absent. The words of the many-jobs routes (cancel, "
        "forget, tone, status) are not ids."))
    pool: _nullable(Annotated[str, Field(pattern=POOL_AT_PATTERN)], default="default",
                    description=(
        "The pool; \"POOL@MEMBER\" also names the member(s), as `member` does (both parts "
        "needed)."))
    priority: _nullable(Annotated[int, Field(ge=-limits.priority_abs_max,
                                             le=limits.priority_abs_max)], default=0)
    retries: _nullable(Annotated[int, Field(ge=0, le=limits.retries_max)], default=0)
    runtime_s: _nullable(Annotated[float, Field(gt=0, le=limits.runtime_s_max)])
    hold: _nullable(bool, default=False)
    tags: _nullable(Annotated[list[Annotated[str, Field(min_length=1,
                                                        max_length=limits.tag_chars_max)]],
                              Field(max_length=limits.tags_max)])
    env: _nullable(dict[str, str])
    cwd: _nullable(str, description=(
        "An absolute path: the items' working directory (null: the member's own folder). "
        "meshctl sends its own folder unless --cwd or --no-cwd. Missing on the member: the item "
        "fails."))
    user: _nullable(Annotated[str, Field(
        max_length=max(limits.user_chars_max, 2 * len(str(limits.uid_max)) + 1),
        pattern=r"^([A-Za-z0-9._][A-Za-z0-9._-]{0,31}|[0-9]+(:[0-9]+)?)$")], description=(
        "Run the items as this user: a name, or UID or UID:GID "
        f"(0 to {limits.uid_max}; an all-digit value is a uid). The member that runs an item "
        "resolves it; it must run as root (else the item fails, or a fleet of one answers 400). "
        "null: the pool's default user ([pools.X] user), or meshd's own."))
    inherit_env: _nullable(bool, default=False, description=(
        "Give items meshd's whole environment (its secrets too) rather than the minimal one."))
    max_leases: _nullable(Annotated[int, Field(ge=1, le=limits.max_leases_max)], description=(
        "At most this many items of the job run at once."))
    items: _nullable(Annotated[list[ItemPayload], Field(min_length=1,
                                                        max_length=limits.items_max)],
                     description="One entry per item; absent: one item with empty stdin.")
    names: _nullable(Annotated[list[Annotated[str, Field(
        min_length=1, max_length=limits.item_name_chars_max, pattern="^[^/]+$")]],
        Field(min_length=1, max_length=limits.items_max)], description=(
        "The input file name of each item (one per item, no '/', not . or ..): `job results "
        "--out` names files after them."))
    after: _nullable(Annotated[list[After], Field(max_length=limits.deps_max)], description=(
        "Jobs this one waits for (each named once; all must hold; they must exist, and the "
        "job's own id is refused). Until then the job is `waiting` and nothing of it runs; when "
        "a condition can no longer hold it ends `dep_failed`. A string is short for an object: "
        "\"ID\" or \"ID:COND\"."))
    member: _nullable(Annotated[str, Field(
        min_length=1, max_length=limits.member_selector_chars_max,
        pattern=r"^[A-Za-z0-9._\-*?\[\]!]+$")], description=(
        "Where the items run: a member name, a glob over member names (fnmatch: gpu-*, node-?, "
        "rack[12]-*), or * to run the job once on every member of the pool (fan-out: one item "
        "per member; at most one item may be given). The fan-out's members are those alive and "
        "offering the pool when the leader takes the submit, fixed then. Items wait while no "
        "such member is alive (`waiting_for` says so); they never go to another member."))
    notify: _nullable(Annotated[str, Field(max_length=limits.notify_url_chars_max)],
                      json_schema_extra={"format": "uri"}, description=(
        "A finish hook: when the job ends, the leader POSTs its final record (JSON) to this "
        "http:// or https:// URL, retried with backoff for up to "
        f"{limits.notify_retry_s_max} s, with an Idempotency-Key header (job id and version). "
        "At least once: after a failover the new leader may send it again."))
    restart: _nullable(Annotated[int, Field(ge=1, le=limits.restart_max)] | Literal["forever"],
                       description="Run the whole job again each time it ends done: N more "
                                   "times, or forever. A cancel stops it.")
    resubmit: _nullable(Annotated[int, Field(ge=1, le=limits.resubmit_max)], description=(
        "Run the whole job again when it ends done or failed (placed afresh on the fleet), up "
        "to N times. Per item: retries."))
    restart_delay_s: _nullable(Annotated[float, Field(ge=limits.restart_delay_s_min,
                                                      le=limits.restart_delay_s_max)],
                               description="Seconds between a run's end and its automatic "
                                           "re-run (needs restart or resubmit); at least "
                                           f"{limits.restart_delay_s_min} (a shorter one is "
                                           "refused, 400), and at most "
                                           f"{limits.restarts_per_minute_max} automatic "
                                           "re-runs of a job within a minute.")
    stdout: _nullable(Annotated[str, Field(max_length=limits.output_path_chars_max)],
                      description=(
        "Also write each item's stdout to this path on the member that runs it: absolute, or "
        "under the job's cwd; {index} is the item's index; no '..'. Written as the item's "
        "user. A failed write is the item's error; the output is kept all the same."))
    stderr: _nullable(Annotated[str, Field(max_length=limits.output_path_chars_max)],
                      description="As stdout, for stderr.")


@with_config(ConfigDict(extra="forbid", json_schema_extra={"minProperties": 1}))
class Tone(TypedDict, total=False):
    """POST /jobs/{id}/tone: the changes, at least one."""

    priority: Annotated[int, Field(ge=-limits.priority_abs_max, le=limits.priority_abs_max)]
    hold: bool
    max_leases: Annotated[int | None, Field(ge=1, le=limits.max_leases_max,
                                            description="null: no limit.")]


@with_config(CLOSED)
class Rerun(TypedDict, total=False):
    failed_only: Annotated[bool, Field(json_schema_extra={"default": False}, description=(
        "Only the items that failed, timed out or were cancelled."))]


# --- a job record (answers of GET /jobs, GET /jobs/{id}, submit, cancel, tone, rerun) ---------

@with_config(CLOSED)
class EarlierAttempt(TypedDict):
    attempt: Annotated[int, Field(ge=1, description="Which attempt (1: the first).")]
    member: Annotated[str | None, Field(description="The member it was leased to.")]
    why: Annotated[str, Field(max_length=limits.item_error_chars_max, description=(
        "Why it ended without the item's result, e.g. `lost with member v1 (dead 3.1 s)`, "
        "`exit 3; tried again (retry 1 of 2)`."))]
    at: Annotated[float, Field(description="When it was seen to end (seconds since the epoch).")]


@with_config(CLOSED)
class Item(TypedDict):
    index: int
    state: ItemState
    attempts: int
    member: str | None
    epoch: int | None
    rc: int | None
    signal: int | None
    stdin: Annotated[Digest | None, Field(description="The digest of the item's input.")]
    stdout: Digest | None
    stderr: Digest | None
    error: Annotated[str | None, Field(
        max_length=limits.item_error_chars_max,
        description="Why the item's last try failed, when the member could say (its program "
                    "could not start, its input was missing); null otherwise.")]
    copies: Annotated[list[str], Field(
        description="The members other than `member` that held a copy of the outputs when the "
                    "result was committed.")]
    earlier_attempts: Annotated[list[EarlierAttempt], Field(
        max_length=limits.item_attempts_kept_max,
        description="Why its earlier attempts ended, oldest first (the last "
                    f"{limits.item_attempts_kept_max}): a lease lost with its member, a failure "
                    "tried again, a run ended before the job ran again. The same on every "
                    "member.")]
    started_at: Annotated[float | None, Field(description="When its last try started "
                                                          "(seconds since the epoch).")]
    ended_at: Annotated[float | None, Field(description="When it ended (seconds).")]
    for_member: NotRequired[Annotated[str, Field(
        description="Only for a fan-out (member *): the member this item runs on, and only "
                    "there.")]]


@with_config(CLOSED)
class WaitingReason(TypedDict):
    reason: Literal["job_held", "dependencies", "pool_held", "pool_drained", "quota",
                    "max_leases", "backoff", "placement", "slot"]
    says: Annotated[str, Field(description="The reason in words, with what to do about it.")]


@with_config(CLOSED)
class Parent(TypedDict):
    id: str
    on: DepCondition


@with_config(CLOSED)
class Job(TypedDict):
    """A job record, as every member answers it from its committed table."""

    id: str
    state: JobState
    version: Annotated[int, Field(ge=0, description=(
        "Grows with every committed change of the job (its last change's log index, the same "
        "on every member): pass it as ?since= to wait for the next change."))]
    priority: int
    hold: bool
    tags: list[str]
    pool: str
    argv: list[str]
    env: dict[str, str]
    cwd: str | None
    user: Annotated[str | None, Field(
        description="The user the job asked for; null: the pool's default.")]
    inherit_env: bool
    submitted_by: NotRequired[Annotated[str, Field(description=(
        "Who submitted it: the token's name, `local` (a member without [auth]) or "
        "`anonymous`. Its owner: only it and admins may change it, or see its env values and "
        "notify URL (others see \"<redacted>\")."))]]
    retries: int
    runtime_s: float | None
    max_leases: int | None
    items_total: int
    items_done: int
    items_failed: int
    items_cancelled: int
    items_running: Annotated[int, Field(description="Items leased now.")]
    items_pending: Annotated[int, Field(description="Items waiting for a lease.")]
    items_tried_before: NotRequired[Annotated[int, Field(ge=0, description=(
        "Items whose earlier attempts are said (items[].earlier_attempts): leases lost, "
        "failures tried again."))]]
    submitted_at: Annotated[float, Field(description="Seconds since the epoch.")]
    finished_at: Annotated[float | None, Field(description="Seconds since the epoch; null "
                                                           "while it runs.")]
    items: NotRequired[Annotated[list[Item], Field(description="Only with ?items=1.")]]
    names: NotRequired[Annotated[list[str], Field(description=(
        "Only with ?items=1, for a job submitted with names: the input file name of each item, "
        "in item order."))]]
    after: NotRequired[Annotated[list[Parent], Field(description=(
        "Only for a job submitted with after: its parents, as {id, on}."))]]
    waiting_on: NotRequired[Annotated[list[Parent], Field(description=(
        "Only with after: the parents not ended yet, as {id, on} (empty once the job may "
        "run)."))]]
    member: NotRequired[Annotated[str, Field(description=(
        "Only for a job submitted with a member selector: the selector."))]]
    members: NotRequired[Annotated[list[str], Field(description=(
        "Only for a fan-out (member *): item i runs on members[i], fixed at the submit."))]]
    pending_members: NotRequired[Annotated[list[str], Field(description=(
        "Only for a fan-out: the members whose item waits for a lease."))]]
    waiting_for: NotRequired[Annotated[str, Field(description=(
        "Only in GET /jobs/{id} (and the job page) while items of an unfinished job wait for a "
        "lease: every reason they wait, in words, joined by \"; \" (the `says` of "
        "waiting_reasons, in order)."))]]
    waiting_reasons: NotRequired[Annotated[list[WaitingReason], Field(description=(
        "With waiting_for: each reason as {reason, says}, in this order: job_held, "
        "dependencies (the parents not ended), pool_held and pool_drained (fleet-wide, or the "
        "members where), quota (its submitter's running_items_max reached), max_leases, "
        "backoff (items tried again after a failure), placement (no alive member matches its "
        "selector, as the leader sees it) and slot (nothing else holds it: it waits for a "
        "free slot in its pool, with how many items are ahead of it)."))]]
    notify: NotRequired[Annotated[str, Field(description="Only with a finish hook: its URL.")]]
    restart: NotRequired[int | Literal["forever"]]
    resubmit: NotRequired[int]
    restart_delay_s: NotRequired[float]
    stdout: NotRequired[Annotated[str, Field(description="The path items' stdout is also "
                                                         "written to.")]]
    stderr: NotRequired[Annotated[str, Field(description="The path items' stderr is also "
                                                         "written to.")]]
    run: NotRequired[Annotated[int, Field(description=(
        "Only for a job that ran again or may: which run this is (1: the first)."))]]
    restarts: NotRequired[Annotated[int, Field(description="Automatic restarts so far.")]]
    resubmits: NotRequired[Annotated[int, Field(description="Automatic resubmits so far.")]]
    rerun_due_at: NotRequired[Annotated[float | None, Field(description=(
        "When the next automatic re-run is due (seconds), if one is."))]]
    rerun_due_why: NotRequired[Literal["restart", "resubmit"] | None]
    rerun_wait: NotRequired[Annotated[Literal["restarts_per_minute_max"] | None, Field(
        description="Why the due re-run waits past its delay: the job had its "
                    "restarts_per_minute_max automatic re-runs within the last minute.")]]
    previous_runs: NotRequired[Annotated[list[dict[str, Any]], Field(description=(
        f"The earlier runs (the last {limits.job_runs_kept_max}): run, state, finished_at, item "
        "counts and then (rerun, restart or resubmit)."))]]
