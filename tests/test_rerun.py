"""Re-running finished jobs on real members (issue 12 point 3, and stdout/stderr to a path):
`meshctl job rerun ID [--failed-only]` and POST /jobs/{id}/rerun (Idempotency-Key, a follower
forwarding it), `--restart N|forever` with `--restart-delay`, `--resubmit N`, a cancel stopping
restarts, the earlier runs in `job status` and `meshctl history`, a leader killed during a
restart's delay (neither skipped nor doubled), `--stdout/--stderr PATH` (also as another user),
and hostile input to every new flag, key and route.

Items append a line to a file the test reads, so that "ran N times" is counted from the
programs' own effects; items that must fail first test for a flag file the test creates.
"""

from __future__ import annotations

import json
import os
import pathlib
import pwd
import shutil
import stat
import tempfile

import pytest

from meshjobs import limits
from meshjobs.runas import can_switch_user
from tests.helpers import Meshd, leader_of, make_fleet, start_all, wait_until

pytestmark = pytest.mark.fleet




def _lines(path) -> list[str]:
    try:
        with open(path) as f:
            return f.read().split()
    except FileNotFoundError:
        return []


def _settled(m, job_id: str) -> dict:
    """The job's record once it has ended and no automatic re-run is due."""
    return wait_until(lambda: (lambda r: r if r["state"] in ("done", "failed", "cancelled")
                               and not r.get("rerun_due_at") else None)(m.record(job_id, True)),
                      what=f"job {job_id} ended with no re-run due")


def test_rerun_failed_only_then_whole_with_history(meshd, tmp_path):
    """A job with one failing item ends failed; `job rerun --failed-only` runs only that item
    again (attempt 2, the others keep attempt 1) and the job ends done; its record and `job
    status` show run 2 and the earlier failed run, `meshctl history` has the earlier run's
    record (why "rerun"); a whole rerun over HTTP with an Idempotency-Key, sent twice, runs
    every item once more (run 3, not 4)."""
    flag, log = tmp_path / "fixed", tmp_path / "ran"
    prog = f'read x; echo "$x" >> {log}; [ "$x" != b ] || test -e {flag}'
    status, rec = meshd.request("POST", "/jobs", {"id": "j", "argv": ["sh", "-c", prog],
                                                  "items": ["a", "b", "c"]})
    assert status == 201, rec
    assert meshd.wait_job("j")["state"] == "failed"
    r = meshd.ctl("job", "rerun", "j")
    assert r.returncode == 0, r.stderr  # nothing stops a rerun of a failed job: fix first
    assert meshd.wait_job("j")["state"] == "failed"
    flag.touch()
    r = meshd.ctl("--json", "job", "rerun", "j", "--failed-only")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["run"] == 3
    rec = meshd.wait_job("j")
    assert rec["state"] == "done"
    assert [it["attempts"] for it in rec["items"]] == [2, 3, 2]
    assert [p["state"] for p in rec["previous_runs"]] == ["failed", "failed"]
    assert sorted(_lines(log)) == sorted(["a", "b", "c"] * 2 + ["b"])
    text = meshd.ctl("job", "status", "j").stdout.decode()
    assert "run        3" in text and "run 1" in text and "failed" in text
    hist = json.loads(meshd.ctl("--json", "history").stdout)
    rows = [row for row in hist["records"] if row["job"]["id"] == "j"]
    assert [row["why"] for row in rows] == ["rerun", "rerun"]
    assert rows[-1]["job"]["state"] == "failed" and rows[-1]["job"]["items_summary"]
    key = {"Idempotency-Key": "rerun-j-1"}
    first = meshd.request("POST", "/jobs/j/rerun", {"failed_only": False}, headers=key)
    again = meshd.request("POST", "/jobs/j/rerun", {"failed_only": False}, headers=key)
    assert first[0] == again[0] == 200, (first, again)
    assert first[1]["run"] == again[1]["run"] == 4
    assert meshd.wait_job("j")["run"] == 4
    # The same key on another body: refused, not answered with the first one's outcome.
    other = meshd.request("POST", "/jobs/j/rerun", {"failed_only": True}, headers=key)
    assert other[0] == 422, other
    # No body at all is a whole rerun.
    status, body = meshd.request("POST", "/jobs/j/rerun")
    assert status == 200 and body["run"] == 5, body


def test_rerun_refused_running_unknown_dep_failed(meshd, tmp_path):
    """A running job: 409 saying to wait or cancel (meshctl exits non-zero with those words);
    an unknown job: 404; a forgotten one: 404; a dep_failed one: 409."""
    flag = tmp_path / "go"
    meshd.submit("--id", "busy", "--", "sh", "-c", f"until [ -e {flag} ]; do sleep 0.05; done")
    wait_until(lambda: meshd.record("busy")["state"] == "running", what="the job runs")
    status, body = meshd.request("POST", "/jobs/busy/rerun", {})
    assert status == 409 and "cancel" in body["error"] and "wait" in body["error"], body
    r = meshd.ctl("job", "rerun", "busy")
    assert r.returncode != 0 and b"only a finished job" in r.stderr
    status, body = meshd.request("POST", "/jobs/nope/rerun", {})
    assert status == 404, body
    assert meshd.ctl("job", "rerun", "nope").returncode != 0
    flag.touch()
    meshd.wait_job("busy")
    meshd.request("POST", "/jobs", {"id": "p", "argv": ["false"]})
    assert meshd.wait_job("p")["state"] == "failed"
    meshd.request("POST", "/jobs", {"id": "kid", "argv": ["true"], "after": ["p:ok"]})
    assert meshd.wait_job("kid")["state"] == "dep_failed"
    status, body = meshd.request("POST", "/jobs/kid/rerun", {})
    assert status == 409 and "dep_failed" in body["error"], body
    # A rerun of the parent does not settle its dependent again.
    assert meshd.request("POST", "/jobs/p/rerun", {})[0] == 200
    meshd.wait_job("p")
    assert meshd.record("kid")["state"] == "dep_failed"
    assert meshd.request("DELETE", "/jobs/busy")[0] == 200
    status, body = meshd.request("POST", "/jobs/busy/rerun", {})
    assert status == 404 and "forgotten" in body["error"], body


def test_rerun_of_a_dependent_cancelled_while_waiting(meshd, tmp_path):
    """A dependent cancelled while it waited, rerun: it waits for its parent again (state
    waiting, nothing of it runs) and runs once the parent is done."""
    flag = tmp_path / "go"
    meshd.submit("--id", "par", "--", "sh", "-c", f"until [ -e {flag} ]; do sleep 0.05; done")
    meshd.submit("--id", "dep", "--after", "par", "--", "echo", "dep")
    assert meshd.ctl("job", "cancel", "dep").returncode == 0
    r = meshd.ctl("--json", "job", "rerun", "dep")
    assert r.returncode == 0, r.stderr
    rec = json.loads(r.stdout)
    assert rec["state"] == "waiting" and rec["waiting_on"] == [{"id": "par", "on": "ok"}], rec
    flag.touch()
    assert meshd.wait_job("dep")["state"] == "done"
    assert meshd.request("GET", "/jobs/dep/results")[1] == b"dep\n"


def test_restart_runs_n_more_times_after_delay(meshd, tmp_path):
    """--restart 2 --restart-delay: the job runs 3 times in all, the record counts 2 restarts
    and shows the earlier runs; each run starts at least the delay after the one before."""
    log = tmp_path / "ran"
    meshd.submit("--id", "r", "--restart", "2", "--restart-delay", "1", "--",
            "sh", "-c", f"date +%s.%N >> {log}")
    rec = wait_until(lambda: (lambda r: r if r["restarts"] == 2 and r["state"] == "done"
                              and not r["rerun_due_at"] else None)(meshd.record("r")),
                     what="two restarts")
    assert rec["run"] == 3 and rec["restart"] == 2 and len(rec["previous_runs"]) == 2
    assert len(_lines(log)) == 3
    runs = [p["finished_at"] for p in rec["previous_runs"]]
    item = meshd.record("r", items=True)["items"][0]
    assert item["attempts"] == 3
    assert item["started_at"] >= runs[1] + 1 - 0.01
    text = meshd.ctl("job", "status", "r").stdout.decode()
    assert "restart 2 of 2" in text


def test_cancel_stops_restarting(meshd, tmp_path):
    """--restart forever with a long delay: after the first run a re-run is due; a cancel drops
    it (the job stays done, meshctl cancel exits 0); nothing runs again."""
    log = tmp_path / "ran"
    meshd.submit("--id", "f", "--restart", "forever", "--restart-delay", "3600", "--",
            "sh", "-c", f"echo x >> {log}")
    rec = wait_until(lambda: (lambda r: r if r.get("rerun_due_at") else None)(
        meshd.record("f")), what="a restart due")
    assert rec["state"] == "done" and rec["rerun_due_why"] == "restart"
    text = meshd.ctl("job", "status", "f").stdout.decode()
    assert "next run" in text and "cancel" in text
    r = meshd.ctl("job", "cancel", "f")
    assert r.returncode == 0, r.stderr
    rec = meshd.record("f")
    assert rec["state"] == "done" and rec["rerun_due_at"] is None and rec["restarts"] == 0
    assert _lines(log) == ["x"]


def test_resubmit_runs_again_after_failure(meshd, tmp_path):
    """--resubmit 2: a job that fails runs again, whole, twice more (3 runs), then stays
    failed; --retries would have re-run single items instead."""
    log = tmp_path / "ran"
    meshd.submit("--id", "rs", "--resubmit", "2", "--", "sh", "-c", f"echo x >> {log}; exit 4")
    rec = wait_until(lambda: (lambda r: r if r["resubmits"] == 2 and r["state"] == "failed"
                              and not r["rerun_due_at"] else None)(meshd.record("rs")),
                     what="two resubmits")
    assert rec["run"] == 3 and len(_lines(log)) == 3
    assert [p["then"] for p in rec["previous_runs"]] == ["resubmit", "resubmit"]


def test_stdout_stderr_to_paths(meshd, tmp_path):
    """--stdout with {index} relative to --cwd and --stderr absolute: each item's output is in
    its file and in the blob store; a path whose folder is missing: the item is done all the
    same, its error says which path and what to do."""
    work = tmp_path / "work"
    work.mkdir()
    err_dir = tmp_path / "errs"
    err_dir.mkdir()
    status, rec = meshd.request("POST", "/jobs", {
        "id": "o", "argv": ["sh", "-c", 'read x; echo "out $x"; echo "err $x" >&2'],
        "items": ["a", "b"], "cwd": str(work), "stdout": "out-{index}.txt",
        "stderr": str(err_dir / "e{index}")})
    assert status == 201, rec
    assert rec["stdout"] == "out-{index}.txt"
    rec = meshd.wait_job("o")
    assert rec["state"] == "done" and all(it["error"] is None for it in rec["items"])
    assert (work / "out-0.txt").read_text() == "out a\n"
    assert (work / "out-1.txt").read_text() == "out b\n"
    assert (err_dir / "e1").read_text() == "err b\n"
    r = meshd.ctl("job", "submit", "--id", "o2", "--cwd", str(work), "--stdout",
                  "missing/dir/out", "--", "echo", "kept")
    assert r.returncode == 0, r.stderr
    rec = meshd.wait_job("o2")
    assert rec["state"] == "done"
    error = rec["items"][0]["error"]
    assert "stdout not written to" in error and "missing/dir/out" in error and "kept" in error
    assert meshd.request("GET", "/jobs/o2/results")[1] == b"kept\n"
    text = meshd.ctl("job", "status", "o").stdout.decode()
    assert "stdout     out-{index}.txt" in text and f"stderr     {err_dir}/e{{index}}" in text


def test_python_item_output_to_path(tmp_path):
    """A python pool's item writes its returned bytes (stdout) to --stdout's path too."""
    cfg = tmp_path / "meshd.toml"
    cfg.write_text('name = "m1"\n[pools.py]\nkind = "python"\nslots = 1\n'
                   '[pools.default]\nslots = 1\n')
    funcs = tmp_path / "funcs"
    funcs.mkdir()
    (funcs / "rerunfuncs.py").write_text("def shout(data):\n    return data.upper()\n")
    m = Meshd(str(tmp_path / "m1"), config=str(cfg))
    try:
        m.start()
        status, rec = m.request("POST", "/jobs", {"pool": "py", "argv": ["rerunfuncs:shout"],
                                                  "cwd": str(funcs), "items": ["a", "b"],
                                                  "stdout": "py-{index}.out"})
        assert status == 201, rec
        done = m.wait_job(rec["id"])
        assert done["state"] == "done" and all(it["error"] is None for it in done["items"])
        assert (funcs / "py-0.out").read_bytes() == b"A"
        assert (funcs / "py-1.out").read_bytes() == b"B"
    finally:
        m.stop()


@pytest.mark.skipif(os.geteuid() != 0 or not can_switch_user(),
                    reason="needs root with CAP_SETUID and CAP_SETGID")
def test_output_path_written_as_the_items_user(meshd, tmp_path):
    """An item run as nobody writes its --stdout file as nobody: into a folder nobody may write
    the file is nobody's; into root's own 0700 folder it is refused, and the error says so."""
    nobody = pwd.getpwnam("nobody")
    # pytest's own folders are root's (0700): nobody could not reach into them.
    base = pathlib.Path(tempfile.mkdtemp(prefix="meshjobs-outpaths-", dir="/tmp"))
    try:
        _written_as_nobody(meshd, base, nobody)
    finally:
        shutil.rmtree(base)


def _written_as_nobody(meshd, base, nobody) -> None:
    os.chmod(base, 0o755)
    open_dir = base / "open"
    open_dir.mkdir()
    os.chmod(open_dir, 0o777)
    shut = base / "shut"
    shut.mkdir(mode=0o700)
    for job_id, where in (("as1", open_dir / "out"), ("as2", shut / "out")):
        status, rec = meshd.request("POST", "/jobs", {"id": job_id, "argv": ["echo", "hi"],
                                                      "user": "nobody", "cwd": "/",
                                                      "stdout": str(where)})
        assert status == 201, rec
    rec = meshd.wait_job("as1")
    assert rec["state"] == "done" and rec["items"][0]["error"] is None, rec["items"][0]
    st = os.stat(open_dir / "out")
    assert st.st_uid == nobody.pw_uid and (open_dir / "out").read_text() == "hi\n"
    assert stat.S_ISREG(st.st_mode)
    rec = meshd.wait_job("as2")
    assert rec["state"] == "done"
    assert "not written" in rec["items"][0]["error"] and "as uid" in rec["items"][0]["error"]
    assert not (shut / "out").exists()


BAD_SUBMITS = [
    {"restart": 0}, {"restart": "always"}, {"restart": True}, {"restart": -5},
    {"restart": 10**12}, {"resubmit": 0}, {"resubmit": "2"}, {"resubmit": None, "restart_delay_s": 1},
    {"restart": 1, "restart_delay_s": -0.5}, {"restart": 1, "restart_delay_s": "1"},
    {"restart": 1, "restart_delay_s": 1e300}, {"stdout": "../../etc/passwd"},
    {"stdout": "a\x00b"}, {"stderr": ["x"]}, {"stdout": "o{job}"}, {"stdout": "x" * 5000},
]


@pytest.mark.parametrize("delay", [0, 0.5, 1e-9])
def test_restart_delay_under_the_minimum_is_refused(meshd, delay):
    """restart_delay_s under restart_delay_s_min (reruns.py Rule 6): POST /jobs is 400 naming
    the minimum, PUT /cron/{name} too, meshctl refuses it before sending; no job is made."""
    status, body = meshd.request("POST", "/jobs", {"id": "fast", "argv": ["true"],
                                                   "restart": "forever", "restart_delay_s": delay})
    assert status == 400 and "restart_delay_s_min" in body["error"], body
    assert f"at least {limits.restart_delay_s_min}" in body["error"]
    assert meshd.request("GET", "/jobs/fast")[0] == 404
    status, body = meshd.request("PUT", "/cron/fast", {"spec": "@every 1h", "job": {
        "argv": ["true"], "restart": 1, "restart_delay_s": delay}})
    assert status == 400 and "restart_delay_s_min" in body["error"], body
    r = meshd.ctl("job", "submit", "--restart", "forever", "--restart-delay", str(delay), "--",
                  "true")
    assert r.returncode != 0 and b"restart-delay" in r.stderr


@pytest.mark.parametrize("bad", BAD_SUBMITS)
def test_hostile_submit_keys(meshd, bad):
    status, body = meshd.request("POST", "/jobs", {"argv": ["true"], **bad})
    assert status == 400 and body["error"], body


def test_hostile_rerun_route_and_flags(meshd):
    """The rerun route refuses bodies that are not {"failed_only": bool}, bad ids and huge
    bodies; meshctl refuses bad --restart/--resubmit/--restart-delay values before sending."""
    meshd.request("POST", "/jobs", {"id": "h", "argv": ["true"]})
    meshd.wait_job("h")
    for raw in (b"[]", b"\"x\"", b"{\"failed_only\": 1}", b"{\"failed_only\": \"yes\"}",
                b"{\"other\": true}", b"{not json", b"{\"failed_only\": null, \"x\": []}"):
        status, body = meshd.request("POST", "/jobs/h/rerun", raw=raw)
        assert status == 400, (raw, status, body)
    assert meshd.request("POST", "/jobs/..%2f/rerun", {})[0] in (400, 404)
    assert meshd.request("POST", "/jobs/" + "x" * 300 + "/rerun", {})[0] == 400
    status, _ = meshd.request("POST", "/jobs/h/rerun", raw=b"{" + b" " * (limits.http_body_bytes_max + 10) + b"}")
    assert status == 413
    assert meshd.request("GET", "/jobs/h/rerun")[0] in (404, 405)
    for args in (["--restart", "0"], ["--restart", "-1"], ["--restart", "x"],
                 ["--restart", "9" * 40], ["--resubmit", "0"], ["--resubmit", "abc"],
                 ["--restart", "1", "--restart-delay", "-1"], ["--restart-delay", "2"],
                 ["--restart", "1", "--restart-delay", "nan"],
                 ["--stdout", "../x"], ["--stderr", ""]):
        r = meshd.ctl("job", "submit", *args, "--", "true")
        assert r.returncode != 0 and r.stderr, args
    assert meshd.ctl("job", "rerun").returncode != 0
    assert meshd.ctl("job", "rerun", "bad/id").returncode != 0
    assert meshd.record("h")["state"] == "done"


def test_rerun_forwarded_and_restart_across_leader_kill(tmp_path):
    """3 voters: a rerun sent to a follower is forwarded and runs; a job with --restart 1 and
    a delay ends its first run, the leader is killed (-9) during the delay, and the new leader
    restarts it exactly once: two runs in all, as every member agrees."""
    members = make_fleet(str(tmp_path), voters=3)
    try:
        start_all(members)
        lead = leader_of(members)
        follower = next(m for m in members if m is not lead)
        # Items write into a folder of their own: the folder that holds the members' data
        # folders is walled off for creating files (meshjobs/wall.py, Rule 3).
        (tmp_path / "out").mkdir()
        log = tmp_path / "out" / "ran"
        status, rec = follower.request("POST", "/jobs", {"id": "fw", "argv": ["sh", "-c",
                                                         f"echo fw >> {log}"]})
        assert status == 201, rec
        assert follower.wait_job("fw")["state"] == "done"
        status, rec = follower.request("POST", "/jobs/fw/rerun", {"failed_only": False},
                                       headers={"Idempotency-Key": "fw-1"})
        assert status == 200 and rec["run"] == 2, rec
        assert follower.wait_job("fw")["state"] == "done"
        assert _lines(log) == ["fw", "fw"]
        log2 = tmp_path / "out" / "ran2"
        status, rec = follower.request("POST", "/jobs", {
            "id": "rk", "argv": ["sh", "-c", f"echo rk >> {log2}"], "restart": 1,
            "restart_delay_s": 4})
        assert status == 201, rec
        wait_until(lambda: lead.record("rk").get("rerun_due_at"), what="a restart due")
        lead.kill9()
        rest = [m for m in members if m is not lead]
        new = leader_of(rest)
        rec = _settled(new, "rk")
        assert rec["state"] == "done" and rec["restarts"] == 1 and rec["run"] == 2, rec
        assert _lines(log2) == ["rk", "rk"]
        for m in rest:
            wait_until(lambda m=m: m.record("rk")["restarts"] == 1
                       and m.record("rk")["state"] == "done",
                       what=f"{m.name} sees the restart")
    finally:
        for m in members:
            m.stop()
