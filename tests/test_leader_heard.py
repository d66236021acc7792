"""A new leader's first moments on real members (issue 26, point 1): 3 voters and 2 workers,
the workers alone offering pool "gpu" (the layout of deploy/fleet/). Right after the leader is
killed (-9), the new leader has not heard from the workers yet (here they are paused, so that
it cannot have): a submit to gpu, a fan-out and `member drain w2` are "not known yet" (503,
retried by a member that forwarded them), never a final 400/404 or a fan-out that leaves the
workers out; once the workers report, each goes through."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from tests.helpers import Meshd, env_with_path, fleet_running, leader_of, make_fleet, wait_until

pytestmark = pytest.mark.fleet

GPU = "\n[pools.gpu]\nslots = 1\n"
# Long enough that the new leader surely still waits for the paused workers while the test
# asks, on a loaded machine; the fan-out after the kill waits this long (the killed voter
# never reports again).
DEAD_MS = 12_000


@pytest.fixture
def fleet(tmp_path: Any) -> Iterator[list[Meshd]]:
    yield from fleet_running(make_fleet(str(tmp_path), voters=3, workers=2, dead_ms=DEAD_MS,
                                        worker_pools=GPU))


class Paused:
    """Members stopped with SIGSTOP until `resume` (also on failure: call it in a finally)."""

    def __init__(self, members: list[Meshd]) -> None:
        self.members = members
        for m in members:
            os.kill(m.pid, signal.SIGSTOP)

    def resume(self) -> None:
        for m in self.members:
            if m.proc is not None and m.proc.poll() is None:
                os.kill(m.pid, signal.SIGCONT)
        self.members = []


def _alive(m: Meshd) -> set[str]:
    status, fleet = m.request("GET", "/fleet")
    return {r["name"] for r in fleet["members"] if r.get("alive") is True} if status == 200 else set()


def _until_taken(m: Meshd, spec: dict, seen: list[int]) -> dict:
    """POST /jobs until it is taken; every answer before is 503 (noted in `seen`)."""
    def attempt() -> dict | None:
        status, body = m.request("POST", "/jobs", spec)
        seen.append(status)
        assert status in (200, 201, 503), (status, body)
        return body if status in (200, 201) else None
    return wait_until(attempt, timeout_s=DEAD_MS / 1000 + 60, what=f"{spec['id']} taken")


def test_worker_pool_fanout_and_drain_right_after_a_leader_kill(fleet: list[Meshd]) -> None:
    lead = leader_of(fleet)
    voters = [m for m in fleet if m.name.startswith("v")]
    workers = [m for m in fleet if m.name.startswith("w")]
    wait_until(lambda: {"w1", "w2"} <= _alive(lead), what="both workers alive at the leader")
    # A gpu fan-out before the kill: both workers run an item of it (the table names both).
    before = _until_taken(lead, {"argv": ["true"], "pool": "gpu", "member": "*",
                                 "id": "before"}, [])
    assert before["members"] == ["w1", "w2"], before
    assert lead.wait_job("before")["state"] == "done"

    paused = Paused(workers)
    drain: subprocess.Popen | None = None
    try:
        lead.kill9()
        rest = [m for m in voters if m is not lead]
        new = leader_of(rest)
        follower = next(m for m in rest if m is not new)
        gpu = {"argv": ["sh", "-c", "echo on-$MESH_MEMBER"], "pool": "gpu", "id": "gpu-after"}
        status, body = new.request("POST", "/jobs", gpu)
        assert status == 503 and "try again" in body["error"], (status, body)
        fan = {"argv": ["true"], "member": "*", "id": "fan-after"}
        status, body = new.request("POST", "/jobs", fan)
        assert status == 503 and "fan-out" in body["error"], (status, body)
        # Through the follower: it forwards the order, and asks again itself while the leader
        # cannot tell (its client sees neither the 503 nor "no member").
        drain = subprocess.Popen(
            [sys.executable, "-m", "meshjobs.cli", "--at", follower.url, "member", "drain", "w2"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env_with_path())

        def retried() -> bool:
            assert drain is not None and drain.poll() is None, drain and drain.communicate()
            return follower.metrics().get("meshjobs_node_ctl_not_known_yet_retried_total", 0) >= 1
        wait_until(retried, what="the follower asks the new leader again")
        paused.resume()
        out, err = drain.communicate(timeout=60)
        assert drain.returncode == 0 and b"drained" in out, (drain.returncode, out, err)
        seen: list[int] = []
        rec = _until_taken(new, gpu, seen)
        assert rec["pool"] == "gpu"
        done = new.wait_job("gpu-after")
        assert done["state"] == "done" and done["items"][0]["member"] == "w1", done
        rec = _until_taken(new, fan, seen)
        assert rec["members"] == sorted([new.name, follower.name, "w1", "w2"]), rec
        assert set(seen) <= {200, 201, 503}, seen
    finally:
        paused.resume()
        if drain is not None and drain.poll() is None:
            drain.kill()
            drain.wait()
