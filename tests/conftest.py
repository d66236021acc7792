"""Shared fixtures: real meshd processes, always stopped by pid."""

from __future__ import annotations

import os
import sys
from typing import Any

import pytest
import structlog

from tests.helpers import LinksMember, Meshd

# Logs of the parts a test runs in this process (an HTTP API, a driver) go to the real stderr,
# as a member's do: never into a command's captured stdout (meshctl prints ids there).
structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.__stderr__))


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
