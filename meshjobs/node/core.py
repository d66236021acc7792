"""The job node: one member's decisions, as a pure state machine.

Theory of operation. The node reads the committed job table and takes events: control requests,
committed entries (with their outcomes), changes of the Raft view, frames from other members,
ends of items the driver ran, and ticks of time. It answers with effects: entries to propose,
answers to clients, frames to send, items to run or cut, blobs to pin, unpin or copy. The jobs
thread (`jobsd.py`) feeds it and carries its effects out through the durability gate: every effect
but a proposal waits until the journal it depends on is fsynced.

Rule 1: pure. No IO, threads, clocks or randomness: time comes in events, ids come from the
        injected `random.Random`.
Rule 2: level-triggered. After every batch of events, `take()` compares what the table says with
        what this member is doing (items leased to it and not running, runs whose lease is gone,
        leases of members or incarnations that are gone, pending items and free slots) and emits
        what closes the gap. An effect that is lost (a proposal that never commits, a frame that
        never arrives) is made again later; the table, deduplicating by request id and lease
        epoch, makes a repeat harmless.
Rule 3: only the leader proposes leases, revokes and results, and only while it is ready (its
        table holds every committed entry of its term). Other members report to it, forward
        changes to it and send it their results (`follow.py`).
Rule 4: a change is answered only once its entry is applied; a read is answered from this
        member's own committed table.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

from meshjobs import bulk, cron, limits, quotas, reruns, waits
from meshjobs.compact import entry_payloads, pack_items
from meshjobs.control import (
    CHANGE_OPS,
    OUTPUT_INDEX,
    READ_ITEM_OPS,
    Answer,
    ControlError,
    parse_request,
)
from meshjobs.node import reads
from meshjobs.node.catchup import CatchUpRing
from meshjobs.node.changes import Change, Changes
from meshjobs.node.clock import CommittedClock
from meshjobs.node.copies import Copies, Recopies
from meshjobs.node.events import (
    MEMBER_OWNER,
    Applied,
    BlobBytes,
    BlobsCopied,
    Ctl,
    Cut,
    DiskFull,
    DumpReady,
    FrameIn,
    ItemEnded,
    NodeConfig,
    PeerLink,
    Pin,
    Pressure,
    Run,
    Send,
    Tick,
    Unpin,
    UnpinAllBut,
    View,
    spec_digest,
)
from meshjobs.node.feed import Feed
from meshjobs.node.follow import Follower
from meshjobs.node.heard import Hearing
from meshjobs.node.hooks import Notices, Orders
from meshjobs.node.leader import Leadership
from meshjobs.node.members import Members
from meshjobs.node.proposals import Proposals
from meshjobs.node.ready import Ready
from meshjobs.node.runs import Runs
from meshjobs.node.storage import Storage
from meshjobs.table import RID_REUSED, JobTable


def _other_request(fp: str | None, seen_fp: Any) -> bool:
    """Is a committed change under a request id another request than the one waiting under it
    (both bound to fingerprints, and they differ)? Then the waiting one is refused (422)."""
    return fp is not None and seen_fp is not None and seen_fp != fp


def _rows_ok(rows: Any) -> bool:
    return isinstance(rows, list) and len(rows) <= limits.result_batch_max and all(
        isinstance(r, list) and 10 <= len(r) <= 12 and isinstance(r[0], str) and type(r[1]) is int
        and type(r[2]) is int for r in rows)


def _pool_user_bound(job: Any, pool: Any) -> tuple[str, ...] | None:
    """What the driver holds a pool's user to: the submitter's run_as, when the item runs as
    its pool's user (the job names none) and the submitter has one."""
    if job.user is not None or job.run_as is None or pool is None or pool.user is None:
        return None
    return tuple(job.run_as)


def _output_paths(job: Any, i: int) -> tuple[str | None, str | None]:
    """The paths item `i` of `job` also writes its stdout and stderr to (`{index}` filled in)."""
    return tuple(None if p is None else p.replace(OUTPUT_INDEX, str(i))  # type: ignore[return-value]
                 for p in (job.stdout_path, job.stderr_path))


class JobNode:
    """One member's job node. Feed it with `step`, collect its effects with `take`."""

    def __init__(self, table: JobTable, config: NodeConfig, rng: random.Random) -> None:
        self.table = table
        self.cfg = config
        self.rng = rng
        self.now_ms = 0
        self.view = View()
        self._out: list[Any] = []
        self.proposals = Proposals(self._count, self._emit)
        self.clock = CommittedClock(config.boot)  # committed time, as this member reckons it
        # Changes and reads in flight, forwarded, waiting or parked (changes.py).
        self.changes = Changes(config, table, self._count, self._emit)
        # The feed of committed changes (`changes` op, GET /events).
        self.feed = Feed(table, self._count, self._reply)
        self.runs = Runs(self._count)  # items running here, results not yet committed
        # Results (job, index, epoch) and submits ("in", rid) waiting for their blobs to be on
        # enough members (copies.py).
        self.copies = Copies(config, self.runs, self._others, self._count, self._emit,
                             self._reply, self._carry_on)
        self._was_ready = False
        self._whole = False  # a voter's table has caught up once since start (`_behind`)
        self.storage = Storage(self._count)
        self._links: dict[str, bool] = {}
        # Restoring blob_copies after a member is lost (copies.py).
        self.recopies = Recopies(config, table, self._count, self._emit)
        self.roster = Members(config, self._count)  # what the leader knows of the members
        # Recent committed entries (prev table index, index, entry), to catch workers up.
        # Kept only while the leader knows of worker members, or by a voter once a lease went to
        # a member that is not a voter (so that a new leader catches the workers up with
        # entries, not each with the whole table); bounded by entries and by rows.
        self.ring = CatchUpRing()
        self._workers_seen = False
        # item_records_built is there from the start: what reads cost is seen before any read.
        self.counts: dict[str, int] = {"item_records_built": 0}
        self.orders = Orders(config, table, self.roster.boot_of, self._count, self._emit)
        self.notices = Notices(table, self._count, self._emit)
        self.follower = Follower(config, table, self._count, self._emit, self._set_view,
                                 self._applied)
        self.leadership = Leadership(config, table, self.roster, self.proposals, self.orders,
                                     self.ring, self._count, self._emit, self._takes_no_work)
        self._handlers = self._handler_table()

    # --- stepping ---------------------------------------------------------------------------

    def step(self, ev: Any) -> None:
        """Take one event: the handler of its type. An event of a type the node has no handler
        for is a bug of ours (events.EVENTS lists them all): it crashes."""
        handler = self._handlers.get(type(ev))
        if handler is None:
            raise AssertionError(f"the node has no handler for the event {ev!r}")
        handler(ev)

    def _handler_table(self) -> dict[type, Callable[[Any], None]]:
        """Event type -> handler: one per type of events.EVENTS (a test checks it)."""
        return {
            Tick: self._on_tick,
            Ctl: lambda ev: self._ctl(ev.token, ev.req),
            Applied: self._applied,
            View: self._on_view,
            ItemEnded: self._ended,
            FrameIn: lambda ev: self._frame(ev.peer, ev.ftype, ev.body),
            PeerLink: self._on_link,
            BlobsCopied: lambda ev: self._copied(ev.member, ev.digests),
            Pressure: self.storage.on_pressure,
            DiskFull: self.storage.on_disk_full,
            BlobBytes: self.storage.on_blob_bytes,
            DumpReady: self.leadership.dump_ready,
        }

    def _on_tick(self, ev: Tick) -> None:
        if ev.now_ms > self.now_ms:
            self.now_ms = ev.now_ms
        self.roster.tick(self.now_ms)
        self.clock.tick(self.now_ms if ev.mono_ms is None else ev.mono_ms)

    def _on_view(self, ev: View) -> None:
        if ev.is_leader and not self.view.is_leader:
            self.roster.new_reign(self.now_ms)
            self.recopies.new_reign()
        if self.view.is_leader and (not ev.is_leader or ev.term != self.view.term):
            self.runs.drop_others()  # their members send them to the next reign
        if ev.term != self.view.term or not ev.is_leader:
            self.proposals.new_reign()
        if ev.leader is not None:
            self.follower.leader_seen_ms = self.now_ms
        if ev.leader != self.view.leader:
            self.changes.new_leader()
        self.view = ev

    def _on_link(self, ev: PeerLink) -> None:
        self._links[ev.peer] = ev.up
        if not ev.up:
            self.copies.link_down(ev.peer)

    def take(self) -> list[Any]:
        """Reconcile, then hand over every effect made since the last call."""
        self.clock.observe(self.table, self.now_ms)
        self._reconcile()
        self.proposals.flush(self.now_ms, self._leading(), (self.clock.now_ms(), self.cfg.boot))
        out, self._out = self._out, []
        return out

    def ready(self) -> Ready:
        """`take`, sorted by the durability gate (node/ready.py): what to log, what may leave
        at once, what must wait for the sync."""
        return Ready.of(self.take())

    def _emit(self, eff: Any) -> None:
        """An effect of this round (handed over by `take`)."""
        self._out.append(eff)

    def next_deadline_ms(self) -> int | None:
        """When the node next needs a tick even if nothing happens."""
        ds = self.changes.deadlines()
        ds += self.feed.deadlines()
        ds += [p[3] for p in self.changes.parked]
        ds += self.copies.deadlines()
        held = self.proposals.deadline_ms()
        if held is not None:
            ds.append(held)
        due = self.table.next_due_ms(self.now_ms)
        if due is not None:
            ds.append(due)
        due = reruns.next_due_ms(self.table, self.now_ms) if self._leading() else None
        if due is not None:
            ds.append(due)
        if self.table.crons and self._leading():
            wake = cron.next_wake_ms(self.table.crons.values(), self.now_ms)
            if wake is not None:
                ds.append(wake)
        return min(ds) if ds else None

    def _count(self, name: str, n: int = 1) -> None:
        self.counts[name] = self.counts.get(name, 0) + n

    def _reply(self, token: int, status: int, body: Any) -> None:
        self._answer(token, Answer(status, body))

    def _leading(self) -> bool:
        return self.view.is_leader and self.view.ready

    def _new_change(self, tokens: list[int], op: str, job_id: str | None,
                    req: dict | None = None, fp: str | None = None) -> Change:
        return self.changes.new_change(self.now_ms, tokens, op, job_id, req, fp)

    def _rid_reused(self, req: dict) -> bool:
        """Whether a change's request id was used before for a different request: an
        idempotency key is bound to one method, path and body (its fingerprint)."""
        fp = req.get("fp")
        if fp is None:
            return False
        rid = req["rid"]
        seen = self.table.rids.get(rid)
        if seen is not None:
            other = seen.get("fp")
        else:
            ch = self.changes.pending.get(rid) or self.changes.forwarded.get(rid)
            other = ch.fp if ch is not None else None
            if other is None:
                other = self.copies.input_fp(rid)
        return other is not None and other != fp

    # --- control ------------------------------------------------------------------------------

    def _ctl(self, token: int, raw: Any, forwarded: bool = False) -> None:
        try:
            req = parse_request(raw)
        except ControlError as e:
            self._count("ctl_bad")
            self._answer(token, e.answer())
            return
        op = req["op"]
        self._count("ctl_" + op)
        if op == "get":
            self._get(token, req)
        elif op in READ_ITEM_OPS:
            self._read_items(token, req)
        elif op == "changes":
            self.feed.op(token, req, self.now_ms)
        elif (op == "list" or (op == "bulk" and (req["action"] == "status" or req["dry_run"]))) \
                and self._behind():
            self._reply(token, 503, {"error": self._behind_error("which jobs there are")})
        elif op == "list":
            self._list(token, req)
        elif op == "fleet":
            if self._leading() or forwarded or not self._ask_leader_for_fleet(token):
                self._reply(token, 200, self.fleet())
        elif op == "pools":
            if self._leading() or forwarded or not self._ask_leader_for_fleet(token, "pools"):
                self._reply(token, 200, self.pools())
        elif op == "health":
            self._reply(token, 200, self.health())
        elif op == "metrics":
            self._reply(token, 200, self.metrics())
        elif op == "cron" and req["action"] in ("list", "get"):
            self._cron_read(token, req)
        elif op == "bulk" and req["action"] == "status":
            self._reply(token, 200, bulk.status(self.table, req))
        elif op == "bulk" and req["dry_run"]:
            self._reply(token, 200, bulk.dry_run(self.table, req))
        elif op == "submit" and self.storage.disk_full and not forwarded:
            self._count("ctl_refused_disk_full")
            self._reply(token, 507, {"error": self._disk_full_error()})
        elif op in CHANGE_OPS and self._rid_reused(req):
            self._count("ctl_rid_reused")
            self._reply(token, 422, {"error": RID_REUSED})
        elif op == "submit" and not forwarded and self._copy_inputs_first(token, req):
            return
        elif self._leading() or forwarded:
            self._change(token, req)
        else:
            self._forward(token, req)

    def _list(self, token: int, req: dict) -> None:
        """The job list. Without a limit (older callers): every matching job, oldest first, as
        a list. With one: a page newest first, {"jobs": [...], "next": cursor or None, "fresh":
        bool}, where the cursor is the submit seq of the page's last job (the next page is what
        came before it)."""
        state, tag, pool = req["state"], req["tag"], req.get("pool")

        def wanted(j: Any) -> bool:
            return ((state is None or j.state == state) and (tag is None or tag in j.tags)
                    and (pool is None or j.pool == pool))

        if "limit" not in req:
            self._reply(token, 200, [self.table.record(j) for j in self.table.jobs.values()
                                     if wanted(j)])
            return
        limit, after = req["limit"], req.get("after")
        page: list[Any] = []
        more = False
        for j in sorted(self.table.jobs.values(), key=lambda j: j.seq, reverse=True):
            if (after is not None and j.seq >= after) or not wanted(j):
                continue
            if len(page) == limit:
                more = True
                break
            page.append(j)
        # `fresh`: whether this member's table follows a leader it hears (health's "fresh"); a
        # member cut off from the leader answers from its table all the same, and says so.
        self._reply(token, 200, {"jobs": [self.table.record(j) for j in page],
                                 "next": str(page[-1].seq) if more else None,
                                 "fresh": self._fresh()})

    def _takes_no_work(self) -> bool:
        """Blob memory pressure or a full disk: this member takes no new leases."""
        return self.storage.takes_no_work()

    def _disk_full_error(self) -> str:
        return (f"the disk of member {self.cfg.member} is full ({self.storage.disk_free} bytes free, "
                "under [blobs] disk_free_min): it is read-only and takes no submits until space "
                "is freed on it; submit through another member, or free space")

    def _copy_inputs_first(self, token: int, req: dict) -> bool:
        """A submit's stdin blobs go to `blob_copies` members before the submit goes on
        (copies.py). True when the submit now waits for that."""
        return self.copies.inputs_first(token, req, self.now_ms, self._new_id)

    def _get(self, token: int, req: dict) -> None:
        job = self.table.jobs.get(req["id"])
        if job is None:
            if not self._ask_leader_for_job(token, req):
                self._not_found(token, req["id"])
            return
        since = req.get("since")
        # A local client that asked for the items as a copy (`copy_items`: its HTTP edge builds
        # the item records, not this thread) gets an `ItemRows`; a peer gets the list.
        items = "copy" if req["items"] and req.get("copy_items") else req["items"]
        if req["wait_ms"] and not job.finished and (since is None or job.version <= since):
            self.changes.waiters.setdefault(job.id, []).append(
                (token, items, self.now_ms + req["wait_ms"], since))
            return
        if items is True:
            self._count("item_records_built", job.n)
        # The record's version goes with it: a member that asked on its client's behalf answers
        # once its own table has the job (read your writes, as for a forwarded change).
        self._answer(token, Answer(200, self._job_record(job, items)), job.version)

    def _job_record(self, job: Any, items: bool | str) -> dict:
        """A job's record as `GET /jobs/{id}` answers it: with why its pending items wait
        (meshjobs/waits.py)."""
        rec = self.table.record(job, items=items)
        rec.update(waits.fields(self.table, job, self.now_ms))
        return rec

    def _read_items(self, token: int, req: dict) -> None:
        """One item, a page of items, a slice of their output digests (node/reads.py): what
        the read returns is built, not a record of every item. A job this member does not know
        yet is asked of the leader, as for `get`."""
        job = self.table.jobs.get(req["id"])
        if job is None:
            if not self._ask_leader_for_job(token, req):
                self._not_found(token, req["id"])
            return
        status, body, built = reads.answer(self.table, job, req, self.now_ms)
        self._count("item_records_built", built)
        self._answer(token, Answer(status, body), job.version)

    def _ask_leader_for_job(self, token: int, req: dict) -> bool:
        """A job this member does not know may be committed already, its entry not here yet
        (a follower learns of a commit a heartbeat after the leader answered the submit): before
        it says "no such job", a member that does not lead asks the leader (F_CTL), and answers
        with the leader's word once its own table has the job. True when asked."""
        leader = self.view.leader
        if (self._leading() or token in self.changes.remote or leader is None
                or leader == self.cfg.member or req["id"] in self.table.forgotten):
            return False
        self.changes.next_fleet_ask += 1
        rid = f"#get.{self.cfg.member}.{self.changes.next_fleet_ask}"  # no client request id has "#"
        ask = ({"op": "get", "id": req["id"], "items": req["items"], "wait_ms": 0}
               if req["op"] == "get" else req)  # an item read (node/reads.py) goes as it is
        ch = self._new_change([token], "get", req["id"], ask)
        ch.deadline_ms = ch.sent_ms = self.now_ms
        ch.deadline_ms += limits.fleet_ask_ms
        self.changes.forwarded[rid] = ch
        self._count("ctl_get_asked_leader")
        self._out.append(Send(leader, "F_CTL", {"rid": rid, "req": ask}))
        return True

    def _not_found(self, token: int, job_id: str) -> None:
        if job_id in self.table.forgotten:
            self._reply(token, 404, {"error": f"job {job_id} was forgotten"})
        elif self._behind():
            self._reply(token, 503, {"error": self._behind_error(f"whether job {job_id} exists")})
        else:
            self._reply(token, 404, {"error": f"no job {job_id} (see `meshctl jobs`)"})

    def _behind(self) -> bool:
        """Has this member's table not caught up yet since it started? Then a job it does not
        know may exist all the same (it was acknowledged before a restart, and its entry is not
        applied again yet): a read that would say "no such job" is answered 503 instead.

        Once caught up, a member answers reads from its table whatever it hears, and says
        whether it is fresh: a worker cut off from the leader has its table still. A worker
        knows it has caught up from the leader's frames as they come (follow.py), not from
        what it hears when a read is asked: a first read while it is cut off is no reason to
        take it for a member that has just started."""
        if self.cfg.role == "worker":
            return not self.follower.caught_up
        if not self._whole:
            self._whole = not self.view.behind  # latched by the replica as it catches up
        return not self._whole

    def _behind_error(self, what: str) -> str:
        return (f"member {self.cfg.member} has just started and its table is still catching up "
                f"with the job log, so it cannot tell {what} yet: try again in a moment, or ask "
                "another member")

    def _change(self, token: int, req: dict) -> None:
        rid = req["rid"]
        if rid in self.changes.pending:  # the same change asked again while it is in flight
            self.changes.pending[rid].tokens.append(token)
            return
        seen = self.table.rids.get(rid)
        if seen is not None:  # already applied: answer as then
            self._answer_change(token, req["op"], req.get("id"), seen)
            return
        if not self._leading():
            self._count("ctl_no_leader")
            self._reply(token, 503, {"error": "this member does not lead now (an election is "
                                              "under way); try again shortly"})
            return
        if len(self.changes.pending) >= limits.ctl_pending_max:
            self._reply(token, 503, {"error": "too many changes in flight: try again shortly"})
            return
        op = req["op"]
        entry: dict[str, Any] = {"k": op, "rid": rid, "t": self.now_ms}
        if req.get("fp") is not None:
            entry["fp"] = req["fp"]
        if op == "submit":
            job_id = self._submit_entry(token, req, entry)
            if job_id is None:
                return
        elif op == "cron":
            if req["action"] == "add" and req["job"]["pool"] not in self._pools():
                pool = req["job"]["pool"]
                if self._not_known_yet(token, f"whether some member offers pool {pool!r}"):
                    return
                pools = self._pools()
                self._reply(token, 400, {"error": f"unknown pool {pool!r}: this fleet has "
                                                  f"{', '.join(sorted(pools)) or 'no pools'}"})
                return
            if req["action"] == "add" and not self._schedules_within_quota(token, req):
                return
            entry = cron.entry(req, self.now_ms)
            job_id = None
        elif op == "bulk":
            # A filter is resolved here, against the leader's committed table; the entry names
            # the ids, so that every member changes the same jobs.
            ids, nxt, skipped = bulk.resolve_owned(self.table, req)
            if not ids:
                self._reply(token, 200, bulk.answer(self.table, req["action"], [], False, None,
                                                    skipped))
                return
            entry = bulk.entry(req, ids, nxt, self.now_ms, skipped)
            job_id = None
        elif op in ("pool", "member"):
            job_id = None
            hearing = self._hearing()
            refused = self.orders.entry(req, entry, self._pools(), self.roster.known,
                                        hearing, self.now_ms)
            if refused is not None:
                if hearing is not None and refused.status == 503:
                    self._count("ctl_not_known_yet")
                self._reply(token, refused.status, refused.body)
                return
        else:
            job_id = req["id"]
            if job_id in self.table.forgotten:
                self._not_found(token, job_id)  # a tombstone is a fact even a stale table knows
                return
            # A job this table does not know may still exist: a member that believes it leads
            # may have been deposed, and its table may lag. "No such job" must come from a
            # committed entry (the table refuses it with 404), never from a stale table.
            entry["id"] = job_id
            entry.update(by=req["by"], br=req["by_role"])  # the table checks ownership
            if op == "tone":
                for k in ("priority", "hold", "max_leases"):
                    if k in req:
                        entry[k] = req[k]
            elif op == "rerun":
                entry["failed_only"] = req["failed_only"]
        self.changes.pending[rid] = self._new_change([token], op, job_id, fp=req.get("fp"))
        self.proposals.change(entry)

    def _hearing(self) -> Hearing | None:
        """While this leader has not heard from the fleet yet, what it has heard (it cannot
        answer about the members: node/heard.py); None once it can."""
        return self.roster.hearing(self.now_ms, self.table.members_named)

    def _not_known_yet(self, token: int, what: str) -> bool:
        """Answer "not known yet" (503, to retry: node/heard.py) when this leader cannot tell
        `what` yet; True when it answered."""
        hearing = self._hearing()
        if hearing is None:
            return False
        self._count("ctl_not_known_yet")
        self._answer(token, hearing.answer(what, self.now_ms))
        return True

    def _pools(self) -> set[str]:
        """The pools some member of the fleet offers (as far as this member knows)."""
        pools = set(self.cfg.pools)
        for name, m in self.roster.known.items():
            if self._alive(name, m.boot):
                pools.update(m.pools)
        return pools

    def _submit_entry(self, token: int, req: dict, entry: dict) -> str | None:
        spec = dict(req["spec"])
        pools = self._pools()
        if spec["pool"] not in pools:
            if self._not_known_yet(token, f"whether some member offers pool {spec['pool']!r}"):
                return None
            self._reply(token, 400, {"error": f"unknown pool {spec['pool']!r}: this fleet has "
                                              f"{', '.join(sorted(pools)) or 'no pools'}"})
            return None
        as_bytes: dict[str, bytes] = {}  # an array's repeated payload: one bytes object
        items = [None if d is None else as_bytes.get(d) or as_bytes.setdefault(d, bytes.fromhex(d))
                 for d in req["items"]]
        limit = req.get("quota", {}).get("pending_items_max")
        if limit is not None:
            holds = quotas.pending_items(self.table, req["by"])
            if holds + len(items) > limit:
                self._reply(token, 429, {
                    "error": f"{req['by']} may hold at most {limit} unfinished items "
                             f"(pending_items_max) and holds {holds}; this job adds {len(items)}: "
                             "wait for its jobs to finish, cancel some, or ask an admin to raise "
                             "the token's pending_items_max",
                    "limit": "pending_items_max", "value": limit, "holds": holds})
                return None
        running_max = req.get("quota", {}).get("running_items_max")
        if running_max is not None:
            spec["running_items_max"] = running_max  # the table leases within it (quotas.py)
        digest = spec_digest(spec, items)
        job_id = spec.pop("id")
        if job_id is None:
            job_id = self._new_id()
        elif job_id in self.table.forgotten:
            self._reply(token, 409, {"error": f"job id {job_id} was used by a job that is now "
                                              "forgotten; submit with another id"})
            return None
        else:
            job = self.table.jobs.get(job_id)
            if job is not None:
                if job.digest == digest:
                    self._reply(token, 200, self.table.record(job))
                else:
                    self._reply(token, 409, {"error": f"a different job with id {job_id} exists; "
                                                      "submit with another id or the same spec"})
                return None
        if spec.get("member") == "*":
            # A fan-out: its members are fixed here, once, and committed with it (placement.py).
            on = self._fanout_members(token, spec["pool"], len(items))
            if on is None:
                return None
            entry["on"] = on
            items = items * len(on)
        # One payload and a count, or the distinct payloads and an index each (compact.py),
        # not one payload per item: the entry, the log and every apply stay small.
        entry.update({"id": job_id, "spec": spec, "dg": digest, **pack_items(items)})
        return job_id

    def _fanout_members(self, token: int, pool: str, n_items: int) -> list[str] | None:
        """The members a fan-out of `pool` runs on: those alive that offer the pool now (this
        one among them), sorted by name; None when it cannot be said (the answer is sent).
        Not before this leader has heard from the fleet (node/heard.py): the list is fixed
        once, in the submit entry, and a member that has not reported yet would be left out
        for good."""
        if n_items != 1:
            self._reply(token, 400, {"error": "a fan-out job (member *) has one item per member: "
                                              "give at most one item"})
            return None
        if self._not_known_yet(token, "which members a fan-out (member *) runs on"):
            return None
        names = {self.cfg.member} if pool in self.cfg.pools else set()
        names.update(name for name, m in self.roster.known.items()
                     if name != self.cfg.member and m.boot and pool in m.pools
                     and self._alive(name, m.boot))
        if not names:
            self._reply(token, 409, {"error": f"no alive member offers pool {pool!r}, so a "
                                              "fan-out (member *) has nowhere to run: start "
                                              "one, or submit later"})
            return None
        if len(names) > limits.fanout_members_max:
            self._reply(token, 400, {"error": f"a fan-out runs on at most "
                                              f"{limits.fanout_members_max} members, and pool "
                                              f"{pool!r} has {len(names)}: use a glob instead"})
            return None
        return sorted(names)

    def _new_id(self) -> str:
        while True:
            job_id = f"{self.now_ms // 1000:x}-{self.rng.getrandbits(32):08x}"
            if job_id not in self.table.jobs and job_id not in self.table.forgotten and all(
                c.job_id != job_id for c in self.changes.pending.values()
            ):
                return job_id

    def _answer_change(self, token: int, op: str, job_id: str | None, outcome: dict,
                       index: int = 0) -> None:
        index = index or self.table.applied_index
        if op in ("pool", "member"):
            self._answer(token, self.orders.answer(outcome), index)
            return
        if op == "cron":
            self._answer(token, self._cron_answer(outcome), index)
            return
        if op == "bulk" and outcome.get("ok"):
            self._answer(token, Answer(200, bulk.answer(
                self.table, outcome.get("op", ""), outcome.get("rows") or [], False,
                outcome.get("next"), outcome.get("skipped_not_owner", 0))), index)
            return
        if not outcome.get("ok"):
            answer = Answer(outcome.get("status", 409), {"error": outcome.get("error", "refused")})
        else:
            job_id = outcome.get("id", job_id)
            job = self.table.jobs.get(job_id) if job_id is not None else None
            if op == "forget":
                answer = Answer(200, {"id": job_id, "forgotten": True})
            elif job is None:
                answer = Answer(404, {"error": f"no job {job_id}"})
            else:
                answer = Answer(201 if outcome.get("new") else 200, self.table.record(job))
        self._answer(token, answer, index)

    # --- committed entries --------------------------------------------------------------------

    def _applied(self, ev: Applied) -> None:
        e, out = ev.entry, ev.outcome
        if ev.prev is not None and (self._workers_seen or self.roster.workers_known()):
            self.ring.add(ev.prev, ev.index, e)
        if ev.prev is not None:
            self.feed.follows(ev.prev, ev.index)
        if not isinstance(e, dict):
            return
        kind = e.get("k")
        if out.get("ok") and kind != "batch":
            self.feed.note(ev.index, kind, e, out)
        if kind == "batch":
            self.proposals.applied(e.get("p"))
            outcomes = out.get("outcomes")
            if out.get("ok") and isinstance(outcomes, list):
                for sub, sub_out in zip(e["es"], outcomes, strict=True):
                    self._applied(Applied(ev.index, sub, sub_out, None))
            return
        rid = e.get("rid")
        if rid is not None and rid in self.changes.pending:
            ch = self.changes.pending.pop(rid)
            for token in ch.tokens:
                if _other_request(ch.fp, e.get("fp")):
                    # Another request under the same key committed first (its entry was in the
                    # log before this member's table had it): ours will be refused.
                    self._count("ctl_rid_reused")
                    self._reply(token, 422, {"error": RID_REUSED})
                else:
                    self._answer_change(token, ch.op, ch.job_id, out, ev.index)
        if not out.get("ok"):
            return
        if self._leading():
            self.notices.ends(kind, e, out, ev.index)
        if kind == "submit" and out.get("new"):
            digests = tuple(sorted({d.hex() for d in entry_payloads(e) if d is not None}))
            if digests:
                self._out.append(Pin(e["id"], digests))
        elif kind == "lease":
            hints: dict[str, list] = {}
            for g in e["g"]:
                self.leadership.leased(g[0], g[1])
                if (not self._workers_seen and self.cfg.role == "voter" and self.cfg.voters
                        and g[2] != self.cfg.member and g[2] not in self.cfg.voters):
                    self._workers_seen = True
                m = self.roster.known.get(g[2])
                if self._leading() and m is not None and m.role == "worker":
                    hints.setdefault(g[2], []).append([g[0], g[1]])
            # A worker learns its leases from F_JOB_STATE; F_LEASE tells it at once that there
            # are some at this index, so that one that is behind asks to catch up.
            for member, items in hints.items():
                self._out.append(Send(member, "F_LEASE", {"index": ev.index, "g": items}))
                self.leadership.urgent.add(member)  # its entries go now (leader.push_state)
        elif kind == "result":
            jobs = self.table.jobs
            for r in e["r"]:
                key = (r[0], r[1], r[2])
                job = jobs.get(r[0])
                if job is not None:
                    self.leadership.note_run(job.pool, r[8], r[9])
                self.runs.committed(key)
                self.copies.drop(key)
                if (self.recopies.lost and job is not None and self._leading()
                        and self.recopies.has_room()
                        and 0 <= r[1] < job.n and job.epoch[r[1]] == r[2]):
                    # Committed after the walk for a lost member began: it may name that
                    # member as holding a copy.
                    self.recopies.item(job, r[1], self.now_ms, self._links)
        elif kind == "revoke":
            for lease in e["l"]:
                self.leadership.revoked(tuple(lease))
        elif kind == "forget":
            self._out.append(Unpin(e["id"]))
        elif kind == "bulk" and e.get("op") == "forget":
            for job_id, what, _ in out["rows"]:
                if what == "changed":
                    self._out.append(Unpin(job_id))
        elif kind == "expire":
            for job_id in out["expired"]:
                self.leadership.expired(job_id)
                self._out.append(Unpin(job_id))

    def _ended(self, ev: ItemEnded) -> None:
        key = self.runs.ended(ev)
        if key is None:
            return
        # The outputs are pinned for the job already: the blob writers pin them in the same
        # transaction that stores them (and the empty payload is pinned for good).
        outs = tuple(d for d in (ev.stdout, ev.stderr) if d is not None)
        self.copies.ended(key, ev.job_id, outs)

    # --- blob copies --------------------------------------------------------------------------

    def _copied(self, member: str, digests: tuple[str, ...]) -> None:
        got = set(digests)
        self.recopies.copied(member, got, self.now_ms, self._links)
        self.copies.copied(member, got)

    def _others(self) -> set[str]:
        """The other members this member knows of."""
        return ({v for v in self.cfg.voters} | set(self.roster.known)) - {self.cfg.member}

    def _carry_on(self, token: int, req: dict) -> None:
        """Go on with a submit whose inputs are copied: proposed here, or sent to the leader."""
        if self._leading():
            self._change(token, req)
        else:
            self._forward(token, req)

    def _ask_copies(self) -> None:
        self.copies.ask(self.now_ms, self._links)

    # --- reconciling --------------------------------------------------------------------------

    def _reconcile(self) -> None:
        now = self.now_ms
        for pending in (self.changes.pending, self.changes.forwarded):
            for rid, ch in list(pending.items()):
                if rid in self.table.rids and pending is self.changes.pending:
                    del pending[rid]
                    seen = self.table.rids[rid]
                    for token in ch.tokens:
                        if _other_request(ch.fp, seen.get("fp")):
                            self._count("ctl_rid_reused")
                            self._reply(token, 422, {"error": RID_REUSED})
                        else:
                            self._answer_change(token, ch.op, ch.job_id, seen)
                elif ch.deadline_ms <= now and ch.op == "get":
                    del pending[rid]  # the leader did not answer in time: what this member knows
                    for token in ch.tokens:
                        self._not_found(token, ch.job_id or "")
                elif ch.deadline_ms <= now and ch.op in ("fleet", "pools"):
                    del pending[rid]  # the leader did not answer in time: what this member knows
                    for token in ch.tokens:
                        self._reply(token, 200, self._partial_fleet() if ch.op == "fleet"
                                    else {**self.pools(), "partial": True})
                elif ch.deadline_ms <= now and ch.not_known is not None:
                    del pending[rid]  # the leader still could not tell (node/heard.py)
                    for token in ch.tokens:
                        self._answer(token, ch.not_known)
                elif ch.deadline_ms <= now:
                    del pending[rid]
                    self._count("ctl_timeouts")
                    for token in ch.tokens:
                        self._reply(token, 503, {
                            "error": "the change was not committed in time (no leader or no "
                                     "quorum); it may still be applied: retry with the same "
                                     "request id"})
        self._answer_waiters()
        self._release_parked()
        self._ask_copies()
        if self._leading():
            if not self._was_ready:
                self._was_ready = True
                self._out.append(UnpinAllBut(frozenset(self.table.jobs) | {MEMBER_OWNER}))
            # Changes this member forwarded before it came to lead: its own to propose now.
            for rid, ch in list(self.changes.forwarded.items()):
                del self.changes.forwarded[rid]
                if ch.op in ("fleet", "pools"):
                    for token in ch.tokens:  # this member leads now: its own view is whole
                        self._reply(token, 200, self.fleet() if ch.op == "fleet" else self.pools())
                elif ch.req is not None:
                    for token in ch.tokens:
                        self._change(token, ch.req)
            self._lead()
        else:
            self._follow()
        self._follow_own_leases()

    def _answer_waiters(self) -> None:
        self.feed.answer_waiters(self.now_ms)
        if not self.changes.waiters:
            return
        now = self.now_ms
        for job_id in list(self.changes.waiters):
            job = self.table.jobs.get(job_id)
            ws = self.changes.waiters[job_id]
            keep = []
            for token, items, deadline, since in ws:
                if job is None:
                    self._not_found(token, job_id)
                elif (job.finished or deadline <= now
                      or (since is not None and job.version > since)):
                    if items is True:
                        self._count("item_records_built", job.n)
                    self._reply(token, 200, self._job_record(job, items))
                else:
                    keep.append((token, items, deadline, since))
            if keep:
                self.changes.waiters[job_id] = keep
            else:
                del self.changes.waiters[job_id]

    def _follow_own_leases(self) -> None:
        table = self.table
        for key in list(self.runs.running):
            if not table.lease_current(*key):
                ended = self.runs.gone(key)
                self.copies.drop(key)
                if not ended:
                    self._out.append(Cut(*key))
        # A lease naming this incarnation's boot id was made after this process started, so it
        # is safe to run whatever the member's role; leases of earlier boots are revoked. At
        # most a pool's slots run at once: items leased ahead wait here, in lease order.
        busy: dict[str, int] = {}
        for (jid, _i, _epoch), ended in self.runs.running.items():
            if not ended:
                pool_name = table.jobs[jid].pool
                busy[pool_name] = busy.get(pool_name, 0) + 1
        for jid, i, epoch, boot in table.leases_of(self.cfg.member):
            key = (jid, i, epoch)
            if boot != self.cfg.boot or key in self.runs.running:
                continue
            job = table.jobs[jid]
            if not self.orders.may_start(job):
                continue  # its pool is held here, or this member is stopping
            pool = self.cfg.pools.get(job.pool)
            if pool is not None:
                if busy.get(pool.name, 0) >= self._slots_here(pool):
                    continue
                busy[pool.name] = busy.get(pool.name, 0) + 1
            runtime = job.runtime_s
            if pool is not None and pool.runtime_s is not None:
                runtime = pool.runtime_s if runtime is None else min(runtime, pool.runtime_s)
            stdin = job.stdin[i]
            self.runs.started(key)
            self._count("runs_started")
            self._out.append(Run(jid, i, epoch, list(job.argv), dict(job.env), job.cwd,
                                 None if stdin is None else stdin.hex(), runtime,
                                 pool.kind if pool is not None else "command",
                                 job.user if job.user is not None
                                 else pool.user if pool is not None else None,
                                 job.inherit_env, *_output_paths(job, i), pool=job.pool,
                                 run_as=_pool_user_bound(job, pool)))
        self._stop_check()

    # --- frames between members, seen from both ends --------------------------------------------
    # Frames are hints that make things faster; none is needed for correctness (follow.py).

    def _frame(self, peer: str, ftype: str, body: Any) -> None:
        self._count("frames_in_" + ftype)
        handler = {
            "F_JOB_HAVE": self._on_have,
            "F_JOB_STATE": self._on_state,
            "F_LEASE": lambda _peer, body: self.follower.on_lease(body),
            "F_RESULT": self._on_result,
            "F_CTL": self._on_ctl,
            "F_CTL_REPLY": self._on_ctl_reply,
        }.get(ftype)
        if handler is None:
            self._count("frames_unhandled")
            return
        handler(peer, body)

    def _on_have(self, peer: str, body: Any) -> None:
        if self.view.is_leader:
            # Also before its table is ready: the reports of this reign count from its start
            # (members.py, heard.py).
            self.roster.have(peer, body, self.now_ms)
        elif not self.roster.heard_from(peer, body, self.now_ms):
            return
        if self._leading():
            return
        if self.cfg.role == "voter" and isinstance(body, dict) and body.get("role") == "worker":
            # Tell a worker who leads, so that it reports there.
            self._out.append(Send(peer, "F_JOB_STATE", {
                "term": self.view.term, "leader": self.view.leader, "voters": list(self.cfg.voters)}))

    def _on_result(self, peer: str, body: Any) -> None:
        rows = body.get("r") if isinstance(body, dict) else None
        if not _rows_ok(rows):
            self._count("frames_bad_result")
            return
        if not self.view.is_leader:
            return  # the member sends it again to whoever leads
        # Elected but not ready (its table may not hold every lease yet): taken all the same,
        # for the member sends it to this reign once; proposed once this member is ready, the
        # table refuses a stale one. Forgotten if this member stops leading first.
        ready = self.view.ready
        for r in rows:
            key = (r[0], r[1], r[2])
            if key not in self.runs.results and (not ready or self.table.lease_current(*key)):
                self.runs.from_member(key, r, peer)

    def _on_ctl(self, peer: str, body: Any) -> None:
        if not isinstance(body, dict) or not isinstance(body.get("rid"), str):
            self._count("frames_bad_ctl")
            return
        token = self.changes.remote_token(peer, body)
        self._ctl(token, body.get("req"), forwarded=True)

    def _on_ctl_reply(self, peer: str, body: Any) -> None:
        self.changes.on_ctl_reply(body, self.now_ms)

    def _release_parked(self) -> None:
        self.changes.release_parked(self.now_ms)

    def _forward(self, token: int, req: dict) -> None:
        """A change asked of a member that does not lead: send it to the leader (changes.py)."""
        self.changes.forward(token, req, self.view.leader, self.now_ms)

    def _answer(self, token: int, answer: Answer, index: int = 0) -> None:
        """Every answer goes out here (changes.py)."""
        self.changes.answer(token, answer, index)

    def _on_state(self, peer: str, body: Any) -> None:
        self.follower.on_state(peer, body, self.view, self.now_ms)

    def _set_view(self, view: View) -> None:
        self.view = view

    def _follow(self) -> None:
        """What every non-leader does each round: follow the leader (follow.py), and send it
        this member's results and the changes forwarded to it that are still unanswered."""
        now = self.now_ms
        leader = self.follower.follow(self.view, now, self._have_report)
        if leader is None:
            return
        rows = self._due_results(len(self.runs.results), leader)
        for k in range(0, len(rows), limits.result_batch_max):
            self._out.append(Send(leader, "F_RESULT", {"r": rows[k:k + limits.result_batch_max]}))
        for rid, ch in self.changes.forwarded.items():
            if now - ch.sent_ms >= limits.ctl_resend_ms:
                ch.sent_ms = now
                self._out.append(Send(leader, "F_CTL", {"rid": rid, "req": ch.req}))

    def _have_report(self) -> dict:
        """This member's report to the leader (F_JOB_HAVE)."""
        return {
            "boot": self.cfg.boot, "role": self.cfg.role, "pos": self.table.applied_index,
            "pools": {} if self._takes_no_work() else {
                p.name: p.slots for p in self.cfg.pools.values()},
            "pressure": self.storage.pressure,
            "disk_full": self.storage.disk_full,
            "blob_bytes": self.storage.blob_bytes,
            "running": self.runs.running_count(),
            "items": self.cfg.items,
            "dumps": True,  # a whole table may come as a dump (follow.py)
            "wall_ms": self.now_ms,  # the leader shows how far off its own clock this is
        }

    # --- leading (leader.py) ---------------------------------------------------------------------

    def _lead(self) -> None:
        """A round of the leader's duties, each proposed through `proposals` in this order."""
        self.notices.replay(self.view.term, self.now_ms)
        if self.proposals.may_propose(self.now_ms):
            self.leadership.propose_revokes(self.now_ms)
            self.leadership.propose_leases(self.now_ms, self._frees_slot)
            self._propose_results()
            self.leadership.propose_expiry(self.now_ms, self.clock.now_ms())
            self.leadership.propose_reruns(self.now_ms)
            self._propose_cron()
        self._recopy()
        self.leadership.push_state(self.now_ms, self.view.term)

    def _propose_cron(self) -> None:
        self.leadership.propose_cron(self.now_ms)

    def _recopy(self) -> None:
        """Restore `blob_copies` of committed outputs after a member is lost (node/copies.py)."""
        if self.cfg.blob_copies <= 1:
            return
        self.recopies.walk(self.now_ms, self.roster.lost(self._others(), self.now_ms), self._links)

    def _alive(self, name: str, boot: str | None = None) -> bool:
        """Is this member (in this incarnation, when `boot` is given) alive, as the leader sees it?"""
        return self.roster.alive(name, self.now_ms, boot)

    def _frees_slot(self, key: tuple[str, int, int]) -> bool:
        return self.runs.frees_slot(key, self.copies)

    def _due_results(self, rows_max: int, leader: str) -> list[list]:
        """Results ready to go to `leader` (in this term), marked sent now (runs.py)."""
        return self.runs.due(rows_max, self.now_ms, self.copies, leader, self.view.term)

    def _propose_results(self) -> None:
        now = self.now_ms
        rows = self._due_results(limits.result_batch_max, self.cfg.member)
        if rows:
            self._count("results_proposed", len(rows))
            self.proposals.duty({"k": "result", "t": now, "r": rows})

    # --- orders (hooks.py) ----------------------------------------------------------------------

    def _slots_here(self, pool: Any) -> int:
        return self.orders.slots_here(pool)

    def _stop_check(self) -> None:
        running = self.runs.running_count()
        self.orders.stop_check(running, bool(self.runs.results), self.now_ms)

    def pools(self) -> dict:
        """Per pool, fleet-wide: slots, free, running, pending, held and drained (GET /pools)."""
        return self.orders.pools(self.fleet())

    # --- reads ----------------------------------------------------------------------------------

    def _role(self, name: str) -> str:
        if name == self.view.leader:
            return "leader"
        if name in self.cfg.voters or (name == self.cfg.member and self.cfg.role == "voter"):
            return "follower"
        return "worker"

    def _ask_leader_for_fleet(self, token: int, op: str = "fleet") -> bool:
        """Only the leader hears every member's reports, so a member that does not lead asks it
        for the fleet view (F_CTL), falling back to its own partial view when no leader is
        known or none answers within `fleet_ask_ms`. True when the answer is on its way."""
        leader = self.view.leader
        if leader is None or leader == self.cfg.member:
            return False
        self.changes.next_fleet_ask += 1
        rid = f"#fleet.{self.cfg.member}.{self.changes.next_fleet_ask}"  # no client request id has "#"
        req = {"op": op}
        ch = self._new_change([token], op, None, req)
        ch.deadline_ms = self.now_ms + limits.fleet_ask_ms
        ch.sent_ms = self.now_ms
        self.changes.forwarded[rid] = ch
        self._out.append(Send(leader, "F_CTL", {"rid": rid, "req": req}))
        return True

    def _partial_fleet(self) -> dict:
        """This member's own fleet view, said to be partial (the leader's was not to be had)."""
        return {**self.fleet(), "partial": True}

    def fleet(self) -> dict:
        running = self.runs.running_count()
        me = {
            "name": self.cfg.member,
            "role": self._role(self.cfg.member),
            "alive": True,
            "status": "alive",
            "down_since": None,
            "pools": {p.name: p.slots for p in self.cfg.pools.values()},
            "slots": sum(p.slots for p in self.cfg.pools.values()),
            "running": running,
            "blob_pressure": self.storage.pressure,
            "disk_full": self.storage.disk_full,
            "blob_bytes": self.storage.blob_bytes,
            "last_seen": self.now_ms / 1000.0,
            "items": self.cfg.items,
            "clock_skew_ms": 0,  # the clock the others' are shown against
        }
        members = {self.cfg.member: me}
        for name, m in self.roster.known.items():
            if name == self.cfg.member:
                continue
            alive = self._alive(name, m.boot)
            members[name] = {
                "name": name,
                "role": self._role(name),
                "alive": alive,
                "status": "alive" if alive else "down",
                "down_since": None if alive else m.last_ms / 1000.0,
                "pools": dict(m.pools),
                "slots": sum(m.pools.values()),
                "running": m.running,
                "blob_pressure": m.pressure,
                "disk_full": m.disk_full,
                "blob_bytes": m.blob_bytes,
                "last_seen": m.last_ms / 1000.0 if m.last_ms else None,
                "items": m.items,
                "clock_skew_ms": m.clock_skew_ms,
            }
        for name in self._members_not_reported():
            if name not in members:
                members[name] = self._unreported_row(name)
        self.orders.fleet_rows(members)
        return {"term": self.view.term, "leader": self.view.leader,
                "members": sorted(members.values(), key=lambda r: r["name"])}

    def _members_not_reported(self) -> set[str]:
        """The members a fleet view lists although none of their reports is at hand: the
        voters; and, on the leader, every member heard from here before (leading or not) and
        every member its committed table names. So a member never drops out of the list while
        a new leader waits for reports (heard.py), and one that stopped reporting stays, down."""
        names = set(self.cfg.voters)
        if self._leading():
            names.update(self.roster.heard)
            names.update(self.table.members_named())
        names.discard(self.cfg.member)
        return names

    def _unreported_row(self, name: str) -> dict:
        """A fleet row for a member with no report at hand. On the leader: not heard yet
        (`alive` None) while its reign is younger than `dead_ms`, then down since it was last
        heard (or, never heard here, since the reign began). Elsewhere: unknown (None), as only
        the leader hears the reports."""
        heard_ms = self.roster.heard.get(name)
        alive: bool | None = None
        status, down_since = "unknown", None
        if self._leading():
            status = "not_heard_yet"
            if self.now_ms - self.roster.since_ms >= self.cfg.dead_ms:
                alive, status = False, "down"
                down_since = (heard_ms if heard_ms is not None else self.roster.since_ms) / 1000.0
        return {"name": name, "role": self._role(name), "alive": alive, "status": status,
                "down_since": down_since,
                "pools": {}, "slots": 0, "running": 0,
                "last_seen": heard_ms / 1000.0 if heard_ms else None, "clock_skew_ms": None}

    def health(self) -> dict:
        return {
            # Not ok while read-only: reads are served, but no work is taken.
            "ok": not self.storage.disk_full,
            "state": "read_only" if self.storage.disk_full else "ok",
            "disk_full": self.storage.disk_full,
            "disk_free_bytes": self.storage.disk_free,
            "member": self.cfg.member,
            "role": self.cfg.role,
            "leader": self.view.leader,
            "is_leader": self.view.is_leader,
            "ready": self._leading() or (self.view.leader is not None and (
                self.cfg.role == "voter" or self.view.ready)),
            "term": self.view.term,
            "applied_index": self.table.applied_index,
            "leader_seen_ms_ago": (self.now_ms - self.follower.leader_seen_ms) if self.follower.leader_seen_ms else None,
            # Fresh: this member's table follows a leader it hears from. A member cut off from
            # the leader still answers reads from its table, but says they may be stale.
            "fresh": self._fresh(),
            "jobs": len(self.table.jobs),
        }

    def _fresh(self) -> bool:
        if self._leading():
            return True
        if self.view.leader is None:
            return False
        if self.cfg.role == "worker":
            # Fresh only from the leader itself: a follower's hint of who leads says nothing of
            # whether this member's table still hears the leader's entries. Nor is a worker
            # fresh while the leader's frames have shown it entries it does not hold yet.
            return (self.view.ready and self.follower.leader_seen_ms > 0
                    and self.now_ms - self.follower.leader_seen_ms <= self.cfg.dead_ms
                    and self.follower.in_step())
        return True

    def metrics(self) -> dict:
        m: dict[str, Any] = {"table_" + k: v for k, v in self.table.counts.items()}
        m.update({"node_" + k: v for k, v in self.counts.items()})
        m["jobs"] = len(self.table.jobs)
        m["jobs_forgotten_total"] = len(self.table.forgotten)
        m["items_leased"] = len(self.table.leased)
        m["items_running"] = self.runs.running_count()
        m["changes_in_flight"] = len(self.changes.pending) + len(self.changes.forwarded)
        m["raft_term"] = self.view.term
        m["is_leader"] = 1 if self.view.is_leader else 0
        m["applied_index"] = self.table.applied_index
        m["members_known"] = len(self.roster.known)
        m["blob_pressure"] = 1 if self.storage.pressure else 0
        m["disk_full"] = 1 if self.storage.disk_full else 0
        m["disk_free_bytes"] = self.storage.disk_free
        # Jobs by state, then pool: {"running": {"default": 2}, ...} (labels of meshjobs_jobs).
        by: dict[str, dict[str, int]] = {}
        for j in self.table.jobs.values():
            pools = by.setdefault(j.state, {})
            pools[j.pool] = pools.get(j.pool, 0) + 1
        m["jobs_by_state_pool"] = by
        return m

    # --- schedules (meshjobs/cron.py) -----------------------------------------------------------

    def _cron_read(self, token: int, req: dict) -> None:
        if self._behind():
            self._reply(token, 503, {"error": self._behind_error("which schedules there are")})
        elif req["action"] == "list":
            self._reply(token, 200, {"crons": [cron.record(c, self.now_ms)
                                               for c in self.table.crons.values()]})
        elif req["name"] in self.table.crons:
            self._reply(token, 200, cron.record(self.table.crons[req["name"]], self.now_ms))
        else:
            self._reply(token, 404, {"error": f"no schedule {req['name']} (see `meshctl cron list`)"})

    def _schedules_within_quota(self, token: int, req: dict) -> bool:
        """A new schedule (not a replacement) by an identity that owns schedules_max of them
        already is 429 naming the limit, its value and what it holds. A scan: the fleet keeps
        at most cron_schedules_max schedules."""
        limit = req.get("quota", {}).get("schedules_max")
        if limit is None or req["name"] in self.table.crons:
            return True
        who = req["by"]
        holds = sum(1 for c in self.table.crons.values() if c.owner == who)
        if holds < limit:
            return True
        self._reply(token, 429, {
            "error": f"{who} may own at most {limit} schedules (schedules_max) and owns {holds}: "
                     "remove one (meshctl cron rm NAME), replace one of its own, or ask an admin "
                     "to raise the token's schedules_max",
            "limit": "schedules_max", "value": limit, "holds": holds})
        return False

    def _cron_answer(self, outcome: dict) -> Answer:
        if not outcome.get("ok"):
            return Answer(outcome.get("status", 409), {"error": outcome.get("error", "refused")})
        name = outcome.get("cron")
        if outcome.get("removed"):
            return Answer(200, {"name": name, "removed": True})
        c = self.table.crons.get(name) if isinstance(name, str) else None
        if c is None:
            return Answer(404, {"error": f"no schedule {name} (it was removed since)"})
        return Answer(201 if outcome.get("new") else 200, cron.record(c, self.now_ms))
