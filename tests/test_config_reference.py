"""docs/configuration.md against the code: every key of the config models is documented, no
documented key is unknown, the defaults written as TOML values are the code's, and every flag of
`meshd --help` is documented.

A default is checked by loading two files that differ only by that key: one without it, one with
the documented value. Both must give the same Config (meshjobs/config.py's defaults are what a
member does without the key)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib

import pytest

from meshjobs import configfile
from meshjobs.config import load_config
from tests.helpers import ROOT, env_with_path

DOC = os.path.join(ROOT, "docs", "configuration.md")
HEADING = re.compile(r"^## (.+)$")
# A table row: | `key` | type | default | unit | meaning |; `\|` is a pipe inside a cell.
ROW = re.compile(r"^\|\s*`([a-z_0-9]+)`\s*\|")
CELL_SPLIT = re.compile(r"(?<!\\)\|")
LITERAL = re.compile(r"^`([^`]+)`$")
TOKEN = '{ name = "t", role = "read", sha256 = "' + "ab" * 32 + '" }'
# What each table needs besides the key under test to be a file meshd runs with.
BASE_LINES = {("auth",): f"tokens = [ {TOKEN} ]\n", ("pools", "*"): "slots = 1\n"}


def table_of(heading: str) -> tuple[str, ...] | None:
    """The key path of a heading: `Top level` -> (), `[fleet] voters[]` -> ("fleet", "voters",
    "*"), `[pools.NAME]` -> ("pools", "*"); None for a heading that is no table."""
    if heading == "Top level":
        return ()
    m = re.fullmatch(r"\[([a-z_.A-Z]+)\](?: ([a-z_]+)\[\])?", heading)
    if m is None:
        return None
    path = tuple("*" if part == "NAME" else part for part in m.group(1).split("."))
    return (*path, m.group(2), "*") if m.group(2) else path


def documented(text: str) -> dict[tuple[str, ...], dict[str, str]]:
    """Every documented key: its table's path -> key -> its default cell."""
    out: dict[tuple[str, ...], dict[str, str]] = {}
    table: tuple[str, ...] | None = None
    for line in text.splitlines():
        h = HEADING.match(line)
        if h:
            table = table_of(h.group(1).strip())
            if table is not None:
                out.setdefault(table, {})
            continue
        m = ROW.match(line)
        if m and table is not None:
            cells = [c.strip() for c in CELL_SPLIT.split(line)[1:-1]]
            assert len(cells) == 5, f"a key's row has 5 cells (key, type, default, unit, meaning): {line}"
            assert m.group(1) not in out[table], f"{m.group(1)} twice under {table}"
            out[table][m.group(1)] = cells[2]
    return out


def model_keys() -> dict[tuple[str, ...], set[str]]:
    return {path: set(model.model_fields) for path, model in configfile.TABLES.items()}


def config_text(table: tuple[str, ...], line: str) -> str:
    """A whole file with `line` in `table` (and what that table needs besides)."""
    if not table:
        return f'name = "m"\n{line}'
    header = ".".join("p" if part == "*" else part for part in table)
    return f'name = "m"\n[{header}]\n{BASE_LINES.get(table, "")}{line}'


def load(folder: str, name: str, text: str):
    path = os.path.join(folder, name)
    with open(path, "w") as f:
        f.write(text)
    return load_config(path)


def problems(text: str, folder: str) -> list[str]:
    """What is wrong with a configuration reference, in words (empty: nothing)."""
    found = []
    doc = documented(text)
    code = model_keys()
    for table, keys in code.items():
        for key in sorted(keys - set(doc.get(table, {}))):
            if (*table, key) in doc or (*table, key, "*") in doc:
                continue  # a table with a section of its own ([fleet], [pools.NAME])
            found.append(f"{table} {key}: in the config models, not in the reference")
    for table, rows in doc.items():
        for key in sorted(set(rows) - code.get(table, set())):
            found.append(f"{table} {key}: in the reference, not a key meshd takes")
    for table, rows in doc.items():
        for key, default in rows.items():
            lit = LITERAL.match(default)
            if lit is None or key not in code.get(table, set()):
                continue  # a default in words (computed, required, none)
            try:
                value = tomllib.loads(f"v = {lit.group(1)}")["v"]
            except tomllib.TOMLDecodeError:
                found.append(f"{table} {key}: default {default} is not a TOML value")
                continue
            without = load(folder, "without.toml", config_text(table, ""))
            line = f"{key} = {lit.group(1)}\n"
            try:
                with_it = load(folder, "with.toml", config_text(table, line))
            except Exception as e:  # the documented default is not even a value meshd takes
                found.append(f"{table} {key}: default {default} is refused: {e}")
                continue
            if with_it != without:
                found.append(f"{table} {key}: default {default} is not the code's default "
                             f"({value!r} changes the configuration)")
    return found


def test_every_key_documented_with_its_default(tmp_path):
    """Rule: docs/configuration.md names every key of the config models and no other, and each
    default it writes as a TOML value is what the code does without the key."""
    with open(DOC) as f:
        text = f.read()
    assert documented(text)[()], "the reference has a `## Top level` table"
    assert problems(text, str(tmp_path)) == []


def test_reference_covers_every_table():
    """Rule: every table of the models (top level, [http], [fleet] voters[], [pools.NAME], ...)
    has a section of its own."""
    with open(DOC) as f:
        doc = documented(f.read())
    assert set(doc) == set(model_keys())


@pytest.mark.parametrize("change, says", [
    (("| `dead_ms` | integer | `3000` |", "| `dead_ms` | integer | `2000` |"), "not the code's"),
    (("| `keep` | integer | `3` |", "| `keep` | integer | `4` |"), "not the code's"),
    (("`\"fleet.secret\"`", "`\"other.secret\"`"), "not the code's"),
    (("| `mem_max` |", "| `mem_maxx` |"), "not a key meshd takes"),
    (("| `gc_every_s` | number |", "| gc_every_s | number |"), "not in the reference"),
    (("| `slots` | integer | one per core |", "| `slots` | integer | `-1` |"), "refused"),
    (("| `keep_s` | number | `604800` |", "| `keep_s` | number | `7 days` |"), "not a TOML value"),
])
def test_checker_finds_a_wrong_reference(tmp_path, change, says):
    """The check is not vacuous: a wrong default, an unknown key, a missing key and a default
    meshd refuses are each found."""
    with open(DOC) as f:
        text = f.read()
    old, new = change
    assert text.count(old) >= 1, old
    found = problems(text.replace(old, new, 1), str(tmp_path))
    assert any(says in p for p in found), found


def test_every_meshd_flag_documented():
    """Rule: every flag `meshd --help` lists is in the reference's command-line table."""
    r = subprocess.run([sys.executable, "-m", "meshjobs.daemon", "--help"], capture_output=True,
                       text=True, env=env_with_path(), timeout=60)
    assert r.returncode == 0, r.stderr
    flags = set(re.findall(r"(?<![\w-])(--[a-z][a-z-]*)", r.stdout))
    assert "--config" in flags
    with open(DOC) as f:
        text = f.read()
    section = text[text.index("## meshd's command line"):]
    missing = {f for f in flags if f"`{f}" not in section}
    assert not missing, f"flags of meshd not in docs/configuration.md: {sorted(missing)}"


def test_readme_and_operating_point_to_the_reference():
    """Rule: the README and docs/operating.md send readers to docs/configuration.md, and nothing
    points to a DESIGN file that is not in the repository."""
    for rel in ("README.md", "docs/operating.md"):
        with open(os.path.join(ROOT, rel)) as f:
            assert "docs/configuration.md" in f.read(), rel
    for folder in ("meshjobs", "docs", "deploy"):
        for dirpath, _, files in os.walk(os.path.join(ROOT, folder)):
            for name in files:
                if name.endswith((".py", ".md", ".toml", ".service", ".yaml")):
                    with open(os.path.join(dirpath, name)) as f:
                        assert "DESIGN" not in f.read(), os.path.join(dirpath, name)
    with open(os.path.join(ROOT, "README.md")) as f:
        assert "DESIGN" not in f.read()
