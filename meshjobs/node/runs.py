"""A part of the job node: the runs of items on this member, and results not yet committed.

Theory of operation. A run is (job, index, epoch): an item leased to this member under one
epoch. The node starts it (the `Run` effect) and keeps it here until the driver says it ended
(`ItemEnded`); an ended run's result row waits here until an entry commits it. Every member
sends its results to the leader (F_RESULT), and the leader proposes them with its own; a result
not seen committed is sent again after `proposal_retry_ms`, and at once to a new reign (another
leader, or another term): the leader it went to may have died with it, or dropped it before
it was ready to lead. The table's epochs make a repeat harmless. A run whose lease is gone (revoked, or the job cancelled) is dropped, with its
result: the edge cuts it if it still runs.

Rule: pure, like the rest of the node; it owns the runs and results and is given the node's
counter.
"""

from __future__ import annotations

from collections.abc import Callable, Container

from meshjobs import limits
from meshjobs.node.events import ItemEnded
from meshjobs.table import DONE, FAILED, TIMEOUT

RunKey = tuple[str, int, int]  # (job id, index, epoch)


class Runs:
    """Runs on this member (ended or not) and the results waiting to be committed."""

    def __init__(self, count: Callable[[str], None]) -> None:
        self._count = count
        self.running: dict[RunKey, bool] = {}  # run -> ended
        self.results: dict[RunKey, list] = {}
        self.result_from: dict[RunKey, str] = {}  # the member a result came from (leader)
        # run -> when its result was last sent or proposed, and to which reign (leader, term)
        self.results_sent: dict[RunKey, tuple[int, str, int]] = {}

    def running_count(self) -> int:
        """Runs started here that have not ended."""
        return sum(1 for ended in self.running.values() if not ended)

    def started(self, key: RunKey) -> None:
        self.running[key] = False

    def ended(self, ev: ItemEnded) -> RunKey | None:
        """The driver says a run ended: its result row (unless it was cut). The run's key when
        it has a result; None for an end of a run unknown here, or of one that was cut."""
        key = (ev.job_id, ev.index, ev.epoch)
        if key not in self.running:
            self._count("ends_unknown")
            return None
        self.running[key] = True
        if ev.state == "cut":
            return None
        code = {"done": DONE, "failed": FAILED, "timeout": TIMEOUT}.get(ev.state)
        if code is None:
            raise AssertionError(f"driver reported unknown state {ev.state!r}")
        self.results[key] = [
            ev.job_id, ev.index, ev.epoch, code, ev.rc, ev.signal,
            None if ev.stdout is None else bytes.fromhex(ev.stdout),
            None if ev.stderr is None else bytes.fromhex(ev.stderr),
            ev.started_ms, ev.ended_ms,
        ]
        if ev.error:
            # Why it failed without running (the program is missing, say): kept with the result,
            # cut to a bounded length.
            self.results[key].append(ev.error[:limits.item_error_chars_max])
        return key

    def from_member(self, key: RunKey, row: list, peer: str) -> None:
        """The leader takes a result another member sent (F_RESULT), if it has none yet."""
        if key not in self.results:
            self.results[key] = row
            self.result_from[key] = peer

    def drop_others(self) -> None:
        """This member no longer leads: forget the results other members sent it (each member
        sends its own to the next leader)."""
        for key in self.result_from:
            self.results.pop(key, None)
            self.results_sent.pop(key, None)
        self.result_from.clear()

    def committed(self, key: RunKey) -> None:
        """An entry committed this run's result."""
        self.results.pop(key, None)
        self.results_sent.pop(key, None)
        self.result_from.pop(key, None)

    def gone(self, key: RunKey) -> bool:
        """The run's lease is gone: forget the run and its result. Whether it had ended."""
        ended = self.running.pop(key)
        self.results.pop(key, None)
        self.results_sent.pop(key, None)
        return ended

    def frees_slot(self, key: RunKey, held: Container) -> bool:
        """Has this run ended with its outputs copied (not `held`)? Its slot is free then,
        before its result commits."""
        return key in self.results and key not in held

    def due(self, rows_max: int, now_ms: int, held: Container, leader: str,
            term: int) -> list[list]:
        """Results ready to go (not `held` for their outputs' copies) and not sent lately to
        this reign (`leader` in `term`), marked sent now: proposed by the leader, sent to it by
        any other member."""
        rows = []
        for key, row in self.results.items():
            if key in held:
                continue
            sent = self.results_sent.get(key)
            if (sent is not None and now_ms - sent[0] < limits.proposal_retry_ms
                    and sent[1] == leader and sent[2] == term):
                continue
            self.results_sent[key] = (now_ms, leader, term)
            rows.append(row)
            if len(rows) >= rows_max:
                break
        return rows
