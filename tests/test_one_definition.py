"""One definition per concept: the empty digest and the digest check are blobstore.digest's,
and every module that names them uses that one."""

from __future__ import annotations

import blake3

import blobstore
from blobstore import digest
from meshjobs import control, table
from meshjobs.node import events


def test_the_empty_digest_is_defined_once():
    assert digest.EMPTY_DIGEST == blake3.blake3(b"").hexdigest()
    assert events.EMPTY_DIGEST is digest.EMPTY_DIGEST
    assert blobstore.EMPTY_DIGEST is digest.EMPTY_DIGEST
    assert table._EMPTY == bytes.fromhex(digest.EMPTY_DIGEST)
    src = open(events.__file__).read() + open(table.__file__).read()
    assert 'blake3(b"")' not in src


def test_is_digest_is_defined_once():
    assert control.is_digest is digest.is_digest is blobstore.is_digest
    assert control.is_digest("a" * 64)
    for bad in ("A" * 64, "a" * 63, "a" * 65, "g" * 64, "a" * 63 + "\n", b"a" * 64, None, 1):
        assert not control.is_digest(bad)


def test_blobstore_names_still_import():
    """The stores and writers load when first named (so the pure core loads none of them)."""
    from blobstore import BlobWriters, LmdbBlobStore, MemoryBlobStore, StoreBusy

    assert blobstore.LmdbBlobStore is LmdbBlobStore
    assert {BlobWriters.__name__, MemoryBlobStore.__name__, StoreBusy.__name__}
    try:
        blobstore.NoSuchThing  # noqa: B018
    except AttributeError as e:
        assert "NoSuchThing" in str(e)
    else:
        raise AssertionError("an unknown name must raise AttributeError")
