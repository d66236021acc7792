"""What meshd says when it cannot listen on one of its addresses (HTTP, member links, Raft).

Theory of operation: the three listeners bind in different places (HTTP on its event loop
thread, the member links in their constructor, Raft inside pysyncobj, which wraps the OSError
in its own exceptions), but a member that cannot bind any of them stops the same way: a log
line and a line on stderr naming the part, the address, what is wrong (the OSError's errno:
another process on the port, an address not of this machine, a port that needs privileges)
and what to do, then exit status `EXIT_CODE` (meshd's status for a member that cannot start
as configured, as for a bad config), with nothing written as ready and no traceback.

Rule 1: no IO here: the caller binds, catches and prints; this module only reads the error.
"""

from __future__ import annotations

import errno

EXIT_CODE = 2  # as for a bad config: the member cannot start as configured

# part -> (its name for people, where its address is set: the hint of what to change).
PARTS = {
    "http": ("HTTP", "[http] listen"),
    "peer": ("member links", "the config's peer key"),
    "raft": ("Raft", "the config's raft key"),
}
# Chained exceptions looked through for the OSError (pysyncobj wraps it twice).
_CHAIN_MAX = 8


def bind_error(exc: BaseException | None) -> OSError | None:
    """The OSError that made a bind fail: `exc` itself, or one it was raised from (pysyncobj
    raises its own exception from ours, which was raised from the socket's)."""
    for _ in range(_CHAIN_MAX):
        if exc is None:
            return None
        if isinstance(exc, OSError):
            return exc
        exc = exc.__cause__ or exc.__context__
    return None


def where(host: str, port: int) -> str:
    """host:port, with an IPv6 host in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def refusal(part: str, host: str, port: int, exc: BaseException | None) -> str:
    """The line for stderr (after "meshd: ") when `part` ("http", "peer", "raft") cannot listen
    on host:port; `exc` is what the bind raised (None: no reason known)."""
    name, key = PARTS[part]
    addr = where(host, port)
    flag = f"--{part}"
    err = bind_error(exc)
    code = err.errno if err is not None else None
    if code == errno.EADDRINUSE:
        why = f"another process listens on {addr} (ss -ltnp to see which; another meshd?)"
        todo = f"stop it, or set {key} to a free port (or use {flag})"
    elif code == errno.EADDRNOTAVAIL:
        why = f"{host} is not an address of this machine"
        todo = f"set {key} to one of its addresses (ip -brief addr) (or use {flag})"
    elif type(err).__name__ == "gaierror":  # socket.gaierror: the host name did not resolve
        why = f"{host} does not resolve to an address ({err.strerror or err})"
        todo = f"fix the name (or its DNS entry), or set {key} to an IP address (or use {flag})"
    elif code in (errno.EACCES, errno.EPERM):
        why = f"port {port} needs privileges (ports below 1024 do)"
        todo = (f"set {key} to a port of 1024 or more (or use {flag}), or give meshd "
                "CAP_NET_BIND_SERVICE")
    else:
        detail = (err.strerror or str(err)) if err is not None else "no reason given"
        why = f"{detail}; is another meshd running, or is {host} not an address of this machine?"
        todo = f"check {key} (or use {flag})"
    return f"cannot listen on {name} address {addr}: {why}; {todo}"
