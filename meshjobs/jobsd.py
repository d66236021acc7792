"""The jobs thread: the loop that ticks Raft, steps the job node and owns the durability gate.

It reads like raft's own loop (etcd's `Ready`/`Advance`):

1. tick pysyncobj without waiting: messages are handled and committed entries are applied to the
   table, on this thread;
2. step the node with what happened: the Raft view, committed entries and their outcomes, a bounded
   batch of control requests and item ends, the time;
3. take the node's effects; hand proposals to pysyncobj (they only enter the log);
4. the gate: fsync the journal (one fsync for everything logged since the last one);
5. only then release what depends on it: answers, runs and cuts, blob pins;
6. wait for a socket, a wake-up or the next deadline, unless there is more to do at once.

If the journal cannot be made durable, or the node breaks an invariant of its own, the member
stops at once with a non-zero exit (fail-stop): it never answers from state it could not keep.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import structlog

from meshjobs import limits
from meshjobs.control import Answer
from meshjobs.driver import RunItem
from meshjobs.node import (
    Ctl,
    Cut,
    ItemEnded,
    JobNode,
    Pin,
    Propose,
    Reply,
    Run,
    Tick,
    Unpin,
    UnpinAllBut,
)
from meshjobs.replica import Replica, fail_stop

log = structlog.get_logger(__name__)

_BUSY = Answer(503, {"error": "member busy: too many requests queued; try again shortly"})
_STOPPING = Answer(503, {"error": "member is stopping; try another member or try again later"})


def _wall_ms() -> int:
    return int(time.time() * 1000)


class JobsThread:
    """The jobs thread and the control port that HTTP (and, later, peers) talk to."""

    def __init__(self, node: JobNode, replica: Replica, driver: Any, blobs: Any,
                 clock_ms: Callable[[], int] = _wall_ms,
                 exit_fn: Callable[[int], None] | None = None) -> None:
        self.node = node
        self.replica = replica
        self.driver = driver
        self.blobs = blobs
        self.clock_ms = clock_ms
        self._exit_fn = exit_fn
        self.inbox: queue.Queue = queue.Queue(maxsize=limits.ctl_queue_max)
        self.ends: queue.Queue = queue.Queue(maxsize=limits.driver_events_max)
        self._tokens = itertools.count(1)
        self._futures: dict[int, Future] = {}
        self._stop = threading.Event()
        self._last_view = None
        self.syncs = 0

    # --- called from other threads ---------------------------------------------------------------

    def call(self, request: dict) -> Future:
        """The control port: a request in, a future of its Answer out (never blocks)."""
        fut: Future = Future()
        if self._stop.is_set():
            fut.set_result(_STOPPING)
            return fut
        try:
            self.inbox.put_nowait((next(self._tokens), request, fut))
        except queue.Full:
            fut.set_result(_BUSY)
            return fut
        self.replica.notifier.notify()
        return fut

    def item_ended(self, end: Any) -> None:
        """The driver's report of an item's end. Blocks while the queue is full: an end is never
        dropped (a lost end would hold its lease until the member restarts)."""
        self.ends.put(ItemEnded(end.job_id, end.index, end.epoch, end.state, end.rc, end.signal,
                                end.stdout, end.stderr, end.started_ms, end.ended_ms, end.error))
        self.replica.notifier.notify()

    def stop(self) -> None:
        self._stop.set()
        self.replica.notifier.notify()

    # --- the thread ------------------------------------------------------------------------------

    def run(self) -> None:
        try:
            self._loop()
        except BaseException as exc:  # a bug of our own or a disk that failed: stop loudly
            log.exception("jobs_thread_crashed")
            fail_stop(log, "the jobs thread stopped on an error", exc,
                      **({"exit_fn": self._exit_fn} if self._exit_fn else {}))
            return
        for fut in self._futures.values():
            fut.set_result(_STOPPING)
        self._futures.clear()
        while True:
            try:
                _token, _req, fut = self.inbox.get_nowait()
            except queue.Empty:
                break
            fut.set_result(_STOPPING)

    def _loop(self) -> None:
        node, replica = self.node, self.replica
        while not self._stop.is_set():
            replica.tick(0.0)
            if replica.dump_damage is not None:
                raise replica.dump_damage
            busy = self._step_once()
            if busy or replica.needs_tick():
                continue
            now = self.clock_ms()
            wait_s = limits.publish_ms / 1000.0
            deadline = node.next_deadline_ms()
            if deadline is not None:
                wait_s = max(0.0, min(wait_s, (deadline - now) / 1000.0))
            replica.wait(wait_s)

    def _step_once(self) -> bool:
        node, replica = self.node, self.replica
        view = replica.view()
        if view != self._last_view:
            self._last_view = view
            node.step(view)
            log.info("raft_view", term=view.term, leader=view.leader, is_leader=view.is_leader,
                     ready=view.ready)
        node.step(Tick(self.clock_ms()))
        applied = replica.take_applied()
        for a in applied:
            node.step(a)
        events = 0
        while events < limits.events_batch_max:
            try:
                token, req, fut = self.inbox.get_nowait()
            except queue.Empty:
                break
            self._futures[token] = fut
            node.step(Ctl(token, req))
            events += 1
        while events < limits.events_batch_max:
            try:
                end = self.ends.get_nowait()
            except queue.Empty:
                break
            node.step(end)
            events += 1
        effects = node.take()
        proposed = False
        for eff in effects:
            if isinstance(eff, Propose):
                replica.propose(eff.entry)
                proposed = True
        # The gate: nothing below leaves this thread before the journal is durable.
        if replica.journal.dirty:
            try:
                replica.journal_sync()
            except OSError as exc:
                fail_stop(log, "the journal could not be made durable", exc,
                          **({"exit_fn": self._exit_fn} if self._exit_fn else {}))
                raise
            self.syncs += 1
        for eff in effects:
            self._release(eff)
        return proposed or bool(applied) or events >= limits.events_batch_max

    def _release(self, eff: Any) -> None:
        if isinstance(eff, Reply):
            fut = self._futures.pop(eff.token, None)
            if fut is not None:
                fut.set_result(eff.answer)
        elif isinstance(eff, Run):
            self.driver.start(RunItem(eff.job_id, eff.index, eff.epoch, eff.argv, eff.env,
                                      eff.cwd, eff.stdin, eff.runtime_s))
        elif isinstance(eff, Cut):
            self.driver.cut(eff.job_id, eff.index, eff.epoch)
        elif isinstance(eff, Pin):
            for d in eff.digests:
                self.blobs.pin(d, eff.owner)
        elif isinstance(eff, Unpin):
            self.blobs.unpin_owner(eff.owner)
        elif isinstance(eff, UnpinAllBut):
            for owner in self.blobs.owners() - eff.keep:
                self.blobs.unpin_owner(owner)
        elif isinstance(eff, Propose):
            pass
        else:
            raise AssertionError(f"unknown effect {eff!r}")
