"""meshd's config file is checked against typed models (meshjobs/configfile.py): every problem
of a file is reported at once, each naming its key path and what to put there."""

from __future__ import annotations

import pytest

from meshjobs import limits
from meshjobs.config import ConfigError, load_config
from meshjobs.configfile import ConfigFile, key_path, read
from tests.helpers import Meshd, member_config

SEVERAL = """
name = "a"
bogus = 1
items = 1
[pools.x]
kind = "ruby"
slots = -1
[fleet]
dead_ms = 5000
lost_ms = 1000
[blobs]
mem_max = "lots"
[history]
keep = 1000
rotate = 1
[auth]
tokens = [ { name = "ci", role = "root", sha256 = "abc" }, { role = "read", sha256 = "%s" } ]
[http]
addr = "127.0.0.1:1"
conns_max = 0
""" % ("0" * 64)

# Each problem of SEVERAL: its key path and a word of what to put there.
EXPECTED = [
    ("unknown key 'bogus'", "remove it"),
    ("[items] must be a table", "not 1"),
    ("[pools.x] kind", "one of command, python"),
    ("[pools.x] slots", "0..100000"),
    ("[fleet] lost_ms (1000) must be at least dead_ms (5000)", "lost"),
    ("[blobs] mem_max", "non-negative integer"),
    ("[history] keep", f"at most {limits.history_keep_files_max}"),
    ("[history]: unknown key 'rotate'", "bytes_max, keep"),
    ("[auth] tokens[0].role", "one of read, submit, admin"),
    ("[auth] tokens[0].sha256", "64 hex characters"),
    ("[auth] tokens[1].name is missing", "letters, digits"),
    ("[http] conns_max", f"1..{limits.http_conns_max}"),
]


def test_every_problem_is_reported_at_once(tmp_path):
    """Rule: a file with many mistakes (unknown keys, wrong types, values out of range, keys
    missing, keys that disagree) is refused once, with every mistake named by its key path and
    what to do, one a line."""
    f = tmp_path / "bad.toml"
    f.write_text(SEVERAL)
    with pytest.raises(ConfigError) as e:
        load_config(str(f))
    text = str(e.value)
    assert text.startswith(f"{f} has {len(EXPECTED)} problems")
    assert len(e.value.problems) == len(EXPECTED), e.value.problems
    for where, what in EXPECTED:
        line = next((p for p in e.value.problems if p.startswith(where)), None)
        assert line is not None, (where, e.value.problems)
        assert what in line, (what, line)
        assert f"  - {line}" in text


def test_one_problem_is_one_line(tmp_path):
    """A single problem is the message itself, as before."""
    f = tmp_path / "bad.toml"
    f.write_text('name = "a"\n[pools.x]\nslots = -1\n')
    with pytest.raises(ConfigError) as e:
        load_config(str(f))
    assert str(e.value) == "[pools.x] slots must be an integer 0..100000, not -1"


@pytest.mark.parametrize("raw,problem", [
    ({"pools": {"g": {"slots": True}}}, "[pools.g] slots must be an integer 0..100000, not True"),
    ({"fleet": {"voters": [{"name": "a", "raft": "h:1"}]}}, "[fleet] voters[0].peer is missing"),
    ({"fleet": {"voters": "a"}}, "[fleet] voters must be a list of { name, raft, peer, http }"),
    ({"http": 5}, '[http] must be "host:port" (a port 0..65535) or an [http] table, not 5'),
    ({"http": {"names": ["a b"]}}, "[http] names[0]: string should match pattern"),
    ({"retention": {"keep_s": 1.5, "keep_jobs": 2.5}}, "[retention] keep_jobs must be a non-neg"),
    ({"items": {"env_pass": ["*"]}}, '[items] env_pass: "*" would pass'),
    ({"auth": {"allow_anonymous": 1}}, "[auth] allow_anonymous must be true or false, not 1"),
    ({"name": ["a"]}, "name must be the member's name"),
])
def test_problems_name_their_key_path(raw, problem):
    """Each kind of mistake names where it is as the file writes it."""
    _, problems = read(raw)
    assert any(p.startswith(problem) for p in problems), problems


@pytest.mark.parametrize("raw", [
    {"x" * 100_000: 1},
    {"name": "n" * 100_000},
    {"pools": {"p": {"kind": "k" * 100_000}}},
    {"auth": {"tokens": [{"name": "a", "role": "read", "sha256": "0" * 100_000}]}},
    {"items": {"env_pass": ["A" * 100_000]}},
    {"http": {"names": ["h" * 100_000]}},
    {"notify": {"allow": ["h" * 100_000]}},
    {"notify": {"allow": ["10.0.0.0/8"] * 100_000}},
    {"fleet": {"voters": [[[[[[[1]]]]]]]}},
])
def test_hostile_values_are_not_echoed_whole(raw):
    """A huge or deeply nested value is refused with a problem of bounded length."""
    _, problems = read(raw)
    assert problems and all(len(p) < 600 for p in problems), problems


def test_key_paths():
    assert key_path(("name",)) == "name"
    assert key_path(("items",)) == "[items]"
    assert key_path(("pools", "gpu", "slots")) == "[pools.gpu] slots"
    assert key_path(("fleet", "voters", 1, "raft")) == "[fleet] voters[1].raft"


def test_the_models_know_every_key_config_reads():
    """The file's top-level keys are the model's, as documented (docs/ and deploy/ use them)."""
    assert set(ConfigFile.model_fields) == {
        "name", "data", "http", "peer", "raft", "secret_file", "fleet", "pools", "blobs",
        "retention", "log", "auth", "items", "history", "notify"}


@pytest.mark.fleet
def test_meshd_exits_2_naming_every_problem(tmp_path):
    """Rule: meshd refuses to start (exit 2) with a broken file, printing every problem."""
    cfg = member_config(str(tmp_path), "m1", "[pools.default]\nslots = -1\nkind = 3\n"
                                             "[history]\nkeep = -1\n")
    m = Meshd(str(tmp_path / "m1"), config=cfg)
    m.start(wait_ready=False)
    try:
        assert m.proc is not None and m.proc.wait(60) == 2
        tail = m.log_tail()
        assert "has 3 problems" in tail
        for words in ("[pools.default] slots", "[pools.default] kind", "[history] keep"):
            assert words in tail, tail
    finally:
        m.stop()
