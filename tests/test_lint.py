"""The code is ruff clean (the house settings in pyproject.toml)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_ruff_clean():
    """ruff check passes on every package, test and benchmark."""
    ruff = shutil.which("ruff")
    cmd = [ruff] if ruff else [sys.executable, "-m", "ruff"]
    try:
        r = subprocess.run([*cmd, "check", "meshjobs", "blobstore", "tests", "bench"],
                           cwd=ROOT, capture_output=True, text=True, timeout=120)
    except FileNotFoundError:
        pytest.fail("ruff is not installed: pip install '.[test]'")
    assert r.returncode == 0, r.stdout + r.stderr
