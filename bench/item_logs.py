"""Live item output: how fast a running item's output is read whole, here and from another member.

    python bench/item_logs.py [--mib 64] [--rounds 2]

A fleet of 3 voters runs one item that writes `--mib` MiB to stdout and then waits; while it
runs, `GET /jobs/{id}/items/0/stdout` (no follow) is read whole from the member running it (the
spool file read in place) and from another member (asked over the member links, one
F_LOG_PUT of `log_frame_bytes_max` bytes per round trip).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import machine  # noqa: E402
from tests.helpers import make_fleet, start_all, submit_anywhere, wait_until  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mib", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    size = args.mib << 20
    print(f"machine: {machine()}")
    with tempfile.TemporaryDirectory() as top:
        members = make_fleet(os.path.join(top, "fleet"), voters=3)
        gate = os.path.join(top, "gate")
        try:
            start_all(members)
            submit_anywhere(members, {
                "argv": ["sh", "-c", f"head -c {size} /dev/urandom; "
                                     f"while [ ! -e {gate} ]; do sleep 0.05; done"],
                "items": [""], "id": "bench"})

            def runner():
                for m in members:
                    it = m.request("GET", "/jobs/bench?items=1")[1]["items"][0]
                    if it["state"] == "leased":
                        return it["member"]
                return None
            name = wait_until(runner, 60, "the item leased")
            here = next(m for m in members if m.name == name)
            other = next(m for m in members if m.name != name)

            def written() -> bool:
                with urllib.request.urlopen(
                        f"{other.url}/jobs/bench/items/0/stdout?offset={size - 1}") as r:
                    return len(r.read()) == 1
            wait_until(written, 120, "the whole output written")
            for where, m in (("the running member", here), ("another member", other)):
                for _ in range(args.rounds):
                    t0 = time.monotonic()
                    got = 0
                    with urllib.request.urlopen(f"{m.url}/jobs/bench/items/0/stdout",
                                                timeout=300) as r:
                        while chunk := r.read(1 << 20):
                            got += len(chunk)
                    dt = time.monotonic() - t0
                    assert got == size, got
                    print(f"from {where}: {got >> 20} MiB in {dt:.2f} s, "
                          f"{got / dt / 1e6:.0f} MB/s")
            open(gate, "w").close()
        finally:
            for m in members:
                m.stop()


if __name__ == "__main__":
    main()
