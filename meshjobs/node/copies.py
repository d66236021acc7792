"""Parts of the job node: blob copies. `Copies` holds results and submits back until their blobs
are on `blob_copies` members; `Recopies` restores `blob_copies` of committed outputs after a
member is lost.

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
from dataclasses import dataclass, field
from typing import Any

import blake3

from meshjobs import limits
from meshjobs.node.events import EMPTY_DIGEST, CopyBlobs, FetchBlobs, NodeConfig
from meshjobs.node.runs import Runs
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


@dataclass
class _Copies:
    """Blob copies a result waits for before it may be proposed."""

    owner: str
    digests: tuple[str, ...]
    have: set[str] = field(default_factory=set)  # members that confirmed every digest
    asked: dict[str, int] = field(default_factory=dict)  # member -> when
    # For a submit's inputs: the request to carry on with once they are copied, and by when.
    then: tuple[list[int], dict] | None = None
    deadline_ms: int = 0


class Copies:
    """Results (job, index, epoch) and submits ("in", rid) waiting for their blobs to be on
    enough members.

    Rule: pure. It owns what waits; it is given the config, the runs (whose result rows name
    who confirmed copies), the other members this member knows of, the node's counter, the way
    out for its `CopyBlobs` effects, the way to answer a client, and the way to carry on with a
    submit whose inputs are copied (proposed here when leading, else forwarded)."""

    def __init__(self, cfg: NodeConfig, runs: Runs, others: Callable[[], set[str]],
                 count: Callable[..., None], emit: Callable[[Any], None],
                 reply: Callable[[int, int, Any], None],
                 carry_on: Callable[[int, dict], None]) -> None:
        self.cfg = cfg
        self.runs = runs
        self._others = others
        self._count = count
        self._emit = emit
        self._reply = reply
        self._carry_on = carry_on
        self.waiting: dict[tuple, _Copies] = {}

    def __contains__(self, key: object) -> bool:
        return key in self.waiting

    def __bool__(self) -> bool:
        return bool(self.waiting)

    def deadlines(self) -> list[int]:
        return [c.deadline_ms for c in self.waiting.values() if c.then is not None]

    def link_down(self, peer: str) -> None:
        for copies in self.waiting.values():
            copies.asked.pop(peer, None)  # asked again as soon as it is back

    def drop(self, key: tuple) -> None:
        """A result committed or a run gone: nothing waits for its copies any more."""
        self.waiting.pop(key, None)

    def input_fp(self, rid: str) -> Any:
        """The fingerprint of a submit waiting under `rid` for its inputs' copies, if any."""
        waiting = self.waiting.get(("in", rid))
        if waiting is not None and waiting.then is not None:
            return waiting.then[1].get("fp")
        return None

    def inputs_first(self, token: int, req: dict, now_ms: int,
                     new_id: Callable[[], str]) -> bool:
        """A submit's stdin blobs are on this member only (the HTTP edge stored them here): they
        go to `blob_copies` members before the submit goes on, so that losing this member loses
        no acknowledged job. True when the submit now waits for that."""
        digests = tuple(sorted({d for d in req["items"] if d is not None and d != EMPTY_DIGEST}))
        if not digests or self.cfg.blob_copies <= 1 or not self._others():
            return False
        rid = req["rid"]
        waiting = self.waiting.get(("in", rid))
        if waiting is not None and waiting.then is not None:
            waiting.then[0].append(token)  # a retry of a submit already waiting for its copies
            return True
        if req["spec"].get("id") is None:
            # The job's id is stamped here, so that the copies are pinned under it.
            req = {**req, "spec": {**req["spec"], "id": new_id()}}
        self.waiting[("in", rid)] = _Copies(
            req["spec"]["id"], digests, then=([token], req),
            deadline_ms=now_ms + limits.ctl_commit_ms_max)
        return True

    def ended(self, key: tuple, owner: str, outs: tuple[str, ...]) -> None:
        """A run ended here with these outputs: its result waits for their copies."""
        to_copy = tuple(sorted(set(outs) - {EMPTY_DIGEST}))
        if to_copy and self.cfg.blob_copies > 1 and self._others():
            self.waiting[key] = _Copies(owner, to_copy)

    def copied(self, member: str, got: set[str]) -> None:
        for copies in self.waiting.values():
            if got.issuperset(copies.digests):
                copies.have.add(member)

    def ask(self, now_ms: int, links: dict[str, bool]) -> None:
        """A result's outputs (and a submit's inputs) must be on `blob_copies` members before
        it is proposed: ask `blob_copies - 1` linked members and `copy_spares` more at once,
        and go on with the first `blob_copies - 1` that confirm. (Asking one at a time made
        one silent member, whose link still looks up until it times out, hold every copy back
        for seconds; asking every member would store every output everywhere.) A member that
        has not confirmed is asked again after `proposal_retry_ms`, and another one in its
        place at once."""
        if not self.waiting:
            return
        now = now_ms
        need = min(self.cfg.blob_copies - 1, len(self._others()))
        linked = sorted(p for p, up in links.items() if up and p != self.cfg.member)
        for key, copies in list(self.waiting.items()):
            if len(copies.have) >= need:
                del self.waiting[key]
                row = self.runs.results.get(key)
                if row is not None and copies.have:
                    # The result names who confirmed copies, so that the table knows where its
                    # outputs are when a member is lost (see Recopies).
                    if len(row) == 10:
                        row.append(None)
                    row.append(sorted(copies.have)[:limits.result_holders_max])
                if copies.then is not None:
                    tokens, req = copies.then
                    for token in tokens:
                        self._carry_on(token, req)
                continue
            if copies.then is not None and now >= copies.deadline_ms:
                del self.waiting[key]
                self._count("inputs_not_copied")
                for token in copies.then[0]:
                    self._reply(token, 503, {
                        "error": "the job's inputs could not be copied to another member in time "
                                 "(members unreachable?); nothing was submitted: try again"})
                continue
            # The members still needed and the spares at once, from a place in the list that
            # depends on the owner, so that copies spread over the members.
            waiting = sum(1 for p, t in copies.asked.items()
                          if p not in copies.have and now - t < limits.proposal_retry_ms)
            room = need - len(copies.have) + limits.copy_spares - waiting
            if room <= 0 or not linked:
                continue
            start = blake3.blake3(copies.owner.encode()).digest()[0] % len(linked)
            for to in linked[start:] + linked[:start]:
                if room <= 0:
                    break
                if to in copies.have:
                    continue
                asked = copies.asked.get(to)
                if asked is not None and now - asked < limits.proposal_retry_ms:
                    continue
                copies.asked[to] = now
                room -= 1
                self._emit(CopyBlobs(to, copies.owner, copies.digests))
