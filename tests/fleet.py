"""Real meshd processes for multi-process tests: started on free loopback ports in temporary
folders, and always stopped by pid (the `meshd` fixture's finalizer), also when a test fails."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
START_S_MAX = 30.0  # a member that is not ready by then is a failed start


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env_with_path(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("MESHJOBS_FAILPOINTS", None)
    env.update(extra or {})
    return env


class Meshd:
    """One meshd process of a test."""

    def __init__(self, data: str, slots: int = 2, name: str = "m1",
                 env: dict[str, str] | None = None, config: str | None = None) -> None:
        self.data = data
        self.slots = slots
        self.name = name
        self.extra_env = env or {}
        self.config = config
        self.fleet = False  # a member of a bigger fleet: its addresses come from its config
        self.prefix: list[str] = []  # e.g. setpriv, to run the member under another group
        self.peer_port = 0
        self.secret = b""
        self.raft_port = free_port()
        self.proc: subprocess.Popen | None = None
        self.url = ""
        self.log_path = os.path.join(os.path.dirname(data.rstrip("/")) or ".",
                                     f"{os.path.basename(data.rstrip('/'))}.log")

    def start(self, wait_ready: bool = True) -> Meshd:
        os.makedirs(self.data, exist_ok=True)
        addr_file = os.path.join(self.data, "http.addr")
        with contextlib.suppress(FileNotFoundError):
            os.unlink(addr_file)
        args = [sys.executable, "-m", "meshjobs.daemon", "--data", self.data, "--name", self.name]
        if self.config:
            args += ["--config", self.config]
            if not self.fleet:
                args += ["--http", "127.0.0.1:0", "--raft", f"127.0.0.1:{self.raft_port}"]
        else:
            args += ["--slots", str(self.slots), "--http", "127.0.0.1:0",
                     "--raft", f"127.0.0.1:{self.raft_port}"]
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(self.prefix + args, stdout=log, stderr=subprocess.STDOUT, cwd=self.data,
                                     env=env_with_path({"MESHTEST_DATA": self.data, **self.extra_env}),
                                     start_new_session=True)
        log.close()
        if wait_ready:
            self.wait_ready(addr_file)
        return self

    def wait_ready(self, addr_file: str | None = None) -> None:
        addr_file = addr_file or os.path.join(self.data, "http.addr")
        deadline = time.monotonic() + START_S_MAX
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"meshd exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                with open(addr_file) as f:
                    self.url = "http://" + f.read().strip()
            except FileNotFoundError:
                time.sleep(0.05)
                continue
            try:
                status, body = self.request("GET", "/healthz")
            except OSError:
                time.sleep(0.05)
                continue
            if status == 200 and body.get("ready"):
                return
            time.sleep(0.05)
        raise RuntimeError(f"meshd not ready within {START_S_MAX} s:\n{self.log_tail()}")

    def log_tail(self, n: int = 4000) -> str:
        try:
            with open(self.log_path, "rb") as f:
                return f.read()[-n:].decode(errors="replace")
        except FileNotFoundError:
            return "(no log)"

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def kill9(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        self._kill_items()

    def terminate(self, timeout_s: float = 20.0) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
        try:
            return self.proc.wait(timeout_s)
        finally:
            self._kill_items()

    def stop(self) -> None:
        """Stop by pid, whatever state it is in (the finalizer)."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self._kill_items()

    def _kill_items(self) -> None:
        """Items run in their own process groups; a killed meshd leaves them running. Kill every
        process whose environment names this member's test folder (MESH_JOB_ID is set on items)."""
        me = os.getpid()
        for pid in os.listdir("/proc"):
            if not pid.isdigit() or int(pid) == me:
                continue
            try:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    env = f.read()
            except OSError:
                continue
            if b"MESH_JOB_ID=" in env and f"MESHTEST_DATA={self.data}".encode() in env:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(int(pid), signal.SIGKILL)

    def request(self, method: str, path: str, body: Any = None, raw: bytes | None = None,
                headers: dict[str, str] | None = None, timeout_s: float = 30.0) -> tuple[int, Any]:
        data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json",
                                              "Accept": "application/json", **(headers or {})})
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as r:
                payload = r.read()
                status = r.status
                ctype = r.headers.get("Content-Type", "")
        except urllib.error.HTTPError as e:
            payload = e.read()
            status = e.code
            ctype = e.headers.get("Content-Type", "")
        if "json" in ctype:
            return status, json.loads(payload)
        return status, payload

    def metrics(self) -> dict[str, float]:
        """GET /metrics, parsed: metric name (with labels) -> value."""
        status, text = self.request("GET", "/metrics")
        assert status == 200, (status, text)
        out = {}
        for line in text.decode().splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                out[name] = float(value)
        return out

    def ctl(self, *args: str, timeout_s: float = 60.0, input: bytes | None = None) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "meshjobs.cli", "--at", self.url, *args],
                              capture_output=True, timeout=timeout_s, env=env_with_path(),
                              input=input)

    def wait_job(self, job_id: str, timeout_s: float = 60.0) -> dict:
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"job {job_id} did not finish within {timeout_s} s")
            status, rec = self.request("GET", f"/jobs/{job_id}?items=1&wait={min(left, 10):.1f}")
            assert status == 200, (status, rec)
            if rec["state"] in ("done", "failed", "cancelled"):
                return rec


def make_fleet(top: str, voters: int = 3, workers: int = 0, slots: int = 2,
               dead_ms: int = 1500, worker_slots: int | None = None,
               extra: str = "") -> list[Meshd]:
    """Configs, data folders and one shared fleet secret for `voters` voters and `workers`
    worker members on free loopback ports. Nothing is started."""
    secret = os.urandom(32)
    ports = {f"v{i}": (free_port(), free_port(), free_port()) for i in range(1, voters + 1)}
    voter_lines = ", ".join(
        f'{{ name = "{n}", raft = "127.0.0.1:{r}", peer = "127.0.0.1:{p}", http = "127.0.0.1:{h}" }}'
        for n, (r, p, h) in ports.items())
    members = []
    names = list(ports) + [f"w{i}" for i in range(1, workers + 1)]
    for name in names:
        data = os.path.join(top, name)
        os.makedirs(data, exist_ok=True)
        fd = os.open(os.path.join(data, "fleet.secret"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.write(fd, secret)
        os.close(fd)
        if name in ports:
            fleet = f"voters = [ {voter_lines} ]\n"
            addrs = ""
            n_slots = slots
        else:
            first = next(iter(ports.values()))
            fleet = f'join = "127.0.0.1:{first[1]}"\n'
            addrs = f'http = "127.0.0.1:{free_port()}"\npeer = "127.0.0.1:{free_port()}"\n'
            n_slots = slots if worker_slots is None else worker_slots
        cfg = os.path.join(top, f"{name}.toml")
        with open(cfg, "w") as f:
            f.write(f'name = "{name}"\n{addrs}{extra}\n[fleet]\n{fleet}dead_ms = {dead_ms}\n'
                    f"[pools.default]\nslots = {n_slots}\n")
        m = Meshd(data, name=name, config=cfg)
        m.fleet = True
        m.secret = secret
        if name in ports:
            m.raft_port, m.peer_port = ports[name][0], ports[name][1]
        members.append(m)
    return members


def iptables() -> str | None:
    """The iptables binary, when this process may use it (root); None otherwise."""
    path = shutil.which("iptables")
    return path if path and os.geteuid() == 0 else None


def raft_address(m: Meshd) -> str:
    return f"127.0.0.1:{m.raft_port}"


@contextlib.contextmanager
def raft_deaf(m: Meshd):
    """A one-way cut: nothing reaches `m`'s Raft port while it can still send from it. It must
    hold the lowest Raft address of its fleet: pysyncobj dials from the greater address, so
    every Raft connection of that member is one the others made to its port."""
    binary = iptables()
    assert binary is not None, "raft_deaf needs root and iptables"
    rule = ["INPUT", "-p", "tcp", "-d", "127.0.0.1", "--dport", str(m.raft_port), "-j", "DROP"]
    subprocess.run([binary, "-A", *rule], check=True)
    try:
        yield
    finally:
        subprocess.run([binary, "-D", *rule], check=False, capture_output=True)
