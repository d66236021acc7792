"""How long one plan of `meshctl watch` takes for a big folder (meshjobs/watchplan, pure).

    python bench/watchplan.py [FILES...]

For each size: a folder of FILES names, half of them processed (a .done state each), one glob,
a chain of two jobs; prints the median of 5 plans in ms; then the same folder settled (every due
job kept, nothing to submit), one plan. The IO (listing, stat, reading the
state files) is not in the figure.
"""

from __future__ import annotations

import statistics
import sys
import time

from meshjobs.watchplan import FileFact, Snapshot, build, ended, plan, state_name

S = 10**9


def main(sizes: list[int]) -> None:
    w = build({"watch": {"w": {"path": "/data", "glob": "*.in", "jobs": [
        {"argv": ["a", "%(file)s"]}, {"argv": ["b", "%(file)s"]}]}}}).watches[0]
    for n in sizes:
        now = 1_700_000_000 * S
        files = {f"{i:08d}.in": FileFact(now - i * S, 1) for i in range(n)}
        first = plan(w, Snapshot(files), now)
        states: dict[str, str | None] = {}
        for sub in first.submits[::2]:
            states.update(ended(w, sub, {"id": sub.job_id, "state": "done"})[0])
        snap = Snapshot(files, states)
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            p = plan(w, snap, now)
            times.append(time.perf_counter() - t0)
        print(f"{n:>8} files, {len(states):>7} states: plan {statistics.median(times) * 1000:8.1f} ms"
              f" ({len(p.submits)} submits)")
        # Settled: every due job kept, the plan submits nothing (a rescan of a quiet folder).
        names = sorted(files, reverse=True)
        states = {state_name(w.name, k, f, "done"): "{}" for pos, f in enumerate(names)
                  for k in range(min(pos, 1) + 1)}
        snap = Snapshot(files, states)
        t0 = time.perf_counter()
        p = plan(w, snap, now)
        print(f"{n:>8} files, {len(states):>7} states: plan {(time.perf_counter() - t0) * 1000:8.1f} ms"
              f" ({len(p.submits)} submits, settled)")


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]] or [1_000, 10_000, 100_000])
