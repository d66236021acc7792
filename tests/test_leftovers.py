"""Items do not outlive a killed meshd (meshjobs/leftovers.py; the launcher's parent-death signal,
meshjobs/wall.py; python workers, meshjobs/pyworker.py Rule 6).

Real meshd processes are killed with SIGKILL while an item runs (a python program that writes a
line every 0.1 s): its first process dies with meshd where the launcher starts it; what it
started in its group, and a first process that took its parent-death signal away, are ended by
the next start of meshd on the same data folder before it leases anything (the item's own re-run,
under a new epoch, looks for them as its first act). Records that do not name the item's
processes (a pid reused, a group that is another's, another boot, a copy of the data folder)
and hostile ones are refused without a signal: unrelated processes named in them run on.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from meshjobs import datadir, leftovers, limits, wall
from tests.helpers import Meshd, env_with_path, wait_until

pytestmark = pytest.mark.fleet

WAIT_S = 60  # the longest a test waits for anything (a loaded machine)
walled = pytest.mark.skipif(wall.landlock_abi() == 0,
                            reason="the parent-death signal is set by the wall's launcher")

# The item: `python item.py DIR MODE`. Every run first says what it finds of the processes of
# the runs before it (seen.EPOCH), then records its own (proc.EPOCH.leader, .child) and writes
# a line to DIR/lines every 0.1 s until killed. MODE "alone": nothing more; "grandchild": its
# first process starts a writer of its own in its group (no parent-death signal reaches it);
# "clear": it takes its parent-death signal away (the first process outlives meshd).
ITEM = textwrap.dedent(r'''
    import ctypes, os, subprocess, sys, time
    d, mode = sys.argv[1], sys.argv[2]

    def fields(pid):
        try:
            with open(f"/proc/{pid}/stat") as f:
                s = f.read()
        except OSError:
            return None
        return s[s.rfind(")") + 2:].split()

    def put(name, text):
        tmp = os.path.join(d, name + ".tmp")
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, os.path.join(d, name))

    def write_lines():
        while True:
            with open(os.path.join(d, "lines"), "a") as f:
                f.write(f"{os.getpid()}\n")
            time.sleep(0.1)

    if mode == "writer":
        write_lines()
    epoch = os.environ["MESH_LEASE_EPOCH"]
    seen = []
    for name in sorted(os.listdir(d)):
        if name.startswith("proc.") and not name.endswith(".tmp"):
            with open(os.path.join(d, name)) as f:
                pid, start = f.read().split()
            st = fields(int(pid))
            up = st is not None and st[0] not in ("Z", "X") and st[19] == start
            seen.append(f"{name} {'alive' if up else 'gone'}\n")
    put(f"seen.{epoch}", "".join(seen))
    if mode == "clear":
        ctypes.CDLL(None).prctl(1, 0, 0, 0, 0)  # PR_SET_PDEATHSIG: none
    if mode == "grandchild":
        child = subprocess.Popen([sys.executable, sys.argv[0], d, "writer"])
        put(f"proc.{epoch}.child", f"{child.pid} {fields(child.pid)[19]}")
    put(f"proc.{epoch}.leader", f"{os.getpid()} {fields(os.getpid())[19]}")
    write_lines()
''')


# --- Helpers --------------------------------------------------------------------------------------

def _start_of(pid: int) -> int:
    p = leftovers.proc(pid)
    assert p is not None, pid
    return p.start


def _runs(p: int, start: int) -> bool:
    """Whether the process `p` that started at `start` runs (not a zombie, not a reused pid)."""
    now = leftovers.proc(p)
    return now is not None and now.start == start and now.state not in ("Z", "X")


def _proc_file(d: Path, name: str) -> tuple[int, int]:
    pid, start = (d / name).read_text().split()
    return int(pid), int(start)


def _kill9(m: Meshd) -> None:
    """SIGKILL meshd alone (Meshd.kill9 would end its items too, which is what is tested)."""
    assert m.proc is not None
    os.kill(m.proc.pid, signal.SIGKILL)
    m.proc.wait(WAIT_S)


def _end_job(job: str) -> None:
    """Kill whatever still runs of `job` (its processes name it in their environment)."""
    want = f"MESH_JOB_ID={job}".encode()
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        with contextlib.suppress(OSError):
            with open(f"/proc/{name}/environ", "rb") as f:
                if want in f.read().split(b"\0"):
                    os.kill(int(name), signal.SIGKILL)


def _log_lines(m: Meshd, event: str) -> list[dict]:
    out = []
    for line in m.log_tail(1 << 22).splitlines():
        if f'"{event}"' in line:
            with contextlib.suppress(ValueError):
                out.append(json.loads(line[line.index("{"):]))
    return out


def _item(tmp_path: Path, mode: str) -> tuple[Path, list[str]]:
    script = tmp_path / "item.py"
    script.write_text(ITEM)
    d = tmp_path / "runs"
    d.mkdir()
    return d, ["--cwd", str(tmp_path), "--", sys.executable, str(script), str(d), mode]


def _epochs(d: Path) -> list[int]:
    return sorted({int(n.split(".")[1]) for n in os.listdir(d) if n.startswith("seen.")})


def _canary(**kw) -> subprocess.Popen:
    """An unrelated process in a session of its own (as an item's first process is)."""
    return subprocess.Popen(["sleep", "300"], start_new_session=True, **kw)


def _record_files(data: str) -> list[Path]:
    folder = Path(data) / leftovers.FOLDER
    return sorted(p for p in folder.iterdir()) if folder.exists() else []


# --- Items die with meshd, or at its next start -------------------------------------------------

def _head(data: str, meshd: tuple[int, int], boot: str | None = None,
          folder: tuple[int, int] | None = None) -> str:
    """The header meshd would write at the top of a log in `data` (meshjobs/leftovers.py)."""
    where = Path(data) / leftovers.FOLDER
    where.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = where.stat()
    boot = boot or Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    dev, ino = folder or (st.st_dev, st.st_ino)
    ns = os.stat("/proc/self/ns/pid").st_ino
    return f"meshjobs-running 1 {boot} {ns} {dev} {ino} {meshd[0]} {meshd[1]}\n"


def _write_record(data: str, name: str, head: str, *lines: str) -> Path:
    path = Path(data) / leftovers.FOLDER / name
    path.write_text(head + "".join(line + "\n" for line in lines))
    return path


def _item_lines(seq: int, key: tuple[str, int, int], pgid: int | None = None,
                start: int | None = None) -> list[str]:
    out = [f"b {seq} item {key[0]} {key[1]} {key[2]}"]
    if pgid is not None:
        out.append(f"s {seq} {pgid} {start}")
    return out


def _dead_meshd() -> tuple[int, int]:
    """The pid and start time of a process that ran and is gone (the meshd of a record)."""
    p = subprocess.Popen(["sleep", "300"])
    try:
        return p.pid, _start_of(p.pid)
    finally:
        p.kill()
        p.wait()


def _leaderless_group() -> tuple[subprocess.Popen, int, int, int]:
    """A group of someone else's whose leader is gone: (its process, its pid, the group id,
    the leader's start time)."""
    sh = subprocess.Popen(["sh", "-c", "sleep 300 & echo $!; read x"], stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, start_new_session=True)
    assert sh.stdout is not None and sh.stdin is not None
    member = int(sh.stdout.readline())
    leader_start = _start_of(sh.pid)
    sh.stdin.close()
    sh.wait()
    return sh, member, sh.pid, leader_start


# --- The record and the sweep in this process ------------------------------------------------------

def _sweep(data: str) -> leftovers.Swept:
    return leftovers.sweep(data, wait_ms=WAIT_S * 1000)


def test_a_record_without_its_pid_ends_the_processes_that_name_its_item(tmp_path):
    """Rule 4: a record whose meshd died between the item's start and its pid (one line) ends
    the processes started since that meshd whose environment names the item, and spares one
    that names another epoch."""
    data = str(tmp_path / "data")
    job = f"leftover-{os.urandom(6).hex()}"  # no other test's process names it
    head = _head(data, _dead_meshd())
    env = {"PATH": os.environ["PATH"], "MESH_JOB_ID": job, "MESH_ITEM_INDEX": "2"}
    ours = _canary(env={**env, "MESH_LEASE_EPOCH": "11"})
    theirs = _canary(env={**env, "MESH_LEASE_EPOCH": "12"})
    try:
        _write_record(data, "half", head, f"b 1 item {job} 2 11")
        swept = _sweep(data)
        assert swept.ended == {"half:1": [ours.pid]}
        assert ours.wait(WAIT_S) == -signal.SIGKILL and theirs.poll() is None
        assert _record_files(data) == []
    finally:
        for p in (ours, theirs):
            p.kill()
            p.wait()


def test_a_record_of_a_live_group_ends_all_of_it(tmp_path):
    """Rule 4: with its leader checked, every process of the group is the item's (killpg), even
    one whose environment says nothing of the item."""
    data = str(tmp_path / "data")
    sh = subprocess.Popen(["sh", "-c", "sleep 300 & echo $!; wait"], stdout=subprocess.PIPE,
                          start_new_session=True)
    assert sh.stdout is not None
    child = int(sh.stdout.readline())
    child_start = _start_of(child)
    try:
        _write_record(data, "live", _head(data, _dead_meshd()), "b 1 worker", "b 2 worker",
                      f"s 2 {sh.pid} {_start_of(sh.pid)}", "e 1")
        swept = _sweep(data)
        assert list(swept.ended) == ["live:2"]
        assert sorted(swept.ended["live:2"]) == sorted([sh.pid, child])
        assert sh.wait(WAIT_S) == -signal.SIGKILL
        wait_until(lambda: not _runs(child, child_start), WAIT_S, what="the child's end")
    finally:
        sh.kill()
        sh.wait()
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signal.SIGKILL)


HEAD = "meshjobs-running 1 b00t 4026531836 2049 77 100 5\n"


@pytest.mark.parametrize("text,why", [
    ("meshjobs-running 2 b00t 1 2 3 100 5\n", "header"),
    ("meshjobs-running 1 b00t 1 2 3 1 5\n", "meshd's pid"),
    (HEAD + "b 1 item j1 0 1\ns 1 0 9\n", "pgid 0"),
    (HEAD + "b 1 item j1 0 1\ns 1 4194305 9\n", "pgid 4194305"),
    (HEAD + "b 1 item j1 0 1\ns 1 77 9\n", "meshd's own"),
    (HEAD + "b 1 item j1 0 1\ns 1 100 9\n", "meshd's own"),
    (HEAD + "b 1 item j1 0 1\ns 1 5000 -1\n", "line 3 is not"),
    (HEAD + "b 1 item ../x 0 1\n", "line 2 is not"),
    (HEAD + "b 1 item j1 -1 1\n", "line 2 is not"),
    (HEAD + "b 1 item j1 0 1\nb 1 worker\n", "b 1 after b 1"),
    (HEAD + "s 1 5000 9\n", "s 1 of no b 1"),
    (HEAD + "b 1 worker\ns 1 5000 9\ns 1 5000 9\n", "or twice"),
    (HEAD + "b 1 worker\ne 1\ne 1\n", "e 1 of no b 1"),
    (HEAD + "b 1 worker \n", "line 2 is not"),
    (HEAD + "\n", "line 2 is not"),
])
def test_parse_refuses_what_meshd_does_not_write(text, why):
    """Rule 6, line by line: each malformed log is RecordRefused, saying what is wrong."""
    lines = text.encode().splitlines(keepends=True)
    with pytest.raises(leftovers.RecordRefused, match=why):
        leftovers.parse("r", lines, 4_194_304, {77})


def test_parse_takes_what_meshd_writes():
    """What a log names as running: each b without its e, with its s when it has one; a last
    line cut short is no line, and a log without a whole header names nothing."""
    text = (HEAD + "b 1 item j1 0 1\ns 1 5000 9\nb 2 worker\nb 3 item j.2 4 8\ns 3 6000 10\n"
            "e 3\nb 5 worker\ns 5 7000 1")
    got = leftovers.parse("r", text.encode().splitlines(keepends=True), 4_194_304, set())
    assert got is not None
    head, entries = got
    assert head == leftovers.Head("b00t", 4026531836, (2049, 77), (100, 5))
    assert [(e.seq, e.kind, e.key, e.pgid, e.start) for e in entries] == [
        (1, "item", ("j1", 0, 1), 5000, 9), (2, "worker", None, None, None),
        (5, "worker", None, None, None)]
    assert leftovers.parse("r", [HEAD.encode()[:-1]], 4_194_304, set()) is None
    assert leftovers.parse("r", [], 4_194_304, set()) is None


def test_the_log_starts_anew_and_a_clean_stop_removes_it(tmp_path, monkeypatch):
    """Rule 3: a log past leftover_log_bytes_max, twice what still runs, is written anew with
    what still runs (the old one removed); closed with nothing running, it goes."""
    monkeypatch.setattr(limits, "leftover_log_bytes_max", 4096)
    record = leftovers.Record(str(tmp_path / "data"))
    child = _canary()
    try:
        me = child.pid  # a child of this process, as the driver's are
        keep = record.begin("item", ("j1", 0, 1))
        record.started(keep, me)
        first = record.path
        for _ in range(200):
            seq = record.begin("worker", None)
            record.started(seq, me)
            record.forget(seq)
        assert record.path != first and not os.path.exists(first)
        assert len(os.listdir(record.folder)) == 1
        lines = Path(record.path).read_bytes().splitlines(keepends=True)
        got = leftovers.parse("r", lines, 1 << 22, set())
        assert got is not None and [(e.seq, e.pgid) for e in got[1]] == [(keep, me)]
        assert os.path.getsize(record.path) < 4096
        record.forget(keep)
        record.close()
        assert os.listdir(record.folder) == []
    finally:
        child.kill()
        child.wait()


def test_the_data_folder_lock_names_its_holder(tmp_path):
    """datadir.lock: a second lock of the same folder (another process) is refused naming the
    pid that holds it; the holder's death frees it."""
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from meshjobs import datadir; "
         f"datadir.lock({str(tmp_path)!r}); print('held', flush=True); time.sleep(300)"],
        stdout=subprocess.PIPE, env=env_with_path())
    try:
        assert holder.stdout is not None and holder.stdout.readline() == b"held\n"
        with pytest.raises(datadir.DataFolderError, match=f"another meshd \\(pid {holder.pid}\\)"):
            datadir.lock(str(tmp_path))
    finally:
        holder.kill()
        holder.wait()
    fd = datadir.lock(str(tmp_path))
    os.close(fd)
