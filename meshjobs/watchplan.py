"""What `meshctl watch` submits: the config, the file lists and the jobs to make of them. Pure.

Theory of operation. A watch looks at the files of one folder (`path`). Each `glob` makes one file
list, sorted newest first (names Z->A, 9->0, as datestamped names sort; `reverse` turns it around)
after `min_age`/`max_age` have dropped files too young or too old. With `split` and `match`, the
lists are joined into filesets: the first `match` parts of a name (cut at `split`) are its key, and
a set is complete when every list has a file with the first list's key (`partial`: when the first
list has one). A set whose key plus `skip` exists is marked done and never run. Position n of the
list (file or set) runs `jobs[n]`, the last spec serving every position past the end, so as new
files arrive each older one moves down the chain; `run_all` runs the unprocessed specs 0..n in
turn, one index at a time. What has run is kept beside each file in `._<name>_<n>_<filename>.<state>`
(the job's result) and, for `updated`, the processed mtime: this module reads those facts from a
snapshot and says what to submit, write and remove; `meshjobs.watch` does the IO.

Rule 1: a job id is derived, never drawn: watch name, index, list, file name, mtime and attempt
  go through one digest. The same file at the same mtime is the same job, so a watcher killed
  between its submit and its state file submits the same id again, and meshd answers that the job
  exists: nothing runs twice.
Rule 2: state files are the only memory across restarts; in-flight ids are the edge's memory
  within one run. A damaged state file counts as its suffix says (`.done` is done); a failure of
  unknown attempt is retried from attempt 1, whose id meshd may already know (then it only waits).
Rule 3: config errors are all reported at once, each with its place and what to do; files that
  cannot be turned into a valid job are reported as problems of the plan, never raised.
Rule 4: every list, name and count is bounded by a named limit; the clock comes in as `now_ns`.
"""

from __future__ import annotations

import copy
import fnmatch
import hashlib
import json
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from meshjobs import limits
from meshjobs.control import ControlError, parse_submit

TOP_KEYS = ("name", "defaults", "client", "template", "watch", "cleanup")
CLIENT_KEYS = ("at", "token_file", "cacert")
BOOL_KEYS = {"reverse": False, "partial": False, "updated": False, "retry": True,
             "run_all": True, "cleanup": True}
NUMBER_KEYS = ("min_age", "max_age", "refresh", "rescan")
INT_KEYS = ("match", "max_index", "count")
WATCH_KEYS = frozenset({"template", "plugin", "path", "glob", "split", "skip", "jobs",
                        *BOOL_KEYS, *NUMBER_KEYS, *INT_KEYS})
REFRESH_S = 10.0  # the manual's defaults
RESCAN_S = 60.0
END_STATES = ("done", "failed", "cancelled", "dep_failed")
FAILURES = ("failed", "dep_failed")
# Format keys every job spec may use besides the watch's own keys (and %(<n>)s, %(fileset<n>)s).
FIXED_FORMAT_KEYS = ("name", "filename", "file", "fileset", "index")
NAME_RE = re.compile(rf"^[A-Za-z0-9.-]{{1,{limits.watch_name_chars_max}}}$")
UNSAFE_ID_RE = re.compile(r"[^A-Za-z0-9._-]+")
FORMAT_RE = re.compile(r"%(?:%|\(([A-Za-z0-9_]{1,64})\)s)")
STATE_NAME_BYTES_MAX = 255  # NAME_MAX of Linux filesystems: a longer state file cannot exist


class WatchError(Exception):
    """A config that cannot run: every problem found, each with its place and what to do."""

    def __init__(self, errors: list[str]) -> None:
        super().__init__("\n".join(errors))
        self.errors = errors


@dataclass(frozen=True)
class Slot:
    """jobs[n]: one spec for every list (`per_list` False), or one per list (the last serving
    the rest). A None spec does nothing."""

    specs: tuple[dict | None, ...]
    per_list: bool


@dataclass(frozen=True)
class Watch:
    name: str  # root, template and watch names joined by '-': logs, ids and state files use it
    key: str  # the watch's key in the config
    path: str
    globs: tuple[str, ...]
    jobs: tuple[Slot, ...]
    reverse: bool = False
    split: str | None = None
    match: int = 0
    partial: bool = False
    skip: str | None = None
    updated: bool = False
    retry: bool = True
    run_all: bool = True
    cleanup: bool = True
    min_age: float | None = None
    max_age: float | None = None
    max_index: int | None = None
    refresh: float = REFRESH_S
    rescan: float = RESCAN_S
    count: int | None = None
    values: Mapping[str, str] = field(default_factory=dict)  # %(<k>)s of the watch's own keys


@dataclass(frozen=True)
class Config:
    name: str
    client: Mapping[str, str]
    watches: tuple[Watch, ...]


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


@dataclass(frozen=True)
class StateFact:
    state: str
    attempt: int
    mtime_ns: int | None


# --- Config --------------------------------------------------------------------------------------

def load_text(text: str, where: str, fmt: str = "auto") -> dict:
    """A config file's text as a dict: JSON, or TOML (`fmt` "json", "toml", or "auto": JSON when
    the text starts with '{')."""
    if len(text.encode("utf-8", "surrogatepass")) > limits.watch_config_bytes_max:
        raise WatchError([f"{where}: larger than {limits.watch_config_bytes_max} bytes: split it "
                          "into several config files (they are merged in order)"])
    if fmt == "auto":
        fmt = "json" if text.lstrip().startswith("{") else "toml"
    try:
        raw = json.loads(text) if fmt == "json" else tomllib.loads(text)
    except (ValueError, RecursionError) as e:
        kind = "JSON" if fmt == "json" else "TOML"
        raise WatchError([f"{where}: not valid {kind} ({str(e)[:200]}): fix the file"]) from None
    if not isinstance(raw, dict):
        raise WatchError([f"{where}: the config must be an object with a \"watch\" section"])
    return raw


def merge(base: Mapping, over: Mapping) -> dict:
    """`over` laid on `base`: objects merge key by key, anything else replaces."""
    out = copy.deepcopy(dict(base))
    for k, v in over.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), Mapping):
            out[k] = merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def _override_value(text: str) -> Any:
    """A command-line value: JSON when it parses (numbers, true, false, null, quoted, lists), a
    comma-separated list of such when it has commas, else the text itself."""
    try:
        return json.loads(text)
    except ValueError:
        pass
    if "," in text:
        return [_override_value(p) for p in text.split(",")]
    return text


def apply_overrides(raw: Mapping, args: list[str]) -> dict:
    """`key.subkey=value` overrides (the manual's command line) laid on the config."""
    if len(args) > limits.watch_overrides_max:
        raise WatchError([f"{len(args)} overrides: give at most {limits.watch_overrides_max}, "
                          "or put them in a config file"])
    out = copy.deepcopy(dict(raw))
    errors = []
    for arg in args:
        key, eq, value = arg.partition("=")
        parts = key.split(".")
        if not eq or not key or any(not p for p in parts):
            errors.append(f"override {arg[:80]!r}: write KEY.SUBKEY=VALUE (e.g. watch.in.rescan=30)")
            continue
        if len(parts) > limits.watch_key_depth_max:
            errors.append(f"override {arg[:80]!r}: at most {limits.watch_key_depth_max} key parts")
            continue
        node = out
        for i, p in enumerate(parts[:-1]):
            nxt = node.get(p)
            if nxt is None:
                nxt = node[p] = {}
            if not isinstance(nxt, dict):
                errors.append(f"override {arg[:80]!r}: {'.'.join(parts[:i + 1])} is not a section "
                              "in the config: override the whole value instead")
                break
            node = nxt
        else:
            node[parts[-1]] = _override_value(value)
    if errors:
        raise WatchError(errors)
    return out


def _bool(v: Any, where: str, errors: list[str]) -> bool:
    if isinstance(v, bool):
        return v
    if isinstance(v, int) and v in (0, 1):
        return bool(v)
    errors.append(f"{where}: must be true or false (or 1 or 0), not {str(v)[:40]!r}")
    return False


def _number(v: Any, where: str, errors: list[str], lo: float, positive: bool) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v or not (
            lo <= v <= limits.watch_period_s_max) or (positive and v <= 0):
        least = "more than 0" if positive else f"at least {lo:g}"
        errors.append(f"{where}: must be a number of seconds, {least} and at most "
                      f"{limits.watch_period_s_max}, not {str(v)[:40]!r}")
        return None
    return float(v)


def _int(v: Any, where: str, errors: list[str], lo: int, hi: int) -> int | None:
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        errors.append(f"{where}: must be a whole number from {lo} to {hi}, not {str(v)[:40]!r}")
        return None
    return v


def _value_text(v: Any) -> str | None:
    """What %(<k>)s of a watch key gives: scalars as text, lists of scalars joined by spaces."""
    if isinstance(v, bool):
        return "1" if v else "0"
    if isinstance(v, (str, int, float)):
        return str(v)
    if isinstance(v, list) and all(isinstance(x, (str, int, float)) and not isinstance(x, bool)
                                   for x in v):
        return " ".join(str(x) for x in v)
    return None


def _template_names(v: Any, where: str, errors: list[str]) -> list[str]:
    names = v.split(",") if isinstance(v, str) else v
    if not isinstance(names, list) or not all(isinstance(n, str) and n for n in names):
        errors.append(f"{where}: name one template, or a list (or comma-separated names)")
        return []
    if len(names) > limits.watch_templates_max:
        errors.append(f"{where}: at most {limits.watch_templates_max} templates")
        return []
    return [n.strip() for n in names]


def build(raw: Mapping) -> Config:
    """The whole config checked and resolved (defaults, templates, keys), or WatchError with every
    problem found."""
    errors: list[str] = []
    if not isinstance(raw, Mapping):
        raise WatchError(["the config must be an object with a \"watch\" section"])
    unknown = sorted(str(k) for k in raw if k not in TOP_KEYS)
    if unknown:
        errors.append(f"unknown top-level key(s) {', '.join(unknown)[:200]}: the config has "
                      f"{', '.join(TOP_KEYS)}")
    root = raw.get("name", "")
    if root != "" and (not isinstance(root, str) or not NAME_RE.fullmatch(root)):
        errors.append(f"name: use 1 to {limits.watch_name_chars_max} letters, digits, '.' or '-' "
                      "('_' separates names in state files)")
        root = ""
    sections = {}
    for sec in ("defaults", "client", "template", "watch"):
        v = raw.get(sec, {})
        if not isinstance(v, Mapping):
            errors.append(f"{sec}: must be an object (a TOML table)")
            v = {}
        sections[sec] = v
    defaults = dict(sections["defaults"])
    if "cleanup" in raw:
        defaults.setdefault("cleanup", raw["cleanup"])
    client: dict[str, str] = {}
    for k, v in {**{k: defaults[k] for k in CLIENT_KEYS if k in defaults},
                 **sections["client"]}.items():
        if k not in CLIENT_KEYS:
            errors.append(f"client.{k}: unknown key; the client section has "
                          f"{', '.join(CLIENT_KEYS)}")
        elif not isinstance(v, str) or not v:
            errors.append(f"client.{k}: must be a non-empty string")
        else:
            client[k] = v
    templates = sections["template"]
    for tname, t in templates.items():
        if not isinstance(t, Mapping):
            errors.append(f"template.{tname}: must be an object (the keys of a watch)")
        elif "template" in t:
            errors.append(f"template.{tname}: templates do not apply templates; list them all "
                          "in the watch's \"template\"")
    watches = sections["watch"]
    if not watches and not errors:
        errors.append("no watch defined: add \"watch\": {\"NAME\": {\"path\": DIR, \"glob\": "
                      "\"*\", \"jobs\": [{\"argv\": [\"prog\", \"%(file)s\"]}]}}")
    if len(watches) > limits.watches_max:
        errors.append(f"watch: {len(watches)} watches, at most {limits.watches_max}: split the "
                      "config and run several watchers")
        watches = {}
    built: list[Watch] = []
    for key, w in watches.items():
        where = f"watch.{key}"
        if not isinstance(key, str) or not NAME_RE.fullmatch(key):
            errors.append(f"{where}: name it with 1 to {limits.watch_name_chars_max} letters, "
                          "digits, '.' or '-' ('_' separates names in state files)")
            continue
        if not isinstance(w, Mapping):
            errors.append(f"{where}: must be an object with path, glob and jobs")
            continue
        tnames = _template_names(w.get("template", defaults.get("template", [])),
                                 f"{where}.template", errors)
        merged = {k: v for k, v in defaults.items() if k != "template"}
        ok = True
        for tname in tnames:
            t = templates.get(tname)
            if not isinstance(t, Mapping):
                known = ", ".join(sorted(map(str, templates))) or "none"
                errors.append(f"{where}.template: no template {tname[:40]!r} (defined: "
                              f"{known[:200]}): define it under \"template\" or fix the name")
                ok = False
                continue
            merged.update({k: v for k, v in t.items() if k != "template"})
        merged.update({k: v for k, v in w.items() if k != "template"})
        bad_t = [t for t in tnames if not NAME_RE.fullmatch(t)]
        if bad_t:
            errors.append(f"{where}.template: template names use letters, digits, '.' or '-'")
            continue
        full = "-".join([*(p for p in [root] if p), *tnames, key])
        if len(full) > limits.watch_full_name_chars_max:
            errors.append(f"{where}: its full name {full[:40]}... is longer than "
                          f"{limits.watch_full_name_chars_max} characters: shorten the names")
            continue
        watch = _watch(key, full, merged, where, errors)  # checked even when a template is missing
        if watch is not None and ok:
            built.append(watch)
    seen: dict[tuple[str, str], str] = {}
    for watch in built:
        other = seen.setdefault((watch.name, watch.path), watch.key)
        if other != watch.key:
            errors.append(f"watch.{watch.key}: same name {watch.name} and path as watch.{other}: "
                          "their state files would mix; rename one")
    if errors:
        raise WatchError(errors)
    return Config(name=root, client=client, watches=tuple(built))


def _watch(key: str, full: str, w: Mapping, where: str, errors: list[str]) -> Watch | None:
    before = len(errors)
    kw: dict[str, Any] = {}
    if "plugin" in w:
        errors.append(f"{where}.plugin: plugins are not supported: meshctl watch keeps state in "
                      "hidden files beside each file; remove plugin")
    path = w.get("path")
    if not isinstance(path, str) or not path or "\0" in path:
        errors.append(f"{where}.path: give the folder to watch (a non-empty string)")
    globs_v = w.get("glob", [])
    globs = [globs_v] if isinstance(globs_v, str) else globs_v
    if not isinstance(globs, list) or not all(
            isinstance(g, str) and g and "/" not in g and "\0" not in g for g in globs):
        errors.append(f"{where}.glob: a pattern, or a list of patterns, matching names in path "
                      "(no '/': put a subfolder in path)")
        globs = []
    elif len(globs) > limits.watch_globs_max:
        errors.append(f"{where}.glob: at most {limits.watch_globs_max} patterns")
        globs = []
    for k, default in BOOL_KEYS.items():
        kw[k] = _bool(w[k], f"{where}.{k}", errors) if k in w else default
    for k in NUMBER_KEYS:
        if k in w:
            kw[k] = _number(w[k], f"{where}.{k}", errors, 0, k in ("refresh", "rescan"))
    if kw.get("refresh") is None:
        kw["refresh"] = REFRESH_S
    if kw.get("rescan") is None:
        kw["rescan"] = RESCAN_S
    if kw.get("min_age") is not None and kw.get("max_age") is not None and (
            kw["min_age"] >= kw["max_age"]):
        errors.append(f"{where}: min_age must be less than max_age, or no file is ever old enough "
                      "and young enough")
    bounds = {"match": (0, limits.watch_match_max), "max_index": (0, limits.watch_files_max),
              "count": (1, limits.watch_count_max)}
    for k in INT_KEYS:
        if k in w:
            kw[k] = _int(w[k], f"{where}.{k}", errors, *bounds[k])
    if kw.get("match") is None:
        kw["match"] = 0
    split = w.get("split")
    if split is not None and (not isinstance(split, str) or not split or "\0" in split
                              or len(split) > limits.watch_split_chars_max):
        errors.append(f"{where}.split: 1 to {limits.watch_split_chars_max} characters to cut "
                      "file names at (e.g. \".\")")
        split = None
    if kw["match"] and split is None:
        errors.append(f"{where}.match: needs split, the character(s) to cut file names at")
    skip = w.get("skip")
    if skip is not None and (not isinstance(skip, str) or not skip or "/" in skip
                             or "\0" in skip):
        errors.append(f"{where}.skip: a suffix (e.g. \"out\"), without '/'")
        skip = None
    values: dict[str, str] = {}
    for k, v in w.items():
        if k in WATCH_KEYS and k not in ("path", "glob", "split", "skip", *BOOL_KEYS,
                                         *NUMBER_KEYS, *INT_KEYS):
            continue
        text = _value_text(v)
        if text is None:
            if k not in WATCH_KEYS:
                errors.append(f"{where}.{k}: unknown key with a value that is not text, a number "
                              "or a list of them; watch keys are "
                              f"{', '.join(sorted(WATCH_KEYS))}")
            continue
        if not isinstance(k, str) or not re.fullmatch(r"[A-Za-z0-9_]{1,64}", k):
            errors.append(f"{where}: key {str(k)[:40]!r}: use letters, digits and '_' so "
                          "%(key)s can name it")
            continue
        values[k] = text
    jobs = _jobs(w.get("jobs"), f"{where}.jobs", errors)
    # The specs are checked whatever else is wrong, so that one run reports everything.
    kw = {k: v for k, v in kw.items() if v is not None}
    watch = Watch(name=full, key=key, path=path if isinstance(path, str) else "",
                  globs=tuple(globs), jobs=jobs, split=split, skip=skip, values=values, **kw)
    _check_specs(watch, where, errors)
    return None if len(errors) > before else watch


def _spec(v: Any, where: str, errors: list[str]) -> dict | None:
    if v is None or v == {}:
        return None
    if not isinstance(v, Mapping):
        errors.append(f"{where}: a job spec is an object (the keys of POST /jobs), null or {{}}")
        return None
    spec = dict(v)
    if "args" in spec:
        if "argv" in spec:
            errors.append(f"{where}: give argv or args (the same thing), not both")
            return None
        spec["argv"] = spec.pop("args")
    if "id" in spec:
        errors.append(f"{where}.id: drop it: the watch derives each job's id from its name, "
                      "index, file and mtime, so that no file is processed twice")
        return None
    return spec


def _jobs(v: Any, where: str, errors: list[str]) -> tuple[Slot, ...]:
    if v is None or v == []:
        errors.append(f"{where}: give a list of job specs, e.g. [{{\"argv\": [\"prog\", "
                      "\"%(file)s\"]}]")
        return ()
    if isinstance(v, Mapping):
        v = [v]
    if not isinstance(v, list) or len(v) > limits.watch_jobs_max:
        errors.append(f"{where}: a list of at most {limits.watch_jobs_max} job specs")
        return ()
    slots = []
    for n, item in enumerate(v):
        if isinstance(item, list):
            if not item or len(item) > limits.watch_jobs_max:
                errors.append(f"{where}[{n}]: a list of 1 to {limits.watch_jobs_max} job specs "
                              "(one per file list)")
                continue
            slots.append(Slot(tuple(_spec(s, f"{where}[{n}][{k}]", errors)
                                    for k, s in enumerate(item)), per_list=True))
        else:
            slots.append(Slot((_spec(item, f"{where}[{n}]", errors),), per_list=False))
    return tuple(slots)


class _Sample(dict):
    """A format context for checking specs at load time: every digit key is a filename part."""

    def __contains__(self, key: object) -> bool:
        return super().__contains__(key) or (isinstance(key, str) and key.isdigit())

    def __getitem__(self, key: str) -> str:
        return "0" if key.isdigit() and not super().__contains__(key) else super().__getitem__(key)


def _check_specs(watch: Watch, where: str, errors: list[str]) -> None:
    """Each spec filled with sample values must be a valid POST /jobs body."""
    sample = _Sample(watch.values)
    sample.update(name=watch.name, filename="f", file=_join(watch.path, "f"), fileset="f",
                  index="0")
    for k in range(max(len(watch.globs), 1)):
        sample[f"fileset{k}"] = "f"
    for n, slot in enumerate(watch.jobs):
        for k, spec in enumerate(slot.specs):
            if spec is None:
                continue
            at = f"{where}.jobs[{n}]" + (f"[{k}]" if slot.per_list else "")
            try:
                parse_submit({**fill(spec, sample, at), "id": "x"})
            except _Unfilled as e:
                errors.append(str(e))
            except ControlError as e:
                errors.append(f"{at}: {e.message}")


# --- Format keys ---------------------------------------------------------------------------------

class _Unfilled(Exception):
    pass


def _fill_text(text: str, ctx: Mapping[str, str], where: str) -> str:
    out: list[str] = []
    size = 0
    i = 0
    while True:
        j = text.find("%", i)
        if j < 0:
            out.append(text[i:])
            break
        out.append(text[i:j])
        m = FORMAT_RE.match(text, j)
        if m is None:
            raise _Unfilled(f"{where}: a '%' at character {j} that is neither %% nor %(key)s: "
                            "write %% for a percent sign")
        key = m.group(1)
        if key is None:
            out.append("%")
        elif key not in ctx:
            raise _Unfilled(f"{where}: no format key %({key})s here: use name, filename, file, "
                            "fileset, fileset<n>, index, <n> (a part of the file name) or a key "
                            "of the watch")
        else:
            out.append(ctx[key])
        size += len(out[-1]) + j - i
        if size > limits.argv_bytes_max:
            raise _Unfilled(f"{where}: longer than {limits.argv_bytes_max} characters once filled in")
        i = m.end()
    return "".join(out)


def fill(spec: Any, ctx: Mapping[str, str], where: str) -> Any:
    """A job spec with the format keys of every string in it (values, not keys) filled in."""
    if isinstance(spec, str):
        return _fill_text(spec, ctx, where)
    if isinstance(spec, list):
        return [fill(v, ctx, f"{where}[{i}]") for i, v in enumerate(spec)]
    if isinstance(spec, Mapping):
        return {k: fill(v, ctx, f"{where}.{k}") for k, v in spec.items()}
    return spec


def _join(path: str, name: str) -> str:
    return path + name if path.endswith("/") else f"{path}/{name}"


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
    if not sep or not n_text.isascii() or not n_text.isdigit() or len(n_text) > 4:
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


def facts(watch: Watch, states: Mapping[str, str | None]) -> dict[tuple[int, str], StateFact]:
    """(index, filename) -> the best state fact of the watch's state files: done over failure."""
    rank = {"done": 3, "cancelled": 2, "failed": 1, "dep_failed": 1}
    out: dict[tuple[int, str], StateFact] = {}
    mtimes: dict[tuple[int, str], int] = {}
    for hidden, text in states.items():
        parsed = parse_state_name(watch.name, hidden)
        if parsed is None:
            continue
        n, filename, state = parsed
        if state == "mtime":
            if text is not None and text.strip().isdigit() and len(text) < 32:
                mtimes[(n, filename)] = int(text.strip())
            continue
        f = _fact(state, text)
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


def listing(watch: Watch, pattern: str, files: Mapping[str, FileFact], now_ns: int) -> list[str]:
    """The names of one glob's list, aged and sorted (newest first: Z->A unless `reverse`)."""
    dotted = pattern.startswith(".")
    out = []
    for name, f in files.items():
        if name.startswith("._") or (name.startswith(".") and not dotted):
            continue
        if not fnmatch.fnmatchcase(name, pattern):
            continue
        age_s = (now_ns - f.mtime_ns) / 1e9
        if watch.min_age is not None and age_s < watch.min_age:
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
    ctx.update(name=watch.name, filename=filename, file=_join(watch.path, filename),
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

    known = facts(watch, snap.states)
    if watch.cleanup:
        for hidden in sorted(snap.states):
            parsed = parse_state_name(watch.name, hidden)
            if parsed is not None and parsed[1] not in snap.files:
                removes.append(hidden)
    lists = [listing(watch, g, snap.files, now_ns) for g in watch.globs]
    counts["files"] = sum(len(lst) for lst in lists)
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
                if len(state_name(watch.name, n, f, "dep_failed").encode(
                        "utf-8", "surrogatepass")) > STATE_NAME_BYTES_MAX:
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
                except _Unfilled as e:
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
    return Plan(submits, writes, removes, problems, counts)


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
            except _Unfilled as e:
                problems.append(str(e))
                continue
            except ControlError as e:
                problems.append(f"{at}: {e.message}")
                continue
            add(Submit(jid, body, n, k, "", gen, 0))
