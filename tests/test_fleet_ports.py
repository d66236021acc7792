"""Hostile bytes on every member port of a real fleet: garbage, truncated, oversized, replayed
and wrongly-signed frames on the member-links port and on the Raft port. Each is dropped and
counted; the members stay healthy and the fleet keeps committing."""

from __future__ import annotations

import os
import socket
import struct
import time

import pytest

from meshjobs.frames import HEADER, MAGIC, FrameType, Hello, Role, Session
from tests.helpers import (
    fleet_running,
    leader_of,
    make_fleet,
    metrics,
    send_and_read,
    submit,
    wait_until,
)

pytestmark = pytest.mark.fleet


def _hello(secret: bytes, body: dict) -> tuple[Session, bytes]:
    session = Session(secret, Role.DIALLER)
    return session, session.hello({**body, "wall_ms": int(time.time() * 1000)}, os.urandom(32),
                                  os.urandom(32))


def _handshake(port: int, secret: bytes, body: dict) -> list[bytes]:
    """A whole handshake as a member of the fleet would make it; the bytes it sent."""
    session, hello = _hello(secret, body)
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(hello)
        while not isinstance(session.next_event(), Hello):
            session.receive_data(s.recv(4096))
        proof = session.proof()
        s.sendall(proof)
        return [hello, proof]


@pytest.fixture
def three(tmp_path):
    yield from fleet_running(make_fleet(str(tmp_path), voters=3))


def test_hostile_bytes_on_member_ports(three):
    """Garbage, truncated, oversized, replayed and wrongly-signed input on the links port and
    the Raft port of every voter: dropped, counted by reason, nobody falls over."""
    leader_of(three)
    for m in three:
        secret = m.secret
        peer, raft = m.peer_port, m.raft_port
        # --- the member-links port ---
        send_and_read(peer, os.urandom(4096))  # garbage
        body = {"name": "intruder", "boot": "b", "peer": "127.0.0.1:1", "to": m.name}
        _, good = _hello(secret, body)
        send_and_read(peer, good[: len(good) // 2], wait_s=0.5)  # truncated, then closed
        send_and_read(peer, struct.pack(">4sBBI", MAGIC, int(FrameType.F_HELLO), 0,
                                1 << 30))  # a length over the limit, before any body
        send_and_read(peer, _hello(os.urandom(32), {**body, "name": "x"})[1])  # wrong key
        # A whole handshake (a member of the fleet could make it), then the same bytes again:
        # a replay, which gets a challenge it cannot answer.
        recorded = _handshake(peer, secret, body)
        send_and_read(peer, b"".join(recorded), wait_s=1.0)
        # --- the Raft port (sealed frames, raftlink.py) ---
        send_and_read(raft, os.urandom(4096))
        send_and_read(raft, struct.pack("i", 64) + os.urandom(64))  # pysyncobj's own framing: garbage now
        for length in (1 << 30, 4097):  # lengths over the limit, before any body
            send_and_read(raft, struct.pack(">4sBBI", MAGIC, int(FrameType.F_HELLO), 0, length))
        raft_body = {"raft": f"127.0.0.1:{raft + 1}", "to": f"127.0.0.1:{raft}"}
        send_and_read(raft, _hello(os.urandom(32), raft_body)[1])  # wrong key
    counted = {'meshjobs_links_dropped_total{reason="magic"}': 1,
               'meshjobs_links_dropped_total{reason="length"}': 1,
               'meshjobs_links_dropped_total{reason="mac"}': 1,
               'meshjobs_links_dropped_total{reason="proof"}': 1,
               'meshjobs_raft_dropped_total{reason="oversized"}': 2,
               'meshjobs_raft_dropped_total{reason="garbage"}': 2,
               'meshjobs_raft_dropped_total{reason="mac"}': 1}
    for m in three:
        def short(m=m) -> dict[str, float]:
            mt = metrics(m)
            return {k: mt.get(k, 0) for k, n in counted.items() if mt.get(k, 0) < n}
        wait_until(lambda m=m: not short(m), what=f"{m.name} counts every drop")
        status, h = m.request("GET", "/healthz")
        assert status == 200 and h["ok"]
    leader = leader_of(three)
    rec = submit(leader, {"argv": ["sh", "-c", "echo still-fine"], "id": "after"})
    for m in three:
        assert m.wait_job(rec["id"])["state"] == "done"
    assert HEADER.size == 10
