"""The plans of `meshctl watch` (see meshjobs.watchplan): file lists, filesets, the jobs[n] chain,
derived job ids and the state files beside each file. Pure: a snapshot and a clock in; submits,
writes and removes out.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from meshjobs import limits
from meshjobs.control import JOB_FINAL_STATES, ControlError, parse_submit
from meshjobs.watchplan.config import Unfilled, Watch, fill, join

END_STATES = JOB_FINAL_STATES
FAILURES = ("failed", "dep_failed")
UNSAFE_ID_RE = re.compile(r"[^A-Za-z0-9._-]+")
TMP_SUFFIX = ".part"  # a state file is written under its name plus this, then renamed



@dataclass(frozen=True)
class FileFact:
    mtime_ns: int
    size: int


@dataclass(frozen=True)
class Snapshot:
    """One look at a watch's folder: its files (hidden `._` ones left out) and the text of its
    hidden state files (None: there, but unreadable or too large)."""

    files: Mapping[str, FileFact]
    states: Mapping[str, str | None] = field(default_factory=dict)


@dataclass(frozen=True)
class Submit:
    job_id: str
    body: dict  # the POST /jobs body, id included
    index: int
    list: int
    filename: str  # "" for a watch without globs (its jobs are kept running, no state files)
    mtime_ns: int
    attempt: int


@dataclass(frozen=True)
class Plan:
    submits: list[Submit]
    writes: list[tuple[str, str]]  # (file name in path, text)
    removes: list[str]  # file names in path
    problems: list[str]
    counts: dict[str, int]
    # When the first file too young for min_age becomes old enough (wall clock, ns); None when
    # no file waits for its age. Such files count as deferred.
    due_ns: int | None = None


@dataclass(frozen=True)
class StateFact:
    state: str
    attempt: int
    mtime_ns: int | None



# --- Ids and state files -------------------------------------------------------------------------

def job_id(name: str, index: int, lst: int, filename: str, mtime_ns: int, attempt: int) -> str:
    """The job id of one (watch, index, list, file, mtime, attempt): readable where it can be,
    always ending in a digest of all of them, so two different jobs never share an id."""
    key = json.dumps([name, index, lst, filename, mtime_ns, attempt])
    digest = hashlib.blake2b(key.encode("utf-8", "surrogatepass"),
                             digest_size=16).hexdigest()[:limits.watch_id_hash_chars]
    readable = UNSAFE_ID_RE.sub("_", f"{name}-{index}" + (f".{lst}" if lst else "")
                                + (f"-{filename}" if filename else ""))
    room = limits.job_id_chars_max - len(digest) - 1
    return f"{readable[:room]}.{digest}"


def state_name(name: str, index: int, filename: str, state: str) -> str:
    """The hidden file beside `filename` that keeps index `index`'s state (or "mtime")."""
    return f"._{name}_{index}_{filename}.{state}"


def parse_state_name(name: str, hidden: str) -> tuple[int, str, str] | None:
    """(index, filename, state) of one of this watch's state files, or None. Watch names hold no
    '_', so one watch's prefix never matches another's files."""
    prefix = f"._{name}_"
    if not hidden.startswith(prefix):
        return None
    n_text, sep, tail = hidden[len(prefix):].partition("_")
    if not sep or not n_text.isascii() or not n_text.isdigit() or len(n_text) > len(str(limits.watch_jobs_max)):
        return None
    filename, dot, state = tail.rpartition(".")
    if not dot or not filename or state not in (*END_STATES, "mtime"):
        return None
    return int(n_text), filename, state


def _fact(state: str, text: str | None) -> StateFact:
    """What a state file says; damage leaves the state its name gives, of unknown attempt."""
    attempt, mtime = 0, None
    try:
        rec = json.loads(text) if text is not None else None
    except (ValueError, RecursionError):
        rec = None
    w = rec.get("watch") if isinstance(rec, dict) else None
    if isinstance(w, dict):
        a, m = w.get("attempt"), w.get("mtime_ns")
        if isinstance(a, int) and not isinstance(a, bool) and 0 <= a <= limits.watch_attempts_max:
            attempt = a
        if isinstance(m, int) and not isinstance(m, bool):
            mtime = m
    return StateFact(state, attempt, mtime)


def facts(watch: Watch, states: Mapping[str, str | None],
          owners: dict[str, str] | None = None) -> dict[tuple[int, str], StateFact]:
    """(index, filename) -> the best state fact of the watch's state files: done over failure.
    `owners`, when given, gets each of the watch's state files' file name."""
    rank = {"done": 3, "cancelled": 2, "failed": 1, "dep_failed": 1}
    out: dict[tuple[int, str], StateFact] = {}
    mtimes: dict[tuple[int, str], int] = {}
    for hidden, text in states.items():
        parsed = parse_state_name(watch.name, hidden)
        if parsed is None:
            continue
        n, filename, state = parsed
        if owners is not None:
            owners[hidden] = filename
        if state == "mtime":
            if text is not None and text.strip().isdigit() and len(text) < 32:
                mtimes[(n, filename)] = int(text.strip())
            continue
        # A done (or cancelled) state's attempt never matters, nor its mtime without updated:
        # such a file is not read as JSON at all.
        f = (_fact(state, text) if state in FAILURES or watch.updated
             else StateFact(state, 0, None))
        old = out.get((n, filename))
        if old is None or (rank[f.state], f.attempt) > (rank[old.state], old.attempt):
            out[(n, filename)] = f
    for k, m in mtimes.items():
        if k in out and out[k].mtime_ns is None:
            out[k] = replace(out[k], mtime_ns=m)
    return out


def ended(watch: Watch, sub: Submit, record: Mapping) -> tuple[list[tuple[str, str]], list[str]]:
    """What to write (and remove) beside the file when its job has ended with `record` (the job's
    JSON from GET /jobs/ID): the result in `._<name>_<n>_<filename>.<state>`, the mtime for
    `updated`, and the file of any other end state of the same index."""
    state = record.get("state")
    if state not in END_STATES:
        raise ValueError(f"job {sub.job_id} has not ended ({state!r})")
    if not sub.filename:
        return [], []
    meta = {"name": watch.name, "index": sub.index, "list": sub.list, "file": sub.filename,
            "mtime_ns": sub.mtime_ns, "attempt": sub.attempt}
    text = json.dumps({"id": sub.job_id, "state": state, "watch": meta, "job": dict(record)})
    if len(text) > limits.watch_state_bytes_max:
        text = json.dumps({"id": sub.job_id, "state": state, "watch": meta,
                           "job": {k: record.get(k) for k in ("id", "state", "counts")}})
    writes = [(state_name(watch.name, sub.index, sub.filename, state), text)]
    if watch.updated:
        writes.append((state_name(watch.name, sub.index, sub.filename, "mtime"),
                       str(sub.mtime_ns)))
    removes = [state_name(watch.name, sub.index, sub.filename, s) for s in END_STATES
               if s != state]
    return writes, removes


# --- Plans ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Unit:
    """One position of the list(s): a file, or a fileset (files by list number)."""

    pos: int
    key: str
    files: Mapping[int, str]
    primary: int  # the list whose file a one-spec index runs on


def listing(watch: Watch, pattern: str, files: Mapping[str, FileFact], now_ns: int,
            young: list[int] | None = None) -> list[str]:
    """The names of one glob's list, aged and sorted (newest first: Z->A unless `reverse`);
    `young` gets, for each matching file still too young for min_age, when it is old enough."""
    dotted = pattern.startswith(".")
    out = []
    for name, f in files.items():
        if name.startswith("._") or (name.startswith(".") and not dotted):
            continue
        if not fnmatch.fnmatchcase(name, pattern):
            continue
        age_s = (now_ns - f.mtime_ns) / 1e9
        if watch.min_age is not None and age_s < watch.min_age:
            if young is not None and (watch.max_age is None or watch.min_age < watch.max_age):
                young.append(f.mtime_ns + int(watch.min_age * 1e9))
            continue
        if watch.max_age is not None and age_s >= watch.max_age:
            continue
        out.append(name)
    out.sort(reverse=not watch.reverse)
    return out[:limits.watch_files_max]


def _set_key(watch: Watch, name: str) -> str | None:
    parts = name.split(watch.split)  # type: ignore[arg-type]
    if len(parts) < watch.match:
        return None
    return watch.split.join(parts[:watch.match])  # type: ignore[union-attr]


def units(watch: Watch, lists: list[list[str]], counts: dict[str, int]) -> list[Unit]:
    """Positions of the list(s): each list's files apart, or (match) the filesets across lists."""
    if not watch.match:
        return [Unit(p, name, {k: name}, k) for k, lst in enumerate(lists)
                for p, name in enumerate(lst)]
    keyed: list[dict[str, str]] = []
    for lst in lists:
        by_key: dict[str, str] = {}
        for name in lst:
            key = _set_key(watch, name)
            if key is not None:
                by_key.setdefault(key, name)  # the first in list order wins a shared key
        keyed.append(by_key)
    out: list[Unit] = []
    for key in keyed[0]:
        files = {k: by_key[key] for k, by_key in enumerate(keyed) if key in by_key}
        if len(files) < len(lists):
            counts["incomplete"] += 1
            if not watch.partial:
                continue
        out.append(Unit(len(out), key, files, 0))
    return out


def _context(watch: Watch, unit: Unit, k: int, index: int) -> dict[str, str]:
    filename = unit.files[k]
    ctx = dict(watch.values)
    ctx.update(name=watch.name, filename=filename, file=join(watch.path, filename),
               fileset=" ".join(unit.files[j] for j in sorted(unit.files)), index=str(index))
    for j in range(len(watch.globs)):
        ctx[f"fileset{j}"] = unit.files.get(j, "")
    parts = filename.split(watch.split) if watch.split else [filename]
    for i, part in enumerate(parts[:limits.watch_match_max]):
        ctx[str(i)] = part
    return ctx


def _specs_at(watch: Watch, index: int, unit: Unit) -> list[tuple[int, dict]]:
    """(list, spec) of jobs[index] for the unit: one job, or one per list file it has."""
    slot = watch.jobs[index]
    if not slot.per_list:
        spec = slot.specs[0]
        return [] if spec is None else [(unit.primary, spec)]
    out = []
    for k in sorted(unit.files):
        spec = slot.specs[min(k, len(slot.specs) - 1)]
        if spec is not None:
            out.append((k, spec))
    return out


def _processed(watch: Watch, fact: StateFact | None, index: int, mtime_ns: int) -> bool:
    if fact is None:
        return False
    if watch.updated and index == 0 and fact.mtime_ns is not None and fact.mtime_ns != mtime_ns:
        return False  # the file changed since its first job ran: that job runs again
    if fact.state in FAILURES:
        return not watch.retry or fact.attempt + 1 >= limits.watch_attempts_max
    return True


def _attempt(watch: Watch, fact: StateFact | None, mtime_ns: int) -> int:
    """The attempt number of the next submit: one past a failure of the same version."""
    if fact is None or fact.state not in FAILURES:
        return 0
    if fact.mtime_ns is not None and fact.mtime_ns != mtime_ns:
        return 0
    return fact.attempt + 1


def plan(watch: Watch, snap: Snapshot, now_ns: int, inflight: frozenset[str] = frozenset(),
         generations: Mapping[tuple[int, int], int] | None = None) -> Plan:
    """What to submit, write and remove now, given one snapshot of the folder, the clock and the
    ids of the jobs the watcher already follows. Deterministic in its inputs."""
    counts = {"files": 0, "units": 0, "incomplete": 0, "skipped": 0, "processed": 0,
              "running": 0, "submits": 0, "deferred": 0, "problems": 0}
    submits: list[Submit] = []
    writes: list[tuple[str, str]] = []
    removes: list[str] = []
    problems: list[str] = []
    room = limits.watch_inflight_max - len(inflight)

    def add(sub: Submit) -> None:
        nonlocal room
        if sub.job_id in inflight:
            counts["running"] += 1
        elif room <= 0:
            counts["deferred"] += 1
        else:
            room -= 1
            submits.append(sub)
            counts["submits"] += 1

    if not watch.globs:
        _always(watch, generations or {}, add, problems)
        counts["problems"] = len(problems)
        return Plan(submits, writes, removes, problems, counts)

    owners: dict[str, str] = {}
    known = facts(watch, snap.states, owners)
    if watch.cleanup and not watch.xattr:  # xattrs go with their file
        removes.extend(sorted(h for h, f in owners.items() if f not in snap.files))
    if not watch.xattr:
        # A state file's temporary name left by a watcher killed while writing it (the edge
        # writes and renames within one step, so none is in the making now).
        removes.extend(sorted(h for h in snap.states if h.endswith(TMP_SUFFIX)
                              and parse_state_name(watch.name, h[:-len(TMP_SUFFIX)])))
    young: list[int] = []
    lists = [listing(watch, g, snap.files, now_ns, young) for g in watch.globs]
    counts["files"] = sum(len(lst) for lst in lists)
    counts["deferred"] += len(young)  # (each is planned once old enough: Plan.due_ns)
    last = len(watch.jobs) - 1
    for unit in units(watch, lists, counts):
        if watch.max_index is not None and unit.pos > watch.max_index:
            continue
        counts["units"] += 1
        mtime = {k: snap.files[f].mtime_ns for k, f in unit.files.items()}
        if watch.skip is not None:
            base = unit.key + (watch.split if watch.match else ".") + watch.skip
            if base in snap.files:
                counts["skipped"] += 1
                for n in range(len(watch.jobs)):
                    for k, _ in _specs_at(watch, n, unit):
                        f = unit.files[k]
                        if not _processed(watch, known.get((n, f)), n, mtime[k]):
                            writes.append(_skip_record(watch, n, k, f, mtime[k], base))
                continue
        top = min(unit.pos, last)
        targets = list(range(top + 1)) if watch.run_all else [top]
        if watch.updated and 0 not in targets:
            f0 = unit.files[unit.primary]
            fact0 = known.get((0, f0))
            if fact0 is not None and not _processed(watch, fact0, 0, mtime[unit.primary]):
                targets.insert(0, 0)
        for n in targets:
            pending = [(k, spec) for k, spec in _specs_at(watch, n, unit)
                       if not _processed(watch, known.get((n, unit.files[k])), n, mtime[k])]
            if not pending:
                continue
            for k, spec in pending:
                f = unit.files[k]
                longest = state_name(watch.name, n, f, "dep_failed") + TMP_SUFFIX
                if not watch.xattr and len(longest.encode("utf-8", "surrogatepass")) > (
                        limits.watch_state_name_bytes_max):
                    problems.append(f"{watch.name}: file {f[:80]!r} has too long a name for its "
                                    "state file beside it: rename the file, or shorten the watch "
                                    "name")
                    continue
                attempt = _attempt(watch, known.get((n, f)), mtime[k])
                jid = job_id(watch.name, n, k, f, mtime[k], attempt)
                at = f"{watch.name} jobs[{n}] on {f[:80]!r}"
                try:
                    body = {**fill(spec, _context(watch, unit, k, n), at), "id": jid}
                    parse_submit(body)
                except Unfilled as e:
                    problems.append(str(e))
                    continue
                except ControlError as e:
                    problems.append(f"{at}: {e.message}")
                    continue
                add(Submit(jid, body, n, k, f, mtime[k], attempt))
            break  # one index at a time: jobs[n+1] waits for jobs[n] on this file
        else:
            counts["processed"] += 1
    counts["problems"] = len(problems)
    return Plan(submits, writes, removes, problems, counts, min(young, default=None))


def _skip_record(watch: Watch, n: int, k: int, f: str, mtime_ns: int,
                 by: str) -> tuple[str, str]:
    meta = {"name": watch.name, "index": n, "list": k, "file": f, "mtime_ns": mtime_ns,
            "attempt": 0}
    return (state_name(watch.name, n, f, "done"),
            json.dumps({"id": None, "state": "done", "skipped": by, "watch": meta}))


def _always(watch: Watch, generations: Mapping[tuple[int, int], int], add: Any,
            problems: list[str]) -> None:
    """A watch without globs keeps each of its jobs running: generation g of jobs[n][k] is
    submitted once generation g-1 has ended (the edge counts the generations)."""
    for n, slot in enumerate(watch.jobs):
        for k, spec in enumerate(slot.specs):
            if spec is None:
                continue
            gen = generations.get((n, k), 0)
            jid = job_id(watch.name, n, k, "", gen, 0)
            ctx = dict(watch.values)
            ctx.update(name=watch.name, filename="", file="", fileset="", index=str(n))
            at = f"{watch.name} jobs[{n}]"
            try:
                body = {**fill(spec, ctx, at), "id": jid}
                parse_submit(body)
            except Unfilled as e:
                problems.append(str(e))
                continue
            except ControlError as e:
                problems.append(f"{at}: {e.message}")
                continue
            add(Submit(jid, body, n, k, "", gen, 0))
