"""The HTTP API of a member: aiohttp on its own event loop, in its own thread.

Rules:
- Everything a client sends is garbage until checked; a bad request is answered with one JSON
  shape, `{"error": "..."}` and a 4xx status, and is counted. No traceback reaches a client.
- Reads and changes go to the jobs thread through `ControlPort.call`, whose future is awaited
  without ever being cancelled: the control side may answer it late and must not trip over a
  cancelled future. A future not answered in time is a 503 ("member busy, try again").
- Blob store calls block (LMDB, disk), so they run in the loop's default executor, never on the
  event loop thread. Payloads are streamed chunk by chunk, never read whole into memory.
- Every size and time comes from `limits.py`, read when used.
- Trust comes first (`_trust`, the decisions in meshjobs/auth.py): the Host a request names, the
  origin a browser's change comes from, the caller's token or session and its role, the
  anti-CSRF value of a browser's change and the Content-Type of a body are checked before any
  handler runs. A refusal is counted by reason and logged at most `http_refusal_logs_per_s_max`
  times a second, with the token's name when known and never the token.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import collections
import concurrent.futures
import contextlib
import functools
import json
import math
import resource
import secrets
import socket
import ssl
import threading
import time
import urllib.parse
import uuid
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import Any, Protocol, overload

import blake3
import structlog
from aiohttp import web

from blobstore import BlobCorrupt, BlobGone, StoreFull
from meshjobs import (
    auth,
    cron,
    fleetctl,
    httpconn,
    identity,
    jsonbody,
    limits,
    metrics,
    placement,
    runas,
    waits,
    webui,
)
from meshjobs.auth import AuthError, Caller, LoginLimiter, Sessions
from meshjobs.config import Auth
from meshjobs.connbook import conns_limit
from meshjobs.control import (
    JOB_STATES,
    Answer,
    ControlError,
    is_digest,
    parse_bulk,
    parse_cursor,
    parse_job_id,
    parse_pool,
    parse_rerun,
    parse_rid,
    parse_submit,
    parse_tone,
    parse_version,
)
from meshjobs.eventstream import EventStreams
from meshjobs.frames import LogAsk, LogPiece
from meshjobs.hookaddr import NotifyPolicy
from meshjobs.metrics import MemberMetrics
from meshjobs.openapi import openapi_document
from meshjobs.table import ItemRows

# The shortest answer a client gets when the jobs thread is slow (limits.http_ctl_slack_ms).
CTL_SLACK_MS = limits.http_ctl_slack_ms


FINAL_ITEM_STATES = ("done", "failed", "timeout", "cancelled")
LIVE_ITEM_STATES = ("leased", "running")  # an item whose run may have output so far
# Content types a body of a change may have (a browser's form or text/plain post may not).
JSON_TYPES = ("application/json",)
CSRF_HEADER = "X-Meshjobs-Csrf"
# On a job list: whether the member's table follows a leader it hears ("true"), or it may be
# behind ("false": cut off from the leader, or entries it knows of have not reached it yet).
FRESH_HEADER = "X-Meshjobs-Fresh"
CALLER: web.RequestKey[Caller | None] = web.RequestKey("caller", object)  # type: ignore[arg-type]
SESSION: web.RequestKey[str | None] = web.RequestKey("session", object)  # type: ignore[arg-type]


class TlsError(Exception):
    """The certificate or key of [http] cannot serve HTTPS; the message says which and why."""


def tls_context(cert: str, key: str) -> ssl.SSLContext:
    """A server context for HTTPS with the PEM certificate chain and key: TLS 1.2 or newer."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(cert, key)
    except FileNotFoundError as e:
        raise TlsError(f"[http] tls_cert/tls_key: no file {e.filename}") from None
    except ssl.SSLError as e:
        raise TlsError(f"[http] tls_cert {cert} and tls_key {key} are not a PEM certificate and "
                       f"its private key ({e.reason or e}); give the certificate chain and the "
                       "key it was made for") from None
    except OSError as e:
        raise TlsError(f"[http] cannot read tls_cert {cert} or tls_key {key}: "
                       f"{e.strerror or e}") from None
    return ctx


class ControlPort(Protocol):
    def call(self, request: dict) -> concurrent.futures.Future[Answer]: ...


class BlobReader(Protocol):
    def put(self, data: bytes) -> str: ...
    def has(self, digest: str) -> bool: ...
    def open(self, digest: str) -> Iterator[bytes] | None: ...
    def size(self, digest: str) -> int | None: ...


class _Damaged(Exception):
    """A blob found damaged before anything of the answer was sent."""

    def __init__(self, digest: str) -> None:
        super().__init__(digest)
        self.digest = digest


class HttpError(Exception):
    """A request this layer refuses before it reaches the control port."""

    def __init__(self, status: int, message: str, close: bool = False) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.close = close  # the connection cannot carry another request after this answer


def _parse_since(value: str | None) -> float | None:
    """A history query's since=: seconds since the epoch (a number, not before 0 nor past
    year 9999)."""
    if value is None:
        return None
    try:
        since = (float(value) if len(value) <= limits.history_since_chars_max and value.isascii()
                 else None)
    except ValueError:
        since = None
    if since is None or since != since or not 0 <= since < limits.epoch_s_max:
        raise HttpError(400, f"since must be a time in seconds since the epoch (e.g. "
                             f"1767225600), not {value[:40]!r}")
    return since


def _error(status: int, message: str, headers: dict[str, str] | None = None) -> web.Response:
    return web.json_response({"error": message}, status=status, headers=headers)


def _loads(raw: bytes) -> Any:
    return jsonbody.loads(raw)


class _Expired(Exception):
    """The control port did not answer a request in time."""


def _expire(waiter: asyncio.Future[Any]) -> None:
    if not waiter.done():
        waiter.set_exception(_Expired())


class Handoff:
    """Answers of the jobs thread handed to the event loop: the jobs thread answers a whole
    round's requests at once, and the loop is woken once for all of them (one write to its
    self-pipe, one switch of threads), not once per answer.

    `put` runs on the thread that answers (a future's done callback); `_drain` on the loop.
    The order of the two steps on each side is what makes it safe without a lock: `put` queues
    before it looks at `_due`, and `_drain` clears `_due` before it empties the queue, so an
    answer queued while a drain is on its way is either taken by it or wakes the loop again.
    """

    def __init__(self) -> None:
        self._ready: collections.deque[tuple[asyncio.Future[Any], concurrent.futures.Future[Any]]] = (
            collections.deque())
        self._due = False
        self.wakeups = 0  # times the loop was woken for answers (for the tests' eyes)

    def put(self, loop: asyncio.AbstractEventLoop, waiter: asyncio.Future[Any],
            done: concurrent.futures.Future[Any]) -> None:
        self._ready.append((waiter, done))
        if self._due:
            return
        self._due = True
        try:
            loop.call_soon_threadsafe(self._drain)
        except RuntimeError:
            pass  # The loop closed while the answer was on its way; nobody waits for it.

    def _drain(self) -> None:
        self._due = False
        self.wakeups += 1
        ready = self._ready
        while ready:
            waiter, done = ready.popleft()
            if waiter.done():
                continue  # timed out, or its request was cancelled
            if done.cancelled():
                waiter.set_exception(HttpError(503, "member busy, try again"))
                continue
            exc = done.exception()
            if exc is not None:
                waiter.set_exception(exc)
            else:
                waiter.set_result(done.result())


class HttpApi:
    """Serves the member's HTTP API until `stop()`; `run` is the body of the http thread."""

    def __init__(
        self,
        host: str,
        port: int,
        control: ControlPort,
        blobs: BlobReader,
        member: str,
        log: Any = None,
        *,
        tls: ssl.SSLContext | None = None,
        names: tuple[str, ...] = (),
        auth: Auth | None = None,
        conns_max: int | None = None,
        header_timeout_s: float = limits.http_header_s_max,
        idle_timeout_s: float = limits.http_idle_s_max,
        body_timeout_s: float = limits.http_body_s_max,
        timings: MemberMetrics | None = None,
        item_logs: Any = None,
        user_check: Callable[[str], str | None] | None = None,
        notify_policy: NotifyPolicy | None = None,
    ) -> None:
        self._host = host
        # Why this member cannot run a job's items as a user (None: it can), when it is the only
        # member that could run them (a fleet of one): a submit it could never run is a 400.
        self._user_check = user_check
        # Where finish notices may go ([notify] allow): a notify URL whose host is an address
        # the policy refuses is a 400 at submit (names are checked again at each send).
        self._notify_policy = notify_policy if notify_policy is not None else NotifyPolicy()
        # Live output of running items (meshjobs.itemlogs.ItemLogs); None: only stored output.
        self._item_logs = item_logs
        self.history: Any = None  # the member's History (set by meshd): GET /history reads it
        self._item_streams = 0  # answers of an item's output being sent (event loop only)
        # The member's metrics registry (histograms, process metrics); one of its own if alone.
        self._timings = timings if timings is not None else MemberMetrics()
        self._port = port
        self._control = control
        self._blobs = blobs
        self._member = member
        self._log = log if log is not None else structlog.get_logger(__name__)
        self._tls = tls
        # None: from the soft fd limit, leaving room for what else meshd opens (conns_limit).
        nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        self._conns_max = conns_limit(nofile, conns_max)
        if conns_max is not None and conns_max > conns_limit(nofile, None):
            self._log.warning("http_conns_max_above_fd_limit", conns_max=conns_max, nofile=nofile,
                              hint="accept will fail with EMFILE under load: raise the fd limit "
                                   "(ulimit -n, LimitNOFILE=) or lower [http] conns_max")
        self._header_s = header_timeout_s
        self._idle_s = idle_timeout_s
        self._body_s = body_timeout_s
        self._gate: httpconn.Gate | None = None
        self._bound_port = 0
        self._stopping = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        # Touched on the event loop thread only, so no lock.
        self._by_class: dict[str, int] = {}
        self._bad_requests = 0
        self._damage: dict[str, int] = {}  # damaged blobs found and repaired, by what happened
        self._repairs: dict[str, asyncio.Future[bool]] = {}  # digest -> its repair under way
        self._repaired: dict[str, None] = {}  # digests repaired lately, oldest first
        self._auth = auth if auth is not None else Auth()
        # The names this member answers to besides IP literals and localhost; the machine's own
        # names are added when the server starts.
        self._names = frozenset(n.lower().rstrip(".") for n in (*names, host) if n)
        self._csrf_key = secrets.token_bytes(32)
        self._sessions = Sessions(limits.http_sessions_max, limits.http_session_s_max)
        self._logins = LoginLimiter()  # POST /login per client address (auth.LoginLimiter)
        self._refused: dict[str, int] = {}
        self._log_window_s = 0.0
        self._logged_in_window = 0
        self._not_logged = 0
        self.error: BaseException | None = None
        self._event_streams = EventStreams(self._ask, self._stopping.is_set)
        # Answers of the jobs thread on their way to the event loop, many per wake-up.
        self._handoff = Handoff()
        # Host headers found good (check_host is a pure function of the header and the names).
        self._hosts_ok: dict[str, None] = {}

    @property
    def scheme(self) -> str:
        return "https" if self._tls is not None else "http"

    @property
    def _cookie(self) -> str:
        # Cookies are shared by every port of a host: the name keeps members on one host apart.
        return f"meshjobs_session_{self._bound_port or self._port}"

    @property
    def bound_port(self) -> int:
        """The port the server listens on (the real one when the config asked for port 0)."""
        return self._bound_port

    def run(self, ready: threading.Event) -> None:
        """Serve on a new event loop; set `ready` once bound; return after `stop()`.

        If the server cannot start (the port is taken), `ready` is set all the same, `error`
        holds the reason and `run` raises it, so that a waiter never waits for nothing.
        """
        loop = asyncio.new_event_loop()
        self._loop = loop
        try:
            self._names |= loop.run_until_complete(_machine_names())
            loop.run_until_complete(self._serve(ready))
        except BaseException as e:
            self.error = e
            raise
        finally:
            ready.set()
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

    def stop(self) -> None:
        """Ask the server to stop; safe from any thread, at any time, more than once."""
        self._stopping.set()
        loop = self._loop
        if loop is not None:
            try:
                loop.call_soon_threadsafe(self._on_stop)
            except RuntimeError:
                pass  # The loop has closed already: the server is down.

    def _on_stop(self) -> None:
        if self._wake is not None:
            self._wake.set()

    def make_app(self) -> web.Application:
        app = web.Application(
            client_max_size=limits.http_body_bytes_max,
            middlewares=[self._middleware, self._trust],
        )
        app.on_response_prepare.append(self._stamp)
        r = app.router
        r.add_get("/jobs", self._list_jobs)
        r.add_post("/jobs", self._submit)
        r.add_get("/jobs/{id}", self._get_job)
        r.add_get("/events", self._events)
        r.add_delete("/jobs/{id}", self._forget)
        r.add_get("/jobs/{id}/results", self._results)
        for action in ("cancel", "forget", "tone", "status"):
            r.add_post(f"/jobs/{action}", self._bulk)
            # Every other method too (the same resource): not /jobs/{id}'s, which would read
            # or forget a job of that name (no job may have it: control.RESERVED_JOB_IDS).
            r.add_route("*", f"/jobs/{action}", self._only_post)
        r.add_post("/jobs/{id}/cancel", self._cancel)
        r.add_post("/jobs/{id}/tone", self._tone)
        r.add_post("/jobs/{id}/rerun", self._rerun)
        r.add_get("/jobs/{id}/items/{n}/stdout", self._item_output, allow_head=False)
        r.add_get("/jobs/{id}/items/{n}/stderr", self._item_output, allow_head=False)
        r.add_get("/blobs/{digest}", self._blob)
        r.add_get("/fleet", self._fleet)
        r.add_get("/history", self._history)
        r.add_get("/pools", self._pools)
        for action in fleetctl.POOL_ACTIONS:
            r.add_post(f"/pools/{{pool}}/{action}", self._pool_order)
        for action in fleetctl.MEMBER_ACTIONS:
            r.add_post(f"/members/{{name}}/{action}", self._member_order)
        r.add_post(f"/pools/{{pool}}/{fleetctl.SLOTS}", self._pool_slots)
        r.add_get("/ui.js", self._ui_script)
        r.add_get("/healthz", self._health)
        r.add_get("/metrics", self._metrics)
        r.add_get("/openapi.json", self._openapi)
        r.add_get("/login", self._login_page)
        r.add_post("/login", self._login)
        r.add_post("/logout", self._logout)
        r.add_get("/cron", self._cron_list)
        r.add_get("/cron/{name}", self._cron_get)
        r.add_put("/cron/{name}", self._cron_put)
        r.add_delete("/cron/{name}", self._cron_change)
        r.add_post("/cron/{name}/pause", self._cron_change)
        r.add_post("/cron/{name}/resume", self._cron_change)
        return app

    async def _serve(self, ready: threading.Event) -> None:
        self._wake = asyncio.Event()
        # aiohttp's keep-alive timer closes connections idle between requests; the gate does
        # the rest (header timeout, connection limit, accept errors): see httpconn.py.
        runner = web.AppRunner(self.make_app(), access_log=None,
                               shutdown_timeout=limits.http_shutdown_s,
                               keepalive_timeout=self._idle_s)
        await runner.setup()
        httpconn.budget_asyncio_log()
        gate = self._gate = httpconn.Gate(runner.server, self._host, self._port, tls=self._tls,
                                          conns_max=self._conns_max, header_s=self._header_s,
                                          log=self._log)
        try:
            self._bound_port = gate.start()
            self._log.info("http_listening", host=self._host, port=self._bound_port,
                           tls=self._tls is not None, conns_max=self._conns_max,
                           header_timeout_s=self._header_s, idle_timeout_s=self._idle_s)
            ready.set()
            if not self._stopping.is_set():
                await self._wake.wait()
        finally:
            gate.close()
            await runner.cleanup()
            self._log.info("http_stopped", port=self._bound_port)

    # --- plumbing ---------------------------------------------------------------------------

    @web.middleware
    async def _middleware(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        try:
            resp = await handler(request)
        except HttpError as e:
            resp = _error(e.status, e.message)
            if e.close:
                # Answer, then close at once: aiohttp would otherwise linger reading the rest
                # of the body the client never sends. A transport flushes what it holds first.
                resp.force_close()
                self._count(resp.status)
                await resp.prepare(request)
                await resp.write_eof()
                if request.transport is not None:
                    request.transport.close()
                return resp
        except ControlError as e:
            resp = _error(e.status, e.message)
        except web.HTTPRequestEntityTooLarge:
            resp = _error(413, f"the request body is larger than {limits.http_body_bytes_max} bytes; "
                               "store large payloads as blobs and refer to them")
        except web.HTTPException as e:
            # aiohttp's own answers (no route, wrong method) in our JSON shape.
            headers = {"Allow": e.headers["Allow"]} if "Allow" in e.headers else None
            message = {404: f"no route {request.path}; see /openapi.json",
                       405: f"{request.method} is not allowed on {request.path}"}.get(
                e.status, e.reason)
            resp = _error(e.status, message, headers)
        except asyncio.CancelledError:
            raise
        except Exception:
            self._log.exception("http_internal_error", method=request.method, path=request.path)
            resp = _error(500, "internal error in meshd; see the member's log")
        self._count(resp.status)
        return resp

    async def _stamp(self, request: web.Request, resp: web.StreamResponse) -> None:
        resp.headers["X-Meshjobs-Member"] = self._member

    # --- trust ------------------------------------------------------------------------------

    @web.middleware
    async def _trust(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        route = _route_of(request)
        method = request.method.upper()
        headers = request.headers
        try:
            host = headers.get("Host")
            if route != "/healthz" and host not in self._hosts_ok:
                auth.check_host(host, self._names)
                if host is not None and len(self._hosts_ok) < limits.http_hosts_remembered_max:
                    self._hosts_ok[host] = None
            auth.check_origin(headers, method, self.scheme, self._bound_port, self._names)
            sid, session = self._session_of(request)
            caller = auth.authorize(self._auth, method, route, headers.get("Authorization"),
                                    session)
            if (method not in auth.READ_METHODS and route not in ("/login", "/logout")
                    and auth.looks_like_browser(headers)):
                auth.check_csrf(self._csrf_key, sid if session is not None else None,
                                headers.get(CSRF_HEADER))
        except AuthError as e:
            return self._refuse(request, e)
        if (method not in auth.READ_METHODS and route != "/login" and request.body_exists
                and request.content_type not in JSON_TYPES):
            self._note_refusal(request, "content_type", 415, None)
            raise HttpError(415, f"a body sent to {request.method} {request.path[:100]} must be "
                                 "JSON with Content-Type: application/json")
        request[CALLER] = caller
        request[SESSION] = sid if session is not None else None
        return await handler(request)

    def _session_of(self, request: web.Request) -> tuple[str | None, Caller | None]:
        if not self._auth.configured:
            return None, None
        sid = request.cookies.get(self._cookie)
        return sid, self._sessions.get(sid, time.monotonic())

    def _refuse(self, request: web.Request, e: AuthError) -> web.StreamResponse:
        self._note_refusal(request, e.reason, e.status, e.who)
        headers: dict[str, str] = {}
        if e.status == 401:
            headers["WWW-Authenticate"] = (
                'Bearer realm="meshjobs", error="invalid_token"' if e.reason in ("invalid", "malformed")
                else 'Bearer realm="meshjobs"')
            accept = request.headers.get("Accept", "")
            if (request.method in ("GET", "HEAD") and "text/html" in accept
                    and not _prefers_json(accept)):
                # A browser asking for a page is sent to the login form, and back afterwards.
                headers["Location"] = "/login?" + urllib.parse.urlencode(
                    {"next": auth.safe_next(request.path_qs)})
                return web.json_response({"error": e.message}, status=303, headers=headers)
        return _error(e.status, e.message, headers)

    def _note_refusal(self, request: web.Request, reason: str, status: int,
                      who: str | None) -> None:
        """Count a refusal; log it unless this second's share of log lines is used up."""
        self._refused[reason] = self._refused.get(reason, 0) + 1
        now = time.monotonic()
        if now - self._log_window_s >= 1.0:
            if self._not_logged:
                self._log.warning("http_refusals_not_logged", refusals=self._not_logged)
            self._log_window_s, self._logged_in_window, self._not_logged = now, 0, 0
        if self._logged_in_window >= limits.http_refusal_logs_per_s_max:
            self._not_logged += 1
            return
        self._logged_in_window += 1
        self._log.warning("http_refused", status=status, reason=reason, who=who,
                          method=request.method[:16], path=request.path[:200],
                          remote=request.remote)

    async def _login_page(self, request: web.Request) -> web.Response:
        return _html(webui.login_page(self._member, auth.safe_next(request.query.get("next")),
                                      self._auth.configured, None))

    async def _login(self, request: web.Request) -> web.StreamResponse:
        """A browser's way in: the token, from a form or JSON, becomes a session cookie."""
        wait_s = self._logins.take(request.remote or "", time.monotonic())
        if wait_s is not None:
            self._note_refusal(request, "login_rate", 429, None)
            retry = max(1, math.ceil(wait_s))
            return _error(429, f"too many logins from {str(request.remote)[:60]}: at most "
                               f"{limits.http_login_burst_max} at once, then one every "
                               f"{limits.http_login_refill_s:g} s; try again in {retry} s",
                          {"Retry-After": str(retry)})
        raw = await self._read_body(request, self._login_body)
        if len(raw) > limits.http_login_body_bytes_max:
            raise HttpError(413, f"a login is at most {limits.http_login_body_bytes_max} bytes")
        is_form = request.content_type == "application/x-www-form-urlencoded"
        if is_form:
            try:
                fields = urllib.parse.parse_qs(raw.decode("utf-8"),
                                               max_num_fields=limits.http_login_fields_max)
            except (UnicodeDecodeError, ValueError):
                raise HttpError(400, "the login form is not valid") from None
            token = (fields.get("token") or [""])[0]
            nxt = auth.safe_next((fields.get("next") or [None])[0])
        elif request.content_type in JSON_TYPES:
            try:
                body = _loads(raw)
            except (ValueError, RecursionError):
                raise HttpError(400, 'a login is JSON {"token": "..."}') from None
            token = body.get("token") if isinstance(body, dict) else None
            if not isinstance(token, str):
                raise HttpError(400, 'a login is JSON {"token": "..."}')
            nxt = "/jobs"
        else:
            raise HttpError(415, "a login is a form (application/x-www-form-urlencoded) or JSON "
                                 '{"token": "..."}')
        if not self._auth.configured:
            raise HttpError(400, "this member has no [auth] table: it needs no login")
        try:
            caller = auth.identify(self._auth, "Bearer " + token.strip())
        except AuthError as e:
            self._note_refusal(request, "login_failed", 401, None)
            if is_form:
                return _html(webui.login_page(self._member, nxt, True, "That token is none of "
                                              "this member's. Try again."), status=401)
            return _error(401, e.message, {"WWW-Authenticate": 'Bearer realm="meshjobs"'})
        sid = secrets.token_urlsafe(32)
        self._sessions.open(sid, caller, time.monotonic())
        self._log.info("http_login", who=caller.name, role=caller.role, remote=request.remote)
        if is_form:
            resp: web.Response = web.Response(status=303, headers={"Location": nxt})
        else:
            resp = web.json_response({"name": caller.name, "role": caller.role,
                                      "csrf": auth.csrf_value(self._csrf_key, sid)})
        resp.set_cookie(self._cookie, sid, path="/", httponly=True, samesite="Strict",
                        secure=self._tls is not None, max_age=limits.http_session_s_max)
        return resp

    async def _logout(self, request: web.Request) -> web.Response:
        if self._auth.configured:
            self._sessions.close(request.cookies.get(self._cookie))
        # A page's Sign out button is a plain form: its browser goes on to the login page.
        resp: web.Response = (web.Response(status=303, headers={"Location": "/login"})
                              if "text/html" in request.headers.get("Accept", "")
                              else web.json_response({"logged_out": True}))
        resp.del_cookie(self._cookie, path="/")
        return resp

    def _count(self, status: int) -> None:
        cls = f"{status // 100}xx"
        self._by_class[cls] = self._by_class.get(cls, 0) + 1
        if status in (400, 405, 413, 415):
            self._bad_requests += 1

    async def _ask(self, request: dict, extra_ms: int = 0) -> Answer:
        """Call the control port and wait for its answer, or raise HttpError(503)."""
        loop = asyncio.get_running_loop()
        try:
            fut = self._control.call(request)
        except ControlError as e:
            return Answer(e.status, {"error": e.message})
        waiter: asyncio.Future[Answer] = loop.create_future()
        fut.add_done_callback(functools.partial(self._handoff.put, loop, waiter))
        timeout_s = (limits.ctl_commit_ms_max + CTL_SLACK_MS + extra_ms) / 1000
        timer = loop.call_later(timeout_s, _expire, waiter)
        try:
            answer = await waiter
        except _Expired:
            self._log.warning("http_control_timeout", op=request.get("op"), timeout_s=timeout_s)
            raise HttpError(503, "member busy, try again") from None
        except ControlError as e:
            return Answer(e.status, {"error": e.message})
        finally:
            timer.cancel()
        return Answer(int(answer[0]), answer[1])

    async def _relay(self, request: dict, extra_ms: int = 0,
                     viewer: Caller | None = None) -> web.Response:
        answer = await self._ask(request, extra_ms)
        if viewer is not None:
            answer = Answer(answer.status, identity.redact_body(answer.body, viewer.name,
                                                                viewer.role))
        if "by" in request:
            # Every change, once, at the member that received it, with who asked for it.
            self._log.info("http_change", op=request.get("op"), action=request.get("action"),
                           id=request.get("id") or request.get("name") or request.get("pool"),
                           by=request["by"], by_role=request["by_role"], status=answer.status,
                           job=answer.body.get("id") if isinstance(answer.body, dict) else None)
        return web.json_response(answer.body, status=answer.status)

    async def _body_json(self, request: web.Request) -> Any:
        if request.content_length is not None and request.content_length > limits.http_body_bytes_max:
            raise web.HTTPRequestEntityTooLarge(
                max_size=limits.http_body_bytes_max, actual_size=request.content_length)
        raw = await self._read_body(request)
        if not raw:
            raise HttpError(400, "the request needs a JSON body")
        try:
            if len(raw) > limits.http_json_thread_bytes_min:
                # A big body would hold up every other request while it is parsed.
                return await asyncio.get_running_loop().run_in_executor(None, _loads, raw)
            return _loads(raw)
        except (ValueError, RecursionError) as e:
            raise HttpError(400, f"the body is not valid JSON: {str(e)[:200]}") from None

    @staticmethod
    def _job_id(request: web.Request) -> str:
        return parse_job_id(request.match_info["id"])

    async def _read_body(self, request: web.Request,
                         reader: Callable[[web.Request], Awaitable[bytes]] | None = None) -> bytes:
        """The whole body, or 408 and a closed connection when it does not arrive within the
        body timeout: a client that sends a head and then trickles its body must not hold a
        connection (and its buffered bytes) for ever."""
        if reader is None and request.content.is_eof():
            # The whole body came with the head (or was read before): nothing to wait for, so
            # no task and no timer for the timeout.
            return await request.read()
        try:
            return await asyncio.wait_for((reader or _read_all)(request), self._body_s)
        except TimeoutError:
            self._log.info("http_body_timeout", path=request.path, timeout_s=self._body_s)
            raise HttpError(408, f"the request body did not arrive within {self._body_s:g} s; "
                                 "send it faster, or in smaller requests", close=True) from None

    @staticmethod
    async def _login_body(request: web.Request) -> bytes:
        raw = b""
        while len(raw) <= limits.http_login_body_bytes_max:
            chunk = await request.content.read(limits.http_login_body_bytes_max + 1 - len(raw))
            if not chunk:
                break
            raw += chunk
        return raw

    async def _rid(self, request: web.Request) -> dict[str, str | None]:
        """The request id of a change, the fingerprint its Idempotency-Key is bound to (the
        method, path and body, so that a key reused on another request is refused (422)
        instead of answering that request with the first one's outcome), and who asks for it
        (`by`, `by_role`: the leader checks ownership against them)."""
        caller = request[CALLER]
        assert caller is not None, "a change reached a handler without a caller"
        by = {"by": caller.name, "by_role": caller.role}
        key = request.headers.get("Idempotency-Key")
        if key is None:
            return {"rid": uuid.uuid4().hex, "fp": None, **by}
        body = await self._read_body(request)
        h = blake3.blake3()
        for part in (request.method.encode(), request.path.encode("utf-8", "surrogateescape"), body):
            h.update(len(part).to_bytes(8, "big"))
            h.update(part)
        return {"rid": parse_rid(key), "fp": h.hexdigest()[:32], **by}

    async def _blob_call(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(None, fn, *args)

    # --- jobs -------------------------------------------------------------------------------

    async def _list_jobs(self, request: web.Request) -> web.Response:
        q = request.query
        state = q.get("state") or None
        if state is not None and state not in JOB_STATES:
            raise HttpError(400, f"unknown state {state[:40]!r}: use one of {', '.join(JOB_STATES)}")
        tag = q.get("tag") or None
        if tag is not None and len(tag) > limits.tag_chars_max:
            raise HttpError(400, f"a tag has at most {limits.tag_chars_max} characters")
        pool = q.get("pool") or None
        if pool is not None:
            parse_pool(pool)  # refused here with the control's words, before any round trip
        fmt = q.get("format")
        if fmt not in (None, "json", "html"):
            raise HttpError(400, "format must be json or html")
        want_json = fmt == "json" or (fmt is None and _prefers_json(request.headers.get("Accept", "")))
        limit = _parse_limit(q.get("limit"))
        after = q.get("after") or None
        if after is not None:
            parse_cursor(after)  # refused here with the control's words, before any round trip
        ask: dict[str, Any] = {"op": "list", "state": state, "tag": tag, "limit": limit}
        if pool is not None:
            ask["pool"] = pool
        if after is not None:
            ask["after"] = after
        answer = await self._ask(ask)
        if answer.status != 200:
            return web.json_response(answer.body, status=answer.status)
        # The node answers a page {"jobs", "next", "fresh"}; clients get the list, and the
        # cursor of the next page in a header (and a Link), so that the body keeps its shape;
        # whether this member's table is fresh goes in X-Meshjobs-Fresh (a member cut off from
        # the leader answers from its table all the same).
        caller = request[CALLER]
        body = answer.body if caller is None else identity.redact_body(answer.body, caller.name,
                                                                       caller.role)
        jobs, nxt = (body.get("jobs"), body.get("next")) if isinstance(body, dict) else (body, None)
        if not isinstance(jobs, list):
            return web.json_response(body, status=answer.status)
        fresh = body.get("fresh") if isinstance(body, dict) else None
        headers: dict[str, str] = {}
        if isinstance(fresh, bool):
            headers[FRESH_HEADER] = "true" if fresh else "false"
        next_url = None
        if isinstance(nxt, str):
            query = {k: v for k, v in (("state", state), ("tag", tag), ("pool", pool),
                                       ("format", fmt)) if v}
            query.update({"limit": str(limit), "after": nxt})
            next_url = "/jobs?" + urllib.parse.urlencode(query)
            headers.update({"X-Meshjobs-Next": nxt, "Link": f'<{next_url}>; rel="next"'})
        if want_json:
            return web.json_response(jobs, headers=headers)
        csrf = auth.csrf_value(self._csrf_key, request.get(SESSION))
        nonce = secrets.token_urlsafe(16)
        resp = _html(webui.jobs_page(self._member, jobs, {"state": state, "tag": tag, "pool": pool},
                                     limit=limit, after=after, next_url=next_url, csrf=csrf,
                                     nonce=nonce, stale=fresh is False), nonce=nonce)
        resp.headers.update(headers)
        return resp

    async def _submit(self, request: web.Request) -> web.Response:
        body = await self._body_json(request)
        rid = await self._rid(request)
        spec = dict(parse_submit(body))
        self._check_notify(spec)
        self._check_inherit_env(request, spec)
        await self._stamp_run_as(request, spec)
        if spec.get("user") is not None and self._user_check is not None:
            why = await self._blob_call(self._user_check, spec["user"])
            if why is not None:
                raise HttpError(400, why)
        raw_items = spec.pop("items", None)
        if raw_items is None:
            items: list[str | None] = [None]
        else:
            payloads = _decode_items(raw_items)
            try:
                items = await self._blob_call(self._store_items, payloads)
            except StoreFull as e:
                self._log.error("http_blob_store_full", items=len(payloads), error=str(e))
                # The store's own words when it has them (a full disk names its free bytes).
                why = str(e) or "the blob store of this member is full"
                raise HttpError(503, f"{why}; try another member, or free space") from None
        quota = dict(request[CALLER].quota)
        return await self._relay({"op": "submit", **rid, "spec": spec, "items": items,
                                  **({"quota": quota} if quota else {})})

    @staticmethod
    def _check_inherit_env(request: web.Request, spec: dict) -> None:
        """A job asking for meshd's environment from a caller who is no admin: 403
        (meshjobs/identity.py Rule 4)."""
        why = identity.inherit_env_refusal(spec, request[CALLER].role)
        if why is not None:
            raise HttpError(403, why)

    def _check_notify(self, spec: dict) -> None:
        """A notify URL whose host is an address refused by [notify] allow: 400 saying how to
        allow it (meshjobs.hookaddr)."""
        url = spec.get("notify")
        if isinstance(url, str):
            why = self._notify_policy.refusal_at_submit(url)
            if why is not None:
                raise HttpError(400, why)


    async def _stamp_run_as(self, request: web.Request, spec: dict) -> None:
        """The user a submit's (or a schedule's) job runs as, as the caller's run_as allows
        (meshjobs/identity.py Rule 2; 403 otherwise), and the caller's run_as in the spec, so
        that the member running an item can hold a pool's user to it."""
        caller = request[CALLER]
        assert caller is not None, "a change reached a handler without a caller"
        if caller.run_as is None:
            return
        user = await self._blob_call(identity.job_user, caller.name, caller.run_as,
                                     spec.get("user"), runas.is_root)
        spec.pop("user", None)
        if user is not None:
            spec["user"] = user
        spec["run_as"] = list(caller.run_as)

    def _store_items(self, payloads: list[bytes | tuple[str, int]]) -> list[str | None]:
        """Runs in the executor: store inline payloads, check referred blobs exist.

        An array job's payloads are stored together: each distinct payload once, all in one
        transaction and one fsync (`write_batch` + `sync`), not one durable put per item."""
        distinct: dict[bytes, int] = {}
        for p in payloads:
            if not isinstance(p, tuple) and p not in distinct:
                distinct[p] = len(distinct)
        stored: list[str] = []
        if distinct:
            batch = getattr(self._blobs, "write_batch", None)
            if batch is None:
                stored = [self._blobs.put(p) for p in distinct]
            else:
                stored = []
                for k in range(0, len(distinct), limits.http_store_batch_max):
                    out = batch(list(distinct)[k:k + limits.http_store_batch_max])
                    for r in out:
                        if isinstance(r, Exception):
                            raise r
                    stored.extend(out)  # type: ignore[arg-type]
                self._blobs.sync()
        digests: list[str | None] = []
        for p in payloads:
            if isinstance(p, tuple):
                digest, index = p
                if not self._blobs.has(digest):
                    raise HttpError(400, f"no blob {digest} on this member (items[{index}])")
                digests.append(digest)
            else:
                digests.append(stored[distinct[p]])
        return digests

    async def _get_job(self, request: web.Request) -> web.Response:
        job_id = self._job_id(request)
        items = _parse_flag(request.query.get("items"), "items")
        wait_ms = _parse_wait_ms(request.query.get("wait"))
        fmt = request.query.get("format")
        if fmt not in (None, "json", "html"):
            raise HttpError(400, "format must be json or html")
        accept = request.headers.get("Accept", "")
        if fmt == "html" or (fmt is None and "text/html" in accept and not _prefers_json(accept)):
            return await self._job_page(request, job_id)
        ask: dict[str, Any] = {"op": "get", "id": job_id, "items": items, "wait_ms": wait_ms}
        if items:
            ask["copy_items"] = True  # the item records are built here, not on the jobs thread
        since = request.query.get("since")
        if since is not None:
            # Answered at once when the job's version is past `since` (or it has ended), else at
            # its next change, or after `wait` seconds.
            ask["since"] = parse_version(since)
        answer = await self._ask(ask, extra_ms=wait_ms)
        body = await self._waiting_for(answer.body)
        caller = request[CALLER]
        if caller is not None:
            body = identity.redact_body(body, caller.name, caller.role)
        if isinstance(body, dict) and isinstance(body.get("items"), ItemRows):
            # Sent as it is encoded: no 36 MB string for 100,000 items, nor one copy of it.
            resp = web.StreamResponse(status=answer.status)
            resp.content_type = "application/json"
            resp.charset = "utf-8"
            await resp.prepare(request)
            for part in _record_json(body):
                await resp.write(part)
                await asyncio.sleep(0)  # write() yields only when the client lags: others' turn
            await resp.write_eof()
            return resp
        return web.json_response(body, status=answer.status)

    async def _waiting_for(self, record: Any) -> Any:
        """A placed job with items waiting: why they wait (`waiting_for`), when no member it may
        go to is alive. Only the leader knows who is alive: the fleet view is asked of it."""
        if (not isinstance(record, dict) or not isinstance(record.get("member"), str)
                or not record.get("items_pending")):
            return record
        fleet = await self._ask({"op": "fleet"})
        if not isinstance(fleet.body, dict) or fleet.body.get("partial"):
            return record  # no leader's view to tell who is alive: say nothing rather than guess
        members = fleet.body.get("members")
        why = placement.waiting_for(record, members if isinstance(members, list) else [])
        return waits.merge(record, why)

    async def _events(self, request: web.Request) -> web.StreamResponse:
        """Committed changes as server-sent events (meshjobs/eventstream.py)."""
        return await self._event_streams.handle(request, request[CALLER])

    async def _job_page(self, request: web.Request, job_id: str) -> web.Response:
        """A browser's view of one job (meshjobs/webui.py): its program, counts and times, why
        each failed item failed (with the last lines of its stderr), a page of its items
        (?items_from=N), the head of one item's outputs (?item=N; by default the only item once
        it ended), and Cancel, Hold and Release while it is unfinished."""
        items_from = _parse_index(request.query.get("items_from"), "items_from")
        pick = _parse_index(request.query.get("item"), "item", none=True)
        # One page of its items and its first failed ones (node/reads.py), with its counts:
        # never a record of every item.
        answer = await self._ask({"op": "items", "id": job_id, "from": items_from,
                                  "limit": limits.webui_items_shown_max,
                                  "failed": limits.status_items_shown_max})
        if answer.status != 200 or not isinstance(answer.body, dict):
            why = answer.body.get("error") if isinstance(answer.body, dict) else None
            return _html(webui.error_page(self._member, answer.status,
                                          str(why or f"no answer for job {job_id}")),
                         status=answer.status if answer.status >= 400 else 502)
        record = await self._waiting_for(answer.body)
        caller = request[CALLER]
        if caller is not None:
            record = identity.redact(record, caller.name, caller.role)
        items = [it for it in record.get("items") or [] if isinstance(it, dict)]
        record["items"] = items
        shown = [it for it in record.pop("failed_items", None) or [] if isinstance(it, dict)]
        n_failed = record.get("items_failed") or 0
        total = record.get("items_total") or 0
        tails = await self._blob_call(self._stderr_tails, [it.get("stderr") for it in shown])
        if pick is not None and pick >= total:
            raise HttpError(404, f"job {job_id} has {total} item(s): no item {pick}; "
                                 "items count from 0")
        if (pick is None and total == 1 and items_from == 0 and items
                and (items[0].get("ended_at") is not None
                     or items[0].get("state") in LIVE_ITEM_STATES)):
            pick = 0
        preview = None
        live = None
        if pick is not None:
            on_page = pick - items_from
            item = (items[on_page] if 0 <= on_page < len(items)
                    else await self._item_of(job_id, pick))
            heads = await self._blob_call(self._heads, [item.get("stdout"), item.get("stderr")])
            preview = (item, dict(zip(("stdout", "stderr"), heads, strict=True)))
            if item.get("state") in LIVE_ITEM_STATES:
                live = {stream: await self._live_tail(item, job_id, pick, stream)
                        for stream in ("stdout", "stderr")}
        csrf = auth.csrf_value(self._csrf_key, request.get(SESSION))
        nonce = secrets.token_urlsafe(16)
        return _html(webui.job_page(self._member, record, list(zip(shown, tails, strict=True)),
                                    n_failed, items_from=items_from, preview=preview,
                                    csrf=csrf, nonce=nonce, paged=True, live=live), nonce=nonce)

    async def _live_tail(self, item: dict, job_id: str, n: int,
                         stream: str) -> tuple[str | None, bool]:
        """The last webui_preview_bytes_max bytes of a running item's output so far, as text,
        from at most webui_live_reads_max reads (here or from the member running it), and
        whether more was there than was read; (None, False) when it cannot be read now."""
        offset = 0
        tail = b""
        for _ in range(limits.webui_live_reads_max):
            piece = await self._log_piece(item, job_id, n, stream, offset)
            if piece is None or piece.error is not None:
                return (None, False) if offset == 0 else (
                    tail.decode("utf-8", "replace"), False)
            tail = (tail + piece.data)[-limits.webui_preview_bytes_max:]
            offset += len(piece.data)
            if piece.end or len(piece.data) < limits.log_frame_bytes_max:
                return tail.decode("utf-8", "replace"), False
        return tail.decode("utf-8", "replace"), True

    def _heads(self, digests: list[Any]) -> list[tuple[str | None, int | None]]:
        """Runs in the executor: the first webui_preview_bytes_max bytes of each blob as text,
        and its size ((None, None) when absent; (None, size) when damaged or collected)."""
        out: list[tuple[str | None, int | None]] = []
        for digest in digests:
            if not isinstance(digest, str):
                out.append((None, None))
                continue
            text: str | None = None
            total: int | None = None
            try:
                total = self._blobs.size(digest)
                chunks = self._blobs.open(digest) if total is not None else None
                if chunks is not None:
                    raw = b""
                    try:
                        for chunk in chunks:
                            raw += chunk
                            if len(raw) >= limits.webui_preview_bytes_max:
                                break
                    finally:
                        close = getattr(chunks, "close", None)
                        if close is not None:
                            close()
                    text = raw[: limits.webui_preview_bytes_max].decode("utf-8", "replace")
            except (BlobCorrupt, BlobGone):
                text = None
            out.append((text, total))
        return out

    def _stderr_tails(self, digests: list[Any]) -> list[str | None]:
        """Runs in the executor: the last status_stderr_bytes_max bytes of each stderr blob (None
        when absent, too long to read for its tail, or damaged: the page says so)."""
        out: list[str | None] = []
        for digest in digests:
            tail: str | None = None
            if isinstance(digest, str):
                try:
                    size = self._blobs.size(digest)
                    chunks = self._blobs.open(digest) if size is not None and (
                        size <= limits.status_stderr_read_bytes_max) else None
                    if chunks is not None:
                        raw = b""
                        try:
                            for chunk in chunks:
                                raw = (raw + chunk)[-limits.status_stderr_bytes_max:]
                        finally:
                            close = getattr(chunks, "close", None)
                            if close is not None:
                                close()
                        lines = [ln for ln in raw.decode("utf-8", "replace").split("\n")
                                 if ln.strip()]
                        tail = "\n".join(lines[-limits.status_stderr_lines_max:])
                except (BlobCorrupt, BlobGone):
                    tail = None
            out.append(tail)
        return out

    async def _cancel(self, request: web.Request) -> web.Response:
        job_id = self._job_id(request)
        return await self._relay({"op": "cancel", **await self._rid(request), "id": job_id})

    async def _forget(self, request: web.Request) -> web.Response:
        job_id = self._job_id(request)
        return await self._relay({"op": "forget", **await self._rid(request), "id": job_id})

    async def _tone(self, request: web.Request) -> web.Response:
        job_id = self._job_id(request)
        fields = parse_tone(await self._body_json(request))
        return await self._relay({"op": "tone", **await self._rid(request), "id": job_id, **fields})

    async def _rerun(self, request: web.Request) -> web.Response:
        """POST /jobs/{id}/rerun: a finished job runs again; the body ({"failed_only": bool})
        may be left out."""
        job_id = self._job_id(request)
        raw = await self._read_body(request)
        fields = parse_rerun(await self._body_json(request) if raw.strip() else None)
        return await self._relay({"op": "rerun", **await self._rid(request), "id": job_id, **fields})

    async def _bulk(self, request: web.Request) -> web.Response:
        """POST /jobs/cancel, /jobs/forget, /jobs/tone and /jobs/status: many jobs at once, by
        {"ids": [...]} or {"filter": {...}}; the answer has one result per job."""
        action = request.path.rsplit("/", 1)[1]
        if (request.content_length is not None
                and request.content_length > limits.bulk_body_bytes_max):
            raise HttpError(413, f"a bulk request body has at most {limits.bulk_body_bytes_max} "
                                 f"bytes: name at most {limits.bulk_jobs_max} ids, or use a filter")
        raw = await self._read_body(request)
        if len(raw) > limits.bulk_body_bytes_max:
            raise HttpError(413, f"a bulk request body has at most {limits.bulk_body_bytes_max} "
                                 f"bytes: name at most {limits.bulk_jobs_max} ids, or use a filter")
        body = await self._body_json(request)
        parse_bulk(action, body)  # refused here with the control's words, before any round trip
        ask: dict[str, Any] = {"op": "bulk", "action": action, **body}
        if action != "status":
            ask.update(await self._rid(request))
        return await self._relay(ask, viewer=request[CALLER])

    async def _pools(self, request: web.Request) -> web.Response:
        """GET /pools: every pool, fleet-wide (the leader's view; see fleetctl.pools_view)."""
        return await self._relay({"op": "pools"})

    async def _order_body(self, request: web.Request, keys: frozenset[str]) -> dict:
        """The optional JSON body of a pool or member order (empty: no options)."""
        raw = await self._read_body(request)
        if len(raw) > limits.bulk_body_bytes_max:
            raise HttpError(413, "an order's body is a small JSON object: "
                                 f"{', '.join(sorted(keys))}")
        return fleetctl.parse_body(await self._body_json(request) if raw.strip() else None, keys)

    async def _pool_order(self, request: web.Request) -> web.Response:
        """POST /pools/{pool}/hold|release|drain|undrain, body {"member": M} or none."""
        action = request.path.rsplit("/", 1)[1]
        body = await self._order_body(request, frozenset({"member"}))
        ask = {"op": "pool", "action": action, "pool": request.match_info["pool"],
               "member": body.get("member")}
        fleetctl.parse_ctl({**ask, "rid": "x"})  # refused here, before any round trip
        return await self._relay({**ask, **await self._rid(request)})

    async def _pool_slots(self, request: web.Request) -> web.Response:
        """POST /pools/{pool}/slots, body {"slots": N or null, "member": M (optional)}."""
        body = await self._order_body(request, frozenset({"slots", "member"}))
        if "slots" not in body:
            raise HttpError(400, 'give a body {"slots": N} (N from 0 to '
                                 f'{limits.pool_slots_max}), or {{"slots": null}} to go back to '
                                 'the config; "member": M for one member only')
        ask = {"op": "pool", "action": fleetctl.SLOTS, "pool": request.match_info["pool"],
               "member": body.get("member"), "slots": body["slots"]}
        fleetctl.parse_ctl({**ask, "rid": "x"})  # refused here, before any round trip
        return await self._relay({**ask, **await self._rid(request)})

    async def _member_order(self, request: web.Request) -> web.Response:
        """POST /members/{name}/drain|undrain|stop, body {"grace_s": S} (stop) or none."""
        action = request.path.rsplit("/", 1)[1]
        body = await self._order_body(request, frozenset({"grace_s"}))
        ask = {"op": "member", "action": action, "name": request.match_info["name"],
               "grace_s": body.get("grace_s")}
        fleetctl.parse_ctl({**ask, "rid": "x"})
        return await self._relay({**ask, **await self._rid(request)})

    async def _history(self, request: web.Request) -> web.Response:
        """GET /history?since=T&limit=N: this member's records of forgotten and expired jobs,
        newest first (since: seconds since the epoch; limit: 1..history_read_max)."""
        q = request.query
        unknown = set(q) - {"since", "limit"}
        if unknown:
            raise HttpError(400, f"unknown query key(s): {', '.join(sorted(unknown))[:200]}; "
                                 "use since and limit")
        since = _parse_since(q.get("since"))
        raw_limit = q.get("limit")
        limit = limits.history_read_default
        if raw_limit is not None:
            if (not raw_limit.isascii() or not raw_limit.isdigit() or len(raw_limit) > 6
                    or not 1 <= int(raw_limit) <= limits.history_read_max):
                raise HttpError(400, f"limit must be a whole number from 1 to "
                                     f"{limits.history_read_max}, not {raw_limit[:40]!r}")
            limit = int(raw_limit)
        history = self.history
        if history is None:
            raise HttpError(404, "this member keeps no history")
        from meshjobs import history as history_file
        body = await self._blob_call(history_file.read, history.folder, since, limit)
        body["member"] = self._member
        body["dropped"] = history.counts["history_dropped"]
        caller = request[CALLER]
        if caller is not None:
            body = identity.redact_body(body, caller.name, caller.role)
        return web.json_response(body)

    async def _results(self, request: web.Request) -> web.StreamResponse:
        job_id = self._job_id(request)
        which = request.query.get("stream", "stdout")
        if which not in ("stdout", "stderr"):
            raise HttpError(400, "stream must be stdout or stderr")
        # The items' digests a slice at a time (results_slice_max a read: the jobs thread
        # serves others between two), kept as the table holds them (32 bytes each, shared).
        digests: list[bytes] = []
        total = 0
        lo = 0
        while True:
            answer = await self._ask({"op": "outputs", "id": job_id, "stream": which,
                                      "from": lo, "limit": limits.results_slice_max})
            if answer.status != 200 or not isinstance(answer.body, dict):
                return web.json_response(answer.body, status=answer.status)
            part = [d for d in answer.body["digests"] if d is not None]
            sizes = (await self._blob_call(lambda p=part: [self._blobs.size(d.hex()) for d in p])
                     if part else [])
            for digest, size in zip(part, sizes, strict=True):
                if size is None:
                    raise HttpError(503, f"blob {digest.hex()} of job {job_id} is not on this "
                                         "member yet; try again, or ask another member")
            digests.extend(part)
            total += sum(sizes)
            lo += len(answer.body["digests"])
            if lo >= answer.body["n"] or not answer.body["digests"]:
                break
        return await self._stream(request, _HexDigests(digests), total, job_id, gone_status=503)

    # --- one item's output, live ------------------------------------------------------------

    async def _item_output(self, request: web.Request) -> web.StreamResponse:
        """GET /jobs/{id}/items/{n}/stdout (or /stderr): the item's output from ?offset=, as
        text/plain (the bytes as the item wrote them). While the item runs: what it has written
        so far to its spool file, here or on the member running it; once it ended: its stored
        blob. With ?follow=1 the answer stays open and new bytes follow as they are written,
        until the item ends (or log_follow_s_max passes, or its lease moves to another run)."""
        self._item_streams += 1
        try:
            return await self._item_output_of(request)
        finally:
            self._item_streams -= 1

    async def _item_output_of(self, request: web.Request) -> web.StreamResponse:
        job_id = self._job_id(request)
        n = _parse_item_index(request.match_info["n"])
        stream = "stdout" if request.path.endswith("/stdout") else "stderr"
        follow = _parse_flag(request.query.get("follow"), "follow")
        offset = _parse_offset(request.query.get("offset"))
        loop = asyncio.get_running_loop()
        item = await self._item_of(job_id, n)
        if item.get("state") == "pending":
            if not follow:
                raise HttpError(409, f"item {n} of job {job_id} has not started yet: ask again "
                                     "once it runs, or add ?follow=1 to wait for it")
            until = loop.time() + limits.log_start_wait_s_max
            while item.get("state") == "pending":
                if loop.time() >= until:
                    raise HttpError(409, f"item {n} of job {job_id} has not started within "
                                         f"{limits.log_start_wait_s_max} s (no free slot, or "
                                         "held?): ask again later")
                if not await self._log_pause(request):
                    raise HttpError(503, "member is stopping; try another member")
                item = await self._item_of(job_id, n)
        resp = web.StreamResponse(headers={"Content-Type": "text/plain; charset=utf-8",
                                           "Cache-Control": "no-store",
                                           "X-Content-Type-Options": "nosniff"})
        epoch = item.get("epoch")
        if isinstance(epoch, int):
            # The run whose output this is: a client that resumes knows whether it is the same.
            resp.headers["X-Meshjobs-Item-Epoch"] = str(epoch)
        if follow:
            await resp.prepare(request)  # headers at once: bytes may be long in coming
        follow_until = loop.time() + limits.log_follow_s_max
        settle_until = loop.time() + limits.log_settle_ms_max / 1000
        unreachable: str | None = None
        while not self._stopping.is_set() and not _client_gone(request):
            state = item.get("state")
            if state in FINAL_ITEM_STATES:
                digest = item.get(stream)
                if isinstance(digest, str):
                    await self._item_blob(request, resp, digest, offset, job_id, n)
                break
            if state == "leased" and item.get("epoch") != epoch:
                break  # re-leased: a new run, whose output starts again from its first byte
            piece = None
            if state == "leased":
                piece = await self._log_piece(item, job_id, n, stream, offset)
                if piece is None:
                    unreachable = str(item.get("member"))
                elif piece.error is None:
                    if piece.data:
                        if not await _write(request, resp, piece.data):
                            return resp
                        offset += len(piece.data)
                    if piece.end:
                        break
                    if len(piece.data) == limits.log_frame_bytes_max:
                        continue  # more is there at once
                    if not follow:
                        break
                    settle_until = loop.time() + limits.log_settle_ms_max / 1000
                elif piece.error == "unavailable" and not follow:
                    break  # nothing to show while it runs (a python item, or not spawned yet)
            # Not yet spawned, ended and being stored, or the member did not answer: look at
            # the record again a little later.
            if not follow and loop.time() >= settle_until:
                break
            if follow and loop.time() >= follow_until:
                break
            if not await self._log_pause(request):
                if not resp.prepared:
                    raise HttpError(503, "member is stopping; try another member")
                break
            if piece is None or piece.error is not None:
                try:
                    item = await self._item_of(job_id, n)
                except HttpError:
                    if not resp.prepared:
                        raise
                    break  # forgotten meanwhile, or the member is busy: end what was sent
        if not resp.prepared:
            if unreachable is not None:
                raise HttpError(503, f"member {unreachable}, which runs item {n} of job "
                                     f"{job_id}, does not answer; try again shortly")
        with contextlib.suppress(ConnectionResetError):
            if not resp.prepared:
                await resp.prepare(request)
            await resp.write_eof()
        return resp

    async def _item_of(self, job_id: str, n: int) -> dict:
        """Item n's record (404 when the job or the item does not exist): built alone from the
        table's item arrays (node/reads.py), not with every other item of the job."""
        answer = await self._ask({"op": "item", "id": job_id, "index": n})
        if answer.status != 200 or not isinstance(answer.body, dict):
            message = answer.body.get("error") if isinstance(answer.body, dict) else None
            raise HttpError(answer.status, str(message or f"job {job_id} cannot be read"))
        return answer.body

    async def _log_piece(self, item: dict, job_id: str, n: int, stream: str,
                         offset: int) -> LogPiece | None:
        """The next bytes of a running item's output, read here or asked of its member; None
        when that member does not answer (or no live output can be asked for)."""
        logs = self._item_logs
        member, epoch = item.get("member"), item.get("epoch")
        if logs is None or not isinstance(member, str) or not isinstance(epoch, int):
            return None
        if member == self._member:
            ask = LogAsk(0, job_id, n, epoch, stream, offset, limits.log_frame_bytes_max)
            return await asyncio.get_running_loop().run_in_executor(None, logs.read_local, ask)
        fut = logs.ask(member, job_id, n, epoch, stream, offset, limits.log_frame_bytes_max)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(fut),
                                          limits.log_ask_ms_max / 1000)
        except TimeoutError:
            return None
        finally:
            logs.forget(fut)

    async def _log_pause(self, request: web.Request) -> bool:
        """Wait one poll interval; False when the client went away or the member stops."""
        step_s = limits.log_poll_ms / 1000
        await asyncio.sleep(step_s)
        return not self._stopping.is_set() and not _client_gone(request)

    async def _item_blob(self, request: web.Request, resp: web.StreamResponse, digest: str,
                         offset: int, job_id: str, n: int) -> None:
        """Write an ended item's stored output from `offset` (fetched from another member when
        this one lacks it)."""
        chunks = await self._blob_call(self._blobs.open, digest)
        if chunks is None:
            if not resp.prepared:
                raise HttpError(503, f"the output of item {n} of job {job_id} (blob {digest}) is "
                                     "not on this member yet; try again, or ask another member")
            return
        try:
            skip = offset
            while not _client_gone(request):
                try:
                    chunk = await self._blob_call(next, chunks, None)
                except (BlobCorrupt, BlobGone) as e:
                    self._log.error("blob_damaged", what=f"item {job_id}/{n}", error=str(e))
                    if isinstance(e, BlobCorrupt):
                        self._count_damage("found")
                        asyncio.get_running_loop().create_task(self._repair(e.digest))
                    if not resp.prepared:
                        raise self._damaged(digest, f"item {job_id}/{n}") from None
                    if request.transport is not None:
                        request.transport.close()
                    return
                if chunk is None:
                    return
                if skip >= len(chunk):
                    skip -= len(chunk)
                    continue
                if not await _write(request, resp, chunk[skip:]):
                    return
                skip = 0
        finally:
            close = getattr(chunks, "close", None)
            if close is not None:
                await self._blob_call(close)

    # --- blobs ------------------------------------------------------------------------------

    async def _blob(self, request: web.Request) -> web.StreamResponse:
        digest = request.match_info["digest"]
        if not is_digest(digest):
            raise HttpError(400, "a blob digest is 64 lowercase hex characters (blake3-256)")
        if _parse_flag(request.query.get("check"), "check"):
            return await self._check_blob(digest)
        size = await self._blob_call(self._blobs.size, digest)
        if size is None:
            raise HttpError(404, f"no blob {digest} on this member")
        return await self._stream(request, [digest], size, digest, gone_status=404)

    async def _check_blob(self, digest: str) -> web.Response:
        """GET /blobs/{digest}?check=1: read the blob whole and say whether it is good; a damaged
        one is repaired from another member's copy when one exists."""
        check = getattr(self._blobs, "check", None)
        if check is None:
            raise HttpError(404, "this member cannot check blobs")
        if digest in self._repairs:
            ok = await self._repair(digest)  # the one under way
            return web.json_response({"digest": digest, "state": "good" if ok else "damaged",
                                      "repaired": ok})
        state = await self._blob_call(check, digest)
        if state is None:
            raise HttpError(404, f"no blob {digest} on this member")
        if state:
            answer: dict[str, Any] = {"digest": digest, "state": "good"}
            if digest in self._repaired:
                answer["repaired"] = True
            return web.json_response(answer)
        self._count_damage("found")
        if await self._repair(digest):
            return web.json_response({"digest": digest, "state": "good", "repaired": True})
        return web.json_response({"digest": digest, "state": "damaged", "repaired": False})

    async def _stream(self, request: web.Request, digests: Sequence[str], size: int,
                      what: str, gone_status: int) -> web.StreamResponse:
        """Send blobs one after the other. Damage found before the first byte is repaired (a
        good copy fetched from another member) or answered 500 "damaged"; a small answer is
        checked whole before its headers go out, so that it is never cut short by damage."""
        if request.method == "HEAD":
            # aiohttp would send what a stream writes even to HEAD, so write nothing.
            resp = web.StreamResponse(headers={"Content-Type": "application/octet-stream"})
            resp.content_length = size
            await resp.prepare(request)
            await resp.write_eof()
            return resp
        if size <= limits.http_check_before_send_bytes_max:
            await self._check_all(digests, what)
        for attempt in (1, 2):
            chunks = _chain(self._blobs, digests)
            try:
                try:
                    first = await self._next_chunk(chunks, what, gone_status)
                except _Damaged as d:
                    if attempt == 1 and await self._repair(d.digest):
                        continue
                    raise self._damaged(d.digest, what) from None
                resp = web.StreamResponse(headers={"Content-Type": "application/octet-stream"})
                if len(digests) == 1:
                    resp.headers["X-Meshjobs-Blake3"] = digests[0]
                resp.content_length = size
                await resp.prepare(request)
                await self._pour(request, resp, first, chunks, what)
                return resp
            finally:
                # A store may tie a read to its thread: close the reader where it ran.
                await self._blob_call(chunks.close)
        raise AssertionError("unreachable: the second attempt returns or raises")

    def _damaged(self, digest: str, what: str) -> HttpError:
        return HttpError(500, f"blob {digest} ({what}) is damaged on member {self._member} and no "
                              "good copy could be fetched from another member; see the member's "
                              "log, or ask another member (--at)")

    async def _check_all(self, digests: Sequence[str], what: str) -> None:
        """Check every blob of an answer before its headers go out; repair the damaged ones."""
        check = getattr(self._blobs, "check", None)
        if check is None:
            return
        distinct = list(dict.fromkeys(digests))
        bad = await self._blob_call(lambda: [d for d in distinct if check(d) is False])
        for digest in bad:
            if not await self._repair(digest):
                raise self._damaged(digest, what)

    async def _repair(self, digest: str) -> bool:
        """Replace a damaged blob by a good copy from another member (True when done). One
        repair of a digest at a time: later callers wait for the one under way."""
        repair = getattr(self._blobs, "repair", None)
        if repair is None:
            return False
        running = self._repairs.get(digest)
        if running is not None:
            return await asyncio.shield(running)
        fut: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._repairs[digest] = fut
        try:
            self._count_damage("repairs")
            ok = bool(await self._blob_call(repair, digest))
        except Exception as e:
            self._log.error("blob_repair_failed", digest=digest, error=repr(e))
            ok = False
        finally:
            del self._repairs[digest]
        fut.set_result(ok)
        self._count_damage("repaired" if ok else "unrepaired")
        self._log.warning("blob_repair", digest=digest, repaired=ok)
        if ok:
            # Remembered a while, so that a client cut short by the damage learns what happened.
            self._repaired[digest] = None
            while len(self._repaired) > limits.http_repaired_remembered_max:
                del self._repaired[next(iter(self._repaired))]
        return ok

    def _count_damage(self, what: str) -> None:
        self._damage[what] = self._damage.get(what, 0) + 1

    async def _next_chunk(self, chunks: Iterator[bytes], what: str, gone_status: int) -> bytes | None:
        try:
            return await self._blob_call(next, chunks, None)
        except BlobCorrupt as e:
            self._log.error("blob_damaged", what=what, error=str(e))
            self._count_damage("found")
            raise _Damaged(e.digest) from None
        except BlobGone as e:
            raise HttpError(gone_status, f"blob {e.digest} is no longer on this member") from None
        except ValueError as e:
            # Digests here passed is_digest or came from the committed table.
            raise HttpError(400, f"bad blob digest: {e}") from None

    async def _pour(self, request: web.Request, resp: web.StreamResponse, first: bytes | None,
                    chunks: Iterator[bytes], what: str) -> None:
        """Write chunks after the headers went out; damage now can only cut the connection (the
        client sees fewer bytes than Content-Length; meshctl then asks ?check=1 and says why),
        and the damaged blob is repaired meanwhile, so that the next try is served whole."""
        chunk = first
        while chunk is not None:
            try:
                await resp.write(chunk)
            except ConnectionResetError:
                return  # The client went away; nothing left to tell it.
            try:
                chunk = await self._blob_call(next, chunks, None)
            except (BlobCorrupt, BlobGone) as e:
                self._log.error("blob_damaged", what=what, error=str(e), sent_headers=True)
                if request.transport is not None:
                    request.transport.close()
                if isinstance(e, BlobCorrupt):
                    self._count_damage("found")
                    asyncio.get_running_loop().create_task(self._repair(e.digest))
                return
        try:
            await resp.write_eof()
        except ConnectionResetError:
            pass

    # --- fleet, health, metrics, docs -------------------------------------------------------

    async def _fleet(self, request: web.Request) -> web.Response:
        """The fleet: JSON for API clients, its page for a browser (Accept: text/html ranked
        above JSON) or ?format=html."""
        fmt = request.query.get("format")
        if fmt not in (None, "json", "html"):
            raise HttpError(400, "format must be json or html")
        accept = request.headers.get("Accept", "")
        if not (fmt == "html" or (fmt is None and "text/html" in accept
                                  and not _prefers_json(accept))):
            return await self._relay({"op": "fleet"})
        answer = await self._ask({"op": "fleet"})
        if answer.status != 200 or not isinstance(answer.body, dict):
            return web.json_response(answer.body, status=answer.status)
        nonce = secrets.token_urlsafe(16)
        return _html(webui.fleet_page(self._member, answer.body, nonce=nonce), nonce=nonce)

    async def _ui_script(self, request: web.Request) -> web.Response:
        """The one script of the pages: buttons, and live updates (/events, else polling)."""
        return web.Response(text=webui.UI_SCRIPT, content_type="text/javascript",
                            charset="utf-8",
                            headers={"Cache-Control": "no-cache",
                                     "X-Content-Type-Options": "nosniff"})

    async def _only_post(self, request: web.Request) -> web.Response:
        """Any method but POST on a route that takes only POST: 405, saying what it takes."""
        return _error(405, f"{request.method} is not allowed on {request.path}: use POST",
                      {"Allow": "POST"})

    async def _health(self, request: web.Request) -> web.Response:
        fresh = request.query.get("fresh")
        if fresh not in (None, "0", "1"):
            return _error(400, f"fresh must be 0 or 1, not {fresh[:20]!r}")
        try:
            answer = await self._ask({"op": "health"})
        except HttpError:
            return _error(503, f"member {self._member} does not answer: its jobs thread is busy or stuck")
        except Exception as e:
            self._log.warning("http_health_failed", error=repr(e))
            return _error(503, f"member {self._member} is not healthy: {e}")
        status = answer.status
        if (fresh == "1" and isinstance(answer.body, dict)
                and not answer.body.get("fresh")):
            # Asked for a member whose reads are fresh: one cut off from the leader is not.
            status = 503
        return web.json_response(answer.body, status=status)

    async def _metrics(self, request: web.Request) -> web.Response:
        answer = await self._ask({"op": "metrics"})
        if answer.status != 200 or not isinstance(answer.body, dict):
            return web.json_response(answer.body, status=answer.status)
        # Rendered on the loop thread: the numbers are copied here, where they are touched.
        text = self._timings.render(metrics.member_families(answer.body),
                                    metrics.http_families(self._http_numbers()))
        return web.Response(body=text, headers={"Content-Type": metrics.CONTENT_TYPE})

    def _http_numbers(self) -> dict[str, Any]:
        """This thread's numbers, by family (see metrics.HTTP_RULES)."""
        out: dict[str, Any] = {
            "meshjobs_http_requests": dict(self._by_class),
            "meshjobs_http_bad_requests": self._bad_requests,
            "meshjobs_http_auth_refused": dict(self._refused),
            "meshjobs_http_blobs_damaged": dict(self._damage),
            "meshjobs_http_item_streams": self._item_streams,
        }
        gate = self._gate
        if gate is not None:
            out.update({
                "meshjobs_http_conns_open": gate.open_conns,
                "meshjobs_http_conns_max": gate.conns_max,
                "meshjobs_http_conns_accepted": gate.accepted,
                "meshjobs_http_conns_shed": dict(gate.shed),
                "meshjobs_http_accept_errors": gate.accept_errors,
            })
        return out

    async def _openapi(self, request: web.Request) -> web.Response:
        return web.json_response(openapi_document())

    # --- schedules (meshjobs/cron.py) -------------------------------------------------------

    async def _cron_list(self, request: web.Request) -> web.Response:
        return await self._relay({"op": "cron", "action": "list"})

    async def _cron_get(self, request: web.Request) -> web.Response:
        name = cron.parse_name(request.match_info["name"])
        return await self._relay({"op": "cron", "action": "get", "name": name})

    async def _cron_put(self, request: web.Request) -> web.Response:
        """PUT /cron/{name}: add a schedule, or replace it (unless "replace": false)."""
        name = cron.parse_name(request.match_info["name"])
        too_big = (f"a schedule's body has at most {limits.cron_body_bytes_max} bytes: keep "
                   "large inputs in files the job reads")
        if request.content_length is not None and request.content_length > limits.cron_body_bytes_max:
            raise HttpError(413, too_big)
        raw = await self._read_body(request)
        if len(raw) > limits.cron_body_bytes_max:
            raise HttpError(413, too_big)
        body = await self._body_json(request)
        added = cron.parse_add(body)  # refused here with the control's words, before any round trip
        self._check_notify(added["job"])
        self._check_inherit_env(request, added["job"])
        job = dict(body["job"])
        await self._stamp_run_as(request, job)
        body = {**body, "job": job}
        quota = dict(request[CALLER].quota)
        return await self._relay({"op": "cron", "action": "add", "name": name, **body,
                                  **await self._rid(request),
                                  **({"quota": quota} if quota else {})})

    async def _cron_change(self, request: web.Request) -> web.Response:
        """DELETE /cron/{name}, POST /cron/{name}/pause and /resume."""
        name = cron.parse_name(request.match_info["name"])
        action = "rm" if request.method == "DELETE" else request.path.rsplit("/", 1)[1]
        return await self._relay({"op": "cron", "action": action, "name": name,
                                  **await self._rid(request)})


# --- helpers (pure) -------------------------------------------------------------------------


def _route_of(request: web.Request) -> str | None:
    """The template of the route a request matched (None: no route, a 404 or 405)."""
    resource = request.match_info.route.resource
    return None if resource is None else resource.canonical


async def _machine_names() -> frozenset[str]:
    """This machine's host name and fully qualified name (a resolver that hangs is skipped)."""
    names = {socket.gethostname()}
    try:
        names.add(await asyncio.wait_for(
            asyncio.get_running_loop().run_in_executor(None, socket.getfqdn),
            limits.http_fqdn_s_max))
    except (TimeoutError, OSError):
        pass
    return frozenset(n.lower().rstrip(".") for n in names if n)



def _record_json(record: dict) -> Iterator[bytes]:
    """A job record whose "items" is an `ItemRows`, as JSON, in parts: the item records are
    built and encoded `items_json_slice_max` at a time, so that no one call holds the
    interpreter for long (the jobs thread runs between two), and the handler writes each part
    (other requests are served while the client drains them)."""
    rows: ItemRows = record["items"]
    head = json.dumps({k: v for k, v in record.items() if k != "items"})
    yield (head[:-1] + (', "items": [' if len(head) > 2 else '"items": [')).encode()
    step = limits.items_json_slice_max
    for lo in range(0, len(rows), step):
        part = json.dumps(rows.records(lo, lo + step))[1:-1]
        yield ((", " if lo else "") + part).encode()
    yield b"]}"


def _html(text: str, status: int = 200, nonce: str | None = None) -> web.Response:
    script = f"script-src 'nonce-{nonce}'" if nonce else "script-src 'none'"
    return web.Response(text=text, status=status, content_type="text/html", charset="utf-8",
                        headers={"Content-Security-Policy": f"default-src 'none'; {script}; "
                                 "style-src 'unsafe-inline'; connect-src 'self'; "
                                 "form-action 'self'; frame-ancestors 'none'",
                                 "X-Content-Type-Options": "nosniff",
                                 "Referrer-Policy": "same-origin"})


async def _read_all(request: web.Request) -> bytes:
    return await request.read()


class _HexDigests(Sequence[str]):
    """Raw 32-byte digests seen as their hex names, one at a time: a results download of a
    million items holds a million references, not a million strings."""

    def __init__(self, raw: list[bytes]) -> None:
        self._raw = raw

    def __len__(self) -> int:
        return len(self._raw)

    @overload
    def __getitem__(self, i: int) -> str: ...
    @overload
    def __getitem__(self, i: slice) -> list[str]: ...

    def __getitem__(self, i: int | slice) -> str | list[str]:
        if isinstance(i, slice):
            return [d.hex() for d in self._raw[i]]
        return self._raw[i].hex()

    def __iter__(self) -> Iterator[str]:
        return (d.hex() for d in self._raw)


def _chain(blobs: BlobReader, digests: Sequence[str]) -> Iterator[bytes]:
    """The chunks of several blobs, one after the other; opened lazily in the executor."""
    for digest in digests:
        chunks = blobs.open(digest)
        if chunks is None:
            raise BlobGone(digest)  # Collected between its size and its reading.
        yield from chunks


def _prefers_json(accept: str) -> bool:
    """Whether an Accept header ranks application/json above text/html (ties go to HTML)."""
    best = {"json": -1.0, "html": -1.0}
    for part in accept.split(","):
        fields = [f.strip() for f in part.split(";")]
        media = fields[0].lower()
        q = 1.0
        for f in fields[1:]:
            if f.startswith("q="):
                try:
                    q = float(f[2:])
                except ValueError:
                    q = 0.0
        if media in ("application/json", "application/*"):
            best["json"] = max(best["json"], q)
        elif media in ("text/html", "text/*"):
            best["html"] = max(best["html"], q)
        elif media == "*/*":
            best["json"] = max(best["json"], min(q, 0.001))
            best["html"] = max(best["html"], q)
    return best["json"] > best["html"]


def _parse_flag(value: str | None, name: str) -> bool:
    if value is None:
        return False
    v = value.lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("", "0", "false", "no", "off"):
        return False
    raise HttpError(400, f"{name} must be 1 or 0")


def _parse_item_index(value: str) -> int:
    """An item's index in a path: a decimal number below items_max."""
    if not value.isascii() or not value.isdigit() or len(value) > 12 or int(value) >= limits.items_max:
        raise HttpError(400, f"an item index is a number from 0 to {limits.items_max - 1}, "
                             f"not {value[:40]!r}")
    return int(value)


def _parse_offset(value: str | None) -> int:
    """?offset=: bytes of the output to skip (a decimal number, at most log_offset_bytes_max)."""
    if value is None or value == "":
        return 0
    if (not value.isascii() or not value.isdigit() or len(value) > 20
            or int(value) > limits.log_offset_bytes_max):
        raise HttpError(400, f"offset is a number of bytes from 0 to "
                             f"{limits.log_offset_bytes_max}, not {value[:40]!r}")
    return int(value)


def _client_gone(request: web.Request) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()


async def _write(request: web.Request, resp: web.StreamResponse, data: bytes) -> bool:
    """Write bytes of a streamed answer (its headers first, if not sent yet); False when the
    client went away."""
    try:
        if not resp.prepared:
            await resp.prepare(request)
        await resp.write(data)
    except (ConnectionResetError, ConnectionError):
        return False
    return True


def _parse_wait_ms(value: str | None) -> int:
    if value is None or value == "":
        return 0
    try:
        wait = float(value)
    except ValueError:
        wait = math.nan
    if not 0 <= wait <= limits.http_wait_s_max:  # Also refuses NaN.
        raise HttpError(400, f"wait must be a number of seconds from 0 to {limits.http_wait_s_max}")
    return int(wait * 1000)


def _parse_index(value: str | None, name: str, none: bool = False) -> Any:
    """A whole number from 0 (an item's index) in a query; absent: 0, or None with `none`."""
    if value is None or value == "":
        return None if none else 0
    if not (value.isascii() and value.isdigit() and len(value) <= 9
            and int(value) < limits.items_max):
        raise HttpError(400, f"{name} must be a whole number from 0 to {limits.items_max - 1}")
    return int(value)


def _parse_limit(value: str | None) -> int:
    """?limit=N of the job list: 1 to jobs_list_max, jobs_list_default when absent."""
    if value is None or value == "":
        return limits.jobs_list_default
    if not (value.isascii() and value.isdigit() and len(value) <= 9
            and 1 <= int(value) <= limits.jobs_list_max):
        raise HttpError(400, f"limit must be a whole number from 1 to {limits.jobs_list_max}")
    return int(value)


def _decode_items(raw: list) -> list[bytes | tuple[str, int]]:
    """Item entries (shape checked by parse_submit) as bytes to store or (digest, index) refs."""
    out: list[bytes | tuple[str, int]] = []
    for i, item in enumerate(raw):
        if isinstance(item, str):
            try:
                out.append(item.encode("utf-8"))
            except UnicodeEncodeError:
                raise HttpError(400, f"items[{i}] is not valid Unicode text; send it as b64") from None
        elif "b64" in item:
            try:
                out.append(base64.b64decode(item["b64"], validate=True))
            except (binascii.Error, ValueError):
                raise HttpError(400, f"items[{i}].b64 is not valid base64") from None
        else:
            digest = item["blob"]
            if not is_digest(digest):
                raise HttpError(400, f"items[{i}].blob must be a blob digest (64 lowercase hex characters)")
            out.append((digest, i))
    return out
