"""What a person reads of jobs (issue 27, points 7, 8, 10, 12): real meshd, real meshctl.

`meshctl jobs` has a program column cut to the terminal's width; `job results` on a terminal
marks a failed item's output, piped it gives the items' bytes, and --only-done leaves failed
items out; a python item that raised says `raised ValueError: ...` in `job status`, `job
wait`, its record and the job page; `job wait` says why items failed (timed out);
`history` has a header; `--after` a parent that already failed says the job ends dep_failed.
"""

from __future__ import annotations

import json
import os
import pty
import subprocess
import sys
import textwrap
import urllib.parse
from pathlib import Path

import pytest

from tests.helpers import Meshd, env_with_path, read_pty, wait_until

pytestmark = pytest.mark.fleet

BAD_EXITS_3 = 'c=$(cat); echo "$c"; [ "$c" != bad ] || exit 3'


def _on_terminal(m: Meshd, *args: str, columns: int | None = None) -> tuple[int, bytes, bytes]:
    """meshctl ARGS with its stdout on a pseudo-terminal (isatty true): rc, what the terminal
    showed (newlines as the program wrote them), stderr."""
    master, slave = pty.openpty()
    env = env_with_path()
    env.pop("MESHJOBS_AT", None)
    if columns is not None:
        env["COLUMNS"] = str(columns)
    try:
        p = subprocess.Popen([sys.executable, "-m", "meshjobs.cli", "--at", m.url, *args],
                             stdout=slave, stderr=subprocess.PIPE, env=env)
        os.close(slave)
        slave = -1
        shown = read_pty(master)
        err = p.stderr.read() if p.stderr else b""
        rc = p.wait(timeout=60)
    finally:
        os.close(master)
        if slave >= 0:
            os.close(slave)
    return rc, shown.replace(b"\r\n", b"\n"), err


def _page(m: Meshd, path: str) -> str:
    status, _, body = m.raw_request("GET", path, headers={
        "Host": f"127.0.0.1:{urllib.parse.urlsplit(m.url).port}",
        "Accept": "text/html,application/xhtml+xml,*/*;q=0.8"})
    assert status == 200, body[:300]
    return body.decode()


def _array(meshd: Meshd, tmp_path: Path) -> str:
    words = tmp_path / "words"
    words.mkdir()
    for name, text in (("a.txt", "alpha"), ("b.txt", "beta"), ("zz-bad.txt", "bad")):
        (words / name).write_text(text)
    job = meshd.submit("--items-from", str(words), "--", "sh", "-c", BAD_EXITS_3)
    meshd.wait_job(job)
    return job


def test_jobs_has_a_program_column(meshd):
    """Rule: `meshctl jobs` shows each job's argv, shell-quoted, in a PROGRAM column; whole when
    piped, cut (with …) to the terminal's width on one."""
    job = meshd.submit("--", "sh", "-c", "echo one two; echo " + "x" * 80)
    meshd.wait_job(job)
    text = meshd.ctl("jobs").stdout.decode()
    header, first = text.splitlines()[:2]
    assert header.split()[-1] == "PROGRAM"
    assert first.startswith(job) and first.endswith("sh -c 'echo one two; echo " + "x" * 80 + "'")
    rc, shown, _ = _on_terminal(meshd, "jobs", columns=120)
    assert rc == 0
    lines = shown.decode().splitlines()
    assert "PROGRAM" in lines[0] and all(len(line) <= 120 for line in lines)
    assert "sh -c 'echo one" in lines[1] and lines[1].endswith("…")


def test_results_mark_failed_items_on_a_terminal(meshd, tmp_path):
    """Rule: on a terminal a failed item's output follows `--- item N (NAME): failed, WHY ---`;
    piped, the bytes are the items' own; --only-done leaves failed items out (both ways)."""
    job = _array(meshd, tmp_path)
    rc, shown, err = _on_terminal(meshd, "job", "results", job)
    assert rc == 1, err
    assert shown == b"alpha\nbeta\n--- item 2 (zz-bad.txt): failed, exit 3 ---\nbad\n"
    assert b"item(s) 2 failed" in err
    r = meshd.ctl("job", "results", job)
    assert r.returncode == 1 and r.stdout == b"alpha\nbeta\nbad\n"
    r = meshd.ctl("job", "results", "--only-done", job)
    assert r.returncode == 1 and r.stdout == b"alpha\nbeta\n"
    rc, shown, _ = _on_terminal(meshd, "job", "results", "--only-done", job)
    assert rc == 1 and shown == b"alpha\nbeta\n"
    r = meshd.ctl("job", "results", "--only-done", "--sep", "|", job)
    assert r.stdout == b"alpha\n|beta\n"
    # The job page names each item's input file, as the CLI does.
    page = _page(meshd, f"/jobs/{job}")
    assert '2 <span class="name">(zz-bad.txt)</span>' in page
    assert '0 <span class="name">(a.txt)</span>' in page


def test_running_item_page_shows_output_so_far(meshd, tmp_path):
    """Rule: a running item's page shows the tail of its stdout and stderr so far (with the
    live links), not only links."""
    flag = tmp_path / "go"
    job = meshd.submit("--", "sh", "-c", 'echo first-line; echo err-line >&2; '
                       'while [ ! -e "$0" ]; do sleep 0.05; done', str(flag))
    try:
        # (The program's own text is on the page too: wait for the output's <pre>.)
        page = wait_until(lambda: (lambda p: p if '<pre class="out live">first-line\n</pre>' in p
                                   and '<pre class="out live">err-line\n</pre>' in p
                                   else None)(_page(meshd, f"/jobs/{job}")),
                          what="the output so far on the page")
        assert "stdout (live)" in page and "stdout so far" in page
    finally:
        flag.write_text("")
    assert meshd.wait_job(job)["state"] == "done"


def test_results_print_no_deprecation_warning(meshd):
    """Rule: `job results` prints no DeprecationWarning (click's get_binary_stream), even with
    warnings made errors."""
    job = meshd.submit("--", "echo", "hi")
    meshd.wait_job(job)
    r = meshd.ctl("job", "results", job, env={"PYTHONWARNINGS": "error::DeprecationWarning"})
    assert r.returncode == 0, r.stderr
    assert r.stdout == b"hi\n" and b"Warning" not in r.stderr


def test_python_item_that_raised_says_so(tmp_path):
    """Rule: a python item that raised says `raised ValueError: <message>` (the exception's
    last line) in `job status`, `job wait`, the item's error field and the job page."""
    cfg = tmp_path / "meshd.toml"
    cfg.write_text('name = "m1"\n[pools.py]\nkind = "python"\nslots = 1\n')
    funcs = tmp_path / "funcs"
    funcs.mkdir()
    (funcs / "raisers.py").write_text(textwrap.dedent('''
        def run(data):
            raise ValueError("not a number: x")
    '''))
    m = Meshd(str(tmp_path / "m1"), config=str(cfg))
    try:
        m.start()
        job = m.submit("--pool", "py", "--cwd", str(funcs), "--", "raisers:run")
        rec = m.wait_job(job)
        item = rec["items"][0]
        assert item["state"] == "failed" and item["error"] == "raised ValueError: not a number: x"
        status = m.ctl("job", "status", job).stdout.decode()
        assert "item 0: raised ValueError: not a number: x; attempts 1" in status
        assert "Traceback" in status  # the stderr tail still shows where
        w = m.ctl("job", "wait", job)
        assert w.returncode == 1 and b"item 0: raised ValueError: not a number: x" in w.stderr
        assert "raised ValueError: not a number: x" in _page(m, f"/jobs/{job}")
    finally:
        m.stop()


def test_wait_says_an_item_timed_out(meshd):
    """Rule: a wait that ends failed says why each failed item failed, a timeout by name."""
    job = meshd.submit("--runtime", "1", "--", "sleep", "30")
    w = meshd.ctl("job", "wait", job)
    assert w.returncode == 1
    assert b"item 0: timeout: killed after its runtime limit of 1 s" in w.stderr


def test_history_has_a_header_and_columns(meshd):
    """Rule: `history` prints a header and its columns line up."""
    for job_id in ("short", "a-much-longer-id"):
        assert meshd.request("POST", "/jobs", {"id": job_id, "argv": ["true"]})[0] == 201
        meshd.wait_job(job_id)
        assert meshd.ctl("job", "forget", job_id).returncode == 0
    lines = wait_until(lambda: (lambda t: t if len(t) == 3 else None)(
        meshd.ctl("history").stdout.decode().splitlines()), what="two history rows")
    assert lines[0].split() == ["DROPPED", "WHY", "ID", "STATE", "DONE", "POOL", "TAGS"]
    col = lines[0].index("STATE")
    assert all(line[col:].startswith("done") for line in lines[1:])


def test_after_a_failed_parent_says_dep_failed(meshd):
    """Rule: --after naming a parent that already ended so that it cannot hold says, on stderr,
    that the job ends dep_failed at once; one that can still hold says nothing."""
    parent = meshd.submit("--", "false")
    meshd.wait_job(parent)
    r = meshd.ctl("job", "submit", "--after", parent, "--", "true")
    assert r.returncode == 0
    child = r.stdout.decode().strip()
    assert f"job {parent} already ended failed" in r.stderr.decode()
    assert f"job {child} ends dep_failed at once" in r.stderr.decode()
    assert meshd.wait_job(child)["state"] == "dep_failed"
    r = meshd.ctl("job", "submit", "--after", f"{parent}:fail", "--", "true")
    assert r.returncode == 0 and r.stderr == b""
    assert json.loads(meshd.ctl("--json", "jobs").stdout)  # the listing still answers


def test_demo_runs_this_meshjobs_not_the_current_folders(tmp_path):
    """Rule: `meshd --demo` runs meshd and meshctl of the interpreter that runs it, never a
    meshjobs/ folder in the folder it runs in (a source tree), and prints no Python warning."""
    decoy = tmp_path / "meshjobs"
    decoy.mkdir()
    (decoy / "__init__.py").write_text('raise SystemExit("decoy meshjobs of the current folder")\n')
    repo = str(Path(__file__).resolve().parent.parent)
    env = env_with_path({"PYTHONPATH": repo})
    env.pop("MESHJOBS_AT", None)
    # -P: the demo itself comes from this repository (PYTHONPATH), not from the decoy.
    r = subprocess.run([sys.executable, "-P", "-m", "meshjobs.daemon", "--demo"], cwd=tmp_path,
                       capture_output=True, timeout=240, env=env)
    text = (r.stdout + r.stderr).decode()
    assert r.returncode == 0, text[-2000:]
    assert "decoy" not in text.replace(str(tmp_path), "") and "Warning" not in text
    assert "hello from" in text
