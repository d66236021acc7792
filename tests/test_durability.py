"""Durability of a real meshd: fsync failure stops the member, damaged journals are handled."""

from __future__ import annotations

import os
import urllib.error

import pytest

from tests.helpers import submit_big_entry, wait_until

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
    return os.path.join(m.data, "raft.journal")


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
    wait_until(lambda: os.path.getsize(_journal(meshd)) < limits.log_compaction_bytes_min, 30,
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
    wait_until(lambda: os.path.getsize(_journal(m)) < limits.log_compaction_bytes_min, 30,
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
