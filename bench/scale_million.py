"""A million finished items in the table, with real meshd processes: memory, snapshot, restart, reads.

    python bench/scale.py million [--items 1000000] [--voters 1|3] [--per-job 100000]
                                  [--small-jobs 10000] [--data DIR] [--keep]

Building the table: running a million items would take hours here, so the member's data folders
are made the way the member itself makes them. The member's own `Replica` (pysyncobj with our
journal, dump writer and transport) runs in this process on each voter's folder, at the Raft
address its meshd will use, and its leader takes the entries a leader's node proposes for jobs
of `/bin/true` items run to the end: submits (compact form, as `node/core.py` builds them),
leases of 4,096 items and result entries of 4,096 rows (exit 0, the empty digest for stdout and
stderr, start and end times). Every voter applies them, logs them in its journal, and writes
dumps when its log grows past `log_compaction_bytes_min`, as a running meshd does. Then real
meshd processes start from those folders. `--small-jobs` of the items are one-item jobs (for
paging `GET /jobs` through many jobs); the rest are jobs of `--per-job` items. `--data DIR`
keeps the built folders there and reuses them on the next run (each measurement starts the
meshds again from them; the snapshot step grows the journal a little each run).

Figures (each a real meshd process, or the leader of the voters):
- RSS per item: RssAnon of the meshd serving the whole table minus the RssAnon of the same
  fleet started on empty folders, divided by the items.
- Restart: process start until the member answers reads with the whole table (`/healthz` ready,
  its job count and applied index those of the table built). For 3 voters, all three start.
- Snapshot: size of `raft.dump`; the jobs thread's pause while one is written: a client sends
  `GET /healthz` (answered by the jobs thread) every 15 ms while submits of large held jobs grow
  the log past the compaction size; the slowest probe in flight while a dump was being written.
- `GET /jobs`: first page (100 jobs), a deep page (the last page of 1,000), walking all pages of
  1,000, and `GET /jobs/ID?items=1` of a 100,000-item job (the whole item list; items are not
  paged), with the slowest `/healthz` probe during that read.
- 3 voters: a follower is stopped, the log compacted on the leader (the snapshot step), and the
  follower restarted: the time until its applied index reaches the leader's (a dump sent whole).
- A new worker: a worker member with an empty data folder joins (through the leader's member
  link port) while the leader is probed: the slowest probe from the worker's start until its
  table reaches the leader's applied index (what serving it the whole table costs the leader's
  jobs thread), and that time.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import ROOT, free_port, machine  # noqa: E402

BATCH = 4096  # limits.lease_batch_max and limits.result_batch_max
PROBE_S = 0.015
# "As a dump ends": probes in flight from this long before its writer is seen gone to this long
# after (the jobs thread reaps it at its next tick and then does what a dump's end asks).
END_BEFORE_S = 0.05
END_AFTER_S = 0.5
BUILT = "built.json"


# --- the folders --------------------------------------------------------------------------------

def layout(top: str, voters: int) -> dict:
    """Names, ports and folders of the fleet; written once, read again on reuse."""
    names = [f"v{i}" for i in range(1, voters + 1)]
    return {"voters": voters, "members": {
        n: {"raft": free_port(), "peer": free_port(), "http": free_port(),
            "data": os.path.join(top, n)} for n in names}}


def write_configs(top: str, lay: dict) -> None:
    secret = os.urandom(32)
    members = lay["members"]
    line = ", ".join(
        f'{{ name = "{n}", raft = "127.0.0.1:{m["raft"]}", peer = "127.0.0.1:{m["peer"]}", '
        f'http = "127.0.0.1:{m["http"]}" }}' for n, m in members.items())
    for n, m in members.items():
        os.makedirs(m["data"], exist_ok=True)
        path = os.path.join(m["data"], "fleet.secret")
        if not os.path.exists(path):
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            os.write(fd, secret)
            os.close(fd)
        # A config naming the voters for one voter too: its member links then listen, so that
        # a worker can join it (the new-worker step).
        with open(os.path.join(top, f"{n}.toml"), "w") as f:
            f.write(f'name = "{n}"\n[fleet]\nvoters = [ {line} ]\n[pools.default]\nslots = 2\n')


def _submit(job_id: str, n: int, t: int) -> dict:
    from meshjobs.compact import pack_items
    from meshjobs.control import parse_submit
    from meshjobs.node.events import spec_digest

    spec = parse_submit({"argv": ["true"]})
    spec.pop("items", None)
    spec.pop("id", None)
    items: list[bytes | None] = [None] * n
    return {"k": "submit", "t": t, "id": job_id, "spec": spec, "dg": spec_digest(spec, items),
            **pack_items(items)}


def entries(items: int, per_job: int, small: int, member: str, t0: int):
    """The entries a leader proposes for `items` items of `true` run to the end: yields
    (entry, makes_epoch) where the result entry of a lease needs that lease's log index."""
    small = min(small, items)
    big = items - small
    jobs: list[tuple[str, int]] = []
    k = 0
    while big > 0:
        n = min(per_job, big)
        jobs.append((f"big{k:03d}", n))
        big -= n
        k += 1
    for s in range(small):
        jobs.append((f"one{s:06d}", 1))
    t = t0
    # Big jobs one at a time; the one-item jobs in batches (as the leader batches submits).
    grants: list[list] = []

    def flush():
        nonlocal t
        rows = grants[:]
        grants.clear()
        t += 1000
        yield {"k": "lease", "t": t, "g": [[j, i, member, "b1"] for j, i in rows]}, "lease"
        t += 5
        yield ({"k": "result", "t": t, "r": [[j, i, None, 2, 0, None, None, None, t - 5, t]
                                            for j, i in rows]}, "result")

    pending_submits: list[dict] = []
    for job_id, n in jobs:
        t += 1
        if n == 1:
            pending_submits.append(_submit(job_id, 1, t))
            if len(pending_submits) == 1024:
                yield {"k": "batch", "t": t, "es": pending_submits[:]}, None
                pending_submits.clear()
        else:
            yield _submit(job_id, n, t), None
        for i in range(n) if n > 1 else []:
            grants.append((job_id, i))
            if len(grants) == BATCH:
                yield from flush()
        if n == 1:
            grants.append((job_id, 0))
            if len(grants) == BATCH:
                if pending_submits:
                    yield {"k": "batch", "t": t, "es": pending_submits[:]}, None
                    pending_submits.clear()
                yield from flush()
    if pending_submits:
        yield {"k": "batch", "t": t, "es": pending_submits[:]}, None
    if grants:
        yield from flush()


def build(top: str, lay: dict, items: int, per_job: int, small: int) -> dict:
    """Make each voter's data folder with the member's own Replica, in this process."""
    from blobstore.digest import EMPTY_DIGEST
    from meshjobs import limits
    from meshjobs.failpoints import Failpoints
    from meshjobs.replica import Replica
    from meshjobs.table import JobTable

    empty = bytes.fromhex(EMPTY_DIGEST)
    members = lay["members"]
    addrs = {n: f"127.0.0.1:{m['raft']}" for n, m in members.items()}
    names = {a: n for n, a in addrs.items()}
    replicas = {}
    for n, m in members.items():
        with open(os.path.join(m["data"], "fleet.secret"), "rb") as f:
            secret = f.read()
        partners = [a for o, a in addrs.items() if o != n]
        replicas[n] = Replica(addrs[n], partners, m["data"], secret, JobTable(), Failpoints(),
                              names=names,
                              # Long timeouts: the three tick in one thread here, and a result
                              # entry of 4,096 rows takes a while to apply on a loaded machine.
                              election_s=(limits.raft_election_alone_s if not partners
                                          else (2.0, 3.0)))
    rs = list(replicas.values())

    def spin(until) -> None:
        deadline = time.monotonic() + 600
        while not until():
            if time.monotonic() > deadline:
                raise RuntimeError("the build's replicas did not get there in 600 s")
            for r in rs:
                r.tick(0.0)
                r.compact_when_large()
                if r.dump_damage is not None:
                    raise r.dump_damage
                r.take_applied()
                r.journal_sync()
            if not any(r.needs_tick() for r in rs):
                rs[0].wait(0.002)

    def lead():
        spin(lambda: any(r.view().ready for r in rs))
        return next(r for r in rs if r.view().ready)

    def landed(r, entry: dict, kind: str | None, before: dict) -> bool:
        """Has `entry` been applied (on replica r)? Checked on the table, so that a proposal
        lost to an election is proposed again."""
        t = r.table
        if kind == "lease":
            return t.counts.get("leases_granted", 0) >= before["granted"] + len(entry["g"])
        if kind == "result":
            return t.counts.get("results_accepted", 0) >= before["accepted"] + len(entry["r"])
        ids = [e["id"] for e in entry["es"]] if entry["k"] == "batch" else [entry["id"]]
        return all(i in t.jobs for i in ids)

    leader = lead()
    member = names[leader.selfNode.id] if leader.selfNode is not None else "v1"
    t0 = int(time.time() * 1000) - 3_600_000
    started = time.monotonic()
    last_lease = 0
    done = 0
    for entry, kind in entries(items, per_job, small, member, t0):
        if kind == "result":
            for row in entry["r"]:
                row[2] = last_lease
                row[6] = row[7] = empty
        before = {"granted": leader.table.counts.get("leases_granted", 0),
                  "accepted": leader.table.counts.get("results_accepted", 0)}
        while True:
            leader.propose(entry)
            leader.log_proposals()
            want = leader._SyncObj__getCurrentLogIndex()  # type: ignore[attr-defined]
            deadline = time.monotonic() + 30
            spin(lambda w=want, d=deadline, ld=leader: all(r.raftLastApplied >= w for r in rs)
                 or time.monotonic() > d or not ld._isLeader())
            if landed(leader, entry, kind, before) and all(
                    r.raftLastApplied >= want for r in rs):
                break
            print("  (a proposal did not land: an election; proposing again)", flush=True)
            spin(lambda: all(r.raftLastApplied >= r.raftCommitIndex for r in rs))
            leader = lead()
            if landed(leader, entry, kind, before):
                break
        if kind == "lease":
            last_lease = leader.table.applied_index
        if kind == "result":
            done += len(entry["r"])
            if done % 100_000 < BATCH:
                print(f"  built {done:,} items ({time.monotonic() - started:.0f} s)", flush=True)
    # Let the last dump finish (a fresh one, as a member compacts by size).
    spin(lambda: not any(r.dump_writer is not None and r.dump_writer.writing for r in rs))
    table = leader.table
    want = {"jobs": len(table.jobs), "applied_index": table.applied_index,
            "items": sum(j.n for j in table.jobs.values()),
            "done": sum(j.n_done for j in table.jobs.values()),
            "big": next((j.id for j in table.jobs.values() if j.n > 1), None),
            "build_s": round(time.monotonic() - started, 1)}
    for r in rs:
        r.close()
    return want


# --- real meshd processes -----------------------------------------------------------------------

class Proc:
    def __init__(self, top: str, lay: dict, name: str) -> None:
        self.top, self.lay, self.name = top, lay, name
        self.m = lay["members"][name]
        self.url = f"http://127.0.0.1:{self.m['http']}"
        self.proc: subprocess.Popen | None = None
        self.started = 0.0

    def start(self) -> Proc:
        m = self.m
        args = [sys.executable, "-m", "meshjobs.daemon", "--data", m["data"], "--name", self.name,
                "--config", os.path.join(self.top, f"{self.name}.toml")]
        env = dict(os.environ, PYTHONPATH=ROOT, MESHJOBS_LOG_LEVEL="warning")
        log = open(os.path.join(self.top, f"{self.name}.log"), "ab")
        self.started = time.monotonic()
        self.proc = subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        log.close()
        return self

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def get(self, path: str, timeout: float = 300) -> Any:
        req = urllib.request.Request(self.url + path, headers={"Accept": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout) as r:
            body = r.read()
            return json.loads(body), r.headers, len(body)

    def get_raw(self, path: str, timeout: float = 300) -> bytes:
        req = urllib.request.Request(self.url + path, headers={"Accept": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.read()

    def delete(self, path: str) -> None:
        req = urllib.request.Request(self.url + path, method="DELETE")
        with urllib.request.urlopen(req, timeout=120) as r:
            r.read()

    def post(self, path: str, body: dict) -> Any:
        req = urllib.request.Request(self.url + path, data=json.dumps(body).encode(),
                                     method="POST", headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            return json.loads(r.read())

    def health(self) -> dict | None:
        try:
            return self.get("/healthz", timeout=5)[0]
        except (OSError, ValueError):
            return None

    def rss_anon(self) -> int:
        assert self.proc is not None
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                if line.startswith("RssAnon"):
                    return int(line.split()[1]) * 1024
        raise RuntimeError("no RssAnon")

    def metric(self, name: str) -> float:
        req = urllib.request.Request(self.url + "/metrics")
        with urllib.request.urlopen(req, timeout=60) as r:
            for line in r.read().decode().splitlines():
                if line.startswith(name + " ") or line.startswith(name + "{"):
                    return float(line.rsplit(" ", 1)[1])
        return 0.0


def wait_for(pred, timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(0.01)
    raise RuntimeError(f"timed out after {timeout_s:.0f} s waiting for {what}")


def serving(p: Proc, want: dict) -> bool:
    h = p.health()
    return bool(h and h.get("ready") and h.get("jobs", 0) >= want["jobs"]
                and h.get("applied_index", 0) >= want["applied_index"])


def leader_of(procs: list[Proc]) -> Proc:
    def find():
        for p in procs:
            h = p.health()
            if h and h.get("is_leader") and h.get("ready"):
                return p
        return None
    return wait_for(find, 120, "a leader")


_PROBE = """
import sys, time, urllib.request
url, every = sys.argv[1], float(sys.argv[2])
while True:
    t0 = time.monotonic()
    try:
        with urllib.request.urlopen(url, timeout=30) as r:
            r.read()
    except OSError:
        pass
    took = time.monotonic() - t0
    print(t0, took, flush=True)
    time.sleep(max(0.0, every - took))
"""


class Prober:
    """GET /healthz every PROBE_S from a process of its own (a thread here would share this
    process's interpreter lock with the reads being measured): each probe's (sent, took)
    seconds, on the machine's monotonic clock."""

    def __init__(self, p: Proc) -> None:
        self.p = p
        self.samples: list[tuple[float, float]] = []
        self._proc: subprocess.Popen | None = None

    def __enter__(self) -> Prober:
        self._proc = subprocess.Popen(
            [sys.executable, "-c", _PROBE, self.p.url + "/healthz", str(PROBE_S)],
            stdout=subprocess.PIPE, text=True)
        time.sleep(0.2)  # sleep-ok: the prober's interpreter starts
        return self

    def __exit__(self, *exc) -> None:
        assert self._proc is not None
        self._proc.terminate()
        out, _ = self._proc.communicate(timeout=60)
        for line in out.splitlines():
            with contextlib.suppress(ValueError):
                a, b = line.split()
                self.samples.append((float(a), float(b)))

    def worst(self, start: float = 0.0, end: float = float("inf")) -> float:
        """The slowest probe in flight at some moment in [start, end]."""
        return max((took for t0, took in self.samples if t0 <= end and t0 + took >= start),
                   default=0.0)


def dump_watch(p: Proc, until: threading.Event, spans: list[tuple[float, float]]) -> None:
    """When the member's dump writer (a child of meshd) runs: [(start, end)]."""
    seen: float | None = None
    while not until.is_set():
        kids = _children(p)
        now = time.monotonic()
        if kids and seen is None:
            seen = now
        elif not kids and seen is not None:
            spans.append((seen, now))
            seen = None
        time.sleep(0.002)
    if seen is not None:
        spans.append((seen, time.monotonic()))


def snapshot_step(p: Proc, top: str) -> dict:
    """Grow the log past the compaction size with submits of held jobs (large argv), while
    probing; report the dumps written and the slowest probe while one was written."""
    from meshjobs import limits

    written0 = p.metric("meshjobs_dumps_written_total") or p.metric("dumps_written")
    arg = "x" * 200
    spans: list[tuple[float, float]] = []
    stop = threading.Event()
    watcher = threading.Thread(target=dump_watch, args=(p, stop, spans), daemon=True)
    watcher.start()
    n = 0
    made: list[str] = []
    with Prober(p) as probe:
        t_start = time.monotonic()
        # Until a dump has started (the log passes log_compaction_bytes_min), at most 4 times that.
        need = limits.log_compaction_bytes_min * 4
        sent = 0
        while sent < need and not spans and time.monotonic() - t_start < 120:
            n += 1
            job_id = f"snap{os.getpid()}-{n}"
            p.post("/jobs", {"argv": ["true", *[arg] * 1000], "hold": True, "id": job_id})
            sent += 1000 * 200
            made.append(job_id)
        # wait for the writer to end
        wait_for(lambda: not _children(p), 300, "the dump writer to end")
        time.sleep(0.2)  # sleep-ok: the probe's last samples
    stop.set()
    watcher.join()
    # Gone again (cancelled and forgotten), so that a folder used again holds the same table.
    for job_id in made:
        p.post(f"/jobs/{job_id}/cancel", {})
        p.delete(f"/jobs/{job_id}")
    worst_dump = max((probe.worst(a, b) for a, b in spans), default=0.0)
    # As each dump ends: its writer reaped (the end of its span) and what the jobs thread does
    # then (before: the journal rewritten; now: the older segments dropped from memory).
    worst_end = max((probe.worst(b - END_BEFORE_S, b + END_AFTER_S) for _a, b in spans),
                    default=0.0)
    worst_other = max((took for t0, took in probe.samples
                       if not any(t0 <= b and t0 + took >= a for a, b in spans)), default=0.0)
    written = (p.metric("meshjobs_dumps_written_total") or p.metric("dumps_written")) - written0
    size = os.path.getsize(os.path.join(p.m["data"], "raft.dump"))
    return {"dumps": len(spans), "dumps_metric": written, "worst_dump_s": worst_dump,
            "worst_end_s": worst_end,
            "worst_any_s": worst_other, "dump_bytes": size,
            "dump_write_s": max((b - a for a, b in spans), default=0.0), "submits": n,
            "probes": len(probe.samples)}


def _children(p: Proc) -> list[str]:
    """The member's child processes (the dump writer is forked by its jobs thread: each
    thread's children are listed apart)."""
    assert p.proc is not None
    kids: list[str] = []
    base = f"/proc/{p.proc.pid}/task"
    with contextlib.suppress(OSError):
        for task in os.listdir(base):
            with contextlib.suppress(OSError), open(f"{base}/{task}/children") as f:
                kids += f.read().split()
    return kids


def paging_step(p: Proc, want: dict) -> dict:
    out: dict[str, Any] = {}
    t0 = time.monotonic()
    first, _, _ = p.get("/jobs?limit=100")
    out["first_page_s"] = time.monotonic() - t0
    out["first_page_jobs"] = len(first)
    t0 = time.monotonic()
    pages = 0
    jobs = 0
    cursor = None
    last_cursor = None
    slowest = 0.0
    while True:
        q = "/jobs?limit=1000" + (f"&after={urllib.request.quote(cursor)}" if cursor else "")
        t1 = time.monotonic()
        page, headers, _ = p.get(q)
        slowest = max(slowest, time.monotonic() - t1)
        pages += 1
        jobs += len(page)
        nxt = headers.get("X-Meshjobs-Next")
        if not nxt:
            break
        last_cursor, cursor = cursor, nxt
    out["walk_s"] = time.monotonic() - t0
    out["walk_pages"] = pages
    out["walk_jobs"] = jobs
    out["slowest_page_s"] = slowest
    if cursor is not None:
        t0 = time.monotonic()
        p.get("/jobs?limit=1000&after=" + urllib.request.quote(cursor))
        out["deep_page_s"] = time.monotonic() - t0
    else:
        out["deep_page_s"] = out["first_page_s"]
    del last_cursor
    if want.get("big"):
        with Prober(p) as probe:
            t0 = time.monotonic()
            raw = p.get_raw(f"/jobs/{want['big']}?items=1")
            t1 = time.monotonic()
        rec, size = json.loads(raw), len(raw)
        out["items_s"] = t1 - t0
        out["items_n"] = len(rec.get("items") or [])
        out["items_bytes"] = size
        out["items_probe_s"] = probe.worst(t0, t1)
        t0 = time.monotonic()
        p.get(f"/jobs/{want['big']}")
        out["job_s"] = time.monotonic() - t0
    return out


def worker_step(lead: Proc, top: str) -> dict:
    """A worker member with an empty folder joins through the leader's member links while the
    leader is probed: the slowest probe until the worker's table reaches the leader's."""
    folder = os.path.join(top, "wjoin")
    shutil.rmtree(folder, ignore_errors=True)
    os.makedirs(folder)
    data = os.path.join(folder, "w1")
    os.makedirs(data, mode=0o700)
    shutil.copy(os.path.join(lead.m["data"], "fleet.secret"), os.path.join(data, "fleet.secret"))
    os.chmod(os.path.join(data, "fleet.secret"), 0o600)
    http, peer = free_port(), free_port()
    with open(os.path.join(folder, "w1.toml"), "w") as f:
        f.write(f'name = "w1"\nhttp = "127.0.0.1:{http}"\npeer = "127.0.0.1:{peer}"\n'
                f'[fleet]\njoin = "127.0.0.1:{lead.m["peer"]}"\n[pools.default]\nslots = 1\n')
    lay = {"voters": 0, "members": {"w1": {"data": data, "http": http, "peer": peer}}}
    w = Proc(folder, lay, "w1")
    goal = lead.health()["applied_index"]  # type: ignore[index]
    sent0 = lead.metric("meshjobs_node_state_snapshots_sent_total")
    t1 = None
    try:
        with Prober(lead) as probe:
            t0 = time.monotonic()
            w.start()
            with contextlib.suppress(RuntimeError):
                wait_for(lambda: (w.health() or {}).get("applied_index", 0) >= goal, 300,
                         "the new worker's table to reach the leader's")
                t1 = time.monotonic()
            time.sleep(0.2)  # sleep-ok: the probe's last samples
    finally:
        w.stop()
        with contextlib.suppress(OSError):
            shutil.copy(os.path.join(folder, "w1.log"), os.path.join(top, "wjoin-w1.log"))
        shutil.rmtree(folder, ignore_errors=True)
    end = t1 if t1 is not None else time.monotonic()
    return {"join_s": None if t1 is None else t1 - t0, "worst_s": probe.worst(t0, end),
            "probes": len(probe.samples),
            "tables_sent": lead.metric("meshjobs_node_state_snapshots_sent_total") - sent0}


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="scale.py million", description=__doc__.split("\n")[0])
    ap.add_argument("--items", type=int, default=1_000_000)
    ap.add_argument("--voters", type=int, choices=(1, 3), default=1)
    ap.add_argument("--per-job", type=int, default=100_000)
    ap.add_argument("--small-jobs", type=int, default=10_000)
    ap.add_argument("--data", help="build the folders here once and reuse them")
    ap.add_argument("--keep", action="store_true", help="keep the temporary folders")
    a = ap.parse_args(argv)
    print(f"machine: {machine()}; load at start {load()}", flush=True)
    tmp = None
    if a.data:
        top = os.path.abspath(a.data)
        os.makedirs(top, exist_ok=True)
    else:
        tmp = tempfile.mkdtemp(prefix="meshmillion-")
        top = tmp
    built_path = os.path.join(top, BUILT)
    if os.path.exists(built_path):
        with open(built_path) as f:
            saved = json.load(f)
        lay, want = saved["layout"], saved["want"]
        if lay["voters"] != a.voters or want["items"] != a.items:
            print(f"scale million: {top} holds {want['items']:,} items for {lay['voters']} "
                  "voter(s): use another --data folder for another size", file=sys.stderr)
            return 2
        print(f"reusing {top} ({want['items']:,} items, {lay['voters']} voter(s))", flush=True)
        write_configs(top, lay)  # a folder built before every voter had a config
    else:
        lay = layout(os.path.join(top, "fleet"), a.voters)
        write_configs(top, lay)
        print(f"building {a.items:,} finished items for {a.voters} voter(s) in {top} ...",
              flush=True)
        want = build(top, lay, a.items, a.per_job, a.small_jobs)
        with open(built_path, "w") as f:
            json.dump({"layout": lay, "want": want}, f)
        print(f"built in {want['build_s']} s: {want}", flush=True)
    names = list(lay["members"])
    res: dict[str, Any] = {}
    procs: list[Proc] = []
    try:
        # Baseline: the same fleet on empty folders.
        empty_top = tempfile.mkdtemp(prefix="meshmillion-empty-")
        elay = layout(os.path.join(empty_top, "fleet"), a.voters)
        write_configs(empty_top, elay)
        eprocs = [Proc(empty_top, elay, n).start() for n in elay["members"]]
        try:
            lead = leader_of(eprocs)
            for _ in range(20):
                lead.get("/jobs?limit=100")
                lead.health()
            time.sleep(1.0)  # sleep-ok: let the member settle before reading its memory
            res["rss_empty"] = lead.rss_anon()
        finally:
            for p in eprocs:
                p.stop()
            shutil.rmtree(empty_top, ignore_errors=True)

        # Restart: start every voter, time until the table is served whole.
        procs = [Proc(top, lay, n) for n in names]
        t0 = time.monotonic()
        for p in procs:
            p.start()
        lead = wait_for(lambda: next((p for p in procs if serving(p, want)), None), 300,
                        "a member serving the whole table")
        res["restart_s"] = time.monotonic() - t0
        if a.voters > 1:
            wait_for(lambda: all(serving(p, want) for p in procs), 300, "every voter serving")
            res["restart_all_s"] = time.monotonic() - t0
            lead = leader_of(procs)
        dump = os.path.join(lead.m["data"], "raft.dump")
        res["dump_bytes_at_start"] = os.path.getsize(dump) if os.path.exists(dump) else 0
        journal = os.path.join(lead.m["data"], "raft.journal")
        res["journal_bytes_at_start"] = os.path.getsize(journal) if os.path.exists(journal) else 0
        time.sleep(1.0)  # sleep-ok: let the member settle before reading its memory
        res["rss"] = lead.rss_anon()
        print(f"  restart {res['restart_s']:.2f} s; RssAnon {res['rss'] >> 20} MiB "
              f"(empty {res['rss_empty'] >> 20} MiB)", flush=True)

        res["paging"] = paging_step(lead, want)
        print(f"  paging: {res['paging']}", flush=True)

        follower = None
        if a.voters > 1:
            follower = next(p for p in procs if p is not lead)
            follower.stop()
        res["snap"] = snapshot_step(lead, top)
        print(f"  snapshot: {res['snap']}", flush=True)
        res["rss_after"] = lead.rss_anon()
        res["worker"] = worker_step(lead, top)
        print(f"  new worker: {res['worker']}", flush=True)

        if follower is not None:
            goal_index = lead.health()["applied_index"]  # type: ignore[index]
            t0 = time.monotonic()
            follower.start()
            wait_for(lambda: (follower.health() or {}).get("applied_index", 0) >= goal_index,
                     600, "the restarted voter to catch up")
            res["catch_up_s"] = time.monotonic() - t0
            print(f"  catch-up {res['catch_up_s']:.2f} s", flush=True)

        # Restart once more, from the dump the member wrote itself and its journal.
        for p in procs:
            p.stop()
        want2 = dict(want, jobs=want["jobs"])
        t0 = time.monotonic()
        for p in procs:
            p.start()
        wait_for(lambda: next((p for p in procs if serving(p, want2)), None), 300,
                 "a member serving the whole table")
        res["restart2_s"] = time.monotonic() - t0
    finally:
        for p in procs:
            p.stop()
        if tmp and not a.keep:
            shutil.rmtree(tmp, ignore_errors=True)
    report(a, want, res)
    return 0


def _met(ok: bool) -> str:
    return "met" if ok else "missed"


def report(a: argparse.Namespace, want: dict, res: dict) -> None:
    items = want["items"]
    per_item = (res["rss"] - res["rss_empty"]) / items
    pg, sn = res["paging"], res["snap"]
    fleet = "fleet of one" if a.voters == 1 else f"{a.voters} voters (leader)"
    print()
    print(f"{items:,} finished items ({want['jobs']:,} jobs), {fleet}")
    print()
    print("| figure | goal | measured | met |")
    print("|---|---|---|---|")
    print(f"| RSS per item (RssAnon − empty member) | ≤ 300 B | {per_item:.0f} B "
          f"({res['rss'] >> 20} − {res['rss_empty'] >> 20} MiB) | {_met(per_item <= 300)} |")
    print(f"| restart: start → whole table served (dump {res['dump_bytes_at_start'] / 1e6:.1f} MB "
          f"+ journal {res['journal_bytes_at_start'] / 1e6:.1f} MB) | ≤ 10 s | "
          f"{res['restart_s']:.2f} s | {_met(res['restart_s'] <= 10)} |")
    if "restart_all_s" in res:
        print(f"| restart: all voters serving | ≤ 10 s | {res['restart_all_s']:.2f} s | "
              f"{_met(res['restart_all_s'] <= 10)} |")
    print(f"| restart again (member's own dump + journal) | ≤ 10 s | {res['restart2_s']:.2f} s | "
          f"{_met(res['restart2_s'] <= 10)} |")
    print(f"| snapshot size | — | {sn['dump_bytes'] / 1e6:.1f} MB | — |")
    print(f"| jobs-thread pause while a snapshot is written (slowest /healthz probe, "
          f"{sn['dumps']} dump(s), {sn['dump_write_s']:.1f} s each) | ≤ 50 ms | "
          f"{sn['worst_dump_s'] * 1000:.0f} ms | {_met(sn['dumps'] > 0 and sn['worst_dump_s'] <= 0.05)} |")
    print(f"| of which as a snapshot ends (probes in flight from {END_BEFORE_S * 1000:.0f} ms "
          f"before its writer is gone to {END_AFTER_S * 1000:.0f} ms after) | ≤ 50 ms | "
          f"{sn['worst_end_s'] * 1000:.0f} ms | {_met(sn['dumps'] > 0 and sn['worst_end_s'] <= 0.05)} |")
    print(f"| slowest /healthz probe of that step while no dump was written ({sn['probes']} "
          f"probes in all, {sn['submits']} submits of 200 KB) | — | "
          f"{sn['worst_any_s'] * 1000:.0f} ms | — |")
    print(f"| GET /jobs first page (100) | — | {pg['first_page_s'] * 1000:.0f} ms | — |")
    print(f"| GET /jobs deep page (last of 1,000) | — | {pg['deep_page_s'] * 1000:.0f} ms | — |")
    print(f"| GET /jobs all pages ({pg['walk_pages']} of 1,000, {pg['walk_jobs']:,} jobs) | — | "
          f"{pg['walk_s']:.2f} s (slowest page {pg['slowest_page_s'] * 1000:.0f} ms) | — |")
    if "items_s" in pg:
        print(f"| GET /jobs/ID?items=1, {pg['items_n']:,} items ({pg['items_bytes'] / 1e6:.1f} MB) "
              f"| — | {pg['items_s']:.2f} s | — |")
        print(f"| jobs-thread pause during it (slowest /healthz probe) | ≤ 50 ms | "
              f"{pg['items_probe_s'] * 1000:.0f} ms | {_met(pg['items_probe_s'] <= 0.05)} |")
        print(f"| GET /jobs/ID (no items) | — | {pg['job_s'] * 1000:.0f} ms | — |")
    wk = res["worker"]
    joined = ("not in 300 s" if wk["join_s"] is None else f"{wk['join_s']:.2f} s")
    print(f"| a new worker joins: start → its table at the leader's | — | {joined} "
          f"({wk['tables_sent']:.0f} whole table(s) sent) | — |")
    print(f"| leader's jobs-thread pause meanwhile (slowest /healthz probe of {wk['probes']}) "
          f"| ≤ 50 ms | {wk['worst_s'] * 1000:.0f} ms | {_met(wk['worst_s'] <= 0.05)} |")
    if "catch_up_s" in res:
        print(f"| restarted voter catches up (log compacted: dump sent) | — | "
              f"{res['catch_up_s']:.2f} s | — |")
    print()
    print(f"machine: {machine()}; load average at the end {load()}; table built in "
          f"{want['build_s']} s")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
