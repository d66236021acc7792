"""An item keeps why its earlier attempts ended (issue 27 point 4): a lease lost with its
member, a failure tried again, a run ended before the job ran again; in the committed table,
bounded, in every snapshot, and readable from a snapshot made before it existed."""

from __future__ import annotations

import msgpack

from meshjobs import limits
from meshjobs.table import FAILED, TIMEOUT, JobTable
from tests.helpers import T0, Fleet1, Log, row, spec


def earlier(log: Log, job_id: str = "j1", i: int = 0) -> list[tuple[int, str | None, str]]:
    rec = log.table.item_record(log.job(job_id), i)
    return [(t["attempt"], t["member"], t["why"]) for t in rec["earlier_attempts"]]


def roundtrip(table: JobTable) -> JobTable:
    raw = msgpack.packb(table.to_state(), use_bin_type=True)
    return JobTable.from_state(msgpack.unpackb(raw, raw=False, strict_map_key=False))


def test_a_revoked_lease_keeps_the_leaders_words_and_member() -> None:
    log = Log()
    log.submit()
    _, ep = log.lease(("j1", 0), member="v1")
    log.apply({"k": "revoke", "t": T0 + 3100, "l": [["j1", 0, ep]],
               "w": ["lost with member v1 (dead 3.1 s)"]})
    _, ep2 = log.lease(("j1", 0), member="v2")
    log.result(row("j1", 0, ep2))
    assert earlier(log) == [(1, "v1", "lost with member v1 (dead 3.1 s)")]
    rec = log.table.item_record(log.job(), 0)
    assert rec["attempts"] == 2 and rec["member"] == "v2" and rec["state"] == "done"
    assert rec["earlier_attempts"][0]["at"] == (T0 + 3100) / 1000.0
    assert log.table.record(log.job())["items_tried_before"] == 1
    log.table.check()


def test_an_older_revoke_without_words_still_says_the_member() -> None:
    """A revoke entry of an older leader (no "w"), as an old journal replays it."""
    log = Log()
    log.submit()
    _, ep = log.lease(("j1", 0), member="v1")
    log.revoke(("j1", 0, ep))
    assert earlier(log) == [(1, "v1", "lease revoked: member v1 lost")]


def test_failures_tried_again_say_how_they_ended() -> None:
    log = Log()
    log.submit(retries=3, runtime_s=1.0)
    words = []
    for k, (state, rc, err) in enumerate([(FAILED, 3, None), (TIMEOUT, None, None),
                                          (FAILED, None, "no such program 'x'")]):
        _, ep = log.lease(("j1", 0), t=T0 + 3_600_000 * k)
        r = row("j1", 0, ep, state, rc=rc)
        log.result(r + [err] if err else r, t=T0 + 3_600_000 * k)
        words.append(earlier(log)[-1][2])
    assert words == ["exit 3; tried again (retry 1 of 3)",
                     "timeout: killed after its runtime limit of 1 s; tried again (retry 2 of 3)",
                     "no such program 'x'; tried again (retry 3 of 3)"]
    assert [a for a, _m, _w in earlier(log)] == [1, 2, 3]


def test_a_rerun_says_how_the_last_run_ended() -> None:
    log = Log()
    log.submit()
    _, ep = log.lease(("j1", 0))
    log.result(row("j1", 0, ep, FAILED, rc=1))
    log.op("rerun")
    assert earlier(log) == [(1, "m1", "ended failed in run 1; the job ran again (rerun)")]
    log.table.check()


def test_only_the_last_are_kept_in_order() -> None:
    log = Log()
    log.submit()
    n = limits.item_attempts_kept_max + 3
    for k in range(n):
        _, ep = log.lease(("j1", 0), member=f"v{k}")
        log.apply({"k": "revoke", "t": T0, "l": [["j1", 0, ep]], "w": [f"lost {k}"]})
    kept = earlier(log)
    assert [a for a, _m, _w in kept] == list(range(n - limits.item_attempts_kept_max + 1, n + 1))
    assert kept[-1] == (n, f"v{n - 1}", f"lost {n - 1}")
    log.table.check()


def test_snapshots_keep_them_and_old_snapshots_load() -> None:
    log = Log()
    log.submit()
    _, ep = log.lease(("j1", 0), member="v1")
    log.apply({"k": "revoke", "t": T0, "l": [["j1", 0, ep]], "w": ["lost with member v1"]})
    back = roundtrip(log.table)
    assert back.item_record(back.jobs["j1"], 0)["earlier_attempts"] == \
        log.table.item_record(log.job(), 0)["earlier_attempts"]
    old = log.table.to_state()
    del old["tries"]  # as a member of an earlier version wrote it
    t = JobTable.from_state(msgpack.unpackb(msgpack.packb(old, use_bin_type=True), raw=False,
                                            strict_map_key=False))
    assert t.item_record(t.jobs["j1"], 0)["earlier_attempts"] == []
    assert "tries" not in Log().table.to_state()  # a table without them writes none



def test_the_job_page_lists_earlier_attempts_escaped() -> None:
    from meshjobs import webui

    log = Log()
    log.submit()
    _, ep = log.lease(("j1", 0), member="v1")
    log.apply({"k": "revoke", "t": T0, "l": [["j1", 0, ep]], "w": ["lost <b>with</b> v1"]})
    rec = log.table.record(log.job(), items=True)
    html = webui.job_page("m1", rec, [], 0)
    assert "Earlier attempts" in html and "lost &lt;b&gt;with&lt;/b&gt; v1" in html
    assert "<b>with</b>" not in html


def _node_with_lease(member: str, boot: str) -> tuple[Fleet1, int]:
    f = Fleet1(slots=0)  # it leases nothing itself: only the lease committed below exists
    f.commit({"k": "submit", "t": f.now, "id": "j1", "spec": spec(), "dg": b"x",
              "items": [None]})
    epoch = f.commit({"k": "lease", "t": f.now, "g": [["j1", 0, member, boot]]})
    return f, epoch


def test_the_leader_names_a_silent_member_and_how_long() -> None:
    """A lease of a member never heard from is revoked after dead_ms, the leader's entry saying
    why; the item keeps it."""
    f, epoch = _node_with_lease("v9", "b9")
    f.take()
    assert not f.pending_of("revoke")
    f.tick(limits.member_dead_ms + 100)
    f.take()
    [rev] = f.pending_of("revoke")
    assert rev["l"] == [["j1", 0, epoch]] and len(rev["w"]) == 1
    assert rev["w"][0].startswith("lost with member v9 (not heard from in ")
    f.commit_pending()
    [kept] = f.table.item_record(f.table.jobs["j1"], 0)["earlier_attempts"]
    assert kept["member"] == "v9" and kept["why"] == rev["w"][0]


def test_the_leader_says_a_member_restarted() -> None:
    """A lease of an earlier incarnation of the leader itself: it restarted."""
    f, _epoch = _node_with_lease("m1", "b0")
    f.take()
    [rev] = f.pending_of("revoke")
    assert rev["w"] == ["lost with member m1 (it restarted)"]
