"""Bodies too large for one frame: `frames.Chunker` cuts them into parts, `frames.Assembler`
puts them back together (Rule 5 of frames.py), with malformed, oversized and hostile parts."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshjobs import frames, limits
from meshjobs.frames import Assembler, Chunker, FrameError, FrameType, is_part, pack, sealed_bytes

SMALL = 16  # part bytes in most tests: small bodies already travel in several parts


def packed_of(body: object) -> bytes:
    return msgpack.packb(body, use_bin_type=True)


def test_parts_put_back_together_give_the_body():
    """Rule 5: the parts of a body, added in order, give the body once the last is in."""
    body = {"entries": [{"i": k, "data": bytes(k)} for k in range(20)]}
    parts = Chunker(part_bytes=SMALL).split(packed_of(body))
    assert len(parts) > 2
    asm = Assembler(part_bytes=SMALL)
    got = [asm.add("v1", p) for p in parts]
    assert got[:-1] == [None] * (len(parts) - 1)
    assert got[-1] == body
    assert len(asm) == 0


def test_wire_layout_of_parts():
    """The parts on the wire: {seq, part, parts, data}, slices of the packed body in order, seq
    counting bodies from 1 (the layout members of every version exchange)."""
    raw = bytes(range(50))
    c = Chunker(part_bytes=SMALL)
    assert c.split(raw) == [
        {"seq": 1, "part": 0, "parts": 4, "data": raw[0:16]},
        {"seq": 1, "part": 1, "parts": 4, "data": raw[16:32]},
        {"seq": 1, "part": 2, "parts": 4, "data": raw[32:48]},
        {"seq": 1, "part": 3, "parts": 4, "data": raw[48:50]},
    ]
    assert [p["seq"] for p in c.split(raw)] == [2] * 4


def test_fits_is_up_to_one_part():
    """A packed body of up to `part_bytes` goes whole; one byte more takes two parts."""
    c = Chunker(part_bytes=SMALL)
    assert c.fits(bytes(SMALL)) and not c.fits(bytes(SMALL + 1))
    assert len(c.split(bytes(SMALL + 1))) == 2


def test_default_part_fits_one_frame():
    """A part of the default size, with its fields, seals into one frame of frame_bytes_max."""
    part = Chunker().split(bytes(limits.frame_part_bytes + 1))[0]
    assert len(part["data"]) == limits.frame_part_bytes
    assert sealed_bytes(len(pack(part))) <= limits.frame_bytes_max


def test_a_body_over_parts_max_is_refused_and_uses_no_number():
    """Our own body too large for parts_max parts: ValueError, and the next body's seq is the
    one it would have had."""
    c = Chunker(part_bytes=SMALL, parts_max=3)
    with pytest.raises(ValueError, match="frame_parts_max"):
        c.split(bytes(SMALL * 3 + 1))
    assert c.split(bytes(SMALL * 3))[0]["seq"] == 1


def test_bad_chunker_settings_are_the_callers_bug():
    with pytest.raises(ValueError):
        Chunker(part_bytes=0)
    with pytest.raises(ValueError):
        Chunker(parts_max=0)


def test_parts_in_any_order_and_peers_apart():
    """Parts arrive in any order; the same seq from two peers are two bodies."""
    body_a, body_b = {"who": "a", "x": bytes(40)}, {"who": "b", "x": bytes(41)}
    pa = Chunker(part_bytes=SMALL).split(packed_of(body_a))
    pb = Chunker(part_bytes=SMALL).split(packed_of(body_b))
    assert pa[0]["seq"] == pb[0]["seq"]
    asm = Assembler(part_bytes=SMALL)
    out = []
    for x, y in zip(reversed(pa), reversed(pb), strict=False):
        out.append(asm.add("a", x))
        out.append(asm.add("b", y))
    assert [o for o in out if o is not None] == [body_a, body_b]


@pytest.mark.parametrize("body,why", [
    ([1, 2], "not_map"),
    (None, "not_map"),
    ({}, "fields"),
    ({"seq": 1, "part": 0, "parts": 2}, "fields"),
    ({"seq": "1", "part": 0, "parts": 2, "data": b"x"}, "fields"),
    ({"seq": True, "part": 0, "parts": 2, "data": b"x"}, "fields"),
    ({"seq": 1, "part": 0.0, "parts": 2, "data": b"x"}, "fields"),
    ({"seq": 1, "part": 0, "parts": 2, "data": "x"}, "fields"),
    ({"seq": 1, "part": -1, "parts": 2, "data": b"x"}, "fields"),
    ({"seq": 1, "part": 2, "parts": 2, "data": b"x"}, "fields"),
    ({"seq": 1, "part": 0, "parts": 0, "data": b"x"}, "fields"),
    ({"seq": 1, "part": 0, "parts": limits.frame_parts_max + 1, "data": b"x"}, "fields"),
    ({"seq": 1, "part": 0, "parts": 2, "data": bytes(SMALL + 1)}, "size"),
])
def test_a_malformed_part_is_refused_and_counted(body, why):
    """Rule 5: a part that is not good raises FrameError("parts"), counted by its reason."""
    asm = Assembler(part_bytes=SMALL)
    with pytest.raises(FrameError) as e:
        asm.add("v1", body)
    assert e.value.reason == "parts" and e.value.detail == why
    assert asm.dropped == {why: 1} and len(asm) == 0


def test_a_duplicate_or_changed_part_drops_the_body():
    """A part seen twice, or a part count that changes, drops the whole body being assembled."""
    parts = Chunker(part_bytes=SMALL).split(bytes(40))
    asm = Assembler(part_bytes=SMALL)
    assert asm.add("v1", parts[0]) is None
    with pytest.raises(FrameError, match="mismatch"):
        asm.add("v1", parts[0])
    assert len(asm) == 0
    assert asm.add("v1", parts[0]) is None
    with pytest.raises(FrameError, match="mismatch"):
        asm.add("v1", {**parts[1], "parts": parts[1]["parts"] + 1})
    assert len(asm) == 0 and asm.dropped == {"mismatch": 2}


def test_whole_garbage_is_refused():
    """Parts whose joined bytes are not msgpack: FrameError("parts", "body")."""
    asm = Assembler(part_bytes=SMALL)
    assert asm.add("v1", {"seq": 1, "part": 0, "parts": 2, "data": b"\xc1"}) is None
    with pytest.raises(FrameError, match="body"):
        asm.add("v1", {"seq": 1, "part": 1, "parts": 2, "data": b"\xc1"})
    assert len(asm) == 0


def test_a_hostile_peer_cannot_make_us_hold_more_than_the_bound():
    """Rule 5: first parts of ever new bodies never hold more than assemblies_max bodies; the
    oldest goes first, and a body still held completes."""
    asm = Assembler(part_bytes=SMALL, parts_max=limits.frame_parts_max, assemblies_max=4)
    good = Chunker(part_bytes=SMALL).split(packed_of({"k": bytes(30)}))
    for p in good[:-1]:
        asm.add("v1", {**p, "seq": 10_000})
    for seq in range(1000):
        asm.add("evil", {"seq": seq, "part": 0, "parts": limits.frame_parts_max,
                         "data": bytes(SMALL)})
        assert len(asm) <= 4
    # The good body was pushed out long ago: its last part starts a body of its own.
    assert asm.add("v1", {**good[-1], "seq": 10_000}) is None


@settings(max_examples=300, deadline=None)
@given(st.one_of(
    st.dictionaries(st.sampled_from(["seq", "part", "parts", "data", "x"]),
                    st.one_of(st.integers(-3, 300), st.binary(max_size=40), st.text(max_size=3),
                              st.none(), st.booleans(), st.floats())),
    st.lists(st.integers()), st.binary(), st.none()))
def test_hostile_parts_raise_only_frame_error(body):
    """Whatever a peer sends as a part: None, a whole body, or FrameError; held bodies stay
    within the bound."""
    asm = Assembler(part_bytes=SMALL, assemblies_max=2)
    for _ in range(3):
        try:
            asm.add("p", body)
        except FrameError as e:
            assert e.reason == "parts"
        assert len(asm) <= 2


@settings(max_examples=100, deadline=None)
@given(st.dictionaries(st.text(max_size=5),
                       st.one_of(st.binary(max_size=100), st.integers(-(2**63), 2**64 - 1))),
       st.integers(1, 64))
def test_any_body_survives_parts(body, part_bytes):
    parts = Chunker(part_bytes=part_bytes, parts_max=10_000).split(packed_of(body))
    asm = Assembler(part_bytes=part_bytes, parts_max=10_000)
    assert [asm.add("p", p) for p in parts][-1] == body


def test_is_part():
    assert is_part({"seq": 1, "parts": 2}) and not is_part({"seq": 1}) and not is_part([1])


def test_parts_travel_as_frames_of_their_type():
    """A part body seals and opens like any other body (no type of its own on the wire)."""
    assert FrameType.F_JOB_STATE in frames.FrameType
    part = Chunker(part_bytes=SMALL).split(bytes(20))[0]
    assert frames._unpack_body(pack(part), limits.frame_bytes_max) == part
