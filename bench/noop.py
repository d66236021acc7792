"""The no-op item of the benchmarks' python-pool workload: `bench.noop:run` takes an item's
stdin bytes and returns empty output."""

from __future__ import annotations


def run(data: bytes = b"") -> bytes:
    return b""
