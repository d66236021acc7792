"""The blob mover: the thread that does the IO of blob transfers between members.

The protocol itself (frames, windows, assemblies, acknowledgements, timeouts) is the pure
meshjobs/blobxfer.py; its docstring describes the frames and the rules. The mover feeds it and
executes what it returns: it reads the store (through `_StoreSource`), writes chunks to spool
files, keeps blobs in the store (`write_batch` and `sync`, or `put_file`, and pins), hands frames
to the links, and answers the threads that wait for fetches.

One thread (`run`) does all the work. Other threads only call `copy`, `frame` (the links'
thread), `fetch` (HTTP threads), `prefetch`, `stats` and `stop`: they take one short lock and,
except `fetch`, which waits for its answer, never block.

Rules:
- Every queue is bounded: the inbox by frames and by chunk bytes, the fetches waiting; the
  protocol bounds the rest (blobxfer's Rule 2). What does not fit is dropped and counted.
- A blob is acknowledged only once it is durable (and pinned for its owner): the protocol says
  so only after `kept`/`batch_kept`, which the mover calls after the store's `sync` or
  `put_file` returned. Received blobs of one chunk of one turn are kept in one `write_batch`
  and one `sync`.
- Garbage from a peer is counted by reason in `stats()["dropped"]`; it never raises. A mistake
  of the caller's own (a bad digest or owner passed to `copy` or `fetch`) raises ValueError.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import structlog

from blobstore import BlobError, is_digest
from meshjobs import limits
from meshjobs.blobxfer import (
    Action,
    CopyDone,
    Found,
    Keep,
    KeepBatch,
    PeerMissing,
    Send,
    SendFrames,
    SpoolWrite,
    Tally,
    Transfer,
    Unspool,
    XferError,
    body_bytes,
    check_copy,
)
from meshjobs.frames import FrameType

# The thread wakes this often while a send waits for room in the links' queue.
_TICK_S = 0.01
# And this often when idle, to remove stale assemblies and forgotten copies.
_IDLE_S = 0.25
# Frames and requests taken from the inbox in one turn, so sends keep moving under load.
_TURN_ITEMS = 64
# A window is handed to the links only when at most this many frames wait in the peer's queue.
_ROOM_FRAMES = 2
_SPOOL_SUFFIX = ".part"


def _mono_ms() -> float:
    return time.monotonic() * 1000.0


@dataclass
class _Fetch:
    """A fetch shared by every thread waiting for one digest."""

    asked: set[str] = field(default_factory=set)
    missing: set[str] = field(default_factory=set)
    asking_done: bool = False
    result: bool | None = None
    waiters: int = 0
    done: threading.Event = field(default_factory=threading.Event)
    since_ms: float = 0.0  # when a prefetch (nobody waiting) was asked; 0 for a blocking fetch


class _LockedTally(Tally):
    """The protocol's counters, kept under the mover's lock (`stats` reads them elsewhere)."""

    def __init__(self, lock: threading.Lock, counters: dict[str, int],
                 dropped: dict[str, int]) -> None:
        self._lock = lock
        self.counters = counters
        self.dropped = dropped

    def count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counters[name] = self.counters.get(name, 0) + n

    def drop(self, reason: str, n: int = 1) -> None:
        with self._lock:
            self.dropped[reason] = self.dropped.get(reason, 0) + n


def _unreadable(chunks: Iterable[bytes]) -> Iterator[bytes]:
    """The store's chunks, with its read errors as the protocol's."""
    try:
        yield from chunks
    except BlobError as e:
        raise XferError(str(e)) from e


class _StoreSource:
    """The protocol's view of the store: reads only, store errors as XferError."""

    def __init__(self, mover: BlobMover) -> None:
        self._m = mover

    def has(self, d: str) -> bool:
        return self._m.blobs.has(d)

    def size(self, d: str) -> int | None:
        try:
            return self._m.blobs.size(d)
        except BlobError as e:
            raise XferError(str(e)) from e

    def read(self, d: str) -> bytes | None:
        try:
            chunks = self._m.blobs.open(d)
            return None if chunks is None else b"".join(chunks)
        except BlobError as e:
            raise XferError(str(e)) from e

    def open(self, d: str) -> Iterable[bytes] | None:
        try:
            chunks = self._m.blobs.open(d)
        except BlobError as e:
            raise XferError(str(e)) from e
        return None if chunks is None else _unreadable(chunks)

    def wanted(self, d: str) -> bool:
        with self._m._lock:
            return d in self._m._fetches


class BlobMover:
    """Copies and fetches blobs between members. See the module's rules."""

    def __init__(self, member: str, blobs: Any, links: Any, spool_dir: str,
                 on_copied: Callable[[str, tuple[str, ...]], None], log: Any = None,
                 clock_ms: Callable[[], float] = _mono_ms) -> None:
        self.member = member
        self.blobs = blobs
        self.links = links
        self.spool_dir = spool_dir
        self._on_copied = on_copied
        self._log = log if log is not None else structlog.get_logger(__name__)
        self._clock_ms = clock_ms
        os.makedirs(spool_dir, mode=0o700, exist_ok=True)
        # Spool files left by an earlier run belong to assemblies that died with it.
        for name in os.listdir(spool_dir):
            if name.endswith(_SPOOL_SUFFIX):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(spool_dir, name))

        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._inbox: deque[tuple[Any, ...]] = deque()
        self._inbox_bytes = 0
        self._fetches: dict[str, _Fetch] = {}
        self._stopping = False
        self._started = False
        self._counters: dict[str, int] = {
            "copies_asked": 0, "copies_completed": 0, "chunks_sent": 0, "chunks_received": 0,
            "blobs_sent": 0, "blobs_received": 0, "acks_sent": 0, "acks_received": 0,
            "fetches": 0, "fetches_found": 0, "fetches_failed": 0, "gets_served": 0,
            "gets_missing": 0,
        }
        self._dropped: dict[str, int] = {}

        # The mover thread's own state: the protocol, and the open spools by assembly
        # (path, fd, bytes written).
        self._tally = _LockedTally(self._lock, self._counters, self._dropped)
        self._xfer = Transfer(_StoreSource(self), tally=self._tally, log=self._log)
        self._spools: dict[tuple[str, str], tuple[str, int, int]] = {}
        self._spool_seq = 0
        self._next_expire_ms = 0.0

    # --- the API for other threads -------------------------------------------------------------

    def copy(self, to: str, owner: str, digests: tuple[str, ...]) -> None:
        """Copy blobs held here to `to`, pinned there for `owner`; `on_copied(to, digests)` is
        called once `to` acknowledged every one of them. Never blocks; a request that does not
        fit in the inbox is dropped (the job node asks again)."""
        digests = check_copy(self.member, to, owner, digests)
        with self._cond:
            self._counters["copies_asked"] += 1
            if self._stopping or len(self._inbox) >= limits.blob_mover_queue_max:
                self._drop_locked("queue_full")
                return
            self._inbox.append(("copy", to, owner, digests))
            self._cond.notify()

    def frame(self, peer: str, ftype: FrameType, body: dict) -> None:
        """An F_BLOB_PUT or F_BLOB_GET from `peer` (the links' thread): queued for the mover
        thread, or dropped and counted when the inbox is full."""
        if ftype not in (FrameType.F_BLOB_PUT, FrameType.F_BLOB_GET):
            raise ValueError(f"the blob mover takes blob frames only, not {ftype!r}")
        size = body_bytes(body)
        with self._cond:
            if self._stopping:
                self._drop_locked("stopped")
                return
            if (len(self._inbox) >= limits.blob_mover_queue_max
                    or self._inbox_bytes + size > limits.blob_mover_queue_bytes_max):
                self._drop_locked("queue_full")
                return
            self._inbox.append(("frame", peer, ftype, body, size))
            self._inbox_bytes += size
            self._cond.notify()

    def fetch(self, digest: str, timeout_s: float) -> bool:
        """Block until `digest` is in the local store (True), or until every linked peer said it
        does not hold it, or `timeout_s` (at most `blob_fetch_s_max`) passed (False). Concurrent
        fetches of one digest share one transfer."""
        if not is_digest(digest):
            raise ValueError(f"not a blob digest: {digest!r:.80}")
        if self.blobs.has(digest):
            return True
        timeout_s = max(0.0, min(float(timeout_s), float(limits.blob_fetch_s_max)))
        with self._cond:
            if self._stopping:
                return False
            f = self._fetches.get(digest)
            first = f is None
            if f is None:
                if len(self._fetches) >= limits.blob_mover_queue_max:
                    self._drop_locked("fetches_full")
                    return False
                f = self._fetches[digest] = _Fetch()
                self._counters["fetches"] += 1
            f.waiters += 1
        try:
            if first:
                self._ask(digest, f)
            f.done.wait(timeout_s)
        finally:
            with self._cond:
                f.waiters -= 1
                if f.result is None and f.waiters == 0 and self._fetches.get(digest) is f:
                    # Nobody waits any more; chunks already on their way still complete the
                    # blob, but a transfer not yet begun is no longer wanted.
                    del self._fetches[digest]
                    self._counters["fetches_failed"] += 1
        return f.result is True

    def prefetch(self, digest: str) -> None:
        """Start fetching `digest` without waiting for it (the jobs thread asks for an item's
        stdin this way and starts the item once the blob is here)."""
        if not is_digest(digest):
            raise ValueError(f"not a blob digest: {digest!r:.80}")
        if self.blobs.has(digest):
            return
        with self._cond:
            if self._stopping or digest in self._fetches:
                return
            if len(self._fetches) >= limits.blob_mover_queue_max:
                self._drop_locked("fetches_full")
                return
            f = self._fetches[digest] = _Fetch(since_ms=self._clock_ms())
            self._counters["fetches"] += 1
        self._ask(digest, f)

    def stats(self) -> dict[str, Any]:
        """Counters (copies asked/completed, chunks sent/received, blobs sent/received,
        digests acknowledged (`acks_sent`, `acks_received`), fetches, gets served), `dropped`
        by reason, and the sizes of the queues (`sending`: waiting or being streamed,
        `inflight`: sent and not yet acknowledged)."""
        with self._lock:
            out: dict[str, Any] = dict(self._counters)
            out["dropped"] = dict(self._dropped)
            out["inbox"] = len(self._inbox)
            out["inbox_bytes"] = self._inbox_bytes
            out["fetching"] = len(self._fetches)
        # The mover thread's own state, read without its cooperation: sizes only.
        out.update(self._xfer.sizes())
        return out

    def stop(self) -> None:
        """Make `run` return; waiting fetches answer False. Safe to call more than once."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
            fetches = list(self._fetches.values())
            self._fetches.clear()
            for f in fetches:
                if f.result is None:
                    f.result = False
                f.done.set()

    # --- the mover thread ----------------------------------------------------------------------

    def run(self) -> None:
        """The thread body: returns after `stop()`."""
        with self._cond:
            if self._stopping or self._started:
                return
            self._started = True
        busy = False
        try:
            while True:
                with self._cond:
                    if not self._inbox and not self._stopping:
                        self._cond.wait(_TICK_S if busy else _IDLE_S)
                    if self._stopping:
                        return
                    items = [self._inbox.popleft()
                             for _ in range(min(_TURN_ITEMS, len(self._inbox)))]
                    for item in items:
                        if item[0] == "frame":
                            self._inbox_bytes -= item[4]
                for item in items:
                    if item[0] == "copy":
                        self._do(self._xfer.copy(item[1], item[2], item[3], self._clock_ms()))
                    else:
                        self._do(self._xfer.frame(item[1], item[2] == FrameType.F_BLOB_GET,
                                                  item[3], self._clock_ms()))
                self._do(self._xfer.end_turn())
                actions, busy = self._xfer.pump(self._clock_ms(), self.links.peers, _ROOM_FRAMES)
                self._do(actions)
                now = self._clock_ms()
                if now >= self._next_expire_ms:
                    self._do(self._xfer.tick(now))
                    self._expire_fetches(now)
                    self._next_expire_ms = now + _IDLE_S * 1000
        finally:
            for key in list(self._spools):
                self._unspool(key)

    # --- executing the protocol's actions -------------------------------------------------------

    def _do(self, actions: list[Action]) -> None:
        """Execute `actions` in order, and what the protocol answers to their outcomes."""
        todo = deque(actions)
        while todo:
            a = todo.popleft()
            more: list[Action] = []
            if isinstance(a, SendFrames):
                taken = self.links.send_batch(
                    a.to, [(FrameType.F_BLOB_PUT, body) for body in a.bodies], table=True)
                more = self._xfer.taken(a.ticket, taken, self._clock_ms())
            elif isinstance(a, Send):
                if self.links.send(a.to, FrameType.F_BLOB_PUT, a.body, table=True) and a.counts:
                    self._tally.count(*a.counts)
            elif isinstance(a, SpoolWrite):
                more = self._spool_write(a)
            elif isinstance(a, Unspool):
                self._unspool(a.key)
            elif isinstance(a, Keep):
                more = self._keep(a)
            elif isinstance(a, KeepBatch):
                more = self._xfer.batch_kept(a.ticket, self._keep_batch(a))
            elif isinstance(a, CopyDone):
                self._log.debug("blobs_copied", to=a.to, owner=a.owner, blobs=len(a.digests))
                self._on_copied(a.to, a.digests)
            elif isinstance(a, Found):
                with self._lock:
                    self._resolve_locked(a.d, True)
            elif isinstance(a, PeerMissing):
                self._on_missing(a.peer, a.d)
            else:
                raise AssertionError(f"an action the mover does not know: {a!r:.200}")
            todo.extendleft(reversed(more))

    def _spool_write(self, a: SpoolWrite) -> list[Action]:
        """Append a chunk to its assembly's spool, opened at its first chunk."""
        spool = self._spools.get(a.key)
        try:
            if spool is None:
                assert a.off == 0, f"a spool of {a.d} opened at offset {a.off}"
                self._spool_seq += 1
                path = os.path.join(self.spool_dir,
                                    f"{self._spool_seq}-{a.d}{_SPOOL_SUFFIX}")
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                spool = self._spools[a.key] = (path, fd, 0)
            path, fd, written = spool
            assert a.off == written, f"a chunk of {a.d} at {a.off}, its spool holds {written}"
            view = memoryview(a.data)
            while view:
                n = os.write(fd, view)
                view = view[n:]
            self._spools[a.key] = (path, fd, written + len(a.data))
        except OSError as e:
            self._log.error("blob_spool_failed", digest=a.d, peer=a.key[0], error=str(e))
            self._unspool(a.key)
            return self._xfer.spool_failed(a.key)
        return []

    def _unspool(self, key: tuple[str, str]) -> None:
        """Close and remove an assembly's spool, if it has one (its fd is -1 once closed)."""
        spool = self._spools.pop(key, None)
        if spool is None:
            return
        path, fd, _ = spool
        if fd >= 0:
            os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)

    def _keep(self, a: Keep) -> list[Action]:
        """Store a received blob from its spool (when spooled), pin it, look it up."""
        got: str | Exception | None = None
        if a.spooled:
            spool = self._spools.get(a.key)
            if spool is None:
                return []  # its spool failed: the protocol dropped the assembly already
            path, fd, _ = spool
            os.close(fd)
            self._spools[a.key] = (path, -1, 0)
            try:
                got = self.blobs.put_file(path)
            except (OSError, BlobError) as e:
                got = e
            if got != a.d:
                self._unspool(a.key)
                return self._xfer.kept(a, got, None)
        self._unspool(a.key)
        held: bool | Exception
        try:
            if a.owner is not None:
                self.blobs.pin(a.d, a.owner)
            held = self.blobs.has(a.d)
        except (OSError, BlobError) as e:
            held = e
        return self._xfer.kept(a, got, held)

    def _keep_batch(self, a: KeepBatch) -> list[str | Exception] | None:
        """Keep the staged blobs durably, pinned for their owners, in one transaction and one
        fsync. A store without `write_batch` keeps them one `put` (and `pin`) at a time."""
        write_batch = getattr(self.blobs, "write_batch", None)
        try:
            if write_batch is not None:
                got = write_batch([b.data for b in a.blobs], [b.owner for b in a.blobs])
                self.blobs.sync()
            else:
                got = [self._put_one(b.d, b.data, b.owner) for b in a.blobs]
        except (OSError, BlobError) as e:
            self._log.error("blob_store_failed", blobs=len(a.blobs), error=str(e))
            return None
        return list(got)

    def _put_one(self, d: str, data: bytes, owner: str | None) -> str | Exception:
        """One blob kept by a store without batches: durable and pinned when it returns."""
        try:
            got = self.blobs.put(data)
            if owner is not None and got == d:
                self.blobs.pin(d, owner)
        except (OSError, BlobError) as e:
            return e
        return got

    def _on_missing(self, peer: str, d: str) -> None:
        with self._lock:
            f = self._fetches.get(d)
            if f is None:
                return
            f.missing.add(peer)
            if f.asking_done and f.asked <= f.missing:
                self._resolve_locked(d, False)

    # --- fetches -------------------------------------------------------------------------------

    def _ask(self, digest: str, f: _Fetch) -> None:
        """Ask every linked peer for `digest` (on the fetching thread)."""
        up = [name for name, info in self.links.peers().items() if info["up"]]
        asked = {name for name in up
                 if self.links.send(name, FrameType.F_BLOB_GET, {"d": digest})}
        with self._lock:
            f.asked = asked
            f.asking_done = True
            if f.result is None and f.asked <= f.missing:
                self._resolve_locked(digest, False)
        # The blob may have arrived between the first look and the fetch being listed.
        if f.result is None and self.blobs.has(digest):
            with self._lock:
                self._resolve_locked(digest, True)

    def _resolve_locked(self, digest: str, found: bool) -> None:
        f = self._fetches.pop(digest, None)
        if f is None or f.result is not None:
            return
        f.result = found
        self._counters["fetches_found" if found else "fetches_failed"] += 1
        f.done.set()

    # --- housekeeping --------------------------------------------------------------------------

    def _expire_fetches(self, now: float) -> None:
        with self._lock:
            for digest, f in list(self._fetches.items()):
                if (f.since_ms and f.waiters == 0 and f.result is None
                        and now - f.since_ms > limits.blob_fetch_s_max * 1000):
                    self._resolve_locked(digest, False)

    def _drop_locked(self, reason: str, n: int = 1) -> None:
        self._dropped[reason] = self._dropped.get(reason, 0) + n
