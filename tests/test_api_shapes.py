"""A real member's answers are what /openapi.json says they are.

The schemas of the document are generated from the typed models (meshjobs/apimodels/); here
a real meshd's answers to the main routes (submit, get, list, cancel, tone, rerun, forget, fleet,
health, errors) are validated against the schema the document gives for that route and status.
An answer that grows a key the models lack, or loses one they require, fails here.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
from jsonschema import Draft202012Validator

from meshjobs import apimodels
from meshjobs.openapi import openapi_document

DOC = openapi_document()


def documented(path: str, method: str, status: int) -> dict:
    """The schema of the JSON answer the document gives for a route and status."""
    op = DOC["paths"][path][method]
    answer = op["responses"][str(status)]
    return answer["content"]["application/json"]["schema"]


def check(schema: dict, body: Any) -> None:
    """Validate `body` against `schema`, its references resolved in the document."""
    whole = {**copy.deepcopy(schema), "components": DOC["components"]}
    Draft202012Validator.check_schema(whole)
    errors = sorted(Draft202012Validator(whole).iter_errors(body), key=str)
    assert not errors, "\n".join(f"{list(e.absolute_path)}: {e.message}" for e in errors[:10])


def answer(meshd, method: str, path: str, doc_path: str, status: int, body: Any = None) -> Any:
    """One request to the member: its status must be `status`, its body the documented one."""
    got, data = meshd.request(method, path, body)
    assert got == status, (method, path, got, data)
    check(documented(doc_path, method.lower(), status), data)
    return data


@pytest.mark.fleet
def test_real_answers_match_the_document(meshd):
    """Rule: every main route's answer from a real meshd validates against the schema the
    OpenAPI document gives for it (generated from meshjobs/apimodels/), including the keys
    that only some jobs have (names, after, member selector, restarts, output paths)."""
    plain = answer(meshd, "POST", "/jobs", "/jobs", 201,
                   {"id": "plain", "argv": ["true"], "tags": ["t"], "env": {"A": "1"}})
    assert plain["id"] == "plain"
    rich = answer(meshd, "POST", "/jobs", "/jobs", 201, {
        "id": "rich", "argv": ["cat"], "items": ["a", {"b64": "Yg=="}], "names": ["a", "b"],
        "after": ["plain", {"id": "plain", "on": "end"}][:1], "member": "m1",
        "pool": "default", "priority": 3, "retries": 1, "runtime_s": 60, "max_leases": 2,
        "restart": 1, "restart_delay_s": 1, "stdout": "/dev/null", "cwd": "/",
        "notify": "http://hooks.example.org:9/hook", "inherit_env": False, "hold": False})
    assert rich["after"] == [{"id": "plain", "on": "ok"}]
    # The same submit again under one Idempotency-Key: the same record.
    for _ in range(2):
        got, again = meshd.request("POST", "/jobs", {"id": "k1", "argv": ["true"]},
                                   headers={"Idempotency-Key": "key-1"})
        assert got in (200, 201) and again["id"] == "k1"
        check(documented("/jobs", "post", got), again)

    for job_id in ("plain", "rich", "k1"):
        meshd.wait_job(job_id)
    done = answer(meshd, "GET", "/jobs/rich?items=1", "/jobs/{id}", 200)
    assert len(done["items"]) == 2 and done["names"] == ["a", "b"]
    answer(meshd, "GET", "/jobs/plain", "/jobs/{id}", 200)
    listed = answer(meshd, "GET", "/jobs?format=json", "/jobs", 200)
    assert {j["id"] for j in listed} >= {"plain", "rich", "k1"}

    answer(meshd, "POST", "/jobs", "/jobs", 201, {"id": "long", "argv": ["sleep", "60"]})
    answer(meshd, "POST", "/jobs/long/tone", "/jobs/{id}/tone", 200, {"priority": 5})
    cancelled = answer(meshd, "POST", "/jobs/long/cancel", "/jobs/{id}/cancel", 200)
    assert cancelled["id"] == "long"
    answer(meshd, "POST", "/jobs/plain/rerun", "/jobs/{id}/rerun", 200, {"failed_only": False})
    meshd.wait_job("plain")
    answer(meshd, "GET", "/jobs/plain?items=1", "/jobs/{id}", 200)
    forgotten = answer(meshd, "DELETE", "/jobs/k1", "/jobs/{id}", 200)
    assert forgotten == {"id": "k1", "forgotten": True}

    answer(meshd, "GET", "/fleet", "/fleet", 200)
    answer(meshd, "GET", "/healthz", "/healthz", 200)

    # Errors: each is the documented {"error": ...}.
    answer(meshd, "GET", "/jobs/nope", "/jobs/{id}", 404)
    answer(meshd, "DELETE", "/jobs/nope", "/jobs/{id}", 404)
    answer(meshd, "POST", "/jobs/nope/cancel", "/jobs/{id}/cancel", 404)
    answer(meshd, "POST", "/jobs", "/jobs", 400, {"argv": []})
    answer(meshd, "POST", "/jobs", "/jobs", 409, {"id": "plain", "argv": ["true"]})
    answer(meshd, "GET", "/jobs?state=nope", "/jobs", 400)


@pytest.mark.fleet
def test_real_answers_of_the_other_routes_match_the_document(meshd):
    """Rule: the answers of many jobs at once, pools, members, schedules, history and logout
    validate against the schemas the document gives for them."""
    answer(meshd, "POST", "/jobs", "/jobs", 201, {"id": "a", "argv": ["true"], "tags": ["x"]})
    meshd.wait_job("a")
    answer(meshd, "GET", "/pools", "/pools", 200)
    for action, body in (("hold", {}), ("release", {"member": "m1"}), ("drain", None),
                         ("undrain", {})):
        answer(meshd, "POST", f"/pools/default/{action}", f"/pools/{{pool}}/{action}", 200,
               body)
    answer(meshd, "POST", "/pools/default/slots", "/pools/{pool}/slots", 200, {"slots": 3})
    answer(meshd, "POST", "/pools/default/slots", "/pools/{pool}/slots", 200, {"slots": None})
    answer(meshd, "GET", "/pools", "/pools", 200)
    for action in ("drain", "undrain"):
        answer(meshd, "POST", f"/members/m1/{action}", f"/members/{{name}}/{action}", 200, {})
    answer(meshd, "POST", "/jobs/status", "/jobs/status", 200, {"ids": ["a", "zz"]})
    answer(meshd, "POST", "/jobs/cancel", "/jobs/cancel", 200,
           {"filter": {"tag": "x"}, "dry_run": True})
    answer(meshd, "POST", "/jobs/tone", "/jobs/tone", 200,
           {"ids": ["a"], "set": {"priority": 2}})
    answer(meshd, "POST", "/jobs/forget", "/jobs/forget", 200, {"ids": ["a"]})
    history = answer(meshd, "GET", "/history", "/history", 200)
    assert history["records"][0]["job"]["id"] == "a"
    spec = {"spec": "@every 30s", "job": {"argv": ["true"]}, "overlap": "skip"}
    answer(meshd, "PUT", "/cron/c1", "/cron/{name}", 201, spec)
    answer(meshd, "GET", "/cron", "/cron", 200)
    answer(meshd, "GET", "/cron/c1", "/cron/{name}", 200)
    answer(meshd, "POST", "/cron/c1/pause", "/cron/{name}/pause", 200)
    answer(meshd, "POST", "/cron/c1/resume", "/cron/{name}/resume", 200)
    answer(meshd, "DELETE", "/cron/c1", "/cron/{name}", 200)
    answer(meshd, "GET", "/cron/c1", "/cron/{name}", 404)
    answer(meshd, "POST", "/logout", "/logout", 200)
    blob = answer(meshd, "GET", "/blobs/" + "0" * 64 + "?check=1", "/blobs/{digest}", 404)
    assert "error" in blob


def test_an_answer_with_a_key_the_models_lack_is_refused():
    """Rule: the answer schemas forbid keys they do not name, and require the keys every record
    has, so an answer that drifts from the models fails the test above."""
    record = {"id": "j", "state": "done", "version": 1, "priority": 0, "hold": False,
              "tags": [], "pool": "default", "argv": ["true"], "env": {}, "cwd": None,
              "user": None, "inherit_env": False, "retries": 0, "runtime_s": None,
              "max_leases": None, "items_total": 1, "items_done": 1, "items_failed": 0,
              "items_cancelled": 0, "items_running": 0, "items_pending": 0,
              "submitted_at": 1.0, "finished_at": 2.0}
    job = {"$ref": "#/components/schemas/Job"}
    check(job, record)
    with pytest.raises(AssertionError, match="surprise"):
        check(job, {**record, "surprise": 1})
    with pytest.raises(AssertionError, match="items_pending"):
        check(job, {k: v for k, v in record.items() if k != "items_pending"})
    with pytest.raises(AssertionError, match="forgotten"):
        check(documented("/jobs/{id}", "delete", 200), {"id": "j"})
    with pytest.raises(AssertionError):
        check(documented("/jobs/{id}", "delete", 200), record)


def test_the_document_schemas_are_the_models():
    """The components of /openapi.json that the models describe are generated from them."""
    generated = apimodels.schemas()
    for name, schema in generated.items():
        assert DOC["components"]["schemas"][name] == schema, name
    assert {"Job", "Item", "SubmitSpec", "Forgotten", "Error", "Fleet", "Health", "BulkAnswer",
            "Pools", "History", "Cron"} <= set(generated)


def test_every_body_schema_is_a_model():
    """Every request and JSON answer body of the document is a reference to a model's schema
    (or a list of them), none written by hand in the paths."""
    def refs_only(schema: dict, where: str) -> None:
        if schema.get("type") == "array":
            schema = schema["items"]
        assert set(schema) == {"$ref"} or schema.get("type") in ("string", "object"), where
        if "$ref" not in schema:
            assert "properties" not in schema, where

    for path, ops in DOC["paths"].items():
        for method, op in ops.items():
            for ctype, media in op.get("requestBody", {}).get("content", {}).items():
                refs_only(media["schema"], f"{method} {path} body {ctype}")
            for status, resp in op["responses"].items():
                media = resp.get("content", {}).get("application/json")
                if media is not None:
                    refs_only(media["schema"], f"{method} {path} {status}")


# --- what the document allows, the server takes -------------------------------------------------

def _body_ok(path: str, method: str, body: Any) -> bool:
    """Whether the document allows `body` as the request body of a route."""
    op = DOC["paths"][path][method]
    schema = op["requestBody"]["content"]["application/json"]["schema"]
    whole = {**copy.deepcopy(schema), "components": DOC["components"]}
    return Draft202012Validator(whole).is_valid(body)


def _query_ok(path: str, name: str, value: str, as_number: bool) -> bool:
    """Whether the document allows `value` for a query parameter (a number when `as_number`)."""
    params = {p["name"]: p for p in DOC["paths"][path]["get"]["parameters"]}
    v: Any = float(value) if as_number else value
    return Draft202012Validator(params[name]["schema"]).is_valid(v)


# (route, method, body): bodies on both sides of what the server takes; each must be refused
# 400 by the server exactly when the document refuses it.
_BODIES = [
    ("/jobs", {"argv": [""]}),
    ("/jobs", {"argv": ["true", ""], "hold": True}),
    ("/jobs", {"argv": ["true"], "pool": "bad pool"}),
    ("/jobs", {"argv": ["true"], "pool": ""}),
    ("/jobs", {"argv": ["true"], "pool": "default@m?", "hold": True}),
    ("/jobs", {"argv": ["true"], "tags": [""]}),
    ("/jobs", {"argv": ["true"], "tags": ["a b"], "hold": True}),
    ("/jobs", {"argv": ["true"], "id": "status"}),
    ("/jobs", {"argv": ["true"], "id": "tone"}),
    ("/jobs", {"argv": ["true"], "id": "a b"}),
    ("/jobs", {"argv": ["true"], "priority": 2.0, "hold": True}),
    ("/jobs", {"argv": ["true"], "priority": 2.5}),
    ("/jobs/tone", {"ids": ["p1"], "filter": {"state": "held"}, "set": {"priority": 1}}),
    ("/jobs/tone", {"ids": ["p1"], "set": {"priority": 1.0}}),
    ("/jobs/tone", {"ids": ["p1"], "set": {"priority": 10 ** 9}}),
    ("/jobs/status", {"ids": ["p1"], "after": "12"}),
    ("/jobs/status", {"ids": ["bad id"]}),
    ("/jobs/status", {"filter": {"pool": "bad pool"}}),
    ("/jobs/status", {"filter": {"member": "m*"}}),
    ("/jobs/status", {"filter": {"pool": "default", "member": "m1"}}),
    ("/jobs/status", {}),
    ("/jobs/p1/tone", {"priority": 3.0}),
]


@pytest.mark.fleet
def test_the_server_refuses_exactly_the_bodies_the_document_refuses(meshd):
    """Rule: a request body the document allows is never a 400, and one it refuses is (the
    document's patterns are the parsers': empty argv[0], pool and member names, tags, ids that
    are route words, ids with a filter, a cursor with ids, whole-number floats)."""
    assert meshd.request("POST", "/jobs", {"id": "p1", "argv": ["true"], "hold": True})[0] == 201
    wrong = []
    for path, body in _BODIES:
        doc_path = "/jobs/{id}/tone" if path == "/jobs/p1/tone" else path
        allowed = _body_ok(doc_path, "post", body)
        status, answer = meshd.request("POST", path, body)
        if allowed == (status == 400):
            wrong.append((path, body, allowed, status, answer))
    assert not wrong, wrong
    cron = {"spec": "", "job": {"argv": ["true"]}}
    assert not _body_ok("/cron/{name}", "put", cron)
    assert meshd.request("PUT", "/cron/c1", cron)[0] == 400
    assert _body_ok("/cron/{name}", "put", {**cron, "spec": "@daily"})


@pytest.mark.fleet
def test_query_values_the_document_refuses_are_400(meshd):
    """GET /healthz?fresh= takes 0 or 1 only; /history?since= a time before the year 10000."""
    for value in ("AAA", "", "2", "true"):
        assert not _query_ok("/healthz", "fresh", value, False)
        status, answer = meshd.request("GET", f"/healthz?fresh={value}")
        assert status == 400 and "fresh must be 0 or 1" in answer["error"], (value, answer)
    for value in ("0", "1"):
        assert meshd.request("GET", f"/healthz?fresh={value}")[0] == 200
    for value, ok in (("5.68e307", False), ("1767225600", True), ("0", True)):
        assert _query_ok("/history", "since", value, True) == ok
        assert (meshd.request("GET", f"/history?since={value}")[0] == 200) == ok, value


@pytest.mark.fleet
def test_a_replayed_change_is_answered_as_the_first_time(meshd):
    """The same Idempotency-Key again: the same status and the same documented shape (a pool
    order's answer has no key the document lacks; a submit is 201 again and makes nothing)."""
    for path, doc_path in (("/pools/default/hold", "/pools/{pool}/hold"),
                           ("/pools/default/release", "/pools/{pool}/release")):
        key = {"Idempotency-Key": f"k-{path.rsplit('/', 1)[1]}"}
        first = meshd.request("POST", path, {}, headers=key)
        again = meshd.request("POST", path, {}, headers=key)
        assert first == again, (first, again)
        check(documented(doc_path, "post", 200), again[1])
    key = {"Idempotency-Key": "k-submit"}
    first = meshd.request("POST", "/jobs", {"argv": ["true"], "hold": True}, headers=key)
    again = meshd.request("POST", "/jobs", {"argv": ["true"], "hold": True}, headers=key)
    assert first[0] == again[0] == 201 and first[1]["id"] == again[1]["id"], (first, again)
    check(documented("/jobs", "post", 201), again[1])
    assert len(meshd.request("GET", "/jobs")[1]) == 1
    same = {"id": "same", "argv": ["true"], "hold": True}
    assert meshd.request("POST", "/jobs", same)[0] == 201
    status, body = meshd.request("POST", "/jobs", same)
    assert status == 200, body
    check(documented("/jobs", "post", 200), body)


def _sample(path: str) -> str:
    return (path.replace("{id}", "j1").replace("{n}", "0").replace("{pool}", "default")
            .replace("{name}", "m1").replace("{digest}", "0" * 64))


@pytest.mark.fleet
def test_a_method_a_route_lacks_is_405_listing_the_routes_own(meshd):
    """Every route of the document, asked with a method it does not take: 405, and its Allow
    lists the document's methods for that path (HEAD beside GET), never another route's."""
    wrong = []
    for path, ops in DOC["paths"].items():
        methods = {m.upper() for m in ops}
        other = next(m for m in ("PATCH", "PUT", "DELETE", "POST") if m not in methods)
        status, headers, _data = meshd.raw_request(other, _sample(path), b"{}",
                                                   {"Content-Type": "application/json"})
        allow = {m.strip() for m in headers.get("Allow", "").split(",") if m.strip()}
        if status != 405 or allow - {"HEAD"} != methods:
            wrong.append((other, path, status, sorted(allow), sorted(methods)))
    assert not wrong, wrong
    status, headers, _data = meshd.raw_request("GET", "/jobs/cancel")
    assert status == 405 and headers["Allow"] == "POST"
