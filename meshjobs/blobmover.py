"""The blob mover: copies blobs to other members and fetches blobs from them, over the links.

A result's output blobs must be durable on `blob_copies` members before the result is proposed,
and any member must serve any committed blob. The mover does both with two frame types:

- F_BLOB_PUT carries one chunk of one blob, `{"d", "o", "size", "off", "data", "last"}` (plus
  `"get": True` when it answers a fetch), an acknowledgement `{"ack": [d], "o"}`, or a holder's
  `{"d", "missing": True}`.
- F_BLOB_GET `{"d"}` asks every linked peer for a blob; a holder answers with its chunks.

One thread (`run`) does all the work. Other threads only call `copy`, `frame` (the links'
thread), `fetch` (HTTP threads), `stats` and `stop`: they take one short lock and, except
`fetch`, which waits for its answer, never block.

Rules:
- Every queue is bounded: the inbox by frames and by chunk bytes, the blobs waiting to be sent,
  the blobs being received (`blob_assemblies_max`, each at most `blob_assembly_bytes_max`), the
  fetches and the copies waiting for their acknowledgement. What does not fit is dropped and
  counted: nothing correct depends on a frame arriving, and the job node asks again.
- A blob is sent in windows of `blob_window_frames` chunks, each window only once the links'
  queue to that peer has nearly drained, and one blob at a time per peer: the next one starts
  when the receiver acknowledged the last (or after `blob_ack_wait_ms`). The sender never holds
  a whole blob in memory, and the receiver's inbox absorbs at most about one blob's tail.
- A received blob is written chunk by chunk to a spool file, hashed while it arrives, and put
  into the store only when its bytes hash to its digest; the digest the store returns is checked
  again (paired checks). It is acknowledged only once it is durable (and pinned for its owner).
- Garbage from a peer (wrong types, offsets that do not follow, a size over the limit, bytes
  that do not hash to their digest) drops that blob's assembly and is counted by reason in
  `stats()["dropped"]`; it never raises. A mistake of the caller's own (a bad digest or owner
  passed to `copy` or `fetch`) raises ValueError.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from itertools import islice
from typing import Any

import blake3
import structlog

from blobstore import BlobError, is_digest
from blobstore.limits import owner_bytes_max
from meshjobs import limits
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


def _owner_ok(owner: object) -> bool:
    """True for no owner, or a name the store accepts as a pin owner."""
    if owner is None:
        return True
    if not isinstance(owner, str) or not owner or "\x00" in owner:
        return False
    try:
        return len(owner.encode("utf-8")) <= owner_bytes_max
    except UnicodeEncodeError:
        return False


def _pieces(chunks: Iterable[bytes], size: int) -> Iterator[bytes]:
    """The bytes of `chunks` cut into pieces of `size` (the last may be shorter)."""
    buf = bytearray()
    for chunk in chunks:
        if not buf and len(chunk) == size:
            yield bytes(chunk)
            continue
        buf += chunk
        while len(buf) >= size:
            yield bytes(buf[:size])
            del buf[:size]
    if buf:
        yield bytes(buf)


class _Out:
    """One blob being sent to one peer; touched only by the mover thread."""

    __slots__ = ("to", "d", "owner", "get", "size", "off", "pieces")

    def __init__(self, to: str, d: str, owner: str | None, get: bool) -> None:
        self.to = to
        self.d = d
        self.owner = owner
        self.get = get
        self.size = 0
        self.off = 0
        self.pieces: Iterator[bytes] | None = None

    @property
    def key(self) -> tuple[str, str, str | None, bool]:
        return (self.to, self.d, self.owner, self.get)


class _Assembly:
    """One blob being received from one peer; touched only by the mover thread."""

    __slots__ = ("peer", "d", "owner", "get", "size", "off", "path", "fd", "hasher", "skip",
                 "last_ms")

    def __init__(self, peer: str, d: str, owner: str | None, get: bool, size: int,
                 now: float) -> None:
        self.peer = peer
        self.d = d
        self.owner = owner
        self.get = get
        self.size = size
        self.off = 0
        self.path: str | None = None
        self.fd: int | None = None
        self.hasher = blake3.blake3()
        self.skip = False  # the store already holds the blob: the data is not kept
        self.last_ms = now


@dataclass
class _Copy:
    """A copy request waiting for the peer's acknowledgement of every digest."""

    to: str
    owner: str
    digests: tuple[str, ...]
    remaining: set[str]
    since_ms: float


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
        os.makedirs(spool_dir, exist_ok=True)
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

        # The mover thread's own state.
        self._copies: dict[tuple[str, str, tuple[str, ...]], _Copy] = {}
        self._outq: dict[str, deque[_Out]] = {}
        self._out_keys: set[tuple[str, str, str | None, bool]] = set()
        self._active: dict[str, _Out] = {}
        self._inflight: dict[str, tuple[str, float]] = {}  # peer -> (digest, sent at)
        self._asm: dict[tuple[str, str], _Assembly] = {}
        self._spool_seq = 0
        self._next_expire_ms = 0.0

    # --- the API for other threads -------------------------------------------------------------

    def copy(self, to: str, owner: str, digests: tuple[str, ...]) -> None:
        """Copy blobs held here to `to`, pinned there for `owner`; `on_copied(to, digests)` is
        called once `to` acknowledged every one of them. Never blocks; a request that does not
        fit in the inbox is dropped (the job node asks again)."""
        if to == self.member:
            raise ValueError("a member does not copy blobs to itself")
        if not isinstance(owner, str) or not owner or not _owner_ok(owner):
            raise ValueError(f"a copy's owner is a pin owner name, not {owner!r:.80}")
        digests = tuple(digests)
        for d in digests:
            if not is_digest(d):
                raise ValueError(f"not a blob digest: {d!r:.80}")
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
        data = body.get("data") if isinstance(body, dict) else None
        size = len(data) if isinstance(data, bytes | bytearray) else 0
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
        """Counters (copies asked/completed, chunks sent/received, acks, fetches, gets served),
        `dropped` by reason, and the sizes of the queues."""
        with self._lock:
            out: dict[str, Any] = dict(self._counters)
            out["dropped"] = dict(self._dropped)
            out["inbox"] = len(self._inbox)
            out["inbox_bytes"] = self._inbox_bytes
            out["fetching"] = len(self._fetches)
        # The mover thread's own state, read without its cooperation: sizes only.
        out["assemblies"] = len(self._asm)
        out["sending"] = len(self._active) + sum(len(q) for q in list(self._outq.values()))
        out["copies_waiting"] = len(self._copies)
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
                        self._on_copy(item[1], item[2], item[3])
                    else:
                        self._on_frame(item[1], item[2], item[3])
                busy = self._pump()
                now = self._clock_ms()
                if now >= self._next_expire_ms:
                    self._expire(now)
                    self._next_expire_ms = now + _IDLE_S * 1000
        finally:
            for key in list(self._asm):
                self._close_asm(key)

    # --- copies out ----------------------------------------------------------------------------

    def _on_copy(self, to: str, owner: str, digests: tuple[str, ...]) -> None:
        key = (to, owner, digests)
        now = self._clock_ms()
        c = self._copies.get(key)
        if c is None:
            if len(self._copies) >= limits.blob_mover_queue_max:
                # Forget the oldest copy: its node asks again if it still needs it.
                oldest = min(self._copies, key=lambda k: self._copies[k].since_ms)
                del self._copies[oldest]
                self._drop("copies_full")
            c = self._copies[key] = _Copy(to, owner, digests, set(digests), now)
            if not digests:
                self._complete(key)
                return
        c.since_ms = now
        for d in c.remaining:
            self._queue_out(_Out(to, d, owner, get=False))

    def _queue_out(self, out: _Out) -> None:
        if out.key in self._out_keys:
            return  # already waiting or being sent
        pending = len(self._active) + sum(len(q) for q in self._outq.values())
        if pending >= limits.blob_mover_queue_max:
            self._drop("sends_full")
            return
        self._outq.setdefault(out.to, deque()).append(out)
        self._out_keys.add(out.key)

    def _pump(self) -> bool:
        """Hand the next window of every blob being sent to the links; True while some send
        waits for room or for an acknowledgement."""
        busy = False
        peers: dict[str, dict[str, Any]] | None = None
        now = self._clock_ms()
        for to in list(set(self._outq) | set(self._active)):
            out = self._active.get(to)
            if out is None:
                inflight = self._inflight.get(to)
                if inflight is not None and now - inflight[1] < limits.blob_ack_wait_ms:
                    busy = True
                    continue
                self._inflight.pop(to, None)
                q = self._outq.get(to)
                if not q:
                    self._outq.pop(to, None)
                    continue
                out = q.popleft()
                if not self._start_out(out):
                    self._out_keys.discard(out.key)
                    busy = True
                    continue
                self._active[to] = out
            if peers is None:
                peers = self.links.peers()
            info = peers.get(to)
            if info is None or not info["up"]:
                self._abort_peer(to)
                continue
            busy = True
            if info["queued"] + info["waiting"] > _ROOM_FRAMES:
                continue
            self._send_window(out)
        return busy

    def _start_out(self, out: _Out) -> bool:
        """Open the blob to send; False (after saying so) when this member does not hold it."""
        try:
            size = self.blobs.size(out.d)
            chunks = self.blobs.open(out.d) if size is not None else None
        except BlobError as e:
            self._log.error("blob_send_unreadable", digest=out.d, to=out.to, error=str(e))
            chunks = None
            size = None
        if chunks is None or size is None:
            self._log.warning("blob_send_not_here", digest=out.d, to=out.to, get=out.get)
            self._drop("not_here")
            if out.get:
                self._send_missing(out.to, out.d)
            return False
        out.size = size
        out.pieces = _pieces(chunks, limits.blob_frame_bytes)
        return True

    def _send_window(self, out: _Out) -> None:
        assert out.pieces is not None
        frames: list[tuple[FrameType, dict[str, Any]]] = []
        try:
            for piece in islice(out.pieces, limits.blob_window_frames):
                end = out.off + len(piece)
                if end > out.size:
                    raise BlobError(f"blob {out.d} holds more than its {out.size} bytes")
                frames.append((FrameType.F_BLOB_PUT, self._chunk_body(out, piece, end)))
                out.off = end
        except BlobError as e:
            self._log.error("blob_send_failed", digest=out.d, to=out.to, error=str(e))
            self._drop("read_failed")
            self._end_out(out)
            return
        if out.size == 0 and out.off == 0 and not frames:
            frames.append((FrameType.F_BLOB_PUT, self._chunk_body(out, b"", 0)))
        if not frames:
            # The store's chunks ended before the blob's size: it changed under us.
            self._log.error("blob_send_short", digest=out.d, to=out.to, sent=out.off,
                            size=out.size)
            self._drop("read_failed")
            self._end_out(out)
            return
        taken = self.links.send_batch(out.to, frames, table=True)
        with self._lock:
            self._counters["chunks_sent"] += taken
        if taken < len(frames):
            # The rest of this blob would not follow on; the node asks again later.
            self._drop("send_dropped")
            self._end_out(out)
            return
        if frames[-1][1]["last"]:
            with self._lock:
                self._counters["blobs_sent"] += 1
                if out.get:
                    self._counters["gets_served"] += 1
            self._inflight[out.to] = (out.d, self._clock_ms())
            self._end_out(out)

    def _chunk_body(self, out: _Out, piece: bytes, end: int) -> dict[str, Any]:
        body: dict[str, Any] = {"d": out.d, "o": out.owner, "size": out.size,
                                "off": end - len(piece), "data": piece, "last": end == out.size}
        if out.get:
            body["get"] = True
        return body

    def _end_out(self, out: _Out) -> None:
        if self._active.get(out.to) is out:
            del self._active[out.to]
        self._out_keys.discard(out.key)
        out.pieces = None

    def _abort_peer(self, to: str) -> None:
        """`to` is not linked: what was to be sent to it is dropped."""
        n = 0
        out = self._active.pop(to, None)
        if out is not None:
            self._out_keys.discard(out.key)
            n += 1
        for queued in self._outq.pop(to, deque()):
            self._out_keys.discard(queued.key)
            n += 1
        self._inflight.pop(to, None)
        if n:
            self._drop("peer_down", n)

    def _send_missing(self, to: str, d: str) -> None:
        with self._lock:
            self._counters["gets_missing"] += 1
        self.links.send(to, FrameType.F_BLOB_PUT, {"d": d, "missing": True}, table=True)

    def _complete(self, key: tuple[str, str, tuple[str, ...]]) -> None:
        c = self._copies.pop(key)
        with self._lock:
            self._counters["copies_completed"] += 1
        self._log.debug("blobs_copied", to=c.to, owner=c.owner, blobs=len(c.digests))
        self._on_copied(c.to, c.digests)

    # --- frames in -----------------------------------------------------------------------------

    def _on_frame(self, peer: str, ftype: FrameType, body: Any) -> None:
        if not isinstance(body, dict):
            self._drop("bad_body")
        elif ftype == FrameType.F_BLOB_GET:
            self._on_get(peer, body)
        elif "ack" in body:
            self._on_ack(peer, body)
        elif body.get("missing") is True:
            self._on_missing(peer, body)
        else:
            self._on_chunk(peer, body)

    def _on_get(self, peer: str, body: dict) -> None:
        d = body.get("d")
        if not is_digest(d):
            self._drop("bad_get")
            return
        if self.blobs.has(d):
            self._queue_out(_Out(peer, d, None, get=True))
        else:
            self._send_missing(peer, d)

    def _on_ack(self, peer: str, body: dict) -> None:
        acked, owner = body.get("ack"), body.get("o")
        if (not isinstance(acked, list) or not all(is_digest(d) for d in acked)
                or not _owner_ok(owner)):
            self._drop("bad_ack")
            return
        with self._lock:
            self._counters["acks_received"] += 1
        inflight = self._inflight.get(peer)
        if inflight is not None and inflight[0] in acked:
            del self._inflight[peer]
        done = set(acked)
        q = self._outq.get(peer)
        if q:
            # A copy asked again while its blob was on the way need not be sent twice.
            for out in [o for o in q if o.d in done and o.owner == owner and not o.get]:
                q.remove(out)
                self._out_keys.discard(out.key)
        if owner is None:
            return
        for key, c in list(self._copies.items()):
            if c.to == peer and c.owner == owner and c.remaining & done:
                c.remaining -= done
                if not c.remaining:
                    self._complete(key)

    def _on_missing(self, peer: str, body: dict) -> None:
        d = body.get("d")
        if not is_digest(d):
            self._drop("bad_body")
            return
        with self._lock:
            f = self._fetches.get(d)
            if f is None:
                return
            f.missing.add(peer)
            if f.asking_done and f.asked <= f.missing:
                self._resolve_locked(d, False)

    def _on_chunk(self, peer: str, b: dict) -> None:
        d, size, off, data, last = (b.get(k) for k in ("d", "size", "off", "data", "last"))
        owner, get = b.get("o"), b.get("get", False)
        if not is_digest(d):
            self._drop("bad_body")
            return
        key = (peer, d)
        if not (type(size) is int and type(off) is int and isinstance(data, bytes)
                and type(last) is bool and type(get) is bool and _owner_ok(owner)):
            self._garbage(key, "bad_body")
            return
        if size > limits.blob_assembly_bytes_max:
            self._garbage(key, "too_large")
            return
        end = off + len(data)
        if (size < 0 or off < 0 or len(data) > limits.blob_frame_bytes or end > size
                or last != (end == size) or (not last and not data)):
            self._garbage(key, "bad_offset")
            return
        now = self._clock_ms()
        asm = self._asm.get(key)
        if off == 0:
            if asm is not None:
                # A new transfer of the same blob: the earlier one was cut short.
                self._close_asm(key)
            skip = self.blobs.has(d)
            if get and not skip:
                with self._lock:
                    wanted = d in self._fetches
                if not wanted:
                    # Nobody waits for it any more (the fetch timed out).
                    self._drop("unasked")
                    return
            if len(self._asm) >= limits.blob_assemblies_max:
                self._drop("assemblies_full")
                return
            asm = self._asm[key] = _Assembly(peer, d, owner, get, size, now)
            # A blob already held is acknowledged at its last chunk without keeping its bytes.
            asm.skip = skip
            if not skip and not self._open_spool(asm):
                return
        elif (asm is None or asm.off != off or asm.size != size or asm.owner != owner
              or asm.get != get):
            self._garbage(key, "out_of_order")
            return
        with self._lock:
            self._counters["chunks_received"] += 1
        asm.last_ms = now
        if not asm.skip:
            assert asm.fd is not None
            try:
                view = memoryview(data)
                while view:
                    n = os.write(asm.fd, view)
                    view = view[n:]
            except OSError as e:
                self._log.error("blob_spool_failed", digest=d, peer=peer, error=str(e))
                self._garbage(key, "spool_failed")
                return
            asm.hasher.update(data)
        asm.off = end
        if last:
            self._finish(key, asm)

    def _open_spool(self, asm: _Assembly) -> bool:
        self._spool_seq += 1
        path = os.path.join(self.spool_dir, f"{self._spool_seq}-{asm.d}{_SPOOL_SUFFIX}")
        try:
            asm.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        except OSError as e:
            self._log.error("blob_spool_failed", digest=asm.d, peer=asm.peer, error=str(e))
            self._garbage((asm.peer, asm.d), "spool_failed")
            return False
        asm.path = path
        return True

    def _finish(self, key: tuple[str, str], asm: _Assembly) -> None:
        """The last chunk arrived: keep the blob durably, pin it, acknowledge it."""
        d = asm.d
        if not asm.skip:
            assert asm.fd is not None and asm.path is not None
            os.close(asm.fd)
            asm.fd = None
            if asm.hasher.hexdigest() != d:
                self._log.warning("blob_digest_mismatch", digest=d, peer=asm.peer)
                self._garbage(key, "digest_mismatch")
                return
            try:
                got = self.blobs.put_file(asm.path)
            except (OSError, BlobError) as e:
                self._log.error("blob_store_failed", digest=d, peer=asm.peer, error=str(e))
                self._garbage(key, "store_failed")
                return
            if got != d:
                # The spool file changed after it was hashed: its bytes are not the blob.
                self._log.error("blob_digest_mismatch", digest=d, stored=got, peer=asm.peer)
                self._garbage(key, "digest_mismatch")
                return
            with self._lock:
                self._counters["blobs_received"] += 1
        self._close_asm(key)
        try:
            if asm.owner is not None:
                self.blobs.pin(d, asm.owner)
            held = self.blobs.has(d)
        except (OSError, BlobError) as e:
            self._log.error("blob_store_failed", digest=d, peer=asm.peer, error=str(e))
            self._drop("store_failed")
            return
        if not held:
            # It was collected between its first chunk and its pin; the sender asks again.
            self._drop("gone")
            return
        # Other transfers of the same blob need not keep their bytes any more.
        for other in list(self._asm.values()):
            if other.d == d and not other.skip:
                self._unspool(other)
                other.skip = True
        if self.links.send(asm.peer, FrameType.F_BLOB_PUT, {"ack": [d], "o": asm.owner},
                           table=True):
            with self._lock:
                self._counters["acks_sent"] += 1
        with self._lock:
            self._resolve_locked(d, True)

    def _garbage(self, key: tuple[str, str], reason: str) -> None:
        """Remote garbage or a failed assembly: drop the blob's assembly and count why."""
        self._close_asm(key)
        self._drop(reason)

    def _close_asm(self, key: tuple[str, str]) -> None:
        asm = self._asm.pop(key, None)
        if asm is not None:
            self._unspool(asm)

    def _unspool(self, asm: _Assembly) -> None:
        if asm.fd is not None:
            os.close(asm.fd)
            asm.fd = None
        if asm.path is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(asm.path)
            asm.path = None

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

    def _expire(self, now: float) -> None:
        for key, asm in list(self._asm.items()):
            if now - asm.last_ms > limits.blob_assembly_idle_ms:
                self._log.info("blob_assembly_stale", digest=asm.d, peer=asm.peer,
                               received=asm.off, size=asm.size)
                self._garbage(key, "stale")
        for key, c in list(self._copies.items()):
            if now - c.since_ms > limits.blob_copy_wait_ms:
                del self._copies[key]
                self._drop("copy_expired")
        with self._lock:
            for digest, f in list(self._fetches.items()):
                if (f.since_ms and f.waiters == 0 and f.result is None
                        and now - f.since_ms > limits.blob_fetch_s_max * 1000):
                    self._resolve_locked(digest, False)

    def _drop(self, reason: str, n: int = 1) -> None:
        with self._lock:
            self._drop_locked(reason, n)

    def _drop_locked(self, reason: str, n: int = 1) -> None:
        self._dropped[reason] = self._dropped.get(reason, 0) + n
