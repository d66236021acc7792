"""systemd's notify protocol (meshjobs/sdnotify.py): a real unix datagram socket stands in for
systemd, and a real meshd started with $NOTIFY_SOCKET (and $WATCHDOG_USEC) talks to it."""

from __future__ import annotations

import os
import socket
import threading
import time

import pytest

from meshjobs import sdnotify
from tests.helpers import START_S_MAX, Meshd, wait_until


class FakeSystemd:
    """The receiving end of NOTIFY_SOCKET: a bound unix datagram socket, read on demand."""

    def __init__(self, address: str | bytes) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(address)
        self.got: list[tuple[float, str]] = []

    def next(self, timeout_s: float = START_S_MAX) -> str:
        self.sock.settimeout(timeout_s)
        data = self.sock.recv(4096).decode()
        self.got.append((time.monotonic(), data))
        return data

    def until(self, pred, timeout_s: float = START_S_MAX) -> str:
        deadline = time.monotonic() + timeout_s
        while True:
            msg = self.next(max(0.01, deadline - time.monotonic()))
            if pred(msg):
                return msg

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def systemd(tmp_path):
    path = os.path.join(str(tmp_path), "notify.sock")
    s = FakeSystemd(path)
    s.path = path
    yield s
    s.close()


def lines(msg: str) -> set[str]:
    return set(msg.split("\n"))


@pytest.mark.fleet
def test_ready_once_the_member_serves_then_watchdog_pings(tmp_path, systemd):
    """READY=1 arrives once the member serves HTTP (its /healthz answers then); WATCHDOG=1
    arrives again and again while it runs; STOPPING=1 at a clean stop."""
    m = Meshd(os.path.join(str(tmp_path), "m1"),
              env={"NOTIFY_SOCKET": systemd.path, "WATCHDOG_USEC": "400000"})
    try:
        m.start(wait_ready=False)
        ready = systemd.until(lambda msg: "READY=1" in lines(msg))
        # Serving when it says so: the address file is written and /healthz answers at once.
        with open(os.path.join(m.data, "http.addr")) as f:
            m.url = "http://" + f.read().strip()
        status, body = m.request("GET", "/healthz")
        assert status == 200 and body["member"] == "m1"
        assert any(line.startswith("STATUS=serving HTTP on 127.0.0.1:") for line in lines(ready))
        pings = 0
        while pings < 3:
            if systemd.next() == "WATCHDOG=1":
                pings += 1
        assert m.proc is not None and m.proc.poll() is None
        assert m.terminate() == 0
        systemd.until(lambda msg: msg == "STOPPING=1", 10)
    finally:
        m.stop()


@pytest.mark.fleet
def test_abstract_socket_name(tmp_path):
    """An abstract socket ('@name') is reached too: READY=1 arrives there."""
    name = f"meshjobs-test-{os.getpid()}-{time.monotonic_ns()}"
    s = FakeSystemd(b"\0" + name.encode())
    m = Meshd(os.path.join(str(tmp_path), "m1"), env={"NOTIFY_SOCKET": "@" + name})
    try:
        m.start(wait_ready=False)
        s.until(lambda msg: "READY=1" in lines(msg))
        m.wait_ready()
    finally:
        m.stop()
        s.close()


@pytest.mark.fleet
def test_no_watchdog_pings_for_another_pid(tmp_path, systemd):
    """WATCHDOG_PID naming another process: READY=1 still comes, watchdog pings never do (the
    clean stop's STOPPING=1 is what comes next)."""
    m = Meshd(os.path.join(str(tmp_path), "m1"),
              env={"NOTIFY_SOCKET": systemd.path, "WATCHDOG_USEC": "200000",
                   "WATCHDOG_PID": "1"})
    try:
        m.start(wait_ready=False)
        systemd.until(lambda msg: "READY=1" in lines(msg))
        m.wait_ready()
        # Pings, if any, would come every 0.1 s; a request answered by the jobs thread and two
        # watchdog periods later, only the stop's message follows.
        assert m.request("GET", "/healthz")[0] == 200
        time.sleep(0.4)  # sleep-ok: two watchdog periods in which a ping would have been sent
        assert m.terminate() == 0
        assert systemd.next(10) == "STOPPING=1"
    finally:
        m.stop()


def test_nothing_sent_when_notify_socket_unset(systemd):
    """No NOTIFY_SOCKET: notify sends nothing and says so; no watchdog period either."""
    assert sdnotify.notify("READY=1", env={}) is False
    assert sdnotify.notify("READY=1", env={"NOTIFY_SOCKET": ""}) is False
    assert sdnotify.watchdog_period_s({"WATCHDOG_USEC": "1000000"}) is None
    # The socket that was not named received nothing; one that is named receives at once.
    assert sdnotify.notify("WATCHDOG=1", env={"NOTIFY_SOCKET": systemd.path}) is True
    assert systemd.next(5) == "WATCHDOG=1"


@pytest.mark.fleet
def test_member_without_notify_socket_serves(tmp_path, systemd):
    """A meshd started with WATCHDOG_USEC but no NOTIFY_SOCKET runs as before, and the socket
    it was not told of hears nothing from it."""
    m = Meshd(os.path.join(str(tmp_path), "m1"), env={"WATCHDOG_USEC": "200000"})
    try:
        m.start()
        assert m.terminate() == 0
    finally:
        m.stop()
    systemd.sock.setblocking(False)
    with pytest.raises(BlockingIOError):
        systemd.sock.recv(4096)


@pytest.mark.parametrize("value", [
    "relative/path", "notify.sock", "/" + "x" * 200, "@", "@" + "y" * 200, "/a\0b", "vsock:2:1",
])
def test_hostile_notify_socket_values_are_refused(value):
    """A NOTIFY_SOCKET that is no unix socket address is refused (logged), never raised."""
    assert sdnotify.socket_address(value) is None
    assert sdnotify.notify("READY=1", env={"NOTIFY_SOCKET": value}) is False


def test_unreachable_socket_is_not_fatal(tmp_path):
    """A path where no one listens: the message is dropped and notify says False."""
    assert sdnotify.notify("READY=1", env={"NOTIFY_SOCKET": str(tmp_path / "none")}) is False


@pytest.mark.parametrize("env,pid,want", [
    ({"NOTIFY_SOCKET": "/run/x", "WATCHDOG_USEC": "30000000"}, 7, 30.0),
    ({"NOTIFY_SOCKET": "/run/x", "WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "7"}, 7, 30.0),
    ({"NOTIFY_SOCKET": "/run/x", "WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "8"}, 7, None),
    ({"NOTIFY_SOCKET": "/run/x", "WATCHDOG_USEC": "0"}, 7, None),
    ({"NOTIFY_SOCKET": "/run/x", "WATCHDOG_USEC": "-5"}, 7, None),
    ({"NOTIFY_SOCKET": "/run/x", "WATCHDOG_USEC": "soon"}, 7, None),
    ({"NOTIFY_SOCKET": "/run/x", "WATCHDOG_USEC": "1", "WATCHDOG_PID": "me"}, 7, None),
    ({"WATCHDOG_USEC": "30000000"}, 7, None),
])
def test_watchdog_period(env, pid, want):
    """The period systemd asks of this process, or None when it asks another or none."""
    assert sdnotify.watchdog_period_s(env, pid) == want


def test_watchdog_withheld_while_the_jobs_thread_does_not_answer():
    """The watchdog pings only after an answer; while none comes it withholds the ping, so
    systemd restarts a member whose jobs thread is stuck."""
    answering = threading.Event()
    sent: list[str] = []
    dog = sdnotify.Watchdog(0.04, lambda timeout_s: answering.is_set(),
                            send=lambda msg: sent.append(msg) or True)
    t = threading.Thread(target=dog.run)
    t.start()
    try:
        wait_until(lambda: dog.withheld >= 3, what="three withheld pings")
        assert sent == []
        answering.set()
        wait_until(lambda: dog.pings >= 2, what="pings once the jobs thread answers")
        assert set(sent) == {"WATCHDOG=1"}
    finally:
        dog.stop()
        t.join(5)
