"""A part of the job node: the clients' changes and reads in flight, and their answers.

Theory of operation. A change asked here waits (under its request id) until its entry is
applied; on a member that does not lead it goes to the leader (F_CTL) and waits for its answer
(F_CTL_REPLY), re-sent when the leader changes. An answer "not known yet" (a new leader that has
not heard from the fleet yet, heard.py) is not passed on: the change is asked again after
`ctl_resend_ms`, until its deadline (`ctl_commit_ms_max`), and only then is that answer given.
A change another member forwarded here gets a token of its own (negative), and its answer goes
back to that member with the log index of the entry it depends on; there, the answer is parked
until the member's own table has that entry (read your writes). Reads that wait for a job to end or change wait here too.

Rule: pure, like the rest of the node. It owns the changes in flight, the forwarded ones, the
remote tokens, the waiting reads and the parked answers; it is given the config, the table, the
node's counter and the way out for its `Reply` and `Send` effects, and per call the time and
the leader.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from meshjobs import limits
from meshjobs.control import Answer
from meshjobs.node.events import NodeConfig, Reply, Send
from meshjobs.node.heard import not_known_yet
from meshjobs.table import JobTable, materialize


@dataclass
class Change:
    tokens: list[int]
    deadline_ms: int
    op: str
    job_id: str | None
    req: dict | None = None
    sent_ms: int = 0
    fp: str | None = None  # the fingerprint the change's request id is bound to
    # The leader's last "not known yet" (heard.py): the answer if the deadline passes first.
    not_known: Answer | None = None


class Changes:
    """Changes and reads in flight on this member, and the routing of every answer."""

    def __init__(self, cfg: NodeConfig, table: JobTable, count: Callable[..., None],
                 emit: Callable[[Any], None]) -> None:
        self.cfg = cfg
        self.table = table
        self._count = count
        self._emit = emit
        self.pending: dict[str, Change] = {}
        self.forwarded: dict[str, Change] = {}
        # token -> (member, rid, fingerprint) of a change another member forwarded here
        self.remote: dict[int, tuple[str, str, str | None]] = {}
        self.next_remote = 0
        self.next_fleet_ask = 0  # numbers the fleet views asked of the leader
        # job id -> (token, items, deadline, since) of each read waiting for the job to end
        # (since None) or to change after version `since`.
        self.waiters: dict[str, list[tuple[int, bool, int, int | None]]] = {}
        # Answers to forwarded changes, held until this member's table has the entry they name.
        self.parked: list[tuple[int, int, Answer, int]] = []

    def deadlines(self) -> list[int]:
        ds = [c.deadline_ms for c in self.pending.values()]
        ds += [c.deadline_ms for c in self.forwarded.values()]
        ds += [w[2] for ws in self.waiters.values() for w in ws]
        return ds

    def new_leader(self) -> None:
        for ch in self.forwarded.values():
            ch.sent_ms = -limits.proposal_retry_ms  # to the new leader at once

    def new_change(self, now_ms: int, tokens: list[int], op: str, job_id: str | None,
                   req: dict | None = None, fp: str | None = None) -> Change:
        if fp is None and req is not None:
            fp = req.get("fp")
        return Change(tokens, now_ms + limits.ctl_commit_ms_max, op, job_id, req, fp=fp)

    def remote_token(self, peer: str, body: dict) -> int:
        """A token for a change `peer` forwarded here (F_CTL): its answer goes back there."""
        self.next_remote -= 1
        token = self.next_remote
        req = body.get("req")
        fp = req.get("fp") if isinstance(req, dict) else None
        self.remote[token] = (peer, body["rid"], fp if isinstance(fp, str) else None)
        return token

    def on_ctl_reply(self, body: Any, now_ms: int) -> None:
        if not isinstance(body, dict) or type(body.get("status")) is not int:
            self._count("frames_bad_ctl_reply")
            return
        ch = self.forwarded.get(body.get("rid"))
        if ch is None:
            return  # answered already (a duplicate, or after our deadline)
        if "fp" in body and body["fp"] != ch.fp:
            # A late answer to an earlier request under the same key (one that timed out
            # here), not to the change waiting now: that one must not get its answer.
            self._count("ctl_replies_of_another_request")
            return
        if not_known_yet(body.get("body")) and now_ms < ch.deadline_ms:
            # The leader cannot tell yet: asked again after ctl_resend_ms (core._follow).
            ch.sent_ms = now_ms
            ch.not_known = Answer(body["status"], body.get("body"))
            self._count("ctl_not_known_yet_retried")
            return
        del self.forwarded[body["rid"]]
        index = body.get("index")
        index = index if type(index) is int else 0
        for token in ch.tokens:
            answer = Answer(body["status"], body.get("body"))
            if index > self.table.applied_index:
                # Read your writes: the client's next read here must see its change, so the
                # answer waits until this member's table has the entry (or a deadline passes).
                self.parked.append((index, token, answer, now_ms + limits.ctl_commit_ms_max))
            else:
                self.answer(token, answer)

    def release_parked(self, now_ms: int) -> None:
        if not self.parked:
            return
        keep = []
        for index, token, answer, deadline in self.parked:
            if index <= self.table.applied_index or deadline <= now_ms:
                self.answer(token, answer)
            else:
                keep.append((index, token, answer, deadline))
        self.parked = keep

    def forward(self, token: int, req: dict, leader: str | None, now_ms: int) -> None:
        """A change asked of a member that does not lead: send it to the leader (F_CTL)."""
        if leader is None or leader == self.cfg.member:
            self._count("ctl_no_leader")
            self.answer(token, Answer(503, {
                "error": "no leader: the fleet cannot commit changes now "
                         "(an election is under way, or a majority of voters "
                         "is unreachable); try again shortly"}))
            return
        rid = req["rid"]
        ch = self.forwarded.get(rid)
        if ch is not None:
            ch.tokens.append(token)
            return
        self.forwarded[rid] = self.new_change(now_ms, [token], req["op"], req.get("id"), req)
        self.forwarded[rid].sent_ms = now_ms
        # Forwarded changes are re-sent (same request id) when the leader changes, and every
        # `ctl_resend_ms` while unanswered: a frame to a leader that just died is lost.
        self._count("ctl_forwarded")
        self._emit(Send(leader, "F_CTL", {"rid": rid, "req": req}))

    def answer(self, token: int, answer: Answer, index: int = 0) -> None:
        """Every answer goes out here: to a local client, or back to the member that forwarded
        the request (F_CTL_REPLY, with the log index of the entry it depends on)."""
        remote = self.remote.pop(token, None)
        if remote is None:
            self._emit(Reply(token, answer))
        else:
            peer, rid, fp = remote
            # Item records copied for a local sender to build are built here for a peer.
            answer = Answer(answer.status, materialize(answer.body))
            # The fingerprint says which request under this key the answer is for.
            self._emit(Send(peer, "F_CTL_REPLY", {"rid": rid, "fp": fp,
                                                  "status": answer.status,
                                                  "body": answer.body, "index": index}))
