"""What crosses the edge of the blob transfer protocol (see the package's docstring): its one
error class, its limits, the store port it reads through, the actions it returns, and the
helpers for frame bodies."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

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


class Quiet:
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


def ack(peer: str, owner: str | None, digests: list[str]) -> Send:
    """An acknowledgement of `digests` (durable here, pinned for `owner`) to `peer`."""
    return Send(peer, {"ack": digests, "o": owner}, ("acks_sent", len(digests)))
