"""GET /events: committed changes as server-sent events (text/event-stream), from any member.

The stream is a loop of long-polls of the node's `changes` op (meshjobs/node/feed.py): each answer
is written as events, or as a keep-alive comment when it had nothing to say. Every event is

    id: <version>
    event: job | forget | reset
    data: <one line of JSON>

and a blank line. `job` carries the job's list row (one element of GET /jobs), `forget`
{"id", "version"} of a forgotten job, `reset` {"version"}: the member no longer holds every change
after the version the client asked from, so the client reloads and goes on from this one.

Rules:
- Filters and the starting version are checked before the stream starts: a bad one is a 400 in
  the API's JSON shape, never a half-open stream.
- At most `events_streams_max` streams at once (503 beyond). A stream's slot is held until its
  last long-poll has been answered by the node, so that clients that come and go cannot pile up
  waiters in the node.
- A stream ends within `events_check_ms` of its client going away or the member stopping; it
  never holds up the member's stop.
- A `job` event's row is what its stream's caller may see (meshjobs/identity.py Rule 3): env
  values and the notify URL redacted unless the caller is an admin or the job's submitter. The
  rows the node answers with are shared and never changed: each stream redacts a copy.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from meshjobs import identity, limits
from meshjobs.auth import Caller
from meshjobs.control import Answer, ControlError, parse_changes, parse_version

FILTERS = (("job", "jobs"), ("tag", "tags"), ("state", "states"), ("pool", "pools"))


def parse_query(query: Any, last_event_id: str | None) -> dict:
    """The `changes` request a stream starts with: filters from the query (each repeatable and
    comma-separated), the starting version from Last-Event-ID or else `since` (None: from now).
    Raises ControlError (400) on anything malformed."""
    req: dict[str, Any] = {"op": "changes", "wait_ms": 0}
    for key, name in FILTERS:
        values = [v for raw in query.getall(key, []) for v in raw.split(",") if v]
        if values:
            req[name] = values
    raw = last_event_id if last_event_id else query.get("since")
    if raw is not None:
        what = "Last-Event-ID" if last_event_id else "since"
        req["since"] = parse_version(raw.strip(), what)
    checked = parse_changes(req)  # the node checks again; the client hears of it here first
    return {k: sorted(v) if isinstance(v, frozenset) else v for k, v in checked.items()}


def shown(event: dict, viewer: Caller | None) -> Any:
    """An event's data as `viewer` may see it (None: a caller who sees everything)."""
    data = event["data"]
    if viewer is None or event["event"] != "job":
        return data
    return identity.redact(data, viewer.name, viewer.role)


def frame(event: str, version: int, data: Any) -> bytes:
    return (f"id: {version}\nevent: {event}\ndata: "
            f"{json.dumps(data, separators=(',', ':'))}\n\n").encode()


KEEPALIVE = b": keepalive\n\n"


class EventStreams:
    """The /events streams of one member (on the HTTP thread's event loop only: no lock)."""

    def __init__(self, ask: Callable[[dict, int], Awaitable[Answer]],
                 stopping: Callable[[], bool]) -> None:
        self._ask = ask
        self._stopping = stopping
        self.open = 0
        self.served = 0
        self.refused = 0

    async def handle(self, request: web.Request,
                     viewer: Caller | None = None) -> web.StreamResponse:
        """Serve one stream to `viewer` (the request's caller; None: one who sees everything)."""
        try:
            req = parse_query(request.query, request.headers.get("Last-Event-ID"))
        except ControlError as e:
            return web.json_response({"error": e.message}, status=e.status)
        if self.open >= limits.events_streams_max:
            self.refused += 1
            return web.json_response(
                {"error": f"this member serves {limits.events_streams_max} event streams already; "
                          "try again shortly, or another member"},
                status=503, headers={"Retry-After": "5"})
        self.open += 1
        self.served += 1
        task: asyncio.Future[Answer] | None = None
        try:
            if req["since"] is None:
                # From now: the member's current version is where the stream starts.
                first = await self._ask(req, 0)
                if first.status != 200:
                    return web.json_response(first.body, status=first.status)
                req["since"] = first.body["version"]
            resp = web.StreamResponse(headers={
                "Content-Type": "text/event-stream; charset=utf-8",
                "Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
            await resp.prepare(request)
            try:
                await resp.write(KEEPALIVE)
                task = await self._pour(request, resp, req, viewer)
            except ConnectionError:
                pass  # the client went away while a write was under way
            return resp
        finally:
            self._release(task)

    async def _pour(self, request: web.Request, resp: web.StreamResponse, req: dict,
                    viewer: Caller | None) -> asyncio.Future[Answer] | None:
        """Long-poll and write until the client goes, the member stops or the node cannot
        answer; return the long-poll still under way, if any."""
        wait_ms = max(1_000, limits.events_keepalive_s * 1000 - 1_000)
        while True:
            task = asyncio.ensure_future(self._ask({**req, "wait_ms": wait_ms}, wait_ms))
            if not await self._until_done(task, request):
                return task
            try:
                answer = task.result()
            except Exception:  # the member is busy (503): the client comes back
                return None
            body = answer.body
            if answer.status != 200 or not isinstance(body, dict):
                return None
            out = b""
            if body.get("reset"):
                out = frame("reset", body["version"], {"version": body["version"]})
            out += b"".join(frame(e["event"], e["version"], shown(e, viewer))
                            for e in body["events"])
            await resp.write(out or KEEPALIVE)
            req["since"] = body["version"]

    async def _until_done(self, task: asyncio.Future, request: web.Request) -> bool:
        """Wait for the long-poll; False (at once) when the client went away or the member
        stops."""
        while not task.done():
            transport = request.transport
            if self._stopping() or transport is None or transport.is_closing():
                return False
            await asyncio.wait({task}, timeout=limits.events_check_ms / 1000)
        return True

    def _release(self, task: asyncio.Future | None) -> None:
        if task is None or task.done():
            self.open -= 1
            if task is not None and not task.cancelled():
                task.exception()  # retrieved: an orphaned 503 is not logged as lost
            return
        if self._stopping():
            task.cancel()  # the loop closes: the node's answer has nobody to go to

        def done(t: asyncio.Future) -> None:
            self.open -= 1
            if not t.cancelled():
                t.exception()

        task.add_done_callback(done)
