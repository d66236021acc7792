"""The one shared test module: what two test modules need lives here, and no test module imports
another (tests/test_toolkit.py checks it).

- Real meshd processes for multi-process tests (`Meshd`, `make_fleet`, `start_all`,
  `fleet_running`): started on loopback in temporary folders, and always stopped by pid (the
  `meshd` fixture's finalizer), also when a test fails.
- Waits: `wait_until` polls a condition (a /metrics counter, a file, a state) up to a bound; tests
  wait on conditions, never for a fixed time. An absence check first waits for the thing that
  would have caused the absent effect (a later lease, a later collection, a later turn).
- In-process harnesses: the job table driven through `apply` (`Log`), the job node as a fleet of
  one (`Fleet1`), the HTTP API in front of a recording control port (`Server`), the item driver on
  its thread (`DriverHarness`), members' links on their threads (`LinksMember`).

Ports. A probed free port may be taken by someone else before meshd binds it. So:
- HTTP: meshd binds port 0 (the default `--http 127.0.0.1:0`, and `http = "127.0.0.1:0"` for
  workers) and writes the address it bound to `http.addr` in its data folder; `Meshd.wait_ready`
  reads it from there. Only voters, whose HTTP address is in every voter's config, get a port
  chosen beforehand.
- Raft and member-links ports must be known to the peers beforehand, so they are chosen with
  `free_port()`. A meshd that exits because one of them was taken meanwhile (it says "cannot
  listen on Raft address", or its log has "Address already in use") is started again on fresh
  ports: `Meshd.start` does so for a member whose ports are its own (a fleet of one), and
  `start_all` for a fleet made by `make_fleet` (whose configs it writes again), up to
  `PORT_TRIES_MAX` times. A restart of a member of a running fleet keeps its ports.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import datetime as dt
import errno
import functools
import hashlib
import http.client
import ipaddress
import json
import os
import queue
import random
import selectors
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import msgpack
import pytest

from blobstore import BlobCorrupt, MemoryBlobStore
from meshjobs import http as mhttp
from meshjobs.control import Answer, ControlError
from meshjobs.driver import Driver
from meshjobs.frames import Frame, FrameType
from meshjobs.links import Links
from meshjobs.node import (
    Applied,
    Ctl,
    Cut,
    FrameIn,
    ItemEnded,
    JobNode,
    NodeConfig,
    Pool,
    Reply,
    Run,
    Tick,
    View,
    advance,
    dispatch,
    ignore,
)
from meshjobs.node.events import EFFECTS
from meshjobs.table import DONE, JobTable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
START_S_MAX = 30.0  # a member that is not ready by then is a failed start
WAIT_S_MAX = 30.0  # the longest wait of flood helpers
ITEM_WAIT_S = 30.0  # the longest a driver test waits for an item to end
UNTIL_S_MAX = 60.0  # the default bound of wait_until: long enough for an election on a loaded host


# Who a test meshd runs items as when neither job nor pool names a user ([items] user). Run as root,
# the suite's items run as root, as they did before items got a user of their own: their tests
# write and read the test's own folders (0700, root's). The tests of the item user itself
# (test_item_walls.py) start meshd with items_user=None: the member's real default.
SUITE_ITEMS_USER = "root" if os.geteuid() == 0 else None

PORT_TRIES_MAX = 5  # starts on fresh ports after a port was taken between probe and bind
PORT_TAKEN = ("Address already in use", "cannot listen on")  # what meshd says when it was


class PortTaken(RuntimeError):
    """meshd exited because a port chosen for it was taken before it could bind it."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _proc_net_addr(text: str) -> tuple[str, int]:
    """An address of /proc/net/tcp{,6}: hex host (32-bit words in host byte order), hex port."""
    host_hex, port_hex = text.split(":")
    raw = bytes.fromhex(host_hex)
    host = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    # Not socket.inet_ntop: importing pysyncobj replaces it with a Windows-only shim that fails.
    return str(ipaddress.ip_address(host)), int(port_hex, 16)


def listening_addrs(pid: int) -> set[tuple[str, int]]:
    """The (host, port) of every TCP socket process `pid` listens on, read from /proc (its
    socket descriptors matched by inode against the LISTEN rows of its namespace's tables)."""
    inodes = set()
    fd_dir = f"/proc/{pid}/fd"
    for fd in os.listdir(fd_dir):
        with contextlib.suppress(OSError):
            target = os.readlink(os.path.join(fd_dir, fd))
            if target.startswith("socket:["):
                inodes.add(target[len("socket:["):-1])
    found = set()
    for table in ("tcp", "tcp6"):
        try:
            with open(f"/proc/{pid}/net/{table}") as f:
                rows = f.read().splitlines()[1:]
        except FileNotFoundError:
            continue
        for row in rows:
            cols = row.split()
            if cols[3] == "0A" and cols[9] in inodes:  # 0A: TCP_LISTEN
                found.add(_proc_net_addr(cols[1]))
    return found


def env_with_path(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("MESHJOBS_FAILPOINTS", None)
    env.update(extra or {})
    return env


def _give_items_user(path: str, user: str) -> None:
    """Make the config file at `path` name `user` as its [items] user, unless it names one (or
    is not TOML: meshd is to say so)."""
    import tomllib
    with open(path) as f:
        text = f.read()
    try:
        items = tomllib.loads(text).get("items")
    except tomllib.TOMLDecodeError:
        return
    if isinstance(items, dict) and "user" in items:
        return
    line = f'user = "{user}"\n'
    if isinstance(items, dict) and "\n[items]\n" in "\n" + text:
        at = ("\n" + text).index("\n[items]\n") + len("[items]\n")
        text = text[:at] + line + text[at:]
    elif items is None:
        text += f"\n[items]\n{line}"
    else:
        return  # an inline or dotted [items]: left as the test wrote it
    with open(path, "w") as f:
        f.write(text)


class Meshd:
    """One meshd process of a test."""

    def __init__(self, data: str, slots: int = 2, name: str = "m1",
                 env: dict[str, str] | None = None, config: str | None = None,
                 token: str | None = None, cacert: str | None = None,
                 http: str = "127.0.0.1:0", items_user: str | None = SUITE_ITEMS_USER) -> None:
        self.data = data
        self.items_user = items_user  # [items] user given to meshd (None: its own default)
        self.token = token  # sent as Authorization: Bearer by request() and ctl()
        self.cacert = cacert  # the certificate request() and ctl() trust for https://
        self.http = http
        self.slots = slots
        self.name = name
        self.extra_env = env or {}
        self.config = config
        self.fleet = False  # a member of a bigger fleet: its addresses come from its config
        self.prefix: list[str] = []  # e.g. setpriv, to run the member under another group
        self.peer_port = 0
        self.secret = b""
        self.raft_port = free_port()
        self.raft_host = "127.0.0.1"  # another loopback address (127.0.0.2) is local too
        self.proc: subprocess.Popen | None = None
        self.log_from = 0  # where this start's lines begin in the log file
        # For a member of a fleet made by make_fleet: choose fresh ports for the whole fleet and
        # write its configs again (start_all calls it when a port was taken).
        self.new_ports: Any = None
        self.url = ""
        self.log_path = os.path.join(os.path.dirname(data.rstrip("/")) or ".",
                                     f"{os.path.basename(data.rstrip('/'))}.log")

    def start(self, wait_ready: bool = True) -> Meshd:
        """Start meshd; with `wait_ready`, wait until it is ready. A member whose ports are its
        own (not a fleet's) is started again on a fresh Raft port if its port was taken."""
        for attempt in range(PORT_TRIES_MAX):
            self._spawn()
            if not wait_ready:
                return self
            try:
                self.wait_ready()
                return self
            except PortTaken:
                if self.fleet or attempt == PORT_TRIES_MAX - 1:
                    raise
                self.raft_port = free_port()
        raise AssertionError("unreachable")

    def _spawn(self) -> None:
        os.makedirs(self.data, exist_ok=True)
        addr_file = os.path.join(self.data, "http.addr")
        with contextlib.suppress(FileNotFoundError):
            os.unlink(addr_file)
        args = [sys.executable, "-m", "meshjobs.daemon", "--data", self.data, "--name", self.name]
        items = f'\n[items]\nuser = "{self.items_user}"\n' if self.items_user else ""
        if self.config:
            if items and os.path.exists(self.config):
                _give_items_user(self.config, self.items_user)
            args += ["--config", self.config]
            if not self.fleet:
                args += ["--http", self.http, "--raft", f"{self.raft_host}:{self.raft_port}"]
        else:
            if items:
                path = self.data.rstrip("/") + ".items.toml"
                with open(path, "w") as f:
                    f.write(items)
                args += ["--config", path]
            args += ["--slots", str(self.slots), "--http", self.http,
                     "--raft", f"{self.raft_host}:{self.raft_port}"]
        log = open(self.log_path, "ab")
        self.log_from = log.tell()
        self.proc = subprocess.Popen(self.prefix + args, stdout=log, stderr=subprocess.STDOUT, cwd=self.data,
                                     env=env_with_path({"MESHTEST_DATA": self.data, **self.extra_env}),
                                     start_new_session=True)
        log.close()

    def port_taken(self) -> bool:
        """Whether this start of meshd exited because a port it was to bind was taken."""
        if self.proc is None or self.proc.poll() is None:
            return False
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self.log_from)
                said = f.read().decode(errors="replace")
        except FileNotFoundError:
            return False
        return any(p in said for p in PORT_TAKEN)

    def is_ready(self) -> bool:
        """One look: whether meshd wrote its HTTP address and says it is ready. Raises when it
        exited (PortTaken when a port was taken)."""
        if self.proc is not None and self.proc.poll() is not None:
            error = PortTaken if self.port_taken() else RuntimeError
            raise error(f"meshd exited with {self.proc.returncode}:\n{self.log_tail()}")
        try:
            with open(os.path.join(self.data, "http.addr")) as f:
                addr = f.read().strip()
        except FileNotFoundError:
            return False
        # host:port for HTTP, the whole URL for HTTPS.
        self.url = addr if "://" in addr else "http://" + addr
        try:
            status, body = self.request("GET", "/healthz")
        except OSError:
            return False
        return status == 200 and bool(body.get("ready"))

    def wait_ready(self, addr_file: str | None = None) -> None:
        deadline = time.monotonic() + START_S_MAX
        while time.monotonic() < deadline:
            if self.is_ready():
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
        item process (MESH_JOB_ID is in its environment) of this member: its output goes to a
        spool file in the member's data folder, or it runs there (an item's default cwd). Items
        see none of meshd's own environment, so MESHTEST_DATA cannot tell them apart."""
        me = os.getpid()
        data = os.path.realpath(self.data) + os.sep
        for pid in os.listdir("/proc"):
            if not pid.isdigit() or int(pid) == me:
                continue
            try:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    env = f.read()
            except OSError:
                continue
            if b"MESH_JOB_ID=" not in env:
                continue
            places = []
            for link in ("fd/0", "fd/1", "fd/2", "cwd"):
                with contextlib.suppress(OSError):
                    places.append(os.readlink(f"/proc/{pid}/{link}") + os.sep)
            if any(p.startswith(data) for p in places):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(int(pid), signal.SIGKILL)

    def tls(self) -> ssl.SSLContext | None:
        return ssl.create_default_context(cafile=self.cacert) if self.url.startswith("https") else None

    def request(self, method: str, path: str, body: Any = None, raw: bytes | None = None,
                headers: dict[str, str] | None = None, timeout_s: float = 30.0,
                auth: bool = True) -> tuple[int, Any]:
        """One request; with `auth` (and a token) it carries Authorization: Bearer."""
        data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
        sent = {"Content-Type": "application/json", "Accept": "application/json"}
        if auth and self.token is not None:
            sent["Authorization"] = f"Bearer {self.token}"
        sent.update(headers or {})
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={k: v for k, v in sent.items() if v is not None})
        try:
            with urllib.request.urlopen(req, timeout=timeout_s, context=self.tls()) as r:
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

    def raw_request(self, method: str, path: str, body: bytes | None = None,
                    headers: dict[str, Any] | None = None,
                    timeout_s: float = 30.0) -> tuple[int, Any, bytes]:
        """One request exactly as given (no token, no default headers; a value may be bytes):
        (status, response headers, body bytes)."""
        import http.client
        import urllib.parse
        u = urllib.parse.urlsplit(self.url)
        if u.scheme == "https":
            conn: http.client.HTTPConnection = http.client.HTTPSConnection(
                u.hostname, u.port, timeout=timeout_s, context=self.tls())
        else:
            conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout_s)
        try:
            conn.putrequest(method, path, skip_host="Host" in (headers or {}),
                            skip_accept_encoding=True)
            for k, v in (headers or {}).items():
                conn.putheader(k, v)
            if body is not None:
                conn.putheader("Content-Length", str(len(body)))
            conn.endheaders(body)
            resp = conn.getresponse()
            return resp.status, resp.headers, resp.read()
        finally:
            conn.close()

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

    def ctl(self, *args: str, timeout_s: float = 60.0, input: bytes | None = None,
            env: dict[str, str] | None = None,
            cwd: str | None = None) -> subprocess.CompletedProcess:
        """meshctl against this member (run in folder `cwd`, default the test's); its token and
        certificate go in MESHJOBS_TOKEN and MESHJOBS_CACERT unless `env` says otherwise ("" leaves
        one out)."""
        extra = {"MESHJOBS_TOKEN": self.token or "", "MESHJOBS_CACERT": self.cacert or ""}
        extra.update(env or {})
        full = env_with_path()
        for k in ("MESHJOBS_TOKEN", "MESHJOBS_CACERT", "MESHJOBS_AT"):
            full.pop(k, None)
        full.update({k: v for k, v in extra.items() if v != ""})
        return subprocess.run([sys.executable, "-m", "meshjobs.cli", "--at", self.url, *args],
                              capture_output=True, timeout=timeout_s, env=full, input=input,
                              cwd=cwd)

    def submit(self, *args: str, cwd: str | None = None) -> str:
        """`meshctl job submit ARGS` against this member (run in folder `cwd`); the new job's id."""
        r = self.ctl("job", "submit", *args, cwd=cwd)
        assert r.returncode == 0, r.stderr
        job_id = r.stdout.decode().strip()
        assert job_id and "\n" not in job_id, r.stdout
        return job_id

    def record(self, job_id: str, items: bool = False) -> dict:
        """The job's record as this member has it (GET /jobs/{id}); it must be there."""
        status, rec = self.request("GET", f"/jobs/{job_id}" + ("?items=1" if items else ""))
        assert status == 200, (status, rec)
        return rec

    def wait_job(self, job_id: str, timeout_s: float = 60.0) -> dict:
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"job {job_id} did not finish within {timeout_s} s")
            status, rec = self.request("GET", f"/jobs/{job_id}?items=1&wait={min(left, 10):.1f}")
            assert status == 200, (status, rec)
            if rec["state"] in ("done", "failed", "cancelled", "dep_failed"):
                return rec


def make_cert(folder: str, names: tuple[str, ...] = ("localhost", "127.0.0.1", "::1"),
              days: int = 2) -> tuple[str, str]:
    """A self-signed certificate and its key (PEM files in `folder`) for `names` (host names or
    IP addresses, all in its subjectAltName). Returns (cert path, key path)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, names[0])])
    alt: list[x509.GeneralName] = []
    for n in names:
        try:
            alt.append(x509.IPAddress(ipaddress.ip_address(n)))
        except ValueError:
            alt.append(x509.DNSName(n))
    now = dt.datetime.now(dt.UTC)
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(hours=1))
            .not_valid_after(now + dt.timedelta(days=days))
            .add_extension(x509.SubjectAlternativeName(alt), critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    os.makedirs(folder, exist_ok=True)
    cert_path = os.path.join(folder, "cert.pem")
    key_path = os.path.join(folder, "key.pem")
    with open(cert_path, "wb") as f:
        f.write(cert.public_bytes(serialization.Encoding.PEM))
    with open(key_path, "wb") as f:
        f.write(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                  serialization.NoEncryption()))
    return cert_path, key_path


def token_line(name: str, role: str, token: str, run_as: list[str] | None = None) -> str:
    """One entry of [auth] tokens for `token` (only its SHA-256 goes in the config), with the
    users its jobs may run as when `run_as` is given."""
    digest = hashlib.sha256(token.encode()).hexdigest()
    extra = "" if run_as is None else f", run_as = {json.dumps(run_as)}"
    return f'{{ name = "{name}", role = "{role}", sha256 = "{digest}"{extra} }}'

def limit_fds(m: Meshd, nofile: int) -> Meshd:
    """Start `m` under a file descriptor limit of `nofile` (soft and hard), as a host with
    `ulimit -n 1024` would: prlimit execs meshd, so the pid stays the member's."""
    prlimit = shutil.which("prlimit")
    if prlimit is None:
        pytest.skip("prlimit (util-linux) is not installed")
    m.prefix = [prlimit, f"--nofile={nofile}:{nofile}", "--"]
    return m


def member_config(top: str, name: str, text: str = "") -> str:
    """A config file for a fleet of one named `name`, with `text` after its name (tables such
    as [http]); its HTTP and Raft addresses come from Meshd's command line."""
    path = os.path.join(top, f"{name}.toml")
    with open(path, "w") as f:
        f.write(f'name = "{name}"\n{text}\n')
    return path


def flood(addr: tuple[str, int], n: int, payload: bytes) -> list[socket.socket]:
    """n connections, each sent `payload` once connected (those refused or reset are closed
    at once and left out); returns once every one is connected or failed."""
    sel = selectors.DefaultSelector()
    pending = 0
    for _ in range(n):
        s = socket.socket()
        s.setblocking(False)
        err = s.connect_ex(addr)
        if err not in (0, errno.EINPROGRESS):
            s.close()
            continue
        sel.register(s, selectors.EVENT_WRITE)
        pending += 1
    out: list[socket.socket] = []
    deadline = time.monotonic() + WAIT_S_MAX
    while pending and time.monotonic() < deadline:
        for key, _ in sel.select(timeout=1.0):
            s = key.fileobj
            assert isinstance(s, socket.socket)
            sel.unregister(s)
            pending -= 1
            if s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) != 0:
                s.close()
                continue
            try:
                s.send(payload)
            except OSError:
                s.close()
                continue
            out.append(s)
    for key in list(sel.get_map().values()):
        key.fileobj.close()  # type: ignore[union-attr]
    sel.close()
    return out


def wait_closed(socks: list[socket.socket], timeout_s: float = WAIT_S_MAX) -> int:
    """Wait until the server closed every socket (EOF or reset); returns how many it did in
    time. Bytes the server sends first (an error answer) are read and skipped."""
    sel = selectors.DefaultSelector()
    for s in socks:
        s.setblocking(False)
        sel.register(s, selectors.EVENT_READ)
    closed = 0
    deadline = time.monotonic() + timeout_s
    while closed < len(socks) and time.monotonic() < deadline:
        for key, _ in sel.select(timeout=0.5):
            s = key.fileobj
            assert isinstance(s, socket.socket)
            try:
                data = s.recv(65536)
            except BlockingIOError:
                continue
            except OSError:
                data = b""
            if not data:
                sel.unregister(s)
                closed += 1
    sel.close()
    return closed


def close_all(socks: list[socket.socket]) -> None:
    for s in socks:
        s.close()


_CLOCK_SHIFT = """\
# Written by tests/helpers.py's shift_clock: this process's wall clock runs {seconds} s off.
import time as _time

_time_f, _time_ns_f = _time.time, _time.time_ns
_time.time = lambda: _time_f() + {seconds}
_time.time_ns = lambda: _time_ns_f() + {ns}
"""


def shift_clock(m: Meshd, seconds: float) -> None:
    """Start `m` with its wall clock (time.time, time.time_ns) `seconds` off the others', as a
    member whose clock is wrong would be: a sitecustomize in a folder of its own, first on its
    PYTHONPATH. Monotonic clocks stay as they are, as they would."""
    folder = os.path.join(os.path.dirname(m.data.rstrip("/")), f"{m.name}-clock")
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "sitecustomize.py"), "w") as f:
        f.write(_CLOCK_SHIFT.format(seconds=float(seconds), ns=int(seconds * 1_000_000_000)))
    m.extra_env["PYTHONPATH"] = folder + os.pathsep + ROOT


def make_fleet(top: str, voters: int = 3, workers: int = 0, slots: int = 2,
               dead_ms: int = 1500, worker_slots: int | None = None,
               extra: str = "", lost_ms: int | None = None,
               worker_pools: str = "", hosts: dict[str, str] | None = None) -> list[Meshd]:
    """Configs, data folders and one shared fleet secret for `voters` voters and `workers`
    worker members on loopback (ports as the module's docstring says), or on the addresses
    `hosts` gives by member name (a member in a namespace of its own: `Netns`); `worker_pools`
    ends every worker's config (more `[pools.X]`, say). Nothing is started."""
    hosts = hosts or {}
    secret = os.urandom(32)
    voter_names = [f"v{i}" for i in range(1, voters + 1)]
    names = voter_names + [f"w{i}" for i in range(1, workers + 1)]
    members = []
    for name in names:
        data = os.path.join(top, name)
        os.makedirs(data, exist_ok=True)
        fd = os.open(os.path.join(data, "fleet.secret"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.write(fd, secret)
        os.close(fd)
        m = Meshd(data, name=name, config=os.path.join(top, f"{name}.toml"))
        m.fleet = True
        m.secret = secret
        members.append(m)

    def new_ports() -> None:
        """Choose ports for every voter (raft, peer, http) and worker (peer) and write every
        member's config with them."""
        ports = {n: (free_port(), free_port(), free_port()) for n in voter_names}
        at = {n: hosts.get(n, "127.0.0.1") for n in names}
        voter_lines = ", ".join(
            f'{{ name = "{n}", raft = "{at[n]}:{r}", peer = "{at[n]}:{p}", http = "{at[n]}:{h}" }}'
            for n, (r, p, h) in ports.items())
        for m in members:
            if m.name in ports:
                fleet = f"voters = [ {voter_lines} ]\n"
                addrs = ""
                n_slots = slots
                m.raft_port, m.peer_port = ports[m.name][0], ports[m.name][1]
            else:
                first = voter_names[0]
                fleet = f'join = "{at[first]}:{ports[first][1]}"\n'
                m.peer_port = free_port()
                addrs = f'http = "{at[m.name]}:0"\npeer = "{at[m.name]}:{m.peer_port}"\n'
                n_slots = slots if worker_slots is None else worker_slots
            assert m.config is not None
            with open(m.config, "w") as f:
                lost = f"lost_ms = {lost_ms}\n" if lost_ms is not None else ""
                f.write(f'name = "{m.name}"\n{addrs}{extra}\n[fleet]\n{fleet}dead_ms = {dead_ms}\n{lost}'
                        f"[pools.default]\nslots = {n_slots}\n")
                if m.name not in ports:
                    f.write(worker_pools)

    new_ports()
    for m in members:
        m.new_ports = new_ports
    return members


def running(m: Meshd) -> Iterator[Meshd]:
    """Start `m`, hand it over, and stop it (by pid) afterwards, also on failure: the body of a
    fixture that yields a started member (`yield from running(Meshd(...))`)."""
    try:
        m.start()
        yield m
    finally:
        m.stop()


def read_pty(master: int) -> bytes:
    """All a terminal's program wrote, read from the pty's master side until the program's end
    closes it (EIO, or an empty read)."""
    shown = b""
    while True:
        try:
            chunk = os.read(master, 4096)
        except OSError:
            return shown
        if not chunk:
            return shown
        shown += chunk


def fleet_running(members: list[Meshd]) -> Iterator[list[Meshd]]:
    """Start every member, hand them over, and stop each (by pid) afterwards, also on failure:
    the body of a fixture that yields a started fleet (`yield from fleet_running(make_fleet(...))`)."""
    try:
        start_all(members)
        yield members
    finally:
        for m in members:
            m.stop()


def leader_of(members: list[Meshd], timeout_s: float = 60.0) -> Meshd:
    """The member that is leader and ready, once there is one (members down are passed over)."""
    def find() -> Meshd | None:
        for m in members:
            if m.proc is None or m.proc.poll() is not None:
                continue
            try:
                status, h = m.request("GET", "/healthz", timeout_s=2)
            except OSError:
                continue
            if status == 200 and h.get("is_leader") and h.get("ready"):
                return m
        return None
    return wait_until(find, timeout_s, what="a ready leader")


def wait_until(pred: Any, timeout_s: float = UNTIL_S_MAX, what: str = "condition") -> Any:
    """Call `pred` until it returns something true (OSError counts as not yet); return that, or
    fail naming `what` once `timeout_s` passed."""
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = pred()
        except OSError as e:  # a member that is down or restarting
            last = e
        else:
            if last:
                return last
        time.sleep(0.05)
    raise AssertionError(f"{what} not reached within {timeout_s} s (last: {last!r})")


def journal_segments(data: str) -> list[str]:
    """The Raft journal's segment files in a member's data folder, oldest first (`raft.journal`
    itself, of a folder an earlier version wrote, first)."""
    found = []
    for name in os.listdir(data):
        rest = name[len("raft.journal"):]
        if name.startswith("raft.journal") and (rest == "" or (
                rest[:1] == "." and rest[1:].isdigit())):
            found.append((int(rest[1:] or 0), os.path.join(data, name)))
    return [path for _seq, path in sorted(found)]


def journal_bytes(data: str) -> int:
    """Bytes of the Raft journal's segments in a member's data folder."""
    return sum(os.path.getsize(p) for p in journal_segments(data))


def flip_blob_byte(data: str, needle: bytes) -> None:
    """Flip one bit of a stored blob in a stopped member's LMDB file, where `needle` (bytes
    unique to that blob) lies: damage on disk, as bit rot would leave it."""
    mdb = os.path.join(data, "blobs", "data.mdb")
    with open(mdb, "rb") as f:
        raw = bytearray(f.read())
    at = raw.find(needle)
    assert at >= 0 and raw.find(needle, at + 1) < 0, "the needle must be in the file once"
    raw[at + 7] ^= 0x01
    with open(mdb, "wb") as f:
        f.write(bytes(raw))


def holds_bytes(data: str, needle: bytes) -> bool:
    """Whether a member's LMDB file holds `needle` (so: the blob it belongs to)."""
    with open(os.path.join(data, "blobs", "data.mdb"), "rb") as f:
        return f.read().find(needle) >= 0


def copies_landed(members: list[Meshd]) -> bool:
    """Whether no member's blob mover has a copy waiting for its acknowledgement. A result
    commits once `blob_copies - 1` members confirmed its outputs, while the copy asked of a
    spare at the same time may land later: call this (in wait_until) after a job is done and
    before counting who holds its outputs. Every copy asked for a result is in its mover's
    books by then: the asks were queued before the acknowledgement that let it commit."""
    return all(m.metrics().get("meshjobs_blob_mover_copies_waiting", 0) == 0 for m in members)


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


def netns_unavailable() -> str | None:
    """Why a test cannot put a member in a network namespace of its own here (None: it can):
    it takes root, `ip` and `iptables`, and a namespace and a veth pair made and removed."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "iptables"):
        if shutil.which(tool) is None:
            return f"no {tool} binary on this machine"
    try:
        with Netns():
            pass
    except (OSError, subprocess.CalledProcessError) as e:
        detail = getattr(e, "stderr", b"") or b""
        return f"cannot make a network namespace with a veth pair: {e} {detail.decode().strip()}"
    return None


class Netns:
    """A network namespace of its own for one member, joined to this one by a veth pair: the
    member listens on `inner` (its side), the others on `outer` (this side, a local address
    here). `cut()` drops, inside the namespace, every packet to or from the member but those of
    the ports `reachable` keeps (its HTTP port, for the test to ask it): a partition as a pulled
    cable makes it, with nothing refused or reset. `heal()` takes the rules away. Made and
    removed by the context manager; a member runs inside with `prefix` before its command."""

    _made = 0

    def __init__(self) -> None:
        Netns._made += 1
        tag = f"{os.getpid() % 100000}x{Netns._made}"
        self.name = f"meshjobs-{tag}"
        self._host_if, self._ns_if = f"mj{tag}h", f"mj{tag}n"
        self.outer = self.inner = ""
        self.cut_now = False

    @property
    def prefix(self) -> list[str]:
        return ["ip", "netns", "exec", self.name]

    def _in(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run([*self.prefix, *args], check=check, capture_output=True)

    def _taken(self) -> set[str]:
        out = subprocess.run(["ip", "-4", "-o", "addr"], check=True, capture_output=True)
        return {w.split("/")[0] for w in out.stdout.decode().split() if w.count(".") == 3}

    def __enter__(self) -> Netns:
        rng = random.Random()
        taken = self._taken()
        while True:  # a /30 of 10.0.0.0/8 no interface here uses (other runs make theirs)
            a, b, c = rng.randrange(100, 250), rng.randrange(256), rng.randrange(0, 256, 4)
            self.outer, self.inner = f"10.{a}.{b}.{c + 1}", f"10.{a}.{b}.{c + 2}"
            if not {self.outer, self.inner} & taken:
                break
        run = functools.partial(subprocess.run, check=True, capture_output=True)
        run(["ip", "netns", "add", self.name])
        try:
            run(["ip", "link", "add", self._host_if, "type", "veth", "peer", "name", self._ns_if])
            run(["ip", "link", "set", self._ns_if, "netns", self.name])
            run(["ip", "addr", "add", f"{self.outer}/30", "dev", self._host_if])
            run(["ip", "link", "set", self._host_if, "up"])
            self._in("ip", "addr", "add", f"{self.inner}/30", "dev", self._ns_if)
            self._in("ip", "link", "set", self._ns_if, "up")
            self._in("ip", "link", "set", "lo", "up")
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        subprocess.run(["ip", "link", "del", self._host_if], capture_output=True)
        subprocess.run(["ip", "netns", "del", self.name], capture_output=True)

    def cut(self, reachable: tuple[int, ...] = ()) -> None:
        """Drop every packet in or out of the namespace but those of local TCP ports
        `reachable` (and loopback inside it)."""
        for port in reachable:
            self._in("iptables", "-A", "INPUT", "-p", "tcp", "--dport", str(port), "-j", "ACCEPT")
            self._in("iptables", "-A", "OUTPUT", "-p", "tcp", "--sport", str(port), "-j", "ACCEPT")
        for chain in ("INPUT", "OUTPUT"):
            self._in("iptables", "-A", chain, "-i" if chain == "INPUT" else "-o", "lo",
                     "-j", "ACCEPT")
            self._in("iptables", "-A", chain, "-j", "DROP")
        self.cut_now = True

    def heal(self) -> None:
        for chain in ("INPUT", "OUTPUT"):
            self._in("iptables", "-F", chain)
        self.cut_now = False


def start_all(members: list[Meshd]) -> list[Meshd]:
    """Start every member at once (voters wait for each other), then wait until each is ready.
    When one exits because a port was taken, all are stopped and, for a fleet from make_fleet,
    started again on fresh ports (up to PORT_TRIES_MAX times)."""
    for attempt in range(PORT_TRIES_MAX):
        for m in members:
            m.start(wait_ready=False)
        try:
            deadline = time.monotonic() + START_S_MAX
            waiting = list(members)
            while waiting:
                waiting = [m for m in waiting if not m.is_ready()]
                if waiting and time.monotonic() > deadline:
                    raise RuntimeError(f"{[m.name for m in waiting]} not ready within "
                                       f"{START_S_MAX} s:\n{waiting[0].log_tail()}")
                if waiting:
                    time.sleep(0.05)
            return members
        except PortTaken:
            renew = members[0].new_ports
            if attempt == PORT_TRIES_MAX - 1 or renew is None:
                raise
            for m in members:
                m.stop()
            renew()
    raise AssertionError("unreachable")


def submit_anywhere(members: list[Meshd], spec: dict, timeout_s: float = 60.0) -> tuple[Meshd, str]:
    """Submit `spec` through the first member that takes it (an election may be under way);
    returns that member and the job's id."""
    def attempt() -> tuple[Meshd, str] | None:
        for m in members:
            status, rec = m.request("POST", "/jobs", spec)
            if status == 201:
                return m, rec["id"]
        return None
    return wait_until(attempt, timeout_s, "a submit")


class EventStream:
    """A client of GET /events on one member (a raw socket, so that a test may also drop it):
    `next()` gives the next event as {"id", "event", "data"} (data decoded from JSON), or a
    comment as {"comment": text}."""

    def __init__(self, m: Meshd, query: str = "", headers: dict[str, str] | None = None,
                 timeout_s: float = WAIT_S_MAX) -> None:
        import http.client
        import urllib.parse
        u = urllib.parse.urlsplit(m.url)
        self.conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout_s)
        sent = {"Accept": "text/event-stream"}
        if m.token is not None:
            sent["Authorization"] = f"Bearer {m.token}"
        sent.update(headers or {})
        self.conn.request("GET", "/events" + (f"?{query}" if query else ""), headers=sent)
        self.resp = self.conn.getresponse()
        self.status = self.resp.status
        self.headers = self.resp.headers
        self.body = b"" if self.status == 200 else self.resp.read()

    def next(self) -> dict:
        """The next event or comment (the socket's timeout bounds the wait)."""
        fields: dict[str, Any] = {}
        while True:
            line = self.resp.readline()
            if not line:
                raise EOFError("the event stream ended")
            text = line.decode().rstrip("\n")
            if text == "":
                if fields:
                    if "data" in fields:
                        fields["data"] = json.loads(fields["data"])
                    return fields
                continue
            if text.startswith(":"):
                if not fields:
                    return {"comment": text[1:].strip()}
                continue
            name, _, value = text.partition(": ")
            fields[name] = value

    def until(self, pred: Any, what: str = "an event") -> tuple[dict, list[dict]]:
        """Read events until one passes `pred`: (that event, every event read before it)."""
        seen: list[dict] = []
        while True:
            ev = self.next()
            if "comment" not in ev and pred(ev):
                return ev, seen
            seen.append(ev)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.conn.sock.shutdown(socket.SHUT_RDWR)  # type: ignore[union-attr]
        self.conn.close()


def send_and_read(port: int, data: bytes, wait_s: float = 10.0) -> bytes:
    """Send `data` to 127.0.0.1:`port`, then keep the connection open until the member closes
    it (or `wait_s` passes), so that the member reads and judges it rather than seeing the
    close first; what the member wrote back."""
    got = b""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(data)
        s.settimeout(wait_s)
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            try:
                chunk = s.recv(65536)
            except OSError:
                break
            if not chunk:
                break
            got += chunk
    return got


def submit_big_entry(m: Any) -> dict:
    """Submit a held array job whose entry is over log_compaction_bytes_min (each item its own
    payload: repeated payloads make a small entry), and two small jobs after it (a compaction
    keeps the last applied entry); the big job's record."""
    from meshjobs import limits

    n = limits.log_compaction_bytes_min // 30
    status, rec = m.request("POST", "/jobs", {"argv": ["true"], "hold": True,
                                              "items": [str(k) for k in range(n)]})
    assert status == 201, (status, rec)
    for _ in range(2):
        status, small = m.request("POST", "/jobs", {"argv": ["true"], "hold": True})
        assert status == 201, (status, small)
    return rec


# --- Fleet waits: submit through one member until it takes the change ------------------------


def submit(m, spec: dict, timeout_s: float = 30.0) -> dict:
    def attempt():
        status, rec = m.request("POST", "/jobs", spec, timeout_s=timeout_s)
        return rec if status in (200, 201) else None
    return wait_until(attempt, what=f"submit through {m.name}")


def metrics(m) -> dict[str, float]:
    return m.metrics()


# --- The job table, driven through `apply` (tests of table.py and of what builds on it) -------


T0 = 1_700_000_000_000  # a plausible time stamp, in milliseconds since the epoch


def spec(**kw: Any) -> dict:
    """A job spec as the leader proposes it (every key present, as control normalizes it)."""
    base = {
        "argv": ["echo", "hi"], "pool": "default", "env": {}, "cwd": None, "retries": 0,
        "runtime_s": None, "tags": [], "priority": 0, "hold": False, "max_leases": None,
    }
    base.update(kw)
    return base


class Log:
    """A table and the log index of its next entry: the harness every test drives."""

    def __init__(self) -> None:
        self.table = JobTable()
        self.index = 0

    def apply(self, entry: Any) -> dict:
        self.index += 1
        return self.table.apply(entry, self.index)

    def submit(self, job_id: str = "j1", n: int = 1, t: int = T0, dg: bytes = b"dg-1",
               rid: str | None = None, items: list | None = None, **kw: Any) -> dict:
        e: dict[str, Any] = {"k": "submit", "t": t, "id": job_id, "spec": spec(**kw), "dg": dg,
                             "items": [None] * n if items is None else items}
        if rid is not None:
            e["rid"] = rid
        return self.apply(e)

    def lease(self, *items: tuple[str, int], t: int = T0, member: str = "m1",
              boot: str = "b1") -> tuple[dict, int]:
        """Lease `items`; return the outcome and the epoch (the entry's index)."""
        out = self.apply({"k": "lease", "t": t, "g": [[j, i, member, boot] for j, i in items]})
        return out, self.index

    def result(self, *rows: list, t: int = T0) -> dict:
        return self.apply({"k": "result", "t": t, "r": list(rows)})

    def revoke(self, *leases: tuple[str, int, int], t: int = T0) -> dict:
        return self.apply({"k": "revoke", "t": t, "l": [list(x) for x in leases]})

    def op(self, kind: str, job_id: Any = "j1", t: int = T0, **kw: Any) -> dict:
        return self.apply({"k": kind, "t": t, "id": job_id, **kw})

    def job(self, job_id: str = "j1"):
        return self.table.jobs[job_id]

    def counts(self) -> dict:
        return {k: v for k, v in self.table.counts.items() if v}


def row(job_id: str, i: int, epoch: int, state: int = DONE, rc: int | None = 0,
        out: bytes | None = None, err: bytes | None = None, started: int = T0,
        ended: int = T0 + 5) -> list:
    return [job_id, i, epoch, state, rc, None, out, err, started, ended]


def refusal(out: dict) -> tuple:
    return (out["ok"], out["status"], out["reason"])


# --- The job node as a fleet of one: a log that commits what the node proposes ---------------


LEADER = View(term=1, leader="m1", is_leader=True, ready=True)
DIGEST_OUT = "ab" * 32


class Fleet1:
    """One member, its table and a log that commits whatever the node proposes when told to."""

    def __init__(self, slots: int = 2, seed: int = 7, **cfg_kw: Any) -> None:
        self.table = JobTable()
        cfg_kw.setdefault("pools", {"default": Pool("default", slots=slots)})
        cfg = NodeConfig(member="m1", boot="b1", **cfg_kw)
        self.node = JobNode(self.table, cfg, random.Random(seed))
        self.index = 0
        self.now = 1_700_000_000_000
        self.replies: dict[int, list[Answer]] = {}
        self.runs: list[Run] = []
        self.cuts: list[Cut] = []
        self.pending: list[dict] = []  # proposed, not yet committed (a batch's entries one by one)
        self.batches: list[dict] = []  # every batch entry proposed, whole
        self._tags: dict[int, int] = {}  # id of a batch's entry -> the batch's tag
        self.proposed: list[dict] = []  # every proposal ever
        self.node.step(LEADER)
        self.tick(0)

    def tick(self, ms: int) -> None:
        self.now += ms
        self.node.step(Tick(self.now))

    def ctl(self, token: int, req: Any) -> None:
        self.node.step(Ctl(token, req))

    def take(self) -> list[Any]:
        """One round's second half, as the jobs thread and the simulator carry it out
        (`advance`); returns the round's effects in the order they were released."""
        ready = self.node.ready()
        advance(ready, persist=self._persist, sync=lambda: None, release=self._release)
        return ready.effects()

    def _persist(self, entry: dict) -> None:
        # A batch's entries are committed one by one here, so that a test can commit (or
        # lose) a lease, a result or a change on its own.
        subs = [entry]
        if entry["k"] == "batch":
            self.batches.append(entry)
            subs = entry["es"]
            for sub in subs:
                self._tags[id(sub)] = entry["p"]
        self.pending += subs
        self.proposed += subs

    def _release(self, eff: Any) -> None:
        # The node's effects this harness records; it has nothing to do with the others.
        dispatch(eff, {**dict.fromkeys(EFFECTS, ignore),
                       Reply: lambda e: self.replies.setdefault(e.token, []).append(e.answer),
                       Run: self.runs.append, Cut: self.cuts.append})

    def commit(self, entry: dict) -> int:
        tag = self._tags.pop(id(entry), None)
        if tag is not None:
            # An entry of a batch, committed on its own: as a batch of one with the batch's tag
            # (the node holds back its next entry until it sees one of its entries applied).
            entry = {"k": "batch", "t": entry["t"], "p": tag, "es": [entry]}
        self.index += 1
        e = msgpack.unpackb(msgpack.packb(entry, use_bin_type=True), raw=False,
                            strict_map_key=False)
        prev = self.table.applied_index
        out = self.table.apply(e, self.index)
        self.node.step(Applied(self.index, e, out, prev))
        return self.index

    def commit_pending(self) -> None:
        while self.pending:
            self.commit(self.pending.pop(0))

    def settle(self, rounds: int = 20) -> None:
        """Take and commit until the node proposes nothing more."""
        for _ in range(rounds):
            self.take()
            if not self.pending:
                return
            self.commit_pending()
        raise AssertionError("the node kept proposing")

    def pending_of(self, kind: str) -> list[dict]:
        return [e for e in self.pending if e["k"] == kind]

    def answer(self, token: int) -> Answer:
        got = self.replies.get(token, [])
        assert len(got) == 1, f"token {token} answered {len(got)} times: {got}"
        return got[0]

    def end(self, run: Run, state: str = "done", rc: int | None = 0, ran_ms: int = 5) -> None:
        self.node.step(ItemEnded(run.job_id, run.index, run.epoch, state, rc, None, DIGEST_OUT,
                                 None, self.now - ran_ms, self.now))


def submit_req(rid: str = "r1", job_id: str | None = "j1", n: int = 1, **spec: Any) -> dict:
    s: dict[str, Any] = {"argv": ["echo", "hi"], **spec}
    if job_id is not None:
        s["id"] = job_id
    return {"op": "submit", "rid": rid, "spec": s, "items": [None] * n}


def submitted(f: Fleet1, token: int = 1, **kw: Any) -> dict:
    """Submit a job and commit it (leases proposed with it stay pending); return its record."""
    f.ctl(token, submit_req(**kw))
    f.take()
    [entry] = f.pending_of("submit")
    f.pending.remove(entry)
    f.commit(entry)
    f.take()
    ans = f.answer(token)
    assert ans.status == 201, ans
    return ans.body


# --- The HTTP API on a real socket, in front of a recording control port ---------------------


def job_record(job_id: str = "j1", **extra: Any) -> dict:
    rec = {"id": job_id, "state": "running", "priority": 0, "hold": False, "tags": ["t"],
           "pool": "default", "argv": ["echo"], "items_total": 3, "items_done": 1,
           "items_failed": 0, "submitted_at": 1_700_000_000.0, "finished_at": None}
    rec.update(extra)
    return rec


class RecordingControl:
    """Answers each op from `answers` (an Answer, or a function of the request)."""

    def __init__(self) -> None:
        self.requests: list[dict] = []
        self.hang: set[str] = set()
        self.late_s: dict[str, float] = {}
        self.answers: dict[str, Any] = {}
        self.reset()

    def reset(self) -> None:
        self.requests.clear()
        self.hang.clear()
        self.late_s.clear()
        self.answers = {
            "submit": lambda r: Answer(201, job_record(r["spec"].get("id") or "new1")),
            "get": lambda r: Answer(200, job_record(r["id"])),
            "list": Answer(200, [job_record("j1"), job_record("j2", state="done")]),
            "cancel": lambda r: Answer(200, job_record(r["id"], state="cancelled")),
            "forget": lambda r: Answer(200, job_record(r["id"], state="done")),
            "tone": lambda r: Answer(200, job_record(r["id"])),
            "fleet": Answer(200, {"term": 3, "leader": "m1", "members": [
                {"name": "m1", "role": "leader", "alive": True}]}),
            "health": Answer(200, {"ok": True, "member": "m1", "leader": "m1"}),
            "metrics": Answer(200, {"items_running": 2, "mystery_pending": 7.5,
                                    "is_leader": True, "note": "not a number",
                                    "node_frames_in_F_CTL": 4,
                                    "jobs_by_state_pool": {"running": {"default": 1}}}),
        }

        # The item reads (node/reads.py) answered from what "get" with items answers, so that
        # a test that sets "get" sets them too.
        for op in ("item", "items", "outputs"):
            self.answers[op] = self._item_read

    def _item_read(self, r: dict) -> Answer:
        got = self.answers["get"]
        a = got({"op": "get", "id": r["id"], "items": True, "wait_ms": 0}) if callable(got) else got
        if a.status != 200 or not isinstance(a.body, dict):
            return a
        items = sorted(a.body.get("items") or [], key=lambda it: it.get("index", 0))
        n = a.body.get("items_total", len(items)) if not items else len(items)
        if r["op"] == "item":
            if r["index"] >= n:
                return Answer(404, {"error": f"job {r['id']} has {n} items: no item {r['index']}"})
            return Answer(200, items[r["index"]])
        lo, hi = r["from"], r["from"] + r["limit"]
        if r["op"] == "items":
            failed = [it for it in items if it.get("state") in ("failed", "timeout")]
            return Answer(200, {**a.body, "items": items[lo:hi], "items_from": lo,
                                "items_total": n, "failed_items": failed[:r["failed"]]})
        return Answer(200, {"n": n, "from": lo, "version": a.body.get("version", 1),
                            "digests": [None if it.get(r["stream"]) is None
                                        else bytes.fromhex(it[r["stream"]])
                                        for it in items[lo:hi]]})

    def last(self, by: bool = False) -> dict:
        """The last request; without `by`, less who asked (`by`, `by_role` on every change)."""
        req = self.requests[-1]
        return req if by else {k: v for k, v in req.items() if k not in ("by", "by_role")}

    def call(self, request: dict) -> concurrent.futures.Future:
        self.requests.append(request)
        fut: concurrent.futures.Future = concurrent.futures.Future()
        op = request["op"]
        if op in self.hang:
            return fut
        answer = self.answers[op]

        def settle() -> None:
            try:
                fut.set_result(answer(request) if callable(answer) else answer)
            except ControlError as e:
                fut.set_exception(e)

        if op in self.late_s:
            threading.Timer(self.late_s[op], settle).start()
        else:
            settle()
        return fut


class Server:
    def __init__(self, blobs: Any = None) -> None:
        self.control = RecordingControl()
        self.blobs = blobs if blobs is not None else MemoryBlobStore(chunk_bytes=1024)
        self.api = mhttp.HttpApi("127.0.0.1", 0, self.control, self.blobs, "m1")
        ready = threading.Event()
        self.thread = threading.Thread(target=self.api.run, args=(ready,), daemon=True)
        self.thread.start()
        assert ready.wait(10), "the HTTP server did not start"
        assert self.api.error is None
        self.port = self.api.bound_port

    def request(self, method: str, path: str, body: Any = None,
                headers: dict | None = None, raw: bytes | None = None) -> tuple[int, Any, bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        try:
            data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
            headers = dict(headers or {})
            if data is not None:
                headers.setdefault("Content-Type", "application/json")
            conn.request(method, path, body=data, headers=headers)
            resp = conn.getresponse()
            return resp.status, resp.headers, resp.read()
        finally:
            conn.close()

    def json(self, method: str, path: str, body: Any = None, **kw: Any) -> tuple[int, Any]:
        status, headers, data = self.request(method, path, body, **kw)
        assert headers["Content-Type"].startswith("application/json"), (status, data)
        return status, json.loads(data)

    def close(self) -> None:
        self.api.stop()
        self.thread.join(10)
        assert not self.thread.is_alive()


class LateDamageStore(MemoryBlobStore):
    """A store whose reader finds damage after its first chunk, as LMDB's does at the end."""

    def open(self, digest: str) -> Iterator[bytes] | None:
        chunks = super().open(digest)
        if chunks is None:
            return None

        def damaged() -> Iterator[bytes]:
            yield next(chunks)
            raise BlobCorrupt(digest)
        return damaged()


# --- The item driver on its own thread, as the jobs side runs it -----------------------------


class DriverHarness:
    """A `Driver` over `blobs` with its spool in `tmp_path`, run on a thread of its own (unless
    `run` is false: a test then starts it, or close() does); the items' ends arrive on a queue."""

    def __init__(self, tmp_path: Any, blobs: Any, run: bool = True, **driver_kw: Any) -> None:
        self.spool = tmp_path / "spool"
        self.blobs = blobs
        self.ends: queue.Queue[ItemEnded] = queue.Queue()
        self.driver = Driver(blobs, str(self.spool), self.ends.put, **driver_kw)
        self.thread = threading.Thread(target=self.driver.run, daemon=True)
        if run:
            self.thread.start()

    def end(self) -> ItemEnded:
        return self.ends.get(timeout=ITEM_WAIT_S)

    def spooled(self) -> list[str]:
        return sorted(os.listdir(self.spool))

    def live(self, key: tuple[str, int, int], stream: str = "stdout") -> bytes:
        got = self.driver.read_output(key, stream, 0, 1 << 30)
        return b"" if got is None else got[0]

    def size(self, key: tuple[str, int, int]) -> int:
        got = self.driver.read_output(key, "stdout", 0, 0)
        return 0 if got is None else got[1]

    def out(self, end: ItemEnded) -> bytes:
        assert end.stdout is not None
        return self.blobs.get(end.stdout) or b""

    def err(self, end: ItemEnded) -> str:
        assert end.stderr is not None
        return (self.blobs.get(end.stderr) or b"").decode()

    def close(self) -> None:
        self.driver.stop()
        if not self.thread.is_alive() and self.thread.ident is None:
            self.thread.start()
        self.thread.join(ITEM_WAIT_S)
        assert not self.thread.is_alive(), "run() did not return after stop()"


def alive(pid: int) -> bool:
    """Whether `pid` runs; a zombie waiting for its new parent to reap it is dead for our
    purposes."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


# --- Members' links on their own threads (tests of links and of what talks over them) --------

LINKS_SECRET = bytes(range(32))  # the fleet secret of in-process link tests
LINKS_WAIT_S = 30.0  # the longest a link test waits for a thread to end


class LinksMember:
    """A `Links` named `name` on its own thread, the frames it received and the peer events it
    saw. A part that talks over the links (item logs, the blob mover) subclasses it: it builds
    its part with `run=False`, routes frames by overriding `_on_frame`, appends its threads to
    `threads` and calls `start()`."""

    def __init__(self, name: str, listen: tuple[str, int] = ("127.0.0.1", 0),
                 boot: str | None = None, secret: bytes = LINKS_SECRET, run: bool = True,
                 **kw: Any) -> None:
        self.name = name
        self.frames: list[tuple[str, Frame]] = []
        self.events: list[tuple[str, bool, dict]] = []
        self._mu = threading.Lock()
        self.links = Links(name, boot or os.urandom(4).hex(), listen, secret,
                           on_frame=self._on_frame, on_peer=self._on_peer, **kw)
        self.threads = [threading.Thread(target=self.links.run, name=f"links-{name}", daemon=True)]
        if run:
            self.start()

    def start(self) -> None:
        for t in self.threads:
            t.start()

    @property
    def address(self) -> tuple[str, int]:
        return self.links.address

    def _on_frame(self, peer: str, frame: Frame) -> None:
        with self._mu:
            self.frames.append((peer, frame))

    def _on_peer(self, peer: str, up: bool, hello: dict) -> None:
        with self._mu:
            self.events.append((peer, up, hello))

    def got(self, peer: str, ftype: FrameType) -> list[dict]:
        with self._mu:
            return [f.body for p, f in self.frames if p == peer and f.type == ftype]

    def up(self, peer: str) -> bool:
        return bool(self.links.peers().get(peer, {}).get("up"))

    def stop(self) -> None:
        self.links.stop()
        for t in self.threads:
            t.join(timeout=LINKS_WAIT_S)
            assert not t.is_alive(), f"{t.name} did not end after stop()"


def worker_node(now_ms: int, voters: tuple[str, ...] = ("v1", "v2", "v3")) -> JobNode:
    """A worker member's node (w1, one slot) at `now_ms`, following v1, which leads at term 3
    and has just told it so; its effects so far taken."""
    cfg = NodeConfig(member="w1", boot="wb", pools={"default": Pool("default", slots=1)},
                     role="worker", voters=voters)
    node = JobNode(JobTable(), cfg, random.Random(3))
    node.step(Tick(now_ms))
    node.step(View())
    node.take()
    node.step(FrameIn("v1", "F_JOB_STATE", {"term": 3, "leader": "v1", "prev": 0, "entries": []}))
    node.take()
    return node
