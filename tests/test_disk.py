"""A real meshd and its disk: errors at start stop it with the fail-stop message and code, a full
disk makes it read-only (and it starts on one), and it takes work again once space is back.

The full-disk tests mount a small tmpfs (root only) and fill it for real; without the right to
mount they are skipped, and the `disk.full` failpoint (free space reads 0) covers the read-only
member in every environment.
"""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
import uuid

import pytest

from meshjobs.diskspace import EXIT_DISK, RESERVE_NAME
from tests.helpers import Meshd, wait_until

pytestmark = pytest.mark.fleet

MIB = 1 << 20


def _exited(m: Meshd, timeout_s: float = 30.0) -> int:
    assert m.proc is not None
    return m.proc.wait(timeout_s)


def _config(tmp_path, name: str = "m1", extra: str = "") -> str:
    path = tmp_path / f"{name}.toml"
    path.write_text(f'name = "{name}"\n[pools.default]\nslots = 2\n{extra}')
    return str(path)


# --- point 8: a disk error at start -------------------------------------------------------------


@pytest.mark.parametrize("point, what", [
    ("secret.fsync=1", "fleet secret"),
    ("blob.fsync=1", "blob store"),
])
def test_disk_error_at_start_is_a_fail_stop_not_a_traceback(tmp_path, point: str, what: str):
    """An EIO while the member starts (writing the fleet secret, the blob store's first sync)
    stops it with the fail-stop message and the disk's exit code, not a traceback and exit 1."""
    m = Meshd(str(tmp_path / "m1"), env={"MESHJOBS_FAILPOINTS": point})
    try:
        m.start(wait_ready=False)
        assert _exited(m) == EXIT_DISK
        log = m.log_tail(20000)
        assert "Traceback" not in log, log
        assert '"fail_stop"' in log and what in log and "injected failure" in log, log
        assert "check the disk" in log, log
    finally:
        m.stop()


def test_journal_eio_exits_with_the_disk_code(meshd_factory):
    """A journal fsync that fails stops the member with the one code for a failed disk."""
    m = meshd_factory(env={"MESHJOBS_FAILPOINTS": "journal.fsync=6"})
    for i in range(20):
        try:
            m.request("POST", "/jobs", {"argv": ["true"], "id": f"j{i}"}, timeout_s=10)
        except OSError:
            break
    assert _exited(m) == EXIT_DISK
    assert "Traceback" not in m.log_tail(20000)


# --- point 7: a full disk, through the failpoint -------------------------------------------------


def _read_only_checks(m: Meshd, job_id: str) -> None:
    """Reads are served; submits are refused naming the full disk; health and /fleet say so."""
    status, health = m.request("GET", "/healthz")
    assert status == 200 and health["disk_full"] is True and health["ok"] is False, health
    assert health["state"] == "read_only"
    status, job = m.request("GET", f"/jobs/{job_id}")
    assert status == 200 and job["state"] == "done"
    status, jobs = m.request("GET", "/jobs")
    assert status == 200 and job_id in {j["id"] for j in jobs}
    status, out = m.request("GET", f"/jobs/{job_id}/results")
    assert status == 200 and out == b"before\n"
    status, fleet = m.request("GET", "/fleet")
    assert status == 200 and [r["disk_full"] for r in fleet["members"]] == [True]
    status, body = m.request("POST", "/jobs", {"argv": ["true"]})
    assert status == 507 and "disk" in body["error"] and "full" in body["error"], body
    # With items the HTTP edge would store them first: refused before writing anything.
    status, body = m.request("POST", "/jobs", {"argv": ["cat"], "items": ["x" * 100]})
    assert status in (503, 507) and "full" in body["error"], body


def test_disk_full_failpoint_start_read_only(meshd_factory):
    """With free space reading 0 (failpoint disk.full) a member with finished work starts
    read-only: reads served, submits refused with a message naming the full disk, /healthz and
    /fleet say so; the metrics count it."""
    m = meshd_factory()
    status, rec = m.request("POST", "/jobs", {"argv": ["sh", "-c", "echo before"]})
    assert status == 201
    assert m.wait_job(rec["id"])["state"] == "done"
    assert m.terminate() == 0
    m.extra_env = {"MESHJOBS_FAILPOINTS": "disk.full=1"}
    m.start()
    _read_only_checks(m, rec["id"])
    assert m.metrics()["meshjobs_disk_full"] == 1


def test_disk_full_failpoint_passes_and_the_member_resumes(meshd_factory):
    """Free space that reads 0 for the first polls only: the member starts read-only and takes
    work again by itself once the disk has room."""
    m = meshd_factory(env={"MESHJOBS_FAILPOINTS": "disk.full=1..3"})
    status, health = m.request("GET", "/healthz")
    first = health["disk_full"]
    wait_until(lambda: m.request("GET", "/healthz")[1]["disk_full"] is False, what="disk_full to clear")
    status, rec = m.request("POST", "/jobs", {"argv": ["sh", "-c", "echo after"]})
    assert status == 201, rec
    assert m.wait_job(rec["id"])["state"] == "done"
    assert first is True or m.metrics()["meshjobs_node_disk_full_off_total"] >= 1


# --- point 7: a full disk, for real (tmpfs) -------------------------------------------------------


@pytest.fixture
def small_disk(tmp_path):
    """A 40 MiB tmpfs of its own; skipped where mounting is not allowed."""
    where = tmp_path / f"disk-{uuid.uuid4().hex[:6]}"
    where.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=40m", "tmpfs", str(where)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({r.stderr.strip() or r.returncode}): needs root")
    try:
        yield str(where)
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)


def _fill(folder: str, leave_bytes: int = 0) -> str:
    """Fill the disk holding `folder` until at most `leave_bytes` are free."""
    path = os.path.join(folder, "filler")
    chunk = b"\xa5" * MIB
    with open(path, "ab") as f:
        while True:
            st = os.statvfs(folder)
            free = st.f_bavail * st.f_frsize
            if free <= leave_bytes:
                break
            try:
                f.write(chunk[: max(4096, min(len(chunk), free - leave_bytes))])
                f.flush()
            except OSError as e:
                assert e.errno == errno.ENOSPC
                break
    return path


def _member_on(disk: str, tmp_path, free_min_mib: int) -> Meshd:
    """A member whose data folder is on `disk`; its log (the test reads it) is not: on the disk
    the test fills, which lines reach the log would depend on how full the log's last page is."""
    cfg = _config(tmp_path, extra=f"[blobs]\ndisk_free_min = {free_min_mib * MIB}\n")
    m = Meshd(os.path.join(disk, "m1"), config=cfg)
    m.log_path = str(tmp_path / "m1.log")
    return m


def test_member_starts_on_a_full_disk_read_only_and_resumes(small_disk, tmp_path):
    """A disk filled to the last byte while the member was down: it starts (its reserve file,
    deleted first, gives the journal room for a new term), read-only, serving reads and refusing
    submits; once space is freed it takes work again by itself."""
    m = _member_on(small_disk, tmp_path, free_min_mib=8)
    try:
        m.start()
        assert os.path.exists(os.path.join(m.data, RESERVE_NAME))
        status, rec = m.request("POST", "/jobs", {"argv": ["sh", "-c", "echo before"]})
        assert status == 201
        assert m.wait_job(rec["id"])["state"] == "done"
        assert m.terminate() == 0
        filler = _fill(small_disk)
        st = os.statvfs(small_disk)
        assert st.f_bavail * st.f_frsize < 64 * 1024
        m.start()
        _read_only_checks(m, rec["id"])
        assert not os.path.exists(os.path.join(m.data, RESERVE_NAME))
        assert "Traceback" not in m.log_tail(50000)
        os.unlink(filler)
        wait_until(lambda: not m.request("GET", "/healthz")[1]["disk_full"], what="the member to resume")
        assert m.request("GET", "/healthz")[1]["disk_free_bytes"] >= 8 * MIB
        status, after = m.request("POST", "/jobs", {"argv": ["sh", "-c", "echo after"]})
        assert status == 201, after
        assert m.wait_job(after["id"])["state"] == "done"
        assert m.request("GET", f"/jobs/{after['id']}/results")[1] == b"after\n"
        wait_until(lambda: os.path.exists(os.path.join(m.data, RESERVE_NAME)), what="the reserve again")
    finally:
        m.stop()


def test_disk_free_min_backpressure(small_disk, tmp_path):
    """Below [blobs] disk_free_min (though the disk still has room) the member takes no new
    leases and refuses submits with a clear message; above it again it resumes and the items
    it held back run."""
    m = _member_on(small_disk, tmp_path, free_min_mib=16)
    try:
        m.start()
        status, rec = m.request("POST", "/jobs", {"argv": ["sh", "-c", "echo $MESH_ITEM_INDEX"],
                                                  "hold": True, "items": [""] * 3})
        assert status == 201
        filler = _fill(small_disk, leave_bytes=10 * MIB)
        wait_until(lambda: m.request("GET", "/healthz")[1]["disk_full"], what="disk_free_min to bite")
        status, body = m.request("POST", "/jobs", {"argv": ["true"]})
        assert status == 507 and "disk_free_min" in body["error"], body
        granted = m.metrics().get("meshjobs_table_leases_granted_total", 0)
        # Released while the disk is low: a change is still taken (the journal has room), but
        # no item is leased.
        status, toned = m.request("POST", f"/jobs/{rec['id']}/tone", {"hold": False})
        assert status == 200, toned
        # A lease would be proposed in the leader's next round; a change committed after the
        # release shows that round (and more) went by without one.
        status, toned = m.request("POST", f"/jobs/{rec['id']}/tone", {"priority": 1})
        assert status == 200, toned
        status, job = m.request("GET", f"/jobs/{rec['id']}")
        assert job["state"] != "done"
        assert m.metrics().get("meshjobs_table_leases_granted_total", 0) == granted
        os.unlink(filler)
        wait_until(lambda: not m.request("GET", "/healthz")[1]["disk_full"], what="the member to resume")
        assert m.wait_job(rec["id"])["state"] == "done"
        assert m.request("GET", f"/jobs/{rec['id']}/results")[1] == b"0\n1\n2\n"
    finally:
        m.stop()
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(small_disk, "filler"))


def test_disk_filling_under_a_running_member(small_disk, tmp_path):
    """A disk that fills to the last byte under a running member: it turns read-only (and gives
    its reserve back), serves reads, and stays up. If something else then takes even the room
    the reserve gave back, a restart cannot write its term: it stops with ENOSPC named and the
    disk's exit code, never a traceback."""
    m = _member_on(small_disk, tmp_path, free_min_mib=8)
    try:
        m.start()
        status, rec = m.request("POST", "/jobs", {"argv": ["sh", "-c", "echo before"]})
        assert status == 201
        assert m.wait_job(rec["id"])["state"] == "done"
        _fill(small_disk)
        wait_until(lambda: m.request("GET", "/healthz")[1]["disk_full"], what="the member to see its disk")
        wait_until(lambda: not os.path.exists(os.path.join(m.data, RESERVE_NAME)), what="the reserve freed")
        _read_only_checks(m, rec["id"])
        assert m.proc.poll() is None
        assert m.terminate() == 0
        # The room the reserve gave back is taken too, and so is the page of the old http.addr
        # (which the next start deletes first).
        os.unlink(os.path.join(m.data, "http.addr"))
        _fill(small_disk)
        m.start(wait_ready=False)
        assert _exited(m) == EXIT_DISK
        log = m.log_tail(50000)
        assert "no space left on device" in log and "Traceback" not in log, log
    finally:
        m.stop()


# --- the pieces ------------------------------------------------------------------------------------


@pytest.mark.parametrize("exc, code", [
    (OSError(errno.EIO, "fsync"), EXIT_DISK),
    (OSError(errno.ENOSPC, "write"), EXIT_DISK),
    ("lmdb.DiskError", EXIT_DISK),
    ("lmdb.Error", EXIT_DISK),
    (AssertionError("a bug"), 70),
    (KeyError("a bug"), 70),
])
def test_one_exit_code_for_a_failed_or_full_disk(exc, code):
    """The journal's, the dump's and LMDB's disk errors (ENOSPC or EIO) all stop the member with
    EXIT_DISK (71); anything else is a bug of our own (70)."""
    import lmdb
    import structlog

    from meshjobs.replica import fail_stop

    if exc == "lmdb.DiskError":
        exc = lmdb.DiskError("mdb_txn_commit: No space left on device")
    elif exc == "lmdb.Error":
        exc = lmdb.Error("mdb_txn_commit: Input/output error")
    codes: list[int] = []
    fail_stop(structlog.get_logger("t"), "test", exc, exit_fn=codes.append, path="/")
    assert codes == [code]


def test_eio_on_a_full_disk_is_named_enospc(small_disk):
    """LMDB (and some file systems) report a short write on a full disk as EIO: with the disk
    all but full, the message says "no space left on device"; with room, it stays an EIO."""
    import lmdb

    from meshjobs.diskspace import describe, is_full

    eio = lmdb.Error("mdb_txn_commit: Input/output error")
    assert not is_full(eio, small_disk) and "no space" not in describe(eio, small_disk)
    filler = _fill(small_disk)
    try:
        assert is_full(eio, small_disk)
        text = describe(eio, small_disk)
        assert text.startswith("no space left on device") and "input/output error" in text
        assert is_full(OSError(errno.EIO, "x"), small_disk)
        assert is_full(lmdb.DiskError("x"), None) and is_full(OSError(errno.ENOSPC, "x"), None)
        # The blob store itself on the full disk: its error is named for what it is.
        from blobstore import LmdbBlobStore

        os.unlink(filler)
        store = LmdbBlobStore(os.path.join(small_disk, "blobs"))
        filler = _fill(small_disk)
        with pytest.raises(Exception) as info:
            for k in range(64):
                store.put(os.urandom(256 * 1024) + bytes([k]))
        assert is_full(info.value, small_disk), repr(info.value)
        store.close()
    finally:
        os.unlink(filler)


def test_watch_turns_full_below_the_minimum_and_back_above_it_plus_the_reserve(tmp_path):
    """DiskWatch: full below free_min; not full again only with free_min plus the reserve free
    (no flapping: making the reserve again must not take it under the minimum); every check and
    change reported, in order."""
    from meshjobs.diskspace import DiskWatch, Reserve
    from meshjobs.failpoints import Failpoints

    changes: list[bool] = []

    def report(full: bool, _free: int) -> None:
        if not changes or changes[-1] != full:
            changes.append(full)

    folder = str(tmp_path)
    free = os.statvfs(folder).f_bavail * os.statvfs(folder).f_frsize
    reserve = Reserve(folder, size_bytes=MIB)
    watch = DiskWatch(folder, free_min=free // 2, failpoints=Failpoints("disk.full=2..3"),
                      on_report=report, reserve=reserve)
    assert watch.check() is False and reserve.held()  # room: the reserve is made
    assert watch.check() is True  # reads 0 free, and again after giving the reserve back
    assert not reserve.held()  # all but full: the reserve was given back
    assert watch.check() is False and reserve.held()
    assert changes == [False, True, False]
    watch.write_failed(OSError(errno.ENOSPC, "x"))
    assert watch.full and changes == [False, True, False, True] and not reserve.held()
    assert "disk_free_min" in watch.refusal()


def test_fleet_shows_a_member_with_a_full_disk_and_leases_it_nothing(tmp_path):
    """In a fleet of three, a voter whose disk reads full is shown with disk_full in the
    leader's /fleet (learnt from the member's reports, or its own row), is given no items, and
    refuses submits asked of it; the other two run the work."""
    from tests.helpers import make_fleet

    members = make_fleet(str(tmp_path), voters=3)
    full = members[2]
    full.extra_env = {"MESHJOBS_FAILPOINTS": "disk.full=1"}
    try:
        for m in members:
            m.start(wait_ready=False)
        for m in members:
            m.wait_ready()

        def fleet_says_full() -> bool:
            # The leader's /fleet has every member's report (a follower knows only its own).
            for m in members:
                status, health = m.request("GET", "/healthz")
                if health.get("is_leader"):
                    rows = {r["name"]: r for r in m.request("GET", "/fleet")[1]["members"]}
                    return rows[full.name].get("disk_full") is True
            return False

        wait_until(fleet_says_full, what="the leader's /fleet to show the full disk", timeout_s=60)
        status, body = full.request("POST", "/jobs", {"argv": ["true"]})
        assert status == 507 and full.name in body["error"], body
        status, rec = members[0].request("POST", "/jobs", {
            "argv": ["sh", "-c", "echo $MESH_MEMBER"], "items": [""] * 6})
        assert status == 201, rec
        done = members[0].wait_job(rec["id"])
        assert done["state"] == "done"
        ran_on = {it.get("member") for it in done.get("items", [])}
        assert ran_on and ran_on <= {m.name for m in members[:2]}, ran_on
        # The member with the full disk serves reads of that job (from its own table, which
        # follows the log).
        assert full.wait_job(rec["id"])["state"] == "done"
    finally:
        for m in members:
            m.stop()


def test_items_of_a_crashed_run_are_not_rerun_on_a_full_disk(meshd_factory):
    """A member killed with an item running restarts on a full disk: the item's lease (of the
    last run) is revoked, and the read-only member does not lease it again to run it (its outputs
    could not be stored); once space is back it runs."""
    m = meshd_factory()
    status, rec = m.request("POST", "/jobs", {"argv": ["sh", "-c", "sleep 1; echo ran"]})
    assert status == 201

    def job() -> dict:
        return m.request("GET", f"/jobs/{rec['id']}")[1]

    wait_until(lambda: job()["items_running"] == 1, what="the item to run")
    m.kill9()
    m.extra_env = {"MESHJOBS_FAILPOINTS": "disk.full=1..20"}
    m.start()
    assert m.request("GET", "/healthz")[1]["disk_full"] is True
    # The revoke of the last run's lease is committed (the item is pending again) ...
    wait_until(lambda: job()["items_pending"] == 1, what="the old lease to be revoked")
    # ... and a change committed after it shows the leader went round without leasing it.
    status, _toned = m.request("POST", f"/jobs/{rec['id']}/tone", {"priority": 1})
    assert status == 200
    runs = m.metrics().get("meshjobs_node_runs_started_total", 0)
    assert m.request("GET", "/healthz")[1]["disk_full"] is True, "the disk came back too soon"
    assert runs == 0
    done = m.wait_job(rec["id"])  # space is back after twenty looks: it runs
    assert done["state"] == "done"
    assert m.request("GET", f"/jobs/{rec['id']}/results")[1] == b"ran\n"


def test_worker_restarted_on_a_full_disk_stops_with_the_disk_code(small_disk, tmp_path):
    """A worker member writes nothing at start but its HTTP address (it keeps no journal): on
    a disk with no room left for that, it stops with ENOSPC named and the disk's exit code,
    never a traceback."""
    import shutil

    from tests.helpers import make_fleet, start_all

    voter, worker = make_fleet(str(tmp_path), voters=1, workers=1)
    data = os.path.join(small_disk, worker.name)
    shutil.copytree(worker.data, data)
    worker.data = data  # its config and log stay off the small disk
    try:
        start_all([voter, worker])
        _fill(small_disk)  # under the running worker: it gives its reserve back ...
        wait_until(lambda: not os.path.exists(os.path.join(data, RESERVE_NAME)),
                   what="the reserve freed")
        assert worker.terminate() == 0
        os.unlink(os.path.join(data, "http.addr"))  # (no room given back by the next start)
        _fill(small_disk)  # ... and that room is taken too
        worker.start(wait_ready=False)
        assert _exited(worker) == EXIT_DISK
        log = worker.log_tail(50000)
        assert "no space left on device" in log and "Traceback" not in log, log
        assert "http.addr" in log, log
    finally:
        voter.stop()
        worker.stop()
