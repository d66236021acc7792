"""Member links over real TCP on 127.0.0.1: handshake, one connection per peer, bounded queues,
and hostile input on the port."""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from meshjobs import limits
from meshjobs.frames import HEADER, MAGIC, NONCE_BYTES, Frame, FrameError, FrameType, encode
from meshjobs.links import Links, wall_ms

SECRET = bytes(range(32))
OTHER = bytes(range(1, 33))
WAIT_S = 15.0


def wait_for(pred: Callable[[], Any], timeout: float = WAIT_S, what: str = "") -> Any:
    """Poll until pred() is truthy; fail after timeout."""
    deadline = time.monotonic() + timeout
    while True:
        got = pred()
        if got:
            return got
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what or pred}")
        time.sleep(0.02)


class Member:
    """A Links with its thread, the frames it received and the peer events it saw."""

    def __init__(self, name: str, listen: tuple[str, int] = ("127.0.0.1", 0),
                 boot: str | None = None, **kw: Any) -> None:
        self.name = name
        self.frames: list[tuple[str, Frame]] = []
        self.events: list[tuple[str, bool, dict]] = []
        self._mu = threading.Lock()
        self.links = Links(name, boot or os.urandom(4).hex(), listen, SECRET,
                           on_frame=self._on_frame, on_peer=self._on_peer, **kw)
        self.thread = threading.Thread(target=self.links.run, name=f"links-{name}", daemon=True)
        self.thread.start()

    @property
    def address(self) -> tuple[str, int]:
        return self.links.address

    def _on_frame(self, peer: str, frame: Frame) -> None:
        with self._mu:
            self.frames.append((peer, frame))

    def _on_peer(self, peer: str, up: bool, hello: dict) -> None:
        with self._mu:
            self.events.append((peer, up, hello))

    def got(self, peer: str, ftype: FrameType) -> list[dict]:
        with self._mu:
            return [f.body for p, f in self.frames if p == peer and f.type == ftype]

    def up(self, peer: str) -> bool:
        return bool(self.links.peers().get(peer, {}).get("up"))

    def stop(self) -> None:
        self.links.stop()
        self.thread.join(timeout=WAIT_S)
        assert not self.thread.is_alive()


@pytest.fixture
def members():
    made: list[Member] = []

    def make(name: str, **kw: Any) -> Member:
        m = Member(name, **kw)
        made.append(m)
        return m

    try:
        yield make
    finally:
        for m in made:
            m.stop()


def mesh(*ms: Member) -> None:
    for a in ms:
        for b in ms:
            if a is not b:
                a.links.connect(b.name, b.address)
    for a in ms:
        for b in ms:
            if a is not b:
                wait_for(lambda a=a, b=b: a.up(b.name), what=f"{a.name} -> {b.name} up")


def exchange(a: Member, b: Member, tag: str) -> None:
    """a sends b a frame and back; both arrive."""
    body = {"tag": tag, "from": a.name}
    wait_for(lambda: a.links.send(b.name, FrameType.F_RESULT, body), what="send accepted")
    wait_for(lambda: body in b.got(a.name, FrameType.F_RESULT), what=f"{tag} at {b.name}")
    back = {"tag": tag, "from": b.name}
    wait_for(lambda: b.links.send(a.name, FrameType.F_LEASE, back), what="reply accepted")
    wait_for(lambda: back in a.got(b.name, FrameType.F_LEASE), what=f"{tag} back at {a.name}")


# --- raw sockets speaking (or mangling) the protocol ------------------------------------------

def hello(name: str, to: str, secret: bytes = SECRET, now: int | None = None) -> bytes:
    return encode(FrameType.F_HELLO, {"name": name, "boot": "raw", "peer": "127.0.0.1:1",
                                      "to": to},
                  secret, wall_ms() if now is None else now, os.urandom(NONCE_BYTES))


def raw(addr: tuple[str, int], rcvbuf: int | None = None) -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf is not None:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.settimeout(WAIT_S)
    s.connect(addr)
    return s


def closed_by_peer(s: socket.socket, timeout: float = WAIT_S) -> bool:
    """True once the other end closed the connection (reading whatever it sent first)."""
    s.settimeout(timeout)
    try:
        while s.recv(65536):
            pass
    except (ConnectionResetError, BrokenPipeError):
        pass
    except TimeoutError:
        return False
    return True


# --- exchanging frames -------------------------------------------------------------------------

def test_two_members_exchange_frames_both_ways(members):
    """Frames flow both ways once both are linked; on_peer reports the link up with the hello."""
    a, b = members("a"), members("b")
    a.links.connect("b", b.address)
    wait_for(lambda: a.up("b") and b.up("a"))
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
    wait_for(lambda: len(b.got("a", FrameType.F_JOB_STATE)) == 500)
    assert [x["seq"] for x in b.got("a", FrameType.F_JOB_STATE)] == list(range(500))


def test_send_to_a_peer_that_is_down_is_dropped(members):
    """send() to an unknown peer or one that cannot be reached returns False and counts it."""
    a = members("a")
    assert a.links.send("nobody", FrameType.F_LEASE, {}) is False
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()
    a.links.connect("ghost", dead)
    time.sleep(0.3)
    assert a.links.send("ghost", FrameType.F_LEASE, {}) is False
    assert a.links.send_batch("ghost", [(FrameType.F_JOB_STATE, {})]) == 0
    assert a.links.stats()["send_dropped"]["down"] == 3
    assert a.links.peers()["ghost"]["up"] is False


def test_reconnect_after_the_peer_restarts_on_the_same_port(members):
    """The dialler redials with backoff; a new member on the old port is linked again."""
    a, b = members("a"), members("b")
    a.links.connect("b", b.address)
    wait_for(lambda: a.up("b"))
    exchange(a, b, "before")
    port = b.address
    b.stop()
    wait_for(lambda: not a.up("b"), what="a sees b down")
    wait_for(lambda: ("b", False) in [(p, u) for p, u, _ in a.events], what="on_peer down")
    assert a.links.send("b", FrameType.F_LEASE, {"lost": True}) is False
    time.sleep(0.5)  # a few failed redials
    b2 = members("b", listen=port)
    wait_for(lambda: a.up("b") and b2.up("a"), what="relinked")
    exchange(a, b2, "after")
    ups = [h["boot"] for p, u, h in a.events if p == "b" and u]
    assert len(ups) == 2 and ups[0] != ups[1]


def test_one_connection_per_peer_when_both_dial(members):
    """Both sides dial: each side ends with one connection, the one the lower name dialled."""
    for _ in range(3):
        a, b = members("a"), members("b")
        a.links.connect("b", b.address)
        b.links.connect("a", a.address)
        wait_for(lambda a=a, b=b: a.up("b") and b.up("a"))
        wait_for(lambda a=a, b=b: a.links.stats()["conns"] == 1 and b.links.stats()["conns"] == 1,
                 what="one connection each")
        exchange(a, b, "dup")
        # It stays that way: the higher name does not keep redialling a working link.
        time.sleep(0.5)
        assert a.links.stats()["conns"] == 1 and b.links.stats()["conns"] == 1
        assert a.links.stats()["pending"] == 0 and b.links.stats()["pending"] == 0
        # And neither side saw the link flap on its way there.
        assert [u for p, u, _ in a.events] == [True] and [u for p, u, _ in b.events] == [True]
        a.stop()
        b.stop()


# --- bounded queues ----------------------------------------------------------------------------

def test_a_peer_that_stops_reading(members):
    """Non-table frames drop when the queue is full; a table batch waits, then its rest drops;
    send() never blocks the caller."""
    a = members("a")
    slow = raw(a.address, rcvbuf=4096)
    slow.sendall(hello("slow", "a"))
    wait_for(lambda: a.up("slow"))
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
        time.sleep(0.005)
    else:
        pytest.fail("the queue never filled")
    assert sent * len(big["b"]) >= limits.link_queue_bytes_max // 2
    assert a.links.stats()["send_dropped"]["full"] >= 1
    assert a.links.peers()["slow"]["dropped"] >= 1
    # Wait until the kernel's buffers take nothing more, so the queue stays full.
    last = -1
    while (queued := a.links.peers()["slow"]["queued"]) != last:
        last = queued
        time.sleep(0.5)
    # Then top the queue up: nothing drains now, so it stays full.
    for _ in range(10):
        if not a.links.send("slow", FrameType.F_BLOB_PUT, big):
            break

    t0 = time.monotonic()
    batch = [(FrameType.F_JOB_STATE, {"seq": i, **big}) for i in range(5)]
    assert a.links.send_batch("slow", batch) == 5
    assert time.monotonic() - t0 < 2.0, "send_batch() blocked"
    assert a.links.peers()["slow"]["waiting"] == 5
    wait_for(lambda: a.links.stats()["send_dropped"].get("table_wait") == 5,
             what="the batch dropped after waiting")
    waited = time.monotonic() - t0
    assert waited >= limits.table_frame_wait_ms / 1000 * 0.9
    assert a.links.peers()["slow"]["waiting"] == 0
    # The member still talks to a good peer.
    b = members("b")
    a.links.connect("b", b.address)
    wait_for(lambda: a.up("b"))
    exchange(a, b, "still fine")
    slow.close()


def test_table_frames_wait_for_room_and_go_when_it_appears(members):
    """A table frame that finds the queue full waits, and is sent once room appears."""
    a = members("a", queue_frames_max=4)
    slow = raw(a.address, rcvbuf=4096)
    slow.sendall(hello("slow", "a"))
    wait_for(lambda: a.up("slow"))
    pad = {"p": b"z" * (128 * 1024)}
    for _ in range(400):
        if not a.links.send("slow", FrameType.F_BLOB_PUT, pad):
            break
        time.sleep(0.005)
    else:
        pytest.fail("the queue never filled")
    assert a.links.send_batch("slow", [(FrameType.F_JOB_STATE, {"last": True})]) == 1
    assert a.links.peers()["slow"]["waiting"] == 1
    # Start reading: room appears, the waiting frame is sent rather than dropped.
    got = bytearray()
    slow.settimeout(WAIT_S)
    deadline = time.monotonic() + WAIT_S
    while b"last" not in got and time.monotonic() < deadline:
        got += slow.recv(1 << 20)
        del got[: max(0, len(got) - 64)]
    assert b"last" in got
    assert "table_wait" not in a.links.stats()["send_dropped"]
    slow.close()


# --- hostile input -----------------------------------------------------------------------------

def test_hostile_input_is_dropped_and_counted(members):
    """Garbage, a huge length, a replay, a foreign secret, a wrong first frame and a silent
    connection each close that connection and are counted; good peers are not disturbed."""
    a = members("a", hello_ms_max=1000)
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
    s.sendall(HEADER.pack(MAGIC, int(FrameType.F_HELLO), 0, 2**32 - 1, wall_ms(),
                          os.urandom(NONCE_BYTES)))
    assert closed_by_peer(s)
    assert dropped("length") == 1

    s = raw(a.address)
    s.sendall(hello("mallory", "a", secret=OTHER))
    assert closed_by_peer(s)
    assert dropped("mac") == 1

    s = raw(a.address)
    s.sendall(hello("m-old", "a", now=wall_ms() - limits.frame_clock_skew_ms_max - 5000))
    assert closed_by_peer(s)
    assert dropped("clock") == 1

    s = raw(a.address)
    s.sendall(encode(FrameType.F_LEASE, {}, SECRET, wall_ms(), os.urandom(NONCE_BYTES)))
    assert closed_by_peer(s)
    assert dropped("hello") == 1

    s = raw(a.address)
    s.sendall(hello("b", "someone-else"))
    assert closed_by_peer(s)
    assert dropped("hello") == 2

    # A good hello, then the very same bytes again on a second connection.
    h = hello("replayer", "a")
    first = raw(a.address)
    first.sendall(h)
    wait_for(lambda: a.up("replayer"))
    s = raw(a.address)
    s.sendall(h)
    assert closed_by_peer(s)
    assert dropped("replay") == 1

    s = raw(a.address)
    t0 = time.monotonic()
    assert closed_by_peer(s), "a connection without hello was kept"
    assert time.monotonic() - t0 >= 0.9
    assert dropped("hello_timeout") == 1

    # None of it disturbed the link to b.
    wait_for(lambda: a.links.stats()["pending"] == 0)
    exchange(a, b, "after")
    exchange(b, a, "after too")
    assert b.links.stats()["dropped"] == {}
    first.close()


def test_a_silent_connection_is_closed(members):
    """A peer that completed its hello but sends nothing (no pings) is closed."""
    a = members("a", silent_ms_max=500, idle_ms=100)
    s = raw(a.address)
    s.sendall(hello("quiet", "a"))
    wait_for(lambda: a.up("quiet"))
    assert closed_by_peer(s)
    assert a.links.stats()["dropped"].get("silent") == 1
    wait_for(lambda: not a.up("quiet"))


def test_idle_links_ping_and_stay_up(members):
    """Linked members ping each other, so an idle link outlives the silence limit."""
    a = members("a", silent_ms_max=600, idle_ms=100)
    b = members("b", silent_ms_max=600, idle_ms=100)
    mesh(a, b)
    time.sleep(1.5)
    assert a.up("b") and b.up("a")
    assert a.links.stats()["dropped"] == {} and b.links.stats()["dropped"] == {}
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
    "*"): the member answers with its name and the voters, then closes; a wrong secret gets
    nothing."""
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
        assert links.stats()["dropped"].get("mac", 0) >= 1
    finally:
        links.stop()
        t.join(5)
