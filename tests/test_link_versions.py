"""Versions in the member hello (meshjobs/versions.py, meshjobs/links.py): each member sends its
version and link protocols; members whose protocols overlap talk, others are refused on both
ends with a log line naming both versions and which member to upgrade, counted as "protocol";
a hello without the fields (a member older than them) is protocol 1 and accepted; mistyped
fields are the peer's garbage."""

from __future__ import annotations

import os
import socket
import threading
from typing import Any

import pytest

import meshjobs
from meshjobs import limits, versions
from meshjobs.frames import NONCE_BYTES, FrameError, Hello, Role, Session
from meshjobs.links import discover, wall_ms
from tests.helpers import LINKS_SECRET as SECRET
from tests.helpers import LinksMember as Member
from tests.helpers import wait_until

RECV_S_MAX = 15.0

# --- the rules, pure --------------------------------------------------------------------------


@pytest.mark.parametrize("body,want", [
    ({}, versions.LEGACY),  # a member older than the fields: protocol 1 only
    ({"version": "0.1.0"}, versions.LEGACY),
    ({"proto": 3}, (3, 3)),  # no proto_min: it speaks only its own
    ({"proto": 3, "proto_min": 2}, (2, 3)),
    ({"proto": limits.link_protocol_max, "proto_min": 1}, (1, limits.link_protocol_max)),
])
def test_protocols_of_a_hello(body, want):
    assert versions.protocols(body) == want


@pytest.mark.parametrize("body", [
    {"proto": "1"}, {"proto": True}, {"proto": 1.0}, {"proto": None}, {"proto": 0},
    {"proto": -1}, {"proto": limits.link_protocol_max + 1}, {"proto": 2**70},
    {"proto_min": 1}, {"proto": 1, "proto_min": "1"}, {"proto": 1, "proto_min": False},
    {"proto": 2, "proto_min": 3}, {"proto": [1]}, {"proto": {"a": 1}},
])
def test_mistyped_protocols_are_garbage(body):
    """Rule 2: a field of the wrong type or out of range is FrameError("hello")."""
    with pytest.raises(FrameError) as e:
        versions.protocols(body)
    assert e.value.reason == "hello"


@pytest.mark.parametrize("ours,theirs,want", [
    ((1, 1), (1, 1), 1), ((1, 2), (1, 1), 1), ((1, 1), (1, 2), 1), ((2, 3), (1, 2), 2),
    ((2, 2), (1, 1), None), ((1, 1), (2, 3), None), ((3, 4), (1, 2), None),
])
def test_common_protocol(ours, theirs, want):
    assert versions.common(ours, theirs) == want
    assert versions.common(theirs, ours) == want


@pytest.mark.parametrize("value,want", [
    (None, versions.UNKNOWN_VERSION), ("", versions.UNKNOWN_VERSION),
    (7, versions.UNKNOWN_VERSION), (b"0.1.0", versions.UNKNOWN_VERSION),
    ("0.2.0", "0.2.0"), ("1\n2\x1b[31m", "1?2?[31m"),
    ("9" * 1000, "9" * limits.link_version_chars_max + "..."),
])
def test_version_of_a_hello_is_bounded_and_printable(value, want):
    assert versions.version_of({"version": value} if value is not None else {}) == want


def test_refusal_names_both_versions_and_whom_to_upgrade():
    detail, hint = versions.refusal("m2", "0.1.0", (1, 1), "0.3.0", (2, 3))
    assert "this member is meshjobs 0.1.0 (protocol 1)" in detail
    assert "m2 is meshjobs 0.3.0 (protocols 2..3)" in detail
    assert hint.startswith("upgrade members one at a time")
    assert "Upgrade this member to a release that speaks protocol 2" in hint
    _, hint = versions.refusal("m2", "0.3.0", (2, 3), "0.1.0", (1, 1))
    assert "Upgrade m2 to a release that speaks protocol 2" in hint


# --- real links on loopback -------------------------------------------------------------------


class LogRecorder:
    """What Links logs (event name and fields), as a structlog logger would get it."""

    def __init__(self) -> None:
        self.records: list[tuple[str, dict[str, Any]]] = []
        self._mu = threading.Lock()

    def __getattr__(self, level: str):
        def record(event: str, **kw: Any) -> None:
            with self._mu:
                self.records.append((event, kw))
        return record

    def find(self, event: str, **match: Any) -> list[dict[str, Any]]:
        with self._mu:
            return [kw for e, kw in self.records
                    if e == event and all(kw.get(k) == v for k, v in match.items())]


def _dropped(m: Member, reason: str) -> int:
    return m.links.stats()["dropped"].get(reason, 0)


def test_members_of_this_release_link_and_know_each_others_version(members):
    a, b = members("a"), members("b")
    a.links.connect("b", b.address)
    wait_until(lambda: a.up("b") and b.up("a"), what="a <-> b up")
    assert a.links.peers()["b"]["version"] == meshjobs.version()
    hellos = [h for peer, up, h in a.events if peer == "b" and up]
    assert hellos[0]["proto"] == versions.PROTOCOL
    assert hellos[0]["proto_min"] == versions.PROTOCOL_MIN


def test_the_next_release_links_with_this_one(members):
    """A rolling upgrade: a release speaking protocols 1..2 and this one (1) talk in 1."""
    a = members("a")
    b = members("b", version="0.2.0", protocols=(versions.PROTOCOL, versions.PROTOCOL + 1))
    a.links.connect("b", b.address)
    b.links.connect("a", a.address)
    wait_until(lambda: a.up("b") and b.up("a"), what="a <-> b up")
    assert a.links.peers()["b"]["version"] == "0.2.0"
    assert _dropped(a, "protocol") == 0 and _dropped(b, "protocol") == 0


@pytest.mark.parametrize("dialler_is_new", [True, False])
def test_an_incompatible_peer_is_refused_on_both_ends(members, dialler_is_new):
    """Rule: no protocol in common: both ends log both versions and whom to upgrade, count it
    as "protocol", and never bring the link up."""
    old_log, new_log = LogRecorder(), LogRecorder()
    old = members("old", log=old_log)
    new = members("new", log=new_log, version="9.0.0",
                  protocols=(versions.PROTOCOL + 1, versions.PROTOCOL + 1))
    dialler, acceptor = (new, old) if dialler_is_new else (old, new)
    dialler.links.connect(acceptor.name, acceptor.address)
    wait_until(lambda: _dropped(old, "protocol") >= 1 and _dropped(new, "protocol") >= 1,
               what="both ends refused")
    mine = old_log.find("link_refused", reason="protocol", peer="new")[0]
    assert f"this member is meshjobs {meshjobs.version()}" in mine["detail"]
    assert "new is meshjobs 9.0.0" in mine["detail"]
    assert f"Upgrade this member to a release that speaks protocol {versions.PROTOCOL + 1}" \
        in mine["hint"]
    theirs = new_log.find("link_refused", reason="protocol", peer="old")[0]
    assert f"old is meshjobs {meshjobs.version()}" in theirs["detail"]
    assert "Upgrade old to a release" in theirs["hint"]
    assert not old.up("new") and not new.up("old")
    assert not old.events and not new.events  # never up, so never said up


def _raw_handshake(addr: tuple[str, int], body: dict[str, Any]) -> tuple[Session, Any]:
    """Dial `addr` with a raw session saying hello with `body`; the answer (a Hello or None
    when the member closed the connection)."""
    session = Session(SECRET, Role.DIALLER)
    sock = socket.create_connection(addr, timeout=RECV_S_MAX)
    sock.sendall(session.hello(body, os.urandom(NONCE_BYTES), os.urandom(32)))
    while (ev := session.next_event()) is None:
        data = sock.recv(session.room())
        if not data:
            sock.close()
            return session, None
        session.receive_data(data)
    if isinstance(ev, Hello):
        sock.sendall(session.proof())
    sock.close()
    return session, ev


def _hello_body(to: str, **extra: Any) -> dict[str, Any]:
    return {"name": "raw", "boot": "raw", "peer": "127.0.0.1:1", "to": to,
            "wall_ms": wall_ms(), **extra}


def test_a_hello_without_the_fields_is_an_older_member_and_accepted(members):
    """Decided: a member older than the fields speaks protocol 1, which this release speaks."""
    a = members("a")
    _, ev = _raw_handshake(a.address, _hello_body("a"))
    assert isinstance(ev, Hello)
    assert ev.body["version"] == meshjobs.version()  # the challenge says ours
    wait_until(lambda: any(p == "raw" and up for p, up, _ in a.events), what="raw up")
    assert a.links.peers()["raw"]["version"] == versions.UNKNOWN_VERSION
    assert a.links.stats()["dropped"] == {}


@pytest.mark.parametrize("extra", [
    {"proto": "1"}, {"proto": True}, {"proto": 0}, {"proto": 2**40},
    {"proto": 1, "proto_min": 2}, {"proto_min": 1}, {"proto": None},
])
def test_a_mistyped_protocol_is_counted_and_dropped(members, extra):
    """Remote garbage: counted as "hello", the connection closed, nothing up, no crash."""
    a = members("a")
    _, ev = _raw_handshake(a.address, _hello_body("a", version="x", **extra))
    assert ev is None
    wait_until(lambda: _dropped(a, "hello") == 1, what="counted")
    assert not a.events
    a2 = members("a2")  # and the links still work
    a.links.connect("a2", a2.address)
    wait_until(lambda: a.up("a2"), what="a -> a2 up")


def test_a_hostile_version_string_is_cut_in_the_log(members):
    a = members("a")
    _, ev = _raw_handshake(a.address, _hello_body("a", version="v" * 3000, proto=1))
    assert isinstance(ev, Hello)
    wait_until(lambda: any(p == "raw" and up for p, up, _ in a.events), what="raw up")
    shown = a.links.peers()["raw"]["version"]
    assert len(shown) == limits.link_version_chars_max + 3


def test_a_joining_worker_learns_an_incompatible_fleet_and_says_so(members):
    """discover() (a worker with `join`) refuses a member that speaks no protocol of its own."""
    log = LogRecorder()
    a = members("a", discovery=lambda: {"a": "127.0.0.1:1"}, log=log, version="9.0.0",
                protocols=(versions.PROTOCOL + 1, versions.PROTOCOL + 1))
    with pytest.raises(FrameError) as e:
        discover(a.address, "w1", "boot", SECRET)
    assert e.value.reason == "protocol"
    assert "is meshjobs 9.0.0" in e.value.detail and "upgrade members one at a time" in str(e.value)
    wait_until(lambda: _dropped(a, "protocol") == 1, what="the member counted it too")
