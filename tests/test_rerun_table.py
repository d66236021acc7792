"""Unit tests of re-running finished jobs in the job table (meshjobs/reruns.py): the `rerun`
entry from a client, automatic restart and resubmit, cancel stopping them, snapshots, and the
control parsing of the new keys."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest

from meshjobs import limits
from meshjobs.control import ControlError, parse_request, parse_rerun, parse_submit
from meshjobs.table import DONE, FAILED, TIMEOUT, JobTable
from tests.helpers import T0, Log, refusal, row


def run_all(log: Log, job_id: str = "j1", states: tuple[int, ...] = (DONE,), t: int = T0) -> None:
    """Lease every pending item of the job and end them with `states` (cycled)."""
    job = log.job(job_id)
    items = list(job.queue)
    _, epoch = log.lease(*[(job_id, i) for i in items], t=t)
    rows = [row(job_id, i, epoch, states[k % len(states)], rc=0 if states[k % len(states)] == DONE
                else 1) for k, i in enumerate(items)]
    assert log.result(*rows, t=t)["accepted"] == len(items)


def roundtrip(table: JobTable) -> JobTable:
    s = msgpack.unpackb(msgpack.packb(table.to_state(), use_bin_type=True), raw=False,
                        strict_map_key=False)
    return JobTable.from_state(s)


def test_rerun_whole_job_new_attempts_and_past_kept() -> None:
    """A finished job reruns: every item pending again, attempts counted on, the earlier run
    kept in the record and handed to the history hook."""
    log = Log()
    seen: list[tuple[str, str]] = []
    log.table.on_forget = lambda rec, why, t, index: seen.append((rec["id"], why))
    log.submit(n=3)
    run_all(log)
    assert log.job().state == "done"
    out = log.op("rerun", rid="r1")
    assert out["ok"] and out["run"] == 2 and out["items"] == 3
    job = log.job()
    assert job.state == "queued" and job.n_pending == 3 and not job.finished
    assert list(job.attempts) == [1, 1, 1]
    rec = log.table.record(job, items=True)
    assert rec["run"] == 2 and rec["previous_runs"][0]["state"] == "done"
    assert all(it["stdout"] is None and it["rc"] is None for it in rec["items"])
    assert seen == [("j1", "rerun")]
    run_all(log)
    assert list(job.attempts) == [2, 2, 2] and log.job().state == "done"
    log.table.check()


def test_rerun_failed_only() -> None:
    """--failed-only: only failed, timed-out and cancelled items run again."""
    log = Log()
    log.submit(n=3)
    run_all(log, states=(DONE, FAILED, TIMEOUT))
    assert log.job().state == "failed"
    out = log.op("rerun", failed_only=True)
    assert out["ok"] and out["items"] == 2
    job = log.job()
    assert list(job.queue) == [1, 2] and job.st[0] == DONE
    log.table.check()


def test_rerun_failed_only_nothing_to_do() -> None:
    log = Log()
    log.submit(n=2)
    run_all(log)
    assert refusal(log.op("rerun", failed_only=True)) == (False, 409, "nothing_to_rerun")


def test_rerun_refusals() -> None:
    """Not finished: 409 saying to wait or cancel; unknown: 404; dep_failed: 409; garbage: 400."""
    log = Log()
    log.submit(n=1)
    out = log.op("rerun")
    assert refusal(out) == (False, 409, "not_finished") and "cancel" in out["error"]
    assert refusal(log.op("rerun", "nope-nope")) == (False, 404, "unknown_job")
    assert refusal(log.op("rerun", failed_only="yes")) == (False, 400, "malformed")
    assert refusal(log.op("rerun", auto="later", run=1)) == (False, 400, "malformed")
    assert refusal(log.op("rerun", 17)) == (False, 400, "malformed")
    log.op("cancel")
    log.submit("kid", dg=b"dg-2", after=[{"id": "j1", "on": "ok"}])
    assert log.job("kid").state == "dep_failed"
    assert refusal(log.op("rerun", "kid")) == (False, 409, "dep_failed")
    # A cancelled job reruns (its settled dependents stay settled).
    assert log.op("rerun")["ok"]
    assert log.job("kid").state == "dep_failed"
    log.table.check()


def test_rerun_rid_is_idempotent() -> None:
    log = Log()
    log.submit(n=1)
    run_all(log)
    first = log.op("rerun", rid="k1")
    again = log.op("rerun", rid="k1")
    assert first == again and log.job().run == 2


def test_restart_due_then_rerun_and_never_more_than_n() -> None:
    """restart 2 with a delay: due at end + delay, each rerun once, never a third."""
    log = Log()
    log.submit(n=1, restart=2, restart_delay_s=5.0)
    for k in range(2):
        run_all(log, t=T0 + k * 10_000)
        job = log.job()
        assert job.due_ms == job.finished_ms + 5_000 and job.due_why == "restart"
        # Not due yet at the entry's time: refused, nothing changes.
        early = log.op("rerun", auto="restart", run=job.run, t=job.due_ms - 1)
        assert refusal(early) == (False, 409, "stale_rerun")
        out = log.op("rerun", auto="restart", run=job.run, t=job.due_ms)
        assert out["ok"]
        # The same entry proposed again (a retry, a new leader): stale.
        assert refusal(log.op("rerun", auto="restart", run=job.run - 1, t=job.due_ms)) == (
            False, 409, "stale_rerun")
    run_all(log, t=T0 + 50_000)
    job = log.job()
    assert job.state == "done" and job.due_ms == 0 and job.restarts == 2 and job.run == 3
    assert log.table.record(job)["restarts"] == 2
    log.table.check()


def test_restart_not_after_failure_resubmit_is() -> None:
    """restart runs again only after done; resubmit after done or failed, up to N times."""
    log = Log()
    log.submit(n=1, restart=3)
    run_all(log, states=(FAILED,))
    assert log.job().due_ms == 0
    log.submit("j2", n=1, dg=b"dg-2", resubmit=1)
    run_all(log, "j2", states=(FAILED,))
    job = log.job("j2")
    # No delay asked: the minimum (reruns.py Rule 6).
    assert job.due_why == "resubmit"
    assert job.due_ms == job.finished_ms + limits.restart_delay_s_min * 1000
    assert log.op("rerun", "j2", auto="resubmit", run=1, t=job.due_ms)["ok"]
    run_all(log, "j2", states=(FAILED,))
    assert log.job("j2").due_ms == 0 and log.job("j2").resubmits == 1
    log.table.check()


def test_cancel_stops_restarting() -> None:
    """A cancel during the delay drops the due restart (the job stays done); a cancel of a
    running job with restart ends it cancelled, never restarted."""
    log = Log()
    log.submit(n=1, restart="forever", restart_delay_s=60.0)
    run_all(log)
    assert log.job().due_ms
    assert log.op("cancel")["ok"]
    job = log.job()
    assert job.due_ms == 0 and job.state == "done"
    assert refusal(log.op("rerun", auto="restart", run=1, t=T0 + 120_000)) == (
        False, 409, "stale_rerun")
    # A second cancel: nothing to cancel any more.
    assert refusal(log.op("cancel")) == (False, 409, "finished")
    log.submit("j2", n=1, dg=b"dg-2", restart="forever")
    log.op("cancel", "j2")
    assert log.job("j2").due_ms == 0
    log.table.check()


def test_due_rerun_survives_snapshot_and_blocks_expiry() -> None:
    log = Log()
    log.submit(n=2, restart=1, restart_delay_s=1.0)
    run_all(log)
    log.apply({"k": "expire", "t": T0 + 10**6, "ids": ["j1"]})
    assert "j1" in log.table.jobs
    t2 = roundtrip(log.table)
    assert t2.due == log.table.due and t2.jobs["j1"].due_why == "restart"
    assert t2.record(t2.jobs["j1"]) == log.table.record(log.job())
    log.op("rerun", auto="restart", run=1, t=T0 + 2_000)
    t3 = roundtrip(log.table)
    assert t3.jobs["j1"].run == 2 and t3.jobs["j1"].past == log.job().past


def test_past_runs_bounded() -> None:
    log = Log()
    log.submit(n=1)
    for _ in range(limits.job_runs_kept_max + 3):
        run_all(log)
        assert log.op("rerun")["ok"]
    assert len(log.job().past) == limits.job_runs_kept_max
    log.table.check()


def test_planted_overrun_is_caught_by_check() -> None:
    """check() catches a restart count over N."""
    log = Log()
    log.submit(n=1, restart=1)
    log.job().restarts = 2
    log.job().run = 3
    with pytest.raises(AssertionError, match="restarted"):
        log.table.check()


# --- control: the new keys and the rerun request --------------------------------------------

BAD_SPECS: list[dict[str, Any]] = [
    {"restart": 0}, {"restart": -1}, {"restart": True}, {"restart": "always"},
    {"restart": 1.5}, {"restart": limits.restart_max + 1}, {"restart": [1]},
    {"resubmit": 0}, {"resubmit": "forever"}, {"resubmit": False},
    {"resubmit": limits.resubmit_max + 1},
    {"restart": 1, "restart_delay_s": -1}, {"restart": 1, "restart_delay_s": float("nan")},
    {"restart": 1, "restart_delay_s": "5"}, {"restart": 1, "restart_delay_s": True},
    {"restart": 1, "restart_delay_s": limits.restart_delay_s_max + 1},
    {"restart_delay_s": 5},
    {"stdout": ""}, {"stdout": "out/"}, {"stdout": "../x"}, {"stdout": "a/../b"},
    {"stdout": "x\x00y"}, {"stdout": "x\ny"}, {"stdout": "o{i}"}, {"stdout": "o{index"},
    {"stderr": 5}, {"stderr": "e" * (limits.output_path_chars_max + 1)},
]


@pytest.mark.parametrize("bad", BAD_SPECS)
def test_bad_rerun_keys_refused(bad: dict) -> None:
    with pytest.raises(ControlError) as ei:
        parse_submit({"argv": ["x"], **bad})
    assert ei.value.status == 400


def test_rerun_keys_normalized() -> None:
    spec = parse_submit({"argv": ["x"], "restart": "forever", "restart_delay_s": 2,
                         "resubmit": 3, "stdout": "out-{index}.txt", "stderr": "/tmp/e"})
    assert spec["restart_delay_s"] == 2.0 and isinstance(spec["restart_delay_s"], float)
    assert parse_submit({**spec, "id": None}) == spec
    # Without them, a spec is as it was (its digest unchanged).
    assert not {"restart", "resubmit", "stdout", "stderr"} & set(parse_submit({"argv": ["x"]}))


@pytest.mark.parametrize("body", [[], "x", 1, {"failed_only": 1}, {"failed_only": "true"},
                                  {"failed": True}, {"failed_only": None, "x": 1}])
def test_bad_rerun_request(body: Any) -> None:
    with pytest.raises(ControlError):
        parse_rerun(body)


def test_rerun_request_parsed() -> None:
    assert parse_rerun(None) == {"failed_only": False}
    req = parse_request({"op": "rerun", "rid": "r", "id": "j1", "failed_only": True})
    assert req["failed_only"] is True and req["id"] == "j1"
    with pytest.raises(ControlError):
        parse_request({"op": "rerun", "rid": "r", "id": "../x"})


def test_rerun_of_a_job_cancelled_while_waiting_waits_again() -> None:
    """A dependent cancelled while it waited (its items never ran) is judged again at a rerun:
    it waits for the parent not ended yet, and runs only once the parent allows; a parent that
    ended the wrong way, or is gone, refuses the rerun. One whose items ran is not judged again."""
    log = Log()
    log.submit("p", n=1)
    log.submit("kid", n=1, dg=b"dg-2", after=[{"id": "p", "on": "ok"}])
    assert log.op("cancel", "kid")["ok"]
    assert log.op("rerun", "kid")["ok"]
    kid = log.job("kid")
    assert kid.state == "waiting" and kid.waiting_on == {"p": "ok"} and "kid" not in log.table.ready
    run_all(log, "p")
    assert log.job("kid").state == "queued"
    run_all(log, "kid")
    log.submit("p2", n=1, dg=b"dg-3")
    run_all(log, "p2", states=(FAILED,))
    log.submit("kid2", n=1, dg=b"dg-4", after=[{"id": "p2", "on": "end"}])
    log.op("cancel", "kid2")
    # kid2's parent ended failed, and kid2 waits for its end: judged at the rerun, it runs.
    assert log.op("rerun", "kid2")["ok"] and log.job("kid2").state == "queued"
    log.op("cancel", "kid2")
    log.submit("p3", n=1, dg=b"dg-5")
    log.submit("kid3", n=1, dg=b"dg-6", after=[{"id": "p3", "on": "ok"}])
    log.op("cancel", "kid3")
    run_all(log, "p3", states=(FAILED,))
    assert refusal(log.op("rerun", "kid3")) == (False, 409, "dep_failed")
    log.op("forget", "p3")
    assert refusal(log.op("rerun", "kid3")) == (False, 409, "bad_after")
    # A dependent whose items ran: its parent's consent stands, even with the parent gone.
    log.op("forget", "p")
    assert log.op("rerun", "kid")["ok"] and log.job("kid").state == "queued"
    log.table.check()


# --- restarts bounded (reruns.py Rule 6) ------------------------------------------------------


def test_a_spec_with_no_delay_waits_the_minimum() -> None:
    """Rule 6: a spec committed with restart_delay_s 0 (before the minimum existed) re-runs
    after restart_delay_s_min, not at once; the rerun entry before that is stale."""
    log = Log()
    log.submit(n=1, restart="forever", restart_delay_s=0.0)
    run_all(log)
    job = log.job()
    assert job.due_ms == job.finished_ms + limits.restart_delay_s_min * 1000
    early = log.op("rerun", auto="restart", run=1, t=job.due_ms - 1)
    assert refusal(early) == (False, 409, "stale_rerun")
    assert log.op("rerun", auto="restart", run=1, t=job.due_ms)["ok"]
    log.table.check()


def test_restarts_per_minute_capped_on_the_simulated_clock() -> None:
    """Rule 6: a `true` job with restart forever and the shortest delay, re-run as soon as each
    re-run is due (a leader with no lag), has at most restarts_per_minute_max automatic re-runs
    in any minute; past the cap the next one is due when the oldest leaves the window, and its
    record says why (rerun_wait). The times survive a snapshot."""
    cap, window = limits.restarts_per_minute_max, limits.restarts_window_ms
    log = Log()
    log.submit(n=1, restart="forever", restart_delay_s=float(limits.restart_delay_s_min))
    t = T0
    times: list[int] = []
    for k in range(3 * cap + 2):
        run_all(log, t=t)
        job = log.job()
        rec = log.table.record(job)
        if k >= cap and len(times) >= cap and times[-cap] + window > job.finished_ms + 1000:
            assert job.due_ms == times[-cap] + window, k
            assert rec["rerun_wait"] == "restarts_per_minute_max"
            # A proposal at its delay (the cap ignored) is stale.
            assert refusal(log.op("rerun", auto="restart", run=job.run,
                                  t=job.finished_ms + 1000)) == (False, 409, "stale_rerun")
        else:
            assert rec["rerun_wait"] is None
        if k == cap:
            t2 = roundtrip(log.table)
            assert t2.jobs["j1"].rerun_times == job.rerun_times
            assert t2.record(t2.jobs["j1"]) == rec
        t = job.due_ms
        assert log.op("rerun", auto="restart", run=job.run, t=t)["ok"]
        times.append(t)
        log.table.check()
    for i, start in enumerate(times):
        assert sum(1 for x in times[i:] if x < start + window) <= cap, (i, times)
    assert times[-1] - times[0] >= 2 * window  # 3 * cap + 2 re-runs took over two minutes


def test_resubmits_count_in_the_cap_too() -> None:
    """Rule 6 counts resubmits with restarts: a job of resubmit 100 that fails at once re-runs
    at most restarts_per_minute_max times a minute."""
    log = Log()
    log.submit(n=1, resubmit=limits.resubmit_max)
    t = T0
    times = []
    for _ in range(limits.restarts_per_minute_max + 1):
        run_all(log, states=(FAILED,), t=t)
        t = log.job().due_ms
        assert log.op("rerun", auto="resubmit", run=log.job().run, t=t)["ok"]
        times.append(t)
    assert times[-1] >= times[0] + limits.restarts_window_ms
    log.table.check()


def test_planted_cap_overrun_is_caught_by_check() -> None:
    """check() catches a re-run due sooner than the cap allows."""
    log = Log()
    log.submit(n=1, restart="forever")
    t = T0
    for _ in range(limits.restarts_per_minute_max):
        run_all(log, t=t)
        t = log.job().due_ms
        log.op("rerun", auto="restart", run=log.job().run, t=t)
    run_all(log, t=t)
    job = log.job()
    job.due_ms = job.finished_ms + 1000
    log.table.due["j1"] = job.due_ms
    with pytest.raises(AssertionError, match=f"past {limits.restarts_per_minute_max} in a minute"):
        log.table.check()


@pytest.mark.parametrize("delay", [0, 0.0, 0.5, limits.restart_delay_s_min - 0.001])
def test_a_new_submit_under_the_minimum_delay_is_refused(delay: float) -> None:
    """A request (a submit, or a schedule's job) asking for less than restart_delay_s_min is
    400, naming the minimum; the minimum itself and no delay at all are taken."""
    for ask in ({"op": "submit", "rid": "r", "items": [None],
                 "spec": {"argv": ["true"], "restart": "forever", "restart_delay_s": delay}},
                {"op": "cron", "action": "add", "name": "c", "rid": "r", "spec": "@every 1m",
                 "job": {"argv": ["true"], "restart": 1, "restart_delay_s": delay}}):
        with pytest.raises(ControlError) as ei:
            parse_request(ask)
        assert ei.value.status == 400 and "restart_delay_s_min" in ei.value.message
        assert f"at least {limits.restart_delay_s_min}" in ei.value.message
    for ok in (limits.restart_delay_s_min, None):
        spec = {"argv": ["true"], "restart": "forever",
                **({} if ok is None else {"restart_delay_s": ok})}
        assert parse_request({"op": "submit", "rid": "r", "items": [None], "spec": spec})
