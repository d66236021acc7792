"""meshjobs.limits: how the limits relate is checked when the module is imported, and each
relation is really checked (grown past it in a copy of the values, it is refused)."""

from __future__ import annotations

from pathlib import Path

import pytest

from meshjobs import limits


def values() -> dict[str, object]:
    return {k: v for k, v in vars(limits).items() if not k.startswith("_")}


def test_the_limits_as_they_are_hold_every_relation():
    assert limits.broken(values()) == []


@pytest.mark.parametrize("says,grown", [(says, grown) for says, grown, _ in limits.RELATIONS])
def test_each_relation_is_checked(says: str, grown: str):
    """Grown far, the limit named with a relation breaks it, and `broken` says so."""
    changed = values()
    assert isinstance(changed[grown], int | float), grown
    changed[grown] = changed[grown] * 10**6 + 10**6
    assert says in limits.broken(changed)


def test_relations_name_real_limits():
    for says, grown, _ in limits.RELATIONS:
        assert grown in values(), says
    assert len({says for says, _, _ in limits.RELATIONS}) == len(limits.RELATIONS)


def test_contradicting_limits_stop_the_import():
    """A limit changed so that it contradicts another fails the import of limits.py itself
    (not an `assert`: it holds under python -O too)."""
    source = Path(limits.__file__).read_text()
    assert "\nraft_ping_s = 1.0 " in source
    bad = source.replace("\nraft_ping_s = 1.0 ", "\nraft_ping_s = 9.0 ")
    with pytest.raises(AssertionError, match="an idle Raft connection pings"):
        exec(compile(bad, "limits_changed.py", "exec"), {"__name__": "limits_changed"})


def test_moved_limits_are_used_where_they_were_hard_coded():
    """The sizes and times that were written into control.py, jobsd.py and http.py are the
    named limits now."""
    from meshjobs import frames, http

    assert limits.frame_part_bytes == limits.frame_bytes_max - 64 * 1024
    assert frames.Chunker().part_bytes == limits.frame_part_bytes
    assert http.CTL_SLACK_MS == limits.http_ctl_slack_ms == 2_000
    root = Path(limits.__file__).parent
    assert "64 * 1024" not in (root / "jobsd.py").read_text()
    assert "len(k) > 256" not in (root / "control.py").read_text()
    http_src = (root / "http.py").read_text()
    daemon_src = (root / "daemon.py").read_text()
    for literal in ("time.sleep(0.5)", "wait(10)", "join(10)", "(0.05, 0.1)", "(0.4, 0.8)"):
        assert literal not in daemon_src, literal
    for literal in ("shutdown_timeout=1.0", "max_num_fields=8", "> 1 << 20", "getfqdn), 2.0)",
                    "len(value) <= 32"):
        assert literal not in http_src, literal


def test_edge_constants_are_the_named_limits():
    """The edge modules' own constants are the limits of limits.py, not numbers of their own."""
    from meshjobs import cli, itemlogs, journal, links, pypool, raftlink

    assert links._TICK_S == limits.link_tick_s
    assert links._READS_PER_TURN == limits.link_reads_per_turn_max
    assert raftlink._READ_BYTES == limits.raft_read_bytes
    assert raftlink._READS_PER_EVENT == limits.raft_reads_per_event_max
    assert itemlogs._IDLE_S == limits.item_logs_idle_s
    assert pypool._READ_BYTES == limits.py_read_bytes
    assert journal._JOIN_BYTES_MAX == limits.journal_join_bytes_max
    assert cli.WAIT_POLL_S == limits.cli_wait_poll_s
    assert cli.COPY_CHUNK_BYTES == limits.cli_copy_chunk_bytes
    assert cli.TIMEOUT_S == limits.ctl_commit_ms_max / 1000 + limits.cli_timeout_slack_s
    root = Path(limits.__file__).parent
    links_src = (root / "links.py").read_text()
    for literal in ("timeout_s: float = 5.0", "65536", "settimeout(1.0)"):
        assert literal not in links_src, literal
    assert "64 * 1024" not in (root / "cli.py").read_text()
