"""Who may ask a member what over HTTP: tokens, roles, sessions, and the browser's checks.

Theory of operation. The HTTP edge (meshjobs/http.py) asks this module, for each request, a few
questions whose answers depend only on the request's method, route and headers, on the config,
and on a clock reading handed in; nothing here touches the network, the clock or randomness.

Rule 1: a token is never kept, only its SHA-256 (the config's `[auth] tokens`). A presented
        token is hashed and compared with every configured digest in constant time
        (`hmac.compare_digest`), without stopping at the first match, so that the time taken
        says nothing about which digest, or how much of one, matched.
Rule 2: roles are ordered, each may do what the ones before it may: `read` (GET and HEAD,
        and POST /jobs/status, a read with a body), `submit` (also changes to jobs: submit,
        cancel, tone, of one job or many; schedules), `admin` (everything, forget and bulk forget
        included). A route not listed needs `admin` unless it is a read.
Rule 3: no token, or a token that matches none, is 401 (except that with `allow_anonymous` a
        request with no Authorization header at all gets `anonymous_role`); a wrong token is 401
        even then. A token whose role is too small is 403, naming the role needed.
Rule 4: a browser is told apart by the headers only browsers send (Origin, Cookie, Sec-Fetch-*).
        Its changes must come from one of the member's own origins and carry the member's
        anti-CSRF value; a `Host` the member does not answer to is refused (DNS rebinding).
Rule 5: sessions (a browser's cookie after POST /login) are bounded in count and in age, in
        all and per identity (one identity's logins never push out another's sessions); the
        store keeps the SHA-256 of each session id, never the id. Logins are rate-limited per
        client address (a token bucket, LoginLimiter).
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from meshjobs import limits
from meshjobs.control import ANONYMOUS, LOCAL
from meshjobs.identity import default_run_as

ROLES = ("read", "submit", "admin")  # the same order as meshjobs.config.ROLES
READ_METHODS = frozenset({"GET", "HEAD"})
# Routes (aiohttp's canonical templates) whose changes need only `submit`.
SUBMIT_ROUTES = frozenset({("POST", "/jobs"), ("POST", "/jobs/{id}/cancel"),
                           ("POST", "/jobs/{id}/tone"), ("POST", "/jobs/cancel"),
                           ("POST", "/jobs/tone")})
# A finished job run again is a change of the submitter's own kind (meshjobs.reruns).
SUBMIT_ROUTES |= frozenset({("POST", "/jobs/{id}/rerun")})
# Schedules are submits that come back: adding, pausing and removing one needs `submit` too.
SUBMIT_ROUTES = SUBMIT_ROUTES | {("PUT", "/cron/{name}"), ("DELETE", "/cron/{name}"),
                                 ("POST", "/cron/{name}/pause"), ("POST", "/cron/{name}/resume")}
# Routes that read with a POST (a body names what to read): they need only `read`.
READ_POST_ROUTES = frozenset({("POST", "/jobs/status")})
# Routes anybody may use: the way in and out, and a health check for load balancers.
OPEN_ROUTES = frozenset({("GET", "/healthz"), ("HEAD", "/healthz"), ("GET", "/login"),
                         ("HEAD", "/login"), ("POST", "/login"), ("POST", "/logout")})
TOKEN_HINT = "set MESHJOBS_TOKEN or pass meshctl --token-file (a browser: log in at /login)"


class AuthError(Exception):
    """A request refused for who sent it or where from: `status` and a message that says what
    to do. `reason` is the short label it is counted under."""

    def __init__(self, status: int, reason: str, message: str, who: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.reason = reason
        self.message = message
        self.who = who


class TokenLike(Protocol):
    name: str
    role: str
    sha256: bytes


class AuthLike(Protocol):
    configured: bool
    tokens: tuple[Any, ...]
    allow_anonymous: bool
    anonymous_role: str
    metrics: str


@dataclass(frozen=True)
class Caller:
    """Who a request comes from: a token's (or session's) name, "anonymous" (no token, with
    allow_anonymous), or "local" (a member without [auth]: one person's machine)."""

    name: str
    role: str
    via: str  # "token", "session", "anonymous" or "open" (no [auth] table)
    # The users its jobs may run as (meshjobs/identity.py Rule 2); None: any (`local`).
    run_as: tuple[str, ...] | None = None
    # Its quota (config.Quota.as_request pairs: pending_items_max, ...); empty: no limit.
    quota: tuple[tuple[str, int], ...] = ()


def role_allows(have: str, need: str) -> bool:
    """Whether a caller with role `have` may do what needs role `need` (Rule 2)."""
    return ROLES.index(have) >= ROLES.index(need)


def needed_role(method: str, route: str | None, metrics: str = "open") -> str | None:
    """The role a request needs (None: open to all). `route` is the matched route's template,
    None when no route matched (the answer will be 404 or 405)."""
    method = method.upper()
    if route is not None and (method, route) in OPEN_ROUTES:
        return None
    if route == "/metrics" and method in READ_METHODS:
        return "read" if metrics == "read" else None
    if method in READ_METHODS or (route is not None and (method, route) in READ_POST_ROUTES):
        return "read"
    if route is not None and (method, route) in SUBMIT_ROUTES:
        return "submit"
    return "admin"


def bearer(header: str | None) -> str | None:
    """The token of an `Authorization: Bearer TOKEN` header; None when the header is absent.
    Raises AuthError(401) for any other scheme, an empty or an oversized token."""
    if header is None:
        return None
    scheme, _, token = header.strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer":
        raise AuthError(401, "malformed", "the Authorization header must be `Bearer TOKEN`; "
                        + TOKEN_HINT)
    if not token:
        raise AuthError(401, "malformed", "the Authorization header has no token after Bearer; "
                        + TOKEN_HINT)
    if len(token) > limits.http_token_chars_max:
        raise AuthError(401, "malformed", f"the token is longer than {limits.http_token_chars_max} "
                        "characters, so it is none of this member's; " + TOKEN_HINT)
    return token


def find_token(tokens: Iterable[TokenLike], presented: str) -> TokenLike | None:
    """The configured token whose digest is the presented token's SHA-256 (Rule 1)."""
    digest = hashlib.sha256(presented.encode("utf-8", "surrogateescape")).digest()
    found = None
    for t in tokens:
        if hmac.compare_digest(digest, t.sha256) and found is None:
            found = t
    return found


def identify(auth: AuthLike, header: str | None, session: Caller | None = None) -> Caller:
    """Who sent a request: from its Authorization header, else its session, else anonymous.
    Raises AuthError(401) when nobody may be assumed (Rule 3)."""
    if not auth.configured:
        return Caller(LOCAL, "admin", "open")
    token = bearer(header)
    if token is not None:
        t = find_token(auth.tokens, token)
        if t is None:
            raise AuthError(401, "invalid", "the token is none of this member's tokens; "
                            + TOKEN_HINT)
        quota = getattr(t, "quota", None)
        return Caller(t.name, t.role, "token", tuple(getattr(t, "run_as", ())),
                      tuple(quota.as_request().items()) if quota is not None else ())
    if session is not None:
        return session
    if auth.allow_anonymous:
        quota = getattr(auth, "quota", None)
        return Caller(ANONYMOUS, auth.anonymous_role, "anonymous",
                      default_run_as(auth.anonymous_role),
                      tuple(quota.as_request().items()) if quota is not None else ())
    raise AuthError(401, "missing", "this member wants a token: " + TOKEN_HINT)


def authorize(auth: AuthLike, method: str, route: str | None, header: str | None,
              session: Caller | None = None) -> Caller | None:
    """The caller of a request that may go on (None: an open route, nobody asked), or raises
    AuthError: 401 for who, 403 for a role too small."""
    need = needed_role(method, route, auth.metrics)
    if need is None:
        return None
    caller = identify(auth, header, session)
    if not role_allows(caller.role, need):
        what = f"{method.upper()} {route}" if route else method.upper()
        raise AuthError(403, "role", f"{what} needs the {need} role; {caller.name} "
                        f"({caller.via}) has the {caller.role} role. Use a token with the {need} "
                        "role (ask the member's operator)", who=caller.name)
    return caller


# --- Host and Origin (Rule 4) -----------------------------------------------------------------


def split_host(value: str) -> tuple[str, int | None]:
    """A Host header's (or an origin's authority's) host, lowercased, and port (None: absent).
    Raises ValueError for something that is no host."""
    value = value.strip()
    if not value or len(value) > 300:
        raise ValueError("empty or oversized host")
    if value.startswith("["):
        host, sep, rest = value[1:].partition("]")
        if not sep or (rest and not rest.startswith(":")):
            raise ValueError("broken IPv6 literal")
        port_s = rest[1:] if rest else None
        ipaddress.IPv6Address(host.split("%")[0])
    elif value.count(":") > 1:
        host, port_s = value, None  # a bare IPv6 literal, as some clients send it
        ipaddress.IPv6Address(host.split("%")[0])
    else:
        host, sep, port_s = value.partition(":")
        if not sep:
            port_s = None
    port = None
    if port_s is not None:
        if not port_s.isdigit() or not 0 < int(port_s) < 65536:
            raise ValueError("bad port")
        port = int(port_s)
    host = host.lower().rstrip(".")
    if not host or any(c in host for c in "/\\@ \t?#"):
        raise ValueError("bad host")
    return host, port


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host.split("%")[0])
    except ValueError:
        return False
    return True


def host_allowed(host: str, names: frozenset[str]) -> bool:
    """Whether a member answers to `host` (already split and lowercased): any IP literal (a
    rebinding attack needs a name), `localhost`, or one of `names` ("*": any)."""
    return "*" in names or _is_ip(host) or host == "localhost" or host in names


def check_host(header: str | None, names: frozenset[str]) -> None:
    """Raises AuthError(421) for a Host this member does not answer to (DNS rebinding)."""
    if header is None:
        return  # HTTP/1.0 without Host: no browser sends that
    try:
        host, _ = split_host(header)
    except ValueError:
        raise AuthError(400, "host", "the Host header is not a host name or address") from None
    if not host_allowed(host, names):
        raise AuthError(421, "host", f"this member does not answer to the name {host[:100]!r}; "
                        "if it is one of its names, add it to the config's [http] names")


def check_origin(headers: Any, method: str, scheme: str, port: int,
                 names: frozenset[str]) -> None:
    """A change from a browser comes from one of the member's own origins (scheme://host:port
    with an allowed host) and not from another site. Raises AuthError(403)."""
    if method.upper() in READ_METHODS:
        return
    if (headers.get("Sec-Fetch-Site") or "").lower() == "cross-site":
        raise AuthError(403, "cross_site", "a request from another site may not change anything "
                        "here; use this member's own pages, meshctl or curl")
    origin = headers.get("Origin")
    if origin is None:
        return
    want = "https" if scheme == "https" else "http"
    try:
        o_scheme, sep, authority = origin.partition("://")
        if not sep or o_scheme.lower() != want or "/" in authority:
            raise ValueError(origin)
        host, o_port = split_host(authority)
    except ValueError:
        raise AuthError(403, "origin", f"a change from origin {origin[:100]!r} is refused: only "
                        "this member's own pages may change things from a browser") from None
    if not host_allowed(host, names) or (o_port or (443 if want == "https" else 80)) != port:
        raise AuthError(403, "origin", f"a change from origin {origin[:100]!r} is refused: only "
                        "this member's own pages may change things from a browser (add its "
                        "name to [http] names if it is this member's)")


def looks_like_browser(headers: Any) -> bool:
    """Whether a request carries a header that browsers send and meshctl or curl do not."""
    if "Origin" in headers or "Cookie" in headers:
        return True
    return any(k.lower().startswith("sec-fetch-") for k in headers)


def csrf_value(key: bytes, session_id: str | None) -> str:
    """The anti-CSRF value the member's pages carry: bound to the browser's session, if any."""
    return hmac.new(key, b"csrf\0" + (session_id or "").encode(), hashlib.sha256).hexdigest()


def check_csrf(key: bytes, session_id: str | None, presented: str | None) -> None:
    if presented is None or not hmac.compare_digest(
            csrf_value(key, session_id).encode(), presented.encode("utf-8", "surrogateescape")):
        raise AuthError(403, "csrf", "a change from a browser must carry the X-Meshjobs-Csrf "
                        "header of this member's pages; reload the page and try again")


# --- sessions (Rule 5) ------------------------------------------------------------------------


class Sessions:
    """Browser sessions after POST /login: session id -> (caller, expiry), bounded in all and
    per identity, so that one identity's logins never push out another's sessions: past
    `per_identity_max` an identity's own oldest session goes; when the whole store is full,
    the oldest session of the identity holding the most goes."""

    def __init__(self, max_count: int, ttl_s: float,
                 per_identity_max: int | None = None) -> None:
        if per_identity_max is None:
            per_identity_max = min(max_count, limits.http_sessions_per_identity_max)
        if not 0 < per_identity_max <= max_count:
            raise ValueError("per_identity_max must be in 1..max_count")
        self._max = max_count
        self._per_identity_max = per_identity_max
        self._ttl_s = ttl_s
        # Insertion order is expiry order (every session lives ttl_s): oldest first.
        self._by_digest: dict[bytes, tuple[Caller, float]] = {}
        self._of: dict[str, dict[bytes, None]] = {}  # identity name -> its sessions, oldest first
        self.evicted = 0  # sessions pushed out before their time (counted, for /metrics)

    def __len__(self) -> int:
        return len(self._by_digest)

    def count_of(self, name: str) -> int:
        """The live (not yet expired) sessions the identity `name` holds."""
        return len(self._of.get(name, ()))

    @staticmethod
    def _digest(session_id: str) -> bytes:
        return hashlib.sha256(session_id.encode("utf-8", "surrogateescape")).digest()

    def open(self, session_id: str, caller: Caller, now_s: float) -> None:
        """Remember a new session; the identity's own oldest goes when it holds its cap, and
        the oldest of the identity holding the most when the store is full."""
        self._expire(now_s)
        mine = self._of.get(caller.name)
        if mine is not None and len(mine) >= self._per_identity_max:
            self._drop(next(iter(mine)))
            self.evicted += 1
        while len(self._by_digest) >= self._max:
            most = max(self._of.values(), key=len)
            self._drop(next(iter(most)))
            self.evicted += 1
        d = self._digest(session_id)
        if d in self._by_digest:
            self._drop(d)
        # The session is the caller as it logged in (its run_as too), only its way in differs.
        self._by_digest[d] = (dataclasses.replace(caller, via="session"), now_s + self._ttl_s)
        self._of.setdefault(caller.name, {})[d] = None

    def get(self, session_id: str | None, now_s: float) -> Caller | None:
        if not session_id or len(session_id) > limits.http_token_chars_max:
            return None
        d = self._digest(session_id)
        found = self._by_digest.get(d)
        if found is None:
            return None
        if found[1] <= now_s:
            self._drop(d)
            return None
        return found[0]

    def close(self, session_id: str | None) -> None:
        if session_id:
            d = self._digest(session_id)
            if d in self._by_digest:
                self._drop(d)

    def _drop(self, d: bytes) -> None:
        caller, _until = self._by_digest.pop(d)
        mine = self._of[caller.name]
        del mine[d]
        if not mine:
            del self._of[caller.name]

    def _expire(self, now_s: float) -> None:
        # Oldest first: stop at the first that still lives.
        for d, (_, until) in list(self._by_digest.items()):
            if until > now_s:
                break
            self._drop(d)


class LoginLimiter:
    """POST /login per client address: a token bucket of `burst` logins that refills one every
    `refill_s`; bounded in the addresses it keeps (the longest idle goes first, which is one
    whose bucket has refilled the most)."""

    def __init__(self, burst: int = limits.http_login_burst_max,
                 refill_s: float = limits.http_login_refill_s,
                 clients_max: int = limits.http_login_clients_max) -> None:
        self._burst = burst
        self._refill_s = refill_s
        self._clients_max = clients_max
        # address -> (logins left, when counted), least recently seen first.
        self._buckets: dict[str, tuple[float, float]] = {}
        self.refused = 0  # logins refused for coming too fast (counted, for /metrics)
        self.failed = 0  # logins with a token that is none of the member's

    def __len__(self) -> int:
        return len(self._buckets)

    def take(self, client: str, now_s: float) -> float | None:
        """Take one login for `client`: None when it may go on, else the seconds until it may
        try again (for Retry-After)."""
        left, when = self._buckets.pop(client, (float(self._burst), now_s))
        left = min(float(self._burst), left + max(0.0, now_s - when) / self._refill_s)
        if left < 1.0:
            self._buckets[client] = (left, now_s)
            self.refused += 1
            return (1.0 - left) * self._refill_s
        self._buckets[client] = (left - 1.0, now_s)
        while len(self._buckets) > self._clients_max:
            del self._buckets[next(iter(self._buckets))]
        return None


def safe_next(value: str | None) -> str:
    """Where to go after logging in: a path on this member, never another site."""
    if (not value or not value.startswith("/") or value.startswith("//") or "\\" in value
            or any(ord(c) < 0x21 or ord(c) == 0x7f for c in value) or len(value) > 2000):
        return "/jobs"
    return value
