"""The Raft seam with a real pysyncobj-backed Replica in this process (autoTick off, driven by
doTick): AppendEntries delivered reordered, duplicated and stale never cut or rewrite a
committed entry in the journal; pre-vote and stickiness messages go through the same seam.

The leader is played by the test: it hands the follower the messages pysyncobj's leader sends
(`append_entries` with prevLogIdx, prevLogTerm, entries and commit_index), in orders a leader's
optimistic nextIndex, a reconnect or a duplicate delivery would produce.
"""

from __future__ import annotations

import os
import pickle
import random
import struct

import msgpack
import pytest

from meshjobs import raftseam
from meshjobs.failpoints import Failpoints
from meshjobs.journal import HEADER_BYTES, KIND_CUT
from meshjobs.replica import Replica
from meshjobs.table import JobTable
from tests.helpers import free_port

_HEADER = struct.Struct("<4sBII")


@pytest.fixture
def follower(tmp_path):
    made = []

    def make(name: str = "f") -> tuple[Replica, object]:
        data = tmp_path / name
        data.mkdir()
        r = Replica(f"127.0.0.1:{free_port()}", [f"127.0.0.1:{free_port()}"], str(data),
                    os.urandom(32), JobTable(), Failpoints())
        made.append(r)
        leader = next(iter(r._SyncObj__otherNodes))
        return r, leader

    yield make
    for r in made:
        r.close()


def command(r: Replica, n: int) -> bytes:
    """An entry as pysyncobj's leader logs a call of `apply_entry` (regular command byte 0)."""
    func_id = r._methodToID[r._getFuncName("apply_entry")]
    raw = msgpack.packb({"op": "test", "n": n})
    return bytes([0]) + pickle.dumps((func_id, (raw,)))


def truncations(path: str) -> list[int]:
    """The CUT records of a journal segment: how many entries each kept (the log starts at 1)."""
    with open(path, "rb") as f:
        data = f.read()
    out, pos = [], 0
    while pos + HEADER_BYTES <= len(data):
        _magic, kind, length, _crc = _HEADER.unpack_from(data, pos)
        if kind == KIND_CUT:
            out.append(struct.unpack_from("<Q", data, pos + HEADER_BYTES)[0] - 1)
        pos += HEADER_BYTES + length
    return out


def append(prev: int, log: list, upto: int, commit: int, term: int = 1) -> dict:
    return {"type": "append_entries", "term": term, "commit_index": commit,
            "prevLogIdx": prev, "prevLogTerm": log[prev - 1][2],
            "entries": [tuple(e) for e in log[prev:upto]]}


def deliver(r: Replica, leader: object, msg: dict) -> None:
    r._SyncObj__onMessageReceived(leader, msg)
    r.tick(0.0)


def leader_log(r: Replica, n: int, term: int = 1) -> list:
    """Entries 1..n as the leader holds them: the first no-op every log starts with, then ours."""
    first = r._SyncObj__raftLog[0]
    return [tuple(first)] + [(command(r, i), i, term) for i in range(2, n + 1)]


@pytest.mark.parametrize("seed", range(6))
def test_reordered_duplicated_appends_never_cut_a_committed_entry(follower, seed, caplog):
    """Raft §5.3 at the seam: messages a leader sent as its commit index grew, delivered in a
    shuffled order with duplicates, leave every committed entry in the journal as it was first
    written: no TRUNC record at or below the commit index, each index applied once, and the
    follower ends with the leader's whole log."""
    rng = random.Random(seed)
    r, leader = follower()
    n = 40
    log = leader_log(r, n)
    # What the leader sent over time: windows of entries, with the commit index it had then.
    sent = []
    commit = 1
    prev = 1
    while prev < n:
        upto = min(n, prev + rng.randint(1, 6))
        sent.append(append(prev, log, upto, commit))
        commit = max(commit, prev - rng.randint(0, 3))
        prev = upto
    sent.append(append(n, log, n, n))
    deliveries = sent + [rng.choice(sent) for _ in range(len(sent))]
    # Messages arrive roughly in order, with some from the past and duplicates among them.
    deliveries.sort(key=lambda m: m["prevLogIdx"] + rng.randint(-12, 4))
    deliveries += sent  # then the leader's retries catch the follower up
    journal_path = r.journal.segment_path
    applied = []
    for msg in deliveries:
        commit_before = r.raftCommitIndex
        cuts_before = len(truncations(journal_path))
        deliver(r, leader, msg)
        for keep in truncations(journal_path)[cuts_before:]:
            assert keep + 1 > commit_before, (
                f"seed {seed}: journal cut from {keep + 1} at commit {commit_before}")
        held = r.journal[:]
        for e in held[:r.raftCommitIndex]:
            assert tuple(e) == log[e[1] - 1], f"seed {seed}: committed entry {e[1]} rewritten"
        applied += [a.index for a in r.take_applied()]
    assert r.raftCommitIndex == n
    assert [tuple(e) for e in r.journal[:]] == log
    assert applied == list(range(2, n + 1))
    assert r.raft_stats["truncations_refused"] == 0
    assert r.raft_stats["entries_skipped_duplicate"] > 0
    assert not [x for x in caplog.records if "already-applied" in x.getMessage()]


def test_conflicting_uncommitted_suffix_is_cut_from_the_first_conflict_only(follower):
    """Raft §5.3: entries from an old term past the commit index are replaced from the first
    entry whose term differs; the ones before it, same term, are kept (not cut and rewritten)."""
    r, leader = follower()
    old = leader_log(r, 10, term=1)
    deliver(r, leader, append(1, old, 10, 5))
    assert r.raftCommitIndex == 5
    new = old[:7] + [(command(r, 100 + i), i, 2) for i in range(8, 13)]
    cuts = len(truncations(r.journal.segment_path))
    deliver(r, leader, append(3, new, 12, 9, term=2))
    assert [tuple(e) for e in r.journal[:]] == new
    assert truncations(r.journal.segment_path)[cuts:] == [7]  # kept 1..7, cut from 8
    assert r.raft_stats["truncations"] == 1
    assert r.raft_stats["entries_skipped_duplicate"] == 4  # 4..7 were held


def test_a_leader_disagreeing_with_a_committed_entry_is_refused(follower):
    """Never truncate at or below the commit index: the message is refused and counted, and
    the journal keeps the committed entries."""
    r, leader = follower()
    log = leader_log(r, 8)
    deliver(r, leader, append(1, log, 8, 6))
    assert r.raftCommitIndex == 6
    bad = log[:4] + [(command(r, 99), i, 2) for i in range(5, 9)]
    deliver(r, leader, append(2, bad, 8, 8, term=2))
    assert r.raft_stats["truncations_refused"] == 1
    assert [tuple(e) for e in r.journal[:]] == log
    assert r.raftCommitIndex == 6


def test_stale_term_append_is_ignored_and_answered_with_our_term(follower):
    """An AppendEntries of an older term changes nothing and is counted."""
    r, leader = follower()
    log = leader_log(r, 5, term=3)
    deliver(r, leader, append(1, log, 5, 3, term=3))
    before = r.journal[:]
    deliver(r, leader, append(1, leader_log(r, 3, term=1), 3, 3, term=1))
    assert r.journal[:] == before
    assert r.raft_stats["appends_stale_ignored"] == 1
    assert r.raft_stats["stale_term_notices"] == 1


def test_a_duplicate_heartbeat_behind_the_log_deletes_nothing(follower):
    """pysyncobj deleted everything after prevLogIdx even for an empty heartbeat: a delayed
    heartbeat must keep the entries past it, and commit no further than it vouches for."""
    r, leader = follower()
    log = leader_log(r, 9)
    deliver(r, leader, append(1, log, 9, 2))
    deliver(r, leader, append(4, log, 4, 9))  # an old heartbeat, with a newer commit index
    assert [tuple(e) for e in r.journal[:]] == log
    assert r.raftCommitIndex == 4
    assert r.raft_stats["appends_stale_ignored"] == 1


@pytest.mark.parametrize("msg", [
    {"type": "append_entries", "term": "1", "commit_index": 0, "prevLogIdx": 1, "prevLogTerm": 0},
    {"type": "append_entries", "term": 1, "commit_index": -1, "prevLogIdx": 1, "prevLogTerm": 0},
    {"type": "append_entries", "term": 1, "commit_index": 0, "prevLogIdx": 1, "prevLogTerm": 0,
     "entries": [(b"x", 5, 1)]},
    {"type": "append_entries", "term": 1, "commit_index": 0, "prevLogIdx": 1, "prevLogTerm": 0,
     "entries": "nope"},
    {"type": "append_entries", "term": 1, "commit_index": 0, "prevLogIdx": 1, "prevLogTerm": 0,
     "transmission": "start", "data": b""},
    {"type": "pre_vote", "term": None},
    {"type": "pre_vote_response", "term": 3},
    {"type": "request_vote", "term": 5, "last_log_index": "x", "last_log_term": 0},
    {"type": "stale_term", "term": [1]},
])
def test_hostile_raft_messages_are_counted_and_dropped(follower, msg):
    """Remote garbage on the Raft seam is counted and dropped; the member goes on."""
    r, leader = follower()
    deliver(r, leader, msg)
    assert r.raft_stats["messages_garbage"] == 1
    log = leader_log(r, 3)
    deliver(r, leader, append(1, log, 3, 3))
    assert r.raftCommitIndex == 3


def test_pre_vote_is_refused_while_the_leader_is_heard_and_changes_nothing(follower):
    """A follower that heard from its leader within the minimum election timeout refuses a
    pre-vote and ignores a vote request at a higher term; neither raises its term."""
    r, leader = follower()
    log = leader_log(r, 3, term=2)
    deliver(r, leader, append(1, log, 3, 3, term=2))
    other = leader  # the only peer: stands here for any member asking
    deliver(r, other, {"type": "pre_vote", "term": 3, "last_log_index": 3, "last_log_term": 2})
    deliver(r, other, {"type": "request_vote", "term": 3, "last_log_index": 3,
                       "last_log_term": 2})
    assert r.raftCurrentTerm == 2
    assert r.raft_stats["pre_votes_refused"] == 1
    assert r.raft_stats["votes_ignored_in_lease"] == 1


def test_the_seam_module_names_its_counters():
    """Every counter the seam shows in /metrics starts at zero."""
    from meshjobs.replica import RAFT_COUNTERS
    assert "appends_stale_ignored" in RAFT_COUNTERS
    assert raftseam.PASS != raftseam.APPEND
