"""meshctl: the command line of meshjobs, a small HTTP client of any member.

Rules:
- Exit codes say what happened: 0 ok, 1 the job failed, was cancelled or ended dep_failed
  (`job wait`, `job results`), 5 the job has not finished (`job results`, which prints what
  exists; `job wait` whose --timeout passed), 2 bad
  usage or input, or a missing or refused token (HTTP 400/401/403/409/413/415/421),
  or over a quota (429), 3 no such
  job or forgotten (404), 4 no leader, or the member unreachable or its certificate not trusted
  (503, refused, timeout, TLS). Messages go to stderr and say what to do; the words come
  from the server's `error` when it gave one. No traceback for anything expected.
- One Idempotency-Key per invocation, sent with every request, so that a retry (after a
  connection reset, or on the next member of --at after a connection error or a 502/503/504)
  cannot apply a change twice. Every command goes through Client.open, which passes over the
  members that cannot answer, in order, and names each of them when none could.
- Output bytes are streamed, never held whole in memory.
- A token (MESHJOBS_TOKEN, or the first line of --token-file) is sent as `Authorization:
  Bearer`, and never printed. HTTPS is verified against the system's CAs, or --cacert's.
"""

from __future__ import annotations

import base64
import datetime as dt
import http.client
import io
import json
import os
import shlex
import shutil
import ssl
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from pathlib import Path
from typing import IO, Any, NoReturn

import blake3
import click

import meshjobs
from meshjobs import limits, placement
from meshjobs.control import JOB_FINAL_STATES, JOB_STATES

DEFAULT_AT = "http://127.0.0.1:7700"
TERMINAL = JOB_FINAL_STATES
WAIT_POLL_S = limits.cli_wait_poll_s
# A change may wait ctl_commit_ms_max for its commit; the client waits a little longer.
TIMEOUT_S = limits.ctl_commit_ms_max / 1000 + limits.cli_timeout_slack_s
COPY_CHUNK_BYTES = limits.cli_copy_chunk_bytes


class Failure(click.ClickException):
    """An expected failure: a message for stderr and the exit code that classifies it."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code

    def show(self, file: IO[Any] | None = None) -> None:
        click.echo(f"meshctl: {self.message}", err=True)


class Cut(Failure):
    """A transfer that ended before all its bytes came: the connection, or damage on the member
    (which cuts an answer whose headers went out already)."""


def exit_code_for(status: int) -> int:
    """The exit code for an HTTP status (see docs/contracts.md)."""
    if 200 <= status < 300:
        return 0
    if status == 404:
        return 3
    if status in (502, 503, 504):
        return 4
    if 400 <= status < 500:
        return 2
    return 1


class _TryNext(Exception):
    """One member could not answer (connection error, or HTTP 502/503/504): the next is asked."""

    def __init__(self, failure: Failure, why: str) -> None:
        super().__init__(why)
        self.failure = failure
        self.why = why


class Client:
    """A tiny HTTP client of the members named by --at; every call raises Failure for anything
    but 2xx. A call goes to the member that answered last (the first at the start); when it
    cannot answer (connection error, HTTP 502/503/504) the next is asked, in order, with the
    same Idempotency-Key, so that a change a member made before it died is not made again."""

    def __init__(self, at: str | list[str], key: str, token: str | None = None,
                 tls: ssl.SSLContext | None = None) -> None:
        members = [at] if isinstance(at, str) else list(at)
        assert members, "a client needs a member"
        self.ats = [a.rstrip("/") for a in members]
        self.turn = 0  # the member asked first: the one that answered last
        self.key = key
        self.token = token
        self.tls = tls
        self.on_retry: Any = None  # called with the next member's URL when one cannot answer

    @property
    def at(self) -> str:
        return self.ats[self.turn]

    def _unreachable(self, why: str) -> Failure:
        return Failure(
            f"cannot reach meshd at {self.at} ({why}): is it running? "
            "(start it with `meshd`, or pass --at)", 4)

    def next_member(self) -> None:
        """Ask the next member first from now on (a stream cut on this one)."""
        self.turn = (self.turn + 1) % len(self.ats)
        if self.on_retry is not None:
            self.on_retry(self.at)

    def open(self, method: str, path: str, body: Any = None, timeout: float = TIMEOUT_S,
             retry_s: float | None = None,
             deadline: float | None = None) -> http.client.HTTPResponse:
        """Send a request, return the open 2xx response. A member that cannot answer is passed
        over for the next, in order; after every member failed once, all are asked again with
        backoff while some answered 502/503/504 (an election, a restart: up to
        cli_busy_retry_s_max, when --at names several), or, with `retry_s`, for that long whatever the failures (never
        past the monotonic `deadline`). Then a Failure (exit 4) names each member and why."""
        n = len(self.ats)
        first = time.monotonic()
        rounds = 0
        while True:
            whys: list[tuple[str, str]] = []
            busy = False
            last: Failure | None = None
            for step in range(n):
                if step:
                    self.turn = (self.turn + 1) % n
                    if self.on_retry is not None:
                        self.on_retry(self.at)
                try:
                    return self._open_one(method, path, body, timeout)
                except _TryNext as e:
                    whys.append((self.at, e.why))
                    busy = busy or e.why[:3] in ("502", "503", "504")
                    last = e.failure
            self.turn = (self.turn + 1) % n  # the next round starts after the last one asked
            now = time.monotonic()
            pause = min(limits.cli_wait_backoff_s_base * 2 ** rounds, limits.cli_wait_backoff_s_max)
            # One member alone answers as it always did: at once (its 503 says what to do).
            window = retry_s if retry_s is not None else (
                limits.cli_busy_retry_s_max if busy and n > 1 else 0)
            stop = first + window if deadline is None else min(first + window, deadline)
            if now + pause >= stop:
                assert last is not None
                if n == 1:
                    raise last
                tried = "; ".join(f"{at}: {why}" for at, why in whys)
                raise Failure(
                    f"cannot reach any member: {tried}. Start the members that are down "
                    "(`meshd`), wait for a leader if one says there is none, or pass --at (or "
                    "MESHJOBS_AT) a member that is up", 4)
            rounds += 1
            if self.on_retry is not None:
                self.on_retry(self.at)
            time.sleep(pause)

    def _open_one(self, method: str, path: str, body: Any,
                  timeout: float) -> http.client.HTTPResponse:
        """Send a request to the member self.at; _TryNext when it cannot answer."""
        data = None
        headers = {"Accept": "application/json", "Idempotency-Key": self.key,
                   "User-Agent": "meshctl"}
        if self.token is not None:
            headers["Authorization"] = f"Bearer {self.token}"
        if body is not None:
            data = json.dumps(body).encode()
            if len(data) > limits.http_body_bytes_max:
                raise Failure(
                    f"the request is {len(data)} bytes, over the limit of "
                    f"{limits.http_body_bytes_max}: split the job, or refer to stored blobs", 2)
            headers["Content-Type"] = "application/json"

        def down(why: str) -> _TryNext:
            return _TryNext(self._unreachable(why), why)

        for attempt in (1, 2):
            req = urllib.request.Request(self.at + path, data=data, headers=headers, method=method)
            try:
                return urllib.request.urlopen(req, timeout=timeout, context=self.tls)
            except urllib.error.HTTPError as e:
                failure, said = self._failure(e)
                if e.code in (502, 503, 504):
                    raise _TryNext(failure, f"{e.code} {said}") from None
                raise failure from None
            except (ConnectionResetError, http.client.RemoteDisconnected, BrokenPipeError) as e:
                if attempt == 2:
                    raise down(f"connection lost: {e}") from None
            except urllib.error.URLError as e:
                reason = e.reason
                if isinstance(reason, (ConnectionResetError, BrokenPipeError)) and attempt == 1:
                    continue
                if isinstance(reason, TimeoutError):
                    raise down(f"no answer within {timeout:g} s") from None
                if isinstance(reason, ssl.SSLError):
                    raise self._untrusted(reason) from None
                raise down(str(getattr(reason, "strerror", None) or reason)) from None
            except TimeoutError:
                raise down(f"no answer within {timeout:g} s") from None
            except ssl.SSLError as e:
                raise self._untrusted(e) from None
            except (http.client.HTTPException, OSError) as e:
                raise down(str(e) or type(e).__name__) from None
        raise AssertionError("unreachable: the loop returns or raises")

    def _untrusted(self, e: ssl.SSLError) -> Failure:
        why = getattr(e, "verify_message", None) or getattr(e, "reason", None) or str(e)
        if not isinstance(e, ssl.SSLCertVerificationError):
            return Failure(f"TLS with meshd at {self.at} failed ({why}): does it serve https? "
                           "(an http:// member needs an http:// URL in --at)", 4)
        return Failure(
            f"cannot trust meshd at {self.at} (TLS: {why}): if it uses its own or a self-signed "
            "certificate, pass --cacert FILE (or set MESHJOBS_CACERT) with that certificate", 4)

    def _failure(self, e: urllib.error.HTTPError) -> tuple[Failure, str]:
        """The Failure of an error answer, and the server's words alone."""
        try:
            raw = e.read(limits.cli_error_bytes_max)
            message = json.loads(raw)["error"]
            if not isinstance(message, str):
                raise TypeError(message)
        except Exception:
            message = f"{self.at} answered HTTP {e.code} {e.reason}: is it a meshd?"
        finally:
            e.close()
        said = message
        if e.code in (502, 503, 504):
            message += f" (meshd at {self.at}; try again, or pass --at another member)"
        elif e.code == 401 and self.token is None:
            message = f"meshd at {self.at} wants a token: set MESHJOBS_TOKEN or pass --token-file"
        elif e.code == 401:
            message = (f"meshd at {self.at} refused the token: {message} (is MESHJOBS_TOKEN or "
                       "--token-file one of this fleet's tokens?)")
        elif e.code == 403:
            message = f"meshd at {self.at} refused: {message}"
        return Failure(message, exit_code_for(e.code)), said

    def copy(self, resp: IO[bytes], out: IO[bytes], digest: str | None = None) -> None:
        """Stream an answer's body to `out`; a cut or stalled transfer is a Failure (exit 4).
        With `digest`, the bytes are hashed as they pass and must hash to it (a Damaged
        failure, exit 1, when they do not)."""
        # http.client's read(n) returns short at a closed connection instead of raising, so the
        # length is checked here.
        length = resp.headers.get("Content-Length")
        hasher = blake3.blake3() if digest is not None else None
        got = 0
        while True:
            try:
                chunk = resp.read(COPY_CHUNK_BYTES)
            except (http.client.HTTPException, TimeoutError, ConnectionError) as e:
                raise Cut(f"the transfer from meshd at {self.at} broke off "
                          f"({type(e).__name__}); try again", 4) from None
            if not chunk:
                break
            got += len(chunk)
            if hasher is not None:
                hasher.update(chunk)
            out.write(chunk)
        if length is not None and length.isdigit() and got != int(length):
            raise Cut(f"the transfer from meshd at {self.at} broke off after {got} of "
                      f"{length} bytes; try again", 4)
        if hasher is not None and hasher.hexdigest() != digest:
            raise Failure(f"blob {digest} arrived from meshd at {self.at} with other bytes than "
                          "its digest names: the member's copy is damaged; try again (a member "
                          "repairs a damaged copy from another member's), or pass --at another "
                          "member", 1)

    def json(self, method: str, path: str, body: Any = None,
             timeout: float = TIMEOUT_S, **retry: Any) -> Any:
        return self.json_status(method, path, body, timeout, **retry)[1]

    def json_status(self, method: str, path: str, body: Any = None,
                    timeout: float = TIMEOUT_S, **retry: Any) -> tuple[int, Any]:
        """The 2xx status and the JSON body of an answer (a submit's 201 is a new job, its 200
        one that was there: the same Idempotency-Key, or an id already taken by this spec)."""
        for step in range(len(self.ats)):
            buf = io.BytesIO()
            try:
                with self.open(method, path, body, timeout, **retry) as resp:
                    self.copy(resp, buf)
                    status = resp.status
                break
            except Cut:
                # The member went away mid-answer: the next one answers the same (a change with
                # the same Idempotency-Key is answered as the one it made).
                if step == len(self.ats) - 1:
                    raise
                self.next_member()
        raw = buf.getvalue()
        try:
            return status, json.loads(raw)
        except ValueError:
            raise Failure(f"meshd at {self.at} answered something that is not JSON", 1) from None


def _client(ctx: click.Context) -> Client:
    obj = ctx.find_root().obj
    return Client(obj.get("ats") or [obj["at"]], obj["key"], obj.get("token"), obj.get("tls"))


def _check_token(token: str, where: str) -> str:
    # Visible ASCII only: anything else could not travel in a header (or would split it).
    if not token or not all(0x21 <= ord(c) <= 0x7E for c in token):
        raise Failure(f"the token in {where} is empty or has spaces, control or non-ASCII "
                      "characters: a token is one line of visible ASCII", 2)
    if len(token) > limits.http_token_chars_max:
        raise Failure(f"the token in {where} is longer than {limits.http_token_chars_max} "
                      "characters", 2)
    return token


def _read_token(token_file: str | None) -> str | None:
    """The token from --token-file (its first line), else MESHJOBS_TOKEN, else None."""
    if token_file is not None:
        try:
            with open(token_file, "rb") as f:
                first = f.read(limits.http_token_chars_max + 2).split(b"\n", 1)[0]
        except OSError as e:
            raise Failure(f"cannot read --token-file {token_file}: {e.strerror or e}", 2) from None
        try:
            token = first.decode("ascii").strip()
        except UnicodeDecodeError:
            token = "\x00"
        if not token:
            raise Failure(f"--token-file {token_file} is empty: its first line must be the token", 2)
        return _check_token(token, f"--token-file {token_file}")
    env = os.environ.get("MESHJOBS_TOKEN")
    if env is None or env.strip() == "":
        return None
    return _check_token(env.strip(), "MESHJOBS_TOKEN")


def _tls(cacert: str | None) -> ssl.SSLContext:
    if cacert is None:
        return ssl.create_default_context()
    try:
        return ssl.create_default_context(cafile=cacert)
    except (OSError, ssl.SSLError) as e:
        why = getattr(e, "strerror", None) or getattr(e, "reason", None) or str(e)
        raise Failure(f"cannot use --cacert {cacert}: {why} (give a PEM certificate file)", 2) from None


def _wants_json(ctx: click.Context, local: bool) -> bool:
    return local or bool(ctx.find_root().obj["json"])


def _binary(name: str) -> IO[bytes]:
    """The byte stream under sys.stdout or sys.stderr (as click's testing runner swaps them
    too); click.get_binary_stream is deprecated."""
    stream = sys.stdout if name == "stdout" else sys.stderr
    stream.flush()
    return stream.buffer


def _print_json(value: Any) -> None:
    click.echo(json.dumps(value, indent=2, sort_keys=True))


def _q(job_id: str) -> str:
    return urllib.parse.quote(job_id, safe="")


json_option = click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")


def _filter_options(f: Any) -> Any:
    """--tag/--state/--pool/--member: the filter of a command on many jobs."""
    for opt in reversed([
        click.option("--tag", help="Jobs with this tag."),
        click.option("--state", type=click.Choice(JOB_STATES), help="Jobs in this state."),
        click.option("--pool", help="Jobs of this pool."),
        click.option("--member", metavar="NAME",
                     help="Jobs with an item that ran or runs on this member."),
    ]):
        f = opt(f)
    return f


_dry_run_option = click.option("--dry-run", "dry_run", is_flag=True,
                               help="Show what would change, and change nothing.")


def _filter(tag: str | None, state: str | None, pool: str | None,
            member: str | None) -> dict[str, str]:
    return {k: v for k, v in (("tag", tag), ("state", state), ("pool", pool),
                              ("member", member)) if v is not None}


BULK_WORDS = {"changed": "changed", "would_change": "would change", "already_final":
              "already ended", "no_such_job": "no such job", "refused": "refused",
              "found": "found"}


def _bulk(ctx: click.Context, action: str, job_ids: tuple[str, ...], flt: dict[str, str],
          dry_run: bool, fields: dict | None, as_json: bool) -> None:
    """One command on many jobs: by ids or a filter, page after page (a filter matches at most
    bulk_jobs_max jobs per request); one line per job, then a count of each answer. Exit 0 when
    every job was found and none refused, 1 when some were not found or refused, 3 when none
    was found."""
    if job_ids and flt:
        raise click.UsageError("give job ids or a filter (--tag/--state/--pool/--member), "
                               "not both")
    if not job_ids and not flt:
        raise click.UsageError("give one or more job ids, or a filter: --tag, --state, --pool "
                               "or --member")
    if len(job_ids) > limits.bulk_jobs_max:
        raise click.UsageError(f"at most {limits.bulk_jobs_max} ids at once: split them, or use "
                               "a filter")
    base = _client(ctx)
    body: dict[str, Any] = {"ids": list(job_ids)} if job_ids else {"filter": flt}
    if dry_run:
        body["dry_run"] = True
    if fields is not None:
        body["set"] = fields
    results: list[dict] = []
    page = 0
    while True:
        page += 1
        # Each page is its own change: its own idempotency key, derived from the command's.
        client = Client(base.ats, f"{base.key}:{page}", base.token, base.tls)
        answer = client.json("POST", f"/jobs/{action}", body)
        results.extend(answer.get("results") or [])
        nxt = answer.get("next")
        if not isinstance(nxt, str):
            break
        body["after"] = nxt
    counts: dict[str, int] = {}
    for r in results:
        counts[r.get("answer")] = counts.get(r.get("answer"), 0) + 1
    if _wants_json(ctx, as_json):
        _print_json({"action": action, "dry_run": dry_run, "matched": len(results),
                     "counts": counts, "results": results})
    else:
        for r in results:
            job = r.get("job") or {}
            if action == "status" and job:
                tags = ",".join(job.get("tags") or []) or "-"
                click.echo(f"{r.get('id')}  {job.get('state')}  {job.get('items_done', 0)}/"
                           f"{job.get('items_total', 0)} done  pool {job.get('pool')}  "
                           f"tags {tags}")
                continue
            what = BULK_WORDS.get(r.get("answer"), str(r.get("answer")))
            state = f" ({r['state']})" if r.get("state") else ""
            why = f": {r['error']}" if r.get("error") else ""
            click.echo(f"{r.get('id')}: {what}{state}{why}")
        summary = ", ".join(f"{n} {BULK_WORDS.get(a, a)}" for a, n in counts.items())
        click.echo(f"{action}{' (dry run)' if dry_run else ''}: "
                   f"{summary or 'no job matched'}", err=True)
    found = len(results) - counts.get("no_such_job", 0)
    if found == 0:
        ctx.exit(3)
    if counts.get("no_such_job") or counts.get("refused"):
        ctx.exit(1)



@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--at", "ats", envvar="MESHJOBS_AT", multiple=True, default=(DEFAULT_AT,),
              show_default=True,
              help="URL of any meshd (env MESHJOBS_AT). Repeat it, or separate URLs with commas, "
                   "to name several: every command asks the next, in order, when one cannot "
                   "answer (down, restarting, no leader).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("--token-file", metavar="FILE",
              help="Read the token from FILE's first line (else env MESHJOBS_TOKEN).")
@click.option("--cacert", envvar="MESHJOBS_CACERT", metavar="FILE",
              help="Trust this CA or self-signed certificate for https:// (env MESHJOBS_CACERT).")
@click.version_option(meshjobs.version(), prog_name="meshctl")
@click.pass_context
def cli(ctx: click.Context, ats: tuple[str, ...], as_json: bool, token_file: str | None,
        cacert: str | None) -> None:
    """Drive a meshjobs fleet through any of its members."""
    urls = _urls(ats)
    https = any(urllib.parse.urlsplit(u).scheme == "https" for u in urls)
    # "at" is the member every command talks to; "ats" all of them, in the order given.
    ctx.obj = {"at": urls[0], "ats": urls, "json": as_json, "key": uuid.uuid4().hex,
               "token": _read_token(token_file),
               "tls": _tls(cacert) if https else None}


def _urls(ats: tuple[str, ...]) -> list[str]:
    """The member URLs of --at (repeated, or comma-separated), each checked."""
    urls = [u.strip() for a in ats for u in a.split(",") if u.strip()]
    if not urls:
        raise click.BadParameter("give the URL of a meshd", param_hint="--at")
    for at in urls:
        parsed = urllib.parse.urlsplit(at)
        if parsed.scheme not in ("http", "https") or not parsed.netloc:
            raise click.BadParameter(f"{at!r} is not an http:// or https:// URL", param_hint="--at")
    return urls


@cli.group()
def job() -> None:
    """Submit and follow one job."""


def _parse_env(values: tuple[str, ...]) -> dict[str, str]:
    env = {}
    for kv in values:
        name, sep, value = kv.partition("=")
        if not sep or not name:
            raise click.BadParameter(f"{kv!r} is not NAME=VALUE", param_hint="--env")
        env[name] = value
    return env


def _items_from(path: str) -> tuple[list[Any], list[str] | None]:
    """Item payloads from a directory (one per regular file) or a file (one per line), and for
    a directory the files' names in item order: the job keeps them, so that `job results --out`
    names its files after them (None when a name is one meshd would refuse: numbered then)."""
    if path == "-":
        raw = sys.stdin.buffer.read()
        return _lines(raw, "standard input"), None
    p = Path(path)
    if p.is_dir():
        files = sorted((f for f in p.iterdir() if f.is_file()), key=lambda f: f.name)
        if not files:
            raise click.BadParameter(f"{path} has no regular files", param_hint="--items-from")
        names: list[str] | None = [f.name for f in files]
        if any(len(n) > limits.item_name_chars_max or not _utf8(n)
               or any(ord(c) < 0x20 or ord(c) == 0x7F for c in n) for n in names or []):
            names = None
        return [{"b64": base64.b64encode(f.read_bytes()).decode()} for f in files], names
    try:
        raw = p.read_bytes()
    except OSError as e:
        raise click.BadParameter(f"cannot read {path}: {e.strerror or e}",
                                 param_hint="--items-from") from None
    return _lines(raw, path), None


def _utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _lines(raw: bytes, where: str) -> list[Any]:
    if not raw:
        raise click.BadParameter(f"{where} is empty", param_hint="--items-from")
    lines = raw.split(b"\n")
    if lines[-1] == b"":
        lines.pop()  # The newline ending the last line does not start another item.
    items: list[Any] = []
    for line in lines:
        try:
            items.append(line.decode("utf-8"))
        except UnicodeDecodeError:
            items.append({"b64": base64.b64encode(line).decode()})
    return items


@job.command("submit", context_settings={"allow_interspersed_args": False})
@click.option("--id", "job_id", help="The job id (made up by meshd when absent).")
@click.option("--pool", help="The pool to run in (default: default); POOL@MEMBER also names "
                            "the member(s), as --member does.")
@click.option("--items-from", "items_from", metavar="PATH",
              help="A directory (one item per file) or a file (one item per line; - for stdin).")
@click.option("--retries", type=click.IntRange(0, limits.retries_max), help="Re-runs of a failing item.")
@click.option("--runtime", type=click.FloatRange(0, limits.runtime_s_max, min_open=True),
              metavar="S", help="Runtime limit of one item, in seconds.")
@click.option("--priority", type=click.IntRange(-limits.priority_abs_max, limits.priority_abs_max))
@click.option("--tag", "tags", multiple=True, help="A tag (repeatable).")
@click.option("--hold", is_flag=True, help="Submit on hold (run nothing until released).")
@click.option("--max-leases", type=click.IntRange(1, limits.max_leases_max),
              help="At most N items of the job at once.")
@click.option("--env", "env", multiple=True, metavar="K=V", help="An environment variable (repeatable).")
@click.option("--cwd", metavar="DIR",
              help="Working directory of the items, absolute (default: the folder meshctl "
                   "runs in).")
@click.option("--no-cwd", "no_cwd", is_flag=True,
              help="Run in the member's own folder, not the one meshctl runs in.")
@click.option("--user", metavar="NAME|UID[:GID]",
              help="Run the items as this user (the member must run as root).")
@click.option("--inherit-env", "inherit_env", is_flag=True,
              help="Give items meshd's whole environment (less its token), not the minimal "
                   "one; admins only (see docs/security.md).")
@click.option("--notify", "notify", metavar="URL",
              help="POST the job's record (JSON) to this http(s) URL when it ends; retried, "
                   "with an Idempotency-Key header (job id and version) to tell repeats. "
                   "Public addresses only, unless the member's [notify] allow names it.")
@click.option("--after", "after", multiple=True, metavar="ID[:ok|end|fail]",
              help="Run only after job ID ended done (ok, the default), ended at all (end), or "
                   "failed, timed out or was cancelled (fail); repeatable (all must hold). "
                   "Until then the "
                   "job is waiting; if one can no longer hold it ends dep_failed.")
@click.option("--member", "member", metavar="NAME|GLOB|*",
              help="Run the items only on this member, or on members whose names match a "
                   "glob (gpu-*); * runs the job once on every member of the pool (fan-out, one "
                   "item each). With no such member alive the job waits, and says so.")
@click.option("--restart", "restart", metavar="N|forever",
              help="Run the whole job again each time it ends done, up to N times or forever "
                   "(a cancel stops it).")
@click.option("--restart-delay", "restart_delay", metavar="S",
              type=click.FloatRange(limits.restart_delay_s_min, limits.restart_delay_s_max),
              help="Wait S seconds before each automatic re-run (--restart, --resubmit).")
@click.option("--resubmit", "resubmit", type=click.IntRange(1, limits.resubmit_max), metavar="N",
              help="Run the whole job again when it ends done or failed (placed afresh), up "
                   "to N times; --retries re-runs single failing items instead.")
@click.option("--stdout", "stdout_path", metavar="PATH",
              help="Also write each item's stdout to PATH on the member that runs it (relative "
                   "to --cwd; {index} is the item's index).")
@click.option("--stderr", "stderr_path", metavar="PATH",
              help="Also write each item's stderr to PATH (as --stdout).")
@json_option
@click.argument("argv", nargs=-1, required=True, type=click.UNPROCESSED)
@click.pass_context
def job_submit(ctx: click.Context, job_id: str | None, pool: str | None, items_from: str | None,
               retries: int | None, runtime: float | None, priority: int | None,
               tags: tuple[str, ...], hold: bool, max_leases: int | None, env: tuple[str, ...],
               cwd: str | None, no_cwd: bool, user: str | None, inherit_env: bool,
               after: tuple[str, ...], member: str | None, as_json: bool,
               argv: tuple[str, ...], notify: str | None = None,
               restart: str | None = None, restart_delay: float | None = None,
               resubmit: int | None = None, stdout_path: str | None = None,
               stderr_path: str | None = None) -> None:
    """Submit a job: meshctl job submit [OPTIONS] -- PROGRAM [ARGS]...; prints its id.

    Items run in the folder meshctl runs in (as qsub does), unless --cwd names another or
    --no-cwd keeps the member's own."""
    spec: dict[str, Any] = {"argv": list(argv)}
    optional = {"id": job_id, "pool": pool, "retries": retries, "priority": priority,
                "max_leases": max_leases, "cwd": _submit_cwd(cwd, no_cwd), "user": user}
    spec.update({k: v for k, v in optional.items() if v is not None})
    if runtime is not None:
        spec["runtime_s"] = runtime
    if tags:
        spec["tags"] = list(tags)
    if hold:
        spec["hold"] = True
    if inherit_env:
        spec["inherit_env"] = True
    if env:
        spec["env"] = _parse_env(env)
    if after:
        spec["after"] = list(after)  # meshd checks each (control.parse_after)
    if member is not None:
        spec["member"] = member  # meshd checks it (placement.parse_member)
    if notify is not None:
        spec["notify"] = notify  # meshd checks it (fleetctl.parse_notify)
    spec.update(_rerun_spec(restart, restart_delay, resubmit, stdout_path, stderr_path))
    if items_from is not None:
        spec["items"], names = _items_from(items_from)
        if names is not None:
            spec["names"] = names
    sink = ctx.meta.get(SPEC_SINK)
    if sink is not None:  # `cron add`: the spec a submit with these options would send
        sink.append(spec)
        return
    client = _client(ctx)
    record = client.json("POST", "/jobs", spec)
    if _wants_json(ctx, as_json):
        _print_json(record)
    else:
        click.echo(record["id"])
    if after:
        _say_dep_failed(client, record, after)


# What each --after condition needs of its parent's end state (control.parse_after).
AFTER_HOLDS = {"ok": ("done",), "end": ("done", "failed", "cancelled", "dep_failed"),
               "fail": ("failed", "cancelled", "dep_failed")}


def _say_dep_failed(client: Client, record: dict, after: tuple[str, ...]) -> None:
    """On stderr, when an --after names a parent that already ended so that it can never
    hold: the new job ends dep_failed at once (meshd accepts it, as the parent may be
    run again by hand; the person who typed it should know)."""
    for dep in after:
        parent, sep, cond = dep.rpartition(":")
        if not sep:
            parent, cond = dep, "ok"
        if cond not in AFTER_HOLDS:
            continue  # meshd took it, so it is of a form this meshctl does not know
        try:
            rec = client.json("GET", f"/jobs/{_q(parent)}")
        except Failure:
            continue
        state = rec.get("state")
        if state in TERMINAL and state not in AFTER_HOLDS[cond]:
            click.echo(f"meshctl: job {parent} already ended {state}, so --after {dep} can "
                       f"never hold: job {record.get('id')} ends dep_failed at once (submit "
                       f"again after meshctl job rerun {parent}, or drop --after)", err=True)


def _submit_cwd(cwd: str | None, no_cwd: bool) -> str | None:
    """The working directory a submit names: --cwd (absolute: it names a folder of the member
    that runs the items, which meshd checks), else the folder meshctl runs in; None with
    --no-cwd (the member's own folder)."""
    if no_cwd:
        if cwd is not None:
            raise click.UsageError("give --cwd DIR or --no-cwd, not both")
        return None
    if cwd is not None:
        return cwd
    try:
        return os.getcwd()
    except OSError as e:  # the folder was deleted under us
        raise click.UsageError(f"the current folder cannot be read ({e.strerror or e}): give "
                               "--cwd DIR, or --no-cwd to run in the member's own folder") from None


def _when(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = value / 1000 if value > 1e11 else value
        try:
            return dt.datetime.fromtimestamp(seconds).astimezone().strftime("%Y-%m-%d %H:%M:%S %Z")
        except (OverflowError, OSError, ValueError):
            pass
    return str(value)


FAILED_ITEM_STATES = ("failed", "timeout")


def _item_reason(item: dict, record: dict) -> str:
    """Why an item failed, in words: the spawn error, the timeout, the signal or the exit code."""
    if item.get("error"):
        return str(item["error"])
    if item.get("state") == "timeout":
        limit = record.get("runtime_s")
        return ("timeout: killed after its runtime limit" +
                (f" of {limit:g} s" if isinstance(limit, (int, float)) else ""))
    if item.get("signal"):
        return f"killed by signal {item['signal']}"
    if item.get("rc") is not None:
        return f"exit {item['rc']}"
    return "failed with no exit code (it did not run, or its member lost it)"


def _stderr_tail(client: Client, digest: Any) -> tuple[list[str], str | None]:
    """The last lines of a stderr blob, and a note when they could not be read."""
    if not isinstance(digest, str):
        return [], None
    try:
        with client.open("GET", f"/blobs/{digest}") as resp:
            length = resp.headers.get("Content-Length")
            if length is not None and length.isdigit() and int(length) > limits.status_stderr_read_bytes_max:
                return [], f"stderr is {length} bytes: see meshctl job results ID --stderr --out DIR"
            tail = b""
            while True:
                chunk = resp.read(COPY_CHUNK_BYTES)
                if not chunk:
                    break
                tail = (tail + chunk)[-limits.status_stderr_bytes_max:]
    except Failure as e:
        return [], f"stderr not readable here: {e.message}"
    except (OSError, http.client.HTTPException) as e:
        return [], f"stderr not readable here: {type(e).__name__}"
    lines = tail.decode("utf-8", "replace").rstrip("\n").split("\n")
    lines = [line.rstrip("\r") for line in lines if line.strip()]
    return lines[-limits.status_stderr_lines_max:], None


def _explain(client: Client, record: dict) -> list[dict]:
    """Each failed or timed-out item (up to status_items_shown_max): why, where, its stderr."""
    shown = []
    for item in sorted(record.get("items") or [], key=lambda it: it.get("index", 0)):
        if item.get("state") not in FAILED_ITEM_STATES:
            continue
        if len(shown) == limits.status_items_shown_max:
            break
        tail, note = _stderr_tail(client, item.get("stderr"))
        shown.append({
            "index": item.get("index"), "state": item.get("state"), "rc": item.get("rc"),
            "signal": item.get("signal"), "error": item.get("error"),
            "reason": _item_reason(item, record), "attempts": item.get("attempts"),
            "member": item.get("member"), "stderr_tail": tail, "stderr_note": note,
        })
    return shown


def _shell_words(argv: Any) -> str:
    if not isinstance(argv, list):
        return str(argv)
    return shlex.join(str(a) for a in argv)


@job.command("status")
@click.argument("job_ids", metavar="[ID]...", nargs=-1)
@_filter_options
@json_option
@click.pass_context
def job_status(ctx: click.Context, job_ids: tuple[str, ...], tag: str | None, state: str | None,
               pool: str | None, member: str | None, as_json: bool) -> None:
    """A job's state, program and counts, and why each failed item failed (--json: the record
    with its items, and `failed_items` explained). Several ids, or --tag/--state/--pool/--member:
    one line per job (exit 3 when none is found, 1 when some are not)."""
    if len(job_ids) != 1 or any(v is not None for v in (tag, state, pool, member)):
        _bulk(ctx, "status", job_ids, _filter(tag, state, pool, member), False, None, as_json)
        return
    job_id = job_ids[0]
    want_json = _wants_json(ctx, as_json)
    client = _client(ctx)
    # Items are fetched when they are shown or explain something: a healthy big job's text
    # status stays one small answer.
    record = client.json("GET", f"/jobs/{_q(job_id)}" + ("?items=1" if want_json else ""))
    if not want_json and (record.get("items_failed") or record.get("items_running")
                          or record.get("items_tried_before")):
        record = client.json("GET", f"/jobs/{_q(job_id)}?items=1")
    failed = _explain(client, record)
    if want_json:
        _print_json({**record, "failed_items": failed})
        return
    tags = ", ".join(record.get("tags") or []) or "-"
    hold = " (on hold)" if record.get("hold") and record.get("state") != "held" else ""
    items = record.get("items") or []
    timed_out = sum(1 for it in items if it.get("state") == "timeout")
    counts = (f"{record.get('items_done', 0)} done, {record.get('items_failed', 0)} failed"
              + (f" ({timed_out} timed out)" if timed_out else "")
              + (f", {record.get('items_running', 0)} running" if record.get("items_running") else "")
              + (f", {record.get('items_pending', 0)} pending" if record.get("items_pending") else "")
              + (f", {record.get('items_cancelled', 0)} cancelled"
                 if record.get("items_cancelled") else "")
              + f", {record.get('items_total', 0)} total")
    rows = [
        ("job", record.get("id")),
        ("state", f"{record.get('state')}{hold}"),
        ("argv", _shell_words(record.get("argv"))),
        ("items", counts),
        ("pool", record.get("pool")),
        ("submitter", record.get("submitted_by") or "-"),
        ("user", record.get("user") or "- (the pool's user, else the member's item user)"),
        ("cwd", record.get("cwd") or "- (the member's own folder)"),
        *([("env", "meshd's whole environment (--inherit-env)")]
          if record.get("inherit_env") else []),
        ("priority", record.get("priority")),
        ("tags", tags),
        ("submitted", _when(record.get("submitted_at"))),
        ("finished", _when(record.get("finished_at"))),
    ]
    rows += _dep_rows(record)
    rows += _placement_rows(record)
    rows += _waiting_rows(record)
    rows += _rerun_rows(record)
    rows += [(k, record[k]) for k in ("stdout", "stderr", "notify") if record.get(k)]
    for name, value in rows:
        click.echo(f"{name:<10} {value}")
    names = record.get("names") if isinstance(record.get("names"), list) else None
    for f in failed:
        i = f["index"]
        label = f"item {i}" + (f" ({names[i]})" if names and isinstance(i, int)
                               and 0 <= i < len(names) else "")
        click.echo(f"{label}: {f['reason']}; attempts {f['attempts']}, "
                   f"member {f['member'] or '-'}")
        if f["stderr_tail"]:
            click.echo("  stderr (last lines):")
            for line in f["stderr_tail"]:
                click.echo(f"    {line[:limits.status_stderr_bytes_max]}")
        elif f["stderr_note"]:
            click.echo(f"  ({f['stderr_note']})")
    more = sum(1 for it in items if it.get("state") in FAILED_ITEM_STATES) - len(failed)
    if more > 0:
        click.echo(f"... and {more} more failed item(s): meshctl --json job status {job_id}")
    _show_running(job_id, items)
    _show_earlier_attempts(job_id, items, names)


def _placement_rows(record: dict) -> list[tuple[str, str]]:
    """Where a placed job's items go, which item is whose on a fan-out, and why they wait."""
    selector = record.get("member")
    if not isinstance(selector, str):
        return []
    rows = [("member", selector + (" (fan-out: once on each member)" if selector == "*" else ""))]
    fan = placement.fanout_rows(record)
    if fan:
        shown = fan[:limits.status_items_shown_max]
        rows.append(("members", ", ".join(f"{i}:{m}" for i, m in shown)
                     + (f" and {len(fan) - len(shown)} more" if len(fan) > len(shown) else "")))
    return rows


def _waiting_rows(record: dict) -> list[tuple[str, str]]:
    """Why its pending items wait (`waiting_reasons`, meshjobs/waits.py), one reason a row."""
    says = [str(r.get("says")) for r in record.get("waiting_reasons") or [] if isinstance(r, dict)]
    if not says and record.get("waiting_for"):
        says = [str(record["waiting_for"])]
    return [("waiting" if k == 0 else "", w) for k, w in enumerate(says)]


DEP_WORDS = {"ok": "ends done", "end": "ends", "fail": "fails or is cancelled"}


def _dep_rows(record: dict) -> list[tuple[str, str]]:
    """What a job with parents waits for (or waited for), in words."""
    after = record.get("after")
    if not isinstance(after, list) or not after:
        return []
    waiting = [d for d in record.get("waiting_on") or [] if isinstance(d, dict)]
    rows = [("after", ", ".join(f"{d.get('id')}:{d.get('on')}" for d in after
                                if isinstance(d, dict)))]
    if waiting:
        rows.append(("waits for", "; ".join(
            f"job {d.get('id')} until it {DEP_WORDS.get(str(d.get('on')), d.get('on'))}"
            for d in waiting)))
    elif record.get("state") == "dep_failed":
        rows.append(("why", "a job it waited for ended in a way that can never satisfy its "
                            "condition: nothing of it ran (see the parents' status)"))
    return rows


def _show_running(job_id: str, items: list) -> None:
    """Each running item (up to status_items_shown_max): where, since when, and how to see its
    output as it is written."""
    running = sorted((it for it in items if isinstance(it, dict) and it.get("state") == "leased"),
                     key=lambda it: it.get("index", 0))
    for item in running[: limits.status_items_shown_max]:
        started = item.get("started_at")
        since = ""
        if isinstance(started, int | float):
            since = f" since {_when(started)} ({max(0.0, time.time() - started):.0f} s)"
        click.echo(f"item {item.get('index')}: running on {item.get('member') or '-'}{since}, "
                   f"attempt {item.get('attempts')}; its output: meshctl job logs {job_id} "
                   f"--item {item.get('index')} -f")
    if len(running) > limits.status_items_shown_max:
        click.echo(f"... and {len(running) - limits.status_items_shown_max} more running "
                   f"item(s): meshctl --json job status {job_id}")


def _show_earlier_attempts(job_id: str, items: list, names: list | None) -> None:
    """Why each item's earlier attempts ended (a lease lost with its member, a failure tried
    again), up to status_items_shown_max items, oldest attempt first."""
    tried = sorted((it for it in items if isinstance(it, dict) and it.get("earlier_attempts")),
                   key=lambda it: it.get("index", 0))
    for item in tried[: limits.status_items_shown_max]:
        i = item.get("index")
        label = f"item {i}" + (f" ({names[i]})" if names and isinstance(i, int)
                               and 0 <= i < len(names) else "")
        for t in item["earlier_attempts"]:
            if isinstance(t, dict):
                click.echo(f"{label}: attempt {t.get('attempt')}: {t.get('why')}")
    if len(tried) > limits.status_items_shown_max:
        click.echo(f"... and {len(tried) - limits.status_items_shown_max} more item(s) tried "
                   f"before: meshctl --json job status {job_id}")


def _unescape(sep: str) -> bytes:
    """--sep with backslash escapes (\\n, \\t, \\0, \\\\), as bytes."""
    out = bytearray()
    it = iter(sep)
    for c in it:
        if c != "\\":
            out += c.encode("utf-8", "surrogateescape")
            continue
        nxt = next(it, None)
        esc = {"n": b"\n", "t": b"\t", "0": b"\0", "r": b"\r", "\\": b"\\"}.get(nxt or "")
        if esc is None:
            raise click.BadParameter(f"unknown escape \\{nxt or ''} (use \\n, \\t, \\r, \\0 "
                                     "or \\\\)", param_hint="--sep")
        out += esc
    if len(out) > limits.results_sep_bytes_max:
        raise click.BadParameter(f"at most {limits.results_sep_bytes_max} bytes",
                                 param_hint="--sep")
    return bytes(out)


def _file_name(index: Any, names: list | None) -> str:
    """An item's file under --out: its input file's name when the job has names, else its
    index. A name is a plain file name (meshd checks it), and is checked again here."""
    if (names is not None and isinstance(index, int) and 0 <= index < len(names)
            and isinstance(names[index], str) and names[index] not in ("", ".", "..")
            and "/" not in names[index] and "\0" not in names[index]):
        return names[index]
    return str(index)


def _shortfall(job_id: str, record: dict) -> tuple[int, str | None]:
    """The exit code of `job results` for a job record, and what to say on stderr."""
    state = record.get("state")
    items = sorted(record.get("items") or [], key=lambda it: it.get("index", 0))
    failed = [it.get("index") for it in items if it.get("state") in FAILED_ITEM_STATES]
    missing = [it.get("index") for it in items if it.get("state") not in ("done", *FAILED_ITEM_STATES)]

    def listed(indexes: list) -> str:
        shown = ", ".join(str(i) for i in indexes[: limits.status_items_shown_max])
        return shown + (f" and {len(indexes) - limits.status_items_shown_max} more"
                        if len(indexes) > limits.status_items_shown_max else "")

    parts = []
    if failed:
        parts.append(f"item(s) {listed(failed)} failed (why: meshctl job status {job_id})")
    if missing:
        parts.append(f"item(s) {listed(missing)} have no output"
                     + (" yet" if state not in TERMINAL else ""))
    if state in TERMINAL and state != "done":
        code, head = 1, f"job {job_id} {state}"
    elif state not in TERMINAL:
        code, head = 5, (f"job {job_id} is {state}, not finished: this is what exists so far "
                         f"(meshctl job wait {job_id}, then ask again)")
    else:
        return 0, None
    return code, head + ("; " + "; ".join(parts) if parts else "")


@job.command("results")
@click.argument("job_id", metavar="ID")
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path),
              help="Write DIR/<name>.out per finished item (name: the input file's, or the "
                   "index) instead of standard output.")
@click.option("--stderr", "with_stderr", is_flag=True,
              help="Also the items' stderr: DIR/<name>.err with --out, else to standard error.")
@click.option("--sep", metavar="STR",
              help="Write STR between items' outputs (escapes: \\n \\t \\r \\0 \\\\).")
@click.option("--json-lines", "json_lines", is_flag=True,
              help="One JSON object per item: index, state, rc, stdout (text) or stdout_b64.")
@click.option("--only-done", "only_done", is_flag=True,
              help="Leave out the output of items that failed or timed out.")
@json_option
@click.pass_context
def job_results(ctx: click.Context, job_id: str, out_dir: Path | None, with_stderr: bool,
                sep: str | None, json_lines: bool, as_json: bool, only_done: bool = False) -> None:
    """Every finished item's stdout in item order, to standard output or files under --out.

    On a terminal, a failed item's output follows a line `--- item N (NAME): failed, WHY ---`;
    piped, the bytes are the items' own, unmarked. --only-done leaves failed items out.
    Exits 1 when the job failed, was cancelled or ended dep_failed, 5 when it has not finished (what exists is
    printed all the same); stderr names the items that failed or have no output."""
    client = _client(ctx)
    want_json = _wants_json(ctx, as_json)
    chosen = [n for n, v in (("--out", out_dir is not None), ("--sep", sep is not None),
                             ("--json-lines", json_lines)) if v]
    if len(chosen) > 1:
        raise click.UsageError(f"{' and '.join(chosen)} do not go together: choose one")
    sep_bytes = None if sep is None else _unescape(sep)
    # The record is read before any output: what it says finished is in what follows.
    record = client.json("GET", f"/jobs/{_q(job_id)}?items=1")
    items = sorted(record.get("items") or [], key=lambda it: it.get("index", 0))
    code, why = _shortfall(job_id, record)
    if only_done:
        items = [it for it in items if it.get("state") == "done"]
    finished = [it for it in items if it.get("state") in ("done", *FAILED_ITEM_STATES)]
    marked = (out_dir is None and not want_json and sep_bytes is None and not json_lines
              and sys.stdout.isatty())
    if sep_bytes is not None or json_lines:
        _separated(client, items, sep_bytes, with_stderr)
    elif marked or (only_done and out_dir is None and not want_json):
        _marked(client, record, items, with_stderr, marked)
    elif out_dir is None and not want_json:
        for stream, out in (("stdout", "stdout"), ("stderr", "stderr"))[: 2 if with_stderr else 1]:
            sink = _binary(out)
            try:
                with client.open("GET", f"/jobs/{_q(job_id)}/results?stream={stream}") as resp:
                    client.copy(resp, sink)
            except Cut as cut:
                raise _why_cut(client, job_id, stream) or cut from None
            sink.flush()
    elif out_dir is None:
        _print_json([{k: it.get(k) for k in ("index", "state", "rc", "stdout", "stderr")}
                     for it in items])
    else:
        try:
            out_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise Failure(f"cannot make {out_dir}: {e.strerror or e}", 2) from None
        names = record.get("names") if isinstance(record.get("names"), list) else None
        written = []
        for it in finished:
            entry: dict[str, Any] = {"index": it.get("index")}
            base = _file_name(it.get("index"), names)
            for stream, suffix in (("stdout", "out"), ("stderr", "err"))[: 2 if with_stderr else 1]:
                if it.get(stream) is None:
                    continue  # No output to write (the item never ran): no empty file.
                path = out_dir / f"{base}.{suffix}"
                _fetch_blob(client, it.get(stream), path, it.get("index"))
                entry[stream] = str(path)
            written.append(entry)
        if want_json:
            _print_json(written)
    if why is not None:
        click.echo(f"meshctl: {why}", err=True)
    ctx.exit(code)


def _marked(client: Client, record: dict, items: list[dict], with_stderr: bool,
            marked: bool) -> None:
    """Items' outputs one by one, in item order; with `marked`, a failed item's output
    follows a line that says which item failed and why (on a terminal, where a person reads
    it; a pipe gets the items' bytes as they are)."""
    out = _binary("stdout")
    err = _binary("stderr")
    names = record.get("names") if isinstance(record.get("names"), list) else None
    for it in items:
        if it.get("state") not in ("done", *FAILED_ITEM_STATES):
            continue
        if marked and it.get("state") in FAILED_ITEM_STATES:
            i = it.get("index")
            label = f"item {i}" + (f" ({names[i]})" if names and isinstance(i, int)
                                   and 0 <= i < len(names) else "")
            out.write(f"--- {label}: failed, {_item_reason(it, record)} ---\n".encode())
        _copy_blob(client, it.get("stdout"), out, it.get("index"))
        out.flush()
        if with_stderr:
            _copy_blob(client, it.get("stderr"), err, it.get("index"))
            err.flush()


def _separated(client: Client, items: list[dict], sep: bytes | None, with_stderr: bool) -> None:
    """Items' outputs one by one: separated by `sep`, or as JSON lines (sep None)."""
    sink = _binary("stdout")
    first = True
    for it in items:
        if sep is not None:
            if it.get("state") not in ("done", *FAILED_ITEM_STATES):
                continue
            if not first:
                sink.write(sep)
            first = False
            _copy_blob(client, it.get("stdout"), sink, it.get("index"))
            continue
        line: dict[str, Any] = {"index": it.get("index"), "state": it.get("state"),
                                "rc": it.get("rc")}
        if it.get("signal"):
            line["signal"] = it.get("signal")
        if it.get("error"):
            line["error"] = it.get("error")
        for stream in ("stdout", "stderr")[: 2 if with_stderr else 1]:
            buf = io.BytesIO()
            _copy_blob(client, it.get(stream), buf, it.get("index"))
            raw = buf.getvalue() if it.get(stream) is not None else None
            if raw is None:
                line[stream] = None
            else:
                try:
                    line[stream] = raw.decode("utf-8")
                except UnicodeDecodeError:
                    line[stream + "_b64"] = base64.b64encode(raw).decode()
        sink.write(json.dumps(line, sort_keys=True).encode() + b"\n")
    sink.flush()


def _copy_blob(client: Client, digest: Any, out: IO[bytes], index: Any) -> None:
    """Copy one item's blob to `out`, checked against its digest (nothing when it has none)."""
    if not isinstance(digest, str):
        return
    try:
        with client.open("GET", f"/blobs/{digest}") as resp:
            client.copy(resp, out, digest)
    except Cut as cut:
        raise _why_blob_cut(client, digest, index) or cut from None
    except Failure as e:
        if e.exit_code == 3:
            raise Failure(f"item {index}: blob {digest} is not on meshd at {client.at} yet; "
                          "try again or pass --at another member", 4) from None
        raise


def _why_cut(client: Client, job_id: str, stream: str) -> Failure | None:
    """After a results transfer was cut: whether an item's blob is damaged on the member (it
    says so when asked to check, and repairs it from another member's copy when it can)."""
    try:
        record = client.json("GET", f"/jobs/{_q(job_id)}?items=1")
    except Failure:
        return None
    items = sorted(record.get("items") or [], key=lambda it: it.get("index", 0))
    for it in items:
        digest = it.get(stream)
        if isinstance(digest, str):
            why = _why_blob_cut(client, digest, it.get("index"), stream)
            if why is not None:
                return why
    return None


def _why_blob_cut(client: Client, digest: str, index: Any, stream: str = "output") -> Failure | None:
    """Ask the member to check one blob: a Failure that says it is damaged (or was, and has
    been repaired), or None when it is good (the connection was what failed)."""
    try:
        state = client.json("GET", f"/blobs/{digest}?check=1")
    except Failure:
        return None
    if state.get("repaired"):
        return Failure(f"the {stream} of item {index} (blob {digest}) was damaged on meshd at "
                       f"{client.at} and has been replaced by a good copy from another member: "
                       "run the command again", 1)
    if state.get("state") == "damaged":
        return Failure(f"the {stream} of item {index} (blob {digest}) is damaged on meshd at "
                       f"{client.at}, and no other member had a good copy; see the member's log, "
                       "or try another member (--at)", 1)
    return None


def _fetch_blob(client: Client, digest: str | None, path: Path, index: Any) -> None:
    """Write a blob to a file (empty when the item has none), whole or not at all."""
    tmp = path.with_name(path.name + ".part")
    try:
        with open(tmp, "wb") as f:
            _copy_blob(client, digest, f, index)
        os.replace(tmp, path)
    except OSError as e:
        raise Failure(f"cannot write {path}: {e.strerror or e}", 2) from None
    finally:
        tmp.unlink(missing_ok=True)


@job.command("wait")
@click.argument("job_id", metavar="ID")
@click.option("--timeout", type=click.FloatRange(0, min_open=False), metavar="S",
              help="Give up after S seconds (exit 5: not finished yet).")
@json_option
@click.pass_context
def job_wait(ctx: click.Context, job_id: str, timeout: float | None, as_json: bool) -> None:
    """Wait until a job ends: exit 0 when done, 1 when failed, cancelled or dep_failed, 5 when
    the --timeout passed first (the job has not finished yet).

    Each answer comes at the job's next change (an item started or ended), so the progress
    line on a terminal is current. A member that cannot answer (down, restarting, no leader)
    is asked again with backoff, and the next --at is tried, until the --timeout (or, without
    one, for up to cli_wait_retry_s_max seconds in a row). A job that ends failed: stderr
    says why each failed item failed (timed out, raised, exit N)."""
    client = _client(ctx)
    deadline = None if timeout is None else time.monotonic() + timeout
    progress = sys.stderr.isatty() and not _wants_json(ctx, as_json)
    shown = _Progress(job_id, progress)
    client.on_retry = shown.retrying
    wait = 0.0
    since: int | None = None
    while True:
        path = f"/jobs/{_q(job_id)}?wait={wait:g}"
        if since is not None:
            path += f"&since={since}"
        try:
            # Members that cannot answer are asked in turn, with backoff, until the --timeout
            # (or, without one, for up to cli_wait_retry_s_max seconds in a row).
            record = client.json("GET", path, timeout=wait + TIMEOUT_S,
                                 retry_s=limits.cli_wait_retry_s_max if deadline is None
                                 else max(0.0, deadline - time.monotonic()),
                                 deadline=deadline)
        except Failure:
            shown.end()
            raise
        state = record.get("state")
        version = record.get("version")
        if type(version) is int and version >= 0:
            since = version  # servers without versions: no since, the wait lasts to the end
        shown.show(record)
        if state in TERMINAL:
            break
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            shown.end()
            raise Failure(f"job {job_id} has not finished yet: still {state} after --timeout "
                          f"{timeout:g} s (wait again, or see `meshctl job status {job_id}`)", 5)
        wait = float(WAIT_POLL_S) if left is None else max(0.0, min(float(WAIT_POLL_S), left))
    shown.end()
    if _wants_json(ctx, as_json):
        _print_json(record)
    else:
        if not progress:
            click.echo(f"{job_id}: {state}")
        if state != "done":
            _say_failed_items(client, job_id, record)
    ctx.exit(0 if state == "done" else 1)


def _say_failed_items(client: Client, job_id: str, record: dict) -> None:
    """On stderr, why each failed item failed (timed out, raised, exit N), as `job status`
    says it, so that a wait that ends failed does not only give counts."""
    if not record.get("items_failed"):
        return
    try:
        record = client.json("GET", f"/jobs/{_q(job_id)}?items=1")
    except Failure:
        return  # the end state is said; the reasons are in `job status`
    names = record.get("names") if isinstance(record.get("names"), list) else None
    failed = [it for it in sorted(record.get("items") or [], key=lambda it: it.get("index", 0))
              if it.get("state") in FAILED_ITEM_STATES]
    for it in failed[: limits.status_items_shown_max]:
        i = it.get("index")
        label = f"item {i}" + (f" ({names[i]})" if names and isinstance(i, int)
                               and 0 <= i < len(names) else "")
        click.echo(f"{label}: {_item_reason(it, record)}", err=True)
    if len(failed) > limits.status_items_shown_max:
        click.echo(f"... and {len(failed) - limits.status_items_shown_max} more failed item(s): "
                   f"meshctl job status {job_id}", err=True)


class _Progress:
    """The one progress line of `job wait` on a terminal, rewritten in place; ended (a newline)
    before anything else is printed, so that an error never shares its line."""

    def __init__(self, job_id: str, on: bool) -> None:
        self.job_id = job_id
        self.on = on
        self.open = False
        self.last = ""

    def _put(self, text: str) -> None:
        if self.on:
            click.echo(f"\r{text}\x1b[K", nl=False, err=True)
            self.open = True

    def show(self, record: dict) -> None:
        done, total = record.get("items_done", 0), record.get("items_total", 0)
        text = f"{self.job_id}: {record.get('state')} {done}/{total}"
        running, failed = record.get("items_running"), record.get("items_failed")
        if record.get("state") == "running" and running is not None:
            text += f" done, {running} running"
        if failed:
            text += f", {failed} failed"
        self.last = text
        self._put(text)

    def retrying(self, at: str) -> None:
        self._put(f"{self.last or self.job_id} (member not answering; asking {at})")

    def end(self) -> None:
        if self.open:
            click.echo("", err=True)
            self.open = False


def _change(ctx: click.Context, method: str, path: str, body: Any, as_json: bool) -> None:
    record = _client(ctx).json(method, path, body)
    if _wants_json(ctx, as_json):
        _print_json(record)
    else:
        click.echo(f"{record.get('id')}: {record.get('state')}")


@job.command("cancel")
@click.argument("job_ids", metavar="[ID]...", nargs=-1)
@_filter_options
@_dry_run_option
@json_option
@click.pass_context
def job_cancel(ctx: click.Context, job_ids: tuple[str, ...], tag: str | None, state: str | None,
               pool: str | None, member: str | None, dry_run: bool, as_json: bool) -> None:
    """Cancel jobs: pending items never run, running ones are cut. Several ids, or
    --tag/--state/--pool/--member, cancel many at once (--dry-run: show, change nothing)."""
    flt = _filter(tag, state, pool, member)
    if len(job_ids) != 1 or flt or dry_run:
        _bulk(ctx, "cancel", job_ids, flt, dry_run, None, as_json)
        return
    _change(ctx, "POST", f"/jobs/{_q(job_ids[0])}/cancel", None, as_json)


@job.command("forget")
@click.argument("job_ids", metavar="[ID]...", nargs=-1)
@_filter_options
@_dry_run_option
@json_option
@click.pass_context
def job_forget(ctx: click.Context, job_ids: tuple[str, ...], tag: str | None, state: str | None,
               pool: str | None, member: str | None, dry_run: bool, as_json: bool) -> None:
    """Forget finished or cancelled jobs for good. Several ids, or --tag/--state/--pool/--member,
    forget many at once (--dry-run: show, change nothing)."""
    flt = _filter(tag, state, pool, member)
    if len(job_ids) != 1 or flt or dry_run:
        _bulk(ctx, "forget", job_ids, flt, dry_run, None, as_json)
        return
    job_id = job_ids[0]
    answer = _client(ctx).json("DELETE", f"/jobs/{_q(job_id)}")
    if _wants_json(ctx, as_json):
        _print_json(answer)
    else:
        click.echo(f"{answer.get('id', job_id)}: forgotten")


def _max_leases(value: str | None) -> int | None | str:
    if value is None:
        return "unset"
    if value.lower() in ("none", "off", "unlimited"):
        return None
    try:
        n = int(value)
    except ValueError:
        raise click.BadParameter("give a number, or none for no limit",
                                 param_hint="--max-leases") from None
    if not 1 <= n <= limits.max_leases_max:
        raise click.BadParameter(f"must be 1 to {limits.max_leases_max}, or none",
                                 param_hint="--max-leases")
    return n


@job.command("tone")
@click.argument("job_ids", metavar="[ID]...", nargs=-1)
@click.option("--priority", type=click.IntRange(-limits.priority_abs_max, limits.priority_abs_max))
@click.option("--hold/--release", default=None, help="Put on hold, or release.")
@click.option("--max-leases", "max_leases", metavar="N|none", help="At most N items at once.")
@_filter_options
@_dry_run_option
@json_option
@click.pass_context
def job_tone(ctx: click.Context, job_ids: tuple[str, ...], priority: int | None,
             hold: bool | None, max_leases: str | None, tag: str | None, state: str | None,
             pool: str | None, member: str | None, dry_run: bool, as_json: bool) -> None:
    """Change a running job's priority, hold or most leases at once. Several ids, or
    --tag/--state/--pool/--member, change many at once (--dry-run: show, change nothing)."""
    body: dict[str, Any] = {}
    if priority is not None:
        body["priority"] = priority
    if hold is not None:
        body["hold"] = hold
    ml = _max_leases(max_leases)
    if ml != "unset":
        body["max_leases"] = ml
    if not body:
        raise click.UsageError("nothing to change: give --priority, --hold/--release or --max-leases")
    flt = _filter(tag, state, pool, member)
    if len(job_ids) != 1 or flt or dry_run:
        _bulk(ctx, "tone", job_ids, flt, dry_run, body, as_json)
        return
    _change(ctx, "POST", f"/jobs/{_q(job_ids[0])}/tone", body, as_json)


@job.command("logs")
@click.argument("job_id", metavar="ID")
@click.option("--item", "index", type=click.IntRange(0, limits.items_max - 1), default=0,
              show_default=True, metavar="N", help="The item whose output to show.")
@click.option("--stderr", "use_stderr", is_flag=True, help="Its stderr instead of its stdout.")
@click.option("-f", "--follow", is_flag=True,
              help="Keep printing what the item writes until it ends.")
@click.pass_context
def job_logs(ctx: click.Context, job_id: str, index: int, use_stderr: bool,
             follow: bool) -> None:
    """Print one item's output (stdout, or --stderr) as written so far, from any member, while
    it runs or after; with -f, go on until the item ends."""
    client = _client(ctx)
    stream = "stderr" if use_stderr else "stdout"
    path = f"/jobs/{_q(job_id)}/items/{index}/{stream}"
    sink = _binary("stdout")
    offset = 0
    run_epoch: str | None = None  # the run whose output is printed (its lease's epoch)
    cuts = 0  # streams cut in a row before a byte came
    while True:
        query = f"?offset={offset}" + ("&follow=1" if follow else "")
        # A follow waits up to log_start_wait_s_max for an item that has not started.
        timeout = TIMEOUT_S + (limits.log_start_wait_s_max if follow else 0)
        epoch = None
        try:
            with client.open("GET", path + query, timeout=timeout) as resp:
                epoch = resp.headers.get("X-Meshjobs-Item-Epoch")
                if run_epoch is None:
                    run_epoch = epoch
                elif epoch is not None and epoch != run_epoch:
                    _run_again(job_id, index, f"member {client.at} has a new run of it")
                    return
                while True:
                    try:
                        chunk = resp.read1(COPY_CHUNK_BYTES)
                    except TimeoutError:
                        if not follow:
                            raise
                        break  # a quiet item: ask again from where we are
                    if not chunk:
                        break
                    sink.write(chunk)
                    sink.flush()
                    offset += len(chunk)
                    cuts = 0
        except (http.client.HTTPException, TimeoutError, ConnectionError) as e:
            cuts += 1
            if cuts < len(client.ats):
                # The member went away mid-stream: the next goes on from the same byte.
                client.next_member()
                continue
            raise Cut(f"the output from meshd at {client.at} broke off after {offset} bytes "
                      f"({type(e).__name__}); try again (-f goes on from where it was with "
                      "--item and the same ID)", 4) from None
        if not follow:
            return
        # The stream ended: the item ended, or a follow that lasted log_follow_s_max or went
        # quiet past our timeout (ask again from the offset), or its lease moved to a new run.
        record = client.json("GET", f"/jobs/{_q(job_id)}?items=1")
        items = record.get("items") or []
        item = items[index] if index < len(items) and isinstance(items[index], dict) else {}
        if item.get("state") != "leased":
            return
        if run_epoch is not None and str(item.get("epoch")) != run_epoch:
            _run_again(job_id, index, f"its lease moved to member {item.get('member')}")
            return
        time.sleep(limits.log_poll_ms / 1000)  # (never a tight loop of empty answers)


def _run_again(job_id: str, index: int, why: str) -> None:
    click.echo(f"meshctl: item {index} of job {job_id} runs again ({why}): its output starts "
               "again; run this command again to see it", err=True)


def _table(header: list[str], rows: list[list[str]], width: int | None = None) -> None:
    """Columns padded to their widest cell; with `width`, the widest columns are cut (with
    "…") until a line fits in it, the first column (the id) last; when every column is as
    narrow as it may be, the last columns are left out."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    if width is not None:
        floor = [min(len(h), 4) + 1 for h in header]
        while sum(widths) + 2 * (len(widths) - 1) > width:
            cuttable = [i for i in range(1, len(widths)) if widths[i] > floor[i]]
            if not cuttable and widths[0] > 8:
                cuttable = [0]
            if cuttable:
                i = max(cuttable, key=lambda i: widths[i])
                widths[i] -= 1
            elif len(widths) > 2:
                widths.pop()
            else:
                break
        header = header[: len(widths)]
        rows = [r[: len(widths)] for r in rows]

    def fit(cell: str, w: int) -> str:
        return cell if len(cell) <= w else cell[: max(w - 1, 0)] + "…"

    for r in [header, *rows]:
        click.echo("  ".join(fit(cell, w).ljust(w)
                             for cell, w in zip(r, widths, strict=True)).rstrip())


@cli.command("jobs")
@click.option("--state", type=click.Choice(JOB_STATES))
@click.option("--tag", help="Only jobs with this tag.")
@click.option("--pool", help="Only jobs of this pool.")
@click.option("--limit", type=click.IntRange(1, limits.jobs_list_max),
              default=limits.jobs_list_default, show_default=True,
              help="At most N jobs, newest first.")
@click.option("--after", metavar="CURSOR",
              help="The next page: the cursor the page before printed (on stderr).")
@json_option
@click.pass_context
def jobs_cmd(ctx: click.Context, state: str | None, tag: str | None, pool: str | None,
             limit: int, after: str | None, as_json: bool) -> None:
    """List jobs, newest first, a page at a time, with each one's program (its argv)."""
    query = {k: v for k, v in (("state", state), ("tag", tag), ("pool", pool), ("after", after))
             if v}
    query["limit"] = str(limit)
    query["format"] = "json"
    client = _client(ctx)
    with client.open("GET", "/jobs?" + urllib.parse.urlencode(query)) as resp:
        nxt = resp.headers.get("X-Meshjobs-Next")
        fresh = resp.headers.get("X-Meshjobs-Fresh")
        buf = io.BytesIO()
        client.copy(resp, buf)
    try:
        listed = json.loads(buf.getvalue())
    except ValueError:
        raise Failure(f"meshd at {client.at} answered something that is not JSON", 1) from None
    if _wants_json(ctx, as_json):
        _print_json(listed)
    else:
        rows = [[str(j.get("id")), str(j.get("state")),
                 f"{j.get('items_done', 0)}/{j.get('items_total', 0)}",
                 str(j.get("items_failed", 0)), str(j.get("pool")),
                 str(j.get("priority")), _when(j.get("submitted_at")),
                 ",".join(j.get("tags") or []), _shell_words(j.get("argv", ""))]
                for j in listed]
        # The terminal's width (or $COLUMNS); none when piped, so that scripts get whole cells.
        width = shutil.get_terminal_size((0, 0)).columns or None
        _table(["ID", "STATE", "DONE", "FAILED", "POOL", "PRIORITY", "SUBMITTED", "TAGS",
                "PROGRAM"], rows, width)
    if fresh == "false":
        click.echo(f"meshctl: the member at {client.at} does not hear the leader now: this list "
                   "is its own table's and may be behind; ask another member (--at), or see "
                   "`meshctl fleet`", err=True)
    if nxt and nxt.isascii() and nxt.isdigit():
        more: list[str] = []
        if state:
            more += ["--state", state]
        if tag:
            more += ["--tag", tag]
        if pool:
            more += ["--pool", pool]
        click.echo(f"meshctl: more jobs: meshctl jobs {shlex.join(more + ['--limit', str(limit)])}"
                   f" --after {nxt}", err=True)


DURATION_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def _since(value: str, now: float) -> float:
    """--since: a duration back from now (90s, 30m, 2h, 7d, 1w), a date or time (ISO 8601, local
    time unless it names its zone), or seconds since the epoch."""
    v = value.strip()
    if len(v) > 1 and v[-1] in DURATION_UNITS:
        try:
            n = float(v[:-1])
        except ValueError:
            n = -1.0
        if 0 <= n < 1e7:
            return now - n * DURATION_UNITS[v[-1]]
    try:
        n = float(v)
        if 0 <= n < limits.epoch_s_max:
            return n
    except ValueError:
        pass
    try:
        return dt.datetime.fromisoformat(v).timestamp()
    except (ValueError, OverflowError, OSError):
        raise click.BadParameter(
            "give a duration back from now (30m, 2h, 7d), a date or time (2026-12-01, "
            "2026-12-01T08:00), or seconds since the epoch", param_hint="--since") from None


@cli.command("history")
@click.option("--since", "since", metavar="TIME|DURATION",
              help="Only jobs dropped at or after this: 30m, 2h, 7d, 2026-12-01T08:00, or epoch "
                   "seconds.")
@click.option("--limit", type=click.IntRange(1, limits.history_read_max),
              default=limits.history_read_default,
              show_default=True, help="At most this many records.")
@json_option
@click.pass_context
def history_cmd(ctx: click.Context, since: str | None, limit: int, as_json: bool) -> None:
    """Jobs this member saw forgotten or expired, and the earlier runs of jobs run again (its
    history.jsonl and rotated files), newest
    first: when, why (forget or expire), the job's id, state, items and tags."""
    query = {"limit": str(limit)}
    if since is not None:
        query["since"] = repr(_since(since, time.time()))
    body = _client(ctx).json("GET", "/history?" + urllib.parse.urlencode(query))
    if _wants_json(ctx, as_json):
        _print_json(body)
        return
    records = body.get("records") or []
    rows = []
    for row in records:
        job = row.get("job") or {}
        rows.append([_when(row.get("at")), str(row.get("why", "?")), str(job.get("id")),
                     str(job.get("state")), f"{job.get('items_done', 0)}/{job.get('items_total', 0)}",
                     str(job.get("pool")), ",".join(job.get("tags") or []) or "-"])
    if rows:
        _table(["DROPPED", "WHY", "ID", "STATE", "DONE", "POOL", "TAGS"], rows)
    if not records:
        click.echo("no history records" + (" since then" if since else ""), err=True)
    if body.get("skipped_lines"):
        click.echo(f"({body['skipped_lines']} damaged line(s) skipped)", err=True)
    if body.get("more"):
        click.echo("(more records: raise --limit, or narrow --since)", err=True)


@cli.command("fleet")
@json_option
@click.pass_context
def fleet_cmd(ctx: click.Context, as_json: bool) -> None:
    """The fleet: term, leader and members."""
    from meshjobs import webui  # its skew words; only here, so that other commands start sooner

    fleet = _client(ctx).json("GET", "/fleet")
    if _wants_json(ctx, as_json):
        _print_json(fleet)
        return
    click.echo(f"term {fleet.get('term')}  leader {fleet.get('leader') or '(none)'}")
    if fleet.get("partial"):
        click.echo("(this member's own view: the leader's could not be had; members it does "
                   "not hear from show as unknown)")

    def alive(m: dict) -> str:
        return webui.alive_words(m, local=True)

    def seen(m: dict) -> str:
        t = m.get("last_seen")
        return _when(t) if isinstance(t, (int, float)) and not isinstance(t, bool) else "-"

    rows = [[str(m.get("name")), str(m.get("role")), alive(m), str(m.get("slots", 0)),
             str(m.get("running", 0)), _size(m.get("blob_bytes")),
             _member_state(m), seen(m), webui.skew(m.get("clock_skew_ms")) or "-"]
            for m in fleet.get("members") or []]
    _table(["MEMBER", "ROLE", "ALIVE", "SLOTS", "RUNNING", "BLOBS", "STATE", "LAST SEEN",
            "CLOCK"], rows)
    for name, why in _items_warnings(fleet) + webui.clock_warnings(fleet):
        click.echo(f"WARNING: {name}: {why}")


def _items_warnings(fleet: dict) -> list[tuple[str, str]]:
    """(member, warning) for each member whose items are not walled off from it (/fleet's
    `items.warning`, meshjobs/wall.py)."""
    out = []
    for m in fleet.get("members") or []:
        items = m.get("items") if isinstance(m, dict) else None
        why = items.get("warning") if isinstance(items, dict) else None
        if isinstance(why, str) and why:
            out.append((str(m.get("name")), why))
    return out


def _member_state(m: dict) -> str:
    """The STATE column of `meshctl fleet`: stopping, drained, disk full, pressure."""
    words = [w for w, on in (("stopping", m.get("stopping")), ("drained", m.get("drained")),
                             ("disk full", m.get("disk_full")),
                             ("pressure", m.get("blob_pressure") and not m.get("disk_full")))
             if on]
    return ", ".join(words)


# --- pools and members under command (meshjobs/fleetctl.py) -----------------------------------


@cli.group("pool")
def pool_group() -> None:
    """Hold, release, drain or undrain a pool, or set its slots, fleet-wide or on one member
    (needs admin).

    hold: no new leases in the pool, and items leased but not started there wait until
    release (running ones go on). drain: no new leases; what is leased runs to its end.
    Orders are committed: they survive restarts and failovers, on top of the config."""


def _pool_order(action: str, help_text: str) -> None:
    @pool_group.command(action, help=help_text)
    @click.argument("pool")
    @click.option("--member", metavar="NAME", help="Only on this member (default: fleet-wide).")
    @json_option
    @click.pass_context
    def order(ctx: click.Context, pool: str, member: str | None, as_json: bool) -> None:
        body = {} if member is None else {"member": member}
        out = _client(ctx).json("POST", f"/pools/{_q(pool)}/{action}", body)
        if _wants_json(ctx, as_json):
            _print_json(out)
            return
        click.echo(f"pool {pool}: {_pool_words(out)}")


def _pool_words(row: dict) -> str:
    words = []
    for what in ("held", "drained"):
        on = row.get(f"{what}_on") or []
        if row.get(what):
            words.append(f"{what} fleet-wide")
        if on:
            words.append(f"{what} on {', '.join(map(str, on))}")
    if row.get("slots_set") is not None:
        words.append(f"slots {row['slots_set']} (set)")
    for m, n in sorted((row.get("slots_set_on") or {}).items()):
        words.append(f"slots {n} on {m} (set)")
    return "; ".join(words) or "taking work"


_pool_order("hold", "Hold POOL: start nothing more in it until release.")
_pool_order("release", "Release POOL (with --member: only that member's hold).")
_pool_order("drain", "Drain POOL: running items finish, no new ones are taken.")
_pool_order("undrain", "Undrain POOL (with --member: only that member's drain).")


@pool_group.command("slots")
@click.argument("pool")
@click.argument("n", required=False, type=click.IntRange(0, limits.pool_slots_max))
@click.option("--reset", is_flag=True, help="Back to the members' configured slots.")
@click.option("--member", metavar="NAME", help="Only on this member (default: fleet-wide).")
@json_option
@click.pass_context
def pool_slots(ctx: click.Context, pool: str, n: int | None, reset: bool, member: str | None,
               as_json: bool) -> None:
    """Set POOL's slots to N (0: take no new items there), fleet-wide or on one member, over
    the members' config; --reset goes back to the config. More slots run more items at once;
    fewer start fewer (running items go on). A pool a member's config lacks, or gives no
    slots, stays so."""
    if (n is None) == (not reset):
        raise click.UsageError("give either N (slots, 0 to "
                               f"{limits.pool_slots_max}) or --reset, not both or neither")
    body: dict[str, Any] = {"slots": n}
    if member is not None:
        body["member"] = member
    out = _client(ctx).json("POST", f"/pools/{_q(pool)}/slots", body)
    if _wants_json(ctx, as_json):
        _print_json(out)
        return
    click.echo(f"pool {pool}: {_pool_words(out)}")


@cli.command("pools")
@json_option
@click.pass_context
def pools_cmd(ctx: click.Context, as_json: bool) -> None:
    """Every pool, fleet-wide: slots, free, running, pending, held and drained (and where)."""
    view = _client(ctx).json("GET", "/pools")
    if _wants_json(ctx, as_json):
        _print_json(view)
        return
    if view.get("partial"):
        click.echo("(this member's own view: the leader's could not be had)")
    rows = [[str(p.get("pool")), str(p.get("slots", 0)), str(p.get("free", 0)),
             str(p.get("running", 0)), str(p.get("pending", 0)), _pool_words(p)]
            for p in view.get("pools") or []]
    _table(["POOL", "SLOTS", "FREE", "RUNNING", "PENDING", "STATE"], rows)


@cli.group("member")
def member_group() -> None:
    """Drain, undrain or stop a member (needs admin).

    drain: the member gets no new leases (what it runs goes on). stop: it takes no work, and
    its meshd exits (status 0) once its running items end, or after --grace S (then they are
    cut and leased again elsewhere); started again, it takes work again (the order is for
    that run only). undrain lifts a drain, and a stop not done yet."""


def _member_order(action: str, help_text: str) -> None:
    @member_group.command(action, help=help_text)
    @click.argument("name")
    @json_option
    @click.pass_context
    def order(ctx: click.Context, name: str, as_json: bool, grace: float | None = None) -> None:
        body = {} if grace is None else {"grace_s": grace}
        out = _client(ctx).json("POST", f"/members/{_q(name)}/{action}", body)
        if _wants_json(ctx, as_json):
            _print_json(out)
            return
        state = ("stopping" if out.get("stopping") else "drained" if out.get("drained")
                 else "taking work")
        click.echo(f"member {name}: {state}")

    if action == "stop":
        click.option("--grace", type=click.FloatRange(0, limits.stop_grace_s_max), metavar="S",
                     help="Cut what still runs after S seconds (default: wait for it).")(order)


_member_order("drain", "Drain member NAME: no new leases to it.")
_member_order("undrain", "Undrain member NAME (also calls off a stop not done yet).")
_member_order("stop", "Stop member NAME: its meshd exits once its running items end.")


def _size(n: object) -> str:
    """A byte count for people: 512 B, 3.4 MiB, ..."""
    if isinstance(n, bool) or not isinstance(n, int):
        return "-"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"


# --- Re-running finished jobs ------------------------------------------------------------------


def _rerun_spec(restart: str | None, delay: float | None, resubmit: int | None,
                stdout_path: str | None, stderr_path: str | None) -> dict[str, Any]:
    """The submit keys of --restart, --restart-delay, --resubmit, --stdout and --stderr (meshd
    checks them: control.parse_rerun_keys)."""
    out: dict[str, Any] = {}
    if restart is not None:
        if restart == "forever":
            out["restart"] = restart
        elif restart.isascii() and restart.isdigit() and len(restart) <= 9:
            out["restart"] = int(restart)
        else:
            raise click.BadParameter(f"{restart[:40]!r}: give a number of re-runs (1 to "
                                     f"{limits.restart_max}) or forever", param_hint="--restart")
    if resubmit is not None:
        out["resubmit"] = resubmit
    if delay is not None:
        if not out:
            raise click.UsageError("--restart-delay is the wait before an automatic re-run: give "
                                   "--restart or --resubmit with it")
        out["restart_delay_s"] = delay
    if stdout_path is not None:
        out["stdout"] = stdout_path
    if stderr_path is not None:
        out["stderr"] = stderr_path
    return out


def _rerun_rows(record: dict) -> list[tuple[str, str]]:
    """What `job status` says of a job's runs: which run this is, the automatic re-runs used
    and asked for, the one due, and the earlier runs."""
    rows: list[tuple[str, str]] = []
    if "run" not in record:
        return rows
    asked = []
    if record.get("restart") is not None:
        asked.append(f"restart {record.get('restarts', 0)} of {record['restart']}")
    if record.get("resubmit") is not None:
        asked.append(f"resubmit {record.get('resubmits', 0)} of {record['resubmit']}")
    rows.append(("run", f"{record['run']}" + (f" ({', '.join(asked)})" if asked else "")))
    if record.get("rerun_due_at"):
        capped = (f", later than its delay: it re-ran {limits.restarts_per_minute_max} times "
                  "within a minute (restarts_per_minute_max)"
                  if record.get("rerun_wait") == "restarts_per_minute_max" else "")
        rows.append(("next run", f"{record.get('rerun_due_why')} at "
                                 f"{_when(record['rerun_due_at'])}{capped} (meshctl job cancel "
                                 f"{record.get('id')} stops it)"))
    for p in record.get("previous_runs") or []:
        rows.append((f"run {p.get('run')}", f"{p.get('state')} at {_when(p.get('finished_at'))}: "
                                            f"{p.get('items_done')} done, {p.get('items_failed')} "
                                            f"failed, {p.get('items_cancelled')} cancelled; then "
                                            f"{p.get('then')}"))
    return rows


@job.command("rerun")
@click.argument("job_id", metavar="ID")
@click.option("--failed-only", "failed_only", is_flag=True,
              help="Run again only the items that failed, timed out or were cancelled.")
@json_option
@click.pass_context
def job_rerun(ctx: click.Context, job_id: str, failed_only: bool, as_json: bool) -> None:
    """Run a finished job (done, failed or cancelled) again under the same id: its items (all,
    or --failed-only) wait again and get new attempt numbers; the earlier run stays in the job's
    record (previous_runs) and in `meshctl history`."""
    _change(ctx, "POST", f"/jobs/{_q(job_id)}/rerun", {"failed_only": failed_only}, as_json)
# --- schedules ---------------------------------------------------------------------------------

SPEC_SINK = "meshjobs.spec_sink"  # ctx.meta key: where `job submit` puts its spec for `cron add`
# Options of `job submit` a schedule's runs do not take: each run gets its own id, and has one
# item with no input and no parents.
CRON_NOT_SUBMIT_OPTIONS = frozenset({"job_id", "items_from", "after", "as_json", "argv"})


@cli.group()
def cron() -> None:
    """Schedules: jobs submitted at times a cron spec names (UTC), by the leader, once each."""


def _utc(seconds: Any) -> str:
    if not isinstance(seconds, (int, float)) or isinstance(seconds, bool):
        return "-"
    return dt.datetime.fromtimestamp(seconds, dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


@cron.command("add")
@click.argument("name")
@click.argument("spec")
@click.option("--catch-up", "catch_up", type=click.Choice(("latest", "none")), default="latest",
              show_default=True,
              help="Runs missed while the fleet had no leader: fire the latest of them once "
                   "(latest), or none.")
@click.option("--overlap", type=click.Choice(("allow", "skip")), default="allow",
              show_default=True,
              help="A run due while the one before still runs: submit it all the same (allow), "
                   "or pass it over (skip).")
@click.option("--replace", is_flag=True, help="Replace a schedule of this name if there is one.")
@json_option
@click.argument("argv", nargs=-1, required=True, type=click.UNPROCESSED)
@click.pass_context
def cron_add(ctx: click.Context, name: str, spec: str, catch_up: str, overlap: str,
             replace: bool, as_json: bool, argv: tuple[str, ...], **job_options: Any) -> None:
    """Add a schedule: meshctl cron add NAME 'SPEC' [OPTIONS] -- PROGRAM [ARGS]...

    SPEC is five cron fields, MIN HOUR DAY-OF-MONTH MONTH DAY-OF-WEEK in UTC (`*`, lists,
    ranges, steps, names like mon or jan; when both day fields are restricted either matches),
    or `@every 30s` (5m, 1h30m, 2d: at the multiples of it since the epoch), or @hourly, @daily,
    @weekly, @monthly, @yearly. Each run is a job with id cron-NAME-YYYYMMDDTHHMMSS (its due
    time, UTC), made once even across leader changes. The job options are those of
    `job submit` (not --id, --items-from or --after)."""
    sink: list[dict] = []
    ctx.meta[SPEC_SINK] = sink
    try:
        ctx.invoke(job_submit, argv=argv, **job_options)
    finally:
        del ctx.meta[SPEC_SINK]
    body = {"spec": spec, "job": sink[0], "catch_up": catch_up, "overlap": overlap,
            "replace": replace}
    record = _client(ctx).json("PUT", f"/cron/{_q(name)}", body)
    if _wants_json(ctx, as_json):
        _print_json(record)
    else:
        click.echo(f"{record.get('name')}: next due {_utc(record.get('next_due'))}")


# The job options of `cron add` are `job submit`'s own (one definition, one parser).
cron_add.params[-1:-1] = [p for p in job_submit.params
                          if isinstance(p, click.Option) and p.name not in CRON_NOT_SUBMIT_OPTIONS]


@cron.command("list")
@json_option
@click.pass_context
def cron_list(ctx: click.Context, as_json: bool) -> None:
    """The schedules: name, spec, next due time, the last run's job id, paused or not."""
    body = _client(ctx).json("GET", "/cron")
    if _wants_json(ctx, as_json):
        _print_json(body)
        return
    rows = [[str(c.get("name")), str(c.get("spec")), _utc(c.get("next_due")),
             str(c.get("last_job") or "-"), "paused" if c.get("paused") else "-"]
            for c in body.get("crons") or []]
    if not rows:
        click.echo("no schedules", err=True)
        return
    _table(["NAME", "SPEC", "NEXT DUE", "LAST JOB", "PAUSED"], rows,
           shutil.get_terminal_size((0, 0)).columns or None)


def _cron_change(ctx: click.Context, method: str, path: str, as_json: bool, said: str) -> None:
    record = _client(ctx).json(method, path)
    if _wants_json(ctx, as_json):
        _print_json(record)
    else:
        click.echo(f"{record.get('name')}: {said}")


@cron.command("rm")
@click.argument("name")
@json_option
@click.pass_context
def cron_rm(ctx: click.Context, name: str, as_json: bool) -> None:
    """Remove a schedule (runs it submitted stay)."""
    _cron_change(ctx, "DELETE", f"/cron/{_q(name)}", as_json, "removed")


@cron.command("pause")
@click.argument("name")
@json_option
@click.pass_context
def cron_pause(ctx: click.Context, name: str, as_json: bool) -> None:
    """Fire no runs of a schedule until it is resumed."""
    _cron_change(ctx, "POST", f"/cron/{_q(name)}/pause", as_json, "paused")


@cron.command("resume")
@click.argument("name")
@json_option
@click.pass_context
def cron_resume(ctx: click.Context, name: str, as_json: bool) -> None:
    """Fire a paused schedule's runs again, from the next due time on (none missed meanwhile)."""
    _cron_change(ctx, "POST", f"/cron/{_q(name)}/resume", as_json, "resumed")


@cli.command("watch", context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("args", metavar="[KEY=VALUE]... CONFIG...", nargs=-1, required=True)
@click.option("--once", is_flag=True,
              help="One scan, wait for the jobs it submitted, exit (1 if one failed, 4 if "
                   "the member could not be reached, 2 if it refused a submit).")
@click.option("--dry-run", "dry_run", is_flag=True,
              help="Print the jobs one scan would submit (JSON lines); change nothing.")
@click.option("--at", "watch_at", metavar="URL", help="The member to submit to (else the global "
              "--at or MESHJOBS_AT, else the config's client.at).")
@click.option("--poll", is_flag=True, help="No file events: rescan only (every watch's rescan).")
@click.pass_context
def watch_cmd(ctx: click.Context, args: tuple[str, ...], once: bool, dry_run: bool,
              watch_at: str | None, poll: bool) -> None:
    """Watch folders and submit jobs for the files in them (meeseeks-watch's config).

    CONFIG files (JSON, or TOML) are merged in order; KEY.SUBKEY=VALUE arguments override them.
    A file's job id comes from the watch, index, file name and mtime, so nothing runs twice."""
    from meshjobs import logs, watchplan
    from meshjobs.watch import Watcher

    overrides = [a for a in args if "=" in a and not os.path.exists(a)]
    files = [a for a in args if a not in overrides]
    if not files:
        raise Failure("name a config file: meshctl watch [KEY=VALUE]... CONFIG...", 2)
    raw: dict = {}
    try:
        for name in files:
            try:
                with open(name, "rb") as f:
                    data = f.read(limits.watch_config_bytes_max + 1)
            except OSError as e:
                raise Failure(f"cannot read config {name}: {e.strerror or e}", 2) from None
            fmt = "toml" if name.endswith(".toml") else "json" if name.endswith(".json") else "auto"
            text = data.decode("utf-8", "replace")
            raw = watchplan.merge(raw, watchplan.load_text(text, name, fmt))
        config = watchplan.build(watchplan.apply_overrides(raw, overrides))
    except watchplan.WatchError as e:
        raise Failure("the watch config cannot run:\n  " + "\n  ".join(e.errors), 2) from None
    import dataclasses
    # Jobs run on other members, in other folders: %(file)s and %(path)s must be absolute.
    config = dataclasses.replace(config, watches=tuple(
        watchplan.rooted(w, os.path.abspath(w.path)) for w in config.watches))
    root = ctx.find_root()
    obj = root.obj
    at = watch_at or (obj["at"] if root.get_parameter_source("ats")
                      not in (click.core.ParameterSource.DEFAULT, None)
                      else config.client.get("at", obj["at"]))
    _urls((at,))
    token = obj.get("token")
    if token is None and "token_file" in config.client:
        token = _read_token(config.client["token_file"])
    tls = obj.get("tls")
    if urllib.parse.urlsplit(at).scheme == "https" and tls is None:
        tls = _tls(obj.get("cacert") or config.client.get("cacert"))
    logs.configure()
    import structlog
    client = Client(at, uuid.uuid4().hex, token, tls)
    watcher = Watcher(config, client, structlog.get_logger("meshjobs.watch"), dry_run=dry_run,
                      out=sys.stdout)
    if dry_run or once:
        ctx.exit(watcher.once())
    try:
        watcher.run(events=not poll)
    except KeyboardInterrupt:
        ctx.exit(130)


def main() -> NoReturn:
    """The `meshctl` console script."""
    try:
        cli(prog_name="meshctl")
    except BrokenPipeError:
        # The reader went away (meshctl job results ID | head): quiet, as other tools are.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        sys.exit(1)
    sys.exit(0)  # cli() exits itself; this is for type checkers.


if __name__ == "__main__":
    main()

