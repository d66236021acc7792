"""Starting a command item's program with the C library's posix_spawn: vfork and exec, no Python
in the child, and the GIL released while the kernel copies nothing.

Why not `os.posix_spawn`: Python 3.11's cannot change the working directory or close the
descriptors meshd inherited, and glibc's posix_spawn leaves its two internal signals (32 and
33) ignored in the child unless they are named as "set to default" — which
`os.posix_spawn(setsigdef=...)` refuses, since `sigaddset` does. An item started here gets
what `subprocess.Popen(..., cwd=cwd, start_new_session=True, close_fds=True,
restore_signals=True)` gives it: its three descriptors and no other, a new session, and its
working directory; and more: every signal at its default action, not only the SIGPIPE and
SIGXFSZ Python ignores (a meshd started under nohup has SIGHUP ignored; its items must not),
and no signal blocked, whatever the spawning thread blocks.

Rules:
1. `spawn` returns the pid of a child that has exec'd, or raises OSError with the errno of
   whatever failed (chdir or exec); the caller decides what to say (the driver asks Popen,
   which says exactly which part failed).
2. It never starts a program with an argument or a variable cut short: a NUL in one, or `=` in
   a variable's name, raises ValueError before anything starts.
3. `available()` is False where the C library lacks what is needed (not glibc 2.34 or later,
   not Linux); the driver then uses Popen for everything.
"""

from __future__ import annotations

import ctypes
import os
import signal

# posix_spawnattr_setflags(3)
_POSIX_SPAWN_SETSIGDEF = 0x04
_POSIX_SPAWN_SETSIGMASK = 0x08
_POSIX_SPAWN_SETSID = 0x80  # glibc 2.26

# Generous: glibc's posix_spawn_file_actions_t is 80 bytes and posix_spawnattr_t 336.
_ACTIONS_BYTES = 512
_ATTR_BYTES = 1024
_SIGSET_WORDS = 16  # glibc's sigset_t: 1024 bits

_libc: ctypes.CDLL | None = None
_ok: bool | None = None
_sigdef: ctypes.Array | None = None
_nomask = (ctypes.c_ulong * _SIGSET_WORDS)()  # the empty set: an item starts with no signal blocked


def available() -> bool:
    """Whether this C library can spawn as `spawn` promises."""
    global _libc, _ok, _sigdef
    if _ok is None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            for name in ("posix_spawn", "posix_spawn_file_actions_init",
                         "posix_spawn_file_actions_destroy", "posix_spawn_file_actions_adddup2",
                         "posix_spawn_file_actions_addchdir_np",
                         "posix_spawn_file_actions_addclosefrom_np", "posix_spawnattr_init",
                         "posix_spawnattr_destroy", "posix_spawnattr_setflags",
                         "posix_spawnattr_setsigdefault", "posix_spawnattr_setsigmask"):
                getattr(libc, name)
        except (OSError, AttributeError):
            _ok = False
            return False
        libc.posix_spawnattr_setflags.argtypes = [ctypes.c_void_p, ctypes.c_short]
        _libc = libc
        _sigdef = _default_signals()
        _ok = True
    return _ok


def _default_signals() -> ctypes.Array:
    """Signals the child sets to their default action: every one but SIGKILL and SIGSTOP (what
    Python ignores, what meshd inherited ignored, e.g. SIGHUP under nohup, and the C library's
    internal ones, 32 up to SIGRTMIN), set in the mask's bits directly because sigaddset
    refuses some of them."""
    words = (ctypes.c_ulong * _SIGSET_WORDS)()
    bits = ctypes.sizeof(ctypes.c_ulong) * 8
    wanted = [s for s in range(1, int(signal.NSIG)) if s not in (signal.SIGKILL, signal.SIGSTOP)]
    for sig in wanted:
        words[(sig - 1) // bits] |= 1 << ((sig - 1) % bits)
    return words


def spawn(path: str, argv: list[str], env: dict[str, str], fds: tuple[int, int, int],
          cwd: str | None) -> int:
    """Start `path` with `argv` and `env` in a new session, `fds` as its stdin, stdout and
    stderr, in `cwd` (None: meshd's); its pid. See the module's rules."""
    assert _libc is not None and _sigdef is not None, "spawn() before available()"
    args = [os.fsencode(a) for a in argv]
    pairs = []
    for k, v in env.items():
        if "=" in k:
            raise ValueError(f"illegal environment variable name {k!r}")
        pairs.append(os.fsencode(k) + b"=" + os.fsencode(v))
    path_b = os.fsencode(path)
    cwd_b = None if cwd is None else os.fsencode(cwd)
    if any(b"\0" in x for x in (path_b, cwd_b or b"", *args, *pairs)):
        raise ValueError("embedded null byte")
    libc = _libc
    actions = ctypes.create_string_buffer(_ACTIONS_BYTES)
    attr = ctypes.create_string_buffer(_ATTR_BYTES)
    _check(libc.posix_spawn_file_actions_init(actions))
    try:
        _check(libc.posix_spawnattr_init(attr))
        try:
            for i, fd in enumerate(fds):
                _check(libc.posix_spawn_file_actions_adddup2(actions, fd, i))
            if cwd_b is not None:
                _check(libc.posix_spawn_file_actions_addchdir_np(actions, cwd_b))
            _check(libc.posix_spawn_file_actions_addclosefrom_np(actions, 3))
            _check(libc.posix_spawnattr_setsigdefault(attr, _sigdef))
            _check(libc.posix_spawnattr_setsigmask(attr, _nomask))
            _check(libc.posix_spawnattr_setflags(
                attr, _POSIX_SPAWN_SETSID | _POSIX_SPAWN_SETSIGDEF | _POSIX_SPAWN_SETSIGMASK))
            c_argv = (ctypes.c_char_p * (len(args) + 1))(*args, None)
            c_env = (ctypes.c_char_p * (len(pairs) + 1))(*pairs, None)
            pid = ctypes.c_int(0)
            err = libc.posix_spawn(ctypes.byref(pid), path_b, actions, attr, c_argv, c_env)
            if err:
                raise OSError(err, os.strerror(err), path)
            return pid.value
        finally:
            libc.posix_spawnattr_destroy(attr)
    finally:
        libc.posix_spawn_file_actions_destroy(actions)


def _check(err: int) -> None:
    if err:
        raise OSError(err, os.strerror(err))
