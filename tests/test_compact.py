"""Tests of meshjobs/compact.py: compact array items in submit entries, and the compact queue of
a job's pending items; and of the table reading both forms of a submit entry."""

from __future__ import annotations

from collections import deque
from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshjobs import limits
from meshjobs.compact import (
    ItemQueue,
    entry_item_count,
    entry_items,
    entry_payloads,
    pack_items,
)
from meshjobs.table import PENDING, JobTable

D1, D2, D3 = b"\x01" * 32, b"\x02" * 32, b"\x03" * 32
SPEC = {"argv": ["true"], "pool": "default", "env": {}, "cwd": None, "retries": 0,
        "runtime_s": None, "tags": [], "priority": 0, "hold": False, "max_leases": None}


def _wire(e: dict) -> dict:
    """What a member's apply gets: the entry through msgpack, as the log carries it."""
    out = msgpack.unpackb(msgpack.packb(e, use_bin_type=True), raw=False, strict_map_key=False,
                          use_list=True)
    assert isinstance(out, dict)
    return out


@pytest.mark.parametrize("items", [
    [D1] * 5, [None] * 3, [D1], [D1, D2, D1, None, D3, D2], [None, D1],
])
def test_pack_round_trip(items: list) -> None:
    """Rule 2's other half: what `pack_items` makes, `entry_items` reads back item for item,
    with one object per distinct payload; its count and payloads are said without unpacking."""
    e = _wire(pack_items(items))
    assert "items" not in e
    got = entry_items(e)
    assert got == items
    assert got is not None and len({id(d) for d in got}) == len(set(items))
    assert entry_item_count(e) == len(items)
    assert entry_payloads(e) == list(dict.fromkeys(items))


def test_one_payload_is_a_count() -> None:
    """An array of one payload costs one digest and a count in the entry, however many items."""
    e = pack_items([D1] * limits.items_max)
    assert e == {"ip": [D1], "n": limits.items_max}
    assert len(msgpack.packb(e, use_bin_type=True)) < 64


def test_old_form_still_read() -> None:
    """An entry of an older member (`items`: one payload each) reads as before."""
    e = {"items": [D1, None, D1]}
    got = entry_items(e)
    assert got == [D1, None, D1] and got is not None and got[0] is got[2]
    assert entry_item_count(e) == 3
    assert entry_payloads(e) == [D1, None]


@pytest.mark.parametrize("e", [
    {}, {"ip": []}, {"ip": None, "n": 1}, {"ip": [D1]}, {"ip": [D1], "n": 0},
    {"ip": [D1], "n": True}, {"ip": [D1], "n": 1.0}, {"ip": [D1], "n": -1},
    {"ip": [D1], "n": limits.items_max + 1}, {"ip": [b"short"], "n": 1}, {"ip": ["x" * 32], "n": 1},
    {"ip": [D1, D1], "ix": b"\0" * 8}, {"ip": [D1, D2], "n": 2}, {"ip": [D1, D2], "ix": b""},
    {"ip": [D1, D2], "ix": b"\0\0\0"}, {"ip": [D1, D2], "ix": b"\2\0\0\0"},
    {"ip": [D1, D2], "ix": "\0\0\0\0"}, {"ip": [D1, D2], "ix": b"\0\0\0\0", "n": 1},
    {"ip": [D1, D2], "ix": b"\xff\xff\xff\xff"},
    {"ip": [D1, D2], "ix": b"\0" * 4 * (limits.items_max + 1)},
    {"items": []}, {"items": [b"x"]}, {"items": "abc"}, {"items": [D1] * (limits.items_max + 1)},
])
def test_garbage_is_none(e: dict) -> None:
    """Remote garbage in the item fields is None (the table refuses the entry), never a raise."""
    assert entry_items(e) is None


def test_table_refuses_garbage_items_and_reads_both_forms() -> None:
    """The table applies an old-form and a compact submit alike (same items, same record), and
    refuses a malformed compact one as a malformed item list."""
    t = JobTable()
    base = {"k": "submit", "t": 1, "spec": SPEC, "dg": b"dg"}
    old = t.apply(_wire({**base, "id": "old", "items": [D1, None, D2, D1]}), 1)
    new = t.apply(_wire({**base, "id": "new", **pack_items([D1, None, D2, D1])}), 2)
    assert old["ok"] and new["ok"]
    a, b = t.jobs["old"], t.jobs["new"]
    assert a.stdin == b.stdin == [D1, None, D2, D1] and b.stdin[0] is b.stdin[3]
    bad = t.apply({**base, "id": "bad", "ip": [D1, D2], "ix": b"\5\0\0\0"}, 3)
    assert not bad["ok"] and bad["error"] == "malformed item list"
    neither = t.apply({**base, "id": "bad"}, 4)
    assert not neither["ok"] and neither["error"] == "malformed submit"
    t.check()
    again = JobTable.from_state(_wire(t.to_state()))
    assert again.jobs["new"].stdin == [D1, None, D2, D1]


def test_big_array_holds_no_object_per_item() -> None:
    """A job of many fresh items: its queue keeps no object per item, its stdin one payload."""
    t = JobTable()
    n = 200_000
    t.apply(_wire({"k": "submit", "t": 1, "id": "j", "spec": SPEC, "dg": b"dg",
                   **pack_items([D1] * n)}), 1)
    j = t.jobs["j"]
    assert len(j.queue) == n and not j.queue.head and not j.queue.tail and j.queue.holes is None
    assert len({id(d) for d in j.stdin}) == 1
    t.check()


# --- ItemQueue against a deque ------------------------------------------------------------------

_OPS = st.lists(st.tuples(st.sampled_from(["popleft", "remove", "append", "appendleft",
                                           "remove_first", "remove_last"]),
                          st.integers(0, 40)), max_size=80)


@settings(max_examples=400, deadline=None)
@given(n=st.integers(0, 30), ops=_OPS)
def test_queue_is_a_deque(n: int, ops: list[tuple[str, int]]) -> None:
    """Rule 3: fed the same calls as a deque of the same items (as the table makes them: only
    absent items go back in), the queue holds the same items in the same order, and refuses
    what the deque refuses."""
    q, d = ItemQueue(n), deque(range(n))
    for op, k in ops:
        if op == "popleft":
            if not d:
                with pytest.raises(IndexError):
                    q.popleft()
                continue
            assert q[0] == d[0]
            assert q.popleft() == d.popleft()
        elif op.startswith("remove"):
            i = (d[0] if op == "remove_first" else d[-1]) if d and op != "remove" else k
            if i in d:
                d.remove(i)
                q.remove(i)
            else:
                with pytest.raises(ValueError):
                    q.remove(i)
        elif k not in d:  # a pending item is never queued twice
            getattr(d, op)(k)
            getattr(q, op)(k)
        assert list(q) == list(d) and len(q) == len(d) and bool(q) == bool(d)
    again = ItemQueue.of(list(q))
    assert list(again) == list(d)


def test_queue_of_a_snapshot_run_is_compact() -> None:
    """A snapshot's queue that is one ascending run loads as a run, not as objects."""
    q = ItemQueue.of(range(5, 100_000))
    assert (q.lo, q.hi, len(q.tail), len(q)) == (5, 100_000, 0, 99_995)
    assert list(ItemQueue.of([3, 1, 2])) == [3, 1, 2]
    assert list(ItemQueue.of([])) == []


def test_lease_out_of_order_and_revoke() -> None:
    """Items leased out of order leave holes that are skipped; a revoked one goes to the head,
    a retried one to the tail (the table's own moves)."""
    t = JobTable()
    t.apply({"k": "submit", "t": 1, "id": "j", "spec": SPEC, "dg": b"dg", **pack_items([None] * 6)},
            1)
    t.apply({"k": "lease", "t": 2, "g": [["j", 3, "m", "b"], ["j", 0, "m", "b"]]}, 2)
    j = t.jobs["j"]
    assert list(j.queue) == [1, 2, 4, 5]
    t.apply({"k": "revoke", "t": 3, "l": [["j", 3, 2]]}, 3)
    assert list(j.queue) == [3, 1, 2, 4, 5] and j.st[3] == PENDING
    t.check()
    state: Any = _wire(t.to_state())
    assert list(JobTable.from_state(state).jobs["j"].queue) == [3, 1, 2, 4, 5]
