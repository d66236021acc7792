"""Blob store write path against raw LMDB, side by side in one run, on the same disk.

    python bench/blobs.py [--quick] [--dir DIR]

For 100 B, 64 KB and 16 MB payloads, 8 producer threads put distinct payloads into, each in a
fresh temporary folder:
  (a) raw LMDB, 1,000 puts per synced write transaction (LMDB's own sync on commit);
  (b) raw LMDB, one put per synced write transaction;
  (c) BlobWriters over LmdbBlobStore: each producer keeps up to 1,000 puts (at most 64 MB) in
      flight and counts a put done when its Future says it is durable.
Raw LMDB keys each payload by a 16-byte id and hashes nothing; (c) hashes each payload (blake3),
checksums its chunks and keeps its record, as the store does. The figures are puts/s and MB/s
from the moment all producers start to the moment the last put is durable. Also: fsyncs per
1,000 puts of (c) at 100 B, under that load, and (c) at 100 B once more with a deeper first
generation for Python's garbage collector (which small puts are most sensitive to).

A full run (without --quick) replaces the `## Blob store` section of bench/RESULTS.md with its
table. The goals: (c)/(a) at 64 KB at least 0.70; (c)/(b) at 100 B at least 20.
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import statistics
import struct
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import lmdb  # noqa: E402
import structlog  # noqa: E402

from bench.common import machine  # noqa: E402
from blobstore import BlobWriters, LmdbBlobStore  # noqa: E402

PRODUCERS = 8
RAW_BATCH = 1000  # puts per synced transaction in (a)
WINDOW_PUTS = 1000  # puts one producer keeps in flight in (c)
WINDOW_BYTES = 64 << 20  # and at most this many bytes of them
SIZES = {"100 B": 100, "64 KB": 64 << 10, "16 MB": 16 << 20}
_ID = struct.Struct(">QQ")
REPEATS = 5  # rounds of each case in a full run
GC_THRESHOLD = 20_000  # the collector's first generation, for the extra (c) round at 100 B

# Puts per producer: (a and c, b). Enough for steady figures; the whole run stays near 3 minutes.
FULL = {"100 B": (12500, 1000), "64 KB": (1000, 250), "16 MB": (6, 6)}
QUICK = {"100 B": (500, 60), "64 KB": (100, 25), "16 MB": (2, 2)}


def payloads(size: int, count: int, seed: int) -> list[bytes]:
    """`count` distinct payloads of `size` bytes: a unique id in front of shared random bytes,
    so that a content-addressed store keeps each one."""
    body = os.urandom(size)
    return [_ID.pack(seed, i) + body[_ID.size :] if size >= _ID.size else os.urandom(size)
            for i in range(count)]


def timed(work: Callable[[int], None]) -> float:
    """Run work(n) in PRODUCERS threads started together; seconds until all have finished."""
    go = threading.Barrier(PRODUCERS + 1)
    errors: list[BaseException] = []

    def body(n: int) -> None:
        go.wait()
        try:
            work(n)
        except BaseException as e:  # reported below; a benchmark that failed has no figure
            errors.append(e)

    threads = [threading.Thread(target=body, args=(n,)) for n in range(PRODUCERS)]
    for t in threads:
        t.start()
    go.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - t0
    if errors:
        raise errors[0]
    return elapsed


def raw_lmdb(folder: str, data: list[list[bytes]], per_txn: int) -> float:
    env = lmdb.open(folder, map_size=64 << 30, sync=True, metasync=True)

    def work(n: int) -> None:
        mine = data[n]
        for start in range(0, len(mine), per_txn):
            with env.begin(write=True) as txn:
                for i in range(start, min(start + per_txn, len(mine))):
                    txn.put(_ID.pack(n, i), mine[i])

    try:
        return timed(work)
    finally:
        env.close()


def writers(folder: str, data: list[list[bytes]], size: int) -> tuple[float, dict[str, int]]:
    store = LmdbBlobStore(folder, map_bytes=64 << 30)
    w = BlobWriters(store, mem_max_bytes=8 << 30)
    threads = [threading.Thread(target=body, name=name) for name, body in w.targets()]
    for t in threads:
        t.start()
    window = max(1, min(WINDOW_PUTS, WINDOW_BYTES // size))

    def work(n: int) -> None:
        flying: deque[Future[str]] = deque()
        for p in data[n]:
            if len(flying) >= window:
                flying.popleft().result()
            flying.append(w.put(p))
        for f in flying:
            f.result()

    try:
        elapsed = timed(work)
        stats = w.stats()
    finally:
        w.close()
        for t in threads:
            t.join()
        store.close()
    return elapsed, stats


def run(counts: dict[str, tuple[int, int]], repeats: int, parent: str | None) -> list[dict]:
    rows = []
    for label, size in SIZES.items():
        n_batch, n_single = counts[label]
        data = [payloads(size, n_batch, seed) for seed in range(PRODUCERS)]
        single = [d[:n_single] for d in data]
        row: dict = {"label": label, "size": size}
        # The modes take turns, REPEATS rounds, each time in a fresh folder; a figure is the
        # median of its rounds, as the disk's speed wanders from one second to the next.
        modes = ["a", "b", "c"] + (["c_gc"] if size <= 1024 else [])
        times: dict[str, list[float]] = {m: [] for m in modes}
        fsyncs: list[int] = []
        for _ in range(repeats):
            for mode in modes:
                folder = tempfile.mkdtemp(prefix=f"blobbench-{mode}-", dir=parent)
                try:
                    if mode == "a":
                        elapsed = raw_lmdb(folder, data, RAW_BATCH)
                    elif mode == "b":
                        elapsed = raw_lmdb(folder, single, 1)
                    elif mode == "c":
                        elapsed, stats = writers(folder, data, size)
                        fsyncs.append(stats["fsyncs"])
                    else:
                        # The same with the collector's first generation 20,000 objects deep
                        # rather than 700: each put's Future is a handful of objects that live
                        # until durable, and the default threshold rescans them over and over.
                        old = gc.get_threshold()
                        gc.set_threshold(GC_THRESHOLD, 50, 50)
                        try:
                            elapsed, _ = writers(folder, data, size)
                        finally:
                            gc.set_threshold(*old)
                finally:
                    shutil.rmtree(folder, ignore_errors=True)
                times[mode].append(elapsed)
        rates: dict[str, list[float]] = {}
        for mode in modes:
            total = (n_single if mode == "b" else n_batch) * PRODUCERS
            rates[mode] = [total / t for t in times[mode]]
            rate = statistics.median(rates[mode])
            row[mode] = (rate, rate * size / 1e6)
            spread = ", ".join(f"{r:,.0f}" for r in rates[mode])
            print(f"  {label} ({mode}): {total} puts; puts/s per round: {spread}", file=sys.stderr)
        # A ratio pairs the modes of one round, which ran within seconds of each other, and
        # is the median over the rounds.
        for mode in modes[2:]:
            for base in "ab":
                row[f"{mode}/{base}"] = statistics.median(
                    c / r for c, r in zip(rates[mode], rates[base], strict=True)
                )
        row["fsyncs_per_1000"] = 1000 * statistics.median(fsyncs) / (n_batch * PRODUCERS)
        rows.append(row)
    return rows


def table(rows: list[dict]) -> str:
    lines = [
        "| payload | (a) raw LMDB, 1,000/synced txn | (b) raw LMDB, 1/synced txn "
        "| (c) BlobWriters | (c)/(a) | (c)/(b) |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        cells = [f"{r[m][0]:,.0f} puts/s, {r[m][1]:,.1f} MB/s" for m in "abc"]
        lines.append(
            f"| {r['label']} | {' | '.join(cells)} "
            f"| {r['c/a']:.2f} | {r['c/b']:.1f}× |"
        )
    by = {r["label"]: r for r in rows}
    ca = by["64 KB"]["c/a"]
    cb = by["100 B"]["c/b"]
    small = by["100 B"]
    cgb = small["c_gc/b"]
    lines += [
        "",
        "| goal | measured | met |",
        "|---|---|---|",
        f"| (c)/(a) at 64 KB ≥ 0.70 | {ca:.2f} | {'yes' if ca >= 0.70 else 'no'} |",
        f"| (c)/(b) at 100 B ≥ 20× | {cb:.1f}× | {'yes' if cb >= 20 else 'no'} |",
        f"| fsyncs per 1,000 puts of (c) at 100 B | {small['fsyncs_per_1000']:.1f} | |",
        "",
        f"With `gc.set_threshold({GC_THRESHOLD}, 50, 50)` (the default is 700, 10, 10), (c) at "
        f"100 B does {small['c_gc'][0]:,.0f} puts/s, {cgb:.1f}× (b).",
    ]
    return "\n".join(lines)


def record(text: str) -> None:
    """Replace (or add) the `## Blob store` section of bench/RESULTS.md."""
    path = os.path.join(ROOT, "bench", "RESULTS.md")
    with open(path) as f:
        old = f.read()
    head, mark, rest = old.partition("\n## Blob store")
    tail = ""
    if mark:
        nxt = rest.find("\n## ")
        tail = rest[nxt:] if nxt >= 0 else ""
    new = head.rstrip("\n") + "\n\n" + text.rstrip("\n") + "\n" + tail
    with open(path, "w") as f:
        f.write(new)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--quick", action="store_true", help="a few puts per case; records nothing")
    ap.add_argument("--dir", default=None, help="where the temporary stores go (default: $TMPDIR)")
    a = ap.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(30))
    where = os.path.abspath(a.dir or tempfile.gettempdir())
    print(f"machine: {machine()}; stores under {where}", file=sys.stderr)
    t0 = time.perf_counter()
    rows = run(QUICK if a.quick else FULL, 1 if a.quick else REPEATS, a.dir)
    text = table(rows)
    print(text)
    print(f"(whole run: {time.perf_counter() - t0:.0f} s)", file=sys.stderr)
    if not a.quick:
        counts = ", ".join(
            f"{label}: {FULL[label][0] * PRODUCERS:,} puts for (a) and (c), "
            f"{FULL[label][1] * PRODUCERS:,} for (b)"
            for label in SIZES
        )
        record(
            "## Blob store (`python bench/blobs.py`)\n\n"
            f"Machine: {machine()}; stores in temporary folders under {where}, all on one disk.\n"
            f"8 producer threads; {counts}; each figure the median of {REPEATS} rounds, the "
            "modes taking turns, and each ratio the median of the rounds' own ratios. (a) and (b) are raw LMDB keyed by a 16-byte id, synced "
            "by LMDB on commit; (c) is `BlobWriters` over `LmdbBlobStore` (blake3 digests, chunk "
            "checksums, group commit), a put counted when its Future says it is durable.\n\n"
            + text
        )


if __name__ == "__main__":
    main()
