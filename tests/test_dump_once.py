"""A member reads its dump once at start: the dump checked before start is the one loaded.

Rule (dumpfile.CheckedDump): `check_dump` read, checked and decoded the whole dump before
pysyncobj built its journal, and pysyncobj's first tick read and decoded it all again through the
deserializer (seconds at a million items). The state checked is now handed to the load, once, and
only while the file is the same file; the restored table is the table that was dumped.
"""

from __future__ import annotations

import os
from pathlib import Path

import msgpack
import pytest

from meshjobs import dumpfile
from meshjobs.dumpfile import CheckedDump, read_dump, write_dump
from meshjobs.failpoints import Failpoints
from meshjobs.replica import Replica
from meshjobs.table import JobTable
from tests.helpers import free_port, wait_until

WAIT_S = 60.0
SPEC = {"argv": ["true"], "pool": "default", "priority": 0, "retries": 0, "runtime_s": None,
        "hold": False, "tags": [], "env": {}, "cwd": None, "max_leases": None}
ENTRY = (b"x", 1, 1)


def _open(data: Path, addr: str, secret: bytes) -> Replica:
    r = Replica(addr, [], str(data), secret, JobTable(), Failpoints())

    def leads() -> bool:
        r.tick(0.01)
        r.journal_sync()
        r.take_applied()
        return bool(r._isLeader()) and r.view().ready
    wait_until(leads, WAIT_S, "the replica of a fleet of one leads")
    return r


def _settle(r: Replica, until) -> None:
    def step() -> bool:
        r.tick(0.01)
        r.log_proposals()
        r.journal_sync()
        r.take_applied()
        return bool(until())
    wait_until(step, WAIT_S, "the replica got there")


def _digest(t: JobTable) -> bytes:
    return msgpack.packb(t.to_state(), use_bin_type=True)


def test_restart_reads_the_dump_once_and_restores_the_same_table(tmp_path: Path,
                                                                  monkeypatch) -> None:
    """A restarted member over a dump and a journal tail reads the dump file once (it was read
    twice), and its table is the one it had: the same snapshot bytes."""
    addr, secret = f"127.0.0.1:{free_port()}", os.urandom(32)
    r = _open(tmp_path, addr, secret)
    try:
        for j in range(3):
            r.propose({"k": "submit", "t": 1000 + j, "id": f"j{j}", "spec": dict(SPEC),
                       "dg": b"d%d" % j, "ip": [None], "n": 5})
        _settle(r, lambda: len(r.table.jobs) == 3)
        r.forceLogCompaction()
        _settle(r, lambda: r.dumps.written >= 1 and r.journal.compactions >= 1)
        # A tail after the dump: restored from the journal on top of it.
        r.propose({"k": "submit", "t": 2000, "id": "tail", "spec": dict(SPEC), "dg": b"t",
                   "ip": [None], "n": 2})
        _settle(r, lambda: "tail" in r.table.jobs)
        before = _digest(r.table)
    finally:
        r.close()
    assert os.path.exists(tmp_path / "raft.dump")

    reads: list[str] = []
    real = dumpfile.read_dump

    def counting(path: str) -> dumpfile.Dump:
        reads.append(path)
        return real(path)
    monkeypatch.setattr(dumpfile, "read_dump", counting)
    r = _open(tmp_path, addr, secret)
    try:
        _settle(r, lambda: "tail" in r.table.jobs)
        assert _digest(r.table) == before
        assert reads == [str(tmp_path / "raft.dump")]
        assert r._checked is None  # not held beside the table once loaded
    finally:
        r.close()


def test_a_dump_replaced_after_the_check_is_read_anew(tmp_path: Path) -> None:
    """`take` gives back what `check` read only while the file is that file: a dump renamed
    into place since (one sent by the leader) is not taken for it."""
    path = str(tmp_path / "raft.dump")
    write_dump(path, {"v": "old"}, ENTRY, ENTRY, ["a"])
    checked = CheckedDump()
    assert checked.check(path).state == {"v": "old"}
    write_dump(path + ".tmp", {"v": "new"}, ENTRY, ENTRY, ["a"])
    os.replace(path + ".tmp", path)
    assert checked.take(path) is None
    assert read_dump(path).state == {"v": "new"}


def test_what_was_checked_is_taken_once(tmp_path: Path) -> None:
    """A second `take`, a `take` of another path, or a `take` after `forget` is None; no dump
    at all checks as None."""
    path = str(tmp_path / "raft.dump")
    checked = CheckedDump()
    assert checked.check(path) is None
    assert checked.take(path) is None
    write_dump(path, {"v": 1}, ENTRY, ENTRY, [])
    checked.check(path)
    assert checked.take(str(tmp_path / "other")) is None
    assert checked.take(path) is None
    checked.check(path)
    assert checked.take(path).state == {"v": 1}
    assert checked.take(path) is None
    checked.check(path)
    checked.forget()
    assert checked.take(path) is None


def test_a_damaged_dump_is_refused_at_the_check(tmp_path: Path) -> None:
    """The check still refuses a damaged dump (DumpCorrupt), and remembers nothing of it."""
    path = str(tmp_path / "raft.dump")
    write_dump(path, {"v": 1}, ENTRY, ENTRY, [])
    with open(path, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 0xFF]))
    checked = CheckedDump()
    with pytest.raises(dumpfile.DumpCorrupt):
        checked.check(path)
    assert checked.take(path) is None
