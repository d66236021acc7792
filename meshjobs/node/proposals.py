"""A part of the job node: what one round proposes, and this leader's entries in flight.

Theory of operation. During a round, clients' changes (`change`) and the leader's own leases,
results, revokes, expiries, re-runs and schedule fires (`duty`) are gathered here; at the end
of the round `flush` puts them into the log together, one `batch` entry (or a few, each at most
`ctl_batch_max` entries), so that a busy leader commits them with one Raft round and one fsync.
Changes come first: a lease may name a job submitted in the same batch. Each batch carries a
tag; the batch is in flight until an entry with its tag is applied (`applied`) or
`proposal_wait_ms` passes. While the entries before are in flight, the leader proposes no more
duties (`may_propose`) and changes wait for room (they get more room than duties).

Rule: pure, like the rest of the node; it owns its lists and tags and is given the node's
counter and the way out for its `Propose` effects.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from meshjobs import limits
from meshjobs.node.events import Propose


class Proposals:
    """The entries this round proposes and the batches in flight (tag -> when proposed)."""

    def __init__(self, count: Callable[[str], None], emit: Callable[[Any], None]) -> None:
        self._count = count
        self._emit = emit
        self.changes: list[dict] = []  # clients' changes to propose at the end of this round
        self.duties: list[dict] = []  # and the leader's leases, results, revokes, expiries
        self.in_flight: dict[int, int] = {}  # this leader's batches: tag -> when proposed
        self._seq = 0

    def change(self, entry: dict) -> None:
        self.changes.append(entry)

    def duty(self, entry: dict) -> None:
        self.duties.append(entry)

    def may_propose(self, now_ms: int, changes: bool = False) -> bool:
        """Is there room for another entry in flight? (One applied, or lost for
        `proposal_wait_ms`, makes room.) Changes clients wait for get more room than the
        leader's own leases and results."""
        for tag, sent in list(self.in_flight.items()):
            if now_ms - sent >= limits.proposal_wait_ms:
                del self.in_flight[tag]
        most = limits.changes_in_flight_max if changes else limits.proposals_in_flight_max
        return len(self.in_flight) < most

    def flush(self, now_ms: int, leading: bool, stamp: tuple[int, str]) -> None:
        """Propose what this round gathered (see the theory above), each batch stamped with
        `stamp`: committed time as this leader reckons it and its boot id (table.py Rule 7).
        A member that does not lead proposes nothing: its changes time out and are retried."""
        if not self.changes and not self.duties:
            return
        if not leading:
            self.changes = []
            self.duties = []
            return
        if not self.duties and not self.may_propose(now_ms, changes=True):
            return
        entries = self.changes + self.duties
        self.changes, self.duties = [], []
        for k in range(0, len(entries), limits.ctl_batch_max):
            self._seq += 1
            self.in_flight[self._seq] = now_ms
            self._count("batches_proposed")
            self._emit(Propose({"k": "batch", "t": now_ms, "p": self._seq, "c": stamp[0],
                                "cb": stamp[1], "es": entries[k:k + limits.ctl_batch_max]}))

    def applied(self, tag: Any) -> None:
        """A batch with this tag is applied: it holds nothing back any more."""
        self.in_flight.pop(tag, None)

    def new_reign(self) -> None:
        """What an earlier reign proposed holds nothing back."""
        self.in_flight.clear()

    def deadline_ms(self) -> int | None:
        """When changes held back by the batches in flight may go at the latest."""
        if self.changes and self.in_flight:
            return min(self.in_flight.values()) + limits.proposal_wait_ms
        return None
