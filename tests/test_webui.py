"""The web UI's pages without a browser (issue 11, point 4): the render functions of
meshjobs/webui.py on records (pure: a record in, a page out), the pages through the HTTP API
in front of a recording control port, and the pool filter of GET /jobs on a real member.

Hostile strings (argv, tags, member names, item errors and outputs with markup and quotes)
must come out as text; the pages carry no inline script, only /ui.js under the page's nonce.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import pytest

from meshjobs import limits, webui
from meshjobs.control import Answer
from tests.helpers import Meshd, Server, job_record

EVIL = "<script>alert(1)</script>"
EVIL_ATTR = "\"><img src=x onerror=alert(2)>"


def no_markup_from_records(page: str) -> None:
    assert "<script>" not in page and "<img" not in page and "onerror=alert(2)>" not in page
    # One script element, the page's own, with a src and no body.
    assert len(re.findall(r"<script\b", page)) <= 1
    assert re.search(r"<script[^>]*>[^<]", page) is None


# --- the render functions --------------------------------------------------------------------


def test_jobs_page_rows_buttons_and_escaping() -> None:
    """A row per job: hostile argv and tags escaped, a failed count, Cancel and Hold while a
    job runs, Release while held, Rerun once finished; the filter form keeps its values."""
    jobs = [job_record("run1", argv=["sh", "-c", EVIL], tags=[EVIL_ATTR], items_failed=2),
            job_record("held1", state="held", hold=True),
            job_record("done1", state="done"), "not a record"]
    page = webui.jobs_page("m<1>", jobs, {"state": None, "tag": EVIL_ATTR, "pool": "gpu"},
                           limit=5, next_url="/jobs?limit=5&after=3", csrf="c5", nonce="n0")
    no_markup_from_records(page)
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert f'value="{webui.e(EVIL_ATTR)}"' in page and 'value="gpu"' in page
    assert "member m&lt;1&gt;" in page
    assert '<td class="n">2</td>' in page
    assert ('<button class="cancel" data-job="run1">Cancel</button>'
            '<button class="hold" data-job="run1">Hold</button>') in page
    assert ('<button class="cancel" data-job="held1">Cancel</button>'
            '<button class="release" data-job="held1">Release</button>') in page
    assert '<button class="rerun" data-job="done1">Rerun</button>' in page
    assert '<a href="/jobs?limit=5&amp;after=3">older jobs</a>' in page
    assert '<script nonce="n0" src="/ui.js" defer></script>' in page
    assert '<meta name="meshjobs-csrf" content="c5">' in page
    assert 'data-query="tag=' in page and "pool%3Dgpu" not in page  # the query, url-encoded once
    assert page.count("<tr data-id=") == 3
    empty = webui.jobs_page("m1", [], {"state": "done", "tag": None, "pool": None})
    assert "No jobs with state done." in empty and "<script" not in empty


def test_jobs_page_older_page_links_back() -> None:
    page = webui.jobs_page("m1", [job_record("j1")], {"state": "running", "tag": None,
                                                       "pool": None}, limit=10, after="7")
    assert '<a href="/jobs?state=running&amp;limit=10">newest jobs</a>' in page
    assert "(an older page)" in page
    assert '<option value="running" selected>running</option>' in page


def test_job_page_items_reasons_times_and_preview() -> None:
    """Items with their state, why, rc or signal, attempts, member, times and output links;
    the failed ones explained with their stderr tail; the preview of one item escaped."""
    items = [{"index": 0, "state": "failed", "rc": None, "signal": None, "attempts": 1,
              "member": "<b>m1</b>", "error": "no such program '" + EVIL + "'",
              "stdout": None, "stderr": None, "started_at": 100.0, "ended_at": 100.5},
             {"index": 1, "state": "timeout", "rc": None, "signal": 9, "attempts": 2,
              "member": "m2", "stdout": None, "stderr": "e" * 64},
             {"index": 2, "state": "done", "rc": 0, "attempts": 1, "member": "m1",
              "stdout": "a" * 64, "stderr": None, "started_at": 100.0, "ended_at": 225.0},
             {"index": 3, "state": "leased", "attempts": 1, "member": "m2",
              "stdout": None, "stderr": None, "started_at": 100.0}]
    rec = job_record("j1", items=items, argv=["echo", EVIL], runtime_s=2.5, items_failed=2,
                     submitted_at=90.0, finished_at=None)
    failed = [(items[0], None), (items[1], "last <line>")]
    page = webui.job_page("m1", rec, failed, 2, preview=(items[2], {
        "stdout": ("out " + EVIL, 5 * limits.webui_preview_bytes_max), "stderr": (None, None)}))
    no_markup_from_records(page)
    assert "no such program &#x27;&lt;script&gt;alert(1)&lt;/script&gt;&#x27;" in page
    assert "timeout: killed after its runtime limit of 2.5 s" in page
    assert "<pre>last &lt;line&gt;</pre>" in page and "&lt;b&gt;m1&lt;/b&gt;" in page
    assert '<td class="n">signal 9</td>' in page
    assert "1970-01-01 00:01:40" in page and "0.5 s" in page and "2 min 5 s" in page
    assert f'<a href="/blobs/{"a" * 64}" download="j1-2.stdout">stdout</a>' in page
    assert f'<a href="/blobs/{"e" * 64}" download="j1-1.stderr">stderr</a>' in page
    assert '<h2 id="preview-h">Output of item 2</h2>' in page
    assert '<pre class="out">out &lt;script&gt;' in page
    assert "the first 16.0 KiB of 80.0 KiB" in page
    assert "<h3>stderr</h3><p class=\"note\">none" in page
    assert 'class="cancel" data-job="j1"' in page and 'data-sig="running/1/2/0/0/0"' in page
    assert '<a href="/jobs/j1/items/3/stdout?follow=1">stdout (live)</a>' in page
    assert '<a href="/jobs/j1/items/3/stderr?follow=1">stderr (live)</a>' in page
    assert "items 0–3 of 4" in page and "later items" not in page


def test_job_page_pages_big_jobs() -> None:
    """A job with more items than webui_items_shown_max lists one page of them, with links."""
    n = limits.webui_items_shown_max * 2 + 3
    items = [{"index": i, "state": "pending", "attempts": 0} for i in range(n)]
    rec = job_record("big", items=items, items_total=n)
    cap = limits.webui_items_shown_max
    first = webui.job_page("m1", rec, [], 0)
    assert first.count('<td class="state pending">') == cap
    assert f'href="/jobs/big?items_from={cap}#items">later items' in first
    assert "earlier items" not in first
    last = webui.job_page("m1", rec, [], 0, items_from=2 * cap)
    assert last.count('<td class="state pending">') == 3
    assert f'href="/jobs/big?items_from={cap}#items">earlier items' in last
    assert f"items {2 * cap}–{n - 1} of {n}" in last


def test_job_page_placement_reruns_and_rerun_button() -> None:
    """A placed job says where it runs and why it waits; a job run again says which run it is
    and lists earlier runs; a finished job has Rerun (and nothing to cancel), a running one not."""
    rec = job_record("j2", state="done", member="gpu-*", members=None,
                     waiting_for="no alive member matches 'gpu-*' " + EVIL, notify="http://h/x",
                     run=3, restarts=1, resubmits=1, rerun_due_at=1_700_000_000.0,
                     rerun_due_why="restart",
                     previous_runs=[{"run": 1, "state": "failed", "finished_at": 100.0},
                                    {"run": 2, "state": "done", "finished_at": 160.0}])
    page = webui.job_page("m1", rec, [], 0)
    no_markup_from_records(page)
    assert "members matching gpu-*" in page and "no alive member matches" in page
    assert "&lt;script&gt;" in page and "http://h/x" in page
    assert "3 (restarts 1, resubmits 1)" in page and "(restart)" in page
    assert "run 1: failed at 1970-01-01 00:01:40; run 2: done at 1970-01-01 00:02:40" in page
    assert 'class="rerun" data-job="j2"' in page and 'class="cancel"' not in page
    fan = webui.job_page("m1", job_record("j3", member="*", members=["m1", "m2"]), [], 0)
    assert "every member of the pool, once each: m1, m2" in fan
    assert 'class="rerun"' not in fan and 'class="cancel" data-job="j3"' in fan
    assert 'class="rerun"' not in webui.buttons({"id": "x", "state": "dep_failed"})
    assert 'rerun: ["rerun", {}]' in webui.UI_SCRIPT and '"rerun", "Rerun"' in webui.UI_SCRIPT


def test_fleet_page_members_roles_and_escaping() -> None:
    fleet = {"term": 7, "leader": "m1", "members": [
        {"name": "m1", "role": "leader", "alive": True, "pools": {"default": 2}, "slots": 2,
         "running": 1, "blob_pressure": False, "disk_full": False, "blob_bytes": 3 * 1024 * 1024,
         "last_seen": 1_700_000_000.0},
        {"name": EVIL, "role": "follower", "alive": None, "pools": {}, "slots": 0,
         "running": 0, "last_seen": None},
        {"name": "w1", "role": "worker", "alive": False, "pools": {EVIL_ATTR: 4}, "slots": 4,
         "running": 0, "blob_pressure": True, "disk_full": True, "blob_bytes": 10}]}
    fleet["members"][2]["items"] = {"user": "u", "walls": [], "signals_walled": False,
                                    "warning": EVIL}
    page = webui.fleet_page("m1", fleet, nonce="n1")
    no_markup_from_records(page)
    assert 'data-items-warning="w1"' in page and 'data-items-warning="m1"' not in page
    assert "Leader: <strong>m1</strong>, term 7. 3 member(s), 1 alive" in page
    assert '<td class="role leader">leader</td>' in page
    assert '<td class="role worker">worker</td>' in page
    assert "3.0 MiB" in page and "10 B" in page and "2023-11-14 22:13:20" in page
    assert '<td class="failed">down</td>' in page and '<td class="pending">unknown</td>' in page
    down = webui.fleet_page("m1", {"term": 1, "leader": "m1", "members": [
        {"name": "v1", "alive": False, "status": "down", "down_since": 1_700_000_000.0},
        {"name": "w2", "alive": None, "status": "not_heard_yet", "down_since": None}]})
    assert '<td class="failed">down since 22:13:20</td>' in down
    assert '<td class="pending">not heard yet</td>' in down
    assert '<td class="failed">yes</td>' in page  # pressure, disk full
    assert "<th>orders</th>" in page and "<td>none</td>" in page
    drained = webui.fleet_page("m1", {"term": 1, "leader": "m1", "members": [
        {"name": "m2", "drained": True, "stopping": True}]})
    assert "<td>stopping, drained</td>" in drained
    assert "none known" in webui.fleet_page("m1", {"term": 0, "leader": None, "members": []})


def test_login_page_escapes_next_and_problem() -> None:
    page = webui.login_page("m1", EVIL_ATTR, True, EVIL)
    no_markup_from_records(page)
    assert 'type="password"' in page and "<script" not in page


def test_script_is_plain_and_uses_the_limits() -> None:
    """The script builds rows from text only (no innerHTML, eval or inline handlers), posts with
    the CSRF header, falls back to polling, and takes its timings from limits.py."""
    js = webui.UI_SCRIPT
    for banned in ("innerHTML", "outerHTML", "eval(", "new Function", "document.write",
                   "insertAdjacentHTML", "__POLL_MS__", "__SSE_RETRY_MS__"):
        assert banned not in js, banned
    assert f"const POLL_MS = {limits.webui_poll_ms};" in js
    assert f"const SSE_RETRY_MS = {limits.webui_sse_retry_ms};" in js
    assert '"X-Meshjobs-Csrf": csrf' in js and "new EventSource(url)" in js
    # The change signature the script compares is the one the pages carry.
    assert webui.sig(job_record("x", hold=True, items_running=1)) == "running/1/0/1/0/1"
    assert "const sig = (j) => [j.state, j.items_done ?? 0, j.items_failed ?? 0, " \
           "j.items_running ?? 0,\n                      j.priority ?? 0, j.hold ? 1 : 0]" in js


# --- the pages through HTTP ------------------------------------------------------------------


@pytest.fixture(scope="module")
def srv() -> Iterator[Server]:
    s = Server()
    yield s
    s.close()


@pytest.fixture(autouse=True)
def _fresh(request: pytest.FixtureRequest) -> None:
    if "srv" in request.fixturenames:
        request.getfixturevalue("srv").control.reset()


def csp_nonce(headers: Any) -> str:
    csp = headers["Content-Security-Policy"]
    assert "default-src 'none'" in csp and "'unsafe-inline'" not in csp.split("style-src")[0]
    found = re.search(r"script-src 'nonce-([A-Za-z0-9_-]+)';", csp)
    assert found, csp
    return found.group(1)


def test_fleet_negotiates_html_and_json(srv: Server) -> None:
    """/fleet: JSON for API clients (*/*, application/json, none), the page for a browser or
    ?format=html; a bad format is 400."""
    srv.control.answers["fleet"] = Answer(200, {"term": 3, "leader": "m1", "members": [
        {"name": "m1", "role": "leader", "alive": True, "slots": 2, "running": 0},
        {"name": EVIL, "role": "worker", "alive": False}]})
    for accept in (None, "*/*", "application/json", "text/html;q=0.5,application/json"):
        status, headers, data = srv.request("GET", "/fleet", headers={"Accept": accept} if accept else {})
        assert status == 200 and headers["Content-Type"].startswith("application/json"), accept
        assert json.loads(data)["term"] == 3
    for path, accept in (("/fleet", "text/html,application/xhtml+xml,*/*;q=0.8"),
                         ("/fleet?format=html", "*/*")):
        status, headers, data = srv.request("GET", path, headers={"Accept": accept})
        assert status == 200 and headers["Content-Type"].startswith("text/html"), path
        page = data.decode()
        no_markup_from_records(page)
        assert f'<script nonce="{csp_nonce(headers)}" src="/ui.js" defer></script>' in page
        assert '<td class="role leader">leader</td>' in page
    status, body = srv.json("GET", "/fleet?format=pdf")
    assert status == 400 and "format" in body["error"]


def test_list_pool_filter_reaches_the_control(srv: Server) -> None:
    """GET /jobs?pool=P asks the list op for that pool (JSON and HTML); the next page keeps it;
    a bad pool name is 400 and never reaches the control port."""
    srv.control.answers["list"] = Answer(200, {"jobs": [job_record("g1", pool="gpu")],
                                               "next": "4"})
    status, headers, data = srv.request("GET", "/jobs?pool=gpu&limit=1&format=json")
    assert status == 200 and [j["id"] for j in json.loads(data)] == ["g1"]
    assert srv.control.last() == {"op": "list", "state": None, "tag": None, "limit": 1,
                                  "pool": "gpu"}
    assert headers["Link"] == '</jobs?pool=gpu&format=json&limit=1&after=4>; rel="next"'
    status, headers, data = srv.request("GET", "/jobs?pool=gpu", headers={"Accept": "text/html"})
    page = data.decode()
    assert status == 200 and 'name="pool" value="gpu"' in page
    assert '<a href="/jobs?pool=gpu&amp;limit=100&amp;after=4">older jobs</a>' in page
    srv.control.reset()
    for bad in ("%3Cscript%3E", "a%20b", "x" * (limits.pool_chars_max + 1), "%00"):
        status, body = srv.json("GET", "/jobs?pool=" + bad)
        assert status == 400 and "bad pool name" in body["error"], bad
    assert srv.control.requests == []


def test_pages_carry_one_script_under_the_nonce(srv: Server) -> None:
    """Every page's one script is /ui.js with the nonce of its CSP; /ui.js is JavaScript that
    is not sniffed; the login page runs no script at all."""
    nonces = set()
    for path in ("/jobs", "/jobs/j1", "/fleet"):
        status, headers, data = srv.request("GET", path, headers={"Accept": "text/html"})
        assert status == 200, path
        nonce = csp_nonce(headers)
        nonces.add(nonce)
        assert data.decode().count("<script") == 1
        assert f'<script nonce="{nonce}" src="/ui.js" defer></script>' in data.decode()
    assert len(nonces) == 3  # a fresh nonce per page
    status, headers, data = srv.request("GET", "/ui.js")
    assert status == 200 and headers["Content-Type"] == "text/javascript; charset=utf-8"
    assert headers["X-Content-Type-Options"] == "nosniff" and data.decode() == webui.UI_SCRIPT
    status, headers, data = srv.request("GET", "/login", headers={"Accept": "text/html"})
    assert "script-src 'none'" in headers["Content-Security-Policy"] and b"<script" not in data


def test_job_page_preview_from_the_blob_store(srv: Server) -> None:
    """?item=N shows the head of item N's stdout and stderr (escaped, capped at
    webui_preview_bytes_max) with download links; a one-item job that ended shows its only
    item; a bad or missing item is 400 or 404."""
    big = b"<b>x</b>" * (limits.webui_preview_bytes_max // 4)
    out = srv.blobs.put(big)
    err = srv.blobs.put("stderr \u00e9 <i>\n".encode())
    items = [{"index": 0, "state": "done", "rc": 0, "attempts": 1, "member": "m1",
              "stdout": out, "stderr": err, "started_at": 1.0, "ended_at": 2.0},
             {"index": 1, "state": "failed", "rc": 1, "attempts": 1, "member": "m1",
              "stdout": None, "stderr": "f" * 64}]  # a digest this member does not hold
    srv.control.answers["get"] = lambda r: Answer(200, job_record(r["id"], items=items))
    status, _, data = srv.request("GET", "/jobs/j1?item=0", headers={"Accept": "text/html"})
    page = data.decode()
    assert status == 200 and "<b>" not in page and "<i>" not in page
    head = webui.e(big[: limits.webui_preview_bytes_max].decode())
    assert f'<pre class="out">{head}</pre>' in page
    assert f"the first 16.0 KiB of {webui.size(len(big))}" in page
    assert '<pre class="out">stderr \u00e9 &lt;i&gt;\n</pre>' in page
    assert f'href="/blobs/{out}" download="j1-0.stdout">download stdout' in page
    status, _, data = srv.request("GET", "/jobs/j1?item=1", headers={"Accept": "text/html"})
    assert "<h3>stderr</h3><p class=\"note\">not readable on this member now" in data.decode()
    status, _, data = srv.request("GET", "/jobs/j1", headers={"Accept": "text/html"})
    assert 'id="preview"' not in data.decode()  # two items: none chosen
    for query, want in (("item=2", 404), ("item=-1", 400), ("item=x", 400),
                        ("items_from=1e3", 400), ("item=" + "9" * 12, 400)):
        status, _, data = srv.request("GET", "/jobs/j1?" + query, headers={"Accept": "text/html"})
        assert status == want and "error" in json.loads(data), query
    srv.control.answers["get"] = lambda r: Answer(200, job_record(r["id"], items=items[:1],
                                                                  items_total=1))
    status, _, data = srv.request("GET", "/jobs/j1", headers={"Accept": "text/html"})
    assert '<h2 id="preview-h">Output of item 0</h2>' in data.decode()


def test_job_page_of_an_unknown_job_is_a_page(srv: Server) -> None:
    """A browser asking for a job the member does not know gets a page with the API's words
    (escaped) and the same status; an API client gets the JSON."""
    srv.control.answers["get"] = lambda r: Answer(404, {"error": f"no job {EVIL}"})
    status, headers, data = srv.request("GET", "/jobs/nope", headers={"Accept": "text/html"})
    assert status == 404 and headers["Content-Type"].startswith("text/html")
    page = data.decode()
    no_markup_from_records(page)
    assert "no job &lt;script&gt;alert(1)&lt;/script&gt;" in page and "<script" not in page
    status, body = srv.json("GET", "/jobs/nope", headers={"Accept": "application/json"})
    assert status == 404 and body == {"error": f"no job {EVIL}"}


# --- the pool filter on a real member --------------------------------------------------------


@pytest.mark.fleet
def test_pool_filter_on_a_real_member(tmp_path) -> None:
    """Rule: GET /jobs?pool=P lists only that pool's jobs, as JSON and on the page."""
    cfg = tmp_path / "p1.toml"
    cfg.write_text('name = "p1"\n[pools.default]\nslots = 1\n[pools.gpu]\nslots = 1\n')
    m = Meshd(str(tmp_path / "p1"), name="p1", config=str(cfg))
    try:
        m.start()
        for jid, pool in (("cpu-1", "default"), ("gpu-1", "gpu"), ("gpu-2", "gpu")):
            status, body = m.request("POST", "/jobs", {"argv": ["true"], "id": jid, "pool": pool,
                                                       "hold": True})
            assert status == 201, body
        status, jobs = m.request("GET", "/jobs?pool=gpu&format=json")
        assert status == 200 and [j["id"] for j in jobs] == ["gpu-2", "gpu-1"]
        status, jobs = m.request("GET", "/jobs?pool=default&state=held&format=json")
        assert [j["id"] for j in jobs] == ["cpu-1"]
        status, jobs = m.request("GET", "/jobs?pool=none&format=json")
        assert status == 200 and jobs == []
        status, _, page = m.raw_request("GET", "/jobs?pool=gpu", headers={
            "Host": m.url.split("://", 1)[1], "Accept": "text/html"})
        assert status == 200 and b'data-id="gpu-1"' in page and b'data-id="cpu-1"' not in page
    finally:
        m.stop()
