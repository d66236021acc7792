"""Where a job's finish notice (`--notify URL`) may go: the operator's policy, without IO.

Theory of operation. A notice is a POST from the leader: a submitter who may name any URL could
make the leader reach what only it can reach (its loopback, the cloud's metadata address, the
private network). So a destination is refused, by default, when an address it resolves to is
loopback, link-local, private (RFC 1918), unique-local (fc00::/7), unspecified, multicast,
reserved or otherwise not a public address; the operator allows more with `[notify] allow`
(CIDRs and host names). This module holds the checks; the edge (meshjobs/notify.py) resolves
the name, asks here about every address, and connects to an address it was told is fine.

Rule 1: an address is judged by what it is, not how it is spelled. IPv4 in the forms
        inet_aton and so the system's resolver accept (`2130706433`, `0x7f000001`, `127.1`,
        `0177.0.0.1`), a trailing dot, brackets and zones, and IPv6 forms that carry an IPv4
        address (IPv4-mapped, IPv4-compatible, 6to4, NAT64) are all seen through.
Rule 2: a host literal is refused at submit (`refusal_at_submit`, a 400 that says how to allow
        it); a host name is judged at each send from every address it resolves to
        (`address_refusal`), so that a name re-pointed after the submit (DNS rebinding) does
        not pass.
Rule 3: a host name in `[notify] allow` is allowed whatever it resolves to (the operator
        trusts that name); a CIDR allows the addresses in it.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable
from urllib.parse import urlsplit

from meshjobs import limits

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")
_LABEL = r"(?!-)[a-z0-9_-]{1,63}(?<!-)"
NAME_RE = re.compile(rf"^{_LABEL}(\.{_LABEL})*$")
ALLOW_HINT = ('a list of CIDRs and host names, e.g. ["10.1.2.0/24", "hooks.internal"]')


def host_of(url: str) -> str:
    """The host of a notify URL as it will be looked up: lowercased, without brackets, zone
    or trailing dot."""
    host = (urlsplit(url).hostname or "").lower()
    return host.split("%", 1)[0].rstrip(".")


def _aton_part(part: str) -> int | None:
    try:
        if part[:2] in ("0x", "0X"):
            return int(part[2:], 16) if part[2:] else 0
        if len(part) > 1 and part[0] == "0":
            return int(part, 8)
        return int(part, 10) if part.isdigit() else None
    except ValueError:
        return None


def _inet_aton(host: str) -> ipaddress.IPv4Address | None:
    """IPv4 as inet_aton(3) reads it: 1 to 4 parts, each decimal, 0x hex or 0 octal, the last
    filling the bytes left (`127.1` is 127.0.0.1, `2130706433` too)."""
    parts = host.split(".")
    if not 1 <= len(parts) <= 4 or not all(parts):
        return None
    nums = [_aton_part(p) for p in parts]
    if any(n is None for n in nums):
        return None
    *head, last = nums
    if any(n > 255 for n in head) or last >= 256 ** (4 - len(head)):  # type: ignore[operator]
        return None
    value = 0
    for n in head:
        value = value << 8 | n  # type: ignore[operator]
    value = value << 8 * (4 - len(head)) | last  # type: ignore[operator]
    return ipaddress.IPv4Address(value)


def literal(host: str) -> IPAddress | None:
    """The address a host literal stands for (Rule 1); None for a host name."""
    host = host.strip("[]").split("%", 1)[0].rstrip(".").lower()
    if not host:
        return None
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        pass
    return _inet_aton(host)


def embedded_v4(ip: IPAddress) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 address carries (mapped, compatible, 6to4, NAT64), if any."""
    if not isinstance(ip, ipaddress.IPv6Address):
        return None
    if ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    if ip.sixtofour is not None:
        return ip.sixtofour
    if ip in _NAT64:
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    if int(ip) >> 32 == 0 and int(ip) > 1:  # IPv4-compatible (::a.b.c.d); :: and ::1 are not
        return ipaddress.IPv4Address(int(ip))
    return None


def kind(ip: IPAddress) -> str | None:
    """What makes an address one that notices do not go to by default (None: public)."""
    inner = embedded_v4(ip)
    if inner is not None:
        why = kind(inner)
        return None if why is None else f"{why} (it carries {inner})"
    if ip.is_unspecified:
        return "unspecified"
    if ip.is_loopback:
        return "loopback"
    if ip.is_link_local:
        return "link-local"
    if ip.is_multicast:
        return "multicast"
    if isinstance(ip, ipaddress.IPv6Address) and ip in ipaddress.IPv6Network("fc00::/7"):
        return "unique-local"
    if ip.is_reserved:
        return "reserved"
    if ip.is_private:
        return "private"
    if not ip.is_global:
        return "not public"
    return None


class NotifyPolicy:
    """`[notify] allow`: the networks and host names notices may go to besides public
    addresses. Build it with `parse` (which raises ValueError naming a bad entry)."""

    def __init__(self, networks: Iterable[IPNetwork] = (), names: Iterable[str] = ()) -> None:
        self.networks = tuple(networks)
        self.names = frozenset(names)

    @classmethod
    def parse(cls, allow: Iterable[str]) -> NotifyPolicy:
        networks: list[IPNetwork] = []
        names: list[str] = []
        for entry in allow:
            networks_or_name = parse_allow_entry(entry)
            if isinstance(networks_or_name, str):
                names.append(networks_or_name)
            else:
                networks.append(networks_or_name)
        return cls(networks, names)

    def _in_networks(self, ip: IPAddress) -> bool:
        inner = embedded_v4(ip)
        return any(ip in n or (inner is not None and inner in n) for n in self.networks)

    def address_refusal(self, host: str, ip: IPAddress) -> str | None:
        """Why a notice to `host` may not go to `ip`, one of its addresses (None: it may)."""
        if host in self.names or self._in_networks(ip):
            return None
        why = kind(ip)
        if why is None:
            return None
        return f"{ip} is {why}" + ("" if str(ip) == host else f" (written {host})")

    def refusal_at_submit(self, url: str) -> str | None:
        """Why `url` is refused now (its host is a literal refused by Rule 2), in words that
        say how to allow it; None when it may be submitted (a host name is checked at send)."""
        host = host_of(url)
        ip = literal(host)
        if ip is None:
            return None
        why = self.address_refusal(host, ip)
        if why is None:
            return None
        inner = embedded_v4(ip) or ip
        net = f"{inner}/{inner.max_prefixlen}"
        return (f"notify {url[:100]!r} is refused: {why}, and finish notices go only to public "
                f"addresses by default. If the member may post there, its operator allows it in the "
                f'config: [notify] allow = ["{net}"] (CIDRs and host names; '
                "docs/configuration.md)")


def parse_allow_entry(entry: object) -> IPNetwork | str:
    """One entry of `[notify] allow`: a CIDR (or one address) or a host name."""
    if not isinstance(entry, str) or not 0 < len(entry) <= limits.notify_allow_chars_max:
        raise ValueError(f"{str(entry)[:80]!r} is not a CIDR or a host name")
    text = entry.strip().lower().rstrip(".")
    try:
        return ipaddress.ip_network(text.strip("[]"), strict=False)
    except ValueError:
        pass
    if literal(text) is not None:
        raise ValueError(f"{entry[:80]!r}: write the address as a CIDR, e.g. "
                         f'"{literal(text)}/32"')
    if not NAME_RE.fullmatch(text):
        raise ValueError(f"{entry[:80]!r} is not a CIDR (10.1.2.0/24) or a host name "
                         "(hooks.internal)")
    return text
