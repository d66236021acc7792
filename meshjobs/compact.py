"""Compact forms of per-item data: an array's items in a submit entry, and a job's queue of
pending items.

Theory of operation. A job of a million items must not cost a million Python objects where one
object and a count will do: every small object is 30-60 bytes, and short-lived ones scattered
among long-lived ones keep the allocator's memory from ever going back (a member's memory grows
by what its biggest submit once needed, not by what it keeps).

- A submit entry names its items' stdin payloads as `ip` (the distinct payloads, each a digest or
  None, in order of first use) and, when there is more than one, `ix` (each item's index into
  `ip`, little-endian u32, one bytes object); with one distinct payload, `n` (how many items).
  Entries of older members name one payload per item (`items`) and stay readable.
- `ItemQueue` is a job's queue of pending item indexes: items put back in front (`head`), the
  run of items never taken yet (`lo` to `hi`, in order, less the `holes` taken out of order), then
  items put back behind (`tail`). An array's fresh items cost nothing each.

Rule 1: pure. No IO, clock, randomness or threads.
Rule 2: `entry_items` is total over remote garbage: a malformed form is None (the table refuses
        the entry), never an exception.
Rule 3: `ItemQueue` iterates in exactly the order a deque fed the same calls would, and refuses
        what a deque would refuse (`remove` of an absent item: ValueError; an empty `popleft`:
        IndexError).
"""

from __future__ import annotations

import sys
from array import array
from collections import deque
from collections.abc import Iterable, Iterator
from typing import Any

from meshjobs import limits

Payload = bytes | None


def _u32s() -> array:
    a = array("I")
    if a.itemsize != 4:
        a = array("L")
    if a.itemsize != 4:
        raise AssertionError("no 4-byte unsigned array type on this platform")
    return a


def pack_items(items: list[Payload]) -> dict[str, Any]:
    """The compact fields of a submit entry for `items` (one stdin digest or None per item)."""
    distinct: dict[Payload, int] = {}
    for d in items:
        if d not in distinct:
            distinct[d] = len(distinct)
    if len(distinct) == 1:
        return {"ip": list(distinct), "n": len(items)}
    ix = _u32s()
    ix.extend(distinct[d] for d in items)
    if sys.byteorder == "big":
        ix.byteswap()
    return {"ip": list(distinct), "ix": ix.tobytes()}


def entry_items(e: dict) -> list[Payload] | None:
    """Each item's payload, as one list with one object per distinct payload; None when the
    entry's items are malformed (or too many)."""
    if "items" in e:
        items = e["items"]
        if (not isinstance(items, list) or not items or len(items) > limits.items_max
                or not all(d is None or (isinstance(d, bytes) and len(d) == 32) for d in items)):
            return None
        shared: dict[bytes, bytes] = {}
        return [None if d is None else shared.setdefault(d, d) for d in items]
    ip = e.get("ip")
    if (not isinstance(ip, list) or not ip or len(ip) > limits.items_max
            or not all(d is None or (isinstance(d, bytes) and len(d) == 32) for d in ip)
            or len(set(ip)) != len(ip)):
        return None
    n, ix = e.get("n"), e.get("ix")
    if ix is None:
        if len(ip) != 1 or type(n) is not int or not 0 < n <= limits.items_max:
            return None
        return ip * n
    if n is not None or not isinstance(ix, bytes) or len(ix) % 4 or not ix:
        return None
    if len(ix) // 4 > limits.items_max:
        return None
    idx = _u32s()
    idx.frombytes(ix)
    if sys.byteorder == "big":
        idx.byteswap()
    if max(idx) >= len(ip):
        return None
    return [ip[k] for k in idx]


def entry_item_count(e: dict) -> int:
    """How many items a submit entry (made by this member: well formed) has."""
    if "items" in e:
        return len(e["items"])
    if "ix" in e:
        return len(e["ix"]) // 4
    return int(e["n"])


def entry_payloads(e: dict) -> list[Payload]:
    """The distinct payloads of a (committed, well-formed) submit entry."""
    if "items" in e:
        return list(dict.fromkeys(e["items"]))
    return list(e["ip"])


class ItemQueue:
    """A job's pending item indexes, in the order they are leased (see the module's theory)."""

    __slots__ = ("head", "lo", "hi", "holes", "tail")

    def __init__(self, n: int = 0) -> None:
        self.head: deque[int] = deque()
        self.lo = 0
        self.hi = n
        self.holes: set[int] | None = None
        self.tail: deque[int] = deque()

    @classmethod
    def of(cls, items: Iterable[int]) -> ItemQueue:
        """A queue holding `items` in this order (as a snapshot lists them)."""
        items = list(items)
        if items and items == list(range(items[0], items[0] + len(items))):
            q = cls(items[0] + len(items))
            q.lo = items[0]
            return q
        q = cls(0)
        q.tail.extend(items)
        return q

    def _in_run(self, i: int) -> bool:
        return self.lo <= i < self.hi and not (self.holes is not None and i in self.holes)

    def _settle(self) -> None:
        """Keep `lo` and `hi - 1` off the holes, and drop the holes once the run is empty."""
        holes = self.holes
        if holes is None:
            return
        while self.lo < self.hi and self.lo in holes:
            holes.discard(self.lo)
            self.lo += 1
        while self.hi > self.lo and self.hi - 1 in holes:
            holes.discard(self.hi - 1)
            self.hi -= 1
        if self.lo >= self.hi or not holes:
            self.holes = None
            if self.lo >= self.hi:
                self.lo = self.hi = 0

    def __len__(self) -> int:
        run = self.hi - self.lo - (len(self.holes) if self.holes is not None else 0)
        return len(self.head) + run + len(self.tail)

    def __bool__(self) -> bool:
        return bool(self.head) or self.lo < self.hi or bool(self.tail)

    def __iter__(self) -> Iterator[int]:
        yield from self.head
        holes = self.holes
        if holes is None:
            yield from range(self.lo, self.hi)
        else:
            for i in range(self.lo, self.hi):
                if i not in holes:
                    yield i
        yield from self.tail

    def __getitem__(self, k: int) -> int:
        if k != 0:
            raise IndexError("an item queue gives only its first item")
        if self.head:
            return self.head[0]
        if self.lo < self.hi:
            return self.lo
        if self.tail:
            return self.tail[0]
        raise IndexError("the item queue is empty")

    def __repr__(self) -> str:
        return f"ItemQueue({list(self)!r})"

    def popleft(self) -> int:
        if self.head:
            return self.head.popleft()
        if self.lo < self.hi:
            i = self.lo
            self.lo += 1
            self._settle()
            if self.lo >= self.hi:
                self.lo = self.hi = 0
            return i
        if self.tail:
            return self.tail.popleft()
        raise IndexError("pop from an empty item queue")

    def remove(self, i: int) -> None:
        if self._in_run(i):
            if i == self.lo:
                self.lo += 1
            elif i == self.hi - 1:
                self.hi -= 1
            else:
                if self.holes is None:
                    self.holes = set()
                self.holes.add(i)
            self._settle()
            if self.lo >= self.hi:
                self.lo = self.hi = 0
            return
        try:
            self.head.remove(i)
        except ValueError:
            self.tail.remove(i)  # ValueError when it is nowhere, as a deque's

    def append(self, i: int) -> None:
        self.tail.append(i)

    def appendleft(self, i: int) -> None:
        self.head.appendleft(i)

    def clear(self) -> None:
        self.head.clear()
        self.tail.clear()
        self.lo = self.hi = 0
        self.holes = None
