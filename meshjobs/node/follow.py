"""A member that does not lead: it reports to the leader, forwards changes, sends results, and —
a worker member — follows the leader's table through F_JOB_STATE.

A worker's table is its own: it answers reads from it whatever it hears, and says whether they
are fresh. Two things are told apart, each from the leader's own frames, never from a read:
- `caught_up`, latched: its table has been where the leader's frames put it, once since this
  member started (a table installed whole, or entries applied in order). Before that, a job it
  does not know may exist all the same, and "no such job" or a job list is no answer yet.
- `in_step`: its table is at least where every frame of the leader it got said it should be.
  A frame that shows entries it does not have (a gap: frames were lost, say on a link that went
  silent while it was cut off) means it knows it is behind: it is not fresh until they come.

Frames are hints that make things faster; none is needed for correctness. A lost F_RESULT is
sent again until the member's table shows the lease ended; a lost F_CTL times out with 503 and
the client retries with the same request id; a lost F_JOB_STATE is sent again when the worker's
next F_JOB_HAVE shows it behind.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from meshjobs import dumpbytes, limits
from meshjobs.node.events import Applied, NodeConfig, Send, View
from meshjobs.table import JobTable

# Fields of a member's report that change on their own all the time (sent with the keep-alive).
_DRIFTING = ("pos", "running", "blob_bytes", "wall_ms")


class Follower:
    """A part of the node: a member that does not lead follows the leader. It owns when it last
    heard the leader (or a hint of who leads) and when it reports next; it is given the config,
    the table, the node's counter, the way out for its frames, and the node's view setter and
    applier of committed entries (a worker applies the leader's entries to its table)."""

    def __init__(self, cfg: NodeConfig, table: JobTable, count: Callable[[str], None],
                 emit: Callable[[Any], None], set_view: Callable[[View], None],
                 applied: Callable[[Applied], None]) -> None:
        self.cfg = cfg
        self.table = table
        self._count = count
        self._emit = emit
        self._set_view = set_view
        self._applied = applied
        self.leader_seen_ms = 0  # a worker: when a frame from the leader itself last came
        self.upto = 0  # the furthest table position a frame of the leader itself has shown
        self.caught_up = False  # the table has been in step with the leader once since start
        self.leader_hint_ms = 0  # and when a voter last said who leads
        self.next_have_ms = 0
        # What the last report said (but its position and running items, which move all the
        # time under load) and to whom: a report with nothing else new waits for the keep-alive.
        self._said: tuple[str | None, dict] | None = None
        self._quiet = False  # whether the leader was quiet at the last round (see follow)

    def on_lease(self, body: Any) -> None:
        index = body.get("index") if isinstance(body, dict) else None
        if type(index) is int and index > self.table.applied_index:
            self.next_have_ms = 0  # behind: report now, the leader sends what is missing

    def on_state(self, peer: str, body: Any, view: View, now_ms: int) -> None:
        if self.cfg.role != "worker" or not isinstance(body, dict):
            return
        term, leader = body.get("term"), body.get("leader")
        if type(term) is not int or not (leader is None or isinstance(leader, str)):
            self._count("frames_bad_state")
            return
        if term < view.term:
            return  # from a deposed leader
        if leader != peer:
            # A voter's hint of who leads (it answered our F_JOB_HAVE): worth reporting there,
            # but it says nothing of whether we hear the leader, so it never makes our table
            # fresh, and a hint carries no entries.
            if leader is not None and (view.leader is None or term > view.term):
                self._set_view(View(term=term, leader=leader, is_leader=False, ready=False))
                self.leader_hint_ms = now_ms
            self._count("state_hints")
            return
        self._set_view(View(term=term, leader=leader, is_leader=False, ready=True))
        self.leader_seen_ms = now_ms
        if "dump" in body:
            self._install_dump(peer, body)
            return
        if "snapshot" in body:
            try:
                table = JobTable.from_state(body["snapshot"])
            except Exception:  # remote garbage: a table we cannot load is not installed
                self._count("frames_bad_state")
                return
            self.table.load(table)
            self._count("state_snapshots_installed")
            self._shown(self.table.applied_index)
            return
        entries, prev = body.get("entries"), body.get("prev")
        if not isinstance(entries, list) or type(prev) is not int:
            return
        if prev != self.table.applied_index:
            self._count("state_gaps")
            self.next_have_ms = 0
            # What it shows is known to exist: behind it, this table is not fresh.
            self._shown(max([prev] + [e[0] for e in entries if isinstance(e, list) and e
                                      and type(e[0]) is int]))
            return
        self._apply_entries(entries)

    def _apply_entries(self, entries: list) -> None:
        for e in entries:
            if not (isinstance(e, list) and len(e) == 2 and type(e[0]) is int
                    and e[0] > self.table.applied_index):
                self._count("frames_bad_state")
                return
            prev = self.table.applied_index
            outcome = self.table.apply(e[1], e[0])
            self._applied(Applied(e[0], e[1], outcome, prev))
        self._shown(self.table.applied_index)

    def _shown(self, pos: int) -> None:
        """A frame of the leader itself showed that the table reaches `pos` at least."""
        self.upto = max(self.upto, pos)
        if self.in_step():
            self.caught_up = True

    def in_step(self) -> bool:
        """Does the table hold all that the leader's frames have shown it (a worker)?"""
        return self.table.applied_index >= self.upto

    def _install_dump(self, peer: str, body: dict) -> None:
        """The whole table as the leader's latest dump (its file's bytes) and the committed
        entries after it. Checked whole before anything is installed: the dump's header,
        length, checksum and document (dumpbytes.py), the table it holds, that it does not take
        this table backwards, and that the entries follow it: `prev` is the position of the
        dump the leader meant; the file it read may be newer, and then the entries the dump
        already holds are skipped, the rest applied only when they follow it."""
        raw, prev, entries = body.get("dump"), body.get("prev"), body.get("entries")
        if (not isinstance(raw, bytes) or type(prev) is not int or not isinstance(entries, list)
                or not all(isinstance(e, list) and len(e) == 2 and type(e[0]) is int
                           for e in entries)
                or any(b[0] <= a[0] for a, b in zip(entries, entries[1:], strict=False))
                or (entries and entries[0][0] <= prev)):
            self._count("frames_bad_state")
            return
        try:
            dump = dumpbytes.parse(raw, f"from {peer}", "it is not installed")
            table = JobTable.from_state(dump.state)
        except Exception:  # remote garbage: a dump we cannot check or load is not installed
            self._count("frames_bad_state")
            return
        pos = table.applied_index
        if pos < prev or pos < self.table.applied_index:
            self._count("state_dumps_stale")  # never a table older than meant, or than ours
            self.next_have_ms = 0
            self._shown(prev)  # the leader's dump reaches there: behind it, not fresh
            return
        rest = [e for e in entries if e[0] > pos]
        self.table.load(table)
        self._count("state_dumps_installed")
        if rest and pos != prev and not any(e[0] == pos for e in entries):
            # A newer dump than the leader meant, and no entry of those sent is its last: where
            # they follow on is not known. The leader sends what is missing when asked.
            self._count("state_gaps")
            self.next_have_ms = 0
            self._shown(rest[-1][0])  # what it shows is known to exist: not fresh behind it
            return
        self._apply_entries(rest)

    def follow(self, view: View, now_ms: int, report: Callable[[], dict]) -> str | None:
        """What every non-leader does each round: give up a leader not heard from for too long
        (a worker), and report to the leader (or, none known, to the voters) every `have_ms`
        (`report`: the body). The leader to send to, if one is known."""
        if (self.cfg.role == "worker" and view.leader is not None
                and now_ms - max(self.leader_seen_ms, self.leader_hint_ms) > self.cfg.dead_ms):
            # Not heard from the leader for too long: do not pretend to know who leads (changes
            # then fail fast with 503 instead of waiting on a leader that may be gone).
            view = View(term=view.term)
            self._set_view(view)
            self._count("leader_lost")
            # Ask the voters who leads now, as while no leader is known, not at the next keep-alive.
            self.next_have_ms = min(self.next_have_ms, now_ms + limits.have_ms)
        leader = view.leader if view.leader != self.cfg.member else None
        # Every `have_ms` while no leader is known (it is looked for); to a known leader, at
        # once when it is new or something but the position and running items changed, else
        # every `have_keepalive_ms`: 200 workers' reports every have_ms are 800 frames a
        # second of chatter. A worker behind or missing entries reports at once (next_have_ms
        # is set to 0). A worker whose leader has been quiet for `leader_quiet_ms` reports
        # every `have_ms`, to the voters too (see below).
        body = report()
        said = (leader, {k: v for k, v in body.items() if k not in _DRIFTING})
        quiet = (leader is not None and self.cfg.role == "worker"
                 and now_ms - self.leader_seen_ms > limits.leader_quiet_ms)
        if quiet and not self._quiet:
            self.next_have_ms = now_ms  # ask the voters now, not at the next keep-alive
        self._quiet = quiet
        if now_ms >= self.next_have_ms or (leader is not None and said != self._said):
            slow = leader is not None and not quiet
            self.next_have_ms = now_ms + (limits.have_keepalive_ms if slow else limits.have_ms)
            self._said = said
            voters = [v for v in self.cfg.voters if v != self.cfg.member]
            targets = [leader] if leader else voters
            if quiet:
                # The leader has been quiet for a while: it may be gone. The voters answer with
                # who leads now, so that this member reports to a new leader well before that
                # leader's grace for unheard members (dead_ms from its reign's start) runs out
                # and its leases here are revoked (and their items run again elsewhere).
                targets += [v for v in voters if v != leader]
            for to in targets:
                self._emit(Send(to, "F_JOB_HAVE", body))
        return leader
