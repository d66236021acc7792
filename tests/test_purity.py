"""The pure core stays pure: a static check of meshjobs.table, meshjobs.node, meshjobs.control,
meshjobs.auth (who may ask a member what), meshjobs.watchplan (what `meshctl watch` submits), meshjobs.webui (the web pages), meshjobs.connbook (HTTP connection bookkeeping), meshjobs.frames (the member
links' handshake, sealing and bodies in parts), meshjobs.raftseam (what the Raft seam lets
through) and meshjobs.sim (the seeded simulator, which makes its generators from its seed).

Rule (STYLE.md): the job node, the job table and control parsing import no `os`, `socket`,
`threading`, `time`, `random`, `lmdb`, `pysyncobj` or `subprocess`. The node may import `random`
for the type of its injected generator only: it never calls a module-level `random` function and
never makes a generator of its own; the simulator makes its generators only from a seed
(`random.Random(seed)`, one argument), never from the system's entropy. The check reads the source with `ast`, so it fails as soon as
someone adds such an import or use, wherever in the module it is.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import meshjobs

PURE = ("table", "node", "control", "auth", "connbook", "frames", "raftseam", "raftwire", "webui",
        "bulk", "placement", "fleetctl", "reruns", "cron", "watchplan", "jsonbody", "compact",
        "sim", "blobxfer", "ports", "versions", "identity",
        "quotas", "dumpbytes", "waits")
FORBIDDEN = frozenset({
    "os", "socket", "threading", "time", "random", "lmdb", "pysyncobj", "subprocess",
    # Other ways to reach the world, the clock or entropy from a module that must not.
    "uuid", "secrets", "select", "selectors", "signal", "asyncio", "multiprocessing",
    "concurrent", "shutil", "pathlib", "_thread",
})
# The pure modules may lean on each other and on the limits, and on nothing else of meshjobs.
PURE_SIBLINGS = frozenset({"meshjobs", "meshjobs.limits", "meshjobs.table", "meshjobs.control",
                           "meshjobs.compact", "meshjobs.blobxfer", "meshjobs.blobxfer.wire",
                           "meshjobs.blobxfer.send", "meshjobs.blobxfer.recv",
                           "meshjobs.frames", "meshjobs.bulk", "meshjobs.placement",
                           "meshjobs.cron", "meshjobs.identity", "meshjobs.dumpbytes",
                           "meshjobs.node", "meshjobs.node.events", "meshjobs.node.core",
                           "meshjobs.node.leader", "meshjobs.node.follow",
                           "meshjobs.node.feed", "meshjobs.fleetctl", "meshjobs.node.hooks",
                           "meshjobs.node.ready", "meshjobs.node.proposals",
                           "meshjobs.node.catchup", "meshjobs.node.copies", "meshjobs.node.changes",
                           "meshjobs.node.storage", "meshjobs.node.members",
                           "meshjobs.node.heard",
                           "meshjobs.node.runs", "meshjobs.node.clock",
                           "meshjobs.reruns", "meshjobs.quotas", "meshjobs.waits", "meshjobs.watchplan",
                           "meshjobs.watchplan.config",
                           "meshjobs.watchplan.plan"})
# What a module may use of `random`: the type name, never a call.
RANDOM_TYPE_ONLY = {"node": {"Random"}, "sim": {"Random"}}
# Modules that may also make a generator from a seed: `random.Random(x)`, exactly one argument.
SEEDED_RANDOM = frozenset({"sim"})


def violations(source: str, module: str) -> list[str]:
    """Every impure import or use in `source` (the text of meshjobs.<module>)."""
    tree = ast.parse(source)
    allowed_random = RANDOM_TYPE_ONLY.get(module, set())
    found: list[str] = []
    aliases: dict[str, str] = {}  # local name -> forbidden module it stands for
    called: set[int] = set()
    seeded: set[int] = set()  # calls with exactly one positional argument (a seed)
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            called.add(id(node.func))
            if len(node.args) == 1 and not node.keywords and not isinstance(node.args[0],
                                                                               ast.Starred):
                seeded.add(id(node.func))
            f = node.func
            name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
            if name in ("__import__", "import_module", "eval", "exec"):
                found.append(f"line {node.lineno}: calls {name}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                top = a.name.split(".")[0]
                if top == "importlib":
                    found.append(f"line {node.lineno}: imports importlib")
                if top in FORBIDDEN:
                    aliases[(a.asname or top)] = top
                    if not (top == "random" and allowed_random and a.name == "random"):
                        found.append(f"line {node.lineno}: imports {a.name}")
                if top == "meshjobs" and a.name not in PURE_SIBLINGS:
                    found.append(f"line {node.lineno}: imports impure {a.name}")
        elif isinstance(node, ast.ImportFrom):
            mod = node.module or ""
            top = mod.split(".")[0]
            if top in FORBIDDEN or top == "importlib":
                found.append(f"line {node.lineno}: imports from {mod}")
            if top == "meshjobs":
                for a in node.names:
                    full = mod if mod != "meshjobs" else f"meshjobs.{a.name}"
                    if full not in PURE_SIBLINGS:
                        found.append(f"line {node.lineno}: imports impure {full}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            target = aliases.get(node.value.id)
            if target is None:
                continue
            if target == "random" and node.attr in allowed_random and id(node) not in called:
                continue  # the injected generator's type, in an annotation
            if (target == "random" and node.attr == "Random" and module in SEEDED_RANDOM
                    and id(node) in seeded):
                continue  # a generator made from a seed: replayable
            found.append(f"line {node.lineno}: uses {node.value.id}.{node.attr}")
        elif isinstance(node, ast.Name) and node.id in aliases and id(node) in called:
            found.append(f"line {node.lineno}: calls {node.id}")
    return found


def sources_of(module: str) -> list[str]:
    """The source of meshjobs.<module>: one file, or every file of the package."""
    base = Path(meshjobs.__file__).parent
    single = base / f"{module}.py"
    if single.exists():
        return [single.read_text()]
    files = sorted((base / module).glob("*.py"))
    assert files, f"no source for meshjobs.{module}"
    return [f.read_text() for f in files]


@pytest.mark.parametrize("module", PURE)
def test_pure_module_touches_no_world(module: str) -> None:
    """Pure core: no IO, clock, threads or module-level randomness in meshjobs.<module>."""
    for source in sources_of(module):
        assert violations(source, module) == []


def test_pure_modules_import_no_impure_meshjobs() -> None:
    """Pure core: what the pure modules import of meshjobs is pure too (checked the same way)."""
    imported = set()
    for module in PURE:
        for source in sources_of(module):
            for node in ast.walk(ast.parse(source)):
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("meshjobs"):
                    imported.add(node.module)
    assert imported <= PURE_SIBLINGS


@pytest.mark.parametrize("source,module", [
    ("import time\n", "table"),
    ("import os.path\n", "control"),
    ("from time import monotonic\n", "node"),
    ("import socket as s\n", "table"),
    ("def f():\n    import threading\n", "table"),
    ("import random\n", "table"),
    ("import random\nx = random.random()\n", "node"),
    ("import random\nrng = random.Random()\n", "node"),
    ("import random\nrandom.seed(1)\n", "node"),
    ("from random import Random\n", "node"),
    ("import random as r\nr.choice([1])\n", "node"),
    ("import lmdb\n", "table"),
    ("from pysyncobj import SyncObj\n", "node"),
    ("import subprocess\n", "control"),
    ("x = __import__('os')\n", "table"),
    ("import importlib\n", "table"),
    ("from meshjobs import driver\n", "node"),
    ("from meshjobs.jobsd import JobsThread\n", "node"),
    ("import random\nrng = random.Random()\n", "sim"),
    ("import random\nrng = random.Random(*seeds)\n", "sim"),
    ("import random\nrng = random.Random(x=1)\n", "sim"),
    ("import random\nx = random.random()\n", "sim"),
    ("import random\nrandom.seed(1)\n", "sim"),
    ("import time\n", "sim"),
    ("from meshjobs import driver\n", "sim"),
])
def test_checker_catches_impurity(source: str, module: str) -> None:
    """The checker itself: each of these impure sources is caught (so the test above can fail)."""
    assert violations(source, module) != []


@pytest.mark.parametrize("source,module", [
    ("import random\n\ndef f(rng: random.Random) -> None:\n    rng.random()\n", "node"),
    ("from meshjobs import limits\nfrom meshjobs.table import JobTable\n", "node"),
    ("import re\nfrom array import array\n", "table"),
    ("import random\nrng = random.Random(seed)\nr2 = random.Random(rng.getrandbits(64))\n",
     "sim"),
])
def test_checker_allows_pure(source: str, module: str) -> None:
    """The checker itself: pure sources, the injected generator's type included, pass."""
    assert violations(source, module) == []


# What the pure modules may take of blobstore: its digests (re and blake3) and its named limits,
# nothing that stores.
PURE_BLOBSTORE = frozenset({"blobstore.digest", "blobstore.limits"})


def test_pure_modules_take_only_digests_of_blobstore() -> None:
    """Pure core: of blobstore, the pure modules import its digests and limits only, both pure."""
    imported = set()
    for module in PURE:
        for source in sources_of(module):
            for node in ast.walk(ast.parse(source)):
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("blobstore"):
                    imported.add(node.module)
                elif isinstance(node, ast.Import):
                    imported |= {a.name for a in node.names if a.name.startswith("blobstore")}
    assert imported <= PURE_BLOBSTORE
    import blobstore.digest
    import blobstore.limits
    for mod in (blobstore.digest, blobstore.limits):
        assert violations(Path(mod.__file__).read_text(), mod.__name__.rsplit(".", 1)[1]) == []


def test_importing_the_pure_core_loads_no_store_or_raft() -> None:
    """Pure core: importing the pure modules (blobstore.digest included) loads no LMDB, no
    pysyncobj and none of blobstore's stores, in a fresh interpreter."""
    import subprocess
    import sys

    mods = ", ".join(f"meshjobs.{m}" for m in PURE)
    code = (f"import sys, {mods}\n"
            "print(sorted(m for m in ('lmdb', 'pysyncobj', 'blobstore.store', 'blobstore.writers',"
            " 'blobstore.memory') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=Path(meshjobs.__file__).parent.parent)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
