"""The Raft port of real voters (raftlink.py): sealed msgpack frames behind the member links'
handshake. Hostile input (garbage, an oversized length, a wrong secret, a replayed handshake, a
replayed sealed frame, pickles) is counted by reason and dropped, nothing is unpickled, and the
fleet goes on committing and fails over."""

from __future__ import annotations

import os
import pickle
import socket
import struct
import time
import zlib

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


@pytest.fixture
def three(tmp_path):
    yield from fleet_running(make_fleet(str(tmp_path), voters=3))


class _Marker:
    """Unpickling this creates a file: proof that someone unpickled it."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def _open_session(port: int, secret: bytes, claim: str, to: str,
                  then=lambda session: b"") -> tuple[socket.socket, list[bytes]]:
    """A whole handshake as a voter of the fleet makes it, and `then(session)`'s frames sent
    with the proof (in one write: the voter claimed may dial again and replace this connection
    soon after); the socket and the handshake bytes sent."""
    session = Session(secret, Role.DIALLER)
    hello = session.hello({"raft": claim, "to": to, "wall_ms": int(time.time() * 1000)},
                          os.urandom(32), os.urandom(32))
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    s.sendall(hello)
    while not isinstance(session.next_event(), Hello):
        session.receive_data(s.recv(4096))
    proof = session.proof()
    s.sendall(proof + then(session))
    return s, [hello, proof]


def _raft_addr(m) -> str:
    return f"127.0.0.1:{m.raft_port}"


def _closed(s: socket.socket, wait_s: float = 10.0) -> bool:
    s.settimeout(wait_s)
    deadline = time.monotonic() + wait_s
    try:
        while time.monotonic() < deadline:
            if not s.recv(65536):
                return True
    except OSError:
        return True
    return False


def test_hostile_input_on_the_raft_port(three, tmp_path):
    """Garbage, an oversized length, a wrong secret, a replayed handshake, a replayed sealed
    frame, a pickle in pysyncobj's old framing and a pickle inside a sealed message: each is
    counted by reason and its connection closed; nothing is unpickled; the fleet commits."""
    leader_of(three)
    marker = str(tmp_path / "unpickled")
    evil = pickle.dumps({"type": "append_entries", "x": _Marker(marker)})
    for m in three:
        port, secret = m.raft_port, m.secret
        other = next(o for o in three if o is not m)
        send_and_read(port, os.urandom(4096))  # garbage
        send_and_read(port, HEADER.pack(MAGIC, int(FrameType.F_HELLO), 0, 1 << 30))  # oversized
        # pysyncobj's old framing: a length, then a compressed pickle (no password).
        send_and_read(port, struct.pack("i", len(zlib.compress(evil))) + zlib.compress(evil))
        send_and_read(port, struct.pack("i", len(evil)) + evil)
        wrong = Session(os.urandom(32), Role.DIALLER)
        send_and_read(port, wrong.hello({"raft": _raft_addr(other), "to": _raft_addr(m), "wall_ms": 0},
                                os.urandom(32), os.urandom(32)))  # wrong secret
        stranger = Session(secret, Role.DIALLER)
        send_and_read(port, stranger.hello({"raft": "127.0.0.1:1", "to": _raft_addr(m), "wall_ms": 0},
                                   os.urandom(32), os.urandom(32)))  # not a voter
        # A voter's handshake (anyone holding the secret can make one), then one sealed
        # message twice: a replay within the connection.
        def twice(session):
            harmless = session.seal(FrameType.F_RAFT, {"type": "stale_term", "term": 0})
            return harmless + harmless

        s, recorded = _open_session(port, secret, _raft_addr(other), _raft_addr(m), twice)
        assert _closed(s), m.name
        s.close()
        send_and_read(port, b"".join(recorded), wait_s=2.0)  # the handshake replayed on a new connection
        # A pickle inside a good sealed frame: as an entry the old way, and as the whole body;
        # and a frame type of the member links on the Raft port.
        for then in (
            lambda session: session.seal(FrameType.F_RAFT, {
                "type": "append_entries", "term": 0, "commit_index": 0, "prevLogIdx": 0,
                "prevLogTerm": 0, "entries": [[evil, 1, 0]]}),
            lambda session: session.seal_packed(FrameType.F_RAFT, evil),
            lambda session: session.seal(FrameType.F_CTL, {"op": "submit"}),
        ):
            s, _ = _open_session(port, secret, _raft_addr(other), _raft_addr(m), then)
            assert _closed(s), m.name
            s.close()
    for m in three:
        want = {"garbage": 6, "oversized": 1, "mac": 1, "stranger": 1, "aead": 1, "proof": 1}

        seen: list[dict] = [{}]

        def counted(m=m, want=want, seen=seen):
            mt = metrics(m)
            seen[0] = {k[len("meshjobs_raft_dropped_total"):]: v for k, v in mt.items()
                       if k.startswith("meshjobs_raft_dropped_total")}
            got = {k: mt.get(f'meshjobs_raft_dropped_total{{reason="{k}"}}', 0) for k in want}
            return all(got[k] >= n for k, n in want.items())

        try:
            wait_until(counted, what=f"the refusals counted at {m.name}")
        except AssertionError as e:
            raise AssertionError(f"{e}; counted: {seen[0]}") from None
        status, h = m.request("GET", "/healthz")
        assert status == 200 and h["ok"], m.name
    assert not os.path.exists(marker), "something unpickled input from the Raft port"
    leader = leader_of(three)
    rec = submit(leader, {"argv": ["sh", "-c", "echo still-fine"], "id": "after"})
    for m in three:
        assert m.wait_job(rec["id"])["state"] == "done"


def test_the_raft_port_speaks_sealed_frames_and_fails_over(three):
    """The Raft port answers a voter's hello with a challenge of the member links' codec (not
    pysyncobj's framing); the fleet commits over it, and after the leader is killed the other
    two elect a leader and commit again."""
    leader = leader_of(three)
    other = next(m for m in three if m is not leader)
    s, _ = _open_session(leader.raft_port, leader.secret, _raft_addr(other),
                                  _raft_addr(leader))
    s.close()
    rec = submit(leader, {"argv": ["sh", "-c", "echo one"], "id": "before"})
    for m in three:
        assert m.wait_job(rec["id"])["state"] == "done"
    leader.kill9()
    rest = [m for m in three if m is not leader]
    new = leader_of(rest)
    assert new is not leader
    rec = submit(new, {"argv": ["sh", "-c", "echo two"], "id": "after"})
    for m in rest:
        assert m.wait_job(rec["id"])["state"] == "done"
