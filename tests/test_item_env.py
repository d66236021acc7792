"""Items see a minimal environment, not meshd's: real meshd processes started with secrets in
their own environment run `env` (a command item) and a python function reading os.environ, and
neither sees the secrets; `[items] env_pass` chooses what passes; bad values are refused."""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import pytest

from meshjobs.itemenv import DEFAULT_PASS, DEFAULT_PATH, base_env
from tests.helpers import Meshd

SECRETS = {"MESHJOBS_TOKEN": "s3cret-token", "AWS_SECRET_ACCESS_KEY": "aws-s3cret-key"}


def _env_lines(text: str) -> dict[str, str]:
    out = {}
    for line in text.splitlines():
        k, sep, v = line.partition("=")
        if sep:
            out[k] = v
    return out


def _run_env(m: Meshd, *extra: str) -> dict[str, str]:
    """Submit `env` as a job of the default (command) pool and return what it printed."""
    r = m.ctl("job", "submit", "--env", "JOB_OWN=mine", *extra, "--", "env")
    assert r.returncode == 0, r.stderr
    job = r.stdout.decode().strip()
    rec = m.wait_job(job)
    assert rec["state"] == "done", rec
    r = m.ctl("job", "results", job)
    assert r.returncode == 0, r.stderr
    return _env_lines(r.stdout.decode())


def _start(tmp_path: Path, text: str, env: dict[str, str]) -> Meshd:
    cfg = tmp_path / "meshd.toml"
    cfg.write_text(text)
    return Meshd(str(tmp_path / "m1"), config=str(cfg), env=env)


# --- The pure part ------------------------------------------------------------------------------


@pytest.mark.parametrize("environ,passed,want", [
    ({"PATH": "/x", "HOME": "/h", "TOKEN": "s"}, DEFAULT_PASS, {"PATH": "/x", "HOME": "/h"}),
    ({"TOKEN": "s"}, DEFAULT_PASS, {"PATH": DEFAULT_PATH}),
    ({"LC_ALL": "C", "LC_TIME": "C", "LCX": "no", "LANG": "C.UTF-8"}, DEFAULT_PASS,
     {"LC_ALL": "C", "LC_TIME": "C", "LANG": "C.UTF-8", "PATH": DEFAULT_PATH}),
    ({"PATH": "/x", "HOME": "/h", "A": "1"}, ("A",), {"A": "1", "PATH": DEFAULT_PATH}),
    ({"TOOL_A": "1", "TOOL_B": "2", "TOOLX": "3"}, ("TOOL_*",),
     {"TOOL_A": "1", "TOOL_B": "2", "PATH": DEFAULT_PATH}),
    ({"PATH": "/x"}, (), {"PATH": DEFAULT_PATH}),
])
def test_base_env_passes_only_what_is_named(environ, passed, want):
    """Only the named variables (and prefixes ending in '*') pass; PATH is always set."""
    assert base_env(environ, passed) == want


# --- A real member ------------------------------------------------------------------------------


@pytest.mark.fleet
def test_command_item_does_not_see_meshd_secrets(meshd_factory):
    """meshd started with a token and a cloud key in its environment: `env` run as an item
    prints PATH, the job's own --env and MESH_*, and neither secret."""
    m = meshd_factory(env={**SECRETS, "PATH": os.environ["PATH"], "LANG": "C.UTF-8"})
    got = _run_env(m)
    assert got["PATH"] == os.environ["PATH"] and got["LANG"] == "C.UTF-8"
    assert got["JOB_OWN"] == "mine" and got["MESH_ITEM_INDEX"] == "0" and got["MESH_JOB_ID"]
    for name, value in SECRETS.items():
        assert name not in got
        assert value not in "".join(f"{k}={v}\n" for k, v in got.items())
    # Nothing of the test harness's own environment either, but the allowed names.
    allowed = {"PATH", "HOME", "USER", "LOGNAME", "LANG", "TZ", "TMPDIR", "JOB_OWN", "PWD",
               "SHLVL", "_", "MESH_JOB_ID", "MESH_ITEM_INDEX", "MESH_LEASE_EPOCH",
               "MESH_MEMBER"}
    assert {k for k in got if not k.startswith("LC_")} <= allowed, got


@pytest.mark.fleet
def test_env_pass_chooses_what_items_see(tmp_path):
    """`[items] env_pass` replaces the default list: a named variable and a prefix pass, meshd's
    HOME (not named) and the secrets do not; PATH is set all the same."""
    m = _start(tmp_path, 'name = "m1"\n[items]\nenv_pass = ["CHOSEN", "TOOL_*"]\n',
               {**SECRETS, "CHOSEN": "yes", "TOOL_A": "1", "TOOL_B": "2", "HOME": "/home/x"})
    try:
        m.start()
        got = _run_env(m)
        assert got["CHOSEN"] == "yes" and got["TOOL_A"] == "1" and got["TOOL_B"] == "2"
        assert got["PATH"] == DEFAULT_PATH and got["JOB_OWN"] == "mine"
        # HOME is not meshd's: an item run as the item user gets that user's (runas rule 3).
        assert got.get("HOME") != "/home/x" and not set(SECRETS) & set(got)
    finally:
        m.stop()


@pytest.mark.fleet
def test_python_item_does_not_see_meshd_secrets(tmp_path):
    """A python pool item reads os.environ: the job's env, MESH_* and PATH are there, meshd's
    secrets are not; the worker itself was started without them."""
    funcs = tmp_path / "funcs"
    funcs.mkdir()
    (funcs / "envfuncs.py").write_text(textwrap.dedent('''
        import os
        def dump(data):
            return "".join(f"{k}={v}\\n" for k, v in sorted(os.environ.items()))
        def worker_env(data):
            with open(f"/proc/{os.getpid()}/environ", "rb") as f:
                return f.read().replace(b"\\0", b"\\n")
    '''))
    m = _start(tmp_path, 'name = "m1"\n[pools.py]\nkind = "python"\nslots = 1\n'
                         '[pools.default]\nslots = 1\n', SECRETS)
    try:
        m.start()
        outs = {}
        for fn in ("dump", "worker_env"):
            status, rec = m.request("POST", "/jobs", {
                "pool": "py", "argv": [f"envfuncs:{fn}"], "cwd": str(funcs),
                "env": {"JOB_OWN": "mine"}, "items": ["x"]})
            assert status in (200, 201), rec
            done = m.wait_job(rec["id"])
            assert done["state"] == "done", done
            status, body = m.request("GET", f"/blobs/{done['items'][0]['stdout']}")
            assert status == 200
            outs[fn] = _env_lines(body.decode() if isinstance(body, bytes) else body)
        got, worker = outs["dump"], outs["worker_env"]
        assert got["JOB_OWN"] == "mine" and got["MESH_ITEM_INDEX"] == "0" and "PATH" in got
        assert not set(SECRETS) & set(got), got
        # The worker process's own environment (as it was started) has no secrets either.
        assert "PATH" in worker and "PYTHONPATH" in worker and not set(SECRETS) & set(worker)
    finally:
        m.stop()


def test_bad_env_pass_stops_meshd(tmp_path):
    """A bad `env_pass` stops meshd at start (exit 2) with a message naming the key and what
    to write instead (every bad value: tests/test_config.py)."""
    m = _start(tmp_path, 'name = "m1"\n[items]\nenv_pass = ["*"]\n', {})
    try:
        m.start(wait_ready=False)
        assert m.proc is not None and m.proc.wait(30) == 2
        tail = m.log_tail()
        assert "[items] env_pass" in tail and "name the variables items need" in tail, tail
    finally:
        m.stop()
