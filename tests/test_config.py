"""meshd's configuration: the shipped examples load, and bad files get clear errors."""

from __future__ import annotations

import glob
import os

import pytest

from meshjobs.config import ConfigError, load_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(ROOT, "deploy", "**", "*.toml"),
                                                   recursive=True)))
def test_shipped_examples_load(path):
    """Every example config in deploy/ is valid."""
    cfg = load_config(path)
    assert cfg.name and cfg.pools


def test_defaults_are_a_fleet_of_one():
    """No file: a fleet of one on 127.0.0.1:7700 with a default command pool."""
    cfg = load_config(None)
    assert cfg.fleet_of_one and cfg.role == "voter"
    assert cfg.http == ("127.0.0.1", 7700) and cfg.pools["default"].kind == "command"


def test_roles_from_the_fleet_table(tmp_path):
    """A member named among the voters is a voter and takes its addresses from its entry; one
    that joins is a worker."""
    voters = ('voters = [ { name = "a", raft = "127.0.0.1:1", peer = "127.0.0.1:2", http = "127.0.0.1:3" },'
              ' { name = "b", raft = "127.0.0.1:4", peer = "127.0.0.1:5" },'
              ' { name = "c", raft = "127.0.0.1:6", peer = "127.0.0.1:7" } ]')
    f = tmp_path / "a.toml"
    f.write_text(f'name = "a"\n[fleet]\n{voters}\n')
    cfg = load_config(str(f))
    assert cfg.role == "voter" and cfg.raft == ("127.0.0.1", 1) and cfg.http == ("127.0.0.1", 3)
    w = tmp_path / "w.toml"
    w.write_text('name = "w"\n[fleet]\njoin = "127.0.0.1:2"\n')
    assert load_config(str(w)).role == "worker"


@pytest.mark.parametrize("text,word", [
    ("", "name"),
    ('name = "a"\nbogus = 1\n', "unknown"),
    ('name = "a"\nhttp = "nope"\n', "host:port"),
    ('name = "a"\n[pools.x]\nkind = "ruby"\n', "kind"),
    ('name = "a"\n[pools.x]\nslots = -1\n', "slots"),
    ('name = "a"\n[fleet]\nvoters = [ { name = "a", raft = "127.0.0.1:1", peer = "127.0.0.1:2" },'
     ' { name = "b", raft = "127.0.0.1:3", peer = "127.0.0.1:4" } ]\n', "3 or 5"),
    ('name = "a"\n[blobs]\nmem_max = "lots"\n', "mem_max"),
    ('name = "a"\n[retention]\nkeep_s = -1\n', "keep_s"),
    ('name = "a"\n[fleet]\ndead_ms = 1\n', "dead_ms"),
    ('name = "a"\n[fleet]\ndead_ms = 5000\nlost_ms = 1000\n', "lost_ms"),
    ("name = \n", "TOML"),
    ('name = "a"\nitems = 1\n', "[items] must be a table"),
    ('name = "a"\n[items]\nenv = ["PATH"]\n', "unknown key"),
    ('name = "a"\n[items]\nenv_pass = "PATH"\n', "env_pass must be a list of variable names"),
    ('name = "a"\n[items]\nenv_pass = [1, 2]\n', "env_pass must be a list of variable names"),
    ('name = "a"\n[items]\nenv_pass = ["*"]\n', "whole environment"),
    ('name = "a"\n[items]\nenv_pass = ["PATH", "1ABC"]\n', "not a variable name"),
    ('name = "a"\n[items]\nenv_pass = ["A-B"]\n', "not a variable name"),
    ('name = "a"\n[items]\nenv_pass = ["PATH=x"]\n', "not a variable name"),
    ('name = "a"\n[items]\nenv_pass = ["LC_**"]\n', "not a variable name"),
    ('name = "a"\n[items]\nenv_pass = ["*PATH"]\n', "not a variable name"),
    ('name = "a"\n[items]\nenv_pass = [""]\n', "not a variable name"),
    ('name = "a"\n[items]\nenv_pass = ["' + "A" * 300 + '"]\n', "not a variable name"),
    ('name = "a"\n[items]\nenv_pass = [' + ", ".join(f'"V{i}"' for i in range(300)) + "]\n",
     "env_pass_names_max"),
])
def test_bad_config_says_what_is_wrong(tmp_path, text, word):
    """Each broken file is refused with a message naming what to fix."""
    f = tmp_path / "bad.toml"
    f.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_config(str(f))
    assert word.lower() in str(e.value).lower()


@pytest.mark.parametrize("text,word", [
    ('name = "a"\nhttp = "0.0.0.0:7700"\n', "[auth]"),
    ('name = "a"\nhttp = "10.1.2.3:7700"\n', "allow_anonymous"),
    ('name = "a"\n[http]\naddr = "0.0.0.0:1"\n', "beyond loopback"),
    ('name = "a"\n[auth]\ntokens = []\n', "no tokens"),
    ('name = "a"\n[auth]\ntokens = [ { name = "x", role = "root", sha256 = "' + "0" * 64 + '" } ]\n', "role"),
    ('name = "a"\n[auth]\ntokens = [ { name = "x", role = "read", sha256 = "abc" } ]\n', "sha256"),
    ('name = "a"\n[auth]\ntokens = [ { name = "x", role = "read", sha256 = "' + "z" * 64 + '" } ]\n', "sha256"),
    ('name = "a"\n[auth]\ntokens = [ { name = "x", role = "read", sha256 = "' + "0" * 64 + '" },'
     ' { name = "x", role = "admin", sha256 = "' + "1" * 64 + '" } ]\n', "own name"),
    ('name = "a"\n[auth]\ntokens = "secret"\n', "tokens"),
    ('name = "a"\n[auth]\nallow_anonymous = "yes"\n', "allow_anonymous"),
    ('name = "a"\n[auth]\nallow_anonymous = true\nmetrics = "closed"\n', "metrics"),
    ('name = "a"\n[auth]\nallow_anonymous = true\nbogus = 1\n', "unknown"),
    ('name = "a"\n[http]\naddr = "127.0.0.1:1"\ntls_cert = "nope.pem"\ntls_key = "nope.pem"\n', "no file"),
    ('name = "a"\n[http]\naddr = "127.0.0.1:1"\nconns_max = 0\n', "conns_max"),
    ('name = "a"\n[http]\naddr = "127.0.0.1:1"\nnames = "x"\n', "names"),
    ('name = "a"\n[http]\naddr = "127.0.0.1:1"\nlisten = "127.0.0.1:2"\n', "once"),
    ('name = "a"\n[http]\nport = 1\n', "unknown"),
])
def test_bad_trust_config_says_what_is_wrong(tmp_path, text, word):
    """Auth and HTTP tables that cannot be right are refused with a message naming the fix; HTTP
    beyond loopback without tokens refuses to start."""
    f = tmp_path / "bad.toml"
    f.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_config(str(f))
    assert word.lower() in str(e.value).lower()


def test_http_table_and_auth(tmp_path):
    """[http] carries the address and TLS files (relative to the file); [auth] keeps only hashes;
    allow_anonymous lets a member listen beyond loopback without tokens; --http overrides only
    the address."""
    (tmp_path / "c.pem").write_text("x")
    (tmp_path / "k.pem").write_text("x")
    f = tmp_path / "a.toml"
    f.write_text('name = "a"\n[http]\naddr = "0.0.0.0:7700"\ntls_cert = "c.pem"\ntls_key = "k.pem"\n'
                 'names = ["Meshd.Example.org"]\n[auth]\nmetrics = "read"\n'
                 'tokens = [ { name = "ci", role = "submit", sha256 = "' + "ab" * 32 + '" } ]\n')
    cfg = load_config(str(f))
    assert cfg.http == ("0.0.0.0", 7700)
    assert cfg.http_tls_cert == str(tmp_path / "c.pem") and cfg.http_tls_key == str(tmp_path / "k.pem")
    assert cfg.http_names == ("meshd.example.org",)
    assert cfg.auth.configured and not cfg.auth.allow_anonymous and cfg.auth.metrics == "read"
    assert cfg.auth.tokens[0].role == "submit" and cfg.auth.tokens[0].sha256 == bytes.fromhex("ab" * 32)
    cfg = load_config(str(f), {"http": "127.0.0.1:0"})
    assert cfg.http == ("127.0.0.1", 0) and cfg.http_tls_cert is not None
    g = tmp_path / "b.toml"
    g.write_text('name = "b"\nhttp = "0.0.0.0:7700"\n[auth]\nallow_anonymous = true\n')
    assert load_config(str(g)).auth.allow_anonymous
    assert not load_config(None).auth.configured  # loopback, no [auth]: open as before
def test_items_env_pass(tmp_path):
    """`[items] env_pass` replaces the default list of meshd's variables items see; absent, it
    is the default list (meshjobs.itemenv.DEFAULT_PASS)."""
    from meshjobs.itemenv import DEFAULT_PASS
    f = tmp_path / "a.toml"
    f.write_text('name = "a"\n[items]\nenv_pass = ["PATH", "LC_*", "MY_TOOL_HOME"]\n')
    assert load_config(str(f)).item_env_pass == ("PATH", "LC_*", "MY_TOOL_HOME")
    f.write_text('name = "a"\n[items]\nenv_pass = []\n')
    assert load_config(str(f)).item_env_pass == ()
    assert load_config(None).item_env_pass == DEFAULT_PASS


@pytest.mark.parametrize("value", ['"1G"', "-1", "1.5", "true", '"5%"', "[1]"])
def test_disk_free_min_must_be_bytes(tmp_path, value):
    """[blobs] disk_free_min is a whole number of bytes; anything else is refused, naming it."""
    f = tmp_path / "bad.toml"
    f.write_text(f'name = "a"\n[blobs]\ndisk_free_min = {value}\n')
    with pytest.raises(ConfigError) as e:
        load_config(str(f))
    assert "disk_free_min" in str(e.value)


def test_disk_free_min_default_and_set(tmp_path):
    """Unset, disk_free_min is None (meshd takes 1 GiB, or 5 % of a smaller disk); set, it is
    the bytes given (0 turns the check off)."""
    assert load_config(None).disk_free_min_bytes is None
    f = tmp_path / "a.toml"
    f.write_text('name = "a"\n[blobs]\ndisk_free_min = 0\n')
    assert load_config(str(f)).disk_free_min_bytes == 0
    f.write_text('name = "a"\n[blobs]\ndisk_free_min = 2147483648\n')
    assert load_config(str(f)).disk_free_min_bytes == 2 << 30


def _quota_config(tmp_path, auth: str, token_keys: str) -> str:
    f = tmp_path / "q.toml"
    f.write_text('name = "a"\n[auth]\n' + auth + 'tokens = [ { name = "ci", role = "submit", '
                 'sha256 = "' + "ab" * 32 + '"' + token_keys + ' }, { name = "root", role = '
                 '"admin", sha256 = "' + "cd" * 32 + '" } ]\n')
    return str(f)


def test_quotas_from_the_token_and_auth_defaults(tmp_path):
    """A token's own quota keys win; [auth]'s fill the rest for non-admin tokens; an admin token
    is unlimited unless it sets its own; no [auth] at all: unlimited."""
    cfg = load_config(_quota_config(tmp_path, "pending_items_max = 10\nschedules_max = 3\n",
                                    ", running_items_max = 1, schedules_max = 0"))
    ci, admin = cfg.auth.tokens
    assert (ci.quota.pending_items_max, ci.quota.running_items_max, ci.quota.schedules_max) == (
        10, 1, 0)
    assert ci.quota.as_request() == {"pending_items_max": 10, "running_items_max": 1,
                                     "schedules_max": 0}
    assert admin.quota.as_request() == {}
    assert cfg.auth.quota.as_request() == {"pending_items_max": 10, "schedules_max": 3}
    assert load_config(None).auth.quota.as_request() == {}


@pytest.mark.parametrize("where", ["auth", "token"])
@pytest.mark.parametrize("key,value,hint", [
    ("pending_items_max", "-1", "0..1000000000"),
    ("pending_items_max", "true", "0..1000000000"),
    ("running_items_max", '"5"', "0..1000000000"),
    ("running_items_max", "10000000000000000000000", "0..1000000000"),
    ("running_items_max", "1.5", "0..1000000000"),
    ("schedules_max", "1001", "0..1000"),
    ("schedules_max", "[1]", "0..1000"),
])
def test_hostile_quota_values_name_the_key(tmp_path, where, key, value, hint):
    path = (_quota_config(tmp_path, f"{key} = {value}\n", "") if where == "auth"
            else _quota_config(tmp_path, "", f", {key} = {value}"))
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert key in str(e.value) and hint in str(e.value)
    if where == "token":
        assert "tokens[0]" in str(e.value)
