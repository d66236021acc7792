"""Memory of the job table per finished item, and the cost of a snapshot, in process.

    python bench/table_memory.py [--items 1000000] [--copies] [--errors]

Builds a `JobTable` through `apply` alone, as a member does: jobs of 100,000 `true` items,
leased in batches and finished by result entries whose rows come through msgpack (as the log
delivers them, so each digest is its own bytes object unless the table shares it). Reports the
growth of the process's anonymous memory per item, and the time of `to_state()` and of packing
the snapshot. --copies: each result names a member holding a copy of its outputs (as results
with outputs to copy do); --errors: each says why its item could not start.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time

import msgpack

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import machine  # noqa: E402
from meshjobs.table import JobTable  # noqa: E402

PER_JOB = 100_000
BATCH = 4096
EMPTY = bytes.fromhex("af1349b9f5f9a1a6a0404dea36dcc9499bcb25c9adc112b7cc9a93cae41f3262")
SPEC = {"argv": ["true"], "pool": "default", "priority": 0, "retries": 0, "runtime_s": None,
        "hold": False, "tags": [], "env": {}, "cwd": None, "max_leases": None}


def rss_anon() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--items", type=int, default=1_000_000)
    ap.add_argument("--copies", action="store_true")
    ap.add_argument("--errors", action="store_true")
    a = ap.parse_args()
    t = JobTable()
    idx = 0
    gc.collect()
    base = rss_anon()
    for j in range(a.items // PER_JOB):
        idx += 1
        t.apply({"k": "submit", "t": 1, "id": f"j{j}", "spec": dict(SPEC), "dg": b"d%d" % j,
                 "items": [None] * PER_JOB}, idx)
        for k in range(0, PER_JOB, BATCH):
            idx += 1
            rng = range(k, min(PER_JOB, k + BATCH))
            t.apply({"k": "lease", "t": 2, "g": [[f"j{j}", i, "m1", "b1"] for i in rng]}, idx)
            epoch = idx
            idx += 1
            extra: list = []
            if a.errors or a.copies:
                extra = ["could not start 'x' on member: fix the job's argv" if a.errors else None]
            if a.copies:
                extra.append(["m2"])
            rows = msgpack.unpackb(msgpack.packb(
                [[f"j{j}", i, epoch, 2, 0, None, EMPTY, EMPTY, 3, 4, *extra] for i in rng],
                use_bin_type=True), raw=False)
            t.apply({"k": "result", "t": 3, "r": rows}, idx)
    gc.collect()
    used = rss_anon() - base
    t0 = time.perf_counter()
    state = t.to_state()
    t1 = time.perf_counter()
    raw = msgpack.packb(state, use_bin_type=True)
    t2 = time.perf_counter()
    print(f"machine: {machine()}")
    print("| figure | value |")
    print("|---|---|")
    what = " naming a copy" if a.copies else ""
    what += " with an error" if a.errors else ""
    print(f"| table memory, {a.items:,} finished items{what} | {used / a.items:.0f} B per item |")
    print(f"| snapshot of it | to_state {t1 - t0:.2f} s, msgpack {t2 - t1:.2f} s, "
          f"{len(raw) >> 20} MiB |")


if __name__ == "__main__":
    main()
