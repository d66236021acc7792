"""A part of the job node: restoring `blob_copies` of committed outputs after a member is lost.

Theory of operation. The table knows who held each item's outputs when its result committed
(the member that ran it and those that confirmed copies). When a member is newly found lost,
the leader walks the table (at most `recopy_items_per_round_max` items a round) for outputs
that fell under `blob_copies` with it: it copies them to another member when it holds them
itself, or fetches them from a survivor (it then holds them). At most `recopies_in_flight_max`
at a time; the walk waits for room. Copies made so are not written to the table: a later
leader that finds the same member lost may copy them again (extra copies are harmless and go
with their job).

Rule: pure, like the rest of the node. It owns the lost members, the walk and the copies
asked; it is given the config, the table, the node's counter and the way out for its
`CopyBlobs` and `FetchBlobs` effects, and per call the time, who is lost and which links are up.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from meshjobs import limits
from meshjobs.node.events import EMPTY_DIGEST, CopyBlobs, FetchBlobs, NodeConfig
from meshjobs.table import FINAL, JobTable


class Recopies:
    """Outputs being copied again: (job, item) -> (when asked, its digests, known holders)."""

    def __init__(self, cfg: NodeConfig, table: JobTable, count: Callable[..., None],
                 emit: Callable[[Any], None]) -> None:
        self.cfg = cfg
        self.table = table
        self._count = count
        self._emit = emit
        self.lost: set[str] = set()
        self._scan: list[str] = []
        self._scan_at = (0, 0)
        self.asked: dict[tuple[str, int], tuple[int, frozenset[str], frozenset[str]]] = {}

    def new_reign(self) -> None:
        """A new leader finds lost members afresh (its reign's start counts as heard)."""
        self.lost, self._scan = set(), []

    def has_room(self) -> bool:
        return len(self.asked) < limits.recopies_in_flight_max

    def walk(self, now_ms: int, lost: set[str], links: dict[str, bool]) -> None:
        """One round of the walk (see above), `lost` being the members lost now."""
        now = now_ms
        retry = False
        for key, (sent, _digests, _have) in list(self.asked.items()):
            if now - sent >= limits.recopy_retry_ms:
                # Not confirmed (the fetch found no holder then, or a copy was lost on the way):
                # forget it and walk again, so that it is asked once more.
                del self.asked[key]
                self._count("recopies_retried")
                retry = True
        if lost - self.lost or (retry and not self._scan and lost):
            # Someone newly lost, or a re-copy to ask again: walk the whole table (again).
            self._scan = list(self.table.jobs)
            self._scan_at = (0, 0)
            self._count("recopy_walks")
        self.lost = lost
        if not self._scan:
            return
        jobs = self.table.jobs
        budget = limits.recopy_items_per_round_max
        j, i = self._scan_at
        while j < len(self._scan) and budget > 0:
            job = jobs.get(self._scan[j])
            if job is None or i >= job.n:
                j, i = j + 1, 0
                continue
            if len(self.asked) >= limits.recopies_in_flight_max:
                break
            budget -= 1
            self.item(job, i, now_ms, links)
            i += 1
        self._scan_at = (j, i)
        if j >= len(self._scan):
            self._scan = []

    def item(self, job: Any, i: int, now_ms: int, links: dict[str, bool]) -> None:
        """Restore the copies of item i's outputs if a lost member held one."""
        lost = self.lost
        if job.st[i] not in FINAL or job.member[i] is None:
            return
        digests = tuple(sorted({d.hex() for d in (job.out[i], job.err[i])
                                if d is not None} - {EMPTY_DIGEST}))
        if not digests:
            return
        holders = {job.member[i], *(job.held[i] or () if job.held is not None else ())}
        if not holders & lost:
            return
        alive = holders - lost
        if len(alive) >= self.cfg.blob_copies:
            return
        key = (job.id, i)
        if key in self.asked:
            return
        if not alive:
            # Every holder the table knows is gone. A spare asked for a copy may still hold
            # them (its confirmation came after the result committed, so the table does not
            # name it): the leader fetches, which asks every linked member, then copies on.
            self._count("recopies_no_known_holder")
        self._step(key, digests, frozenset(alive), now_ms, links)

    def _step(self, key: tuple[str, int], digests: tuple[str, ...], have: frozenset[str],
              now_ms: int, links: dict[str, bool]) -> None:
        """The next step of restoring one item's copies, `have` being the members known to hold
        its outputs now: done once they are blob_copies; else copied from this member to
        others when it holds them, or fetched to this member first (which then copies on)."""
        if len(have) >= self.cfg.blob_copies:
            self.asked.pop(key, None)
            self._count("recopies_done")
            return
        if self.cfg.member in have:
            targets = sorted(p for p, up in links.items()
                             if up and p != self.cfg.member and p not in self.lost
                             and p not in have)
            if not targets:
                self.asked.pop(key, None)  # nobody to copy to now; a later walk may retry
                return
            self.asked[key] = (now_ms, frozenset(digests), have)
            self._count("recopies_asked")
            for to in targets:
                self._emit(CopyBlobs(to, key[0], digests))
        else:
            self.asked[key] = (now_ms, frozenset(digests), have)
            self._count("recopies_fetched")
            self._emit(FetchBlobs(key[0], digests))

    def copied(self, member: str, got: set[str], now_ms: int, links: dict[str, bool]) -> None:
        """A copy (or a fetch, confirmed as this member's own) of re-copied outputs is durable:
        one more holder, and the next step."""
        if not self.asked:
            return
        for key, (_sent, digests, have) in list(self.asked.items()):
            if digests <= got and member not in have:
                self._step(key, tuple(sorted(digests)), have | {member}, now_ms, links)
