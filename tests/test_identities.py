"""Identities with a real meshd and real tokens (issue 25, points 3 to 5): tokens name their
jobs' submitter and bound the users their jobs run as; a non-admin changes only its own jobs
and schedules; env values and the notify URL are shown only to the owner and admins."""

from __future__ import annotations

import json
import os

import pytest

from tests.helpers import Meshd, member_config, running, token_line, wait_until

ADMIN, SUB, OTHER, READ, ALICE = "tok-admin-1", "tok-sub-2", "tok-other-3", "tok-read-4", "tok-al-5"
POOLS = ('[pools.default]\nslots = 2\n[pools.nob]\nslots = 1\nuser = "nobody"\n'
         '[pools.daem]\nslots = 1\nuser = "daemon"\n')


@pytest.fixture(scope="module")
def member(tmp_path_factory):
    top = str(tmp_path_factory.mktemp("ids"))
    tokens = ", ".join([
        token_line("boss", "admin", ADMIN),
        token_line("ci", "submit", SUB, run_as=["nobody", "*"]),
        token_line("other", "submit", OTHER),
        token_line("viewer", "read", READ),
        token_line("alice", "submit", ALICE, run_as=["nobody"]),
    ])
    cfg = member_config(top, "i1", POOLS + f"[auth]\ntokens = [ {tokens} ]\n")
    m = Meshd(os.path.join(top, "i1"), name="i1", config=cfg, token=ADMIN)
    yield from running(m)


def as_(m: Meshd, token: str, method: str, path: str, body=None) -> tuple[int, dict]:
    return m.request(method, path, body, headers={"Authorization": f"Bearer {token}"})


def held(m: Meshd, token: str, **kw) -> dict:
    status, body = as_(m, token, "POST", "/jobs", {"argv": ["true"], "hold": True, **kw})
    assert status == 201, body
    return body


# --- point 3: tokens become identities --------------------------------------------------------


def test_submitted_by_names_the_token(member: Meshd) -> None:
    m = member
    job = held(m, SUB)
    assert job["submitted_by"] == "ci"
    assert held(m, ADMIN)["submitted_by"] == "boss"
    status, rec = as_(m, READ, "GET", f"/jobs/{job['id']}")
    assert status == 200 and rec["submitted_by"] == "ci"
    status, rows = as_(m, READ, "GET", "/jobs?format=json")
    assert status == 200 and {r["id"]: r["submitted_by"] for r in rows}[job["id"]] == "ci"


@pytest.mark.parametrize("user", ["root", "0", "0:0", "65534:0", "00", "0:65534"])
def test_submit_token_cannot_run_as_root(member: Meshd, user: str) -> None:
    """ci may run as any user but root ("*"): every spelling of root is 403."""
    status, body = as_(member, SUB, "POST", "/jobs", {"argv": ["id"], "user": user})
    assert status == 403, body
    assert "root" in body["error"] and "ci" in body["error"]


def test_user_outside_run_as_is_403_naming_the_allowed(member: Meshd) -> None:
    status, body = as_(member, ALICE, "POST", "/jobs", {"argv": ["id"], "user": "daemon"})
    assert status == 403 and "nobody" in body["error"] and "daemon" in body["error"], body
    # other has no run_as: its jobs name no user.
    status, body = as_(member, OTHER, "POST", "/jobs", {"argv": ["id"], "user": "nobody"})
    assert status == 403 and "none" in body["error"], body


def test_default_user_is_run_as_first(member: Meshd) -> None:
    assert held(member, ALICE)["user"] == "nobody"
    assert held(member, SUB)["user"] == "nobody"
    assert held(member, SUB, user="daemon")["user"] == "daemon"
    assert held(member, OTHER)["user"] is None
    assert held(member, ADMIN)["user"] is None  # admin: ["*"], no default


def test_client_cannot_name_its_submitter(member: Meshd) -> None:
    for key, value in (("submitted_by", "boss"), ("run_as", ["*"]), ("submitted_by", None)):
        status, body = as_(member, SUB, "POST", "/jobs", {"argv": ["true"], key: value})
        assert status == 400 and key in body["error"], body


def test_pool_user_outside_run_as_fails_the_item(member: Meshd) -> None:
    """alice may run as nobody only: a pool whose user is daemon fails her item, saying so;
    the pool whose user is nobody runs it."""
    m = member
    _, job = as_(m, OTHER, "POST", "/jobs", {"argv": ["true"], "pool": "daem"})
    def ended(jid: str) -> dict | None:
        _, rec = as_(m, ADMIN, "GET", f"/jobs/{jid}?items=1")
        return rec if rec["state"] in ("done", "failed") else None
    rec = wait_until(lambda: ended(job["id"]), what="other's job on pool daem ends")
    assert rec["state"] == "failed", rec
    assert "daemon" in json.dumps(rec["items"]) and "run as" in json.dumps(rec["items"])
