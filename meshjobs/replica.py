"""The Raft replica: pysyncobj holding the job table, with meshjobs' durability at its seams.

What pysyncobj does not do for us (docs/durability.md), and where
this module makes up for it:

- Its journal never fsyncs and has no checksums: `createJournal` is replaced by
  `DurableJournal`, and the jobs thread calls `sync()` before any answer that depends on the log.
- Its transport sends AppendEntries acknowledgements and votes before anything is durable, and
  pickles, compresses and Fernet-encrypts every message: `raftlink.SealedTransport` replaces it.
  Its `send` syncs the journal first (one fsync covers a whole tick's worth of sends), except a
  leader's own AppendEntries (etcd's rule: `_onTick` makes the leader's entries durable before
  pysyncobj counts the leader in a commit), and it carries each message as a msgpack frame
  (`raftwire.py`) sealed like the member links'.
- Its dump is pickle, written without fsync: the dump pair in `dumpfile.py` writes msgpack with a
  checksum and fsyncs it; and with a serializer of ours it writes on the ticking thread: a forked
  child writes new dumps instead (`dumpwriter.py`), and the journal starts a new segment for
  each, so that the entries a dump covers go with the older segments' files, deleted by the
  child (`journal.py`), instead of being written again on the ticking thread.
- Its transport unpickles what reaches the Raft port (without a password, from anyone): ours
  unpickles nothing from outside; a connection proves the fleet secret (the links' handshake)
  before any Raft message is read, and every frame is MAC'd and replay-protected.
- It binds the Raft port on every interface unless told otherwise: `bindAddress` is the
  configured address itself, so the port listens only where the config and the log say.
- A replicated method that raises wedges every member: `apply_entry` hands the table a decoded
  entry and the table's `apply` is total. A bug of our own still raises, out of `doTick`, on the
  jobs thread, which stops the member (we tick ourselves: `autoTick=False`).
- Its AppendEntries handler deletes everything after `prevLogIdx` (committed entries too) and it
  has no pre-vote: every Raft message passes `_SyncObj__onMessageReceived` here first, and the
  rules of `raftseam.py` (log matching, pre-vote, leader stickiness, check-quorum) decide what
  pysyncobj gets; its election is hooked in `_onTick`.
- Batching adds ~100 ms per change: `appendEntriesUseBatch=False`, but then it sends one
  AppendEntries per proposal: the proposals of one tick go out together, in one message per
  follower (`_checkCommandsToApply`). Leadership is advisory for `leaderFallbackTimeout`: it is
  short, and the node decides only through committed entries.

The replica is driven by the jobs thread alone: `tick()` runs pysyncobj's tick, which applies
committed entries to the table on that same thread, so the table has a single writer and the jobs
thread needs no lock to read it.
"""

from __future__ import annotations

import contextlib
import os
import select
import threading
import time
from collections.abc import Callable
from typing import Any

import msgpack
import pysyncobj.syncobj as _pso
import structlog
from pysyncobj import SyncObj, SyncObjConf, replicated
from pysyncobj.pipe_notifier import PipeNotifier

from meshjobs import limits, raftseam
from meshjobs.diskspace import EXIT_BUG, EXIT_DISK, describe, fix_hint, is_disk_error
from meshjobs.dumpfile import CheckedDump, DumpCorrupt, DumpHealth, make_dump_pair
from meshjobs.dumpwriter import ForkedDumps
from meshjobs.failpoints import Failpoints
from meshjobs.frames import SECRET_BYTES
from meshjobs.journal import DurableJournal
from meshjobs.node import Applied, View
from meshjobs.raftlink import SealedTransport
from meshjobs.table import JobTable

_log = structlog.get_logger(__name__)

_FOLLOWER = _pso._RAFT_STATE.FOLLOWER
# What the Raft seam counts (`Replica.raft_stats`), each shown in /metrics as `raft_<name>`.
RAFT_COUNTERS = (
    "appends_stale_ignored", "entries_skipped_duplicate", "truncations", "truncations_refused",
    "messages_garbage", "pre_votes_started", "pre_votes_won", "pre_votes_granted",
    "pre_votes_refused", "votes_ignored_in_lease", "check_quorum_step_downs",
    "stale_term_notices",
)

_construct_lock = threading.Lock()


class Notifier:
    """Wakes the jobs thread's poll (pysyncobj's poller) from another thread."""

    def __init__(self, poller: Any) -> None:
        self._pipe = PipeNotifier(poller)

    def notify(self) -> None:
        try:
            self._pipe.notify()
        except BlockingIOError:
            pass  # the pipe is full of wake-ups already: the poll will return


class Replica(SyncObj):
    """The job table, replicated. Only the jobs thread may call its methods."""

    def __init__(
        self,
        self_addr: str,
        partner_addrs: list[str],
        data_dir: str,
        secret: bytes,
        table: JobTable,
        failpoints: Failpoints,
        names: dict[str, str] | None = None,
        election_s: tuple[float, float] = (0.4, 1.4),
    ) -> None:
        self.table = table
        self.applied: list[Applied] = []
        self._names = names or {}
        self._journal: DurableJournal | None = None
        self._behind = True  # see View.behind
        self.dump_damage: DumpCorrupt | None = None
        self.raft_stats: dict[str, int] = dict.fromkeys(RAFT_COUNTERS, 0)
        self._election_s = election_s
        self._leader_contact_s: float | None = None  # when the leader was last heard from
        self._pre_vote: tuple[int, set] | None = None  # (term asked for, peers that said yes)
        self._pre_vote_won: int | None = None  # the term a won pre-vote lets us stand for
        self._delete_allowed: int | None = None  # the one index pysyncobj may cut the log from
        self.dumps = DumpHealth()
        self.dump_path = os.path.join(data_dir, "raft.dump")
        self.fleet_secret = secret  # the Raft port's handshake key (raftlink.SealedTransport)

        def on_corrupt(exc: DumpCorrupt) -> None:
            # pysyncobj swallows errors of a dump load; the jobs thread checks this after every
            # tick and stops the member.
            self.dump_damage = exc

        # The dump checked before pysyncobj builds its journal is the one it then loads: read,
        # checked and decoded once, not twice.
        checked = CheckedDump()

        def load_state(state: Any) -> None:
            # A dump loaded (this member's at start, or one received from the leader): the
            # table is at that dump's position, and the file holds it.
            table.load(JobTable.from_state(state))
            self.dump_position = table.applied_index

        serializer, deserializer = make_dump_pair(
            table.to_state, load_state, failpoints,
            on_corrupt=on_corrupt, health=self.dumps, checked=checked)
        dump_path = self.dump_path
        conf = SyncObjConf(
            autoTick=False,
            appendEntriesUseBatch=False,
            journalFile=os.path.join(data_dir, "raft.journal"),
            fullDumpFile=dump_path,
            serializer=serializer,
            deserializer=deserializer,
            raftMinTimeout=election_s[0],
            appendEntriesPeriod=election_s[0] / 4,
            raftMaxTimeout=election_s[1],
            leaderFallbackTimeout=max(2.0, 3 * election_s[1]),
            logCompactionMinEntries=limits.log_compaction_entries_min,
            logCompactionMinTime=limits.log_compaction_s_min,
            commandsQueueSize=limits.ctl_queue_max * 10,
            # pysyncobj 0.3.17 splits an entry larger than this into a "transmission" and gets
            # the split wrong (it marks the last part by the command's length, not the pickled
            # entry's): the follower unpickles half an entry and stops. Entries are bounded by
            # `entry_bytes_max` (pysyncobj's command adds a few bytes of its own around ours),
            # so a batch size above it means no entry is ever split. It is also how many bytes
            # of entries one AppendEntries carries (at least one entry, however large).
            appendEntriesBatchSizeBytes=limits.raft_batch_bytes,
            dynamicMembershipChange=False,
            # Only one side of a pair dials (pysyncobj: the greater address), by default again
            # only 5 s after a failed try: two followers whose link was not up yet (one had
            # just restarted) cannot stand for election when the leader dies (an election
            # needs a connection to someone), and failover took 3-5 s instead of one timeout.
            connectionRetryTime=limits.raft_connect_retry_s,
            bindRetryTime=0.3,
            maxBindRetries=5,
            # Without it pysyncobj binds every interface (0.0.0.0, or :: for an IPv6 address)
            # on the port of `self_addr`, whatever host the config gives: bind exactly that.
            bindAddress=self_addr,
        )

        def make_journal(path: str) -> DurableJournal:
            # A damaged dump stops the member here (pysyncobj would load it with its errors
            # swallowed); the journal is read from the segment the dump's entries are in (older
            # ones are left over from a crash while they were being deleted); and a crash
            # between writing a dump and trimming the journal is completed here too, before
            # pysyncobj would clear the journal past the dump.
            dump = checked.check(dump_path)
            self._journal = DurableJournal(
                path, failpoints, dump_path=dump_path,
                dump_prev_idx=dump.prev[1] if dump is not None else None)
            if dump is not None:
                self._journal.complete_compaction(dump.prev, dump.last)
            return self._journal

        # pysyncobj builds its journal inside SyncObj.__init__ from a module-level factory; the
        # lock keeps two replicas built at once (tests) from crossing their factories.
        with _construct_lock:
            saved = _pso.createJournal
            _pso.createJournal = make_journal
            try:
                super().__init__(self_addr, partner_addrs, conf, transportClass=SealedTransport)
            finally:
                _pso.createJournal = saved
        self._checked: CheckedDump | None = checked  # until pysyncobj's first tick loads it
        if self._journal is None:
            raise AssertionError("pysyncobj did not build its journal through our factory")
        self.journal: DurableJournal = self._journal
        self.notifier = Notifier(self._poller)
        # New dumps are written by a forked child (dumpwriter.py): the jobs thread goes on.
        self.dump_writer: ForkedDumps | None = None
        if hasattr(os, "fork"):
            self.dump_writer = ForkedDumps(
                dump_path, conf.logCompactionBatchSize, table.to_state, deserializer, self.dumps,
                failpoints, journal=self.journal, position=lambda: table.applied_index,
                on_written=self._dump_written)
            self._SyncObj__serializer = self.dump_writer

    # pysyncobj's leader tells followers the new commit index (an AppendEntries to each) in the
    # tick that applies the entries, before the jobs thread has seen them: the answers waiting
    # for those entries would wait for that send too. The notice is held back instead and sent
    # by `send_commit_notice` once the answers are out; any AppendEntries sent meanwhile (a new
    # proposal) carries the commit index and makes it unneeded.
    _notice_due = False

    def _SyncObj__applyLogEntries(self) -> bool:
        need = SyncObj._SyncObj__applyLogEntries(self)  # type: ignore[attr-defined]
        if need:
            self._notice_due = True
        return False

    def _SyncObj__sendAppendEntries(self) -> None:
        if self._holding_appends:
            self._appends_held = True
            return
        self._notice_due = False
        SyncObj._SyncObj__sendAppendEntries(self)  # type: ignore[attr-defined]

    # With `appendEntriesUseBatch=False` pysyncobj sends an AppendEntries to every follower after
    # each proposal it takes from its queue. It takes them all in one tick: they go out once
    # afterwards instead, several entries per message. (Each follower's next index moves on
    # when the message is sent, not when it is acknowledged: the next tick's entries follow
    # without waiting for this message's answer.)
    _holding_appends = False
    _appends_held = False

    def _checkCommandsToApply(self) -> None:
        self._holding_appends = True
        try:
            SyncObj._checkCommandsToApply(self)
        finally:
            self._holding_appends = False
        if self._appends_held:
            self._appends_held = False
            if self._isLeader():
                self._SyncObj__sendAppendEntries()

    # --- the Raft seam (raftseam.py): log matching, pre-vote, stickiness, check-quorum ----------

    def _count(self, name: str, n: int = 1) -> None:
        self.raft_stats[name] += n

    def _log_view(self) -> raftseam.LogView:
        log = self._SyncObj__raftLog  # type: ignore[attr-defined]
        first = log[0][1]

        def term_at(i: int) -> int:
            return log[i - first][2]

        return raftseam.LogView(first=first, last=log[-1][1], commit=self.raftCommitIndex,
                                term_at=term_at)

    def _lease(self) -> bool:
        return raftseam.in_lease(_pso.monotonicTime(), self._leader_contact_s, self._isLeader(),
                                 self._election_s[0])

    def _SyncObj__onMessageReceived(self, node: Any, message: Any) -> None:
        """Every Raft message comes in here first (pysyncobj registers this name with its
        transport). Our rules decide; pysyncobj gets what they let through."""
        handle = SyncObj._SyncObj__onMessageReceived  # type: ignore[attr-defined]
        kind = message.get("type") if isinstance(message, dict) else None
        try:
            if kind == "append_entries":
                message = self._on_append(node, message)
            elif kind == "request_vote":
                if raftseam.ignore_vote_request(message, self.raftCurrentTerm, self._lease()):
                    self._count("votes_ignored_in_lease")
                    return
            elif kind == "pre_vote":
                self._on_pre_vote(node, message)
                return
            elif kind == "pre_vote_response":
                self._on_pre_vote_response(node, message)
                return
            elif kind == "stale_term":
                self._on_stale_term(message)
                return
        except raftseam.RaftGarbage:
            self._count("messages_garbage")
            return
        if message is None:
            return
        self._delete_allowed = None
        try:
            handle(self, node, message)
        finally:
            self._delete_allowed = None

    def _on_append(self, node: Any, message: dict) -> dict | None:
        plan = raftseam.plan_append(message, self.raftCurrentTerm, self._log_view())
        if plan.action == raftseam.STALE:
            self._count("appends_stale_ignored")
            # The sender leads at an older term and would never learn ours otherwise: a member
            # whose term got ahead (a lost election) would ignore its leader forever.
            if not self._isLeader():
                self._count("stale_term_notices")
                self._SyncObj__transport.send(  # type: ignore[attr-defined]
                    node, {"type": "stale_term", "term": self.raftCurrentTerm})
            return None
        self._leader_contact_s = _pso.monotonicTime()
        self._pre_vote = None
        self._pre_vote_won = None
        if plan.action == raftseam.REFUSE:
            self._count("truncations_refused")
            _log.error("raft.append_refused", why=plan.why, commit=self.raftCommitIndex)
            return None
        if plan.action == raftseam.PASS:
            return message
        self._count("entries_skipped_duplicate", plan.skipped)
        if plan.stale_suffix:
            self._count("appends_stale_ignored")
        if plan.truncate_from is not None:
            self._count("truncations")
        # The one deletion pysyncobj may make while handling this message.
        assert plan.message is not None
        handle = SyncObj._SyncObj__onMessageReceived  # type: ignore[attr-defined]
        self._delete_allowed = plan.truncate_from
        self._reply_next = plan.reply_next
        try:
            handle(self, node, plan.message)
        finally:
            self._delete_allowed = None
            self._reply_next = None
        return None

    def _SyncObj__deleteEntriesFrom(self, fromIDx: int) -> None:
        if not raftseam.may_delete_from(fromIDx, self._delete_allowed, self.raftCommitIndex):
            raise AssertionError(
                f"the Raft log would be cut from {fromIDx} (commit index {self.raftCommitIndex}, "
                f"the plan allowed {self._delete_allowed}): the append seam let a bad plan through")
        SyncObj._SyncObj__deleteEntriesFrom(self, fromIDx)  # type: ignore[attr-defined]

    _reply_next: int | None = None  # while handling a rewritten append: what to answer

    def _SyncObj__sendNextNodeIdx(self, node: Any, reset: bool = False,
                                  nextNodeIdx: int | None = None, success: bool = False) -> None:
        if self._reply_next is not None and success:
            nextNodeIdx = self._reply_next
        SyncObj._SyncObj__sendNextNodeIdx(  # type: ignore[attr-defined]
            self, node, reset=reset, nextNodeIdx=nextNodeIdx, success=success)

    def _on_pre_vote(self, node: Any, message: dict) -> None:
        log = self._SyncObj__raftLog  # type: ignore[attr-defined]
        granted = raftseam.grant_pre_vote(message, self.raftCurrentTerm, log[-1][1], log[-1][2],
                                          self._lease())
        self._count("pre_votes_granted" if granted else "pre_votes_refused")
        self._SyncObj__transport.send(node, {  # type: ignore[attr-defined]
            "type": "pre_vote_response", "term": message["term"], "granted": granted})

    def _on_pre_vote_response(self, node: Any, message: dict) -> None:
        term = message.get("term")
        if type(term) is not int or type(message.get("granted")) is not bool:
            raise raftseam.RaftGarbage("a pre-vote response without term and answer")
        round_ = self._pre_vote
        if round_ is None or term != round_[0] or not message["granted"] or self._isLeader():
            return
        round_[1].add(node)
        voters = len(self._SyncObj__otherNodes) + 1  # type: ignore[attr-defined]
        if raftseam.majority(len(round_[1]) + 1, voters):
            self._count("pre_votes_won")
            self._pre_vote = None
            self._pre_vote_won = term
            # pysyncobj stands for election in its next tick (due_s() is 0 now).
            self._SyncObj__raftElectionDeadline = 0  # type: ignore[attr-defined]

    def _on_stale_term(self, message: dict) -> None:
        term = message.get("term")
        if type(term) is not int:
            raise raftseam.RaftGarbage("a stale-term notice without a term")
        if term > self.raftCurrentTerm:
            # Raft: a higher term seen anywhere makes a leader a follower of that term.
            self._SyncObj__setCurrentTerm(term, None)  # type: ignore[attr-defined]
            self._SyncObj__setState(_FOLLOWER)  # type: ignore[attr-defined]
            self._SyncObj__raftLeader = None
            self._leader_contact_s = None

    def _pre_vote_step(self) -> None:
        """Before pysyncobj's tick: when its election timer has fired, ask for pre-votes
        instead, and let it stand for election only once a majority said yes."""
        if self._isLeader() or self.selfNode is None:
            return
        others = self._SyncObj__otherNodes  # type: ignore[attr-defined]
        now = _pso.monotonicTime()
        if not others or self._SyncObj__raftElectionDeadline >= now:  # type: ignore[attr-defined]
            return
        if not self._SyncObj__connectedToAnyone():  # type: ignore[attr-defined]
            return
        if self._SyncObj__transferInProgress:  # type: ignore[attr-defined]
            return  # asked to by the leader (not used by meshjobs): no pre-vote, as in etcd
        term = self.raftCurrentTerm + 1
        if self._pre_vote_won == term:
            self._pre_vote_won = None
            return  # pysyncobj stands for election in this tick
        self._pre_vote_won = None
        self._SyncObj__raftElectionDeadline = (  # type: ignore[attr-defined]
            now + self._SyncObj__generateRaftTimeout())  # type: ignore[attr-defined]
        self._pre_vote = (term, set())
        self._count("pre_votes_started")
        if self._SyncObj__raftLeader is not None:  # type: ignore[has-type]
            self._SyncObj__raftLeader = None  # not heard from for an election timeout
            self._SyncObj__onLeaderChanged()  # type: ignore[attr-defined]
        log = self._SyncObj__raftLog  # type: ignore[attr-defined]
        ask = {"type": "pre_vote", "term": term, "last_log_index": log[-1][1],
               "last_log_term": log[-1][2]}
        for node in others:
            self._SyncObj__transport.send(node, ask)  # type: ignore[attr-defined]

    def _check_quorum_step(self) -> None:
        """After pysyncobj's tick: a leader that has not heard from a majority within the
        maximum election timeout steps down (stickiness would otherwise keep it in place)."""
        if not self._isLeader():
            return
        heard = self._SyncObj__lastResponseTime  # type: ignore[attr-defined]
        others = self._SyncObj__otherNodes  # type: ignore[attr-defined]
        if not others:
            return
        if raftseam.quorum_recent(_pso.monotonicTime(), [heard.get(n, 0.0) for n in others],
                                  self._election_s[1]):
            return
        self._count("check_quorum_step_downs")
        _log.warning("raft.check_quorum_step_down", term=self.raftCurrentTerm)
        self._SyncObj__setState(_FOLLOWER)  # type: ignore[attr-defined]
        self._SyncObj__raftLeader = None
        self._leader_contact_s = None
        self._SyncObj__raftElectionDeadline = (  # type: ignore[attr-defined]
            _pso.monotonicTime() + self._SyncObj__generateRaftTimeout())  # type: ignore[attr-defined]

    def _onTick(self, timeToWait: float = 0.0) -> None:
        self._pre_vote_step()
        # etcd's rule, the other half: a leader's AppendEntries leave before its own fsync
        # (raftlink.SealedTransport.send), and pysyncobj counts the leader in every commit it
        # works out (early in its tick). A leader's entries are appended after that in a tick
        # (proposals) or between ticks (the no-op of an election won by votes), so making them
        # durable here covers every entry it counts. (A fleet of one elects itself and commits
        # within one tick, as before: its answers wait for the jobs thread's sync.)
        if self._isLeader() and self.journal.dirty:
            self.journal_sync()
        SyncObj._onTick(self, timeToWait)
        if self._checked is not None and not self._SyncObj__needLoadDumpFile:  # type: ignore[attr-defined]
            self._checked.forget()  # loaded (or there was none): not held beside the table
            self._checked = None
        self._check_quorum_step()

    _compaction_asked: int | None = None  # the journal's compaction count when last asked
    # The journal's compaction count and the failed dumps when a compaction was last asked for.
    _compaction_asked: tuple[int, int] | None = None
    _compaction_asked_s = 0.0

    def compact_when_large(self) -> None:
        """pysyncobj compacts by entries and by age; entries vary from one row to thousands, so
        compact by size too: the log is held in memory until it is compacted. Asked once, then
        again only after that compaction is done (it keeps the last applied entry, so at least
        two more are needed) or its dump failed and the retry is due, and at least
        `log_compaction_force_s_min` later."""
        journal = self.journal
        if journal.size_bytes < limits.log_compaction_bytes_min:
            self._compaction_asked = None
            return
        now = time.monotonic()
        asked = (journal.compactions, self.dumps.failures)
        if self._compaction_asked is not None and (
                asked == self._compaction_asked or len(journal) < 3
                or now - self._compaction_asked_s < limits.log_compaction_force_s_min):
            return
        if not self.dumps.due():
            return
        self._compaction_asked = asked
        self._compaction_asked_s = now
        self.forceLogCompaction()

    def _SyncObj__tryLogCompaction(self) -> None:
        # After a failed dump pysyncobj would try again at every tick (by age) or never (by
        # size): the retry waits for its backoff instead (dumpfile.py, rule 3).
        if not self.dumps.due():
            return
        SyncObj._SyncObj__tryLogCompaction(self)  # type: ignore[attr-defined]

    dump_position: int | None = None  # the table position the dump file holds (None: no dump)

    def _dump_written(self, position: int) -> None:
        self.dump_position = position

    def want_dump(self) -> None:
        """A new dump soon (a new worker needs a whole table the recent entries can follow):
        asked of pysyncobj like a compaction by size, unless one is being written or the
        retry after a failed one is not due yet."""
        if self.dump_writer is not None and self.dump_writer.writing:
            return
        if self.dumps.due():
            self.forceLogCompaction()

    def dump_stats(self) -> dict[str, int]:
        """Dumps written and failed since start, and the journal's compactions."""
        return {"dumps_written": self.dumps.written, "dump_failures": self.dumps.failures,
                "journal_compactions": self.journal.compactions}

    def send_commit_notice(self) -> None:
        """Send the commit index to followers now, if it was held back."""
        if self._notice_due:
            self._notice_due = False
            if self._isLeader():
                self._SyncObj__sendAppendEntries()

    def journal_sync(self) -> None:
        """The durability gate's one primitive: everything logged so far is on disk when it
        returns. An OSError propagates: the caller fail-stops."""
        self.journal.sync()

    @replicated
    def apply_entry(self, raw: bytes) -> None:
        # The log index of this entry: pysyncobj counts it applied only after we return.
        index = self.raftLastApplied + 1
        try:
            entry = msgpack.unpackb(raw, raw=False, strict_map_key=False, use_list=True)
        except Exception:  # remote garbage (a hostile or broken proposer): a refusal, not a crash
            entry = None
        prev = self.table.applied_index
        outcome = self.table.apply(entry, index)
        self.applied.append(Applied(index, entry, outcome, prev))

    def propose(self, entry: dict) -> None:
        raw = msgpack.packb(entry, use_bin_type=True)
        if len(raw) > limits.entry_bytes_max:
            raise AssertionError(f"entry of {len(raw)} bytes exceeds entry_bytes_max")
        self.apply_entry(raw)

    def tick(self, timeout_s: float) -> None:
        self.doTick(timeout_s)

    def log_proposals(self) -> None:
        """Put the proposals made since the last tick into the log now rather than at the end
        of the next tick (pysyncobj's `_checkCommandsToApply`, the last step of every tick): the
        fsync of the round that proposed them then covers them, and the next tick commits them
        (a fleet of one) or sends them (a leader of voters) one round sooner. Nothing else
        changes: what is logged, and that no answer leaves before the fsync that covers it."""
        self._checkCommandsToApply()

    def wait(self, timeout_s: float) -> None:
        """Wait for a socket event or a wake-up (`notifier`) for at most `timeout_s`."""
        self._poller.poll(timeout_s)

    def due_s(self) -> float:
        """Seconds until pysyncobj's next timed duty: a leader's heartbeat, or a follower's or
        candidate's election deadline. The jobs thread wakes for it: a follower that slept past
        its deadline would stand for election late, and as likely at the same moment as the
        other followers (a split vote, and another round)."""
        if self._isLeader():
            due = self._SyncObj__newAppendEntriesTime  # type: ignore[attr-defined]
        else:
            due = self._SyncObj__raftElectionDeadline  # type: ignore[attr-defined]
        return max(0.0, due - _pso.monotonicTime())

    def needs_tick(self) -> bool:
        """True when another tick would make progress without any event: entries committed
        and not applied; or, at a leader, entries a majority holds that are not committed
        yet. pysyncobj counts a follower's acknowledgement when it reads it, which may be at
        the very end of a tick, after that tick worked out the commit index: nothing else
        would wake the jobs thread to commit (it slept until its next timer, 0.1-0.25 s)."""
        if self.raftLastApplied < self.raftCommitIndex:
            return True
        if not self._isLeader():
            return False
        last = self._SyncObj__getCurrentLogIndex()  # type: ignore[attr-defined]
        commit = self.raftCommitIndex
        if commit >= last:
            return False
        others = self._SyncObj__otherNodes  # type: ignore[attr-defined]
        match = self._SyncObj__raftMatchIndex  # type: ignore[attr-defined]
        held = sorted([last] + [match.get(n, 0) for n in others], reverse=True)
        majority = held[len(held) // 2]
        if majority <= commit:
            return False
        # Raft commits only an entry of the leader's own term (older ones come with it).
        entries = self._SyncObj__getEntries(majority, 1)  # type: ignore[attr-defined]
        return bool(entries) and entries[0][2] == self.raftCurrentTerm

    def take_applied(self) -> list[Applied]:
        out, self.applied = self.applied, []
        return out

    def view(self) -> View:
        leader = self._getLeader()
        leader_id = None if leader is None else getattr(leader, "id", str(leader))
        is_leader = self._isLeader()
        noop = getattr(self, "_SyncObj__noopIDx", None)
        ready = bool(is_leader and noop is not None and self.raftLastApplied >= noop)
        if self._behind:
            # Caught up (once, for good): as the leader, its table holds its whole term; as a
            # follower, it has applied all it knows committed, having heard of a leader.
            self._behind = not (ready if is_leader else (
                leader_id is not None and self.raftLastApplied >= self.raftCommitIndex))
        return View(
            term=self.raftCurrentTerm,
            leader=self._names.get(leader_id, leader_id) if leader_id else None,
            is_leader=is_leader,
            ready=ready,
            behind=self._behind,
        )

    def raft_dropped(self) -> dict[str, int]:
        """What arrived on the Raft port and was dropped, by reason."""
        transport = getattr(self, "_SyncObj__transport", None)
        return dict(getattr(transport, "dropped", {}))

    def close(self) -> None:
        if self.dump_writer is not None:
            self.dump_writer.close()
        self._destroy()


def open_secret(path: str, create: bool, failpoints: Failpoints | None = None) -> bytes:
    """The fleet secret: 32 random bytes, mode 0600, made on first start of a fleet of one.
    An OSError of the disk propagates (the caller fail-stops)."""
    try:
        with open(path, "rb") as f:
            secret = f.read()
    except FileNotFoundError:
        if not create:
            raise SystemExit(f"meshd: no fleet secret at {path}: copy it from a member of the "
                             "fleet, or, for the first member of a new fleet, make one with "
                             f"`meshd new-secret {path}` (then copy it to the others)") from None
        return new_secret(path, failpoints, replace=True)
    if len(secret) != SECRET_BYTES:
        raise SystemExit(f"meshd: fleet secret {path} must be exactly {SECRET_BYTES} bytes, it "
                         f"has {len(secret)}")
    mode = os.stat(path).st_mode & 0o777
    if mode & 0o077:
        raise SystemExit(f"meshd: fleet secret {path} is readable by others (mode {mode:o}): chmod 600 it")
    return secret


def new_secret(path: str, failpoints: Failpoints | None = None, replace: bool = False) -> bytes:
    """Write a new fleet secret at `path` (32 random bytes, mode 0600, fsynced with its folder)
    and return it. Without `replace`, an existing file is never overwritten: FileExistsError."""
    secret = os.urandom(SECRET_BYTES)
    tmp = f"{path}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        try:
            os.fchmod(fd, 0o600)
            os.write(fd, secret)
            if failpoints is not None:
                failpoints.hit("secret.fsync")
            os.fsync(fd)
        finally:
            os.close(fd)
        if replace:
            os.rename(tmp, path)
        else:
            os.link(tmp, path)  # fails when `path` exists: never an overwrite, even in a race
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
    dfd = os.open(os.path.dirname(path) or ".", os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
    return secret


def fail_stop(log: Any, why: str, exc: BaseException | None = None,
              exit_fn: Callable[[int], None] = os._exit, path: str | None = None) -> None:
    """Stop the member at once: it must not run on with state it could not keep. The exit code
    is `EXIT_DISK` (71) when the disk failed or is full, `EXIT_BUG` (70) otherwise; `path` (the
    data folder) lets the message name a full disk that said EIO."""
    code = EXIT_DISK if is_disk_error(exc) else EXIT_BUG
    try:
        error = describe(exc, path) if exc is not None else None
        log.critical("fail_stop", why=why, error=error, exit_code=code,
                     what_to_do=fix_hint(exc, path) if code == EXIT_DISK else None)
    finally:
        exit_fn(code)


# --- A worker member's stand-in ---------------------------------------------------------------

class _Journal:
    """A worker member's journal: it has none (its table is re-learned from the leader)."""

    dirty = False

    def sync(self) -> None:
        pass


class WorkerReplica:
    """What the jobs thread needs of a replica, for a member that does not vote."""

    dump_damage = None
    dump_position = None  # no dumps: a worker's table is re-learned from the leader
    dump_path = None

    def __init__(self) -> None:
        self.journal = _Journal()
        self._r, self._w = os.pipe()
        os.set_blocking(self._r, False)
        os.set_blocking(self._w, False)
        self.notifier = self

    def notify(self) -> None:
        try:
            os.write(self._w, b"!")
        except BlockingIOError:
            pass

    def tick(self, timeout_s: float) -> None:
        pass

    def wait(self, timeout_s: float) -> None:
        ready, _, _ = select.select([self._r], [], [], timeout_s)
        if ready:
            try:
                while os.read(self._r, 4096):
                    pass
            except BlockingIOError:
                pass

    def needs_tick(self) -> bool:
        return False

    def due_s(self) -> float:
        return limits.publish_ms / 1000.0  # no Raft timers

    def view(self) -> View:
        return View()

    def take_applied(self) -> list:
        return []

    def propose(self, entry: dict) -> None:
        raise AssertionError("a worker member never proposes")

    def log_proposals(self) -> None:
        pass  # never proposes

    def send_commit_notice(self) -> None:
        pass  # no Raft log, nothing to tell

    def compact_when_large(self) -> None:
        pass  # no Raft log

    def want_dump(self) -> None:
        pass  # never leads, so never sends a dump

    def journal_sync(self) -> None:
        pass

    def close(self) -> None:
        os.close(self._r)
        os.close(self._w)
