"""Table-driven tests of the job table (meshjobs/table.py): every transition of `JobTable.apply`.

Each test's docstring names the rule it checks. The table is driven only through `apply`, with a
log index that grows by one per entry, the way a member applies its committed log.
"""

from __future__ import annotations

from typing import Any

import msgpack
import pytest

from meshjobs import limits
from meshjobs.table import (
    DONE,
    FAILED,
    LEASED,
    PENDING,
    TIMEOUT,
    JobTable,
    backoff_ms,
)
from tests.helpers import T0, Log, refusal, row, spec


def digest(n: int) -> bytes:
    return bytes([n % 256]) * 32


def state_without_counts(table: JobTable) -> dict:
    s = table.to_state()
    s.pop("counts")
    s.pop("applied_index")
    s.pop("clock")  # committed time moves with every entry applied, as the index does
    return msgpack.unpackb(msgpack.packb(s, use_bin_type=True), raw=False, strict_map_key=False)


# --- entries in general ---------------------------------------------------------------------


@pytest.mark.parametrize("entry", [
    None, 7, "submit", [1, 2], b"\x00", {}, {"k": "nope", "t": 1}, {"k": None, "t": 1},
    {"k": "cancel"}, {"k": "cancel", "t": -1}, {"k": "cancel", "t": True},
    {"k": "cancel", "t": 1.5}, {"k": "cancel", "t": "1"},
    {"k": "cancel", "t": 1, "rid": 5}, {"k": "cancel", "t": 1, "rid": "r" * (limits.rid_chars_max + 1)},
])
def test_malformed_entry_is_refused(entry: Any) -> None:
    """Rule 2 (apply is total): a malformed entry becomes a 400 refusal and a count, no change."""
    log = Log()
    log.submit()
    before = state_without_counts(log.table)
    out = log.apply(entry)
    assert refusal(out) == (False, 400, "malformed")
    assert log.table.counts["refused_malformed"] == 1
    assert state_without_counts(log.table) == before
    log.table.check()


def test_unhashable_kind_is_refused() -> None:
    """Rule 2: an entry whose kind is a list (msgpack can carry one) is refused, not raised."""
    log = Log()
    out = log.apply({"k": ["submit"], "t": 1})
    assert refusal(out) == (False, 400, "malformed")


def test_index_must_grow() -> None:
    """Rule 3: applying at an index not after the last one is our own bug and raises."""
    log = Log()
    log.submit()
    with pytest.raises(AssertionError):
        log.table.apply({"k": "cancel", "t": T0, "id": "j1"}, log.index)
    with pytest.raises(AssertionError):
        log.table.apply({"k": "cancel", "t": T0, "id": "j1"}, log.index - 1)
    assert log.job().state == "queued"


def test_index_may_skip() -> None:
    """The lease epoch is the entry's log index, whatever gaps other entries leave in the log."""
    log = Log()
    log.submit()
    out = log.table.apply({"k": "lease", "t": T0, "g": [["j1", 0, "m1", "b1"]]}, 40)
    assert out["granted"] == 1
    assert log.job().epoch[0] == 40
    assert log.table.applied_index == 40


# --- submit -----------------------------------------------------------------------------------


def test_submit_new_job() -> None:
    """submit: a new id makes a queued job whose items are pending, in order."""
    log = Log()
    out = log.submit("j1", n=3, items=[digest(1), None, digest(2)], tags=["a"])
    assert out == {"ok": True, "id": "j1", "new": True}
    job = log.job()
    assert job.state == "queued"
    assert list(job.queue) == [0, 1, 2]
    assert [job.st[i] for i in range(3)] == [PENDING] * 3
    assert job.stdin == [digest(1), None, digest(2)]
    assert job.submitted_ms == T0
    assert log.counts() == {"entries": 1, "jobs_submitted": 1, "items_submitted": 3}
    log.table.check()


def test_submit_same_digest_is_idempotent() -> None:
    """submit: the same id with the same digest answers the existing job and changes nothing."""
    log = Log()
    log.submit("j1", n=2)
    before = state_without_counts(log.table)
    out = log.submit("j1", n=2, t=T0 + 99)
    assert out == {"ok": True, "id": "j1", "new": False}
    assert state_without_counts(log.table) == before
    assert log.table.counts["jobs_submitted"] == 1


def test_submit_different_digest_conflicts() -> None:
    """submit: the same id with another digest is refused 409 and the first job stays."""
    log = Log()
    log.submit("j1", n=2, dg=b"one")
    out = log.submit("j1", n=5, dg=b"two")
    assert refusal(out) == (False, 409, "conflict")
    assert log.job().n == 2
    assert log.table.counts["refused_conflict"] == 1


def test_submit_forgotten_id_refused() -> None:
    """Rule 5: a forgotten id never comes back, not even with the same digest."""
    log = Log()
    log.submit("j1", dg=b"one")
    log.op("cancel")
    assert log.op("forget")["ok"]
    for dg in (b"one", b"two"):
        out = log.submit("j1", dg=dg)
        assert refusal(out) == (False, 409, "forgotten")
        assert "j1" not in log.table.jobs
    assert log.table.counts["refused_forgotten"] == 2


def _bad_submits() -> list:
    good = {"k": "submit", "t": T0, "id": "j1", "spec": spec(), "dg": b"d", "items": [None]}

    def with_(**kw: Any) -> dict:
        e = dict(good)
        e.update(kw)
        return e

    def spec_with(**kw: Any) -> dict:
        return with_(spec=spec(**kw))

    def spec_without(key: str) -> dict:
        s = spec()
        del s[key]
        return with_(spec=s)

    return [
        with_(id=None), with_(id=""), with_(id=5), with_(id="x" * (limits.job_id_chars_max + 1)),
        with_(spec=None), with_(spec=[]), with_(spec={}), spec_without("argv"),
        spec_without("max_leases"), spec_with(argv=[]), spec_with(argv="echo"),
        spec_with(argv=["echo", 1]), spec_with(pool=None), spec_with(env=[]),
        spec_with(cwd=5), spec_with(retries=-1), spec_with(retries=limits.retries_max + 1),
        spec_with(retries="1"), spec_with(runtime_s="1"), spec_with(tags="a"),
        spec_with(priority=True), spec_with(priority=1.0), spec_with(hold=1),
        spec_with(max_leases=0), spec_with(max_leases="2"),
        with_(dg=None), with_(dg="d"), with_(items=[]), with_(items=None), with_(items=(None,)),
        with_(items=[b"short"]), with_(items=["00" * 32]), with_(items=[None, 5]),
    ]


@pytest.mark.parametrize("entry", _bad_submits())
def test_submit_malformed_refused(entry: dict) -> None:
    """submit: a malformed id, spec, digest or item list is a 400 refusal, never an exception."""
    log = Log()
    out = log.apply(entry)
    assert refusal(out) == (False, 400, "malformed")
    assert log.table.jobs == {}
    assert log.counts() == {"entries": 1, "refused_malformed": 1}


@pytest.mark.parametrize("bad", [
    {"env": {"A": 1}}, {"tags": [1]}, {"retries": True},
    {"priority": limits.priority_abs_max + 1},
])
def test_submit_spec_fields_checked_like_control(bad: dict) -> None:
    """submit: a spec the control parser would never produce is refused as malformed."""
    log = Log()
    out = log.apply({"k": "submit", "t": T0, "id": "j1", "spec": spec(**bad), "dg": b"d",
                     "items": [None]})
    assert refusal(out) == (False, 400, "malformed")


# --- lease ----------------------------------------------------------------------------------------


def test_lease_grants_pending_item() -> None:
    """lease: pending -> leased, epoch = the entry's index, attempts + 1, job running."""
    log = Log()
    log.submit(n=3)
    out, epoch = log.lease(("j1", 1), t=T0 + 10)
    assert out == {"ok": True, "granted": 1, "refused": 0}
    job = log.job()
    assert job.st[1] == LEASED and job.epoch[1] == epoch and job.attempts[1] == 1
    assert job.member[1] == "m1"
    assert log.table.leased == {("j1", 1): ("m1", "b1")}
    assert list(job.queue) == [0, 2]
    assert job.state == "running"
    assert log.table.leases_of("m1") == [("j1", 1, epoch, "b1")]
    assert log.table.lease_current("j1", 1, epoch)
    assert log.table.item_record(job, 1)["started_at"] == (T0 + 10) / 1000.0
    assert log.table.counts["leases_granted"] == 1
    log.table.check()


def _lease_refusal_cases() -> list:
    def leased(log: Log) -> list:
        log.lease(("j1", 0))
        return [["j1", 0, "m1", "b1"]]

    def held(log: Log) -> list:
        log.op("tone", hold=True)
        return [["j1", 0, "m1", "b1"]]

    def max_leases(log: Log) -> list:
        log.op("tone", max_leases=1)
        log.lease(("j1", 1))
        return [["j1", 0, "m1", "b1"]]

    def backoff(log: Log) -> list:
        log.op("tone", max_leases=None)
        log.submit("j2", retries=1, dg=b"other")
        _, e = log.lease(("j2", 0))
        log.result(row("j2", 0, e, FAILED, rc=1), t=T0)
        return [["j2", 0, "m1", "b1"]]  # applied at T0 + backoff - 1 below

    def finished(log: Log) -> list:
        log.op("cancel")
        return [["j1", 0, "m1", "b1"]]

    return [
        ("already leased", leased), ("job held", held), ("max_leases reached", max_leases),
        ("backoff not over", backoff), ("job cancelled", finished),
        ("unknown job", lambda log: [["nope", 0, "m1", "b1"]]),
        ("index past the end", lambda log: [["j1", 3, "m1", "b1"]]),
        ("negative index", lambda log: [["j1", -1, "m1", "b1"]]),
        ("grant not a list", lambda log: ["j1"]),
        ("grant too short", lambda log: [["j1", 0, "m1"]]),
        ("grant index a string", lambda log: [["j1", "0", "m1", "b1"]]),
        ("grant member not a string", lambda log: [["j1", 0, None, "b1"]]),
        ("grant boot not a string", lambda log: [["j1", 0, "m1", 7]]),
    ]


@pytest.mark.parametrize("name,setup", _lease_refusal_cases(), ids=[c[0] for c in _lease_refusal_cases()])
def test_lease_refused(name: str, setup) -> None:
    """lease: a grant that cannot be honoured is refused and counted; the rest is untouched."""
    log = Log()
    log.submit(n=3)
    grants = setup(log)
    log.table.counts.pop("leases_refused", None)
    before = state_without_counts(log.table)
    out = log.apply({"k": "lease", "t": T0 + backoff_ms(1) - 1, "g": grants})
    assert out == {"ok": True, "granted": 0, "refused": 1}
    assert state_without_counts(log.table) == before
    assert log.table.counts["leases_refused"] == 1
    log.table.check()


def test_lease_max_leases_within_one_entry() -> None:
    """lease: max_leases counts the grants of the same entry as they are made."""
    log = Log()
    log.submit(n=4, max_leases=2)
    out, _ = log.lease(("j1", 0), ("j1", 1), ("j1", 2))
    assert out == {"ok": True, "granted": 2, "refused": 1}
    assert log.job().n_leased == 2


def test_lease_same_item_twice_in_one_entry() -> None:
    """lease: an item granted twice in one entry is leased once."""
    log = Log()
    log.submit(n=1)
    out, _ = log.lease(("j1", 0), ("j1", 0))
    assert out == {"ok": True, "granted": 1, "refused": 1}
    assert log.job().attempts[0] == 1


@pytest.mark.parametrize("g", [None, "x", {"j1": 0}, [["j1", 0, "m1", "b1"]] * (limits.lease_batch_max + 1)])
def test_lease_malformed_body(g: Any) -> None:
    """lease: a grant list that is not a bounded list is a 400 refusal."""
    log = Log()
    log.submit()
    out = log.apply({"k": "lease", "t": T0, "g": g})
    assert refusal(out) == (False, 400, "malformed")
    assert log.job().st[0] == PENDING


# --- result -------------------------------------------------------------------------------------


def test_result_done_under_current_epoch() -> None:
    """result: accepted under the current epoch; the item is done, the job done and finished."""
    log = Log()
    log.submit()
    _, e = log.lease(("j1", 0))
    out = log.result(row("j1", 0, e, DONE, rc=0, out=digest(7), err=digest(8)), t=T0 + 50)
    assert out == {"ok": True, "accepted": 1, "refused": 0}
    job = log.job()
    assert job.st[0] == DONE and job.state == "done" and job.finished
    rec = log.table.record(job, items=True)
    assert rec["finished_at"] == (T0 + 50) / 1000.0
    assert rec["items_done"] == 1 and rec["items_failed"] == 0
    item = rec["items"][0]
    assert item["rc"] == 0 and item["stdout"] == digest(7).hex() and item["stderr"] == digest(8).hex()
    assert item["epoch"] == e and item["attempts"] == 1
    assert log.table.leased == {}
    log.table.check()


def test_late_result_of_revoked_lease_refused() -> None:
    """result: a late result of a revoked lease is refused and counted (epoch fencing)."""
    log = Log()
    log.submit()
    _, e1 = log.lease(("j1", 0), member="m1")
    log.revoke(("j1", 0, e1))
    _, e2 = log.lease(("j1", 0), member="m2")
    assert e2 > e1
    out = log.result(row("j1", 0, e1, DONE))
    assert out == {"ok": True, "accepted": 0, "refused": 1}
    job = log.job()
    assert job.st[0] == LEASED and job.epoch[0] == e2 and job.member[0] == "m2"
    assert log.table.counts["results_refused"] == 1
    assert log.result(row("j1", 0, e2, DONE))["accepted"] == 1


def test_second_result_refused() -> None:
    """result: an item never has two committed results (a repeated result is refused)."""
    log = Log()
    log.submit()
    _, e = log.lease(("j1", 0))
    assert log.result(row("j1", 0, e, DONE, rc=0))["accepted"] == 1
    out = log.result(row("j1", 0, e, FAILED, rc=1))
    assert out == {"ok": True, "accepted": 0, "refused": 1}
    assert log.job().rc[0] == 0 and log.job().state == "done"


def test_two_results_in_one_entry() -> None:
    """result: a duplicate row within one entry is refused after the first is accepted."""
    log = Log()
    log.submit()
    _, e = log.lease(("j1", 0))
    out = log.result(row("j1", 0, e, DONE), row("j1", 0, e, FAILED))
    assert out == {"ok": True, "accepted": 1, "refused": 1}
    assert log.job().st[0] == DONE


def test_result_for_item_not_leased_refused() -> None:
    """result: never a result for an item that is not leased under that epoch."""
    log = Log()
    log.submit(n=2)
    _, e = log.lease(("j1", 0))
    rows = [row("j1", 1, e), row("j1", 1, 0), row("j1", 0, e + 1), row("j1", 0, e - 1),
            row("j1", 2, e), row("nope", 0, e)]
    out = log.result(*rows)
    assert out == {"ok": True, "accepted": 0, "refused": len(rows)}
    assert log.job().st[0] == LEASED and log.job().st[1] == PENDING


@pytest.mark.parametrize("state,name", [(FAILED, "failed"), (TIMEOUT, "timeout")])
def test_result_final_failure(state: int, name: str) -> None:
    """result: a failure without retries left is final; the job ends failed."""
    log = Log()
    log.submit(n=2)
    _, e = log.lease(("j1", 0), ("j1", 1))
    log.result(row("j1", 0, e, DONE))
    assert not log.job().finished
    log.result(row("j1", 1, e, state, rc=None if state == TIMEOUT else 3), t=T0 + 7)
    job = log.job()
    rec = log.table.record(job, items=True)
    assert rec["items"][1]["state"] == name
    assert rec["state"] == "failed" and rec["items_failed"] == 1 and rec["items_done"] == 1
    assert rec["finished_at"] == (T0 + 7) / 1000.0


def test_result_retry_goes_to_end_of_queue_with_backoff() -> None:
    """result: a failure with retries left -> pending at the END of the queue, not before
    t + backoff_ms(fails); the last allowed failure is final."""
    log = Log()
    log.submit(n=3, retries=2)
    _, e = log.lease(("j1", 0))
    t1 = T0 + 100
    out = log.result(row("j1", 0, e, FAILED, rc=1), t=t1)
    assert out["accepted"] == 1
    job = log.job()
    assert job.st[0] == PENDING and list(job.queue) == [1, 2, 0]
    assert job.not_before == {0: t1 + backoff_ms(1)}
    assert log.table.counts["items_retried"] == 1
    assert log.table.next_due_ms(0) == t1 + backoff_ms(1)
    # Not leasable one millisecond early, leasable on the dot.
    assert log.lease(("j1", 0), t=t1 + backoff_ms(1) - 1)[0]["refused"] == 1
    out, e = log.lease(("j1", 0), t=t1 + backoff_ms(1))
    assert out["granted"] == 1 and job.attempts[0] == 2 and job.not_before == {}
    t2 = t1 + 5000
    log.result(row("j1", 0, e, TIMEOUT, rc=None), t=t2)
    assert job.st[0] == PENDING and job.not_before == {0: t2 + backoff_ms(2)}
    assert backoff_ms(2) == 2 * backoff_ms(1)
    _, e = log.lease(("j1", 0), t=t2 + backoff_ms(2))
    log.result(row("j1", 0, e, FAILED, rc=1), t=t2 + 10_000)
    assert job.st[0] == FAILED and job.attempts[0] == 3 and job.fails[0] == 3
    assert not job.finished  # items 1 and 2 are still pending
    log.table.check()


def test_backoff_is_capped() -> None:
    """backoff_ms grows exponentially from the base and never passes the maximum."""
    assert backoff_ms(1) == limits.retry_backoff_ms_base
    assert backoff_ms(3) == 4 * limits.retry_backoff_ms_base
    assert backoff_ms(60) == limits.retry_backoff_ms_max


def test_job_finishes_when_all_items_end() -> None:
    """result: the job finishes (done) exactly when its last item ends."""
    log = Log()
    log.submit(n=3)
    _, e = log.lease(("j1", 0), ("j1", 1), ("j1", 2))
    for i in range(3):
        assert not log.job().finished
        log.result(row("j1", i, e), t=T0 + i + 1)
    assert log.job().state == "done" and log.job().finished_ms == T0 + 3


@pytest.mark.parametrize("bad", [
    "x", [], ["j1", 0], row("j1", 0, 0)[:9], row("j1", 0, 0) + [1],
    row("j1", 0, 0, state=PENDING), row("j1", 0, 0, state=LEASED), row("j1", 0, 0, state=9),
    row("j1", 0, 0, rc=2**31), row("j1", 0, 0, rc="0"), row("j1", 0, 0, out=b"short"),
    row("j1", 0, 0, err="00" * 32), ["j1", "0", 0, DONE, 0, None, None, None, 0, 0],
    ["j1", 0, 0, DONE, 0, 256, None, None, 0, 0], ["j1", 0, 0, DONE, 0, None, None, None, -1, 0],
    ["j1", 0, 0, DONE, 0, None, None, None, 0, 2**63],
])
def test_result_malformed_row_refused(bad: Any) -> None:
    """result: a malformed row is refused and counted, never an exception."""
    log = Log()
    log.submit()
    _, e = log.lease(("j1", 0))
    if isinstance(bad, list) and len(bad) >= 3 and bad[2] == 0:
        bad = list(bad)
        bad[2] = e
    out = log.result(bad)
    assert out == {"ok": True, "accepted": 0, "refused": 1}
    assert log.job().st[0] == LEASED


def test_result_with_error_kept_and_shown() -> None:
    """result: a row's eleventh field says why the item failed without running; the table keeps
    it (only for items that have one), shows it as the item's `error`, keeps it through a
    snapshot, and drops it when a later try of the item ends without one."""
    log = Log()
    log.submit(n=3, retries=1)
    _, e = log.lease(("j1", 0), ("j1", 1))
    why = "no such program '/no/such/prog' on member: install it or fix the job's argv"
    out = log.result([*row("j1", 0, e, FAILED, rc=None), why], row("j1", 1, e, DONE))
    assert out == {"ok": True, "accepted": 2, "refused": 0}
    job = log.job()
    assert job.errors == {0: why}
    items = log.table.record(job, items=True)["items"]
    assert [it["error"] for it in items] == [why, None, None]
    assert items[0]["rc"] is None and items[0]["stdout"] is None
    raw = msgpack.packb(log.table.to_state(), use_bin_type=True)
    t2 = JobTable.from_state(msgpack.unpackb(raw, raw=False, strict_map_key=False))
    assert t2.jobs["j1"].errors == {0: why}
    assert msgpack.packb(t2.to_state(), use_bin_type=True) == raw
    # The retry runs and fails with an exit code: the old reason goes.
    _, e2 = log.lease(("j1", 0), t=T0 + 60_000)
    log.result(row("j1", 0, e2, FAILED, rc=3), t=T0 + 60_000)
    assert log.job().errors is None and log.job().st[0] == FAILED
    log.table.check()


def test_jobs_without_errors_cost_nothing_more() -> None:
    """Snapshot: a job none of whose items has an error keeps the 23-field row (no error list,
    no dict in memory)."""
    log = Log()
    log.submit(n=2)
    _, e = log.lease(("j1", 0), ("j1", 1))
    log.result(row("j1", 0, e), row("j1", 1, e, FAILED, rc=1))
    assert log.job().errors is None
    assert [len(r) for r in log.table.to_state()["jobs"]] == [23]


@pytest.mark.parametrize("error", ["", 5, None, b"bytes", "x" * (limits.item_error_chars_max + 1)])
def test_result_malformed_error_refused(error: Any) -> None:
    """result: an error field that is not a short non-empty string is a malformed row."""
    log = Log()
    log.submit()
    _, e = log.lease(("j1", 0))
    out = log.result([*row("j1", 0, e, FAILED, rc=None), error])
    assert out == {"ok": True, "accepted": 0, "refused": 1}
    assert log.job().st[0] == LEASED and log.job().errors is None


def test_result_float_state_refused() -> None:
    """result: a state given as a float (msgpack can carry one) is refused, not raised."""
    log = Log()
    log.submit()
    _, e = log.lease(("j1", 0))
    out = log.result(["j1", 0, e, float(FAILED), 1, None, None, None, 0, 0])
    assert out == {"ok": True, "accepted": 0, "refused": 1}


@pytest.mark.parametrize("r", [None, "x", [row("j1", 0, 1)] * (limits.result_batch_max + 1)])
def test_result_malformed_body(r: Any) -> None:
    """result: a result list that is not a bounded list is a 400 refusal."""
    log = Log()
    log.submit()
    out = log.apply({"k": "result", "t": T0, "r": r})
    assert refusal(out) == (False, 400, "malformed")


# --- revoke ---------------------------------------------------------------------------------------


def test_revoke_to_head_of_queue_in_order() -> None:
    """revoke: leased -> pending at the HEAD of the queue, in the order the entry gives."""
    log = Log()
    log.submit(n=5)
    _, e = log.lease(("j1", 1), ("j1", 2), ("j1", 3))
    assert list(log.job().queue) == [0, 4]
    out = log.revoke(("j1", 3, e), ("j1", 1, e))
    assert out == {"ok": True, "revoked": 2}
    job = log.job()
    assert list(job.queue) == [3, 1, 0, 4]
    assert job.st[3] == PENDING and job.member[3] is None and job.st[2] == LEASED
    assert log.table.leased == {("j1", 2): ("m1", "b1")}
    assert log.table.counts["leases_revoked"] == 2
    assert log.table.pick("default", 5, T0, set()) == [("j1", 3), ("j1", 1), ("j1", 0), ("j1", 4)]
    log.table.check()


def test_revoke_stale_epoch_ignored() -> None:
    """revoke: a revoke naming an older epoch of the item is ignored."""
    log = Log()
    log.submit()
    _, e1 = log.lease(("j1", 0))
    log.revoke(("j1", 0, e1))
    _, e2 = log.lease(("j1", 0))
    out = log.revoke(("j1", 0, e1), ("j1", 0, e2 + 1), ("nope", 0, e2), ("j1", 9, e2), ["j1"], "x")
    assert out == {"ok": True, "revoked": 0}
    assert log.job().st[0] == LEASED and log.job().epoch[0] == e2


@pytest.mark.parametrize("items", [None, {"j1": 0}, [["j1", 0, 1]] * (limits.lease_batch_max + 1)])
def test_revoke_malformed_body(items: Any) -> None:
    """revoke: a lease list that is not a bounded list is a 400 refusal."""
    log = Log()
    out = log.apply({"k": "revoke", "t": T0, "l": items})
    assert refusal(out) == (False, 400, "malformed")


# --- cancel ------------------------------------------------------------------------------------


def test_cancel_pending_and_leased() -> None:
    """cancel: pending and leased items -> cancelled; the job is cancelled and finished."""
    log = Log()
    log.submit(n=3)
    _, e = log.lease(("j1", 0), ("j1", 1))
    log.result(row("j1", 0, e))
    out = log.op("cancel", t=T0 + 9)
    assert out == {"ok": True, "id": "j1"}
    job = log.job()
    rec = log.table.record(job, items=True)
    assert [it["state"] for it in rec["items"]] == ["done", "cancelled", "cancelled"]
    assert rec["state"] == "cancelled" and rec["finished_at"] == (T0 + 9) / 1000.0
    assert rec["items_cancelled"] == 2 and list(job.queue) == []
    assert log.table.leased == {} and log.table.pick("default", 5, T0, set()) == []
    assert not log.table.lease_current("j1", 1, e)
    assert log.result(row("j1", 1, e))["refused"] == 1
    assert log.table.counts["jobs_cancelled"] == 1
    log.table.check()


def test_cancel_held_job() -> None:
    """cancel: a held job can be cancelled; it is then cancelled, not held."""
    log = Log()
    log.submit(hold=True)
    assert log.op("cancel")["ok"]
    assert log.job().state == "cancelled"


@pytest.mark.parametrize("how", ["done", "failed", "cancelled"])
def test_cancel_finished_job_conflicts(how: str) -> None:
    """cancel: a job that has ended is refused 409 and stays as it ended."""
    log = Log()
    log.submit()
    if how == "cancelled":
        log.op("cancel")
    else:
        _, e = log.lease(("j1", 0))
        log.result(row("j1", 0, e, DONE if how == "done" else FAILED))
    out = log.op("cancel")
    assert refusal(out) == (False, 409, "finished")
    assert log.job().state == how


def test_cancel_unknown_and_forgotten() -> None:
    """cancel: an unknown id is 404 unknown_job; a forgotten id 404 forgotten; a bad id 400."""
    log = Log()
    assert refusal(log.op("cancel", "nope")) == (False, 404, "unknown_job")
    log.submit()
    log.op("cancel")
    log.op("forget")
    assert refusal(log.op("cancel")) == (False, 404, "forgotten")
    assert refusal(log.op("cancel", 5)) == (False, 400, "malformed")
    assert refusal(log.op("cancel", None)) == (False, 400, "malformed")


# --- forget ------------------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["done", "failed", "cancelled"])
def test_forget_finished_job(how: str) -> None:
    """forget: a finished or cancelled job leaves the table; its id is in `forgotten`."""
    log = Log()
    log.submit()
    if how == "cancelled":
        log.op("cancel")
    else:
        _, e = log.lease(("j1", 0))
        log.result(row("j1", 0, e, DONE if how == "done" else FAILED))
    out = log.op("forget")
    assert out == {"ok": True, "id": "j1"}
    assert "j1" not in log.table.jobs and list(log.table.forgotten) == ["j1"]
    assert log.table.counts["jobs_forgotten"] == 1
    assert refusal(log.op("forget")) == (False, 404, "forgotten")
    log.table.check()


@pytest.mark.parametrize("leased", [False, True])
def test_forget_unfinished_job_conflicts(leased: bool) -> None:
    """forget: a job that has not ended (queued or running) is refused 409."""
    log = Log()
    log.submit()
    if leased:
        log.lease(("j1", 0))
    out = log.op("forget")
    assert refusal(out) == (False, 409, "not_finished")
    assert "j1" in log.table.jobs and not log.table.forgotten


def test_forget_unknown() -> None:
    """forget: an unknown id is 404."""
    log = Log()
    assert refusal(log.op("forget", "nope")) == (False, 404, "unknown_job")


# --- tone ----------------------------------------------------------------------------------------


def test_tone_changes_knobs() -> None:
    """tone: priority, hold and max_leases change; max_leases None lifts the limit."""
    log = Log()
    log.submit(n=3)
    assert log.op("tone", priority=5, hold=True, max_leases=2) == {"ok": True, "id": "j1"}
    rec = log.table.record(log.job())
    assert (rec["priority"], rec["hold"], rec["max_leases"], rec["state"]) == (5, True, 2, "held")
    assert log.table.pick("default", 3, T0, set()) == []
    log.op("tone", hold=False)
    assert log.job().state == "queued"
    assert len(log.table.pick("default", 3, T0, set())) == 2
    log.op("tone", max_leases=None)
    assert log.job().max_leases is None
    assert len(log.table.pick("default", 3, T0, set())) == 3


def test_tone_finished_conflicts() -> None:
    """tone: a job that has ended is refused 409."""
    log = Log()
    log.submit()
    log.op("cancel")
    assert refusal(log.op("tone", priority=1)) == (False, 409, "finished")


@pytest.mark.parametrize("fields", [
    {}, {"priority": True}, {"priority": "1"}, {"priority": limits.priority_abs_max + 1},
    {"priority": -limits.priority_abs_max - 1}, {"hold": 1}, {"hold": None},
    {"max_leases": 0}, {"max_leases": True}, {"max_leases": 1.5},
    {"priority": 3, "hold": "yes"},
])
def test_tone_malformed(fields: dict) -> None:
    """tone: a malformed knob (or none at all) is a 400 refusal and nothing changes."""
    log = Log()
    log.submit(priority=1)
    out = log.op("tone", **fields)
    assert refusal(out) == (False, 400, "malformed")
    assert log.job().priority == 1 and log.job().hold is False


def test_tone_unknown() -> None:
    """tone: an unknown id is 404."""
    log = Log()
    assert refusal(log.op("tone", "nope", priority=1)) == (False, 404, "unknown_job")


# --- request ids --------------------------------------------------------------------------------


def _rid_entries() -> list:
    return [
        ("submit", {"k": "submit", "t": T0, "id": "j2", "spec": spec(), "dg": b"x", "items": [None]}),
        ("cancel", {"k": "cancel", "t": T0, "id": "j1"}),
        ("tone", {"k": "tone", "t": T0, "id": "j1", "priority": 4}),
        ("refused", {"k": "forget", "t": T0, "id": "j1"}),
        ("lease", {"k": "lease", "t": T0, "g": [["j1", 0, "m1", "b1"]]}),
    ]


@pytest.mark.parametrize("name,entry", _rid_entries(), ids=[e[0] for e in _rid_entries()])
def test_rid_applied_once(name: str, entry: dict) -> None:
    """Request ids: an entry whose rid was seen returns the first outcome and changes nothing."""
    log = Log()
    log.submit("j1", n=2)
    entry = dict(entry, rid="r-1")
    first = log.apply(entry)
    before = state_without_counts(log.table)
    again = log.apply(dict(entry, t=T0 + 1))
    assert again == first
    assert state_without_counts(log.table) == before
    assert log.table.counts["duplicate_rids"] == 1


def test_rid_replays_first_outcome_even_for_another_change() -> None:
    """Request ids: a refused change's rid replays the refusal, even if it would now succeed."""
    log = Log()
    log.submit("j1")
    first = log.op("forget", rid="r-9")
    assert refusal(first) == (False, 409, "not_finished")
    log.op("cancel")
    assert log.op("forget", rid="r-9") == first
    assert "j1" in log.table.jobs


def test_rid_of_submit_is_deduplicated() -> None:
    """Request ids: the same submit twice under one rid makes one job and counts it once."""
    log = Log()
    a = log.submit("j1", rid="s1")
    b = log.submit("j1", rid="s1")
    assert a == b == {"ok": True, "id": "j1", "new": True}
    assert log.table.counts["jobs_submitted"] == 1


# --- pick -------------------------------------------------------------------------------------------


def test_pick_priority_then_submit_order_then_queue() -> None:
    """pick: priority first, then submit order (seq), then each job's queue order."""
    log = Log()
    log.submit("a", n=2, dg=b"a")
    log.submit("b", n=2, dg=b"b", priority=5)
    log.submit("c", n=2, dg=b"c", priority=5)
    log.submit("d", n=1, dg=b"d", priority=-1)
    _, e = log.lease(("c", 0))
    log.revoke(("c", 0, e))
    got = log.table.pick("default", 10, T0, set())
    assert got == [("b", 0), ("b", 1), ("c", 0), ("c", 1), ("a", 0), ("a", 1), ("d", 0)]
    assert log.table.pick("default", 3, T0, set()) == got[:3]
    assert log.table.pick("default", 0, T0, set()) == []
    log.op("tone", "a", priority=9)
    assert log.table.pick("default", 1, T0, set()) == [("a", 0)]


def test_pick_skips() -> None:
    """pick: skips held jobs, other pools, items in `skip` and items in backoff."""
    log = Log()
    log.submit("held", n=1, dg=b"1", hold=True)
    log.submit("gpu", n=1, dg=b"2", pool="gpu")
    log.submit("r", n=3, dg=b"3", retries=1)
    _, e = log.lease(("r", 0))
    log.result(row("r", 0, e, FAILED, rc=1), t=T0)
    nb = T0 + backoff_ms(1)
    assert log.table.pick("default", 10, nb - 1, {("r", 1)}) == [("r", 2)]
    assert log.table.pick("default", 10, nb, set()) == [("r", 1), ("r", 2), ("r", 0)]
    assert log.table.pick("gpu", 10, T0, set()) == [("gpu", 0)]
    assert log.table.pick("cpu", 10, T0, set()) == []


def test_pick_respects_max_leases_minus_in_flight() -> None:
    """pick: max_leases minus items leased minus items already being proposed (in `skip`)."""
    log = Log()
    log.submit("a", n=6, dg=b"a", max_leases=3)
    log.submit("b", n=2, dg=b"b")
    log.lease(("a", 0))
    got = log.table.pick("default", 10, T0, {("a", 1)})
    assert got == [("a", 2), ("b", 0), ("b", 1)]
    log.lease(("a", 1), ("a", 2))
    assert log.table.pick("default", 10, T0, set()) == [("b", 0), ("b", 1)]


# --- records and job states -------------------------------------------------------------------------

JOB_FIELDS = {"id", "state", "priority", "hold", "tags", "pool", "argv", "items_total",
              "items_done", "items_failed", "submitted_at", "finished_at"}
ITEM_FIELDS = {"index", "state", "attempts", "member", "epoch", "rc", "stdout", "stderr"}


def test_records_have_design_fields() -> None:
    """Job record: at least the fields clients read, item records likewise, JSON-able values."""
    import json

    log = Log()
    log.submit("j1", n=2, items=[digest(3), None], tags=["x", "y"], t=T0)
    _, e = log.lease(("j1", 0))
    log.result(row("j1", 0, e, DONE, out=digest(4)))
    rec = log.table.record(log.job(), items=True)
    assert JOB_FIELDS <= set(rec)
    assert all(ITEM_FIELDS <= set(it) for it in rec["items"])
    json.dumps(rec)
    assert rec["id"] == "j1" and rec["tags"] == ["x", "y"] and rec["argv"] == ["echo", "hi"]
    assert rec["items_total"] == 2 and rec["items_done"] == 1 and rec["submitted_at"] == T0 / 1000
    assert rec["finished_at"] is None
    it0, it1 = rec["items"]
    assert it0 == {**it0, "index": 0, "state": "done", "attempts": 1, "member": "m1", "epoch": e,
                   "rc": 0, "stdout": digest(4).hex(), "stderr": None, "stdin": digest(3).hex()}
    assert it1 == {**it1, "index": 1, "state": "pending", "attempts": 0, "member": None,
                   "epoch": None, "rc": None, "stdout": None}
    assert "items" not in log.table.record(log.job())


def test_job_state_machine() -> None:
    """Job states: queued -> running -> done | failed | cancelled, held while on hold."""
    log = Log()
    log.submit("j1", n=2, dg=b"1")
    job = log.job()
    assert job.state == "queued"
    log.op("tone", hold=True)
    assert job.state == "held"
    log.op("tone", hold=False)
    _, e = log.lease(("j1", 0))
    assert job.state == "running"
    log.op("tone", hold=True)
    assert job.state == "held"
    log.op("tone", hold=False)
    log.revoke(("j1", 0, e))
    assert job.state == "running"  # once started, a job stays running until it ends
    _, e = log.lease(("j1", 0), ("j1", 1))
    log.result(row("j1", 0, e), row("j1", 1, e))
    assert job.state == "done"
    log.submit("j2", dg=b"2")
    log.op("cancel", "j2")
    assert log.job("j2").state == "cancelled"


# --- snapshots ------------------------------------------------------------------------------------


def rich_history() -> Log:
    """A table with every kind of job and item state, tombstones, request ids and backoffs."""
    log = Log()
    log.submit("done", n=2, dg=b"1", items=[digest(1), None], tags=["t"], env={"A": "b"},
               cwd="/tmp", runtime_s=2.5)
    log.submit("retry", n=3, dg=b"2", retries=3, priority=2, rid="rid-a")
    log.submit("held", n=2, dg=b"3", hold=True, max_leases=1)
    log.submit("gone", n=1, dg=b"4")
    log.submit("cut", n=2, dg=b"5", pool="gpu")
    _, e = log.lease(("done", 0), ("done", 1), ("retry", 0), ("retry", 1), ("cut", 0))
    log.result(row("done", 0, e, DONE, out=digest(5), err=digest(6)),
               row("done", 1, e, FAILED, rc=-9), t=T0 + 20)
    log.result(row("retry", 0, e, FAILED, rc=2), t=T0 + 30)
    log.revoke(("retry", 1, e))
    _, e2 = log.lease(("retry", 1), member="m2", boot="b9")
    log.op("cancel", "cut", rid="rid-b")
    log.op("cancel", "gone")
    log.op("forget", "gone")
    log.op("tone", "retry", priority=-3, max_leases=4)
    log.apply({"k": "nonsense", "t": 1})
    log.op("forget", "retry", rid="rid-c")
    assert log.table.jobs["retry"].epoch[1] == e2
    return log


def test_snapshot_round_trip() -> None:
    """Snapshot: from_state(to_state()) is the same table (state, records, check)."""
    log = rich_history()
    t = log.table
    t2 = JobTable.from_state(t.to_state())
    assert t2.to_state() == t.to_state()
    assert [t2.record(j, items=True) for j in t2.jobs.values()] == \
        [t.record(j, items=True) for j in t.jobs.values()]
    t2.check()


def test_item_names_kept_through_a_snapshot() -> None:
    """A spec's names (item file names) are applied, shown with the items, and survive a
    snapshot through msgpack; a spec without names has none (older logs stay valid)."""
    log = Log()
    log.submit("named", n=2, names=["a.txt", "b.txt"])
    log.submit("plain", n=1, dg=b"dg-2")
    raw = msgpack.packb(log.table.to_state(), use_bin_type=True)
    t2 = JobTable.from_state(msgpack.unpackb(raw, raw=False, strict_map_key=False))
    assert t2.record(t2.jobs["named"], items=True)["names"] == ["a.txt", "b.txt"]
    assert "names" not in t2.record(t2.jobs["plain"], items=True)
    assert "names" not in t2.record(t2.jobs["named"])
    t2.check()


def test_snapshot_msgpack_round_trip_and_carry_on() -> None:
    """Snapshot: through msgpack the table is the same, and applies later entries the same."""
    log = rich_history()
    t = log.table
    raw = msgpack.packb(t.to_state(), use_bin_type=True)
    t2 = JobTable.from_state(msgpack.unpackb(raw, raw=False, strict_map_key=False))
    t2.check()
    assert msgpack.packb(t2.to_state(), use_bin_type=True) == raw
    assert [t2.record(j, items=True) for j in t2.jobs.values()] == \
        [t.record(j, items=True) for j in t.jobs.values()]
    assert list(t2.forgotten) == ["gone"] and t2.next_due_ms(0) == t.next_due_ms(0)
    # The same later entries give the same outcomes and the same table on both.
    later = [
        {"k": "lease", "t": T0 + 10_000, "g": [["retry", 0, "m1", "b1"], ["retry", 2, "m1", "b1"],
                                            ["held", 0, "m1", "b1"]]},
        {"k": "submit", "t": T0, "id": "gone", "spec": spec(), "dg": b"4", "items": [None]},
        {"k": "forget", "t": T0, "id": "retry", "rid": "rid-c"},
        {"k": "tone", "t": T0, "id": "held", "hold": False},
        {"k": "lease", "t": T0, "g": [["held", 0, "m1", "b1"], ["held", 1, "m1", "b1"]]},
        {"k": "cancel", "t": T0, "id": "retry"},
    ]
    for n, entry in enumerate(later, start=log.index + 1):
        assert t.apply(entry, n) == t2.apply(entry, n)
    assert t.to_state() == t2.to_state()
    t.check()


def test_snapshot_refuses_other_format() -> None:
    """Snapshot: a state that is not format 1 is refused with ValueError."""
    with pytest.raises(ValueError):
        JobTable.from_state({"v": 2})
    with pytest.raises(ValueError):
        JobTable.from_state([])


def test_load_becomes_other() -> None:
    """load: a table that loads a snapshot becomes that table."""
    log = rich_history()
    t = JobTable()
    t.load(JobTable.from_state(log.table.to_state()))
    assert t.to_state() == log.table.to_state()


def test_check_catches_broken_table() -> None:
    """check: a table whose counts disagree with its items fails the check (it can fail)."""
    log = rich_history()
    log.table.jobs["done"].n_done += 1
    with pytest.raises(AssertionError):
        log.table.check()
    log = rich_history()
    log.table.leased[("held", 0)] = ("m1", "b1")
    with pytest.raises(AssertionError):
        log.table.check()


def test_batch_applies_each_change_in_order() -> None:
    """batch: many control changes in one entry, each applied in order at the entry's index,
    each with its own outcome and request id; a repeated request id inside is deduplicated; a
    batch inside a batch and a malformed one are refused without an exception."""
    log = Log()
    sub = {"k": "submit", "t": T0, "id": "a", "spec": spec(), "dg": b"x", "items": [None], "rid": "r1"}
    sub2 = {**sub, "id": "b", "dg": b"y", "rid": "r2"}
    out = log.apply({"k": "batch", "t": T0, "es": [sub, sub2, dict(sub), {"k": "cancel", "t": T0,
                                                                           "id": "a", "rid": "r3"}]})
    assert out["ok"] and [o["ok"] for o in out["outcomes"]] == [True, True, True, True]
    assert out["outcomes"][2] == out["outcomes"][0]  # r1 again: the first outcome
    assert set(log.table.jobs) == {"a", "b"} and log.table.jobs["a"].state == "cancelled"
    assert log.table.rids["r2"]["id"] == "b"
    nested = log.apply({"k": "batch", "t": T0, "es": [{"k": "batch", "t": T0, "es": [sub2]}]})
    assert nested["outcomes"][0]["ok"] is False
    assert log.apply({"k": "batch", "t": T0, "es": "nope"})["ok"] is False
    assert log.apply({"k": "batch", "t": T0, "es": []})["ok"] is False
    log.table.check()


def test_rid_bound_to_its_fingerprint() -> None:
    """Request ids: a rid seen with one fingerprint and now with another is refused with 422 and
    changes nothing; the same fingerprint (or none, from an older member) replays the outcome."""
    log = Log()
    log.submit("j1", n=2)
    log.submit("j2", n=1)
    first = log.apply({"k": "tone", "t": T0, "id": "j1", "priority": 4, "rid": "K", "fp": "a" * 32})
    assert first["ok"]
    before = state_without_counts(log.table)
    other = log.apply({"k": "cancel", "t": T0, "id": "j2", "rid": "K", "fp": "b" * 32})
    assert not other["ok"] and other["status"] == 422 and other["reason"] == "rid_reused"
    assert state_without_counts(log.table) == before
    same = log.apply({"k": "tone", "t": T0 + 1, "id": "j1", "priority": 4, "rid": "K", "fp": "a" * 32})
    assert same["ok"] and same.get("fp") == "a" * 32
    unbound = log.apply({"k": "cancel", "t": T0, "id": "j2", "rid": "K"})
    assert unbound["ok"] and state_without_counts(log.table) == before
    assert log.apply({"k": "cancel", "t": T0, "id": "j2", "rid": "Z", "fp": 7})["reason"] == "malformed"
    # The binding is part of a snapshot.
    assert JobTable.from_state(log.table.to_state()).rids["K"]["fp"] == "a" * 32


def test_tombstones_bounded_oldest_dropped_first(monkeypatch: pytest.MonkeyPatch) -> None:
    """forget: at most forgotten_ids_max tombstones are kept, the oldest dropped first (and
    counted); a dropped id reads as unknown and may be submitted again; the order of the
    tombstones survives a snapshot, so every member drops the same one next."""
    monkeypatch.setattr(limits, "forgotten_ids_max", 2)
    log = Log()
    for jid in ("a1", "b2", "c3"):
        log.submit(jid)
        _, e = log.lease((jid, 0))
        log.result(row(jid, 0, e))
        assert log.op("forget", jid)["ok"]
    assert list(log.table.forgotten) == ["b2", "c3"]
    assert log.counts()["tombstones_dropped"] == 1
    assert refusal(log.op("cancel", "a1")) == (False, 404, "unknown_job")
    assert refusal(log.op("cancel", "b2")) == (False, 404, "forgotten")
    assert refusal(log.submit("b2")) == (False, 409, "forgotten")
    raw = msgpack.packb(log.table.to_state(), use_bin_type=True)
    t2 = JobTable.from_state(msgpack.unpackb(raw, raw=False, strict_map_key=False))
    assert list(t2.forgotten) == ["b2", "c3"]
    assert log.submit("a1", dg=b"new")["new"] is True
    log.table.check()


def test_result_names_its_copies() -> None:
    """result: a twelfth field names the other members that hold the outputs; the table keeps it
    (one shared tuple per set of members), shows it as the item's `copies`, keeps it through a
    snapshot; malformed holders make the row malformed."""
    log = Log()
    log.submit(n=3)
    _, e = log.lease(("j1", 0), ("j1", 1), ("j1", 2))
    out = log.result([*row("j1", 0, e, out=digest(1)), None, ["m2"]],
                     [*row("j1", 1, e, FAILED, rc=None), "could not start", ["m2"]],
                     row("j1", 2, e))
    assert out["accepted"] == 3
    job = log.job()
    assert job.held[0] == ("m2",) and job.held[0] is job.held[1] and job.held[2] is None
    assert [it["copies"] for it in log.table.record(job, items=True)["items"]] == [
        ["m2"], ["m2"], []]
    raw = msgpack.packb(log.table.to_state(), use_bin_type=True)
    t2 = JobTable.from_state(msgpack.unpackb(raw, raw=False, strict_map_key=False))
    assert t2.jobs["j1"].held == [("m2",), ("m2",), None]
    assert msgpack.packb(t2.to_state(), use_bin_type=True) == raw
    log.submit("j2")
    _, e = log.lease(("j2", 0))
    for bad in (["m2", 5], "m2", [""], ["m"] * (limits.result_holders_max + 1), ["x" * 65]):
        out = log.result([*row("j2", 0, e), None, bad])
        assert out == {"ok": True, "accepted": 0, "refused": 1}, bad
    out = log.result([*row("j2", 0, e), 7, ["m2"]])
    assert out["refused"] == 1
