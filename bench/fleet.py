"""A fleet of 3 voters and 1 worker: leader kill -9 → first committed change, and `true` items/s.

    python bench/fleet.py [--rounds 5] [--items 1000] [--slots 2]

Failover: kill -9 the leader, then submit to another member again and again (each answered only
once committed) until one is answered 2xx; the time from the kill to that answer. The killed
member is restarted and the fleet settles between rounds. Throughput: one job of N `true` items
on the 4 members (`--slots` each), from sending the submit to having the finished record.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import machine  # noqa: E402
from tests.helpers import make_fleet  # noqa: E402


def _leader(members, timeout_s: float = 60.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for m in members:
            if m.proc is None or m.proc.poll() is not None:
                continue
            try:
                status, h = m.request("GET", "/healthz", timeout_s=1)
            except OSError:
                continue
            if status == 200 and h.get("is_leader") and h.get("ready"):
                return m
        time.sleep(0.02)
    raise RuntimeError("no leader")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--items", type=int, default=1000)
    ap.add_argument("--slots", type=int, default=2)
    a = ap.parse_args()
    print(f"machine: {machine()}")
    with tempfile.TemporaryDirectory(prefix="meshbench-fleet-") as top:
        members = make_fleet(top, voters=3, workers=1, slots=a.slots,
                             extra='[retention]\nkeep_jobs = 0\n')
        try:
            for m in members:
                m.extra_env = {"MESHJOBS_LOG_LEVEL": "warning"}
                m.start(wait_ready=False)
            for m in members:
                m.wait_ready()
            leader = _leader(members)
            deadline = time.monotonic() + 30
            while not any(x["name"] == "w1" and x["alive"]
                          for x in leader.request("GET", "/fleet")[1]["members"]):
                if time.monotonic() > deadline:
                    raise RuntimeError("the worker never reported")
                time.sleep(0.05)
            # Throughput first, on a settled fleet.
            t0 = time.perf_counter()
            status, rec = leader.request("POST", "/jobs", {"argv": ["true"], "items": [""] * a.items})
            assert status in (200, 201), rec
            done = leader.wait_job(rec["id"], timeout_s=600)
            dt = time.perf_counter() - t0
            assert done["items_done"] == a.items, done["state"]
            ran_on = sorted({i["member"] for i in done["items"]})
            # Failover rounds.
            takes = []
            for r in range(a.rounds):
                leader = _leader(members)
                others = [m for m in members[:3] if m is not leader]
                t_kill = time.perf_counter()
                leader.kill9()
                answered = None
                k = 0
                while answered is None:
                    target = others[k % len(others)]
                    k += 1
                    try:
                        status, body = target.request("POST", "/jobs",
                                                      {"argv": ["true"], "id": f"after-kill-{r}"},
                                                      timeout_s=15)
                    except OSError:
                        continue
                    if status in (200, 201):
                        answered = time.perf_counter() - t_kill
                takes.append(answered)
                leader.start(wait_ready=False)
                leader.wait_ready()
                time.sleep(2.0)  # let it catch up before the next round
        finally:
            for m in members:
                m.stop()
    print("| figure | value |")
    print("|---|---|")
    print(f"| {a.items} `true` items, 3 voters + 1 worker, {a.slots} slots each | "
          f"{a.items / dt:.0f} items/s ({dt:.2f} s; ran on {', '.join(ran_on)}) |")
    print(f"| leader kill -9 → first committed change, median of {a.rounds} | "
          f"{statistics.median(takes) * 1000:.0f} ms (min {min(takes) * 1000:.0f}, "
          f"max {max(takes) * 1000:.0f}) |")


if __name__ == "__main__":
    main()
