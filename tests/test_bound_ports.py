"""Each port a member listens on is bound to exactly the address its config gives: the Raft
port (pysyncobj would bind every interface), the member links port and HTTP. Checked from
outside, in /proc, on real meshd processes."""

from __future__ import annotations

import socket

import pytest

from tests.helpers import listening_addrs, make_fleet, start_all


def _http_port(m) -> int:
    return int(m.url.rsplit(":", 1)[1])


def test_fleet_of_one_binds_only_loopback(meshd):
    """A fleet of one told 127.0.0.1 listens on 127.0.0.1 only: HTTP and Raft, nothing on
    0.0.0.0 or ::."""
    assert listening_addrs(meshd.pid) == {("127.0.0.1", _http_port(meshd)),
                                           ("127.0.0.1", meshd.raft_port)}


def test_raft_binds_the_configured_host(meshd_factory):
    """Raft told 127.0.0.2 listens there alone: 127.0.0.1 on the same port refuses."""
    m = meshd_factory(start=False)
    m.raft_host = "127.0.0.2"
    m.start()
    assert ("127.0.0.2", m.raft_port) in listening_addrs(m.pid)
    assert not any(port == m.raft_port and host != "127.0.0.2"
                   for host, port in listening_addrs(m.pid))
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", m.raft_port), timeout=5).close()
    socket.create_connection(("127.0.0.2", m.raft_port), timeout=5).close()


@pytest.mark.fleet
def test_voters_bind_raft_peer_and_http_as_configured(tmp_path):
    """Three voters on 127.0.0.1: each listens on its raft, peer and HTTP addresses from the
    config, on 127.0.0.1, and on nothing else."""
    members = make_fleet(str(tmp_path), voters=3)
    try:
        start_all(members)
        for m in members:
            assert listening_addrs(m.pid) == {("127.0.0.1", m.raft_port),
                                               ("127.0.0.1", m.peer_port),
                                               ("127.0.0.1", _http_port(m))}, m.name
    finally:
        for m in members:
            m.stop()
