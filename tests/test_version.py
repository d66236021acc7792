"""`meshd --version` and `meshctl --version`: the package's version, exit 0, from the real
commands; the version constant of the source tree is pyproject.toml's."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import meshjobs
from tests.helpers import ROOT, env_with_path

RUN_S_MAX = 60


def _run(module: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True,
                          timeout=RUN_S_MAX, env=env_with_path(), cwd=ROOT)


def test_the_source_version_is_pyprojects():
    project = tomllib.loads((Path(ROOT) / "pyproject.toml").read_text())["project"]
    assert meshjobs.__version__ == project["version"]
    assert meshjobs.version() == project["version"]  # installed from this tree (pip install .)


def test_meshd_version_prints_it_and_exits_0():
    r = _run("meshjobs.daemon", "--version")
    assert r.returncode == 0, r.stderr
    assert r.stdout == f"meshd, version {meshjobs.version()}\n"


def test_meshctl_version_prints_it_and_exits_0():
    r = _run("meshjobs.cli", "--version")
    assert r.returncode == 0, r.stderr
    assert r.stdout == f"meshctl, version {meshjobs.version()}\n"


def test_the_version_without_the_package_installed_is_the_constant(tmp_path):
    """A source tree run without `pip install`: the package copied alone to a folder, run with
    python -S (no site-packages, so no installed meshjobs and no metadata of it)."""
    shutil.copytree(Path(meshjobs.__file__).parent, tmp_path / "meshjobs",
                    ignore=shutil.ignore_patterns("__pycache__"))
    code = ("import importlib.metadata as m, meshjobs\n"
            "try:\n"
            "    m.version('meshjobs')\n"
            "    print('installed')\n"
            "except m.PackageNotFoundError:\n"
            "    print(meshjobs.version())\n")
    r = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True,
                       timeout=RUN_S_MAX, env={**os.environ, "PYTHONPATH": str(tmp_path)},
                       cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == meshjobs.__version__
