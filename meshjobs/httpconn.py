"""The HTTP server's edge: its listening sockets, the accept loop, and each connection's timer.

aiohttp parses requests and answers them; this module decides which connections it gets and for
how long, by the rules of connbook.py (header timeout, a connection limit below the fd limit,
newcomers served under a flood). aiohttp's own keep-alive timer closes a connection idle between
requests (`keepalive_timeout`, set to the idle timeout by http.py).

Why not aiohttp's TCPSite (asyncio's create_server): on Python 3.11 asyncio's accept loop goes on
calling accept() after EMFILE within one wakeup and schedules one retry per failure, each logged
with a traceback: at the fd limit that was thousands of lines a second. And it has neither a
connection limit nor a header timeout. Here accept errors pause accepting for a moment, close the
connections that wait longest for a head, and are logged within a budget (connbook.LogBudget); a
filter puts asyncio's own logger on the same kind of budget.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
import ssl
import time
from collections.abc import Callable
from typing import Any

from meshjobs import limits
from meshjobs.connbook import ConnBook, LogBudget

# accept() errors that mean "no file descriptor or buffer left", not "this connection is bad".
OUT_OF_RESOURCES = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
SHED_REASONS = ("limit", "evicted", "fds", "header_timeout")


def _waits_for_head(handler: Any) -> bool:
    """Whether aiohttp's request handler waits for a request head: the state aiohttp's own
    keep-alive check reads (RequestHandler._process_keepalive). False while a request is in
    progress (a long-poll, a download): such a connection is never closed here."""
    waiter = handler._waiter
    return waiter is not None and not waiter.done()


def _head_queued(handler: Any) -> bool:
    """Whether a complete request head is parsed and waiting for the handler's loop."""
    return bool(handler._messages)


class _Conn(asyncio.Protocol):
    """One accepted connection: passes everything on to aiohttp's handler, and tells the gate
    what it saw. Until `connection_made` (a TLS handshake in progress) it has no transport."""

    def __init__(self, gate: Gate, inner: asyncio.Protocol, sock: socket.socket) -> None:
        self.gate = gate
        self.inner = inner
        self.sock = sock
        self.transport: asyncio.BaseTransport | None = None
        self.task: asyncio.Task | None = None
        self.began = False  # the task that sets up the transport has started running
        self.timer: asyncio.TimerHandle | None = None

    def waits(self) -> bool:
        """Waiting for a request head: still in its TLS handshake, or idle/mid-head in aiohttp."""
        return self.transport is None or _waits_for_head(self.inner)

    def shut(self) -> None:
        """Close at once: no lingering, no TLS close_notify (the fd is what we want back)."""
        if self.transport is not None:
            self.transport.abort()  # type: ignore[attr-defined]
        elif self.task is not None:
            self.task.cancel()

    # asyncio.Protocol, passed on to aiohttp's handler.
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        self.inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        self.inner.data_received(data)
        self.gate.received(self)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        self.gate.lost(self)
        self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()


class Gate:
    """Listens on (host, port) and hands connections to `factory` (aiohttp's web.Server).

    Runs on one event loop; every method but the constructor is called on it."""

    def __init__(self, factory: Callable[[], asyncio.Protocol], host: str, port: int, *,
                 conns_max: int, header_s: float, tls: ssl.SSLContext | None = None,
                 log: Any = None) -> None:
        self._factory = factory
        self._host = host
        self._port = port
        self._tls = tls
        self.book: ConnBook[_Conn] = ConnBook(conns_max, header_s)
        self._header_s = header_s
        self._log = log
        self._budget = LogBudget()
        self._summary: asyncio.TimerHandle | None = None
        self._socks: list[socket.socket] = []
        self._paused: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False
        self._starting: set[_Conn] = set()
        # Touched on the loop's thread only.
        self.accepted = 0
        self.accept_errors = 0
        self.shed = dict.fromkeys(SHED_REASONS, 0)

    @property
    def conns_max(self) -> int:
        return self.book.cap

    @property
    def open_conns(self) -> int:
        return len(self.book)

    def start(self) -> int:
        """Bind and start accepting; returns the bound port."""
        self._loop = asyncio.get_running_loop()
        probe = self._factory()
        if not (hasattr(probe, "_waiter") and hasattr(probe, "_messages")):
            raise RuntimeError("this aiohttp's request handler has no _waiter/_messages: "
                               "meshjobs/httpconn.py needs updating for it")
        self._socks = _bind(self._host, self._port, limits.http_backlog_conns)
        for s in self._socks:
            self._loop.add_reader(s.fileno(), self._on_readable, s)
        return self._socks[0].getsockname()[1]

    def close(self) -> None:
        """Stop accepting and drop connections still in their handshake; aiohttp's runner
        closes the established ones."""
        self._closed = True
        for timer in (self._paused, self._summary):
            if timer is not None:
                timer.cancel()
        if self._loop is not None:
            for s in self._socks:
                self._loop.remove_reader(s.fileno())
        for s in self._socks:
            s.close()
        self._socks = []
        for c in list(self._starting):
            c.shut()

    # --- accepting ---------------------------------------------------------------------------

    def _on_readable(self, sock: socket.socket) -> None:
        for _ in range(limits.http_accept_batch_max):
            try:
                conn, _addr = sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except ConnectionAbortedError:
                continue  # Gone before we took it.
            except OSError as e:
                self._accept_failed(e)
                return
            self._admit(conn)

    def _admit(self, sock: socket.socket) -> None:
        assert self._loop is not None
        ok, victims = self.book.make_room(_Conn.waits)
        for v in victims:
            self.shed["evicted"] += 1
            v.shut()
        if not ok:
            # Every connection looked at is busy with a request: the newcomer cannot come in.
            self.shed["limit"] += 1
            sock.close()
            return
        self.accepted += 1
        sock.setblocking(False)
        c = _Conn(self, self._factory(), sock)
        self.book.opened(c, self._loop.time())
        self._starting.add(c)
        c.task = self._loop.create_task(self._connect(c))
        c.task.add_done_callback(lambda _t, c=c: self._started(c))
        self._arm(c)

    async def _connect(self, c: _Conn) -> None:
        c.began = True
        assert self._loop is not None
        # A TLS handshake is part of what a client owes before its head: header_s bounds it, and
        # the close too (a peer that never answers close_notify must not hold its fd).
        tls_kw: dict[str, Any] = {}
        if self._tls is not None:
            tls_kw = {"ssl": self._tls, "ssl_handshake_timeout": self._header_s,
                      "ssl_shutdown_timeout": self._header_s}
        await self._loop.connect_accepted_socket(lambda: c, c.sock, **tls_kw)

    def _started(self, c: _Conn) -> None:
        self._starting.discard(c)
        task = c.task
        c.task = None
        if task is not None and (task.cancelled() or task.exception() is not None):
            # A failed or timed-out TLS handshake, or shut before it began. Once the task began,
            # asyncio closed the transport and the socket with it; before, the socket is ours.
            if not c.began:
                c.sock.close()
            if c.transport is None:
                self.lost(c)

    def _accept_failed(self, e: OSError) -> None:
        """accept() failed: pause accepting for a moment rather than spin on a listening socket
        that stays readable; out of fds, close the connections waiting longest for a head."""
        assert self._loop is not None
        self.accept_errors += 1
        evicted = 0
        if e.errno in OUT_OF_RESOURCES:
            for v in self.book.victims(limits.http_emfile_evict_conns, _Conn.waits):
                self.shed["fds"] += 1
                v.shut()
                evicted += 1
        self._budgeted("http_accept_failed", error=errno.errorcode.get(e.errno or 0, str(e)),
                       conns=len(self.book), closed_waiting=evicted,
                       pause_ms=limits.http_accept_backoff_ms)
        if self._paused is None and not self._closed:
            for s in self._socks:
                self._loop.remove_reader(s.fileno())
            self._paused = self._loop.call_later(limits.http_accept_backoff_ms / 1000, self._resume)

    def _resume(self) -> None:
        self._paused = None
        if self._closed or self._loop is None:
            return
        for s in self._socks:
            self._loop.add_reader(s.fileno(), self._on_readable, s)

    def _budgeted(self, event: str, **fields: Any) -> None:
        if self._log is None or self._loop is None:
            return
        ok, left_out = self._budget.admit(self._loop.time())
        if ok:
            if left_out:
                fields["left_out"] = left_out
            self._log.warning(event, **fields)
        elif self._summary is None:
            self._summary = self._loop.call_later(self._budget.window_s, self._sum_up, event)

    def _sum_up(self, event: str) -> None:
        self._summary = None
        left_out = self._budget.take_left_out()
        if left_out and self._log is not None:
            self._log.warning(event + "_left_out", count=left_out,
                              window_s=self._budget.window_s)

    # --- each connection ---------------------------------------------------------------------

    def received(self, c: _Conn) -> None:
        assert self._loop is not None
        self.book.received(c, self._loop.time(), head_done=_head_queued(c.inner), waiting=c.waits())
        self._arm(c)

    def lost(self, c: _Conn) -> None:
        self.book.closed(c)
        if c.timer is not None:
            c.timer.cancel()
            c.timer = None

    def _arm(self, c: _Conn) -> None:
        """One timer per connection, at most: a timer that fires early re-arms itself."""
        due = self.book.deadline(c)
        if due is None or c.timer is not None or self._loop is None:
            return
        c.timer = self._loop.call_at(due, self._check, c)

    def _check(self, c: _Conn) -> None:
        assert self._loop is not None
        c.timer = None
        if self.book.overdue(c, self._loop.time(), waiting=c.waits()):
            self.shed["header_timeout"] += 1
            c.shut()
        else:
            self._arm(c)


def _bind(host: str, port: int, backlog: int) -> list[socket.socket]:
    """Listening sockets for every address `host` resolves to (as asyncio's create_server);
    with port 0, all on the port the first one got."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    socks: list[socket.socket] = []
    seen: set[tuple] = set()
    try:
        for family, kind, proto, _name, addr in infos:
            if (family, addr) in seen:
                continue
            seen.add((family, addr))
            s = socket.socket(family, kind, proto)
            socks.append(s)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6 and len(infos) > 1:
                s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            if port == 0 and len(socks) > 1:
                addr = (addr[0], socks[0].getsockname()[1], *addr[2:])
            s.bind(addr)
            s.listen(backlog)
            s.setblocking(False)
    except BaseException:
        for s in socks:
            s.close()
        raise
    return socks


# --- asyncio's own log lines, on a budget --------------------------------------------------


class _BudgetFilter(logging.Filter):
    """Lets through at most http_log_records_max of the logger's lines per http_log_window_s;
    the first line let through after a burst says how many were left out."""

    def __init__(self) -> None:
        super().__init__("meshjobs-budget")
        self.budget = LogBudget()

    def filter(self, record: logging.LogRecord) -> bool:
        ok, left_out = self.budget.admit(time.monotonic())
        if ok and left_out:
            record.msg = f"{record.msg} [{left_out} earlier asyncio log lines left out]"
        return ok


def budget_asyncio_log() -> logging.Filter:
    """Put the `asyncio` logger on a log budget (once per process); returns its filter."""
    logger = logging.getLogger("asyncio")
    for f in logger.filters:
        if isinstance(f, _BudgetFilter):
            return f
    f = _BudgetFilter()
    logger.addFilter(f)
    return f
