"""The blob transfer protocol between members, with no IO (sans-IO, after h11).

Theory of operation. A result's output blobs must be durable on `blob_copies` members before the
result is proposed, and any member must serve any committed blob. Two frame types carry blobs:

- F_BLOB_PUT carries one chunk of one blob, `{"d", "o", "size", "off", "data", "last"}` (plus
  `"get": True` when it answers a fetch); a pack of whole blobs of one chunk each,
  `{"blobs": [[d, o, data], ...]}` (at most `frame_bytes` of data); an acknowledgement of one
  or many blobs, `{"ack": [d, ...], "o"}`; or a holder's `{"d", "missing": True}`.
- F_BLOB_GET `{"d"}` asks a peer for a blob; a holder answers with its chunks.

One `Transfer` per member holds both halves: the `Sender` (copies asked, the blobs waiting for
each peer, the window of blobs sent and not yet acknowledged, the larger blob being streamed)
and the `Receiver` (the blobs being assembled, the small blobs waiting to be stored together).
Its caller (meshjobs/blobmover.py in meshd, meshjobs/sim.py in the simulator) feeds it events
with the time as a number — a frame received (`frame`), a copy asked (`copy`), the end of a
turn (`end_turn`), a chance to send (`pump`), a clock tick (`tick`) — and executes the actions
each call returns, in order: frames to send, chunks to write to a spool, blobs to keep, copies
done, fetches answered. An action whose outcome the protocol needs (how many frames the links
took, what the store kept) is answered at once by the matching call (`taken`, `kept`,
`batch_kept`, `spool_failed`), which may return more actions.

Rule 1: no IO, clock, threads or randomness. The store is read through the `Source` the caller
        passes in (has, size, read, open: reads only, like an injected clock); every write and
        send is an action.
Rule 2: bounded. Every queue and window has a limit from meshjobs/limits.py (`XferLimits`):
        the blobs waiting to be sent, the blobs and bytes in flight per peer, the assemblies
        and each one's size, the copies waiting for their acknowledgement, the staged batch.
        What does not fit is dropped and counted; nothing correct depends on a frame arriving,
        and the job node asks again.
Rule 3: remote garbage (wrong types, offsets that do not follow, a size over the limit, bytes
        that do not hash to their digest) drops that blob's assembly and is counted by reason
        (`Tally.drop`); it never raises. A mistake of the caller's own (a bad digest or owner
        passed to `copy`) raises `XferError`, the one error class; a broken invariant of this
        module's own fails an assertion.
Rule 4: a blob is acknowledged only after the caller said it is durable (and pinned for its
        owner): acknowledgements follow `kept`/`batch_kept`, never a chunk. Chunks of one
        assembly are written in order, each at the offset where the spool ends (`SpoolWrite.off`
        lets the executor check it), and a blob is kept only when its bytes hash to its digest;
        the digest the store returns is checked again (paired checks).
Rule 5: a blob is sent to a peer once at a time: asked again while waiting, being sent or
        unacknowledged, it is not queued twice. A blob of one chunk is read only when its frame
        is built; a larger one is read one window (`window_frames` chunks) at a time.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from itertools import islice
from typing import Any, Protocol

import blake3

from blobstore.digest import is_digest
from blobstore.limits import batch_blobs_max, batch_bytes_max, owner_bytes_max
from meshjobs import limits

# Digests in one acknowledgement frame (about 70 bytes each, far below `frame_bytes_max`).
ACK_DIGESTS = 4096

OutKey = tuple[str, str, str | None, bool]  # peer, digest, owner, answers a fetch
AsmKey = tuple[str, str]  # peer, digest


class XferError(ValueError):
    """The one error class: a caller's mistake (a copy to itself, a bad owner or digest), or a
    blob the `Source` cannot read (raised by the source, caught here and counted)."""


@dataclass(frozen=True)
class XferLimits:
    """The protocol's limits; meshd uses the defaults (meshjobs/limits.py and the store's), the
    simulator smaller frames so that its small blobs travel in windows of chunks."""

    frame_bytes: int = limits.blob_frame_bytes
    window_frames: int = limits.blob_window_frames
    ack_wait_ms: int = limits.blob_ack_wait_ms
    inflight_max: int = limits.blob_inflight_max
    inflight_bytes_max: int = limits.blob_inflight_bytes_max
    send_queue_max: int = limits.blob_send_queue_max
    assemblies_max: int = limits.blob_assemblies_max
    assembly_bytes_max: int = limits.blob_assembly_bytes_max
    assembly_idle_ms: int = limits.blob_assembly_idle_ms
    copies_max: int = limits.blob_mover_queue_max
    copy_wait_ms: int = limits.blob_copy_wait_ms
    batch_blobs_max: int = batch_blobs_max
    batch_bytes_max: int = batch_bytes_max
    owner_bytes_max: int = owner_bytes_max


class Source(Protocol):
    """What the protocol reads of the local store. `size`, `read` and `open` (and iterating what
    `open` returns) raise XferError when the store cannot read the blob."""

    def has(self, d: str) -> bool: ...
    def size(self, d: str) -> int | None: ...
    def read(self, d: str) -> bytes | None: ...
    def open(self, d: str) -> Iterable[bytes] | None: ...
    def wanted(self, d: str) -> bool: ...  # a fetch of `d` waits on this member


class Tally:
    """Counters and drops by reason; the mover's keeps them under its lock."""

    def __init__(self) -> None:
        self.counters: dict[str, int] = {}
        self.dropped: dict[str, int] = {}

    def count(self, name: str, n: int = 1) -> None:
        self.counters[name] = self.counters.get(name, 0) + n

    def drop(self, reason: str, n: int = 1) -> None:
        self.dropped[reason] = self.dropped.get(reason, 0) + n


class _Quiet:
    """A logger that says nothing (the default; meshd passes its structlog logger)."""

    def __getattr__(self, _name: str) -> Callable[..., None]:
        return lambda *_a, **_k: None


# --- actions --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SendFrames:
    """Hand these F_BLOB_PUT bodies to the links for `to` (table=True), in order; then call
    `taken(ticket, n, now)` with how many the links took."""

    to: str
    bodies: list[dict[str, Any]]
    ticket: int


@dataclass(frozen=True, slots=True)
class Send:
    """Send one F_BLOB_PUT body to `to` (table=True); when the links take it, count `counts`
    (a counter name and how much) if set."""

    to: str
    body: dict[str, Any]
    counts: tuple[str, int] | None = None


@dataclass(frozen=True, slots=True)
class SpoolWrite:
    """Append `data` to the spool of assembly `key` (opened at its first write); the spool holds
    exactly `off` bytes before it. When the write fails, call `spool_failed(key)` and skip the
    actions for `key` that follow."""

    key: AsmKey
    d: str
    off: int
    data: bytes


@dataclass(frozen=True, slots=True)
class Unspool:
    """Close and remove the spool of assembly `key`, if it has one."""

    key: AsmKey


@dataclass(frozen=True, slots=True)
class Keep:
    """A blob received whole: when `spooled`, store the spool of `key` (it hashed to `d`); pin
    it for `owner` (if any); say whether the store holds it; remove the spool; then call
    `kept(self, got, held)`. Skipped when `spooled` and the spool is gone (`spool_failed`)."""

    key: AsmKey
    d: str
    owner: str | None
    spooled: bool


@dataclass(frozen=True, slots=True)
class Staged:
    """A received blob of one chunk, checked against its digest, waiting to be stored."""

    peer: str
    d: str
    owner: str | None
    get: bool
    data: bytes
    held: bool  # the store held it already: stored again only to renew and pin it


@dataclass(frozen=True, slots=True)
class KeepBatch:
    """Store these blobs durably (one transaction, one sync), pinned for their owners; then
    call `batch_kept(ticket, results)`: per blob the digest the store returned or the error, or
    None for the whole batch when it failed."""

    blobs: list[Staged]
    ticket: int


@dataclass(frozen=True, slots=True)
class CopyDone:
    """`to` acknowledged every blob of a copy: tell the job node."""

    to: str
    owner: str
    digests: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Found:
    """`d` is durable here now: a fetch of it is answered."""

    d: str


@dataclass(frozen=True, slots=True)
class PeerMissing:
    """`peer` does not hold `d` (its answer to a fetch)."""

    peer: str
    d: str


Action = SendFrames | Send | SpoolWrite | Unspool | Keep | KeepBatch | CopyDone | Found | PeerMissing


# --- helpers ----------------------------------------------------------------------------------


def owner_ok(owner: object, owner_bytes: int = owner_bytes_max) -> bool:
    """True for no owner, or a name the store accepts as a pin owner."""
    if owner is None:
        return True
    if not isinstance(owner, str) or not owner or "\x00" in owner:
        return False
    try:
        return len(owner.encode("utf-8")) <= owner_bytes
    except UnicodeEncodeError:
        return False


def check_copy(member: str, to: str, owner: object, digests: Iterable[object]) -> tuple[str, ...]:
    """The digests of a copy asked of `member`, or XferError saying what is wrong with it."""
    if to == member:
        raise XferError("a member does not copy blobs to itself")
    if not isinstance(owner, str) or not owner or not owner_ok(owner):
        raise XferError(f"a copy's owner is a pin owner name, not {owner!r:.80}")
    out = tuple(digests)
    for d in out:
        if not is_digest(d):
            raise XferError(f"not a blob digest: {d!r:.80}")
    return out  # type: ignore[return-value]


def body_bytes(body: object) -> int:
    """The blob bytes a frame's body carries, as the mover's inbox counts them."""
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


def pieces(chunks: Iterable[bytes], size: int) -> Iterator[bytes]:
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


# --- sending ------------------------------------------------------------------------------------


class _Out:
    """One blob to send to one peer."""

    __slots__ = ("key", "to", "d", "owner", "get", "size", "off", "pieces")

    def __init__(self, to: str, d: str, owner: str | None, get: bool) -> None:
        self.key: OutKey = (to, d, owner, get)
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
    longer maps to it in the sender's `out_live` was cancelled and is skipped."""

    __slots__ = ("queue", "active", "inflight", "inflight_bytes")

    def __init__(self) -> None:
        self.queue: deque[_Out] = deque()
        self.active: _Out | None = None
        self.inflight: dict[OutKey, tuple[float, int]] = {}
        self.inflight_bytes = 0


@dataclass
class _Copy:
    """A copy request waiting for the peer's acknowledgement of every digest."""

    to: str
    owner: str
    digests: tuple[str, ...]
    remaining: set[str]
    since_ms: float


class Sender:
    """Copies out and answers to fetches: queues, windows and acknowledgements."""

    def __init__(self, src: Source, lim: XferLimits, tally: Tally, log: Any) -> None:
        self.src = src
        self.lim = lim
        self.tally = tally
        self.log = log
        self.copies: dict[tuple[str, str, tuple[str, ...]], _Copy] = {}
        self.send: dict[str, _PeerSend] = {}
        # Every blob waiting, being sent or unacknowledged, by its key: what is asked again
        # meanwhile is not sent twice.
        self.out_live: dict[OutKey, _Out] = {}
        self.queued = 0  # entries in the peers' queues, cancelled ones included
        self._tickets = 0
        # What to do once the links said how many frames of a SendFrames they took.
        self._pending: dict[int, Callable[[int, float], list[Action]]] = {}

    def copy(self, to: str, owner: str, digests: tuple[str, ...], now: float) -> list[Action]:
        key = (to, owner, digests)
        c = self.copies.get(key)
        if c is None:
            if len(self.copies) >= self.lim.copies_max:
                # Forget the oldest copy: its node asks again if it still needs it.
                oldest = min(self.copies, key=lambda k: self.copies[k].since_ms)
                del self.copies[oldest]
                self.tally.drop("copies_full")
            c = self.copies[key] = _Copy(to, owner, digests, set(digests), now)
            if not digests:
                return [self._complete(key)]
        c.since_ms = now
        for d in c.remaining:
            self._queue_out(_Out(to, d, owner, get=False))
        return []

    def get(self, peer: str, body: dict) -> list[Action]:
        d = body.get("d")
        if not is_digest(d):
            self.tally.drop("bad_get")
            return []
        if self.src.has(d):
            self._queue_out(_Out(peer, d, None, get=True))
            return []
        return [self._missing(peer, d)]

    def ack(self, peer: str, body: dict) -> list[Action]:
        acked, owner = body.get("ack"), body.get("o")
        if (not isinstance(acked, list) or not all(is_digest(d) for d in acked)
                or not owner_ok(owner, self.lim.owner_bytes_max)):
            self.tally.drop("bad_ack")
            return []
        self.tally.count("acks_received", len(acked))
        done = set(acked)
        ps = self.send.get(peer)
        if ps is not None:
            get = owner is None  # a fetch's answer carries no owner, a copy always one
            for d in done:
                key: OutKey = (peer, d, owner, get)
                sent = ps.inflight.pop(key, None)
                if sent is not None:
                    ps.inflight_bytes -= sent[1]
                    del self.out_live[key]
                elif (out := self.out_live.get(key)) is not None and ps.active is not out:
                    # Asked again while an earlier transfer was on its way: that one was
                    # acknowledged, so the waiting one is cancelled (and skipped when its
                    # turn comes).
                    del self.out_live[key]
        if owner is None:
            return []
        actions: list[Action] = []
        for key, c in list(self.copies.items()):
            if c.to == peer and c.owner == owner and c.remaining & done:
                c.remaining -= done
                if not c.remaining:
                    actions.append(self._complete(key))
        return actions

    def expire(self, now: float) -> None:
        for key, c in list(self.copies.items()):
            if now - c.since_ms > self.lim.copy_wait_ms:
                del self.copies[key]
                self.tally.drop("copy_expired")

    def _complete(self, key: tuple[str, str, tuple[str, ...]]) -> CopyDone:
        c = self.copies.pop(key)
        self.tally.count("copies_completed")
        return CopyDone(c.to, c.owner, c.digests)

    def _missing(self, to: str, d: str) -> Send:
        self.tally.count("gets_missing")
        return Send(to, {"d": d, "missing": True})

    def _queue_out(self, out: _Out) -> None:
        if out.key in self.out_live:
            return  # already waiting, being sent, or sent and not yet acknowledged
        if self.queued >= self.lim.send_queue_max:
            self.tally.drop("sends_full")
            return
        ps = self.send.get(out.to)
        if ps is None:
            ps = self.send[out.to] = _PeerSend()
        ps.queue.append(out)
        self.queued += 1
        self.out_live[out.key] = out

    def pump(self, now: float, peers: Callable[[], Mapping[str, Mapping[str, Any]]],
             room_frames: int) -> tuple[list[Action], bool]:
        """The next frames for every peer whose links' queue holds at most `room_frames`
        (`peers()` says, per peer, `up`, `queued` and `waiting`), and True while some send waits
        for room or for an acknowledgement."""
        busy = False
        known: Mapping[str, Mapping[str, Any]] | None = None
        actions: list[Action] = []
        for to, ps in list(self.send.items()):
            self._expire_inflight(ps, now)
            if ps.active is None and not ps.queue:
                if ps.inflight:
                    busy = True
                else:
                    del self.send[to]
                continue
            if known is None:
                known = peers()
            info = known.get(to)
            if info is None or not info["up"]:
                self._abort_peer(to)
                continue
            busy = True
            if info["queued"] + info["waiting"] > room_frames:
                continue
            if ps.active is not None:
                actions += self._send_window(ps, ps.active)
            else:
                actions += self._send_next(ps, to)
        return actions, busy

    def taken(self, ticket: int, n: int, now: float) -> list[Action]:
        return self._pending.pop(ticket)(n, now)

    def _hand(self, to: str, bodies: list[dict[str, Any]],
              then: Callable[[int, float], list[Action]]) -> list[Action]:
        self._tickets += 1
        assert len(self._pending) <= len(self.send), "a SendFrames was never answered"
        self._pending[self._tickets] = then
        return [SendFrames(to, bodies, self._tickets)]

    def _expire_inflight(self, ps: _PeerSend, now: float) -> None:
        """Blobs not acknowledged within `ack_wait_ms` leave the window (oldest first); their
        copies wait until the node asks again."""
        while ps.inflight:
            key, (sent_ms, size) = next(iter(ps.inflight.items()))
            if now - sent_ms < self.lim.ack_wait_ms:
                return
            del ps.inflight[key]
            ps.inflight_bytes -= size
            self.out_live.pop(key, None)
            self.tally.drop("ack_late")

    def _room(self, ps: _PeerSend, blobs: int, size: int) -> bool:
        """True when `blobs` more blobs of `size` bytes in all fit in the peer's window; a
        blob larger than the whole byte window goes once the window is empty."""
        n = len(ps.inflight) + (ps.active is not None)
        if n + blobs > self.lim.inflight_max:
            return False
        return n + blobs == 1 or ps.inflight_bytes + size <= self.lim.inflight_bytes_max

    def _send_next(self, ps: _PeerSend, to: str) -> list[Action]:
        """Take waiting blobs while the window has room: blobs of one chunk are read and packed
        into frames of at most `frame_bytes`, at most `window_frames` frames a turn; a larger
        blob becomes the one being streamed."""
        frames: list[tuple[dict[str, Any], list[_Out]]] = []
        pack: list[list[Any]] = []
        pack_outs: list[_Out] = []
        pack_bytes = 0
        taken = reserved = 0  # blobs and bytes of this turn's frames
        actions: list[Action] = []
        while ps.queue and len(frames) < self.lim.window_frames:
            out = ps.queue[0]
            if self.out_live.get(out.key) is not out:
                ps.queue.popleft()  # cancelled: acknowledged meanwhile
                self.queued -= 1
                continue
            size = self._size_of(out, actions)
            if size is None:
                ps.queue.popleft()
                self.queued -= 1
                del self.out_live[out.key]
                continue
            if not self._room(ps, taken + 1, reserved + size):
                break
            if size > self.lim.frame_bytes:
                if pack_outs or frames:
                    break  # it starts once what is packed so far is on its way
                ps.queue.popleft()
                self.queued -= 1
                if self._start_out(out, size, actions):
                    ps.active = out
                    ps.inflight_bytes += size
                    actions += self._send_window(ps, out)
                else:
                    del self.out_live[out.key]
                return actions
            data = self._read_small(out, size, actions)
            ps.queue.popleft()
            self.queued -= 1
            if data is None:
                del self.out_live[out.key]
                continue
            taken += 1
            reserved += size
            if out.get:
                # An answer to a fetch goes alone, as a chunk: the asker takes it as such.
                frames.append((self._chunk_body(out, data, size), [out]))
                continue
            if pack_outs and pack_bytes + size > self.lim.frame_bytes:
                frames.append(({"blobs": pack}, pack_outs))
                pack, pack_outs, pack_bytes = [], [], 0
            pack.append([out.d, out.owner, data])
            pack_outs.append(out)
            pack_bytes += size
        if pack_outs:
            frames.append(({"blobs": pack}, pack_outs))
        if frames:
            actions += self._hand(to, [body for body, _ in frames],
                                  lambda n, now: self._handed(ps, frames, n, now))
        return actions

    def _handed(self, ps: _PeerSend, frames: list[tuple[dict[str, Any], list[_Out]]],
                taken: int, now: float) -> list[Action]:
        sent = gets = 0
        for i, (_, outs) in enumerate(frames):
            for out in outs:
                if i < taken:
                    ps.inflight[out.key] = (now, out.size)
                    ps.inflight_bytes += out.size
                    sent += 1
                    gets += out.get
                else:
                    del self.out_live[out.key]
        self.tally.count("chunks_sent", sent)
        self.tally.count("blobs_sent", sent)
        self.tally.count("gets_served", gets)
        if taken < len(frames):
            # The node asks again for what the links had no room for.
            self.tally.drop("send_dropped", sum(len(outs) for _, outs in frames[taken:]))
        return []

    def _size_of(self, out: _Out, actions: list[Action]) -> int | None:
        """The blob's size, or None (after saying so) when this member does not hold it."""
        if out.size >= 0:
            return out.size
        try:
            size = self.src.size(out.d)
        except XferError as e:
            self.log.error("blob_send_unreadable", digest=out.d, to=out.to, error=str(e))
            size = None
        if size is None:
            self._not_here(out, actions)
            return None
        out.size = size
        return size

    def _not_here(self, out: _Out, actions: list[Action]) -> None:
        self.log.warning("blob_send_not_here", digest=out.d, to=out.to, get=out.get)
        self.tally.drop("not_here")
        if out.get:
            actions.append(self._missing(out.to, out.d))

    def _read_small(self, out: _Out, size: int, actions: list[Action]) -> bytes | None:
        """The bytes of a blob of one chunk, or None (after saying why) when they cannot be
        read or are not `size` bytes long."""
        try:
            data = self.src.read(out.d)
        except XferError as e:
            self.log.error("blob_send_failed", digest=out.d, to=out.to, error=str(e))
            self.tally.drop("read_failed")
            return None
        if data is None:
            self._not_here(out, actions)
            return None
        if len(data) != size:
            self.log.error("blob_send_short", digest=out.d, to=out.to, sent=len(data),
                           size=size)
            self.tally.drop("read_failed")
            return None
        return data

    def _start_out(self, out: _Out, size: int, actions: list[Action]) -> bool:
        """Open a larger blob to stream; False (after saying so) when it cannot be read."""
        try:
            chunks = self.src.open(out.d)
        except XferError as e:
            self.log.error("blob_send_unreadable", digest=out.d, to=out.to, error=str(e))
            chunks = None
        if chunks is None:
            self._not_here(out, actions)
            return False
        out.pieces = pieces(chunks, self.lim.frame_bytes)
        return True

    def _send_window(self, ps: _PeerSend, out: _Out) -> list[Action]:
        assert out.pieces is not None and ps.active is out
        bodies: list[dict[str, Any]] = []
        try:
            for piece in islice(out.pieces, self.lim.window_frames):
                end = out.off + len(piece)
                if end > out.size:
                    raise XferError(f"blob {out.d} holds more than its {out.size} bytes")
                bodies.append(self._chunk_body(out, piece, end))
                out.off = end
        except XferError as e:
            self.log.error("blob_send_failed", digest=out.d, to=out.to, error=str(e))
            self.tally.drop("read_failed")
            self._end_active(ps, out, sent=False, now=0.0)
            return []
        if not bodies:
            # The store's chunks ended before the blob's size: it changed under us.
            self.log.error("blob_send_short", digest=out.d, to=out.to, sent=out.off,
                           size=out.size)
            self.tally.drop("read_failed")
            self._end_active(ps, out, sent=False, now=0.0)
            return []
        last = bodies[-1]["last"]
        return self._hand(out.to, bodies,
                          lambda n, now: self._window_handed(ps, out, len(bodies), last, n, now))

    def _window_handed(self, ps: _PeerSend, out: _Out, frames: int, last: bool, taken: int,
                       now: float) -> list[Action]:
        self.tally.count("chunks_sent", taken)
        if taken < frames:
            # The rest of this blob would not follow on; the node asks again later.
            self.tally.drop("send_dropped")
            self._end_active(ps, out, sent=False, now=now)
            return []
        if last:
            self.tally.count("blobs_sent")
            if out.get:
                self.tally.count("gets_served")
            self._end_active(ps, out, sent=True, now=now)
        return []

    def _chunk_body(self, out: _Out, piece: bytes, end: int) -> dict[str, Any]:
        body: dict[str, Any] = {"d": out.d, "o": out.owner, "size": out.size,
                                "off": end - len(piece), "data": piece, "last": end == out.size}
        if out.get:
            body["get"] = True
        return body

    def _end_active(self, ps: _PeerSend, out: _Out, sent: bool, now: float) -> None:
        """The streamed blob is all sent (it waits for its acknowledgement) or given up."""
        ps.active = None
        out.pieces = None
        if sent:
            # Its bytes were counted in the window when it started.
            ps.inflight[out.key] = (now, out.size)
        else:
            ps.inflight_bytes -= out.size
            del self.out_live[out.key]

    def _abort_peer(self, to: str) -> None:
        """`to` is not linked: what was to be sent to it is dropped."""
        ps = self.send.pop(to, None)
        if ps is None:
            return
        n = 0
        outs = list(ps.queue) + ([ps.active] if ps.active is not None else [])
        for out in outs:
            if self.out_live.get(out.key) is out:
                del self.out_live[out.key]
                n += 1
        self.queued -= len(ps.queue)
        for key in ps.inflight:
            self.out_live.pop(key, None)
        if n:
            self.tally.drop("peer_down", n)


# --- receiving ----------------------------------------------------------------------------------


class _Assembly:
    """One blob being received from one peer."""

    __slots__ = ("peer", "d", "owner", "get", "size", "off", "hasher", "skip", "spooled",
                 "last_ms")

    def __init__(self, peer: str, d: str, owner: str | None, get: bool, size: int,
                 now: float) -> None:
        self.peer = peer
        self.d = d
        self.owner = owner
        self.get = get
        self.size = size
        self.off = 0
        self.hasher = blake3.blake3()
        self.skip = False  # the store already holds the blob: the data is not kept
        self.spooled = False  # a SpoolWrite was asked for it (its spool may exist)
        self.last_ms = now


@dataclass
class _Batch:
    blobs: list[Staged] = field(default_factory=list)
    keys: set[tuple[str, str, str | None, bool]] = field(default_factory=set)
    bytes: int = 0


class Receiver:
    """Blobs in: assemblies of chunks, small blobs staged and kept together, acknowledgements
    once durable."""

    def __init__(self, src: Source, lim: XferLimits, tally: Tally, log: Any) -> None:
        self.src = src
        self.lim = lim
        self.tally = tally
        self.log = log
        self.asm: dict[AsmKey, _Assembly] = {}
        self._batch = _Batch()
        self._tickets = 0
        self._pending: dict[int, list[Staged]] = {}

    def pack(self, peer: str, body: dict, now: float) -> list[Action]:
        """Whole blobs of one chunk each, `[d, o, data]`: each is taken as a chunk at offset 0
        that is also its last."""
        blobs = body.get("blobs")
        if not isinstance(blobs, list) or len(body) != 1:
            self.tally.drop("bad_body")
            return []
        actions: list[Action] = []
        for entry in blobs:
            if not isinstance(entry, list | tuple) or len(entry) != 3:
                self.tally.drop("bad_body")
                continue
            d, owner, data = entry
            actions += self.chunk(peer, {"d": d, "o": owner,
                                         "size": len(data) if isinstance(data, bytes) else None,
                                         "off": 0, "data": data, "last": True}, now)
        return actions

    def in_order(self, asm: _Assembly | None, off: int, size: int, owner: object,
                 get: bool) -> bool:
        """A chunk past the first follows on its assembly: same blob, owner and purpose, at the
        offset where the assembly ends."""
        return not (asm is None or asm.off != off or asm.size != size or asm.owner != owner
                    or asm.get != get)

    def chunk(self, peer: str, b: dict, now: float) -> list[Action]:
        d, size, off, data, last = (b.get(k) for k in ("d", "size", "off", "data", "last"))
        owner, get = b.get("o"), b.get("get", False)
        if not is_digest(d):
            self.tally.drop("bad_body")
            return []
        key = (peer, d)
        if not (type(size) is int and type(off) is int and isinstance(data, bytes)
                and type(last) is bool and type(get) is bool
                and owner_ok(owner, self.lim.owner_bytes_max)):
            return self._garbage(key, "bad_body")
        if size > self.lim.assembly_bytes_max:
            return self._garbage(key, "too_large")
        end = off + len(data)
        if (size < 0 or off < 0 or len(data) > self.lim.frame_bytes or end > size
                or last != (end == size) or (not last and not data)):
            return self._garbage(key, "bad_offset")
        actions: list[Action] = []
        asm = self.asm.get(key)
        if off == 0:
            if asm is not None:
                # A new transfer of the same blob: the earlier one was cut short.
                actions += self._close(key)
            skip = self.src.has(d)
            if get and not skip and not self.src.wanted(d):
                # Nobody waits for it any more (the fetch timed out).
                self.tally.drop("unasked")
                return actions
            if last:
                return actions + self._stage(Staged(peer, d, owner, get, data, skip))
            if len(self.asm) >= self.lim.assemblies_max:
                self.tally.drop("assemblies_full")
                return actions
            asm = self.asm[key] = _Assembly(peer, d, owner, get, size, now)
            # A blob already held is acknowledged at its last chunk without keeping its bytes.
            asm.skip = skip
        elif not self.in_order(asm, off, size, owner, get):
            return self._garbage(key, "out_of_order")
        assert asm is not None
        self.tally.count("chunks_received")
        asm.last_ms = now
        if not asm.skip:
            actions.append(SpoolWrite(key, d, off, data))
            asm.spooled = True
            asm.hasher.update(data)
        asm.off = end
        if last:
            actions += self._finish(key, asm)
        return actions

    def spool_failed(self, key: AsmKey) -> list[Action]:
        """Writing to the spool of `key` failed (the executor said why)."""
        return self._garbage(key, "spool_failed")

    def _stage(self, blob: Staged) -> list[Action]:
        """A whole blob of one chunk: checked now, kept with the rest of the turn's."""
        if blake3.blake3(blob.data).hexdigest() != blob.d:
            self.log.warning("blob_digest_mismatch", digest=blob.d, peer=blob.peer)
            self.tally.drop("digest_mismatch")
            return []
        self.tally.count("chunks_received")
        key = (blob.peer, blob.d, blob.owner, blob.get)
        batch = self._batch
        if key in batch.keys:
            return []  # sent twice in one turn: stored and acknowledged once
        batch.keys.add(key)
        batch.blobs.append(blob)
        batch.bytes += len(blob.data)
        if len(batch.blobs) >= self.lim.batch_blobs_max or batch.bytes >= self.lim.batch_bytes_max:
            return self.end_turn()
        return []

    def end_turn(self) -> list[Action]:
        """The staged blobs, to be kept in one transaction and one sync."""
        blobs = self._batch.blobs
        if not blobs:
            return []
        self._batch = _Batch()
        self._tickets += 1
        self._pending[self._tickets] = blobs
        return [KeepBatch(blobs, self._tickets)]

    def batch_kept(self, ticket: int, results: list[str | Exception] | None) -> list[Action]:
        """The store kept a batch (`results`: per blob, the digest it returned or the error) or
        failed it whole (None): acknowledge what is durable, one frame per peer and owner, and
        answer its fetches."""
        batch = self._pending.pop(ticket)
        if results is None:
            self.tally.drop("store_failed", len(batch))
            return []
        if len(results) != len(batch):
            raise AssertionError(f"the store answered {len(results)} of a batch of {len(batch)}")
        acks: dict[tuple[str, str | None], list[str]] = {}
        stored: set[str] = set()
        new = 0
        for b, r in zip(batch, results, strict=True):
            if isinstance(r, Exception):
                self.log.error("blob_store_failed", digest=b.d, peer=b.peer, error=str(r))
                self.tally.drop("store_failed")
                continue
            if r != b.d:
                # The bytes were checked before the batch: the store kept something else.
                self.log.error("blob_digest_mismatch", digest=b.d, stored=r, peer=b.peer)
                self.tally.drop("digest_mismatch")
                continue
            new += not b.held
            stored.add(b.d)
            acks.setdefault((b.peer, b.owner), []).append(b.d)
        self.tally.count("blobs_received", new)
        actions: list[Action] = [Found(d) for d in sorted(stored)]
        if self.asm:
            # Other transfers of the same blobs need not keep their bytes any more.
            actions += self._skip_others(stored)
        for (peer, owner), digests in acks.items():
            for i in range(0, len(digests), ACK_DIGESTS):
                actions.append(ack(peer, owner, digests[i:i + ACK_DIGESTS]))
        return actions

    def _finish(self, key: AsmKey, asm: _Assembly) -> list[Action]:
        """The last chunk arrived: check the bytes, then have the blob kept (and pinned)."""
        if not asm.skip and asm.hasher.hexdigest() != asm.d:
            self.log.warning("blob_digest_mismatch", digest=asm.d, peer=asm.peer)
            return self._garbage(key, "digest_mismatch")
        return [Keep(key, asm.d, asm.owner, spooled=not asm.skip)]

    def kept(self, act: Keep, got: str | Exception | None, held: bool | Exception | None
             ) -> list[Action]:
        """The executor of `act` stored the spool (`got`: the digest the store returned, or
        the error; None when not spooled) and then pinned it and looked it up (`held`; None
        when storing failed)."""
        asm = self.asm.get(act.key)
        assert asm is not None and asm.d == act.d, f"kept an assembly that is gone: {act}"
        asm.spooled = False  # the executor of a Keep removes the spool
        if act.spooled:
            if isinstance(got, Exception):
                self.log.error("blob_store_failed", digest=act.d, peer=asm.peer, error=str(got))
                return self._garbage(act.key, "store_failed")
            if got != act.d:
                # The spool file changed after it was hashed: its bytes are not the blob.
                self.log.error("blob_digest_mismatch", digest=act.d, stored=got, peer=asm.peer)
                return self._garbage(act.key, "digest_mismatch")
            self.tally.count("blobs_received")
        actions = self._close(act.key)
        if isinstance(held, Exception):
            self.log.error("blob_store_failed", digest=act.d, peer=asm.peer, error=str(held))
            self.tally.drop("store_failed")
            return actions
        if not held:
            # It was collected between its first chunk and its pin; the sender asks again.
            self.tally.drop("gone")
            return actions
        actions += self._skip_others({act.d})
        actions.append(ack(asm.peer, asm.owner, [act.d]))
        actions.append(Found(act.d))
        return actions

    def _skip_others(self, stored: set[str]) -> list[Action]:
        """Other transfers of blobs now stored need not keep their bytes any more."""
        actions: list[Action] = []
        for key, other in list(self.asm.items()):
            if other.d in stored and not other.skip:
                if other.spooled:
                    actions.append(Unspool(key))
                    other.spooled = False
                other.skip = True
        return actions

    def expire(self, now: float) -> list[Action]:
        actions: list[Action] = []
        for key, asm in list(self.asm.items()):
            if now - asm.last_ms > self.lim.assembly_idle_ms:
                self.log.info("blob_assembly_stale", digest=asm.d, peer=asm.peer,
                              received=asm.off, size=asm.size)
                actions += self._garbage(key, "stale")
        return actions

    def _garbage(self, key: AsmKey, reason: str) -> list[Action]:
        """Remote garbage or a failed assembly: drop the blob's assembly and count why."""
        actions = self._close(key)
        self.tally.drop(reason)
        return actions

    def _close(self, key: AsmKey) -> list[Action]:
        asm = self.asm.pop(key, None)
        return [Unspool(key)] if asm is not None and asm.spooled else []


def ack(peer: str, owner: str | None, digests: list[str]) -> Send:
    """An acknowledgement of `digests` (durable here, pinned for `owner`) to `peer`."""
    return Send(peer, {"ack": digests, "o": owner}, ("acks_sent", len(digests)))


# --- both halves --------------------------------------------------------------------------------


class Transfer:
    """One member's side of every blob transfer: a `Sender` and a `Receiver` fed the same
    frames. Not thread-safe: one thread (the mover's, or the simulator) calls it."""

    def __init__(self, src: Source, lim: XferLimits | None = None, tally: Tally | None = None,
                 log: Any = None, receiver_cls: type[Receiver] = Receiver) -> None:
        self.lim = lim if lim is not None else XferLimits()
        self.tally = tally if tally is not None else Tally()
        log = log if log is not None else _Quiet()
        self.sender = Sender(src, self.lim, self.tally, log)
        self.receiver = receiver_cls(src, self.lim, self.tally, log)

    def copy(self, to: str, owner: str, digests: tuple[str, ...], now: float) -> list[Action]:
        """Queue the blobs of a copy (checked by `check_copy`) for `to`; CopyDone once `to`
        acknowledged every one."""
        return self.sender.copy(to, owner, digests, now)

    def frame(self, peer: str, is_get: bool, body: Any, now: float) -> list[Action]:
        """An F_BLOB_GET (`is_get`) or F_BLOB_PUT body from `peer`."""
        if not isinstance(body, dict):
            self.tally.drop("bad_body")
            return []
        if is_get:
            return self.sender.get(peer, body)
        if "ack" in body:
            return self.sender.ack(peer, body)
        if body.get("missing") is True:
            d = body.get("d")
            if not is_digest(d):
                self.tally.drop("bad_body")
                return []
            return [PeerMissing(peer, d)]
        if "blobs" in body:
            return self.receiver.pack(peer, body, now)
        return self.receiver.chunk(peer, body, now)

    def end_turn(self) -> list[Action]:
        return self.receiver.end_turn()

    def pump(self, now: float, peers: Callable[[], Mapping[str, Mapping[str, Any]]],
             room_frames: int) -> tuple[list[Action], bool]:
        return self.sender.pump(now, peers, room_frames)

    def taken(self, ticket: int, n: int, now: float) -> list[Action]:
        return self.sender.taken(ticket, n, now)

    def kept(self, act: Keep, got: str | Exception | None, held: bool | Exception | None
             ) -> list[Action]:
        return self.receiver.kept(act, got, held)

    def batch_kept(self, ticket: int, results: list[str | Exception] | None) -> list[Action]:
        return self.receiver.batch_kept(ticket, results)

    def spool_failed(self, key: AsmKey) -> list[Action]:
        return self.receiver.spool_failed(key)

    def tick(self, now: float) -> list[Action]:
        """Remove stale assemblies and forgotten copies."""
        actions = self.receiver.expire(now)
        self.sender.expire(now)
        return actions

    def sizes(self) -> dict[str, int]:
        """The sizes of the queues, for stats (read without the caller's cooperation)."""
        sends = list(self.sender.send.values())
        return {"assemblies": len(self.receiver.asm),
                "sending": self.sender.queued + sum(1 for ps in sends if ps.active is not None),
                "inflight": sum(len(ps.inflight) for ps in sends),
                "copies_waiting": len(self.sender.copies)}

    def busy(self) -> bool:
        """True while anything waits: a send, an acknowledgement, an assembly or a copy."""
        return bool(self.sender.send or self.sender.copies or self.receiver.asm)
