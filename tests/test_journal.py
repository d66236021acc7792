"""Tests of the durable Raft journal (meshjobs/journal.py) and the failpoints it passes through."""

from __future__ import annotations

import os
import shutil
import socket
import struct
import tempfile
import time
import zlib
from pathlib import Path
from typing import Any

import pysyncobj.syncobj
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)
from pysyncobj import SyncObj, SyncObjConf, replicated
from pysyncobj.journal import MemoryJournal

from meshjobs.dumpfile import check_dump, make_dump_pair
from meshjobs.failpoints import Failpoints
from meshjobs.journal import HEADER_BYTES, DurableJournal, JournalCorrupt, retire_segments


def _fill(path: Path, n: int, first_idx: int = 1) -> list[tuple[bytes, int, int]]:
    """Write n entries to a fresh journal at path, sync and close it; return the entries."""
    j = DurableJournal(str(path))
    entries = [(b"cmd-%d-" % i + bytes(i % 7), first_idx + i, 1 + i // 3) for i in range(n)]
    for e in entries:
        j.add(*e)
    j.sync()
    j._destroy()
    return entries


def _seg(path: Path, seq: int = 1) -> Path:
    """The file of segment `seq` of the journal at path."""
    return Path(f"{path}.{seq:08d}")


def _record_offsets(data: bytes) -> list[int]:
    """Start offsets of the records of a well-formed journal file."""
    offsets, pos = [], 0
    while pos < len(data):
        offsets.append(pos)
        (length,) = struct.unpack_from("<I", data, pos + 5)
        pos += HEADER_BYTES + length
    assert pos == len(data)
    return offsets


# --- round trips ---------------------------------------------------------------------------------


def test_round_trip_across_reopen(tmp_path: Path) -> None:
    """Entries, truncations, commit index, term and vote all survive close and reopen."""
    path = str(tmp_path / "journal")
    j = DurableJournal(path)
    assert len(j) == 0 and j.getCurrentTerm() == 0 and j.getVotedForNodeId() is None
    for i in range(1, 11):
        j.add(b"c%d" % i, i, 1)
    j.deleteEntriesFrom(7)  # keeps idx 1..7
    j.add(b"new8", 8, 2)
    j.setRaftCommitIndex(5)
    j.setCurrentTerm(2, "127.0.0.1:4001")
    j._destroy()

    j = DurableJournal(path)
    assert list(j[:]) == [(b"c%d" % i, i, 1) for i in range(1, 8)] + [(b"new8", 8, 2)]
    assert j.getRaftCommitIndex() == 5
    assert (j.getCurrentTerm(), j.getVotedForNodeId()) == (2, "127.0.0.1:4001")

    j.deleteEntriesTo(3)  # drops idx 1..3, as after a snapshot
    j.add(b"c9", 9, 2)
    j.setCurrentTerm(3, None)
    j._destroy()

    j = DurableJournal(path)
    assert [e[1] for e in j[:]] == [4, 5, 6, 7, 8, 9]
    assert j[0] == (b"c4", 4, 1) and j[-1] == (b"c9", 9, 2)
    assert (j.getCurrentTerm(), j.getVotedForNodeId()) == (3, None)
    assert j.getRaftCommitIndex() == 5

    j.clear()
    j.add(b"p", 100, 3)
    j.add(b"l", 101, 3)
    j._destroy()
    j = DurableJournal(path)
    assert j[:] == [(b"p", 100, 3), (b"l", 101, 3)]
    j._destroy()


def test_entries_are_tuples_of_bytes_int_int(tmp_path: Path) -> None:
    """pysyncobj compares entries with tuples, so they must be tuples before and after reopen."""
    path = str(tmp_path / "journal")
    j = DurableJournal(path)
    j.add(bytearray(b"abc"), 1, 1)
    assert j[0] == (b"abc", 1, 1) and type(j[0]) is tuple and type(j[0][0]) is bytes
    assert not (j[0] != (b"abc", 1, 1))
    j._destroy()
    j = DurableJournal(path)
    assert type(j[0]) is tuple and type(j[0][0]) is bytes and j[0] == (b"abc", 1, 1)
    j._destroy()


def test_add_refuses_a_gap_in_idx(tmp_path: Path) -> None:
    """Rule 4: idx increases by one; an add that breaks it raises and writes nothing."""
    j = DurableJournal(str(tmp_path / "journal"))
    j.add(b"a", 1, 1)
    records = j.stats()["records"]
    with pytest.raises(ValueError, match="increase by one"):
        j.add(b"b", 3, 1)
    assert len(j) == 1 and j.stats()["records"] == records
    j._destroy()


# --- a model check against pysyncobj's MemoryJournal -----------------------------------------------


class JournalVsMemory(RuleBasedStateMachine):
    """DurableJournal behaves like MemoryJournal op by op, across reopens at random points."""

    @initialize()
    def start(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="journal-model-")
        self.path = os.path.join(self.dir, "journal")
        self.j = DurableJournal(self.path)
        self.m = MemoryJournal()
        self.commit = 1
        self.term: tuple[int, str | None] = (0, None)

    def teardown(self) -> None:
        if hasattr(self, "j"):
            self.j._destroy()
            shutil.rmtree(self.dir, ignore_errors=True)

    @rule(command=st.binary(max_size=40), term=st.integers(0, 5), first=st.integers(1, 1000))
    def add(self, command: bytes, term: int, first: int) -> None:
        idx = self.m[-1][1] + 1 if len(self.m) else first
        self.j.add(command, idx, term)
        self.m.add(command, idx, term)

    @rule(n=st.integers(-12, 12))
    def delete_from(self, n: int) -> None:
        self.j.deleteEntriesFrom(n)
        self.m.deleteEntriesFrom(n)

    @rule(n=st.integers(-12, 12))
    def delete_to(self, n: int) -> None:
        self.j.deleteEntriesTo(n)
        self.m.deleteEntriesTo(n)

    @rule()
    def clear(self) -> None:
        self.j.clear()
        self.m.clear()

    @rule(commit=st.integers(1, 10_000))
    def set_commit(self, commit: int) -> None:
        self.j.setRaftCommitIndex(commit)
        self.commit = commit

    @rule(term=st.integers(0, 2**63), vote=st.one_of(st.none(), st.text(max_size=30)))
    def set_term(self, term: int, vote: str | None) -> None:
        self.j.setCurrentTerm(term, vote)
        self.m.setCurrentTerm(term, vote)
        self.term = (term, vote)

    @rule()
    def sync(self) -> None:
        self.j.sync()
        assert not self.j.dirty

    @rule()
    def one_second_timer(self) -> None:
        self.j.onOneSecondTimer()

    @rule()
    def reopen(self) -> None:
        self.j._destroy()
        self.j = DurableJournal(self.path)

    @precondition(lambda self: len(self.m) > 0)
    @rule(data=st.data())
    def index(self, data: st.DataObject) -> None:
        i = data.draw(st.integers(-len(self.m), len(self.m) - 1))
        assert self.j[i] == self.m[i]

    @rule(
        start=st.one_of(st.none(), st.integers(-15, 15)),
        stop=st.one_of(st.none(), st.integers(-15, 15)),
        step=st.one_of(st.none(), st.integers(1, 3), st.integers(-3, -1)),
    )
    def slice_(self, start: int | None, stop: int | None, step: int | None) -> None:
        assert self.j[start:stop:step] == self.m[start:stop:step]

    @invariant()
    def same(self) -> None:
        if not hasattr(self, "j"):
            return
        assert len(self.j) == len(self.m)
        assert self.j[:] == self.m[:]
        assert self.j.getRaftCommitIndex() == self.commit
        assert (self.j.getCurrentTerm(), self.j.getVotedForNodeId()) == self.term


JournalVsMemory.TestCase.settings = settings(
    max_examples=60,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_journal_matches_memory_journal = JournalVsMemory.TestCase


# --- torn tails and damage -----------------------------------------------------------------------


def test_torn_tail_at_every_offset_of_the_last_record(tmp_path: Path) -> None:
    """Rule 3: a last record cut anywhere is dropped with the bytes counted; the rest is intact."""
    src = tmp_path / "whole"
    entries = _fill(src, 5)
    data = _seg(src).read_bytes()
    last = _record_offsets(data)[-1]
    for cut in range(last, len(data)):
        path = tmp_path / f"cut-{cut}"
        _seg(path).write_bytes(data[:cut])
        j = DurableJournal(str(path))
        assert j[:] == entries[:-1], cut
        assert j.stats()["torn_tail_dropped_bytes"] == cut - last
        assert _seg(path).stat().st_size == last
        j.add(b"again", entries[-1][1], 9)  # the log goes on where the torn record was
        j._destroy()
        j = DurableJournal(str(path))
        assert j[:] == entries[:-1] + [(b"again", entries[-1][1], 9)]
        assert j.stats()["torn_tail_dropped_bytes"] == 0
        j._destroy()


def test_garbage_tail_is_dropped(tmp_path: Path) -> None:
    """Zeros or stray magic after the last record (never synced) are cut off, not fatal."""
    path = tmp_path / "journal"
    entries = _fill(path, 3)
    size = _seg(path).stat().st_size
    with open(_seg(path), "ab") as f:
        f.write(b"\0" * 100 + b"MJL1" + b"\xff" * 20)
    j = DurableJournal(str(path))
    assert j[:] == entries
    assert j.stats()["torn_tail_dropped_bytes"] == 124
    assert _seg(path).stat().st_size == size
    j._destroy()


def test_flipped_byte_in_a_middle_record_is_corrupt(tmp_path: Path) -> None:
    """Rule 3: damage followed by a good record stops the member, whichever byte it hits."""
    src = tmp_path / "whole"
    _fill(src, 5)
    data = _seg(src).read_bytes()
    offsets = _record_offsets(data)
    for pos in range(offsets[2], offsets[3]):
        damaged = bytearray(data)
        damaged[pos] ^= 0x40
        path = tmp_path / "damaged"
        _seg(path).write_bytes(bytes(damaged))
        with pytest.raises(JournalCorrupt, match=f"offset {offsets[2]}.*will not start"):
            DurableJournal(str(path))
        assert _seg(path).read_bytes() == bytes(damaged), "a corrupt journal must not be rewritten"


def test_idx_gap_in_the_file_is_corrupt(tmp_path: Path) -> None:
    """Rule 4: a well-checksummed ADD whose idx does not follow the previous one is corrupt."""
    src = tmp_path / "whole"
    _fill(src, 3)
    data = bytearray(_seg(src).read_bytes())
    second = _record_offsets(bytes(data))[2]  # the second ADD (the SEG record is first)
    # Rewrite the second record's idx and recompute its crc so only the sequence is wrong.
    (length,) = struct.unpack_from("<I", data, second + 5)
    struct.pack_into("<Q", data, second + HEADER_BYTES, 7)
    body = bytes(data[second + HEADER_BYTES : second + HEADER_BYTES + length])
    crc = zlib.crc32(body, zlib.crc32(bytes(data[second + 4 : second + 9])))
    struct.pack_into("<I", data, second + 9, crc)
    _seg(src).write_bytes(bytes(data))
    with pytest.raises(JournalCorrupt, match="does not follow"):
        DurableJournal(str(src))


def test_term_file_damage_is_corrupt(tmp_path: Path) -> None:
    """A flipped byte anywhere in the term file, or a cut one, stops the member."""
    path = tmp_path / "journal"
    j = DurableJournal(str(path))
    j.setCurrentTerm(7, "127.0.0.1:4321")
    j._destroy()
    term_path = tmp_path / "journal.term"
    good = term_path.read_bytes()
    for pos in range(len(good)):
        damaged = bytearray(good)
        damaged[pos] ^= 0x01
        term_path.write_bytes(bytes(damaged))
        with pytest.raises(JournalCorrupt, match="term file"):
            DurableJournal(str(path))
    for cut in range(len(good)):
        term_path.write_bytes(good[:cut])
        with pytest.raises(JournalCorrupt, match="term file"):
            DurableJournal(str(path))
    term_path.write_bytes(good)
    j = DurableJournal(str(path))
    assert (j.getCurrentTerm(), j.getVotedForNodeId()) == (7, "127.0.0.1:4321")
    j._destroy()


def test_leftover_tmp_files_are_ignored(tmp_path: Path) -> None:
    """A rewrite or term update that crashed before its rename leaves the old files in charge."""
    path = tmp_path / "journal"
    entries = _fill(path, 4)
    (tmp_path / "journal.tmp").write_bytes(b"half a rewrite")
    (tmp_path / "journal.term.tmp").write_bytes(b"half a term")
    j = DurableJournal(str(path))
    assert j[:] == entries and j.getCurrentTerm() == 0
    assert not (tmp_path / "journal.tmp").exists()
    j._destroy()


# --- sync and failpoints -------------------------------------------------------------------------


def test_sync_on_a_clean_journal_does_no_fsync(tmp_path: Path) -> None:
    """Rule 1: sync is free when nothing is dirty, and does real work when something is."""
    j = DurableJournal(str(tmp_path / "journal"))
    assert j.dirty  # the new file's name is not durable yet
    j.add(b"a", 1, 1)
    j.sync()
    assert not j.dirty
    before = j.stats()
    j.sync()
    j.sync()
    assert j.stats()["fsyncs"] == before["fsyncs"] and j.stats()["syncs"] == before["syncs"]
    j.add(b"b", 2, 1)
    assert j.dirty
    j.sync()
    assert j.stats()["fsyncs"] == before["fsyncs"] + 1
    j._destroy()


def test_commit_index_is_written_lazily(tmp_path: Path) -> None:
    """Rule 6: commit changes alone make no fsync; they ride with the next sync, once."""
    path = str(tmp_path / "journal")
    j = DurableJournal(path)
    j.add(b"a", 1, 1)
    j.sync()
    records = j.stats()["records"]
    fsyncs = j.stats()["fsyncs"]
    for c in range(2, 50):
        j.setRaftCommitIndex(c)
    j.sync()
    assert j.stats()["fsyncs"] == fsyncs
    j.add(b"b", 2, 1)
    j.sync()
    assert j.stats()["records"] == records + 2  # one ADD and one COMMIT
    j.setRaftCommitIndex(60)
    j.onOneSecondTimer()
    assert j.dirty
    j._destroy()
    assert DurableJournal(path).getRaftCommitIndex() == 60


def test_failpoint_makes_sync_fail_and_stay_failed(tmp_path: Path) -> None:
    """Rule 2: with journal.fsync=1 the first sync raises OSError, and so does every later one."""
    j = DurableJournal(str(tmp_path / "journal"), Failpoints("journal.fsync=1"))
    j.add(b"a", 1, 1)
    with pytest.raises(OSError, match="injected failure at journal.fsync"):
        j.sync()
    with pytest.raises(OSError, match="failed earlier"):
        j.sync()
    with pytest.raises(OSError):
        j.setCurrentTerm(1, None)
    j._destroy()


def test_failpoint_fails_on_the_nth_fsync(tmp_path: Path) -> None:
    """journal.fsync=3: two syncs pass, the third raises."""
    j = DurableJournal(str(tmp_path / "journal"), Failpoints("journal.fsync=3"))
    j.add(b"a", 1, 1)
    j.sync()  # the file and its new folder entry: two fsyncs
    j.add(b"b", 2, 1)
    with pytest.raises(OSError):
        j.sync()
    j._destroy()


def test_failpoints_spec() -> None:
    """Bad specs are refused with a clear message; counts start at one."""
    for bad in [
        "journal.fsync",
        "journal.fsync=0",
        "journal.fsync=x",
        "nope.fsync=1",
        "journal.fsync=1,journal.fsync=2",
    ]:
        with pytest.raises(ValueError, match="failpoint"):
            Failpoints(bad)
    fp = Failpoints(" blob.fsync=2 , dump.fsync=1 ")
    fp.hit("journal.fsync")
    fp.hit("blob.fsync")
    with pytest.raises(OSError):
        fp.hit("blob.fsync")
    with pytest.raises(OSError):
        fp.hit("blob.fsync")
    assert fp.hits("blob.fsync") == 3
    assert not Failpoints().active


def test_failpoints_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """MESHJOBS_FAILPOINTS configures the points."""
    monkeypatch.setenv("MESHJOBS_FAILPOINTS", "dump.fsync=1")
    with pytest.raises(OSError):
        Failpoints.from_env().hit("dump.fsync")
    monkeypatch.delenv("MESHJOBS_FAILPOINTS")
    Failpoints.from_env().hit("dump.fsync")


# --- a real pysyncobj fleet of one ---------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Table(SyncObj):
    def __init__(self, self_node: str, conf: SyncObjConf, state: dict) -> None:
        super().__init__(self_node, [], conf)
        self.state = state

    @replicated
    def put(self, key: str, value: int) -> int:
        self.state[key] = value
        return value


class _Member:
    """One pysyncobj member over DurableJournal and meshjobs dumps, ticked by hand."""

    def __init__(
        self,
        folder: Path,
        port: int,
        journals: list[DurableJournal],
        compact_entries_min: int = 8,
    ) -> None:
        self.state: dict = {}

        def set_state(new: dict) -> None:
            self.state.clear()
            self.state.update(new)

        real_serializer, deserializer = make_dump_pair(lambda: dict(self.state), set_state)

        def serializer(tmp_path: str, data: Any) -> None:
            # Keep the entries as they are when a dump is taken (before pysyncobj trims them),
            # so a test can stage a crash between the dump's rename and the trim.
            self.at_dump = list(self.journal[:])
            real_serializer(tmp_path, data)

        conf = SyncObjConf(
            autoTick=False,
            journalFile=str(folder / "journal"),
            fullDumpFile=str(folder / "dump"),
            serializer=serializer,
            deserializer=deserializer,
            password=os.urandom(32),
            appendEntriesUseBatch=False,
            logCompactionMinEntries=compact_entries_min,
        )
        self.at_dump: list = []
        self.obj = _Table(f"127.0.0.1:{port}", conf, self.state)
        self.journal = journals[-1]

    def tick_until(self, done, timeout_s: float = 20.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not done():
            assert time.monotonic() < deadline, "pysyncobj did not get there in time"
            self.obj.doTick(0.01)
            self.journal.sync()

    def put(self, key: str, value: int) -> None:
        results: list = []
        self.obj.put(key, value, callback=lambda res, err: results.append((res, err)))
        self.tick_until(lambda: results)
        assert results[0][1] == 0, results  # FAIL_REASON.SUCCESS

    def close(self) -> None:
        self.obj.destroy()


@pytest.fixture
def durable_pysyncobj(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    journals: list[DurableJournal] = []

    def create(path: str) -> DurableJournal:
        # What the member does at start: refuse a damaged dump, and finish a compaction that a
        # crash interrupted before pysyncobj loads the dump.
        dump = check_dump(str(tmp_path / "dump"))
        journal = DurableJournal(path, dump_path=str(tmp_path / "dump"))
        if dump is not None:
            journal.complete_compaction(dump.prev, dump.last)
        journals.append(journal)
        return journal

    # monkeypatch puts pysyncobj's own createJournal back after the test.
    monkeypatch.setattr(pysyncobj.syncobj, "createJournal", create)
    return journals


def test_pysyncobj_state_survives_restart(tmp_path: Path, durable_pysyncobj: list) -> None:
    """A fleet of one on DurableJournal comes back with the same state, before any compaction."""
    port = _free_port()
    m = _Member(tmp_path, port, durable_pysyncobj)
    for i in range(5):
        m.put(f"k{i}", i)
    assert not (tmp_path / "dump").exists()
    expected = dict(m.state)
    m.close()

    m = _Member(tmp_path, port, durable_pysyncobj)
    m.tick_until(lambda: m.state == expected)
    m.put("after", 1)
    assert m.state == {**expected, "after": 1}
    m.close()


def test_pysyncobj_state_survives_restart_after_compaction(
    tmp_path: Path, durable_pysyncobj: list
) -> None:
    """After log compactions the dump and the rewritten journal together restore the state."""
    port = _free_port()
    m = _Member(tmp_path, port, durable_pysyncobj)
    for i in range(40):
        m.put(f"k{i % 13}", i)
    assert (tmp_path / "dump").exists(), "no compaction happened"
    assert len(m.journal) < 40
    expected = dict(m.state)
    m.close()

    m = _Member(tmp_path, port, durable_pysyncobj)
    m.tick_until(lambda: m.state == expected)
    for i in range(5):
        m.put(f"x{i}", i)
    assert m.state == {**expected, **{f"x{i}": i for i in range(5)}}
    m.close()

    m = _Member(tmp_path, port, durable_pysyncobj)
    m.tick_until(lambda: m.state == {**expected, **{f"x{i}": i for i in range(5)}})
    m.close()


def test_pysyncobj_crash_between_dump_and_trim(tmp_path: Path, durable_pysyncobj: list) -> None:
    """A crash after the dump's rename but before the journal was trimmed loses nothing: the
    entries after the dump's last entry are kept (pysyncobj alone would clear them)."""
    port = _free_port()
    m = _Member(tmp_path, port, durable_pysyncobj)
    for i in range(30):
        m.put(f"k{i}", i)
    at_dump = m.at_dump
    m.close()
    # No more compactions, so the entries after the dump stay in the journal.
    m = _Member(tmp_path, port, durable_pysyncobj, compact_entries_min=10_000)
    for i in range(5):
        m.put(f"x{i}", i)
    expected = dict(m.state)
    commit = m.journal.getRaftCommitIndex()
    m.close()

    # Stage the crash: the journal as it was when the last dump was taken, followed by
    # everything written since.
    later = DurableJournal(str(tmp_path / "journal"))
    first = later[0][1]
    staged = [e for e in at_dump if e[1] < first] + later[:]
    assert staged[0][1] < first, "the staged journal must start before the dump"
    for path in later.segment_paths:
        os.unlink(path)
    later._destroy()
    j = DurableJournal(str(tmp_path / "journal"))
    for e in staged:
        j.add(*e)
    j.setRaftCommitIndex(commit)
    j._destroy()

    m = _Member(tmp_path, port, durable_pysyncobj, compact_entries_min=10_000)
    assert m.journal[0][1] == first, "the interrupted compaction was not completed"
    m.tick_until(lambda: m.state == expected)
    m.close()


# --- segments: a dump starts one, its writer deletes the older ones ------------------------------
#
# What `start_segment`, the dump writer (journal.retire_segments) and pysyncobj (deleteEntriesTo)
# do at the end of a dump, and the folders a crash or a power cut at each step can leave: each is
# built here with the journal's own calls, then the files a power cut would lose are taken away.


def _log(path: Path, n: int) -> DurableJournal:
    """A journal at path with entries 1..n (term 1), synced, left open."""
    j = DurableJournal(str(path))
    for i in range(1, n + 1):
        j.add(b"c%d" % i, i, 1)
    j.setRaftCommitIndex(n)
    j.sync()
    return j


def _dump_of(folder: Path, j: DurableJournal, prev_idx: int) -> str:
    """A dump whose (prev, last) are entries prev_idx and prev_idx + 1 of j, written and
    fsynced as the dump writer writes one."""
    from meshjobs.dumpfile import write_dump

    first = j[0][1]
    path = str(folder / "raft.dump")
    write_dump(path + ".tmp", {"upto": prev_idx + 1}, j[prev_idx + 1 - first],
               j[prev_idx - first], ["127.0.0.1:1"])
    os.replace(path + ".tmp", path)
    return path


def _entries(path: Path, dump_prev_idx: int | None) -> list:
    j = DurableJournal(str(path), dump_path=str(path.parent / "raft.dump"),
                       dump_prev_idx=dump_prev_idx)
    out = list(j[:])
    j._destroy()
    return out


def test_a_dump_costs_the_jobs_thread_no_fsync_and_no_entry_written_again(tmp_path: Path) -> None:
    """What the jobs thread does for a dump: start a segment (its head: the entries from the
    dump's prev on and the commit index), then, the dump written, drop the entries before it.
    Neither fsyncs, and the entries before the dump are not written again (before, the end of a
    dump rewrote the journal and fsynced four times)."""
    path = tmp_path / "raft.journal"
    j = _log(path, 1000)
    dump = _dump_of(tmp_path, j, 997)
    j2 = DurableJournal(str(path), dump_path=dump)  # as the member runs: with its dump path
    j._destroy()
    j = j2
    fsyncs, written = j.stats()["fsyncs"], j.size_bytes
    segments = j.start_segment(997)
    assert j.stats()["fsyncs"] == fsyncs
    assert j.size_bytes - written < 200, "only the head (entries 997..1000) is written"
    retire_segments(segments)  # the dump writer's part, off the jobs thread
    j.segments_retired(segments.older)
    j.deleteEntriesTo(997 - j[0][1])  # pysyncobj, after the dump writer's success
    assert j.stats()["fsyncs"] == fsyncs
    assert [e[1] for e in j[:]] == [997, 998, 999, 1000]
    assert j.segment_paths == [segments.new]
    assert not any(os.path.exists(p) for p in segments.older)
    j.add(b"c1001", 1001, 2)
    j.sync()  # the next sync makes the new segment and its name durable, as any append's would
    j._destroy()
    assert [e[1] for e in _entries(path, 997)] == [997, 998, 999, 1000, 1001]


def test_segments_started_and_retired_again_and_again(tmp_path: Path) -> None:
    """Many dumps in a row: each starts a segment and retires the ones before; the log read
    back is the log held, and only the newest segment is left."""
    path = tmp_path / "raft.journal"
    j = _log(path, 3)
    idx = 3
    for round_ in range(20):
        for _ in range(round_ % 4):
            idx += 1
            j.add(b"r%d" % idx, idx, 2)
        segments = j.start_segment(idx - 1)
        idx += 1
        j.add(b"after%d" % idx, idx, 2)  # logged while the dump is written
        j.sync()
        retire_segments(segments)
        j.segments_retired(segments.older)
        j.deleteEntriesTo(idx - 2 - j[0][1])
        held = list(j[:])
        assert len(j.segment_paths) == 1
        assert _entries(path, idx - 2)[-len(held):] == held
    j._destroy()


def test_crash_while_the_dump_is_written(tmp_path: Path) -> None:
    """A crash with the dump half-written (raft.dump.tmp) and the new segment started: the
    entries are those of the old segment and the new one, whatever of the new one reached the
    disk (here: its whole head and an entry not yet synced)."""
    path = tmp_path / "raft.journal"
    j = _log(path, 10)
    j.start_segment(9)
    j.add(b"c11", 11, 1)
    j.flush()  # a process crash keeps what reached the OS
    (tmp_path / "raft.dump.tmp").write_bytes(b"half a dump")
    want = list(j[:])
    assert _entries(path, None) == want
    j._destroy()


def test_power_cut_before_the_new_segment_was_synced(tmp_path: Path) -> None:
    """The new segment's name never reached the disk (nothing synced since it was started):
    the old segment holds every entry ever acknowledged, with or without the dump."""
    path = tmp_path / "raft.journal"
    j = _log(path, 10)
    acked = list(j[:])
    segments = j.start_segment(9)
    j.add(b"c11", 11, 1)
    j.flush()
    os.unlink(segments.new)  # lost with the power
    assert _entries(path, None) == acked
    _dump_of(tmp_path, j, 9)  # the dump was renamed into place, its name durable or not
    assert _entries(path, 9) == acked
    j._destroy()


@pytest.mark.parametrize("deleted", [0, 1])
def test_power_cut_before_the_older_segments_were_deleted(tmp_path: Path, deleted: int) -> None:
    """The dump and the new segment are durable, the older segments were not deleted yet (or
    only the oldest was): the journal is read from the new segment, and the older ones are left
    for the next dump's writer to delete."""
    path = tmp_path / "raft.journal"
    j = _log(path, 10)
    j.start_segment(5)  # a dump that failed: its segment stays
    j.add(b"c11", 11, 1)
    second = j.start_segment(10)
    j.add(b"c12", 12, 1)
    j.sync()
    _dump_of(tmp_path, j, 10)
    want = list(j[:])[9:]  # entries 10..12: the dump covers the rest
    j._destroy()
    assert len(second.older) == 2
    for p in second.older[:deleted]:
        os.unlink(p)
    got = DurableJournal(str(path), dump_prev_idx=10)
    assert list(got[:]) == want
    assert got.segment_paths == [*second.older[deleted:], second.new]
    nxt = got.start_segment(11)
    assert nxt.older == (*second.older[deleted:], second.new)
    retire_segments(nxt)
    got.segments_retired(nxt.older)
    assert got.segment_paths == [nxt.new]
    got._destroy()
    assert _entries(path, 11) == want[1:]


def test_power_cut_with_the_new_segment_durable_but_not_the_old_ones_tail(tmp_path: Path) -> None:
    """The dump's writer fsynced the new segment's head, but the dump itself did not stay and
    the older segment lost records never synced: the new segment follows a gap, so it was never
    synced by the member (a sync makes the older segments whole first): it is dropped, and the
    log is what was acknowledged."""
    path = tmp_path / "raft.journal"
    j = _log(path, 10)
    acked = list(j[:])
    for i in range(11, 15):
        j.add(b"c%d" % i, i, 1)  # applied, not synced (a follower's)
    segments = j.start_segment(13)
    j.flush()
    old = segments.older[0]
    # The old segment as a power cut leaves it: only what was synced.
    with open(old, "rb") as f:
        data = f.read()
    offsets = _record_offsets(data)
    # The records of entries 11..14 come last: cut the file before the first of them.
    cut = offsets[-4]
    with open(old, "r+b") as f:
        f.truncate(cut)
    got = DurableJournal(str(path))
    assert list(got[:]) == acked
    assert got.stats()["unsynced_segments_dropped"] == 1
    assert not os.path.exists(segments.new)
    got.add(b"again", 11, 2)  # the log goes on where the synced part ended
    got._destroy()
    assert _entries(path, None) == acked + [(b"again", 11, 2)]
    j._destroy()


def test_a_snapshot_installed_resets_the_log(tmp_path: Path) -> None:
    """clear() (a dump received from the leader): a reset segment, synced, then the older
    segments deleted; after a crash that kept them (their deletion lost), the reset segment is
    read alone."""
    path = tmp_path / "raft.journal"
    j = _log(path, 10)
    j._destroy()
    (tmp_path / "raft.dump").write_bytes(b"the leader's dump")
    j = DurableJournal(str(path), dump_path=str(tmp_path / "raft.dump"))
    old = {p: Path(p).read_bytes() for p in j.segment_paths}
    j.clear()
    assert not any(os.path.exists(p) for p in old)
    j.add(b"p", 500, 4)
    j.add(b"l", 501, 4)
    j.sync()
    j._destroy()
    for p, data in old.items():
        Path(p).write_bytes(data)
    assert _entries(path, None) == [(b"p", 500, 4), (b"l", 501, 4)]
    assert _entries(path, 500) == [(b"p", 500, 4), (b"l", 501, 4)]


def test_a_torn_reset_or_new_segment_header_is_an_empty_segment(tmp_path: Path) -> None:
    """A new segment whose first record never reached the disk (cut anywhere in its SEG record)
    held nothing synced: it is deleted at start and the log is the older segments'."""
    path = tmp_path / "raft.journal"
    j = _log(path, 5)
    acked = list(j[:])
    segments = j.start_segment(5)
    j.flush()
    head = Path(segments.new).read_bytes()[:HEADER_BYTES + 9]
    j._destroy()
    for cut in range(len(head)):
        Path(segments.new).write_bytes(head[:cut])
        assert _entries(path, None) == acked
        assert not os.path.exists(segments.new)


def test_a_damaged_segment_header_with_records_after_it_is_corrupt(tmp_path: Path) -> None:
    """A flipped byte in a segment's SEG record with good records after it is damage, and a
    segment file whose SEG record names another segment is not one of ours: both stop the
    member."""
    path = tmp_path / "raft.journal"
    j = _log(path, 5)
    j._destroy()
    seg = _seg(path)
    good = seg.read_bytes()
    damaged = bytearray(good)
    damaged[HEADER_BYTES + 2] ^= 0x10
    seg.write_bytes(bytes(damaged))
    with pytest.raises(JournalCorrupt, match="damaged SEG record"):
        DurableJournal(str(path))
    seg.write_bytes(good)
    os.replace(seg, _seg(path, 7))
    with pytest.raises(JournalCorrupt, match="says it is segment 1"):
        DurableJournal(str(path))


def test_a_journal_of_an_earlier_version_loads_and_is_retired_by_the_first_dump(
        tmp_path: Path) -> None:
    """A data folder written before segments: the one file `raft.journal` (and a leftover of
    its rewrite) is read as it was, appended to, and deleted by the first dump's writer."""
    path = tmp_path / "raft.journal"
    _fill_legacy(path, 8)
    (tmp_path / "raft.journal.tmp").write_bytes(b"half a rewrite")
    j = DurableJournal(str(path))
    assert [e[1] for e in j[:]] == [4, 5, 6, 7, 8] and j.getRaftCommitIndex() == 6
    assert j.segment_paths == [str(path)]
    j.add(b"c9", 9, 2)
    j.sync()
    segments = j.start_segment(8)
    assert segments.older == (str(path),)
    retire_segments(segments)
    j.segments_retired(segments.older)
    j.deleteEntriesTo(8 - j[0][1])
    j._destroy()
    assert not path.exists() and not (tmp_path / "raft.journal.tmp").exists()
    assert [e[1] for e in _entries(path, 8)] == [8, 9]


def _fill_legacy(path: Path, n: int) -> None:
    """The one-file journal an earlier version wrote: entries 1..n, the first three dropped by a
    rewrite (gone from the file), a TRUNC and a COMMIT."""
    import zlib as _z

    def record(kind: int, body: bytes) -> bytes:
        head = struct.pack("<BI", kind, len(body))
        return b"MJL1" + head + struct.pack("<I", _z.crc32(body, _z.crc32(head))) + body

    out = b"".join(record(1, struct.pack("<QQ", i, 1) + b"c%d" % i) for i in range(4, n + 2))
    out += record(2, struct.pack("<Q", n - 3))  # keep 4..n: cut the extra one
    out += record(3, struct.pack("<Q", 6))
    path.write_bytes(out)
