"""How meshjobs holds up as the fleet and the table grow: one command, four measurements.

    python bench/scale.py sim [...]      5 voters + 200 workers in one process (real node code)
    python bench/scale.py real [...]     3 voters + 30 workers as real meshd processes
    python bench/scale.py million [...]  a table of 1,000,000 finished items
    python bench/scale.py --help         this text; `python bench/scale.py sim --help` for each

Each part lives in its own module (`bench/scale_sim.py`, `bench/scale_real.py`,
`bench/scale_million.py`) with a `main(argv)`; the figures are in `bench/RESULTS.md` and what
they mean for larger fleets in `docs/scale.md`.
"""

from __future__ import annotations

import importlib
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PARTS = {"sim": "bench.scale_sim", "real": "bench.scale_real", "million": "bench.scale_million"}


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0 if argv else 2
    part = PARTS.get(argv[0])
    if part is None:
        print(f"scale: unknown part {argv[0]!r}: use one of {', '.join(PARTS)}", file=sys.stderr)
        return 2
    return int(importlib.import_module(part).main(argv[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
