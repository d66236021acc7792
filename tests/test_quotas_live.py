"""Per-identity quotas with a real meshd and real tokens (issue 25, point 8): a submit that would
take a token past its pending_items_max is 429 naming the limit, its value and what the token
holds; another token and an admin are unaffected. A new schedule past schedules_max likewise."""

from __future__ import annotations

import os

import pytest

from tests.helpers import Meshd, member_config, running, token_line

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
