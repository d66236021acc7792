"""Member links: one authenticated TCP connection per peer, with bounded send queues.

This is the IO edge around `frames`. One thread (the caller starts it with `run` as its body)
runs a selector loop over the listening socket, every connection, a wake-up pipe and the
timers (redials, handshakes, pings, table frames waiting for room). Other threads only call
`connect`, `send`, `send_batch`, `peers`, `stats` and `stop`, which take one short lock and never
block on the network.

Rules:
- The first frame each way on a connection is an F_HELLO `{"name", "boot", "peer", "to"}`. The
  dialler speaks first; the acceptor answers once the dialler's hello is good. Until then no
  other frame is accepted, and a connection that has not completed its hello within
  `link_hello_ms_max` is closed.
- One connection per peer. If two are up (both sides dialled), both members keep the one dialled
  by the member whose name sorts lower; a newer boot of the peer, or a second connection dialled
  by the same member, replaces the older one.
- Every queue is bounded: `link_queue_frames_max` / `link_queue_bytes_max` frames waiting to be
  written per peer, and as many table frames waiting for room. Frames to a peer that is down are
  dropped. Nothing correct may depend on a frame arriving; every drop is counted.
- Garbage from outside (any `FrameError`, a bad hello, a silent or handshake-less connection)
  closes that connection and is counted by reason in `stats()["dropped"]`. It never raises out of
  `run`. An exception from the `on_frame` / `on_peer` callbacks is a bug of ours and does.
- F_HELLO and F_PING are the links' own: they are not passed to `on_frame`.
"""

from __future__ import annotations

import os
import random
import selectors
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

import structlog

from meshjobs import limits
from meshjobs.frames import (
    NONCE_BYTES,
    Frame,
    FrameDecoder,
    FrameError,
    FrameType,
    NonceCache,
    encode,
)

_LISTEN = object()
_WAKE = object()
# Reads of one connection per loop turn, so that one busy peer cannot starve the others.
_READS_PER_TURN = 16
# The loop wakes at least this often to run its timers.
_TICK_S = 0.05


DISCOVER = "*"  # the `to` of a hello that asks "who are you and who are the voters?"


def discover(addr: tuple[str, int], self_name: str, boot: str, secret: bytes,
             timeout_s: float = 5.0) -> dict[str, Any]:
    """Ask the member at `addr` for its hello and the fleet's voters (blocking; used once when a
    worker member starts with `join`). Raises OSError or FrameError when it cannot."""
    deadline = time.monotonic() + timeout_s
    with socket.create_connection(addr, timeout=timeout_s) as sock:
        sock.sendall(encode(FrameType.F_HELLO, {"name": self_name, "boot": boot, "peer": "",
                                                "to": DISCOVER}, secret, wall_ms(),
                            os.urandom(NONCE_BYTES)))
        decoder = FrameDecoder(secret)
        while True:
            frame = decoder.next_frame(wall_ms())
            if frame is not None:
                if frame.type != FrameType.F_HELLO or not isinstance(frame.body.get("voters"), dict):
                    raise FrameError("hello", "the member did not answer with its voters")
                return frame.body
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no answer from {addr[0]}:{addr[1]} within {timeout_s} s")
            sock.settimeout(left)
            data = sock.recv(min(decoder.room(), 65536))
            if not data:
                raise ConnectionError(f"{addr[0]}:{addr[1]} closed the connection")
            decoder.receive_data(data)


def wall_ms() -> int:
    """Milliseconds since the epoch: frames carry wall time, compared across members."""
    return time.time_ns() // 1_000_000


def _mono_ms() -> float:
    return time.monotonic() * 1000.0


def _parse_hostport(value: str) -> tuple[str, int]:
    host, _, port = value.rpartition(":")
    return host.strip("[]"), int(port)


class _Conn:
    """One TCP connection; touched only by the link thread."""

    __slots__ = ("sock", "outgoing", "name", "dialler", "decoder", "established", "hello",
                 "out", "connecting", "created_ms", "last_recv_ms", "last_sent_ms", "closed",
                 "events", "seq")

    def __init__(self, sock: socket.socket, outgoing: bool, name: str | None,
                 decoder: FrameDecoder, now: float, seq: int) -> None:
        self.sock = sock
        self.outgoing = outgoing
        self.name = name  # for an outgoing connection, the peer it was dialled to
        self.dialler: str | None = None
        self.decoder = decoder
        self.established = False
        self.hello: dict[str, Any] | None = None
        self.out = bytearray()
        self.connecting = outgoing
        self.created_ms = now
        self.last_recv_ms = now
        self.last_sent_ms = now
        self.closed = False
        # What the selector watches for: writable while connecting, readable after.
        self.events = selectors.EVENT_WRITE if outgoing else selectors.EVENT_READ
        self.seq = seq


class _Peer:
    """What the links know of one peer; guarded by Links._lock."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.addr: tuple[str, int] | None = None
        self.conn: _Conn | None = None  # the established connection, if any
        self.dialing: _Conn | None = None
        self.next_dial_ms = 0.0
        self.backoff_ms = float(limits.link_connect_backoff_ms_base)
        self.queue: deque[bytes] = deque()
        self.queue_bytes = 0
        # Table frames waiting for room: (frame, batch id, since when, monotonic ms).
        self.waiting: deque[tuple[bytes, int, float]] = deque()
        self.waiting_bytes = 0
        self.since_ms: int | None = None
        self.hello: dict[str, Any] | None = None
        self.sent = 0
        self.received = 0
        self.dropped = 0


class Links:
    """The member links of one member. See the module's rules."""

    def __init__(self, self_name: str, boot: str, listen: tuple[str, int], secret: bytes,
                 on_frame: Callable[[str, Frame], None],
                 on_peer: Callable[[str, bool, dict[str, Any]], None] | None = None,
                 clock_ms: Callable[[], int] = wall_ms, log: Any = None, *,
                 queue_frames_max: int = limits.link_queue_frames_max,
                 queue_bytes_max: int = limits.link_queue_bytes_max,
                 table_wait_ms: int = limits.table_frame_wait_ms,
                 idle_ms: int = limits.link_idle_ms,
                 silent_ms_max: int = limits.link_silent_ms_max,
                 hello_ms_max: int = limits.link_hello_ms_max,
                 frame_bytes_max: int = limits.frame_bytes_max,
                 discovery: Callable[[], dict[str, str]] | None = None) -> None:
        if queue_bytes_max < frame_bytes_max:
            raise ValueError("a link's queue must hold at least one frame of the largest size")
        self.self_name = self_name
        self.boot = boot
        self._secret = bytes(secret)
        self._on_frame = on_frame
        self._on_peer = on_peer
        self._discovery = discovery  # name -> peer address of the voters, for joining workers
        self._clock_ms = clock_ms
        self._log = log if log is not None else structlog.get_logger(__name__)
        self._queue_frames_max = queue_frames_max
        self._queue_bytes_max = queue_bytes_max
        self._table_wait_ms = table_wait_ms
        self._idle_ms = idle_ms
        self._silent_ms_max = silent_ms_max
        self._hello_ms_max = hello_ms_max
        self._frame_bytes_max = frame_bytes_max
        # One replay cache for every connection: a frame replayed on another connection is
        # still a replay.
        self._nonces = NonceCache()

        self._lock = threading.Lock()
        self._peers: dict[str, _Peer] = {}
        self._dropped: dict[str, int] = {}  # incoming garbage, by reason
        self._send_dropped: dict[str, int] = {}  # outgoing frames dropped, by reason
        self._pending = 0  # accepted connections without a hello yet
        self._established = 0  # open connections that completed their hello
        self._batch_seq = 0
        self._conn_seq = 0
        self._stopping = False
        self._started = False
        self._done = False

        family = socket.AF_INET6 if ":" in listen[0] else socket.AF_INET
        self._listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._listener.bind(listen)
            self._listener.listen(limits.link_pending_conns_max)
            self._listener.setblocking(False)
        except OSError:
            self._listener.close()
            raise
        host, port = self._listener.getsockname()[:2]
        self.address: tuple[str, int] = (host, port)
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._listener, selectors.EVENT_READ, _LISTEN)
        self._sel.register(self._wake_r, selectors.EVENT_READ, _WAKE)
        self._conns: set[_Conn] = set()

    # --- the API for other threads ---------------------------------------------------------

    def connect(self, name: str, addr: tuple[str, int]) -> None:
        """Keep a connection to `name` at `addr`, redialling with backoff while it is down."""
        if name == self.self_name:
            raise ValueError("a member does not link to itself")
        with self._lock:
            peer = self._peer(name)
            peer.addr = (addr[0], int(addr[1]))
            peer.next_dial_ms = 0.0
        self._wake()

    def send(self, name: str, ftype: FrameType, body: dict[str, Any], table: bool = False) -> bool:
        """Queue one frame to `name`; False if it was dropped (peer down, queue full)."""
        if table:
            return self.send_batch(name, [(ftype, body)], table=True) == 1
        data = self._encode(ftype, body)
        with self._lock:
            peer = self._peers.get(name)
            if peer is None or peer.conn is None:
                self._drop_send(peer, "down", 1)
                return False
            if not self._has_room(peer, len(data)):
                self._drop_send(peer, "full", 1)
                return False
            peer.queue.append(data)
            peer.queue_bytes += len(data)
        self._wake()
        return True

    def send_batch(self, name: str, frames: Iterable[tuple[FrameType, dict[str, Any]]],
                   table: bool = True) -> int:
        """Queue frames to `name` in order; returns how many were queued (or wait for room).

        Table frames wait up to `table_frame_wait_ms` for room; once one has waited that long,
        it and the rest of its batch are dropped. Other frames are dropped at once when there
        is no room.
        """
        if not table:
            return sum(self.send(name, t, b) for t, b in frames)
        encoded = [self._encode(t, b) for t, b in frames]
        if not encoded:
            return 0
        now = _mono_ms()
        with self._lock:
            peer = self._peers.get(name)
            if peer is None or peer.conn is None:
                self._drop_send(peer, "down", len(encoded))
                return 0
            self._batch_seq += 1
            batch = self._batch_seq
            taken = 0
            for data in encoded:
                if not peer.waiting and self._has_room(peer, len(data)):
                    peer.queue.append(data)
                    peer.queue_bytes += len(data)
                elif (len(peer.waiting) < self._queue_frames_max
                      and peer.waiting_bytes + len(data) <= self._queue_bytes_max):
                    peer.waiting.append((data, batch, now))
                    peer.waiting_bytes += len(data)
                else:
                    break
                taken += 1
            if taken < len(encoded):
                self._drop_send(peer, "full", len(encoded) - taken)
        self._wake()
        return taken

    def peers(self) -> dict[str, dict[str, Any]]:
        """Every peer the links know: up, since_ms, sent, received, dropped (outgoing)."""
        with self._lock:
            return {
                p.name: {
                    "up": p.conn is not None,
                    "since_ms": p.since_ms,
                    "sent": p.sent,
                    "received": p.received,
                    "dropped": p.dropped,
                    "queued": len(p.queue),
                    "waiting": len(p.waiting),
                    "addr": f"{p.addr[0]}:{p.addr[1]}" if p.addr else None,
                    "boot": p.hello.get("boot") if p.hello else None,
                }
                for p in self._peers.values()
            }

    def stats(self) -> dict[str, Any]:
        """Counters: `dropped` (incoming garbage, by reason), `send_dropped` (outgoing frames
        dropped, by reason: down, full, table_wait), `peers_up`, `pending` (connections without
        a hello yet), `conns` (connections with one), `sent`, `received`."""
        with self._lock:
            return {
                "dropped": dict(self._dropped),
                "send_dropped": dict(self._send_dropped),
                "peers_up": sum(1 for p in self._peers.values() if p.conn is not None),
                "pending": self._pending,
                "conns": self._established,
                "sent": sum(p.sent for p in self._peers.values()),
                "received": sum(p.received for p in self._peers.values()),
            }

    def stop(self) -> None:
        """Make `run` return (and close every socket). Safe to call more than once."""
        with self._lock:
            self._stopping = True
            started = self._started
        if started:
            self._wake()
        else:
            self._close_all()

    # --- the link thread ---------------------------------------------------------------------

    def run(self) -> None:
        """The thread body: returns after `stop()`."""
        with self._lock:
            if self._stopping or self._started:
                return
            self._started = True
        try:
            while not self._stopping:
                for key, mask in self._sel.select(_TICK_S):
                    if key.data is _LISTEN:
                        self._accept()
                    elif key.data is _WAKE:
                        self._drain_wake()
                    else:
                        self._ready(key.data, mask)
                self._timers()
                self._flush()
        finally:
            self._close_all()

    # --- inside the link thread --------------------------------------------------------------

    def _peer(self, name: str) -> _Peer:
        peer = self._peers.get(name)
        if peer is None:
            peer = self._peers[name] = _Peer(name)
        return peer

    def _encode(self, ftype: FrameType, body: dict[str, Any]) -> bytes:
        return encode(ftype, body, self._secret, self._clock_ms(), os.urandom(NONCE_BYTES),
                      self._frame_bytes_max)

    def _has_room(self, peer: _Peer, size: int) -> bool:
        return (len(peer.queue) < self._queue_frames_max
                and peer.queue_bytes + size <= self._queue_bytes_max)

    def _drop_send(self, peer: _Peer | None, reason: str, n: int) -> None:
        # Called with the lock held.
        self._send_dropped[reason] = self._send_dropped.get(reason, 0) + n
        if peer is not None:
            peer.dropped += n

    def _count(self, reason: str) -> None:
        with self._lock:
            self._dropped[reason] = self._dropped.get(reason, 0) + 1

    def _wake(self) -> None:
        # Under the lock, so that the pipe is never written after _close_all closed it (its
        # descriptor number may belong to another file by then).
        with self._lock:
            if self._done:
                return
            try:
                os.write(self._wake_w, b"x")
            except BlockingIOError:
                pass  # a full pipe already wakes the loop

    def _drain_wake(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except (BlockingIOError, OSError):
            pass

    def _hello(self, to: str) -> bytes:
        host, port = self.address
        return self._encode(FrameType.F_HELLO, {"name": self.self_name, "boot": self.boot,
                                                "peer": f"{host}:{port}", "to": to})

    def _new_conn(self, sock: socket.socket, outgoing: bool, name: str | None) -> _Conn:
        self._conn_seq += 1
        decoder = FrameDecoder(self._secret, self._frame_bytes_max, nonces=self._nonces)
        conn = _Conn(sock, outgoing, name, decoder, _mono_ms(), self._conn_seq)
        self._sel.register(sock, conn.events, conn)
        self._conns.add(conn)
        return conn

    def _accept(self) -> None:
        for _ in range(limits.link_pending_conns_max):
            try:
                sock, _addr = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                # Out of file descriptors and the like: try again on the next turn.
                self._log.warning("link_accept_failed", error=str(e))
                return
            with self._lock:
                full = self._pending >= limits.link_pending_conns_max
                if not full:
                    self._pending += 1
            if full:
                self._count("pending_full")
                sock.close()
                continue
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._new_conn(sock, outgoing=False, name=None)

    def _dial(self, peer: _Peer) -> None:
        # Called with the lock held; the socket calls below do not block (an IP address does
        # not resolve; a host name resolves once, at dial time).
        assert peer.addr is not None
        host, port = peer.addr
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            sock.connect_ex((host, port))
        except OSError as e:
            sock.close()
            self._log.info("link_dial_failed", peer=peer.name, error=str(e))
            self._backoff(peer)
            return
        peer.dialing = self._new_conn(sock, outgoing=True, name=peer.name)

    def _backoff(self, peer: _Peer) -> None:
        # Called with the lock held. Jitter keeps a fleet from redialling in step.
        peer.next_dial_ms = _mono_ms() + peer.backoff_ms * random.uniform(0.5, 1.0)
        peer.backoff_ms = min(peer.backoff_ms * 2, float(limits.link_connect_backoff_ms_max))

    def _ready(self, conn: _Conn, mask: int) -> None:
        if conn.closed:
            return
        if conn.connecting:
            if mask & (selectors.EVENT_WRITE | selectors.EVENT_READ):
                err = conn.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                if err:
                    self._close(conn, f"connect: {os.strerror(err)}")
                    return
                conn.connecting = False
                assert conn.name is not None
                conn.out += self._hello(conn.name)
                self._set_events(conn)
            return
        if mask & selectors.EVENT_READ:
            self._read(conn)
        if mask & selectors.EVENT_WRITE and not conn.closed:
            self._write(conn)

    def _read(self, conn: _Conn) -> None:
        for _ in range(_READS_PER_TURN):
            want = min(limits.link_io_bytes, conn.decoder.room())
            try:
                data = conn.sock.recv(want)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                self._close(conn, f"recv: {e}")
                return
            if not data:
                self._close(conn, "eof")
                return
            conn.last_recv_ms = _mono_ms()
            conn.decoder.receive_data(data)
            while True:
                try:
                    frame = conn.decoder.next_frame(self._clock_ms())
                except FrameError as e:
                    self._garbage(conn, e.reason, e.detail)
                    return
                if frame is None:
                    break
                self._frame(conn, frame)
                if conn.closed:
                    return
            if len(data) < want:
                return

    def _garbage(self, conn: _Conn, reason: str, detail: str = "") -> None:
        self._count(reason)
        self._log.warning("link_garbage", reason=reason, detail=detail,
                          peer=conn.name if conn.established else None)
        self._close(conn, reason)

    def _frame(self, conn: _Conn, frame: Frame) -> None:
        if not conn.established:
            self._handshake(conn, frame)
            return
        if frame.type == FrameType.F_HELLO:
            self._garbage(conn, "hello", "a second hello")
            return
        if frame.type == FrameType.F_PING:
            return
        assert conn.name is not None
        with self._lock:
            peer = self._peers.get(conn.name)
            if peer is not None:
                peer.received += 1
        self._on_frame(conn.name, frame)

    def _handshake(self, conn: _Conn, frame: Frame) -> None:
        body = frame.body
        if frame.type != FrameType.F_HELLO:
            self._garbage(conn, "hello", f"first frame is {frame.type.name}")
            return
        name, boot, peer_addr, to = (body.get(k) for k in ("name", "boot", "peer", "to"))
        if not (isinstance(name, str) and name and isinstance(boot, str)
                and isinstance(peer_addr, str) and isinstance(to, str)):
            self._garbage(conn, "hello", "missing or mistyped fields")
            return
        if to == DISCOVER and not conn.outgoing and self._discovery is not None:
            self._discover_reply(conn, name)
            return
        if to != self.self_name or name == self.self_name:
            self._garbage(conn, "hello", f"hello from {name!r} to {to!r}")
            return
        if conn.outgoing and name != conn.name:
            self._garbage(conn, "hello", f"dialled {conn.name!r}, {name!r} answered")
            return
        if not conn.outgoing and self.self_name < name:
            with self._lock:
                peer = self._peers.get(name)
                dialing = peer is not None and peer.dialing is not None
            if dialing:
                # Our own dial to this peer is in flight and, our name sorting lower, it is the
                # one both sides will keep: refuse this one now rather than bring it up and
                # down again. Should our dial fail, the peer's next dial is accepted.
                self._close(conn, "duplicate")
                return
        conn.name = name
        conn.hello = dict(body)
        conn.established = True
        conn.dialler = self.self_name if conn.outgoing else name
        if not conn.outgoing:
            # The acceptor answers only a good hello, so a stranger learns nothing.
            conn.out += self._hello(name)
        events: list[tuple[bool, dict[str, Any]]] = []
        loser: _Conn | None = None
        with self._lock:
            if not conn.outgoing:
                self._pending -= 1
            self._established += 1
            peer = self._peer(name)
            if peer.dialing is conn:
                peer.dialing = None
            old = peer.conn
            if old is None:
                keep = conn
            else:
                keep = self._choose(old, conn)
                loser = conn if keep is old else old
            if keep is conn:
                if old is not None and old.hello is not None and old.hello.get("boot") != boot:
                    # The peer restarted: its old connection is a ghost of its last boot.
                    events.append((False, old.hello))
                    old = None
                peer.conn = conn
                peer.hello = conn.hello
                peer.backoff_ms = float(limits.link_connect_backoff_ms_base)
                if old is None:
                    peer.since_ms = self._clock_ms()
                    events.append((True, conn.hello))
        self._log.info("link_up", peer=name, outgoing=conn.outgoing, replaces=loser is not None)
        if loser is not None:
            self._close(loser, "duplicate")
        self._set_events(conn)
        self._report(name, events)

    def _discover_reply(self, conn: _Conn, name: str) -> None:
        """A member that knows only our address asked who we are and who the voters are (a
        worker joining with `join = "host:port"`): answer with our hello and the voters, then
        close. The answer is a few hundred bytes on a fresh socket, so the send does not wait."""
        assert self._discovery is not None
        host, port = self.address
        reply = self._encode(FrameType.F_HELLO, {
            "name": self.self_name, "boot": self.boot, "peer": f"{host}:{port}", "to": name,
            "voters": self._discovery()})
        try:
            conn.sock.setblocking(True)
            conn.sock.settimeout(1.0)
            conn.sock.sendall(reply)
        except OSError:
            pass
        self._count("discovery")
        self._close(conn, "discovery")

    def _choose(self, old: _Conn, new: _Conn) -> _Conn:
        """Of two connections to one peer, the one to keep (both sides choose the same)."""
        assert old.hello is not None and new.hello is not None
        if old.hello.get("boot") != new.hello.get("boot") or old.dialler == new.dialler:
            return new
        assert new.name is not None
        lower = min(self.self_name, new.name)
        return old if old.dialler == lower else new

    def _report(self, name: str, events: list[tuple[bool, dict[str, Any]]]) -> None:
        if self._on_peer is not None:
            for up, hello in events:
                self._on_peer(name, up, hello)

    def _close(self, conn: _Conn, why: str) -> None:
        if conn.closed:
            return
        conn.closed = True
        self._conns.discard(conn)
        try:
            self._sel.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        conn.sock.close()
        events: list[tuple[bool, dict[str, Any]]] = []
        name = conn.name
        with self._lock:
            if conn.established:
                self._established -= 1
            elif not conn.outgoing:
                self._pending -= 1
            peer = self._peers.get(name) if name is not None else None
            if peer is not None:
                if peer.dialing is conn:
                    peer.dialing = None
                    if not conn.established:
                        self._backoff(peer)
                if peer.conn is conn:
                    peer.conn = None
                    peer.since_ms = None
                    # Queued frames were for that connection; the peer catches up from the
                    # committed log once it is back.
                    dropped = len(peer.queue) + len(peer.waiting)
                    if dropped:
                        self._drop_send(peer, "down", dropped)
                    peer.queue.clear()
                    peer.queue_bytes = 0
                    peer.waiting.clear()
                    peer.waiting_bytes = 0
                    peer.next_dial_ms = _mono_ms() + peer.backoff_ms
                    assert conn.hello is not None
                    events.append((False, conn.hello))
        if conn.established:
            self._log.info("link_down", peer=name, why=why)
        else:
            self._log.debug("link_closed", peer=name, why=why)
        if name is not None:
            self._report(name, events)

    def _timers(self) -> None:
        now = _mono_ms()
        for conn in list(self._conns):
            if conn.closed:
                continue
            if not conn.established:
                if now - conn.created_ms > self._hello_ms_max:
                    if conn.outgoing:
                        self._close(conn, "hello_timeout")
                    else:
                        self._garbage(conn, "hello_timeout")
            elif now - conn.last_recv_ms > self._silent_ms_max:
                self._garbage(conn, "silent")
        with self._lock:
            for peer in self._peers.values():
                if (peer.addr is not None and peer.conn is None and peer.dialing is None
                        and not self._stopping and now >= peer.next_dial_ms):
                    self._dial(peer)
                self._drain_waiting(peer, now)

    def _drain_waiting(self, peer: _Peer, now: float) -> None:
        # Called with the lock held: move waiting table frames into the queue as room appears;
        # a frame that waited too long drops the rest of its batch.
        while peer.waiting:
            data, batch, since = peer.waiting[0]
            if self._has_room(peer, len(data)):
                peer.waiting.popleft()
                peer.waiting_bytes -= len(data)
                peer.queue.append(data)
                peer.queue_bytes += len(data)
            elif now - since >= self._table_wait_ms:
                dropped = 0
                while peer.waiting and peer.waiting[0][1] == batch:
                    peer.waiting_bytes -= len(peer.waiting.popleft()[0])
                    dropped += 1
                self._drop_send(peer, "table_wait", dropped)
                self._log.info("link_table_frames_dropped", peer=peer.name, frames=dropped)
            else:
                return

    def _flush(self) -> None:
        now = _mono_ms()
        for conn in list(self._conns):
            if conn.closed or conn.connecting:
                continue
            if conn.established and len(conn.out) < limits.link_io_bytes:
                with self._lock:
                    peer = self._peers.get(conn.name) if conn.name is not None else None
                    if peer is not None and peer.conn is conn:
                        while peer.queue and len(conn.out) < limits.link_io_bytes:
                            data = peer.queue.popleft()
                            peer.queue_bytes -= len(data)
                            conn.out += data
                            peer.sent += 1
                        self._drain_waiting(peer, now)
                if not conn.out and now - conn.last_sent_ms >= self._idle_ms:
                    conn.out += self._encode(FrameType.F_PING, {})
            if conn.out:
                self._write(conn)
            if not conn.closed:
                self._set_events(conn)

    def _write(self, conn: _Conn) -> None:
        while conn.out:
            try:
                n = conn.sock.send(conn.out[: limits.link_io_bytes])
            except (BlockingIOError, InterruptedError):
                break
            except OSError as e:
                self._close(conn, f"send: {e}")
                return
            if n <= 0:
                break
            del conn.out[:n]
            conn.last_sent_ms = _mono_ms()

    def _set_events(self, conn: _Conn) -> None:
        if conn.closed:
            return
        if conn.connecting:
            events = selectors.EVENT_WRITE
        else:
            events = selectors.EVENT_READ | (selectors.EVENT_WRITE if conn.out else 0)
        if events != conn.events:
            conn.events = events
            self._sel.modify(conn.sock, events, conn)

    def _close_all(self) -> None:
        with self._lock:
            if self._done:
                return
            self._done = True
        for conn in list(self._conns):
            conn.closed = True
            conn.sock.close()
        self._conns.clear()
        with self._lock:
            self._established = 0
            self._pending = 0
            for peer in self._peers.values():
                peer.conn = None
                peer.dialing = None
                peer.since_ms = None
        try:
            self._sel.close()
        except OSError:
            pass
        self._listener.close()
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass
