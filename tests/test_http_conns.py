"""HTTP connections are shed (meshjobs/httpconn.py, meshjobs/connbook.py), tested from outside.

Real meshd processes, some under a file descriptor limit of 1,024 (prlimit), flooded with
connections that never finish their request heads; and the pure book's rules one by one.
"""

from __future__ import annotations

import errno
import http.client
import json
import os
import socket
import ssl
import subprocess
import threading
import time
import urllib.parse

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshjobs import limits
from meshjobs.connbook import ConnBook, LogBudget, conns_limit
from tests.helpers import (
    WAIT_S_MAX,
    Meshd,
    close_all,
    flood,
    limit_fds,
    member_config,
    wait_closed,
    wait_until,
)

PARTIAL_HEAD = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: "
LOG_BYTES_MAX = 1 << 20  # a member's whole log during a flood stays under this


# --- helpers --------------------------------------------------------------------------------


def host_port(m: Meshd) -> tuple[str, int]:
    u = urllib.parse.urlsplit(m.url)
    return u.hostname or "127.0.0.1", u.port or 80


def healthz(m: Meshd, timeout_s: float = WAIT_S_MAX) -> int:
    """GET /healthz until it is answered (connections refused or cut are tried again)."""
    host, port = host_port(m)
    deadline = time.monotonic() + timeout_s
    last: Exception | None = None
    while time.monotonic() < deadline:
        conn = http.client.HTTPConnection(host, port, timeout=max(0.5, deadline - time.monotonic()))
        try:
            conn.request("GET", "/healthz")
            resp = conn.getresponse()
            resp.read()
            return resp.status
        except (OSError, http.client.HTTPException) as e:
            last = e
        finally:
            conn.close()
    raise AssertionError(f"/healthz not answered within {timeout_s} s: {last!r}")


def log_bytes(m: Meshd) -> int:
    return os.path.getsize(m.log_path)


def start_member(tmp_path, name: str, http_table: str, nofile: int | None = None) -> Meshd:
    cfg = member_config(str(tmp_path), name, "[http]\n" + http_table)
    m = Meshd(os.path.join(str(tmp_path), name), name=name, config=cfg)
    if nofile is not None:
        limit_fds(m, nofile)
    return m


@pytest.fixture
def members():
    started: list[Meshd] = []
    yield started
    for m in started:
        m.stop()


def read_response(s: socket.socket, timeout_s: float = WAIT_S_MAX) -> bytes:
    """One HTTP/1.1 answer with a Content-Length, read off a raw socket."""
    s.settimeout(timeout_s)
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = s.recv(65536)
        assert chunk, f"closed before an answer: {buf!r}"
        buf += chunk
    head, _, body = buf.partition(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n")[1:]:
        k, _, v = line.partition(b":")
        if k.strip().lower() == b"content-length":
            length = int(v)
    while len(body) < length:
        chunk = s.recv(65536)
        assert chunk
        body += chunk
    return head


# --- a flood against a member at 1,024 file descriptors ------------------------------------


@pytest.mark.fleet
def test_flood_of_silent_connections_at_fd_limit(tmp_path, members) -> None:
    """1,100 connections left mid-head against a member at a 1,024 fd limit: /healthz keeps
    answering, the server closes them all (header timeout, or room for newcomers), the log
    stays small, and new clients are served after the flood."""
    m = start_member(tmp_path, "m1", "header_timeout_s = 1\nidle_timeout_s = 60\n", nofile=1024)
    members.append(m)
    m.start()
    before = log_bytes(m)
    socks = flood(host_port(m), 1100, PARTIAL_HEAD)
    try:
        assert len(socks) > 900, len(socks)
        assert healthz(m) == 200
        # Every flood connection is closed by the server: evicted for newcomers, or its head
        # overdue after 1 s; not after the 60 s idle timeout, the wait here is shorter.
        assert wait_closed(socks) == len(socks)
    finally:
        close_all(socks)
    for _ in range(20):
        assert healthz(m, timeout_s=5) == 200
    metrics = m.metrics()
    assert metrics["meshjobs_http_conns_max"] == conns_limit(1024, None) == 768
    shed = sum(v for k, v in metrics.items() if k.startswith("meshjobs_http_conns_shed_total"))
    assert metrics['meshjobs_http_conns_shed_total{reason="header_timeout"}'] > 0
    assert shed >= len(socks) - 1, metrics
    assert log_bytes(m) - before < LOG_BYTES_MAX
    # A kept-alive connection that begins its next head and stalls is closed after the header
    # timeout (1 s), well before the idle timeout (60 s) that would close it if it sent nothing.
    s = socket.create_connection(host_port(m), timeout=WAIT_S_MAX)
    try:
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert b" 200 " in read_response(s).split(b"\r\n")[0]
        s.sendall(PARTIAL_HEAD)
        assert wait_closed([s], timeout_s=15) == 1
    finally:
        s.close()


@pytest.mark.fleet
def test_flood_past_the_fd_limit_keeps_log_small(tmp_path, members) -> None:
    """A member told to allow more connections than its fds (conns_max 5,000 at a 1,024 limit)
    runs out of fds under a flood: accept fails with EMFILE. It backs off instead of spinning,
    closes the connections that wait longest, logs a bounded number of lines, and answers."""
    m = start_member(tmp_path, "m1", "conns_max = 5000\nheader_timeout_s = 5\nidle_timeout_s = 60\n",
                     nofile=1024)
    members.append(m)
    m.start()
    before = log_bytes(m)
    socks = flood(host_port(m), 1100, PARTIAL_HEAD)
    try:
        assert healthz(m) == 200
        assert wait_closed(socks) == len(socks)
    finally:
        close_all(socks)
    assert healthz(m, timeout_s=5) == 200
    metrics = m.metrics()
    assert metrics["meshjobs_http_accept_errors_total"] > 0, "the flood never reached the fd limit"
    assert log_bytes(m) - before < LOG_BYTES_MAX, m.log_tail()
    with open(m.log_path, "rb") as f:
        text = f.read().decode(errors="replace")
    assert "socket.accept() out of system resource" not in text
    assert text.count("http_accept_failed") <= 2 * limits.http_log_records_max * (1 + WAIT_S_MAX / limits.http_log_window_s)


# --- long requests are not cut; idle ones are ---------------------------------------------


@pytest.mark.fleet
def test_long_poll_and_slow_download_outlive_the_timeouts(tmp_path, members) -> None:
    """A 5 s long-poll and a download stalled by its reader both outlast the header and idle
    timeouts (1 s each): a request in progress is never cut; an idle kept-alive connection is
    closed once idle_timeout_s passed."""
    m = start_member(tmp_path, "m1", "header_timeout_s = 1\nidle_timeout_s = 2\n")
    members.append(m)
    m.start()
    status, job = m.request("POST", "/jobs", {"argv": ["sleep", "60"]})
    assert status == 201, job
    status, big = m.request("POST", "/jobs", {"argv": ["head", "-c", str(16 << 20), "/dev/zero"]})
    assert status == 201, big
    assert m.wait_job(big["id"])["state"] == "done"

    answer: dict = {}

    def long_poll() -> None:
        answer["status"], answer["body"] = m.request("GET", f"/jobs/{job['id']}?wait=5", timeout_s=20)

    poller = threading.Thread(target=long_poll)
    poller.start()
    # A download whose reader stops after the first bytes: the server is mid-answer.
    dl = socket.create_connection(host_port(m), timeout=WAIT_S_MAX)
    dl.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
    dl.sendall(f"GET /jobs/{big['id']}/results HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode())
    got = dl.recv(65536)
    assert got.startswith(b"HTTP/1.1 200"), got[:200]
    # An idle kept-alive connection, opened now: once the server closes it, the idle timeout
    # has passed for the download and the long-poll too.
    idle = socket.create_connection(host_port(m), timeout=WAIT_S_MAX)
    try:
        idle.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        read_response(idle)
        t0 = time.monotonic()
        assert wait_closed([idle], timeout_s=15) == 1
        # Closed for being idle (2 s), not by the header timeout (1 s).
        assert time.monotonic() - t0 > 2 - 0.5
    finally:
        idle.close()
    poller.join(WAIT_S_MAX)
    assert not poller.is_alive()
    assert answer["status"] == 200 and answer["body"]["id"] == job["id"], answer
    # The stalled download goes on to its end.
    head, _, body = got.partition(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length"))
    assert length == 16 << 20
    received = len(body)
    dl.settimeout(WAIT_S_MAX)
    while received < length:
        chunk = dl.recv(1 << 20)
        assert chunk, f"the download was cut at {received} of {length} bytes"
        received += len(chunk)
    dl.close()


# --- the edge in process: room for newcomers, refusal when all are busy, hostile heads -----


class InProcess:
    """HttpApi on a real socket in this process, in front of the recording control port of
    tests/test_http.py (a stand-in for the jobs thread; the connection handling is under test)."""

    def __init__(self, **kw) -> None:
        from blobstore import MemoryBlobStore
        from meshjobs import http as mhttp
        from tests.helpers import RecordingControl

        self.control = RecordingControl()
        self.api = mhttp.HttpApi("127.0.0.1", 0, self.control, MemoryBlobStore(), "m1", **kw)
        ready = threading.Event()
        self.thread = threading.Thread(target=self.api.run, args=(ready,), daemon=True)
        self.thread.start()
        assert ready.wait(10) and self.api.error is None
        self.addr = ("127.0.0.1", self.api.bound_port)

    def get(self, path: str, timeout_s: float = WAIT_S_MAX) -> int:
        conn = http.client.HTTPConnection(*self.addr, timeout=timeout_s)
        try:
            conn.request("GET", path)
            resp = conn.getresponse()
            resp.read()
            return resp.status
        finally:
            conn.close()

    def stop(self) -> None:
        self.api.stop()
        self.thread.join(10)


def test_at_the_limit_the_least_recently_heard_makes_room() -> None:
    """Rule 3 from outside: with conns_max 3 and three silent connections, a fourth client is
    served, and the oldest silent connection is the one closed for it."""
    srv = InProcess(conns_max=3, header_timeout_s=60, idle_timeout_s=60)
    gate = srv.api._gate
    silent: list[socket.socket] = []

    def add_silent() -> None:
        silent.append(socket.create_connection(srv.addr, timeout=WAIT_S_MAX))
        n = len(silent)
        wait_until(lambda: gate.accepted >= n + served)

    served = 0
    try:
        for _ in range(3):
            add_silent()
        assert srv.get("/healthz") == 200
        served += 1
        assert wait_closed(silent[:1], timeout_s=10) == 1
        assert gate.shed["evicted"] == 1
        wait_until(lambda: gate.open_conns == 2)  # the healthz connection is gone
        add_silent()  # full again: silent 1, 2, 3
        assert srv.get("/healthz") == 200
        assert wait_closed(silent[1:2], timeout_s=10) == 1  # the next oldest goes next
        assert gate.shed["evicted"] == 2
        for s in silent[2:]:
            s.setblocking(False)
            with pytest.raises(BlockingIOError):
                s.recv(1)  # the younger ones are still open
    finally:
        close_all(silent)
        srv.stop()


def test_when_every_connection_is_busy_a_newcomer_is_closed_at_once() -> None:
    """Rule 2 and 3: long-polls in progress are never closed for room; a newcomer is."""
    srv = InProcess(conns_max=2, header_timeout_s=60, idle_timeout_s=60)
    srv.control.hang.add("get")
    polls = []
    try:
        for _ in range(2):
            s = socket.create_connection(srv.addr, timeout=WAIT_S_MAX)
            s.sendall(b"GET /jobs/j1?wait=60 HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            polls.append(s)
        wait_until(lambda: len(srv.control.requests) == 2)
        late = socket.create_connection(srv.addr, timeout=WAIT_S_MAX)
        late.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert wait_closed([late], timeout_s=10) == 1
        late.close()
        assert srv.api._gate.shed["limit"] >= 1
        assert srv.api._gate.shed["evicted"] == 0
        for s in polls:
            s.setblocking(False)
            with pytest.raises(BlockingIOError):
                s.recv(1)  # still open, still waiting for its answer
    finally:
        close_all(polls)
        srv.stop()


@pytest.mark.parametrize("garbage", [
    b"\x00\xff" * 512,  # binary, no line end
    b"GET / HTTP/1.1\r\n" + b"X: " + b"a" * 100_000,  # one header line past aiohttp's limit
    b"GET / HTTP/1.1\r\n" + b"X-A: b\r\n" * 10_000,  # more header lines than allowed, no end
    b"\r\n" * 10 + b"GE",  # blank lines, then a method cut short
])
def test_hostile_heads_are_closed(garbage: bytes) -> None:
    """A head that is garbage, oversized or never finished is answered 400 or closed by the
    header timeout; the server goes on answering others."""
    srv = InProcess(header_timeout_s=1, idle_timeout_s=1)
    try:
        s = socket.create_connection(srv.addr, timeout=WAIT_S_MAX)
        try:
            s.sendall(garbage)
        except OSError:
            pass  # Closed while we were still sending: that is what we want.
        assert wait_closed([s], timeout_s=15) == 1
        s.close()
        assert srv.get("/healthz") == 200
    finally:
        srv.stop()


# --- TLS: the handshake is bounded by the header timeout ----------------------------------


def _self_signed(tmp_path) -> tuple[str, str]:
    cert, key = str(tmp_path / "cert.pem"), str(tmp_path / "key.pem")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", key,
                    "-out", cert, "-days", "2", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True, timeout=60)
    return cert, key


def test_tls_handshake_never_started_is_closed(tmp_path) -> None:
    """HTTPS: a connection that never starts its TLS handshake is closed after header_timeout_s,
    and a real HTTPS client is answered."""
    from meshjobs import http as mhttp
    from tests.helpers import RecordingControl

    if not os.path.exists("/usr/bin/openssl"):
        pytest.skip("openssl is not installed")
    from blobstore import MemoryBlobStore

    cert, key = _self_signed(tmp_path)
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(cert, key)
    api = mhttp.HttpApi("127.0.0.1", 0, RecordingControl(), MemoryBlobStore(), "m1", tls=ctx,
                        header_timeout_s=1, idle_timeout_s=1)
    ready = threading.Event()
    t = threading.Thread(target=api.run, args=(ready,), daemon=True)
    t.start()
    try:
        assert ready.wait(10) and api.error is None
        silent = socket.create_connection(("127.0.0.1", api.bound_port), timeout=WAIT_S_MAX)
        try:
            assert wait_closed([silent], timeout_s=15) == 1
        finally:
            silent.close()
        client = ssl.create_default_context(cafile=cert)
        conn = http.client.HTTPSConnection("127.0.0.1", api.bound_port, context=client,
                                           timeout=WAIT_S_MAX)
        conn.request("GET", "/healthz")
        resp = conn.getresponse()
        assert resp.status == 200 and json.loads(resp.read())["ok"] is True
        conn.close()
    finally:
        api.stop()
        t.join(10)


# --- the pure book ---------------------------------------------------------------------------


@pytest.mark.parametrize("soft,conns_max,want", [
    (1024, None, 768),  # a quarter reserved is 256
    (65536, None, 49152),  # a quarter reserved
    (512, None, 256),  # 256 reserved
    (100, None, limits.http_conns_min),  # never below the minimum
    (10_000_000, None, limits.http_conns_max),  # never above the maximum
    (-1, None, limits.http_conns_max),  # RLIM_INFINITY
    (None, None, limits.http_conns_max),
    (1024, 5000, 5000),  # the config wins, even past the fd limit
])
def test_conns_limit(soft, conns_max, want) -> None:
    """The default connection limit leaves a quarter of the fds (at least 256) to the rest."""
    assert conns_limit(soft, conns_max) == want


@pytest.mark.parametrize("bad", [0, -1, limits.http_conns_max + 1])
def test_conns_limit_refuses_out_of_range(bad) -> None:
    """A conns_max out of range is a programming error here (the config checks it first)."""
    with pytest.raises(ValueError):
        conns_limit(1024, bad)


def test_head_due_from_opening_then_from_first_byte_after_an_answer() -> None:
    """Rule 1: a head is owed header_s after opening; after an answer, header_s after the next
    request's first byte; nothing is owed while idle between requests."""
    book: ConnBook[str] = ConnBook(cap=4, header_s=2.0)
    book.opened("a", 10.0)
    assert book.deadline("a") == 12.0
    book.received("a", 10.5, head_done=False, waiting=True)  # part of a head
    assert book.deadline("a") == 12.0
    assert not book.overdue("a", 11.9, waiting=True)
    book.received("a", 11.0, head_done=True, waiting=False)  # the head is complete
    assert book.deadline("a") is None
    assert not book.overdue("a", 100.0, waiting=True)  # idle after an answer: none owed
    book.received("a", 50.0, head_done=False, waiting=True)  # next request's first byte
    assert book.deadline("a") == 52.0
    assert book.overdue("a", 52.0, waiting=True)
    assert "a" not in book


def test_busy_connection_is_never_overdue_nor_a_victim() -> None:
    """Rule 2: a request in progress (body bytes, a long-poll) is never closed here."""
    book: ConnBook[str] = ConnBook(cap=1, header_s=1.0)
    book.opened("a", 0.0)
    book.received("a", 0.1, head_done=True, waiting=False)
    book.received("a", 0.2, head_done=False, waiting=False)  # body bytes
    assert book.deadline("a") is None
    assert not book.overdue("a", 1e9, waiting=False)
    assert book.make_room(lambda k: False) == (False, [])
    assert "a" in book


def test_found_busy_at_its_deadline_owes_nothing() -> None:
    """Rule 2: a connection whose head came (the handler is busy) is not closed at the old deadline."""
    book: ConnBook[str] = ConnBook(cap=2, header_s=1.0)
    book.opened("a", 0.0)
    assert not book.overdue("a", 5.0, waiting=False)
    assert book.deadline("a") is None


def test_room_goes_to_newcomer_by_closing_least_recently_heard() -> None:
    """Rule 3: at capacity, the waiting connection heard from least recently makes room;
    busy ones are skipped and moved back."""
    book: ConnBook[str] = ConnBook(cap=3, header_s=1.0)
    for i, k in enumerate("abc"):
        book.opened(k, float(i))
    book.received("a", 5.0, head_done=False, waiting=True)  # a spoke last
    busy = {"b"}
    ok, victims = book.make_room(lambda k: k not in busy)
    assert ok and victims == ["c"]
    assert "c" not in book and len(book) == 2
    book.opened("d", 6.0)
    ok, victims = book.make_room(lambda k: k not in busy)
    assert ok and victims == ["a"]
    book.closed("a")  # the edge's close of a victim is a no-op (Rule 4)
    assert len(book) == 2


def test_victims_look_at_a_bounded_number() -> None:
    """Rule 3: the search for room looks at no more than scan_max + n connections."""
    book: ConnBook[int] = ConnBook(cap=1000, header_s=1.0, scan_max=5)
    for k in range(1000):
        book.opened(k, 0.0)
    looked: list[int] = []

    def waiting(k: int) -> bool:
        looked.append(k)
        return k == 999

    assert book.victims(1, waiting) == []
    assert len(looked) == 6


def test_opened_without_room_is_a_broken_invariant() -> None:
    """The edge must make room before opening: more than cap is our own bug, and crashes."""
    book: ConnBook[str] = ConnBook(cap=1, header_s=1.0)
    book.opened("a", 0.0)
    with pytest.raises(AssertionError):
        book.opened("b", 0.0)
    with pytest.raises(AssertionError):
        book.opened("a", 0.0)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["open", "rx", "head", "body", "check", "close", "room"]),
                          st.integers(0, 9), st.floats(0, 5)), max_size=200))
def test_book_model(ops) -> None:
    """Invariants under any sequence of events: never more than cap; a busy connection is never
    closed by the book; a connection closed for time had its head past due."""
    book: ConnBook[int] = ConnBook(cap=4, header_s=1.0, scan_max=2)
    busy: set[int] = set()
    now = 0.0
    for op, k, dt in ops:
        now += dt
        if op == "open" and k not in book:
            ok, victims = book.make_room(lambda c, b=busy: c not in b)
            assert all(v not in busy for v in victims)
            busy.difference_update(victims)
            if ok:
                book.opened(k, now)
                busy.discard(k)
        elif op == "rx":
            book.received(k, now, head_done=False, waiting=k not in busy)
        elif op == "head" and k in book:
            book.received(k, now, head_done=True, waiting=False)
            busy.add(k)
        elif op == "body" and k in busy:
            busy.discard(k)  # its answer is finished: idle again
        elif op == "check" and k in book:
            due = book.deadline(k)
            if book.overdue(k, now, waiting=k not in busy):
                assert k not in busy and due is not None and now >= due
        elif op == "close":
            book.closed(k)
            busy.discard(k)
        assert len(book) <= 4


def test_log_budget() -> None:
    """At most records_max lines per window; the next line written says how many were left out."""
    b = LogBudget(records_max=2, window_s=10)
    assert [b.admit(0.0) for _ in range(5)] == [(True, 0), (True, 0), (False, 0), (False, 0), (False, 0)]
    assert b.admit(10.0) == (True, 3)
    assert b.admit(10.1) == (True, 0)
    assert b.admit(10.2) == (False, 0)
    assert b.take_left_out() == 1 and b.take_left_out() == 0
    assert b.left_out_total == 4


def test_asyncio_logger_is_on_a_budget() -> None:
    """asyncio's own lines (its accept errors) are bounded per window, with a count after."""
    import logging

    from meshjobs.httpconn import budget_asyncio_log

    f = budget_asyncio_log()
    assert budget_asyncio_log() is f  # installed once
    saved = f.budget  # type: ignore[attr-defined]
    f.budget = LogBudget(records_max=3, window_s=1000)  # type: ignore[attr-defined]
    try:
        rec = [logging.LogRecord("asyncio", logging.ERROR, __file__, 1, "socket.accept() out of "
                                 "system resource", None, None) for _ in range(100)]
        assert sum(f.filter(r) for r in rec) == 3
    finally:
        f.budget = saved  # type: ignore[attr-defined]


def test_gate_logs_accept_errors_within_budget_then_sums_up() -> None:
    """A burst of accept errors writes at most records_max lines, then one line with the count
    of those left out once the window is over."""
    import asyncio

    from meshjobs.httpconn import Gate

    class Log:
        def __init__(self) -> None:
            self.lines: list[tuple[str, dict]] = []

        def warning(self, event: str, **fields) -> None:
            self.lines.append((event, fields))

    log = Log()

    async def burst() -> None:
        gate = Gate(lambda: None, "127.0.0.1", 0, conns_max=4, header_s=1.0, log=log)  # type: ignore[arg-type,return-value]
        gate._loop = asyncio.get_running_loop()
        gate._budget = LogBudget(records_max=3, window_s=0.2)
        for _ in range(100):
            gate._accept_failed(OSError(errno.EMFILE, "Too many open files"))
        assert gate.accept_errors == 100
        deadline = time.monotonic() + WAIT_S_MAX
        while len(log.lines) < 4 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)  # until the summary timer (0.2 s) has written its line
        gate.close()

    asyncio.run(burst())
    events = [e for e, _ in log.lines]
    assert events == ["http_accept_failed"] * 3 + ["http_accept_failed_left_out"]
    assert log.lines[-1][1]["count"] == 97


@pytest.mark.fleet
def test_trickled_body_is_cut_at_the_body_timeout(tmp_path, members) -> None:
    """A client that sends a whole head and then only part of its body is answered 408 and its
    connection closed once body_timeout_s passed; nothing is submitted; others are served."""
    m = start_member(tmp_path, "m1", "body_timeout_s = 1\n")
    members.append(m)
    m.start()
    s = socket.create_connection(host_port(m), timeout=WAIT_S_MAX)
    try:
        body = json.dumps({"argv": ["true"], "id": "slow"}).encode()
        s.sendall(b"POST /jobs HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  + f"Content-Length: {len(body)}\r\n\r\n".encode() + body[:5])
        head = read_response(s)
        assert head.startswith(b"HTTP/1.1 408"), head
        assert wait_closed([s]) == 1
    finally:
        s.close()
    assert m.request("GET", "/jobs/slow")[0] == 404
    assert healthz(m) == 200
