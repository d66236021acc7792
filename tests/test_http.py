"""The HTTP API (meshjobs/http.py) on a real socket, in front of a recording control port.

The control port here is a stand-in that records each request and answers from a table: it is
not the part under test. The blob store is the real in-memory store.
"""

from __future__ import annotations

import base64
import http.client
import json
import re
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from blobstore import MemoryBlobStore, hexdigest
from meshjobs import http as mhttp
from meshjobs import limits
from meshjobs.control import Answer, ControlError
from meshjobs.openapi import openapi_document
from tests.helpers import LateDamageStore, RecordingControl, Server, job_record

DIGEST_A = "a" * 64


@pytest.fixture(scope="module")
def srv() -> Iterator[Server]:
    s = Server()
    yield s
    s.close()


@pytest.fixture(autouse=True)
def _fresh(request: pytest.FixtureRequest) -> None:
    if "srv" in request.fixturenames:
        request.getfixturevalue("srv").control.reset()


# --- GET /jobs -------------------------------------------------------------------------------


def test_list_json_by_accept_and_by_format(srv: Server) -> None:
    """GET /jobs answers JSON when Accept prefers it or ?format=json, with op list."""
    status, body = srv.json("GET", "/jobs", headers={"Accept": "application/json"})
    assert status == 200 and [j["id"] for j in body] == ["j1", "j2"]
    assert srv.control.last() == {"op": "list", "state": None, "tag": None, "limit": 100}
    status, body = srv.json("GET", "/jobs?format=json&state=running&tag=nightly&limit=7&after=12")
    assert status == 200
    assert srv.control.last() == {"op": "list", "state": "running", "tag": "nightly",
                                  "limit": 7, "after": "12"}


def test_list_html_by_default_and_escaped(srv: Server) -> None:
    """A browser gets an HTML table in which a hostile id and tag are escaped."""
    srv.control.answers["list"] = Answer(200, [job_record(
        "<script>alert(1)</script>", tags=['"><img src=x onerror=alert(2)>'], items_done=2)])
    status, headers, data = srv.request("GET", "/jobs", headers={
        "Accept": "text/html,application/xhtml+xml,application/json;q=0.9,*/*;q=0.8"})
    assert status == 200
    assert headers["Content-Type"].startswith("text/html")
    page = data.decode()
    assert "<script>" not in page and "<img" not in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert "&quot;&gt;&lt;img src=x onerror=alert(2)&gt;" in page
    assert "2/3" in page and "<table>" in page
    # Without any Accept header (curl's */*) the page is HTML as well.
    status, headers, _ = srv.request("GET", "/jobs", headers={"Accept": "*/*"})
    assert headers["Content-Type"].startswith("text/html")


def test_job_page_escapes_what_items_say(srv: Server) -> None:
    """The job page shows a failed item's error and stderr tail escaped, only for a browser
    (Accept: text/html); */* and JSON clients get the record."""
    err = srv.blobs.put(b"line1\n" * 10 + b"<script>alert(1)</script>\n")
    items = [{"index": 0, "state": "failed", "rc": None, "signal": None, "attempts": 1,
              "member": "<b>m1</b>", "error": "could not start '<img src=x onerror=alert(2)>'",
              "stdout": None, "stderr": err},
             {"index": 1, "state": "timeout", "rc": None, "signal": 9, "attempts": 2,
              "member": "m2", "stdout": None, "stderr": None},
             {"index": 2, "state": "done", "rc": 0, "stdout": None, "stderr": None}]
    srv.control.answers["get"] = lambda r: Answer(200, job_record(
        r["id"], items=items, argv=["sh", "-c", "echo '</code><script>'"], runtime_s=2.5,
        items_failed=2))
    status, headers, data = srv.request("GET", "/jobs/j1", headers={"Accept": "text/html"})
    assert status == 200 and headers["Content-Type"].startswith("text/html")
    page = data.decode()
    assert "<script>alert" not in page and "<img" not in page and "<b>m1" not in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert "could not start &#x27;&lt;img src=x onerror=alert(2)&gt;&#x27;" in page
    assert "timeout: killed after its runtime limit of 2.5 s" in page
    assert page.count("line1") == 4  # the last lines only
    assert 'class="cancel" data-job="j1"' in page  # running: it can be cancelled
    for accept in ("*/*", "application/json", "text/html;q=0.5,application/json"):
        status, headers, data = srv.request("GET", "/jobs/j1", headers={"Accept": accept})
        assert status == 200 and headers["Content-Type"].startswith("application/json"), accept
    status, headers, _ = srv.request("GET", "/jobs/j1?format=html")
    assert headers["Content-Type"].startswith("text/html")
    status, _, _ = srv.request("GET", "/jobs/j1?format=pdf")
    assert status == 400


def test_list_page_next_link_and_failed_column(srv: Server) -> None:
    """A page of the list carries the next page's cursor (header, Link, and a link on the
    HTML page) and a failed-count column."""
    srv.control.answers["list"] = Answer(200, {"jobs": [job_record("j9", items_failed=4)],
                                               "next": "9"})
    status, headers, data = srv.request("GET", "/jobs?limit=1&tag=t", headers={
        "Accept": "application/json"})
    assert status == 200 and [j["id"] for j in json.loads(data)] == ["j9"]
    assert headers["X-Meshjobs-Next"] == "9"
    assert headers["Link"] == '</jobs?tag=t&limit=1&after=9>; rel="next"'
    status, headers, data = srv.request("GET", "/jobs?limit=1", headers={"Accept": "text/html"})
    page = data.decode()
    assert '<a href="/jobs?limit=1&amp;after=9">older jobs</a>' in page
    assert '<td class="n">4</td>' in page and "<th>failed</th>" in page


def test_list_says_whether_the_members_table_is_fresh(srv: Server) -> None:
    """Issue 26 point 2: a member cut off from the leader answers the job list from its table
    and says so: X-Meshjobs-Fresh (false), and a note on the HTML page; a fresh one says true
    and the page has no note."""
    for fresh in (False, True):
        srv.control.answers["list"] = Answer(200, {"jobs": [job_record("j9")], "next": None,
                                                   "fresh": fresh})
        status, headers, data = srv.request("GET", "/jobs", headers={"Accept": "application/json"})
        assert status == 200 and [j["id"] for j in json.loads(data)] == ["j9"]
        assert headers["X-Meshjobs-Fresh"] == ("true" if fresh else "false")
        status, headers, data = srv.request("GET", "/jobs", headers={"Accept": "text/html"})
        assert status == 200 and headers["X-Meshjobs-Fresh"] == ("true" if fresh else "false")
        assert ("does not hear the leader now" in data.decode()) is not fresh


@pytest.mark.parametrize("query", [
    "state=sleeping", "format=xml", "tag=" + "x" * 65, "limit=0", "limit=-1", "limit=1001",
    "limit=abc", "limit=1e3", "limit=%EF%BC%91", "limit=" + "9" * 40, "after=abc", "after=-1",
    "after=1.5", "after=" + "1" * 21, "after=%EF%BC%91", "after=%00"])
def test_list_bad_query(srv: Server, query: str) -> None:
    """A bad state, format or tag is a 400 and never reaches the control port."""
    status, body = srv.json("GET", "/jobs?" + query)
    assert status == 400 and "error" in body
    assert srv.control.requests == []


# --- POST /jobs ------------------------------------------------------------------------------


def test_submit_without_items_is_one_empty_item(srv: Server) -> None:
    """No items key: one item with empty stdin; the rid is the Idempotency-Key."""
    status, body = srv.json("POST", "/jobs", {"argv": ["echo", "hi"], "id": "x1", "tags": ["a"]},
                            headers={"Idempotency-Key": "key-1"})
    assert status == 201 and body["id"] == "x1"
    req = srv.control.last()
    assert req["op"] == "submit" and req["rid"] == "key-1" and req["items"] == [None]
    assert req["spec"]["argv"] == ["echo", "hi"] and req["spec"]["tags"] == ["a"]
    assert "items" not in req["spec"]


def test_submit_makes_a_rid_when_none_is_given(srv: Server) -> None:
    """Without Idempotency-Key each submit gets a fresh uuid4 hex rid."""
    srv.json("POST", "/jobs", {"argv": ["true"]})
    srv.json("POST", "/jobs", {"argv": ["true"]})
    a, b = (r["rid"] for r in srv.control.requests)
    assert a != b and len(a) == 32 and int(a, 16) >= 0


def test_submit_items_become_digests(srv: Server) -> None:
    """String, b64 and blob items turn into digests of the stored payloads, in order."""
    stored = srv.blobs.put(b"already here")
    raw = bytes(range(256))
    status, _ = srv.json("POST", "/jobs", {"argv": ["cat"], "items": [
        "héllo", {"b64": base64.b64encode(raw).decode()}, {"blob": stored}, ""]})
    assert status == 201
    items = srv.control.last()["items"]
    assert items == [hexdigest("héllo".encode()), hexdigest(raw), stored, hexdigest(b"")]
    assert srv.blobs.get(items[0]) == "héllo".encode()
    assert srv.blobs.get(items[1]) == raw


@pytest.mark.parametrize("items,needle", [
    ([{"b64": "not base64!!"}], "base64"),
    ([{"blob": DIGEST_A}], "no blob"),
    ([{"blob": "A" * 64}], "digest"),
    ([{"blob": "abc"}], "digest"),
    (["ok", "\ud800"], "Unicode"),
    ([{"b64": "aGk=", "blob": DIGEST_A}], "items[0]"),
    ([], "items"),
    ("not a list", "items"),
    ([1], "items[0]"),
])
def test_submit_bad_items(srv: Server, items: Any, needle: str) -> None:
    """Each malformed item is a 400 naming the problem, and nothing is submitted."""
    raw = json.dumps({"argv": ["cat"], "items": items}).encode()
    status, body = srv.json("POST", "/jobs", raw=raw)
    assert status == 400 and needle in body["error"]
    assert [r for r in srv.control.requests if r["op"] == "submit"] == []


@pytest.mark.parametrize("raw", [
    b"", b"{", b"[1, 2]", b'"argv"', b"null", b'{"argv": "echo"}', b'{"argv": ["echo"], "priority": true}',
    b'{"argv": ["echo"], "bogus": 1}', b'{"argv": ["echo"], "priority": NaN}', b"\xff\xfe",
    b'{"argv": ["echo"], "id": "bad id"}',
])
def test_submit_garbage_is_400(srv: Server, raw: bytes) -> None:
    """Broken JSON, non-objects and wrong types are 400 with a JSON error."""
    status, body = srv.json("POST", "/jobs", raw=raw)
    assert status == 400 and isinstance(body["error"], str)
    assert srv.control.requests == []


def test_submit_bad_idempotency_key(srv: Server) -> None:
    """An Idempotency-Key that is not a request id is refused."""
    status, body = srv.json("POST", "/jobs", {"argv": ["true"]},
                            headers={"Idempotency-Key": "has space"})
    assert status == 400 and srv.control.requests == []


def test_submit_answer_passes_through(srv: Server) -> None:
    """The control's status and body are the HTTP answer (here a 409)."""
    srv.control.answers["submit"] = Answer(409, {"error": "job x exists"})
    status, body = srv.json("POST", "/jobs", {"argv": ["true"], "id": "x"})
    assert (status, body) == (409, {"error": "job x exists"})


def test_control_error_from_the_future(srv: Server) -> None:
    """A ControlError set on the future is answered with its status and message."""
    def refuse(r: dict) -> Answer:
        raise ControlError(503, "no leader: try again")
    srv.control.answers["cancel"] = refuse
    status, body = srv.json("POST", "/jobs/j1/cancel")
    assert (status, body) == (503, {"error": "no leader: try again"})


# --- GET /jobs/{id} and long polls -----------------------------------------------------------


def test_get_job_params(srv: Server) -> None:
    """items and wait become the get op's items (bool) and wait_ms (int)."""
    status, body = srv.json("GET", "/jobs/j1")
    assert status == 200 and body["id"] == "j1"
    assert srv.control.last() == {"op": "get", "id": "j1", "items": False, "wait_ms": 0}
    srv.json("GET", "/jobs/j.1-_x?items=1&wait=2.5")
    # With items, the jobs thread answers a copy of the columns (copy_items) and the edge
    # builds the records (table.ItemRows).
    assert srv.control.last() == {"op": "get", "id": "j.1-_x", "items": True, "wait_ms": 2500,
                                  "copy_items": True}
    srv.json("GET", f"/jobs/j1?wait={limits.http_wait_s_max}")
    assert srv.control.last()["wait_ms"] == limits.http_wait_s_max * 1000


@pytest.mark.parametrize("query", ["wait=-1", f"wait={limits.http_wait_s_max + 0.5}", "wait=nan",
                                   "wait=inf", "wait=abc", "items=maybe"])
def test_get_job_bad_params(srv: Server, query: str) -> None:
    """wait outside 0..http_wait_s_max, or a bad items flag, is a 400."""
    status, body = srv.json("GET", "/jobs/j1?" + query)
    assert status == 400 and "error" in body
    assert srv.control.requests == []


def test_long_poll_answered_late_from_another_thread(srv: Server) -> None:
    """A get answered later, from another thread, still reaches the client."""
    srv.control.late_s["get"] = 0.3
    status, body = srv.json("GET", "/jobs/j1?wait=5")
    assert status == 200 and body["id"] == "j1"


@pytest.mark.parametrize("method,suffix", [("GET", ""), ("DELETE", ""), ("POST", "/cancel"),
                                           ("POST", "/tone"), ("GET", "/results")])
@pytest.mark.parametrize("job_id", ["bad%20id", "x" * (limits.job_id_chars_max + 1), "a%24b",
                                    "%C3%A9t%C3%A9"])
def test_bad_job_id_on_every_route(srv: Server, method: str, suffix: str, job_id: str) -> None:
    """A job id outside [A-Za-z0-9._-]{1,max} is a 400 on every route that takes one."""
    status, body = srv.json(method, f"/jobs/{job_id}{suffix}", {"priority": 1})
    assert status == 400 and "job id" in body["error"]
    assert srv.control.requests == []


def test_longest_job_id_is_fine(srv: Server) -> None:
    status, _ = srv.json("GET", "/jobs/" + "x" * limits.job_id_chars_max)
    assert status == 200


# --- cancel, forget, tone --------------------------------------------------------------------


def test_cancel_and_forget_ops(srv: Server) -> None:
    """cancel and forget carry the id and a rid (the Idempotency-Key when given), and the key's
    fingerprint (method, path, body), which differs between two requests."""
    status, body = srv.json("POST", "/jobs/j1/cancel", headers={"Idempotency-Key": "k:1"})
    assert status == 200 and body["state"] == "cancelled"
    req = srv.control.last(by=True)
    fp = req.pop("fp")
    # Who asks goes with it: a member without [auth] is the `local` identity.
    assert req == {"op": "cancel", "rid": "k:1", "id": "j1", "by": "local", "by_role": "admin"}
    assert re.fullmatch("[0-9a-f]{32}", fp)
    srv.json("POST", "/jobs/j2/cancel", headers={"Idempotency-Key": "k:1"})
    assert srv.control.last()["fp"] != fp
    srv.json("POST", "/jobs/j1/cancel", headers={"Idempotency-Key": "k:1"})
    assert srv.control.last()["fp"] == fp
    status, _ = srv.json("DELETE", "/jobs/j2")
    req = srv.control.last()
    assert status == 200 and req["op"] == "forget" and req["id"] == "j2" and len(req["rid"]) == 32
    assert req["fp"] is None  # no key: a fresh request id, bound to nothing


def test_tone_ops(srv: Server) -> None:
    """tone passes exactly the fields given; max_leases null clears the limit."""
    srv.json("POST", "/jobs/j1/tone", {"priority": -5, "hold": True})
    req = srv.control.last()
    assert {k: v for k, v in req.items() if k not in ("rid", "fp")} == {
        "op": "tone", "id": "j1", "priority": -5, "hold": True}
    srv.json("POST", "/jobs/j1/tone", {"max_leases": None})
    req = srv.control.last()
    assert req["max_leases"] is None and "priority" not in req and "hold" not in req


@pytest.mark.parametrize("body,needle", [
    ({}, "nothing to change"),
    ({"priority": True}, "priority"),
    ({"priority": "1"}, "priority"),
    ({"hold": 1}, "hold"),
    ({"max_leases": 0}, "max_leases"),
    ({"max_leases": 2.5}, "max_leases"),
    ({"speed": 3}, "unknown"),
    ([1], "object"),
])
def test_tone_bad_bodies(srv: Server, body: Any, needle: str) -> None:
    status, answer = srv.json("POST", "/jobs/j1/tone", body)
    assert status == 400 and needle in answer["error"]
    assert srv.control.requests == []


def test_tone_broken_json(srv: Server) -> None:
    status, body = srv.json("POST", "/jobs/j1/tone", raw=b'{"priority": ')
    assert status == 400 and "JSON" in body["error"]


# --- results and blobs -----------------------------------------------------------------------


def test_results_stream_in_item_order(srv: Server) -> None:
    """Results are the items' stdout blobs in index order; null stdout is skipped."""
    d0, d2, e1 = (srv.blobs.put(b) for b in (b"zero\n", b"two" * 1000, b"err1"))
    items = [
        {"index": 2, "state": "done", "stdout": d2, "stderr": None},
        {"index": 0, "state": "done", "stdout": d0, "stderr": None},
        {"index": 1, "state": "failed", "stdout": None, "stderr": e1},
    ]
    srv.control.answers["get"] = lambda r: Answer(200, job_record(r["id"], items=items))
    status, headers, data = srv.request("GET", "/jobs/j1/results")
    assert status == 200 and headers["Content-Type"] == "application/octet-stream"
    assert data == b"zero\n" + b"two" * 1000
    assert int(headers["Content-Length"]) == len(data)
    # The digests a slice at a time (node/reads.py), never every item record.
    assert srv.control.last() == {"op": "outputs", "id": "j1", "stream": "stdout", "from": 0,
                                  "limit": limits.results_slice_max}
    status, _, data = srv.request("GET", "/jobs/j1/results?stream=stderr")
    assert (status, data) == (200, b"err1")


def test_results_errors(srv: Server) -> None:
    """A missing job passes its 404; a bad stream is 400; a blob not here yet is 503."""
    status, body = srv.json("GET", "/jobs/j1/results?stream=stdin")
    assert status == 400
    srv.control.answers["get"] = Answer(404, {"error": "no job j9"})
    assert srv.json("GET", "/jobs/j9/results") == (404, {"error": "no job j9"})
    srv.control.answers["get"] = lambda r: Answer(200, job_record(r["id"], items=[
        {"index": 0, "state": "done", "stdout": DIGEST_A, "stderr": None}]))
    status, body = srv.json("GET", "/jobs/j1/results")
    assert status == 503 and DIGEST_A in body["error"]


def test_blob_streams_with_length(srv: Server) -> None:
    """A blob of many chunks comes back whole, with its Content-Length."""
    payload = bytes(range(256)) * 41
    digest = srv.blobs.put(payload)
    status, headers, data = srv.request("GET", f"/blobs/{digest}")
    assert status == 200 and data == payload
    assert headers["Content-Type"] == "application/octet-stream"
    assert int(headers["Content-Length"]) == len(payload)
    empty = srv.blobs.put(b"")
    assert srv.request("GET", f"/blobs/{empty}")[::2] == (200, b"")


def test_head_sends_no_body(srv: Server) -> None:
    """HEAD on a blob gives its length and no bytes; the connection stays usable."""
    digest = srv.blobs.put(b"y" * 3000)
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=10)
    try:
        conn.request("HEAD", f"/blobs/{digest}")
        resp = conn.getresponse()
        assert resp.status == 200 and resp.headers["Content-Length"] == "3000"
        assert resp.read() == b""
        conn.request("GET", "/healthz")
        resp = conn.getresponse()
        assert resp.status == 200 and json.loads(resp.read())["ok"] is True
    finally:
        conn.close()


@pytest.mark.parametrize("digest,status", [(DIGEST_A, 404), ("A" * 64, 400), ("abc", 400),
                                           ("g" * 64, 400), ("a" * 65, 400)])
def test_blob_absent_or_malformed(srv: Server, digest: str, status: int) -> None:
    got, body = srv.json("GET", f"/blobs/{digest}")
    assert got == status and "error" in body


def test_blob_damaged_is_500_json(srv: Server) -> None:
    """A blob that no longer hashes to its digest is a 500 "blob damaged", never its bytes."""
    digest = srv.blobs.put(b"precious")
    # Damage the store's copy behind its back, as a bad disk would.
    srv.blobs._blobs[digest] = (b"tampered", srv.blobs._blobs[digest][1])
    status, body = srv.json("GET", f"/blobs/{digest}")
    assert status == 500 and set(body) == {"error"}
    assert f"blob {digest}" in body["error"] and "is damaged on member" in body["error"]
    assert b"tampered" not in json.dumps(body).encode()
    status, body = srv.json("GET", f"/blobs/{digest}?check=1")
    assert (status, body) == (200, {"digest": digest, "state": "damaged", "repaired": False})


def test_damage_after_headers_cuts_the_body() -> None:
    """Damage found once bytes are sent cuts the connection short of Content-Length."""
    s = Server(LateDamageStore(chunk_bytes=1024))
    try:
        digest = s.blobs.put(b"x" * 5000)
        conn = http.client.HTTPConnection("127.0.0.1", s.port, timeout=10)
        conn.request("GET", f"/blobs/{digest}")
        resp = conn.getresponse()
        assert resp.status == 200
        with pytest.raises(http.client.IncompleteRead):
            resp.read()
        conn.close()
        assert s.request("GET", "/healthz")[0] == 200
    finally:
        s.close()


# --- fleet, health, metrics, openapi ---------------------------------------------------------


def test_fleet_and_health(srv: Server) -> None:
    status, body = srv.json("GET", "/fleet")
    assert status == 200 and body["leader"] == "m1" and srv.control.last() == {"op": "fleet"}
    status, body = srv.json("GET", "/healthz")
    assert status == 200 and body["ok"] is True and srv.control.last() == {"op": "health"}


def test_health_503_when_control_fails(srv: Server) -> None:
    """/healthz is 503 when the control call raises."""
    def broken(r: dict) -> Answer:
        raise ControlError(503, "jobs thread gone")
    srv.control.answers["health"] = broken
    status, body = srv.json("GET", "/healthz")
    assert status == 503 and "error" in body


def test_unanswered_control_is_503(srv: Server, monkeypatch: pytest.MonkeyPatch) -> None:
    """A control future never answered gives 503 "member busy, try again" (health too)."""
    monkeypatch.setattr(limits, "ctl_commit_ms_max", 0)
    monkeypatch.setattr(mhttp, "CTL_SLACK_MS", 200)
    srv.control.hang.update({"cancel", "health"})
    status, body = srv.json("POST", "/jobs/j1/cancel")
    assert (status, body) == (503, {"error": "member busy, try again"})
    status, body = srv.json("GET", "/healthz")
    assert status == 503


def test_metrics_prometheus_text(srv: Server) -> None:
    """The member's numbers become typed, described families (meshjobs/metrics.py); the HTTP
    layer adds its counters."""
    srv.request("GET", "/jobs?state=nope")  # one bad request, counted
    status, headers, data = srv.request("GET", "/metrics")
    assert status == 200 and headers["Content-Type"].startswith("text/plain")
    text = data.decode()
    assert "# TYPE meshjobs_items_running gauge\nmeshjobs_items_running 2.0\n" in text
    assert "# TYPE meshjobs_mystery_pending gauge\nmeshjobs_mystery_pending 7.5\n" in text
    assert "# TYPE meshjobs_frames_in_total counter\n" in text
    assert 'meshjobs_frames_in_total{type="F_CTL"} 4.0\n' in text
    assert 'meshjobs_jobs{pool="default",state="running"} 1.0\n' in text or \
        'meshjobs_jobs{state="running",pool="default"} 1.0\n' in text
    assert "meshjobs_is_leader 1.0\n" in text
    assert "note" not in text
    assert 'meshjobs_http_requests_total{class="4xx"}' in text
    bad = [ln for ln in text.splitlines() if ln.startswith("meshjobs_http_bad_requests_total ")]
    assert len(bad) == 1 and float(bad[0].split()[1]) >= 1
    for line in text.splitlines():
        if not line.startswith("#"):
            float(line.rsplit(" ", 1)[1])


def test_openapi_describes_every_route(srv: Server) -> None:
    """Every route the server has is in /openapi.json with its method and path parameters."""
    status, doc = srv.json("GET", "/openapi.json")
    assert status == 200 and doc["openapi"].startswith("3.1") and doc == openapi_document()
    served = set()
    for route in srv.api.make_app().router.routes():
        if route.method in ("HEAD", "*"):  # ("*": the 405 of a route's other methods)
            continue
        path = route.resource.canonical
        served.add((path, route.method.lower()))
    documented = {(p, m) for p, ops in doc["paths"].items() for m in ops}
    assert served == documented
    for path, ops in doc["paths"].items():
        for op in ops.values():
            names = {p["name"] for p in op.get("parameters", []) if p["in"] == "path"}
            assert names == set(re.findall(r"\{(\w+)\}", path))
            assert "200" in op["responses"] or "201" in op["responses"]


def test_openapi_document_is_valid_openapi() -> None:
    """The document is valid OpenAPI 3.1 (schema and references), as a client generator needs."""
    from openapi_spec_validator import validate

    validate(openapi_document())
    broken = openapi_document()
    broken["paths"]["/jobs"]["post"]["responses"]["201"] = {"no": "description"}
    with pytest.raises(Exception, match="description"):
        validate(broken)


# --- routing, sizes, fuzz --------------------------------------------------------------------


def test_unknown_route_and_method(srv: Server) -> None:
    status, body = srv.json("GET", "/nope")
    assert status == 404 and "error" in body
    status, headers, data = srv.request("PUT", "/jobs", {"argv": ["x"]})
    assert status == 405 and "error" in json.loads(data) and "POST" in headers["Allow"]
    status, body = srv.json("PATCH", "/jobs/j1")
    assert status == 405


@pytest.fixture()
def small() -> Iterator[Server]:
    """A server whose body limit is 1000 bytes (read when the app is made)."""
    mp = pytest.MonkeyPatch()
    mp.setattr(limits, "http_body_bytes_max", 1000)
    s = Server()
    try:
        yield s
    finally:
        s.close()
        mp.undo()


def test_oversized_body_is_413(small: Server) -> None:
    """A body over http_body_bytes_max is a 413 JSON error, with or without Content-Length."""
    body = {"argv": ["cat"], "items": ["x" * 2000]}
    status, answer = small.json("POST", "/jobs", body)
    assert status == 413 and "error" in answer
    conn = http.client.HTTPConnection("127.0.0.1", small.port, timeout=10)
    chunks = [json.dumps(body).encode()[i:i + 100] for i in range(0, 2100, 100)]
    conn.request("POST", "/jobs", body=iter(chunks), encode_chunked=True,
                 headers={"Transfer-Encoding": "chunked", "Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 413 and "error" in json.loads(resp.read())
    conn.close()
    assert small.control.requests == []
    status, _ = small.json("POST", "/jobs", {"argv": ["cat"], "items": ["x" * 100]})
    assert status == 201


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=8), kids, max_size=4),
    max_leaves=12,
)

spec_like = st.fixed_dictionaries({}, optional={
    "argv": json_values | st.lists(st.text(max_size=5), max_size=3),
    "items": json_values | st.lists(st.text(max_size=5) | st.fixed_dictionaries(
        {"b64": st.text(max_size=8)}), max_size=3),
    "priority": json_values, "hold": json_values, "tags": json_values, "max_leases": json_values,
})


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=json_values | spec_like, route=st.sampled_from(["/jobs", "/jobs/j1/tone"]))
def test_fuzzed_bodies_never_500(srv: Server, body: Any, route: str) -> None:
    """Any JSON body on a route that takes one is answered 2xx or 400/413 as JSON, never 500."""
    status, answer = srv.json("POST", route, body)
    assert status in (200, 201, 400, 413), (status, answer)
    if status >= 400:
        assert isinstance(answer["error"], str)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(raw=st.binary(max_size=64))
def test_fuzzed_bytes_never_500(srv: Server, raw: bytes) -> None:
    status, answer = srv.json("POST", "/jobs", raw=raw)
    assert status in (201, 400), (status, answer)


# --- life of the server ----------------------------------------------------------------------


def test_port_in_use_is_reported() -> None:
    """A server that cannot bind still sets ready, keeps the reason and raises it."""
    first = Server()
    try:
        api = mhttp.HttpApi("127.0.0.1", first.port, RecordingControl(), MemoryBlobStore(), "m2")
        ready = threading.Event()
        with pytest.raises(OSError):
            api.run(ready)
        assert ready.is_set() and isinstance(api.error, OSError)
    finally:
        first.close()


def test_stop_is_safe_before_and_twice() -> None:
    """stop() before run() makes run() return at once; stop() twice is harmless."""
    api = mhttp.HttpApi("127.0.0.1", 0, RecordingControl(), MemoryBlobStore(), "m3")
    api.stop()
    ready = threading.Event()
    t = threading.Thread(target=api.run, args=(ready,))
    t.start()
    t.join(10)
    assert not t.is_alive() and ready.is_set()
    api.stop()


def test_server_still_healthy_after_everything(srv: Server) -> None:
    """After all the garbage above, the shared server answers /healthz 200."""
    status, body = srv.json("GET", "/healthz")
    assert status == 200 and body["ok"] is True
