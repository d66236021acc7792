"""The durable Raft journal: pysyncobj's log, kept in a checksummed append-only file.

`DurableJournal` replaces pysyncobj's FileJournal (which never fsyncs, has no checksums and cannot
open a torn file). pysyncobj keeps calling `add`, `deleteEntriesFrom`, `deleteEntriesTo`, `clear`
and the term/commit setters as before; the jobs thread calls `sync()` before any answer or message
that depends on the log leaves the member (the durability gate).

Theory of operation. The log file is a sequence of records, each a 13-byte header (magic `MJL1`,
kind u8, body length u32, crc32 of kind+length+body u32, little-endian) and a body:
ADD (idx u64, term u64, command bytes), TRUNC (keep the first n entries, u64) or COMMIT (Raft
commit index, u64). Reading the records in order rebuilds the entry list. Term and vote live apart,
in `<path>.term`, replaced atomically and synchronously because Raft must not send a vote before
they are durable.

Rules:
- Rule 1: nothing is durable until `sync()`; `sync()` flushes and fdatasyncs the log (and fsyncs
  the folder when a file was created there) and costs no syscall when nothing is dirty.
- Rule 2: a failed fsync poisons the journal: every later `sync()` raises too, because after a
  failed fsync the page cache can no longer be trusted and a retry could falsely succeed.
- Rule 3: on load, a bad record with no well-formed record after it is a torn tail that was never
  synced, so never acknowledged: it is cut off with a warning. A bad record followed by a good one
  is damage in the middle: `JournalCorrupt`, and the member does not start.
- Rule 4: idx increases by one from each ADD to the next (TRUNC and rewrites accounted); anything
  else in the file is `JournalCorrupt`, and `add` refuses it as a broken invariant.
- Rule 5: `deleteEntriesTo` and `clear` rewrite the file beside it and rename it over the log,
  fsyncing the folder before the rename, so the dump pysyncobj renamed just before is durable
  before the entries it replaces are gone.
- Rule 6: commit index records are written lazily, only when the index changed, at most once per
  `sync()` or one-second timer; a lost one only makes the member re-learn its commit index.

One thread owns a journal (the thread that ticks pysyncobj); it takes no lock.
"""

from __future__ import annotations

import contextlib
import errno
import os
import struct
import zlib
from typing import Any

import structlog
from pysyncobj.journal import Journal

from meshjobs import limits
from meshjobs.datadir import private_opener
from meshjobs.failpoints import Failpoints

log = structlog.get_logger(__name__)

MAGIC = b"MJL1"
KIND_ADD = 1
KIND_TRUNC = 2
KIND_COMMIT = 3

_HEADER = struct.Struct("<4sBII")  # magic, kind, length, crc
HEADER_BYTES = _HEADER.size
_KIND_LENGTH = struct.Struct("<BI")  # the part of the header the crc covers
_CRC = struct.Struct("<I")
_IDX_TERM = struct.Struct("<QQ")
_U64 = struct.Struct("<Q")

TERM_MAGIC = b"MJT1"
_TERM_HEADER = struct.Struct("<4sII")  # magic, body length, crc32 of body
_TERM_BODY = struct.Struct("<QB")  # term, has a vote; the vote's UTF-8 bytes follow

_JOIN_BYTES_MAX = limits.journal_join_bytes_max

_fdatasync = getattr(os, "fdatasync", os.fsync)

_RESTORE_HINT = (
    "the member will not start; restore this member's data folder from a peer "
    "or move the journal aside"
)


class JournalCorrupt(Exception):
    """The journal or its term file is damaged where a crash cannot explain it."""


def _crc(kind: int, head: bytes, tail: bytes = b"") -> tuple[bytes, int]:
    """The kind+length bytes and the crc of a record whose body is head + tail."""
    kind_length = _KIND_LENGTH.pack(kind, len(head) + len(tail))
    crc = zlib.crc32(head, zlib.crc32(kind_length))
    if tail:
        crc = zlib.crc32(tail, crc)
    return kind_length, crc


def _write_record(f: Any, kind: int, head: bytes, tail: bytes = b"") -> int:
    """Write one record to a buffered file; return its size in bytes."""
    kind_length, crc = _crc(kind, head, tail)
    if len(tail) < _JOIN_BYTES_MAX:
        f.write(b"".join((MAGIC, kind_length, _CRC.pack(crc), head, tail)))
    else:
        f.write(b"".join((MAGIC, kind_length, _CRC.pack(crc), head)))
        f.write(tail)
    return HEADER_BYTES + len(head) + len(tail)


def _record_at(data: bytes, view: memoryview, pos: int, record_max: int) -> tuple[int, int] | None:
    """(kind, body length) of a well-formed record at pos, or None: short, bad magic, bad length
    or bad crc."""
    end = len(data)
    if end - pos < HEADER_BYTES:
        return None
    magic, kind, length, crc = _HEADER.unpack_from(data, pos)
    if magic != MAGIC or length > record_max or pos + HEADER_BYTES + length > end:
        return None
    body = view[pos + HEADER_BYTES : pos + HEADER_BYTES + length]
    if zlib.crc32(body, zlib.crc32(view[pos + 4 : pos + 9])) != crc:
        return None
    return kind, length


def _next_record(data: bytes, view: memoryview, start: int, record_max: int) -> int | None:
    """The offset of the first well-formed record at or after start, or None."""
    pos = data.find(MAGIC, start)
    while pos != -1:
        if _record_at(data, view, pos, record_max) is not None:
            return pos
        pos = data.find(MAGIC, pos + 1)
    return None


class DurableJournal(Journal):
    """pysyncobj's journal interface over a checksummed, fsynced, append-only file."""

    def __init__(
        self,
        path: str,
        failpoints: Failpoints | None = None,
        *,
        dump_path: str | None = None,
    ) -> None:
        self._path = path
        self._dir = os.path.dirname(os.path.abspath(path))
        self._term_path = path + ".term"
        self._dump_path = dump_path
        self._failpoints = failpoints
        self._record_max = limits.journal_record_bytes_max
        self._entries: list[tuple[bytes, int, int]] = []
        self._commit = 1
        self._commit_written = 1
        self._records = 0
        self._bytes = 0
        self.compactions = 0  # times entries before a dump were cut off
        self._syncs = 0
        self._fsyncs = 0
        self._torn_bytes = 0
        self._dirty = False
        self._dir_dirty = False
        self._broken: OSError | None = None
        self._closed = False

        # A leftover .tmp is a rewrite or term update that crashed before its rename: the file
        # it was meant to replace is still whole and is the one to read.
        for leftover in (path + ".tmp", self._term_path + ".tmp"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(leftover)

        self._term, self._vote = self._load_term()
        created = not os.path.exists(path)
        if not created:
            self._load()
        self._f = open(path, "ab", opener=private_opener)
        if created:
            self._dir_dirty = True

    # --- loading ---------------------------------------------------------------------------------

    def _load(self) -> None:
        with open(self._path, "rb") as f:
            data = f.read()
        view = memoryview(data)
        entries = self._entries
        pos = 0
        end = len(data)
        try:
            while pos < end:
                found = _record_at(data, view, pos, self._record_max)
                if found is None:
                    later = _next_record(data, view, pos + 1, self._record_max)
                    if later is not None:
                        raise JournalCorrupt(
                            f"journal {self._path}: damaged record at offset {pos} "
                            f"(a good record follows at offset {later}); {_RESTORE_HINT}"
                        )
                    self._cut_torn_tail(pos, end - pos)
                    break
                kind, length = found
                body = pos + HEADER_BYTES
                if kind == KIND_ADD and length >= _IDX_TERM.size:
                    idx, term = _IDX_TERM.unpack_from(data, body)
                    if entries and idx != entries[-1][1] + 1:
                        raise JournalCorrupt(
                            f"journal {self._path}: entry idx {idx} at offset {pos} does not "
                            f"follow idx {entries[-1][1]}; {_RESTORE_HINT}"
                        )
                    entries.append((data[body + _IDX_TERM.size : body + length], idx, term))
                elif kind == KIND_TRUNC and length == _U64.size:
                    (keep,) = _U64.unpack_from(data, body)
                    if keep > len(entries):
                        raise JournalCorrupt(
                            f"journal {self._path}: truncation to {keep} entries at offset {pos} "
                            f"with only {len(entries)} entries; {_RESTORE_HINT}"
                        )
                    del entries[keep:]
                elif kind == KIND_COMMIT and length == _U64.size:
                    (self._commit,) = _U64.unpack_from(data, body)
                else:
                    raise JournalCorrupt(
                        f"journal {self._path}: record of kind {kind} and length {length} at "
                        f"offset {pos} is not one this version writes; {_RESTORE_HINT}"
                    )
                self._records += 1
                pos = body + length
        finally:
            view.release()
        self._bytes = pos
        self._commit_written = self._commit

    def _cut_torn_tail(self, offset: int, dropped: int) -> None:
        log.warning(
            "journal.torn_tail_dropped", path=self._path, offset=offset, dropped_bytes=dropped
        )
        with open(self._path, "r+b") as f:
            f.truncate(offset)
            self._fsync(f.fileno())
        self._torn_bytes += dropped

    def _load_term(self) -> tuple[int, str | None]:
        try:
            with open(self._term_path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            return 0, None
        why = None
        head = _TERM_HEADER.size
        if len(data) < head + _TERM_BODY.size:
            why = f"{len(data)} bytes is too short"
        else:
            magic, length, crc = _TERM_HEADER.unpack_from(data)
            body = data[head:]
            if magic != TERM_MAGIC:
                why = "bad magic"
            elif length != len(body):
                why = f"length {length} but {len(body)} bytes follow the header"
            elif zlib.crc32(body) != crc:
                why = "checksum mismatch"
            else:
                term, has_vote = _TERM_BODY.unpack_from(body)
                vote_bytes = body[_TERM_BODY.size :]
                if has_vote == 0 and not vote_bytes:
                    return term, None
                if has_vote == 1:
                    try:
                        return term, vote_bytes.decode("utf-8")
                    except UnicodeDecodeError:
                        why = "the vote is not UTF-8"
                else:
                    why = "bad vote flag"
        raise JournalCorrupt(
            f"term file {self._term_path} is damaged ({why}); the member will not start; "
            f"restore this member's data folder from a peer"
        )

    # --- pysyncobj's interface -------------------------------------------------------------------

    def add(self, command: bytes, idx: int, term: int) -> None:
        entries = self._entries
        if entries and idx != entries[-1][1] + 1:
            raise ValueError(
                f"journal add of idx {idx} after idx {entries[-1][1]}: indexes must increase by one"
            )
        if type(command) is not bytes:
            command = bytes(command)
        if _IDX_TERM.size + len(command) > self._record_max:
            raise ValueError(
                f"journal entry of {len(command)} bytes is over journal_record_bytes_max"
            )
        self._append(KIND_ADD, _IDX_TERM.pack(idx, term), command)
        entries.append((command, idx, term))

    def clear(self) -> None:
        self._entries = []
        self._rewrite()

    def deleteEntriesFrom(self, entryFrom: int) -> None:
        keep = len(range(*slice(None, entryFrom).indices(len(self._entries))))
        if keep >= len(self._entries):
            return
        self._append(KIND_TRUNC, _U64.pack(keep))
        del self._entries[keep:]

    def deleteEntriesTo(self, entryTo: int) -> None:
        drop = len(range(*slice(None, entryTo).indices(len(self._entries))))
        if drop == 0:
            return
        self._entries = self._entries[drop:]
        self._rewrite()
        self.compactions += 1

    def __getitem__(self, item: int | slice) -> Any:
        return self._entries[item]

    def __len__(self) -> int:
        return len(self._entries)

    def _destroy(self) -> None:
        if self._closed:
            return
        try:
            if self._broken is None:
                self._append_commit()
                self.sync()
        finally:
            self._closed = True
            with contextlib.suppress(OSError):
                self._f.close()

    def setRaftCommitIndex(self, raftCommitIndex: int) -> None:
        self._commit = raftCommitIndex

    def getRaftCommitIndex(self) -> int:
        return self._commit

    def setCurrentTerm(self, term: int, votedForNodeId: str | None) -> None:
        if votedForNodeId is not None and not isinstance(votedForNodeId, str):
            raise TypeError(f"a vote is a node id string or None, not {votedForNodeId!r}")
        if (term, votedForNodeId) == (self._term, self._vote):
            return
        self._check_usable()
        vote = b"" if votedForNodeId is None else votedForNodeId.encode("utf-8")
        body = _TERM_BODY.pack(term, votedForNodeId is not None) + vote
        data = _TERM_HEADER.pack(TERM_MAGIC, len(body), zlib.crc32(body)) + body
        tmp = self._term_path + ".tmp"
        try:
            with open(tmp, "wb", opener=private_opener) as f:
                f.write(data)
                f.flush()
                self._fsync(f.fileno())
            os.replace(tmp, self._term_path)
            self._fsync_dir()
        except OSError as e:
            self._broken = e
            raise
        self._term, self._vote = term, votedForNodeId

    def getCurrentTerm(self) -> int:
        return self._term

    def getVotedForNodeId(self) -> str | None:
        return self._vote

    def onOneSecondTimer(self) -> None:
        # A commit index that moved while nothing else was written reaches the file here, so it
        # is made durable by the next sync without a sync of its own.
        if self._closed or self._broken is not None:
            return
        self._append_commit()
        self.flush()

    def flush(self) -> None:
        """Hand buffered records to the OS (this survives a crash of the process, not of the
        machine; `sync()` makes them durable)."""
        try:
            self._f.flush()
        except OSError as e:
            self._broken = e
            raise

    def complete_compaction(
        self, prev: tuple[bytes, int, int], last: tuple[bytes, int, int]
    ) -> bool:
        """Finish a compaction that a crash interrupted; return True if entries were dropped.

        pysyncobj renames the dump into place and only on a later tick drops the entries it
        replaces. After a crash between the two, the journal still starts before the dump's
        (prev, last) pair, and pysyncobj's dump load would then clear the whole journal, losing
        the entries after `last`. Call this with the dump's pair before pysyncobj loads it.
        """
        entries = self._entries
        if not entries:
            return False
        p = prev[1] - entries[0][1]
        if p <= 0 or p + 1 >= len(entries) or entries[p] != prev or entries[p + 1] != last:
            return False
        log.info("journal.compaction_completed", path=self._path, dropped_entries=p)
        self.deleteEntriesTo(p)
        return True

    # --- durability ------------------------------------------------------------------------------

    def sync(self) -> None:
        """Make everything written so far durable; raise OSError if it cannot be."""
        self._check_usable()
        if not (self._dirty or self._dir_dirty):
            return
        try:
            if self._dirty:
                self._append_commit()
                self._f.flush()
                self._fsync(self._f.fileno(), data_only=True)
                self._dirty = False
            if self._dir_dirty:
                self._fsync_dir()
                self._dir_dirty = False
        except OSError as e:
            self._broken = e
            raise
        self._syncs += 1

    @property
    def dirty(self) -> bool:
        """True when something written since the last sync is not durable yet."""
        return self._dirty or self._dir_dirty

    @property
    def path(self) -> str:
        return self._path

    @property
    def size_bytes(self) -> int:
        """Bytes of the log file, about what its entries take in memory."""
        return self._bytes

    def stats(self) -> dict[str, int]:
        return {
            "entries": len(self._entries),
            "records": self._records,
            "bytes": self._bytes,
            "syncs": self._syncs,
            "fsyncs": self._fsyncs,
            "torn_tail_dropped_bytes": self._torn_bytes,
            "commit_index": self._commit,
        }

    # --- internals -------------------------------------------------------------------------------

    def _check_usable(self) -> None:
        if self._closed:
            raise ValueError(f"journal {self._path} is closed")
        if self._broken is not None:
            raise OSError(
                errno.EIO,
                f"journal {self._path} failed earlier and cannot be made durable: {self._broken}",
            )

    def _append(self, kind: int, head: bytes, tail: bytes = b"") -> None:
        if self._closed:
            raise ValueError(f"journal {self._path} is closed")
        try:
            self._bytes += _write_record(self._f, kind, head, tail)
        except OSError as e:
            self._broken = e
            raise
        self._records += 1
        self._dirty = True

    def _append_commit(self) -> None:
        if self._commit != self._commit_written:
            self._append(KIND_COMMIT, _U64.pack(self._commit))
            self._commit_written = self._commit

    def _rewrite(self) -> None:
        """Replace the log with one holding only the current entries and commit index."""
        self._check_usable()
        tmp = self._path + ".tmp"
        f = open(tmp, "wb", opener=private_opener)
        try:
            size = records = 0
            for command, idx, term in self._entries:
                size += _write_record(f, KIND_ADD, _IDX_TERM.pack(idx, term), command)
                records += 1
            size += _write_record(f, KIND_COMMIT, _U64.pack(self._commit))
            records += 1
            f.flush()
            self._fsync(f.fileno())
            # The dump that lets these entries go was renamed into this folder just before (by
            # pysyncobj, which fsyncs nothing): make its contents and its name durable before the
            # entries it replaces disappear.
            if self._dump_path is not None and os.path.exists(self._dump_path):
                fd = os.open(self._dump_path, os.O_RDONLY)
                try:
                    self._fsync(fd)
                finally:
                    os.close(fd)
            self._fsync_dir()
            os.replace(tmp, self._path)
            self._fsync_dir()
        except OSError as e:
            self._broken = e
            with contextlib.suppress(OSError):
                f.close()
            raise
        old, self._f = self._f, f
        # The old file's name is gone; whatever its buffer still holds is of no use.
        with contextlib.suppress(OSError):
            old.close()
        self._records, self._bytes = records, size
        self._commit_written = self._commit
        self._dirty = self._dir_dirty = False

    def _fsync(self, fd: int, *, data_only: bool = False) -> None:
        if self._failpoints is not None:
            self._failpoints.hit("journal.fsync")
        (_fdatasync if data_only else os.fsync)(fd)
        self._fsyncs += 1

    def _fsync_dir(self) -> None:
        fd = os.open(self._dir, os.O_RDONLY)
        try:
            self._fsync(fd)
        finally:
            os.close(fd)
