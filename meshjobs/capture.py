"""One stream of a running command item's output: kept in memory while it is small, in a spool
file once it is not.

The driver thread reads each item's stdout and stderr pipe when its selector says there are
bytes (`take`). The first `limits.item_output_memory_bytes_max` bytes of a stream stay in
memory: most items print little, and then no file is created, written, fsynced or removed. The
moment a stream grows past that, what it holds is written to its spool file and every later
byte goes there too (spliced from the pipe by the kernel, not copied through Python), so an item
that prints gigabytes costs the member no more memory than before.

Other threads read what a stream holds so far (`read`, for live output: meshjobs.itemlogs);
the driver hands the finished stream to the blob store (`source`: the bytes, or the spool
file's path).

Rules:
1. Only the driver thread calls `take`, `close` and `source`; `read` may come from any thread.
   The switch from memory to file happens under the lock, so a reader sees either the bytes in
   memory or the file that holds all of them, never half of each.
2. A spool file that cannot be written (a full disk) never fails the member: the stream keeps
   what it had, the pipe is still drained (so the item does not block on a full pipe) and the
   rest is dropped; `error` says so, and the item's end carries it.
"""

from __future__ import annotations

import errno
import os
import threading

from meshjobs import limits


class Capture:
    """One output stream of one run: memory first, then `path` (created only when needed)."""

    __slots__ = ("path", "error", "_lock", "_buf", "_fd", "_spilled", "_splice", "_dropped")

    def __init__(self, path: str) -> None:
        self.path = path
        self.error: str | None = None  # why some output was dropped (a spool file not written)
        self._lock = threading.Lock()
        self._buf = bytearray()
        self._fd: int | None = None  # the spool file, open for writing, once spilled
        self._spilled = False
        self._splice = True  # os.splice works from this pipe to the spool file
        self._dropped = 0

    @property
    def spilled(self) -> bool:
        return self._spilled

    def take(self, fd: int) -> bool:
        """Read once from the (non-blocking) pipe `fd`; False at its end (no writer is left).

        Raises BlockingIOError when the pipe has nothing now."""
        if self._spilled and self._fd is not None and self._splice:
            try:
                n = os.splice(fd, self._fd, limits.item_pipe_read_bytes)
            except BlockingIOError:
                raise
            except OSError as e:
                if e.errno == errno.EINVAL:  # a file system without splice: copy instead
                    self._splice = False
                    return True
                self._fail(e)
                return True
            return n > 0
        data = os.read(fd, limits.item_pipe_read_bytes)
        if not data:
            return False
        if self.error is not None:
            self._dropped += len(data)  # rule 2: drained, not kept
            return True
        if self._spilled:
            self._write(data)
            return True
        if len(self._buf) + len(data) <= limits.item_output_memory_bytes_max:
            with self._lock:
                self._buf += data
            return True
        self._spill(data)
        return True

    def _spill(self, data: bytes) -> None:
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        except OSError as e:
            self._fail(e)
            return
        self._fd = fd
        try:
            _write_all(fd, self._buf)
        except OSError as e:
            self._fail(e)
            return
        with self._lock:
            self._spilled = True
            self._buf = bytearray()
        self._write(data)

    def _write(self, data: bytes) -> None:
        assert self._fd is not None
        try:
            _write_all(self._fd, data)
        except OSError as e:
            self._fail(e)

    def _fail(self, e: OSError) -> None:
        self.error = (f"output past {limits.item_output_memory_bytes_max} bytes not kept: its "
                      f"spool file {self.path} could not be written ({e.strerror or e}); free "
                      f"disk space on the member")
        self._splice = False

    def close(self) -> None:
        """The stream ended (or the run did): close the spool file, if there is one."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def source(self) -> bytes | str:
        """What the blob store takes: the bytes kept in memory, or the spool file's path."""
        self.close()
        if self._spilled:
            return self.path
        return bytes(self._buf)

    def read(self, offset: int, size: int) -> tuple[bytes, int]:
        """Up to `size` bytes from `offset`, and how many bytes the stream holds now (any
        thread). Raises FileNotFoundError when the spool file is gone (stored and removed)."""
        with self._lock:
            if not self._spilled:
                return bytes(self._buf[offset:offset + size]), len(self._buf)
        fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            return os.pread(fd, size, offset), os.fstat(fd).st_size
        finally:
            os.close(fd)


def _write_all(fd: int, data: bytes | bytearray) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]
