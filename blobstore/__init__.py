"""blobstore: a content-addressed payload store (blake3-256 digests, LMDB on disk).

Payloads are stored once per digest, durable when a put returns, checked against their digest
on every read, and kept while pinned. `LmdbBlobStore` is the store; `MemoryBlobStore` is its
in-memory twin with the same interface. `BlobWriters` puts payloads into either from any
thread in batches, each batch durable with one shared fsync (group commit), with backpressure on
the payload bytes waiting in memory. This package imports nothing of meshjobs; its limits are in
`blobstore.limits`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from blobstore.digest import EMPTY_DIGEST, Hasher, check_digest, hexdigest, is_digest
from blobstore.errors import (
    BlobCorrupt,
    BlobError,
    BlobGone,
    Failpoints,
    StoreClosed,
    StoreFull,
)

if TYPE_CHECKING:
    from blobstore.memory import MemoryBlobStore
    from blobstore.store import LmdbBlobStore
    from blobstore.writers import BlobWriters, StoreBusy

# The stores and the writers are imported when first asked for: a pure module that needs only
# `blobstore.digest` (the job node's EMPTY_DIGEST, control's is_digest) loads no LMDB or threads.
_LAZY = {"MemoryBlobStore": "blobstore.memory", "LmdbBlobStore": "blobstore.store",
         "BlobWriters": "blobstore.writers", "StoreBusy": "blobstore.writers"}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'blobstore' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value

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
