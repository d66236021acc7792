"""The durability gate as a type: `Ready` sorts a round's effects, `advance` carries them out.

What must hold: nothing that acknowledges a record (an answer, a frame, an item started or
cut, a copy, a notice, an exit) leaves before the sync that follows the round's entries. The
tests drive a real JobNode (pure) through submits, leases, ends and results with the same
`advance` the jobs thread and the simulator use, record every call in order, and check that
order; a planted gate that lets answers out early is caught by the same check.
"""

from __future__ import annotations

import random
from typing import Any

import msgpack
import pytest

from meshjobs.control import Answer
from meshjobs.node import (
    Applied,
    CopyBlobs,
    Ctl,
    Cut,
    FetchBlobs,
    ItemEnded,
    JobNode,
    NodeConfig,
    Pin,
    Pool,
    Propose,
    Ready,
    Reply,
    Run,
    Send,
    Tick,
    Unpin,
    UnpinAllBut,
    View,
    advance,
    run_round,
)
from meshjobs.node.events import Exit, Notify, SendDump, WantDump
from meshjobs.node.ready import AFTER_SYNC, AT_ONCE
from meshjobs.table import JobTable

LEADER = View(term=1, leader="m1", is_leader=True, ready=True)
RUN = Run("j1", 0, 1, ["true"], {}, None, None, None)
OK = Reply(1, Answer(200, {"id": "j1"}))
MALFORMED = Reply(2, Answer(400, {"error": "argv must be a list"}))


@pytest.mark.parametrize("eff,where", [
    (Propose({"k": "noop"}), "entries"),
    (Pin("j1", ("ab" * 32,)), "at_once"),
    (FetchBlobs("j1", ("ab" * 32,)), "at_once"),
    (MALFORMED, "at_once"),
    (OK, "after_sync"),
    (Reply(3, Answer(404, {"error": "no such job"})), "after_sync"),
    (Reply(4, Answer(503, {"error": "busy"})), "after_sync"),
    (Send("m2", "F_LEASE", {}), "after_sync"),
    (RUN, "after_sync"),
    (Cut("j1", 0, 1), "after_sync"),
    (CopyBlobs("m2", "j1", ("ab" * 32,)), "after_sync"),
    (Unpin("j1"), "after_sync"),
    (UnpinAllBut(frozenset()), "after_sync"),
    (Notify("https://h.example/", "j1.3", {}), "after_sync"),
    (Exit("stop ordered"), "after_sync"),
])
def test_every_effect_has_its_place(eff: Any, where: str) -> None:
    ready = Ready.of([eff])
    got = {"entries": ready.entries, "at_once": ready.at_once, "after_sync": ready.after_sync}
    want = eff.entry if isinstance(eff, Propose) else eff
    assert got[where] == (want,)
    assert sum(len(v) for v in got.values()) == 1


def test_every_effect_class_is_known_to_the_gate() -> None:
    from meshjobs.node import events

    effect_classes = {Propose, Reply, Run, Cut, Pin, Unpin, UnpinAllBut, Send, CopyBlobs,
                      FetchBlobs, Exit, Notify, SendDump, WantDump}
    assert set(AT_ONCE) | set(AFTER_SYNC) | {Propose} == effect_classes
    assert not set(AT_ONCE) & set(AFTER_SYNC)
    assert all(hasattr(events, c.__name__) for c in effect_classes)


def test_an_unknown_effect_is_a_bug() -> None:
    with pytest.raises(AssertionError, match="does not know"):
        Ready.of([object()])


def test_cuts_then_runs_go_first_after_the_sync_and_the_rest_keep_their_order() -> None:
    send = Send("m2", "F_LEASE", {})
    cut = Cut("j0", 0, 1)
    ready = Ready.of([OK, send, Propose({"k": "a"}), RUN, MALFORMED, cut, Propose({"k": "b"})])
    assert ready.entries == ({"k": "a"}, {"k": "b"})
    assert ready.at_once == (MALFORMED,)
    assert ready.after_sync == (cut, RUN, OK, send)
    assert ready.effects()[:2] == [Propose({"k": "a"}), Propose({"k": "b"})]
    assert not Ready() and Ready.of([RUN])


def test_advance_logs_then_releases_at_once_then_syncs_then_the_rest() -> None:
    calls: list[tuple[str, Any]] = []
    ready = Ready.of([OK, Propose({"k": "a"}), Pin("j1", ()), RUN])
    advance(ready, persist=lambda e: calls.append(("persist", e)),
            sync=lambda: calls.append(("sync", None)),
            release=lambda e: calls.append(("release", e)))
    assert calls == [("persist", {"k": "a"}), ("release", Pin("j1", ())), ("sync", None),
                     ("release", RUN), ("release", OK)]


def test_a_sync_that_fails_releases_nothing_after_it() -> None:
    released: list[Any] = []

    def sync() -> None:
        raise OSError(5, "Input/output error")

    with pytest.raises(OSError):
        advance(Ready.of([Propose({"k": "a"}), OK, RUN]), persist=lambda e: None, sync=sync,
                release=released.append)
    assert released == []


# --- a real node, driven through submits, leases, ends and results ----------------------------

def _acknowledges(eff: Any) -> bool:
    return isinstance(eff, AFTER_SYNC) and not (isinstance(eff, Reply)
                                                and eff.answer.status == 400)


class GateLog:
    """Carries out rounds with `advance` and fails the moment an acknowledging effect leaves
    while an entry logged before it is not yet synced."""

    def __init__(self) -> None:
        self.unsynced = 0
        self.released: list[Any] = []
        self.logged: list[dict] = []
        self.syncs = 0

    def persist(self, entry: dict) -> None:
        self.unsynced += 1
        self.logged.append(entry)

    def sync(self) -> None:
        self.unsynced = 0
        self.syncs += 1

    def release(self, eff: Any) -> None:
        assert not (self.unsynced and _acknowledges(eff)), (
            f"{eff!r} left before {self.unsynced} logged entries were synced")
        self.released.append(eff)


def _drive(node_ready: Any, seed: int, rounds: int = 300) -> GateLog:
    """A fleet of one: random submits (some malformed), every entry committed a round or two
    after it is logged, every item run ending a few rounds later."""
    rng = random.Random(seed)
    table = JobTable()
    node = JobNode(table, NodeConfig(member="m1", boot="b1",
                                     pools={"default": Pool("default", slots=2)}),
                   random.Random(seed))
    gate = GateLog()
    now, index, token = 1_700_000_000_000, 0, 0
    waiting: list[dict] = []  # logged, to be committed next round
    running: list[tuple[int, Run]] = []  # (round it ends, run)
    node.step(LEADER)
    for r in range(rounds):
        now += rng.randint(1, 30)
        events: list[Any] = [Tick(now)]
        for entry in waiting:
            index += 1
            e = msgpack.unpackb(msgpack.packb(entry, use_bin_type=True), raw=False,
                                strict_map_key=False)
            prev = table.applied_index
            events.append(Applied(index, e, table.apply(e, index), prev))
        waiting = []
        for _ in range(rng.randint(0, 3)):
            token += 1
            if rng.random() < 0.1:
                events.append(Ctl(token, {"op": "submit", "rid": f"r{token}",
                                          "spec": {"argv": "not a list"}, "items": [None]}))
            else:
                events.append(Ctl(token, {"op": "submit", "rid": f"r{token}",
                                          "spec": {"argv": ["true"]},
                                          "items": [None] * rng.randint(1, 4)}))
        for when, run in list(running):
            if when <= r:
                running.remove((when, run))
                events.append(ItemEnded(run.job_id, run.index, run.epoch, "done", 0, None,
                                        None, None, now - 1, now))
        for ev in events:
            node.step(ev)
        ready = node_ready(node)
        advance(ready, persist=gate.persist, sync=gate.sync, release=gate.release)
        waiting = list(gate.logged)
        gate.logged.clear()
        running += [(r + rng.randint(1, 4), e) for e in ready.after_sync + ready.at_once
                    if isinstance(e, Run)]
    return gate


@pytest.mark.parametrize("seed", range(5))
def test_a_real_node_never_acknowledges_unsynced_entries(seed: int) -> None:
    gate = _drive(lambda node: node.ready(), seed)
    kinds = {type(e).__name__ for e in gate.released}
    answers = {e.answer.status for e in gate.released if isinstance(e, Reply)}
    # The drive did what it is for: submits answered (and refused), items run.
    assert {"Reply", "Run"} <= kinds, kinds
    assert {200, 400} <= answers or {201, 400} <= answers, answers
    assert gate.syncs > 0


def test_a_gate_that_lets_answers_out_early_is_caught() -> None:
    def leaky(node: JobNode) -> Ready:
        ready = node.ready()
        return Ready(ready.entries, ready.at_once + ready.after_sync, ())

    with pytest.raises(AssertionError, match="left before"):
        for seed in range(5):
            _drive(leaky, seed)


def test_run_round_steps_every_event_in_order() -> None:
    seen: list[Any] = []

    class Recorder:
        def step(self, ev: Any) -> None:
            seen.append(ev)

        def ready(self) -> Ready:
            return Ready.of([OK])

    assert run_round(Recorder(), [Tick(1), LEADER, Tick(2)]) == Ready((), (), (OK,))
    assert seen == [Tick(1), LEADER, Tick(2)]
