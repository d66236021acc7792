"""The web UI in a real browser: headless Chromium (Debian's, /usr/bin/chromium) driven by
Playwright, against real members (issue 11, point 4).

A submitted job appears on the open /jobs page and turns `done` without a reload; a job whose
program cannot start shows the item's error on its page; Cancel, Hold and Release work from
the list and the job page; with [auth], a browser logs in through /login and its buttons work
with the page's anti-CSRF value, and a refusal shows the API's words. Hostile argv and tags stay
text. The pages follow /events when the member streams them and poll the JSON API when not.

Screenshots go to $MESHJOBS_SCREENSHOTS, else build/screenshots/ under the repository.
Without Playwright or Chromium the tests skip, except under CI=true, where they fail.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from tests.helpers import Meshd, running, token_line

pytestmark = pytest.mark.fleet

CHROMIUM = os.environ.get("MESHJOBS_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                 "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
WAIT_MS = 30_000  # the longest condition wait: a job through a busy 2-core machine
TOKENS = {"reader": ("read", "tok-read-b7c1"), "ci": ("submit", "tok-submit-3d9e")}
REPO = Path(__file__).resolve().parent.parent
SHOTS = Path(os.environ.get("MESHJOBS_SCREENSHOTS") or REPO / "build" / "screenshots")
HOSTILE_ARGV = ["sh", "-c", "echo '<script>alert(1)</script>'", "\"><img src=x onerror=alert(2)>"]
HOSTILE_TAG = "\"><img src=x onerror=alert(3)>"


def _missing() -> str | None:
    """Why the browser tests cannot run here (None: they can)."""
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "the playwright package is not installed (pip install '.[test]')"
    path = CHROMIUM if os.path.isabs(CHROMIUM) else shutil.which(CHROMIUM)
    if not path or not os.access(path, os.X_OK):
        return f"no Chromium at {CHROMIUM} (apt-get install chromium; or set MESHJOBS_CHROMIUM)"
    return None


@pytest.fixture(scope="module")
def browser():
    why = _missing()
    if why is not None:
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(f"CI runs the browser tests, but {why}")
        pytest.skip(why)
    from playwright.sync_api import sync_playwright

    SHOTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            yield b
        finally:
            b.close()


@pytest.fixture
def page(browser):
    """A fresh browser context and page; any alert() a page would run fails the test."""
    ctx = browser.new_context(viewport={"width": 1400, "height": 900})
    ctx.set_default_timeout(WAIT_MS)
    dialogs: list[str] = []
    ctx.on("page", lambda p: p.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss())))
    pg = ctx.new_page()
    try:
        yield pg
    finally:
        ctx.close()
    assert dialogs == [], f"a page ran a script it must not have: {dialogs}"


def shot(pg, name: str) -> None:
    pg.screenshot(path=str(SHOTS / f"{name}.png"), full_page=True)


@pytest.fixture(scope="module")
def member(tmp_path_factory):
    """An open member (no [auth]) with two slots."""
    yield from running(Meshd(str(tmp_path_factory.mktemp("browser") / "m1"), slots=2))


@pytest.fixture(scope="module")
def closed(tmp_path_factory):
    """A member with tokens and no anonymous access."""
    top = tmp_path_factory.mktemp("closed")
    cfg = top / "c1.toml"
    lines = ", ".join(token_line(n, r, t) for n, (r, t) in TOKENS.items())
    cfg.write_text(f'name = "c1"\n[pools.default]\nslots = 2\n[auth]\ntokens = [ {lines} ]\n')
    m = Meshd(str(top / "c1"), name="c1", config=str(cfg), token=TOKENS["ci"][1])
    try:
        m.start()
        yield m
    finally:
        m.stop()


def submit(m: Meshd, **spec) -> dict:
    status, body = m.request("POST", "/jobs", spec)
    assert status == 201, body
    return body


def waiter(flag: Path) -> list[str]:
    """A program that runs until `flag` exists."""
    return ["sh", "-c", 'while [ ! -e "$0" ]; do sleep 0.05; done; echo seen', str(flag)]


def expect_live(pg) -> None:
    """The page's script runs and follows the member (events, or polling when not)."""
    from playwright.sync_api import expect

    expect(pg.locator("#live-note")).to_contain_text("live:")


def test_job_appears_and_finishes_without_reload(member, page, tmp_path):
    """Rule: a job submitted while /jobs is open appears on top without a reload and turns
    `done` when its item ends; hostile argv and tags show as text."""
    from playwright.sync_api import expect

    submit(member, argv=["true"], id="older", tags=["browser"])
    page.goto(member.url + "/jobs?tag=browser")
    expect_live(page)
    page.evaluate("window.meshjobsNoReload = 1")
    flag = tmp_path / "go"
    submit(member, argv=waiter(flag), id="waits", tags=["browser"])
    submit(member, argv=HOSTILE_ARGV, id="hostile", tags=["browser", HOSTILE_TAG])
    row = page.locator('tr[data-id="waits"]')
    expect(row).to_be_visible()
    expect(row.locator("td.state")).to_have_text("running")
    expect(page.locator("#jobs tr").first).to_have_attribute("data-id", "hostile")
    hostile = page.locator('tr[data-id="hostile"]')
    expect(hostile).to_contain_text("<script>alert(1)</script>")
    expect(hostile).to_contain_text(HOSTILE_TAG)
    assert page.locator("#jobs img").count() == 0
    shot(page, "jobs-running")
    hostile_page = page.context.new_page()
    hostile_page.goto(member.url + "/jobs/hostile")
    expect(hostile_page.locator("table.facts")).to_contain_text("<script>alert(1)</script>")
    expect(hostile_page.locator("table.facts")).to_contain_text(HOSTILE_TAG)
    assert hostile_page.locator("main img").count() == 0
    hostile_page.close()
    flag.write_text("")
    expect(row.locator("td.state")).to_have_text("done")
    expect(row.locator("button")).to_have_text(["Rerun"])  # nothing to cancel or hold now
    assert page.evaluate("window.meshjobsNoReload") == 1, "the page was reloaded"
    shot(page, "jobs-done")
    # The filter form narrows the list (a GET of the page itself).
    page.select_option("select[name=state]", "done")
    page.click("form.filters button[type=submit]")
    expect(page.locator('tr[data-id="waits"]')).to_be_visible()
    expect(page).to_have_url(member.url + "/jobs?state=done&tag=browser&pool=&limit=100")


def test_polls_when_events_fail(member, page):
    """Rule: when /events answers 404 (a member without it, a proxy that breaks event
    streams), the list polls the JSON API: new jobs still appear, and a row the script builds
    reads the same as the row the member rendered."""
    from playwright.sync_api import expect

    page.route("**/events?*", lambda route: route.fulfill(
        status=404, content_type="application/json", body='{"error": "no route /events"}'))
    submit(member, argv=["true"], id="poll-old", tags=["poll"])
    page.goto(member.url + "/jobs?tag=poll")
    expect(page.locator("#live-note")).to_contain_text("polling")
    old = page.locator('tr[data-id="poll-old"]')
    expect(old.locator("td.state")).to_have_text("done")
    rendered = old.locator("td").all_inner_texts()
    page.evaluate("document.querySelector('tr[data-id=\"poll-old\"]').dataset.sig = 'stale'")
    expect(old).not_to_have_attribute("data-sig", "stale")  # rebuilt by the script
    assert old.locator("td").all_inner_texts() == rendered
    page.evaluate("window.meshjobsNoReload = 1")
    submit(member, argv=["true"], id="poll-new", tags=["poll"])
    expect(page.locator("#jobs tr").first).to_have_attribute("data-id", "poll-new")
    expect(page.locator('tr[data-id="poll-new"] td.state')).to_have_text("done")
    assert page.evaluate("window.meshjobsNoReload") == 1, "the page was reloaded"
    shot(page, "jobs-polling")


def test_follows_events_by_the_contract(member, page):
    """Rule: the list follows GET /events (text/event-stream; `job` events carry a job as the
    JSON list shows it, `forget` its id): a changed job's row changes, a forgotten one goes, a
    new one matching the filter goes on top, another is left out. The stream here is a
    stand-in served by the browser, and polling is made to fail, so that only the events can
    have changed the page."""
    import json

    from playwright.sync_api import expect

    for jid in ("ev-a", "ev-b"):
        submit(member, argv=["true"], id=jid, hold=True, tags=["ev"])
    _, a = member.request("GET", "/jobs/ev-a")

    def job(jid: str, state: str, tags: list[str], at: float) -> str:
        # Past the member's own versions (log indexes), so that the page takes these as news.
        return json.dumps({"id": jid, "state": state, "version": a["version"] + 100,
                           "tags": tags, "pool": "default",
                           "argv": ["true"], "items_total": 1, "items_done": 0, "items_failed": 0,
                           "items_running": 1 if state == "running" else 0, "priority": 0,
                           "hold": False, "submitted_at": at})

    stream = (f"id: 5\nevent: job\ndata: {job('ev-a', 'running', ['ev'], a['submitted_at'])}\n\n"
              'id: 6\nevent: forget\ndata: {"id": "ev-b", "version": 6}\n\n'
              f"id: 7\nevent: job\ndata: {job('ev-other', 'queued', ['zzz'], a['submitted_at'] + 61)}\n\n"
              f"id: 8\nevent: job\ndata: {job('ev-new', 'queued', ['ev'], a['submitted_at'] + 60)}\n\n")
    asked: list[str] = []

    def events(route) -> None:
        asked.append(route.request.url)
        route.fulfill(status=200, headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache"}, body=stream)

    page.route(lambda url: "format=json" in url, lambda route: route.fulfill(
        status=503, content_type="application/json", body='{"error": "member busy, try again"}'))
    page.route("**/events?*", events)
    page.goto(member.url + "/jobs?tag=ev")
    expect(page.locator('tr[data-id="ev-a"] td.state')).to_have_text("running")
    expect(page.locator('tr[data-id="ev-b"]')).to_have_count(0)
    expect(page.locator("#jobs tr").first).to_have_attribute("data-id", "ev-new")
    expect(page.locator('tr[data-id="ev-new"] td.state')).to_have_text("queued")
    assert page.locator('tr[data-id="ev-other"]').count() == 0  # its event came before ev-new's
    assert asked and asked[0] == member.url + "/events?tag=ev"
    shot(page, "jobs-events")


def test_unstartable_command_explained_on_job_page(member, page):
    """Rule: the page of a job whose program cannot start shows the item's error."""
    from playwright.sync_api import expect

    submit(member, argv=["/no/such/prog", "x"], id="nostart")
    page.goto(member.url + "/jobs/nostart")
    expect_live(page)
    expect(page.locator("h1 .state")).to_have_text("failed")
    expect(page.locator("#failed + table")).to_contain_text(
        "no such program '/no/such/prog' on member")
    expect(page.locator("#items + p + table")).to_contain_text("no such program")
    shot(page, "job-cannot-start")


def test_item_output_preview_and_download(member, page):
    """Rule: a job's page shows the head of an item's stdout and links its download."""
    from playwright.sync_api import expect

    job = submit(member, argv=["sh", "-c", "echo 'hello <b>web</b>'; echo oops >&2"], id="says")
    member.wait_job(job["id"])
    page.goto(member.url + "/jobs/says")
    expect(page.locator("#preview pre").first).to_have_text("hello <b>web</b>\n")
    href = page.locator("#preview a", has_text="download stdout").get_attribute("href")
    assert href.startswith("/blobs/")
    body = page.request.get(member.url + href).body()
    assert body == b"hello <b>web</b>\n"
    shot(page, "job-preview")


def test_cancel_hold_release_buttons(member, page, tmp_path):
    """Rule: on a running job's page Hold holds it, Release lets it go on and Cancel cancels
    it (the page follows each); Release on the list lets a held job run."""
    from playwright.sync_api import expect

    submit(member, argv=waiter(tmp_path / "never"), id="to-cancel")
    page.goto(member.url + "/jobs/to-cancel")
    expect_live(page)
    expect(page.locator("h1 .state")).to_have_text("running")
    page.click("button.hold")
    expect(page.locator("h1 .state")).to_have_text("held")
    page.click("button.release")
    expect(page.locator("h1 .state")).to_have_text("running")
    page.click("button.cancel")
    expect(page.locator("#msg")).to_contain_text("cancelled")
    expect(page.locator("h1 .state")).to_have_text("cancelled")
    expect(page.locator("button.cancel")).to_have_count(0)
    expect(page.locator("#live-note")).to_contain_text("live:")  # kept across the swaps
    shot(page, "job-cancelled")
    page.click("button.rerun")  # a cancelled job runs again under its id
    expect(page.locator("h1 .state")).to_have_text("running")
    expect(page.locator("main")).to_contain_text("earlier runs")
    page.click("button.cancel")
    expect(page.locator("h1 .state")).to_have_text("cancelled")

    submit(member, argv=["true"], id="held", hold=True, tags=["hold"])
    page.goto(member.url + "/jobs?tag=hold")
    row = page.locator('tr[data-id="held"]')
    expect(row.locator("td.state")).to_have_text("held")
    row.locator("button.release").click()
    expect(row.locator("td.state")).to_have_text("done")
    shot(page, "jobs-released")


def test_fleet_page(member, page):
    """Rule: /fleet in a browser is a page of members, roles, slots, leader and term."""
    from playwright.sync_api import expect

    page.goto(member.url + "/fleet")
    expect(page.locator("h1")).to_have_text("Fleet")
    row = page.locator("tbody tr", has_text="m1")
    expect(row.locator("td.role")).to_have_text("leader")
    expect(page.locator("main")).to_contain_text("Leader: m1")
    expect(page.locator("#live-note")).to_contain_text("live: every")  # swapped in by the script
    shot(page, "fleet")


def test_login_then_buttons_with_csrf(closed, page, browser):
    """Rule: with [auth], a browser logs in through /login; the page's Cancel then works (the
    session cookie and the page's X-Meshjobs-Csrf); a read-only session's Cancel is refused,
    and the page shows the member's words."""
    from playwright.sync_api import expect

    submit(closed, argv=["true"], id="auth-held", hold=True)
    page.goto(closed.url + "/jobs")
    expect(page).to_have_url(closed.url + "/login?next=%2Fjobs")
    page.fill("input[name=token]", TOKENS["ci"][1])
    page.click("form button")
    expect(page).to_have_url(closed.url + "/jobs")
    expect_live(page)
    row = page.locator('tr[data-id="auth-held"]')
    expect(row.locator("td.state")).to_have_text("held")
    row.locator("button.cancel").click()
    expect(row.locator("td.state")).to_have_text("cancelled")
    shot(page, "auth-cancelled")

    submit(closed, argv=["true"], id="auth-held2", hold=True)
    ctx = browser.new_context()
    ctx.set_default_timeout(WAIT_MS)
    try:
        reader = ctx.new_page()
        reader.goto(closed.url + "/login?next=/jobs/auth-held2")
        reader.fill("input[name=token]", TOKENS["reader"][1])
        reader.click("form button")
        expect(reader).to_have_url(closed.url + "/jobs/auth-held2")
        reader.click("button.cancel")
        expect(reader.locator("#msg")).to_contain_text("needs the submit role")
        expect(reader.locator("#msg")).to_have_class("bad")
        expect(reader.locator("h1 .state")).to_have_text("held")
        shot(reader, "auth-refused")
    finally:
        ctx.close()


def test_jobs_page_fits_1400_px_with_sign_out(member, page):
    """Rule: at 1,400 px the jobs list, a long program without spaces included, is not cut
    off: its actions column ends inside the window; the header has a Sign out control (POST
    /logout), which goes on to the login page."""
    from playwright.sync_api import expect

    long_prog = ["/opt/" + "x" * 120 + "/bin/tool", "--input=/data/" + "y" * 80]
    wide_id = "wide-" + "q" * 50
    submit(member, argv=long_prog, id=wide_id, tags=["wide", "a-rather-long-tag-name"])
    page.goto(member.url + "/jobs?tag=wide")
    expect_live(page)
    row = page.locator(f'tr[data-id="{wide_id}"]')
    expect(row).to_be_visible()
    box = row.locator("td.act").bounding_box()
    assert box is not None and box["x"] + box["width"] <= 1400, box
    assert page.evaluate("document.documentElement.scrollWidth") <= 1400
    shot(page, "jobs-1400")
    page.click("header form.out button")
    expect(page).to_have_url(member.url + "/login")
