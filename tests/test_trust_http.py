"""Trust on a member's HTTP port, against real meshd processes: tokens and roles, TLS, meshctl's
token and certificate options, and what a browser may do (issue 9, points 1 and 5)."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.parse

import pytest

from tests.helpers import Meshd, env_with_path, make_cert, running, token_line, wait_until

pytestmark = pytest.mark.fleet

TOKENS = {"reader": ("read", "tok-read-5b1f"), "ci": ("submit", "tok-submit-9c2e"),
          "ops": ("admin", "tok-admin-77aa")}
ROLE_TOKEN = {role: secret for role, secret in TOKENS.values()}
# Any of a member's names, for the Host checks.
NAMES = '["meshd.test"]'


def write_config(folder: str, name: str, auth: str = "", http: str = "") -> str:
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"{name}.toml")
    with open(path, "w") as f:
        f.write(f'name = "{name}"\n[pools.default]\nslots = 2\n')
        if http:
            f.write(f"[http]\n{http}\n")
        if auth:
            f.write(f"[auth]\n{auth}\n")
    return path


def tokens_toml() -> str:
    return "tokens = [ " + ", ".join(token_line(n, r, t) for n, (r, t) in TOKENS.items()) + " ]\n"


def _running(tmp_path_factory, name: str, auth: str, http: str = ""):
    """A started member named `name` with `auth` as its [auth] table; stopped after use."""
    top = str(tmp_path_factory.mktemp(name))
    cfg = write_config(top, name, auth, http=http)
    yield from running(Meshd(os.path.join(top, name), name=name, config=cfg,
                             token=ROLE_TOKEN["admin"]))


@pytest.fixture(scope="module")
def closed(tmp_path_factory):
    """A member with tokens, no anonymous access, /metrics closed, and one more name."""
    yield from _running(tmp_path_factory, "closed", tokens_toml() + 'metrics = "read"\n',
                        http=f"names = {NAMES}")


@pytest.fixture(scope="module")
def anon(tmp_path_factory):
    """A member with tokens that lets a request without one read (and /metrics open)."""
    yield from _running(tmp_path_factory, "anon",
                        tokens_toml() + 'allow_anonymous = true\nanonymous_role = "read"\n')


@pytest.fixture(scope="module")
def open_member(tmp_path_factory):
    """A member bound to loopback with no [auth] table: open, as the quick start runs it."""
    yield from running(Meshd(str(tmp_path_factory.mktemp("open") / "m1"), slots=2))


def job_ids(m: Meshd) -> set[str]:
    status, jobs = m.request("GET", "/jobs?format=json")
    assert status == 200, jobs
    return {j["id"] for j in jobs}


def origin(m: Meshd) -> str:
    u = urllib.parse.urlsplit(m.url)
    return f"{u.scheme}://{u.netloc}"


# --- tokens and roles (point 1) ---------------------------------------------------------------

# (method, path, body, role needed): every route of the API.
ROUTES = [
    ("GET", "/jobs?format=json", None, "read"),
    ("GET", "/jobs/nosuch", None, "read"),
    ("GET", "/jobs/nosuch/results", None, "read"),
    ("GET", "/jobs/nosuch/items/0/stdout", None, "read"),
    ("GET", "/jobs/nosuch/items/0/stderr?follow=1", None, "read"),
    ("HEAD", "/blobs/" + "0" * 64, None, "read"),
    ("GET", "/blobs/" + "0" * 64, None, "read"),
    ("GET", "/fleet", None, "read"),
    ("GET", "/openapi.json", None, "read"),
    ("GET", "/metrics", None, "read"),  # closed by metrics = "read"
    ("POST", "/jobs", {"argv": ["true"], "hold": True}, "submit"),
    ("POST", "/jobs/nosuch/cancel", None, "submit"),
    ("POST", "/jobs/nosuch/tone", {"priority": 1}, "submit"),
    ("POST", "/jobs/nosuch/rerun", {"failed_only": True}, "submit"),
    ("DELETE", "/jobs/nosuch", None, "admin"),
    ("POST", "/jobs/status", {"ids": ["nosuch"]}, "read"),
    ("POST", "/jobs/cancel", {"ids": ["nosuch"]}, "submit"),
    ("POST", "/jobs/tone", {"ids": ["nosuch"], "set": {"priority": 1}}, "submit"),
    ("POST", "/jobs/forget", {"ids": ["nosuch"]}, "admin"),
    ("POST", "/jobs/forget", {"filter": {"state": "done"}, "dry_run": True}, "admin"),
    ("GET", "/history", None, "read"),
    ("GET", "/cron", None, "read"),
    ("GET", "/cron/nosuch", None, "read"),
    ("PUT", "/cron/role", {"spec": "@yearly", "job": {"argv": ["true"], "hold": True}}, "submit"),
    ("POST", "/cron/nosuch/pause", None, "submit"),
    ("POST", "/cron/nosuch/resume", None, "submit"),
    ("DELETE", "/cron/nosuch", None, "submit"),
    ("GET", "/healthz", None, None),
    ("GET", "/login", None, None),
]


@pytest.mark.parametrize("who", [None, "wrong", "read", "submit", "admin"])
@pytest.mark.parametrize("method,path,body,need", ROUTES,
                         ids=[f"{r[0]} {r[1][:24]}" for r in ROUTES])
def test_every_role_on_every_route(closed, who, method, path, body, need):
    """No token or a wrong one: 401 (with WWW-Authenticate: Bearer and what to do); a role too
    small: 403 naming the role needed and the token's name; enough: the route's own answer."""
    headers = {"Content-Type": "application/json", "Accept": "application/json"}
    token = {None: None, "wrong": "tok-nobody"}.get(who, ROLE_TOKEN.get(who or ""))
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    raw = None
    if body is not None:
        if "argv" in body:
            body = {**body, "id": f"role-{who}-{len(path)}"}
        raw = json.dumps(body).encode()
    status, h, data = closed.raw_request(method, path, raw, headers)
    roles = ("read", "submit", "admin")
    if need is None or (who in roles and roles.index(who) >= roles.index(need)):
        assert status not in (401, 403), (status, data)
        return
    if who in (None, "wrong"):
        assert status == 401, (status, data)
        assert h["WWW-Authenticate"].startswith("Bearer")
        if method != "HEAD":
            assert "MESHJOBS_TOKEN" in json.loads(data)["error"]
    else:
        assert status == 403, (status, data)
        if method != "HEAD":
            error = json.loads(data)["error"]
            name = next(n for n, (r, _) in TOKENS.items() if r == who)
            assert f"{need} role" in error and name in error
    assert h.get("Set-Cookie") is None


def test_refused_submits_run_nothing(closed):
    """Only the submits allowed above made jobs (a read token's and no token's did not)."""
    ids = job_ids(closed)
    assert "role-None-5" not in ids and "role-wrong-5" not in ids and "role-read-5" not in ids


@pytest.mark.parametrize("auth_header", [
    b"Bearer", b"Bearer ", b"Basic dXNlcjpwYXNzd29yZA==", b"Token tok-admin-77aa",
    b"Bearer tok-admin-77aa-", b"Bearer " + "tök".encode(), b"Bearer \xff\xfe",
    b"Bearer " + b"x" * 10_240, b"Bearer " + b"y" * 5000,
])
def test_malformed_authorization(closed, auth_header):
    """Malformed, foreign-scheme, oversized and non-ASCII Authorization headers are refused
    (401, or 400 when the header is over the server's header limit) and submit nothing."""
    body = json.dumps({"argv": ["true"], "id": "malformed"}).encode()
    status, h, data = closed.raw_request("POST", "/jobs", body, {
        "Authorization": auth_header, "Content-Type": "application/json"})
    assert status in (400, 401), (status, data)
    if status == 401:
        assert h["WWW-Authenticate"].startswith("Bearer")
        assert "error" in json.loads(data)
    assert "malformed" not in job_ids(closed)
    status, _ = closed.request("GET", "/healthz", auth=False)
    assert status == 200


def test_metrics_count_refusals_and_healthz_is_open(closed):
    """/healthz needs no token; /metrics needs the read role here, and counts refusals."""
    status, body = closed.request("GET", "/healthz", auth=False)
    assert status == 200 and body["ok"]
    assert closed.request("GET", "/metrics", auth=False)[0] == 401
    closed.request("GET", "/fleet", headers={"Authorization": "Bearer nope"}, auth=False)
    m = closed.metrics()  # with the admin token
    assert m['meshjobs_http_auth_refused_total{reason="invalid"}'] >= 1
    assert m['meshjobs_http_auth_refused_total{reason="missing"}'] >= 1
    log = closed.log_tail(200_000)
    assert "http_refused" in log
    for _, secret in TOKENS.values():
        assert secret not in log  # a token is never logged


def test_anonymous_role(anon):
    """allow_anonymous: no Authorization gets anonymous_role (read here); a wrong token is still
    401; /metrics is open by default."""
    status, jobs = anon.request("GET", "/jobs?format=json", auth=False)
    assert status == 200 and isinstance(jobs, list)
    status, body = anon.request("POST", "/jobs", {"argv": ["true"], "id": "anon1"}, auth=False)
    assert status == 403 and "submit role" in body["error"] and "anonymous" in body["error"]
    status, body = anon.request("GET", "/jobs", headers={"Authorization": "Bearer wrong"},
                                auth=False)
    assert status == 401
    assert anon.request("GET", "/metrics", auth=False)[0] == 200
    status, rec = anon.request("POST", "/jobs", {"argv": ["true"], "id": "anon2"})
    assert status == 201
    assert anon.wait_job("anon2")["state"] == "done"
    assert "anon1" not in job_ids(anon)


def test_beyond_loopback_without_tokens_refuses_to_start(tmp_path):
    """A real meshd asked to listen on every interface with no [auth] table exits non-zero and
    says what to do."""
    m = Meshd(str(tmp_path / "wide"), http="0.0.0.0:0")
    try:
        m.start(wait_ready=False)
        rc = m.proc.wait(30)
        assert rc == 2
        log = m.log_tail()
        assert "beyond loopback" in log and "[auth]" in log
        assert not os.path.exists(os.path.join(m.data, "http.addr"))
    finally:
        m.stop()


# --- meshctl with tokens ----------------------------------------------------------------------


def test_meshctl_tokens(closed, tmp_path):
    """meshctl sends MESHJOBS_TOKEN or --token-file's first line; without one it says what to
    do (exit 2); a role too small names the role (exit 2); the token is never printed."""
    r = closed.ctl("jobs", env={"MESHJOBS_TOKEN": ""})
    err = r.stderr.decode()
    assert r.returncode == 2, err
    assert f"meshd at {closed.url} wants a token: set MESHJOBS_TOKEN or pass --token-file" in err
    r = closed.ctl("job", "submit", "--id", "ctl1", "--", "true",
                   env={"MESHJOBS_TOKEN": ROLE_TOKEN["submit"]})
    assert r.returncode == 0 and r.stdout.decode().strip() == "ctl1", r.stderr
    r = closed.ctl("job", "forget", "ctl1", env={"MESHJOBS_TOKEN": ROLE_TOKEN["submit"]})
    assert r.returncode == 2 and "admin role" in r.stderr.decode()
    f = tmp_path / "token"
    f.write_text(ROLE_TOKEN["read"] + "\nsecond line is ignored\n")
    r = closed.ctl("--token-file", str(f), "job", "submit", "--", "true",
                   env={"MESHJOBS_TOKEN": ""})
    assert r.returncode == 2 and "submit role" in r.stderr.decode()
    r = closed.ctl("--token-file", str(f), "job", "status", "ctl1", env={"MESHJOBS_TOKEN": "x"})
    assert r.returncode == 0, r.stderr  # the file wins over the environment
    r = closed.ctl("jobs", env={"MESHJOBS_TOKEN": "not-a-token"})
    assert r.returncode == 2 and "refused the token" in r.stderr.decode()
    out = (r.stdout + r.stderr).decode()
    assert "not-a-token" not in out and all(t not in out for _, t in TOKENS.values())


@pytest.mark.parametrize("content", [None, "", "\n\n", "two words\n", "tök\n"])
def test_meshctl_bad_token_file(closed, tmp_path, content):
    """A missing, empty or unusable --token-file is exit 2 with a message, before any request."""
    f = tmp_path / "token"
    if content is not None:
        f.write_text(content)
    r = closed.ctl("--token-file", str(f), "jobs")
    err = r.stderr.decode()
    assert r.returncode == 2 and "token" in err and "Traceback" not in err


# --- TLS --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tls_member(tmp_path_factory):
    top = str(tmp_path_factory.mktemp("tls"))
    cert, key = make_cert(os.path.join(top, "pki"))
    cfg = write_config(top, "tls", tokens_toml(), http=f'tls_cert = "{cert}"\ntls_key = "{key}"')
    m = Meshd(os.path.join(top, "tls"), name="tls", config=cfg, token=ROLE_TOKEN["admin"],
              cacert=cert)
    try:
        m.start()
        yield m
    finally:
        m.stop()


def test_https_with_meshctl_cacert(tls_member):
    """With [http] tls_cert/tls_key the member serves HTTPS (and says so); meshctl trusts it with
    --cacert or MESHJOBS_CACERT, and without gives exit 4 telling to pass --cacert."""
    assert tls_member.url.startswith("https://127.0.0.1:")
    # meshd_ready is logged just after http.addr is written.
    ready = wait_until(lambda: [json.loads(line) for line in tls_member.log_tail(1_000_000).splitlines()
                                if '"meshd_ready"' in line], 30, what="meshd_ready logged")
    assert ready[-1]["http"].startswith("https://127.0.0.1:")
    r = tls_member.ctl("job", "submit", "--id", "tls1", "--", "true")
    assert r.returncode == 0, r.stderr
    r = tls_member.ctl("--cacert", tls_member.cacert, "job", "wait", "tls1",
                       env={"MESHJOBS_CACERT": ""})
    assert r.returncode == 0, r.stderr
    r = tls_member.ctl("jobs", env={"MESHJOBS_CACERT": ""})
    err = r.stderr.decode()
    assert r.returncode == 4 and "--cacert" in err and "Traceback" not in err
    # Plain HTTP to the HTTPS port is no way around it.
    plain = tls_member.url.replace("https://", "http://")
    r = subprocess.run([sys.executable, "-m", "meshjobs.cli", "--at", plain, "jobs"],
                       capture_output=True, timeout=60, env=env_with_path())
    assert r.returncode == 4, r.stderr


def test_https_login_cookie_is_secure(tls_member):
    """Over TLS the session cookie is Secure (as well as HttpOnly and SameSite=Strict)."""
    status, h, data = tls_member.raw_request(
        "POST", "/login", json.dumps({"token": ROLE_TOKEN["read"]}).encode(),
        {"Content-Type": "application/json"})
    assert status == 200, data
    cookie = h["Set-Cookie"]
    assert "Secure" in cookie and "HttpOnly" in cookie and "SameSite=Strict" in cookie


@pytest.mark.parametrize("broken", ["garbage", "swapped"])
def test_bad_certificate_stops_meshd(tmp_path, broken):
    """A certificate or key that cannot serve TLS stops meshd at start: exit 2 and a message."""
    cert, key = make_cert(str(tmp_path / "pki"))
    if broken == "garbage":
        (tmp_path / "pki" / "cert.pem").write_text("-----BEGIN CERTIFICATE-----\nnope\n")
    else:
        cert, key = key, cert
    cfg = write_config(str(tmp_path), "badtls", http=f'tls_cert = "{cert}"\ntls_key = "{key}"')
    m = Meshd(str(tmp_path / "badtls"), name="badtls", config=cfg)
    try:
        m.start(wait_ready=False)
        assert m.proc.wait(30) == 2
        assert "tls_cert" in m.log_tail()
    finally:
        m.stop()


# --- the browser (point 5) --------------------------------------------------------------------


def test_cross_site_text_plain_post_runs_nothing(open_member, tmp_path):
    """The issue's case: POST /jobs with Content-Type text/plain and Origin
    http://attacker.example is refused and nothing runs, on an open loopback member."""
    marker = tmp_path / "pwned"
    spec = json.dumps({"argv": ["touch", str(marker)], "id": "csrf1"}).encode()
    status, _, data = open_member.raw_request("POST", "/jobs", spec, {
        "Content-Type": "text/plain", "Origin": "http://attacker.example"})
    assert status == 403, data
    for headers, want in (
        ({"Content-Type": "text/plain"}, 415),
        ({"Content-Type": "application/x-www-form-urlencoded"}, 415),
        ({"Content-Type": "application/json", "Origin": "http://attacker.example"}, 403),
        ({"Content-Type": "application/json", "Origin": "null"}, 403),
        ({"Content-Type": "application/json", "Sec-Fetch-Site": "cross-site"}, 403),
        ({"Content-Type": "application/json", "Origin": origin(open_member)}, 403),  # no CSRF
    ):
        status, _, data = open_member.raw_request("POST", "/jobs", spec, headers)
        assert status == want, (headers, status, data)
        assert "error" in json.loads(data)
    # What would have run had any been accepted runs now, and is the only job there.
    status, rec = open_member.request("POST", "/jobs", {"argv": ["true"], "id": "after"})
    assert status == 201
    open_member.wait_job("after")
    assert job_ids(open_member) == {"after"}
    assert not marker.exists()


@pytest.mark.parametrize("host,want", [
    ("attacker.example", 421), ("attacker.example:80", 421), ("localhost.attacker.example", 421),
    ("localhost", 200), ("127.0.0.1", 200), ("[::1]:1", 200),
])
def test_foreign_host_refused(open_member, host, want):
    """A Host this member does not answer to (DNS rebinding) is refused with a message."""
    status, _, data = open_member.raw_request("GET", "/jobs?format=json", None, {"Host": host})
    assert status == want, data
    if want == 421:
        assert "[http] names" in json.loads(data)["error"]


def test_machine_names_are_answered(open_member):
    """The machine's own host name is one of the member's names."""
    host = socket.gethostname()
    status, _, data = open_member.raw_request("GET", "/jobs?format=json", None, {"Host": host})
    assert status == 200, data


def test_configured_names_are_answered(closed):
    """[http] names adds names the member answers to; others stay refused; /healthz answers
    any name (load balancers)."""
    h = {"Authorization": f"Bearer {ROLE_TOKEN['read']}"}
    assert closed.raw_request("GET", "/fleet", None, {**h, "Host": "meshd.test:1"})[0] == 200
    assert closed.raw_request("GET", "/fleet", None, {**h, "Host": "other.test"})[0] == 421
    assert closed.raw_request("GET", "/healthz", None, {"Host": "other.test"})[0] == 200


def page_csrf(page: bytes) -> str:
    found = re.search(rb'<meta name="meshjobs-csrf" content="([0-9a-f]+)">', page)
    assert found, page[:400]
    return found.group(1).decode()


def test_cancel_button(open_member):
    """The jobs page has a Cancel button on each unfinished job, whose request (same origin,
    JSON, the page's X-Meshjobs-Csrf) cancels it; the same request without the header does not."""
    for jid in ("btn1", "btn2"):
        assert open_member.request("POST", "/jobs", {"argv": ["true"], "id": jid,
                                                     "hold": True})[0] == 201
    assert open_member.request("POST", "/jobs", {"argv": ["true"], "id": "btn-done"})[0] == 201
    open_member.wait_job("btn-done")
    status, h, page = open_member.raw_request("GET", "/jobs", None, {"Accept": "text/html"})
    assert status == 200 and h["Content-Type"].startswith("text/html")
    assert b'<button class="cancel" data-job="btn1">Cancel</button>' in page
    # A finished job has no Cancel, only Rerun.
    assert b'<button class="rerun" data-job="btn-done">Rerun</button></td>' in page
    # The page's one script (/ui.js, allowed by the page's nonce) posts JSON with the CSRF value.
    nonce = re.search(r"'nonce-([^']+)'", h["Content-Security-Policy"]).group(1)
    assert f'<script nonce="{nonce}" src="/ui.js" defer></script>'.encode() in page
    status, _, script = open_member.raw_request("GET", "/ui.js", None, {})
    assert status == 200 and b"X-Meshjobs-Csrf" in script and b"application/json" in script
    assert "frame-ancestors 'none'" in h["Content-Security-Policy"]
    csrf = page_csrf(page)
    browser = {"Origin": origin(open_member), "Sec-Fetch-Site": "same-origin",
               "Sec-Fetch-Mode": "cors", "Content-Type": "application/json"}
    status, _, data = open_member.raw_request("POST", "/jobs/btn1/cancel", b"{}",
                                              {**browser, "X-Meshjobs-Csrf": csrf})
    assert status == 200 and json.loads(data)["state"] == "cancelled", data
    status, _, data = open_member.raw_request("POST", "/jobs/btn2/cancel", b"{}", browser)
    assert status == 403 and "X-Meshjobs-Csrf" in json.loads(data)["error"]
    status, _, data = open_member.raw_request("POST", "/jobs/btn2/cancel", b"{}",
                                              {**browser, "X-Meshjobs-Csrf": "0" * 64})
    assert status == 403
    assert open_member.request("GET", "/jobs/btn2")[1]["state"] == "held"


def test_job_page_cancel_button(open_member):
    """The job page of an unfinished job has a Cancel button carrying the page's anti-CSRF
    value, under the same Content-Security-Policy as /jobs; its request cancels the job."""
    assert open_member.request("POST", "/jobs", {"argv": ["true"], "id": "pg1",
                                                 "hold": True})[0] == 201
    status, h, page = open_member.raw_request("GET", "/jobs/pg1", None, {"Accept": "text/html"})
    assert status == 200 and h["Content-Type"].startswith("text/html")
    assert b'<button class="cancel" data-job="pg1">Cancel</button>' in page
    assert "frame-ancestors 'none'" in h["Content-Security-Policy"]
    nonce = re.search(r"'nonce-([^']+)'", h["Content-Security-Policy"]).group(1)
    assert f'<script nonce="{nonce}" src="/ui.js" defer></script>'.encode() in page
    assert b"<script>" not in page and page.count(b"<script") == 1
    browser = {"Origin": origin(open_member), "Sec-Fetch-Site": "same-origin",
               "Sec-Fetch-Mode": "cors", "Content-Type": "application/json",
               "X-Meshjobs-Csrf": page_csrf(page)}
    status, _, data = open_member.raw_request("POST", "/jobs/pg1/cancel", b"{}", browser)
    assert status == 200 and json.loads(data)["state"] == "cancelled", data
    status, _, page = open_member.raw_request("GET", "/jobs/pg1", None, {"Accept": "text/html"})
    assert b'class="cancel"' not in page


def test_login_cookie_and_csrf(closed):
    """A browser without a token is sent to /login; the login form sets an HttpOnly,
    SameSite=Strict session cookie; with it the page's Cancel works only with the page's CSRF
    value and from the member's own origin; a read session may not cancel; logout ends it."""
    # Submitted with the submit token: the browser session below (the same submitter) may
    # change its own jobs only.
    assert closed.request("POST", "/jobs", {"argv": ["true"], "id": "lg1", "hold": True},
                          headers={"Authorization": f"Bearer {ROLE_TOKEN['submit']}"})[0] == 201
    status, h, _ = closed.raw_request("GET", "/jobs", None, {"Accept": "text/html"})
    assert status == 303 and h["Location"] == "/login?next=%2Fjobs"
    status, h, page = closed.raw_request("GET", "/login?next=/jobs", None, {"Accept": "text/html"})
    assert status == 200 and b'name="token"' in page and b'type="password"' in page
    own = origin(closed)
    form = {"Content-Type": "application/x-www-form-urlencoded", "Origin": own,
            "Sec-Fetch-Site": "same-origin"}
    status, h, page = closed.raw_request("POST", "/login", b"token=wrong&next=%2Fjobs", form)
    assert status == 401 and h.get("Set-Cookie") is None
    status, _, _ = closed.raw_request(
        "POST", "/login", f"token={ROLE_TOKEN['submit']}".encode(),
        {**form, "Origin": "http://attacker.example"})
    assert status == 403
    status, h, _ = closed.raw_request(
        "POST", "/login", f"token={ROLE_TOKEN['submit']}&next=%2Fjobs".encode(), form)
    assert status == 303 and h["Location"] == "/jobs"
    set_cookie = h["Set-Cookie"]
    assert "HttpOnly" in set_cookie and "SameSite=Strict" in set_cookie
    assert "Secure" not in set_cookie  # plain HTTP here
    cookie = set_cookie.split(";", 1)[0]
    assert ROLE_TOKEN["submit"] not in cookie
    status, _, page = closed.raw_request("GET", "/jobs", None, {"Accept": "text/html",
                                                                "Cookie": cookie})
    assert status == 200 and b'data-job="lg1"' in page
    csrf = page_csrf(page)
    browser = {"Cookie": cookie, "Origin": own, "Sec-Fetch-Site": "same-origin",
               "Content-Type": "application/json"}
    assert closed.raw_request("POST", "/jobs/lg1/cancel", b"{}", browser)[0] == 403
    assert closed.raw_request("POST", "/jobs/lg1/cancel", b"{}",
                              {**browser, "X-Meshjobs-Csrf": csrf,
                               "Origin": "http://attacker.example"})[0] == 403
    # The open-mode value (no session) is not this session's.
    status, _, data = closed.raw_request("DELETE", "/jobs/lg1", None,
                                         {**browser, "X-Meshjobs-Csrf": csrf})
    assert status == 403 and "admin role" in json.loads(data)["error"]
    status, _, data = closed.raw_request("POST", "/jobs/lg1/cancel", b"{}",
                                         {**browser, "X-Meshjobs-Csrf": csrf})
    assert status == 200 and json.loads(data)["state"] == "cancelled", data
    # A read session may look but not change.
    status, h, data = closed.raw_request("POST", "/login",
                                         json.dumps({"token": ROLE_TOKEN["read"]}).encode(),
                                         {"Content-Type": "application/json"})
    assert status == 200 and json.loads(data)["role"] == "read"
    read_cookie = h["Set-Cookie"].split(";", 1)[0]
    read_csrf = json.loads(data)["csrf"]
    status, _, data = closed.raw_request("POST", "/jobs", b'{"argv": ["true"]}', {
        "Cookie": read_cookie, "Origin": own, "Content-Type": "application/json",
        "X-Meshjobs-Csrf": read_csrf})
    assert status == 403 and "submit role" in json.loads(data)["error"]
    # Logging out ends the session: the cookie no longer lets the browser in.
    assert closed.raw_request("POST", "/logout", None, {"Cookie": cookie, "Origin": own})[0] == 200
    status, _, _ = closed.raw_request("GET", "/jobs?format=json", None, {"Cookie": cookie})
    assert status == 401


def test_refusal_flood_keeps_the_log_small(anon):
    """A flood of refused requests is counted in full but logged at a bounded rate."""
    before = anon.log_tail(10_000_000).count("http_refused")
    started = time.monotonic()
    for _ in range(200):
        anon.raw_request("GET", "/fleet", None, {"Authorization": "Bearer wrong"})
    seconds = time.monotonic() - started
    status, text = anon.request("GET", "/metrics")
    assert status == 200
    count = float(re.search(rb'meshjobs_http_auth_refused_total\{reason="invalid"\} (\S+)',
                            text).group(1))
    assert count >= 200
    logged = anon.log_tail(10_000_000).count("http_refused") - before
    assert logged <= 5 * (int(seconds) + 2)


@pytest.mark.parametrize("ctype,body,want", [
    ("application/x-www-form-urlencoded", b"token=" + b"x" * 20_000, 413),
    ("application/json", b"[1]", 400),
    ("application/json", b'{"token": 5}', 400),
    ("application/json", b"{", 400),
    ("text/plain", b"token=tok-admin-77aa", 415),
    ("application/x-www-form-urlencoded", b"next=%2Fjobs", 401),
    ("application/x-www-form-urlencoded", b"token=%ff%fe", 401),
    ("application/x-www-form-urlencoded", b"\xff\xfe", 400),
    ("application/json", b'{"token": "tok-admin-77aa\\u0000"}', 401),
])
def test_hostile_logins(closed, ctype, body, want):
    """Oversized, broken and wrong logins are refused with their status and set no cookie."""
    status, h, data = closed.raw_request("POST", "/login", body, {"Content-Type": ctype})
    assert status == want, data
    assert h.get("Set-Cookie") is None


def test_login_on_an_open_member(open_member):
    """A member without [auth] needs no login and says so."""
    status, _, data = open_member.raw_request("POST", "/login", b'{"token": "x"}',
                                              {"Content-Type": "application/json"})
    assert status == 400 and "no [auth]" in json.loads(data)["error"]
    status, _, page = open_member.raw_request("GET", "/login", None, {"Accept": "text/html"})
    assert status == 200 and b"needs no login" in page
