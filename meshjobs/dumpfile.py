"""Full dumps (snapshots) of the replicated state: pysyncobj's `serializer=`/`deserializer=` pair.

A dump file is an 18-byte header (magic `MJD1`, format version u16, payload length u64, crc32 of
the payload u32, little-endian) and a msgpack payload
`{"state": ..., "last": [command, idx, term], "prev": [command, idx, term], "cluster": [node ids]}`
(packed and checked by `dumpbytes.py`, which does no IO).

pysyncobj calls the serializer with `(tmp_path, (last_entry, prev_entry, cluster))` and renames
the tmp file over the dump itself; it passes no state (a custom serializer gets None), so the
state comes from `get_state()` and goes back through `set_state()`.

Rules:
- Rule 1: msgpack only, never pickle: a dump may come from a peer.
- Rule 2: the serializer fsyncs the file before returning (failpoint `dump.fsync`); the folder is
  fsynced before a journal segment the dump replaces is deleted: by the dump writer
  (dumpwriter.py), or by the journal for a dump pysyncobj renamed into place (journal.py).
- Rule 3: a dump that cannot be written (a failed fsync, a full disk) is not fatal: a dump is not
  the log. The tmp file is deleted, the journal keeps every entry (it is trimmed only after a
  dump was written and fsynced), and `DumpHealth` counts the failure and says when to try again
  (backoff from `dump_retry_ms_min` doubling to `dump_retry_ms_max`). A retry writes a new file,
  so a failed fsync's lost pages are never taken for written.
- Rule 4: a damaged dump is `DumpCorrupt`, never ignored. pysyncobj swallows every exception of a
  dump load and goes on with empty state, so the caller must also check the dump before starting
  (`check_dump`) and pass `on_corrupt` to learn of a damaged dump received from a peer.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from typing import Any

import structlog

from meshjobs import dumpbytes, limits
from meshjobs.datadir import private_opener
from meshjobs.failpoints import Failpoints

log = structlog.get_logger(__name__)

_fdatasync = getattr(os, "fdatasync", os.fsync)

MAGIC = dumpbytes.MAGIC
FORMAT_VERSION = dumpbytes.FORMAT_VERSION
HEADER_BYTES = dumpbytes.HEADER_BYTES
DumpCorrupt = dumpbytes.DumpCorrupt
Dump = dumpbytes.Dump
Entry = dumpbytes.Entry
Serializer = Callable[[str, Any], None]
Deserializer = Callable[[str], tuple[Entry, Entry, list[str]]]
_RESTORE_HINT = "the member will not start; restore this member's data folder from a peer"


class DumpHealth:
    """Dumps written and failed, and when the next try is due after a failure (backoff)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self.written = 0
        self.failures = 0
        self.consecutive = 0
        self.retry_at = 0.0
        self.last_error: str | None = None

    def ok(self) -> None:
        self.written += 1
        self.consecutive = 0
        self.retry_at = 0.0

    def failed(self, error: BaseException) -> float:
        """Count a failure; the seconds until the next try."""
        self.failures += 1
        self.consecutive += 1
        self.last_error = repr(error)
        wait_ms = min(limits.dump_retry_ms_max,
                      limits.dump_retry_ms_min * 2 ** min(self.consecutive - 1, 30))
        self.retry_at = self._clock() + wait_ms / 1000
        return wait_ms / 1000

    def due(self) -> bool:
        """May a dump be tried now?"""
        return self._clock() >= self.retry_at


def write_dump(
    path: str,
    state: Any,
    last: Entry,
    prev: Entry,
    cluster: list[str],
    failpoints: Failpoints | None = None,
) -> None:
    """Write a dump file and fsync it (not its folder). It is written and made durable
    `dump_sync_bytes` at a time: the member's own journal fsyncs, meanwhile, wait behind at most
    that much of it (one fsync of the whole file at the end made one of them wait for all of it:
    up to 0.2 s at a million items)."""
    body = dumpbytes.payload(state, last, prev, cluster)
    step = limits.dump_sync_bytes
    with open(path, "wb", opener=private_opener) as f:
        f.write(dumpbytes.header(body))
        view = memoryview(body)
        for k in range(0, len(body), step):
            f.write(view[k:k + step])
            if k + step < len(body):
                f.flush()
                _fdatasync(f.fileno())
        f.flush()
        if failpoints is not None:
            failpoints.hit("dump.fsync")
        os.fsync(f.fileno())


def read_dump(path: str) -> Dump:
    """Read and verify a dump file; raise DumpCorrupt on any damage."""
    with open(path, "rb") as f:
        data = f.read(limits.snapshot_bytes_max + HEADER_BYTES + 1)
    return dumpbytes.parse(data, path, _RESTORE_HINT)


def check_dump(path: str) -> Dump | None:
    """The dump at path (None if there is none); DumpCorrupt if it is damaged. Call it before
    building the SyncObj, since pysyncobj would log a failed load and go on with empty state, and
    hand its (prev, last) to `DurableJournal.complete_compaction`."""
    if not os.path.exists(path):
        return None
    return read_dump(path)


class CheckedDump:
    """The dump checked before start, handed once to the deserializer that loads it.

    A member reads its dump twice at start otherwise: `check_dump` (before pysyncobj builds its
    journal) and pysyncobj's load through the deserializer, each a whole read, checksum and
    msgpack decode (seconds at a million items). `check` keeps what it read with the file's
    identity (device, inode, size, modification time); `take` gives it back once, only while
    the file is that same file (a dump renamed into place since is read anew), and forgets it,
    so that the decoded state is not held beside the table built from it."""

    def __init__(self) -> None:
        self._held: tuple[str, tuple[int, ...], Dump] | None = None

    def check(self, path: str) -> Dump | None:
        """`check_dump(path)`, remembered for one `take`."""
        self._held = None
        try:
            before = _identity(path)
        except FileNotFoundError:
            return None
        dump = read_dump(path)
        if _identity(path) == before:
            self._held = (path, before, dump)
        return dump

    def take(self, path: str) -> Dump | None:
        """The dump `check` read at `path`, if that file is still the one read; else None."""
        held, self._held = self._held, None
        if held is None or held[0] != path:
            return None
        try:
            same = _identity(path) == held[1]
        except FileNotFoundError:
            return None
        return held[2] if same else None

    def forget(self) -> None:
        """Drop what `check` read, if nothing took it."""
        self._held = None


def _identity(path: str) -> tuple[int, ...]:
    st = os.stat(path)
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def make_dump_pair(
    get_state: Callable[[], Any],
    set_state: Callable[[Any], None],
    failpoints: Failpoints | None = None,
    *,
    on_corrupt: Callable[[DumpCorrupt], None] | None = None,
    health: DumpHealth | None = None,
    checked: CheckedDump | None = None,
) -> tuple[Serializer, Deserializer]:
    """pysyncobj's serializer and deserializer, writing and reading meshjobs dump files.

    `on_corrupt` is called with the error before the deserializer raises it, because pysyncobj
    swallows that exception; the caller uses it to stop the member. `health` counts the dumps
    written and failed (rule 3). `checked`: the dump read by its `check` before start is
    loaded from there, not read a second time.
    """

    def serializer(tmp_path: str, data: Any) -> None:
        last, prev, cluster = data
        try:
            write_dump(
                tmp_path,
                get_state(),
                last,
                prev,
                sorted(getattr(node, "id", node) for node in cluster),
                failpoints,
            )
        except Exception as e:
            # pysyncobj keeps only "Failed to store full dump" and drops the reason.
            retry_s = health.failed(e) if health is not None else None
            log.error("dump.write_failed", path=tmp_path, error=repr(e), retry_in_s=retry_s,
                      failures=health.failures if health is not None else None,
                      note="the journal keeps every entry until a dump is written")
            with contextlib.suppress(OSError):
                os.unlink(tmp_path)
            raise
        if health is not None:
            health.ok()

    def deserializer(path: str) -> tuple[Entry, Entry, list[str]]:
        try:
            dump = checked.take(path) if checked is not None else None
            if dump is None:
                dump = read_dump(path)
        except DumpCorrupt as e:
            log.error("dump.corrupt", path=path, error=str(e))
            if on_corrupt is not None:
                on_corrupt(e)
            raise
        set_state(dump.state)
        return dump.last, dump.prev, dump.cluster

    return serializer, deserializer
