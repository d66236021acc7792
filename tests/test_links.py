"""Member links over real TCP on 127.0.0.1: handshake, sealed frames, one connection per peer,
bounded queues, and hostile input on the port."""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from meshjobs import limits
from meshjobs.frames import (
    HEADER,
    MAGIC,
    NONCE_BYTES,
    Frame,
    FrameError,
    FrameType,
    Hello,
    Role,
    Session,
)
from meshjobs.links import Links, wall_ms
from tests.helpers import LINKS_SECRET as SECRET
from tests.helpers import LinksMember as Member
from tests.helpers import wait_until

OTHER = bytes(range(1, 33))
WAIT_S = 15.0



def mesh(*ms: Member) -> None:
    for a in ms:
        for b in ms:
            if a is not b:
                a.links.connect(b.name, b.address)
    for a in ms:
        for b in ms:
            if a is not b:
                wait_until(lambda a=a, b=b: a.up(b.name), what=f"{a.name} -> {b.name} up")


def exchange(a: Member, b: Member, tag: str) -> None:
    """a sends b a frame and back; both arrive."""
    body = {"tag": tag, "from": a.name}
    wait_until(lambda: a.links.send(b.name, FrameType.F_RESULT, body), what="send accepted")
    wait_until(lambda: body in b.got(a.name, FrameType.F_RESULT), what=f"{tag} at {b.name}")
    back = {"tag": tag, "from": b.name}
    wait_until(lambda: b.links.send(a.name, FrameType.F_LEASE, back), what="reply accepted")
    wait_until(lambda: back in a.got(b.name, FrameType.F_LEASE), what=f"{tag} back at {a.name}")


# --- raw sockets speaking (or mangling) the protocol ------------------------------------------

def hello_body(name: str, to: str) -> dict[str, Any]:
    return {"name": name, "boot": "raw", "peer": "127.0.0.1:1", "to": to, "wall_ms": wall_ms()}


def hello(name: str, to: str, secret: bytes = SECRET) -> bytes:
    """A dialler's first frame, from a fresh session."""
    return Session(secret, Role.DIALLER).hello(hello_body(name, to), os.urandom(NONCE_BYTES),
                                               os.urandom(32))


class RawPeer:
    """A raw socket that speaks the handshake itself and keeps every byte it sent."""

    def __init__(self, addr: tuple[str, int], name: str, to: str, secret: bytes = SECRET,
                 rcvbuf: int | None = None) -> None:
        self.sock = raw(addr, rcvbuf)
        self.session = Session(secret, Role.DIALLER)
        self.name, self.to = name, to
        self.sent: list[bytes] = []

    def send(self, data: bytes) -> None:
        self.sent.append(data)
        self.sock.sendall(data)

    def event(self) -> Any:
        """The next event from the other end (blocking)."""
        while (ev := self.session.next_event()) is None:
            data = self.sock.recv(min(self.session.room(), 1 << 20))
            assert data, "the member closed the connection"
            self.session.receive_data(data)
        return ev

    def handshake(self) -> dict[str, Any]:
        self.send(self.session.hello(hello_body(self.name, self.to), os.urandom(NONCE_BYTES),
                                     os.urandom(32)))
        ev = self.event()
        assert isinstance(ev, Hello)
        self.send(self.session.proof())
        return ev.body

    def close(self) -> None:
        self.sock.close()


class Hangup:
    """A port that accepts a dial and hangs up at once (so a link to it never comes up) and
    counts the dials: a peer that cannot be reached, whose redials a test can wait for."""

    def __init__(self, port: int = 0) -> None:
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", port))
        self.sock.listen(16)
        self.sock.setblocking(False)
        self.address: tuple[str, int] = self.sock.getsockname()
        self._dials = 0

    def dials(self) -> int:
        while True:
            try:
                conn, _ = self.sock.accept()
            except BlockingIOError:
                return self._dials
            conn.close()
            self._dials += 1

    def close(self) -> None:
        self.sock.close()


class LogRecorder:
    """Collects what Links logs (event name and fields), as a structlog logger would get it."""

    def __init__(self) -> None:
        self.records: list[tuple[str, str, dict[str, Any]]] = []
        self._mu = threading.Lock()

    def __getattr__(self, level: str) -> Callable[..., None]:
        def record(event: str, **kw: Any) -> None:
            with self._mu:
                self.records.append((level, event, kw))
        return record

    def find(self, event: str, **match: Any) -> list[dict[str, Any]]:
        with self._mu:
            return [kw for _, e, kw in self.records
                    if e == event and all(kw.get(k) == v for k, v in match.items())]


class Proxy:
    """A TCP proxy in front of a member that records every byte both ways and can flip one bit
    of the next chunk going up (towards the member)."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address: tuple[str, int] = self.listener.getsockname()[:2]
        self.seen = {"up": bytearray(), "down": bytearray()}
        self.flip_up = threading.Event()
        self._mu = threading.Lock()
        self._socks: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                c, _ = self.listener.accept()
                s = socket.create_connection(self.target)
            except OSError:
                return
            with self._mu:
                self._socks += [c, s]
            threading.Thread(target=self._pump, args=(c, s, "up"), daemon=True).start()
            threading.Thread(target=self._pump, args=(s, c, "down"), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, way: str) -> None:
        while True:
            try:
                data = src.recv(65536)
            except OSError:
                data = b""
            if not data:
                for x in (src, dst):
                    try:
                        x.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass
                return
            if way == "up" and self.flip_up.is_set():
                self.flip_up.clear()
                data = data[:-1] + bytes([data[-1] ^ 0x01])
            with self._mu:
                self.seen[way] += data
            try:
                dst.sendall(data)
            except OSError:
                return

    def captured(self) -> bytes:
        with self._mu:
            return bytes(self.seen["up"] + self.seen["down"])

    def close(self) -> None:
        self.listener.close()
        with self._mu:
            for s in self._socks:
                s.close()


def raw(addr: tuple[str, int], rcvbuf: int | None = None) -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf is not None:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.settimeout(WAIT_S)
    s.connect(addr)
    return s


def answer_then_close(s: socket.socket, timeout: float = WAIT_S) -> bytes | None:
    """What the other end sent before it closed the connection; None if it did not close."""
    s.settimeout(timeout)
    got = b""
    try:
        while chunk := s.recv(65536):
            got += chunk
    except (ConnectionResetError, BrokenPipeError):
        pass
    except TimeoutError:
        return None
    return got


def closed_by_peer(s: socket.socket, timeout: float = WAIT_S) -> bool:
    """True once the other end closed the connection (reading whatever it sent first)."""
    return answer_then_close(s, timeout) is not None


# --- exchanging frames -------------------------------------------------------------------------

def test_two_members_exchange_frames_both_ways(members):
    """Frames flow both ways once both are linked; on_peer reports the link up with the hello."""
    a, b = members("a"), members("b")
    a.links.connect("b", b.address)
    wait_until(lambda: a.up("b") and b.up("a"))
    exchange(a, b, "one")
    exchange(b, a, "two")
    assert ("b", True) in [(p, u) for p, u, _ in a.events]
    hello_b = next(h for p, u, h in a.events if p == "b" and u)
    assert hello_b["name"] == "b" and hello_b["peer"] == f"{b.address[0]}:{b.address[1]}"
    assert a.links.peers()["b"]["sent"] >= 1 and a.links.peers()["b"]["received"] >= 1
    assert a.links.stats()["dropped"] == {} and b.links.stats()["dropped"] == {}


def test_three_members_exchange_frames(members):
    """A full mesh of three: every ordered pair exchanges frames."""
    ms = [members(n) for n in ("m1", "m2", "m3")]
    mesh(*ms)
    for x in ms:
        for y in ms:
            if x is not y:
                exchange(x, y, f"{x.name}->{y.name}")


def test_batch_arrives_in_order(members):
    """A batch of table frames arrives whole and in order."""
    a, b = members("a"), members("b")
    mesh(a, b)
    batch = [(FrameType.F_JOB_STATE, {"seq": i}) for i in range(500)]
    assert a.links.send_batch("b", batch) == 500
    wait_until(lambda: len(b.got("a", FrameType.F_JOB_STATE)) == 500)
    assert [x["seq"] for x in b.got("a", FrameType.F_JOB_STATE)] == list(range(500))


def test_send_to_a_peer_that_is_down_is_dropped(members):
    """send() to an unknown peer or one that cannot be reached returns False and counts it."""
    a = members("a")
    assert a.links.send("nobody", FrameType.F_LEASE, {}) is False
    ghost = Hangup()
    a.links.connect("ghost", ghost.address)
    wait_until(lambda: ghost.dials() >= 2, what="a dial to ghost failed and was tried again")
    assert a.links.send("ghost", FrameType.F_LEASE, {}) is False
    assert a.links.send_batch("ghost", [(FrameType.F_JOB_STATE, {})]) == 0
    assert a.links.stats()["send_dropped"]["down"] == 3
    assert a.links.peers()["ghost"]["up"] is False


def test_reconnect_after_the_peer_restarts_on_the_same_port(members):
    """The dialler redials with backoff; a new member on the old port is linked again."""
    a, b = members("a"), members("b")
    a.links.connect("b", b.address)
    wait_until(lambda: a.up("b"))
    exchange(a, b, "before")
    port = b.address
    b.stop()
    wait_until(lambda: not a.up("b"), what="a sees b down")
    wait_until(lambda: ("b", False) in [(p, u) for p, u, _ in a.events], what="on_peer down")
    assert a.links.send("b", FrameType.F_LEASE, {"lost": True}) is False
    hangup = Hangup(port[1])  # a few failed redials
    wait_until(lambda: hangup.dials() >= 2, what="a redials b and fails")
    hangup.close()
    b2 = members("b", listen=port)
    wait_until(lambda: a.up("b") and b2.up("a"), what="relinked")
    exchange(a, b2, "after")
    ups = [h["boot"] for p, u, h in a.events if p == "b" and u]
    assert len(ups) == 2 and ups[0] != ups[1]


def test_one_connection_per_peer_when_both_dial(members):
    """Both sides dial: each side ends with one connection, the one the lower name dialled."""
    for _ in range(3):
        a, b = members("a"), members("b")
        a.links.connect("b", b.address)
        b.links.connect("a", a.address)
        wait_until(lambda a=a, b=b: a.up("b") and b.up("a"))
        wait_until(lambda a=a, b=b: a.links.stats()["conns"] == 1 and b.links.stats()["conns"] == 1,
                 what="one connection each")
        exchange(a, b, "dup")
        # It stays that way: the higher name does not keep redialling a working link. Its
        # dialler had its chances: it redialled a peer that hangs up twice meanwhile.
        hangup = Hangup()
        b.links.connect("c", hangup.address)
        wait_until(lambda h=hangup: h.dials() >= 2, what="b redials c")
        hangup.close()
        assert a.links.stats()["conns"] == 1 and b.links.stats()["conns"] == 1
        assert a.links.stats()["pending"] == 0 and b.links.stats()["pending"] == 0
        # The lower name never sees the link flap. The higher one may, once: its own dial can
        # finish its handshake before the lower name drops it as the duplicate (a known race of
        # the three-frame handshake; the link ends up, and stays, on the lower name's dial).
        assert [u for p, u, _ in a.events] == [True]
        assert [u for p, u, _ in b.events] in ([True], [True, False, True])
        a.stop()
        b.stop()


# --- bounded queues ----------------------------------------------------------------------------

def test_a_peer_that_stops_reading(members):
    """Non-table frames drop when the queue is full; a table batch waits, then its rest drops;
    send() never blocks the caller."""
    a = members("a")
    slow = RawPeer(a.address, "slow", "a", rcvbuf=4096)
    slow.handshake()
    wait_until(lambda: a.up("slow"))
    big = {"b": b"x" * (256 * 1024)}
    sent = 0
    for _ in range(500):
        t0 = time.monotonic()
        ok = a.links.send("slow", FrameType.F_BLOB_PUT, big)
        assert time.monotonic() - t0 < 2.0, "send() blocked"
        if not ok:
            break
        sent += 1
        # Let the link thread move frames into the socket until the kernel's buffers are full.
        time.sleep(0.005)  # sleep-ok: paces the sender (the pace is the test, not a wait)
    else:
        pytest.fail("the queue never filled")
    assert sent * len(big["b"]) >= limits.link_queue_bytes_max // 2
    assert a.links.stats()["send_dropped"]["full"] >= 1
    assert a.links.peers()["slow"]["dropped"] >= 1
    # Wait until the kernel's buffers take nothing more, so the queue stays full.
    last = -1
    while (queued := a.links.peers()["slow"]["queued"]) != last:
        last = queued
        time.sleep(0.5)  # sleep-ok: a queue that did not move for this long is full
    # Then top the queue up: nothing drains now, so it stays full.
    for _ in range(10):
        if not a.links.send("slow", FrameType.F_BLOB_PUT, big):
            break

    t0 = time.monotonic()
    batch = [(FrameType.F_JOB_STATE, {"seq": i, **big}) for i in range(5)]
    assert a.links.send_batch("slow", batch) == 5
    assert time.monotonic() - t0 < 2.0, "send_batch() blocked"
    assert a.links.peers()["slow"]["waiting"] == 5
    wait_until(lambda: a.links.stats()["send_dropped"].get("table_wait") == 5,
             what="the batch dropped after waiting")
    waited = time.monotonic() - t0
    assert waited >= limits.table_frame_wait_ms / 1000 * 0.9
    assert a.links.peers()["slow"]["waiting"] == 0
    # The member still talks to a good peer.
    b = members("b")
    a.links.connect("b", b.address)
    wait_until(lambda: a.up("b"))
    exchange(a, b, "still fine")
    slow.close()


def test_table_frames_wait_for_room_and_go_when_it_appears(members):
    """A table frame that finds the queue full waits, and is sent once room appears."""
    a = members("a", queue_frames_max=4)
    slow = RawPeer(a.address, "slow", "a", rcvbuf=4096)
    slow.handshake()
    wait_until(lambda: a.up("slow"))
    pad = {"p": b"z" * (128 * 1024)}
    for _ in range(400):
        if not a.links.send("slow", FrameType.F_BLOB_PUT, pad):
            break
        time.sleep(0.005)  # sleep-ok: paces the sender (the pace is the test, not a wait)
    else:
        pytest.fail("the queue never filled")
    assert a.links.send_batch("slow", [(FrameType.F_JOB_STATE, {"last": True})]) == 1
    assert a.links.peers()["slow"]["waiting"] == 1
    # Start reading: room appears, the waiting frame is sent rather than dropped.
    while True:
        ev = slow.event()
        assert isinstance(ev, Frame)
        if ev.body.get("last"):
            break
    assert "table_wait" not in a.links.stats()["send_dropped"]
    slow.close()


def test_send_wait_paces_a_long_run_of_frames_to_the_link(members):
    """send_wait (a thread that sends a dump to a new worker): frames far more than the queue
    holds all go, in order, each waiting for room as the peer reads; when the peer stops
    reading, one waits its time out and is dropped (False, counted table_wait)."""
    a = members("a", queue_frames_max=4)
    slow = RawPeer(a.address, "slow", "a", rcvbuf=4096)
    slow.handshake()
    wait_until(lambda: a.up("slow"))
    pad = b"w" * (128 * 1024)
    n = 40  # ten times the queue
    results: list[bool] = []
    sender = threading.Thread(target=lambda: results.extend(
        a.links.send_wait("slow", FrameType.F_JOB_STATE, {"k": k, "p": pad}, 10_000)
        for k in range(n)))
    sender.start()
    got = []
    while len(got) < n:
        ev = slow.event()
        assert isinstance(ev, Frame)
        got.append(ev.body["k"])
    sender.join(WAIT_S)
    assert results == [True] * n and got == list(range(n))
    assert "table_wait" not in a.links.stats()["send_dropped"]
    # Now nobody reads: the queue fills, and a frame gives up after its wait.
    for k in range(400):
        if not a.links.send_wait("slow", FrameType.F_JOB_STATE, {"k": k, "p": pad}, 300):
            break
    else:
        pytest.fail("the queue never filled")
    assert a.links.stats()["send_dropped"]["table_wait"] == 1
    slow.close()


# --- hostile input -----------------------------------------------------------------------------

def test_hostile_input_is_dropped_and_counted(members):
    """Garbage, a huge length, an old member's MJF1, a foreign secret, a wrong first frame, a
    replayed handshake, a tampered sealed frame and a silent connection each close that
    connection and are counted; good peers are not disturbed."""
    log = LogRecorder()
    a = members("a", hello_ms_max=1000, log=log)
    b = members("b")
    mesh(a, b)
    exchange(a, b, "before")

    def dropped(reason: str) -> int:
        return a.links.stats()["dropped"].get(reason, 0)

    s = raw(a.address)
    s.sendall(os.urandom(16) + b"GET / HTTP/1.1\r\n\r\n")
    assert closed_by_peer(s)
    assert dropped("magic") == 1

    s = raw(a.address)
    s.sendall(b"MJF1" + bytes(30))  # a member of the old protocol
    assert closed_by_peer(s)
    assert dropped("magic") == 2

    s = raw(a.address)
    s.sendall(HEADER.pack(MAGIC, int(FrameType.F_HELLO), 0, 2**32 - 1))
    assert closed_by_peer(s)
    assert dropped("length") == 1

    s = raw(a.address)
    s.sendall(hello("mallory", "a", secret=OTHER))
    assert answer_then_close(s) == b"", "a stranger learns nothing"
    assert dropped("mac") == 1
    assert log.find("link_refused", reason="mac", peer="mallory"), "the log names the peer"

    s = raw(a.address)
    s.sendall(HEADER.pack(MAGIC, int(FrameType.F_LEASE), 0, 17) + bytes(17))
    assert closed_by_peer(s)
    assert dropped("handshake") == 1

    s = raw(a.address)
    s.sendall(hello("b", "someone-else"))
    assert closed_by_peer(s)
    assert dropped("hello") == 1

    # A whole handshake recorded, then replayed on a new connection: a challenge, and no more.
    first = RawPeer(a.address, "replayer", "a")
    first.handshake()
    wait_until(lambda: a.up("replayer"))
    first.send(first.session.seal(FrameType.F_RESULT, {"once": True}))
    wait_until(lambda: a.got("replayer", FrameType.F_RESULT) == [{"once": True}])
    s = raw(a.address)
    s.sendall(first.sent[0])
    s.sendall(b"".join(first.sent[1:]))
    assert closed_by_peer(s)
    assert dropped("proof") == 1
    assert log.find("link_refused", reason="proof", peer="replayer")
    assert a.got("replayer", FrameType.F_RESULT) == [{"once": True}]

    # A sealed frame with one bit changed.
    t = RawPeer(a.address, "tamperer", "a")
    t.handshake()
    wait_until(lambda: a.up("tamperer"))
    bad = bytearray(t.session.seal(FrameType.F_RESULT, {"x": 1}))
    bad[-3] ^= 0x40
    t.send(bytes(bad))
    assert closed_by_peer(t.sock)
    assert dropped("aead") == 1
    assert log.find("link_refused", reason="aead", peer="tamperer", proven=True)
    assert not a.got("tamperer", FrameType.F_RESULT)

    s = raw(a.address)
    t0 = time.monotonic()
    assert closed_by_peer(s), "a connection without a handshake was kept"
    assert time.monotonic() - t0 >= 0.9
    assert dropped("hello_timeout") == 1

    # Every refusal was logged with the reason and the address of the other end.
    refused = log.find("link_refused")
    assert len(refused) == sum(a.links.stats()["dropped"].values())
    assert all(r["addr"].startswith("127.0.0.1:") and r["reason"] for r in refused)

    # None of it disturbed the link to b.
    wait_until(lambda: a.links.stats()["pending"] == 0)
    exchange(a, b, "after")
    exchange(b, a, "after too")
    assert b.links.stats()["dropped"] == {}
    first.close()


def test_a_replayed_handshake_to_a_restarted_member_is_not_answered(members):
    """Rule: a handshake recorded on the wire and replayed to the member after it restarted
    (its memory gone) gets a challenge and nothing more: no link, no frame delivered."""
    log = LogRecorder()
    a = members("a", log=log)
    port = a.address
    rec = RawPeer(a.address, "d", "a")
    rec.handshake()
    rec.send(rec.session.seal(FrameType.F_LEASE, {"run": "recorded"}))
    wait_until(lambda: a.got("d", FrameType.F_LEASE) == [{"run": "recorded"}])
    rec.close()
    a.stop()

    a2 = members("a", listen=port, log=log)
    s = raw(a2.address)
    s.sendall(rec.sent[0])  # the recorded hello
    got = b""
    while len(got) < 10 or len(got) < 10 + int.from_bytes(got[6:10], "big"):
        got += s.recv(4096)
    assert got[4] == int(FrameType.F_CHALLENGE), "the answer is a challenge"
    s.sendall(b"".join(rec.sent[1:]))  # the recorded proof and sealed frame
    assert closed_by_peer(s)
    wait_until(lambda: a2.links.stats()["dropped"].get("proof") == 1)
    assert a2.frames == [] and not a2.up("d")
    wait_until(lambda: a2.links.stats()["pending"] == 0)
    assert log.find("link_refused", reason="proof", peer="d")


def test_members_whose_clocks_differ_by_two_minutes_link_and_exchange(members):
    """Rule: no clock is compared. A member whose wall clock is 120 s ahead links to the
    others and exchanges frames both ways; the skew is only logged and shown."""
    log = LogRecorder()
    ahead = members("ahead", clock_ms=lambda: wall_ms() + 120_000)
    b = members("b", log=log)
    c = members("c")
    mesh(ahead, b, c)
    for x, y in ((ahead, b), (b, ahead), (ahead, c), (c, ahead)):
        exchange(x, y, "skewed")
    for m in (ahead, b, c):
        assert m.links.stats()["dropped"] == {}, m.name
    skew = b.links.peers()["ahead"]["clock_skew_ms"]
    assert 110_000 <= skew <= 130_000
    assert abs(b.links.peers()["c"]["clock_skew_ms"]) < 10_000
    assert log.find("link_clock_skew", peer="ahead")
    assert not log.find("link_clock_skew", peer="c")


def test_bytes_on_the_wire_are_sealed(members):
    """Rule: what crosses the network is sealed: a proxy between two members sees none of a
    frame's plaintext, both ways; one bit changed on the way is refused and named in the log."""
    log = LogRecorder()
    a = members("a")
    b = members("b", log=log)
    proxy = Proxy(b.address)
    try:
        a.links.connect("b", proxy.address)
        wait_until(lambda: a.up("b") and b.up("a"))
        marker = b"PLAINTEXT-MARKER-" * 64
        body = {"stdout": marker, "argv": ["echo", "confidential-arg"]}
        wait_until(lambda: a.links.send("b", FrameType.F_BLOB_PUT, body))
        wait_until(lambda: body in b.got("a", FrameType.F_BLOB_PUT))
        wait_until(lambda: b.links.send("a", FrameType.F_RESULT, {"out": marker}))
        wait_until(lambda: {"out": marker} in a.got("b", FrameType.F_RESULT))
        wire = proxy.captured()
        assert len(wire) > len(marker) * 2
        for plain in (b"PLAINTEXT-MARKER", b"confidential-arg", b"stdout"):
            assert plain not in wire
        # One bit flipped on its way to b: b refuses the frame and says who sent it.
        proxy.flip_up.set()
        a.links.send("b", FrameType.F_RESULT, {"x": "flipped"})
        wait_until(lambda: b.links.stats()["dropped"].get("aead") == 1, what="aead refusal")
        assert {"x": "flipped"} not in b.got("a", FrameType.F_RESULT)
        assert log.find("link_refused", reason="aead", peer="a", proven=True)
        # The link comes back on its own, with new keys.
        wait_until(lambda: a.up("b") and b.up("a"))
        exchange(a, b, "after the flip")
    finally:
        proxy.close()


def test_a_silent_connection_is_closed(members):
    """A peer that completed its handshake but sends nothing (no pings) is closed."""
    a = members("a", silent_ms_max=500, idle_ms=100)
    s = RawPeer(a.address, "quiet", "a")
    s.handshake()
    wait_until(lambda: a.up("quiet"))
    assert closed_by_peer(s.sock)
    assert a.links.stats()["dropped"].get("silent") == 1
    wait_until(lambda: not a.up("quiet"))


def test_idle_links_ping_and_stay_up(members):
    """Linked members ping each other, so an idle link outlives the silence limit."""
    # The silence limit is 30 pings long, so that a loaded machine (a thread not run for a
    # while) does not pass for a silent peer; the absence of a drop is checked once the limit
    # has passed: when `a` closed a peer linked after `b` that sends nothing, for its silence.
    silent_ms = 3000
    a = members("a", silent_ms_max=silent_ms, idle_ms=100)
    b = members("b", silent_ms_max=silent_ms, idle_ms=100)
    mesh(a, b)
    quiet = RawPeer(a.address, "quiet", "a")
    quiet.handshake()
    assert closed_by_peer(quiet.sock, timeout=silent_ms * 3 / 1000)
    wait_until(lambda: a.links.stats()["dropped"].get("silent") == 1, what="quiet dropped")
    quiet.close()
    assert a.up("b") and b.up("a")
    assert a.links.stats()["dropped"] == {"silent": 1} and b.links.stats()["dropped"] == {}
    assert not a.got("b", FrameType.F_PING), "pings are not passed on"
    assert [u for p, u, _ in a.events if p == "b"] == [True]


def test_stop_before_run_closes_the_port():
    """A Links that never ran releases its port on stop()."""
    links = Links("a", "boot", ("127.0.0.1", 0), SECRET, on_frame=lambda n, f: None)
    addr = links.address
    links.stop()
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(addr)


def test_discover_answers_with_voters(tmp_path):
    """A worker that knows only an address asks who is there and who the voters are (hello to
    "*"): after the whole handshake the member answers with its name and the voters, then
    closes; a wrong secret gets nothing; a replayed discovery hello gets only a challenge."""
    import threading as _threading

    from meshjobs.links import Links, discover

    secret = b"s" * 32
    links = Links("v1", "boot1", ("127.0.0.1", 0), secret, on_frame=lambda p, f: None,
                  discovery=lambda: {"v1": "127.0.0.1:1", "v2": "127.0.0.1:2"})
    t = _threading.Thread(target=links.run, daemon=True)
    t.start()
    try:
        body = discover(links.address, "w1", "bootw", secret)
        assert body["name"] == "v1" and body["voters"] == {"v1": "127.0.0.1:1", "v2": "127.0.0.1:2"}
        with pytest.raises((OSError, FrameError)):
            discover(links.address, "w1", "bootw", b"x" * 32, timeout_s=1.5)
        rp = RawPeer(links.address, "w2", "*", secret=secret)
        rp.send(rp.session.hello(hello_body("w2", "*"), os.urandom(NONCE_BYTES), os.urandom(32)))
        assert isinstance(rp.event(), Hello)
        rp.send(b"MJF2" + bytes([int(FrameType.F_PROOF), 0]) + (40).to_bytes(4, "big")
                + bytes(40))
        assert closed_by_peer(rp.sock)
        assert links.stats()["dropped"].get("proof") == 1
        assert links.stats()["dropped"].get("discovery") == 1
        assert links.stats()["dropped"].get("mac", 0) >= 1
        assert links.stats()["dropped"].get("discovery") == 1
    finally:
        links.stop()
        t.join(5)
