"""A part of the job node: what the leader knows of the fleet's members (soft state).

Theory of operation. Every member reports to the leader every `have_ms` (F_JOB_HAVE): its
incarnation (boot id), role, table position, pools and slots, blob pressure, full disk, blob
bytes, running items and wall clock. The leader keeps the latest report of each (`Member`),
and how far the member's wall clock is off its own (only shown: nothing depends on the members'
clocks agreeing, see table.py Rule 7); a member is
alive while its last report is at most `dead_ms` old, and, in a new reign, one not heard from
yet gets `dead_ms` from the reign's start to report. A member not heard from for `lost_ms` is
lost: the copies of outputs it held are taken as gone (copies.py). What the leader knew in an
earlier reign is dropped when it comes to lead again; only who reported, and when, is kept
(`heard`, also while this member does not lead), so that a new leader knows whom to wait for
before it answers about the members (heard.py).

Rule: pure, like the rest of the node; it owns the reports and the reign's start, and is given
the node's config and counter and, per call, the time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from meshjobs import limits
from meshjobs.node.events import NodeConfig
from meshjobs.node.heard import Hearing

WALLS = ("uid", "landlock", "undumpable")  # meshjobs.wall.Status.walls


@dataclass
class Member:
    """What the leader knows of a member, from its F_JOB_HAVE reports (soft state)."""

    name: str
    boot: str = ""
    role: str = "worker"
    pools: dict[str, int] = field(default_factory=dict)
    pressure: bool = False
    disk_full: bool = False
    pos: int = 0
    running: int = 0
    blob_bytes: int = 0
    items: dict | None = None  # the walls its items run behind (None: not said)
    # Its wall clock minus the leader's when its last report came (None: not said); the
    # report's time in transit makes it look a little behind.
    clock_skew_ms: int | None = None
    last_ms: int = 0
    sent_upto: int = 0  # the table position F_JOB_STATE has been sent up to (workers)
    sent_ms: int = 0  # when F_JOB_STATE last went to it (entries or a keep-alive)
    pos_ms: int = 0  # when its reported position last moved
    snapshot_ms: int = 0  # when the whole table last went to it (workers)
    dumps: bool = False  # it takes the whole table as a dump (it says so in its reports)


def parse_have(body: Any) -> dict | None:
    """A member's F_JOB_HAVE body, checked; None for garbage (counted by the caller)."""
    if not isinstance(body, dict):
        return None
    boot, role, pos, pools = body.get("boot"), body.get("role"), body.get("pos"), body.get("pools")
    if not (isinstance(boot, str) and 0 < len(boot) <= limits.boot_chars_max
            and role in ("voter", "worker")
            and type(pos) is int and pos >= 0 and isinstance(pools, dict)
            and len(pools) <= limits.have_pools_max
            and all(isinstance(k, str) and type(v) is int and 0 <= v <= limits.pool_slots_max
                    for k, v in pools.items())):
        return None
    running = body.get("running", 0)
    blob_bytes = body.get("blob_bytes", 0)
    wall = body.get("wall_ms")
    return {
        "boot": boot, "role": role, "pos": pos, "pools": dict(pools),
        "pressure": body.get("pressure") is True,
        "disk_full": body.get("disk_full") is True,
        "running": running if type(running) is int else 0,
        "blob_bytes": blob_bytes if type(blob_bytes) is int else 0,
        "items": parse_items(body.get("items")),
        "dumps": body.get("dumps") is True,
        "wall_ms": wall if type(wall) is int and 0 <= wall < 2**63 else None,
    }


def parse_items(items: Any) -> dict | None:
    """A member's `items` (the walls its items run behind), checked; None when absent or
    garbage (an older member says nothing of it)."""
    if not isinstance(items, dict):
        return None
    user, walls, signals, warning = (items.get("user"), items.get("walls"),
                                     items.get("signals_walled"), items.get("warning"))
    if not (isinstance(user, str) and len(user) <= limits.boot_chars_max
            and isinstance(walls, list) and len(walls) <= len(WALLS)
            and all(w in WALLS for w in walls)
            and isinstance(signals, bool)
            and (warning is None or (isinstance(warning, str)
                                         and len(warning) <= limits.items_warning_chars_max))):
        return None
    return {"user": user, "walls": list(walls), "signals_walled": signals, "warning": warning}


class Members:
    """The leader's view of the members: name -> its latest report (`known`)."""

    def __init__(self, cfg: NodeConfig, count: Callable[[str], None]) -> None:
        self.cfg = cfg
        self._count = count
        self.known: dict[str, Member] = {}
        self.since_ms = 0  # when this member last came to lead
        self._since_tick = False  # the reign's start is the next tick's time (see `tick`)
        self._settled = False  # this reign has heard from the fleet (heard.py)
        # Member -> when a report of it last came here, leading or not, oldest first; at most
        # member_names_max of them.
        self.heard: dict[str, int] = {}

    def new_reign(self, now_ms: int) -> None:
        self.since_ms = now_ms
        self._since_tick = True
        self._settled = False
        self.known.clear()  # soft state of an earlier reign is stale

    def tick(self, now_ms: int) -> None:
        """The time moved on. The view that began a reign comes before the round's tick (and,
        at a member's start, before any): the reign begins at the time of the tick after it."""
        if self._since_tick:
            self._since_tick = False
            self.since_ms = max(self.since_ms, now_ms)

    def heard_from(self, peer: str, body: Any, now_ms: int) -> bool:
        """A member's report came here: noted as heard (Rule 2 of heard.py). False for garbage
        (counted and dropped)."""
        if parse_have(body) is None:
            self._count("frames_bad_have")
            return False
        self._heard(peer, now_ms)
        return True

    def _heard(self, peer: str, now_ms: int) -> None:
        self.heard.pop(peer, None)
        self.heard[peer] = now_ms
        while len(self.heard) > limits.member_names_max:
            del self.heard[next(iter(self.heard))]

    def hearing(self, now_ms: int, named: Callable[[], Iterable[str]]) -> Hearing | None:
        """What this leader has heard of the fleet in its reign while it cannot yet give final
        answers about the members (heard.py); None once it can. `named` gives the members its
        committed table names (asked only while it cannot)."""
        if self._settled:
            return None
        since = self.since_ms
        expected = set(self.cfg.voters) | set(named())
        expected.update(n for n, t in self.heard.items() if t >= since - self.cfg.lost_ms)
        h = Hearing.of(self.cfg.member, since, self.cfg.dead_ms, expected,
                       (n for n, m in self.known.items() if m.boot))
        if h.settled(now_ms):
            self._settled = True  # Rule 3 of heard.py: it stays so for the reign
            return None
        return h

    def have(self, peer: str, body: Any, now_ms: int) -> None:
        """A member's report (F_JOB_HAVE); garbage is counted and dropped."""
        have = parse_have(body)
        if have is None:
            self._count("frames_bad_have")
            return
        self._heard(peer, now_ms)
        m = self.known.get(peer)
        if m is None:
            m = self.known[peer] = Member(peer)
        if m.boot and m.boot != have["boot"]:
            m.sent_upto = 0  # a new incarnation starts its table again
            m.snapshot_ms = 0
        if have["pos"] != m.pos:
            m.pos_ms = now_ms
        m.boot, m.role, m.pools = have["boot"], have["role"], have["pools"]
        m.pressure, m.pos, m.running = have["pressure"], have["pos"], have["running"]
        m.blob_bytes = have["blob_bytes"]
        m.disk_full = have["disk_full"]
        m.items = have["items"]
        m.dumps = have["dumps"]
        m.clock_skew_ms = None if have["wall_ms"] is None else have["wall_ms"] - now_ms
        m.last_ms = now_ms
        if m.role == "worker" and (m.pos > m.sent_upto or (
                m.pos < m.sent_upto and now_ms - m.pos_ms >= limits.state_resend_ms
                and now_ms - m.snapshot_ms >= limits.state_snapshot_resend_ms)):
            # Caught up by other means; or behind what was sent and not moving: frames were
            # lost, so send again from where it is. (Not timed from the last send: keep-alives
            # go out every `have_ms` and would put this off for ever.) The whole table takes a
            # while to arrive and load on a busy worker: sent again before that, it would only
            # pile more copies of itself on the links.
            m.sent_upto = m.pos
            m.pos_ms = now_ms

    def workers_known(self) -> bool:
        """Does this member know of worker members (whose tables it keeps up to date)?"""
        return any(m.role == "worker" for m in self.known.values())

    def alive(self, name: str, now_ms: int, boot: str | None = None) -> bool:
        """Is this member (in this incarnation, when `boot` is given) alive, as the leader sees it?"""
        if name == self.cfg.member:
            return boot is None or boot == self.cfg.boot
        m = self.known.get(name)
        if m is None or not m.boot:
            # Not heard from yet: a new leader gives every member `dead_ms` to report.
            return now_ms - self.since_ms < self.cfg.dead_ms
        if boot is not None and m.boot != boot:
            return False
        return now_ms - m.last_ms <= self.cfg.dead_ms

    def boot_of(self, name: str) -> str:
        """The boot id a member last reported ("" when none); this member's own."""
        if name == self.cfg.member:
            return self.cfg.boot
        m = self.known.get(name)
        return m.boot if m is not None else ""

    def lost(self, others: set[str], now_ms: int) -> set[str]:
        """Of `others`, the members not heard from for `lost_ms` (this reign's start counts as
        heard): the copies of outputs they held are taken as gone."""
        lost = set()
        for name in others:
            m = self.known.get(name)
            last = max(m.last_ms if m is not None else 0, self.since_ms)
            if now_ms - last > self.cfg.lost_ms:
                lost.add(name)
        return lost
