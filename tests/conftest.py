"""Shared fixtures: real meshd processes, always stopped by pid."""

from __future__ import annotations

import os

import pytest

from tests.helpers import Meshd


@pytest.fixture
def meshd_factory(tmp_path):
    started: list[Meshd] = []

    def make(name: str = "m1", slots: int = 2, env: dict[str, str] | None = None,
             data: str | None = None, start: bool = True) -> Meshd:
        m = Meshd(data or os.path.join(str(tmp_path), name), slots=slots, name=name, env=env)
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
