"""What placement costs the leader per lease round: `JobTable.place` (pick and choose a member
for each item, honouring member selectors) against the leader's loop before placement (`pick`,
then the member with most room for each item), on one table of 1000 ready jobs of 100 items,
50 members of 8 free slots each.

    python3 -m bench.placement
"""

from __future__ import annotations

import time

from meshjobs.table import JobTable

T0 = 1_700_000_000_000
SPEC = {"argv": ["true"], "pool": "default", "env": {}, "cwd": None, "retries": 0,
        "runtime_s": None, "tags": [], "priority": 0, "hold": False, "max_leases": None}
ROUNDS = 200


def table(selector: str | None) -> JobTable:
    t = JobTable()
    for j in range(1000):
        spec = {**SPEC, **({"member": selector} if selector else {})}
        t.apply({"k": "submit", "t": T0, "id": f"j{j}", "spec": spec,
                 "dg": bytes([j % 256]) * 32, "items": [None] * 100}, j + 1)
    return t


def old_loop(t: JobTable, room: dict[str, int]) -> None:
    r = dict(room)
    for _jid, _i in t.pick("default", sum(r.values()), T0, set()):
        m = max((x for x in r if r[x] > 0), key=lambda x: (r[x], x == "m0", x))
        r[m] -= 1


def ms_per_round(fn, *args) -> float:
    start = time.perf_counter()
    for _ in range(ROUNDS):
        fn(*args)
    return 1e3 * (time.perf_counter() - start) / ROUNDS


def main() -> None:
    room = {f"m{i}": 8 for i in range(50)}
    plain = table(None)
    print(f"before placement (pick, then a member per item): "
          f"{ms_per_round(old_loop, plain, room):.2f} ms per round")
    for sel in (None, "m1*", "m7"):
        t = plain if sel is None else table(sel)
        ms = ms_per_round(lambda t=t: t.place("default", dict(room), 400, T0, set(), "m0"))
        print(f"place, every job's selector {sel!r}: {ms:.2f} ms per round")


if __name__ == "__main__":
    main()
