"""The blob store's error classes and the checks of caller input that raise them.

Rule: garbage from a caller (a bad digest, a bad owner) is a ValueError with a message a person
can act on; trouble found on disk is a BlobError; a broken invariant of the store's own raises
AssertionError and is not caught.
"""

from __future__ import annotations

from typing import Protocol

from blobstore import limits


class Failpoints(Protocol):
    """Anything whose `hit(name)` may raise OSError, as a failing disk would at that point."""

    def hit(self, name: str) -> None: ...


class BlobError(Exception):
    """Base of the errors the blob store raises about its own contents."""


class BlobCorrupt(BlobError):
    """The stored bytes no longer hash to their digest; the blob is never served."""

    def __init__(self, digest: str, why: str = "stored bytes do not match the digest") -> None:
        super().__init__(f"blob {digest} is corrupt: {why}")
        self.digest = digest
        self.why = why


class BlobGone(BlobError):
    """The blob was collected while it was being read."""

    def __init__(self, digest: str) -> None:
        super().__init__(f"blob {digest} was removed while it was being read")
        self.digest = digest


class StoreFull(BlobError):
    """The store cannot grow any more."""


class StoreClosed(BlobError):
    """The store was closed."""


def check_owner(owner: object) -> bytes:
    """Return a pin owner's name as UTF-8 bytes, or raise ValueError saying what is wrong."""
    if not isinstance(owner, str) or not owner:
        raise ValueError(f"a pin owner is a non-empty string, not {owner!r:.80}")
    raw = owner.encode("utf-8")
    if len(raw) > limits.owner_bytes_max:
        raise ValueError(
            f"a pin owner is at most {limits.owner_bytes_max} bytes of UTF-8, not {len(raw)}"
        )
    if b"\x00" in raw:
        raise ValueError("a pin owner may not contain a NUL character")
    return raw


def check_data(data: object) -> memoryview:
    """Return a byte view of a payload (or a chunk of one), or raise TypeError."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise TypeError(f"a payload is bytes, not {type(data).__name__}")
    view = memoryview(data)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")
