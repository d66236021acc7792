"""The compose fleet (deploy/compose.yaml) run here as real meshd processes: the member configs
the compose file mounts, with every service name (v1, ..., w2) mapped to `localhost` and a port
of its own, so that members still address each other by host name, as in containers. Three
voters elect a leader, two workers join, and a job runs."""

from __future__ import annotations

import hashlib
import os
import re

import pytest
import yaml

from tests.helpers import (
    ROOT,
    Meshd,
    free_port,
    leader_of,
    start_all,
    submit_anywhere,
    wait_until,
)

DEPLOY = os.path.join(ROOT, "deploy")
TOKEN = "compose-fleet-test-token"
PLACEHOLDER = "0" * 64
ADDR = re.compile(r'"(v1|v2|v3|w1|w2):(7700|7701|7702)"')


def compose_members(top: str) -> list[Meshd]:
    """One Meshd per compose service, with that service's config (as mounted) rewritten for
    this machine: service names -> localhost:PORT, the compose secret -> a file of the data
    folder, the placeholder token hash -> TOKEN's. Nothing is started."""
    with open(os.path.join(DEPLOY, "compose.yaml")) as f:
        doc = yaml.safe_load(f)
    services = list(doc["services"])
    secret = os.urandom(32)
    members, sources = [], {}
    for name, svc in doc["services"].items():
        (mount,) = svc["configs"]
        sources[name] = os.path.join(DEPLOY, doc["configs"][mount["source"]]["file"])
        data = os.path.join(top, name)
        os.makedirs(data)
        fd = os.open(os.path.join(data, "fleet.secret"), os.O_WRONLY | os.O_CREAT, 0o600)
        os.write(fd, secret)
        os.close(fd)
        m = Meshd(data, name=name, config=os.path.join(top, f"{name}.toml"), token=TOKEN)
        m.fleet = True
        m.secret = secret
        members.append(m)

    def new_ports() -> None:
        ports = {(n, p): free_port() for n in services for p in (7700, 7701, 7702)}
        for m in members:
            with open(sources[m.name]) as f:
                text = f.read()
            assert PLACEHOLDER in text and '"0.0.0.0:7700"' in text
            text = ADDR.sub(lambda a: f'"localhost:{ports[(a[1], int(a[2]))]}"', text)
            text = text.replace('"0.0.0.0:7700"', f'"localhost:{ports[(m.name, 7700)]}"')
            text = text.replace('"/run/secrets/fleet_secret"', '"fleet.secret"')
            text = text.replace(PLACEHOLDER, hashlib.sha256(TOKEN.encode()).hexdigest())
            m.raft_port, m.peer_port = ports[(m.name, 7702)], ports[(m.name, 7701)]
            assert m.config is not None
            with open(m.config, "w") as f:
                f.write(text)

    new_ports()
    for m in members:
        m.new_ports = new_ports
    return members


@pytest.fixture
def compose_fleet(tmp_path):
    members = compose_members(str(tmp_path))
    try:
        yield members
    finally:
        for m in members:
            m.stop()


@pytest.mark.fleet
def test_compose_fleet_elects_a_leader_and_runs_a_job(compose_fleet):
    """The compose configs, addressed by host name: a voter leads, both workers join, and a
    job of several items runs to the end."""
    members = compose_fleet
    for m in members:
        with open(m.config) as f:
            text = f.read()
        assert '"127.0.0.1:' not in text and '"localhost:' in text  # host names only
    start_all(members)
    leader = leader_of(members)
    assert leader.name in ("v1", "v2", "v3")

    def alive() -> set[str]:
        rows = leader.request("GET", "/fleet")[1]["members"]
        return {x["name"] for x in rows if x["alive"]}

    wait_until(lambda: alive() == {"v1", "v2", "v3", "w1", "w2"}, what="all five members alive")
    via, job = submit_anywhere(members, {"argv": ["sh", "-c", "echo item-$MESH_ITEM_INDEX"],
                                         "items": [""] * 6})
    done = via.wait_job(job, timeout_s=120)
    assert done["state"] == "done" and done["items_done"] == 6, done
    assert {i["member"] for i in done["items"]} <= {m.name for m in members}
    # A worker answers for the fleet too (its reads follow the leader).
    worker = members[-1]
    wait_until(lambda: worker.request("GET", f"/jobs/{job}")[1].get("state") == "done",
               what="the worker sees the job done")


def test_raft_looks_a_voter_name_up_again(tmp_path):
    """Voters named by host name: one whose name pointed elsewhere when first looked up (a pod
    rescheduled to a new address, a container recreated) is found at its new address within
    `raft_dns_cache_s`, not pysyncobj's ten minutes. Three Replicas in this process on
    `localhost:PORT`, with `localhost` first known at an address where nothing listens."""
    import time

    from pysyncobj.dns_resolver import globalDnsResolver

    from meshjobs import limits
    from meshjobs.failpoints import Failpoints
    from meshjobs.replica import Replica
    from meshjobs.table import JobTable

    resolver = globalDnsResolver()
    cache = resolver._DnsCachingResolver__cache  # what an earlier lookup left
    saved = cache.get("localhost")
    cache["localhost"] = (time.monotonic(), ["127.0.0.9"])
    secret = os.urandom(32)
    addrs = [f"localhost:{free_port()}" for _ in range(3)]
    made: list[Replica] = []
    try:
        for i, addr in enumerate(addrs):
            data = tmp_path / f"v{i}"
            data.mkdir()
            made.append(Replica(addr, [a for a in addrs if a != addr], str(data), secret,
                                JobTable(), Failpoints()))
        deadline = time.monotonic() + limits.raft_dns_cache_s + 30
        while not any(r._isLeader() for r in made):
            assert time.monotonic() < deadline, "no leader: the stale address was kept"
            for r in made:
                r.tick(0.002)
        assert cache["localhost"][1] == ["127.0.0.1"]
    finally:
        for r in made:
            r.close()
        if saved is None:
            cache.pop("localhost", None)
        else:
            cache["localhost"] = saved


def test_raft_listens_where_it_is_dialled():
    """A name that is both ::1 and 127.0.0.1 is listened on at 127.0.0.1, where pysyncobj's
    resolver (IPv4 first) dials it."""
    import socket

    from meshjobs.raftlink import bind_choice

    v6 = (socket.AF_INET6, socket.SOCK_STREAM, 6, "", ("::1", 7702, 0, 0))
    v4 = (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.1", 7702))
    assert bind_choice([v6, v4]) == v4
    assert bind_choice([v4, v6]) == v4
    assert bind_choice([v6]) == v6
