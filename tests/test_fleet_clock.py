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


def _offsets() -> dict[str, int]:
    """Each member's wall clock in the `skewed` fleet, ms off the right time."""
    return {"v1": 120_000, "v2": 0, "v3": 0, "w1": -120_000}


def test_skew_is_shown_in_fleet_metrics_page_and_meshctl(skewed):
    """docs/security.md: the skew between members is shown. GET /fleet has each member's
    clock_skew_ms against the leader's clock (from its reports); /metrics has each peer's
    against this member's (from its hello); the fleet page and meshctl fleet show the skew and
    warn of each member further off than link_clock_skew_warn_ms."""
    voters = [m for m in skewed.values() if m.name.startswith("v")]
    leader = leader_of(voters)
    off = _offsets()
    want = {name: ms - off[leader.name] for name, ms in off.items()}

    def shown() -> dict | None:
        status, fleet = leader.request("GET", "/fleet")
        rows = {m["name"]: m.get("clock_skew_ms") for m in fleet.get("members", [])}
        return rows if status == 200 and set(rows) == set(off) and all(
            isinstance(v, int) for v in rows.values()) else None

    rows = wait_until(shown, what="every member's clock skew in /fleet")
    assert rows[leader.name] == 0
    for name, ms in rows.items():
        assert abs(ms - want[name]) < 10_000, (name, ms, want)
    far = sorted(n for n, ms in want.items() if abs(ms) > 30_000)
    assert far  # v1 and w1, or (v1 leading) everyone else

    mt = metrics(skewed["v2"])
    assert abs(mt['meshjobs_links_clock_skew_ms{peer="v1"}'] - 120_000) < 10_000, mt
    assert abs(mt['meshjobs_links_clock_skew_ms{peer="w1"}'] + 120_000) < 10_000, mt
    assert abs(mt['meshjobs_links_clock_skew_ms{peer="v3"}']) < 10_000, mt

    status, _, page = leader.raw_request("GET", "/fleet?format=html")
    assert status == 200
    text = page.decode()
    for name in far:
        assert f'data-clock-warning="{name}"' in text, text
        assert f"{rows[name] / 1000:+.1f} s" in text
    near = sorted(set(off) - set(far))
    assert not any(f'data-clock-warning="{n}"' in text for n in near), text

    out = leader.ctl("fleet")
    assert out.returncode == 0, out.stderr
    said = out.stdout.decode()
    assert "CLOCK" in said
    for name in far:
        assert f"WARNING: {name}: its wall clock is " in said, said
    assert not any(f"WARNING: {n}: its wall clock" in said for n in near), said
