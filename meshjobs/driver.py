"""The driver: runs the items this member leased and reports how each one ended.

Items of kind "command" run as subprocesses; items of kind "python" are calls made by the
workers of the python pool (meshjobs.pypool), which the driver thread owns.

Theory of operation. The jobs thread hands the driver `Run`s (`start`) and revocations
(`cut`); both only append to state guarded by one lock and wake the driver thread through a pipe.
The driver thread (`run`) waits with one selector on that pipe and on a pidfd per running
process, with a timeout equal to the nearest deadline (a runtime limit or the end of a cut's
grace). It never polls.

Rules:
1. Only the driver thread spawns, signals and reaps processes; other threads talk to it through
   the command state and the wake-up pipe.
2. Each item runs in its own session, so its process group is its own. When the leader exits the
   whole group is killed before the leader is reaped (a zombie leader keeps its pid, so the group
   id cannot be reused under us): nothing an item started outlives it, unless it left the group
   on purpose (setsid), which only a cgroup could stop.
3. Stdout and stderr are pipes the driver thread reads (meshjobs.capture): a stream stays in
   memory up to limits.item_output_memory_bytes_max bytes, past that all of it goes to a spool
   file, and from there into the blob store. A stdin payload up to
   limits.item_stdin_pipe_bytes_max bytes is fed through a pipe; a larger one is spooled from
   its blob to a file before the process starts. The item ends when its leader exits: its
   group is killed, what the pipes still hold is read (a bounded number of reads: a process
   that left the group may write on), and the pipes are closed.
4. Every item accepted by `start` is reported through `on_end` exactly once, unless `stop` comes
   first; after `stop` nothing more is reported.
5. Spool files live only between a start and its report; leftovers of a previous run are removed
   when a driver is constructed.
6. Python items: the job's argv[0] is the target "package.module:function" and its argv[1:], when
   there are any, are passed as the keyword `args` (see meshjobs.pyworker). The stdin blob (at
   most limits.py_request_bytes_max bytes) is the function's argument; its return value is the
   stdout blob; what it printed, then the traceback or why the call failed, is the stderr blob.
   Outputs are stored and the end reported exactly as for command items. A cut or a runtime
   limit kills the worker (SIGKILL to its group) and a new one takes its place.
7. Items see meshd's whole environment only when their job asks: a command item gets the
   variables `env_pass` names (meshjobs.itemenv), then the job's env, then MESH_JOB_ID,
   MESH_ITEM_INDEX and MESH_LEASE_EPOCH (and MESH_MEMBER, this member's name: command items
   only); python workers start from the same variables (plus
   PYTHONPATH and PYTHONHOME, to start as meshd did) and layer the job's env and MESH_* over
   them per call. A job with `inherit_env` gets meshd's whole environment instead of the
   named variables.
8. Orphans: an item that leaves its group (setsid) and whose process outlives it is re-parented
   to PID 1, or to the nearest child subreaper. When that is this process (meshd is a
   container's PID 1, or runs as a subreaper), the driver thread reaps those orphans' zombies
   every limits.orphan_reap_ms, and only them: its own children (items' leaders, python
   workers) are left to the waits that report their ends.
9. Users (meshjobs.runas): an item whose job (or pool) names a user runs with that user's uid,
   gid and supplementary groups, and its HOME, USER and LOGNAME, when this member may switch
   users; otherwise, or when the user is unknown here, it fails without running and its error
   says why. When this member may switch users, an item whose job and pool name nobody runs as
   the member's item user (`[items] user`, runas.item_user), never as meshd's own uid; when it
   may not, as meshd's own uid. An item that runs as another user and whose job gives no cwd
   starts in that user's HOME (or /tmp: runas.item_cwd), not in meshd's folder. Its stdin,
   stdout and stderr are descriptors meshd opened, so the spool folder stays meshd's alone.
10. Python items run in workers of their pool's user (`[pools.X] user`, else the item user when
   this member may switch users, else meshd's own): one worker pool per user, sized by the
   slots of the python pools that run as that user. A job that names a user runs in a python
   pool only when that is the pool's user; otherwise the item fails saying so.
11. A meshd that dies leaves nothing running for long (meshjobs.leftovers): every process the
   driver starts (items, python workers) is recorded in the data folder before it starts and
   until it is reaped, and the next start of meshd ends what the record names, before any
   lease. Where the item starts behind the wall (the launcher, meshjobs/wall.py) and for python
   workers, its first process also dies with the thread that started it (PR_SET_PDEATHSIG,
   SIGKILL). That signal follows the parent *thread*, not the process: it is right here only
   because the driver thread, the one thread that starts processes (Rule 1, asserted), ends
   after it has killed every group it started, or with the process. What the item started
   beside itself in its group is the sweep's to end.
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import queue
import selectors
import signal
import subprocess
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future
from typing import Any, Protocol

import structlog

from blobstore.digest import EMPTY_DIGEST
from blobstore.errors import BlobError
from meshjobs import identity, leftovers, limits, outpaths, pidwatch, runas, spawn, wall
from meshjobs.capture import Capture
from meshjobs.datadir import private_opener
from meshjobs.itemenv import DEFAULT_PASS, base_env, inherited_env
from meshjobs.node.events import ItemEnded, Run
from meshjobs.pypool import PyEnd, PyPool

RunKey = tuple[str, int, int]  # (job_id, index, epoch)

PR_SET_CHILD_SUBREAPER = 36  # prctl(2)
PR_GET_CHILD_SUBREAPER = 37

_SPOOL_PREFIX = "item-"


class BlobStore(Protocol):
    """The part of the blob store the driver uses."""

    def put_file(self, path: str) -> str: ...

    def put(self, data: bytes) -> str: ...

    def open(self, digest: str) -> Iterator[bytes] | None: ...

    def get(self, digest: str) -> bytes | None: ...

    def size(self, digest: str) -> int | None: ...


# What the driver runs is the node's `Run` effect itself, and what it reports is the node's
# `ItemEnded` event (meshjobs/node/events.py): one type per concept, no copy at the edge.
# `ItemEnded`'s state is "done" (rc 0), "failed" (rc != 0, killed by a signal, or could not
# start), "timeout" (its runtime limit passed) or "cut" (revoked by `Driver.cut`); stdout and
# stderr are digests of the captured output (the empty payload has one too), None only when no
# process ran, and then error says why.


def _wall_ms() -> int:
    return time.time_ns() // 1_000_000


class _Pipe:
    """Our end of one of a run's pipes, registered with the selector while it is open."""

    __slots__ = ("run", "fd", "capture", "data")

    def __init__(self, run: _Run, fd: int, capture: Capture | None,
                 data: memoryview | None = None) -> None:
        self.run = run
        self.fd = fd  # -1 once closed
        self.capture = capture  # stdout or stderr: where what is read goes
        self.data = data  # stdin: what is left to write


class _Run:
    """One running process; touched by the driver thread only."""

    __slots__ = ("item", "pid", "proc", "pidfd", "stdin_path", "out", "err", "pipes",
                 "started_ms", "deadline", "kill_at", "reason", "record")

    def __init__(self, item: Run, out: Capture, err: Capture, started_ms: int) -> None:
        self.item = item
        self.pid = 0
        self.proc: subprocess.Popen[bytes] | None = None  # None: spawned by meshjobs.spawn
        self.pidfd = -1
        self.stdin_path: str | None = None  # the stdin spool file (a large payload only)
        self.out = out
        self.err = err
        self.pipes: list[_Pipe] = []  # open ones: stdout, stderr, and stdin while it is fed
        self.started_ms = started_ms
        self.deadline: float | None = None  # time.monotonic() when the runtime limit passes
        self.kill_at: float | None = None  # time.monotonic() when a cut's grace ends
        self.reason: str | None = None  # "timeout" or "cut" once the driver ended it
        self.record: int | None = None  # its number in the log of running processes (Rule 11)


class Driver:
    """Runs leased items as subprocesses; see the module docstring for its rules."""

    def __init__(
        self,
        blobs: BlobStore,
        spool_dir: str,
        on_end: Callable[[ItemEnded], None],
        clock_ms: Callable[[], int] = _wall_ms,
        log: Any = None,
        writers: Any = None,
        on_fatal: Callable[[BaseException], None] | None = None,
        python_workers: int | None = None,
        env_pass: Iterable[str] = DEFAULT_PASS,
        member: str = "this member",
        may_switch_user: bool | None = None,
        item_user: str | None = None,
        python_pools: dict[str, tuple[int, str | None]] | None = None,
        wall_denied: Iterable[str] | None = None,
        record: leftovers.Record | None = None,
    ) -> None:
        """python_workers: the python worker processes to pre-fork when run() starts (the
        slots of this member's python pools together). None starts os.cpu_count() workers when
        the first python item comes; 0 starts one then.

        env_pass: the names of this process's environment variables items see (`[items]
        env_pass`; see meshjobs.itemenv): items and python workers start from those alone.

        member: this member's name, for errors. may_switch_user: whether items may run as other
        users (None: whether this process holds CAP_SETUID and CAP_SETGID, meshjobs.runas).

        item_user: who items run as when neither their job nor their pool names a user, when
        this member may switch users (runas.item_user of `[items] user`); None: meshd's own.

        python_pools: each python pool's slots and the user its workers run as (None: the item
        user); with it, python_workers is ignored and the workers of each user are started
        when run() starts.

        wall_denied: the paths items may not reach (meshjobs.wall): every command item and
        python worker then starts behind Landlock rules denying them, in a Landlock domain of
        its own. None: no wall (the caller checked that the kernel has Landlock).

        record: where each process this driver starts is recorded while it runs (Rule 11;
        meshjobs.leftovers), so that a later run of meshd ends it if this one dies first.
        None: not recorded."""
        self._blobs = blobs
        # The blob writer threads (group commit, backpressure); without them, outputs are
        # stored on the driver thread.
        self._writers = writers
        self._on_fatal = on_fatal
        self._spool_dir = spool_dir
        # Taken once: meshd's environment does not change while it runs.
        self._base_env = base_env(os.environ, env_pass)
        self._full_env = inherited_env(os.environ)  # for jobs that ask for it (inherit_env)
        self._member = member
        self._may_switch = runas.can_switch_user() if may_switch_user is None else may_switch_user
        self._item_user = item_user if self._may_switch else None
        self._wall_denied = tuple(wall_denied) if wall_denied is not None else None
        self._wall_rules: wall.Rules | None = None
        self._record = record
        self._thread: int | None = None  # the driver thread's id, once run() runs
        self._on_end = on_end
        self._clock_ms = clock_ms
        self._log = log if log is not None else structlog.get_logger(__name__)
        os.makedirs(spool_dir, mode=0o700, exist_ok=True)
        self._clear_spool()

        # Shared with other threads, under _lock.
        self._lock = threading.Lock()
        self._starts: deque[Run] = deque()
        self._cuts: set[RunKey] = set()
        self._accepted: set[RunKey] = set()  # started and not yet reported ended
        # The stdout and stderr of each running process, and whether it has ended (they are
        # then complete), for live output (meshjobs.itemlogs).
        self._spools: dict[RunKey, tuple[Capture, Capture, bool]] = {}
        self._stopping = False
        self._closed = False  # the wake-up pipe is closed; nobody may write to it
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)

        # The driver thread's own.
        self._runs: dict[RunKey, _Run] = {}
        self._seq = 0
        self._ran = False
        if python_workers is not None and not 0 <= python_workers <= limits.py_workers_max:
            raise ValueError(f"python_workers must be 0..{limits.py_workers_max}, "
                             f"not {python_workers}")
        self._python_workers = python_workers
        # The python workers' user of each python pool (None: meshd's own), and how many
        # workers each user gets: the slots of its pools together.
        self._py_users: dict[str, str | None] = {}
        self._py_sizes: dict[str | None, int] = {}
        for name, (slots, user) in (python_pools or {}).items():
            run_as = (user or self._item_user) if self._may_switch else None
            self._py_users[name] = run_as
            self._py_sizes[run_as] = self._py_sizes.get(run_as, 0) + slots
        if python_pools is not None:
            self._python_workers = sum(self._py_sizes.values())
            if not self._python_workers <= limits.py_workers_max:
                raise ValueError(f"python pools have {self._python_workers} slots, over "
                                 f"{limits.py_workers_max}")
        self._pools: dict[str | None, PyPool] = {}  # by the user their workers run as
        self._next_reap: float | None = None
        self.orphans_reaped = 0

    # --- Other threads -------------------------------------------------------------------------

    def start(self, item: Run) -> None:
        """Queue an item to run; a no-op if that (job_id, index, epoch) is already accepted.

        Raises queue.Full when limits.driver_queue_max items wait to be spawned.
        """
        with self._lock:
            if self._stopping:
                self._log.debug("item_dropped_stopping", job=item.job_id, index=item.index,
                                epoch=item.epoch)
                return
            if item.key in self._accepted:
                return
            if len(self._starts) >= limits.driver_queue_max:
                raise queue.Full(f"driver queue holds {limits.driver_queue_max} items")
            self._starts.append(item)
            self._accepted.add(item.key)
            self._wake_locked()

    def cut(self, job_id: str, index: int, epoch: int) -> None:
        """End that run: SIGTERM to its group, SIGKILL after limits.cut_grace_ms; state "cut".

        A no-op for a run that is not accepted. A run cut before it was spawned is reported
        "cut" without a process (stdout and stderr None).
        """
        key = (job_id, index, epoch)
        with self._lock:
            if self._stopping or key not in self._accepted:
                return
            self._cuts.add(key)
            self._wake_locked()

    def running(self) -> set[RunKey]:
        """The runs accepted and not yet reported ended (waiting to spawn or running)."""
        with self._lock:
            return set(self._accepted)

    def read_output(self, key: RunKey, stream: str, offset: int, size: int
                    ) -> tuple[bytes, int, bool] | None:
        """Live output (any thread): up to `size` bytes of a run's "stdout" or "stderr" from
        `offset`, how many bytes that stream holds now, and whether the run has ended (the
        stream is then complete); None when it has no process yet, had none (a python item),
        or its end was reported. Raises FileNotFoundError when its spool file is gone (stored
        in the blob store meanwhile): a reader then looks for the output in the item's blob."""
        with self._lock:
            got = self._spools.get(key)
        if got is None:
            return None
        ended = got[2]  # taken before the read: once ended, the stream is complete
        data, total = (got[0] if stream == "stdout" else got[1]).read(offset, size)
        return data, total, ended

    def accepted(self, key: RunKey) -> bool:
        """Whether a run is accepted and its end not yet reported (waiting or running)."""
        with self._lock:
            return key in self._accepted

    def stop(self) -> None:
        """Make run() kill every group (SIGKILL), reap them and return, reporting nothing more."""
        with self._lock:
            self._stopping = True
            self._wake_locked()

    def _wake_locked(self) -> None:
        if self._closed:
            return
        try:
            os.write(self._wake_w, b"\0")
        except BlockingIOError:
            pass  # The pipe is full, so the driver thread is already bound to wake up.

    # --- The driver thread ---------------------------------------------------------------------

    def run(self) -> None:
        """The driver thread's body; returns after stop()."""
        if self._ran:
            raise RuntimeError("Driver.run() may run once")
        self._ran = True
        self._thread = threading.get_ident()
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._wake_r, selectors.EVENT_READ, None)
        # Orphans come to this process only when it is PID 1 or a subreaper: then reap them.
        self._next_reap = time.monotonic() if is_reaper() else None
        try:
            if self._python_workers:
                for user, size in (self._py_sizes or {None: self._python_workers}).items():
                    if size:
                        self._python_pool(user)
            while True:
                for key, mask in self._sel.select(self._next_timeout()):
                    if key.data is None:
                        self._drain_wake()
                    elif isinstance(key.data, _Pipe):
                        self._on_pipe(key.data)
                    elif isinstance(key.data, _Run):
                        self._reap(key.data)
                    else:
                        key.data[0].owner.on_event(key.data, mask)
                with self._lock:
                    if self._stopping:
                        break
                    starts = list(self._starts)
                    self._starts.clear()
                    cuts = self._cuts
                    self._cuts = set()
                for item in starts:
                    if item.key in cuts:
                        cuts.discard(item.key)
                        now = self._clock_ms()
                        self._report_unstarted(item, "cut", now, None)
                    elif (why := _pool_user_refused(item, self._member)) is not None:
                        self._report_unstarted(item, "failed", self._clock_ms(), why)
                    elif item.kind == "python":
                        self._py_start(item)
                    else:
                        self._spawn(item)
                for key in cuts:
                    run = self._runs.get(key)
                    if run is not None:
                        self._cut_run(run)
                    else:
                        for pool in self._pools.values():
                            if pool.cut(key):
                                break
                self._check_deadlines()
                for pool in list(self._pools.values()):
                    pool.check()
                if self._next_reap is not None and time.monotonic() >= self._next_reap:
                    self._next_reap = time.monotonic() + limits.orphan_reap_ms / 1000
                    self._reap_orphans()
        finally:
            # Also on an error (on_end raising, say): no item may outlive the driver.
            self._shutdown()

    def _next_timeout(self) -> float | None:
        soonest: float | None = None
        for run in self._runs.values():
            for t in (run.deadline, run.kill_at):
                if t is not None and (soonest is None or t < soonest):
                    soonest = t
        for pool in self._pools.values():
            t = pool.next_deadline()
            if t is not None and (soonest is None or t < soonest):
                soonest = t
        t = self._next_reap
        if t is not None and (soonest is None or t < soonest):
            soonest = t
        if soonest is None:
            return None
        return max(0.0, soonest - time.monotonic())

    def _reap_orphans(self) -> None:
        own = {run.pid for run in self._runs.values()}
        for pool in self._pools.values():
            own |= pool.pids()
        n = reap_orphans(own)
        if n:
            self.orphans_reaped += n
            self._log.debug("orphans_reaped", n=n)

    def _drain_wake(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass

    def _spool_paths(self) -> tuple[str, str, str]:
        self._seq += 1
        base = os.path.join(self._spool_dir, f"{_SPOOL_PREFIX}{self._seq}")
        return (base + ".in", base + ".out", base + ".err")

    def _spawn(self, item: Run) -> None:
        started_ms = self._clock_ms()
        argv0 = item.argv[0] if item.argv else ""
        if not item.argv:
            self._report_unstarted(item, "failed", started_ms, "empty argv: fix the job's argv")
            return
        paths = self._spool_paths()
        ident: runas.Identity | None = None
        user = self._run_user(item)
        if user is not None:
            try:
                ident = self._identity(user)
            except runas.RunAsError as e:
                self._report_unstarted(item, "failed", started_ms, e.message)
                return
        base = dict(self._full_env if item.inherit_env else self._base_env)
        if ident is not None:
            # The user's HOME, USER and LOGNAME, never meshd's (a uid the user database does
            # not know gets none); the job's env may still set them.
            for name in runas.IDENTITY_VARS:
                base.pop(name, None)
            base.update(ident.env())
        env = {
            **base,
            **item.env,
            "MESH_JOB_ID": item.job_id,
            "MESH_ITEM_INDEX": str(item.index),
            "MESH_LEASE_EPOCH": str(item.epoch),
            "MESH_MEMBER": self._member,  # where it runs (placement: `--member`)
        }
        ids: dict[str, Any] = {}
        if ident is not None and self._may_switch:
            # extra_groups always: without it the item would keep meshd's supplementary groups.
            ids = {"user": ident.uid, "group": ident.gid, "extra_groups": list(ident.groups)}
            if item.cwd is None and ident.uid != os.geteuid():
                # Not meshd's own folder (often the data folder): the user's HOME, or /tmp.
                item = dataclasses.replace(item, cwd=runas.item_cwd(ident))
        run = _Run(item, Capture(paths[1]), Capture(paths[2]), started_ms)
        # The child's ends of its stdin, stdout and stderr; ours are closed once it runs.
        theirs: list[int] = []
        try:
            error = self._open_stdin(run, paths[0], theirs)
            if error is not None:
                self._close_run_fds(run)
                self._remove_stdin(run)
                self._report_unstarted(item, "failed", started_ms, error)
                return
            for capture in (run.out, run.err):
                r, w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
                theirs.append(w)
                run.pipes.append(_Pipe(run, r, capture))
            # The child's ends block, as files did: only our ends are non-blocking.
            os.set_blocking(theirs[1], True)
            os.set_blocking(theirs[2], True)
        except OSError as e:
            for fd in theirs:
                os.close(fd)
            self._close_run_fds(run)
            self._remove_stdin(run)
            error = f"could not open pipes or spool files on member ({e.strerror or e}): " \
                    "check its disk and its open file limit"
            self._report_unstarted(item, "failed", started_ms, error)
            return
        # Only the driver thread starts processes: the parent-death signal of the launcher
        # follows the thread that started it (Rule 11).
        assert threading.get_ident() == self._thread, "a process started off the driver thread"
        try:
            # Recorded before it starts (meshjobs.leftovers, Rule 1): a process without a
            # record is one that never started.
            run.record = (self._record.begin("item", item.key) if self._record is not None
                          else None)
            run.pid, run.proc = self._launch(item, env, theirs, ids)
        except (OSError, ValueError, TypeError, wall.WallError) as e:
            self._close_run_fds(run)
            self._remove_stdin(run)
            if run.record is None and self._record is not None and isinstance(e, OSError):
                why = (f"could not record the item's process in the data folder on member "
                       f"{self._member} ({e.strerror or e}): check its disk")
            else:
                why = _start_error(item, argv0, e, self._member)
            self._forget(run.record)
            self._report_unstarted(item, "failed", started_ms, why)
            return
        finally:
            for fd in theirs:
                os.close(fd)
        def reap() -> None:
            # Out of descriptors, or its record cannot be written: the member cannot supervise
            # it, so it stops here rather than leave a process it cannot watch or find again.
            self._wait(run)
            self._close_run_fds(run)
            self._remove_stdin(run)
            self._forget(run.record)

        if self._record is not None and run.record is not None:
            try:
                self._record.started(run.record, run.pid)
            except OSError:
                _killpg(run.pid, signal.SIGKILL)
                reap()
                raise
        run.pidfd = pidwatch.open_pidfd(run.pid, reap)
        if item.runtime_s is not None:
            run.deadline = time.monotonic() + item.runtime_s
        self._runs[item.key] = run
        with self._lock:
            self._spools[item.key] = (run.out, run.err, False)
        self._sel.register(run.pidfd, selectors.EVENT_READ, run)
        for pipe in run.pipes:
            events = selectors.EVENT_READ if pipe.capture is not None else selectors.EVENT_WRITE
            self._sel.register(pipe.fd, events, pipe)
        self._log.debug("item_started", job=item.job_id, index=item.index, epoch=item.epoch,
                        pid=run.pid)

    def _launch(self, item: Run, env: dict[str, str], fds: list[int],
                ids: dict[str, Any]) -> tuple[int, subprocess.Popen[bytes] | None]:
        """Start the item's program on the stdin, stdout and stderr `fds`, in a new session;
        its pid, and its Popen when it was started that way.

        posix_spawn (meshjobs.spawn: vfork and exec, no Python in the child) unless the item
        runs as another user; subprocess.Popen then, and whenever posix_spawn fails: Popen
        then fails too, and says exactly why, as it always did. Behind the wall, the argv is
        the launcher's (meshjobs.wall), its program resolved first so a missing one is said
        as clearly as without it."""
        walled = self._walled(item.argv, env)
        if walled is not None:
            item = dataclasses.replace(item, argv=walled)
        if not ids and min(fds) > 2 and spawn.available():
            path = item.argv[0] if "/" in item.argv[0] else _which(item.argv[0], env)
            if path is not None:
                try:
                    return spawn.spawn(path, item.argv, env, (fds[0], fds[1], fds[2]),
                                       item.cwd), None
                except (OSError, ValueError, TypeError):
                    pass
        proc = subprocess.Popen(item.argv, stdin=fds[0], stdout=fds[1], stderr=fds[2],
                                cwd=item.cwd, env=env, start_new_session=True, close_fds=True,
                                **ids)
        return proc.pid, proc

    def _walled(self, argv: list[str], env: dict[str, str]) -> list[str] | None:
        """`argv` behind the wall (None: no wall). Raises FileNotFoundError or PermissionError
        when its program is missing or may not run (meshjobs.wall.program_path)."""
        rules = self.wall_rules()
        if rules is None:
            return None
        return wall.wrap(rules, wall.program_path(argv[0], env), argv, env)

    def wall_rules(self) -> wall.Rules | None:
        """The wall's rules as the filesystem is now (computed again when a folder around a
        denied path changed); None: no wall."""
        if self._wall_denied is None:
            return None
        if self._wall_rules is None or not wall.fresh(self._wall_rules):
            self._wall_rules = wall.rules(self._wall_denied)
        return self._wall_rules

    def _walled_cwd_hint(self, item: Run) -> str | None:
        """For a failed item whose working directory holds a path walled off from items (the
        data folder's own folder, the quick start's): it may not create files there, which is
        most likely why it failed; say so and what to do."""
        rules = self._wall_rules
        if rules is None:
            return None
        try:
            cwd = os.path.realpath(item.cwd if item.cwd is not None else os.getcwd())
        except OSError:
            return None
        if cwd == "/" or not any(folder == cwd for folder, _ in rules.stamp):
            return None
        return (f"note: its working directory {cwd} holds meshd's data folder, and items may "
                f"not create or remove files directly in it (the wall around items keeps the "
                f"data folder out of their reach): submit with another --cwd, or keep meshd's "
                f"data folder elsewhere (--data)")

    def _forget(self, seq: int | None) -> None:
        """A process was reaped, or did not start: its end in the log (meshjobs.leftovers)."""
        if self._record is not None:
            self._record.forget(seq)

    def _remove_stdin(self, run: _Run) -> None:
        if run.stdin_path is not None:
            self._remove((run.stdin_path,))

    def _open_stdin(self, run: _Run, path: str, theirs: list[int]) -> str | None:
        """Give the child its stdin (appended to `theirs`): nothing (/dev/null), a pipe fed
        with a small payload, or a large payload's spool file. Why it could not, or None."""
        item = run.item
        if item.stdin is None:
            theirs.append(os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC))
            return None
        data = b""
        if item.stdin != EMPTY_DIGEST:
            missing = f"stdin blob {item.stdin} is not on this member: submit its stdin again"
            try:
                size = self._blobs.size(item.stdin)
                if size is None:
                    return missing
                if size > limits.item_stdin_pipe_bytes_max:
                    run.stdin_path = path
                    error = self._spool_stdin(item, path)
                    if error is None:
                        theirs.append(os.open(path, os.O_RDONLY | os.O_CLOEXEC))
                    return error
                got = self._blobs.get(item.stdin)
            except KeyError:
                return missing
            except BlobError as e:
                return f"stdin blob {item.stdin} is unreadable on this member ({e}): " \
                       "submit it again"
            if got is None:
                return missing
            data = got
        r, w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        os.set_blocking(r, True)
        theirs.append(r)
        view = memoryview(data)
        if view:
            # What fits in the pipe now; the rest as the item reads (the driver's selector).
            view = view[os.write(w, view):]
        if view:
            run.pipes.append(_Pipe(run, w, None, view))
        else:
            os.close(w)
        return None

    def _on_pipe(self, pipe: _Pipe) -> None:
        """One of a run's pipes is ready: read its output, or feed its stdin."""
        if pipe.fd < 0:
            return  # closed earlier in this round of events
        if pipe.capture is None:
            assert pipe.data is not None
            try:
                pipe.data = pipe.data[os.write(pipe.fd, pipe.data):]
            except BlockingIOError:
                return
            except OSError:  # the item closed its stdin (EPIPE): what is left is not wanted
                pipe.data = pipe.data[:0]
            if not pipe.data:
                self._close_pipe(pipe)
            return
        try:
            more = pipe.capture.take(pipe.fd)
        except BlockingIOError:
            return
        if not more:
            self._close_pipe(pipe)

    def _close_pipe(self, pipe: _Pipe) -> None:
        self._sel.unregister(pipe.fd)
        os.close(pipe.fd)
        pipe.fd = -1
        pipe.run.pipes.remove(pipe)

    def _drain(self, run: _Run) -> None:
        """The run's group is dead: take what its output pipes still hold and close them all.
        Bounded: a process that left the group (setsid) may hold a pipe open and write on."""
        for pipe in list(run.pipes):
            if pipe.capture is not None:
                for _ in range(limits.item_drain_reads_max):
                    try:
                        if not pipe.capture.take(pipe.fd):
                            break
                    except BlockingIOError:
                        break
            self._close_pipe(pipe)

    def _close_run_fds(self, run: _Run) -> None:
        """Close a run's pipes that were never registered (it did not start)."""
        for pipe in run.pipes:
            os.close(pipe.fd)
            pipe.fd = -1
        run.pipes.clear()
        run.out.close()
        run.err.close()

    @staticmethod
    def _wait(run: _Run) -> int:
        """Reap the run's leader; its return code as Popen gives it."""
        if run.proc is not None:
            return run.proc.wait()
        _pid, status = os.waitpid(run.pid, 0)
        return os.waitstatus_to_exitcode(status)

    @property
    def item_user(self) -> str | None:
        """The user items no job or pool names a user for run as here (None: meshd's own uid,
        when this member may not switch users)."""
        return self._item_user

    def items_run_as(self) -> str:
        """Who those items run as, in a few words (the start log, /fleet, check-config)."""
        return runas.items_run_as(self._item_user, self._may_switch)

    def check_user(self, user: str) -> str | None:
        """Why this member cannot run items as `user`, or None when it can (any thread: it
        reads the user database, nothing of the driver's)."""
        try:
            self._identity(user)
        except runas.RunAsError as e:
            return e.message
        return None

    def _identity(self, user: str) -> runas.Identity:
        """The ids `user` runs with here; RunAsError when this member cannot run items so."""
        ident = runas.resolve(user, self._member)
        why = runas.refusal(user, ident, self._member, self._may_switch, os.geteuid(),
                            os.getegid())
        if why is not None:
            raise runas.RunAsError(why)
        return ident

    def _spool_stdin(self, item: Run, path: str) -> str | None:
        """Write the item's stdin blob to path; return why it could not, or None."""
        if item.stdin is None:
            return None
        missing = f"stdin blob {item.stdin} is not on this member: submit its stdin again"
        try:
            with open(path, "wb", opener=private_opener) as f:
                chunks = self._blobs.open(item.stdin)
                if chunks is None:
                    return missing
                for chunk in chunks:
                    f.write(chunk)
        except KeyError:
            return missing
        except BlobError as e:
            return f"stdin blob {item.stdin} is unreadable on this member ({e}): submit it again"
        except OSError as e:
            # A full or broken spool disk fails this item rather than the member, so one job's
            # huge stdin cannot take members down one after another.
            return f"could not spool stdin on member ({e.strerror or e}): free disk space"
        return None

    def _cut_run(self, run: _Run) -> None:
        if run.reason is not None:
            return  # Already being ended; the first reason stands.
        run.reason = "cut"
        run.deadline = None
        run.kill_at = time.monotonic() + limits.cut_grace_ms / 1000
        _killpg(run.pid, signal.SIGTERM)

    def _check_deadlines(self) -> None:
        now = time.monotonic()
        for run in self._runs.values():
            if run.deadline is not None and now >= run.deadline:
                run.deadline = None
                run.reason = "timeout"
                _killpg(run.pid, signal.SIGKILL)
            if run.kill_at is not None and now >= run.kill_at:
                run.kill_at = None
                _killpg(run.pid, signal.SIGKILL)

    def _reap(self, run: _Run) -> None:
        """The leader exited: kill what it left in its group, reap it, report the end."""
        self._sel.unregister(run.pidfd)
        os.close(run.pidfd)
        # The leader is a zombie until wait(), so its pid (the group id) is still ours.
        _killpg(run.pid, signal.SIGKILL)
        returncode = self._wait(run)
        self._forget(run.record)
        ended_ms = self._clock_ms()
        # The group is dead: what it wrote is in the pipes (or was read already).
        self._drain(run)
        del self._runs[run.item.key]
        self._finish(run, returncode, ended_ms)

    def _finish(self, run: _Run, returncode: int, ended_ms: int) -> None:
        """Store the outputs (durable), report the end, drop the spool files.

        Kept in one place so the puts can move to the blob writer threads.
        """
        item = run.item
        with self._lock:
            if item.key in self._spools:
                self._spools[item.key] = (run.out, run.err, True)
        rc: int | None = returncode
        sig: int | None = None
        if returncode < 0:
            rc, sig = None, -returncode
        if run.reason is not None:
            state = run.reason
        else:
            state = "done" if returncode == 0 else "failed"
        self._log.debug("item_ended", job=item.job_id, index=item.index, epoch=item.epoch,
                        pid=run.pid, rc=rc, signal=sig, state=state)
        self._remove_stdin(run)
        sources = (run.out.source(), run.err.source())
        why = None if state == "cut" else self._write_paths(item, sources)
        dropped = [c.error for c in (run.out, run.err) if c.error is not None]
        hint = self._walled_cwd_hint(item) if state == "failed" else None
        if dropped or hint:
            why = "; ".join(([why] if why else []) + dropped + ([hint] if hint else []))[
                :limits.item_error_chars_max]
        if self._writers is None:
            stdout, stderr = (self._blobs.put(src) if isinstance(src, bytes)
                              else self._blobs.put_file(src) for src in sources)
            self._pin_outputs(item.job_id, stdout, stderr)
            self._remove(tuple(src for src in sources if isinstance(src, str)))
            self._report(ItemEnded(item.job_id, item.index, item.epoch, state, rc, sig, stdout,
                                 stderr, run.started_ms, ended_ms, why))
            return
        # The writers make both outputs durable (one fsync for many items) and remove their
        # spool files; the end is reported once both are durable, from a writer thread. An empty
        # output is the empty blob, stored and pinned for good when the member starts.
        futs: list[Future] = []
        for src in sources:
            if not src:
                done: Future = Future()
                done.set_result(EMPTY_DIGEST)
                futs.append(done)
            elif isinstance(src, bytes):
                futs.append(self._writers.put(src, owner=item.job_id))
            else:
                futs.append(self._writers.put_file(src, owner=item.job_id, remove=True))
        self._when_stored(item, futs, lambda stdout, stderr: ItemEnded(
            item.job_id, item.index, item.epoch, state, rc, sig, stdout, stderr,
            run.started_ms, ended_ms, why))

    def _when_stored(self, item: Run, futs: list[Future],
                     make_end: Callable[[str, str], ItemEnded]) -> None:
        """Report make_end(stdout, stderr) once both outputs are durable (from a writer thread,
        or at once when both were durable already)."""
        left = [len(futs)]
        lock = threading.Lock()

        def stored(_fut: Any) -> None:
            with lock:
                left[0] -= 1
                if left[0]:
                    return
            try:
                stdout, stderr = (f.result() for f in futs)
            except BaseException as exc:  # the store failed: the member must stop
                self._log.critical("outputs_not_stored", job=item.job_id, index=item.index,
                                   error=repr(exc))
                if self._on_fatal is None:
                    raise
                self._on_fatal(exc)
                return
            self._report(make_end(stdout, stderr))

        for fut in futs:
            fut.add_done_callback(stored)

    # --- Python items --------------------------------------------------------------------------

    def _python_pool(self, user: str | None) -> PyPool:
        """The workers that run as `user` (None: meshd's own), started when first wanted.
        RunAsError when this member cannot run them as that user."""
        pool = self._pools.get(user)
        if pool is None:
            size = self._py_sizes.get(user) or self._python_workers
            if size is None:
                size = min(os.cpu_count() or 1, limits.py_workers_max)
            ident = None if user is None else self._identity(user)
            if ident is not None and (ident.uid, ident.gid) == (os.geteuid(), os.getegid()):
                ident = None  # meshd's own user: nothing to switch
            pool = self._pools[user] = PyPool(max(1, size), self._sel, self._py_load,
                                              self._py_finish, self._clock_ms, self._log,
                                              env=self._base_env, user=ident,
                                              wall_rules=self.wall_rules, record=self._record)
            pool.start()
        return pool

    def _run_user(self, item: Run) -> str | None:
        """Who a command item runs as: its job's user, else its pool's, else (when this member
        may switch users) the member's item user; None: meshd's own uid."""
        return item.user if item.user is not None else self._item_user

    def _py_user(self, item: Run) -> str | None:
        """Who a python item's workers run as: its pool's user (None: meshd's own)."""
        if item.pool is not None and item.pool in self._py_users:
            return self._py_users[item.pool]
        return self._item_user

    def _py_start(self, item: Run) -> None:
        if not item.argv:
            self._report_unstarted(item, "failed", self._clock_ms(),
                                   "empty argv: give the job's argv[0] as 'package.module:function'")
            return
        pool_user = self._py_user(item)
        try:
            if item.user is not None:
                # The job's user (or the pool's own, which Run.user carries when the job names
                # none): a python pool's workers all run as one user, so it must be that one.
                ident = runas.resolve(item.user, self._member)
                if pool_user is None:
                    own = (os.geteuid(), os.getegid())
                    workers = f"meshd's own user (uid {own[0]})"
                else:
                    mine = runas.resolve(pool_user, self._member)
                    own = (mine.uid, mine.gid)
                    workers = f"user {pool_user!r} (uid {mine.uid})"
                if (ident.uid, ident.gid) != own:
                    self._report_unstarted(
                        item, "failed", self._clock_ms(),
                        f"python pool{' ' + item.pool if item.pool else ''} on member "
                        f"{self._member} calls "
                        f"functions in workers that run as {workers}: they cannot run as user "
                        f"{item.user!r}; submit without --user (or with that pool's user), or "
                        f"use a command pool")
                    return
            pool = self._python_pool(pool_user)
        except runas.RunAsError as e:
            self._report_unstarted(item, "failed", self._clock_ms(), e.message)
            return
        if item.inherit_env:
            item = dataclasses.replace(item, env={**self._full_env, **item.env})
        pool.submit(item)

    def _py_load(self, item: Run) -> bytes | str:
        """The item's stdin payload, or why it cannot be had."""
        if item.stdin is None:
            return b""
        missing = f"stdin blob {item.stdin} is not on this member: submit its stdin again"
        try:
            size = self._blobs.size(item.stdin)
            if size is None:
                return missing
            if size > limits.py_request_bytes_max:
                return (f"stdin of {size} bytes is over the python pool's limit of "
                        f"{limits.py_request_bytes_max} bytes (py_request_bytes_max): use a "
                        f"command pool, or pass a path or a blob digest instead")
            data = self._blobs.get(item.stdin)
        except KeyError:
            return missing
        except BlobError as e:
            return f"stdin blob {item.stdin} is unreadable on this member ({e}): submit it again"
        if data is None:
            return missing
        return data

    def _py_finish(self, end: PyEnd) -> None:
        """Store a python call's outputs (durable), then report its end."""
        item = end.item
        self._log.debug("item_ended", job=item.job_id, index=item.index, epoch=item.epoch,
                        rc=end.rc, signal=end.signal, state=end.state, error=end.error)
        why = None
        if end.stdout is not None and end.stderr is not None:
            why = self._write_paths(item, (end.stdout, end.stderr))
            if why is not None:
                end = dataclasses.replace(end, error=why if end.error is None
                                          else f"{end.error}; {why}"[:limits.item_error_chars_max])
        if end.stdout is None or end.stderr is None:
            self._report(ItemEnded(item.job_id, item.index, item.epoch, end.state, end.rc,
                                 end.signal, None, None, end.started_ms, end.ended_ms, end.error))
            return
        if self._writers is None:
            stdout = self._blobs.put(end.stdout)
            stderr = self._blobs.put(end.stderr)
            self._pin_outputs(item.job_id, stdout, stderr)
            self._report(ItemEnded(item.job_id, item.index, item.epoch, end.state, end.rc,
                                 end.signal, stdout, stderr, end.started_ms, end.ended_ms,
                                 end.error))
            return
        # An empty output is the empty blob, stored and pinned for good when the member starts.
        futs: list[Future] = []
        for data in (end.stdout, end.stderr):
            if data:
                futs.append(self._writers.put(data, owner=item.job_id))
            else:
                done: Future = Future()
                done.set_result(EMPTY_DIGEST)
                futs.append(done)
        self._when_stored(item, futs, lambda stdout, stderr: ItemEnded(
            item.job_id, item.index, item.epoch, end.state, end.rc, end.signal, stdout, stderr,
            end.started_ms, end.ended_ms, end.error))

    def _write_paths(self, item: Run, sources: tuple[outpaths.Source, outpaths.Source]
                     ) -> str | None:
        """Write the outputs to the job's --stdout/--stderr paths (as the item's user); why
        some could not be, or None."""
        if item.stdout_path is None and item.stderr_path is None:
            return None
        ids = None
        user = self._py_user(item) if item.kind == "python" else self._run_user(item)
        if user is not None and self._may_switch:
            try:
                ident = self._identity(user)
            except runas.RunAsError as e:
                return f"outputs not written to their paths: {e.message}"
            if (ident.uid, ident.gid) != (os.geteuid(), os.getegid()):
                ids = {"user": ident.uid, "group": ident.gid, "extra_groups": list(ident.groups)}
        return outpaths.write_outputs((item.stdout_path, item.stderr_path), sources, item.cwd,
                                      ids, self._member)

    def _pin_outputs(self, job_id: str, *digests: str) -> None:
        """Without the writers (which pin in the same transaction), pin outputs for their job."""
        pin = getattr(self._blobs, "pin", None)
        if pin is not None:
            for d in digests:
                pin(d, job_id)

    def _report_unstarted(self, item: Run, state: str, started_ms: int,
                          error: str | None) -> None:
        self._log.debug("item_ended", job=item.job_id, index=item.index, epoch=item.epoch,
                        pid=None, rc=None, state=state, error=error)
        self._report(ItemEnded(item.job_id, item.index, item.epoch, state, None, None, None, None,
                             started_ms, self._clock_ms(), error))

    def _report(self, end: ItemEnded) -> None:
        key = (end.job_id, end.index, end.epoch)
        with self._lock:
            if self._stopping:
                return
        self._on_end(end)
        # Forgotten only after on_end, so a running() snapshot never misses a run whose end
        # is not yet in the jobs thread's inbox.
        with self._lock:
            self._accepted.discard(key)
            self._cuts.discard(key)
            self._spools.pop(key, None)

    def _shutdown(self) -> None:
        for pool in self._pools.values():
            pool.stop()
        for run in self._runs.values():
            _killpg(run.pid, signal.SIGKILL)
        for run in self._runs.values():
            self._wait(run)
            self._forget(run.record)
            self._sel.unregister(run.pidfd)
            os.close(run.pidfd)
            for pipe in list(run.pipes):
                self._close_pipe(pipe)
            run.out.close()
            run.err.close()
            self._remove_stdin(run)
            self._remove((run.out.path, run.err.path))
        self._runs.clear()
        self._sel.close()
        with self._lock:
            self._stopping = True
            self._closed = True
            self._starts.clear()
            self._cuts.clear()
            self._accepted.clear()
            self._spools.clear()
            os.close(self._wake_r)
            os.close(self._wake_w)

    # --- Spool files ---------------------------------------------------------------------------

    def _clear_spool(self) -> None:
        for name in os.listdir(self._spool_dir):
            if name.startswith(_SPOOL_PREFIX):
                try:
                    os.unlink(os.path.join(self._spool_dir, name))
                except FileNotFoundError:
                    pass

    @staticmethod
    def _remove(paths: tuple[str, ...]) -> None:
        for path in paths:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass


_killpg = pidwatch.killpg


def _which(name: str, env: dict[str, str]) -> str | None:
    """The program `name` (no slash in it) as Popen would find it on the item's PATH; None
    when it is not there, or when Popen should decide (a relative folder on the PATH)."""
    for folder in os.get_exec_path(env):
        if not folder.startswith("/"):
            return None
        path = os.path.join(folder, name)
        if os.access(path, os.X_OK) and not os.path.isdir(path):
            return path
    return None


def _cwd_error(cwd: str, member: str, why: str) -> str:
    return (f"working directory '{cwd}' is not usable on member {member} ({why}): create it "
            f"there, or submit with another --cwd (or --no-cwd: the member's own folder)")


def _start_error(item: Run, argv0: str, e: Exception, member: str = "") -> str:
    """Say why the item's program could not start, and what to do about it."""
    if isinstance(e, wall.WallError):
        return str(e)
    if isinstance(e, OSError):
        why = e.strerror or str(e)
        if item.cwd is not None and e.filename == item.cwd and argv0 != item.cwd:
            return _cwd_error(item.cwd, member, why)
        if isinstance(e, FileNotFoundError):
            return f"no such program '{argv0}' on member: install it or fix the job's argv"
        if isinstance(e, PermissionError):
            return (f"program '{argv0}' may not run on member ({why}): "
                    f"make it executable or fix the job's argv")
        return f"could not start '{argv0}' on member ({why}): fix the job's argv"
    return f"could not start '{argv0}' ({e}): fix the job's argv or env"


def is_reaper() -> bool:
    """Are orphaned descendants re-parented to this process? It is PID 1 (of its PID namespace),
    or a child subreaper (prctl PR_SET_CHILD_SUBREAPER, which survives an exec)."""
    if os.getpid() == 1:
        return True
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        flag = ctypes.c_int(0)
        if libc.prctl(PR_GET_CHILD_SUBREAPER, ctypes.byref(flag), 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):  # not Linux, or no prctl: nothing is re-parented to us
        return False
    return flag.value != 0


def _children() -> set[int] | None:
    """The pids of this process's children (of all its threads), or None when the kernel does
    not list them (no CONFIG_PROC_CHILDREN)."""
    if not os.path.exists(f"/proc/self/task/{os.getpid()}/children"):
        return None
    pids: set[int] = set()
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/children", "rb") as f:
                pids.update(int(p) for p in f.read().split())
        except OSError:
            continue  # the thread ended meanwhile
    return pids


def reap_orphans(own: set[int]) -> int:
    """Reap the zombies among this process's children that it did not start (orphans re-parented
    to it); leave `own` (children whose waits report their ends) alone. Returns how many."""
    me = os.getpid()
    candidates = _children()
    if candidates is None:
        candidates = {int(p) for p in os.listdir("/proc") if p.isdigit()}
    reaped = 0
    for pid in sorted(candidates - own):
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses.
        fields = stat[stat.rfind(b")") + 2:].split()
        if len(fields) < 2 or fields[0] != b"Z" or int(fields[1]) != me:
            continue
        try:
            got, _status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            continue
        if got == pid:
            reaped += 1
    return reaped


def _pool_user_refused(item: Run, member: str) -> str | None:
    """Why an item may not run as its pool's user: the job's submitter may not run as it
    (Run.run_as, meshjobs/identity.py Rule 2); None when it may, or nothing bounds it."""
    if item.run_as is None or item.user is None:
        return None
    if identity.user_allowed(item.run_as, item.user, runas.is_root):
        return None
    return (f"the pool of this job runs its items as user {item.user!r} on member {member}, "
            f"and the job's submitter may run as: {identity.allowed_text(item.run_as)}; submit "
            "with a user it may run as, to a pool whose user it may run as, or ask the "
            "operator to add the user to the token's run_as")
