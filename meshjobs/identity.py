"""Identities: who submitted a job, who may change it, as whom its items may run, who may see
its secrets.

Theory of operation. Every request to the HTTP edge has a caller (meshjobs/auth.py `Caller`):
a token's name and role, `anonymous` (no token, with allow_anonymous) or `local` (a member
without [auth]). The edge stamps every change with `by` and `by_role` (control.parse_by), and
a submit's committed spec with `submitted_by` and, for a token, `run_as` (the users its jobs
may run as). Nothing here does IO: whether a user is root on this machine is asked of a
function handed in (meshjobs/runas.py `is_root` at the edges).

Rule 1: a caller may change a job (cancel, tone, rerun, forget) or a schedule iff its role is
        admin or it is the job's submitter (the schedule's owner). The leader decides, against
        its committed table, so that the answer is the same through every member.
Rule 2: run_as. An identity with no run_as (`local`) runs its jobs as any user, as it names.
        Otherwise a job's `user` must be one of the entries, or any non-root user when "*" is
        one; root (a user whose uid or primary gid is 0 here) only with an explicit "root" or
        "0" entry. The first entry is the default user of a job that names none ("*" first:
        no default, the pool's or the member's item user). A pool's user is held to the same
        rule where the item runs (the spec carries run_as).
Rule 3: env values and the notify URL are secrets of the job's submitter: any other identity
        but an admin sees the env keys with redacted values and the notify redacted, on every
        read (`redact`, applied at the HTTP edge to every job record it answers with).
Rule 4: inherit_env. A job that starts from meshd's environment (the spec's `inherit_env`)
        reads what meshd was started with: only an admin (or `local`) may submit one
        (`inherit_env_refusal`, at the HTTP edge, for submits and schedules alike). Even then
        the item never gets meshd's own secrets (meshjobs/itemenv.py `MESHD_SECRETS`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from meshjobs.control import ControlError

ANY = "*"  # run_as: any user but root
ROOT_ENTRIES = frozenset({"root", "0", "0:0"})  # run_as entries that allow root
REDACTED = "<redacted>"


def default_run_as(role: str) -> tuple[str, ...]:
    """The users a token (or the anonymous caller) of `role` may run its jobs as when the
    config names none: any but root for admin, none for the others."""
    return (ANY,) if role == "admin" else ()


def inherit_env_refusal(spec: dict, role: str) -> str | None:
    """Rule 4: why a caller of `role` may not submit `spec` (None: it may)."""
    if not spec.get("inherit_env") or role == "admin":
        return None
    return ("inherit_env gives the job's items meshd's whole environment, which only an admin "
            "may ask for: pass the variables the job needs with --env K=V (or ask an admin to "
            "add them to [items] env_pass)")


def may_change(by: str, by_role: str, owner: str) -> bool:
    """Rule 1."""
    return by_role == "admin" or by == owner


def not_owner(what: str, owner: str, by: str) -> dict:
    """The outcome of a change refused by Rule 1 (403, naming the owner)."""
    return {"ok": False, "status": 403,
            "error": f"{what} belongs to {owner}; {by} may change only its own jobs and "
                     f"schedules: ask {owner} or an admin"}


def may_see(viewer: str, viewer_role: str, owner: str) -> bool:
    """Rule 3: whether `viewer` sees the secrets of a job submitted by `owner`."""
    return viewer_role == "admin" or viewer == owner


def user_allowed(run_as: list[str] | tuple[str, ...], user: str,
                 is_root: Callable[[str], bool]) -> bool:
    """Rule 2: whether a job whose submitter may run as `run_as` may run as `user`."""
    if is_root(user):
        return any(e in ROOT_ENTRIES for e in run_as)
    return user in run_as or ANY in run_as


def allowed_text(run_as: list[str] | tuple[str, ...]) -> str:
    if not run_as:
        return "none (its jobs run as the member's item user: submit without user)"
    return ", ".join("any user but root" if e == ANY else e for e in run_as)


def job_user(caller_name: str, run_as: tuple[str, ...] | None, user: str | None,
             is_root: Callable[[str], bool]) -> str | None:
    """The user a submit's committed spec names: the one asked for, or the identity's default
    (run_as[0]); raises ControlError(403) when the identity may not run as it (Rule 2)."""
    if run_as is None:
        return user
    if user is None:
        if not run_as or run_as[0] == ANY:
            return None
        user = run_as[0]
        if not user_allowed(run_as, user, is_root):
            raise ControlError(403, f"{caller_name}'s default user {user!r} (its run_as[0]) is "
                                    "root on this member, and its run_as has no \"root\" entry: "
                                    "ask the operator to fix [auth] tokens run_as")
        return user
    if not user_allowed(run_as, user, is_root):
        root = " (root on this member: it needs an explicit \"root\" entry)" if is_root(user) else ""
        raise ControlError(403, f"{caller_name} may not run jobs as user {user!r}{root}; it may "
                                f"run as: {allowed_text(run_as)}. Submit with one of those, or "
                                "ask the operator to add the user to the token's run_as")
    return user


def redact_body(body: Any, viewer: str, viewer_role: str) -> Any:
    """An answer's body as `viewer` may see it (Rule 3): a job record, a list of them, a page
    ({"jobs": [...]}), a bulk status ({"results": [{"job": record}]}) or history
    ({"records": [{"job": record}]}); anything else as it is."""
    if viewer_role == "admin":
        return body
    if isinstance(body, list):
        return [redact_body(b, viewer, viewer_role) for b in body]
    if not isinstance(body, dict):
        return body
    if "id" in body and "submitted_by" in body:
        return redact(body, viewer, viewer_role)
    out = dict(body)
    for key in ("jobs", "results", "records", "entries"):
        if isinstance(body.get(key), list):
            out[key] = [redact_body(r, viewer, viewer_role) for r in body[key]]
    if isinstance(body.get("job"), dict):
        out["job"] = redact(body["job"], viewer, viewer_role)
    return out


def redact(record: Any, viewer: str, viewer_role: str) -> Any:
    """A job record (or a list of them, or a history row {"job": record}) as `viewer` may see
    it (Rule 3): the same object when it may see everything, else a copy with every env value
    and the notify URL replaced by REDACTED."""
    if isinstance(record, list):
        return [redact(r, viewer, viewer_role) for r in record]
    if not isinstance(record, dict):
        return record
    if viewer_role == "admin":
        return record
    if "job" in record and isinstance(record["job"], dict) and "id" not in record:
        job = redact(record["job"], viewer, viewer_role)
        return record if job is record["job"] else {**record, "job": job}
    if "id" not in record or may_see(viewer, viewer_role, str(record.get("submitted_by"))):
        return record
    out = dict(record)
    env = record.get("env")
    if isinstance(env, dict):
        out["env"] = dict.fromkeys(env, REDACTED)
    if out.get("notify") is not None:
        out["notify"] = REDACTED
    past = record.get("past")
    if isinstance(past, list):
        out["past"] = [redact(p, viewer, viewer_role) if isinstance(p, dict) and "id" in p else p
                       for p in past]
    return out
