"""meshd's start and stop as named steps (daemon.Member.serve): the steps in order, each said
in a docstring, and, against real meshd processes, what a step that cannot start the member
says and exits with, and a clean stop's order."""

from __future__ import annotations

import ast
import inspect
import os
import signal
import socket
import subprocess
import sys
import textwrap

from meshjobs import daemon
from tests.helpers import Meshd, env_with_path

STEPS = ["_open_tls", "_end_leftovers", "_open_secret", "_watch_disk", "_find_voters", "_open_blobs",
         "_build_node", "_build_replica", "_build_parts", "_start_threads", "_write_addr_files",
         "_wait", "_shut_down"]
RUN_S_MAX = 120  # a meshd that cannot start exits long before this


def _method(name: str) -> ast.FunctionDef:
    tree = ast.parse(textwrap.dedent(inspect.getsource(getattr(daemon.Member, name))))
    fn = tree.body[0]
    assert isinstance(fn, ast.FunctionDef)
    return fn


def test_serve_is_its_steps_in_order():
    """serve calls the steps, in order, and does little else; each step says what it does."""
    fn = _method("serve")
    calls = [n for n in ast.walk(fn) if isinstance(n, ast.Call)
             and isinstance(n.func, ast.Attribute) and n.func.attr in STEPS]
    called = [n.func.attr for n in sorted(calls, key=lambda n: (n.lineno, n.col_offset))]
    assert called == STEPS
    assert fn.end_lineno - fn.lineno < 30
    for name in STEPS:
        step = _method(name)
        assert ast.get_docstring(step), name
        assert step.end_lineno - step.lineno < 80, name


def _run_meshd(data: str, raft_port: int, *extra: str) -> subprocess.CompletedProcess:
    os.makedirs(data, exist_ok=True)
    return subprocess.run(
        [sys.executable, "-m", "meshjobs.daemon", "--data", data, "--name", "m1",
         "--http", "127.0.0.1:0", "--raft", f"127.0.0.1:{raft_port}", *extra],
        capture_output=True, text=True, timeout=RUN_S_MAX, cwd=data, env=env_with_path())


def _taken_port() -> socket.socket:
    """A listening socket on a port of its own: a Raft port no meshd can take (the members
    that fail before Raft never reach it)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    return s


def test_raft_port_taken_exits_2_and_says_what_to_do(tmp_path):
    with _taken_port() as s:
        r = _run_meshd(str(tmp_path / "d"), s.getsockname()[1])
    assert r.returncode == 2, r.stderr
    assert "meshd: cannot listen on Raft address 127.0.0.1:" in r.stderr
    assert "use --raft" in r.stderr


def test_a_secret_others_may_read_exits_2(tmp_path):
    data = tmp_path / "d"
    data.mkdir()
    secret = data / "fleet.secret"
    secret.write_bytes(bytes(32))
    secret.chmod(0o644)
    with _taken_port() as s:
        r = _run_meshd(str(data), s.getsockname()[1])
    assert r.returncode == 2, r.stderr
    assert "is readable by others" in r.stderr and "chmod 600" in r.stderr


def test_a_certificate_that_does_not_load_exits_2(tmp_path):
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert.write_text("not a certificate\n")
    key.write_text("not a key\n")
    cfg = tmp_path / "m1.toml"
    cfg.write_text(f'name = "m1"\n[http]\ntls_cert = "{cert}"\ntls_key = "{key}"\n')
    with _taken_port() as s:
        r = _run_meshd(str(tmp_path / "d"), s.getsockname()[1], "--config", str(cfg))
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith("meshd: ") and "Traceback" not in r.stderr
    assert not os.path.exists(tmp_path / "d" / "fleet.secret")  # it stopped before the secret


def test_clean_stop_in_order(tmp_path):
    """Started, the member writes http.addr and says it is ready; SIGTERM stops it with exit 0,
    saying it stops, then that it stopped (after the journal and the blob store are closed)."""
    m = Meshd(str(tmp_path / "m1"))
    try:
        m.start()
        with open(os.path.join(m.data, "http.addr")) as f:
            assert f.read().strip() == m.url.removeprefix("http://")
        m.proc.send_signal(signal.SIGTERM)
        assert m.proc.wait(RUN_S_MAX) == 0
        text = m.log_tail(1 << 20)
        ready, stopping, stopped = (text.index(w) for w in
                                    ("meshd_ready", "meshd_stopping", "meshd_stopped"))
        assert ready < stopping < stopped
    finally:
        m.stop()
