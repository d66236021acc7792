"""Output paths never follow a planted symlink (issue 25, point 9).

`--stdout W/out-{index}.txt` in a folder others may write: a symlink at the name, planted
before the submit or by the item itself while it runs, is replaced by the output (written by the
item's user, to a temporary name, renamed), and the file it points to is never touched. Unit
tests of meshjobs.outpaths.write_into, then a real meshd run as root.
"""

from __future__ import annotations

import os
import pathlib
import pwd
import shutil
import stat
import tempfile

import pytest

from meshjobs import outpaths
from meshjobs.runas import can_switch_user
from tests.helpers import Meshd, running

SECRET = b"root only: never overwritten\n"

needs_root = pytest.mark.skipif(os.geteuid() != 0 or not can_switch_user(),
                                reason="needs root with CAP_SETUID and CAP_SETGID")


@pytest.fixture
def base():
    """A folder under /tmp (pytest's own are 0700: another user could not reach in), with a
    world-writable, non-sticky W and a root-only file beside it."""
    top = pathlib.Path(tempfile.mkdtemp(prefix="meshjobs-outpaths-", dir="/tmp"))
    os.chmod(top, 0o755)
    (top / "W").mkdir()
    os.chmod(top / "W", 0o777)
    secret = top / "root-only"
    secret.write_bytes(SECRET)
    os.chmod(secret, 0o600)
    yield top
    shutil.rmtree(top)


def test_a_symlink_at_the_name_is_replaced_not_followed(base) -> None:
    """Rule 2: the link itself is replaced by a regular file; its target keeps its bytes."""
    link = base / "W" / "out-0.txt"
    link.symlink_to(base / "root-only")
    outpaths.write_into(str(link), b"output\n", None)
    assert (base / "root-only").read_bytes() == SECRET
    assert stat.S_ISREG(os.lstat(link).st_mode) and link.read_bytes() == b"output\n"
    assert sorted(os.listdir(base / "W")) == ["out-0.txt"]  # no temporary name left behind


def test_a_symlink_to_a_folder_is_replaced_too(base) -> None:
    link = base / "W" / "out"
    link.symlink_to(base)
    outpaths.write_into(str(link), b"x", None)
    assert stat.S_ISREG(os.lstat(link).st_mode) and not (base / "out").exists()


def test_what_cannot_be_written_says_why_and_leaves_nothing(base) -> None:
    (base / "W" / "adir").mkdir()
    for dest, words in ((base / "nosuch" / "f", "folder"), (base / "W" / "adir", "directory"),
                        (f"{base}/W/", "names a folder")):
        with pytest.raises(outpaths.WriteError, match=words):
            outpaths.write_into(str(dest), b"x", None)
    assert sorted(os.listdir(base / "W")) == ["adir"]
    os.mkfifo(base / "W" / "fifo")
    with pytest.raises(outpaths.WriteError, match="FIFO"):
        outpaths.write_into(str(base / "W" / "fifo"), b"x", None)


def test_a_character_device_is_written_into_never_replaced() -> None:
    """`--stdout /dev/null` discards, as it always did: the device is not replaced."""
    before = os.lstat("/dev/null")
    outpaths.write_into("/dev/null", b"gone", None)
    after = os.lstat("/dev/null")
    assert stat.S_ISCHR(after.st_mode) and after.st_rdev == before.st_rdev


def test_a_long_name_gets_a_temporary_name_that_fits(base) -> None:
    name = "n" * 255
    outpaths.write_into(str(base / "W" / name), b"long", None)
    assert (base / "W" / name).read_bytes() == b"long"


# --- a real meshd, as root ------------------------------------------------------------------


@pytest.fixture(scope="module")
def member(tmp_path_factory):
    yield from running(Meshd(str(tmp_path_factory.mktemp("outpaths") / "m1"), slots=2))


def _check(member: Meshd, base: pathlib.Path, job_id: str, spec: dict) -> None:
    """The job's item prints its uid; the output file is a regular file of that uid holding it,
    and the root-only file is unchanged."""
    out = base / "W" / "out-0.txt"
    status, rec = member.request("POST", "/jobs", {"id": job_id, "cwd": "/",
                                                   "stdout": str(base / "W" / "out-{index}.txt"),
                                                   **spec})
    assert status == 201, rec
    rec = member.wait_job(job_id)
    assert rec["state"] == "done" and rec["items"][0]["error"] is None, rec["items"][0]
    assert (base / "root-only").read_bytes() == SECRET
    st = os.lstat(out)
    assert stat.S_ISREG(st.st_mode), "the output went through the symlink"
    uid = int(out.read_text().split()[-1])
    assert st.st_uid == uid
    assert [n for n in os.listdir(base / "W") if n.endswith(".tmp")] == []


@needs_root
@pytest.mark.parametrize("user", [None, "nobody"])
def test_a_symlink_planted_before_the_submit_is_not_followed(member, base, user) -> None:
    (base / "W" / "out-0.txt").symlink_to(base / "root-only")
    spec = {"argv": ["id", "-u"]} | ({"user": user} if user else {})
    _check(member, base, f"plant-before-{user or 'own'}", spec)
    if user:
        assert os.lstat(base / "W" / "out-0.txt").st_uid == pwd.getpwnam(user).pw_uid


@needs_root
@pytest.mark.parametrize("user", [None, "nobody"])
def test_a_symlink_the_item_plants_while_it_runs_is_not_followed(member, base, user) -> None:
    script = f"ln -s {base / 'root-only'} {base / 'W' / 'out-0.txt'} && id -u"
    spec = {"argv": ["sh", "-c", script]} | ({"user": user} if user else {})
    _check(member, base, f"plant-during-{user or 'own'}", spec)


def test_protected_folders_refuse_outputs_below_them_by_any_path(base) -> None:
    """Rule 3: a protected folder, a folder below it, and a symlink leading into it all refuse;
    a folder beside it does not."""
    data = base / "data"
    (data / "blobs").mkdir(parents=True)
    (base / "W" / "into").symlink_to(data)
    try:
        outpaths.protect((str(data),))
        for dest in (data / "raft.journal", data / "blobs" / "x", base / "W" / "into" / "y"):
            with pytest.raises(outpaths.WriteError, match="meshd's own"):
                outpaths.write_into(str(dest), b"x", None)
        outpaths.write_into(str(base / "W" / "fine"), b"x", None)
    finally:
        outpaths.protect(())
    assert sorted(os.listdir(data)) == ["blobs"] and os.listdir(data / "blobs") == []


def test_an_output_path_never_lands_in_the_data_folder(member, base) -> None:
    """A submitter's --stdout that names meshd's journal (relative to meshd's folder, absolute,
    or through a symlink the item plants) is refused in the item's error; the journal stays."""
    journal = os.path.join(member.data, "raft.journal")
    before = open(journal, "rb").read() if os.path.exists(journal) else None
    link = base / "W" / "d"
    cases = {"rel": {"argv": ["echo", "x"], "stdout": "raft.journal"},
             "abs": {"argv": ["echo", "x"], "stdout": journal, "cwd": "/"},
             "link": {"argv": ["sh", "-c", f"ln -s {member.data} {link}; echo x"],
                      "stdout": str(link / "raft.journal"), "cwd": "/"}}
    for name, spec in cases.items():
        status, rec = member.request("POST", "/jobs", {"id": f"data-{name}", **spec})
        assert status == 201, rec
        rec = member.wait_job(f"data-{name}")
        assert "meshd's own" in (rec["items"][0]["error"] or ""), (name, rec["items"][0])
    if before is not None:
        assert open(journal, "rb").read()[:len(before)] == before
    assert not [n for n in os.listdir(member.data) if n.endswith(".tmp")]
