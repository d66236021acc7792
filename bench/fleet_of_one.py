"""Fleet of one: submit → result latency of a one-item `true` job, and `true` items per second.

    python bench/fleet_of_one.py [--jobs 100] [--items 1000] [--slots 2]

Latency: a client submits a job (POST /jobs, answered once committed and fsynced) and long-polls
it (GET /jobs/ID?wait=60, answered when the job has finished); the time from sending the submit
to having the finished record, one job at a time. Throughput: one job of N `true` items on a
member with two slots, from submit to finished.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import Member, machine, pct  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--jobs", type=int, default=100)
    ap.add_argument("--items", type=int, default=1000)
    ap.add_argument("--slots", type=int, default=2)
    a = ap.parse_args()
    print(f"machine: {machine()}")
    with Member(slots=a.slots) as m:
        for _ in range(5):  # warm up
            m.wait(m.post("/jobs", {"argv": ["true"]})["id"])
        lat = []
        for _ in range(a.jobs):
            t0 = time.perf_counter()
            rec = m.post("/jobs", {"argv": ["true"]})
            done = m.wait(rec["id"])
            lat.append((time.perf_counter() - t0) * 1000)
            assert done["state"] == "done"
        t0 = time.perf_counter()
        rec = m.post("/jobs", {"argv": ["true"], "items": [""] * a.items})
        done = m.wait(rec["id"])
        dt = time.perf_counter() - t0
        assert done["items_done"] == a.items
    print("| figure | value |")
    print("|---|---|")
    print(f"| submit→result of one `true` job, p50 of {a.jobs} | {pct(lat, 50):.1f} ms |")
    print(f"| same, p99 | {pct(lat, 99):.1f} ms |")
    print(f"| {a.items} `true` items on {a.slots} slots | {a.items / dt:.0f} items/s ({dt:.2f} s) |")


if __name__ == "__main__":
    main()
