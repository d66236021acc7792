"""meshd's configuration: the TOML file of DESIGN.md, with defaults for a fleet of one.

Every key is optional but `name` (in a file); with no file at all, meshd runs a fleet of one on
127.0.0.1 with its data folder in the current directory and a `default` pool of kind `command`
with one slot per core. Errors say which key is wrong and what it should be.
"""

from __future__ import annotations

import os
import socket
import tomllib
from dataclasses import dataclass, field
from typing import Any

from meshjobs import limits
from meshjobs.control import POOL_RE, ControlError, parse_user
from meshjobs.itemenv import DEFAULT_PASS, PASS_RE
from meshjobs.node import Pool

DEFAULT_DATA = "meshjobs-data"
DEFAULT_HTTP = "127.0.0.1:7700"
DEFAULT_PEER = "127.0.0.1:7701"
DEFAULT_RAFT = "127.0.0.1:7702"
DEFAULT_BLOB_MEM_MAX = 256 << 20  # [blobs] mem_max: payload bytes waiting to be stored
DEFAULT_GC_GRACE_S = 3600.0  # [blobs] gc_grace_s: an unpinned blob lives this long
DEFAULT_GC_EVERY_S = 60.0  # [blobs] gc_every_s: how often unpinned blobs are collected
DEFAULT_KEEP_S = 7 * 86400.0  # [retention] keep_s: finished jobs are forgotten after this
DEFAULT_KEEP_JOBS = 100_000  # [retention] keep_jobs: and at most this many are kept
TOP_KEYS = {"name", "data", "http", "peer", "raft", "secret_file", "fleet", "pools", "blobs",
            "retention", "log", "auth", "items", "history"}
# `http` is either the address ("host:port") or a table with the address and these keys.
HTTP_KEYS = {"addr", "listen", "tls_cert", "tls_key", "names", "conns_max", "header_timeout_s",
             "idle_timeout_s", "body_timeout_s"}
AUTH_KEYS = {"tokens", "allow_anonymous", "anonymous_role", "metrics"}
ROLES = ("read", "submit", "admin")  # each role may do what the ones before it may
TOKEN_KEYS = {"name", "role", "sha256"}
LOOPBACK_NAMES = ("localhost", "ip6-localhost")
POOL_KEYS = {"kind", "slots", "runtime_s", "hold", "drain", "user"}
POOL_KINDS = ("command", "python")  # python: slots pre-forked meshjobs.pyworker processes


class ConfigError(Exception):
    """A configuration meshd cannot run with; the message says which key and why."""


@dataclass(frozen=True)
class Token:
    """A client token as the config names it: only the SHA-256 of the token is kept."""

    name: str
    role: str  # one of ROLES
    sha256: bytes  # 32 bytes


@dataclass
class Auth:
    """Who may use the HTTP API. `configured` is False when the file has no [auth] table."""

    configured: bool = False
    tokens: tuple[Token, ...] = ()
    allow_anonymous: bool = True
    # The role of a request that carries no token, when anonymous requests are allowed.
    anonymous_role: str = "admin"
    metrics: str = "open"  # "open": /metrics needs no token; "read": it needs the read role


@dataclass
class Voter:
    name: str
    raft: tuple[str, int]
    peer: tuple[str, int]
    http: tuple[str, int] | None = None

    @property
    def raft_addr(self) -> str:
        return f"{self.raft[0]}:{self.raft[1]}"


@dataclass
class Config:
    name: str
    data: str
    http: tuple[str, int]
    peer: tuple[str, int]
    raft: tuple[str, int]
    secret_file: str
    voters: list[Voter] = field(default_factory=list)
    join: tuple[str, int] | None = None
    dead_ms: int = limits.member_dead_ms
    lost_ms: int = limits.member_lost_ms
    blob_copies: int = limits.blob_copies
    pools: dict[str, Pool] = field(default_factory=dict)
    blob_mem_max_bytes: int = DEFAULT_BLOB_MEM_MAX
    blob_gc_grace_s: float = DEFAULT_GC_GRACE_S
    blob_gc_every_s: float = DEFAULT_GC_EVERY_S
    # [blobs] disk_free_min: below this many bytes free on the data folder's disk the member is
    # read-only. None: 1 GiB, or 5 % of the disk when that is smaller (diskspace.py).
    disk_free_min_bytes: int | None = None
    keep_s: float | None = DEFAULT_KEEP_S
    keep_jobs: int | None = DEFAULT_KEEP_JOBS
    # [history] bytes_max: history.jsonl is rotated when it would grow past this (0: no
    # history file); keep: rotated files kept (history.1.jsonl, the newest, ...).
    history_bytes_max: int = limits.history_bytes_max
    history_keep: int = limits.history_keep_files
    auth: Auth = field(default_factory=Auth)
    http_tls_cert: str | None = None  # PEM certificate chain; with tls_key, HTTP is HTTPS
    http_tls_key: str | None = None
    # Host names (besides loopback names and IP literals) this member's HTTP is reached by:
    # requests naming any other host are refused (DNS rebinding), and so are browser requests
    # from any other origin. "*" allows every name.
    http_names: tuple[str, ...] = ()
    http_conns_max: int | None = None  # None: from the process's file descriptor limit
    http_header_timeout_s: float = limits.http_header_s_max
    http_idle_timeout_s: float = limits.http_idle_s_max
    http_body_timeout_s: float = limits.http_body_s_max
    # [items] env_pass: the names of meshd's environment variables items see (meshjobs.itemenv)
    item_env_pass: tuple[str, ...] = DEFAULT_PASS

    @property
    def secret_path(self) -> str:
        return os.path.join(self.data, self.secret_file)

    @property
    def raft_addr(self) -> str:
        return f"{self.raft[0]}:{self.raft[1]}"

    @property
    def role(self) -> str:
        """voter when named among the voters (or in a fleet of one), worker otherwise."""
        if self.fleet_of_one or any(v.name == self.name for v in self.voters):
            return "voter"
        return "worker"

    @property
    def fleet_of_one(self) -> bool:
        return not self.voters and self.join is None


def is_loopback(host: str) -> bool:
    """Whether a bind address is reachable from this machine only."""
    import ipaddress
    if host.lower() in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: whatever it resolves to, it may be reachable from outside


def parse_addr(value: Any, key: str) -> tuple[str, int]:
    if not isinstance(value, str) or ":" not in value:
        raise ConfigError(f"{key} must be \"host:port\", not {value!r}")
    host, _, port = value.rpartition(":")
    host = host.strip("[]")
    try:
        p = int(port)
    except ValueError:
        raise ConfigError(f"{key}: port {port!r} is not a number") from None
    if not 0 <= p <= 65535 or not host:
        raise ConfigError(f"{key} must be \"host:port\" with a port 0..65535, not {value!r}")
    return host, p


def _pools(raw: Any) -> dict[str, Pool]:
    if not isinstance(raw, dict) or not raw:
        raise ConfigError("[pools] must have at least one [pools.NAME] table")
    pools = {}
    for name, p in raw.items():
        if not POOL_RE.fullmatch(name):
            raise ConfigError(f"pool name {name!r}: use letters, digits, '.', '_' or '-'")
        if not isinstance(p, dict):
            raise ConfigError(f"[pools.{name}] must be a table")
        unknown = set(p) - POOL_KEYS
        if unknown:
            raise ConfigError(f"[pools.{name}]: unknown key(s) {', '.join(sorted(unknown))}")
        kind = p.get("kind", "command")
        if kind not in POOL_KINDS:
            raise ConfigError(f"[pools.{name}] kind must be one of {', '.join(POOL_KINDS)}, not {kind!r}")
        slots = p.get("slots", os.cpu_count() or 1)
        if isinstance(slots, bool) or not isinstance(slots, int) or not 0 <= slots <= 100_000:
            raise ConfigError(f"[pools.{name}] slots must be an integer 0..100000, not {slots!r}")
        runtime = p.get("runtime_s")
        if runtime is not None and (isinstance(runtime, bool) or not isinstance(runtime, (int, float))
                                    or runtime <= 0):
            raise ConfigError(f"[pools.{name}] runtime_s must be a positive number of seconds")
        if p.get("drain") or p.get("hold"):
            slots = 0  # a draining or held pool takes no new items
        pools[name] = Pool(name=name, kind=kind, slots=slots,
                           runtime_s=None if runtime is None else float(runtime),
                           user=_pool_user(name, kind, p.get("user")))
    workers = python_workers(pools)
    if workers > limits.py_workers_max:
        # Each slot of a python pool is a resident process, not a fork per item.
        raise ConfigError(f"[pools]: python pools have {workers} slots together, over "
                          f"{limits.py_workers_max} worker processes (py_workers_max)")
    return pools


def _pool_user(pool: str, kind: str, value: Any) -> str | None:
    """[pools.X] user: who the pool's items run as when their job names no user; a user name, or
    "UID" / "UID:GID", that this machine knows (daemon.py checks meshd may switch to it)."""
    if value is None:
        return None
    from meshjobs import runas
    try:
        user = parse_user(value)
    except ControlError as e:
        raise ConfigError(f"[pools.{pool}] user: {e.message}") from None
    if kind != "command":
        raise ConfigError(f"[pools.{pool}] user: a pool of kind {kind} calls functions in meshd's "
                          "own workers, which run as meshd's user: remove the key")
    try:
        runas.resolve(user, "this member")
    except runas.RunAsError:
        if ":" in user or not user.isdigit():
            why = "no such user on this machine: create it, or fix the key"
        else:
            why = (f"uid {user} has no entry in this machine's user database, so its group is "
                   f"unknown: give it (\"{user}:GID\"), or create the user")
        raise ConfigError(f"[pools.{pool}] user = {user!r}: {why}") from None
    return user


def python_workers(pools: dict[str, Pool]) -> int:
    """The python worker processes a member keeps: the slots of its python pools together."""
    return sum(p.slots for p in pools.values() if p.kind == "python")


def _number(table: dict, key: str, where: str, default: Any, integer: bool = False,
            allow_none: bool = False) -> Any:
    value = table.get(key, default)
    if value is None and allow_none:
        return None
    ok = isinstance(value, int) if integer else isinstance(value, (int, float))
    if isinstance(value, bool) or not ok or value < 0:
        kind = "a non-negative integer" if integer else "a non-negative number"
        raise ConfigError(f"[{where}] {key} must be {kind}, not {value!r}")
    return value


def _section(raw: dict, name: str, keys: set[str]) -> dict:
    sec = raw.get(name, {})
    if not isinstance(sec, dict):
        raise ConfigError(f"[{name}] must be a table")
    unknown = set(sec) - keys
    if unknown:
        raise ConfigError(f"[{name}]: unknown key(s) {', '.join(sorted(unknown))}")
    return sec


def _http_table(raw: dict) -> dict:
    """The [http] table (a bare `http = "host:port"` is its `addr`)."""
    value = raw.get("http")
    if value is None:
        return {}
    if isinstance(value, str):
        return {"addr": value}
    if not isinstance(value, dict):
        raise ConfigError('http must be "host:port" or an [http] table')
    unknown = set(value) - HTTP_KEYS
    if unknown:
        raise ConfigError(f"[http]: unknown key(s) {', '.join(sorted(unknown))}")
    table = dict(value)
    if "listen" in table:
        if "addr" in table:
            raise ConfigError("[http]: give the address once, as addr (listen is another name for it)")
        table["addr"] = table.pop("listen")
    return table


def _tls_file(table: dict, key: str, base: str) -> str | None:
    value = table.get(key)
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise ConfigError(f"[http] {key} must be the path of a PEM file")
    path = value if os.path.isabs(value) else os.path.join(base, value)
    if not os.path.isfile(path):
        raise ConfigError(f"[http] {key}: no file at {path}")
    return path


def _http_names(table: dict) -> tuple[str, ...]:
    names = table.get("names", [])
    if not isinstance(names, list) or not all(
            isinstance(n, str) and n and len(n) <= 253 and " " not in n for n in names):
        raise ConfigError('[http] names must be a list of host names, e.g. ["meshd.example.org"]')
    return tuple(n.lower() for n in names)


def _auth(raw: dict) -> Auth:
    if "auth" not in raw:
        return Auth()
    sec = _section(raw, "auth", AUTH_KEYS)
    tokens_raw = sec.get("tokens", [])
    if not isinstance(tokens_raw, list) or not all(isinstance(t, dict) for t in tokens_raw):
        raise ConfigError('[auth] tokens must be a list of { name = "...", role = "read|submit|admin", '
                          'sha256 = "<hex sha256 of the token>" } tables')
    tokens = []
    for k, t in enumerate(tokens_raw):
        unknown = set(t) - TOKEN_KEYS
        if unknown:
            raise ConfigError(f"[auth] tokens[{k}]: unknown key(s) {', '.join(sorted(unknown))}")
        name = t.get("name")
        if not isinstance(name, str) or not POOL_RE.fullmatch(name):
            raise ConfigError(f"[auth] tokens[{k}]: name must be letters, digits, '.', '_' or '-'")
        role = t.get("role")
        if role not in ROLES:
            raise ConfigError(f"[auth] tokens[{k}] ({name}): role must be one of {', '.join(ROLES)}, "
                              f"not {role!r}")
        digest = t.get("sha256")
        try:
            raw_digest = bytes.fromhex(digest) if isinstance(digest, str) else b""
        except ValueError:
            raw_digest = b""
        if len(raw_digest) != 32:
            raise ConfigError(f"[auth] tokens[{k}] ({name}): sha256 must be the 64 hex characters of "
                              "the token's SHA-256 (e.g. `printf %s TOKEN | sha256sum`)")
        tokens.append(Token(name, role, raw_digest))
    if len({t.name for t in tokens}) != len(tokens):
        raise ConfigError("[auth] tokens: every token needs its own name")
    if len({t.sha256 for t in tokens}) != len(tokens):
        raise ConfigError("[auth] tokens: two tokens have the same sha256")
    allow = sec.get("allow_anonymous", False)
    if not isinstance(allow, bool):
        raise ConfigError("[auth] allow_anonymous must be true or false")
    anon_role = sec.get("anonymous_role", "admin")
    if anon_role not in ROLES:
        raise ConfigError(f"[auth] anonymous_role must be one of {', '.join(ROLES)}")
    metrics = sec.get("metrics", "open")
    if metrics not in ("open", "read"):
        raise ConfigError('[auth] metrics must be "open" or "read"')
    return Auth(configured=True, tokens=tuple(tokens), allow_anonymous=allow,
                anonymous_role=anon_role, metrics=metrics)

def _env_pass(raw: dict) -> tuple[str, ...]:
    """[items] env_pass: a list of variable names, each optionally ending in `*` (a prefix)."""
    items = _section(raw, "items", {"env_pass"})
    names = items.get("env_pass", DEFAULT_PASS)
    if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names):
        raise ConfigError(f'[items] env_pass must be a list of variable names, like ["PATH", '
                          f'"HOME", "LC_*"], not {names!r:.80}')
    if len(names) > limits.env_pass_names_max:
        raise ConfigError(f"[items] env_pass names {len(names)} variables, over "
                          f"{limits.env_pass_names_max} (env_pass_names_max)")
    for n in names:
        if n == "*":
            raise ConfigError('[items] env_pass: "*" would pass meshd\'s whole environment (its '
                              "secrets too): name the variables items need")
        if not PASS_RE.fullmatch(n) or len(n) > 256:
            raise ConfigError(f"[items] env_pass: {n[:80]!r} is not a variable name: use letters, "
                              "digits and '_', not starting with a digit; a trailing '*' "
                              "passes every variable it is a prefix of")
    return tuple(names)


def load_config(path: str | None = None, overrides: dict[str, Any] | None = None) -> Config:
    """Read the TOML file at `path` (None: the defaults of a fleet of one), then apply overrides
    given on meshd's command line (name, data, http, raft, peer)."""
    raw: dict[str, Any] = {}
    if path is not None:
        try:
            with open(path, "rb") as f:
                raw = tomllib.load(f)
        except FileNotFoundError:
            raise ConfigError(f"no config file at {path}") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{path} is not valid TOML: {e}") from None
        if "name" not in raw and not (overrides or {}).get("name"):
            raise ConfigError(f"{path}: `name` is required (the member's name, unique in the fleet)")
        unknown = set(raw) - TOP_KEYS
        if unknown:
            raise ConfigError(f"{path}: unknown key(s) {', '.join(sorted(unknown))}")
    http_table = _http_table(raw)
    for k, v in (overrides or {}).items():
        if v is not None:
            if k == "http":
                http_table["addr"] = v
            else:
                raw[k] = v
    name = raw.get("name") or socket.gethostname() or "meshd"
    if not isinstance(name, str) or not POOL_RE.fullmatch(name):
        raise ConfigError(f"name {name!r}: use letters, digits, '.', '_' or '-'")
    data = raw.get("data", DEFAULT_DATA)
    if not isinstance(data, str) or not data:
        raise ConfigError("data must be a folder path")
    if path is not None and not os.path.isabs(data):
        data = os.path.join(os.path.dirname(os.path.abspath(path)), data)
    secret_file = raw.get("secret_file", "fleet.secret")
    if not isinstance(secret_file, str) or not secret_file:
        raise ConfigError("secret_file must be a file name")
    fleet = raw.get("fleet", {})
    if not isinstance(fleet, dict):
        raise ConfigError("[fleet] must be a table")
    unknown = set(fleet) - {"voters", "join", "dead_ms", "lost_ms", "blob_copies"}
    if unknown:
        raise ConfigError(f"[fleet]: unknown key(s) {', '.join(sorted(unknown))}")
    raw_voters = fleet.get("voters", [])
    if not isinstance(raw_voters, list) or not all(isinstance(v, dict) for v in raw_voters):
        raise ConfigError("fleet.voters must be a list of { name, raft, peer, http } tables")
    voters = []
    for k, v in enumerate(raw_voters):
        vname = v.get("name")
        if not isinstance(vname, str) or not POOL_RE.fullmatch(vname):
            raise ConfigError(f"fleet.voters[{k}]: name must be a member name")
        if "raft" not in v or "peer" not in v:
            raise ConfigError(f"fleet.voters[{k}] ({vname}) needs raft and peer addresses")
        voters.append(Voter(vname, parse_addr(v["raft"], f"fleet.voters[{k}].raft"),
                            parse_addr(v["peer"], f"fleet.voters[{k}].peer"),
                            parse_addr(v["http"], f"fleet.voters[{k}].http") if "http" in v else None))
    if len({v.name for v in voters}) != len(voters):
        raise ConfigError("fleet.voters: every voter needs its own name")
    if voters and len(voters) not in (1, 3, 5, 7):
        raise ConfigError(f"fleet.voters: use 3 or 5 voters (an odd number), not {len(voters)}")
    join = parse_addr(fleet["join"], "fleet.join") if fleet.get("join") is not None else None
    me = next((v for v in voters if v.name == name), None)
    if me is not None:
        # A voter's own addresses come from its entry unless the file or command line says more.
        raw.setdefault("raft", me.raft_addr)
        raw.setdefault("peer", f"{me.peer[0]}:{me.peer[1]}")
        if me.http is not None:
            http_table.setdefault("addr", f"{me.http[0]}:{me.http[1]}")
    dead_ms = _number(fleet, "dead_ms", "fleet", limits.member_dead_ms, integer=True)
    blob_copies = _number(fleet, "blob_copies", "fleet", limits.blob_copies, integer=True)
    if dead_ms < 100 or not 1 <= blob_copies <= 7:
        raise ConfigError("[fleet] dead_ms must be at least 100 and blob_copies 1..7")
    lost_ms = _number(fleet, "lost_ms", "fleet", limits.member_lost_ms, integer=True)
    if lost_ms < dead_ms:
        raise ConfigError(f"[fleet] lost_ms ({lost_ms}) must be at least dead_ms ({dead_ms}): a "
                          "member is lost (its outputs copied again) only after it is dead")
    pools = _pools(raw["pools"]) if "pools" in raw else {
        "default": Pool(name="default", kind="command", slots=os.cpu_count() or 1)}
    blobs = _section(raw, "blobs", {"mem_max", "gc_grace_s", "gc_every_s", "disk_free_min"})
    retention = _section(raw, "retention", {"keep_s", "keep_jobs"})
    keep_s = _number(retention, "keep_s", "retention", DEFAULT_KEEP_S)
    keep_jobs = _number(retention, "keep_jobs", "retention", DEFAULT_KEEP_JOBS, integer=True)
    history = _section(raw, "history", {"bytes_max", "keep"})
    history_bytes_max = _number(history, "bytes_max", "history", limits.history_bytes_max,
                                integer=True)
    history_keep = _number(history, "keep", "history", limits.history_keep_files, integer=True)
    if history_bytes_max and history_bytes_max < limits.history_line_bytes_max:
        raise ConfigError(f"[history] bytes_max must be 0 (no history) or at least "
                          f"{limits.history_line_bytes_max} (one record), not {history_bytes_max}")
    if history_keep > limits.history_keep_files_max:
        raise ConfigError(f"[history] keep must be at most {limits.history_keep_files_max}, "
                          f"not {history_keep}")
    http = parse_addr(http_table.get("addr", DEFAULT_HTTP), "http")
    base = os.path.dirname(os.path.abspath(path)) if path is not None else os.getcwd()
    tls_cert = _tls_file(http_table, "tls_cert", base)
    tls_key = _tls_file(http_table, "tls_key", base)
    if (tls_cert is None) != (tls_key is None):
        raise ConfigError("[http] tls_cert and tls_key go together: give both, or neither")
    conns_max = http_table.get("conns_max")
    if conns_max is not None and (isinstance(conns_max, bool) or not isinstance(conns_max, int)
                                  or not 1 <= conns_max <= limits.http_conns_max):
        raise ConfigError(f"[http] conns_max must be an integer 1..{limits.http_conns_max}")
    header_s = float(_number(http_table, "header_timeout_s", "http", limits.http_header_s_max))
    idle_s = float(_number(http_table, "idle_timeout_s", "http", limits.http_idle_s_max))
    body_s = float(_number(http_table, "body_timeout_s", "http", limits.http_body_s_max))
    if not 0 < body_s <= 86400:
        raise ConfigError("[http] body_timeout_s must be in (0, 86400] seconds")
    if not 0 < header_s <= 3600 or not 0 < idle_s <= 86400:
        raise ConfigError("[http] header_timeout_s must be in (0, 3600] and idle_timeout_s in "
                          "(0, 86400] seconds")
    auth = _auth(raw)
    if not auth.configured and not is_loopback(http[0]):
        raise ConfigError(
            f"HTTP would listen on {http[0]}, beyond loopback, with no [auth] table: anyone who "
            "reaches it could run commands. Add [auth] tokens (see docs/security.md), or set "
            "[auth] allow_anonymous = true if a firewall or proxy guards it, or bind 127.0.0.1")
    if auth.configured and not auth.tokens and not auth.allow_anonymous:
        raise ConfigError("[auth] has no tokens and allow_anonymous = false: nobody could use the "
                          "HTTP API. Add a token, or set allow_anonymous = true")
    return Config(
        auth=auth,
        http_tls_cert=tls_cert,
        http_tls_key=tls_key,
        http_names=_http_names(http_table),
        http_conns_max=conns_max,
        http_header_timeout_s=header_s,
        http_idle_timeout_s=idle_s,
        http_body_timeout_s=body_s,
        blob_mem_max_bytes=_number(blobs, "mem_max", "blobs", DEFAULT_BLOB_MEM_MAX, integer=True),
        blob_gc_grace_s=float(_number(blobs, "gc_grace_s", "blobs", DEFAULT_GC_GRACE_S)),
        blob_gc_every_s=max(0.5, float(_number(blobs, "gc_every_s", "blobs", DEFAULT_GC_EVERY_S))),
        disk_free_min_bytes=_number(blobs, "disk_free_min", "blobs", None, integer=True,
                                    allow_none=True),
        keep_s=float(keep_s) if keep_s else None,
        keep_jobs=keep_jobs if keep_jobs else None,
        history_bytes_max=history_bytes_max,
        history_keep=history_keep,
        name=name,
        data=os.path.abspath(data),
        http=http,
        peer=parse_addr(raw.get("peer", DEFAULT_PEER), "peer"),
        raft=parse_addr(raw.get("raft", DEFAULT_RAFT), "raft"),
        secret_file=secret_file,
        voters=voters,
        join=join,
        dead_ms=dead_ms,
        lost_ms=lost_ms,
        blob_copies=blob_copies,
        pools=pools,
        item_env_pass=_env_pass(raw),
    )
