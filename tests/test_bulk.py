"""Many jobs at once (issue 12, point 5): parsing a bulk request, resolving its filter, the
table's one-entry `bulk` change and its per-job answers, the node's answer and its dry run.
Pure: the table and the node are driven directly, without IO."""

from __future__ import annotations

import random
from typing import Any

import pytest

from meshjobs import bulk, limits
from meshjobs.control import ControlError, parse_bulk, parse_request
from meshjobs.node import Ctl, JobNode, NodeConfig, Pool, Propose, Tick, View
from meshjobs.node.feed import named_jobs
from meshjobs.table import JobTable
from tests.helpers import T0, Log, spec


def _jobs(log: Log) -> None:
    """a: queued, tag t; b: running on m1, tag t, pool p; c: done on m2; d: held, tag u."""
    log.submit("a", tags=["t"])
    log.submit("b", tags=["t"], pool="p")
    log.lease(("b", 0), member="m1")
    log.submit("c")
    _, epoch = log.lease(("c", 0), member="m2")
    log.result(["c", 0, epoch, 2, 0, None, None, None, T0, T0])
    log.submit("d", tags=["u"], hold=True)


# --- parsing ------------------------------------------------------------------------------------

@pytest.mark.parametrize("action,body,words", [
    ("cancel", [], "JSON object"),
    ("cancel", {}, "not both and not neither"),
    ("cancel", {"ids": ["a"], "filter": {"tag": "t"}}, "not both"),
    ("cancel", {"ids": []}, "non-empty list"),
    ("cancel", {"ids": "a,b"}, "non-empty list"),
    ("cancel", {"ids": [1, 2]}, "bad job id"),
    ("cancel", {"ids": ["ok", "no/slash"]}, "bad job id"),
    ("cancel", {"ids": ["x"] * (limits.bulk_jobs_max + 1)}, f"at most {limits.bulk_jobs_max}"),
    ("cancel", {"filter": {}}, "at least one"),
    ("cancel", {"filter": {"tog": "t"}}, "unknown filter key"),
    ("cancel", {"filter": {"state": "sleeping"}}, "unknown state"),
    ("cancel", {"filter": {"tag": 7}}, "tag must be a string"),
    ("cancel", {"filter": {"tag": ""}}, "must not be empty"),
    ("cancel", {"filter": {"member": "a b"}}, "bad member name"),
    ("cancel", {"filter": {"pool": "../x"}}, "bad pool name"),
    ("cancel", {"filter": "tag=t"}, "filter must be an object"),
    ("cancel", {"ids": ["a"], "dry_run": "yes"}, "dry_run must be true or false"),
    ("cancel", {"ids": ["a"], "set": {"priority": 1}}, "unknown key"),
    ("cancel", {"ids": ["a"], "after": "3"}, "no pages"),
    ("cancel", {"filter": {"tag": "t"}, "after": "x1"}, "cursor"),
    ("cancel", {"ids": ["a"], "extra": 1}, "unknown key"),
    ("status", {"ids": ["a"], "dry_run": True}, "unknown key"),
    ("tone", {"ids": ["a"]}, 'needs "set"'),
    ("tone", {"ids": ["a"], "set": {}}, "nothing to change"),
    ("tone", {"ids": ["a"], "set": {"priority": True}}, "priority must be an integer"),
    ("explode", {"ids": ["a"]}, "unknown bulk action"),
])
def test_hostile_bulk_bodies_are_refused(action, body, words):
    """Rule: a bulk request is remote garbage until parse_bulk says otherwise; each refusal is
    a 400 that says what to send instead."""
    with pytest.raises(ControlError) as e:
        parse_bulk(action, body)
    assert e.value.status == 400
    assert words in e.value.message


def test_bulk_ids_keep_order_without_repeats():
    """Rule: ids are answered in the order given, each once."""
    out = parse_bulk("cancel", {"ids": ["b", "a", "b"], "dry_run": True})
    assert out == {"action": "cancel", "dry_run": True, "ids": ["b", "a"]}
    req = parse_request({"op": "bulk", "action": "tone", "rid": "r1", "ids": ["a"],
                         "set": {"hold": True}, "junk": 1})
    assert req["set"] == {"hold": True} and req["rid"] == "r1" and "junk" not in req


# --- resolving a filter -------------------------------------------------------------------------

@pytest.mark.parametrize("flt,want", [
    ({"tag": "t"}, ["a", "b"]),
    ({"state": "running"}, ["b"]),
    ({"state": "done"}, ["c"]),
    ({"pool": "p"}, ["b"]),
    ({"member": "m1"}, ["b"]),
    ({"member": "m2"}, ["c"]),
    ({"member": "m9"}, []),
    ({"tag": "t", "state": "queued"}, ["a"]),
    ({"tag": "u", "state": "held"}, ["d"]),
])
def test_filter_resolution(flt, want):
    """Rule: a job matches a filter when it passes every key given (member: an item of it
    ran or runs there); matches come in submit order."""
    log = Log()
    _jobs(log)
    assert bulk.resolve(log.table, {"filter": flt}) == (want, None)


def test_filter_pages_past_the_bound():
    """Rule 2 of bulk.py: a filter that matches more than bulk_jobs_max jobs answers the oldest
    bulk_jobs_max and a cursor; the cursor's page has the rest, and no cursor."""
    log = Log()
    n = limits.bulk_jobs_max + 3
    for k in range(n):
        log.submit(f"j{k}", tags=["many"], dg=b"d%d" % k)
    ids, nxt = bulk.resolve(log.table, {"filter": {"tag": "many"}})
    assert len(ids) == limits.bulk_jobs_max and ids[0] == "j0" and nxt is not None
    rest, last = bulk.resolve(log.table, {"filter": {"tag": "many"}, "after": int(nxt)})
    assert rest == [f"j{k}" for k in range(limits.bulk_jobs_max, n)] and last is None


# --- the table's bulk entry ---------------------------------------------------------------------

def test_bulk_cancel_answers_per_job_in_one_entry():
    """Rule: a bulk change is one entry; each job answers changed, already_final, no_such_job
    or refused, and the table's invariants hold after it."""
    log = Log()
    _jobs(log)
    log.op("forget", "c")
    before = log.index
    out = log.apply({"k": "bulk", "t": T0, "op": "cancel", "ids": ["a", "b", "c", "zz", "d"]})
    assert log.index == before + 1
    assert out["ok"] and out["rows"] == [["a", "changed", None], ["b", "changed", None],
                                         ["c", "no_such_job", None], ["zz", "no_such_job", None],
                                         ["d", "changed", None]]
    assert {j: log.job(j).state for j in "abd"} == dict.fromkeys("abd", "cancelled")
    again = log.apply({"k": "bulk", "t": T0, "op": "cancel", "ids": ["a"]})
    assert again["rows"] == [["a", "already_final", None]]
    log.table.check()
    assert named_jobs("bulk", {}, out) == ["a", "b", "d"]


def test_bulk_forget_refuses_running_jobs_and_forgets_the_rest():
    """Rule: forgetting a job that has not ended is refused (and says what to do); the ended
    ones in the same entry are forgotten."""
    log = Log()
    _jobs(log)
    out = log.apply({"k": "bulk", "t": T0, "op": "forget", "ids": ["b", "c"]})
    assert out["rows"][0][:2] == ["b", "refused"] and "cancel it first" in out["rows"][0][2]
    assert out["rows"][1] == ["c", "changed", None]
    assert "c" in log.table.forgotten and "b" in log.table.jobs
    log.table.check()


def test_bulk_tone_sets_fields_on_every_job():
    """Rule: a bulk tone applies `set` to every named job that has not ended."""
    log = Log()
    _jobs(log)
    out = log.apply({"k": "bulk", "t": T0, "op": "tone", "ids": ["a", "c"],
                     "set": {"priority": 7, "hold": True}})
    assert out["rows"] == [["a", "changed", None], ["c", "already_final", None]]
    assert log.job("a").priority == 7 and log.job("a").state == "held"
    log.table.check()


def test_bulk_entry_is_idempotent_by_request_id():
    """Rule: a retried bulk change (same rid and fp) applies nothing and answers as the first;
    the same rid on another request is refused (422)."""
    log = Log()
    _jobs(log)
    e = {"k": "bulk", "t": T0, "op": "cancel", "ids": ["a", "b"], "rid": "r1", "fp": "f" * 32}
    first = log.apply(e)
    second = log.apply(dict(e))
    assert second["rows"] == first["rows"] == [["a", "changed", None], ["b", "changed", None]]
    other = log.apply({**e, "ids": ["d"], "fp": "0" * 32})
    assert other["status"] == 422 and log.job("d").state == "held"


@pytest.mark.parametrize("entry", [
    {"k": "bulk", "t": T0, "op": "submit", "ids": ["a"]},
    {"k": "bulk", "t": T0, "op": "cancel", "ids": []},
    {"k": "bulk", "t": T0, "op": "cancel", "ids": "a"},
    {"k": "bulk", "t": T0, "op": "cancel", "ids": ["a"] * (limits.bulk_jobs_max + 1)},
    {"k": "bulk", "t": T0, "op": "tone", "ids": ["a"]},
    {"k": "bulk", "t": T0, "op": "tone", "ids": ["a"], "set": {"argv": ["rm"]}},
    {"k": "bulk", "t": T0, "op": "cancel", "ids": ["a"], "set": {"priority": 1}},
    {"k": "bulk", "t": T0, "op": "cancel", "ids": [["a"], 3, None]},
])
def test_malformed_bulk_entries_are_refusals(entry):
    """Rule 2 of table.py: a malformed bulk entry is a recorded refusal, never an exception,
    and changes nothing."""
    log = Log()
    _jobs(log)
    out = log.apply(entry)
    if out.get("ok"):  # ids that are not strings: each refused on its own
        assert all(r[1] in ("refused", "no_such_job") for r in out["rows"])
    else:
        assert out["reason"] == "malformed"
    assert log.job("a").state == "queued" and log.job("a").priority == 0
    log.table.check()


def test_bulk_in_a_batch_applies():
    """Rule: the leader's batch may carry a bulk entry beside other changes."""
    log = Log()
    _jobs(log)
    out = log.apply({"k": "batch", "t": T0, "es": [
        {"k": "bulk", "t": T0, "op": "cancel", "ids": ["a"]},
        {"k": "tone", "t": T0, "id": "d", "hold": False}]})
    assert out["outcomes"][0]["rows"] == [["a", "changed", None]] and out["outcomes"][1]["ok"]


def test_forgetting_calls_the_history_hook_with_the_final_record():
    """Rule: the table hands every job it drops (forget, bulk forget, expire) to on_forget,
    with its final record and items summary, why, time and log index; a snapshot install
    keeps the hook."""
    log = Log()
    seen: list[tuple[Any, ...]] = []
    log.table.on_forget = lambda rec, why, t, index: seen.append((rec["id"], why, t, index, rec))
    _jobs(log)
    log.op("cancel", "a")
    log.op("forget", "a", t=T0 + 5)
    log.apply({"k": "bulk", "t": T0 + 6, "op": "forget", "ids": ["c"]})
    log.table.load(JobTable.from_state(log.table.to_state()))
    log.op("cancel", "d")
    log.apply({"k": "expire", "t": T0 + 7, "ids": ["d"]})
    assert [s[:3] for s in seen] == [("a", "forget", T0 + 5), ("c", "forget", T0 + 6),
                                     ("d", "expire", T0 + 7)]
    assert seen[1][3] == log.index - 2  # the bulk forget; then a cancel and the expire
    c = seen[1][4]
    assert c["state"] == "done" and c["items_summary"] == {"states": {"done": 1},
                                                          "members": ["m2"]}


# --- the node: resolve at the leader, dry run anywhere ------------------------------------------

def _leader() -> tuple[JobNode, Log]:
    log = Log()
    node = JobNode(log.table, NodeConfig(member="m1", boot="b1",
                                         pools={"elsewhere": Pool("elsewhere", "command", 1)},
                                         keep_s=None, keep_jobs=None),
                   random.Random(1))
    node.step(Tick(T0))
    node.step(View(term=1, leader="m1", is_leader=True, ready=True))
    node.take()
    return node, log


def _replies(effects: list) -> list:
    return [e for e in effects if type(e).__name__ == "Reply"]


def test_node_dry_run_changes_nothing_and_proposes_nothing():
    """Rule: a dry run is a read: it answers what would change and proposes no entry."""
    node, log = _leader()
    _jobs(log)
    node.step(Ctl(1, {"op": "bulk", "action": "forget", "rid": "r", "dry_run": True,
                      "filter": {"tag": "t"}}))
    out = node.take()
    assert not [e for e in out if isinstance(e, Propose)]
    (reply,) = _replies(out)
    body = reply.answer.body
    assert [(r["id"], r["answer"]) for r in body["results"]] == [("a", "refused"),
                                                                 ("b", "refused")]
    assert body["dry_run"] is True and "a" in log.table.jobs


def test_node_resolves_a_filter_into_one_bulk_entry():
    """Rule: the leader resolves a filter against its committed table and proposes one bulk
    entry naming the ids; a filter that matches nothing is answered at once, proposing
    nothing."""
    node, log = _leader()
    _jobs(log)
    node.step(Ctl(1, {"op": "bulk", "action": "cancel", "rid": "r2", "filter": {"tag": "t"}}))
    (prop,) = [e for e in node.take() if isinstance(e, Propose)]
    (sub,) = prop.entry["es"]
    assert sub["k"] == "bulk" and sub["ids"] == ["a", "b"] and sub["rid"] == "r2"
    node.step(Ctl(2, {"op": "bulk", "action": "cancel", "rid": "r3", "filter": {"tag": "none"}}))
    out = node.take()
    assert not [e for e in out if isinstance(e, Propose)]
    (reply,) = _replies(out)
    assert reply.answer.body["matched"] == 0


def test_node_bulk_status_answers_records_and_unknowns():
    """Rule: bulk status answers each named job's record, or no_such_job."""
    node, log = _leader()
    _jobs(log)
    node.step(Ctl(1, {"op": "bulk", "action": "status", "ids": ["c", "nope"]}))
    (reply,) = _replies(node.take())
    res = reply.answer.body["results"]
    assert res[0]["answer"] == "found" and res[0]["job"]["state"] == "done"
    assert res[1] == {"id": "nope", "answer": "no_such_job"}


def test_spec_helper_matches_control():
    """The tests' spec helper is what control normalizes (so _jobs' submits are applied)."""
    assert spec()["pool"] == "default"


# --- on real members ----------------------------------------------------------------------------

import json  # noqa: E402

from tests.helpers import Meshd, make_fleet, start_all, wait_until  # noqa: E402


@pytest.fixture
def member(tmp_path):
    m = Meshd(str(tmp_path / "m1"), slots=1)
    try:
        m.start()
        yield m
    finally:
        m.stop()


def _submit(m: Meshd, job_id: str, **kw: Any) -> None:
    status, body = m.request("POST", "/jobs", {"id": job_id, **kw})
    assert status == 201, body


def _state(m: Meshd, job_id: str) -> str | None:
    status, body = m.request("GET", f"/jobs/{job_id}")
    return body.get("state") if status == 200 else None


@pytest.mark.fleet
def test_bulk_cancel_by_tag_and_forget_by_state_with_dry_run(member):
    """meshctl job cancel --tag cancels every tagged job (running ones cut) and no other;
    forget --state cancelled --dry-run shows them and changes nothing; without --dry-run they
    are forgotten; bulk status reports each. Exit codes: 0 all done, 1 some refused or not
    found, 3 none found."""
    m = member
    _submit(m, "run1", argv=["sleep", "60"], tags=["batch7"])
    _submit(m, "held1", argv=["true"], tags=["batch7"], hold=True)
    _submit(m, "held2", argv=["true"], tags=["batch7"], hold=True)
    _submit(m, "other", argv=["true"], tags=["keep"], hold=True)
    wait_until(lambda: _state(m, "run1") == "running", what="run1 running")
    r = m.ctl("job", "cancel", "--tag", "batch7")
    assert r.returncode == 0, r.stderr
    out = r.stdout.decode()
    assert all(f"{j}: changed (cancelled)" in out for j in ("run1", "held1", "held2"))
    assert "other" not in out and _state(m, "other") == "held"
    # run1's item was running: it is cut (its item ends cancelled, not done).
    assert m.wait_job("run1")["items"][0]["state"] == "cancelled"

    r = m.ctl("--json", "job", "forget", "--state", "cancelled", "--dry-run")
    assert r.returncode == 0, r.stderr
    dry = json.loads(r.stdout)
    assert dry["dry_run"] is True
    assert {x["id"]: x["answer"] for x in dry["results"]} == dict.fromkeys(
        ("run1", "held1", "held2"), "would_change")
    assert all(_state(m, j) == "cancelled" for j in ("run1", "held1", "held2"))

    r = m.ctl("job", "status", "run1", "other", "nosuch")
    assert r.returncode == 1
    assert "nosuch: no such job" in r.stdout.decode() and "run1  cancelled" in r.stdout.decode()

    r = m.ctl("job", "forget", "--state", "cancelled")
    assert r.returncode == 0, r.stderr
    assert all(_state(m, j) is None for j in ("run1", "held1", "held2"))
    assert m.ctl("job", "status", "--tag", "batch7").returncode == 3  # none found
    assert m.ctl("job", "forget", "other", "nosuch").returncode == 1  # other has not ended
    assert _state(m, "other") == "held"
    r = m.ctl("job", "tone", "--tag", "keep", "--priority", "5")
    assert r.returncode == 0 and m.request("GET", "/jobs/other")[1]["priority"] == 5


@pytest.mark.fleet
def test_bulk_change_is_idempotent_over_http(member):
    """An Idempotency-Key repeated with the same bulk request answers as the first, changing
    nothing more; with another body it is refused (422)."""
    m = member
    _submit(m, "i1", argv=["true"], hold=True)
    _submit(m, "i2", argv=["true"], hold=True)
    key = {"Idempotency-Key": "bulk-key-1"}
    first = m.request("POST", "/jobs/cancel", {"ids": ["i1", "i2"]}, headers=key)
    again = m.request("POST", "/jobs/cancel", {"ids": ["i1", "i2"]}, headers=key)
    assert first[0] == again[0] == 200
    assert first[1]["results"] == again[1]["results"]
    assert [x["answer"] for x in again[1]["results"]] == ["changed", "changed"]
    other = m.request("POST", "/jobs/cancel", {"ids": ["i1"]}, headers=key)
    assert other[0] == 422


@pytest.mark.fleet
@pytest.mark.parametrize("path,body,status", [
    ("/jobs/cancel", {"ids": [f"j{k}" for k in range(limits.bulk_jobs_max + 1)]}, 400),
    ("/jobs/cancel", {"ids": ["a"], "filter": {"tag": "t"}}, 400),
    ("/jobs/forget", {"filter": {"owner": "me"}}, 400),
    ("/jobs/forget", {"ids": [1, 2]}, 400),
    ("/jobs/forget", {"ids": None, "filter": None}, 400),
    ("/jobs/tone", {"ids": ["a"], "set": {"priority": "high"}}, 400),
    ("/jobs/status", {"filter": {"state": ["done"]}}, 400),
    ("/jobs/status", ["a", "b"], 400),
    ("/jobs/cancel", {"ids": ["x" * 128] * 3000}, 413),
])
def test_hostile_bulk_bodies_over_http(member, path, body, status):
    """Huge id lists, wrong types, unknown filter keys, both ids and filter: refused with a
    message, and nothing changes."""
    got, answer = member.request("POST", path, body)
    assert got == status, answer
    assert "error" in answer


@pytest.mark.fleet
def test_bulk_body_that_is_not_json(member):
    status, _, data = member.raw_request("POST", "/jobs/cancel", b"{nope",
                                         {"Content-Type": "application/json"})
    assert status == 400 and b"JSON" in data


@pytest.mark.fleet
def test_bulk_filter_pages_with_a_cursor(member):
    """A filter that matches more than bulk_jobs_max jobs: the answer names the first
    bulk_jobs_max and a cursor (`next`); meshctl follows it to the end."""
    m = member
    n = limits.bulk_jobs_max + 2
    for k in range(n):
        _submit(m, f"p{k}", argv=["true"], tags=["pages"], hold=True)
    status, body = m.request("POST", "/jobs/status", {"filter": {"tag": "pages"}})
    assert status == 200 and body["matched"] == limits.bulk_jobs_max and body["next"]
    status, rest = m.request("POST", "/jobs/status", {"filter": {"tag": "pages"},
                                                      "after": body["next"]})
    assert [x["id"] for x in rest["results"]] == [f"p{k}" for k in range(n - 2, n)]
    r = m.ctl("--json", "job", "cancel", "--tag", "pages")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["counts"] == {"changed": n}


@pytest.mark.fleet
def test_bulk_cancel_through_a_follower_is_one_entry(tmp_path):
    """A follower forwards a bulk cancel to the leader, which resolves the filter and commits
    one entry; every member's table shows every job cancelled."""
    members = make_fleet(str(tmp_path), voters=3, slots=1)
    try:
        start_all(members)

        def leader() -> Meshd | None:
            for m in members:
                status, h = m.request("GET", "/healthz")
                if status == 200 and h.get("is_leader") and h.get("ready"):
                    return m
            return None

        lead = wait_until(leader, what="a ready leader")
        follower = next(m for m in members if m is not lead)
        for k in range(4):
            _submit(lead, f"f{k}", argv=["true"], tags=["fw"], hold=True)
        r = follower.ctl("--json", "job", "cancel", "--tag", "fw")
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["counts"] == {"changed": 4}
        for m in members:
            wait_until(lambda m=m: all(_state(m, f"f{k}") == "cancelled" for k in range(4)),
                       what=f"the cancels on {m.name}")
        bulk_entries = [v for k, v in lead.metrics().items() if "bulk_changes" in k]
        assert bulk_entries == [1.0]  # one entry cancelled the four jobs
    finally:
        for m in members:
            m.stop()


@pytest.mark.parametrize("method,route,need", [
    ("POST", "/jobs/status", "read"),
    ("POST", "/jobs/cancel", "submit"),
    ("POST", "/jobs/tone", "submit"),
    ("POST", "/jobs/forget", "admin"),
    ("GET", "/history", "read"),
])
def test_roles_of_the_bulk_routes(method, route, need):
    """Rule 2 of auth.py: bulk status and history read; bulk cancel and tone need submit;
    bulk forget needs admin, as a single forget does."""
    from meshjobs.auth import needed_role
    assert needed_role(method, route) == need
