"""Live item output: the bytes a running item has written so far, read here or asked of the
member that runs it.

The driver captures each running command item's stdout and stderr (in memory while small, then
in spool files: meshjobs/capture.py) and stores them as blobs when it ends. While it runs,
`GET /jobs/{id}/items/{n}/stdout` is served from what it captured so far
(`Driver.read_output`): read here when the item runs on this member (`read_local`), or
asked of the member that runs it over the member links with an F_LOG_GET, whose F_LOG_PUT
answer carries at most `log_frame_bytes_max` bytes (`ask`). Once the item has ended and its
output is stored, HTTP serves the blob instead (meshjobs/http.py).

Threads. HTTP reads local spool files in its executor (`read_local`: one open, one pread, one
close) and asks other members with `ask`, which returns a future at once. The links' thread
hands frames to `frame`: an F_LOG_PUT resolves its ask's future; an F_LOG_GET is queued for the
item-log thread (`run`, started by the daemon), which reads the spool file and answers, so that
the links' thread never waits on a disk.

Rules:
- Every queue is bounded: asks waiting for their answer (`log_asks_max`; more are answered
  None at once, which HTTP turns into a 503) and F_LOG_GETs waiting to be served
  (`log_inbox_max`; more are dropped and counted: the asker times out and asks again).
- Garbage from a peer (a body that does not parse, an answer nobody asked for or from another
  member than the one asked) is dropped and counted by reason in `stats()["dropped"]`.
- A spool file is only read, never held open between reads: the driver and the blob writers
  remove it when the item's output is stored, and a reader that finds it gone answers
  "unknown" (the caller then looks for the blob).
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections import deque
from concurrent.futures import Future, InvalidStateError
from typing import Any

import structlog

from meshjobs import limits
from meshjobs.frames import (
    FrameError,
    FrameType,
    LogAsk,
    LogPiece,
    log_ask_body,
    log_piece_body,
    parse_log_ask,
    parse_log_piece,
)

_IDLE_S = limits.item_logs_idle_s


def _resolve(fut: Future, value: LogPiece | None) -> None:
    with contextlib.suppress(InvalidStateError):  # cancelled by a waiter that gave up
        fut.set_result(value)


class ItemLogs:
    """Reads running items' output here and asks other members for theirs. See the module's
    rules. `driver` is this member's driver (its `read_output` and `accepted`); `links` is None on a
    fleet of one."""

    def __init__(self, member: str, driver: Any, links: Any = None, log: Any = None) -> None:
        self.member = member
        self._driver = driver
        self.links = links
        self._log = log if log is not None else structlog.get_logger(__name__)
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._seq = itertools.count(1)
        self._asks: dict[int, tuple[str, Future]] = {}  # q -> (member asked, its answer)
        self._inbox: deque[tuple[str, Any]] = deque()
        self._stopping = False
        self._counters = {"asks": 0, "answers": 0, "served": 0, "served_bytes": 0,
                          "asks_timed_out": 0}
        self._dropped: dict[str, int] = {}

    # --- reading here --------------------------------------------------------------------------

    def read_local(self, ask: LogAsk) -> LogPiece:
        """Up to `ask.size` bytes of a run's output on this member from `ask.offset` (blocking
        file IO: call it off the event loop). "unavailable" when the run is here but has no
        spool file (a python item, or a command not spawned yet); "unknown" when this member
        has no such run now (ended and stored, or another epoch)."""
        key = (ask.job, ask.index, ask.epoch)
        try:
            got = self._driver.read_output(key, ask.stream, ask.offset, ask.size)
        except FileNotFoundError:
            return LogPiece(ask.q, b"", False, "unknown")  # stored and removed meanwhile
        except OSError as e:
            self._log.warning("item_spool_unreadable", job=ask.job, index=ask.index,
                              error=str(e))
            return LogPiece(ask.q, b"", False, "unavailable")
        if got is None:
            error = "unavailable" if self._driver.accepted(key) else "unknown"
            return LogPiece(ask.q, b"", False, error)
        data, size, ended = got
        return LogPiece(ask.q, data, ended and ask.offset + len(data) >= size)

    # --- asking another member -----------------------------------------------------------------

    def ask(self, member: str, job: str, index: int, epoch: int, stream: str, offset: int,
            size: int) -> Future:
        """Ask `member` for output of its run of (job, index) under `epoch`; a future of the
        LogPiece, or of None when the ask could not be sent (no link to that member, too many
        asks waiting). A caller that stops waiting calls `forget` with the future."""
        fut: Future = Future()
        fut.set_running_or_notify_cancel()
        with self._lock:
            self._counters["asks"] += 1
            if (self.links is None or self._stopping or member == self.member
                    or len(self._asks) >= limits.log_asks_max):
                _resolve(fut, None)
                return fut
            q = next(self._seq)
            self._asks[q] = (member, fut)
        fut.q = q  # type: ignore[attr-defined]
        body = log_ask_body(LogAsk(q, job, index, epoch, stream, offset, size))
        if not self.links.send(member, FrameType.F_LOG_GET, body):
            self._forget_q(q, None)
        return fut

    def forget(self, fut: Future) -> None:
        """The caller of `ask` stopped waiting (its time ran out, or its client went away)."""
        q = getattr(fut, "q", None)
        if q is not None and not fut.done():
            with self._lock:
                self._counters["asks_timed_out"] += 1
            self._forget_q(q, None)

    def _forget_q(self, q: int, value: LogPiece | None) -> None:
        with self._lock:
            entry = self._asks.pop(q, None)
        if entry is not None:
            _resolve(entry[1], value)

    # --- frames from the links' thread ---------------------------------------------------------

    def frame(self, peer: str, ftype: FrameType, body: Any) -> None:
        """An F_LOG_GET or F_LOG_PUT from `peer`: never blocks."""
        if ftype == FrameType.F_LOG_PUT:
            try:
                piece = parse_log_piece(body)
            except FrameError:
                self._drop("bad_put")
                return
            with self._lock:
                entry = self._asks.get(piece.q)
                if entry is None or entry[0] != peer:
                    self._drop_locked("unasked")
                    return
                del self._asks[piece.q]
                self._counters["answers"] += 1
            _resolve(entry[1], piece)
            return
        if ftype != FrameType.F_LOG_GET:
            raise ValueError(f"item logs take F_LOG_GET and F_LOG_PUT, not {ftype!r}")
        with self._cond:
            if self._stopping or len(self._inbox) >= limits.log_inbox_max:
                self._drop_locked("inbox_full")
                return
            self._inbox.append((peer, body))
            self._cond.notify()

    # --- the item-log thread ------------------------------------------------------------------

    def run(self) -> None:
        """The thread body: serves F_LOG_GETs from other members; returns after `stop()`."""
        while True:
            with self._cond:
                while not self._inbox and not self._stopping:
                    self._cond.wait(_IDLE_S)
                if self._stopping:
                    return
                peer, body = self._inbox.popleft()
            try:
                ask = parse_log_ask(body)
            except FrameError:
                self._drop("bad_get")
                continue
            piece = self.read_local(ask)
            with self._lock:
                self._counters["served"] += 1
                self._counters["served_bytes"] += len(piece.data)
            if self.links is not None:
                self.links.send(peer, FrameType.F_LOG_PUT, log_piece_body(piece))

    def stop(self) -> None:
        """Make `run` return; asks still waiting are answered None. Safe more than once."""
        with self._cond:
            self._stopping = True
            self._inbox.clear()
            asks = list(self._asks.values())
            self._asks.clear()
            self._cond.notify_all()
        for _member, fut in asks:
            _resolve(fut, None)

    def stats(self) -> dict[str, Any]:
        """Counters: asks sent, answers received, asks timed out, F_LOG_GETs served and their
        bytes, `dropped` by reason, and the asks waiting now."""
        with self._lock:
            out: dict[str, Any] = dict(self._counters)
            out["dropped"] = dict(self._dropped)
            out["waiting"] = len(self._asks)
        return out

    def _drop(self, reason: str) -> None:
        with self._lock:
            self._drop_locked(reason)

    def _drop_locked(self, reason: str) -> None:
        self._dropped[reason] = self._dropped.get(reason, 0) + 1
