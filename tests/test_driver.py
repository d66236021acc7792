"""The driver against real subprocesses, real spool files and a real LMDB blob store."""

from __future__ import annotations

import os
import queue
import stat
import tracemalloc
from collections.abc import Iterator
from pathlib import Path

import blake3
import pytest

from blobstore import limits as blob_limits
from blobstore.store import LmdbBlobStore
from meshjobs import limits
from meshjobs.node import Run
from tests.helpers import DriverHarness as Harness
from tests.helpers import alive, wait_until

WAIT_S = 30  # the longest a test waits for anything


def put_bytes(blobs: LmdbBlobStore, data: bytes) -> str:
    return blobs.put(data)


def item(argv: list[str], index: int = 0, job_id: str = "j1", epoch: int = 1,
         env: dict[str, str] | None = None, cwd: str | None = None, stdin: str | None = None,
         runtime_s: float | None = None) -> Run:
    return Run(job_id, index, epoch, argv, env or {}, cwd, stdin, runtime_s)


def sh(script: str, **kw: object) -> Run:
    return item(["sh", "-c", script], **kw)  # type: ignore[arg-type]


@pytest.fixture
def blobs(tmp_path: Path) -> Iterator[LmdbBlobStore]:
    store = LmdbBlobStore(str(tmp_path / "blobs"))
    yield store
    store.close()


@pytest.fixture
def h(tmp_path: Path, blobs: LmdbBlobStore) -> Iterator[Harness]:
    harness = Harness(tmp_path, blobs)
    yield harness
    harness.close()


def wait_gone(pid: int) -> bool:
    return wait_until(lambda: not alive(pid), WAIT_S, what=f"process {pid} gone")


def wait_file(path: Path) -> str:
    return wait_until(lambda: path.exists() and path.read_text().endswith("\n") and path.read_text(),
                      WAIT_S, what=f"{path} written")


# --- Output, input, environment ---------------------------------------------------------------


def test_stdout_and_stderr_are_captured_into_blobs(h: Harness, blobs: LmdbBlobStore) -> None:
    """Both streams land in the blob store and the end names their digests."""
    h.driver.start(sh("echo out; echo err >&2"))
    end = h.end()
    assert (end.state, end.rc, end.signal, end.error) == ("done", 0, None, None)
    assert end.stdout is not None and end.stderr is not None
    assert blobs.get(end.stdout) == b"out\n"
    assert blobs.get(end.stderr) == b"err\n"
    assert (end.job_id, end.index, end.epoch) == ("j1", 0, 1)
    assert 0 < end.started_ms <= end.ended_ms


def test_empty_output_still_has_a_digest(h: Harness, blobs: LmdbBlobStore) -> None:
    """An item that prints nothing reports the empty payload's digest, not None."""
    h.driver.start(item(["true"]))
    end = h.end()
    empty = blake3.blake3(b"").hexdigest()
    assert (end.state, end.stdout, end.stderr) == ("done", empty, empty)


def test_stdin_comes_from_its_blob(h: Harness, blobs: LmdbBlobStore, tmp_path: Path) -> None:
    """The stdin blob is what the program reads."""
    digest = put_bytes(blobs, b"hello mesh\n")
    h.driver.start(item(["tr", "a-z", "A-Z"], stdin=digest))
    end = h.end()
    assert end.state == "done"
    assert end.stdout is not None and blobs.get(end.stdout) == b"HELLO MESH\n"


def test_stdin_is_empty_without_a_blob(h: Harness, blobs: LmdbBlobStore) -> None:
    """Without a stdin blob the program reads end of file at once."""
    h.driver.start(item(["cat"]))
    end = h.end()
    assert end.state == "done" and end.stdout is not None
    assert blobs.get(end.stdout) == b""


def test_missing_stdin_blob_fails_the_item(h: Harness) -> None:
    """A stdin digest this member does not hold fails the item with a reason."""
    h.driver.start(item(["cat"], stdin="00" * 32))
    end = h.end()
    assert (end.state, end.rc, end.stdout, end.stderr) == ("failed", None, None, None)
    assert end.error is not None and "00" * 32 in end.error


def test_environment_names_the_item(h: Harness, blobs: LmdbBlobStore) -> None:
    """MESH_JOB_ID, MESH_ITEM_INDEX, MESH_LEASE_EPOCH and the job's env reach the program."""
    h.driver.start(sh('echo "$MESH_JOB_ID $MESH_ITEM_INDEX $MESH_LEASE_EPOCH $EXTRA"',
                      job_id="job-7", index=42, epoch=9, env={"EXTRA": "x y"}))
    end = h.end()
    assert end.stdout is not None and blobs.get(end.stdout) == b"job-7 42 9 x y\n"


def test_environment_is_not_the_drivers(tmp_path: Path, blobs: LmdbBlobStore,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Rule 7: a secret in the driver's own environment does not reach items; the variables
    env_pass names (a prefix too) do, and PATH always; the job's env wins over them."""
    monkeypatch.setenv("SECRET_TOKEN", "s3cret")
    monkeypatch.setenv("KEEP_ME", "kept")
    monkeypatch.setenv("TOOL_X", "x")
    monkeypatch.setenv("TOOL_Y", "y")
    h = Harness(tmp_path, blobs, env_pass=("KEEP_ME", "TOOL_*"))
    try:
        h.driver.start(item(["env"], env={"TOOL_Y": "job's"}))
        end = h.end()
        assert end.stdout is not None
        got = dict(line.split("=", 1) for line in
                   (blobs.get(end.stdout) or b"").decode().splitlines())
        assert set(got) == {"KEEP_ME", "TOOL_X", "TOOL_Y", "PATH", "MESH_JOB_ID",
                            "MESH_ITEM_INDEX", "MESH_LEASE_EPOCH", "MESH_MEMBER"}, got
        assert (got["KEEP_ME"], got["TOOL_X"], got["TOOL_Y"]) == ("kept", "x", "job's")
    finally:
        h.close()


def test_cwd_is_used(h: Harness, blobs: LmdbBlobStore, tmp_path: Path) -> None:
    """The program runs in the job's working directory."""
    h.driver.start(item(["pwd"], cwd=str(tmp_path)))
    end = h.end()
    assert end.stdout is not None and blobs.get(end.stdout) == f"{tmp_path}\n".encode()


# --- How items end ------------------------------------------------------------------------------


def test_nonzero_rc_fails(h: Harness) -> None:
    """rc != 0 is state failed with that rc."""
    h.driver.start(sh("exit 3"))
    end = h.end()
    assert (end.state, end.rc, end.signal) == ("failed", 3, None)


def test_killed_by_a_signal_fails_with_the_signal(h: Harness) -> None:
    """A program killed by a signal is failed, rc None, signal set."""
    h.driver.start(sh("kill -9 $$"))
    end = h.end()
    assert (end.state, end.rc, end.signal) == ("failed", None, 9)
    assert end.stdout is not None


def test_runtime_limit_kills_the_whole_group(h: Harness, tmp_path: Path) -> None:
    """Past its runtime limit the item's group is killed, grandchildren too; state timeout."""
    gc = tmp_path / "gc"
    h.driver.start(sh(f"sleep 30 & echo $! > {gc}; sleep 30", runtime_s=0.5))
    end = h.end()
    assert (end.state, end.rc, end.signal) == ("timeout", None, 9)
    assert end.stdout is not None and end.stderr is not None
    assert wait_gone(int(wait_file(gc)))


def test_leftovers_die_with_the_leader(h: Harness, tmp_path: Path) -> None:
    """A process left in the group when the leader exits does not outlive the item."""
    gc = tmp_path / "gc"
    h.driver.start(sh(f"sleep 30 >/dev/null 2>&1 & echo $! > {gc}"))
    end = h.end()
    assert end.state == "done"
    assert wait_gone(int(wait_file(gc)))


def test_unknown_program_fails_with_a_reason(h: Harness) -> None:
    """A program that does not exist is failed with an error saying what to do."""
    h.driver.start(item(["no-such-program-meshjobs"]))
    end = h.end()
    assert (end.state, end.rc, end.signal, end.stdout, end.stderr) == (
        "failed", None, None, None, None)
    assert end.error is not None
    assert "no such program 'no-such-program-meshjobs'" in end.error
    assert "argv" in end.error


def test_program_that_may_not_run_fails_with_a_reason(h: Harness, tmp_path: Path) -> None:
    """A program without execute permission is failed with an error."""
    prog = tmp_path / "prog"
    prog.write_text("#!/bin/sh\necho hi\n")
    prog.chmod(stat.S_IRUSR | stat.S_IWUSR)
    h.driver.start(item([str(prog)]))
    end = h.end()
    assert (end.state, end.rc, end.stdout) == ("failed", None, None)
    assert end.error is not None and str(prog) in end.error


def test_bad_cwd_fails_with_a_reason(h: Harness, tmp_path: Path) -> None:
    """A working directory that does not exist is failed with an error naming it."""
    cwd = str(tmp_path / "nowhere")
    h.driver.start(item(["true"], cwd=cwd))
    end = h.end()
    assert (end.state, end.rc, end.stdout) == ("failed", None, None)
    assert end.error is not None and cwd in end.error and "cwd" in end.error


# --- cut, start twice, running, stop ------------------------------------------------------------


def test_cut_kills_the_group(h: Harness, tmp_path: Path) -> None:
    """cut ends a running item's whole group; state cut."""
    gc = tmp_path / "gc"
    it = sh(f"sleep 30 & echo $! > {gc}; wait")
    h.driver.start(it)
    pid = int(wait_file(gc))
    assert h.driver.running() == {it.key}
    h.driver.cut(*it.key)
    end = h.end()
    assert end.state == "cut" and end.rc is None and end.signal is not None
    assert end.stdout is not None
    assert wait_gone(pid)
    assert h.driver.running() == set()


def test_cut_kills_after_grace_when_sigterm_is_ignored(
    h: Harness, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An item that ignores SIGTERM is killed with SIGKILL once the cut's grace has passed."""
    monkeypatch.setattr(limits, "cut_grace_ms", 200)
    ready = tmp_path / "ready"
    it = sh(f"trap '' TERM; echo ok > {ready}; sleep 30")
    h.driver.start(it)
    wait_file(ready)
    h.driver.cut(*it.key)
    end = h.end()
    assert (end.state, end.signal) == ("cut", 9)


def test_cut_of_something_not_running_is_a_noop(h: Harness) -> None:
    """cut of an unknown run reports nothing and leaves other runs alone."""
    h.driver.cut("nope", 0, 0)
    it = sh("echo hi", job_id="other")
    h.driver.start(it)
    h.driver.cut("nope", 0, 0)
    end = h.end()
    assert (end.job_id, end.state) == ("other", "done")


def test_cut_before_spawn_reports_cut_without_a_process(tmp_path: Path, blobs: LmdbBlobStore) -> None:
    """A run cut while still queued is reported cut once, and never spawned."""
    harness = Harness(tmp_path, blobs, run=False)
    marker = tmp_path / "ran"
    it = sh(f"echo x > {marker}")
    harness.driver.start(it)
    harness.driver.cut(*it.key)
    harness.thread.start()
    end = harness.end()
    assert (end.state, end.stdout, end.rc) == ("cut", None, None)
    harness.close()
    assert not marker.exists()
    assert harness.ends.empty()


def test_start_twice_runs_once(h: Harness, tmp_path: Path) -> None:
    """A second start of the same (job, index, epoch) while it runs is a no-op."""
    runs = tmp_path / "runs"
    it = sh(f"echo run >> {runs}; sleep 0.2")
    h.driver.start(it)
    h.driver.start(it)
    first = h.end()
    assert first.state == "done"
    h.driver.start(sh("true", job_id="after"))
    assert h.end().job_id == "after"
    h.close()
    assert h.ends.empty()
    assert runs.read_text() == "run\n"


def test_stop_kills_everything_and_run_returns(h: Harness, tmp_path: Path) -> None:
    """stop() kills every running group, reports nothing, and run() returns."""
    pids = []
    for i in range(3):
        gc = tmp_path / f"gc{i}"
        h.driver.start(sh(f"sleep 30 & echo $! > {gc}; wait", index=i))
        pids.append(int(wait_file(gc)))
    h.close()
    assert h.ends.empty()
    assert all(wait_gone(pid) for pid in pids)
    assert list(h.spool.iterdir()) == []
    h.driver.start(sh("true", index=9))  # after stop: dropped, not run
    h.driver.cut("j1", 0, 1)
    assert h.ends.empty()


def test_queue_is_bounded(tmp_path: Path, blobs: LmdbBlobStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """start beyond limits.driver_queue_max waiting items raises queue.Full."""
    monkeypatch.setattr(limits, "driver_queue_max", 2)
    harness = Harness(tmp_path, blobs, run=False)
    harness.driver.start(item(["true"], index=0))
    harness.driver.start(item(["true"], index=1))
    harness.driver.start(item(["true"], index=1))  # already accepted: a no-op, not a third
    with pytest.raises(queue.Full):
        harness.driver.start(item(["true"], index=2))
    harness.close()
    assert harness.ends.empty()


def test_fifty_items_each_reported_once(h: Harness, blobs: LmdbBlobStore) -> None:
    """Fifty items at once all end, each reported exactly once, each with its own output."""
    for i in range(50):
        h.driver.start(sh('echo "$MESH_ITEM_INDEX"; sleep 0.1', index=i))
    ends = [h.end() for _ in range(50)]
    h.close()
    assert h.ends.empty()
    assert sorted(e.index for e in ends) == list(range(50))
    for e in ends:
        assert e.state == "done" and e.stdout is not None
        assert blobs.get(e.stdout) == f"{e.index}\n".encode()
    assert list(h.spool.iterdir()) == []


# --- Spool files and large output ---------------------------------------------------------------


def test_spool_is_cleaned(tmp_path: Path, blobs: LmdbBlobStore) -> None:
    """Leftover spool files are removed on construction, and each item's after its end."""
    spool = tmp_path / "spool"
    spool.mkdir()
    (spool / "item-7.out").write_bytes(b"old")
    harness = Harness(tmp_path, blobs)
    try:
        assert list(spool.iterdir()) == []
        digest = put_bytes(blobs, b"abc")
        harness.driver.start(item(["cat"], stdin=digest))
        assert harness.end().state == "done"
        assert list(spool.iterdir()) == []
    finally:
        harness.close()


def test_large_output_round_trips_in_bounded_memory(h: Harness, blobs: LmdbBlobStore) -> None:
    """64 MiB of stdout reaches the blob store intact, and Python memory stays below it.

    The store may hold one transaction's worth of chunks (its txn_payload_bytes_max); the
    driver itself never reads the output, so the peak stays under that plus a little, which
    is less than the output.
    """
    line = b"0123456789abcde\n"
    size = 64 * 1024 * 1024
    bound = blob_limits.txn_payload_bytes_max + 8 * 1024 * 1024
    assert bound < size
    tracemalloc.start()
    try:
        h.driver.start(sh(f"yes 0123456789abcde | head -c {size}"))
        end = h.end()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert end.state == "done" and end.stdout is not None
    assert peak < bound, f"peak Python memory {peak} bytes while storing {size}"
    want = blake3.blake3()
    block = line * (1 << 16)
    for _ in range(size // len(block)):
        want.update(block)
    assert end.stdout == want.hexdigest()
    got = blake3.blake3()
    n = 0
    chunks = blobs.open(end.stdout)
    assert chunks is not None
    for chunk in chunks:
        got.update(chunk)
        n += len(chunk)
    assert n == size and got.hexdigest() == want.hexdigest()


_REAPER_SCRIPT = r"""
import ctypes, os, subprocess, sys, time
from meshjobs.driver import PR_SET_CHILD_SUBREAPER, is_reaper, reap_orphans

def state(pid):
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rfind(b")") + 2:].split()
    return fields[0].decode(), int(fields[1])

def wait_until(cond, what):
    deadline = time.monotonic() + 30
    while not cond():
        if time.monotonic() > deadline:
            sys.exit(f"timed out waiting for {what}")
        time.sleep(0.01)

was = is_reaper()
assert ctypes.CDLL(None).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
own = subprocess.Popen(["sh", "-c", "exit 7"])
# An orphan: a grandchild that outlives its parent (which exits at once and so never waits
# for it), re-parented to this subreaper, and then exits.
out = subprocess.run(["sh", "-c", "sh -c 'sleep 1' >/dev/null 2>&1 & echo $!"],
                     capture_output=True, check=True)
orphan = int(out.stdout)
wait_until(lambda: state(orphan) == ("Z", os.getpid()), "the orphan's zombie")
wait_until(lambda: state(own.pid) == ("Z", os.getpid()), "our own child's zombie")
n = reap_orphans({own.pid})
print(was, is_reaper(), n, state(orphan), own.wait())
"""


def test_orphans_are_reaped_but_not_our_own_children(tmp_path: Path) -> None:
    """Rule 7: a subreaper (or PID 1) reaps the zombies of orphans re-parented to it, and leaves
    the exit status of its own children to their own waits."""
    import subprocess
    import sys

    root = str(Path(__file__).resolve().parent.parent)
    done = subprocess.run([sys.executable, "-c", _REAPER_SCRIPT], capture_output=True, text=True,
                          timeout=60, cwd=str(tmp_path),
                          env={**os.environ, "PYTHONPATH": root})
    assert done.returncode == 0, done.stderr
    # Not a reaper before the prctl, one after; one orphan reaped (gone from /proc); our own
    # child's exit code still ours to collect.
    assert done.stdout.split() == ["False", "True", "1", "None", "7"], done.stdout
