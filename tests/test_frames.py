"""Frames between members: the pure codec, its authentication and its replay rules."""

from __future__ import annotations

import ast
import os
import struct

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshjobs import frames, limits
from meshjobs.frames import (
    HEADER,
    HEADER_BYTES,
    MAC_BYTES,
    MAGIC,
    Frame,
    FrameDecoder,
    FrameError,
    FrameType,
    NonceCache,
    encode,
)

SECRET = bytes(range(32))
OTHER = bytes(range(1, 33))
NOW = 1_700_000_000_000


def nonce(i: int) -> bytes:
    return i.to_bytes(16, "big")


def frame(ftype=FrameType.F_LEASE, body=None, i=1, now=NOW, secret=SECRET) -> bytes:
    return encode(ftype, {"i": i} if body is None else body, secret, now, nonce(i))


def decode_all(data: bytes, now: int = NOW, **kw) -> list[Frame]:
    d = FrameDecoder(SECRET, **kw)
    d.receive_data(data)
    out = []
    while (f := d.next_frame(now)) is not None:
        out.append(f)
    return out


def reason(data: bytes, now: int = NOW, **kw) -> str:
    with pytest.raises(FrameError) as e:
        decode_all(data, now, **kw)
    return e.value.reason


def signed(header: bytes, body: bytes, secret: bytes = SECRET) -> bytes:
    """Bytes with a correct MAC over whatever header and body we craft."""
    return header + body + frames._mac(secret, header, body)


# --- round trips -------------------------------------------------------------------------------

@pytest.mark.parametrize("ftype", list(FrameType))
def test_round_trip_every_type(ftype):
    """Every frame type decodes to the type, body, sent_ms and nonce it was encoded with."""
    body = {"s": "text", "b": b"\x00\xff", "n": [1, -2, 3.5, None, True], "m": {1: "int key"}}
    data = encode(ftype, body, SECRET, NOW, nonce(7))
    (f,) = decode_all(data)
    assert f == Frame(ftype, body, NOW, nonce(7))


def test_wire_layout():
    """The header is magic | type u8 | flags u8 | length u32 | sent_ms u64 | nonce, big-endian."""
    data = encode(FrameType.F_CTL, {"a": 1}, SECRET, NOW, nonce(9))
    packed = msgpack.packb({"a": 1}, use_bin_type=True)
    assert data[:HEADER_BYTES] == MAGIC + struct.pack(">BBIQ", int(FrameType.F_CTL), 0,
                                                       len(packed), NOW) + nonce(9)
    assert data[HEADER_BYTES:-MAC_BYTES] == packed
    assert len(data) == HEADER_BYTES + len(packed) + MAC_BYTES


@given(st.dictionaries(st.text(max_size=8),
                       st.recursive(st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1)
                                    | st.text(max_size=20) | st.binary(max_size=20),
                                    lambda c: st.lists(c, max_size=4)
                                    | st.dictionaries(st.text(max_size=4), c, max_size=4),
                                    max_leaves=10),
                       max_size=6))
def test_round_trip_any_map(body):
    """Any msgpack map survives the trip."""
    (f,) = decode_all(encode(FrameType.F_JOB_STATE, body, SECRET, NOW, nonce(3)))
    assert f.body == body


def test_encode_refuses_oversized_frame():
    """An oversized frame is the sender's bug: ValueError, not a frame on the wire."""
    with pytest.raises(ValueError):
        encode(FrameType.F_BLOB_PUT, {"b": b"x" * limits.frame_bytes_max}, SECRET, NOW, nonce(1))
    with pytest.raises(ValueError):
        encode(FrameType.F_PING, {}, SECRET, NOW, b"short")
    with pytest.raises(ValueError):
        encode(FrameType.F_PING, {}, b"short secret", NOW, nonce(1))
    with pytest.raises(TypeError):
        encode(FrameType.F_PING, [1, 2], SECRET, NOW, nonce(1))


# --- streaming ---------------------------------------------------------------------------------

def test_many_frames_in_one_chunk_and_byte_by_byte_decode_the_same():
    """Chunking never changes what decodes."""
    stream = b"".join(frame(FrameType(1 + i % len(FrameType)), {"i": i, "pad": "x" * i}, i)
                      for i in range(40))
    whole = decode_all(stream)
    d = FrameDecoder(SECRET)
    split = []
    for k in range(len(stream)):
        d.receive_data(stream[k:k + 1])
        while (f := d.next_frame(NOW)) is not None:
            split.append(f)
    assert len(whole) == 40
    assert split == whole
    assert d.buffered == 0


def test_truncated_at_every_offset_needs_data_never_errors():
    """A frame cut anywhere is 'need more data' (None), never an error."""
    data = frame(body={"k": "v" * 50})
    for cut in range(len(data)):
        d = FrameDecoder(SECRET)
        d.receive_data(data[:cut])
        assert d.next_frame(NOW) is None, cut
        d.receive_data(data[cut:])
        assert d.next_frame(NOW) is not None, cut


def test_buffer_never_exceeds_one_frame():
    """The decoder holds at most frame_bytes_max bytes and refuses to be fed more."""
    small_max = 4096
    d = FrameDecoder(SECRET, frame_bytes_max=small_max)
    stream = b"".join(frame(body={"p": "y" * 1000}, i=i) for i in range(30))
    fed = 0
    count = 0
    while fed < len(stream):
        n = min(700, d.room(), len(stream) - fed)
        assert n > 0
        d.receive_data(stream[fed:fed + n])
        fed += n
        assert d.buffered <= small_max
        while d.next_frame(NOW) is not None:
            count += 1
    assert count == 30
    with pytest.raises(ValueError):
        d.receive_data(b"\x00" * (d.room() + 1))


# --- garbage -----------------------------------------------------------------------------------

@settings(max_examples=300)
@given(st.binary(min_size=1, max_size=200))
def test_random_bytes_are_refused_or_need_data(data):
    """Random bytes never decode to a frame and fail only with FrameError."""
    d = FrameDecoder(SECRET)
    d.receive_data(data)
    try:
        assert d.next_frame(NOW) is None
    except FrameError as e:
        assert e.reason in {"magic", "type", "flags", "length", "mac"}


@given(st.binary(min_size=0, max_size=64))
def test_random_bytes_after_magic(data):
    """Garbage behind a correct magic still fails with FrameError or waits for data."""
    d = FrameDecoder(SECRET)
    d.receive_data(MAGIC + data)
    try:
        assert d.next_frame(NOW) is None
    except FrameError:
        pass


def test_bad_magic_is_refused_at_the_first_wrong_byte():
    """'MJX' fails after three bytes; no need to wait for a whole header."""
    assert reason(b"MJX") == "magic"
    assert reason(b"GET / HTTP/1.1\r\n") == "magic"


def test_oversized_length_refused_before_the_body_arrives():
    """A hostile length fails on the header alone: the body is never buffered."""
    header = HEADER.pack(MAGIC, int(FrameType.F_LEASE), 0, 2**32 - 1, NOW, nonce(1))
    d = FrameDecoder(SECRET)
    d.receive_data(header)
    with pytest.raises(FrameError) as e:
        d.next_frame(NOW)
    assert e.value.reason == "length"
    assert d.buffered == 0
    # Exactly at the limit is fine; one byte over is not.
    limit = 1000
    ok = HEADER.pack(MAGIC, 1, 0, limit - HEADER_BYTES - MAC_BYTES, NOW, nonce(1))
    over = HEADER.pack(MAGIC, 1, 0, limit - HEADER_BYTES - MAC_BYTES + 1, NOW, nonce(1))
    d = FrameDecoder(SECRET, frame_bytes_max=limit)
    d.receive_data(ok)
    assert d.next_frame(NOW) is None
    assert reason(over, frame_bytes_max=limit) == "length"


def test_unknown_type_and_flags():
    """A type byte outside FrameType, or a flag bit set, is refused."""
    body = msgpack.packb({})
    assert reason(signed(HEADER.pack(MAGIC, 0, 0, len(body), NOW, nonce(1)), body)) == "type"
    assert reason(signed(HEADER.pack(MAGIC, 200, 0, len(body), NOW, nonce(1)), body)) == "type"
    assert reason(signed(HEADER.pack(MAGIC, 1, 1, len(body), NOW, nonce(1)), body)) == "flags"


def test_a_flipped_bit_anywhere_is_refused():
    """Every single-bit change of a good frame fails (mostly as a bad MAC)."""
    data = frame(body={"job": "j1", "items": [1, 2, 3]})
    reasons = set()
    for i in range(len(data)):
        for bit in (0, 3, 7):
            bad = bytearray(data)
            bad[i] ^= 1 << bit
            d = FrameDecoder(SECRET)
            d.receive_data(bytes(bad))
            try:
                got = d.next_frame(NOW)
            except FrameError as e:
                reasons.add(e.reason)
                continue
            # A length made longer waits for bytes that a hostile sender never gets to fake.
            assert got is None, (i, bit)
            assert HEADER_BYTES - 16 - 8 - 4 <= i < HEADER_BYTES - 16 - 8, (i, bit)
    assert "mac" in reasons
    assert reasons <= {"magic", "type", "flags", "length", "mac", "clock"}


def test_another_secret_is_refused():
    """A frame signed with another fleet's secret is a bad MAC."""
    assert reason(frame(secret=OTHER)) == "mac"


def test_body_must_be_a_msgpack_map():
    """A correctly signed body that is not one msgpack map is refused as 'body'."""
    for body in (msgpack.packb([1, 2]), msgpack.packb("s"), b"\xc1", msgpack.packb({}) + b"\x00",
                 b"", msgpack.packb({"a": 1})[:-1], b"\x81\x80\x01"):
        header = HEADER.pack(MAGIC, int(FrameType.F_RESULT), 0, len(body), NOW, nonce(1))
        assert reason(signed(header, body)) == "body", body


def test_stale_and_future_timestamps():
    """sent_ms must be within ±frame_clock_skew_ms_max of the receiver's clock."""
    skew = limits.frame_clock_skew_ms_max
    assert decode_all(frame(now=NOW - skew))
    assert decode_all(frame(now=NOW + skew))
    assert reason(frame(now=NOW - skew - 1)) == "clock"
    assert reason(frame(now=NOW + skew + 1)) == "clock"


def test_replayed_frame_is_refused():
    """The same bytes twice: the second is a replay, even on another decoder of the member."""
    data = frame()
    cache = NonceCache()
    first = FrameDecoder(SECRET, nonces=cache)
    first.receive_data(data + data)
    assert first.next_frame(NOW) is not None
    with pytest.raises(FrameError) as e:
        first.next_frame(NOW)
    assert e.value.reason == "replay"
    other = FrameDecoder(SECRET, nonces=cache)
    other.receive_data(data)
    with pytest.raises(FrameError) as e:
        other.next_frame(NOW + 1000)
    assert e.value.reason == "replay"


def test_decoder_is_dead_after_an_error():
    """After a FrameError every later call raises it again, whatever is fed."""
    d = FrameDecoder(SECRET)
    d.receive_data(b"XXXX")
    with pytest.raises(FrameError):
        d.next_frame(NOW)
    assert d.dead
    d.receive_data(frame())
    with pytest.raises(FrameError):
        d.next_frame(NOW)


# --- the nonce cache ---------------------------------------------------------------------------

def test_nonce_cache_expires_after_the_window():
    """Entries leave once their frames would be stale; stale frames are refused, not re-let."""
    c = NonceCache(entries_max=100, window_ms=5000)
    assert c.admit(nonce(1), NOW, NOW)
    assert not c.admit(nonce(1), NOW, NOW + 4000)
    assert c.admit(nonce(2), NOW + 1000, NOW + 1000)
    assert len(c) == 2
    c.admit(nonce(3), NOW + 6500, NOW + 6500)
    assert len(c) == 2  # nonce(1)'s bucket expired
    # The clock stepping back does not reopen what expired.
    assert not c.admit(nonce(1), NOW, NOW)


def test_nonce_cache_is_bounded():
    """A full cache drops its oldest second and refuses frames sent before it."""
    c = NonceCache(entries_max=10, window_ms=60_000)
    for i in range(10):
        assert c.admit(nonce(i), NOW + i * 100, NOW)
    assert c.admit(nonce(100), NOW + 1500, NOW)
    assert len(c) <= 10
    assert c.floor_ms == NOW - NOW % 1000 + 1000
    assert not c.admit(nonce(200), NOW + 10, NOW)  # before the floor: cannot prove it is new
    for i in range(10_000):
        c.admit(os.urandom(16), NOW + 2000 + i, NOW + 2000)
        assert len(c) <= 10


@given(st.lists(st.tuples(st.integers(0, 30), st.integers(0, 20_000), st.integers(0, 20_000)),
                max_size=200))
def test_nonce_cache_never_admits_a_nonce_twice(ops):
    """Whatever the order and clocks, one (nonce, sent_ms) is admitted at most once."""
    c = NonceCache(entries_max=16, window_ms=3000)
    admitted = set()
    for n, sent, now in ops:
        if c.admit(nonce(n), sent, now):
            assert (n, sent) not in admitted
            admitted.add((n, sent))
        assert len(c) <= 16


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
    assert not names & {"os", "socket", "threading", "time", "random", "select", "selectors"}
