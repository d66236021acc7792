"""Writing an item's stdout and stderr to the paths its job names (`--stdout`, `--stderr`).

The blob store keeps every item's outputs whatever happens here: a path is a convenience copy
on the member that ran the item (as meeseeks' stdout=/stderr=). `{index}` in a path is already
the item's index (the node fills it in); a relative path is under the item's working directory
(the job's cwd, else meshd's own folder, where the item ran). The file is replaced whole.

Rule 1: the file is written by the item's own user. An item that runs as another user than
        meshd has its files written by a short forked child that takes the user's uid, gid and
        groups (reading the spool file meshd opened for it), so that a
        job cannot write where its user could not. The folders on the way are followed as that
        user follows them: a symlink planted there leads only where the user could write anyway.
Rule 2: the last component is never followed. The folder is opened once (O_DIRECTORY), the
        bytes go to a new temporary name in it (O_CREAT|O_EXCL|O_NOFOLLOW, relative to the
        folder's descriptor), are fsynced, and the temporary file is renamed over the name
        (relative to the same descriptor): a symlink found at the name, planted before the
        submit or while the item ran, is itself replaced and its target never touched.
Rule 3: never into meshd's own folders (`protect`, the data folder): the folder opened is
        walked up by its real parents (`..` of the descriptor, not of the path), so no path,
        symlink or bind of a user's leads an output into them. Where items run as meshd's own
        uid (walled off by the kernel), meshd writes their files itself, outside that wall.
Rule 4: a write that fails (no such folder, no permission, a full disk, too slow) never fails
        the item and never loses its result: it becomes the text of the item's error, which
        says what to do.
"""

from __future__ import annotations

import os
import select
import signal
import stat
from typing import Any

from meshjobs import limits

# What an output is read from: a spool file's path, or the bytes of a python item's output.
Source = str | bytes


def dest_of(path: str, cwd: str | None) -> str:
    return path if path.startswith("/") else os.path.join(cwd or os.getcwd(), path)


def write_outputs(paths: tuple[str | None, str | None], sources: tuple[Source, Source],
                  cwd: str | None, ids: dict[str, Any] | None, member: str) -> str | None:
    """Write each output that has a path; return why some could not be written (None: all
    were). `ids`: the user, group and extra_groups to write as (None: as meshd)."""
    errors = []
    for name, path, src in zip(("stdout", "stderr"), paths, sources, strict=True):
        if path is None:
            continue
        dest = dest_of(path, cwd)
        why = _write_as(dest, src, cwd, ids) if ids else _write(dest, src)
        if why is not None:
            errors.append(f"{name} not written to {dest} on member {member} ({why}): the "
                          f"output is kept all the same (meshctl job results); create the "
                          f"folder or fix its permissions, or submit with another --{name}")
    return "; ".join(errors)[:limits.item_error_chars_max] if errors else None


class WriteError(Exception):
    """Why an output could not be written: the step and the system's words."""


# The (device, inode) of the folders no output may go into, nor below (Rule 3).
_protected: frozenset[tuple[int, int]] = frozenset()


def protect(folders: tuple[str, ...]) -> None:
    """Keep outputs out of these folders and everything below them (meshd calls it at start
    with its data folder)."""
    global _protected
    found = set()
    for f in folders:
        st = os.stat(f)
        found.add((st.st_dev, st.st_ino))
    _protected = frozenset(found)


def _in_protected(dfd: int) -> bool:
    """Whether the opened folder is a protected one or below one (Rule 3)."""
    cur = os.open(".", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=dfd)
    try:
        for _ in range(limits.output_path_chars_max):
            st = os.fstat(cur)
            here = (st.st_dev, st.st_ino)
            if here in _protected:
                return True
            parent = os.open("..", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=cur)
            os.close(cur)
            cur = parent
            pst = os.fstat(cur)
            if (pst.st_dev, pst.st_ino) == here:
                return False  # the root
        return True  # deeper than any path could name: not to be trusted
    finally:
        os.close(cur)


def _tmp_name(name: str) -> str:
    """A fresh hidden name beside `name` (at most 255 bytes, as a file name may be)."""
    tail = f".{os.urandom(6).hex()}.tmp"
    head = "." + name
    while len((head + tail).encode("utf-8", "surrogateescape")) > 255:
        head = head[:-1]
    return head + tail


def write_into(dest: str, data: bytes | None, src_fd: int | None) -> None:
    """Replace `dest` whole with `data` (or what `src_fd` holds, read to its end), never
    through a symlink at `dest` itself (Rule 2). Raises WriteError saying why not."""
    folder, name = os.path.split(dest)
    if not name or name in (".", ".."):
        raise WriteError(f"{dest!r} names a folder, not a file")
    try:
        dfd = os.open(folder or ".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as e:
        raise WriteError(f"cannot open its folder: {e.strerror or e}") from None
    tmp = None
    try:
        if _protected and _in_protected(dfd):
            raise WriteError("that folder is meshd's own (its data folder, or below it)")
        if _into_device(dfd, name, data, src_fd):
            return
        for _ in range(8):
            tmp = _tmp_name(name)
            try:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                             | os.O_CLOEXEC, 0o666, dir_fd=dfd)
                break
            except FileExistsError:
                tmp = None
        else:
            raise WriteError("no free temporary name in its folder")
        try:
            _copy(fd, data, src_fd)
            os.fsync(fd)
        finally:
            os.close(fd)
        # rename(2) never follows its last component: a symlink at `name` is replaced, its
        # target untouched. A folder at `name` refuses (EISDIR), as it should.
        os.rename(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
        tmp = None
        try:
            os.fsync(dfd)
        except OSError:
            pass  # some file systems cannot sync a folder; the file itself is synced
    except OSError as e:
        raise WriteError(e.strerror or str(e)) from None
    finally:
        if tmp is not None:
            try:
                os.unlink(tmp, dir_fd=dfd)
            except OSError:
                pass
        os.close(dfd)


def _copy(fd: int, data: bytes | None, src_fd: int | None) -> None:
    if data is not None:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        return
    assert src_fd is not None
    while chunk := os.read(src_fd, 1 << 20):
        view = memoryview(chunk)
        while view:
            view = view[os.write(fd, view):]


def _into_device(dfd: int, name: str, data: bytes | None, src_fd: int | None) -> bool:
    """A character device at the name (`/dev/null`, a terminal) is written into, as it always
    was, never replaced; a FIFO, socket or block device is refused. False: no such thing
    there, go on with a file."""
    try:
        st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    if stat.S_ISREG(st.st_mode) or stat.S_ISLNK(st.st_mode) or stat.S_ISDIR(st.st_mode):
        return False  # a file or a symlink is replaced; a folder refuses at the rename
    if not stat.S_ISCHR(st.st_mode):
        raise WriteError("it is a FIFO, socket or block device, not a file: give a file path")
    fd = os.open(name, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=dfd)
    try:
        if not stat.S_ISCHR(os.fstat(fd).st_mode):  # swapped meanwhile: not what was looked at
            raise WriteError("it changed while it was opened: try again")
        os.set_blocking(fd, True)
        _copy(fd, data, src_fd)
    finally:
        os.close(fd)
    return True


def _write(dest: str, src: Source) -> str | None:
    """Write as meshd itself: the item ran as meshd's own user."""
    try:
        if isinstance(src, bytes):
            write_into(dest, src, None)
        else:
            fd = os.open(src, os.O_RDONLY | os.O_CLOEXEC)
            try:
                write_into(dest, None, fd)
            finally:
                os.close(fd)
    except OSError as e:
        return e.strerror or str(e)
    except WriteError as e:
        return str(e)
    return None


def _write_as(dest: str, src: Source, cwd: str | None, ids: dict[str, Any]) -> str | None:
    """Write as the item's user (Rule 1): a forked child (no exec: the interpreter's own files
    may be out of the user's reach) takes the user's groups, gid and uid, then writes as
    `write_into` does; it says why it failed on a pipe. Killed past output_path_write_s_max."""
    src_fd = None
    try:
        if not isinstance(src, bytes):
            src_fd = os.open(src, os.O_RDONLY | os.O_CLOEXEC)
        r, w = os.pipe2(os.O_CLOEXEC)
    except OSError as e:
        if src_fd is not None:
            os.close(src_fd)
        return e.strerror or str(e)
    try:
        pid = os.fork()
    except OSError as e:
        for fd in (r, w, src_fd):
            if fd is not None:
                os.close(fd)
        return f"could not start a writer as uid {ids['user']} ({e.strerror or e})"
    if pid == 0:  # the child: nothing here may take a lock another thread of meshd held
        code = 1
        try:
            os.close(r)
            os.setgroups(list(ids.get("extra_groups") or []))
            os.setgid(ids["group"])
            os.setuid(ids["user"])
            write_into(dest, src if isinstance(src, bytes) else None, src_fd)
            code = 0
        except BaseException as e:  # noqa: BLE001 - the child reports every failure, then exits
            try:
                why = str(e) if isinstance(e, WriteError) else (
                    getattr(e, "strerror", None) or repr(e))
                os.write(w, why.encode("utf-8", "replace")[:200])
            except BaseException:  # noqa: BLE001, S110 - nothing more the child can do
                pass
        finally:
            os._exit(code)
    os.close(w)
    if src_fd is not None:
        os.close(src_fd)
    try:
        ready, _, _ = select.select([r], [], [], limits.output_path_write_s_max)
        why = os.read(r, 4096).decode("utf-8", "replace") if ready else None
    finally:
        os.close(r)
    if why is None:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        return f"took over {limits.output_path_write_s_max} s"
    _pid, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        return (why or f"exit {code}")[:200] + f", as uid {ids['user']}"
    return None
