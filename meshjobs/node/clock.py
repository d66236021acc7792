"""A part of the job node: its reckoning of the fleet's committed time.

Theory of operation. Retention measures a finished job's age in committed time (table.py Rule
7), never against one member's wall clock: a job that ended under a leader whose clock was right
must not expire early (or late) because the next leader's clock is minutes ahead (or behind).
Every batch a leader proposes carries its reckoning (`c`) and its boot id (`cb`); the table keeps
the greatest `c` (`clock_ms`, never backwards) and the last stamp.

Each member reckons committed time as: the last stamp another member made (or this member made
in an earlier run), plus what its own monotonic clock has measured since it applied that stamp;
its own stamps do not move it (they are its own reckoning already), and it is never behind the
table's `clock_ms`. So a member's reckoning runs at its own clock's rate from where the fleet's
log stands, whatever its wall clock says, and a new leader goes on from the stamps of the last.
What this gives (the simulator checks it with leaders whose wall clocks are minutes off): a
job is expired at the earliest `keep_s` after the batch that ended it was proposed, as time
passes. Committed time loses what no member measured (the time since a stamp, for a member that
restarts; the time a whole fleet was down), so retention errs late, never early.

Rule: pure, like the rest of the node. Time comes in with the node's ticks (`Tick.mono_ms`, or
the wall clock when a tick has none); the table is read, never changed.
"""

from __future__ import annotations

from meshjobs.table import JobTable


class CommittedClock:
    """This member's reckoning of committed time: `now_ms()` after each `observe`."""

    def __init__(self, boot: str) -> None:
        self.boot = boot
        self.mono_ms = 0  # this member's monotonic clock, as of its last tick
        self._base_ms: int | None = None  # committed time at _at_ms (None: not yet reckoned)
        self._at_ms = 0
        self._seen: tuple[int, int, str] | None = None  # the table's (index, last stamp, by)

    def tick(self, mono_ms: int) -> None:
        self.mono_ms = max(self.mono_ms, mono_ms)

    def observe(self, table: JobTable, wall_ms: int) -> None:
        """Take in what the table says (once per round, after its entries are applied). A
        member with an empty table starts from its wall clock: the first stamps of a new
        fleet are its first leader's time."""
        if self._base_ms is None:
            self._base_ms, self._at_ms = (table.clock_ms or wall_ms), self.mono_ms
        seen = (table.applied_index, table.stamp_ms, table.stamp_by)
        if seen != self._seen:
            self._seen = seen
            if table.applied_index and table.stamp_by != self.boot:
                self._base_ms, self._at_ms = table.stamp_ms, self.mono_ms
        if self.now_ms() < table.clock_ms:
            self._base_ms, self._at_ms = table.clock_ms, self.mono_ms

    def now_ms(self) -> int:
        """Committed time now, as this member reckons it."""
        assert self._base_ms is not None, "committed time read before the table was observed"
        return self._base_ms + self.mono_ms - self._at_ms
