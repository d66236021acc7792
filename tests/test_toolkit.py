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

import pytest

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
