"""The OpenAPI 3.1 description of a member's HTTP API, served at /openapi.json.

Rule: every route that meshjobs/http.py serves is described here with its parameters, body and
answers; tests/test_http.py checks that the two agree.
"""

from __future__ import annotations

import copy
from typing import Any

from meshjobs import limits
from meshjobs.control import ITEM_STATES, JOB_STATES

_ERROR = {"$ref": "#/components/schemas/Error"}
_JOB = {"$ref": "#/components/schemas/Job"}


def _json(schema: dict, description: str) -> dict:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _err(description: str) -> dict:
    return _json(_ERROR, description)


_JOB_ID = {
    "name": "id",
    "in": "path",
    "required": True,
    "description": "A job id.",
    "schema": {"type": "string", "pattern": f"^[A-Za-z0-9._-]{{1,{limits.job_id_chars_max}}}$"},
}
_IDEMPOTENCY_KEY = {
    "name": "Idempotency-Key",
    "in": "header",
    "required": False,
    "description": "A request id: a change retried with the same key is applied once. "
    "Without it the member makes one up (and a retry may apply twice).",
    "schema": {"type": "string", "pattern": f"^[A-Za-z0-9._:-]{{1,{limits.rid_chars_max}}}$"},
}
_BAD = _err("Bad input: broken JSON, wrong types, a bad job id; `error` says what to fix.")
_BUSY = _err("No leader, no quorum, or the member is busy: try again, or ask another member.")
_NO_JOB = _err("No such job, or it was forgotten.")
_CONFLICT = _err("The job is in a state that does not allow this change.")
_OCTETS = {"application/octet-stream": {"schema": {"type": "string", "contentMediaType":
                                                   "application/octet-stream"}}}

_SCHEMAS: dict[str, Any] = {
    "Error": {
        "type": "object",
        "required": ["error"],
        "properties": {"error": {"type": "string", "description": "What went wrong and what to do."}},
    },
    "ItemPayload": {
        "description": "One item's stdin: text (sent as UTF-8), raw bytes in base64, or a stored blob.",
        "oneOf": [
            {"type": "string"},
            {"type": "object", "required": ["b64"], "additionalProperties": False,
             "properties": {"b64": {"type": "string", "contentEncoding": "base64"}}},
            {"type": "object", "required": ["blob"], "additionalProperties": False,
             "properties": {"blob": {"$ref": "#/components/schemas/Digest"}}},
        ],
    },
    "Digest": {"type": "string", "pattern": "^[0-9a-f]{64}$",
               "description": "A blob's blake3-256 digest, lowercase hex."},
    "SubmitSpec": {
        "type": "object",
        "required": ["argv"],
        "additionalProperties": False,
        "properties": {
            "argv": {"type": "array", "minItems": 1, "maxItems": limits.argv_items_max,
                     "items": {"type": "string"}, "description": "The program and its arguments."},
            "id": {"type": ["string", "null"], "description": "The job id; made up when absent."},
            "pool": {"type": ["string", "null"], "default": "default"},
            "priority": {"type": ["integer", "null"], "minimum": -limits.priority_abs_max,
                         "maximum": limits.priority_abs_max, "default": 0},
            "retries": {"type": ["integer", "null"], "minimum": 0, "maximum": limits.retries_max,
                        "default": 0},
            "runtime_s": {"type": ["number", "null"], "exclusiveMinimum": 0,
                          "maximum": limits.runtime_s_max},
            "hold": {"type": ["boolean", "null"], "default": False},
            "tags": {"type": ["array", "null"], "maxItems": limits.tags_max,
                     "items": {"type": "string", "maxLength": limits.tag_chars_max}},
            "env": {"type": ["object", "null"], "additionalProperties": {"type": "string"}},
            "cwd": {"type": ["string", "null"], "description": "An absolute path."},
            "max_leases": {"type": ["integer", "null"], "minimum": 1,
                           "maximum": limits.max_leases_max,
                           "description": "At most this many items of the job run at once."},
            "items": {"type": ["array", "null"], "minItems": 1, "maxItems": limits.items_max,
                      "items": {"$ref": "#/components/schemas/ItemPayload"},
                      "description": "One entry per item; absent: one item with empty stdin."},
        },
    },
    "Tone": {
        "type": "object",
        "minProperties": 1,
        "additionalProperties": False,
        "properties": {
            "priority": {"type": "integer", "minimum": -limits.priority_abs_max,
                         "maximum": limits.priority_abs_max},
            "hold": {"type": "boolean"},
            "max_leases": {"type": ["integer", "null"], "minimum": 1,
                           "maximum": limits.max_leases_max,
                           "description": "null: no limit."},
        },
    },
    "Item": {
        "type": "object",
        "required": ["index", "state"],
        "properties": {
            "index": {"type": "integer"},
            "state": {"enum": list(ITEM_STATES)},
            "attempts": {"type": "integer"},
            "member": {"type": ["string", "null"]},
            "epoch": {"type": ["integer", "null"]},
            "rc": {"type": ["integer", "null"]},
            "stdout": {"oneOf": [{"$ref": "#/components/schemas/Digest"}, {"type": "null"}]},
            "stderr": {"oneOf": [{"$ref": "#/components/schemas/Digest"}, {"type": "null"}]},
            "error": {"type": ["string", "null"], "maxLength": limits.item_error_chars_max,
                      "description": "Why the item's last try failed, when the member could "
                                     "say (its program could not start, its input was "
                                     "missing); null otherwise."},
            "copies": {"type": "array", "items": {"type": "string"},
                       "description": "The members other than `member` that held a copy of "
                                      "the outputs when the result was committed."},
        },
    },
    "Job": {
        "type": "object",
        "required": ["id", "state"],
        "properties": {
            "id": {"type": "string"},
            "state": {"enum": list(JOB_STATES)},
            "priority": {"type": "integer"},
            "hold": {"type": "boolean"},
            "tags": {"type": "array", "items": {"type": "string"}},
            "pool": {"type": "string"},
            "argv": {"type": "array", "items": {"type": "string"}},
            "items_total": {"type": "integer"},
            "items_done": {"type": "integer"},
            "items_failed": {"type": "integer"},
            "submitted_at": {},
            "finished_at": {},
            "items": {"type": "array", "items": {"$ref": "#/components/schemas/Item"},
                      "description": "Only with ?items=1."},
        },
    },
    "Fleet": {
        "type": "object",
        "required": ["term", "leader", "members"],
        "properties": {
            "term": {"type": "integer"},
            "leader": {"type": ["string", "null"]},
            "members": {"type": "array", "items": {
                "type": "object", "required": ["name", "role", "alive"],
                "properties": {"name": {"type": "string"},
                               "role": {"enum": ["leader", "follower", "worker"]},
                               "alive": {"type": "boolean"}}}},
        },
    },
    "Health": {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "member": {"type": "string"},
                       "leader": {"type": ["string", "null"]}},
    },
}

_PATHS: dict[str, Any] = {
    "/jobs": {
        "get": {
            "summary": "List jobs: an HTML page, or JSON for Accept: application/json or ?format=json.",
            "operationId": "listJobs",
            "parameters": [
                {"name": "state", "in": "query", "schema": {"enum": list(JOB_STATES)}},
                {"name": "tag", "in": "query",
                 "schema": {"type": "string", "maxLength": limits.tag_chars_max}},
                {"name": "format", "in": "query", "schema": {"enum": ["json", "html"]}},
            ],
            "responses": {
                "200": {"description": "The jobs on this member's committed table.",
                        "content": {"application/json": {"schema": {"type": "array", "items": _JOB}},
                                    "text/html": {"schema": {"type": "string"}}}},
                "400": _BAD,
                "503": _BUSY,
            },
        },
        "post": {
            "summary": "Submit a job; answers once the submission is committed.",
            "operationId": "submitJob",
            "parameters": [_IDEMPOTENCY_KEY],
            "requestBody": {"required": True, "content": {"application/json": {
                "schema": {"$ref": "#/components/schemas/SubmitSpec"}}}},
            "responses": {
                "201": _json(_JOB, "The job was created."),
                "200": _json(_JOB, "The same submission was seen before (same Idempotency-Key)."),
                "400": _BAD,
                "409": _err("A job with this id exists already, or was forgotten."),
                "413": _err(f"The body is over {limits.http_body_bytes_max} bytes, or too many items."),
                "503": _BUSY,
            },
        },
    },
    "/jobs/{id}": {
        "get": {
            "summary": "A job record; with ?wait=S, answers when the job finishes or after S seconds.",
            "operationId": "getJob",
            "parameters": [
                _JOB_ID,
                {"name": "items", "in": "query", "description": "1: include the items.",
                 "schema": {"enum": ["0", "1", "true", "false"]}},
                {"name": "wait", "in": "query", "description": "Long-poll, in seconds.",
                 "schema": {"type": "number", "minimum": 0, "maximum": limits.http_wait_s_max}},
            ],
            "responses": {"200": _json(_JOB, "The job."), "400": _BAD, "404": _NO_JOB,
                          "503": _BUSY},
        },
        "delete": {
            "summary": "Forget a finished or cancelled job: it leaves the table for good.",
            "operationId": "forgetJob",
            "parameters": [_JOB_ID, _IDEMPOTENCY_KEY],
            "responses": {"200": _json(_JOB, "The job, as it was forgotten."), "400": _BAD,
                          "404": _NO_JOB, "409": _CONFLICT, "503": _BUSY},
        },
    },
    "/jobs/{id}/results": {
        "get": {
            "summary": "The items' stdout (or stderr) in item order, one stream.",
            "operationId": "jobResults",
            "parameters": [_JOB_ID, {"name": "stream", "in": "query",
                                     "schema": {"enum": ["stdout", "stderr"], "default": "stdout"}}],
            "responses": {"200": {"description": "The bytes.", "content": _OCTETS},
                          "400": _BAD, "404": _NO_JOB,
                          "500": _err("A blob is damaged on this member."),
                          "503": _err("A blob is not on this member yet, or the member is busy.")},
        },
    },
    "/jobs/{id}/cancel": {
        "post": {
            "summary": "Cancel a job: pending items will not run, running ones are cut.",
            "operationId": "cancelJob",
            "parameters": [_JOB_ID, _IDEMPOTENCY_KEY],
            "responses": {"200": _json(_JOB, "The job."), "400": _BAD, "404": _NO_JOB,
                          "409": _CONFLICT, "503": _BUSY},
        },
    },
    "/jobs/{id}/tone": {
        "post": {
            "summary": "Change a job's priority, hold, or most leases at once.",
            "operationId": "toneJob",
            "parameters": [_JOB_ID, _IDEMPOTENCY_KEY],
            "requestBody": {"required": True, "content": {"application/json": {
                "schema": {"$ref": "#/components/schemas/Tone"}}}},
            "responses": {"200": _json(_JOB, "The job."), "400": _BAD, "404": _NO_JOB,
                          "409": _CONFLICT, "503": _BUSY},
        },
    },
    "/blobs/{digest}": {
        "get": {
            "summary": "A blob's bytes.",
            "operationId": "getBlob",
            "parameters": [{"name": "digest", "in": "path", "required": True,
                            "schema": {"$ref": "#/components/schemas/Digest"}}],
            "responses": {"200": {"description": "The bytes.", "content": _OCTETS},
                          "400": _BAD, "404": _err("No such blob on this member."),
                          "500": _err("The blob is damaged on this member.")},
        },
    },
    "/fleet": {
        "get": {
            "summary": "The fleet as this member sees it: term, leader, members.",
            "operationId": "fleet",
            "responses": {"200": _json({"$ref": "#/components/schemas/Fleet"}, "The fleet."),
                          "503": _BUSY},
        },
    },
    "/healthz": {
        "get": {
            "summary": "Whether this member answers (and, with fresh=1, whether its reads are fresh).",
            "operationId": "health",
            "parameters": [{"name": "fresh", "in": "query", "required": False,
                            "schema": {"type": "string", "enum": ["0", "1"]},
                            "description": "1: answer 503 when this member is cut off from the "
                                           "leader, so that its reads may be stale."}],
            "responses": {"200": _json({"$ref": "#/components/schemas/Health"}, "Healthy."),
                          "503": _err("The member does not answer in time, or (fresh=1) it is "
                                      "cut off from the leader.")},
        },
    },
    "/metrics": {
        "get": {
            "summary": "Metrics in the Prometheus text format.",
            "operationId": "metrics",
            "responses": {"200": {"description": "Gauges and counters.",
                                  "content": {"text/plain": {"schema": {"type": "string"}}}},
                          "503": _BUSY},
        },
    },
    "/openapi.json": {
        "get": {
            "summary": "This document.",
            "operationId": "openapi",
            "responses": {"200": {"description": "OpenAPI 3.1.",
                                  "content": {"application/json": {"schema": {"type": "object"}}}}},
        },
    },
}

_COMMON = {
    "404": _err("No such route."),
    "405": _err("The route does not take this method."),
}


def openapi_document() -> dict[str, Any]:
    """The OpenAPI 3.1 document, a fresh copy each call (callers may change it)."""
    paths = copy.deepcopy(_PATHS)
    for ops in paths.values():
        for op in ops.values():
            for status, resp in _COMMON.items():
                op["responses"].setdefault(status, resp)
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "meshjobs",
            "version": "0.1.0",
            "description": "The HTTP API of a meshjobs member (meshd). Reads are answered from "
            "the member's committed table; changes are forwarded to the leader and answered "
            "once committed. Every error is JSON: {\"error\": \"...\"}.",
        },
        "paths": paths,
        "components": {"schemas": copy.deepcopy(_SCHEMAS)},
    }
