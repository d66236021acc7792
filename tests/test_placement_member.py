"""Placement on real members (issue 12 point 1), 3 voters: `meshctl job submit --member NAME`
pins a job's items to that member, a glob spreads them over matching members only, `*` (and
`--pool POOL@*`) runs the job once on every member (each item on its own member, as its
record and MESH_MEMBER say); a job no alive member matches waits and says why (`job status`
text and JSON, GET /jobs/ID on any member); a member that leaves keeps its items waiting,
never moved elsewhere, and runs them when it is back; bad selectors are refused.

"Not run elsewhere" is checked after another job has been leased and has ended, so that the
leader provably had rounds in which it could have placed the waiting items, never after a
fixed sleep.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator

import pytest

from tests.helpers import Meshd, leader_of, make_fleet, start_all, wait_until

pytestmark = pytest.mark.fleet


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Meshd]]:
    members = make_fleet(str(tmp_path_factory.mktemp("place")), voters=3)
    try:
        start_all(members)
        lead = leader_of(members)
        # The leader fixes a fan-out's members only once it has heard from every voter.
        wait_until(lambda: all(m.get("alive") is True
                               for m in lead.request("GET", "/fleet")[1]["members"]),
                   what="every member alive in the leader's view")
        yield members
    finally:
        for m in members:
            m.stop()


def _submit(m: Meshd, *args: str) -> subprocess.CompletedProcess:
    """meshctl job submit, tried again while the answer is 503/no leader (an election, or a
    leader that has not heard from everyone yet); the job's --id makes a retry harmless."""
    def attempt() -> subprocess.CompletedProcess | None:
        r = m.ctl("job", "submit", *args)
        return None if r.returncode == 4 else r
    return wait_until(attempt, what=f"submit {args}")


ECHO_MEMBER = ["sh", "-c", 'echo "$MESH_MEMBER"']


def _others_done(m: Meshd, job_id: str, n: int = 6) -> None:
    """A plain job of `n` items, run to its end: leasing rounds have passed."""
    r = _submit(m, "--id", job_id, "--", "true")
    assert r.returncode == 0, r.stderr
    assert m.wait_job(job_id)["state"] == "done"


def test_member_pins_every_item(fleet):
    """--member NAME: every item runs on that member (the item records and MESH_MEMBER say
    so), though the job was submitted elsewhere and other members have room."""
    lead = leader_of(fleet)
    target = next(m for m in fleet if m is not lead)
    r = lead.ctl("job", "submit", "--id", "pinned", "--member", target.name, "--items-from", "-",
                 "--", *ECHO_MEMBER, input=b"a\nb\nc\nd\ne\nf\n")
    assert r.returncode == 0, r.stderr
    done = lead.wait_job("pinned")
    assert done["state"] == "done" and done["member"] == target.name
    assert {it["member"] for it in done["items"]} == {target.name}
    assert lead.request("GET", "/jobs/pinned/results")[1].decode().split() == [target.name] * 6
    text = lead.ctl("job", "status", "pinned").stdout.decode()
    assert f"member     {target.name}" in text


def test_glob_spreads_over_matching_members_only(fleet):
    """--member GLOB: the items go to members whose names match, never to the other one; the
    pool@member short form does the same."""
    names = sorted(m.name for m in fleet)
    glob = "v[" + "".join(n[-1] for n in names[1:]) + "]"  # e.g. v[23]: all but the first
    for job_id, args in (("glob", ["--member", glob]), ("poolat", ["--pool", f"default@{glob}"])):
        r = fleet[0].ctl("job", "submit", "--id", job_id, *args, "--items-from", "-", "--",
                         *ECHO_MEMBER, input=b"".join(b"%d\n" % i for i in range(12)))
        assert r.returncode == 0, r.stderr
        done = fleet[0].wait_job(job_id)
        assert done["state"] == "done" and done["member"] == glob and done["pool"] == "default"
        ran = {it["member"] for it in done["items"]}
        assert ran <= set(names[1:]) and ran, ran
        assert names[0] not in fleet[0].request("GET", f"/jobs/{job_id}/results")[1].decode()


def test_fanout_runs_once_on_every_member(fleet):
    """--member '*' (and --pool default@*): one item per member, item i for members[i], each
    run on its own member (record and MESH_MEMBER), shown by `job status`."""
    names = sorted(m.name for m in fleet)
    for job_id, args in (("fan", ["--member", "*"]), ("fan2", ["--pool", "default@*"])):
        r = _submit(fleet[1], "--id", job_id, *args, "--", *ECHO_MEMBER)
        assert r.returncode == 0, r.stderr
        done = fleet[1].wait_job(job_id)
        assert done["state"] == "done" and done["items_total"] == 3
        assert done["members"] == names
        assert [it["for_member"] for it in done["items"]] == names
        assert [it["member"] for it in done["items"]] == names
        out = fleet[1].request("GET", f"/jobs/{job_id}/results")[1].decode().split()
        assert out == names
    text = fleet[0].ctl("job", "status", "fan").stdout.decode()
    assert "fan-out" in text and ", ".join(f"{i}:{n}" for i, n in enumerate(names)) in text
    js = json.loads(fleet[2].ctl("--json", "job", "status", "fan").stdout)
    assert js["members"] == names and js["member"] == "*"


def test_no_matching_member_waits_and_says_why(fleet):
    """A job whose selector matches no alive member waits (nothing of it leased, while another
    job runs and ends) and says why: GET /jobs/ID on the leader and on a follower, `job status`
    text and --json; cancelling it ends it."""
    r = _submit(fleet[0], "--id", "gpu", "--member", "gpu-*", "--", "true")
    assert r.returncode == 0, r.stderr
    _others_done(fleet[0], "after-gpu")
    why = "no alive member matches 'gpu-*'"
    for m in fleet:
        rec = m.record("gpu", items=True)
        assert rec["state"] == "queued" and rec["items"][0]["attempts"] == 0
        assert why in rec.get("waiting_for", ""), (m.name, rec)
    text = fleet[1].ctl("job", "status", "gpu").stdout.decode()
    assert "waiting" in text and why in text
    js = json.loads(fleet[2].ctl("--json", "job", "status", "gpu").stdout)
    assert why in js["waiting_for"]
    assert fleet[0].ctl("job", "cancel", "gpu").returncode == 0
    assert "waiting_for" not in fleet[0].record("gpu")


@pytest.mark.parametrize("body, words", [
    ({"member": ""}, "member is empty"),
    ({"member": "a b"}, "bad member selector"),
    ({"member": "x" * 129}, "longer than 128"),
    ({"member": 5}, "must be a string"),
    ({"member": {"$ne": 1}}, "must be a string"),
    ({"pool": "@v1"}, "both parts are needed"),
    ({"pool": "default@"}, "both parts are needed"),
    ({"pool": "default@v1", "member": "v2"}, "disagree"),
    ({"member": "*", "items": ["a", "b"]}, "fan-out"),
])
def test_bad_selectors_are_400(fleet, body, words):
    """Hostile or malformed selectors over HTTP: 400 with words that say what to do."""
    status, rec = fleet[0].request("POST", "/jobs", {"argv": ["true"], **body})
    assert status == 400 and words in rec["error"], (status, rec)


@pytest.mark.parametrize("args, words", [
    (["--member", ""], "member is empty"),
    (["--member", "v1;rm -rf /"], "bad member selector"),
    (["--pool", "default@"], "both parts are needed"),
    (["--member", "é"], "bad member selector"),
])
def test_bad_selectors_in_meshctl(fleet, args, words):
    """meshctl shows the refusal and exits 2 (bad input)."""
    r = fleet[0].ctl("job", "submit", *args, "--", "true")
    assert r.returncode == 2 and words in r.stderr.decode(), (r.returncode, r.stderr)


def test_member_that_leaves_is_not_replaced(tmp_path):
    """A fan-out's item whose member is killed waits (its record and waiting_for name that
    member) and is not moved; a job pinned to the dead member waits too, saying no alive member
    matches it; both run on that member, and only there, once it is back."""
    members = make_fleet(str(tmp_path), voters=3)
    try:
        start_all(members)
        lead = leader_of(members)
        wait_until(lambda: all(m.get("alive") is True
                               for m in lead.request("GET", "/fleet")[1]["members"]),
                   what="every member alive in the leader's view")
        gone = next(m for m in members if m is not lead)
        flag = tmp_path / "go"
        blocked = ["sh", "-c", f'until [ -e {flag} ]; do sleep 0.05; done; echo "$MESH_MEMBER"']
        r = _submit(lead, "--id", "fan", "--member", "*", "--", *blocked)
        assert r.returncode == 0, r.stderr
        wait_until(lambda: lead.record("fan")["items_running"] == 3, what="the fan-out runs")
        gone.kill9()
        wait_until(lambda: gone.name in lead.record("fan").get("pending_members", []),
                   what="the dead member's item back to pending")
        r = _submit(lead, "--id", "pinned", "--member", gone.name, "--", *ECHO_MEMBER)
        assert r.returncode == 0, r.stderr
        flag.touch()
        wait_until(lambda: lead.record("fan")["items_done"] == 2, what="the others end")
        _others_done(lead, "filler")
        fan = lead.record("fan", items=True)
        mine = next(it for it in fan["items"] if it["for_member"] == gone.name)
        assert fan["state"] == "running" and mine["state"] == "pending", fan
        assert gone.name in fan["waiting_for"] and "never run elsewhere" in fan["waiting_for"]
        pinned = lead.record("pinned", items=True)
        assert pinned["items"][0]["attempts"] == 0
        assert f"no alive member matches '{gone.name}'" in pinned["waiting_for"]
        text = lead.ctl("job", "status", "fan").stdout.decode()
        assert gone.name in text and "waiting" in text
        gone.start()
        fan, pinned = lead.wait_job("fan", timeout_s=120), lead.wait_job("pinned", timeout_s=120)
        assert fan["state"] == "done" and pinned["state"] == "done"
        assert [it["member"] for it in fan["items"]] == fan["members"]
        assert pinned["items"][0]["member"] == gone.name
        assert lead.request("GET", "/jobs/pinned/results")[1] == f"{gone.name}\n".encode()
    finally:
        for m in members:
            m.stop()
