"""Run as a user (issue 12, point 2), on real members: `--user NAME|UID[:GID]`, the pool's default
user, `--inherit-env`, and `--cwd` defaulting to meshctl's folder. The tests run as root, so items
really run as `nobody` (uid 65534) or as ids no user has; a member that may not switch users is a
real meshd started without CAP_SETUID and CAP_SETGID (setpriv), not a pretend one."""

from __future__ import annotations

import os
import pwd
import queue
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from blobstore.store import LmdbBlobStore
from meshjobs.config import ConfigError, load_config
from meshjobs.control import ControlError, parse_submit, parse_user
from meshjobs.driver import Driver
from meshjobs.node import ItemEnded, Run
from meshjobs.runas import can_switch_user
from tests.helpers import Meshd, make_fleet, member_config

NOBODY = pwd.getpwnam("nobody")
NO_SUCH_USER = "meshjobs-no-such-user"
WAIT_S = 30

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not can_switch_user() or shutil.which("setpriv") is None,
    reason="needs root with CAP_SETUID and CAP_SETGID, and setpriv")

# Run meshd as root without the capabilities that switch users: a member that may not.
NO_SETUID = ["setpriv", "--bounding-set=-setuid,-setgid", "--inh-caps=-setuid,-setgid"]
WHO = "id -u; id -g; id -G; echo ${HOME-unset}; echo ${USER-unset}; echo ${LOGNAME-unset}; pwd"



def _out(m: Meshd, job: str) -> list[str]:
    r = m.ctl("job", "results", job)
    assert r.returncode == 0, r.stderr
    return r.stdout.decode().splitlines()


def _who(m: Meshd, *args: str, cwd: str | None = None) -> tuple[dict, list[str]]:
    job = m.submit(*args, "--", "sh", "-c", WHO, cwd=cwd)
    rec = m.wait_job(job)
    assert rec["state"] == "done", rec
    return rec, _out(m, job)


# --- Specs: the pure part -----------------------------------------------------------------------


@pytest.mark.parametrize("given,normal", [
    ("nobody", "nobody"), ("www-data", "www-data"), ("_apt", "_apt"), ("a.b", "a.b"),
    ("0", "0"), ("65534", "65534"), ("007:0100", "7:100"), ("4294967294:0", "4294967294:0"),
    ("x" * 32, "x" * 32),
])
def test_user_is_a_name_or_numeric_ids(given, normal):
    """A user is a POSIX portable name or UID[:GID]; numbers are normalized (one spelling, one
    job spec)."""
    assert parse_user(given) == normal


@pytest.mark.parametrize("bad", [
    "", "x" * 33, "../x", "a/b", "-1", "-x", "0:-1", "1:", ":1", "1:2:3", "+1", " nobody",
    "nobody ", "a b", "ünïcode", "٣", "１", "4294967295", "0:4294967295", "9" * 11, "9" * 5000,
    ".", "..", "a:b", "nobody:0", "a\x00b", "a\nb", 5, 1.5, True, None, ["nobody"], {"u": 1},
])
def test_hostile_users_are_refused(bad):
    """Empty, too long, paths, negative or huge ids, unicode digits and non-strings are 400s
    (None only means "not given" in a spec, so it is refused where a user must be given)."""
    with pytest.raises(ControlError) as e:
        parse_user(bad)
    assert e.value.status == 400


def test_spec_fields_only_when_given():
    """user and inherit_env join the spec only when given: a spec committed before they existed
    stays normalized, with the same digest."""
    spec = parse_submit({"argv": ["x"]})
    assert "user" not in spec and "inherit_env" not in spec
    spec = parse_submit({"argv": ["x"], "user": None, "inherit_env": False})
    assert "user" not in spec and "inherit_env" not in spec
    spec = parse_submit({"argv": ["x"], "user": "0100", "inherit_env": True})
    assert spec["user"] == "100" and spec["inherit_env"] is True
    for bad in ("yes", 1, 0, [], {}):
        with pytest.raises(ControlError):
            parse_submit({"argv": ["x"], "inherit_env": bad})


# --- Config ------------------------------------------------------------------------------------


def test_pool_user_in_config(tmp_path):
    """[pools.X] user: a user of this machine (name or ids), on command and python pools alike
    (a python pool's workers run as it); unknown users and bad values are refused with the key
    named."""
    def load(text: str):
        path = tmp_path / "m.toml"
        path.write_text(f'name = "m1"\n{text}\n')
        return load_config(str(path))

    cfg = load('[pools.default]\nuser = "nobody"\n[pools.b]\nuser = "4242:4343"\n[pools.c]\n')
    assert cfg.pools["default"].user == "nobody"
    assert cfg.pools["b"].user == "4242:4343"
    assert cfg.pools["c"].user is None
    assert load('[pools.py]\nkind = "python"\nuser = "nobody"').pools["py"].user == "nobody"
    for text, words in [
        (f'[pools.default]\nuser = "{NO_SUCH_USER}"', ("[pools.default] user", NO_SUCH_USER,
                                                         "no such user")),
        ('[pools.default]\nuser = "4242"', ("uid 4242 has no entry", "4242:GID")),
        ('[pools.default]\nuser = "../x"', ("[pools.default] user", "bad user")),
        ('[pools.default]\nuser = 65534', ("[pools.default] user", "must be a string")),
    ]:
        with pytest.raises(ConfigError) as e:
            load(text)
        for w in words:
            assert w in str(e.value), (text, str(e.value))


def test_unknown_pool_user_stops_meshd_at_start(tmp_path):
    """meshd refuses to start (exit 2, the key named) with a pool user it cannot run items as:
    unknown here, or other than its own when it may not switch users."""
    cfg = member_config(str(tmp_path), "m1", f'[pools.default]\nuser = "{NO_SUCH_USER}"\n')
    m = Meshd(str(tmp_path / "m1"), config=cfg)
    m.start(wait_ready=False)
    assert m.proc is not None and m.proc.wait(WAIT_S) == 2
    assert f"[pools.default] user = '{NO_SUCH_USER}': no such user" in m.log_tail()

    cfg = member_config(str(tmp_path), "m2", '[pools.default]\nuser = "nobody"\n')
    m = Meshd(str(tmp_path / "m2"), config=cfg, name="m2")
    m.prefix = NO_SETUID
    m.start(wait_ready=False)
    assert m.proc is not None and m.proc.wait(WAIT_S) == 2
    log = m.log_tail()
    assert "[pools.default] user = 'nobody'" in log
    assert "without the CAP_SETUID and CAP_SETGID capabilities" in log


# --- Real members -------------------------------------------------------------------------------


def test_items_run_as_the_named_user(meshd, tmp_path):
    """--user nobody: the item's uid, gid and groups are nobody's, and so are HOME, USER and
    LOGNAME; the record and `job status` show the user."""
    rec, lines = _who(meshd, "--user", "nobody", "--cwd", "/")
    groups = sorted(os.getgrouplist("nobody", NOBODY.pw_gid))
    assert lines == [str(NOBODY.pw_uid), str(NOBODY.pw_gid), " ".join(map(str, groups)),
                     NOBODY.pw_dir, "nobody", "nobody", "/"]
    assert rec["user"] == "nobody" and rec["inherit_env"] is False
    r = meshd.ctl("job", "status", rec["id"])
    assert r.returncode == 0, r.stderr
    text = r.stdout.decode()
    assert "user       nobody" in text and "cwd        /" in text
    status, page = meshd.request("GET", f"/jobs/{rec['id']}?format=html",
                                 headers={"Accept": "text/html"})
    assert status == 200
    assert b"<th>user</th><td>nobody</td>" in page.replace(b"\n", b""), page[:3000]


def test_numeric_ids_with_no_user(meshd):
    """--user UID:GID of ids no user has: exactly those ids, no supplementary group (not root's),
    and no HOME, USER or LOGNAME (not meshd's)."""
    _rec, lines = _who(meshd, "--user", "4242:4343", "--cwd", "/")
    assert lines == ["4242", "4343", "4343", "unset", "unset", "unset", "/"]


def test_root_keeps_nothing_of_meshds_groups(meshd):
    """--user 0:0 runs as root with no supplementary groups but root's own."""
    _rec, lines = _who(meshd, "--user", "0", "--cwd", "/")
    assert lines[:2] == ["0", "0"]
    assert lines[3:6] == [pwd.getpwuid(0).pw_dir, "root", "root"]


def test_submit_refused_early_in_a_fleet_of_one(meshd):
    """A fleet of one knows it is the member that would run the job: an unknown user, or a bare
    uid it cannot find a group for, is a 400 at submit, naming the user and the member."""
    r = meshd.ctl("job", "submit", "--user", NO_SUCH_USER, "--", "true")
    assert r.returncode != 0
    assert f"no user '{NO_SUCH_USER}' on member m1" in r.stderr.decode()
    status, body = meshd.request("POST", "/jobs", {"argv": ["true"], "user": "4242"})
    assert status == 400 and "uid 4242 has no entry" in body["error"], body
    status, jobs = meshd.request("GET", "/jobs")
    assert status == 200 and jobs == []


@pytest.mark.parametrize("bad", ["", "../x", "-1", "0:-1", "ünï", "x" * 33, "9" * 40, 65534,
                                 True, ["nobody"]])
def test_hostile_user_over_http(meshd, bad):
    """Hostile users over HTTP are 400s with a hint, and make no job."""
    status, body = meshd.request("POST", "/jobs", {"argv": ["true"], "user": bad})
    assert status == 400, body
    assert "user" in body["error"]
    if isinstance(bad, str) and bad:
        r = meshd.ctl("job", "submit", "--user", bad, "--", "true")
        assert r.returncode == 2, r
        err = r.stderr.decode()
        assert "user" in err and "Traceback" not in err
    status, jobs = meshd.request("GET", "/jobs")
    assert status == 200 and jobs == []


def test_resubmit_with_the_same_user_is_the_same_job(meshd):
    """The user is part of the spec: the same id with the same user returns the job, with
    another user it is a conflict."""
    spec = {"id": "same-user", "argv": ["true"], "user": "nobody", "cwd": "/", "hold": True}
    status, first = meshd.request("POST", "/jobs", spec)
    assert status in (200, 201), first
    status, again = meshd.request("POST", "/jobs", {**spec, "user": "nobody"})
    assert status == 200 and again["id"] == "same-user" and again["user"] == "nobody", again
    status, other = meshd.request("POST", "/jobs", {**spec, "user": "65534:65534"})
    assert status == 409, other
    status, other = meshd.request("POST", "/jobs", {**spec, "inherit_env": True})
    assert status == 409, other


def test_pool_default_user_and_the_job_wins(tmp_path):
    """[pools.default] user = "nobody": a job without --user runs as nobody; --user wins."""
    cfg = member_config(str(tmp_path), "m1", '[pools.default]\nslots = 2\nuser = "nobody"\n')
    m = Meshd(str(tmp_path / "m1"), config=cfg)
    try:
        m.start()
        rec, lines = _who(m, "--cwd", "/")
        assert lines[:2] == [str(NOBODY.pw_uid), str(NOBODY.pw_gid)]
        assert lines[3:6] == [NOBODY.pw_dir, "nobody", "nobody"]
        assert rec["user"] is None  # the record says what the job asked for
        _rec, lines = _who(m, "--user", "4242:4343", "--cwd", "/")
        assert lines[:2] == ["4242", "4343"]
    finally:
        m.stop()


def test_inherit_env_gives_meshds_whole_environment(meshd_factory):
    """Without --inherit-env an item sees none of meshd's own variables; with it, all of them
    but meshd's own secrets, plus the job's env and MESH_*; with a user, HOME/USER/LOGNAME are still the user's."""
    m = meshd_factory(env={"RUNAS_SECRET": "s3cret", "HOME": "/root-home",
                           "MESHJOBS_TOKEN": "meshds-own-token"})

    def env_of(*args: str) -> dict[str, str]:
        job = m.submit("--env", "JOB_OWN=mine", *args, "--cwd", "/", "--", "env")
        assert m.wait_job(job)["state"] == "done"
        return dict(line.split("=", 1) for line in _out(m, job) if "=" in line)

    minimal = env_of()
    assert "RUNAS_SECRET" not in minimal and minimal["JOB_OWN"] == "mine"
    whole = env_of("--inherit-env")
    assert whole["RUNAS_SECRET"] == "s3cret" and whole["JOB_OWN"] == "mine"
    # ... but never meshd's own token (itemenv.MESHD_SECRETS).
    assert "MESHJOBS_TOKEN" not in whole and "MESHJOBS_TOKEN" not in minimal
    # Run as the member's item user (root in the suite: SUITE_ITEMS_USER), so that user's HOME.
    assert whole["HOME"] == pwd.getpwuid(0).pw_dir and "MESH_JOB_ID" in whole
    as_nobody = env_of("--inherit-env", "--user", "nobody")
    assert as_nobody["RUNAS_SECRET"] == "s3cret"
    assert (as_nobody["HOME"], as_nobody["USER"], as_nobody["LOGNAME"]) == (
        NOBODY.pw_dir, "nobody", "nobody")
    minimal_nobody = env_of("--user", "nobody")
    assert "RUNAS_SECRET" not in minimal_nobody and minimal_nobody["HOME"] == NOBODY.pw_dir
    status, rec = m.request("GET", "/jobs?limit=10")
    assert status == 200 and sum(1 for j in rec if j["inherit_env"]) == 2


def test_cwd_defaults_to_meshctls_folder(meshd, tmp_path):
    """meshctl sends the folder it runs in as the job's cwd (as qsub does); --cwd DIR names
    another (absolute: a relative one is still refused); --no-cwd keeps the member's own
    folder."""
    here = tmp_path / "submit-here"
    (here / "sub").mkdir(parents=True)
    job = meshd.submit("--", "pwd", cwd=str(here))
    rec = meshd.wait_job(job)
    assert rec["cwd"] == str(here) and _out(meshd, job) == [str(here)]
    r = meshd.ctl("job", "submit", "--cwd", "sub", "--", "pwd", cwd=str(here))
    assert r.returncode == 2 and "cwd must be an absolute path" in r.stderr.decode()
    job = meshd.submit("--cwd", str(here / "sub"), "--", "pwd", cwd=str(here))
    assert meshd.wait_job(job)["cwd"] == str(here / "sub")
    assert _out(meshd, job) == [str(here / "sub")]
    job = meshd.submit("--no-cwd", "--", "pwd", cwd=str(here))
    rec = meshd.wait_job(job)
    assert rec["cwd"] is None and _out(meshd, job) == [os.path.realpath(meshd.data)]
    r = meshd.ctl("job", "submit", "--no-cwd", "--cwd", "/", "--", "pwd")
    assert r.returncode != 0 and "not both" in r.stderr.decode()


def test_missing_cwd_is_an_item_error_naming_folder_and_member(meshd):
    """A cwd that does not exist on the member that runs the item fails it, naming both."""
    job = meshd.submit("--cwd", "/no/such/folder", "--", "true")
    rec = meshd.wait_job(job)
    assert rec["state"] == "failed"
    error = rec["items"][0]["error"]
    assert "working directory '/no/such/folder' is not usable on member m1" in error, error
    assert "--no-cwd" in error


def test_member_that_may_not_switch_users(tmp_path):
    """A member without CAP_SETUID/CAP_SETGID (a fleet of one) refuses --user nobody at submit;
    its own uid:gid still runs; in a bigger fleet the item fails with that error, committed."""
    cfg = member_config(str(tmp_path), "m1", "[pools.default]\nslots = 2\n")
    m = Meshd(str(tmp_path / "m1"), config=cfg)
    m.prefix = NO_SETUID
    try:
        m.start()
        r = m.ctl("job", "submit", "--user", "nobody", "--", "true")
        assert r.returncode != 0
        err = r.stderr.decode()
        assert "member m1 runs as root without the CAP_SETUID and CAP_SETGID" in err, err
        assert "cannot run items as user 'nobody'" in err and "submit without --user" in err
        _rec, lines = _who(m, "--user", "0:0", "--cwd", "/")
        assert lines[:2] == ["0", "0"]
    finally:
        m.stop()


def test_item_errors_are_committed_in_a_fleet(tmp_path):
    """In a fleet (one voter here), the member that runs an item decides: an unknown user, or any
    user on a member that may not switch, fails the item with an error naming user and member."""
    (v1,) = make_fleet(str(tmp_path), voters=1)
    v1.prefix = NO_SETUID
    try:
        v1.start()
        job = v1.submit("--user", NO_SUCH_USER, "--cwd", "/", "--", "true")
        rec = v1.wait_job(job)
        assert rec["state"] == "failed"
        assert rec["items"][0]["error"].startswith(f"no user '{NO_SUCH_USER}' on member v1"), rec
        job = v1.submit("--user", "nobody", "--cwd", "/", "--", "true")
        rec = v1.wait_job(job)
        assert rec["state"] == "failed"
        error = rec["items"][0]["error"]
        assert "member v1 runs as root without the CAP_SETUID" in error, error
        assert "cannot run items as user 'nobody'" in error
        r = v1.ctl("job", "status", job)
        assert "cannot run items as user 'nobody'" in r.stdout.decode()
    finally:
        v1.stop()


# --- The driver with a real subprocess ----------------------------------------------------------


@pytest.fixture
def blobs(tmp_path: Path) -> Iterator[LmdbBlobStore]:
    store = LmdbBlobStore(str(tmp_path / "blobs"))
    yield store
    store.close()


def _drive(tmp_path: Path, blobs: LmdbBlobStore, item: Run, **kw) -> ItemEnded:
    ends: queue.Queue[ItemEnded] = queue.Queue()
    driver = Driver(blobs, str(tmp_path / "spool"), ends.put, member="m9", **kw)
    thread = threading.Thread(target=driver.run, daemon=True)
    thread.start()
    try:
        driver.start(item)
        return ends.get(timeout=WAIT_S)
    finally:
        driver.stop()
        thread.join(WAIT_S)


def test_driver_that_may_not_switch(tmp_path, blobs):
    """may_switch_user=False (a member not root): another user fails the item without running,
    its own uid:gid runs; a python item runs only as its workers' user (here meshd's own)."""
    end = _drive(tmp_path, blobs, Run("j", 0, 1, ["true"], {}, "/", None, None,
                                          user="nobody"), may_switch_user=False)
    assert end.state == "failed" and end.stdout is None
    assert "member m9" in end.error and "cannot run items as user 'nobody'" in end.error
    own = f"{os.geteuid()}:{os.getegid()}"
    end = _drive(tmp_path, blobs, Run("j", 1, 1, ["true"], {}, "/", None, None, user=own),
                 may_switch_user=False)
    assert end.state == "done", end
    end = _drive(tmp_path, blobs, Run("j", 2, 1, ["json:dumps"], {}, None, None, None,
                                          kind="python", user="nobody"), python_workers=0)
    assert end.state == "failed" and "python pool on member m9" in end.error
    assert "cannot run as user 'nobody'" in end.error


# --- The job table: committed specs -------------------------------------------------------------


@pytest.mark.parametrize("bad", [
    {"user": ""}, {"user": "../x"}, {"user": "007"}, {"user": 65534}, {"user": None},
    {"inherit_env": False}, {"inherit_env": 1}, {"inherit_env": "yes"},
])
def test_committed_spec_user_must_be_normalized(bad):
    """A committed spec's user and inherit_env pass control's checks and are normalized (present
    only when set, numbers without leading zeros), or the entry is refused as malformed."""
    from tests.helpers import T0, Log, refusal, spec
    log = Log()
    out = log.apply({"k": "submit", "t": T0, "id": "j1", "spec": spec(**bad), "dg": b"d",
                     "items": [None]})
    assert refusal(out) == (False, 400, "malformed")


def test_user_survives_snapshots_and_shows_in_records():
    """user and inherit_env are part of the job: in its record, and kept by to_state/from_state;
    a job without them has neither in its spec fields (old snapshots load unchanged)."""
    from meshjobs.table import JobTable
    from tests.helpers import Log
    log = Log()
    assert log.submit("j1", user="nobody", inherit_env=True)["ok"]
    assert log.submit("j2", dg=b"dg-2", cwd="/tmp")["ok"]
    j1, j2 = log.table.jobs["j1"], log.table.jobs["j2"]
    assert j1.spec_fields()["user"] == "nobody" and j1.spec_fields()["inherit_env"] is True
    assert "user" not in j2.spec_fields() and "inherit_env" not in j2.spec_fields()
    again = JobTable.from_state(log.table.to_state())
    rec = again.record(again.jobs["j1"])
    assert (rec["user"], rec["inherit_env"], rec["cwd"]) == ("nobody", True, None)
    rec = again.record(again.jobs["j2"])
    assert (rec["user"], rec["inherit_env"], rec["cwd"]) == (None, False, "/tmp")


def test_python_items_inherit_env(tmp_path, blobs, monkeypatch):
    """A python item sees meshd's whole environment during its call only with inherit_env."""
    monkeypatch.setenv("RUNAS_PY_SECRET", "py-s3cret")
    (tmp_path / "runasmod.py").write_text(
        "import os\n\ndef secret(data):\n    return os.environ.get('RUNAS_PY_SECRET', 'unset')\n")
    outs = []
    for inherit in (False, True):
        end = _drive(tmp_path, blobs, Run("j", int(inherit), 1, ["runasmod:secret"], {},
                                              str(tmp_path), None, None, kind="python",
                                              inherit_env=inherit), python_workers=1)
        assert end.state == "done", end
        outs.append(blobs.get(end.stdout))
    assert outs == [b"unset", b"py-s3cret"]


def test_refusal_says_who_the_member_runs_as():
    """A member not root names its uid and what to do; one that may switch, or is asked for its
    own ids, runs the item."""
    from meshjobs.runas import Identity, refusal, resolve
    ident = resolve("nobody", "m1")
    assert ident == Identity(NOBODY.pw_uid, NOBODY.pw_gid,
                             tuple(os.getgrouplist("nobody", NOBODY.pw_gid)), "nobody",
                             NOBODY.pw_dir)
    why = refusal("nobody", ident, "m1", False, 1000, 1000)
    assert why == ("member m1 runs as uid 1000, not root: it cannot run items as user 'nobody'; "
                   "start meshd as root there to run items as other users, or submit without "
                   "--user (items then run as uid 1000, gid 1000)")
    assert refusal("nobody", ident, "m1", True, 1000, 1000) is None
    assert refusal("nobody", ident, "m1", False, NOBODY.pw_uid, NOBODY.pw_gid) is None
