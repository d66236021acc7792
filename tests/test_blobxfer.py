"""The blob transfer protocol by itself (meshjobs/blobxfer.py): no threads, no store, no links.

Two members' `Transfer`s exchange frames through a list; each member's executor is a few lines
that keep blobs in a dict, as meshjobs/blobmover.py keeps them in the store. The frames are
msgpack round-tripped, as the links do."""

from __future__ import annotations

from typing import Any

import blake3
import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshjobs import limits
from meshjobs.blobxfer import (
    Action,
    CopyDone,
    Found,
    Keep,
    KeepBatch,
    PeerMissing,
    Receiver,
    Send,
    SendFrames,
    SpoolWrite,
    Transfer,
    Unspool,
    XferError,
    XferLimits,
    check_copy,
)

FB = 64  # frame bytes: small, so that a blob of a few hundred bytes goes in windows of chunks
LIM = XferLimits(frame_bytes=FB, window_frames=4, inflight_bytes_max=1024, assemblies_max=3,
                 send_queue_max=50, assembly_bytes_max=10_000)


def digest(data: bytes) -> str:
    return blake3.blake3(data).hexdigest()


class Member:
    """A member's store (a dict), spools and executor around a real `Transfer`."""

    def __init__(self, name: str, lim: XferLimits = LIM,
                 receiver_cls: type[Receiver] = Receiver) -> None:
        self.name = name
        self.blobs: dict[str, bytes] = {}
        self.pins: set[tuple[str, str]] = set()
        self.spools: dict[tuple[str, str], bytearray] = {}
        self.fetching: set[str] = set()
        self.reads = 0  # chunks read from the store by `open`'s iterators
        self.x = Transfer(self, lim, receiver_cls=receiver_cls)
        self.out: list[tuple[str, dict[str, Any]]] = []  # frames handed to the "links"
        self.room: int | None = None  # frames the links take from one SendFrames (None: all)
        self.copied: list[tuple[str, tuple[str, ...]]] = []
        self.found: list[str] = []
        self.missing: list[tuple[str, str]] = []
        self.log: list[Action] = []
        self.peers_up: dict[str, bool] = {}

    # The Source.
    def has(self, d: str) -> bool:
        return d in self.blobs

    def size(self, d: str) -> int | None:
        b = self.blobs.get(d)
        return None if b is None else len(b)

    def read(self, d: str) -> bytes | None:
        return self.blobs.get(d)

    def open(self, d: str) -> Any:
        b = self.blobs.get(d)
        return None if b is None else self._chunks(b)

    def _chunks(self, b: bytes) -> Any:
        for i in range(0, len(b), 50):
            self.reads += 1
            yield b[i:i + 50]

    def wanted(self, d: str) -> bool:
        return d in self.fetching

    def put(self, data: bytes) -> str:
        d = digest(data)
        self.blobs[d] = data
        return d

    # The executor.
    def do(self, actions: list[Action], now: float = 0.0) -> None:
        todo = list(actions)
        while todo:
            a = todo.pop(0)
            self.log.append(a)
            more: list[Action] = []
            if isinstance(a, SendFrames):
                n = len(a.bodies) if self.room is None else min(self.room, len(a.bodies))
                for body in a.bodies[:n]:
                    self.out.append((a.to, msgpack.unpackb(msgpack.packb(body))))
                more = self.x.taken(a.ticket, n, now)
            elif isinstance(a, Send):
                self.out.append((a.to, msgpack.unpackb(msgpack.packb(a.body))))
                if a.counts:
                    self.x.tally.count(*a.counts)
            elif isinstance(a, SpoolWrite):
                spool = self.spools.setdefault(a.key, bytearray())
                assert a.off == len(spool), "a chunk written past the end of its spool"
                spool += a.data
            elif isinstance(a, Unspool):
                self.spools.pop(a.key, None)
            elif isinstance(a, Keep):
                got = None
                if a.spooled:
                    got = self.put(bytes(self.spools.pop(a.key)))
                if a.owner is not None:
                    self.pins.add((a.d, a.owner))
                more = self.x.kept(a, got, a.d in self.blobs)
            elif isinstance(a, KeepBatch):
                got = [self.put(b.data) for b in a.blobs]
                self.pins.update((b.d, b.owner) for b in a.blobs if b.owner is not None)
                more = self.x.batch_kept(a.ticket, got)
            elif isinstance(a, CopyDone):
                self.copied.append((a.to, a.digests))
            elif isinstance(a, Found):
                self.found.append(a.d)
            elif isinstance(a, PeerMissing):
                self.missing.append((a.peer, a.d))
            todo[:0] = more

    def peers(self) -> dict[str, dict[str, Any]]:
        return {p: {"up": up, "queued": 0, "waiting": 0} for p, up in self.peers_up.items()}

    def pump(self, now: float = 0.0) -> bool:
        actions, busy = self.x.pump(now, self.peers, 2)
        self.do(actions, now)
        return busy

    def receive(self, peer: str, body: Any, now: float = 0.0, get: bool = False) -> None:
        self.do(self.x.frame(peer, get, body, now), now)
        self.do(self.x.end_turn(), now)

    def take_out(self) -> list[tuple[str, dict[str, Any]]]:
        out, self.out = self.out, []
        return out


def pair(**kw: Any) -> tuple[Member, Member]:
    a, b = Member("a", **kw), Member("b", **kw)
    a.peers_up["b"] = True
    b.peers_up["a"] = True
    return a, b


def exchange(a: Member, b: Member, now: float = 0.0, rounds: int = 100) -> None:
    """Pump both and deliver every frame until nothing moves."""
    by = {a.name: a, b.name: b}
    for _ in range(rounds):
        a.pump(now)
        b.pump(now)
        frames = [(m, f) for m in (a, b) for f in m.take_out()]
        if not frames:
            return
        for src, (to, body) in frames:
            by[to].receive(src.name, body, now)
    raise AssertionError("the members never stopped exchanging frames")


def big(n: int, seed: int = 1) -> bytes:
    return bytes((i * 31 + seed) % 251 for i in range(n))


# --- copies -------------------------------------------------------------------------------------


def test_large_copy_goes_in_windows_of_chunks_in_order() -> None:
    """Rule 5: a larger blob is streamed window by window, each chunk at the offset where the
    last ended; the copy is done only when the peer acknowledged it."""
    a, b = pair()
    data = big(10 * FB + 5)
    d = a.put(data)
    a.do(a.x.copy("b", "job-1", (d,), 0.0))
    a.pump()
    first = a.take_out()
    assert [body["off"] for _, body in first] == [0, FB, 2 * FB, 3 * FB]
    assert not any(body["last"] for _, body in first)
    assert a.reads <= 6  # one window read (256 bytes in reads of 50), not the whole blob
    a.pump()
    second = a.take_out()
    assert [body["off"] for _, body in second] == [4 * FB, 5 * FB, 6 * FB, 7 * FB]
    for _, body in first + second:
        b.receive("a", body)
    a.pump()
    third = a.take_out()
    assert [body["off"] for _, body in third] == [8 * FB, 9 * FB, 10 * FB]
    assert third[-1][1]["last"] is True and len(third[-1][1]["data"]) == 5
    assert a.copied == []
    for _, body in third:
        b.receive("a", body)
    assert b.blobs[d] == data and (d, "job-1") in b.pins
    assert b.spools == {}
    acks = b.take_out()
    assert acks == [("a", {"ack": [d], "o": "job-1"})]
    a.receive("b", acks[0][1])
    assert a.copied == [("b", (d,))]
    assert a.x.sizes() == {"assemblies": 0, "sending": 0, "inflight": 0, "copies_waiting": 0}


def test_small_blobs_are_packed_and_kept_in_one_batch() -> None:
    """Blobs of one chunk go packed, at most frame_bytes of data a frame, and are kept in one
    batch whose blobs are acknowledged in one frame."""
    a, b = pair()
    ds = tuple(a.put(bytes([i]) * 20) for i in range(7))
    a.do(a.x.copy("b", "job-2", ds, 0.0))
    a.pump()
    frames = a.take_out()
    assert all("blobs" in body for _, body in frames)
    assert all(sum(len(e[2]) for e in body["blobs"]) <= FB for _, body in frames)
    assert sorted(e[0] for _, body in frames for e in body["blobs"]) == sorted(ds)
    for _, body in frames:
        b.do(b.x.frame("a", False, body, 0.0))
    batch = b.x.end_turn()
    assert len(batch) == 1 and isinstance(batch[0], KeepBatch) and len(batch[0].blobs) == 7
    b.do(batch)
    acks = b.take_out()
    assert len(acks) == 1 and sorted(acks[0][1]["ack"]) == sorted(ds)
    a.receive("b", acks[0][1])
    assert a.copied == [("b", ds)]


def test_acknowledged_only_after_kept() -> None:
    """Rule 4: the last chunk of a blob yields a Keep, never an acknowledgement; the
    acknowledgement follows `kept`."""
    a, b = pair()
    d = a.put(big(2 * FB))
    a.do(a.x.copy("b", "job-3", (d,), 0.0))
    a.pump()
    actions: list[Action] = []
    for _, body in a.take_out():
        actions += b.x.frame("a", False, body, 0.0)
    assert not any(isinstance(x, Send) for x in actions)
    keep = [x for x in actions if isinstance(x, Keep)]
    assert len(keep) == 1 and keep[0].spooled
    b.do(actions)
    kinds = [type(x).__name__ for x in b.log]
    assert kinds.index("Keep") < kinds.index("Send")


def test_copy_asked_again_while_in_flight_is_sent_once() -> None:
    """Rule 5: a blob asked again while unacknowledged is not queued twice."""
    a, _b = pair()
    d = a.put(b"x" * 10)
    a.do(a.x.copy("b", "job-4", (d,), 0.0))
    a.pump()
    assert len(a.take_out()) == 1
    a.do(a.x.copy("b", "job-4", (d,), 1.0))
    a.pump(1.0)
    assert a.take_out() == []


def test_copy_of_nothing_is_done_at_once_and_bad_copies_raise() -> None:
    """A copy of no blobs completes at once; a caller's mistake raises XferError."""
    a, _ = pair()
    a.do(a.x.copy("b", "job-5", (), 0.0))
    assert a.copied == [("b", ())]
    d = digest(b"x")
    with pytest.raises(XferError, match="itself"):
        check_copy("a", "a", "job", (d,))
    with pytest.raises(XferError, match="owner"):
        check_copy("a", "b", "", (d,))
    with pytest.raises(XferError, match="owner"):
        check_copy("a", "b", "x" * 300, (d,))
    with pytest.raises(XferError, match="digest"):
        check_copy("a", "b", "job", ("nope",))
    assert issubclass(XferError, ValueError)


def test_links_taking_part_of_a_window_drop_the_rest() -> None:
    """Frames the links had no room for are counted (send_dropped) and the blob leaves the
    window, so that the node's next ask sends it again."""
    a, b = pair()
    d = a.put(big(6 * FB))
    a.do(a.x.copy("b", "job-6", (d,), 0.0))
    a.room = 2
    a.pump()
    assert len(a.take_out()) == 2
    assert a.x.tally.dropped == {"send_dropped": 1}
    assert a.x.sizes()["inflight"] == 0 and a.x.sizes()["sending"] == 0
    a.room = None
    a.do(a.x.copy("b", "job-6", (d,), 1.0))
    exchange(a, b, 1.0)
    assert a.copied == [("b", (d,))] and b.blobs[d] == a.blobs[d]


def test_peer_down_drops_its_sends() -> None:
    """What waits for a peer that is not linked is dropped and counted (peer_down)."""
    a, _ = pair()
    ds = tuple(a.put(bytes([i]) * 5) for i in range(3))
    a.do(a.x.copy("b", "job-7", ds, 0.0))
    a.peers_up["b"] = False
    assert a.pump() is False
    assert a.take_out() == []
    assert a.x.tally.dropped == {"peer_down": 3}


# --- timeouts -----------------------------------------------------------------------------------


def test_unacknowledged_blob_leaves_the_window_and_is_sent_again() -> None:
    """A blob not acknowledged within ack_wait_ms leaves the window (ack_late); asked again,
    it is sent again, to whichever member the node now names."""
    a, c = Member("a"), Member("c")
    a.peers_up.update(b=True, c=True)
    c.peers_up["a"] = True
    d = a.put(b"y" * 30)
    a.do(a.x.copy("b", "job-8", (d,), 0.0))
    assert a.pump(0.0) is True
    assert len(a.take_out()) == 1  # b never answers
    assert a.pump(LIM.ack_wait_ms - 1) is True
    a.pump(LIM.ack_wait_ms)
    assert a.x.tally.dropped == {"ack_late": 1}
    a.do(a.x.copy("b", "job-8", (d,), LIM.ack_wait_ms + 1))
    a.pump(LIM.ack_wait_ms + 1)
    assert [to for to, _ in a.take_out()] == ["b"]
    # The node gives up on b and names another holder: the copy to c completes.
    a.do(a.x.copy("c", "job-8", (d,), LIM.ack_wait_ms + 2))
    exchange(a, c, LIM.ack_wait_ms + 2)
    assert ("c", (d,)) in a.copied and c.blobs[d] == b"y" * 30


def test_copies_and_assemblies_expire() -> None:
    """A copy not acknowledged within copy_wait_ms is forgotten (copy_expired); an assembly
    with no chunk for assembly_idle_ms is removed with its spool (stale)."""
    a, b = pair()
    d = a.put(big(3 * FB))
    a.do(a.x.copy("b", "job-9", (d,), 0.0))
    a.pump()
    first = a.take_out()[0][1]
    b.receive("a", first, 0.0)
    assert b.x.sizes()["assemblies"] == 1 and len(b.spools) == 1
    b.do(b.x.tick(LIM.assembly_idle_ms + 1))
    assert b.x.sizes()["assemblies"] == 0 and b.spools == {}
    assert b.x.tally.dropped == {"stale": 1}
    a.do(a.x.tick(LIM.copy_wait_ms + 1))
    assert a.x.sizes()["copies_waiting"] == 0
    assert a.x.tally.dropped == {"copy_expired": 1}


# --- garbage ------------------------------------------------------------------------------------


def chunk(d: str, data: bytes, **over: Any) -> dict[str, Any]:
    body = {"d": d, "o": "job-g", "size": len(data), "off": 0, "data": data, "last": True}
    body.update(over)
    return body


def test_duplicate_and_out_of_order_chunks_are_counted_and_dropped() -> None:
    """Rule 3: a chunk that does not follow on its assembly (a duplicate, a skipped or reordered
    one, an orphan) drops the assembly and is counted; nothing of it is kept."""
    _, b = pair()
    data = big(3 * FB)
    d = digest(data)
    parts = [chunk(d, data[i:i + FB], size=len(data), off=i, last=i + FB == len(data))
             for i in range(0, len(data), FB)]
    b.receive("a", parts[0])
    b.receive("a", parts[1])
    b.receive("a", parts[1])  # a duplicate
    assert b.x.tally.dropped == {"out_of_order": 1}
    assert b.x.sizes()["assemblies"] == 0 and b.spools == {}
    b.receive("a", parts[0])
    b.receive("a", parts[2])  # reordered: 1 is skipped
    b.receive("a", parts[1])  # an orphan now
    assert b.x.tally.dropped == {"out_of_order": 3}
    assert d not in b.blobs and b.take_out() == []
    # A whole transfer afterwards succeeds.
    for p in parts:
        b.receive("a", p)
    assert b.blobs[d] == data
    assert b.take_out() == [("a", {"ack": [d], "o": "job-g"})]


def test_digest_mismatch_fails_the_copy() -> None:
    """Rule 4: bytes that do not hash to the blob's digest are never kept nor acknowledged."""
    _, b = pair()
    data = big(2 * FB + 1)
    d = digest(data)
    bad = bytearray(data)
    bad[FB + 3] ^= 1
    for i in range(0, len(bad), FB):
        piece = bytes(bad[i:i + FB])
        b.receive("a", chunk(d, piece, size=len(bad), off=i, last=i + len(piece) == len(bad)))
    b.receive("a", chunk(digest(b"small"), b"not small"))
    assert b.x.tally.dropped == {"digest_mismatch": 2}
    assert b.blobs == {} and b.spools == {} and b.take_out() == []


def test_store_answering_another_digest_is_not_acknowledged() -> None:
    """Paired checks: when the store says it kept another digest, the blob is not
    acknowledged."""
    _, b = pair()
    data = big(2 * FB)
    d = digest(data)
    actions: list[Action] = []
    for i in range(0, len(data), FB):
        actions += b.x.frame("a", False, chunk(d, data[i:i + FB], size=len(data), off=i,
                                               last=i + FB == len(data)), 0.0)
    keep = next(x for x in actions if isinstance(x, Keep))
    assert not any(isinstance(x, Send) for x in b.x.kept(keep, digest(b"other"), None))
    assert b.x.tally.dropped == {"digest_mismatch": 1}
    assert b.x.sizes()["assemblies"] == 0
    batch = b.x.frame("a", False, chunk(digest(b"s"), b"s"), 0.0) + b.x.end_turn()
    kb = next(x for x in batch if isinstance(x, KeepBatch))
    assert b.x.batch_kept(kb.ticket, [digest(b"t")]) == []
    assert b.x.tally.dropped == {"digest_mismatch": 2}


@pytest.mark.parametrize("reason,body", [
    ("bad_body", {"d": digest(b"x"), "o": "j", "size": "1", "off": 0, "data": b"x",
                  "last": True}),
    ("bad_body", {"d": "not-a-digest", "data": b"x"}),
    ("bad_body", {"d": digest(b"x"), "o": 7, "size": 1, "off": 0, "data": b"x", "last": True}),
    ("bad_body", {"d": digest(b"x"), "o": "j", "size": 1, "off": True, "data": b"x",
                  "last": True}),
    ("bad_offset", {"d": digest(b"x"), "o": "j", "size": 10, "off": -1, "data": b"x",
                    "last": False}),
    ("bad_offset", {"d": digest(b"x"), "o": "j", "size": 5, "off": 9, "data": b"x",
                    "last": False}),
    ("bad_offset", {"d": digest(b"x"), "o": "j", "size": 5, "off": 0, "data": b"",
                    "last": False}),
    ("bad_offset", {"d": digest(b"x"), "o": "j", "size": FB + 1, "off": 0,
                    "data": b"x" * (FB + 1), "last": True}),
    ("too_large", {"d": digest(b"x"), "o": "j", "size": LIM.assembly_bytes_max + 1, "off": 0,
                   "data": b"x", "last": False}),
    ("bad_ack", {"ack": "nope", "o": "j"}),
    ("bad_ack", {"ack": [digest(b"x")], "o": 3}),
    ("bad_body", {"blobs": "nope"}),
    ("bad_body", {"blobs": [[1, 2]]}),
    ("bad_body", {"d": 5, "missing": True}),
])
def test_garbage_frames_are_counted_by_reason(reason: str, body: dict[str, Any]) -> None:
    """Rule 3: each malformed, oversized or hostile body is dropped and counted by reason."""
    _, b = pair()
    b.receive("a", body)
    assert b.x.tally.dropped == {reason: 1}
    assert b.blobs == {} and b.spools == {} and b.x.sizes()["assemblies"] == 0


def test_garbage_get_and_non_dict_bodies() -> None:
    """A get without a digest, and bodies that are not maps, are counted."""
    _, b = pair()
    b.receive("a", {"d": 12}, get=True)
    b.receive("a", [1, 2, 3])
    assert b.x.tally.dropped == {"bad_get": 1, "bad_body": 1}


_value = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.text(max_size=8),
                   st.binary(max_size=80), st.lists(st.integers(), max_size=3))


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.lists(st.tuples(st.booleans(), st.dictionaries(
    st.sampled_from(["d", "o", "size", "off", "data", "last", "get", "ack", "missing",
                     "blobs"]),
    st.one_of(_value, st.sampled_from([digest(b"t"), digest(b"u")]),
              st.lists(st.lists(_value, max_size=3), max_size=3)),
    max_size=7)), max_size=30))
def test_hostile_frames_never_raise_and_stay_bounded(frames: list) -> None:
    """Whatever bodies a peer sends, the protocol neither raises nor holds more assemblies
    than its limit, and every spool write follows its spool's end."""
    _, b = pair()
    b.blobs[digest(b"t")] = b"t"
    b.fetching.add(digest(b"u"))
    for get, body in frames:
        b.receive("a", body, get=get)
        assert b.x.sizes()["assemblies"] <= LIM.assemblies_max
        assert len(b.spools) <= LIM.assemblies_max


# --- bounds -------------------------------------------------------------------------------------


def test_assemblies_are_bounded() -> None:
    """At most assemblies_max blobs are received at once; more are dropped and counted."""
    _, b = pair()
    for i in range(LIM.assemblies_max + 2):
        data = big(2 * FB, seed=i)
        b.receive("a", chunk(digest(data), data[:FB], size=len(data), last=False))
    assert b.x.sizes()["assemblies"] == LIM.assemblies_max
    assert b.x.tally.dropped == {"assemblies_full": 2}


def test_send_queue_and_window_are_bounded() -> None:
    """At most send_queue_max blobs wait; at most inflight_max blobs and inflight_bytes_max
    bytes are unacknowledged at once per peer."""
    lim = XferLimits(frame_bytes=FB, window_frames=100, inflight_max=5, inflight_bytes_max=100,
                     send_queue_max=8)
    a = Member("a", lim)
    a.peers_up["b"] = True
    ds = tuple(a.put(bytes([i]) * 30) for i in range(10))
    a.do(a.x.copy("b", "job-b", ds, 0.0))
    assert a.x.tally.dropped == {"sends_full": 2}
    a.pump()
    sent = [e for _, body in a.take_out() for e in body["blobs"]]
    assert len(sent) == 3  # 3 * 30 bytes fit in 100, a fourth does not
    assert a.x.sizes()["inflight"] == 3


def test_large_blob_read_one_window_at_a_time() -> None:
    """Bounded memory: the sender reads a large blob only one window ahead of what it sent."""
    a, b = pair()
    data = big(40 * FB)
    d = a.put(data)
    a.do(a.x.copy("b", "job-m", (d,), 0.0))
    windows = 0
    while not a.copied:
        a.pump()
        frames = a.take_out()
        assert len(frames) <= LIM.window_frames
        # 4 chunks of 64 bytes need at most 6 reads of 50 bytes (one partly read ahead).
        assert a.reads <= (windows + 1) * LIM.window_frames * FB // 50 + 2
        windows += 1
        for _, body in frames:
            b.receive("a", body)
        for _, body in b.take_out():
            a.receive("b", body)
    assert windows == 10 and b.blobs[d] == data


# --- fetches ------------------------------------------------------------------------------------


def test_get_is_answered_with_chunks_or_missing() -> None:
    """A holder answers a get with the blob (`get`: True, no owner); a member without it says
    missing; an answer nobody waits for is dropped (unasked)."""
    a, b = pair()
    small = a.put(b"fetch me")
    large = a.put(big(3 * FB))
    absent = digest(b"absent")
    for d in (small, large, absent):
        a.receive("b", {"d": d}, get=True)
    b.fetching.update({small, large})
    exchange(a, b)
    assert b.blobs[small] == b"fetch me" and b.blobs[large] == a.blobs[large]
    assert sorted(b.found) == sorted([small, large])
    assert b.missing == [("a", absent)]
    assert not b.pins
    other = a.put(b"nobody waits")
    a.receive("b", {"d": other}, get=True)
    exchange(a, b)
    assert other not in b.blobs and b.x.tally.dropped == {"unasked": 1}


def test_default_limits_are_the_named_ones() -> None:
    """The protocol's limits default to meshjobs/limits.py's."""
    lim = XferLimits()
    assert lim.frame_bytes == limits.blob_frame_bytes
    assert lim.window_frames == limits.blob_window_frames
    assert lim.inflight_max == limits.blob_inflight_max
    assert lim.assemblies_max == limits.blob_assemblies_max
