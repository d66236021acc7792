"""The node's shape: one handler per event type, one gate class per effect type, and one
dispatch per edge; a type nobody handles is a bug of ours and crashes."""

from __future__ import annotations

import dataclasses
import inspect
import random
from dataclasses import dataclass

import pytest

from meshjobs.node import JobNode, NodeConfig, Tick, events
from meshjobs.node.ready import AFTER_SYNC, AT_ONCE
from meshjobs.table import JobTable


def _node() -> JobNode:
    return JobNode(JobTable(), NodeConfig(member="m1", boot="b1"), random.Random(1))


def _defined_in_events() -> set[type]:
    return {c for _n, c in inspect.getmembers(events, inspect.isclass)
            if c.__module__ == events.__name__ and dataclasses.is_dataclass(c)}


def test_every_event_type_has_a_handler() -> None:
    """Rule: `step` looks an event's handler up by its type; the table has exactly one handler
    for each event type of node/events.py, and nothing else."""
    assert set(_node()._handlers) == set(events.EVENTS)
    assert len(set(events.EVENTS)) == len(events.EVENTS)


def test_every_type_in_events_is_an_event_an_effect_or_config() -> None:
    """Rule: a new type in node/events.py is listed as an event (then it needs a handler) or an
    effect (then the gate must sort it), so that none is forgotten."""
    config = {events.Pool, events.NodeConfig}
    assert _defined_in_events() == set(events.EVENTS) | set(events.EFFECTS) | config
    assert not set(events.EVENTS) & set(events.EFFECTS)


def test_every_effect_type_is_sorted_by_the_gate() -> None:
    """Rule: every effect is at once, after the sync, or an entry (Propose)."""
    assert set(events.EFFECTS) == set(AT_ONCE) | set(AFTER_SYNC) | {events.Propose}


@dataclass(frozen=True)
class _Unknown:
    now_ms: int


def test_an_unknown_event_crashes() -> None:
    """Rule: an event of a type the node does not know is our bug: it crashes loudly, whatever
    fields it has, and changes nothing."""
    node = _node()
    node.step(Tick(5))
    with pytest.raises(AssertionError, match="no handler"):
        node.step(_Unknown(10))
    with pytest.raises(AssertionError, match="no handler"):
        node.step({"now_ms": 10})
    assert node.now_ms == 5


def test_a_subclass_of_an_event_is_not_taken_for_it() -> None:
    """Rule: the lookup is by exact type: a look-alike of an event is not handled as it."""

    @dataclass(frozen=True)
    class LateTick(Tick):
        pass

    node = _node()
    with pytest.raises(AssertionError, match="no handler"):
        node.step(LateTick(10))


def test_driver_runs_the_node_run_and_reports_the_node_end() -> None:
    """One type per concept: the driver takes the node's `Run` effect and reports the node's
    `ItemEnded` event, so that the jobs thread hands both on without copying them."""
    from meshjobs import driver

    assert driver.RunItem is events.Run and driver.ItemEnd is events.ItemEnded
    run = events.Run("j", 2, 3, ["true"], {}, None, None, None)
    assert run.key == ("j", 2, 3)


def test_state_names_are_defined_once() -> None:
    """One definition of the item state names and of a job's final states (control.py), which
    the table, the simulator and the clients use."""
    from meshjobs import cli, control, sim, table, webui
    from meshjobs.watchplan import END_STATES

    assert table.ITEM_STATE_NAMES is control.ITEM_STATES
    for final in (cli.TERMINAL, webui.TERMINAL_STATES, END_STATES, sim.FINAL_STATES):
        assert final is control.JOB_FINAL_STATES
    assert table.DEP_SATISFIED["end"] == frozenset(control.JOB_FINAL_STATES)
