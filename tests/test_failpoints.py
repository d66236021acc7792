"""The failpoint spec: counts, ranges, sleeps, and refusal of anything malformed."""

from __future__ import annotations

import pytest

from meshjobs.failpoints import Failpoints


def _outcomes(fp: Failpoints, name: str, n: int) -> list[bool]:
    out = []
    for _ in range(n):
        try:
            fp.hit(name)
            out.append(True)
        except OSError:
            out.append(False)
    return out


def test_from_nth_hit_on() -> None:
    """name=N fails on the Nth hit and every hit after it."""
    assert _outcomes(Failpoints("dump.fsync=3"), "dump.fsync", 6) == [True, True] + [False] * 4


def test_range_fails_then_passes() -> None:
    """name=N..M fails on hits N to M only: a disk whose trouble passes."""
    fp = Failpoints("dump.fsync=2..4,disk.full=1..1")
    assert _outcomes(fp, "dump.fsync", 6) == [True, False, False, False, True, True]
    assert _outcomes(fp, "disk.full", 3) == [False, True, True]
    assert fp.hits("dump.fsync") == 6


@pytest.mark.parametrize("spec", [
    "dump.fsync=0", "dump.fsync=3..2", "dump.fsync=1..", "dump.fsync=..3", "dump.fsync=1...3",
    "dump.fsync=a..b", "dump.fsync=1..3..5", "no.such.point=1", "dump.fsync=1,dump.fsync=2",
    "dump.fsync", "Dump.fsync=1", "dump.fsync=-1", "dump.fsync=1.." + "9" * 5000 + "x",
])
def test_malformed_specs_are_refused(spec: str) -> None:
    """A malformed spec is a ValueError, never a silently ignored fault."""
    with pytest.raises(ValueError):
        Failpoints(spec)
