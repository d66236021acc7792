"""Schedules (issue 12 point 7) in the pure parts: the spec language and due times of
meshjobs/cron.py (cron's own meaning: lists, ranges, steps, names, Feb 29, the day-of-month OR
day-of-week rule), the requests that carry them, and the table's "cron" entries: add, replace,
pause, resume, rm, and fires that make one job per due time whoever proposes them how often.
"""

from __future__ import annotations

import datetime as dt
import random
from typing import Any

import msgpack
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from meshjobs import auth, cron, limits
from meshjobs.control import ControlError, parse_request
from meshjobs.cron import CronError, Schedule
from meshjobs.node import View
from meshjobs.node.events import spec_digest
from meshjobs.node.feed import named_jobs
from meshjobs.table import DONE, JobTable
from tests.helpers import Log, row

JOB = {"argv": ["echo", "hi"], "pool": "default", "priority": 0, "retries": 0, "runtime_s": None,
       "hold": False, "tags": [], "env": {}, "cwd": None, "max_leases": None}


def ms(text: str) -> int:
    """Milliseconds since the epoch of an ISO time in UTC."""
    return int(dt.datetime.fromisoformat(text).replace(tzinfo=dt.UTC).timestamp() * 1000)


def iso(t: int | None) -> str | None:
    return None if t is None else dt.datetime.fromtimestamp(t / 1000, dt.UTC).strftime("%Y-%m-%dT%H:%M:%S")


# --- the spec language ---------------------------------------------------------------------

NEXT = [
    # (spec, after, the next due time): the first due time strictly after
    ("* * * * *", "2026-12-01T06:30:00", "2026-12-01T06:31:00"),
    ("* * * * *", "2026-12-01T06:30:59", "2026-12-01T06:31:00"),
    ("30 6 * * *", "2026-12-01T06:29:00", "2026-12-01T06:30:00"),
    ("30 6 * * *", "2026-12-01T06:30:00", "2026-12-02T06:30:00"),
    ("59 23 31 12 *", "2026-12-31T23:59:00", "2027-12-31T23:59:00"),
    ("0 0 1 1 *", "2026-12-31T23:59:30", "2027-01-01T00:00:00"),
    ("*/15 * * * *", "2026-12-01T06:31:00", "2026-12-01T06:45:00"),
    ("10-30/10 * * * *", "2026-12-01T06:31:00", "2026-12-01T07:10:00"),
    ("5/20 * * * *", "2026-12-01T06:26:00", "2026-12-01T06:45:00"),  # N/STEP: N to the end
    ("0,30 9-17/4 * * *", "2026-12-01T09:31:00", "2026-12-01T13:00:00"),
    ("0 0 29 2 *", "2026-12-01T00:00:00", "2028-02-29T00:00:00"),  # Feb 29: the next leap year
    ("0 0 29 2 *", "2096-03-01T00:00:00", "2104-02-29T00:00:00"),  # 2100 is no leap year
    ("0 0 31 * *", "2026-04-01T00:00:00", "2026-05-31T00:00:00"),  # April has no 31st
    ("0 12 * * mon", "2026-12-01T13:00:00", "2026-12-07T12:00:00"),  # Dec 1 2026 is a Tuesday
    ("0 12 * * 0", "2026-12-01T13:00:00", "2026-12-06T12:00:00"),
    ("0 12 * * 7", "2026-12-01T13:00:00", "2026-12-06T12:00:00"),  # 7 is Sunday too
    ("0 12 * * SAT-sun", "2026-12-01T13:00:00", "2026-12-05T12:00:00"),  # a range may end on sun
    ("0 12 * * fri-0", "2026-12-05T13:00:00", "2026-12-06T12:00:00"),
    # Both day fields restricted: either matches (the 15th, or a Friday).
    ("0 0 15 * fri", "2026-12-01T00:00:00", "2026-12-04T00:00:00"),
    ("0 0 15 * fri", "2026-12-12T00:00:00", "2026-12-15T00:00:00"),
    ("0 0 15 * fri", "2026-12-15T00:00:00", "2026-12-18T00:00:00"),
    # A day field starting with * counts as unrestricted, steps included (Vixie cron).
    ("0 0 */2 * fri", "2026-12-01T00:00:00", "2026-12-04T00:00:00"),
    ("0 0 15 * */1", "2026-12-01T00:00:00", "2026-12-15T00:00:00"),
    ("0 0 1 jan,JUL *", "2026-12-01T00:00:00", "2027-01-01T00:00:00"),
    ("0 0 1 feb-mar/1 *", "2026-12-01T00:00:00", "2027-02-01T00:00:00"),
    ("@hourly", "2026-12-01T06:30:00", "2026-12-01T07:00:00"),
    ("@daily", "2026-12-01T06:30:00", "2026-12-02T00:00:00"),
    ("@midnight", "2026-12-01T06:30:00", "2026-12-02T00:00:00"),
    ("@weekly", "2026-12-01T06:30:00", "2026-12-06T00:00:00"),
    ("@monthly", "2026-12-01T06:30:00", "2027-01-01T00:00:00"),
    ("@yearly", "2026-12-01T06:30:00", "2027-01-01T00:00:00"),
    ("@ANNUALLY", "2026-12-01T06:30:00", "2027-01-01T00:00:00"),
    ("@every 30s", "2026-12-01T06:30:10", "2026-12-01T06:30:30"),
    ("@every 30s", "2026-12-01T06:30:30", "2026-12-01T06:31:00"),
    ("@every 1h30m", "2026-12-01T06:30:00", "2026-12-01T07:30:00"),
    ("@every 2d", "2026-12-01T06:30:00", "2026-12-03T00:00:00"),
    ("  */5   *  * * *  ", "2026-12-01T06:31:00", "2026-12-01T06:35:00"),
]


@pytest.mark.parametrize(("spec", "after", "due"), NEXT)
def test_next_after(spec: str, after: str, due: str) -> None:
    """Rule 2 and 3: the first due time strictly after a time, as cron means the fields."""
    assert iso(Schedule.parse(spec).next_after(ms(after))) == due


LATEST = [
    # (spec, at, the latest due time at or before)
    ("30 6 * * *", "2026-12-01T06:30:00", "2026-12-01T06:30:00"),
    ("30 6 * * *", "2026-12-01T06:29:59", "2026-11-30T06:30:00"),
    ("0 0 29 2 *", "2026-12-01T00:00:00", "2024-02-29T00:00:00"),
    ("0 0 1 1 *", "2027-01-01T00:00:30", "2027-01-01T00:00:00"),
    ("0 0 15 * fri", "2026-12-14T00:00:00", "2026-12-11T00:00:00"),
    ("0 0 31 * *", "2026-05-01T00:00:00", "2026-03-31T00:00:00"),
    ("*/15 9-17 * * mon-fri", "2026-12-07T08:00:00", "2026-12-04T17:45:00"),
    ("@every 30s", "2026-12-01T06:30:29", "2026-12-01T06:30:00"),
    ("@every 30s", "2026-12-01T06:30:30", "2026-12-01T06:30:30"),
]


@pytest.mark.parametrize(("spec", "at", "due"), LATEST)
def test_latest_upto(spec: str, at: str, due: str) -> None:
    """The latest due time at or before a time (what a leader fires after a gap)."""
    assert iso(Schedule.parse(spec).latest_upto(ms(at))) == due


SPECS = ["* * * * *", "*/7 3,5 * * *", "0 0 29 2 *", "0 0 15 * fri", "0 0 */3 * mon",
         "10-50/20 */5 1-10 */2 *", "0 12 L * *".replace("L", "31"), "0 0 * feb sun",
         "@every 45s", "@every 1h", "@weekly", "0 0 1,15 * 3"]


def brute_next(s: Schedule, t: int) -> int:
    """The next due time by looking at every minute (the definition itself)."""
    m = (t // 60_000 + 1) * 60_000
    while True:
        d = dt.datetime.fromtimestamp(m / 1000, dt.UTC)
        if (d.minute in s.minutes and d.hour in s.hours and d.month in s.months
                and s._day_ok(d)):
            return m
        m += 60_000


@settings(max_examples=60, deadline=None)
@given(spec=st.sampled_from([s for s in SPECS if not s.startswith("@every")]),
       t=st.integers(min_value=ms("2000-01-01T00:00:00"), max_value=ms("2090-01-01T00:00:00")))
def test_next_matches_minute_by_minute(spec: str, t: int) -> None:
    """The field walk gives what trying each minute gives (specs due at least monthly)."""
    s = Schedule.parse(spec)
    if spec in ("0 0 29 2 *",):
        return
    assert s.next_after(t) == brute_next(s, t)


@settings(max_examples=150, deadline=None)
@given(spec=st.sampled_from(SPECS),
       t=st.integers(min_value=ms("1990-01-01T00:00:00"), max_value=ms("2200-01-01T00:00:00")))
def test_next_and_latest_agree(spec: str, t: int) -> None:
    """latest_upto(t) <= t < next_after(t), nothing due between them, and each is a due time
    of the other's walk."""
    s = Schedule.parse(spec)
    lo, hi = s.latest_upto(t), s.next_after(t)
    assert lo is not None and hi is not None
    assert lo <= t < hi
    assert s.next_after(lo) == hi or s.next_after(lo) <= t
    assert s.latest_upto(hi) == hi and s.latest_upto(hi - 1) == lo
    assert hi % 1000 == 0 and lo % 1000 == 0


BAD = [
    ("", "empty"), ("* * * *", "4 fields, not 5"), ("* * * * * *", "6 fields, not 5"),
    ("60 * * * *", "minute field: 60 is out of range 0-59"),
    ("* 24 * * *", "hour field: 24 is out of range 0-23"),
    ("* * 0 * *", "day of month field: 0 is out of range 1-31"),
    ("* * * 13 *", "month field: 13 is out of range 1-12"),
    ("* * * * 8", "day of week field: 8 is out of range 0-7"),
    ("* * * foo *", "'foo' is not a number from 1 to 12 or a name (jan"),
    ("* * * * funday", "or a name (sun"),
    ("*/0 * * * *", "the step after '/' must be a number"),
    ("*/ * * * *", "the step after '/' must be a number"),
    ("5-1 * * * *", "a range must go up (5 > 1)"),
    ("1,,2 * * * *", "an empty list entry"),
    ("-1 * * * *", "'' is not a number"),
    ("١ * * * *", "is not a number"),
    ("0 0 30 2 *", "is never due"), ("0 0 31 4,6,9,11 *", "is never due"),
    ("@reboot", "@reboot is not supported"), ("@daily 5", "unknown spec"), ("@often", "unknown spec"),
    ("@every", "write a duration"), ("@every 5", "write a duration"), ("@every 5x", "write a duration"),
    ("@every -5s", "write a duration"), ("@every 0s", "from 1s to 366d"),
    ("@every 367d", "from 1s to 366d"), ("@every 9999999999s", "write a duration"),
    ("x" * (limits.cron_spec_chars_max + 1), "longer than"),
]


@pytest.mark.parametrize(("spec", "words"), BAD)
def test_invalid_specs_say_what_to_write(spec: str, words: str) -> None:
    """Rule 4: a bad spec is one CronError, naming the problem and what to write instead."""
    with pytest.raises(CronError) as e:
        Schedule.parse(spec)
    assert words in str(e.value)
    assert "@every" in str(e.value) or "write" in str(e.value) or "period" in str(e.value)


def test_not_a_string() -> None:
    for value in (None, 5, ["* * * * *"], b"* * * * *"):
        with pytest.raises(CronError, match="must be a string"):
            Schedule.parse(value)


def test_feb_29_with_a_weekday_is_either() -> None:
    """Both day fields restricted: Feb 29 or any Monday of February (cron's OR), so it is
    due every year, not only when Feb 29 is a Monday."""
    s = Schedule.parse("0 0 29 2 mon")
    assert iso(s.next_after(ms("2027-01-01T00:00:00"))) == "2027-02-01T00:00:00"
    assert iso(s.next_after(ms("2028-02-28T00:00:00"))) == "2028-02-29T00:00:00"


def test_run_ids_are_the_name_and_due_time() -> None:
    """A run's id is made of the name and the due time only (seconds: @every 30s differs)."""
    assert cron.run_id("nightly", ms("2026-12-01T06:30:00")) == "cron-nightly-20261201T063000"
    assert cron.run_id("n", ms("2026-12-01T06:30:30")) == "cron-n-20261201T063030"
    longest = cron.run_id("x" * limits.cron_name_chars_max, ms("2999-12-31T23:59:59"))
    assert len(longest) <= limits.job_id_chars_max


# --- requests --------------------------------------------------------------------------------


def test_parse_add_normalizes() -> None:
    got = cron.parse_add({"spec": " @every  30s ", "job": {"argv": ["x"], "tags": ["a", "a"]}})
    assert got["spec"] == "@every 30s" and got["job"]["tags"] == ["a"]
    assert (got["catch_up"], got["overlap"], got["replace"]) == ("latest", "allow", True)
    assert "id" not in got["job"]
    assert cron.parse_job(got["job"]) == got["job"]  # a fixed point: the table checks so


@pytest.mark.parametrize(("body", "words"), [
    (None, "must be a JSON object"), ([], "must be a JSON object"),
    ({"spec": "@daily"}, 'needs "spec"'), ({"job": {"argv": ["x"]}}, 'needs "spec"'),
    ({"spec": "@daily", "job": {"argv": ["x"]}, "x": 1}, "unknown key(s) in schedule: x"),
    ({"spec": "@daily", "job": "x"}, "job must be a JSON object"),
    ({"spec": "@daily", "job": {"argv": ["x"], "id": "a"}}, "may not have id"),
    ({"spec": "@daily", "job": {"argv": ["x"], "items": ["a"], "after": ["b"]}},
     "may not have after, items"),
    ({"spec": "@daily", "job": {"argv": []}}, "argv must be a non-empty list"),
    ({"spec": "@daily", "job": {"argv": ["x"]}, "catch_up": "all"}, "catch_up must be one of"),
    ({"spec": "@daily", "job": {"argv": ["x"]}, "overlap": True}, "overlap must be one of"),
    ({"spec": "@daily", "job": {"argv": ["x"]}, "replace": 1}, "replace must be true or false"),
    ({"spec": "61 * * * *", "job": {"argv": ["x"]}}, "minute field"),
    ({"spec": "@daily", "job": {"argv": ["x"], "member": "*"}}, "cannot fan out"),
    ({"spec": "@daily", "job": {"argv": ["x"], "pool": "default@*"}}, "cannot fan out"),
])
def test_parse_add_refuses(body: Any, words: str) -> None:
    with pytest.raises(ControlError) as e:
        cron.parse_add(body)
    assert e.value.status == 400 and words in e.value.message


@pytest.mark.parametrize("req", [
    {"op": "cron"}, {"op": "cron", "action": "explode", "name": "x"},
    {"op": "cron", "action": "get"}, {"op": "cron", "action": "get", "name": ".."},
    {"op": "cron", "action": "get", "name": "a/b"}, {"op": "cron", "action": "get", "name": 5},
    {"op": "cron", "action": "rm", "name": "x"},  # a change needs a request id
    {"op": "cron", "action": "rm", "name": "x", "rid": "r", "fp": "nothex"},
    {"op": "cron", "action": "add", "name": "x", "rid": "r"},
    {"op": "cron", "action": "pause", "name": "x" * (limits.cron_name_chars_max + 1), "rid": "r"},
])
def test_parse_request_refuses(req: dict) -> None:
    with pytest.raises(ControlError):
        parse_request(req)


def test_parse_request_and_entry() -> None:
    req = parse_request({"op": "cron", "action": "add", "name": "n", "rid": "r1",
                         "spec": "@hourly", "job": {"argv": ["x"]}, "overlap": "skip"})
    e = cron.entry(req, 5)
    assert e == {"k": "cron", "rid": "r1", "t": 5, "op": "add", "name": "n", "spec": "@hourly",
                 "job": {**cron.parse_job({"argv": ["x"]}), "submitted_by": "local"},
                 "catch_up": "latest", "overlap": "skip", "replace": True,
                 "by": "local", "br": "admin"}  # a request without by is the member's own
    assert parse_request({"op": "cron", "action": "list"}) == {"op": "cron", "action": "list"}


def test_schedules_need_the_submit_role() -> None:
    """Adding, pausing, resuming and removing a schedule need what a submit needs; reading
    them, read."""
    for method, route in (("PUT", "/cron/{name}"), ("DELETE", "/cron/{name}"),
                          ("POST", "/cron/{name}/pause"), ("POST", "/cron/{name}/resume")):
        assert auth.needed_role(method, route) == auth.needed_role("POST", "/jobs") == "submit"
    assert auth.needed_role("GET", "/cron") == auth.needed_role("GET", "/cron/{name}") == "read"


def test_run_digest_is_a_submits() -> None:
    assert cron.job_digest(JOB) == spec_digest(JOB, [None])


# --- the table -------------------------------------------------------------------------------


class CronLog(Log):
    def add(self, name: str = "n", spec: str = "@every 10s", t: int = 0, **kw: Any) -> dict:
        e = {"k": "cron", "t": t, "op": "add", "name": name, "spec": spec, "job": dict(JOB),
             "catch_up": "latest", "overlap": "allow", "replace": True, **kw}
        out = self.apply(e)
        self.table.check()
        return out

    def cron(self, op: str, name: str = "n", t: int = 0, **kw: Any) -> dict:
        out = self.apply({"k": "cron", "t": t, "op": op, "name": name, **kw})
        self.table.check()
        return out

    def fire(self, t: int, name: str = "n") -> dict:
        """What a leader does at time t: fire the due time cron.due names, if any."""
        d = cron.due(self.table.crons[name], t)
        assert d is not None, f"nothing due at {t}"
        return self.cron("fire", name, t, due=d)


BASE = ms("2026-12-01T06:00:00")


def test_fire_makes_one_job_per_due_time() -> None:
    """A fire submits the run under cron-NAME-TIME with the schedule's job spec; the same fire
    again (a retry, another leader) is refused as stale and makes nothing."""
    log = CronLog()
    assert log.add(t=BASE + 1) == {"ok": True, "cron": "n", "new": True}
    c = log.table.crons["n"]
    assert cron.due(c, BASE + 9_999) is None
    out = log.fire(BASE + 10_400)
    jid = "cron-n-20261201T060010"
    assert out == {"ok": True, "id": jid, "new": True, "cron": "n", "due": BASE + 10_000}
    job = log.job(jid)
    assert job.spec_fields() == JOB and job.n == 1 and job.stdin == [None]
    assert job.digest == spec_digest(JOB, [None])
    again = log.cron("fire", t=BASE + 10_500, due=BASE + 10_000)
    assert (again["ok"], again["reason"]) == (False, "cron_stale")
    assert len(log.table.jobs) == 1 and c.fired == 1 and c.last_id == jid
    assert named_jobs("cron", {}, out) == [jid]


def test_missed_runs_fire_the_latest_once() -> None:
    """After a gap (no leader for many due times) the leader fires the latest due time only:
    one job, not a burst; an older due time is refused."""
    log = CronLog()
    log.add(t=BASE)
    t = BASE + 95_000
    stale = log.cron("fire", t=t, due=BASE + 10_000)
    assert stale["reason"] == "cron_stale"
    out = log.fire(t)
    assert out["due"] == BASE + 90_000 and out["new"]
    assert cron.due(log.table.crons["n"], t) is None
    assert len(log.table.jobs) == 1


def test_catch_up_none_skips_a_late_run() -> None:
    """catch_up none: a run more than cron_late_ms_max late is not fired; the next one is."""
    log = CronLog()
    log.add(spec="@every 1h", t=BASE, catch_up="none")
    c = log.table.crons["n"]
    late = BASE + 3_600_000 + limits.cron_late_ms_max + 1
    assert cron.due(c, late) is None
    assert log.cron("fire", t=late, due=BASE + 3_600_000)["reason"] == "cron_stale"
    on_time = BASE + 3_600_000 + limits.cron_late_ms_max
    assert cron.due(c, on_time) == BASE + 3_600_000
    assert log.fire(BASE + 7_200_000 + 5)["due"] == BASE + 7_200_000


def test_overlap_skip_passes_over_while_the_last_runs() -> None:
    """overlap skip: a due time while the last run has not ended moves the cursor and makes no
    job; once it ended, the next due time fires. allow (the default) fires regardless."""
    log = CronLog()
    log.add(t=BASE, overlap="skip")
    first = log.fire(BASE + 10_000)["id"]
    out = log.fire(BASE + 20_000)
    assert out == {"ok": True, "cron": "n", "due": BASE + 20_000, "skipped": "overlap"}
    assert log.table.crons["n"].skipped == 1 and len(log.table.jobs) == 1
    _, epoch = log.lease((first, 0))
    log.result(row(first, 0, epoch, DONE))
    assert log.fire(BASE + 30_000)["new"]
    log2 = CronLog()
    log2.add(t=BASE)
    log2.fire(BASE + 10_000)
    assert log2.fire(BASE + 20_000)["new"]


def test_pause_resume_rm_replace() -> None:
    """Paused: nothing due, a fire refused; resumed: due times while paused are not fired;
    replaced: the new spec from then on, history kept; removed: its runs stay."""
    log = CronLog()
    log.add(t=BASE)
    log.fire(BASE + 10_000)
    assert log.cron("pause", t=BASE + 11_000) == {"ok": True, "cron": "n"}
    c = log.table.crons["n"]
    assert c.paused and cron.due(c, BASE + 50_000) is None
    assert log.cron("fire", t=BASE + 50_000, due=BASE + 50_000)["reason"] == "cron_stale"
    assert cron.record(c, BASE + 50_000)["next_due"] is None
    log.cron("resume", t=BASE + 55_000)
    assert cron.due(c, BASE + 55_000) is None
    assert cron.record(c, BASE + 55_000)["next_due"] == (BASE + 60_000) / 1000
    assert log.fire(BASE + 60_000)["due"] == BASE + 60_000
    assert log.add(t=BASE + 61_000, replace=False) == {"ok": True, "cron": "n", "new": False}
    conflict = log.add(spec="@every 1h", t=BASE + 62_000, replace=False)
    assert (conflict["status"], conflict["reason"]) == (409, "conflict")
    assert log.add(spec="@every 1h", t=BASE + 63_000)["new"] is False
    c = log.table.crons["n"]
    assert c.spec == "@every 1h" and c.fired == 2 and c.done_ms == BASE + 63_000
    assert log.cron("rm") == {"ok": True, "cron": "n", "removed": True}
    assert log.cron("rm")["status"] == 404 and log.cron("pause")["status"] == 404
    assert len(log.table.jobs) == 2


def test_a_taken_id_makes_no_second_job() -> None:
    """A run whose id a job already has (or had: forgotten) is not made again: a removed and
    re-added schedule fires no due time twice."""
    log = CronLog()
    log.add(t=BASE)
    jid = log.fire(BASE + 10_000)["id"]
    log.cron("rm", t=BASE + 10_001)
    log.add(t=BASE + 5_000)  # a cursor from an earlier clock: the due time comes again
    out = log.fire(BASE + 10_002)
    assert out == {"ok": True, "cron": "n", "due": BASE + 10_000, "id": jid, "new": False}
    assert len(log.table.jobs) == 1
    log.op("cancel", jid)
    log.op("forget", jid)
    log.cron("rm", t=BASE + 10_003)
    log.add(t=BASE + 5_000)
    assert log.fire(BASE + 10_004)["new"] is False and not log.table.jobs


def test_the_schedules_limit() -> None:
    log = CronLog()
    for i in range(limits.cron_schedules_max):
        log.table.crons[f"c{i}"] = cron.Cron(f"c{i}", "@daily", dict(JOB), "latest", "allow",
                                             created_ms=0, done_ms=0, version=1)
    log.index = 1
    log.table.applied_index = 1
    out = log.add(name="one-more")
    assert (out["status"], out["reason"]) == (409, "too_many")
    assert "meshctl cron rm" in out["error"]


@pytest.mark.parametrize("entry", [
    {"k": "cron", "t": 1, "op": "add"},
    {"k": "cron", "t": 1, "op": "add", "name": ".."},
    {"k": "cron", "t": 1, "op": "add", "name": "x" * 65},
    {"k": "cron", "t": 1, "op": "add", "name": "n", "spec": "@daily", "job": dict(JOB),
     "catch_up": "latest", "overlap": "sometimes"},
    {"k": "cron", "t": 1, "op": "add", "name": "n", "spec": "61 * * * *", "job": dict(JOB),
     "catch_up": "latest", "overlap": "allow"},
    {"k": "cron", "t": 1, "op": "add", "name": "n", "spec": " @daily", "job": dict(JOB),
     "catch_up": "latest", "overlap": "allow"},  # not normalized
    {"k": "cron", "t": 1, "op": "add", "name": "n", "spec": "@daily", "job": {"argv": ["x"]},
     "catch_up": "latest", "overlap": "allow"},  # not normalized
    {"k": "cron", "t": 1, "op": "add", "name": "n", "spec": "@daily",
     "job": {**JOB, "id": "x"}, "catch_up": "latest", "overlap": "allow"},
    {"k": "cron", "t": 1, "op": "add", "name": "n", "spec": 5, "job": dict(JOB),
     "catch_up": "latest", "overlap": "allow"},
    {"k": "cron", "t": 1, "op": "explode", "name": "n"},
    {"k": "cron", "t": 1, "op": "fire", "name": "n", "due": "soon"},
    {"k": "cron", "t": 1, "op": "fire", "name": "n", "due": True},
    {"k": "cron", "t": 1, "op": "fire", "name": "nope", "due": 0},
    {"k": "cron", "t": 1, "op": ["rm"], "name": "n"},
])
def test_garbage_entries_are_refusals(entry: dict) -> None:
    """Rule 2 of the table: a malformed cron entry is a recorded refusal, never an exception,
    and changes nothing."""
    log = CronLog()
    log.add(spec="@daily", t=0)
    before = log.table.to_state()["crons"]
    out = log.apply(entry)
    assert out["ok"] is False
    log.table.check()
    assert log.table.to_state()["crons"] == before


def test_snapshot_round_trip() -> None:
    """Schedules are in to_state/from_state (msgpack and back), and check holds after; a
    table without schedules has no "crons" key (older snapshots load unchanged)."""
    log = CronLog()
    assert "crons" not in log.table.to_state()
    log.add(t=BASE, overlap="skip")
    log.add(name="m", spec="0 6 * * mon-fri", t=BASE, catch_up="none")
    log.fire(BASE + 10_000)
    log.cron("pause", "m", t=BASE + 11_000)
    s = msgpack.unpackb(msgpack.packb(log.table.to_state(), use_bin_type=True), raw=False,
                        strict_map_key=False)
    t2 = JobTable.from_state(s)
    assert t2.to_state() == log.table.to_state()
    assert [cron.record(c, BASE) for c in t2.crons.values()] == \
        [cron.record(c, BASE) for c in log.table.crons.values()]
    assert cron.due(t2.crons["n"], BASE + 20_000) == BASE + 20_000


def test_check_catches_a_broken_schedule() -> None:
    log = CronLog()
    log.add(t=BASE)
    log.fire(BASE + 10_000)
    c = log.table.crons["n"]
    c.last_id = "cron-n-19700101T000000"
    with pytest.raises(AssertionError, match="last run's id"):
        log.table.check()
    c.last_id = cron.run_id("n", c.last_due_ms)
    c.done_ms = c.created_ms - 1
    with pytest.raises(AssertionError, match="cursor before its creation"):
        log.table.check()


def test_leaders_fire_each_due_time_once_whatever_they_propose() -> None:
    """Random leaders' clocks, repeats and stale proposals over many due times: every job made
    is a due time of the schedule, made once, and the cursor never goes back."""
    rng = random.Random(12)
    log = CronLog()
    log.add(spec="*/2 * * * *", t=BASE)
    c = log.table.crons["n"]
    t = BASE
    made: list[str] = []
    cursor = c.done_ms
    for _ in range(300):
        t += rng.choice([1_000, 30_000, 60_000, 400_000])
        d = cron.due(c, t)
        for due in ([d] if d is not None else []) + [rng.choice([BASE, t - 120_000, t])]:
            out = log.cron("fire", t=t + rng.randrange(0, 2), due=due)
            if out.get("new"):
                made.append(out["id"])
            assert c.done_ms >= cursor
            cursor = c.done_ms
    assert len(made) == len(set(made)) == len(log.table.jobs) == c.fired
    for jid in made:
        stamp = dt.datetime.strptime(jid.rsplit("-", 1)[1], "%Y%m%dT%H%M%S")
        assert stamp.minute % 2 == 0 and stamp.second == 0


def test_the_leader_wakes_for_the_next_due_time_never_now() -> None:
    """next_wake_ms is the first due time after now: a due time already past (its fire in
    flight, or too late for catch-up none) must not make the jobs thread spin."""
    log = CronLog()
    log.add(spec="@every 1h", t=BASE, catch_up="none")
    log.add(name="p", spec="@every 10s", t=BASE)
    log.cron("pause", "p", t=BASE)
    crons = list(log.table.crons.values())
    assert cron.next_wake_ms(crons, BASE + 5) == BASE + 3_600_000
    late = BASE + 3_600_000 + limits.cron_late_ms_max + 1
    assert cron.due(crons[0], late) is None
    assert cron.next_wake_ms(crons, late) == BASE + 7_200_000
    assert cron.next_wake_ms(crons, BASE + 3_600_000) == BASE + 7_200_000
    log.cron("pause", t=BASE)
    assert cron.next_wake_ms(crons, BASE) is None


# --- the leader (a node driven directly; tests/test_node.py's fleet of one) ------------------


def _fleet_with_schedule(spec: str = "@every 10s"):
    from tests.helpers import Fleet1

    f = Fleet1()
    f.ctl(1, {"op": "cron", "action": "add", "name": "n", "rid": "a1", "spec": spec,
              "job": {"argv": ["true"]}})
    f.take()
    assert 1 not in f.replies  # answered only once committed
    f.settle()
    ans = f.answer(1)
    assert ans.status == 201 and ans.body["name"] == "n" and ans.body["spec"] == spec
    return f


def test_the_leader_fires_each_due_time_and_repeats_only_after_the_retry_time() -> None:
    """At a due time the leader proposes one fire; it does not propose it again while it may
    still commit (proposal_retry_ms), then does (level-triggered); both committed make one
    job, the repeat refused as stale; the jobs thread is woken for the next due time."""
    f = _fleet_with_schedule()
    c = f.table.crons["n"]
    due = c.next_due()
    assert f.node.next_deadline_ms() is not None and f.node.next_deadline_ms() <= due
    f.tick(due - f.now - 1)
    f.take()
    assert not [e for e in f.pending if e["k"] == "cron"]
    f.tick(1)
    f.take()
    fires = [e for e in f.pending if e["k"] == "cron"]
    assert [(e["op"], e["name"], e["due"]) for e in fires] == [("fire", "n", due)]
    f.pending.clear()  # lost: never committed
    f.tick(limits.proposal_retry_ms - 1)
    f.take()
    assert not [e for e in f.pending if e["k"] == "cron"]
    f.tick(1)
    f.take()
    again = [e for e in f.pending if e["k"] == "cron"]
    assert [(e["due"]) for e in again] == [due]
    f.commit_pending()
    f.commit(dict(fires[0]))  # the lost one turns up after all
    assert [j for j in f.table.jobs] == [cron.run_id("n", due)]
    assert f.table.counts["cron_fires_stale"] == 1
    assert f.node.next_deadline_ms() > f.now


def test_a_follower_fires_nothing() -> None:
    f = _fleet_with_schedule()
    f.node.step(View(term=2, leader="m2", is_leader=False, ready=False))
    f.tick(60_000)
    f.take()
    assert not [e for e in f.proposed if e["k"] == "cron" and e.get("op") == "fire"]


def test_reads_and_changes_through_the_node() -> None:
    """list and get are reads; pause/resume/rm are answered from the committed outcome, and a
    retried request id answers as the first time."""
    f = _fleet_with_schedule("0 6 * * *")
    f.ctl(2, {"op": "cron", "action": "list"})
    f.ctl(3, {"op": "cron", "action": "get", "name": "n"})
    f.ctl(4, {"op": "cron", "action": "get", "name": "nope"})
    f.take()
    assert [c["name"] for c in f.answer(2).body["crons"]] == ["n"]
    assert f.answer(3).body["spec"] == "0 6 * * *"
    assert f.answer(4).status == 404 and "no schedule nope" in f.answer(4).body["error"]
    f.ctl(5, {"op": "cron", "action": "pause", "name": "n", "rid": "p1"})
    f.settle()
    assert f.answer(5).status == 200 and f.answer(5).body["paused"] is True
    f.ctl(6, {"op": "cron", "action": "pause", "name": "n", "rid": "p1"})
    f.take()
    assert f.answer(6) == f.answer(5)
    f.ctl(7, {"op": "cron", "action": "rm", "name": "nope", "rid": "r1"})
    f.ctl(8, {"op": "cron", "action": "add", "name": "m", "rid": "a2", "spec": "@daily",
              "job": {"argv": ["true"], "pool": "nosuch"}})
    f.settle()
    assert f.answer(7).status == 404
    assert f.answer(8).status == 400 and "unknown pool" in f.answer(8).body["error"]


# --- a model of the table's schedules -----------------------------------------------------------

NAMES = ("a", "b")
MODEL_SPECS = ("@every 10s", "*/2 * * * *", "0 * * * *")


class CronModel(RuleBasedStateMachine):
    """Any order of add, replace, pause, resume, rm, fires (right, repeated, stale, older) and
    run ends: each (name, due time) makes at most one job, under its id; a fire is applied
    only as the latest due time after the cursor; cursors never go back (but by a re-add);
    check() holds; a snapshot round trip is the same table."""

    def __init__(self) -> None:
        super().__init__()
        self.log = CronLog()
        self.t = BASE
        self.made: dict[tuple[str, int], str] = {}
        self.cursor: dict[str, int] = {}

    @initialize(specs=st.tuples(*[st.sampled_from(MODEL_SPECS)] * len(NAMES)))
    def start(self, specs: tuple[str, ...]) -> None:
        for name, spec in zip(NAMES, specs, strict=True):
            self.add(name, spec, "latest", "allow", True)

    @rule(ms=st.sampled_from((10_000, 60_000, 120_000, 7_200_000)))
    def lead(self, ms: int) -> None:
        """What a leader does: time passes, and it fires what is due."""
        self.t += ms
        for name in NAMES:
            self.fire(name, "due")

    @rule(name=st.sampled_from(NAMES), spec=st.sampled_from(MODEL_SPECS),
          catch_up=st.sampled_from(cron.CATCH_UP), overlap=st.sampled_from(cron.OVERLAP),
          replace=st.booleans())
    def add(self, name: str, spec: str, catch_up: str, overlap: str, replace: bool) -> None:
        existed = name in self.log.table.crons
        out = self.log.add(name, spec, t=self.t, catch_up=catch_up, overlap=overlap,
                           replace=replace)
        if out["ok"]:
            self.cursor[name] = self.log.table.crons[name].done_ms
        else:
            assert existed and not replace and out["reason"] == "conflict"

    @rule(name=st.sampled_from(NAMES), op=st.sampled_from(("pause", "resume", "rm")))
    def change(self, name: str, op: str) -> None:
        out = self.log.cron(op, name, t=self.t)
        assert out["ok"] == (name in self.cursor)
        if op == "rm" and out["ok"]:
            del self.cursor[name]
        elif out["ok"]:
            self.cursor[name] = self.log.table.crons[name].done_ms

    @rule(ms=st.sampled_from((1, 999, 10_000, 61_000, 3_600_000)))
    def wait(self, ms: int) -> None:
        self.t += ms

    @rule(name=st.sampled_from(NAMES), which=st.sampled_from(("due", "past", "now", "old")))
    def fire(self, name: str, which: str) -> None:
        c = self.log.table.crons.get(name)
        d = {"due": cron.due(c, self.t) if c else None,
             "past": c.done_ms if c else None,
             "now": self.t,
             "old": (c.sched.latest_upto(c.done_ms) if c else None)}[which]
        if d is None:
            return
        want = c is not None and cron.fire_ok(c, d, self.t)
        out = self.log.cron("fire", name, t=self.t, due=d)
        assert out["ok"] == want, (which, out)
        if not out["ok"]:
            return
        assert d == c.sched.latest_upto(self.t) and d > self.cursor[name]
        self.cursor[name] = d
        if out.get("new"):
            assert (name, d) not in self.made and out["id"] == cron.run_id(name, d)
            self.made[(name, d)] = out["id"]
            event("a run made")

    @rule()
    def end_runs(self) -> None:
        for jid, job in list(self.log.table.jobs.items()):
            if not job.finished and job.n_pending:
                _, epoch = self.log.lease((jid, 0), t=self.t)
                self.log.result(row(jid, 0, epoch, DONE), t=self.t)

    @invariant()
    def consistent(self) -> None:
        table = self.log.table
        table.check()
        assert sorted(table.jobs) == sorted(self.made.values())
        for name, c in table.crons.items():
            assert c.done_ms == self.cursor[name]
        s = msgpack.unpackb(msgpack.packb(table.to_state(), use_bin_type=True), raw=False,
                            strict_map_key=False)
        assert JobTable.from_state(s).to_state() == table.to_state()


TestCronModel = CronModel.TestCase
TestCronModel.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)


def test_a_clock_gone_wrong_finds_no_due_time_and_raises_nothing() -> None:
    """Rule 2 of the table (apply is total): an entry time stamped far in the future (a
    leader's clock gone wrong) finds no due time; the fire and the add are refusals or
    no-ops, never an exception."""
    for spec in ("@every 10s", "0 0 29 2 *", "* * * * *"):
        s = Schedule.parse(spec)
        for t in (2**62, limits.epoch_s_max * 1000, cron.T_MS_MAX + 1):
            assert s.next_after(t) is None and s.latest_upto(t) is None
    log = CronLog()
    far = 2**62
    assert log.add(t=far)["ok"]
    assert log.cron("fire", t=far, due=far)["reason"] == "cron_stale"
    assert cron.due(log.table.crons["n"], far) is None
    assert cron.record(log.table.crons["n"], far)["next_due"] is None
