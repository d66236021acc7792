"""The Raft path alone: three Replicas in this process on loopback Raft ports (real journals,
real fsyncs, the real transport), ticked in turn by one thread. No HTTP, no items: what one
commit costs in the replica and its transport, A/B between two trees.

    PYTHONPATH=/path/to/tree python3 bench/raft_inproc.py [--profile]

Prints the median and p99 time from a proposal at the leader to its commit there (one at a
time), and the time to commit 1,000 proposals made 20 per tick. With --profile, the top
functions (cumulative) of the one-at-a-time part.
"""

from __future__ import annotations

import cProfile
import os
import pstats
import socket
import statistics
import sys
import tempfile
import time

from meshjobs.failpoints import Failpoints
from meshjobs.replica import Replica
from meshjobs.table import JobTable


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tick_until(rs, pred, timeout_s: float = 30.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for r in rs:
            r.tick(0.0)
        got = pred()
        if got:
            return got
    raise RuntimeError("timed out")


def main() -> None:
    profile = "--profile" in sys.argv
    top = tempfile.mkdtemp(prefix="raft-inproc-")
    secret = os.urandom(32)
    addrs = [f"127.0.0.1:{free_port()}" for _ in range(3)]
    rs = []
    for i, a in enumerate(addrs):
        d = os.path.join(top, f"v{i}")
        os.makedirs(d)
        rs.append(Replica(a, [b for b in addrs if b != a], d, secret, JobTable(), Failpoints()))
    try:
        leader = tick_until(rs, lambda: next((r for r in rs if r._isLeader()
                                              and r.view().ready), None))
        entry = {"op": "bench", "pad": "x" * 200}
        for _ in range(50):  # warm up
            leader.propose(entry)
            want = leader._SyncObj__getCurrentLogIndex() + 1
            tick_until(rs, lambda w=want: leader.raftCommitIndex >= w)
        prof = cProfile.Profile() if profile else None
        lat = []
        if prof:
            prof.enable()
        for _ in range(300):
            t0 = time.perf_counter()
            leader.propose(entry)
            want = leader._SyncObj__getCurrentLogIndex() + 1
            tick_until(rs, lambda w=want: leader.raftCommitIndex >= w)
            lat.append(time.perf_counter() - t0)
        if prof:
            prof.disable()
        lat.sort()
        start = leader._SyncObj__getCurrentLogIndex()
        t0 = time.perf_counter()
        for _ in range(50):
            for _ in range(20):
                leader.propose(entry)
            for r in rs:
                r.tick(0.0)
        tick_until(rs, lambda: leader.raftCommitIndex >= start + 1000)
        batch_s = time.perf_counter() - t0
        print(f"one at a time: commit p50 {statistics.median(lat) * 1e3:.2f} ms, "
              f"p99 {lat[int(0.99 * (len(lat) - 1))] * 1e3:.2f} ms; "
              f"1,000 proposals 20 per tick: {batch_s:.2f} s "
              f"({1000 / batch_s:.0f} commits/s)")
        if prof:
            pstats.Stats(prof).sort_stats("tottime").print_stats(12)
    finally:
        for r in rs:
            r.close()


if __name__ == "__main__":
    main()
