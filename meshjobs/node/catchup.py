"""A part of the job node: the recent committed entries a leader keeps to catch worker members
up (F_JOB_STATE), so that a worker a little behind gets entries rather than the whole table.

Theory of operation. Each applied entry goes into the ring with the table position before it
(`prev`) and its own index; the ring holds only entries that follow one another (a gap, as
after a snapshot, empties it). It is bounded by entries (`state_ring_entries_max`) and by item
rows (`state_ring_rows_max`: a decoded entry of thousands of rows is large). `after(pos)` gives
the entries right after table position `pos`, or None when the ring no longer reaches back that
far (the leader then sends its whole table).

Rule: pure, like the rest of the node; it owns the ring and is given nothing else.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from meshjobs import limits


def entry_rows(e: Any) -> int:
    """About how many item rows a committed entry holds (what its decoded size goes with)."""
    if not isinstance(e, dict):
        return 1
    es = e.get("es")
    if e.get("k") == "batch" and isinstance(es, list):
        return 1 + sum(entry_rows(sub) for sub in es)
    n = 1
    for f in ("g", "r", "l", "items", "ids", "ip"):
        v = e.get(f)
        if isinstance(v, list):
            n += len(v)
    return n


class CatchUpRing:
    """Recent committed entries: (prev table index, index, entry, rows), in index order."""

    def __init__(self) -> None:
        self.entries: deque[tuple[int, int, Any, int]] = deque()
        self.rows = 0

    def add(self, prev: int, index: int, e: Any) -> None:
        if self.entries and self.entries[-1][1] != prev:
            self.entries.clear()  # the ring holds only entries that follow one another
            self.rows = 0
        rows = entry_rows(e)
        self.entries.append((prev, index, e, rows))
        self.rows += rows
        while (len(self.entries) > limits.state_ring_entries_max
               or self.rows > limits.state_ring_rows_max):
            self.rows -= self.entries.popleft()[3]

    def after(self, pos: int, applied: int) -> list[list] | None:
        """Up to `state_entries_max` committed entries right after table position `pos`, or None
        when the ring no longer reaches back that far (`applied`: the table's position)."""
        ring = self.entries
        if not ring or ring[0][0] > pos:
            return None if applied > pos else []
        # The ring is in index order; entries after pos follow the one whose prev is pos.
        lo, hi = 0, len(ring)
        while lo < hi:
            mid = (lo + hi) // 2
            if ring[mid][1] <= pos:
                lo = mid + 1
            else:
                hi = mid
        out = []
        for k in range(lo, min(lo + limits.state_entries_max, len(ring))):
            _prev, index, entry, _rows = ring[k]
            out.append([index, entry])
        if out and ring[lo][0] != pos:
            return None
        return out
