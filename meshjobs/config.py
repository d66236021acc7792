"""meshd's configuration: the TOML file of docs/configuration.md, with defaults for a fleet of one.

Every key is optional but `name` (in a file); with no file at all, meshd runs a fleet of one on
127.0.0.1 with its data folder in the current directory and a `default` pool of kind `command`
with one slot per core. Errors say which key is wrong and what it should be: all of them at
once (the file's shape is checked by the typed models of meshjobs/configfile.py, what keys mean
together here).
"""

from __future__ import annotations

import os
import socket
import tomllib
from dataclasses import dataclass, field
from typing import Any

from meshjobs import configfile, limits
from meshjobs.control import POOL_RE, QUOTA_KEYS, ControlError, parse_user
from meshjobs.identity import default_run_as
from meshjobs.itemenv import DEFAULT_PASS
from meshjobs.node import Pool

DEFAULT_DATA = "meshjobs-data"
K8S_SECRETS = "/var/run/secrets"  # the service account's token, when Kubernetes mounts it
DEFAULT_HTTP = "127.0.0.1:7700"
DEFAULT_PEER = "127.0.0.1:7701"
DEFAULT_RAFT = "127.0.0.1:7702"
DEFAULT_BLOB_MEM_MAX = 256 << 20  # [blobs] mem_max: payload bytes waiting to be stored
DEFAULT_GC_GRACE_S = 3600.0  # [blobs] gc_grace_s: an unpinned blob lives this long
DEFAULT_GC_EVERY_S = 60.0  # [blobs] gc_every_s: how often unpinned blobs are collected
DEFAULT_KEEP_S = 7 * 86400.0  # [retention] keep_s: finished jobs are forgotten after this
DEFAULT_KEEP_JOBS = 100_000  # [retention] keep_jobs: and at most this many are kept
# The keys of each table: the typed models of the file's shape (meshjobs/configfile.py).
TOP_KEYS = set(configfile.ConfigFile.model_fields)
# `http` is either the address ("host:port") or a table with the address and these keys.
HTTP_KEYS = set(configfile.HttpTable.model_fields)
AUTH_KEYS = set(configfile.AuthTable.model_fields)
ROLES = ("read", "submit", "admin")  # each role may do what the ones before it may
TOKEN_KEYS = set(configfile.TokenTable.model_fields)
LOOPBACK_NAMES = ("localhost", "ip6-localhost")
POOL_KEYS = set(configfile.PoolTable.model_fields)
POOL_KINDS = ("command", "python")  # python: slots pre-forked meshjobs.pyworker processes


class ConfigError(Exception):
    """A configuration meshd cannot run with; the message says which key and why (every
    problem found, one a line, when there are several: `problems`)."""

    def __init__(self, message: str, problems: list[str] | None = None) -> None:
        super().__init__(message)
        self.problems = problems if problems is not None else [message]


@dataclass(frozen=True)
class Token:
    """A client token as the config names it: only the SHA-256 of the token is kept."""

    name: str
    role: str  # one of ROLES
    sha256: bytes  # 32 bytes
    # The users its jobs may run as (meshjobs/identity.py Rule 2; "*": any but root), the first
    # the default. From the config's run_as; without one: ["*"] for admin, none for the others.
    run_as: tuple[str, ...] = ()
    # Per-identity quotas (meshjobs/quotas.py): None is unlimited. From the token's keys, else
    # [auth]'s defaults; an admin token takes no [auth] default, only what it sets itself.
    quota: Quota = field(default_factory=lambda: Quota())


@dataclass(frozen=True)
class Quota:
    """What one identity may hold at once; None: no limit."""

    pending_items_max: int | None = None
    running_items_max: int | None = None
    schedules_max: int | None = None

    def as_request(self) -> dict[str, int]:
        """The limits that are set, as a change request's "quota" carries them."""
        return {k: v for k, v in (("pending_items_max", self.pending_items_max),
                                  ("running_items_max", self.running_items_max),
                                  ("schedules_max", self.schedules_max)) if v is not None}


@dataclass
class Auth:
    """Who may use the HTTP API. `configured` is False when the file has no [auth] table."""

    configured: bool = False
    tokens: tuple[Token, ...] = ()
    allow_anonymous: bool = True
    # The role of a request that carries no token, when anonymous requests are allowed.
    anonymous_role: str = "admin"
    metrics: str = "open"  # "open": /metrics needs no token; "read": it needs the read role
    # [auth]'s default quota: of non-admin tokens without their own keys, and of anonymous.
    quota: Quota = field(default_factory=lambda: Quota())


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
    # [notify] allow: CIDRs and host names finish notices may go to besides public addresses
    # (meshjobs.hookaddr); nothing else private, loopback or link-local.
    notify_allow: tuple[str, ...] = ()
    # [items] user: who items run as when neither their job nor their pool names a user, when
    # meshd may switch users (None: meshjobs-item, else nobody; see runas.item_user).
    item_user: str | None = None
    # [items] wall: auto (Landlock when the kernel has it), landlock (refuse to start without
    # it) or off (meshjobs.wall)
    item_wall: str = "auto"

    @property
    def wall_denied(self) -> tuple[str, ...]:
        """What items may never reach (meshjobs.wall): the data folder, the fleet secret, the
        TLS key, and the Kubernetes service account's token."""
        paths = [self.data, self.secret_path, K8S_SECRETS]
        if self.http_tls_key is not None:
            paths.append(self.http_tls_key)
        return tuple(paths)

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


class _Problems:
    """Every problem of a file, kept to be reported together."""

    def __init__(self, found: list[str] | None = None) -> None:
        self.found: list[str] = list(found or [])

    def add(self, message: str) -> None:
        self.found.append(message)

    def check(self, fn: Any, *args: Any, default: Any = None) -> Any:
        """fn(*args), or `default` with its ConfigError kept."""
        try:
            return fn(*args)
        except ConfigError as e:
            self.found.extend(e.problems)
            return default

    def raise_any(self, path: str | None) -> None:
        if not self.found:
            return
        if len(self.found) == 1:
            raise ConfigError(self.found[0], self.found)
        where = path or "the configuration"
        raise ConfigError(f"{where} has {len(self.found)} problems; fix each of them:\n"
                          + "\n".join(f"  - {p}" for p in self.found), self.found)


def _pools(tables: dict[str, configfile.PoolTable], problems: _Problems) -> dict[str, Pool]:
    if not tables:
        problems.add("[pools] must have at least one [pools.NAME] table")
        return {}
    pools = {}
    for name, p in tables.items():
        if not POOL_RE.fullmatch(name):
            problems.add(f"pool name {name[:80]!r}: use letters, digits, '.', '_' or '-'")
            continue
        kind = p.kind or "command"
        slots = p.slots if p.slots is not None else (os.cpu_count() or 1)
        if p.drain or p.hold:
            slots = 0  # a draining or held pool takes no new items
        pools[name] = Pool(name=name, kind=kind, slots=slots,
                           runtime_s=None if p.runtime_s is None else float(p.runtime_s),
                           user=problems.check(_pool_user, name, p.user))
    workers = python_workers(pools)
    if workers > limits.py_workers_max:
        # Each slot of a python pool is a resident process, not a fork per item.
        problems.add(f"[pools]: python pools have {workers} slots together, over "
                     f"{limits.py_workers_max} worker processes (py_workers_max)")
    return pools


def _pool_user(pool: str, value: Any) -> str | None:
    """[pools.X] user: who the pool's items run as when their job names no user; a user name, or
    "UID" / "UID:GID", that this machine knows (daemon.py checks meshd may switch to it)."""
    if value is None:
        return None
    try:
        user = parse_user(value)
    except ControlError as e:
        raise ConfigError(f"[pools.{pool}] user: {e.message}") from None
    # A python pool's workers run as its user too (meshjobs.pypool).
    _known_user(f"[pools.{pool}] user", user)
    return user


def _known_user(key: str, user: str) -> None:
    """A user (as parse_user normalized it) this machine's user database knows, or the
    ConfigError naming `key`."""
    from meshjobs import runas
    try:
        runas.resolve(user, "this member")
    except runas.RunAsError:
        if ":" in user or not user.isdigit():
            why = "no such user on this machine: create it, or fix the key"
        else:
            why = (f"uid {user} has no entry in this machine's user database, so its group is "
                   f"unknown: give it (\"{user}:GID\"), or create the user")
        raise ConfigError(f"{key} = {user!r}: {why}") from None


def _item_user(value: Any) -> str | None:
    """[items] user: who items run as when neither their job nor their pool names a user (when
    meshd may switch users); a user this machine knows. None: the default (runas.item_user)."""
    if value is None:
        return None
    try:
        user = parse_user(value)
    except ControlError as e:
        raise ConfigError(f"[items] user: {e.message}") from None
    _known_user("[items] user", user)
    return user


def python_workers(pools: dict[str, Pool]) -> int:
    """The python worker processes a member keeps: the slots of its python pools together."""
    return sum(p.slots for p in pools.values() if p.kind == "python")


def _tls_file(value: str | None, key: str, base: str) -> str | None:
    if value is None:
        return None
    path = value if os.path.isabs(value) else os.path.join(base, value)
    if not os.path.isfile(path):
        raise ConfigError(f"[http] {key}: no file at {path}")
    return path


def _auth(table: configfile.AuthTable | None, problems: _Problems) -> Auth:
    if table is None:
        return Auth()
    default = Quota(**{k: getattr(table, k) for k in QUOTA_KEYS})

    def quota(t: configfile.TokenTable) -> Quota:
        return Quota(**{k: getattr(t, k) if getattr(t, k) is not None or t.role == "admin"
                        else getattr(default, k) for k in QUOTA_KEYS})

    tokens = tuple(Token(t.name, t.role, bytes.fromhex(t.sha256), default_run_as(t.role)
                         if t.run_as is None else tuple(t.run_as), quota(t))
                   for t in table.tokens or ())
    if len({t.name for t in tokens}) != len(tokens):
        problems.add("[auth] tokens: every token needs its own name")
    if len({t.sha256 for t in tokens}) != len(tokens):
        problems.add("[auth] tokens: two tokens have the same sha256")
    return Auth(configured=True, tokens=tokens,
                allow_anonymous=bool(table.allow_anonymous),
                anonymous_role=table.anonymous_role or "admin",
                metrics=table.metrics or "open", quota=default)


def _or(value: Any, default: Any) -> Any:
    return default if value is None else value


def read_toml(path: str) -> dict[str, Any]:
    """The parsed TOML file at `path`, read whole (at most `config_file_bytes_max` bytes). What
    keeps it from being read (no file, a folder, no permission, too big, not UTF-8, not TOML)
    is a ConfigError saying so and what to do."""
    try:
        with open(path, "rb") as f:
            data = f.read(limits.config_file_bytes_max + 1)
    except FileNotFoundError:
        raise ConfigError(f"no config file at {path}: check the path") from None
    except IsADirectoryError:
        raise ConfigError(f"{path} is a folder, not a config file: name the TOML file in "
                          "it") from None
    except OSError as e:
        raise ConfigError(f"cannot read the config file {path}: {e.strerror or e}: name a "
                          "regular file meshd's user can read (check its permissions)") from None
    if len(data) > limits.config_file_bytes_max:
        raise ConfigError(f"{path} is over {limits.config_file_bytes_max} bytes "
                          "(config_file_bytes_max): is it really meshd's config file?")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path} is not valid TOML: not UTF-8 text (byte {e.start}): is it "
                          "really meshd's config file?") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path} is not valid TOML: {e}") from None


def load_config(path: str | None = None, overrides: dict[str, Any] | None = None) -> Config:
    """Read the TOML file at `path` (None: the defaults of a fleet of one), then apply overrides
    given on meshd's command line (name, data, http, raft, peer). A file with problems raises
    one ConfigError naming every problem found."""
    raw: dict[str, Any] = read_toml(path) if path is not None else {}
    # What the command line overrides is checked there (below), not in the file, as before.
    given_now = {k for k, v in (overrides or {}).items() if v is not None}
    checked = {k: v for k, v in raw.items() if k not in given_now - {"http"}}
    if "http" in given_now and isinstance(raw.get("http"), str):
        del checked["http"]
    file, found = configfile.read(checked)
    problems = _Problems(found)
    if path is not None and "name" not in raw and not (overrides or {}).get("name"):
        problems.add(f"{path}: `name` is required (the member's name, unique in the fleet)")
    http_t = file.http or configfile.HttpTable()
    http_addr = http_t.addr
    if http_t.listen is not None:
        if http_t.addr is not None:
            problems.add("[http]: give the address once, as addr (listen is another name for it)")
        http_addr = http_t.listen
    given = {"name": file.name, "data": file.data, "raft": file.raft, "peer": file.peer}
    for k, v in (overrides or {}).items():
        if v is not None:
            if k == "http":
                http_addr = v
            else:
                given[k] = v
    name = given["name"] or socket.gethostname() or "meshd"
    if not isinstance(name, str) or not POOL_RE.fullmatch(name):
        problems.add(f"name {str(name)[:80]!r}: use letters, digits, '.', '_' or '-'")
    data = given["data"] if given["data"] is not None else DEFAULT_DATA
    if not isinstance(data, str) or not data:
        problems.add("data must be a folder path")
        data = DEFAULT_DATA
    if path is not None and not os.path.isabs(data):
        data = os.path.join(os.path.dirname(os.path.abspath(path)), data)
    secret_file = _or(file.secret_file, "fleet.secret")
    fleet = file.fleet or configfile.FleetTable()
    voters = []
    for k, v in enumerate(fleet.voters or ()):
        where = f"[fleet] voters[{k}]"
        addrs = [problems.check(parse_addr, v.raft, f"{where}.raft"),
                 problems.check(parse_addr, v.peer, f"{where}.peer"),
                 problems.check(parse_addr, v.http, f"{where}.http") if v.http is not None
                 else None]
        if addrs[0] is not None and addrs[1] is not None:
            voters.append(Voter(v.name, addrs[0], addrs[1], addrs[2]))
    names = [v.name for v in fleet.voters or ()]
    if len(set(names)) != len(names):
        problems.add("fleet.voters: every voter needs its own name")
    if names and len(names) not in (1, 3, 5, 7):
        problems.add(f"fleet.voters: use 3 or 5 voters (an odd number), not {len(names)}")
    join = problems.check(parse_addr, fleet.join, "fleet.join") if fleet.join is not None else None
    me = next((v for v in voters if v.name == name), None)
    raft_addr, peer_addr = given["raft"], given["peer"]
    if me is not None:
        # A voter's own addresses come from its entry unless the file or command line says more.
        raft_addr = _or(raft_addr, me.raft_addr)
        peer_addr = _or(peer_addr, f"{me.peer[0]}:{me.peer[1]}")
        if me.http is not None:
            http_addr = _or(http_addr, f"{me.http[0]}:{me.http[1]}")
    dead_ms = _or(fleet.dead_ms, limits.member_dead_ms)
    blob_copies = _or(fleet.blob_copies, limits.blob_copies)
    lost_ms = _or(fleet.lost_ms, limits.member_lost_ms)
    if lost_ms < dead_ms:
        problems.add(f"[fleet] lost_ms ({lost_ms}) must be at least dead_ms ({dead_ms}): a "
                     "member is lost (its outputs copied again) only after it is dead")
    if "pools" in raw and file.pools is not None:
        pools = _pools(file.pools, problems)
    else:
        pools = {"default": Pool(name="default", kind="command", slots=os.cpu_count() or 1)}
    blobs = file.blobs or configfile.BlobsTable()
    retention = file.retention or configfile.RetentionTable()
    keep_s = _or(retention.keep_s, DEFAULT_KEEP_S)
    keep_jobs = _or(retention.keep_jobs, DEFAULT_KEEP_JOBS)
    history = file.history or configfile.HistoryTable()
    http = problems.check(parse_addr, _or(http_addr, DEFAULT_HTTP), "http",
                          default=("127.0.0.1", 0))
    base = os.path.dirname(os.path.abspath(path)) if path is not None else os.getcwd()
    tls_cert = problems.check(_tls_file, http_t.tls_cert, "tls_cert", base)
    tls_key = problems.check(_tls_file, http_t.tls_key, "tls_key", base)
    if (http_t.tls_cert is None) != (http_t.tls_key is None):
        problems.add("[http] tls_cert and tls_key go together: give both, or neither")
    auth = _auth(file.auth, problems)
    if "auth" not in raw and not is_loopback(http[0]):
        problems.add(
            f"HTTP would listen on {http[0]}, beyond loopback, with no [auth] table: anyone who "
            "reaches it could run commands. Add [auth] tokens (see docs/security.md), or set "
            "[auth] allow_anonymous = true if a firewall or proxy guards it, or bind 127.0.0.1")
    if file.auth is not None and not auth.tokens and not auth.allow_anonymous:
        problems.add("[auth] has no tokens and allow_anonymous = false: nobody could use the "
                     "HTTP API. Add a token, or set allow_anonymous = true")
    peer = problems.check(parse_addr, _or(peer_addr, DEFAULT_PEER), "peer")
    raft = problems.check(parse_addr, _or(raft_addr, DEFAULT_RAFT), "raft")
    items = file.items or configfile.ItemsTable()
    item_user = problems.check(_item_user, items.user)
    problems.raise_any(path)
    return Config(
        auth=auth,
        http_tls_cert=tls_cert,
        http_tls_key=tls_key,
        http_names=tuple(n.lower() for n in http_t.names or ()),
        http_conns_max=http_t.conns_max,
        http_header_timeout_s=float(_or(http_t.header_timeout_s, limits.http_header_s_max)),
        http_idle_timeout_s=float(_or(http_t.idle_timeout_s, limits.http_idle_s_max)),
        http_body_timeout_s=float(_or(http_t.body_timeout_s, limits.http_body_s_max)),
        blob_mem_max_bytes=_or(blobs.mem_max, DEFAULT_BLOB_MEM_MAX),
        blob_gc_grace_s=float(_or(blobs.gc_grace_s, DEFAULT_GC_GRACE_S)),
        blob_gc_every_s=max(0.5, float(_or(blobs.gc_every_s, DEFAULT_GC_EVERY_S))),
        disk_free_min_bytes=blobs.disk_free_min,
        keep_s=float(keep_s) if keep_s else None,
        keep_jobs=keep_jobs if keep_jobs else None,
        history_bytes_max=_or(history.bytes_max, limits.history_bytes_max),
        history_keep=_or(history.keep, limits.history_keep_files),
        name=name,
        data=os.path.abspath(data),
        http=http,
        peer=peer,
        raft=raft,
        secret_file=secret_file,
        voters=voters,
        join=join,
        dead_ms=dead_ms,
        lost_ms=lost_ms,
        blob_copies=blob_copies,
        pools=pools,
        item_env_pass=tuple(items.env_pass) if items.env_pass is not None else DEFAULT_PASS,
        notify_allow=tuple((file.notify or configfile.NotifyTable()).allow or ()),
        item_user=item_user,
        item_wall=items.wall or "auto",
    )
