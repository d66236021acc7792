"""Item logs over real links on 127.0.0.1: a member asks another for a running item's output
(F_LOG_GET) and gets it (F_LOG_PUT); garbage from a peer is dropped and counted; the queues are
bounded. The spool files are real files; the runs are described by a small table standing in
for the driver (its `read_output` and `accepted`), which the fleet tests in test_item_logs.py cover
for real."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import pytest

from meshjobs import limits
from meshjobs.frames import Frame, FrameType, LogAsk, LogPiece, log_piece_body
from meshjobs.itemlogs import ItemLogs
from tests.helpers import LinksMember, wait_until

WAIT_S = 30.0



class Runs:
    """The driver's side that item logs read: spool files of runs, and runs accepted."""

    def __init__(self) -> None:
        self.spools: dict[tuple[str, int, int], tuple[str, str, bool]] = {}
        self.waiting: set[tuple[str, int, int]] = set()

    def read_output(self, key: tuple[str, int, int], stream: str, offset: int,
                    size: int) -> tuple[bytes, int, bool] | None:
        got = self.spools.get(key)
        if got is None:
            return None
        with open(got[0] if stream == "stdout" else got[1], "rb") as f:
            f.seek(offset)
            return f.read(size), os.fstat(f.fileno()).st_size, got[2]

    def accepted(self, key: tuple[str, int, int]) -> bool:
        return key in self.spools or key in self.waiting


class Member(LinksMember):
    def __init__(self, name: str, base: Path, serve: bool = True) -> None:
        self.dir = base / name
        self.dir.mkdir(parents=True)
        self.runs = Runs()
        super().__init__(name, run=False)
        self.logs = ItemLogs(name, self.runs, self.links)
        if serve:
            self.threads.append(threading.Thread(target=self.logs.run, daemon=True))
        self.start()

    def _on_frame(self, peer: str, frame: Frame) -> None:
        if frame.type in (FrameType.F_LOG_GET, FrameType.F_LOG_PUT):
            self.logs.frame(peer, frame.type, frame.body)

    def run(self, job: str, index: int, epoch: int, out: bytes, err: bytes = b"",
            ended: bool = False) -> None:
        base = self.dir / f"{job}-{index}-{epoch}"
        Path(f"{base}.out").write_bytes(out)
        Path(f"{base}.err").write_bytes(err)
        self.runs.spools[(job, index, epoch)] = (f"{base}.out", f"{base}.err", ended)

    def dropped(self, reason: str) -> int:
        return self.logs.stats()["dropped"].get(reason, 0)

    def stop(self) -> None:
        self.logs.stop()
        super().stop()


@pytest.fixture
def pair(tmp_path):
    a, b = Member("a", tmp_path), Member("b", tmp_path)
    a.links.connect("b", b.links.address)
    wait_until(lambda: a.links.peers().get("b", {}).get("up")
             and b.links.peers().get("a", {}).get("up"), what="a and b linked")
    yield a, b
    a.stop()
    b.stop()


def ask(a: Member, *args: Any):
    return a.logs.ask("b", *args).result(WAIT_S)


def test_a_running_items_output_from_another_member(pair):
    """What the run wrote so far, from an offset, at most the size asked; `end` only once the
    run ended and the answer reaches the end of its output; stderr likewise."""
    a, b = pair
    b.run("j", 0, 5, b"hello world\n", b"oops\n")
    p = ask(a, "j", 0, 5, "stdout", 0, 5)
    assert (p.data, p.end, p.error) == (b"hello", False, None)
    p = ask(a, "j", 0, 5, "stdout", 6, 100)
    assert (p.data, p.end) == (b"world\n", False)
    assert ask(a, "j", 0, 5, "stderr", 0, 100).data == b"oops\n"
    with open(b.runs.spools[("j", 0, 5)][0], "ab") as f:
        f.write(b"more\n")
    b.runs.spools[("j", 0, 5)] = (*b.runs.spools[("j", 0, 5)][:2], True)
    p = ask(a, "j", 0, 5, "stdout", 12, 3)
    assert (p.data, p.end) == (b"mor", False)
    p = ask(a, "j", 0, 5, "stdout", 12, 100)
    assert (p.data, p.end) == (b"more\n", True)
    p = ask(a, "j", 0, 5, "stdout", 1000, 100)
    assert (p.data, p.end) == (b"", True)
    st = b.logs.stats()
    assert st["served"] >= 6 and st["served_bytes"] >= len(b"hello world\noops\nmore\n")


def test_unknown_and_unavailable_runs(pair):
    """Another epoch, or no such run: "unknown"; a run accepted without a spool file (a python
    item, or not spawned yet): "unavailable"; a spool file gone (stored): "unknown"."""
    a, b = pair
    b.run("j", 0, 5, b"x")
    assert ask(a, "j", 0, 4, "stdout", 0, 10).error == "unknown"
    assert ask(a, "other", 0, 5, "stdout", 0, 10).error == "unknown"
    b.runs.waiting.add(("py", 1, 2))
    assert ask(a, "py", 1, 2, "stdout", 0, 10).error == "unavailable"
    os.unlink(b.runs.spools[("j", 0, 5)][0])
    assert ask(a, "j", 0, 5, "stdout", 0, 10).error == "unknown"


def test_asks_that_cannot_be_sent_are_answered_none(pair, tmp_path, monkeypatch):
    """An ask of a member with no link, of ourselves, or beyond log_asks_max, is None at
    once (HTTP answers 503); `forget` and `stop` answer the waiting ones None."""
    a, b = pair
    monkeypatch.setattr(limits, "log_asks_max", 16)  # (a bound well within the links' queue)
    assert a.logs.ask("nobody", "j", 0, 1, "stdout", 0, 1).result(1) is None
    assert a.logs.ask("a", "j", 0, 1, "stdout", 0, 1).result(1) is None
    alone = ItemLogs("c", Runs(), None)
    assert alone.ask("b", "j", 0, 1, "stdout", 0, 1).result(1) is None
    quiet = Member("q", tmp_path, serve=False)  # never answers
    try:
        a.links.connect("q", quiet.links.address)
        wait_until(lambda: a.links.peers().get("q", {}).get("up"), what="a and q linked")
        futs = [a.logs.ask("q", "j", 0, 1, "stdout", 0, 1) for _ in range(limits.log_asks_max)]
        assert not any(f.done() for f in futs)
        assert a.logs.stats()["waiting"] == limits.log_asks_max
        assert a.logs.ask("q", "j", 0, 1, "stdout", 0, 1).result(1) is None
        a.logs.forget(futs[0])
        assert futs[0].result(1) is None and a.logs.stats()["asks_timed_out"] == 1
        a.logs.stop()
        assert all(f.result(1) is None for f in futs)
        assert a.logs.stats()["waiting"] == 0
    finally:
        quiet.stop()


@pytest.mark.parametrize("body", [
    {}, {"q": 1}, {"q": "1", "j": "j", "i": 0, "e": 1, "s": "stdout", "o": 0, "n": 1},
    {"q": 1, "j": "j", "i": 0, "e": 1, "s": "stdin", "o": 0, "n": 1},
    {"q": 1, "j": "j", "i": 0, "e": 1, "s": "stdout", "o": -1, "n": 1},
    {"q": 1, "j": "j", "i": 0, "e": 1, "s": "stdout", "o": 0, "n": 1 << 40},
    {"q": 1, "j": "../../etc/passwd" * 20, "i": 0, "e": 1, "s": "stdout", "o": 0, "n": 1},
])
def test_garbage_asks_are_dropped_and_counted(pair, body):
    """A bad F_LOG_GET is dropped as bad_get, answered with nothing, and the member goes on."""
    a, b = pair
    assert a.links.send("b", FrameType.F_LOG_GET, body)
    wait_until(lambda: b.dropped("bad_get") == 1, what="the bad ask counted")
    b.run("j", 0, 5, b"still here")
    assert ask(a, "j", 0, 5, "stdout", 0, 100).data == b"still here"


def test_garbage_and_unasked_answers_are_dropped_and_counted(pair, tmp_path):
    """A malformed F_LOG_PUT is bad_put; one nobody asked for, or from another member than the
    one asked, is unasked; neither resolves an ask."""
    a, b = pair
    b.links.send("a", FrameType.F_LOG_PUT, {"q": 1, "data": "text", "end": False, "err": None})
    wait_until(lambda: a.dropped("bad_put") == 1, what="the bad answer counted")
    b.links.send("a", FrameType.F_LOG_PUT, log_piece_body(LogPiece(999, b"x", False)))
    wait_until(lambda: a.dropped("unasked") == 1, what="the unasked answer counted")
    quiet = Member("q", tmp_path, serve=False)
    try:
        a.links.connect("q", quiet.links.address)
        wait_until(lambda: a.links.peers().get("q", {}).get("up"), what="a and q linked")
        fut = a.logs.ask("q", "j", 0, 1, "stdout", 0, 1)
        q = fut.q  # type: ignore[attr-defined]
        b.links.send("a", FrameType.F_LOG_PUT, log_piece_body(LogPiece(q, b"forged", True)))
        wait_until(lambda: a.dropped("unasked") == 2, what="the answer from the wrong member")
        assert not fut.done()
    finally:
        quiet.stop()


def test_the_inbox_is_bounded(tmp_path):
    """F_LOG_GETs beyond log_inbox_max waiting for the item-log thread are dropped, counted."""
    m = Member("m", tmp_path, serve=False)
    try:
        body = {"q": 1, "j": "j", "i": 0, "e": 1, "s": "stdout", "o": 0, "n": 1}
        for _ in range(limits.log_inbox_max + 10):
            m.logs.frame("x", FrameType.F_LOG_GET, body)
        assert m.dropped("inbox_full") == 10
    finally:
        m.stop()


def test_read_local_reads_this_members_spool(tmp_path):
    """The local read HTTP uses for items run here: the same answers without any link."""
    runs = Runs()
    out = tmp_path / "o"
    out.write_bytes(b"abcdef")
    runs.spools[("j", 2, 3)] = (str(out), str(tmp_path / "missing"), True)
    logs = ItemLogs("m", runs, None)
    p = logs.read_local(LogAsk(0, "j", 2, 3, "stdout", 2, 3))
    assert (p.data, p.end) == (b"cde", False)
    p = logs.read_local(LogAsk(0, "j", 2, 3, "stdout", 2, 100))
    assert (p.data, p.end) == (b"cdef", True)
    assert logs.read_local(LogAsk(0, "j", 2, 3, "stderr", 0, 1)).error == "unknown"
