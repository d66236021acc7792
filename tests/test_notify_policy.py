"""Where finish notices may go, and one slow receiver delaying none (issue 25, point 6).

`--notify` is a POST from the leader: by default it goes only to public addresses, in any
spelling of the address, checked at submit for literals and at each send for names (the
connection goes to the address checked); `[notify] allow` lets an operator allow CIDRs and
names. Senders take destinations in turn, a few at a time each, so that a tarpit delays no
other receiver. Receivers and the tarpit are small servers of the test on 127.0.0.1: the part
under test is the member's sender.
"""

from __future__ import annotations

import http.server
import ipaddress
import json
import os
import selectors
import socket
import threading
from typing import Any

import pytest

from meshjobs import hookaddr, limits
from meshjobs.hookaddr import NotifyPolicy
from meshjobs.notify import Notifier
from tests.helpers import Meshd, make_cert, member_config, running, wait_until

# --- spellings of addresses the member itself, its network or its cloud can reach -------------

REFUSED_LITERALS = [
    "http://127.0.0.1/", "http://127.0.0.1./", "http://2130706433/", "http://0x7f000001/",
    "http://0x7F.0.0.1/", "http://127.1/", "http://0177.0.0.1/", "http://017700000001/",
    "http://[::1]/", "http://[::ffff:127.0.0.1]/", "http://[::ffff:7f00:1]:8080/",
    "http://[::127.0.0.1]/", "http://[2002:7f00:1::]/", "http://[64:ff9b::a9fe:a9fe]/",
    "http://0/", "http://0.0.0.0:80/", "http://[::]/", "http://169.254.169.254/latest/meta-data",
    "http://[fe80::1%25eth0]/", "http://10.1.2.3/", "http://172.16.0.1/", "http://192.168.1.1/",
    "http://[fd00::1]/", "http://[fc00::5]/", "http://224.0.0.1/", "http://[ff02::1]/",
    "http://240.0.0.1/", "http://255.255.255.255/", "http://100.64.0.1/",
    "https://127.0.0.1:8443/hook", "HTTP://127.0.0.1/",
]
PUBLIC = ["http://93.184.216.34/", "https://[2606:4700::1111]/h", "http://hooks.example.org/",
          "http://localhost/", "http://[::ffff:93.184.216.34]/"]


@pytest.mark.parametrize("url", REFUSED_LITERALS)
def test_every_spelling_of_a_private_address_is_refused(url: str) -> None:
    """Rule 1 of hookaddr: an address is judged by what it is, however it is written."""
    why = NotifyPolicy().refusal_at_submit(url)
    assert why is not None and '[notify] allow = ["' in why, (url, why)


@pytest.mark.parametrize("url", PUBLIC)
def test_public_addresses_and_names_pass_at_submit(url: str) -> None:
    """Public literals pass; a name (even localhost) is judged at send, not at submit."""
    assert NotifyPolicy().refusal_at_submit(url) is None


def test_allow_takes_cidrs_and_names() -> None:
    """Rule 3: an allowed CIDR covers its addresses (and their IPv4-mapped forms); an allowed
    name passes whatever it resolves to; nothing else is widened."""
    p = NotifyPolicy.parse(["10.1.2.0/24", "hooks.internal", "fd00::/8", "127.0.0.1/32"])
    assert p.refusal_at_submit("http://10.1.2.9/") is None
    assert p.refusal_at_submit("http://[::ffff:10.1.2.9]/") is None
    assert p.refusal_at_submit("http://10.1.3.9/") is not None
    assert p.refusal_at_submit("http://127.1/") is None
    assert p.refusal_at_submit("http://127.0.0.2/") is not None
    assert p.address_refusal("hooks.internal", ipaddress.ip_address("10.9.9.9")) is None
    assert p.address_refusal("other.internal", ipaddress.ip_address("10.9.9.9")) is not None


@pytest.mark.parametrize("entry", ["", "a b", "127.1", "10.0.0.0/33", "-x-.org", "x" * 300, 5,
                                   None, "http://hooks.internal/", "hooks.internal/24"])
def test_bad_allow_entries_are_refused(entry: Any) -> None:
    with pytest.raises(ValueError):
        hookaddr.parse_allow_entry(entry)


def test_config_refuses_bad_allow_lists(tmp_path) -> None:
    """[notify] allow in the file: each bad entry named; a list too long refused."""
    from meshjobs.config import ConfigError, load_config

    for text, words in (('allow = ["127.1"]', "127.0.0.1/32"), ("allow = 5", "a list"),
                        ('allow = ["a b"]', "not a CIDR"), ("other = 1", "unknown key"),
                        ("allow = [" + ", ".join(['"10.0.0.0/8"'] * (limits.notify_allow_max + 1))
                         + "]", "notify_allow_max")):
        path = tmp_path / "m.toml"
        path.write_text(f'name = "m"\n[notify]\n{text}\n')
        with pytest.raises(ConfigError, match=words):
            load_config(str(path))
    path.write_text('name = "m"\n[notify]\nallow = ["10.1.2.0/24", "hooks.internal"]\n')
    assert load_config(str(path)).notify_allow == ("10.1.2.0/24", "hooks.internal")


# --- the sender, with a resolver of the test's ----------------------------------------------


class Receiver:
    """An HTTP server on 127.0.0.1 that records every POST and answers `status`."""

    def __init__(self, status: int = 204, location: str | None = None) -> None:
        self.got: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                with outer.lock:
                    outer.got.append({"path": self.path, "headers": dict(self.headers),
                                      "body": json.loads(body)})
                self.send_response(status)
                if location:
                    self.send_header("Location", location)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.port}"

    def of(self, job_id: str) -> list[dict]:
        with self.lock:
            return [g for g in self.got if g["body"].get("id") == job_id]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class Tarpit:
    """Accepts connections, reads what comes, never answers; counts connections open now."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.accepted = 0
        self.open = 0
        self._stop = False
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        sel = selectors.DefaultSelector()
        sel.register(self.sock, selectors.EVENT_READ)
        while not self._stop:
            for key, _ in sel.select(0.1):
                if key.fileobj is self.sock:
                    conn, _ = self.sock.accept()
                    sel.register(conn, selectors.EVENT_READ)
                    self.accepted += 1
                    self.open += 1
                    continue
                try:
                    data = key.fileobj.recv(65536)
                except OSError:
                    data = b""
                if not data:
                    sel.unregister(key.fileobj)
                    key.fileobj.close()
                    self.open -= 1
        for key in list(sel.get_map().values()):
            key.fileobj.close()

    def close(self) -> None:
        self._stop = True
        self.thread.join(5)


@pytest.fixture
def receiver():
    r = Receiver()
    yield r
    r.close()


def sender(n: Notifier) -> list[threading.Thread]:
    threads = [threading.Thread(target=n.run, daemon=True) for _ in range(limits.notify_senders_max)]
    for t in threads:
        t.start()
    return threads


def stop(n: Notifier, threads: list[threading.Thread]) -> None:
    n.stop()
    for t in threads:
        t.join(limits.notify_send_timeout_s + 5)


def test_a_name_is_checked_at_send_and_the_checked_address_is_used(receiver) -> None:
    """Rule 1 of notify: the host is resolved once per send, every address checked, and the
    connection goes to that address with the URL's own Host."""
    asked: list[str] = []

    def resolve(host: str, port: int) -> list[str]:
        asked.append(host)
        return ["127.0.0.1"]

    n = Notifier("x", policy=NotifyPolicy.parse(["hooks.test"]), resolve=resolve)
    threads = sender(n)
    try:
        n.offer(f"http://hooks.test:{receiver.port}/h?a=1", "j1.1", {"id": "j1"})
        wait_until(lambda: receiver.of("j1"), what="the notice")
        got = receiver.of("j1")[0]
        assert got["headers"]["Host"] == f"hooks.test:{receiver.port}" and got["path"] == "/h?a=1"
        assert asked == ["hooks.test"]
    finally:
        stop(n, threads)


def test_a_name_with_any_refused_address_is_refused_and_not_retried(receiver) -> None:
    """DNS rebinding: one public and one loopback address is refused, counted, not retried;
    nothing reaches the receiver."""
    n = Notifier("x", resolve=lambda host, port: ["93.184.216.34", "127.0.0.1"])
    threads = sender(n)
    try:
        n.offer(f"http://rebind.test:{receiver.port}/", "j2.1", {"id": "j2"})
        wait_until(lambda: n.numbers()["notify_refused"] == 1, what="the refusal")
        wait_until(lambda: n.held() == 0, what="the notice let go")
        assert n.numbers()["notify_retried"] == 0 and receiver.of("j2") == []
    finally:
        stop(n, threads)


def test_https_checks_the_urls_name_on_the_checked_address(tmp_path) -> None:
    """TLS goes to the checked address with the URL's host as server name, and the
    certificate must be that name's: a certificate for another name is refused (retried)."""
    import ssl

    cert, key = make_cert(str(tmp_path), names=("hooks.test",))
    server = Receiver()
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(cert, key)
    server.server.socket = ctx.wrap_socket(server.server.socket, server_side=True)
    client = ssl.create_default_context(cafile=cert)
    names = {"hooks.test": ["127.0.0.1"], "other.test": ["127.0.0.1"]}
    n = Notifier("x", policy=NotifyPolicy.parse(["127.0.0.1/32"]),
                 resolve=lambda host, port: names[host], tls=client)
    threads = sender(n)
    try:
        n.offer(f"https://hooks.test:{server.port}/t", "t1.1", {"id": "t1"})
        wait_until(lambda: server.of("t1"), what="the notice over TLS")
        assert server.of("t1")[0]["headers"]["Host"] == f"hooks.test:{server.port}"
        n.offer(f"https://other.test:{server.port}/t", "t2.1", {"id": "t2"})
        wait_until(lambda: n.numbers()["notify_retried"] >= 1, what="the wrong name refused")
        assert server.of("t2") == []
    finally:
        stop(n, threads)
        server.close()


def test_a_redirect_is_not_followed(receiver) -> None:
    """A 302 to another receiver is a refusal: retried to the same URL, never followed."""
    bouncer = Receiver(status=302, location=receiver.url + "/elsewhere")
    n = Notifier("x", policy=NotifyPolicy.parse(["127.0.0.1/32"]))
    threads = sender(n)
    try:
        n.offer(bouncer.url + "/r", "j3.1", {"id": "j3"})
        wait_until(lambda: n.numbers()["notify_retried"] >= 1, what="a retry")
        assert receiver.of("j3") == [] and len(bouncer.of("j3")) >= 1
    finally:
        stop(n, threads)
        bouncer.close()


def test_a_tarpit_does_not_hold_up_another_receiver(receiver) -> None:
    """Rule 2: notices to a tarpit take at most notify_inflight_per_dest_max senders; a notice
    to another receiver offered after them arrives while the tarpit still holds its
    connections, and every tarpit send is cut off within the send timeout."""
    pit = Tarpit()
    n = Notifier("x", policy=NotifyPolicy.parse(["127.0.0.1/32"]))
    threads = sender(n)
    try:
        for i in range(5):
            n.offer(pit.url + "/slow", f"slow{i}.1", {"id": f"slow{i}"})
        wait_until(lambda: pit.open == limits.notify_inflight_per_dest_max, what="the pit holds")
        n.offer(receiver.url + "/fast", "fast.1", {"id": "fast"})
        wait_until(lambda: receiver.of("fast"), what="the fast notice")
        assert pit.open >= 1, "the fast notice waited for the tarpit"
        assert pit.accepted == limits.notify_inflight_per_dest_max
        wait_until(lambda: n.numbers()["notify_retried"] >= 1,
                   timeout_s=3 * limits.notify_send_timeout_s, what="a tarpit send cut off")
    finally:
        stop(n, threads)
        pit.close()


# --- real members ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def allowing(tmp_path_factory):
    """A member whose operator allows notices to 127.0.0.1 (the test's receivers)."""
    top = str(tmp_path_factory.mktemp("allowing"))
    cfg = member_config(top, "na", '[pools.default]\nslots = 4\n[notify]\nallow = ["127.0.0.1/32"]\n')
    yield from running(Meshd(os.path.join(top, "na"), name="na", config=cfg))


@pytest.fixture(scope="module")
def default(tmp_path_factory):
    """A member with no [notify] table: notices go to public addresses only."""
    top = str(tmp_path_factory.mktemp("default"))
    cfg = member_config(top, "nd", "[pools.default]\nslots = 2\n")
    yield from running(Meshd(os.path.join(top, "nd"), name="nd", config=cfg))


@pytest.mark.parametrize("url", REFUSED_LITERALS + ["http://a@127.0.0.1/", "http://a:b@[::1]/"])
def test_member_refuses_private_literals_at_submit(default: Meshd, url: str) -> None:
    """A private literal in any spelling (or with a user part) is a 400 at submit that says
    how to allow it; no job is made."""
    status, body = default.request("POST", "/jobs", {"argv": ["true"], "notify": url})
    assert status == 400 and "notify" in body["error"], body
    assert "[notify] allow" in body["error"] or "no user or password" in body["error"], body


def test_member_refuses_private_literals_in_a_schedule(default: Meshd) -> None:
    status, body = default.request("PUT", "/cron/hook", {
        "spec": "@yearly", "job": {"argv": ["true"], "notify": "http://169.254.169.254/"}})
    assert status == 400 and "[notify] allow" in body["error"], body
    assert default.request("GET", "/cron/hook")[0] == 404


def test_member_refuses_localhost_at_send(default: Meshd, receiver: Receiver) -> None:
    """A name that resolves to loopback passes the submit, but its notice is refused at the
    send: counted and logged once, not retried, and nothing reaches the receiver."""
    status, rec = default.request("POST", "/jobs", {
        "argv": ["true"], "notify": f"http://localhost:{receiver.port}/hook"})
    assert status == 201, rec
    default.wait_job(rec["id"])
    m = wait_until(lambda: (lambda x: x if x.get("meshjobs_notify_refused_total", 0) >= 1
                            else None)(default.metrics()), what="the refusal counted")
    assert m.get("meshjobs_notify_retried_total", 0) == 0
    assert receiver.got == []
    key = f"{rec['id']}."
    lines = [ln for ln in default.log_tail(10_000_000).splitlines()
             if "notify_refused" in ln and key in ln]
    assert len(lines) == 1 and "loopback" in lines[0], lines
    assert f"localhost:{receiver.port}/hook" not in lines[0]  # the URL itself is not logged


def test_allowed_cidr_delivers(allowing: Meshd, receiver: Receiver) -> None:
    """The operator's [notify] allow = ["127.0.0.1/32"] lets a literal and localhost pass."""
    for url in (receiver.url + "/a", f"http://localhost:{receiver.port}/b"):
        status, rec = allowing.request("POST", "/jobs", {"argv": ["true"], "notify": url})
        assert status == 201, rec
        wait_until(lambda r=rec: receiver.of(r["id"]), what="the notice")


def test_member_tarpit_does_not_hold_up_a_fast_receiver(allowing: Meshd, receiver: Receiver) -> None:
    """Three jobs notify a tarpit, a fourth a fast receiver: its notice arrives while the
    tarpit still holds the member's connections."""
    pit = Tarpit()
    try:
        for i in range(3):
            status, rec = allowing.request("POST", "/jobs", {"argv": ["true"],
                                                             "notify": pit.url + f"/slow{i}"})
            assert status == 201, rec
        wait_until(lambda: pit.open >= limits.notify_inflight_per_dest_max, what="the pit holds")
        status, rec = allowing.request("POST", "/jobs", {"argv": ["true"],
                                                         "notify": receiver.url + "/fast"})
        assert status == 201, rec
        wait_until(lambda: receiver.of(rec["id"]), what="the fast notice")
        assert pit.open >= 1, "the fast notice waited for the tarpit"
    finally:
        pit.close()
