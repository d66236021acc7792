"""A dead member looks dead (issue 27, point 5), on real members: 3 voters and a worker. The
leader is killed (-9); every fleet view the new leader gives lists all four members (none
drops out while it waits for reports), the worker comes back `alive`, and once `dead_ms` has
passed the killed voter is `down` with the time since when, in `meshctl fleet` too."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.helpers import Meshd, fleet_running, leader_of, make_fleet, wait_until

pytestmark = pytest.mark.fleet

DEAD_MS = 1500


@pytest.fixture
def fleet(tmp_path: Any) -> Iterator[list[Meshd]]:
    yield from fleet_running(make_fleet(str(tmp_path), voters=3, workers=1, dead_ms=DEAD_MS))


def _rows(m: Meshd) -> dict[str, dict] | None:
    status, fleet = m.request("GET", "/fleet")
    if status != 200 or fleet.get("partial") or not fleet.get("leader"):
        return None
    return {r["name"]: r for r in fleet["members"]}


def test_a_killed_leader_is_down_and_no_member_drops_out(fleet: list[Meshd]) -> None:
    names = {m.name for m in fleet}
    lead = leader_of(fleet)
    wait_until(lambda: (r := _rows(lead)) and all(r[n]["status"] == "alive" for n in names)
               and set(r) == names, what="every member alive at the leader")
    lead.kill9()
    others = [m for m in fleet if m is not lead]
    new = leader_of(others)
    seen: list[dict[str, dict]] = []

    def down() -> dict | None:
        rows = _rows(new)
        if rows is None:
            return None
        seen.append(rows)
        row = rows.get(lead.name)
        return row if row and row["status"] == "down" else None

    row = wait_until(down, what=f"{lead.name} down at the new leader")
    assert row["alive"] is False and isinstance(row["down_since"], float), row
    # Never a member fewer than the fleet has, in any view on the way.
    assert all(set(rows) == names for rows in seen), [sorted(r) for r in seen]
    worker = next(m for m in fleet if m.name.startswith("w"))
    wait_until(lambda: (_rows(new) or {}).get(worker.name, {}).get("status") == "alive",
               what="the worker alive at the new leader")
    out = new.ctl("fleet")
    assert out.returncode == 0, out.stderr
    line = next(ln for ln in out.stdout.decode().splitlines() if ln.startswith(lead.name + " "))
    assert "down since " in line, out.stdout.decode()
