"""What goes into the job node (events) and what comes out of it (effects), and its config.

All plain, frozen data: the jobs thread, the tests and the simulator build and read them alike.
Frame types are named by strings here (`"F_RESULT"`, ...) so the pure core needs nothing of the
wire codec; `meshjobs.frames.FrameType[name]` maps them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import blake3
import msgpack

from meshjobs import limits
from meshjobs.control import Answer

# --- events -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Tick:
    now_ms: int  # the member's wall clock
    # Its monotonic clock (any origin), by which committed time advances (node/clock.py);
    # None: the wall clock stands for it.
    mono_ms: int | None = None


@dataclass(frozen=True)
class Ctl:
    token: int
    req: Any


@dataclass(frozen=True)
class Applied:
    index: int
    entry: Any
    outcome: dict
    prev: int | None = None  # the table's position before this entry (None: not known)


@dataclass(frozen=True)
class View:
    term: int = 0
    leader: str | None = None
    is_leader: bool = False
    ready: bool = False  # leader: its table holds every committed entry of its term
    # The member has just started and its table has not caught up yet with the entries it held
    # before (a voter: no leader yet, or fewer entries applied than it knows committed). While
    # it is behind, a job it does not know may still exist: "no such job" is no answer then.
    behind: bool = False


@dataclass(frozen=True)
class Pressure:
    """The blob store holds more payload bytes in memory than it may (on), or drained (off)."""

    on: bool


@dataclass(frozen=True)
class DiskFull:
    """The data folder's disk is below `[blobs] disk_free_min` bytes free, or refused a write for
    want of space (on), or has room again (off). While it is on the member is read-only: it takes
    no leases and no submits, and says so in its health and its reports."""

    on: bool
    free_bytes: int = 0


@dataclass(frozen=True)
class BlobBytes:
    """How many payload bytes this member's blob store holds (reported to the leader)."""

    n: int


@dataclass(frozen=True)
class ItemEnded:
    job_id: str
    index: int
    epoch: int
    state: str  # done | failed | timeout | cut
    rc: int | None
    signal: int | None
    stdout: str | None
    stderr: str | None
    started_ms: int
    ended_ms: int
    error: str | None = None


@dataclass(frozen=True)
class FrameIn:
    """A frame from another member (already authenticated and decoded by the links)."""

    peer: str
    ftype: str
    body: Any


@dataclass(frozen=True)
class PeerLink:
    """A link to a member came up or went down."""

    peer: str
    up: bool


@dataclass(frozen=True)
class DumpReady:
    """A dump (snapshot) of this member's table at position `index` is durable in its data
    folder: the one a leader sends a new worker (`SendDump`), with the entries after it."""

    index: int


@dataclass(frozen=True)
class BlobsCopied:
    """`member` confirmed that these blobs are durable in its store."""

    member: str
    digests: tuple[str, ...]


# --- effects ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Propose:
    entry: dict


@dataclass(frozen=True)
class Reply:
    token: int
    answer: Answer


@dataclass(frozen=True)
class Run:
    job_id: str
    index: int
    epoch: int
    argv: list[str]
    env: dict[str, str]
    cwd: str | None
    stdin: str | None
    runtime_s: float | None
    kind: str = "command"  # the kind of the item's pool on this member
    user: str | None = None  # run as: the job's user, else the pool's default, else meshd's own
    inherit_env: bool = False  # the item gets meshd's whole environment, not the minimal one
    stdout_path: str | None = None  # also write the item's stdout here (the job's --stdout)
    stderr_path: str | None = None  # and its stderr here (--stderr)
    # The job's pool: a python pool's workers run as that pool's user (meshjobs.pypool).
    pool: str | None = None
    # The users the job's submitter may run as, when `user` is the pool's (None: no bound):
    # the driver refuses a pool user outside it (meshjobs/identity.py Rule 2).
    run_as: tuple[str, ...] | None = None

    @property
    def key(self) -> tuple[str, int, int]:
        """The run's (job id, index, epoch): what the driver and the jobs thread key it by."""
        return (self.job_id, self.index, self.epoch)


@dataclass(frozen=True)
class Cut:
    job_id: str
    index: int
    epoch: int


@dataclass(frozen=True)
class Pin:
    owner: str
    digests: tuple[str, ...]


@dataclass(frozen=True)
class Unpin:
    owner: str


@dataclass(frozen=True)
class UnpinAllBut:
    keep: frozenset[str]


@dataclass(frozen=True)
class Send:
    """A frame to another member. `table` frames may wait for room in the link's queue."""

    to: str
    ftype: str
    body: Any
    table: bool = False


@dataclass(frozen=True)
class SendDump:
    """An F_JOB_STATE frame to a worker: `body` with this member's latest dump added as `dump`,
    the dump file's bytes, read and sent in parts by the edge off the jobs thread (the table is
    never built or packed for it). `body["prev"]` is the position of the dump the node was told
    of (`DumpReady`) and `body["entries"]` the committed entries after it; the file read may be a
    newer dump, which the worker tells from the dump itself."""

    to: str
    body: Any


@dataclass(frozen=True)
class WantDump:
    """Ask for a new dump soon: a worker needs the whole table and the recent entries kept to
    follow a dump no longer reach back to the latest one."""


@dataclass(frozen=True)
class CopyBlobs:
    """Copy these blobs (durable here) to `to`, which pins them for `owner` (a job) and answers
    with BlobsCopied once they are durable there."""

    to: str
    owner: str
    digests: tuple[str, ...]


@dataclass(frozen=True)
class FetchBlobs:
    """Fetch these blobs from whichever member holds them, make them durable here pinned for
    `owner` (a job), and step the node with BlobsCopied(this member, digests) once they are."""

    owner: str
    digests: tuple[str, ...]


# --- configuration ------------------------------------------------------------------------------


@dataclass
class Pool:
    name: str
    kind: str = "command"
    slots: int = 1
    runtime_s: float | None = None
    user: str | None = None  # [pools.X] user: who its items run as when the job names nobody


@dataclass
class NodeConfig:
    member: str
    boot: str  # this incarnation of the member; leases name it
    pools: dict[str, Pool] = field(default_factory=dict)
    keep_s: float | None = None  # retention: forget finished jobs older than this
    keep_jobs: int | None = None  # retention: keep at most this many finished jobs
    role: str = "voter"  # voter (takes part in Raft) or worker (follows the leader's table)
    voters: tuple[str, ...] = ()  # the fleet's voters; empty: a fleet of one
    dead_ms: int = limits.member_dead_ms
    lost_ms: int = limits.member_lost_ms  # not heard from this long: its blob copies are remade
    blob_copies: int = limits.blob_copies
    # What walls this member's items run behind (meshjobs.wall.Status.fleet_entry), for /fleet.
    items: dict | None = None


# Every event the node takes (`JobNode.step` has one handler per type) and every effect it makes
# (node/ready.py sorts each by the durability gate). A type in neither is a bug of ours.
EVENTS: tuple[type, ...] = (Tick, Ctl, Applied, View, Pressure, DiskFull, BlobBytes, ItemEnded,
                            FrameIn, PeerLink, BlobsCopied, DumpReady)


# The digest of the empty payload: every member holds it, pinned for good by this owner (see
# daemon.py), which no reconciliation of pins ever removes.
from blobstore.digest import EMPTY_DIGEST as EMPTY_DIGEST  # noqa: E402 (its one definition)

MEMBER_OWNER = "meshd"


def spec_digest(spec: dict, items: list[bytes | None]) -> bytes:
    """What makes two submits "the same job": everything but the id, items included."""
    body = msgpack.packb([sorted((k, v) for k, v in spec.items() if k != "id"), items],
                         use_bin_type=True)
    return blake3.blake3(body).digest()


@dataclass(frozen=True)
class Exit:
    """Effect: this member's meshd is ordered to stop (`meshctl member stop`) and may exit
    now; `why` goes to its log."""

    why: str


@dataclass(frozen=True)
class Notify:
    """Effect: POST a job's final record to its finish hook (`--notify URL`); `key` (job id and
    version) lets the receiver tell a repeat from a new notice."""

    url: str
    key: str
    record: dict


EFFECTS: tuple[type, ...] = (Propose, Reply, Run, Cut, Pin, Unpin, UnpinAllBut, Send, CopyBlobs,
                             FetchBlobs, Exit, Notify, SendDump, WantDump)
