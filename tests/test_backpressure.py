"""Backpressure on payload memory, on a real member: while more than `[blobs] mem_max` bytes of
output wait to be stored, the member takes no new leases; it resumes once they are stored, and
nothing is dropped."""

from __future__ import annotations

import time

import pytest

from tests.helpers import Meshd

pytestmark = pytest.mark.fleet


def _metrics(m) -> dict[str, float]:
    return m.metrics()


def test_pressure_stops_leases_then_resumes(tmp_path):
    """With a small mem_max and slow blob writes, pressure goes on, then off again, more than
    once; the job completes with every output correct and nothing dropped. (That no lease is
    proposed while it is on is checked on the node itself, in test_node.py, where a test can
    see every proposal.)"""
    cfg = tmp_path / "m.toml"
    cfg.write_text('name = "m1"\n[pools.default]\nslots = 4\n[blobs]\nmem_max = 20000\n')
    m = Meshd(str(tmp_path / "m1"), config=str(cfg),
              env={"MESHJOBS_FAILPOINTS": "blob.write=sleep:150"})
    try:
        m.start()
        status, rec = m.request("POST", "/jobs", {
            "argv": ["sh", "-c", "head -c 10000 /dev/zero | tr '\\0' x; echo $MESH_ITEM_INDEX"],
            "items": [""] * 24})
        assert status in (200, 201), rec
        samples = []
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            mt = _metrics(m)
            samples.append((mt.get("meshjobs_node_pressure_on_total", 0), mt.get("meshjobs_node_pressure_off_total", 0),
                            mt.get("meshjobs_blob_pressure", 0), mt.get("meshjobs_table_leases_granted_total", 0)))
            if m.request("GET", f"/jobs/{rec['id']}")[1]["state"] == "done":
                break
            time.sleep(0.01)  # sleep-ok: the sampling interval (pressure is seen while it lasts)
        saw_pressure = any(pressure for _on, _off, pressure, _granted in samples)
        done = m.wait_job(rec["id"])
        assert done["state"] == "done"
        assert saw_pressure, "pressure never went on"
        mt = _metrics(m)
        assert mt.get("meshjobs_node_pressure_on_total", 0) >= 1
        assert mt.get("meshjobs_node_pressure_off_total", 0) >= 1
        status, out = m.request("GET", f"/jobs/{rec['id']}/results")
        assert out == b"".join(b"x" * 10000 + f"{i}\n".encode() for i in range(24))
    finally:
        m.stop()
