"""`meshd check-config FILE`, run as the real command: every problem of a file at once, each
with its key and what to do, exit 2; a good file's summary, exit 0; hostile files (missing,
a folder, binary garbage, huge, not TOML, unreadable) are one clear problem, never a
traceback. `meshd --config` reads a file with the same code, so it says the same."""

from __future__ import annotations

import glob
import io
import os
import socket
import subprocess
import sys

import pytest

from meshjobs import limits
from meshjobs.checkconfig import check_config
from tests.helpers import ROOT, env_with_path

RUN_S_MAX = 60


def _check(path, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "meshjobs.daemon", "check-config", str(path)],
                          capture_output=True, text=True, timeout=RUN_S_MAX, cwd=cwd,
                          env=env_with_path())


def _problems(r: subprocess.CompletedProcess) -> list[str]:
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "Traceback" not in r.stderr
    assert r.stdout == ""
    lines = r.stderr.splitlines()
    assert lines[0].startswith("meshd check-config: ")
    return [line.removeprefix("  - ") for line in lines[1:]]


def test_a_good_voter_config_says_ok_with_a_summary(tmp_path):
    cfg = tmp_path / "m2.toml"
    cfg.write_text('name = "m2"\ndata = "d"\n[fleet]\nvoters = [\n'
                   '  {name = "m1", raft = "10.0.0.1:7702", peer = "10.0.0.1:7701"},\n'
                   '  {name = "m2", raft = "10.0.0.2:7702", peer = "10.0.0.2:7701"},\n'
                   '  {name = "m3", raft = "10.0.0.3:7702", peer = "10.0.0.3:7701"},\n]\n')
    r = _check(cfg, tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"ok: {cfg}: member m2, voter, voters m1, m2, m3;")
    assert f"data {tmp_path / 'd'}" in r.stdout
    assert not (tmp_path / "d").exists()  # checking starts nothing and writes nothing


def test_a_worker_config_names_its_role(tmp_path):
    cfg = tmp_path / "w1.toml"
    cfg.write_text('name = "w1"\n[fleet]\njoin = "10.0.0.1:7701"\n')
    r = _check(cfg, tmp_path)
    assert r.returncode == 0, r.stderr
    assert "member w1, worker, joins the fleet through 10.0.0.1:7701" in r.stdout


def test_every_problem_at_once_with_its_key(tmp_path):
    """Rule: all problems of the file, not the first one; each names its key path."""
    cfg = tmp_path / "bad.toml"
    cfg.write_text('name = "m1"\nbogus = 1\n[fleet]\nvoters = [\n'
                   '  {name = "a", raft = "h:1", peer = "h:2"},\n'
                   '  {name = "a", raft = "nope", peer = "h:3"},\n]\n'
                   '[pools.gpu]\nslots = "3"\n[http]\nlisten = "0.0.0.0:7700"\n')
    found = _problems(_check(cfg, tmp_path))
    text = "\n".join(found)
    assert len(found) >= 5, found
    assert "unknown key 'bogus'" in text
    assert "[pools.gpu] slots must be" in text
    assert "[fleet] voters[1].raft must be" in text
    assert "every voter needs its own name" in text
    assert "no [auth] table" in text  # 0.0.0.0 without tokens: what to add is said


@pytest.mark.parametrize("what,make,says", [
    ("missing", lambda p: None, "no config file at"),
    ("a folder", lambda p: p.mkdir(), "is a folder, not a config file"),
    ("binary garbage", lambda p: p.write_bytes(bytes(range(256)) * 8), "not UTF-8 text"),
    ("NUL bytes", lambda p: p.write_bytes(b'name = "m1"\x00\n'), "is not valid TOML"),
    ("not TOML", lambda p: p.write_text("name: m1\nhttp: [127.0.0.1\n"), "is not valid TOML"),
    ("JSON", lambda p: p.write_text('{"name": "m1"}'), "is not valid TOML"),
    ("huge", lambda p: p.write_bytes(b"# " + b"x" * limits.config_file_bytes_max + b"\n"),
     "config_file_bytes_max"),
    ("empty", lambda p: p.write_bytes(b""), "`name` is required"),
])
def test_hostile_files_are_one_clear_problem(tmp_path, what, make, says):
    path = tmp_path / "meshd.toml"
    make(path)
    found = _problems(_check(path, tmp_path))
    assert len(found) == 1 and says in found[0], (what, found)
    assert str(path) in found[0]


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads a file whatever its mode")
def test_an_unreadable_file_says_to_check_its_permissions(tmp_path):
    path = tmp_path / "meshd.toml"
    path.write_text('name = "m1"\n')
    path.chmod(0)
    found = _problems(_check(path, tmp_path))
    assert "permissions" in found[0]


def test_a_socket_instead_of_a_file_is_one_clear_problem(tmp_path):
    """Not a regular file (open fails with ENXIO, whoever runs it): said, not a traceback."""
    path = tmp_path / "meshd.toml"
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(path))
        found = _problems(_check(path, tmp_path))
    assert found == [f"cannot read the config file {path}: No such device or address: name a "
                     "regular file meshd's user can read (check its permissions)"]


def test_meshd_config_with_a_folder_exits_2_without_a_traceback(tmp_path):
    """meshd itself reads the file with the same code (it used to raise IsADirectoryError)."""
    r = subprocess.run([sys.executable, "-m", "meshjobs.daemon", "--config", str(tmp_path)],
                       capture_output=True, text=True, timeout=RUN_S_MAX, cwd=tmp_path,
                       env=env_with_path())
    assert r.returncode == 2, r.stderr
    assert r.stderr == f"meshd: {tmp_path} is a folder, not a config file: name the TOML file in it\n"


def test_check_config_needs_a_file(tmp_path):
    r = subprocess.run([sys.executable, "-m", "meshjobs.daemon", "check-config"],
                       capture_output=True, text=True, timeout=RUN_S_MAX, cwd=tmp_path,
                       env=env_with_path())
    assert r.returncode == 2
    assert "FILE" in r.stderr and "Traceback" not in r.stderr


DEPLOY_TOMLS = sorted(glob.glob(os.path.join(ROOT, "deploy", "**", "*.toml"), recursive=True))


@pytest.mark.parametrize("path", DEPLOY_TOMLS, ids=lambda p: os.path.relpath(p, ROOT))
def test_every_shipped_config_checks_ok(path):
    """The example configs of deploy/ are good (the function the command runs, in-process)."""
    out, err = io.StringIO(), io.StringIO()
    assert check_config(path, out, err) == 0, err.getvalue()
    assert out.getvalue().startswith(f"ok: {path}: member ")


def test_there_are_shipped_configs():
    assert len(DEPLOY_TOMLS) >= 3


def test_help_names_the_command(tmp_path):
    r = subprocess.run([sys.executable, "-m", "meshjobs.daemon", "--help"], capture_output=True,
                       text=True, timeout=RUN_S_MAX, cwd=tmp_path, env=env_with_path())
    assert r.returncode == 0 and "check-config" in r.stdout and "--version" in r.stdout
