"""The sending half of the blob transfer protocol: copies asked, the blobs waiting for each
peer, the window of blobs sent and not yet acknowledged, the larger blob being streamed."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from itertools import islice
from typing import Any

from blobstore.digest import is_digest
from meshjobs.blobxfer.wire import (
    Action,
    CopyDone,
    OutKey,
    Send,
    SendFrames,
    Source,
    Tally,
    XferError,
    XferLimits,
    owner_ok,
    pieces,
)


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
