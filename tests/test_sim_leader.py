"""The simulator on a new leader's first moments (issue 26, point 1; meshjobs/node/heard.py).

Workers offer a pool no voter does ("gpu"), jobs go there and fan out, and right after each
election an operator asks about a worker or that pool. The simulator checks that no leader
gives a final "unknown pool" or "no member", or proposes a fan-out's member list, while a member
it knows of has not reported to it in its reign (and less than dead_ms has passed); nodes that
answer too early are caught, with their seed named.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from meshjobs.node import JobNode
from meshjobs.node.heard import Hearing
from meshjobs.sim import SimConfig, SimFailure, run

WORKER_POOL = SimConfig(worker_pool=0.3, place=0.5)


def caught(seeds: Any, what: str, words: str, **run_args: Any) -> None:
    """Run the simulation on `seeds` until one fails with `words` in its message, which must
    name its seed; fail, naming `what`, if none does (the planted bug went unseen)."""
    for seed in seeds:
        try:
            run(seed, **run_args)
        except SimFailure as e:
            msg = str(e)
            assert msg.startswith(f"seed={seed} "), msg
            if words in msg:
                return
    raise AssertionError(f"no seed caught {what}")


@pytest.mark.parametrize("seed", (1, 3))
def test_new_leaders_wait_to_hear_the_fleet_safe_and_live(seed: int) -> None:
    """Jobs in a pool only workers offer, fan-outs, and questions about workers right after
    each election: no final answer about the members comes too early, every check is
    exercised, and once healed every acknowledged job ends (its gpu items on workers)."""
    c = run(seed, WORKER_POOL).counts
    assert c.get("jobs_worker_pool", 0) > 0 and c.get("probes_sent", 0) > 0, c
    assert c.get("heard_checked", 0) > 0 and c.get("not_known_yet_answers", 0) > 0, c


def test_new_leaders_with_orders_and_stops() -> None:
    """With operators' drains, holds and stops about as well (a stop of a member the new
    leader has not heard from yet is not known yet, not refused)."""
    c = run(4, replace(WORKER_POOL, orders=0.02, stops=0.01)).counts
    assert c.get("heard_checked", 0) > 0 and c.get("orders_committed", 0) > 0, c


class EarlyAnswersNode(JobNode):
    """Planted bug: the node answers about pools and members, and fixes fan-outs, as soon as
    it leads, as if it had heard from the whole fleet."""

    def _hearing(self) -> Hearing | None:
        return None


class VotersOnlyNode(JobNode):
    """Planted bug: the node waits only for the voters (as before issue 26), not for the
    workers it knows of."""

    def _hearing(self) -> Hearing | None:
        h = super()._hearing()
        if h is None:
            return None
        voters = h.expected & set(self.cfg.voters)
        narrow = Hearing.of(h.member, h.since_ms, h.dead_ms, voters, h.reported)
        return None if narrow.settled(self.now_ms) else narrow


@pytest.mark.parametrize("node_cls", (EarlyAnswersNode, VotersOnlyNode))
def test_planted_early_final_answers_are_caught(node_cls: type[JobNode]) -> None:
    """Safety check: a leader that answers "unknown pool"/"no member", or fixes a fan-out's
    members, before it has heard from the fleet is caught, and the failure names its seed."""
    caught(range(1, 12), node_cls.__name__, "into its reign, not yet heard from",
           config=replace(WORKER_POOL, liveness_ms_max=1_000), node_cls=node_cls)
