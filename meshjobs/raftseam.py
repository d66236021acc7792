"""Raft rules pysyncobj 0.3.17 lacks, decided without IO: log matching, pre-vote, check-quorum.

Theory of operation. `replica.py` intercepts pysyncobj's messages before pysyncobj handles them
and asks this module what to do; it then hands pysyncobj either the message as sent, a rewritten
one, or nothing. Everything here is a function of the message and a view of the member's Raft
state, so each rule is a table-driven test.

AppendEntries (Raft §5.3). pysyncobj deletes every entry after `prevLogIdx` before appending the
message's entries, whatever they are: a delayed, duplicated or reordered AppendEntries (or a
heartbeat sent after the leader's optimistic `nextIndex` fell back) deletes committed, applied
entries and writes them again. `plan_append` instead compares each incoming entry's term with
ours at its index: entries we hold with the same term are skipped, the log is cut only from the
first entry whose term differs, and never at or below our commit index (a leader whose log
disagrees there breaks Raft's leader completeness: the message is refused and counted). The
rewritten message starts after the held prefix, so what pysyncobj then deletes is exactly the
conflicting suffix, and its commit index is capped at the last entry the message vouches for
(Raft: min(leaderCommit, index of last new entry)).

Elections (etcd's PreVote and CheckQuorum). A member whose election timer fires first asks its
peers "would you vote for me at term+1?" (`pre_vote`) without raising its term; a peer says yes
only when it has not heard from a leader within the minimum election timeout (its lease) and the
asker's log is at least as up to date as its own. Only a majority of yeses starts a real
election. A peer in its lease also ignores a real vote request at a higher term (leader
stickiness), so a member that cannot hear the leader, or comes back from a cut, cannot depose a
leader the others still hear. In return a leader that has not heard from a majority within the
maximum election timeout steps down (`quorum_recent`), or stickiness would keep a leader that
lost its quorum in place for as long as one follower hears it.

Rule 1: pure. No IO, clock, threads or randomness: time comes in as seconds from the caller's
        monotonic clock, the log as a `LogView`.
Rule 2: a message no member of ours would send (wrong types, indexes that do not follow on) is
        `RaftGarbage`, the one error class: the caller counts it and drops the message.
Rule 3: a plan never lets pysyncobj delete an entry at or below the commit index; the caller
        asserts it again where the deletion happens (a broken invariant of ours crashes).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

# What `plan_append` tells the caller to do.
PASS = "pass"          # hand pysyncobj the message as sent (it deletes nothing in these cases)
APPEND = "append"      # hand pysyncobj `AppendPlan.message` instead: only the new entries
STALE = "stale"        # an older term: drop it (pysyncobj would too); tell the sender our term
REFUSE = "refuse"      # a leader disagrees with a committed entry: drop it, count it, log it


class RaftGarbage(ValueError):
    """A Raft message that no member of ours would send."""


@dataclass(frozen=True)
class LogView:
    """What `plan_append` needs of the member's log: the first and last index held (pysyncobj
    keeps the entry at the last compaction point as the first), the commit index, and the term
    of a held entry."""

    first: int
    last: int
    commit: int
    term_at: Callable[[int], int]


@dataclass(frozen=True)
class AppendPlan:
    action: str
    message: dict | None = None      # for APPEND: what pysyncobj gets instead
    truncate_from: int | None = None  # the only index pysyncobj may delete from (APPEND)
    skipped: int = 0                  # entries already held with the same term
    stale_suffix: bool = False        # nothing new, and we hold entries past the message
    reply_next: int | None = None     # the next index to answer the leader, if not pysyncobj's
    why: str = ""


def _int(msg: dict, key: str) -> int:
    v = msg.get(key)
    if type(v) is not int or v < 0:
        raise RaftGarbage(f"{key} is {type(v).__name__}, not a count")
    return v


def _entries(msg: dict, prev_idx: int, term: int) -> list[tuple[Any, int, int]]:
    raw = msg.get("entries", [])
    if not isinstance(raw, (list, tuple)):
        raise RaftGarbage("entries is not a list")
    out = []
    last_term = 0
    for i, e in enumerate(raw):
        if not isinstance(e, (list, tuple)) or len(e) != 3:
            raise RaftGarbage("an entry is not (command, index, term)")
        cmd, idx, t = e
        if type(idx) is not int or type(t) is not int or not isinstance(cmd, (bytes, bytearray)):
            raise RaftGarbage("an entry's index or term is not an int, or its command not bytes")
        if idx != prev_idx + 1 + i:
            raise RaftGarbage(f"entry index {idx} does not follow {prev_idx + i}")
        if t < last_term or t > term:
            raise RaftGarbage(f"entry term {t} out of order (after {last_term}, message {term})")
        last_term = t
        out.append((cmd, idx, t))
    return out


def plan_append(msg: dict, term: int, log: LogView) -> AppendPlan:
    """What to do with an incoming `append_entries` message at a member whose current term is
    `term`. Raises RaftGarbage for a malformed message."""
    msg_term = _int(msg, "term")
    leader_commit = _int(msg, "commit_index")
    if msg_term < term:
        return AppendPlan(STALE, why=f"term {msg_term} is older than ours ({term})")
    if "prevLogIdx" not in msg:
        return AppendPlan(PASS, why="a snapshot, not entries")
    if "transmission" in msg:
        # An entry split over messages: never sent by ours (entries are smaller than a batch).
        raise RaftGarbage("a split entry (transmission)")
    prev_idx = _int(msg, "prevLogIdx")
    prev_term = _int(msg, "prevLogTerm")
    entries = _entries(msg, prev_idx, msg_term)
    if prev_idx > log.last or prev_idx < log.first:
        # pysyncobj answers "not there" (the leader goes back, or on to our last) and deletes
        # nothing.
        return AppendPlan(PASS, why="the previous entry is not held")
    if log.term_at(prev_idx) != prev_term:
        if prev_idx <= log.commit:
            return AppendPlan(REFUSE, why=f"previous entry {prev_idx} is committed with term "
                              f"{log.term_at(prev_idx)}, the leader says {prev_term}")
        return AppendPlan(PASS, why="the previous entry differs: pysyncobj answers so")
    skipped = 0
    truncate_from = None
    new = entries
    for i, (_, idx, t) in enumerate(entries):
        if idx > log.last:
            new = entries[i:]
            break
        if log.term_at(idx) == t:
            skipped += 1
            continue
        if idx <= log.commit:
            return AppendPlan(REFUSE, why=f"entry {idx} is committed with term "
                              f"{log.term_at(idx)}, the leader says {t}")
        truncate_from = idx
        new = entries[i:]
        break
    else:
        new = []
    verified = entries[-1][1] if entries else prev_idx
    if skipped:
        anchor_idx, anchor_term = entries[skipped - 1][1], entries[skipped - 1][2]
    else:
        anchor_idx, anchor_term = prev_idx, prev_term
    rewritten = dict(msg)
    rewritten["prevLogIdx"] = anchor_idx
    rewritten["prevLogTerm"] = anchor_term
    rewritten["entries"] = list(new)
    # Raft: a follower commits no further than the last entry this message vouches for; entries
    # we hold past it may be an old term's.
    rewritten["commit_index"] = min(leader_commit, verified)
    stale_suffix = not new and log.last > verified
    reply_next = None
    if stale_suffix:
        # Nothing new, and we hold entries past the message (it is old, or they are an old
        # term's that a later message will replace). pysyncobj would delete them: anchor the
        # message at our last entry instead, so it deletes nothing, and answer for what the
        # message vouches for, not for what we hold.
        rewritten["prevLogIdx"] = log.last
        rewritten["prevLogTerm"] = log.term_at(log.last)
        reply_next = verified + 1
    return AppendPlan(APPEND, message=rewritten, truncate_from=truncate_from, skipped=skipped,
                      stale_suffix=stale_suffix, reply_next=reply_next)


def may_delete_from(index: int, allowed: int | None, commit: int) -> bool:
    """Whether pysyncobj may delete the log from `index` on: only at the plan's conflict, and
    never at or below the commit index. The caller treats anything else as a broken invariant:
    a plan makes pysyncobj delete exactly at its conflict or not at all."""
    return allowed is not None and index == allowed and index > commit


def in_lease(now_s: float, leader_contact_s: float | None, is_leader: bool,
             election_min_s: float) -> bool:
    """True while this member knows a live leader: it leads, or it heard from the leader less
    than the minimum election timeout ago."""
    if is_leader:
        return True
    return leader_contact_s is not None and now_s - leader_contact_s < election_min_s


def vote_request_fields(msg: dict) -> tuple[int, int, int]:
    """(term, last_log_index, last_log_term) of a `pre_vote` or `request_vote` message."""
    return _int(msg, "term"), _int(msg, "last_log_index"), _int(msg, "last_log_term")


def grant_pre_vote(msg: dict, term: int, last_idx: int, last_term: int, lease: bool) -> bool:
    """Would this member vote for the asker at the term it names? Only for a higher term than
    ours, a log at least as up to date as ours (Raft §5.4.1), and when it knows no live leader.
    A pre-vote changes nothing here: no term, no vote, no timer."""
    asked, their_idx, their_term = vote_request_fields(msg)
    if lease or asked <= term:
        return False
    return their_term > last_term or (their_term == last_term and their_idx >= last_idx)


def ignore_vote_request(msg: dict, term: int, lease: bool) -> bool:
    """Leader stickiness: a real vote request at a higher term is ignored while this member
    knows a live leader (it would otherwise raise our term and depose that leader)."""
    asked, _, _ = vote_request_fields(msg)
    return lease and asked > term


def majority(count: int, voters: int) -> bool:
    """`count` of `voters` (this member included) is a majority."""
    return count > voters / 2


def quorum_recent(now_s: float, last_heard_s: Iterable[float], window_s: float) -> bool:
    """Check-quorum: a leader heard from a majority (itself included) within `window_s`."""
    heard = list(last_heard_s)
    recent = 1 + sum(1 for t in heard if now_s - t < window_s)
    return majority(recent, len(heard) + 1)
