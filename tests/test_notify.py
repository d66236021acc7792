"""Finish hooks (issue 12, point 8): `--notify URL` at submit; when the job ends the leader POSTs
its final record there, retried with backoff, never blocking the jobs thread
(meshjobs/notify.py at the edge, meshjobs/node/hooks.py in the node).

The receiver is a small http.server on 127.0.0.1 in a thread of the test: it is not the part
under test, the member's sender is.
"""

from __future__ import annotations

import http.server
import json
import os
import random
import threading
from typing import Any

import pytest

from meshjobs import limits
from meshjobs.control import ControlError, parse_submit
from meshjobs.hookaddr import NotifyPolicy
from meshjobs.node import JobNode, NodeConfig, Pool, Tick, View
from meshjobs.node.events import Notify
from meshjobs.notify import Notifier
from tests.helpers import Log, Meshd, member_config, running, wait_until

T0 = 1_700_000_000_000
LOOPBACK = NotifyPolicy.parse(["127.0.0.1/32"])


class Receiver:
    """An HTTP server that records every POST; it answers `fail_first` of them 500."""

    def __init__(self, fail_first: int = 0) -> None:
        self.got: list[dict[str, Any]] = []
        self.fail_first = fail_first
        self.lock = threading.Lock()
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                n = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(n)
                with outer.lock:
                    fail = outer.fail_first > 0
                    outer.fail_first -= 1 if fail else 0
                    outer.got.append({"path": self.path, "headers": dict(self.headers),
                                      "body": json.loads(body), "failed": fail})
                self.send_response(500 if fail else 204)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def of(self, job_id: str) -> list[dict]:
        with self.lock:
            return [g for g in self.got if g["body"].get("id") == job_id]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver():
    r = Receiver()
    yield r
    r.close()


@pytest.fixture(scope="module")
def member(tmp_path_factory):
    top = str(tmp_path_factory.mktemp("notify"))
    # Notices to this test's receivers on loopback are allowed, as an operator would allow them.
    cfg = member_config(top, "n1", '[pools.default]\nslots = 2\n[notify]\nallow = ["127.0.0.1/32"]\n')
    yield from running(Meshd(os.path.join(top, "n1"), name="n1", config=cfg))


# --- the spec ---------------------------------------------------------------------------------


@pytest.mark.parametrize("url", [
    "ftp://example.org/x", "file:///etc/passwd", "http://", "http:///path", "example.org/hook",
    "http://user:pw@example.org/", "http://exa mple.org/", "http://example.org/\n",
    "http://ex\u00e4mple.org/", "http://example.org:99999/", "http://example.org:0/",
    "http://[::1/", "", "http://example.org/" + "a" * limits.notify_url_chars_max, 5, ["x"],
    True, {"url": "http://example.org"},
])
def test_bad_notify_urls_are_refused(url: Any) -> None:
    """notify must be an http(s) URL with a host, without credentials, bounded in length."""
    with pytest.raises(ControlError) as e:
        parse_submit({"argv": ["true"], "notify": url})
    assert e.value.status == 400 and "notify" in e.value.message


def test_notify_is_kept_in_the_spec_only_when_given() -> None:
    """A spec without notify stays as it was (its digest too); with one, it is kept."""
    assert "notify" not in parse_submit({"argv": ["true"]})
    spec = parse_submit({"argv": ["true"], "notify": "https://hooks.example.org/a?b=c"})
    assert spec["notify"] == "https://hooks.example.org/a?b=c"


# --- the node -------------------------------------------------------------------------------------


def leader_node(log: Log) -> JobNode:
    node = JobNode(log.table, NodeConfig(member="a", boot="b1",
                                         pools={"default": Pool("default", slots=2)}),
                   random.Random(1))
    node.step(Tick(T0))
    node.step(View(term=1, leader="a", is_leader=True, ready=True))
    node.take()
    return node


def test_a_new_leader_hands_on_recent_ends_again() -> None:
    """At-least-once across failovers: a new reign hands on the notices of jobs that ended
    within notify_retry_s_max before it (the old leader may have died before sending), with the
    same key; older ends are not sent again."""
    log = Log()
    log.submit("old", n=1, notify="http://127.0.0.1:9/h", t=T0)
    log.op("cancel", "old", t=T0)
    later = T0 + limits.notify_retry_s_max * 1000 + 5_000
    log.submit("new", n=1, notify="http://127.0.0.1:9/h", t=later)
    log.op("cancel", "new", t=later)
    node = JobNode(log.table, NodeConfig(member="a", boot="b1",
                                         pools={"default": Pool("default", slots=2)}),
                   random.Random(1))
    node.step(Tick(later + 1_000))
    node.step(View(term=2, leader="a", is_leader=True, ready=True))
    notes = [e for e in node.take() if isinstance(e, Notify)]
    assert [(n.key, n.record["state"]) for n in notes] == [
        (f"new.{log.table.jobs['new'].version}", "cancelled")]
    node.step(Tick(later + 2_000))
    assert not [e for e in node.take() if isinstance(e, Notify)]  # once per reign


# --- the edge's sender ------------------------------------------------------------------------------


def test_a_full_queue_drops_and_counts_without_blocking() -> None:
    """offer never blocks: past notify_queue_max waiting notices it drops one and counts it."""
    n = Notifier("x")
    for i in range(limits.notify_queue_max):
        assert n.offer("http://127.0.0.1:9/", f"j{i}.1", {"id": f"j{i}"})
    assert n.offer("http://127.0.0.1:9/", "late.1", {"id": "late"}) is False
    assert n.numbers()["notify_dropped"] == 1


def test_sender_retries_until_the_receiver_takes_it() -> None:
    """A refused notice (500) is sent again, with the same Idempotency-Key, until taken."""
    r = Receiver(fail_first=2)
    n = Notifier("x", policy=LOOPBACK)
    t = threading.Thread(target=n.run, daemon=True)
    t.start()
    try:
        n.offer(r.url + "/hook", "j1.7", {"id": "j1", "state": "done"})
        wait_until(lambda: n.numbers()["notify_sent"] == 1, what="the notice taken")
        got = r.of("j1")
        assert [g["failed"] for g in got] == [True, True, False]
        assert {g["headers"]["Idempotency-Key"] for g in got} == {"j1.7"}
        assert n.numbers()["notify_retried"] == 2
    finally:
        n.stop()
        t.join(10)
        r.close()


# --- a real member ---------------------------------------------------------------------------------


def test_notice_delivered_once_per_end(member: Meshd, receiver: Receiver) -> None:
    """The job's final record is POSTed once when it ends, keyed by id and version; a second
    job's notice (sent after by the same single sender) shows none came twice."""
    status, rec = member.request("POST", "/jobs", {"argv": ["true"], "items": ["a", "b"],
                                                   "notify": receiver.url + "/done?x=1"})
    assert status == 201 and rec["notify"].endswith("/done?x=1"), rec
    first = rec["id"]
    final = member.wait_job(first)
    wait_until(lambda: receiver.of(first), what="the notice")
    r = member.ctl("job", "submit", "--notify", receiver.url + "/second", "--", "true")
    assert r.returncode == 0, r
    second = r.stdout.decode().strip()
    wait_until(lambda: receiver.of(second), what="the second notice")
    got = receiver.of(first)
    assert len(got) == 1, got
    g = got[0]
    assert g["path"] == "/done?x=1" and g["headers"]["Content-Type"] == "application/json"
    assert g["headers"]["Idempotency-Key"] == f"{first}.{final['version']}"
    assert g["body"]["state"] == "done" and g["body"]["items_done"] == 2
    assert g["body"]["items_summary"]["members"] == ["n1"]
    text = member.ctl("job", "status", first).stdout.decode()
    assert f"notify     {receiver.url}/done?x=1" in text


def test_notice_of_a_failed_and_a_cancelled_job(member: Meshd, receiver: Receiver) -> None:
    """Every end is told: failed, and cancelled (before it ran)."""
    status, rec = member.request("POST", "/jobs", {"argv": ["false"],
                                                   "notify": receiver.url + "/f"})
    failed = rec["id"]
    status, rec = member.request("POST", "/jobs", {"argv": ["true"], "hold": True,
                                                   "notify": receiver.url + "/c"})
    held = rec["id"]
    assert member.request("POST", f"/jobs/{held}/cancel")[0] == 200
    wait_until(lambda: receiver.of(failed) and receiver.of(held), what="both notices")
    assert receiver.of(failed)[0]["body"]["state"] == "failed"
    assert receiver.of(held)[0]["body"]["state"] == "cancelled"


def test_notice_retried_when_the_receiver_fails_first(member: Meshd) -> None:
    """The receiver answers 500 first: the member tries again and the notice gets through."""
    r = Receiver(fail_first=1)
    try:
        status, rec = member.request("POST", "/jobs", {"argv": ["true"],
                                                       "notify": r.url + "/retry"})
        jid = rec["id"]
        wait_until(lambda: any(not g["failed"] for g in r.of(jid)), what="the retried notice")
        got = r.of(jid)
        assert [g["failed"] for g in got] == [True, False]
        assert got[0]["headers"]["Idempotency-Key"] == got[1]["headers"]["Idempotency-Key"]
    finally:
        r.close()


@pytest.mark.parametrize("url", ["ftp://x/y", "http://", "http://a b/", "http://u:p@h/",
                                 "http://h/" + "a" * limits.notify_url_chars_max])
def test_member_refuses_bad_notify(member: Meshd, url: str) -> None:
    """A bad URL is refused at submit (400, saying what notify must be); nothing is made."""
    status, body = member.request("POST", "/jobs", {"argv": ["true"], "notify": url})
    assert status == 400 and "notify" in body["error"], body
    r = member.ctl("job", "submit", "--notify", url, "--", "true")
    assert r.returncode != 0 and b"notify" in r.stderr, r


def test_metrics_count_notices(member: Meshd, receiver: Receiver) -> None:
    """/metrics counts the notices the receiver took (and those dropped, retried, given up)."""
    status, rec = member.request("POST", "/jobs", {"argv": ["true"], "notify": receiver.url})
    wait_until(lambda: receiver.of(rec["id"]), what="the notice")
    m = wait_until(lambda: (lambda x: x if x.get("meshjobs_notify_sent_total", 0) >= 1 else None)(
        member.metrics()), what="the counter")
    assert "meshjobs_notify_dropped_total" in m and "meshjobs_notify_given_up_total" in m


def test_an_oversized_record_is_cut_to_valid_json() -> None:
    """A record over notify_body_bytes_max drops argv and env (then more), and stays JSON."""
    from meshjobs.notify import _body

    big = {"id": "j", "state": "done", "version": 3, "finished_at": 1.0,
           "argv": ["x" * limits.notify_body_bytes_max], "env": {}, "tags": []}
    out = json.loads(_body(big))
    assert out["truncated"] is True and "argv" not in out and out["id"] == "j"
    huge = {**big, "tags": ["t" * limits.notify_body_bytes_max]}
    out = json.loads(_body(huge))
    assert out == {"id": "j", "state": "done", "version": 3, "finished_at": 1.0, "truncated": True}
    small = {"id": "j", "state": "done"}
    assert json.loads(_body(small)) == small
