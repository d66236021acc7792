"""The in-memory twin of the LMDB blob store: the same answers, kept in dicts.

Tests and simulations use it where a disk would only slow them down, and the property tests run
it beside the LMDB store as the model the real one must agree with. It keeps no chunks: a payload
is one bytes object, cut into chunks only when read through `open`.

Rules: the same input checks, errors and counters as LmdbBlobStore. Every change calls
`failpoints.hit("blob.write")` first; a durable change then counts one fsync and calls
`failpoints.hit("blob.fsync")`, while `write_batch` leaves that to `sync`, as the LMDB store does.
A failed "fsync" poisons the twin just as a real one poisons the LMDB store, so failure tests run
on either.
"""

from __future__ import annotations

import errno
import threading
import time
from collections.abc import Callable, Iterable, Iterator

from blobstore import limits
from blobstore.digest import Hasher, check_digest, hexdigest
from blobstore.errors import BlobCorrupt, Failpoints, StoreClosed, check_data, check_owner


class MemoryBlobStore:
    """Content-addressed payloads in memory; thread-safe under one lock."""

    def __init__(
        self,
        failpoints: Failpoints | None = None,
        *,
        clock: Callable[[], float] = time.time,
        chunk_bytes: int = limits.chunk_bytes,
    ) -> None:
        self._failpoints = failpoints
        self._clock = clock
        self._chunk_bytes = chunk_bytes
        self._lock = threading.Lock()
        self._blobs: dict[str, tuple[bytes, float]] = {}  # digest -> (payload, last put time)
        self._pins: dict[str, set[str]] = {}  # owner -> digests
        self._puts = 0
        self._fsyncs = 0
        self._closed = False
        self._dirty = False  # changed since the last "fsync"
        self._poisoned: BaseException | None = None

    def _begin(self) -> None:
        """Called under the lock before every change, where the LMDB store begins a write."""
        self._live()
        if self._failpoints is not None:
            self._failpoints.hit("blob.write")

    def _durable(self) -> None:
        """Called under the lock after a change, where the LMDB store syncs."""
        self._dirty = True
        self._sync_locked()

    def _sync_locked(self) -> bool:
        self._live()
        if not self._dirty:
            return False
        if self._failpoints is not None:
            try:
                self._failpoints.hit("blob.fsync")
            except BaseException as e:
                self._poisoned = e
                raise
        self._dirty = False
        self._fsyncs += 1
        return True

    def sync(self) -> bool:
        """Count everything changed so far as durable; True when that took an "fsync"."""
        with self._lock:
            return self._sync_locked()

    def _live(self) -> None:
        if self._closed:
            raise StoreClosed("the memory blob store is closed")
        if self._poisoned is not None:
            raise OSError(
                errno.EIO,
                f"the memory blob store failed to fsync earlier ({self._poisoned}); it refuses "
                "every call",
            )

    def put(self, data: bytes) -> str:
        return self.put_stream((check_data(data),))

    def put_file(self, path: str) -> str:
        with open(path, "rb") as f:
            return self.put_stream(iter(lambda: f.read(self._chunk_bytes), b""))

    def put_stream(self, chunks: Iterable[bytes]) -> str:
        data, digest = self._stage(chunks)
        with self._lock:
            self._begin()
            self._keep(digest, data)
            self._puts += 1
            self._durable()
        return digest

    def write_batch(
        self, payloads: list[bytes | str], owners: list[str | None] | None = None
    ) -> list[str | Exception]:
        """As LmdbBlobStore.write_batch: one change for the whole batch, not durable until
        `sync`; each payload's digest, or the error that kept it out, in order."""
        if owners is None:
            owners = [None] * len(payloads)
        if len(owners) != len(payloads):
            raise ValueError(f"{len(payloads)} payloads but {len(owners)} owners")
        out: list[str | Exception] = []
        staged: list[tuple[str, bytes, str | None]] = []
        for payload, owner in zip(payloads, owners, strict=True):
            try:
                if owner is not None:
                    check_owner(owner)
                if isinstance(payload, str):
                    with open(payload, "rb") as f:
                        data, digest = self._stage(iter(lambda: f.read(self._chunk_bytes), b""))
                else:
                    data, digest = self._stage((check_data(payload),))
            except (OSError, TypeError, ValueError) as e:
                out.append(e)
                continue
            staged.append((digest, data, owner))
            out.append(digest)
        if staged:
            with self._lock:
                self._begin()
                for digest, data, owner in staged:
                    self._keep(digest, data)
                    if owner is not None:
                        self._pins.setdefault(owner, set()).add(digest)
                self._puts += len(staged)
                self._dirty = True
        return out

    def _stage(self, chunks: Iterable[bytes]) -> tuple[bytes, str]:
        hasher = Hasher()
        parts = []
        for piece in chunks:
            view = check_data(piece)
            hasher.update(view)
            parts.append(bytes(view))
        return b"".join(parts), hasher.hexdigest()

    def _keep(self, digest: str, data: bytes) -> None:
        self._blobs[digest] = (self._blobs.get(digest, (data, 0.0))[0], float(self._clock()))

    def _payload(self, digest: str) -> bytes | None:
        check_digest(digest)
        with self._lock:
            self._live()
            entry = self._blobs.get(digest)
        if entry is None:
            return None
        if hexdigest(entry[0]) != digest:
            raise BlobCorrupt(digest)
        return entry[0]

    def get(self, digest: str) -> bytes | None:
        return self._payload(digest)

    def open(self, digest: str) -> Iterator[bytes] | None:
        data = self._payload(digest)
        if data is None:
            return None
        step = self._chunk_bytes
        return iter([data[i : i + step] for i in range(0, len(data), step)])

    def size(self, digest: str) -> int | None:
        check_digest(digest)
        with self._lock:
            self._live()
            entry = self._blobs.get(digest)
        return None if entry is None else len(entry[0])

    def has(self, digest: str) -> bool:
        check_digest(digest)
        with self._lock:
            self._live()
            return digest in self._blobs

    def check(self, digest: str) -> bool | None:
        """Whether one blob's bytes still match its digest (None when absent)."""
        check_digest(digest)
        with self._lock:
            self._live()
            entry = self._blobs.get(digest)
        return None if entry is None else hexdigest(entry[0]) == digest

    def drop_damaged(self, digest: str) -> bool:
        """Remove a blob whose bytes no longer match its digest, keeping its pins, so that a
        good copy can be put in its place; True when one was removed."""
        check_digest(digest)
        with self._lock:
            self._begin()
            entry = self._blobs.get(digest)
            if entry is None or hexdigest(entry[0]) == digest:
                return False
            del self._blobs[digest]
            self._durable()
            return True

    def verify(self) -> list[str]:
        with self._lock:
            self._live()
            items = list(self._blobs.items())
        return sorted(d for d, (data, _) in items if hexdigest(data) != d)

    def pin(self, digest: str, owner: str) -> None:
        check_digest(digest)
        check_owner(owner)
        with self._lock:
            self._begin()
            self._pins.setdefault(owner, set()).add(digest)
            self._durable()

    def pin_many(self, digests, owner: str) -> None:
        """`pin` for many digests at once (one durable step)."""
        ds = [check_digest(d) for d in digests]
        check_owner(owner)
        if not ds:
            return
        with self._lock:
            self._begin()
            self._pins.setdefault(owner, set()).update(ds)
            self._durable()

    def unpin_owner(self, owner: str) -> int:
        check_owner(owner)
        with self._lock:
            self._begin()
            removed = len(self._pins.pop(owner, ()))
            self._durable()
            return removed

    def owners(self) -> set[str]:
        with self._lock:
            self._live()
            return set(self._pins)

    def pinned(self, digest: str) -> bool:
        check_digest(digest)
        with self._lock:
            self._live()
            return any(digest in ds for ds in self._pins.values())

    def collect(self, grace_s: float, now_s: float) -> int:
        grace_s, now_s = float(grace_s), float(now_s)
        with self._lock:
            self._begin()
            held = set().union(*self._pins.values())
            gone = [
                d
                for d, (_, put_s) in self._blobs.items()
                if now_s - put_s > grace_s and d not in held
            ]
            for d in gone:
                del self._blobs[d]
            self._durable()
            return len(gone)

    def stats(self) -> dict[str, int]:
        with self._lock:
            self._live()
            return {
                "blobs": len(self._blobs),
                "bytes": sum(len(data) for data, _ in self._blobs.values()),
                "pins": sum(len(ds) for ds in self._pins.values()),
                "puts": self._puts,
                "fsyncs": self._fsyncs,
                "map_bytes": 0,
            }

    def close(self) -> None:
        with self._lock:
            self._closed = True

    def __enter__(self) -> MemoryBlobStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
