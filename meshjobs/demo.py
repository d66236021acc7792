"""`meshd --demo`: a throw-away fleet of one, a few jobs through it, then a clean stop.

It starts a real meshd in a temporary folder on free loopback ports, drives it with meshctl
exactly as a user would, shows every command and its output, kills the member with SIGKILL in the
middle to show that nothing acknowledged is lost, and stops it with SIGTERM.
"""

from __future__ import annotations

import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time

START_S_MAX = 30.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -P: the meshjobs of this interpreter (the installed one), never a meshjobs/ folder in the
# folder the demo runs in (a source tree), which `python -m` would put first on sys.path.
def _start(data: str, http_port: int, raft_port: int) -> subprocess.Popen:
    log = open(os.path.join(data, "..", "meshd.log"), "ab")
    proc = subprocess.Popen(
        [sys.executable, "-P", "-m", "meshjobs.daemon", "--data", data, "--name", "demo",
         "--http", f"127.0.0.1:{http_port}", "--raft", f"127.0.0.1:{raft_port}"],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    log.close()
    deadline = time.monotonic() + START_S_MAX
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"meshd exited with {proc.returncode}; see {data}/../meshd.log")
        r = subprocess.run([sys.executable, "-P", "-m", "meshjobs.cli", "--at",
                            f"http://127.0.0.1:{http_port}", "--json", "fleet"],
                           capture_output=True)
        if r.returncode == 0 and b'"leader"' in r.stdout and b"null" not in r.stdout.split(b'"leader"')[1][:8]:
            return proc
        time.sleep(0.1)
    proc.kill()
    raise SystemExit("meshd did not become ready in time")


def _ctl(url: str, *args: str, show: bool = True) -> str:
    cmd = ["meshctl", *args]
    if show:
        print(f"$ {' '.join(shlex.quote(a) for a in cmd)}")
    r = subprocess.run([sys.executable, "-P", "-m", "meshjobs.cli", "--at", url, *args],
                       capture_output=True, text=True)
    out = r.stdout
    if show:
        sys.stdout.write(out)
        if r.stderr:
            sys.stdout.write(r.stderr)
        if r.returncode:
            print(f"(exit {r.returncode})")
    return out.strip()


def run_demo() -> int:
    with tempfile.TemporaryDirectory(prefix="meshjobs-demo-") as top:
        data = os.path.join(top, "data")
        os.makedirs(data)
        http_port, raft_port = _free_port(), _free_port()
        url = f"http://127.0.0.1:{http_port}"
        print(f"Starting a fleet of one: meshd --data {data} --http 127.0.0.1:{http_port}\n")
        proc = _start(data, http_port, raft_port)
        try:
            job = _ctl(url, "job", "submit", "--", "sh", "-c", "echo hello from $MESH_JOB_ID")
            _ctl(url, "job", "wait", job)
            _ctl(url, "job", "results", job)
            print()
            words = os.path.join(top, "words")
            os.makedirs(words)
            for i, w in enumerate(["durable", "replicated", "simple"]):
                with open(os.path.join(words, f"{i}.txt"), "w") as f:
                    f.write(w + "\n")
            arr = _ctl(url, "job", "submit", "--items-from", words, "--", "tr", "a-z", "A-Z")
            _ctl(url, "job", "wait", arr)
            _ctl(url, "job", "results", arr)
            print()
            slow = _ctl(url, "job", "submit", "--id", "slow-one", "--", "sh", "-c", "sleep 1; echo survived")
            print("\nKilling meshd with SIGKILL while that job runs, then starting it again ...\n")
            time.sleep(0.3)
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
            proc = _start(data, http_port, raft_port)
            _ctl(url, "job", "wait", slow)
            _ctl(url, "job", "results", slow)
            print()
            _ctl(url, "jobs")
            print()
            _ctl(url, "job", "status", arr)
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(20)
                except subprocess.TimeoutExpired:
                    proc.kill()
        print(f"\nmeshd stopped (exit {proc.returncode}). Run your own: `meshd` in one terminal, "
              "`meshctl job submit -- CMD...` in another.")
        return 0 if proc.returncode == 0 else 1
