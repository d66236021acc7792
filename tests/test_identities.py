"""Identities with a real meshd and real tokens (issue 25, points 3 to 5): tokens name their
jobs' submitter and bound the users their jobs run as; a non-admin changes only its own jobs
and schedules; env values and the notify URL are shown only to the owner and admins."""

from __future__ import annotations

import json
import os

import pytest

from tests.helpers import EventStream, Meshd, member_config, running, token_line, wait_until

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


# --- point 4: ownership between tokens --------------------------------------------------------


def test_submit_token_cannot_change_an_admins_job(member: Meshd) -> None:
    m = member
    job = held(m, ADMIN)
    for path, body in (("cancel", None), ("tone", {"hold": False}), ("tone", {"priority": 3}),
                       ("rerun", None)):
        status, out = as_(m, SUB, "POST", f"/jobs/{job['id']}/{path}", body)
        assert status == 403 and "boss" in out["error"], (path, out)
    status, rec = as_(m, ADMIN, "GET", f"/jobs/{job['id']}")
    assert rec["state"] == "held" and rec["priority"] == 0
    status, out = as_(m, SUB, "PUT", "/cron/bossly",
                      {"spec": "@hourly", "job": {"argv": ["true"]}})
    status, out = as_(m, ADMIN, "PUT", "/cron/bossly", {"spec": "@hourly", "job": {"argv": ["true"]}})
    assert status in (200, 201), out
    for method, path in (("PUT", "/cron/bossly"), ("DELETE", "/cron/bossly"),
                         ("POST", "/cron/bossly/pause")):
        body = {"spec": "@daily", "job": {"argv": ["false"]}} if method == "PUT" else None
        status, out = as_(m, SUB, method, path, body)
        assert status == 403 and "boss" in out["error"], (path, out)
    # Its own job it changes, and an admin changes anyone's.
    mine = held(m, SUB)
    assert as_(m, SUB, "POST", f"/jobs/{mine['id']}/tone", {"hold": False})[0] == 200
    assert as_(m, ADMIN, "POST", f"/jobs/{job['id']}/cancel")[0] == 200


def test_bulk_by_filter_skips_others_jobs(member: Meshd) -> None:
    m = member
    theirs = held(m, ADMIN, tags=["bulk1"])
    mine = held(m, OTHER, tags=["bulk1"])
    status, out = as_(m, OTHER, "POST", "/jobs/cancel", {"filter": {"tag": "bulk1"}})
    assert status == 200 and out["skipped_not_owner"] == 1, out
    assert [r["id"] for r in out["results"]] == [mine["id"]]
    status, out = as_(m, OTHER, "POST", "/jobs/tone",
                      {"ids": [theirs["id"]], "set": {"hold": False}})
    assert status == 200 and out["results"][0]["answer"] == "not_owner", out
    assert out["results"][0]["status"] == 403 and "boss" in out["results"][0]["error"]
    assert as_(m, ADMIN, "GET", f"/jobs/{theirs['id']}")[1]["state"] == "held"


# --- point 5: secrets shown only to the owner and admins --------------------------------------


def test_env_and_notify_redacted_for_others(member: Meshd) -> None:
    m = member
    job = held(m, SUB, env={"API_KEY": "s3cret-value"}, notify="https://hooks.example.com/x1y2")
    jid = job["id"]
    for token in (READ, OTHER):
        status, rec = as_(m, token, "GET", f"/jobs/{jid}")
        assert status == 200 and rec["env"] == {"API_KEY": "<redacted>"}, rec
        assert rec["notify"] == "<redacted>"
        _, rows = as_(m, token, "GET", "/jobs?format=json")
        text = json.dumps(rows)
        assert "s3cret-value" not in text and "x1y2" not in text
        _, out = as_(m, token, "POST", "/jobs/status", {"ids": [jid]})
        assert "s3cret-value" not in json.dumps(out) and "API_KEY" in json.dumps(out)
    for token in (SUB, ADMIN):
        status, rec = as_(m, token, "GET", f"/jobs/{jid}")
        assert rec["env"] == {"API_KEY": "s3cret-value"} and rec["notify"].endswith("x1y2")


def test_event_stream_redacted_for_its_caller(member: Meshd) -> None:
    """A job event's row on /events is what the stream's caller may see: a read token sees the
    env keys with redacted values and the notify redacted, an admin and the owner see them."""
    m = member
    streams = {tok: EventStream(m, headers={"Authorization": f"Bearer {tok}"})
               for tok in (READ, OTHER, ADMIN, SUB)}
    try:
        assert all(s.status == 200 for s in streams.values()), [s.body for s in streams.values()]
        job = held(m, SUB, env={"EV_KEY": "ev-secret-7"}, notify="https://hooks.example.org/ev9h")
        rows = {}
        for tok, stream in streams.items():
            ev, _ = stream.until(lambda e: e.get("event") == "job"
                                 and e["data"].get("id") == job["id"], what="the job's event")
            rows[tok] = ev["data"]
    finally:
        for stream in streams.values():
            stream.close()
    for tok in (READ, OTHER):
        assert rows[tok]["env"] == {"EV_KEY": "<redacted>"}, rows[tok]
        assert rows[tok]["notify"] == "<redacted>"
        assert "ev-secret-7" not in json.dumps(rows[tok]) and "ev9h" not in json.dumps(rows[tok])
    for tok in (ADMIN, SUB):
        assert rows[tok]["env"] == {"EV_KEY": "ev-secret-7"}, rows[tok]
        assert rows[tok]["notify"] == "https://hooks.example.org/ev9h"


@pytest.mark.parametrize("how", ["accept", "query"])
def test_html_job_page_redacted_for_others(member: Meshd, how: str) -> None:
    """The HTML job page shows the notify URL (and no env value) only to the owner and admins."""
    m = member
    job = held(m, SUB, env={"PG_KEY": "page-secret-3"}, notify="https://hooks.example.org/pg4q")
    path = f"/jobs/{job['id']}" + ("?format=html" if how == "query" else "")

    def page(tok: str) -> str:
        status, _, body = m.raw_request("GET", path, headers={
            "Authorization": f"Bearer {tok}", "Accept": "text/html"})
        assert status == 200, body[:300]
        return body.decode()

    for tok in (READ, OTHER):
        text = page(tok)
        assert job["id"] in text
        assert "page-secret-3" not in text and "pg4q" not in text, tok
        assert "&lt;redacted&gt;" in text
    for tok in (SUB, ADMIN):
        assert "https://hooks.example.org/pg4q" in page(tok)


def test_history_file_keeps_no_env_values(member: Meshd) -> None:
    m = member
    status, job = as_(m, SUB, "POST", "/jobs", {"argv": ["true"], "env": {"TOK": "hist-secret-9"}})
    assert status == 201
    wait_until(lambda: as_(m, ADMIN, "GET", f"/jobs/{job['id']}")[1]["state"] == "done",
               what="the job ends")
    assert as_(m, ADMIN, "DELETE", f"/jobs/{job['id']}")[0] == 200
    path = os.path.join(m.data, "history.jsonl")
    wait_until(lambda: os.path.exists(path) and job["id"] in open(path).read(),
               what="its history line")
    text = open(path).read()
    assert "hist-secret-9" not in text and '"TOK"' in text
    _, hist = as_(m, READ, "GET", "/history")
    assert "hist-secret-9" not in json.dumps(hist)


# --- inherit_env: meshd's environment is for admins (identity.py Rule 4) --------------------


def test_only_an_admin_may_ask_for_meshds_environment(member: Meshd) -> None:
    """A submit token's job or schedule with inherit_env is 403, saying what to do instead,
    and nothing is made; an admin's is accepted."""
    m = member
    status, body = as_(m, SUB, "POST", "/jobs", {"argv": ["env"], "inherit_env": True,
                                                 "id": "inherit-sub"})
    assert status == 403 and "only an admin" in body["error"] and "--env" in body["error"], body
    assert as_(m, ADMIN, "GET", "/jobs/inherit-sub")[0] == 404
    status, body = as_(m, SUB, "PUT", "/cron/inherit-sub", {
        "spec": "@hourly", "job": {"argv": ["env"], "inherit_env": True}})
    assert status == 403 and "only an admin" in body["error"], body
    assert as_(m, ADMIN, "GET", "/cron/inherit-sub")[0] == 404
    held(m, ADMIN, inherit_env=True)
    # inherit_env false is anyone's.
    held(m, SUB, inherit_env=False)
