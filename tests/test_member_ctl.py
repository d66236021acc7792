"""Members under command (issue 12, point 8), on a fleet of 3 real voters: `meshctl member
drain|undrain|stop NAME [--grace S]` and POST /members/{name}/drain|undrain|stop, forwarded to
the leader and committed like any change (meshjobs/fleetctl.py)."""

from __future__ import annotations

import pytest

from tests.helpers import fleet_running, leader_of, make_fleet, wait_until


def blocked(flag: str) -> list[str]:
    return ["sh", "-c", f'until [ -e "{flag}" ]; do sleep 0.05; done; echo ran']


def record(m, job_id: str, items: bool = False) -> dict:
    status, rec = m.request("GET", f"/jobs/{job_id}" + ("?items=1" if items else ""))
    assert status == 200, (status, rec)
    return rec


def fleet_row(m, name: str) -> dict:
    status, fleet = m.request("GET", "/fleet")
    assert status == 200, (status, fleet)
    return next(r for r in fleet["members"] if r["name"] == name)


def order(m, name: str, action: str, body=None) -> dict:
    status, out = m.request("POST", f"/members/{name}/{action}", body)
    assert status == 200, (status, out)
    return out


@pytest.fixture
def fleet(tmp_path):
    yield from fleet_running(make_fleet(str(tmp_path), voters=3))


def test_drained_member_takes_no_new_items(fleet) -> None:
    """A member drained (through meshctl on another member: forwarded to the leader) runs
    none of a new job's items; meshctl fleet says drained; undrained, it takes work again."""
    lead = leader_of(fleet)
    target = next(m for m in fleet if m is not lead)
    other = next(m for m in fleet if m is not lead and m is not target)
    r = other.ctl("member", "drain", target.name)
    assert r.returncode == 0 and b"drained" in r.stdout, r
    assert fleet_row(lead, target.name)["drained"] is True
    assert b"drained" in lead.ctl("fleet").stdout
    status, rec = lead.request("POST", "/jobs", {"argv": ["sleep", "0.2"],
                                                 "items": [str(i) for i in range(8)]})
    assert status == 201
    done = lead.wait_job(rec["id"], timeout_s=120)
    assert done["state"] == "done"
    ran_on = {it["member"] for it in done["items"]}
    assert target.name not in ran_on and ran_on, ran_on
    r = other.ctl("member", "undrain", target.name)
    assert r.returncode == 0 and b"taking work" in r.stdout, r
    status, rec = lead.request("POST", "/jobs", {"argv": ["sleep", "0.3"],
                                                 "items": [str(i) for i in range(6)]})
    done = lead.wait_job(rec["id"], timeout_s=120)
    assert target.name in {it["member"] for it in done["items"]}


def test_stop_exits_once_running_items_end(fleet, tmp_path) -> None:
    """stop: the member starts nothing more, and its meshd exits by itself with status 0
    (saying why in its log) once its running items have ended, their results committed. Started
    again, it is neither stopping nor drained: the order was for that run."""
    lead = leader_of(fleet)
    target = next(m for m in fleet if m is not lead)
    others = [m for m in fleet if m is not target]
    for m in others:
        order(lead, m.name, "drain")
    flag = str(tmp_path / "go")
    status, rec = lead.request("POST", "/jobs", {"argv": blocked(flag), "items": ["a", "b"]})
    jid = rec["id"]
    wait_until(lambda: record(lead, jid)["items_running"] == 2, what="both items running")
    assert {it["member"] for it in record(lead, jid, items=True)["items"]} == {target.name}
    for m in others:
        order(lead, m.name, "undrain")
    out = order(others[1], target.name, "stop")
    assert out["stopping"] is True
    wait_until(lambda: fleet_row(lead, target.name)["stopping"], what="the fleet says stopping")
    assert b"stopping" in lead.ctl("fleet").stdout
    status, pools = lead.request("GET", "/pools")
    default = next(p for p in pools["pools"] if p["pool"] == "default")
    assert default["members"][target.name]["stopping"] is True
    assert default["members"][target.name]["free"] == 0
    assert target.proc.poll() is None  # its items still run
    open(flag, "w").close()
    assert target.proc.wait(60) == 0
    log = target.log_tail(20_000)
    assert "meshd_stop_ordered" in log and "running items have ended" in log, log[-2000:]
    done = lead.wait_job(jid, timeout_s=60)
    assert done["state"] == "done"
    assert [it["member"] for it in done["items"]] == [target.name, target.name]
    assert [it["attempts"] for it in done["items"]] == [1, 1]
    target.start()
    # The row is the old boot's until the new boot's hello reaches the leader: wait for that.
    wait_until(
        lambda: (row := fleet_row(lead, target.name))["alive"]
        and row["stopping"] is False
        and row["drained"] is False,
        what="the new boot's row: alive, neither stopping nor drained",
    )


def test_stop_with_grace_cuts_and_the_item_runs_elsewhere(fleet, tmp_path) -> None:
    """stop --grace S: what still runs after S seconds is cut, the member exits 0 saying so,
    and the item's lease is revoked and the item runs on another member."""
    lead = leader_of(fleet)
    target = next(m for m in fleet if m is not lead)
    others = [m for m in fleet if m is not target]
    for m in others:
        order(lead, m.name, "drain")
    flag = str(tmp_path / "go")
    status, rec = lead.request("POST", "/jobs", {"argv": blocked(flag)})
    jid = rec["id"]
    wait_until(lambda: record(lead, jid)["items_running"] == 1, what="the item running")
    for m in others:
        order(lead, m.name, "undrain")
    r = lead.ctl("member", "stop", target.name, "--grace", "0.5")
    assert r.returncode == 0 and b"stopping" in r.stdout, r
    assert target.proc.wait(60) == 0
    assert "grace of 0.5 s is over" in target.log_tail(20_000)
    wait_until(lambda: record(lead, jid, items=True)["items"][0]["member"] not in
               (None, target.name), timeout_s=60, what="the item leased elsewhere")
    open(flag, "w").close()
    done = lead.wait_job(jid, timeout_s=60)
    item = done["items"][0]
    assert done["state"] == "done" and item["member"] != target.name and item["attempts"] == 2


def test_stop_of_an_unknown_member_is_refused(fleet) -> None:
    """A member the fleet does not know cannot be stopped or drained (404, naming it), once
    the leader has heard from every member (before, it cannot tell yet: 503)."""
    lead = leader_of(fleet)
    wait_until(lambda: all(m.get("alive") is True
                           for m in lead.request("GET", "/fleet")[1]["members"]),
               what="every member alive in the leader's view")
    for action in ("stop", "drain"):
        status, body = lead.request("POST", f"/members/ghost/{action}")
        assert status == 404 and "ghost" in body["error"], body


def test_pool_hold_survives_a_leader_failover(fleet) -> None:
    """A pool hold is a committed entry: the leader killed (-9), the new leader still holds
    the pool (and says so), leases nothing there, and leases it again once released."""
    lead = leader_of(fleet)
    r = lead.ctl("pool", "hold", "default")
    assert r.returncode == 0 and b"held fleet-wide" in r.stdout, r
    status, rec = lead.request("POST", "/jobs", {"argv": ["true"]})
    assert status == 201
    jid = rec["id"]
    lead.kill9()
    rest = [m for m in fleet if m is not lead]
    new = leader_of(rest)
    status, pools = new.request("GET", "/pools")
    assert next(p for p in pools["pools"] if p["pool"] == "default")["held"] is True
    assert record(new, jid)["state"] == "queued"
    assert new.request("POST", "/pools/default/release")[0] == 200
    assert new.wait_job(jid, timeout_s=60)["state"] == "done"
