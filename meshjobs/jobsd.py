"""The jobs thread: the loop that ticks Raft, steps the job node and owns the durability gate.

It reads like raft's own loop (etcd's `Ready`/`Advance`):

1. tick pysyncobj without waiting: messages are handled and committed entries are applied to the
   table, on this thread;
2. step the node with what happened: the Raft view, committed entries and their outcomes, a bounded
   batch of control requests, frames from other members, item ends, the time;
3. take the node's effects; hand proposals to pysyncobj (they only enter the log);
4. the gate: fsync the journal (one fsync for everything logged since the last one);
5. only then release what depends on it: answers, frames, runs and cuts, blob pins and copies;
6. wait for a socket, a wake-up or the next deadline, unless there is more to do at once.

If the journal cannot be made durable, or the node breaks an invariant of its own, the member
stops at once with a non-zero exit (fail-stop): it never answers from state it could not keep.

A worker member has no Raft replica: `replica.WorkerReplica` stands in for it (nothing to tick,
nothing to sync), and the node applies the leader's F_JOB_STATE frames to its table itself.
"""

from __future__ import annotations

import itertools
import os
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import msgpack
import structlog

from meshjobs import limits
from meshjobs.control import Answer
from meshjobs.diskspace import is_disk_error
from meshjobs.frames import Assembler, Chunker, FrameError, FrameType, is_part
from meshjobs.node import (
    BlobBytes,
    BlobsCopied,
    CopyBlobs,
    Ctl,
    Cut,
    DumpReady,
    FetchBlobs,
    FrameIn,
    ItemEnded,
    JobNode,
    PeerLink,
    Pin,
    Reply,
    Run,
    Send,
    SendDump,
    Tick,
    Unpin,
    UnpinAllBut,
    WantDump,
    advance,
    dispatch,
    run_round,
)
from meshjobs.node.events import Exit, Notify
from meshjobs.replica import WorkerReplica as WorkerReplica  # its home before; still found here
from meshjobs.replica import fail_stop

log = structlog.get_logger(__name__)

_BUSY = Answer(503, {"error": "member busy: too many requests queued; try again shortly"})
_STOPPING = Answer(503, {"error": "member is stopping; try another member or try again later"})


def _wall_ms() -> int:
    return int(time.time() * 1000)


class JobsThread:
    """The jobs thread and the control port that HTTP talks to."""

    def __init__(self, node: JobNode, replica: Any, driver: Any, blobs: Any,
                 clock_ms: Callable[[], int] = _wall_ms,
                 exit_fn: Callable[[int], None] | None = None,
                 links: Any = None, mover: Any = None) -> None:
        self.node = node
        self.replica = replica
        self.driver = driver
        self.blobs = blobs
        self.links = links
        self.mover = mover
        self.clock_ms = clock_ms
        self._exit_fn = exit_fn
        self.inbox: queue.Queue = queue.Queue(maxsize=limits.ctl_queue_max)
        self.ends: queue.Queue = queue.Queue(maxsize=limits.driver_events_max)
        self._tokens = itertools.count(1)
        self._futures: dict[int, Future] = {}
        self._stop = threading.Event()
        self._last_view = None
        self._chunker = Chunker()
        self._sent_body: Any = None  # the body _send packed last, and its parts (None: one frame)
        self._sent_parts: list[dict] | None = None
        self._assembler = Assembler()
        # Items whose stdin blob is on another member: started once it is fetched, or at the
        # deadline (the driver then fails the item, saying the input is missing).
        self._awaiting_input: dict[tuple[str, int, int], tuple[Run, float]] = {}
        # Blobs the node asked to have here (copies lost with a member): pinned for their owner
        # and confirmed to the node once all are here, or dropped at the deadline.
        self._awaiting_fetch: dict[tuple[str, tuple[str, ...]], float] = {}
        self.frames_dropped = 0
        self.syncs = 0
        self._metrics_tokens: set[int] = set()
        self._next_publish_ms = 0
        self.writers: Any = None  # the blob writer threads, for their counters
        self.logs: Any = None  # live item output (meshjobs.itemlogs.ItemLogs), set by the daemon
        self.history: Any = None  # the history writer (meshjobs.history.History), for its counters
        # The member's latency histograms (meshjobs.metrics.MemberMetrics), set by the daemon.
        self.timings: Any = None
        self._submit_at: dict[int, float] = {}  # token of a submit -> when it was taken
        # Run of this member -> wall time its lease reached the jobs thread (for lease->start).
        self._run_at: dict[tuple[str, int, int], float] = {}
        # Set by the daemon: what a `meshctl member stop` does once the node says it may exit,
        # and the sender of jobs' finish notices (meshjobs.notify.Notifier).
        self.on_exit: Callable[[str], None] | None = None
        self.notifier: Any = None
        # Set by the daemon on a member with links and a dump: sends dumps to new workers
        # (meshjobs.dumpsend.DumpSender), off this thread.
        self.dump_sender: Any = None
        self._dump_told: int | None = None  # the dump position the node was last told of
        # A wake-up of this thread is on its way (see `_wake`); cleared before each round takes
        # its events, so an event queued after that sends a new one.
        self._woken = False
        self._logging = False  # this round proposed: its entries go into the log before the sync
        self._effects = self._effect_table()

    def _data_dir(self) -> str | None:
        """The folder of the journal (where a full disk is looked for), if there is one."""
        path = getattr(self.replica.journal, "path", None)
        return os.path.dirname(path) if isinstance(path, str) else None

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
        self._wake()
        return fut

    def item_ended(self, end: ItemEnded) -> None:
        """The driver's report of an item's end. Blocks while the queue is full: an end is never
        dropped (a lost end would hold its lease until the member restarts)."""
        self.event(end)  # the driver reports the node's own ItemEnded event

    def event(self, ev: Any) -> None:
        """An event from a thread of this member (driver, blob threads): never dropped."""
        self.ends.put(ev)
        self._wake()

    def frame_in(self, peer: str, frame: Any) -> None:
        """A frame from the links thread. Blob frames go to the blob mover, live output frames
        to the item logs; the rest to the node. Frames are hints: when the inbox is full they are dropped and counted."""
        name = frame.type.name
        if name in ("F_BLOB_PUT", "F_BLOB_GET"):
            if self.mover is not None:
                self.mover.frame(peer, frame.type, frame.body)
            return
        if name in ("F_LOG_GET", "F_LOG_PUT"):
            if self.logs is not None:
                self.logs.frame(peer, frame.type, frame.body)
            return
        try:
            self.inbox.put_nowait((0, FrameIn(peer, name, frame.body), None))
        except queue.Full:
            self.frames_dropped += 1
            return
        self._wake()

    def peer_changed(self, peer: str, up: bool, hello: dict) -> None:
        self.event(PeerLink(peer, up))

    def _wake(self) -> None:
        """Wake the thread for an event just queued, unless a wake-up is on its way already:
        a round takes every event queued before it starts, so while one is due, more are only
        more writes to the notifier's pipe (a system call each, and a switch of threads).
        The event is queued before `_woken` is read here, and the round clears `_woken` before
        it takes its events: an event is either taken by the round that is due or wakes another."""
        if self._woken:
            return
        self._woken = True
        self.replica.notifier.notify()

    def stop(self) -> None:
        self._stop.set()
        self.replica.notifier.notify()

    # --- the thread ------------------------------------------------------------------------------

    def run(self) -> None:
        try:
            self._loop()
        except BaseException as exc:  # a bug of our own or a disk that failed: stop loudly
            if not is_disk_error(exc):  # (a disk's error is told by fail_stop, with no trace)
                log.exception("jobs_thread_crashed")
            fail_stop(log, "the jobs thread stopped on an error", exc, path=self._data_dir(),
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
            if fut is not None:
                fut.set_result(_STOPPING)

    def _loop(self) -> None:
        node, replica = self.node, self.replica
        while not self._stop.is_set():
            replica.tick(0.0)
            replica.compact_when_large()
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
            replica.wait(min(wait_s, replica.due_s()))

    def _step_once(self) -> bool:
        """One round: gather the events, step the node with them (`run_round`), then carry out
        what it asks in the gate's order (`advance`: log, sync, release)."""
        replica = self.replica
        events: list[Any] = []
        self._woken = False  # events queued from here on wake the thread again (see `_wake`)
        view = replica.view()
        if view != self._last_view:
            self._last_view = view
            events.append(view)
            log.info("raft_view", term=view.term, leader=view.leader, is_leader=view.is_leader,
                     ready=view.ready)
        now = self.clock_ms()
        # The monotonic clock too: committed time advances by it (node/clock.py), so a wall
        # clock set while the member runs changes no job's age.
        events.append(Tick(now, time.monotonic_ns() // 1_000_000))
        dumped = getattr(replica, "dump_position", None)
        if dumped is not None and dumped != self._dump_told:
            self._dump_told = dumped
            events.append(DumpReady(dumped))
        if now >= self._next_publish_ms:
            # Every `publish_ms`: what the blob store holds, for this member's reports.
            self._next_publish_ms = now + limits.publish_ms
            events.append(BlobBytes(int(self.blobs.stats().get("bytes", 0))))
        applied = replica.take_applied()
        events += applied
        taken = 0
        while taken < limits.events_batch_max:
            try:
                token, req, fut = self.inbox.get_nowait()
            except queue.Empty:
                break
            taken += 1
            if fut is None:
                frame = self._frame(req)
                if frame is not None:
                    events.append(frame)
                continue
            self._futures[token] = fut
            if isinstance(req, dict):
                if req.get("op") == "metrics":
                    self._metrics_tokens.add(token)
                elif req.get("op") == "submit" and self.timings is not None:
                    self._submit_at[token] = time.monotonic()
            events.append(Ctl(token, req))
        while taken < limits.events_batch_max:
            try:
                ev = self.ends.get_nowait()
            except queue.Empty:
                break
            if isinstance(ev, ItemEnded) and self.timings is not None:
                self._time_end(ev)
            events.append(ev)
            taken += 1
        ready = run_round(self.node, events)
        advance(ready, persist=self._persist, sync=self._sync, release=self._release)
        if not ready.entries:
            # (After a proposal the next tick sends its entries, which carry the commit index.)
            replica.send_commit_notice()
        if self._awaiting_input:
            self._start_ready_inputs()
        if self._awaiting_fetch:
            self._confirm_fetches()
        return bool(ready.entries) or bool(applied) or taken >= limits.events_batch_max

    def _persist(self, entry: dict) -> None:
        self.replica.propose(entry)
        self._logging = True

    def _sync(self) -> None:
        """The gate: one fsync for everything logged since the last one (this round's entries,
        or what Raft appended). Nothing that `advance` releases after it leaves this thread
        before the journal is durable; if it cannot be made durable the member stops."""
        replica = self.replica
        if self._logging:
            # Into the log before the fsync, so that this round's fsync covers the round's
            # entries (not the next round's, after one more trip round the loop).
            self._logging = False
            replica.log_proposals()
        if not replica.journal.dirty:
            return
        try:
            t0 = time.monotonic()
            replica.journal_sync()
            if self.timings is not None:
                self.timings.journal_fsync_s.observe(time.monotonic() - t0)
        except OSError as exc:
            fail_stop(log, "the journal could not be made durable", exc, path=self._data_dir(),
                      **({"exit_fn": self._exit_fn} if self._exit_fn else {}))
            raise
        self.syncs += 1

    def _start_ready_inputs(self) -> None:
        now = time.monotonic()
        for key, (item, deadline) in list(self._awaiting_input.items()):
            if now >= deadline or self.blobs.has(item.stdin):
                del self._awaiting_input[key]
                self.driver.start(item)

    def _confirm_fetches(self) -> None:
        now = time.monotonic()
        for key, deadline in list(self._awaiting_fetch.items()):
            owner, digests = key
            if all(self.blobs.has(d) for d in digests):
                del self._awaiting_fetch[key]
                self.blobs.pin_many(digests, owner)
                # On the jobs thread already: straight to the node (its effects go next round).
                self.node.step(BlobsCopied(self.node.cfg.member, digests))
            elif now >= deadline:
                del self._awaiting_fetch[key]  # the node gives up on it too, and may ask again

    def _time_end(self, ev: ItemEnded) -> None:
        """Observe an item's lease->start and run time (clocks of the driver, wall ms)."""
        leased_at = self._run_at.pop((ev.job_id, ev.index, ev.epoch), None)
        if leased_at is not None and ev.started_ms:
            self.timings.lease_start_s.observe(max(0.0, ev.started_ms / 1000.0 - leased_at))
        if ev.error is None and ev.started_ms and ev.ended_ms >= ev.started_ms:
            self.timings.item_run_s.observe((ev.ended_ms - ev.started_ms) / 1000.0)

    def edge_metrics(self) -> dict[str, float]:
        """Counters of the edges (journal, Raft port, links, blob store and writers, mover)."""
        m: dict[str, float] = {"journal_syncs": self.syncs, "frames_inbox_dropped": self.frames_dropped}
        dump_stats = getattr(self.replica, "dump_stats", None)
        if dump_stats is not None:
            m.update(dump_stats())
        m["driver_orphans_reaped"] = getattr(self.driver, "orphans_reaped", 0)
        raft_dropped = getattr(self.replica, "raft_dropped", None)
        if raft_dropped is not None:
            for reason, n in raft_dropped().items():
                m[f"raft_dropped_{reason}"] = n
        # What the Raft seam decided (replica.RAFT_COUNTERS): refused truncations, pre-votes...
        for name, n in getattr(self.replica, "raft_stats", {}).items():
            m[f"raft_{name}"] = n
        if self.links is not None:
            st = self.links.stats()
            for reason, n in st.get("dropped", {}).items():
                m[f"links_dropped_{reason}"] = n
            for reason, n in st.get("send_dropped", {}).items():
                m[f"links_send_dropped_{reason}"] = n
            m["links_peers_up"] = st.get("peers_up", 0)
            for peer, p in self.links.peers().items():
                if p.get("clock_skew_ms") is not None:
                    m[f"links_clock_skew_ms_{peer}"] = p["clock_skew_ms"]
        try:
            for k, v in self.blobs.stats().items():
                if isinstance(v, (int, float)):
                    m[f"blobs_{k}"] = v
        except Exception:  # a store that is closing: no blob counters this time
            pass
        if self.writers is not None:
            for k, v in self.writers.stats().items():
                m[f"blob_writers_{k}"] = v
        if self.mover is not None:
            st = self.mover.stats()
            for reason, n in st.get("dropped", {}).items():
                m[f"blob_mover_dropped_{reason}"] = n
            for k, v in st.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    m[f"blob_mover_{k}"] = v
        history = getattr(self, "history", None)
        if history is not None:
            m.update(history.counts)
        if self.dump_sender is not None:
            m.update(self.dump_sender.counts)
        if self.notifier is not None:
            m.update(self.notifier.numbers())
        if self.logs is not None:
            st = self.logs.stats()
            for reason, n in st.get("dropped", {}).items():
                m[f"item_logs_dropped_{reason}"] = n
            for k, v in st.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    m[f"item_logs_{k}"] = v
        return m

    def _frame(self, ev: FrameIn) -> FrameIn | None:
        """A frame for the node, once whole (a frame sent in parts waits for its last part)."""
        body = ev.body
        if is_part(body):
            try:
                whole = self._assembler.add(ev.peer, body)
            except FrameError:
                return None  # counted by the assembler
            if whole is None:
                return None
            ev = FrameIn(ev.peer, ev.ftype, whole)
        return ev

    def _release(self, eff: Any) -> None:
        dispatch(eff, self._effects)

    def _effect_table(self) -> dict[type, Callable[[Any], None]]:
        """What this edge does with each effect the node may release (node/ready.py)."""
        return {
            Reply: self._answer,
            Send: self._send,
            Run: self._start,
            Cut: self._cut,
            Pin: lambda eff: self.blobs.pin_many(eff.digests, eff.owner),
            Unpin: lambda eff: self.blobs.unpin_owner(eff.owner),
            UnpinAllBut: self._unpin_all_but,
            CopyBlobs: self._copy,
            FetchBlobs: self._fetch,
            Exit: self._exit,
            Notify: self._notify,
            SendDump: self._send_dump,
            WantDump: lambda eff: self.replica.want_dump(),
        }

    def _answer(self, eff: Reply) -> None:
        fut = self._futures.pop(eff.token, None)
        answer = eff.answer
        taken_at = self._submit_at.pop(eff.token, None)
        if taken_at is not None and 200 <= answer.status < 300:
            self.timings.submit_commit_s.observe(time.monotonic() - taken_at)
        if eff.token in self._metrics_tokens:
            self._metrics_tokens.discard(eff.token)
            if answer.status == 200 and isinstance(answer.body, dict):
                answer = Answer(200, {**answer.body, **self.edge_metrics()})
        if fut is not None:
            fut.set_result(answer)

    def _start(self, eff: Run) -> None:
        item = eff  # the driver runs the node's Run effect as it is
        if self.timings is not None:
            if len(self._run_at) >= limits.run_stamps_max:
                del self._run_at[next(iter(self._run_at))]  # the oldest: its end was lost
            self._run_at[item.key] = time.time()
        if eff.stdin is not None and self.mover is not None and not self.blobs.has(eff.stdin):
            self.mover.prefetch(eff.stdin)
            self._awaiting_input[item.key] = (item, time.monotonic() + limits.blob_fetch_s_max)
        else:
            self.driver.start(item)

    def _cut(self, eff: Cut) -> None:
        if self._awaiting_input.pop((eff.job_id, eff.index, eff.epoch), None) is None:
            self.driver.cut(eff.job_id, eff.index, eff.epoch)

    def _unpin_all_but(self, eff: UnpinAllBut) -> None:
        for owner in self.blobs.owners() - eff.keep:
            self.blobs.unpin_owner(owner)

    def _copy(self, eff: CopyBlobs) -> None:
        if self.mover is not None:
            self.mover.copy(eff.to, eff.owner, eff.digests)

    def _fetch(self, eff: FetchBlobs) -> None:
        if self.mover is not None:
            for d in eff.digests:
                self.mover.prefetch(d)
            self._awaiting_fetch[(eff.owner, eff.digests)] = (
                time.monotonic() + limits.blob_copy_wait_ms / 1000)

    def _exit(self, eff: Exit) -> None:
        log.info("meshd_stop_ordered", why=eff.why)
        if self.on_exit is not None:
            self.on_exit(eff.why)

    def _notify(self, eff: Notify) -> None:
        if self.notifier is not None:
            self.notifier.offer(eff.url, eff.key, eff.record)

    def _send_dump(self, eff: SendDump) -> None:
        if self.dump_sender is not None:
            self.dump_sender.offer(eff.to, eff.body)

    def _send(self, eff: Send) -> None:
        if self.links is None:
            return
        ftype = FrameType[eff.ftype]
        if eff.table and eff.body is self._sent_body:
            # The table body just sent to another member (the whole table, to every worker
            # behind: leader.push_state shares it): packed and split once, not once per member.
            parts = self._sent_parts
        else:
            raw = msgpack.packb(eff.body, use_bin_type=True)
            if self._chunker.fits(raw):
                parts = None
            else:
                # Too large for one frame (a table snapshot, a large batch of entries): in
                # parts, as one table batch, so that a part that cannot be queued drops the rest.
                try:
                    parts = self._chunker.split(raw)
                except ValueError:
                    log.error("frame_too_large", to=eff.to, ftype=eff.ftype, bytes=len(raw))
                    return
            if eff.table:
                self._sent_body, self._sent_parts = eff.body, parts
        if parts is None:
            self.links.send(eff.to, ftype, eff.body, table=eff.table)
            return
        self.links.send_batch(eff.to, [(ftype, part) for part in parts], table=True)
