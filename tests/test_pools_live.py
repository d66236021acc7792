"""Pools under command (issue 12, point 4): hold, release, drain and undrain a pool while the
fleet runs, fleet-wide or on one member, as committed entries (meshjobs/fleetctl.py); and
`meshctl pools` / GET /pools.

Table rules first (pure), then the member's own rule (a leased item of a held pool is not
started), then a real member: through HTTP and meshctl, across a restart, and hostile input.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from typing import Any

import pytest

from meshjobs import limits
from meshjobs.fleetctl import FleetCtl
from meshjobs.node import JobNode, NodeConfig, Pool, Run, Tick
from meshjobs.table import JobTable
from tests.helpers import Log, Meshd, member_config, running, token_line, wait_until

T0 = 1_700_000_000_000


# --- the table --------------------------------------------------------------------------------


def order(log: Log, kind: str, action: str, **kw: Any) -> dict:
    return log.apply({"k": kind, "t": T0, "a": action, **kw})


def test_hold_refuses_leases_in_the_pool_until_release() -> None:
    """A pool held fleet-wide takes no lease on any member; released, it does again."""
    log = Log()
    log.submit("j1", n=2)
    assert order(log, "pool", "hold", pool="default")["held"] is True
    out, _ = log.lease(("j1", 0))
    assert out["granted"] == 0 and out["refused"] == 1
    assert order(log, "pool", "release", pool="default")["held"] is False
    out, _ = log.lease(("j1", 0))
    assert out["granted"] == 1
    log.table.check()


def test_member_hold_and_drain_refuse_only_that_member() -> None:
    """A pool held (or drained) on one member refuses leases to it, and to no other."""
    for action in ("hold", "drain"):
        log = Log()
        log.submit("j1", n=2)
        order(log, "pool", action, pool="default", member="m1")
        assert log.lease(("j1", 0), member="m1")[0]["granted"] == 0
        assert log.lease(("j1", 0), member="m2")[0]["granted"] == 1
        undo = "release" if action == "hold" else "undrain"
        order(log, "pool", undo, pool="default", member="m1")
        assert log.lease(("j1", 1), member="m1")[0]["granted"] == 1


def test_release_without_member_lifts_every_hold_of_the_pool() -> None:
    """release POOL lifts the fleet-wide hold and every member's; release POOL --member M only
    M's own (a fleet-wide hold still holds M)."""
    log = Log()
    order(log, "pool", "hold", pool="default")
    order(log, "pool", "hold", pool="default", member="m1")
    order(log, "pool", "release", pool="default", member="m1")
    assert log.table.ctl.pool_held("default", "m1")  # still: fleet-wide
    order(log, "pool", "hold", pool="default", member="m2")
    order(log, "pool", "release", pool="default")
    assert not log.table.ctl.active()


def test_drain_leaves_granted_leases_running() -> None:
    """Drain takes no more: a lease granted before it stays, and its result is taken."""
    log = Log()
    log.submit("j1", n=2)
    _, epoch = log.lease(("j1", 0))
    order(log, "pool", "drain", pool="default")
    assert log.lease(("j1", 1))[0]["granted"] == 0
    out = log.result(["j1", 0, epoch, 2, 0, None, None, None, T0, T0 + 1])
    assert out["accepted"] == 1
    assert log.table.jobs["j1"].n_done == 1 and log.table.jobs["j1"].n_pending == 1


def test_member_drain_and_stop() -> None:
    """A drained member takes no lease; a stop is for the incarnation (boot) it names only."""
    log = Log()
    log.submit("j1", n=3)
    order(log, "member", "drain", name="m1")
    assert log.lease(("j1", 0), member="m1")[0]["granted"] == 0
    order(log, "member", "undrain", name="m1")
    order(log, "member", "stop", name="m1", boot="b1", grace_ms=5000)
    assert log.lease(("j1", 0), member="m1", boot="b1")[0]["granted"] == 0
    assert log.lease(("j1", 0), member="m1", boot="b2")[0]["granted"] == 1  # started again
    assert log.table.ctl.stops["m1"] == ("b1", T0, 5000)
    order(log, "member", "undrain", name="m1")
    assert not log.table.ctl.active()


def test_orders_survive_a_snapshot() -> None:
    """Orders are part of the table's state: a snapshot brings them back as they were, and a
    table without orders snapshots as before (no "ctl" key)."""
    log = Log()
    assert "ctl" not in log.table.to_state()
    order(log, "pool", "hold", pool="default", member="m1")
    order(log, "pool", "drain", pool="gpu")
    order(log, "member", "drain", name="m3")
    order(log, "member", "stop", name="m2", boot="b9")
    back = JobTable.from_state(log.table.to_state())
    assert back.ctl.to_state() == log.table.ctl.to_state()
    assert back.ctl.pool_held("default", "m1") and back.ctl.pool_drained("gpu", "m7")
    assert back.ctl.closed("m3", "x") and back.ctl.stopping("m2", "b9")


@pytest.mark.parametrize("entry", [
    {"k": "pool", "a": "explode", "pool": "default"},
    {"k": "pool", "a": "hold"},
    {"k": "pool", "a": "hold", "pool": "a b"},
    {"k": "pool", "a": "hold", "pool": "x" * (limits.pool_chars_max + 1)},
    {"k": "pool", "a": "hold", "pool": "default", "member": 7},
    {"k": "pool", "a": "hold", "pool": ["default"]},
    {"k": "member", "a": "drain"},
    {"k": "member", "a": "stop", "name": "m1"},
    {"k": "member", "a": "stop", "name": "m1", "boot": "b", "grace_ms": -1},
    {"k": "member", "a": "stop", "name": "m1", "boot": "b", "grace_ms": True},
    {"k": "member", "a": "stop", "name": "m1", "boot": "b" * (limits.boot_chars_max + 1)},
    {"k": "member", "a": "nap", "name": "m1"},
])
def test_malformed_orders_are_refused_not_raised(entry: dict) -> None:
    """Rule 2 of the table: a malformed order is a recorded refusal, and changes nothing."""
    log = Log()
    out = log.apply({"t": T0, **entry})
    assert out["ok"] is False and out["status"] == 400, out
    assert not log.table.ctl.active()
    log.table.check()


def test_orders_are_bounded() -> None:
    """At most ctl_orders_max orders are kept; one more is refused (409), never a crash."""
    ctl = FleetCtl()
    for n in range(limits.ctl_orders_max):
        ctl.held[(f"p{n}", "*")] = None
    log = Log()
    log.table.ctl = ctl
    out = order(log, "member", "drain", name="m1")
    assert out["ok"] is False and out["status"] == 409 and "release" in out["error"]


# --- the member's own rule ----------------------------------------------------------------------


def test_member_does_not_start_a_leased_item_of_a_held_pool() -> None:
    """Hold keeps leased-but-not-started items waiting: the member that holds the lease starts
    it only once the pool is released (the lease stays its own meanwhile)."""
    log = Log()
    log.submit("j1", n=1, argv=["true"])
    log.lease(("j1", 0), member="a", boot="b1")
    order(log, "pool", "hold", pool="default", member="a")
    node = JobNode(log.table, NodeConfig(member="a", boot="b1",
                                         pools={"default": Pool("default", slots=2)}),
                   random.Random(1))
    node.step(Tick(T0 + 10))
    assert not [e for e in node.take() if isinstance(e, Run)]
    assert ("j1", 0) in log.table.leased
    order(log, "pool", "release", pool="default", member="a")
    node.step(Tick(T0 + 20))
    runs = [e for e in node.take() if isinstance(e, Run)]
    assert [(r.job_id, r.index) for r in runs] == [("j1", 0)]


# --- a real member ------------------------------------------------------------------------------

ADMIN, SUBMIT = "admin-token-pools", "submit-token-pools"
POOLS = "[pools.default]\nslots = 1\n[pools.other]\nslots = 1\n[pools.slow]\nslots = 1\n"


def wait_flag(path: str) -> list[str]:
    return ["sh", "-c", f'while [ ! -e "{path}" ]; do sleep 0.05; done']


@pytest.fixture(scope="module")
def member(tmp_path_factory):
    top = str(tmp_path_factory.mktemp("pools"))
    cfg = member_config(top, "p1", POOLS + "[auth]\ntokens = [ "
                        + token_line("a", "admin", ADMIN) + ", "
                        + token_line("s", "submit", SUBMIT) + " ]\n")
    m = Meshd(os.path.join(top, "p1"), name="p1", config=cfg, token=ADMIN)
    yield from running(m)


def submit(m: Meshd, **spec: Any) -> str:
    status, rec = m.request("POST", "/jobs", {"argv": ["true"], **spec})
    assert status == 201, (status, rec)
    return rec["id"]


def job(m: Meshd, job_id: str) -> dict:
    status, rec = m.request("GET", f"/jobs/{job_id}")
    assert status == 200, (status, rec)
    return rec


def pool_row(m: Meshd, pool: str) -> dict:
    status, view = m.request("GET", "/pools")
    assert status == 200, (status, view)
    return next(p for p in view["pools"] if p["pool"] == pool)


def test_pool_hold_and_release_over_http(member: Meshd) -> None:
    """Held, the pool starts nothing (a job in another pool runs meanwhile); released, its job
    runs. GET /pools says held, and how many items wait."""
    status, out = member.request("POST", "/pools/default/hold")
    assert status == 200 and out["held"] is True, (status, out)
    held_job = submit(member)
    member.wait_job(submit(member, pool="other"))  # the leader had its rounds: none leased it
    rec = job(member, held_job)
    assert rec["state"] == "queued" and rec["items_running"] == 0, rec
    row = pool_row(member, "default")
    assert row["held"] is True and row["pending"] == 1 and row["free"] == 0, row
    assert row["members"]["p1"]["held"] is True
    status, out = member.request("POST", "/pools/default/release", {})
    assert status == 200 and out["held"] is False
    assert member.wait_job(held_job)["state"] == "done"
    assert pool_row(member, "default")["held"] is False


def test_pool_drain_lets_running_finish_and_takes_no_more(member: Meshd, tmp_path) -> None:
    """Drained while an item runs: that item ends done, the next one is not started until
    undrain."""
    flag = str(tmp_path / "go")
    jid = submit(member, pool="slow", argv=wait_flag(flag), items=["a", "b"])
    wait_until(lambda: job(member, jid)["items_running"] == 1, what="one item running")
    status, out = member.request("POST", "/pools/slow/drain")
    assert status == 200 and out["drained"] is True
    open(flag, "w").close()
    wait_until(lambda: job(member, jid)["items_done"] == 1, what="the running item done")
    member.wait_job(submit(member, pool="other"))
    rec = job(member, jid)
    assert rec["items_done"] == 1 and rec["items_pending"] == 1 and rec["items_running"] == 0, rec
    row = pool_row(member, "slow")
    assert row["drained"] is True and row["pending"] == 1 and row["running"] == 0, row
    assert member.request("POST", "/pools/slow/undrain")[0] == 200
    assert member.wait_job(jid)["state"] == "done"


def test_meshctl_pool_and_pools(member: Meshd) -> None:
    """meshctl pool hold|release|drain|undrain POOL [--member M], and meshctl pools."""
    r = member.ctl("pool", "hold", "other", "--member", "p1")
    assert r.returncode == 0 and b"held on p1" in r.stdout, r
    r = member.ctl("pools")
    assert r.returncode == 0, r
    line = next(ln for ln in r.stdout.decode().splitlines() if ln.startswith("other"))
    assert "held on p1" in line, r.stdout
    r = member.ctl("--json", "pools")
    view = json.loads(r.stdout)
    other = next(p for p in view["pools"] if p["pool"] == "other")
    assert other["held_on"] == ["p1"] and other["slots"] == 1, other
    r = member.ctl("pool", "release", "other")
    assert r.returncode == 0 and b"taking work" in r.stdout, r
    r = member.ctl("pool", "drain", "other")
    assert r.returncode == 0 and b"drained fleet-wide" in r.stdout, r
    assert member.ctl("pool", "undrain", "other").returncode == 0
    assert not pool_row(member, "other")["drained"]
    r = member.ctl("pool", "hold", "nosuchpool")
    assert r.returncode != 0 and b"unknown pool" in r.stderr, r


def test_member_drain_in_a_fleet_of_one(member: Meshd, tmp_path) -> None:
    """A drained member takes no lease at all (GET /fleet and meshctl fleet say drained) while
    what it runs ends; undrained, its work runs."""
    flag = str(tmp_path / "go")
    running_job = submit(member, pool="slow", argv=wait_flag(flag))
    wait_until(lambda: job(member, running_job)["items_running"] == 1, what="the item running")
    status, out = member.request("POST", "/members/p1/drain")
    assert status == 200 and out["drained"] is True, out
    try:
        waiting = submit(member, pool="other")
        status, fleet = member.request("GET", "/fleet")
        assert fleet["members"][0]["drained"] is True and fleet["members"][0]["stopping"] is False
        assert b"drained" in member.ctl("fleet").stdout
        assert pool_row(member, "other")["members"]["p1"]["member_drained"] is True
        # The leader proposes leases before results in each round: the round that proposed the
        # running item's result would have leased the waiting job, had the drain let it.
        open(flag, "w").close()
        assert member.wait_job(running_job)["state"] == "done"
        assert job(member, waiting)["state"] == "queued"
    finally:
        assert member.request("POST", "/members/p1/undrain")[0] == 200
    assert member.wait_job(waiting)["state"] == "done"


def test_orders_need_admin(member: Meshd) -> None:
    """Pool and member orders change the fleet: the submit role is refused (403), the read
    of GET /pools is not."""
    for path in ("/pools/default/hold", "/pools/default/release", "/members/p1/drain",
                 "/members/p1/stop"):
        status, body = member.request("POST", path, headers={"Authorization": f"Bearer {SUBMIT}"})
        assert status == 403 and "admin" in body["error"], (path, status, body)
    status, _ = member.request("GET", "/pools", headers={"Authorization": f"Bearer {SUBMIT}"})
    assert status == 200
    assert member.request("POST", "/pools/default/hold", auth=False)[0] == 401
    assert not pool_row(member, "default")["held"]


@pytest.mark.parametrize("path,body,status", [
    ("/pools/default/explode", None, 404),
    ("/pools/" + "x" * 65 + "/hold", None, 400),
    ("/pools/a%20b/hold", None, 400),
    ("/pools/%C3%A9/hold", None, 400),
    ("/pools/nosuchpool/hold", None, 404),
    ("/pools/default/hold", [1], 400),
    ("/pools/default/hold", "member", 400),
    ("/pools/default/hold", {"member": 5}, 400),
    ("/pools/default/hold", {"member": "x" * 100}, 400),
    ("/pools/default/hold", {"member": "ghost"}, 404),
    ("/pools/default/hold", {"bogus": 1}, 400),
    ("/members/ghost/drain", None, 404),
    ("/members/p1/drain", {"grace_s": 5}, 400),
    ("/members/p1/stop", {"grace_s": -1}, 400),
    ("/members/p1/stop", {"grace_s": "5"}, 400),
    ("/members/p1/stop", {"grace_s": True}, 400),
    ("/members/p1/stop", {"grace_s": limits.stop_grace_s_max + 1}, 400),
    ("/members/p1/stop", {"name": "p2"}, 400),
    ("/members/p1/nap", None, 404),
    ("/members/x%2Fy/drain", None, 400),
])
def test_hostile_orders_are_refused(member: Meshd, path: str, body: Any, status: int) -> None:
    """Every malformed order is refused with a status and words, and changes nothing."""
    got, answer = member.request("POST", path, body)
    assert got == status, (path, got, answer)
    if isinstance(answer, dict):
        assert answer.get("error"), answer
    assert not pool_row(member, "default")["held"]
    status_f, fleet = member.request("GET", "/fleet")
    assert not fleet["members"][0]["drained"] and not fleet["members"][0]["stopping"]


def test_hostile_order_bodies(member: Meshd) -> None:
    """Not JSON, NaN, and an oversized body: refused, nothing changes."""
    for raw, want in ((b"{nope", 400), (b'{"grace_s": NaN}', 400),
                      (b'{"member": "' + b"a" * (300 * 1024) + b'"}', 413)):
        path = "/members/p1/stop" if b"grace" in raw else "/pools/default/hold"
        got, answer = member.request("POST", path, raw=raw)
        assert got == want, (raw[:40], got, answer)
    assert not pool_row(member, "default")["held"]


def test_meshctl_refuses_bad_flags(member: Meshd) -> None:
    """meshctl checks what it can before asking: a negative --grace, no pool name."""
    r = member.ctl("member", "stop", "p1", "--grace", "-3")
    assert r.returncode == 2 and b"grace" in r.stderr.lower(), r
    r = member.ctl("pool", "hold")
    assert r.returncode == 2, r
    r = member.ctl("member", "drain", "ghost")
    assert r.returncode != 0 and b"no member" in r.stderr, r


def test_help_names_the_commands() -> None:
    """meshctl --help lists pool, pools and member; submit --help lists --notify."""
    out = subprocess.run([sys.executable, "-m", "meshjobs.cli", "--help"], capture_output=True,
                         check=True).stdout.decode()
    for word in ("pool ", "pools ", "member "):
        assert word in out, out
    sub = subprocess.run([sys.executable, "-m", "meshjobs.cli", "job", "submit", "--help"],
                         capture_output=True, check=True).stdout.decode()
    assert "--notify" in sub
    grp = subprocess.run([sys.executable, "-m", "meshjobs.cli", "member", "stop", "--help"],
                         capture_output=True, check=True).stdout.decode()
    assert "--grace" in grp


def test_pool_hold_survives_a_restart(tmp_path) -> None:
    """A hold is committed: the member restarted still holds the pool (its config says
    nothing of it) and starts nothing there until release."""
    top = str(tmp_path)
    cfg = member_config(top, "r1", POOLS)
    m = Meshd(os.path.join(top, "r1"), name="r1", config=cfg)
    try:
        m.start()
        assert m.request("POST", "/pools/default/hold")[0] == 200
        assert m.terminate() == 0
        m.start()
        assert pool_row(m, "default")["held"] is True
        held_job = submit(m)
        m.wait_job(submit(m, pool="other"))
        assert job(m, held_job)["state"] == "queued"
        r = m.ctl("pool", "release", "default")
        assert r.returncode == 0, r
        assert m.wait_job(held_job)["state"] == "done"
    finally:
        m.stop()
