"""Durability of a real meshd: fsync failure stops the member, damaged journals are handled."""

from __future__ import annotations

import os
import urllib.error

import pytest

from tests.helpers import journal_bytes, journal_segments, submit_big_entry, wait_until

pytestmark = pytest.mark.fleet


def test_fsync_failure_fail_stops_and_acknowledges_nothing_after(meshd_factory):
    """An fsync error stops the member at once with a non-zero exit; every submit acknowledged
    before it is there after a restart, and nothing is acknowledged after it."""
    m = meshd_factory(env={"MESHJOBS_FAILPOINTS": "journal.fsync=25"})
    acked: list[str] = []
    failed_at = None
    for i in range(200):
        try:
            status, rec = m.request("POST", "/jobs", {"argv": ["true"], "id": f"j{i}"}, timeout_s=15)
        except (urllib.error.URLError, ConnectionError, OSError):
            failed_at = i
            break
        if status in (200, 201):
            acked.append(rec["id"])
        else:
            failed_at = i
            break
    assert failed_at is not None, "the injected fsync failure never happened"
    assert m.proc.wait(15) not in (0, None), "the member must exit non-zero"
    assert acked, "some submits should have been acknowledged before the failure"
    # Nothing after the failure was acknowledged: the member is gone.
    with pytest.raises((urllib.error.URLError, ConnectionError, OSError)):
        m.request("GET", "/healthz", timeout_s=2)
    m.extra_env = {}
    m.start()
    status, jobs = m.request("GET", "/jobs")
    have = {j["id"] for j in jobs}
    assert set(acked) <= have, f"acknowledged but lost: {sorted(set(acked) - have)}"


def _journal(m) -> str:
    """The journal segment the member writes to now."""
    return journal_segments(m.data)[-1]


def _fill(m, n: int) -> list[str]:
    ids = []
    for i in range(n):
        status, rec = m.request("POST", "/jobs", {"argv": ["true"], "id": f"t{i}"})
        assert status in (200, 201), rec
        ids.append(rec["id"])
    for job_id in ids:
        m.wait_job(job_id)
    return ids


def test_torn_last_record_is_dropped(meshd):
    """A journal whose last record is torn (power lost mid-write) opens: the tail is dropped and
    everything before it is intact."""
    ids = _fill(meshd, 6)
    assert meshd.terminate() == 0
    path = _journal(meshd)
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size - 3)
    meshd.start()
    status, jobs = meshd.request("GET", "/jobs")
    assert status == 200
    assert set(ids[:5]) <= {j["id"] for j in jobs}
    # and the member still takes work
    status, rec = meshd.request("POST", "/jobs", {"argv": ["true"]})
    assert status in (200, 201)
    assert meshd.wait_job(rec["id"])["state"] == "done"


def test_garbage_tail_is_dropped(meshd):
    """Half-written bytes after the last record (a record header with no body) are a torn tail."""
    ids = _fill(meshd, 3)
    meshd.kill9()
    with open(_journal(meshd), "ab") as f:
        f.write(b"\x00\x07garbage-that-never-synced")
    meshd.start()
    status, jobs = meshd.request("GET", "/jobs")
    assert set(ids) <= {j["id"] for j in jobs}


def test_flipped_byte_in_the_middle_stops_the_member(meshd):
    """One flipped byte inside a record with valid records after it is damage, not a torn tail:
    the member refuses to start, loudly, and says what to do."""
    _fill(meshd, 10)
    assert meshd.terminate() == 0
    path = _journal(meshd)
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.seek(size // 3)
        b = f.read(1)
        f.seek(size // 3)
        f.write(bytes([b[0] ^ 0x40]))
    with pytest.raises(RuntimeError) as e:
        meshd.start()
    assert meshd.proc.returncode not in (0, None)
    assert "journal" in str(e.value).lower()


def test_blob_fsync_failure_on_submit_fail_stops(meshd_factory):
    """An fsync error while storing a submit's payloads stops the member (non-zero exit); the
    submit is not acknowledged."""
    m = meshd_factory(env={"MESHJOBS_FAILPOINTS": "blob.fsync=3"})
    answered = []
    for i in range(20):
        try:
            status, rec = m.request("POST", "/jobs", {"argv": ["cat"], "items": [f"payload {i}"]},
                                    timeout_s=15)
        except (urllib.error.URLError, ConnectionError, OSError):
            break
        answered.append(status)
        if status >= 500:
            break
    assert m.proc.wait(15) not in (0, None), "the member must exit non-zero"
    assert answered.count(201) + answered.count(200) < 20


def test_log_compacted_by_size(meshd):
    """The log is held in memory until it is compacted: past log_compaction_bytes_min of
    entries it is compacted (a dump written, the journal cut), however few entries it has, and
    everything is still there after a restart."""
    from meshjobs import limits

    rec = submit_big_entry(meshd)
    n = limits.log_compaction_bytes_min // 30  # the items submit_big_entry submits
    wait_until(lambda: journal_bytes(meshd.data) < limits.log_compaction_bytes_min, 30,
               what="the journal compacted")
    assert os.path.exists(os.path.join(meshd.data, "raft.dump"))
    assert meshd.terminate() == 0
    meshd.start()
    status, job = meshd.request("GET", f"/jobs/{rec['id']}")
    assert status == 200 and job["items_total"] == n and job["state"] == "held"


def _wait_metric(m, name: str, at_least: float, timeout_s: float = 60.0) -> float:
    return wait_until(lambda: (v := m.metrics().get(f"meshjobs_{name}_total", 0.0)) >= at_least and v,
                      timeout_s, what=f"{name} at {at_least} or more")


def test_failed_dump_fsync_is_retried_and_compaction_resumes(meshd_factory):
    """A dump is not the log: a failed fsync of raft.dump.tmp is counted and tried again with
    backoff, the member keeps serving (the journal is still the durable record), the journal is
    compacted once a dump succeeds, and nothing acknowledged is lost across a restart."""
    from meshjobs import limits

    m = meshd_factory(env={"MESHJOBS_FAILPOINTS": "dump.fsync=1..3"})
    big = submit_big_entry(m)
    # The three failures happen (each retried after its backoff) ...
    _wait_metric(m, "dump_failures", 3)
    # ... the member still takes and runs work meanwhile and after ...
    status, rec = m.request("POST", "/jobs", {"argv": ["sh", "-c", "echo after"]})
    assert status == 201, rec
    assert m.wait_job(rec["id"])["state"] == "done"
    # ... and the fourth try writes the dump: the journal is cut.
    _wait_metric(m, "dumps_written", 1)
    wait_until(lambda: journal_bytes(m.data) < limits.log_compaction_bytes_min, 30,
               what="the journal compacted after the dump")
    assert m.metrics()["meshjobs_dump_failures_total"] == 3
    assert not os.path.exists(os.path.join(m.data, "raft.dump.tmp"))
    assert m.terminate() == 0
    m.extra_env = {}
    m.start()
    status, job = m.request("GET", f"/jobs/{big['id']}")
    assert status == 200 and job["state"] == "held"
    status, job = m.request("GET", f"/jobs/{rec['id']}")
    assert status == 200 and job["state"] == "done"


def test_failed_dump_never_stops_the_member_and_the_journal_keeps_everything(meshd_factory):
    """While every dump fails, the member goes on serving from its journal; after a restart
    (with the disk healthy) every acknowledged job is there."""
    m = meshd_factory(env={"MESHJOBS_FAILPOINTS": "dump.fsync=1"})
    big = submit_big_entry(m)
    _wait_metric(m, "dump_failures", 2)
    ids = _fill(m, 5)
    assert m.proc.poll() is None
    assert m.metrics().get("meshjobs_dumps_written_total", 0) == 0
    assert m.terminate() == 0
    m.extra_env = {}
    m.start()
    status, jobs = m.request("GET", "/jobs")
    assert status == 200
    assert set(ids) | {big["id"]} <= {j["id"] for j in jobs}


# --- a dump starts a journal segment: crashes at each step of its end -----------------------------


def _dump_renamed(m) -> bool:
    """The dump writer renamed its dump into place (there is a raft.dump and a second
    segment: the one its start began)."""
    return os.path.exists(os.path.join(m.data, "raft.dump")) and len(journal_segments(m.data)) >= 2


def _jobs(m) -> set[str]:
    status, jobs = m.request("GET", "/jobs?limit=1000")
    assert status == 200
    return {j["id"] for j in jobs}


def _kill_at(meshd_factory, point: str, reached) -> None:
    """Hold the dump writer at `point` (a slow failpoint), submit jobs meanwhile, kill -9 the
    member (its writer dies with it), start it again: every acknowledged job is there, and the
    next dump leaves one segment."""
    m = meshd_factory(env={"MESHJOBS_FAILPOINTS": f"{point}=sleep:600000"})
    big = submit_big_entry(m)
    wait_until(lambda: reached(m), 60, f"the dump writer at {point}")
    during = _fill(m, 4)
    m.kill9()
    m.extra_env = {}
    m.start()
    assert {big["id"], *during} <= _jobs(m)
    submit_big_entry(m)  # a dump again: it deletes whatever the killed one left
    wait_until(lambda: len(journal_segments(m.data)) == 1, 60, "one segment left")
    assert m.terminate() == 0
    m.start()
    assert {big["id"], *during} <= _jobs(m)


def test_kill_while_a_dump_is_written(meshd_factory):
    """Killed with the dump half-written (raft.dump.tmp) and the new segment started: nothing
    acknowledged is lost."""
    _kill_at(meshd_factory, "dump.fsync",
             lambda m: os.path.exists(os.path.join(m.data, "raft.dump.tmp")))


def test_kill_after_the_dump_renamed_before_the_segment_synced(meshd_factory):
    """Killed after the dump's rename, before the new segment and the folder are fsynced."""
    _kill_at(meshd_factory, "journal.segment_fsync", _dump_renamed)


def test_kill_before_the_older_segments_are_deleted(meshd_factory):
    """Killed with the dump and the new segment durable and the older segments not deleted:
    the member starts from the new segment and the next dump deletes the leftovers."""
    _kill_at(meshd_factory, "journal.segment_delete", _dump_renamed)


def test_a_failed_segment_fsync_keeps_every_segment(meshd_factory):
    """An fsync error after the dump's rename (the new segment or the folder) is a failed dump,
    not a failed member: the older segments are kept, the next dump deletes them, and nothing
    is lost across a restart."""
    m = meshd_factory(env={"MESHJOBS_FAILPOINTS": "journal.segment_fsync=1..1"})
    big = submit_big_entry(m)
    _wait_metric(m, "dump_failures", 1)
    assert len(journal_segments(m.data)) >= 2
    ids = _fill(m, 3)
    _wait_metric(m, "dumps_written", 1)
    wait_until(lambda: len(journal_segments(m.data)) == 1, 60, "one segment left")
    assert m.terminate() == 0
    m.extra_env = {}
    m.start()
    assert {big["id"], *ids} <= _jobs(m)


def test_entries_logged_during_a_dump_are_not_written_again(meshd_factory):
    """The entries logged while a dump is written stay in the file they were appended to when
    the dump ends (a new segment since its start): the end of a dump writes nothing again and
    fsyncs nothing on the jobs thread (before, the journal was rewritten into a new file)."""
    m = meshd_factory(env={"MESHJOBS_FAILPOINTS": "dump.fsync=sleep:1500"})
    submit_big_entry(m)
    wait_until(lambda: os.path.exists(os.path.join(m.data, "raft.dump.tmp")), 60,
               "a dump being written")
    during = _fill(m, 3)
    current = _journal(m)
    inode = os.stat(current).st_ino
    _wait_metric(m, "dumps_written", 1)
    segments = journal_segments(m.data)
    if segments[:1] == [current]:
        # The older segments are gone; the one written during the dump is the same file. (A
        # later segment is the next dump's: the new segment opens with the entries after the
        # dump's index, and when those hold the big entry the log is large again at once.)
        assert os.stat(current).st_ino == inode
        assert all(s > current for s in segments[1:]), segments
    else:
        # Only a second dump, done since, may have retired it.
        assert current not in segments and all(s > current for s in segments), segments
        _wait_metric(m, "dumps_written", 2)
    assert m.terminate() == 0
    m.extra_env = {}
    m.start()
    assert set(during) <= _jobs(m)
