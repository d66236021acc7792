"""A reduced run of the scale harness (bench/scale_sim.py): 3 voters and 20 worker members over
the real node and table code, a worker added late and a leader killed mid-run. It checks what
must hold at any size (nothing lost, one result per item, every table the same), never speed:
the figures come from `python bench/scale.py sim`."""

from __future__ import annotations

from bench.scale_sim import T0_MS, ScaleSim
from meshjobs import limits
from meshjobs.sim import table_digest
from meshjobs.table import DONE


def test_reduced_fleet_loses_nothing_through_a_late_worker_and_a_failover() -> None:
    """Rule: every acknowledged job ends with exactly one result per item, every member's table
    converges to the leader's (the late worker's too), and a leader failover mid-run loses
    nothing."""
    sim = ScaleSim(voters=3, workers=20, seed=5, jobs_per_s=1.5, run_ms=(50, 3_000),
                   items_max=20)
    sim.run_until(T0_MS + 3_000)
    late = sim.add_worker("wlate", 4)
    sim.run_until(T0_MS + 6_000)
    old = sim.leader
    assert old is not None
    sim.kill(old)
    sim.run_until(T0_MS + 10_000)
    assert sim.leader not in (None, old), "a new leader took over"
    sim.load_on = False
    assert sim.run_while(lambda: not sim.settled(), 120_000), "the fleet settles"

    leader = sim.leader_table()
    items = 0
    for c in sim.clients:
        assert c.acked, f"submit {c.req['rid']} was never acknowledged"
        job = leader.jobs[c.job_id]
        assert job.finished and job.n == c.items
        assert all(st == DONE for st in job.st), c.job_id
        items += job.n
    assert len(sim.clients) >= 10 and items >= 100, (len(sim.clients), items)
    # One result per item: every voter applied the whole log, each result accepted once.
    for v in sim.voters:
        m = sim.members[v]
        if m.alive:
            assert m.table.counts.get("results_accepted", 0) == items, v
    want = table_digest(leader)
    for m in sim.members.values():
        if m.alive:
            assert table_digest(m.table) == want, f"{m.name}'s table differs from the leader's"
    assert set(late.table.jobs) == set(leader.jobs), "the late worker caught up"
    assert sim.members[sim.leader].node.counts.get("state_snapshots_sent", 0) <= 3, \
        "after the failover workers took entries from the ring, not whole tables"


def test_idle_fleet_keeps_in_touch_without_chatter() -> None:
    """Rule: a settled fleet's members report to the leader every have_keepalive_ms and the
    leader tells each caught-up worker it leads every state_keepalive_ms (frames counted, not
    timed): no report or keep-alive every have_ms."""
    sim = ScaleSim(voters=3, workers=20, seed=2, jobs_per_s=0.0)
    sim.run_until(T0_MS + 3_000)
    sim.reset_figures()
    secs = 5
    sim.run_until(sim.now + secs * 1000)
    members = len(sim.members) - 1
    haves = sim.frames.get("F_JOB_HAVE", [0, 0])[0]
    states = sim.frames.get("F_JOB_STATE", [0, 0])[0]
    assert haves <= members * (secs * 1000 // limits.have_keepalive_ms + 1), haves
    assert states <= 20 * (secs * 1000 // limits.state_keepalive_ms + 1), states
    assert all(m.node.health()["fresh"] for m in sim.members.values()), "all still in touch"
