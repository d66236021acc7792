"""The data folder's disk: free space, the reserve file, and naming a full disk for what it is.

Theory of operation. A member below `[blobs] disk_free_min` bytes free is read-only: it serves
reads, takes no leases and no submits, and says so (`DiskFull` to the node, which puts it in
/healthz and /fleet). The main thread calls `DiskWatch.check` every `disk_poll_s`; once free space
is back above the minimum by the reserve's size, the member takes work again by itself.

The reserve is a file of `disk_reserve_bytes` in the data folder, made while there is room. When
the disk is all but full (less than `disk_full_bytes_max` free, or a write refused for want of
space) the reserve is deleted, so that the journal still has room for what a read-only member
writes (a new term at start, revokes of its old leases, the leader's no-op) and a member on a disk
that filled up completely can start. It is made again when space is back. A member whose reserve
was spent already (something else filled the room it gave back) cannot write its term: it stops
at start with ENOSPC named and `EXIT_DISK`.

LMDB reports some short writes on a full disk as EIO ("Input/output error"), and so may the kernel
for some file systems: an EIO is taken for ENOSPC when the disk has less than
`disk_full_bytes_max` free, and the messages say "no space left on device".

Exit codes of a member that stops (fail-stop): `EXIT_DISK` when the disk failed or is full (an
fsync or write error, ENOSPC, an LMDB disk error), `EXIT_BUG` for a broken invariant of our own.
"""

from __future__ import annotations

import contextlib
import errno
import os
import threading
from collections.abc import Callable

import lmdb
import structlog

from blobstore import StoreFull
from meshjobs import limits
from meshjobs.failpoints import Failpoints

log = structlog.get_logger(__name__)

EXIT_BUG = 70  # sysexits EX_SOFTWARE: a broken invariant of our own
EXIT_DISK = 71  # sysexits EX_OSERR: the disk failed (EIO) or is full (ENOSPC)

RESERVE_NAME = "disk.reserve"


def free_bytes(path: str, failpoints: Failpoints | None = None) -> int:
    """Bytes an unprivileged writer may still use on the disk holding `path` (0 when the
    failpoint `disk.full` fails)."""
    if failpoints is not None:
        try:
            failpoints.hit("disk.full")
        except OSError:
            return 0
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def total_bytes(path: str) -> int:
    st = os.statvfs(path)
    return st.f_blocks * st.f_frsize


def default_free_min(path: str) -> int:
    """`[blobs] disk_free_min` when the config does not set it: 1 GiB, or 5 % of the disk when
    that is smaller (a small disk would otherwise be read-only from the start)."""
    pct = total_bytes(path) * limits.disk_free_min_pct_default // 100
    return min(limits.disk_free_min_bytes_default, pct)


def is_disk_error(exc: BaseException | None) -> bool:
    """An error the disk gave (an OSError, an LMDB error, a full blob store), as opposed to a
    bug of our own."""
    return isinstance(exc, OSError | lmdb.Error | StoreFull) and not isinstance(
        exc, lmdb.MapResizedError | lmdb.BadTxnError | lmdb.BadDbiError)


def _says_eio(exc: BaseException) -> bool:
    if isinstance(exc, OSError):
        return exc.errno == errno.EIO
    return isinstance(exc, lmdb.Error) and os.strerror(errno.EIO) in str(exc)


def is_full(exc: BaseException | None, path: str | None) -> bool:
    """The disk is full: ENOSPC (or LMDB's DiskError, which is ENOSPC), or an EIO with almost
    no space left on the disk holding `path`."""
    if exc is None:
        return False
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    if isinstance(exc, lmdb.DiskError):
        return True
    if path is not None and _says_eio(exc):
        with contextlib.suppress(OSError):
            return free_bytes(path) < limits.disk_full_bytes_max
    return False


def describe(exc: BaseException | None, path: str | None) -> str:
    """The error, saying "no space left on device" when that is what it is."""
    if exc is None:
        return "(no error)"
    text = f"{type(exc).__name__}: {exc}"
    if not is_full(exc, path):
        return text
    free = "?"
    if path is not None:
        with contextlib.suppress(OSError):
            free = str(free_bytes(path))
    said = " (the disk reported it as an input/output error)" if _says_eio(exc) else ""
    return f"no space left on device ({path}: {free} bytes free){said}: {text}"


def fix_hint(exc: BaseException | None, path: str | None) -> str:
    """What an operator does next, for a member that stopped on this error."""
    if is_full(exc, path):
        return ("free space on the disk of the data folder: with a little room the member starts "
                "read-only, and takes work again by itself once more than [blobs] disk_free_min "
                "is free")
    return ("check the disk (dmesg, SMART); the member refuses to run on a disk that lost "
            "writes: restart it once the disk is sound, or move its data folder to another disk")


class Reserve:
    """The reserve file: space set aside while there is room, given back when the disk is low."""

    def __init__(self, folder: str, size_bytes: int = limits.disk_reserve_bytes) -> None:
        self.path = os.path.join(folder, RESERVE_NAME)
        self.size_bytes = size_bytes

    def held(self) -> bool:
        try:
            return os.path.getsize(self.path) >= self.size_bytes
        except OSError:
            return False

    def keep(self) -> bool:
        """Make the reserve if it is missing; False when there is no room for it."""
        if self.held():
            return True
        tmp = self.path + ".tmp"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                try:
                    os.posix_fallocate(fd, 0, self.size_bytes)
                except OSError as e:
                    if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                        raise
                    zeros = bytes(1 << 20)
                    for k in range(0, self.size_bytes, len(zeros)):
                        os.write(fd, zeros[: min(len(zeros), self.size_bytes - k)])
                os.fsync(fd)
            finally:
                os.close(fd)
            os.rename(tmp, self.path)
        except OSError as e:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            log.warning("disk_reserve_not_made", path=self.path, error=describe(e, self.path))
            return False
        log.info("disk_reserve_made", path=self.path, bytes=self.size_bytes)
        return True

    def release(self) -> int:
        """Delete the reserve; the bytes it gave back."""
        freed = 0
        for p in (self.path, self.path + ".tmp"):
            with contextlib.suppress(OSError):
                freed += os.path.getsize(p)
                os.unlink(p)
        if freed:
            log.warning("disk_reserve_released", path=self.path, bytes=freed)
        return freed


class DiskWatch:
    """Whether the data folder's disk is full (read-only), from polls of its free space.

    Full below `free_min` bytes free, or after `write_failed` (a write the disk refused for
    space); not full again once free space is at least `free_min` plus the reserve's size (the
    reserve is made again then). `on_report(full, free)` is called after every check and every
    change, in order (under the watch's lock), from the thread that made it: it must be quick.
    """

    def __init__(self, folder: str, free_min: int, failpoints: Failpoints | None = None,
                 on_report: Callable[[bool, int], None] | None = None,
                 reserve: Reserve | None = None) -> None:
        self.folder = folder
        self.free_min = free_min
        self.reserve = reserve if reserve is not None else Reserve(folder)
        self._failpoints = failpoints
        self._on_report = on_report
        self._lock = threading.Lock()
        self.full = False
        self.free = 0
        self.changes = 0

    def check(self) -> bool:
        """Poll free space, change state if it calls for it, and say whether the disk is full."""
        with self._lock:
            try:
                free = free_bytes(self.folder, self._failpoints)
            except OSError as e:  # a disk that cannot say: keep the last state
                log.warning("disk_free_unknown", path=self.folder, error=repr(e))
                return self.full
            self.free = free
            if free < limits.disk_full_bytes_max and self.reserve.release():
                with contextlib.suppress(OSError):
                    self.free = free = free_bytes(self.folder, self._failpoints)
            if not self.full and free < self.free_min:
                self._set(True)
            elif self.full and free >= self.free_min + self.reserve.size_bytes:
                self.reserve.keep()
                self._set(False)
            elif not self.full and not self.reserve.held() and (
                    free >= self.free_min + self.reserve.size_bytes):
                self.reserve.keep()
            self._report()
            return self.full

    def write_failed(self, exc: BaseException) -> None:
        """A write the disk refused for want of space: read-only until space is back."""
        with self._lock:
            self.reserve.release()
            if not self.full:
                log.error("disk_write_refused", path=self.folder, error=describe(exc, self.folder))
                self._set(True)
                self._report()

    def _set(self, full: bool) -> None:
        self.full = full
        self.changes += 1
        log.warning("disk_full" if full else "disk_space_back", path=self.folder,
                    free_bytes=self.free, free_min=self.free_min)

    def _report(self) -> None:
        if self._on_report is not None:
            self._on_report(self.full, self.free)

    def refusal(self) -> str:
        """What a refused submit is told."""
        return (f"the disk of this member is full ({self.free} bytes free, under [blobs] "
                f"disk_free_min = {self.free_min}): it takes no submits and no work until space "
                "is freed on it; submit through another member, or free space")


__all__ = ["EXIT_BUG", "EXIT_DISK", "DiskWatch", "Reserve", "default_free_min",
           "describe", "fix_hint", "free_bytes", "is_disk_error", "is_full"]
