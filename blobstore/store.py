"""The LMDB blob store: payloads under their blake3-256 digest, durable when a call returns.

Theory of operation. A payload is cut into chunks of the store's chunk size. Each chunk is kept
with its own blake3 checksum under (stream id, index); the blob's record, under the payload's
raw digest, says its size, its stream id, how many chunks it has and when it was last put. The
stream id indirection lets a payload of any size stream in over several transactions: its chunks
go under a fresh stream id that is listed as pending, and the last transaction either adopts
the stream as the blob or, when the blob was already stored, deletes it again. Identical
payloads are therefore stored once. Pins are (digest, owner) pairs, indexed both ways.

Durability is group commit. The environment is opened without LMDB's own syncs; a commit makes
its transaction visible, and `sync` makes everything committed so far durable with one fsync of
the data file. A sync that starts after a commit returned covers that commit, so callers that
commit at about the same time share one fsync: each waits for a sync that started after its
commit, and starts one itself only when none is running. `write_batch` commits a whole batch of
payloads in one transaction without syncing; the blob writer threads (`blobstore.writers`) call
it and then `sync`. Every other change (put, pin, unpin_owner, collect) commits and then syncs
through the same path, so it is durable when it returns.

A failed fsync poisons the store, as it does the journal: committed pages may be lost from the
page cache while later transactions build on them, so a retry could falsely succeed. From then
on every call raises OSError until the store is reopened.

Rules:
1. Every change goes through `_commit`: one LMDB write transaction, after
   `failpoints.hit("blob.write")`, then (for a durable change) `sync`, which calls
   `failpoints.hit("blob.fsync")` before each real fsync. Nothing changes Python-side state until
   a commit returned.
2. Counters (blobs, bytes, pins) live in the meta db and change in the same transaction as what
   they count, so opening a store never rescans it.
3. Paired checks: the digest and each chunk's checksum are computed while writing; on every read
   each chunk is checked before it is handed out and the whole payload is hashed again before
   its last chunk is handed out. A mismatch raises BlobCorrupt; a corrupt blob is never served.
4. No read transaction lives across a yield: `open` reads each chunk in its own short one.
5. The map grows only while no transaction of this process is open (the read gate and the
   write lock), and only from inside `_commit`.
"""

from __future__ import annotations

import errno
import os
import struct
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple, NoReturn, TypeVar

import blake3
import lmdb
import structlog

from blobstore import limits
from blobstore.digest import Hasher, check_digest
from blobstore.errors import (
    BlobCorrupt,
    BlobGone,
    Failpoints,
    StoreClosed,
    StoreFull,
    check_data,
    check_owner,
)

log = structlog.get_logger(__name__)

T = TypeVar("T")

format_version = 1
_SUM_BYTES = 32  # each chunk carries the full blake3-256 of its bytes
_REC = struct.Struct(">QQId")  # size, stream id, chunk count, put time (s)
_U64 = struct.Struct(">Q")
_CKEY = struct.Struct(">QI")  # stream id, chunk index: a stream's chunks sort together, in order

_DB_BLOBS = b"blobs"  # raw digest -> _REC
_DB_CHUNKS = b"chunks"  # _CKEY -> checksum + chunk bytes
_DB_PINS = b"pins"  # raw digest + owner -> b""
_DB_OWNERS = b"owners"  # owner + NUL + raw digest -> b""
_DB_PENDING = b"pending"  # stream id -> b"" while a streaming put is under way
_DB_META = b"meta"  # name -> u64


class _Rec(NamedTuple):
    size: int
    stream: int
    chunks: int
    put_s: float


class _Staged:
    """A payload hashed and cut into stored chunks, waiting for the transaction that keeps it.

    `stream` is 0 when all its chunks are still in `values`; otherwise the first `written`
    chunks are already committed under that pending stream id.
    """

    __slots__ = ("key", "size", "stream", "written", "values", "held_bytes", "who", "pos")

    def __init__(
        self,
        key: bytes,
        size: int,
        stream: int,
        written: int,
        values: list[bytes],
        held_bytes: int,
    ) -> None:
        self.key = key
        self.size = size
        self.stream = stream
        self.written = written
        self.values = values
        self.held_bytes = held_bytes
        self.who: bytes | None = None
        self.pos = 0  # its place in the batch

    @property
    def hexd(self) -> str:
        return self.key.hex()


class _Small:
    """Payloads of one chunk, staged in flat lists: digest, stored chunk, pin owner, place."""

    __slots__ = ("keys", "values", "whos", "places")

    def __init__(self) -> None:
        self.keys: list[bytes] = []
        self.values: list[bytes] = []
        self.whos: list[bytes | None] = []
        self.places: list[int] = []


class _Gate:
    """Many short read transactions at once, or one map change with none of them running."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._readers = 0
        self._exclusive = False

    @contextmanager
    def reading(self) -> Iterator[None]:
        with self._cond:
            while self._exclusive:
                self._cond.wait()
            self._readers += 1
        try:
            yield
        finally:
            with self._cond:
                self._readers -= 1
                if self._readers == 0:
                    self._cond.notify_all()

    @contextmanager
    def alone(self) -> Iterator[None]:
        with self._cond:
            while self._exclusive:
                self._cond.wait()
            self._exclusive = True
            while self._readers:
                self._cond.wait()
        try:
            yield
        finally:
            with self._cond:
                self._exclusive = False
                self._cond.notify_all()


def _key(digest: object) -> tuple[bytes, str]:
    hexd = check_digest(digest)
    return bytes.fromhex(hexd), hexd


def _chunk_value(data: bytes | bytearray | memoryview) -> bytes:
    """A chunk as stored: its blake3-256 checksum, then its bytes (copied once)."""
    return b"".join((blake3.blake3(data).digest(), data))


def _rechunk(tail: bytearray, view: memoryview, size: int) -> Iterator[bytes | memoryview]:
    """Yield whole chunks of `size` from what is left in `tail` followed by `view`; keep the rest
    in `tail`. Only a partial chunk is ever copied into `tail`; a yielded chunk is valid only
    until the next one is asked for."""
    if tail:
        need = size - len(tail)
        tail += view[:need]
        view = view[need:]
        if len(tail) < size:
            return
        yield tail
        tail.clear()
    while len(view) >= size:
        yield view[:size]
        view = view[size:]
    tail += view


class LmdbBlobStore:
    """Content-addressed payloads in one LMDB environment (a folder with data.mdb and lock.mdb)."""

    def __init__(
        self,
        path: str,
        map_bytes: int = limits.map_bytes_initial,
        failpoints: Failpoints | None = None,
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if not 0 < map_bytes <= limits.map_bytes_max:
            raise ValueError(f"map_bytes must be in 1..{limits.map_bytes_max}, not {map_bytes}")
        # The store holds every item's outputs: its folder and files are its owner's alone.
        os.makedirs(path, mode=0o700, exist_ok=True)
        self.path = path
        self._failpoints = failpoints
        self._clock = clock
        self._write_lock = threading.Lock()
        self._gate = _Gate()
        self._stats_lock = threading.Lock()
        self._puts = 0
        self._fsyncs = 0
        # Group commit: commits are numbered under the write lock; `_synced` is the number of the
        # last commit known durable. One sync runs at a time, and the others wait on the condition.
        self._committed = 0
        self._synced = 0
        self._syncing = False
        self._sync_cond = threading.Condition()
        self._poisoned: BaseException | None = None
        # Stream ids of streaming puts under way in this process; a pending stream not listed
        # here was left by a put that failed or a process that died, and is swept.
        self._live_streams: set[int] = set()
        self._env: lmdb.Environment | None = lmdb.open(
            path,
            map_size=map_bytes,
            subdir=True,
            sync=False,
            metasync=False,
            writemap=False,
            max_dbs=limits.dbs_max,
            max_readers=limits.readers_max,
            lock=True,
            mode=0o600,
        )
        env = self._env
        try:
            with env.begin(write=True) as txn:
                self._blobs = env.open_db(_DB_BLOBS, txn=txn)
                self._chunks = env.open_db(_DB_CHUNKS, txn=txn)
                self._pins = env.open_db(_DB_PINS, txn=txn)
                self._owners = env.open_db(_DB_OWNERS, txn=txn)
                self._pending = env.open_db(_DB_PENDING, txn=txn)
                self._meta = env.open_db(_DB_META, txn=txn)
                version = self._get_u64(txn, b"format")
                if version == 0:
                    self._set_u64(txn, b"format", format_version)
                    self._set_u64(txn, b"chunk_bytes", limits.chunk_bytes)
                elif version != format_version:
                    raise ValueError(
                        f"{path} holds a blob store of format {version}; this code reads format "
                        f"{format_version} only"
                    )
                self._chunk_bytes = self._get_u64(txn, b"chunk_bytes")
                saved_map = self._get_u64(txn, b"map_bytes")
            # A map that grew before a restart starts at that size again rather than growing
            # again one doubling at a time.
            if saved_map > env.info()["map_size"]:
                env.set_mapsize(saved_map)
            self._map_bytes = env.info()["map_size"]
            self._map_bytes_saved = saved_map
            orphans = self._read(lambda t: t.stat(self._pending)["entries"])
            if orphans:
                self._sweep_orphans()
        except BaseException:
            env.close()
            self._env = None
            raise
        log.info(
            "blobstore_open",
            path=path,
            map_bytes=self._map_bytes,
            chunk_bytes=self._chunk_bytes,
            orphans=orphans,
        )

    # --- the write path -------------------------------------------------------------------------

    def _commit(
        self,
        work: Callable[[lmdb.Transaction], T],
        weight_bytes: int = 0,
        *,
        durable: bool = True,
    ) -> T:
        """Run `work` in one write transaction and commit it; the one way anything changes.

        With `durable`, the commit is synced (shared with other callers) before this returns.
        `work` must have no effect outside its transaction: when the map is full the
        transaction is aborted, the map grows, and `work` runs once more in a new one.
        `weight_bytes` is about how much the transaction writes, to size the growth.
        """
        with self._write_lock:
            self._live_env()
            if self._failpoints is not None:
                self._failpoints.hit("blob.write")
            for attempt in range(2):
                env = self._live_env()
                txn = env.begin(write=True)
                try:
                    result = work(txn)
                    if self._map_bytes_saved != self._map_bytes:
                        self._set_u64(txn, b"map_bytes", self._map_bytes)
                    txn.commit()
                except lmdb.MapFullError:
                    txn.abort()
                    if attempt == 1 or self._map_bytes >= limits.map_bytes_max:
                        log.error("blobstore_full", path=self.path, map_bytes=self._map_bytes)
                        raise StoreFull(
                            f"the blob store at {self.path} is full ({self._map_bytes} bytes of "
                            f"map, at most {limits.map_bytes_max}): free disk space, or forget "
                            "finished jobs so that their blobs can be collected"
                        ) from None
                    self._grow(weight_bytes)
                    continue
                except BaseException:
                    txn.abort()
                    raise
                self._map_bytes_saved = self._map_bytes
                self._committed += 1
                number = self._committed
                break
            else:
                raise AssertionError("unreachable: _commit commits or raises in its second attempt")
        if durable:
            self._sync_through(number)
        return result

    def sync(self) -> bool:
        """Make every transaction committed so far durable. True when this call ran the fsync
        itself, False when nothing was left to sync or another caller's fsync covered it.
        Raises OSError when the fsync fails, and on every call after that."""
        return self._sync_through(self._committed)

    def _sync_through(self, number: int) -> bool:
        """Return once commit `number` is durable, joining a sync that started after it."""
        with self._sync_cond:
            while True:
                self._check_poison()
                if self._synced >= number:
                    return False
                if not self._syncing:
                    break
                self._sync_cond.wait()
            self._syncing = True
            # Commits are numbered after they committed, so everything up to this number is in
            # the file before the fsync below starts.
            target = self._committed
        failure: BaseException | None = None
        try:
            with self._gate.reading():
                env = self._live_env()
                if self._failpoints is not None:
                    self._failpoints.hit("blob.fsync")
                env.sync(True)
        except StoreClosed:
            raise
        except BaseException as e:
            failure = e
            err = self._poison(e)
            if err is e:
                raise
            raise err from e
        finally:
            with self._sync_cond:
                self._syncing = False
                if failure is None:
                    self._synced = max(self._synced, target)
                self._sync_cond.notify_all()
        with self._stats_lock:
            self._fsyncs += 1
        return True

    def _poison(self, e: BaseException) -> OSError:
        with self._sync_cond:
            if self._poisoned is None:
                self._poisoned = e
                log.error("blobstore_fsync_failed", path=self.path, error=str(e))
        return e if isinstance(e, OSError) else OSError(errno.EIO, f"blob store fsync: {e}")

    def _check_poison(self) -> None:
        first = self._poisoned
        if first is not None:
            raise OSError(
                errno.EIO,
                f"the blob store at {self.path} failed to fsync earlier ({first}); it refuses "
                "every call until it is reopened",
            )

    def _grow(self, weight_bytes: int) -> None:
        """Double the map, or more when the transaction that did not fit needs more."""
        env = self._live_env()
        psize = env.stat()["psize"]
        used = (env.info()["last_pgno"] + 1) * psize
        want = max(2 * self._map_bytes, used + 2 * weight_bytes + limits.map_growth_slack_bytes)
        step = max(psize, limits.map_growth_slack_bytes)
        want = min(-(-want // step) * step, limits.map_bytes_max)
        with self._gate.alone():
            env.set_mapsize(want)
        old, self._map_bytes = self._map_bytes, env.info()["map_size"]
        log.info("blobstore_grow", path=self.path, map_bytes_was=old, map_bytes=self._map_bytes)

    def _live_env(self) -> lmdb.Environment:
        env = self._env
        if env is None:
            raise StoreClosed(f"the blob store at {self.path} is closed")
        self._check_poison()
        return env

    def _read(self, fn: Callable[[lmdb.Transaction], T]) -> T:
        """Run `fn` in a short read transaction of its own."""
        with self._gate.reading():
            env = self._live_env()
            with env.begin() as txn:
                return fn(txn)

    def _get_u64(self, txn: lmdb.Transaction, name: bytes) -> int:
        raw = txn.get(name, db=self._meta)
        return 0 if raw is None else _U64.unpack(raw)[0]

    def _set_u64(self, txn: lmdb.Transaction, name: bytes, value: int) -> None:
        txn.put(name, _U64.pack(value), db=self._meta)

    def _add(self, txn: lmdb.Transaction, name: bytes, delta: int) -> None:
        value = self._get_u64(txn, name) + delta
        if value < 0:
            raise AssertionError(f"blob store counter {name!r} would go below zero")
        self._set_u64(txn, name, value)

    def _new_stream(self, txn: lmdb.Transaction) -> int:
        stream = self._get_u64(txn, b"next_stream") + 1
        self._set_u64(txn, b"next_stream", stream)
        return stream

    def _drop_stream(self, txn: lmdb.Transaction, stream: int) -> None:
        prefix = _U64.pack(stream)
        cur = txn.cursor(db=self._chunks)
        if cur.set_range(prefix):
            while cur.key()[:8] == prefix:
                if not cur.delete():
                    break
        cur.close()

    def _record(self, txn: lmdb.Transaction, key: bytes, hexd: str) -> _Rec | None:
        raw = txn.get(key, db=self._blobs)
        if raw is None:
            return None
        if len(raw) != _REC.size:
            raise BlobCorrupt(hexd, f"its record is {len(raw)} bytes, not {_REC.size}")
        rec = _Rec(*_REC.unpack(raw))
        if rec.chunks != -(-rec.size // self._chunk_bytes):
            raise BlobCorrupt(hexd, f"its record says {rec.size} bytes in {rec.chunks} chunks")
        return rec

    # --- puts -------------------------------------------------------------------------------------

    def put(self, data: bytes) -> str:
        """Store a payload; return its digest. Durable when it returns."""
        return self._put_staged(self._stage_bytes(check_data(data)))

    def put_file(self, path: str) -> str:
        """Stream a file of any size into the store in bounded memory. Durable when it returns."""
        return self._put_staged(self._stage_file(path))

    def put_stream(self, chunks: Iterable[bytes]) -> str:
        """Store the concatenation of `chunks`; return its digest. Durable when it returns.

        A payload that fits in one transaction's budget is written in a single transaction,
        after its digest is known, so a duplicate writes nothing but its put time. A larger one
        goes to disk as it arrives under a pending stream id, and the last transaction keeps it
        or, for a duplicate, deletes it.
        """
        return self._put_staged(self._stage_stream(chunks))

    def write_batch(
        self, payloads: list[bytes | str], owners: list[str | None] | None = None
    ) -> list[str | Exception]:
        """Store a batch of payloads (bytes, or the path of a file to stream in) in one write
        transaction, each pinned for its owner in the same transaction when one is given.

        Not durable when it returns: call `sync`. Returns, in order, each payload's digest or
        the error that kept that payload out (an unreadable file, a payload that is not bytes);
        raises when the transaction itself fails, and then none of the batch is stored. A file
        larger than one transaction's budget streams in over transactions of its own first.
        """
        if owners is None:
            owners = [None] * len(payloads)
        if len(owners) != len(payloads):
            raise ValueError(f"{len(payloads)} payloads but {len(owners)} owners")
        out: list[str | Exception] = []
        # Payloads of one chunk, the common case, are kept in flat lists rather than as one
        # _Staged each: at a hundred bytes a payload, the objects made per payload are most
        # of the cost.
        small = _Small()
        staged: list[_Staged] = []
        weight = 0
        one_chunk = self._chunk_bytes
        digest_of = blake3.blake3
        try:
            for pos, (payload, owner) in enumerate(zip(payloads, owners, strict=True)):
                try:
                    who = None if owner is None else check_owner(owner)
                    if type(payload) is bytes and 0 < len(payload) <= one_chunk:
                        # One chunk, whose checksum is the payload's digest.
                        key = digest_of(payload).digest()
                        small.keys.append(key)
                        small.values.append(key + payload)
                        small.whos.append(who)
                        small.places.append(pos)
                        weight += len(payload)
                        out.append(key.hex())
                        continue
                    if isinstance(payload, str):
                        item = self._stage_file(payload)
                    else:
                        item = self._stage_bytes(check_data(payload))
                except (OSError, TypeError, ValueError) as e:
                    out.append(e)
                    continue
                item.who = who
                item.pos = pos
                staged.append(item)
                weight += item.held_bytes
                out.append(item.key.hex())
            if staged or small.keys:
                left_out = self._commit(
                    lambda txn: self._write_staged(txn, staged, small), weight, durable=False
                )
            else:
                left_out = []
        except BaseException:
            self._abandon_all(staged)
            raise
        self._settle(staged)
        for pos, error in left_out:
            out[pos] = error
        with self._stats_lock:
            self._puts += len(staged) + len(small.keys) - len(left_out)
        return out

    def _put_staged(self, item: _Staged) -> str:
        try:
            left_out = self._commit(
                lambda txn: self._write_staged(txn, [item]), item.held_bytes
            )
        except BaseException:
            self._abandon_all([item])
            raise
        self._settle([item])
        if left_out:
            raise left_out[0][1]
        with self._stats_lock:
            self._puts += 1
        return item.hexd

    def _stage_bytes(self, view: memoryview) -> _Staged:
        """Hash a payload held in memory and cut it into stored chunks."""
        size = len(view)
        if 0 < size <= self._chunk_bytes:
            # One chunk: its checksum is the payload's digest, so it is hashed once.
            key = blake3.blake3(view).digest()
            return _Staged(key, size, 0, 0, [b"".join((key, view))], size)
        if size > limits.txn_payload_bytes_max:
            return self._stage_stream((view,))
        hasher = Hasher()
        hasher.update(view)
        step = self._chunk_bytes
        values = [_chunk_value(view[i : i + step]) for i in range(0, size, step)]
        return _Staged(hasher.digest(), size, 0, 0, values, size)

    def _stage_file(self, path: str) -> _Staged:
        with open(path, "rb") as f:
            return self._stage_stream(iter(lambda: f.read(self._chunk_bytes), b""))

    def _stage_stream(self, chunks: Iterable[bytes]) -> _Staged:
        """Hash and chunk a stream; parts past one transaction's budget are committed (not
        synced) under a pending stream id as they arrive."""
        hasher = Hasher()
        size = 0
        tail = bytearray()
        values: list[bytes] = []  # whole chunks, as stored, not yet written
        held_bytes = 0
        stream = 0  # 0: nothing written yet
        written = 0  # chunks written under `stream`
        try:
            for piece in chunks:
                view = check_data(piece)
                hasher.update(view)
                size += len(view)
                for chunk in _rechunk(tail, view, self._chunk_bytes):
                    values.append(_chunk_value(chunk))
                    held_bytes += len(chunk)
                if held_bytes >= limits.txn_payload_bytes_max:
                    stream = self._commit(
                        lambda txn, s=stream, w=written, v=values: self._write_part(txn, s, w, v),
                        held_bytes,
                        durable=False,
                    )
                    written += len(values)
                    values, held_bytes = [], 0
            if tail:
                values.append(_chunk_value(tail))
                held_bytes += len(tail)
        except BaseException:
            if stream:
                self._abandon(stream)
            raise
        return _Staged(hasher.digest(), size, stream, written, values, held_bytes)

    def _write_staged(
        self, txn: lmdb.Transaction, items: list[_Staged], small: _Small | None = None
    ) -> list[tuple[int, BlobCorrupt]]:
        """Write staged payloads (and their pins) in one transaction; the counters change once.

        A payload already stored only has its put time renewed (and its streamed copy removed).
        A payload whose stored record disagrees with it is left out and returned, by its place
        in the batch, with the BlobCorrupt that says why; anything else that goes wrong fails
        the whole transaction.
        """
        blobs = stored_bytes = pins = 0
        next_stream = self._get_u64(txn, b"next_stream")
        put_s = float(self._clock())
        left_out: list[tuple[int, BlobCorrupt]] = []
        chunks_db, blobs_db = self._chunks, self._blobs
        ckey, rec_pack = _CKEY.pack, _REC.pack
        if small is not None:
            for key, value, who, pos in zip(
                small.keys, small.values, small.whos, small.places, strict=True
            ):
                size = len(value) - _SUM_BYTES
                stream = next_stream + 1
                if txn.put(key, rec_pack(size, stream, 1, put_s), db=blobs_db, overwrite=False):
                    next_stream = stream
                    # A fresh stream id is above every id in use: its chunk goes at the end.
                    txn.put(ckey(stream, 0), value, db=chunks_db, append=True)
                    blobs += 1
                    stored_bytes += size
                else:
                    error = self._renew(txn, key, size, put_s)
                    if error is not None:
                        left_out.append((pos, error))
                        continue
                if who is not None:
                    pins += self._pin_in(txn, key, who)
        for it in items:
            stream = it.stream
            fresh = stream == 0
            if fresh:
                stream = next_stream + 1
            else:
                txn.delete(_U64.pack(stream), db=self._pending)
            count = it.written + len(it.values)
            # Most payloads are new: try to add the record, and look at the stored one only
            # when there is one already.
            if txn.put(it.key, rec_pack(it.size, stream, count, put_s), db=blobs_db,
                       overwrite=False):
                if fresh:
                    next_stream = stream
                # A fresh stream id is above every id in use, so its chunks go at the end.
                for index, value in enumerate(it.values, it.written):
                    txn.put(ckey(stream, index), value, db=chunks_db, append=fresh)
                blobs += 1
                stored_bytes += it.size
            else:
                if not fresh:
                    self._drop_stream(txn, stream)
                error = self._renew(txn, it.key, it.size, put_s)
                if error is not None:
                    left_out.append((it.pos, error))
                    continue
            if it.who is not None:
                pins += self._pin_in(txn, it.key, it.who)
        self._set_u64(txn, b"next_stream", next_stream)
        if blobs:
            self._add(txn, b"blobs", blobs)
            self._add(txn, b"bytes", stored_bytes)
        if pins:
            self._add(txn, b"pins", pins)
        return left_out

    def _renew(
        self, txn: lmdb.Transaction, key: bytes, size: int, put_s: float
    ) -> BlobCorrupt | None:
        """Renew a stored blob's put time; or say why its record disagrees with the payload."""
        hexd = key.hex()
        try:
            rec = self._record(txn, key, hexd)
        except BlobCorrupt as e:
            return e
        if rec is None:
            raise AssertionError("a blob record vanished inside its own transaction")
        if rec.size != size:
            return BlobCorrupt(hexd, f"stored as {rec.size} bytes, put again as {size}")
        txn.put(key, _REC.pack(rec.size, rec.stream, rec.chunks, put_s), db=self._blobs)
        return None

    def _write_part(
        self, txn: lmdb.Transaction, stream: int, first: int, values: list[bytes]
    ) -> int:
        if stream == 0:
            stream = self._new_stream(txn)
            txn.put(_U64.pack(stream), b"", db=self._pending)
            # Listed as live under the write lock, so that a sweep never sees it pending and
            # unlisted; an aborted transaction leaves a harmless extra entry.
            self._live_streams.add(stream)
        for index, value in enumerate(values, first):
            txn.put(_CKEY.pack(stream, index), value, db=self._chunks)
        return stream

    def _settle(self, items: list[_Staged]) -> None:
        """The staged payloads' streams were adopted or removed: no longer live."""
        for it in items:
            if it.stream:
                self._live_streams.discard(it.stream)

    def _abandon_all(self, items: list[_Staged]) -> None:
        for it in items:
            if it.stream:
                self._abandon(it.stream)

    def _abandon(self, stream: int) -> None:
        """Remove the chunks of a streaming put that failed; a sweep finds them otherwise."""

        def work(txn: lmdb.Transaction) -> None:
            txn.delete(_U64.pack(stream), db=self._pending)
            self._drop_stream(txn, stream)

        try:
            self._commit(work, durable=False)
        except Exception as e:  # the put's own error is the one the caller must see
            log.warning("blobstore_abandon_failed", stream=stream, error=str(e))
        finally:
            self._live_streams.discard(stream)

    def _has_orphans(self, txn: lmdb.Transaction) -> bool:
        cur = txn.cursor(db=self._pending)
        try:
            live = set(self._live_streams)  # a copy: writer threads change the set meanwhile
            return any(_U64.unpack(k)[0] not in live for k in cur.iternext(values=False))
        finally:
            cur.close()

    def _sweep_orphans(self) -> int:
        def work(txn: lmdb.Transaction) -> int:
            cur = txn.cursor(db=self._pending)
            live = set(self._live_streams)  # a copy: writer threads change the set meanwhile
            orphans = [k for k in cur.iternext(values=False) if _U64.unpack(k)[0] not in live]
            cur.close()
            for k in orphans:
                txn.delete(k, db=self._pending)
                self._drop_stream(txn, _U64.unpack(k)[0])
            return len(orphans)

        swept = self._commit(work)
        if swept:
            log.info("blobstore_orphans_swept", path=self.path, streams=swept)
        return swept

    # --- reads ------------------------------------------------------------------------------------

    def get(self, digest: str) -> bytes | None:
        """The payload, checked against its digest; None when absent. Raises BlobCorrupt."""
        key, hexd = _key(digest)

        def read(txn: lmdb.Transaction) -> bytes | None:
            rec = self._record(txn, key, hexd)
            if rec is None:
                return None
            hasher = Hasher()
            parts = []
            for index in range(rec.chunks):
                chunk = self._chunk(txn, key, hexd, rec, index)
                hasher.update(chunk)
                parts.append(chunk)
            self._check_whole(hexd, key, hasher)
            return b"".join(parts)

        return self._read(read)

    def open(self, digest: str) -> Iterator[bytes] | None:
        """The payload as an iterator of chunks, or None when absent.

        Each chunk is read in its own short read transaction and checked before it is yielded;
        the whole payload is checked before the last chunk is yielded. Raises BlobCorrupt while
        iterating, and BlobGone when the blob is collected part way.
        """
        key, hexd = _key(digest)
        rec = self._read(lambda txn: self._record(txn, key, hexd))
        if rec is None:
            return None
        return self._iter_chunks(key, hexd, rec)

    def _iter_chunks(self, key: bytes, hexd: str, rec: _Rec) -> Iterator[bytes]:
        hasher = Hasher()
        last = rec.chunks - 1
        if last < 0:
            self._check_whole(hexd, key, hasher)
        for index in range(rec.chunks):
            chunk = self._read(lambda txn, i=index: self._chunk(txn, key, hexd, rec, i))
            hasher.update(chunk)
            if index == last:
                self._check_whole(hexd, key, hasher)
            yield chunk

    def _chunk(self, txn: lmdb.Transaction, key: bytes, hexd: str, rec: _Rec, index: int) -> bytes:
        now = self._record(txn, key, hexd)
        if now is None:
            raise BlobGone(hexd)
        if now.size != rec.size:
            raise BlobCorrupt(hexd, f"its record changed from {rec.size} to {now.size} bytes")
        value = txn.get(_CKEY.pack(now.stream, index), db=self._chunks)
        if value is None:
            self._corrupt(hexd, f"chunk {index} is missing")
        want = min(self._chunk_bytes, rec.size - index * self._chunk_bytes)
        if len(value) != _SUM_BYTES + want:
            self._corrupt(hexd, f"chunk {index} is {len(value) - _SUM_BYTES} bytes, not {want}")
        chunk = value[_SUM_BYTES:]
        if blake3.blake3(chunk).digest() != value[:_SUM_BYTES]:
            self._corrupt(hexd, f"chunk {index} does not match its checksum")
        return chunk

    def _check_whole(self, hexd: str, key: bytes, hasher: Hasher) -> None:
        if hasher.digest() != key:
            self._corrupt(hexd, "the payload does not hash to its digest")

    def _corrupt(self, hexd: str, why: str) -> NoReturn:
        log.error("blob_corrupt", digest=hexd, why=why, path=self.path)
        raise BlobCorrupt(hexd, why)

    def size(self, digest: str) -> int | None:
        """The payload's size in bytes, or None when absent."""
        key, hexd = _key(digest)
        rec = self._read(lambda txn: self._record(txn, key, hexd))
        return None if rec is None else rec.size

    def has(self, digest: str) -> bool:
        """True when the blob is stored (its bytes are not checked)."""
        key, _ = _key(digest)
        return self._read(lambda txn: txn.get(key, db=self._blobs) is not None)

    def check(self, digest: str) -> bool | None:
        """Read and check one blob: True when its bytes match its digest, False when damaged,
        None when it is not here."""
        key, hexd = _key(digest)
        try:
            rec = self._read(lambda txn: self._record(txn, key, hexd))
            if rec is None:
                return None
            for _ in self._iter_chunks(key, hexd, rec):
                pass
        except BlobCorrupt:
            return False
        except BlobGone:
            return None
        return True

    def drop_damaged(self, digest: str) -> bool:
        """Remove a damaged blob (its record and chunks; its pins stay, so a good copy put in
        its place is pinned as the damaged one was). Checked again first: a good blob is never
        dropped. True when one was removed."""
        key, hexd = _key(digest)
        if self.check(digest) is not False:
            return False

        def work(txn: lmdb.Transaction) -> bool:
            rec = self._record(txn, key, hexd)
            if rec is None:
                return False
            self._drop_stream(txn, rec.stream)
            txn.delete(key, db=self._blobs)
            self._add(txn, b"blobs", -1)
            self._add(txn, b"bytes", -rec.size)
            return True

        dropped = self._commit(work)
        if dropped:
            log.warning("blob_damaged_dropped", digest=hexd, path=self.path)
        return dropped

    def verify(self) -> list[str]:
        """Read and check every blob; return the digests of those that no longer match, sorted."""
        bad: list[str] = []
        after = b""
        while True:
            keys = self._read(lambda txn, a=after: self._keys_after(txn, self._blobs, a))
            if not keys:
                return bad
            for key in keys:
                hexd = key.hex()
                try:
                    rec = self._read(lambda txn, k=key, h=hexd: self._record(txn, k, h))
                    if rec is not None:
                        for _ in self._iter_chunks(key, hexd, rec):
                            pass
                except BlobCorrupt:
                    bad.append(hexd)
                except BlobGone:
                    pass
            after = keys[-1]

    def _keys_after(self, txn: lmdb.Transaction, db: Any, after: bytes) -> list[bytes]:
        cur = txn.cursor(db=db)
        keys: list[bytes] = []
        found = cur.set_range(after) if after else cur.first()
        if found and cur.key() == after:
            found = cur.next()
        while found and len(keys) < limits.batch_blobs_max:
            keys.append(cur.key())
            found = cur.next()
        cur.close()
        return keys

    # --- pins -------------------------------------------------------------------------------------

    def pin(self, digest: str, owner: str) -> None:
        """Keep the blob from being collected until `owner` is unpinned. Durable when it returns.

        A blob may be pinned before it is stored; the pin then guards it from its first put.
        """
        key, _ = _key(digest)
        who = check_owner(owner)

        def work(txn: lmdb.Transaction) -> None:
            if self._pin_in(txn, key, who):
                self._add(txn, b"pins", 1)

        self._commit(work)

    def pin_many(self, digests: Iterable[str], owner: str) -> None:
        """`pin` for many digests at once: one transaction, one fsync."""
        keys = [_key(d)[0] for d in digests]
        who = check_owner(owner)

        def work(txn: lmdb.Transaction) -> None:
            added = sum(self._pin_in(txn, key, who) for key in keys)
            if added:
                self._add(txn, b"pins", added)

        if keys:
            self._commit(work)

    def _pin_in(self, txn: lmdb.Transaction, key: bytes, who: bytes) -> int:
        """Add the pin (key, who) inside `txn`; return 1 when it is new, 0 when it was there."""
        if txn.put(key + who, b"", db=self._pins, overwrite=False):
            txn.put(who + b"\x00" + key, b"", db=self._owners)
            return 1
        return 0

    def unpin_owner(self, owner: str) -> int:
        """Remove every pin of `owner`; return how many. Durable when it returns."""
        who = check_owner(owner)
        prefix = who + b"\x00"

        def work(txn: lmdb.Transaction) -> int:
            cur = txn.cursor(db=self._owners)
            keys: list[bytes] = []
            found = cur.set_range(prefix)
            while found and len(keys) < limits.batch_pins_max:
                k = cur.key()
                if not k.startswith(prefix):
                    break
                keys.append(k)
                found = cur.next()
            cur.close()
            for k in keys:
                txn.delete(k, db=self._owners)
                if not txn.delete(k[len(prefix) :] + who, db=self._pins):
                    raise AssertionError(f"pin index out of step for owner {owner!r}")
            if keys:
                self._add(txn, b"pins", -len(keys))
            return len(keys)

        removed = 0
        while True:
            n = self._commit(work)
            removed += n
            if n < limits.batch_pins_max:
                return removed

    def owners(self) -> set[str]:
        """Every owner holding at least one pin."""

        def read(txn: lmdb.Transaction) -> set[str]:
            cur = txn.cursor(db=self._owners)
            found = cur.first()
            out: set[str] = set()
            while found:
                who = cur.key().split(b"\x00", 1)[0]
                out.add(who.decode("utf-8"))
                # NUL never occurs in an owner, so who + 0x01 sorts after all of who's pins.
                found = cur.set_range(who + b"\x01")
            cur.close()
            return out

        return self._read(read)

    def pinned(self, digest: str) -> bool:
        """True when some owner pins the digest."""
        key, _ = _key(digest)
        return self._read(lambda txn: self._is_pinned(txn, key))

    def has_pin(self, digest: str, owner: str) -> bool:
        """True when `owner` pins the digest (a read: a member on a full disk asks before it
        would write a pin it already has)."""
        key, _ = _key(digest)
        who = check_owner(owner)
        return self._read(lambda txn: txn.get(key + who, db=self._pins) is not None)

    @property
    def poisoned(self) -> bool:
        """True once an fsync failed: every later call raises until the store is reopened."""
        return self._poisoned is not None

    def _is_pinned(self, txn: lmdb.Transaction, key: bytes) -> bool:
        cur = txn.cursor(db=self._pins)
        try:
            return cur.set_range(key) and cur.key()[: len(key)] == key
        finally:
            cur.close()

    # --- collection -------------------------------------------------------------------------------

    def collect(self, grace_s: float, now_s: float) -> int:
        """Remove unpinned blobs last put more than `grace_s` before `now_s`; return how many.

        Also removes the chunks of streaming puts that died part way.
        """
        grace_s, now_s = float(grace_s), float(now_s)
        if self._read(self._has_orphans):
            self._sweep_orphans()

        def work(txn: lmdb.Transaction, after: bytes) -> tuple[int, bytes]:
            keys = self._keys_after(txn, self._blobs, after)
            removed = 0
            for key in keys:
                rec = self._record(txn, key, key.hex())
                if rec is None:
                    raise AssertionError("a listed blob vanished inside its own transaction")
                if now_s - rec.put_s > grace_s and not self._is_pinned(txn, key):
                    self._drop_stream(txn, rec.stream)
                    txn.delete(key, db=self._blobs)
                    self._add(txn, b"blobs", -1)
                    self._add(txn, b"bytes", -rec.size)
                    removed += 1
            return removed, keys[-1] if keys else b""

        total = 0
        after = b""
        while True:
            removed, last = self._commit(lambda txn, a=after: work(txn, a))
            total += removed
            if not last:
                break
            after = last
        if total:
            log.info("blobstore_collect", path=self.path, removed=total)
        return total

    # --- the rest ---------------------------------------------------------------------------------

    def stats(self) -> dict[str, int]:
        """Counts: blobs, bytes, pins (stored); puts, fsyncs (since open); map_bytes."""

        def read(txn: lmdb.Transaction) -> dict[str, int]:
            return {n: self._get_u64(txn, n.encode()) for n in ("blobs", "bytes", "pins")}

        out = self._read(read)
        with self._stats_lock:
            out.update(puts=self._puts, fsyncs=self._fsyncs, map_bytes=self._map_bytes)
        return out

    def close(self) -> None:
        """Make what was committed durable, then close the environment; later calls raise
        StoreClosed. Closing twice is fine."""
        if self._env is not None and self._poisoned is None:
            try:
                self.sync()
            except (OSError, StoreClosed) as e:
                log.error("blobstore_close_sync_failed", path=self.path, error=str(e))
        with self._write_lock, self._gate.alone():
            if self._env is not None:
                self._env.close()
                self._env = None
                log.info("blobstore_close", path=self.path)

    def __enter__(self) -> LmdbBlobStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
