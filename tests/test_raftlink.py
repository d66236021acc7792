"""The Raft transport (raftlink.py) with three real pysyncobj-backed Replicas in this process,
each on its own Raft port, ticked in turn: they elect a leader over sealed frames, the proposals
of one tick leave in one AppendEntries per follower, and nothing a follower sends leaves before
its journal is durable."""

from __future__ import annotations

import os
import time

import pytest

from meshjobs import frames
from meshjobs.failpoints import Failpoints
from meshjobs.replica import Replica
from meshjobs.table import JobTable
from tests.helpers import free_port

WAIT_S = 30.0


@pytest.fixture
def three(tmp_path):
    secret = os.urandom(32)
    addrs = [f"127.0.0.1:{free_port()}" for _ in range(3)]
    made = []
    try:
        for i, addr in enumerate(addrs):
            data = tmp_path / f"v{i}"
            data.mkdir()
            made.append(Replica(addr, [a for a in addrs if a != addr], str(data), secret,
                                JobTable(), Failpoints()))
        yield made
    finally:
        for r in made:
            r.close()


def tick_until(rs: list[Replica], pred, what: str):
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        for r in rs:
            r.tick(0.002)
        got = pred()
        if got:
            return got
    raise AssertionError(f"{what} not reached within {WAIT_S} s")


def transport(r: Replica):
    return r._SyncObj__transport


def settled_leader(rs: list[Replica]) -> Replica:
    def find():
        leaders = [r for r in rs if r._isLeader()]
        if len(leaders) != 1:
            return None
        leader = leaders[0]
        noop = getattr(leader, "_SyncObj__noopIDx", None)
        caught_up = all(r.raftLastApplied >= (noop or 1 << 60) for r in rs)
        connected = all(len(transport(r)._conns) == 2 for r in rs)
        return leader if caught_up and connected else None
    return tick_until(rs, find, "one leader, its no-op applied everywhere, all connected")


def test_a_tick_of_proposals_leaves_in_one_message_per_follower(three):
    """Several entries per message: 20 proposals taken in one tick reach each follower in one
    AppendEntries (pysyncobj alone sent one per proposal), and every member applies them."""
    leader = settled_leader(three)
    for i in range(20):
        leader.propose({"op": "raftlink-test", "n": i})
    t = transport(leader)
    frames_before, entries_before = t.sent_frames, t.sent_entries
    leader.tick(0.0)  # takes the 20 from its queue, logs them, sends
    assert t.sent_entries - entries_before == 40
    # One AppendEntries per follower (a heartbeat that fell due in that tick may add one each).
    assert t.sent_frames - frames_before <= 4
    last = leader._SyncObj__getCurrentLogIndex()
    tick_until(three, lambda: all(r.raftLastApplied >= last for r in three),
               "the 20 entries applied on every member")


def test_nothing_leaves_a_follower_before_its_journal_is_durable(three):
    """The gate: every Raft message a follower writes (acknowledgements, votes) is written
    while its journal has nothing unsynced."""
    leader = settled_leader(three)
    seen = []
    for r in three:
        if r is leader:
            continue
        t = transport(r)
        write = t._write

        def checked(conn, data, r=r, write=write):
            if data[4] == frames.FrameType.F_RAFT:
                seen.append(not r.journal.dirty)
            write(conn, data)

        t._write = checked
    for i in range(30):
        leader.propose({"op": "raftlink-test", "n": i})
        for r in three:
            r.tick(0.0)
    last = leader._SyncObj__getCurrentLogIndex()
    tick_until(three, lambda: all(r.raftLastApplied >= last for r in three),
               "the entries applied on every member")
    assert seen and all(seen), f"{seen.count(False)} of {len(seen)} left before the fsync"


def test_failover_over_sealed_frames(three):
    """A leader that is gone is replaced by one of the other two, which commits."""
    leader = settled_leader(three)
    leader.close()
    rest = [r for r in three if r is not leader]
    new = tick_until(rest, lambda: next((r for r in rest if r._isLeader()), None),
                     "a new leader of the two left")
    new.propose({"op": "raftlink-test", "n": 1})
    last_before = new._SyncObj__getCurrentLogIndex()
    tick_until(rest, lambda: all(r.raftLastApplied > last_before for r in rest),
               "a new entry applied on both")


def test_leader_counts_itself_only_after_its_fsync(three):
    """etcd's rule: the leader's AppendEntries may leave while its journal is not durable yet
    (its fsync overlaps the followers'), but no entry is committed that is durable on fewer
    than a majority: the leader's own journal counts only up to what it has synced."""
    leader = settled_leader(three)
    followers = [r for r in three if r is not leader]
    synced = [leader._SyncObj__getCurrentLogIndex()]
    sync = leader.journal.sync

    def recorded_sync():
        at = leader._SyncObj__getCurrentLogIndex()
        sync()
        synced[0] = at

    leader.journal.sync = recorded_sync
    early = []
    t = transport(leader)
    write = t._write

    def checked(conn, data):
        if data[4] == frames.FrameType.F_RAFT:
            early.append(leader.journal.dirty)
        write(conn, data)

    t._write = checked
    match = leader._SyncObj__raftMatchIndex
    # One follower only answers meanwhile: every commit needs the leader's own copy durable.
    for i in range(30):
        leader.propose({"op": "raftlink-test", "n": i})
        for r in (leader, followers[0]):
            r.tick(0.0)
            commit = leader.raftCommitIndex
            durable_on = (commit <= synced[0]) + sum(match.get(f._SyncObj__selfNode, 0) >= commit
                                                     for f in followers)
            assert durable_on >= 2, f"entry {commit} committed, durable on {durable_on} of 3"
    last = leader._SyncObj__getCurrentLogIndex()
    tick_until(three, lambda: all(r.raftLastApplied >= last for r in three),
               "the entries applied on every member")
    assert any(early), "the leader's appends never overlapped its fsync"
    assert leader.raftCommitIndex >= last
