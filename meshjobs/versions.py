"""Versions in the member hello: which members talk to which during a rolling upgrade.

Theory of operation. Every hello and challenge on the member links (meshjobs/links.py) carries
three fields besides who sends it:

    version    the sender's meshjobs version ("0.1.0"): for people, never compared
    proto      the newest link protocol the sender speaks (an integer)
    proto_min  the oldest link protocol it still speaks

Two members talk when their ranges [proto_min, proto] overlap, in the newest protocol both speak
(`common`). A release that changes what goes over the links raises `PROTOCOL` and keeps
`PROTOCOL_MIN` at the protocol of the release before it, so that the fleet can be upgraded one
member at a time; only a later release drops the old protocol. A hello without the fields comes
from a member older than them: it speaks protocol 1 only (`LEGACY`), which this release speaks
too, so an old and a new member keep talking. docs/protocol.md ("Versions and rolling
upgrades") says the same to operators.

Rule 1: no IO: the links read and send the fields, this module only judges them.
Rule 2: a field of the wrong type or out of range is the peer's garbage: `FrameError("hello")`,
the links' one error class for it. Ranges that do not overlap are not garbage but a refusal:
`refusal` words it, and the links count it as "protocol".
"""

from __future__ import annotations

from typing import Any

from meshjobs import limits
from meshjobs.frames import FrameError

PROTOCOL = 1  # the newest member-link protocol this release speaks
PROTOCOL_MIN = 1  # the oldest it still speaks
LEGACY = (1, 1)  # (proto_min, proto) of a hello without the fields: a member older than them
UNKNOWN_VERSION = "older than 0.1.0"  # a hello without a version


def hello_fields(version: str, protocols: tuple[int, int] = (PROTOCOL_MIN, PROTOCOL)) -> dict:
    """The fields this member adds to its hello and challenge."""
    return {"version": version, "proto": protocols[1], "proto_min": protocols[0]}


def protocols(body: dict[Any, Any]) -> tuple[int, int]:
    """(proto_min, proto) of a hello; LEGACY when it has neither. Raises FrameError("hello")
    when they are mistyped, out of range, or proto_min is above proto."""
    if "proto" not in body and "proto_min" not in body:
        return LEGACY
    proto, proto_min = body.get("proto"), body.get("proto_min", body.get("proto"))
    for key, value in (("proto", proto), ("proto_min", proto_min)):
        if (not isinstance(value, int) or isinstance(value, bool)
                or not 1 <= value <= limits.link_protocol_max):
            raise FrameError("hello", f"{key} must be a protocol number "
                                      f"1..{limits.link_protocol_max}, not {value!r:.40}")
    assert isinstance(proto, int) and isinstance(proto_min, int)
    if proto_min > proto:
        raise FrameError("hello", f"proto_min {proto_min} is above proto {proto}")
    return proto_min, proto


def version_of(body: dict[Any, Any]) -> str:
    """The version a hello says, for the log: bounded, printable; UNKNOWN_VERSION if none."""
    value = body.get("version")
    if not isinstance(value, str) or not value:
        return UNKNOWN_VERSION
    shown = "".join(c if c.isprintable() else "?" for c in value[:limits.link_version_chars_max])
    return shown + ("..." if len(value) > limits.link_version_chars_max else "")


def common(ours: tuple[int, int], theirs: tuple[int, int]) -> int | None:
    """The newest protocol both ends speak, None when their ranges do not overlap."""
    low, high = max(ours[0], theirs[0]), min(ours[1], theirs[1])
    return high if low <= high else None


def _span(p: tuple[int, int]) -> str:
    return f"protocol {p[0]}" if p[0] == p[1] else f"protocols {p[0]}..{p[1]}"


def refusal(peer: str, our_version: str, ours: tuple[int, int], their_version: str,
            theirs: tuple[int, int]) -> tuple[str, str]:
    """(detail, hint) of the log line refusing a peer whose protocols do not overlap ours: both
    versions, and which member to upgrade."""
    detail = (f"this member is meshjobs {our_version} ({_span(ours)}), {peer} is meshjobs "
              f"{their_version} ({_span(theirs)}): no protocol in common")
    if theirs[1] < ours[0]:
        older, newer, needed = peer, "this member", ours[0]
    else:
        older, newer, needed = "this member", peer, theirs[0]
    hint = (f"upgrade members one at a time, each to the next release: every release speaks "
            f"the protocol of the one before it. Upgrade {older} to a release that speaks "
            f"protocol {needed}, or run {newer} at its previous release until then "
            "(docs/protocol.md, Versions and rolling upgrades)")
    return detail, hint
