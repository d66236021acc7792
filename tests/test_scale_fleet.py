"""A fleet of some size, multi-process: 3 voters and 12 worker members as real meshd on 127.0.0.1,
thousands of `true` items in a few array jobs, and a kill -9 of the leader in the middle.

The reduced form of `python bench/scale.py real` (3 voters + 30 workers, 100,000 items), which
measures; this test only checks: nothing lost, one result per item, the items spread over many
members, and the killed leader's table the same as the others' once it is back. Every member is
stopped by pid at the end, also when the test fails.
"""

from __future__ import annotations

import uuid

import pytest

from tests.helpers import Meshd, leader_of, make_fleet, start_all, wait_until

pytestmark = pytest.mark.fleet

VOTERS = 3
WORKERS = 12
JOBS = 3
ITEMS_PER_JOB = 1000
WAVE = 4  # workers started at once: a dozen interpreters starting together starve 2 cores
FINAL = ("done", "failed", "cancelled", "dep_failed")
RUN_S_MAX = 300.0  # the bound of the waits for the jobs (a loaded 2-core host runs ~100 items/s)


def _start_workers(leader: Meshd, workers: list[Meshd]) -> None:
    for k in range(0, len(workers), WAVE):
        wave = workers[k:k + WAVE]
        for m in wave:
            m.start(wait_ready=False)
        wait_until(lambda wave=wave: all(m.is_ready() for m in wave), 120,
                   what=f"workers {[m.name for m in wave]} ready")
    names = {m.name for m in workers}

    def all_alive() -> bool:
        status, fleet = leader.request("GET", "/fleet")
        return status == 200 and names <= {x["name"] for x in fleet["members"] if x.get("alive")}
    wait_until(all_alive, 120, what="every worker reporting to the leader")


def _submit(via: Meshd, job_id: str) -> None:
    """Submit through `via` (forwarded to the leader when it does not lead), retried under the
    same Idempotency-Key until answered."""
    key = uuid.uuid4().hex
    spec = {"argv": ["true"], "id": job_id, "items": [""] * ITEMS_PER_JOB}

    def attempt() -> bool:
        status, rec = via.request("POST", "/jobs", spec, headers={"Idempotency-Key": key},
                                  timeout_s=30)
        return status in (200, 201)
    wait_until(attempt, 120, what=f"the submit of {job_id} through {via.name}")


def _done(m: Meshd, ids: list[str]) -> tuple[int, int]:
    """(items with a result, jobs finished) of `ids`, as `m` has them."""
    status, page = m.request("GET", "/jobs?limit=1000", timeout_s=10)
    assert status == 200, page
    mine = [j for j in page if j["id"] in ids]
    return (sum(j["items_done"] + j["items_failed"] for j in mine),
            sum(j["state"] in FINAL for j in mine))


def test_leader_kill9_in_a_fleet_of_3_voters_and_12_workers(tmp_path):
    """3 voters (no slots) and 12 workers (one slot each) run 3,000 `true` items submitted
    through a worker, a follower and the leader; the leader is killed with SIGKILL when about a
    third have results and started again. Every job finishes; every item is done with rc 0 and
    has exactly one result (the new leader, up since the start, applied exactly one accepted
    result per item); the items ran on most of the workers; the restarted member's table holds
    the same items."""
    members = make_fleet(str(tmp_path), voters=VOTERS, workers=WORKERS, slots=0, worker_slots=1)
    voters, workers = members[:VOTERS], members[VOTERS:]
    try:
        start_all(voters)
        leader = leader_of(voters)
        _start_workers(leader, workers)
        follower = next(m for m in voters if m is not leader)
        ids = [f"scale-{k}" for k in range(JOBS)]
        for job_id, via in zip(ids, [workers[0], follower, leader], strict=True):
            _submit(via, job_id)
        total = JOBS * ITEMS_PER_JOB

        wait_until(lambda: _done(leader, ids)[0] >= total // 3, RUN_S_MAX,
                   what="a third of the items with results")
        leader.kill9()
        others = [m for m in voters if m is not leader]
        new = leader_of(others)
        leader.start(wait_ready=False)
        wait_until(lambda: _done(new, ids)[1] == JOBS, RUN_S_MAX, what="every job finished")

        records = {j: new.record(j, items=True) for j in ids}
        items = [it for rec in records.values() for it in rec["items"]]
        assert len(items) == total
        bad = [it for it in items if it["state"] != "done" or it["rc"] != 0 or it["attempts"] < 1]
        assert not bad, bad[:5]
        # A result commits only on the lease it ran under: the new leader, which applied the
        # whole log since the fleet started, accepted exactly one result per item.
        accepted = new.metrics()["meshjobs_table_results_accepted_total"]
        assert accepted == total, accepted
        ran_on = {it["member"] for it in items}
        assert ran_on <= {m.name for m in workers}, ran_on
        assert len(ran_on) >= WORKERS - 2, sorted(ran_on)

        leader.wait_ready()
        wait_until(lambda: _done(leader, ids)[1] == JOBS, RUN_S_MAX,
                   what="the restarted member's table has every job finished")
        for j in ids:
            assert leader.record(j, items=True)["items"] == records[j]["items"], j
    finally:
        for m in members:
            m.stop()
