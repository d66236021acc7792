"""A seeded, deterministic simulation of a whole fleet's job nodes (after TigerBeetle's VOPR).

Theory of operation. Five members (voters v1..v3, workers w1 and w2) each run a real `JobNode`
over a real `JobTable`, in one process, on simulated time. Around them the simulator plays what
the jobs thread, pysyncobj, the links, the driver, the blob mover and the clients would do, and
breaks them:

- Raft is modelled, not run. One committed log; a leader elected among live voters that reach a
  majority, with a term that grows. Proposals of the member that leads in the model go to an
  uncommitted tail (some are lost, as if the leader were deposed first); at an election a random
  prefix of the old tail survives. Committed indexes have random gaps (pysyncobj's no-ops). Each
  voter applies committed entries at its own pace, only while it reaches the leader. A deposed
  leader cut off from the new one goes on believing it leads for a while (pysyncobj does).
- Frames go through a lossy network: dropped, duplicated, delayed and reordered, cut by
  partitions (with `PeerLink` events); every body is msgpack round-tripped, as is every entry.
  Frames in flight to or from a member that crashes are lost (its connections die with it).
- The driver runs fake items that end after a random delay with random output digests; blob
  copies land after a delay when the target is reachable. With `xfer` set, blobs have bytes
  and copies run the real transfer protocol (meshjobs/blobxfer/) between the members, its
  frames in order on each link but lost or late (`_Xfers`).
- Members crash and restart with a new boot id: a voter keeps its journal (it replays its applied
  prefix, sometimes from a snapshot), a worker starts empty and relearns from the leader. With
  `dumps` set, voters write dumps now and then (and when their node asks for one): a copy of the
  table taken at once, in the dump format (meshjobs/dumpbytes.py), ready some time later and kept
  over a crash; a leader sends a worker that needs the whole table its latest dump and the
  entries after it, as the jobs thread's sender does with the dump file. A
  member's blob store may run over (`Pressure`) for a while, and with `disk_full` set its disk
  may fill up (`DiskFull`: read-only, no leases to it, its submits answered 507); some seeds keep
  only 20 finished jobs (retention).
- Clients submit jobs (some held then released, some cancelled, some forgotten once finished)
  and retry with the same request id after a 503, a 507 or a timeout. With `deps` set, some
  jobs wait for earlier ones (`after`, each condition drawn from ok, end and fail). With
  `reruns` set, some jobs restart once or twice after a short delay and some clients rerun
  their finished job (whole, or only its failed items): each committed rerun must send back
  exactly the items it names, no item may have more results than attempts, no job more
  restarts than it asked for, and no job more automatic re-runs in a minute than
  `limits.restarts_per_minute_max` (with `restarts_many`, jobs ask for enough to reach it).
  jobs wait for earlier ones (`after`, each condition drawn from ok, end and fail). With `cron`
  set, that many schedules (`@every` 1 to 5 s of simulated time) are added through the control
  path and fire through crashes, partitions and leader changes; once healed and seen firing,
  they are paused (so that the fleet can settle). With `stops` set, an operator now and then
  orders a member to stop (`member stop`, with or without a grace): the member exits when its
  node says so (the `Exit` effect, as meshd does), and is started again later with a new boot
  id, as a crashed member is. With `slots` set, an operator now and then sets the pool's
  slots (0 to 3, fleet-wide or on one member) or resets them; after healing every override
  is reset.
- With `reads` set, readers now and then ask a member cut off from the leader for the job
  list: once its table has caught up with the log since it started, it answers from it
  (never 503), saying whether it is fresh.
- Clients are three submitters, every fifth client an admin, and every change carries who
  sends it. With `meddle` set, a submitter now and then tries to cancel, hold or forget a job
  another submitted: it must be refused (403) wherever it lands, and, checked on every
  committed entry whether or not `meddle` is set, no entry changes a job for anyone but its
  submitter or an admin (nor does a bulk change answer otherwise). With `quota` set, one
  submitter's token has that running_items_max, and at no committed index are more of its
  items leased (recounted from the items, not from the table's counters). With `worker_pool`
  set, the workers also offer pool "gpu", which no voter does; that share of new jobs goes
  there (placed ones on workers only), and soon after every election an operator asks the new
  leader's fleet about a worker (`member undrain`) or the gpu pool (`pool release`): what a new
  leader says of pools and members it has not heard from yet is checked (see Rule 2).
- With `clocks` set, those members' wall clocks are off (minutes ahead or behind); every
  incarnation's monotonic clock has an origin of its own. With `keep_s` set, retention is by
  age: no job may be expired before keep_s has passed, in the simulator's own time, since the
  batch that ended it was proposed, whichever leaders' clocks stamped its end and its expiry.

Rule 1: pure and replayable. No IO, clock or threads; every choice comes from one
        `random.Random(seed)`, and nothing iterates a set whose order could change between runs.
        `run(seed)` twice gives equal reports.
Rule 2: the checks are the point. A broken one raises `SimFailure`, whose message starts with
        the seed. Checked after every committed entry (against an oracle table that applies the
        log): at most one accepted result per lease epoch, and only under the item's current
        epoch; epochs never go backwards; a forgotten id never comes back; `table.check()`; the
        blobs of a committed result or submit are on `blob_copies` members; a dependent never
        starts before each parent has ended the way its condition asks, waits only while a
        parent has not ended, and ends dep_failed only when a condition can no longer hold (the
        parents' final states are noted as each entry, or each change of a batch, ends them).
        A schedule's due time is settled (fired or passed over) at most once, its run made under
        the id of its name and due time, and only as the latest due time at the fire's time
        stamp (never an older missed one: no burst; with catch-up none, not over
        `cron_late_ms_max` late); once the fleet is healed and settled, no due time is missed.
        No lease to a member's incarnation (boot) is committed after a stop naming it, and a
        member exits only in an incarnation a committed stop named. A member starts an item
        only while fewer of the pool's items run there than its effective slots (as its own
        table says; with slots set to 0, its configured ones, for what was leased before).
        Checked after every
        step: a worker says it is fresh only while its leader itself sent it F_JOB_STATE within
        dead_ms and its table holds every entry that leader's frames showed it;
        every member's table equals every other table (and the oracle) at the same index;
        a submit, cancel or forget is answered 200/201 only once committed; a change of an
        acknowledged, committed job is never answered 404; no answer is given twice. A leader
        gives no final "unknown pool" or "no member" answer, and proposes no fan-out's member
        list, while it has not heard from the fleet (node/heard.py, told here from what the
        simulator delivered to it): less than dead_ms into its reign with a member it knows of
        (a voter, one its table names, one that reported to it within lost_ms before the
        reign) not yet reported in the reign.
Rule 3: a safety phase of `steps` steps with faults, then a liveness phase with every fault
        healed, which must end, within a bound, with every acknowledged job ended or forgotten
        and every member's table caught up.
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import blake3
import msgpack

from meshjobs import blobxfer, cron, dumpbytes, limits, placement
from meshjobs.control import JOB_FINAL_STATES, Answer
from meshjobs.node import (
    Applied,
    BlobsCopied,
    CopyBlobs,
    Ctl,
    Cut,
    DiskFull,
    DumpReady,
    FetchBlobs,
    FrameIn,
    ItemEnded,
    JobNode,
    NodeConfig,
    PeerLink,
    Pin,
    Pool,
    Pressure,
    Reply,
    Run,
    Send,
    SendDump,
    Tick,
    Unpin,
    UnpinAllBut,
    View,
    WantDump,
)
from meshjobs.node.events import Exit, Notify
from meshjobs.node.ready import AFTER_SYNC, advance, dispatch
from meshjobs.table import CANCELLED, FAILED, ITEM_STATE_NAMES, LEASED, PENDING, TIMEOUT, JobTable

T0_MS = 1_700_000_000_000
VOTERS = ("v1", "v2", "v3")
WORKERS = ("w1", "w2")
MEMBERS = VOTERS + WORKERS
FINAL_STATES = JOB_FINAL_STATES


def _fp(*parts: object) -> str:
    """A request's fingerprint, as the HTTP edge makes one: what its key is bound to."""
    return blake3.blake3(repr(parts).encode()).hexdigest()[:32]


class SimFailure(AssertionError):
    """A check of the simulation failed; the message names the seed that replays it."""

    def __init__(self, seed: int, step: int, now_ms: int, what: str) -> None:
        super().__init__(f"seed={seed} step={step} t={now_ms - T0_MS}ms: {what} "
                         f"(replay: meshjobs.sim.run({seed}))")
        self.seed = seed
        self.what = what


@dataclass(frozen=True)
class SimConfig:
    """The simulated world's knobs: fault rates per step or per frame, and time ranges in ms."""

    steps: int = 2500  # steps of the safety phase
    step_ms_max: int = 40  # simulated time between two steps: 1..this
    liveness_ms_max: int = 300_000  # the liveness phase must settle within this
    frame_drop: float = 0.05
    frame_dup: float = 0.03
    frame_delay_ms_max: int = 120
    frame_late: float = 0.03  # a frame delayed up to frame_late_ms_max (so reordered)
    frame_late_ms_max: int = 3_000
    proposal_lost: float = 0.03
    crash: float = 0.002  # per step
    restart_ms: tuple[int, int] = (300, 8_000)
    partition: float = 0.003  # per step
    partition_ms: tuple[int, int] = (500, 12_000)
    pressure: float = 0.001  # per step: a member's blob store runs over for a while
    # per step: a member's disk is full (read-only) for a while. Off by default, and then not
    # drawn at all, so that the seeds recorded before it replay as they did.
    disk_full: float = 0.0
    election_ms: tuple[int, int] = (150, 1_500)
    fallback_ms: tuple[int, int] = (200, 4_000)  # a deposed leader believes it leads this long
    apply_all: float = 0.7  # a voter that can apply applies everything committed (else a part)
    job_new: float = 0.03  # per step, while fewer than jobs_max jobs were made
    jobs_max: int = 40
    items_max: int = 20
    run_ms: tuple[int, int] = (20, 1_500)
    # per step: a client reuses an acknowledged submit's idempotency key on another change
    key_reuse: float = 0.004
    client_timeout_ms: int = limits.ctl_commit_ms_max + 2_000
    inputs: float = 0.15  # a job's items have inputs (blobs the submit must copy first)
    # Members cut off from every other for the whole safety phase whose links still look up to
    # all (a silent peer: the links notice only after link_silent_ms_max, if ever).
    silent: tuple[str, ...] = ()
    # A member lost for good (its blob store with it) at step `lose_at_step`: it never comes
    # back, and the liveness phase must end with every committed output on blob_copies members
    # again. `lost_ms` is the members' NodeConfig.lost_ms.
    # Pairs of members cut apart for the whole safety phase (a worker cut off from some voters
    # only, say: it hears the others).
    cut: tuple[tuple[str, str], ...] = ()
    lose: str | None = None
    lose_at_step: int = 0
    lost_ms: int = limits.member_lost_ms
    # A new job waits for 1 to 3 acknowledged jobs (`after`) with this chance. Off by default,
    # and then not drawn at all, so that the seeds recorded before it replay as they did.
    deps: float = 0.0
    # A client's cancel or forget goes, with this chance, as one bulk request naming its own job
    # and another acknowledged one (`bulk` entries). Off by default, and then not drawn at all.
    bulk: float = 0.0
    # A new job names where its items go (`member`) with this chance: one member, a glob, or
    # "*" (a fan-out, one item per member). Off by default, and then not drawn at all.
    place: float = 0.0
    # Per step: an operator holds, releases, drains or undrains the pool (fleet-wide or on one
    # member), or drains or undrains a member (`pool` and `member` entries); after healing every
    # order is lifted. Off by default, and then not drawn at all.
    orders: float = 0.0
    # Re-runs (meshjobs.reruns): with this chance a new job asks for `restart` 1 or 2 (with a
    # short delay), and a client reruns its finished job (whole, or its failed items). Off by
    # default, and then not drawn at all.
    reruns: float = 0.0
    # With re-runs on: the `restart` a job asks for is this many instead of 1 or 2 (0: 1 or 2,
    # as before), with the shortest delay, so that a job re-runs more often than
    # limits.restarts_per_minute_max allows in a minute (reruns.py Rule 6). Drawn nothing more.
    restarts_many: int = 0
    # Schedules added at the start (meshjobs/cron.py), `@every` 1 to 5 s. Off by default (0),
    # and then nothing is drawn for them, so that recorded seeds replay as they did.
    cron: int = 0
    # Per step: an operator orders a member to stop (`member stop`, grace none, 0 or a few
    # seconds); it exits when its node says so and is started again later, as after a crash.
    # Off by default, and then not drawn at all, so that recorded seeds replay as they did.
    stops: float = 0.0
    # Per step: an operator sets the pool's slots (0 to 3; fleet-wide or on one member) or
    # resets them (`pool slots`); after healing they are reset. Off by default, and then not
    # drawn at all, so that recorded seeds replay as they did.
    slots: float = 0.0
    # Blob copies go through the real transfer protocol (meshjobs/blobxfer.py) between the
    # members' `Transfer`s, their frames through the lossy network, and outputs and inputs get
    # real bytes (up to `XFER_BLOB_BYTES_MAX`). Off by default, and then not drawn at all, so
    # that recorded seeds replay as they did.
    xfer: bool = False
    # Per step: a client (never an admin) tries to cancel, hold or forget another submitter's
    # acknowledged job (meshjobs/identity.py): it must be refused (403) wherever it lands, and
    # no committed entry may change a job for anyone but its submitter or an admin. Off by
    # default, and then not drawn at all, so that recorded seeds replay as they did.
    meddle: float = 0.0
    # The running_items_max of QUOTA_USER's token (0: none): every job that identity submits
    # carries it, and at no committed index may more of its items be leased (quotas.py).
    # Drawn nothing.
    quota: int = 0
    # Per step: a voter starts a dump of its table (ready 20 ms to 2 s later, if it is still up),
    # and the leaders send new workers dumps. Off by default, and then not drawn at all, so that
    # recorded seeds replay as they did.
    dumps: float = 0.0
    # Workers also offer pool "gpu" (no voter does): a new job goes there with this chance,
    # and operators ask about a worker or the gpu pool right after each election. Off by
    # default, and then not drawn at all, so that recorded seeds replay as they did.
    worker_pool: float = 0.0
    # Members whose wall clocks are off, by ms: (("v2", 120_000),) is v2 two minutes ahead.
    # Monotonic clocks have an origin of their own per incarnation whatever this says. Drawn
    # nothing.
    clocks: tuple[tuple[str, int], ...] = ()
    # Retention by age (NodeConfig.keep_s; then no keep_jobs): no job may be expired before
    # keep_s has passed, in the simulator's time, since the batch that ended it was proposed
    # (table.py Rule 7), whichever leaders' clocks stamped its end and its expiry. Drawn
    # nothing.
    keep_s: float | None = None
    # Per step: a reader asks a member for the job list. A member whose table has caught up with
    # the log once since it started answers it from its table (200), saying whether it is
    # fresh, whatever it hears then: never 503. Off by default, and then not drawn at all, so
    # that recorded seeds replay as they did.
    reads: float = 0.0
    # The leader is killed this long (drawn) after the last kill, as by an operator testing
    # failovers. Off by default, and then not drawn at all, so that recorded seeds replay as
    # they did.
    leader_kills_ms: tuple[int, int] = (0, 0)
    # With this set (ms), every accepted result must commit within this of its run's end, or
    # of the start of the reign it commits in, whichever is later: a member sends its results
    # to each new reign at once, not when its resend timer (proposal_retry_ms) is due. Only for
    # worlds whose frames are never lost (a lost frame is resent by that timer). Drawn nothing.
    result_wait_ms_max: int = 0


# With SimConfig.worker_pool: the pool only workers offer, and the selectors its placed jobs
# draw from (each matches a worker, so that every job can end).
WORKER_POOL = "gpu"
WORKER_SELECTORS = ("w1", "w2", "w?", "*", "*")


# The identity whose token has a running_items_max when SimConfig.quota is set.
QUOTA_USER = "user2"


# After healing, the fleet has this long to settle before a due time missed is a failure.
CRON_SETTLE_MS = 10_000


@dataclass
class _CronClient:
    """A client that adds one schedule, and pauses it once the fleet is healed."""

    name: str
    req: dict
    phase: str = "add"  # add, added, pause, paused
    attempt: int = 0
    inflight: tuple | None = None
    deadline_ms: int = 0
    next_ms: int = 0


@dataclass
class Report:
    """What one run did. Two runs of one seed give equal reports."""

    seed: int
    steps: int
    sim_ms: int
    liveness_ms: int
    digest: str  # of the final committed table
    counts: dict[str, int] = field(default_factory=dict)


@dataclass
class _Member:
    name: str
    role: str
    alive: bool = False
    inc: int = 0
    boot: str = ""
    table: Any = None
    node: Any = None
    inbox: list = field(default_factory=list)  # events for its next step, in order
    applied: list = field(default_factory=list)  # Applied events for its next step
    view_sent: View | None = None
    links: dict[str, bool] = field(default_factory=dict)
    pos: int = 0  # voters: committed entries applied (kept over a crash, as the journal is)
    tokens: int = 0
    mono_ms: int = 0  # its monotonic clock's origin, in the simulator's time (per incarnation)
    running: dict[tuple, int] = field(default_factory=dict)  # run -> seq of its end event
    checked_index: int = -1
    pressure: bool = False
    disk_full: bool = False  # as the sim's disk is; `disk_known` once the node was told
    disk_known: bool = False
    exiting: bool = False  # its node said Exit (a stop order): it goes down after this step
    cut: set = field(default_factory=set)  # runs its node cut, whose end is still to come
    unsynced: bool = False  # it logged entries this round and has not synced them yet
    dump: tuple[int, bytes] | None = None  # voters: the latest dump (position, bytes), kept over a crash
    dumping: bool = False  # a dump of this incarnation is being written
    # What the simulator gave its node: when its reign as leader began (None: not leading),
    # and when each member's report (F_JOB_HAVE) was last stepped into it, this incarnation.
    reign_ms: int | None = None
    reports: dict[str, int] = field(default_factory=dict)
    caught_up: bool = False  # its table has been at the log's last entry since it started


@dataclass
class _Client:
    cid: int
    req: dict
    plan: list[str]
    phase: str = "submit"
    job_id: str | None = None
    attempt: int = 0  # bumped when a phase starts over with a fresh request id
    sent: dict | None = None  # the request last sent: a retry under its request id sends it again
    inflight: tuple | None = None
    deadline_ms: int = 0
    next_ms: int = 0


def _identity(cid: int) -> dict[str, str]:
    """Who client `cid` is (not drawn: the seeds' runs stay what they were): one of three
    submit identities, every fifth client an admin."""
    return {"by": f"user{cid % 3}", "by_role": "admin" if cid % 5 == 0 else "submit"}


def _pack(x: Any) -> bytes:
    return msgpack.packb(x, use_bin_type=True)


def _unpack(raw: bytes) -> Any:
    return msgpack.unpackb(raw, raw=False, strict_map_key=False, use_list=True)


def table_digest(table: JobTable) -> bytes:
    return blake3.blake3(_pack(table.to_state())).digest()


# With `xfer`, blobs are this large at most, and travel in frames of XFER_LIMITS.frame_bytes:
# most go in windows of chunks, the others packed.
XFER_BLOB_BYTES_MAX = 400
XFER_LIMITS = blobxfer.XferLimits(frame_bytes=64, inflight_bytes_max=1024)
XFER_PUMP_MS = 20  # a member with a transfer under way pumps (and ticks) this often


class _XferSource:
    """What a member's protocol reads of its simulated store: the bytes of the blobs it holds."""

    def __init__(self, xfers: _Xfers, name: str) -> None:
        self._x = xfers
        self._name = name

    def has(self, d: str) -> bool:
        return d in self._x.sim.blobs[self._name]

    def size(self, d: str) -> int | None:
        return len(self._x.content[d]) if self.has(d) else None

    def read(self, d: str) -> bytes | None:
        return self._x.content[d] if self.has(d) else None

    def open(self, d: str) -> Any:
        if not self.has(d):
            return None
        data = self._x.content[d]
        return (data[i:i + 48] for i in range(0, len(data), 48))

    def wanted(self, d: str) -> bool:
        return False  # fetches stay modelled (FetchBlobs); only copies run the protocol


class _Xfers:
    """Blob copies through the pure transfer protocol: each member incarnation has a
    `blobxfer.Transfer` over its simulated store; their frames cross the lossy network (dropped,
    duplicated, delayed, reordered, cut), and what the protocol asks is done here as the mover
    does it. Checked: a chunk is written only where its spool ends; bytes are kept only when
    they hash to their digest; an acknowledgement is sent only for blobs durable on the member
    that sends it; a copy is reported done only when its blobs are durable on its target."""

    def __init__(self, sim: Sim, receiver_cls: type[blobxfer.Receiver]) -> None:
        self.sim = sim
        self.receiver_cls = receiver_cls
        self.content: dict[str, bytes] = {}
        self.x: dict[str, tuple[int, blobxfer.Transfer]] = {}  # member -> (inc, its protocol)
        self.spools: dict[tuple[str, int], dict[blobxfer.AsmKey, bytearray]] = {}
        self.pumps: set[tuple[str, int]] = set()  # incarnations with a pump scheduled
        self.link_at: dict[tuple[str, str], int] = {}  # the last frame's arrival on each link

    def new_blob(self, rng: random.Random) -> str:
        data = rng.randbytes(rng.randint(1, XFER_BLOB_BYTES_MAX))
        d = blake3.blake3(data).hexdigest()
        self.content[d] = data
        return d

    def _of(self, name: str) -> blobxfer.Transfer:
        inc = self.sim.members[name].inc
        got = self.x.get(name)
        if got is None or got[0] != inc:
            # A new incarnation: what the old one had under way died with it.
            if got is not None:
                self.spools.pop((name, got[0]), None)
            got = self.x[name] = (inc, blobxfer.Transfer(
                _XferSource(self, name), XFER_LIMITS, receiver_cls=self.receiver_cls))
        return got[1]

    def copy(self, m: _Member, eff: CopyBlobs) -> bool:
        """Start `eff` through the protocol; False when a blob has no bytes (made before `xfer`
        bytes existed), which leaves the copy to the model."""
        if not all(d in self.content for d in eff.digests):
            return False
        self.sim.count("xfer_copies")
        self._do(m.name, self._of(m.name).copy(eff.to, eff.owner, eff.digests, self.sim.now))
        self._pump_soon(m.name)
        return True

    def due(self, kind: str, p: Any) -> None:
        sim = self.sim
        if kind == "xpump":
            name, inc = p
            self.pumps.discard(p)
            m = sim.members[name]
            if not m.alive or m.inc != inc:
                return
            x = self._of(name)
            peers = {n: {"up": sim._reachable(name, n), "queued": 0, "waiting": 0}
                     for n in MEMBERS if n != name}
            actions, busy = x.pump(sim.now, lambda: peers, 2)
            self._do(name, actions)
            self._do(name, x.tick(sim.now))
            if busy or x.busy():
                self._pump_soon(name)
            return
        src, src_inc, dst, dst_inc, raw = p
        if (sim.members[src].inc != src_inc or sim.members[dst].inc != dst_inc
                or not sim._reachable(src, dst)):
            sim.count("xframes_lost_in_flight")
            return
        x = self._of(dst)
        self._do(dst, x.frame(src, False, _unpack(raw), sim.now))
        self._do(dst, x.end_turn())
        self._pump_soon(dst)

    def _pump_soon(self, name: str) -> None:
        key = (name, self.sim.members[name].inc)
        if key not in self.pumps:
            self.pumps.add(key)
            self.sim._at(self.sim.now + XFER_PUMP_MS, "xpump", key)

    def _net(self, src: str, dst: str, body: dict) -> bool:
        """A frame from `src` to `dst` through the lossy network; False when the links are down
        (they do not take it). Frames are not duplicated: the links never do."""
        sim = self.sim
        sim.count("xframes_sent")
        if dst not in sim.members or dst == src:
            sim.fail(f"{src} sent a blob frame to {dst!r}")
        if not sim._reachable(src, dst):
            return False
        if sim.faulty and sim.rng.random() < sim.cfg.frame_drop:
            sim.count("xframes_dropped")
            return True
        # The links are streams: a frame may be lost (with its connection) or late, but the
        # frames that arrive arrive in order, each once.
        delay = sim.rng.randint(1, sim.cfg.frame_delay_ms_max)
        if sim.faulty and sim.rng.random() < sim.cfg.frame_late:
            delay = sim.rng.randint(delay, sim.cfg.frame_late_ms_max)
        at = self.link_at[(src, dst)] = max(sim.now + delay, self.link_at.get((src, dst), 0))
        sim._at(at, "xframe", (src, sim.members[src].inc, dst, sim.members[dst].inc,
                               _pack(body)))
        return True

    def _keep(self, name: str, d: str, data: bytes) -> None:
        """The store keeps `data` as blob `d` (the paired check of what the protocol passed)."""
        if blake3.blake3(data).hexdigest() != d:
            self.sim.fail(f"{name} kept bytes that are not blob {d[:12]}")
        self.sim.blobs[name].add(d)

    def _do(self, name: str, actions: list[blobxfer.Action]) -> None:
        """Execute the protocol's actions for `name` as its mover would, checking them."""
        sim = self.sim
        x = self._of(name)
        spools = self.spools.setdefault((name, sim.members[name].inc), {})
        todo = list(actions)
        while todo:
            a = todo.pop(0)
            more: list[blobxfer.Action] = []
            if isinstance(a, blobxfer.SendFrames):
                taken = 0
                for body in a.bodies:
                    if not self._net(name, a.to, body):
                        break
                    taken += 1
                more = x.taken(a.ticket, taken, sim.now)
            elif isinstance(a, blobxfer.Send):
                acked = a.body.get("ack")
                if acked is not None:
                    late = [d for d in acked if d not in sim.blobs[name]]
                    if late:
                        sim.fail(f"{name} acknowledged blob {late[0][:12]} before it was "
                                 "durable")
                self._net(name, a.to, a.body)
            elif isinstance(a, blobxfer.SpoolWrite):
                spool = spools.setdefault(a.key, bytearray())
                if a.off != len(spool):
                    sim.fail(f"{name} wrote a chunk of {a.d[:12]} at offset {a.off} to a spool "
                             f"of {len(spool)} bytes")
                spool += a.data
            elif isinstance(a, blobxfer.Unspool):
                spools.pop(a.key, None)
            elif isinstance(a, blobxfer.Keep):
                got = None
                if a.spooled:
                    spool = spools.pop(a.key, None)
                    if spool is None:
                        continue
                    got = blake3.blake3(spool).hexdigest()
                    if got == a.d:
                        self._keep(name, a.d, bytes(spool))
                spools.pop(a.key, None)
                more = x.kept(a, got, a.d in sim.blobs[name])
            elif isinstance(a, blobxfer.KeepBatch):
                for b in a.blobs:
                    self._keep(name, b.d, b.data)
                more = x.batch_kept(a.ticket, [b.d for b in a.blobs])
            elif isinstance(a, blobxfer.CopyDone):
                if a.to not in sim.gone:
                    lost = [d for d in a.digests if d not in sim.blobs[a.to]]
                    if lost:
                        sim.fail(f"{name} was told blob {lost[0][:12]} is on {a.to}, which does "
                                 "not hold it")
                sim.count("copies_done")
                sim.members[name].inbox.append(BlobsCopied(a.to, a.digests))
            elif isinstance(a, blobxfer.Found | blobxfer.PeerMissing):
                sim.count("xfer_found")
            else:
                sim.fail(f"{name}'s blob protocol made an unknown action {a!r:.200}")
            todo[:0] = more


class Sim:
    """The whole simulated fleet. `run()` drives it; tests may build one to plant bugs."""

    def __init__(self, seed: int, config: SimConfig | None = None,
                 table_cls: type[JobTable] = JobTable, node_cls: type[JobNode] = JobNode,
                 receiver_cls: type[blobxfer.Receiver] = blobxfer.Receiver) -> None:
        self.seed = seed
        self.cfg = config or SimConfig()
        self.rng = random.Random(seed)
        self.table_cls = table_cls
        self.node_cls = node_cls
        self._effects = self._effect_table()
        self.now = T0_MS
        self.step_no = 0
        self.faulty = True
        self.counts: dict[str, int] = {}
        self._heap: list = []
        self._seq = 0
        self.members = {n: _Member(n, "voter" if n in VOTERS else "worker") for n in MEMBERS}
        self.blobs: dict[str, set[str]] = {n: set() for n in MEMBERS}  # durable over crashes
        self.xfers = _Xfers(self, receiver_cls) if self.cfg.xfer else None
        self.cuts: dict[int, frozenset] = {}  # partition id -> pairs of members cut apart
        self.keep_jobs = self.rng.choice([None, None, 20])
        if self.cfg.keep_s is not None:
            self.keep_jobs = None  # an expiry for room would not be one of age
        self.ended_at: dict[str, int] = {}  # finished job -> when the batch that ended it was proposed
        self.proposed_ms = 0  # when the entry being committed was proposed
        # Raft, modelled.
        self.term = 0
        self.leader: str | None = None
        self.ready_pos = 0
        self.election_at = self.now
        self.believes: dict[str, int] = {}  # deposed leader -> until when it believes it leads
        # Proposed, not committed: (entry, commit at, proposed at).
        self.tail: list[tuple[bytes, int, int]] = []
        self.log: list[tuple[int, bytes]] = []  # committed: (index, entry)
        self.last_index = 0
        # The oracle: a table that applies the committed log as it commits.
        self.oracle = table_cls()
        self.oracle_hash = table_digest(self.oracle)
        self.ref_hash: dict[int, bytes] = {}  # table index -> the first digest seen there
        self.accepted: dict[tuple[str, int, int], int] = {}
        self.max_epoch: dict[tuple[str, int], int] = {}
        self.ever_forgotten: set[str] = set()
        self.ever_cancelled: set[str] = set()  # jobs a committed cancel ever ended
        self.ended: dict[str, str] = {}  # job id -> the state it ended in (ids are never reused)
        # Placed jobs -> (selector, fan-out members) as their committed submit said: what every
        # committed lease of them is checked against (kept apart from the table under test).
        self.placed: dict[str, tuple[str, list[str] | None]] = {}
        # Re-runs: jobs rerun at least once (their first end is what `ended` keeps), and each
        # job's committed automatic restarts.
        self.rerun_ids: set[str] = set()
        self.restarts: dict[str, int] = {}
        # Each job's committed automatic re-runs (restart and resubmit): their entry times.
        self.auto_times: dict[str, list[int]] = {}
        # Clients.
        self.clients: list[_Client] = []
        self.waiting: dict[tuple, _Client] = {}
        self.asked: dict[tuple, dict] = {}  # (member, inc, token) -> request, until answered
        self.sent_ms: dict[tuple, int] = {}  # (member, inc, token) -> when a client sent it
        self.answered: set[tuple] = set()
        self.acked: dict[str, int] = {}  # acknowledged job id -> its client
        self.probes: set[tuple] = set()  # requests that reuse a key: each must be refused
        self.meddles: set[tuple] = set()  # changes of another submitter's job: each refused
        self.owners: dict[str, str] = {}  # committed job id -> its submitter
        self.gone: set[str] = set()  # members lost for good
        self.heard: dict[tuple[str, str], int] = {}  # (worker, voter) -> last F_JOB_STATE from it
        # Request id -> the request a member forwarded under it (F_CTL), as delivered.
        self.forwarded_reqs: dict[Any, Any] = {}
        self.probes_sent = 0
        # (worker, incarnation, leader, term) -> the furthest table position that leader's own
        # F_JOB_STATE frames of that term showed the worker (entries it has, or must get).
        self.shown: dict[tuple[str, int, str, int], int] = {}
        self.wiped: set[str] = set()  # blobs they held (a copy confirmed before the loss counts)
        # The operators' orders as the committed log says, kept here apart from the table (so
        # that a table that ignores one is caught): (pool, member or "*") held or drained, and
        # members drained.
        self.held: set[tuple[str, str]] = set()
        self.pool_drains: set[tuple[str, str]] = set()
        self.member_drains: set[str] = set()
        self.orders_sent = 0
        self.orders_lift_ms = 0
        # Stop orders as the committed log says: member -> the boot a stop in force names, and
        # every (member, boot) a committed stop ever named.
        self.stopped: dict[str, str] = {}
        self.stop_boots: set[tuple[str, str]] = set()
        self.slots_lift_ms = 0
        # Schedules: their clients, each (schedule, due time) settled and how, the last due
        # time each settled, and when the fleet was healed.
        self.cron_clients: list[_CronClient] = []
        self.cron_settled: dict[tuple[str, int], str] = {}
        self.cron_last: dict[str, tuple[int, int]] = {}
        self.healed_ms: int | None = None
        # Results: when each run's end reached its member, and when the reign began.
        self.run_ended_ms: dict[tuple[str, int, int], int] = {}
        self.reign_ms = self.now
        self.next_leader_kill_ms = self.now + self.cfg.leader_kills_ms[1]
        for i in range(self.cfg.cron):
            spec = f"@every {self.rng.choice([1, 2, 3, 5])}s"
            name = f"c{i}"
            self.cron_clients.append(_CronClient(name, {
                "op": "cron", "action": "add", "name": name, "spec": spec,
                "job": {"argv": ["cron", name]}, "catch_up": self.rng.choice(["latest", "none"]),
                "overlap": self.rng.choice(["allow", "skip"])}))
        for name in MEMBERS:
            self._start(self.members[name])

    # --- plumbing ---------------------------------------------------------------------------

    def fail(self, what: str) -> None:
        raise SimFailure(self.seed, self.step_no, self.now, what)

    def count(self, name: str, n: int = 1) -> None:
        self.counts[name] = self.counts.get(name, 0) + n

    def _at(self, t: int, kind: str, payload: Any) -> int:
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq, kind, payload))
        return self._seq

    def _between(self, r: tuple[int, int]) -> int:
        return self.rng.randint(r[0], r[1])

    def _reachable(self, a: str, b: str) -> bool:
        if not (self.members[a].alive and self.members[b].alive):
            return False
        if self.faulty and (a in self.cfg.silent or b in self.cfg.silent
                            or (a, b) in self.cfg.cut or (b, a) in self.cfg.cut):
            return False
        pair = frozenset((a, b))
        return all(pair not in cut for cut in self.cuts.values())

    def _has_majority(self, v: str) -> bool:
        votes = 1 + sum(1 for o in VOTERS if o != v and self._reachable(v, o))
        return self.members[v].alive and votes * 2 > len(VOTERS)

    # --- members ------------------------------------------------------------------------------

    def _start(self, m: _Member) -> None:
        if m.alive:
            raise AssertionError(f"{m.name} started twice")
        m.inc += 1
        m.inbox, m.applied, m.running, m.links, m.view_sent = [], [], {}, {}, None
        m.cut = set()
        m.reign_ms, m.reports = None, {}
        m.caught_up = False
        m.boot = f"{m.name}.{m.inc}.{self.rng.getrandbits(32):08x}"
        m.mono_ms = T0_MS - int(m.boot.rsplit(".", 1)[1], 16)  # not drawn: seeds replay as they did
        m.dumping = False
        if m.role == "voter":
            table = self._voter_table(m)
            if m.dump is not None:
                m.inbox.append(DumpReady(m.dump[0]))  # its dump file, there at start
        else:
            table = self.table_cls()
            m.inbox.append(View())  # a worker's replica has no Raft: one empty view at start
        pools = {"default": Pool("default", slots=2)}
        if self.cfg.worker_pool and m.role == "worker":
            pools[WORKER_POOL] = Pool(WORKER_POOL, slots=1)
        cfg = NodeConfig(member=m.name, boot=m.boot, pools=pools,
                         keep_jobs=self.keep_jobs, keep_s=self.cfg.keep_s, role=m.role,
                         voters=VOTERS,
                         dead_ms=limits.member_dead_ms, blob_copies=2, lost_ms=self.cfg.lost_ms)
        m.table = table
        m.node = self.node_cls(table, cfg, random.Random(self.rng.getrandbits(64)))
        m.alive = True
        m.checked_index = -1

    def _voter_table(self, m: _Member) -> JobTable:
        """A restarted voter replays its journal: from the start, or from a snapshot (a dump
        taken at some earlier position) and then the rest, as pysyncobj does."""
        start = 0
        table = self.table_cls()
        if m.pos and self.rng.random() < 0.5:
            start = self.rng.randint(1, m.pos)
            for index, raw in self.log[:start]:
                table.apply(_unpack(raw), index)
            table = self.table_cls.from_state(_unpack(_pack(table.to_state())))
            self.count("restarts_from_snapshot")
        for index, raw in self.log[start:m.pos]:
            entry = _unpack(raw)
            prev = table.applied_index
            m.applied.append(Applied(index, entry, table.apply(entry, index), prev))
        return table

    def _crash(self, m: _Member, why: str = "crashes_") -> None:
        self.count(why + m.role)
        m.alive = False
        m.exiting = False
        m.node = m.table = m.view_sent = None
        m.inbox, m.applied, m.running, m.links = [], [], {}, {}
        m.pressure = m.disk_full = m.disk_known = False
        self.believes.pop(m.name, None)
        self._at(self.now + self._between(self.cfg.restart_ms), "restart", m.name)

    def _step_member(self, m: _Member) -> None:
        node = m.node
        if m.role == "voter":
            view = self._voter_view(m)
            if view != m.view_sent:
                led = m.view_sent is not None and m.view_sent.is_leader
                m.view_sent = view
                node.step(view)
                if view.is_leader and not led:
                    m.reign_ms = self.now  # its reign begins at this round's tick
                elif not view.is_leader:
                    m.reign_ms = None
        node.step(Tick(self.now + dict(self.cfg.clocks).get(m.name, 0), self.now - m.mono_ms))
        applied, m.applied = m.applied, []
        for a in applied:
            node.step(a)
        inbox, m.inbox = m.inbox, []
        for ev in inbox:
            node.step(ev)
            if isinstance(ev, DiskFull):
                m.disk_known = ev.on
            elif isinstance(ev, FrameIn) and ev.ftype == "F_JOB_HAVE":
                m.reports[ev.peer] = self.now
            elif isinstance(ev, FrameIn) and ev.ftype == "F_CTL" and isinstance(ev.body, dict):
                self.forwarded_reqs[ev.body.get("rid")] = ev.body.get("req")
        advance(node.ready(), persist=lambda entry: self._persist(m, entry),
                sync=lambda: self._sync(m), release=lambda eff: self._effect(m, eff))
        if m.exiting:
            self._crash(m, "stop_exits_")  # its meshd exits; started again later

    def _persist(self, m: _Member, entry: dict) -> None:
        if m.disk_known:
            # A member whose disk is full takes no work: as leader it leases nothing to
            # itself (it learned of its disk before this round).
            for sub in entry.get("es", ()):
                if sub.get("k") == "lease" and any(g[2] == m.name for g in sub["g"]):
                    self.fail(f"{m.name} leased items to itself while its disk is full")
        for sub in entry.get("es", ()):
            if sub.get("k") == "submit" and "on" in sub:
                self._check_heard(m, f"proposed fan-out {sub.get('id')} on {sub['on']}")
        m.unsynced = True
        self._propose(m, entry)

    def _sync(self, m: _Member) -> None:
        m.unsynced = False

    def _effect(self, m: _Member, eff: Any) -> None:
        if m.unsynced and isinstance(eff, AFTER_SYNC) and not (
                isinstance(eff, Reply) and eff.answer.status == 400):
            self.fail(f"{m.name} let {type(eff).__name__} leave before the entries it logged "
                      f"this round were synced")
        if isinstance(eff, Reply) and m.node.view.is_leader:
            self._check_final(m, self.asked.get((m.name, m.inc, eff.token)), eff.answer)
        elif isinstance(eff, Send) and eff.ftype == "F_CTL_REPLY" and isinstance(eff.body, dict):
            self._check_final(m, self.forwarded_reqs.get(eff.body.get("rid")),
                              Answer(eff.body.get("status"), eff.body.get("body")))
        dispatch(eff, self._effects, m)

    # --- a new leader's first moments (node/heard.py) -----------------------------------------

    def _heard_all(self, m: _Member) -> str | None:
        """Has leader `m` heard from the fleet, as the simulator gave it reports? None when it
        has; else what it still waits for."""
        since = m.reign_ms
        if since is None or self.now - since >= limits.member_dead_ms:
            return None
        expected = set(VOTERS) | m.table.members_named()
        expected.update(p for p, t in m.reports.items() if t >= since - self.cfg.lost_ms)
        missing = sorted(p for p in expected - {m.name} if m.reports.get(p, -1) < since)
        if not missing:
            return None
        return (f"{self.now - since} ms into its reign, not yet heard from {missing} "
                "in it")

    def _check_heard(self, m: _Member, what: str) -> None:
        waits = self._heard_all(m)
        if waits is not None:
            self.fail(f"leader {m.name} {what}, {waits}")
        self.count("heard_checked")

    def _check_final(self, m: _Member, req: Any, answer: Answer) -> None:
        """No final "unknown pool" or "no member" from a leader that has not heard from the
        fleet yet (it may only not have heard yet)."""
        if not isinstance(req, dict) or not isinstance(answer.body, dict):
            return
        op, status, words = req.get("op"), answer.status, str(answer.body.get("error", ""))
        final = ((op in ("submit", "cron") and status == 400 and "unknown pool" in words)
                 or (op in ("pool", "member") and status == 404
                     and ("unknown pool" in words or "no member" in words))
                 or (op == "member" and status == 409 and "has not reported" in words))
        if final:
            self._check_heard(m, f"answered {op} {status} {words!r}")
            self.count("final_unknowns_checked")
        elif status == 503 and answer.body.get("not_known_yet") is True:
            self.count("not_known_yet_answers")

    def _effect_table(self) -> dict[type, Callable[[Any, _Member], None]]:
        """What the simulated edge does with each effect a member's node releases."""
        return {
            Reply: lambda eff, m: self._reply(m, eff.token, eff.answer),
            Send: lambda eff, m: self._send(m, eff),
            Run: lambda eff, m: self._run(m, eff),
            Cut: self._cut,
            CopyBlobs: self._copy,
            FetchBlobs: self._fetch,
            Pin: lambda eff, m: self.count("pins"),
            Unpin: lambda eff, m: self.count("pins"),
            UnpinAllBut: lambda eff, m: self.count("pins"),
            Notify: lambda eff, m: self.count("notices"),
            Exit: self._exit,
            SendDump: self._send_dump,
            WantDump: lambda eff, m: self._start_dump(m),
        }

    def _start_dump(self, m: _Member) -> None:
        """A voter's dump writer starts: its table now, ready some time later (a fork's copy)."""
        if m.dumping or not m.alive or m.role != "voter":
            return
        m.dumping = True
        state = _unpack(_pack(m.table.to_state()))
        pos = m.table.applied_index
        body = dumpbytes.payload(state, (b"", pos, self.term), (b"", max(0, pos - 1), self.term),
                                 [])
        self._at(self.now + self.rng.randint(20, 2_000), "dumped",
                 (m.name, m.inc, pos, dumpbytes.header(body) + body))
        self.count("dumps_started")

    def _send_dump(self, eff: SendDump, m: _Member) -> None:
        """What the jobs thread's sender does: the latest dump file, with the node's body."""
        if m.dump is None:
            self.fail(f"{m.name} sent a dump to {eff.to} but has none")
        if m.dump[0] < eff.body["prev"]:
            self.fail(f"{m.name} sent a dump at {m.dump[0]} for one at {eff.body['prev']}")
        self.count("dumps_sent")
        self._send(m, Send(eff.to, "F_JOB_STATE", {**eff.body, "dump": m.dump[1]}, table=True))

    def _cut(self, eff: Cut, m: _Member) -> None:
        key = (eff.job_id, eff.index, eff.epoch)
        if m.running.pop(key, None) is None:
            self.count("cuts_idle")
            return
        self.count("cuts")
        m.cut.add(key)
        end = ItemEnded(eff.job_id, eff.index, eff.epoch, "cut", None, 15, None, None,
                        self.now, self.now)
        m.running[key] = self._at(self.now + self.rng.randint(1, 50), "end",
                                  (m.name, m.inc, end))

    def _copy(self, eff: CopyBlobs, m: _Member) -> None:
        self.count("copies_asked")
        missing = [d for d in eff.digests if d not in self.blobs[m.name]]
        if missing:
            self.fail(f"{m.name} asked to copy blobs it does not hold: {missing[:2]}")
        if self.xfers is not None and self.xfers.copy(m, eff):
            return
        if self._reachable(m.name, eff.to) and not (self.faulty and
                                                    self.rng.random() < self.cfg.frame_drop):
            self._at(self.now + self.rng.randint(5, 400), "copied",
                     (m.name, m.inc, eff.to, self.members[eff.to].inc, eff.digests))

    def _fetch(self, eff: FetchBlobs, m: _Member) -> None:
        self.count("fetches_asked")
        if any(self._reachable(m.name, n) and set(eff.digests) <= self.blobs[n]
               for n in MEMBERS) and not (self.faulty and self.rng.random() < self.cfg.frame_drop):
            self._at(self.now + self.rng.randint(5, 400), "fetched",
                     (m.name, m.inc, eff.digests))

    def _exit(self, eff: Exit, m: _Member) -> None:
        if not self.cfg.stops:
            self.fail(f"{m.name} exits, though the simulator orders no member to stop")
        if (m.name, m.boot) not in self.stop_boots:
            self.fail(f"{m.name} exits ({eff.why}), but no committed stop names its boot "
                      f"{m.boot}")
        m.exiting = True

    # --- Raft, modelled -----------------------------------------------------------------------

    def _propose(self, m: _Member, entry: dict) -> None:
        if m.role != "voter":
            self.fail(f"worker {m.name} proposed {entry!r}")
        raw = _pack(entry)
        if len(raw) > limits.entry_bytes_max:
            self.fail(f"{m.name} proposed an entry of {len(raw)} bytes")
        if m.name != self.leader:
            self.count("proposals_not_leader")  # a deposed leader's: never committed
            return
        if self.faulty and self.rng.random() < self.cfg.proposal_lost:
            self.count("proposals_lost")
            return
        at = max(self.tail[-1][1] if self.tail else 0, self.now + self.rng.randint(1, 30))
        self.tail.append((raw, at, self.now))

    def _depose(self) -> None:
        old = self.leader
        self.leader = None
        self.election_at = self.now + self._between(self.cfg.election_ms)
        self.count("depositions")
        if old is not None and self.members[old].alive:
            self.believes[old] = self.now + self._between(self.cfg.fallback_ms)

    def _elect(self) -> None:
        candidates = [v for v in VOTERS if self._has_majority(v)]
        if not candidates:
            self.election_at = self.now + self._between(self.cfg.election_ms)
            return
        leader = self.rng.choice(candidates)
        if self.cfg.clocks:
            self.count("elected_" + leader)
        self.term += self.rng.randint(1, 2)
        self.reign_ms = self.now  # (what of the old tail it keeps commits in its reign)
        keep = self.rng.randint(0, len(self.tail))
        for raw, _at, proposed in self.tail[:keep]:
            self._commit(raw, proposed)
        self.count("proposals_lost_at_election", len(self.tail) - keep)
        self.tail = []
        self.last_index += 1  # the new leader's no-op
        self.ready_pos = len(self.log)
        self.leader = leader
        self.believes.pop(leader, None)
        self.count("elections")
        if self.cfg.worker_pool:
            for _ in range(self.rng.randint(1, 3)):
                self._at(self.now + self.rng.randint(0, 1_500), "probe", None)

    def _commit(self, raw: bytes, proposed: int) -> None:
        self.last_index += 1 if self.rng.random() < 0.8 else self.rng.randint(2, 4)
        self.log.append((self.last_index, raw))
        self.proposed_ms = proposed
        self._oracle_apply(_unpack(raw), self.last_index)

    def _voter_view(self, m: _Member) -> View:
        lead = self.leader
        if lead == m.name:
            return View(self.term, lead, True, m.pos >= self.ready_pos)
        if lead is not None and self._reachable(m.name, lead):
            return View(self.term, lead, False, False)
        last = m.view_sent or View()
        if self.believes.get(m.name, 0) > self.now and last.is_leader:
            return last
        return View(last.term, None, False, False)

    def _raft(self) -> None:
        if self.leader is not None and not self._has_majority(self.leader):
            self._depose()
        if self.leader is None and self.now >= self.election_at:
            self._elect()
        if self.leader is None:
            return
        while self.tail and self.tail[0][1] <= self.now:
            raw, _at, proposed = self.tail.pop(0)
            self._commit(raw, proposed)
        for v in VOTERS:
            m = self.members[v]
            if not m.alive or not (v == self.leader or self._reachable(v, self.leader)):
                continue
            left = len(self.log) - m.pos
            if left <= 0:
                continue
            n = left if self.rng.random() < self.cfg.apply_all else self.rng.randint(0, left)
            for index, raw in self.log[m.pos:m.pos + n]:
                entry = _unpack(raw)
                prev = m.table.applied_index
                m.applied.append(Applied(index, entry, m.table.apply(entry, index), prev))
            m.pos += n

    # --- the oracle's checks, entry by entry --------------------------------------------------

    def _oracle_apply(self, entry: Any, index: int) -> None:
        t = self.oracle
        kind = entry.get("k") if isinstance(entry, dict) else None
        ids_before = set(t.jobs)
        # A batch entry carries several changes; the checks look at each, as it is applied.
        stack: list[tuple[list, list, dict]] = []

        def observe(sub: Any, outcome: dict | None) -> None:
            if outcome is None:
                stack.append(self._rows_before(sub))
            else:
                self._check_entry(sub, index, outcome, *stack.pop())

        if kind == "batch":
            t.observe = observe
            try:
                t.apply(entry, index)
            finally:
                t.observe = None
        else:
            rows = self._rows_before(entry)
            self._check_entry(entry, index, t.apply(entry, index), *rows)
        self.count("entries_" + str(kind))
        self._check_deps(index)
        try:
            t.check()
        except AssertionError as e:
            self.fail(f"oracle table broken after entry {index} {kind}: {e}")
        if self.cfg.quota:
            leased = sum(st == LEASED for job in t.jobs.values()
                         if job.submitted_by == QUOTA_USER for st in job.st)
            if leased > self.cfg.quota:
                self.fail(f"{leased} items of {QUOTA_USER}'s jobs leased at index {index}, over "
                          f"its running_items_max of {self.cfg.quota}")
            if leased == self.cfg.quota:
                self.count("quota_running_at_limit")
        for jid in sorted(set(t.jobs) - ids_before):
            self.owners[jid] = t.jobs[jid].submitted_by
            if jid in self.ever_forgotten:
                self.fail(f"forgotten job {jid} came back at index {index}")
            self._check_copies(index, [d.hex() for d in t.jobs[jid].stdin if d is not None])
        for jid in sorted(set(t.forgotten) - self.ever_forgotten):
            self.ever_forgotten.add(jid)
            self.count("jobs_forgotten")
        self.ever_cancelled.update(jid for jid, job in t.jobs.items() if job.cancelled)
        if any(jid in self.ever_forgotten for jid in t.jobs):
            self.fail("a forgotten job is in the table again")
        self.oracle_hash = table_digest(t)

    def _rows_before(self, e: Any) -> tuple[list, list, dict]:
        """The item rows an entry names (leases, results, revokes), its result rows, and the
        state of those items before it is applied."""
        rows: list[list] = []
        results: list[list] = []
        field_ = {"result": "r", "lease": "g", "revoke": "l"}.get(
            e.get("k") if isinstance(e, dict) else None)
        if field_ is not None and isinstance(e.get(field_), list):
            rows = [r for r in e[field_] if isinstance(r, list) and len(r) >= 3
                    and isinstance(r[0], str) and type(r[1]) is int]
            if field_ == "r":
                results = rows
        before = {(r[0], r[1]): self._item((r[0], r[1])) for r in rows}
        if isinstance(e, dict) and e.get("k") == "rerun" and e.get("id") in self.oracle.jobs:
            # Every item of a job run again: the check compares each before and after.
            job = self.oracle.jobs[e["id"]]
            before = {(job.id, i): self._item((job.id, i)) for i in range(job.n)}
        return rows, results, before

    def _note_ends(self) -> None:
        for jid, job in self.oracle.jobs.items():
            if job.finished and jid not in self.ended:
                self.ended[jid] = job.state

    def _check_deps(self, index: int) -> None:
        """Each dependent against its parents' ends: it starts only once every condition holds,
        waits only while a parent has not ended and none has failed it, and ends dep_failed
        only when one can no longer hold."""
        for jid, job in self.oracle.jobs.items():
            if not job.after or any(d["id"] in self.rerun_ids for d in job.after):
                continue  # a parent run again: `ended` holds its first end only
            open_, bad = [], []
            for d in job.after:
                end = self.ended.get(d["id"])
                if end is None:
                    open_.append(d["id"])
                elif end not in {"ok": ("done",), "end": FINAL_STATES,
                                 "fail": ("failed", "cancelled", "dep_failed")}[d["on"]]:
                    bad.append(f"{d['id']} ended {end}, not {d['on']}")
            state = job.state
            if state == "dep_failed":
                if not bad:
                    self.fail(f"entry {index}: {jid} ended dep_failed, but no condition of "
                              f"{job.after} became impossible")
                continue
            if state == "cancelled" and not job.started:
                continue
            if job.started and (open_ or bad):
                self.fail(f"entry {index}: {jid} started before its parents allowed: "
                          f"{bad or ('waits on ' + ', '.join(open_))}")
            if state == "waiting" and (bad or not open_):
                self.fail(f"entry {index}: {jid} still waits, its parents {job.after} having "
                          f"ended ({bad or 'all as asked'})")
            if state not in ("waiting", "cancelled") and (open_ or bad):
                self.fail(f"entry {index}: {jid} is {state}, its parents not allowing it: "
                          f"{bad or ('waits on ' + ', '.join(open_))}")
            self.count("deps_checked")

    def _check_entry(self, e: Any, index: int, outcome: dict, rows: list, results: list,
                     before: dict) -> None:
        self._note_ends()
        if self.cfg.place:
            self._check_placement(e, index, outcome, rows)
        if self.cfg.orders and isinstance(e, dict):
            self._check_orders(e, index, outcome, before)
        if self.cfg.stops and isinstance(e, dict):
            self._check_stops(e, index, outcome)
        if isinstance(e, dict) and e.get("k") == "pool" and e.get("a") == "slots" \
                and outcome.get("ok"):
            self.count("slots_orders_committed")
        if isinstance(e, dict) and e.get("k") == "cron" and e.get("op") == "fire" \
                and outcome.get("ok"):
            self._check_fire(e, index, outcome)
        if results:
            self._check_results(results, index, before,
                                outcome if isinstance(e, dict) and e.get("k") == "result" else None)
        self._check_rerun(e, index, outcome, before)
        self._check_attempts(before, index)
        self._check_owner(e, index, outcome)
        if self.cfg.keep_s is not None:
            self._check_retention(e, index, outcome)
        for key in sorted(before, key=repr):
            after = self._item(key)
            if after is None:
                continue
            epoch = after[1]
            if epoch < self.max_epoch.get(key, 0):
                self.fail(f"lease epoch of {key} went back from {self.max_epoch[key]} to {epoch}")
            self.max_epoch[key] = epoch

    def _check_attempts(self, keys: dict, index: int) -> None:
        """Every item an entry touched keeps why each of its earlier attempts ended, in order:
        attempts 1..a-1 while attempt a is leased or has its result, 1..a once it waits for a
        lease again (the last limits.item_attempts_kept_max of them)."""
        for jid, i in keys:
            job = self.oracle.jobs.get(jid)
            if job is None or not 0 <= i < job.n:
                continue
            a, st = job.attempts[i], job.st[i]
            kept = [k[0] for k in (job.tries or {}).get(i, ())]
            last = a if st == PENDING else a - 1 if st != CANCELLED else (
                kept[-1] if kept and kept[-1] == a else max(a - 1, 0))
            want = list(range(max(1, last - limits.item_attempts_kept_max + 1), last + 1))
            if kept != want:
                self.fail(f"entry {index}: {jid}[{i}] at attempt {a} "
                          f"({ITEM_STATE_NAMES[st]}) keeps the reasons of attempts {kept}, "
                          f"not {want}")
            self.count("attempts_checked")

    def _check_retention(self, e: Any, index: int, outcome: dict) -> None:
        """A job is expired only once keep_s has passed, in the simulator's own time, since the
        batch that ended it was proposed: whatever the wall clocks of the leaders that ended
        it and expire it say (table.py Rule 7)."""
        for jid, job in self.oracle.jobs.items():
            if job.finished:
                self.ended_at.setdefault(jid, self.proposed_ms)
            else:
                self.ended_at.pop(jid, None)  # run again: its next end counts
        if not (isinstance(e, dict) and e.get("k") == "expire" and outcome.get("ok")):
            return
        assert self.cfg.keep_s is not None
        for jid in outcome["expired"]:
            age = self.proposed_ms - self.ended_at.pop(jid)
            if age < self.cfg.keep_s * 1000:
                self.fail(f"entry {index} expired job {jid} {age} ms after the batch that ended "
                          f"it was proposed, before keep_s ({self.cfg.keep_s} s)")
            self.count("expiries_checked")

    def _check_owner(self, e: Any, index: int, outcome: dict) -> None:
        """A committed change of one job by an identity (its `by` and role `br`) changes it
        only when that identity submitted it or is an admin; else it is refused, not_owner."""
        if not isinstance(e, dict) or not isinstance(e.get("by"), str) or \
                not isinstance(e.get("id"), str):
            return
        owner = self.owners.get(e["id"])
        if owner is None or owner == e["by"] or e.get("br") == "admin":
            return
        if outcome.get("ok"):
            self.fail(f"entry {index} ({e.get('k')}) by {e['by']} ({e.get('br')}) changed job "
                      f"{e['id']} of {owner}")
        if outcome.get("reason") == "not_owner":
            self.count("changes_refused_not_owner")

    def _check_placement(self, e: Any, index: int, outcome: dict, rows: list) -> None:
        """Every item of a placed job is leased only to a member its selector matches, and a
        fan-out's item only to its own member (as the committed submit named them)."""
        kind = e.get("k") if isinstance(e, dict) else None
        if kind == "submit" and outcome.get("new") and isinstance(e.get("spec"), dict):
            sel = e["spec"].get("member")
            if isinstance(sel, str):
                self.placed[e["id"]] = (sel, list(e["on"]) if isinstance(e.get("on"), list) else None)
            return
        if kind != "lease":
            return
        for r in rows:
            job = self.oracle.jobs.get(r[0])
            i = r[1]
            if (job is None or r[0] not in self.placed or not 0 <= i < job.n
                    or job.st[i] != LEASED or job.epoch[i] != index):
                continue
            sel, pins = self.placed[r[0]]
            member = job.member[i]
            if pins is not None and (i >= len(pins) or member != pins[i]):
                self.fail(f"lease entry {index} gave fan-out item {r[0]}[{i}] to {member}, "
                          f"not its own member {pins[i] if i < len(pins) else '(none)'}")
            if member is None or not placement.matches(sel, member):
                self.fail(f"lease entry {index} gave {r[0]}[{i}] to {member}, which its "
                          f"member selector {sel!r} does not match")
            self.count("placements_checked")
    def _check_orders(self, e: dict, index: int, outcome: dict, before: dict) -> None:
        """No lease is committed to a drained member, or in a pool held or drained (on that
        member or everywhere), after the entry that ordered it."""
        kind = e.get("k")
        if kind == "pool" and outcome.get("ok"):
            key = (e["pool"], e.get("member") or "*")
            book = self.held if e["a"] in ("hold", "release") else self.pool_drains
            if e["a"] in ("hold", "drain"):
                book.add(key)
            elif e.get("member") is None:
                for k in [k for k in book if k[0] == e["pool"]]:
                    book.discard(k)
            else:
                book.discard(key)
            self.count("orders_committed")
        elif kind == "member" and outcome.get("ok"):
            if e["a"] == "drain":
                self.member_drains.add(e["name"])
            elif e["a"] == "undrain":
                self.member_drains.discard(e["name"])
            self.count("orders_committed")
        elif kind == "lease":
            for g in e.get("g") or ():
                after = self._item((g[0], g[1]))
                if after is None or after[0] != LEASED or after[1] != index:
                    continue  # not granted by this entry
                pool = self.oracle.jobs[g[0]].pool
                why = ("member drained" if g[2] in self.member_drains
                       else "pool held" if {(pool, "*"), (pool, g[2])} & self.held
                       else "pool drained" if {(pool, "*"), (pool, g[2])} & self.pool_drains
                       else None)
                if why is not None:
                    self.fail(f"entry {index} leased {g[0]}[{g[1]}] to {g[2]} in pool {pool}: "
                              f"{why} by a committed order")
                self.count("order_leases_checked")

    def _orders(self) -> None:
        """An operator's order now and then (while faulty); after healing, every order lifted
        (sent again every second until the log shows none in force)."""
        rng = self.rng
        if self.faulty:
            if rng.random() >= self.cfg.orders:
                return
            member = rng.choice([None, *MEMBERS])
            if rng.random() < 0.6:
                req: dict[str, Any] = {"op": "pool", "action": rng.choice(
                    ["hold", "release", "drain", "undrain"]), "pool": "default", "member": member}
            else:
                req = {"op": "member", "action": rng.choice(["drain", "undrain"]),
                       "name": member or MEMBERS[0], "grace_s": None}
            self._order(req)
            return
        if not (self.held or self.pool_drains or self.member_drains) or self.now < self.orders_lift_ms:
            return
        self.orders_lift_ms = self.now + 1_000
        self._order({"op": "pool", "action": "release", "pool": "default", "member": None})
        self._order({"op": "pool", "action": "undrain", "pool": "default", "member": None})
        for name in sorted(self.member_drains):
            self._order({"op": "member", "action": "undrain", "name": name, "grace_s": None})

    def _check_stops(self, e: dict, index: int, outcome: dict) -> None:
        """No lease is committed to a member's incarnation after a stop naming it (until an
        undrain calls the stop off)."""
        kind = e.get("k")
        if kind == "member" and outcome.get("ok"):
            if e["a"] == "stop":
                self.stopped[e["name"]] = e["boot"]
                self.stop_boots.add((e["name"], e["boot"]))
                self.count("stops_committed")
            elif e["a"] == "undrain":
                self.stopped.pop(e["name"], None)
        elif kind == "lease":
            for g in e.get("g") or ():
                after = self._item((g[0], g[1]))
                if after is None or after[0] != LEASED or after[1] != index:
                    continue  # not granted by this entry
                if self.stopped.get(g[2]) == g[3]:
                    self.fail(f"entry {index} leased {g[0]}[{g[1]}] to {g[2]} (boot {g[3]}), "
                              "which a committed stop order names")
                self.count("stop_leases_checked")

    def _stops(self) -> None:
        """Now and then (while faulty) an operator orders a member to stop."""
        rng = self.rng
        if not self.faulty or rng.random() >= self.cfg.stops:
            return
        self._order({"op": "member", "action": "stop", "name": rng.choice(MEMBERS),
                     "grace_s": rng.choice([None, None, 0.0, 0.5, 3.0])})
        self.count("stops_sent")

    def _check_slots(self, m: _Member, key: tuple) -> None:
        """A member starts an item only while fewer items of the pool run there than its
        effective slots (pool "default", 2 slots; with `worker_pool`, "gpu" too, 1 slot)."""
        pool = m.table.jobs[key[0]].pool
        configured = m.node.cfg.pools[pool].slots
        n = m.table.ctl.slots_of(pool, m.name, configured)
        limit = n if n > 0 else configured
        jobs = m.table.jobs
        running = sum(1 for k in m.running if k not in m.cut
                      and getattr(jobs.get(k[0]), "pool", pool) == pool)
        if running >= limit:
            self.fail(f"{m.name} started {key} with {running} items running, its pool's "
                      f"effective slots being {n}")
        self.count("slot_starts_checked")

    def _slots(self) -> None:
        """Now and then (while faulty) an operator sets or resets the pool's slots; after
        healing, every override is reset (sent again every second until the log shows none)."""
        rng = self.rng
        if self.faulty:
            if rng.random() >= self.cfg.slots:
                return
            n = rng.choice([None, 0, 1, 1, 2, 3])
            self._order({"op": "pool", "action": "slots", "pool": "default",
                         "member": rng.choice([None, *MEMBERS]), "slots": n})
            self.count("slots_sent")
            return
        if self.oracle.ctl.slots and self.now >= self.slots_lift_ms:
            self.slots_lift_ms = self.now + 1_000
            self._order({"op": "pool", "action": "slots", "pool": "default", "member": None,
                         "slots": None})

    def _probe(self) -> None:
        """Right after an election, an operator asks about a worker or the pool only workers
        offer: harmless if done (an undrain of a member not drained, a release of a pool not
        held), and its answer from a new leader is checked (`_check_final`)."""
        rng = self.rng
        if rng.random() < 0.5:
            req: dict[str, Any] = {"op": "member", "action": "undrain",
                                   "name": rng.choice(WORKERS), "grace_s": None}
        else:
            req = {"op": "pool", "action": "release", "pool": WORKER_POOL, "member": None}
        self._order(req)
        self.count("probes_sent")

    def _order(self, req: dict) -> None:
        alive = [n for n in MEMBERS if self.members[n].alive]
        if not alive:
            return
        m = self.members[self.rng.choice(alive)]
        self.orders_sent += 1
        rid = f"o{self.orders_sent}"
        req = {**req, "rid": rid, "fp": _fp(rid)}
        m.tokens += 1
        key = (m.name, m.inc, m.tokens)
        self.asked[key] = req
        m.inbox.append(Ctl(m.tokens, req))
        self.count("orders_sent")
    def _check_fire(self, e: dict, index: int, outcome: dict) -> None:
        """A committed fire: its due time settled once, as the latest at its time stamp, its
        run under the id of name and due time; once settled after healing, none missed."""
        name, d, t = e["name"], e["due"], e["t"]
        c = self.oracle.crons.get(name)
        if c is None:
            self.fail(f"entry {index}: schedule {name} fired, but the table has no such schedule")
        how = "skipped" if outcome.get("skipped") else str(outcome.get("id"))
        key = (name, d)
        if key in self.cron_settled:
            self.fail(f"entry {index}: due time {d - T0_MS} of schedule {name} settled twice "
                      f"({self.cron_settled[key]}, then {how})")
        self.cron_settled[key] = how
        if c.sched.latest_upto(t) != d:
            self.fail(f"entry {index}: schedule {name} fired due time {d - T0_MS} at "
                      f"{t - T0_MS}, not the latest due then ({c.sched.latest_upto(t) - T0_MS}): "
                      "an older missed run (a burst)")
        if c.catch_up == "none" and t - d > limits.cron_late_ms_max:
            self.fail(f"entry {index}: schedule {name} (catch-up none) fired a run "
                      f"{t - d} ms late")
        if not outcome.get("skipped"):
            want = cron.run_id(name, d)
            if outcome.get("id") != want or want not in self.oracle.jobs:
                self.fail(f"entry {index}: schedule {name}'s run due at {d - T0_MS} made as "
                          f"{outcome.get('id')}, not {want}")
            self.count("cron_runs")
        prev = self.cron_last.get(name)
        if prev is not None and d != c.sched.next_after(prev[0]):
            self.count("cron_catch_ups")  # due times missed (no leader), the latest fired
        settle = None if self.healed_ms is None else self.healed_ms + CRON_SETTLE_MS
        if prev is not None and settle is not None and prev[1] > settle and t > settle:
            if d != c.sched.next_after(prev[0]):
                self.fail(f"entry {index}: schedule {name} settled {d - T0_MS} after "
                          f"{prev[0] - T0_MS}, missing {c.sched.next_after(prev[0]) - T0_MS}, "
                          "though the fleet is healed")
            self.count("cron_gaps_checked")
        self.cron_last[name] = (d, t)
        self.count("cron_fires_checked")

    def _item(self, key: tuple[str, int]) -> tuple | None:
        job = self.oracle.jobs.get(key[0])
        if job is None or not 0 <= key[1] < job.n:
            return None
        i = key[1]
        return (job.st[i], job.epoch[i], job.fails[i], job.out[i], job.ended_ms[i])

    def _check_results(self, rows: list[list], index: int, before: dict,
                       outcome: dict | None) -> None:
        """Which items a result entry moved, from the items themselves: each must have been
        leased under the epoch of one of its rows, and no epoch gets two results."""
        accepted = 0
        for key in sorted({(r[0], r[1]) for r in rows}, key=repr):
            b, a = before[key], self._item(key)
            if b is None:
                continue
            if b[0] != LEASED:
                if a != b:
                    self.fail(f"result entry {index} changed {key}, which was not leased")
                continue
            if a is not None and a[0] == LEASED and a == b:
                continue  # refused
            epochs = [r[2] for r in rows if (r[0], r[1]) == key]
            if b[1] not in epochs:
                self.fail(f"result entry {index} accepted a stale result for {key}: "
                          f"result epochs {epochs}, lease epoch {b[1]}")
            k3 = (key[0], key[1], b[1])
            self.accepted[k3] = self.accepted.get(k3, 0) + 1
            if self.accepted[k3] > 1:
                self.fail(f"two accepted results for {k3}")
            ended_ms = self.run_ended_ms.pop(k3, None)
            if ended_ms is not None:
                waited = self.now - max(ended_ms, self.reign_ms)
                if waited > self.cfg.result_wait_ms_max:
                    self.fail(f"the result of {k3} committed {waited} ms after its run ended "
                              f"and the reign of {self.leader} began (over "
                              f"{self.cfg.result_wait_ms_max} ms): it waited for a resend")
                self.counts["results_waited_ms_max"] = max(
                    waited, self.counts.get("results_waited_ms_max", 0))
            row = next(r for r in rows if (r[0], r[1], r[2]) == k3)
            if len(row) >= 10:
                self._check_copies(index, [d.hex() for d in (row[6], row[7])
                                           if isinstance(d, bytes)])
            if len(row) == 11:
                job = self.oracle.jobs.get(key[0])
                if job is None or job.errors is None or job.errors.get(key[1]) != row[10]:
                    self.fail(f"result entry {index} accepted {k3} with error {row[10]!r}, "
                              "but the table does not keep it")
                self.count("results_with_error")
            accepted += 1
        if outcome is not None and outcome.get("accepted") != accepted:
            self.fail(f"result entry {index}: table says {outcome.get('accepted')} accepted, "
                      f"items show {accepted}")
        self.count("results_accepted", accepted)
        self.count("results_refused", len(rows) - accepted)

    def _check_copies(self, index: int, digests: list[str]) -> None:
        for d in digests:
            holders = sum(1 for n in MEMBERS if d in self.blobs[n]) + (d in self.wiped)
            if holders < 2:
                self.fail(f"entry {index} committed with blob {d[:12]} on {holders} member(s)")

    def _check_rerun(self, e: Any, index: int, outcome: dict, before: dict) -> None:
        """A committed rerun sends back to pending every item it names (all, or those that
        ended failed, timeout or cancelled) and leaves the others as they were; automatic
        restarts of a job never exceed its `restart`; every item has at most one accepted
        result per attempt."""
        if not (isinstance(e, dict) and e.get("k") == "rerun" and outcome.get("ok")):
            return
        jid = e["id"]
        job = self.oracle.jobs[jid]
        self.rerun_ids.add(jid)
        if job.finished:
            self.fail(f"entry {index}: job {jid} was rerun, yet it is still finished")
        for (_, i), b in sorted(before.items()):
            if b is None:
                continue
            again = not e.get("failed_only") or b[0] in (FAILED, TIMEOUT, CANCELLED)
            if again and job.st[i] != PENDING:
                self.fail(f"entry {index}: rerun of {jid} left item {i} "
                          f"{ITEM_STATE_NAMES[job.st[i]]}")
            if not again and job.st[i] != b[0]:
                self.fail(f"entry {index}: rerun of {jid} (failed only) changed item {i}")
            results = sum(n for (j, k, _), n in self.accepted.items() if j == jid and k == i)
            if results > job.attempts[i]:
                self.fail(f"{jid}[{i}] has {results} accepted results in {job.attempts[i]} "
                          "attempts")
        if e.get("auto") == "restart":
            n = self.restarts[jid] = self.restarts.get(jid, 0) + 1
            if job.restart != "forever" and n > (job.restart or 0):
                self.fail(f"entry {index}: job {jid} restarted {n} times; it asked for "
                          f"{job.restart}")
        if e.get("auto") is not None:
            # Restarts bounded (reruns.py Rule 6): never more than the cap in any minute.
            times = self.auto_times.setdefault(jid, [])
            times.append(e["t"])
            cap = limits.restarts_per_minute_max
            if len(times) > cap and times[-1] - times[-1 - cap] < limits.restarts_window_ms:
                self.fail(f"entry {index}: job {jid} re-ran automatically {cap + 1} times "
                          f"within {times[-1] - times[-1 - cap]} ms; the cap is {cap} a minute")
            self.count("rerun_caps_checked")
        self.count("reruns_checked")

    def _check_rerun_answer(self, m: _Member, req: dict, status: int, body: Any) -> None:
        """A rerun is answered 200 only once committed (the job has run again since), and an
        acknowledged, committed job is never answered 404."""
        jid = req["id"]
        job = self.oracle.jobs.get(jid)
        if status == 200 and (job is None and jid not in self.oracle.forgotten
                              or job is not None and job.run < 2):
            self.fail(f"{m.name} answered rerun of {jid} 200 before it was committed")
        if status == 404 and job is not None and jid in self.acked:
            self.fail(f"{m.name} answered rerun of acknowledged job {jid} 404")
        self.count(f"rerun_answers_{status}")

    # --- network, driver, blobs ---------------------------------------------------------------

    def _send(self, m: _Member, eff: Send) -> None:
        self.count("frames_sent")
        if eff.to not in self.members or eff.to == m.name:
            self.fail(f"{m.name} sent {eff.ftype} to {eff.to!r}")
        if not self._reachable(m.name, eff.to):
            self.count("frames_cut")
            return
        if self.faulty and self.rng.random() < self.cfg.frame_drop:
            self.count("frames_dropped")
            return
        raw = _pack(eff.body)
        dst = self.members[eff.to]
        copies = 2 if self.faulty and self.rng.random() < self.cfg.frame_dup else 1
        self.count("frames_duplicated", copies - 1)
        for _ in range(copies):
            delay = self.rng.randint(1, self.cfg.frame_delay_ms_max)
            if self.faulty and self.rng.random() < self.cfg.frame_late:
                delay = self.rng.randint(delay, self.cfg.frame_late_ms_max)
                self.count("frames_late")
            self._at(self.now + delay, "frame", (m.name, m.inc, dst.name, dst.inc, eff.ftype, raw))

    def _note_shown(self, d: _Member, src: str, body: Any) -> None:
        """The table position an F_JOB_STATE of the leader itself (`src`) shows worker `d`: a
        whole table's, or the last of the entries it carries (or where they would start)."""
        if d.role != "worker" or body.get("leader") != src:
            return  # a follower's hint of who leads shows no entries
        if "snapshot" in body:
            end = body["index"]
        elif "entries" in body:
            end = max([body["prev"]] + [e[0] for e in body["entries"]])
        else:
            return
        key = (d.name, d.inc, src, body["term"])
        self.shown[key] = max(self.shown.get(key, 0), end)

    def _new_blob(self, rng: random.Random) -> str:
        """A new blob's digest; with `xfer`, of real bytes the transfers carry."""
        if self.xfers is None:
            return rng.randbytes(32).hex()
        return self.xfers.new_blob(rng)

    def _run(self, m: _Member, eff: Run) -> None:
        key = (eff.job_id, eff.index, eff.epoch)
        if key in m.running:
            self.fail(f"{m.name} ran {key} twice")
        if self.cfg.slots:
            self._check_slots(m, key)
        if eff.stdin is not None and not any(eff.stdin in self.blobs[n] for n in MEMBERS):
            self.fail(f"{m.name} runs {key} whose input {eff.stdin[:12]} no member holds")
        self.count("runs")
        r = self.rng.random()
        state = "done" if r < 0.7 else "failed" if r < 0.92 else "timeout"
        rc = {"done": 0, "failed": self.rng.randint(1, 3), "timeout": None}[state]
        out: str | None = self._new_blob(self.rng)
        err = self._new_blob(self.rng) if self.rng.random() < 0.3 else None
        error = None
        if state == "failed" and self.rng.random() < 0.25:
            # The program could not start: no exit code, no outputs, and the driver's reason.
            rc, out, err = None, None, None
            error = f"no such program 'sim{self.rng.randint(0, 9)}' on member: fix the job's argv"
        start = self.now
        end = start + self._between(self.cfg.run_ms)
        ev = ItemEnded(eff.job_id, eff.index, eff.epoch, state, rc,
                       9 if state == "timeout" else None, out, err, start, end, error)
        m.running[key] = self._at(end, "end", (m.name, m.inc, ev))

    def _due(self) -> None:
        while self._heap and self._heap[0][0] <= self.now:
            _t, seq, kind, p = heapq.heappop(self._heap)
            if kind == "frame":
                src, src_inc, dst, dst_inc, ftype, raw = p
                s, d = self.members[src], self.members[dst]
                if s.inc != src_inc or d.inc != dst_inc or not self._reachable(src, dst):
                    self.count("frames_lost_in_flight")
                    continue
                d.inbox.append(FrameIn(src, ftype, _unpack(raw)))
                if ftype == "F_JOB_STATE":
                    self.heard[(dst, src)] = self.now
                    self._note_shown(d, src, _unpack(raw))
            elif kind == "end":
                name, inc, ev = p
                m = self.members[name]
                key = (ev.job_id, ev.index, ev.epoch)
                if m.inc != inc or not m.alive or m.running.get(key) != seq:
                    continue
                del m.running[key]
                m.cut.discard(key)
                # The driver writes the outputs to the blob store before it reports the end.
                self.blobs[name].update(d for d in (ev.stdout, ev.stderr) if d is not None)
                m.inbox.append(ev)
                if self.cfg.result_wait_ms_max and ev.state != "cut":
                    self.run_ended_ms[key] = self.now
            elif kind == "copied":
                src, src_inc, dst, dst_inc, digests = p
                if (self.members[dst].inc != dst_inc or self.members[src].inc != src_inc
                        or not self._reachable(src, dst)):
                    self.count("copies_lost")
                    continue
                self.blobs[dst].update(digests)
                self.members[src].inbox.append(BlobsCopied(dst, digests))
                self.count("copies_done")
            elif kind == "restart":
                if not self.members[p].alive and p not in self.gone:  # else healed already
                    self.count("restarts")
                    self._start(self.members[p])
            elif kind == "fetched":
                name, inc, digests = p
                if self.members[name].inc != inc or not self.members[name].alive:
                    continue
                self.blobs[name].update(digests)
                self.members[name].inbox.append(BlobsCopied(name, digests))
                self.count("fetches_done")
            elif kind == "heal":
                self.cuts.pop(p, None)
            elif kind == "dumped":
                name, inc, pos, data = p
                m = self.members[name]
                if m.inc == inc and m.alive and m.dumping:
                    m.dumping = False
                    m.dump = (pos, data)
                    m.inbox.append(DumpReady(pos))
                    self.count("dumps_written")
            elif kind == "probe":
                self._probe()
            elif kind in ("xframe", "xpump"):
                assert self.xfers is not None
                self.xfers.due(kind, p)
            elif kind == "disk_off":
                m = self.members[p[0]]
                if m.inc == p[1] and m.disk_full:
                    m.disk_full = False
                    m.inbox.append(DiskFull(False, 1 << 40))
            elif kind == "pressure_off":
                m = self.members[p[0]]
                if m.inc == p[1] and m.pressure:
                    m.pressure = False
                    m.inbox.append(Pressure(False))

    def _links(self) -> None:
        for m in self.members.values():
            if not m.alive:
                continue
            for peer in MEMBERS:
                if peer == m.name:
                    continue
                up = self._reachable(m.name, peer) or (
                    self.faulty and self.members[peer].alive
                    and (m.name in self.cfg.silent or peer in self.cfg.silent))
                if m.links.get(peer) != up:
                    m.links[peer] = up
                    m.inbox.append(PeerLink(peer, up))

    # --- faults -------------------------------------------------------------------------------

    def _faults(self) -> None:
        cfg, rng = self.cfg, self.rng
        if cfg.leader_kills_ms[1] and self.now >= self.next_leader_kill_ms:
            self.next_leader_kill_ms = self.now + self._between(cfg.leader_kills_ms)
            if self.leader is not None and self.members[self.leader].alive:
                self._crash(self.members[self.leader])
                self.count("leader_kills")
        if rng.random() < cfg.crash:
            alive = [n for n in MEMBERS if self.members[n].alive]
            if alive:
                self._crash(self.members[rng.choice(alive)])
        if rng.random() < cfg.partition:
            self._seq += 1
            if rng.random() < 0.5:
                lone = rng.choice(MEMBERS)
                pairs = frozenset(frozenset((lone, o)) for o in MEMBERS if o != lone)
            else:
                side = {n for n in MEMBERS if rng.random() < 0.5}
                pairs = frozenset(frozenset((a, b)) for a in MEMBERS for b in MEMBERS
                                  if a < b and (a in side) != (b in side))
            self.cuts[self._seq] = pairs
            self._at(self.now + self._between(cfg.partition_ms), "heal", self._seq)
            self.count("partitions")
        if rng.random() < cfg.pressure:
            m = self.members[rng.choice(MEMBERS)]
            if m.alive and not m.pressure:
                m.pressure = True
                m.inbox.append(Pressure(True))
                self._at(self.now + rng.randint(200, 5_000), "pressure_off", (m.name, m.inc))
                self.count("pressure")
        if cfg.dumps and rng.random() < cfg.dumps:
            self._start_dump(self.members[rng.choice(VOTERS)])
        if cfg.disk_full and rng.random() < cfg.disk_full:
            m = self.members[rng.choice(MEMBERS)]
            if m.alive and not m.disk_full:
                m.disk_full = True
                m.inbox.append(DiskFull(True, 0))
                self._at(self.now + rng.randint(200, 5_000), "disk_off", (m.name, m.inc))
                self.count("disk_full")

    def heal(self) -> None:
        """End every fault: no more drops, partitions, crashes or lost proposals."""
        self.faulty = False
        self.healed_ms = self.now
        self.cuts.clear()
        for m in self.members.values():
            if m.name in self.gone:
                continue
            if not m.alive:
                self.count("restarts")
                self._start(m)
            elif m.pressure:
                m.pressure = False
                m.inbox.append(Pressure(False))
            if m.alive and m.disk_full:
                m.disk_full = False
                m.inbox.append(DiskFull(False, 1 << 40))

    # --- clients ------------------------------------------------------------------------------

    def _new_client(self) -> None:
        rng = self.rng
        cid = len(self.clients)
        n = rng.randint(1, self.cfg.items_max)
        hold = rng.random() < 0.2
        spec: dict[str, Any] = {"argv": ["sim", str(cid)], "hold": hold,
                                "priority": rng.choice([0, 0, 0, 1, -1, 5]),
                                "retries": rng.choice([0, 0, 1, 2])}
        if rng.random() < 0.5:
            spec["id"] = f"job{cid}"
        if rng.random() < 0.15:
            spec["max_leases"] = rng.randint(1, 3)
        if cid % 7 == 3:  # a user to run as (not drawn: the seeds' runs stay what they were)
            spec["user"] = "nobody" if cid % 2 else "1000:1000"
        items: list[str | None] = [None] * n
        if rng.random() < self.cfg.inputs:
            items = [self._new_blob(rng) if rng.random() < 0.7 else None for _ in range(n)]
        if self.cfg.reruns and rng.random() < self.cfg.reruns:
            spec["restart"] = rng.randint(1, 2)
            spec["restart_delay_s"] = limits.restart_delay_s_min + rng.randint(0, 1500) / 1000
            if self.cfg.restarts_many:
                spec["restart"] = self.cfg.restarts_many
                spec["restart_delay_s"] = float(limits.restart_delay_s_min)
            self.count("jobs_with_restart")
        if self.cfg.deps and self.acked and rng.random() < self.cfg.deps:
            # Mostly recent jobs, which are likelier not to have ended yet.
            known = list(self.acked)[-6:] if rng.random() < 0.7 else sorted(self.acked)
            parents = rng.sample(known, min(len(known), rng.randint(1, 3)))
            spec["after"] = [{"id": p, "on": rng.choice(["ok", "ok", "end", "fail"])}
                             for p in parents]
            self.count("jobs_with_deps")
        gpu = bool(self.cfg.worker_pool) and rng.random() < self.cfg.worker_pool
        if gpu:
            spec["pool"] = WORKER_POOL
            self.count("jobs_worker_pool")
        if self.cfg.place and rng.random() < self.cfg.place:
            # Each selector matches a member that offers the pool, so that every job can end.
            spec["member"] = rng.choice(WORKER_SELECTORS if gpu else
                                        ["v1", "w2", "v*", "w?", "[vw]1", "*", "*"])
            if spec["member"] == "*":
                items = items[:1]
            self.count("jobs_placed")
        plan = (["release"] if hold else []) + (["cancel"] if rng.random() < 0.15 else [])
        if self.cfg.reruns and rng.random() < self.cfg.reruns:
            plan += ["poll", "rerun"]
        plan += (["poll", "forget"] if rng.random() < 0.3 else []) + ["done"]
        req = {"op": "submit", "rid": f"s{cid}", "fp": _fp("submit", cid), "spec": spec,
               "items": items, **_identity(cid)}
        if self.cfg.quota and req["by"] == QUOTA_USER:
            req["quota"] = {"running_items_max": self.cfg.quota}  # as its token's, at the edge
        self.clients.append(_Client(cid, req, plan, next_ms=self.now))
        self.count("jobs_made")

    def _client_request(self, c: _Client) -> dict:
        rid = f"c{c.cid}.{c.phase}.{c.attempt}"
        if c.phase == "submit":
            return c.req
        if c.sent is not None and c.sent.get("rid") == rid:
            # A client retrying under the same key sends the same request (over HTTP a key
            # bound to one request refuses another, so a bulk retry of a single change, or a
            # single retry of a bulk one, would not be answered with the other's outcome).
            return c.sent
        c.sent = self._new_client_request(c, rid)
        if c.sent["op"] != "get":
            c.sent.update(_identity(c.cid))
        return c.sent

    def _new_client_request(self, c: _Client, rid: str) -> dict:
        if c.phase == "release":
            return {"op": "tone", "rid": rid, "fp": _fp(rid), "id": c.job_id, "hold": False}
        if c.phase in ("cancel", "forget"):
            if self.cfg.bulk and self.acked and self.rng.random() < self.cfg.bulk:
                other = self.rng.choice(sorted(self.acked))
                self.count("bulk_requests")
                return {"op": "bulk", "action": c.phase, "rid": rid, "fp": _fp(rid),
                        "ids": list(dict.fromkeys([c.job_id, other])), "dry_run": False}
            return {"op": c.phase, "rid": rid, "fp": _fp(rid), "id": c.job_id}
        if c.phase == "rerun":
            return {"op": "rerun", "rid": rid, "fp": _fp(rid), "id": c.job_id,
                    "failed_only": self.rng.random() < 0.4}
        return {"op": "get", "id": c.job_id}

    def _clients(self) -> None:
        for c in self.clients:
            if c.phase in ("done", "refused"):
                continue
            if c.inflight is not None:
                if self.now < c.deadline_ms:
                    continue
                self.waiting.pop(c.inflight, None)  # the client gives up on this request
                c.inflight = None
                self.count("client_timeouts")
            if self.now < c.next_ms:
                continue
            alive = [n for n in MEMBERS if self.members[n].alive]
            if not alive:
                c.next_ms = self.now + 500
                continue
            m = self.members[self.rng.choice(alive)]
            req = self._client_request(c)
            if req["op"] == "submit":
                # The HTTP edge stores a submit's inputs in its member's blob store first.
                self.blobs[m.name].update(d for d in req["items"] if d is not None)
            m.tokens += 1
            key = (m.name, m.inc, m.tokens)
            c.inflight, c.deadline_ms = key, self.now + self.cfg.client_timeout_ms
            self.waiting[key] = c
            self.asked[key] = req
            self.sent_ms[key] = self.now
            m.inbox.append(Ctl(m.tokens, req))
            self.count("ctl_" + req["op"])
        if self.faulty and self.acked and self.rng.random() < self.cfg.key_reuse:
            self._reuse_key()
        if self.cfg.meddle and self.faulty and self.acked and self.rng.random() < self.cfg.meddle:
            self._meddle()

    def _meddle(self) -> None:
        """A submitter (not an admin) asks to change a job another submitted: wherever it
        lands, it must be refused (403), or not answered for now (503, 507), or 404 once the
        job is forgotten; never applied (`_check_owner`)."""
        alive = [n for n in MEMBERS if self.members[n].alive]
        target = self.rng.choice(sorted(self.acked))
        owner = self.owners.get(target)
        if not alive or owner is None:
            return
        who = self.rng.choice(sorted({f"user{i}" for i in range(3)} - {owner}))
        op = self.rng.choice(["cancel", "forget", "tone"])
        m = self.members[self.rng.choice(alive)]
        m.tokens += 1
        key = (m.name, m.inc, m.tokens)
        rid = f"meddle{m.tokens}.{m.name}.{m.inc}"
        req: dict[str, Any] = {"op": op, "rid": rid, "fp": _fp(rid), "id": target, "by": who,
                               "by_role": "submit"}
        if op == "tone":
            req["hold"] = True
        self.asked[key] = req
        self.meddles.add(key)
        m.inbox.append(Ctl(m.tokens, req))
        self.count("meddles")

    def _reuse_key(self) -> None:
        """A client sends another change under an acknowledged submit's key. Whatever member
        it reaches, and however far its table lags, the answer must be a refusal (422), or
        503: never the submit's outcome, and the change must never be applied."""
        alive = [n for n in MEMBERS if self.members[n].alive]
        if not alive:
            return
        owner = self.acked[self.rng.choice(sorted(self.acked))]
        target = self.rng.choice(sorted(self.acked))
        m = self.members[self.rng.choice(alive)]
        m.tokens += 1
        key = (m.name, m.inc, m.tokens)
        req = {"op": "cancel", "rid": f"s{owner}", "fp": _fp("reuse", owner), "id": target}
        self.asked[key] = req
        self.probes.add(key)
        m.inbox.append(Ctl(m.tokens, req))
        self.count("key_reuses")

    def _reply(self, m: _Member, token: int, answer: Answer) -> None:
        key = (m.name, m.inc, token)
        if key in self.answered:
            self.fail(f"{m.name} answered token {token} twice: {answer!r}")
        self.answered.add(key)
        req = self.asked.pop(key, None)
        if req is None:
            self.fail(f"{m.name} answered token {token}, which nobody asked")
        status, body = answer
        if req["op"] == "cron":
            self._cron_answered(m, key, req, status, body)
            return
        if req["op"] == "list":
            self._check_list(m, status, body)
            return
        if status == 507 and not (req["op"] == "submit" and m.disk_known):
            self.fail(f"{m.name} answered {req['op']} 507 (disk full) but its disk is not full")
        if key in self.meddles:
            self.meddles.discard(key)
            if status not in (403, 404, 503, 507):
                self.fail(f"{m.name} answered {req['by']}'s {req['op']} of {req['id']} (job of "
                          f"{self.owners.get(req['id'])}) with {status} {body!r}: it must be "
                          "refused (403)")
            if status == 404 and req["id"] not in self.oracle.forgotten:
                self.fail(f"{m.name} answered {req['by']}'s {req['op']} of committed job "
                          f"{req['id']} 404")
            self.count(f"meddles_{status}")
            return
        if key in self.probes:
            self.probes.discard(key)
            if status not in (422, 503):
                self.fail(f"{m.name} answered a change under a reused key {req['rid']} with "
                          f"{status} {body!r}: it must be refused (422)")
            self.count(f"key_reuses_{status}")
            return
        sent = self.sent_ms.pop(key, None)
        if (req["op"] == "submit" and sent is not None and m.name not in self.cfg.silent
                and any(d is not None for d in req["items"])):
            # How long a submit with inputs waited, from its member's answer: a silent member
            # must not hold the copies of the others back.
            if status in (200, 201):
                self.counts["inputs_submit_ms_max"] = max(
                    self.counts.get("inputs_submit_ms_max", 0), self.now - sent)
                self.count("inputs_submits_acked")
            else:
                self.count(f"inputs_submits_{status}")
        if req["op"] == "submit" and status in (200, 201):
            jid = body["id"]
            if jid not in self.oracle.jobs and jid not in self.oracle.forgotten:
                self.fail(f"{m.name} acknowledged submit {req['rid']} (job {jid}) before it "
                          "was committed")
            fanout = req["spec"].get("member") == "*"  # one item per member instead
            if body["items_total"] != len(req["items"]) and not fanout:
                self.fail(f"submit {req['rid']} acknowledged with {body['items_total']} items")
        elif (req["op"] in ("cancel", "forget", "tone") and status == 404
              and req["id"] in self.oracle.jobs and req["id"] in self.acked):
            # Rule 4 of the node: a change is answered from a committed entry. "No such job"
            # for a job acknowledged and in the committed log is a wrong answer, not a stale one.
            self.fail(f"{m.name} answered {req['op']} of acknowledged job {req['id']} 404 "
                      f"({body.get('error')!r}), its own table at index "
                      f"{m.table.applied_index}; the job was committed (log at {self.last_index})")
        elif req["op"] in ("cancel", "forget") and status == 200:
            self._check_changed(m, req["op"], req["id"])
        elif req["op"] == "bulk" and status == 200:
            self._check_bulk(m, req, body)
        elif req["op"] == "rerun":
            self._check_rerun_answer(m, req, status, body)
        c = self.waiting.pop(key, None)
        if c is None:
            return
        c.inflight = None
        if req["op"] == "bulk" and status == 200:
            # The client's own job's row stands for the answer a single change would have had.
            own = next(r["answer"] for r in body["results"] if r["id"] == c.job_id)
            status = {"changed": 200, "already_final": 409, "refused": 409,
                      "no_such_job": 404}[own]
        self.count(f"answers_{status}")
        self._answered(c, status, body)

    def _reads(self) -> None:
        """Now and then a reader asks a member cut off from the leader for the job list
        (`_check_list`): one the reader reaches, as a client beside it would."""
        if self.rng.random() >= self.cfg.reads or self.leader is None:
            return
        cut_off = [n for n in MEMBERS if n != self.leader and self.members[n].alive
                   and not self._reachable(n, self.leader)]
        if not cut_off:
            return
        m = self.members[self.rng.choice(cut_off)]
        m.tokens += 1
        self.asked[(m.name, m.inc, m.tokens)] = req = {"op": "list", "limit": 20}
        m.inbox.append(Ctl(m.tokens, req))
        self.count("ctl_list")

    def _check_list(self, m: _Member, status: int, body: Any) -> None:
        """A member whose table caught up with the log once since it started has a table to
        answer from: it answers the list (200) and says whether it is fresh, cut off or not.
        Before that, 503 (try again) is its answer: an empty table would deny jobs that exist."""
        if status == 503 and m.caught_up:
            self.fail(f"{m.name} refused a job list ({body.get('error')!r}), though its table "
                      f"(at index {m.table.applied_index}) has caught up with the log since "
                      "it started: it must answer from its table and say whether it is fresh")
        if status == 200:
            if not isinstance(body.get("fresh"), bool):
                self.fail(f"{m.name} answered a job list without saying whether it is fresh")
            self.count("reads_fresh" if body["fresh"] else "reads_not_fresh")
        else:
            self.count(f"reads_{status}")

    def _check_changed(self, m: _Member, op: str, jid: str) -> None:
        """A change is answered only once applied: the committed table must show it."""
        t = self.oracle
        # Cancelled once is enough: a rerun committed since may have started the job again
        # before the answer (relayed by another member) reached its client.
        done = jid in t.forgotten or (op == "cancel" and jid in self.ever_cancelled)
        if not done:
            self.fail(f"{m.name} answered {op} of {jid} 200 before it was committed")

    def _check_bulk(self, m: _Member, req: dict, body: Any) -> None:
        """A bulk change answers each job it names, as the committed entry applied it: a job
        "changed" shows the change in the committed table, and an acknowledged job in the
        committed log is never "no such job"."""
        rows = {r.get("id"): r.get("answer") for r in body.get("results", [])}
        if set(rows) != set(req["ids"]):
            self.fail(f"{m.name} answered bulk {req['action']} of {req['ids']} for {sorted(rows)}")
        admin = req.get("by_role") == "admin"
        for jid, what in rows.items():
            owner = self.owners.get(jid)
            if what in ("changed", "not_owner") and owner is not None and (
                    (what == "changed") != (admin or owner == req.get("by"))):
                self.fail(f"{m.name} answered {req.get('by')}'s bulk {req['action']} of {jid} "
                          f"(job of {owner}) {what}")
            if what == "not_owner":
                self.count("bulk_not_owner")
            if what == "changed":
                self._check_changed(m, req["action"], jid)
            elif what == "no_such_job" and jid in self.oracle.jobs and jid in self.acked:
                self.fail(f"{m.name} answered bulk {req['action']} of acknowledged job {jid} "
                          "no_such_job; the job was committed")
        self.count("bulk_answers_checked")

    def _answered(self, c: _Client, status: int, body: Any) -> None:
        later = self.now + self.rng.randint(20, 1_000)
        if status in (503, 507):  # 507: that member's disk is full; ask again (elsewhere)
            c.next_ms = later
            return
        if status == 400 and c.phase == "submit" and c.req["spec"].get("after"):
            # A parent that was forgotten (by its client, or expired) since it was picked.
            gone = [d["id"] for d in c.req["spec"]["after"] if d["id"] in self.oracle.forgotten]
            if not gone or "after" not in body.get("error", ""):
                self.fail(f"client {c.cid}: submit with after answered 400 {body}, though its "
                          "parents are all known")
            c.phase = "refused"
            self.count("submits_refused_after")
            return
        if (status == 400 and c.phase == "submit" and c.req["spec"].get("pool") == WORKER_POOL
                and "unknown pool" in body.get("error", "")):
            # No worker heard from for dead_ms by a leader that had heard from the fleet
            # (checked where it was answered: `_check_final`).
            c.phase = "refused"
            self.count("submits_refused_unknown_pool")
            return
        if status == 400 or status == 413:
            self.fail(f"client {c.cid} {c.phase}: a well-formed request answered {status} {body}")
        if c.phase == "submit":
            if status in (200, 201):
                if body.get("submitted_by") != c.req["by"]:
                    self.fail(f"client {c.cid}: its job {body.get('id')} names "
                              f"{body.get('submitted_by')!r} as its submitter, not {c.req['by']!r}")
                c.job_id = body["id"]
                self.acked[c.job_id] = c.cid
                self.count("jobs_acked")
                self._next_phase(c)
            else:
                c.phase = "refused"  # 404/409: its job was forgotten before the client heard
                self.count("submits_refused")
        elif c.phase == "poll":
            if status == 200 and body["state"] in FINAL_STATES:
                self._next_phase(c)
            elif status == 404 and "forgotten" in body.get("error", ""):
                c.phase = "done"
            else:
                c.next_ms = self.now + self.rng.randint(500, 3_000)
        elif c.phase == "forget" and status == 409:
            c.attempt += 1  # not finished as the leader sees it: look again, then ask anew
            c.phase = "poll"
            c.next_ms = later
        else:  # release, cancel, forget: 200, 404 and 409 all end the phase
            if c.phase == "forget" and status == 200:
                self.count("jobs_forgotten_by_clients")
            self._next_phase(c)

    def _next_phase(self, c: _Client) -> None:
        c.phase = c.plan.pop(0)
        c.attempt = 0
        c.next_ms = self.now + self.rng.randint(0, 6_000)

    # --- schedules -------------------------------------------------------------------------------

    def _cron_requests(self) -> None:
        """Each schedule's client adds it, retrying under the same request id; once the fleet
        is healed and the schedule has settled a few due times since, it pauses it."""
        for c in self.cron_clients:
            if c.phase == "added" and self._cron_fired_since_settled(c.name):
                c.phase, c.attempt = "pause", 0
            if c.phase not in ("add", "pause"):
                continue
            if c.inflight is not None:
                if self.now < c.deadline_ms:
                    continue
                c.inflight = None
                self.count("cron_client_timeouts")
            if self.now < c.next_ms:
                continue
            alive = [n for n in MEMBERS if self.members[n].alive]
            if not alive:
                continue
            m = self.members[self.rng.choice(alive)]
            rid = f"{c.name}.{c.phase}.{c.attempt}"
            req = dict(c.req) if c.phase == "add" else {"op": "cron", "action": "pause",
                                                         "name": c.name}
            req.update(rid=rid, fp=_fp(rid))
            m.tokens += 1
            key = (m.name, m.inc, m.tokens)
            c.inflight, c.deadline_ms = key, self.now + self.cfg.client_timeout_ms
            self.asked[key] = req
            m.inbox.append(Ctl(m.tokens, req))
            self.count("ctl_cron_" + c.phase)

    def _cron_fired_since_settled(self, name: str) -> bool:
        last = self.cron_last.get(name)
        c = self.oracle.crons.get(name)
        return (self.healed_ms is not None and last is not None and c is not None
                and last[1] > self.healed_ms + CRON_SETTLE_MS + 4 * c.sched.every_s * 1000)

    def _cron_answered(self, m: _Member, key: tuple, req: dict, status: int, body: Any) -> None:
        c = next(c for c in self.cron_clients if c.name == req["name"])
        if status in (200, 201):
            oc = self.oracle.crons.get(req["name"])
            if oc is None or (req["action"] == "pause" and not oc.paused):
                self.fail(f"{m.name} answered cron {req['action']} of {req['name']} {status} "
                          "before it was committed")
            if body.get("name") != req["name"]:
                self.fail(f"{m.name} answered cron {req['action']} of {req['name']} with {body}")
        elif status != 503:
            self.fail(f"{m.name} answered a well-formed cron {req['action']} of {req['name']} "
                      f"{status} {body}")
        self.count(f"cron_answers_{status}")
        if c.inflight != key:
            return  # an answer its client gave up waiting for
        c.inflight = None
        if status in (200, 201):
            c.phase = {"add": "added", "pause": "paused"}[c.phase]
        else:
            c.next_ms = self.now + self.rng.randint(20, 1_000)

    def _crons_settled(self) -> bool:
        return all(c.phase == "paused" for c in self.cron_clients) and all(
            oc.paused for oc in self.oracle.crons.values())

    # --- checks after each step ---------------------------------------------------------------

    def _check_fresh(self) -> None:
        """A worker says its table is fresh only while the member it takes for the leader has
        itself sent it F_JOB_STATE within dead_ms (a follower's hint does not count), and only
        while its table holds every entry that leader's frames (of its term) have shown it."""
        for name in WORKERS:
            m = self.members[name]
            if not m.alive or not m.node.health()["fresh"]:
                continue
            leader = m.node.view.leader
            last = self.heard.get((name, leader))
            if last is None or self.now - last > limits.member_dead_ms:
                self.fail(f"{name} says it is fresh, but its leader {leader} last sent it "
                          f"F_JOB_STATE {None if last is None else self.now - last} ms ago")
            shown = self.shown.get((name, m.inc, leader, m.node.view.term), 0)
            if m.table.applied_index < shown:
                self.fail(f"{name} says it is fresh at index {m.table.applied_index}, but its "
                          f"leader {leader} has shown it entries up to index {shown}")

    def _check_tables(self) -> None:
        self._check_fresh()
        last = self.log[-1][0] if self.log else 0
        for m in self.members.values():
            if m.alive and last and m.table.applied_index == last:
                m.caught_up = True
            if not m.alive or m.table.applied_index == m.checked_index:
                continue
            index = m.table.applied_index
            m.checked_index = index
            try:
                m.table.check()
            except AssertionError as e:
                self.fail(f"{m.name}'s table broken at index {index}: {e}")
            h = table_digest(m.table)
            ref = self.oracle_hash if index == self.oracle.applied_index else self.ref_hash.get(index)
            if ref is None:
                self.ref_hash[index] = h
            elif ref != h:
                self.fail(f"{m.name}'s table at index {index} differs from another table there")

    # --- driving ------------------------------------------------------------------------------

    def step(self) -> None:
        self.step_no += 1
        self.now += self.rng.randint(1, self.cfg.step_ms_max)
        self._due()
        if self.cfg.lose is not None and self.step_no == self.cfg.lose_at_step:
            lost = self.members[self.cfg.lose]
            if lost.alive:
                self._crash(lost)
            self.gone.add(lost.name)
            self.wiped |= self.blobs[lost.name]
            self.blobs[lost.name] = set()
            self.count("members_lost")
        if self.faulty:
            self._faults()
            if len(self.clients) < self.cfg.jobs_max and self.rng.random() < self.cfg.job_new:
                self._new_client()
        self._raft()
        self._links()
        self._clients()
        if self.cfg.orders:
            self._orders()
        if self.cfg.stops:
            self._stops()
        if self.cfg.slots:
            self._slots()
        if self.cron_clients:
            self._cron_requests()
        if self.cfg.reads:
            self._reads()
        for name in MEMBERS:
            m = self.members[name]
            if m.alive:
                self._step_member(m)
        self._check_tables()

    def settled(self) -> bool:
        """Every client past its submit, every acknowledged job ended or forgotten, and every
        member's table at the last committed entry."""
        if any(c.phase == "submit" for c in self.clients):
            return False
        if self.cron_clients and not self._crons_settled():
            return False
        if any(not m.alive for m in self.members.values() if m.name not in self.gone):
            return False  # a member that exited on a stop order, not started again yet
        for jid in self.acked:
            job = self.oracle.jobs.get(jid)
            if job is None:
                if jid not in self.oracle.forgotten:
                    self.fail(f"acknowledged job {jid} is neither in the table nor forgotten")
                continue
            if not job.finished:
                return False
        last = self.log[-1][0] if self.log else 0
        # Every run ended or was cut: a run whose lease is gone must not go on for ever.
        if not all(m.table.applied_index == last and not m.running
                   for m in self.members.values() if m.name not in self.gone):
            return False
        return not self._under_copied()

    def _under_copied(self) -> list[tuple[str, int]]:
        """Items whose committed outputs are on fewer than blob_copies (2) members."""
        if not self.gone:
            return []  # no blob store was ever lost: every commit checked its copies
        short = []
        for jid, job in sorted(self.oracle.jobs.items()):
            for i in range(job.n):
                for d in (job.out[i], job.err[i]):
                    if d is not None and sum(1 for n in MEMBERS if d.hex() in self.blobs[n]) < 2:
                        short.append((jid, i))
                        break
        return short

    def unsettled(self) -> str:
        open_jobs = sorted(j for j in self.acked if j in self.oracle.jobs
                           and not self.oracle.jobs[j].finished)
        last = self.log[-1][0] if self.log else 0
        live = [m for m in self.members.values() if m.name not in self.gone and m.alive]
        behind = [m.name for m in live if m.role == "worker" and m.table.applied_index < last]
        short = self._under_copied()
        return (f"clients submitting: {[c.cid for c in self.clients if c.phase == 'submit']}; "
                + (f"workers behind the log: {behind}; " if behind else "")
                + (f"outputs on fewer than 2 members: {short[:5]}; " if short else "")
                + f"jobs not ended: {open_jobs[:5]}; leader {self.leader} term {self.term}; "
                f"tables at {[(m.name, m.table.applied_index) for m in live]}, "
                f"runs {[(m.name, sorted(m.running)[:3]) for m in self.members.values() if m.running]}, "
                f"log at {last}")

    def report(self, liveness_ms: int) -> Report:
        counts = dict(self.counts)
        counts["entries_committed"] = len(self.log)
        counts["term"] = self.term
        counts["clients"] = len(self.clients)
        for k, v in self.oracle.counts.items():
            counts["table_" + k] = v
        return Report(self.seed, self.step_no, self.now - T0_MS, liveness_ms,
                      self.oracle_hash.hex(), dict(sorted(counts.items())))


def run(seed: int, config: SimConfig | None = None, table_cls: type[JobTable] = JobTable,
        node_cls: type[JobNode] = JobNode,
        receiver_cls: type[blobxfer.Receiver] = blobxfer.Receiver) -> Report:
    """Simulate one fleet from `seed`: the safety phase, then the liveness phase. Raises
    SimFailure (naming the seed) when a check fails."""
    sim = Sim(seed, config, table_cls, node_cls, receiver_cls)
    try:
        for _ in range(sim.cfg.steps):
            sim.step()
        sim.heal()
        healed = sim.now
        while not sim.settled():
            if sim.now - healed > sim.cfg.liveness_ms_max:
                sim.fail(f"liveness: not settled {sim.cfg.liveness_ms_max} ms after healing: "
                         + sim.unsettled())
            sim.step()
    except SimFailure:
        raise
    except Exception as e:  # a node or table crashed on an invariant of its own
        raise SimFailure(seed, sim.step_no, sim.now, f"{type(e).__name__}: {e}") from e
    return sim.report(sim.now - healed)
