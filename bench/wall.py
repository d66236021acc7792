"""The cost of the items' wall per item start: `true` started N times through posix_spawn
(meshjobs.spawn, as the driver starts items) bare and behind the Landlock launcher
(meshjobs.wall) with the rules of a data folder in a temporary folder.

    python3 -m bench.wall [N]
    python3 -m bench.wall --e2e N   (a fleet of one: N `true` items, wall on and off)

The second form runs a real meshd twice (bench.common.Member, 2 slots): one job of N `true`
items from submit to finished, with `[items] wall = "auto"` and then "off".
"""

from __future__ import annotations

import os
import sys
import tempfile
import time

from meshjobs import spawn, wall


def run(n: int, argv: list[str], path: str, env: dict[str, str]) -> float:
    fd = os.open(os.devnull, os.O_RDWR)
    t0 = time.perf_counter()
    for _ in range(n):
        pid = spawn.spawn(path, argv, env, (fd, fd, fd), None)
        os.waitpid(pid, 0)
    took = time.perf_counter() - t0
    os.close(fd)
    return n / took


def e2e(n: int) -> None:
    from bench.common import Member
    rates = {}
    for mode in ("auto", "off"):
        with Member(slots=2, config=f'[items]\nwall = "{mode}"\n') as m:
            m.wait(m.post("/jobs", {"argv": ["true"]})["id"])  # warm up
            t0 = time.perf_counter()
            rec = m.post("/jobs", {"argv": ["true"], "items": [""] * n})
            done = m.wait(rec["id"])
            took = time.perf_counter() - t0
            assert done["items_done"] == n, done
            rates[mode] = n / took
    print(f"{n} `true` items on a fleet of one (2 slots), submit to finished: walled "
          f"{rates['auto']:.0f} items/s, wall off {rates['off']:.0f} items/s")


def main() -> None:
    if sys.argv[1:2] == ["--e2e"]:
        e2e(int(sys.argv[2]) if len(sys.argv) > 2 else 1000)
        return
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 200
    assert spawn.available() and wall.landlock_abi() > 0
    env = {"PATH": "/usr/bin:/bin"}
    with tempfile.TemporaryDirectory() as top:
        os.mkdir(os.path.join(top, "data"))
        rules = wall.rules([os.path.join(top, "data")])
        true = wall.program_path("true", env)
        bare = run(n, ["true"], true, env)
        walled_argv = wall.wrap(rules, true, ["true"], env)
        walled = run(n, walled_argv, walled_argv[0], env)
    print(f"{n} starts of true: bare {bare:.0f}/s ({1000 / bare:.2f} ms each), walled "
          f"{walled:.0f}/s ({1000 / walled:.2f} ms each): the wall adds "
          f"{1000 / walled - 1000 / bare:.2f} ms per item start ({len(rules.allow)} rules)")


if __name__ == "__main__":
    main()
