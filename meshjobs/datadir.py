"""The data folder is meshd's alone: folders 0700, files 0600, whatever the umask.

meshd keeps the fleet secret, the Raft journal and dumps, the blob store (every item's outputs
and stdins), the history and its spool files there; any of them read by another local user (an
item run as another user among them) leaks jobs' env values, outputs or the fleet's root
password. So, like etcd and PostgreSQL:

Rules:
1. meshd sets its umask to 0o077 before it creates anything (`private_umask`), and the files
   and folders it makes there also name their mode (FILE_MODE, DIR_MODE, `private_opener`).
2. At start, `secure` walks the data folder (not through symbolic links). A folder or file
   open to group or others is fixed (chmod to its owner's bits alone, logged once naming it)
   when meshd may (it owns it, or holds CAP_FOWNER), or refused (DataFolderError: the path and
   the chmod to run) when it cannot be fixed. The fleet secret is left to replica.open_secret, which refuses one others
   may read: a secret already exposed must be replaced, not hidden again.
3. One meshd per data folder: a running meshd holds a lock on LOCK_FILE (`lock`), and another
   meshd started on the same folder stops at start naming it. Its items' record
   (meshjobs/leftovers.py) is swept only under that lock, so a second meshd can never take the
   first one's running items for leftovers of its own.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
from typing import Any

FILE_MODE = 0o600
DIR_MODE = 0o700
UMASK = 0o077
LOCK_FILE = "meshd.lock"


class DataFolderError(Exception):
    """A path of the data folder open to group or others that meshd cannot close."""


def private_umask() -> int:
    """Set the process umask to UMASK; the previous one."""
    return os.umask(UMASK)


def private_opener(path: str, flags: int) -> int:
    """An `opener` for open(): the file is created with FILE_MODE."""
    return os.open(path, flags, FILE_MODE)


def make_folder(path: str) -> None:
    """The folder (and missing parents) created with DIR_MODE; an existing one is left as it
    is (`secure` checks it)."""
    os.makedirs(path, mode=DIR_MODE, exist_ok=True)


def secure(data: str, log: Any, skip: tuple[str, ...] = ()) -> list[str]:
    """Close every path under `data` (and `data` itself) open to group or others: chmod when
    this process may (it owns it, or holds CAP_FOWNER), else DataFolderError naming the first
    such path and the chmod to run. `skip`: paths left to their own check (the fleet secret). Returns the paths
    fixed, each logged once."""
    skipped = {os.path.abspath(p) for p in skip}
    fixed: list[str] = []
    euid = os.geteuid()

    def check(path: str) -> None:
        if os.path.abspath(path) in skipped:
            return
        st = os.lstat(path)
        if stat.S_ISLNK(st.st_mode) or not st.st_mode & 0o077:
            return
        mode = stat.S_IMODE(st.st_mode)
        want = mode & 0o700
        try:
            # (Not a symbolic link: lstat said so, and nobody else may write in our folders.)
            os.chmod(path, want)
        except PermissionError:
            # Not ours (nor may we change others' files: no CAP_FOWNER): its owner must.
            flag = "-R " if stat.S_ISDIR(st.st_mode) else ""
            raise DataFolderError(
                f"{path} in meshd's data folder is open to group or others (mode {mode:o}) and "
                f"meshd (uid {euid}) may not change it (its owner is uid {st.st_uid}): run "
                f"`chown {flag}{euid} {path} && chmod {flag}go-rwx {path}` as root, then start "
                f"meshd again") from None
        log.warning("data_mode_fixed", path=path, was=f"{mode:o}", now=f"{want:o}")
        fixed.append(path)

    check(data)
    for folder, dirs, files in os.walk(data):
        for name in dirs + files:
            check(os.path.join(folder, name))
    return fixed


def lock(data: str) -> int:
    """Hold the data folder for this process (Rule 3): a POSIX lock on LOCK_FILE, which the
    kernel drops when the process ends, however it ends, and which no forked child inherits (a
    dump writer outliving its member for a moment does not hold it). The descriptor, to keep
    open for the member's life (closing any descriptor of that file in this process would drop
    the lock). DataFolderError naming the meshd that holds it."""
    path = os.path.join(data, LOCK_FILE)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, FILE_MODE)
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        try:
            holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "unknown"
        finally:
            os.close(fd)
        if e.errno not in (errno.EACCES, errno.EAGAIN):
            raise
        raise DataFolderError(
            f"another meshd (pid {holder}) runs on the data folder {data}: stop it first, or "
            f"give this one a data folder of its own (--data)") from None
    try:  # who holds it, for the message above; on a full disk it is left unsaid
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    except OSError:
        pass
    return fd
