"""Reads of one item, a page of items and all items' outputs cost the jobs thread what they
return, not what the job holds (node/reads.py; issue 25, point 7): the control ops `item`,
`items` and `outputs`, on the job node and through a real meshd (item output, follow, results
and the job page of a big array job), and the count of item records the jobs thread built
(`meshjobs_node_item_records_built_total`) that says so from outside."""

from __future__ import annotations

import http.client
import urllib.parse

import pytest

from meshjobs import limits
from meshjobs.control import ControlError, parse_request
from tests.helpers import DIGEST_OUT, Fleet1, wait_until

BIG = 100_000


def built(m) -> float:
    return m.metrics().get("meshjobs_node_item_records_built_total", -1.0)


# --- the job node -----------------------------------------------------------------------------


def _node_with_job(n: int) -> Fleet1:
    f = Fleet1()
    f.ctl(1, {"op": "submit", "rid": "r1", "spec": {"argv": ["echo"], "id": "j1", "hold": True},
              "items": [None] * n})
    f.settle()
    assert f.answer(1).status == 201
    return f


def test_item_op_answers_one_record_and_builds_only_it():
    """`item` answers item N's record, the same as the whole record's item N, and the node
    builds that one record (a `get` with items builds every one)."""
    f = _node_with_job(5_000)
    f.ctl(2, {"op": "item", "id": "j1", "index": 4_321})
    f.take()
    ans = f.answer(2)
    assert ans.status == 200
    assert ans.body == f.table.item_record(f.table.jobs["j1"], 4_321)
    assert ans.body["index"] == 4_321 and ans.body["state"] == "pending"
    assert f.node.counts["item_records_built"] == 1
    f.ctl(3, {"op": "get", "id": "j1", "items": True, "wait_ms": 0})
    f.take()
    assert f.node.counts["item_records_built"] == 1 + 5_000


def test_item_op_out_of_range_and_unknown_job():
    f = _node_with_job(3)
    f.ctl(2, {"op": "item", "id": "j1", "index": 3})
    f.ctl(3, {"op": "item", "id": "nope", "index": 0})
    f.take()
    assert f.answer(2).status == 404
    assert f.answer(2).body["error"] == "job j1 has 3 items, numbered from 0: no item 3"
    assert f.answer(3).status == 404 and "no job nope" in f.answer(3).body["error"]


def test_items_op_pages_and_finds_the_first_failed():
    """`items` answers the job's record with one page of item records and its first failed
    ones (found in the state bytes), building those and no others."""
    f = Fleet1(slots=8)
    f.ctl(1, {"op": "submit", "rid": "r1", "spec": {"argv": ["echo"], "id": "j1"},
              "items": [None] * 8})
    f.settle()
    for run in f.runs[:8]:
        f.end(run, state="failed" if run.index in (2, 5, 7) else "done",
              rc=1 if run.index in (2, 5, 7) else 0)
    f.settle()
    job = f.table.jobs["j1"]
    assert job.n_failed == 3
    before = f.node.counts.get("item_records_built", 0)
    f.ctl(2, {"op": "items", "id": "j1", "from": 3, "limit": 4, "failed": 2})
    f.take()
    body = f.answer(2).body
    assert [it["index"] for it in body["items"]] == [3, 4, 5, 6]
    assert [it["index"] for it in body["failed_items"]] == [2, 5]
    assert body["items_from"] == 3 and body["items_total"] == 8 and body["items_failed"] == 3
    assert body["failed_items"][0]["rc"] == 1
    assert f.node.counts["item_records_built"] - before == 6
    f.ctl(3, {"op": "outputs", "id": "j1", "stream": "stdout", "from": 6, "limit": 100})
    f.take()
    out = f.answer(3).body
    assert out["n"] == 8 and out["from"] == 6
    assert out["digests"] == [bytes.fromhex(DIGEST_OUT)] * 2
    f.ctl(4, {"op": "outputs", "id": "j1", "stream": "stderr", "from": 8, "limit": 1})
    f.take()
    assert f.answer(4).body["digests"] == []


@pytest.mark.parametrize("req,words", [
    ({"op": "item", "id": "j1"}, "index must be an integer"),
    ({"op": "item", "id": "j1", "index": -1}, "index must be between 0"),
    ({"op": "item", "id": "j1", "index": limits.items_max}, "index must be between 0"),
    ({"op": "item", "id": "j1", "index": 10**30}, "index must be between 0"),
    ({"op": "item", "id": "j1", "index": "0"}, "index must be an integer"),
    ({"op": "item", "id": "j1", "index": 1.5}, "index must be an integer"),
    ({"op": "item", "id": "j1", "index": True}, "index must be an integer"),
    ({"op": "item", "id": ["j1"], "index": 0}, "id"),
    ({"op": "item", "id": "x" * 10_000, "index": 0}, "id"),
    ({"op": "items", "id": "j1", "from": 0}, "limit must be an integer"),
    ({"op": "items", "id": "j1", "from": 0, "limit": 0}, "limit must be between 1"),
    ({"op": "items", "id": "j1", "from": 0, "limit": limits.items_page_max + 1},
     "limit must be between 1"),
    ({"op": "items", "id": "j1", "from": -5, "limit": 1}, "from must be between 0"),
    ({"op": "items", "id": "j1", "limit": 1, "failed": -1}, "failed must be between 0"),
    ({"op": "items", "id": "j1", "limit": 1, "failed": None}, "failed must be an integer"),
    ({"op": "outputs", "id": "j1", "limit": 1}, "stream must be stdout or stderr"),
    ({"op": "outputs", "id": "j1", "stream": "/etc/passwd", "limit": 1}, "stream must be"),
    ({"op": "outputs", "id": "j1", "stream": "stdout", "limit": limits.results_slice_max + 1},
     "limit must be between 1"),
    ({"op": "outputs", "id": "j1", "stream": "stdout", "from": "0", "limit": 1},
     "from must be an integer"),
])
def test_item_reads_refuse_bad_requests(req, words):
    with pytest.raises(ControlError) as e:
        parse_request(req)
    assert e.value.status == 400 and words in e.value.message
    f = _node_with_job(2)
    f.ctl(9, req)
    f.take()
    assert f.answer(9).status == 400


def test_a_follower_asks_the_leader_for_an_item_of_a_job_it_does_not_know_yet():
    """As for `get`: a member that does not lead asks the leader (F_CTL) before it says no."""
    from meshjobs.node import Ctl, Send, Tick
    from tests.helpers import worker_node

    node = worker_node(1_700_000_000_000)
    node.step(Ctl(5, {"op": "item", "id": "later", "index": 7}))
    node.step(Tick(1_700_000_000_001))
    asks = [e for e in node.take() if isinstance(e, Send) and e.ftype == "F_CTL"]
    assert [(a.to, a.body["req"]) for a in asks] == [
        ("v1", {"op": "item", "id": "later", "index": 7})]


# --- a real meshd -----------------------------------------------------------------------------


def _get(m, path: str, accept: str = "application/json") -> tuple[int, bytes]:
    u = urllib.parse.urlsplit(m.url)
    c = http.client.HTTPConnection(u.hostname, u.port, timeout=120)
    try:
        c.request("GET", path, headers={"Accept": accept})
        r = c.getresponse()
        return r.status, r.read()
    finally:
        c.close()


def test_reads_of_a_big_held_job_build_what_they_return(meshd):
    """A held job of 100,000 items: its item output (409: not started, with and without
    follow), its results (nothing yet) and its job page (one page of items, the counts) make
    the jobs thread build a handful of item records, not 100,000 for each read."""
    status, rec = meshd.request("POST", "/jobs", {"argv": ["true"], "hold": True, "id": "big",
                                                  "items": [""] * BIG}, timeout_s=120)
    assert status == 201, rec
    b0 = built(meshd)
    assert b0 >= 0, "the member counts the item records its jobs thread builds"
    status, body = _get(meshd, f"/jobs/big/items/{BIG - 1}/stdout")
    assert status == 409 and b"has not started yet" in body
    status, body = _get(meshd, f"/jobs/big/items/{BIG}/stdout")
    assert status == 404 and f"job big has {BIG} items, numbered from 0: no item {BIG}".encode() in body
    status, body = _get(meshd, "/jobs/big/results")
    assert (status, body) == (200, b"")
    status, page = _get(meshd, "/jobs/big", accept="text/html")
    assert status == 200
    text = page.decode()
    assert text.count('<td class="state pending">') == limits.webui_items_shown_max
    assert f"items 0–{limits.webui_items_shown_max - 1} of {BIG}" in text
    assert f"0 done, 0 failed, 0 running, {BIG} pending, {BIG} total" in text
    status, page = _get(meshd, f"/jobs/big?format=html&items_from={BIG - 3}&item={BIG - 1}")
    assert status == 200 and page.decode().count('<td class="state pending">') == 3
    assert f"items {BIG - 3}–{BIG - 1} of {BIG}" in page.decode()
    assert "Output of item 99999" in page.decode()
    status, page = _get(meshd, f"/jobs/big?format=html&item={BIG}")
    assert status == 404
    # A follow of a held item looks at it every log_poll_ms: a record each time, no more.
    u = urllib.parse.urlsplit(meshd.url)
    c = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
    c.request("GET", "/jobs/big/items/0/stdout?follow=1")
    b1 = built(meshd)
    wait_until(lambda: built(meshd) >= b1 + 3, what="the follow to look at its item again")
    c.close()
    spent = built(meshd) - b0
    # 1 + 1 + 0 + (200 + 0) + (3 + 0 + 1) + the follow's few: far from 100,000 a read.
    assert spent < 2 * limits.webui_items_shown_max + 100, spent


def test_item_output_follow_results_and_page_give_the_right_bytes(meshd):
    """An array job that ran: each item's output, its results in item order, exact and whole,
    the job page listing a page of them; a follow of a running item gets every byte."""
    n = 250
    status, rec = meshd.request("POST", "/jobs", {
        "argv": ["sh", "-c", 'echo "item $MESH_ITEM_INDEX"; echo "e$MESH_ITEM_INDEX" >&2'],
        "id": "arr", "items": [""] * n})
    assert status == 201, rec
    done = meshd.wait_job("arr", timeout_s=300)
    assert done["state"] == "done" and done["items_done"] == n
    for i in (0, 137, n - 1):
        status, body = _get(meshd, f"/jobs/arr/items/{i}/stdout")
        assert (status, body) == (200, f"item {i}\n".encode())
        status, body = _get(meshd, f"/jobs/arr/items/{i}/stderr?follow=1")
        assert (status, body) == (200, f"e{i}\n".encode())
    status, body = _get(meshd, "/jobs/arr/results")
    assert (status, body) == (200, "".join(f"item {i}\n" for i in range(n)).encode())
    status, body = _get(meshd, "/jobs/arr/results?stream=stderr")
    assert (status, body) == (200, "".join(f"e{i}\n" for i in range(n)).encode())
    status, body = _get(meshd, "/jobs/arr/results?stream=nope")
    assert status == 400
    status, page = _get(meshd, "/jobs/arr?format=html&items_from=200")
    text = page.decode()
    assert status == 200 and text.count('<td class="state done">') == n - 200
    assert f"items 200–{n - 1} of {n}" in text and "earlier items" in text
    status, rec = meshd.request("POST", "/jobs", {
        "argv": ["sh", "-c", "echo one; sleep 1; echo two"], "id": "live", "items": [""]})
    assert status == 201, rec
    status, body = _get(meshd, "/jobs/live/items/0/stdout?follow=1")
    assert (status, body) == (200, b"one\ntwo\n")
