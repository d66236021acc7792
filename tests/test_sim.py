"""Tests of the fleet simulator (meshjobs/sim.py): whole fleets of real job nodes and tables on a
lossy network with crashes, partitions and deposed leaders, seeded and replayable.

Every run checks safety after each committed entry and each step, then heals the fleet and
checks that every acknowledged job ends. A failure names its seed; `meshjobs.sim.run(seed)`
replays it exactly. More seeds: MESHJOBS_SIM_SEEDS=200 (and MESHJOBS_SIM_SEED_BASE to move the
window); the long, harsher variant runs with MESHJOBS_SIM_LONG=1.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

from meshjobs import cron, limits, reruns
from meshjobs.compact import entry_item_count
from meshjobs.control import Answer
from meshjobs.node import Ctl, JobNode, NodeConfig, Pool, Propose, Ready, Reply, Tick, View
from meshjobs.node.events import Exit
from meshjobs.node.runs import Runs
from meshjobs.sim import SimConfig, SimFailure, run
from meshjobs.table import CANCELLED, DONE, LEASED, JobTable

FIXED_SEEDS = (1, 2, 3, 5, 8)
HARSH = SimConfig(steps=6000, crash=0.006, partition=0.008, frame_drop=0.15, frame_dup=0.1,
                  frame_late=0.1, proposal_lost=0.1, pressure=0.005, jobs_max=60)

# The simulator found two bugs of the job node, both fixed: a worker that missed an F_JOB_STATE
# frame never caught up (seed 0; the leader's resend was timed from its last send, which
# keep-alives refreshed for ever), and a deposed leader answered 404 for a job its stale table
# did not have yet (seeds 2089, and 3059 of HARSH). The tests below keep both from coming back.


def caught(seeds: Any, what: str, *words: str, **run_args: Any) -> None:
    """Run the simulation on `seeds` (each with `run_args`: a config, a planted table or node)
    until one fails with one of `words` in its message, which must name its seed; fail, naming
    `what`, if none does (the planted bug went unseen)."""
    config = run_args.pop("config")
    for seed in seeds:
        try:
            run(seed, config, **run_args)
        except SimFailure as e:
            msg = str(e)
            assert msg.startswith(f"seed={seed} "), msg
            if any(w in msg for w in words):
                return
    raise AssertionError(f"no seed caught {what}")


def _check_run(seed: int, config: SimConfig | None = None,
               node_cls: type[JobNode] = JobNode) -> None:
    report = run(seed, config, node_cls=node_cls)
    c = report.counts
    # A run that exercised nothing would pass vacuously: each of these must have happened.
    assert c.get("jobs_acked", 0) > 0 and c.get("results_accepted", 0) > 0, (seed, c)
    assert c.get("entries_committed", 0) > 0 and c.get("elections", 0) >= 1, (seed, c)


@pytest.mark.parametrize("seed", FIXED_SEEDS)
def test_fixed_seeds_safe_and_live(seed: int) -> None:
    """Safety under faults, then liveness once healed, for a few fixed seeds."""
    _check_run(seed)


@pytest.mark.parametrize("seed", (0, 2, 2089))
def test_seeds_that_found_bugs(seed: int) -> None:
    """The seeds on which the simulator found the worker catch-up and stale-404 bugs."""
    _check_run(seed)


def test_deposed_leader_does_not_deny_a_job_it_has_not_seen() -> None:
    """The bug the simulator found, reduced: a member that believes it leads, with a table that
    lags the log, is asked to cancel a job committed after its table's position. It must not
    answer 404 before anything commits (it may propose, or answer 503)."""
    table = JobTable()
    cfg = NodeConfig(member="v1", boot="b1", pools={"default": Pool("default", slots=2)},
                     role="voter", voters=("v1", "v2", "v3"))
    node = JobNode(table, cfg, random.Random(1))
    node.step(Tick(1_700_000_000_000))
    node.step(View(term=5, leader="v1", is_leader=True, ready=True))  # deposed, but unaware
    node.step(Ctl(1, {"op": "cancel", "rid": "c1", "id": "job9"}))
    answers = [e.answer for e in node.take() if isinstance(e, Reply)]
    assert all(a.status != 404 for a in answers), answers


def test_seeds_from_env() -> None:
    """As many seeds as MESHJOBS_SIM_SEEDS says (a few by default), from MESHJOBS_SIM_SEED_BASE."""
    n = int(os.environ.get("MESHJOBS_SIM_SEEDS", "3"))
    base = int(os.environ.get("MESHJOBS_SIM_SEED_BASE", "1000"))
    for seed in range(base, base + n):
        _check_run(seed)


@settings(max_examples=3, deadline=None, database=None, phases=[Phase.generate])
@given(seed=st.integers(min_value=0, max_value=2**32 - 1))
def test_random_seed(seed: int) -> None:
    """A seed hypothesis picks (not shrunk: a failing seed is its own minimal example)."""
    _check_run(seed)


@pytest.mark.skipif(not os.environ.get("MESHJOBS_SIM_LONG"),
                    reason="long run: set MESHJOBS_SIM_LONG=1 (seed count: MESHJOBS_SIM_SEEDS)")
def test_long_harsh_seeds() -> None:
    """Harsher faults, longer safety phases, many seeds (by hand or in a nightly job)."""
    n = int(os.environ.get("MESHJOBS_SIM_SEEDS", "200"))
    base = int(os.environ.get("MESHJOBS_SIM_SEED_BASE", "100000"))
    for seed in range(base, base + n):
        _check_run(seed, HARSH)


def test_harsh_faults_one_seed() -> None:
    """One run with many more crashes, partitions, drops and lost proposals."""
    _check_run(7, HARSH)


def _outcome(seed: int, config: SimConfig | None = None) -> object:
    """A run's report, or its failure's message: either must replay exactly."""
    try:
        return run(seed, config)
    except SimFailure as e:
        return str(e)


def test_same_seed_same_report() -> None:
    """Rule 1: a run is replayable: one seed, two runs, equal reports (or equal failures)."""
    a, b = _outcome(11), _outcome(11)
    assert a == b
    assert _outcome(12) != a


def test_same_seed_same_report_across_hash_seeds() -> None:
    """Rule 1: nothing depends on the order of a set: two processes with different string
    hashing give the same report."""
    code = ("from tests.test_sim import _outcome; from meshjobs.sim import SimConfig; "
            "print(repr(_outcome(21, SimConfig(steps=800))))")
    root = str(Path(__file__).resolve().parent.parent)
    outs = []
    for hash_seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": hash_seed, "PYTHONPATH": root}
        done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                              text=True, timeout=120, cwd=root)
        assert done.returncode == 0, done.stderr
        outs.append(done.stdout)
    assert outs[0] == outs[1]


# --- planted bugs: the checks can fail -----------------------------------------------------------


class StaleResultTable(JobTable):
    """Planted bug: a result is accepted while its item is leased, whatever its epoch (a late
    result of a revoked lease counts for the new lease)."""

    def _apply_one(self, entry: object, index: int, nested: bool) -> dict:
        # Results travel inside batch entries: every entry, nested or not, passes here.
        if isinstance(entry, dict) and entry.get("k") == "result" and isinstance(entry.get("r"), list):
            entry = {**entry, "r": [self._as_current(r) for r in entry["r"]]}
        return super()._apply_one(entry, index, nested)

    def _as_current(self, r: object) -> object:
        if not (isinstance(r, list) and 10 <= len(r) <= 12 and isinstance(r[0], str)):
            return r
        job = self.jobs.get(r[0])
        if job is None or type(r[1]) is not int or not 0 <= r[1] < job.n or job.st[r[1]] != LEASED:
            return r
        return [r[0], r[1], job.epoch[r[1]], *r[3:]]


class EagerNode(JobNode):
    """Planted bug: a submit is answered 201 as soon as it is proposed, before it commits."""

    def take(self) -> list:
        out = super().take()
        for eff in out:
            if not isinstance(eff, Propose):
                continue
            entries = eff.entry["es"] if eff.entry.get("k") == "batch" else [eff.entry]
            for e in entries:
                if e.get("k") != "submit":
                    continue
                change = self.changes.pending.get(e["rid"])
                for token in change.tokens if change else []:
                    self._answer(token, Answer(201, {"id": e["id"], "items_total": entry_item_count(e)}))
        extra, self._out = self._out, []
        return out + extra


def test_planted_stale_result_is_caught() -> None:
    """Safety check: a table that accepts a stale result is caught, and the failure names its
    seed."""
    # Stale results are rare (a result in flight while its lease is revoked and granted again):
    # try seeds until one shows one; seed 17 does today. A short liveness bound keeps the others
    # quick: only a safety failure counts here.
    quick = SimConfig(liveness_ms_max=1_000)
    caught(range(32), "a table that accepts stale results", "stale result", "two accepted results",
           config=quick, table_cls=StaleResultTable)


def test_planted_early_ack_is_caught() -> None:
    """Safety check: a node that acknowledges a submit before it is committed is caught."""
    with pytest.raises(SimFailure) as info:
        run(3, SimConfig(liveness_ms_max=1_000), node_cls=EagerNode)
    msg = str(info.value)
    assert msg.startswith("seed=3 ") and "run(3)" in msg
    # A forwarded submit answered early is answered again once committed: its remote token is
    # gone by then, so the second answer names a token nobody asked.
    assert ("before it was committed" in msg or "twice" in msg or "nobody asked" in msg), msg


def test_liveness_bound_fails_with_seed() -> None:
    """Liveness check: a fleet that cannot finish within the bound fails, naming the seed (here
    items take far longer than the bound allows)."""
    slow = SimConfig(steps=300, run_ms=(2_000_000, 3_000_000), liveness_ms_max=60_000)
    with pytest.raises(SimFailure) as info:
        run(4, slow)
    assert str(info.value).startswith("seed=4 ") and "liveness" in str(info.value)


def test_reused_keys_are_refused_everywhere() -> None:
    """Idempotency keys reused on another change, sent to any member (a follower, a deposed
    leader, one whose table lags), are refused with 422 and never applied; the run checks each
    answer, and here that the probe ran and was refused."""
    report = run(1)
    assert report.counts.get("key_reuses_422", 0) > 0, report.counts
    assert report.counts.get("table_refused_rid_reused", 0) + report.counts.get(
        "key_reuses_422", 0) > 0


DISKY = SimConfig(disk_full=0.02, steps=3000)


class DiskBlindNode(JobNode):
    """A planted bug: a node that leases to itself whatever its disk says."""

    def _takes_no_work(self) -> bool:
        return self.storage.pressure


@pytest.mark.parametrize("seed", (1, 2, 3))
def test_full_disks_safe_and_live(seed: int) -> None:
    """Members whose disk fills up for a while (read-only: no leases to themselves, submits
    answered 507 and retried elsewhere) keep the fleet safe, and once space is back every
    acknowledged job ends."""
    report = run(seed, DISKY)
    c = report.counts
    assert c.get("disk_full", 0) > 0 and c.get("jobs_acked", 0) > 0, c
    assert c.get("results_accepted", 0) > 0, c


def test_full_disk_submits_are_refused_with_507() -> None:
    """A submit reaching a member whose disk is full is answered 507 (checked in every run: only
    a member that knows its disk is full may say so), and clients retry it."""
    seen = 0
    for seed in range(1, 6):
        seen += run(seed, DISKY).counts.get("answers_507", 0)
    assert seen > 0


def test_planted_lease_on_a_full_disk_is_caught() -> None:
    """Safety check: a leader that leases items to itself while its disk is full is caught."""
    for seed in range(1, 12):
        try:
            run(seed, SimConfig(disk_full=0.05, liveness_ms_max=1_000), node_cls=DiskBlindNode)
        except SimFailure as e:
            if "while its disk is full" in str(e):
                return
    raise AssertionError("no seed caught a leader that leases to itself on a full disk")


def test_results_with_errors_are_kept() -> None:
    """Items that could not start end with the driver's reason: the run checks that each such
    result's reason is in the table, and here that some were committed."""
    report = run(1)
    assert report.counts.get("results_with_error", 0) > 0, report.counts


SILENT_V1 = SimConfig(steps=1500, frame_drop=0.0, frame_dup=0.0, frame_late=0.0,
                      proposal_lost=0.0, crash=0.0, partition=0.0, pressure=0.0, key_reuse=0.0,
                      inputs=0.7, silent=("v1",))


@pytest.mark.parametrize("seed", (1, 2))
def test_silent_member_does_not_delay_copies(seed: int) -> None:
    """A member cut off from all the others whose links still look up (v1, first by name) must
    not hold back the copies of submits with inputs made through the other members: each is
    answered well before a copy asked of v1 alone would be asked again elsewhere, and none
    fails for want of copies."""
    c = run(seed, SILENT_V1).counts
    assert c.get("inputs_submits_acked", 0) >= 5, c
    assert c.get("inputs_submits_503", 0) == 0, c
    assert c["inputs_submit_ms_max"] < limits.proposal_retry_ms, c


LOSE_V3 = SimConfig(steps=3000, crash=0.0, lose="v3", lose_at_step=1200, lost_ms=8_000)


class NoRecopyNode(JobNode):
    """Planted bug (the old behaviour): copies lost with a member are never made again."""

    def _recopy(self) -> None:
        pass


@pytest.mark.parametrize("seed", (1, 4))
def test_outputs_copied_again_after_a_member_is_lost(seed: int) -> None:
    """A voter lost for good with its blob store: the liveness phase ends only once every
    committed output is on blob_copies members again (the leader copies or fetches what the
    lost member held)."""
    report = run(seed, LOSE_V3)
    c = report.counts
    assert c["members_lost"] == 1 and c.get("results_accepted", 0) > 0, c
    assert c.get("copies_done", 0) + c.get("fetches_done", 0) > 0, c


def test_planted_no_recopy_is_caught() -> None:
    """The liveness check fails, naming outputs left on one member, when nothing restores the
    copies a lost member held."""
    with pytest.raises(SimFailure) as info:
        run(1, replace(LOSE_V3, liveness_ms_max=120_000), node_cls=NoRecopyNode)
    assert "outputs on fewer than 2 members" in str(info.value), str(info.value)[:400]


# w1 hears only v3: whenever v1 or v2 leads, it is cut off from the leader alone.
W1_HEARS_V3 = SimConfig(steps=2500, crash=0.0, partition=0.0, cut=(("w1", "v1"), ("w1", "v2")))


class HintFreshNode(JobNode):
    """Planted bug (the old behaviour): a voter's hint of who leads makes a worker fresh."""

    def _on_state(self, peer: str, body: object) -> None:
        super()._on_state(peer, body)
        if (self.cfg.role == "worker" and isinstance(body, dict)
                and type(body.get("term")) is int and body["term"] >= self.view.term
                and isinstance(body.get("leader"), str)):
            self.view = View(term=body["term"], leader=body["leader"], is_leader=False, ready=True)
            self.follower.leader_seen_ms = self.now_ms


@pytest.mark.parametrize("seed", (1, 2, 3))
def test_worker_cut_off_from_the_leader_alone_is_not_fresh(seed: int) -> None:
    """A worker that hears a follower but not the leader never says its table is fresh (the run
    checks every worker after every step)."""
    _check_run(seed, W1_HEARS_V3)


def test_planted_hint_freshness_is_caught() -> None:
    """The freshness check fails when a follower's hint makes a worker fresh."""
    caught = []
    for seed in (1, 2, 3):
        try:
            run(seed, replace(W1_HEARS_V3, liveness_ms_max=1_000), node_cls=HintFreshNode)
        except SimFailure as e:
            caught.append(str(e))
    assert any("says it is fresh" in msg for msg in caught), caught


class GapFreshNode(JobNode):
    """Planted bug (the old behaviour): a worker is fresh on any frame of the leader, also one
    that shows it entries it does not have (a gap)."""

    def _fresh(self) -> bool:
        if self.cfg.role != "worker" or self._leading() or self.view.leader is None:
            return super()._fresh()
        return (self.view.ready and self.follower.leader_seen_ms > 0
                and self.now_ms - self.follower.leader_seen_ms <= self.cfg.dead_ms)


def test_planted_fresh_despite_a_gap_is_caught() -> None:
    """The freshness check fails when a worker says it is fresh though its leader's frames have
    shown it entries it lacks."""
    caught((1, 2, 3), "a worker fresh despite a gap", "has shown it entries up to",
           config=SimConfig(), node_cls=GapFreshNode)


# --- reads of a member cut off from the leader (issue 26 point 2) --------------------------------

READS = SimConfig(reads=0.01)


@pytest.mark.parametrize("seed", (1, 3, 4))
def test_cut_off_members_answer_reads_from_their_tables(seed: int) -> None:
    """Members cut off from the leader are asked for the job list: once their table caught up
    since they started, each answers from it (never 503), saying whether it is fresh."""
    report = run(seed, READS)
    assert report.counts.get("reads_not_fresh", 0) > 0, report.counts
    assert report.counts["jobs_acked"] > 0


class LazyGateNode(JobNode):
    """Planted bug (the old behaviour): whether a worker's table has caught up since it started
    is decided at its first read, from whether it hears the leader then."""

    _seen_ready = False

    def _behind(self) -> bool:
        if self.cfg.role != "worker":
            return super()._behind()
        if not self._seen_ready:
            self._seen_ready = self.view.ready
        return not self._seen_ready


def test_planted_lazy_read_gate_is_caught() -> None:
    """The read check fails when a worker whose first read comes while it is cut off refuses
    it as if it had just started."""
    caught((1, 3, 4), "a cut-off worker refusing reads", "refused a job list",
           config=READS, node_cls=LazyGateNode)


# --- dependencies (issue 12 point 6) --------------------------------------------------------------

DEPS = SimConfig(deps=0.4)


@pytest.mark.parametrize("seed", (1, 2, 3))
def test_dependencies_safe_and_live(seed: int) -> None:
    """Jobs that wait for earlier ones (ok, end and fail): every entry, each dependent is checked
    against its parents' ends (never started before they allow, waiting only while one runs,
    dep_failed only when a condition can no longer hold), and once healed every one ends."""
    report = run(seed, DEPS)
    c = report.counts
    assert c.get("jobs_with_deps", 0) > 0 and c.get("deps_checked", 0) > 0, c
    assert c.get("table_jobs_released", 0) > 0 and c.get("table_jobs_dep_failed", 0) > 0, c


def test_dependencies_under_harsh_faults() -> None:
    """Dependencies with many more crashes, partitions, drops and lost proposals."""
    c = run(7, replace(HARSH, deps=0.4)).counts
    assert c.get("jobs_with_deps", 0) > 0, c


@settings(max_examples=2, deadline=None, database=None, phases=[Phase.generate])
@given(seed=st.integers(min_value=0, max_value=2**32 - 1))
def test_dependencies_random_seed(seed: int) -> None:
    """A seed hypothesis picks, with dependencies."""
    _check_run(seed, DEPS)


class EarlyReleaseTable(JobTable):
    """Planted bug: a dependent is released whatever its parent's end (every condition holds)."""

    def _holds(self, parent_state: str, on: str) -> bool:
        return True


def test_planted_early_release_is_caught() -> None:
    """Safety check: a table that releases a dependent its parents do not allow is caught, and
    the failure names its seed."""
    caught(range(1, 8), "a table that releases dependents early", "before its parents allowed",
           "still waits", "its parents not allowing it",
           config=replace(DEPS, liveness_ms_max=1_000), table_cls=EarlyReleaseTable)


# --- results across leader kills (issue 26 point 8) ----------------------------------------------

# A world whose frames are never lost (so no result needs its resend timer), whose leader is
# killed every 2 to 6 s, and whose new leaders take a while to catch up with the log (results
# sent to one that is not ready yet). A result must commit within the time a worker takes to
# find a new leader (leader_quiet_ms) and a second more, of its run's end or the reign's start.
FAILOVERS = SimConfig(frame_drop=0, frame_dup=0, frame_late=0, proposal_lost=0, crash=0,
                      partition=0, pressure=0, deps=0.4, apply_all=0.2,
                      leader_kills_ms=(2_000, 6_000),
                      result_wait_ms_max=limits.leader_quiet_ms + 1_000)


@pytest.mark.parametrize("seed", (1, 2, 3))
def test_results_go_to_each_new_reign_at_once(seed: int) -> None:
    """Leaders killed again and again: a member sends its results to each new leader (or term)
    as soon as it follows it, and a leader not ready yet keeps them, so that no result (nor the
    dependents waiting for it) waits for the resend timer (proposal_retry_ms, 5 s)."""
    c = run(seed, FAILOVERS).counts
    assert c.get("leader_kills", 0) >= 5 and c.get("results_accepted", 0) > 0, c
    assert c.get("jobs_with_deps", 0) > 0 and c.get("results_waited_ms_max", 0) > 0, c


class OneReignRuns(Runs):
    """Planted bug: results are sent again only when the resend timer is due, whoever leads
    meanwhile (as before issue 26)."""

    def due(self, rows_max: int, now_ms: int, held: Any, leader: str, term: int) -> list[list]:
        return super().due(rows_max, now_ms, held, "", 0)


class OneReignNode(JobNode):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.runs.__class__ = OneReignRuns


class DropsBeforeReadyNode(JobNode):
    """Planted bug: a leader that is not ready yet drops the results sent to it."""

    def _on_result(self, peer: str, body: Any) -> None:
        if self._leading():
            super()._on_result(peer, body)


@pytest.mark.parametrize("node_cls, what", [
    (OneReignNode, "a member that sends its results to a new leader only on its timer"),
    (DropsBeforeReadyNode, "a new leader that drops the results sent before it is ready"),
])
def test_planted_late_results_are_caught(node_cls: type[JobNode], what: str) -> None:
    caught(range(1, 12), what, "it waited for a resend",
           config=replace(FAILOVERS, liveness_ms_max=1_000), node_cls=node_cls)


BULK = SimConfig(bulk=0.6, deps=0.2)


@pytest.mark.parametrize("seed", (1, 2))
def test_bulk_changes_safe_and_live(seed: int) -> None:
    """Clients cancel and forget through bulk requests that name their own job and another: each
    job a bulk answer says "changed" shows the change in the committed table, none acknowledged
    is "no such job", and once healed every job ends."""
    c = run(seed, BULK).counts
    assert c.get("bulk_requests", 0) > 0 and c.get("bulk_answers_checked", 0) > 0, c
    assert c.get("table_bulk_changes", 0) > 0, c


class HalfBulkTable(JobTable):
    """Planted bug: a bulk change applies only to its first job, yet answers "changed" for all."""

    def _apply_one(self, entry: object, index: int, nested: bool) -> dict:
        if not (isinstance(entry, dict) and entry.get("k") == "bulk"
                and isinstance(entry.get("ids"), list) and len(entry["ids"]) > 1):
            return super()._apply_one(entry, index, nested)
        out = super()._apply_one({**entry, "ids": entry["ids"][:1]}, index, nested)
        if out.get("ok"):
            out["rows"] += [[job_id, "changed", None] for job_id in entry["ids"][1:]]
        return out


def test_planted_half_bulk_is_caught() -> None:
    """Safety check: a table that answers a bulk change for jobs it did not change is caught,
    and the failure names its seed: an answer "changed" before any change committed, or for
    another submitter's job (which no bulk change of this client may change)."""
    caught(range(1, 8), "a table that half-applies bulk changes", "before it was committed",
           ") changed", config=replace(BULK, liveness_ms_max=1_000), table_cls=HalfBulkTable)


# --- placement (issue 12 point 1) -------------------------------------------------------------------

PLACE = SimConfig(place=0.5)


@pytest.mark.parametrize("seed", (1, 2))
def test_placement_safe_and_live(seed: int) -> None:
    """Jobs pinned to a member, to a glob, or fanned out to every member: every committed lease
    of them goes to a matching member (a fan-out's item to its own), and once healed every one
    ends."""
    c = run(seed, PLACE).counts
    assert c.get("jobs_placed", 0) > 0 and c.get("placements_checked", 0) > 0, c


class IgnoresPlacementTable(JobTable):
    """Planted bug: a table that drops a job's member selector (and fan-out members) when it
    applies the submit, so that its items go anywhere."""

    def _apply_one(self, entry: object, index: int, nested: bool) -> dict:
        out = super()._apply_one(entry, index, nested)
        if isinstance(entry, dict) and entry.get("k") == "submit" and out.get("new"):
            job = self.jobs[entry["id"]]
            job.selector = job.pins = None
        return out


def test_planted_placement_ignored_is_caught() -> None:
    """Safety check: a table that ignores the member selector is caught, and the failure names
    its seed."""
    caught(range(1, 8), "a table that ignores member selectors", "member selector",
           "not its own member", config=replace(PLACE, liveness_ms_max=1_000),
           table_cls=IgnoresPlacementTable)


ORDERS = SimConfig(orders=0.02)


@pytest.mark.parametrize("seed", (1, 2))
def test_pool_and_member_orders_safe_and_live(seed: int) -> None:
    """Operators hold, release, drain and undrain the pool and drain members during the run: no
    lease is committed against an order in force, and once the orders are lifted every job
    ends."""
    c = run(seed, ORDERS).counts
    assert c.get("orders_committed", 0) > 0, c
    assert c.get("order_leases_checked", 0) > 0, c


class DrainDeafTable(JobTable):
    """Planted bug: a hold or drain order is answered as applied, but the table ignores it."""

    def _apply_one(self, entry: object, index: int, nested: bool) -> dict:
        if isinstance(entry, dict) and entry.get("k") in ("pool", "member") \
                and entry.get("a") in ("hold", "drain"):
            return {"ok": True, "pool": entry.get("pool"), "name": entry.get("name")}
        return super()._apply_one(entry, index, nested)


def test_planted_drain_deaf_table_is_caught() -> None:
    """Safety check: a table that ignores drains and holds leases against them, and is caught
    with its seed named."""
    caught(range(1, 8), "a table that ignores pool and member orders", "by a committed order",
           config=replace(ORDERS, orders=0.05, liveness_ms_max=1_000), table_cls=DrainDeafTable)


# --- re-runs (issue 12 point 3) -------------------------------------------------------------------

RERUNS = SimConfig(reruns=0.4, deps=0.2)


@pytest.mark.parametrize("seed", (1, 2))
def test_reruns_safe_and_live(seed: int) -> None:
    """Clients rerun finished jobs (whole or failed items only) and some jobs restart 1 or 2
    times after a delay: each committed rerun sends back exactly the items it names, no item has
    more results than attempts, restarts never exceed what was asked, and once healed every
    job ends."""
    c = run(seed, RERUNS).counts
    assert c.get("reruns_checked", 0) > 0 and c.get("rerun_answers_200", 0) > 0, c
    assert c.get("table_jobs_rerun_restart", 0) > 0 and c.get("table_jobs_rerun_rerun", 0) > 0, c


def test_rerun_seed_that_found_a_bug() -> None:
    """Seed 11 found a rerun of a dependent cancelled while it waited running before its
    parents had ended (reruns.py Rule 5 now judges such a job again); it stays fixed."""
    c = run(11, SimConfig(reruns=0.5, deps=0.3, bulk=0.3)).counts
    assert c.get("reruns_checked", 0) > 0, c


class RerunLeavesOneFinalTable(JobTable):
    """Planted bug: a whole rerun leaves the job's last item final (it takes only the others),
    keeping its counts and queue consistent so that the table's own check passes."""

    def _apply_one(self, entry: object, index: int, nested: bool) -> dict:
        job = None
        if isinstance(entry, dict) and entry.get("k") == "rerun" and not entry.get("failed_only"):
            job = self.jobs.get(entry.get("id"))  # type: ignore[arg-type]
        last = job.n - 1 if job is not None and job.n > 1 else None
        was = job.st[last] if job is not None and last is not None else None
        out = super()._apply_one(entry, index, nested)
        if job is not None and last is not None and out.get("ok"):
            job.queue.remove(last)
            job.st[last] = was
            job.n_pending -= 1
            if was == DONE:
                job.n_done += 1
            elif was == CANCELLED:
                job.n_cancelled += 1
            else:
                job.n_failed += 1
            self._ready(job)
        return out


class OneRestartTooManyTable(JobTable):
    """Planted bug: the first automatic restart of a job is not counted, so it restarts once
    more than it asked for (the table's own check still passes)."""

    def _apply_one(self, entry: object, index: int, nested: bool) -> dict:
        out = super()._apply_one(entry, index, nested)
        if (isinstance(entry, dict) and entry.get("k") == "rerun"
                and entry.get("auto") == "restart" and out.get("ok")):
            job = self.jobs[entry["id"]]
            if job.restarts == 1 and job.run == 2:
                job.restarts = 0
                job.rerun_times = None  # (and its time: the table's own check stays quiet)
        return out


@pytest.mark.parametrize(("table_cls", "words"), [
    (RerunLeavesOneFinalTable, "rerun of"),
    (OneRestartTooManyTable, "times; it asked for"),
])
def test_planted_rerun_bugs_are_caught(table_cls: type[JobTable], words: str) -> None:
    """Safety check: a table that reruns a job but leaves an item final, or restarts a job one
    time too many, is caught, and the failure names its seed."""
    caught(range(1, 8), table_cls.__name__, words,
           config=replace(RERUNS, liveness_ms_max=60_000), table_cls=table_cls)


RESTARTS_MANY = replace(RERUNS, restarts_many=limits.restarts_per_minute_max + 4)


def test_restarts_capped_per_minute_in_the_fleet() -> None:
    """reruns.py Rule 6 through crashes, partitions and failovers: jobs that ask for more
    restarts than a minute allows re-run at most restarts_per_minute_max times in any minute
    of entry times (whichever leader proposes them), and still all end once healed."""
    # Two seeds, counted together: whether one seed's faults leave room for more than a
    # minute's worth of re-runs moves with every change to what the members draw.
    runs = [run(seed, RESTARTS_MANY).counts for seed in (1, 3)]
    checked = sum(c.get("rerun_caps_checked", 0) for c in runs)
    assert checked > limits.restarts_per_minute_max, runs
    assert sum(c.get("table_jobs_rerun_restart", 0) for c in runs) > 0, runs


class UncappedRestartsTable(JobTable):
    """Planted bug: the table forgets the cap of re-runs per minute (each re-run is due at its
    delay), keeping its own check quiet."""

    def _apply_one(self, entry: object, index: int, nested: bool) -> dict:
        out = super()._apply_one(entry, index, nested)
        for job in self.jobs.values():
            if job.due_capped:
                job.due_capped = False
                job.due_ms = job.finished_ms + reruns.delay_ms(job)
                self.due[job.id] = job.due_ms
            job.rerun_times = None
        return out


def test_planted_uncapped_restarts_are_caught() -> None:
    """Safety check: a table that lets a job re-run past the cap of a minute is caught, and
    the failure names its seed."""
    caught(range(1, 8), "UncappedRestartsTable", "the cap is",
           config=RESTARTS_MANY, table_cls=UncappedRestartsTable)


CRON = SimConfig(cron=3)


@pytest.mark.parametrize("seed", (1, 2))
def test_schedules_safe_and_live(seed: int) -> None:
    """Schedules of `@every` 1 to 5 s fire through crashes, partitions and leader changes: each
    due time settled once, its run named by name and due time, never an older missed one; once
    healed, none missed; then they are paused and the fleet settles."""
    c = run(seed, CRON).counts
    assert c.get("cron_runs", 0) > 0 and c.get("cron_gaps_checked", 0) > 0, c
    assert c.get("table_crons_added", 0) == 3 and c.get("elections", 0) >= 1, c


def test_schedules_under_harsh_faults() -> None:
    """Harsher faults: leaders come and go, so due times are missed and the latest is fired
    once (catch-ups happen), and still no due time settles twice."""
    c = run(7, replace(HARSH, cron=3)).counts
    assert c.get("cron_runs", 0) > 0 and c.get("cron_catch_ups", 0) > 0, c


class IndexIdTable(JobTable):
    """Planted bug: a fired run is named by the log index of its entry, not by its due time."""

    def _apply_one(self, entry: object, index: int, nested: bool) -> dict:
        if not (isinstance(entry, dict) and entry.get("k") == "cron" and entry.get("op") == "fire"):
            return super()._apply_one(entry, index, nested)
        c, d, t = self.crons.get(entry.get("name")), entry.get("due"), entry.get("t")
        if c is None or type(d) is not int or type(t) is not int or not cron.fire_ok(c, d, t):
            return super()._apply_one(entry, index, nested)
        c.done_ms = c.last_due_ms = d
        c.last_id, c.version = cron.run_id(c.name, d), index
        c.fired += 1
        out = self._apply_submit({"id": f"cron-{c.name}-at{index}", "spec": c.job,
                                  "dg": cron.job_digest(c.job), "items": [None]}, index, t)
        return {**out, "cron": c.name, "due": d}


def test_planted_index_id_is_caught() -> None:
    """Safety check: a table that names a run other than by its name and due time (so a second
    leader's fire would make a second job) is caught, and the failure names its seed."""
    try:
        run(1, replace(CRON, liveness_ms_max=1_000), table_cls=IndexIdTable)
    except SimFailure as e:
        assert str(e).startswith("seed=1 ") and "made as cron-c" in str(e), e
        return
    raise AssertionError("the simulator did not catch runs named by log index")


class BurstNode(JobNode):
    """A leader that proposes every due time missed, each round: repeats the table must make
    harmless (and a burst it must refuse)."""

    def _propose_cron(self) -> None:
        for c in self.table.crons.values():
            d = None if c.paused else c.next_due()
            while d is not None and d <= self.now_ms:
                self.proposals.duty({"k": "cron", "op": "fire", "t": self.now_ms,
                                           "name": c.name, "due": d})
                d = c.sched.next_after(d)


class LaxFireTable(JobTable):
    """Planted bug: a fire of any due time after the cursor is applied, not only the latest."""

    def _apply_one(self, entry: object, index: int, nested: bool) -> dict:
        if isinstance(entry, dict) and entry.get("k") == "cron" and entry.get("op") == "fire":
            c, d, t = self.crons.get(entry.get("name")), entry.get("due"), entry.get("t")
            if (c is not None and not c.paused and type(d) is int and type(t) is int
                    and c.done_ms < d <= t and c.sched.latest_upto(d) == d):
                return self._cron_fire(c, d, index, t)
        return super()._apply_one(entry, index, nested)


def test_burst_proposals_are_harmless() -> None:
    """A leader that proposes every missed due time, again and again: the table fires only the
    latest, once; safe and live."""
    c = run(7, replace(HARSH, cron=3), node_cls=BurstNode).counts
    assert c.get("cron_runs", 0) > 0 and c.get("table_cron_fires_stale", 0) > 0, c


def test_planted_burst_is_caught() -> None:
    """Safety check: a table that fires every missed due time (a burst after an outage) is
    caught, and the failure names its seed."""
    caught((7, 1, 2), "a table that fires every missed due time", "an older missed run (a burst)",
           config=replace(HARSH, cron=3, liveness_ms_max=1_000), table_cls=LaxFireTable,
           node_cls=BurstNode)


# --- all of job control at once ---------------------------------------------------------------

ALL_CONTROL = SimConfig(place=0.3, orders=0.02, reruns=0.3, cron=2, deps=0.3, bulk=0.3)


@pytest.mark.parametrize("seed", (3, 11))
def test_all_job_control_together(seed: int) -> None:
    """Placement, pool and member orders, reruns and restarts, schedules, dependencies and bulk
    changes in one run through the faults: every check of each holds with the others about,
    and each is exercised."""
    c = run(seed, ALL_CONTROL).counts
    for check in ("placements_checked", "order_leases_checked", "reruns_checked",
                  "cron_fires_checked", "deps_checked"):
        assert c.get(check, 0) > 0, (check, c)


# --- members ordered to stop (issue 12 point 8: member stop) ----------------------------------

STOPS = SimConfig(stops=0.01)


@pytest.mark.parametrize("seed", (1, 2))
def test_member_stops_safe_and_live(seed: int) -> None:
    """Operators order members to stop during the run: each exits when its node says so and is
    started again later; no lease is committed to a stopped incarnation, and once healed every
    acknowledged job ends. The same seed replays the same run."""
    report = run(seed, STOPS)
    c = report.counts
    assert c.get("stops_committed", 0) > 0, c
    assert c.get("stop_exits_voter", 0) + c.get("stop_exits_worker", 0) > 0, c
    assert c.get("stop_leases_checked", 0) > 0, c
    assert run(seed, STOPS) == report


def test_member_stops_with_pool_and_member_orders() -> None:
    """Stops among holds, drains and undrains (an undrain calls a stop off)."""
    c = run(4, replace(STOPS, orders=0.02)).counts
    assert c.get("stops_committed", 0) > 0 and c.get("orders_committed", 0) > 0, c


class LeaseIgnoresStopsTable(JobTable):
    """Planted bug: the lease rule forgets stop orders, so a lease the leader proposed before
    the stop was applied, committed after it, goes to the stopped incarnation."""

    def _apply_one(self, entry: object, index: int, nested: bool) -> dict:
        if isinstance(entry, dict) and entry.get("k") == "lease" and self.ctl.stops:
            stops, self.ctl.stops = self.ctl.stops, {}
            try:
                return super()._apply_one(entry, index, nested)
            finally:
                self.ctl.stops = stops
        return super()._apply_one(entry, index, nested)


def test_planted_lease_to_a_stopped_member_is_caught() -> None:
    """Safety check: a table that lets a stopped incarnation take leases is caught, with its
    seed named."""
    for seed in range(1, 8):
        try:
            run(seed, replace(STOPS, stops=0.05, liveness_ms_max=1_000),
                table_cls=LeaseIgnoresStopsTable)
        except SimFailure as e:
            msg = str(e)
            assert msg.startswith(f"seed={seed} ")
            if "which a committed stop order names" in msg:
                return
    raise AssertionError("no seed caught a table that leases to a stopped member")


class ExitsOnAnyStopNode(JobNode):
    """Planted bug: the node compares a stop's member but not its boot, so a member started
    again after a stop exits once more (and again, for ever)."""

    def _stop_check(self) -> None:
        stop = self.table.ctl.stops.get(self.cfg.member)
        if stop is not None and stop[0] != self.cfg.boot and not self.orders.exit_sent:
            self.orders.exit_sent = True
            self._out.append(Exit("ordered to stop"))
            return
        super()._stop_check()


def test_planted_exit_of_a_new_incarnation_is_caught() -> None:
    """Safety check: a member that exits in an incarnation no committed stop names is caught."""
    for seed in range(1, 8):
        try:
            run(seed, replace(STOPS, stops=0.05, liveness_ms_max=1_000),
                node_cls=ExitsOnAnyStopNode)
        except SimFailure as e:
            msg = str(e)
            assert msg.startswith(f"seed={seed} ")
            if "no committed stop names its boot" in msg:
                return
    raise AssertionError("no seed caught a member that exits on another incarnation's stop")


# --- pool slots set while running (issue 12 point 4: slots) -----------------------------------

SLOTS = SimConfig(slots=0.02)


@pytest.mark.parametrize("seed", (1, 2))
def test_pool_slots_orders_safe_and_live(seed: int) -> None:
    """Operators set and reset the pool's slots during the run (0 to 3, fleet-wide or on one
    member): no member starts an item past its effective slots, and once they are reset after
    healing every job ends."""
    c = run(seed, SLOTS).counts
    assert c.get("slots_orders_committed", 0) > 0, c
    assert c.get("slot_starts_checked", 0) > 0, c


def test_pool_slots_with_stops_and_orders() -> None:
    """Slots orders among stops, holds and drains, in one run."""
    c = run(6, replace(SLOTS, stops=0.01, orders=0.02)).counts
    for check in ("slots_orders_committed", "stops_committed", "orders_committed"):
        assert c.get(check, 0) > 0, (check, c)


class IgnoresSlotsNode(JobNode):
    """Planted bug: the member starts up to its configured slots, whatever the orders say."""

    def _slots_here(self, pool: Pool) -> int:
        return pool.slots


def test_planted_slots_ignored_is_caught() -> None:
    """Safety check: a member that starts items past its pool's effective slots is caught,
    with its seed named."""
    for seed in range(1, 8):
        try:
            run(seed, replace(SLOTS, liveness_ms_max=1_000), node_cls=IgnoresSlotsNode)
        except SimFailure as e:
            msg = str(e)
            assert msg.startswith(f"seed={seed} ")
            if "effective slots" in msg:
                return
    raise AssertionError("no seed caught a member that ignores slots orders")


class LeakyGateNode(JobNode):
    """Planted: the node's Ready lets every effect leave at once, before the round's entries
    are synced (a gate that answers a submit, or starts an item, from an unsynced log)."""

    def ready(self) -> Ready:
        r = super().ready()
        return Ready(r.entries, r.at_once + r.after_sync, ())


def test_sim_catches_a_gate_that_releases_before_the_sync() -> None:
    caught(range(3), "a gate releasing before the sync", "before the entries it logged",
           config=SimConfig(), node_cls=LeakyGateNode)


# Identities: submitters who try to change each other's jobs, and one whose token bounds how
# many of its items may be leased at once (meshjobs/identity.py, meshjobs/quotas.py).
SHARED = SimConfig(meddle=0.02, quota=2, bulk=0.3)


@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_shared_fleet_safe_and_live(seed: int) -> None:
    """Through every fault: no committed entry changes a job for anyone but its submitter or
    an admin, every meddling change is refused, and the quota user never has more items leased
    than its running_items_max; and the meddling and the limit really happen."""
    c = run(seed, SHARED).counts
    assert c.get("meddles_403", 0) > 0 and c.get("changes_refused_not_owner", 0) > 0, c
    assert c.get("quota_running_at_limit", 0) > 0, c
    assert c["jobs_acked"] > 0


class AnyoneMayChangeTable(JobTable):
    """Planted bug: the appliers never refuse a change by someone other than the submitter."""

    def _owned(self, e: dict, owner: str, what: str) -> None:
        return None


class IgnoresRunningQuotaTable(JobTable):
    """Planted bug: a submit's running_items_max is dropped as the job is made."""

    def apply(self, entry, index):  # type: ignore[no-untyped-def]
        before = set(self.jobs)
        out = super().apply(entry, index)
        for jid in set(self.jobs) - before:
            self.jobs[jid].running_items_max = None
        return out


@pytest.mark.parametrize(("table_cls", "words"), [
    (AnyoneMayChangeTable, "changed job"),
    (IgnoresRunningQuotaTable, "over its running_items_max"),
])
def test_planted_identity_bugs_are_caught(table_cls: type[JobTable], words: str) -> None:
    """Safety check: a table that lets anyone change a job, or leases past a submitter's
    running_items_max, is caught, and the failure names its seed."""
    caught(range(1, 8), table_cls.__name__, words,
           config=replace(SHARED, liveness_ms_max=60_000), table_cls=table_cls)


# --- whole tables sent to workers as dumps (issue 26 point 5) --------------------------------------

DUMPS = SimConfig(dumps=0.01)


@pytest.mark.parametrize("seed", (1, 3, 4))
def test_workers_caught_up_from_dumps(seed: int) -> None:
    """Voters write dumps (and when a worker needs one the ring cannot follow); a worker that
    needs the whole table is sent the leader's latest dump and the entries after it, and every
    table stays equal to every other at each index, through crashes and lost frames."""
    report = run(seed, DUMPS)
    c = report.counts
    assert c.get("dumps_written", 0) > 0 and c.get("dumps_sent", 0) > 0, c


class DumpSkipsAnEntryNode(JobNode):
    """Planted bug: the entries sent with a dump leave out the first one after the dump (the
    ring read from one entry too far), while still saying they follow the dump."""

    def _emit(self, eff: Any) -> None:
        from meshjobs.node import SendDump

        if isinstance(eff, SendDump) and eff.body.get("entries"):
            eff = SendDump(eff.to, {**eff.body, "entries": eff.body["entries"][1:]})
        super()._emit(eff)


def test_planted_dump_that_skips_an_entry_is_caught() -> None:
    """The simulator's table check fails when a dump's entries do not follow it."""
    caught(range(1, 30), "a dump whose entries skip one", "differs from another table",
           config=replace(DUMPS, dumps=0.02), node_cls=DumpSkipsAnEntryNode)


# --- earlier attempts (issue 27 point 4) ---------------------------------------------------------


class ForgetfulRevokeTable(JobTable):
    """Planted bug: a revoked lease leaves no reason (the old behaviour): the item runs again
    and nothing says its first attempt was lost with its member."""

    def note_attempt(self, job: Any, i: int, why: str, t: int) -> None:
        if not why.startswith(("lost with member", "lease revoked")):
            super().note_attempt(job, i, why, t)


def test_every_earlier_attempt_keeps_its_reason() -> None:
    """Items run more than once (leases lost with crashed members, failures retried) keep why
    each earlier attempt ended, in order: the simulator checks every item each entry touches."""
    report = run(1)
    assert report.counts.get("attempts_checked", 0) > 0


def test_planted_lost_attempt_without_reason_is_caught() -> None:
    """Safety check: a table whose revokes keep no reason is caught, and the failure names its
    seed."""
    caught(range(8), "a table that forgets lost attempts", "keeps the reasons of attempts",
           config=SimConfig(liveness_ms_max=1_000), table_cls=ForgetfulRevokeTable)
