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

    assert not hasattr(driver, "RunItem") and not hasattr(driver, "ItemEnd")
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


def _edge_effects() -> set[type]:
    """The effects an edge may be given: every effect but Propose (its entry is logged)."""
    return set(events.EFFECTS) - {events.Propose}


def test_each_edge_has_one_handler_per_effect_type() -> None:
    """Rule: the jobs thread and the simulator carry out effects through one dispatch table
    each, which has a handler for every effect the node releases (and nothing else)."""
    from meshjobs.jobsd import JobsThread
    from meshjobs.sim import Sim

    jobs = JobsThread(_node(), None, None, None)
    assert set(jobs._effects) == _edge_effects()
    assert set(Sim(1)._effects) == _edge_effects()


def test_dispatch_calls_the_handler_of_the_type_and_crashes_on_an_unknown_one() -> None:
    """Rule: `dispatch` calls the handler of the effect's exact type, with the edge's
    arguments; an effect the table does not name is a bug of ours and crashes."""
    from meshjobs.node import Cut, Reply, dispatch, ignore

    seen: list = []
    handlers = {Cut: lambda eff, who: seen.append((eff, who)), Reply: ignore}
    cut = Cut("j", 0, 1)
    dispatch(cut, handlers, "m1")
    assert seen == [(cut, "m1")]
    with pytest.raises(AssertionError, match="no handler for the effect"):
        dispatch(events.Exit("bye"), handlers, "m1")
    from meshjobs.jobsd import JobsThread

    jobs = JobsThread(_node(), None, None, None)
    del jobs._effects[events.Exit]  # an effect the jobs thread would not know
    with pytest.raises(AssertionError, match="no handler for the effect"):
        jobs._release(events.Exit("bye"))


def test_report_limits_come_from_limits(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rule: the node's bounds on a member's F_JOB_HAVE report are named in limits.py: a report
    past any of them is garbage (None), one within them is taken."""
    from meshjobs import limits
    from meshjobs.node.members import parse_have

    monkeypatch.setattr(limits, "have_pools_max", 2)
    monkeypatch.setattr(limits, "boot_chars_max", 4)
    monkeypatch.setattr(limits, "pool_slots_max", 9)
    ok = {"boot": "b123", "role": "worker", "pos": 0, "pools": {"a": 9, "b": 1}}
    assert parse_have(ok) is not None
    for bad in ({"pools": {"a": 1, "b": 1, "c": 1}}, {"boot": "b1234"}, {"pools": {"a": 10}}):
        assert parse_have({**ok, **bad}) is None, bad


def test_run_time_average_weight_comes_from_limits(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rule: the weight of the newest result in a pool's average run time is a named limit."""
    from meshjobs import limits

    monkeypatch.setattr(limits, "run_ms_average_weight_fraction", 0.5)
    node = _node()
    node.leadership.note_run("p", 1_000, 1_100)
    node.leadership.note_run("p", 1_000, 1_300)
    assert node.leadership.run_ms["p"] == 200.0


PARTS = {"proposals": "Proposals", "feed": "Feed", "storage": "Storage", "recopies": "Recopies",
         "roster": "Members", "ring": "CatchUpRing", "orders": "Orders", "notices": "Notices",
         "follower": "Follower", "leadership": "Leadership",
         "runs": "Runs", "copies": "Copies", "changes": "Changes"}


def test_the_node_is_composed_of_parts_not_mixins() -> None:
    """Rule: JobNode inherits nothing; its parts are plain classes that own their state and
    hold no reference to the node itself (they get the table, other parts and callbacks)."""
    assert JobNode.__bases__ == (object,)
    node = _node()
    for attr, cls_name in PARTS.items():
        part = getattr(node, attr)
        assert type(part).__name__ == cls_name
        assert type(part).__bases__ == (object,), cls_name
        for name, value in vars(part).items():
            assert value is not node, f"{cls_name}.{name} is the node"
