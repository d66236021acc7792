"""The in-memory twin of the LMDB blob store: the same answers, kept in dicts.

Tests and simulations use it where a disk would only slow them down, and the property tests run
it beside the LMDB store as the model the real one must agree with. It keeps no chunks: a payload
is one bytes object, cut into chunks only when read through `open`.

Rules: the same input checks, errors and counters as LmdbBlobStore; every change counts as one
durable commit and calls `failpoints.hit("blob.fsync")` first, so failure tests run on either.
"""

from __future__ import annotations

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

    def _begin(self) -> None:
        """Called under the lock before every change, where the LMDB store commits."""
        if self._closed:
            raise StoreClosed("the memory blob store is closed")
        if self._failpoints is not None:
            self._failpoints.hit("blob.fsync")

    def _live(self) -> None:
        if self._closed:
            raise StoreClosed("the memory blob store is closed")

    def put(self, data: bytes) -> str:
        return self.put_stream((check_data(data),))

    def put_file(self, path: str) -> str:
        with open(path, "rb") as f:
            return self.put_stream(iter(lambda: f.read(self._chunk_bytes), b""))

    def put_stream(self, chunks: Iterable[bytes]) -> str:
        hasher = Hasher()
        parts = []
        for piece in chunks:
            view = check_data(piece)
            hasher.update(view)
            parts.append(bytes(view))
        data = b"".join(parts)
        digest = hasher.hexdigest()
        with self._lock:
            self._begin()
            self._blobs[digest] = (self._blobs.get(digest, (data, 0.0))[0], float(self._clock()))
            self._fsyncs += 1
            self._puts += 1
        return digest

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
            self._fsyncs += 1

    def unpin_owner(self, owner: str) -> int:
        check_owner(owner)
        with self._lock:
            self._begin()
            self._fsyncs += 1
            return len(self._pins.pop(owner, ()))

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
            self._fsyncs += 1
            held = set().union(*self._pins.values())
            gone = [
                d
                for d, (_, put_s) in self._blobs.items()
                if now_s - put_s > grace_s and d not in held
            ]
            for d in gone:
                del self._blobs[d]
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
