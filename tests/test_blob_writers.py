"""Tests of the blob writers (blobstore/writers.py) and the store's group commit beneath them:
many producers, fsyncs shared, a large file in bounded memory, a failing fsync, backpressure,
and any interleaving of puts giving blake3's digests. Real LMDB stores in temporary folders; the
memory twin where the behaviour is the same."""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
import threading
import tracemalloc
from collections.abc import Iterator
from concurrent.futures import Future, wait
from pathlib import Path

import blake3
import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, given, settings

from blobstore import (
    BlobWriters,
    LmdbBlobStore,
    MemoryBlobStore,
    StoreBusy,
    StoreClosed,
    hexdigest,
    limits,
)
from meshjobs.failpoints import Failpoints

WAIT_S = 120  # a bound on any one wait, never a speed


def start(w: BlobWriters) -> list[threading.Thread]:
    threads = [threading.Thread(target=body, name=name, daemon=True) for name, body in w.targets()]
    for t in threads:
        t.start()
    return threads


def stop(w: BlobWriters, threads: list[threading.Thread]) -> None:
    w.close()
    for t in threads:
        t.join(timeout=WAIT_S)
    assert not any(t.is_alive() for t in threads)


def make_store(kind: str, path: Path, failpoints: Failpoints | None = None):
    if kind == "lmdb":
        return LmdbBlobStore(str(path), failpoints=failpoints)
    return MemoryBlobStore(failpoints)


@pytest.fixture
def running(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple]:
    """A store of the kind named by the test's `kind` parameter, with writers running over it."""
    store = make_store(request.param, tmp_path / "blobs")
    w = BlobWriters(store, mem_max_bytes=1 << 30)
    threads = start(w)
    yield store, w
    stop(w, threads)
    store.close()


def payload(n: int, i: int) -> bytes:
    return b"producer %d payload %d " % (n, i) * (1 + i % 7)


# --- many producers ------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["lmdb", "memory"])
def test_many_producers_get_their_digests_with_few_fsyncs(tmp_path: Path, kind: str) -> None:
    """8 threads x 500 puts all resolve with blake3's digest; under that load the writers share
    fsyncs (fewer than one per five puts); every payload reads back, after a reopen too."""
    store = make_store(kind, tmp_path / "blobs")
    w = BlobWriters(store, mem_max_bytes=1 << 30)
    threads = start(w)
    futures: list[list[Future[str]]] = [[] for _ in range(8)]
    go = threading.Barrier(8)

    def producer(n: int) -> None:
        go.wait()
        for i in range(500):
            futures[n].append(w.put(payload(n, i)))

    producers = [threading.Thread(target=producer, args=(n,)) for n in range(8)]
    for t in producers:
        t.start()
    for t in producers:
        t.join(timeout=WAIT_S)
    for n in range(8):
        assert len(futures[n]) == 500
        for i, f in enumerate(futures[n]):
            assert f.result(timeout=WAIT_S) == blake3.blake3(payload(n, i)).hexdigest()
    stats = w.stats()
    assert stats["payloads"] == 4000
    assert stats["pending_bytes"] == 0
    assert 0 < stats["fsyncs"] < 4000 / 5
    assert 0 < store.stats()["fsyncs"] < 4000 / 5
    stop(w, threads)
    if kind == "lmdb":
        store.close()
        store = LmdbBlobStore(str(tmp_path / "blobs"))
    for n in range(8):
        for i in range(500):
            assert store.get(hexdigest(payload(n, i))) == payload(n, i)
    assert store.stats()["blobs"] == 4000
    store.close()


def test_concurrent_durable_puts_share_fsyncs(tmp_path: Path) -> None:
    """Plain store.put from many threads goes through the same group commit: each is durable
    when it returns, and the threads share fsyncs."""
    store = LmdbBlobStore(str(tmp_path / "blobs"))
    go = threading.Barrier(8)

    def producer(n: int) -> None:
        go.wait()
        for i in range(100):
            store.put(payload(n, i))

    threads = [threading.Thread(target=producer, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=WAIT_S)
    stats = store.stats()
    assert stats["puts"] == 800
    assert 0 < stats["fsyncs"] < 800
    store.close()


@pytest.mark.parametrize("running", ["lmdb", "memory"], indirect=True)
def test_owner_is_pinned_with_the_payload(running) -> None:
    """A put with an owner pins the payload for that owner in the same write."""
    store, w = running
    d = w.put(b"pinned output", owner="job-7").result(timeout=WAIT_S)
    assert store.pinned(d)
    assert store.owners() == {"job-7"}
    assert store.stats()["pins"] == 1


@pytest.mark.parametrize("kind", ["lmdb", "memory"])
def test_write_batch_reports_each_payload(tmp_path: Path, kind: str) -> None:
    """write_batch answers each payload's digest or the error that kept it out, and its
    batch is stored once synced."""
    store = make_store(kind, tmp_path / "blobs")
    f = tmp_path / "out"
    f.write_bytes(b"from a file")
    out = store.write_batch([b"a", str(tmp_path / "absent"), str(f), b"a"])
    assert out[0] == out[3] == hexdigest(b"a")
    assert isinstance(out[1], FileNotFoundError)
    assert out[2] == hexdigest(b"from a file")
    assert store.sync() is True
    assert store.sync() is False  # nothing new to make durable
    assert store.get(hexdigest(b"from a file")) == b"from a file"
    assert store.stats()["blobs"] == 2
    store.close()


# --- files ---------------------------------------------------------------------------------------


def test_large_file_streams_in_bounded_memory(tmp_path: Path) -> None:
    """A 200 MB file counts as pending from when it is queued, is stored with peak Python memory
    far below its size, and is removed once durable."""
    size = 200 << 20
    src = tmp_path / "spool"
    hasher = blake3.blake3()
    with open(src, "wb") as f:
        for _ in range(size // (8 << 20)):
            block = os.urandom(8 << 20)
            hasher.update(block)
            f.write(block)
    store = LmdbBlobStore(str(tmp_path / "blobs"))
    w = BlobWriters(store, mem_max_bytes=1 << 30)
    tracemalloc.start()
    try:
        fut = w.put_file(str(src), owner="job-1", remove=True)
        assert w.pending_bytes() == size
        threads = start(w)
        digest = fut.result(timeout=WAIT_S)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    stop(w, threads)
    assert digest == hasher.hexdigest()
    assert peak < limits.txn_payload_bytes_max + 8 * limits.chunk_bytes
    assert not src.exists()
    assert w.stats()["peak_pending_bytes"] == size
    assert w.pending_bytes() == 0
    assert store.size(digest) == size and store.pinned(digest)
    check = blake3.blake3()
    for chunk in store.open(digest):
        check.update(chunk)
    assert check.hexdigest() == digest
    store.close()


@pytest.mark.parametrize("running", ["lmdb", "memory"], indirect=True)
def test_unreadable_file_fails_alone_and_is_kept(running, tmp_path: Path) -> None:
    """A file that cannot be read fails its own Future and is not removed; the rest of its
    batch is stored; a missing file fails at once."""
    store, w = running
    folder = tmp_path / "a folder"
    folder.mkdir()
    good = tmp_path / "good"
    good.write_bytes(b"good output")
    bad = w.put_file(str(folder), remove=True)
    ok = w.put_file(str(good), remove=True)
    missing = w.put_file(str(tmp_path / "absent"))
    with pytest.raises(OSError):
        bad.result(timeout=WAIT_S)
    with pytest.raises(FileNotFoundError):
        missing.result(timeout=WAIT_S)
    assert ok.result(timeout=WAIT_S) == hexdigest(b"good output")
    assert folder.exists() and not good.exists()
    assert store.get(hexdigest(b"good output")) == b"good output"
    assert w.pending_bytes() == 0


# --- failures and limits -------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["lmdb", "memory"])
def test_failed_fsync_is_final(tmp_path: Path, kind: str) -> None:
    """blob.fsync=3: two puts are durable, the third fails with OSError, and nothing after it
    is reported durable, however many more are queued; the LMDB store keeps what was durable
    across a reopen."""
    fp = Failpoints("blob.fsync=3")
    store = make_store(kind, tmp_path / "blobs", fp)
    w = BlobWriters(store, mem_max_bytes=1 << 30)
    threads = start(w)
    first = [w.put(b"durable %d" % i).result(timeout=WAIT_S) for i in range(2)]
    with pytest.raises(OSError) as e:
        w.put(b"not durable").result(timeout=WAIT_S)
    assert e.value.errno == errno.EIO
    later = [w.put(b"later %d" % i) for i in range(200)]
    for f in later:
        with pytest.raises(OSError):
            f.result(timeout=WAIT_S)
    with pytest.raises(OSError, match="earlier"):
        store.put(b"direct")
    with pytest.raises(OSError, match="earlier"):
        store.get(first[0])
    assert fp.hits("blob.fsync") == 3
    assert w.stats()["payloads"] == 2
    assert w.pending_bytes() == 0
    stop(w, threads)
    store.close()
    if kind == "lmdb":
        reopened = LmdbBlobStore(str(tmp_path / "blobs"))
        assert [reopened.get(d) for d in first] == [b"durable 0", b"durable 1"]
        reopened.close()


@pytest.mark.parametrize("kind", ["lmdb", "memory"])
def test_failed_fsync_under_load_fails_everything_after_it(tmp_path: Path, kind: str) -> None:
    """With four producers racing, once one Future has failed from the fsync no Future that
    resolves later succeeds."""
    fp = Failpoints("blob.fsync=2")
    store = make_store(kind, tmp_path / "blobs", fp)
    w = BlobWriters(store, mem_max_bytes=1 << 30)
    threads = start(w)
    outcomes: list[bool] = []  # in the order the Futures resolved: True when stored
    lock = threading.Lock()

    def record(f: Future[str]) -> None:
        with lock:
            outcomes.append(f.exception() is None)

    def producer(n: int) -> None:
        for i in range(300):
            f = w.put(payload(n, i))
            f.add_done_callback(record)
            if i % 100 == 99:
                wait([f], timeout=WAIT_S)  # so that there are several batches and fsyncs

    producers = [threading.Thread(target=producer, args=(n,)) for n in range(4)]
    for t in producers:
        t.start()
    for t in producers:
        t.join(timeout=WAIT_S)
    stop(w, threads)
    assert len(outcomes) == 1200
    assert False in outcomes
    first_failure = outcomes.index(False)
    assert not any(outcomes[first_failure:])
    store.close()


def test_queue_is_bounded_by_count(tmp_path: Path) -> None:
    """Past queue_items_max queued payloads a put raises StoreBusy; the queued ones are all
    stored once the threads run."""
    store = MemoryBlobStore()
    w = BlobWriters(store, mem_max_bytes=1 << 30)
    futures = [w.put(b"%d" % i) for i in range(limits.queue_items_max)]
    with pytest.raises(StoreBusy, match="queued"):
        w.put(b"one too many")
    threads = start(w)
    stop(w, threads)
    assert all(f.result(timeout=WAIT_S) == hexdigest(b"%d" % i) for i, f in enumerate(futures))
    with pytest.raises(StoreClosed):
        w.put(b"after close")


def test_close_without_threads_fails_the_queued(tmp_path: Path) -> None:
    """Closed before any thread started, queued Futures fail with StoreClosed (never hang)."""
    w = BlobWriters(MemoryBlobStore(), mem_max_bytes=100)
    f = w.put(b"x" * 200)
    assert w.under_pressure()
    w.close()
    with pytest.raises(StoreClosed):
        f.result(timeout=WAIT_S)
    assert w.pending_bytes() == 0 and not w.under_pressure()


@pytest.mark.parametrize("bad", ["text", 5, None])
def test_bad_payload_is_refused_at_once(bad: object) -> None:
    """A payload that is not bytes is a TypeError from put, and a bad owner a ValueError."""
    w = BlobWriters(MemoryBlobStore(), mem_max_bytes=100)
    with pytest.raises(TypeError):
        w.put(bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        w.put(b"x", owner="")
    w.close()


# --- backpressure --------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["lmdb", "memory"])
def test_backpressure_goes_on_and_off(tmp_path: Path, kind: str) -> None:
    """With slow writes, pending bytes pass mem_max_bytes: pressure goes on (on_pressure(True),
    once) while puts still queue; it goes off (on_pressure(False), once) when drained; every
    payload is stored."""
    fp = Failpoints("blob.write=sleep:200")
    store = make_store(kind, tmp_path / "blobs", fp)
    calls: list[bool] = []
    w = BlobWriters(store, mem_max_bytes=64 << 10, on_pressure=calls.append)
    threads = start(w)
    data = [os.urandom(16 << 10) for _ in range(24)]
    futures = [w.put(d) for d in data]
    assert calls == [True]
    assert w.under_pressure()
    assert w.stats()["peak_pending_bytes"] > 64 << 10
    assert [f.result(timeout=WAIT_S) for f in futures] == [hexdigest(d) for d in data]
    assert calls == [True, False]
    assert not w.under_pressure()
    assert w.pending_bytes() == 0
    assert all(store.get(hexdigest(d)) == d for d in data)
    assert fp.hits("blob.write") >= 1
    stop(w, threads)
    store.close()


# --- any interleaving ----------------------------------------------------------------------------

PIECES = st.one_of(
    st.binary(max_size=300),
    st.sampled_from([b"", b"same", bytes(range(256)) * 4100]),  # the last is past one chunk
)
WORK = st.lists(
    st.lists(st.tuples(st.sampled_from(["put", "file"]), PIECES), min_size=1, max_size=12),
    min_size=1,
    max_size=4,
)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(work=WORK, kind=st.sampled_from(["lmdb", "memory"]))
def test_any_interleaving_gives_blake3_digests(work: list, kind: str) -> None:
    """Puts and put_files from a few threads at once, with repeats, each resolve with exactly the
    digest blake3 gives, and the store then holds exactly the distinct payloads."""
    folder = tempfile.mkdtemp(prefix="blobwriters-")
    try:
        store = make_store(kind, Path(folder) / "blobs")
        w = BlobWriters(store, mem_max_bytes=4096, writers=2)
        threads = start(w)
        got: list[list[tuple[bytes, Future[str]]]] = [[] for _ in work]

        def producer(n: int) -> None:
            for i, (how, data) in enumerate(work[n]):
                if how == "put":
                    got[n].append((data, w.put(data)))
                else:
                    path = os.path.join(folder, f"{n}-{i}")
                    with open(path, "wb") as f:
                        f.write(data)
                    got[n].append((data, w.put_file(path, remove=True)))

        producers = [threading.Thread(target=producer, args=(n,)) for n in range(len(work))]
        for t in producers:
            t.start()
        for t in producers:
            t.join(timeout=WAIT_S)
        for pairs in got:
            for data, f in pairs:
                assert f.result(timeout=WAIT_S) == blake3.blake3(data).hexdigest()
        stop(w, threads)
        distinct = {data for pairs in got for data, _ in pairs}
        assert store.stats()["blobs"] == len(distinct)
        assert all(store.get(hexdigest(d)) == d for d in distinct)
        assert not w.under_pressure() and w.pending_bytes() == 0
        store.close()
    finally:
        shutil.rmtree(folder, ignore_errors=True)
