"""Per-identity quotas with a real meshd and real tokens (issue 25, point 8): a submit that would
take a token past its pending_items_max is 429 naming the limit, its value and what the token
holds; another token and an admin are unaffected. A new schedule past schedules_max likewise."""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest

from tests.helpers import Meshd, member_config, running, token_line, wait_until

ADMIN, SUB, OTHER, ZERO = "tok-qadmin-1", "tok-qsub-2", "tok-qother-3", "tok-qzero-4"


@pytest.fixture(scope="module")
def member(tmp_path_factory):
    top = str(tmp_path_factory.mktemp("quotas"))
    tokens = ", ".join([
        token_line("boss", "admin", ADMIN),
        token_line("ci", "submit", SUB)[:-2] + ", pending_items_max = 10, schedules_max = 2 }",
        token_line("other", "submit", OTHER),
        token_line("zero", "submit", ZERO)[:-2] + ", pending_items_max = 0 }",
    ])
    cfg = member_config(top, "q1", "[pools.default]\nslots = 2\n[auth]\npending_items_max = 20\n"
                        f"tokens = [ {tokens} ]\n")
    m = Meshd(os.path.join(top, "q1"), name="q1", config=cfg, token=ADMIN)
    yield from running(m)


def held(m: Meshd, token: str, n: int) -> tuple[int, dict]:
    return m.request("POST", "/jobs", {"argv": ["true"], "hold": True,
                                       "items": [str(i) for i in range(n)]},
                     headers={"Authorization": f"Bearer {token}"})


def test_pending_items_max_at_submit(member: Meshd) -> None:
    m = member
    status, body = held(m, SUB, 8)
    assert status == 201, body
    status, body = held(m, SUB, 3)
    assert status == 429, body
    assert (body["limit"], body["value"], body["holds"]) == ("pending_items_max", 10, 8)
    assert "pending_items_max" in body["error"] and "cancel" in body["error"]
    status, body = held(m, SUB, 2)  # up to the limit exactly still passes
    assert status == 201, body
    # another token has its own count (and [auth]'s default of 20), the admin has none
    status, body = held(m, OTHER, 15)
    assert status == 201, body
    status, body = held(m, OTHER, 6)
    assert status == 429 and body["value"] == 20 and body["holds"] == 15, body
    status, body = held(m, ADMIN, 50)
    assert status == 201, body


def test_hostile_quota_in_a_control_request() -> None:
    from meshjobs.control import ControlError, parse_quota

    assert parse_quota({"pending_items_max": 3}) == {"pending_items_max": 3}
    for bad in ([], {"x": 1}, {"pending_items_max": -1}, {"pending_items_max": True},
                {"pending_items_max": "3"}, {"pending_items_max": 10**20}):
        with pytest.raises(ControlError):
            parse_quota(bad)


def test_meshctl_says_over_a_quota_with_exit_2(member: Meshd) -> None:
    r = member.ctl("job", "submit", "--hold", "--", "true", env={"MESHJOBS_TOKEN": ZERO})
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert b"pending_items_max" in r.stderr and b"Traceback" not in r.stderr


def put_cron(m: Meshd, token: str, name: str, spec: str = "@daily", **extra: object) -> tuple[int, dict]:
    return m.request("PUT", f"/cron/{name}", {"spec": spec, "job": {"argv": ["true"]}, **extra},
                     headers={"Authorization": f"Bearer {token}"})


def test_schedules_max_at_cron_put(member: Meshd) -> None:
    m = member
    assert put_cron(m, SUB, "ci-a")[0] == 201
    assert put_cron(m, SUB, "ci-b")[0] == 201
    status, body = put_cron(m, SUB, "ci-c")
    assert status == 429, body
    assert (body["limit"], body["value"], body["holds"]) == ("schedules_max", 2, 2)
    assert "schedules_max" in body["error"] and "cron rm" in body["error"]
    # replacing one of its own is not a new schedule; the same schedule again neither
    status, body = put_cron(m, SUB, "ci-a", spec="@hourly", replace=True)
    assert status == 200, body
    assert put_cron(m, SUB, "ci-b")[0] == 200
    # an admin is unlimited by default and its schedules count for nobody else
    for i in range(3):
        assert put_cron(m, ADMIN, f"boss-{i}")[0] == 201
    # another submit token has its own count (no schedules_max: unlimited)
    assert put_cron(m, OTHER, "other-a")[0] == 201
    # a schedule it may not replace (another's) is still refused for ownership, not quota
    status, body = put_cron(m, SUB, "boss-0", replace=True)
    assert status == 403, body
    # removing one frees a slot
    status, _ = m.request("DELETE", "/cron/ci-b", headers={"Authorization": f"Bearer {SUB}"})
    assert status == 200
    assert put_cron(m, SUB, "ci-c")[0] == 201
    assert put_cron(m, SUB, "ci-d")[0] == 429


def test_hostile_quota_in_a_cron_request() -> None:
    from meshjobs.control import ControlError, parse_request

    req = {"op": "cron", "action": "add", "name": "x", "spec": "@daily",
           "job": {"argv": ["true"]}, "rid": "r" * 16, "by": "ci", "by_role": "submit"}
    out = parse_request({**req, "quota": {"schedules_max": 2}})
    assert out["quota"] == {"schedules_max": 2}
    for bad in ("2", [], {"schedules_max": -1}, {"schedules_max": "2"}, {"nope": 1},
                {"schedules_max": 10**20}):
        with pytest.raises(ControlError):
            parse_request({**req, "quota": bad})


LIM = "tok-qlim-5"


@pytest.fixture(scope="module")
def four_slots(tmp_path_factory):
    top = str(tmp_path_factory.mktemp("quotas_run"))
    tokens = ", ".join([token_line("boss", "admin", ADMIN),
                        token_line("lim", "submit", LIM)[:-2] + ", running_items_max = 1 }"])
    cfg = member_config(top, "q2", f"[pools.default]\nslots = 4\n[auth]\ntokens = [ {tokens} ]\n")
    m = Meshd(os.path.join(top, "q2"), name="q2", config=cfg, token=ADMIN)
    yield from running(m)


def test_running_items_max_bounds_leases(four_slots: Meshd) -> None:
    m = four_slots
    gate = tempfile.mkdtemp(prefix="meshjobs-quota-")
    os.chmod(gate, 0o755)  # items run as the member's item user: it must see the file appear
    flag = os.path.join(gate, "go")
    wait = ["sh", "-c", f"while [ ! -e {flag} ]; do sleep 0.05; done"]

    def submit(token: str, n: int) -> str:
        status, body = m.request("POST", "/jobs", {"argv": wait, "items": [str(i) for i in range(n)]},
                                 headers={"Authorization": f"Bearer {token}"})
        assert status == 201, body
        return body["id"]

    def rec(job_id: str) -> dict:
        status, body = m.request("GET", f"/jobs/{job_id}")
        assert status == 200, body
        return body

    try:
        a, b = submit(LIM, 3), submit(LIM, 1)
        wait_until(lambda: rec(a)["items_running"] + rec(b)["items_running"] == 1,
                   what="one item of the limited token running")
        boss = submit(ADMIN, 2)
        # the admin's items take the free slots the limited token may not
        wait_until(lambda: rec(boss)["items_running"] == 2, what="the admin's items running")
        ra, rb = rec(a), rec(b)
        assert ra["items_running"] + rb["items_running"] == 1, (ra, rb)
        assert ra["items_pending"] + rb["items_pending"] == 3, (ra, rb)
        assert ra["submitted_by"] == "lim" and "running_items_max" not in ra
        open(flag, "w").close()
        for job_id in (a, b, boss):
            wait_until(lambda j=job_id: rec(j)["state"] == "done", what=f"job {job_id} done")
    finally:
        shutil.rmtree(gate, ignore_errors=True)


def test_clients_may_not_set_running_items_max(four_slots: Meshd) -> None:
    m = four_slots
    status, body = m.request("POST", "/jobs", {"argv": ["true"], "running_items_max": 100},
                             headers={"Authorization": f"Bearer {LIM}"})
    assert status == 400 and "running_items_max" in body["error"], body
    from meshjobs.control import ControlError, parse_request, parse_submit

    with pytest.raises(ControlError):
        parse_submit({"argv": ["true"], "running_items_max": 5})
    for bad in (-1, "5", True, 10**20):
        with pytest.raises(ControlError):
            parse_submit({"argv": ["true"], "running_items_max": bad}, committed=True)
    # a forwarded request's spec may not carry it either: only the leader sets it, from the quota
    out = parse_request({"op": "submit", "rid": "r" * 16, "by": "lim", "by_role": "submit",
                         "spec": {"argv": ["true"], "running_items_max": 100}, "items": [None]})
    assert "running_items_max" not in out["spec"]
