"""A part of the job node: whether a new leader has heard from the fleet yet.

Theory of operation. What a leader knows of the other members comes from their reports
(members.py), soft state it drops when it comes to lead. For a while after, a pool that no
member it has heard from offers, a member name it has not heard, or the members a fan-out
(`member *`) runs on, may be so only because some members have not reported *yet*: a final
"unknown pool" or "no member" then would be wrong, and a fan-out's member list (fixed once, in
its submit entry) would leave members out for good. Until the leader has heard from the fleet,
such questions are "not known yet": they are answered 503 with a word to try again, which a
member that forwarded the change does itself (changes.py), and no fan-out is committed.

Rule 1: the fleet is heard (`Hearing.settled`) once `dead_ms` has passed since the reign began
        (a member not heard from by then is dead as the leader sees it: its leases are
        revoked, members.py), or sooner once every member the leader expects has reported in
        this reign.
Rule 2: the members expected are the voters, the members the committed table names (items'
        members, leases, fan-outs, copies, orders: `JobTable.members_named`) and the members
        that reported to this member, leading or not, within `lost_ms` before the reign began;
        never the leader itself. A member that none of these names (it never ran an item, was
        never ordered, and never reported to this member) is not waited for: it is as unknown
        to the new leader as it was to the old one before it reported.
Rule 3: once heard, a reign stays heard: time only moves on, and a report is never unmade.
Rule 4: an answer "not known yet" says so in its body (`NOT_KNOWN_YET`), so that a member that
        forwarded the change can tell it from any other 503 and ask again.
Rule 5: pure, like the rest of the node: the time comes in calls.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from meshjobs.control import Answer

NOT_KNOWN_YET = "not_known_yet"  # the key, true in the body of a "not known yet" answer
_NAMES_SHOWN = 5  # members not heard from yet, named in the answer's words


@dataclass(frozen=True)
class Hearing:
    """What a leader has heard of the fleet in its reign: `settled` tells whether it can give
    final answers about the members, `answer` the 503 to give until then."""

    member: str  # the leader
    since_ms: int  # when its reign began
    dead_ms: int
    expected: frozenset[str]  # the members it waits for (Rule 2)
    reported: frozenset[str]  # those that reported in this reign

    @classmethod
    def of(cls, member: str, since_ms: int, dead_ms: int, expected: Iterable[str],
           reported: Iterable[str]) -> Hearing:
        return cls(member, since_ms, dead_ms, frozenset(expected) - {member},
                   frozenset(reported) - {member})

    def settled(self, now_ms: int) -> bool:
        """Rule 1."""
        return now_ms - self.since_ms >= self.dead_ms or self.expected <= self.reported

    def unheard(self) -> list[str]:
        """The members expected that have not reported yet, by name."""
        return sorted(self.expected - self.reported)

    def answer(self, what: str, now_ms: int) -> Answer:
        """The answer to a question about the members it cannot tell yet: `what` says what."""
        left_ms = max(1, self.since_ms + self.dead_ms - now_ms)
        unheard = self.unheard()
        names = ", ".join(unheard[:_NAMES_SHOWN])
        if len(unheard) > _NAMES_SHOWN:
            names += f" and {len(unheard) - _NAMES_SHOWN} more"
        return Answer(503, {
            "error": f"member {self.member} has just come to lead and has not heard from every "
                     f"member yet (not from {names}), so it cannot tell {what} yet: try again "
                     f"in a moment (it knows within {left_ms / 1000:g} s)",
            NOT_KNOWN_YET: True, "retry_ms": left_ms})


def not_known_yet(answer_body: Any) -> bool:
    """Is this an answer's body "not known yet" (Rule 4)?"""
    return isinstance(answer_body, dict) and answer_body.get(NOT_KNOWN_YET) is True
