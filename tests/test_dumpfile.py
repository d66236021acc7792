"""Tests of the dump files pysyncobj writes through meshjobs/dumpfile.py."""

from __future__ import annotations

import struct
import zlib
from pathlib import Path
from typing import Any

import msgpack
import pytest
from pysyncobj.node import TCPNode

from meshjobs.dumpfile import (
    HEADER_BYTES,
    DumpCorrupt,
    check_dump,
    make_dump_pair,
    read_dump,
)
from meshjobs.failpoints import Failpoints

STATE = {
    "jobs": {"j1": {"items": [1, 2, 3], "payload": b"\x00\xff" * 100, "name": "ünï"}},
    7: [None, True, 1.5, -(2**63)],
}
LAST = (b"\x01last", 42, 3)
PREV = (b"\x01prev", 41, 3)
CLUSTER = {TCPNode("127.0.0.1:4002"), TCPNode("127.0.0.1:4001")}


def _write(path: Path, state: Any = STATE, failpoints: Failpoints | None = None) -> None:
    serializer, _ = make_dump_pair(lambda: state, lambda s: None, failpoints)
    serializer(str(path), (LAST, PREV, CLUSTER))


def test_round_trip(tmp_path: Path) -> None:
    """The deserializer hands the state to set_state and returns pysyncobj's 3-tuple."""
    path = tmp_path / "dump"
    _write(path)
    got: list[Any] = []
    _, deserializer = make_dump_pair(lambda: None, got.append)
    last, prev, cluster = deserializer(str(path))
    assert got == [STATE]
    assert (last, prev) == (LAST, PREV)
    assert type(last) is tuple and type(last[0]) is bytes
    assert not (last != LAST)  # pysyncobj compares entries with tuples
    assert cluster == ["127.0.0.1:4001", "127.0.0.1:4002"]
    check_dump(str(path))


def test_file_layout(tmp_path: Path) -> None:
    """Magic, version, length and crc head a msgpack document (no pickle anywhere)."""
    path = tmp_path / "dump"
    _write(path, state={"a": 1})
    data = path.read_bytes()
    magic, version, length, crc = struct.unpack_from("<4sHQI", data)
    assert (magic, version, length) == (b"MJD1", 1, len(data) - HEADER_BYTES)
    assert crc == zlib.crc32(data[HEADER_BYTES:])
    doc = msgpack.unpackb(data[HEADER_BYTES:], raw=False, strict_map_key=False)
    assert doc["state"] == {"a": 1} and doc["last"] == [b"\x01last", 42, 3]


def test_flipped_byte_is_corrupt(tmp_path: Path) -> None:
    """Any flipped byte, in the header or the payload, is DumpCorrupt."""
    path = tmp_path / "dump"
    _write(path)
    good = path.read_bytes()
    _, deserializer = make_dump_pair(lambda: None, lambda s: pytest.fail("state of a bad dump"))
    for pos in range(len(good)):
        damaged = bytearray(good)
        damaged[pos] ^= 0x10
        path.write_bytes(bytes(damaged))
        with pytest.raises(DumpCorrupt, match="damaged"):
            deserializer(str(path))


def test_truncated_or_extended_is_corrupt(tmp_path: Path) -> None:
    """A dump cut at any length, or with bytes after its payload, is DumpCorrupt."""
    path = tmp_path / "dump"
    _write(path)
    good = path.read_bytes()
    for cut in range(len(good)):
        path.write_bytes(good[:cut])
        with pytest.raises(DumpCorrupt):
            read_dump(str(path))
    path.write_bytes(good + b"\0")
    with pytest.raises(DumpCorrupt, match="follow the header"):
        read_dump(str(path))


def test_well_checksummed_garbage_is_corrupt(tmp_path: Path) -> None:
    """A payload with a good crc that is not a dump document is refused all the same."""
    path = tmp_path / "dump"
    for payload in [b"\xc1", msgpack.packb([1, 2]), msgpack.packb({"state": 1})]:
        header = struct.pack("<4sHQI", b"MJD1", 1, len(payload), zlib.crc32(payload))
        path.write_bytes(header + payload)
        with pytest.raises(DumpCorrupt):
            read_dump(str(path))
    doc = {"state": 1, "last": [b"x", "1", 2], "prev": [b"x", 0, 2], "cluster": []}
    payload = msgpack.packb(doc, use_bin_type=True)
    path.write_bytes(struct.pack("<4sHQI", b"MJD1", 1, len(payload), zlib.crc32(payload)) + payload)
    with pytest.raises(DumpCorrupt, match="command, idx, term"):
        read_dump(str(path))


def test_on_corrupt_hears_of_the_damage(tmp_path: Path) -> None:
    """pysyncobj swallows the deserializer's exception, so on_corrupt must be told first."""
    path = tmp_path / "dump"
    path.write_bytes(b"not a dump at all, just some bytes")
    heard: list[DumpCorrupt] = []
    _, deserializer = make_dump_pair(lambda: None, lambda s: None, on_corrupt=heard.append)
    with pytest.raises(DumpCorrupt):
        deserializer(str(path))
    assert len(heard) == 1 and "bad magic" in str(heard[0])
    with pytest.raises(DumpCorrupt):
        check_dump(str(path))
    check_dump(str(tmp_path / "missing"))


def test_failed_fsync_propagates(tmp_path: Path) -> None:
    """dump.fsync=1: the serializer raises (pysyncobj then reports a failed dump) and leaves no
    tmp file behind."""
    path = tmp_path / "dump.tmp"
    with pytest.raises(OSError, match="dump.fsync"):
        _write(path, failpoints=Failpoints("dump.fsync=1"))
    assert not path.exists()


def test_unpackable_state_propagates(tmp_path: Path) -> None:
    """A state msgpack cannot encode fails the dump instead of writing half a file."""
    path = tmp_path / "dump.tmp"
    with pytest.raises(TypeError):
        _write(path, state={"x": object()})
    assert not path.exists()


def test_failed_dump_is_counted_and_retried_with_backoff(tmp_path: Path) -> None:
    """A dump whose fsync fails raises (pysyncobj keeps its journal), leaves no tmp file, is
    counted, and the next try is due only after a backoff that doubles; a dump written resets
    it (dumpfile rule 3)."""
    from meshjobs import limits
    from meshjobs.dumpfile import DumpHealth

    now = [100.0]
    health = DumpHealth(clock=lambda: now[0])
    serializer, _ = make_dump_pair(lambda: STATE, lambda s: None, Failpoints("dump.fsync=1..2"),
                                   health=health)
    path = tmp_path / "raft.dump.tmp"
    waits = []
    for _ in range(2):
        assert health.due()
        with pytest.raises(OSError):
            serializer(str(path), (LAST, PREV, CLUSTER))
        assert not path.exists()
        assert not health.due()
        waits.append(health.retry_at - now[0])
        now[0] = health.retry_at
    assert waits == [limits.dump_retry_ms_min / 1000, 2 * limits.dump_retry_ms_min / 1000]
    assert health.failures == 2 and health.written == 0
    serializer(str(path), (LAST, PREV, CLUSTER))
    assert read_dump(str(path)).last == LAST
    assert (health.written, health.failures, health.consecutive) == (1, 2, 0) and health.due()
    for _ in range(40):  # the backoff is bounded
        health.failed(OSError(5, "x"))
    assert health.retry_at - now[0] == limits.dump_retry_ms_max / 1000
