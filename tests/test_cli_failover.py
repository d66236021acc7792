"""meshctl with several members (--at A,B,C or MESHJOBS_AT): every command asks the next, in
order, when one cannot answer (connection error, 502/503/504), a change keeps its
Idempotency-Key across them so that it is made once, `job logs -f` goes on from the byte it
reached, and when every member fails the error names each one and why."""

from __future__ import annotations

import http.client
import http.server
import json
import socket
import subprocess
import sys
import threading
import urllib.parse

import pytest

from tests.helpers import (
    Meshd,
    env_with_path,
    fleet_running,
    free_port,
    leader_of,
    make_fleet,
    wait_until,
)

pytestmark = pytest.mark.fleet


def meshctl(at: list[str], *args: str, timeout_s: float = 120.0) -> subprocess.CompletedProcess:
    """meshctl with MESHJOBS_AT naming `at`, in that order."""
    env = env_with_path({"MESHJOBS_AT": ",".join(at)})
    env.pop("MESHJOBS_TOKEN", None)
    return subprocess.run([sys.executable, "-m", "meshjobs.cli", *args], capture_output=True,
                          timeout=timeout_s, env=env, text=True)


def job_ids(m: Meshd) -> list[str]:
    status, body = m.request("GET", "/jobs?limit=100")
    assert status == 200, body
    return sorted(j["id"] for j in body)


@pytest.fixture
def fleet(tmp_path):
    yield from fleet_running(make_fleet(str(tmp_path / "fleet"), voters=3))


def test_commands_pass_over_a_killed_first_member(fleet) -> None:
    """The leader, first in MESHJOBS_AT, killed -9: fleet, jobs and a submit answer from the
    others (the submit through the election that follows), and the submit makes one job."""
    leader = leader_of(fleet)
    rest = [m for m in fleet if m is not leader]
    at = [leader.url] + [m.url for m in rest]
    leader.kill9()
    r = meshctl(at, "fleet")
    assert r.returncode == 0, r.stderr
    assert all(m.name in r.stdout for m in rest), r.stdout
    r = meshctl(at, "jobs")
    assert r.returncode == 0, r.stderr
    r = meshctl(at, "job", "submit", "--id", "after-crash", "--", "echo", "hi")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "after-crash"
    assert job_ids(leader_of(rest)) == ["after-crash"]
    r = meshctl(at, "job", "wait", "after-crash", "--timeout", "60")
    assert r.returncode == 0, r.stderr


class Front:
    """An HTTP front of a real member that spoils the answer to the first POST: it passes the
    request on (so the member makes the change), then answers 503 (`mode` "503") or closes the
    connection without an answer and stops listening, as a member dying mid-request (`mode`
    "die"). With `mode` "refuse" it answers 503 without passing the request on."""

    def __init__(self, upstream: str, mode: str) -> None:
        self.up = urllib.parse.urlsplit(upstream)
        self.mode = mode
        self.posts = 0
        front = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def _any(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if self.command == "POST":
                    front.posts += 1
                if front.mode == "refuse":
                    self._answer(503, {"error": "no leader yet"})
                    return
                conn = http.client.HTTPConnection(front.up.hostname, front.up.port, timeout=60)
                headers = {k: v for k, v in self.headers.items() if k.lower() != "host"}
                conn.request(self.command, self.path, body or None, headers)
                resp = conn.getresponse()
                data = resp.read()
                conn.close()
                if self.command == "POST" and front.mode == "die":
                    front.server.socket.close()  # no one listens here any more
                    self.connection.shutdown(socket.SHUT_RDWR)
                    self.close_connection = True
                    return
                if self.command == "POST" and front.mode == "503":
                    self._answer(503, {"error": "member busy, try again"})
                    return
                self.send_response(resp.status)
                for k, v in resp.getheaders():
                    if k.lower() not in ("transfer-encoding", "connection"):
                        self.send_header(k, v)
                self.end_headers()
                self.wfile.write(data)

            def _answer(self, status: int, body: dict) -> None:
                raw = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            do_GET = do_POST = do_DELETE = do_PUT = _any

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.mark.parametrize("mode", ["503", "die", "refuse"])
def test_a_submit_is_made_once_across_members(fleet, mode) -> None:
    """The first member answers 503, or dies after making the job but before answering, or
    answers 503 having made nothing: the submit goes on to the next member with the same
    Idempotency-Key, and exactly one job exists (no --id: the id is the member's)."""
    leader = leader_of(fleet)
    other = next(m for m in fleet if m is not leader)
    front = Front(leader.url, mode)
    try:
        r = meshctl([front.url, other.url], "job", "submit", "--", "echo", "once")
    finally:
        front.close()
    assert r.returncode == 0, r.stderr
    assert front.posts >= 1
    # The leader answers from its committed table: a second job, had one been made, is there.
    made = job_ids(leader)
    assert made == [r.stdout.strip()], (made, r.stdout)
    wait_until(lambda: job_ids(other) == made, 30, "the follower's table")


def test_logs_follow_moves_to_the_next_member_mid_stream(fleet, tmp_path) -> None:
    """`job logs -f` from a member that is killed mid-stream goes on from the next member at the
    byte it reached: every byte once, none lost."""
    gate = str(tmp_path / "gate")
    script = ("i=0; while [ $i -lt 200 ]; do echo line-$i; i=$((i+1)); done; "
              f"while [ ! -e {gate} ]; do sleep 0.05; done; echo after-the-kill; echo end")
    leader = leader_of(fleet)
    status, rec = leader.request("POST", "/jobs", {"argv": ["sh", "-c", script], "items": [""],
                                                   "id": "far"})
    assert status == 201, rec

    def runner() -> str | None:
        status, rec = leader.request("GET", "/jobs/far?items=1")
        item = rec["items"][0] if status == 200 else {}
        return item.get("member") if item.get("state") == "leased" else None
    runs_on = wait_until(runner, 60, "the item leased")
    first, second = [m for m in fleet if m.name != runs_on]
    env = env_with_path({"MESHJOBS_AT": f"{first.url},{second.url}"})
    proc = subprocess.Popen([sys.executable, "-m", "meshjobs.cli", "job", "logs", "far", "-f"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    try:
        assert proc.stdout is not None
        got = b""
        while not got.endswith(b"line-199\n"):
            line = proc.stdout.readline()
            assert line, "the stream ended early"
            got += line
        first.kill9()
        open(gate, "w").close()
        rest, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    want = b"".join(b"line-%d\n" % i for i in range(200)) + b"after-the-kill\nend\n"
    assert proc.returncode == 0, err
    assert got + rest == want
    assert b"runs again" not in err


def test_every_member_down_is_named(tmp_path) -> None:
    """No member answers: the error names each one and why, and says what to do (exit 4)."""
    a, b = (f"http://127.0.0.1:{free_port()}" for _ in range(2))
    front = Front(a, "refuse")  # answers 503 to everything
    try:
        r = meshctl([a, front.url, b], "job", "submit", "--", "true", timeout_s=60)
    finally:
        front.close()
    assert r.returncode == 4, r.stderr
    err = r.stderr
    assert err.startswith("meshctl: cannot reach any member: "), err
    assert f"{a}: Connection refused" in err and f"{b}: Connection refused" in err, err
    assert f"{front.url}: 503 no leader yet" in err, err
    assert "pass --at" in err and "Traceback" not in err
    r = meshctl([a, b], "fleet", timeout_s=60)
    assert r.returncode == 4 and f"{a}: Connection refused; {b}: Connection refused" in r.stderr
    r = meshctl([a], "fleet", timeout_s=60)  # one member: as before
    assert r.returncode == 4 and f"cannot reach meshd at {a}" in r.stderr, r.stderr
