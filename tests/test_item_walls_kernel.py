"""The kernel wall around items (meshjobs/wall.py): a hostile item against a real meshd run as a
non-root user, which cannot give items another uid, so only Landlock and a non-dumpable meshd
stand between them; and the rule builder and launcher on their own."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile

import pytest

from meshjobs import wall
from tests.helpers import Meshd, wait_until

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or wall.landlock_abi() < 6,
                                reason="needs root (to start meshd as nobody) and Landlock 6+")
SECRET = b"fleet-secret-bytes-0123456789abcdef"[:32]
MARKER = "meshd-env-marker-5f1c0e"


def _folder() -> str:
    """A folder nobody may use (pytest's tmp_path sits under a root-only folder)."""
    top = tempfile.mkdtemp(prefix="walls-")
    os.chmod(top, 0o755)
    return top


def _nobody_meshd(top: str, wall_mode: str | None, data: str, secret: str | None) -> Meshd:
    os.makedirs(data, exist_ok=True)
    lines = []
    if secret is not None:
        lines.append(f'secret_file = "{secret}"')
    if wall_mode is not None:
        lines.append(f'[items]\nwall = "{wall_mode}"')
    config = os.path.join(top, "meshd.toml")
    with open(config, "w") as f:
        f.write("\n".join(lines) + "\n")
    for path in (data, *( [os.path.dirname(secret)] if secret else [])):
        os.chmod(path, 0o700)
    if secret is not None:
        with open(secret, "wb") as f:
            f.write(SECRET)

        os.chmod(secret, 0o600)
    m = Meshd(data, config=config, env={"MESHTEST_MARKER": MARKER})
    # Root with no capabilities at all: a meshd that cannot change uid (the python install
    # here is readable by root alone, so uid 0 stands for the unprivileged user).
    m.prefix = ["setpriv", "--bounding-set=-all", "--inh-caps=-all"]
    return m.start()


HOSTILE = ('find "$1" -type f -exec cat {} + ; echo "find:$?"; cat "$2"; echo "secret:$?"; '
           'tr "\\0" "\\n" < /proc/$3/environ; echo "environ:$?"; kill -0 $3; echo "kill:$?"; '
           'kill -0 $4; echo "other:$?"')


def _hostile_run(m: Meshd, secret: str) -> tuple[str, bytes]:
    """Run the hostile item against `m` while a sleep job of another job runs; its output."""
    r = m.ctl("job", "submit", "--id", "sleeper", "--", "sleep", "60")
    assert r.returncode == 0, r.stderr

    def sleeper_pid() -> int | None:
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmd = f.read().split(b"\0")
                with open(f"/proc/{pid}/status") as f:
                    ppid = next(int(x.split()[1]) for x in f if x.startswith("PPid:"))
            except (OSError, StopIteration):
                continue
            if cmd[:2] == [b"sleep", b"60"] and ppid == m.pid:
                return int(pid)
        return None
    sleeper = wait_until(sleeper_pid, what="the sleep item")
    job = m.submit("--", "sh", "-c", HOSTILE, "sh", m.data, secret, str(m.pid), str(sleeper))
    rec = m.wait_job(job)
    item = rec["items"][0]
    out = b""
    for stream in ("stdout", "stderr"):
        if item.get(stream):
            status, body = m.request("GET", f"/blobs/{item[stream]}")
            assert status == 200, status
            out += body if isinstance(body, bytes) else json.dumps(body).encode()
    m.ctl("job", "cancel", "sleeper")
    return item["state"], out


@pytest.mark.parametrize("layout", ["plain", "container"])
def test_hostile_item_gets_nothing_from_a_non_root_meshd(layout: str) -> None:
    """Rule: an item of a non-root meshd reads nothing of its data folder or secret file, not
    its /proc environ, and signals neither meshd nor another job's item."""
    top = _folder()
    try:
        if layout == "plain":
            data, secret = os.path.join(top, "meshjobs-data"), None
        else:  # the image's /data, and the secret mounted from elsewhere
            data, secret = os.path.join(top, "data"), os.path.join(top, "run", "secrets",
                                                                      "fleet.secret")
            os.makedirs(os.path.dirname(secret))
        m = _nobody_meshd(top, None, data, secret)
        try:
            secret_path = secret or os.path.join(data, "fleet.secret")
            with open(secret_path, "rb") as f:
                real = f.read()
            _state, out = _hostile_run(m, secret_path)
            assert real not in out and MARKER.encode() not in out, out
            for step in (b"secret", b"environ", b"kill", b"other"):
                assert step + b":" in out and step + b":0" not in out, out
            assert b"Permission denied" in out
            status, fleet = m.request("GET", "/fleet")
            me = next(e for e in fleet["members"] if e["name"] == m.name)
            assert "landlock" in me["items"]["walls"] and me["items"]["signals_walled"]
            assert me["items"]["warning"] is None
        finally:
            m.stop()
    finally:
        shutil.rmtree(top, ignore_errors=True)


def test_hostile_item_gets_through_with_the_wall_off() -> None:
    """Rule: with [items] wall = "off" nothing stands in the way (the test above can fail)."""
    top = _folder()
    try:
        data = os.path.join(top, "data")
        m = _nobody_meshd(top, "off", data, None)
        try:
            secret_path = os.path.join(data, "fleet.secret")
            with open(secret_path, "rb") as f:
                real = f.read()
            _state, out = _hostile_run(m, secret_path)
            assert real in out, out
            assert b"kill:0" in out and b"other:0" in out, out
            assert b"items_not_walled" in open(m.log_path, "rb").read()
            status, fleet = m.request("GET", "/fleet")
            me = next(e for e in fleet["members"] if e["name"] == m.name)
            assert "landlock" not in me["items"]["walls"] and "read the data" in me["items"]["warning"]
            # meshctl fleet and the web fleet page say it too.
            text = m.ctl("fleet").stdout.decode()
            assert f"WARNING: {m.name}: " in text and "read the data" in text, text
            status, page = m.request("GET", "/fleet", headers={"Accept": "text/html"})
            page = page.decode() if isinstance(page, bytes) else str(page)
            assert status == 200 and f'data-items-warning="{m.name}"' in page, page[-2000:]
        finally:
            m.stop()
    finally:
        shutil.rmtree(top, ignore_errors=True)


# --- The rule builder and the launcher on their own ------------------------------------------


@pytest.mark.parametrize("garbage", [
    None, "x", {}, {"user": 1, "walls": [], "signals_walled": True, "warning": None},
    {"user": "u", "walls": ["root"], "signals_walled": True, "warning": None},
    {"user": "u", "walls": ["uid"] * 100, "signals_walled": True, "warning": None},
    {"user": "u", "walls": [], "signals_walled": "yes", "warning": None},
    {"user": "u", "walls": [], "signals_walled": False, "warning": "w" * 100_000},
    {"user": "u" * 10_000, "walls": [], "signals_walled": False, "warning": None}])
def test_fleet_items_garbage_is_dropped(garbage) -> None:
    """A member's report of its items' walls that is not well formed is taken as not said."""
    from meshjobs.node.members import parse_items
    assert parse_items(garbage) is None
    good = {"user": "u", "walls": ["landlock"], "signals_walled": True, "warning": None}
    assert parse_items(good) == good


def test_rules_allow_siblings_and_nothing_beneath(tmp_path) -> None:
    """Rules 1-2: every sibling of every ancestor is allowed; nothing beneath a denied path."""
    (tmp_path / "data" / "blobs").mkdir(parents=True)
    (tmp_path / "keep").mkdir()
    (tmp_path / "file").write_text("x")
    r = wall.rules([str(tmp_path / "data")])
    assert str(tmp_path / "keep") in r.allow and str(tmp_path / "file") in r.allow
    assert not any(p.startswith(str(tmp_path / "data")) for p in r.allow)
    assert str(tmp_path) not in r.allow and "/" not in r.allow
    assert r.denied == (str(tmp_path / "data"),)


def test_rules_nested_missing_and_symlinked(tmp_path) -> None:
    """Rules 1 and 4: nested denied paths fold into the outer one, missing ones are dropped, a
    symlinked one is resolved, and a symlink among the siblings gets no rule."""
    (tmp_path / "data" / "inner").mkdir(parents=True)
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "key.pem").write_text("k")
    os.symlink(tmp_path / "data", tmp_path / "link")
    os.symlink(tmp_path / "elsewhere" / "key.pem", tmp_path / "keylink")
    r = wall.rules([str(tmp_path / "data"), str(tmp_path / "data" / "inner"),
                    str(tmp_path / "nothing"), str(tmp_path / "keylink")])
    assert set(r.denied) == {str(tmp_path / "data"), str(tmp_path / "elsewhere" / "key.pem")}
    assert str(tmp_path / "link") not in r.allow and str(tmp_path / "keylink") not in r.allow
    assert str(tmp_path / "elsewhere") not in r.allow  # on the spine: the key is beneath it
    assert not any(p.startswith(str(tmp_path / "data")) for p in r.allow)


def test_rules_go_stale_when_a_spine_folder_changes(tmp_path) -> None:
    """Rule 5: an entry added beside a denied path makes the rules stale."""
    (tmp_path / "data").mkdir()
    r = wall.rules([str(tmp_path / "data")])
    assert wall.fresh(r)
    (tmp_path / "new").mkdir()
    assert not wall.fresh(r)
    assert str(tmp_path / "new") in wall.rules([str(tmp_path / "data")]).allow


def _launch(r: wall.Rules, argv: list[str], env: dict[str, str], path: str | None = "",
            cwd: str | None = None) -> subprocess.CompletedProcess:
    if path == "":
        path = wall.program_path(argv[0], env)
    return subprocess.run(wall.wrap(r, path, argv, env), env=env, cwd=cwd, capture_output=True)


def test_launcher_keeps_argv0_env_and_cwd(tmp_path) -> None:
    """The launcher: the program gets the item's argv[0], env (no LC_CTYPE added) and cwd."""
    (tmp_path / "data").mkdir()
    (tmp_path / "work").mkdir()
    (tmp_path / "data" / "x").write_text("secret")
    r = wall.rules([str(tmp_path / "data")])
    env = {"PATH": "/usr/bin:/bin", "ONE": "1"}
    p = _launch(r, ["env", "-0"], env, cwd=str(tmp_path / "work"))
    assert p.returncode == 0, p.stderr
    assert sorted(p.stdout.split(b"\0")[:-1]) == [b"ONE=1", b"PATH=/usr/bin:/bin"]
    p = _launch(r, ["sh", "-c", "pwd"], env, cwd=str(tmp_path / "work"))
    assert p.stdout.decode().strip() == str(tmp_path / "work")
    p = _launch(r, ["sh", "-c", 'echo "$0"; cat ' + str(tmp_path / "data" / "x")], env)
    assert p.stdout == b"sh\n" and b"Permission denied" in p.stderr


def test_launcher_errors() -> None:
    """The launcher's error paths: no such program is said before anything starts; a program
    that vanished says so with EXIT_EXEC; bad rules exit EXIT_WALL; one stderr line each."""
    env = {"PATH": "/usr/bin:/bin"}
    with pytest.raises(FileNotFoundError):
        wall.program_path("no-such-program-here", env)
    with pytest.raises(FileNotFoundError):
        wall.program_path("/no/such/program", env)
    r = wall.Rules(("/usr", "/bin", "/lib", "/lib64", "/etc"), (), ())
    p = _launch(r, ["gone"], env, path="/no/such/program")
    assert p.returncode == wall.EXIT_EXEC
    assert p.stderr.decode().startswith("meshjobs wall: cannot run /no/such/program")
    bad = [sys.executable, "-I", "-S", "-c", wall.LAUNCHER_CODE, "{not json", "--", "true"]
    p = subprocess.run(bad, env=env, capture_output=True)
    assert p.returncode == wall.EXIT_WALL and p.stderr.startswith(b"meshjobs wall: bad rules")
    none = [sys.executable, "-I", "-S", "-c", wall.LAUNCHER_CODE,
            json.dumps({"allow": [], "path": None}), "--"]
    p = subprocess.run(none, env=env, capture_output=True)
    assert p.returncode == wall.EXIT_WALL


@pytest.mark.parametrize("mode,said", [("off", "WARNING: items run as meshd's own user"),
                                       ("auto", "walls landlock, undumpable"),
                                       ("bogus", "[items] wall must be one of"),
                                       ("", "[items] wall must be one of"),
                                       ("x" * 10_000, "[items] wall must be one of")])
def test_check_config_says_what_walls_items_get(tmp_path, mode: str, said: str) -> None:
    """meshd check-config says what walls items get where meshd cannot change uid, with the
    warning when none holds; a bad [items] wall is a problem (exit 2)."""
    cfg = tmp_path / "m.toml"
    cfg.write_text(f'name = "a"\n[items]\nwall = "{mode}"\n')
    p = subprocess.run(["setpriv", "--bounding-set=-all", "--inh-caps=-all", sys.executable,
                        "-m", "meshjobs.daemon", "check-config", str(cfg)],
                       capture_output=True, cwd=os.getcwd())
    assert said in (p.stdout + p.stderr).decode(), p
    assert p.returncode == (0 if mode in ("off", "auto") else 2)


def test_rules_past_their_bound_allow_nothing_and_refuse(tmp_path, monkeypatch) -> None:
    """Rule 6: more neighbours than limits.wall_rules_bytes_max of paths gives rules that allow
    nothing and refuse to wrap an item, saying what to do."""
    from meshjobs import limits
    (tmp_path / "data").mkdir()
    for i in range(50):
        (tmp_path / f"neighbour-{i:03}").mkdir()
    monkeypatch.setattr(limits, "wall_rules_bytes_max", 1000)
    r = wall.rules([str(tmp_path / "data")])
    assert r.allow == () and r.too_many >= 50
    with pytest.raises(wall.WallError, match="move the data folder into a folder of its own"):
        wall.wrap(r, "/bin/true", ["true"], {"PATH": "/usr/bin:/bin"})


def test_launcher_needs_nothing_beyond_its_rules(tmp_path) -> None:
    """The launcher imports all it needs before the wall goes up: with rules that allow the
    program and its libraries but not python's own library, the program runs."""
    env = {"PATH": "/usr/bin:/bin"}
    sh = os.path.realpath("/bin/sh")
    libs = subprocess.run(["ldd", sh], capture_output=True, text=True).stdout.split()
    allow = {os.path.dirname(sh)} | {os.path.dirname(os.path.realpath(w)) for w in libs
                                     if w.startswith("/")}
    assert not any(sys.base_prefix.startswith(a) or "python" in a for a in allow), allow
    p = _launch(wall.Rules(tuple(sorted(allow)), (), ()), [sh, "-c", "echo ran"], env)
    assert p.returncode == 0 and p.stdout == b"ran\n", p.stderr


def test_a_member_among_too_many_neighbours_says_so_and_runs_nothing() -> None:
    """A data folder whose surroundings are too many for the wall: meshd says so at start, and
    an item fails without running, its error saying what to do."""
    from meshjobs import limits
    top = _folder()
    try:
        name = "n" * 200
        for i in range(limits.wall_rules_bytes_max // (len(top) + len(name)) + 10):
            open(os.path.join(top, f"{name}{i}"), "w").close()
        m = _nobody_meshd(top, None, os.path.join(top, "data"), None)
        try:
            assert "items_cannot_be_walled" in m.log_tail(1 << 20)
            job = m.submit("--", "sh", "-c", "echo ran")
            rec = m.wait_job(job)
            item = rec["items"][0]
            assert item["state"] == "failed" and "folder of its own" in item["error"], item
            assert not item.get("stdout")
        finally:
            m.stop()
    finally:
        shutil.rmtree(top, ignore_errors=True)


def test_an_item_that_fails_beside_the_data_folder_is_told_why() -> None:
    """The quick start's trap: meshd's data folder in the folder items work in. An item that
    writes there fails, and its error says why and what to do; one that writes into a folder
    beside the data folder works."""
    top = _folder()
    try:
        os.mkdir(os.path.join(top, "work"))
        m = _nobody_meshd(top, None, os.path.join(top, "data"), None)
        try:
            job = m.submit("--cwd", top, "--", "sh", "-c", "echo x > out")
            item = m.wait_job(job)["items"][0]
            assert item["state"] == "failed", item
            assert f"its working directory {top} holds meshd's data folder" in item["error"]
            job = m.submit("--cwd", os.path.join(top, "work"), "--", "sh", "-c", "echo x > out")
            item = m.wait_job(job)["items"][0]
            assert item["state"] == "done" and not item.get("error"), item
        finally:
            m.stop()
    finally:
        shutil.rmtree(top, ignore_errors=True)
