"""The procedures of docs/operating.md ("Changing the voters", "Replacing a dead voter's disk",
"Backup and restore"), done as an operator would, with real meshd processes: every member
stopped by pid, also on failure; every wait on a condition.

meshjobs' voters are a static list (pysyncobj's dynamic membership change is off), so the
voters change by a full stop of the fleet and a new list on every voter; the rule the procedures
keep is that the voters of the new list that were voters before hold every committed entry before
a new or emptied voter may vote."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest

from tests.helpers import (
    ROOT,
    Meshd,
    env_with_path,
    free_port,
    holds_bytes,
    leader_of,
    make_fleet,
    start_all,
    submit_anywhere,
    wait_until,
)

pytestmark = pytest.mark.fleet

DONE_SPEC = {"argv": ["sh", "-c", "echo out-$MESH_JOB_ID"]}


def write_configs(members: list[Meshd], voters: list[Meshd], http_ports: dict[str, int],
                  dead_ms: int = 1500, lost_ms: int | None = None) -> None:
    """Every member's config with `voters` as its [fleet] voters, as an operator writes them."""
    entries = ", ".join(
        f'{{ name = "{v.name}", raft = "127.0.0.1:{v.raft_port}", '
        f'peer = "127.0.0.1:{v.peer_port}", http = "127.0.0.1:{http_ports[v.name]}" }}'
        for v in voters)
    lost = f"lost_ms = {lost_ms}\n" if lost_ms is not None else ""
    for m in members:
        assert m.config is not None
        with open(m.config, "w") as f:
            f.write(f'name = "{m.name}"\n[fleet]\nvoters = [ {entries} ]\ndead_ms = {dead_ms}\n'
                    f"{lost}[pools.default]\nslots = 2\n")


def fleet_of(top: str, names: int, voters: int, **kw) -> tuple[list[Meshd], dict[str, int]]:
    """`names` members v1.. with one secret; the first `voters` of them have configs listing
    those voters. Ports taken between probe and bind are chosen again (start_all)."""
    members = make_fleet(top, voters=names)
    http_ports: dict[str, int] = {}

    def new_ports() -> None:
        for m in members:
            m.raft_port, m.peer_port = free_port(), free_port()
            http_ports[m.name] = free_port()
        write_configs(members[:voters], members[:voters], http_ports, **kw)

    new_ports()
    for m in members:
        m.new_ports = new_ports
    return members, http_ports


def stop_all(members: list[Meshd]) -> None:
    for m in members:
        if m.proc is not None and m.proc.poll() is None:
            assert m.terminate() == 0, m.log_tail()


def has_job_done(m: Meshd, job_id: str) -> bool:
    status, rec = m.request("GET", f"/jobs/{job_id}", timeout_s=5)
    return status == 200 and rec["state"] == "done"


def copies_back(members: list[Meshd], jobs: list[str], copies: int = 2) -> bool:
    """Whether each job's output (`out-ID`, unique to it) is in the blob stores of at least
    `copies` of `members` (the fleet's blob_copies)."""
    return all(sum(holds_bytes(m.data, f"out-{j}".encode()) for m in members) >= copies
               for j in jobs)


def results_text(m: Meshd, job_id: str) -> str:
    r = m.ctl("job", "results", job_id)
    assert r.returncode == 0, r.stderr
    return r.stdout.decode()


def run_jobs(members: list[Meshd], n: int) -> list[str]:
    """n jobs submitted through whichever member takes them, each waited for until done."""
    ids = []
    for _ in range(n):
        m, job_id = submit_anywhere(members, DONE_SPEC)
        assert m.wait_job(job_id)["state"] == "done"
        ids.append(job_id)
    return ids


def test_add_two_voters_by_a_full_stop(tmp_path):
    """docs/operating.md "Adding a voter": stop the fleet, give every voter the new list, start
    the old voters first and commit one change, then start the new voters empty. The new voters
    catch up, and they vote: the fleet commits with two old voters down."""
    members, http_ports = fleet_of(str(tmp_path), names=5, voters=3)
    old, new = members[:3], members[3:]
    try:
        start_all(old)
        before = run_jobs(old, 3)
        stop_all(old)
        write_configs(members, members, http_ports)
        for m in members:
            m.new_ports = None  # a restart keeps its ports: the voters' list names them
        start_all(old)
        _, during = submit_anywhere(old, DONE_SPEC)  # the one committed change
        start_all(new)
        jobs = [*before, during]
        for m in new:
            wait_until(lambda m=m: all(has_job_done(m, j) for j in jobs), what=f"{m.name} caught up")
            assert results_text(m, before[0]).strip() == f"out-{before[0]}"
        status, fleet = new[0].request("GET", "/fleet")
        assert status == 200
        roles = {r["name"]: r.get("role") for r in fleet["members"]}
        # Raft roles: a voter is a leader or a follower; a worker is a worker.
        assert {roles.get("v4"), roles.get("v5")} <= {"leader", "follower"}, fleet
        # Quorum is now 3 of 5: with v1 and v2 down, v3, v4 and v5 still commit.
        stop_all(old[:2])
        m, after = submit_anywhere([old[2], *new], DONE_SPEC)
        assert m.wait_job(after)["state"] == "done"
        for m in new:
            wait_until(lambda m=m: all(has_job_done(m, j) for j in [*jobs, after]),
                       what=f"{m.name} has every job")
    finally:
        for m in members:
            m.stop()


def test_remove_two_voters_by_a_full_stop(tmp_path):
    """docs/operating.md "Removing a voter": stop the voters that go, wait past lost_ms for their
    outputs to be copied to the voters that stay, commit one change with them, stop the fleet, give the voters that stay the smaller list, start them. Every job
    acknowledged before is there, and the three commit alone."""
    members, http_ports = fleet_of(str(tmp_path), names=5, voters=5, lost_ms=2000)
    stay, go = members[:3], members[3:]
    try:
        start_all(members)
        before = run_jobs(members, 6)
        stop_all(go)
        wait_until(lambda: copies_back(stay, before), what="the outputs of v4 and v5 copied again")
        _, during = submit_anywhere(stay, DONE_SPEC)
        stop_all(stay)
        for m in go:
            shutil.rmtree(m.data)  # a removed voter never starts again with the old list
        write_configs(stay, stay, http_ports)
        for m in members:
            m.new_ports = None
        start_all(stay)
        for m in stay:
            wait_until(lambda m=m: all(has_job_done(m, j) for j in [*before, during]),
                       what=f"{m.name} has every job")
        # Quorum is now 2 of 3: with one voter down the other two commit.
        leader = leader_of(stay)
        down = [m for m in stay if m is not leader][0]
        stop_all([down])
        m, after = submit_anywhere([m for m in stay if m is not down], DONE_SPEC)
        assert m.wait_job(after)["state"] == "done"
    finally:
        for m in members:
            m.stop()


def test_dead_voters_disk_replaced(tmp_path):
    """docs/operating.md "Replacing a dead voter's disk": the voter's data folder is gone; while
    it is down one change commits (so the other voters hold every committed entry) and, past
    `lost_ms`, the leader copies again the outputs it held. It starts on an empty folder with
    the fleet secret alone, catches up, and nothing acknowledged is lost: with the leader down
    too, the fleet still commits and has every job."""
    members, _ = fleet_of(str(tmp_path), names=3, voters=3, lost_ms=2000)
    try:
        start_all(members)
        before = run_jobs(members, 3)
        leader = leader_of(members)
        dead = next(m for m in members if m is not leader)
        dead.kill9()
        shutil.rmtree(dead.data)
        alive = [m for m in members if m is not dead]
        _, during = submit_anywhere(alive, DONE_SPEC)
        wait_until(lambda: copies_back(alive, before), what="the dead voter's copies made again")
        os.makedirs(dead.data)
        with open(os.path.join(dead.data, "fleet.secret"), "wb") as f:
            f.write(leader.secret)
        os.chmod(os.path.join(dead.data, "fleet.secret"), 0o600)
        dead.start()
        jobs = [*before, during]
        wait_until(lambda: all(has_job_done(dead, j) for j in jobs), what="the new disk caught up")
        leader.kill9()
        rest = [m for m in members if m is not leader]
        m, after = submit_anywhere(rest, DONE_SPEC)
        assert m.wait_job(after)["state"] == "done"
        for m in rest:
            assert all(has_job_done(m, j) for j in jobs)
            assert results_text(m, before[0]).strip() == f"out-{before[0]}"
    finally:
        for m in members:
            m.stop()


def test_voter_restored_from_a_backup(tmp_path):
    """docs/operating.md "Backup and restore": a copy of a stopped voter's data folder, put back
    after its disk died (with one change committed while it is down), brings it back: it catches
    up past the backup, and the fleet keeps every job with another voter down."""
    members, _ = fleet_of(str(tmp_path), names=3, voters=3)
    backup = str(tmp_path / "v3-backup")
    try:
        start_all(members)
        first = run_jobs(members, 2)
        v3 = members[2]
        assert v3.terminate() == 0
        shutil.copytree(v3.data, backup, symlinks=True)
        v3.start()
        second = run_jobs(members, 2)
        v3.kill9()
        shutil.rmtree(v3.data)
        _, during = submit_anywhere(members[:2], DONE_SPEC)
        shutil.copytree(backup, v3.data, symlinks=True)
        v3.start()
        jobs = [*first, *second, during]
        wait_until(lambda: all(has_job_done(v3, j) for j in jobs), what="the restored voter caught up")
        other = members[0]
        other.kill9()
        m, after = submit_anywhere(members[1:], DONE_SPEC)
        assert m.wait_job(after)["state"] == "done"
        assert all(has_job_done(v3, j) for j in [*jobs, after])
    finally:
        for m in members:
            m.stop()


def test_whole_fleet_restored_from_copies_taken_stopped(tmp_path):
    """docs/operating.md "Backup and restore": copies of every voter taken while the whole fleet
    was stopped give back the fleet as it was then: its jobs and their outputs, and none of the
    jobs submitted after the copies."""
    members, _ = fleet_of(str(tmp_path), names=3, voters=3)
    try:
        start_all(members)
        for m in members:
            m.new_ports = None  # the copies hold these ports' fleet: keep them
        kept = run_jobs(members, 2)
        stop_all(members)
        for m in members:
            shutil.copytree(m.data, m.data + ".backup", symlinks=True)
        start_all(members)
        later = run_jobs(members, 1)
        stop_all(members)
        for m in members:
            shutil.rmtree(m.data)
            shutil.copytree(m.data + ".backup", m.data, symlinks=True)
        start_all(members)
        leader = leader_of(members)
        for m in members:
            wait_until(lambda m=m: all(has_job_done(m, j) for j in kept), what=f"{m.name} restored")
            assert m.request("GET", f"/jobs/{later[0]}")[0] == 404
        assert results_text(leader, kept[0]).strip() == f"out-{kept[0]}"
    finally:
        for m in members:
            m.stop()


def test_fleet_of_one_restored_goes_back_to_its_backup(tmp_path, meshd_factory):
    """docs/operating.md "Backup and restore": a fleet of one is the only copy of its jobs, so a
    restore brings back what the backup held and nothing after it (a job submitted later reads
    as unknown, 404)."""
    m = meshd_factory()
    kept = m.submit("--", "sh", "-c", "echo kept")
    assert m.wait_job(kept)["state"] == "done"
    assert m.terminate() == 0
    backup = str(tmp_path / "backup")
    shutil.copytree(m.data, backup, symlinks=True)
    m.start()
    later = m.submit("--", "true")
    assert m.wait_job(later)["state"] == "done"
    assert m.terminate() == 0
    shutil.rmtree(m.data)
    shutil.copytree(backup, m.data, symlinks=True)
    m.start()
    assert has_job_done(m, kept)
    assert results_text(m, kept).strip() == "kept"
    status, _ = m.request("GET", f"/jobs/{later}")
    assert status == 404


def test_readme_first_commands_run_as_written(tmp_path, meshd):
    """The README's first commands against a member: `ID=$(meshctl job submit ...)` keeps the
    job's id (submit prints it alone), and `meshctl job wait $ID && meshctl job results $ID`
    prints the item's output."""
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    block = re.search(r"For your own member.*?```sh\n(.*?)```", readme, re.S)
    assert block is not None, "the README's block of first meshctl commands"
    lines = [line.split("#")[0].rstrip() for line in block.group(1).splitlines()[:2]]
    assert lines[0].startswith("ID=$(meshctl job submit"), lines
    shim = tmp_path / "bin"
    shim.mkdir()
    (shim / "meshctl").write_text(f'#!/bin/sh\nexec {sys.executable} -m meshjobs.cli "$@"\n')
    (shim / "meshctl").chmod(0o755)
    env = env_with_path({"MESHJOBS_AT": meshd.url,
                         "PATH": f"{shim}{os.pathsep}{os.environ.get('PATH', '')}"})
    r = subprocess.run(["sh", "-ec", "\n".join(lines) + '\necho "id=$ID"'], capture_output=True,
                       text=True, env=env, cwd=str(tmp_path), timeout=120)
    assert r.returncode == 0, r.stderr
    out = r.stdout.splitlines()
    job_id = out[-1].removeprefix("id=")
    assert out == [f"{job_id}: done", "hello", f"id={job_id}"], r.stdout
    assert meshd.record(job_id)["state"] == "done"


def test_rolling_restart_one_member_at_a_time(tmp_path):
    """docs/operating.md "Upgrading one member at a time": followers first, then the leader, each
    stopped by `meshctl member stop NAME --grace S` (meshd exits 0 once its running item ended)
    and started again once the one before is back; the fleet commits throughout and keeps every
    job."""
    members, _ = fleet_of(str(tmp_path), names=3, voters=3)
    try:
        start_all(members)
        for m in members:
            m.new_ports = None
        jobs = run_jobs(members, 1)
        leader = leader_of(members)
        for m in [*(x for x in members if x is not leader), leader]:
            others = [x for x in members if x is not m]
            _, running = submit_anywhere(members, {"argv": ["sh", "-c", "sleep 2; echo slow"],
                                                   "member": m.name})
            wait_until(lambda m=m, r=running: m.record(r, items=True)["items"][0]["state"]
                       in ("running", "done"), what=f"the item started on {m.name}")
            r = others[0].ctl("member", "stop", m.name, "--grace", "60")
            assert r.returncode == 0, r.stderr
            assert m.proc is not None and m.proc.wait(60) == 0, m.log_tail()
            assert others[0].wait_job(running)["state"] == "done"
            jobs += [running, *run_jobs(others, 1)]
            m.start()
            wait_until(lambda m=m, jobs=tuple(jobs): all(has_job_done(m, j) for j in jobs),
                       what=f"{m.name} back")
    finally:
        for m in members:
            m.stop()
