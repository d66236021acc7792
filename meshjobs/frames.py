"""Frames between members: a handshake that proves both ends hold the fleet secret, then sealed
frames.

Theory of operation. Every frame is a fixed header and a payload:

    magic b"MJF2" | type u8 | flags u8 | payload length u32      (10 bytes, big-endian)

A connection opens with three handshake frames, each a msgpack map followed by a 32-byte blake3
MAC keyed with a key derived from the fleet's 32-byte secret (one key per step, so that no step's
MAC can stand in for another's):

    dialler  -> acceptor  F_HELLO      {name, boot, peer, to, wall_ms, nonce: N_d, kx: X_d}
                          MAC(hello)
    acceptor -> dialler   F_CHALLENGE  {name, boot, peer, to, wall_ms, nonce: N_a, kx: X_a}
                          MAC(hello | challenge)
    dialler  -> acceptor  F_PROOF      {}
                          MAC(hello | challenge | proof)

N_d and N_a are fresh random 32-byte nonces, one from each side; X_d and X_a are the public halves
of fresh X25519 keys, one from each side; the caller passes in the random bytes of both. The
challenge's MAC covers the dialler's hello, so it proves to the dialler that the acceptor holds
the secret now (N_d is new); the proof's MAC covers the challenge, so it proves the same of the
dialler (N_a is new). A recorded hello replayed to an acceptor, even one restarted since, earns
nothing but a challenge it cannot answer. Then each side derives two keys, one per direction,
from the secret, the X25519 shared secret of the two fresh keys and the hash of the whole
transcript (both nonces in it). The shared secret gives forward secrecy: someone who records the
traffic and later learns the fleet secret still cannot open it. Every later frame is sealed with
ChaCha20-Poly1305 under its direction's key: the AEAD nonce is the count of frames
sealed before it in that direction, and the header is the associated data. A TCP stream delivers
frames in order, so the receiver expects exactly the next count: a frame replayed, duplicated,
reordered, dropped or taken from another connection fails to open. No clock is read: `wall_ms`
in the hellos is there only so that a receiver can warn about skew.

A `Session` is one end of one connection, in the manner of h11: bytes in with `receive_data`,
events out with `next_event` (None means it needs more bytes, or waits for its caller to answer
a `Hello`), bytes out from `hello`, `challenge`, `proof` and `seal`.

Rule 1: this module does no IO. It imports no os, socket, threading, time or random: the nonces
and the random bytes of the fresh keys come from the caller.
Rule 2: anything wrong with the bytes from outside raises `FrameError(reason)`, the one error
class, and the session is dead from then on (the connection must be closed). A caller's own
mistake (an oversized frame to send, a step out of turn, a bad nonce) raises ValueError,
TypeError or AssertionError.
Rule 3: a session never holds more than one frame's worth of bytes. The header's length is
checked against the limit (`handshake_bytes_max` for handshake frames) before any of the payload
is buffered, so a hostile length costs nothing; a caller feeds at most `room()` bytes at a time.
Rule 4: the states and what each accepts live in one table (`_EXPECT`); a frame of any other type
in a state is refused as `handshake`.
"""

from __future__ import annotations

import enum
import hmac
import struct
from dataclasses import dataclass
from typing import Any

import blake3
import msgpack
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305

from meshjobs import limits

MAGIC = b"MJF2"
# magic, type, flags, payload length.
HEADER = struct.Struct(">4sBBI")
HEADER_BYTES = HEADER.size
MAC_BYTES = 32
TAG_BYTES = 16
NONCE_BYTES = 32
SECRET_BYTES = 32
# The smallest frame: a header, an empty msgpack map (one byte) and a tag.
FRAME_BYTES_MIN = HEADER_BYTES + 1 + TAG_BYTES
KX_BYTES = 32  # an X25519 key, private or public
_COUNTER_MAX = (1 << 64) - 1
_CONTEXT = "meshjobs 2026-12 member links v2 "
# Any fixed private key tells a low-order public key (whose shared secret is zero, whatever the
# private key) from a good one: refused at receipt, so that no later exchange can fail.
_PROBE = X25519PrivateKey.from_private_bytes(bytes(range(KX_BYTES)))


class FrameType(enum.IntEnum):
    """The frame types; the value is the type byte on the wire (never renumber one)."""

    F_HELLO = 1  # dialler -> acceptor, the first frame: who I am, my nonce
    F_JOB_STATE = 2  # leader -> members: committed job table changes
    F_JOB_HAVE = 3  # member -> leader: what the member has and offers
    F_LEASE = 4  # leader -> member: items to run under their lease epochs
    F_RESULT = 5  # member -> leader: item results under a lease epoch
    F_CTL = 6  # member -> leader: a forwarded control request
    F_CTL_REPLY = 7  # leader -> member: its answer
    F_BLOB_GET = 8  # member -> member: asks for blobs by id
    F_BLOB_PUT = 9  # member -> member: carries blob bytes
    F_PING = 10  # keeps an idle connection known to be alive
    F_CHALLENGE = 11  # acceptor -> dialler: who I am, my nonce, proof that I hold the secret
    F_PROOF = 12  # dialler -> acceptor: proof that I hold the secret
    F_VOTERS = 13  # acceptor -> a joining worker that said hello to "*": the fleet's voters
    F_LOG_GET = 14  # member -> member: asks for bytes of a running item's output (`LogAsk`)
    F_LOG_PUT = 15  # member -> member: the answer, bytes of that output (`LogPiece`)
    F_RAFT = 16  # voter -> voter, on the Raft port only: one Raft message (`raftwire`)


HANDSHAKE_TYPES = frozenset({FrameType.F_HELLO, FrameType.F_CHALLENGE, FrameType.F_PROOF})
_TYPES = frozenset(int(t) for t in FrameType)


class FrameError(Exception):
    """Bytes from outside that are not a good frame. `reason` is a short word to count by;
    `claimed` is the name in a hello that failed its MAC (unproven: for the log only)."""

    def __init__(self, reason: str, detail: str = "", claimed: str | None = None) -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail
        self.claimed = claimed


@dataclass(frozen=True, slots=True)
class Frame:
    """One sealed frame, opened."""

    type: FrameType
    body: dict[Any, Any]


@dataclass(frozen=True, slots=True)
class Hello:
    """The other end's hello (to an acceptor) or challenge (to a dialler), its MAC checked. The
    caller decides whether to go on (`challenge` or `proof`) or to close."""

    body: dict[Any, Any]


@dataclass(frozen=True, slots=True)
class Ready:
    """To an acceptor: the dialler proved it holds the secret; frames may flow both ways."""


class Role(enum.Enum):
    DIALLER = "dialler"
    ACCEPTOR = "acceptor"


class State(enum.Enum):
    START = "start"  # dialler: hello not sent yet; acceptor: waiting for the hello
    SENT_HELLO = "sent_hello"  # dialler: waiting for the challenge
    GOT_HELLO = "got_hello"  # acceptor: the caller decides whether to challenge
    GOT_CHALLENGE = "got_challenge"  # dialler: the caller decides whether to prove
    SENT_CHALLENGE = "sent_challenge"  # acceptor: waiting for the proof
    OPEN = "open"  # sealed frames both ways
    DEAD = "dead"  # a FrameError happened: close the connection


# What each state accepts from the other end. None: any sealed (non-handshake) type. A state
# missing here accepts nothing: the peer must wait for us, and a frame then is a violation.
_EXPECT: dict[tuple[Role, State], FrameType | None] = {
    (Role.ACCEPTOR, State.START): FrameType.F_HELLO,
    (Role.DIALLER, State.SENT_HELLO): FrameType.F_CHALLENGE,
    (Role.ACCEPTOR, State.SENT_CHALLENGE): FrameType.F_PROOF,
    (Role.DIALLER, State.OPEN): None,
    (Role.ACCEPTOR, State.OPEN): None,
}


def _check_secret(secret: bytes) -> None:
    if not isinstance(secret, bytes | bytearray) or len(secret) != SECRET_BYTES:
        raise ValueError(f"the fleet secret must be {SECRET_BYTES} bytes")


def _derive(purpose: str, material: bytes) -> bytes:
    return blake3.blake3(material, derive_key_context=_CONTEXT + purpose).digest()


def _mac(key: bytes, *parts: bytes) -> bytes:
    h = blake3.blake3(key=key)
    for p in parts:
        h.update(p)
    return h.digest()


def pack(body: dict[Any, Any]) -> bytes:
    """A frame body as msgpack (a map)."""
    if not isinstance(body, dict):
        raise TypeError(f"a frame body is a dict, not {type(body).__name__}")
    return msgpack.packb(body, use_bin_type=True)


def sealed_bytes(packed_len: int) -> int:
    """The size on the wire of a sealed frame whose packed body has `packed_len` bytes."""
    return HEADER_BYTES + packed_len + TAG_BYTES


class Session:
    """One end of one member link. See the module's rules.

    `frame_bytes_max` bounds every frame both ways; `handshake_bytes_max` bounds the handshake
    frames, which are small.
    """

    def __init__(self, secret: bytes, role: Role,
                 frame_bytes_max: int = limits.frame_bytes_max,
                 handshake_bytes_max: int = limits.link_handshake_bytes_max) -> None:
        _check_secret(secret)
        if frame_bytes_max < FRAME_BYTES_MIN or handshake_bytes_max < FRAME_BYTES_MIN:
            raise ValueError(f"frame limits must be at least {FRAME_BYTES_MIN}")
        self._secret = bytes(secret)
        self.role = Role(role)
        self.state = State.START
        self.frame_bytes_max = frame_bytes_max
        self.handshake_bytes_max = min(handshake_bytes_max, frame_bytes_max)
        self._buf = bytearray()
        self._error: FrameError | None = None
        self._transcript: list[bytes] = []  # the handshake frames, whole, in order
        self._nonce: bytes | None = None  # ours
        self._kx: X25519PrivateKey | None = None  # our fresh key
        self._peer_kx: X25519PublicKey | None = None  # the other end's
        self._send_aead: ChaCha20Poly1305 | None = None
        self._recv_aead: ChaCha20Poly1305 | None = None
        self.sent = 0  # sealed frames sent: the next one's AEAD nonce
        self.received = 0  # sealed frames opened: the next one's AEAD nonce

    # --- bytes in --------------------------------------------------------------------------

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
            raise ValueError(f"{len(data)} bytes fed to a session with room for {self.room()}")
        self._buf += data

    def _fail(self, reason: str, detail: str = "", claimed: str | None = None) -> FrameError:
        self._error = FrameError(reason, detail, claimed)
        self.state = State.DEAD
        self._buf = bytearray()
        return self._error

    def next_event(self) -> Hello | Ready | Frame | None:
        """The next event, None if more bytes are needed (or the caller must answer a Hello
        first), or FrameError."""
        if self._error is not None:
            raise self._error
        buf = self._buf
        have = len(buf)
        # Refuse a bad magic as soon as its first wrong byte arrives.
        if bytes(buf[: min(have, len(MAGIC))]) != MAGIC[: min(have, len(MAGIC))]:
            raise self._fail("magic")
        if have == 0:
            return None
        key = (self.role, self.state)
        if key not in _EXPECT:
            raise self._fail("handshake", f"bytes before our turn is done in {self.state.value}")
        if have < HEADER_BYTES:
            return None
        _, ftype, flags, length = HEADER.unpack_from(buf, 0)
        if ftype not in _TYPES:
            raise self._fail("type", str(ftype))
        if flags != 0:
            raise self._fail("flags", str(flags))
        ftype = FrameType(ftype)
        expect = _EXPECT[key]
        if expect is None and ftype in HANDSHAKE_TYPES or expect is not None and ftype != expect:
            raise self._fail("handshake", f"{ftype.name} in {self.state.value}")
        size = HEADER_BYTES + length
        size_max = self.frame_bytes_max if expect is None else self.handshake_bytes_max
        if size > size_max:
            raise self._fail("length", f"{size} > {size_max}")
        if have < size:
            return None
        with memoryview(buf) as view:
            frame = bytes(view[:size])  # one copy; the view is released before the delete
        del buf[:size]
        if expect is None:
            return self._open(ftype, frame)
        return self._handshake(ftype, frame)

    def _open(self, ftype: FrameType, frame: bytes) -> Frame:
        assert self._recv_aead is not None
        if len(frame) < HEADER_BYTES + TAG_BYTES:
            raise self._fail("aead", "shorter than a tag")
        try:
            packed = self._recv_aead.decrypt(self._aead_nonce(self.received),
                                             memoryview(frame)[HEADER_BYTES:],
                                             frame[:HEADER_BYTES])
        except InvalidTag:
            raise self._fail("aead", f"frame {self.received} does not open") from None
        body = _unpack_body(packed, self.frame_bytes_max)
        if body is None:
            raise self._fail("body")
        self.received += 1
        return Frame(ftype, body)

    def _handshake(self, ftype: FrameType, frame: bytes) -> Hello | Ready:
        if len(frame) < HEADER_BYTES + 1 + MAC_BYTES:
            raise self._fail("length", "a handshake frame too short for its MAC")
        signed, mac = frame[:-MAC_BYTES], frame[-MAC_BYTES:]
        good = _mac(self._mac_key(ftype), *self._transcript, signed)
        if not hmac.compare_digest(mac, good):
            # A wrong secret shows at the first step; a replayed or spliced handshake later.
            reason = {FrameType.F_HELLO: "mac", FrameType.F_CHALLENGE: "challenge",
                      FrameType.F_PROOF: "proof"}[ftype]
            # Whom the frame claims to come from helps an operator find a member with the
            # wrong secret; it proves nothing.
            claimed = (_unpack_body(signed[HEADER_BYTES:], self.handshake_bytes_max)
                       or {}).get("name")
            raise self._fail(reason, "the MAC does not match",
                             claimed[:64] if isinstance(claimed, str) else None)
        body = _unpack_body(signed[HEADER_BYTES:], self.handshake_bytes_max)
        if body is None:
            raise self._fail("body")
        self._transcript.append(frame)
        if ftype == FrameType.F_PROOF:
            if body:
                raise self._fail("handshake", "a proof's body must be an empty map")
            self._open_keys()
            self.state = State.OPEN
            return Ready()
        nonce = body.pop("nonce", None)
        if not isinstance(nonce, bytes) or len(nonce) != NONCE_BYTES:
            raise self._fail("handshake", f"no {NONCE_BYTES}-byte nonce")
        if nonce == self._nonce:
            # Our own nonce coming back is a reflection, never a peer's fresh one.
            raise self._fail("handshake", "our own nonce")
        kx = body.pop("kx", None)
        if not isinstance(kx, bytes) or len(kx) != KX_BYTES:
            raise self._fail("handshake", f"no {KX_BYTES}-byte key")
        try:
            self._peer_kx = X25519PublicKey.from_public_bytes(kx)
            _PROBE.exchange(self._peer_kx)
        except ValueError:
            raise self._fail("handshake", "a low-order key") from None
        self.state = State.GOT_HELLO if ftype == FrameType.F_HELLO else State.GOT_CHALLENGE
        return Hello(body)

    # --- bytes out -------------------------------------------------------------------------

    def hello(self, body: dict[str, Any], nonce: bytes, kx: bytes) -> bytes:
        """The dialler's first frame: `body` (name, boot, peer, to, wall_ms) with our nonce and
        the public half of our fresh key. `nonce` and `kx` (the private key) are 32 random
        bytes each, new for this session."""
        _check_fresh(body, nonce, kx)
        self._step(Role.DIALLER, State.START, State.SENT_HELLO)
        return self._signed(FrameType.F_HELLO, body, nonce, kx)

    def challenge(self, body: dict[str, Any], nonce: bytes, kx: bytes) -> bytes:
        """The acceptor's answer to a good Hello: our own hello fields with our nonce and key,
        32 random bytes each, new for this session."""
        _check_fresh(body, nonce, kx)
        self._step(Role.ACCEPTOR, State.GOT_HELLO, State.SENT_CHALLENGE)
        return self._signed(FrameType.F_CHALLENGE, body, nonce, kx)

    def proof(self) -> bytes:
        """The dialler's answer to a good challenge; the session is open once it is sent."""
        self._step(Role.DIALLER, State.GOT_CHALLENGE, State.OPEN)
        data = self._signed(FrameType.F_PROOF, {}, None, None)
        self._open_keys()
        return data

    def seal(self, ftype: FrameType, body: dict[Any, Any]) -> bytes:
        """One sealed frame. Raises ValueError if it would exceed `frame_bytes_max`."""
        return self.seal_packed(ftype, pack(body))

    def seal_packed(self, ftype: FrameType, packed: bytes) -> bytes:
        """One sealed frame of a body already packed (see `pack`)."""
        if self.state is not State.OPEN:
            raise AssertionError(f"seal in state {self.state.value}")
        ftype = FrameType(ftype)
        if ftype in HANDSHAKE_TYPES:
            raise ValueError(f"{ftype.name} is not sealed")
        size = sealed_bytes(len(packed))
        if size > self.frame_bytes_max:
            raise ValueError(f"frame of {size} bytes exceeds frame_bytes_max="
                             f"{self.frame_bytes_max}")
        assert self._send_aead is not None and self.sent < _COUNTER_MAX
        header = HEADER.pack(MAGIC, int(ftype), 0, len(packed) + TAG_BYTES)
        sealed = self._send_aead.encrypt(self._aead_nonce(self.sent), packed, header)
        self.sent += 1
        return header + sealed

    # --- inside ------------------------------------------------------------------------------

    def _step(self, role: Role, before: State, after: State) -> None:
        if self.role is not role or self.state is not before:
            raise AssertionError(f"{self.role.value} in {self.state.value} cannot do this")
        self.state = after

    def _signed(self, ftype: FrameType, body: dict[str, Any], nonce: bytes | None,
                kx: bytes | None) -> bytes:
        if nonce is not None:
            assert kx is not None
            self._nonce = nonce
            self._kx = X25519PrivateKey.from_private_bytes(kx)
            body = {**body, "nonce": nonce, "kx": self._kx.public_key().public_bytes_raw()}
        packed = pack(body)
        size = HEADER_BYTES + len(packed) + MAC_BYTES
        if size > self.handshake_bytes_max:
            raise ValueError(f"handshake frame of {size} bytes exceeds {self.handshake_bytes_max}")
        signed = HEADER.pack(MAGIC, int(ftype), 0, len(packed) + MAC_BYTES) + packed
        frame = signed + _mac(self._mac_key(ftype), *self._transcript, signed)
        self._transcript.append(frame)
        return frame

    def _mac_key(self, ftype: FrameType) -> bytes:
        return _derive(f"{ftype.name} mac", self._secret)

    def _open_keys(self) -> None:
        # Both keys depend on the secret, on the fresh keys' shared secret and on the whole
        # transcript, both nonces included.
        assert self._kx is not None and self._peer_kx is not None
        shared = self._kx.exchange(self._peer_kx)  # checked at receipt: cannot fail
        material = (self._secret + shared
                    + blake3.blake3(b"".join(self._transcript)).digest())
        to_acceptor = ChaCha20Poly1305(_derive("dialler to acceptor", material))
        to_dialler = ChaCha20Poly1305(_derive("acceptor to dialler", material))
        self._transcript = []
        self._kx = self._peer_kx = None
        if self.role is Role.DIALLER:
            self._send_aead, self._recv_aead = to_acceptor, to_dialler
        else:
            self._send_aead, self._recv_aead = to_dialler, to_acceptor

    @staticmethod
    def _aead_nonce(counter: int) -> bytes:
        return counter.to_bytes(12, "big")


def _check_fresh(body: dict[str, Any], nonce: bytes, kx: bytes) -> None:
    if not isinstance(nonce, bytes) or len(nonce) != NONCE_BYTES:
        raise ValueError(f"a nonce is {NONCE_BYTES} bytes")
    if not isinstance(kx, bytes) or len(kx) != KX_BYTES:
        raise ValueError(f"a key is {KX_BYTES} random bytes")
    if "nonce" in body or "kx" in body:
        raise ValueError("the session adds the nonce and the key itself")


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


# --- Live item output: the bodies of F_LOG_GET and F_LOG_PUT ----------------------------------
#
# A member serving `GET /jobs/{id}/items/{n}/stdout` for an item that runs on another member
# asks that member for the bytes written so far to the item's spool file, from an offset; the
# answer carries at most `log_frame_bytes_max` of them and says whether the output is complete.
# These functions check a body field by field; anything else raises FrameError("body", why).
# Keys a body has beyond these are ignored (a newer member may add some).

LOG_STREAMS = ("stdout", "stderr")
# Why an F_LOG_PUT carries no bytes: "unknown" the member runs no such item under that lease
# epoch now (ended and its output stored, or leased elsewhere); "unavailable" the run is there
# but its output cannot be read while it runs (a python item, a command not spawned yet, a read
# error).
LOG_ERRORS = ("unknown", "unavailable")
_U63 = (1 << 63) - 1


@dataclass(frozen=True, slots=True)
class LogAsk:
    """F_LOG_GET: `size` bytes (at most) of an item's `stream` from `offset`, of the run of
    (`job`, `index`) under lease `epoch`; `q` is the asker's id of the request."""

    q: int
    job: str
    index: int
    epoch: int
    stream: str
    offset: int
    size: int


@dataclass(frozen=True, slots=True)
class LogPiece:
    """F_LOG_PUT: the answer to the ask `q`: `data` from its offset, `end` when `data` reaches
    the end of the item's whole output (the run has ended), or `error` (one of LOG_ERRORS) and
    no data."""

    q: int
    data: bytes
    end: bool
    error: str | None = None


def _int_in(body: dict[Any, Any], key: str, lo: int, hi: int) -> int:
    v = body.get(key)
    if type(v) is not int or not lo <= v <= hi:
        raise FrameError("body", f"{key} must be an integer from {lo} to {hi}")
    return v


def log_ask_body(a: LogAsk) -> dict[str, Any]:
    """The body of an F_LOG_GET. A field out of its range is the caller's bug (ValueError)."""
    body = {"q": a.q, "j": a.job, "i": a.index, "e": a.epoch, "s": a.stream, "o": a.offset,
            "n": a.size}
    try:
        parse_log_ask(body)
    except FrameError as e:
        raise ValueError(f"not a good F_LOG_GET: {e.detail}") from None
    return body


def parse_log_ask(body: Any) -> LogAsk:
    """An F_LOG_GET body from a peer, checked; FrameError("body") if it is not a good one."""
    if not isinstance(body, dict):
        raise FrameError("body", "an F_LOG_GET body is a map")
    job = body.get("j")
    if (not isinstance(job, str) or not 1 <= len(job) <= limits.job_id_chars_max
            or not job.isascii() or not job.isprintable()):
        raise FrameError("body", f"j must be a job id of 1 to {limits.job_id_chars_max} "
                                 "printable ASCII characters")
    stream = body.get("s")
    if stream not in LOG_STREAMS:
        raise FrameError("body", "s must be stdout or stderr")
    return LogAsk(_int_in(body, "q", 0, _U63), job, _int_in(body, "i", 0, limits.items_max - 1),
                  _int_in(body, "e", 0, _U63), stream,
                  _int_in(body, "o", 0, limits.log_offset_bytes_max),
                  _int_in(body, "n", 1, limits.log_frame_bytes_max))


def log_piece_body(p: LogPiece) -> dict[str, Any]:
    """The body of an F_LOG_PUT. A field out of its range is the caller's bug (ValueError)."""
    body = {"q": p.q, "data": p.data, "end": p.end, "err": p.error}
    try:
        parse_log_piece(body)
    except FrameError as e:
        raise ValueError(f"not a good F_LOG_PUT: {e.detail}") from None
    return body


def parse_log_piece(body: Any) -> LogPiece:
    """An F_LOG_PUT body from a peer, checked; FrameError("body") if it is not a good one."""
    if not isinstance(body, dict):
        raise FrameError("body", "an F_LOG_PUT body is a map")
    q = _int_in(body, "q", 0, _U63)
    data, end, err = body.get("data"), body.get("end"), body.get("err")
    if not isinstance(data, bytes) or len(data) > limits.log_frame_bytes_max:
        raise FrameError("body", f"data must be at most {limits.log_frame_bytes_max} bytes")
    if type(end) is not bool:
        raise FrameError("body", "end must be true or false")
    if err is not None and err not in LOG_ERRORS:
        raise FrameError("body", f"err must be nil or one of {', '.join(LOG_ERRORS)}")
    if err is not None and (data or end):
        raise FrameError("body", "an answer with an error carries no data and no end")
    return LogPiece(q, data, end, err)


# --- Bodies too large for one frame: parts, and putting them back together --------------------
#
# A body whose msgpack is larger than `limits.frame_part_bytes` (a table snapshot, a large
# batch of committed entries) travels as a run of frames of its own type, each body
# {seq, part, parts, data}: `data` is the `part`-th slice of the packed body, `parts` how many
# slices there are, `seq` the sender's number for this body. `Chunker` cuts a packed body into
# part bodies; `Assembler` puts them back together, per (peer, seq). Both do no IO.
#
# Rule 5: an assembler holds at most `frame_assemblies_max` bodies at once (the oldest goes
# first), each of at most `frame_parts_max` parts of at most `frame_part_bytes` bytes; a part
# that is not a good one raises `FrameError("parts", why)` and drops its body's other parts.


def is_part(body: Any) -> bool:
    """True when a frame body is one part of a body sent in parts (it has a `parts` field)."""
    return isinstance(body, dict) and "parts" in body


class Chunker:
    """Cuts packed bodies too large for one frame into part bodies, numbering each body."""

    def __init__(self, part_bytes: int = limits.frame_part_bytes,
                 parts_max: int = limits.frame_parts_max) -> None:
        if part_bytes < 1 or parts_max < 1:
            raise ValueError("part_bytes and parts_max must be at least 1")
        self.part_bytes = part_bytes
        self.parts_max = parts_max
        self._seq = 0  # the last body's number (the first is 1)

    def fits(self, packed: bytes) -> bool:
        """True when `packed` goes whole, in one frame."""
        return len(packed) <= self.part_bytes

    def split(self, packed: bytes) -> list[dict[str, Any]]:
        """The part bodies of `packed`, in order. A body that would take more than `parts_max`
        parts raises ValueError (our own body too large: the caller drops it, loudly); no
        number is used up then."""
        size = self.part_bytes
        parts = -(-len(packed) // size)
        if parts > self.parts_max:
            raise ValueError(f"a body of {len(packed)} bytes needs {parts} parts, more than "
                             f"frame_parts_max={self.parts_max}")
        self._seq += 1
        return [{"seq": self._seq, "part": k, "parts": parts,
                 "data": packed[k * size:(k + 1) * size]} for k in range(parts)]


class Assembler:
    """Puts bodies sent in parts back together (see Rule 5). `add` gives the whole body once
    its last part is in, None before; `dropped` counts the parts refused, by reason."""

    def __init__(self, part_bytes: int = limits.frame_part_bytes,
                 parts_max: int = limits.frame_parts_max,
                 assemblies_max: int = limits.frame_assemblies_max) -> None:
        self.part_bytes = part_bytes
        self.parts_max = parts_max
        self.assemblies_max = assemblies_max
        # (peer, seq) -> (parts, the parts in so far, bytes in so far); oldest first.
        self._parts: dict[tuple[str, int], tuple[int, list[bytes | None], int]] = {}
        self.dropped: dict[str, int] = {}

    def __len__(self) -> int:
        """Bodies being put back together now."""
        return len(self._parts)

    def add(self, peer: str, body: Any) -> Any:
        """One part from `peer`: the whole body (unpacked) once every part is in, else None.
        A part that is not good raises FrameError("parts")."""
        try:
            return self._add(peer, body)
        except FrameError as e:
            self.dropped[e.detail] = self.dropped.get(e.detail, 0) + 1
            raise

    def _add(self, peer: str, body: Any) -> Any:
        if not isinstance(body, dict):
            raise FrameError("parts", "not_map")
        seq, part, parts, data = body.get("seq"), body.get("part"), body.get("parts"), body.get("data")
        if not (type(seq) is int and type(part) is int and type(parts) is int
                and isinstance(data, bytes) and 0 <= part < parts <= self.parts_max):
            raise FrameError("parts", "fields")
        if len(data) > self.part_bytes:
            raise FrameError("parts", "size")
        key = (peer, seq)
        if key not in self._parts:
            if len(self._parts) >= self.assemblies_max:
                self._parts.pop(next(iter(self._parts)))
            self._parts[key] = (parts, [None] * parts, 0)
        n, chunks, size = self._parts[key]
        if n != parts or chunks[part] is not None:
            del self._parts[key]
            raise FrameError("parts", "mismatch")
        chunks[part] = data
        size += len(data)
        self._parts[key] = (n, chunks, size)
        if any(c is None for c in chunks):
            return None
        del self._parts[key]
        try:
            return msgpack.unpackb(b"".join(chunks), raw=False, strict_map_key=False)  # type: ignore[arg-type]
        except Exception:  # msgpack raises many classes for garbage; all mean "not a body"
            raise FrameError("parts", "body") from None
