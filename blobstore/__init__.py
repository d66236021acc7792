"""blobstore: a content-addressed payload store (blake3-256 digests, LMDB on disk).

Payloads are stored once per digest, durable when a put returns, checked against their digest
on every read, and kept while pinned. `LmdbBlobStore` is the store; `MemoryBlobStore` is its
in-memory twin with the same interface. `BlobWriters` puts payloads into either from any
thread in batches, each batch durable with one shared fsync (group commit), with backpressure on
the payload bytes waiting in memory. This package imports nothing of meshjobs; its limits are in
`blobstore.limits`.
"""

from __future__ import annotations

from blobstore.digest import EMPTY_DIGEST, Hasher, check_digest, hexdigest, is_digest
from blobstore.errors import (
    BlobCorrupt,
    BlobError,
    BlobGone,
    Failpoints,
    StoreClosed,
    StoreFull,
)
from blobstore.memory import MemoryBlobStore
from blobstore.store import LmdbBlobStore
from blobstore.writers import BlobWriters, StoreBusy

__all__ = [
    "EMPTY_DIGEST",
    "BlobCorrupt",
    "BlobError",
    "BlobGone",
    "BlobWriters",
    "Failpoints",
    "Hasher",
    "LmdbBlobStore",
    "MemoryBlobStore",
    "StoreBusy",
    "StoreClosed",
    "StoreFull",
    "check_digest",
    "hexdigest",
    "is_digest",
]
