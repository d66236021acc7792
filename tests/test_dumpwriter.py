"""Tests of the forked dump writer (meshjobs/dumpwriter.py): dumps written by a child while the
jobs thread goes on, and every way a child can fail leaves the journal untrimmed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from pysyncobj.config import SERIALIZER_STATE
from pysyncobj.node import TCPNode

from meshjobs.dumpfile import DumpHealth, make_dump_pair, read_dump
from meshjobs.dumpwriter import ForkedDumps
from meshjobs.failpoints import Failpoints
from tests.helpers import submit_big_entry, wait_until

LAST = (b"\x01last", 42, 3)
PREV = (b"\x01prev", 41, 3)
CLUSTER = {TCPNode("127.0.0.1:4002"), TCPNode("127.0.0.1:4001")}


def _writer(path: Path, state: dict, failpoints: Failpoints | None = None,
            health: DumpHealth | None = None) -> ForkedDumps:
    _, deserializer = make_dump_pair(lambda: None, lambda s: None)
    return ForkedDumps(str(path), 1 << 16, lambda: dict(state), deserializer,
                       health or DumpHealth(), failpoints)


def _outcome(w: ForkedDumps) -> tuple[int, int | None]:
    """Tick as pysyncobj does until the child has ended."""
    got: list[tuple[int, int | None]] = []

    def ended() -> bool:
        got.append(w.checkSerializing())
        return got[-1][0] != SERIALIZER_STATE.SERIALIZING
    wait_until(ended, 30, "the dump writer's end")
    return got[-1]


def test_child_writes_the_state_of_the_fork(tmp_path: Path) -> None:
    """The dump holds the state at `serialize` (the child's copy), not what the member changed
    while the child wrote; it is renamed into place only after its fsync."""
    path = tmp_path / "raft.dump"
    state = {"a": 1}
    health = DumpHealth()
    w = _writer(path, state, Failpoints("dump.fsync=sleep:300"), health)
    w.serialize((None, LAST, PREV, CLUSTER), 42)
    assert w.writing
    state["a"] = 2  # the member goes on applying entries
    assert w.checkSerializing()[0] == SERIALIZER_STATE.SERIALIZING
    assert not path.exists()
    assert _outcome(w) == (SERIALIZER_STATE.SUCCESS, 42)
    dump = read_dump(str(path))
    assert dump.state == {"a": 1}
    assert (dump.last, dump.prev) == (LAST, PREV)
    assert dump.cluster == ["127.0.0.1:4001", "127.0.0.1:4002"]
    assert not (tmp_path / "raft.dump.tmp").exists()
    assert (health.written, health.failures) == (1, 0)
    assert w.checkSerializing() == (SERIALIZER_STATE.NOT_SERIALIZING, None)


def test_failed_fsync_in_the_child_is_a_failed_dump(tmp_path: Path) -> None:
    """dump.fsync failing in the child: FAILED (pysyncobj then keeps its journal), no tmp file,
    the old dump untouched, the failure counted with its reason. The failpoint is counted by the
    member: `dump.fsync=1..1` fails the first dump only."""
    path = tmp_path / "raft.dump"
    path.write_bytes(b"the old dump")
    health = DumpHealth()
    fp = Failpoints("dump.fsync=1..1")
    w = _writer(path, {"a": 1}, fp, health)
    w.serialize((None, LAST, PREV, CLUSTER), 42)
    assert _outcome(w) == (SERIALIZER_STATE.FAILED, 42)
    assert path.read_bytes() == b"the old dump"
    assert not (tmp_path / "raft.dump.tmp").exists()
    assert health.failures == 1 and "injected failure at dump.fsync" in (health.last_error or "")
    assert fp.hits("dump.fsync") == 1
    w.serialize((None, LAST, PREV, CLUSTER), 43)
    assert _outcome(w) == (SERIALIZER_STATE.SUCCESS, 43)
    assert fp.hits("dump.fsync") == 2
    assert read_dump(str(path)).state == {"a": 1}


def test_state_that_cannot_be_packed_fails_the_dump(tmp_path: Path) -> None:
    """An error while packing (here: a state msgpack refuses) is reported by the child."""
    path = tmp_path / "raft.dump"
    health = DumpHealth()
    w = _writer(path, {"a": object()}, None, health)
    w.serialize((None, LAST, PREV, CLUSTER), 7)
    assert _outcome(w) == (SERIALIZER_STATE.FAILED, 7)
    assert not path.exists() and not (tmp_path / "raft.dump.tmp").exists()
    assert "TypeError" in (health.last_error or "")


def test_child_killed_is_a_failed_dump(tmp_path: Path) -> None:
    """A child that dies by a signal (the OOM killer, say) is a failed dump, whatever it wrote."""
    path = tmp_path / "raft.dump"
    health = DumpHealth()
    w = _writer(path, {"a": 1}, Failpoints("dump.fsync=sleep:30000"), health)
    w.serialize((None, LAST, PREV, CLUSTER), 9)
    wait_until(lambda: (tmp_path / "raft.dump.tmp").exists(), 30, "the child's tmp file")
    os.kill(w._pid, signal.SIGKILL)
    assert _outcome(w) == (SERIALIZER_STATE.FAILED, 9)
    assert not path.exists() and not (tmp_path / "raft.dump.tmp").exists()
    assert health.failures == 1 and "signal 9" in (health.last_error or "")


def test_close_stops_the_child(tmp_path: Path) -> None:
    """A member that stops kills its writer and drops its tmp file."""
    path = tmp_path / "raft.dump"
    w = _writer(path, {"a": 1}, Failpoints("dump.fsync=sleep:30000"))
    w.serialize((None, LAST, PREV, CLUSTER), 9)
    pid = w._pid
    wait_until(lambda: (tmp_path / "raft.dump.tmp").exists(), 30, "the child's tmp file")
    w.close()
    with pytest.raises(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)  # reaped
    assert not (tmp_path / "raft.dump.tmp").exists() and not path.exists()
    assert not w.writing


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_child_dies_with_the_member(tmp_path: Path) -> None:
    """A member killed while its child writes takes the child with it (rule 3): the child never
    renames a dump over one a restarted member writes."""
    script = textwrap.dedent(f"""
        import os, sys, time
        sys.path.insert(0, {os.getcwd()!r})
        from meshjobs.dumpfile import DumpHealth
        from meshjobs.dumpwriter import ForkedDumps
        from meshjobs.failpoints import Failpoints
        w = ForkedDumps({str(tmp_path / "raft.dump")!r}, 65536, lambda: {{"a": 1}},
                        lambda p: None, DumpHealth(), Failpoints("dump.fsync=sleep:60000"))
        w.serialize((None, (b"x", 2, 1), (b"y", 1, 1), []), 2)
        print(w._pid, flush=True)
        time.sleep(60)
    """)
    member = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE)
    try:
        assert member.stdout is not None
        child = int(member.stdout.readline())
        wait_until(lambda: (tmp_path / "raft.dump.tmp").exists(), 30, "the child's tmp file")
    finally:
        member.kill()
        member.wait(30)

    def gone() -> bool:
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            return True
        # Killed but not yet reaped by init shows as a zombie.
        with open(f"/proc/{child}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    wait_until(gone, 30, "the orphaned dump writer's end")
    assert not (tmp_path / "raft.dump").exists()


def test_member_serves_while_a_dump_is_written(meshd_factory) -> None:
    """The jobs thread does not wait for a dump: while a (very slow) dump is being written, the
    member takes a job and runs it to the end; stopped meanwhile, it stops cleanly, leaves no
    tmp file and comes back with every job (the journal was not trimmed for the dump)."""
    m = meshd_factory(env={"MESHJOBS_FAILPOINTS": "dump.fsync=sleep:120000"})
    big = submit_big_entry(m)
    tmp = os.path.join(m.data, "raft.dump.tmp")
    wait_until(lambda: os.path.exists(tmp), 60, "a dump being written")
    status, rec = m.request("POST", "/jobs", {"argv": ["sh", "-c", "echo during"]}, timeout_s=20)
    assert status == 201, rec
    assert m.wait_job(rec["id"], timeout_s=20)["state"] == "done"
    status, h = m.request("GET", "/healthz", timeout_s=20)
    assert status == 200 and h.get("ready")
    assert os.path.exists(tmp), "the dump finished: this test needs one still being written"
    assert m.metrics().get("meshjobs_dumps_written_total", 0) == 0
    assert m.terminate() == 0
    assert not os.path.exists(tmp)
    m.extra_env = {}
    m.start()
    for job_id, state in ((big["id"], "held"), (rec["id"], "done")):
        status, job = m.request("GET", f"/jobs/{job_id}")
        assert status == 200 and job["state"] == state


def test_dump_from_the_leader_wins_over_ours(tmp_path: Path) -> None:
    """A dump received from the leader while our child writes one: ours is abandoned (never
    renamed over the leader's, never reported as written), the leader's stays in place."""
    path = tmp_path / "raft.dump"
    health = DumpHealth()
    w = _writer(path, {"a": 1}, Failpoints("dump.fsync=sleep:30000"), health)
    w.serialize((None, LAST, PREV, CLUSTER), 9)
    wait_until(lambda: (tmp_path / "raft.dump.tmp").exists(), 30, "the child's tmp file")
    assert w.setTransmissionData((b"the leader's dump", True, False)) is False
    assert w.writing
    assert w.setTransmissionData((b"", False, True)) is True
    assert not w.writing and not (tmp_path / "raft.dump.tmp").exists()
    assert path.read_bytes() == b"the leader's dump"
    assert w.checkSerializing() == (SERIALIZER_STATE.NOT_SERIALIZING, None)
    assert (health.written, health.failures) == (0, 0)


def _journal_writer(tmp_path: Path, failpoints: Failpoints | None = None):
    from meshjobs.journal import DurableJournal

    j = DurableJournal(str(tmp_path / "raft.journal"))
    for i in range(1, 43):
        j.add(b"c%d" % i, i, 3)
    j.sync()
    _, deserializer = make_dump_pair(lambda: None, lambda s: None)
    w = ForkedDumps(str(tmp_path / "raft.dump"), 1 << 16, lambda: {"a": 1}, deserializer,
                    DumpHealth(), failpoints, journal=j)
    return j, w


def test_the_child_deletes_the_older_segments_after_its_dump(tmp_path: Path) -> None:
    """A dump starts a journal segment (the entries from its prev on) before the fork; the child
    deletes the older segments once its dump and the new segment are durable, and the member
    then forgets them."""
    j, w = _journal_writer(tmp_path)
    old = j.segment_paths
    w.serialize((None, (b"c42", 42, 3), (b"c41", 41, 3), CLUSTER), 41)
    assert len(j.segment_paths) == 2
    j.add(b"c43", 43, 3)  # logged while the child writes: to the new segment
    assert _outcome(w) == (SERIALIZER_STATE.SUCCESS, 41)
    assert not any(os.path.exists(p) for p in old)
    assert j.segment_paths == [j.segment_path] and j.segment_path not in old
    j.deleteEntriesTo(41 - 1)
    j._destroy()
    from meshjobs.journal import DurableJournal

    again = DurableJournal(str(tmp_path / "raft.journal"), dump_prev_idx=41)
    assert [e[1] for e in again[:]] == [41, 42, 43]
    again._destroy()


@pytest.mark.parametrize("point", ["journal.segment_fsync", "journal.segment_delete"])
def test_a_child_that_fails_after_its_rename_keeps_the_older_segments(tmp_path: Path,
                                                                       point: str) -> None:
    """A failure after the dump's rename (fsyncing the new segment or the folder, deleting the
    older segments) is a failed dump: the member keeps every segment and entry, and the next
    dump's child deletes them."""
    j, w = _journal_writer(tmp_path, Failpoints(f"{point}=1..1"))
    old = j.segment_paths
    w.serialize((None, (b"c42", 42, 3), (b"c41", 41, 3), CLUSTER), 41)
    assert _outcome(w)[0] == SERIALIZER_STATE.FAILED
    assert all(os.path.exists(p) for p in old) and len(j.segment_paths) == 2
    assert len(j) == 42
    w.serialize((None, (b"c42", 42, 3), (b"c41", 41, 3), CLUSTER), 41)
    assert _outcome(w) == (SERIALIZER_STATE.SUCCESS, 41)
    assert len(j.segment_paths) == 1 and not any(os.path.exists(p) for p in old)
    j._destroy()
