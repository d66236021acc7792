"""Finish hooks at the edge: POST a job's final record to its `--notify` URL.

The jobs thread hands a notice over with `offer`, which never blocks: a bounded store, and a
notice that finds it full is dropped (counted, and said in the log). Sender threads (started by
the daemon, like every thread: `notify_senders_max` of them, each running `run`) POST each
notice as JSON with an `Idempotency-Key` header (the job id and its version: the same for a
repeat of one notice, as a new leader sends after a failover) and retry one the receiver refuses
or does not answer (any status but 2xx, or no answer within `notify_send_timeout_s`) with a
doubling backoff, for at most `notify_retry_s_max`. Notices waiting for a retry count against
the same bound. Redirects are not followed (a 3xx is a refusal like any other).

Rule 1: where a notice may go is meshjobs/hookaddr.py's policy. At each send the host is
        resolved, every address it has is checked, and the connection goes to an address that
        was checked (never to a second resolution: DNS rebinding), with the Host header, TLS
        server name and certificate check of the URL's own host. A destination the policy
        refuses is not retried: the notice is counted (`notify_refused`) and logged.
Rule 2: one slow destination does not delay the others. Notices wait per destination (scheme,
        host, port), due retries at the back of their destination's line; senders take from
        the destinations in turn (round robin), with at most `notify_inflight_per_dest_max`
        sends to one destination at once; every send is bounded as a whole (resolution aside,
        which the resolver bounds) by `notify_send_timeout_s`.
Rule 3: logs name the destination (scheme://host:port), never the whole URL, which may carry
        a secret.
"""

from __future__ import annotations

import collections
import heapq
import itertools
import json
import socket
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import structlog

from meshjobs import hookaddr, limits

log = structlog.get_logger(__name__)

Dest = tuple[str, str, int]  # scheme, host, port: what a notice's line is kept by
# host, port -> the addresses the host has (getaddrinfo's, as strings).
Resolver = Callable[[str, int], list[str]]


def _body(record: dict) -> bytes:
    body = json.dumps(record, separators=(",", ":")).encode()
    if len(body) > limits.notify_body_bytes_max:
        slim = {k: v for k, v in record.items() if k not in ("argv", "env")}
        slim["truncated"] = True
        body = json.dumps(slim, separators=(",", ":")).encode()
    if len(body) > limits.notify_body_bytes_max:
        # Still too long (huge tags?): what a receiver needs to look the job up itself.
        body = json.dumps({k: record.get(k) for k in ("id", "state", "version", "finished_at")}
                          | {"truncated": True}, separators=(",", ":")).encode()
    return body


def system_resolve(host: str, port: int) -> list[str]:
    """Every address the system's resolver gives `host` (TCP), in its order."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP)
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


def dest_of(url: str) -> Dest:
    u = urlsplit(url)
    scheme = u.scheme.lower()
    port = u.port or (443 if scheme == "https" else 80)
    return scheme, hookaddr.host_of(url), port


def where(dest: Dest) -> str:
    host = f"[{dest[1]}]" if ":" in dest[1] else dest[1]
    return f"{dest[0]}://{host}:{dest[2]}"


@dataclass
class _Notice:
    url: str
    key: str
    dest: Dest
    record: dict | None  # until the first try builds the body
    first: float
    body: bytes = b""
    tries: int = 0
    seq: int = field(default=0)


class _Refused(Exception):
    """The policy refuses the destination: not retried."""


class _Lookup(Exception):
    """The host could not be resolved now: retried like a refusal of the receiver."""


class Notifier:
    """Finish notices waiting by destination, and the loop of the threads that send them."""

    def __init__(self, member: str, clock: Any = time.monotonic,
                 policy: hookaddr.NotifyPolicy | None = None,
                 resolve: Resolver = system_resolve,
                 tls: ssl.SSLContext | None = None) -> None:
        self.member = member
        self._clock = clock
        self._policy = policy if policy is not None else hookaddr.NotifyPolicy()
        self._resolve = resolve
        self._tls = tls if tls is not None else ssl.create_default_context()
        self._cond = threading.Condition()
        self._stopped = False
        # Guarded by _cond: the lines by destination (in turn order), retries by when due,
        # sends under way by destination, and every notice held (for the bound).
        self._ready: dict[Dest, collections.deque[_Notice]] = {}
        self._waiting: list[tuple[float, int, _Notice]] = []
        self._inflight: dict[Dest, int] = {}
        self._held = 0
        self._socks: set[socket.socket] = set()  # sends under way, cut short by stop()
        self._seq = itertools.count()
        self.sent = 0
        self.retried = 0
        self.dropped = 0
        self.given_up = 0
        self.refused = 0

    def offer(self, url: str, key: str, record: dict) -> bool:
        """Queue a notice (never blocks on IO); False when the store is full and it was dropped."""
        try:
            dest = dest_of(url)
        except ValueError:
            dest = ("?", url[:64], 0)
        with self._cond:
            if self._held >= limits.notify_queue_max:
                self.dropped += 1
                full = True
            else:
                full = False
                self._held += 1
                self._ready.setdefault(dest, collections.deque()).append(
                    _Notice(url, key, dest, record, self._clock(), seq=next(self._seq)))
                self._cond.notify()
        if full:
            log.warning("notify_dropped", key=key, dest=where(dest), queue_max=limits.notify_queue_max,
                        why="the store of finish notices is full (slow or dead receivers?)")
        return not full

    def stop(self) -> None:
        """Stop the senders; a send under way is cut short (its notice is sent again by the
        next leader, as after any stop)."""
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
            socks = list(self._socks)
        for sock in socks:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def numbers(self) -> dict[str, int]:
        return {"notify_sent": self.sent, "notify_retried": self.retried,
                "notify_dropped": self.dropped, "notify_given_up": self.given_up,
                "notify_refused": self.refused}

    def held(self) -> int:
        """Notices waiting, retrying or being sent now."""
        with self._cond:
            return self._held

    # --- the senders' loop (Rule 2) -------------------------------------------------------

    def run(self) -> None:
        """One sender: take the next notice in turn, send it, file the outcome; until stop."""
        while True:
            with self._cond:
                n = self._take()
                while n is None and not self._stopped:
                    wait_s = 1.0
                    if self._waiting:
                        wait_s = min(wait_s, max(0.0, self._waiting[0][0] - self._clock()))
                    self._cond.wait(wait_s)
                    n = self._take()
                if self._stopped:
                    return
                self._inflight[n.dest] = self._inflight.get(n.dest, 0) + 1
            outcome = self._try(n)
            with self._cond:
                left = self._inflight[n.dest] - 1
                if left:
                    self._inflight[n.dest] = left
                else:
                    del self._inflight[n.dest]
                if outcome is None:
                    self._held -= 1
                else:
                    heapq.heappush(self._waiting, (outcome, n.seq, n))
                self._cond.notify_all()

    def _take(self) -> _Notice | None:
        """The next notice to send, by destinations in turn (with _cond held)."""
        now = self._clock()
        while self._waiting and self._waiting[0][0] <= now:
            _due, _s, n = heapq.heappop(self._waiting)
            self._ready.setdefault(n.dest, collections.deque()).append(n)
        for dest in list(self._ready):
            if self._inflight.get(dest, 0) >= limits.notify_inflight_per_dest_max:
                continue
            line = self._ready.pop(dest)
            n = line.popleft()
            if line:
                self._ready[dest] = line  # to the back of the turn order
            return n
        return None

    def _try(self, n: _Notice) -> float | None:
        """Send once; None when done with the notice (taken, refused, given up), else when
        to try it again."""
        if n.record is not None:
            n.body, n.record = _body(n.record), None
        try:
            why = self._post(n)
        except _Refused as e:
            with self._cond:
                self.refused += 1
            log.warning("notify_refused", key=n.key, dest=where(n.dest), why=str(e),
                        hint="not retried; the member's operator may allow it: [notify] allow")
            return None
        if why is None:
            with self._cond:
                self.sent += 1
            log.info("notify_sent", key=n.key, dest=where(n.dest), tries=n.tries + 1)
            return None
        now = self._clock()
        delay = min(limits.notify_backoff_s_base * 2 ** n.tries, limits.notify_backoff_s_max)
        if now + delay - n.first > limits.notify_retry_s_max:
            with self._cond:
                self.given_up += 1
            log.warning("notify_given_up", key=n.key, dest=where(n.dest), tries=n.tries + 1, why=why)
            return None
        with self._cond:
            self.retried += 1
        n.tries += 1
        log.info("notify_retry", key=n.key, dest=where(n.dest), in_s=delay, why=why)
        return now + delay

    # --- one POST (Rule 1) ------------------------------------------------------------------

    def _addresses(self, n: _Notice) -> list[str]:
        """The host's addresses, each checked by the policy; raises _Refused for any refused."""
        scheme, host, port = n.dest
        if scheme not in ("http", "https") or not host:
            raise _Refused(f"not an http(s) URL with a host ({scheme}://)")
        ip = hookaddr.literal(host)
        if ip is not None:
            found = [ip]
        else:
            try:
                got = self._resolve(host, port)
            except (OSError, UnicodeError) as e:
                raise _Lookup(f"cannot resolve {host}: {e}") from None
            found = [a for a in map(hookaddr.literal, got) if a is not None]
            if not found:
                raise _Lookup(f"{host} has no address")
        for a in found:
            why = self._policy.address_refusal(host, a)
            if why is not None:
                raise _Refused(why)
        return [str(a) for a in found]

    def _post(self, n: _Notice) -> str | None:
        """POST once; None when the receiver took it (2xx), else why not. Raises _Refused."""
        deadline = time.monotonic() + limits.notify_send_timeout_s
        try:
            addrs = self._addresses(n)
        except _Lookup as e:
            return str(e)[:200]
        scheme, host, port = n.dest
        u = urlsplit(n.url)
        target = (u.path or "/") + (f"?{u.query}" if u.query else "")
        head = (f"POST {target} HTTP/1.1\r\nHost: {u.netloc}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(n.body)}\r\n"
                f"Idempotency-Key: {n.key}\r\nUser-Agent: meshjobs-notify\r\n"
                f"X-Meshjobs-Member: {self.member}\r\nConnection: close\r\n\r\n")
        last = "no address answered"
        for addr in addrs:
            left = deadline - time.monotonic()
            if left <= 0:
                return f"no answer within {limits.notify_send_timeout_s} s"
            try:
                return self._exchange(addr, port, host if scheme == "https" else None,
                                      head.encode("ascii") + n.body, deadline)
            except TimeoutError:
                return f"no answer within {limits.notify_send_timeout_s} s"
            except (OSError, ValueError) as e:
                last = f"{type(e).__name__}: {e}"[:200]
        return last

    def _exchange(self, addr: str, port: int, tls_name: str | None, request: bytes,
                  deadline: float) -> str | None:
        """Connect to `addr` (checked), send, read the status line; all before `deadline`."""
        def left() -> float:
            s = deadline - time.monotonic()
            if s <= 0:
                raise TimeoutError
            return s

        sock = socket.create_connection((addr, port), timeout=left())
        with self._cond:
            self._socks.add(sock)
            stopped = self._stopped
        try:
            if stopped:
                return "the member is stopping"
            if tls_name is not None:
                sock.settimeout(left())
                raw = sock
                sock = self._tls.wrap_socket(raw, server_hostname=tls_name)
                with self._cond:  # the fd is the TLS socket's now
                    self._socks.discard(raw)
                    self._socks.add(sock)
            view = memoryview(request)
            while view:
                sock.settimeout(left())
                view = view[sock.send(view):]
            got = b""
            while b"\r\n" not in got:
                sock.settimeout(left())
                chunk = sock.recv(limits.notify_answer_bytes_max)
                if not chunk:
                    return "the receiver closed without answering"
                got += chunk
                if len(got) > limits.notify_answer_bytes_max:
                    return "the receiver's answer has no status line"
            parts = got.split(b"\r\n", 1)[0].split(b" ", 2)
            if len(parts) < 2 or not parts[0].startswith(b"HTTP/") or not parts[1].isdigit():
                return "the receiver's answer is not HTTP"
            status = int(parts[1])
            return None if 200 <= status < 300 else f"status {status}"
        finally:
            with self._cond:
                self._socks.discard(sock)
            sock.close()
