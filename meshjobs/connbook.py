"""The book of a member's HTTP connections: which to close, and when. Pure: no IO, no clock.

Theory of operation. The edge (httpconn.py) owns the sockets and tells the book what happens to
each connection: `opened` when it is accepted, `received` when bytes arrive, `closed` when it is
gone. Time comes in as an argument (the event loop's clock). The book answers three questions:
is this connection's request head overdue (`overdue`), which connections to close to make room
for a newcomer (`make_room`) or to free file descriptors (`victims`), and how many connections
the member allows at once (`conns_limit`). `LogBudget` decides which of a burst of log lines
are written.

Rule 1: A connection owes a complete request head within `header_s` of its opening, and, after
        a response on a kept-alive connection, within `header_s` of the first byte of its next
        request. A connection idle between requests (no byte yet) is the HTTP server's keep-alive
        timer's business, not this book's.
Rule 2: A connection with a request in progress (its head complete, its answer not finished: a
        long-poll, a blob download) is never closed here, neither for time nor for room.
Rule 3: The book never holds more than `cap` connections. At capacity, a newcomer gets the place
        of the connection waiting for a head that was heard from least recently; when the oldest
        connections looked at (at most `scan_max`) are all busy, the newcomer is refused. So a
        flood of silent connections cannot lock a real client out: it churns itself, and a
        client that sends its head at once (a health probe) is served.
Rule 4: A connection leaves the book once (closed or chosen as a victim); the edge's later
        `closed` for it is a no-op.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Generic, TypeVar

from meshjobs import limits

K = TypeVar("K", bound=Hashable)


def conns_limit(nofile_soft: int | None, conns_max: int | None) -> int:
    """How many HTTP connections a member keeps open at once.

    `conns_max` from the config wins. Otherwise the soft fd limit less a reserve for everything
    else meshd opens: max(http_fds_reserved, a quarter of the limit); never below
    http_conns_min, never above http_conns_max. At the usual 1,024 that is 768; at 65,536, 49,152.
    An unknown or unlimited fd limit (None, or below 0 as RLIM_INFINITY may be) gives the maximum.
    """
    if conns_max is not None:
        if not 1 <= conns_max <= limits.http_conns_max:
            raise ValueError(f"conns_max must be 1..{limits.http_conns_max}, not {conns_max}")
        return conns_max
    if nofile_soft is None or nofile_soft < 0:
        return limits.http_conns_max
    reserve = max(limits.http_fds_reserved, nofile_soft // 4)
    return max(limits.http_conns_min, min(limits.http_conns_max, nofile_soft - reserve))


@dataclass(slots=True)
class _Entry:
    head_since: float | None  # a head is owed by head_since + header_s; None: none owed now


class ConnBook(Generic[K]):
    """The open connections, least recently heard from first (see the module's rules)."""

    def __init__(self, cap: int, header_s: float, scan_max: int = limits.http_evict_scan_max) -> None:
        assert cap >= 1 and header_s > 0 and scan_max >= 1, (cap, header_s, scan_max)
        self.cap = cap
        self.header_s = header_s
        self.scan_max = scan_max
        self._entries: OrderedDict[K, _Entry] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def opened(self, key: K, now: float) -> None:
        """A connection was accepted; it owes its first head from now (Rule 1)."""
        assert key not in self._entries, "a connection opened twice"
        assert len(self._entries) < self.cap, "opened without room: call make_room first"
        self._entries[key] = _Entry(head_since=now)

    def received(self, key: K, now: float, *, head_done: bool, waiting: bool) -> None:
        """Bytes arrived. `head_done`: they completed a request head. `waiting`: after them, the
        connection still waits for a head (they were part of one, not of a request body)."""
        entry = self._entries.get(key)
        if entry is None:
            return  # Chosen as a victim; its close is on its way (Rule 4).
        self._entries.move_to_end(key)
        if head_done:
            entry.head_since = None
        elif waiting and entry.head_since is None:
            entry.head_since = now

    def deadline(self, key: K) -> float | None:
        """When the connection's head is due, or None when it owes none (or is gone)."""
        entry = self._entries.get(key)
        if entry is None or entry.head_since is None:
            return None
        return entry.head_since + self.header_s

    def overdue(self, key: K, now: float, *, waiting: bool) -> bool:
        """Whether to close the connection now: it still waits for a head that is past due.
        A connection found busy owes nothing any more (its head came; Rule 2)."""
        entry = self._entries.get(key)
        if entry is None or entry.head_since is None:
            return False
        if not waiting:
            entry.head_since = None
            return False
        if now < entry.head_since + self.header_s:
            return False
        del self._entries[key]
        return True

    def closed(self, key: K) -> None:
        self._entries.pop(key, None)

    def make_room(self, waiting: Callable[[K], bool]) -> tuple[bool, list[K]]:
        """Before `opened`: (True, victims to close) when the newcomer may come in, (False, [])
        when it must be refused (Rule 3). Victims leave the book at once."""
        if len(self._entries) < self.cap:
            return True, []
        victims = self.victims(1, waiting)
        return bool(victims), victims

    def victims(self, n: int, waiting: Callable[[K], bool]) -> list[K]:
        """Up to n connections waiting for a head, least recently heard from first, taken out of
        the book. Busy ones looked at on the way go to the back, so the next search starts past
        them; at most scan_max + n are looked at."""
        out: list[K] = []
        for _ in range(min(len(self._entries), self.scan_max + n)):
            if len(out) >= n:
                break
            key = next(iter(self._entries))
            if waiting(key):
                del self._entries[key]
                out.append(key)
            else:
                self._entries.move_to_end(key)
        return out


class LogBudget:
    """At most `records_max` lines per window of `window_s`; the rest are counted, and the count
    is handed to the first line written in a later window, which says how many were left out."""

    def __init__(self, records_max: int = limits.http_log_records_max,
                 window_s: float = limits.http_log_window_s) -> None:
        assert records_max >= 1 and window_s > 0
        self.records_max = records_max
        self.window_s = window_s
        self._window_start: float | None = None
        self._written = 0
        self._left_out = 0
        self.left_out_total = 0

    def admit(self, now: float) -> tuple[bool, int]:
        """(write this line?, lines left out since the last one written, to mention with it)."""
        if self._window_start is None or now >= self._window_start + self.window_s or now < self._window_start:
            self._window_start = now
            self._written = 0
        if self._written >= self.records_max:
            self._left_out += 1
            self.left_out_total += 1
            return False, 0
        self._written += 1
        left_out, self._left_out = self._left_out, 0
        return True, left_out

    def take_left_out(self) -> int:
        """Lines left out and not yet mentioned (for a summary line once a burst is over)."""
        left_out, self._left_out = self._left_out, 0
        return left_out
