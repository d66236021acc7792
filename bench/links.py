"""The cost of sealing member links: frames/s and MB/s.

1. In one thread, no sockets: a frame packed, protected and checked, then unpacked, for small
   frames (~200 B body) and 1 MiB blob frames; MAC only (blake3 keyed over header and body, as
   the MJF1 frames of before did) against sealed (ChaCha20-Poly1305, as `frames.Session`).
2. Through a pair of real `Links` on 127.0.0.1: one sends N frames, the other counts them; the
   time from the first send to the last frame handed to `on_frame`.

    python bench/links.py                     # this tree
    python bench/links.py --tree /work/main   # part 2 against another checkout (MJF1 links)

With `--old-frames FILE` (the MJF1 codec, e.g. `git show a299d1d:meshjobs/frames.py > FILE`),
part 1 also runs that codec's `encode` and `FrameDecoder` (with its clock check and nonce cache),
the fair comparison with `Session`; the inline MAC-only loop is the floor either way.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SMALL = {"k": "result", "job": "j-000123", "i": 17, "rc": 0, "ms": 12, "out": "x" * 140}
BLOB = {"d": "b" * 64, "o": None, "size": 1 << 20, "off": 0, "data": b"\xa5" * (1 << 20),
        "last": True}


def _rate(n: int, seconds: float, size: int) -> str:
    return f"{n / seconds:,.0f} frames/s, {n * size / seconds / 1e6:,.1f} MB/s"


def _load(path: str) -> object:
    import importlib.util

    from meshjobs import limits

    # The MJF1 codec's own limits, gone from this tree's limits.py.
    for name, value in (("nonce_cache_max", 262_144), ("frame_clock_skew_ms_max", 30_000)):
        if not hasattr(limits, name):
            setattr(limits, name, value)

    spec = importlib.util.spec_from_file_location("frames_mjf1", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look themselves up there
    spec.loader.exec_module(mod)
    return mod


def pure(rounds: int, old_frames: str | None) -> None:
    import blake3
    import msgpack

    from meshjobs.frames import FrameType, Hello, Role, Session

    secret = os.urandom(32)
    d, a = Session(secret, Role.DIALLER), Session(secret, Role.ACCEPTOR)
    a.receive_data(d.hello({"name": "d", "to": "a"}, os.urandom(32), os.urandom(32)))
    assert isinstance(a.next_event(), Hello)
    d.receive_data(a.challenge({"name": "a", "to": "d"}, os.urandom(32), os.urandom(32)))
    assert isinstance(d.next_event(), Hello)
    a.receive_data(d.proof())
    a.next_event()
    header = b"MJF1" + bytes(30)

    def mac_only(body: dict) -> int:
        packed = msgpack.packb(body, use_bin_type=True)
        h = blake3.blake3(key=secret)
        h.update(header)
        h.update(packed)
        frame = header + packed + h.digest()
        # The receiver: MAC again, compare, unpack.
        body_bytes = frame[len(header):-32]
        h2 = blake3.blake3(key=secret)
        h2.update(frame[:len(header)])
        h2.update(body_bytes)
        assert h2.digest() == frame[-32:]
        msgpack.unpackb(body_bytes, raw=False)
        return len(frame)

    def sealed(body: dict) -> int:
        frame = d.seal(FrameType.F_BLOB_PUT, body)
        a.receive_data(frame)
        a.next_event()
        return len(frame)

    cases = [("MAC only, inline", mac_only)]
    if old_frames:
        old = _load(old_frames)
        decoder = old.FrameDecoder(secret)  # type: ignore[attr-defined]

        def mjf1(body: dict) -> int:
            now = int(time.time() * 1000)
            frame = old.encode(old.FrameType.F_BLOB_PUT,  # type: ignore[attr-defined]
                               body, secret, now, os.urandom(16))
            decoder.receive_data(frame)
            decoder.next_frame(now)
            return len(frame)

        cases.append(("MJF1 codec", mjf1))
    cases.append(("MJF2 sealed", sealed))

    def handshake() -> None:
        d, a = Session(secret, Role.DIALLER), Session(secret, Role.ACCEPTOR)
        a.receive_data(d.hello({"name": "d", "to": "a"}, os.urandom(32), os.urandom(32)))
        a.next_event()
        d.receive_data(a.challenge({"name": "a", "to": "d"}, os.urandom(32), os.urandom(32)))
        d.next_event()
        a.receive_data(d.proof())
        a.next_event()

    n = max(50, rounds)
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(n):
            handshake()
        best = min(best, time.perf_counter() - t0)
    print(f"pure handshake (both ends, X25519 included): {best / n * 1e6:,.0f} us")

    for name, body, n in (("small", SMALL, rounds * 100), ("1 MiB", BLOB, max(20, rounds // 10))):
        for label, fn in cases:
            size = fn(body)
            best = float("inf")
            for _ in range(3):
                t0 = time.perf_counter()
                for _ in range(n):
                    fn(body)
                best = min(best, time.perf_counter() - t0)
            print(f"pure {name:6} {label:16} {size:>8} B/frame  {_rate(n, best, size)}")


def real(n_small: int, n_blob: int) -> None:
    from meshjobs.frames import FrameType
    from meshjobs.links import Links

    secret = os.urandom(32)
    got = [0]
    done = threading.Event()
    target = [0]

    def on_frame(peer: str, frame: object) -> None:
        got[0] += 1
        if got[0] >= target[0]:
            done.set()

    a = Links("a", "ba", ("127.0.0.1", 0), secret, on_frame=lambda p, f: None)
    b = Links("b", "bb", ("127.0.0.1", 0), secret, on_frame=on_frame)
    threads = [threading.Thread(target=x.run, daemon=True) for x in (a, b)]
    for t in threads:
        t.start()
    a.connect("b", b.address)
    while not a.peers().get("b", {}).get("up"):
        time.sleep(0.01)
    try:
        for name, body, n, batch in (("small", SMALL, n_small, 256), ("1 MiB", BLOB, n_blob, 4)):
            best = float("inf")
            for _ in range(3):
                got[0] = 0
                target[0] = n
                done.clear()
                t0 = time.perf_counter()
                left = n
                while left:
                    k = min(batch, left)
                    taken = a.send_batch("b", [(FrameType.F_BLOB_PUT, body)] * k)
                    left -= taken
                    if taken < k:
                        time.sleep(0.001)
                assert done.wait(120), f"{got[0]} of {n} frames arrived"
                best = min(best, time.perf_counter() - t0)
            size = len(__import__("msgpack").packb(body, use_bin_type=True))
            print(f"links {name:6} {n:>7} frames  {_rate(n, best, size)} (body bytes)")
    finally:
        a.stop()
        b.stop()
        for t in threads:
            t.join(5)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--tree", default=ROOT, help="the checkout whose meshjobs to measure")
    p.add_argument("--rounds", type=int, default=200)
    p.add_argument("--old-frames", help="the MJF1 frames.py, to compare its codec")
    args = p.parse_args()
    sys.path.insert(0, os.path.abspath(args.tree))
    import meshjobs

    print(f"meshjobs from {os.path.dirname(meshjobs.__file__)}")
    try:
        from bench.common import machine
        print(machine())
    except ImportError:
        pass
    from meshjobs import frames
    if hasattr(frames, "Session"):
        pure(args.rounds, args.old_frames)
    real(args.rounds * 100, max(50, args.rounds))


if __name__ == "__main__":
    main()
