"""Schedules on real members (issue 12 point 7): `meshctl cron add|list|pause|resume|rm` and
their HTTP routes on a fleet of one, runs fired by the leader under ids made of the name and
the due time, a missed run fired once after a restart, hostile input for every route and flag,
and a 3-voter fleet whose leader is killed (-9) while a schedule fires: the new leader goes on
firing it, and no due time is fired twice.

Absence checks wait for what would have caused the thing absent: a paused schedule's runs are
counted while another schedule of the same period provably fires.
"""

from __future__ import annotations

import datetime as dt
import json
import time

import pytest

from meshjobs import limits
from tests.helpers import leader_of, make_fleet, start_all, wait_until

pytestmark = pytest.mark.fleet


def _crons(m) -> dict[str, dict]:
    status, body = m.request("GET", "/cron")
    assert status == 200, (status, body)
    return {c["name"]: c for c in body["crons"]}


def _runs(m, name: str) -> list[dict]:
    status, body = m.request("GET", "/jobs")
    assert status == 200, (status, body)
    return sorted((j for j in body if j["id"].startswith(f"cron-{name}-")), key=lambda j: j["id"])


def _due_of(job_id: str) -> float:
    stamp = job_id.rsplit("-", 1)[1]
    return dt.datetime.strptime(stamp, "%Y%m%dT%H%M%S").replace(tzinfo=dt.UTC).timestamp()


def _fired(m, name: str, n: int) -> list[dict]:
    """Wait until `name` has fired at least n runs; they all, each once."""
    return wait_until(lambda: len(r := _runs(m, name)) >= n and r,
                      what=f"{n} runs of schedule {name}")


def test_cli_add_list_pause_resume_rm(meshd, tmp_path):
    """`cron add NAME '@every 1s' -- ARGV` fires runs cron-NAME-<due time> that run the job
    (job options as `job submit` takes them: tags, env); `cron list` shows name, spec, next due,
    last job and paused; `cron pause` stops its runs (while another schedule of the same period
    fires), `cron resume` starts them again, `cron rm` removes it and keeps its runs."""
    r = meshd.ctl("cron", "add", "tick", "@every 1s", "--tag", "nightly", "--env", "WHO=cron",
                  "--", "sh", "-c", "echo $WHO", cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert r.stdout.decode().startswith("tick: next due ")
    runs = _fired(meshd, "tick", 2)
    first = runs[0]
    assert first["tags"] == ["nightly"] and first["env"] == {"WHO": "cron"}
    assert first["cwd"] == str(tmp_path) and first["argv"] == ["sh", "-c", "echo $WHO"]
    assert _due_of(first["id"]) % 1 == 0 and len({j["id"] for j in runs}) == len(runs)
    done = meshd.wait_job(first["id"])
    assert done["state"] == "done"
    assert meshd.request("GET", f"/jobs/{first['id']}/results")[1] == b"cron\n"
    assert all(j["submitted_at"] >= _due_of(j["id"]) for j in runs)
    text = meshd.ctl("cron", "list").stdout.decode()
    assert "NAME" in text and "NEXT DUE" in text and "tick" in text and "@every 1s" in text
    listed = json.loads(meshd.ctl("--json", "cron", "list").stdout)["crons"]
    assert [c["name"] for c in listed] == ["tick"]
    assert listed[0]["paused"] is False and listed[0]["last_job"].startswith("cron-tick-")
    assert listed[0]["next_due"] is not None and listed[0]["job"]["tags"] == ["nightly"]

    r = meshd.ctl("cron", "pause", "tick")
    assert r.returncode == 0 and r.stdout.decode().strip() == "tick: paused", r.stderr
    paused = _crons(meshd)["tick"]
    assert paused["paused"] is True and paused["next_due"] is None
    before = len(_runs(meshd, "tick"))
    assert meshd.ctl("cron", "add", "witness", "@every 1s", "--", "true").returncode == 0
    _fired(meshd, "witness", 3)
    assert len(_runs(meshd, "tick")) == before
    assert "paused" in meshd.ctl("cron", "list").stdout.decode()

    r = meshd.ctl("cron", "resume", "tick")
    assert r.returncode == 0 and r.stdout.decode().strip() == "tick: resumed", r.stderr
    _fired(meshd, "tick", before + 1)

    r = meshd.ctl("cron", "rm", "tick")
    assert r.returncode == 0 and r.stdout.decode().strip() == "tick: removed", r.stderr
    assert "tick" not in _crons(meshd)
    assert meshd.request("GET", "/cron/tick")[0] == 404
    assert len(_runs(meshd, "tick")) >= before + 1  # its runs stay
    assert meshd.ctl("cron", "rm", "witness").returncode == 0
    assert meshd.ctl("cron", "list").stderr.decode().strip() == "no schedules"
    m = meshd.metrics()
    assert m["meshjobs_table_crons_added_total"] == 2 and m["meshjobs_table_crons_removed_total"] == 2
    fired = len(_runs(meshd, "tick")) + len(_runs(meshd, "witness"))
    assert m["meshjobs_table_cron_runs_fired_total"] == fired
    assert m["meshjobs_node_cron_fires_proposed_total"] >= m["meshjobs_table_cron_runs_fired_total"]


def test_http_routes_and_idempotency(meshd):
    """PUT /cron/{name} adds (201) and, unchanged, answers 200; "replace": false refuses a
    different one (409), true replaces it; GET /cron/{name}; POST .../pause and .../resume;
    DELETE; an Idempotency-Key retried answers as the first time without a second change, and
    the same key on another request is 422."""
    body = {"spec": "0 6 * * mon-fri", "job": {"argv": ["true"]}}
    status, rec = meshd.request("PUT", "/cron/daily", body)
    assert status == 201, rec
    assert rec["name"] == "daily" and rec["spec"] == "0 6 * * mon-fri" and rec["paused"] is False
    assert rec["catch_up"] == "latest" and rec["overlap"] == "allow"
    assert rec["job"]["pool"] == "default" and rec["last_job"] is None
    nxt = dt.datetime.fromtimestamp(rec["next_due"], dt.UTC)
    assert (nxt.hour, nxt.minute, nxt.isoweekday() <= 5) == (6, 0, True)
    assert meshd.request("PUT", "/cron/daily", body)[0] == 200
    status, err = meshd.request("PUT", "/cron/daily", {**body, "spec": "@daily", "replace": False})
    assert status == 409 and "meshctl cron rm daily" in err["error"]
    status, rec = meshd.request("PUT", "/cron/daily", {**body, "spec": "@daily",
                                                        "overlap": "skip", "catch_up": "none"})
    assert status == 200 and rec["spec"] == "@daily" and rec["overlap"] == "skip"
    assert meshd.request("GET", "/cron/daily")[1]["catch_up"] == "none"
    key = {"Idempotency-Key": "cron-pause-1"}
    status, rec = meshd.request("POST", "/cron/daily/pause", headers=key)
    assert status == 200 and rec["paused"] is True
    v = rec["version"]
    status, again = meshd.request("POST", "/cron/daily/pause", headers=key)
    assert status == 200 and again["version"] == v
    status, err = meshd.request("POST", "/cron/daily/resume", headers=key)
    assert status == 422, err
    assert meshd.request("GET", "/cron/daily")[1]["paused"] is True
    status, rec = meshd.request("POST", "/cron/daily/resume")
    assert status == 200 and rec["paused"] is False
    assert meshd.request("DELETE", "/cron/daily")[1] == {"name": "daily", "removed": True}
    assert meshd.request("DELETE", "/cron/daily")[0] == 404
    assert meshd.request("GET", "/cron")[1] == {"crons": []}
    openapi = meshd.request("GET", "/openapi.json")[1]
    assert {"/cron", "/cron/{name}", "/cron/{name}/pause", "/cron/{name}/resume"} <= set(openapi["paths"])


BAD_SPECS = ["", "* * * *", "* * * * * *", "60 * * * *", "* 24 * * *", "* * 0 * *", "* * 32 * *",
             "* * * 13 *", "* * * * 8", "*/0 * * * *", "5-1 * * * *", "a * * * *", "* * * foo *",
             "0 0 30 2 *", "0 0 31 4,6 *", "@reboot", "@every", "@every 0s", "@every 5x",
             "@every 400d", "@daily 5", "1,,2 * * * *", "x" * (limits.cron_spec_chars_max + 1),
             "١ * * * *", "*/ * * * *", "-1 * * * *"]


def test_hostile_input(meshd):
    """Every route refuses garbage with 4xx and words that say what to write instead, and
    nothing is added: bad names, specs, jobs, keys, types, bodies, sizes and content types."""
    for spec in BAD_SPECS:
        status, err = meshd.request("PUT", "/cron/x", {"spec": spec, "job": {"argv": ["true"]}})
        assert status == 400, (spec, status, err)
        assert "spec" in err["error"] or "@every" in err["error"] or "field" in err["error"], err
    for name in ["a" * (limits.cron_name_chars_max + 1), "a%20b", "%2e%2e", "x%00", "%C3%A9"]:
        for method, path in (("PUT", f"/cron/{name}"), ("GET", f"/cron/{name}"),
                             ("DELETE", f"/cron/{name}"), ("POST", f"/cron/{name}/pause"),
                             ("POST", f"/cron/{name}/resume")):
            status, err = meshd.request(method, path, {"spec": "@daily", "job": {"argv": ["true"]}}
                                        if method == "PUT" else None)
            assert status in (400, 404), (method, path, status, err)
            if status == 400:
                assert "schedule name" in err["error"]
    bodies = [
        [], "x", 5, None, {}, {"spec": "@daily"}, {"job": {"argv": ["true"]}},
        {"spec": "@daily", "job": {"argv": ["true"]}, "evil": 1},
        {"spec": 5, "job": {"argv": ["true"]}},
        {"spec": "@daily", "job": ["true"]},
        {"spec": "@daily", "job": {"argv": []}},
        {"spec": "@daily", "job": {"argv": ["true"], "id": "x"}},
        {"spec": "@daily", "job": {"argv": ["true"], "items": ["a"]}},
        {"spec": "@daily", "job": {"argv": ["true"], "after": ["p"]}},
        {"spec": "@daily", "job": {"argv": ["true"], "priority": True}},
        {"spec": "@daily", "job": {"argv": ["true"], "cwd": "relative"}},
        {"spec": "@daily", "job": {"argv": ["true"], "pool": "nosuchpool"}},
        {"spec": "@daily", "job": {"argv": ["true"]}, "catch_up": "all"},
        {"spec": "@daily", "job": {"argv": ["true"]}, "overlap": 1},
        {"spec": "@daily", "job": {"argv": ["true"]}, "replace": "yes"},
    ]
    for body in bodies:
        status, err = meshd.request("PUT", "/cron/x", body)
        assert status == 400, (body, status, err)
        assert err["error"], body
    status, err = meshd.request("PUT", "/cron/x", raw=b"{not json")
    assert status == 400 and "JSON" in err["error"]
    status, err = meshd.request("PUT", "/cron/x", raw=b"")
    assert status == 400
    big = {"spec": "@daily", "job": {"argv": ["x" * (limits.cron_body_bytes_max + 10)]}}
    status, err = meshd.request("PUT", "/cron/x", big)
    assert status == 413 and "at most" in err["error"]
    status, err = meshd.request("PUT", "/cron/x", raw=b'{"spec": "@daily", "job": {"argv": ["true"]}}',
                                headers={"Content-Type": "text/plain"})
    assert status == 415
    status, err = meshd.request("PUT", "/cron/x", {"spec": "@daily", "job": {"argv": ["true"]}},
                                headers={"Idempotency-Key": "bad key with spaces"})
    assert status == 400
    for method, path in (("DELETE", "/cron/nope"), ("POST", "/cron/nope/pause"),
                         ("POST", "/cron/nope/resume"), ("GET", "/cron/nope")):
        status, err = meshd.request(method, path)
        assert status == 404 and "no schedule nope" in err["error"], (method, status, err)
    assert meshd.request("POST", "/cron/x/stop")[0] in (404, 405)
    assert meshd.request("PATCH", "/cron/x", {})[0] == 405
    assert meshd.request("GET", "/cron")[1] == {"crons": []}


def test_cli_hostile_flags(meshd, tmp_path):
    """meshctl refuses bad flags before sending, and shows meshd's words for bad specs and
    names; `meshctl --help` names the cron commands."""
    assert "cron" in meshd.ctl("--help").stdout.decode()
    helptext = meshd.ctl("cron", "--help").stdout.decode()
    for word in ("add", "list", "pause", "resume", "rm"):
        assert word in helptext
    for args, words in [
        (["cron", "add", "x", "61 * * * *", "--", "true"], "minute field: 61 is out of range"),
        (["cron", "add", "x", "@every 0s", "--", "true"], "period must be"),
        (["cron", "add", "b@d", "@daily", "--", "true"], "bad schedule name"),
        (["cron", "add", "x", "@daily", "--catch-up", "all", "--", "true"], "Invalid value"),
        (["cron", "add", "x", "@daily", "--overlap", "sometimes", "--", "true"], "Invalid value"),
        (["cron", "add", "x", "@daily", "--retries", "-1", "--", "true"], "Invalid value"),
        (["cron", "add", "x", "@daily", "--env", "NOEQUALS", "--", "true"], "NAME=VALUE"),
        (["cron", "add", "x", "@daily", "--id", "y", "--", "true"], "No such option"),
        (["cron", "add", "x", "@daily", "--after", "y", "--", "true"], "No such option"),
        (["cron", "add", "x", "@daily"], "Missing argument"),
        (["cron", "add", "x", "@daily", "--pool", "nosuch", "--", "true"], "unknown pool"),
        (["cron", "rm", "nope"], "no schedule nope"),
        (["cron", "pause", "nope"], "no schedule nope"),
        (["cron", "resume", "nope"], "no schedule nope"),
    ]:
        r = meshd.ctl(*args, cwd=str(tmp_path))
        assert r.returncode != 0, (args, r.stdout)
        assert words in r.stderr.decode(), (args, r.stderr)
    assert meshd.ctl("cron", "add", "x", "@daily", "--", "true").returncode == 0
    r = meshd.ctl("cron", "add", "x", "@hourly", "--", "true")
    assert r.returncode != 0 and "--replace" in r.stderr.decode()
    r = meshd.ctl("--json", "cron", "add", "x", "@hourly", "--replace", "--", "true")
    assert r.returncode == 0 and json.loads(r.stdout)["spec"] == "@hourly"


def test_missed_runs_fire_once_after_a_restart(meshd_factory):
    """A fleet of one stopped for several due times of `@every 1s`: started again, it fires
    the latest missed run once, not one per missed due time (catch-up latest)."""
    m = meshd_factory()
    assert m.request("PUT", "/cron/t", {"spec": "@every 1s", "job": {"argv": ["true"]}})[0] == 201
    _fired(m, "t", 2)
    m.terminate()
    stopped = time.time()
    wait_until(lambda: time.time() > stopped + 4, what="four due times missed")
    # Nothing fires before meshd runs again: of the due times before this, at most the latest
    # (the catch-up) may have a run; every later fire is of a due time after the one before.
    begin = time.time()
    m.start()
    after = wait_until(lambda: [j for j in _runs(m, "t") if _due_of(j["id"]) > stopped + 1] or None,
                       what="a run after the restart")
    missed = [j for j in _runs(m, "t") if stopped + 1 < _due_of(j["id"]) < begin]
    assert len(missed) <= 1, [j["id"] for j in missed]
    assert after
    # Paused (a committed entry), it fires no more: its count and its runs hold still.
    assert m.request("POST", "/cron/t/pause")[0] == 200
    c = _crons(m)["t"]
    assert c["fired"] == len(_runs(m, "t"))


def test_leader_killed_schedule_goes_on_once(tmp_path):
    """3 voters, `@every 1s` added through a follower (forwarded): runs fire; the leader is
    killed (-9); the new leader fires the runs due after, and every member has one job per due
    time, as many as the schedule says it fired, each run made under its due time's id."""
    members = make_fleet(str(tmp_path), voters=3)
    try:
        start_all(members)
        lead = leader_of(members)
        follower = next(m for m in members if m is not lead)
        status, rec = follower.request("PUT", "/cron/beat", {"spec": "@every 1s",
                                                              "job": {"argv": ["true"]}})
        assert status == 201, rec
        _fired(lead, "beat", 3)
        lead.kill9()
        killed = time.time()
        rest = [m for m in members if m is not lead]
        new = leader_of(rest)
        assert new is not lead
        wait_until(lambda: [j for j in _runs(new, "beat") if _due_of(j["id"]) > killed + 1]
                   or None, what="runs fired by the new leader")
        # Paused so that the counts checked below stop moving.
        assert new.request("POST", "/cron/beat/pause")[0] == 200
        for m in rest:
            wait_until(lambda m=m: _crons(m)["beat"]["paused"], what=f"{m.name} sees it paused")
        counts = []
        for m in rest:
            runs = _runs(m, "beat")
            ids = [j["id"] for j in runs]
            assert len(ids) == len(set(ids))
            dues = [_due_of(i) for i in ids]
            assert len(dues) == len(set(dues))
            assert all(j["submitted_at"] >= _due_of(j["id"]) for j in runs)
            c = _crons(m)["beat"]
            assert c["fired"] == len(runs), (m.name, c, ids)
            counts.append(ids)
        assert counts[0] == counts[1]
    finally:
        for m in members:
            m.stop()


def test_overlap_skip_passes_over_while_a_run_runs(meshd, tmp_path):
    """--overlap skip: while the last run still runs, due times are passed over (counted as
    skipped, no job made); once it ended, the next due time fires again."""
    flag = tmp_path / "go"
    r = meshd.ctl("cron", "add", "slow", "@every 1s", "--overlap", "skip", "--", "sh", "-c",
                  f"until [ -e {flag} ]; do sleep 0.05; done")
    assert r.returncode == 0, r.stderr
    first = _fired(meshd, "slow", 1)[0]["id"]
    wait_until(lambda: _crons(meshd)["slow"]["skipped"] >= 2, what="due times passed over")
    assert [j["id"] for j in _runs(meshd, "slow")] == [first]
    assert meshd.request("GET", f"/jobs/{first}")[1]["state"] == "running"
    flag.touch()
    assert meshd.wait_job(first)["state"] == "done"
    _fired(meshd, "slow", 2)
    c = _crons(meshd)["slow"]
    assert c["overlap"] == "skip" and c["fired"] == len(_runs(meshd, "slow"))
