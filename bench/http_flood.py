"""A flood of connections that never finish their request heads, against one meshd at a low fd
limit: how /healthz is answered meanwhile, how much the member logs, what it sheds.

    python bench/http_flood.py [--conns 2000] [--nofile 1024] [--seconds 30] [--root DIR]

The attacker keeps `--conns` connections open (each sent part of a head), opening a new one for
each the member closes. Every 0.5 s a client GETs /healthz on a new connection (timeout 10 s).
`--root` runs the meshd of another checkout (e.g. the main branch) for a before/after figure.
"""

from __future__ import annotations

import argparse
import http.client
import os
import selectors
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import machine  # noqa: E402
from tests import helpers as fleet  # noqa: E402

PARTIAL_HEAD = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: "


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--conns", type=int, default=2000)
    p.add_argument("--nofile", type=int, default=1024)
    p.add_argument("--seconds", type=float, default=30.0)
    p.add_argument("--root", default=fleet.ROOT, help="checkout whose meshd to run")
    args = p.parse_args()
    fleet.ROOT = os.path.abspath(args.root)
    with tempfile.TemporaryDirectory() as top:
        cfg = fleet.member_config(top, "m1")
        m = fleet.Meshd(os.path.join(top, "m1"), name="m1", config=cfg)
        fleet.limit_fds(m, args.nofile)
        m.start()
        try:
            run(m, args)
        finally:
            m.stop()


def run(m: fleet.Meshd, args: argparse.Namespace) -> None:
    host, port = m.url.removeprefix("http://").rsplit(":", 1)
    addr = (host, int(port))
    log_before = os.path.getsize(m.log_path)
    sel = selectors.DefaultSelector()
    opened = closed_by_server = 0

    def top_up() -> None:
        nonlocal opened
        for s in fleet.flood(addr, args.conns - len(sel.get_map()), PARTIAL_HEAD):
            s.setblocking(False)
            sel.register(s, selectors.EVENT_READ)
            opened += 1

    top_up()
    latencies: list[float] = []
    failures = 0
    t_end = time.monotonic() + args.seconds
    next_probe = time.monotonic()
    while time.monotonic() < t_end:
        for key, _ in sel.select(timeout=0.05):
            s = key.fileobj
            try:
                data = s.recv(65536)  # type: ignore[union-attr]
            except OSError:
                data = b""
            if not data:
                sel.unregister(s)
                s.close()  # type: ignore[union-attr]
                closed_by_server += 1
        if len(sel.get_map()) < args.conns:
            top_up()
        if time.monotonic() >= next_probe:
            next_probe = time.monotonic() + 0.5
            t0 = time.monotonic()
            conn = http.client.HTTPConnection(*addr, timeout=10)
            try:
                conn.request("GET", "/healthz")
                ok = conn.getresponse().status == 200
            except (OSError, http.client.HTTPException):
                ok = False
            finally:
                conn.close()
            if ok:
                latencies.append(time.monotonic() - t0)
            else:
                failures += 1
    for key in list(sel.get_map().values()):
        key.fileobj.close()  # type: ignore[union-attr]
    log_bytes = os.path.getsize(m.log_path) - log_before
    print(f"machine: {machine()}")
    print(f"meshd from {fleet.ROOT}, fd limit {args.nofile}, {args.conns} mid-head connections kept "
          f"open for {args.seconds:.0f} s ({opened} opened, {closed_by_server} closed by the member)")
    if latencies:
        q = statistics.quantiles(latencies, n=100) if len(latencies) > 1 else latencies * 99
        print(f"/healthz: {len(latencies)} answered, {failures} not (10 s timeout); "
              f"p50 {statistics.median(latencies) * 1000:.1f} ms, p99 {q[98] * 1000:.1f} ms, "
              f"max {max(latencies) * 1000:.1f} ms")
    else:
        print(f"/healthz: none answered, {failures} tries failed (10 s timeout)")
    print(f"log written during the flood: {log_bytes:,} bytes")
    try:
        for name, value in m.metrics().items():
            if "conns" in name or "accept" in name:
                print(f"  {name} {value:g}")
    except Exception as e:  # the old meshd has no such metrics, or does not answer
        print(f"  (no metrics: {e!r})")


if __name__ == "__main__":
    main()
