"""Bad input against a real member: every CLI command and HTTP route gets a clear error, loses
nothing, and leaves the member healthy."""

from __future__ import annotations

import json
import socket

import pytest

from meshjobs import limits

pytestmark = pytest.mark.fleet


@pytest.fixture(scope="module")
def member(tmp_path_factory):
    from tests.helpers import Meshd
    m = Meshd(str(tmp_path_factory.mktemp("bad") / "m1"), slots=2)
    m.start()
    status, rec = m.request("POST", "/jobs", {"argv": ["true"], "id": "known"})
    assert status in (200, 201)
    m.wait_job("known")
    yield m
    m.stop()


def _healthy(m) -> None:
    status, body = m.request("GET", "/healthz")
    assert status == 200 and body["ok"] and body["ready"]
    status, rec = m.request("GET", "/jobs/known")
    assert status == 200 and rec["state"] == "done"


CLI_CASES = [
    # (argv, exit code, a word the message must contain)
    (["job", "submit"], 2, ""),
    (["job", "submit", "--"], 2, ""),
    (["job", "submit", "--pool", "nope", "--", "true"], 2, "pool"),
    (["job", "submit", "--retries", "x", "--", "true"], 2, ""),
    (["job", "submit", "--retries", "-1", "--", "true"], 2, ""),
    (["job", "submit", "--runtime", "-5", "--", "true"], 2, "runtime"),
    (["job", "submit", "--priority", "99999999999", "--", "true"], 2, "priority"),
    (["job", "submit", "--id", "bad id!", "--", "true"], 2, "id"),
    (["job", "submit", "--id", "x" * 500, "--", "true"], 2, "id"),
    (["job", "submit", "--items-from", "/nonexistent/path", "--", "true"], 2, ""),
    (["job", "submit", "--env", "NOEQUALS", "--", "true"], 2, ""),
    (["job", "submit", "--cwd", "relative/dir", "--", "true"], 2, "cwd"),
    (["job", "status", "nosuchjob"], 3, "no job"),
    (["job", "status", "bad/id"], 2, ""),
    (["job", "status"], 2, ""),
    (["job", "results", "nosuchjob"], 3, ""),
    (["job", "wait", "nosuchjob"], 3, ""),
    (["job", "cancel", "nosuchjob"], 3, ""),
    (["job", "cancel", "known"], 2, "ended"),
    (["job", "forget", "nosuchjob"], 3, ""),
    (["job", "tone", "known"], 2, ""),
    (["job", "tone", "nosuchjob", "--priority", "1"], 3, ""),
    (["job", "tone", "known", "--priority", "one"], 2, ""),
    (["job", "nope"], 2, ""),
    (["jobs", "--state", "bogus"], 2, ""),
    (["nope"], 2, ""),
]


@pytest.mark.parametrize("argv,code,word", CLI_CASES, ids=[" ".join(c[0])[:40] for c in CLI_CASES])
def test_cli_bad_input(member, argv, code, word):
    """Each malformed meshctl command exits with its documented code and a readable message,
    never a traceback, and the member stays healthy."""
    r = member.ctl(*argv)
    assert r.returncode == code, (r.returncode, r.stdout, r.stderr)
    err = r.stderr.decode()
    assert "Traceback" not in err
    assert err.strip(), "an error must say something"
    assert word.lower() in err.lower()
    _healthy(member)


def test_empty_meshctl_argv(member):
    """meshctl with no command prints its usage and exits 2 (or 0 for help)."""
    r = member.ctl()
    assert r.returncode in (0, 2) and b"Usage" in (r.stdout + r.stderr)


HTTP_CASES = [
    ("POST", "/jobs", b"{not json", 400),
    ("POST", "/jobs", b"[1,2,3]", 400),
    ("POST", "/jobs", b'"argv"', 400),
    ("POST", "/jobs", b"{}", 400),
    ("POST", "/jobs", b'{"argv": []}', 400),
    ("POST", "/jobs", b'{"argv": "true"}', 400),
    ("POST", "/jobs", b'{"argv": [1, 2]}', 400),
    ("POST", "/jobs", b'{"argv": ["true"], "pool": "nope"}', 400),
    ("POST", "/jobs", b'{"argv": ["true"], "priority": true}', 400),
    ("POST", "/jobs", b'{"argv": ["true"], "retries": "3"}', 400),
    ("POST", "/jobs", b'{"argv": ["true"], "items": []}', 400),
    ("POST", "/jobs", b'{"argv": ["true"], "items": [{"b64": "!!!"}]}', 400),
    ("POST", "/jobs", b'{"argv": ["true"], "items": [{"blob": "00"}]}', 400),
    ("POST", "/jobs", b'{"argv": ["true"], "items": [{"blob": "' + b"0" * 64 + b'"}]}', 400),
    ("POST", "/jobs", b'{"argv": ["true"], "items": [7]}', 400),
    ("POST", "/jobs", b'{"argv": ["true"], "surprise": 1}', 400),
    ("POST", "/jobs", b'{"argv": ["true"], "env": {"1BAD": "x"}}', 400),
    ("POST", "/jobs", b'{"argv": ["true"], "id": "../etc"}', 400),
    ("GET", "/jobs/nosuchjob", None, 404),
    ("GET", "/jobs/known?wait=abc", None, 400),
    ("GET", "/jobs/known?wait=-1", None, 400),
    ("GET", "/jobs/known?wait=100000", None, 400),
    ("GET", "/jobs/" + "x" * 300, None, 400),
    ("GET", "/jobs/nosuchjob/results", None, 404),
    ("POST", "/jobs/nosuchjob/cancel", None, 404),
    ("POST", "/jobs/known/cancel", None, 409),
    ("POST", "/jobs/known/tone", b"{}", 400),
    ("POST", "/jobs/known/tone", b"nope", 400),
    ("POST", "/jobs/known/tone", b'{"priority": "high"}', 400),
    ("POST", "/jobs/known/tone", b'{"colour": 1}', 400),
    ("POST", "/jobs/known/tone", b'{"priority": 1}', 409),
    ("DELETE", "/jobs/nosuchjob", None, 404),
    ("GET", "/blobs/zz", None, 400),
    ("GET", "/blobs/" + "0" * 64, None, 404),
    ("GET", "/nope", None, 404),
    ("PUT", "/jobs", b"{}", 405),
    ("GET", "/jobs?state=bogus", None, 400),
]


@pytest.mark.parametrize("method,path,body,status", HTTP_CASES,
                         ids=[f"{c[0]} {c[1][:30]} {(c[2] or b'')[:30]!r}" for c in HTTP_CASES])
def test_http_bad_input(member, method, path, body, status):
    """Each malformed request gets its status and a JSON error; the member stays healthy."""
    got, answer = member.request(method, path, raw=body)
    assert got == status, (got, answer)
    assert isinstance(answer, dict) and answer.get("error"), answer
    _healthy(member)


def test_http_oversized_body(member):
    """A body over the limit is refused with 413 without being read whole."""
    big = b'{"argv": ["true"], "items": ["' + b"x" * (limits.http_body_bytes_max + 10) + b'"]}'
    try:
        got, answer = member.request("POST", "/jobs", raw=big, timeout_s=60)
    except OSError:
        got, answer = 413, {"error": "connection closed while sending an oversized body"}
    assert got == 413, answer
    _healthy(member)


def test_http_garbage_bytes_on_the_port(member):
    """Raw garbage and a half request on the HTTP port: the member drops them and stays healthy."""
    host, port = member.url.removeprefix("http://").split(":")
    for junk in (b"\x00\xff" * 100 + b"\r\n\r\n", b"GET /jobs HTTP/1.1\r\nHost: x\r\nContent-Length: 99\r\n\r\nabc",
                 b"POST /jobs HTTP/1.1\r\nContent-Length: -5\r\n\r\n"):
        with socket.create_connection((host, int(port)), timeout=5) as s:
            s.sendall(junk)
            s.shutdown(socket.SHUT_WR)
            try:
                s.recv(4096)
            except OSError:
                pass
    _healthy(member)


def test_nothing_lost_after_bad_input(member):
    """After all the garbage, a real job still runs end to end and the old one is intact."""
    status, rec = member.request("POST", "/jobs", {"argv": ["sh", "-c", "echo ok"]})
    assert status in (200, 201)
    done = member.wait_job(rec["id"])
    assert done["state"] == "done"
    status, jobs = member.request("GET", "/jobs")
    assert "known" in {j["id"] for j in jobs}
    json.dumps(jobs)
