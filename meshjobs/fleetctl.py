"""Pools and members under command: hold, release, drain and undrain a pool (fleet-wide or on
one member), and drain, undrain or stop a member, as committed entries of the job log.

Theory of operation. An operator's order is a change like any other: the member that gets it
forwards it to the leader, the leader proposes it (`{"k": "pool"}` or `{"k": "member"}`), and
every member applies it to its table's `FleetCtl` in log order. The orders are therefore the
same on every member, survive restarts and failovers (they are part of every snapshot), and
are applied on top of the config: a pool `[pools.X] hold = true` or `drain = true` in a
member's config has no slots there whatever the table says; a pool held or drained in the
table is held or drained whatever the config says. (The config cannot be released by a
command: edit it and restart the member.)

What each order means:

- pool hold: the leader grants no new lease in the pool (on the member named, or anywhere),
  and a member that holds a lease of an item of the pool that has not started yet (leased
  ahead) does not start it until the pool is released: the item stays leased to it, and is
  revoked and leased again elsewhere only if that member is lost, as any lease. Items already
  running go on to their end.
- pool drain: the leader grants no new lease in the pool; items already leased (started or
  leased ahead) run to their end.
- member drain: the leader grants the member no new lease in any pool; its leases run out.
- member stop: the member's current incarnation (its boot id, stamped into the entry by the
  leader) takes no new lease and starts nothing not started (items leased to it ahead stay
  leased until it is gone, then are revoked and leased elsewhere); once its running items have
  ended and their results are committed, or after `grace_s` (then its running items are cut,
  and their leases revoked and leased again elsewhere as for any lost member), its meshd exits
  with status 0, saying why in its log. The order is one-shot: the same member started again
  (a new boot id) comes back taking work, unless it was also drained.
- undrain (member) lifts a drain and a stop not yet done; release and undrain without a member
  lift every hold (or drain) of the pool, with one only that member's own.
- pool slots N (0..`limits.pool_slots_max`): the pool's slots, fleet-wide or on the member
  named, instead of the member's configured ones; `slots` with no number (reset) goes back
  to the config (fleet-wide reset: every override of the pool; with a member: its own). The
  effective slots of a pool on a member are its member override if any, else the fleet-wide
  one, else its configured slots. An override never creates a pool a member's config does
  not have, and never gives slots to a pool its config gives none (slots = 0, or hold or
  drain): the config's word is final there, as for hold and drain. The leader leases up to
  the effective slots (and the member starts up to them), so raising them runs more items
  at once and lowering them starts fewer: running items are never cut, and items already
  leased ahead past the new number wait their turn. Slots 0 takes no new lease there and lets
  what is leased run to its end, as a drain.

Rule 1: pure. No IO, clock, randomness or threads; the entry's `t` is its time.
Rule 2: `apply` raises `meshjobs.table.Refused` (through the table) for a malformed entry; the
        table turns that into a recorded refusal. The orders kept are bounded
        (`limits.ctl_orders_max`): beyond it a new order is refused, never a crash.
"""

from __future__ import annotations

from typing import Any

from meshjobs import limits

ALL = "*"  # the "member" of a fleet-wide pool order
POOL_ACTIONS = ("hold", "release", "drain", "undrain")
SLOTS = "slots"  # the pool order that sets (or resets) a pool's slots: POST /pools/{pool}/slots
MEMBER_ACTIONS = ("drain", "undrain", "stop")


class CtlRefused(Exception):
    """An order that cannot be applied; the table records it as a refusal."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class FleetCtl:
    """The committed orders: pools held or drained (per member, or ALL), members drained, and
    the stop orders of members' incarnations."""

    def __init__(self) -> None:
        self.held: dict[tuple[str, str], None] = {}  # (pool, member or ALL)
        self.drained_pools: dict[tuple[str, str], None] = {}
        self.drained: dict[str, None] = {}  # member names
        self.stops: dict[str, tuple[str, int, int | None]] = {}  # member -> (boot, t ms, grace ms)
        self.slots: dict[tuple[str, str], int] = {}  # (pool, member or ALL) -> slots set

    # --- reading ----------------------------------------------------------------------------

    def active(self) -> bool:
        return bool(self.held or self.drained_pools or self.drained or self.stops or self.slots)

    def pool_held(self, pool: str, member: str) -> bool:
        return (pool, ALL) in self.held or (pool, member) in self.held

    def pool_drained(self, pool: str, member: str) -> bool:
        return (pool, ALL) in self.drained_pools or (pool, member) in self.drained_pools

    def stopping(self, member: str, boot: str) -> bool:
        stop = self.stops.get(member)
        return stop is not None and stop[0] == boot

    def closed(self, member: str, boot: str) -> bool:
        """Whether the member (in this incarnation) takes no new lease at all."""
        return member in self.drained or self.stopping(member, boot)

    def refuses(self, pool: str, member: str, boot: str) -> bool:
        """Whether a lease of an item of `pool` to `member` (incarnation `boot`) is refused."""
        return (self.closed(member, boot) or self.pool_held(pool, member)
                or self.pool_drained(pool, member))

    def pool_view(self, pool: str) -> dict[str, Any]:
        """Who holds and drains `pool`: fleet-wide, and the members named."""
        return {
            "held": (pool, ALL) in self.held,
            "held_on": sorted(m for p, m in self.held if p == pool and m != ALL),
            "drained": (pool, ALL) in self.drained_pools,
            "drained_on": sorted(m for p, m in self.drained_pools if p == pool and m != ALL),
            **self.slots_view(pool),
        }

    def members_named(self) -> set[str]:
        """The members the orders name (drained, stopping, or named by a pool order)."""
        return (set(self.drained) | set(self.stops)
                | {m for _p, m in self.held if m != ALL}
                | {m for _p, m in self.drained_pools if m != ALL}
                | {m for _p, m in self.slots if m != ALL})

    def pools_named(self) -> set[str]:
        return ({p for p, _m in self.held} | {p for p, _m in self.drained_pools}
                | {p for p, _m in self.slots})

    def slots_of(self, pool: str, member: str, configured: int) -> int:
        """The effective slots of `pool` on `member`, whose config gives it `configured`."""
        if not self.slots or configured <= 0:
            return configured
        n = self.slots.get((pool, member))
        if n is None:
            n = self.slots.get((pool, ALL))
        return configured if n is None else n

    def effective(self, member: str, pools: dict[str, int]) -> dict[str, int]:
        """A member's pools (name -> configured slots) with their effective slots."""
        if not self.slots:
            return pools
        return {p: self.slots_of(p, member, n) for p, n in pools.items()}

    def slots_view(self, pool: str) -> dict[str, Any]:
        """The slots set for `pool`: fleet-wide (None: none), and per member named."""
        return {"slots_set": self.slots.get((pool, ALL)),
                "slots_set_on": {m: n for (p, m), n in sorted(self.slots.items())
                                 if p == pool and m != ALL}}

    # --- applying -----------------------------------------------------------------------------

    def _room_for(self, n: int = 1) -> None:
        total = (len(self.held) + len(self.drained_pools) + len(self.drained) + len(self.stops)
                 + len(self.slots))
        if total + n > limits.ctl_orders_max:
            raise CtlRefused(409, f"the fleet keeps at most {limits.ctl_orders_max} pool and "
                                  "member orders: release, undrain or undrain members first")

    def apply_pool(self, e: dict) -> dict:
        if e.get("a") == SLOTS:
            return self.apply_slots(e)
        action, pool, member = e.get("a"), e.get("pool"), e.get("member")
        if (action not in POOL_ACTIONS or not _name_ok(pool)
                or not (member is None or _name_ok(member))):
            raise CtlRefused(400, "malformed pool order")
        key = (pool, ALL if member is None else member)
        if action in ("hold", "drain"):
            book = self.held if action == "hold" else self.drained_pools
            if key not in book:
                self._room_for()
                book[key] = None
        else:
            book = self.held if action == "release" else self.drained_pools
            if member is None:
                for k in [k for k in book if k[0] == pool]:
                    del book[k]
            else:
                book.pop(key, None)
        return {"ok": True, "pool": pool, "action": action, "member": member,
                **self.pool_view(pool)}

    def apply_slots(self, e: dict) -> dict:
        """Set (`slots` an int) or reset (`slots` None) a pool's slots, fleet-wide or on one
        member. A fleet-wide reset drops every override of the pool."""
        pool, member, n = e.get("pool"), e.get("member"), e.get("slots", ...)
        if (not _name_ok(pool) or not (member is None or _name_ok(member))
                or not (n is None or _slots_ok(n))):
            raise CtlRefused(400, "malformed pool order")
        key = (pool, ALL if member is None else member)
        if n is not None:
            if key not in self.slots:
                self._room_for()
            self.slots[key] = n
        elif member is None:
            for k in [k for k in self.slots if k[0] == pool]:
                del self.slots[k]
        else:
            self.slots.pop(key, None)
        return {"ok": True, "pool": pool, "action": SLOTS, "member": member,
                **self.pool_view(pool)}

    def apply_member(self, e: dict, t: int) -> dict:
        action, name = e.get("a"), e.get("name")
        if action not in MEMBER_ACTIONS or not _name_ok(name):
            raise CtlRefused(400, "malformed member order")
        if action == "drain":
            if name not in self.drained:
                self._room_for()
                self.drained[name] = None
        elif action == "undrain":
            self.drained.pop(name, None)
            self.stops.pop(name, None)
        else:
            boot, grace = e.get("boot"), e.get("grace_ms")
            if not (isinstance(boot, str) and 0 < len(boot) <= limits.boot_chars_max) or not (
                    grace is None or (type(grace) is int and 0 <= grace <= limits.stop_grace_s_max * 1000)):
                raise CtlRefused(400, "malformed member order")
            if name not in self.stops:
                self._room_for()
            self.stops[name] = (boot, t, grace)
        return {"ok": True, "name": name, "action": action, "drained": name in self.drained,
                "stopping": name in self.stops}

    # --- snapshots ------------------------------------------------------------------------------

    def to_state(self) -> dict | None:
        if not self.active():
            return None  # a table without orders snapshots as it did before they existed
        return {"held": [list(k) for k in self.held],
                "drained_pools": [list(k) for k in self.drained_pools],
                "drained": list(self.drained),
                "stops": [[n, b, t, g] for n, (b, t, g) in self.stops.items()],
                **({"slots": [[p, m, n] for (p, m), n in self.slots.items()]}
                   if self.slots else {})}

    @classmethod
    def from_state(cls, s: Any) -> FleetCtl:
        c = cls()
        if s is None:
            return c
        c.held = {(p, m): None for p, m in s["held"]}
        c.drained_pools = {(p, m): None for p, m in s["drained_pools"]}
        c.drained = dict.fromkeys(s["drained"])
        c.stops = {n: (b, t, g) for n, b, t, g in s["stops"]}
        c.slots = {(p, m): n for p, m, n in s.get("slots", ())}
        c.check()
        return c

    def check(self) -> None:
        total = (len(self.held) + len(self.drained_pools) + len(self.drained) + len(self.stops)
                 + len(self.slots))
        assert total <= limits.ctl_orders_max, "more pool and member orders than kept"
        for p, m in (*self.held, *self.drained_pools):
            assert _name_ok(p) and (m == ALL or _name_ok(m)), f"bad pool order {p}@{m}"
        for n in (*self.drained, *self.stops):
            assert _name_ok(n), f"bad member order for {n!r}"
        for (p, m), n in self.slots.items():
            assert _name_ok(p) and (m == ALL or _name_ok(m)) and _slots_ok(n), \
                f"bad slots order {p}@{m} = {n!r}"


def _slots_ok(n: Any) -> bool:
    return type(n) is int and 0 <= n <= limits.pool_slots_max


def _name_ok(x: Any) -> bool:
    """A pool or member name: [A-Za-z0-9._-], 1..pool_chars_max characters."""
    return (isinstance(x, str) and 0 < len(x) <= limits.pool_chars_max and x.isascii()
            and all(c.isalnum() or c in "._-" for c in x))


# --- requests (control ops "pool", "member" and "pools") --------------------------------------


def parse_ctl(req: dict) -> dict:
    """Validate an operator's order as it reaches the node; raises control.ControlError."""
    from meshjobs.control import ControlError, parse_fp, parse_rid

    op = req.get("op")
    if op == "pools":
        return {"op": "pools"}
    action = req.get("action")
    if op == "pool":
        if action not in (*POOL_ACTIONS, SLOTS):
            raise ControlError(400, f"unknown pool action {str(action)[:40]!r}: use one of "
                                    f"{', '.join((*POOL_ACTIONS, SLOTS))}")
        out: dict[str, Any] = {"op": "pool", "rid": parse_rid(req.get("rid")),
                               "fp": parse_fp(req.get("fp")), "action": action,
                               "pool": parse_name(req.get("pool"), "pool"), "member": None}
        if req.get("member") is not None:
            out["member"] = parse_name(req.get("member"), "member")
        if action == SLOTS:
            if "slots" not in req:
                raise ControlError(400, 'give "slots": a whole number, or null to go back to '
                                        "the config")
            out["slots"] = parse_slots(req["slots"])
        return out
    if action not in MEMBER_ACTIONS:
        raise ControlError(400, f"unknown member action {str(action)[:40]!r}: use one of "
                                f"{', '.join(MEMBER_ACTIONS)}")
    out = {"op": "member", "rid": parse_rid(req.get("rid")), "fp": parse_fp(req.get("fp")),
           "action": action, "name": parse_name(req.get("name"), "member"), "grace_s": None}
    if req.get("grace_s") is not None:
        if action != "stop":
            raise ControlError(400, "grace_s is for stop only")
        out["grace_s"] = parse_grace(req["grace_s"])
    return out


def parse_name(value: Any, what: str) -> str:
    from meshjobs.control import ControlError

    if not _name_ok(value):
        raise ControlError(400, f"bad {what} name {str(value)[:40]!r}: use 1 to "
                                f"{limits.pool_chars_max} letters, digits, '.', '_' or '-'")
    return str(value)


def parse_slots(value: Any) -> int | None:
    """A pool's slots in a slots order: a whole number 0..pool_slots_max, or None (reset)."""
    from meshjobs.control import ControlError

    if value is None or _slots_ok(value):
        return value
    raise ControlError(400, f"slots must be a whole number from 0 to {limits.pool_slots_max} "
                            f"(or null to go back to the config), not {str(value)[:40]!r}")


def parse_grace(value: Any) -> float:
    from meshjobs.control import ControlError

    if (isinstance(value, bool) or not isinstance(value, (int, float)) or value != value
            or not 0 <= value <= limits.stop_grace_s_max):
        raise ControlError(400, f"grace_s must be a number of seconds from 0 to "
                                f"{limits.stop_grace_s_max}")
    return float(value)


def parse_body(body: Any, keys: frozenset[str]) -> dict:
    """The optional JSON body of POST /pools/{pool}/{action} ({"member"}) or
    /members/{name}/{action} ({"grace_s"}): an object with only those keys."""
    from meshjobs.control import ControlError

    if body is None:
        return {}
    if not isinstance(body, dict):
        raise ControlError(400, "the body must be a JSON object")
    unknown = set(body) - keys
    if unknown:
        raise ControlError(400, f"unknown key(s): {', '.join(sorted(map(str, unknown)))[:200]}; "
                                f"use {', '.join(sorted(keys))}")
    return body


def parse_notify(value: Any) -> str:
    """A job's finish hook: an http:// or https:// URL with a host, printable ASCII, at most
    `notify_url_chars_max` characters."""
    from urllib.parse import urlsplit

    from meshjobs.control import ControlError

    if (not isinstance(value, str) or not 0 < len(value) <= limits.notify_url_chars_max
            or not value.isascii() or not value.isprintable() or " " in value):
        raise ControlError(400, f"notify must be an http:// or https:// URL of at most "
                                f"{limits.notify_url_chars_max} printable ASCII characters")
    try:
        u = urlsplit(value)
        port = u.port
    except ValueError:
        raise ControlError(400, f"notify {value[:80]!r} is not a URL: give http://HOST[:PORT]/PATH") from None
    if u.scheme not in ("http", "https") or not u.hostname or u.username or u.password:
        raise ControlError(400, f"notify {value[:80]!r}: give an http:// or https:// URL with a "
                                "host and no user or password")
    if port == 0:
        raise ControlError(400, "notify: port 0 is not a port")
    return value


# --- what `GET /pools` shows --------------------------------------------------------------------


def pools_view(fleet: dict, ctl: FleetCtl, leased: dict[str, dict[str, int]],
               pending: dict[str, int]) -> dict:
    """Per pool, fleet-wide: slots and free slots of the alive members, items running (leased),
    items waiting for a slot, and who holds and drains it. `fleet` is the node's fleet view,
    `leased` pool -> member -> items leased, `pending` pool -> items waiting."""
    pools: dict[str, dict] = {}
    names = set(ctl.pools_named()) | set(leased) | set(pending)
    for m in fleet.get("members", []):
        names.update(m.get("pools") or {})
    for pool in sorted(names):
        row: dict[str, Any] = {"pool": pool, "slots": 0, "free": 0, "running": 0,
                               "pending": pending.get(pool, 0), **ctl.pool_view(pool),
                               "members": {}}
        for m in fleet.get("members", []):
            name, slots = m["name"], (m.get("pools") or {}).get(pool)
            running = leased.get(pool, {}).get(name, 0)
            if slots is None and not running:
                continue
            slots = slots or 0
            taking = bool(m.get("alive")) and not m.get("drained") and not m.get("stopping") \
                and not ctl.pool_held(pool, name) and not ctl.pool_drained(pool, name)
            if m.get("alive"):
                row["slots"] += slots
            free = max(0, slots - running) if taking else 0
            row["free"] += free
            row["running"] += running
            row["members"][name] = {"slots": slots, "running": running, "free": free,
                                    "slots_set": ctl.slots.get((pool, name),
                                                               ctl.slots.get((pool, ALL))),
                                    "held": ctl.pool_held(pool, name),
                                    "drained": ctl.pool_drained(pool, name),
                                    "member_drained": bool(m.get("drained")),
                                    "stopping": bool(m.get("stopping")),
                                    "alive": m.get("alive")}
        pools[pool] = row
    return {"leader": fleet.get("leader"), "pools": list(pools.values()),
            **({"partial": True} if fleet.get("partial") else {})}
