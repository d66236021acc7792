"""A fleet of one, end to end: real meshd processes, real meshctl, real subprocess items.

The single-member list of the mesh-jobd seed: a job with payloads runs to the end (leases,
results, durable payloads, commit, status); control answers and their errors; restart (the log
replayed, a forgotten job stays forgotten, the blob store re-indexed).
"""

from __future__ import annotations

import base64
import json
import os
import sys

import blake3
import pytest

from tests.helpers import alive, wait_until

pytestmark = pytest.mark.fleet



def test_hello_submit_wait_results(meshd):
    """A plain command is a job of one item: submit prints the id, wait exits 0, results prints
    the output; status --json has the job record's fields."""
    job = meshd.submit("--", "sh", "-c", "echo hello")
    r = meshd.ctl("job", "wait", job)
    assert r.returncode == 0, r.stderr
    r = meshd.ctl("job", "results", job)
    assert r.returncode == 0 and r.stdout == b"hello\n"
    r = meshd.ctl("--json", "job", "status", job)
    rec = json.loads(r.stdout)
    for k in ("id", "state", "priority", "hold", "tags", "pool", "argv", "items_total",
              "items_done", "items_failed", "submitted_at", "finished_at", "items"):
        assert k in rec, k
    item = rec["items"][0]
    for k in ("index", "state", "attempts", "member", "epoch", "rc", "stdout", "stderr"):
        assert k in item, k
    assert rec["state"] == "done" and item["rc"] == 0 and item["member"] == "m1"
    assert item["stdout"] == blake3.blake3(b"hello\n").hexdigest()
    status, body = meshd.request("GET", f"/blobs/{item['stdout']}")
    assert status == 200 and body == b"hello\n"
    # The same with --json after the command.
    r = meshd.ctl("job", "status", job, "--json")
    assert json.loads(r.stdout)["id"] == job


def test_items_from_dir_and_file(meshd, tmp_path):
    """--items-from DIR: one item per file, sorted by name, bytes on stdin; results in item
    order. --items-from FILE: one item per line."""
    d = tmp_path / "in"
    d.mkdir()
    names = ["b.txt", "a.txt", "c.txt", "10.txt"]
    for n in names:
        (d / n).write_bytes(f"item {n}\n".encode())
    job = meshd.submit("--items-from", str(d), "--", "tr", "a-z", "A-Z")
    assert meshd.ctl("job", "wait", job).returncode == 0
    r = meshd.ctl("job", "results", job)
    assert r.stdout == b"".join(f"ITEM {n.upper()}\n".encode() for n in sorted(names))
    lines = tmp_path / "lines.txt"
    lines.write_text("one\ntwo\nthree\n")
    job = meshd.submit("--items-from", str(lines), "--", "sh", "-c", "cat; echo \" $MESH_ITEM_INDEX\"")
    assert meshd.ctl("job", "wait", job).returncode == 0
    assert meshd.ctl("job", "results", job).stdout == b"one 0\ntwo 1\nthree 2\n"
    out = tmp_path / "out"
    assert meshd.ctl("job", "results", job, "--out", str(out)).returncode == 0
    assert (out / "1.out").read_bytes() == b"two 1\n"


def test_http_items_string_b64_blob(meshd):
    """POST /jobs takes items as strings, {"b64"} and {"blob"}; answers once committed."""
    raw = bytes(range(256))
    status, rec = meshd.request("POST", "/jobs", {
        "argv": ["sh", "-c", "wc -c"],
        "items": ["abc", {"b64": base64.b64encode(raw).decode()}],
        "tags": ["t1"]})
    assert status in (200, 201), rec
    done = meshd.wait_job(rec["id"])
    digest = done["items"][1]["stdin"]
    status, rec2 = meshd.request("POST", "/jobs", {"argv": ["wc", "-c"], "items": [{"blob": digest}]})
    assert status in (200, 201), rec2
    done2 = meshd.wait_job(rec2["id"])
    outs = [meshd.request("GET", f"/blobs/{i['stdout']}")[1].strip()
            for i in done["items"] + done2["items"]]
    assert outs == [b"3", b"256", b"256"]
    status, jobs = meshd.request("GET", "/jobs?tag=t1")
    assert [j["id"] for j in jobs] == [rec["id"]]


def test_retries_runtime_and_failure_exit_codes(meshd, tmp_path):
    """--retries re-runs a failing item with backoff; --runtime kills the whole group and the
    item ends as timeout; job wait exits 1 when the job failed."""
    counter = tmp_path / "count"
    job = meshd.submit("--retries", "2", "--", "sh", "-c",
                  f"echo x >> {counter}; [ $(wc -l < {counter}) -ge 2 ]")
    assert meshd.ctl("job", "wait", job).returncode == 0
    rec = meshd.wait_job(job)
    assert rec["items"][0]["attempts"] == 2 and rec["state"] == "done"
    job = meshd.submit("--retries", "1", "--", "sh", "-c", "exit 3")
    assert meshd.ctl("job", "wait", job).returncode == 1
    rec = meshd.wait_job(job)
    assert rec["state"] == "failed" and rec["items"][0]["rc"] == 3
    assert rec["items"][0]["attempts"] == 2
    pidfile = tmp_path / "grandchild.pid"
    job = meshd.submit("--runtime", "0.5", "--", "sh", "-c",
                  f"sleep 60 & echo $! > {pidfile}; wait")
    rec = meshd.wait_job(job)
    assert rec["state"] == "failed" and rec["items"][0]["state"] == "timeout"
    pid = int(pidfile.read_text())
    _assert_gone(pid)


def _assert_gone(pid: int, timeout_s: float = 5.0) -> None:
    wait_until(lambda: not alive(pid), timeout_s, what=f"process {pid} gone")


def test_priority_hold_tone_and_max_leases(meshd_factory, tmp_path):
    """Higher priority leases first; --hold keeps a job from running until tone --release;
    --max-leases bounds how many items of a job run at once."""
    m = meshd_factory(slots=1)
    gate = tmp_path / "gate"
    blocker = m.submit("--", "sh", "-c", f"while [ ! -e {gate} ]; do sleep 0.05; done")
    low = m.submit("--priority", "1", "--", "true")
    high = m.submit("--priority", "5", "--", "true")
    held = m.submit("--hold", "--priority", "9", "--", "true")
    assert json.loads(m.ctl("--json", "job", "status", held).stdout)["state"] == "held"
    gate.write_text("go")
    m.wait_job(blocker)
    lo, hi = m.wait_job(low), m.wait_job(high)
    assert hi["items"][0]["started_at"] <= lo["items"][0]["started_at"]
    # A job of lower priority submitted after it runs: had `held` been leasable, it would have
    # had the slot first.
    after = m.submit("--", "true")
    assert m.wait_job(after)["state"] == "done"
    assert json.loads(m.ctl("--json", "job", "status", held).stdout)["state"] == "held"
    assert m.ctl("job", "tone", held, "--release").returncode == 0
    assert m.wait_job(held)["state"] == "done"
    # max-leases 1 on a two-slot member: no two items of the job overlap.
    m2 = meshd_factory(name="m2", slots=2)
    items = tmp_path / "items.txt"
    items.write_text("a\nb\nc\nd\n")
    job = m2.submit("--max-leases", "1", "--items-from", str(items), "--", "sh", "-c", "sleep 0.2")
    rec = m2.wait_job(job)
    spans = sorted((i["started_at"], i["ended_at"]) for i in rec["items"])
    for (_s1, e1), (s2, _e2) in zip(spans, spans[1:], strict=False):
        assert s2 >= e1 - 0.01, spans
    # tone of priority and max-leases on a live job, then on a finished one (exit 2).
    job = m2.submit("--hold", "--", "true")
    assert m2.ctl("job", "tone", job, "--priority", "7", "--max-leases", "3").returncode == 0
    rec = json.loads(m2.ctl("--json", "job", "status", job).stdout)
    assert rec["priority"] == 7 and rec["max_leases"] == 3
    assert m2.ctl("job", "tone", job, "--release").returncode == 0
    m2.wait_job(job)
    assert m2.ctl("job", "tone", job, "--priority", "1").returncode == 2


def test_cancel_kills_and_forget(meshd, tmp_path):
    """cancel kills running items' process groups and ends pending ones; forget removes a
    finished job: status then exits 3, a new submit with its id is refused (exit 2)."""
    pidfile = tmp_path / "pid"
    items = tmp_path / "items.txt"
    items.write_text("\n".join(str(i) for i in range(6)) + "\n")
    job = meshd.submit("--id", "long", "--items-from", str(items), "--", "sh", "-c",
                  f"sleep 60 & echo $! >> {pidfile}; wait")
    wait_until(lambda: pidfile.exists() and len(pidfile.read_text().split()) >= 2, 20,
               what="two items running")
    assert meshd.ctl("job", "forget", job).returncode == 2  # running: cancel it first
    assert meshd.ctl("job", "cancel", job).returncode == 0
    rec = meshd.wait_job(job)
    assert rec["state"] == "cancelled"
    assert all(i["state"] == "cancelled" for i in rec["items"])
    for pid in pidfile.read_text().split():
        _assert_gone(int(pid))
    assert meshd.ctl("job", "wait", job).returncode == 1
    assert meshd.ctl("job", "cancel", job).returncode == 2  # already ended
    assert meshd.ctl("job", "forget", job).returncode == 0
    assert meshd.ctl("job", "status", job).returncode == 3
    assert meshd.ctl("job", "forget", job).returncode == 3
    r = meshd.ctl("job", "submit", "--id", "long", "--", "true")
    assert r.returncode == 2 and b"forgotten" in r.stderr


def test_idempotent_submit(meshd):
    """Re-submitting --id with the same spec returns that job; with a different spec: exit 2."""
    a = meshd.submit("--id", "same", "--tag", "x", "--", "echo", "1")
    b = meshd.submit("--id", "same", "--tag", "x", "--", "echo", "1")
    assert a == b == "same"
    r = meshd.ctl("job", "submit", "--id", "same", "--", "echo", "2")
    assert r.returncode == 2 and b"different" in r.stderr
    status, jobs = meshd.request("GET", "/jobs")
    assert [j["id"] for j in jobs] == ["same"]
    # The same request id (a client retrying after an unknown outcome) is applied once.
    spec = {"argv": ["true"]}
    s1, r1 = meshd.request("POST", "/jobs", spec, headers={"Idempotency-Key": "retry-1"})
    s2, r2 = meshd.request("POST", "/jobs", spec, headers={"Idempotency-Key": "retry-1"})
    assert r1["id"] == r2["id"]
    assert len(meshd.request("GET", "/jobs")[1]) == 2


def test_restart_replays_log_and_forgotten_stays_forgotten(meshd):
    """Restart: the log is replayed, outputs are served with the same digests, a forgotten job
    stays forgotten, and SIGTERM stops the member with exit 0."""
    keep = meshd.submit("--", "sh", "-c", "echo kept")
    gone = meshd.submit("--", "sh", "-c", "echo gone")
    rec = meshd.wait_job(keep)
    meshd.wait_job(gone)
    assert meshd.ctl("job", "forget", gone).returncode == 0
    assert meshd.terminate() == 0
    meshd.start()
    rec2 = meshd.wait_job(keep)
    assert rec2["items"][0]["stdout"] == rec["items"][0]["stdout"]
    assert meshd.ctl("job", "results", keep).stdout == b"kept\n"
    r = meshd.ctl("job", "status", gone)
    assert r.returncode == 3 and b"forgotten" in r.stderr
    meshd.kill9()
    meshd.start()
    assert meshd.ctl("job", "status", gone).returncode == 3
    assert meshd.ctl("job", "results", keep).stdout == b"kept\n"


def test_kill9_during_200_items(meshd_factory, tmp_path):
    """kill -9 in the middle of a 200-item job, then restart: every item ends done with exactly
    one result, and items that were running ran again under a new lease epoch."""
    m = meshd_factory(slots=4)
    items = tmp_path / "items.txt"
    items.write_text("".join(f"{i}\n" for i in range(200)))
    runs = tmp_path / "runs"
    runs.mkdir()
    job = m.submit("--items-from", str(items), "--", "sh", "-c",
                  f"read x; touch {runs}/$x.$MESH_LEASE_EPOCH; sleep 0.02; echo out-$x")
    wait_until(lambda: len(os.listdir(runs)) >= 40, 30, what="40 items started")
    m.kill9()
    m.start()
    rec = m.wait_job(job, timeout_s=120)
    assert rec["state"] == "done" and rec["items_done"] == 200
    out = m.ctl("job", "results", job).stdout.decode().split()
    assert out == [f"out-{i}" for i in range(200)]
    status, metrics = m.request("GET", "/metrics")
    assert status == 200
    # Items that ran before the kill and were re-leased ran under a new epoch.
    reruns = [i for i in rec["items"] if i["attempts"] > 1]
    for i in reruns:
        mine = [f for f in os.listdir(runs) if f.split(".")[0] == str(i["index"])]
        assert str(i["epoch"]) in [f.split(".")[1] for f in mine]


def test_sigterm_exits_zero_and_cuts_items(meshd, tmp_path):
    """SIGTERM stops the member cleanly (exit 0) and kills running items' groups."""
    pidfile = tmp_path / "pid"
    meshd.submit("--", "sh", "-c", f"sleep 60 & echo $! > {pidfile}; wait")
    wait_until(lambda: pidfile.exists() and pidfile.read_text().strip(), 20, what="the item's pid")
    assert meshd.terminate() == 0
    _assert_gone(int(pidfile.read_text()))


def test_unreachable_member_exit_4(tmp_path):
    """meshctl against a member that is not running exits 4 with what to do."""
    from tests.helpers import Meshd, free_port
    m = Meshd(str(tmp_path / "none"))
    m.url = f"http://127.0.0.1:{free_port()}"
    r = m.ctl("jobs")
    assert r.returncode == 4 and b"meshd" in r.stderr


def test_idempotency_key_is_bound_to_its_request(meshd):
    """An Idempotency-Key names one request (method, path, body): reused on another request it
    is refused with 422 and nothing is applied; the same request again replays its answer."""
    k = {"Idempotency-Key": "key-K"}
    s1, a = meshd.request("POST", "/jobs", {"id": "a", "argv": ["true"], "hold": True}, headers=k)
    assert s1 == 201 and a["id"] == "a"
    s, b = meshd.request("POST", "/jobs", {"id": "b", "argv": ["true"], "hold": True})
    assert s == 201
    # The case: tone b with a's key must not answer a's record and leave b unchanged.
    s, body = meshd.request("POST", "/jobs/b/tone", {"priority": 7}, headers=k)
    assert s == 422 and "Idempotency-Key" in body["error"] and "new key" in body["error"]
    s, body = meshd.request("DELETE", "/jobs/b", headers=k)
    assert s == 422
    s, body = meshd.request("POST", "/jobs/b/cancel", headers=k)
    assert s == 422
    s, body = meshd.request("POST", "/jobs", {"id": "c", "argv": ["true"]}, headers=k)
    assert s == 422
    s, b_now = meshd.request("GET", "/jobs/b")
    assert s == 200 and b_now["priority"] == 0 and b_now["state"] != "cancelled"
    assert meshd.request("GET", "/jobs/c")[0] == 404
    # The same request with the same key: the first answer again, applied once.
    s2, a2 = meshd.request("POST", "/jobs", {"id": "a", "argv": ["true"], "hold": True}, headers=k)
    assert s2 in (200, 201) and a2["id"] == "a"
    # A new key for the tone: applied.
    s, b2 = meshd.request("POST", "/jobs/b/tone", {"priority": 7}, headers={"Idempotency-Key": "k2"})
    assert s == 200 and b2["priority"] == 7
    # The binding survives a restart (it is in the committed log).
    assert meshd.terminate() == 0
    meshd.start()
    s, body = meshd.request("POST", "/jobs/b/tone", {"priority": 9}, headers=k)
    assert s == 422
    assert meshd.metrics().get("meshjobs_node_ctl_rid_reused_total", 0) >= 1


def test_program_that_cannot_start_says_why(meshd):
    """An item whose program does not exist ends failed with no exit code, signal or outputs,
    and its record says why (`items[].error`), also after a restart (from the log)."""
    job = meshd.submit("--", "/no/such/prog", "arg")
    rec = meshd.wait_job(job)
    item = rec["items"][0]
    assert rec["state"] == "failed" and item["state"] == "failed"
    assert (item["rc"], item["signal"], item["stdout"], item["stderr"]) == (None, None, None, None)
    assert "/no/such/prog" in item["error"] and "argv" in item["error"], item
    r = meshd.ctl("--json", "job", "status", job)
    assert json.loads(r.stdout)["items"][0]["error"] == item["error"]
    meshd.stop()
    meshd.start()
    status, again = meshd.request("GET", f"/jobs/{job}?items=1")
    assert status == 200 and again["items"][0]["error"] == item["error"]
    # A command that ran and failed has no error text: its exit code says it.
    job = meshd.submit("--", "sh", "-c", "exit 3")
    item = meshd.wait_job(job)["items"][0]
    assert item["rc"] == 3 and item["error"] is None


# Runs meshd as a child subreaper (as if it were a container's PID 1): orphans of its items are
# re-parented to it. The setting survives the exec.
_SUBREAPER = [sys.executable, "-c", "import ctypes, os, sys; "
              "assert ctypes.CDLL(None).prctl(36, 1, 0, 0, 0) == 0; "
              "os.execv(sys.argv[1], sys.argv[1:])"]


def test_orphans_of_items_are_reaped_when_meshd_is_a_subreaper(meshd_factory):
    """A member that is PID 1 or a subreaper reaps the zombies of processes its items left
    behind (here one that left the item's group with setsid and exits a moment later)."""
    m = meshd_factory(start=False)
    m.prefix = _SUBREAPER
    m.start()
    job = m.submit("--", "sh", "-c",
                  "setsid sh -c 'sleep 1' </dev/null >/dev/null 2>&1 & echo $!")
    assert m.wait_job(job)["state"] == "done"
    r = m.ctl("job", "results", job)
    orphan = int(r.stdout)
    meshd_pid = m.pid
    # It ends after 1 s, a zombie of meshd's (its parent shell is gone): meshd must reap it.
    def reaped() -> bool:
        try:
            with open(f"/proc/{orphan}/stat", "rb") as f:
                stat = f.read()
        except FileNotFoundError:
            return True
        fields = stat[stat.rfind(b")") + 2:].split()
        return int(fields[1]) != meshd_pid  # else the pid was reaped and reused by another

    wait_until(reaped, 20, what=f"orphan {orphan} reaped by meshd")
    reaped = [v for k, v in m.metrics().items() if "orphans_reaped" in k]
    assert reaped and reaped[0] >= 1, reaped


def test_restarted_member_never_says_an_acknowledged_job_is_missing(tmp_path):
    """Rule: a member killed (-9) and started again answers for a job it acknowledged before
    either 503 (its table is still catching up: try again) or the job, never 404: "no such job"
    would end a client's wait (exit 3) for a job that exists. Asked from the moment its HTTP
    port answers, before it is ready."""
    from tests.helpers import Meshd

    m = Meshd(str(tmp_path / "m1"))
    try:
        m.start()
        m.http = m.url.removeprefix("http://")  # restarts keep the port meshd bound
        for _ in range(3):
            status, rec = m.request("POST", "/jobs", {"argv": ["sleep", "60"]})
            assert status == 201
            m.kill9()
            m.proc.wait()
            m.start(wait_ready=False)
            seen: list[int] = []

            def answered(job_id: str = rec["id"], seen: list[int] = seen) -> bool:
                status, body = m.request("GET", f"/jobs/{job_id}")
                seen.append(status)
                assert status in (200, 503), (status, body)
                assert status == 200 or "catching up" in body["error"], body
                return status == 200

            wait_until(answered, what="the job, from the restarted member")
            m.wait_ready()
    finally:
        m.stop()
