"""`meshctl watch` in its pure part (meshjobs/watchplan.py, issue 13): the config (JSON, TOML,
overrides, defaults, templates) and its checks, the file lists, filesets, the jobs[n] chain, the
format keys, the derived job ids and the state files beside each file. A snapshot and a clock go
in; submits, writes and removes come out.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshjobs import limits
from meshjobs.control import JOB_ID_RE
from meshjobs.watchplan import (
    FileFact,
    Snapshot,
    WatchError,
    apply_overrides,
    build,
    ended,
    facts,
    job_id,
    load_text,
    parse_state_name,
    plan,
    rooted,
    state_name,
)

S = 10**9  # nanoseconds in a second
NOW = 1_700_000_000 * S


def one(watch: dict, **top) -> object:
    """The single watch "w" of a config."""
    return build({"watch": {"w": watch}, **top}).watches[0]


def W(**keys) -> object:
    base = {"path": "/data", "glob": "*.in", "jobs": [{"argv": ["proc", "%(file)s"]}]}
    base.update(keys)
    return one(base)


def snap(files: dict[str, int] | list[str], states: dict[str, str | None] | None = None) -> Snapshot:
    """Files by name with their age in seconds (a list: all 1000 s old)."""
    if isinstance(files, list):
        files = dict.fromkeys(files, 1000)
    return Snapshot({n: FileFact(NOW - age * S, 10) for n, age in files.items()}, states or {})


def errors_of(raw: object) -> list[str]:
    with pytest.raises(WatchError) as e:
        build(raw)  # type: ignore[arg-type]
    return e.value.errors


def targets(p) -> list[tuple[int, str]]:
    return sorted((s.index, s.filename) for s in p.submits)


def finish(w, p, state: str = "done", snapshot: Snapshot | None = None) -> dict[str, str]:
    """The state files the edge would write once every submit of the plan ended in `state`."""
    out = dict(snapshot.states) if snapshot else {}
    for s in p.submits:
        writes, removes = ended(w, s, {"id": s.job_id, "state": state})
        for r in removes:
            out.pop(r, None)
        out.update(writes)
    return out


# --- Config ------------------------------------------------------------------------------------

MANUAL = {
    "name": "lab",
    "defaults": {"rescan": 30},
    "client": {"at": "http://127.0.0.1:7700"},
    "template": {"gz": {"glob": "*.log", "jobs": [{"args": ["gzip", "%(file)s"]}], "refresh": 5},
                 "big": {"refresh": 2, "max_index": 9}},
    "watch": {"logs": {"path": "/var/log/x", "template": ["gz", "big"], "refresh": 1}},
}


def test_manual_json_shape() -> None:
    """Config: name, defaults, client, template, watch; args is argv; watch keys override
    templates, later templates override earlier ones, defaults fill the rest."""
    c = build(MANUAL)
    assert c.name == "lab" and c.client == {"at": "http://127.0.0.1:7700"}
    (w,) = c.watches
    assert w.name == "lab-gz-big-logs" and w.key == "logs"
    assert w.refresh == 1.0 and w.rescan == 30.0 and w.max_index == 9
    assert w.globs == ("*.log",)
    assert w.jobs[0].specs[0] == {"argv": ["gzip", "%(file)s"]}


def test_manual_defaults() -> None:
    """The manual's defaults: refresh 10 s, rescan 60 s, retry and run_all on, cleanup on,
    updated, reverse and partial off, no filesets."""
    w = W()
    assert (w.refresh, w.rescan, w.retry, w.run_all, w.cleanup) == (10.0, 60.0, True, True, True)
    assert (w.updated, w.reverse, w.partial, w.match, w.count) == (False, False, False, 0, None)


def test_toml_is_the_same_config() -> None:
    """Config: the TOML form of a config builds the same watches as its JSON form."""
    toml = """
name = "lab"
[defaults]
rescan = 30
[client]
at = "http://127.0.0.1:7700"
[template.gz]
glob = "*.log"
refresh = 5
jobs = [{args = ["gzip", "%(file)s"]}]
[template.big]
refresh = 2
max_index = 9
[watch.logs]
path = "/var/log/x"
template = ["gz", "big"]
refresh = 1
"""
    assert build(load_text(toml, "x.toml")) == build(load_text(json.dumps(MANUAL), "x.json"))
    assert build(load_text(toml, "x", "toml")) == build(MANUAL)


def test_defaults_template_applies_to_every_watch() -> None:
    """Config: defaults.template=a,b (the manual's command line) applies templates to all watches."""
    raw = {"template": {"a": {"glob": "*.a", "jobs": [{"argv": ["x"]}]}, "b": {"reverse": True}},
           "watch": {"one": {"path": "/p1"}, "two": {"path": "/p2"}}}
    c = build(apply_overrides(raw, ["defaults.template=a,b"]))
    assert [w.name for w in c.watches] == ["a-b-one", "a-b-two"]
    assert all(w.reverse and w.globs == ("*.a",) for w in c.watches)


def test_overrides() -> None:
    """Config: key.subkey=value overrides; JSON values, comma lists, new sections."""
    raw = {"watch": {"w": {"path": "/d", "glob": "*", "jobs": [{"argv": ["x"]}]}}}
    out = apply_overrides(raw, ["watch.w.rescan=5", "watch.w.glob=*.a,*.b", "cleanup=0",
                                "watch.w.updated=true", "client.at=http://h:1",
                                "watch.w.note=hello world"])
    w = build(out).watches[0]
    assert w.rescan == 5 and w.globs == ("*.a", "*.b") and w.updated and not w.cleanup
    assert w.values["note"] == "hello world"
    assert build(out).client == {"at": "http://h:1"}
    assert raw["watch"]["w"]["glob"] == "*"  # the input is not changed


@pytest.mark.parametrize("arg", ["novalue", "=x", "a..b=1", ".a=1", "watch.w.path.x=1",
                                 "a.b.c.d.e.f.g.h.i=1"])
def test_bad_overrides(arg: str) -> None:
    """Config: a malformed override is refused with how to write one."""
    raw = {"watch": {"w": {"path": "/d", "glob": "*", "jobs": [{"argv": ["x"]}]}}}
    with pytest.raises(WatchError) as e:
        apply_overrides(raw, [arg])
    assert "override" in str(e.value)


def test_too_many_overrides() -> None:
    with pytest.raises(WatchError):
        apply_overrides({}, ["a=1"] * (limits.watch_overrides_max + 1))


def test_every_error_at_once() -> None:
    """Validation reports every problem of the config in one go, each with its place."""
    errs = errors_of({
        "bogus": 1,
        "client": {"port": 1},
        "watch": {
            "a": {"path": "", "glob": "x/*.in", "jobs": [{"argv": ["p"], "id": "fixed"}],
                  "refresh": -1, "min_age": 10, "max_age": 5, "match": 2},
            "b": {"path": "/d", "glob": "*", "jobs": [{"argv": ["p", "%(nope)s"]}],
                  "retry": "maybe", "template": "missing"},
            "c": {"path": "/d", "glob": "*", "jobs": [{"argv": ["p", "100%"]}],
                  "plugin": "my.Plugin"},
        },
    })
    text = "\n".join(errs)
    for needle in ("bogus", "client.port", "watch.a.path", "watch.a.glob", "watch.a.jobs[0].id",
                   "watch.a.refresh", "min_age must be less than max_age", "watch.a.match",
                   "watch.b.template", "watch.b.retry", "%(nope)s", "watch.c.plugin",
                   "watch.c.jobs[0]"):
        assert needle in text, needle
    assert len(errs) >= 10


@pytest.mark.parametrize("watch,needle", [
    ({"path": "/d", "glob": "*", "jobs": [{"argv": ["p", "%(nope)s"]}]}, "%(nope)s"),
    ({"path": "/d", "glob": "*", "jobs": [{"argv": ["p", "50%"]}]}, "%%"),
    ({"path": "/d", "glob": "*", "jobs": [{"argv": ["p", "%s"]}]}, "%%"),
    ({"path": "/d", "glob": "*", "jobs": [{"argv": ["p", "%(file)d"]}]}, "%%"),
    ({"path": "/d", "glob": "*", "jobs": [{"argv": ["p"], "args": ["q"]}]}, "not both"),
    ({"path": "/d", "glob": "*", "jobs": [{"argv": ["p"], "bogus": 1}]}, "unknown key"),
    ({"path": "/d", "glob": "*", "jobs": [{"argv": []}]}, "argv"),
    ({"path": "/d", "glob": "*", "jobs": [{"pool": "p"}]}, "argv"),
    ({"path": "/d", "glob": "*", "jobs": [{"argv": ["p"], "retries": 10**9}]}, "retries"),
    ({"path": "/d", "glob": "*", "jobs": [{"argv": ["p"], "cwd": "rel"}]}, "absolute"),
    ({"path": "/d", "glob": "*", "jobs": "echo"}, "jobs"),
    ({"path": "/d", "glob": "*", "jobs": []}, "jobs"),
    ({"path": "/d", "glob": "*", "jobs": [[]]}, "jobs[0]"),
    ({"path": "/d", "glob": "*", "jobs": [7]}, "jobs[0]"),
    ({"path": "/d", "glob": "*", "jobs": [{"argv": ["p"]}] * (limits.watch_jobs_max + 1)}, "at most"),
    ({"path": "/d", "glob": ["*"] * (limits.watch_globs_max + 1), "jobs": [{"argv": ["p"]}]}, "glob"),
    ({"path": "/d", "glob": 5, "jobs": [{"argv": ["p"]}]}, "glob"),
    ({"path": "/d", "glob": [""], "jobs": [{"argv": ["p"]}]}, "glob"),
    ({"path": 5, "glob": "*", "jobs": [{"argv": ["p"]}]}, "path"),
    ({"path": "/d\0", "glob": "*", "jobs": [{"argv": ["p"]}]}, "path"),
    ({"path": "/d", "glob": "*", "jobs": [{"argv": ["p"]}], "refresh": float("nan")}, "refresh"),
    ({"path": "/d", "glob": "*", "jobs": [{"argv": ["p"]}], "rescan": 0}, "rescan"),
    ({"path": "/d", "glob": "*", "jobs": [{"argv": ["p"]}], "rescan": 10**12}, "rescan"),
    ({"path": "/d", "glob": "*", "jobs": [{"argv": ["p"]}], "min_age": -1}, "min_age"),
    ({"path": "/d", "glob": "*", "jobs": [{"argv": ["p"]}], "max_index": True}, "max_index"),
    ({"path": "/d", "glob": "*", "jobs": [{"argv": ["p"]}], "count": 0}, "count"),
    ({"path": "/d", "glob": "*", "jobs": [{"argv": ["p"]}], "match": 1}, "needs split"),
    ({"path": "/d", "glob": "*", "jobs": [{"argv": ["p"]}], "split": ""}, "split"),
    ({"path": "/d", "glob": "*", "jobs": [{"argv": ["p"]}], "split": "x" * 9}, "split"),
    ({"path": "/d", "glob": "*", "jobs": [{"argv": ["p"]}], "skip": "a/b"}, "skip"),
    ({"path": "/d", "glob": "*", "jobs": [{"argv": ["p"]}], "reverse": 2}, "reverse"),
    ({"path": "/d", "glob": "*", "jobs": [{"argv": ["p"]}], "extra": {"x": 1}}, "unknown key"),
    ({"path": "/d", "glob": "*", "jobs": [{"argv": ["p"]}], "template": 3}, "template"),
    ("not an object", "must be an object"),
])
def test_hostile_watch(watch: object, needle: str) -> None:
    """Validation: each malformed watch is refused, saying where and what to do."""
    text = "\n".join(errors_of({"watch": {"w": watch}}))
    assert needle in text and "watch.w" in text


@pytest.mark.parametrize("raw,needle", [
    ([], "object"),
    ({}, "no watch defined"),
    ({"watch": []}, "watch: must be an object"),
    ({"watch": {"a_b": {}}}, "'_' separates"),
    ({"watch": {"a b": {}}}, "letters"),
    ({"name": "x_y", "watch": {"w": {}}}, "name"),
    ({"name": 5, "watch": {"w": {}}}, "name"),
    ({"defaults": 3, "watch": {}}, "defaults"),
    ({"client": {"at": 5}, "watch": {}}, "client.at"),
    ({"template": {"t": {"template": "u"}}, "watch": {}}, "do not apply templates"),
    ({"template": {"t": 1}, "watch": {}}, "template.t"),
    ({"watch": {f"w{i}": {} for i in range(limits.watches_max + 1)}}, "at most"),
    ({"name": "n" * 64, "template": {"t" * 64: {}, "u" * 64: {}},
      "watch": {"w" * 64: {"template": ["t" * 64, "u" * 64], "path": "/d", "glob": "*",
                            "jobs": [{"argv": ["x"]}]}}}, "longer than"),
])
def test_hostile_config(raw: object, needle: str) -> None:
    """Validation: hostile top-level shapes are refused with a message, never a traceback."""
    assert needle in "\n".join(errors_of(raw))


def test_same_name_and_path_refused() -> None:
    """Two watches whose state files would mix (same full name and path) are refused."""
    raw = {"template": {"a": {}}, "watch": {
        "x": {"path": "/d", "glob": "*", "jobs": [{"argv": ["p"]}]},
        "y": {"path": "/d", "glob": "*", "jobs": [{"argv": ["p"]}]}}}
    build(raw)  # different names: fine
    raw2 = {"name": "r", "template": {"a": {}}, "watch": {
        "a-x": {"path": "/d", "glob": "*", "jobs": [{"argv": ["p"]}]},
        "x": {"template": "a", "path": "/d", "glob": "*", "jobs": [{"argv": ["p"]}]}}}
    assert "mix" in "\n".join(errors_of(raw2))


@pytest.mark.parametrize("text,fmt", [
    ("{not json", "auto"),
    ("[1, 2]", "json"),
    ("= = =", "toml"),
    ("[" * 100_000 + "]" * 100_000, "json"),
    ("x" * (limits.watch_config_bytes_max + 1), "auto"),
])
def test_hostile_text(text: str, fmt: str) -> None:
    """A config file that is not JSON/TOML, too deep or too large is one clear error."""
    with pytest.raises(WatchError) as e:
        load_text(text, "c.cfg", fmt)
    assert "c.cfg" in str(e.value)


# --- File lists ---------------------------------------------------------------------------------

def test_newest_first_and_reverse() -> None:
    """glob lists sort Z->A (datestamps newest first); reverse sorts A->Z; hidden files and other
    names are not in the list."""
    files = ["20200101.in", "20200103.in", "20200102.in", ".x.in", "._w_0_a.in.done", "a.out"]
    w = W(jobs=[{"argv": ["p", "%(filename)s"]}, {}], run_all=False)
    assert targets(plan(w, snap(files), NOW)) == [(0, "20200103.in")]
    w = W(jobs=[{"argv": ["p", "%(filename)s"]}, {}], run_all=False, reverse=True)
    assert targets(plan(w, snap(files), NOW)) == [(0, "20200101.in")]
    w = W(glob=".*.in")
    assert targets(plan(w, snap(files), NOW)) == [(0, ".x.in")]


def test_one_job_runs_on_every_file() -> None:
    """With one job defined, it runs on all files."""
    p = plan(W(), snap(["a.in", "b.in", "c.in"]), NOW)
    assert targets(p) == [(0, "a.in"), (0, "b.in"), (0, "c.in")]
    assert {s.body["argv"][1] for s in p.submits} == {"/data/a.in", "/data/b.in", "/data/c.in"}


def test_min_and_max_age() -> None:
    """min_age: a file younger is not considered yet; max_age: an older one no longer is."""
    files = {"young.in": 5, "mid.in": 50, "old.in": 500}
    assert targets(plan(W(min_age=10), snap(files), NOW)) == [(0, "mid.in"), (0, "old.in")]
    assert targets(plan(W(max_age=100), snap(files), NOW)) == [(0, "mid.in"), (0, "young.in")]
    assert targets(plan(W(min_age=10, max_age=100), snap(files), NOW)) == [(0, "mid.in")]
    # The clock is an input: the same folder later has the young file old enough.
    assert targets(plan(W(min_age=10), snap(files), NOW + 10 * S))[-1] == (0, "young.in")



def test_files_too_young_are_deferred_until_they_come_of_age() -> None:
    """A matching file younger than min_age counts as deferred, and the plan says when the
    first one comes of age; none is too young once that time has come."""
    files = {"young.in": 5, "younger.in": 2, "mid.in": 50, "other.txt": 1}
    p = plan(W(min_age=10), snap(files), NOW)
    assert p.counts["deferred"] == 2 and p.counts["files"] == 1
    assert p.due_ns == NOW + 5 * S  # young.in, 5 s old, is 10 s old 5 s from now
    later = plan(W(min_age=10), snap(files), NOW + 8 * S)
    assert later.counts["deferred"] == 0 and later.due_ns is None
    assert plan(W(), snap(files), NOW).due_ns is None


def test_chain_moves_files_down() -> None:
    """jobs[n] runs on file[n]: a new file[0] gets jobs[0], the old file[0] is now file[1] and gets
    jobs[1]; when it is file[2] and no jobs[2] exists, nothing more happens to it."""
    w = W(jobs=[{"argv": ["first", "%(file)s"]}, {"argv": ["second", "%(file)s"]}])
    s1 = snap(["1.in"])
    p1 = plan(w, s1, NOW)
    assert targets(p1) == [(0, "1.in")]
    s2 = snap(["1.in", "2.in"], finish(w, p1))
    p2 = plan(w, s2, NOW)
    assert targets(p2) == [(0, "2.in"), (1, "1.in")]
    assert {s.body["argv"][0] for s in p2.submits} == {"first", "second"}
    s3 = snap(["1.in", "2.in", "3.in"], finish(w, p2, snapshot=s2))
    p3 = plan(w, s3, NOW)
    assert targets(p3) == [(0, "3.in"), (1, "2.in")]  # 1.in is file[2]: its jobs[1] has run
    s4 = snap(["1.in", "2.in", "3.in"], finish(w, p3, snapshot=s3))
    assert plan(w, s4, NOW).submits == [] and plan(w, s4, NOW).counts["processed"] == 3


def test_run_all_sequential_and_off() -> None:
    """run_all (default): a file first seen at file[1] gets jobs[0], then (once done) jobs[1];
    run_all false: only jobs[1]."""
    w = W(jobs=[{"argv": ["a"]}, {"argv": ["b"]}])
    s = snap(["x.in", "y.in"])
    p = plan(w, s, NOW)
    assert targets(p) == [(0, "x.in"), (0, "y.in")]
    # While x's jobs[0] runs, its jobs[1] waits.
    running = frozenset(x.job_id for x in p.submits)
    assert plan(w, s, NOW, running).submits == []
    s2 = snap(["x.in", "y.in"], finish(w, p))
    assert targets(plan(w, s2, NOW)) == [(1, "x.in")]
    w_off = W(jobs=[{"argv": ["a"]}, {"argv": ["b"]}], run_all=False)
    assert targets(plan(w_off, s, NOW)) == [(0, "y.in"), (1, "x.in")]


def test_empty_spec_does_nothing() -> None:
    """An empty (or null) jobspec does nothing: files at that index are passed over."""
    w = W(jobs=[{}, {"argv": ["b", "%(file)s"]}])
    assert targets(plan(w, snap(["x.in", "y.in"]), NOW)) == [(1, "x.in")]
    w = W(jobs=[None, {}])
    p = plan(w, snap(["x.in", "y.in"]), NOW)
    assert p.submits == [] and p.counts["processed"] == 2


def test_max_index() -> None:
    """max_index: no jobs for files further down the list than it."""
    p = plan(W(max_index=1), snap(["a.in", "b.in", "c.in", "d.in"]), NOW)
    assert targets(p) == [(0, "c.in"), (0, "d.in")]


def test_filesets_complete_partial() -> None:
    """split + match: a fileset is complete when every list has the first list's key; files wait
    until then unless partial."""
    raw = dict(glob=["*.foo", "*.bar", "*.baz"], split=".", match=2,
               jobs=[{"argv": ["p", "%(fileset)s", "%(fileset1)s", "%(0)s", "%(1)s"]}])
    files = ["20200101.00.foo", "20200101.00.bar", "20200101.00.baz",
             "20200101.01.foo", "20200101.01.bar", "20200101.02.baz"]
    p = plan(W(**raw), snap(files), NOW)
    assert targets(p) == [(0, "20200101.00.foo")]
    assert p.submits[0].body["argv"] == [
        "p", "20200101.00.foo 20200101.00.bar 20200101.00.baz", "20200101.00.bar", "20200101", "00"]
    assert p.counts["incomplete"] == 1
    p = plan(W(partial=True, **raw), snap(files), NOW)
    assert targets(p) == [(0, "20200101.00.foo"), (0, "20200101.01.foo")]
    part = next(s for s in p.submits if s.filename == "20200101.01.foo")
    assert part.body["argv"][1] == "20200101.01.foo 20200101.01.bar"


def test_fileset_per_list_specs() -> None:
    """jobs[n] as a list: jobs[n][k] runs on list k's file of set n, jobs[n][-1] on the rest."""
    w = W(glob=["*.a", "*.b", "*.c"], split=".", match=1,
          jobs=[[{"argv": ["A", "%(filename)s"]}, {"argv": ["rest", "%(filename)s"]}]])
    p = plan(w, snap(["k.a", "k.b", "k.c"]), NOW)
    got = sorted((s.list, s.body["argv"][0], s.filename) for s in p.submits)
    assert got == [(0, "A", "k.a"), (1, "rest", "k.b"), (2, "rest", "k.c")]
    assert len({s.job_id for s in p.submits}) == 3


def test_several_lists_without_filesets() -> None:
    """Several globs, no match: each list has its own positions; jobs[n][k] serves list k."""
    w = W(glob=["*.a", "*.b"], jobs=[[{"argv": ["A"]}, {"argv": ["B"]}], [None, {"argv": ["B1"]}]])
    p = plan(w, snap(["1.a", "2.a", "1.b", "2.b"]), NOW)
    got = sorted((s.list, s.index, s.filename, s.body["argv"][0]) for s in p.submits)
    assert got == [(0, 0, "1.a", "A"), (0, 0, "2.a", "A"), (1, 0, "1.b", "B"), (1, 0, "2.b", "B")]
    s2 = snap(["1.a", "2.a", "1.b", "2.b"], finish(w, p))
    got = sorted((s.list, s.index, s.filename) for s in plan(w, s2, NOW).submits)
    assert got == [(1, 1, "1.b")]  # jobs[1][0] is null: 1.a is done


def test_skip_marks_done() -> None:
    """skip: a set whose <matched parts>.<suffix> exists is skipped and marked done (for every
    index), without a job."""
    w = W(glob=["*.foo", "*.bar"], split=".", match=2, skip="out",
          jobs=[{"argv": ["p"]}, {"argv": ["q"]}])
    files = ["d.00.foo", "d.00.bar", "d.00.out", "d.01.foo", "d.01.bar"]
    p = plan(w, snap(files), NOW)
    assert targets(p) == [(0, "d.01.foo")]
    assert sorted(n for n, _ in p.writes) == [state_name("w", 0, "d.00.foo", "done"),
                                              state_name("w", 1, "d.00.foo", "done")]
    assert json.loads(p.writes[0][1])["skipped"] == "d.00.out"
    # With the marks written, the skipped set stays done even if the .out file goes.
    s2 = snap([f for f in files if f != "d.00.out"], dict(p.writes))
    assert all(s.filename != "d.00.foo" for s in plan(w, s2, NOW).submits)
    # Without filesets the skip file is <filename>.<suffix>.
    w1 = W(skip="ok")
    p1 = plan(w1, snap(["a.in", "a.in.ok", "b.in"]), NOW)
    assert targets(p1) == [(0, "b.in")] and len(p1.writes) == 1


def test_updated_reruns_first_job_only() -> None:
    """updated: a file whose mtime changed gets jobs[0] again (a new job id); later jobs do not
    re-run. Without updated, a processed file stays processed."""
    jobs = [{"argv": ["a"]}, {"argv": ["b"]}]
    for updated in (True, False):
        w = W(jobs=jobs, updated=updated)
        s = snap({"x.in": 100, "y.in": 50})
        states = {}
        for _ in range(3):  # x: jobs[0], jobs[1]; y: jobs[0]
            p = plan(w, snap({"x.in": 100, "y.in": 50}, states), NOW)
            states = finish(w, p, snapshot=snap([], states))
        assert plan(w, snap({"x.in": 100, "y.in": 50}, states), NOW).submits == []
        if updated:
            assert state_name("w", 0, "x.in", "mtime") in states
        p = plan(w, snap({"x.in": 1, "y.in": 50}, states), NOW)  # x rewritten
        if updated:
            assert targets(p) == [(0, "x.in")]
            first = job_id("w", 0, 0, "x.in", NOW - 100 * S, 0)
            assert p.submits[0].job_id != first
            states = finish(w, p, snapshot=snap([], states))
            assert plan(w, snap({"x.in": 1, "y.in": 50}, states), NOW).submits == []
        else:
            assert p.submits == []
        del s


def test_retry_and_cancelled() -> None:
    """retry (default true): a failed job is submitted again under the next attempt's id;
    retry false: failed counts as processed; cancelled (killed) is never retried."""
    w = W()
    s = snap(["a.in"])
    p = plan(w, s, NOW)
    failed = finish(w, p, "failed")
    p2 = plan(w, snap(["a.in"], failed), NOW)
    assert [x.attempt for x in p2.submits] == [1] and p2.submits[0].job_id != p.submits[0].job_id
    failed2 = finish(w, p2, "failed", snap([], failed))
    assert [x.attempt for x in plan(w, snap(["a.in"], failed2), NOW).submits] == [2]
    assert plan(W(retry=False), snap(["a.in"], failed), NOW).submits == []
    assert plan(w, snap(["a.in"], finish(w, p, "cancelled")), NOW).submits == []
    dep = finish(w, p, "dep_failed")
    assert [x.attempt for x in plan(w, snap(["a.in"], dep), NOW).submits] == [1]
    # A done state wins over an older failure of the same file.
    both = {**failed, **finish(w, p2, "done")}
    assert plan(w, snap(["a.in"], both), NOW).submits == []


def test_retries_are_bounded() -> None:
    """A file failing watch_attempts_max times is left failed (a named limit, not forever)."""
    w = W()
    sub = plan(w, snap(["a.in"]), NOW).submits[0]
    last = type(sub)(sub.job_id, sub.body, 0, 0, "a.in", sub.mtime_ns,
                     limits.watch_attempts_max - 1)
    writes, _ = ended(w, last, {"state": "failed"})
    assert plan(w, snap(["a.in"], dict(writes)), NOW).submits == []


def test_damaged_state_files() -> None:
    """A damaged .done still means done; a damaged .failed is retried from attempt 1; stray and
    malformed hidden names are ignored."""
    w = W()
    states = {state_name("w", 0, "a.in", "done"): "garbage{",
              state_name("w", 0, "b.in", "failed"): None,
              state_name("w", 0, "c.in", "failed"): json.dumps({"watch": {"attempt": -5}}),
              "._w_x_c.in.done": "{}", "._w_0_.done": "{}", "._w_0_c.in.weird": "{}",
              "._w_00000_c.in": "{}"}
    p = plan(w, snap(["a.in", "b.in", "c.in"], states), NOW)
    assert sorted((s.filename, s.attempt) for s in p.submits) == [("b.in", 1), ("c.in", 1)]


def test_inflight_is_not_submitted_again() -> None:
    """A job the watcher follows already is counted as running, not submitted again."""
    w = W()
    p = plan(w, snap(["a.in", "b.in"]), NOW)
    p2 = plan(w, snap(["a.in", "b.in"]), NOW, frozenset(s.job_id for s in p.submits))
    assert p2.submits == [] and p2.counts["running"] == 2


def test_cleanup() -> None:
    """State files of a file that is gone are removed, unless cleanup=0; another watch's state
    files (even one whose name starts the same) are never touched."""
    states = {state_name("w", 0, "gone.in", "done"): "{}",
              state_name("w", 0, "gone.in", "mtime"): "5",
              state_name("w", 0, "here.in", "done"): "{}",
              state_name("w-1", 0, "gone.in", "done"): "{}",
              state_name("w.x", 0, "gone.in", "done"): "{}"}
    p = plan(W(), snap(["here.in"], states), NOW)
    assert sorted(p.removes) == sorted([state_name("w", 0, "gone.in", "done"),
                                        state_name("w", 0, "gone.in", "mtime")])
    assert plan(W(cleanup=0), snap(["here.in"], states), NOW).removes == []
    assert one({"path": "/d", "glob": "*", "jobs": [{"argv": ["p"]}]}, cleanup=0).cleanup is False


def test_format_keys() -> None:
    """Format keys: name, filename, file, fileset, fileset<n>, <n>, index, any watch key; %% is a
    percent sign; every string of the spec is filled (env, cwd, tags, pool)."""
    w = one({"path": "/in/", "glob": "*.csv", "split": "_", "outdir": "/out", "level": 3,
             "jobs": [{"args": ["conv", "%(file)s", "%(outdir)s/%(0)s.%(index)s", "%(path)s",
                                "%(name)s", "%(fileset0)s", "100%%", "%(level)s", "%(split)s"],
                       "env": {"F": "%(filename)s"}, "cwd": "%(outdir)s", "tags": ["%(1)s"],
                       "pool": "p-%(index)s"}]}, name="root")
    (s,) = plan(w, snap(["2024_jan.csv"]), NOW).submits
    assert s.body["argv"] == ["conv", "/in/2024_jan.csv", "/out/2024.0", "/in/", "root-w",
                              "2024_jan.csv", "100%", "3", "_"]
    assert s.body["env"] == {"F": "2024_jan.csv"} and s.body["cwd"] == "/out"
    assert s.body["tags"] == ["jan.csv"] and s.body["pool"] == "p-0"
    assert s.body["id"] == s.job_id


def test_format_problem_is_reported_not_raised() -> None:
    """A file whose name has fewer parts than the spec uses is a problem of the plan; the other
    files are still submitted."""
    w = W(split="-", jobs=[{"argv": ["p", "%(2)s"]}])
    p = plan(w, snap(["a-b-c.in", "short.in"]), NOW)
    assert targets(p) == [(0, "a-b-c.in")]
    assert len(p.problems) == 1 and "%(2)s" in p.problems[0]


def test_long_file_name_is_a_problem() -> None:
    """A file whose state file name would pass NAME_MAX is reported, not submitted (its state
    could never be kept, so it would run again on every scan)."""
    long = "x" * 240 + ".in"
    p = plan(W(), snap([long, "ok.in"]), NOW)
    assert targets(p) == [(0, "ok.in")] and "too long a name" in p.problems[0]


def test_inflight_bound() -> None:
    """At most watch_inflight_max jobs followed at once; the rest are deferred to a later scan."""
    files = [f"{i:06d}.in" for i in range(10)]
    busy = frozenset(f"x{i}" for i in range(limits.watch_inflight_max - 3))
    p = plan(W(), snap(files), NOW, busy)
    assert len(p.submits) == 3 and p.counts["deferred"] == 7


def test_no_globs_keeps_jobs_running() -> None:
    """A watch without globs keeps its jobs running: one job per spec, the next generation once
    the edge says the last one ended."""
    w = one({"path": "/d", "jobs": [{"argv": ["serve", "%(name)s"]}, [{"argv": ["a"]}, None]]})
    p = plan(w, snap([]), NOW)
    assert sorted((s.index, s.list) for s in p.submits) == [(0, 0), (1, 0)]
    assert p.submits[0].body["argv"] == ["serve", "w"] and p.submits[0].filename == ""
    assert plan(w, snap([]), NOW, frozenset(s.job_id for s in p.submits)).submits == []
    p2 = plan(w, snap([]), NOW, generations={(0, 0): 1})
    assert {s.job_id for s in p2.submits} & {s.job_id for s in p.submits} == {p.submits[1].job_id}
    assert ended(w, p.submits[0], {"state": "done"}) == ([], [])


# --- Ids and state files ------------------------------------------------------------------------

def test_job_id_derived() -> None:
    """The job id is a function of watch name, index, list, file name, mtime and attempt: the
    same inputs give the same id, any change a different one; always a valid id."""
    base = ("w", 0, 0, "a.in", 5, 0)
    assert job_id(*base) == job_id(*base)
    variants = [("w2", 0, 0, "a.in", 5, 0), ("w", 1, 0, "a.in", 5, 0), ("w", 0, 1, "a.in", 5, 0),
                ("w", 0, 0, "b.in", 5, 0), ("w", 0, 0, "a.in", 6, 0), ("w", 0, 0, "a.in", 5, 1),
                ("w-0", 0, 0, "a.in", 5, 0), ("w", 0, 0, "0-a.in", 5, 0)]
    ids = {job_id(*v) for v in variants} | {job_id(*base)}
    assert len(ids) == len(variants) + 1
    assert job_id("w", 0, 0, "a b.in", 5, 0) != job_id("w", 0, 0, "a_b.in", 5, 0)


@given(st.text(min_size=1, max_size=300), st.text(max_size=300), st.integers(0, 63),
       st.integers(-(2**63), 2**63), st.integers(0, 100))
@settings(max_examples=300, deadline=None)
def test_job_id_always_valid(name: str, filename: str, n: int, mtime: int, attempt: int) -> None:
    """Any name (long, unicode, undecodable) gives a valid id within job_id_chars_max."""
    jid = job_id(name, n, 0, filename, mtime, attempt)
    assert JOB_ID_RE.fullmatch(jid) and len(jid) <= limits.job_id_chars_max


def test_surrogate_file_names() -> None:
    """Names os.listdir gives for undecodable bytes (surrogates) plan and end like any other."""
    name = "caf\udce9.in"
    w = W()
    (s,) = plan(w, snap([name]), NOW).submits
    writes, _ = ended(w, s, {"state": "done"})
    assert plan(w, snap([name], dict(writes)), NOW).submits == []


def test_state_names_round_trip() -> None:
    """._<name>_<n>_<filename>.<state> as the manual keeps them, parsed back."""
    assert state_name("w", 3, "a_b.c.in", "done") == "._w_3_a_b.c.in.done"
    assert parse_state_name("w", "._w_3_a_b.c.in.done") == (3, "a_b.c.in", "done")
    assert parse_state_name("w", "._w_3_a.in.mtime") == (3, "a.in", "mtime")
    assert parse_state_name("w", "._w-1_3_a.in.done") is None
    assert parse_state_name("w", "._w_x_a.in.done") is None
    assert parse_state_name("w", "._w_٣_a.in.done") is None  # a digit of another script


def test_ended_writes_result_and_removes_others() -> None:
    """When a job ends, its record goes into the state file of its state, with the watch facts;
    the files of other end states of the same index go; updated also keeps .mtime."""
    w = W(updated=True)
    (s,) = plan(w, snap(["a.in"]), NOW).submits
    writes, removes = ended(w, s, {"id": s.job_id, "state": "done", "exit": 0})
    names = dict(writes)
    rec = json.loads(names["._w_0_a.in.done"])
    assert rec["job"]["exit"] == 0 and rec["watch"]["mtime_ns"] == s.mtime_ns
    assert names["._w_0_a.in.mtime"] == str(s.mtime_ns)
    assert "._w_0_a.in.failed" in removes and "._w_0_a.in.done" not in removes
    big = {"id": s.job_id, "state": "done", "items": ["x" * 1000] * 1000}
    assert len(dict(ended(w, s, big)[0])["._w_0_a.in.done"]) <= limits.watch_state_bytes_max
    with pytest.raises(ValueError):
        ended(w, s, {"state": "running"})


# --- The whole story, simulated -----------------------------------------------------------------

@given(st.lists(st.tuples(st.sampled_from(["add", "touch", "rm", "tick", "crash"]),
                          st.integers(0, 7), st.sampled_from(["done", "failed", "cancelled"])),
                max_size=40),
       st.booleans(), st.booleans())
@settings(max_examples=200, deadline=None)
def test_simulated_watcher_runs_each_version_once(steps, updated, run_all) -> None:
    """Files arrive, change and go while jobs end and the watcher crashes (losing what it
    follows, keeping the state files): every derived id is run at most once by the member, and
    no (index, file, version) is done twice."""
    w = W(jobs=[{"argv": ["a"]}, {"argv": ["b"]}], updated=updated, run_all=run_all)
    files: dict[str, int] = {}
    states: dict[str, str | None] = {}
    member: dict[str, str | None] = {}  # job id -> end state (None: running); meshd's table
    following: dict[str, object] = {}
    done_versions: list[tuple[int, str, int]] = []
    clock = NOW
    for op, i, outcome in steps:
        clock += S
        name = f"{i}.in"
        if op == "add" and name not in files:
            files[name] = clock
        elif op == "touch" and name in files:
            files[name] = clock
        elif op == "rm":
            files.pop(name, None)
        elif op == "crash":
            following.clear()
        s = Snapshot({n: FileFact(m, 1) for n, m in files.items()}, states)
        p = plan(w, s, clock, frozenset(following))
        for r in p.removes:
            states.pop(r, None)
        states.update(p.writes)
        for sub in p.submits:
            member.setdefault(sub.job_id, None)  # idempotent: an existing id runs nothing new
            following[sub.job_id] = sub
        if op == "tick":
            for jid, sub in list(following.items()):
                if member[jid] is None:
                    member[jid] = outcome
                    if outcome == "done":
                        done_versions.append((sub.index, sub.filename, sub.mtime_ns))
                writes, removes = ended(w, sub, {"id": jid, "state": member[jid]})
                for r in removes:
                    states.pop(r, None)
                states.update(writes)
                del following[jid]
    assert len(done_versions) == len(set(done_versions))
    # Liveness: with every job ending done from now on, the watcher settles with each present
    # file's due jobs kept (every index up to its place with run_all, its own index without).
    following.clear()
    for _ in range(3 * (len(files) + 2)):
        clock += S
        s = Snapshot({n: FileFact(m, 1) for n, m in files.items()}, states)
        p = plan(w, s, clock, frozenset(following))
        states.update(p.writes)
        for r in p.removes:
            states.pop(r, None)
        for sub in p.submits:
            member.setdefault(sub.job_id, None)
            if member[sub.job_id] is None:
                member[sub.job_id] = "done"
            writes, removes = ended(w, sub, {"id": sub.job_id, "state": member[sub.job_id]})
            for r in removes:
                states.pop(r, None)
            states.update(writes)
    final = plan(w, Snapshot({n: FileFact(m, 1) for n, m in files.items()}, states), clock)
    assert final.submits == [] and final.problems == []
    kept = facts(w, states)
    for pos, name in enumerate(sorted(files, reverse=True)):
        due = range(min(pos, 1) + 1) if run_all else [min(pos, 1)]
        for n in due:
            assert (n, name) in kept, (n, name, pos)


def test_xattr_state() -> None:
    """xattr (or the manual's plugin meeseeks.watch.WatchXattr): the state lives on the file, so
    nothing is cleaned up beside it and a long file name is no problem."""
    assert W(xattr=True).xattr and W(plugin="meeseeks.watch.WatchXattr").xattr
    assert not W().xattr
    states = {state_name("w", 0, "gone.in", "done"): "{}"}
    assert plan(W(xattr=True), snap(["a.in"], states), NOW).removes == []
    long = "x" * 250 + ".in"
    assert targets(plan(W(xattr=True), snap([long]), NOW)) == [(0, long)]


def test_rooted_path() -> None:
    """The edge's absolute folder replaces path in %(file)s and %(path)s alike."""
    w = rooted(W(path="rel", jobs=[{"argv": ["p", "%(file)s", "%(path)s"]}]), "/abs/rel")
    (s,) = plan(w, snap(["a.in"]), NOW).submits
    assert s.body["argv"] == ["p", "/abs/rel/a.in", "/abs/rel"]


def test_leftover_temporary_state_removed() -> None:
    """A state file's temporary name (a watcher killed while writing it) is removed; another
    watch's, or a stranger's, is not."""
    states = {state_name("w", 0, "a.in", "done") + ".part": "{",
              state_name("w-1", 0, "a.in", "done") + ".part": "{",
              "._w_junk.part": "x"}
    p = plan(W(cleanup=0), snap(["a.in"], states), NOW)
    assert p.removes == [state_name("w", 0, "a.in", "done") + ".part"]
    assert targets(p) == [(0, "a.in")]
