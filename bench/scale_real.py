"""3 voters and 30 worker members as real meshd processes: 100,000 `true` items and a leader kill.

    python bench/scale.py real [--voters 3] [--workers 30] [--items 100000] [--jobs 10]
                               [--slots 1] [--voter-slots 0] [--kill-at 0.5] [--keep]

Every member is a real `meshd` on 127.0.0.1 in a folder of its own (tests/helpers.py's
make_fleet: voters first, then the workers, which join through a voter). The items go in as
`--jobs` array jobs of `true`, submitted through members taken in turn (so most submits are
forwarded to the leader). When `--kill-at` of the items have results, the leader is killed with
SIGKILL; a submit is then sent to the other voters again and again until one is answered (the
failover time: kill -> first committed change), and the killed member is started again. Once
every job is finished, each job's record with its items is read from the new leader and checked:
every item done with rc 0, exactly one result (a result only commits on the lease it was run
under, so runs beyond one per item are counted from the members' `node_runs_started`), and the
restarted member's copy of the table is the same.

Printed: a Markdown table of the figures, the spread of items over the workers, and a line
naming the machine and its load. Every meshd is stopped by pid at the end, also on failure.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import machine  # noqa: E402
from meshjobs import limits  # noqa: E402
from tests.helpers import Meshd, leader_of, make_fleet, start_all  # noqa: E402

TICK_S = os.sysconf("SC_CLK_TCK")
FINAL = ("done", "failed", "cancelled", "dep_failed")
WAVE = 6  # workers started at once (33 interpreters starting together starve a 2-core host)
START_S_MAX = 180.0  # a worker not ready (or not seen alive by the leader) by then: a failure
RUN_S_MAX = 3600.0  # the whole run's bound
POLL_S = 0.25


def rss_kib(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far (0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / TICK_S


def load() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def up(m: Meshd) -> bool:
    return m.proc is not None and m.proc.poll() is None


def ask(m: Meshd, method: str, path: str, body: Any = None, timeout_s: float = 30.0,
        key: str | None = None) -> tuple[int, Any]:
    headers = {"Idempotency-Key": key} if key else None
    return m.request(method, path, body, headers=headers, timeout_s=timeout_s)


def jobs_done(m: Meshd, ids: set[str]) -> tuple[int, int]:
    """(items with a result, jobs finished) of `ids`, as member `m` has them (one GET /jobs
    page holds them: a run has far fewer than jobs_list_max jobs)."""
    status, page = ask(m, "GET", f"/jobs?limit={limits.jobs_list_max}", timeout_s=10)
    if status != 200:
        raise OSError(f"GET /jobs: {status}")
    items = finished = 0
    for j in page:
        if j["id"] in ids:
            items += j["items_done"] + j["items_failed"]
            finished += j["state"] in FINAL
    return items, finished


def start_workers(leader: Meshd, workers: list[Meshd]) -> None:
    """Start workers a wave at a time, each wave ready before the next; then wait until the
    leader's fleet view has every one alive."""
    for k in range(0, len(workers), WAVE):
        wave = workers[k:k + WAVE]
        for m in wave:
            m.start(wait_ready=False)
        deadline = time.monotonic() + START_S_MAX
        waiting = list(wave)
        while waiting:
            waiting = [m for m in waiting if not m.is_ready()]
            if waiting and time.monotonic() > deadline:
                raise RuntimeError(f"{[m.name for m in waiting]} not ready:\n{waiting[0].log_tail()}")
            time.sleep(0.1)
    names = {m.name for m in workers}
    deadline = time.monotonic() + START_S_MAX
    while True:
        status, fleet = ask(leader, "GET", "/fleet")
        alive = {x["name"] for x in fleet.get("members", []) if x.get("alive")} if status == 200 else set()
        if names <= alive:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"workers never seen alive by the leader: {sorted(names - alive)}")
        time.sleep(0.2)


def metric(m: Meshd, name: str) -> float:
    return m.metrics().get(name, 0.0)


class Sampler:
    """RSS and CPU of every member, sampled on a thread of its own: the peak RSS of each, and
    (with a `timeline` file) one line per second of each voter's RSS and CPU and the items done."""

    def __init__(self, members: list[Meshd], timeline: str | None = None) -> None:
        self.members = members
        self.peak: dict[str, int] = {}
        self.done = 0  # items with a result, as the main loop last saw
        self._out = open(timeline, "w") if timeline else None  # noqa: SIM115
        self._t0 = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        k = 0
        while not self._stop.wait(0.5):
            k += 1
            line = [f"{time.monotonic() - self._t0:.1f}", str(self.done)]
            for m in self.members:
                if up(m):
                    rss = rss_kib(m.pid)
                    self.peak[m.name] = max(self.peak.get(m.name, 0), rss)
                    if m.name.startswith("v"):
                        line.append(f"{m.name}:{rss // 1024}M/{cpu_s(m.pid):.1f}s")
            if self._out is not None and k % 2 == 0:
                self._out.write(" ".join(line) + "\n")
                self._out.flush()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
        if self._out is not None:
            self._out.close()
            self._out = None


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="scale.py real", description=__doc__.split("\n")[0])
    ap.add_argument("--voters", type=int, default=3)
    ap.add_argument("--workers", type=int, default=30)
    ap.add_argument("--items", type=int, default=100_000)
    ap.add_argument("--jobs", type=int, default=10, help="array jobs the items are split into")
    ap.add_argument("--slots", type=int, default=1, help="slots of each worker")
    ap.add_argument("--voter-slots", type=int, default=0, help="slots of each voter")
    ap.add_argument("--kill-at", type=float, default=0.5,
                    help="kill -9 the leader when this share of the items have results (0: no kill)")
    ap.add_argument("--keep", action="store_true",
                    help="keep the members' folders, logs, a timeline and every member's metrics")
    ap.add_argument("--log-level", default="warning", help="the members' MESHJOBS_LOG_LEVEL")
    a = ap.parse_args(argv)
    if a.jobs < 1 or a.items < a.jobs or a.voters < 1 or a.workers < 0:
        print("scale real: need voters >= 1, workers >= 0 and items >= jobs >= 1", file=sys.stderr)
        return 2
    top = tempfile.mkdtemp(prefix="meshscale-real-")
    members = make_fleet(top, voters=a.voters, workers=a.workers, slots=a.voter_slots,
                         worker_slots=a.slots)
    for m in members:
        m.extra_env = {"MESHJOBS_LOG_LEVEL": a.log_level}
    voters, workers = members[:a.voters], members[a.voters:]
    fig: dict[str, Any] = {}
    sampler: Sampler | None = None
    ok = False
    try:
        t0 = time.monotonic()
        start_all(voters)
        leader = leader_of(voters)
        start_workers(leader, workers)
        fig["start_s"] = time.monotonic() - t0
        idle_rss = {m.name: rss_kib(m.pid) for m in members}
        sampler = Sampler(members, os.path.join(top, "timeline.txt") if a.keep else None)

        # Submit: job k through member k (in turn), retried with the same key until answered.
        sizes = [a.items // a.jobs + (k < a.items % a.jobs) for k in range(a.jobs)]
        ids = {f"scale-{k}" for k in range(a.jobs)}
        forward_s: list[float] = []
        cpu0 = {m.name: cpu_s(m.pid) for m in members}
        t_submit = time.monotonic()
        for k, n in enumerate(sizes):
            key = uuid.uuid4().hex
            spec = {"argv": ["true"], "id": f"scale-{k}", "items": [""] * n}
            for attempt in range(20):
                via = members[(k + attempt) % len(members)]
                t = time.monotonic()
                try:
                    status, rec = ask(via, "POST", "/jobs", spec, timeout_s=60, key=key)
                except OSError as e:
                    status, rec = 0, str(e)
                if status in (200, 201):
                    forward_s.append(time.monotonic() - t)
                    break
                print(f"submit scale-{k} through {via.name}: {status} {rec}", file=sys.stderr)
            else:
                raise RuntimeError(f"scale-{k} was never taken")
        fig["submit_s"] = time.monotonic() - t_submit

        # Run; kill the leader when kill_at of the items have results.
        victim: Meshd | None = None
        t_kill = t_fail = None
        done_at_kill = done_at_fail = 0
        leader_cpu_before = None
        reader = leader
        deadline = time.monotonic() + RUN_S_MAX
        while True:
            if time.monotonic() > deadline:
                raise RuntimeError("the jobs did not finish in time")
            try:
                done, finished = jobs_done(reader, ids)
            except OSError:
                reader = next(m for m in voters if up(m))
                time.sleep(POLL_S)
                continue
            sampler.done = done
            if finished == len(ids):
                break
            if victim is None and a.kill_at > 0 and done >= a.kill_at * a.items:
                victim = leader_of(voters, timeout_s=5)
                leader_cpu_before = (cpu_s(victim.pid) - cpu0[victim.name], rss_kib(victim.pid))
                t_kill = time.monotonic()
                done_at_kill = done
                victim.kill9()
                others = [m for m in voters if m is not victim]
                key = uuid.uuid4().hex
                probe = {"argv": ["true"], "id": "after-kill"}
                k = 0
                while t_fail is None:
                    target = others[k % len(others)]
                    k += 1
                    try:
                        status, _ = ask(target, "POST", "/jobs", probe, timeout_s=15, key=key)
                    except OSError:
                        continue
                    if status in (200, 201):
                        t_fail = time.monotonic()
                ids.add("after-kill")
                reader = leader = leader_of(others)
                done_at_fail, _ = jobs_done(leader, ids)
                cpu_after0 = cpu_s(leader.pid)
                t_restart = time.monotonic()
                victim.start(wait_ready=False)
                victim.wait_ready()
                fig["restart_s"] = time.monotonic() - t_restart
                continue
            time.sleep(POLL_S)
        t_end = time.monotonic()
        leader = leader_of([m for m in voters if up(m)])
        leader_cpu_after = cpu_s(leader.pid) - (cpu_after0 if victim else cpu0[leader.name])

        # Check every item, from the leader's records.
        t_read = time.monotonic()
        records = {}
        for job_id in sorted(ids):
            status, rec = ask(leader, "GET", f"/jobs/{job_id}?items=1", timeout_s=120)
            assert status == 200, (job_id, status)
            records[job_id] = rec
        fig["read_s"] = time.monotonic() - t_read
        ran_on: Counter[str] = Counter()
        bad: list[tuple[str, dict]] = []
        attempts: Counter[int] = Counter()
        for job_id, rec in records.items():
            if len(rec["items"]) != rec["items_total"]:
                bad.append((job_id, {"items": len(rec["items"]), "total": rec["items_total"]}))
            for it in rec["items"]:
                attempts[it["attempts"]] += 1
                if it["state"] != "done" or it["rc"] != 0:
                    bad.append((job_id, it))
                ran_on[it["member"]] += 1
        total = sum(len(r["items"]) for r in records.values())
        every = {m.name: m.metrics() for m in members if up(m)}
        if a.keep:
            with open(os.path.join(top, "metrics.json"), "w") as f:
                json.dump(every, f, indent=1, sort_keys=True)
        runs = {name: got.get("meshjobs_node_runs_started_total", 0.0) for name, got in every.items()}
        results = metric(leader, "meshjobs_table_results_accepted_total")
        refused = metric(leader, "meshjobs_table_results_refused_total")
        revoked = metric(leader, "meshjobs_table_leases_revoked_total")

        # The restarted member catches up: the same items, item for item.
        same = None
        if victim is not None:
            t_catch = time.monotonic()
            while True:
                try:
                    if all(ask(victim, "GET", f"/jobs/{j}")[1].get("state") in FINAL for j in ids):
                        break
                except OSError:
                    pass
                if time.monotonic() - t_catch > START_S_MAX:
                    break
                time.sleep(POLL_S)
            fig["catch_up_s"] = time.monotonic() - t_catch
            same = all(ask(victim, "GET", f"/jobs/{j}?items=1", timeout_s=120)[1].get("items")
                       == records[j]["items"] for j in ids)
        cpu_end = {m.name: cpu_s(m.pid) - cpu0[m.name] for m in members if up(m)}
        ok = not bad and total == a.items + (victim is not None) and (same is not False)
        peak = dict(sampler.peak)
        sampler.stop()
    finally:
        if sampler is not None:
            sampler.stop()
        for m in members:
            with contextlib.suppress(Exception):
                m.stop()
        if not a.keep:
            shutil.rmtree(top, ignore_errors=True)
        elif top:
            print(f"kept: {top}", file=sys.stderr)

    wall = t_end - t_submit
    per_worker = [ran_on.get(m.name, 0) for m in workers]
    on_voters = sum(ran_on.get(m.name, 0) for m in voters)
    w_rss = [peak.get(m.name, 0) for m in workers]
    extra_runs = sum(runs.values()) - total
    rows = [
        ("members", f"{a.voters} voters ({a.voter_slots} slots) + {a.workers} workers "
                    f"({a.slots} slots each), started in {fig['start_s']:.1f} s"),
        ("items", f"{a.items:,} `true` items in {a.jobs} array jobs"
                  + (" + 1 probe job" if victim else "")),
        ("submit (all jobs, most forwarded)", f"{fig['submit_s']:.2f} s; slowest submit "
                                              f"{max(forward_s) * 1000:.0f} ms"),
        ("wall time, first submit → every job finished", f"{wall:.1f} s ({total / wall:,.0f} items/s)"),
    ]
    if victim is not None:
        assert t_kill is not None and t_fail is not None and leader_cpu_before is not None
        rows += [
            (f"items/s before the kill ({done_at_kill:,} items)",
             f"{done_at_kill / (t_kill - t_submit):,.0f}"),
            ("items/s after the kill (failover included)",
             f"{(total - done_at_kill) / (t_end - t_kill):,.0f}"),
            ("items/s after the first committed change",
             f"{(total - done_at_fail) / max(t_end - t_fail, 1e-9):,.0f}"),
            ("leader kill -9 → first committed change", f"{(t_fail - t_kill) * 1000:,.0f} ms"),
            ("killed leader: restart → ready (replay)", f"{fig['restart_s']:.1f} s"),
            ("killed leader's table at the end", f"items equal the leader's: {same} "
                                                 f"(caught up {fig['catch_up_s']:.1f} s after the end)"),
            ("old leader before the kill: CPU, RSS",
             f"{leader_cpu_before[0] / (t_kill - t_submit) * 100:.0f}% of a core, "
             f"{leader_cpu_before[1] / 1024:.0f} MiB"),
            ("new leader after the kill: CPU", f"{leader_cpu_after / (t_end - t_fail) * 100:.0f}% of a core"),
        ]
    else:
        rows.append(("leader CPU", f"{leader_cpu_after / wall * 100:.0f}% of a core"))
    rows += [
        ("leader RSS, peak", f"{peak.get(leader.name, 0) / 1024:.0f} MiB"),
        ("voters' RSS: idle → peak", ", ".join(f"{idle_rss[m.name] / 1024:.0f}→{peak.get(m.name, 0) / 1024:.0f} MiB"
                                               for m in voters)),
        ("workers' RSS, peak: min / median / max",
         f"{min(w_rss) / 1024:.0f} / {statistics.median(w_rss) / 1024:.0f} / {max(w_rss) / 1024:.0f} MiB"
         if w_rss else "-"),
        ("items per worker: min / median / max",
         f"{min(per_worker):,} / {statistics.median(per_worker):,.0f} / {max(per_worker):,} "
         f"({sum(1 for n in per_worker if n)} of {len(per_worker)} workers ran items; "
         f"{on_voters:,} ran on voters)" if per_worker else "-"),
        ("CPU over the run: each voter; workers in all (per item)",
         ", ".join(f"{m.name} {cpu_end.get(m.name, 0):.0f} s" for m in voters)
         + f"; {sum(cpu_end.get(m.name, 0) for m in workers):.0f} s "
         f"({sum(cpu_end.get(m.name, 0) for m in workers) / total * 1000:.2f} ms)"),
        ("time to read every job with its items", f"{fig['read_s']:.2f} s"),
        ("items not done / missing", f"{len(bad)}"),
        ("items by attempts", ", ".join(f"{k}: {v:,}" for k, v in sorted(attempts.items()))),
        ("runs started beyond one per item (members up at the end)", f"{extra_runs:,.0f}"),
        ("leader: results accepted / refused, leases revoked",
         f"{results:,.0f} / {refused:,.0f} / {revoked:,.0f}"),
    ]
    print("| figure | value |")
    print("|---|---|")
    for k, v in rows:
        print(f"| {k} | {v} |")
    print()
    print(f"machine: {machine()}; load average at the end: {load()}")
    for job_id, it in bad[:10]:
        print(f"BAD {job_id}: {it}", file=sys.stderr)
    print("nothing lost, one result per item" if ok else "CHECK FAILED", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
