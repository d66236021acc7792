"""The OpenAPI 3.1 description of a member's HTTP API, served at /openapi.json.

Rule: every route that meshjobs/http.py serves is described here with its parameters, body and
answers; tests/test_http.py checks that the two agree. The paths and operations are written
here; the schemas of the main bodies (jobs, items, specs, errors, the fleet) are generated from
the typed models of meshjobs/apimodels/, and tests/test_api_shapes.py checks a real member's
answers against them.
"""

from __future__ import annotations

import copy
import functools
from typing import Any

from meshjobs import apimodels as api
from meshjobs import limits
from meshjobs.control import JOB_STATES

_ERROR = api.ref(api.Error)
_JOB = api.ref(api.Job)


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
    "description": "A request id: a change retried with the same key is applied once, and "
    "answered with the status and shape of its first answer. "
    "Without it the member makes one up (and a retry may apply twice).",
    "schema": {"type": "string", "pattern": f"^[A-Za-z0-9._:-]{{1,{limits.rid_chars_max}}}$"},
}
_BAD = _err("Bad input: broken JSON, wrong types, a bad job id; `error` says what to fix.")
_BUSY = _err("No leader, no quorum, or the member is busy: try again, or ask another member.")
_NO_JOB = _err("No such job, or it was forgotten.")
_CONFLICT = _err("The job is in a state that does not allow this change.")
_UNAUTHORIZED = _err("No token, or a token that is none of this member's (with [auth]): set "
                     "MESHJOBS_TOKEN or meshctl --token-file, send `Authorization: Bearer TOKEN`, "
                     "or log in at /login. The answer has `WWW-Authenticate: Bearer`; a browser "
                     "asking for HTML is sent to /login (303) instead.")
_FORBIDDEN = _err("Refused: the caller's role is too small (the message names the role needed "
                  "and the token's name), or a change from a browser came from another origin or "
                  "site, or lacks the X-Meshjobs-Csrf header of this member's pages.")
_MISDIRECTED = _err("The Host header names a host this member does not answer to (DNS rebinding "
                    "defence): add the name to the config's [http] names.")
_NOT_JSON = _err("A body whose Content-Type is not application/json.")
_OCTETS = {"application/octet-stream": {"schema": {"type": "string", "contentMediaType":
                                                   "application/octet-stream"}}}

# The schemas of the bodies are generated from the typed models (meshjobs/apimodels/), once,
# when the document is first asked for (it takes a moment: not at every import of http.py).
_schemas = functools.cache(api.schemas)

_PATHS: dict[str, Any] = {
    "/jobs": {
        "get": {
            "summary": "List jobs: an HTML page, or JSON for Accept: application/json or ?format=json.",
            "operationId": "listJobs",
            "parameters": [
                {"name": "state", "in": "query", "schema": {"enum": list(JOB_STATES)}},
                {"name": "tag", "in": "query",
                 "schema": {"type": "string", "maxLength": limits.tag_chars_max}},
                {"name": "pool", "in": "query", "description": "Only the jobs of this pool.",
                 "schema": {"type": "string", "maxLength": limits.pool_chars_max}},
                {"name": "format", "in": "query", "schema": {"enum": ["json", "html"]}},
                {"name": "limit", "in": "query", "description": "At most this many jobs, newest "
                 f"first (default {limits.jobs_list_default}).",
                 "schema": {"type": "integer", "minimum": 1, "maximum": limits.jobs_list_max}},
                {"name": "after", "in": "query", "description": "The next page: the cursor of "
                 "the page before's X-Meshjobs-Next header (opaque).",
                 "schema": {"type": "string", "maxLength": limits.jobs_cursor_chars_max}},
            ],
            "responses": {
                "200": {"description": "A page of the jobs on this member's committed table, "
                                       "newest first. X-Meshjobs-Next (and a Link rel=next) "
                                       "carry the cursor of the next page when there is one; "
                                       "X-Meshjobs-Fresh says whether that table follows a "
                                       "leader the member hears (false: cut off from the "
                                       "leader, or entries it knows of still on their way; "
                                       "the list may be behind).",
                        "headers": {"X-Meshjobs-Next": {"schema": {"type": "string"}},
                                    "X-Meshjobs-Fresh": {"schema": {"enum": ["true", "false"]}}},
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
                "schema": api.ref(api.SubmitSpec)}}},
            "responses": {
                "201": _json(_JOB, "The job was created; a retry with the same Idempotency-Key "
                             "gets this answer again (the job as it is now), and makes nothing."),
                "200": _json(_JOB, "A job with this id and the same spec exists already "
                             "(submitted before without this Idempotency-Key): nothing was "
                             "made."),
                "400": _BAD,
                "409": _err("A job with this id exists already, or was forgotten."),
                "413": _err(f"The body is over {limits.http_body_bytes_max} bytes, or too many items."),
                "503": _BUSY,
            },
        },
    },
    "/jobs/{id}": {
        "get": {
            "summary": "A job record; with ?wait=S, answers when the job finishes or after S "
                       "seconds; with ?wait=S&since=V, as soon as the job's version is past V "
                       "(an item started or ended) or it has finished, else after S seconds. A "
                       "browser (Accept: text/html) or ?format=html gets the job's page.",
            "operationId": "getJob",
            "parameters": [
                _JOB_ID,
                {"name": "format", "in": "query", "schema": {"enum": ["json", "html"]}},
                {"name": "items", "in": "query", "description": "1: include the items.",
                 "schema": {"enum": ["0", "1", "true", "false"]}},
                {"name": "wait", "in": "query", "description": "Long-poll, in seconds.",
                 "schema": {"type": "number", "minimum": 0, "maximum": limits.http_wait_s_max}},
                {"name": "since", "in": "query",
                 "description": "A version of the job seen before: the long-poll ends at the "
                                "first change after it.",
                 "schema": {"type": "integer", "minimum": 0, "maximum": limits.version_max}},
                {"name": "items_from", "in": "query", "description": "The page: the first item "
                 f"its item table lists (at most {limits.webui_items_shown_max} a page).",
                 "schema": {"type": "integer", "minimum": 0}},
                {"name": "item", "in": "query", "description": "The page: the item whose "
                 f"stdout and stderr it shows the first {limits.webui_preview_bytes_max} bytes "
                 "of (default: the only item of a one-item job).",
                 "schema": {"type": "integer", "minimum": 0}},
            ],
            "responses": {"200": {"description": "The job (its page for a browser).",
                                  "content": {"application/json": {"schema": _JOB},
                                              "text/html": {"schema": {"type": "string"}}}},
                          "400": _BAD, "404": _NO_JOB, "503": _BUSY},
        },
        "delete": {
            "summary": "Forget a finished or cancelled job: it leaves the table for good.",
            "operationId": "forgetJob",
            "parameters": [_JOB_ID, _IDEMPOTENCY_KEY],
            "responses": {"200": _json(api.ref(api.Forgotten),
                                       "The job is forgotten."), "400": _BAD,
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
    **{f"/jobs/{{id}}/items/{{n}}/{stream}": {
        "get": {
            "summary": f"One item's {stream} as written so far, while it runs or after; with "
                       "?follow=1, until the item ends.",
            "description": "While the item runs: what it has written so far to its spool file "
                           "on the member running it (any member answers: it asks that member "
                           "over the member links). Once it ended: its stored output. The bytes "
                           "are sent as the item wrote them (text/plain; they need not be UTF-8). "
                           "With follow=1 the answer (chunked) stays open and new bytes follow "
                           f"as they are written (looked for every {limits.log_poll_ms} ms), "
                           "until the item ends; it also ends after "
                           f"{limits.log_follow_s_max} s, or when the item's lease moves to a "
                           "new run (header X-Meshjobs-Item-Epoch names the run; resume with "
                           "?offset=). An item not started yet is 409; with follow=1 the "
                           f"answer waits up to {limits.log_start_wait_s_max} s for it to start.",
            "operationId": f"itemOutput{stream.capitalize()}",
            "parameters": [
                _JOB_ID,
                {"name": "n", "in": "path", "required": True, "description": "The item's index.",
                 "schema": {"type": "integer", "minimum": 0, "maximum": limits.items_max - 1}},
                {"name": "follow", "in": "query",
                 "description": "1: keep the answer open until the item ends.",
                 "schema": {"enum": ["0", "1", "true", "false", "yes", "no", "on", "off"]}},
                {"name": "offset", "in": "query",
                 "description": "Bytes of the output to skip (to resume).",
                 "schema": {"type": "integer", "minimum": 0,
                            "maximum": limits.log_offset_bytes_max, "default": 0}},
            ],
            "responses": {
                "200": {"description": "The bytes from the offset.",
                        "headers": {"X-Meshjobs-Item-Epoch": {
                            "description": "The lease epoch of the run whose output this is.",
                            "schema": {"type": "integer"}}},
                        "content": {"text/plain": {"schema": {"type": "string",
                                                              "format": "binary"}}}},
                "400": _BAD,
                "404": _err("No such job (or forgotten), or no such item."),
                "409": _err("The item has not started yet (with follow=1: not within "
                            f"{limits.log_start_wait_s_max} s)."),
                "500": _err("The item's stored output is damaged on this member."),
                "503": _err("The member running the item does not answer, the stored output "
                            "is not on this member yet, or the member is busy or stopping."),
            },
        },
    } for stream in ("stdout", "stderr")},
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
                "schema": api.ref(api.Tone)}}},
            "responses": {"200": _json(_JOB, "The job."), "400": _BAD, "404": _NO_JOB,
                          "409": _CONFLICT, "503": _BUSY},
        },
    },
    "/blobs/{digest}": {
        "get": {
            "summary": "A blob's bytes (header X-Meshjobs-Blake3: the digest they hash to); "
                       "with ?check=1, whether this member's copy is good.",
            "description": "A copy found damaged is replaced by a good one from another member "
                           "when one exists. An answer of up to "
                           f"{limits.http_check_before_send_bytes_max} bytes is checked whole "
                           "before it is sent; a larger one found damaged part way is cut short "
                           "(fewer bytes than Content-Length): ask ?check=1 to learn why.",
            "operationId": "getBlob",
            "parameters": [{"name": "digest", "in": "path", "required": True,
                            "schema": api.ref(api.Digest)},
                           {"name": "check", "in": "query",
                            "description": "1: read the blob whole and answer its state as JSON.",
                            "schema": {"enum": ["0", "1", "true", "false"]}}],
            "responses": {"200": {"description": "The bytes, or with ?check=1 the state: "
                                                 "{digest, state: good|damaged, repaired?}.",
                                  "content": {**_OCTETS, "application/json": {
                                      "schema": api.ref(api.BlobCheck)}}},
                          "400": _BAD, "404": _err("No such blob on this member."),
                          "500": _err("The blob is damaged on this member and no other member "
                                      "had a good copy.")},
        },
    },
    "/events": {
        "get": {
            "summary": "Committed changes as server-sent events, from any member. Each event: "
                       "`id: <version>`, `event: job` with `data:` the job's list row (as an "
                       "element of GET /jobs), `event: forget` with {id, version} of a forgotten "
                       "job, or `event: reset` with {version} when the changes after the version "
                       "asked for are no longer kept here (reload, then go on from it). A "
                       "`: keepalive` comment at least every "
                       f"{limits.events_keepalive_s} s. Filters: a job passes when it matches "
                       "any value of a filter, and every filter given; forget events pass the "
                       "job filter only.",
            "operationId": "events",
            "parameters": [
                {"name": "job", "in": "query", "description": "Job ids (repeat, or commas).",
                 "schema": {"type": "string"}},
                {"name": "tag", "in": "query", "description": "Tags (repeat, or commas).",
                 "schema": {"type": "string"}},
                {"name": "state", "in": "query", "description": "Job states (repeat, or commas).",
                 "schema": {"type": "string"}},
                {"name": "pool", "in": "query", "description": "Pools (repeat, or commas).",
                 "schema": {"type": "string"}},
                {"name": "since", "in": "query",
                 "description": "Send the changes after this version (Last-Event-ID wins).",
                 "schema": {"type": "integer", "minimum": 0, "maximum": limits.version_max}},
                {"name": "Last-Event-ID", "in": "header",
                 "description": "The id of the last event seen: the stream resumes after it.",
                 "schema": {"type": "string"}},
            ],
            "responses": {"200": {"description": "The stream.",
                                  "content": {"text/event-stream": {"schema": {"type": "string"}}}},
                          "400": _BAD,
                          "503": _err("This member serves events_streams_max streams already, "
                                      "or is busy.")},
        },
    },
    "/fleet": {
        "get": {
            "summary": "The fleet as this member sees it: term, leader, members. A browser "
                       "(Accept: text/html) or ?format=html gets the fleet's page.",
            "operationId": "fleet",
            "parameters": [{"name": "format", "in": "query", "schema": {"enum": ["json", "html"]}}],
            "responses": {"200": {"description": "The fleet (its page for a browser).",
                                  "content": {"application/json": {
                                      "schema": api.ref(api.Fleet)},
                                      "text/html": {"schema": {"type": "string"}}}},
                          "400": _BAD, "503": _BUSY},
        },
    },
    "/ui.js": {
        "get": {
            "summary": "The one script of the web pages: Cancel, Hold and Release buttons, and "
                       "live updates from /events (polling the JSON API when that fails).",
            "operationId": "uiScript",
            "responses": {"200": {"description": "The script.",
                                  "content": {"text/javascript": {"schema": {"type": "string"}}}}},
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
            "responses": {"200": _json(api.ref(api.Health), "Healthy."),
                          "503": _err("The member does not answer in time, or (fresh=1) it is "
                                      "cut off from the leader.")},
        },
    },
    "/metrics": {
        "get": {
            "summary": "Metrics in the Prometheus text exposition format 0.0.4.",
            "description": "Rendered by prometheus_client: every family has HELP and TYPE; "
                           "counters end in _total; latency histograms (submit->commit, "
                           "lease->start, item run time, journal fsync, in seconds), jobs by "
                           "state and pool, process metrics. The query string is ignored.",
            "operationId": "metrics",
            "responses": {"200": {"description": "Counters, gauges and histograms.",
                                  "content": {"text/plain": {"schema": {"type": "string"}}}},
                          "503": _BUSY},
        },
    },
    "/login": {
        "get": {
            "summary": "A form to log a browser in with a token (a session cookie follows).",
            "operationId": "loginPage",
            "parameters": [{"name": "next", "in": "query", "required": False,
                            "schema": {"type": "string"},
                            "description": "A path on this member to go to afterwards."}],
            "responses": {"200": {"description": "The form.",
                                  "content": {"text/html": {"schema": {"type": "string"}}}}},
        },
        "post": {
            "summary": "Log in: the token (a form field `token`, or JSON) becomes an HttpOnly, "
                       "SameSite=Strict session cookie (Secure with TLS) naming a session on this "
                       "member with the token's name and role. Changes made with the cookie need "
                       "the X-Meshjobs-Csrf header of this member's pages.",
            "operationId": "login",
            "requestBody": {"required": True, "content": {
                "application/json": {"schema": api.ref(api.Login)},
                "application/x-www-form-urlencoded": {"schema": api.ref(api.LoginForm)}}},
            "responses": {
                "200": _json(api.ref(api.LoggedIn), "Logged in (JSON); the cookie is set."),
                "303": {"description": "Logged in (form); the cookie is set, on to `next`."},
                "400": _err("A broken form or JSON, or this member has no [auth] table."),
                "401": _UNAUTHORIZED,
                "413": _err(f"The body is over {limits.http_login_body_bytes_max} bytes."),
                "415": _err("Neither a form nor JSON."),
            },
        },
    },
    "/logout": {
        "post": {
            "summary": "End this browser's session and drop its cookie.",
            "operationId": "logout",
            "responses": {"200": _json(api.ref(api.LoggedOut), "Logged out.")},
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
    "421": _MISDIRECTED,
}
# Routes anybody may use (/metrics too, unless [auth] metrics = "read").
_OPEN = {("/healthz", "get"), ("/login", "get"), ("/login", "post"), ("/logout", "post")}


# --- many jobs at once (POST /jobs/cancel, /jobs/forget, /jobs/tone, /jobs/status) and history --

_BULK_BODY = {"cancel": api.ref(api.BulkChange), "forget": api.ref(api.BulkChange),
              "tone": api.ref(api.BulkTone), "status": api.ref(api.BulkStatus)}
_BULK_SUMMARY = {
    "cancel": "Cancel many jobs: by ids or a filter (submit role).",
    "forget": "Forget many ended jobs: by ids or a filter (admin role).",
    "tone": "Change priority, hold or max_leases of many jobs: by ids or a filter (submit role).",
    "status": "The records of many jobs: by ids or a filter (read role; a read, though a POST).",
}

_BULK_PATHS: dict[str, Any] = {
    f"/jobs/{action}": {"post": {
        "summary": _BULK_SUMMARY[action],
        "description": "A change is resolved by the leader against its committed table and "
                       "committed as one entry (all or nothing across a failover); a dry run "
                       "and a status are answered from this member's table. At most "
                       f"{limits.bulk_jobs_max} ids (more: 400); a filter matching more answers "
                       f"the oldest {limits.bulk_jobs_max} and a cursor in `next`.",
        "operationId": f"bulk{action.capitalize()}",
        "parameters": [] if action == "status" else [_IDEMPOTENCY_KEY],
        "requestBody": {"required": True, "content": {"application/json": {
            "schema": _BULK_BODY[action]}}},
        "responses": {"200": _json(api.ref(api.BulkAnswer),
                                   "One result per job."),
                      "400": _BAD, "413": _err(f"A body over {limits.bulk_body_bytes_max} "
                                               "bytes."), "503": _BUSY},
    }} for action in ("cancel", "forget", "tone", "status")
}
_BULK_PATHS["/history"] = {"get": {
    "summary": "This member's records of forgotten and expired jobs (history.jsonl and its "
               "rotated files), newest first.",
    "operationId": "history",
    "parameters": [
        {"name": "since", "in": "query", "description": "Only records at or after this time, in "
         "seconds since the epoch.", "schema": {"type": "number", "minimum": 0,
                                                "exclusiveMaximum": limits.epoch_s_max}},
        {"name": "limit", "in": "query", "schema": {
            "type": "integer", "minimum": 1, "maximum": limits.history_read_max, "default": 100}},
    ],
    "responses": {"200": _json(api.ref(api.History), "The records."),
                  "400": _BAD, "404": _err("This member keeps no history.")},
}}
_BULK_PATHS["/pools"] = {"get": {
    "summary": "Every pool, fleet-wide (the leader's view): slots, free, running, pending, and "
               "whether it is held or drained, fleet-wide or on which members.",
    "operationId": "pools",
    "responses": {"200": _json(api.ref(api.Pools), "The pools."),
                  "503": _BUSY},
}}
_ORDER_WORDS = {
    "hold": "Hold the pool: no new leases in it, and items leased but not started wait until "
            "release (running ones go on).",
    "release": "Release the pool (every hold of it; with member: only that member's).",
    "drain": "Drain the pool: running and leased items finish, no new ones are leased.",
    "undrain": "Undrain the pool (every drain of it; with member: only that member's).",
}
for _action, _words in _ORDER_WORDS.items():
    _BULK_PATHS[f"/pools/{{pool}}/{_action}"] = {"post": {
        "summary": _words + " Committed: survives restarts and failovers; applied on top of "
                            "the config's [pools.X] hold/drain. Needs admin.",
        "operationId": f"pool{_action.capitalize()}",
        "parameters": [{"name": "pool", "in": "path", "required": True,
                        "schema": {"type": "string", "maxLength": limits.pool_chars_max}},
                       _IDEMPOTENCY_KEY],
        "requestBody": {"required": False, "content": {"application/json": {
            "schema": api.ref(api.PoolOrderBody)}}},
        "responses": {"200": _json(api.ref(api.PoolOrder), "Applied."),
                      "400": _BAD, "404": _err("No such pool or member in the fleet."),
                      "409": _err("Too many orders kept: lift some first."), "503": _BUSY},
    }}
_BULK_PATHS["/pools/{pool}/slots"] = {"post": {
    "summary": "Set the pool's slots (fleet-wide, or on member), over the members' config; "
               "slots null goes back to the config (fleet-wide: every override of the pool). "
               "Effective slots: the member's override, else the fleet-wide one, else the "
               "config; a pool a member's config lacks or gives no slots stays so. More "
               "slots run more items at once, fewer start fewer (running items go on); 0 "
               "takes no new items there. Committed: survives restarts and failovers. Needs "
               "admin.",
    "operationId": "poolSlots",
    "parameters": [{"name": "pool", "in": "path", "required": True,
                    "schema": {"type": "string", "maxLength": limits.pool_chars_max}},
                   _IDEMPOTENCY_KEY],
    "requestBody": {"required": True, "content": {"application/json": {
        "schema": api.ref(api.PoolSlotsBody)}}},
    "responses": {"200": _json(api.ref(api.PoolOrder), "Applied."),
                  "400": _BAD, "404": _err("No such pool or member in the fleet."),
                  "409": _err("Too many orders kept: lift some first."), "503": _BUSY},
}}
_MEMBER_WORDS = {
    "drain": "Drain the member: it gets no new leases; what it runs goes on.",
    "undrain": "Undrain the member (also calls off a stop not done yet).",
    "stop": "Stop the member: it takes no work and its meshd exits (status 0) once its "
            "running items end, or after grace_s (then they are cut and leased again "
            "elsewhere). For its current run only: started again, it takes work.",
}
for _action, _words in _MEMBER_WORDS.items():
    _BULK_PATHS[f"/members/{{name}}/{_action}"] = {"post": {
        "summary": _words + " Forwarded to the leader and committed. Needs admin.",
        "operationId": f"member{_action.capitalize()}",
        "parameters": [{"name": "name", "in": "path", "required": True,
                        "schema": {"type": "string", "maxLength": limits.pool_chars_max}},
                       _IDEMPOTENCY_KEY],
        "requestBody": {"required": False, "content": {"application/json": {"schema": api.ref(
            api.MemberStopBody if _action == "stop" else api.MemberOrderBody)}}},
        "responses": {"200": _json(api.ref(api.MemberOrder), "Applied."),
                      "400": _BAD, "404": _err("No such member in the fleet."),
                      "409": _err("The member has not reported to the leader (stop), or too "
                                  "many orders are kept."), "503": _BUSY},
    }}


# --- re-running finished jobs (POST /jobs/{id}/rerun, restart, resubmit, output paths) -----------

_RERUN_PATHS: dict[str, Any] = {
    "/jobs/{id}/rerun": {"post": {
        "summary": "Run a finished job (done, failed or cancelled) again under the same id.",
        "description": "Its items (all, or with failed_only those that ended failed, timeout "
                       "or cancelled) wait again and get new attempt numbers; the earlier run "
                       "is kept: in the record's previous_runs and in the history (why "
                       "\"rerun\"). Dependents already settled by its earlier end stay "
                       "settled. A job not finished: 409 (wait for it, or cancel it first); "
                       "dep_failed: 409. The body may be left out (a whole rerun).",
        "operationId": "rerunJob",
        "parameters": [_JOB_ID, _IDEMPOTENCY_KEY],
        "requestBody": {"required": False, "content": {"application/json": {
            "schema": api.ref(api.Rerun)}}},
        "responses": {"200": _json(_JOB, "The job, queued again (run: its run number)."),
                      "400": _BAD, "404": _NO_JOB, "409": _CONFLICT, "503": _BUSY},
    }},
}
_CRON_NAME = {
    "name": "name", "in": "path", "required": True, "description": "A schedule's name.",
    "schema": {"type": "string", "pattern": f"^[A-Za-z0-9._-]{{1,{limits.cron_name_chars_max}}}$"},
}
_CRON = api.ref(api.Cron)
_NO_CRON = _err("No schedule of this name.")


def _cron_change(summary: str, op_id: str) -> dict:
    return {"post": {"summary": summary, "operationId": op_id,
                     "parameters": [_CRON_NAME, _IDEMPOTENCY_KEY],
                     "responses": {"200": _json(_CRON, "The schedule now."), "400": _BAD,
                                   "404": _NO_CRON, "503": _BUSY}}}


_CRON_PATHS: dict[str, Any] = {
    "/cron": {"get": {
        "summary": "The schedules (read role).", "operationId": "listCron",
        "responses": {"200": _json(api.ref(api.CronList), "Every schedule, oldest first."),
            "503": _BUSY}}},
    "/cron/{name}": {
        "get": {"summary": "One schedule (read role).", "operationId": "getCron",
                "parameters": [_CRON_NAME],
                "responses": {"200": _json(_CRON, "The schedule."), "400": _BAD,
                              "404": _NO_CRON, "503": _BUSY}},
        "put": {
            "summary": "Add a schedule, or replace it (submit role).",
            "description": "The leader submits each due run as a committed entry, as job "
                           "cron-NAME-YYYYMMDDTHHMMSS (its due time, UTC): a failover never "
                           "fires a due time twice. Runs missed while there was no leader: "
                           "the latest is fired once (catch_up latest) or none is (none: a run "
                           f"over {limits.cron_late_ms_max // 1000} s late is skipped). A run "
                           "due while the one before has not ended is submitted (overlap "
                           "allow) or passed over (skip). At most "
                           f"{limits.cron_schedules_max} schedules.",
            "operationId": "putCron",
            "parameters": [_CRON_NAME, _IDEMPOTENCY_KEY],
            "requestBody": {"required": True, "content": {"application/json": {
                "schema": api.ref(api.CronPut)}}},
            "responses": {"201": _json(_CRON, "Added."),
                          "200": _json(_CRON, "Replaced, or the same as before."),
                          "400": _BAD, "409": _err("A different schedule of this name (with "
                                                   "replace false), or too many schedules."),
                          "413": _err(f"A body over {limits.cron_body_bytes_max} bytes."),
                          "503": _BUSY}},
        "delete": {"summary": "Remove a schedule; its runs stay (submit role).",
                   "operationId": "deleteCron", "parameters": [_CRON_NAME, _IDEMPOTENCY_KEY],
                   "responses": {"200": _json(api.ref(api.CronRemoved), "Removed."),
                       "400": _BAD, "404": _NO_CRON, "503": _BUSY}},
    },
    "/cron/{name}/pause": _cron_change("Fire no runs of a schedule (submit role).", "pauseCron"),
    "/cron/{name}/resume": _cron_change("Fire a schedule's runs again from the next due time "
                                        "on; none missed while paused (submit role).",
                                        "resumeCron"),
}


def openapi_document() -> dict[str, Any]:
    """The OpenAPI 3.1 document, a fresh copy each call (callers may change it)."""
    paths = copy.deepcopy({**_PATHS, **_BULK_PATHS, **_RERUN_PATHS, **_CRON_PATHS})
    for path, ops in paths.items():
        for method, op in ops.items():
            common = dict(_COMMON)
            if path == "/healthz":
                del common["421"]  # a load balancer may ask by any name
            if (path, method) not in _OPEN:
                common["401"] = _UNAUTHORIZED
                common["403"] = _FORBIDDEN
            if method != "get" and path != "/login":
                common["403"] = _FORBIDDEN
                common["415"] = _NOT_JSON
            if _IDEMPOTENCY_KEY in op.get("parameters", []):
                common["422"] = _err("This Idempotency-Key was used before for a different request "
                                     "(method, path or body); nothing was applied. Use a new key.")
            for status, resp in common.items():
                op["responses"].setdefault(status, resp)
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "meshjobs",
            "version": "0.1.0",
            "description": "The HTTP API of a meshjobs member (meshd). Reads are answered from "
            "the member's committed table; changes are forwarded to the leader and answered "
            "once committed. Every error is JSON: {\"error\": \"...\"}. With an [auth] table, "
            "requests carry `Authorization: Bearer TOKEN` (or a browser's session cookie from "
            "/login); roles: read (GET), submit (also POST /jobs, cancel, tone, schedules), admin "
            "(everything, DELETE /jobs/{id} included). /healthz is always open, /metrics unless "
            "[auth] metrics = \"read\". Changes from a browser must come from this member's own "
            "origin and carry the X-Meshjobs-Csrf header of its pages.",
        },
        "paths": paths,
        "components": {"schemas": copy.deepcopy(_schemas())},
    }
