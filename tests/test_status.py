"""What a person sees of a job, end to end: real meshd, real meshctl, real items.

`job status` explains each failed, timed-out or unstartable item (argv, pool, rc or signal,
timeout, spawn error, attempts, member, the last lines of stderr), in text, JSON and on the
job's HTML page; `job results` exits 1 for a failed job and 5 for one not finished, and names
the items that failed or have no output; `jobs` pages newest first; `job forget` says so.
"""

from __future__ import annotations

import base64
import json
import urllib.parse

import pytest

from tests.helpers import wait_until

pytestmark = pytest.mark.fleet

FAILING = "echo starting; echo oops >&2; exit 3"



def _page(m, path: str) -> tuple[int, dict, str]:
    status, headers, body = m.raw_request("GET", path, headers={
        "Host": f"127.0.0.1:{urllib.parse.urlsplit(m.url).port}",
        "Accept": "text/html,application/xhtml+xml,*/*;q=0.8"})
    return status, headers, body.decode()


def test_failing_item_explained(meshd):
    """Rule: status shows argv, pool and a failed item's rc, attempts, member and stderr tail;
    results of a failed job exit 1 and name the failed item; the job page shows the same."""
    job = meshd.submit("--retries", "1", "--", "sh", "-c", FAILING)
    meshd.wait_job(job)
    r = meshd.ctl("job", "status", job)
    assert r.returncode == 0, r.stderr
    text = r.stdout.decode()
    assert f"argv       sh -c '{FAILING}'" in text
    assert "pool       default" in text and "state      failed" in text
    assert "item 0: exit 3; attempts 2, member m1" in text
    assert "  stderr (last lines):\n    oops\n" in text
    r = meshd.ctl("--json", "job", "status", job)
    rec = json.loads(r.stdout)
    assert rec["items"][0]["rc"] == 3  # the record's fields stay
    (f,) = rec["failed_items"]
    assert (f["index"], f["rc"], f["attempts"], f["member"], f["stderr_tail"]) == (
        0, 3, 2, "m1", ["oops"])
    r = meshd.ctl("job", "results", job)
    assert r.returncode == 1 and r.stdout == b"starting\n"
    assert b"job " + job.encode() + b" failed; item(s) 0 failed" in r.stderr
    status, headers, page = _page(meshd, f"/jobs/{job}")
    assert status == 200 and headers["Content-Type"].startswith("text/html")
    assert "script-src 'nonce-" in headers["Content-Security-Policy"]
    assert "exit 3" in page and "<pre>oops</pre>" in page and "m1" in page
    assert "sh -c &#x27;echo starting; echo oops &gt;&amp;2; exit 3&#x27;" in page
    assert 'class="cancel"' not in page  # finished: nothing to cancel
    # JSON clients still get the record.
    status, body = meshd.request("GET", f"/jobs/{job}")
    assert status == 200 and body["id"] == job


def test_timed_out_item_says_timeout(meshd):
    """Rule: an item killed by its runtime limit is `timeout` (README), and status says why."""
    job = meshd.submit("--runtime", "1", "--", "sleep", "30")
    rec = meshd.wait_job(job)
    assert rec["items"][0]["state"] == "timeout" and rec["state"] == "failed"
    text = meshd.ctl("job", "status", job).stdout.decode()
    assert "1 failed (1 timed out)" in text
    assert "item 0: timeout: killed after its runtime limit of 1 s; attempts 1, member m1" in text
    _, _, page = _page(meshd, f"/jobs/{job}")
    assert "timeout: killed after its runtime limit of 1 s" in page


def test_command_that_cannot_start(meshd):
    """Rule: a program that does not exist ends failed, and status explains it with the
    item's spawn error when the table records one, else its state and exit code."""
    job = meshd.submit("--", "/no/such/prog", "x")
    rec = meshd.wait_job(job)
    assert rec["state"] == "failed"
    item = rec["items"][0]
    text = meshd.ctl("job", "status", job).stdout.decode()
    assert "argv       /no/such/prog x" in text
    if item.get("error"):
        assert f"item 0: {item['error']}" in text and "/no/such/prog" in text
    else:
        assert "item 0: " in text and "attempts 1, member m1" in text
    assert meshd.ctl("job", "results", job).returncode == 1


def test_running_job_results_exit_5(meshd, tmp_path):
    """Rule: results of an unfinished job print what exists, exit 5, name the items without
    output; --out writes only finished items."""
    lines = tmp_path / "in.txt"
    lines.write_text("a\nb\nc\nd\ne\n")
    job = meshd.submit("--items-from", str(lines), "--", "sh", "-c",
                  'read x; if [ "$x" = a ]; then echo "$x"; else sleep 60; fi')
    wait_until(lambda: meshd.request("GET", f"/jobs/{job}")[1]["items_done"] == 1,
               what="item 0 done")
    r = meshd.ctl("job", "results", job)
    assert r.returncode == 5, r.stderr
    assert r.stdout == b"a\n"
    assert b"not finished" in r.stderr and b"item(s) 1, 2, 3, 4 have no output yet" in r.stderr
    out = tmp_path / "out"
    r = meshd.ctl("job", "results", job, "--out", str(out))
    assert r.returncode == 5
    assert sorted(p.name for p in out.iterdir()) == ["0.out"]
    wait_until(lambda: meshd.request("GET", f"/jobs/{job}")[1]["items_running"],
               what="an item running")
    text = meshd.ctl("job", "status", job).stdout.decode()
    assert "state      running" in text and "1 done, 0 failed" in text
    # Each running item is shown: where, since when, how to follow its output.
    shown = [line for line in text.splitlines() if ": running on " in line]
    assert shown and f"1 done, 0 failed, {len(shown)} running" in text, text
    first = shown[0].split(":")[0].split()[1]
    assert f"attempt 1; its output: meshctl job logs {job} --item {first} -f" in shown[0]
    status, _, page = _page(meshd, f"/jobs/{job}")
    assert status == 200 and 'class="cancel"' in page and 'name="meshjobs-csrf"' in page
    assert meshd.ctl("job", "cancel", job).returncode == 0
    r = meshd.ctl("job", "results", job)
    assert r.returncode == 1 and b"cancelled" in r.stderr


def test_jobs_paged_newest_first(meshd):
    """Rule: GET /jobs?limit=N&after=CURSOR pages newest first; a bad cursor is 400; meshctl
    jobs pages the same way, shows failed counts and fits the terminal's width."""
    ids = [meshd.submit("--id", f"page-{i}", "--tag", "paging", "--", "true") for i in range(5)]
    status, headers, raw = meshd.raw_request("GET", "/jobs?tag=paging&limit=2&format=json", headers={
        "Host": f"127.0.0.1:{urllib.parse.urlsplit(meshd.url).port}"})
    assert status == 200
    assert [j["id"] for j in json.loads(raw)] == [ids[4], ids[3]]
    cursor = headers["X-Meshjobs-Next"]
    assert 'rel="next"' in headers["Link"]
    status, page2 = meshd.request("GET", f"/jobs?tag=paging&limit=2&after={cursor}")
    assert [j["id"] for j in page2] == [ids[2], ids[1]]
    status, headers, raw = meshd.raw_request(
        "GET", f"/jobs?tag=paging&limit=2&after={cursor}&format=json",
        headers={"Host": f"127.0.0.1:{urllib.parse.urlsplit(meshd.url).port}"})
    status, page3 = meshd.request("GET", f"/jobs?tag=paging&limit=2&after={headers['X-Meshjobs-Next']}")
    assert [j["id"] for j in page3] == [ids[0]]
    for bad in ("abc", "-1", "1.5", "9" * 40, "%00"):
        status, body = meshd.request("GET", f"/jobs?after={bad}")
        assert status == 400 and "after" in body["error"], bad
    r = meshd.ctl("jobs", "--tag", "paging", "--limit", "2")
    assert r.returncode == 0
    rows = r.stdout.decode().splitlines()
    assert rows[0].split()[:4] == ["ID", "STATE", "DONE", "FAILED"]
    assert [row.split()[0] for row in rows[1:]] == [ids[4], ids[3]]
    hint = r.stderr.decode()
    assert "meshctl jobs --tag paging --limit 2 --after " in hint
    after = hint.split("--after ")[1].split()[0]
    r = meshd.ctl("jobs", "--tag", "paging", "--limit", "2", "--after", after)
    assert [row.split()[0] for row in r.stdout.decode().splitlines()[1:]] == [ids[2], ids[1]]
    r = meshd.ctl("jobs", "--tag", "paging", env={"COLUMNS": "40"})
    assert r.returncode == 0 and all(len(line) <= 40 for line in r.stdout.decode().splitlines())
    assert "…" in r.stdout.decode()
    assert meshd.ctl("jobs", "--limit", "0").returncode == 2
    assert meshd.ctl("jobs", "--after", "nope").returncode == 2


def test_forget_says_forgotten(meshd):
    """Rule: forget prints `ID: forgotten` (not `ID: None`); --json is what DELETE answers,
    which the OpenAPI document describes."""
    job = meshd.submit("--", "true")
    meshd.wait_job(job)
    r = meshd.ctl("job", "forget", job)
    assert r.returncode == 0 and r.stdout == f"{job}: forgotten\n".encode()
    job = meshd.submit("--", "true")
    meshd.wait_job(job)
    r = meshd.ctl("--json", "job", "forget", job)
    assert json.loads(r.stdout) == {"id": job, "forgotten": True}
    _, doc = meshd.request("GET", "/openapi.json")
    ok = doc["paths"]["/jobs/{id}"]["delete"]["responses"]["200"]
    schema = ok["content"]["application/json"]["schema"]
    assert schema == {"$ref": "#/components/schemas/Forgotten"}
    assert set(doc["components"]["schemas"]["Forgotten"]["required"]) == {"id", "forgotten"}


def test_sep_json_lines_and_names(meshd, tmp_path):
    """Rule: --sep puts STR between items' outputs, --json-lines gives one object per item
    (text or b64), and --out names files after --items-from DIR's input files."""
    d = tmp_path / "in"
    d.mkdir()
    (d / "b.txt").write_bytes(b"B")
    (d / "a.txt").write_bytes(b"A")
    (d / "c.bin").write_bytes(b"\xff\x00")
    job = meshd.submit("--items-from", str(d), "--", "cat")
    rec = meshd.wait_job(job)
    assert rec["names"] == ["a.txt", "b.txt", "c.bin"]
    r = meshd.ctl("job", "results", job, "--sep", "\\n--\\n")
    assert r.returncode == 0 and r.stdout == b"A\n--\nB\n--\n\xff\x00"
    r = meshd.ctl("job", "results", job, "--json-lines")
    assert r.returncode == 0
    lines = [json.loads(x) for x in r.stdout.decode().splitlines()]
    assert [(x["index"], x["state"], x["rc"]) for x in lines] == [(0, "done", 0), (1, "done", 0),
                                                                 (2, "done", 0)]
    assert lines[0]["stdout"] == "A" and lines[1]["stdout"] == "B"
    assert base64.b64decode(lines[2]["stdout_b64"]) == b"\xff\x00" and "stdout" not in lines[2]
    out = tmp_path / "out"
    assert meshd.ctl("job", "results", job, "--out", str(out)).returncode == 0
    assert sorted(p.name for p in out.iterdir()) == ["a.txt.out", "b.txt.out", "c.bin.out"]
    assert (out / "b.txt.out").read_bytes() == b"B"
    # Hostile or contradictory flags are usage errors (exit 2), and nothing is written.
    for args in (["--sep", "\\q"], ["--sep", "x" * 5000], ["--sep", ",", "--json-lines"],
                 ["--json-lines", "--out", str(tmp_path / "no")], ["--sep", "\\"]):
        r = meshd.ctl("job", "results", job, *args)
        assert r.returncode == 2, (args, r.stderr)
        assert r.stdout == b""
    assert not (tmp_path / "no").exists()


@pytest.mark.parametrize("names", [
    ["a/b"], [".."], ["."], [""], ["x\ny"], ["x" * 256], "a.txt", [1], ["a", "b"], [None], [],
])
def test_submit_names_refused(meshd, names):
    """Rule: names are file names, one per item, checked with limits before anything is
    stored; garbage is a 400 that says what is wrong."""
    status, body = meshd.request("POST", "/jobs", {"argv": ["true"], "items": ["x"],
                                                   "names": names})
    assert status == 400 and "names" in body["error"], (names, body)


def test_job_page_bad_format_and_unknown_job(meshd):
    """Rule: the job page answers a bad format with 400 and an unknown job with 404."""
    assert meshd.request("GET", "/jobs/nope?format=xml")[0] == 400
    status, _, _ = _page(meshd, "/jobs/nope")
    assert status == 404
    status, _, _ = _page(meshd, "/jobs/%3Cscript%3E")
    assert status == 400


def test_jobs_by_pool(meshd):
    """Rule: meshctl jobs --pool P lists only P's jobs; a bad pool name is refused (exit 2).
    (Two pools on one member: tests/test_webui.py.)"""
    here = meshd.submit("--tag", "by-pool", "--", "true")
    r = meshd.ctl("jobs", "--tag", "by-pool", "--pool", "default")
    assert r.returncode == 0, r.stderr
    assert [row.split()[0] for row in r.stdout.decode().splitlines()[1:]] == [here]
    r = meshd.ctl("jobs", "--tag", "by-pool", "--pool", "gpu")
    assert r.returncode == 0 and r.stdout.decode().splitlines()[1:] == [], r.stdout
    r = meshd.ctl("jobs", "--pool", "no such/pool")
    assert r.returncode == 2 and b"bad pool name" in r.stderr, r.stderr
