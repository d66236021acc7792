"""The Raft seam's decisions, pure (meshjobs/raftseam.py): table-driven, and a hypothesis model of
a follower's log under AppendEntries delivered in any order."""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

from meshjobs import raftseam
from meshjobs.raftseam import APPEND, PASS, REFUSE, STALE, LogView, RaftGarbage


def view(terms: list[int], commit: int, first: int = 1) -> LogView:
    """A log holding indexes first.. with these terms."""
    return LogView(first=first, last=first + len(terms) - 1, commit=commit,
                   term_at=lambda i: terms[i - first])


def msg(prev: int, prev_term: int, terms: list[int], term: int = 2, commit: int = 0) -> dict:
    return {"type": "append_entries", "term": term, "commit_index": commit, "prevLogIdx": prev,
            "prevLogTerm": prev_term,
            "entries": [(b"c%d" % (prev + 1 + i), prev + 1 + i, t) for i, t in enumerate(terms)]}


@pytest.mark.parametrize("name,log,m,action,prev,new,cut,skipped", [
    # name, our log (terms from index 1), message, action, rewritten prev, new indexes, cut, skip
    ("appends after our last", view([0, 1, 1], 2), msg(3, 1, [2, 2]), APPEND, 3, [4, 5], None, 0),
    ("skips a held prefix", view([0, 1, 1, 1], 2), msg(1, 0, [1, 1, 1, 2]), APPEND, 4, [5], None,
     3),
    ("cuts from the first conflict", view([0, 1, 1, 1, 1], 2), msg(2, 1, [1, 2, 2]), APPEND, 3,
     [4, 5], 4, 1),
    ("a duplicate behind our log", view([0, 1, 1, 1, 1], 2), msg(1, 0, [1, 1]), APPEND, 5, [],
     None, 2),
    ("a heartbeat at our last", view([0, 1, 1], 3), msg(3, 1, []), APPEND, 3, [], None, 0),
    ("previous entry missing", view([0, 1], 1), msg(5, 1, [2]), PASS, None, None, None, 0),
    ("previous entry compacted", view([1, 1, 1], 5, first=4), msg(2, 1, [1]), PASS, None, None,
     None, 0),
    ("previous entry differs, uncommitted", view([0, 1, 1], 1), msg(3, 2, [2]), PASS, None, None,
     None, 0),
    ("previous entry differs, committed", view([0, 1, 1], 3), msg(3, 2, [2]), REFUSE, None, None,
     None, 0),
    ("a conflict at a committed entry", view([0, 1, 1, 1], 3), msg(1, 0, [1, 2, 2]), REFUSE, None,
     None, None, 0),
    ("a same-term heartbeat", view([0, 1, 1], 1), msg(3, 1, [], term=1), APPEND, 3, [], None, 0),
])
def test_plan_append_table(name, log, m, action, prev, new, cut, skipped):
    """Raft §5.3: skip what is held with the same term, cut only from the first conflict and
    never at or below the commit index, leave to pysyncobj what deletes nothing."""
    plan = raftseam.plan_append(m, 1, log)
    assert plan.action == action, (name, plan.why)
    if action == APPEND:
        assert plan.message["prevLogIdx"] == prev, name
        assert [e[1] for e in plan.message["entries"]] == new, name
        assert plan.truncate_from == cut, name
        assert plan.skipped == skipped, name


def test_older_term_is_stale():
    """An AppendEntries of a term older than ours is stale: ignored."""
    assert raftseam.plan_append(msg(1, 0, [1], term=1), 2, view([0, 1], 0)).action == STALE


def test_commit_goes_no_further_than_the_message_vouches():
    """Raft: commit = min(leaderCommit, index of the last entry the message covers), and the
    answer names that entry, not what we hold past it."""
    plan = raftseam.plan_append(msg(1, 0, [1], commit=9), 1, view([0, 1, 1, 1, 1], 1))
    assert plan.message["commit_index"] == 2
    assert plan.reply_next == 3
    assert plan.stale_suffix


@pytest.mark.parametrize("m", [
    {"term": 1},
    {"term": True, "commit_index": 0, "prevLogIdx": 1, "prevLogTerm": 0},
    {"term": 1, "commit_index": 0, "prevLogIdx": -1, "prevLogTerm": 0},
    {"term": 1, "commit_index": 0, "prevLogIdx": 1, "prevLogTerm": 0, "entries": [(b"x", 3, 1)]},
    {"term": 1, "commit_index": 0, "prevLogIdx": 1, "prevLogTerm": 0, "entries": [(b"x", 2, 5)]},
    {"term": 2, "commit_index": 0, "prevLogIdx": 1, "prevLogTerm": 0,
     "entries": [(b"x", 2, 2), (b"y", 3, 1)]},
    {"term": 1, "commit_index": 0, "prevLogIdx": 1, "prevLogTerm": 0, "entries": [("s", 2, 1)]},
    {"term": 1, "commit_index": 0, "prevLogIdx": 1, "prevLogTerm": 0, "entries": [(b"x", 2)]},
    {"term": 1, "commit_index": 0, "prevLogIdx": 1, "prevLogTerm": 0, "entries": {}},
    {"term": 1, "commit_index": 0, "prevLogIdx": 1, "prevLogTerm": 0, "transmission": "start"},
])
def test_malformed_append_is_garbage(m):
    """Remote garbage: one error class."""
    with pytest.raises(RaftGarbage):
        raftseam.plan_append(m, 1, view([0, 1], 0))


def test_may_delete_only_at_the_planned_conflict_above_commit():
    """Rule 3: a deletion happens only where the plan said, and never at or below commit."""
    assert raftseam.may_delete_from(5, 5, 4)
    assert not raftseam.may_delete_from(5, None, 4)
    assert not raftseam.may_delete_from(4, 5, 4)
    assert not raftseam.may_delete_from(4, 4, 4)


# --- a model follower: pysyncobj's handling of what the plan hands it --------------------------

def apply_plan(log: list[int], commit: int, m: dict, term: int) -> tuple[list[int], int, int]:
    """What pysyncobj does with the plan's message (the log is a list of terms from index 1):
    returns the new log, commit index and the lowest index deleted (0: none)."""
    plan = raftseam.plan_append(m, term, view(log, commit))
    if plan.action != APPEND:
        return log, commit, 0
    rm = plan.message
    cut = 0
    if len(log) > rm["prevLogIdx"]:  # pysyncobj deletes after prev whenever it holds more
        assert raftseam.may_delete_from(rm["prevLogIdx"] + 1, plan.truncate_from, commit)
        cut = rm["prevLogIdx"] + 1
        log = log[:rm["prevLogIdx"]]
    log = log + [e[2] for e in rm["entries"]]
    if rm["commit_index"] > commit:
        commit = min(rm["commit_index"], len(log))
    return log, commit, cut


@st.composite
def histories(draw):
    """A leader's log of term-1 entries, replaced past some point by term-2 entries of a new
    leader, and the AppendEntries each leader sent, each with the commit index it had then."""
    n1 = draw(st.integers(3, 15))
    keep = draw(st.integers(1, n1))
    n2 = draw(st.integers(keep, keep + 10))
    old = [0] + [1] * (n1 - 1)
    new = old[:keep] + [2] * (n2 - keep)
    old_commit = draw(st.integers(1, keep))  # the new leader holds all the old one committed
    sent = []
    for log, term, commit_max in ((old, 1, old_commit), (new, 2, len(new))):
        for _ in range(draw(st.integers(1, 12))):
            prev = draw(st.integers(1, len(log)))
            upto = draw(st.integers(prev, len(log)))
            commit = draw(st.integers(1, commit_max))
            sent.append((term, {"type": "append_entries", "term": term, "commit_index": commit,
                                "prevLogIdx": prev, "prevLogTerm": log[prev - 1],
                                "entries": [(b"e", i + 1, log[i]) for i in range(prev, upto)]}))
    order = draw(st.permutations(sent))
    return new, order


@settings(max_examples=300, deadline=None)
@given(histories())
def test_any_order_never_cuts_or_changes_a_committed_entry(h):
    """Whatever order and duplicates the messages come in: no deletion at or below the commit
    index, the committed prefix never changes, and the log's committed prefix is the leader's."""
    leader_log, order = h
    log, commit, term = [0], 1, 0
    for msg_term, m in order:
        term = max(term, msg_term)
        before = log[:commit]
        log, new_commit, cut = apply_plan(log, commit, m, term)
        assert cut == 0 or cut > commit
        assert log[:commit] == before
        commit = new_commit
        assert log[:commit] == leader_log[:commit]


# --- elections ----------------------------------------------------------------------------------

@pytest.mark.parametrize("now,contact,leader,lease", [
    (10.0, 9.7, False, True),   # heard 0.3 s ago, min timeout 0.4
    (10.0, 9.5, False, False),  # 0.5 s ago: the lease is over
    (10.0, None, False, False),  # never heard of a leader
    (10.0, None, True, True),   # the leader itself
])
def test_in_lease(now, contact, leader, lease):
    """A member knows a live leader while it leads, or heard from one within the minimum
    election timeout."""
    assert raftseam.in_lease(now, contact, leader, 0.4) == lease


def pv(term, idx, t):
    return {"type": "pre_vote", "term": term, "last_log_index": idx, "last_log_term": t}


@pytest.mark.parametrize("m,term,last_idx,last_term,lease,grant", [
    (pv(4, 10, 3), 3, 10, 3, False, True),    # up to date, higher term, no leader
    (pv(4, 10, 3), 3, 10, 3, True, False),    # a live leader is known: no
    (pv(3, 10, 3), 3, 10, 3, False, False),   # not a higher term
    (pv(4, 9, 3), 3, 10, 3, False, False),    # shorter log of the same last term
    (pv(4, 2, 4), 3, 10, 3, False, True),     # later last term wins over length
    (pv(4, 20, 2), 3, 10, 3, False, False),   # earlier last term loses, however long
])
def test_grant_pre_vote(m, term, last_idx, last_term, lease, grant):
    """PreVote: yes only for a higher term, an up-to-date log (§5.4.1) and no live leader."""
    assert raftseam.grant_pre_vote(m, term, last_idx, last_term, lease) == grant


@pytest.mark.parametrize("asked,term,lease,ignore", [
    (5, 4, True, True),    # stickiness: a live leader is known
    (5, 4, False, False),
    (4, 4, True, False),   # same term: pysyncobj's rules (one vote per term) decide
])
def test_ignore_vote_request(asked, term, lease, ignore):
    """Leader stickiness: a vote request at a higher term is ignored within the lease."""
    m = {"type": "request_vote", "term": asked, "last_log_index": 1, "last_log_term": 1}
    assert raftseam.ignore_vote_request(m, term, lease) == ignore


@pytest.mark.parametrize("m", [{"term": 1}, pv("4", 1, 1), pv(4, None, 1), pv(4, 1, -2)])
def test_malformed_vote_request_is_garbage(m):
    with pytest.raises(RaftGarbage):
        raftseam.grant_pre_vote(m, 1, 1, 1, False)


@pytest.mark.parametrize("heard,ok", [
    ([9.9, 9.9], True),     # both followers answered lately
    ([9.9, 1.0], True),     # one of two: with the leader a majority of three
    ([1.0, 1.0], False),    # nobody: step down
    ([9.9, 1.0, 1.0, 1.0], False),  # two of five
    ([], True),             # a fleet of one
])
def test_quorum_recent(heard, ok):
    """CheckQuorum: a leader that has not heard from a majority within the window steps down."""
    assert raftseam.quorum_recent(10.0, heard, 0.8) == ok


def test_majority():
    assert raftseam.majority(2, 3) and not raftseam.majority(1, 3) and not raftseam.majority(2, 4)
