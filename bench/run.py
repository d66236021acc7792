"""meshjobs side by side with Huey, Celery and RQ, on this machine, in one run.

    python bench/run.py [--quick] [--only e2e_true,e2e_noop,submits,array,latency,failover,memory]

Starts meshjobs as a fleet of one (2 slots) and as 3 voters (slots 1/1/0), and the peers (2
workers each) on a private redis-server (loopback, port 6390 + pid % 100, no persistence, in a
temporary folder); runs the workloads of `bench/workloads.py` A/B/A/B; prints one markdown table
(median, min–max, ratio to the best peer) and the goals, and writes them into bench/RESULTS.md
under `## Side by side`. Every process it started is stopped by pid at the end, also after an
error or Ctrl-C, and its temporary folder is removed. `bench/setup.sh` installs the peers.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import workloads  # noqa: E402
from bench.common import machine  # noqa: E402
from bench.peers import Procs  # noqa: E402
from bench.workloads import Figure  # noqa: E402

NAMES = ("e2e_true", "e2e_noop", "submits", "array", "latency", "failover", "memory")
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "RESULTS.md")
MESH1, MESH3 = "meshjobs, fleet of 1", "meshjobs, 3 voters"
PEERS = ["Huey", "Celery", "RQ"]


def _fmt(v: float) -> str:
    if v >= 100:
        return f"{v:,.0f}"
    if v >= 10:
        return f"{v:.1f}"
    return f"{v:.2f}" if v >= 0.1 else f"{v:.3f}"


def render(figures: list[Figure], order: list[str]) -> str:
    lines = ["| figure | system | median | min–max | ÷ best peer |", "|---|---|---|---|---|"]
    for f in figures:
        best = f.best_peer(PEERS)
        first = True
        for name in order:
            if name not in f.values and name not in f.cells:
                continue
            title = f.title if first else ""
            first = False
            if name in f.values:
                v = f.values[name]
                med = statistics.median(v)
                ratio = f"{med / best:.2f}" if best else "—"
                lines.append(f"| {title} | {name} | {_fmt(med)} {f.unit} | {_fmt(min(v))}–{_fmt(max(v))} "
                             f"| {ratio} |")
            else:
                lines.append(f"| {title} | {name} | {f.cells[name]} | | |")
    return "\n".join(lines)


def goals(figs: dict[str, Figure], memory: dict | None, quick: bool) -> str:
    rows: list[tuple[str, str, str]] = []

    def at_least(goal: str, value: float | None, want: float, unit: str = "", why: str = "") -> None:
        if value is None:
            rows.append((goal, why or "not measured", "missed" if why.startswith("failed") else ""))
            return
        met = value >= want
        rows.append((goal, f"{_fmt(value)}{unit}",
                     "met" if met else f"missed: {value / want:.2f} of the goal"))

    def at_most(goal: str, value: float | None, want: float, unit: str = "", why: str = "") -> None:
        if value is None:
            rows.append((goal, why or "not measured", "missed" if why.startswith("failed") else ""))
            return
        met = value <= want
        rows.append((goal, f"{_fmt(value)}{unit}",
                     "met" if met else f"missed: {value / want:.1f}× the goal"))

    def med(key: str, system: str) -> float | None:
        return figs[key].median(system) if key in figs else None

    def ratio(key: str, system: str, peer: str) -> float | None:
        a, b = med(key, system), med(key, peer)
        return None if a is None or b is None else a / b

    at_least("`/bin/true` e2e, 3 voters ≥ 1.0× Huey", ratio("e2e_true", MESH3, "Huey"), 1.0, "×")
    at_least("no-op python items, 3 voters ≥ 1.0× Huey", ratio("e2e_noop", MESH3, "Huey"), 1.0, "×")
    at_least("submits/s, 3 voters, 16 clients ≥ 5,000/s", med("submits", MESH3), 5000, "/s")
    at_least("submits/s, 3 voters ≥ 2× RQ enqueue", ratio("submits", MESH3, "RQ"), 2.0, "×")
    at_most("100k array submitted ≤ 1 s (fleet of 1)", med("array", MESH1), 1.0, " s")
    at_most("100k array submitted ≤ 1 s (3 voters)", med("array", MESH3), 1.0, " s",
            figs["array"].cells.get(MESH3, "")[:80] if "array" in figs else "")
    at_most("submit→result p50 ≤ 2 ms (fleet of 1)", med("lat_p50", MESH1), 2.0, " ms")
    at_most("submit→result p50 ≤ 3 ms (3 voters)", med("lat_p50", MESH3), 3.0, " ms")
    at_most("leader kill → first change ≤ 1 s, median", med("failover", MESH3), 1.0, " s")
    if memory and "failed" in memory:
        rows.append(("table memory ≤ 500 B per finished item", f"failed: {memory['failed']}", ""))
    elif memory:
        for n, b in memory["per_item_b"].items():
            at_most(f"table memory ≤ 500 B per finished item (at {n:,})", b, 500, " B")
        top = max(memory["per_item_b"])
        label = "at 1 M items" if top >= 1_000_000 else f"at {top:,} items (1 M: full mode)"
        at_most(f"snapshot pause ≤ 1 s {label}", memory["longest_at_dump_s"] or None, 1.0, " s")
    else:
        rows.append(("table memory ≤ 500 B per finished item", "not measured", ""))
        rows.append(("snapshot pause ≤ 1 s at 1 M items", "not measured", ""))
    out = ["| goal | measured | |", "|---|---|---|"]
    out += [f"| {g} | {m} | {v} |" for g, m, v in rows]
    return "\n".join(out)


def memory_text(memory: dict | None) -> str:
    if not memory:
        return ""
    if "failed" in memory:
        return f"Table memory: the measurement failed: {memory['failed']}."
    per = ", ".join(f"{b:.0f} B per item at {n:,} ({memory['seconds'][n]:.0f} s to run them)"
                    for n, b in memory["per_item_b"].items())
    return (f"Table memory (fleet of one, 2 slots, jobs of `/bin/true` items run to the end): meshd's "
            f"RssAnon grew by {per}, from {memory['before_kb'] / 1024:.0f} MiB after a warm-up job. "
            f"Snapshot pause: a client sent `GET /healthz` every 20 ms throughout (it is answered "
            f"by the jobs thread, which also writes the snapshot); {memory['dumps']} snapshot(s) "
            f"were written (`raft.dump` rewritten, last {memory['dump_bytes'] / 1e6:.1f} MB); the "
            f"slowest probe in flight when one ended took {memory['longest_at_dump_s'] * 1000:.0f} ms, "
            f"the slowest probe of the whole run {memory['longest_probe_s'] * 1000:.0f} ms.")


def write_results(section: str) -> None:
    text = open(RESULTS).read() if os.path.exists(RESULTS) else "# Benchmark results\n"
    head = "## Side by side"
    m = re.search(rf"^{re.escape(head)}.*?(?=^## |\Z)", text, flags=re.S | re.M)
    if m:
        text = text[:m.start()] + section + "\n" + text[m.end():]
    else:
        text = text.rstrip("\n") + "\n\n" + section
    with open(RESULTS, "w") as f:
        f.write(text.rstrip("\n") + "\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="smaller counts: a few minutes")
    ap.add_argument("--only", default="", help="comma-separated: " + ",".join(NAMES))
    ap.add_argument("--no-write", action="store_true", help="do not update bench/RESULTS.md")
    a = ap.parse_args()
    only = [n for n in a.only.split(",") if n] or list(NAMES)
    unknown = set(only) - set(NAMES)
    if unknown:
        ap.error(f"unknown workload(s) {', '.join(sorted(unknown))}; choose from {', '.join(NAMES)}")
    counts = workloads.QUICK if a.quick else workloads.FULL
    command = "python bench/run.py" + (" --quick" if a.quick else "") + (f" --only {a.only}" if a.only else "")

    def on_term(signum: int, frame: object) -> None:
        raise KeyboardInterrupt
    signal.signal(signal.SIGTERM, on_term)

    started = time.perf_counter()
    top = tempfile.mkdtemp(prefix="meshbench-")
    procs = Procs()
    systems: list = []
    figures: list[Figure] = []
    memory = None
    try:
        from bench.peers.redis_server import RedisServer
        redis_server = RedisServer(procs, os.path.join(top, "redis"))
        redis_server.start()
        # The peers' apps read their Redis URL when imported, here and in their workers.
        os.environ["BENCH_CELERY_URL"] = redis_server.url(1)
        os.environ["BENCH_HUEY_URL"] = redis_server.url(2)
        from bench.peers.celery_peer import CeleryPeer
        from bench.peers.huey_peer import HueyPeer
        from bench.peers.mesh import MeshFleet, python_pool_works, table_memory
        from bench.peers.rq_peer import RqPeer

        py_ok, why = python_pool_works(procs, os.path.join(top, "probe"))
        print(f"python pool: {'works' if py_ok else 'not available'} ({why[:200]})", flush=True)
        mesh1 = MeshFleet(procs, os.path.join(top, "mesh1"), voters=1, python_pool=py_ok)
        mesh3 = MeshFleet(procs, os.path.join(top, "mesh3"), voters=3, python_pool=py_ok)
        peers_dir = os.path.join(top, "peers")
        os.makedirs(peers_dir)
        peer_systems = [HueyPeer(procs, redis_server.url(2), peers_dir),
                        CeleryPeer(procs, redis_server.url(1), peers_dir),
                        RqPeer(procs, redis_server.url(0), peers_dir)]
        needs_peers = bool(set(only) & {"e2e_true", "e2e_noop", "submits", "array", "latency"})
        systems = [mesh1, mesh3] + (peer_systems if needs_peers else [])
        for s in systems:
            t0 = time.perf_counter()
            s.start()
            print(f"started {s.name} ({time.perf_counter() - t0:.1f} s)", flush=True)
        all_names = [s.name for s in systems]
        first = True
        for name in only:
            if not first:
                for s in systems:
                    s.reset()
            first = False
            print(f"# {name}", flush=True)
            if name == "e2e_true":
                figures += workloads.e2e(systems, counts, "true")
            elif name == "e2e_noop":
                figures += workloads.e2e(systems, counts, "noop")
            elif name == "submits":
                figures += workloads.submits(systems, counts)
            elif name == "array":
                got = workloads.array(systems, counts)
                sub = next((f for f in figures if f.key == "submits"), None)
                for p in PEERS:
                    if sub and sub.median(p) and p in got[0].cells:
                        got[0].cells[p] = (f"n/a (enqueueing {counts.array:,} tasks at the rate above: "
                                           f"≈ {counts.array / sub.median(p):.0f} s)")
                figures += got
            elif name == "latency":
                figures += workloads.latency(systems, counts)
            elif name == "failover":
                figures += workloads.failover(mesh3, counts)
            elif name == "memory":
                try:
                    memory = table_memory(mesh1, counts.memory_steps)
                except Exception as e:  # meshd failed: say so in the results, keep the rest
                    memory = {"failed": f"{type(e).__name__}: {str(e)[:200]}"}
                    print(f"  memory: {memory['failed']}", flush=True)
        took = time.perf_counter() - started
        table = render(figures, all_names)
        goal_table = goals({f.key: f for f in figures}, memory, a.quick)
        section = "\n\n".join(x for x in [
            f"## Side by side (`{command}`)",
            f"Machine: {machine()}. Took {took / 60:.1f} min.",
            "meshjobs: a fleet of one with 2 slots, and 3 voters on loopback with slots 1/1/0 "
            "(2 in all); every submit answered once committed and fsynced (on a majority for 3 "
            "voters); clients talk to the leader. Peers: Huey (`-w 2 -k process`, "
            "`notify_result=True`), Celery (`--concurrency 2`, prefork, Redis broker and "
            "backend), RQ (2 `rq worker`, the default forking worker), all on one private "
            "redis-server without persistence. Each figure: the median of the rounds, the "
            f"systems taking turns round by round ({counts.rounds} rounds; failover: "
            f"{counts.kills} kills); `÷ best peer` is the median over the best peer's median. "
            "Submits are held jobs (meshjobs) or enqueues to a queue no worker reads (peers), "
            "so nothing runs while they are measured; the clients run in the harness's own "
            "process, on the same cores.",
            table, goal_table, memory_text(memory)] if x)
        print("\n" + section + "\n", flush=True)
        if not a.no_write:
            write_results(section)
            print(f"written to {RESULTS}", flush=True)
        return 0
    except KeyboardInterrupt:
        print("interrupted; stopping everything", file=sys.stderr)
        return 130
    finally:
        for s in systems:
            try:
                s.stop()
            except Exception as e:  # keep stopping the others
                print(f"stopping {s.name}: {e}", file=sys.stderr)
        procs.stop_all()
        shutil.rmtree(top, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
