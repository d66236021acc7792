"""Dumps written by a forked child, so that the jobs thread does not wait for them.

pysyncobj forks its own dump writer only when it uses its own (pickle) serializer; given ours it
calls it on the ticking thread, which then stops for the whole dump: the table turned into plain
data, packed, checksummed, written and fsynced (about 0.26 s at 100,000 finished items, seconds
at millions). `ForkedDumps` takes the place of pysyncobj's `Serializer` in a replica: `serialize`
forks, the child writes and fsyncs the dump from its copy-on-write image of the table (taken
between two ticks, so it is a committed state), and the jobs thread learns of its end from
`checkSerializing`, which pysyncobj calls at every tick.

Just before it forks, the jobs thread starts a new journal segment (`DurableJournal.
start_segment`): the entries logged from then on go there, and the older segments hold nothing
the dump and the new segment do not.

Rules:
- Rule 1: the journal loses a segment only after a dump that is whole and durable: the child
  renames `raft.dump.tmp` over `raft.dump` only after its fsync, then fsyncs the new segment and
  the folder (the dump's name and the segment's), and only then deletes the older segments
  (`journal.retire_segments`); it exits 0 after that. Only then does the member report SUCCESS,
  and pysyncobj drops the entries before the dump from memory (no file is written again, nothing
  is fsynced on the jobs thread). Any other end of the child (an error, a signal, a nonzero exit,
  a lost child) is a failed dump: the tmp file is deleted, `DumpHealth` counts it and sets the
  backoff, and the journal keeps every entry and segment (dumpfile.py, rule 3); the next dump's
  child deletes them.
- Rule 2: the child runs no code of the member but the dump: no logging, no locks, no `atexit`
  (it leaves by `os._exit`); it tells why it failed on a pipe, in a few bytes.
- Rule 3: the child dies with the member (`PR_SET_PDEATHSIG` on Linux, and it checks its parent
  after setting it): a child of a member that was killed must not write on while a restarted
  member writes dumps of its own.
- Rule 4: failpoints are counted in the member (`Failpoints.plan`): the child only does what the
  member's count says for this pass.
"""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import sys
from collections.abc import Callable
from typing import Any

import structlog
from pysyncobj.config import SERIALIZER_STATE
from pysyncobj.serializer import Serializer

from meshjobs.dumpfile import Deserializer, DumpHealth, write_dump
from meshjobs.failpoints import Failpoints
from meshjobs.journal import DurableJournal, Segments, retire_segments

log = structlog.get_logger(__name__)

_WHY_BYTES_MAX = 2000  # what a failed child says on its pipe
_PR_SET_PDEATHSIG = 1


class DumpWriteFailed(Exception):
    """The forked dump writer did not write a dump."""


def _prctl() -> Callable[[int, int], int] | None:
    """libc's prctl, loaded once in the member (not in each child), or None off Linux."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_PRCTL = _prctl()


class ForkedDumps(Serializer):
    """pysyncobj's `Serializer` with our dump format, written by a forked child.

    Loading a dump and sending or receiving one over Raft stay pysyncobj's (they read the file
    by its name); only the writing of a new dump moves to a child."""

    def __init__(
        self,
        path: str,
        transmission_batch_bytes: int,
        get_state: Callable[[], Any],
        deserializer: Deserializer,
        health: DumpHealth,
        failpoints: Failpoints | None = None,
        journal: DurableJournal | None = None,
        position: Callable[[], int] | None = None,
        on_written: Callable[[int], None] | None = None,
    ) -> None:
        # serializer=None would make pysyncobj pickle: it is never called here, as `serialize`
        # is ours; the deserializer is ours.
        super().__init__(path, transmission_batch_bytes, False, _never, deserializer, None)
        self._path = path
        self._tmp = path + ".tmp"
        self._get_state = get_state
        self._health = health
        self._failpoints = failpoints
        self._why_fd: int | None = None
        self._id: int | None = None
        self._journal = journal
        self._segments: Segments | None = None  # the child's, when it retires any
        # The table's position, as the child's copy holds it, told to `on_written` once the
        # dump is written (a leader sends it to new workers).
        self._position = position
        self._on_written = on_written
        self._writing_position: int | None = None

    # pysyncobj keeps the child's pid in its own (name-mangled) field: `getTransmissionData`
    # sends no dump while it is set, as with its own forked writer.
    @property
    def _pid(self) -> int:
        return self._Serializer__pid  # type: ignore[attr-defined,no-any-return]

    @_pid.setter
    def _pid(self, pid: int) -> None:
        self._Serializer__pid = pid

    @property
    def writing(self) -> bool:
        """A child is writing a dump now."""
        return self._pid > 0

    def serialize(self, data: Any, id: int) -> None:
        if self._pid != 0:
            return
        _, last, prev, cluster = data
        cluster_ids = sorted(getattr(node, "id", node) for node in cluster)
        planned = (self._failpoints.plan("dump.fsync", "journal.segment_fsync",
                                         "journal.segment_delete")
                   if self._failpoints is not None else None)
        # New entries go to a new segment from now on; its head is in the page cache before the
        # fork (an OSError here is the journal's: it propagates and the member stops).
        segments = self._journal.start_segment(prev[1]) if self._journal is not None else None
        self._segments = segments
        self._writing_position = self._position() if self._position is not None else None
        parent = os.getpid()
        r, w = os.pipe()
        try:
            pid = os.fork()
        except OSError as e:
            os.close(r)
            os.close(w)
            self._failed(e)
            self._pid = -2  # reported as FAILED by the next checkSerializing
            self._id = id
            return
        if pid == 0:
            self._child(parent, w, r, last, prev, cluster_ids, planned, segments)
        os.close(w)
        self._pid = pid
        self._why_fd = r
        self._id = id

    def _child(self, parent: int, w: int, r: int, last: Any, prev: Any, cluster: list[str],
               planned: Failpoints | None, segments: Segments | None) -> None:
        code = 1
        try:
            gc.disable()  # a collection would only copy pages of the member's heap
            for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                signal.signal(sig, signal.SIG_DFL)  # the member's handlers are not the child's
            os.close(r)
            if _PRCTL is not None:
                _PRCTL(_PR_SET_PDEATHSIG, signal.SIGKILL)
            if os.getppid() != parent:
                raise DumpWriteFailed("the member died before its dump writer started")
            write_dump(self._tmp, self._get_state(), last, prev, cluster, planned)
            # Renamed here, not by the member: the rename frees the old dump's blocks, which
            # takes tens of milliseconds for a dump of a million items.
            os.replace(self._tmp, self._path)
            if segments is not None:
                retire_segments(segments, planned)
            code = 0
        except BaseException as e:  # noqa: BLE001 - the child reports every failure, then exits
            with contextlib.suppress(BaseException):
                os.write(w, repr(e).encode("utf-8", "replace")[:_WHY_BYTES_MAX])
        finally:
            os._exit(code)

    def checkSerializing(self) -> tuple[int, int | None]:
        pid = self._pid
        if pid == 0:
            return SERIALIZER_STATE.NOT_SERIALIZING, None
        if pid == -2:
            self._pid = 0
            return SERIALIZER_STATE.FAILED, self._id
        try:
            got, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError as e:  # reaped by someone else: its outcome is unknown
            self._pid = 0
            self._failed(DumpWriteFailed(f"the dump writer (pid {pid}) was lost: {e}"))
            return SERIALIZER_STATE.FAILED, self._id
        if got == 0:
            return SERIALIZER_STATE.SERIALIZING, self._id
        self._pid = 0
        why = self._read_why()
        code = os.waitstatus_to_exitcode(status)
        if code != 0 or why:
            ended = f"exit code {code}" if code >= 0 else f"signal {-code}"
            self._failed(DumpWriteFailed(why or f"the dump writer ended with {ended}"))
            return SERIALIZER_STATE.FAILED, self._id
        self._health.ok()
        if self._on_written is not None and self._writing_position is not None:
            self._on_written(self._writing_position)
        if self._segments is not None and self._journal is not None:
            self._journal.segments_retired(self._segments.older)
        self._segments = None
        # What pysyncobj's own writer does on success: transmissions start over from the file.
        self._Serializer__transmissions = {}
        return SERIALIZER_STATE.SUCCESS, self._id

    def setTransmissionData(self, data: Any) -> bool:
        """A dump sent by the leader (pysyncobj writes it beside ours and renames it into place;
        True once it is whole and the member loads it): a dump of our own still being written
        is older, and renamed over it, it would not match the journal that pysyncobj rebuilds
        from the leader's. It is abandoned first."""
        last = isinstance(data, tuple) and len(data) == 3 and bool(data[2])
        if last and self.writing:
            # Before pysyncobj renames the leader's dump into place: ours cannot follow it.
            self.close()
            log.info("dump.abandoned", why="a newer dump came from the leader")
        return bool(super().setTransmissionData(data))

    def close(self) -> None:
        """Stop a dump being written (the member stops, or a newer dump came): kill and reap
        the child, drop its file. The journal was not trimmed for it."""
        pid = self._pid
        if pid > 0:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)
            self._pid = 0
            self._read_why()
            with contextlib.suppress(OSError):
                os.unlink(self._tmp)

    def _read_why(self) -> str:
        fd, self._why_fd = self._why_fd, None
        if fd is None:
            return ""
        try:
            return os.read(fd, _WHY_BYTES_MAX).decode("utf-8", "replace")
        except OSError:
            return ""
        finally:
            os.close(fd)

    def _failed(self, error: BaseException) -> None:
        retry_s = self._health.failed(error)
        log.error("dump.write_failed", path=self._tmp, error=repr(error), retry_in_s=retry_s,
                  failures=self._health.failures,
                  note="the journal keeps every entry until a dump is written")
        with contextlib.suppress(OSError):
            os.unlink(self._tmp)


def _never(path: str, data: Any) -> None:
    raise AssertionError("ForkedDumps writes dumps itself")
