"""blobstore: a content-addressed payload store (blake3-256 digests, LMDB on disk).

Payloads are stored once per digest, durable when a put returns, checked against their digest
on every read, and kept while pinned. `LmdbBlobStore` is the store; `MemoryBlobStore` is its
in-memory twin with the same interface. This package imports nothing of meshjobs; its limits
are in `blobstore.limits`.
"""

from __future__ import annotations

from blobstore.digest import Hasher, check_digest, hexdigest, is_digest
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

__all__ = [
    "BlobCorrupt",
    "BlobError",
    "BlobGone",
    "Failpoints",
    "Hasher",
    "LmdbBlobStore",
    "MemoryBlobStore",
    "StoreClosed",
    "StoreFull",
    "check_digest",
    "hexdigest",
    "is_digest",
]
