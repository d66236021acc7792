"""The python pool: pre-forked `meshjobs.pyworker` processes that the driver thread hands items to.

Theory of operation. The pool is no thread of its own: the driver thread owns it and calls it.
Each worker is a `python -m meshjobs.pyworker` process in its own session, with a request pipe
(its stdin), an answer pipe (its stdout) and a pidfd, all three registered on the driver's one
selector (non-blocking), so the driver thread waits on workers and command items alike. Frames
are described in meshjobs.pyworker. A worker is `starting` until its ready frame, then `idle` or
`busy` with one call; it runs until it dies or is killed.

Rules:
1. Only the driver thread calls the pool (`submit`, `cut`, `on_event`, `check`, `stop`).
2. Items wait in the pool's queue (bounded by the driver's: every item in it is accepted) until
   a worker is ready; an item's stdin is loaded only when a worker takes it, so waiting items
   hold no payload.
3. A call ends exactly once, through `on_end`: with the worker's answer; or, when the worker
   dies first, "failed" (or "timeout" or "cut" when the pool killed it for that reason). A
   worker the pool killed or that died is reaped and replaced at once; one that died before it
   was ready is replaced after limits.py_worker_respawn_ms, and if no worker is ready then, the
   waiting items fail (the member cannot run python items until a worker starts).
4. Killing a worker kills its whole process group (SIGKILL) before it is reaped, so nothing a
   function started outlives its worker.
5. Garbage on an answer pipe (a frame too large, or not msgpack) is WorkerProtocolError: the
   worker is killed and its item fails saying so; the member carries on.
6. A pool may run its workers as a user (`user`: meshjobs.runas.Identity): they start with that
   uid, gid and supplementary groups, that user's HOME, USER and LOGNAME, and its HOME (or /tmp)
   as their folder, never meshd's. A worker that cannot start as that user (it cannot read
   meshjobs or python's own modules) is a start failure that names the user.
"""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgpack
import structlog

from meshjobs import leftovers, limits, pidwatch, pyworker, runas, wall
from meshjobs.itemenv import base_env

RunKey = tuple[str, int, int]  # (job_id, index, epoch)
_READ_BYTES = limits.py_read_bytes
# The folder meshjobs itself was imported from: first on the workers' PYTHONPATH, so a worker runs
# the same meshjobs as its member whatever the member's cwd or installed copies.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(pyworker.__file__)))


class WorkerProtocolError(Exception):
    """A worker sent something that is not a well-formed answer."""


@dataclass(frozen=True)
class PyEnd:
    """How one python call ended. stdout and stderr are None only when no worker took the item
    (then error says why)."""

    item: Any  # the driver's Run
    state: str  # done | failed | timeout | cut
    rc: int | None
    signal: int | None
    stdout: bytes | None
    stderr: bytes | None
    started_ms: int
    ended_ms: int
    error: str | None


class _Worker:
    """One worker process; touched by the driver thread only."""

    __slots__ = ("owner", "proc", "pidfd", "r_fd", "w_fd", "rbuf", "wbuf", "writing", "ready",
                 "start_by", "item", "started_ms", "deadline", "reason", "dead", "closed",
                 "record")

    def __init__(self, owner: PyPool, proc: subprocess.Popen[bytes], pidfd: int,
                 start_by: float, record: int | None = None) -> None:
        assert proc.stdin is not None and proc.stdout is not None
        self.owner = owner  # the pool that started it (a member may have one per user)
        self.proc = proc
        self.pidfd = pidfd
        self.r_fd = proc.stdout.fileno()
        self.w_fd = proc.stdin.fileno()
        self.rbuf = bytearray()
        self.wbuf = memoryview(b"")  # the rest of the request being written
        self.writing = False  # w_fd is registered for EVENT_WRITE
        self.ready = False
        self.start_by: float | None = start_by  # time.monotonic() its ready frame is due by
        self.item: Any = None  # the Run of the call it is making
        self.started_ms = 0
        self.deadline: float | None = None  # time.monotonic() when the item's runtime passes
        self.reason: str | None = None  # "timeout" or "cut" once the pool killed it for that
        self.dead = False  # killed, or closed its answer pipe (its pidfd is still to fire)
        self.closed = False  # reaped: its descriptors are closed (their numbers may be reused)
        self.record = record  # its number in the log of running processes (meshjobs.leftovers)


class PyPool:
    """Python workers on the driver's selector; see the module docstring for its rules."""

    def __init__(
        self,
        size: int,
        sel: selectors.BaseSelector,
        load: Callable[[Any], bytes | str],
        on_end: Callable[[PyEnd], None],
        clock_ms: Callable[[], int],
        log: Any = None,
        env: dict[str, str] | None = None,
        user: runas.Identity | None = None,
        wall_rules: Callable[[], Any] | None = None,
        record: leftovers.Record | None = None,
    ) -> None:
        """env: the workers' environment (meshjobs.itemenv.base_env of meshd's; that of the
        default list when None), to which the pool adds what python needs to start a worker.

        user: who the workers run as (None: meshd's own user, in meshd's folder).
        wall_rules: the Landlock rules (meshjobs.wall.Rules, or None) each worker starts
        behind. A worker serves the items of many jobs, so it is one Landlock domain: walled
        off from meshd's files and from signalling meshd, not from the other items it runs.
        record: where each worker is recorded while it runs (meshjobs.leftovers; None: not)."""
        if size < 1:
            raise ValueError(f"a python pool needs at least one worker, not {size}")
        self._size = size
        self._sel = sel
        self._load = load  # an item's stdin payload, or why it could not be read
        self._on_end = on_end
        self._clock_ms = clock_ms
        self._log = log if log is not None else structlog.get_logger(__name__)
        self._env = dict(env if env is not None else base_env(os.environ))
        self._user = user
        self._ids: dict[str, Any] = {}
        self._cwd: str | None = None
        if user is not None:
            # extra_groups always: without it a worker would keep meshd's supplementary groups.
            self._ids = {"user": user.uid, "group": user.gid, "extra_groups": list(user.groups)}
            self._cwd = runas.item_cwd(user)
            for name in runas.IDENTITY_VARS:
                self._env.pop(name, None)
            self._env.update(user.env())
        self._wall_rules = wall_rules
        self._record = record
        self._workers: list[_Worker] = []
        self._queue: deque[Any] = deque()
        self._respawn_at: float | None = None
        self._last_start_failure = ""
        self._stopped = False

    # --- The driver's calls --------------------------------------------------------------------

    def start(self) -> None:
        """Spawn the workers (they get ready in the background)."""
        for _ in range(self._size - len(self._workers)):
            self._spawn()

    def submit(self, item: Any) -> None:
        """Queue an item; it is handed to the first ready worker. With limits.driver_queue_max
        items waiting already, it fails at once (the leader leases no more than the slots, so
        only a broken lease count gets there)."""
        if len(self._queue) >= limits.driver_queue_max:
            now = self._clock_ms()
            self._on_end(PyEnd(item, "failed", None, None, None, None, now, now,
                               f"{len(self._queue)} python items wait on this member already "
                               f"(driver_queue_max)"))
            return
        self._queue.append(item)
        self._assign()

    def cut(self, key: RunKey) -> bool:
        """End that item: a waiting one is reported "cut" at once, a running one when its
        worker (killed now) is reaped. False when the pool does not hold it."""
        for item in self._queue:
            if item.key == key:
                self._queue.remove(item)
                now = self._clock_ms()
                self._on_end(PyEnd(item, "cut", None, None, None, None, now, now, None))
                return True
        for w in self._workers:
            if w.item is not None and w.item.key == key:
                if w.reason is None:
                    w.reason = "cut"
                    w.deadline = None
                    self._kill(w)
                return True
        return False

    def on_event(self, data: tuple[_Worker, str], mask: int) -> None:
        """A worker's descriptor is ready: `data` is what the pool registered with it."""
        w, what = data
        if w.closed or (what == "r" and w.dead):
            return  # an event of the same select() round, for a worker reaped or killed since
        if what == "pid":
            self._reap(w)
        elif what == "w":
            self._write(w)
        elif what == "r":
            self._read(w)
        else:
            raise AssertionError(f"unknown pool registration {what!r}")

    def pids(self) -> set[int]:
        """The worker processes this pool started and has not reaped yet."""
        return {w.proc.pid for w in self._workers}

    def next_deadline(self) -> float | None:
        """The soonest time.monotonic() at which `check` has something to do."""
        times = [t for w in self._workers for t in (w.deadline, w.start_by) if t is not None]
        if self._respawn_at is not None:
            times.append(self._respawn_at)
        return min(times) if times else None

    def check(self) -> None:
        """Kill workers past their runtime limit or start deadline; respawn when due."""
        now = time.monotonic()
        for w in self._workers:
            if w.deadline is not None and now >= w.deadline:
                w.deadline = None
                if w.reason is None:  # a cut that came first stands
                    w.reason = "timeout"
                self._kill(w)
            if w.start_by is not None and now >= w.start_by:
                w.start_by = None
                self._last_start_failure = (f"not ready within {limits.py_worker_start_s_max} s "
                                            f"(py_worker_start_s_max)")
                self._kill(w)
        if self._respawn_at is not None and now >= self._respawn_at:
            self._respawn_at = None
            if not self._stopped:
                self.start()

    def stop(self) -> None:
        """Kill every worker, reap it and close its descriptors; report nothing more."""
        self._stopped = True
        for w in self._workers:
            _killpg(w.proc.pid, signal.SIGKILL)
        for w in self._workers:
            w.proc.wait()
            self._forget(w.record)
            self._close(w)
        self._workers.clear()
        self._queue.clear()

    # --- Workers ---------------------------------------------------------------------------------

    def _spawn(self) -> None:
        # A worker sees the items' environment, not meshd's (its secrets stay out of the jobs'
        # functions), plus what python needs to start as meshd did: meshd's PYTHONHOME, and its
        # PYTHONPATH behind meshjobs' own folder. They are read at each start, as meshd's own.
        env = dict(self._env)
        path = os.environ.get("PYTHONPATH")
        env["PYTHONPATH"] = _ROOT + (os.pathsep + path if path else "")
        if "PYTHONHOME" in os.environ:
            env["PYTHONHOME"] = os.environ["PYTHONHOME"]
        # The worker dies with the driver thread (pyworker.main: PR_SET_PDEATHSIG), which it
        # checks against meshd's pid.
        argv = [sys.executable, "-m", "meshjobs.pyworker", str(os.getpid())]
        rules = self._wall_rules() if self._wall_rules is not None else None
        if rules is not None:
            try:
                argv = wall.wrap(rules, sys.executable, argv, env)
            except wall.WallError as e:
                self._start_failed(None, str(e))
                return
        entry = None
        try:
            # Recorded before it starts (meshjobs.leftovers): a later meshd ends it if this one
            # dies first.
            entry = self._record.begin("worker", None) if self._record is not None else None
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True,
                close_fds=True, env=env, cwd=self._cwd, **self._ids)
        except OSError as e:
            # Out of memory or processes, for now: try again later, as for a worker that died
            # before it was ready.
            self._forget(entry)
            what = ("could not record a python worker in the data folder" if self._record is not None
                    and entry is None else f"could not spawn {sys.executable}{self._as()}")
            self._start_failed(None, f"{what}: {e.strerror or e}")
            return

        def reap() -> None:
            # Out of descriptors, or its record cannot be written: the member cannot supervise
            # a worker it cannot watch or find again.
            proc.wait()
            self._forget(entry)
            for pipe in (proc.stdin, proc.stdout):
                if pipe is not None:
                    pipe.close()

        if self._record is not None and entry is not None:
            try:
                self._record.started(entry, proc.pid)
            except OSError:
                _killpg(proc.pid, signal.SIGKILL)
                reap()
                raise
        pidfd = pidwatch.open_pidfd(proc.pid, reap)
        w = _Worker(self, proc, pidfd, time.monotonic() + limits.py_worker_start_s_max, entry)
        os.set_blocking(w.r_fd, False)
        os.set_blocking(w.w_fd, False)
        self._sel.register(pidfd, selectors.EVENT_READ, (w, "pid"))
        self._sel.register(w.r_fd, selectors.EVENT_READ, (w, "r"))
        self._workers.append(w)
        self._log.debug("py_worker_started", pid=proc.pid,
                        uid=os.geteuid() if self._user is None else self._user.uid)

    def _forget(self, seq: int | None) -> None:
        """A worker was reaped, or did not start: its end in the log (meshjobs.leftovers)."""
        if self._record is not None:
            self._record.forget(seq)

    def _as(self) -> str:
        """Words naming the workers' user, for errors (empty when they run as meshd's)."""
        u = self._user
        if u is None:
            return ""
        return f" as user {u.name or u.uid} (uid {u.uid})"

    def _assign(self) -> None:
        while self._queue:
            w = next((w for w in self._workers if w.ready and w.item is None and not w.dead),
                     None)
            if w is None:
                return
            item = self._queue.popleft()
            started_ms = self._clock_ms()
            payload = self._load(item)
            if isinstance(payload, str):
                self._on_end(PyEnd(item, "failed", None, None, None, None, started_ms,
                                   self._clock_ms(), payload))
                continue
            req = pyworker.frame({
                "job": item.job_id, "index": item.index, "epoch": item.epoch,
                "target": item.argv[0], "payload": payload, "env": item.env, "cwd": item.cwd,
                "args": list(item.argv[1:]),
            })
            w.item = item
            w.started_ms = started_ms
            w.deadline = None if item.runtime_s is None else time.monotonic() + item.runtime_s
            w.wbuf = memoryview(req)
            self._write(w)

    def _write(self, w: _Worker) -> None:
        while w.wbuf:
            try:
                n = os.write(w.w_fd, w.wbuf)
            except BlockingIOError:
                break
            except BrokenPipeError:
                # The worker is dying; its pidfd ends the call.
                w.wbuf = memoryview(b"")
                break
            w.wbuf = w.wbuf[n:]
        want = bool(w.wbuf)
        if want and not w.writing:
            self._sel.register(w.w_fd, selectors.EVENT_WRITE, (w, "w"))
        elif not want and w.writing:
            self._sel.unregister(w.w_fd)
        w.writing = want

    def _read(self, w: _Worker) -> None:
        """Take what the answer pipe holds and act on every whole frame in it."""
        eof = False
        while True:
            try:
                chunk = os.read(w.r_fd, _READ_BYTES)
            except BlockingIOError:
                break
            if not chunk:
                eof = True
                break
            w.rbuf += chunk
            try:
                self._frames(w)
            except WorkerProtocolError as e:
                self._garbage(w, str(e))
                return
        if eof and not w.dead:
            # The worker closed its answer pipe: it is exiting; its pidfd ends what is left.
            self._sel.unregister(w.r_fd)
            w.dead = True

    def _frames(self, w: _Worker) -> None:
        limit = pyworker.answer_frame_bytes_max()
        while len(w.rbuf) >= pyworker.HEADER_BYTES:
            n = int.from_bytes(w.rbuf[:pyworker.HEADER_BYTES], "big")
            if n > limit:
                raise WorkerProtocolError(f"an answer of {n} bytes, over {limit}")
            end = pyworker.HEADER_BYTES + n
            if len(w.rbuf) < end:
                return
            body = bytes(w.rbuf[pyworker.HEADER_BYTES:end])
            del w.rbuf[:end]
            try:
                msg = msgpack.unpackb(body, raw=False)
            except (ValueError, msgpack.UnpackException) as e:
                raise WorkerProtocolError(f"an answer that is not msgpack ({e})") from None
            if not isinstance(msg, dict):
                raise WorkerProtocolError(f"an answer that is a {type(msg).__name__}, not a map")
            self._answer(w, msg)

    def _answer(self, w: _Worker, msg: dict[str, Any]) -> None:
        if msg == pyworker.READY:
            if w.ready:
                raise WorkerProtocolError("a second ready frame")
            w.ready = True
            w.start_by = None
            self._assign()
            return
        if w.item is None:
            raise WorkerProtocolError("an answer with no call under way")
        ok, out, err = msg.get("ok"), msg.get("out"), msg.get("err")
        if not isinstance(ok, bool) or not isinstance(out, bytes) or not isinstance(err, bytes):
            raise WorkerProtocolError("an answer without ok, out and err")
        why = msg.get("why")
        if why is not None and not isinstance(why, str):
            raise WorkerProtocolError("an answer whose why is not text")
        item, started_ms = w.item, w.started_ms
        w.item = None
        w.deadline = None
        state = w.reason or ("done" if ok else "failed")
        # The worker's one line (`raised ValueError: bad`) is the item's error: said by `job
        # status` and the job page instead of the bare exit 1 of a python call.
        error = why[:limits.item_error_chars_max] if why and state == "failed" else None
        self._on_end(PyEnd(item, state, 0 if ok else 1, None, out, err, started_ms,
                           self._clock_ms(), error))
        if not w.dead:
            self._assign()

    def _garbage(self, w: _Worker, why: str) -> None:
        self._log.error("py_worker_garbage", pid=w.proc.pid, why=why)
        self._kill(w)
        if w.item is not None:
            item, started_ms = w.item, w.started_ms
            w.item = None
            w.deadline = None
            msg = f"python worker sent {why}: the function wrote to the frames' descriptor?\n"
            self._on_end(PyEnd(item, "failed", None, None, b"", msg.encode(), started_ms,
                               self._clock_ms(), None))

    def _kill(self, w: _Worker) -> None:
        """SIGKILL the worker's group; its pidfd then reaps and replaces it."""
        _killpg(w.proc.pid, signal.SIGKILL)
        if not w.dead:
            w.dead = True
            self._sel.unregister(w.r_fd)

    def _reap(self, w: _Worker) -> None:
        """The worker exited: read what it answered, kill its group, reap it, replace it."""
        if not w.dead:
            self._read(w)  # an answer it sent before it exited still counts
        _killpg(w.proc.pid, signal.SIGKILL)  # the leader is a zombie: its pgid is still ours
        if not w.dead:
            w.dead = True
            self._sel.unregister(w.r_fd)
        returncode = w.proc.wait()
        self._forget(w.record)
        self._close(w)
        self._workers.remove(w)
        rc, sig = (None, -returncode) if returncode < 0 else (returncode, None)
        self._log.debug("py_worker_exited", pid=w.proc.pid, rc=rc, signal=sig,
                        ready=w.ready, item=None if w.item is None else w.item.key)
        if w.item is not None:
            item, started_ms = w.item, w.started_ms
            w.item = None
            state = w.reason or "failed"
            if state == "timeout":
                why = f"runtime limit of {item.runtime_s} s passed: the python worker was killed"
            elif state == "cut":
                why = "cut: the python worker running it was killed"
            elif sig is not None:
                why = f"the python worker died of signal {sig} during the call"
            else:
                why = f"the python worker exited with status {rc} during the call"
            self._on_end(PyEnd(item, state, None, sig, b"", (why + "\n").encode(), started_ms,
                               self._clock_ms(), None))
        if self._stopped:
            return
        if w.ready:
            self._spawn()
            return
        why = self._last_start_failure or (f"exit status {rc}" if sig is None
                                           else f"signal {sig}")

        self._last_start_failure = ""
        self._start_failed(w.proc.pid, why)

    def _start_failed(self, pid: int | None, why: str) -> None:
        """A worker could not start: python itself does not start here, for now. Wait, then
        retry; the waiting items fail unless some worker is ready to take them."""
        if self._user is not None:
            why += (f"; the workers run{self._as()}, which must be able to read "
                    f"{sys.executable}, meshjobs ({_ROOT}) and the modules on PYTHONPATH")
        self._log.error("py_worker_not_started", pid=pid, why=why)
        if self._respawn_at is None:
            self._respawn_at = time.monotonic() + limits.py_worker_respawn_ms / 1000
        if not any(x.ready for x in self._workers):
            while self._queue:
                item = self._queue.popleft()
                now = self._clock_ms()
                self._on_end(PyEnd(item, "failed", None, None, None, None, now, now,
                                   f"python workers do not start on this member ({why}): see "
                                   f"its log"))

    def _close(self, w: _Worker) -> None:
        for fd, registered in ((w.pidfd, True), (w.w_fd, w.writing), (w.r_fd, not w.dead)):
            if registered:
                try:
                    self._sel.unregister(fd)
                except (KeyError, ValueError):
                    pass
        w.writing = False
        w.closed = True
        os.close(w.pidfd)
        assert w.proc.stdin is not None and w.proc.stdout is not None
        w.proc.stdin.close()  # nothing was ever written through its buffer, so no flush fails
        w.proc.stdout.close()


_killpg = pidwatch.killpg
