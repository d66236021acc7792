"""meshjobs.pidwatch: one way to watch a child through a pidfd (the driver's items and the
python workers both use it), and what happens when the member cannot watch one."""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import sys
import textwrap

from meshjobs import driver, pidwatch, pypool


def test_pidfd_turns_readable_when_the_child_ends():
    """A pidfd from open_pidfd is readable once the child exits, and not before."""
    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                            stdin=subprocess.PIPE, start_new_session=True)
    reaped = []
    fd = pidwatch.open_pidfd(proc.pid, lambda: reaped.append(1))
    try:
        with selectors.DefaultSelector() as sel:
            sel.register(fd, selectors.EVENT_READ)
            assert sel.select(0) == []
            proc.stdin.close()  # the child reads to the end and exits
            assert sel.select(60) != []
        assert proc.wait(60) == 0 and reaped == []
    finally:
        os.close(fd)


def test_a_child_that_cannot_be_watched_is_killed_and_reaped():
    """Rule: out of descriptors, the child's group is killed, reap runs, the OSError goes up.
    Run in a process of its own, whose descriptor limit is lowered to the next free one."""
    script = textwrap.dedent("""
        import errno, os, resource, subprocess, sys
        from meshjobs import pidwatch
        proc = subprocess.Popen(["sleep", "600"], start_new_session=True)
        free = os.dup(0); os.close(free)
        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        resource.setrlimit(resource.RLIMIT_NOFILE, (free, hard))
        reaped = []
        try:
            pidwatch.open_pidfd(proc.pid, lambda: reaped.append(proc.wait()))
        except OSError as e:
            print(e.errno == errno.EMFILE, reaped)
        else:
            print("opened")
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert out.stdout.split("\n")[0] == f"True [{-signal.SIGKILL}]", out.stderr


def test_killpg_of_a_gone_group_is_no_error():
    proc = subprocess.Popen(["true"], start_new_session=True)
    proc.wait(60)
    pidwatch.killpg(proc.pid, signal.SIGKILL)


def test_driver_and_python_pool_share_it():
    """One helper, not two copies: the driver and the python pool use pidwatch's."""
    assert driver._killpg is pidwatch.killpg and pypool._killpg is pidwatch.killpg
    for mod in (driver, pypool):
        src = open(mod.__file__).read()
        assert "os.pidfd_open" not in src and "pidwatch.open_pidfd(" in src
