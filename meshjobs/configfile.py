"""The shape of meshd's TOML config file, as typed models, and its problems in words.

Theory of operation: `read(raw)` checks the parsed TOML (a dict) against `ConfigFile`, one
top-level key at a time, so that a broken table does not hide the problems of the others. Every
problem is kept (unknown keys, wrong types, values out of range, missing keys), each naming its
key path (`[pools.gpu] slots`, `[fleet] voters[1].raft`) and what the value should be. The
models say only what one key may hold; what keys mean together (lost_ms after dead_ms, TLS
files that exist, tokens with their own names) and the defaults are meshjobs/config.py's, which
also turns the checked tables into its `Config`.

Rule 1: a field's `description` is the hint a problem gives: "<key> must be <description>".
Rule 2: a validator's message reads after the key path ("must be ...", or ": ..." to follow it).
Rule 3: no defaults here but None (absent): config.py keeps the defaults and their units.
"""

from __future__ import annotations

import typing
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, ValidationError

from meshjobs import limits
from meshjobs.control import POOL_RE
from meshjobs.itemenv import PASS_RE

NAME_HINT = "letters, digits, '.', '_' or '-'"
ADDR_HINT = '"host:port" (a port 0..65535)'


class _Table(BaseModel):
    """A TOML table: unknown keys are refused, values are not coerced (1 is not true)."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


def _env_pass(value: Any) -> Any:
    """[items] env_pass: a list of variable names, each optionally ending in `*` (a prefix)."""
    if not isinstance(value, list) or not all(isinstance(n, str) for n in value):
        raise ValueError('must be a list of variable names, like ["PATH", "HOME", "LC_*"], '
                         f'not {value!r:.80}')
    if len(value) > limits.env_pass_names_max:
        raise ValueError(f"names {len(value)} variables, over {limits.env_pass_names_max} "
                         "(env_pass_names_max)")
    for n in value:
        if n == "*":
            raise ValueError(': "*" would pass meshd\'s whole environment (its secrets too): '
                             "name the variables items need")
        if not PASS_RE.fullmatch(n) or len(n) > 256:
            raise ValueError(f": {n[:80]!r} is not a variable name: use letters, digits and '_', "
                             "not starting with a digit; a trailing '*' passes every variable "
                             "it is a prefix of")
    return value


def _run_as(value: Any) -> Any:
    """[auth] tokens run_as: the users a token's jobs may run as (control.parse_run_as)."""
    from meshjobs.control import ControlError, parse_run_as

    try:
        return parse_run_as(value)
    except ControlError as e:
        raise ValueError(f": {e.message}") from None


def _sha256(value: str) -> str:
    try:
        ok = len(bytes.fromhex(value)) == 32
    except ValueError:
        ok = False
    if not ok:
        raise ValueError("must be the 64 hex characters of the token's SHA-256 (e.g. "
                         "`printf %s TOKEN | sha256sum`)")
    return value


def _history_bytes(value: int) -> int:
    if value and value < limits.history_line_bytes_max:
        raise ValueError(f"must be 0 (no history) or at least {limits.history_line_bytes_max} "
                         f"(one record), not {value}")
    return value


def _http_addr(value: Any) -> Any:
    """`http = "host:port"` is short for an [http] table with only `addr`."""
    return {"addr": value} if isinstance(value, str) else value


class VoterTable(_Table):
    """One voter of [fleet] voters."""

    name: str = Field(pattern=POOL_RE.pattern, description="a member name: " + NAME_HINT)
    raft: str = Field(description=ADDR_HINT + ": the voter's Raft address")
    peer: str = Field(description=ADDR_HINT + ": the voter's member-link address")
    http: str | None = Field(None, description=ADDR_HINT + ": the voter's HTTP address")


class FleetTable(_Table):
    voters: list[VoterTable] | None = Field(
        None, description="a list of { name, raft, peer, http } tables (3 or 5 voters)")
    join: str | None = Field(None, description=ADDR_HINT + ": a voter's member-link address")
    dead_ms: int | None = Field(None, ge=100, description="an integer of at least 100 (ms)")
    lost_ms: int | None = Field(None, ge=0, description="a non-negative integer (ms)")
    blob_copies: int | None = Field(None, ge=1, le=7, description="an integer 1..7")


class PoolTable(_Table):
    kind: Literal["command", "python"] | None = Field(None, description="one of command, python")
    slots: int | None = Field(None, ge=0, le=100_000, description="an integer 0..100000")
    runtime_s: float | None = Field(None, gt=0, description="a positive number of seconds")
    hold: bool | None = Field(None, description="true or false")
    drain: bool | None = Field(None, description="true or false")
    user: str | None = Field(None, description='a string: a user name, or "UID" or "UID:GID"')


class HttpTable(_Table):
    addr: str | None = Field(None, description=ADDR_HINT)
    listen: str | None = Field(None, description=ADDR_HINT + " (another name for addr)")
    tls_cert: str | None = Field(None, min_length=1, description="the path of a PEM file")
    tls_key: str | None = Field(None, min_length=1, description="the path of a PEM file")
    names: list[Annotated[str, Field(min_length=1, max_length=253, pattern=r"^[^ ]+$")]] | None = (
        Field(None, description='a list of host names, e.g. ["meshd.example.org"]'))
    conns_max: int | None = Field(None, ge=1, le=limits.http_conns_max,
                                  description=f"an integer 1..{limits.http_conns_max}")
    header_timeout_s: float | None = Field(None, gt=0, le=3600,
                                           description="a number of seconds in (0, 3600]")
    idle_timeout_s: float | None = Field(None, gt=0, le=86400,
                                         description="a number of seconds in (0, 86400]")
    body_timeout_s: float | None = Field(None, gt=0, le=86400,
                                         description="a number of seconds in (0, 86400]")


class TokenTable(_Table):
    name: str = Field(pattern=POOL_RE.pattern, description=NAME_HINT)
    role: Literal["read", "submit", "admin"] = Field(description="one of read, submit, admin")
    sha256: Annotated[str, AfterValidator(_sha256)] = Field(
        description="the 64 hex characters of the token's SHA-256")
    run_as: Annotated[Any, BeforeValidator(_run_as)] | None = Field(
        None, description='a list of users its jobs may run as ("alice", "1001", "1001:1001"; '
                          '"*": any user but root; "root" or "0": root too), the first the '
                          "default")
    pending_items_max: int | None = Field(None, ge=0, le=limits.quota_items_max,
                                          description=f"an integer 0..{limits.quota_items_max}")
    running_items_max: int | None = Field(None, ge=0, le=limits.quota_items_max,
                                          description=f"an integer 0..{limits.quota_items_max}")
    schedules_max: int | None = Field(None, ge=0, le=limits.cron_schedules_max,
                                      description=f"an integer 0..{limits.cron_schedules_max}")


class AuthTable(_Table):
    tokens: list[TokenTable] | None = Field(
        None, description='a list of { name = "...", role = "read|submit|admin", '
                          'sha256 = "<hex sha256 of the token>", run_as = [...] } tables')
    allow_anonymous: bool | None = Field(None, description="true or false")
    anonymous_role: Literal["read", "submit", "admin"] | None = Field(
        None, description="one of read, submit, admin")
    metrics: Literal["open", "read"] | None = Field(None, description='"open" or "read"')
    pending_items_max: int | None = Field(None, ge=0, le=limits.quota_items_max,
                                          description=f"an integer 0..{limits.quota_items_max}")
    running_items_max: int | None = Field(None, ge=0, le=limits.quota_items_max,
                                          description=f"an integer 0..{limits.quota_items_max}")
    schedules_max: int | None = Field(None, ge=0, le=limits.cron_schedules_max,
                                      description=f"an integer 0..{limits.cron_schedules_max}")


class BlobsTable(_Table):
    mem_max: int | None = Field(None, ge=0, description="a non-negative integer (bytes)")
    gc_grace_s: float | None = Field(None, ge=0, description="a non-negative number (seconds)")
    gc_every_s: float | None = Field(None, ge=0, description="a non-negative number (seconds)")
    disk_free_min: int | None = Field(None, ge=0, description="a non-negative integer (bytes)")


class RetentionTable(_Table):
    keep_s: float | None = Field(None, ge=0, description="a non-negative number (seconds; 0: "
                                                         "no age limit)")
    keep_jobs: int | None = Field(None, ge=0, description="a non-negative integer (0: no limit)")


class HistoryTable(_Table):
    bytes_max: Annotated[int, Field(ge=0), AfterValidator(_history_bytes)] | None = Field(
        None, description=f"a non-negative integer: 0 (no history) or at least "
                                f"{limits.history_line_bytes_max} bytes")
    keep: int | None = Field(None, ge=0, le=limits.history_keep_files_max,
                             description=f"a non-negative integer, at most "
                                         f"{limits.history_keep_files_max}")


def _notify_allow(value: Any) -> Any:
    """[notify] allow: CIDRs and host names finish notices may go to besides public addresses."""
    from meshjobs.hookaddr import ALLOW_HINT, parse_allow_entry

    if not isinstance(value, list):
        raise ValueError(f"must be {ALLOW_HINT}, not {value!r:.80}")
    if len(value) > limits.notify_allow_max:
        raise ValueError(f"has {len(value)} entries, over {limits.notify_allow_max} "
                         "(notify_allow_max): allow a wider network instead")
    for entry in value:
        try:
            parse_allow_entry(entry)
        except ValueError as e:
            raise ValueError(f": {e}") from None
    return value


class NotifyTable(_Table):
    allow: Annotated[list[str], BeforeValidator(_notify_allow)] | None = Field(
        None, description='a list of CIDRs and host names, e.g. ["10.1.2.0/24", "hooks.internal"]')


class ItemsTable(_Table):
    env_pass: Annotated[list[str], BeforeValidator(_env_pass)] | None = Field(
        None, description='a list of variable names, like ["PATH", "HOME", "LC_*"]')
    # Who items run as when neither their job nor their pool names a user (meshjobs.runas).
    user: str | None = Field(None, description='a string: a user name, or "UID" or "UID:GID"')
    wall: Literal["auto", "landlock", "off"] | None = Field(
        None, description='one of "auto", "landlock", "off"')


class ConfigFile(_Table):
    """The whole file. Every key may be absent here; config.py says which are needed."""

    # An empty name is the host's name, as it always was.
    name: str | None = Field(None, pattern="^$|" + POOL_RE.pattern,
                             description="the member's name: " + NAME_HINT)
    data: str | None = Field(None, min_length=1, description="a folder path")
    http: Annotated[HttpTable, BeforeValidator(_http_addr)] | None = Field(
        None, description=f'{ADDR_HINT} or an [http] table')
    peer: str | None = Field(None, description=ADDR_HINT)
    raft: str | None = Field(None, description=ADDR_HINT)
    secret_file: str | None = Field(None, min_length=1, description="a file name")
    fleet: FleetTable | None = None
    pools: dict[str, PoolTable] | None = Field(
        None, description="[pools.NAME] tables, at least one")
    blobs: BlobsTable | None = None
    retention: RetentionTable | None = None
    # Read by nothing; files that have it still load, as they always did.
    log: Any = None
    auth: AuthTable | None = None
    items: ItemsTable | None = None
    notify: NotifyTable | None = None
    history: HistoryTable | None = None


# --- problems in words -------------------------------------------------------------------------

def _inner_model(annotation: Any) -> tuple[type[BaseModel] | None, bool]:
    """The table model inside a field's type, and whether it sits in a list or dict (a `*`)."""
    for arg in typing.get_args(annotation) or (annotation,):
        if typing.get_origin(arg) is Annotated:
            arg = typing.get_args(arg)[0]
        if isinstance(arg, type) and issubclass(arg, BaseModel):
            return arg, False
        if typing.get_origin(arg) in (list, dict):
            inner = typing.get_args(arg)[-1]
            if isinstance(inner, type) and issubclass(inner, BaseModel):
                return inner, True
    return None, False


def _walk(model: type[BaseModel], prefix: tuple[str, ...], hints: dict, tables: dict) -> None:
    tables[prefix] = model
    for key, field in model.model_fields.items():
        here = (*prefix, key)
        if field.description:
            hints[here] = field.description
        inner, starred = _inner_model(field.annotation)
        if inner is not None:
            _walk(inner, (*here, "*") if starred else here, hints, tables)


HINTS: dict[tuple[str, ...], str] = {}
TABLES: dict[tuple[str, ...], type[BaseModel]] = {}
_walk(ConfigFile, (), HINTS, TABLES)


def _pattern(loc: tuple) -> tuple[str, ...]:
    """A location with list indexes and pool names as `*`: ("pools", "*", "slots")."""
    out: list[str] = []
    for part in loc:
        starred = (*out, "*")
        out.append("*" if isinstance(part, int) or (starred in TABLES and (*out, part)
                                                    not in TABLES) else str(part))
    return tuple(out)


def key_path(loc: tuple) -> str:
    """How the file names a location: `name`, `[items]`, `[pools.gpu] slots`, `[fleet]
    voters[0].raft`."""
    if not loc:
        return "the file"
    head = [str(loc[0])]
    rest = list(loc[1:])
    if head[0] == "pools" and rest:
        head.append(str(rest.pop(0)))
    if len(loc) == 1 and (str(loc[0]),) not in TABLES:
        return str(loc[0])
    text = ""
    for part in rest:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    table = f"[{'.'.join(head)}]"
    return f"{table} {text}" if text else table


def _hint(loc: tuple) -> str | None:
    pat = _pattern(loc)
    while pat:
        if pat in HINTS:
            return HINTS[pat]
        pat = pat[:-1]
    return None


def problem(error: dict) -> str:
    """One pydantic error as a sentence: the key path, what is wrong, what to put there."""
    loc = tuple(error["loc"])
    kind = error["type"]
    value = error.get("input")
    if kind == "extra_forbidden":
        table = TABLES.get(_pattern(loc[:-1]))
        known = ", ".join(table.model_fields) if table is not None else ""
        where = f"{key_path(loc[:-1])}: " if len(loc) > 1 else ""
        return f"{where}unknown key {str(loc[-1])[:80]!r}: remove it, or use one of {known}"
    path = key_path(loc)
    hint = _hint(loc)
    if kind == "missing":
        return f"{path} is missing: give it, {hint}" if hint else f"{path} is missing"
    if kind in ("value_error", "assertion_error"):
        words = str(error.get("ctx", {}).get("error", error["msg"]))
        return f"{path}{words}" if words.startswith(":") else f"{path} {words}"
    if kind in ("model_type", "model_attributes_type", "dict_type") and _pattern(loc) in TABLES:
        return f"{path} must be {hint or 'a table'}, not {value!r:.80}"
    if hint is None:
        return f"{path}: {error['msg'].lower()}, not {value!r:.80}"
    at = _pattern(loc)
    while at and at not in HINTS:
        at = at[:-1]
    if len(at) < len(_pattern(loc)):
        # A part of a list or table: say what is wrong with it, and what the whole should be.
        return (f"{path}: {error['msg'].lower()}, not {value!r:.80} "
                f"({key_path(loc[:len(at)])} must be {hint})")
    return f"{path} must be {hint}, not {value!r:.80}"


def read(raw: dict[str, Any]) -> tuple[ConfigFile, list[str]]:
    """The file's tables checked one top-level key at a time: the keys that are right (the
    others absent), and every problem found."""
    good: dict[str, Any] = {}
    problems: list[str] = []
    for key, value in raw.items():
        try:
            part = ConfigFile.model_validate({key: value})
        except ValidationError as e:
            problems.extend(problem(err) for err in e.errors())
            continue
        good[key] = getattr(part, key)
    return ConfigFile.model_construct(**good), problems
