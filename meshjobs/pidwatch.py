"""Watching a child process through a pidfd, for the driver's items and the python workers.

A child is started in a session of its own (its pid is its process group's id); the thread that
supervises it waits on one selector for its pidfd, which turns readable when the child exits.

Rule: a child that cannot be watched does not run on. When `pidfd_open` fails (the member is out
of descriptors), the child's whole group is killed, the caller's `reap` waits for it and releases
what it holds, and the OSError goes on up: the member stops rather than leave a process it
cannot see end.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable


def killpg(pgid: int, sig: int) -> None:
    """Send `sig` to the process group `pgid`; a group that is gone already is no error."""
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass  # The whole group is gone already.
    except PermissionError:
        pass  # Only members that changed their user remain; the rest got the signal.


def open_pidfd(pid: int, reap: Callable[[], object]) -> int:
    """A pidfd of the child `pid`, the leader of its own group (see the module's rule)."""
    try:
        return os.pidfd_open(pid)
    except OSError:
        killpg(pid, signal.SIGKILL)
        reap()
        raise
