"""Frames between members: encoding, decoding, authentication and replay protection.

Theory of operation. A frame is a fixed header, a msgpack body and a MAC:

    magic b"MJF1" | type u8 | flags u8 | body length u32 | sent_ms u64 | nonce 16 bytes
    body (msgpack map, `length` bytes)
    MAC: 32 bytes, blake3 keyed with the fleet's 32-byte secret, over header + body

All integers are big-endian. `encode` turns a type and a body into bytes; a `FrameDecoder` is fed
bytes with `receive_data` and hands out `Frame`s with `next_frame` (None means it needs more
bytes), in the manner of h11.

Rule 1: this module does no IO. It imports no os, socket, threading, time or random: the clock
(`now_ms`) and the nonces are passed in by the caller.
Rule 2: anything wrong with the bytes from outside raises `FrameError(reason)`, the one error
class, and the decoder is dead from then on (the connection must be closed). A caller's own
mistake (an oversized frame to send, a bad nonce length) raises ValueError or TypeError.
Rule 3: the decoder never holds more than one frame's worth of bytes. The header's length is
checked against the limit before any of the body is buffered, so a hostile length costs nothing;
a caller feeds at most `room()` bytes at a time.
Rule 4: a frame is accepted only if its MAC is right, its sent_ms is within
±`frame_clock_skew_ms_max` of the receiver's clock, its body is a msgpack map, and its nonce has
not been seen before (a `NonceCache`, shared by all the decoders of one receiving member).
"""

from __future__ import annotations

import enum
import hmac
import struct
from dataclasses import dataclass
from typing import Any

import blake3
import msgpack

from meshjobs import limits

MAGIC = b"MJF1"
# magic, type, flags, body length, sent_ms, nonce.
HEADER = struct.Struct(">4sBBIQ16s")
HEADER_BYTES = HEADER.size
MAC_BYTES = 32
NONCE_BYTES = 16
SECRET_BYTES = 32
# The smallest frame: a header, an empty msgpack map (one byte) and the MAC.
FRAME_BYTES_MIN = HEADER_BYTES + 1 + MAC_BYTES
_U64_MAX = (1 << 64) - 1
# Nonces are remembered in buckets of one second of sent_ms; see NonceCache.
_BUCKET_MS = 1000


class FrameType(enum.IntEnum):
    """The frame types; the value is the type byte on the wire (never renumber one)."""

    F_HELLO = 1  # the first frame on a connection, both ways: who I am
    F_JOB_STATE = 2  # leader -> members: committed job table changes
    F_JOB_HAVE = 3  # member -> leader: what the member has and offers
    F_LEASE = 4  # leader -> member: items to run under their lease epochs
    F_RESULT = 5  # member -> leader: item results under a lease epoch
    F_CTL = 6  # member -> leader: a forwarded control request
    F_CTL_REPLY = 7  # leader -> member: its answer
    F_BLOB_GET = 8  # member -> member: asks for blobs by id
    F_BLOB_PUT = 9  # member -> member: carries blob bytes
    F_PING = 10  # keeps an idle connection known to be alive


_TYPES = frozenset(int(t) for t in FrameType)


class FrameError(Exception):
    """Bytes from outside that are not a good frame. `reason` is a short word to count by."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True, slots=True)
class Frame:
    """One decoded, authenticated, fresh frame."""

    type: FrameType
    body: dict[Any, Any]
    sent_ms: int
    nonce: bytes


def _check_secret(secret: bytes) -> None:
    if not isinstance(secret, bytes | bytearray) or len(secret) != SECRET_BYTES:
        raise ValueError(f"the fleet secret must be {SECRET_BYTES} bytes")


def _mac(secret: bytes, header: bytes, body: bytes) -> bytes:
    h = blake3.blake3(key=bytes(secret))
    h.update(header)
    h.update(body)
    return h.digest()


def encode(ftype: FrameType, body: dict[Any, Any], secret: bytes, now_ms: int,
           nonce: bytes, frame_bytes_max: int = limits.frame_bytes_max) -> bytes:
    """The bytes of one frame. Raises ValueError if it would exceed `frame_bytes_max`.

    An oversized frame is the sender's own bug: callers size their batches, so this is not a
    FrameError (which is reserved for bytes from outside).
    """
    ftype = FrameType(ftype)
    if not isinstance(body, dict):
        raise TypeError(f"a frame body is a dict, not {type(body).__name__}")
    if not isinstance(nonce, bytes) or len(nonce) != NONCE_BYTES:
        raise ValueError(f"a nonce is {NONCE_BYTES} bytes")
    if not 0 <= now_ms <= _U64_MAX:
        raise ValueError(f"now_ms out of range: {now_ms}")
    _check_secret(secret)
    packed = msgpack.packb(body, use_bin_type=True)
    size = HEADER_BYTES + len(packed) + MAC_BYTES
    if size > frame_bytes_max:
        raise ValueError(f"frame of {size} bytes exceeds frame_bytes_max={frame_bytes_max}")
    header = HEADER.pack(MAGIC, int(ftype), 0, len(packed), now_ms, nonce)
    return b"".join((header, packed, _mac(secret, header, packed)))


class NonceCache:
    """The nonces of recently accepted frames, to refuse a frame seen before (a replay).

    Nonces are kept in buckets by their frame's sent_ms (one bucket per second), so a replay,
    which carries the same authenticated sent_ms, is looked up in one bucket. A bucket is dropped
    once all its frames would be refused as stale anyway, or, when the cache is full, oldest
    first. Either way `floor_ms` rises past the dropped bucket and frames sent before the floor
    are refused from then on: the cache cannot prove they are new. The floor never goes down, so
    a receiver's clock stepping back does not reopen old nonces.
    """

    def __init__(self, entries_max: int = limits.nonce_cache_max,
                 window_ms: int = limits.frame_clock_skew_ms_max) -> None:
        if entries_max < 1 or window_ms < 0:
            raise ValueError("a nonce cache needs room for one entry and a window >= 0")
        self.entries_max = entries_max
        self.window_ms = window_ms
        self.floor_ms = 0
        self._buckets: dict[int, set[bytes]] = {}
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def _drop_oldest(self) -> None:
        oldest = min(self._buckets)
        self._count -= len(self._buckets.pop(oldest))
        self.floor_ms = max(self.floor_ms, (oldest + 1) * _BUCKET_MS)

    def admit(self, nonce: bytes, sent_ms: int, now_ms: int) -> bool:
        """True, and remembered, if this nonce is new; False if it may be a replay."""
        # Drop the buckets whose every frame is now older than the window.
        while self._buckets and (min(self._buckets) + 1) * _BUCKET_MS <= now_ms - self.window_ms:
            self._drop_oldest()
        if sent_ms < self.floor_ms:
            return False
        bucket = sent_ms // _BUCKET_MS
        seen = self._buckets.get(bucket)
        if seen is not None and nonce in seen:
            return False
        while self._count >= self.entries_max:
            self._drop_oldest()
        if sent_ms < self.floor_ms:
            # The cache was full of frames no older than this one.
            return False
        self._buckets.setdefault(bucket, set()).add(bytes(nonce))
        self._count += 1
        return True


class FrameDecoder:
    """Bytes in (`receive_data`), frames out (`next_frame`). See the module's rules."""

    def __init__(self, secret: bytes, frame_bytes_max: int = limits.frame_bytes_max,
                 nonces: NonceCache | None = None,
                 skew_ms_max: int = limits.frame_clock_skew_ms_max) -> None:
        _check_secret(secret)
        if frame_bytes_max < FRAME_BYTES_MIN:
            raise ValueError(f"frame_bytes_max must be at least {FRAME_BYTES_MIN}")
        self._secret = bytes(secret)
        self.frame_bytes_max = frame_bytes_max
        self.nonces = nonces if nonces is not None else NonceCache(window_ms=skew_ms_max)
        self.skew_ms_max = skew_ms_max
        self._buf = bytearray()
        self._error: FrameError | None = None

    @property
    def buffered(self) -> int:
        """Bytes held that are not yet a whole frame (at most frame_bytes_max)."""
        return len(self._buf)

    @property
    def dead(self) -> bool:
        return self._error is not None

    def room(self) -> int:
        """How many more bytes `receive_data` accepts now."""
        return self.frame_bytes_max - len(self._buf)

    def receive_data(self, data: bytes | bytearray | memoryview) -> None:
        """Buffer bytes from the connection. More than `room()` is the caller's bug."""
        if len(data) > self.room():
            raise ValueError(f"{len(data)} bytes fed to a decoder with room for {self.room()}")
        self._buf += data

    def _fail(self, reason: str, detail: str = "") -> FrameError:
        self._error = FrameError(reason, detail)
        self._buf = bytearray()
        return self._error

    def next_frame(self, now_ms: int) -> Frame | None:
        """The next good frame, None if more bytes are needed, or FrameError."""
        if self._error is not None:
            raise self._error
        buf = self._buf
        have = len(buf)
        # Refuse a bad magic as soon as its first wrong byte arrives.
        if bytes(buf[: min(have, len(MAGIC))]) != MAGIC[: min(have, len(MAGIC))]:
            raise self._fail("magic")
        if have < HEADER_BYTES:
            return None
        _, ftype, flags, length, sent_ms, nonce = HEADER.unpack_from(buf, 0)
        if ftype not in _TYPES:
            raise self._fail("type", str(ftype))
        if flags != 0:
            raise self._fail("flags", str(flags))
        size = HEADER_BYTES + length + MAC_BYTES
        if size > self.frame_bytes_max:
            raise self._fail("length", f"{size} > {self.frame_bytes_max}")
        if have < size:
            return None
        header = bytes(buf[:HEADER_BYTES])
        packed = bytes(buf[HEADER_BYTES:HEADER_BYTES + length])
        mac = bytes(buf[HEADER_BYTES + length:size])
        good_mac = hmac.compare_digest(mac, _mac(self._secret, header, packed))
        if not good_mac:
            raise self._fail("mac")
        if abs(sent_ms - now_ms) > self.skew_ms_max:
            raise self._fail("clock", f"sent_ms={sent_ms} now_ms={now_ms}")
        body = _unpack_body(packed, self.frame_bytes_max)
        if body is None:
            raise self._fail("body")
        if not self.nonces.admit(nonce, sent_ms, now_ms):
            raise self._fail("replay")
        del buf[:size]
        return Frame(FrameType(ftype), body, sent_ms, nonce)


def _unpack_body(packed: bytes, size_max: int) -> dict[Any, Any] | None:
    """The body as a dict, or None if it is not one msgpack map."""
    try:
        body = msgpack.unpackb(
            packed, raw=False, strict_map_key=False, use_list=True,
            max_str_len=size_max, max_bin_len=size_max, max_array_len=size_max,
            max_map_len=size_max, max_ext_len=size_max)
    # msgpack raises many classes for garbage (ExtraData, FormatError, StackError, ValueError,
    # UnicodeDecodeError, TypeError for an unhashable key); all of them mean "not a body".
    except Exception:
        return None
    return body if isinstance(body, dict) else None
