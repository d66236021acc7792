"""The blob mover over real links on 127.0.0.1 and real LMDB blob stores: copies arrive durable
and pinned, fetches find a holder or give up, garbage from a peer is dropped and counted, and a
large blob is sent in bounded memory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from blobstore import LmdbBlobStore, hexdigest
from meshjobs import limits
from meshjobs.blobmover import BlobMover
from meshjobs.frames import Frame, FrameType
from tests.helpers import LinksMember, wait_until

SECRET = bytes(range(32))
WAIT_S = 30.0
MiB = 1 << 20
ROOT = Path(__file__).resolve().parent.parent



class Member(LinksMember):
    """A blob store, its links and its mover, with the links' and the mover's threads."""

    def __init__(self, name: str, base: Path, run_mover: bool = True,
                 clock_ms: Callable[[], float] | None = None,
                 wrap: Callable[[LmdbBlobStore], Any] | None = None) -> None:
        self.store_path = str(base / name / "blobs")
        self.spool = str(base / name / "spool")
        self.store = LmdbBlobStore(self.store_path)
        self.copied: list[tuple[str, tuple[str, ...]]] = []
        super().__init__(name, secret=SECRET, run=False)
        kw = {} if clock_ms is None else {"clock_ms": clock_ms}
        self.mover = BlobMover(name, self.store if wrap is None else wrap(self.store),
                               self.links, self.spool, on_copied=self._on_copied, **kw)
        if run_mover:
            self.threads.append(threading.Thread(target=self.mover.run, name=f"mover-{name}",
                                                 daemon=True))
        self.start()
        self.stopped = False

    def _on_frame(self, peer: str, frame: Frame) -> None:
        if frame.type in (FrameType.F_BLOB_PUT, FrameType.F_BLOB_GET):
            self.mover.frame(peer, frame.type, frame.body)

    def _on_copied(self, to: str, digests: tuple[str, ...]) -> None:
        with self._mu:
            self.copied.append((to, digests))

    def copies(self) -> list[tuple[str, tuple[str, ...]]]:
        with self._mu:
            return list(self.copied)

    def put(self, data: bytes, tmp: Path) -> str:
        path = tmp / f"payload-{self.name}-{hexdigest(data)[:16]}"
        path.write_bytes(data)
        return self.store.put_file(str(path))

    def dropped(self, reason: str) -> int:
        return self.mover.stats()["dropped"].get(reason, 0)

    def mover_alive(self) -> bool:
        return len(self.threads) == 2 and self.threads[1].is_alive()

    def start_mover(self) -> None:
        """Start the mover of a member made with its mover idle."""
        assert len(self.threads) == 1
        t = threading.Thread(target=self.mover.run, name=f"mover-{self.name}", daemon=True)
        self.threads.append(t)
        t.start()

    def put_many(self, payloads: list[bytes]) -> tuple[str, ...]:
        out: list[str] = []
        for i in range(0, len(payloads), 4096):
            got = self.store.write_batch(payloads[i:i + 4096])
            assert all(isinstance(d, str) for d in got), got
            out += got
        self.store.sync()
        return tuple(out)

    def stop(self) -> None:
        if self.stopped:
            return
        self.stopped = True
        self.mover.stop()
        super().stop()
        self.store.close()


@pytest.fixture
def fleet(tmp_path: Path):
    """make(*names) starts members and links every pair; all are stopped at the end."""
    made: list[Member] = []

    def make(*names: str, idle: tuple[str, ...] = ()) -> list[Member]:
        new = [Member(n, tmp_path, run_mover=n not in idle) for n in names]
        made.extend(new)
        for i, a in enumerate(new):
            for b in new[i + 1:]:
                a.links.connect(b.name, b.address)
        for a in new:
            for b in new:
                if a is not b:
                    wait_until(lambda a=a, b=b: a.links.peers().get(b.name, {}).get("up"),
                             what=f"{a.name} linked to {b.name}")
        return new

    try:
        yield make
    finally:
        for m in made:
            m.stop()


def copied_after(a: Member, to: str, owner: str = "job-witness") -> tuple[str, tuple[str, ...]]:
    """Copy one more small blob from `a` to `to` and wait for its on_copied: acknowledgements
    come in order on a link, so any later call for a copy asked before would have come by now.
    Returns that last copy, as a.copies() lists it."""
    (d,) = a.put_many([b"witness " + os.urandom(8)])
    done = len(a.copies())
    a.mover.copy(to, owner, (d,))
    wait_until(lambda: len(a.copies()) > done, what="the witness copy confirmed")
    return (to, (d,))


def mover_turned(m: Member) -> None:
    """Wait until `m`'s mover took everything asked of it so far and then ran a turn of its
    sending (what a wrong extra send would come from): a bad frame given after is counted
    (`bad_body`), and then a second one, which a later turn takes."""
    for _ in range(2):
        n = m.dropped("bad_body")
        m.mover.frame("witness", FrameType.F_BLOB_PUT, {})
        wait_until(lambda n=n: m.dropped("bad_body") > n, what="the mover's next turn")


def read_all(store: LmdbBlobStore, d: str) -> bytes | None:
    it = store.open(d)
    return None if it is None else b"".join(it)


def test_copy_arrives_durable_and_pinned(fleet, tmp_path: Path) -> None:
    """A copy of an empty, a small and a multi-chunk blob lands in the receiver's store, durable
    and pinned for the owner, and on_copied fires once with the digests."""
    a, b = fleet("a", "b")
    payloads = [b"", b"hello, blobs", os.urandom(5 * MiB + 12345)]
    digests = tuple(a.put(p, tmp_path) for p in payloads)
    a.mover.copy("b", "job-1", digests)
    wait_until(a.copies, what="on_copied")
    st_a, st_b = a.mover.stats(), b.mover.stats()
    assert st_a["copies_completed"] == 1 and st_a["acks_received"] == 3
    assert st_b["blobs_received"] == 3 and st_b["dropped"] == {}
    assert st_a["chunks_sent"] == 1 + 1 + 6
    # A second call would come from a second acknowledgement, before a later copy's.
    last = copied_after(a, "b", owner="job-1")
    assert a.copies() == [("b", digests), last]
    assert os.listdir(b.spool) == []
    b.stop()
    # Reopened from disk: the copies survived the receiver's restart, checked and pinned.
    with LmdbBlobStore(b.store_path) as store:
        for d, p in zip(digests, payloads, strict=True):
            assert read_all(store, d) == p
            assert store.pinned(d)
        assert store.owners() == {"job-1"}


def test_copy_of_held_blob_is_acked_not_stored_again(fleet, tmp_path: Path) -> None:
    """A blob the receiver already holds is acknowledged (and pinned) without a second copy."""
    a, b = fleet("a", "b")
    data = os.urandom(3 * MiB)
    d = a.put(data, tmp_path)
    assert b.put(data, tmp_path) == d
    before = b.store.stats()
    a.mover.copy("b", "job-2", (d,))
    wait_until(a.copies, what="on_copied")
    assert a.copies() == [("b", (d,))]
    after = b.store.stats()
    assert after["blobs"] == before["blobs"] == 1
    assert after["bytes"] == before["bytes"]
    assert b.mover.stats()["blobs_received"] == 0
    assert b.store.pinned(d) and b.store.owners() == {"job-2"}


def test_copy_asked_twice_is_sent_once(fleet, tmp_path: Path) -> None:
    """The same copy asked again while under way is sent once and confirmed once."""
    a, b = fleet("a", "b")
    data = os.urandom(4 * MiB)
    d = a.put(data, tmp_path)
    a.mover.copy("b", "job-4", (d,))
    a.mover.copy("b", "job-4", (d,))
    wait_until(a.copies, what="on_copied")
    last = copied_after(a, "b")
    assert a.copies() == [("b", (d,)), last]
    assert a.mover.stats()["chunks_sent"] == 4 + 1
    assert b.mover.stats()["chunks_received"] == 4 + 1


def test_stale_assembly_is_removed(tmp_path: Path) -> None:
    """A blob whose chunks stop coming is removed, with its spool file, once it is idle for
    `blob_assembly_idle_ms`."""
    now = [0.0]
    m = Member("m", tmp_path, clock_ms=lambda: now[0])
    try:
        # A witness assembly, opened 2 ms before the one under test: the look at the
        # assemblies that drops it is one that found the other 1 ms short of the limit.
        for n, (ms, tag) in enumerate(((2, b"w"), (0, b"d")), start=1):
            data = tag + os.urandom(2 * limits.blob_frame_bytes - 1)
            d = hexdigest(data)
            m.mover.frame("p", FrameType.F_BLOB_PUT,
                          good_chunk(d, data[:limits.blob_frame_bytes], size=len(data), last=False))
            wait_until(lambda n=n: m.mover.stats()["assemblies"] == n, what="assembly open")
            now[0] += ms
        assert len(os.listdir(m.spool)) == 2
        now[0] += limits.blob_assembly_idle_ms - 1
        wait_until(lambda: m.dropped("stale") == 1, what="the witness assembly dropped")
        assert m.mover.stats()["assemblies"] == 1
        now[0] += 1000  # past the idle limit, and past the mover's next look at its assemblies
        wait_until(lambda: m.dropped("stale") == 2, what="stale assembly dropped")
        assert m.mover.stats()["assemblies"] == 0 and os.listdir(m.spool) == []
    finally:
        m.stop()


def test_copy_of_blob_not_held_is_skipped(fleet, tmp_path: Path) -> None:
    """A digest the sender does not hold is skipped: nothing reaches the peer, no on_copied."""
    a, b = fleet("a", "b")
    missing = hexdigest(b"nobody has this")
    a.mover.copy("b", "job-3", (missing,))
    wait_until(lambda: a.dropped("not_here"), what="not_here counted")
    last = copied_after(a, "b")
    assert a.copies() == [last]
    assert not b.store.has(missing)


def test_fetch_from_holder(fleet, tmp_path: Path) -> None:
    """A fetch finds the blob on the peer that holds it; concurrent fetches share one transfer."""
    a, b, c = fleet("a", "b", "c")
    data = os.urandom(2 * MiB + 7)
    d = a.put(data, tmp_path)
    results: list[bool] = []

    def one() -> None:
        results.append(c.mover.fetch(d, 20))

    threads = [threading.Thread(target=one) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT_S)
    assert results == [True] * 4
    assert read_all(c.store, d) == data
    assert a.mover.stats()["gets_served"] == 1
    assert b.mover.stats()["gets_missing"] == 1
    assert c.mover.stats()["fetches_found"] == 1
    assert c.mover.fetch(d, 1) is True  # held now: answered from the store


def test_fetch_of_unknown_blob_fails_before_timeout(fleet) -> None:
    """When every linked peer says it does not hold the blob, fetch is False at once."""
    a, b, c = fleet("a", "b", "c")
    d = hexdigest(b"held by no member")
    t0 = time.monotonic()
    assert c.mover.fetch(d, 20) is False
    assert time.monotonic() - t0 < 10
    assert a.mover.stats()["gets_missing"] == 1 and b.mover.stats()["gets_missing"] == 1
    assert c.mover.stats()["fetches_failed"] == 1


def test_fetch_with_holder_down_times_out(fleet, tmp_path: Path) -> None:
    """A linked peer that never answers (its mover is down) leaves fetch to its timeout."""
    a, b = fleet("a", "b", idle=("a",))
    d = a.put(b"only a has it", tmp_path)
    t0 = time.monotonic()
    assert b.mover.fetch(d, 1.0) is False
    assert time.monotonic() - t0 >= 1.0
    assert not b.store.has(d)
    assert b.mover.stats()["fetches_failed"] == 1


def test_fetch_with_no_peer_linked_fails(tmp_path: Path) -> None:
    """With no linked peer to ask, fetch answers False without waiting."""
    m = Member("lonely", tmp_path)
    try:
        assert m.mover.fetch(hexdigest(b"x"), 20) is False
    finally:
        m.stop()


def good_chunk(d: str, data: bytes, **over: Any) -> dict[str, Any]:
    body = {"d": d, "o": "job-g", "size": len(data), "off": 0, "data": data, "last": True}
    body.update(over)
    return body


def test_garbage_puts_are_dropped_and_counted(fleet, tmp_path: Path) -> None:
    """Malformed F_BLOB_PUT/F_BLOB_GET bodies drop their assembly and are counted by reason;
    nothing is stored from them and the mover keeps working."""
    a, b = fleet("a", "b")
    data = os.urandom(3 * limits.blob_frame_bytes // 2)
    d = hexdigest(data)
    half = limits.blob_frame_bytes
    put = FrameType.F_BLOB_PUT
    cases: list[tuple[str, dict[str, Any]]] = [
        ("bad_body", good_chunk(d, data[:10], size="10")),
        ("bad_body", good_chunk(d, "text", size=4)),
        ("bad_body", good_chunk(d, b"x", size=1, last=1)),
        ("bad_body", good_chunk("not-a-digest", b"x", size=1)),
        ("bad_body", good_chunk(d, b"x", size=1, o=7)),
        ("bad_body", good_chunk(d, b"x", size=1, off=True)),
        ("bad_offset", good_chunk(d, b"x", size=10, off=-1, last=False)),
        ("bad_offset", good_chunk(d, b"xy", size=1, off=0)),
        ("bad_offset", good_chunk(d, b"x", size=5, off=9)),
        ("bad_offset", good_chunk(d, b"x", size=5, off=0, last=True)),
        ("bad_offset", good_chunk(d, b"", size=5, off=0, last=False)),
        ("too_large", good_chunk(d, b"x", size=limits.blob_assembly_bytes_max + 1,
                                 last=False)),
        ("digest_mismatch", good_chunk(d, b"these bytes are not the blob")),
        ("bad_ack", {"ack": "nope", "o": "job-g"}),
        ("bad_ack", {"ack": [d], "o": 3}),
    ]
    for _reason, body in cases:
        b.mover.frame("a", put, body)
    b.mover.frame("a", FrameType.F_BLOB_GET, {"d": 12})
    # Out of order: the first half, then the first half again at the wrong offset.
    b.mover.frame("a", put, good_chunk(d, data[:half], size=len(data), last=False))
    b.mover.frame("a", put, good_chunk(d, data[half:], size=len(data), off=half - 1,
                                       last=False))
    # An orphan middle chunk, with no first chunk before it.
    e = hexdigest(b"e")
    b.mover.frame("a", put, good_chunk(e, b"e", size=2, off=1, last=True))
    want: dict[str, int] = {}
    for reason, _ in cases:
        want[reason] = want.get(reason, 0) + 1
    want["bad_get"] = 1
    want["out_of_order"] = 2
    try:
        wait_until(lambda: b.mover.stats()["dropped"] == want, timeout_s=10)
    finally:
        print("dropped:", b.mover.stats()["dropped"], "wanted:", want)
    assert b.mover_alive()
    assert b.mover.stats()["assemblies"] == 0
    assert b.store.stats()["blobs"] == 0
    assert os.listdir(b.spool) == []
    # The mover still works: a real copy of the same blob afterwards succeeds.
    assert a.put(data, tmp_path) == d
    a.mover.copy("b", "job-g", (d,))
    wait_until(a.copies, what="on_copied after garbage")
    assert read_all(b.store, d) == data and b.store.pinned(d)


_value = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.text(max_size=8),
                   st.binary(max_size=64), st.lists(st.integers(), max_size=3))


def test_random_garbage_never_stops_the_mover(fleet, tmp_path: Path) -> None:
    """Whatever the bodies of blob frames from a peer, the mover neither raises nor leaks an
    assembly past its limit, and a good copy works afterwards."""
    a, b = fleet("a", "b")
    d = hexdigest(b"target")
    keys = st.sampled_from(["d", "o", "size", "off", "data", "last", "get", "ack", "missing"])
    digests = st.sampled_from([d, hexdigest(b"other")])
    body = st.dictionaries(keys, st.one_of(_value, digests), max_size=9)
    frames = st.lists(st.tuples(st.sampled_from([FrameType.F_BLOB_PUT, FrameType.F_BLOB_GET]),
                                body), max_size=20)

    @settings(max_examples=150, deadline=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(frames)
    def feed(batch: list[tuple[FrameType, dict[str, Any]]]) -> None:
        for ftype, fbody in batch:
            b.mover.frame("a", ftype, fbody)

    feed()
    wait_until(lambda: b.mover.stats()["inbox"] == 0, what="inbox drained")
    assert b.mover_alive()
    assert b.mover.stats()["assemblies"] <= limits.blob_assemblies_max
    data = os.urandom(MiB + 1)
    dd = a.put(data, tmp_path)
    a.mover.copy("b", "job-r", (dd,))
    wait_until(a.copies, what="on_copied after random garbage")
    assert read_all(b.store, dd) == data


SENDER = r"""
import json, sys, threading, time, tracemalloc
from blobstore import LmdbBlobStore
from meshjobs.blobmover import BlobMover
from meshjobs.frames import FrameType
from meshjobs.links import Links

secret, host, port, store_dir, spool, payload = sys.argv[1:7]
store = LmdbBlobStore(store_dir)
d = store.put_file(payload)
tracemalloc.start()  # the blob is stored already: only the copy is measured
done = threading.Event()
mover = None

def on_frame(peer, frame):
    if frame.type in (FrameType.F_BLOB_PUT, FrameType.F_BLOB_GET):
        mover.frame(peer, frame.type, frame.body)

links = Links("s", "boot-s", ("127.0.0.1", 0), bytes.fromhex(secret), on_frame=on_frame)
mover = BlobMover("s", store, links, spool, on_copied=lambda to, ds: done.set())
threads = [threading.Thread(target=links.run, daemon=True),
           threading.Thread(target=mover.run, daemon=True)]
for t in threads:
    t.start()
links.connect("r", (host, int(port)))
deadline = time.monotonic() + 30
while not links.peers()["r"]["up"] and time.monotonic() < deadline:
    time.sleep(0.02)
mover.copy("r", "job-big", (d,))
ok = done.wait(120)
peak = tracemalloc.get_traced_memory()[1]
stats = mover.stats()
mover.stop()
links.stop()
for t in threads:
    t.join(30)
store.close()
print("RESULT " + json.dumps({"ok": ok, "digest": d, "peak": peak, "stats": stats}), flush=True)
"""


def test_large_copy_in_bounded_sender_memory(fleet, tmp_path: Path) -> None:
    """A 50 MB blob is copied while the sender (its own process) holds far less than 50 MB of
    Python memory at its peak: it streams the blob in windows, never the whole of it."""
    (r,) = fleet("r")
    size = 50 * 1000 * 1000
    payload = tmp_path / "big.bin"
    with open(payload, "wb") as f:
        left = size
        while left:
            n = min(left, MiB)
            f.write(os.urandom(n))
            left -= n
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    host, port = r.address
    proc = subprocess.run(
        [sys.executable, "-c", SENDER, SECRET.hex(), host, str(port),
         str(tmp_path / "s" / "blobs"), str(tmp_path / "s" / "spool"), str(payload)],
        cwd=str(ROOT), env=env, capture_output=True, text=True, timeout=240)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:] + proc.stdout[-3000:]
    out = json.loads(lines[-1][len("RESULT "):])
    assert out["ok"], out
    assert out["peak"] < 20 * MiB, out
    d = out["digest"]
    assert r.store.size(d) == size and r.store.pinned(d)
    with open(payload, "rb") as f:
        for chunk in r.store.open(d):
            assert chunk == f.read(len(chunk))
    assert r.mover.stats()["dropped"] == {}


def small_payloads(n: int, salt: bytes = b"") -> list[bytes]:
    """`n` distinct payloads of 8 to 16 bytes (a salt of at most 4 bytes, then the index)."""
    assert len(salt) <= 4
    return [(salt + i.to_bytes(4, "big") + os.urandom(16))[:8 + i % 9] for i in range(n)]


def test_copy_of_many_small_blobs(fleet) -> None:
    """A copy of 20,000 distinct small blobs (an array job's stdins) completes: every one
    durable and pinned at the receiver, stored in batches (far fewer fsyncs than blobs), and
    on_copied fires once with all the digests."""
    a, b = fleet("a", "b")
    n = 20_000
    payloads = small_payloads(n)
    assert all(8 <= len(p) <= 16 for p in payloads)
    digests = a.put_many(payloads)
    assert len(set(digests)) == n
    t0 = time.monotonic()
    a.mover.copy("b", "job-many", digests)
    wait_until(a.copies, timeout_s=WAIT_S, what="on_copied for 20,000 small blobs")
    took = time.monotonic() - t0
    print(f"copied {n} small blobs in {took:.2f} s")
    st_a, st_b = a.mover.stats(), b.mover.stats()
    assert st_a["blobs_sent"] == n and st_a["acks_received"] == n
    assert st_b["blobs_received"] == n and st_b["dropped"] == {} and st_a["dropped"] == {}
    assert st_a["sending"] == 0 and st_a["inflight"] == 0
    assert b.store.stats()["fsyncs"] < n // 10
    assert os.listdir(b.spool) == []
    for d, p in zip(digests, payloads, strict=True):
        assert b.store.get(d) == p
    assert b.store.owners() == {"job-many"} and b.store.stats()["pins"] == n
    last = copied_after(a, "b")
    assert a.copies() == [("b", digests), last]


def test_copy_of_small_and_large_blobs_mixed(fleet, tmp_path: Path) -> None:
    """Small blobs travel packed and larger ones in chunks on the same link: 5,000 small and
    three multi-chunk blobs all arrive intact and pinned."""
    a, b = fleet("a", "b")
    small = small_payloads(5_000, salt=b"m")
    large = [os.urandom(limits.blob_frame_bytes + 1), os.urandom(3 * MiB + 5),
             os.urandom(2 * limits.blob_frame_bytes)]
    small_ds = a.put_many(small)
    large_ds = tuple(a.put(p, tmp_path) for p in large)
    # The large ones sit among the small ones in the copy's order.
    digests = small_ds[:100] + large_ds[:1] + small_ds[100:2500] + large_ds[1:] + small_ds[2500:]
    a.mover.copy("b", "job-mix", digests)
    wait_until(a.copies, what="on_copied for the mixed copy")
    assert a.copies() == [("b", digests)]
    st_b = b.mover.stats()
    assert st_b["blobs_received"] == len(digests) and st_b["dropped"] == {}
    for d, p in zip(large_ds, large, strict=True):
        assert read_all(b.store, d) == p and b.store.pinned(d)
    for d, p in zip(small_ds, small, strict=True):
        assert b.store.get(d) == p
    assert b.store.stats()["pins"] == len(digests)
    assert os.listdir(b.spool) == []


def test_copy_asked_again_while_in_flight_is_not_sent_twice(fleet) -> None:
    """While the receiver does not acknowledge, the sender has at most `blob_inflight_max`
    blobs on the way and reads no more; the same copy asked again meanwhile adds nothing, and
    once the receiver answers every blob is sent exactly once."""
    a, b = fleet("a", "b", idle=("b",))
    n = 3 * limits.blob_inflight_max + 17
    digests = a.put_many(small_payloads(n, salt=b"w"))
    a.mover.copy("b", "job-w", digests)
    wait_until(lambda: a.mover.stats()["inflight"] == limits.blob_inflight_max,
             what="a full window")
    a.mover.copy("b", "job-w", digests)
    a.mover.copy("b", "job-w", digests[:10])  # another copy of some of the same blobs
    mover_turned(a)
    st = a.mover.stats()
    assert st["blobs_sent"] == limits.blob_inflight_max
    assert st["inflight"] == limits.blob_inflight_max
    assert st["sending"] == n - limits.blob_inflight_max
    b.start_mover()
    wait_until(lambda: len(a.copies()) == 2, what="both copies confirmed")
    st_a, st_b = a.mover.stats(), b.mover.stats()
    assert st_a["blobs_sent"] == n and st_b["chunks_received"] == n
    assert st_b["blobs_received"] == n and st_a["dropped"] == {"bad_body": 2}  # mover_turned's
    assert sorted(a.copies()[:2]) == sorted([("b", digests), ("b", digests[:10])])
    last = copied_after(a, "b")
    assert a.copies()[2:] == [last]


def test_fetch_of_small_blob(fleet) -> None:
    """A fetch of a blob of one chunk is answered as one chunk and stored with the turn's
    batch; the fetch returns True with the blob in the store."""
    a, b = fleet("a", "b")
    (d,) = a.put_many([b"a small stdin"])
    assert b.mover.fetch(d, 20) is True
    assert b.store.get(d) == b"a small stdin"
    assert a.mover.stats()["gets_served"] == 1
    assert b.mover.stats()["fetches_found"] == 1 and b.mover.stats()["blobs_received"] == 1


class _NoBatches:
    """A real store seen through the calls a store without `write_batch` offers."""

    def __init__(self, store: LmdbBlobStore) -> None:
        self._store = store
        self.puts = 0

    def put(self, data: bytes) -> str:
        self.puts += 1
        return self._store.put(data)

    def __getattr__(self, name: str) -> Any:
        if name in ("write_batch", "sync"):
            raise AttributeError(name)
        return getattr(self._store, name)


def test_store_without_batches_keeps_blobs_one_by_one(fleet, tmp_path: Path) -> None:
    """A receiver whose store has no `write_batch` stores small blobs with `put` and pins
    them; the copy completes as with any store."""
    made: list[_NoBatches] = []

    def wrap(store: LmdbBlobStore) -> _NoBatches:
        made.append(_NoBatches(store))
        return made[-1]

    (a,) = fleet("a")
    b = Member("b", tmp_path, wrap=wrap)
    try:
        a.links.connect("b", b.address)
        wait_until(lambda: a.links.peers().get("b", {}).get("up")
                 and b.links.peers().get("a", {}).get("up"), what="linked")
        payloads = small_payloads(300, salt=b"n")
        digests = a.put_many(payloads)
        a.mover.copy("b", "job-n", digests)
        wait_until(a.copies, what="on_copied through a store without batches")
        assert made[0].puts == len(payloads)
        for d, p in zip(digests, payloads, strict=True):
            assert b.store.get(d) == p and b.store.pinned(d)
    finally:
        b.stop()


def test_garbage_packs_are_dropped_and_counted(fleet) -> None:
    """Malformed packs of small blobs are dropped and counted by reason; the good entries of a
    pack are stored, pinned and acknowledged all the same."""
    a, b = fleet("a", "b", idle=("a",))
    good = b"a good small blob"
    d = hexdigest(good)
    put = FrameType.F_BLOB_PUT
    cases: list[tuple[str, dict[str, Any]]] = [
        ("bad_body", {"blobs": "nope"}),
        ("bad_body", {"blobs": [[d, "job-p"]]}),
        ("bad_body", {"blobs": [[d, "job-p", "text"]]}),
        ("bad_body", {"blobs": [[d, 5, good]]}),
        ("bad_body", {"blobs": [["not-a-digest", "job-p", good]]}),
        ("bad_body", {"blobs": [], "extra": 1}),
        ("bad_offset", {"blobs": [[d, "job-p", bytes(limits.blob_frame_bytes + 1)]]}),
        ("digest_mismatch", {"blobs": [[d, "job-p", b"other bytes"]]}),
    ]
    for _reason, body in cases:
        b.mover.frame("a", put, body)
    want: dict[str, int] = {}
    for reason, _ in cases:
        want[reason] = want.get(reason, 0) + 1
    wait_until(lambda: b.mover.stats()["dropped"] == want, timeout_s=10,
             what=f"dropped == {want}")
    assert b.store.stats()["blobs"] == 0
    b.mover.frame("a", put, {"blobs": [[d, "job-p", b"wrong"], [d, "job-p", good]]})
    want["digest_mismatch"] += 1
    wait_until(lambda: b.mover.stats()["acks_sent"] == 1, what="the good entry acknowledged")
    assert b.mover.stats()["dropped"] == want
    assert b.store.get(d) == good and b.store.pinned(d)
    assert b.mover_alive()
