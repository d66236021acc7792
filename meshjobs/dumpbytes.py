"""The dump format, as bytes: what `dumpfile.py` writes to disk and what a leader sends a new
worker (F_JOB_STATE with `dump`), packed and checked here without any IO.

A dump is an 18-byte header (magic `MJD1`, format version u16, payload length u64, crc32 of the
payload u32, little-endian) and a msgpack payload
`{"state": ..., "last": [command, idx, term], "prev": [command, idx, term], "cluster": [node ids]}`.

Rule 1: pure. No IO: bytes in, a `Dump` (or `DumpCorrupt`) out; bytes out of a state.
Rule 2: msgpack only, never pickle: a dump may come from a peer.
Rule 3: anything wrong with the bytes is `DumpCorrupt`, naming where they came from; a dump is
checked whole (header, length, crc, document) before anything of it is used.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass
from typing import Any

import msgpack

from meshjobs import limits

MAGIC = b"MJD1"
FORMAT_VERSION = 1
HEADER = struct.Struct("<4sHQI")  # magic, format version, payload length, crc32 of payload
HEADER_BYTES = HEADER.size

Entry = tuple[bytes, int, int]


class DumpCorrupt(Exception):
    """A dump is damaged or is not a meshjobs dump."""


@dataclass(frozen=True)
class Dump:
    """What one dump holds."""

    state: Any
    last: Entry
    prev: Entry
    cluster: list[str]


def payload(state: Any, last: Entry, prev: Entry, cluster: list[str]) -> bytes:
    """The msgpack payload of a dump; ValueError when it is over `snapshot_bytes_max`."""
    out = msgpack.packb({"state": state, "last": _entry_out(last), "prev": _entry_out(prev),
                         "cluster": list(cluster)}, use_bin_type=True)
    if len(out) > limits.snapshot_bytes_max:
        raise ValueError(
            f"dump of {len(out)} bytes is over snapshot_bytes_max ({limits.snapshot_bytes_max})")
    return out


def header(body: bytes) -> bytes:
    """The header that goes before a payload."""
    return HEADER.pack(MAGIC, FORMAT_VERSION, len(body), zlib.crc32(body))


def parse(data: bytes | memoryview, where: str, hint: str) -> Dump:
    """A dump's bytes checked and decoded; DumpCorrupt naming `where` (a path, a peer) and
    saying `hint` (what to do) on any damage."""

    def corrupt(why: str) -> DumpCorrupt:
        return DumpCorrupt(f"dump {where} is damaged ({why}); {hint}")

    if len(data) < HEADER_BYTES:
        raise corrupt(f"{len(data)} bytes is shorter than the {HEADER_BYTES}-byte header")
    magic, version, length, crc = HEADER.unpack_from(data)
    if magic != MAGIC:
        raise corrupt(f"bad magic {bytes(magic)!r}")
    if version != FORMAT_VERSION:
        raise corrupt(f"format version {version}, this build reads {FORMAT_VERSION}")
    if length > limits.snapshot_bytes_max:
        raise corrupt(f"payload length {length} is over snapshot_bytes_max")
    body = memoryview(data)[HEADER_BYTES:]
    if len(body) != length:
        raise corrupt(f"payload length {length} but {len(body)} bytes follow the header")
    if zlib.crc32(body) != crc:
        raise corrupt("checksum mismatch")
    try:
        doc = msgpack.unpackb(body, raw=False, strict_map_key=False, use_list=True)
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as e:
        raise corrupt(f"payload is not msgpack ({e})") from e
    if not isinstance(doc, dict) or set(doc) != {"state", "last", "prev", "cluster"}:
        raise corrupt("payload is not a dump document")
    cluster = doc["cluster"]
    if not isinstance(cluster, list) or not all(isinstance(n, str) for n in cluster):
        raise corrupt("cluster is not a list of node ids")
    return Dump(state=doc["state"], last=_entry_in(corrupt, doc["last"]),
                prev=_entry_in(corrupt, doc["prev"]), cluster=cluster)


def _entry_out(entry: Entry) -> list[Any]:
    command, idx, term = entry
    return [bytes(command), int(idx), int(term)]


def _entry_in(corrupt: Any, value: Any) -> Entry:
    if (
        not isinstance(value, list)
        or len(value) != 3
        or not isinstance(value[0], bytes)
        or not isinstance(value[1], int)
        or not isinstance(value[2], int)
    ):
        raise corrupt(f"an entry is not [command, idx, term]: {value!r:.200}")
    return value[0], value[1], value[2]
