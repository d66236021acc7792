"""The history file (issue 12, point 9): forgotten and expired jobs appended to history.jsonl,
rotated by size, read back newest first with torn lines skipped; on real members through
`meshctl history` and GET /history. The writer is driven on real files in tmp folders."""

from __future__ import annotations

import json
import os
import threading

import pytest

from meshjobs import history, limits
from meshjobs.config import ConfigError, load_config
from tests.helpers import Meshd, member_config, wait_until


def _rec(job_id: str, **kw) -> dict:
    return {"id": job_id, "state": "done", "tags": [], "argv": ["true"], "env": {}, **kw}


def test_rotation_by_size_keeps_n_files(tmp_path):
    """[history] bytes_max: history.jsonl becomes history.1.jsonl when the next line would
    pass it, and only `keep` rotated files are kept (the oldest deleted)."""
    h = history.History(str(tmp_path), "m1", bytes_max=600, keep=2)
    for k in range(40):
        h.write(_rec(f"j{k}"), "forget", 1_000_000 + k, k + 1)
    names = sorted(os.listdir(tmp_path))
    assert names == ["history.1.jsonl", "history.2.jsonl", "history.jsonl"]
    assert all(os.path.getsize(tmp_path / n) <= 600 for n in names)
    assert h.counts["history_rotations"] >= 3
    got = history.read(str(tmp_path), None, 1000)
    ids = [r["job"]["id"] for r in got["records"]]
    assert ids[0] == "j39" and ids == sorted(ids, key=lambda i: -int(i[1:]))
    assert "j0" not in ids  # in a file past `keep`: gone


def test_keep_zero_keeps_only_the_current_file(tmp_path):
    """keep = 0: a full history.jsonl is deleted rather than rotated."""
    h = history.History(str(tmp_path), "m1", bytes_max=400, keep=0)
    for k in range(20):
        h.write(_rec(f"j{k}"), "expire", 1_000_000, k + 1)
    assert os.listdir(tmp_path) == ["history.jsonl"]


def test_torn_and_garbage_lines_are_skipped_and_counted(tmp_path):
    """A damaged or partial last line (a crash mid-write) and garbage lines are skipped and
    counted; the whole records around them are read."""
    h = history.History(str(tmp_path), "m1", bytes_max=1 << 20, keep=1)
    h.write(_rec("old"), "forget", 1_000_000, 1)
    with open(tmp_path / "history.jsonl", "ab") as f:
        f.write(b"\xff\xfe not json\n[1, 2]\n{\"at\": \"x\"}\n")
    h.write(_rec("new"), "forget", 2_000_000, 2)
    with open(tmp_path / "history.jsonl", "ab") as f:
        f.write(b'{"at": 3000.0, "why": "forget", "job": {"id": "to')  # torn
    got = history.read(str(tmp_path), None, 10)
    assert [r["job"]["id"] for r in got["records"]] == ["new", "old"]
    assert got["skipped_lines"] == 4
    # And the writer goes on after a torn line: its next record is a line of its own.
    h2 = history.History(str(tmp_path), "m1", bytes_max=1 << 20, keep=1)
    h2.write(_rec("after"), "forget", 4_000_000, 3)
    got = history.read(str(tmp_path), None, 10)
    assert got["records"][0]["job"]["id"] == "after"


def test_since_and_limit(tmp_path):
    """since keeps records at or after it; limit bounds the answer and says there is more."""
    h = history.History(str(tmp_path), "m1", bytes_max=1 << 20, keep=1)
    for k in range(10):
        h.write(_rec(f"j{k}"), "forget", (100 + k) * 1000, k + 1)
    got = history.read(str(tmp_path), 105.0, 100)
    assert [r["job"]["id"] for r in got["records"]] == [f"j{k}" for k in range(9, 4, -1)]
    got = history.read(str(tmp_path), None, 3)
    assert len(got["records"]) == 3 and got["more"] is True


def test_replayed_entries_are_not_written_twice(tmp_path):
    """A member that restarts applies its journal again: records at or before the last
    index written (the same job at the same index) are not written again."""
    h = history.History(str(tmp_path), "m1", bytes_max=1 << 20, keep=1)
    h.write(_rec("a"), "forget", 1000, 5)
    h.write(_rec("b"), "forget", 1000, 5)
    again = history.History(str(tmp_path), "m1", bytes_max=1 << 20, keep=1)
    for job_id, index in (("a", 5), ("b", 5), ("x", 4), ("c", 5), ("d", 6)):
        again.write(_rec(job_id), "forget", 1000, index)
    ids = [r["job"]["id"] for r in history.read(str(tmp_path), None, 100)["records"]]
    assert ids == ["d", "c", "b", "a"] and again.counts["history_replayed"] == 3


def test_a_huge_record_is_trimmed_and_a_full_queue_drops(tmp_path):
    """A record over history_line_bytes_max keeps its program's name only; offers past the
    bounded queue are dropped and counted, never waited for."""
    h = history.History(str(tmp_path), "m1", bytes_max=1 << 20, keep=1)
    h.write(_rec("big", argv=["prog"] + ["x" * 1000] * 200), "forget", 1000, 1)
    (row,) = history.read(str(tmp_path), None, 10)["records"]
    assert row["job"]["argv"] == ["prog"] and row["job"]["truncated"] is True
    for k in range(limits.history_queue_max + 5):
        h.offer(_rec(f"q{k}"), "forget", 1000, 10 + k)  # no writer thread: the queue fills
    assert h.counts["history_dropped"] == 5
    t = threading.Thread(target=h.run)
    t.start()
    h.stop()
    t.join(60)
    assert not t.is_alive()
    assert h.counts["history_written"] == 1 + limits.history_queue_max


@pytest.mark.parametrize("text,words", [
    ("[history]\nbytes_max = 10\n", "at least"),
    ("[history]\nbytes_max = -1\n", "non-negative"),
    ("[history]\nkeep = 1000\n", "at most"),
    ("[history]\nrotate = 1\n", "unknown key"),
])
def test_history_config_is_checked(tmp_path, text, words):
    """[history] bytes_max and keep: wrong values are refused, naming the key."""
    path = member_config(str(tmp_path), "m1", text)
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert words in str(e.value)


def test_history_config_defaults(tmp_path):
    cfg = load_config(member_config(str(tmp_path), "m1", "[history]\nbytes_max = 0\nkeep = 5\n"))
    assert cfg.history_bytes_max == 0 and cfg.history_keep == 5


# --- on a real member ---------------------------------------------------------------------------

@pytest.fixture
def member(tmp_path):
    cfg = member_config(str(tmp_path), "m1",
                        "[pools.default]\nslots = 2\n[retention]\nkeep_s = 2\n")
    m = Meshd(str(tmp_path / "m1"), config=cfg)
    try:
        m.start()
        yield m
    finally:
        m.stop()


def _history(m: Meshd, *args: str) -> dict:
    r = m.ctl("--json", "history", *args)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@pytest.mark.fleet
def test_forgotten_and_expired_jobs_appear_in_history(member):
    """A job forgotten by hand and one expired by retention ([retention] keep_s) are both in
    `meshctl history`, newest first, with their final records; a torn last line is skipped."""
    m = member
    status, forgot = m.request("POST", "/jobs", {"id": "gone-by-hand", "argv": ["true"],
                                                 "tags": ["h"]})
    assert status == 201
    m.wait_job("gone-by-hand")
    assert m.ctl("job", "forget", "gone-by-hand").returncode == 0
    # The retention of 2 s expires this one without anyone asking.
    assert m.request("POST", "/jobs", {"id": "gone-by-age", "argv": ["true"]})[0] == 201
    got = wait_until(lambda: (lambda b: b if len(b["records"]) == 2 else None)(_history(m)),
                     what="both jobs in the history")
    rows = {r["job"]["id"]: r for r in got["records"]}
    assert rows["gone-by-hand"]["why"] == "forget" and rows["gone-by-age"]["why"] == "expire"
    assert rows["gone-by-hand"]["job"]["state"] == "done"
    assert rows["gone-by-hand"]["job"]["items_summary"]["members"] == ["m1"]
    assert got["order"] == "newest_first"
    assert got["records"][0]["at"] >= got["records"][1]["at"]
    text = m.ctl("history")
    assert text.returncode == 0 and "gone-by-hand" in text.stdout.decode()
    assert "expire" in text.stdout.decode()
    # A crash mid-write leaves a torn line: it is skipped and counted, never fatal.
    with open(os.path.join(m.data, "history.jsonl"), "ab") as f:
        f.write(b'{"at": 1, "job": {"id": "tor')
    got = _history(m)
    assert got["skipped_lines"] == 1 and len(got["records"]) == 2
    assert "damaged line" in m.ctl("history").stderr.decode()
    # --since in the future: none.
    assert _history(m, "--since", "4000000000")["records"] == []
    assert _history(m, "--since", "1h", "--limit", "1")["records"][0]["job"]["id"] in rows


@pytest.mark.fleet
@pytest.mark.parametrize("query", [
    "since=abc", "since=-1", "since=nan", "since=inf", "since=1e400", "limit=0", "limit=-5",
    "limit=1001", "limit=1.5", "limit=" + "9" * 50, "since=" + "1" * 100, "what=1",
])
def test_hostile_history_queries_are_400(member, query):
    """Hostile query values: 400 with what to send instead."""
    status, body = member.request("GET", "/history?" + query)
    assert status == 400 and body["error"]


@pytest.mark.fleet
def test_history_cli_refuses_a_bad_since(member):
    r = member.ctl("history", "--since", "yesterday-ish")
    assert r.returncode == 2 and "duration" in r.stderr.decode()


@pytest.mark.fleet
def test_a_restart_does_not_write_records_twice(member):
    """A member that restarts applies its journal again: the jobs it dropped before are not
    appended to its history a second time."""
    m = member
    for job_id in ("r1", "r2"):
        assert m.request("POST", "/jobs", {"id": job_id, "argv": ["true"], "hold": True})[0] == 201
    r = m.ctl("job", "cancel", "r1", "r2")
    assert r.returncode == 0, r.stderr
    assert m.ctl("job", "forget", "r1", "r2").returncode == 0
    wait_until(lambda: len(_history(m)["records"]) == 2, what="two records")
    m.stop()
    m.start()
    assert m.request("POST", "/jobs", {"id": "r3", "argv": ["true"], "hold": True})[0] == 201
    assert m.ctl("job", "cancel", "r3").returncode == 0
    assert m.ctl("job", "forget", "r3").returncode == 0
    got = wait_until(lambda: (lambda b: b if any(r["job"]["id"] == "r3" for r in b["records"])
                              else None)(_history(m)), what="r3 in the history")
    assert sorted(r["job"]["id"] for r in got["records"]) == ["r1", "r2", "r3"]
    # The journal was applied again at the restart, and its forgets skipped.
    assert m.metrics().get("meshjobs_history_replayed_total", 0) >= 1
