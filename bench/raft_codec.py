"""Cost of one Raft message on the wire, both ends, A/B in one process (no network, no fsync):
pysyncobj's TCP transport (pickle, zlib level 3, Fernet with the fleet secret, length prefix)
against meshjobs' (raftwire's msgpack body, sealed with ChaCha20-Poly1305 by a frames.Session).

    python3 bench/raft_codec.py

Prints microseconds per message (send + receive) for a heartbeat, an acknowledgement, and
AppendEntries of 1 and of 20 entries of a typical submit entry (~300 bytes of msgpack).
"""

from __future__ import annotations

import os
import pickle
import struct
import sys
import time
import zlib

import msgpack

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pysyncobj.encryptor import getEncryptor  # noqa: E402

from meshjobs import raftwire  # noqa: E402
from meshjobs.frames import FrameType, Hello, Ready, Role, Session  # noqa: E402


def entry(n: int) -> tuple[bytes, int, int]:
    raw = msgpack.packb({"op": "submit", "job": {"id": f"job-{n:06d}", "argv": ["/bin/true"],
                                                 "env": {"A": "b" * 40}, "items": 1,
                                                 "pool": "default", "retries": 0},
                         "at_ms": 1_760_000_000_000 + n, "by": "m1", "token": n})
    return bytes([0]) + pickle.dumps((3, (raw,))), 100 + n, 7


def messages() -> dict[str, dict]:
    base = {"type": "append_entries", "term": 7, "commit_index": 99, "prevLogIdx": 99,
            "prevLogTerm": 7}
    return {
        "heartbeat": {**base, "entries": []},
        "ack (next_node_idx)": {"type": "next_node_idx", "next_node_idx": 101, "reset": False,
                                "success": True},
        "append, 1 entry": {**base, "entries": [entry(1)]},
        "append, 20 entries": {**base, "entries": [entry(i) for i in range(20)]},
    }


def old_pair(secret: bytes):
    enc = getEncryptor(secret)
    rand_key = os.urandom(32)
    last = [0]

    def roundtrip(message: dict) -> dict:
        data = zlib.compress(pickle.dumps((rand_key, message)), 3)
        data = enc.encrypt_at_time(data, int(time.monotonic()))
        wire = struct.pack("i", len(data)) + data
        n = struct.unpack("i", wire[:4])[0]
        data = wire[4:4 + n]
        ts = enc.extract_timestamp(data)
        assert ts >= last[0]
        last[0] = ts
        key, got = pickle.loads(zlib.decompress(enc.decrypt(data)))
        assert key == rand_key
        return got

    return roundtrip


def new_pair(secret: bytes):
    d, a = Session(secret, Role.DIALLER), Session(secret, Role.ACCEPTOR)
    a.receive_data(d.hello({"raft": "x"}, os.urandom(32), os.urandom(32)))
    assert isinstance(a.next_event(), Hello)
    d.receive_data(a.challenge({"raft": "y"}, os.urandom(32), os.urandom(32)))
    assert isinstance(d.next_event(), Hello)
    a.receive_data(d.proof())
    assert isinstance(a.next_event(), Ready)

    def roundtrip(message: dict) -> dict:
        wire = d.seal(FrameType.F_RAFT, raftwire.encode(message))
        a.receive_data(wire)
        return raftwire.decode(a.next_event().body)

    return roundtrip


def per_message_us(roundtrip, message: dict, n: int) -> float:
    roundtrip(message)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            roundtrip(message)
        best = min(best, (time.perf_counter() - t0) / n)
    return best * 1e6


def main() -> None:
    secret = os.urandom(32)
    old, new = old_pair(secret), new_pair(secret)
    print("| message | pysyncobj (pickle+zlib+Fernet) | meshjobs (msgpack+ChaCha20) | old ÷ new |")
    print("|---|---|---|---|")
    for name, message in messages().items():
        n = 200 if "20" in name else 2000
        assert new(message) == old(message)
        o, w = per_message_us(old, message, n), per_message_us(new, message, n)
        print(f"| {name} | {o:.1f} µs | {w:.1f} µs | {o / w:.1f} |")


if __name__ == "__main__":
    main()
