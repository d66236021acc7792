"""Tests of blobstore: round trips, the LMDB store against its in-memory twin, damage on disk,
restarts, threads, bad input, failing fsyncs and a map that has to grow."""

from __future__ import annotations

import errno
import math
import random
import shutil
import tempfile
import threading
import tracemalloc
from pathlib import Path

import blake3
import hypothesis.strategies as st
import lmdb
import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import Bundle, RuleBasedStateMachine, invariant, rule

from blobstore import (
    BlobCorrupt,
    BlobGone,
    LmdbBlobStore,
    MemoryBlobStore,
    hexdigest,
    is_digest,
    limits,
)
from blobstore.store import _chunk_value

CHUNK = limits.chunk_bytes
EMPTY_BLAKE3 = "af1349b9f5f9a1a6a0404dea36dcc9499bcb25c9adc112b7cc9a93cae41f3262"


class Failpoints:
    """Raises OSError at a named point once it has been passed `after` times."""

    def __init__(self) -> None:
        self.armed: dict[str, int] = {}
        self.hits: dict[str, int] = {}

    def arm(self, name: str, after: int = 0) -> None:
        self.armed[name] = after

    def hit(self, name: str) -> None:
        self.hits[name] = self.hits.get(name, 0) + 1
        left = self.armed.get(name)
        if left is None:
            return
        if left <= 0:
            raise OSError(errno.EIO, f"failpoint {name}")
        self.armed[name] = left - 1


def payload(size: int, seed: int = 0) -> bytes:
    return random.Random(seed).randbytes(size)


def raw_entries(path: Path, db: bytes) -> int:
    """How many entries a named db of a closed store holds, read through a raw LMDB handle."""
    env = lmdb.open(str(path), readonly=True, max_dbs=limits.dbs_max, lock=False)
    try:
        with env.begin() as txn:
            return txn.stat(env.open_db(db, txn=txn, create=False))["entries"]
    finally:
        env.close()


@pytest.fixture(params=["lmdb", "memory"])
def store(request: pytest.FixtureRequest, tmp_path: Path):
    s = LmdbBlobStore(str(tmp_path / "blobs")) if request.param == "lmdb" else MemoryBlobStore()
    yield s
    s.close()


# --- digests -------------------------------------------------------------------------------------


def test_digest_of_known_bytes_matches_blake3() -> None:
    """A digest is blake3-256 in lowercase hex, the same as the blake3 package gives."""
    assert hexdigest(b"") == EMPTY_BLAKE3
    assert hexdigest(b"meshjobs") == blake3.blake3(b"meshjobs").hexdigest()


@pytest.mark.parametrize(
    "value, ok",
    [
        (EMPTY_BLAKE3, True),
        ("0" * 64, True),
        (EMPTY_BLAKE3.upper(), False),
        (EMPTY_BLAKE3[:-1], False),
        (EMPTY_BLAKE3 + "0", False),
        (EMPTY_BLAKE3 + "\n", False),
        ("g" * 64, False),
        (b"0" * 64, False),
        (None, False),
        (64, False),
    ],
)
def test_is_digest(value: object, ok: bool) -> None:
    """A digest is exactly 64 lowercase hex characters in a str."""
    assert is_digest(value) is ok


# --- round trips ---------------------------------------------------------------------------------

SIZES = [0, 1, 300, CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK + 17]


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("how", ["put", "put_file", "put_stream"])
def test_round_trip(store, tmp_path: Path, size: int, how: str) -> None:
    """What goes in by put, put_file or put_stream comes out the same by get and open."""
    data = payload(size, seed=size)
    if how == "put":
        digest = store.put(data)
    elif how == "put_file":
        f = tmp_path / "payload"
        f.write_bytes(data)
        digest = store.put_file(str(f))
    else:
        rng = random.Random(size)
        cuts = sorted(rng.randrange(size + 1) for _ in range(5))
        pieces = [data[a:b] for a, b in zip([0, *cuts], [*cuts, size], strict=True)]
        digest = store.put_stream(iter(pieces))
    assert digest == blake3.blake3(data).hexdigest()
    assert store.has(digest)
    assert store.size(digest) == size
    assert store.get(digest) == data
    chunks = list(store.open(digest))
    assert b"".join(chunks) == data
    assert len(chunks) == math.ceil(size / CHUNK)
    assert all(len(c) <= CHUNK for c in chunks)
    assert store.verify() == []


def test_identical_payloads_are_stored_once(store) -> None:
    """Putting the same bytes again, by any path, adds no blob and no bytes."""
    data = payload(CHUNK + 5)
    d1 = store.put(data)
    d2 = store.put_stream([data[:10], data[10:]])
    d3 = store.put(b"other")
    assert d1 == d2 != d3
    stats = store.stats()
    assert stats["blobs"] == 2
    assert stats["bytes"] == len(data) + 5
    assert stats["puts"] == 3


def test_absent_blob(store) -> None:
    """An absent digest answers None, None, None and False."""
    assert store.get(EMPTY_BLAKE3) is None
    assert store.open(EMPTY_BLAKE3) is None
    assert store.size(EMPTY_BLAKE3) is None
    assert store.has(EMPTY_BLAKE3) is False
    assert store.pinned(EMPTY_BLAKE3) is False


def test_large_file_streams_in_bounded_memory_and_dedupes(tmp_path: Path) -> None:
    """A payload larger than one transaction's budget streams in over several transactions in
    bounded memory; putting it again leaves no second copy of its chunks behind."""
    size = 3 * limits.txn_payload_bytes_max + 12345
    src = tmp_path / "big"
    with open(src, "wb") as f:
        rng = random.Random(3)
        left = size
        while left:
            n = min(left, 8 * CHUNK)
            f.write(rng.randbytes(n))
            left -= n
    path = tmp_path / "blobs"
    s = LmdbBlobStore(str(path))
    tracemalloc.start()
    try:
        digest = s.put_file(str(src))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < limits.txn_payload_bytes_max + 8 * CHUNK
    assert s.put_file(str(src)) == digest
    hasher = blake3.blake3()
    for chunk in s.open(digest):
        hasher.update(chunk)
    assert hasher.hexdigest() == digest
    assert s.stats()["blobs"] == 1
    assert s.stats()["bytes"] == size
    s.close()
    assert raw_entries(path, b"chunks") == math.ceil(size / CHUNK)
    assert raw_entries(path, b"pending") == 0


def test_failed_stream_leaves_no_chunks(tmp_path: Path) -> None:
    """A streaming put whose source fails part way removes what it had written."""
    path = tmp_path / "blobs"
    s = LmdbBlobStore(str(path))

    def source():
        for i in range(limits.txn_payload_bytes_max // CHUNK + 3):
            yield payload(CHUNK, seed=i)
        raise RuntimeError("source broke")

    with pytest.raises(RuntimeError, match="source broke"):
        s.put_stream(source())
    assert s.stats()["blobs"] == 0
    s.close()
    assert raw_entries(path, b"chunks") == 0
    assert raw_entries(path, b"pending") == 0


def test_stream_left_by_a_dead_put_is_swept_on_open(tmp_path: Path) -> None:
    """Chunks of a streaming put that could neither finish nor clean up are removed when the
    store is next opened."""
    path = tmp_path / "blobs"
    fp = Failpoints()
    s = LmdbBlobStore(str(path), failpoints=fp)
    fp.arm("blob.write", after=1)  # the first part commits; the last one and the cleanup fail
    data = payload(limits.txn_payload_bytes_max + 3 * CHUNK)
    with pytest.raises(OSError):
        s.put_stream([data[i : i + CHUNK] for i in range(0, len(data), CHUNK)])
    s.close()
    assert raw_entries(path, b"pending") == 1
    assert raw_entries(path, b"chunks") > 0
    LmdbBlobStore(str(path)).close()
    assert raw_entries(path, b"pending") == 0
    assert raw_entries(path, b"chunks") == 0


# --- the LMDB store beside its twin --------------------------------------------------------------

BIG = payload(CHUNK + 3, seed=11)
PAYLOADS = st.one_of(
    st.binary(max_size=64),
    st.sampled_from([b"", b"a", b"b", BIG, BIG[:CHUNK]]),
)
OWNERS = st.sampled_from(["job-1", "job-2", "job-3", "jøb 4"])


class TwinMachine(RuleBasedStateMachine):
    """The LMDB store and the memory twin, driven alike, give the same answers every step."""

    digests = Bundle("digests")

    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="blobtwin-")
        self.now = 1_000.0
        self.disk = LmdbBlobStore(self.dir, map_bytes=1 << 20, clock=self.clock)
        self.mem = MemoryBlobStore(clock=self.clock)

    def clock(self) -> float:
        return self.now

    @rule(target=digests, data=PAYLOADS)
    def put(self, data: bytes) -> str:
        d = self.disk.put(data)
        assert d == self.mem.put(data) == hexdigest(data)
        return d

    @rule(target=digests, data=PAYLOADS, cuts=st.lists(st.integers(0, CHUNK + 3), max_size=4))
    def put_stream(self, data: bytes, cuts: list[int]) -> str:
        ends = sorted(min(c, len(data)) for c in cuts)
        pieces = [data[a:b] for a, b in zip([0, *ends], [*ends, len(data)], strict=True)]
        d = self.disk.put_stream(pieces)
        assert d == self.mem.put_stream(pieces) == hexdigest(data)
        return d

    @rule(d=st.one_of(digests, st.binary(min_size=32, max_size=32).map(bytes.hex)))
    def read(self, d: str) -> None:
        assert self.disk.has(d) == self.mem.has(d)
        assert self.disk.size(d) == self.mem.size(d)
        assert self.disk.get(d) == self.mem.get(d)
        assert self.disk.pinned(d) == self.mem.pinned(d)
        it = self.disk.open(d)
        assert (it is None) == (self.mem.open(d) is None)
        if it is not None:
            assert b"".join(it) == self.mem.get(d)

    @rule(d=digests, owner=OWNERS)
    def pin(self, d: str, owner: str) -> None:
        self.disk.pin(d, owner)
        self.mem.pin(d, owner)

    @rule(owner=OWNERS)
    def unpin_owner(self, owner: str) -> None:
        assert self.disk.unpin_owner(owner) == self.mem.unpin_owner(owner)

    @rule(dt=st.floats(0, 100, allow_nan=False))
    def advance(self, dt: float) -> None:
        self.now += dt

    @rule(grace=st.sampled_from([0.0, 5.0, 50.0, 500.0]))
    def collect(self, grace: float) -> None:
        kept = [d for d in self.mem._blobs if self.mem.pinned(d)]
        assert self.disk.collect(grace, self.now) == self.mem.collect(grace, self.now)
        for d in kept:
            assert self.disk.has(d), "a pinned blob was collected"
            assert self.mem.has(d)

    @rule()
    def reopen(self) -> None:
        self.disk.close()
        self.disk = LmdbBlobStore(self.dir, map_bytes=1 << 20, clock=self.clock)

    @invariant()
    def same_counts(self) -> None:
        a, b = self.disk.stats(), self.mem.stats()
        assert (a["blobs"], a["bytes"], a["pins"]) == (b["blobs"], b["bytes"], b["pins"])
        assert self.disk.owners() == self.mem.owners()

    def teardown(self) -> None:
        self.disk.close()
        shutil.rmtree(self.dir, ignore_errors=True)


TwinMachine.TestCase.settings = settings(
    max_examples=40,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
test_lmdb_store_agrees_with_memory_twin = TwinMachine.TestCase


# --- damage on disk ------------------------------------------------------------------------------


@pytest.mark.parametrize("size, bad_chunk", [(300, 0), (3 * CHUNK + 100, 2)])
def test_flipped_byte_on_disk_is_caught(tmp_path: Path, size: int, bad_chunk: int) -> None:
    """One flipped byte in data.mdb: get raises, open raises before yielding the bad chunk,
    verify lists the blob, and other blobs still read."""
    path = tmp_path / "blobs"
    data = payload(size, seed=5)
    s = LmdbBlobStore(str(path))
    good = s.put(b"an innocent neighbour")
    digest = s.put(data)
    s.close()

    mdb = path / "data.mdb"
    raw = bytearray(mdb.read_bytes())
    at = bad_chunk * CHUNK + min(100, size // 2)
    needle = data[at : at + 64]
    assert raw.count(needle) == 1
    raw[raw.find(needle) + 7] ^= 0x01
    mdb.write_bytes(bytes(raw))

    s = LmdbBlobStore(str(path))
    try:
        with pytest.raises(BlobCorrupt) as e:
            s.get(digest)
        assert e.value.digest == digest
        served = []
        with pytest.raises(BlobCorrupt):
            for chunk in s.open(digest):
                served.append(chunk)
        assert served == [data[i * CHUNK : (i + 1) * CHUNK] for i in range(bad_chunk)]
        assert s.verify() == [digest]
        assert s.get(good) == b"an innocent neighbour"
        # check names the damage; drop_damaged removes only a damaged blob, keeps its pins, and a
        # good copy put in its place is served again.
        s.pin(digest, "job-1")
        assert s.check(digest) is False and s.check(good) is True
        assert s.check("0" * 64) is None
        assert s.drop_damaged(good) is False and s.get(good) == b"an innocent neighbour"
        assert s.drop_damaged(digest) is True and s.check(digest) is None
        assert s.pinned(digest)
        assert s.put(data) == digest and s.get(digest) == data and s.verify() == []
    finally:
        s.close()


def test_chunk_rewritten_with_its_checksum_is_caught_before_the_last_chunk(tmp_path: Path) -> None:
    """A chunk replaced along with a matching checksum passes the chunk check, but the payload no
    longer hashes to its digest, so open raises before handing out the last chunk."""
    path = tmp_path / "blobs"
    data = payload(2 * CHUNK + 10, seed=6)
    s = LmdbBlobStore(str(path))
    digest = s.put(data)
    s.close()

    env = lmdb.open(str(path), max_dbs=limits.dbs_max)
    with env.begin(write=True) as txn:
        db = env.open_db(b"chunks", txn=txn, create=False)
        cur = txn.cursor(db=db)
        assert cur.last()
        txn.put(cur.key(), _chunk_value(b"x" * 10), db=db)
    env.close()

    s = LmdbBlobStore(str(path))
    try:
        served = []
        with pytest.raises(BlobCorrupt):
            for chunk in s.open(digest):
                served.append(chunk)
        assert served == [data[:CHUNK], data[CHUNK : 2 * CHUNK]]
        with pytest.raises(BlobCorrupt):
            s.get(digest)
        assert s.verify() == [digest]
    finally:
        s.close()


def test_blob_collected_while_streaming_out(tmp_path: Path) -> None:
    """A blob collected while a reader is part way through it ends the read with BlobGone."""
    s = LmdbBlobStore(str(tmp_path / "blobs"), clock=lambda: 0.0)
    try:
        digest = s.put(payload(3 * CHUNK))
        it = s.open(digest)
        next(it)
        assert s.collect(0.0, 1.0) == 1
        with pytest.raises(BlobGone):
            list(it)
    finally:
        s.close()


# --- restarts ------------------------------------------------------------------------------------


def test_blobs_and_pins_survive_restart(tmp_path: Path) -> None:
    """Blobs, pins and counters are there after close and reopen, and a collect across the
    restart keeps the pinned blob and removes the other."""
    path = str(tmp_path / "blobs")
    s = LmdbBlobStore(path, clock=lambda: 100.0)
    kept = s.put(b"pinned payload")
    loose = s.put(payload(CHUNK + 1))
    s.pin(kept, "job-1")
    s.pin(kept, "job-1")
    s.pin(kept, "job-2")
    s.close()

    s = LmdbBlobStore(path, clock=lambda: 200.0)
    assert s.get(kept) == b"pinned payload"
    assert s.get(loose) == payload(CHUNK + 1)
    assert s.pinned(kept) and not s.pinned(loose)
    assert s.owners() == {"job-1", "job-2"}
    stats = s.stats()
    assert (stats["blobs"], stats["bytes"], stats["pins"]) == (2, 14 + CHUNK + 1, 2)
    assert s.collect(10.0, 1_000.0) == 1
    s.close()

    s = LmdbBlobStore(path)
    assert s.has(kept) and not s.has(loose)
    assert s.unpin_owner("job-1") == 1
    assert s.unpin_owner("job-1") == 0
    assert s.collect(10.0, 1_000.0) == 0
    assert s.unpin_owner("job-2") == 1
    assert s.owners() == set()
    assert s.collect(10.0, 1_000.0) == 1
    assert s.stats()["blobs"] == 0 and s.stats()["bytes"] == 0
    s.close()


@pytest.mark.parametrize("kind", ["lmdb", "memory"])
def test_grace_period_counts_from_the_last_put(tmp_path: Path, kind: str) -> None:
    """An unpinned blob stays while its last put is no more than grace_s before now_s."""
    now = [100.0]
    clock = lambda: now[0]  # noqa: E731
    s = (
        LmdbBlobStore(str(tmp_path / "b"), clock=clock)
        if kind == "lmdb"
        else MemoryBlobStore(clock=clock)
    )
    d = s.put(b"x")
    assert s.collect(50.0, 150.0) == 0
    now[0] = 140.0
    s.put(b"x")
    assert s.collect(50.0, 190.0) == 0
    assert s.has(d)
    assert s.collect(50.0, 190.5) == 1
    assert not s.has(d)
    s.close()


# --- threads -------------------------------------------------------------------------------------


def test_threads_put_and_read_at_once(tmp_path: Path) -> None:
    """Four threads put 200 payloads each while another reads, through map growth; all are
    readable after."""
    s = LmdbBlobStore(str(tmp_path / "blobs"), map_bytes=1 << 20)
    put: list[list[str]] = [[] for _ in range(4)]
    errors: list[BaseException] = []
    done = threading.Event()

    def writer(n: int) -> None:
        try:
            for i in range(200):
                # Every tenth payload is the same in all threads, so duplicates race too.
                data = b"shared %d" % i if i % 10 == 0 else payload(2000, seed=n * 1000 + i)
                put[n].append(s.put(data))
        except BaseException as e:
            errors.append(e)

    def reader() -> None:
        try:
            while not done.is_set():
                for n in range(4):
                    for d in list(put[n][-5:]):
                        assert s.get(d) is not None
                        assert b"".join(s.open(d)) == s.get(d)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(n,)) for n in range(4)]
    r = threading.Thread(target=reader)
    r.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    done.set()
    r.join(timeout=120)
    assert not any(t.is_alive() for t in [*threads, r])
    assert errors == []
    for n in range(4):
        assert len(put[n]) == 200
        for i, d in enumerate(put[n]):
            want = b"shared %d" % i if i % 10 == 0 else payload(2000, seed=n * 1000 + i)
            assert s.get(d) == want
    assert s.stats()["blobs"] == 4 * 180 + 20
    assert s.stats()["map_bytes"] > 1 << 20
    assert s.verify() == []
    s.close()


# --- bad input and failing disks -----------------------------------------------------------------


@pytest.mark.parametrize("bad", ["", "abc", EMPTY_BLAKE3.upper(), EMPTY_BLAKE3 + " ", None, 7])
def test_bad_digest_is_a_value_error(store, bad: object) -> None:
    """Something that is not a digest gives ValueError from every call that takes one."""
    for call in (store.get, store.open, store.has, store.size, store.pinned):
        with pytest.raises(ValueError, match="not a blob digest"):
            call(bad)
    with pytest.raises(ValueError, match="not a blob digest"):
        store.pin(bad, "job-1")


@pytest.mark.parametrize("bad", ["", "a\x00b", "x" * (limits.owner_bytes_max + 1), None])
def test_bad_owner_is_a_value_error(store, bad: object) -> None:
    """A pin owner is a non-empty string without NUL, of bounded length."""
    with pytest.raises(ValueError):
        store.pin(EMPTY_BLAKE3, bad)
    with pytest.raises(ValueError):
        store.unpin_owner(bad)


def test_payload_must_be_bytes(store) -> None:
    """A str is not a payload."""
    with pytest.raises(TypeError):
        store.put("text")


@pytest.mark.parametrize("kind", ["lmdb", "memory"])
def test_failing_write_fails_the_put(tmp_path: Path, kind: str) -> None:
    """When the write transaction fails (before anything reaches the file), put raises OSError,
    nothing is stored, and the store carries on once the disk does. A failed fsync is final
    instead: see tests/test_blob_writers.py."""
    fp = Failpoints()
    s = LmdbBlobStore(str(tmp_path / "b"), failpoints=fp) if kind == "lmdb" else MemoryBlobStore(fp)
    fp.arm("blob.write")
    with pytest.raises(OSError):
        s.put(b"lost")
    with pytest.raises(OSError):
        s.pin(EMPTY_BLAKE3, "job-1")
    assert not s.has(hexdigest(b"lost"))
    assert not s.pinned(EMPTY_BLAKE3)
    assert s.stats()["blobs"] == 0 and s.stats()["pins"] == 0
    del fp.armed["blob.write"]
    d = s.put(b"kept")
    assert s.get(d) == b"kept"
    assert fp.hits["blob.write"] >= 3
    s.close()


def test_tiny_map_grows_to_take_a_larger_payload(tmp_path: Path) -> None:
    """A store whose map is smaller than a payload grows the map and stores it; the grown size
    is kept across a restart."""
    first = 256 * 1024
    path = str(tmp_path / "blobs")
    s = LmdbBlobStore(path, map_bytes=first)
    data = payload(4 * first)
    d = s.put(data)
    grown = s.stats()["map_bytes"]
    assert grown > first
    assert s.get(d) == data
    s.close()
    s = LmdbBlobStore(path, map_bytes=first)
    assert s.stats()["map_bytes"] == grown
    assert s.get(d) == data
    s.close()


def test_closed_store_refuses_calls(tmp_path: Path) -> None:
    """After close, calls raise StoreClosed rather than touching a closed environment."""
    from blobstore import StoreClosed

    s = LmdbBlobStore(str(tmp_path / "blobs"))
    d = s.put(b"x")
    s.close()
    s.close()
    with pytest.raises(StoreClosed):
        s.get(d)
    with pytest.raises(StoreClosed):
        s.put(b"y")


def test_pin_many_is_one_durable_step(tmp_path):
    """pin_many pins every digest for the owner with one fsync; unpin_owner removes them all;
    the memory twin agrees."""
    from blobstore import LmdbBlobStore, MemoryBlobStore

    for store in (LmdbBlobStore(str(tmp_path / "s")), MemoryBlobStore()):
        ds = [store.put(b"p%d" % i) for i in range(50)]
        before = store.stats()["fsyncs"]
        store.pin_many(ds, "job")
        assert all(store.pinned(d) for d in ds)
        if isinstance(store, LmdbBlobStore):
            assert store.stats()["fsyncs"] - before <= 1
        assert store.unpin_owner("job") == 50
        store.close()


def test_memory_twin_checks_and_drops_damaged() -> None:
    """The in-memory twin has the same check/drop_damaged contract as the LMDB store."""
    s = MemoryBlobStore()
    digest = s.put(b"precious")
    s.pin(digest, "job-1")
    assert s.check(digest) is True and s.check("0" * 64) is None
    assert s.drop_damaged(digest) is False
    s._blobs[digest] = (b"tampered", s._blobs[digest][1])
    assert s.check(digest) is False
    assert s.drop_damaged(digest) is True and s.check(digest) is None and s.pinned(digest)
    assert s.put(b"precious") == digest and s.check(digest) is True
