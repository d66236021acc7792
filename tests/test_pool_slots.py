"""A pool's slots set while the fleet runs (issue 12, point 4: `slots`): `meshctl pool slots
POOL N|--reset [--member M]` and POST /pools/{pool}/slots, a committed order over the members'
config (meshjobs/fleetctl.py).

Table rules first (pure), then the member's own start rule, then a real fleet of one: more
slots run more items at once, a reset goes back to the config, the order survives a restart,
and hostile input is refused.
"""

from __future__ import annotations

import os
import random
from typing import Any

import pytest

from meshjobs import limits
from meshjobs.fleetctl import FleetCtl
from meshjobs.node import JobNode, NodeConfig, Pool, Run, Tick
from meshjobs.table import JobTable
from tests.helpers import Log, Meshd, member_config, running, token_line, wait_until

T0 = 1_700_000_000_000


def slots(log: Log, pool: str, n: int | None, member: str | None = None) -> dict:
    e: dict[str, Any] = {"k": "pool", "t": T0, "a": "slots", "pool": pool, "slots": n}
    if member is not None:
        e["member"] = member
    return log.apply(e)


# --- the table --------------------------------------------------------------------------------


def test_slots_order_sets_and_resets() -> None:
    """A fleet-wide slots order sets every member's slots of the pool; a reset goes back to
    the config, and leaves no order behind."""
    log = Log()
    out = slots(log, "default", 3)
    assert out["ok"] and out["slots_set"] == 3 and out["slots_set_on"] == {}
    ctl = log.table.ctl
    assert ctl.slots_of("default", "m1", 1) == 3 and ctl.slots_of("other", "m1", 1) == 1
    out = slots(log, "default", None)
    assert out["ok"] and out["slots_set"] is None
    assert ctl.slots_of("default", "m1", 1) == 1 and not ctl.active()
    log.table.check()


def test_member_override_wins_over_fleet_wide_and_config() -> None:
    """Effective slots: the member's own override, else the fleet-wide one, else the config;
    a member reset drops only its own, a fleet-wide reset every override of the pool."""
    log = Log()
    slots(log, "default", 4)
    slots(log, "default", 0, member="m2")
    ctl = log.table.ctl
    assert ctl.slots_of("default", "m1", 1) == 4
    assert ctl.slots_of("default", "m2", 1) == 0
    assert ctl.effective("m2", {"default": 1, "gpu": 2}) == {"default": 0, "gpu": 2}
    slots(log, "default", None, member="m2")
    assert ctl.slots_of("default", "m2", 1) == 4
    slots(log, "default", 7, member="m3")
    slots(log, "default", None)
    assert not ctl.active()


def test_override_adds_no_pool_and_no_slots_to_a_closed_pool() -> None:
    """A pool a member's config lacks stays absent; one its config gives no slots (slots 0,
    hold or drain) keeps none: the config's word is final there."""
    log = Log()
    slots(log, "gpu", 5)
    ctl = log.table.ctl
    assert ctl.effective("m1", {"default": 2}) == {"default": 2}
    slots(log, "default", 5)
    assert ctl.effective("m1", {"default": 0}) == {"default": 0}


def test_slots_zero_refuses_no_lease_in_the_table_but_is_kept() -> None:
    """The slots order is the leader's business (room), not a refusal rule of the table: the
    table keeps it and still applies leases (committed ones stay valid)."""
    log = Log()
    log.submit("j1", n=1)
    slots(log, "default", 0)
    assert log.lease(("j1", 0))[0]["granted"] == 1


def test_slots_orders_survive_a_snapshot() -> None:
    """Slots orders are part of the table's state, alone or with other orders."""
    log = Log()
    slots(log, "default", 3)
    slots(log, "gpu", 0, member="m2")
    back = JobTable.from_state(log.table.to_state())
    assert back.ctl.slots == log.table.ctl.slots
    assert back.ctl.slots_of("gpu", "m2", 4) == 0 and back.ctl.slots_of("default", "m9", 1) == 3
    log.apply({"k": "pool", "t": T0, "a": "hold", "pool": "x"})
    back = JobTable.from_state(log.table.to_state())
    assert back.ctl.to_state() == log.table.ctl.to_state()
    back.check()


@pytest.mark.parametrize("entry", [
    {"a": "slots", "pool": "default"},
    {"a": "slots", "pool": "default", "slots": -1},
    {"a": "slots", "pool": "default", "slots": limits.pool_slots_max + 1},
    {"a": "slots", "pool": "default", "slots": True},
    {"a": "slots", "pool": "default", "slots": "3"},
    {"a": "slots", "pool": "default", "slots": 2.0},
    {"a": "slots", "pool": "a b", "slots": 2},
    {"a": "slots", "pool": "default", "slots": 2, "member": 5},
    {"a": "slots", "slots": 2},
])
def test_malformed_slots_orders_are_refused(entry: dict) -> None:
    """A malformed slots entry is a recorded refusal (400) and changes nothing."""
    log = Log()
    out = log.apply({"k": "pool", "t": T0, **entry})
    assert out["ok"] is False and out["status"] == 400, out
    assert not log.table.ctl.active()
    log.table.check()


def test_slots_orders_are_bounded() -> None:
    """Slots orders count toward ctl_orders_max: one more is refused (409); changing one
    already kept is not a new one."""
    ctl = FleetCtl()
    for n in range(limits.ctl_orders_max - 1):
        ctl.held[(f"p{n}", "*")] = None
    log = Log()
    log.table.ctl = ctl
    assert slots(log, "default", 2)["ok"]
    assert slots(log, "default", 5)["ok"]
    out = slots(log, "default", 5, member="m1")
    assert out["ok"] is False and out["status"] == 409
    ctl.check()


# --- the member's own start rule ------------------------------------------------------------------


def test_member_starts_up_to_its_effective_slots() -> None:
    """Items leased ahead to a member start up to the pool's effective slots: one with the
    config's 1, all three once slots are set to 3."""
    log = Log()
    log.submit("j1", n=3, argv=["true"])
    log.lease(("j1", 0), ("j1", 1), ("j1", 2), member="a", boot="b1")
    node = JobNode(log.table, NodeConfig(member="a", boot="b1",
                                         pools={"default": Pool("default", slots=1)}),
                   random.Random(1))
    node.step(Tick(T0 + 10))
    assert len([e for e in node.take() if isinstance(e, Run)]) == 1
    slots(log, "default", 3, member="a")
    node.step(Tick(T0 + 20))
    assert len([e for e in node.take() if isinstance(e, Run)]) == 2


# --- a real fleet of one ----------------------------------------------------------------------

ADMIN, SUBMIT = "admin-token-slots", "submit-token-slots"
POOLS = "[pools.default]\nslots = 1\n[pools.other]\nslots = 2\n"


def gated(folder: str, name: str, gate: str) -> list[str]:
    """An item that says it started (a file) and waits for its gate."""
    return ["sh", "-c", f'touch "{folder}/{name}"; while [ ! -e "{gate}" ]; do sleep 0.05; done']


def started(folder: str) -> set[str]:
    return {n for n in os.listdir(folder) if n.startswith("s")}


def submit(m: Meshd, argv: list[str], **spec: Any) -> str:
    status, rec = m.request("POST", "/jobs", {"argv": argv, **spec})
    assert status == 201, (status, rec)
    return rec["id"]


def pool_row(m: Meshd, pool: str) -> dict:
    status, view = m.request("GET", "/pools")
    assert status == 200, (status, view)
    return next(p for p in view["pools"] if p["pool"] == pool)


def fleet_slots(m: Meshd) -> tuple[int, dict]:
    status, fleet = m.request("GET", "/fleet")
    assert status == 200, (status, fleet)
    row = fleet["members"][0]
    return row["slots"], row["pools"]


def runs_started(m: Meshd) -> float:
    return m.metrics().get("meshjobs_node_runs_started_total", 0)


def one_runs_rest_wait(m: Meshd, folder: str, names: set[str], runs_before: float,
                       pool: str = "default") -> None:
    """Wait until one item started and the leader has placed the rest (pending, or leased
    ahead to this member when the pool's items are known to be short), then only one of them
    has started: the slot is the limit."""
    wait_until(lambda: len(started(folder) & names) >= 1, what="one item started")

    def placed() -> bool:
        row = pool_row(m, pool)
        return row["running"] >= 1 and row["running"] + row["pending"] == len(names)

    wait_until(placed, what="one running, the rest pending or leased ahead")
    assert runs_started(m) - runs_before == 1
    assert len(started(folder) & names) == 1, started(folder)


@pytest.fixture(scope="module")
def member(tmp_path_factory):
    top = str(tmp_path_factory.mktemp("slots"))
    cfg = member_config(top, "q1", POOLS + "[auth]\ntokens = [ "
                        + token_line("a", "admin", ADMIN) + ", "
                        + token_line("s", "submit", SUBMIT) + " ]\n")
    m = Meshd(os.path.join(top, "q1"), name="q1", config=cfg, token=ADMIN)
    yield from running(m)


def test_raising_slots_runs_more_at_once_and_reset_goes_back(member: Meshd, tmp_path) -> None:
    """Config slots 1, three gated items: one runs. `meshctl pool slots default 3`: all three
    run at once (fleet and pools say 3, `(set)`). `--reset`: back to one for new items."""
    m, folder = member, str(tmp_path)
    gate = os.path.join(folder, "gate1")
    before = runs_started(m)
    ids = [submit(m, gated(folder, f"s{k}", gate)) for k in range(3)]
    one_runs_rest_wait(m, folder, {"s0", "s1", "s2"}, before)
    r = m.ctl("pool", "slots", "default", "3")
    assert r.returncode == 0 and b"slots 3 (set)" in r.stdout, r
    wait_until(lambda: started(folder) >= {"s0", "s1", "s2"}, what="all three running at once")
    assert fleet_slots(m) == (5, {"default": 3, "other": 2})
    row = pool_row(m, "default")
    assert row["slots"] == 3 and row["slots_set"] == 3 and row["members"]["q1"]["slots_set"] == 3
    assert b"slots 3 (set)" in m.ctl("pools").stdout
    open(gate, "w").close()
    for job_id in ids:
        assert m.wait_job(job_id)["state"] == "done"

    r = m.ctl("pool", "slots", "default", "--reset")
    assert r.returncode == 0 and b"(set)" not in r.stdout, r
    assert fleet_slots(m) == (3, {"default": 1, "other": 2})
    gate = os.path.join(folder, "gate2")
    before = runs_started(m)
    ids = [submit(m, gated(folder, f"s{k}", gate)) for k in range(3, 5)]
    one_runs_rest_wait(m, folder, {"s3", "s4"}, before)
    open(gate, "w").close()
    for job_id in ids:
        assert m.wait_job(job_id)["state"] == "done"


def test_lowering_slots_starts_fewer_and_cuts_nothing(member: Meshd, tmp_path) -> None:
    """Pool other (config 2) set to 1 on this member over HTTP while two items run: both go on
    to their end; of two more, only one starts."""
    m, folder = member, str(tmp_path)
    gate = os.path.join(folder, "gate")
    first = [submit(m, gated(folder, f"s{k}", gate), pool="other") for k in range(2)]
    wait_until(lambda: started(folder) >= {"s0", "s1"}, what="two running")
    status, out = m.request("POST", "/pools/other/slots", {"slots": 1, "member": "q1"})
    assert status == 200 and out["slots_set_on"] == {"q1": 1}, (status, out)
    gate2 = os.path.join(folder, "gate2")
    later = [submit(m, gated(folder, f"s{k}", gate2), pool="other") for k in range(2, 4)]
    wait_until(lambda: pool_row(m, "other")["pending"] == 2, what="two waiting")
    before = runs_started(m)
    open(gate, "w").close()
    for job_id in first:
        assert m.wait_job(job_id)["state"] == "done"  # not cut by the lower number
    one_runs_rest_wait(m, folder, {"s2", "s3"}, before, pool="other")
    status, out = m.request("POST", "/pools/other/slots", {"slots": None})
    assert status == 200 and out["slots_set_on"] == {}, (status, out)
    open(gate2, "w").close()
    for job_id in later:
        assert m.wait_job(job_id)["state"] == "done"


def test_slots_order_needs_admin(member: Meshd) -> None:
    """The submit role is refused (403), no token 401; nothing changes."""
    status, body = member.request("POST", "/pools/default/slots", {"slots": 2},
                                  headers={"Authorization": f"Bearer {SUBMIT}"})
    assert status == 403 and "admin" in body["error"], (status, body)
    assert member.request("POST", "/pools/default/slots", {"slots": 2}, auth=False)[0] == 401
    assert pool_row(member, "default")["slots_set"] is None


@pytest.mark.parametrize("path,body,status", [
    ("/pools/default/slots", None, 400),
    ("/pools/default/slots", {}, 400),
    ("/pools/default/slots", {"slots": -1}, 400),
    ("/pools/default/slots", {"slots": limits.pool_slots_max + 1}, 400),
    ("/pools/default/slots", {"slots": 10 ** 30}, 400),
    ("/pools/default/slots", {"slots": "3"}, 400),
    ("/pools/default/slots", {"slots": True}, 400),
    ("/pools/default/slots", {"slots": 1.5}, 400),
    ("/pools/default/slots", {"slots": [3]}, 400),
    ("/pools/default/slots", {"slots": 2, "bogus": 1}, 400),
    ("/pools/default/slots", {"slots": 2, "member": "a b"}, 400),
    ("/pools/default/slots", {"slots": 2, "member": "ghost"}, 404),
    ("/pools/default/slots", [2], 400),
    ("/pools/ghost/slots", {"slots": 2}, 404),
    ("/pools/a%20b/slots", {"slots": 2}, 400),
])
def test_hostile_slots_orders_are_refused(member: Meshd, path: str, body: Any,
                                          status: int) -> None:
    """Every malformed slots order is refused with a status and words, and changes nothing."""
    got, answer = member.request("POST", path, body)
    assert got == status, (path, body, got, answer)
    assert isinstance(answer, dict) and answer.get("error"), answer
    assert pool_row(member, "default")["slots_set"] is None
    assert fleet_slots(member)[1]["default"] == 1


def test_meshctl_refuses_bad_slots(member: Meshd) -> None:
    """meshctl checks N before asking; an unknown pool gets the member's words."""
    for args in (["default", "-1"], ["default", "abc"], ["default", "1000001"], ["default"],
                 ["default", "3", "--reset"]):
        r = member.ctl("pool", "slots", *args)
        assert r.returncode == 2, (args, r)
    r = member.ctl("pool", "slots", "ghost", "2")
    assert r.returncode != 0 and b"unknown pool" in r.stderr, r
    r = member.ctl("pool", "slots", "default", "2", "--member", "ghost")
    assert r.returncode != 0 and b"no member" in r.stderr, r
    assert pool_row(member, "default")["slots_set"] is None


def test_slots_survive_a_restart(tmp_path) -> None:
    """A slots order is committed: the member restarted still runs the pool with the slots
    set (its config says 1), two gated items at once."""
    top = str(tmp_path)
    cfg = member_config(top, "r1", POOLS)
    m = Meshd(os.path.join(top, "r1"), name="r1", config=cfg)
    folder = os.path.join(top, "flags")
    os.makedirs(folder)
    try:
        m.start()
        assert m.request("POST", "/pools/default/slots", {"slots": 2})[0] == 200
        assert m.terminate() == 0
        m.start()
        assert pool_row(m, "default")["slots_set"] == 2
        assert fleet_slots(m)[1]["default"] == 2
        gate = os.path.join(folder, "gate")
        ids = [submit(m, gated(folder, f"s{k}", gate)) for k in range(2)]
        wait_until(lambda: started(folder) >= {"s0", "s1"}, what="both running at once")
        open(gate, "w").close()
        for job_id in ids:
            assert m.wait_job(job_id)["state"] == "done"
    finally:
        m.stop()
