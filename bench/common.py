"""Shared parts of the benchmarks: a real meshd started in a temporary folder, and HTTP."""

from __future__ import annotations

import json
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{os.cpu_count()} cores, {cpu}, Python {platform.python_version()}, {platform.system()} {platform.release()}"


class Member:
    """A meshd process for a benchmark (a fleet of one)."""

    def __init__(self, slots: int = 2, data: str | None = None, config: str | None = None) -> None:
        self.tmp = tempfile.TemporaryDirectory(prefix="meshbench-")
        self.config = config  # meshd.toml text, when given
        self.data = data or os.path.join(self.tmp.name, "data")
        self.slots = slots
        self.raft = free_port()
        self.proc: subprocess.Popen | None = None
        self.url = ""

    def __enter__(self) -> Member:
        os.makedirs(self.data, exist_ok=True)
        env = dict(os.environ, PYTHONPATH=ROOT, MESHJOBS_LOG_LEVEL="warning")
        extra: list[str] = []
        if self.config is not None:
            path = os.path.join(self.tmp.name, "meshd.toml")
            with open(path, "w") as f:
                f.write(self.config)
            extra = ["--config", path]
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "meshjobs.daemon", "--data", self.data, "--http", "127.0.0.1:0",
             "--raft", f"127.0.0.1:{self.raft}", "--slots", str(self.slots), "--name", "bench",
             *extra],
            env=env, stdout=subprocess.DEVNULL, stderr=open(os.path.join(self.tmp.name, "log"), "wb"))
        deadline = time.monotonic() + 30
        addr = os.path.join(self.data, "http.addr")
        while time.monotonic() < deadline:
            if os.path.exists(addr):
                self.url = "http://" + open(addr).read().strip()
                try:
                    if self.get("/healthz").get("ready"):
                        return self
                except OSError:
                    pass
            time.sleep(0.05)
        raise RuntimeError("meshd did not start")

    def __exit__(self, *exc) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(30)
        self.tmp.cleanup()

    def post(self, path: str, body: dict) -> dict:
        req = urllib.request.Request(self.url + path, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            return json.loads(r.read())

    def get(self, path: str) -> dict:
        req = urllib.request.Request(self.url + path, headers={"Accept": "application/json"})
        with urllib.request.urlopen(req, timeout=300) as r:
            return json.loads(r.read())

    def wait(self, job_id: str) -> dict:
        while True:
            rec = self.get(f"/jobs/{job_id}?wait=60")
            if rec["state"] in ("done", "failed", "cancelled"):
                return rec


def pct(values: list[float], p: float) -> float:
    v = sorted(values)
    return v[min(len(v) - 1, int(round(p / 100 * (len(v) - 1))))]
