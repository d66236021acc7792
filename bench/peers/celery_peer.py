"""Celery: one `celery worker --concurrency 2 -P prefork` on the private Redis, database 1, as
broker and result backend. This module is also the worker's app (`-A bench.peers.celery_peer`);
the Redis URL comes from BENCH_CELERY_URL.

Submits (`.delay`) go to a task routed to a queue no worker reads.
"""

from __future__ import annotations

import os
import sys
import threading
import time

from celery import Celery
from celery.result import ResultSet

from bench import workloads
from bench.peers import NotAvailable, Procs, System

URL = os.environ.get("BENCH_CELERY_URL", "redis://127.0.0.1:6390/1")
IDLE = "bench-idle"

app = Celery("bench", broker=URL, backend=URL)
app.conf.update(
    task_default_queue="bench",
    task_routes={"bench.true_idle": {"queue": IDLE}},
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
    result_expires=86400,
    worker_send_task_events=False,
)
run_true = app.task(name="bench.true")(workloads.run_true)
noop = app.task(name="bench.noop")(workloads.noop)
true_idle = app.task(name="bench.true_idle")(workloads.run_true)


class CeleryPeer(System):
    name = "Celery"

    def __init__(self, procs: Procs, url: str, folder: str, workers: int = 2) -> None:
        if url != URL:
            raise RuntimeError("set BENCH_CELERY_URL before importing bench.peers.celery_peer")
        self.procs = procs
        self.folder = folder
        self.workers = workers
        self.proc = None

    def start(self) -> None:
        self.proc = self.procs.start(
            [sys.executable, "-m", "celery", "-A", "bench.peers.celery_peer", "worker",
             "--concurrency", str(self.workers), "-P", "prefork", "-Q", "bench", "--without-gossip",
             "--without-mingle", "--without-heartbeat", "--loglevel", "WARNING"],
            os.path.join(self.folder, "celery.log"), env={"BENCH_CELERY_URL": URL})
        # Ready once it has run a task.
        run_true.delay().get(timeout=60)

    def stop(self) -> None:
        if self.proc is not None:
            self.procs.stop(self.proc)
            self.proc = None

    def run_items(self, kind: str, n: int) -> float:
        task = run_true if kind == "true" else noop
        t0 = time.perf_counter()
        results = [task.delay() for _ in range(n)]
        ResultSet(results).join_native(timeout=3600, propagate=True, interval=0.002)
        dt = time.perf_counter() - t0
        for r in results:
            r.forget()
        return dt

    def submit_rate(self, threads: int, seconds: float) -> float:
        counts = [0] * threads
        stop_at = time.monotonic() + seconds

        def client(i: int) -> None:
            while time.monotonic() < stop_at:
                true_idle.delay()
                counts[i] += 1
        t0 = time.perf_counter()
        ts = [threading.Thread(target=client, args=(i,)) for i in range(threads)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        rate = sum(counts) / (time.perf_counter() - t0)
        with app.connection_for_write() as conn:
            conn.default_channel.client.delete(IDLE)
        return rate

    def latency(self, n: int) -> list[float]:
        out = []
        for i in range(n + 5):
            t0 = time.perf_counter()
            r = run_true.delay()
            r.get(timeout=60)
            dt = (time.perf_counter() - t0) * 1000
            r.forget()
            if i >= 5:
                out.append(dt)
        return out

    def big_submit(self, n: int) -> float:
        raise NotAvailable("n/a")
