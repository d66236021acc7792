"""`meshctl watch`: the IO edge of meshjobs.watchplan. It looks at folders, submits the jobs the
plan says, follows them and keeps their results beside each file.

Rules:
- All decisions are the plan's (meshjobs/watchplan/); this module lists folders, reads and
  writes the hidden state files, talks HTTP to one member and sleeps.
- Submits are idempotent: the job id is derived from the file, so a POST answered "already
  there" (200, where a job just made is 201) is a job to follow like one just made. Each submit
  has an Idempotency-Key of its own, kept for meshctl's one retry of it: a key that were the job
  id would have meshd answer every later submit of the file as the first (201, "new").
- A state file is written whole under a temporary name, synced, then renamed: a crash leaves the
  old state or the new one, never half of one (a lost one only costs a submit meshd dedupes).
- Folders are watched with inotify (watchfiles) where it works, and rescanned every `rescan`
  seconds in any case: network filesystems send no events.
- With `xattr` (the manual's WatchXattr) the same state lives in each file's extended attributes
  `user.meshjobs.<name>.<n>.<state>` instead: the plan sees them under the hidden files' names.
- One summary log line per scan of a watch; structlog JSON when not on a terminal.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
import urllib.parse
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import IO, Any

from click import ClickException

from meshjobs import limits
from meshjobs.watchplan import (
    END_STATES,
    TMP_SUFFIX,
    Config,
    FileFact,
    Plan,
    Snapshot,
    Submit,
    Watch,
    ended,
    parse_state_name,
    plan,
    state_name,
)

try:  # inotify (and the other platforms' file events); without it, rescans only
    import watchfiles
except ImportError:  # pragma: no cover - the dependency is declared; this is a broken install
    watchfiles = None  # type: ignore[assignment]

@dataclass
class WatchState:
    """What the watcher keeps of one watch in memory: the jobs it follows (lost on a crash, which
    the derived ids make harmless) and how many of its jobs have ended."""

    following: dict[str, Submit] = field(default_factory=dict)
    generations: dict[tuple[int, int], int] = field(default_factory=dict)
    ended: int = 0
    next_scan: float = 0.0
    next_refresh: float = 0.0


def snapshot(watch: Watch) -> tuple[Snapshot, int]:
    """The files of the watch's folder and the text of its state files; and how many entries were
    left out (past watch_files_max, or not regular files)."""
    files: dict[str, FileFact] = {}
    states: dict[str, str | None] = {}
    prefix = f"._{watch.name}_"
    left = 0
    with os.scandir(watch.path) as it:
        for entry in it:
            if len(files) + len(states) >= limits.watch_files_max:
                left += 1
                continue
            try:
                if not entry.is_file():
                    continue
                st = entry.stat()
            except OSError:
                continue  # gone between the listing and the stat: the next scan sees it
            if entry.name.startswith("._"):
                if entry.name.startswith(prefix) and not watch.xattr:
                    states[entry.name] = _read_state(entry.path, st.st_size)
                continue
            files[entry.name] = FileFact(st.st_mtime_ns, st.st_size)
            if watch.xattr:
                states.update(_read_xattrs(watch, entry.path, entry.name))
    return Snapshot(files, states), left


def _attr_prefix(watch: Watch) -> str:
    return f"user.meshjobs.{watch.name}."


def _read_xattrs(watch: Watch, path: str, filename: str) -> dict[str, str | None]:
    """A file's state attributes (user.meshjobs.<name>.<n>.<state>) under the names the plan
    knows (its hidden state files' names): the plan is the same whichever keeps the state."""
    prefix = _attr_prefix(watch)
    out: dict[str, str | None] = {}
    try:
        attrs = os.listxattr(path)
    except OSError:
        return out
    for attr in attrs:
        if not attr.startswith(prefix):
            continue
        n_text, _, state = attr[len(prefix):].partition(".")
        if not n_text.isascii() or not n_text.isdigit() or len(n_text) > len(str(limits.watch_jobs_max)):
            continue
        try:
            value = os.getxattr(path, attr)
        except OSError:
            continue
        out[state_name(watch.name, int(n_text), filename, state)] = (
            value[:limits.watch_state_bytes_max].decode("utf-8", "replace"))
    return out


def keep(watch: Watch, writes: list[tuple[str, str]], removes: list[str]) -> None:
    """Apply a plan's (or an end's) state changes: hidden files, or the files' xattrs."""
    if not watch.xattr:
        for name in removes:
            remove_file(watch.path, name)
        for name, text in writes:
            write_file(watch.path, name, text)
        return
    prefix = _attr_prefix(watch)
    for name in removes:
        parsed = parse_state_name(watch.name, name)
        if parsed is not None:
            n, filename, state = parsed
            with contextlib.suppress(OSError):  # gone already, or its file is
                os.removexattr(os.path.join(watch.path, filename), f"{prefix}{n}.{state}")
    for name, text in writes:
        parsed = parse_state_name(watch.name, name)
        if parsed is None:
            raise AssertionError(f"the plan wrote a state name it cannot parse: {name!r}")
        n, filename, state = parsed
        if len(text) > limits.watch_xattr_bytes_max:
            # Filesystems keep little in xattrs (ext4: one block for all of a file's): the
            # watch facts, not the job's whole record.
            rec = json.loads(text)
            text = json.dumps({k: rec.get(k) for k in ("id", "state", "skipped", "watch")})
        try:
            os.setxattr(os.path.join(watch.path, filename), f"{prefix}{n}.{state}",
                        text.encode("utf-8", "surrogateescape"))
        except FileNotFoundError:
            pass  # the file went: nothing to keep its state on


def _read_state(path: str, size: int) -> str | None:
    if size > limits.watch_state_bytes_max:
        return None
    try:
        with open(path, "rb") as f:
            return f.read(limits.watch_state_bytes_max + 1).decode("utf-8", "replace")
    except OSError:
        return None


def write_file(folder: str, name: str, text: str) -> None:
    """`name` in `folder` replaced whole by `text`: written aside, synced, renamed."""
    final = os.path.join(folder, name)
    tmp = final + TMP_SUFFIX
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, text.encode("utf-8", "surrogateescape"))
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, final)


def remove_file(folder: str, name: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join(folder, name))


class EndFeed:
    """The ends of jobs, heard on the member's change feed (GET /events, server-sent events) as
    they commit, so that a watcher learns of them at once rather than at its next `refresh`.

    A thread reads the stream and keeps the ids of jobs that reached an end state; the watcher
    takes them at each wakeup and asks after those jobs then. The feed only hastens: the
    watcher's own asking every `refresh` stays, so a broken or lagging stream (or more ends
    than `watch_feed_ids_max` not yet taken) delays an end, never loses it. A stream that
    breaks is opened again from the last event it gave (Last-Event-ID)."""

    def __init__(self, client: Any, log: Any) -> None:
        self.client = client
        self.log = log
        self.wake = threading.Event()  # set when an end is heard
        self._lock = threading.Lock()
        self._ended: set[str] = set()
        self._last: str | None = None
        self.heard = 0  # ends heard (for the log and tests)

    def start(self) -> EndFeed:
        threading.Thread(target=self._run, name="watch-feed", daemon=True).start()
        return self

    def take(self) -> set[str]:
        """The job ids heard ending since the last take."""
        with self._lock:
            out, self._ended = self._ended, set()
            self.wake.clear()
        return out

    def _run(self) -> None:
        broken = False
        while True:
            try:
                self._read()
                broken = False
            except (ClickException, OSError, ValueError) as e:
                if not broken:  # once per outage, not once per retry
                    self.log.warning("watch_feed_broken", error=getattr(e, "message", str(e)),
                                     fallback=f"asks after its jobs every refresh; again in "
                                              f"{limits.watch_feed_retry_s:g} s")
                broken = True
            time.sleep(limits.watch_feed_retry_s)

    def _read(self) -> None:
        query = "state=" + ",".join(sorted(END_STATES))
        if self._last is not None:
            query += "&since=" + urllib.parse.quote(self._last)
        resp = self.client.open("GET", "/events?" + query, timeout=limits.watch_feed_read_s)
        with resp:
            event, event_id = "", None
            for raw in resp:
                line = raw.decode("utf-8", "replace").rstrip("\r\n")
                if line.startswith("id:"):
                    event_id = line[3:].strip()
                elif line.startswith("event:"):
                    event = line[6:].strip()
                elif line.startswith("data:") and event == "job":
                    row = json.loads(line[5:])
                    if isinstance(row, dict) and isinstance(row.get("id"), str):
                        self._heard(row["id"])
                elif not line:
                    if event_id:
                        self._last = event_id
                    event, event_id = "", None

    def _heard(self, job_id: str) -> None:
        with self._lock:
            if len(self._ended) < limits.watch_feed_ids_max:
                self._ended.add(job_id)
            self.heard += 1
        self.wake.set()


class Watcher:
    """Runs the watches of one config against one member (`client`: meshjobs.cli.Client, whose
    failures are ClickExceptions with a message and an exit code)."""

    def __init__(self, config: Config, client: Any, log: Any, dry_run: bool = False,
                 out: IO[str] | None = None, clock: Callable[[], float] = time.monotonic,
                 wall_ns: Callable[[], int] = time.time_ns) -> None:
        self.config = config
        self.client = client
        self.log = log
        self.dry_run = dry_run
        self.out = out
        self.clock = clock
        self.wall_ns = wall_ns
        self.states = {w.name: WatchState() for w in config.watches}
        self.feed: EndFeed | None = None  # started by once() and run(), not for --dry-run
        self.failed = 0  # jobs seen ending failed or dep_failed
        self.submit_exit = 0  # the exit code of the last refused or unanswered submit (meshctl's)

    # --- one watch ---------------------------------------------------------------------------
    def scan(self, watch: Watch) -> Plan:
        """Look at the folder, apply the plan: removes, writes, submits; log one summary line."""
        st = self.states[watch.name]
        try:
            snap, left = snapshot(watch)
        except OSError as e:
            self.log.warning("watch_scan_failed", watch=watch.name, path=watch.path,
                             error=f"{e.strerror or e}: check that the folder exists and is "
                                   "readable; retrying at the next rescan")
            return Plan([], [], [], [], {})
        p = plan(watch, snap, self.wall_ns(), frozenset(st.following), st.generations)
        failed = 0
        if not self.dry_run:
            try:
                keep(watch, p.writes, p.removes)
            except OSError as e:
                self.log.warning("watch_state_write_failed", watch=watch.name, path=watch.path,
                                 error=f"{e.strerror or e}: let the watcher write in the "
                                       "folder; retrying at the next scan")
        for sub in p.submits:
            if self.dry_run:
                if self.out is not None:
                    self.out.write(json.dumps({"watch": watch.name, "file": sub.filename,
                                               "index": sub.index, "submit": sub.body}) + "\n")
                continue
            if not self._submit(watch, sub):
                failed += 1
        for problem in p.problems[:limits.watch_jobs_max]:
            self.log.warning("watch_problem", watch=watch.name, problem=problem)
        due = {} if p.due_ns is None else {
            "next_due_in_s": round(max(0, p.due_ns - self.wall_ns()) / 1e9, 1)}
        self.log.info("watch_scan", watch=watch.name, following=len(st.following),
                      ended=st.ended, submit_failed=failed, left_out=left,
                      removed=0 if self.dry_run else len(p.removes),
                      written=0 if self.dry_run else len(p.writes), **p.counts, **due)
        return p

    def _submit(self, watch: Watch, sub: Submit) -> bool:
        self.client.key = uuid.uuid4().hex  # (meshctl's retry of this POST is the same request)
        try:
            status, _record = self.client.json_status("POST", "/jobs", sub.body)
        except ClickException as e:
            if e.exit_code == 2 and self._exists(sub.job_id):
                # The job of this file version exists under another spec (the config was
                # edited since it was submitted): it is this file's job all the same, and
                # submitting the new spec under another id would run the file twice.
                self.log.warning("watch_spec_changed", watch=watch.name, job=sub.job_id,
                                 file=sub.filename, error=e.message,
                                 action="following the job submitted with the earlier spec")
                self.states[watch.name].following[sub.job_id] = sub
                return True
            self.log.warning("watch_submit_failed", watch=watch.name, job=sub.job_id,
                             file=sub.filename, error=e.message)
            self.submit_exit = e.exit_code
            return False
        self.states[watch.name].following[sub.job_id] = sub
        # 201: a job made by this submit; 200: one that was there (submitted before the watcher
        # was killed, or by another watcher of the same file). The answer is the job's record.
        self.log.info("watch_submitted", watch=watch.name, job=sub.job_id, file=sub.filename,
                      index=sub.index, attempt=sub.attempt, new=status == 201)
        return True

    def _exists(self, job_id: str) -> bool:
        try:
            self.client.json("GET", f"/jobs/{urllib.parse.quote(job_id, safe='')}")
        except ClickException:
            return False
        return True

    def refresh(self, watch: Watch, only: set[str] | None = None) -> tuple[int, bool]:
        """Ask after every job followed (or those of `only`: heard ending on the feed); keep the
        result of each that ended. Returns how many ended, and whether one of them ended in a
        way that moves files on (not a failure, whose retry waits for the next rescan)."""
        st = self.states[watch.name]
        count = 0
        moves = False
        for jid, sub in list(st.following.items()):
            if only is not None and jid not in only:
                continue
            try:
                record = self.client.json("GET", f"/jobs/{urllib.parse.quote(jid, safe='')}")
            except ClickException as e:
                if e.exit_code == 3:  # forgotten before we saw its end: the next scan decides
                    self.log.warning("watch_job_gone", watch=watch.name, job=jid,
                                     error=e.message)
                    del st.following[jid]
                    continue
                self.log.warning("watch_refresh_failed", watch=watch.name, job=jid,
                                 error=e.message)
                break  # the member is away: ask again at the next refresh
            state = record.get("state") if isinstance(record, dict) else None
            if state not in END_STATES:
                continue
            writes, removes = ended(watch, sub, record)
            del st.following[jid]
            try:
                keep(watch, writes, removes)
            except OSError as e:
                # Not kept: the next scan submits the same id again, and follows it to its end.
                self.log.warning("watch_state_write_failed", watch=watch.name, job=jid,
                                 file=sub.filename, error=f"{e.strerror or e}: let the watcher "
                                 "write in the folder; retrying at the next scan")
                continue
            if not sub.filename:
                st.generations[(sub.index, sub.list)] = sub.mtime_ns + 1
            st.ended += 1
            count += 1
            moves = moves or state not in ("failed", "dep_failed")
            self.failed += state in ("failed", "dep_failed")
            self.log.info("watch_job_ended", watch=watch.name, job=jid, file=sub.filename,
                          index=sub.index, state=state)
        return count, moves

    def counted_out(self, watch: Watch) -> bool:
        return watch.count is not None and self.states[watch.name].ended >= watch.count

    # --- the loop ----------------------------------------------------------------------------
    def once(self) -> int:
        """One scan of every watch, then follow what it submitted until all of it ended.
        Returns the exit code: that of a submit that failed (4: the member unreachable, 2:
        refused), else 1 if a job ended failed (or dep_failed), else 0."""
        if not self.dry_run:
            self.feed = EndFeed(self.client, self.log).start()
        for w in self.config.watches:
            self.scan(w)
        if self.dry_run:
            return 0
        only: set[str] | None = None
        while any(self.states[w.name].following for w in self.config.watches):
            for w in self.config.watches:
                self.refresh(w, only)
            if any(self.states[w.name].following for w in self.config.watches):
                # At the next end heard on the feed (asking after those jobs), or else at the
                # next refresh (asking after all).
                heard = self.feed.wake.wait(min(w.refresh for w in self.config.watches))
                only = self.feed.take() if heard else None
        return self.submit_exit or (1 if self.failed else 0)

    def run(self, events: bool = True) -> None:
        """Scan, follow, rescan, until every watch with a `count` has reached it (or forever)."""
        watches = list(self.config.watches)
        self.feed = EndFeed(self.client, self.log).start()
        now = self.clock()
        for w in watches:
            # The first scans come at the first wakeup, once file events are being watched: a
            # file made between a scan and the start of the watching would be seen only by the
            # next rescan.
            self.states[w.name].next_scan = now
            self.states[w.name].next_refresh = now + w.refresh
        for changed in self._wakeups(events):
            now = self.clock()
            ended = self.feed.take()
            for w in list(watches):
                st = self.states[w.name]
                scan_now = now >= st.next_scan or w.path in changed
                if now >= st.next_refresh or not ended.isdisjoint(st.following):
                    only = None if now >= st.next_refresh else ended
                    if only is None:
                        st.next_refresh = now + w.refresh
                    n, moves = self.refresh(w, only)
                    scan_now = scan_now or moves
                if self.counted_out(w):
                    self.log.info("watch_count_reached", watch=w.name, count=w.count)
                    watches.remove(w)
                    continue
                if scan_now:
                    p = self.scan(w)
                    st.next_scan = self.clock() + w.rescan
                    if p.due_ns is not None:
                        # A file too young for min_age is scanned again as it comes of age,
                        # not a whole rescan later.
                        st.next_scan = min(st.next_scan, self.clock() + max(
                            0.0, (p.due_ns - self.wall_ns()) / 1e9))
            if not watches:
                return

    def _wakeups(self, events: bool) -> Iterator[set[str]]:
        """The folders with file events since the last wakeup (empty: a tick)."""
        tick_s = min([limits.watch_tick_s_max, *(w.refresh for w in self.config.watches)])
        paths = sorted({w.path for w in self.config.watches})
        if events and watchfiles is not None:
            try:
                for changes in watchfiles.watch(
                        *paths, watch_filter=_not_state_file, recursive=False,
                        debounce=int(tick_s * 1000), rust_timeout=int(tick_s * 1000),
                        yield_on_timeout=True, raise_interrupt=False):
                    yield {os.path.dirname(p) for _, p in changes}
                return
            except (OSError, RuntimeError) as e:
                self.log.warning("watch_events_unavailable", error=str(e),
                                 fallback="rescans every rescan seconds")
        while True:
            yield set()
            time.sleep(tick_s)


def _not_state_file(change: Any, path: str) -> bool:
    """File events worth a scan: not our own state files (nor their temporary names)."""
    return not os.path.basename(path).startswith("._")
