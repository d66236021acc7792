"""Retention and collection on a real member: old finished jobs are forgotten automatically and
their blobs collected once unpinned; pinned blobs survive collection across restarts."""

from __future__ import annotations

import os

import pytest

from tests.helpers import Meshd, wait_until

pytestmark = pytest.mark.fleet


def _member(tmp_path, keep_s: float | None, gc_grace_s: float = 0.0, keep_jobs: int | None = None) -> Meshd:
    cfg = tmp_path / "meshd.toml"
    retention = []
    if keep_s is not None:
        retention.append(f"keep_s = {keep_s}")
    if keep_jobs is not None:
        retention.append(f"keep_jobs = {keep_jobs}")
    cfg.write_text(
        'name = "m1"\n'
        "[pools.default]\nslots = 2\n"
        f"[blobs]\ngc_grace_s = {gc_grace_s}\ngc_every_s = 0.5\n"
        "[retention]\n" + "\n".join(retention) + "\n")
    m = Meshd(str(tmp_path / "m1"), config=str(cfg))
    return m


def _collection_ran(m: Meshd) -> None:
    """Wait for a collection (grace 0) after the member restarted and its leader reconciled the
    pins: one that removed the output of a job forgotten since. A collection goes over every
    blob, so a blob it had to keep and kept is checked, not merely not yet looked at."""
    status, rec = m.request("POST", "/jobs", {"argv": ["echo", f"witness-{os.urandom(8).hex()}"]})
    assert status == 201, rec
    witness = m.wait_job(rec["id"])["items"][0]["stdout"]
    assert m.request("GET", f"/blobs/{witness}")[0] == 200
    assert m.ctl("job", "forget", rec["id"]).returncode == 0
    wait_until(lambda: m.request("GET", f"/blobs/{witness}")[0] == 404, what="a collection")


def test_old_jobs_are_forgotten_and_their_blobs_collected(tmp_path):
    """keep_s: a finished job older than it is forgotten (status 404 "forgotten"); its output
    blob loses its pin and is collected after gc_grace_s; a job still running is kept."""
    m = _member(tmp_path, keep_s=1.0)
    try:
        m.start()
        status, rec = m.request("POST", "/jobs", {"argv": ["sh", "-c", "echo retained-$$"]})
        done = m.wait_job(rec["id"])
        digest = done["items"][0]["stdout"]
        assert m.request("GET", f"/blobs/{digest}")[0] == 200
        status, slow = m.request("POST", "/jobs", {"argv": ["sleep", "4"]})
        wait_until(lambda: m.request("GET", f"/jobs/{rec['id']}")[0] == 404, what="expiry")
        status, body = m.request("GET", f"/jobs/{rec['id']}")
        assert "forgotten" in body["error"]
        wait_until(lambda: m.request("GET", f"/blobs/{digest}")[0] == 404, what="collection")
        assert m.request("GET", f"/jobs/{slow['id']}")[0] == 200  # running: kept
    finally:
        m.stop()


def test_keep_jobs_bounds_the_table(tmp_path):
    """keep_jobs: only the newest N finished jobs stay."""
    m = _member(tmp_path, keep_s=None, keep_jobs=3)
    try:
        m.start()
        ids = []
        for i in range(6):
            status, rec = m.request("POST", "/jobs", {"argv": ["true"], "id": f"k{i}"})
            m.wait_job(rec["id"])
            ids.append(rec["id"])
        wait_until(lambda: len(m.request("GET", "/jobs")[1]) == 3, what="trim to 3 jobs")
        assert [j["id"] for j in m.request("GET", "/jobs")[1]] == ids[3:][::-1]  # newest first
    finally:
        m.stop()


def test_pinned_blobs_survive_collection_across_restart(tmp_path):
    """A blob pinned by a live job is never collected, also after a restart; once its job is
    forgotten it goes."""
    m = _member(tmp_path, keep_s=None)
    try:
        m.start()
        status, rec = m.request("POST", "/jobs", {"argv": ["sh", "-c", "echo pinned"], "items": ["in"]})
        done = m.wait_job(rec["id"])
        out, inp = done["items"][0]["stdout"], done["items"][0]["stdin"]
        m.kill9()
        m.start()
        _collection_ran(m)
        assert m.request("GET", f"/blobs/{out}") == (200, b"pinned\n")
        assert m.request("GET", f"/blobs/{inp}") == (200, b"in")
        assert m.ctl("job", "forget", rec["id"]).returncode == 0
        wait_until(lambda: m.request("GET", f"/blobs/{out}")[0] == 404, what="collection")
        assert m.request("GET", f"/blobs/{inp}")[0] == 404
        assert os.path.isdir(os.path.join(m.data, "blobs"))
    finally:
        m.stop()


def test_empty_blob_is_never_collected(tmp_path):
    """The empty payload, which every empty output names, stays through restarts and
    collections, also once every job that named it is forgotten."""
    m = _member(tmp_path, keep_s=None)
    try:
        m.start()
        status, rec = m.request("POST", "/jobs", {"argv": ["true"]})
        done = m.wait_job(rec["id"])
        empty = done["items"][0]["stdout"]
        assert m.ctl("job", "forget", rec["id"]).returncode == 0
        m.kill9()
        m.start()
        _collection_ran(m)
        assert m.request("GET", f"/blobs/{empty}") == (200, b"")
    finally:
        m.stop()
