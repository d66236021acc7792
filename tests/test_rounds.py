"""The jobs thread's round: proposals enter the log in the round that makes them.

Rule (jobsd.py, Replica.log_proposals): a round hands its proposals to pysyncobj and puts them
into the log before the gate, so that the gate's fsync of that same round covers them and the
next tick commits them (a fleet of one); before, they waited for the end of the next tick, and
their fsync and commit came one trip round the loop later. The gate itself does not move:
nothing is applied (so nothing answered) before the fsync that covers it.
"""

from __future__ import annotations

import os

import pytest

from meshjobs.failpoints import Failpoints
from meshjobs.replica import Replica
from meshjobs.table import JobTable
from tests.helpers import free_port, wait_until

WAIT_S = 30.0


@pytest.fixture
def alone(tmp_path):
    """A real Replica of a fleet of one, leader of its own log."""
    r = Replica(f"127.0.0.1:{free_port()}", [], str(tmp_path), os.urandom(32), JobTable(),
                Failpoints())
    try:
        def leads() -> bool:
            r.tick(0.01)
            return bool(r._isLeader()) and r.view().ready
        wait_until(leads, WAIT_S, "the replica of a fleet of one leads")
        r.journal_sync()
        r.take_applied()
        yield r
    finally:
        r.close()


def test_proposals_are_in_the_log_before_the_gate_of_their_round(alone: Replica) -> None:
    """log_proposals puts the round's proposals into the journal at once: the journal is dirty
    (the gate's fsync of this round covers them), and nothing of them is applied yet."""
    last = alone._SyncObj__getCurrentLogIndex()
    alone.propose({"op": "nothing", "n": 1})
    alone.propose({"op": "nothing", "n": 2})
    assert not alone.journal.dirty  # only queued in pysyncobj so far
    alone.log_proposals()
    assert alone.journal.dirty
    assert alone._SyncObj__getCurrentLogIndex() == last + 2
    assert alone.take_applied() == []  # the gate has not synced: nothing committed or applied
    alone.journal_sync()
    assert not alone.journal.dirty
    alone.tick(0.0)  # the very next tick commits and applies both
    applied = alone.take_applied()
    assert [a.entry for a in applied] == [{"op": "nothing", "n": 1}, {"op": "nothing", "n": 2}]
    assert [a.index for a in applied] == [last + 1, last + 2]


def test_without_proposals_it_changes_nothing(alone: Replica) -> None:
    """With nothing proposed, log_proposals logs nothing and dirties nothing."""
    last = alone._SyncObj__getCurrentLogIndex()
    alone.log_proposals()
    assert not alone.journal.dirty
    assert alone._SyncObj__getCurrentLogIndex() == last
