"""Whole tables for new workers, sent off the jobs thread: the latest dump file, as it is.

Theory of operation. A worker far behind the leader's ring of recent entries needs the whole
table. Building it from the table and packing it took the leader's jobs thread 1.4 s at 100,000
jobs (seconds at a million items, and a table of more than the link's queue could never be
sent at all). The leader has that table on disk already: the dump its forked writer wrote
(dumpwriter.py). So the node asks for `SendDump(to, body)` (node/leader.py), and the jobs thread
hands it here (`offer`); this thread opens the dump file, and sends the msgpack of `body` with
`dump` added, the file's bytes, as one F_JOB_STATE body in parts (frames.py, "Bodies too large
for one frame"). The map's and the bin's msgpack headers are written here, so the file's bytes
go from the file into the parts as they are read: never decoded, packed or held whole. Each
part waits for room in the link's queue (`Links.send_wait`) up to `table_frame_wait_ms`, so a
table larger than the queue goes at the pace the link takes it. The worker puts the parts
together, checks the dump whole (header, length, checksum, document) and the entries after it,
and installs it (node/follow.py).

Rules:
- Rule 1: bounded: at most `dump_sends_queued_max` sends wait here; an offer past that is
  dropped and counted. Nothing is lost by a drop: the worker still reports itself behind, and
  the leader sends again.
- Rule 2: nothing sent here depends on the journal: the dump was fsynced before it was renamed
  into place, and the entries in the body are committed (the jobs thread releases `SendDump`
  after its sync, like any frame).
- Rule 3: the file read is the dump in place when the send starts; a newer one renamed over it
  meanwhile does not change what this open file holds. It may be newer than the dump the node
  meant: the body says which position the entries follow (`prev`), and the worker skips what
  the dump already holds.
- Rule 4: a part that cannot be queued (the link down, or no room in time) drops the rest of
  the body, counted; the numbers of the bodies sent here (`seq`) are apart from the jobs
  thread's (they start at `SEQ_BASE`), since the worker puts parts together by (sender, seq).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import queue
import struct
import threading
from collections.abc import Iterator
from typing import Any, BinaryIO

import msgpack
import structlog

from meshjobs import limits
from meshjobs.frames import FrameType

log = structlog.get_logger(__name__)

SEQ_BASE = 1 << 62  # bodies numbered here: far from the jobs thread's Chunker, which counts from 1
_BIN32_MAX = (1 << 32) - 1
_STOP = object()


def body_head(body: dict[str, Any], dump_bytes: int) -> bytes:
    """The msgpack of `body` with one more key, `dump`, up to the first byte of its value: a
    bin of `dump_bytes` bytes. ValueError when the dump is too large for a msgpack bin."""
    if "dump" in body:
        raise ValueError("the body has its dump already")
    if dump_bytes > _BIN32_MAX:
        raise ValueError(f"a dump of {dump_bytes} bytes is over msgpack's largest bin")
    packer = msgpack.Packer(use_bin_type=True)
    out = [packer.pack_map_header(len(body) + 1)]
    for k, v in body.items():
        out += [packer.pack(k), packer.pack(v)]
    out.append(packer.pack("dump"))
    if dump_bytes < 1 << 8:
        out.append(struct.pack(">BB", 0xC4, dump_bytes))
    elif dump_bytes < 1 << 16:
        out.append(struct.pack(">BH", 0xC5, dump_bytes))
    else:
        out.append(struct.pack(">BI", 0xC6, dump_bytes))
    return b"".join(out)


def pieces(head: bytes, f: BinaryIO, size: int, part_bytes: int) -> Iterator[bytes]:
    """`head` then `size` bytes of `f`, in pieces of `part_bytes` (the last may be shorter)."""
    buf = bytearray(head)
    left = size
    while buf or left:
        while len(buf) < part_bytes and left:
            chunk = f.read(min(part_bytes - len(buf), left))
            if not chunk:
                raise OSError(f"the dump file ended {left} bytes early")
            buf += chunk
            left -= len(chunk)
        yield bytes(buf[:part_bytes])
        del buf[:part_bytes]


class DumpSender:
    """The thread that sends dumps to new workers (see the module's rules). `run` is its
    body (daemon.py starts it); `offer` is for the jobs thread."""

    def __init__(self, links: Any, dump_path: str, *,
                 part_bytes: int = limits.frame_part_bytes,
                 parts_max: int = limits.frame_parts_max,
                 queued_max: int = limits.dump_sends_queued_max,
                 wait_ms: int = limits.table_frame_wait_ms) -> None:
        self._links = links
        self._path = dump_path
        self._part_bytes = part_bytes
        self._parts_max = parts_max
        self._wait_ms = wait_ms
        self._queue: queue.Queue = queue.Queue(maxsize=queued_max)
        self._seq = itertools.count(SEQ_BASE)  # taken by this thread only
        self._stopping = threading.Event()
        self.counts = {"dumps_sent": 0, "dumps_dropped_queue": 0, "dumps_dropped_link": 0,
                       "dumps_failed": 0, "dump_bytes_sent": 0}

    def offer(self, to: str, body: dict[str, Any]) -> bool:
        """Send this member's dump to `to` with `body` (a `SendDump`'s); False when too many
        wait already (dropped, counted)."""
        try:
            self._queue.put_nowait((to, body))
        except queue.Full:
            self.counts["dumps_dropped_queue"] += 1
            return False
        return True

    def stop(self) -> None:
        self._stopping.set()
        with contextlib.suppress(queue.Full):
            self._queue.put_nowait(_STOP)

    def run(self) -> None:
        while not self._stopping.is_set():
            try:
                job = self._queue.get(timeout=limits.stop_poll_ms / 1000)
            except queue.Empty:
                continue
            if job is _STOP:
                return
            to, body = job
            self.send(to, body)

    def send(self, to: str, body: dict[str, Any]) -> bool:
        """Send the dump file now, with `body`, to `to`: True once every part is queued."""
        try:
            f = open(self._path, "rb")
        except OSError as e:
            self.counts["dumps_failed"] += 1
            log.error("dump_send_failed", to=to, path=self._path, error=str(e))
            return False
        with f:
            size = os.fstat(f.fileno()).st_size
            try:
                head = body_head(body, size)
            except ValueError as e:
                self.counts["dumps_failed"] += 1
                log.error("frame_too_large", to=to, ftype="F_JOB_STATE", bytes=size, error=str(e))
                return False
            parts = -(-(len(head) + size) // self._part_bytes)
            if parts > self._parts_max:
                self.counts["dumps_failed"] += 1
                log.error("frame_too_large", to=to, ftype="F_JOB_STATE", bytes=len(head) + size,
                          note=f"more than frame_parts_max={self._parts_max} parts")
                return False
            seq = next(self._seq)
            try:
                for k, data in enumerate(pieces(head, f, size, self._part_bytes)):
                    part = {"seq": seq, "part": k, "parts": parts, "data": data}
                    if not self._links.send_wait(to, FrameType.F_JOB_STATE, part, self._wait_ms):
                        self.counts["dumps_dropped_link"] += 1
                        log.info("dump_send_dropped", to=to, part=k, parts=parts)
                        return False
            except OSError as e:
                self.counts["dumps_failed"] += 1
                log.error("dump_send_failed", to=to, path=self._path, error=str(e))
                return False
        self.counts["dumps_sent"] += 1
        self.counts["dump_bytes_sent"] += len(head) + size
        return True
