"""The blob mover: copies blobs to other members and fetches blobs from them, over the links.

A result's output blobs must be durable on `blob_copies` members before the result is proposed,
and any member must serve any committed blob. The mover does both with two frame types:

- F_BLOB_PUT carries one chunk of one blob, `{"d", "o", "size", "off", "data", "last"}` (plus
  `"get": True` when it answers a fetch); a pack of whole blobs of one chunk each,
  `{"blobs": [[d, o, data], ...]}` (at most `blob_frame_bytes` of data); an acknowledgement of
  one or many blobs, `{"ack": [d, ...], "o"}`; or a holder's `{"d", "missing": True}`.
- F_BLOB_GET `{"d"}` asks every linked peer for a blob; a holder answers with its chunks.

One thread (`run`) does all the work. Other threads only call `copy`, `frame` (the links'
thread), `fetch` (HTTP threads), `stats` and `stop`: they take one short lock and, except
`fetch`, which waits for its answer, never block.

Rules:
- Every queue is bounded: the inbox by frames and by chunk bytes, the blobs waiting to be sent
  (`blob_send_queue_max`), the blobs sent and not yet acknowledged (`blob_inflight_max` and
  `blob_inflight_bytes_max` per peer), the blobs being received (`blob_assemblies_max`, each at
  most `blob_assembly_bytes_max`), the fetches and the copies waiting for their
  acknowledgement. What does not fit is dropped and counted: nothing correct depends on a frame
  arriving, and the job node asks again.
- Many blobs are on their way to a peer at once: up to `blob_inflight_max` of them, and
  `blob_inflight_bytes_max` bytes (a larger blob goes alone), each until its acknowledgement or
  for `blob_ack_wait_ms`. A blob of one chunk is read only when its frame is built, and packed
  with others into one frame; a larger blob is streamed in windows of `blob_window_frames`
  chunks, one such blob at a time per peer. A window is handed to the links only once their
  queue to that peer has nearly drained. The sender never holds a whole large blob in memory,
  and a blob asked again while waiting, being sent or unacknowledged is not sent twice.
- A received blob of one chunk is checked against its digest and kept with the others of the
  same turn of the mover thread: one `write_batch` (pins included) and one `sync` store them
  all, and the digests the store returns are checked again (paired checks). A larger blob is
  written chunk by chunk to a spool file, hashed while it arrives, and put into the store only
  when its bytes hash to its digest; the digest the store returns is checked again. A blob is
  acknowledged only once it is durable (and pinned for its owner); acknowledgements of one turn
  go together, one frame per peer and owner.
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
from blobstore.limits import batch_blobs_max, batch_bytes_max, owner_bytes_max
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
# Digests in one acknowledgement frame (about 70 bytes each, far below `frame_bytes_max`).
_ACK_DIGESTS = 4096

_OutKey = tuple[str, str, str | None, bool]  # peer, digest, owner, answers a fetch


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


def _body_bytes(body: object) -> int:
    """The blob bytes a frame's body carries, as the inbox counts them."""
    if not isinstance(body, dict):
        return 0
    data = body.get("data")
    if isinstance(data, bytes | bytearray):
        return len(data)
    pack = body.get("blobs")
    if isinstance(pack, list):
        return sum(len(e[2]) for e in pack
                   if isinstance(e, list | tuple) and len(e) == 3
                   and isinstance(e[2], bytes | bytearray))
    return 0


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
    """One blob to send to one peer; touched only by the mover thread."""

    __slots__ = ("key", "to", "d", "owner", "get", "size", "off", "pieces")

    def __init__(self, to: str, d: str, owner: str | None, get: bool) -> None:
        self.key: _OutKey = (to, d, owner, get)
        self.to = to
        self.d = d
        self.owner = owner
        self.get = get
        self.size = -1  # not looked up yet
        self.off = 0
        self.pieces: Iterator[bytes] | None = None


class _PeerSend:
    """What is to be sent to one peer: the blobs waiting (oldest first), the larger blob being
    streamed, and the blobs sent and not yet acknowledged, each with when it was sent and its
    size. `inflight_bytes` counts those and the streamed blob. A waiting blob whose key no
    longer maps to it in the mover's `_out_live` was cancelled and is skipped."""

    __slots__ = ("queue", "active", "inflight", "inflight_bytes")

    def __init__(self) -> None:
        self.queue: deque[_Out] = deque()
        self.active: _Out | None = None
        self.inflight: dict[_OutKey, tuple[float, int]] = {}
        self.inflight_bytes = 0


class _Stored:
    """A received blob of one chunk waiting for the end of the turn to be stored."""

    __slots__ = ("peer", "d", "owner", "get", "data", "held")

    def __init__(self, peer: str, d: str, owner: str | None, get: bool, data: bytes,
                 held: bool) -> None:
        self.peer = peer
        self.d = d
        self.owner = owner
        self.get = get
        self.data = data
        self.held = held  # the store held it already: stored again only to renew and pin it


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
        self._send: dict[str, _PeerSend] = {}
        # Every blob waiting, being sent or unacknowledged, by its key: what is asked again
        # meanwhile is not sent twice.
        self._out_live: dict[_OutKey, _Out] = {}
        self._queued = 0  # entries in the peers' queues, cancelled ones included
        self._batch: list[_Stored] = []  # received blobs of one chunk, stored at the turn's end
        self._batch_keys: set[tuple[str, str, str | None, bool]] = set()
        self._batch_bytes = 0
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
        size = _body_bytes(body)
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
        out["assemblies"] = len(self._asm)
        sends = list(self._send.values())
        out["sending"] = self._queued + sum(1 for ps in sends if ps.active is not None)
        out["inflight"] = sum(len(ps.inflight) for ps in sends)
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
                self._store_batch()
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
        if out.key in self._out_live:
            return  # already waiting, being sent, or sent and not yet acknowledged
        if self._queued >= limits.blob_send_queue_max:
            self._drop("sends_full")
            return
        ps = self._send.get(out.to)
        if ps is None:
            ps = self._send[out.to] = _PeerSend()
        ps.queue.append(out)
        self._queued += 1
        self._out_live[out.key] = out

    def _pump(self) -> bool:
        """Hand the next frames for every peer to the links; True while some send waits for
        room or for an acknowledgement."""
        busy = False
        peers: dict[str, dict[str, Any]] | None = None
        now = self._clock_ms()
        for to, ps in list(self._send.items()):
            self._expire_inflight(ps, now)
            if ps.active is None and not ps.queue:
                if ps.inflight:
                    busy = True
                else:
                    del self._send[to]
                continue
            if peers is None:
                peers = self.links.peers()
            info = peers.get(to)
            if info is None or not info["up"]:
                self._abort_peer(to)
                continue
            busy = True
            if info["queued"] + info["waiting"] > _ROOM_FRAMES:
                continue
            if ps.active is not None:
                self._send_window(ps, ps.active)
            else:
                self._send_next(ps, to)
        return busy

    def _expire_inflight(self, ps: _PeerSend, now: float) -> None:
        """Blobs not acknowledged within `blob_ack_wait_ms` leave the window (oldest first);
        their copies wait until the node asks again."""
        while ps.inflight:
            key, (sent_ms, size) = next(iter(ps.inflight.items()))
            if now - sent_ms < limits.blob_ack_wait_ms:
                return
            del ps.inflight[key]
            ps.inflight_bytes -= size
            self._out_live.pop(key, None)
            self._drop("ack_late")

    def _room(self, ps: _PeerSend, blobs: int, size: int) -> bool:
        """True when `blobs` more blobs of `size` bytes in all fit in the peer's window; a
        blob larger than the whole byte window goes once the window is empty."""
        n = len(ps.inflight) + (ps.active is not None)
        if n + blobs > limits.blob_inflight_max:
            return False
        return n + blobs == 1 or ps.inflight_bytes + size <= limits.blob_inflight_bytes_max

    def _send_next(self, ps: _PeerSend, to: str) -> None:
        """Take waiting blobs while the window has room: blobs of one chunk are read and packed
        into frames of at most `blob_frame_bytes`, at most `blob_window_frames` frames a turn;
        a larger blob becomes the one being streamed."""
        frames: list[tuple[dict[str, Any], list[_Out]]] = []
        pack: list[list[Any]] = []
        pack_outs: list[_Out] = []
        pack_bytes = 0
        taken = reserved = 0  # blobs and bytes of this turn's frames
        while ps.queue and len(frames) < limits.blob_window_frames:
            out = ps.queue[0]
            if self._out_live.get(out.key) is not out:
                ps.queue.popleft()  # cancelled: acknowledged meanwhile
                self._queued -= 1
                continue
            size = self._size_of(out)
            if size is None:
                ps.queue.popleft()
                self._queued -= 1
                del self._out_live[out.key]
                continue
            if not self._room(ps, taken + 1, reserved + size):
                break
            if size > limits.blob_frame_bytes:
                if pack_outs or frames:
                    break  # it starts once what is packed so far is on its way
                ps.queue.popleft()
                self._queued -= 1
                if self._start_out(out, size):
                    ps.active = out
                    ps.inflight_bytes += size
                    self._send_window(ps, out)
                else:
                    del self._out_live[out.key]
                return
            data = self._read_small(out, size)
            ps.queue.popleft()
            self._queued -= 1
            if data is None:
                del self._out_live[out.key]
                continue
            taken += 1
            reserved += size
            if out.get:
                # An answer to a fetch goes alone, as a chunk: the asker takes it as such.
                frames.append((self._chunk_body(out, data, size), [out]))
                continue
            if pack_outs and pack_bytes + size > limits.blob_frame_bytes:
                frames.append(({"blobs": pack}, pack_outs))
                pack, pack_outs, pack_bytes = [], [], 0
            pack.append([out.d, out.owner, data])
            pack_outs.append(out)
            pack_bytes += size
        if pack_outs:
            frames.append(({"blobs": pack}, pack_outs))
        if frames:
            self._hand_over(ps, to, frames)

    def _hand_over(self, ps: _PeerSend, to: str,
                   frames: list[tuple[dict[str, Any], list[_Out]]]) -> None:
        taken = self.links.send_batch(to, [(FrameType.F_BLOB_PUT, body) for body, _ in frames],
                                      table=True)
        now = self._clock_ms()
        sent = gets = 0
        for i, (_, outs) in enumerate(frames):
            for out in outs:
                if i < taken:
                    ps.inflight[out.key] = (now, out.size)
                    ps.inflight_bytes += out.size
                    sent += 1
                    gets += out.get
                else:
                    del self._out_live[out.key]
        with self._lock:
            self._counters["chunks_sent"] += sent
            self._counters["blobs_sent"] += sent
            self._counters["gets_served"] += gets
        if taken < len(frames):
            # The node asks again for what the links had no room for.
            self._drop("send_dropped", sum(len(outs) for _, outs in frames[taken:]))

    def _size_of(self, out: _Out) -> int | None:
        """The blob's size, or None (after saying so) when this member does not hold it."""
        if out.size >= 0:
            return out.size
        try:
            size = self.blobs.size(out.d)
        except BlobError as e:
            self._log.error("blob_send_unreadable", digest=out.d, to=out.to, error=str(e))
            size = None
        if size is None:
            self._not_here(out)
            return None
        out.size = size
        return size

    def _not_here(self, out: _Out) -> None:
        self._log.warning("blob_send_not_here", digest=out.d, to=out.to, get=out.get)
        self._drop("not_here")
        if out.get:
            self._send_missing(out.to, out.d)

    def _read_small(self, out: _Out, size: int) -> bytes | None:
        """The bytes of a blob of one chunk, or None (after saying why) when they cannot be
        read or are not `size` bytes long."""
        try:
            chunks = self.blobs.open(out.d)
            data = None if chunks is None else b"".join(chunks)
        except BlobError as e:
            self._log.error("blob_send_failed", digest=out.d, to=out.to, error=str(e))
            self._drop("read_failed")
            return None
        if data is None:
            self._not_here(out)
            return None
        if len(data) != size:
            self._log.error("blob_send_short", digest=out.d, to=out.to, sent=len(data),
                            size=size)
            self._drop("read_failed")
            return None
        return data

    def _start_out(self, out: _Out, size: int) -> bool:
        """Open a larger blob to stream; False (after saying so) when it cannot be read."""
        try:
            chunks = self.blobs.open(out.d)
        except BlobError as e:
            self._log.error("blob_send_unreadable", digest=out.d, to=out.to, error=str(e))
            chunks = None
        if chunks is None:
            self._not_here(out)
            return False
        out.pieces = _pieces(chunks, limits.blob_frame_bytes)
        return True

    def _send_window(self, ps: _PeerSend, out: _Out) -> None:
        assert out.pieces is not None and ps.active is out
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
            self._end_active(ps, out, sent=False)
            return
        if not frames:
            # The store's chunks ended before the blob's size: it changed under us.
            self._log.error("blob_send_short", digest=out.d, to=out.to, sent=out.off,
                            size=out.size)
            self._drop("read_failed")
            self._end_active(ps, out, sent=False)
            return
        taken = self.links.send_batch(out.to, frames, table=True)
        with self._lock:
            self._counters["chunks_sent"] += taken
        if taken < len(frames):
            # The rest of this blob would not follow on; the node asks again later.
            self._drop("send_dropped")
            self._end_active(ps, out, sent=False)
            return
        if frames[-1][1]["last"]:
            with self._lock:
                self._counters["blobs_sent"] += 1
                if out.get:
                    self._counters["gets_served"] += 1
            self._end_active(ps, out, sent=True)

    def _chunk_body(self, out: _Out, piece: bytes, end: int) -> dict[str, Any]:
        body: dict[str, Any] = {"d": out.d, "o": out.owner, "size": out.size,
                                "off": end - len(piece), "data": piece, "last": end == out.size}
        if out.get:
            body["get"] = True
        return body

    def _end_active(self, ps: _PeerSend, out: _Out, sent: bool) -> None:
        """The streamed blob is all sent (it waits for its acknowledgement) or given up."""
        ps.active = None
        out.pieces = None
        if sent:
            # Its bytes were counted in the window when it started.
            ps.inflight[out.key] = (self._clock_ms(), out.size)
        else:
            ps.inflight_bytes -= out.size
            del self._out_live[out.key]

    def _abort_peer(self, to: str) -> None:
        """`to` is not linked: what was to be sent to it is dropped."""
        ps = self._send.pop(to, None)
        if ps is None:
            return
        n = 0
        outs = list(ps.queue) + ([ps.active] if ps.active is not None else [])
        for out in outs:
            if self._out_live.get(out.key) is out:
                del self._out_live[out.key]
                n += 1
        self._queued -= len(ps.queue)
        for key in ps.inflight:
            self._out_live.pop(key, None)
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
        elif "blobs" in body:
            self._on_pack(peer, body)
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
            self._counters["acks_received"] += len(acked)
        done = set(acked)
        ps = self._send.get(peer)
        if ps is not None:
            get = owner is None  # a fetch's answer carries no owner, a copy always one
            for d in done:
                key: _OutKey = (peer, d, owner, get)
                sent = ps.inflight.pop(key, None)
                if sent is not None:
                    ps.inflight_bytes -= sent[1]
                    del self._out_live[key]
                elif (out := self._out_live.get(key)) is not None and ps.active is not out:
                    # Asked again while an earlier transfer was on its way: that one was
                    # acknowledged, so the waiting one is cancelled (and skipped when its
                    # turn comes).
                    del self._out_live[key]
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

    def _on_pack(self, peer: str, body: dict) -> None:
        """Whole blobs of one chunk each, `[d, o, data]`: each is taken as a chunk at offset 0
        that is also its last."""
        pack = body.get("blobs")
        if not isinstance(pack, list) or len(body) != 1:
            self._drop("bad_body")
            return
        for entry in pack:
            if not isinstance(entry, list | tuple) or len(entry) != 3:
                self._drop("bad_body")
                continue
            d, owner, data = entry
            self._on_chunk(peer, {"d": d, "o": owner,
                                  "size": len(data) if isinstance(data, bytes) else None,
                                  "off": 0, "data": data, "last": True})

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
            if last:
                self._stage(_Stored(peer, d, owner, get, data, skip))
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

    def _stage(self, blob: _Stored) -> None:
        """A whole blob of one chunk: checked now, stored with the rest of the turn's."""
        if blake3.blake3(blob.data).hexdigest() != blob.d:
            self._log.warning("blob_digest_mismatch", digest=blob.d, peer=blob.peer)
            self._drop("digest_mismatch")
            return
        with self._lock:
            self._counters["chunks_received"] += 1
        key = (blob.peer, blob.d, blob.owner, blob.get)
        if key in self._batch_keys:
            return  # sent twice in one turn: stored and acknowledged once
        self._batch_keys.add(key)
        self._batch.append(blob)
        self._batch_bytes += len(blob.data)
        if len(self._batch) >= batch_blobs_max or self._batch_bytes >= batch_bytes_max:
            self._store_batch()

    def _store_batch(self) -> None:
        """Keep the staged blobs durably, pinned for their owners, in one transaction and one
        fsync; then acknowledge them, one frame per peer and owner, and answer their fetches.
        A store without `write_batch` keeps them one `put` (and `pin`) at a time."""
        batch = self._batch
        if not batch:
            return
        self._batch, self._batch_keys, self._batch_bytes = [], set(), 0
        write_batch = getattr(self.blobs, "write_batch", None)
        try:
            if write_batch is not None:
                got = write_batch([b.data for b in batch], [b.owner for b in batch])
                self.blobs.sync()
            else:
                got = [self._put_one(b) for b in batch]
        except (OSError, BlobError) as e:
            self._log.error("blob_store_failed", blobs=len(batch), error=str(e))
            self._drop("store_failed", len(batch))
            return
        if len(got) != len(batch):
            raise AssertionError(f"the store answered {len(got)} of a batch of {len(batch)}")
        acks: dict[tuple[str, str | None], list[str]] = {}
        stored: set[str] = set()
        new = 0
        for b, r in zip(batch, got, strict=True):
            if isinstance(r, Exception):
                self._log.error("blob_store_failed", digest=b.d, peer=b.peer, error=str(r))
                self._drop("store_failed")
                continue
            if r != b.d:
                # The bytes were checked before the batch: the store kept something else.
                self._log.error("blob_digest_mismatch", digest=b.d, stored=r, peer=b.peer)
                self._drop("digest_mismatch")
                continue
            new += not b.held
            stored.add(b.d)
            acks.setdefault((b.peer, b.owner), []).append(b.d)
        with self._lock:
            self._counters["blobs_received"] += new
            for d in stored:
                self._resolve_locked(d, True)
        if self._asm:
            # Other transfers of the same blobs need not keep their bytes any more.
            for other in list(self._asm.values()):
                if other.d in stored and not other.skip:
                    self._unspool(other)
                    other.skip = True
        for (peer, owner), digests in acks.items():
            for i in range(0, len(digests), _ACK_DIGESTS):
                self._send_ack(peer, owner, digests[i:i + _ACK_DIGESTS])

    def _put_one(self, b: _Stored) -> str | Exception:
        """One blob kept by a store without batches: durable and pinned when it returns."""
        try:
            got = self.blobs.put(b.data)
            if b.owner is not None and got == b.d:
                self.blobs.pin(b.d, b.owner)
        except (OSError, BlobError) as e:
            return e
        return got

    def _send_ack(self, peer: str, owner: str | None, digests: list[str]) -> None:
        if self.links.send(peer, FrameType.F_BLOB_PUT, {"ack": digests, "o": owner},
                           table=True):
            with self._lock:
                self._counters["acks_sent"] += len(digests)

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
        self._send_ack(asm.peer, asm.owner, [d])
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
