"""Committed time (meshjobs/table.py Rule 7, meshjobs/node/clock.py): a finished job's age is
measured in the fleet's committed time, so that a leader whose wall clock is minutes off
neither expires a job early nor keeps it late. Table, node and simulator; the multi-process
test is tests/test_retention_skew.py."""

from __future__ import annotations

import random
from dataclasses import replace
from typing import Any

import msgpack
import pytest

from meshjobs.node import JobNode, NodeConfig, Pool, Tick, View
from meshjobs.node.clock import CommittedClock
from meshjobs.sim import SimConfig, SimFailure, run
from meshjobs.table import JobTable
from tests.helpers import Log, refusal, row, spec

T0 = 1_700_000_000_000
VOTERS = ("v1", "v2", "v3")


def batch(log: Log, *entries: dict, t: int, c: int | None = None, by: str = "v1.boot") -> dict:
    """Commit `entries` as one batch stamped with committed time `c` by the member booted `by`
    (no stamp at all when `c` is None: a batch of an older member)."""
    e: dict[str, Any] = {"k": "batch", "t": t, "p": log.index + 1, "es": list(entries)}
    if c is not None:
        e.update(c=c, cb=by)
    return log.apply(e)


def finished_job(log: Log, t: int, c: int | None, job_id: str = "j1") -> None:
    """A job submitted, leased and ended in three batches, the last at wall time `t` and
    committed time `c`."""
    batch(log, {"k": "submit", "t": t, "id": job_id, "spec": spec(), "dg": b"dg-1",
                "items": [None]}, t=t, c=c)
    batch(log, {"k": "lease", "t": t, "g": [[job_id, 0, "v1", "v1.boot"]]}, t=t, c=c)
    epoch = log.index
    out = batch(log, {"k": "result", "t": t, "r": [row(job_id, 0, epoch)]}, t=t, c=c)
    assert out["outcomes"][0]["accepted"] == 1


# --- the table ----------------------------------------------------------------------------------


def test_a_job_ends_at_the_committed_time_of_its_batch_not_its_wall_time() -> None:
    """Rule 7: finished_ms is the proposer's wall clock (shown); finished_clock_ms, what its
    age is measured from, is the batch's committed time."""
    log = Log()
    finished_job(log, t=T0 + 120_000, c=T0)
    job = log.job()
    assert job.finished_ms == T0 + 120_000
    assert job.finished_clock_ms == T0 == log.table.finished["j1"]
    assert (log.table.clock_ms, log.table.stamp_ms, log.table.stamp_by) == (T0, T0, "v1.boot")


def test_committed_time_never_goes_back() -> None:
    """Rule 7: clock_ms is the greatest stamp; a later, lower stamp is the last stamp only,
    and a job that ends under it ends at clock_ms."""
    log = Log()
    batch(log, {"k": "tone", "t": T0, "id": "none", "priority": 1}, t=T0, c=T0 + 5_000)
    finished_job(log, t=T0, c=T0 + 1_000)
    assert log.table.clock_ms == T0 + 5_000
    assert log.table.stamp_ms == T0 + 1_000
    assert log.job().finished_clock_ms == T0 + 5_000
    log.table.check()


def test_an_entry_of_an_older_member_stamps_its_own_time() -> None:
    """Rule 7: an entry without `c` (a member of an older version proposed it, or an older
    journal holds it) counts its `t`, the proposer's wall clock, as before."""
    log = Log()
    finished_job(log, t=T0 + 7_000, c=None)
    assert log.job().finished_clock_ms == T0 + 7_000
    assert (log.table.clock_ms, log.table.stamp_by) == (T0 + 7_000, "")


@pytest.mark.parametrize("stamp", [{"c": "1"}, {"c": -1}, {"c": True}, {"c": 1.5}, {"c": 5},
                                   {"cb": "x"}, {"c": 5, "cb": 7}, {"c": 5, "cb": "b" * 65}])
def test_a_malformed_stamp_is_refused_and_changes_nothing(stamp: dict) -> None:
    """Rule 2 and 7: a batch with a malformed committed time stamp is refused (400) whole."""
    log = Log()
    batch(log, {"k": "tone", "t": T0, "id": "none", "priority": 1}, t=T0, c=T0)
    out = log.apply({"k": "batch", "t": T0 + 1, "p": 9, "es": [
        {"k": "submit", "t": T0, "id": "j9", "spec": spec(), "dg": b"d", "items": [None]}],
        **stamp})
    assert refusal(out) == (False, 400, "malformed")
    assert "j9" not in log.table.jobs
    assert (log.table.clock_ms, log.table.stamp_ms, log.table.stamp_by) == (T0, T0, "v1.boot")


def test_snapshots_keep_committed_time() -> None:
    """A snapshot holds the table's committed time and each job's end in it."""
    log = Log()
    finished_job(log, t=T0 + 120_000, c=T0, job_id="a")
    finished_job(log, t=T0, c=T0 + 3_000, job_id="b")
    raw = msgpack.packb(log.table.to_state(), use_bin_type=True)
    back = JobTable.from_state(msgpack.unpackb(raw, raw=False, strict_map_key=False))
    assert (back.clock_ms, back.stamp_ms, back.stamp_by) == (T0 + 3_000, T0 + 3_000, "v1.boot")
    assert back.finished == {"a": T0, "b": T0 + 3_000} == log.table.finished
    assert back.to_state() == log.table.to_state()


def test_a_snapshot_from_before_committed_time_loads() -> None:
    """An older data folder's dump has no committed time: its jobs ended at their wall times
    (what its entries carried) and committed time is the latest time it holds."""
    log = Log()
    finished_job(log, t=T0 + 9_000, c=None, job_id="a")
    log.submit("b", t=T0 + 11_000)
    state = log.table.to_state()
    del state["clock"], state["finished_clock"]
    old = JobTable.from_state(state)
    assert old.finished == {"a": T0 + 9_000}
    assert (old.clock_ms, old.stamp_ms, old.stamp_by) == (T0 + 11_000, T0 + 11_000, "")
    more = Log()  # and the loaded table goes on from there
    more.table, more.index = old, old.applied_index
    batch(more, {"k": "cancel", "t": T0, "id": "b"}, t=T0, c=T0 + 12_000)
    assert more.table.finished == {"a": T0 + 9_000, "b": T0 + 12_000}


# --- the node's reckoning -----------------------------------------------------------------------


def test_the_reckoning_follows_other_members_stamps_and_its_own_monotonic_clock() -> None:
    """A member's committed time is the last stamp another member made plus what its own
    monotonic clock measured since; its own stamps do not move it; its wall clock is not
    used once the table has a stamp; it is never behind the table's clock_ms."""
    log = Log()
    clock = CommittedClock("me")
    clock.tick(50_000)
    batch(log, {"k": "tone", "t": T0, "id": "none", "priority": 1}, t=T0, c=T0, by="other")
    clock.observe(log.table, wall_ms=T0 + 120_000)
    assert clock.now_ms() == T0
    clock.tick(53_000)
    assert clock.now_ms() == T0 + 3_000
    batch(log, {"k": "tone", "t": T0, "id": "none", "priority": 1}, t=T0, c=T0 + 1_000, by="me")
    clock.observe(log.table, wall_ms=T0)
    assert clock.now_ms() == T0 + 3_000  # its own stamp, seen late: not taken again
    batch(log, {"k": "tone", "t": T0, "id": "none", "priority": 1}, t=T0, c=T0 + 2_000,
          by="other")
    clock.observe(log.table, wall_ms=T0)
    assert clock.now_ms() == T0 + 2_000  # another member's: followed, even lower
    clock.tick(54_000)
    batch(log, {"k": "tone", "t": T0, "id": "none", "priority": 1}, t=T0, c=T0 + 9_000,
          by="old run of me")
    batch(log, {"k": "tone", "t": T0, "id": "none", "priority": 1}, t=T0, c=T0 + 4_000, by="me")
    clock.observe(log.table, wall_ms=T0)
    assert clock.now_ms() == T0 + 9_000  # never behind the greatest stamp


def test_an_empty_table_starts_from_the_wall_clock() -> None:
    """A new fleet's first stamps are its first leader's wall time."""
    clock = CommittedClock("me")
    clock.tick(7)
    clock.observe(JobTable(), wall_ms=T0)
    clock.tick(1_007)
    assert clock.now_ms() == T0 + 1_000


def _leader(table: JobTable, keep_s: float) -> JobNode:
    cfg = NodeConfig(member="v2", boot="v2.boot", pools={"default": Pool("default", slots=1)},
                     keep_s=keep_s, role="voter", voters=VOTERS)
    node = JobNode(table, cfg, random.Random(3))
    return node


def _round(node: JobNode, wall_ms: int, mono_ms: int) -> list[dict]:
    """One round at these clocks: the batches it proposes (it commits none)."""
    node.step(Tick(wall_ms, mono_ms))
    return node.ready().entries


def test_a_leader_two_minutes_ahead_expires_a_job_keep_s_after_it_ended() -> None:
    """The issue's case, on one node: a job ended under a leader whose clock was right; a
    leader 120 s ahead takes over. It expires the job once keep_s has passed on its own
    monotonic clock since it applied the job's end, not at once (nor 120 s late for one
    behind), and stamps its batches with committed time, not its wall clock."""
    log = Log()
    finished_job(log, t=T0, c=T0)
    node = _leader(log.table, keep_s=10)
    node.step(View(term=2, leader="v2", is_leader=True, ready=True))
    wall, mono = T0 + 120_000, 1_000_000  # its wall clock two minutes ahead
    for ms in range(0, 10_000, 500):
        for b in _round(node, wall + ms, mono + ms):
            assert all(e["k"] != "expire" for e in b["es"]), (ms, b)
    proposed = _round(node, wall + 10_000, mono + 10_000)
    [b] = [b for b in proposed if any(e["k"] == "expire" for e in b["es"])]
    assert [e["ids"] for e in b["es"] if e["k"] == "expire"] == [["j1"]]
    assert (b["c"], b["cb"], b["t"]) == (T0 + 10_000, "v2.boot", wall + 10_000)


# --- the simulator ------------------------------------------------------------------------------

# v2 two minutes ahead, v3 40 s behind; jobs kept 10 s.
CLOCKS = SimConfig(clocks=(("v2", 120_000), ("v3", -40_000)), keep_s=10.0)


@pytest.mark.parametrize("seed", (1, 2, 6))
def test_skewed_leaders_expire_no_job_early(seed: int) -> None:
    """Rule 7 in a whole fleet: with leaders minutes apart, no job is expired before keep_s has
    passed (in the simulator's time) since the batch that ended it, and jobs are expired."""
    c = run(seed, CLOCKS).counts
    assert c.get("expiries_checked", 0) > 0, c
    assert c.get("elected_v2", 0) + c.get("elected_v3", 0) > 0, c  # a skewed member led


def test_skewed_leaders_under_harsh_faults() -> None:
    """The same with many more crashes, partitions, drops and lost proposals."""
    harsh = replace(CLOCKS, steps=6000, crash=0.006, partition=0.008, frame_drop=0.15,
                    frame_dup=0.1, frame_late=0.1, proposal_lost=0.1, jobs_max=60)
    c = run(7, harsh).counts
    assert c.get("expiries_checked", 0) > 0, c


class ProposerClockTable(JobTable):
    """Planted bug (the old behaviour): committed time is each entry's `t`, the wall clock of
    whichever leader proposed it, so a job's age depends on which leader's clock stamped it."""

    def stamp_of(self, e: dict, t: int) -> tuple[int, str] | None:
        return t, ""


def test_planted_proposer_clock_is_caught() -> None:
    """A table that reckons ages by the proposer's clock expires jobs early once a leader
    ahead takes over: a seed catches it, and names itself."""
    for seed in range(1, 8):
        try:
            run(seed, replace(CLOCKS, liveness_ms_max=60_000), table_cls=ProposerClockTable)
        except SimFailure as e:
            assert str(e).startswith(f"seed={seed} "), e
            if "before keep_s" in str(e):
                return
    raise AssertionError("no seed caught ProposerClockTable")
