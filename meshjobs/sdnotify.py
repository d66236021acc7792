"""systemd's notify protocol at the edge: the member says when it serves, and that it lives.

Theory of operation. A service of `Type=notify` tells systemd it is ready by sending
`READY=1`; with `WatchdogSec=` it must then send `WATCHDOG=1` more often than that, or systemd
restarts it. Each message is one datagram of "KEY=VALUE" lines to the unix socket that
`$NOTIFY_SOCKET` names: a file path, or an abstract socket name when it starts with '@' (the '@'
stands for the leading NUL byte). systemd gives the watchdog's period in `$WATCHDOG_USEC`, and in
`$WATCHDOG_PID` the process it expects the pings from.

Rules:
- Nothing is sent, and nothing fails, when `$NOTIFY_SOCKET` is unset (meshd run by hand, in a
  container, or by a unit of `Type=simple`): `notify` returns False.
- A message that cannot be sent (no such socket, a name that is no unix socket address) is
  logged and dropped: systemd then restarts or fails the service, as it should; the member itself
  does not stop for it.
- The watchdog pings every half period (what sd_watchdog_enabled(3) advises), and only after
  the jobs thread has answered a request within that half period: a jobs thread that is stuck
  or gone stops the pings, and systemd restarts the member.
"""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Callable, Mapping

import structlog

log = structlog.get_logger(__name__)

# sockaddr_un's sun_path holds 108 bytes, the NUL that ends a path included.
_SUN_PATH_BYTES = 108


def socket_address(value: str | None) -> str | bytes | None:
    """The address `$NOTIFY_SOCKET` names: a path, or (from '@name') an abstract name as bytes
    with its leading NUL; None when unset, empty or not a unix socket address."""
    if not value:
        return None
    if value.startswith("@"):
        name = b"\0" + value[1:].encode()
        return name if 1 < len(name) <= _SUN_PATH_BYTES else None
    if not value.startswith("/") or len(value.encode()) >= _SUN_PATH_BYTES or "\0" in value:
        return None
    return value


def notify(message: str, env: Mapping[str, str] | None = None) -> bool:
    """Send `message` ("READY=1", "WATCHDOG=1", ...) to systemd. True if it was sent; False when
    no notify socket is set, or it could not be reached (said in the log)."""
    env = os.environ if env is None else env
    raw = env.get("NOTIFY_SOCKET")
    if not raw:
        return False
    addr = socket_address(raw)
    if addr is None:
        log.warning("sd_notify_bad_socket", notify_socket=raw[:120],
                    what_to_do="NOTIFY_SOCKET must be an absolute path or an '@' abstract name")
        return False
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
            s.connect(addr)
            s.send(message.encode())
    except OSError as e:
        log.warning("sd_notify_failed", notify_socket=raw[:120], message=message.split("\n")[0],
                    error=str(e))
        return False
    return True


def watchdog_period_s(env: Mapping[str, str] | None = None, pid: int | None = None) -> float | None:
    """The watchdog period systemd asks for (`$WATCHDOG_USEC`), if it asks this process
    (`$WATCHDOG_PID` unset or this pid) and a notify socket is set; None otherwise."""
    env = os.environ if env is None else env
    if not env.get("NOTIFY_SOCKET"):
        return None
    try:
        usec = int(env.get("WATCHDOG_USEC", ""))
    except ValueError:
        return None
    if usec <= 0:
        return None
    wanted = env.get("WATCHDOG_PID")
    if wanted:
        try:
            if int(wanted) != (os.getpid() if pid is None else pid):
                return None
        except ValueError:
            return None
    return usec / 1_000_000


class Watchdog:
    """Pings systemd's watchdog every half `period_s` while `alive(timeout_s)` says the member
    lives (it waits at most timeout_s for the jobs thread's answer). Run on a thread of the
    daemon's; `stop` ends it."""

    def __init__(self, period_s: float, alive: Callable[[float], bool],
                 send: Callable[[str], bool] = notify) -> None:
        self.every_s = period_s / 2
        self._alive = alive
        self._send = send
        self._stop = threading.Event()
        self.pings = 0
        self.withheld = 0

    def run(self) -> None:
        while not self._stop.wait(self.every_s):
            if self._alive(self.every_s):
                if self._send("WATCHDOG=1"):
                    self.pings += 1
            else:
                self.withheld += 1
                log.warning("watchdog_withheld", why="the jobs thread did not answer within "
                            f"{self.every_s:.1f} s", withheld=self.withheld)

    def stop(self) -> None:
        self._stop.set()
