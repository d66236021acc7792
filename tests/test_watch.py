"""`meshctl watch` against a real member (issue 13): files in, jobs out, results beside each
file, nothing run twice, also when the watcher is killed between its submit and its state file.

Every job appends one line to a run log, so "ran exactly once" is counted from what the programs
did, not from what the watcher says.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.helpers import env_with_path, wait_until

pytestmark = pytest.mark.fleet


def config(folder: str, **watch) -> dict:
    """A watch of `folder` whose job appends "<index> <filename>" to folder/../ran.log."""
    ran = os.path.join(os.path.dirname(folder), "ran.log")
    base = {"path": folder, "glob": "*.in", "refresh": 0.2, "rescan": 1,
            "jobs": [{"argv": ["sh", "-c", f"echo \"$1 $2\" >> {ran}", "sh", "%(index)s",
                               "%(filename)s"]}]}
    base.update(watch)
    return {"name": "t", "watch": {"w": base}}


def write_config(tmp_path, cfg: dict, name: str = "watch.json") -> str:
    path = os.path.join(str(tmp_path), name)
    with open(path, "w") as f:
        json.dump(cfg, f)
    return path


def ran(folder: str) -> list[str]:
    try:
        with open(os.path.join(os.path.dirname(folder), "ran.log")) as f:
            return sorted(f.read().splitlines())
    except FileNotFoundError:
        return []


def states(folder: str) -> list[str]:
    return sorted(n for n in os.listdir(folder) if n.startswith("._"))


def put(folder: str, name: str, text: str = "x", age_s: float = 0) -> None:
    path = os.path.join(folder, name)
    with open(path, "w") as f:
        f.write(text)
    if age_s:
        t = time.time() - age_s
        os.utime(path, (t, t))


def jobs_of(m) -> list[dict]:
    status, page = m.request("GET", "/jobs?limit=1000")
    assert status == 200, page
    return page["jobs"] if isinstance(page, dict) else page


@pytest.fixture
def folder(tmp_path) -> str:
    path = os.path.join(str(tmp_path), "in")
    os.makedirs(path)
    return path


def start_watcher(m, *args: str) -> subprocess.Popen:
    """A long-running `meshctl watch`; its log goes to watch.log beside the member's data (a pipe
    nobody reads would fill and stop it)."""
    env = env_with_path()
    env.pop("MESHJOBS_AT", None)
    log_path = os.path.join(os.path.dirname(m.data.rstrip("/")), "watch.log")
    with open(log_path, "ab") as log:
        proc = subprocess.Popen([sys.executable, "-m", "meshjobs.cli", "--at", m.url, "watch",
                                 *args], stdout=log, stderr=log, env=env, start_new_session=True)
    proc.log_path = log_path  # type: ignore[attr-defined]
    return proc


def watch_log(proc: subprocess.Popen) -> str:
    with open(proc.log_path) as f:  # type: ignore[attr-defined]
        return f.read()


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)


def test_once_processes_a_folder_and_never_twice(meshd, folder, tmp_path) -> None:
    """--once: one scan, wait for the jobs, exit 0; results are kept beside each file in
    ._<name>_<n>_<filename>.done; a second run submits nothing and runs nothing."""
    put(folder, "a.in")
    put(folder, "b.in")
    put(folder, "c.out")
    cfg = write_config(tmp_path, config(folder))
    r = meshd.ctl("watch", "--once", cfg)
    assert r.returncode == 0, r.stderr.decode()
    assert ran(folder) == ["0 a.in", "0 b.in"]
    assert states(folder) == ["._t-w_0_a.in.done", "._t-w_0_b.in.done"]
    rec = json.load(open(os.path.join(folder, "._t-w_0_a.in.done")))
    assert rec["state"] == "done" and rec["job"]["state"] == "done"
    assert rec["watch"]["file"] == "a.in" and rec["watch"]["attempt"] == 0
    before = len(jobs_of(meshd))
    r = meshd.ctl("watch", "--once", cfg)
    assert r.returncode == 0 and ran(folder) == ["0 a.in", "0 b.in"]
    assert len(jobs_of(meshd)) == before
    summary = [json.loads(line) for line in r.stderr.decode().splitlines()
               if '"watch_scan"' in line]
    assert summary and summary[0]["submits"] == 0 and summary[0]["processed"] == 2


def test_dry_run_changes_nothing(meshd, folder, tmp_path) -> None:
    """--dry-run prints the submits one scan would make and submits and writes nothing."""
    put(folder, "a.in")
    cfg = write_config(tmp_path, config(folder))
    r = meshd.ctl("watch", "--dry-run", cfg)
    assert r.returncode == 0, r.stderr.decode()
    (line,) = r.stdout.decode().splitlines()
    out = json.loads(line)
    assert out["file"] == "a.in" and out["submit"]["id"].startswith("t-w-0-a.in.")
    assert jobs_of(meshd) == [] and states(folder) == []


def _scan_lines(r) -> list[dict]:
    return [json.loads(line) for line in r.stderr.decode().splitlines() if '"watch_scan"' in line]


def test_files_too_young_are_counted_deferred_with_when_due(meshd, folder, tmp_path) -> None:
    """--dry-run and --once with two matching files younger than min_age: the scan says
    deferred=2 and when the first comes of age, and submits nothing; once old enough, both run."""
    put(folder, "a.in")
    put(folder, "b.in", age_s=30)
    cfg = write_config(tmp_path, config(folder, min_age=3600))
    for mode in ("--dry-run", "--once"):
        r = meshd.ctl("watch", mode, cfg)
        assert r.returncode == 0, r.stderr.decode()
        (scan,) = _scan_lines(r)
        assert scan["files"] == 0 and scan["deferred"] == 2 and scan["submits"] == 0, scan
        assert 3500 <= scan["next_due_in_s"] <= 3570, scan  # b.in's: 30 s of its hour gone
    assert jobs_of(meshd) == [] and ran(folder) == []
    put(folder, "a.in", age_s=7200)
    put(folder, "b.in", age_s=7200)
    r = meshd.ctl("watch", "--once", cfg)
    assert r.returncode == 0, r.stderr.decode()
    (scan,) = _scan_lines(r)
    assert scan["deferred"] == 0 and "next_due_in_s" not in scan, scan
    assert ran(folder) == ["0 a.in", "0 b.in"]


def test_a_running_watcher_takes_a_young_file_as_it_comes_of_age(meshd, folder,
                                                                  tmp_path) -> None:
    """A file 1 s short of min_age is submitted once it is old enough, not a rescan later."""
    put(folder, "a.in", age_s=2)
    cfg = write_config(tmp_path, config(folder, min_age=3, rescan=3600, refresh=0.2))
    proc = start_watcher(meshd, cfg)
    try:
        wait_until(lambda: ran(folder) == ["0 a.in"], what="a.in's job, as it came of age")
    finally:
        stop(proc)


def test_a_running_watcher_hears_of_job_ends_on_the_change_feed(meshd, folder,
                                                                 tmp_path) -> None:
    """A watcher whose refresh and rescan are an hour learns of its job's end from /events as
    it commits, and keeps the file's state then, not an hour later."""
    put(folder, "a.in")
    cfg = write_config(tmp_path, config(folder, refresh=3600, rescan=3600))
    proc = start_watcher(meshd, cfg)
    try:
        wait_until(lambda: "._t-w_0_a.in.done" in states(folder), what="the job's end kept")
        assert ran(folder) == ["0 a.in"]
        assert '"watch_job_ended"' in watch_log(proc)
    except AssertionError:
        raise AssertionError(watch_log(proc)[-3000:]) from None
    finally:
        stop(proc)


def test_overrides_toml_and_bad_config(meshd, folder, tmp_path) -> None:
    """A TOML config with key=value overrides runs; a broken config exits 2 naming every error."""
    toml = os.path.join(str(tmp_path), "w.toml")
    with open(toml, "w") as f:
        f.write(f'name = "t"\n[watch.w]\npath = "{folder}"\nglob = "*.nope"\n'
                f'jobs = [{{args = ["true"]}}]\n')
    put(folder, "a.in")
    r = meshd.ctl("watch", "--dry-run", "watch.w.glob=*.in", toml)
    assert r.returncode == 0 and json.loads(r.stdout)["file"] == "a.in", r.stderr.decode()
    bad = write_config(tmp_path, {"watch": {"w": {"path": folder, "glob": "a/b", "jobs": [
        {"argv": ["x", "%(nope)s"]}], "refresh": -1}}}, "bad.json")
    r = meshd.ctl("watch", "--once", bad)
    err = r.stderr.decode()
    assert r.returncode == 2 and "watch.w.glob" in err and "%(nope)s" in err
    assert "watch.w.refresh" in err and "Traceback" not in err


def test_retry_of_a_failing_command(meshd, folder, tmp_path) -> None:
    """retry (default): a failed job is kept in .failed and submitted again (a new attempt, a new
    id) at the next scan; once done, .failed gives way to .done. retry=0 leaves it failed."""
    put(folder, "a.in")
    count = os.path.join(str(tmp_path), "count")
    cmd = f"n=$(cat {count} 2>/dev/null || echo 0); echo $((n+1)) > {count}; [ $n -ge 1 ]"
    cfg = write_config(tmp_path, config(folder, jobs=[{"argv": ["sh", "-c", cmd]}]))
    r = meshd.ctl("watch", "--once", cfg)
    assert r.returncode == 1 and states(folder) == ["._t-w_0_a.in.failed"]
    r = meshd.ctl("watch", "--once", "watch.w.retry=0", cfg)
    assert r.returncode == 0 and open(count).read().strip() == "1"  # not retried
    r = meshd.ctl("watch", "--once", cfg)
    assert r.returncode == 0 and states(folder) == ["._t-w_0_a.in.done"]
    rec = json.load(open(os.path.join(folder, "._t-w_0_a.in.done")))
    assert rec["watch"]["attempt"] == 1 and open(count).read().strip() == "2"


def test_filesets_skip_and_updated(meshd, folder, tmp_path) -> None:
    """Filesets run when complete (partial: when the first list has the file), skip marks a set
    done without a job, updated runs jobs[0] again when the mtime changes."""
    ranlog = os.path.join(str(tmp_path), "ran.log")
    cfg = config(folder, glob=["*.foo", "*.bar"], split=".", match=2, skip="out", updated=True,
                 jobs=[{"argv": ["sh", "-c", f"echo \"%(index)s %(fileset)s\" >> {ranlog}"]}])
    path = write_config(tmp_path, cfg)
    for name in ("d.00.foo", "d.00.bar", "d.01.foo", "d.02.foo", "d.02.bar", "d.02.out"):
        put(folder, name, age_s=100)
    assert meshd.ctl("watch", "--once", path).returncode == 0
    assert ran(folder) == ["0 d.00.foo d.00.bar"]
    assert "._t-w_0_d.02.foo.done" in states(folder)  # skipped, marked done
    assert meshd.ctl("watch", "--once", "watch.w.partial=true", path).returncode == 0
    assert ran(folder) == ["0 d.00.foo d.00.bar", "0 d.01.foo"]
    put(folder, "d.00.foo", "changed")  # a new mtime
    assert meshd.ctl("watch", "--once", path).returncode == 0
    assert ran(folder) == ["0 d.00.foo d.00.bar", "0 d.00.foo d.00.bar", "0 d.01.foo"]
    os.unlink(os.path.join(folder, "d.00.foo"))
    assert meshd.ctl("watch", "--once", path).returncode == 0
    assert not any("d.00.foo" in s for s in states(folder))  # cleaned up with the file


def test_files_arriving_and_the_chain(meshd, folder, tmp_path) -> None:
    """A running watcher: files arriving over time get jobs[0]; each older file moves down and
    gets jobs[1]; every (index, file) ran exactly once. `count` ends the watcher."""
    ranlog = os.path.join(str(tmp_path), "ran.log")
    jobs = [{"argv": ["sh", "-c", f"echo \"%(index)s %(filename)s\" >> {ranlog}"]}] * 2
    path = write_config(tmp_path, config(folder, jobs=jobs, count=5))
    proc = start_watcher(meshd, path)
    try:
        put(folder, "1.in")
        wait_until(lambda: ran(folder) == ["0 1.in"], what="1.in's jobs[0]")
        put(folder, "2.in")
        wait_until(lambda: ran(folder) == ["0 1.in", "0 2.in", "1 1.in"], what="the chain")
        put(folder, "3.in")
        wait_until(lambda: len(ran(folder)) == 5, what="3.in's jobs[0] and 2.in's jobs[1]")
        proc.wait(timeout=60)  # count: 5 jobs ended
        assert proc.returncode == 0, watch_log(proc)
    finally:
        stop(proc)
    assert ran(folder) == ["0 1.in", "0 2.in", "0 3.in", "1 1.in", "1 2.in"]


def test_killed_between_submit_and_state_file(meshd, folder, tmp_path) -> None:
    """The watcher killed (kill -9) after its submit and before the job's state file, then
    restarted: the same derived id is submitted, meshd answers it exists, the result is kept;
    the program ran once."""
    gate = os.path.join(str(tmp_path), "gate")
    ranlog = os.path.join(str(tmp_path), "ran.log")
    cmd = f"while [ ! -f {gate} ]; do sleep 0.05; done; echo \"%(filename)s\" >> {ranlog}"
    path = write_config(tmp_path, config(folder, jobs=[{"argv": ["sh", "-c", cmd]}]))
    put(folder, "a.in")
    proc = start_watcher(meshd, path)
    try:
        wait_until(lambda: [j for j in jobs_of(meshd) if j["state"] == "running"],
                   what="the job running")
    finally:
        stop(proc)  # kill -9: its state in memory is lost
    assert states(folder) == []
    open(gate, "w").close()
    (job,) = jobs_of(meshd)
    meshd.wait_job(job["id"])
    r = meshd.ctl("watch", "--once", path)
    assert r.returncode == 0, r.stderr.decode()
    submitted = [json.loads(line) for line in r.stderr.decode().splitlines()
                 if '"watch_submitted"' in line]
    # The same derived id, answered by the job that exists (200, not 201): not a new job.
    assert [(s["job"], s["new"]) for s in submitted] == [(job["id"], False)]
    first = [json.loads(line) for line in watch_log(proc).splitlines()
             if '"watch_submitted"' in line]
    assert [(s["job"], s["new"]) for s in first] == [(job["id"], True)]
    assert states(folder) == ["._t-w_0_a.in.done"]
    assert ran(folder) == ["a.in"] and len(jobs_of(meshd)) == 1
    assert meshd.ctl("watch", "--once", path).returncode == 0 and ran(folder) == ["a.in"]


def test_killed_at_random_points_and_restarted(meshd, folder, tmp_path) -> None:
    """The watcher killed (kill -9) at seeded random points while files arrive and a chain
    jobs[0]/jobs[1] moves them down, then restarted: each (index, file) ran exactly once."""
    import random
    seed = random.randrange(2**32)
    print(f"seed {seed}")
    rng = random.Random(seed)
    ranlog = os.path.join(str(tmp_path), "ran.log")
    jobs = [{"argv": ["sh", "-c", f"echo \"%(index)s %(filename)s\" >> {ranlog}"]}] * 2
    path = write_config(tmp_path, config(folder, jobs=jobs))
    names = [f"{i}.in" for i in range(1, 6)]
    for name in names:
        proc = start_watcher(meshd, path)
        try:
            put(folder, name)
            # The kill point itself is what is drawn: a crash at any moment, not a wait.
            time.sleep(rng.uniform(0, 1.5))  # sleep-ok: a kill at a random moment is the test
        finally:
            stop(proc)
    for _ in range(len(jobs) + 1):  # run_all: one index per scan of a file
        r = meshd.ctl("watch", "--once", path)
        assert r.returncode == 0, r.stderr.decode()
    expected = sorted([f"0 {n}" for n in names] + [f"1 {n}" for n in names[:-1]])
    assert ran(folder) == expected, f"seed {seed}"
    r = meshd.ctl("watch", "--once", path)
    assert ran(folder) == expected and '"submits": 0' in r.stderr.decode()


def test_member_restart(tmp_path, tmp_path_factory, folder) -> None:
    """The member stopped and started again under a running watcher: submits and refreshes that
    fail are logged and tried again; every file's job runs once."""
    from tests.helpers import Meshd
    # The data folder beside tmp_path, not in it: items write ran.log into tmp_path, and the
    # folder that holds a data folder is walled off for creating files (meshjobs/wall.py).
    m = Meshd(os.path.join(str(tmp_path_factory.mktemp("members")), "m1"))
    try:
        m.start()
        m.http = m.url.removeprefix("http://")  # the restart keeps the port the watcher knows
        path = write_config(tmp_path, config(folder))
        proc = start_watcher(m, path)
        try:
            put(folder, "1.in")
            wait_until(lambda: states(folder) == ["._t-w_0_1.in.done"], what="1.in done")
            assert m.terminate() == 0
            put(folder, "2.in")
            m.start()
            wait_until(lambda: "._t-w_0_2.in.done" in states(folder),
                       what=f"2.in done; the watcher's log:\n{watch_log(proc)[-3000:]}")
        finally:
            stop(proc)
        assert ran(folder) == ["0 1.in", "0 2.in"]
    finally:
        m.stop()


def test_polling_and_always_running(meshd, folder, tmp_path) -> None:
    """--poll: rescans only, still processes files. A watch without globs keeps its job running:
    each time it ends, the next one is submitted (count ends the watcher)."""
    path = write_config(tmp_path, config(folder))
    proc = start_watcher(meshd, "--poll", path)
    try:
        put(folder, "p.in")
        wait_until(lambda: ran(folder) == ["0 p.in"], what="p.in by polling")
    finally:
        stop(proc)
    ranlog = os.path.join(str(tmp_path), "ran.log")
    cfg = {"watch": {"svc": {"path": folder, "refresh": 0.2, "count": 3, "jobs": [
        {"argv": ["sh", "-c", f"echo svc >> {ranlog}"]}]}}}
    proc = start_watcher(meshd, write_config(tmp_path, cfg, "svc.json"))
    try:
        assert proc.wait(timeout=60) == 0, watch_log(proc)
    finally:
        stop(proc)
    assert ran(folder).count("svc") == 3
    assert len({j["id"] for j in jobs_of(meshd) if j["id"].startswith("svc-")}) == 3


def test_hostile_folder(meshd, folder, tmp_path) -> None:
    """Garbage state files, odd names and a missing folder neither crash the watcher nor run a
    processed file again."""
    odd = "sp ace é'\";$(x).in"
    put(folder, odd)
    put(folder, "._t-w_0_gone.in.done", "x" * (1 << 20))  # huge, and its file is gone
    put(folder, "._t-w_0_done.in.done", "{not json")  # damaged: still done
    put(folder, "done.in")
    missing = os.path.join(str(tmp_path), "missing")
    cfg = config(folder)
    cfg["watch"]["m"] = {"path": missing, "glob": "*", "jobs": [{"argv": ["true"]}]}
    r = meshd.ctl("watch", "--once", write_config(tmp_path, cfg))
    assert r.returncode == 0, r.stderr.decode()
    assert "watch_scan_failed" in r.stderr.decode()
    assert ran(folder) == [f"0 {odd}"]
    assert states(folder) == sorted(["._t-w_0_done.in.done", f"._t-w_0_{odd}.done"])


def test_readme_example(meshd, folder, tmp_path) -> None:
    """The README's watch (gzip every *.log a minute old) processes a folder as shown."""
    readme = open(os.path.join(os.path.dirname(os.path.dirname(__file__)), "README.md")).read()
    start = readme.index("$ cat gz.json\n") + len("$ cat gz.json\n")
    cfg = json.loads(readme[start:readme.index("$ meshctl watch --dry-run gz.json")])
    cfg["watch"]["logs"]["path"] = folder
    path = write_config(tmp_path, cfg, "gz.json")
    put(folder, "a.log", "hello\n", age_s=100)
    put(folder, "b.log", "too new\n")
    r = meshd.ctl("watch", "--once", path)
    assert r.returncode == 0, r.stderr.decode()
    assert sorted(os.listdir(folder)) == ["._lab-logs_0_a.log.done", "a.log", "a.log.gz",
                                          "b.log"]


def test_member_from_config_or_at(meshd, folder, tmp_path) -> None:
    """The member is the watch's --at, else the global --at or MESHJOBS_AT, else the config's
    client.at; a missing config file is exit 2 with its name."""
    put(folder, "a.in")
    cfg = config(folder)
    cfg["client"] = {"at": meshd.url}
    path = write_config(tmp_path, cfg)
    env = env_with_path()
    env.pop("MESHJOBS_AT", None)
    run = [sys.executable, "-m", "meshjobs.cli"]
    r = subprocess.run([*run, "watch", "--once", path], capture_output=True, env=env, timeout=60)
    assert r.returncode == 0 and ran(folder) == ["0 a.in"], r.stderr.decode()
    cfg["client"] = {"at": "http://127.0.0.1:9"}  # nothing listens there
    path = write_config(tmp_path, cfg)
    put(folder, "b.in")
    r = subprocess.run([*run, "watch", "--once", path], capture_output=True, env=env, timeout=60)
    assert r.returncode == 4 and "cannot reach meshd" in r.stderr.decode()
    r = subprocess.run([*run, "watch", "--once", "--at", meshd.url, path], capture_output=True,
                       env=env, timeout=60)
    assert r.returncode == 0 and ran(folder) == ["0 a.in", "0 b.in"], r.stderr.decode()
    put(folder, "c.in")
    r = subprocess.run([*run, "watch", "--once", path], capture_output=True,
                       env={**env, "MESHJOBS_AT": meshd.url}, timeout=60)
    assert r.returncode == 0 and ran(folder) == ["0 a.in", "0 b.in", "0 c.in"]
    r = meshd.ctl("watch", "--once", os.path.join(str(tmp_path), "nope.json"))
    assert r.returncode == 2 and "nope.json" in r.stderr.decode()


def test_spec_edited_under_a_running_job(meshd, folder, tmp_path) -> None:
    """The config's spec edited while a file's job (old spec) runs and the watcher restarted:
    the file's job id is the same, meshd refuses the new spec under it, and the watcher follows
    the existing job instead of running the file again."""
    gate = os.path.join(str(tmp_path), "gate")
    ranlog = os.path.join(str(tmp_path), "ran.log")
    cmd = f"while [ ! -f {gate} ]; do sleep 0.05; done; echo \"old $1\" >> {ranlog}"
    path = write_config(tmp_path, config(folder, jobs=[{"argv": ["sh", "-c", cmd, "sh",
                                                                 "%(filename)s"]}]))
    put(folder, "a.in")
    proc = start_watcher(meshd, path)
    try:
        wait_until(lambda: [j for j in jobs_of(meshd) if j["state"] == "running"],
                   what="the job running")
    finally:
        stop(proc)
    path = write_config(tmp_path, config(folder))  # the new spec: echo "<index> <file>"
    open(gate, "w").close()
    r = meshd.ctl("watch", "--once", path)
    assert r.returncode == 0, r.stderr.decode()
    assert "watch_spec_changed" in r.stderr.decode()
    assert ran(folder) == ["old a.in"] and len(jobs_of(meshd)) == 1
    assert states(folder) == ["._t-w_0_a.in.done"]


def test_state_file_cannot_be_written(meshd, folder, tmp_path) -> None:
    """A state file that cannot be written is logged, not a crash; the next run submits the same
    id, follows the job that exists and keeps its end: the program ran once."""
    put(folder, "a.in")
    os.makedirs(os.path.join(folder, "._t-w_0_a.in.done.part"))  # in the way of the write
    path = write_config(tmp_path, config(folder))
    r = meshd.ctl("watch", "--once", path)
    assert r.returncode == 0 and "watch_state_write_failed" in r.stderr.decode()
    assert "._t-w_0_a.in.done" not in states(folder)
    os.rmdir(os.path.join(folder, "._t-w_0_a.in.done.part"))
    r = meshd.ctl("watch", "--once", path)
    assert r.returncode == 0, r.stderr.decode()
    assert states(folder) == ["._t-w_0_a.in.done"] and ran(folder) == ["0 a.in"]
    assert len(jobs_of(meshd)) == 1


def test_xattr_state(meshd, folder, tmp_path) -> None:
    """xattr: the state is kept in each file's user.meshjobs.<name>.<n>.<state> attribute, no
    hidden files; a restarted watcher reads it and runs nothing twice; updated re-runs."""
    probe = os.path.join(folder, "probe")
    open(probe, "w").close()
    try:
        os.setxattr(probe, "user.probe", b"1")
    except OSError:
        pytest.skip("this filesystem keeps no user xattrs")
    os.unlink(probe)
    put(folder, "a.in")
    path = write_config(tmp_path, config(folder, plugin="meeseeks.watch.WatchXattr",
                                         updated=True))
    assert meshd.ctl("watch", "--once", path).returncode == 0
    assert states(folder) == [] and ran(folder) == ["0 a.in"]
    attrs = os.listxattr(os.path.join(folder, "a.in"))
    assert sorted(attrs) == ["user.meshjobs.t-w.0.done", "user.meshjobs.t-w.0.mtime"]
    rec = json.loads(os.getxattr(os.path.join(folder, "a.in"), "user.meshjobs.t-w.0.done"))
    assert rec["state"] == "done" and rec["watch"]["file"] == "a.in"
    assert meshd.ctl("watch", "--once", path).returncode == 0 and ran(folder) == ["0 a.in"]
    t = time.time() + 5
    os.utime(os.path.join(folder, "a.in"), (t, t))
    assert meshd.ctl("watch", "--once", path).returncode == 0
    assert ran(folder) == ["0 a.in", "0 a.in"] and len(jobs_of(meshd)) == 2


def test_file_events_without_rescan(meshd, folder, tmp_path) -> None:
    """With inotify a file is picked up at once: rescan is an hour here, so only the file event
    can make the scan that submits its job."""
    path = write_config(tmp_path, config(folder, rescan=3600))
    proc = start_watcher(meshd, path)
    try:
        wait_until(lambda: '"watch_scan"' in watch_log(proc), what="the first scan")
        put(folder, "e.in")
        wait_until(lambda: ran(folder) == ["0 e.in"], what="e.in by its file event")
        wait_until(lambda: "._t-w_0_e.in.done" in states(folder), what="e.in's state")
    finally:
        stop(proc)


def test_relative_path(meshd, folder, tmp_path) -> None:
    """A relative path is the watcher's folder made absolute: the job (run by meshd, elsewhere)
    gets the absolute %(file)s and %(path)s."""
    ranlog = os.path.join(str(tmp_path), "ran.log")
    cfg = config("in", jobs=[{"argv": ["sh", "-c", f"echo \"$1 $2\" >> {ranlog}", "sh",
                                       "%(file)s", "%(path)s"]}])
    path = write_config(tmp_path, cfg)
    put(folder, "a.in")
    r = meshd.ctl("watch", "--once", path, cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr.decode()
    assert ran(folder) == [f"{folder}/a.in {folder}"]
