"""meshctl (meshjobs/cli.py) against the real HTTP API in front of a recording control port.

The server and its control stand-in come from test_http.py; the part under test is the CLI:
its arguments, the requests it makes, its output and its exit codes.
"""

from __future__ import annotations

import http.server
import json
import os
import pty
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

from blobstore import hexdigest
from meshjobs.cli import cli
from meshjobs.control import Answer
from tests.helpers import LateDamageStore, Server, job_record, read_pty


@pytest.fixture(scope="module")
def srv() -> Iterator[Server]:
    s = Server()
    yield s
    s.close()


@pytest.fixture(autouse=True)
def _fresh(srv: Server) -> None:
    srv.control.reset()


def at(srv: Server) -> str:
    return f"http://127.0.0.1:{srv.port}"


def run(srv: Server, *args: str, stdin: bytes | None = None, env: dict | None = None) -> Result:
    return CliRunner().invoke(cli, ["--at", at(srv), *args], input=stdin, env=env,
                              catch_exceptions=False)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- job submit ------------------------------------------------------------------------------


def test_submit_every_option(srv: Server) -> None:
    """Every submit option lands in the spec; the job id is printed alone on a line."""
    r = run(srv, "job", "submit", "--id", "x1", "--pool", "gpu", "--retries", "2", "--runtime",
            "1.5", "--priority", "-3", "--tag", "a", "--tag", "b", "--hold", "--max-leases", "4",
            "--env", "K=V=W", "--env", "E=", "--cwd", "/tmp", "--", "echo", "-n", "--json")
    assert r.exit_code == 0, r.output
    assert r.stdout == "x1\n"
    req = srv.control.last()
    spec = req["spec"]
    assert spec["argv"] == ["echo", "-n", "--json"]
    assert (spec["id"], spec["pool"], spec["retries"], spec["runtime_s"], spec["priority"]) == (
        "x1", "gpu", 2, 1.5, -3)
    assert spec["tags"] == ["a", "b"] and spec["hold"] is True and spec["max_leases"] == 4
    assert spec["env"] == {"E": "", "K": "V=W"} and spec["cwd"] == "/tmp"
    assert req["items"] == [None] and len(req["rid"]) == 32


def test_submit_without_dashes_stops_options_at_the_program(srv: Server) -> None:
    """Options after the program belong to the program."""
    r = run(srv, "job", "submit", "ls", "-l", "--pool", "x")
    assert r.exit_code == 0, r.output
    assert srv.control.last()["spec"]["argv"] == ["ls", "-l", "--pool", "x"]
    assert srv.control.last()["spec"]["pool"] == "default"


@pytest.mark.parametrize("where", ["before", "after"])
def test_submit_json_before_or_after(srv: Server, where: str) -> None:
    args = ["job", "submit", "--json", "--", "true"]
    if where == "before":
        args = ["--json", "job", "submit", "--", "true"]
    r = run(srv, *args)
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["id"] == "new1"


@pytest.mark.parametrize("args", [["job", "submit"], ["job", "submit", "--"],
                                  ["job", "submit", "--env", "NOEQUALS", "--", "x"],
                                  ["job", "submit", "--retries", "-1", "--", "x"],
                                  ["job", "submit", "--priority", "x", "--", "x"],
                                  ["job", "submit", "--bogus", "--", "x"]])
def test_submit_bad_usage_is_2(srv: Server, args: list[str]) -> None:
    """No program, or a bad option, is exit 2 and sends nothing."""
    r = run(srv, *args)
    assert r.exit_code == 2
    assert srv.control.requests == []


def test_items_from_directory(srv: Server, tmp_path: Path) -> None:
    """A directory gives one item per regular file, sorted by name, bytes as they are."""
    (tmp_path / "b").write_bytes(b"\x00\xffbee")
    (tmp_path / "a").write_bytes(b"ay\n")
    (tmp_path / "c").mkdir()
    r = run(srv, "job", "submit", "--items-from", str(tmp_path), "--", "cat")
    assert r.exit_code == 0, r.output
    assert srv.control.last()["items"] == [hexdigest(b"ay\n"), hexdigest(b"\x00\xffbee")]


def test_items_from_file_and_stdin(srv: Server, tmp_path: Path) -> None:
    """A file gives one item per line, without its newline; - reads standard input."""
    f = tmp_path / "lines"
    f.write_bytes(b"one\n\ntwo\xff\nthree")
    r = run(srv, "job", "submit", "--items-from", str(f), "--", "cat")
    assert r.exit_code == 0, r.output
    want = [hexdigest(b) for b in (b"one", b"", b"two\xff", b"three")]
    assert srv.control.last()["items"] == want
    r = run(srv, "job", "submit", "--items-from", "-", "--", "cat", stdin=b"x\ny\n")
    assert r.exit_code == 0, r.output
    assert srv.control.last()["items"] == [hexdigest(b"x"), hexdigest(b"y")]


def test_items_from_empty_or_missing_is_2(srv: Server, tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "sub").mkdir()
    (tmp_path / "nothing").write_bytes(b"")
    for path in ("empty", "nothing", "absent"):
        r = run(srv, "job", "submit", "--items-from", str(tmp_path / path), "--", "cat")
        assert r.exit_code == 2, (path, r.output)
    assert srv.control.requests == []


# --- exit codes ------------------------------------------------------------------------------


@pytest.mark.parametrize("status,code", [(400, 2), (409, 2), (413, 2), (404, 3), (503, 4),
                                         (500, 1)])
def test_exit_code_per_status(srv: Server, status: int, code: int) -> None:
    """Each status class has its exit code, and the server's error is the message."""
    srv.control.answers["get"] = Answer(status, {"error": f"trouble {status}"})
    r = run(srv, "job", "status", "j1")
    assert r.exit_code == code
    assert f"meshctl: trouble {status}" in r.stderr
    assert r.stdout == "" and "Traceback" not in r.stderr


def test_unreachable_member_is_4() -> None:
    """Nobody listening: exit 4, and a message saying what to do."""
    url = f"http://127.0.0.1:{free_port()}"
    r = CliRunner().invoke(cli, ["--at", url, "fleet"])
    assert r.exit_code == 4
    assert f"cannot reach meshd at {url}" in r.stderr and "--at" in r.stderr
    assert r.exception is None or isinstance(r.exception, SystemExit)


def test_at_from_environment(srv: Server) -> None:
    r = CliRunner().invoke(cli, ["fleet", "--json"], env={"MESHJOBS_AT": at(srv)})
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["leader"] == "m1"


def test_bad_at_is_2() -> None:
    r = CliRunner().invoke(cli, ["--at", "ftp://x", "fleet"])
    assert r.exit_code == 2


def test_console_script_in_a_subprocess(srv: Server, tmp_path: Path) -> None:
    """The real entry point: exit codes and output through a process boundary."""
    env = {**os.environ, "MESHJOBS_AT": at(srv)}
    cmd = [sys.executable, "-m", "meshjobs.cli"]
    p = subprocess.run([*cmd, "job", "submit", "--id", "p1", "--", "true"], env=env,
                       capture_output=True, timeout=60)
    assert (p.returncode, p.stdout) == (0, b"p1\n"), p.stderr
    p = subprocess.run([*cmd, "job", "submit"], env=env, capture_output=True, timeout=60)
    assert p.returncode == 2
    env["MESHJOBS_AT"] = f"http://127.0.0.1:{free_port()}"
    p = subprocess.run([*cmd, "jobs"], env=env, capture_output=True, timeout=60)
    assert p.returncode == 4 and b"cannot reach meshd" in p.stderr and b"Traceback" not in p.stderr


# --- job status, results, wait ---------------------------------------------------------------


def test_status_human_and_json(srv: Server) -> None:
    r = run(srv, "job", "status", "j1")
    assert r.exit_code == 0, r.output
    assert "running" in r.stdout and "1 done, 0 failed, 3 total" in r.stdout
    assert srv.control.last() == {"op": "get", "id": "j1", "items": False, "wait_ms": 0}
    r = run(srv, "--json", "job", "status", "j1")
    assert json.loads(r.stdout)["id"] == "j1"
    assert srv.control.last()["items"] is True
    r = run(srv, "job", "status", "j1", "--json")
    assert srv.control.last()["items"] is True and json.loads(r.stdout)["state"] == "running"


def test_status_explains_every_kind_of_failure(srv: Server) -> None:
    """Each failed item says why (spawn error, signal, timeout, exit code), where, how often,
    and the last lines of its stderr; past status_items_shown_max the rest are counted."""
    err = srv.blobs.put(b"".join(b"line %d\n" % i for i in range(9)))
    items = [{"index": 0, "state": "failed", "error": "could not start '/no/such/prog': gone",
              "attempts": 1, "member": "m1", "stderr": None},
             {"index": 1, "state": "failed", "signal": 9, "attempts": 3, "member": "m2",
              "stderr": err},
             {"index": 2, "state": "timeout", "signal": 9, "attempts": 1, "member": "m1"},
             {"index": 3, "state": "failed", "rc": 7, "attempts": 1, "member": None,
              "stderr": "f" * 64}]
    items += [{"index": i, "state": "failed", "rc": 1, "attempts": 1} for i in range(4, 30)]
    srv.control.answers["get"] = lambda r: Answer(200, job_record(
        r["id"], state="failed", items=items, items_failed=len(items), runtime_s=0.5,
        argv=["sh", "-c", "exit 1"]))
    r = run(srv, "job", "status", "j1")
    assert r.exit_code == 0, r.output
    out = r.stdout
    assert "argv       sh -c 'exit 1'" in out
    assert "item 0: could not start '/no/such/prog': gone; attempts 1, member m1" in out
    assert "item 1: killed by signal 9; attempts 3, member m2" in out
    assert "    line 4\n    line 5\n    line 6\n    line 7\n    line 8\n" in out
    assert "line 3" not in out
    assert "item 2: timeout: killed after its runtime limit of 0.5 s" in out
    assert "item 3: exit 7; attempts 1, member -" in out and "stderr not readable here" in out
    assert "... and 10 more failed item(s)" in out
    r = run(srv, "--json", "job", "status", "j1")
    rec = json.loads(r.stdout)
    assert len(rec["failed_items"]) == 20 and len(rec["items"]) == 30
    assert rec["failed_items"][1]["stderr_tail"][-1] == "line 8"


@pytest.mark.parametrize(("sep", "want"), [
    ("\\n", b"\n"), ("\\0", b"\0"), ("a\\\\b", b"a\\b"), ("\\t|\\r", b"\t|\r"), ("é", "é".encode()),
])
def test_results_sep_escapes(srv: Server, sep: str, want: bytes) -> None:
    _with_items(srv)
    r = run(srv, "job", "results", "j1", "--sep", sep)
    assert r.exit_code == 1, r.output
    assert r.stdout_bytes == b"\x00zero\xff" + want + b"one" + want


def _with_items(srv: Server) -> list[dict]:
    outs = [srv.blobs.put(b) for b in (b"\x00zero\xff", b"one")]
    err = srv.blobs.put(b"oops")
    items = [{"index": 1, "state": "done", "stdout": outs[1], "stderr": err},
             {"index": 0, "state": "done", "stdout": outs[0], "stderr": None},
             {"index": 2, "state": "failed", "stdout": None, "stderr": None}]
    srv.control.answers["get"] = lambda r: Answer(200, job_record(r["id"], items=items,
                                                                  state="failed"))
    return items


def test_results_to_stdout_binary(srv: Server) -> None:
    """Items' stdout in item order, bytes untouched; --stderr adds their stderr on stderr."""
    _with_items(srv)
    r = run(srv, "job", "results", "j1")
    assert r.exit_code == 1, r.output  # the job failed: what exists is printed all the same
    assert r.stdout_bytes == b"\x00zero\xffone"
    assert r.stderr == "meshctl: job j1 failed; item(s) 2 failed (why: meshctl job status j1)\n"
    r = run(srv, "job", "results", "j1", "--stderr")
    assert r.stdout_bytes == b"\x00zero\xffone" and r.stderr_bytes.startswith(b"oops")


def test_results_to_files(srv: Server, tmp_path: Path) -> None:
    """--out writes <index>.out per item that has an output, .err with --stderr; an item
    without one (item 2 failed before writing any) gets no file."""
    _with_items(srv)
    out = tmp_path / "o"
    r = run(srv, "job", "results", "j1", "--out", str(out), "--stderr")
    assert r.exit_code == 1, r.output
    assert sorted(p.name for p in out.iterdir()) == [
        "0.out", "1.err", "1.out"]
    assert (out / "0.out").read_bytes() == b"\x00zero\xff"
    assert (out / "1.err").read_bytes() == b"oops"


def test_results_missing_blob_is_4(srv: Server, tmp_path: Path) -> None:
    srv.control.answers["get"] = lambda r: Answer(200, job_record(r["id"], items=[
        {"index": 0, "state": "done", "stdout": "a" * 64, "stderr": None}]))
    r = run(srv, "job", "results", "j1", "--out", str(tmp_path))
    assert r.exit_code == 4 and "not on meshd" in r.stderr
    assert list(tmp_path.iterdir()) == []
    r = run(srv, "job", "results", "j1")
    assert r.exit_code == 4


def test_results_cut_short_is_4() -> None:
    """A transfer that breaks off part way is exit 4 with a message, not a traceback."""
    s = Server(LateDamageStore(chunk_bytes=1024))
    try:
        digest = s.blobs.put(b"z" * 5000)
        s.control.answers["get"] = lambda r: Answer(200, job_record(r["id"], items=[
            {"index": 0, "state": "done", "stdout": digest, "stderr": None}]))
        r = CliRunner().invoke(cli, ["--at", at(s), "job", "results", "j1"])
        assert r.exit_code == 4 and "broke off" in r.stderr
    finally:
        s.close()


def test_wait_shows_progress_on_a_terminal(srv: Server) -> None:
    """On a terminal, wait shows state and done/total on one line."""
    _states(srv, "running", "done")
    master, slave = pty.openpty()
    try:
        p = subprocess.run([sys.executable, "-m", "meshjobs.cli", "--at", at(srv), "job", "wait",
                            "j1"], stderr=slave, stdout=subprocess.PIPE, timeout=60)
        os.close(slave)
        slave = -1
        shown = read_pty(master)
    finally:
        os.close(master)
        if slave >= 0:
            os.close(slave)
    assert p.returncode == 0
    assert b"j1: running 1/3" in shown and b"j1: done 1/3" in shown


def _states(srv: Server, *states: str) -> None:
    seq = list(states)

    def answer(req: dict) -> Answer:
        state = seq.pop(0) if len(seq) > 1 else seq[0]
        return Answer(200, job_record(req["id"], state=state))
    srv.control.answers["get"] = answer


@pytest.mark.parametrize("final,code", [("done", 0), ("failed", 1), ("cancelled", 1)])
def test_wait_exit_codes(srv: Server, final: str, code: int) -> None:
    """wait long-polls until the job ends: 0 when done, 1 when failed or cancelled."""
    _states(srv, "queued", "running", final)
    r = run(srv, "job", "wait", "j1")
    assert r.exit_code == code, r.output
    waits = [q["wait_ms"] for q in srv.control.requests]
    assert waits == [0, 30_000, 30_000]


def test_wait_timeout(srv: Server) -> None:
    """A job still running at --timeout is exit 5 (not finished yet, as `job results` of an
    unfinished job), not 1 (the job failed), and stderr says so."""
    _states(srv, "running")
    r = run(srv, "job", "wait", "j1", "--timeout", "0")
    assert r.exit_code == 5, r.output
    assert "has not finished yet: still running after --timeout 0 s" in r.stderr
    shown = run(srv, "job", "wait", "--help").output
    assert "exit 5" in shown and "5 when" in " ".join(shown.split())


def test_wait_json(srv: Server) -> None:
    _states(srv, "done")
    r = run(srv, "--json", "job", "wait", "j1")
    assert r.exit_code == 0 and json.loads(r.stdout)["state"] == "done"


# --- cancel, forget, tone --------------------------------------------------------------------


def test_cancel_forget(srv: Server) -> None:
    r = run(srv, "job", "cancel", "j1")
    assert r.exit_code == 0 and r.stdout == "j1: cancelled\n"
    assert srv.control.last()["op"] == "cancel"
    r = run(srv, "job", "forget", "j1", "--json")
    assert r.exit_code == 0 and json.loads(r.stdout)["id"] == "j1"
    assert srv.control.last()["op"] == "forget"


@pytest.mark.parametrize("args,fields", [
    (["--priority", "7"], {"priority": 7}),
    (["--hold"], {"hold": True}),
    (["--release", "--max-leases", "3"], {"hold": False, "max_leases": 3}),
    (["--max-leases", "none"], {"max_leases": None}),
])
def test_tone(srv: Server, args: list[str], fields: dict) -> None:
    r = run(srv, "job", "tone", "j1", *args)
    assert r.exit_code == 0, r.output
    req = srv.control.last()
    assert {k: v for k, v in req.items() if k not in ("op", "rid", "fp", "id")} == fields


@pytest.mark.parametrize("args", [[], ["--max-leases", "0"], ["--max-leases", "lots"]])
def test_tone_bad_usage(srv: Server, args: list[str]) -> None:
    r = run(srv, "job", "tone", "j1", *args)
    assert r.exit_code == 2
    assert srv.control.requests == []


def test_bad_job_id_from_server_is_2(srv: Server) -> None:
    r = run(srv, "job", "cancel", "bad id")
    assert r.exit_code == 2 and "bad job id" in r.stderr


# --- jobs, fleet -----------------------------------------------------------------------------


def test_jobs_table_and_json(srv: Server) -> None:
    r = run(srv, "jobs", "--state", "running", "--tag", "t")
    assert r.exit_code == 0, r.output
    lines = r.stdout.splitlines()
    assert lines[0].split() == ["ID", "STATE", "DONE", "FAILED", "POOL", "PRIORITY", "SUBMITTED",
                                "TAGS", "PROGRAM"]
    assert lines[1].split()[:5] == ["j1", "running", "1/3", "0", "default"]
    assert srv.control.last() == {"op": "list", "state": "running", "tag": "t", "limit": 100}
    r = run(srv, "jobs", "--json")
    assert [j["id"] for j in json.loads(r.stdout)] == ["j1", "j2"]
    assert run(srv, "jobs", "--state", "nope").exit_code == 2


def test_jobs_from_a_member_that_is_not_fresh_says_so(srv: Server) -> None:
    """A list from a member cut off from the leader is printed as it is, with a note on stderr
    that it may be behind and where to look instead; a fresh list has no note."""
    srv.control.answers["list"] = Answer(200, {"jobs": [job_record("j1")], "next": None,
                                               "fresh": False})
    r = run(srv, "jobs")
    assert r.exit_code == 0 and r.stdout.splitlines()[1].split()[0] == "j1", r.output
    assert "does not hear the leader now" in r.stderr and "--at" in r.stderr
    r = run(srv, "jobs", "--json")
    assert [j["id"] for j in json.loads(r.stdout)] == ["j1"] and "may be behind" in r.stderr
    srv.control.answers["list"] = Answer(200, {"jobs": [job_record("j1")], "next": None,
                                               "fresh": True})
    r = run(srv, "jobs")
    assert r.exit_code == 0 and "leader" not in r.stderr


def test_fleet_table_and_json(srv: Server) -> None:
    r = run(srv, "fleet")
    assert r.exit_code == 0, r.output
    assert r.stdout.splitlines()[0] == "term 3  leader m1"
    assert r.stdout.splitlines()[1].split()[:5] == ["MEMBER", "ROLE", "ALIVE", "SLOTS", "RUNNING"]
    # Fields the member did not give show as 0 or "-", never a traceback.
    assert r.stdout.splitlines()[2].split() == ["m1", "leader", "yes", "0", "0", "-", "-", "-"]
    r = run(srv, "--json", "fleet")
    assert json.loads(r.stdout)["members"][0]["name"] == "m1"


def test_one_idempotency_key_per_invocation(srv: Server) -> None:
    """Two invocations send two keys; one invocation's requests share its key."""
    run(srv, "job", "cancel", "j1")
    run(srv, "job", "cancel", "j1")
    a, b = (q["rid"] for q in srv.control.requests)
    assert a != b


class DropFirst(http.server.BaseHTTPRequestHandler):
    """Hangs up on the first request without answering, answers the next ones."""

    seen: list[str | None] = []

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        DropFirst.seen.append(self.headers.get("Idempotency-Key"))
        if len(DropFirst.seen) == 1:
            self.close_connection = True
            return
        body = json.dumps(job_record("r1", state="cancelled")).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


def test_retry_after_reset_reuses_the_key() -> None:
    """A connection lost before the answer is retried once, with the same Idempotency-Key."""
    DropFirst.seen = []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), DropFirst)
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        r = CliRunner().invoke(cli, ["--at", url, "job", "cancel", "r1"])
        assert r.exit_code == 0, r.output
        assert len(DropFirst.seen) == 2 and DropFirst.seen[0] == DropFirst.seen[1]
        assert DropFirst.seen[0] is not None
    finally:
        server.shutdown()
        server.server_close()
