"""Placement: which members a job's items may go to.

Theory of operation. A job may name a member selector (`"member"` in its spec, `--member` of
meshctl, or the `member` part of `"pool": "pool@member"`):

- a member name (`gpu-1`): every item runs on that member;
- a glob over member names, fnmatch style (`gpu-*`, `node-?`, `rack[12]-*`): each item runs on
  some member whose name matches;
- `*`: fan-out. The job runs once on every member that offers its pool: one item per member.
  The leader resolves `*` when it takes the submit, against the members it knows to be alive
  and offering the pool then (itself among them), sorted by name, and puts that list in the
  committed submit entry (`"on"`), so that every member agrees which item is whose: item i is
  pinned to member i of the list, for good. A member that joins later is not added; one that
  is gone keeps its item waiting (never moved elsewhere) until it comes back or the job is
  cancelled.

The selector is a fact of the job spec, so every member's table enforces it the same way: a
lease grant to a member the selector does not allow is refused (counted), whoever proposed it.
Whether a matching member is alive is the leader's soft knowledge, never the table's: the words
of `waiting_for` are made from a fleet view, at the edge that answers a client.

Rule 1: pure. No IO, clock or randomness; `fnmatch` only translates a pattern.
Rule 2: remote garbage raises `ControlError` (400) with what to do next.
Rule 3: a selector is at most `limits.member_selector_chars_max` characters of a member name's
        alphabet (letters, digits, '.', '_', '-') and the glob characters `*?[]!`.
"""

from __future__ import annotations

import fnmatch
import re
from functools import lru_cache
from typing import Any

from meshjobs import limits
from meshjobs.control import POOL_RE, ControlError

FANOUT = "*"
GLOB_CHARS = frozenset("*?[")
SELECTOR_RE = re.compile(r"^[A-Za-z0-9._\-*?\[\]!]+$")
HINT = ("give a member name, a glob over member names (gpu-*, node-?, rack[12]-*) or * (every "
        f"member of the pool, once each): up to {limits.member_selector_chars_max} of letters, "
        "digits, '.', '_', '-' and the glob characters * ? [ ] !")


def parse_member(value: object) -> str:
    """A member selector as a client gives it, checked (ControlError 400 otherwise)."""
    if not isinstance(value, str):
        raise ControlError(400, f"member must be a string: {HINT}")
    if not value:
        raise ControlError(400, f"member is empty: {HINT}")
    if len(value) > limits.member_selector_chars_max:
        raise ControlError(400, f"member {value[:40]!r}... is longer than "
                                f"{limits.member_selector_chars_max} characters: {HINT}")
    if not SELECTOR_RE.fullmatch(value):
        raise ControlError(400, f"bad member selector {value[:40]!r}: {HINT}")
    if is_glob(value) and value != FANOUT:
        try:
            _compiled(value)
        except re.error:
            raise ControlError(400, f"bad member glob {value[:40]!r}: {HINT}") from None
    return value


def split_pool(value: object) -> tuple[str, str | None]:
    """`"pool"` or `"pool@member"`: the pool name and the member selector (None without '@')."""
    if not isinstance(value, str) or "@" not in value:
        return value, None  # type: ignore[return-value]  # the pool check says what is wrong
    pool, _, member = value.partition("@")
    if not pool or not member:
        raise ControlError(400, f"bad pool@member {value[:80]!r}: both parts are needed, as "
                                "in gpu@node-1, gpu@node-* or gpu@* (every member of pool gpu); "
                                "or give the pool alone")
    if not POOL_RE.fullmatch(pool):
        raise ControlError(400, f"bad pool name {pool[:40]!r} in {value[:80]!r}: use 1 to "
                                f"{limits.pool_chars_max} letters, digits, '.', '_' or '-'")
    return pool, parse_member(member)


def is_glob(selector: str) -> bool:
    return any(c in GLOB_CHARS for c in selector)


@lru_cache(maxsize=256)
def _compiled(selector: str) -> re.Pattern[str]:
    return re.compile(fnmatch.translate(selector))


def matches(selector: str | None, name: str) -> bool:
    """Does member `name` match `selector` (None: any member)? Case-sensitive, as names are."""
    if selector is None or selector == FANOUT:
        return True
    if not is_glob(selector):
        return selector == name
    return _compiled(selector).fullmatch(name) is not None


def allows(selector: str | None, pins: list[str] | None, i: int, member: str) -> bool:
    """May item `i` of a job with this selector (and, for a fan-out, these pinned members) be
    leased to `member`?"""
    if pins is not None:
        return 0 <= i < len(pins) and pins[i] == member
    return matches(selector, member)


def fanout_ok(names: object, n: int) -> bool:
    """A committed fan-out list: one distinct member name per item, each a member name."""
    return (isinstance(names, list) and len(names) == n and 0 < n <= limits.fanout_members_max
            and all(isinstance(m, str) and POOL_RE.fullmatch(m) for m in names)
            and len(set(names)) == n)


def waiting_for(record: dict, fleet_members: list[dict]) -> str | None:
    """Why a placed job's pending items get no lease, in words, from a fleet view (the members
    with "name", "alive" and "pools"); None when nothing in placement keeps them waiting."""
    selector = record.get("member")
    if not isinstance(selector, str) or record.get("state") not in ("queued", "running"):
        return None
    if not record.get("items_pending"):
        return None
    pool = record.get("pool")
    up = {m.get("name") for m in fleet_members if isinstance(m, dict) and m.get("alive") is True
          and isinstance(m.get("pools"), dict) and pool in m["pools"]}
    if selector == FANOUT:
        gone = [m for m in record.get("pending_members") or [] if m not in up]
        if not gone:
            return None
        shown = ", ".join(gone[:10]) + (f" and {len(gone) - 10} more" if len(gone) > 10 else "")
        return (f"member(s) {shown} of this fan-out are not alive (or offer no pool {pool!r} now): "
                "their items wait for them and never run elsewhere; start them again, or cancel "
                "the job")
    if any(matches(selector, n) for n in up if isinstance(n, str)):
        return None
    return (f"no alive member matches {selector!r} in pool {pool!r}: the job waits until one "
            "does (see `meshctl fleet`); start such a member, or cancel and submit with another "
            "--member")


def fanout_rows(record: dict) -> list[tuple[int, str]]:
    """(item index, member) of a fan-out job's record."""
    names: Any = record.get("members")
    if not isinstance(names, list):
        return []
    return [(i, str(m)) for i, m in enumerate(names)]
