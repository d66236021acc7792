"""The workloads of `bench/run.py`, the same for every system, and the tasks the peers run.

Rules: every figure is measured A/B/A/B — round by round, each round giving every system its
turn in the same order — and kept as one value per round (or per sample); a system that cannot
give a figure raises `NotAvailable` and its cell says why. Tasks are module-level functions so
the peers' worker processes import them by name.
"""

from __future__ import annotations

import statistics
import subprocess
import time
from dataclasses import dataclass, field
from typing import Any


def run_true() -> int:
    """The peers' task for a `/bin/true` item."""
    return subprocess.run(["/bin/true"]).returncode


def noop() -> bytes:
    """The peers' no-op task."""
    return b""


@dataclass
class Figure:
    key: str
    title: str
    unit: str
    higher_better: bool
    values: dict[str, list[float]] = field(default_factory=dict)
    cells: dict[str, str] = field(default_factory=dict)  # system name -> why there is no value
    note: str = ""

    def median(self, system: str) -> float | None:
        v = self.values.get(system)
        return statistics.median(v) if v else None

    def best_peer(self, peers: list[str]) -> float | None:
        got = [m for m in (self.median(p) for p in peers) if m is not None]
        if not got:
            return None
        return max(got) if self.higher_better else min(got)


@dataclass
class Counts:
    items: int
    rounds: int
    submit_s: float
    clients: int
    array: int
    latency_jobs: int
    kills: int
    memory_steps: list[int]


QUICK = Counts(items=1_000, rounds=2, submit_s=3.0, clients=16, array=100_000, latency_jobs=100,
               kills=5, memory_steps=[100_000])
FULL = Counts(items=10_000, rounds=3, submit_s=10.0, clients=16, array=100_000, latency_jobs=500,
              kills=5, memory_steps=[100_000, 1_000_000])


def _rounds(systems: list[Any], rounds: int, measure: Any, figures: list[Figure],
            label: str) -> None:
    """Run `measure(system) -> tuple of values, one per figure` round by round."""
    for r in range(rounds):
        for s in systems:
            if any(s.name in f.cells for f in figures):
                continue
            t0 = time.perf_counter()
            try:
                got = measure(s)
            except Exception as e:
                # A figure this system cannot give, or a failure of the system under test (a
                # refused request, a crashed member, a timeout): the cell says which, that system
                # sits out the figure's remaining rounds, and the other systems go on.
                from bench.peers import NotAvailable
                why = str(e) if isinstance(e, NotAvailable) else \
                    f"failed: {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
                for f in figures:
                    f.cells[s.name] = why
                print(f"  {label} r{r + 1} {s.name}: {why}", flush=True)
                continue
            for f, v in zip(figures, got, strict=True):
                f.values.setdefault(s.name, []).append(v)
            shown = ", ".join(f"{v:,.4g} {f.unit}" for f, v in zip(figures, got, strict=True))
            print(f"  {label} r{r + 1} {s.name}: {shown} ({time.perf_counter() - t0:.1f} s)",
                  flush=True)


def e2e(systems: list[Any], c: Counts, kind: str) -> list[Figure]:
    what = "`/bin/true`" if kind == "true" else "no-op python"
    f = Figure(f"e2e_{kind}", f"{c.items:,} {what} items, 2 slots, end to end (higher is better)",
               "items/s", True)
    _rounds(systems, c.rounds, lambda s: (c.items / s.run_items(kind, c.items),), [f], f.key)
    return [f]


def submits(systems: list[Any], c: Counts) -> list[Figure]:
    f = Figure("submits", f"single submits (peers: enqueues) per second, {c.clients} client threads, "
               f"{c.submit_s:g} s (higher is better)", "/s", True)
    _rounds(systems, c.rounds, lambda s: (s.submit_rate(c.clients, c.submit_s),), [f], f.key)
    return [f]


def array(systems: list[Any], c: Counts) -> list[Figure]:
    f = Figure("array", f"one array job of {c.array:,} items: submit → committed answer "
               "(lower is better)", "s", False)
    _rounds(systems, c.rounds, lambda s: (s.big_submit(c.array),), [f], f.key)
    return [f]


def latency(systems: list[Any], c: Counts) -> list[Figure]:
    p50 = Figure("lat_p50", f"submit → result of a one-item `true` job, p50 of {c.latency_jobs} "
                 "(lower is better)", "ms", False)
    p99 = Figure("lat_p99", f"same, p99 of {c.latency_jobs} (lower is better)", "ms", False)

    def measure(s: Any) -> tuple[float, float]:
        v = sorted(s.latency(c.latency_jobs))
        return (statistics.median(v), v[min(len(v) - 1, round(0.99 * (len(v) - 1)))])
    _rounds(systems, c.rounds, measure, [p50, p99], "latency")
    return [p50, p99]


def failover(fleet: Any, c: Counts) -> list[Figure]:
    f = Figure("failover", f"leader kill -9 → first committed submit via another member, {c.kills} "
               "kills (lower is better)", "s", False)
    _rounds([fleet], c.kills, lambda s: (s.failover(),), [f], f.key)
    return [f]
