"""A port meshd cannot listen on (HTTP, member links, Raft), with real meshd processes and a
real socket holding the port: one log line and one stderr line naming the part, the address
and what to do, exit status 2 (ports.EXIT_CODE, as for a bad config), nothing written as ready
(no http.addr, no meshd_ready, no READY to systemd), and no traceback anywhere."""

from __future__ import annotations

import errno
import json
import os
import socket
import subprocess
import sys

import pytest

from meshjobs import ports
from tests.helpers import env_with_path, free_port

RUN_S_MAX = 120  # a meshd that cannot start exits long before this


def _held() -> socket.socket:
    """A listening socket on a loopback port of its own: that port is taken while it is open."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    return s


def _run(tmp_path, *args: str) -> subprocess.CompletedProcess:
    data = tmp_path / "d"
    data.mkdir(exist_ok=True)
    return subprocess.run([sys.executable, "-m", "meshjobs.daemon", "--data", str(data), *args],
                          capture_output=True, text=True, timeout=RUN_S_MAX, cwd=data,
                          env=env_with_path())


def _voter_config(tmp_path, raft: int, peer: int, http: int) -> str:
    """m1, one of three voters (the others need not run: m1 fails before it would need them)."""
    others = [(free_port(), free_port()) for _ in range(2)]
    lines = ['name = "m1"', f'data = "{tmp_path / "d"}"', "[fleet]", "voters = [",
             f'  {{name = "m1", raft = "127.0.0.1:{raft}", peer = "127.0.0.1:{peer}", '
             f'http = "127.0.0.1:{http}"}},']
    for k, (r, p) in enumerate(others, 2):
        lines.append(f'  {{name = "m{k}", raft = "127.0.0.1:{r}", peer = "127.0.0.1:{p}"}},')
    lines.append("]")
    (tmp_path / "d").mkdir(exist_ok=True)
    secret = tmp_path / "d" / "fleet.secret"
    secret.write_bytes(os.urandom(32))
    secret.chmod(0o600)
    path = tmp_path / "m1.toml"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def _says_it_cannot_listen(r: subprocess.CompletedProcess, tmp_path, part: str,
                           addr: str) -> dict:
    """Exit 2, the stderr line, the JSON log line; nothing ready; no traceback. The log line."""
    assert r.returncode == ports.EXIT_CODE, r.stderr
    name = ports.PARTS[part][0]
    said = [line for line in r.stderr.splitlines() if line.startswith("meshd: ")]
    assert said == [f"meshd: cannot listen on {name} address {addr}: another process listens on "
                    f"{addr} (ss -ltnp to see which; another meshd?); stop it, or set "
                    f"{ports.PARTS[part][1]} to a free port (or use --{part})"], r.stderr
    assert "Traceback" not in r.stderr and "Traceback" not in r.stdout
    logged = [json.loads(line) for line in r.stderr.splitlines() if line.startswith("{")]
    assert len(logged) == len(r.stderr.splitlines()) - 1  # every other line is a JSON log line
    events = [e["event"] for e in logged]
    assert "meshd_ready" not in events
    assert "fail_stop" not in events and "thread_ended" not in events
    assert not os.path.exists(tmp_path / "d" / "http.addr")
    failed = [e for e in logged if e["event"] == "listen_failed"]
    assert len(failed) == 1 and failed[0]["part"] == part and failed[0]["addr"] == addr
    return failed[0]


def test_http_port_taken_exits_2_and_says_what_to_do(tmp_path):
    """It used to log meshd_ready with port 0, then fail-stop with exit 71 and "check the
    disk"."""
    with _held() as s:
        port = s.getsockname()[1]
        r = _run(tmp_path, "--name", "m1", "--http", f"127.0.0.1:{port}",
                 "--raft", f"127.0.0.1:{free_port()}")
    _says_it_cannot_listen(r, tmp_path, "http", f"127.0.0.1:{port}")
    # It stopped cleanly, the journal closed: the stop's lines, in order.
    assert r.stderr.index("meshd_stopping") < r.stderr.index("meshd_stopped")


def test_a_voters_http_port_taken_exits_2(tmp_path):
    """A voter of three whose HTTP port (from its [fleet] voters entry) is taken."""
    with _held() as s:
        port = s.getsockname()[1]
        cfg = _voter_config(tmp_path, free_port(), free_port(), port)
        r = _run(tmp_path, "--config", cfg)
    _says_it_cannot_listen(r, tmp_path, "http", f"127.0.0.1:{port}")


def test_member_links_port_taken_exits_2(tmp_path):
    """It used to end in a traceback (OSError out of Links' constructor), exit 1."""
    with _held() as s:
        port = s.getsockname()[1]
        cfg = _voter_config(tmp_path, free_port(), port, 0)
        r = _run(tmp_path, "--config", cfg)
    _says_it_cannot_listen(r, tmp_path, "peer", f"127.0.0.1:{port}")


def test_raft_port_taken_exits_2_without_a_traceback_in_the_log(tmp_path):
    """pysyncobj's own line about it stays, as one JSON line without the traceback."""
    with _held() as s:
        port = s.getsockname()[1]
        r = _run(tmp_path, "--name", "m1", "--http", "127.0.0.1:0", "--raft", f"127.0.0.1:{port}")
    _says_it_cannot_listen(r, tmp_path, "raft", f"127.0.0.1:{port}")
    logged = [json.loads(line) for line in r.stderr.splitlines() if line.startswith("{")]
    pysyncobj = [e for e in logged if e.get("logger") == "pysyncobj.syncobj"]
    assert pysyncobj and all("exception" not in e for e in pysyncobj)
    assert "Address already in use" in pysyncobj[0]["event"]


def test_an_address_not_of_this_machine_says_so(tmp_path):
    """192.0.2.1 (TEST-NET-1) is no address of this machine: EADDRNOTAVAIL, said as such."""
    cfg = tmp_path / "m1.toml"
    cfg.write_text('name = "m1"\nhttp = "192.0.2.1:7700"\n[auth]\nallow_anonymous = true\n')
    r = _run(tmp_path, "--config", str(cfg), "--raft", f"127.0.0.1:{free_port()}")
    assert r.returncode == ports.EXIT_CODE, r.stderr
    assert ("meshd: cannot listen on HTTP address 192.0.2.1:7700: 192.0.2.1 is not an address "
            "of this machine; set [http] listen to one of its addresses") in r.stderr
    assert "Traceback" not in r.stderr


def test_a_host_name_that_does_not_resolve_says_so(tmp_path):
    cfg = tmp_path / "m1.toml"
    cfg.write_text('name = "m1"\nhttp = "nohost.invalid:7700"\n[auth]\nallow_anonymous = true\n')
    r = _run(tmp_path, "--config", str(cfg), "--raft", f"127.0.0.1:{free_port()}")
    assert r.returncode == ports.EXIT_CODE, r.stderr
    assert ("meshd: cannot listen on HTTP address nohost.invalid:7700: nohost.invalid does not "
            "resolve to an address") in r.stderr
    assert "set [http] listen to an IP address" in r.stderr and "Traceback" not in r.stderr


# --- the words, from real bind errors --------------------------------------------------------


def _bind_error(addr: tuple[str, int]) -> OSError:
    with socket.socket() as s:
        try:
            s.bind(addr)
        except OSError as e:
            return e
    raise AssertionError(f"{addr} could be bound")


def test_refusal_reads_the_errno_through_chained_exceptions():
    """pysyncobj raises its own exception from the transport's, raised from the OSError."""
    with _held() as held:
        err = _bind_error(held.getsockname())
    assert err.errno == errno.EADDRINUSE
    try:
        try:
            raise RuntimeError("transport not ready") from err
        except RuntimeError:
            raise ValueError("BindError")  # noqa: B904 (as pysyncobj does: context, no cause)
    except ValueError as e:
        wrapped = e
    assert ports.bind_error(wrapped) is err
    assert "another process listens on 127.0.0.1:5" in ports.refusal("raft", "127.0.0.1", 5,
                                                                      wrapped)


@pytest.mark.parametrize("exc,says", [
    (OSError(errno.EACCES, "Permission denied"), "port 80 needs privileges"),
    (OSError(errno.EADDRNOTAVAIL, "Cannot assign"), "10.9.9.9 is not an address of this machine"),
    (OSError(errno.EINVAL, "Invalid argument"), "Invalid argument; is another meshd running"),
    (None, "no reason given"),
    (ValueError("BindError"), "no reason given"),
])
def test_refusal_words(exc, says):
    text = ports.refusal("peer", "10.9.9.9", 80, exc)
    assert text.startswith("cannot listen on member links address 10.9.9.9:80: ")
    assert says in text and "(or use --peer)" in text


def test_an_ipv6_address_is_bracketed():
    assert ports.where("::1", 7700) == "[::1]:7700"
    assert ports.refusal("http", "::1", 7700, None).startswith(
        "cannot listen on HTTP address [::1]:7700: ")
