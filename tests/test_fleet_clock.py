"""Members whose wall clocks disagree by minutes still make a fleet: the member links compare no
clocks (a leader 120 s ahead used to have every frame of its peers refused as `clock`, and the
fleet finished nothing)."""

from __future__ import annotations

import pytest

from tests.helpers import leader_of, make_fleet, metrics, shift_clock, start_all, submit, wait_until

pytestmark = pytest.mark.fleet


@pytest.fixture
def skewed(tmp_path):
    members = make_fleet(str(tmp_path), voters=3, workers=1)
    by_name = {m.name: m for m in members}
    # v1 two minutes ahead, the worker two minutes behind: four minutes between them. The
    # worker joins through v1 (make_fleet's `join`), so discovery crosses the skew too.
    shift_clock(by_name["v1"], 120)
    shift_clock(by_name["w1"], -120)
    try:
        start_all(members)
        yield by_name
    finally:
        for m in members:
            m.stop()


def test_members_minutes_apart_link_and_finish_jobs(skewed):
    """Rule: no link refuses a frame for its clock. Every member links to every other, five
    jobs finish with items run on every member, and the skew is only logged."""
    members = list(skewed.values())
    voters = [m for m in members if m.name.startswith("v")]
    for m in members:
        # A voter links to the two other voters and the worker; the worker to the voters.
        wait_until(lambda m=m: metrics(m).get("meshjobs_links_peers_up") == 3,
                 what=f"{m.name} linked to every other member")
    leader = leader_of(voters)
    ids = [submit(leader, {"argv": ["sh", "-c", "sleep 0.2; echo ok-$MESH_ITEM_INDEX"],
                           "items": [""] * 16})["id"] for _ in range(5)]
    ran_on: set[str] = set()
    for job in ids:
        for m in members:
            rec = m.wait_job(job, timeout_s=120)
            assert rec["state"] == "done", (m.name, rec)
        ran_on |= {i["member"] for i in leader.wait_job(job)["items"]}
    assert {"v1", "w1"} <= ran_on, ran_on  # the skewed members ran items too
    for m in members:
        mt = metrics(m)
        refused = {k: v for k, v in mt.items() if k.startswith("meshjobs_links_dropped_total{")
                   and k != 'meshjobs_links_dropped_total{reason="discovery"}'}
        assert refused == {}, (m.name, refused)
    assert "link_clock_skew" in skewed["v2"].log_tail(200_000)
    assert "link_refused" not in "".join(m.log_tail(200_000) for m in members)
