"""Retention across leaders whose clocks disagree, on real members (issue 26, point 3): a job
that ended under a leader whose clock was right is kept `keep_s` after it ended, also once a
leader two minutes ahead takes over. (It used to be expired at once: the new leader compared
its own clock with the old leader's stamp.)"""

from __future__ import annotations

import time

import pytest

from tests.helpers import leader_of, make_fleet, shift_clock, start_all, submit, wait_until

pytestmark = pytest.mark.fleet

KEEP_S = 30  # [retention] keep_s of the fleet
SLACK_S = 3.0  # what the test's own view of the job's end may lag its committed end


@pytest.fixture
def fleet(tmp_path):
    members = make_fleet(str(tmp_path), voters=3, extra=f"[retention]\nkeep_s = {KEEP_S}\n")
    shift_clock(members[2], 120)  # v3: two minutes ahead
    try:
        start_all(members)
        yield {m.name: m for m in members}
    finally:
        for m in members:
            m.stop()


def test_a_leader_ahead_keeps_a_job_keep_s_after_it_ended(fleet):
    """Rule 7 of table.py, with real members: a job ends under v1 or v2 (right clocks) while
    the other is down; then its leader is killed and the other comes back behind the log, so
    that v3 (120 s ahead) must lead. The job is still there when v3 leads, and it is expired
    about keep_s after it ended (not before), by v3."""
    ahead = fleet["v3"]
    leader = leader_of(list(fleet.values()))
    if leader is ahead:
        # A leader with the right clock first: v3 restarted does not win against a leader the
        # others still hear (pre-vote and stickiness), and catches up as a follower.
        ahead.terminate()
        leader = leader_of([fleet["v1"], fleet["v2"]])
        ahead.start()
    other = fleet["v2"] if leader.name == "v1" else fleet["v1"]
    other.terminate()  # down while the job runs: its log will lack the job's entries

    job = submit(leader, {"argv": ["true"]})["id"]
    assert leader.wait_job(job)["state"] == "done"
    seen_done = time.monotonic()  # at or after the batch that ended it
    wait_until(lambda: ahead.request("GET", f"/jobs/{job}")[1].get("state") == "done",
               what="v3 applying the job's end")

    leader.kill9()
    other.start(wait_ready=False)  # behind the log: it votes for v3, never v3 for it
    assert leader_of([ahead, other]) is ahead
    status, rec = ahead.request("GET", f"/jobs/{job}")
    assert status == 200 and rec["state"] == "done", (status, rec)

    def expired() -> bool:
        status, body = ahead.request("GET", f"/jobs/{job}")
        return status == 404 and "forgotten" in body.get("error", "")

    wait_until(expired, timeout_s=KEEP_S + 60, what="the job expired")
    kept_s = time.monotonic() - seen_done
    assert kept_s >= KEEP_S - SLACK_S, f"expired {kept_s:.1f} s after it ended, keep_s {KEEP_S}"
    assert ahead.request("GET", "/healthz")[1].get("is_leader"), "v3 no longer leads"
