"""Shared fixtures: real meshd processes, always stopped by pid."""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import sys
import tempfile
from collections.abc import Iterator
from typing import Any

import pytest
import structlog

from tests.helpers import LinksMember, Meshd

# Logs of the parts a test runs in this process (an HTTP API, a driver) go to the real stderr,
# as a member's do: never into a command's captured stdout (meshctl prints ids there).
structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.__stderr__))

# Every test's folders live in one folder of this run, directly under /tmp, and a test's own
# folder goes when the test passed (a failed test's stays, and the run's folder with it). Not
# pytest's tmp_path: its folder for a run gathers a folder per test, thousands by the end, and
# every folder around a member's data folder is one rule of the wall around its items, given
# at each item's start (meshjobs/wall.py, Rules 2 and 6).
_RUN_DIR = pathlib.Path(tempfile.mkdtemp(prefix="meshjobs-tests-", dir="/tmp"))
_failed: list[str] = []


class _Folders:
    """What the suite uses of pytest's TempPathFactory: `mktemp(name)`, a new folder each call."""

    def mktemp(self, basename: str, numbered: bool = True) -> pathlib.Path:
        return pathlib.Path(tempfile.mkdtemp(prefix=_short(basename) + "-", dir=_RUN_DIR))

    def getbasetemp(self) -> pathlib.Path:
        return _RUN_DIR


def _short(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name)[:40]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        _failed.append(item.nodeid)
        item.stash.setdefault(_FAILED, True)


_FAILED = pytest.StashKey[bool]()


def pytest_sessionfinish(session, exitstatus):
    if not _failed and exitstatus == 0:
        shutil.rmtree(_RUN_DIR, ignore_errors=True)


@pytest.fixture(scope="session")
def tmp_path_factory() -> _Folders:
    return _Folders()


@pytest.fixture
def tmp_path(request) -> Iterator[pathlib.Path]:
    path = _Folders().mktemp(request.node.name)
    yield path
    if not request.node.stash.get(_FAILED, False):
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def meshd_factory(tmp_path_factory):
    # The data folders live beside the test's tmp_path, not in it: items are walled off from
    # the folders around meshd's data folder (meshjobs/wall.py, Rule 3), and tests' items write
    # into tmp_path.
    where = str(tmp_path_factory.mktemp("members"))
    started: list[Meshd] = []

    def make(name: str = "m1", slots: int = 2, env: dict[str, str] | None = None,
             data: str | None = None, start: bool = True) -> Meshd:
        m = Meshd(data or os.path.join(where, name), slots=slots, name=name, env=env)
        started.append(m)
        if start:
            m.start()
        return m

    yield make
    for m in started:
        m.stop()


@pytest.fixture
def meshd(meshd_factory) -> Meshd:
    return meshd_factory()


@pytest.fixture
def members():
    """Makes member links (`LinksMember(name, **kw)`), each stopped at the end of the test."""
    made: list[LinksMember] = []

    def make(name: str, **kw: Any) -> LinksMember:
        m = LinksMember(name, **kw)
        made.append(m)
        return m

    try:
        yield make
    finally:
        for m in made:
            m.stop()
