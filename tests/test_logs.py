"""Every log line is one format: structlog's own and the standard library's (pysyncobj, asyncio).

meshjobs/logs.py renders both through the same processors and renderer; when stderr is not a
terminal each line is one JSON object with `event`, `level` and `timestamp`.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.helpers import env_with_path

USUAL_KEYS = {"event", "level", "timestamp"}

_PROGRAM = r"""
import logging, structlog
from meshjobs import logs
logs.configure("info")
structlog.get_logger("meshd").info("member started", name="m1")
logging.getLogger("pysyncobj.syncobj").warning("raftCommitIndex (%d) exceeds journal end", 7)
logging.getLogger("pysyncobj.syncobj").info("chatty: below warning, not written")
try:
    1 / 0
except ZeroDivisionError:
    logging.getLogger("asyncio").exception("Task exception was never retrieved")
logging.getLogger().error("a line of the root logger")
"""


def json_lines(text: str) -> list[dict]:
    """Each non-empty line parsed as JSON; the test fails naming a line that is not."""
    out = []
    for line in text.splitlines():
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except ValueError:
            pytest.fail(f"not a JSON log line: {line!r}")
        assert isinstance(obj, dict) and USUAL_KEYS <= set(obj), line
        out.append(obj)
    return out


def test_stdlib_lines_are_json_like_structlog_lines():
    """Rule: with stderr not a terminal, a stdlib logger's line (pysyncobj's, with %-args and an
    exception) is a JSON object with the keys of structlog's own lines, plus its logger name;
    the stdlib's info lines stay below the threshold (warning) as before."""
    r = subprocess.run([sys.executable, "-c", _PROGRAM], capture_output=True, timeout=60,
                       env=env_with_path(), stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stderr.decode()
    lines = json_lines(r.stderr.decode())
    by_event = {line["event"]: line for line in lines}
    assert by_event["member started"]["level"] == "info" and by_event["member started"]["name"] == "m1"
    raft = by_event["raftCommitIndex (7) exceeds journal end"]
    assert raft["level"] == "warning" and raft["logger"] == "pysyncobj.syncobj"
    boom = by_event["Task exception was never retrieved"]
    assert boom["level"] == "error" and "ZeroDivisionError" in boom["exception"]
    assert by_event["a line of the root logger"]["logger"] == "root"
    assert not any("chatty" in line["event"] for line in lines)
    assert len(lines) == 4


@pytest.mark.fleet
def test_a_real_member_writes_only_json_lines(meshd):
    """Rule: a real meshd whose stderr is a file writes nothing but JSON log lines, from start
    to stop (the fleet harness sends its stderr to a file)."""
    job = meshd.submit("--", "true")
    status, body = meshd.request("GET", f"/jobs/{job}?wait=60")
    assert status == 200 and body["state"] == "done", body
    assert meshd.terminate() == 0
    with open(meshd.log_path, encoding="utf-8") as f:
        lines = json_lines(f.read())
    assert lines, "the member logged nothing"
