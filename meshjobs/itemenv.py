"""The environment an item starts with: a few of meshd's variables by name, never all of them.

meshd's environment may hold secrets (a token, cloud keys, a database URL) that items have no
business seeing, and an item is any program anyone who can submit a job chooses. So an item
starts from an empty environment and gets:

1. the variables of meshd's environment named by `[items] env_pass` (default `DEFAULT_PASS`); a
   name ending in `*` passes every variable it is a prefix of (`LC_*`);
2. PATH: meshd's when passed, else `DEFAULT_PATH` (items are usually named by program name, and
   the program is looked up in the item's own PATH);
3. the job's own `env`, then MESH_JOB_ID, MESH_ITEM_INDEX and MESH_LEASE_EPOCH (the driver and the
   python worker add those).

The default list, and why each is there:
- PATH: to find programs named without a folder.
- HOME, USER, LOGNAME: who the item runs as; many tools (git, pip, ssh, shells) need HOME.
- LANG, LC_*: the locale, so text and its encoding are what the operator set for meshd.
- TZ: the time zone local times are shown in.
- TMPDIR: where temporary files go, when the operator moved them for meshd.
SHELL, TERM and the like are left out: items are started directly, not through a shell, and have
no terminal. Anything else an item needs goes in the job's `env`, or in `env_pass` for the fleet.
meshd's own secrets (`MESHD_SECRETS`) never pass, whatever env_pass or inherit_env say.

Two things change this, both per job (meshjobs.driver): `inherit_env` starts the item from meshd's
whole environment instead (docs/security.md says what that risks; only an admin may ask for
it, meshjobs/identity.py Rule 4), and a job that runs as another
user (`user`) gets that user's HOME, USER and LOGNAME instead of meshd's (meshjobs.runas).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

# Variables of meshd's own that no item gets, not even with `inherit_env` or `env_pass`: the token
# meshd's own meshctl calls carry, and where it is read from.
MESHD_SECRETS: frozenset[str] = frozenset({"MESHJOBS_TOKEN", "MESHJOBS_TOKEN_FILE"})

DEFAULT_PASS: tuple[str, ...] = ("PATH", "HOME", "USER", "LOGNAME", "LANG", "LC_*", "TZ", "TMPDIR")
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# A variable name, or a prefix of names followed by "*" (at least one character before it: a bare
# "*" would pass everything again).
PASS_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*\*?$")


def base_env(environ: Mapping[str, str], passed: Iterable[str] = DEFAULT_PASS) -> dict[str, str]:
    """What an item gets of `environ` (meshd's environment): the variables `passed` names, and
    PATH always (DEFAULT_PATH when it is not passed or not set)."""
    names = list(passed)
    exact = {n for n in names if not n.endswith("*")}
    prefixes = tuple(n[:-1] for n in names if n.endswith("*"))
    env = {k: v for k, v in environ.items() if k not in MESHD_SECRETS
           and (k in exact or (prefixes and k.startswith(prefixes)))}
    env.setdefault("PATH", DEFAULT_PATH)
    return env


def inherited_env(environ: Mapping[str, str]) -> dict[str, str]:
    """What an item of a job with `inherit_env` gets: meshd's environment but its secrets."""
    return {k: v for k, v in environ.items() if k not in MESHD_SECRETS}
