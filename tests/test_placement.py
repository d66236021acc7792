"""Placement (issue 12 point 1), the pure parts: parsing a member selector (`member`, and the
`pool@member` short form), matching it against member names, the table keeping it (only
matching members are ever leased an item, a fan-out's items each to their own member, a grant
elsewhere is a recorded refusal), the leader's lease proposal honouring it, and the words of
`waiting_for`.

Each test's docstring names the rule it checks.
"""

from __future__ import annotations

from typing import Any

import pytest

from meshjobs import limits, placement
from meshjobs.control import ControlError, parse_request, parse_submit
from meshjobs.node.events import FrameIn, View
from meshjobs.table import JobTable
from tests.helpers import T0, Fleet1, Log, spec, submit_req, submitted

# --- parsing ------------------------------------------------------------------------------------


@pytest.mark.parametrize("body, pool, member", [
    ({"member": "gpu-1"}, "default", "gpu-1"),
    ({"member": "gpu-*"}, "default", "gpu-*"),
    ({"member": "rack[12]-?"}, "default", "rack[12]-?"),
    ({"member": "*"}, "default", "*"),
    ({"pool": "gpu@node-1"}, "gpu", "node-1"),
    ({"pool": "gpu@*"}, "gpu", "*"),
    ({"pool": "gpu@n-*", "member": "n-*"}, "gpu", "n-*"),
    ({"pool": "gpu"}, "gpu", None),
])
def test_selector_forms_are_normalized(body: dict, pool: str, member: str | None) -> None:
    """`member` and `pool@member` give a pool and a selector; the spec holds "member" only when
    one is given (older specs stay normalized)."""
    out = parse_submit({"argv": ["true"], **body})
    assert out["pool"] == pool
    assert out.get("member") == member
    assert ("member" in out) == (member is not None)


@pytest.mark.parametrize("body, words", [
    ({"member": ""}, "member is empty"),
    ({"member": "a b"}, "bad member selector"),
    ({"member": "x/y"}, "bad member selector"),
    ({"member": "n\x00"}, "bad member selector"),
    ({"member": "é"}, "bad member selector"),
    ({"member": "x" * (limits.member_selector_chars_max + 1)}, "longer than"),
    ({"member": 7}, "must be a string"),
    ({"member": ["a"]}, "must be a string"),
    ({"pool": "@x"}, "both parts are needed"),
    ({"pool": "x@"}, "both parts are needed"),
    ({"pool": "@"}, "both parts are needed"),
    ({"pool": "a b@x"}, "bad pool name"),
    ({"pool": "p@a@b"}, "bad member selector"),
    ({"pool": "p@x", "member": "y"}, "disagree"),
    ({"member": "*", "items": ["a", "b"]}, "fan-out"),
    ({"member": "*", "items": ["a"], "names": ["f"]}, "drop names"),
])
def test_bad_selectors_are_refused(body: dict, words: str) -> None:
    """A bad selector is a 400 that says what is wrong and what a good one looks like."""
    with pytest.raises(ControlError) as e:
        parse_submit({"argv": ["true"], **body})
    assert e.value.status == 400 and words in e.value.message
    assert len(e.value.message) < 400


def test_longest_selector_is_taken() -> None:
    """A selector of exactly the limit passes."""
    sel = "a" * limits.member_selector_chars_max
    assert parse_submit({"argv": ["x"], "member": sel})["member"] == sel


def test_forwarded_fanout_with_many_items_is_refused() -> None:
    """A forwarded submit of a fan-out with several item digests is refused before the leader."""
    req = {"op": "submit", "rid": "r1", "spec": {"argv": ["x"], "member": "*"},
           "items": [None, None]}
    with pytest.raises(ControlError) as e:
        parse_request(req)
    assert e.value.status == 400 and "fan-out" in e.value.message


@pytest.mark.parametrize("selector, name, hit", [
    ("gpu-1", "gpu-1", True), ("gpu-1", "gpu-10", False), ("gpu-*", "gpu-10", True),
    ("gpu-*", "cpu-1", False), ("n?", "n1", True), ("n?", "n10", False),
    ("rack[12]-a", "rack2-a", True), ("rack[12]-a", "rack3-a", False),
    ("rack[!1]-a", "rack3-a", True), ("*", "anything", True), (None, "x", True),
    ("GPU-*", "gpu-1", False),
])
def test_matching(selector: str | None, name: str, hit: bool) -> None:
    """A name is exact, a glob is fnmatch style over the whole name and case-sensitive; "*" and
    no selector match every member."""
    assert placement.matches(selector, name) is hit


def test_fanout_pins_allow_their_own_member_only() -> None:
    """A fan-out's item i may go to member i of its list only."""
    pins = ["a", "b"]
    assert placement.allows("*", pins, 0, "a") and placement.allows("*", pins, 1, "b")
    assert not placement.allows("*", pins, 0, "b") and not placement.allows("*", pins, 2, "a")


# --- the table ----------------------------------------------------------------------------------


def fan_submit(log: Log, job_id: str, on: Any, n: int | None = None, **kw: Any) -> dict:
    n = len(on) if n is None and isinstance(on, list) else (n or 1)
    e = {"k": "submit", "t": T0, "id": job_id, "spec": spec(member="*", **kw), "dg": b"fan",
         "items": [None] * n}
    if on is not None:
        e["on"] = on
    return log.apply(e)


def test_grant_to_a_non_matching_member_is_refused() -> None:
    """The table refuses (counts, never raises) a lease grant to a member the job's selector
    does not allow: a stale or buggy leader cannot place wrongly."""
    log = Log()
    log.submit("j1", n=2, member="gpu-*")
    out, _ = log.lease(("j1", 0), member="cpu-1")
    assert out == {"ok": True, "granted": 0, "refused": 1}
    assert log.counts()["leases_refused_placement"] == 1
    assert log.job().st[0] == 0 and log.job().member[0] is None
    out, _ = log.lease(("j1", 0), member="gpu-7")
    assert out["granted"] == 1 and log.job().member[0] == "gpu-7"
    log.table.check()


def test_fanout_items_go_to_their_own_member() -> None:
    """A fan-out's submit names its members (one per item); item i is leased to member i only,
    the record says which item is whose, and a snapshot keeps it."""
    log = Log()
    assert fan_submit(log, "f", ["a", "b", "c"])["ok"]
    job = log.job("f")
    assert job.pins == ["a", "b", "c"] and job.n == 3
    out, _ = log.lease(("f", 0), ("f", 1), member="b")
    assert (out["granted"], out["refused"]) == (1, 1) and job.member[1] == "b"
    rec = log.table.record(job, items=True)
    assert rec["member"] == "*" and rec["members"] == ["a", "b", "c"]
    assert rec["pending_members"] == ["a", "c"]
    assert [it["for_member"] for it in rec["items"]] == ["a", "b", "c"]
    back = JobTable.from_state(log.table.to_state())
    assert back.jobs["f"].pins == ["a", "b", "c"] and back.jobs["f"].selector == "*"
    back.check()


@pytest.mark.parametrize("on, n", [
    (None, 1), ([], 0), (["a", "a"], 2), (["a"], 2), (["a b"], 1), ([3], 1), ("a", 1),
    (["a"] * (limits.fanout_members_max + 1), limits.fanout_members_max + 1),
])
def test_malformed_fanout_list_is_refused(on: Any, n: int) -> None:
    """A fan-out submit without a list of distinct member names, one per item, is refused."""
    log = Log()
    if n == 0:
        out = log.apply({"k": "submit", "t": T0, "id": "f", "spec": spec(member="*"),
                         "dg": b"x", "items": [], "on": on})
    else:
        out = fan_submit(log, "f", on, n=n)
    assert not out["ok"] and out["status"] == 400
    assert "f" not in log.table.jobs


def test_fanout_list_on_a_plain_job_is_refused() -> None:
    """Only a fan-out ("*") carries a member list."""
    log = Log()
    out = log.apply({"k": "submit", "t": T0, "id": "j", "spec": spec(member="a"), "dg": b"x",
                     "items": [None], "on": ["a"]})
    assert not out["ok"] and out["reason"] == "malformed"


def test_pick_with_member_filter() -> None:
    """`pick(member=...)` gives only items that may go to that member."""
    log = Log()
    log.submit("g", n=2, member="gpu-*", dg=b"g")
    log.submit("any", n=1, dg=b"a")
    fan_submit(log, "f", ["cpu-1", "gpu-1"])
    assert log.table.pick("default", 10, T0, set(), member="cpu-1") == [("any", 0), ("f", 0)]
    assert log.table.pick("default", 10, T0, set(), member="gpu-1") == [
        ("g", 0), ("g", 1), ("any", 0), ("f", 1)]
    assert log.table.pick("default", 10, T0, set()) == [
        ("g", 0), ("g", 1), ("any", 0), ("f", 0), ("f", 1)]


def test_place_assigns_only_allowed_members_and_skips_full_ones() -> None:
    """`place` gives each item to the member with most room among those its job allows; a job
    whose members are full does not hold up the jobs behind it."""
    log = Log()
    log.submit("g", n=3, member="gpu-*", priority=5, dg=b"g")
    log.submit("any", n=3, dg=b"a")
    room = {"gpu-1": 1, "cpu-1": 3}
    got = log.table.place("default", room, 10, T0, set())
    assert got == [("g", 0, "gpu-1"), ("any", 0, "cpu-1"), ("any", 1, "cpu-1"),
                   ("any", 2, "cpu-1")]
    assert room == {"gpu-1": 0, "cpu-1": 0}


def test_place_fanout_waits_for_its_member() -> None:
    """A fan-out item whose member has no room (or is gone) is not placed elsewhere."""
    log = Log()
    fan_submit(log, "f", ["a", "b"])
    assert log.table.place("default", {"a": 5}, 10, T0, set()) == [("f", 0, "a")]
    assert log.table.place("default", {"c": 5}, 10, T0, set()) == []


def test_place_without_selectors_is_the_old_spread() -> None:
    """For jobs without a selector, `place` picks what `pick` picks, and spreads by room as the
    leader always did (most room, then the preferred member, then the greatest name)."""
    log = Log()
    log.submit("a", n=4, dg=b"a")
    log.submit("b", n=2, dg=b"b", priority=1)
    room = {"m1": 2, "m2": 2, "m3": 1}
    picked = log.table.pick("default", 5, T0, set())
    got = log.table.place("default", dict(room), 5, T0, set(), prefer="m1")
    assert [(j, i) for j, i, _ in got] == picked
    left = dict(room)
    want = []
    for j, i in picked:
        m = max((n for n in left if left[n] > 0), key=lambda n: (left[n], n == "m1", n))
        left[m] -= 1
        want.append((j, i, m))
    assert got == want


def test_check_catches_an_item_run_off_its_selector() -> None:
    """The table's own check fails loudly on an item recorded as run by a member its selector
    does not allow (a bug of ours, not remote garbage)."""
    log = Log()
    log.submit("j1", member="gpu-*")
    log.job().member[0] = "cpu-1"
    with pytest.raises(AssertionError, match="selector"):
        log.table.check()


# --- the leader ---------------------------------------------------------------------------------


def fleet(voters: tuple[str, ...] = ()) -> Fleet1:
    """A leader m1 (2 slots) that hears from voters/workers w1 and w2 (2 slots each)."""
    f = Fleet1(slots=2, voters=voters)
    for name in ("w1", "w2"):
        f.node.step(FrameIn(name, "F_JOB_HAVE", {"boot": "b-" + name, "role": "voter", "pos": 0,
                                                 "pools": {"default": 2}}))
    return f


def test_leader_leases_only_to_matching_members() -> None:
    """The leader proposes a placed job's items to matching members only, even with room
    elsewhere, while an unplaced job behind it takes that room."""
    f = fleet()
    submitted(f, n=4, member="w?", priority=1)
    submitted(f, token=2, rid="r2", job_id="free", n=4)
    f.settle()
    grants = [g for e in f.proposed if e["k"] == "lease" for g in e["g"]]
    placed = [g[2] for g in grants if g[0] == "j1"]
    assert sorted(placed) == ["w1", "w1", "w2", "w2"]
    assert [g[2] for g in grants if g[0] == "free"] == ["m1", "m1"]
    f.table.check()


def test_leader_fixes_fanout_members_at_submit() -> None:
    """A fan-out submit commits one item per alive member of the pool (the leader too), sorted;
    each item is leased to its own member."""
    f = fleet()
    rec = submitted(f, member="*")
    assert rec["members"] == ["m1", "w1", "w2"] and rec["items_total"] == 3
    f.settle()
    grants = {(g[0], g[1]): g[2] for e in f.proposed if e["k"] == "lease" for g in e["g"]}
    assert grants == {("j1", 0): "m1", ("j1", 1): "w1", ("j1", 2): "w2"}


def test_fanout_waits_for_a_gone_member_never_moves() -> None:
    """A fan-out item whose member stops reporting is revoked and waits; it is never leased to
    another member, however long it waits."""
    f = fleet()
    submitted(f, member="*")
    f.settle()
    for _ in range(4):  # w1 goes quiet; w2 keeps reporting
        f.tick(f.node.cfg.dead_ms)
        f.node.step(FrameIn("w2", "F_JOB_HAVE", {"boot": "b-w2", "role": "voter",
                                                 "pos": f.table.applied_index,
                                                 "pools": {"default": 2}}))
        f.settle()
    job = f.table.jobs["j1"]
    assert job.st[1] == 0 and job.member[1] is None, "w1's item is pending again"
    later = [g for e in f.proposed if e["k"] == "lease" for g in e["g"] if g[1] == 1]
    assert [g[2] for g in later] == ["w1"], "leased to w1 once, never elsewhere"


def test_fanout_right_after_election_is_503() -> None:
    """A leader that has just taken over and not heard from every voter will not fix a
    fan-out's members (it would miss some): 503, try again."""
    f = Fleet1(slots=1, voters=("m1", "m2", "m3"))
    f.node.step(View(term=2))  # an election...
    f.node.step(View(term=3, leader="m1", is_leader=True, ready=True))  # ...won now
    f.ctl(1, submit_req(member="*"))
    f.take()
    ans = f.answer(1)
    assert ans.status == 503 and "fan-out" in ans.body["error"]
    assert not f.pending_of("submit")


def test_fanout_submit_with_two_items_is_400() -> None:
    """A fan-out has one item per member: two items are refused at the leader too."""
    f = fleet()
    f.ctl(1, submit_req(member="*", n=2))
    f.take()
    assert f.answer(1).status == 400


def waiting(record: dict, alive: dict[str, bool], pools: tuple[str, ...] = ("default",)) -> str | None:
    fleet = [{"name": n, "alive": a, "pools": {p: 1 for p in pools}} for n, a in alive.items()]
    return placement.waiting_for(record, fleet)


def test_waiting_for_words() -> None:
    """`waiting_for` says a placed job waits when no alive member with its pool matches, names
    a fan-out's members that are gone, and says nothing otherwise."""
    rec = {"member": "gpu-*", "state": "queued", "items_pending": 2, "pool": "default"}
    why = waiting(rec, {"cpu-1": True, "gpu-1": False})
    assert why is not None and "no alive member matches 'gpu-*'" in why
    assert waiting(rec, {"gpu-1": True}) is None
    assert waiting(rec, {"gpu-1": True}, pools=("other",)) is not None
    assert waiting({**rec, "state": "held"}, {}) is None
    assert waiting({**rec, "items_pending": 0}, {}) is None
    assert waiting({k: v for k, v in rec.items() if k != "member"}, {}) is None
    fan = {"member": "*", "state": "running", "items_pending": 1, "pool": "default",
           "members": ["a", "b"], "pending_members": ["b"]}
    why = waiting(fan, {"a": True, "b": False})
    assert why is not None and "b" in why and "never run elsewhere" in why
    assert waiting(fan, {"a": False, "b": True}) is None
