"""The Raft port: pysyncobj's transport (its `transportClass` seam) over sealed frames.

This is the IO edge around `frames` (the handshake and sealing of the member links) and
`raftwire` (Raft message dicts <-> msgpack bodies). It replaces pysyncobj's TCP transport, which
pickled, compressed and Fernet-encrypted every message: nothing on the Raft port is pickled,
compressed or Fernet-encrypted now.

Rules:
- It runs on pysyncobj's poller, so on the jobs thread alone (the only thread that ticks the
  replica): a message is handed to pysyncobj in the poll that read it, as pysyncobj's own
  transport did. It starts no thread and takes no lock.
- The server socket binds exactly the configured address (`bindAddress`, the member's Raft
  address), never every interface.
- A connection opens with the handshake of `frames`: the dialler's F_HELLO
  `{"raft": its Raft address, "to": the address dialled, "wall_ms"}`, the acceptor's F_CHALLENGE
  `{"raft": its Raft address, "wall_ms"}`, the dialler's F_PROOF. The acceptor answers only a
  hello from a voter it knows that is meant for it; the dialler goes on only if the challenge
  comes from the voter it dialled. Both carry the sender's version and link protocols
  (meshjobs/versions.py): a voter with no protocol in common is refused on both ends, counted
  as `protocol` (the acceptor sends its challenge first, so that the dialler says so too). As
  in pysyncobj, only the voter whose address sorts greater dials; a newer connection from a
  voter replaces the older one. A connection that has not completed its handshake within
  `link_hello_ms_max` is closed; at most `link_pending_conns_max` are pending at once.
- Every Raft message is one sealed F_RAFT frame of at most `raft_message_bytes_max` bytes: MAC'd,
  replay-protected (the AEAD nonce is the frame's count on its connection) and keyed by the
  fleet secret and the handshake's fresh keys. An idle connection carries an F_PING every
  `raft_ping_s`; one that brings nothing for `raft_idle_s_max` is closed (a peer that stopped).
- The durability gate: `send` makes the journal durable before a message leaves (one fsync
  covers a whole tick's worth of sends; `journal.sync` returns at once when nothing is new),
  except a leader's AppendEntries (etcd's rule: they acknowledge nothing; the leader's own fsync
  overlaps its followers', and the replica counts the leader in a commit only after it).
- Bytes waiting to be written to one connection are bounded (`raft_send_queue_bytes_max`): a
  peer that does not read is cut off (Raft resends once it is back).
- Garbage from outside (any `FrameError`, a hello from a stranger, an F_RAFT frame that is not a
  good message) closes that connection and is counted by reason in `dropped` (shown in /metrics
  as `raft_dropped_<reason>`): `oversized` for a length over the limit, `garbage` for bytes that
  are not our frames or messages, `mac`, `challenge`, `proof`, `aead` and `stranger` for the
  handshake and seal refusals, `silent` for a handshake not completed in time, `pending` when
  too many are. It never raises out of the poll; an exception of pysyncobj's handling of a good
  message is a bug of ours and does.
"""

from __future__ import annotations

import errno
import functools
import os
import socket
import threading
import time
from typing import Any

import structlog
from pysyncobj.dns_resolver import globalDnsResolver
from pysyncobj.poller import POLL_EVENT_TYPE
from pysyncobj.transport import Transport, TransportNotReadyError

import meshjobs
from meshjobs import limits, raftwire, versions
from meshjobs.frames import (
    KX_BYTES,
    NONCE_BYTES,
    Frame,
    FrameError,
    FrameType,
    Hello,
    Ready,
    Role,
    Session,
)

log = structlog.get_logger(__name__)

_READ_BYTES = limits.raft_read_bytes  # one recv
_READS_PER_EVENT = limits.raft_reads_per_event_max
_RW = POLL_EVENT_TYPE.READ | POLL_EVENT_TYPE.ERROR
_RWW = _RW | POLL_EVENT_TYPE.WRITE
# What each FrameError reason is counted as (the names /metrics has shown since pysyncobj's
# transport: `oversized` and `garbage`).
_REASONS = {"length": "oversized", "magic": "garbage", "type": "garbage", "flags": "garbage",
            "body": "garbage", "handshake": "garbage", "message": "garbage", "mac": "mac",
            "challenge": "challenge", "proof": "proof", "aead": "aead", "hello": "stranger",
            "protocol": "protocol"}


def _mono() -> float:
    return time.monotonic()


class _Conn:
    """One TCP connection of the Raft port."""

    __slots__ = ("sock", "fd", "session", "node", "outgoing", "connecting", "out", "created",
                 "last_recv", "last_sent", "closed", "addr")

    def __init__(self, sock: socket.socket, session: Session, outgoing: bool, addr: str) -> None:
        self.sock = sock
        self.fd = sock.fileno()
        self.session = session
        self.node: Any = None  # the pysyncobj node, once the handshake is done
        self.outgoing = outgoing
        self.connecting = outgoing
        self.out = bytearray()
        self.created = self.last_recv = self.last_sent = _mono()
        self.closed = False
        self.addr = addr


def bind_choice(infos: list) -> tuple:
    """Of getaddrinfo's answers for our own Raft address, the one to listen on: IPv4 when the
    name has one, as pysyncobj's resolver dials IPv4 first (a name such as `localhost` that is
    both ::1 and 127.0.0.1 would otherwise be listened on at ::1 and dialled at 127.0.0.1)."""
    return next((i for i in infos if i[0] == socket.AF_INET), infos[0])


class SealedTransport(Transport):
    """pysyncobj's transport for meshjobs: see the module's rules. The fleet secret is the
    SyncObj's `fleet_secret`; the journal gate its `journal_sync()`."""

    def __init__(self, syncObj: Any, selfNode: Any, otherNodes: Any) -> None:
        super().__init__(syncObj, selfNode, otherNodes)
        if selfNode is None:
            raise AssertionError("meshjobs has no read-only Raft nodes")
        self._so = syncObj
        self._secret: bytes = syncObj.fleet_secret
        self._self = selfNode
        self._poller = syncObj._poller
        self._nodes: dict[str, Any] = {}  # address -> node
        self._conns: dict[Any, _Conn] = {}  # node -> its open (handshake done) connection
        self._dialing: dict[Any, _Conn] = {}  # node -> our connection still in its handshake
        self._pending: set[_Conn] = set()  # accepted, handshake not done
        self._last_dial: dict[Any, float] = {}
        self._server: socket.socket | None = None
        self._ready = False
        self._bind_attempts = 0
        self._last_bind = 0.0
        self._bind_over = threading.Event()
        self._destroyed = False
        self.dropped: dict[str, int] = {}
        self.sent_frames = 0  # Raft messages sealed and queued (all voters)
        self.sent_entries = 0  # log entries in them
        for node in otherNodes:
            self.addNode(node)
        # pysyncobj's resolver keeps an address 600 s (a failed lookup 30 s): a voter that comes
        # back on another address under its name (a rescheduled pod, a recreated container)
        # would be dialled at its old one for ten minutes.
        globalDnsResolver().setTimeouts(limits.raft_dns_cache_s, limits.raft_dns_retry_s)
        syncObj.addOnTickCallback(self._on_tick)

    # --- pysyncobj's interface ---------------------------------------------------------------

    @property
    def ready(self) -> bool:
        return self._ready

    def tryGetReady(self) -> None:
        conf = self._so.conf
        if self._ready or _mono() < self._last_bind + conf.bindRetryTime:
            return
        self._last_bind = _mono()
        try:
            self._bind(conf.bindAddress or self._self.address)
        except OSError as exc:
            self._bind_attempts += 1
            log.warning("raft.bind_failed", address=conf.bindAddress, error=str(exc),
                        attempt=self._bind_attempts)
            if conf.maxBindRetries and self._bind_attempts >= conf.maxBindRetries:
                self._bind_over.set()
                raise TransportNotReadyError from exc
            return
        self._ready = True
        self._bind_over.set()

    def waitReady(self) -> None:
        self._bind_over.wait()
        if not self._ready:
            raise TransportNotReadyError

    def addNode(self, node: Any) -> None:
        self._nodes[node.address] = node

    def dropNode(self, node: Any) -> None:
        self._nodes.pop(node.address, None)
        for conns in (self._conns, self._dialing):
            conn = conns.get(node)
            if conn is not None:
                self._close(conn, notify=False)
        self._last_dial.pop(node, None)

    def send(self, node: Any, message: Any) -> bool:
        # The gate: what leaves may acknowledge log entries or a vote; they are durable first.
        # etcd's rule: a leader's own AppendEntries acknowledge nothing and may leave before its
        # fsync (the followers' fsyncs overlap the leader's); the leader counts itself in a
        # commit only once its own entries are durable (`Replica._onTick`).
        if message.get("type") != "append_entries":
            self._so.journal_sync()
        conn = self._conns.get(node)
        if conn is None or conn.closed:
            return False
        body = raftwire.encode(message)
        frame = conn.session.seal(FrameType.F_RAFT, body)
        self._write(conn, frame)
        self.sent_frames += 1
        self.sent_entries += len(body.get("entries", ()))
        return not conn.closed

    def destroy(self) -> None:
        self._destroyed = True
        self.setOnMessageReceivedCallback(None)
        self.setOnNodeConnectedCallback(None)
        self.setOnNodeDisconnectedCallback(None)
        for conn in [*self._conns.values(), *self._dialing.values(), *self._pending]:
            self._close(conn, notify=False)
        if self._server is not None:
            self._poller.unsubscribe(self._server.fileno())
            self._server.close()
            self._server = None

    # --- bind, accept, dial --------------------------------------------------------------------

    def _bind(self, address: str) -> None:
        host, _, port = address.rpartition(":")
        host = host.strip("[]")
        infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
        family, _, _, _, sockaddr = bind_choice(infos)
        server = socket.socket(family, socket.SOCK_STREAM)
        try:
            server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            server.setblocking(False)
            server.bind(sockaddr)
            server.listen(limits.link_pending_conns_max)
        except OSError:
            server.close()
            raise
        self._server = server
        self._poller.subscribe(server.fileno(), self._on_accept, _RW)

    def _on_accept(self, _fd: int, event: int) -> None:
        server = self._server
        if server is None:
            return
        for _ in range(limits.link_pending_conns_max):
            try:
                sock, addr = server.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # out of descriptors, say: the listener stays, we retry later
                log.warning("raft.accept_failed", error=str(exc))
                return
            if len(self._pending) >= limits.link_pending_conns_max:
                self._count("pending")
                sock.close()
                continue
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = _Conn(sock, Session(self._secret, Role.ACCEPTOR, limits.raft_message_bytes_max),
                         outgoing=False, addr=f"{addr[0]}:{addr[1]}")
            self._pending.add(conn)
            self._poller.subscribe(conn.fd, functools.partial(self._on_event, conn), _RW)

    def _should_dial(self, node: Any) -> bool:
        return self._self.address > node.address

    def _dial(self, node: Any) -> None:
        self._last_dial[node] = _mono()
        host, _, port = node.address.rpartition(":")
        # pysyncobj's resolver caches names (and failures): no lookup blocks every retry.
        ip = globalDnsResolver().resolve(host.strip("[]"))
        if ip is None:
            log.warning("raft.resolve_failed", peer=node.address)
            return
        try:
            infos = socket.getaddrinfo(ip, int(port), type=socket.SOCK_STREAM,
                                       flags=socket.AI_NUMERICHOST)
        except OSError as exc:
            log.warning("raft.resolve_failed", peer=node.address, error=str(exc))
            return
        family, _, _, _, sockaddr = infos[0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        rc = sock.connect_ex(sockaddr)
        if rc not in (0, errno.EINPROGRESS, errno.EAGAIN):
            sock.close()
            return
        session = Session(self._secret, Role.DIALLER, limits.raft_message_bytes_max)
        conn = _Conn(sock, session, outgoing=True, addr=node.address)
        conn.node = node
        self._dialing[node] = conn
        conn.out += session.hello({"raft": self._self.address, "to": node.address,
                                   "wall_ms": time.time_ns() // 1_000_000,
                                   **versions.hello_fields(meshjobs.version())},
                                  os.urandom(NONCE_BYTES), os.urandom(KX_BYTES))
        self._poller.subscribe(conn.fd, functools.partial(self._on_event, conn), _RWW)

    def _on_tick(self) -> None:
        if self._destroyed:
            return
        if not self._ready:
            try:
                self.tryGetReady()
            except TransportNotReadyError:
                pass
        now = _mono()
        for node in list(self._nodes.values()):
            if (node not in self._conns and node not in self._dialing and self._should_dial(node)
                    and now - self._last_dial.get(node, 0.0) >= self._so.conf.connectionRetryTime):
                self._dial(node)
        hello_s = limits.link_hello_ms_max / 1000.0
        for conn in [*self._pending, *self._dialing.values()]:
            if now - conn.created > hello_s:
                if not conn.outgoing:
                    self._count("silent")
                self._close(conn)
        for conn in list(self._conns.values()):
            if now - conn.last_recv > limits.raft_idle_s_max:
                log.info("raft.peer_silent", peer=conn.node.address)
                self._close(conn)
            elif now - conn.last_sent > limits.raft_ping_s:
                self._write(conn, conn.session.seal(FrameType.F_PING, {}))

    # --- bytes ---------------------------------------------------------------------------------

    def _write(self, conn: _Conn, data: bytes) -> None:
        if len(conn.out) + len(data) > limits.raft_send_queue_bytes_max:
            self._count("send_queue_full")
            log.warning("raft.peer_not_reading", peer=conn.addr, queued=len(conn.out))
            self._close(conn)
            return
        conn.out += data
        conn.last_sent = _mono()
        if not conn.connecting:
            self._flush(conn)

    def _flush(self, conn: _Conn) -> None:
        while conn.out:
            try:
                n = conn.sock.send(conn.out)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                self._close(conn)
                return
            del conn.out[:n]
        self._poller.subscribe(conn.fd, functools.partial(self._on_event, conn),
                               _RWW if conn.out else _RW)

    def _on_event(self, conn: _Conn, _fd: int, event: int) -> None:
        if conn.closed:
            return
        if conn.connecting:
            if event & (POLL_EVENT_TYPE.WRITE | POLL_EVENT_TYPE.ERROR):
                if conn.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) != 0:
                    self._close(conn)
                    return
                conn.connecting = False
                self._flush(conn)
            return
        if event & POLL_EVENT_TYPE.WRITE:
            self._flush(conn)
            if conn.closed:
                return
        if event & (POLL_EVENT_TYPE.READ | POLL_EVENT_TYPE.ERROR):
            self._read(conn)

    def _read(self, conn: _Conn) -> None:
        for _ in range(_READS_PER_EVENT):
            try:
                data = conn.sock.recv(min(conn.session.room(), _READ_BYTES))
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                self._close(conn)
                return
            if not data:
                self._close(conn)
                return
            conn.last_recv = _mono()
            conn.session.receive_data(data)
            try:
                while not conn.closed:
                    event = conn.session.next_event()
                    if event is None:
                        break
                    self._on_frame_event(conn, event)
            except FrameError as exc:
                self._refuse(conn, exc)
                return
            if conn.closed:
                return

    def _on_frame_event(self, conn: _Conn, event: Hello | Ready | Frame) -> None:
        if isinstance(event, Frame):
            if event.type == FrameType.F_PING:
                return
            if event.type != FrameType.F_RAFT:
                raise FrameError("message", f"a {event.type.name} frame on the Raft port")
            message = raftwire.decode(event.body)
            self._onMessageReceived(conn.node, message)
            return
        if isinstance(event, Ready):  # we accepted; the dialler proved it holds the secret
            self._pending.discard(conn)
            self._open(conn)
            return
        body = event.body
        claimed = body.get("raft")
        node = self._nodes.get(claimed) if isinstance(claimed, str) else None
        theirs = versions.protocols(body)
        ours = (versions.PROTOCOL_MIN, versions.PROTOCOL)
        if conn.outgoing:
            if node is not conn.node:
                raise FrameError("hello", f"the voter at {conn.addr} answered as {claimed!r}")
            if versions.common(ours, theirs) is None:
                raise self._protocol_refusal(conn, body, ours, theirs)
            self._write(conn, conn.session.proof())
            if not conn.closed:
                self._dialing.pop(conn.node, None)
                self._open(conn)
            return
        if node is None or body.get("to") != self._self.address:
            raise FrameError("hello", f"a hello from {str(claimed)[:64]!r} to "
                                      f"{str(body.get('to'))[:64]!r}: not a voter of ours")
        conn.node = node
        self._write(conn, conn.session.challenge(
            {"raft": self._self.address, "wall_ms": time.time_ns() // 1_000_000,
             **versions.hello_fields(meshjobs.version())},
            os.urandom(NONCE_BYTES), os.urandom(KX_BYTES)))
        if versions.common(ours, theirs) is None:  # refused after our challenge (its versions)
            raise self._protocol_refusal(conn, body, ours, theirs)

    def _protocol_refusal(self, conn: _Conn, body: dict, ours: tuple[int, int],
                          theirs: tuple[int, int]) -> FrameError:
        """A voter with no link protocol in common: logged with both versions and which voter
        to upgrade; the FrameError to refuse the connection with (counted as `protocol`)."""
        where = conn.node.address if conn.node is not None else conn.addr
        detail, hint = versions.refusal(f"the voter at {where}", meshjobs.version(), ours,
                                        versions.version_of(body), theirs)
        log.warning("raft.incompatible", peer=conn.addr, detail=detail, hint=hint)
        return FrameError("protocol", detail)

    def _open(self, conn: _Conn) -> None:
        node = conn.node
        old = self._conns.get(node)
        if old is not None:  # the peer restarted (or dialled again): the newer connection wins
            self._close(old, notify=False)
        self._conns[node] = conn
        conn.last_recv = _mono()
        self._onNodeConnected(node)

    def _refuse(self, conn: _Conn, exc: FrameError) -> None:
        reason = _REASONS.get(exc.reason, "garbage")
        self._count(reason)
        log.warning("raft.refused", peer=conn.addr, reason=reason, detail=exc.detail[:200])
        self._close(conn)

    def _count(self, reason: str) -> None:
        self.dropped[reason] = self.dropped.get(reason, 0) + 1

    def _close(self, conn: _Conn, notify: bool = True) -> None:
        if conn.closed:
            return
        conn.closed = True
        self._poller.unsubscribe(conn.fd)
        try:
            conn.sock.close()
        except OSError:
            pass
        self._pending.discard(conn)
        node = conn.node
        if node is not None and self._dialing.get(node) is conn:
            del self._dialing[node]
        if node is not None and self._conns.get(node) is conn:
            del self._conns[node]
            if notify:
                self._onNodeDisconnected(node)
