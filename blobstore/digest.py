"""Content addresses: blake3-256 digests, as 64 lowercase hex characters in every interface.

Rule: a digest crossing an interface is hex; only the LMDB keys inside the store are raw bytes.
"""

from __future__ import annotations

import re

import blake3

digest_bytes = 32  # blake3-256
_HEX = re.compile(r"[0-9a-f]{64}")


def hexdigest(data: bytes) -> str:
    """Return the blake3-256 digest of `data` as 64 lowercase hex characters."""
    return blake3.blake3(data).hexdigest()


def is_digest(s: object) -> bool:
    """True when `s` is a str of exactly 64 lowercase hex characters."""
    return isinstance(s, str) and _HEX.fullmatch(s) is not None


def check_digest(s: object) -> str:
    """Return `s` when it is a digest; otherwise raise ValueError saying what a digest looks like."""
    if not is_digest(s):
        shown = repr(s)
        if len(shown) > 80:
            shown = shown[:77] + "..."
        raise ValueError(
            f"not a blob digest: {shown}; a digest is 64 lowercase hex characters (blake3-256)"
        )
    return s  # type: ignore[return-value]


class Hasher:
    """Incremental blake3-256, fed chunk by chunk while a payload streams past."""

    __slots__ = ("_h",)

    def __init__(self) -> None:
        self._h = blake3.blake3()

    def update(self, data: bytes | bytearray | memoryview) -> None:
        self._h.update(data)

    def digest(self) -> bytes:
        return self._h.digest()

    def hexdigest(self) -> str:
        return self._h.hexdigest()


# The digest of the empty payload. Every member stores it once, pinned for good, so an empty
# output needs no write, no fsync and no copy.
EMPTY_DIGEST = hexdigest(b"")
