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

from blobstore.store import LmdbBlobStore
from meshjobs import datadir, leftovers, limits, wall
from meshjobs.failpoints import Failpoints
from meshjobs.node import Run
from tests.helpers import DriverHarness, Meshd, alive, env_with_path, free_port, wait_until

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

@walled
def test_an_items_first_process_dies_with_its_meshd(meshd_factory, tmp_path):
    """kill -9 of meshd: the item's first process (started by the launcher, which set its
    parent-death signal) dies with it, with no restart of meshd."""
    m = meshd_factory()
    d, argv = _item(tmp_path, "alone")
    job = m.submit(*argv)
    try:
        wait_until(lambda: (d / f"proc.{_epochs(d)[0]}.leader").exists() if _epochs(d) else None,
                   WAIT_S, what="the item's first process")
        pid, start = _proc_file(d, f"proc.{_epochs(d)[0]}.leader")
        assert _runs(pid, start)
        _kill9(m)
        wait_until(lambda: not _runs(pid, start), WAIT_S, what="the item's end with its meshd")
    finally:
        _end_job(job)


def _outlive_and_rerun(m, d: Path, which: str) -> tuple[int, tuple[int, int], str]:
    """Wait for the item's first run, kill -9 its meshd, check that the run's `which` process
    (leader or child) outlived it, start meshd again and wait for the re-run: the first run's
    epoch, that process, and what the re-run saw at its start."""
    wait_until(lambda: _epochs(d) and (d / f"proc.{_epochs(d)[0]}.leader").exists(),
               WAIT_S, what="the item's processes")
    first = _epochs(d)[0]
    proc = _proc_file(d, f"proc.{first}.{which}")
    _kill9(m)
    assert _runs(*proc)  # what the tests are about: it outlives meshd
    m.start()
    wait_until(lambda: len(_epochs(d)) > 1, WAIT_S, what="the item's re-run")
    return first, proc, (d / f"seen.{_epochs(d)[1]}").read_text()


def test_a_restarted_meshd_ends_what_its_item_left_in_its_group_before_any_lease(
        meshd_factory, tmp_path):
    """kill -9 of meshd while an item's first process has a child in its group writing lines
    (no parent-death signal reaches a child): meshd started again on the same data folder ends
    that child before it leases anything (the item's re-run finds it gone), and says so."""
    m = meshd_factory()
    d, argv = _item(tmp_path, "grandchild")
    job = m.submit(*argv)
    try:
        first, child, seen = _outlive_and_rerun(m, d, "child")
        assert f"proc.{first}.child gone" in seen, seen
        assert f"proc.{first}.leader gone" in seen, seen
        ended = [e for e in _log_lines(m, "leftover_ended") if e.get("job") == job]
        assert ended and child[0] in ended[0]["pids"], m.log_tail()
        assert ended[0]["epoch"] == first and ended[0]["index"] == 0
    finally:
        _end_job(job)


def test_an_item_that_takes_its_death_signal_away_is_ended_at_the_next_start(
        meshd_factory, tmp_path):
    """An item whose first process clears its parent-death signal outlives meshd's kill -9; the
    next start ends its group (its leader checked by its start time) before any lease."""
    m = meshd_factory()
    d, argv = _item(tmp_path, "clear")
    job = m.submit(*argv)
    try:
        first, leader, seen = _outlive_and_rerun(m, d, "leader")
        assert f"proc.{first}.leader gone" in seen, seen
        assert not _runs(*leader)
    finally:
        _end_job(job)


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


def test_records_that_do_not_name_the_items_processes_signal_nothing(meshd_factory, tmp_path):
    """Beside the record of a real leftover (ended at the next start), records naming unrelated
    processes spare them: a pid reused (another start time), a group whose leader is gone and
    whose processes do not name the item, a record of another boot or of another data folder
    (a copy), and one whose meshd still runs (kept for it)."""
    m = meshd_factory()
    d, argv = _item(tmp_path, "clear")
    job = m.submit(*argv)
    reused = _canary()
    _sh, member, group, group_start = _leaderless_group()
    others = [reused.pid, member]
    try:
        wait_until(lambda: _epochs(d) and (d / f"proc.{_epochs(d)[0]}.leader").exists(),
                   WAIT_S, what="the item's first process")
        first = _epochs(d)[0]
        leader = _proc_file(d, f"proc.{first}.leader")
        _kill9(m)
        (real,) = _record_files(m.data)
        head = real.read_text().splitlines(keepends=True)[0]
        meshd = tuple(int(x) for x in head.split()[-2:])
        key = (job, 0, first)
        start = _start_of(reused.pid)
        _write_record(m.data, "reused", head, *_item_lines(1, key, reused.pid, start + 1))
        # A group of someone else's, even under the real item's name: its processes do not name it.
        _write_record(m.data, "group", head, *_item_lines(1, key, group, group_start))
        _write_record(m.data, "boot", _head(m.data, meshd, boot="0" * 36),
                      *_item_lines(1, key, reused.pid, start))
        _write_record(m.data, "copy", _head(m.data, meshd, folder=(1, 2)),
                      *_item_lines(1, key, reused.pid, start))
        kept = _write_record(m.data, "meshd-runs", _head(m.data, (member, _start_of(member))),
                             *_item_lines(1, key, reused.pid, start))
        m.start()
        wait_until(lambda: len(_epochs(d)) > 1, WAIT_S, what="the item's re-run")
        seen = (d / f"seen.{_epochs(d)[1]}").read_text()
        assert f"proc.{first}.leader gone" in seen, seen
        assert not _runs(*leader)
        assert alive(reused.pid) and alive(member)
        names = {p.name for p in _record_files(m.data)}
        assert kept.name in names and not {"reused", "group", "boot", "copy", real.name} & names
        dropped = {e["why"].split(":")[0] for e in _log_lines(m, "leftover_record_dropped")}
        assert any("earlier boot" in w for w in dropped) and any("data folder" in w
                                                                 for w in dropped), dropped
        assert _log_lines(m, "leftover_meshd_runs")
    finally:
        _end_job(job)
        for pid in others:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        reused.wait()


def test_hostile_records_are_refused_without_a_signal(meshd_factory, tmp_path):
    """Records meshd did not write as they are (too large, three lines, an unknown field, a pid
    that is no integer, pid 1, garbage, a symbolic link, a FIFO, meshd's parent) are renamed
    NAME.refused, each with an error, and the process they name runs on; a well-formed record
    beside them is acted on (its process ended)."""
    m = meshd_factory(start=False)
    spared, ended = _canary(), _canary()
    try:
        head = _head(m.data, _dead_meshd())
        pid, start = spared.pid, _start_of(spared.pid)
        key = ("j1", 0, 1)
        b, s1 = _item_lines(1, key, pid, start)
        folder = Path(m.data) / leftovers.FOLDER
        hostile = {
            "huge": None,  # past leftover_file_bytes_max (a sparse file)
            "long": head + b + " " * limits.leftover_line_bytes_max + "\n" + s1 + "\n",
            "twice": head + b + "\n" + s1 + "\n" + s1 + "\n",
            "unbegun": head + "s 2 " + str(pid) + " " + str(start) + "\n",
            "order": head + "b 2 worker\n" + b + "\n" + s1 + "\n",
            "ended-twice": head + b + "\ne 1\ne 1\n",
            "field": head + b + " extra\n" + s1 + "\n",
            "header": "meshjobs-running 2" + head[len("meshjobs-running 1"):] + b + "\n",
            "pid1": head + b + "\ns 1 1 0\n",
            "past-max": head + b + f"\ns 1 {2**31} 0\n",
            "parent": head + b + f"\ns 1 {os.getpid()} {_start_of(os.getpid())}\n",
            "garbage": "\x00\xff{not a log\n\n\n",
        }
        for name, text in hostile.items():
            if text is not None:
                (folder / name).write_bytes(text.encode("utf-8", "surrogateescape"))
        with open(folder / "huge", "wb") as f:
            f.write((head + b + "\n" + s1 + "\n").encode())
            f.truncate(limits.leftover_file_bytes_max + 1)
        (folder / "link").symlink_to("/dev/zero")
        os.mkfifo(folder / "fifo")
        _write_record(m.data, "good", head, *_item_lines(1, key, ended.pid, _start_of(ended.pid)))
        m.start()
        wait_until(lambda: ended.poll() is not None, WAIT_S, what="the well-formed record's end")
        assert ended.returncode == -signal.SIGKILL
        assert spared.poll() is None
        names = {p.name for p in _record_files(m.data)}
        refused = {*hostile, "link", "fifo"}
        # What is left: the refused ones, and the log of this run of meshd.
        assert {n for n in names if n.endswith(leftovers.REFUSED)} == {
            n + leftovers.REFUSED for n in refused}, names
        assert not names & {*refused, "good"}, names
        said = {Path(e["record"]).name for e in _log_lines(m, "leftover_record_refused")}
        assert said == refused, said
        m.terminate()
        m.start()  # refused records stay refused, and are not read again
        assert spared.poll() is None
        assert {p.name for p in _record_files(m.data) if p.name.endswith(leftovers.REFUSED)} \
            == {n + leftovers.REFUSED for n in refused}
    finally:
        for p in (spared, ended):
            p.kill()
            p.wait()


def test_a_second_meshd_on_the_same_data_folder_stops_at_start(meshd_factory):
    """One meshd per data folder: a second one started on it exits 2 naming the first, and
    ends none of its items (it would take them for leftovers of its own)."""
    m = meshd_factory()
    second = subprocess.Popen(
        [sys.executable, "-m", "meshjobs.daemon", "--data", m.data, "--name", m.name,
         "--http", "127.0.0.1:0", "--raft", f"127.0.0.1:{free_port()}"],
        cwd=m.data, env=env_with_path(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        start_new_session=True)
    try:
        _out, err = second.communicate(timeout=WAIT_S)
    finally:
        if second.poll() is None:
            second.kill()
            second.wait()
    assert second.returncode == 2, err
    assert f"another meshd (pid {m.pid}) runs on the data folder" in err.decode(), err


@walled
def test_a_python_worker_dies_with_its_meshd(tmp_path):
    """kill -9 of a member with a python pool: the worker running a long function dies with it
    (pyworker.main sets its parent-death signal)."""
    cfg = tmp_path / "meshd.toml"
    cfg.write_text('name = "m1"\n[pools.py]\nkind = "python"\nslots = 1\n'
                   '[pools.default]\nslots = 1\n')
    funcs = tmp_path / "funcs"
    funcs.mkdir()
    pidfile = funcs / "worker.pid"  # not beside the data folder: items may not write there
    (funcs / "longfuncs.py").write_text(textwrap.dedent(f'''
        import os, time
        def forever(data):
            with open({str(pidfile)!r} + ".tmp", "w") as f:
                f.write(str(os.getpid()))
            os.replace({str(pidfile)!r} + ".tmp", {str(pidfile)!r})
            while True:
                time.sleep(0.1)
    '''))
    m = Meshd(str(tmp_path / "m1"), config=str(cfg))
    try:
        m.start()
        status, rec = m.request("POST", "/jobs", {"pool": "py", "argv": ["longfuncs:forever"],
                                                  "cwd": str(funcs), "items": ["x"]})
        assert status in (200, 201), rec
        worker = int(wait_until(lambda: pidfile.exists() and pidfile.read_text(), WAIT_S,
                                what="the worker's pid"))
        start = _start_of(worker)
        _kill9(m)
        wait_until(lambda: not _runs(worker, start), WAIT_S, what="the worker's end")
    finally:
        m.stop()


# --- The record and the sweep in this process ------------------------------------------------------

@pytest.fixture
def blobs(tmp_path: Path):
    store = LmdbBlobStore(str(tmp_path / "blobs"))
    yield store
    store.close()


def test_the_driver_records_a_process_while_it_runs(tmp_path, blobs):
    """Rule 1: while an item runs its log names its job, index, epoch, pid (its group) and
    start time; once it ended, its end. A line that cannot be written before the start fails
    the item before anything starts, saying why."""
    # Hits of running.write: the header, then b, s and e of the first item; the next b fails.
    record = leftovers.Record(str(tmp_path / "data"), Failpoints("running.write=5"))
    h = DriverHarness(tmp_path, blobs, record=record)

    def running() -> list[leftovers.Leftover]:
        got = leftovers.parse("r", Path(record.path).read_bytes().splitlines(keepends=True),
                              1 << 22, set())
        assert got is not None
        return got[1]

    try:
        gate = tmp_path / "gate"
        h.driver.start(Run("j1", 3, 7, ["sh", "-c", f"while [ ! -e {gate} ]; do sleep 0.05; "
                                       "done"], {}, None, None, None))
        (rec,) = wait_until(lambda: [e for e in running() if e.pgid is not None], WAIT_S,
                            what="the item's pid in the log")
        assert rec.key == ("j1", 3, 7) and rec.kind == "item"
        assert rec.pgid is not None and _runs(rec.pgid, rec.start or 0)
        gate.write_text("go")
        assert h.end().state == "done"
        assert running() == []
        h.driver.start(Run("j1", 4, 7, ["true"], {}, None, None, None))
        end = h.end()
        assert end.state == "failed" and end.stdout is None
        assert "could not record the item's process in the data folder" in (end.error or "")
        assert running() == []
    finally:
        h.close()


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
