"""The durable Raft journal: pysyncobj's log, kept in checksummed append-only segment files.

`DurableJournal` replaces pysyncobj's FileJournal (which never fsyncs, has no checksums and cannot
open a torn file). pysyncobj keeps calling `add`, `deleteEntriesFrom`, `deleteEntriesTo`, `clear`
and the term/commit setters as before; the jobs thread calls `sync()` before any answer or message
that depends on the log leaves the member (the durability gate).

Theory of operation. The log is a run of segment files `<path>.<seq>` (seq counts up from 1,
written with eight digits or more); the one file `<path>` of a data folder written by an earlier
version is read as segment 0 and appended to until the first dump. Every file is a sequence of
records, each a 13-byte header (magic `MJL1`, kind u8, body length u32, crc32 of kind+length+body
u32, little-endian) and a body: SEG (this segment's seq u64 and flags u8, bit 0 "reset"; the first
record of every segment but 0), ADD (idx u64, term u64, command bytes), COMMIT (Raft commit index,
u64), CUT (keep the entries below idx u64), DROP (drop the entries below idx u64) and TRUNC (keep
the first n entries, u64: written by earlier versions, still read). Reading the records of the
segments in order rebuilds the entry list. Term and vote live apart, in `<path>.term`, replaced
atomically and synchronously because Raft must not send a vote before they are durable.

A dump starts a new segment (`start_segment`, called by the forked dump writer just before it
forks, on the jobs thread): the new segment opens with a copy of the entries from the dump's
`prev` entry on (the dump's two entries and those logged but not applied yet: a few) and the
commit index, and every entry appended after goes there. The older segments then hold nothing
that the dump and the new segment do not; the dump writer deletes them, but only after the dump
file, its name, the new segment's head and its name are fsynced (dumpwriter.py). So a dump costs
the jobs thread one small file created and a few records written: no entry re-encoded, no fsync
but those of the next `sync()`, which it makes anyway.

Rules:
- Rule 1: nothing is durable until `sync()`; `sync()` flushes and fdatasyncs the segments written
  since the last sync, oldest first (a segment left behind by `start_segment` with records not yet
  synced, then the current one), and fsyncs the folder when a file was created there; it costs no
  syscall when nothing is dirty. So when a sync returns, every segment is whole on disk: a later
  segment never holds an acknowledged entry while an earlier one misses records.
- Rule 2: a failed fsync poisons the journal: every later `sync()` raises too, because after a
  failed fsync the page cache can no longer be trusted and a retry could falsely succeed.
- Rule 3: on load, a bad record of a file with no well-formed record after it is a torn tail
  that was never synced, so never acknowledged: it is cut off with a warning. A bad record
  followed by a good one is damage in the middle: `JournalCorrupt`, and the member does not start.
- Rule 4: idx increases by one from each ADD to the next within a segment; a segment's first ADD
  takes the place of the entries from its idx on (its head is a copy of them). Anything else is
  `JournalCorrupt`, and `add` refuses it as a broken invariant.
- Rule 5: which segments are read. Replay starts at the last reset segment (`clear()`, a snapshot
  installed: every segment before it is void), or later at the newest segment whose first entry
  is at or before the dump's `prev` (`dump_prev_idx`): the segments before that one are left over
  from a dump whose writer died while deleting them, and are not read (they are deleted with the
  next dump's). A later segment whose first entry leaves a gap after the entries read so far was
  never synced (rule 1: the entries before the gap would be on disk): it and those after it were
  never acknowledged and are deleted, with a warning.
- Rule 6: `clear()` fsyncs the dump file pysyncobj just renamed into place and the folder, writes a
  reset segment and fsyncs it and the folder, and only then deletes the older segments.
- Rule 7: commit index records are written lazily, only when the index changed, at most once per
  `sync()` or one-second timer; a lost one only makes the member re-learn its commit index.
- Rule 8: `deleteEntriesTo` (the entries a durable dump covers) drops them in memory and writes a
  DROP record; it fsyncs nothing and deletes no file (the dump writer deleted the segments).

One thread owns a journal (the thread that ticks pysyncobj); it takes no lock.
"""

from __future__ import annotations

import contextlib
import errno
import os
import struct
import zlib
from dataclasses import dataclass
from typing import Any

import structlog
from pysyncobj.journal import Journal

from meshjobs import limits
from meshjobs.datadir import private_opener
from meshjobs.failpoints import Failpoints

log = structlog.get_logger(__name__)

MAGIC = b"MJL1"
KIND_ADD = 1
KIND_TRUNC = 2  # written by earlier versions only
KIND_COMMIT = 3
KIND_SEG = 4
KIND_CUT = 5
KIND_DROP = 6
SEG_RESET = 1  # SEG flags: every earlier segment is void

_HEADER = struct.Struct("<4sBII")  # magic, kind, length, crc
HEADER_BYTES = _HEADER.size
_KIND_LENGTH = struct.Struct("<BI")  # the part of the header the crc covers
_CRC = struct.Struct("<I")
_IDX_TERM = struct.Struct("<QQ")
_U64 = struct.Struct("<Q")
_SEG = struct.Struct("<QB")  # seq, flags

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


def _segment_seq(base: str, name: str) -> int | None:
    """The seq of a segment file's name in the journal's folder (`base` is the journal's own
    name), or None for any other file: `<base>` itself is segment 0, `<base>.<digits>` the others."""
    if name == base:
        return 0
    prefix = base + "."
    if name.startswith(prefix) and name[len(prefix):].isdigit() and name[len(prefix):].isascii():
        seq = int(name[len(prefix):])
        return seq if seq > 0 else None
    return None


@dataclass(frozen=True)
class Segments:
    """What `start_segment` hands the dump writer: the new segment, the older ones the dump makes
    redundant (to delete once the dump, the new segment's head and their names are durable), and
    the folder that holds them."""

    new: str
    older: tuple[str, ...]
    folder: str


@dataclass
class _Segment:
    seq: int
    path: str
    bytes: int = 0  # bytes of its records read or written (0 for a segment not read)
    first: int | None = None  # idx of its first entry


def retire_segments(segments: Segments, failpoints: Failpoints | None = None) -> None:
    """Delete the segments a dump made redundant, once nothing of theirs can be missed: the
    dump must be durable in the folder already (its file fsynced, renamed into place); here the
    new segment's head and then the folder (the dump's name and the new segment's) are fsynced
    first. Run by the forked dump writer (dumpwriter.py), off the jobs thread. An older segment
    left behind (a crash meanwhile) is not read at the next start (rule 5), and the next dump's
    writer deletes it."""
    if failpoints is not None:
        failpoints.hit("journal.segment_fsync")
    fd = os.open(segments.new, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    fd = os.open(segments.folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    if failpoints is not None:
        failpoints.hit("journal.segment_delete")
    for path in segments.older:  # oldest first: what a crash leaves is a run of the newest
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


class DurableJournal(Journal):
    """pysyncobj's journal interface over checksummed, fsynced, append-only segment files."""

    def __init__(
        self,
        path: str,
        failpoints: Failpoints | None = None,
        *,
        dump_path: str | None = None,
        dump_prev_idx: int | None = None,
    ) -> None:
        self._path = path
        self._dir = os.path.dirname(os.path.abspath(path))
        self._base = os.path.basename(path)
        self._term_path = path + ".term"
        self._dump_path = dump_path
        self._failpoints = failpoints
        self._record_max = limits.journal_record_bytes_max
        self._entries: list[tuple[bytes, int, int]] = []
        self._commit = 1
        self._commit_written = 1
        self._records = 0
        self._bytes = 0  # of the current segment
        self._old_bytes = 0  # of the older segments read or written since
        self.compactions = 0  # times entries before a dump were cut off
        self._syncs = 0
        self._fsyncs = 0
        self._torn_bytes = 0
        self._dropped_segments = 0
        self._dirty = False
        self._dir_dirty = False
        self._pending: list[Any] = []  # older segments' files with records not synced yet
        self._broken: OSError | None = None
        self._closed = False
        self._segments: list[_Segment] = []  # live segment files, oldest first; the last is current
        self._next_seq = 1
        self._rolled = False  # a segment was started for a dump whose writer has not ended well

        # A leftover .tmp is a rewrite (of an earlier version) or term update that crashed before
        # its rename: the file it was meant to replace is still whole and is the one to read.
        for leftover in (path + ".tmp", self._term_path + ".tmp"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(leftover)

        self._term, self._vote = self._load_term()
        self._load(dump_prev_idx)
        if self._segments:
            self._f = open(self._segments[-1].path, "ab", opener=private_opener)
        else:
            self._f = self._new_segment(0)

    # --- loading ---------------------------------------------------------------------------------

    def _list(self) -> list[_Segment]:
        found = []
        for name in os.listdir(self._dir):
            seq = _segment_seq(self._base, name)
            if seq is not None:
                found.append(_Segment(seq, os.path.join(self._dir, name)))
        found.sort(key=lambda s: s.seq)
        return found

    def _load(self, dump_prev_idx: int | None) -> None:
        segs = self._list()
        if segs:
            self._next_seq = segs[-1].seq + 1
        heads: list[tuple[_Segment, int, int | None]] = []  # (segment, flags, first idx)
        gone = False
        for seg in segs:
            head = self._head(seg)
            if head is None:
                # A new segment whose first record never reached the disk: nothing in it was
                # ever synced (its SEG record is written first).
                log.warning("journal.empty_segment_dropped", path=seg.path)
                os.unlink(seg.path)
                gone = True
                continue
            seg.first = head[1]
            heads.append((seg, *head))
        start = 0
        for k, (_seg, flags, _first) in enumerate(heads):
            if flags & SEG_RESET:
                start = k
        if dump_prev_idx is not None:
            for k in range(len(heads) - 1, start - 1, -1):
                first = heads[k][2]
                if first is not None and first <= dump_prev_idx:
                    start = k
                    break
        live = [h[0] for h in heads]
        for k in range(start, len(heads)):
            seg = heads[k][0]
            if not self._replay(seg, first_read=k == start):
                dropped = live[k:]
                log.warning("journal.unsynced_segments_dropped", paths=[s.path for s in dropped],
                            entries_up_to=self._entries[-1][1] if self._entries else None,
                            note="they follow a segment that misses records, so they were never "
                                 "synced (never acknowledged)")
                for s in dropped:
                    os.unlink(s.path)
                self._dropped_segments += len(dropped)
                del live[k:]
                gone = True
                break
        if gone:
            self._fsync_dir()
        self._segments = live
        if live:
            self._bytes = live[-1].bytes
            self._old_bytes = sum(s.bytes for s in live[:-1])
        self._commit_written = self._commit

    def _head(self, seg: _Segment) -> tuple[int, int | None] | None:
        """(SEG flags, idx of the first entry) of a segment, read from its first records; None
        for a new segment whose SEG record is missing or torn with nothing well-formed after it.
        Damage here is left to the full read (rule 3), which only the segments replayed get."""
        with open(seg.path, "rb") as f:
            data = f.read()
        view = memoryview(data)
        try:
            pos, flags, first = 0, 0, None
            while pos < len(data) and first is None:
                found = _record_at(data, view, pos, self._record_max)
                if found is None:
                    break
                kind, length = found
                body = pos + HEADER_BYTES
                if pos == 0 and seg.seq > 0:
                    if kind != KIND_SEG or length != _SEG.size:
                        raise JournalCorrupt(
                            f"journal segment {seg.path} does not start with its SEG record; "
                            f"{_RESTORE_HINT}")
                    got, flags = _SEG.unpack_from(data, body)
                    if got != seg.seq:
                        raise JournalCorrupt(
                            f"journal segment {seg.path} says it is segment {got}; "
                            f"{_RESTORE_HINT}")
                elif kind == KIND_ADD and length >= _IDX_TERM.size:
                    first = _IDX_TERM.unpack_from(data, body)[0]
                pos = body + length
            if pos == 0 and seg.seq > 0:
                later = _next_record(data, view, 1, self._record_max)
                if later is not None:
                    raise JournalCorrupt(
                        f"journal segment {seg.path}: damaged SEG record at offset 0 (a good "
                        f"record follows at offset {later}); {_RESTORE_HINT}")
                return None
            return flags, first
        finally:
            view.release()

    def _replay(self, seg: _Segment, first_read: bool) -> bool:
        """Apply one segment's records to the entries; False (nothing applied) when its first
        entry leaves a gap after the entries read so far (rule 5)."""
        path = seg.path
        with open(path, "rb") as f:
            data = f.read()
        view = memoryview(data)
        entries = self._entries
        pos = 0
        end = len(data)
        first_add = True
        commit = self._commit
        records = 0
        try:
            while pos < end:
                found = _record_at(data, view, pos, self._record_max)
                if found is None:
                    later = _next_record(data, view, pos + 1, self._record_max)
                    if later is not None:
                        raise JournalCorrupt(
                            f"journal {path}: damaged record at offset {pos} "
                            f"(a good record follows at offset {later}); {_RESTORE_HINT}"
                        )
                    self._cut_torn_tail(path, pos, end - pos)
                    break
                kind, length = found
                body = pos + HEADER_BYTES
                if kind == KIND_ADD and length >= _IDX_TERM.size:
                    idx, term = _IDX_TERM.unpack_from(data, body)
                    if first_add and entries and not first_read:
                        # The segment's head: a copy of the entries from idx on (rule 4).
                        if idx > entries[-1][1] + 1:
                            return False
                        del entries[max(0, idx - entries[0][1]):]
                    elif entries and idx != entries[-1][1] + 1:
                        raise JournalCorrupt(
                            f"journal {path}: entry idx {idx} at offset {pos} does not "
                            f"follow idx {entries[-1][1]}; {_RESTORE_HINT}"
                        )
                    first_add = False
                    entries.append((data[body + _IDX_TERM.size : body + length], idx, term))
                elif kind == KIND_TRUNC and length == _U64.size:
                    (keep,) = _U64.unpack_from(data, body)
                    if keep > len(entries):
                        raise JournalCorrupt(
                            f"journal {path}: truncation to {keep} entries at offset {pos} "
                            f"with only {len(entries)} entries; {_RESTORE_HINT}"
                        )
                    del entries[keep:]
                elif kind in (KIND_CUT, KIND_DROP) and length == _U64.size:
                    (below,) = _U64.unpack_from(data, body)
                    if entries:
                        if kind == KIND_CUT and below > entries[-1][1] + 1:
                            raise JournalCorrupt(
                                f"journal {path}: cut from idx {below} at offset {pos} past the "
                                f"last entry, idx {entries[-1][1]}; {_RESTORE_HINT}")
                        at = min(len(entries), max(0, below - entries[0][1]))
                        if kind == KIND_CUT:
                            del entries[at:]
                        else:
                            del entries[:at]
                elif kind == KIND_COMMIT and length == _U64.size:
                    (commit,) = _U64.unpack_from(data, body)
                elif kind == KIND_SEG and length == _SEG.size and pos == 0:
                    pass  # checked by _head
                else:
                    raise JournalCorrupt(
                        f"journal {path}: record of kind {kind} and length {length} at "
                        f"offset {pos} is not one this version writes; {_RESTORE_HINT}"
                    )
                records += 1
                pos = body + length
        finally:
            view.release()
        self._commit = commit
        self._records += records
        seg.bytes = pos
        return True

    def _cut_torn_tail(self, path: str, offset: int, dropped: int) -> None:
        log.warning("journal.torn_tail_dropped", path=path, offset=offset, dropped_bytes=dropped)
        with open(path, "r+b") as f:
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
        self._append_entry(command, idx, term)
        entries.append((command, idx, term))

    def clear(self) -> None:
        """Rule 6: a snapshot was installed (pysyncobj renamed the dump into place and loads it):
        the dump made durable, then a reset segment, then the older segments deleted."""
        self._check_usable()
        try:
            if self._dump_path is not None and os.path.exists(self._dump_path):
                fd = os.open(self._dump_path, os.O_RDONLY)
                try:
                    self._fsync(fd)
                finally:
                    os.close(fd)
                self._fsync_dir()
            older = self._segments
            old_files = [self._f, *self._pending]
            self._rolled = False
            self._segments = []
            self._pending = []
            self._entries = []
            self._f = self._new_segment(SEG_RESET)
            self._append(KIND_COMMIT, _U64.pack(self._commit))
            self._commit_written = self._commit
            self._sync_current()
            for f in old_files:
                with contextlib.suppress(OSError):
                    f.close()
            for seg in older:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(seg.path)
        except OSError as e:
            self._broken = e
            raise
        self._old_bytes = 0

    def deleteEntriesFrom(self, entryFrom: int) -> None:
        keep = len(range(*slice(None, entryFrom).indices(len(self._entries))))
        if keep >= len(self._entries):
            return
        self._append(KIND_CUT, _U64.pack(self._entries[keep][1]))
        del self._entries[keep:]

    def deleteEntriesTo(self, entryTo: int) -> None:
        """Rule 8: only in memory and one DROP record; the dump writer deleted the segments."""
        entries = self._entries
        drop = len(range(*slice(None, entryTo).indices(len(entries))))
        if drop == 0:
            return
        below = entries[drop][1] if drop < len(entries) else entries[-1][1] + 1
        self._append(KIND_DROP, _U64.pack(below))
        del entries[:drop]
        self.compactions += 1
        first = self._segments[-1].first
        if (not self._rolled and self._dump_path is not None and entries and first is not None
                and first < entries[0][1] and os.path.exists(self._dump_path)):
            self._compact_here()

    def _compact_here(self) -> None:
        """Entries before a dump were dropped and no segment was started for that dump (a dump
        written by pysyncobj's own serializer, without the forked writer; or an interrupted
        compaction completed at start): start one and retire the older segments now, on this
        thread, the dump made durable first."""
        segments = self.start_segment(self._entries[0][1])
        try:
            fd = os.open(self._dump_path, os.O_RDONLY)  # type: ignore[arg-type]
            try:
                self._fsync(fd)
            finally:
                os.close(fd)
            self._sync_current()
            retire_segments(segments, self._failpoints)
        except OSError as e:
            self._broken = e
            raise
        self.segments_retired(segments.older)

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
            for f in [self._f, *self._pending]:
                with contextlib.suppress(OSError):
                    f.close()
            self._pending = []

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

        The dump writer renames the dump into place and only on a later tick does pysyncobj drop
        the entries it replaces. After a crash between the two, the journal still starts before
        the dump's (prev, last) pair, and pysyncobj's dump load would then clear the whole
        journal, losing the entries after `last`. Call this with the dump's pair before
        pysyncobj loads it.
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

    # --- segments --------------------------------------------------------------------------------

    def start_segment(self, from_idx: int) -> Segments:
        """A dump of the state up to entry `from_idx` + 1 starts: new entries go to a new
        segment, which opens with a copy of the entries from `from_idx` on and the commit
        index. Nothing is fsynced here (the next `sync()` makes the new segment durable, and the
        older one if it holds records not synced yet); the dump writer deletes the older
        segments once the dump is durable (`Segments`), and `segments_retired` is told."""
        self._check_usable()
        entries = self._entries
        try:
            self._f.flush()
            older = tuple(s.path for s in self._segments)
            if self._dirty:
                self._pending.append(self._f)
            else:
                self._f.close()
            self._dirty = False
            self._old_bytes += self._bytes
            self._f = self._new_segment(0)
            at = max(0, from_idx - entries[0][1]) if entries else 0
            for command, idx, term in entries[at:]:
                self._append_entry(command, idx, term)
            self._append(KIND_COMMIT, _U64.pack(self._commit))
            self._commit_written = self._commit
            # Handed to the OS before the dump writer forks: it fsyncs this file by name.
            self._f.flush()
        except OSError as e:
            self._broken = e
            raise
        self._rolled = True
        return Segments(self._segments[-1].path, older, self._dir)

    def segments_retired(self, paths: tuple[str, ...]) -> None:
        """The dump writer deleted these older segments (their dump is durable)."""
        self._rolled = False
        gone = set(paths)
        keep = []
        for seg in self._segments[:-1]:
            if seg.path in gone:
                self._old_bytes -= seg.bytes
            else:
                keep.append(seg)
        self._segments = keep + self._segments[-1:]
        # Records of a deleted segment not synced yet: the dump and the new segment's head
        # (both durable now) hold all they held.
        still = []
        for f in self._pending:
            if f.name in gone:
                with contextlib.suppress(OSError):
                    f.close()
            else:
                still.append(f)
        self._pending = still

    def _new_segment(self, flags: int) -> Any:
        """Create the next segment file and write its SEG record (buffered); it is current."""
        seq = self._next_seq
        self._next_seq += 1
        path = os.path.join(self._dir, f"{self._base}.{seq:08d}")
        f = open(path, "xb", opener=private_opener)
        self._segments.append(_Segment(seq, path))
        self._f = f
        self._bytes = 0
        self._append(KIND_SEG, _SEG.pack(seq, flags))
        self._dir_dirty = True
        return f

    # --- durability ------------------------------------------------------------------------------

    def sync(self) -> None:
        """Make everything written so far durable; raise OSError if it cannot be."""
        self._check_usable()
        if not (self._dirty or self._dir_dirty or self._pending):
            return
        try:
            while self._pending:
                f = self._pending[0]
                f.flush()
                self._fsync(f.fileno(), data_only=True)
                self._pending.pop(0)
                with contextlib.suppress(OSError):
                    f.close()
            self._sync_current()
        except OSError as e:
            self._broken = e
            raise
        self._syncs += 1

    def _sync_current(self) -> None:
        if self._dirty:
            self._append_commit()
            self._f.flush()
            self._fsync(self._f.fileno(), data_only=True)
            self._dirty = False
        if self._dir_dirty:
            self._fsync_dir()
            self._dir_dirty = False

    @property
    def dirty(self) -> bool:
        """True when something written since the last sync is not durable yet."""
        return self._dirty or self._dir_dirty or bool(self._pending)

    @property
    def path(self) -> str:
        """The journal's name: its segments are `<path>.<seq>` (and `<path>` itself, of an
        earlier version)."""
        return self._path

    @property
    def segment_path(self) -> str:
        """The segment written now."""
        return self._segments[-1].path

    @property
    def segment_paths(self) -> list[str]:
        """Every live segment file, oldest first."""
        return [s.path for s in self._segments]

    @property
    def size_bytes(self) -> int:
        """Bytes of the segments since the last dump, about what their entries take in memory."""
        return self._bytes + self._old_bytes

    def stats(self) -> dict[str, int]:
        return {
            "entries": len(self._entries),
            "records": self._records,
            "bytes": self.size_bytes,
            "segments": len(self._segments),
            "syncs": self._syncs,
            "fsyncs": self._fsyncs,
            "torn_tail_dropped_bytes": self._torn_bytes,
            "unsynced_segments_dropped": self._dropped_segments,
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
        self._segments[-1].bytes = self._bytes
        self._records += 1
        self._dirty = True

    def _append_entry(self, command: bytes, idx: int, term: int) -> None:
        self._append(KIND_ADD, _IDX_TERM.pack(idx, term), command)
        seg = self._segments[-1]
        if seg.first is None:
            seg.first = idx

    def _append_commit(self) -> None:
        if self._commit != self._commit_written:
            self._append(KIND_COMMIT, _U64.pack(self._commit))
            self._commit_written = self._commit

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
