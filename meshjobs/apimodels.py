"""The bodies of the HTTP API as typed models: what a request may carry and what an answer holds.

Theory of operation: the models are TypedDicts (an answer is a dict built by the node; a key
that is only sometimes there is `NotRequired`, never a null it does not send), and a few named
type aliases (`Digest`, `ItemPayload`, `After`). `schemas()` turns them into the JSON Schemas of
the OpenAPI document's components (meshjobs/openapi.py), so the document says what the models
say. Requests are still parsed by control.py's pure parsers (their messages are part of the
API); tests/test_api_shapes.py checks real answers of a real meshd against these schemas, so an
answer that grows a key the models lack, or loses one they require, fails a test.

Rule 1: an answer model forbids keys it does not name (drift is caught, not tolerated).
Rule 2: descriptions are the documentation: they say what a key means to a client.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, NotRequired, Required

from pydantic import ConfigDict, Field, TypeAdapter, with_config
from pydantic.json_schema import GenerateJsonSchema

# pydantic needs typing_extensions' TypedDict before Python 3.12 (and TypeAliasType for named
# aliases before 3.12's `type` statement).
from typing_extensions import TypeAliasType, TypedDict

from meshjobs import limits
from meshjobs.control import ITEM_STATES, JOB_STATES

_CLOSED = ConfigDict(extra="forbid")
_OPEN = ConfigDict(extra="allow")

JobState = Literal[JOB_STATES]  # type: ignore[valid-type]
ItemState = Literal[ITEM_STATES]  # type: ignore[valid-type]
DepCondition = Literal["ok", "end", "fail"]

Digest = TypeAliasType("Digest", Annotated[str, Field(
    pattern="^[0-9a-f]{64}$", description="A blob's blake3-256 digest, lowercase hex.")])


@with_config(_CLOSED)
class PayloadB64(TypedDict):
    b64: Annotated[str, Field(json_schema_extra={"contentEncoding": "base64"})]


@with_config(_CLOSED)
class PayloadBlob(TypedDict):
    blob: Digest


ItemPayload = TypeAliasType("ItemPayload", Annotated[str | PayloadB64 | PayloadBlob, Field(
    description="One item's stdin: text (sent as UTF-8), raw bytes in base64, or a stored "
                "blob.")])


@with_config(_CLOSED)
class AfterObject(TypedDict):
    id: str
    on: NotRequired[Annotated[DepCondition, Field(json_schema_extra={"default": "ok"})]]


After = TypeAliasType("After", Annotated[
    Annotated[str, Field(pattern="^[A-Za-z0-9._-]{1,128}(:(ok|end|fail))?$")] | AfterObject,
    Field(description="One parent of a job and what it must do: ok (it ended done; the "
                      "default), end (it ended, any way), fail (it ended failed, timed out, "
                      "cancelled or dep_failed).")])


@with_config(_OPEN)
class Error(TypedDict):
    """Every error answer."""

    error: Annotated[str, Field(description="What went wrong and what to do.")]


@with_config(_CLOSED)
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


@with_config(_CLOSED)
class SubmitSpec(TypedDict, total=False):
    argv: Required[Annotated[list[str], Field(min_length=1, max_length=limits.argv_items_max,
                                              description="The program and its arguments.")]]
    id: _nullable(str, description="The job id; made up when absent.")
    pool: _nullable(str, default="default", description=(
        "The pool; \"POOL@MEMBER\" also names the member(s), as `member` does (both parts "
        "needed)."))
    priority: _nullable(Annotated[int, Field(ge=-limits.priority_abs_max,
                                             le=limits.priority_abs_max)], default=0)
    retries: _nullable(Annotated[int, Field(ge=0, le=limits.retries_max)], default=0)
    runtime_s: _nullable(Annotated[float, Field(gt=0, le=limits.runtime_s_max)])
    hold: _nullable(bool, default=False)
    tags: _nullable(Annotated[list[Annotated[str, Field(max_length=limits.tag_chars_max)]],
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
    restart_delay_s: _nullable(Annotated[float, Field(ge=0, le=limits.restart_delay_s_max)],
                               description="Seconds between a run's end and its automatic "
                                           "re-run (needs restart or resubmit).")
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


@with_config(_CLOSED)
class Rerun(TypedDict, total=False):
    failed_only: Annotated[bool, Field(json_schema_extra={"default": False}, description=(
        "Only the items that failed, timed out or were cancelled."))]


# --- a job record (answers of GET /jobs, GET /jobs/{id}, submit, cancel, tone, rerun) ---------

@with_config(_CLOSED)
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
    started_at: Annotated[float | None, Field(description="When its last try started "
                                                          "(seconds since the epoch).")]
    ended_at: Annotated[float | None, Field(description="When it ended (seconds).")]
    for_member: NotRequired[Annotated[str, Field(
        description="Only for a fan-out (member *): the member this item runs on, and only "
                    "there.")]]


@with_config(_CLOSED)
class Parent(TypedDict):
    id: str
    on: DepCondition


@with_config(_CLOSED)
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
    retries: int
    runtime_s: float | None
    max_leases: int | None
    items_total: int
    items_done: int
    items_failed: int
    items_cancelled: int
    items_running: Annotated[int, Field(description="Items leased now.")]
    items_pending: Annotated[int, Field(description="Items waiting for a lease.")]
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
        "Only when a placed job's items wait because no member they may go to is alive (as the "
        "leader sees it): why, in words."))]]
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
    previous_runs: NotRequired[Annotated[list[dict[str, Any]], Field(description=(
        f"The earlier runs (the last {limits.job_runs_kept_max}): run, state, finished_at, item "
        "counts and then (rerun, restart or resubmit)."))]]


# --- the fleet and a member's health ------------------------------------------------------------

@with_config(_CLOSED)
class FleetMember(TypedDict):
    name: str
    role: Literal["leader", "follower", "worker"]
    alive: Annotated[bool | None, Field(description="null: a voter not heard from yet.")]
    pools: Annotated[dict[str, int], Field(description="Its pools' effective slots.")]
    slots: int
    running: int
    last_seen: Annotated[float | None, Field(description="When it last reported (seconds).")]
    blob_pressure: NotRequired[Any]
    disk_full: NotRequired[bool]
    blob_bytes: NotRequired[Any]
    drained: Annotated[bool, Field(description="Drained by command: it gets no new leases.")]
    stopping: Annotated[bool, Field(description="Ordered to stop: it exits once its running "
                                                "items end.")]


@with_config(_CLOSED)
class Fleet(TypedDict):
    term: int
    leader: str | None
    members: list[FleetMember]
    partial: NotRequired[Annotated[bool, Field(description=(
        "This member's own view: the leader's could not be had."))]]


@with_config(_CLOSED)
class Health(TypedDict):
    ok: Annotated[bool, Field(description="False while read-only (its disk is full).")]
    state: Literal["ok", "read_only"]
    disk_full: bool
    disk_free_bytes: int | None
    member: str
    role: Literal["voter", "worker"]
    leader: str | None
    is_leader: bool
    ready: bool
    term: int
    applied_index: int
    leader_seen_ms_ago: int | float | None
    fresh: Annotated[bool, Field(description="This member's table follows a leader it hears "
                                             "from (its reads are not stale).")]
    jobs: int


# --- many jobs at once (POST /jobs/cancel, /jobs/forget, /jobs/tone, /jobs/status) ------------

@with_config(ConfigDict(extra="forbid", json_schema_extra={"minProperties": 1}))
class Filter(TypedDict, total=False):
    """Jobs that match every key given."""

    tag: Annotated[str, Field(min_length=1, max_length=limits.tag_chars_max)]
    state: Literal["queued", "held", "running", "done", "failed", "cancelled"]
    pool: str
    member: Annotated[str, Field(description="Jobs with an item that ran or runs on this "
                                             "member.")]


_IDS = Annotated[list[str], Field(min_length=1, max_length=limits.bulk_jobs_max)]
_AFTER = Annotated[str, Field(description="The `next` cursor of the answer before: the "
                                          "filter's next page.")]
_DRY_RUN = Annotated[bool, Field(description="Answer what would change; change nothing.")]


@with_config(_CLOSED)
class BulkStatus(TypedDict, total=False):
    """Either ids or filter, not both."""

    ids: _IDS
    filter: Filter
    after: _AFTER


@with_config(_CLOSED)
class BulkChange(TypedDict, total=False):
    """Either ids or filter, not both (cancel, forget)."""

    ids: _IDS
    filter: Filter
    after: _AFTER
    dry_run: _DRY_RUN


@with_config(_CLOSED)
class ToneSet(TypedDict, total=False):
    priority: int
    hold: bool
    max_leases: Annotated[int | None, Field(ge=1)]


@with_config(_CLOSED)
class BulkTone(TypedDict, total=False):
    """Either ids or filter, not both."""

    ids: _IDS
    filter: Filter
    after: _AFTER
    dry_run: _DRY_RUN
    set: ToneSet


@with_config(_CLOSED)
class BulkResult(TypedDict):
    id: str
    answer: Literal["changed", "would_change", "already_final", "no_such_job", "refused",
                    "found"]
    state: NotRequired[Annotated[str, Field(description="The job's state now, if it exists.")]]
    error: NotRequired[Annotated[str, Field(description="Why it was refused.")]]
    job: NotRequired[Job]


@with_config(_CLOSED)
class BulkAnswer(TypedDict):
    """One result per job."""

    action: Literal["cancel", "forget", "tone", "status"]
    dry_run: bool
    matched: int
    counts: dict[str, int]
    next: Annotated[str | None, Field(description="The cursor of the filter's next page (pass "
                                                  "it as `after`).")]
    results: list[BulkResult]


# --- history (GET /history) ---------------------------------------------------------------------

@with_config(_CLOSED)
class ItemsSummary(TypedDict):
    states: Annotated[dict[str, int], Field(description="How many items ended in each state.")]
    members: Annotated[list[str], Field(description="The members that ran them.")]


@with_config(_CLOSED)
class FinalJob(Job):
    """A job's final record, as the history keeps it: the record and a summary of its items."""

    items_summary: ItemsSummary


@with_config(_CLOSED)
class HistoryRecord(TypedDict):
    at: Annotated[float, Field(description="When the job was dropped (seconds).")]
    why: Annotated[Literal["forget", "expire", "rerun", "restart", "resubmit"], Field(
        description="forget or expire: the job was dropped; rerun, restart or resubmit: the "
                    "record is of its earlier run, which ended (the job runs again).")]
    index: Annotated[int, Field(description="The log index of the entry.")]
    member: str
    job: FinalJob


@with_config(_CLOSED)
class History(TypedDict):
    order: Literal["newest_first"]
    member: str
    records: list[HistoryRecord]
    skipped_lines: Annotated[int, Field(description="Damaged lines skipped (a torn last line "
                                                    "after a crash).")]
    more: bool
    dropped: Annotated[int, Field(description="Records this member dropped since it started "
                                              "(writer queue full).")]


# --- pools and members (GET /pools, POST /pools/{pool}/..., POST /members/{name}/...) -----------

class _PoolState(TypedDict):
    held: Annotated[bool, Field(description="Held fleet-wide.")]
    held_on: list[str]
    drained: Annotated[bool, Field(description="Drained fleet-wide.")]
    drained_on: list[str]
    slots_set: Annotated[int | None, Field(description="Slots set fleet-wide (meshctl pool "
                                                       "slots).")]
    slots_set_on: Annotated[dict[str, int], Field(description="Slots set per member.")]


@with_config(_CLOSED)
class PoolOrder(_PoolState):
    """The answer of a pool order: the pool's state now."""

    pool: str
    action: str
    member: str | None


@with_config(_CLOSED)
class PoolOnMember(TypedDict):
    slots: int
    running: int
    free: int
    slots_set: int | None
    held: bool
    drained: bool
    member_drained: bool
    stopping: bool
    alive: bool | None


@with_config(_CLOSED)
class PoolRow(_PoolState):
    pool: str
    slots: Annotated[int, Field(description="Slots of the alive members.")]
    free: Annotated[int, Field(description="Slots taking work now.")]
    running: Annotated[int, Field(description="Items leased.")]
    pending: Annotated[int, Field(description="Items waiting for a slot.")]
    members: dict[str, PoolOnMember]


@with_config(_CLOSED)
class Pools(TypedDict):
    leader: str | None
    partial: NotRequired[Annotated[bool, Field(description=(
        "This member's own view: the leader's could not be had."))]]
    pools: list[PoolRow]


@with_config(_CLOSED)
class PoolOrderBody(TypedDict, total=False):
    member: Annotated[str, Field(description="Only on this member.")]


@with_config(_CLOSED)
class PoolSlotsBody(TypedDict):
    slots: Annotated[int | None, Field(ge=0, le=limits.pool_slots_max)]
    member: NotRequired[Annotated[str, Field(description="Only on this member.")]]


@with_config(_CLOSED)
class MemberOrderBody(TypedDict, total=False):
    """drain and undrain take no keys."""


@with_config(_CLOSED)
class MemberStopBody(TypedDict, total=False):
    grace_s: Annotated[float, Field(ge=0, le=limits.stop_grace_s_max)]


@with_config(_CLOSED)
class MemberOrder(TypedDict):
    name: str
    action: str
    drained: bool
    stopping: bool


# --- schedules (/cron) --------------------------------------------------------------------------

CatchUp = Literal["latest", "none"]
Overlap = Literal["allow", "skip"]


@with_config(_CLOSED)
class CronPut(TypedDict):
    spec: Annotated[str, Field(max_length=limits.cron_spec_chars_max, description=(
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


@with_config(_CLOSED)
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


@with_config(_CLOSED)
class CronList(TypedDict):
    crons: Annotated[list[Cron], Field(description="Every schedule, oldest first.")]


@with_config(_CLOSED)
class CronRemoved(TypedDict):
    name: str
    removed: Literal[True]


# --- logging in, blobs --------------------------------------------------------------------------

class Login(TypedDict):
    token: str


class LoginForm(TypedDict):
    token: str
    next: NotRequired[str]


class LoggedIn(TypedDict, total=False):
    name: str
    role: Literal["read", "submit", "admin"]
    csrf: Annotated[str, Field(description="The X-Meshjobs-Csrf value of this session.")]


class LoggedOut(TypedDict, total=False):
    logged_out: bool


@with_config(_CLOSED)
class BlobCheck(TypedDict):
    digest: Digest
    state: Literal["good", "damaged"]
    repaired: NotRequired[bool]


# --- schemas ------------------------------------------------------------------------------------

MODELS: tuple[Any, ...] = (
    Error, Forgotten, SubmitSpec, Tone, Rerun, Item, Job, Fleet, Health, Digest, ItemPayload,
    After, BulkStatus, BulkChange, BulkTone, BulkAnswer, History, PoolOrder, Pools, PoolOrderBody,
    PoolSlotsBody, MemberOrderBody, MemberStopBody, MemberOrder, CronPut, Cron, CronList,
    CronRemoved, Login, LoginForm, LoggedIn, LoggedOut, BlobCheck)
REF = "#/components/schemas/{model}"


class _NoTitles(GenerateJsonSchema):
    """Schemas without the titles pydantic makes up from key names (noise in a document)."""

    def field_title_should_be_set(self, schema: Any) -> bool:
        return False


def ref(model: Any) -> dict[str, str]:
    """A reference to a model's schema in the document."""
    return {"$ref": REF.format(model=model.__name__)}


def schemas() -> dict[str, Any]:
    """The JSON Schemas of the models, by name, with references as the OpenAPI document's."""
    _, top = TypeAdapter.json_schemas(
        [(m, "validation", TypeAdapter(m)) for m in MODELS], ref_template=REF,
        schema_generator=_NoTitles)
    out = top["$defs"]
    for schema in out.values():
        schema.pop("title", None)
    return out
