"""The config of `meshctl watch` (see meshjobs.watchplan): JSON or TOML text, key.subkey=value
overrides, defaults and templates resolved, every key checked, and the format keys of job specs.
Pure: text in, a Config or one WatchError with every problem out.
"""

from __future__ import annotations

import copy
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
             "run_all": True, "cleanup": True, "xattr": False}
XATTR_PLUGIN = "meeseeks.watch.WatchXattr"  # the manual's plugin: state in xattrs (`xattr`)
NUMBER_KEYS = ("min_age", "max_age", "refresh", "rescan")
INT_KEYS = ("match", "max_index", "count")
WATCH_KEYS = frozenset({"template", "plugin", "path", "glob", "split", "skip", "jobs",
                        *BOOL_KEYS, *NUMBER_KEYS, *INT_KEYS})
REFRESH_S = 10.0  # the manual's defaults
RESCAN_S = 60.0
# Format keys every job spec may use besides the watch's own keys (and %(<n>)s, %(fileset<n>)s).
FIXED_FORMAT_KEYS = ("name", "filename", "file", "fileset", "index")
NAME_RE = re.compile(rf"^[A-Za-z0-9.-]{{1,{limits.watch_name_chars_max}}}$")
FORMAT_RE = re.compile(r"%(?:%|\(([A-Za-z0-9_]{1,64})\)s)")


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
    xattr: bool = False  # state in each file's extended attributes, not in hidden files
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
    if "plugin" in w and w["plugin"] != XATTR_PLUGIN:
        errors.append(f"{where}.plugin: only {XATTR_PLUGIN} (the same as \"xattr\": true) is "
                      "built in; remove plugin to keep state in hidden files")
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
    if w.get("plugin") == XATTR_PLUGIN:
        kw["xattr"] = True
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


def rooted(watch: Watch, path: str) -> Watch:
    """The watch with its folder given as `path` (the edge makes it absolute), %(path)s too."""
    return replace(watch, path=path, values={**watch.values, "path": path})


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
    sample.update(name=watch.name, filename="f", file=join(watch.path, "f"), fileset="f",
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
            except Unfilled as e:
                errors.append(str(e))
            except ControlError as e:
                errors.append(f"{at}: {e.message}")


# --- Format keys ---------------------------------------------------------------------------------

class Unfilled(Exception):
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
            raise Unfilled(f"{where}: a '%' at character {j} that is neither %% nor %(key)s: "
                            "write %% for a percent sign")
        key = m.group(1)
        if key is None:
            out.append("%")
        elif key not in ctx:
            raise Unfilled(f"{where}: no format key %({key})s here: use "
                           f"{', '.join(FIXED_FORMAT_KEYS)}, fileset<n>, <n> (a part of the file "
                           "name) or a key of the watch")
        else:
            out.append(ctx[key])
        size += len(out[-1]) + j - i
        if size > limits.argv_bytes_max:
            raise Unfilled(f"{where}: longer than {limits.argv_bytes_max} characters once filled in")
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


def join(path: str, name: str) -> str:
    return path + name if path.endswith("/") else f"{path}/{name}"
