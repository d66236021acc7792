"""Pre-vote, leader stickiness and check-quorum with real voters: a one-way cut of one follower
(iptables drops what reaches its Raft port; it can still send) raises no term and deposes no one,
during the cut or after it heals."""

from __future__ import annotations

import contextlib
import os
import signal

import pytest

from tests.helpers import iptables, leader_of, make_fleet, raft_address, raft_deaf, wait_until

pytestmark = pytest.mark.fleet
needs_iptables = pytest.mark.skipif(
    iptables() is None, reason="needs root and iptables (the CI script installs iptables)")

SUBMITS_MIN = 20


def health(m) -> dict:
    status, h = m.request("GET", "/healthz", timeout_s=5)
    assert status == 200, (m.name, status, h)
    return h


def seam(m, name: str) -> float:
    return m.metrics().get(f"meshjobs_raft_{name}_total", 0.0)


@pytest.fixture
def voters(tmp_path):
    members = make_fleet(str(tmp_path), voters=3)
    yield members
    for m in members:
        with contextlib.suppress(ProcessLookupError):
            if m.proc is not None:
                os.kill(m.pid, signal.SIGCONT)
        m.stop()


@needs_iptables
def test_one_way_cut_follower_raises_no_term_and_deposes_no_one(voters):
    """PreVote + stickiness: a follower that hears nobody asks for pre-votes, which the others
    refuse (they hear the leader), so its term never rises; submits keep committing through the
    leader and the other follower; once the cut heals it follows the same leader at the same
    term. (Before: its elections raised the term by 6-7 in 8 s and, back, it deposed the
    leader.)"""
    members = voters
    for m in members:
        m.start(wait_ready=False)
    for m in members:
        m.wait_ready()
    deaf = min(members, key=raft_address)  # every Raft connection of it is dialled to its port
    lead = leader_of(members)
    if lead is deaf:
        # Make it a follower: stopped, it is replaced; woken, its old term's messages are stale
        # and the new leader's term reaches it (it must not depose the new leader either).
        os.kill(deaf.pid, signal.SIGSTOP)
        try:
            lead = leader_of([m for m in members if m is not deaf])
        finally:
            os.kill(deaf.pid, signal.SIGCONT)
        wait_until(lambda: health(deaf).get("leader") == lead.name, what="the old leader follows")
        assert leader_of(members) is lead
    follower = next(m for m in members if m is not deaf and m is not lead)
    term0 = health(lead)["term"]
    deaf_term0 = health(deaf)["term"]
    tries0 = seam(deaf, "pre_votes_started")
    won0 = seam(deaf, "pre_votes_won")

    submitted = []
    with raft_deaf(deaf):
        def churn_was_tried() -> bool:
            # One submit per check, through the leader and the other follower in turn: each
            # must commit, and no term may rise. Done once the deaf member's election timer
            # fired three times (each used to raise the term), after enough submits.
            m = (lead, follower)[len(submitted) % 2]
            status, rec = m.request("POST", "/jobs", {"argv": ["true"]}, timeout_s=30)
            assert status in (200, 201), (m.name, status, rec)
            submitted.append(rec["id"])
            assert health(deaf)["term"] == deaf_term0, "the cut member raised its term"
            assert health(lead)["term"] == term0, "the leader's term rose"
            return len(submitted) >= SUBMITS_MIN and seam(deaf, "pre_votes_started") >= tries0 + 3
        wait_until(churn_was_tried, timeout_s=120, what="three elections tried by the cut member")
        assert health(deaf)["term"] == deaf_term0, seam_report(members)
        assert seam(deaf, "pre_votes_won") == won0, seam_report(members)
        assert health(lead)["is_leader"]
        assert health(lead)["term"] == term0

    status, rec = lead.request("POST", "/jobs", {"argv": ["true"], "id": "after-heal"})
    assert status in (200, 201), (status, rec)
    wait_until(lambda: deaf.request("GET", "/jobs/after-heal", timeout_s=2)[0] == 200,
             what="the cut member catches up")
    wait_until(lambda: health(deaf).get("leader") == lead.name, what="it follows the same leader")
    for m in members:
        h = health(m)
        assert h["term"] == term0, (m.name, h)
    assert health(lead)["is_leader"]
    for m in members:  # pysyncobj's cry when it deleted applied entries
        assert "truncating already-applied" not in m.log_tail(10**7), m.name
    for job in submitted[-3:]:
        assert deaf.request("GET", f"/jobs/{job}", timeout_s=5)[0] == 200


def seam_report(members) -> str:
    return "; ".join(f"{m.name}: " + ", ".join(
        f"{k.removeprefix('meshjobs_raft_')}={v:g}" for k, v in sorted(m.metrics().items())
        if k.startswith("meshjobs_raft_") and v) for m in members)


def test_leader_that_hears_no_majority_steps_down(voters):
    """CheckQuorum: a leader whose followers are both stopped steps down (counted), and once they
    are back the fleet elects a leader and commits again."""
    members = voters
    for m in members:
        m.start(wait_ready=False)
    for m in members:
        m.wait_ready()
    lead = leader_of(members)
    followers = [m for m in members if m is not lead]
    for m in followers:
        os.kill(m.pid, signal.SIGSTOP)
    try:
        wait_until(lambda: not health(lead)["is_leader"], what="the leader steps down")
        assert seam(lead, "check_quorum_step_downs") >= 1
    finally:
        for m in followers:
            os.kill(m.pid, signal.SIGCONT)
    new = leader_of(members)
    status, rec = new.request("POST", "/jobs", {"argv": ["true"], "id": "after"})
    assert status in (200, 201), (status, rec)


def test_restarted_follower_raises_no_term(voters):
    """PreVote and stickiness keep a restart quiet and do not keep it out: a follower killed
    and restarted catches up and follows the same leader at the same term."""
    members = voters
    for m in members:
        m.start(wait_ready=False)
    for m in members:
        m.wait_ready()
    lead = leader_of(members)
    term0 = health(lead)["term"]
    for m in [m for m in members if m is not lead]:
        status, rec = lead.request("POST", "/jobs", {"argv": ["true"], "id": f"before-{m.name}"})
        assert status in (200, 201), (status, rec)
        m.kill9()
        m.start()
        wait_until(lambda m=m: health(m).get("leader") == lead.name, what=f"{m.name} follows")
        wait_until(lambda m=m: m.request("GET", f"/jobs/before-{m.name}")[0] == 200,
                 what=f"{m.name} catches up")
    for m in members:
        assert health(m)["term"] == term0, (m.name, seam_report(members))
    assert health(lead)["is_leader"]
