"""Control requests: parsing and validating what clients ask for.

Theory of operation. A client (meshctl, HTTP, a forwarded F_CTL) asks for a change or a read.
Everything it sends is remote garbage until this module says otherwise: each parser takes a
decoded JSON value and returns a normalized dict, or raises one error class, `ControlError`, with
the HTTP status that fits and a message that says what to do next.

Rule 1: pure. No IO, no clock, no randomness: the caller stamps ids and times.
Rule 2: every size is bounded by a named limit in `limits.py`.
Rule 3: a bool is not an int (JSON `true` must not pass as priority 1).
"""

from __future__ import annotations

import re
from typing import Any, NamedTuple

from blobstore.digest import is_digest as is_digest  # one definition, also found here
from meshjobs import limits


class Answer(NamedTuple):
    """An answer to a control request: an HTTP status and a JSON-able body."""

    status: int
    body: Any


class ControlError(Exception):
    """A request that cannot be served as asked; `status` is the HTTP status to answer with."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message

    def answer(self) -> Answer:
        return Answer(self.status, {"error": self.message})


JOB_ID_RE = re.compile(rf"^[A-Za-z0-9._-]{{1,{limits.job_id_chars_max}}}$")
POOL_RE = re.compile(rf"^[A-Za-z0-9._-]{{1,{limits.pool_chars_max}}}$")
ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
RID_RE = re.compile(rf"^[A-Za-z0-9._:-]{{1,{limits.rid_chars_max}}}$")
# A user a job runs as: a name of the POSIX portable set (not starting with '-'), or a numeric
# uid with an optional gid. ASCII only: str.isdigit() would take other scripts' digits.
USER_NAME_RE = re.compile(rf"^[A-Za-z0-9._][A-Za-z0-9._-]{{0,{limits.user_chars_max - 1}}}$")
USER_IDS_RE = re.compile(r"^([0-9]+)(?::([0-9]+))?$")

JOB_STATES = ("waiting", "queued", "held", "running", "done", "failed", "cancelled", "dep_failed")
# The states a job ends in: it changes no more (until it is run again by hand or by a rule).
JOB_FINAL_STATES = ("done", "failed", "cancelled", "dep_failed")
# What a dependent waits for of each parent (`--after ID:COND`): that it ends done ("ok"), that
# it ends at all ("end"), or that it ends without succeeding ("fail": failed, a timeout among
# them, cancelled or dep_failed).
DEP_CONDITIONS = ("ok", "end", "fail")
# Item states by name, in the order of their codes in the job table (table.py stores the code).
ITEM_STATES = ("pending", "leased", "done", "failed", "timeout", "cancelled")

SUBMIT_KEYS = frozenset(
    {"id", "argv", "pool", "priority", "retries", "runtime_s", "hold", "tags", "env", "cwd",
     "items", "max_leases", "names", "user", "inherit_env", "after", "member", "notify"}
    | {"restart", "restart_delay_s", "resubmit", "stdout", "stderr"}
)
# Keys of a committed spec that no client sets: the HTTP edge and the leader stamp them (who
# submitted the job, and the users its items may run as; meshjobs/identity.py).
# The leader also stamps the submitter's running_items_max (quotas.py) from its request's quota.
SPEC_IDENTITY_KEYS = frozenset({"submitted_by", "run_as", "running_items_max"})
# Who asks for a change: an identity's name (a token's, "local" without [auth], "anonymous")
# and its role, stamped by the HTTP edge on every change request (`by`, `by_role`).
IDENTITY_RE = POOL_RE
ROLES = ("read", "submit", "admin")  # the same order as meshjobs.auth.ROLES
LOCAL = "local"  # the identity of a member without [auth] (one person's machine)
ANONYMOUS = "anonymous"  # a request without a token (allow_anonymous), and jobs from before names
TONE_KEYS = frozenset({"priority", "hold", "max_leases"})
# The ops that are log entries ("cron": its list and get are reads, its other actions changes).
CHANGE_OPS = frozenset({"submit", "cancel", "forget", "tone", "bulk", "pool", "member", "rerun",
                        "cron"})
BULK_ACTIONS = ("cancel", "forget", "tone", "status")  # what a bulk request may do to many jobs
# Not job ids (a submit naming one is refused): POST /jobs/ACTION acts on many jobs, and every
# other method of /jobs/ACTION is a 405, so that no job could be read or forgotten at that path.
RESERVED_JOB_IDS = BULK_ACTIONS
BULK_KEYS = frozenset({"ids", "filter", "dry_run", "after", "set"})
FILTER_KEYS = frozenset({"tag", "state", "pool", "member"})


def _int(value: object, name: str, lo: int, hi: int) -> int:
    if isinstance(value, float) and value.is_integer():
        value = int(value)  # JSON has one number type: 3.0 is the integer 3 (as JSON Schema says)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ControlError(400, f"{name} must be an integer, not {type(value).__name__}")
    if not lo <= value <= hi:
        raise ControlError(400, f"{name} must be between {lo} and {hi}, not {value}")
    return value


def _bool(value: object, name: str) -> bool:
    if not isinstance(value, bool):
        raise ControlError(400, f"{name} must be true or false, not {type(value).__name__}")
    return value


def _str(value: object, name: str, chars_max: int) -> str:
    if not isinstance(value, str):
        raise ControlError(400, f"{name} must be a string, not {type(value).__name__}")
    if len(value) > chars_max:
        raise ControlError(400, f"{name} is longer than {chars_max} characters")
    if "\x00" in value:
        raise ControlError(400, f"{name} must not contain NUL characters")
    return value


def parse_job_id(value: object) -> str:
    """A job id as a client gives it: 1..128 of [A-Za-z0-9._-]."""
    if not isinstance(value, str) or not JOB_ID_RE.fullmatch(value):
        raise ControlError(
            400,
            f"bad job id {str(value)[:80]!r}: use 1 to {limits.job_id_chars_max} letters, digits, "
            "'.', '_' or '-'",
        )
    return value


def parse_rid(value: object) -> str:
    if not isinstance(value, str) or not RID_RE.fullmatch(value):
        raise ControlError(400, "bad request id: use 1 to 128 of [A-Za-z0-9._:-]")
    return value


FP_RE = re.compile(r"^[0-9a-f]{32}$")


def parse_fp(value: object) -> str | None:
    """A request's fingerprint: what its idempotency key is bound to (method, path, body)."""
    if value is None:
        return None
    if not isinstance(value, str) or not FP_RE.fullmatch(value):
        raise ControlError(400, "bad request fingerprint: 32 lowercase hex characters")
    return value


def parse_argv(value: object) -> list[str]:
    if not isinstance(value, list) or not value:
        raise ControlError(400, "argv must be a non-empty list of strings (the program and its arguments)")
    if len(value) > limits.argv_items_max:
        raise ControlError(400, f"argv has more than {limits.argv_items_max} arguments")
    total = 0
    for i, arg in enumerate(value):
        _str(arg, f"argv[{i}]", limits.argv_bytes_max)
        total += len(arg.encode("utf-8", "surrogatepass"))
    if total > limits.argv_bytes_max:
        raise ControlError(400, f"argv is larger than {limits.argv_bytes_max} bytes")
    if not value[0]:
        raise ControlError(400, "argv[0] (the program) must not be empty")
    return list(value)


def parse_tags(value: object) -> list[str]:
    if not isinstance(value, list):
        raise ControlError(400, "tags must be a list of strings")
    if len(value) > limits.tags_max:
        raise ControlError(400, f"a job has at most {limits.tags_max} tags")
    tags = []
    for i, tag in enumerate(value):
        _str(tag, f"tags[{i}]", limits.tag_chars_max)
        if not tag:
            raise ControlError(400, "a tag must not be empty")
        if tag not in tags:
            tags.append(tag)
    return tags


def parse_env(value: object) -> dict[str, str]:
    if not isinstance(value, dict):
        raise ControlError(400, "env must be an object of NAME: value strings")
    if len(value) > limits.env_items_max:
        raise ControlError(400, f"env has more than {limits.env_items_max} variables")
    total = 0
    for k, v in value.items():
        if (not isinstance(k, str) or not ENV_NAME_RE.fullmatch(k)
                or len(k) > limits.env_name_chars_max):
            raise ControlError(400, f"bad environment variable name {str(k)[:80]!r}")
        _str(v, f"env[{k}]", limits.env_bytes_max)
        total += len(k) + len(v)
    if total > limits.env_bytes_max:
        raise ControlError(400, f"env is larger than {limits.env_bytes_max} bytes")
    return dict(sorted(value.items()))


def parse_identity(value: object, name: str = "by") -> str:
    """The name of an identity (a token's name, "local" or "anonymous")."""
    if not isinstance(value, str) or not IDENTITY_RE.fullmatch(value):
        raise ControlError(400, f"bad {name} {str(value)[:80]!r}: an identity is 1 to "
                                f"{limits.pool_chars_max} letters, digits, '.', '_' or '-'")
    return value


def parse_by(req: dict) -> tuple[str, str]:
    """Who asks for a change (`by`, `by_role`). A request without them comes from a caller
    older than identities: it counts as the member's own (`local`, admin)."""
    if "by" not in req and "by_role" not in req:
        return LOCAL, "admin"
    role = req.get("by_role")
    if role not in ROLES:
        raise ControlError(400, f"bad by_role {str(role)[:40]!r}: use one of {', '.join(ROLES)}")
    return parse_identity(req.get("by")), role


def parse_run_as(value: object) -> list[str]:
    """The users an identity's jobs may run as: user names or ids (parse_user), or "*" (any
    user but root). Normalized as users are, duplicates dropped, order kept (the first is the
    default user of its jobs)."""
    if not isinstance(value, list):
        raise ControlError(400, 'run_as must be a list of users ("alice", "1001", "1001:1001") '
                                'or ["*"]')
    if len(value) > limits.run_as_users_max:
        raise ControlError(400, f"run_as names at most {limits.run_as_users_max} users")
    out: list[str] = []
    for u in value:
        v = "*" if u == "*" else parse_user(u)
        if v not in out:
            out.append(v)
    return out


def parse_submit(body: object, committed: bool = False) -> dict:
    """Validate a submit spec (the JSON body of POST /jobs) and return it normalized.

    The normalized spec has every key with its default; `items` is left as given (the HTTP edge
    turns it into blob digests) but its shape and count are checked here. `committed`: the spec
    may carry the identity keys (SPEC_IDENTITY_KEYS) that only members set, never a client.
    """
    if not isinstance(body, dict):
        raise ControlError(400, "a job spec must be a JSON object with at least \"argv\"")
    unknown = set(body) - (SUBMIT_KEYS | SPEC_IDENTITY_KEYS if committed else SUBMIT_KEYS)
    if unknown:
        raise ControlError(400, f"unknown key(s) in job spec: {', '.join(sorted(map(str, unknown)))[:200]}")
    if "argv" not in body:
        raise ControlError(400, "a job spec needs \"argv\": the program and its arguments")
    spec: dict[str, Any] = {
        "id": None,
        "argv": parse_argv(body["argv"]),
        "pool": "default",
        "priority": 0,
        "retries": 0,
        "runtime_s": None,
        "hold": False,
        "tags": [],
        "env": {},
        "cwd": None,
        "max_leases": None,
    }
    if body.get("id") is not None:
        spec["id"] = parse_job_id(body["id"])
        if spec["id"] in RESERVED_JOB_IDS:
            raise ControlError(400, f"job id {spec['id']!r} is the name of the route /jobs/"
                                    f"{spec['id']} (many jobs at once): choose another id")
    member = None
    if body.get("pool") is not None:
        pool = body["pool"]
        if isinstance(pool, str) and "@" in pool:
            # "pool@member": the short form of a pool and a member selector (placement.py).
            from meshjobs.placement import split_pool
            pool, member = split_pool(pool)
        if not isinstance(pool, str) or not POOL_RE.fullmatch(pool):
            raise ControlError(400, "bad pool name: use letters, digits, '.', '_' or '-'")
        spec["pool"] = pool
    if body.get("priority") is not None:
        spec["priority"] = _int(body["priority"], "priority", -limits.priority_abs_max, limits.priority_abs_max)
    if body.get("retries") is not None:
        spec["retries"] = _int(body["retries"], "retries", 0, limits.retries_max)
    if body.get("runtime_s") is not None:
        rt = body["runtime_s"]
        if isinstance(rt, bool) or not isinstance(rt, (int, float)) or rt != rt:
            raise ControlError(400, "runtime_s must be a number of seconds")
        if not 0 < rt <= limits.runtime_s_max:
            raise ControlError(400, f"runtime_s must be more than 0 and at most {limits.runtime_s_max}")
        spec["runtime_s"] = float(rt)
    if body.get("hold") is not None:
        spec["hold"] = _bool(body["hold"], "hold")
    if body.get("tags") is not None:
        spec["tags"] = parse_tags(body["tags"])
    if body.get("env") is not None:
        spec["env"] = parse_env(body["env"])
    if body.get("cwd") is not None:
        cwd = _str(body["cwd"], "cwd", limits.cwd_chars_max)
        if not cwd.startswith("/"):
            raise ControlError(400, "cwd must be an absolute path")
        spec["cwd"] = cwd
    if body.get("max_leases") is not None:
        spec["max_leases"] = _int(body["max_leases"], "max_leases", 1, limits.max_leases_max)
    if body.get("names") is not None:
        # Only when given, so that a spec committed before names existed stays normalized.
        spec["names"] = parse_names(body["names"])
    # Only when given, as names: a spec committed before these existed stays normalized (and its
    # digest, which decides whether a resubmit is "the same job", stays what it was).
    if body.get("user") is not None:
        spec["user"] = parse_user(body["user"])
    if body.get("inherit_env") is not None and _bool(body["inherit_env"], "inherit_env"):
        spec["inherit_env"] = True
    if body.get("after") is not None:
        after = parse_after(body["after"])
        if spec["id"] is not None and any(a["id"] == spec["id"] for a in after):
            raise ControlError(400, f"job {spec['id']} cannot wait for itself: remove it from after")
        if after:
            # Only when given, so that a spec committed before dependencies stays normalized.
            spec["after"] = after
    if body.get("member") is not None or member is not None:
        spec["member"] = _member(body.get("member"), member)
    if body.get("notify") is not None:
        # Only when given, as user: older specs stay normalized.
        from meshjobs.fleetctl import parse_notify
        spec["notify"] = parse_notify(body["notify"])
    spec.update(parse_rerun_keys(body))
    if committed and body.get("submitted_by") is not None:
        spec["submitted_by"] = parse_identity(body["submitted_by"], "submitted_by")
    if committed and body.get("run_as") is not None:
        spec["run_as"] = parse_run_as(body["run_as"])
    if committed and body.get("running_items_max") is not None:
        spec["running_items_max"] = _int(body["running_items_max"], "running_items_max", 0,
                                         limits.quota_items_max)
    if "items" in body and body["items"] is not None:
        items = body["items"]
        if not isinstance(items, list) or not items:
            raise ControlError(400, "items must be a non-empty list (one entry per item)")
        if len(items) > limits.items_max:
            raise ControlError(413, f"a job has at most {limits.items_max} items")
        for i, item in enumerate(items):
            if isinstance(item, str):
                continue
            if isinstance(item, dict) and len(item) == 1 and (
                isinstance(item.get("b64"), str) or isinstance(item.get("blob"), str)
            ):
                continue
            raise ControlError(
                400, f"items[{i}] must be a string, {{\"b64\": \"...\"}} or {{\"blob\": \"<digest>\"}}"
            )
        spec["items"] = items
    if "names" in spec and len(spec["names"]) != len(spec.get("items") or spec["names"]):
        raise ControlError(400, "names must have one entry per item")
    if spec.get("member") == "*" and "names" in spec:
        raise ControlError(400, "a fan-out job (member *) has one item per member, named by "
                                "its member: drop names (--items-from DIR)")
    if spec.get("member") == "*" and len(spec.get("items") or ()) > 1:
        raise ControlError(400, "a fan-out job (member *) runs once on every member, one item "
                                "each: give at most one item (its stdin goes to every member), "
                                "or name a member or a glob to spread many items")
    return spec


def _member(given: object, from_pool: str | None) -> str:
    """The member selector of a submit: "member", or the member part of "pool@member" (both
    only when they agree). Only in the spec when given, so that a spec committed before
    placement stays normalized."""
    from meshjobs.placement import parse_member
    if given is None:
        return from_pool  # type: ignore[return-value]
    member = parse_member(given)
    if from_pool is not None and from_pool != member:
        raise ControlError(400, f"member {member[:40]!r} and pool@{from_pool[:40]} disagree: "
                                "name the member once")
    return member


def parse_user(value: object) -> str:
    """The user a job's items run as: a user name (POSIX portable characters, not starting with
    '-', not all digits), or "UID" or "UID:GID" (decimal, 0..uid_max). Numbers are normalized
    ("007:0100" is "7:100"), so two spellings of one user are one job spec."""
    hint = (f"give a user name (up to {limits.user_chars_max} of letters, digits, '.', '_' and "
            f"'-', not starting with '-') or a numeric UID or UID:GID (0 to {limits.uid_max})")
    if not isinstance(value, str):
        raise ControlError(400, f"user must be a string: {hint}")
    if len(value) > max(limits.user_chars_max, 2 * len(str(limits.uid_max)) + 1):
        raise ControlError(400, f"user {value[:40]!r}... is too long: {hint}")
    m = USER_IDS_RE.fullmatch(value)
    if m is not None:
        ids = [int(g) for g in m.groups() if g is not None]
        if any(i > limits.uid_max for i in ids):
            raise ControlError(400, f"user {value[:40]!r}: an id is over {limits.uid_max}: {hint}")
        return ":".join(map(str, ids))
    if not USER_NAME_RE.fullmatch(value) or value in (".", ".."):
        raise ControlError(400, f"bad user {value[:40]!r}: {hint}")
    return value


def parse_after(value: object) -> list[dict[str, str]]:
    """The jobs a job waits for: a list of "ID", "ID:COND" or {"id": ID, "on": COND}, COND one of
    DEP_CONDITIONS (default "ok"); normalized to [{"id": ID, "on": COND}, ...] in the order given.
    Each parent at most once."""
    if not isinstance(value, list):
        raise ControlError(400, 'after must be a list of parent jobs: "ID", "ID:ok|end|fail" or '
                                '{"id": "ID", "on": "ok|end|fail"}')
    if len(value) > limits.deps_max:
        raise ControlError(400, f"after names {len(value)} parent jobs; a job waits for at most "
                                f"{limits.deps_max}: chain them, or wait for fewer")
    out: list[dict[str, str]] = []
    seen: set[str] = set()
    for i, dep in enumerate(value):
        if isinstance(dep, str):
            job_id, sep, on = dep.rpartition(":")
            if not sep:
                job_id, on = dep, "ok"
        elif isinstance(dep, dict):
            unknown = set(dep) - {"id", "on"}
            if unknown:
                raise ControlError(400, f"after[{i}]: unknown key(s) "
                                        f"{', '.join(sorted(map(str, unknown)))[:100]}: use id and on")
            job_id, on = dep.get("id"), dep.get("on", "ok")
        else:
            raise ControlError(400, f"after[{i}] must be \"ID[:ok|end|fail]\" or "
                                    f"{{\"id\": ..., \"on\": ...}}, not {type(dep).__name__}")
        if not isinstance(job_id, str) or not JOB_ID_RE.fullmatch(job_id):
            raise ControlError(400, f"after[{i}]: bad job id {str(job_id)[:80]!r}: use 1 to "
                                    f"{limits.job_id_chars_max} letters, digits, '.', '_' or '-'")
        if not isinstance(on, str) or on not in DEP_CONDITIONS:
            raise ControlError(400, f"after[{i}]: unknown condition {str(on)[:40]!r} for job "
                                    f"{job_id}: use ok (it ended done), end (it ended) or fail "
                                    "(it ended failed or cancelled)")
        if job_id in seen:
            raise ControlError(400, f"after names job {job_id} twice: name each parent once")
        seen.add(job_id)
        out.append({"id": job_id, "on": on})
    return out


def parse_names(value: object) -> list[str]:
    """Item names (the input files' names of `--items-from DIR`): file names, one per item."""
    if not isinstance(value, list) or not value or len(value) > limits.items_max:
        raise ControlError(400, f"names must be a non-empty list of at most {limits.items_max} "
                                "file names, one per item")
    for i, name in enumerate(value):
        _str(name, f"names[{i}]", limits.item_name_chars_max)
        try:
            name.encode("utf-8")
        except UnicodeEncodeError:
            raise ControlError(400, f"names[{i}] is not valid Unicode text") from None
        if (not name or name in (".", "..") or "/" in name
                or any(ord(c) < 0x20 or ord(c) == 0x7F for c in name)):
            raise ControlError(400, f"names[{i}] must be a file name: not empty, not . or .., "
                                    "no '/' and no control characters")
    return list(value)


def parse_tone(body: object) -> dict:
    """Validate a tone request: priority, hold and/or max_leases (null clears the limit)."""
    if not isinstance(body, dict):
        raise ControlError(400, "a tone request must be a JSON object")
    unknown = set(body) - TONE_KEYS
    if unknown:
        raise ControlError(400, f"unknown key(s) in tone request: {', '.join(sorted(map(str, unknown)))[:200]}")
    if not body:
        raise ControlError(400, "nothing to change: give priority, hold or max_leases")
    out: dict[str, Any] = {}
    if "priority" in body:
        out["priority"] = _int(body["priority"], "priority", -limits.priority_abs_max, limits.priority_abs_max)
    if "hold" in body:
        out["hold"] = _bool(body["hold"], "hold")
    if "max_leases" in body:
        ml = body["max_leases"]
        out["max_leases"] = None if ml is None else _int(ml, "max_leases", 1, limits.max_leases_max)
    return out


# Reads of a job's items answered from the table's item arrays, without a record of every item
# (node/reads.py): one item, a page of them, a slice of their output digests.
READ_ITEM_OPS = ("item", "items", "outputs")


def parse_item_read(req: dict) -> dict:
    """{"op": "item", "id", "index"}: item `index`'s record. {"op": "items", "id", "from",
    "limit", "failed"}: the job's record with the records of items from..from+limit-1 and of its
    first `failed` failed items. {"op": "outputs", "id", "stream", "from", "limit"}: the
    digests of `stream` (stdout or stderr) of items from..from+limit-1."""
    op = req["op"]
    job_id = parse_job_id(req.get("id"))
    if op == "item":
        return {"op": "item", "id": job_id,
                "index": _int(req.get("index"), "index", 0, limits.items_max - 1)}
    if op == "items":
        return {"op": "items", "id": job_id,
                "from": _int(req.get("from", 0), "from", 0, limits.items_max),
                "limit": _int(req.get("limit"), "limit", 1, limits.items_page_max),
                "failed": _int(req.get("failed", 0), "failed", 0, limits.items_page_max)}
    stream = req.get("stream")
    if stream not in ("stdout", "stderr"):
        raise ControlError(400, f"stream must be stdout or stderr, not {str(stream)[:40]!r}")
    return {"op": "outputs", "id": job_id, "stream": stream,
            "from": _int(req.get("from", 0), "from", 0, limits.items_max),
            "limit": _int(req.get("limit"), "limit", 1, limits.results_slice_max)}


def parse_request(req: object) -> dict:
    """Validate a whole control request (as it reaches the node, locally or forwarded). A
    change keeps who asks for it (`by`, `by_role`, parse_by)."""
    if not isinstance(req, dict):
        raise ControlError(400, "a control request must be an object")
    out = _parse_request(req)
    if out["op"] in CHANGE_OPS and "rid" in out:
        out["by"], out["by_role"] = parse_by(req)
        if out["op"] == "submit":
            out["spec"]["submitted_by"] = out["by"]
            # Only the leader sets it, from the quota (node/core.py), never a request's spec.
            out["spec"].pop("running_items_max", None)
            if "quota" in req:
                out["quota"] = parse_quota(req["quota"])
        elif out["op"] == "cron" and out["action"] == "add":
            out["job"]["submitted_by"] = out["by"]  # the schedule's owner, its runs' submitter
            if "quota" in req:
                out["quota"] = parse_quota(req["quota"])
    return out


QUOTA_KEYS = ("pending_items_max", "running_items_max", "schedules_max")


def parse_quota(value: object) -> dict[str, int]:
    """The caller's limits a change request carries (config.Quota.as_request)."""
    if not isinstance(value, dict) or not set(value) <= set(QUOTA_KEYS):
        raise ControlError(400, f"quota must be an object with keys {', '.join(QUOTA_KEYS)}")
    return {k: _int(v, k, 0, limits.quota_items_max) for k, v in value.items()}


def _parse_request(req: dict) -> dict:
    op = req.get("op")
    if op == "submit":
        spec = req.get("spec")
        if not isinstance(spec, dict):
            raise ControlError(400, "submit needs a spec")
        spec = parse_submit({k: v for k, v in spec.items() if k != "items"}, committed=True)
        check_restart_delay(spec)
        items = req.get("items")
        if not isinstance(items, list) or not items or len(items) > limits.items_max:
            raise ControlError(400, "submit needs a non-empty list of item digests")
        for d in items:
            if d is not None and not is_digest(d):
                raise ControlError(400, "an item's stdin must be a blob digest or null")
        if "names" in spec and len(spec["names"]) != len(items):
            raise ControlError(400, "names must have one entry per item")
        if spec.get("member") == "*" and len(items) > 1:
            raise ControlError(400, "a fan-out job (member *) has one item per member: give at "
                                    "most one item")
        return {"op": "submit", "rid": parse_rid(req.get("rid")), "fp": parse_fp(req.get("fp")),
                "spec": spec, "items": list(items)}
    if op in ("cancel", "forget"):
        return {"op": op, "rid": parse_rid(req.get("rid")), "fp": parse_fp(req.get("fp")),
                "id": parse_job_id(req.get("id"))}
    if op == "tone":
        fields = {k: req[k] for k in TONE_KEYS if k in req}
        return {"op": "tone", "rid": parse_rid(req.get("rid")), "fp": parse_fp(req.get("fp")),
                "id": parse_job_id(req.get("id")), **parse_tone(fields)}
    if op == "rerun":
        return {"op": "rerun", "rid": parse_rid(req.get("rid")), "fp": parse_fp(req.get("fp")),
                "id": parse_job_id(req.get("id")),
                **parse_rerun({k: req[k] for k in RERUN_KEYS if k in req})}
    if op == "get":
        wait_ms = req.get("wait_ms", 0)
        since = req.get("since")
        return {"op": "get", "id": parse_job_id(req.get("id")), "items": bool(req.get("items")),
                "wait_ms": _int(wait_ms, "wait_ms", 0, limits.http_wait_s_max * 1000),
                "since": None if since is None else _int(since, "since", 0, limits.version_max),
                # The HTTP edge builds the item records from a copy (table.ItemRows).
                **({"copy_items": True} if req.get("copy_items") is True else {})}
    if op in READ_ITEM_OPS:
        return parse_item_read(req)
    if op == "changes":
        return parse_changes(req)
    if op == "list":
        state = req.get("state")
        if state is not None and state not in JOB_STATES:
            raise ControlError(400, f"unknown state {str(state)[:40]!r}: use one of {', '.join(JOB_STATES)}")
        tag = req.get("tag")
        if tag is not None:
            _str(tag, "tag", limits.tag_chars_max)
        out: dict[str, Any] = {"op": "list", "state": state, "tag": tag}
        pool = req.get("pool")
        if pool is not None:
            out["pool"] = parse_pool(pool)
        # A page, newest first: at most `limit` jobs submitted before the job `after` names
        # (a cursor is the submit seq of the last job of the page before, opaque to clients).
        if req.get("limit") is not None:
            out["limit"] = _int(req.get("limit"), "limit", 1, limits.jobs_list_max)
        if req.get("after") is not None:
            out["after"] = parse_cursor(req.get("after"))
        return out
    if op == "bulk":
        rid = {} if req.get("action") == "status" else {
            "rid": parse_rid(req.get("rid")), "fp": parse_fp(req.get("fp"))}
        return {"op": "bulk", **rid, **parse_bulk(req.get("action"),
                                                  {k: v for k, v in req.items() if k in BULK_KEYS})}
    if op in ("fleet", "health", "metrics"):
        return {"op": op}
    if op in ("pool", "member", "pools"):
        from meshjobs.fleetctl import parse_ctl
        return parse_ctl(req)
    if op == "cron":
        from meshjobs import cron  # here: meshjobs.cron builds on this module

        return cron.parse_request(req)
    raise ControlError(400, f"unknown control op {str(op)[:40]!r}")


def parse_version(value: str, name: str = "since") -> int:
    """A job version a client names in a query (since=, Last-Event-ID): a decimal integer."""
    if (not value or len(value) > len(str(limits.version_max)) or not value.isascii()
            or not value.isdigit() or int(value) > limits.version_max):
        raise ControlError(400, f"{name} must be a version: a whole number from 0 to "
                                f"{limits.version_max} (a job's \"version\", or the id of the last "
                                f"event seen), not {value[:40]!r}")
    return int(value)


def parse_changes(req: dict) -> dict:
    """The node's "changes" op: the committed changes after version `since` (None: none, only
    the current version), waiting up to `wait_ms` for one, for jobs that pass every filter
    given (job ids, tags, states, pools; a job passes a filter when it matches any value)."""
    since = req.get("since")
    out: dict[str, Any] = {
        "op": "changes",
        "since": None if since is None else _int(since, "since", 0, limits.version_max),
        "wait_ms": _int(req.get("wait_ms", 0), "wait_ms", 0, limits.http_wait_s_max * 1000),
    }
    checks = {"jobs": parse_job_id, "tags": lambda v: _str(v, "tag", limits.tag_chars_max),
              "states": _state, "pools": parse_pool}
    for name, check in checks.items():
        values = req.get(name)
        if values is None:
            out[name] = None
            continue
        if not isinstance(values, list) or not values:
            raise ControlError(400, f"{name} must be a non-empty list")
        if len(values) > limits.events_filter_values_max:
            raise ControlError(400, f"at most {limits.events_filter_values_max} {name} in one "
                                    "filter")
        out[name] = frozenset(check(v) for v in values)
    return out


def _state(value: object) -> str:
    if value not in JOB_STATES:
        raise ControlError(400, f"unknown state {str(value)[:40]!r}: use one of "
                                f"{', '.join(JOB_STATES)}")
    return str(value)


def parse_pool(value: object) -> str:
    """A pool name as a filter or in a spec: letters, digits, '.', '_' or '-'."""
    if not isinstance(value, str) or not POOL_RE.fullmatch(value):
        raise ControlError(400, f"bad pool name {str(value)[:40]!r}: use 1 to "
                                f"{limits.pool_chars_max} letters, digits, '.', '_' or '-'")
    return value


def parse_cursor(value: object) -> int:
    """A paging cursor of the job list: the decimal submit seq of the last job shown."""
    if (not isinstance(value, str) or not value or len(value) > limits.jobs_cursor_chars_max
            or not value.isascii() or not value.isdigit()):
        raise ControlError(400, "after must be a cursor from a previous page (its X-Meshjobs-Next "
                                "header, or the hint of `meshctl jobs`); start again without it")
    return int(value)


def parse_bulk(action: object, body: object) -> dict:
    """A request for many jobs at once (the JSON body of POST /jobs/cancel, /jobs/forget,
    /jobs/tone and /jobs/status): either `ids` (a list of job ids) or `filter` (tag, state,
    pool and/or member, all of which a job must match), never both; `dry_run` (changes only)
    answers what would change and changes nothing; `set` (tone only) holds the tone fields;
    `after` is the cursor of a filter's next page."""
    if action not in BULK_ACTIONS:
        raise ControlError(400, f"unknown bulk action {str(action)[:40]!r}: use one of "
                                f"{', '.join(BULK_ACTIONS)}")
    if not isinstance(body, dict):
        raise ControlError(400, 'a bulk request must be a JSON object: {"ids": [...]} or '
                                '{"filter": {"tag": ..., "state": ..., "pool": ..., "member": ...}}')
    allowed = BULK_KEYS - ({"set"} if action != "tone" else set()) - (
        {"dry_run"} if action == "status" else set())
    unknown = set(body) - allowed
    if unknown:
        raise ControlError(400, f"unknown key(s) in bulk {action} request: "
                                f"{', '.join(sorted(map(str, unknown)))[:200]}; use "
                                f"{', '.join(sorted(allowed))}")
    has_ids, has_filter = body.get("ids") is not None, body.get("filter") is not None
    if has_ids == has_filter:
        raise ControlError(400, 'give either "ids" (a list of job ids) or "filter" (tag, state, '
                                "pool, member), not both and not neither")
    out: dict[str, Any] = {"action": action, "dry_run": False}
    if action != "status" and body.get("dry_run") is not None:
        out["dry_run"] = _bool(body["dry_run"], "dry_run")
    if has_ids:
        ids = body["ids"]
        if not isinstance(ids, list) or not ids:
            raise ControlError(400, "ids must be a non-empty list of job ids")
        if len(ids) > limits.bulk_jobs_max:
            raise ControlError(400, f"at most {limits.bulk_jobs_max} ids in one request (not "
                                    f"{len(ids)}): split them, or use a filter")
        out["ids"] = list(dict.fromkeys(parse_job_id(i) for i in ids))
        if body.get("after") is not None:
            raise ControlError(400, "after pages a filter's matches; a list of ids has no pages")
    else:
        out["filter"] = parse_filter(body["filter"])
        if body.get("after") is not None:
            out["after"] = parse_cursor(body["after"])
    if action == "tone":
        if body.get("set") is None:
            raise ControlError(400, 'a bulk tone needs "set": {"priority", "hold" and/or '
                                    '"max_leases"}')
        out["set"] = parse_tone(body["set"])
    return out


def parse_filter(value: object) -> dict:
    """A bulk filter: at least one of tag, state, pool and member (a job matches when it has
    the tag, is in the state, is of the pool and has an item that ran or runs on the member)."""
    if not isinstance(value, dict) or not value:
        raise ControlError(400, "filter must be an object with at least one of tag, state, pool, "
                                "member")
    unknown = set(value) - FILTER_KEYS
    if unknown:
        raise ControlError(400, f"unknown filter key(s): {', '.join(sorted(map(str, unknown)))[:200]}"
                                "; use tag, state, pool or member")
    out: dict[str, str] = {}
    if value.get("tag") is not None:
        tag = _str(value["tag"], "tag", limits.tag_chars_max)
        if not tag:
            raise ControlError(400, "a tag must not be empty")
        out["tag"] = tag
    if value.get("state") is not None:
        out["state"] = _state(value["state"])
    if value.get("pool") is not None:
        out["pool"] = parse_pool(value["pool"])
    if value.get("member") is not None:
        member = value["member"]
        if not isinstance(member, str) or not POOL_RE.fullmatch(member):
            raise ControlError(400, f"bad member name {str(member)[:40]!r}: use letters, digits, "
                                    "'.', '_' or '-'")
        out["member"] = member
    if not out:
        raise ControlError(400, "filter must name at least one of tag, state, pool, member")
    return out


# --- Re-running finished jobs ------------------------------------------------------------------

RERUN_KEYS = frozenset({"failed_only"})
OUTPUT_INDEX = "{index}"  # in a --stdout/--stderr path: the item's index


def parse_rerun(body: object) -> dict:
    """A rerun request (the JSON body of POST /jobs/{id}/rerun, may be empty):
    {"failed_only": bool}."""
    if body is None:
        body = {}
    if not isinstance(body, dict):
        raise ControlError(400, 'a rerun request must be a JSON object: {"failed_only": true|false} '
                                "or {}")
    unknown = set(body) - RERUN_KEYS
    if unknown:
        raise ControlError(400, f"unknown key(s) in rerun request: "
                                f"{', '.join(sorted(map(str, unknown)))[:200]}; use failed_only")
    failed_only = body.get("failed_only")
    return {"failed_only": False if failed_only is None else _bool(failed_only, "failed_only")}


def parse_output_path(value: object, name: str) -> str:
    """A path an item's stdout or stderr is also written to: absolute, or relative to the job's
    cwd; `{index}` in it is the item's index. No NUL, no '..' component."""
    path = _str(value, name, limits.output_path_chars_max)
    if not path or path.endswith("/"):
        raise ControlError(400, f"{name} must be a file path (not empty, not ending in '/'); "
                                f"{OUTPUT_INDEX} in it is the item's index")
    if any(part == ".." for part in path.split("/")):
        raise ControlError(400, f"{name} must not contain a '..' component: give an absolute "
                                "path, or one under the job's cwd")
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in path):
        raise ControlError(400, f"{name} must not contain control characters")
    rest = path.replace(OUTPUT_INDEX, "")
    if "{" in rest or "}" in rest:
        raise ControlError(400, f"{name}: the only placeholder is {OUTPUT_INDEX} (the item's "
                                "index); remove other braces")
    return path


def check_restart_delay(spec: dict) -> None:
    """A new submit's restart delay is at least `limits.restart_delay_s_min` (reruns.py Rule
    6). Checked on a request, not in parse_submit: a spec committed before the minimum existed
    stays valid in the journal (the table waits the minimum for it)."""
    delay = spec.get("restart_delay_s")
    if delay is not None and delay < limits.restart_delay_s_min:
        raise ControlError(400, f"restart_delay_s must be at least {limits.restart_delay_s_min} "
                                f"second(s) (restart_delay_s_min), not {delay:g}: give "
                                f"{limits.restart_delay_s_min} or more, or leave it out (the "
                                "minimum is the default); a job re-runs at most "
                                f"{limits.restarts_per_minute_max} times a minute "
                                "(restarts_per_minute_max)")


def parse_rerun_keys(body: dict) -> dict:
    """The submit keys of automatic re-runs and output paths, normalized; only those given (so
    that a spec committed before they existed stays normalized, and its digest the same).

    restart: N (1..restart_max) or "forever": run the job again each time it ends done.
    restart_delay_s: seconds to wait before each automatic re-run (restart or resubmit).
    resubmit: N (1..resubmit_max): run the whole job again when it ends done or failed (the
    seed's resubmit: back to the fleet, placed afresh), up to N times.
    stdout, stderr: paths (see parse_output_path)."""
    out: dict[str, Any] = {}
    restart = body.get("restart")
    if restart is not None:
        if restart != "forever":
            if isinstance(restart, bool) or not isinstance(restart, int):
                raise ControlError(400, f'restart must be a number of re-runs (1 to '
                                        f'{limits.restart_max}) or "forever", not '
                                        f"{str(restart)[:40]!r}")
            restart = _int(restart, "restart", 1, limits.restart_max)
        out["restart"] = restart
    resubmit = body.get("resubmit")
    if resubmit is not None:
        out["resubmit"] = _int(resubmit, "resubmit", 1, limits.resubmit_max)
    delay = body.get("restart_delay_s")
    if delay is not None:
        if isinstance(delay, bool) or not isinstance(delay, (int, float)) or delay != delay:
            raise ControlError(400, "restart_delay_s must be a number of seconds")
        if not 0 <= delay <= limits.restart_delay_s_max:
            raise ControlError(400, f"restart_delay_s must be from 0 to "
                                    f"{limits.restart_delay_s_max} seconds")
        if not out:
            raise ControlError(400, "restart_delay_s is the wait before an automatic re-run: "
                                    "give restart or resubmit with it")
        out["restart_delay_s"] = float(delay)
    for name in ("stdout", "stderr"):
        if body.get(name) is not None:
            out[name] = parse_output_path(body[name], name)
    return out
