"""Reads of one item and of all items of a held 1,000,000-item job: does the member stall?

    python bench/reads_million.py [--items 1000000] [--follows 5] [--results 1] [--seconds 30]
                                  [--code DIR] [--rss-stop-mb 6000]

One real meshd (a fleet of one, started from the code in --code: this tree by default, or
another checkout to measure it the same way) gets a held job of --items items (POST /jobs with
"hold": true, every item's stdin empty). Then, for --seconds, --follows clients each keep a
`GET /jobs/ID/items/0/stdout?follow=1` open (the item is held: the member looks at it every
log_poll_ms until log_start_wait_s_max, then answers 409 and the client asks again) and --results
clients download `GET /jobs/ID/results` again and again, while a process of its own sends
`GET /healthz` (answered by the jobs thread) every 50 ms.

Figures: the slowest /healthz (and how many probes failed or took over 1 s), and meshd's RSS
growth: VmRSS sampled every 250 ms and VmHWM at the end, minus VmRSS before the reads began
(from /proc/PID/status). Goal: ≤ 50 ms and ≤ 64 MB. When VmRSS passes --rss-stop-mb the reads
stop early (so that a member that would take the machine's memory does not), and the report
says so.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import ROOT, free_port, machine  # noqa: E402

PROBE_S = 0.05
JOB = "held1m"

_PROBE = r"""
import http.client, sys, time
host, port, every, until = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4])
end = time.monotonic() + until
while time.monotonic() < end:
    t0 = time.monotonic()
    status = 0
    try:
        c = http.client.HTTPConnection(host, port, timeout=30)
        c.request("GET", "/healthz")
        r = c.getresponse()
        r.read()
        status = r.status
        c.close()
    except OSError:
        pass
    took = time.monotonic() - t0
    print(t0, took, status, flush=True)
    time.sleep(max(0.0, every - took))
"""


def status_kb(pid: int, key: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {key} in /proc/{pid}/status")


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


class Meshd:
    def __init__(self, code: str, top: str) -> None:
        self.code, self.top = code, top
        self.data = os.path.join(top, "data")
        self.port = free_port()
        self.proc: subprocess.Popen | None = None

    def start(self) -> Meshd:
        os.makedirs(self.data, exist_ok=True)
        env = dict(os.environ, PYTHONPATH=self.code, MESHJOBS_LOG_LEVEL="warning")
        log = open(os.path.join(self.top, "meshd.log"), "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "meshjobs.daemon", "--data", self.data,
             "--http", f"127.0.0.1:{self.port}", "--raft", f"127.0.0.1:{free_port()}",
             "--slots", "2", "--name", "bench"],
            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=self.top)
        log.close()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError, ValueError):
                if self.get("/healthz", 5).get("ready"):
                    return self
            time.sleep(0.1)  # sleep-ok: meshd starts
        raise RuntimeError("meshd did not start: see " + os.path.join(self.top, "meshd.log"))

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def get(self, path: str, timeout: float = 300) -> dict:
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}",
                                     headers={"Accept": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())

    def post(self, path: str, body: dict) -> dict:
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}",
                                     data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=900) as r:
            return json.loads(r.read())


def reader(port: int, path: str, stop: threading.Event, counts: dict, key: str,
           open_conns: set) -> None:
    """GET `path` again and again until `stop`, reading each answer to its end (at the stop,
    the main thread shuts the connections that are still open)."""
    while not stop.is_set():
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
        try:
            c.connect()
            open_conns.add(c)
            c.request("GET", path)
            r = c.getresponse()
            while not stop.is_set():
                chunk = r.read1(65536)
                if not chunk:
                    break
                counts[key + "_bytes"] = counts.get(key + "_bytes", 0) + len(chunk)
            counts[key + "_" + str(r.status)] = counts.get(key + "_" + str(r.status), 0) + 1
        except (OSError, http.client.HTTPException):
            counts[key + "_errors"] = counts.get(key + "_errors", 0) + 1
            stop.wait(0.2)
        finally:
            open_conns.discard(c)
            c.close()


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="reads_million.py", description=__doc__.split("\n")[0])
    ap.add_argument("--items", type=int, default=1_000_000)
    ap.add_argument("--follows", type=int, default=5)
    ap.add_argument("--results", type=int, default=1)
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--code", default=ROOT, help="the checkout meshd runs from")
    ap.add_argument("--rss-stop-mb", type=int, default=6000)
    a = ap.parse_args(argv)
    code = os.path.abspath(a.code)
    print(f"machine: {machine()}; code {code}; load at start {load()}", flush=True)
    top = tempfile.mkdtemp(prefix="meshreads-")
    m = Meshd(code, top).start()
    assert m.proc is not None
    pid = m.proc.pid
    try:
        t0 = time.monotonic()
        m.post("/jobs", {"argv": ["true"], "hold": True, "id": JOB, "items": [""] * a.items})
        rec = m.get(f"/jobs/{JOB}")
        assert rec["items_total"] == a.items and rec["state"] == "held", rec
        print(f"  held job of {a.items:,} items submitted in {time.monotonic() - t0:.1f} s",
              flush=True)
        time.sleep(2.0)  # sleep-ok: let the member settle before reading its memory
        rss0 = status_kb(pid, "VmRSS")
        hwm0 = status_kb(pid, "VmHWM")
        probe = subprocess.Popen([sys.executable, "-c", _PROBE, "127.0.0.1", str(m.port),
                                  str(PROBE_S), str(a.seconds + 1.0)],
                                 stdout=subprocess.PIPE, text=True)
        time.sleep(0.5)  # sleep-ok: the prober's interpreter starts, probes before the load
        stop = threading.Event()
        counts: dict = {}
        open_conns: set = set()
        threads = [threading.Thread(target=reader, daemon=True,
                                    args=(m.port, f"/jobs/{JOB}/items/0/stdout?follow=1", stop,
                                          counts, "follow", open_conns)) for _ in range(a.follows)]
        threads += [threading.Thread(target=reader, daemon=True,
                                     args=(m.port, f"/jobs/{JOB}/results", stop, counts,
                                           "results", open_conns)) for _ in range(a.results)]
        for t in threads:
            t.start()
        peak = rss0
        stopped_early = False
        end = time.monotonic() + a.seconds
        while time.monotonic() < end:
            peak = max(peak, status_kb(pid, "VmRSS"))
            if peak > a.rss_stop_mb * 1024:
                stopped_early = True
                break
            time.sleep(0.25)  # sleep-ok: RSS sampling interval
        stop.set()
        hwm = status_kb(pid, "VmHWM")
        for c in list(open_conns):
            with contextlib.suppress(OSError, AttributeError):
                c.sock.shutdown(socket.SHUT_RDWR)
        if stopped_early:
            probe.terminate()
        out, _ = probe.communicate(timeout=120)
        for t in threads:
            t.join(30)
        samples = []
        for line in out.splitlines():
            with contextlib.suppress(ValueError):
                s0, took, status = line.split()
                samples.append((float(s0), float(took), int(status)))
        worst = max((t for _, t, _ in samples), default=0.0)
        failed = sum(1 for _, _, s in samples if s != 200)
        slow = sum(1 for _, t, _ in samples if t > 1.0)
        ordered = sorted(t for _, t, _ in samples)
        p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] if ordered else 0.0
        print()
        print(f"{a.items:,}-item held job, {a.follows} follows + {a.results} results download(s), "
              f"{a.seconds:g} s{' (stopped early: RSS over the stop)' if stopped_early else ''}")
        print(f"  /healthz probes: {len(samples)}, slowest {worst * 1000:.0f} ms, p99 "
              f"{p99 * 1000:.0f} ms, over 1 s: {slow}, not 200: {failed}")
        growth = max(peak - rss0, hwm - hwm0)
        print(f"  meshd VmRSS before {rss0 // 1024} MB, peak sampled {peak // 1024} MB "
              f"(+{(peak - rss0) // 1024} MB); VmHWM {hwm0 // 1024} -> {hwm // 1024} MB "
              f"(+{(hwm - hwm0) // 1024} MB; the submit set the one before)")
        print(f"  reads: {json.dumps(dict(sorted(counts.items())))}")
        print(f"  goal ≤ 50 ms: {'met' if worst <= 0.05 else 'missed'}; ≤ 64 MB: "
              f"{'met' if growth <= 64 * 1024 else 'missed'} (+{growth // 1024} MB)")
        print(f"machine: {machine()}; load average at the end {load()}")
    finally:
        m.stop()
        shutil.rmtree(top, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
