"""meshjobs as a system under test: a fleet of one, or 3 voters on loopback, each member a real
`python -m meshjobs.daemon --config FILE` in a temporary folder, spoken to over HTTP with
keep-alive `http.client` connections.

Slots: the fleet has 2 `default` slots in all, like the peers' 2 workers (a fleet of one: 2;
3 voters: 1/1/0). Clients talk to the leader. Submits of the submit-rate and big-array
workloads are held (`"hold": true`), so nothing runs while they are measured.
"""

from __future__ import annotations

import http.client
import json
import os
import sys
import threading
import time
import uuid
from typing import Any

from bench.common import free_port
from bench.peers import NotAvailable, Procs, System, wait_until

START_S_MAX = 60.0
FINISHED = ("done", "failed", "cancelled")


class Http:
    """One keep-alive HTTP connection to a member; reconnects after an error."""

    def __init__(self, url: str, timeout_s: float = 120.0) -> None:
        host, _, port = url.removeprefix("http://").rpartition(":")
        self.host, self.port, self.timeout_s = host, int(port), timeout_s
        self.conn: http.client.HTTPConnection | None = None

    def call(self, method: str, path: str, body: Any = None, raw: bytes | None = None,
             key: str | None = None) -> tuple[int, Any]:
        data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
        headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if key:
            headers["Idempotency-Key"] = key
        if self.conn is None:
            self.conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout_s)
        try:
            self.conn.request(method, path, body=data, headers=headers)
            r = self.conn.getresponse()
            payload = r.read()
        except (OSError, http.client.HTTPException):
            self.close()
            raise
        try:
            return r.status, json.loads(payload) if payload else None
        except ValueError:
            return r.status, payload

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None

    def wait(self, job_id: str) -> dict:
        while True:
            status, rec = self.call("GET", f"/jobs/{job_id}?wait=60")
            if status != 200:
                raise RuntimeError(f"GET /jobs/{job_id}: {status} {rec}")
            if rec["state"] in FINISHED:
                return rec

    def submit(self, spec: dict) -> dict:
        status, rec = self.call("POST", "/jobs", spec, key=uuid.uuid4().hex)
        if status not in (200, 201):
            raise RuntimeError(f"POST /jobs: {status} {rec}")
        return rec


class MeshMember:
    def __init__(self, procs: Procs, top: str, name: str, cfg_text: str) -> None:
        self.procs = procs
        self.name = name
        self.data = os.path.join(top, name)
        os.makedirs(self.data, exist_ok=True)
        self.cfg = os.path.join(top, f"{name}.toml")
        with open(self.cfg, "w") as f:
            f.write(f'data = "{self.data}"\n' + cfg_text)
        self.log = os.path.join(top, f"{name}.log")
        self.proc = None
        self.url = ""

    def start(self) -> None:
        addr = os.path.join(self.data, "http.addr")
        if os.path.exists(addr):
            os.unlink(addr)
        self.proc = self.procs.start(
            [sys.executable, "-m", "meshjobs.daemon", "--config", self.cfg, "--log-level", "warning"],
            self.log, cwd=self.data)

    def wait_ready(self) -> None:
        addr = os.path.join(self.data, "http.addr")

        def ready() -> bool:
            if self.proc.poll() is not None:
                with open(self.log, "rb") as f:
                    tail = f.read()[-2000:].decode(errors="replace")
                raise RuntimeError(f"meshd {self.name} exited with {self.proc.returncode}: {tail}")
            if not os.path.exists(addr):
                return False
            with open(addr) as f:
                self.url = "http://" + f.read().strip()
            try:
                status, h = self.health()
            except OSError:
                return False
            return status == 200 and bool(h.get("ready"))
        wait_until(ready, START_S_MAX, f"meshd {self.name} ready", every_s=0.05)

    def health(self) -> tuple[int, Any]:
        c = Http(self.url, timeout_s=2)
        try:
            return c.call("GET", "/healthz")
        finally:
            c.close()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def rss_anon_kb(self) -> int:
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1])
        raise RuntimeError("no RssAnon in /proc status")

    def stop(self) -> None:
        if self.proc is not None:
            self.procs.stop(self.proc, timeout_s=30)
            self.proc = None


class MeshFleet(System):
    """A fleet of one (`voters=1`) or of 3 voters; `slots` per member, 2 in all."""

    def __init__(self, procs: Procs, top: str, voters: int, python_pool: bool = False) -> None:
        self.procs = procs
        self.voters = voters
        self.python_pool = python_pool
        self.name = "meshjobs, fleet of 1" if voters == 1 else f"meshjobs, {voters} voters"
        self.top = top
        self.slots = [2] if voters == 1 else ([1, 1] + [0] * (voters - 2))
        self.members: list[MeshMember] = []
        self.lead: MeshMember | None = None

    def _configs(self) -> list[tuple[str, str]]:
        pools = []
        for n in self.slots:
            p = f"[pools.default]\nslots = {n}\n"
            if self.python_pool:
                p += f'[pools.py]\nkind = "python"\nslots = {n}\n'
            pools.append(p)
        if self.voters == 1:
            return [("m1", f'name = "m1"\nhttp = "127.0.0.1:{free_port()}"\n'
                           f'raft = "127.0.0.1:{free_port()}"\npeer = "127.0.0.1:{free_port()}"\n'
                     + pools[0])]
        secret = os.urandom(32)
        ports = {f"v{i}": (free_port(), free_port(), free_port()) for i in range(1, self.voters + 1)}
        voter_lines = ", ".join(
            f'{{ name = "{n}", raft = "127.0.0.1:{r}", peer = "127.0.0.1:{p}", http = "127.0.0.1:{h}" }}'
            for n, (r, p, h) in ports.items())
        out = []
        for (name, _), pool in zip(ports.items(), pools, strict=True):
            data = os.path.join(self.top, name)
            os.makedirs(data, exist_ok=True)
            fd = os.open(os.path.join(data, "fleet.secret"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            os.write(fd, secret)
            os.close(fd)
            out.append((name, f'name = "{name}"\n[fleet]\nvoters = [ {voter_lines} ]\n' + pool))
        return out

    def start(self) -> None:
        os.makedirs(self.top, exist_ok=True)
        self.members = [MeshMember(self.procs, self.top, n, c) for n, c in self._configs()]
        for m in self.members:
            m.start()
        for m in self.members:
            m.wait_ready()
        self.lead = self.leader()

    def stop(self) -> None:
        for m in self.members:
            m.stop()
        self.members = []

    def reset(self) -> None:
        """A fresh fleet, so one workload's jobs do not weigh on the next."""
        self.stop()
        import shutil
        shutil.rmtree(self.top, ignore_errors=True)
        self.start()

    def leader(self, timeout_s: float = 30.0) -> MeshMember:
        def find() -> MeshMember | None:
            for m in self.members:
                if not m.alive():
                    continue
                try:
                    status, h = m.health()
                except OSError:
                    continue
                if status == 200 and h.get("is_leader") and h.get("ready"):
                    return m
            return None
        return wait_until(find, timeout_s, "a ready leader", every_s=0.02)

    def client(self) -> Http:
        assert self.lead is not None
        return Http(self.lead.url)

    def _spec(self, kind: str, n: int | None) -> dict:
        if kind == "true":
            spec: dict = {"argv": ["/bin/true"]}
        else:
            if not self.python_pool:
                raise NotAvailable("n/a (pool kind `python` not built yet)")
            spec = {"pool": "py", "argv": ["bench.noop:run"]}
        if n is not None:
            spec["items"] = [""] * n
        return spec

    def run_items(self, kind: str, n: int) -> float:
        spec = json.dumps(self._spec(kind, n)).encode()
        c = self.client()
        t0 = time.perf_counter()
        status, rec = c.call("POST", "/jobs", raw=spec, key=uuid.uuid4().hex)
        if status not in (200, 201):
            raise RuntimeError(f"POST /jobs: {status} {rec}")
        done = c.wait(rec["id"])
        dt = time.perf_counter() - t0
        c.close()
        if done["items_done"] != n:
            raise RuntimeError(f"job {rec['id']} ended {done['state']} with {done['items_done']}/{n} done")
        return dt

    def submit_rate(self, threads: int, seconds: float) -> float:
        counts = [0] * threads
        errors: list[str] = []
        stop_at = time.monotonic() + seconds
        body = {"argv": ["/bin/true"], "hold": True}

        def client(i: int) -> None:
            c = self.client()
            try:
                while time.monotonic() < stop_at:
                    status, rec = c.call("POST", "/jobs", body, key=uuid.uuid4().hex)
                    if status in (200, 201):
                        counts[i] += 1
                    elif len(errors) < 5:
                        errors.append(f"{status} {rec}")
            finally:
                c.close()
        t0 = time.perf_counter()
        ts = [threading.Thread(target=client, args=(i,)) for i in range(threads)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        rate = sum(counts) / (time.perf_counter() - t0)
        if errors:
            print(f"  {self.name}: {len(errors)}+ submits refused, e.g. {errors[0]}", flush=True)
        return rate

    def big_submit(self, n: int) -> float:
        spec = dict(self._spec("true", n), hold=True)
        raw = json.dumps(spec).encode()
        c = self.client()
        t0 = time.perf_counter()
        status, rec = c.call("POST", "/jobs", raw=raw, key=uuid.uuid4().hex)
        dt = time.perf_counter() - t0
        c.close()
        if status not in (200, 201):
            raise RuntimeError(f"POST /jobs of {n} items: {status} {rec}")
        return dt

    def latency(self, n: int) -> list[float]:
        c = self.client()
        out = []
        body = {"argv": ["/bin/true"]}
        for i in range(n + 5):
            t0 = time.perf_counter()
            rec = c.submit(body)
            done = c.wait(rec["id"])
            dt = (time.perf_counter() - t0) * 1000
            if done["state"] != "done":
                raise RuntimeError(f"job {rec['id']} ended {done['state']}")
            if i >= 5:
                out.append(dt)
        c.close()
        return out

    def failover(self) -> float:
        """kill -9 the leader; seconds until a submit to another member is answered 2xx. The
        killed member is started again (and the fleet settled) before this returns."""
        if self.voters < 3:
            raise NotAvailable("n/a (needs 3 voters)")
        lead = self.leader()
        other = next(m for m in self.members if m is not lead)
        c = Http(other.url, timeout_s=2)
        c.submit({"argv": ["/bin/true"], "hold": True})  # the connection is open and warm
        key = uuid.uuid4().hex
        body = json.dumps({"argv": ["/bin/true"], "hold": True}).encode()
        self.procs.kill9(lead.proc)
        t0 = time.perf_counter()
        while True:
            try:
                status, _ = c.call("POST", "/jobs", raw=body, key=key)
            except (OSError, http.client.HTTPException):
                status = 0
            if status in (200, 201):
                break
            if time.perf_counter() - t0 > 60:
                raise RuntimeError("no submit answered 2xx within 60 s of the leader's kill")
            time.sleep(0.005)
        dt = time.perf_counter() - t0
        c.close()
        self.procs.stop(lead.proc)  # reaps its process group (items it left running)
        lead.start()
        lead.wait_ready()
        self.lead = self.leader()
        self._wait_settled()
        return dt

    def _wait_settled(self) -> None:
        """Every member answers and follows the same leader."""
        def settled() -> bool:
            leaders = set()
            for m in self.members:
                try:
                    status, h = m.health()
                except OSError:
                    return False
                if status != 200 or not h.get("ready") or not h.get("fresh", True):
                    return False
                leaders.add(h.get("leader"))
            return len(leaders) == 1 and None not in leaders
        wait_until(settled, 60, "the fleet settled", every_s=0.1)
        time.sleep(1.0)  # Let the restarted member catch up on the log before the next kill.


def python_pool_works(procs: Procs, top: str) -> tuple[bool, str]:
    """Whether a member started with `[pools.py] kind = "python"` takes a `bench.noop:run` job."""
    m = MeshMember(procs, top, "probe",
                   f'name = "probe"\nhttp = "127.0.0.1:{free_port()}"\nraft = "127.0.0.1:{free_port()}"\n'
                   f'peer = "127.0.0.1:{free_port()}"\n[pools.default]\nslots = 1\n'
                   '[pools.py]\nkind = "python"\nslots = 1\n')
    m.start()
    try:
        try:
            m.wait_ready()
        except RuntimeError as e:
            return False, str(e).strip().splitlines()[-1] if str(e).strip() else "meshd did not start"
        c = Http(m.url, timeout_s=30)
        status, rec = c.call("POST", "/jobs", {"pool": "py", "argv": ["bench.noop:run"]})
        c.close()
        return status in (200, 201), f"POST /jobs to pool py: {status} {rec}"
    finally:
        m.stop()


class Prober:
    """GET /healthz every `every_s` on its own connection (the answer goes through the jobs
    thread, so it waits out whatever holds that thread, a snapshot included), and the times at
    which the member's `raft.dump` was rewritten (its mtime: the end of a snapshot)."""

    def __init__(self, member: MeshMember, every_s: float = 0.02) -> None:
        self.member = member
        self.every_s = every_s
        self.probes: list[tuple[float, float]] = []  # (sent, answered), time.time()
        self.dumps: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Prober:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(120)

    def _run(self) -> None:
        c = Http(self.member.url, timeout_s=120)
        dump = os.path.join(self.member.data, "raft.dump")
        last_mtime = os.path.getmtime(dump) if os.path.exists(dump) else 0.0
        while not self._stop.is_set():
            t0 = time.time()
            try:
                c.call("GET", "/healthz")
            except (OSError, http.client.HTTPException):
                pass
            self.probes.append((t0, time.time()))
            try:
                mtime = os.path.getmtime(dump)
            except OSError:
                mtime = last_mtime
            if mtime != last_mtime:
                self.dumps.append(mtime)
                last_mtime = mtime
            self._stop.wait(self.every_s)
        c.close()

    def longest_s(self) -> float:
        return max((b - a for a, b in self.probes), default=0.0)

    def longest_at_dump_s(self) -> float:
        """The slowest probe in flight when a snapshot ended (0.1 s of slack for the clocks)."""
        worst = 0.0
        for end in self.dumps:
            for a, b in self.probes:
                if a - 0.1 <= end <= b + 0.1:
                    worst = max(worst, b - a)
        return worst


def table_memory(fleet: MeshFleet, steps: list[int]) -> dict:
    """RssAnon of a fleet of one's meshd per finished `true` item, after `steps` items in all
    (cumulative, e.g. [100_000, 1_000_000]), and how long requests waited during snapshots."""
    m = fleet.members[0]
    c = Http(m.url, timeout_s=300)
    c.wait(c.submit({"argv": ["/bin/true"], "items": [""] * 100})["id"])  # warm up
    time.sleep(0.5)
    before_kb = m.rss_anon_kb()
    out: dict = {"before_kb": before_kb, "per_item_b": {}, "seconds": {}}
    total = 0
    with Prober(m) as probe:
        for target in steps:
            t0 = time.perf_counter()
            while total < target:
                n = min(target - total, 1_000_000)
                rec = c.submit({"argv": ["/bin/true"], "items": [""] * n})
                done = c.wait(rec["id"])
                if done["items_done"] != n:
                    raise RuntimeError(f"job {rec['id']}: {done['items_done']}/{n} items done")
                total += n
            out["seconds"][target] = time.perf_counter() - t0
            time.sleep(0.5)
            out["per_item_b"][target] = (m.rss_anon_kb() - before_kb) * 1024 / total
            print(f"  {total:,} items finished in {out['seconds'][target]:.0f} s, "
                  f"{out['per_item_b'][target]:.0f} B per item", flush=True)
    c.close()
    out["dumps"] = len(probe.dumps)
    out["longest_probe_s"] = probe.longest_s()
    out["longest_at_dump_s"] = probe.longest_at_dump_s()
    out["dump_bytes"] = (os.path.getsize(os.path.join(m.data, "raft.dump"))
                         if os.path.exists(os.path.join(m.data, "raft.dump")) else 0)
    return out
