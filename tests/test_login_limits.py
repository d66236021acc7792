"""Logins against a real meshd (issue 25, point 10): a flood of `read` logins does not push
out the admin's browser session, and one address that logs in too fast gets 429."""

from __future__ import annotations

import http.client
import json
import os

import pytest

from meshjobs import limits
from tests.helpers import Meshd, metrics, running, token_line

pytestmark = pytest.mark.fleet

READ, ADMIN = "tok-read-31c8", "tok-admin-e02b"


@pytest.fixture(scope="module")
def member(tmp_path_factory):
    top = str(tmp_path_factory.mktemp("logins"))
    cfg = os.path.join(top, "m1.toml")
    with open(cfg, "w") as f:
        f.write('name = "m1"\n[pools.default]\nslots = 1\n[auth]\ntokens = [ '
                + token_line("reader", "read", READ) + ", "
                + token_line("ops", "admin", ADMIN) + " ]\n")
    yield from running(Meshd(os.path.join(top, "m1"), name="m1", config=cfg, token=ADMIN))


def login(m: Meshd, token: str, source: str = "127.0.0.1") -> tuple[int, dict[str, str], dict]:
    """POST /login from the loopback address `source` (all of 127/8 is this machine)."""
    conn = http.client.HTTPConnection("127.0.0.1", int(m.url.rsplit(":", 1)[1]), timeout=30,
                                      source_address=(source, 0))
    try:
        conn.request("POST", "/login", body=json.dumps({"token": token}),
                     headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, dict(resp.headers), json.loads(resp.read() or b"{}")
    finally:
        conn.close()


def cookie_works(m: Meshd, cookie: str) -> bool:
    status, _, _ = m.raw_request("GET", "/jobs?format=json", None, {"Cookie": cookie})
    return status == 200


def test_a_flood_of_read_logins_keeps_the_admins_session(member: Meshd) -> None:
    """1,025 logins with a read token (from many addresses, so no rate limit is met) fill
    only the reader's own share of sessions: the admin's cookie still works."""
    status, headers, body = login(member, ADMIN, "127.0.0.200")
    assert status == 200 and body["role"] == "admin", body
    admin_cookie = headers["Set-Cookie"].split(";", 1)[0]
    per_address = limits.http_login_burst_max
    n = 0
    while n < 1_025:
        source = f"127.0.{1 + n // per_address // 250}.{2 + n // per_address % 250}"
        status, _, body = login(member, READ, source)
        assert status == 200, (n, source, body)
        n += 1
    assert n > limits.http_sessions_max
    assert cookie_works(member, admin_cookie)


def test_a_login_flood_from_one_address_gets_429(member: Meshd) -> None:
    """Past its burst, one address is told 429 with Retry-After, and the refusals and failed
    logins are counted; another address still logs in."""
    got = [login(member, "wrong-token", "127.0.9.9") for _ in range(limits.http_login_burst_max + 5)]
    statuses = [g[0] for g in got]
    assert statuses[:limits.http_login_burst_max] == [401] * limits.http_login_burst_max
    assert 429 in statuses[limits.http_login_burst_max:], statuses
    refused = next(g for g in got if g[0] == 429)
    assert int(refused[1]["Retry-After"]) >= 1 and "too many logins" in refused[2]["error"]
    # A right token from the same address is refused too while the bucket is empty.
    assert login(member, ADMIN, "127.0.9.9")[0] == 429
    assert login(member, ADMIN, "127.0.9.10")[0] == 200
    m = metrics(member)
    assert m['meshjobs_http_auth_refused_total{reason="login_rate"}'] >= 5
    assert m['meshjobs_http_auth_refused_total{reason="login_failed"}'] >= limits.http_login_burst_max
