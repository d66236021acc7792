"""Member links: one sealed TCP connection per peer, with bounded send queues.

This is the IO edge around `frames` (the pure handshake and sealing). One thread (the caller
starts it with `run` as its body) runs a selector loop over the listening socket, every
connection, a wake-up pipe and the timers (redials, handshakes, pings, table frames waiting for
room). Other threads only call `connect`, `send`, `send_batch`, `peers`, `stats` and `stop`,
which take one short lock and never block on the network.

Rules:
- A connection opens with the handshake of `frames`: the dialler's F_HELLO `{"name", "boot",
  "peer", "to", "wall_ms", "version", "proto", "proto_min"}` and its nonce, the acceptor's
  F_CHALLENGE (its own hello fields and nonce), the dialler's F_PROOF. The acceptor answers only a good hello that is meant for it;
  until the proof no other frame is accepted, and a connection that has not completed its
  handshake within `link_hello_ms_max` is closed. The nonces and the fresh X25519 keys
  come from `os.urandom` here.
- Frames are queued as (type, packed body) and sealed when they are written to a connection:
  the keys and the frame count belong to one connection. No frame is checked against a clock;
  a hello whose `wall_ms` is more than `link_clock_skew_warn_ms` off ours is only logged.
- One connection per peer. If two are up (both sides dialled), both members keep the one dialled
  by the member whose name sorts lower; a newer boot of the peer, or a second connection dialled
  by the same member, replaces the older one.
- Every queue is bounded: `link_queue_frames_max` / `link_queue_bytes_max` frames waiting to be
  written per peer, and as many table frames waiting for room. Frames to a peer that is down are
  dropped. Nothing correct may depend on a frame arriving; every drop is counted.
- Garbage from outside (any `FrameError`, a bad hello, a silent or handshake-less connection)
  closes that connection, is counted by reason in `stats()["dropped"]` and is logged with the
  peer's name (when it gave one) and address. It never raises out of `run`. An exception from
  the `on_frame` / `on_peer` callbacks is a bug of ours and does.
- The handshake frames, F_PING and F_VOTERS are the links' own: they are not passed to
  `on_frame`.
- Versions (meshjobs/versions.py): a peer whose link protocols do not overlap ours is refused
  on both ends, each logging both versions and which member to upgrade, counted as "protocol".
  The acceptor still sends its challenge first (its versions in it), so that the dialler can
  say so too; the dialler then sends no proof.
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

import meshjobs
from meshjobs import limits, versions
from meshjobs.frames import (
    KX_BYTES,
    NONCE_BYTES,
    Frame,
    FrameError,
    FrameType,
    Hello,
    Role,
    Session,
    pack,
    sealed_bytes,
)

_LISTEN = object()
_WAKE = object()
# Reads of one connection per loop turn, so that one busy peer cannot starve the others.
_READS_PER_TURN = limits.link_reads_per_turn_max
# The loop wakes at least this often to run its timers.
_TICK_S = limits.link_tick_s


DISCOVER = "*"  # the `to` of a hello that asks "who are you and who are the voters?"

# What an operator should know about a refusal, by reason (logged with it).
_HINTS = {
    "magic": "not a member link of this version (MJF2): another program, or an older meshjobs",
    "mac": "its hello is not signed with our fleet secret: is its secret file the fleet's?",
    "challenge": "the member dialled does not hold our fleet secret (or its answer was replayed)",
    "proof": "the dialler did not prove it holds the fleet secret (a replayed handshake?)",
    "aead": "a sealed frame did not open: bytes changed, replayed or reordered on the way",
}


def discover(addr: tuple[str, int], self_name: str, boot: str, secret: bytes,
             timeout_s: float = limits.link_discover_s_max) -> dict[str, Any]:
    """Ask the member at `addr` for its hello and the fleet's voters (blocking; used once when a
    worker member starts with `join`), over a whole handshake: the answer comes only after both
    ends proved they hold the secret. Raises OSError or FrameError when it cannot."""
    deadline = time.monotonic() + timeout_s
    session = Session(secret, Role.DIALLER)
    hello: dict[str, Any] | None = None
    with socket.create_connection(addr, timeout=timeout_s) as sock:
        sock.sendall(session.hello({"name": self_name, "boot": boot, "peer": "",
                                    "to": DISCOVER, "wall_ms": wall_ms(),
                                    **versions.hello_fields(meshjobs.version())},
                                   os.urandom(NONCE_BYTES), os.urandom(KX_BYTES)))
        while True:
            event = session.next_event()
            if isinstance(event, Hello):
                hello = event.body
                theirs = versions.protocols(hello)
                ours = (versions.PROTOCOL_MIN, versions.PROTOCOL)
                if versions.common(ours, theirs) is None:
                    detail, hint = versions.refusal(
                        f"the member at {addr[0]}:{addr[1]}", meshjobs.version(), ours,
                        versions.version_of(hello), theirs)
                    raise FrameError("protocol", f"{detail}; {hint}")
                sock.sendall(session.proof())
                continue
            if isinstance(event, Frame):
                voters = event.body.get("voters")
                if event.type != FrameType.F_VOTERS or not isinstance(voters, dict):
                    raise FrameError("hello", "the member did not answer with its voters")
                assert hello is not None
                return {**hello, "voters": voters}
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no answer from {addr[0]}:{addr[1]} within {timeout_s} s")
            sock.settimeout(left)
            data = sock.recv(min(session.room(), limits.link_discover_read_bytes))
            if not data:
                raise ConnectionError(f"{addr[0]}:{addr[1]} closed the connection")
            session.receive_data(data)


def wall_ms() -> int:
    """Milliseconds since the epoch: only logged (clock skew between members), never compared
    to refuse anything."""
    return time.time_ns() // 1_000_000


def _mono_ms() -> float:
    return time.monotonic() * 1000.0


def _parse_hostport(value: str) -> tuple[str, int]:
    host, _, port = value.rpartition(":")
    return host.strip("[]"), int(port)


class _Conn:
    """One TCP connection; touched only by the link thread."""

    __slots__ = ("sock", "outgoing", "name", "dialler", "session", "established", "hello",
                 "out", "connecting", "created_ms", "last_recv_ms", "last_sent_ms", "closed",
                 "events", "seq", "addr", "claimed", "discover")

    def __init__(self, sock: socket.socket, outgoing: bool, name: str | None,
                 session: Session, now: float, seq: int, addr: str) -> None:
        self.sock = sock
        self.outgoing = outgoing
        self.name = name  # for an outgoing connection, the peer it was dialled to
        self.dialler: str | None = None
        self.session = session
        self.addr = addr  # host:port of the other end, for the log
        self.claimed: str | None = None  # the name in its hello, before it is proven
        self.discover = False  # a joining worker asking for the voters
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


_Item = tuple[FrameType, bytes, int]


class _Peer:
    """What the links know of one peer; guarded by Links._lock."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.addr: tuple[str, int] | None = None
        self.conn: _Conn | None = None  # the established connection, if any
        self.dialing: _Conn | None = None
        self.next_dial_ms = 0.0
        self.backoff_ms = float(limits.link_connect_backoff_ms_base)
        # Frames to write, sealed only when written: (type, packed body, bytes on the wire).
        self.queue: deque[_Item] = deque()
        self.queue_bytes = 0
        # Table frames waiting for room: (frame, batch id, since when, monotonic ms).
        self.waiting: deque[tuple[_Item, int, float]] = deque()
        self.waiting_bytes = 0
        self.since_ms: int | None = None
        self.hello: dict[str, Any] | None = None
        self.skew_ms: int | None = None  # its wall clock minus ours, at its last handshake
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
                 discovery: Callable[[], dict[str, str]] | None = None,
                 version: str | None = None,
                 protocols: tuple[int, int] = (versions.PROTOCOL_MIN, versions.PROTOCOL)) -> None:
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
        # What our hellos say (meshjobs/versions.py); a test gives another release's.
        self._version = version if version is not None else meshjobs.version()
        self._protocols = protocols

        self._lock = threading.Lock()
        # Notified when frames leave a queue (or a link goes down): `send_wait` waits on it.
        self._room = threading.Condition(self._lock)
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
        item = self._pack(ftype, body)
        with self._lock:
            peer = self._peers.get(name)
            if peer is None or peer.conn is None:
                self._drop_send(peer, "down", 1)
                return False
            if not self._has_room(peer, item[2]):
                self._drop_send(peer, "full", 1)
                return False
            peer.queue.append(item)
            peer.queue_bytes += item[2]
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
        encoded = [self._pack(t, b) for t, b in frames]
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
            for item in encoded:
                if not peer.waiting and self._has_room(peer, item[2]):
                    peer.queue.append(item)
                    peer.queue_bytes += item[2]
                elif (len(peer.waiting) < self._queue_frames_max
                      and peer.waiting_bytes + item[2] <= self._queue_bytes_max):
                    peer.waiting.append((item, batch, now))
                    peer.waiting_bytes += item[2]
                else:
                    break
                taken += 1
            if taken < len(encoded):
                self._drop_send(peer, "full", len(encoded) - taken)
        self._wake()
        return taken

    def send_wait(self, name: str, ftype: FrameType, body: dict[str, Any],
                  wait_ms: int | None = None) -> bool:
        """Queue one table frame to `name`, waiting up to `wait_ms` (`table_frame_wait_ms`)
        for room in its queue: for a thread of its own that sends a long run of frames (a
        dump to a new worker, dumpsend.py) at the pace the link takes them, never the jobs
        thread. False when the peer is down or no room came in time: the frame is dropped,
        counted `down` or `table_wait`."""
        item = self._pack(ftype, body)
        deadline = _mono_ms() + (self._table_wait_ms if wait_ms is None else wait_ms)
        with self._room:
            while True:
                peer = self._peers.get(name)
                if peer is None or peer.conn is None or self._stopping:
                    self._drop_send(peer, "down", 1)
                    return False
                if not peer.waiting and self._has_room(peer, item[2]):
                    peer.queue.append(item)
                    peer.queue_bytes += item[2]
                    break
                left_ms = deadline - _mono_ms()
                if left_ms <= 0:
                    self._drop_send(peer, "table_wait", 1)
                    return False
                self._room.wait(left_ms / 1000)
        self._wake()
        return True

    def peers(self) -> dict[str, dict[str, Any]]:
        """Every peer the links know: up, since_ms, sent, received, dropped (outgoing), and
        clock_skew_ms (its wall clock minus ours at its last handshake; only informative)."""
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
                    "clock_skew_ms": p.skew_ms,
                    "version": versions.version_of(p.hello) if p.hello else None,
                }
                for p in self._peers.values()
            }

    def stats(self) -> dict[str, Any]:
        """Counters: `dropped` (incoming garbage, by reason), `send_dropped` (outgoing frames
        dropped, by reason: down, full, table_wait), `peers_up`, `pending` (accepted connections
        whose handshake is not complete), `conns` (connections whose handshake is), `sent`,
        `received`."""
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
            self._room.notify_all()
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

    def _pack(self, ftype: FrameType, body: dict[str, Any]) -> _Item:
        """A frame to queue: sealed later, when it is written to a connection. Raises ValueError
        if it would exceed frame_bytes_max (the sender's bug: callers size their batches)."""
        ftype = FrameType(ftype)
        packed = pack(body)
        size = sealed_bytes(len(packed))
        if size > self._frame_bytes_max:
            raise ValueError(f"frame of {size} bytes exceeds frame_bytes_max="
                             f"{self._frame_bytes_max}")
        return (ftype, packed, size)

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

    def _hello_body(self, to: str) -> dict[str, Any]:
        host, port = self.address
        return {"name": self.self_name, "boot": self.boot, "peer": f"{host}:{port}", "to": to,
                "wall_ms": self._clock_ms(), **versions.hello_fields(self._version, self._protocols)}

    def _new_conn(self, sock: socket.socket, outgoing: bool, name: str | None,
                  addr: str) -> _Conn:
        self._conn_seq += 1
        session = Session(self._secret, Role.DIALLER if outgoing else Role.ACCEPTOR,
                          self._frame_bytes_max)
        conn = _Conn(sock, outgoing, name, session, _mono_ms(), self._conn_seq, addr)
        self._sel.register(sock, conn.events, conn)
        self._conns.add(conn)
        return conn

    def _accept(self) -> None:
        for _ in range(limits.link_pending_conns_max):
            try:
                sock, addr = self._listener.accept()
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
            self._new_conn(sock, outgoing=False, name=None, addr=f"{addr[0]}:{addr[1]}")

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
        peer.dialing = self._new_conn(sock, outgoing=True, name=peer.name, addr=f"{host}:{port}")

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
                conn.out += conn.session.hello(self._hello_body(conn.name),
                                               os.urandom(NONCE_BYTES), os.urandom(KX_BYTES))
                self._set_events(conn)
            return
        if mask & selectors.EVENT_READ:
            self._read(conn)
        if mask & selectors.EVENT_WRITE and not conn.closed:
            self._write(conn)

    def _read(self, conn: _Conn) -> None:
        for _ in range(_READS_PER_TURN):
            want = min(limits.link_io_bytes, conn.session.room())
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
            conn.session.receive_data(data)
            while True:
                try:
                    event = conn.session.next_event()
                except FrameError as e:
                    conn.claimed = conn.claimed or e.claimed
                    self._garbage(conn, e.reason, e.detail)
                    return
                if event is None:
                    break
                if isinstance(event, Frame):
                    self._frame(conn, event)
                elif isinstance(event, Hello):
                    self._hello(conn, event.body)
                else:
                    self._proven(conn)
                if conn.closed:
                    return
            if len(data) < want:
                return

    def _garbage(self, conn: _Conn, reason: str, detail: str = "") -> None:
        self._count(reason)
        # The name is the proven one once linked, else whatever the other end claimed (or the
        # peer we dialled); the address is always known.
        self._log.warning("link_refused", reason=reason, detail=detail,
                          peer=conn.name or conn.claimed, addr=conn.addr,
                          proven=conn.established, outgoing=conn.outgoing,
                          hint=_HINTS.get(reason, ""))
        self._close(conn, reason)

    def _frame(self, conn: _Conn, frame: Frame) -> None:
        if frame.type == FrameType.F_PING:
            return
        if frame.type == FrameType.F_VOTERS:
            self._garbage(conn, "hello", "voters on a member link")
            return
        assert conn.name is not None
        with self._lock:
            peer = self._peers.get(conn.name)
            if peer is not None:
                peer.received += 1
        self._on_frame(conn.name, frame)

    def _hello(self, conn: _Conn, body: dict[str, Any]) -> None:
        """The other end's hello (we accepted) or challenge (we dialled), its MAC good."""
        name, boot, peer_addr, to = (body.get(k) for k in ("name", "boot", "peer", "to"))
        if not (isinstance(name, str) and name and isinstance(boot, str)
                and isinstance(peer_addr, str) and isinstance(to, str)):
            self._garbage(conn, "hello", "missing or mistyped fields")
            return
        conn.claimed = name
        try:
            theirs = versions.protocols(body)
        except FrameError as e:
            self._garbage(conn, e.reason, e.detail)
            return
        compatible = versions.common(self._protocols, theirs) is not None
        if conn.outgoing:
            if name != conn.name or to != self.self_name:
                self._garbage(conn, "hello", f"dialled {conn.name!r}, {name!r} answered to {to!r}")
                return
            if not compatible:
                self._refuse_protocol(conn, name, body, theirs)
                return
            conn.hello = dict(body)
            conn.out += conn.session.proof()
            self._establish(conn)
            return
        if to == DISCOVER and self._discovery is not None:
            conn.discover = True
        elif to != self.self_name or name == self.self_name:
            self._garbage(conn, "hello", f"hello from {name!r} to {to!r}")
            return
        elif self.self_name < name:
            with self._lock:
                peer = self._peers.get(name)
                dialing = peer is not None and peer.dialing is not None
            if dialing:
                # Our own dial to this peer is in flight and, our name sorting lower, it is the
                # one both sides will keep: refuse this one now rather than bring it up and
                # down again. Should our dial fail, the peer's next dial is accepted.
                self._close(conn, "duplicate")
                return
        conn.hello = dict(body)
        # The acceptor answers only a good hello meant for it, so a stranger learns nothing,
        # and one that replays a recorded hello gets a challenge it cannot answer.
        conn.out += conn.session.challenge(self._hello_body(name), os.urandom(NONCE_BYTES),
                                           os.urandom(KX_BYTES))
        if not compatible:
            # Our challenge first (a few hundred bytes on a fresh socket: one send, no wait),
            # so that the dialler learns our versions and says why too.
            try:
                conn.sock.send(conn.out)
            except OSError:
                pass
            self._refuse_protocol(conn, name, body, theirs)

    def _refuse_protocol(self, conn: _Conn, name: str, body: dict[str, Any],
                         theirs: tuple[int, int]) -> None:
        """A peer whose link protocols do not overlap ours: counted as "protocol", logged with
        both versions and which member to upgrade, closed."""
        detail, hint = versions.refusal(name, self._version, self._protocols,
                                        versions.version_of(body), theirs)
        self._count("protocol")
        self._log.warning("link_refused", reason="protocol", detail=detail, peer=name,
                          addr=conn.addr, proven=False, outgoing=conn.outgoing,
                          version=self._version, peer_version=versions.version_of(body),
                          hint=hint)
        self._close(conn, "protocol")

    def _proven(self, conn: _Conn) -> None:
        """The dialler proved it holds the secret: the connection is the claimed member's."""
        if conn.discover:
            self._discover_reply(conn)
        else:
            self._establish(conn)

    def _skew(self, name: str, hello: dict[str, Any]) -> int | None:
        """The peer's wall clock minus ours, logged when large; never a reason to refuse."""
        theirs = hello.get("wall_ms")
        if not isinstance(theirs, int) or isinstance(theirs, bool):
            return None
        skew = theirs - self._clock_ms()
        if abs(skew) > limits.link_clock_skew_warn_ms:
            self._log.warning("link_clock_skew", peer=name, skew_ms=skew,
                              hint="the links do not depend on it, but logs and job times "
                                   "will disagree: check NTP on both members")
        return skew

    def _establish(self, conn: _Conn) -> None:
        assert conn.hello is not None
        name, boot = conn.hello["name"], conn.hello["boot"]
        conn.name = name
        conn.established = True
        conn.dialler = self.self_name if conn.outgoing else name
        skew = self._skew(name, conn.hello)
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
                peer.skew_ms = skew
                peer.backoff_ms = float(limits.link_connect_backoff_ms_base)
                if old is None:
                    peer.since_ms = self._clock_ms()
                    events.append((True, conn.hello))
        self._log.info("link_up", peer=name, addr=conn.addr, outgoing=conn.outgoing,
                       replaces=loser is not None)
        if loser is not None:
            self._close(loser, "duplicate")
        self._set_events(conn)
        self._report(name, events)

    def _discover_reply(self, conn: _Conn) -> None:
        """A member that knows only our address asked who we are and who the voters are (a
        worker joining with `join = "host:port"`) and proved it holds the secret: answer with
        the voters, then close. The answer is a few hundred bytes on a fresh socket, so the send
        does not wait."""
        assert self._discovery is not None
        conn.out += conn.session.seal(FrameType.F_VOTERS, {"voters": self._discovery()})
        try:
            conn.sock.setblocking(True)
            conn.sock.settimeout(limits.link_voters_send_s_max)
            conn.sock.sendall(conn.out)
        except OSError:
            pass
        conn.out.clear()
        self._count("discovery")
        self._log.info("link_discovery", peer=conn.claimed, addr=conn.addr)
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
                    self._room.notify_all()
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
            item, batch, since = peer.waiting[0]
            if self._has_room(peer, item[2]):
                peer.waiting.popleft()
                peer.waiting_bytes -= item[2]
                peer.queue.append(item)
                peer.queue_bytes += item[2]
            elif now - since >= self._table_wait_ms:
                dropped = 0
                while peer.waiting and peer.waiting[0][1] == batch:
                    peer.waiting_bytes -= peer.waiting.popleft()[0][2]
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
                taken: list[_Item] = []
                room = limits.link_io_bytes - len(conn.out)
                with self._lock:
                    peer = self._peers.get(conn.name) if conn.name is not None else None
                    if peer is not None and peer.conn is conn:
                        while peer.queue and room > 0:
                            item = peer.queue.popleft()
                            peer.queue_bytes -= item[2]
                            room -= item[2]
                            taken.append(item)
                            peer.sent += 1
                        self._drain_waiting(peer, now)
                        if taken:
                            self._room.notify_all()
                # Sealed here, outside the lock and in the order written: the AEAD nonce is
                # the count of frames sealed before on this connection.
                for ftype, packed, _ in taken:
                    conn.out += conn.session.seal_packed(ftype, packed)
                if not conn.out and now - conn.last_sent_ms >= self._idle_ms:
                    conn.out += conn.session.seal(FrameType.F_PING, {})
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
