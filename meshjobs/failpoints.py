"""Deterministic fault injection: named points that fail on their Nth hit, off unless configured.

A spec is a comma-separated list of `name=N` pairs, such as `journal.fsync=3,blob.fsync=10`: the
point `name` fails on its Nth hit and on every hit after it, raising `OSError(EIO)` as a dying disk
would. A pair `name=N..M` fails on hits N to M only, as a disk whose trouble passes (an fsync that
fails a few times and then works, a disk that is full for a while). A pair `name=sleep:MS` instead
makes every hit of `name` sleep MS milliseconds, as a slow disk would. An empty spec (the default) turns every point off, and then `hit` costs one dict lookup.

Rules:
- Rule 1: the spec is checked whole when it is read; a malformed one is a `ValueError`, never a
  silently ignored fault.
- Rule 2: counting is exact across threads (one lock around the counters), so a test that says
  "the third fsync fails" gets exactly that.
"""

from __future__ import annotations

import errno
import os
import re
import threading
import time

ENV_VAR = "MESHJOBS_FAILPOINTS"

# Every point that some module passes through. A spec naming any other point is refused, so a
# misspelt name fails the test that uses it instead of injecting nothing. A module that adds a
# point adds its name here.
# `disk.full` is passed by every check of free space (meshjobs/diskspace.py): when it fails, the
# disk reads as full. `secret.fsync` is the fsync of a new fleet secret at first start.
# `journal.segment_fsync` and `journal.segment_delete` are passed by the dump writer after its
# dump is in place: before it fsyncs the new journal segment and the folder, and before it deletes
# the segments the dump made redundant (journal.retire_segments).
# `running.write` is each write of the log of running processes (meshjobs/leftovers.py).
KNOWN_POINTS = frozenset({"journal.fsync", "dump.fsync", "blob.fsync", "blob.write", "disk.full",
                          "secret.fsync", "journal.segment_fsync", "journal.segment_delete",
                          "running.write"})

# A point name is dotted words, as the places that call `hit` name them.
_NAME_RE = re.compile(r"^[a-z][a-z0-9_]*(\.[a-z][a-z0-9_]*)*$")


class Failpoints:
    """Named fault points, each failing from its Nth hit on (or on hits N to M), or slowed on
    every hit."""

    def __init__(self, spec: str = "") -> None:
        self._due, self._until, self._sleep_s = _parse(spec)
        self._hits: dict[str, int] = {}
        self._lock = threading.Lock()
        self.spec = spec

    @classmethod
    def from_env(cls) -> Failpoints:
        """The failpoints named by the environment variable MESHJOBS_FAILPOINTS (none if unset)."""
        return cls(os.environ.get(ENV_VAR, ""))

    @property
    def active(self) -> bool:
        """True when at least one point is configured."""
        return bool(self._due) or bool(self._sleep_s)

    def hit(self, name: str) -> None:
        """Count one pass through point `name`; sleep when it is slowed; raise OSError(EIO) once
        it is due."""
        due = self._due.get(name)
        if due is None:
            pause_s = self._sleep_s.get(name)
            if pause_s is not None:
                with self._lock:
                    self._hits[name] = self._hits.get(name, 0) + 1
                time.sleep(pause_s)
            return
        with self._lock:
            count = self._hits.get(name, 0) + 1
            self._hits[name] = count
        if count >= due and count <= self._until.get(name, count):
            raise OSError(errno.EIO, f"injected failure at {name}")

    def plan(self, *names: str) -> Failpoints:
        """Count one pass through each point of `names` now, and return a Failpoints whose
        `hit(name)` does what this pass does (nothing, sleep, or raise), to be done later: a
        forked dump writer takes its passes from the member, which keeps the count (the child's
        own copy of the counters would start from the member's every time)."""
        planned = Failpoints()
        for name in names:
            due = self._due.get(name)
            if due is None:
                pause_s = self._sleep_s.get(name)
                if pause_s is not None:
                    with self._lock:
                        self._hits[name] = self._hits.get(name, 0) + 1
                    planned._sleep_s[name] = pause_s
                continue
            with self._lock:
                count = self._hits.get(name, 0) + 1
                self._hits[name] = count
            if count >= due and count <= self._until.get(name, count):
                planned._due[name] = 1
        return planned

    def hits(self, name: str) -> int:
        """How many times a configured point has been passed (0 for an unconfigured one)."""
        with self._lock:
            return self._hits.get(name, 0)

    def __repr__(self) -> str:
        return f"Failpoints({self.spec!r})"


def _parse(spec: str) -> tuple[dict[str, int], dict[str, int], dict[str, float]]:
    due: dict[str, int] = {}
    until: dict[str, int] = {}
    sleep_s: dict[str, float] = {}
    for part in spec.split(","):
        part = part.strip()
        if not part:
            continue
        name, sep, value = part.partition("=")
        name, value = name.strip(), value.strip()
        kind, colon, ms = value.partition(":")
        ms = ms.strip()
        sleeps = bool(colon) and kind.strip() == "sleep" and ms.isdigit()
        first, dots, last = value.partition("..")
        counts = first.isdigit() and int(first) >= 1 and (
            not dots or (last.isdigit() and int(last) >= int(first)))
        if not sep or not _NAME_RE.match(name) or not (sleeps or counts):
            raise ValueError(
                f"bad failpoint {part!r} in {spec!r}: expected name=N with a dotted lowercase "
                f"name and N >= 1, for example 'journal.fsync=3', name=N..M with M >= N, for "
                f"example 'dump.fsync=1..3', or name=sleep:MS, for example 'blob.write=sleep:200'"
            )
        if name not in KNOWN_POINTS:
            raise ValueError(
                f"unknown failpoint {name!r} in {spec!r}; known points: {sorted(KNOWN_POINTS)}"
            )
        if name in due or name in sleep_s:
            raise ValueError(f"failpoint {name!r} is named twice in {spec!r}")
        if sleeps:
            sleep_s[name] = int(ms) / 1000
        else:
            due[name] = int(first)
            if dots:
                until[name] = int(last)
    return due, until, sleep_s
