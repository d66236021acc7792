"""Job dependencies (issue 12 point 6) in the pure parts: the spec's `after` as control parses it,
and the table's rules for dependents (Rule 6 of meshjobs/table.py): waiting, released in the apply
of the entry that ended the last parent, dep_failed when a condition can never hold (in chains),
forget refused while a dependent waits, snapshots and the record.
"""

from __future__ import annotations

from typing import Any

import msgpack
import pytest

from meshjobs import limits
from meshjobs.control import ControlError, parse_after, parse_request, parse_submit
from meshjobs.node.feed import named_jobs
from meshjobs.table import CANCELLED, DONE, FAILED, PENDING, TIMEOUT, JobTable
from tests.helpers import T0, Log, row, spec


def after(*deps: str) -> list[dict[str, str]]:
    return parse_after(list(deps))


def submit(log: Log, job_id: str, *deps: str, n: int = 1, **kw: Any) -> dict:
    extra = {"after": after(*deps)} if deps else {}
    out = log.submit(job_id, n=n, dg=f"{job_id}/{deps}".encode(), **extra, **kw)
    log.table.check()
    return out


def end(log: Log, job_id: str, state: int = DONE, **kw: Any) -> dict:
    """Lease every item of a job and end it with `state` (retries none)."""
    job = log.job(job_id)
    _, epoch = log.lease(*[(job_id, i) for i in range(job.n)])
    out = log.result(*[row(job_id, i, epoch, state, rc=0 if state == DONE else 1)
                       for i in range(job.n)], **kw)
    log.table.check()
    return out


def states(log: Log) -> dict[str, str]:
    return {jid: j.state for jid, j in log.table.jobs.items()}


# --- control: parsing after ------------------------------------------------------------------


def test_after_forms_normalized() -> None:
    """Strings "ID" and "ID:COND" and objects {"id", "on"} all normalize to {"id", "on"}; the
    default condition is ok; the order given is kept."""
    got = parse_after(["a", "b:end", {"id": "c", "on": "fail"}, {"id": "d"}, "e:ok"])
    assert got == [{"id": "a", "on": "ok"}, {"id": "b", "on": "end"}, {"id": "c", "on": "fail"},
                   {"id": "d", "on": "ok"}, {"id": "e", "on": "ok"}]


def test_spec_after_is_a_fixed_point_and_absent_when_empty() -> None:
    """A normalized spec parses to itself (the table checks committed specs that way), and a
    spec without after (or with an empty one) has no "after" key: older logs stay valid."""
    s = parse_submit({"argv": ["x"], "after": ["a", "b:fail"]})
    assert s["after"] == [{"id": "a", "on": "ok"}, {"id": "b", "on": "fail"}]
    assert parse_submit({k: v for k, v in s.items() if k != "id"}) == s
    assert "after" not in parse_submit({"argv": ["x"]})
    assert "after" not in parse_submit({"argv": ["x"], "after": []})
    assert "after" not in parse_submit({"argv": ["x"], "after": None})


BAD_AFTER = [
    ("a string", "a"),
    ("an object", {"id": "a"}),
    ("a number", 5),
    ("true", True),
    ("a number in the list", [5]),
    ("null in the list", [None]),
    ("a list in the list", [["a"]]),
    ("a bool id", [{"id": True}]),
    ("no id", [{"on": "ok"}]),
    ("an empty id", [""]),
    ("an empty id before a condition", [":ok"]),
    ("a bad id", ["a b"]),
    ("a path id", ["../a"]),
    ("a NUL id", ["a\x00"]),
    ("a long id", ["x" * (limits.job_id_chars_max + 1)]),
    ("an unknown condition", ["a:maybe"]),
    ("an empty condition", ["a:"]),
    ("two colons", ["a:ok:ok"]),
    ("an upper-case condition", ["a:OK"]),
    ("a condition of the wrong type", [{"id": "a", "on": 1}]),
    ("a null condition", [{"id": "a", "on": None}]),
    ("an unknown key", [{"id": "a", "on": "ok", "when": "now"}]),
    ("a parent twice", ["a", "a:end"]),
    ("too many parents", [f"p{i}" for i in range(limits.deps_max + 1)]),
    ("a huge list", ["a"] * 100_000),
]


@pytest.mark.parametrize("name,value", BAD_AFTER, ids=[b[0] for b in BAD_AFTER])
def test_bad_after_refused(name: str, value: Any) -> None:
    """Malformed or hostile after values are refused with 400 and words that say what to use."""
    with pytest.raises(ControlError) as info:
        parse_submit({"argv": ["x"], "after": value})
    assert info.value.status == 400
    assert "after" in info.value.message or "parent" in info.value.message


def test_deps_max_parents_accepted() -> None:
    """Exactly deps_max parents pass."""
    got = parse_after([f"p{i}" for i in range(limits.deps_max)])
    assert len(got) == limits.deps_max


def test_self_reference_refused_in_control() -> None:
    """A job that names its own id in after is refused before anything is proposed."""
    with pytest.raises(ControlError) as info:
        parse_submit({"id": "me", "argv": ["x"], "after": ["other", "me:end"]})
    assert info.value.status == 400 and "itself" in info.value.message


def test_forwarded_submit_checks_after() -> None:
    """A forwarded submit (parse_request) checks after like an HTTP one."""
    req = {"op": "submit", "rid": "r1", "spec": {"argv": ["x"], "after": ["a:nope"]},
           "items": [None]}
    with pytest.raises(ControlError):
        parse_request(req)
    req["spec"]["after"] = ["a:end"]
    assert parse_request(req)["spec"]["after"] == [{"id": "a", "on": "end"}]


# --- the table: waiting and released -----------------------------------------------------------


def test_dependent_waits_and_is_not_leased() -> None:
    """A job with an unfinished parent is "waiting": not in the ready index, never picked, and a
    lease of its items is refused even when proposed."""
    log = Log()
    submit(log, "p")
    submit(log, "c", "p", n=2)
    assert states(log) == {"p": "queued", "c": "waiting"}
    assert "c" not in log.table.ready
    assert log.table.pick("default", 10, T0, set()) == [("p", 0)]
    out, _ = log.lease(("c", 0), ("c", 1))
    assert out["granted"] == 0 and out["refused"] == 2
    assert log.job("c").n_pending == 2
    log.table.check()


@pytest.mark.parametrize("cond,parent_end,runs", [
    ("ok", DONE, True), ("ok", FAILED, False), ("ok", TIMEOUT, False), ("ok", "cancel", False),
    ("end", DONE, True), ("end", FAILED, True), ("end", TIMEOUT, True), ("end", "cancel", True),
    ("fail", DONE, False), ("fail", FAILED, True), ("fail", TIMEOUT, True), ("fail", "cancel", True),
])
def test_each_condition(cond: str, parent_end: Any, runs: bool) -> None:
    """ok holds when the parent ends done; end when it ends at all; fail when it ends failed
    (a timeout counts) or cancelled. A condition that holds releases the dependent (queued) in
    the apply of the entry that ended the parent, with the version of that entry; one that can
    never hold ends it dep_failed, its items cancelled unrun."""
    log = Log()
    submit(log, "p")
    submit(log, "c", f"p:{cond}", n=3)
    out = log.op("cancel", "p") if parent_end == "cancel" else end(log, "p", parent_end)
    log.table.check()
    c = log.job("c")
    assert out["deps"] == ["c"]
    assert c.version == log.index
    if runs:
        assert c.state == "queued" and "c" in log.table.ready and c.n_pending == 3
        assert log.table.pick("default", 10, T0, set()) == [("c", 0), ("c", 1), ("c", 2)]
    else:
        assert c.state == "dep_failed" and c.finished and c.n_cancelled == 3
        assert all(s == CANCELLED for s in c.st) and "c" not in log.table.ready
        assert "c" in log.table.finished


def test_all_parents_must_hold() -> None:
    """A dependent of several parents runs only when the last of them ends, in that apply."""
    log = Log()
    for p in ("p1", "p2", "p3"):
        submit(log, p)
    submit(log, "c", "p1", "p2:end", "p3:fail")
    end(log, "p1")
    assert log.job("c").state == "waiting"
    assert [d["id"] for d in log.table.record(log.job("c"))["waiting_on"]] == ["p2", "p3"]
    end(log, "p3", FAILED)
    assert log.job("c").state == "waiting"
    out = end(log, "p2", FAILED)
    assert out["deps"] == ["c"] and log.job("c").state == "queued"
    assert log.table.record(log.job("c"))["waiting_on"] == []


def test_one_impossible_parent_ends_it_at_once() -> None:
    """One condition that can never hold ends the dependent dep_failed at once, even while other
    parents still run; those parents' dependents no longer list it."""
    log = Log()
    submit(log, "p1")
    submit(log, "p2")
    submit(log, "c", "p1", "p2")
    end(log, "p1", FAILED)
    assert log.job("c").state == "dep_failed"
    assert "p2" not in log.table.dependents
    end(log, "p2")
    assert log.job("c").state == "dep_failed"


def test_dep_failed_chains() -> None:
    """A dependent of a dep_failed job: with ok it ends dep_failed too (in the same apply), with
    end or fail it runs; a long chain settles without recursion."""
    log = Log()
    submit(log, "p")
    submit(log, "c", "p")
    submit(log, "g-ok", "c:ok")
    submit(log, "g-end", "c:end")
    submit(log, "g-fail", "c:fail")
    submit(log, "gg", "g-ok:ok")
    out = end(log, "p", FAILED)
    assert out["deps"] == ["c", "g-ok", "g-end", "g-fail", "gg"]
    assert states(log) == {"p": "failed", "c": "dep_failed", "g-ok": "dep_failed",
                           "g-end": "queued", "g-fail": "queued", "gg": "dep_failed"}
    assert {log.job(j).version for j in out["deps"]} == {log.index}


def test_long_chain_settles_in_one_apply() -> None:
    """Thousands of jobs in a chain of ok: a cancel of the first ends them all dep_failed in its
    own apply (a worklist, so no recursion limit)."""
    log = Log()
    submit(log, "j0")
    for i in range(1, 3000):
        log.submit(f"j{i}", dg=f"j{i}".encode(), after=after(f"j{i - 1}"))
    out = log.op("cancel", "j0")
    assert len(out["deps"]) == 2999
    assert all(log.job(f"j{i}").state == "dep_failed" for i in range(1, 3000))
    assert not log.table.dependents
    log.table.check()


def test_parent_ended_before_submit_is_settled_at_submit() -> None:
    """A parent that has already ended is settled at the submit: the dependent is born queued,
    or dep_failed (its items cancelled) when the parent ended the wrong way."""
    log = Log()
    submit(log, "ok")
    submit(log, "bad")
    end(log, "ok")
    end(log, "bad", FAILED)
    submit(log, "runs", "ok", "bad:fail")
    submit(log, "never", "ok", "bad:ok", n=2)
    assert log.job("runs").state == "queued" and "runs" in log.table.ready
    never = log.job("never")
    assert never.state == "dep_failed" and never.n_cancelled == 2 and never.finished
    assert not log.table.dependents


def test_unknown_forgotten_and_self_parents_refused() -> None:
    """Parents must exist at the submit: unknown or forgotten ids and the job's own id are
    refused with 400 (no job is made), with words that say what to do."""
    log = Log()
    out = submit(log, "c", "nope")
    assert (out["ok"], out["status"], out["reason"]) == (False, 400, "bad_after")
    assert "nope" in out["error"] and "does not exist" in out["error"]
    submit(log, "p")
    end(log, "p")
    log.op("forget", "p")
    out = submit(log, "c", "p")
    assert out["status"] == 400 and "forgotten" in out["error"]
    out = submit(log, "c", "c")
    assert out["status"] == 400 and "itself" in out["error"]
    assert "c" not in log.table.jobs


def test_resubmit_with_other_after_conflicts() -> None:
    """after is part of the spec: the same id with another after is another job (409), so a
    job's edges never change and no cycle can be made by a re-submit."""
    log = Log()
    submit(log, "a")
    submit(log, "b", "a")
    out = log.submit("a", dg=b"other", after=after("b"))
    assert out["status"] == 409
    same = log.submit("b", dg=b"b/('a',)", after=after("a"))
    assert same == {"ok": True, "id": "b", "new": False}


def test_cancel_of_a_waiting_job() -> None:
    """A waiting job may be cancelled: it leaves its parents' dependents, and its own
    dependents are settled (ok: dep_failed; fail: released)."""
    log = Log()
    submit(log, "p")
    submit(log, "c", "p")
    submit(log, "k-ok", "c")
    submit(log, "k-fail", "c:fail")
    out = log.op("cancel", "c")
    assert out["deps"] == ["k-ok", "k-fail"]
    assert states(log) == {"p": "queued", "c": "cancelled", "k-ok": "dep_failed",
                           "k-fail": "queued"}
    assert "p" not in log.table.dependents
    log.table.check()


def test_tone_of_a_waiting_job() -> None:
    """A waiting job may be held and released; it stays waiting (not leased) until its parents
    allow, and a hold it has then still holds."""
    log = Log()
    submit(log, "p")
    submit(log, "c", "p")
    assert log.op("tone", "c", hold=True)["ok"]
    assert log.job("c").state == "waiting"
    end(log, "p")
    assert log.job("c").state == "held" and "c" not in log.table.ready
    log.op("tone", "c", hold=False)
    assert log.job("c").state == "queued" and "c" in log.table.ready


def test_forget_refused_while_dependents_wait() -> None:
    """Forgetting a parent that a dependent waits on is refused (409) naming the dependents;
    once the parent ends, forgetting (or expiring) it changes nothing for them."""
    log = Log()
    submit(log, "p")
    submit(log, "q")
    submit(log, "c1", "p", "q")
    submit(log, "c2", "p:end")
    out = log.op("forget", "p")
    assert (out["status"], out["reason"]) == (409, "has_dependents")
    assert "c1" in out["error"] and "c2" in out["error"]
    end(log, "p")
    assert log.op("forget", "p")["ok"]
    assert log.job("c1").state == "waiting" and log.job("c2").state == "queued"
    end(log, "q")
    out = log.apply({"k": "expire", "t": T0, "ids": ["q"]})
    assert out["expired"] == ["q"]
    assert log.job("c1").state == "queued"
    log.table.check()


def test_dependents_of_a_reused_id_are_not_mixed_up() -> None:
    """A parent expired and its id reused by a new job (its tombstone dropped): dependents that
    waited on the old one were settled when it ended and do not wait on the new one."""
    log = Log()
    submit(log, "p")
    submit(log, "x")
    submit(log, "c", "p", "x")
    end(log, "p")
    log.apply({"k": "expire", "t": T0, "ids": ["p"]})
    log.table.forgotten.clear()  # as if its tombstone had been dropped (forgotten_ids_max)
    out = log.submit("p", dg=b"new-p")
    assert out["new"]
    assert list(log.job("c").waiting_on or {}) == ["x"]
    end(log, "p", FAILED)
    assert log.job("c").state == "waiting"
    log.table.check()


def test_records_say_what_a_job_waits_for() -> None:
    """The record of a job with after has "after" (every parent and condition) and "waiting_on"
    (those not settled yet); a job without after has neither key (its record is as before)."""
    log = Log()
    submit(log, "p")
    submit(log, "c", "p:end")
    rec = log.table.record(log.job("c"))
    assert rec["state"] == "waiting"
    assert rec["after"] == [{"id": "p", "on": "end"}]
    assert rec["waiting_on"] == [{"id": "p", "on": "end"}]
    assert "after" not in log.table.record(log.job("p"))
    assert "waiting_on" not in log.table.record(log.job("p"))


def test_feed_names_the_dependents_an_entry_changed() -> None:
    """/events and ?since= follow what an entry changed: the jobs it names and the dependents its
    outcome lists."""
    log = Log()
    submit(log, "p")
    submit(log, "c", "p")
    _, epoch = log.lease(("p", 0))
    e = {"k": "result", "t": T0, "r": [row("p", 0, epoch)]}
    out = log.apply(e)
    assert named_jobs("result", e, out) == ["p", "c"]


def _deps_history() -> Log:
    log = Log()
    submit(log, "p1")
    submit(log, "p2")
    submit(log, "c", "p1", "p2:end")
    submit(log, "d", "c:fail")
    submit(log, "bad")
    end(log, "bad", FAILED)
    submit(log, "df", "bad")
    submit(log, "w2", "p2")
    end(log, "p1")
    return log


def test_snapshot_carries_dependencies() -> None:
    """Snapshots carry waiting_on and dep_failed, and the reverse index is rebuilt the same (so
    later entries settle dependents in the same order on both tables)."""
    log = _deps_history()
    t = log.table
    raw = msgpack.packb(t.to_state(), use_bin_type=True)
    t2 = JobTable.from_state(msgpack.unpackb(raw, raw=False, strict_map_key=False))
    t2.check()
    assert msgpack.packb(t2.to_state(), use_bin_type=True) == raw
    assert t2.dependents == t.dependents
    assert [list(k) for k in t2.dependents.values()] == [list(k) for k in t.dependents.values()]
    assert {j: x.state for j, x in t2.jobs.items()} == {j: x.state for j, x in t.jobs.items()}
    assert [t2.record(j, items=True) for j in t2.jobs.values()] == \
        [t.record(j, items=True) for j in t.jobs.values()]
    _, epoch = log.lease(("p2", 0))
    e = {"k": "result", "t": T0, "r": [row("p2", 0, epoch, FAILED, rc=1)]}
    n = log.index + 1
    t2.apply({"k": "lease", "t": T0, "g": [["p2", 0, "m1", "b1"]]}, log.index)
    assert t.apply(e, n) == t2.apply(e, n)
    assert t.to_state() == t2.to_state()
    assert t.jobs["c"].state == "queued" and t.jobs["w2"].state == "dep_failed"


def test_snapshot_without_dependencies_unchanged() -> None:
    """A table with no dependencies snapshots without the new keys (older readers load it)."""
    log = Log()
    submit(log, "a")
    s = log.table.to_state()
    assert "waits" not in s and "dep_failed" not in s


def test_check_catches_broken_dependencies() -> None:
    """check() asserts the invariants of dependencies: a waiting job never leased, the reverse
    index consistent with waiting_on."""
    log = Log()
    submit(log, "p")
    submit(log, "c", "p")
    t = log.table
    t.dependents["p"].pop("c")
    with pytest.raises(AssertionError):
        t.check()
    t.dependents["p"]["c"] = None
    t.check()
    t.jobs["c"].st[0] = PENDING
    t.ready["c"] = t.jobs["c"]
    with pytest.raises(AssertionError):
        t.check()


def test_dep_failed_job_cannot_be_cancelled_or_toned() -> None:
    """dep_failed is final: cancel and tone are refused as for any ended job, forget works."""
    log = Log()
    submit(log, "p")
    submit(log, "c", "p")
    log.op("cancel", "p")
    assert log.op("cancel", "c")["status"] == 409
    assert log.op("tone", "c", priority=3)["status"] == 409
    assert log.op("forget", "c")["ok"]


def test_spec_fields_keep_after() -> None:
    """The committed spec keeps after, as control normalized it."""
    log = Log()
    submit(log, "p")
    submit(log, "c", "p:fail")
    assert log.job("c").spec_fields()["after"] == [{"id": "p", "on": "fail"}]
    assert spec() == {k: v for k, v in log.job("p").spec_fields().items()}


def test_a_dependent_waiting_on_fewer_gets_a_new_version() -> None:
    """When one of several parents ends as asked, the dependent's record changes (waiting_on
    shrinks): its version is that entry's, and the entry's outcome names it once."""
    log = Log()
    submit(log, "p1")
    submit(log, "p2")
    submit(log, "p3")
    submit(log, "c", "p1", "p2", "p3")
    _, epoch = log.lease(("p1", 0), ("p2", 0))
    out = log.result(row("p1", 0, epoch), row("p2", 0, epoch))
    assert out["deps"] == ["c"]
    assert log.job("c").version == log.index and log.job("c").state == "waiting"
    assert [d["id"] for d in log.table.record(log.job("c"))["waiting_on"]] == ["p3"]


def test_job_page_shows_parents() -> None:
    """The job page lists a dependent's parents (links), marking those it still waits for."""
    from meshjobs import webui

    log = Log()
    submit(log, "p1")
    submit(log, "p2")
    submit(log, "c", "p1", "p2:end")
    end(log, "p1")
    html = webui.job_page("m1", log.table.record(log.job("c"), items=True), [], 0)
    assert 'href="/jobs/p1">p1</a>:ok' in html and "p2</a>:end (waiting)" in html
    assert "p1</a>:ok (waiting)" not in html
    assert 'class="state waiting"' in html


def test_node_leases_a_dependent_only_once_released() -> None:
    """The job node (one member, its own log): a dependent submitted while its parent runs gets
    no lease proposed with its submit (nor later, while it waits); the entry that ends the
    parent releases it, the next round leases and runs it, and a client waiting on the
    dependent's version (?since=) is answered at its release."""
    from tests.helpers import Fleet1, submit_req

    f = Fleet1(slots=2)
    f.ctl(1, submit_req(rid="r1", job_id="p"))
    f.settle()
    assert [r.job_id for r in f.runs] == ["p"]
    f.ctl(2, submit_req(rid="r2", job_id="c", n=2, after=["p"]))
    f.take()
    assert not any(g[0] == "c" for e in f.pending_of("lease") for g in e["g"])
    f.settle()
    assert f.answer(2).status == 201 and f.answer(2).body["state"] == "waiting"
    assert [r.job_id for r in f.runs] == ["p"]
    since = f.table.jobs["c"].version
    f.ctl(3, {"op": "get", "id": "c", "items": False, "wait_ms": 60_000, "since": since})
    f.take()
    assert 3 not in f.replies
    f.end(f.runs[0])
    f.settle()
    assert f.table.jobs["p"].state == "done"
    assert f.answer(3).status == 200 and f.answer(3).body["waiting_on"] == []
    assert sorted((r.job_id, r.index) for r in f.runs) == [("c", 0), ("c", 1), ("p", 0)]


def test_remembered_outcome_keeps_no_dependents() -> None:
    """A change's outcome is remembered under its request id without the dependents it changed
    (a retry changes none, and snapshots stay small); the first answer names them."""
    log = Log()
    submit(log, "p")
    submit(log, "c", "p")
    first = log.op("cancel", "p", rid="r-cancel")
    assert first["deps"] == ["c"]
    again = log.op("cancel", "p", rid="r-cancel")
    assert again == {"ok": True, "id": "p"}
    assert "deps" not in log.table.rids["r-cancel"]
