"""Schedules: when a cron spec is due, and the requests that add, pause and remove schedules.

Theory of operation. A schedule is replicated state of the job table (`JobTable.crons`): its
name, its spec (five cron fields, or `@every 30s`, or a macro such as `@daily`), the job spec
each run is submitted with, and a cursor `done_ms`: every due time up to it is settled (fired,
or passed over). The leader asks `due(c, now_ms)` which due time to fire now and proposes a
"cron fire" entry naming only the schedule and that due time; the table checks the due time
against the entry's own time stamp (the same on every member), moves the cursor and submits the
run under an id made of the name and the due time (`run_id`). So a failover never fires a due
time twice: the cursor has moved, and the id is taken anyway. A missed run (no leader at its due
time) is fired once when a leader is back, the latest one only (`catch_up` "latest"), never a
burst; or not at all (`catch_up` "none": a run more than `cron_late_ms_max` late is skipped).
While the run before is still going, `overlap` "skip" passes a due time over; "allow" (the
default) submits it all the same.

Rule 1: pure. No IO, no clock: times come in as milliseconds since the epoch, in UTC.
Rule 2: cron's own meaning. Fields are minute (0-59), hour (0-23), day of month (1-31), month
        (1-12 or jan-dec) and day of week (0-7 or sun-sat, 0 and 7 both Sunday); each a list of
        `*`, `N`, `A-B`, with an optional `/STEP` (`N/STEP` runs from N to the field's end).
        When both day fields are restricted (neither starts with `*`), a day matches when
        either does (Vixie cron, POSIX); otherwise the restricted one decides. A range of days
        may end on Sunday by name or 0 (`sat-sun`, `fri-0`).
Rule 3: `@every D` (D like `30s`, `5m`, `1h30m`, `2d`) is due at the multiples of D since the
        epoch, so every member, and every leader, computes the same due times.
Rule 4: one error class, `CronError`, with a message that says what to write instead; a spec
        that can never be due (`0 0 30 2 *`) is refused when it is parsed.
"""

from __future__ import annotations

import datetime as _dt
import re
from dataclasses import dataclass, field
from typing import Any

from meshjobs import limits
from meshjobs.control import ControlError, check_restart_delay, parse_fp, parse_rid, parse_submit

UTC = _dt.UTC
MINUTE_MS = 60_000
MONTHS = ("jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec")
DAYS = ("sun", "mon", "tue", "wed", "thu", "fri", "sat")
MACROS = {
    "@yearly": "0 0 1 1 *", "@annually": "0 0 1 1 *", "@monthly": "0 0 1 * *",
    "@weekly": "0 0 * * 0", "@daily": "0 0 * * *", "@midnight": "0 0 * * *",
    "@hourly": "0 * * * *",
}
CATCH_UP = ("latest", "none")
OVERLAP = ("allow", "skip")
ACTIONS = ("list", "get", "add", "rm", "pause", "resume")
# A schedule's name: as a job id, shorter, and not "." or ".." (it is a path segment).
NAME_RE = re.compile(rf"^(?!\.\.?$)[A-Za-z0-9._-]{{1,{limits.cron_name_chars_max}}}$")
# What a run's job spec may not have: its id is the run's, and it has no inputs or parents.
JOB_KEYS_REFUSED = frozenset({"id", "items", "names", "after"})
ADD_KEYS = frozenset({"spec", "job", "catch_up", "overlap", "replace"})
_EVERY_RE = re.compile(r"^(?:([0-9]{1,9})([smhd]))+$")
_EVERY_PART_RE = re.compile(r"([0-9]{1,9})([smhd])")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}
# (name, low, high, names) of the five fields.
_FIELDS = (("minute", 0, 59, None), ("hour", 0, 23, None), ("day of month", 1, 31, None),
           ("month", 1, 12, MONTHS), ("day of week", 0, 7, DAYS))
_DAYS_IN = (31, 29, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31)  # the most each month may have
# The latest time a due time is looked for around: the search must stay inside the calendar
# (a time stamp past it, from a clock gone wrong, finds none rather than raising).
T_MS_MAX = (limits.epoch_s_max - (limits.cron_search_years_max + 1) * 366 * 86400) * 1000

SPEC_HINT = ("write five fields `MIN HOUR DAY-OF-MONTH MONTH DAY-OF-WEEK` (each `*`, N, A-B, "
             "lists with ',', steps with '/', names like mon or jan; UTC), or `@every 30s`, or "
             "@hourly, @daily, @weekly, @monthly, @yearly")


class CronError(ValueError):
    """A schedule spec that cannot be used; the message says what to write instead."""


def _field(text: str, name: str, lo: int, hi: int, names: tuple[str, ...] | None) -> frozenset[int]:
    def number(word: str) -> int:
        w = word.lower()
        if names is not None and w in names:
            return names.index(w) + (1 if name == "month" else 0)
        if not word.isascii() or not word.isdigit() or len(word) > 2:
            extra = f" or a name ({', '.join(names)})" if names else ""
            raise CronError(f"{name} field: {word[:20]!r} is not a number from {lo} to {hi}{extra}; "
                            + SPEC_HINT)
        n = int(word)
        if not lo <= n <= hi:
            raise CronError(f"{name} field: {n} is out of range {lo}-{hi}; " + SPEC_HINT)
        return n

    values: set[int] = set()
    for part in text.split(","):
        if not part:
            raise CronError(f"{name} field {text[:40]!r}: an empty list entry; " + SPEC_HINT)
        rng, slash, step_text = part.partition("/")
        step = 1
        if slash:
            if not step_text.isascii() or not step_text.isdigit() or len(step_text) > 2 \
                    or int(step_text) == 0:
                raise CronError(f"{name} field {part[:40]!r}: the step after '/' must be a "
                                f"number from 1 to {hi}; " + SPEC_HINT)
            step = int(step_text)
        if rng == "*":
            a, b = lo, hi
        elif "-" in rng:
            left, _, right = rng.partition("-")
            a, b = number(left), number(right)
            if names is DAYS and b == 0:
                b = 7  # sat-sun, fri-0: a range of days may end on Sunday's other number
            if a > b:
                raise CronError(f"{name} field {part[:40]!r}: a range must go up ({a} > {b}); "
                                + SPEC_HINT)
        else:
            a = number(rng)
            b = hi if slash else a
        values.update(range(a, b + 1, step))
    return frozenset(values)


def parse_every(text: str) -> int:
    """The period of `@every D`, in seconds (D: one or more of N s|m|h|d, like 1h30m)."""
    if not _EVERY_RE.fullmatch(text):
        raise CronError(f"@every {text[:40]!r}: write a duration like 30s, 5m, 1h30m or 2d")
    s = sum(int(n) * _UNIT_S[u] for n, u in _EVERY_PART_RE.findall(text))
    if not 1 <= s <= limits.cron_every_s_max:
        raise CronError(f"@every {text[:40]!r}: the period must be from 1s to "
                        f"{limits.cron_every_s_max // 86400}d")
    return s


@dataclass(frozen=True)
class Schedule:
    """A parsed spec: either a period (`every_s`) or the five fields' sets of values."""

    text: str
    every_s: int = 0
    minutes: frozenset[int] = frozenset()
    hours: frozenset[int] = frozenset()
    doms: frozenset[int] = frozenset()
    months: frozenset[int] = frozenset()
    dows: frozenset[int] = frozenset()
    dom_star: bool = True
    dow_star: bool = True

    @classmethod
    def parse(cls, text: object) -> Schedule:
        if not isinstance(text, str):
            raise CronError("a schedule spec must be a string; " + SPEC_HINT)
        if len(text) > limits.cron_spec_chars_max:
            raise CronError(f"the spec is longer than {limits.cron_spec_chars_max} characters; "
                            + SPEC_HINT)
        spec = " ".join(text.split())
        if not spec:
            raise CronError("the spec is empty; " + SPEC_HINT)
        if spec.startswith("@"):
            word, _, rest = spec.partition(" ")
            word = word.lower()
            if word == "@every":
                return cls(spec, every_s=parse_every(rest.replace(" ", "").lower()))
            if word not in MACROS or rest:
                raise CronError(f"unknown spec {spec[:40]!r} (@reboot is not supported: a fleet "
                                "has no single boot); " + SPEC_HINT)
            return cls._fields(spec, MACROS[word])
        return cls._fields(spec, spec)

    @classmethod
    def _fields(cls, text: str, spec: str) -> Schedule:
        parts = spec.split(" ")
        if len(parts) != 5:
            raise CronError(f"the spec {text[:60]!r} has {len(parts)} fields, not 5 (seconds and "
                            "years are not supported); " + SPEC_HINT)
        sets = [_field(p, *f) for p, f in zip(parts, _FIELDS, strict=True)]
        dows = frozenset(d % 7 for d in sets[4])
        s = cls(text, minutes=sets[0], hours=sets[1], doms=sets[2], months=sets[3], dows=dows,
                dom_star=parts[2].startswith("*"), dow_star=parts[4].startswith("*"))
        # With both day fields restricted any day of the week does; with the day of month
        # alone, some month named must have one of its days (Feb 29 counts: leap years come).
        if s.dow_star and not any(d <= _DAYS_IN[m - 1] for m in s.months for d in s.doms):
            raise CronError(f"the spec {text[:60]!r} is never due: no month it names has such a "
                            "day; " + SPEC_HINT)
        return s

    def _day_ok(self, d: _dt.datetime) -> bool:
        dom_ok = d.day in self.doms
        dow_ok = d.isoweekday() % 7 in self.dows
        if self.dom_star and self.dow_star:
            return True
        if self.dom_star:
            return dow_ok
        if self.dow_star:
            return dom_ok
        return dom_ok or dow_ok

    def next_after(self, t_ms: int) -> int | None:
        """The first due time strictly after `t_ms` (None: none in `cron_search_years_max`)."""
        if not 0 <= t_ms <= T_MS_MAX:
            return None
        if self.every_s:
            p = self.every_s * 1000
            return (t_ms // p + 1) * p
        d = _dt.datetime.fromtimestamp((t_ms // MINUTE_MS + 1) * 60, UTC)
        last_year = d.year + limits.cron_search_years_max
        while d.year <= last_year:
            if d.month not in self.months:
                y, m = (d.year + 1, 1) if d.month == 12 else (d.year, d.month + 1)
                d = _dt.datetime(y, m, 1, tzinfo=UTC)
            elif not self._day_ok(d):
                d = d.replace(hour=0, minute=0) + _dt.timedelta(days=1)
            elif d.hour not in self.hours:
                d = d.replace(minute=0) + _dt.timedelta(hours=1)
            elif d.minute not in self.minutes:
                d += _dt.timedelta(minutes=1)
            else:
                return int(d.timestamp()) * 1000
        return None

    def latest_upto(self, t_ms: int) -> int | None:
        """The last due time at or before `t_ms` (None: none in `cron_search_years_max`)."""
        if not 0 <= t_ms <= T_MS_MAX:
            return None
        if self.every_s:
            p = self.every_s * 1000
            return (t_ms // p) * p
        d = _dt.datetime.fromtimestamp(t_ms // MINUTE_MS * 60, UTC)
        first_year = d.year - limits.cron_search_years_max
        one = _dt.timedelta(minutes=1)
        while d.year >= first_year and d.year > 1:
            if d.month not in self.months:
                d = d.replace(day=1, hour=0, minute=0) - one
            elif not self._day_ok(d):
                d = d.replace(hour=0, minute=0) - one
            elif d.hour not in self.hours:
                d = d.replace(minute=0) - one
            elif d.minute not in self.minutes:
                d -= one
            else:
                return int(d.timestamp()) * 1000
        return None


def run_id(name: str, due_ms: int) -> str:
    """The id of a schedule's run due at `due_ms`: the same on every member and every leader."""
    return f"cron-{name}-{_dt.datetime.fromtimestamp(due_ms // 1000, UTC):%Y%m%dT%H%M%S}"


@dataclass
class Cron:
    """One schedule, as the table keeps it."""

    name: str
    spec: str
    job: dict
    catch_up: str
    overlap: str
    created_ms: int
    done_ms: int  # every due time up to this is settled (fired or passed over)
    sched: Schedule = field(repr=False, compare=False, default=Schedule(""))
    paused: bool = False
    last_due_ms: int = 0
    last_id: str | None = None
    fired: int = 0
    skipped: int = 0
    version: int = 0
    # (done_ms, the first due time after it): derived, so that asking whether a run is due
    # costs one comparison until one is. Not part of the state.
    nxt: tuple[int, int | None] | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.sched.text:
            self.sched = Schedule.parse(self.spec)

    def row(self) -> list:
        """Its snapshot row (plain data)."""
        return [self.name, self.spec, self.job, self.catch_up, self.overlap, self.created_ms,
                self.done_ms, self.paused, self.last_due_ms, self.last_id, self.fired,
                self.skipped, self.version]

    @classmethod
    def from_row(cls, row: list) -> Cron:
        (name, spec, job, catch_up, overlap, created, done, paused, last_due, last_id, fired,
         skipped, version) = row[:13]
        return cls(name, spec, job, catch_up, overlap, created, done, paused=paused,
                   last_due_ms=last_due, last_id=last_id, fired=fired, skipped=skipped,
                   version=version)

    def next_due(self) -> int | None:
        """The first due time after the cursor (None: none in `cron_search_years_max`)."""
        if self.nxt is None or self.nxt[0] != self.done_ms:
            self.nxt = (self.done_ms, self.sched.next_after(self.done_ms))
        return self.nxt[1]

    @property
    def owner(self) -> str:
        """Who owns it: the identity that added it, whose name its runs are submitted by."""
        return str(self.job.get("submitted_by", "anonymous"))

    def same(self, spec: str, job: dict, catch_up: str, overlap: str) -> bool:
        return (self.spec, self.job, self.catch_up, self.overlap) == (spec, job, catch_up, overlap)


def fire_ok(c: Cron, due_ms: int, t_ms: int) -> bool:
    """Whether a fire of `c` for `due_ms`, stamped `t_ms`, is the one `due` says to fire."""
    return not c.paused and due_ms > c.done_ms and due(c, t_ms) == due_ms


def due(c: Cron, now_ms: int) -> int | None:
    """The due time of `c` to fire at `now_ms`, if any: the latest not settled yet (older
    missed ones are passed over: never a burst); with catch_up "none", only if it is not more
    than `cron_late_ms_max` late."""
    if c.paused:
        return None
    first = c.next_due()
    if first is None or first > now_ms:
        return None
    latest = c.sched.latest_upto(now_ms)
    if latest is None or latest <= c.done_ms:
        return None
    if c.catch_up == "none" and now_ms - latest > limits.cron_late_ms_max:
        return None
    return latest


def next_wake_ms(crons: Any, now_ms: int) -> int | None:
    """When a leader next has a due time to fire, strictly after `now_ms` (None: none coming).
    A due time already past (fired and not committed yet, or too late to fire) is no reason
    to wake now: that would spin; the next one after now is."""
    ds = []
    for c in crons:
        d = None if c.paused else c.next_due()
        if d is not None and d <= now_ms:
            d = c.sched.next_after(now_ms)
        if d is not None:
            ds.append(d)
    return min(ds) if ds else None


def record(c: Cron, now_ms: int | None = None) -> dict:
    """A schedule as clients see it (GET /cron, meshctl cron list)."""
    nxt = None
    if not c.paused:
        pending = due(c, now_ms) if now_ms is not None else None
        nxt = pending if pending is not None else c.sched.next_after(
            max(c.done_ms, now_ms if now_ms is not None else c.done_ms))
    return {
        "name": c.name, "spec": c.spec, "job": c.job, "catch_up": c.catch_up,
        "overlap": c.overlap, "paused": c.paused, "created_at": c.created_ms / 1000.0,
        "next_due": None if nxt is None else nxt / 1000.0,
        "last_due": c.last_due_ms / 1000.0 if c.last_due_ms else None,
        "last_job": c.last_id, "fired": c.fired, "skipped": c.skipped, "version": c.version,
        "owner": c.owner,
    }


# --- requests --------------------------------------------------------------------------------


def parse_name(value: object) -> str:
    if not isinstance(value, str) or not NAME_RE.fullmatch(value):
        raise ControlError(400, f"bad schedule name {str(value)[:80]!r}: use 1 to "
                                f"{limits.cron_name_chars_max} letters, digits, '.', '_' or '-' (not . or ..)")
    return value


def parse_job(value: object, committed: bool = False) -> dict:
    """The job spec a schedule's runs are submitted with: a submit spec without id, items,
    names or after (normalized as a submit's)."""
    if not isinstance(value, dict):
        raise ControlError(400, 'job must be a JSON object: a job spec as POST /jobs takes, at '
                                'least {"argv": [...]}')
    refused = set(value) & JOB_KEYS_REFUSED
    if refused:
        raise ControlError(400, f"a schedule's job may not have {', '.join(sorted(refused))}: "
                                "each run gets its own id (cron-NAME-TIME) and has one item "
                                "with no input and no parents")
    spec = parse_submit(value, committed)
    del spec["id"]
    if spec.get("member") == "*":
        # A fan-out's members are fixed by the leader at a submit from a client; a run fired by
        # the table has no such list.
        raise ControlError(400, "a schedule's job cannot fan out (member *): give a member "
                                "name or glob, or add one schedule per member")
    return spec


def parse_add(body: object, committed: bool = False) -> dict:
    """The body of PUT /cron/{name}: {"spec": "...", "job": {...}, "catch_up", "overlap",
    "replace"}."""
    if not isinstance(body, dict):
        raise ControlError(400, 'a schedule must be a JSON object: {"spec": "*/5 * * * *", '
                                '"job": {"argv": [...]}}')
    unknown = set(body) - ADD_KEYS
    if unknown:
        raise ControlError(400, f"unknown key(s) in schedule: {', '.join(sorted(map(str, unknown)))[:200]}; "
                                f"use {', '.join(sorted(ADD_KEYS))}")
    if "spec" not in body or "job" not in body:
        raise ControlError(400, 'a schedule needs "spec" (when) and "job" (what to run)')
    try:
        sched = Schedule.parse(body["spec"])
    except CronError as e:
        raise ControlError(400, str(e)) from None
    out: dict[str, Any] = {"spec": sched.text, "job": parse_job(body["job"], committed),
                           "catch_up": "latest", "overlap": "allow", "replace": True}
    for key, allowed in (("catch_up", CATCH_UP), ("overlap", OVERLAP)):
        v = body.get(key)
        if v is not None:
            if v not in allowed:
                raise ControlError(400, f"{key} must be one of {', '.join(allowed)}, not "
                                        f"{str(v)[:40]!r}")
            out[key] = v
    if body.get("replace") is not None:
        if not isinstance(body["replace"], bool):
            raise ControlError(400, "replace must be true or false")
        out["replace"] = body["replace"]
    return out


def parse_request(req: dict) -> dict:
    """A control request of op "cron" (as it reaches the node, locally or forwarded)."""
    action = req.get("action")
    if action not in ACTIONS:
        raise ControlError(400, f"unknown cron action {str(action)[:40]!r}: use one of "
                                f"{', '.join(ACTIONS)}")
    if action == "list":
        return {"op": "cron", "action": "list"}
    out: dict[str, Any] = {"op": "cron", "action": action, "name": parse_name(req.get("name"))}
    if action == "get":
        return out
    out.update(rid=parse_rid(req.get("rid")), fp=parse_fp(req.get("fp")))
    if action == "add":
        out.update(parse_add({k: req[k] for k in ADD_KEYS if k in req}, committed=True))
        check_restart_delay(out["job"])  # a new schedule's job, as a new submit (reruns Rule 6)
    return out


def entry(req: dict, now_ms: int) -> dict:
    """The committed entry of a parsed cron change."""
    e: dict[str, Any] = {"k": "cron", "rid": req["rid"], "t": now_ms, "op": req["action"],
                         "name": req["name"]}
    if req.get("fp") is not None:
        e["fp"] = req["fp"]
    if req["action"] == "add":
        e.update({k: req[k] for k in ("spec", "job", "catch_up", "overlap", "replace")})
    if req.get("by") is not None:
        e.update(by=req["by"], br=req["by_role"])  # the table checks ownership
    return e


def job_digest(spec: dict) -> bytes:
    """The digest of a run's submit (one item, no input), as any submit's is made."""
    from meshjobs.node.events import spec_digest  # here: meshjobs.node imports the table

    return spec_digest(spec, [None])
