"""Writing an item's stdout and stderr to the paths its job names (`--stdout`, `--stderr`).

The blob store keeps every item's outputs whatever happens here: a path is a convenience copy
on the member that ran the item (as meeseeks' stdout=/stderr=). `{index}` in a path is already
the item's index (the node fills it in); a relative path is under the item's working directory
(the job's cwd, else meshd's own folder, where the item ran). The file is replaced whole.

An item that runs as another user (`--user`) has its files written by that user: a short `cat`
started with the user's uid, gid and groups, so that a job cannot write where its user could
not. A write that fails (no such folder, no permission, a full disk, too slow) never fails the
item and never loses its result: it becomes the text of the item's error, which says what to
do.
"""

from __future__ import annotations

import os
import shutil
import subprocess
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


def _write(dest: str, src: Source) -> str | None:
    try:
        if isinstance(src, bytes):
            with open(dest, "wb") as f:
                f.write(src)
        else:
            shutil.copyfile(src, dest)
    except OSError as e:
        return e.strerror or str(e)
    return None


def _write_as(dest: str, src: Source, cwd: str | None, ids: dict[str, Any]) -> str | None:
    """Write as the item's user: `cat > dest` with its ids, fed from the spool file."""
    argv = ["/bin/sh", "-c", 'exec cat > "$1"', "sh", dest]
    try:
        if isinstance(src, bytes):
            done = subprocess.run(argv, input=src, capture_output=True, cwd="/",
                                  env={"PATH": "/usr/bin:/bin"}, close_fds=True,
                                  timeout=limits.output_path_write_s_max, **ids)
        else:
            with open(src, "rb") as f:
                done = subprocess.run(argv, stdin=f, capture_output=True, cwd="/",
                                      env={"PATH": "/usr/bin:/bin"}, close_fds=True,
                                      timeout=limits.output_path_write_s_max, **ids)
    except subprocess.TimeoutExpired:
        return f"took over {limits.output_path_write_s_max} s"
    except (OSError, ValueError) as e:
        return str(e)
    if done.returncode != 0:
        text = done.stderr.decode("utf-8", "replace").strip().splitlines()
        return (text[-1] if text else f"exit {done.returncode}")[:200] + f", as uid {ids['user']}"
    return None
