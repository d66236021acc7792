"""Earlier attempts and why a job waits, on real members (issue 27 points 3 and 4): real meshd
processes on 127.0.0.1 in temporary folders, stopped by pid, also on failure."""

from __future__ import annotations

import json
import os

import pytest

from tests.helpers import Meshd, fleet_running, leader_of, make_fleet, running, submit, wait_until

pytestmark = pytest.mark.fleet


@pytest.fixture
def fleet(tmp_path):
    yield from fleet_running(make_fleet(str(tmp_path), voters=3, slots=1))


@pytest.fixture
def member(tmp_path):
    yield from running(Meshd(os.path.join(str(tmp_path), "m1"), slots=1))


def test_a_lost_leader_leaves_its_attempt_said(fleet):
    """kill -9 of the leader while it runs an item: the item runs again on another member
    (attempt 2), and its record on every member, `job status` and the job page say that
    attempt 1 was lost with that member."""
    leader = leader_of(fleet)
    # One item per member (one slot each): the leader runs one of them.
    submit(leader, {"argv": ["sh", "-c", "sleep 2; echo ok"], "items": [""] * 3, "id": "lost"})

    def on_leader():
        items = leader.record("lost", items=True)["items"]
        return [it["index"] for it in items
                if it["member"] == leader.name and it["state"] == "leased" and it["started_at"]]

    i = wait_until(on_leader, what="an item runs on the leader")[0]
    leader.kill9()
    rest = [m for m in fleet if m is not leader]
    new = leader_of(rest)
    done = new.wait_job("lost", timeout_s=120)
    assert done["state"] == "done", done
    item = done["items"][i]
    assert item["attempts"] == 2 and item["member"] != leader.name, item
    first = item["earlier_attempts"][0]
    assert first["attempt"] == 1 and first["member"] == leader.name, item
    assert first["why"].startswith(f"lost with member {leader.name} ("), first
    for m in rest:  # committed: every member says the same
        assert wait_until(lambda m=m: m.record("lost", items=True)["items"][i]
                          ["earlier_attempts"] == item["earlier_attempts"], what=m.name)
    text = rest[0].ctl("job", "status", "lost").stdout.decode()
    assert f"item {i}: attempt 1: lost with member {leader.name} (" in text, text
    status, page = rest[1].request("GET", "/jobs/lost?format=html")
    assert status == 200 and b"Earlier attempts" in page
    assert f"lost with member {leader.name}".encode() in page


def test_a_held_pool_says_why_its_job_waits(member):
    """After `meshctl pool hold default` a new job says why it waits, in `job status`, the
    JSON (`waiting_for`, `waiting_reasons`) and the job page; released, it runs and says
    nothing more."""
    assert member.ctl("pool", "hold", "default").returncode == 0
    submit(member, {"argv": ["true"], "id": "held"})
    rec = member.record("held")
    assert rec["state"] == "queued" and rec["items_pending"] == 1
    assert "pool 'default' held fleet-wide (meshctl pool release default)" in rec["waiting_for"]
    assert [r["reason"] for r in rec["waiting_reasons"]] == ["pool_held"]
    text = member.ctl("job", "status", "held").stdout.decode()
    assert "waiting    pool 'default' held fleet-wide" in text, text
    js = json.loads(member.ctl("--json", "job", "status", "held").stdout)
    assert js["waiting_for"] == rec["waiting_for"]
    status, page = member.request("GET", "/jobs/held?format=html")
    assert status == 200 and b"held fleet-wide" in page
    assert member.ctl("pool", "release", "default").returncode == 0
    assert member.wait_job("held")["state"] == "done"
    assert "waiting_for" not in member.record("held")


def test_a_job_behind_a_busy_slot_says_how_many_are_ahead(member):
    """With the only slot busy, a job waits for a free slot behind the items leased first."""
    submit(member, {"argv": ["sleep", "30"], "id": "busy"})
    wait_until(lambda: member.record("busy")["items_running"] == 1, what="the slot is taken")
    submit(member, {"argv": ["true"], "items": [""] * 2, "id": "ahead"})
    submit(member, {"argv": ["true"], "id": "behind"})
    rec = member.record("behind")
    assert "a free slot in pool 'default' (2 item(s) ahead of it)" in rec["waiting_for"], rec
    text = member.ctl("job", "status", "behind").stdout.decode()
    assert "2 item(s) ahead of it" in text, text
    for j in ("busy", "ahead", "behind"):
        member.request("POST", f"/jobs/{j}/cancel")
