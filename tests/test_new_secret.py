"""`meshd new-secret PATH`: the first member of a new fleet gets its secret from meshd itself
(32 random bytes, mode 0600), an existing file is never overwritten, and the error of a member
started without a secret names the command."""

from __future__ import annotations

import os
import stat
import subprocess
import sys

from tests.helpers import env_with_path, make_fleet


def _meshd(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "meshjobs.daemon", *args], capture_output=True,
                          timeout=60, env=env_with_path(), text=True)


def test_new_secret_writes_32_private_bytes(tmp_path) -> None:
    path = tmp_path / "fleet.secret"
    r = _meshd("new-secret", str(path))
    assert r.returncode == 0, r.stderr
    assert f"wrote a new fleet secret to {path}" in r.stderr
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert len(path.read_bytes()) == 32
    other = tmp_path / "other.secret"
    assert _meshd("new-secret", str(other)).returncode == 0
    assert other.read_bytes() != path.read_bytes()  # random, not a constant
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fleet.secret", "other.secret"]


def test_new_secret_never_overwrites(tmp_path) -> None:
    path = tmp_path / "fleet.secret"
    path.write_bytes(b"k" * 32)
    os.chmod(path, 0o600)
    r = _meshd("new-secret", str(path))
    assert r.returncode == 2
    assert f"meshd: {path} exists already: not overwritten" in r.stderr
    assert "Traceback" not in r.stderr
    assert path.read_bytes() == b"k" * 32
    assert [p.name for p in tmp_path.iterdir()] == ["fleet.secret"]  # no temporary file left
    r = _meshd("new-secret", str(tmp_path / "no" / "such" / "folder" / "fleet.secret"))
    assert r.returncode == 2 and "cannot write a fleet secret" in r.stderr


def test_first_voter_starts_with_a_new_secret(tmp_path) -> None:
    """The first voter of a new fleet, with no secret: its error names `meshd new-secret`; after
    it, the voter starts and is ready."""
    (m,) = make_fleet(str(tmp_path), voters=1)
    path = os.path.join(m.data, "fleet.secret")
    os.unlink(path)
    try:
        m.start(wait_ready=False)
        assert m.proc is not None
        assert m.proc.wait(timeout=60) == 2
        assert f"`meshd new-secret {path}`" in m.log_tail()
        r = _meshd("new-secret", path)
        assert r.returncode == 0, r.stderr
        m.start()
        status, health = m.request("GET", "/healthz")
        assert status == 200 and health["ready"], health
    finally:
        m.stop()
