"""Frames between members: the pure handshake, sealing and opening, and their refusals."""

from __future__ import annotations

import ast
import itertools
import struct

import blake3
import msgpack
import pytest
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from hypothesis import given, settings
from hypothesis import strategies as st

from meshjobs import frames, limits
from meshjobs.frames import (
    HEADER,
    HEADER_BYTES,
    KX_BYTES,
    MAC_BYTES,
    MAGIC,
    NONCE_BYTES,
    TAG_BYTES,
    Frame,
    FrameError,
    FrameType,
    Hello,
    Ready,
    Role,
    Session,
    State,
)

SECRET = bytes(range(32))
OTHER = bytes(range(1, 33))
_counter = itertools.count(1)


def nonce() -> bytes:
    """A fresh nonce (a counter: deterministic, never repeated within a test run)."""
    return next(_counter).to_bytes(NONCE_BYTES, "big")


def key() -> bytes:
    """Bytes for a fresh X25519 key: a hashed counter (X25519 clears a key's low bits, so
    consecutive counters would make the same key)."""
    return blake3.blake3(next(_counter).to_bytes(8, "big")).digest()


def hello_body(name: str = "d", to: str = "a") -> dict:
    return {"name": name, "boot": "b1", "peer": "127.0.0.1:1", "to": to, "wall_ms": 0}


def feed(s: Session, data: bytes):
    """Feed bytes and return the first event (or None)."""
    s.receive_data(data)
    return s.next_event()


def reason(s: Session, data: bytes) -> str:
    with pytest.raises(FrameError) as e:
        s.receive_data(data)
        while s.next_event() is not None:
            pass
    assert s.dead and s.state is State.DEAD
    return e.value.reason


class Handshake:
    """A full handshake between two sessions, keeping every frame that crossed."""

    def __init__(self, dsecret: bytes = SECRET, asecret: bytes = SECRET, **kw) -> None:
        self.d = Session(dsecret, Role.DIALLER, **kw)
        self.a = Session(asecret, Role.ACCEPTOR, **kw)
        self.hello = self.d.hello(hello_body(), nonce(), key())
        ev = feed(self.a, self.hello)
        assert ev == Hello(hello_body())
        self.challenge = self.a.challenge(hello_body("a", "d"), nonce(), key())
        ev = feed(self.d, self.challenge)
        assert ev == Hello(hello_body("a", "d"))
        self.proof = self.d.proof()
        assert feed(self.a, self.proof) == Ready()


def receiver_copy(s: Session) -> Session:
    """A session that opens what `s` would open next (same keys, same count)."""
    c = Session(SECRET, Role.ACCEPTOR)
    c.state, c._recv_aead, c.received = State.OPEN, s._recv_aead, s.received
    return c


def opened(s: Session, data: bytes) -> list[Frame]:
    s.receive_data(data)
    out = []
    while (ev := s.next_event()) is not None:
        out.append(ev)
    return out


# --- the handshake -----------------------------------------------------------------------------

def test_handshake_and_frames_both_ways():
    """Rule: after hello, challenge and proof both sessions are open and frames flow both ways,
    each opening to the type and body it was sealed with."""
    h = Handshake()
    assert h.d.state is State.OPEN and h.a.state is State.OPEN
    body = {"s": "text", "b": b"\x00\xff", "n": [1, -2, 3.5, None, True], "m": {1: "int key"}}
    for ftype in FrameType:
        if ftype in frames.HANDSHAKE_TYPES:
            continue
        assert opened(h.a, h.d.seal(ftype, body)) == [Frame(ftype, body)]
        assert opened(h.d, h.a.seal(ftype, body)) == [Frame(ftype, body)]


def test_wire_layout():
    """The header is magic | type u8 | flags u8 | payload length u32; a sealed payload is the
    ciphertext (as long as the packed body) and a 16-byte tag; the body is not in clear."""
    h = Handshake()
    assert h.hello[:HEADER_BYTES] == MAGIC + struct.pack(">BBI", 1, 0, len(h.hello) - HEADER_BYTES)
    body = {"secret-input": "plaintext-marker" * 4}
    packed = msgpack.packb(body, use_bin_type=True)
    data = h.d.seal(FrameType.F_RESULT, body)
    assert data[:HEADER_BYTES] == MAGIC + struct.pack(">BBI", int(FrameType.F_RESULT), 0,
                                                       len(packed) + TAG_BYTES)
    assert len(data) == HEADER_BYTES + len(packed) + TAG_BYTES
    assert b"plaintext-marker" not in data and b"secret-input" not in data


@given(st.dictionaries(st.text(max_size=8),
                       st.recursive(st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1)
                                    | st.text(max_size=20) | st.binary(max_size=20),
                                    lambda c: st.lists(c, max_size=4)
                                    | st.dictionaries(st.text(max_size=4), c, max_size=4),
                                    max_leaves=10),
                       max_size=6))
@settings(max_examples=50)
def test_any_map_survives_sealing(body):
    """Any msgpack map survives seal and open."""
    h = Handshake()
    frame = h.d.seal(FrameType.F_JOB_STATE, body)
    assert opened(h.a, frame) == [Frame(FrameType.F_JOB_STATE, body)]


def test_keys_differ_per_direction_and_per_session():
    """The same body sealed by two sessions, or both ways of one, never gives the same bytes."""
    h1, h2 = Handshake(), Handshake()
    seen = {h1.d.seal(FrameType.F_PING, {}), h1.a.seal(FrameType.F_PING, {}),
            h2.d.seal(FrameType.F_PING, {}), h2.a.seal(FrameType.F_PING, {})}
    assert len(seen) == 4


def test_another_secret_is_refused_at_the_first_step():
    """Rule: a hello signed with another fleet's secret is refused as `mac`, unanswered."""
    d = Session(OTHER, Role.DIALLER)
    a = Session(SECRET, Role.ACCEPTOR)
    assert reason(a, d.hello(hello_body(), nonce(), key())) == "mac"


def test_an_acceptor_without_the_secret_cannot_challenge():
    """Rule: a challenge not made with the fleet secret is refused by the dialler."""
    d = Session(SECRET, Role.DIALLER)
    hello = d.hello(hello_body(), nonce(), key())
    a = Session(OTHER, Role.ACCEPTOR)
    # The impostor cannot even check the hello; suppose it answers anyway.
    a._transcript.append(hello)
    a.state = State.GOT_HELLO
    assert reason(d, a.challenge(hello_body("a", "d"), nonce(), key())) == "challenge"


def test_a_recorded_handshake_replayed_never_completes():
    """Rule: a recorded hello and proof replayed to a fresh acceptor (a member restarted since,
    or another connection) earn a challenge and nothing else: the proof was made for another
    challenge's nonce."""
    h = Handshake()
    recorded_frame = h.d.seal(FrameType.F_LEASE, {"run": "rm -rf"})
    for _ in range(3):
        fresh = Session(SECRET, Role.ACCEPTOR)  # a new acceptor object: a restart
        assert isinstance(feed(fresh, h.hello), Hello)
        fresh.challenge(hello_body("a", "d"), nonce(), key())
        assert reason(fresh, h.proof + recorded_frame) == "proof"


def test_a_recorded_challenge_replayed_to_a_dialler_is_refused():
    """Rule: the challenge binds the dialler's nonce: one recorded from an earlier handshake
    does not answer a new hello."""
    h = Handshake()
    d = Session(SECRET, Role.DIALLER)
    d.hello(hello_body(), nonce(), key())
    assert reason(d, h.challenge) == "challenge"


def test_a_reflected_hello_is_refused():
    """A dialler's own hello sent back to it is not a challenge."""
    d = Session(SECRET, Role.DIALLER)
    hello = d.hello(hello_body(), nonce(), key())
    assert reason(d, hello) == "handshake"


def test_own_nonce_back_is_refused():
    """An acceptor that echoes the dialler's nonce in a validly signed challenge is refused."""
    d = Session(SECRET, Role.DIALLER)
    n = nonce()
    hello = d.hello(hello_body(), n, key())
    a = Session(SECRET, Role.ACCEPTOR)
    feed(a, hello)
    assert reason(d, a.challenge(hello_body("a", "d"), n, key())) == "handshake"


def test_frames_before_the_handshake_is_done_are_refused():
    """Rule 4: a sealed frame type before the proof, a handshake frame after it, or bytes
    while the other end should be waiting for us, are refused as `handshake`."""
    h = Handshake()
    a = Session(SECRET, Role.ACCEPTOR)
    assert reason(a, h.d.seal(FrameType.F_LEASE, {})) == "handshake"
    a = Session(SECRET, Role.ACCEPTOR)
    feed(a, Session(SECRET, Role.DIALLER).hello(hello_body(), nonce(), key()))
    assert a.state is State.GOT_HELLO
    assert reason(a, b"M") == "handshake"  # the dialler spoke before our challenge
    late_hello = Session(SECRET, Role.DIALLER).hello(hello_body(), nonce(), key())
    assert reason(h.a, late_hello) == "handshake"
    d = Session(SECRET, Role.DIALLER)
    d.hello(hello_body(), nonce(), key())
    assert reason(d, h.proof) == "handshake"
    # A dialler that has not said hello yet expects nothing at all.
    assert reason(Session(SECRET, Role.DIALLER), b"MJF2") == "handshake"


def test_a_proof_with_a_body_is_refused():
    """A proof carries an empty map: anything else, even correctly signed, is refused."""
    d = Session(SECRET, Role.DIALLER)
    a = Session(SECRET, Role.ACCEPTOR)
    hello = d.hello(hello_body(), nonce(), key())
    feed(a, hello)
    challenge = a.challenge(hello_body("a", "d"), nonce(), key())
    packed = msgpack.packb({"x": 1})
    signed = HEADER.pack(MAGIC, int(FrameType.F_PROOF), 0, len(packed) + MAC_BYTES) + packed
    mac = frames._mac(frames._derive("F_PROOF mac", SECRET), hello, challenge, signed)
    assert reason(a, signed + mac) == "handshake"


def signed_hello(body: dict) -> bytes:
    """A hello with exactly `body`, correctly signed with SECRET."""
    packed = msgpack.packb(body, use_bin_type=True)
    signed = HEADER.pack(MAGIC, 1, 0, len(packed) + MAC_BYTES) + packed
    return signed + frames._mac(frames._derive("F_HELLO mac", SECRET), signed)


def test_missing_or_bad_nonce_or_key_is_refused():
    """A hello without a 32-byte nonce, or without a 32-byte X25519 key that is not of low
    order, is refused, however well signed."""
    good_kx = bytes(range(1, 33))
    for n in (None, b"short", "a" * 32, 7):
        body = dict(hello_body(), kx=good_kx, **({} if n is None else {"nonce": n}))
        assert reason(Session(SECRET, Role.ACCEPTOR), signed_hello(body)) == "handshake", n
    # The zero point and another low-order point: their shared secret is zero, whatever our key.
    low = (bytes(32), bytes([1]) + bytes(31),
           bytes.fromhex("e0eb7a7c3b41b8ae1656e3faf19fc46ada098deb9c32b1fd866205165f49b800"))
    for kx in (None, b"short", "k" * 32, *low):
        body = dict(hello_body(), nonce=nonce(), **({} if kx is None else {"kx": kx}))
        assert reason(Session(SECRET, Role.ACCEPTOR), signed_hello(body)) == "handshake", kx
    body = dict(hello_body(), nonce=nonce(), kx=good_kx)
    assert isinstance(feed(Session(SECRET, Role.ACCEPTOR), signed_hello(body)), Hello)


def test_the_secret_and_the_transcript_alone_do_not_open_a_session():
    """Rule (forward secrecy): someone who recorded a whole handshake and its frames, and later
    learns the fleet secret, still cannot compute the keys: they depend on the fresh X25519
    keys too, whose private halves never left the two ends."""
    h = Handshake()
    frame = h.d.seal(FrameType.F_RESULT, {"out": "confidential"})
    transcript = blake3.blake3(h.hello + h.challenge + h.proof).digest()
    for material in (SECRET + transcript, SECRET + bytes(KX_BYTES) + transcript):
        guess = ChaCha20Poly1305(frames._derive("dialler to acceptor", material))
        with pytest.raises(InvalidTag):
            guess.decrypt(bytes(12), frame[HEADER_BYTES:], frame[:HEADER_BYTES])
    assert opened(h.a, frame) == [Frame(FrameType.F_RESULT, {"out": "confidential"})]


def test_fresh_keys_give_fresh_session_keys():
    """Two handshakes with the same nonces but other X25519 keys seal differently."""
    sealed = set()
    for k in (key(), key()):
        d, a = Session(SECRET, Role.DIALLER), Session(SECRET, Role.ACCEPTOR)
        feed(a, d.hello(hello_body(), bytes(NONCE_BYTES), k))
        feed(d, a.challenge(hello_body("a", "d"), b"\x01" * NONCE_BYTES, bytes(range(32))))
        feed(a, d.proof())
        sealed.add(d.seal(FrameType.F_PING, {}))
    assert len(sealed) == 2


def test_steps_out_of_turn_are_the_callers_bug():
    """Calling hello, challenge, proof or seal in the wrong state is an AssertionError (ours),
    not a FrameError."""
    d = Session(SECRET, Role.DIALLER)
    with pytest.raises(AssertionError):
        d.proof()
    with pytest.raises(AssertionError):
        d.seal(FrameType.F_PING, {})
    with pytest.raises(AssertionError):
        Session(SECRET, Role.ACCEPTOR).hello(hello_body(), nonce(), key())
    with pytest.raises(AssertionError):
        Session(SECRET, Role.ACCEPTOR).challenge(hello_body(), nonce(), key())
    with pytest.raises(ValueError):
        d.hello(hello_body(), b"short", key())
    with pytest.raises(ValueError):
        d.hello(hello_body(), nonce(), b"short")
    with pytest.raises(ValueError):
        Session(b"short", Role.DIALLER)
    h = Handshake()
    with pytest.raises(ValueError):
        h.d.seal(FrameType.F_HELLO, {})
    with pytest.raises(TypeError):
        h.d.seal(FrameType.F_PING, [1])
    with pytest.raises(ValueError):
        h.d.seal(FrameType.F_BLOB_PUT, {"b": b"x" * limits.frame_bytes_max})


# --- replay, order and tampering of sealed frames ----------------------------------------------

def test_replayed_duplicated_reordered_or_dropped_frames_fail_to_open():
    """Rule: the AEAD nonce is the frame count, so only the next frame in order opens."""
    for case in ("replay", "duplicate", "reorder", "drop"):
        h = Handshake()
        f0, f1, f2 = (h.d.seal(FrameType.F_RESULT, {"i": i}) for i in range(3))
        stream = {"replay": f0 + f1 + f0, "duplicate": f0 + f0,
                  "reorder": f0 + f2 + f1, "drop": f0 + f2}[case]
        with pytest.raises(FrameError) as e:
            opened(h.a, stream)
        assert e.value.reason == "aead", case
        assert h.a.received >= 1


def test_a_frame_of_another_session_fails_to_open():
    """A frame sealed in one session (same secret, same count) does not open in another."""
    h1, h2 = Handshake(), Handshake()
    f = h1.d.seal(FrameType.F_LEASE, {"x": 1})
    assert reason(h2.a, f) == "aead"
    # Nor does a frame sealed in the other direction of the same session.
    h3 = Handshake()
    assert reason(h3.a, h3.a.seal(FrameType.F_LEASE, {"x": 1})) == "aead"


def test_a_flipped_bit_anywhere_is_refused():
    """Every single-bit change of a sealed frame (header, body or tag) fails."""
    h = Handshake()
    data = h.d.seal(FrameType.F_RESULT, {"job": "j1", "items": [1, 2, 3]})
    reasons = set()
    for i in range(len(data)):
        for bit in (0, 3, 7):
            bad = bytearray(data)
            bad[i] ^= 1 << bit
            copy = receiver_copy(h.a)
            copy.receive_data(bytes(bad))
            try:
                got = copy.next_event()
            except FrameError as e:
                reasons.add(e.reason)
                continue
            # A length made longer waits for bytes that a hostile sender never gets to fake.
            assert got is None, (i, bit)
            assert 6 <= i < HEADER_BYTES, (i, bit)
    assert {"aead", "magic", "type", "flags"} <= reasons
    assert reasons <= {"magic", "type", "flags", "length", "aead", "handshake"}
    # And the untouched frame still opens.
    assert opened(h.a, data) == [Frame(FrameType.F_RESULT, {"job": "j1", "items": [1, 2, 3]})]


def test_a_flipped_bit_in_any_handshake_frame_is_refused():
    """Every single-bit change in the hello, the challenge or the proof fails that step."""
    h = Handshake()
    for step, data in (("hello", h.hello), ("challenge", h.challenge), ("proof", h.proof)):
        for i in range(len(data)):
            bad = bytearray(data)
            bad[i] ^= 0x10
            d = Session(SECRET, Role.DIALLER)
            a = Session(SECRET, Role.ACCEPTOR)
            d.hello(hello_body(), nonce(), key())
            if step == "hello":
                target = a
            elif step == "challenge":
                d._transcript = [h.hello]
                target = d
            else:
                feed(a, h.hello)
                a._transcript = [h.hello, h.challenge]
                a.state = State.SENT_CHALLENGE
                target = a
            target.receive_data(bytes(bad))
            try:
                got = target.next_event()
            except FrameError:
                continue
            assert got is None, (step, i)  # a longer length waits for more bytes


def test_sealed_body_must_be_a_msgpack_map():
    """A sealed payload that opens but is not one msgpack map is refused as `body`."""
    for packed in (msgpack.packb([1, 2]), msgpack.packb("s"), b"\xc1",
                   msgpack.packb({}) + b"\x00", b"\x81\x80\x01"):
        h = Handshake()
        assert reason(h.a, h.d.seal_packed(FrameType.F_RESULT, packed)) == "body", packed


# --- streaming and bounds ----------------------------------------------------------------------

def test_byte_by_byte_and_one_chunk_decode_the_same():
    """Chunking never changes what opens, from the hello to the last sealed frame."""
    h = Handshake()
    stream = b"".join(h.d.seal(FrameType(2 + i % 9), {"i": i, "pad": "x" * i}) for i in range(40))
    d2 = receiver_copy(h.a)
    whole = opened(h.a, stream)
    split = []
    for k in range(len(stream)):
        d2.receive_data(stream[k:k + 1])
        while (f := d2.next_event()) is not None:
            split.append(f)
    assert len(whole) == 40 and split == whole and d2.buffered == 0


def test_truncated_handshake_waits_never_errors():
    """A hello cut anywhere is 'need more data', never an error."""
    hello = Session(SECRET, Role.DIALLER).hello(hello_body(), nonce(), key())
    for cut in range(len(hello)):
        a = Session(SECRET, Role.ACCEPTOR)
        a.receive_data(hello[:cut])
        assert a.next_event() is None, cut
        a.receive_data(hello[cut:])
        assert isinstance(a.next_event(), Hello), cut


def test_oversized_length_refused_before_buffering():
    """Rule 3: a hostile length fails on the header alone, in the handshake (its own, smaller
    limit) and after it, and nothing of the body is buffered."""
    a = Session(SECRET, Role.ACCEPTOR)
    a.receive_data(HEADER.pack(MAGIC, int(FrameType.F_HELLO), 0, 2**32 - 1))
    with pytest.raises(FrameError) as e:
        a.next_event()
    assert e.value.reason == "length" and a.buffered == 0
    big_hello = HEADER.pack(MAGIC, 1, 0, limits.link_handshake_bytes_max - HEADER_BYTES + 1)
    assert reason(Session(SECRET, Role.ACCEPTOR), big_hello) == "length"
    ok_hello = HEADER.pack(MAGIC, 1, 0, limits.link_handshake_bytes_max - HEADER_BYTES)
    a = Session(SECRET, Role.ACCEPTOR)
    assert feed(a, ok_hello) is None
    h = Handshake(frame_bytes_max=1000)
    h.a.receive_data(HEADER.pack(MAGIC, int(FrameType.F_LEASE), 0, 1000 - HEADER_BYTES))
    assert h.a.next_event() is None
    h = Handshake(frame_bytes_max=1000)
    assert reason(h.a, HEADER.pack(MAGIC, int(FrameType.F_LEASE), 0, 1001 - HEADER_BYTES)) \
        == "length"


def test_buffer_never_exceeds_one_frame():
    """A session holds at most frame_bytes_max bytes and refuses to be fed more."""
    h = Handshake(frame_bytes_max=4096)
    stream = b"".join(h.d.seal(FrameType.F_LEASE, {"p": "y" * 1000, "i": i}) for i in range(30))
    fed = count = 0
    while fed < len(stream):
        n = min(700, h.a.room(), len(stream) - fed)
        h.a.receive_data(stream[fed:fed + n])
        fed += n
        assert h.a.buffered <= 4096
        while h.a.next_event() is not None:
            count += 1
    assert count == 30
    with pytest.raises(ValueError):
        h.a.receive_data(b"\x00" * (h.a.room() + 1))


def test_unknown_type_and_flags_and_magic():
    """An old member's MJF1, a type byte outside FrameType, or a flag bit, is refused."""
    assert reason(Session(SECRET, Role.ACCEPTOR), b"MJF1") == "magic"
    assert reason(Session(SECRET, Role.ACCEPTOR), b"GET / HTTP/1.1\r\n") == "magic"
    assert reason(Session(SECRET, Role.ACCEPTOR), HEADER.pack(MAGIC, 0, 0, 10)) == "type"
    assert reason(Session(SECRET, Role.ACCEPTOR), HEADER.pack(MAGIC, 200, 0, 10)) == "type"
    assert reason(Session(SECRET, Role.ACCEPTOR), HEADER.pack(MAGIC, 1, 1, 10)) == "flags"


def test_session_is_dead_after_an_error():
    """After a FrameError every later call raises it again, whatever is fed."""
    a = Session(SECRET, Role.ACCEPTOR)
    assert reason(a, b"XXXX") == "magic"
    a.receive_data(Session(SECRET, Role.DIALLER).hello(hello_body(), nonce(), key()))
    with pytest.raises(FrameError):
        a.next_event()


# --- garbage at every step ---------------------------------------------------------------------

def _at_step(step: str) -> Session:
    """A session waiting for the other end's frame at `step`."""
    if step == "hello":
        return Session(SECRET, Role.ACCEPTOR)
    if step == "challenge":
        d = Session(SECRET, Role.DIALLER)
        d.hello(hello_body(), nonce(), key())
        return d
    if step == "proof":
        a = Session(SECRET, Role.ACCEPTOR)
        feed(a, Session(SECRET, Role.DIALLER).hello(hello_body(), nonce(), key()))
        a.challenge(hello_body("a", "d"), nonce(), key())
        return a
    return Handshake().a


@settings(max_examples=200)
@given(st.sampled_from(["hello", "challenge", "proof", "open"]),
       st.binary(min_size=1, max_size=300), st.booleans())
def test_garbage_at_every_step_is_refused_or_waits(step, data, with_magic):
    """Random bytes at any step never make an event and fail only with FrameError."""
    s = _at_step(step)
    s.receive_data((MAGIC + data) if with_magic else data)
    try:
        assert s.next_event() is None
    except FrameError as e:
        assert e.reason in {"magic", "type", "flags", "length", "mac", "challenge", "proof",
                            "aead", "body", "handshake"}


@settings(max_examples=100)
@given(st.sampled_from(["hello", "challenge", "proof"]), st.integers(0, 255),
       st.binary(max_size=200))
def test_well_framed_garbage_in_the_handshake_is_refused(step, ftype, payload):
    """A well-framed but unsigned frame of any type at any handshake step is refused."""
    s = _at_step(step)
    data = HEADER.pack(MAGIC, ftype, 0, len(payload)) + payload
    s.receive_data(data)
    with pytest.raises(FrameError):
        s.next_event()


# --- live item output: F_LOG_GET and F_LOG_PUT bodies --------------------------------------------

GOOD_ASK = {"q": 7, "j": "job-1", "i": 3, "e": 2, "s": "stderr", "o": 10, "n": 4096}
GOOD_PIECE = {"q": 7, "data": b"line\n", "end": False, "err": None}


def test_log_frames_round_trip_through_a_session():
    """An F_LOG_GET and its F_LOG_PUT survive sealing and opening and parse back as sent."""
    h = Handshake()
    ask = frames.LogAsk(7, "job-1", 3, 2, "stderr", 10, 4096)
    piece = frames.LogPiece(7, b"\x00\xffbytes", True)
    got = opened(h.a, h.d.seal(FrameType.F_LOG_GET, frames.log_ask_body(ask)))
    assert got[0].type == FrameType.F_LOG_GET and frames.parse_log_ask(got[0].body) == ask
    got = opened(h.d, h.a.seal(FrameType.F_LOG_PUT, frames.log_piece_body(piece)))
    assert got[0].type == FrameType.F_LOG_PUT and frames.parse_log_piece(got[0].body) == piece
    assert frames.parse_log_piece({"q": 1, "data": b"", "end": False, "err": "unknown"}).error \
        == "unknown"


def test_a_full_log_piece_fits_in_one_frame():
    """The largest F_LOG_PUT (log_frame_bytes_max of output) is far below frame_bytes_max."""
    body = frames.log_piece_body(frames.LogPiece(frames._U63, b"x" * limits.log_frame_bytes_max,
                                                 True))
    assert frames.sealed_bytes(len(frames.pack(body))) < limits.frame_bytes_max


@pytest.mark.parametrize("change", [
    {"q": -1}, {"q": 1 << 63}, {"q": "7"}, {"q": True}, {"q": 1.0}, {"q": None},
    {"j": ""}, {"j": "x" * (limits.job_id_chars_max + 1)}, {"j": 5}, {"j": b"job"},
    {"j": "j\x00b"}, {"j": "jöb"}, {"j": "a\nb"},
    {"i": -1}, {"i": limits.items_max}, {"i": 10**30}, {"i": "3"},
    {"e": -1}, {"e": 1 << 64}, {"s": "stdin"}, {"s": "STDOUT"}, {"s": None}, {"s": b"stdout"},
    {"o": -1}, {"o": limits.log_offset_bytes_max + 1}, {"o": 0.5},
    {"n": 0}, {"n": limits.log_frame_bytes_max + 1}, {"n": -5}, {"n": [1]},
])
def test_a_bad_log_ask_is_refused_as_body(change):
    """Each field of an F_LOG_GET out of its type or range is FrameError("body")."""
    with pytest.raises(frames.FrameError) as e:
        frames.parse_log_ask({**GOOD_ASK, **change})
    assert e.value.reason == "body"


@pytest.mark.parametrize("change", [
    {"q": -1}, {"q": "x"}, {"data": "text"}, {"data": None}, {"data": [1, 2]},
    {"data": b"x" * (limits.log_frame_bytes_max + 1)}, {"end": 1}, {"end": None},
    {"err": "gone"}, {"err": 1}, {"err": "unknown"}, {"err": "unknown", "data": b"", "end": True},
])
def test_a_bad_log_piece_is_refused_as_body(change):
    """An F_LOG_PUT with a field out of its type or range, over-long data, or an error that
    carries data or an end, is FrameError("body")."""
    with pytest.raises(frames.FrameError) as e:
        frames.parse_log_piece({**GOOD_PIECE, **change})
    assert e.value.reason == "body"


@pytest.mark.parametrize("body", [None, [], "q", 7, b"", {}, {"q": 1}])
def test_log_bodies_that_are_not_maps_or_lack_fields_are_refused(body):
    """Missing fields and bodies that are not maps are FrameError("body"), never a crash."""
    for parse in (frames.parse_log_ask, frames.parse_log_piece):
        with pytest.raises(frames.FrameError):
            parse(body)


def test_unknown_keys_in_log_bodies_are_ignored():
    """A newer member may add fields: they are ignored."""
    assert frames.parse_log_ask({**GOOD_ASK, "x": [1] * 10}).index == 3
    assert frames.parse_log_piece({**GOOD_PIECE, "x": {}}).data == b"line\n"


def test_building_a_bad_log_body_is_the_callers_bug():
    """Building a body with a field out of range raises ValueError (our own mistake)."""
    with pytest.raises(ValueError):
        frames.log_ask_body(frames.LogAsk(1, "j", 0, 1, "stdin", 0, 1))
    with pytest.raises(ValueError):
        frames.log_ask_body(frames.LogAsk(1, "j", 0, 1, "stdout", 0, limits.log_frame_bytes_max + 1))
    with pytest.raises(ValueError):
        frames.log_piece_body(frames.LogPiece(1, b"x" * (limits.log_frame_bytes_max + 1), False))


@settings(max_examples=300)
@given(st.dictionaries(st.sampled_from(["q", "j", "i", "e", "s", "o", "n", "data", "end", "err"]),
                       st.one_of(st.none(), st.booleans(), st.integers(), st.floats(),
                                 st.text(max_size=20), st.binary(max_size=20),
                                 st.sampled_from(["stdout", "stderr", "unknown", "job"])),
                       max_size=10))
def test_hostile_log_bodies_raise_only_frame_error(body):
    """Any map of any values either parses to fields within their limits or is FrameError."""
    try:
        a = frames.parse_log_ask(body)
    except frames.FrameError as e:
        assert e.reason == "body"
    else:
        assert a.stream in frames.LOG_STREAMS and 1 <= a.size <= limits.log_frame_bytes_max
    try:
        p = frames.parse_log_piece(body)
    except frames.FrameError as e:
        assert e.reason == "body"
    else:
        assert len(p.data) <= limits.log_frame_bytes_max and isinstance(p.end, bool)


# --- purity ------------------------------------------------------------------------------------

def test_frames_is_pure():
    """frames.py imports no os, socket, threading, time or random."""
    tree = ast.parse(open(frames.__file__).read())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module.split(".")[0])
    assert not names & {"os", "socket", "threading", "time", "random", "select", "selectors",
                        "secrets", "uuid"}
