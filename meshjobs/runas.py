"""Who an item runs as: a job's `user` (or its pool's default) resolved on the member that runs it.

A job names its user as text that `control.parse_user` checked ("name", "uid" or "uid:gid"); what
that text means is up to the user database of the member that runs the item, so it is resolved
there, when the item starts, never when the job is submitted or committed.

Rules:
1. A name gets that user's uid, primary gid and supplementary groups (getgrouplist). A numeric
   "uid:gid" gets exactly those ids and no supplementary groups. A bare numeric "uid" takes its
   primary gid from the user database, and is refused when the uid has no entry there (rather
   than run with some group nobody chose).
2. A member switches users only when it may: it holds CAP_SETUID and CAP_SETGID (root does,
   unless its capabilities were dropped). A member that may not still runs items that ask for
   its own uid and gid; any other user is refused, with a message that says what to do.
3. An item that runs as a user sees that user's HOME, USER and LOGNAME (from the user database),
   never meshd's own: a uid with no entry there gets none of the three.
4. Every refusal is a `RunAsError` whose message names the user and the member: the driver turns
   it into the item's error, the HTTP edge into a 400 when it can tell at submit.
"""

from __future__ import annotations

import os
import pwd
from dataclasses import dataclass

from meshjobs.control import USER_IDS_RE

CAP_SETGID = 6  # capabilities(7)
CAP_SETUID = 7
IDENTITY_VARS = ("HOME", "USER", "LOGNAME")


class RunAsError(Exception):
    """A user an item cannot run as on this member; the message says why and what to do."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


@dataclass(frozen=True)
class Identity:
    """A resolved user: the ids a process runs with, and what its environment says it is."""

    uid: int
    gid: int
    groups: tuple[int, ...]  # the supplementary groups
    name: str | None  # None: a uid with no entry in the user database
    home: str | None

    def env(self) -> dict[str, str]:
        """HOME, USER and LOGNAME of this user (those it has)."""
        out = {}
        if self.home is not None:
            out["HOME"] = self.home
        if self.name is not None:
            out["USER"] = out["LOGNAME"] = self.name
        return out


def resolve(user: str, member: str) -> Identity:
    """The ids of `user` (as control.parse_user normalized it) on this machine."""
    m = USER_IDS_RE.fullmatch(user)
    if m is not None:
        uid = int(m.group(1))
        try:
            entry: pwd.struct_passwd | None = pwd.getpwuid(uid)
        except KeyError:
            entry = None
        if m.group(2) is not None:
            gid = int(m.group(2))
        elif entry is not None:
            gid = entry.pw_gid
        else:
            raise RunAsError(f"uid {uid} has no entry in the user database of member {member}, "
                             f"so its group is unknown: give it (--user {uid}:GID), or create "
                             f"the user there")
        return Identity(uid, gid, (), entry.pw_name if entry else None,
                        entry.pw_dir if entry else None)
    try:
        entry = pwd.getpwnam(user)
    except KeyError:
        raise RunAsError(f"no user {user!r} on member {member}: create it there, or submit with "
                         "another --user (a numeric UID:GID needs no entry)") from None
    try:
        groups = tuple(os.getgrouplist(entry.pw_name, entry.pw_gid))
    except OSError as e:  # the group database could not be read
        raise RunAsError(f"the groups of user {user!r} could not be read on member {member} "
                         f"({e.strerror or e}): check its group database (/etc/group, NSS)") from e
    return Identity(entry.pw_uid, entry.pw_gid, groups, entry.pw_name, entry.pw_dir)


def can_switch_user(status_path: str = "/proc/self/status") -> bool:
    """Whether this process may run children as other users: CAP_SETUID and CAP_SETGID are in
    its effective set (root has them unless they were dropped). Without /proc: euid 0."""
    try:
        with open(status_path) as f:
            for line in f:
                if line.startswith("CapEff:"):
                    caps = int(line.split()[1], 16)
                    return bool(caps >> CAP_SETUID & 1) and bool(caps >> CAP_SETGID & 1)
    except (OSError, ValueError, IndexError):
        pass
    return os.geteuid() == 0


def refusal(user: str, ident: Identity, member: str, may_switch: bool, euid: int,
            egid: int) -> str | None:
    """Why this member cannot run an item as `user` (resolved as `ident`), or None if it can.
    A member that may not switch users runs items as its own uid and gid only."""
    if may_switch or (ident.uid == euid and ident.gid == egid):
        return None
    who = (f"runs as uid {euid}, not root" if euid != 0
           else "runs as root without the CAP_SETUID and CAP_SETGID capabilities")
    return (f"member {member} {who}: it cannot run items as user {user!r}; start meshd as root "
            f"there to run items as other users, or submit without --user (items then run as "
            f"uid {euid}, gid {egid})")


def is_root(user: str) -> bool:
    """Whether `user` (as control.parse_user normalized it) is root on this machine: its uid
    or its primary gid is 0 ("root", "0", "0:0", "65534:0", or a name whose entry says so).
    A name or uid this machine does not know is not (an item cannot run as it here)."""
    if user == "root":
        return True
    m = USER_IDS_RE.fullmatch(user)
    try:
        if m is not None:
            uid = int(m.group(1))
            if uid == 0 or (m.group(2) is not None and int(m.group(2)) == 0):
                return True
            return m.group(2) is None and pwd.getpwuid(uid).pw_gid == 0
        entry = pwd.getpwnam(user)
    except KeyError:
        return False
    return entry.pw_uid == 0 or entry.pw_gid == 0
