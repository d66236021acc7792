"""The installed package (what `pip install .` put in site-packages) has every module: the
quick start runs meshd from there, not from this checkout."""

from __future__ import annotations

import os
import pkgutil
import subprocess
import sys
import tempfile

import pytest

import meshjobs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _modules(package: str) -> list[str]:
    path = os.path.join(ROOT, package)
    return [package] + [f"{package}.{m.name}" for m in pkgutil.walk_packages([path])]


def test_installed_package_imports_every_module():
    """Outside the checkout, every module of meshjobs and blobstore imports from the installed
    distribution (a subpackage missing from the packaging fails here)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    with tempfile.TemporaryDirectory() as cwd:
        where = subprocess.run([sys.executable, "-c", "import meshjobs; print(meshjobs.__file__)"],
                               cwd=cwd, env=env, capture_output=True, text=True)
        if where.returncode != 0:
            pytest.skip("meshjobs is not installed (pip install '.[test]' installs it)")
        if where.stdout.strip().startswith(os.path.dirname(meshjobs.__file__)):
            pytest.skip("meshjobs is installed in development mode from this checkout")
        names = [n for n in _modules("meshjobs") + _modules("blobstore")]
        code = "import importlib, sys\nfor n in sys.argv[1:]:\n    importlib.import_module(n)\n"
        r = subprocess.run([sys.executable, "-c", code, *names], cwd=cwd, env=env,
                           capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
