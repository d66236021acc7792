"""Job dependencies on real members (issue 12 point 6): `meshctl job submit --after`, a dependent
that waits and says why, runs once its parent is done, ends dep_failed when it never can (and
`job wait`/`job results` exit 1), refusals of bad parents and of forgetting a waited-for parent,
and a leader failover (3 voters, kill -9) while a dependent waits.

Parents block on a flag file the test creates, so that "still waiting" is checked while the
parent provably runs, never after a fixed sleep.
"""

from __future__ import annotations

import json
import time

import pytest

from tests.helpers import EventStream, leader_of, make_fleet, start_all, wait_until

pytestmark = pytest.mark.fleet


def _blocked(flag: str, then: str = "echo parent") -> list[str]:
    return ["sh", "-c", f"until [ -e {flag} ]; do sleep 0.05; done; {then}"]




def test_dependent_waits_says_why_then_runs(meshd, tmp_path):
    """A job submitted with --after waits (state waiting, nothing of it running) while its
    parent runs; `job status` says which job it waits for and on what, in text and JSON, and
    `jobs --state waiting` lists it; once the parent is done it runs, its items starting after
    the parent's end, and `job wait` exits 0."""
    flag = tmp_path / "go"
    meshd.submit("--id", "parent", "--", *_blocked(str(flag)))
    r = meshd.ctl("job", "submit", "--id", "child", "--after", "parent", "--", "sh", "-c",
                  "echo child")
    assert r.returncode == 0, r.stderr
    wait_until(lambda: meshd.record("parent")["state"] == "running", what="the parent runs")
    rec = meshd.record("child", items=True)
    assert rec["state"] == "waiting"
    assert rec["waiting_on"] == [{"id": "parent", "on": "ok"}]
    assert rec["after"] == [{"id": "parent", "on": "ok"}]
    assert rec["items_running"] == 0 and rec["items"][0]["attempts"] == 0
    text = meshd.ctl("job", "status", "child").stdout.decode()
    assert "waiting" in text and "waits for" in text and "job parent until it ends done" in text
    js = json.loads(meshd.ctl("--json", "job", "status", "child").stdout)
    assert js["state"] == "waiting" and js["waiting_on"] == [{"id": "parent", "on": "ok"}]
    listed = json.loads(meshd.ctl("--json", "jobs", "--state", "waiting").stdout)
    assert [j["id"] for j in listed] == ["child"]
    status, body = meshd.request("GET", "/jobs?state=waiting")
    assert status == 200 and [j["id"] for j in body] == ["child"]
    flag.touch()
    w = meshd.ctl("job", "wait", "child", timeout_s=90)
    assert w.returncode == 0, w.stderr
    parent, child = meshd.record("parent"), meshd.record("child", items=True)
    assert parent["state"] == "done" and child["state"] == "done"
    assert child["waiting_on"] == []
    assert child["items"][0]["started_at"] >= parent["finished_at"]
    assert meshd.request("GET", "/jobs/child/results")[1] == b"child\n"


def test_dep_failed_and_conditions(meshd, tmp_path):
    """A parent that fails: its ok dependent ends dep_failed (job wait and job results exit 1,
    status says why), a dependent of that with :ok too, while :fail and :end dependents run; a
    parent that has already ended is judged at the submit."""
    flag = tmp_path / "go"
    meshd.submit("--id", "p", "--", *_blocked(str(flag), "exit 3"))
    meshd.submit("--id", "ok", "--after", "p", "--", "echo", "ok")
    meshd.submit("--id", "ok2", "--after", "ok:ok", "--", "echo", "ok2")
    meshd.submit("--id", "end2", "--after", "ok:end", "--", "echo", "end2")
    meshd.submit("--id", "fail", "--after", "p:fail", "--", "echo", "fail")
    meshd.submit("--id", "end", "--after", "p:end", "--", "echo", "end")
    flag.touch()
    w = meshd.ctl("job", "wait", "ok", timeout_s=90)
    assert w.returncode == 1 and b"dep_failed" in w.stdout, (w.stdout, w.stderr)
    assert meshd.record("p")["state"] == "failed"
    for jid in ("fail", "end", "end2"):
        assert meshd.ctl("job", "wait", jid, timeout_s=90).returncode == 0, jid
    rec = meshd.record("ok2", items=True)
    assert rec["state"] == "dep_failed" and rec["items"][0]["state"] == "cancelled"
    assert rec["items"][0]["attempts"] == 0
    res = meshd.ctl("job", "results", "ok")
    assert res.returncode == 1 and b"dep_failed" in res.stderr, res.stderr
    text = meshd.ctl("job", "status", "ok").stdout.decode()
    assert "dep_failed" in text and "can never satisfy" in text
    # Parents that have ended: judged at once.
    born = json.loads(meshd.ctl("--json", "job", "submit", "--after", "p", "--", "true").stdout)
    assert born["state"] == "dep_failed"
    runs = meshd.submit("--after", "p:fail", "--after", "fail", "--", "echo", "late")
    assert meshd.ctl("job", "wait", runs, timeout_s=90).returncode == 0


@pytest.mark.parametrize("after,words", [
    ("nope", "does not exist"),
    ("p1:maybe", "unknown condition"),
    ("p1:", "unknown condition"),
    ("bad id", "bad job id"),
    ("self", "itself"),
])
def test_bad_after_refused_by_meshctl(meshd, after, words):
    """--after with an unknown job, a bad condition, a bad id or the job's own id: exit 2, and
    stderr says what is wrong; no job is made."""
    meshd.submit("--id", "p1", "--", "true")
    r = meshd.ctl("job", "submit", "--id", "self", "--after", after, "--", "true")
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert words in r.stderr.decode(), r.stderr
    assert meshd.request("GET", "/jobs/self")[0] == 404


@pytest.mark.parametrize("after", [
    "p1", {"id": "p1"}, [5], [None], [["p1"]], [{"id": "p1", "on": "sometimes"}],
    [{"id": "p1", "extra": 1}], ["p1", "p1"], ["p"] * 65, ["x" * 200], [{"id": "p1", "on": True}],
])
def test_bad_after_refused_over_http(meshd, after):
    """Malformed after over HTTP: 400 with an error, nothing made."""
    meshd.submit("--id", "p1", "--", "true")
    status, body = meshd.request("POST", "/jobs", {"id": "c1", "argv": ["true"], "after": after})
    assert status == 400 and "after" in body["error"], (status, body)
    assert meshd.request("GET", "/jobs/c1")[0] == 404


def test_events_follow_a_released_dependent(meshd, tmp_path):
    """/events names a dependent when the entry that ended its parent releases it: a held
    dependent (nothing else changes it afterwards) is sent, filtered by state=held, with its
    waiting_on empty; a state filter of waiting is accepted."""
    flag = tmp_path / "go"
    meshd.submit("--id", "p", "--", *_blocked(str(flag)))
    meshd.submit("--id", "c", "--hold", "--after", "p", "--", "true")
    assert meshd.record("c")["state"] == "waiting"
    since = meshd.record("c")["version"]
    waiting = EventStream(meshd, "state=waiting")
    assert waiting.status == 200, waiting.body
    waiting.close()
    stream = EventStream(meshd, f"job=c&state=held&since={since}")
    try:
        assert stream.status == 200, stream.body
        flag.touch()
        # Keep-alive comments come every events_keepalive_s: the wait is bounded by them.
        deadline = time.monotonic() + 30
        ev = stream.next()
        while ev.get("event") != "job":
            assert time.monotonic() < deadline, "no event for the released dependent"
            ev = stream.next()
        assert ev["data"]["id"] == "c" and ev["data"]["state"] == "held"
        assert ev["data"]["waiting_on"] == []
        assert ev["data"]["version"] == meshd.record("p")["version"]
    finally:
        stream.close()


def test_forget_of_a_waited_for_parent_refused(meshd, tmp_path):
    """Forgetting a parent a dependent waits on is refused (409: meshctl exits 2) naming the
    dependent; forgetting a forgotten parent's id in after is refused at submit."""
    flag = tmp_path / "go"
    meshd.submit("--id", "p", "--", *_blocked(str(flag)))
    meshd.submit("--id", "c", "--after", "p", "--", "true")
    r = meshd.ctl("job", "forget", "p")
    assert r.returncode == 2 and b"c" in r.stderr and b"wait for it" in r.stderr, r.stderr
    flag.touch()
    assert meshd.ctl("job", "wait", "c", timeout_s=90).returncode == 0
    assert meshd.ctl("job", "forget", "p").returncode == 0
    r = meshd.ctl("job", "submit", "--after", "p", "--", "true")
    assert r.returncode == 2 and b"forgotten" in r.stderr, r.stderr


def test_dependent_survives_leader_failover(tmp_path):
    """3 voters: a dependent waits while its parent runs; the leader is killed (-9); the new
    leader's table has the dependent waiting on the same parent; the parent completes and the
    dependent runs and is done, as every member agrees."""
    members = make_fleet(str(tmp_path), voters=3)
    try:
        start_all(members)
        flag = tmp_path / "go"
        lead = leader_of(members)
        assert lead.request("POST", "/jobs", {"id": "p", "argv": _blocked(str(flag))})[0] == 201
        status, rec = lead.request("POST", "/jobs", {"id": "c", "argv": ["echo", "after-p"],
                                                     "after": ["p:ok"]})
        assert status == 201 and rec["state"] == "waiting", rec
        wait_until(lambda: lead.record("p")["state"] == "running", what="the parent runs")
        lead.kill9()
        rest = [m for m in members if m is not lead]
        new = leader_of(rest)
        assert new is not lead
        rec = new.record("c")
        assert rec["state"] == "waiting" and rec["waiting_on"] == [{"id": "p", "on": "ok"}]
        flag.touch()
        done = new.wait_job("c", timeout_s=120)
        assert done["state"] == "done"
        assert new.request("GET", "/jobs/c/results")[1] == b"after-p\n"
        assert new.record("p")["state"] == "done"
        for m in rest:
            wait_until(lambda m=m: m.record("c")["state"] == "done",
                       what=f"{m.name} sees the dependent done")
    finally:
        for m in members:
            m.stop()
