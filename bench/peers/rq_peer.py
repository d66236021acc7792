"""RQ: two `rq worker` processes (the default forking worker) on the private Redis, database 0.

End to end is counted on the finished and failed registries (relative to the round's start);
results live a day so none expire during a run. Submits go to a queue no worker reads.
"""

from __future__ import annotations

import os
import sys
import threading
import time

import redis
from rq import Queue
from rq.registry import FailedJobRegistry, FinishedJobRegistry

from bench import workloads
from bench.peers import NotAvailable, Procs, System, wait_until

QUEUE = "bench"
IDLE = "bench-idle"
TTL_S = 86400


class RqPeer(System):
    name = "RQ"

    def __init__(self, procs: Procs, url: str, folder: str, workers: int = 2) -> None:
        self.procs = procs
        self.url = url
        self.folder = folder
        self.workers = workers
        self.conn = redis.Redis.from_url(url, max_connections=64)
        self.queue = Queue(QUEUE, connection=self.conn)
        self.idle = Queue(IDLE, connection=self.conn)
        self.procs_started: list = []

    def start(self) -> None:
        for i in range(self.workers):
            self.procs_started.append(self.procs.start(
                [sys.executable, "-m", "rq.cli", "worker", "--url", self.url, "--name",
                 f"bench-{os.getpid()}-{i}", "--logging_level", "WARNING", "--results-ttl",
                 str(TTL_S), QUEUE], os.path.join(self.folder, f"rq-{i}.log")))
        from rq import Worker
        wait_until(lambda: len(Worker.all(connection=self.conn)) >= self.workers, 30,
                   "rq workers registered", every_s=0.1)

    def stop(self) -> None:
        for p in self.procs_started:
            self.procs.stop(p)
        self.procs_started = []

    def _done(self) -> int:
        return (FinishedJobRegistry(queue=self.queue).count
                + FailedJobRegistry(queue=self.queue).count)

    def run_items(self, kind: str, n: int) -> float:
        func = workloads.run_true if kind == "true" else workloads.noop
        before = self._done()
        t0 = time.perf_counter()
        for _ in range(n):
            self.queue.enqueue(func, result_ttl=TTL_S, failure_ttl=TTL_S)
        wait_until(lambda: self._done() >= before + n, 3600, "rq jobs done", every_s=0.002)
        return time.perf_counter() - t0

    def submit_rate(self, threads: int, seconds: float) -> float:
        counts = [0] * threads
        stop_at = time.monotonic() + seconds

        def client(i: int) -> None:
            q = Queue(IDLE, connection=self.conn)
            while time.monotonic() < stop_at:
                q.enqueue(workloads.run_true)
                counts[i] += 1
        t0 = time.perf_counter()
        ts = [threading.Thread(target=client, args=(i,)) for i in range(threads)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        rate = sum(counts) / (time.perf_counter() - t0)
        self.idle.empty()
        return rate

    def latency(self, n: int) -> list[float]:
        out = []
        for i in range(n + 5):
            t0 = time.perf_counter()
            job = self.queue.enqueue(workloads.run_true, result_ttl=TTL_S)
            res = job.latest_result(timeout=60)
            dt = (time.perf_counter() - t0) * 1000
            if res is None or res.type != res.Type.SUCCESSFUL:
                raise RuntimeError(f"rq job {job.id} did not succeed: {res}")
            if i >= 5:  # the first five warm up
                out.append(dt)
        return out

    def big_submit(self, n: int) -> float:
        raise NotAvailable("n/a")
