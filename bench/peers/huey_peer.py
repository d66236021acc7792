"""Huey: one `huey_consumer -w 2 -k process` on the private Redis, database 2, with
`notify_result=True` (results are waited for with BLPOP, not polled). This module is also the
consumer's app (`bench.peers.huey_peer.huey`); the Redis URL comes from BENCH_HUEY_URL.

Submits go to a second Huey (`bench-idle`) that no consumer reads.
"""

from __future__ import annotations

import os
import sys
import threading
import time

from huey import RedisHuey

from bench import workloads
from bench.peers import NotAvailable, Procs, System, wait_until

URL = os.environ.get("BENCH_HUEY_URL", "redis://127.0.0.1:6390/2")

huey = RedisHuey("bench", url=URL, notify_result=True)
huey_idle = RedisHuey("bench-idle", url=URL)
run_true = huey.task(name="bench.true")(workloads.run_true)
noop = huey.task(name="bench.noop")(workloads.noop)
true_idle = huey_idle.task(name="bench.true")(workloads.run_true)


class HueyPeer(System):
    name = "Huey"

    def __init__(self, procs: Procs, url: str, folder: str, workers: int = 2) -> None:
        if url != URL:
            raise RuntimeError("set BENCH_HUEY_URL before importing bench.peers.huey_peer")
        self.procs = procs
        self.folder = folder
        self.workers = workers
        self.proc = None

    def start(self) -> None:
        self.proc = self.procs.start(
            [sys.executable, "-m", "huey.bin.huey_consumer", "bench.peers.huey_peer.huey",
             "-w", str(self.workers), "-k", "process", "-q"],
            os.path.join(self.folder, "huey.log"), env={"BENCH_HUEY_URL": URL})
        run_true().get(blocking=True, timeout=60)

    def stop(self) -> None:
        if self.proc is not None:
            self.procs.stop(self.proc)
            self.proc = None

    def reset(self) -> None:
        huey.storage.conn.flushdb()

    def run_items(self, kind: str, n: int) -> float:
        task = run_true if kind == "true" else noop
        huey.storage.conn.flushdb()
        t0 = time.perf_counter()
        for _ in range(n):
            task()
        # Every result is stored (none is None), so the count of stored results is the count done.
        wait_until(lambda: huey.result_count() >= n, 3600, "huey tasks done", every_s=0.002)
        dt = time.perf_counter() - t0
        # flushdb also drops the result notifications nobody popped (Huey's flush keeps them).
        huey.storage.conn.flushdb()
        return dt

    def submit_rate(self, threads: int, seconds: float) -> float:
        counts = [0] * threads
        stop_at = time.monotonic() + seconds

        def client(i: int) -> None:
            while time.monotonic() < stop_at:
                true_idle()
                counts[i] += 1
        t0 = time.perf_counter()
        ts = [threading.Thread(target=client, args=(i,)) for i in range(threads)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        rate = sum(counts) / (time.perf_counter() - t0)
        huey_idle.flush()
        return rate

    def latency(self, n: int) -> list[float]:
        out = []
        for i in range(n + 5):
            t0 = time.perf_counter()
            run_true().get(blocking=True, timeout=60)
            dt = (time.perf_counter() - t0) * 1000
            if i >= 5:
                out.append(dt)
        return out

    def big_submit(self, n: int) -> float:
        raise NotAvailable("n/a")
