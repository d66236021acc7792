"""Why a pending job waits (meshjobs/waits.py): every reason from the table alone, said the
same way (issue 27 point 3). Pure: the table is driven through `apply`, time handed in."""

from __future__ import annotations

from meshjobs import waits
from meshjobs.table import FAILED
from tests.helpers import T0, Log, row


def codes(log: Log, job_id: str = "j1", now: int = T0) -> list[str]:
    return [c for c, _w in waits.reasons(log.table, log.job(job_id), now)]


def says(log: Log, job_id: str = "j1", now: int = T0) -> str:
    return waits.fields(log.table, log.job(job_id), now).get("waiting_for", "")


def test_pool_held_fleet_wide_and_on_a_member() -> None:
    """A held pool is said with where it is held, and what lifts it; a hold fleet-wide keeps
    it from a slot's reason, a hold on one member does not (it may run elsewhere)."""
    log = Log()
    log.submit()
    assert codes(log) == ["slot"]
    log.apply({"k": "pool", "t": T0, "a": "hold", "pool": "default"})
    assert codes(log) == ["pool_held"]
    assert "pool 'default' held fleet-wide (meshctl pool release default)" in says(log)
    log.apply({"k": "pool", "t": T0, "a": "release", "pool": "default"})
    log.apply({"k": "pool", "t": T0, "a": "drain", "pool": "default", "member": "v1"})
    assert codes(log) == ["pool_drained", "slot"]
    assert "pool 'default' drained on member(s) v1" in says(log)


def test_job_held_and_dependencies_name_what_they_wait_for() -> None:
    log = Log()
    log.submit("p1")
    log.submit("j1", dg=b"dg-2", hold=True, after=[{"id": "p1", "on": "ok"}])
    assert codes(log) == ["job_held", "dependencies"]
    text = says(log)
    assert "job held" in text and "meshctl job tone j1 --release" in text
    assert "dependencies: job p1 until it ends done" in text


def test_quota_and_max_leases() -> None:
    """A submitter at its running_items_max, and a job at its own max_leases, say so."""
    log = Log()
    log.submit("a1", n=2, submitted_by="alice", running_items_max=1)
    log.lease(("a1", 0))
    assert codes(log, "a1") == ["quota"]
    assert "alice has 1 item(s) running, its running_items_max of 1" in says(log, "a1")
    log.submit("m1", n=2, dg=b"dg-2", max_leases=1)
    log.lease(("m1", 0))
    assert codes(log, "m1") == ["max_leases"]


def test_slot_counts_the_items_ahead() -> None:
    """Nothing else holding it, a job waits for a free slot behind the items the leader leases
    first: of higher priority, or the same priority submitted earlier, in its pool."""
    log = Log()
    log.submit("first", n=3)
    log.submit("other-pool", n=5, dg=b"dg-2", pool="gpu")
    log.submit("j1", n=1, dg=b"dg-3")
    log.submit("urgent", n=2, dg=b"dg-4", priority=5)
    assert "a free slot in pool 'default' (5 item(s) ahead of it)" in says(log)
    assert "no item ahead of it" in says(log, "urgent")


def test_backoff_after_a_failure() -> None:
    log = Log()
    log.submit(retries=2)
    _, ep = log.lease(("j1", 0))
    log.result(row("j1", 0, ep, FAILED, rc=3))
    assert codes(log) == ["backoff"]
    assert "the next in" in says(log)
    assert codes(log, now=T0 + 3_600_000) == ["slot"]  # the backoff is over by then


def test_nothing_pending_or_ended_says_nothing() -> None:
    log = Log()
    log.submit()
    log.lease(("j1", 0))
    assert waits.fields(log.table, log.job(), T0) == {}
    log.op("cancel")
    assert waits.fields(log.table, log.job(), T0) == {}


def test_placement_takes_the_place_of_a_slot() -> None:
    """The HTTP edge's placement reason (from the leader's fleet view) replaces "a free slot",
    in its place in the order."""
    log = Log()
    log.submit()
    log.apply({"k": "pool", "t": T0, "a": "drain", "pool": "default", "member": "v1"})
    rec = {**log.table.record(log.job()), **waits.fields(log.table, log.job(), T0)}
    merged = waits.merge(rec, "no alive member matches 'gpu-*' in pool 'default'")
    assert [r["reason"] for r in merged["waiting_reasons"]] == ["pool_drained", "placement"]
    assert merged["waiting_for"].endswith("no alive member matches 'gpu-*' in pool 'default'")
    assert waits.merge(rec, None) is rec
