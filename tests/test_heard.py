"""A new leader's first moments (issue 26, point 1): until it has heard from the fleet, an
unknown pool, an unknown member name and a fan-out's members are "not known yet" (503, to
retry), never a final 400/404 or a member list that leaves members out (meshjobs/node/heard.py).
The rule alone, then the job node with it (pure, in process)."""

from __future__ import annotations

import random
from typing import Any

from meshjobs import limits
from meshjobs.node import Ctl, FrameIn, JobNode, NodeConfig, Pool, Reply, Send, Tick, View
from meshjobs.node.heard import NOT_KNOWN_YET, Hearing, not_known_yet
from meshjobs.table import JobTable
from tests.helpers import T0, Fleet1, submit_req

VOTERS = ("m1", "m2", "m3")
DEAD = limits.member_dead_ms


# --- the rule -----------------------------------------------------------------------------------


def test_settled_once_dead_ms_passed_or_every_expected_member_reported() -> None:
    """Rule 1: heard from the fleet once dead_ms has passed since the reign began, or sooner
    once every member expected has reported; the leader itself is never waited for."""
    h = Hearing.of("m1", 1_000, DEAD, {"m1", "m2", "w1"}, {"m2"})
    assert h.expected == {"m2", "w1"} and h.unheard() == ["w1"]
    assert not h.settled(1_000) and not h.settled(1_000 + DEAD - 1)
    assert h.settled(1_000 + DEAD)
    assert Hearing.of("m1", 1_000, DEAD, {"m1", "m2", "w1"}, {"m2", "w1", "w9"}).settled(1_000)
    assert Hearing.of("m1", 1_000, DEAD, {"m1"}, ()).settled(1_000), "a fleet of one"


def test_the_answer_is_a_503_that_says_to_retry_and_names_who_is_awaited() -> None:
    """The answer until then: 503, marked not known yet (a forwarding member retries it), words
    that say what cannot be told yet, whom the leader waits for, and to try again."""
    h = Hearing.of("m1", 1_000, DEAD, {f"w{i}" for i in range(8)}, {"w0"})
    status, body = h.answer("whether some member offers pool 'gpu'", 1_500)
    assert status == 503 and not_known_yet(body) and body[NOT_KNOWN_YET] is True
    assert body["retry_ms"] == DEAD - 500
    words = body["error"]
    assert "pool 'gpu'" in words and "try again" in words
    assert "w1, w2, w3, w4, w5 and 2 more" in words
    assert not not_known_yet({"error": "no leader"}) and not not_known_yet(None)


# --- the node -----------------------------------------------------------------------------------


def _have(boot: str, pools: dict[str, int], role: str = "worker") -> dict:
    return {"boot": boot, "role": role, "pos": 0, "pools": pools}


def _report(f: Fleet1, name: str, pools: dict[str, int] | None = None) -> None:
    role = "voter" if name in VOTERS else "worker"
    f.node.step(FrameIn(name, "F_JOB_HAVE", _have("b-" + name, pools or {"default": 1}, role)))


def _new_leader(ready: bool = True) -> Fleet1:
    """m1 of voters m1..m3 follows m2 and hears worker w1 (pools default and gpu) report at its
    start, as a worker does to every voter; then it comes to lead."""
    f = Fleet1(voters=VOTERS)
    f.node.step(View(term=2, leader="m2"))
    f.tick(1)
    _report(f, "w1", {"default": 1, "gpu": 1})
    f.tick(1_000)
    f.take()
    f.node.step(View(term=3, leader="m1", is_leader=True, ready=ready))
    f.tick(1)
    f.take()
    return f


def _ask(f: Fleet1, token: int, req: dict) -> Any:
    f.ctl(token, req)
    f.take()
    return f.replies.get(token, [None])[-1]


def _order(rid: str, action: str, name: str) -> dict:
    return {"op": "member", "rid": rid, "action": action, "name": name, "grace_s": None}


def test_a_pool_only_a_worker_offers_is_not_known_yet_then_taken() -> None:
    """A submit to a pool that only a worker offers, before the worker reported to the new
    leader: 503 not known yet (never 400 unknown pool), nothing proposed; the voters' reports
    do not settle it while the worker heard before the reign has not reported; once it has,
    the same submit is proposed."""
    f = _new_leader()
    ans = _ask(f, 1, submit_req(rid="g1", pool="gpu"))
    assert ans.status == 503 and not_known_yet(ans.body), ans
    assert "w1" in ans.body["error"] and "'gpu'" in ans.body["error"]
    assert not f.pending_of("submit")
    _report(f, "m2")
    _report(f, "m3")
    assert _ask(f, 2, submit_req(rid="g1", pool="gpu")).status == 503
    _report(f, "w1", {"default": 1, "gpu": 1})
    assert _ask(f, 3, submit_req(rid="g1", pool="gpu")) is None
    [entry] = f.pending_of("submit")
    assert entry["spec"]["pool"] == "gpu"
    assert f.node.counts["ctl_not_known_yet"] == 2
    # After dead_ms the old final answer stands (a member not heard from by then is dead to
    # the leader); and once every member expected has reported, a pool none offers is
    # unknown at once.
    f = _new_leader()
    f.tick(DEAD)
    ans = _ask(f, 1, submit_req(rid="g1", pool="gpu"))
    assert ans.status == 400 and "unknown pool 'gpu'" in ans.body["error"], ans
    f = _new_leader()
    for name in ("m2", "m3", "w1"):
        _report(f, name)
    ans = _ask(f, 1, submit_req(rid="n1", pool="nosuch"))
    assert ans.status == 400 and "unknown pool" in ans.body["error"], ans


def test_the_reign_begins_at_the_tick_after_the_view() -> None:
    """A voter whose first event is the view that makes it leader (before any tick): its reign
    begins at the tick that follows, not at time 0 (which would have ended the wait at once).
    A fleet of one waits for nobody."""
    cfg = NodeConfig(member="m1", boot="b1", pools={"default": Pool("default", slots=1)},
                     voters=VOTERS)
    node = JobNode(JobTable(), cfg, random.Random(1))
    node.step(View(term=1, leader="m1", is_leader=True, ready=True))
    node.step(Tick(T0))
    node.step(Ctl(1, submit_req(pool="gpu")))
    [reply] = [e for e in node.take() if isinstance(e, Reply)]
    assert reply.answer.status == 503 and not_known_yet(reply.answer.body), reply
    ans = _ask(Fleet1(), 1, submit_req(pool="nosuch"))
    assert ans.status == 400 and "unknown pool" in ans.body["error"], ans


def test_a_fanout_waits_for_the_workers_not_only_the_voters() -> None:
    """A fan-out right after an election, the voters heard from and the worker not yet: 503
    (its member list would leave the worker out for good); once the worker reported, the list
    has it."""
    f = _new_leader()
    _report(f, "m2")
    _report(f, "m3")
    ans = _ask(f, 1, submit_req(rid="fan", member="*"))
    assert ans.status == 503 and "fan-out" in ans.body["error"] and not_known_yet(ans.body)
    assert not f.pending_of("submit")
    _report(f, "w1", {"default": 1, "gpu": 1})
    assert _ask(f, 2, submit_req(rid="fan", member="*")) is None
    [entry] = f.pending_of("submit")
    assert entry["on"] == ["m1", "m2", "m3", "w1"]


def test_reports_that_come_before_the_table_is_ready_count() -> None:
    """The reports of the reign count from its start, also those that come while the new
    leader's table is not ready yet."""
    f = _new_leader(ready=False)
    for name in ("m2", "m3", "w1"):
        _report(f, name, {"default": 1, "gpu": 1} if name == "w1" else None)
    f.node.step(View(term=3, leader="m1", is_leader=True, ready=True))
    assert _ask(f, 1, submit_req(rid="fan", member="*")) is None
    [entry] = f.pending_of("submit")
    assert entry["on"] == ["m1", "m2", "m3", "w1"]


def test_a_member_the_table_names_is_waited_for() -> None:
    """A worker the committed table names (it holds a lease) is waited for too: `member drain`
    of it right after an election is not known yet, not "no member"; once it has reported the
    order is proposed; and without its report, after dead_ms, "no member" stands."""
    for reports in (True, False):
        f = Fleet1(slots=0, voters=VOTERS)  # leases nothing to itself
        f.ctl(1, submit_req(rid="j"))
        f.take()
        f.commit_pending()
        f.commit({"k": "lease", "t": T0, "g": [["j1", 0, "w2", "b-w2"]]})
        assert "w2" in f.table.members_named()
        f.node.step(View(term=2, leader="m2"))
        f.tick(limits.member_lost_ms + 1)  # long after anything was heard
        f.take()
        f.node.step(View(term=3, leader="m1", is_leader=True, ready=True))
        f.tick(1)
        for name in ("m2", "m3"):
            _report(f, name)
        ans = _ask(f, 2, _order("d1", "drain", "w2"))
        assert ans.status == 503 and not_known_yet(ans.body) and "w2" in ans.body["error"], ans
        if reports:
            _report(f, "w2")
            assert _ask(f, 3, _order("d1", "drain", "w2")) is None
            [entry] = f.pending_of("member")
            assert entry["a"] == "drain" and entry["name"] == "w2"
        else:
            f.tick(DEAD)
            ans = _ask(f, 3, _order("d1", "drain", "w2"))
            assert ans.status == 404 and "no member 'w2'" in ans.body["error"], ans


def test_stop_of_a_member_not_reported_yet_is_503_then_409() -> None:
    """`member stop` of a voter that has not reported to the new leader: not known yet while
    the leader waits for the fleet, "has not reported" (409) after."""
    f = _new_leader()
    ans = _ask(f, 1, _order("s1", "stop", "m2"))
    assert ans.status == 503 and not_known_yet(ans.body), ans
    f.tick(DEAD)
    ans = _ask(f, 2, _order("s1", "stop", "m2"))
    assert ans.status == 409 and "has not reported" in ans.body["error"], ans


def test_pool_orders_and_schedules_on_a_pool_not_heard_of_yet() -> None:
    """A pool order and a new schedule naming a pool only the worker offers: not known yet,
    never 404/400, while the leader waits for the fleet."""
    f = _new_leader()
    ans = _ask(f, 1, {"op": "pool", "rid": "p1", "action": "hold", "pool": "gpu",
                      "member": None})
    assert ans.status == 503 and not_known_yet(ans.body), ans
    ans = _ask(f, 2, {"op": "pool", "rid": "p2", "action": "hold", "pool": "default",
                      "member": "w7"})
    assert ans.status == 503 and "'w7'" in ans.body["error"], ans
    ans = _ask(f, 3, {"op": "cron", "rid": "c1", "action": "add", "name": "nightly",
                      "spec": "@daily", "job": {"argv": ["true"], "pool": "gpu"},
                      "catch_up": "latest", "overlap": "allow", "by": "ops", "by_role": "admin"})
    assert ans.status == 503 and not_known_yet(ans.body), ans


# --- forwarding ---------------------------------------------------------------------------------


def _follower() -> Fleet1:
    f = Fleet1(voters=VOTERS)
    f.node.step(View(term=2, leader="m2"))
    f.tick(1)
    f.take()
    return f


def _ctls(effects: list[Any]) -> list[Send]:
    return [e for e in effects if isinstance(e, Send) and e.ftype == "F_CTL"]


def _not_known_reply(rid: str) -> dict:
    body = Hearing.of("m2", 0, DEAD, {"w1"}, ()).answer("whether some member offers pool "
                                                       "'gpu'", 10).body
    return {"rid": rid, "fp": None, "status": 503, "body": body, "index": 0}


def test_a_forwarding_member_asks_again_while_the_leader_cannot_tell() -> None:
    """A member that forwarded a change and got "not known yet" does not pass it on: it asks
    the leader again after ctl_resend_ms, and answers with the leader's next word."""
    f = _follower()
    f.ctl(1, submit_req(rid="g1", pool="gpu"))
    [sent] = _ctls(f.take())
    assert sent.to == "m2"
    f.node.step(FrameIn("m2", "F_CTL_REPLY", _not_known_reply("g1")))
    assert not _ctls(f.take()) and 1 not in f.replies
    f.tick(limits.ctl_resend_ms)
    [again] = _ctls(f.take())
    assert again.body == sent.body
    assert f.node.counts["ctl_not_known_yet_retried"] == 1
    f.node.step(FrameIn("m2", "F_CTL_REPLY", {"rid": "g1", "fp": None, "status": 201,
                                              "body": {"id": "j1"}, "index": 0}))
    f.take()
    assert f.answer(1).status == 201


def test_a_forwarding_member_gives_up_at_the_change_deadline() -> None:
    """Asked again only until the change's deadline (ctl_commit_ms_max): then its client gets
    the leader's last "not known yet", which says to try again."""
    f = _follower()
    f.ctl(1, submit_req(rid="g1", pool="gpu"))
    f.take()
    waited = 0
    while waited < limits.ctl_commit_ms_max:
        f.node.step(FrameIn("m2", "F_CTL_REPLY", _not_known_reply("g1")))
        f.tick(limits.ctl_resend_ms)
        waited += limits.ctl_resend_ms
        f.take()
    ans = f.answer(1)
    assert ans.status == 503 and not_known_yet(ans.body) and "try again" in ans.body["error"]
