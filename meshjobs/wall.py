"""The kernel wall around items: Landlock rules that keep an item out of meshd's files, and the
launcher that puts an item's program behind them.

Theory of operation. An item is someone else's code. When meshd cannot give it another uid (a
non-root container, a plain `meshd` on a laptop) the item runs as meshd's own user and could
read everything meshd can: the data folder (fleet secret, journal, dumps, blob store,
history), the TLS key, token files. Landlock (Linux 5.13+) lets an unprivileged process take
away its own access to the filesystem, for itself and everything it starts, for good.

Landlock is an allow-list: once a ruleset handles an access right, that right is allowed only
beneath the paths a rule names. A rule on a folder covers everything beneath it, so a denied
path can only be carved out by naming everything around it. `rules(denied)` therefore:

Rule 1. Resolves every denied path (symlinks followed, `realpath`), drops those that do not
   exist, and those beneath another denied path (already covered).
Rule 2. Takes the *spine*: every folder that is an ancestor of a denied path. Every entry of a
   spine folder that is neither on the spine nor denied is allowed in full (every handled
   right): the rest of the filesystem. Nothing beneath a denied path is allowed.
Rule 3. A spine folder itself gets no rule (a right on it would reach the denied path beneath
   it): an item may walk through it, stat and use what is in it, but not list it nor create,
   rename or remove entries directly in it (Landlock does not restrict lookups or stat). Give
   items a folder of their own rather than the folder that holds meshd's data folder.
Rule 4. Symbolic links among the entries get no rule: a rule is taken on what a path opens to,
   and a link to the data folder would otherwise allow it. A link's target is reachable when
   the target is allowed by its own path.
Rule 5. The result is a pure function of the tree as it is now; `Rules.stamp` (the spine
   folders' change times) tells when it must be computed again (an entry added or removed).
Rule 6. The allowed paths are the launcher's arguments, so they are bounded
   (limits.wall_rules_bytes_max): past it the rules allow nothing, `Rules.too_many` says how
   many entries there were, and `Rules.check` refuses to start an item (fail closed, with what
   to do: a data folder in a folder of its own has a few dozen neighbours at most).

The launcher. Command items start through posix_spawn or Popen: no Python code runs in the
child before exec, so no `landlock_restrict_self` can be called there. An item's argv is
wrapped instead (`wrap`): `python -I -S -c LAUNCHER_CODE PATH LC_CTYPE PARENT ALLOW... -- argv...`.
LAUNCHER_CODE is self-contained and imports only the standard library (an item user who cannot
read meshd's install can run it): it sets its parent-death signal (the item's first process
dies with the meshd thread that started it: meshjobs/driver.py, Rule 11; no_new_privs keeps an
exec of a set-user-ID program from clearing it), sets no_new_privs, builds a ruleset handling every filesystem right of
the running ABI and (ABI 6+) the signal and abstract unix socket scopes, adds one rule per
allowed path, restricts itself and execs the item's program with the item's own argv (argv[0]
included), environment and working directory. Each item gets its own Landlock domain: with
the signal scope it cannot signal meshd, nor the items of other jobs (each in its own domain),
while meshd, outside every domain, still signals it. Landlock also keeps a walled process from
ptrace access to processes outside its domain, so meshd's /proc files are closed to it too.

Launcher exit statuses (the item's own statuses are whatever its program returns):
EXIT_WALL (125): the rules were unreadable or the kernel refused the wall, or meshd died
before the item started; nothing ran.
EXIT_EXEC (127): the program could not be executed; nothing ran. Either way one line on stderr
starting "meshjobs wall:" says why.
"""

from __future__ import annotations

import ctypes
import errno
import os
import stat
import sys
from collections.abc import Iterable
from dataclasses import dataclass

from . import limits

EXIT_WALL = 125
EXIT_EXEC = 127
MODES = ("auto", "landlock", "off")

# Linux x86_64 and aarch64 share these numbers (asm-generic and x86_64 tables).
_SYS_CREATE_RULESET = 444
_CREATE_RULESET_VERSION = 1

# The launcher: a program of its own, run by `python -I -S -c` (isolated: no site, no user
# site, no PYTHON* variables, no current folder on sys.path: the item's cwd cannot plant a
# module). It imports nothing but ctypes, os and _signal (built in) (a Python start is most of its cost,
# and json, struct or stat would each add to it). argv: PATH LC_CTYPE PARENT ALLOW... "--" argv...
# PATH: the program to exec, or "" (search the item's PATH). LC_CTYPE: "=" and the item's
# LC_CTYPE, or "" (none: python may set it at start; it is put back exactly). PARENT: the pid of
# the process that starts the launcher (meshd), or 0: the launcher sets its parent-death signal
# to SIGKILL (it runs as the item's user already: a later uid change would clear it) and exits
# at once if PARENT is no longer its parent (it died before the signal was set). ALLOW: one
# absolute path per argument (so "--" cannot be one), each allowed in full.
LAUNCHER_CODE = r"""
import _signal, ctypes, os, sys
def fail(code, why):
    os.write(2, ("meshjobs wall: " + why + "\n").encode("utf-8", "replace"))
    os._exit(code)
a = sys.argv
try:
    cut = a.index("--", 4)
except ValueError:
    cut = 0
if cut == 0 or len(a) <= cut + 1 or (a[2] and a[2][0] != "=") or not a[3].isdigit() or \
        not all(p.startswith("/") for p in a[4:cut]):
    fail(125, "bad rules (%r): meshd passes them; report this" % a[1:5])
path, lc_ctype, parent, allow = a[1] or None, a[2][1:] if a[2] else None, int(a[3]), a[4:cut]
libc = ctypes.CDLL(None, use_errno=True)
if parent:
    libc.prctl(1, 9, 0, 0, 0)  # PR_SET_PDEATHSIG, SIGKILL
    if os.getppid() != parent:
        os._exit(125)  # meshd died before the signal was set: nobody waits for this item
sc = libc.syscall
sc.restype = ctypes.c_long
L, I, U = ctypes.c_long, ctypes.c_int, ctypes.c_uint32
abi = sc(L(444), None, L(0), U(1))
if abi < 1:
    fail(125, "Landlock is not available here (%s)" % os.strerror(ctypes.get_errno()))
fs = (1 << 13) - 1
files = 1 | 2 | 4
if abi >= 2: fs |= 1 << 13
if abi >= 3: fs |= 1 << 14; files |= 1 << 14
if abi >= 5: fs |= 1 << 15; files |= 1 << 15
attr = (fs.to_bytes(8, "little") + bytes(8) + (3 if abi >= 6 else 0).to_bytes(8, "little"))
attr = attr[:8 if abi < 4 else 16 if abi < 6 else 24]
buf = ctypes.create_string_buffer(attr, len(attr))
rs = sc(L(444), buf, L(len(attr)), U(0))
if rs < 0:
    fail(125, "landlock_create_ruleset: " + os.strerror(ctypes.get_errno()))
rule = ctypes.create_string_buffer(12)
for p in allow:
    try:
        fd = os.open(p, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        continue
    kind = os.fstat(fd).st_mode & 0o170000
    if kind == 0o120000:  # a symbolic link: no rule (the module's Rule 4)
        os.close(fd)
        continue
    rule.raw = (fs if kind == 0o040000 else files).to_bytes(8, "little") + \
        fd.to_bytes(4, "little", signed=True)
    if sc(L(445), I(rs), I(1), rule, U(0)):
        fail(125, "landlock_add_rule %s: %s" % (p, os.strerror(ctypes.get_errno())))
    os.close(fd)
if libc.prctl(38, 1, 0, 0, 0):
    fail(125, "prctl(PR_SET_NO_NEW_PRIVS): " + os.strerror(ctypes.get_errno()))
if sc(L(446), I(rs), U(0)):
    fail(125, "landlock_restrict_self: " + os.strerror(ctypes.get_errno()))
os.close(rs)
env = os.environb
env.pop(b"LC_CTYPE", None)
if lc_ctype is not None:
    env[b"LC_CTYPE"] = os.fsencode(lc_ctype)
argv = [os.fsencode(x) for x in a[cut + 1:]]
for sig in range(1, _signal.NSIG):  # ignored by Python, or by whoever started meshd (nohup)
    try:
        if _signal.getsignal(sig) == _signal.SIG_IGN:
            _signal.signal(sig, _signal.SIG_DFL)
    except (OSError, ValueError):
        pass
_signal.pthread_sigmask(_signal.SIG_SETMASK, ())  # and none blocked, whatever meshd's thread had
try:
    if path is None:
        os.execvpe(argv[0], argv, env)
    os.execve(os.fsencode(path), argv, env)
except OSError as e:
    fail(127, "cannot run %s: %s" % (path or a[cut + 1], e.strerror or e))
"""


@dataclass(frozen=True)
class Rules:
    """What an item may reach: `allow` (paths allowed in full), `denied` (the resolved denied
    paths that exist) and `stamp` (the spine folders and their change times, Rule 5)."""

    allow: tuple[str, ...]
    denied: tuple[str, ...]
    stamp: tuple[tuple[str, int], ...]
    too_many: int = 0  # entries around the denied paths past limits.wall_rules_bytes_max

    def check(self) -> None:
        """Raise WallError when these rules cannot wall an item (Rule 6)."""
        if self.too_many:
            raise WallError(
                f"the folders around meshd's data folder hold {self.too_many} entries, too many "
                f"for the wall around items (limit {limits.wall_rules_bytes_max} bytes of paths): "
                f"move the data folder into a folder of its own (for example /var/lib/meshjobs)")


class WallError(Exception):
    """Items cannot be put behind the wall as the filesystem is now; nothing was started."""


def _beneath(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip("/") + "/")


def _ancestors(path: str) -> list[str]:
    """The folders above `path`, from / down to its parent."""
    out = []
    head = os.path.dirname(path)
    while True:
        out.append(head)
        if head == "/":
            break
        head = os.path.dirname(head)
    return out[::-1]


def rules(denied: Iterable[str]) -> Rules:
    """The allow rules that leave `denied` out of reach (the module's Rules 1-4)."""
    real = sorted({os.path.realpath(p) for p in denied if p and os.path.lexists(p)})
    real = [p for p in real if os.path.exists(p)]
    kept = [p for p in real if not any(q != p and _beneath(p, q) for q in real)]
    if "/" in kept:
        return Rules((), ("/",), ())
    spine: set[str] = set()
    for p in kept:
        spine.update(_ancestors(p))
    allow: list[str] = []
    stamp: list[tuple[str, int]] = []
    for folder in sorted(spine):
        try:
            stamp.append((folder, os.stat(folder).st_mtime_ns))
            names = sorted(os.listdir(folder))
        except OSError:
            continue  # gone, or not ours to list: nothing in it is allowed
        for name in names:
            path = os.path.join(folder, name)
            if path in spine or path in kept:
                continue
            try:
                if stat.S_ISLNK(os.lstat(path).st_mode):
                    continue
            except OSError:
                continue
            allow.append(path)
    size = sum(len(os.fsencode(p)) + 1 for p in allow)
    if size > limits.wall_rules_bytes_max:
        return Rules((), tuple(kept), tuple(stamp), too_many=len(allow))
    return Rules(tuple(allow), tuple(kept), tuple(stamp))


def fresh(r: Rules) -> bool:
    """Do `r`'s spine folders still hold what they held when `r` was computed (Rule 5)?"""
    try:
        return all(os.stat(f).st_mtime_ns == t for f, t in r.stamp)
    except OSError:
        return False


def wrap(r: Rules, path: str | None, argv: list[str], env: dict[str, str],
         parent: int | None = None) -> list[str]:
    """The argv that runs `argv` (its program at `path`, or None: searched on the item's PATH
    at exec) behind the rules `r`, with `env` as the item's environment; it dies with the
    thread of `parent` (this process unless given; 0: not) that starts it. Raises WallError
    when `r` cannot wall anything (Rule 6)."""
    r.check()
    lc_ctype = env.get("LC_CTYPE")
    return [launcher_python(), "-I", "-S", "-c", LAUNCHER_CODE, path or "",
            "" if lc_ctype is None else "=" + lc_ctype,
            str(os.getpid() if parent is None else parent), *r.allow, "--", *argv]


def _open_to_all(path: str) -> bool:
    """Whether every user may run the program at `path`: it and each folder above it are open
    to others (the item may run as a user other than meshd's)."""
    real = os.path.realpath(path)
    try:
        if os.stat(real).st_mode & 0o005 != 0o005:
            return False
        folder = os.path.dirname(real)
        while True:
            if os.stat(folder).st_mode & 0o001 == 0:
                return False
            up = os.path.dirname(folder)
            if up == folder:
                return True
            folder = up
    except OSError:
        return False


_SYSTEM_PYTHONS = ("/usr/bin/python3", "/usr/local/bin/python3", "/bin/python3")
_launcher: str | None = None


def launcher_python() -> str:
    """The interpreter the launcher runs on: meshd's own when every user may run it, else a
    system python3 that every user may run (the launcher needs only the standard library, so
    any Python 3 does; an item running as another user may not be able to enter the folder of
    meshd's interpreter, e.g. one installed under root's HOME). Found once."""
    global _launcher
    if _launcher is None:
        found = sys.executable
        if not _open_to_all(found):
            found = next((p for p in _SYSTEM_PYTHONS if _open_to_all(p)), found)
        _launcher = found
    return _launcher


def landlock_abi() -> int:
    """The running kernel's Landlock ABI version; 0 when it has none (or it is disabled)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.syscall.restype = ctypes.c_long
        abi = libc.syscall(ctypes.c_long(_SYS_CREATE_RULESET), None, ctypes.c_size_t(0),
                           ctypes.c_uint32(_CREATE_RULESET_VERSION))
    except (OSError, AttributeError):
        return 0
    return int(abi) if abi > 0 else 0


def make_undumpable() -> bool:
    """prctl(PR_SET_DUMPABLE, 0): this process's /proc files (environ, mem, fd, ...) become
    root's, so processes of the same uid cannot read them, and it cannot be ptraced by them.
    False where prctl is missing (not Linux)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(4, 0, 0, 0, 0) == 0  # PR_SET_DUMPABLE
    except (OSError, AttributeError):
        return False


def is_dumpable() -> bool:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(3, 0, 0, 0, 0) == 1  # PR_GET_DUMPABLE
    except (OSError, AttributeError):
        return True


def program_path(argv0: str, env: dict[str, str]) -> str | None:
    """The program the item's argv[0] names, as exec would find it, checked here so a missing
    program is said as clearly as without the wall: its path, or None when the item's PATH has
    a relative folder (the launcher then searches it). Raises FileNotFoundError when there is
    no such program, PermissionError when it may not be executed."""
    if "/" in argv0:
        candidates = [argv0]
    else:
        candidates = []
        for folder in os.get_exec_path(env):
            if not folder.startswith("/"):
                return None
            candidates.append(os.path.join(folder, argv0))
    for path in candidates:
        if os.path.isdir(path):
            continue
        if os.access(path, os.X_OK):
            return path
        if "/" in argv0 and os.path.exists(path):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), argv0)
    raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), argv0)


@dataclass(frozen=True)
class Status:
    """What walls this member's items are behind, for the start log, /fleet and check-config."""

    user: str  # the user items run as by default ("meshd's own (NAME)" or a user name)
    walls: tuple[str, ...]  # "uid", "landlock", "undumpable"
    signals_walled: bool
    abi: int
    warning: str | None

    def fleet_entry(self) -> dict:
        return {"user": self.user, "walls": list(self.walls),
                "signals_walled": self.signals_walled, "warning": self.warning}


def status(mode: str, abi: int, may_switch_user: bool, user: str, data: str,
           undumpable: bool = True) -> Status:
    """The walls items get under `[items] wall = mode` on a kernel with Landlock ABI `abi`
    (0: none), and the warning to give when they do not hold."""
    walls: list[str] = []
    if may_switch_user:
        walls.append("uid")
    landlock = mode != "off" and abi > 0
    if landlock:
        walls.append("landlock")
    if undumpable:
        walls.append("undumpable")
    signals = (landlock and abi >= 6) or may_switch_user
    warning = None
    if not may_switch_user and not landlock:
        why = ("[items] wall = \"off\"" if mode == "off"
               else "this kernel has no Landlock")
        warning = (f"items run as meshd's own user with no wall ({why}): they can read the data "
                   f"folder {data} (the fleet secret, journal, blob store, history), the TLS "
                   "key and signal meshd and other jobs' items. Start meshd as root (items then "
                   "run as an item user), or on a kernel with Landlock (5.13+, enabled in "
                   "lsm=) with [items] wall = \"auto\"")
    elif landlock and not signals:
        warning = (f"Landlock ABI {abi} cannot scope signals (6+ can): items may signal meshd "
                   "and other jobs' items; a newer kernel walls them off")
    return Status(user, tuple(walls), signals, abi, warning)
