"""The fleet, a member's health, pools and members, logging in, blob checks."""

from __future__ import annotations

from typing import Annotated, Any, Literal, NotRequired

from pydantic import Field, with_config

# pydantic needs typing_extensions' TypedDict before Python 3.12 (and TypeAliasType for named
# aliases before 3.12's `type` statement).
from typing_extensions import TypedDict

from meshjobs import limits
from meshjobs.apimodels.jobs import CLOSED, Digest

# --- the fleet and a member's health ------------------------------------------------------------

@with_config(CLOSED)
class ItemWalls(TypedDict):
    user: Annotated[str, Field(description="Who items that name no user run as.")]
    walls: Annotated[list[Literal["uid", "landlock", "undumpable"]], Field(description=(
        "uid: items run as a user of their own; landlock: each in a Landlock domain; "
        "undumpable: meshd's /proc files are closed to them."))]
    signals_walled: Annotated[bool, Field(description=(
        "Whether items cannot signal meshd or other jobs' items."))]
    warning: Annotated[str | None, Field(description=(
        "Set when items are not walled off from meshd: what they reach, what to do."))]


@with_config(CLOSED)
class FleetMember(TypedDict):
    name: str
    role: Literal["leader", "follower", "worker"]
    alive: Annotated[bool | None, Field(description=(
        "false: down (no report for `dead_ms`); null: not known (see `status`)."))]
    status: Annotated[Literal["alive", "down", "not_heard_yet", "unknown"], Field(description=(
        "alive; down (since `down_since`); not_heard_yet: the leader has just come to lead and "
        "gives it `dead_ms` to report; unknown: the member that answers does not lead, and "
        "only the leader hears the reports (`partial`)."))]
    down_since: Annotated[float | None, Field(description=(
        "When a down member was last heard from (seconds), or, never heard by this leader, "
        "when its reign began; null unless down."))]
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
    items: NotRequired[Annotated[ItemWalls, Field(description=(
        "What walls its items off from meshd (absent: a voter not heard from yet)."))]]
    clock_skew_ms: NotRequired[Annotated[int | None, Field(description=(
        "Its wall clock minus that of the member that answers (the leader, unless `partial`), "
        "in ms, from its last report (0 for the member that answers; null: not known). Only "
        "shown: retention and leases do not depend on it."))]]


@with_config(CLOSED)
class Fleet(TypedDict):
    term: int
    leader: str | None
    members: list[FleetMember]
    partial: NotRequired[Annotated[bool, Field(description=(
        "This member's own view: the leader's could not be had."))]]


@with_config(CLOSED)
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


# --- pools and members (GET /pools, POST /pools/{pool}/..., POST /members/{name}/...) -----------

class _PoolState(TypedDict):
    held: Annotated[bool, Field(description="Held fleet-wide.")]
    held_on: list[str]
    drained: Annotated[bool, Field(description="Drained fleet-wide.")]
    drained_on: list[str]
    slots_set: Annotated[int | None, Field(description="Slots set fleet-wide (meshctl pool "
                                                       "slots).")]
    slots_set_on: Annotated[dict[str, int], Field(description="Slots set per member.")]


@with_config(CLOSED)
class PoolOrder(_PoolState):
    """The answer of a pool order: the pool's state now."""

    pool: str
    action: str
    member: str | None


@with_config(CLOSED)
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


@with_config(CLOSED)
class PoolRow(_PoolState):
    pool: str
    slots: Annotated[int, Field(description="Slots of the alive members.")]
    free: Annotated[int, Field(description="Slots taking work now.")]
    running: Annotated[int, Field(description="Items leased.")]
    pending: Annotated[int, Field(description="Items waiting for a slot.")]
    members: dict[str, PoolOnMember]


@with_config(CLOSED)
class Pools(TypedDict):
    leader: str | None
    partial: NotRequired[Annotated[bool, Field(description=(
        "This member's own view: the leader's could not be had."))]]
    pools: list[PoolRow]


@with_config(CLOSED)
class PoolOrderBody(TypedDict, total=False):
    member: Annotated[str, Field(description="Only on this member.")]


@with_config(CLOSED)
class PoolSlotsBody(TypedDict):
    slots: Annotated[int | None, Field(ge=0, le=limits.pool_slots_max)]
    member: NotRequired[Annotated[str, Field(description="Only on this member.")]]


@with_config(CLOSED)
class MemberOrderBody(TypedDict, total=False):
    """drain and undrain take no keys."""


@with_config(CLOSED)
class MemberStopBody(TypedDict, total=False):
    grace_s: Annotated[float, Field(ge=0, le=limits.stop_grace_s_max)]


@with_config(CLOSED)
class MemberOrder(TypedDict):
    name: str
    action: str
    drained: bool
    stopping: bool


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


@with_config(CLOSED)
class BlobCheck(TypedDict):
    digest: Digest
    state: Literal["good", "damaged"]
    repaired: NotRequired[bool]
