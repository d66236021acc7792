"""The web UI's pages: pure functions that render HTML from job, item and fleet records.

Everything a record holds is escaped (html.escape, quote=True) before it reaches the page, and
the pages carry no inline script: their one script is `UI_SCRIPT`, served as /ui.js and allowed
by the page's Content-Security-Policy nonce (see http.py `_html`). The pages work without it
except for live updates and the buttons (which post JSON with the page's anti-CSRF value).
"""

from __future__ import annotations

import datetime as dt
import html
import shlex
import urllib.parse
from collections.abc import Iterable, Sequence
from typing import Any

from meshjobs import limits
from meshjobs.control import JOB_FINAL_STATES, JOB_STATES

TERMINAL_STATES = JOB_FINAL_STATES
FAILED_ITEM_STATES = ("failed", "timeout")

e = html.escape


def q(value: object) -> str:
    """A path segment: every character but the unreserved ones percent-encoded."""
    return urllib.parse.quote(str(value), safe="")


def when(value: object) -> str:
    """A time from a record, readable (UTC); numbers are Unix seconds (milliseconds if huge)."""
    if value is None:
        return ""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = value / 1000 if value > 1e11 else value
        try:
            return dt.datetime.fromtimestamp(seconds, dt.UTC).strftime("%Y-%m-%d %H:%M:%S")
        except (OverflowError, OSError, ValueError):
            return str(value)
    return str(value)


def took(start: object, end: object) -> str:
    """How long from `start` to `end` (Unix seconds), in words; "" when either is unknown."""
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (start, end)):
        return ""
    s = float(end) - float(start)  # type: ignore[arg-type]
    if s < 0:
        return ""
    if s < 60:
        return f"{s:.1f} s"
    if s < 3600:
        return f"{int(s // 60)} min {int(s % 60)} s"
    return f"{int(s // 3600)} h {int(s % 3600 // 60)} min"


def size(n: object) -> str:
    """A byte count, readable."""
    if not isinstance(n, int) or isinstance(n, bool):
        return "" if n is None else str(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return str(n)


def skew(ms: object) -> str:
    """A clock's skew (ms), readable: "+120.0 s"; "" when unknown."""
    if not isinstance(ms, int) or isinstance(ms, bool):
        return ""
    return f"{ms / 1000:+.1f} s"


def alive_words(m: dict, local: bool = False) -> str:
    """A fleet row's liveness in words (/fleet's `status`, `down_since`): "yes", "down since
    HH:MM:SS" (UTC, or the local time for a terminal), "not heard yet" (a new leader waits for
    its report), "unknown" (this member does not hear the reports: only the leader does)."""
    status = m.get("status")
    if status not in ("alive", "down", "not_heard_yet", "unknown"):  # an older member's row
        status = {True: "alive", False: "down"}.get(m.get("alive"), "unknown")
    if status != "down":
        return {"alive": "yes", "not_heard_yet": "not heard yet"}.get(status, "unknown")
    t = m.get("down_since")
    if not isinstance(t, (int, float)) or isinstance(t, bool):
        return "down"
    try:
        at = (dt.datetime.fromtimestamp(t).astimezone() if local
              else dt.datetime.fromtimestamp(t, dt.UTC))
    except (OverflowError, OSError, ValueError):
        return "down"
    return f"down since {at:%H:%M:%S}"


def clock_warnings(fleet: dict) -> list[tuple[str, str]]:
    """(member, warning) for each member whose wall clock is more than
    `limits.link_clock_skew_warn_ms` off the answering member's (/fleet's `clock_skew_ms`):
    for the fleet page and `meshctl fleet`."""
    ref = "this member's" if fleet.get("partial") else "the leader's"
    out = []
    for m in fleet.get("members") or []:
        ms = m.get("clock_skew_ms") if isinstance(m, dict) else None
        if isinstance(ms, int) and not isinstance(ms, bool) and abs(ms) > limits.link_clock_skew_warn_ms:
            way = "ahead of" if ms > 0 else "behind"
            out.append((str(m.get("name")), (
                f"its wall clock is {abs(ms) / 1000:.0f} s {way} {ref} (warned past "
                f"{limits.link_clock_skew_warn_ms / 1000:.0f} s): job times and schedules "
                "follow the leader's clock, retention does not; set its clock right (NTP)")))
    return out


def argv_text(argv: object) -> str:
    """A program and its arguments as a shell would read them back."""
    if isinstance(argv, list):
        return " ".join(shlex.quote(str(a)) for a in argv)
    return "" if argv is None else str(argv)


def tags_text(tags: object) -> str:
    if isinstance(tags, list):
        return ", ".join(str(t) for t in tags)
    return "" if tags is None else str(tags)


def short(text: str, n: int) -> str:
    return text if len(text) <= n else text[: n - 1] + "\u2026"


def sig(job: dict) -> str:
    """What the script compares to see that a job changed (the same words as ui.js `sig`)."""
    return "/".join(str(x) for x in (
        job.get("state"), _int(job.get("items_done")), _int(job.get("items_failed")),
        _int(job.get("items_running")), _int(job.get("priority")), 1 if job.get("hold") else 0))


def _int_or(value: object, default: int) -> int:
    return value if type(value) is int and value >= 0 else default


def _int(value: object) -> object:
    return 0 if value is None else value


def item_reason(item: dict, runtime_s: object) -> str:
    """Why an item failed, in words (the same as `meshctl job status` says)."""
    if item.get("error"):
        return str(item["error"])
    if item.get("state") == "timeout":
        return "timeout: killed after its runtime limit" + (
            f" of {runtime_s:g} s" if isinstance(runtime_s, (int, float)) else "")
    if item.get("signal"):
        return f"killed by signal {item['signal']}"
    if item.get("rc") is not None:
        return f"exit {item['rc']}"
    return "failed with no exit code"


# --- the frame of every page ----------------------------------------------------------------

STYLE = (
    ":root{color-scheme:light dark}"
    "body{font-family:system-ui,sans-serif;margin:0;color:#1a1a1a;background:#fff;line-height:1.4}"
    "@media (prefers-color-scheme:dark){body{color:#e8e8e8;background:#161616}"
    "th{background:#262626!important}a{color:#8ab4f8}.done{color:#6fcf73!important}"
    ".failed,.timeout,#msg.bad{color:#ff7070!important}.running,.leased{color:#7ab7ff!important}"
    ".held,.waiting{color:#c59cf0!important}.cancelled,.dep_failed{color:#e0a040!important}}"
    "header{padding:.6em 2em;border-bottom:1px solid #ccc}header a{margin-right:1.2em}"
    "header .me{float:right;color:#666}header form.out{float:right;margin:0 0 0 1em}"
    "header form.out button{margin:0}"
    # The program cell wraps (its whole argv is its title), so that at 1,400 px the list
    # fits with its actions column.
    "td.prog code{white-space:normal;word-break:break-all}"
    "#jobs td:first-child{word-break:break-all;min-width:8em}td.prog{min-width:12em}"
    "main{padding:0 2em 1em}#msg{margin:.5em 2em;position:sticky;top:0;background:inherit}"
    "#msg:empty{margin:0}"
    "td.act,td.t{white-space:nowrap}"
    "#msg.bad{color:#b00020;font-weight:600}#msg.ok{color:#1b6e20}"
    "table{border-collapse:collapse;margin:.5em 0}"
    "th,td{padding:.3em .7em;text-align:left;border-bottom:1px solid #ddd;vertical-align:top}"
    "th{background:#f2f2f2}td.n{text-align:right;font-variant-numeric:tabular-nums}"
    "pre{margin:0;white-space:pre-wrap;word-break:break-all;max-width:60em}"
    "pre.out{border:1px solid #ccc;padding:.5em;max-height:30em;overflow:auto}"
    "form.filters label{margin-right:1em}form.filters input{width:10em}"
    ".state{font-weight:600}.done{color:#1b6e20}.failed,.timeout{color:#b00020}"
    ".cancelled,.dep_failed{color:#8a5300}.running,.leased{color:#0b57d0}"
    ".held,.waiting{color:#6b3fa0}"
    ".queued,.pending{color:#555}"
    "button{margin:0 .3em .2em 0;cursor:pointer}.note{color:#666}"
    ".stale{color:#8a5300;font-weight:600}"
)


def page(title: str, member: str, body: str, *, csrf: str = "", nonce: str = "",
         sign_out: bool = True) -> str:
    """A whole page: a navigation bar, a message line the script fills, `body` (which holds the
    page's <main>), and the script when a nonce allows it."""
    script = f'<script nonce="{e(nonce)}" src="/ui.js" defer></script>' if nonce else ""
    return (
        '<!doctype html>\n<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f'<meta name="meshjobs-csrf" content="{e(csrf)}">'
        f"<title>meshjobs: {e(title)}</title><style>{STYLE}</style>{script}</head>\n<body>\n"
        '<header><nav aria-label="meshjobs"><a href="/jobs">Jobs</a><a href="/fleet">Fleet</a>'
        '<a href="/openapi.json">API</a>'
        + ('<form class="out" method="post" action="/logout"><button type="submit">Sign out'
           '</button></form>' if sign_out else "") +
        f'<span class="me">member {e(member)}</span></nav></header>\n'
        '<p id="msg" role="status" aria-live="polite"></p>\n'
        f"{body}\n</body></html>\n"
    )


def buttons(job: dict) -> str:
    """Cancel while a job is unfinished; Hold or Release (hold: no new items start); Rerun
    once it ended done, failed or cancelled."""
    jid = e(str(job.get("id", "")))
    st = str(job.get("state", ""))
    if st in ("done", "failed", "cancelled"):
        return f'<button class="rerun" data-job="{jid}">Rerun</button>'
    if st in TERMINAL_STATES:
        return ""
    hold = (f'<button class="release" data-job="{jid}">Release</button>'
            if job.get("hold") or st == "held"
            else f'<button class="hold" data-job="{jid}">Hold</button>')
    return f'<button class="cancel" data-job="{jid}">Cancel</button>{hold}'


# --- the job list ---------------------------------------------------------------------------


def job_row(job: dict) -> str:
    """One row of the job list (the same cells as ui.js `row`)."""
    jid = str(job.get("id", ""))
    st = str(job.get("state", ""))
    prog = argv_text(job.get("argv"))
    version = job.get("version")
    return (
        f'<tr data-id="{e(jid)}" data-sig="{e(sig(job))}" data-at="{e(str(job.get("submitted_at", "")))}"'
        + (f' data-version="{e(str(version))}"' if version is not None else "") + ">"
        f'<td><a href="/jobs/{e(q(jid))}">{e(jid)}</a></td>'
        f'<td class="state {e(st)}">{e(st)}</td>'
        f"<td>{e(str(job.get('pool', '')))}</td>"
        f'<td class="prog"><code title="{e(prog)}">{e(short(prog, 60))}</code></td>'
        f'<td class="n">{e(str(job.get("items_done", 0)))}/{e(str(job.get("items_total", 0)))}</td>'
        f'<td class="n">{e(str(job.get("items_failed", 0)))}</td>'
        f'<td class="n">{e(str(job.get("priority", 0)))}</td>'
        f"<td>{e(tags_text(job.get('tags')))}</td>"
        f'<td class="t">{e(when(job.get("submitted_at")))}</td>'
        f'<td class="act">{buttons(job)}</td>'
        "</tr>"
    )


def jobs_page(member: str, jobs: Iterable[Any], filters: dict[str, str | None], *,
              limit: int = limits.jobs_list_default, after: str | None = None,
              next_url: str | None = None, csrf: str = "", nonce: str = "",
              stale: bool = False) -> str:
    """The job list: a filter form, one page of jobs newest first, the link to older ones.
    `filters` holds state, tag and pool (None: any). `stale`: the member's table is not fresh
    (it does not hear the leader now), which the page says above the list."""
    rows = [job_row(j) for j in jobs if isinstance(j, dict)]
    state, tag, pool = (filters.get(k) for k in ("state", "tag", "pool"))
    options = "".join(
        f'<option value="{s}"{" selected" if s == state else ""}>{s}</option>'
        for s in ("", *JOB_STATES)).replace('<option value="">', '<option value="">any')
    shown = ", ".join(f"{k} {v}" for k, v in (("state", state), ("tag", tag), ("pool", pool)) if v)
    query = {k: v for k, v in (("state", state), ("tag", tag), ("pool", pool)) if v}
    query["limit"] = str(limit)
    if after:
        query["after"] = after
    newest = ("/jobs?" + urllib.parse.urlencode({k: v for k, v in query.items() if k != "after"})
              if after else None)
    empty = f'<tr class="empty"><td colspan="10">No jobs{" with " + e(shown) if shown else ""}.</td></tr>'
    form = (
        '<form class="filters" method="get" action="/jobs" role="search">'
        f'<label>State <select name="state">{options}</select></label>'
        f'<label>Tag <input name="tag" value="{e(tag or "")}" maxlength="{limits.tag_chars_max}"></label>'
        f'<label>Pool <input name="pool" value="{e(pool or "")}" maxlength="{limits.pool_chars_max}"></label>'
        f'<label>Per page <input name="limit" type="number" min="1" max="{limits.jobs_list_max}" '
        f'value="{limit}"></label>'
        '<button type="submit">Show</button> <a href="/jobs">all jobs</a></form>')
    note = (f'<p class="stale" role="status">Member {e(member)} does not hear the leader now: '
            "this list is its own table's and may be behind. Ask another member, or see the "
            '<a href="/fleet">fleet</a>.</p>\n' if stale else "")
    body = (
        f'<main data-page="jobs" data-query="{e(urllib.parse.urlencode(query))}">\n'
        "<h1>Jobs</h1>\n" + form + "\n" + note
        + f'<p><span id="shown">{len(rows)}</span> job(s), newest first'
        f"{' with ' + e(shown) if shown else ''}{' (an older page)' if after else ''}. "
        '<span id="live-note" class="note">Live updates need the page\'s script.</span> '
        f'<a href="/jobs?{e(urllib.parse.urlencode({**query, "format": "json"}))}">JSON</a></p>\n'
        "<table><thead><tr><th>id</th><th>state</th><th>pool</th><th>program</th>"
        "<th>items done/total</th><th>failed</th><th>priority</th><th>tags</th>"
        '<th>submitted (UTC)</th><th>actions</th></tr></thead>\n<tbody id="jobs">\n'
        + ("\n".join(rows) if rows else empty)
        + "\n</tbody></table>\n"
        + (f'<p><a href="{e(next_url)}">older jobs</a></p>\n' if next_url else "")
        + (f'<p><a href="{e(newest)}">newest jobs</a></p>\n' if newest else "")
        + "</main>")
    return page(f"jobs on {member}", member, body, csrf=csrf, nonce=nonce)


# --- a job's page ---------------------------------------------------------------------------


def preview_html(label: str, digest: object, text: str | None, total: int | None,
                 download: str) -> str:
    """The head of one output of an item, and the link to all of it."""
    if not isinstance(digest, str):
        return f"<h3>{e(label)}</h3><p class=\"note\">none (not written, or the item has not ended)</p>"
    link = f'<a href="/blobs/{e(q(digest))}" download="{e(download)}">download {e(label)}</a>'
    if text is None:
        return (f"<h3>{e(label)}</h3><p class=\"note\">not readable on this member now "
                f"(it may still be copied here); {link}</p>")
    cut = total is not None and total > limits.webui_preview_bytes_max
    about = (f"the first {size(limits.webui_preview_bytes_max)} of {size(total)}; " if cut
             else f"{size(total)}; " if total is not None else "")
    return (f'<h3>{e(label)}</h3><pre class="out">{e(text)}</pre>'
            f'<p class="note">{about}{link}</p>')


def live_html(label: str, text: str | None, more: bool, follow: str) -> str:
    """The tail of a running item's output so far, and the link that follows it."""
    link = f'<a href="{e(follow)}">{e(label)} (live)</a>'
    if text is None:
        return (f"<h3>{e(label)} so far</h3><p class=\"note\">not readable now (not started "
                f"yet, or its member does not answer); {link}</p>")
    about = (f"the last {size(limits.webui_preview_bytes_max)} of what was read"
             + (" (there is more)" if more else "") + "; ")
    return (f'<h3>{e(label)} so far</h3><pre class="out live">{e(text)}</pre>'
            f'<p class="note">{about if text else "nothing yet; "}{link}</p>')


def job_page(member: str, record: dict, failed: Sequence[tuple[dict, str | None]],
             n_failed: int, *, items_from: int = 0,
             preview: tuple[dict, dict[str, tuple[str | None, int | None]]] | None = None,
             csrf: str = "", nonce: str = "", paged: bool = False,
             live: dict[str, tuple[str | None, bool]] | None = None) -> str:
    """A job's page: its program, pool, tags, state, counts and times; why each failed item
    failed (with the last lines of its stderr); a page of its items with their times and
    outputs; the head of one item's outputs (`preview`: the item and, by stream, its text and
    size); Cancel, Hold and Release while it is unfinished. The record's "items" are all its
    items, or with `paged` only the page from `items_from` (of its "items_total")."""
    jid = str(record.get("id", ""))
    st = str(record.get("state", ""))
    base = f"/jobs/{e(q(jid))}"
    runtime = record.get("runtime_s")
    facts = [
        ("state", f'<span class="state {e(st)}">{e(st)}</span>'
                  + (" (held: no new items start)" if record.get("hold") and st != "held" else "")),
        ("program", f"<code>{e(argv_text(record.get('argv')))}</code>"),
        ("pool", e(str(record.get("pool", "")))),
        ("user", e(str(record.get("user") or "the pool's default, or meshd's own"))),
        ("folder", e(str(record.get("cwd") or "the member's own"))),
        ("tags", e(tags_text(record.get("tags")))),
        ("items", e(f"{record.get('items_done', 0)} done, {record.get('items_failed', 0)} failed, "
                    f"{record.get('items_running', 0)} running, "
                    f"{record.get('items_pending', 0)} pending, "
                    f"{record.get('items_total', 0)} total")),
        ("priority", e(str(record.get("priority", "")))),
        ("retries", e(str(record.get("retries", "")))),
        ("runtime limit", e(f"{runtime:g} s" if isinstance(runtime, (int, float)) else "none")),
        ("submitted (UTC)", e(when(record.get("submitted_at")))),
        ("finished (UTC)", e(when(record.get("finished_at")))),
        ("took", e(took(record.get("submitted_at"), record.get("finished_at")))),
    ]
    facts += _placement_facts(record) + _rerun_facts(record)
    after = record.get("after")
    if isinstance(after, list) and after:
        waits = {str(d.get("id")) for d in record.get("waiting_on") or [] if isinstance(d, dict)}
        facts.append(("after", ", ".join(
            f'<a href="/jobs/{e(q(str(d.get("id"))))}">{e(str(d.get("id")))}</a>:'
            f'{e(str(d.get("on")))}' + (" (waiting)" if str(d.get("id")) in waits else "")
            for d in after if isinstance(d, dict))))
    names = record.get("names") if isinstance(record.get("names"), list) else None
    failed_rows = []
    for item, tail in failed:
        failed_rows.append(
            "<tr>"
            f'<td class="n"><a href="{base}?item={e(q(item.get("index", "")))}#preview">'
            f'{e(str(item.get("index", "")))}</a>{_name_of(item, names)}</td>'
            f'<td class="state failed">{e(str(item.get("state", "")))}</td>'
            f"<td>{e(item_reason(item, runtime))}</td>"
            f'<td class="n">{e(str(item.get("attempts", "")))}</td>'
            f"<td>{e(str(item.get('member') or '-'))}</td>"
            f"<td><pre>{e(tail) if tail else '-'}</pre></td>"
            "</tr>")
    more = (f"<p>… and {n_failed - len(failed)} more failed item(s): see "
            f'<a href="{base}?items=1&amp;format=json">the JSON</a>.</p>'
            if n_failed > len(failed) else "")
    failed_html = (
        '<h2 id="failed">Failed items</h2>\n<table><thead><tr><th>item</th><th>state</th>'
        "<th>why</th><th>attempts</th><th>member</th><th>stderr (last lines)</th></tr></thead>\n"
        "<tbody>\n" + "\n".join(failed_rows) + "\n</tbody></table>\n" + more
    ) if failed_rows else ""
    items = [it for it in record.get("items") or [] if isinstance(it, dict)]
    if paged:
        total = _int_or(record.get("items_total"), len(items))
        page_items = items[: limits.webui_items_shown_max]
    else:
        total = len(items)
        page_items = items[items_from: items_from + limits.webui_items_shown_max]
    item_rows = [_item_row(base, jid, it, runtime, names) for it in page_items]
    nav = []
    if items_from > 0:
        prev = max(0, items_from - limits.webui_items_shown_max)
        nav.append(f'<a href="{base}?items_from={prev}#items">earlier items</a>')
    if items_from + limits.webui_items_shown_max < total:
        nav.append(f'<a href="{base}?items_from={items_from + limits.webui_items_shown_max}'
                   '#items">later items</a>')
    items_html = (
        f'<h2 id="items">Items</h2>\n<p>items {items_from if page_items else 0}'
        f"–{items_from + len(page_items) - 1 if page_items else 0} of {total} "
        f"(at most {limits.webui_items_shown_max} a page). {' · '.join(nav)}</p>\n"
        "<table><thead><tr><th>item</th><th>state</th><th>why</th><th>rc</th><th>attempts</th>"
        "<th>member</th><th>started (UTC)</th><th>ended (UTC)</th><th>took</th><th>output</th>"
        "</tr></thead>\n<tbody>\n" + "\n".join(item_rows) + "\n</tbody></table>\n"
    ) if total else ""
    preview_part = ""
    if preview is not None:
        item, outs = preview
        idx = str(item.get("index", ""))
        if live is not None:
            # Running: the output so far (its tail), and the live links for all of it.
            parts = [live_html(stream, *live.get(stream, (None, False)),
                               f"/jobs/{q(jid)}/items/{q(idx)}/{stream}?follow=1")
                     for stream in ("stdout", "stderr")]
        else:
            parts = [preview_html(stream, item.get(stream), *outs.get(stream, (None, None)),
                                  download=f"{jid}-{idx}.{stream}")
                     for stream in ("stdout", "stderr")]
        preview_part = (f'<section id="preview" aria-labelledby="preview-h"><h2 id="preview-h">'
                        f"Output of item {e(idx)}{_name_of(item, names)}</h2>\n"
                        + "\n".join(parts) + "</section>\n")
    acts = buttons(record)
    body = (
        f'<main data-page="job" data-job="{e(jid)}" data-sig="{e(sig(record))}">\n'
        f'<h1>Job {e(jid)} <span class="state {e(st)}">{e(st)}</span></h1>\n'
        f'<p><a href="/jobs">all jobs</a> · <a href="{base}?items=1&amp;format=json">JSON</a> · '
        '<span id="live-note" class="note">Live updates need the page\'s script.</span></p>\n'
        + (f'<p class="act">{acts}</p>\n' if acts else "")
        + '<table class="facts"><tbody>\n'
        + "\n".join(f"<tr><th>{e(k)}</th><td>{v}</td></tr>" for k, v in facts)
        + "\n</tbody></table>\n" + failed_html + _attempts_html(base, items) + preview_part
        + items_html + "</main>")
    return page(f"job {jid} on {member}", member, body, csrf=csrf, nonce=nonce)


def _attempts_html(base: str, items: list[dict]) -> str:
    """Why the earlier attempts of the items shown ended (a lease lost with its member, a
    failure tried again), oldest first."""
    rows = [
        "<tr>"
        f'<td class="n"><a href="{base}?item={e(q(it.get("index", "")))}#preview">'
        f'{e(str(it.get("index", "")))}</a></td>'
        f'<td class="n">{e(str(t.get("attempt", "")))}</td>'
        f"<td>{e(str(t.get('member') or '-'))}</td>"
        f'<td class="t">{e(when(t.get("at")))}</td>'
        f"<td>{e(str(t.get('why', '')))}</td>"
        "</tr>"
        for it in items[: limits.webui_items_shown_max]
        for t in it.get("earlier_attempts") or [] if isinstance(t, dict)]
    if not rows:
        return ""
    return ('<h2 id="attempts">Earlier attempts</h2>\n<table><thead><tr><th>item</th>'
            "<th>attempt</th><th>member</th><th>ended (UTC)</th><th>why</th></tr></thead>\n"
            "<tbody>\n" + "\n".join(rows) + "\n</tbody></table>\n")


def _name_of(item: dict, names: list | None) -> str:
    """ (NAME): the item's input file name, as the CLI says it (`item 4 (zz-bad.txt)`)."""
    name = item.get("name")
    i = item.get("index")
    if not isinstance(name, str) and names and isinstance(i, int) and 0 <= i < len(names):
        name = names[i]
    return f' <span class="name">({e(name)})</span>' if isinstance(name, str) else ""


def _item_row(base: str, jid: str, item: dict, runtime: object,
              names: list | None = None) -> str:
    idx = str(item.get("index", ""))
    st = str(item.get("state", ""))
    why = item_reason(item, runtime) if st in FAILED_ITEM_STATES else (item.get("error") or "")
    sig_ = item.get("signal")
    rc = item.get("rc")
    outs = []
    for stream in ("stdout", "stderr"):
        digest = item.get(stream)
        if isinstance(digest, str):
            outs.append(f'<a href="/blobs/{e(q(digest))}" download="{e(f"{jid}-{idx}.{stream}")}">'
                        f"{stream}</a>")
    if outs:
        outs.append(f'<a href="{base}?item={e(q(idx))}#preview">preview</a>')
    elif st in ("leased", "running"):
        # Running: its output as it is written, from the member running it (via this one).
        live = f"/jobs/{q(jid)}/items/{q(idx)}"
        outs = [f'<a href="{e(live)}/{stream}?follow=1">{stream} (live)</a>'
                for stream in ("stdout", "stderr")]
        outs.append(f'<a href="{base}?item={e(q(idx))}#preview">so far</a>')
    return (
        "<tr>"
        f'<td class="n">{e(idx)}{_name_of(item, names)}</td>'
        f'<td class="state {e(st)}">{e(st)}</td>'
        f"<td>{e(str(why))}</td>"
        f'<td class="n">{e(str(rc)) if rc is not None else (e("signal " + str(sig_)) if sig_ else "")}</td>'
        f'<td class="n">{e(str(item.get("attempts", "")))}</td>'
        f"<td>{e(str(item.get('member') or ''))}</td>"
        f'<td class="t">{e(when(item.get("started_at")))}</td>'
        f'<td class="t">{e(when(item.get("ended_at")))}</td>'
        f"<td>{e(took(item.get('started_at'), item.get('ended_at')))}</td>"
        f"<td>{' '.join(outs)}</td>"
        "</tr>")


# --- the fleet ------------------------------------------------------------------------------


def _placement_facts(record: dict) -> list[tuple[str, str]]:
    """Where a job's items may run, and why they wait (placement)."""
    out = []
    selector = record.get("member")
    if selector is not None:
        members = record.get("members")
        where = ("every member of the pool, once each" if selector == "*"
                 else f"members matching {selector}")
        if isinstance(members, list) and members:
            where += ": " + ", ".join(str(m) for m in members)
        out.append(("runs on", e(where)))
    why = record.get("waiting_for")
    if why:
        out.append(("waiting for", e(str(why))))
    if record.get("notify"):
        out.append(("notify", e(str(record["notify"]))))
    return out


def _rerun_facts(record: dict) -> list[tuple[str, str]]:
    """Which run this is, and earlier runs (rerun, restart, resubmit)."""
    out = []
    run = record.get("run")
    if isinstance(run, int) and run > 1:
        out.append(("run", e(f"{run} (restarts {record.get('restarts', 0)}, resubmits "
                             f"{record.get('resubmits', 0)})")))
    due = record.get("rerun_due_at")
    if due is not None:
        out.append(("runs again (UTC)", e(f"{when(due)} ({record.get('rerun_due_why') or ''})")))
    past = record.get("previous_runs")
    if isinstance(past, list) and past:
        out.append(("earlier runs", e("; ".join(
            f"run {p.get('run')}: {p.get('state')} at {when(p.get('finished_at'))}"
            for p in past[-5:] if isinstance(p, dict)))))
    return out


def _yes(value: object) -> str:
    return "unknown" if value is None else "yes" if value else "no"


def _bad(flag: object) -> str:
    return ' class="failed"' if flag else ""


def _orders_text(m: dict) -> str:
    """A member's orders in force (meshctl member drain|stop)."""
    words = [w for w, on in (("stopping", m.get("stopping")), ("drained", m.get("drained"))) if on]
    return ", ".join(words) or "none"


def fleet_page(member: str, fleet: dict, *, nonce: str = "") -> str:
    """The fleet as a member sees it: leader, term, and each member's role, liveness, slots,
    running items, blob store bytes and pressure, full disk, when it was last heard of, and how
    far its wall clock is off the leader's (with a warning past link_clock_skew_warn_ms)."""
    members = [m for m in fleet.get("members") or [] if isinstance(m, dict)]
    rows = []
    for m in members:
        pools = m.get("pools") if isinstance(m.get("pools"), dict) else {}
        alive = m.get("alive")
        rows.append(
            "<tr>"
            f"<td>{e(str(m.get('name', '')))}</td>"
            f'<td class="role {e(str(m.get("role", "")))}">{e(str(m.get("role", "")))}</td>'
            f'<td class="{"done" if alive else "failed" if alive is False else "pending"}">'
            f"{e(alive_words(m))}</td>"
            f"<td>{e(', '.join(f'{k}: {v}' for k, v in pools.items()))}</td>"
            f'<td class="n">{e(str(m.get("slots", "")))}</td>'
            f'<td class="n">{e(str(m.get("running", "")))}</td>'
            f"<td>{e(_orders_text(m))}</td>"
            f'<td class="n">{e(size(m.get("blob_bytes")))}</td>'
            f"<td{_bad(m.get('blob_pressure'))}>{_yes(m.get('blob_pressure'))}</td>"
            f"<td{_bad(m.get('disk_full'))}>{_yes(m.get('disk_full'))}</td>"
            f'<td class="t">{e(when(m.get("last_seen")))}</td>'
            f'<td class="n"{_bad(_off(m))}>{e(skew(m.get("clock_skew_ms")))}</td>'
            "</tr>")
    n_alive = sum(1 for m in members if m.get("alive"))
    leader = fleet.get("leader")
    body = (
        '<main data-page="fleet">\n<h1>Fleet</h1>\n'
        f"<p>Leader: <strong>{e(str(leader)) if leader else 'none known'}</strong>, "
        f"term {e(str(fleet.get('term', '')))}. {len(members)} member(s), {n_alive} alive, "
        f"as member {e(member)} sees it. "
        '<a href="/fleet?format=json">JSON</a> '
        '<span id="live-note" class="note">Live updates need the page\'s script.</span></p>\n'
        "<table><thead><tr><th>member</th><th>role</th><th>alive</th><th>pools (slots)</th>"
        "<th>slots</th><th>running</th><th>orders</th><th>blob bytes</th><th>blob pressure</th>"
        "<th>disk full</th><th>last seen (UTC)</th><th>clock</th></tr></thead>\n<tbody>\n"
        + "\n".join(rows) + "\n</tbody></table>\n" + _items_warnings(members)
        + _clock_warnings(fleet) + "</main>")
    return page(f"fleet seen from {member}", member, body, nonce=nonce)


def _off(m: dict) -> bool:
    ms = m.get("clock_skew_ms")
    return isinstance(ms, int) and abs(ms) > limits.link_clock_skew_warn_ms


def _clock_warnings(fleet: dict) -> str:
    """A warning per member whose clock is far off (`clock_warnings`), for the fleet page."""
    return "".join(f'<p class="failed" role="alert" data-clock-warning="{e(name)}">'
                   f"<strong>{e(name)}</strong>: {e(why)}</p>\n"
                   for name, why in clock_warnings(fleet))


def _items_warnings(members: list[dict]) -> str:
    """A warning per member whose items are not walled off from it (`items.warning` of
    /fleet, meshjobs/wall.py), for the fleet page."""
    out = []
    for m in members:
        items = m.get("items")
        why = items.get("warning") if isinstance(items, dict) else None
        if isinstance(why, str) and why:
            out.append(f'<p class="failed" role="alert" data-items-warning="{e(str(m.get("name")))}">'
                       f"<strong>{e(str(m.get('name')))}</strong>: {e(why)}</p>\n")
    return "".join(out)


def error_page(member: str, status: int, message: str) -> str:
    """What a browser sees when the member cannot show what it asked for: the API's words."""
    body = (f'<main data-page="error"><h1>{e(str(status))}: cannot show this page</h1>'
            f'<p class="failed" role="alert">{e(message)}</p>'
            '<p><a href="/jobs">all jobs</a> · <a href="/fleet">fleet</a></p></main>')
    return page(f"{status} on {member}", member, body)


# --- logging in -----------------------------------------------------------------------------


def login_page(member: str, nxt: str, needed: bool, problem: str | None) -> str:
    if not needed:
        body = (f"<main><h1>Log in to {e(member)}</h1><p>{e(member)} has no [auth] table: it "
                'needs no login. <a href="/jobs">Jobs</a></p></main>')
    else:
        body = (
            f"<main><h1>Log in to {e(member)}</h1>"
            + (f'<p class="failed" role="alert">{e(problem)}</p>' if problem else "")
            + '<form method="post" action="/login">'
            f'<input type="hidden" name="next" value="{e(nxt)}">'
            '<label>Token <input type="password" name="token" autocomplete="current-password" '
            'required autofocus></label> <button>Log in</button></form>'
            "<p>The token is one of the member's [auth] tokens; the browser keeps a session "
            "cookie, not the token.</p></main>")
    return page(f"log in to {member}", member, body, sign_out=False)


# --- the script -----------------------------------------------------------------------------

UI_SCRIPT_TEMPLATE = r"""
// meshjobs web UI: the one script of the pages (served as /ui.js under the pages' CSP nonce).
// Buttons (cancel, hold, release) post JSON with the page's anti-CSRF value; the job list and a
// job's page follow changes live through GET /events, and poll the JSON API every POLL_MS when
// the event stream fails (no /events, or a proxy that breaks server-sent events).
"use strict";
(() => {
  const POLL_MS = __POLL_MS__;
  const SSE_RETRY_MS = __SSE_RETRY_MS__;
  const TERMINAL = ["done", "failed", "cancelled", "dep_failed"];
  const main = document.querySelector("main");
  const meta = document.querySelector('meta[name="meshjobs-csrf"]');
  const csrf = meta ? meta.content : "";
  const msg = document.getElementById("msg");

  const say = (text, bad) => {
    if (!msg) return;
    msg.textContent = text;
    msg.className = bad ? "bad" : "ok";
  };
  let lastNote = "";
  const note = (text) => {  // looked up each time: a swapped <main> has a new one
    lastNote = text;
    const el = document.getElementById("live-note");
    if (el) el.textContent = text;
  };

  // --- buttons ---------------------------------------------------------------------------------

  const ACTIONS = {cancel: ["cancel", {}], hold: ["tone", {hold: true}],
                   release: ["tone", {hold: false}], rerun: ["rerun", {}]};
  let changed = () => {};

  document.addEventListener("click", async (ev) => {
    const b = ev.target.closest("button[data-job]");
    if (!b) return;
    const act = Object.keys(ACTIONS).find((c) => b.classList.contains(c));
    if (!act) return;
    const [op, body] = ACTIONS[act];
    const job = b.dataset.job;
    b.disabled = true;
    try {
      const r = await fetch("/jobs/" + encodeURIComponent(job) + "/" + op, {
        method: "POST", credentials: "same-origin", body: JSON.stringify(body),
        headers: {"Content-Type": "application/json", "Accept": "application/json",
                  "X-Meshjobs-Csrf": csrf}});
      const answer = await r.json().catch(() => ({}));
      if (!r.ok) throw new Error(answer.error || ("HTTP " + r.status));
      say(b.textContent + " job " + job + ": it is " + (answer.state || "changed") + " now.", false);
      changed(answer);
    } catch (e) {
      say(b.textContent + " job " + job + " was refused: " + e.message, true);
      b.disabled = false;
    }
  });

  // --- the live source: /events, else polling --------------------------------------------------

  function live(url, onEvent, poll) {
    let timer = null;
    const startPolling = () => {
      if (timer !== null) return;
      note("live: polling every " + POLL_MS / 1000 + " s");
      const since = Date.now();
      const tick = async () => {
        try {
          await poll();
          note("live: polling every " + POLL_MS / 1000 + " s");
        } catch (e) {
          note("live: polling, the last try failed (" + e.message + ")");
        }
        if (window.EventSource && Date.now() - since >= SSE_RETRY_MS) {
          timer = null;
          connect();
          return;
        }
        timer = setTimeout(tick, POLL_MS);
      };
      timer = setTimeout(tick, 0);
    };
    const connect = () => {
      if (!window.EventSource) { startPolling(); return; }
      const es = new EventSource(url);
      es.addEventListener("open", () => { note("live: events"); poll().catch(() => {}); });
      for (const kind of ["job", "forget", "reset"]) {
        es.addEventListener(kind, (ev) => {
          let data;
          try { data = JSON.parse(ev.data); } catch (e) { return; }
          onEvent(kind, data);
        });
      }
      es.addEventListener("error", () => { es.close(); startPolling(); });
    };
    connect();
  }

  const getJson = async (path) => {
    const r = await fetch(path, {credentials: "same-origin", headers: {"Accept": "application/json"}});
    if (!r.ok) {
      const answer = await r.json().catch(() => ({}));
      throw new Error(answer.error || ("HTTP " + r.status));
    }
    return r.json();
  };

  // The same words as the server's rendering (meshjobs/webui.py); keep the two in step.
  const sig = (j) => [j.state, j.items_done ?? 0, j.items_failed ?? 0, j.items_running ?? 0,
                      j.priority ?? 0, j.hold ? 1 : 0].join("/");
  const when = (s) => {
    if (typeof s !== "number") return s == null ? "" : String(s);
    const d = new Date(s > 1e11 ? s : s * 1000);
    return isNaN(d) ? String(s) : d.toISOString().slice(0, 19).replace("T", " ");
  };
  const quote = (a) => {
    a = String(a);
    if (a === "") return "''";
    return /[^\w@%+=:,./-]/.test(a) ? "'" + a.replace(/'/g, "'\"'\"'") + "'" : a;
  };
  const argvText = (argv) => Array.isArray(argv) ? argv.map(quote).join(" ") : String(argv ?? "");
  const short = (text, n) => text.length > n ? text.slice(0, n - 1) + "\u2026" : text;

  const cell = (text, cls) => {
    const td = document.createElement("td");
    if (cls) td.className = cls;
    td.textContent = text;
    return td;
  };
  const button = (cls, label, job) => {
    const b = document.createElement("button");
    b.className = cls;
    b.dataset.job = job;
    b.textContent = label;
    return b;
  };

  function row(j) {
    const tr = document.createElement("tr");
    const id = String(j.id);
    tr.dataset.id = id;
    tr.dataset.sig = sig(j);
    tr.dataset.at = String(j.submitted_at ?? "");
    if (j.version != null) tr.dataset.version = String(j.version);
    const a = document.createElement("a");
    a.href = "/jobs/" + encodeURIComponent(id);
    a.textContent = id;
    const first = document.createElement("td");
    first.append(a);
    const st = String(j.state ?? "");
    const prog = argvText(j.argv);
    const code = document.createElement("code");
    code.textContent = short(prog, 60);
    code.title = prog;
    const progCell = document.createElement("td");
    progCell.className = "prog";
    progCell.append(code);
    const tags = Array.isArray(j.tags) ? j.tags.map(String).join(", ") : String(j.tags ?? "");
    const acts = document.createElement("td");
    acts.className = "act";
    if (["done", "failed", "cancelled"].includes(st)) {
      acts.append(button("rerun", "Rerun", id));
    } else if (!TERMINAL.includes(st)) {
      acts.append(button("cancel", "Cancel", id));
      acts.append(j.hold || st === "held" ? button("release", "Release", id)
                                          : button("hold", "Hold", id));
    }
    tr.append(first, cell(st, "state " + st), cell(String(j.pool ?? "")), progCell,
              cell((j.items_done ?? 0) + "/" + (j.items_total ?? 0), "n"),
              cell(String(j.items_failed ?? 0), "n"), cell(String(j.priority ?? 0), "n"),
              cell(tags), cell(when(j.submitted_at), "t"), acts);
    return tr;
  }

  // --- the job list ----------------------------------------------------------------------------

  if (main && main.dataset.page === "jobs") {
    const tbody = document.getElementById("jobs");
    const q = new URLSearchParams(main.dataset.query || "");
    const firstPage = !q.get("after");
    const rows = () => new Map([...tbody.querySelectorAll("tr[data-id]")].map((tr) => [tr.dataset.id, tr]));
    const wanted = (j) => (!q.get("state") || j.state === q.get("state"))
      && (!q.get("tag") || (Array.isArray(j.tags) && j.tags.includes(q.get("tag"))))
      && (!q.get("pool") || j.pool === q.get("pool"));
    const tidy = () => {
      const n = tbody.querySelectorAll("tr[data-id]").length;
      const empty = tbody.querySelector("tr.empty");
      if (n && empty) empty.remove();
      const shown = document.getElementById("shown");
      if (shown) shown.textContent = String(n);
    };
    const upsert = (j) => {
      if (!j || j.id == null) return;
      const have = rows().get(String(j.id));
      if (!wanted(j)) { if (have) have.remove(); tidy(); return; }
      if (have && have.dataset.version && j.version != null
          && Number(j.version) < Number(have.dataset.version)) return;  // an older event
      const tr = row(j);
      if (have) {
        if (have.dataset.sig !== tr.dataset.sig || have.dataset.version !== tr.dataset.version) {
          have.replaceWith(tr);
        }
      } else if (firstPage) {
        // A job not shown yet goes on top when it is newer than the newest shown.
        const top = tbody.querySelector("tr[data-id]");
        const topAt = top ? Number(top.dataset.at) : -Infinity;
        if (!(Number(j.submitted_at) < topAt)) tbody.prepend(tr);
      }
      tidy();
    };
    const poll = async () => {
      const p = new URLSearchParams(q);
      p.set("format", "json");
      const jobs = await getJson("/jobs?" + p);
      if (!Array.isArray(jobs)) return;
      const have = rows();
      const next = jobs.map((j) => {
        const tr = row(j);
        const old = have.get(String(j.id));
        return old && old.dataset.sig === tr.dataset.sig ? old : tr;
      });
      const empty = tbody.querySelector("tr.empty");
      tbody.replaceChildren(...next);
      if (!next.length && empty) tbody.append(empty);
      tidy();
    };
    changed = upsert;
    const ev = new URLSearchParams();
    for (const k of ["tag", "pool"]) if (q.get(k)) ev.set(k, q.get(k));
    live("/events?" + ev, (kind, data) => {
      if (kind === "job") upsert(data);
      else if (kind === "forget") { const tr = rows().get(String(data.id)); if (tr) tr.remove(); tidy(); }
      else if (kind === "reset") poll().catch(() => {});
    }, poll);
  }

  // --- a job's page, the fleet: the member renders, the script swaps the page's <main> ------

  let swapping = false;
  const swapMain = async () => {
    if (swapping) return;
    swapping = true;
    try {
      const r = await fetch(location.pathname + location.search, {
        credentials: "same-origin", headers: {"Accept": "text/html"}});
      if (!r.ok) throw new Error("HTTP " + r.status);
      const doc = new DOMParser().parseFromString(await r.text(), "text/html");
      const fresh = doc.querySelector("main");
      if (fresh && fresh.dataset.page === main.dataset.page && fresh.dataset.job === main.dataset.job) {
        main.replaceChildren(...fresh.childNodes);
        main.dataset.sig = fresh.dataset.sig || "";
        if (lastNote) note(lastNote);
      }
    } finally {
      swapping = false;
    }
  };

  if (main && main.dataset.page === "job") {
    const id = main.dataset.job;
    const seen = (j) => { if (j && sig(j) !== main.dataset.sig) return swapMain(); };
    changed = () => { swapMain().catch(() => {}); };
    live("/events?job=" + encodeURIComponent(id), (kind, data) => {
      if (kind === "job" && String(data.id) === id) seen(data)?.catch(() => {});
      else if (kind === "forget" && String(data.id) === id) say("Job " + id + " was forgotten.", true);
      else if (kind === "reset") swapMain().catch(() => {});
    }, async () => seen(await getJson("/jobs/" + encodeURIComponent(id) + "?format=json")));
  }

  if (main && main.dataset.page === "fleet") {
    const tick = async () => {
      try {
        await swapMain();
        note("live: every " + POLL_MS / 1000 + " s");
      } catch (e) {
        note("live: the last try failed (" + e.message + ")");
      }
      setTimeout(tick, POLL_MS);
    };
    setTimeout(tick, POLL_MS);
  }
})();
"""

UI_SCRIPT = (UI_SCRIPT_TEMPLATE.lstrip()
             .replace("__POLL_MS__", str(limits.webui_poll_ms))
             .replace("__SSE_RETRY_MS__", str(limits.webui_sse_retry_ms)))
