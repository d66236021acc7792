"""The blob writers: payloads queued by any thread, stored in batches, durable with one fsync each.

Theory of operation. `put` and `put_file` queue a payload and return a Future at once. One owner
thread takes whatever is queued when a writer is free, up to `limits.batch_blobs_max` payloads or
`limits.batch_bytes_max` bytes (a larger payload goes alone), and hands the batch to one of the
writer threads. The writer hashes and writes the whole batch in one transaction
(`store.write_batch`), makes it durable (`store.sync`, which shares an fsync with the other
writers when one is already under way after the commit), and only then resolves each caller's
Future with the digest, or with the error that kept that payload out. The busier the writers,
the larger the batches, so under load many payloads share each fsync.

Backpressure. Every queued payload counts towards `pending_bytes()` (a file by its size, from the
moment it is queued) until it is durable or has failed. Past `mem_max_bytes` the writers are
under pressure and call `on_pressure(True)`; once pending bytes fall back to half of that they
call `on_pressure(False)`. Pressure never refuses or blocks a put: the member reacts by taking no
new leases. The queue is bounded by count only (`limits.queue_items_max`, then StoreBusy).

Rules:
1. This module starts no threads: `targets()` gives the thread bodies, and the caller starts
   each one (in meshd, the daemon starts every thread).
2. A Future resolves only after its payload is durable, or with an exception; nothing is ever
   dropped. A failed fsync poisons the store, so every later batch fails too.
3. `on_pressure` is called with True and False alternately, in order, never twice in a row with
   the same value; it must return quickly and must not wait for the writers.
4. A broken invariant inside a writer (AssertionError) fails its batch and then kills the thread.
"""

from __future__ import annotations

import os
import queue
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from typing import Protocol

import structlog

from blobstore import limits
from blobstore.errors import BlobError, StoreClosed, check_data, check_owner

log = structlog.get_logger(__name__)


class StoreBusy(BlobError):
    """The blob writers' queue holds as many payloads as it may; try again once some are done."""


class BatchStore(Protocol):
    """The part of a blob store the writers use (LmdbBlobStore and MemoryBlobStore)."""

    def write_batch(
        self, payloads: list[bytes | str], owners: list[str | None] | None = None
    ) -> list[str | Exception]: ...

    def sync(self) -> bool: ...


class _Put(Future):  # type: ignore[type-arg]
    """A queued payload and the Future its caller holds, in one object: a put allocates little,
    as the writers' speed on small payloads is mostly the cost of each put's objects.

    Cancelling it only tells the caller's side: a queued payload is written all the same.
    """

    __slots__ = ("_payload", "_owner", "_size", "_remove")

    def __init__(self, payload: bytes | str, owner: str | None, size: int, remove: bool) -> None:
        Future.__init__(self)
        self._payload: bytes | str | None = payload
        self._owner = owner
        self._size = size
        self._remove = remove

    def _resolve(self, result: str | Exception) -> None:
        self._payload = None  # the caller may keep the Future long after; not the payload
        try:
            if isinstance(result, str):
                self.set_result(result)
            else:
                self.set_exception(result)
        except InvalidStateError:
            if not self.cancelled():
                raise


_STOP = None  # handed to a writer thread to end it
_FOR_PAYLOADS = 1
_FOR_A_FULL_BATCH = 2


class BlobWriters:
    """Batched, group-committed puts into a blob store by one owner and `writers` writer threads."""

    def __init__(
        self,
        store: BatchStore,
        mem_max_bytes: int,
        on_pressure: Callable[[bool], None] | None = None,
        writers: int = limits.writer_threads,
    ) -> None:
        if mem_max_bytes < 1:
            raise ValueError(f"mem_max_bytes must be at least 1, not {mem_max_bytes}")
        if writers < 1:
            raise ValueError(f"writers must be at least 1, not {writers}")
        self._store = store
        self._mem_max_bytes = mem_max_bytes
        self._on_pressure = on_pressure
        self._writers = writers
        self._lock = threading.Lock()  # the queue, the counters and the pressure flag
        self._wake = threading.Condition(self._lock)  # the owner waits here for payloads
        self._done = threading.Condition(self._lock)  # close waits here for the threads
        self._pressure_lock = threading.Lock()  # pressure changes and their calls, in order
        self._inbox: deque[_Put] = deque()
        # A writer takes a permit back when it is free, so the owner cuts a batch only when a
        # writer can start on it at once, and payloads keep gathering while all are busy.
        self._free = threading.Semaphore(writers)
        self._handoff: queue.Queue[list[_Put] | None] = queue.Queue(maxsize=writers)
        self._inbox_bytes = 0  # bytes of the payloads in _inbox
        self._pending_bytes = 0
        self._peak_pending_bytes = 0
        self._pressure = False
        self._closing = False
        # Why the owner sleeps on _wake, if it does: _FOR_PAYLOADS (any put wakes it) or
        # _FOR_A_FULL_BATCH (only a put that fills a batch, or a writer done writing, wakes it).
        self._owner_waits = 0
        self._writing = 0  # writers inside write_batch
        self._started = 0
        self._running = 0
        self._batches = 0
        self._payloads = 0
        self._fsyncs = 0
        self._targets = [("blob-owner", self._own)] + [
            (f"blob-writer-{n}", self._write) for n in range(1, writers + 1)
        ]

    # --- the callers' side ----------------------------------------------------------------------

    def put(self, data: bytes, owner: str | None = None) -> Future[str]:
        """Queue a payload (pinned for `owner` when given); the Future gives its digest once it
        is durable. Raises TypeError or ValueError for bad input, StoreBusy when the queue is
        full and StoreClosed after close."""
        if type(data) is not bytes:
            # Anything mutable is copied, as the caller may change it once put returns.
            data = bytes(check_data(data))
        if owner is not None:
            check_owner(owner)
        return self._enqueue(_Put(data, owner, len(data), False))

    def put_file(self, path: str, owner: str | None = None, remove: bool = False) -> Future[str]:
        """Queue a file, streamed into the store in bounded memory; with `remove`, the file is
        removed once its payload is durable (and kept when the put fails). A file that cannot
        be read gives a Future that fails with the OSError."""
        if not isinstance(path, str):
            raise TypeError(f"a file path is a str, not {type(path).__name__}")
        if owner is not None:
            check_owner(owner)
        try:
            size = os.stat(path).st_size
        except OSError as e:
            failed: Future[str] = Future()
            failed.set_exception(e)
            return failed
        return self._enqueue(_Put(path, owner, size, remove))

    def _enqueue(self, job: _Put) -> Future[str]:
        with self._lock:
            if self._closing:
                raise StoreClosed("the blob writers are closed")
            if len(self._inbox) >= limits.queue_items_max:
                raise StoreBusy(
                    f"{len(self._inbox)} payloads are already queued for the blob writers "
                    f"(at most {limits.queue_items_max}): wait for some to finish"
                )
            self._inbox.append(job)
            self._inbox_bytes += job._size
            self._pending_bytes += job._size
            if self._pending_bytes > self._peak_pending_bytes:
                self._peak_pending_bytes = self._pending_bytes
            if self._owner_waits == _FOR_PAYLOADS or (
                self._owner_waits == _FOR_A_FULL_BATCH and self._batch_is_full()
            ):
                self._wake.notify()
            change = not self._pressure and self._pending_bytes > self._mem_max_bytes
        if change:
            self._update_pressure()
        return job

    def pending_bytes(self) -> int:
        """Bytes of payload queued or being written, not yet durable."""
        with self._lock:
            return self._pending_bytes

    def under_pressure(self) -> bool:
        """True from when pending bytes pass mem_max_bytes until they fall to half of it."""
        with self._lock:
            return self._pressure

    def stats(self) -> dict[str, int]:
        """Counters since start: batches written, payloads stored, fsyncs run by the writers;
        and now: pending_bytes, peak_pending_bytes, queued payloads."""
        with self._lock:
            return {
                "batches": self._batches,
                "payloads": self._payloads,
                "fsyncs": self._fsyncs,
                "pending_bytes": self._pending_bytes,
                "peak_pending_bytes": self._peak_pending_bytes,
                "queued": len(self._inbox),
            }

    def targets(self) -> list[tuple[str, Callable[[], None]]]:
        """The thread bodies, each with a thread name: the owner, then the writers. The caller
        starts one thread for each, and all of them before calling close."""
        return list(self._targets)

    def close(self) -> None:
        """Refuse new puts, finish every queued one, and return once the threads have ended.
        When no thread was ever started, the queued Futures fail with StoreClosed instead."""
        with self._lock:
            self._closing = True
            self._wake.notify_all()
            if self._started == 0:
                orphans = list(self._inbox)
                self._inbox.clear()
                self._inbox_bytes = 0
            else:
                orphans = []
                while self._running:
                    self._done.wait()
        if orphans:
            self._account(-sum(j._size for j in orphans))
            for job in orphans:
                job._resolve(StoreClosed("the blob writers closed before starting"))

    # --- pressure -------------------------------------------------------------------------------

    def _account(self, delta: int) -> None:
        with self._lock:
            self._pending_bytes += delta
            if self._pending_bytes < 0:
                raise AssertionError("blob writers' pending bytes went below zero")
            change = self._pressure and self._pending_bytes <= self._mem_max_bytes // 2
        if change:
            self._update_pressure()

    def _update_pressure(self) -> None:
        """Move the pressure flag to what pending bytes say now, and report the move. Both
        happen under one lock, so the reports come in the order of the moves."""
        with self._pressure_lock:
            with self._lock:
                pending = self._pending_bytes
                if not self._pressure and pending > self._mem_max_bytes:
                    self._pressure = True
                elif self._pressure and pending <= self._mem_max_bytes // 2:
                    self._pressure = False
                else:
                    return
                now = self._pressure
            log.info("blob_pressure", on=now, pending_bytes=pending, max_bytes=self._mem_max_bytes)
            if self._on_pressure is not None:
                self._on_pressure(now)

    # --- the threads ----------------------------------------------------------------------------

    def _enter(self) -> None:
        with self._lock:
            self._started += 1
            self._running += 1

    def _leave(self) -> None:
        with self._lock:
            self._running -= 1
            self._done.notify_all()

    def _own(self) -> None:
        """The owner: cut a batch whenever a writer is free; stop the writers when closed."""
        self._enter()
        try:
            while True:
                self._free.acquire()
                batch = self._take()
                if batch is None:
                    break
                self._handoff.put(batch)
        finally:
            for _ in range(self._writers):
                self._handoff.put(_STOP)
            self._leave()

    def _batch_is_full(self) -> bool:
        return (
            len(self._inbox) >= limits.batch_blobs_max
            or self._inbox_bytes >= limits.batch_bytes_max
        )

    def _take(self) -> list[_Put] | None:
        """The next batch: as many queued payloads as the limits allow, at least one; None once
        closed with nothing left.

        While another writer is still writing its batch, a new batch would only queue behind it
        for the store's write lock, so the owner waits until that write is done or the batch is
        full: payloads that arrive meanwhile join this batch instead of making more, smaller
        ones, each with its own transaction and fsync. An idle store takes a payload at once.
        """
        with self._lock:
            while True:
                if not self._inbox:
                    if self._closing:
                        return None
                    self._owner_waits = _FOR_PAYLOADS
                elif self._writing and not self._closing and not self._batch_is_full():
                    self._owner_waits = _FOR_A_FULL_BATCH
                else:
                    break
                self._wake.wait()
                self._owner_waits = 0
            inbox = self._inbox
            if self._inbox_bytes <= limits.batch_bytes_max:
                # Any prefix fits by bytes: only the count limits the batch (the usual case
                # for small payloads, so it is cut without looking at each one's size).
                if len(inbox) <= limits.batch_blobs_max:
                    batch = list(inbox)
                    inbox.clear()
                    self._inbox_bytes = 0
                    return batch
                batch = [inbox.popleft() for _ in range(limits.batch_blobs_max)]
                self._inbox_bytes -= sum(j._size for j in batch)
                return batch
            batch = []
            batch_bytes = 0
            while inbox and len(batch) < limits.batch_blobs_max:
                size = inbox[0]._size
                if batch and batch_bytes + size > limits.batch_bytes_max:
                    break
                batch.append(inbox.popleft())
                batch_bytes += size
            self._inbox_bytes -= batch_bytes
            return batch

    def _write(self) -> None:
        """A writer: write each batch handed to it, make it durable, resolve its Futures."""
        self._enter()
        try:
            while True:
                batch = self._handoff.get()
                if batch is _STOP:
                    return
                try:
                    self._write_one(batch)
                finally:
                    self._free.release()
        finally:
            self._leave()

    def _write_one(self, batch: list[_Put]) -> None:
        failure: Exception | None = None
        results: list[str | Exception] = []
        synced = False
        try:
            with self._lock:
                self._writing += 1
            try:
                results = self._store.write_batch(
                    [j._payload for j in batch],  # type: ignore[misc]
                    [j._owner for j in batch],
                )
            finally:
                with self._lock:
                    self._writing -= 1
                    if self._owner_waits == _FOR_A_FULL_BATCH:
                        self._wake.notify()
            if len(results) != len(batch):
                raise AssertionError(f"write_batch answered {len(results)} of {len(batch)}")
            stored = sum(isinstance(r, str) for r in results)
            if stored:
                synced = self._store.sync()
        except Exception as e:  # the batch's callers must hear of it; see the re-raise below
            failure = e
            log.error("blob_batch_failed", payloads=len(batch), error=str(e))
            results = [e] * len(batch)
            stored = 0
        for job, result in zip(batch, results, strict=True):
            if job._remove and isinstance(result, str):
                try:
                    os.remove(job._payload)  # type: ignore[arg-type]
                except FileNotFoundError:
                    pass
                except OSError as e:
                    log.warning("blob_spool_remove_failed", path=job._payload, error=str(e))
        with self._lock:
            self._batches += 1
            self._payloads += stored
            self._fsyncs += synced
        # Pending bytes drop before any Future resolves, so a caller that saw its Future done
        # also sees its bytes gone from pending_bytes() and the pressure that follows.
        self._account(-sum(j._size for j in batch))
        for job, result in zip(batch, results, strict=True):
            job._resolve(result)
        if isinstance(failure, AssertionError):
            raise failure
