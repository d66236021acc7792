"""The systems the benchmark compares: meshjobs (`mesh.py`) and its peers Huey, Celery and RQ
(one module each), all behind the same small interface, `System`.

Rules: every process a system starts is registered with a `Procs` and stopped by its pid (its
process group, which it leads) when the system stops, also after an error; a figure a system
cannot give raises `NotAvailable`, whose message becomes the table cell.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class NotAvailable(Exception):
    """This system cannot give this figure; str(e) is what the table shows instead."""


class Procs:
    """Processes started by the benchmark, each the leader of its own process group, so that
    stopping one by its pid also stops what it forked (work horses, pool children, items)."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []

    def start(self, args: list[str], log_path: str, env: dict[str, str] | None = None,
              cwd: str | None = None) -> subprocess.Popen:
        full_env = dict(os.environ)
        full_env["PYTHONPATH"] = ROOT + os.pathsep + full_env.get("PYTHONPATH", "")
        full_env.update(env or {})
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=full_env,
                                    cwd=cwd or ROOT, start_new_session=True)
        self.procs.append(proc)
        return proc

    def stop(self, proc: subprocess.Popen, timeout_s: float = 15.0) -> None:
        """SIGTERM the process group `proc` leads, SIGKILL it if it lingers."""
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                pass
        # The leader may be gone while its children (a work horse, a pool child) linger.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(5)
        if proc in self.procs:
            self.procs.remove(proc)

    def kill9(self, proc: subprocess.Popen) -> None:
        """kill -9 the process alone (not its group): a crash of that one process."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)

    def stop_all(self) -> None:
        for proc in list(reversed(self.procs)):
            self.stop(proc)


def wait_until(pred: Any, timeout_s: float, what: str, every_s: float = 0.005) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        got = pred()
        if got:
            return got
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not reached within {timeout_s} s")
        time.sleep(every_s)


class System:
    """One system under test. Counts and durations are the workload's; times in seconds."""

    name = "?"

    def start(self) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def reset(self) -> None:
        """Between workloads: drop what earlier rounds left behind."""

    def run_items(self, kind: str, n: int) -> float:
        """Seconds from the first enqueue to all `n` items of `kind` ("true" or "noop") done."""
        raise NotImplementedError

    def submit_rate(self, threads: int, seconds: float) -> float:
        """Single submits (enqueues) per second from `threads` concurrent clients; the work
        submitted is not run (held, or sent to a queue no worker reads)."""
        raise NotImplementedError

    def big_submit(self, n: int) -> float:
        """Seconds from sending an array of `n` items to its acknowledgement."""
        raise NotAvailable("n/a")

    def latency(self, n: int) -> list[float]:
        """Milliseconds from submit to result of `n` one-item `true` jobs, one at a time."""
        raise NotImplementedError
