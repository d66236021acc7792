"""The feed of committed changes: what `GET /jobs/{id}?since=` and `GET /events` follow.

Theory of operation. Every job carries a version: the log index of the last committed entry that
changed it (table.py), the same on every member. The node keeps a bounded ring of recent changes,
(version, job id) in log order, made from the committed entries as they are applied: which job
each entry names is enough, since what a client is sent is the job's record as the table has it
when the answer is made (an entry that names a job without changing it costs a look, nothing
more: the job's version says whether it changed after `since`).

The `changes` op answers a client that has seen everything up to version `since` with every job
that changed after it and passes its filters (its current record, in version order), and each
forgotten job (`forget`, with the version of the entry that forgot it); or, when the ring no
longer holds every change after `since` (it was trimmed, or a snapshot was installed), with
`reset`: the client reloads and goes on from the current version. With nothing to say, the op
waits (a long-poll, answered by the same rounds as the other waiters) until a change comes or
`wait_ms` passes.

Rule 1: pure, like the rest of the node.
Rule 2: bounded: the ring (`events_ring_changes_max`), the waiters (`events_waiters_max`) and the
        events of one answer (`events_answer_max`; the answer's version then says how far it
        got, and the next call goes on from there).
Rule 3: an answer never skips a change: its version is the table's applied index when it holds
        every change that passes the filters (or the version of its last event when cut short).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

from meshjobs import limits
from meshjobs.table import JobTable


def named_jobs(kind: Any, e: dict, out: dict) -> list[str]:
    """The job ids a committed entry (applied with outcome `out`) may have changed: those it
    names, and the dependents its outcome says it released or ended (`deps`)."""
    deps = out.get("deps")
    named = _named_jobs(kind, e, out)
    if isinstance(deps, list):
        seen = set(named)
        for j in deps:
            if isinstance(j, str) and j not in seen:
                seen.add(j)
                named.append(j)
    return named


def _named_jobs(kind: Any, e: dict, out: dict) -> list[str]:
    if kind in ("submit", "cancel", "tone", "forget", "rerun"):
        job_id = out.get("id", e.get("id"))
        return [job_id] if isinstance(job_id, str) else []
    if kind == "cron":  # a schedule's fired run: the job it made
        job_id = out.get("id") if out.get("new") else None
        return [job_id] if isinstance(job_id, str) else []
    if kind == "bulk":
        rows = out.get("rows")
        return [r[0] for r in rows if r[1] == "changed"] if isinstance(rows, list) else []
    if kind == "expire":
        ids = out.get("expired")
        return [j for j in ids if isinstance(j, str)] if isinstance(ids, list) else []
    rows = {"lease": e.get("g"), "result": e.get("r"), "revoke": e.get("l")}.get(kind)
    if not isinstance(rows, list):
        return []
    ids: dict[str, None] = {}
    for row in rows:
        if isinstance(row, list) and row and isinstance(row[0], str):
            ids[row[0]] = None
    return list(ids)


class Feed:
    """A part of the node: the ring of recent changes and the `changes` op. It owns the ring
    and the clients that wait on it; it is given the table, and the node's counter and answer."""

    def __init__(self, table: JobTable, count: Callable[[str], None],
                 reply: Callable[[int, int, Any], None]) -> None:
        self.table = table
        self._count = count
        self._reply = reply
        # (version, job id) of recent changes in log order, complete after version `floor`;
        # `last` is the index of the last entry seen, to tell a gap (a snapshot installed)
        # from a sequence.
        self.ring: deque[tuple[int, str]] = deque()
        self.floor = table.applied_index
        self.last = table.applied_index
        self.waiters: list[tuple[int, dict, int]] = []  # (token, request, deadline)

    # --- the ring -----------------------------------------------------------------------------

    def follows(self, prev: int, index: int) -> None:
        """Entry `index` is applied on top of table position `prev`."""
        if prev != self.last:
            self._gap(prev)
        self.last = index

    def note(self, index: int, kind: Any, e: dict, out: dict) -> None:
        for job_id in named_jobs(kind, e, out):
            self.ring.append((index, job_id))
        while len(self.ring) > limits.events_ring_changes_max:
            dropped, _ = self.ring.popleft()
            self.floor = max(self.floor, dropped)

    def _gap(self, index: int) -> None:
        """Entries up to `index` came some other way (a snapshot): what changed before it is
        not known here, so a client that saw less must reload."""
        self.ring.clear()
        self.floor = index
        self.last = index
        self._count("feed_gaps")

    def deadlines(self) -> list[int]:
        return [w[2] for w in self.waiters]

    # --- the op -------------------------------------------------------------------------------

    def op(self, token: int, req: dict, now_ms: int) -> None:
        self._check()
        answer = self._answer(req)
        if answer is not None or not req["wait_ms"]:
            self._reply(token, 200, answer or self._body([], self.table.applied_index))
            return
        if len(self.waiters) >= limits.events_waiters_max:
            self._count("changes_waiters_full")
            self._reply(token, 503, {"error": "too many clients follow changes on this member; "
                                              "try again shortly, or another member"})
            return
        self.waiters.append((token, req, now_ms + req["wait_ms"]))

    def _check(self) -> None:
        if self.table.applied_index != self.last:
            self._gap(self.table.applied_index)  # a snapshot installed without entries

    def answer_waiters(self, now_ms: int) -> None:
        if not self.waiters:
            return
        self._check()
        keep = []
        for token, req, deadline in self.waiters:
            answer = self._answer(req)
            if answer is not None:
                self._reply(token, 200, answer)
            elif deadline <= now_ms:
                self._reply(token, 200, self._body([], self.table.applied_index))
            else:
                # Nothing up to here passes its filters: the next round looks only at what
                # comes after.
                since = max(req["since"], self.table.applied_index)
                keep.append((token, {**req, "since": since}, deadline))
        self.waiters = keep

    def _body(self, events: list[dict], version: int, reset: bool = False) -> dict:
        return {"version": version, "reset": reset, "events": events}

    def _answer(self, req: dict) -> dict | None:
        """The answer to `req` now, or None when there is nothing to say yet."""
        table = self.table
        since = req["since"]
        if since is None:
            return self._body([], table.applied_index)
        if since < self.floor:
            self._count("feed_resets")
            return self._body([], table.applied_index, reset=True)
        if not self.ring or self.ring[-1][0] <= since:
            return None
        latest: dict[str, int] = {}
        for index, job_id in reversed(self.ring):
            if index <= since:
                break
            latest.setdefault(job_id, index)
        jobs, tags, states, pools = req["jobs"], req["tags"], req["states"], req["pools"]
        found: list[tuple[int, str, Any]] = []
        for job_id, index in latest.items():
            if jobs is not None and job_id not in jobs:
                continue
            job = table.jobs.get(job_id)
            if job is None:
                # Gone: a forget passes the job filter only (its tags and state are gone too).
                found.append((index, "forget", job_id))
            elif (job.version > since
                  and (tags is None or not tags.isdisjoint(job.tags))
                  and (states is None or job.state in states)
                  and (pools is None or job.pool in pools)):
                found.append((job.version, "job", job))
        if not found:
            return None
        found.sort(key=lambda f: f[0])
        version = table.applied_index
        if len(found) > limits.events_answer_max:
            # Cut short between two versions, never inside one (the next call goes on after
            # the last version sent); one entry's jobs all go, however many.
            cut = limits.events_answer_max
            last = found[cut - 1][0]
            while cut > 0 and found[cut - 1][0] == last:
                cut -= 1
            if cut == 0:
                cut = sum(1 for f in found if f[0] == last)
            found = found[:cut]
            version = found[-1][0]
        events = [{"event": "forget", "version": v, "data": {"id": x, "version": v}}
                  if kind == "forget" else {"event": "job", "version": v, "data": table.record(x)}
                  for v, kind, x in found]
        return self._body(events, version)
