"""What an earlier run of meshd left running: the log that lets a later run find its items'
processes, and the sweep that ends them before the member takes a lease.

Theory of operation. Every item (and every python worker) runs in a session, hence a process
group, of its own: meshd kills the group when the item ends, is cut or passes its runtime. A
meshd that dies without its clean stop (kill -9, an out-of-memory kill, its own fail-stop) kills
nothing: its items run on, beyond their runtime, their cancel and `member stop`, beside their own
re-run once their leases are revoked. Where the kernel allows, an item's first process dies with
the thread that started it (the launcher's PR_SET_PDEATHSIG, meshjobs/wall.py), but that reaches
neither what the item started in its group nor items started without the launcher. So meshd
appends a line to a log under `running/` in the data folder for each process it starts and
reaps, and its next start, before any lease, ends every process the logs it finds name, then
removes them.

A log (`running/RUN-GEN`, one per run of meshd) is lines of ASCII:

    meshjobs-running 1 BOOT PIDNS DEV INO MESHD_PID MESHD_START   the header: where, and by whom
    b SEQ item JOB INDEX EPOCH | b SEQ worker                      before a process starts
    s SEQ PGID START                                               once it runs
    e SEQ                                                          once it was reaped

Rules:
1. A process's `b` line is written before it starts and its `s` line once it runs: its pid
   (which is its session's and group's id) and its start time (/proc/PID/stat, in clock ticks
   since boot); its `e` line once it is reaped. A process without a `b` line can therefore only
   be one that never started. Each line is one write() to a file opened O_APPEND: a process
   that dies leaves whole lines (a short write is cut off again at once).
2. No fsync. The log must outlive meshd, not the machine: a machine that goes down takes every
   item with it, and a log of an earlier boot (its BOOT) names nothing. A write() is in the page
   cache, which the death of meshd does not lose, before the process starts. A `b` line that
   cannot be written fails the item (nothing ran); an `s` line, and the process is killed and
   the member stops, as for a process it cannot watch (meshjobs/pidwatch.py); an `e` line is
   let go (its pid is found gone or reused at the next start).
3. The cost per start is three short appends and one read of /proc/PID/stat. A log that grew
   past leftover_log_bytes_max and twice what still runs starts anew: a new file with the
   header and the lines of what still runs, then the old one is removed (both at once after a
   crash in between: the same processes twice, which the sweep does not mind).
4. A log is acted on only when it was written on this boot, in this pid namespace, for this
   data folder (a copy of a data folder names another member's items), by a meshd that no
   longer runs. Any other is removed (or, while its meshd runs, left alone) without a signal.
5. Identity (pids are reused: pid_max may be 32768). An entry's group is the item's when its
   leader (pid = group id) runs, or is a zombie, with the recorded start time and still leads
   its session and group (as an item's first process does for good): then every process of
   that group or session is the item's (neither id is handed out again while a process has
   it). When the leader is gone, the group id may have been freed and taken by another group:
   then a process of the group or session is the item's only if it started after the leader and
   its environment names the item (MESH_JOB_ID, MESH_ITEM_INDEX, MESH_LEASE_EPOCH). An entry
   with no `s` line (meshd died between the start and the line) names the processes that
   started after that meshd and whose environment names the item, and the session they lead. A
   worker names no item: only a worker whose leader is checked is ended.
6. A hostile log is refused whole, and nothing it names is signalled: a file that is not
   regular, over leftover_file_bytes_max, with a line over leftover_line_bytes_max or not of the
   shapes above, lines out of order (an `s` or `e` of no `b`, twice, a `b` not after the last),
   or naming pid 0 or 1, a pid past pid_max, or this meshd, its parent, group or session. It is
   renamed NAME.refused and an error names it. More than leftover_files_max files: none is
   read, and an error says what to do.
7. Signals go through a pidfd opened and then checked against the start time seen in /proc, so
   the pid cannot have changed hands in between; a group whose leader was checked is killed with
   killpg first (a process forking meanwhile cannot escape it). meshd waits up to
   leftover_end_wait_ms for them to end, and looks again (up to leftover_passes_max times) while
   processes of the logs are still found. A log is removed once nothing it names runs; one with
   processes that could not be signalled (EPERM) or did not end is kept for the next start, and
   an error says what to do. Each entry that had processes left is logged (`leftover_ended`).
8. Not covered: a process that left its session (setsid) and cleared its environment, and the
   processes a python function started once its worker is gone; only a cgroup would hold those.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import selectors
import signal
import stat
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import structlog

from meshjobs import limits

FOLDER = "running"  # in the data folder
REFUSED = ".refused"  # a refused log is renamed NAME + REFUSED
MAGIC = "meshjobs-running"
_VERSION = 1

_HEAD_RE = re.compile(rb"meshjobs-running 1 ([0-9A-Za-z-]{1,64}) ([0-9]{1,20}) ([0-9]{1,20}) "
                      rb"([0-9]{1,20}) ([0-9]{1,10}) ([0-9]{1,20})\n")
_BEGIN_RE = re.compile(rb"b ([0-9]{1,20}) (?:item ([A-Za-z0-9._-]{1,128}) ([0-9]{1,10}) "
                       rb"([0-9]{1,20})|worker)\n")
_STARTED_RE = re.compile(rb"s ([0-9]{1,20}) ([0-9]{1,10}) ([0-9]{1,20})\n")
_ENDED_RE = re.compile(rb"e ([0-9]{1,20})\n")

RunKey = tuple[str, int, int]  # (job_id, index, epoch)


class RecordRefused(ValueError):
    """A log meshd did not write as it is (Rule 6); the message says what is wrong."""


# --- /proc ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Proc:
    """One process as /proc/PID/stat has it."""

    pid: int
    state: str  # R, S, D, Z, ...
    pgid: int
    sid: int
    start: int  # clock ticks after boot


def _parse_stat(pid: int, data: bytes) -> Proc | None:
    # "pid (comm) state ppid pgrp session ...": comm may hold spaces and parentheses.
    fields = data[data.rfind(b")") + 2:].split()
    try:
        return Proc(pid, fields[0].decode("ascii", "replace"), int(fields[2]), int(fields[3]),
                    int(fields[19]))
    except (IndexError, ValueError):
        return None


def proc(pid: int) -> Proc | None:
    """The process `pid` now, or None when there is none."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read(4096)
    except OSError:
        return None
    return _parse_stat(pid, data)


def _scan() -> dict[int, Proc]:
    out = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            p = proc(int(name))
            if p is not None:
                out[p.pid] = p
    return out


def _read_text(path: str) -> str:
    try:
        with open(path) as f:
            return f.read(256).strip()
    except OSError:
        return ""


def _pidns() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def _pid_max() -> int:
    try:
        return int(_read_text("/proc/sys/kernel/pid_max"))
    except ValueError:
        return 1 << 22  # the kernel's own ceiling (PID_MAX_LIMIT on 64-bit)


def _names_item(pid: int, key: RunKey) -> bool:
    """Whether process `pid`'s environment names the item `key` (as the driver gives it)."""
    want = {f"MESH_JOB_ID={key[0]}".encode(), f"MESH_ITEM_INDEX={key[1]}".encode(),
            f"MESH_LEASE_EPOCH={key[2]}".encode()}
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            data = f.read(limits.leftover_environ_bytes_max + 1)
    except OSError:
        return False  # gone, or not ours to read: not known to be the item's
    if len(data) > limits.leftover_environ_bytes_max:
        return False
    return want <= set(data.split(b"\0"))


# --- The log, written by the driver thread ---------------------------------------------------------

class Record:
    """This run's log of the processes it starts (Rules 1-3). Not thread-safe: the driver
    thread, the only one that starts processes, is its one user (and `close` comes after it
    ended)."""

    def __init__(self, data: str, failpoints: Any = None) -> None:
        """OSError when its folder cannot be made."""
        self.folder = os.path.join(data, FOLDER)
        os.makedirs(self.folder, mode=0o700, exist_ok=True)
        self._failpoints = failpoints
        me = proc(os.getpid())
        st = os.stat(self.folder)
        boot = re.sub(r"[^0-9A-Za-z-]", "", _read_text("/proc/sys/kernel/random/boot_id"))[:64]
        self._head = (f"{MAGIC} {_VERSION} {boot or 'none'} {_pidns()} {st.st_dev} {st.st_ino} "
                      f"{os.getpid()} {me.start if me is not None else 0}\n").encode()
        self._run = uuid.uuid4().hex[:12]
        self._gen = 0
        self._seq = 0
        self._live: dict[int, list[bytes]] = {}  # seq -> its b (and s) line
        self._live_bytes = 0
        self._fd = -1
        self._size = 0
        self._broken: OSError | None = None  # a write failed and could not be cut off again
        self._next_compaction = limits.leftover_log_bytes_max
        self.path = ""  # made with the first line: a member that starts on a full disk
        # (read-only, it starts nothing) writes nothing here

    def _open(self, lines: bytes) -> None:
        self._gen += 1
        path = os.path.join(self.folder, f"{self._run}-{self._gen}")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND | os.O_CLOEXEC,
                     0o600)
        try:
            if self._failpoints is not None:
                self._failpoints.hit("running.write")
            _write_all(fd, self._head + lines)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(path)
            raise
        self._fd, self.path, self._size = fd, path, len(self._head) + len(lines)

    def _write(self, line: bytes) -> None:
        if self._fd < 0:
            self._open(b"")
        if self._broken is not None:
            raise OSError(self._broken.errno, f"the log of running processes is damaged "
                                              f"({self._broken.strerror or self._broken})")
        try:
            if self._failpoints is not None:
                self._failpoints.hit("running.write")
            n = os.write(self._fd, line)
            if n != len(line):
                raise OSError(errno.ENOSPC, "short write")
        except OSError as e:
            try:
                os.ftruncate(self._fd, self._size)  # no line cut short in the log (Rule 1)
            except OSError:
                self._broken = e
            raise
        self._size += n

    def begin(self, kind: str, key: RunKey | None) -> int:
        """Before a process starts: its `b` line, and its number in this log. OSError when it
        cannot be written (nothing of it is in the log then)."""
        assert kind in ("item", "worker") and (key is None) == (kind == "worker"), (kind, key)
        seq = self._seq + 1
        line = (f"b {seq} item {key[0]} {key[1]} {key[2]}\n" if key is not None
                else f"b {seq} worker\n").encode()
        self._write(line)
        self._seq = seq
        self._live[seq] = [line]
        self._live_bytes += len(line)
        return seq

    def started(self, seq: int, pid: int) -> None:
        """The process `pid` (a child not yet reaped, leader of its own session) runs: its `s`
        line. OSError when it cannot be written."""
        me = proc(pid)
        if me is None:  # a child not yet reaped always has its /proc entry
            raise OSError(errno.ESRCH, f"no /proc/{pid}/stat for a child not yet reaped")
        line = f"s {seq} {pid} {me.start}\n".encode()
        self._write(line)
        self._live[seq].append(line)
        self._live_bytes += len(line)

    def forget(self, seq: int | None) -> None:
        """The process was reaped, or never started: its `e` line (Rule 2: one that cannot be
        written is let go), and the log starts anew when due (Rule 3)."""
        if seq is None or seq not in self._live:
            return
        self._live_bytes -= sum(len(x) for x in self._live.pop(seq))
        with contextlib.suppress(OSError):
            self._write(f"e {seq}\n".encode())
        if self._size >= self._next_compaction and self._size >= 2 * self._live_bytes:
            self._compact()

    def _compact(self) -> None:
        old_fd, old_path = self._fd, self.path
        try:
            self._open(b"".join(x for lines in self._live.values() for x in lines))
        except OSError:
            # The old log is whole: go on with it, and try again once it grew as much again.
            self._next_compaction = self._size + limits.leftover_log_bytes_max
            return
        self._broken = None
        self._next_compaction = limits.leftover_log_bytes_max
        os.close(old_fd)
        with contextlib.suppress(OSError):
            os.unlink(old_path)  # one left behind names what the new one names (Rule 3)

    def close(self) -> None:
        """After the driver stopped: the log goes when nothing it names runs (a clean stop)."""
        if self._fd < 0:
            return  # nothing was ever started
        os.close(self._fd)
        self._fd = -1
        if not self._live:
            with contextlib.suppress(OSError):
                os.unlink(self.path)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


# --- Reading logs back -----------------------------------------------------------------------------

@dataclass(frozen=True)
class Head:
    """Where a log was written, and by which meshd (Rule 4)."""

    boot: str
    pidns: int
    folder: tuple[int, int]
    meshd: tuple[int, int]  # its pid and start time


@dataclass(frozen=True)
class Leftover:
    """One process a log names as started and not reaped (a `b` line without an `e`)."""

    file: str
    seq: int
    head: Head
    kind: str
    key: RunKey | None
    pgid: int | None  # None: it may have started; its pid was not written
    start: int | None

    def fields(self) -> dict[str, Any]:
        """What a log line of meshd says of it."""
        out: dict[str, Any] = {"record": f"{self.file}:{self.seq}", "kind": self.kind,
                               "pgid": self.pgid}
        if self.key is not None:
            out.update(job=self.key[0], index=self.key[1], epoch=self.key[2])
        return out


def parse(name: str, lines: list[bytes], pid_max: int, spared: set[int]
          ) -> tuple[Head, list[Leftover]] | None:
    """The log `name` as its `lines` (each with its newline; a last one without is cut short
    and ignored), checked (Rule 6): its header and what it names as still running; None when
    it has no whole header (nothing it would name can have started). RecordRefused when it is
    not a log meshd writes, or names a pid of `spared` (this meshd, its parent, group, session)."""
    if lines and not lines[-1].endswith(b"\n"):
        lines = lines[:-1]
    if not lines:
        return None
    m = _HEAD_RE.fullmatch(lines[0])
    if m is None:
        raise RecordRefused("its first line is not a version 1 header")
    meshd_pid = int(m.group(5))
    if not 2 <= meshd_pid <= pid_max:
        raise RecordRefused(f"meshd's pid {meshd_pid} is not 2..{pid_max}")
    head = Head(m.group(1).decode(), int(m.group(2)), (int(m.group(3)), int(m.group(4))),
                (meshd_pid, int(m.group(6))))
    begun: dict[int, list[Any]] = {}  # seq -> [kind, key, pgid, start]
    last = 0
    for n, line in enumerate(lines[1:], 2):
        if (b := _BEGIN_RE.fullmatch(line)) is not None:
            seq = int(b.group(1))
            if seq <= last:
                raise RecordRefused(f"line {n}: b {seq} after b {last}")
            last = seq
            key = (b.group(2).decode(), int(b.group(3)), int(b.group(4))) if b.group(2) else None
            begun[seq] = ["item" if key else "worker", key, None, None]
        elif (s := _STARTED_RE.fullmatch(line)) is not None:
            seq, pgid = int(s.group(1)), int(s.group(2))
            if seq not in begun or begun[seq][2] is not None:
                raise RecordRefused(f"line {n}: s {seq} of no b {seq}, or twice")
            if not 2 <= pgid <= pid_max or pgid in spared or pgid == meshd_pid:
                raise RecordRefused(f"line {n}: pgid {pgid} is not 2..{pid_max}, or is meshd's "
                                    "own, its parent's, its group's or its session's")
            begun[seq][2:] = [pgid, int(s.group(3))]
        elif (e := _ENDED_RE.fullmatch(line)) is not None:
            seq = int(e.group(1))
            if begun.pop(seq, None) is None:
                raise RecordRefused(f"line {n}: e {seq} of no b {seq}, or twice")
        else:
            raise RecordRefused(f"line {n} is not a line of a log of running processes")
    return head, [Leftover(name, seq, head, *v) for seq, v in begun.items()]


def _read_lines(path: str) -> list[bytes]:
    """A log's lines; RecordRefused when it is no regular file, is too large or has too long a
    line (Rule 6)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise RecordRefused("a symbolic link, not a file") from None
        raise
    with open(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise RecordRefused("not a regular file")
        if st.st_size > limits.leftover_file_bytes_max:
            raise RecordRefused(f"{st.st_size} bytes, over leftover_file_bytes_max "
                                f"({limits.leftover_file_bytes_max})")
        lines = []
        total = 0
        while line := f.readline(limits.leftover_line_bytes_max + 1):
            if len(line) > limits.leftover_line_bytes_max:
                raise RecordRefused(f"a line over leftover_line_bytes_max "
                                    f"({limits.leftover_line_bytes_max})")
            total += len(line)
            if total > limits.leftover_file_bytes_max:
                raise RecordRefused("over leftover_file_bytes_max")
            lines.append(line)
        return lines


# --- The sweep --------------------------------------------------------------------------------------

@dataclass
class Swept:
    """What a sweep did: logs read, processes it ended per entry, logs refused or kept."""

    logs: int = 0
    ended: dict[str, list[int]] = field(default_factory=dict)  # "FILE:SEQ" -> pids ended
    refused: int = 0
    kept: int = 0


@dataclass
class _Target:
    rec: Leftover
    procs: list[Proc]
    leader: Proc | None  # a checked group leader: its group is killed with killpg


def _ours(rec: Leftover, procs: dict[int, Proc], spared: set[int], own_sid: int) -> _Target:
    """The processes of `procs` the record names (Rule 5)."""

    def ok(p: Proc) -> bool:
        return p.state not in ("Z", "X") and p.pid > 1 and p.pid not in spared \
            and p.sid != own_sid and p.pgid not in spared

    def of(g: int) -> list[Proc]:
        return [p for p in procs.values() if (p.pgid == g or p.sid == g) and ok(p)]

    if rec.pgid is None:
        if rec.key is None:
            return _Target(rec, [], None)
        key = rec.key
        found = [p for p in procs.values()
                 if ok(p) and p.start >= rec.head.meshd[1] and _names_item(p.pid, key)]
        leaders = [p for p in found if p.pid == p.sid == p.pgid]
        if len(leaders) == 1:  # the item's own session: all of it is the item's
            return _Target(rec, sorted({*found, *of(leaders[0].pid)}, key=lambda p: p.pid),
                           leaders[0])
        return _Target(rec, found, None)
    lead = procs.get(rec.pgid)
    if lead is not None:
        if lead.start != rec.start or not lead.pid == lead.pgid == lead.sid:
            # The pid was reused (an item's first process leads its session, and no session
            # leader can change its group): nothing of the item is left.
            return _Target(rec, [], None)
        return _Target(rec, of(rec.pgid), lead)
    if rec.key is None:
        return _Target(rec, [], None)
    key, since = rec.key, rec.start or 0
    return _Target(rec, [p for p in of(rec.pgid) if p.start >= since and _names_item(p.pid, key)],
                   None)


def _end(targets: list[_Target], deadline: float, log: Any) -> tuple[dict[str, list[int]],
                                                                      dict[str, str]]:
    """SIGKILL every process of `targets` (Rule 7) and wait for them until `deadline`; the
    pids signalled per record, and why some of a record's could not be ended."""
    signalled: dict[str, list[int]] = {}
    stuck: dict[str, str] = {}
    for t in targets:
        if t.leader is None:
            continue
        now = proc(t.leader.pid)
        if now is None or now.start != t.leader.start or now.pgid != t.leader.pid:
            continue  # ended meanwhile: its processes are killed one by one below
        try:
            os.killpg(t.leader.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        except PermissionError:
            stuck[t.rec.fields()["record"]] = "not permitted"
    flat = [(t.rec, p) for t in targets for p in t.procs]
    for at in range(0, len(flat), limits.leftover_batch_max):
        sel = selectors.DefaultSelector()
        fds: list[int] = []
        try:
            for rec, p in flat[at:at + limits.leftover_batch_max]:
                try:
                    fd = os.pidfd_open(p.pid)
                except ProcessLookupError:
                    continue
                fds.append(fd)
                now = proc(p.pid)
                if now is None or now.start != p.start:
                    continue  # not the process that was looked at: it is gone
                try:
                    signal.pidfd_send_signal(fd, signal.SIGKILL)
                except ProcessLookupError:
                    pass  # ended meanwhile (killed with its group, say)
                except PermissionError:
                    stuck[rec.fields()["record"]] = "not permitted"
                    continue
                signalled.setdefault(rec.fields()["record"], []).append(p.pid)
                sel.register(fd, selectors.EVENT_READ, (rec, p))
            while sel.get_map():
                left = deadline - time.monotonic()
                if left <= 0:
                    for key in sel.get_map().values():
                        rec, p = key.data
                        stuck[rec.fields()["record"]] = "still ending"
                        log.warning("leftover_still_ending", pid=p.pid, **rec.fields())
                    break
                for key, _mask in sel.select(left):
                    sel.unregister(key.fd)
        finally:
            sel.close()
            for fd in fds:
                os.close(fd)
    return signalled, stuck


def _refuse(path: str, why: str, log: Any) -> None:
    to = path + REFUSED
    try:
        os.replace(path, to)
    except OSError:
        to = path  # left where it is: refused again at the next start
    log.error("leftover_record_refused", record=path, why=why, moved_to=to,
              what_to_do="meshd did not write this log as it is, so it signalled nothing it "
                         "names: see who wrote it, and look for item processes an earlier run "
                         "of meshd left running (ps -eo pid,pgid,sid,lstart,args)")


def _elsewhere(head: Head, boot: str, pidns: int, folder: os.stat_result) -> str | None:
    """Why a log names no process of this data folder here and now (Rule 4), or None."""
    if head.boot != boot:
        return "written on an earlier boot: its processes ended with it"
    if head.pidns != pidns:
        return "written in another pid namespace: its pids mean nothing here"
    if head.folder != (folder.st_dev, folder.st_ino):
        return "written for another data folder (this one is a copy?): its items are not ours"
    return None


def sweep(data: str, log: Any = None, wait_ms: int = limits.leftover_end_wait_ms) -> Swept:
    """End every process the logs in `data`'s running/ folder name (Rules 4-7), then remove
    those logs; what it did. Call it once, before this meshd starts anything, holding the data
    folder (meshjobs.datadir.lock). OSError when the folder cannot be read or cleared."""
    log = log if log is not None else structlog.get_logger(__name__)
    folder = os.path.join(data, FOLDER)
    out = Swept()
    try:
        names = []
        with os.scandir(folder) as it:
            for entry in it:
                names.append(entry.name)
                if len(names) > limits.leftover_files_max:
                    break
        here = os.stat(folder)
    except FileNotFoundError:
        return out
    if len(names) > limits.leftover_files_max:
        log.error("leftover_records_too_many", folder=folder, max=limits.leftover_files_max,
                  what_to_do="none of them was read: move the folder aside, and look for item "
                             "processes an earlier run of meshd left running (ps -eo "
                             "pid,pgid,sid,lstart,args)")
        out.refused = len(names)
        return out
    spared = {0, 1, os.getpid(), os.getpgrp(), os.getppid(), os.getsid(0)}
    own_sid = os.getsid(0)
    pid_max = _pid_max()
    boot = re.sub(r"[^0-9A-Za-z-]", "", _read_text("/proc/sys/kernel/random/boot_id"))[:64]
    pidns = _pidns()
    files: dict[str, list[Leftover]] = {}
    for name in sorted(names):
        if name.endswith(REFUSED):
            continue
        path = os.path.join(folder, name)
        out.logs += 1
        try:
            got = parse(name, _read_lines(path), pid_max, spared)
        except RecordRefused as e:
            _refuse(path, str(e), log)
            out.refused += 1
            continue
        if got is None:
            os.unlink(path)  # no whole header: nothing it names started
            continue
        head, entries = got
        why = _elsewhere(head, boot or "none", pidns, here)
        if why is not None:
            log.info("leftover_record_dropped", record=name, entries=len(entries), why=why)
            os.unlink(path)
            continue
        writer = proc(head.meshd[0])
        if writer is not None and writer.start == head.meshd[1]:
            log.warning("leftover_meshd_runs", record=name, meshd_pid=head.meshd[0],
                        why="the meshd that started its processes still runs: they are its own")
            out.kept += 1
            continue
        files[name] = entries
    left = [rec for entries in files.values() for rec in entries]
    deadline = time.monotonic() + wait_ms / 1000
    stuck: dict[str, str] = {}  # "FILE:SEQ" -> why
    for n in range(limits.leftover_passes_max + 1) if left else ():
        procs = _scan()
        targets = [t for t in (_ours(r, procs, spared, own_sid) for r in left) if t.procs]
        if not targets:
            stuck.clear()  # nothing any log names runs any more
            break
        if n == limits.leftover_passes_max or time.monotonic() >= deadline:
            for t in targets:
                stuck.setdefault(t.rec.fields()["record"], "still running")
            break
        signalled, why = _end(targets, deadline, log)
        for rec_id, pids in signalled.items():
            out.ended.setdefault(rec_id, []).extend(pids)
        stuck.update(why)
    for name, entries in files.items():
        keep = False
        for rec in entries:
            rec_id = rec.fields()["record"]
            pids = sorted(set(out.ended.get(rec_id, ())))
            if rec_id in stuck:
                keep = True
                log.error("leftover_not_ended", why=stuck[rec_id], pids=pids, **rec.fields(),
                          what_to_do=(f"end it as root (kill -9 -- -{rec.pgid}) if it still "
                                      "runs" if rec.pgid is not None else "end it as root if "
                                      "it still runs (its environment names the item)")
                          + "; meshd tries again at its next start")
            elif pids:
                log.warning("leftover_ended", pids=pids, meshd_pid=rec.head.meshd[0],
                            **rec.fields())
        if keep:
            out.kept += 1
        else:
            os.unlink(os.path.join(folder, name))
    if out.logs:
        log.info("leftovers_swept", logs=out.logs, entries=len(left), ended=len(out.ended),
                 processes=sum(len(v) for v in out.ended.values()), refused=out.refused,
                 kept=out.kept)
    return out
