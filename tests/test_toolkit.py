"""The test toolkit's own rules, checked over every test module's syntax tree:

- Rule 1: shared test code lives in tests/helpers.py; no test module imports another test module
  (a harness copied or borrowed from a neighbour is how `wait_for` came to be written five times).
- Rule 2: a test waits on a condition (helpers.wait_until, an event, a counter), never a fixed
  sleep. A `time.sleep(` call outside helpers.py must say why it is not a wait on the same line:
  `# sleep-ok: <reason>` (a sampling interval, a sender's pace, a kill at a random moment).

Code inside strings (scripts a test runs in a child process) is not a call of the test's own and
is not looked at.
"""

from __future__ import annotations

import ast
import os
import socket

import pytest

from tests.helpers import Meshd, leader_of, listening_addrs, make_fleet, start_all, wait_until

TESTS = os.path.dirname(os.path.abspath(__file__))
SLEEP_OK = "# sleep-ok:"


def _modules() -> list[str]:
    return sorted(os.path.join(TESTS, n) for n in os.listdir(TESTS) if n.endswith(".py"))


def imported_test_modules(source: str) -> list[tuple[int, str]]:
    """(line, module) of every import of a test module (tests.test_x, .test_x, test_x)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = ("." * node.level) + (node.module or "")
            sep = "" if base.endswith(".") else "."
            names = [base, *(f"{base}{sep}{a.name}" for a in node.names)]
        else:
            continue
        for name in names:
            if any(part.startswith("test_") for part in name.split(".")):
                found.append((node.lineno, name))
                break
    return found


def bare_sleeps(source: str) -> list[int]:
    """Lines with a call of time.sleep (or a `sleep` imported from time) that do not carry
    the sleep-ok marker."""
    tree = ast.parse(source)
    lines = source.splitlines()
    sleep_names = {a.asname or a.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                   and node.module == "time" for a in node.names if a.name == "sleep"}
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        is_sleep = ((isinstance(f, ast.Attribute) and f.attr == "sleep"
                     and isinstance(f.value, ast.Name) and f.value.id == "time")
                    or (isinstance(f, ast.Name) and f.id in sleep_names))
        if is_sleep and SLEEP_OK not in lines[node.lineno - 1]:
            out.append(node.lineno)
    return sorted(out)


def test_no_test_module_imports_another() -> None:
    """Rule 1: what two test modules share is in tests/helpers.py."""
    bad = []
    for path in _modules():
        with open(path) as f:
            for line, name in imported_test_modules(f.read()):
                bad.append(f"{os.path.basename(path)}:{line} imports {name}")
    assert not bad, "move what is shared into tests/helpers.py:\n" + "\n".join(bad)


def test_no_bare_sleeps_outside_helpers() -> None:
    """Rule 2: outside helpers.py every time.sleep says why it is not a wait (sleep-ok)."""
    bad = []
    for path in _modules():
        if os.path.basename(path) == "helpers.py":
            continue
        with open(path) as f:
            for line in bare_sleeps(f.read()):
                bad.append(f"{os.path.basename(path)}:{line}")
    assert not bad, ("wait on a condition (tests/helpers.py wait_until), or mark the line "
                     f"'{SLEEP_OK} <reason>':\n" + "\n".join(bad))


@pytest.mark.parametrize("source, expected", [
    ("from tests.test_table import Log\n", [(1, "tests.test_table")]),
    ("import tests.test_node\n", [(1, "tests.test_node")]),
    ("from tests import test_http\n", [(1, "tests.test_http")]),
    ("from .test_fleet import wait_for\n", [(1, ".test_fleet")]),
    ("def f():\n    from tests.test_x import y\n", [(2, "tests.test_x")]),
    ("from tests.helpers import wait_until\n", []),
    ("code = 'from tests.test_sim import _outcome'\n", []),  # a child's script, not an import
])
def test_the_import_rule_sees(source: str, expected: list) -> None:
    """Rule 1's checker finds imports of test modules in every spelling, and only those."""
    assert imported_test_modules(source) == expected


@pytest.mark.parametrize("source, expected", [
    ("import time\ntime.sleep(0.5)\n", [2]),
    ("from time import sleep\nsleep(1)\n", [2]),
    ("from time import sleep as nap\nnap(1)\n", [2]),
    ("import time\ntime.sleep(0.01)  # sleep-ok: the sampling interval\n", []),
    ("script = 'import time; time.sleep(60)'\n", []),  # the child's sleep is the thing tested
    ("import asyncio\nasyncio.sleep(1)\n", []),
])
def test_the_sleep_rule_sees(source: str, expected: list) -> None:
    """Rule 2's checker finds a fixed sleep however it is imported, and lets a marked one be."""
    assert bare_sleeps(source) == expected


# --- Ports: bound by meshd where they need not be known, retried where they must be -----------


def _taken_port() -> socket.socket:
    """A listening socket on a loopback port: that port is taken for as long as it is open."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(1)
    return s


def test_meshd_binds_its_http_port_and_the_harness_reads_it(meshd) -> None:
    """Rule 3: a member's HTTP port is bound by meshd itself (port 0) and read from the
    http.addr file it writes; no port is probed for it beforehand."""
    assert meshd.http == "127.0.0.1:0"
    with open(os.path.join(meshd.data, "http.addr")) as f:
        assert f"http://{f.read().strip()}" == meshd.url
    port = int(meshd.url.rsplit(":", 1)[1])
    assert port != 0 and ("127.0.0.1", port) in listening_addrs(meshd.pid)


def test_a_taken_raft_port_is_retried_on_a_fresh_one(meshd_factory) -> None:
    """Rule 3: a Raft port taken between the probe and meshd's bind makes meshd exit saying so;
    the harness starts it again on a fresh port instead of failing the test."""
    with _taken_port() as taken:
        m = meshd_factory(start=False)
        m.raft_port = taken.getsockname()[1]
        m.start()
        assert m.raft_port != taken.getsockname()[1]
        assert ("127.0.0.1", m.raft_port) in listening_addrs(m.pid)
    with open(m.log_path, "rb") as f:
        assert b"cannot listen on Raft address" in f.read()


def _occupy(m: Meshd, key: str, old: int, new: int) -> None:
    """Give `m` port `new` for `key` in its config instead of `old`."""
    assert m.config is not None
    with open(m.config) as f:
        text = f.read()
    line = f'{key} = "127.0.0.1:{old}"'
    assert line in text, (line, text)
    with open(m.config, "w") as f:
        f.write(text.replace(line, f'{key} = "127.0.0.1:{new}"'))
    setattr(m, f"{key}_port", new)


@pytest.mark.fleet
def test_a_taken_fleet_port_restarts_the_fleet_on_fresh_ones(tmp_path) -> None:
    """Rule 3: in a fleet the ports are in every member's config, so a taken one (a voter's
    Raft port, a worker's member-links port) restarts the whole fleet on fresh ports."""
    members = make_fleet(str(tmp_path), voters=1, workers=1)
    v1, w1 = members
    try:
        with _taken_port() as raft, _taken_port() as peer:
            # The configs as make_fleet wrote them, but with two ports someone else holds.
            _occupy(v1, "raft", v1.raft_port, raft.getsockname()[1])
            _occupy(w1, "peer", w1.peer_port, peer.getsockname()[1])
            start_all(members)
            assert v1.raft_port != raft.getsockname()[1] and w1.peer_port != peer.getsockname()[1]
        leader = leader_of(members)
        assert leader is v1
        wait_until(lambda: any(x["name"] == "w1" and x["alive"]
                               for x in v1.request("GET", "/fleet")[1]["members"]),
                   what="the worker joined")
    finally:
        for m in members:
            m.stop()
