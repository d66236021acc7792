"""The python pool: real worker processes driven by the real driver, a real LMDB blob store, and
one real meshd with a python pool."""

from __future__ import annotations

import signal
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from blobstore import BlobWriters
from blobstore.store import LmdbBlobStore
from meshjobs import limits
from meshjobs.config import ConfigError, load_config
from meshjobs.node import ItemEnded, Run
from tests.helpers import DriverHarness, Meshd, alive, wait_until

WAIT_S = 30  # the longest a test waits for anything

# The functions the items call, written into each test's own folder (the job's cwd), so a test
# also checks that the job's cwd is where its target is imported from.
FUNCS = '''
import os, sys, time

def echo(data):
    return data

def upper(data):
    return data.decode().upper()

def nothing(data):
    return None

def number(data):
    return 42

def environ(data):
    keys = ("MESH_JOB_ID", "MESH_ITEM_INDEX", "MESH_LEASE_EPOCH", "COLOUR")
    return " ".join(f"{k}={os.environ.get(k)}" for k in keys) + f" cwd={os.getcwd()}"

def boom(data):
    raise ValueError("boom " + data.decode())

def exit3(data):
    os._exit(3)

def kill9(data):
    os.kill(os.getpid(), 9)

def pid(data):
    return str(os.getpid())

def sleepy(data):
    with open(data.decode(), "w") as f:
        f.write(str(os.getpid()))
    time.sleep(30)
    return b"woke"

def chatty(data):
    print("hello from print")
    print("to stderr", file=sys.stderr)
    os.write(1, b"raw bytes on fd 1\\n")
    return b"out:" + data

def withargs(data, args):
    return ",".join(args)

def huge(data):
    return b"x" * int(data)
'''


def _item(target: str, index: int = 0, job_id: str = "j1", epoch: int = 1,
          env: dict[str, str] | None = None, cwd: str | None = None, stdin: str | None = None,
          runtime_s: float | None = None, args: tuple[str, ...] = ()) -> Run:
    return Run(job_id, index, epoch, [target, *args], env or {}, cwd, stdin, runtime_s,
                   "python")


class Harness(DriverHarness):
    """The driver harness with the test's Python functions in a folder of their own."""

    def __init__(self, tmp_path: Path, blobs: LmdbBlobStore, workers: int = 2,
                 writers: BlobWriters | None = None) -> None:
        self.dir = tmp_path / "funcs"
        self.dir.mkdir()
        (self.dir / "pyfuncs.py").write_text(FUNCS)
        super().__init__(tmp_path, blobs, python_workers=workers, writers=writers)

    def call(self, func: str, data: bytes = b"", **kw: object) -> ItemEnded:
        self.start(func, data, **kw)
        return self.end()

    def start(self, func: str, data: bytes = b"", **kw: object) -> None:
        stdin = self.blobs.put(data) if data else None
        kw.setdefault("cwd", str(self.dir))
        self.driver.start(_item(f"pyfuncs:{func}", stdin=stdin, **kw))  # type: ignore[arg-type]


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


# --- Results ----------------------------------------------------------------------------------


def test_bytes_str_and_none_results(h: Harness) -> None:
    """Rule 1: bytes are the output as they are, str is encoded UTF-8, None is empty output;
    the stdin payload is the function's argument."""
    end = h.call("echo", b"\x00payload\xff")
    assert (end.state, end.rc, end.signal, end.error) == ("done", 0, None, None)
    assert h.out(end) == b"\x00payload\xff"
    assert h.err(end) == ""
    end = h.call("upper", "grüße".encode())
    assert end.state == "done" and h.out(end) == "GRÜSSE".encode()
    end = h.call("nothing", b"ignored")
    assert end.state == "done" and h.out(end) == b""
    end = h.call("echo")  # no stdin: an empty payload
    assert end.state == "done" and h.out(end) == b""
    assert 0 < end.started_ms <= end.ended_ms


def test_other_return_types_fail(h: Harness) -> None:
    """Rule 1: a result that is not bytes, str or None fails the item and says what it was."""
    end = h.call("number")
    assert (end.state, end.rc) == ("failed", 1)
    assert "returned int" in h.err(end)


def test_extra_argv_is_passed_as_args(h: Harness) -> None:
    """Rule 1: argv after the target arrives as the keyword `args`."""
    end = h.call("withargs", args=("a", "b c"))
    assert end.state == "done" and h.out(end) == b"a,b c"


def test_env_and_cwd_during_the_call_only(h: Harness, tmp_path: Path) -> None:
    """Rule 2: the job's env and MESH_* are set for the call and removed after it; the cwd is
    the job's."""
    end = h.call("environ", job_id="jobx", index=7, epoch=3, env={"COLOUR": "teal"})
    assert end.state == "done"
    assert h.out(end).decode() == (f"MESH_JOB_ID=jobx MESH_ITEM_INDEX=7 MESH_LEASE_EPOCH=3 "
                                   f"COLOUR=teal cwd={h.dir}")
    other = tmp_path / "elsewhere"
    other.mkdir()
    (other / "pyfuncs.py").write_text(FUNCS)  # for a worker that has not imported it yet
    ends = []
    for i in range(4):  # enough calls that both workers serve one
        ends.append(h.call("environ", index=i, cwd=str(other)))
    for i, end in enumerate(ends):
        assert h.out(end).decode() == (f"MESH_JOB_ID=j1 MESH_ITEM_INDEX={i} MESH_LEASE_EPOCH=1 "
                                       f"COLOUR=None cwd={other}")


def test_bad_cwd_fails_with_a_message(h: Harness, tmp_path: Path) -> None:
    """A cwd that does not exist fails the item, naming the folder."""
    end = h.call("echo", cwd=str(tmp_path / "missing"))
    assert end.state == "failed"
    assert "missing" in h.err(end) and "working directory" in h.err(end)


# --- Failures ---------------------------------------------------------------------------------


def test_exception_fails_with_its_traceback(h: Harness) -> None:
    """An exception fails the item (rc 1) with the traceback, starting in the job's code."""
    end = h.call("boom", b"now")
    assert (end.state, end.rc, end.signal) == ("failed", 1, None)
    err = h.err(end)
    assert "Traceback" in err and "in boom" in err and "ValueError: boom now" in err
    assert "pyworker" not in err
    assert end.error == "raised ValueError: boom now"  # the record's words, not `exit 1`
    assert h.call("echo", b"next").state == "done"


def test_unknown_module_and_function_are_named(h: Harness) -> None:
    """A target that cannot be imported or found fails with a message naming it."""
    h.driver.start(_item("no_such_module_xyz:run", cwd=str(h.dir)))
    end = h.end()
    assert end.state == "failed" and "no_such_module_xyz" in h.err(end)
    end = h.call("no_such_function")
    assert end.state == "failed"
    assert "no_such_function" in h.err(end) and "pyfuncs" in h.err(end)
    h.driver.start(_item("pyfuncs", cwd=str(h.dir)))
    end = h.end()
    assert end.state == "failed" and "module:function" in h.err(end)


@pytest.mark.parametrize("func, rc, sig", [("exit3", None, None), ("kill9", None, 9)])
def test_a_worker_that_dies_fails_its_item_and_is_replaced(
        tmp_path: Path, blobs: LmdbBlobStore, func: str, rc: object, sig: object) -> None:
    """A worker dying during a call fails that item (rc None, the signal if any) and a new
    worker takes the next items."""
    h = Harness(tmp_path, blobs, workers=1)
    try:
        first = int(h.out(h.call("pid", index=0)))
        end = h.call(func, index=1)
        assert (end.state, end.rc, end.signal) == ("failed", rc, sig)
        assert ("status 3" if func == "exit3" else "signal 9") in h.err(end)
        wait_until(lambda: not alive(first), WAIT_S, what="the worker's death")
        second = int(h.out(h.call("pid", index=2)))
        assert second != first
        assert h.call("echo", b"works", index=3).state == "done"
    finally:
        h.close()


def test_runtime_limit_kills_the_worker(h: Harness, tmp_path: Path) -> None:
    """runtime_s: past it the worker is killed, the item ends "timeout", and the next item
    works."""
    marker = tmp_path / "started"
    h.start("sleepy", str(marker).encode(), runtime_s=0.5)
    end = h.end()
    assert end.state == "timeout" and end.signal == signal.SIGKILL
    pid = int(marker.read_text())
    wait_until(lambda: not alive(pid), WAIT_S, what="the worker's death")
    assert h.call("echo", b"again").state == "done"


def test_cut_kills_the_worker(h: Harness, tmp_path: Path) -> None:
    """cut: the worker running the item is killed, the item ends "cut", a new worker serves."""
    marker = tmp_path / "started"
    h.start("sleepy", str(marker).encode(), index=5)
    wait_until(lambda: marker.exists() and marker.read_text(), WAIT_S, what="the call's start")
    h.driver.cut("j1", 5, 1)
    end = h.end()
    assert (end.state, end.index) == ("cut", 5)
    assert not alive(int(marker.read_text()))
    assert h.call("echo", b"again", index=6).state == "done"


def test_cut_of_a_waiting_item(tmp_path: Path, blobs: LmdbBlobStore) -> None:
    """An item waiting for a busy worker is cut without a call (no outputs)."""
    h = Harness(tmp_path, blobs, workers=1)
    try:
        marker = tmp_path / "started"
        h.start("sleepy", str(marker).encode(), index=0)
        h.start("echo", b"never", index=1)
        wait_until(lambda: marker.exists(), WAIT_S, what="the first call's start")
        h.driver.cut("j1", 1, 1)
        end = h.end()
        assert (end.index, end.state, end.stdout, end.stderr) == (1, "cut", None, None)
        h.driver.cut("j1", 0, 1)
        assert (h.end().index, "cut") == (0, "cut")
    finally:
        h.close()


def test_workers_that_cannot_start(tmp_path: Path, blobs: LmdbBlobStore,
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Rule 3 of the pool: workers that die before they are ready fail the waiting items with
    a message; once python starts again, a worker is back after py_worker_respawn_ms."""
    monkeypatch.setenv("PYTHONHOME", str(tmp_path / "no-python-here"))
    h = Harness(tmp_path, blobs, workers=1)
    try:
        h.start("echo", b"x", index=0)
        end = h.end()
        assert (end.state, end.stdout) == ("failed", None)
        assert end.error is not None and "do not start" in end.error
        monkeypatch.delenv("PYTHONHOME")
        deadline = time.monotonic() + WAIT_S
        while True:
            end = h.call("echo", b"back", index=1)
            if end.state == "done" or time.monotonic() > deadline:
                break
        assert end.state == "done" and h.out(end) == b"back"
    finally:
        h.close()


def test_prints_do_not_break_the_protocol(h: Harness) -> None:
    """Rule 3: print() to stdout or stderr goes to the item's stderr; a raw write on fd 1 goes
    to the worker's log; the output is still the return value, and the next call works."""
    for i in range(3):
        end = h.call("chatty", b"x", index=i)
        assert end.state == "done" and h.out(end) == b"out:x"
        assert h.err(end) == "hello from print\nto stderr\n"


def test_oversize_result_fails_with_a_message(h: Harness) -> None:
    """Rule 5: a result over py_result_bytes_max fails the item and names the limit."""
    end = h.call("huge", str(limits.py_result_bytes_max + 1).encode())
    assert end.state == "failed"
    assert "py_result_bytes_max" in h.err(end)
    assert h.call("echo", b"fine").state == "done"


def test_missing_stdin_blob_fails_without_a_call(h: Harness) -> None:
    """A stdin blob not on the member fails the item and says so (no outputs)."""
    h.driver.start(_item("pyfuncs:echo", cwd=str(h.dir), stdin="ab" * 32))
    end = h.end()
    assert (end.state, end.stdout) == ("failed", None)
    assert end.error is not None and "not on this member" in end.error


def test_stop_kills_every_worker(tmp_path: Path, blobs: LmdbBlobStore) -> None:
    """driver.stop() kills the workers, busy or idle, and reaps them."""
    h = Harness(tmp_path, blobs, workers=2)
    marker = tmp_path / "started"
    idle = int(h.out(h.call("pid")))
    h.start("sleepy", str(marker).encode(), index=1)
    wait_until(lambda: marker.exists() and marker.read_text(), WAIT_S, what="the call's start")
    busy = int(marker.read_text())
    h.close()
    assert not alive(idle) and not alive(busy)


def test_many_items_end_exactly_once(tmp_path: Path, blobs: LmdbBlobStore) -> None:
    """500 no-op items through 2 workers, outputs through the blob writers: every item ends
    once, done, with its own output."""
    writers = BlobWriters(blobs, 64 << 20)
    threads = [threading.Thread(target=body, daemon=True) for _, body in writers.targets()]
    for t in threads:
        t.start()
    h = Harness(tmp_path, blobs, workers=2, writers=writers)
    try:
        n = 500
        for i in range(n):
            h.driver.start(_item("bench.noop:run", index=i))
        for i in range(5):
            h.start("echo", f"item {i}".encode(), job_id="echoes", index=i)
        seen: dict[tuple[str, int], ItemEnded] = {}
        for _ in range(n + 5):
            end = h.end()
            key = (end.job_id, end.index)
            assert key not in seen, f"{key} ended twice"
            seen[key] = end
        assert all(e.state == "done" for e in seen.values())
        assert len(seen) == n + 5
        for i in range(5):
            assert h.out(seen[("echoes", i)]) == f"item {i}".encode()
        # A second end of any of them would come before the ends of items started after them
        # on the same workers: one more item per worker, each ending once and last.
        for i in range(2):
            h.start("echo", b"last", job_id="last", index=i)
        last = {(e.job_id, e.index) for e in (h.end(), h.end())}
        assert last == {("last", 0), ("last", 1)}
        assert h.ends.empty()
        assert h.driver.running() == set()
    finally:
        h.close()
        writers.close()


# --- Configuration ----------------------------------------------------------------------------


def test_config_takes_python_pools_and_refuses_bad_kinds(tmp_path: Path) -> None:
    """[pools.py] kind = "python" loads; an unknown kind and too many workers are refused."""
    cfg = tmp_path / "meshd.toml"
    cfg.write_text('name = "m1"\n[pools.py]\nkind = "python"\nslots = 2\n[pools.default]\n')
    pools = load_config(str(cfg)).pools
    assert (pools["py"].kind, pools["py"].slots) == ("python", 2)
    assert pools["default"].kind == "command"
    cfg.write_text('name = "m1"\n[pools.py]\nkind = "perl"\n')
    with pytest.raises(ConfigError, match="kind"):
        load_config(str(cfg))
    cfg.write_text(f'name = "m1"\n[pools.py]\nkind = "python"\n'
                   f'slots = {limits.py_workers_max + 1}\n')
    with pytest.raises(ConfigError, match="py_workers_max"):
        load_config(str(cfg))


# --- A real member ----------------------------------------------------------------------------


@pytest.mark.fleet
def test_member_runs_a_python_job(tmp_path: Path) -> None:
    """A member with a python pool runs POST /jobs {"pool": "py", "argv": ["bench.noop:run"]}
    to done, and a job of its own function with the outputs of each item."""
    cfg = tmp_path / "meshd.toml"
    cfg.write_text('name = "m1"\n[pools.py]\nkind = "python"\nslots = 2\n'
                   '[pools.default]\nslots = 1\n')
    funcs = tmp_path / "funcs"
    funcs.mkdir()
    (funcs / "memberfuncs.py").write_text(textwrap.dedent('''
        import os
        def shout(data):
            return data.upper() + b" " + os.environ["MESH_ITEM_INDEX"].encode()
    '''))
    m = Meshd(str(tmp_path / "m1"), config=str(cfg))
    try:
        m.start()
        status, rec = m.request("POST", "/jobs", {"pool": "py", "argv": ["bench.noop:run"],
                                                  "items": [f"item {i}" for i in range(20)]})
        assert status in (200, 201), rec
        done = m.wait_job(rec["id"])
        assert done["state"] == "done", done
        assert len(done["items"]) == 20
        assert all(it["state"] == "done" and it["rc"] == 0 for it in done["items"])
        status, body = m.request("GET", f"/blobs/{done['items'][0]['stdout']}")
        assert status == 200 and body in (b"", "")
        status, rec = m.request("POST", "/jobs", {"pool": "py", "argv": ["memberfuncs:shout"],
                                                  "cwd": str(funcs), "items": ["a", "b", "c"]})
        assert status in (200, 201), rec
        done = m.wait_job(rec["id"])
        assert done["state"] == "done", done
        outs = []
        for it in done["items"]:
            status, body = m.request("GET", f"/blobs/{it['stdout']}")
            assert status == 200
            outs.append(body if isinstance(body, bytes) else body.encode())
        assert outs == [b"A 0", b"B 1", b"C 2"]
    finally:
        m.stop()
