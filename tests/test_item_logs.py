"""Live item output, with real members: GET /jobs/{id}/items/{n}/stdout and /stderr (while the
item runs, followed, after it ended, from another member of a fleet) and `meshctl job logs`."""

from __future__ import annotations

import http.client
import os
import socket
import subprocess
import sys
import threading
import urllib.parse

import pytest

from meshjobs import limits
from tests.helpers import (
    Meshd,
    env_with_path,
    free_port,
    make_cert,
    make_fleet,
    start_all,
    submit_anywhere,
    token_line,
    wait_until,
)

FINAL = ("done", "failed", "timeout", "cancelled")


def gated_spec(gate: str, job_id: str, **extra) -> dict:
    """An item that writes a line to stdout and one to stderr, waits for the file `gate`, then
    writes another line to each and ends."""
    script = (f"echo first; echo err-one >&2; while [ ! -e {gate} ]; do sleep 0.05; done; "
              "echo second; echo err-two >&2")
    return {"argv": ["sh", "-c", script], "items": [""], "id": job_id, **extra}


class Follow:
    """GET ...?follow=1 read on a thread of its own: what came, and whether the answer ended."""

    def __init__(self, url: str, path: str) -> None:
        self.url = urllib.parse.urlsplit(url)
        self.path = path
        self.status: int | None = None
        self.headers: dict[str, str] = {}
        self.data = b""
        self.error: BaseException | None = None
        self.ended = threading.Event()
        self._lock = threading.Lock()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        conn = http.client.HTTPConnection(self.url.hostname, self.url.port, timeout=120)
        try:
            conn.request("GET", self.path)
            resp = conn.getresponse()
            self.status = resp.status
            self.headers = dict(resp.headers)
            while True:
                chunk = resp.read1(65536)
                if not chunk:
                    break
                with self._lock:
                    self.data += chunk
        except BaseException as e:  # seen by the test through `error`
            self.error = e
        finally:
            conn.close()
            self.ended.set()

    def got(self) -> bytes:
        with self._lock:
            return self.data


def item_of(m, job_id: str, n: int = 0) -> dict:
    status, rec = m.request("GET", f"/jobs/{job_id}?items=1")
    assert status == 200, (status, rec)
    return rec["items"][n]


def output_is(m, path: str, want: bytes):
    """A predicate: the member answers `path` with 200 and exactly `want`."""
    def check():
        status, body = m.request("GET", path)
        return status == 200 and body == want
    return check


def output_has(m, path: str, want: bytes):
    def check():
        status, body = m.request("GET", path)
        return status == 200 and isinstance(body, bytes) and body.startswith(want)
    return check


def test_running_item_output_live_followed_and_stored(meshd, tmp_path):
    """While the item runs, stdout and stderr show what it wrote so far; a follow delivers the
    second line once the item goes on, and closes when it ends; then the blob is served, from
    any offset."""
    gate = str(tmp_path / "gate")
    status, rec = meshd.request("POST", "/jobs", gated_spec(gate, "live"))
    assert status == 201, rec
    wait_until(output_is(meshd, "/jobs/live/items/0/stdout", b"first\n"), what="first line")
    wait_until(output_is(meshd, "/jobs/live/items/0/stderr", b"err-one\n"), what="stderr line")
    assert item_of(meshd, "live")["state"] == "leased"
    status, body = meshd.request("GET", "/jobs/live/items/0/stdout?offset=2")
    assert (status, body) == (200, b"rst\n")
    follow = Follow(meshd.url, "/jobs/live/items/0/stdout?follow=1")
    err_follow = Follow(meshd.url, "/jobs/live/items/0/stderr?follow=1&offset=4")
    wait_until(lambda: follow.got() == b"first\n", what="the follow's first line")
    wait_until(lambda: err_follow.got() == b"one\n", what="the stderr follow's first line")
    assert not follow.ended.is_set()
    assert follow.status == 200 and follow.headers["Content-Type"].startswith("text/plain")
    open(gate, "w").close()
    assert follow.ended.wait(60) and err_follow.ended.wait(60)
    assert follow.error is None and follow.got() == b"first\nsecond\n"
    assert err_follow.error is None and err_follow.got() == b"one\nerr-two\n"
    done = meshd.wait_job("live")
    assert done["state"] == "done"
    item = done["items"][0]
    assert item["state"] in FINAL
    for stream, whole in (("stdout", b"first\nsecond\n"), ("stderr", b"err-one\nerr-two\n")):
        status, body = meshd.request("GET", f"/jobs/live/items/0/{stream}")
        assert (status, body) == (200, whole)
        status, blob = meshd.request("GET", f"/blobs/{item[stream]}")
        assert blob == whole
        status, body = meshd.request("GET", f"/jobs/live/items/0/{stream}?offset=6&follow=1")
        assert (status, body) == (200, whole[6:])
        status, body = meshd.request("GET", f"/jobs/live/items/0/{stream}?offset=1000")
        assert (status, body) == (200, b"")


def test_follow_waits_for_an_item_that_has_not_started(meshd, tmp_path):
    """An item not started yet: 409 saying so without follow; with follow=1 the answer waits
    for it to start and then streams its output."""
    gate = str(tmp_path / "gate")
    open(gate, "w").close()
    status, rec = meshd.request("POST", "/jobs", gated_spec(gate, "held", hold=True))
    assert status == 201, rec
    status, body = meshd.request("GET", "/jobs/held/items/0/stdout")
    assert status == 409 and "has not started" in body["error"], body
    follow = Follow(meshd.url, "/jobs/held/items/0/stdout?follow=1")
    status, body = meshd.request("POST", "/jobs/held/tone", {"hold": False})
    assert status == 200, body
    assert follow.ended.wait(60)
    assert follow.error is None and follow.status == 200
    assert follow.got() == b"first\nsecond\n"


def test_cancel_ends_a_follow(meshd, tmp_path):
    """A follow of an item whose job is cancelled ends (with what the item wrote), and the
    job forgotten afterwards answers 404."""
    gate = str(tmp_path / "gate")
    status, rec = meshd.request("POST", "/jobs", gated_spec(gate, "stopme"))
    assert status == 201, rec
    follow = Follow(meshd.url, "/jobs/stopme/items/0/stdout?follow=1")
    wait_until(lambda: follow.got() == b"first\n", what="the follow's first line")
    status, body = meshd.request("POST", "/jobs/stopme/cancel")
    assert status == 200, body
    assert follow.ended.wait(60)
    assert follow.error is None and follow.got() == b"first\n"
    assert meshd.wait_job("stopme")["state"] == "cancelled"
    status, body = meshd.request("DELETE", "/jobs/stopme")
    assert status == 200, body
    status, body = meshd.request("GET", "/jobs/stopme/items/0/stdout")
    assert status == 404, body


@pytest.mark.parametrize("path,status,words", [
    ("/jobs/ended/items/1/stdout", 404, "no item 1"),
    ("/jobs/ended/items/999999/stdout", 404, "no item 999999"),
    ("/jobs/ended/items/1000000/stdout", 400, "item index"),
    ("/jobs/ended/items/99999999999999999999999/stdout", 400, "item index"),
    ("/jobs/ended/items/-1/stdout", 400, "item index"),
    ("/jobs/ended/items/x/stdout", 400, "item index"),
    ("/jobs/ended/items/%C2%B2/stdout", 400, "item index"),
    ("/jobs/ended/items/0/stdin", 404, "no route"),
    ("/jobs/ended/items/0/STDOUT", 404, "no route"),
    ("/jobs/ended/items/0/", 404, "no route"),
    ("/jobs/nosuchjob/items/0/stdout", 404, "no job"),
    ("/jobs/bad%00id/items/0/stdout", 400, ""),
    ("/jobs/ended/items/0/stdout?offset=-1", 400, "offset"),
    ("/jobs/ended/items/0/stdout?offset=1.5", 400, "offset"),
    ("/jobs/ended/items/0/stdout?offset=0x10", 400, "offset"),
    (f"/jobs/ended/items/0/stdout?offset={limits.log_offset_bytes_max + 1}", 400, "offset"),
    ("/jobs/ended/items/0/stdout?offset=" + "9" * 400, 400, "offset"),
    ("/jobs/ended/items/0/stdout?follow=maybe", 400, "follow"),
    ("/jobs/ended/items/0/stdout?follow=2", 400, "follow"),
])
def test_hostile_requests_are_refused(meshd_factory, path, status, words, tmp_path):
    """Bad item numbers, streams, offsets and follow values, and unknown jobs, are refused
    with the status the API documents and words that say what is wrong."""
    m = _ended_member(meshd_factory, tmp_path)
    got, body = m.request("GET", path)
    assert got == status, (path, got, body)
    assert isinstance(body, dict) and words in body["error"], body


def _ended_member(meshd_factory, tmp_path):
    """A member (one per test) with a job `ended` of one item that ran."""
    m = meshd_factory()
    status, rec = m.request("POST", "/jobs", {"argv": ["echo", "hi"], "items": [""],
                                              "id": "ended"})
    assert status == 201, rec
    assert m.wait_job("ended")["state"] == "done"
    return m


def test_head_is_not_allowed(meshd_factory, tmp_path):
    """HEAD has no meaning for a stream that grows: 405, in the usual JSON shape."""
    m = _ended_member(meshd_factory, tmp_path)
    status, _headers, body = m.raw_request("HEAD", "/jobs/ended/items/0/stdout")
    assert status == 405


def test_client_disconnect_ends_the_stream_and_stop_is_not_held(meshd, tmp_path):
    """A follow whose client goes away ends on the member (its stream gauge drops to 0); a
    member stopped with a follow open exits cleanly and the follow's answer ends."""
    gate = str(tmp_path / "gate")
    status, rec = meshd.request("POST", "/jobs", gated_spec(gate, "cut"))
    assert status == 201, rec
    wait_until(output_is(meshd, "/jobs/cut/items/0/stdout", b"first\n"), what="first line")
    u = urllib.parse.urlsplit(meshd.url)
    sock = socket.create_connection((u.hostname, u.port), timeout=30)
    sock.sendall(f"GET /jobs/cut/items/0/stdout?follow=1 HTTP/1.1\r\nHost: {u.netloc}\r\n\r\n"
                 .encode())
    assert b"first\n" in _read_until(sock, b"first\n")
    assert meshd.metrics()["meshjobs_http_item_streams"] == 1
    sock.close()
    wait_until(lambda: meshd.metrics()["meshjobs_http_item_streams"] == 0,
               what="the member ends the stream of a client that went away")
    follow = Follow(meshd.url, "/jobs/cut/items/0/stdout?follow=1")
    wait_until(lambda: follow.got() == b"first\n", what="the follow's first line")
    assert meshd.terminate() == 0
    assert follow.ended.wait(30)


def _read_until(sock: socket.socket, needle: bytes) -> bytes:
    got = b""
    while needle not in got:
        chunk = sock.recv(4096)
        if not chunk:
            break
        got += chunk
    return got


def ctl_at(url: str, *args: str, timeout_s: float = 120) -> subprocess.CompletedProcess:
    env = env_with_path()
    for k in ("MESHJOBS_TOKEN", "MESHJOBS_CACERT", "MESHJOBS_AT"):
        env.pop(k, None)
    return subprocess.run([sys.executable, "-m", "meshjobs.cli", "--at", url, *args],
                          capture_output=True, timeout=timeout_s, env=env)


def test_meshctl_job_logs(meshd, tmp_path):
    """`meshctl job logs` prints what the item wrote so far, --stderr its stderr, -f follows
    until the item ends; 3 for no such job, 2 for an item not started, 4 when no member
    answers."""
    gate = str(tmp_path / "gate")
    status, rec = meshd.request("POST", "/jobs", gated_spec(gate, "cli"))
    assert status == 201, rec
    wait_until(lambda: meshd.ctl("job", "logs", "cli").stdout == b"first\n", what="first line")
    r = meshd.ctl("job", "logs", "cli", "--stderr", "--item", "0")
    assert (r.returncode, r.stdout) == (0, b"err-one\n"), r.stderr
    proc = subprocess.Popen([sys.executable, "-m", "meshjobs.cli", "--at", meshd.url, "job",
                             "logs", "cli", "-f"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=env_with_path())
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline() == b"first\n"
        assert proc.poll() is None
        open(gate, "w").close()
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    assert out == b"second\n"
    r = meshd.ctl("job", "logs", "cli")
    assert (r.returncode, r.stdout) == (0, b"first\nsecond\n")
    r = meshd.ctl("job", "logs", "cli", "-f", "--stderr")
    assert (r.returncode, r.stdout) == (0, b"err-one\nerr-two\n")
    r = meshd.ctl("job", "logs", "nosuchjob")
    assert r.returncode == 3 and b"no job" in r.stderr, r.stderr
    r = meshd.ctl("job", "logs", "cli", "--item", "5")
    assert r.returncode == 3 and b"no item 5" in r.stderr, r.stderr
    r = meshd.ctl("job", "logs", "cli", "--item", "-1")
    assert r.returncode == 2
    status, rec = meshd.request("POST", "/jobs", {"argv": ["true"], "items": [""], "hold": True,
                                                  "id": "waiting"})
    assert status == 201, rec
    r = meshd.ctl("job", "logs", "waiting")
    assert r.returncode == 2 and b"has not started" in r.stderr, r.stderr
    r = ctl_at(f"http://127.0.0.1:{free_port()}", "job", "logs", "cli")
    assert r.returncode == 4 and b"cannot reach" in r.stderr, r.stderr


@pytest.mark.fleet
def test_output_from_another_member_of_a_fleet(tmp_path):
    """In a fleet of three, a member the item does not run on serves its growing output (asked
    of the member running it over the links), follows it to its end, and then serves the
    stored blob; meshctl job logs -f works against it too."""
    members = make_fleet(str(tmp_path / "fleet"), voters=3)
    try:
        start_all(members)
        gate = str(tmp_path / "gate")
        _m, job_id = submit_anywhere(members, gated_spec(gate, "far"))

        def running_on():
            for m in members:
                it = item_of(m, job_id)
                if it["state"] == "leased" and it["member"]:
                    return it["member"]
            return None
        runner = wait_until(running_on, 60, "the item leased to a member")
        other = next(m for m in members if m.name != runner)
        wait_until(output_is(other, "/jobs/far/items/0/stdout", b"first\n"), 60,
                   "first line from another member")
        wait_until(output_is(other, "/jobs/far/items/0/stderr", b"err-one\n"), 60,
                   "stderr from another member")
        assert item_of(other, job_id)["member"] == runner != other.name
        follow = Follow(other.url, "/jobs/far/items/0/stdout?follow=1")
        proc = subprocess.Popen([sys.executable, "-m", "meshjobs.cli", "--at", other.url, "job",
                                 "logs", "far", "-f", "--stderr"], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, env=env_with_path())
        try:
            assert proc.stdout is not None
            assert proc.stdout.readline() == b"err-one\n"
            wait_until(lambda: follow.got() == b"first\n", what="the follow's first line")
            assert not follow.ended.is_set()
            open(gate, "w").close()
            out, err = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        assert (proc.returncode, out) == (0, b"err-two\n"), err
        assert follow.ended.wait(60)
        assert follow.error is None and follow.got() == b"first\nsecond\n"
        for m in members:
            assert m.wait_job(job_id)["state"] == "done"
            status, body = m.request("GET", "/jobs/far/items/0/stdout")
            assert (status, body) == (200, b"first\nsecond\n")
        assert sum(m.metrics().get("meshjobs_item_logs_served_total", 0) for m in members) >= 1
        # More than one F_LOG_PUT's worth, written before the item waits: served whole.
        big_gate = str(tmp_path / "big-gate")
        size = 3 * limits.log_frame_bytes_max + 123
        _m, big = submit_anywhere(members, {
            "argv": ["sh", "-c", f"head -c {size} /dev/zero | tr '\\0' a; "
                                 f"while [ ! -e {big_gate} ]; do sleep 0.05; done"],
            "items": [""], "id": "big"})
        runner = wait_until(lambda: next((item_of(m, big)["member"] for m in members
                                          if item_of(m, big)["state"] == "leased"), None),
                            60, "the big item leased")
        other = next(m for m in members if m.name != runner)
        wait_until(output_is(other, "/jobs/big/items/0/stdout", b"a" * size), 60,
                   "the big output from another member")
        status, body = other.request("GET", f"/jobs/big/items/0/stdout?offset={size - 5}")
        assert (status, body) == (200, b"aaaaa")
        open(big_gate, "w").close()
    finally:
        for m in members:
            m.stop()


@pytest.mark.fleet
def test_follow_ends_when_the_member_running_the_item_dies(tmp_path):
    """A follow from another member does not hang when the member running the item is killed:
    once the item's lease moves to a new run, the answer ends, meshctl -f says the output
    starts again, and the new run's output is served."""
    members = make_fleet(str(tmp_path / "fleet"), voters=3, dead_ms=1000)
    try:
        start_all(members)
        gate = str(tmp_path / "gate")
        _m, job_id = submit_anywhere(members, gated_spec(gate, "moved"))

        def running_on():
            for m in members:
                it = item_of(m, job_id)
                if it["state"] == "leased" and it["member"]:
                    return it
            return None
        first = wait_until(running_on, 60, "the item leased to a member")
        runner = next(m for m in members if m.name == first["member"])
        other = next(m for m in members if m is not runner)
        wait_until(output_is(other, "/jobs/moved/items/0/stdout", b"first\n"), 60,
                   "first line from another member")
        follow = Follow(other.url, "/jobs/moved/items/0/stdout?follow=1")
        proc = subprocess.Popen([sys.executable, "-m", "meshjobs.cli", "--at", other.url, "job",
                                 "logs", "moved", "-f"], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, env=env_with_path())
        try:
            assert proc.stdout is not None
            assert proc.stdout.readline() == b"first\n"
            wait_until(lambda: follow.got() == b"first\n", what="the follow's first line")
            assert follow.headers["X-Meshjobs-Item-Epoch"] == str(first["epoch"])
            runner.kill9()
            assert follow.ended.wait(120), "the follow must end once the lease moved"
            out, err = proc.communicate(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        assert follow.error is None and follow.got() == b"first\n"
        assert proc.returncode == 0 and out == b"" and b"runs again" in err, err
        again = item_of(other, job_id)
        assert again["epoch"] != first["epoch"] and again["member"] != runner.name
        wait_until(output_is(other, "/jobs/moved/items/0/stdout", b"first\n"), 60,
                   "the new run's first line")
        open(gate, "w").close()
        assert other.wait_job(job_id, timeout_s=120)["state"] == "done"
        status, body = other.request("GET", "/jobs/moved/items/0/stdout")
        assert (status, body) == (200, b"first\nsecond\n")
    finally:
        for m in members:
            m.stop()


def test_a_python_items_output_shows_once_it_ended(tmp_path):
    """A python item has no spool file: while it runs its output is empty (200, no wait for
    it), a follow delivers it once the item ended."""
    funcs = tmp_path / "funcs"
    funcs.mkdir()
    gate = tmp_path / "gate"
    (funcs / "gated.py").write_text(
        "import os, time\n"
        "def wait(data):\n"
        "    while not os.path.exists(os.environ['GATE']):\n"
        "        time.sleep(0.05)\n"
        "    return 'py-done'\n")
    cfg = tmp_path / "m.toml"
    cfg.write_text('name = "m"\n[pools.py]\nkind = "python"\nslots = 1\n'
                   '[pools.default]\nslots = 1\n')
    m = Meshd(str(tmp_path / "m"), name="m", config=str(cfg))
    try:
        m.start()
        status, rec = m.request("POST", "/jobs", {
            "pool": "py", "argv": ["gated:wait"], "cwd": str(funcs), "env": {"GATE": str(gate)},
            "items": ["x"], "id": "py"})
        assert status == 201, rec
        wait_until(lambda: item_of(m, "py")["state"] == "leased", what="the python item runs")
        assert m.request("GET", "/jobs/py/items/0/stdout") == (200, b"")
        follow = Follow(m.url, "/jobs/py/items/0/stdout?follow=1")
        wait_until(lambda: m.metrics()["meshjobs_http_item_streams"] == 1, what="the follow")
        gate.write_text("")
        assert follow.ended.wait(60)
        assert follow.error is None and follow.got() == b"py-done"
    finally:
        m.stop()


def test_openapi_describes_the_routes(meshd):
    """The OpenAPI document has both routes with their parameters."""
    status, doc = meshd.request("GET", "/openapi.json")
    assert status == 200
    for stream in ("stdout", "stderr"):
        op = doc["paths"][f"/jobs/{{id}}/items/{{n}}/{stream}"]["get"]
        names = {p["name"] for p in op["parameters"]}
        assert {"id", "n", "follow", "offset"} <= names
        assert {"200", "400", "404", "409", "503"} <= set(op["responses"])



def test_meshctl_job_logs_with_tokens_and_https(tmp_path):
    """Over HTTPS with tokens: a read token is enough for job logs (also -f); no token is
    exit 2 saying to set one; without --cacert it is exit 4 saying to pass it."""
    top = str(tmp_path)
    cert, key = make_cert(os.path.join(top, "pki"))
    cfg = os.path.join(top, "m.toml")
    with open(cfg, "w") as f:
        f.write('name = "m"\n[pools.default]\nslots = 2\n'
                f'[http]\ntls_cert = "{cert}"\ntls_key = "{key}"\n'
                "[auth]\ntokens = [ " + token_line("reader", "read", "tok-read-1234") + ", "
                + token_line("ci", "submit", "tok-submit-5678") + " ]\n")
    m = Meshd(os.path.join(top, "m"), name="m", config=cfg, token="tok-submit-5678", cacert=cert)
    try:
        m.start()
        status, rec = m.request("POST", "/jobs", {"argv": ["echo", "secret-free"],
                                                  "items": [""], "id": "tls"})
        assert status == 201, rec
        m.wait_job("tls")
        for extra in ([], ["-f"]):
            r = m.ctl("job", "logs", "tls", *extra, env={"MESHJOBS_TOKEN": "tok-read-1234"})
            assert (r.returncode, r.stdout) == (0, b"secret-free\n"), r.stderr
        r = m.ctl("job", "logs", "tls", env={"MESHJOBS_TOKEN": ""})
        assert r.returncode == 2 and b"MESHJOBS_TOKEN" in r.stderr, r.stderr
        r = m.ctl("job", "logs", "tls", env={"MESHJOBS_CACERT": ""})
        assert r.returncode == 4 and b"--cacert" in r.stderr, r.stderr
    finally:
        m.stop()
