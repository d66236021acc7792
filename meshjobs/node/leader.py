"""The leader's duties: members' liveness and room, leases, revokes, results, retention, and
keeping worker members' tables up to date.

Only a leader whose table holds every committed entry of its term (`view.ready`) does any of
this, and only through proposals: a lease, revoke or result counts when it is committed, never
when it is decided. Everything here is level-triggered: run it again and it proposes what is
still missing, and the table's epochs and request ids make a repeat harmless.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Callable
from typing import Any

from meshjobs import cron, limits, reruns
from meshjobs.compact import entry_item_count
from meshjobs.node.catchup import CatchUpRing
from meshjobs.node.events import DumpReady, NodeConfig, Send, SendDump, WantDump
from meshjobs.node.hooks import Orders
from meshjobs.node.members import Members
from meshjobs.node.proposals import Proposals
from meshjobs.table import JobTable


class _Spread:
    """Members with room in one pool, most room first (then this member, then the greatest
    name), as a heap: each item taken charges one slot, without scanning every member per
    item (200 workers and a job of 100 items would be 20,000 looks)."""

    def __init__(self, room: dict[str, dict[str, int]], pool: str, me: str) -> None:
        self.room, self.pool = room, pool
        names = sorted((n for n in room if room[n].get(pool, 0) > 0), reverse=True)
        self.heap = [(-room[n][pool], n != me, rank, n) for rank, n in enumerate(names)]
        heapq.heapify(self.heap)

    def take(self) -> str:
        """The member the next item goes to; its room is charged."""
        neg, not_me, rank, name = self.heap[0]
        self.room[name][self.pool] -= 1
        if neg + 1 < 0:
            heapq.heapreplace(self.heap, (neg + 1, not_me, rank, name))
        else:
            heapq.heappop(self.heap)
        return name


class Leadership:
    """A part of the node: what it does while it leads. It owns what the leader has proposed
    and not yet seen committed (leases, revokes, expiries, re-runs, schedule fires) and each
    pool's typical run time; it is given the config, the table, the other parts it proposes
    through or reads (members, proposals, orders, the catch-up ring), the node's counter, the
    way out for its frames, and whether this member takes work now."""

    def __init__(self, cfg: NodeConfig, table: JobTable, roster: Members, proposals: Proposals,
                 orders: Orders, ring: CatchUpRing, count: Callable[..., None],
                 emit: Callable[[Any], None], takes_no_work: Callable[[], bool]) -> None:
        self.cfg = cfg
        self.table = table
        self.roster = roster
        self.proposals = proposals
        self.orders = orders
        self.ring = ring
        self._count = count
        self._emit = emit
        self._takes_no_work = takes_no_work
        self.run_ms: dict[str, float] = {}  # pool -> moving average of its items' run times
        self.inflight: dict[tuple[str, int], tuple[int, str, str]] = {}  # grant -> (ms, pool, member)
        self._revoking: dict[tuple[str, int, int], int] = {}
        self._expiring: dict[str, int] = {}
        self._rerunning: dict[tuple[str, int], int] = {}  # (job, run) -> when its rerun was proposed
        self._cron_sent: dict[tuple[str, int], int] = {}  # (schedule, due) -> when its fire was proposed
        self._next_expiry_ms = 0
        self.urgent: set[str] = set()  # workers with leases in entries not yet sent to them
        self._snapshots_sent: deque[int] = deque()  # when whole tables went out lately
        self.dump_index: int | None = None  # the table position of this member's latest dump
        self._dump_asked_ms: int | None = None  # when a new dump was last asked for
        self._dump_wanted_ms: int | None = None  # since when one is wanted (None: none is)

    # --- what committed entries say -------------------------------------------------------------

    def leased(self, jid: str, i: int) -> None:
        """A lease of item i of job jid committed: it is no longer in flight."""
        self.inflight.pop((jid, i), None)

    def revoked(self, lease: tuple) -> None:
        self._revoking.pop(lease, None)  # type: ignore[arg-type]

    def expired(self, job_id: str) -> None:
        self._expiring.pop(job_id, None)

    # --- room ---------------------------------------------------------------------------------

    def ahead(self, pool: str) -> int:
        """Items per slot leased ahead in `pool`: none until its items are known to be short
        (from the results committed lately), then as many as run in `lease_ahead_ms`."""
        run_ms = self.run_ms.get(pool)
        if run_ms is None or run_ms > limits.lease_ahead_run_ms_max:
            return 0
        return min(limits.lease_ahead_per_slot_max,
                   max(1, math.ceil(limits.lease_ahead_ms / max(run_ms, 1.0))))

    def room(self, now_ms: int, frees_slot: Callable[[tuple[str, int, int]], bool]
             ) -> dict[str, dict[str, int]]:
        """Room per member and pool: its slots (and the items leased ahead in a pool of short
        items), minus items leased to it that have not ended, minus leases proposed. An item
        that ended frees its slot at once, though its result is not committed yet; one whose
        outputs are still being copied does not (a member whose copies fail stops there):
        `frees_slot` says which runs ended so."""
        room: dict[str, dict[str, int]] = {}
        aheads: dict[str, int] = {}  # pool -> ahead(pool), once per call (200 members share it)

        def cap(pools: dict[str, int]) -> dict[str, int]:
            out = {}
            for p, n in pools.items():
                a = aheads.get(p)
                if a is None:
                    a = aheads[p] = self.ahead(p)
                out[p] = n * (1 + a)
            return out

        if not self._takes_no_work():
            room[self.cfg.member] = cap(self.table.ctl.effective(
                self.cfg.member, {p.name: p.slots for p in self.cfg.pools.values()}))
        for name, m in self.roster.known.items():
            if (name != self.cfg.member and not m.pressure and not m.disk_full
                    and self.roster.alive(name, now_ms, m.boot)):
                room[name] = cap(self.table.ctl.effective(name, m.pools))
        jobs = self.table.jobs
        for (jid, i), (member, _boot) in self.table.leased.items():
            pools = room.get(member)
            if pools is not None:
                job = jobs[jid]
                key = (jid, i, job.epoch[i])
                if frees_slot(key):
                    continue
                if job.pool in pools:
                    pools[job.pool] -= 1
        for _sent, pool, member in self.inflight.values():
            pools = room.get(member)
            if pools is not None and pool in pools:
                pools[pool] -= 1
        self.orders.room(room)
        return room

    def note_run(self, pool: str, started_ms: Any, ended_ms: Any) -> None:
        """Keep each pool's typical run time (a moving average of committed results)."""
        if type(started_ms) is not int or type(ended_ms) is not int or not 0 < started_ms <= ended_ms:
            return
        ms = float(ended_ms - started_ms)
        old = self.run_ms.get(pool)
        self.run_ms[pool] = ms if old is None else old + limits.run_ms_average_weight_fraction * (ms - old)

    # --- proposals ---------------------------------------------------------------------------------

    def propose_revokes(self, now_ms: int) -> None:
        now = now_ms
        dead = []
        whys: list[str] = []
        for (jid, i), (member, boot) in self.table.leased.items():
            if self.roster.alive(member, now, boot):
                continue
            key = (jid, i, self.table.jobs[jid].epoch[i])
            sent = self._revoking.get(key)
            if sent is not None and now - sent < limits.proposal_retry_ms:
                continue
            self._revoking[key] = now
            dead.append(list(key))
            whys.append(self._lost_why(member, boot, now))
            if len(dead) >= limits.lease_batch_max:
                break
        if dead:
            self._count("revokes_proposed", len(dead))
            self.proposals.duty({"k": "revoke", "t": now, "l": dead, "w": whys})

    def _lost_why(self, member: str, boot: str, now_ms: int) -> str:
        """Why a lease of `member` (incarnation `boot`) is revoked, as the item keeps it."""
        if self.roster.boot_of(member) not in ("", boot):
            return f"lost with member {member} (it restarted)"
        m = self.roster.known.get(member)
        last = m.last_ms if m is not None and m.boot else self.roster.heard.get(member)
        if last is None:
            return (f"lost with member {member} (not heard from in "
                    f"{(now_ms - self.roster.since_ms) / 1000:.1f} s since a new leader took over)")
        return f"lost with member {member} (dead {(now_ms - last) / 1000:.1f} s)"

    def propose_leases(self, now_ms: int,
                       frees_slot: Callable[[tuple[str, int, int]], bool]) -> None:
        now = now_ms
        for key, (sent, _pool, _member) in list(self.inflight.items()):
            if now - sent >= limits.proposal_retry_ms:
                del self.inflight[key]
        if not self.table.ready and not any(e["k"] == "submit" for e in self.proposals.changes):
            return  # nothing waits for a lease: no need to work out every member's room
        room = self.room(now, frees_slot)
        boots = {name: m.boot for name, m in self.roster.known.items()}
        boots[self.cfg.member] = self.cfg.boot
        pools = {p for free in room.values() for p, n in free.items() if n > 0}
        grants: list[list] = []
        for pool in sorted(pools):
            total = sum(free.get(pool, 0) for free in room.values() if free.get(pool, 0) > 0)
            total = min(total, limits.lease_batch_max - len(grants))
            if total <= 0:
                continue
            # Spread by load: of the members an item may go to (placement), the one with the
            # most free slots in this pool takes it.
            free = {n: room[n][pool] for n in room if room[n].get(pool, 0) > 0}
            placed = self.table.place(pool, free, total, now, set(self.inflight), self.cfg.member)
            for n, left in free.items():
                room[n][pool] = left
            picked = [(jid, i) for jid, i, _member in placed]
            if len(picked) < total:
                picked += self._new_items(pool, total - len(picked))
            spread = _Spread(room, pool, self.cfg.member) if len(picked) > len(placed) else None
            for k, (jid, i) in enumerate(picked):
                if k < len(placed):
                    member = placed[k][2]
                else:
                    assert spread is not None
                    member = spread.take()
                self.inflight[(jid, i)] = (now, pool, member)
                grants.append([jid, i, member, boots[member]])
        if grants:
            self._count("leases_proposed", len(grants))
            self.proposals.duty({"k": "lease", "t": now, "g": grants})

    def _new_items(self, pool: str, count: int) -> list[tuple[str, int]]:
        """Room that nothing committed waits for goes to the jobs submitted in this round: their
        first items are leased in the same entry as the submit (it is applied first), one Raft
        round sooner than after it commits."""
        out: list[tuple[str, int]] = []
        seen: set[str] = set()
        for e in self.proposals.changes:
            if len(out) >= count:
                break
            if e["k"] != "submit" or e["id"] in seen:
                continue
            seen.add(e["id"])
            spec = e["spec"]
            if spec.get("pool") != pool or spec.get("hold") or spec.get("after"):
                continue  # a dependent most likely waits: the table says once it is applied
            if spec.get("member") is not None:
                continue  # placed: leased once committed, where its selector allows
            if spec.get("running_items_max") is not None:
                continue  # its submitter's running items are counted once it is committed
            n = entry_item_count(e)
            if spec.get("max_leases") is not None:
                n = min(n, spec["max_leases"])
            out += [(e["id"], i) for i in range(min(n, count - len(out)))]
        return out

    def propose_expiry(self, now_ms: int, committed_ms: int) -> None:
        """Retention: forget the oldest finished jobs past `keep_s` or beyond `keep_jobs`. Ages
        are measured in committed time (`committed_ms` now, as this leader reckons it; table.py
        Rule 7), not against this leader's wall clock, which may be off the one that saw the
        job end."""
        now = now_ms
        keep_s, keep_jobs = self.cfg.keep_s, self.cfg.keep_jobs
        if now < self._next_expiry_ms or (keep_s is None and keep_jobs is None):
            return
        self._next_expiry_ms = now + limits.publish_ms
        finished = self.table.finished
        excess = len(finished) - keep_jobs if keep_jobs is not None else 0
        cutoff = committed_ms - int(keep_s * 1000) if keep_s is not None else None
        ids = []
        for job_id, ended_ms in finished.items():  # oldest first (committed time of its end)
            if len(ids) >= limits.lease_batch_max:
                break
            if job_id in self.table.due:
                continue  # its re-run is due: it is not expired (meshjobs.reruns)
            if excess <= 0 and (cutoff is None or ended_ms > cutoff):
                break
            excess -= 1
            sent = self._expiring.get(job_id)
            if sent is None or now - sent >= limits.proposal_retry_ms:
                self._expiring[job_id] = now
                ids.append(job_id)
        if ids:
            self._count("expiries_proposed", len(ids))
            self.proposals.duty({"k": "expire", "t": now, "ids": ids})

    def propose_reruns(self, now_ms: int) -> None:
        """Automatic re-runs whose time has come (meshjobs.reruns): each proposed once, and
        again only after `proposal_retry_ms` (the entry names its run: a second one that
        commits is refused as stale)."""
        now = now_ms
        for key, sent in list(self._rerunning.items()):
            if now - sent >= limits.proposal_retry_ms:
                del self._rerunning[key]
        entries = [e for e in reruns.due_now(self.table, now)
                   if (e["id"], e["run"]) not in self._rerunning][:limits.lease_batch_max]
        for e in entries:
            self._rerunning[(e["id"], e["run"])] = now
        if entries:
            self._count("reruns_proposed", len(entries))
            for e in entries:
                self.proposals.duty(e)

    # --- worker members' tables --------------------------------------------------------------------

    def dump_ready(self, ev: DumpReady) -> None:
        """This member's latest dump holds the table at position `ev.index`."""
        self.dump_index = ev.index
        self._dump_wanted_ms = None

    def push_state(self, now_ms: int, term: int) -> None:
        """Send each worker the committed entries it does not have yet (F_JOB_STATE), from the
        ring of recent entries, or the whole table when it is further behind than the ring.

        With hundreds of workers a frame to each per round is most of the leader's work, so
        new entries go to a worker at most every `state_push_ms`, at once only when they hold
        leases of its own (`urgent`: it has items to start); a caught-up worker hears from the
        leader every `state_keepalive_ms`. Whole tables are costly to carry: at most
        `state_snapshots_max` go out per `state_resend_ms` (after a failover the others take
        entries from the ring, and those further behind wait their turn, told meanwhile who
        leads). A worker that takes dumps (it says so in its reports) is sent this member's
        latest dump (`SendDump`: the file, read and sent by the edge off the jobs thread) with
        the ring's entries after it; when the ring no longer reaches back to that dump a new
        one is asked for (`WantDump`, at most every `state_resend_ms`) and the worker waits for
        it, up to `state_dump_wait_ms`. Only a worker that does not take dumps, a member with no
        dump yet, or one whose new dump is that late, is sent the table built and packed here:
        one body per round however many workers need it."""
        applied = self.table.applied_index
        urgent, self.urgent = self.urgent, set()
        while self._snapshots_sent and now_ms - self._snapshots_sent[0] >= limits.state_resend_ms:
            self._snapshots_sent.popleft()
        whole: dict[str, Any] | None = None  # one body for every worker sent the whole table
        dumped: dict[str, Any] | None = None  # and for every worker sent the dump
        for m in self.roster.known.values():
            if m.role != "worker":
                continue
            behind = m.sent_upto < applied
            since = now_ms - m.sent_ms
            if behind and m.name not in urgent and since < limits.state_push_ms:
                continue
            if not behind and since < limits.state_keepalive_ms:
                continue
            if not self.roster.alive(m.name, now_ms, m.boot):
                continue
            body: dict[str, Any] = {"term": term, "leader": self.cfg.member}
            entries = self.ring.after(m.sent_upto, applied) if behind else []
            if behind and not entries:
                entries = None  # the table moved on without entries in the ring (a snapshot)
            after = None
            wait_dump = False
            if entries is None and m.dumps and self.dump_index is not None:
                after = self.ring.after(self.dump_index, applied)
                if after is None:
                    wait_dump = self._want_dump(now_ms)
            if entries is None and (len(self._snapshots_sent) >= limits.state_snapshots_max
                                    or wait_dump):
                if since < limits.state_keepalive_ms:
                    continue
                self._count("state_snapshots_waiting")  # told who leads; its table waits
            elif entries is None and after is not None:
                assert self.dump_index is not None
                if dumped is None:
                    dumped = {**body, "prev": self.dump_index, "entries": after,
                              "index": applied}
                self._emit(SendDump(m.name, dumped))
                self._count("state_dumps_sent")
                self._snapshots_sent.append(now_ms)
                m.sent_upto = after[-1][0] if after else self.dump_index
                m.snapshot_ms = now_ms
                m.sent_ms = now_ms
                continue
            elif entries is None:
                if whole is None:
                    # The same body (and so one encoding of it: jobsd.py packs a body sent to
                    # many once) for every worker that needs the whole table this round.
                    whole = {**body, "snapshot": self.table.to_state(), "index": applied}
                body = whole
                self._count("state_snapshots_sent")
                self._snapshots_sent.append(now_ms)
                m.sent_upto = applied
                m.snapshot_ms = now_ms
            else:
                body["prev"] = m.sent_upto
                body["entries"] = entries
                if entries:
                    m.sent_upto = entries[-1][0]
            m.sent_ms = now_ms
            self._emit(Send(m.name, "F_JOB_STATE", body, table=True))

    def _want_dump(self, now_ms: int) -> bool:
        """Ask for a new dump, at most every `state_resend_ms` (its writing takes a while).
        True while it is worth waiting for: a dump that has not come `state_dump_wait_ms`
        after it was first asked for (dumps failing, say) is waited for no longer, and the
        worker is sent the table built here meanwhile."""
        if self._dump_wanted_ms is None:
            self._dump_wanted_ms = now_ms
        if self._dump_asked_ms is None or now_ms - self._dump_asked_ms >= limits.state_resend_ms:
            self._dump_asked_ms = now_ms
            self._count("state_dumps_asked")
            self._emit(WantDump())
        return now_ms - self._dump_wanted_ms < limits.state_dump_wait_ms

    # --- schedules --------------------------------------------------------------------------------

    def propose_cron(self, now_ms: int) -> None:
        """Fire each schedule's due run (meshjobs/cron.py): an entry naming the schedule and the
        due time; the table makes the run's job, once, whoever proposes it how often."""
        crons = self.table.crons
        if not crons:
            self._cron_sent.clear()
            return
        now = now_ms
        for key in [k for k in self._cron_sent
                    if k[0] not in crons or k[1] <= crons[k[0]].done_ms]:
            del self._cron_sent[key]
        for c in crons.values():
            d = cron.due(c, now)
            if d is None:
                continue
            sent = self._cron_sent.get((c.name, d))
            if sent is not None and now - sent < limits.proposal_retry_ms:
                continue
            self._cron_sent[(c.name, d)] = now
            self._count("cron_fires_proposed")
            self.proposals.duty({"k": "cron", "op": "fire", "t": now, "name": c.name,
                                 "due": d})
