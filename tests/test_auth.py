"""The trust decisions of meshjobs/auth.py, one rule at a time (table-driven, no IO)."""

from __future__ import annotations

import hashlib

import pytest

from meshjobs import auth, config, limits
from meshjobs.auth import AuthError, Caller, Sessions
from meshjobs.config import Auth, Token


def tok(name: str, role: str, secret: str) -> Token:
    return Token(name, role, hashlib.sha256(secret.encode()).digest())


AUTH = Auth(configured=True, tokens=(tok("r", "read", "tr"), tok("s", "submit", "ts"),
                                     tok("a", "admin", "ta")), allow_anonymous=False)


def test_roles_are_the_configs() -> None:
    """Rule 2: the role order here is the one the config accepts."""
    assert auth.ROLES == config.ROLES


@pytest.mark.parametrize("method,route,metrics,need", [
    ("GET", "/jobs", "open", "read"),
    ("HEAD", "/blobs/{digest}", "open", "read"),
    ("GET", "/jobs/{id}/results", "open", "read"),
    ("GET", "/events", "open", "read"),
    ("GET", None, "open", "read"),  # an unknown path: a read all the same
    ("POST", "/jobs", "open", "submit"),
    ("POST", "/jobs/{id}/cancel", "open", "submit"),
    ("POST", "/jobs/{id}/tone", "open", "submit"),
    ("DELETE", "/jobs/{id}", "open", "admin"),
    ("PUT", "/jobs", "open", "admin"),
    ("POST", None, "open", "admin"),
    ("GET", "/healthz", "read", None),
    ("GET", "/metrics", "open", None),
    ("GET", "/metrics", "read", "read"),
    ("GET", "/login", "open", None),
    ("POST", "/login", "open", None),
    ("POST", "/logout", "open", None),
])
def test_needed_role(method: str, route: str | None, metrics: str, need: str | None) -> None:
    """Rule 2: each method and route needs its role; /healthz and the way in are open."""
    assert auth.needed_role(method, route, metrics) == need


@pytest.mark.parametrize("have,need,ok", [
    ("read", "read", True), ("read", "submit", False), ("read", "admin", False),
    ("submit", "read", True), ("submit", "submit", True), ("submit", "admin", False),
    ("admin", "read", True), ("admin", "submit", True), ("admin", "admin", True),
])
def test_role_order(have: str, need: str, ok: bool) -> None:
    assert auth.role_allows(have, need) is ok


@pytest.mark.parametrize("header", ["Bearer", "Bearer    ", "Basic dXNlcjpwYXNz", "Token abc",
                                    "", "Bearer " + "x" * (limits.http_token_chars_max + 1)])
def test_malformed_authorization_is_401(header: str) -> None:
    """Rule 3: any Authorization but `Bearer TOKEN` (with a token of sane length) is a 401."""
    with pytest.raises(AuthError) as e:
        auth.identify(AUTH, header)
    assert e.value.status == 401 and "MESHJOBS_TOKEN" in e.value.message


def test_token_lookup() -> None:
    """Rule 1: the presented token's SHA-256 finds its entry; anything else finds none."""
    assert auth.find_token(AUTH.tokens, "ts").name == "s"
    assert auth.find_token(AUTH.tokens, "ta").name == "a"
    for wrong in ("", "t", "tss", "TS", "ts ", "t\udcff"):
        assert auth.find_token(AUTH.tokens, wrong) is None
    assert auth.identify(AUTH, "bearer   ts ").name == "s"  # scheme case and spaces


def test_authorize_401_403() -> None:
    """Rule 3: no token 401, wrong token 401, small role 403 naming the role and the token."""
    with pytest.raises(AuthError) as e:
        auth.authorize(AUTH, "GET", "/jobs", None)
    assert (e.value.status, e.value.reason) == (401, "missing")
    with pytest.raises(AuthError) as e:
        auth.authorize(AUTH, "GET", "/jobs", "Bearer nope")
    assert (e.value.status, e.value.reason) == (401, "invalid")
    with pytest.raises(AuthError) as e:
        auth.authorize(AUTH, "POST", "/jobs", "Bearer tr")
    assert e.value.status == 403 and "submit role" in e.value.message and "r " in e.value.message
    with pytest.raises(AuthError) as e:
        auth.authorize(AUTH, "DELETE", "/jobs/{id}", "Bearer ts")
    assert e.value.status == 403 and "admin" in e.value.message and e.value.who == "s"
    assert auth.authorize(AUTH, "DELETE", "/jobs/{id}", "Bearer ta").name == "a"
    assert auth.authorize(AUTH, "GET", "/healthz", None) is None


def test_anonymous_and_open() -> None:
    """Rule 3: allow_anonymous gives a request without a token its role; a wrong token is still
    401; with no [auth] table everything is open."""
    anon = Auth(configured=True, tokens=AUTH.tokens, allow_anonymous=True, anonymous_role="read")
    assert auth.authorize(anon, "GET", "/jobs", None).via == "anonymous"
    with pytest.raises(AuthError) as e:
        auth.authorize(anon, "POST", "/jobs", None)
    assert e.value.status == 403 and "anonymous" in e.value.message
    with pytest.raises(AuthError) as e:
        auth.authorize(anon, "GET", "/jobs", "Bearer wrong")
    assert e.value.status == 401
    assert auth.authorize(Auth(), "DELETE", "/jobs/{id}", None).role == "admin"


def test_session_caller() -> None:
    """A session stands in for a token when the request has no Authorization header."""
    s = Caller("s", "submit", "session")
    assert auth.authorize(AUTH, "POST", "/jobs", None, s) is s
    with pytest.raises(AuthError):
        auth.authorize(AUTH, "POST", "/jobs", "Bearer wrong", s)


@pytest.mark.parametrize("value,split", [
    ("127.0.0.1:7700", ("127.0.0.1", 7700)), ("LocalHost", ("localhost", None)),
    ("[::1]:80", ("::1", 80)), ("[::1]", ("::1", None)), ("::1", ("::1", None)),
    ("meshd.example.org.:443", ("meshd.example.org", 443)),
])
def test_split_host(value: str, split: tuple) -> None:
    assert auth.split_host(value) == split


@pytest.mark.parametrize("value", ["", ":80", "a:b", "a:0", "a:70000", "[::1", "[::1]x", "a/b",
                                   "user@host", "x" * 400, "[zz]:1"])
def test_split_host_garbage(value: str) -> None:
    with pytest.raises(ValueError):
        auth.split_host(value)


@pytest.mark.parametrize("host,ok", [
    ("127.0.0.1:1", True), ("[::1]:1", True), ("10.0.0.7", True), ("localhost:9", True),
    ("meshd.test", True), ("MESHD.TEST:8", True), ("attacker.example", False),
    ("localhost.attacker.example", False), (None, True),
])
def test_check_host(host: str | None, ok: bool) -> None:
    """Rule 4: IP literals, localhost and the configured names are answered; others are 421."""
    names = frozenset({"meshd.test"})
    if ok:
        auth.check_host(host, names)
    else:
        with pytest.raises(AuthError) as e:
            auth.check_host(host, names)
        assert e.value.status == 421 and "[http] names" in e.value.message
    auth.check_host("anything.example", frozenset({"*"}))


@pytest.mark.parametrize("headers,method,ok", [
    ({}, "POST", True),
    ({"Origin": "http://127.0.0.1:7700"}, "POST", True),
    ({"Origin": "http://localhost:7700"}, "DELETE", True),
    ({"Origin": "http://attacker.example"}, "POST", False),
    ({"Origin": "http://127.0.0.1:7701"}, "POST", False),
    ({"Origin": "https://127.0.0.1:7700"}, "POST", False),
    ({"Origin": "null"}, "POST", False),
    ({"Origin": "http://127.0.0.1:7700/x"}, "POST", False),
    ({"Sec-Fetch-Site": "cross-site"}, "POST", False),
    ({"Sec-Fetch-Site": "same-origin", "Origin": "http://127.0.0.1:7700"}, "POST", True),
    ({"Origin": "http://attacker.example", "Sec-Fetch-Site": "cross-site"}, "GET", True),
])
def test_check_origin(headers: dict, method: str, ok: bool) -> None:
    """Rule 4: a browser's change comes from one of the member's own origins only."""
    if ok:
        auth.check_origin(headers, method, "http", 7700, frozenset())
    else:
        with pytest.raises(AuthError) as e:
            auth.check_origin(headers, method, "http", 7700, frozenset())
        assert e.value.status == 403


def test_csrf_value_bound_to_session() -> None:
    key = b"k" * 32
    auth.check_csrf(key, None, auth.csrf_value(key, None))
    auth.check_csrf(key, "sid", auth.csrf_value(key, "sid"))
    for sid, presented in ((None, None), (None, ""), ("sid", auth.csrf_value(key, None)),
                           (None, auth.csrf_value(b"x" * 32, None)), (None, "\udcff")):
        with pytest.raises(AuthError) as e:
            auth.check_csrf(key, sid, presented)
        assert e.value.status == 403 and "X-Meshjobs-Csrf" in e.value.message


def test_browser_detection() -> None:
    assert not auth.looks_like_browser({"User-Agent": "curl/8", "Accept": "*/*"})
    for h in ("Origin", "Cookie", "Sec-Fetch-Mode", "sec-fetch-site"):
        assert auth.looks_like_browser({h: "x"})


def test_sessions_bounded_and_expiring() -> None:
    """Rule 5: sessions end after their time, and the oldest goes when the store is full."""
    s = Sessions(max_count=2, ttl_s=10.0)
    c = Caller("s", "submit", "token")
    s.open("one", c, now_s=0.0)
    s.open("two", c, now_s=1.0)
    assert s.get("one", 5.0).via == "session" and len(s) == 2
    s.open("three", c, now_s=2.0)
    assert len(s) == 2 and s.get("one", 2.0) is None and s.get("two", 2.0) is not None
    assert s.get("two", 11.0) is None and s.get("three", 11.0) is not None
    s.close("three")
    assert s.get("three", 11.5) is None
    assert s.get(None, 0.0) is None and s.get("x" * 10_000, 0.0) is None


@pytest.mark.parametrize("value,out", [
    ("/jobs?state=running", "/jobs?state=running"), (None, "/jobs"), ("", "/jobs"),
    ("//evil.example/", "/jobs"), ("https://evil.example/", "/jobs"), ("/\\evil", "/jobs"),
    ("/a\r\nSet-Cookie: x", "/jobs"),
])
def test_safe_next(value: str | None, out: str) -> None:
    assert auth.safe_next(value) == out


def test_an_identitys_logins_never_push_out_anothers_sessions() -> None:
    """Rule 5: past its own cap an identity loses its own oldest session; a full store loses
    the oldest session of the identity holding the most, never the lone admin's."""
    s = Sessions(max_count=8, ttl_s=100.0, per_identity_max=4)
    admin, reader = Caller("ops", "admin", "token"), Caller("reader", "read", "token")
    s.open("admin-1", admin, now_s=0.0)
    for i in range(1_025):
        s.open(f"read-{i}", reader, now_s=1.0 + i / 1000)
    assert s.get("admin-1", 2.0) == Caller("ops", "admin", "session")
    assert s.count_of("reader") == 4 and len(s) == 5
    assert s.get("read-1024", 2.0) is not None and s.get("read-1020", 2.0) is None
    # Many identities fill the store: the one holding the most gives up its oldest.
    for k in range(3):
        s.open(f"other-{k}", Caller(f"o{k}", "read", "token"), now_s=3.0)
    assert len(s) == 8
    s.open("other-3", Caller("o3", "read", "token"), now_s=4.0)
    assert len(s) == 8 and s.count_of("reader") == 3 and s.get("admin-1", 4.0) is not None
    assert s.get("read-1021", 4.0) is None and s.get("read-1022", 4.0) is not None
    assert s.evicted == 1_021 + 1


def test_sessions_expire_by_identity_and_close_cleanly() -> None:
    """Expired and closed sessions leave their identity's count; a reused id replaces."""
    s = Sessions(max_count=4, ttl_s=10.0, per_identity_max=2)
    c = Caller("a", "read", "token")
    s.open("x", c, 0.0)
    s.open("x", c, 1.0)
    assert len(s) == 1 and s.count_of("a") == 1
    s.open("y", c, 2.0)
    s.close("x")
    s.close("x")
    s.close("nosuch")
    assert s.count_of("a") == 1
    s.open("z", Caller("b", "read", "token"), 20.0)  # y expired meanwhile
    assert s.count_of("a") == 0 and len(s) == 1
    with pytest.raises(ValueError):
        Sessions(max_count=2, ttl_s=1.0, per_identity_max=3)


def test_login_limiter_is_a_token_bucket_per_address() -> None:
    """A burst of logins from one address, then one per refill; other addresses untouched."""
    from meshjobs.auth import LoginLimiter

    lim = LoginLimiter(burst=3, refill_s=2.0, clients_max=2)
    assert [lim.take("a", 0.0) for _ in range(3)] == [None, None, None]
    assert lim.take("a", 0.0) == pytest.approx(2.0)
    assert lim.take("a", 1.0) == pytest.approx(1.0)  # a refused try costs nothing more
    assert lim.take("b", 1.0) is None
    assert lim.take("a", 2.0) is None and lim.take("a", 2.0) is not None
    assert lim.take("a", 100.0) is None  # refilled, but never past the burst
    assert [lim.take("a", 100.0) for _ in range(3)] == [None, None, 2.0]
    assert lim.refused == 4
    lim.take("c", 101.0)  # a third address: the longest idle ("b") is forgotten
    assert len(lim) == 2


@pytest.mark.parametrize("req", [
    {"by": "x" * 65, "by_role": "submit"}, {"by": "a b", "by_role": "submit"},
    {"by": "", "by_role": "submit"}, {"by": 5, "by_role": "submit"},
    {"by": "ci", "by_role": "root"}, {"by": "ci"}, {"by_role": "admin"},
    {"by": "ci\x00", "by_role": "admin"}, {"by": ["ci"], "by_role": "admin"},
])
def test_hostile_by_is_refused(req: dict) -> None:
    from meshjobs.control import ControlError, parse_request

    with pytest.raises(ControlError):
        parse_request({"op": "cancel", "rid": "r1", "id": "j1", **req})


@pytest.mark.parametrize("run_as", [
    "alice", [1001], ["-rf"], ["a" * 40], [None], ["*"] * 0 + [["x"]],
    ["u"] * 65, ["../etc"], ["1:2:3"], [str(2**32)],
])
def test_hostile_run_as_is_refused(run_as: object, tmp_path) -> None:
    """[auth] tokens run_as: anything but a short list of users is a config problem."""
    import json as _json

    from meshjobs.config import ConfigError, load_config

    path = tmp_path / "m.toml"
    path.write_text('name = "m"\n[auth]\ntokens = [ { name = "t", role = "submit", sha256 = "'
                    + "ab" * 32 + f'", run_as = {_json.dumps(run_as)} }} ]\n')
    with pytest.raises(ConfigError) as e:
        load_config(str(path))
    assert "run_as" in str(e.value)


def test_run_as_defaults_and_local_identity() -> None:
    from meshjobs.identity import job_user

    assert auth.identify(Auth(), None) == Caller("local", "admin", "open")
    anon = Auth(configured=True, tokens=(), allow_anonymous=True, anonymous_role="submit")
    assert auth.identify(anon, None).run_as == ()
    def never_root(u: str) -> bool:
        return u in ("root", "0")
    assert job_user("local", None, "0", never_root) == "0"  # local may run as anyone
    assert job_user("t", ("*",), None, never_root) is None
    with pytest.raises(Exception, match="root"):
        job_user("t", ("*", "alice"), "root", never_root)
    assert job_user("t", ("root",), "0", never_root) == "0"
