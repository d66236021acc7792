"""Versions in the Raft port's hello (raftlink.py, meshjobs/versions.py), against one real
pysyncobj-backed Replica in this process and a raw socket speaking the handshake: the hello
and the challenge carry the version and protocols; a voter with no protocol in common is
refused on both ends (counted as `protocol`); a hello without the fields (an older voter) is
answered; mistyped fields are counted and dropped."""

from __future__ import annotations

import os
import socket
import time
from typing import Any

import pytest

import meshjobs
from meshjobs import versions
from meshjobs.failpoints import Failpoints
from meshjobs.frames import KX_BYTES, NONCE_BYTES, Hello, Role, Session
from meshjobs.replica import Replica
from meshjobs.table import JobTable
from tests.helpers import free_port

WAIT_S = 30.0
SECRET = bytes(range(32))
FUTURE = {"version": "9.0.0", "proto": versions.PROTOCOL + 1, "proto_min": versions.PROTOCOL + 1}


def _transport(r: Replica):
    return r._SyncObj__transport


def _tick_until(r: Replica, pred, what: str):
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        r.tick(0.01)
        got = pred()
        if got:
            return got
    raise AssertionError(f"{what} not reached within {WAIT_S} s")


class _Raw:
    """A raw socket with a handshake session; read() is polled between the replica's ticks."""

    def __init__(self, sock: socket.socket, role: Role) -> None:
        self.sock = sock
        self.sock.setblocking(False)
        self.session = Session(SECRET, role)
        self.eof = False

    def event(self) -> Any:
        ev = self.session.next_event()
        if ev is not None or self.eof:
            return ev
        try:
            data = self.sock.recv(self.session.room())
        except BlockingIOError:
            return None
        if not data:
            self.eof = True
            return None
        self.session.receive_data(data)
        return self.session.next_event()


@pytest.fixture
def voter(tmp_path):
    """One voter of three (the others are raw sockets of the tests, or nobody). Its partner
    `low` sorts lower than it, so it dials `low` (the greater address dials); `high` sorts
    higher, so `high` dials it."""
    ports = sorted(free_port() for _ in range(3))
    low, me, high = (f"127.0.0.1:{p}" for p in ports)
    listener = socket.create_server(("127.0.0.1", ports[0]))
    r = Replica(me, [low, high], str(tmp_path), SECRET, JobTable(), Failpoints())
    try:
        yield r, me, low, high, listener
    finally:
        r.close()
        listener.close()


def _dial(me: str, high: str, **fields: Any) -> _Raw:
    host, port = me.rsplit(":", 1)
    raw = _Raw(socket.create_connection((host, int(port)), timeout=WAIT_S), Role.DIALLER)
    raw.sock.setblocking(True)
    raw.sock.sendall(raw.session.hello({"raft": high, "to": me, "wall_ms": 0, **fields},
                                       os.urandom(NONCE_BYTES), os.urandom(KX_BYTES)))
    raw.sock.setblocking(False)
    return raw


def test_an_older_voters_hello_is_answered_with_our_versions(voter):
    r, me, _low, high, _ = voter
    raw = _dial(me, high)  # no version fields: protocol 1
    ev = _tick_until(r, raw.event, "the challenge")
    assert isinstance(ev, Hello)
    assert ev.body["version"] == meshjobs.version()
    assert (ev.body["proto_min"], ev.body["proto"]) == (versions.PROTOCOL_MIN, versions.PROTOCOL)
    assert "protocol" not in _transport(r).dropped


def test_an_incompatible_dialler_gets_our_challenge_then_is_refused(voter):
    r, me, _low, high, _ = voter
    raw = _dial(me, high, **FUTURE)
    ev = _tick_until(r, raw.event, "the challenge")
    assert isinstance(ev, Hello) and ev.body["version"] == meshjobs.version()
    _tick_until(r, lambda: raw.event() is None and raw.eof, "the connection closed")
    assert _transport(r).dropped["protocol"] == 1


@pytest.mark.parametrize("fields", [{"proto": "1"}, {"proto": 0}, {"proto": 1, "proto_min": 2}])
def test_mistyped_protocols_are_counted_and_dropped(voter, fields):
    r, me, _low, high, _ = voter
    raw = _dial(me, high, **fields)
    _tick_until(r, lambda: raw.event() is None and raw.eof, "the connection closed")
    assert _transport(r).dropped == {"stranger": 1}


def test_the_voter_refuses_an_incompatible_acceptor(voter):
    """It dials `low`; `low` answers with a challenge of a release with no protocol in common:
    it sends no proof, counts `protocol` and closes."""
    r, _me, low, _high, listener = voter
    listener.setblocking(False)

    def accepted():
        try:
            return listener.accept()[0]
        except BlockingIOError:
            return None

    raw = _Raw(_tick_until(r, accepted, "the voter's dial"), Role.ACCEPTOR)
    hello = _tick_until(r, raw.event, "its hello")
    assert isinstance(hello, Hello) and hello.body["version"] == meshjobs.version()
    assert hello.body["proto"] == versions.PROTOCOL
    raw.sock.setblocking(True)
    raw.sock.sendall(raw.session.challenge({"raft": low, "wall_ms": 0, **FUTURE},
                                           os.urandom(NONCE_BYTES), os.urandom(KX_BYTES)))
    raw.sock.setblocking(False)
    _tick_until(r, lambda: _transport(r).dropped.get("protocol") == 1, "refused")
    _tick_until(r, lambda: raw.event() is None and raw.eof, "the connection closed")
