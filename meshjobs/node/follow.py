"""A member that does not lead: it reports to the leader, forwards changes, sends results, and —
a worker member — follows the leader's table through F_JOB_STATE.

Frames are hints that make things faster; none is needed for correctness. A lost F_RESULT is
sent again until the member's table shows the lease ended; a lost F_CTL times out with 503 and
the client retries with the same request id; a lost F_JOB_STATE is sent again when the worker's
next F_JOB_HAVE shows it behind.
"""

from __future__ import annotations

from typing import Any

from meshjobs import limits
from meshjobs.control import Answer
from meshjobs.node.events import Applied, Reply, Send, View
from meshjobs.table import JobTable


def _rows_ok(rows: Any) -> bool:
    return isinstance(rows, list) and len(rows) <= limits.result_batch_max and all(
        isinstance(r, list) and 10 <= len(r) <= 12 and isinstance(r[0], str) and type(r[1]) is int
        and type(r[2]) is int for r in rows)


class Following:
    """Mixed into JobNode: frames between members, seen from both ends."""

    def _frame(self, peer: str, ftype: str, body: Any) -> None:
        self._count("frames_in_" + ftype)
        handler = {
            "F_JOB_HAVE": self._on_have,
            "F_JOB_STATE": self._on_state,
            "F_LEASE": self._on_lease,
            "F_RESULT": self._on_result,
            "F_CTL": self._on_ctl,
            "F_CTL_REPLY": self._on_ctl_reply,
        }.get(ftype)
        if handler is None:
            self._count("frames_unhandled")
            return
        handler(peer, body)

    # --- at the leader -------------------------------------------------------------------------

    def _on_have(self, peer: str, body: Any) -> None:
        if self._leading():
            self.roster.have(peer, body, self.now_ms)
        elif self.cfg.role == "voter" and isinstance(body, dict) and body.get("role") == "worker":
            # Tell a worker who leads, so that it reports there.
            self._out.append(Send(peer, "F_JOB_STATE", {
                "term": self.view.term, "leader": self.view.leader, "voters": list(self.cfg.voters)}))

    def _on_result(self, peer: str, body: Any) -> None:
        rows = body.get("r") if isinstance(body, dict) else None
        if not _rows_ok(rows):
            self._count("frames_bad_result")
            return
        if not self._leading():
            return  # the member sends it again to whoever leads
        for r in rows:
            key = (r[0], r[1], r[2])
            if key not in self._results and self.table.lease_current(*key):
                self._results[key] = r
                self._result_from[key] = peer

    def _on_ctl(self, peer: str, body: Any) -> None:
        if not isinstance(body, dict) or not isinstance(body.get("rid"), str):
            self._count("frames_bad_ctl")
            return
        self._next_remote -= 1
        token = self._next_remote
        req = body.get("req")
        fp = req.get("fp") if isinstance(req, dict) else None
        self._remote[token] = (peer, body["rid"], fp if isinstance(fp, str) else None)
        self._ctl(token, body.get("req"), forwarded=True)

    # --- at the member -------------------------------------------------------------------------

    def _on_ctl_reply(self, peer: str, body: Any) -> None:
        if not isinstance(body, dict) or type(body.get("status")) is not int:
            self._count("frames_bad_ctl_reply")
            return
        ch = self._forwarded.get(body.get("rid"))
        if ch is None:
            return  # answered already (a duplicate, or after our deadline)
        if "fp" in body and body["fp"] != ch.fp:
            # A late answer to an earlier request under the same key (one that timed out
            # here), not to the change waiting now: that one must not get its answer.
            self._count("ctl_replies_of_another_request")
            return
        del self._forwarded[body["rid"]]
        index = body.get("index")
        index = index if type(index) is int else 0
        for token in ch.tokens:
            answer = Answer(body["status"], body.get("body"))
            if index > self.table.applied_index:
                # Read your writes: the client's next read here must see its change, so the
                # answer waits until this member's table has the entry (or a deadline passes).
                self._parked.append((index, token, answer, self.now_ms + limits.ctl_commit_ms_max))
            else:
                self._answer(token, answer)

    def _release_parked(self) -> None:
        if not self._parked:
            return
        keep = []
        for index, token, answer, deadline in self._parked:
            if index <= self.table.applied_index or deadline <= self.now_ms:
                self._answer(token, answer)
            else:
                keep.append((index, token, answer, deadline))
        self._parked = keep

    def _on_lease(self, peer: str, body: Any) -> None:
        index = body.get("index") if isinstance(body, dict) else None
        if type(index) is int and index > self.table.applied_index:
            self._next_have_ms = 0  # behind: report now, the leader sends what is missing

    def _on_state(self, peer: str, body: Any) -> None:
        if self.cfg.role != "worker" or not isinstance(body, dict):
            return
        term, leader = body.get("term"), body.get("leader")
        if type(term) is not int or not (leader is None or isinstance(leader, str)):
            self._count("frames_bad_state")
            return
        if term < self.view.term:
            return  # from a deposed leader
        if leader != peer:
            # A voter's hint of who leads (it answered our F_JOB_HAVE): worth reporting there,
            # but it says nothing of whether we hear the leader, so it never makes our table
            # fresh, and a hint carries no entries.
            if leader is not None and (self.view.leader is None or term > self.view.term):
                self.view = View(term=term, leader=leader, is_leader=False, ready=False)
                self._leader_hint_ms = self.now_ms
            self._count("state_hints")
            return
        self.view = View(term=term, leader=leader, is_leader=False, ready=True)
        self._leader_seen_ms = self.now_ms
        if "snapshot" in body:
            try:
                table = JobTable.from_state(body["snapshot"])
            except Exception:  # remote garbage: a table we cannot load is not installed
                self._count("frames_bad_state")
                return
            self.table.load(table)
            self._count("state_snapshots_installed")
            return
        entries, prev = body.get("entries"), body.get("prev")
        if not isinstance(entries, list) or type(prev) is not int:
            return
        if prev != self.table.applied_index:
            self._count("state_gaps")
            self._next_have_ms = 0
            return
        for e in entries:
            if not (isinstance(e, list) and len(e) == 2 and type(e[0]) is int
                    and e[0] > self.table.applied_index):
                self._count("frames_bad_state")
                return
            prev = self.table.applied_index
            outcome = self.table.apply(e[1], e[0])
            self._applied(Applied(e[0], e[1], outcome, prev))

    # --- what every non-leader does each round -------------------------------------------------

    def _follow(self) -> None:
        now = self.now_ms
        if (self.cfg.role == "worker" and self.view.leader is not None
                and now - max(self._leader_seen_ms, self._leader_hint_ms) > self.cfg.dead_ms):
            # Not heard from the leader for too long: do not pretend to know who leads (changes
            # then fail fast with 503 instead of waiting on a leader that may be gone).
            self.view = View(term=self.view.term)
            self._count("leader_lost")
        leader = self.view.leader if self.view.leader != self.cfg.member else None
        if now >= self._next_have_ms:
            self._next_have_ms = now + limits.have_ms
            body = {
                "boot": self.cfg.boot, "role": self.cfg.role, "pos": self.table.applied_index,
                "pools": {} if self._takes_no_work() else {
                    p.name: p.slots for p in self.cfg.pools.values()},
                "pressure": self.storage.pressure,
                "disk_full": self.storage.disk_full,
                "blob_bytes": self.storage.blob_bytes,
                "running": sum(1 for ended in self._running.values() if not ended),
            }
            targets = [leader] if leader else [v for v in self.cfg.voters if v != self.cfg.member]
            for to in targets:
                self._out.append(Send(to, "F_JOB_HAVE", body))
        if leader is None:
            return
        rows = self._due_results(len(self._results))
        for k in range(0, len(rows), limits.result_batch_max):
            self._out.append(Send(leader, "F_RESULT", {"r": rows[k:k + limits.result_batch_max]}))
        for rid, ch in self._forwarded.items():
            if now - ch.sent_ms >= limits.ctl_resend_ms:
                ch.sent_ms = now
                self._out.append(Send(leader, "F_CTL", {"rid": rid, "req": ch.req}))

    def _forward(self, token: int, req: dict) -> None:
        """A change asked of a member that does not lead: send it to the leader (F_CTL)."""
        leader = self.view.leader
        if leader is None or leader == self.cfg.member:
            self._count("ctl_no_leader")
            self._reply(token, 503, {"error": "no leader: the fleet cannot commit changes now "
                                              "(an election is under way, or a majority of voters "
                                              "is unreachable); try again shortly"})
            return
        rid = req["rid"]
        ch = self._forwarded.get(rid)
        if ch is not None:
            ch.tokens.append(token)
            return
        self._forwarded[rid] = self._new_change([token], req["op"], req.get("id"), req)
        self._forwarded[rid].sent_ms = self.now_ms
        # Forwarded changes are re-sent (same request id) when the leader changes, and every
        # `ctl_resend_ms` while unanswered: a frame to a leader that just died is lost.
        self._count("ctl_forwarded")
        self._out.append(Send(leader, "F_CTL", {"rid": rid, "req": req}))

    def _answer(self, token: int, answer: Answer, index: int = 0) -> None:
        """Every answer goes out here: to a local client, or back to the member that forwarded
        the request (F_CTL_REPLY, with the log index of the entry it depends on)."""
        remote = self._remote.pop(token, None)
        if remote is None:
            self._out.append(Reply(token, answer))
        else:
            peer, rid, fp = remote
            # The fingerprint says which request under this key the answer is for.
            self._out.append(Send(peer, "F_CTL_REPLY", {"rid": rid, "fp": fp,
                                                        "status": answer.status,
                                                        "body": answer.body, "index": index}))
