"""A 1 GiB output passes through a real member with bounded memory: streamed from the item into
the blob store, and out again through HTTP and `meshctl job results`."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import blake3
import pytest

from tests.helpers import env_with_path

pytestmark = pytest.mark.fleet

SIZE_BYTES = int(os.environ.get("MESHJOBS_STREAM_TEST_BYTES", str(1 << 30)))
PEAK_ANON_BYTES_MAX = 400 << 20  # "well under the payload size"


def _status(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field}")


class _PeakAnon:
    """Samples the member's anonymous memory (its own heap and stacks) while the payload moves.

    VmHWM is not the right measure here: LMDB serves reads from a memory map, so every page of
    the blob that is read counts in the process's RSS as file-backed page cache, which the
    kernel can drop at any time. RssAnon is the memory the member itself holds."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.peak = 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.peak = max(self.peak, _status(self.pid, "RssAnon"))
            except (OSError, AssertionError):
                return
            time.sleep(0.02)  # sleep-ok: the sampling interval of a memory probe

    def __enter__(self) -> _PeakAnon:
        self._t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._t.join(5)


def test_one_gib_output_streams_with_bounded_memory(meshd):
    """1 GiB of output: stored and served with the same digest, and the member's peak memory
    (VmHWM) stays far below the payload's size."""
    sampler = _PeakAnon(meshd.pid).__enter__()
    status, rec = meshd.request("POST", "/jobs", {
        "argv": ["sh", "-c", f"head -c {SIZE_BYTES} /dev/urandom"]})
    assert status in (200, 201), rec
    done = meshd.wait_job(rec["id"], timeout_s=600)
    assert done["state"] == "done", done
    digest = done["items"][0]["stdout"]
    # Out through meshctl (which streams /jobs/{id}/results): hash as it arrives.
    proc = subprocess.Popen([sys.executable, "-m", "meshjobs.cli", "--at", meshd.url, "job",
                             "results", rec["id"]], stdout=subprocess.PIPE, env=env_with_path())
    h = blake3.blake3()
    total = 0
    assert proc.stdout is not None
    while True:
        chunk = proc.stdout.read(1 << 20)
        if not chunk:
            break
        h.update(chunk)
        total += len(chunk)
    assert proc.wait(600) == 0
    assert total == SIZE_BYTES
    assert h.hexdigest() == digest
    sampler.__exit__()
    hwm = _status(meshd.pid, "VmHWM")
    print(f"meshd after a {SIZE_BYTES >> 20} MiB output: peak RssAnon {sampler.peak >> 20} MiB, "
          f"VmHWM {hwm >> 20} MiB (the latter counts LMDB's mapped pages)")
    assert 0 < sampler.peak < PEAK_ANON_BYTES_MAX, f"peak anonymous memory {sampler.peak >> 20} MiB"
