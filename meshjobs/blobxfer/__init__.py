"""The blob transfer protocol between members, with no IO (sans-IO, after h11).

Theory of operation. A result's output blobs must be durable on `blob_copies` members before the
result is proposed, and any member must serve any committed blob. Two frame types carry blobs:

- F_BLOB_PUT carries one chunk of one blob, `{"d", "o", "size", "off", "data", "last"}` (plus
  `"get": True` when it answers a fetch); a pack of whole blobs of one chunk each,
  `{"blobs": [[d, o, data], ...]}` (at most `frame_bytes` of data); an acknowledgement of one
  or many blobs, `{"ack": [d, ...], "o"}`; or a holder's `{"d", "missing": True}`.
- F_BLOB_GET `{"d"}` asks a peer for a blob; a holder answers with its chunks.

One `Transfer` per member holds both halves: the `Sender` (send.py: copies asked, the blobs
waiting for each peer, the window of blobs sent and not yet acknowledged, the larger blob being
streamed) and the `Receiver` (recv.py: the blobs being assembled, the small blobs waiting to be
stored together); wire.py holds what crosses the edge (limits, the `Source`, the actions).
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

from collections.abc import Callable, Mapping
from typing import Any

from blobstore.digest import is_digest
from meshjobs.blobxfer.recv import Receiver
from meshjobs.blobxfer.send import Sender
from meshjobs.blobxfer.wire import (
    ACK_DIGESTS,
    Action,
    AsmKey,
    CopyDone,
    Found,
    Keep,
    KeepBatch,
    OutKey,
    PeerMissing,
    Quiet,
    Send,
    SendFrames,
    Source,
    SpoolWrite,
    Staged,
    Tally,
    Unspool,
    XferError,
    XferLimits,
    ack,
    body_bytes,
    check_copy,
    owner_ok,
    pieces,
)

__all__ = [
    "ACK_DIGESTS", "Action", "AsmKey", "CopyDone", "Found", "Keep", "KeepBatch", "OutKey",
    "PeerMissing", "Receiver", "Send", "SendFrames", "Sender", "Source", "SpoolWrite", "Staged",
    "Tally", "Transfer", "Unspool", "XferError", "XferLimits", "ack", "body_bytes",
    "check_copy", "owner_ok", "pieces",
]


class Transfer:
    """One member's side of every blob transfer: a `Sender` and a `Receiver` fed the same
    frames. Not thread-safe: one thread (the mover's, or the simulator) calls it."""

    def __init__(self, src: Source, lim: XferLimits | None = None, tally: Tally | None = None,
                 log: Any = None, receiver_cls: type[Receiver] = Receiver) -> None:
        self.lim = lim if lim is not None else XferLimits()
        self.tally = tally if tally is not None else Tally()
        log = log if log is not None else Quiet()
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
