"""The history file: a JSON-lines record of every job this member saw forgotten or expired.

When a committed `forget`, `expire` or bulk forget drops a job, the table hands the job's final
record to `History.offer` (its `on_forget` hook) on the jobs thread. `offer` only puts it on a
bounded queue (a full queue drops the record and counts it): the jobs thread never waits for
this disk. The history writer thread appends one line per record to `history.jsonl` in the data
folder and rotates it by size: `history.jsonl` becomes `history.1.jsonl`, that one
`history.2.jsonl`, ... and files past `[history] keep` are deleted.

Durability: history is a convenience record, not part of the durable log. Lines are written and
flushed to the kernel, never fsynced: a machine crash may lose the last records or leave a
torn last line. A reader skips (and counts) any line that is not a whole JSON object, so a torn
line is never fatal. Records come in the order this member applied the entries; each carries
the entry's time (`at`, seconds since the epoch, as the leader stamped it).

A job run again (meshjobs.reruns: `rerun`, or an automatic restart or resubmit) hands over the
record of the run that ended the same way, with why "rerun", "restart" or "resubmit": the
earlier runs of a job are in its history too.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import threading
from typing import Any

from meshjobs import limits
from meshjobs.datadir import private_opener

FILE = "history.jsonl"


def rotated_name(k: int) -> str:
    return f"history.{k}.jsonl"


REDACTED = "<redacted>"  # as meshjobs/identity.py shows a secret to who may not see it


def line_of(record: dict, why: str, t_ms: int, index: int, member: str) -> bytes | None:
    """One record's line (with its newline), at most history_line_bytes_max bytes: a record too
    large keeps its program's name only, and no environment; None if even that is too large."""
    # No env values, ever (keys only), and no notify URL: the file outlives the jobs' secrets.
    record = {**record, "env": dict.fromkeys(record.get("env") or {}, REDACTED),
              **({"notify": REDACTED} if record.get("notify") is not None else {})}
    row = {"at": t_ms / 1000.0, "why": why, "index": index, "member": member, "job": record}
    line = json.dumps(row, separators=(",", ":"), ensure_ascii=False).encode("utf-8",
                                                                              "surrogatepass")
    if len(line) < limits.history_line_bytes_max:
        return line + b"\n"
    job = dict(record)
    argv = job.get("argv") or [""]
    job.update({"argv": [str(argv[0])[:256]], "env": {}, "truncated": True})
    line = json.dumps({**row, "job": job}, separators=(",", ":"),
                      ensure_ascii=False).encode("utf-8", "surrogatepass")
    return line + b"\n" if len(line) < limits.history_line_bytes_max else None


class History:
    """The bounded queue to the history writer, and the writer (`run`, on its own thread)."""

    def __init__(self, folder: str, member: str, bytes_max: int, keep: int,
                 log: Any = None) -> None:
        self.folder = folder
        self.member = member
        self.bytes_max = bytes_max
        self.keep = keep
        self.log = log
        self._q: queue.Queue[tuple[dict, str, int, int] | None] = queue.Queue(
            limits.history_queue_max)
        # The log index of the last record written, and the jobs written at it: a member that
        # restarts applies its journal again, and must not write those records twice.
        self._last: tuple[int, set[str]] | None = None
        self._tail_checked = False
        self._stop = threading.Event()
        self.counts = {"history_written": 0, "history_dropped": 0, "history_too_large": 0,
                       "history_rotations": 0, "history_write_errors": 0,
                       "history_replayed": 0}

    @property
    def path(self) -> str:
        return os.path.join(self.folder, FILE)

    def offer(self, record: dict, why: str, t_ms: int, index: int) -> None:
        """The table's on_forget hook: never blocks (a full queue drops the record)."""
        if not self.bytes_max:
            return
        try:
            self._q.put_nowait((record, why, t_ms, index))
        except queue.Full:
            self.counts["history_dropped"] += 1

    def stop(self) -> None:
        self._stop.set()
        with contextlib.suppress(queue.Full):
            self._q.put_nowait(None)

    def run(self) -> None:
        """The writer thread: append what comes, until stopped (what is queued is written)."""
        while True:
            try:
                got = self._q.get(timeout=1.0)
            except queue.Empty:
                if self._stop.is_set():
                    return
                continue
            if got is None:
                if self._stop.is_set() and self._q.empty():
                    return
                continue
            self.write(*got)

    def write(self, record: dict, why: str, t_ms: int, index: int) -> None:
        if self._last is None:
            self._last = last_written(self.folder)
        last, ids = self._last
        if index < last or (index == last and record.get("id") in ids):
            self.counts["history_replayed"] += 1
            return
        line = line_of(record, why, t_ms, index, self.member)
        if line is None:
            self.counts["history_too_large"] += 1
            return
        try:
            try:
                size = os.path.getsize(self.path)
            except FileNotFoundError:
                size = 0
            if size and size + len(line) > self.bytes_max:
                self._rotate()
            elif size and not self._tail_checked:
                # A crash may have left a torn last line: end it, so that it stays the only
                # damaged line and this record is whole.
                with open(self.path, "rb") as f:
                    f.seek(size - 1)
                    if f.read(1) != b"\n":
                        line = b"\n" + line
            self._tail_checked = True
            with open(self.path, "ab", opener=private_opener) as f:
                f.write(line)
                f.flush()  # to the kernel; no fsync: see the module's words on durability
            self.counts["history_written"] += 1
            if index > last:
                self._last = (index, set())
            self._last[1].add(str(record.get("id")))
        except OSError as e:
            # A full or failing disk loses history records, counted and logged; the member
            # goes on (its durable state is the journal, which has its own fail-stop).
            self.counts["history_write_errors"] += 1
            if self.log is not None:
                self.log.warning("history_write_failed", error=str(e), path=self.path)

    def _rotate(self) -> None:
        self.counts["history_rotations"] += 1
        if self.keep <= 0:
            os.unlink(self.path)
            return
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(self.folder, rotated_name(self.keep)))
        for k in range(self.keep - 1, 0, -1):
            with contextlib.suppress(FileNotFoundError):
                os.replace(os.path.join(self.folder, rotated_name(k)),
                           os.path.join(self.folder, rotated_name(k + 1)))
        os.replace(self.path, os.path.join(self.folder, rotated_name(1)))


def last_written(folder: str) -> tuple[int, set[str]]:
    """The highest log index in the newest history file that has records, and the ids of the
    jobs written at it ((0, {}) when there are none)."""
    for path in files_newest_first(folder):
        try:
            with open(path, "rb") as f:
                f.seek(0, os.SEEK_END)
                size = f.tell()
                f.seek(max(0, size - 4 * limits.history_line_bytes_max))
                raw = f.read()
        except FileNotFoundError:
            continue
        best, ids = 0, set()
        for ln in raw.split(b"\n"):
            try:
                row = json.loads(ln)
                index, job_id = row["index"], row["job"]["id"]
            except (ValueError, TypeError, KeyError):
                continue  # a torn line, or the cut first one
            if isinstance(index, int) and index > best:
                best, ids = index, set()
            if index == best:
                ids.add(str(job_id))
        if best:
            return best, ids
    return 0, set()


def files_newest_first(folder: str) -> list[str]:
    """history.jsonl, then history.1.jsonl, history.2.jsonl, ... as long as they exist."""
    out = [os.path.join(folder, FILE)]
    k = 1
    while k <= limits.history_keep_files_max:
        path = os.path.join(folder, rotated_name(k))
        if not os.path.exists(path):
            break
        out.append(path)
        k += 1
    return out


def read(folder: str, since_s: float | None, limit: int) -> dict:
    """The newest `limit` records at or after `since_s` (seconds since the epoch), newest
    first; lines that are not whole JSON records (a torn last line) are skipped and counted.
    At most history_read_bytes_max bytes of files are looked at, newest first."""
    records: list[dict] = []
    skipped = 0
    budget = limits.history_read_bytes_max
    done = False
    for path in files_newest_first(folder):
        try:
            with open(path, "rb") as f:
                f.seek(0, os.SEEK_END)
                size = f.tell()
                start = max(0, size - budget)
                f.seek(start)
                raw = f.read(size - start)
        except FileNotFoundError:
            continue
        budget -= len(raw)
        lines = raw.split(b"\n")
        if start > 0:
            lines = lines[1:]  # the first line was cut by the budget: not a record
        for ln in reversed(lines):
            if not ln.strip():
                continue
            try:
                row = json.loads(ln)
            except ValueError:
                skipped += 1
                continue
            if not isinstance(row, dict) or not isinstance(row.get("at"), (int, float)) or \
                    not isinstance(row.get("job"), dict):
                skipped += 1
                continue
            if since_s is not None and row["at"] < since_s:
                continue
            records.append(row)
            if len(records) >= limit:
                done = True
                break
        if done or budget <= 0:
            break
    return {"order": "newest_first", "records": records, "skipped_lines": skipped,
            "more": done}
