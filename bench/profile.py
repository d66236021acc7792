"""Where a meshjobs member's time goes under one of `bench/run.py`'s workloads, by py-spy.

    python bench/profile.py [--voters 1|3] [--workload e2e_true|submits|latency] [--seconds S]
                            [--gil] [--out DIR]

Starts a fresh fleet (as `bench/run.py` does: a fleet of one with 2 slots, or 3 voters with
slots 1/1/0), attaches `py-spy record --format raw` to the leader (and, with 3 voters, to a
follower) while the workload runs over and over for `--seconds`, and prints for each member the
share of samples by thread and the functions with the most samples of their own (self) and in
all (total). `--gil` samples only the thread holding the GIL (where Python time goes), without
it every thread, waiting or not (where wall time goes). The raw stacks are kept in `--out`
(collapsed format: `flamegraph.pl` or speedscope read them).

Needs py-spy (`pip install py-spy`) and permission to attach to a child (root, or
`kernel.yama.ptrace_scope` 0).
"""

from __future__ import annotations

import argparse
import collections
import os
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.peers import Procs  # noqa: E402
from bench.peers.mesh import MeshFleet  # noqa: E402

TOP_N = 14


def workload(fleet: MeshFleet, name: str, until: float) -> int:
    """Run `name` until `until` (monotonic); how many rounds it ran."""
    rounds = 0
    while time.monotonic() < until:
        if name == "e2e_true":
            fleet.run_items("true", 1000)
        elif name == "submits":
            fleet.submit_rate(16, min(3.0, max(0.5, until - time.monotonic())))
        elif name == "latency":
            fleet.latency(50)
        else:
            raise SystemExit(f"unknown workload {name!r}: e2e_true, submits or latency")
        rounds += 1
    return rounds


def summarize(path: str, label: str) -> None:
    """Per thread, self and total samples by function, from py-spy's raw (collapsed) output."""
    threads: collections.Counter[str] = collections.Counter()
    own: collections.Counter[str] = collections.Counter()
    total: collections.Counter[str] = collections.Counter()
    n = 0
    with open(path) as f:
        for line in f:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            if not stack or not count.isdigit():
                continue
            c = int(count)
            n += c
            frames = stack.split(";")
            threads[frames[0]] += c
            funcs = [fr.split(" (")[0] + " " + fr.rsplit("/", 1)[-1].rstrip(")")
                     for fr in frames[1:]]
            if funcs:
                own[funcs[-1]] += c
            for fn in set(funcs):
                total[fn] += c
    print(f"\n## {label}: {n} samples")
    if not n:
        return
    print("threads:")
    for t, c in threads.most_common(8):
        print(f"  {100 * c / n:5.1f}%  {t}")
    print("self:")
    for fn, c in own.most_common(TOP_N):
        print(f"  {100 * c / n:5.1f}%  {fn}")
    print("total:")
    for fn, c in total.most_common(TOP_N):
        print(f"  {100 * c / n:5.1f}%  {fn}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--voters", type=int, choices=(1, 3), default=3)
    ap.add_argument("--workload", default="e2e_true")
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--gil", action="store_true", help="only the thread holding the GIL")
    ap.add_argument("--out", default=None, help="folder for the raw stacks")
    args = ap.parse_args()
    out = args.out or tempfile.mkdtemp(prefix="meshjobs-profile-")
    os.makedirs(out, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="meshjobs-profile-fleet-") as top:
        procs = Procs()
        fleet = MeshFleet(procs, top, args.voters)
        try:
            fleet.start()
            workload(fleet, args.workload, time.monotonic() + 1.0)  # warm up
            targets = [fleet.lead] + [m for m in fleet.members if m is not fleet.lead][:1]
            spies = []
            for m in targets:
                raw = os.path.join(out, f"{args.workload}-{args.voters}v-{m.name}.txt")
                cmd = ["py-spy", "record", "--pid", str(m.proc.pid), "--format", "raw",
                       "--threads", "--rate", "200", "--duration", str(int(args.seconds) + 1),
                       "--output", raw, "--nonblocking"]
                if args.gil:
                    cmd.append("--gil")
                spies.append((m, raw, subprocess.Popen(cmd, stdout=subprocess.DEVNULL,
                                                        stderr=subprocess.DEVNULL)))
            rounds = [0]
            t = threading.Thread(target=lambda: rounds.__setitem__(
                0, workload(fleet, args.workload, time.monotonic() + args.seconds)))
            t.start()
            t.join()
            for _, _, p in spies:
                p.wait(timeout=args.seconds + 60)
            print(f"{args.workload}, {args.voters} voter(s), {rounds[0]} rounds in "
                  f"{args.seconds:.0f} s, {'GIL holder only' if args.gil else 'all threads'}")
            for m, raw, _ in spies:
                role = "leader" if m is fleet.lead else "follower"
                summarize(raw, f"{m.name} ({role})")
            print(f"\nraw stacks: {out}")
        finally:
            fleet.stop()
            procs.stop_all()


if __name__ == "__main__":
    main()
