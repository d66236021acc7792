"""Command items' stdin, stdout and stderr through pipes (meshjobs/driver.py rule 3,
meshjobs/capture.py): real processes, a real LMDB blob store, a real driver thread; then a real
meshd for what an item sees of it (descriptors, signals, its PATH)."""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import blake3
import pytest

from blobstore.digest import EMPTY_DIGEST
from blobstore.store import LmdbBlobStore
from meshjobs import limits
from meshjobs.node import Run
from tests.helpers import DriverHarness as Harness
from tests.helpers import alive, wait_until

WAIT_S = 30.0
MEMORY = limits.item_output_memory_bytes_max


def sh(script: str, stdin: str | None = None, index: int = 0, cwd: str | None = None,
       env: dict[str, str] | None = None) -> Run:
    return Run("j", index, 1, ["sh", "-c", script], env or {}, cwd, stdin, None)


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


def read_pid(path: Path) -> int:
    wait_until(lambda: path.exists() and path.read_text().endswith("\n"), WAIT_S,
               what=f"{path} written")
    return int(path.read_text())


def kill_escaped(path: Path) -> None:
    """A process that left the item's group (setsid) is the test's to end."""
    if path.exists() and path.read_text().strip():
        try:
            os.kill(int(path.read_text()), signal.SIGKILL)
        except ProcessLookupError:
            pass


# --- stdin -------------------------------------------------------------------------------------


def test_small_stdin_comes_through_a_pipe(h: Harness, blobs: LmdbBlobStore) -> None:
    """A payload up to item_stdin_pipe_bytes_max is read from a pipe, and no spool file is
    made for it."""
    digest = blobs.put(b"hello pipe\n")
    h.driver.start(sh("test -p /dev/stdin && cat", stdin=digest))
    end = h.end()
    assert (end.state, end.rc) == ("done", 0), end
    assert end.stdout is not None and blobs.get(end.stdout) == b"hello pipe\n"
    assert h.spooled() == []


def test_empty_stdin_payload_is_an_empty_pipe(h: Harness, blobs: LmdbBlobStore) -> None:
    """The empty payload (an array item of "") reads end of file at once, from a pipe."""
    h.driver.start(sh("test -p /dev/stdin && wc -c", stdin=EMPTY_DIGEST))
    end = h.end()
    assert end.state == "done" and end.stdout is not None
    assert blobs.get(end.stdout).strip() == b"0"


def test_large_stdin_is_spooled_to_a_file(h: Harness, blobs: LmdbBlobStore) -> None:
    """A payload over the limit is read from a spool file (as before), removed at the end."""
    payload = os.urandom(limits.item_stdin_pipe_bytes_max + 1)
    digest = blobs.put(payload)
    h.driver.start(sh("test -f /dev/stdin && cat", stdin=digest))
    end = h.end()
    assert end.state == "done", end
    assert end.stdout == blake3.blake3(payload).hexdigest()
    assert h.spooled() == []


def test_stdin_larger_than_the_pipe_is_fed_as_it_is_read(
        tmp_path: Path, blobs: LmdbBlobStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """A pipe payload larger than the pipe holds is written as the item reads it (the driver's
    selector), whole; an item that stops reading early still ends."""
    monkeypatch.setattr(limits, "item_stdin_pipe_bytes_max", 4 << 20)
    payload = os.urandom(3 << 20)
    digest = blobs.put(payload)
    h = Harness(tmp_path, blobs)
    try:
        h.driver.start(sh("test -p /dev/stdin && cat", stdin=digest))
        end = h.end()
        assert end.state == "done" and end.stdout == blake3.blake3(payload).hexdigest()
        h.driver.start(sh("head -c 10", stdin=digest, index=1))
        end = h.end()
        assert (end.state, end.rc) == ("done", 0)
        assert end.stdout == blake3.blake3(payload[:10]).hexdigest()
        assert h.spooled() == []
    finally:
        h.close()


def test_missing_stdin_blob_fails_without_leaking_pipes(h: Harness) -> None:
    """A stdin this member lacks fails the item unstarted, and every pipe is closed."""
    before = len(os.listdir("/proc/self/fd"))
    for i in range(20):
        h.driver.start(sh("cat", stdin="00" * 32, index=i))
    for _ in range(20):
        end = h.end()
        assert (end.state, end.stdout) == ("failed", None) and "00" * 32 in (end.error or "")
    assert len(os.listdir("/proc/self/fd")) <= before + 2


# --- stdout and stderr -------------------------------------------------------------------------


def test_small_output_stays_in_memory(h: Harness, blobs: LmdbBlobStore, tmp_path: Path) -> None:
    """Output under item_output_memory_bytes_max makes no spool file at all, is readable live
    while the item runs, and is stored when it ends."""
    gate = tmp_path / "gate"
    h.driver.start(sh(f"echo small; echo oops >&2; while [ ! -e {gate} ]; do sleep 0.01; done"))
    key = ("j", 0, 1)
    wait_until(lambda: h.live(key) == b"small\n" and h.live(key, "stderr") == b"oops\n",
               WAIT_S, what="live output")
    assert h.spooled() == []
    assert h.driver.read_output(key, "stdout", 2, 2) == (b"al", 6, False)
    gate.touch()
    end = h.end()
    assert end.state == "done"
    assert end.stdout is not None and blobs.get(end.stdout) == b"small\n"
    assert end.stderr is not None and blobs.get(end.stderr) == b"oops\n"
    assert h.driver.read_output(key, "stdout", 0, 10) is None  # reported: the blob has it


def test_output_past_the_buffer_goes_to_one_spool_file(h: Harness, blobs: LmdbBlobStore,
                                                       tmp_path: Path) -> None:
    """A stream that grows past the buffer moves to its spool file (only that stream's), which
    live reads follow across the switch; the file is removed once stored."""
    gate = tmp_path / "gate"
    size = MEMORY * 3 + 17
    h.driver.start(sh(f"echo head; echo tiny >&2; while [ ! -e {gate}.1 ]; do sleep 0.01; done;"
                      f" head -c {size} /dev/zero | tr '\\0' z;"
                      f" while [ ! -e {gate}.2 ]; do sleep 0.01; done"))
    key = ("j", 0, 1)
    wait_until(lambda: h.live(key) == b"head\n", WAIT_S, what="the first line")
    assert h.spooled() == []
    (tmp_path / "gate.1").touch()
    wait_until(lambda: len(h.live(key)) == 5 + size, WAIT_S, what="all of the output, live")
    assert [n.rsplit(".", 1)[1] for n in h.spooled()] == ["out"]
    got = h.driver.read_output(key, "stdout", 3, 4)
    assert got == (b"d\nzz", 5 + size, False)
    assert h.live(key, "stderr") == b"tiny\n"
    (tmp_path / "gate.2").touch()
    end = h.end()
    assert end.stdout == blake3.blake3(b"head\n" + b"z" * size).hexdigest()
    assert end.stderr is not None and blobs.get(end.stderr) == b"tiny\n"
    wait_until(lambda: h.spooled() == [], WAIT_S, what="the spool file removed")


def test_an_item_that_prints_slowly_is_followed(h: Harness, tmp_path: Path) -> None:
    """Each line shows up live as it is printed, before the next one, and the stream ends."""
    gate = tmp_path / "g"
    lines = 5
    h.driver.start(sh(f"for i in $(seq {lines}); do echo line $i;"
                      f" while [ ! -e {gate}.$i ]; do sleep 0.01; done; done"))
    key = ("j", 0, 1)
    seen = b""
    for i in range(1, lines + 1):
        want = f"line {i}\n".encode()
        wait_until(lambda w=want, s=seen: h.live(key)[len(s):] == w, WAIT_S, what=f"line {i}")
        seen += want
        assert not h.driver.read_output(key, "stdout", 0, 1 << 20)[2]  # not ended
        (tmp_path / f"g.{i}").touch()
    end = h.end()
    assert end.stdout == blake3.blake3(seen).hexdigest()


def test_a_fast_writer_is_stored_whole(h: Harness, blobs: LmdbBlobStore) -> None:
    """64 MiB on stdout and 8 MiB on stderr at once, as fast as the item can: all kept."""
    size = 64 << 20
    h.driver.start(sh(f"head -c {8 << 20} /dev/zero >&2 & head -c {size} /dev/zero; wait"))
    end = h.end()
    assert end.state == "done"
    want = blake3.blake3()
    block = bytes(1 << 20)
    for _ in range(size >> 20):
        want.update(block)
    assert end.stdout == want.hexdigest()
    assert end.stderr is not None and blobs.size(end.stderr) == 8 << 20
    wait_until(lambda: h.spooled() == [], WAIT_S, what="the spool files removed")


def test_closing_stdout_early_does_not_end_the_item(h: Harness, blobs: LmdbBlobStore,
                                                    tmp_path: Path) -> None:
    """The item ends when its leader exits, not when its output pipes close."""
    gate = tmp_path / "gate"
    h.driver.start(sh(f"echo before; exec 1>&-; echo closed >&2;"
                      f" while [ ! -e {gate} ]; do sleep 0.01; done; exit 4"))
    key = ("j", 0, 1)
    wait_until(lambda: h.live(key, "stderr") == b"closed\n", WAIT_S, what="stderr")
    assert key in h.driver.running() and h.ends.empty()
    gate.touch()
    end = h.end()
    assert (end.state, end.rc) == ("failed", 4)
    assert end.stdout is not None and blobs.get(end.stdout) == b"before\n"


def test_children_holding_the_pipes_do_not_hold_the_item(h: Harness, blobs: LmdbBlobStore,
                                                         tmp_path: Path) -> None:
    """A child in the group that keeps stdout open is killed with it; one that left the group
    (setsid) and writes on does not keep the item from ending, nor the driver busy."""
    grouped, escaped = tmp_path / "grouped", tmp_path / "escaped"
    try:
        h.driver.start(sh(f"sh -c 'echo $$ > {grouped}; exec sleep 1000' &"
                          f" setsid sh -c 'echo $$ > {escaped}; while :; do echo x; done' &"
                          f" while [ ! -s {grouped} ] || [ ! -s {escaped} ]; do sleep 0.01; done;"
                          f" echo leader done"))
        end = h.end()
        assert (end.state, end.rc) == ("done", 0), end
        assert end.stdout is not None
        out = blobs.get(end.stdout) or b""
        assert b"leader done\n" in out
        grouped_pid = read_pid(grouped)
        wait_until(lambda: not alive(grouped_pid), WAIT_S, what="the grouped child killed")
        # The driver goes on: the next item runs and ends.
        h.driver.start(sh("echo next", index=1))
        end = h.end()
        assert end.stdout is not None and blobs.get(end.stdout) == b"next\n"
    finally:
        kill_escaped(escaped)


def test_a_cut_item_with_a_full_pipe_ends(h: Harness, tmp_path: Path) -> None:
    """An item blocked on a pipe nobody drains fast enough is still cut, group and all."""
    h.driver.start(sh("yes"))
    key = ("j", 0, 1)
    wait_until(lambda: h.size(key) > MEMORY, WAIT_S, what="output past the buffer")
    h.driver.cut(*key)
    end = h.end()
    assert end.state == "cut" and end.signal in (signal.SIGTERM, signal.SIGKILL)
    wait_until(lambda: h.spooled() == [], WAIT_S, what="the spool file removed")


# --- What an item sees of a real meshd ---------------------------------------------------------


def _run(meshd: Any, spec: dict) -> tuple[dict, bytes]:
    status, rec = meshd.request("POST", "/jobs", spec)
    assert status == 201, rec
    done = meshd.wait_job(rec["id"])
    item = done["items"][0]
    status, out = meshd.request("GET", f"/blobs/{item['stdout']}")
    assert status == 200
    return item, out


def test_items_see_only_their_three_descriptors_and_default_signals(meshd, tmp_path):
    """Spawned with or without a working directory, an item holds only stdin, stdout and
    stderr of meshd's descriptors, and no signal is ignored (Python ignores SIGPIPE and
    SIGXFSZ; Popen's restore_signals gave items the default)."""
    script = "ls /proc/self/fd; grep '^SigIgn' /proc/self/status"
    for cwd in (None, str(tmp_path)):
        item, out = _run(meshd, {"argv": ["/bin/sh", "-c", script], "cwd": cwd})
        assert item["state"] == "done", item
        lines = out.decode().split()
        # sh's own ls reads /proc/self/fd through one more descriptor of its own.
        assert lines[:4] == ["0", "1", "2", "3"] and lines[4] == "SigIgn:", out
        assert int(lines[5], 16) == 0, out


@pytest.mark.parametrize("wall", ["auto", "off"])
def test_items_of_a_meshd_under_nohup_ignore_no_signal(meshd_factory, tmp_path, wall):
    """meshd started with SIGHUP ignored (nohup): its items still start with no signal
    ignored, behind the wall's launcher or spawned directly."""
    from tests.helpers import member_config
    m = meshd_factory(start=False)
    m.config = member_config(str(tmp_path), "m1", f'[items]\nwall = "{wall}"\n')
    m.prefix = ["nohup"]
    m.start()
    item, out = _run(m, {"argv": ["/bin/sh", "-c", "grep '^SigIgn' /proc/self/status"]})
    assert item["state"] == "done", item
    assert int(out.split()[1], 16) == 0, out


# Starts meshd with SIGUSR1 and SIGTERM blocked: the mask survives exec.
_BLOCKING = [sys.executable, "-c", "import os, signal, sys; signal.pthread_sigmask(signal.SIG_BLOCK, "
             "{signal.SIGUSR1, signal.SIGTERM}); os.execvp(sys.argv[1], sys.argv[1:])"]


@pytest.mark.parametrize("wall", ["auto", "off"])
def test_items_of_a_meshd_started_with_signals_blocked_block_none(meshd_factory, tmp_path, wall):
    """meshd started with signals blocked: its items start with an empty mask, behind the
    wall's launcher or spawned directly, and meshd itself still stops on SIGTERM."""
    from tests.helpers import member_config
    m = meshd_factory(start=False)
    m.config = member_config(str(tmp_path), "m1", f'[items]\nwall = "{wall}"\n')
    m.prefix = _BLOCKING
    m.start()
    item, out = _run(m, {"argv": ["/bin/sh", "-c", "grep -E '^Sig(Blk|Ign)' /proc/self/status"]})
    assert item["state"] == "done", item
    words = out.split()
    assert words[0] == b"SigBlk:" and int(words[1], 16) == 0, out
    assert words[2] == b"SigIgn:" and int(words[3], 16) == 0, out
    m.proc.send_signal(signal.SIGTERM)
    assert m.proc.wait(timeout=30) == 0


def test_a_bare_program_name_is_found_on_the_items_path(meshd, tmp_path):
    """argv[0] without a slash is looked up on the PATH of the item's environment (the job's
    env), not meshd's; a name found nowhere fails with the same reason as before."""
    tools = tmp_path / "tools"
    tools.mkdir()
    tool = tools / "meshjobs-pipe-tool"
    tool.write_text("#!/bin/sh\necho tool ran \"$@\"\n")
    tool.chmod(0o755)
    item, out = _run(meshd, {"argv": ["meshjobs-pipe-tool", "a"],
                             "env": {"PATH": f"{tools}:/usr/bin:/bin"}})
    assert item["state"] == "done" and out == b"tool ran a\n", (item, out)
    status, rec = meshd.request("POST", "/jobs", {"argv": ["meshjobs-pipe-tool"]})
    done = meshd.wait_job(rec["id"])
    assert done["items"][0]["state"] == "failed"
    assert "no such program 'meshjobs-pipe-tool'" in done["items"][0]["error"]


def test_many_short_items_through_meshd(meshd):
    """An array of short items (the fast path: posix_spawn, pipes, no spool files), each with
    its own stdin and output, all stored right."""
    n = 200
    status, rec = meshd.request("POST", "/jobs", {
        "argv": ["/bin/sh", "-c", "cat; echo \" $MESH_ITEM_INDEX\" >&2"],
        "items": [f"item-{i}" for i in range(n)]})
    assert status == 201, rec
    done = meshd.wait_job(rec["id"], timeout_s=300)
    assert done["state"] == "done" and len(done["items"]) == n
    for it in done["items"][:: n // 10]:
        status, out = meshd.request("GET", f"/blobs/{it['stdout']}")
        assert out == f"item-{it['index']}".encode()
    spool = os.path.join(meshd.data, "spool")
    wait_until(lambda: os.listdir(spool) == [], WAIT_S, what="no spool file left")


def test_a_relative_program_runs_from_the_items_folder(h: Harness, blobs: LmdbBlobStore,
                                                        tmp_path: Path) -> None:
    """`./tool` is the tool in the job's working directory (the folder changes before the
    exec, as with Popen); a folder that is not there fails with the same reason as before."""
    work = tmp_path / "work"
    work.mkdir()
    (work / "tool").write_text("#!/bin/sh\npwd\n")
    (work / "tool").chmod(0o755)
    h.driver.start(Run("j", 0, 1, ["./tool"], {}, str(work), None, None))
    end = h.end()
    assert end.state == "done" and end.stdout is not None
    assert blobs.get(end.stdout) == f"{work}\n".encode()
    h.driver.start(Run("j", 1, 1, ["./tool"], {}, str(tmp_path / "gone"), None, None))
    end = h.end()
    assert (end.state, end.stdout) == ("failed", None)
    assert end.error is not None and "working directory" in end.error and "gone" in end.error


def test_every_start_runs_however_it_meets_the_drivers_wakeups(h: Harness) -> None:
    """Starts queued while the driver drains its wake-up pipe, then nothing running: each
    burst of starts runs and is reported (the driver is never left asleep with starts queued,
    however they met its wake-ups)."""
    index = 0
    for _ in range(150):
        burst = []
        for _ in range(3):
            h.driver.start(Run("j", index, 1, ["/bin/true"], {}, None, None, None))
            burst.append(index)
            index += 1
        assert sorted(h.end().index for _ in burst) == burst
