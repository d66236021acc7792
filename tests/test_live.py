"""Following a job live, against real members: job versions, GET /jobs/{id}?wait=S&since=V,
`meshctl job wait` across a member restart and several --at, and GET /events (server-sent events
of committed changes).

Items here wait for a file the test creates (`$GATE/<item index>`), so that a test decides when
each item ends; nothing waits on a fixed sleep.
"""

from __future__ import annotations

import os
import pty
import subprocess
import sys
import threading
from typing import Any

import pytest

from meshjobs import limits
from tests.helpers import (
    EventStream,
    Meshd,
    env_with_path,
    free_port,
    make_fleet,
    start_all,
    submit_anywhere,
    token_line,
    wait_until,
)

GATED = 'while [ ! -e "$GATE/$MESH_ITEM_INDEX" ]; do sleep 0.02; done'


def gated(gate: str, n: int, **spec: Any) -> dict:
    """A job of `n` items, item i ending when the file `gate`/i exists."""
    os.makedirs(gate, exist_ok=True)
    return {"argv": ["sh", "-c", GATED], "env": {"GATE": gate},
            "items": [str(i) for i in range(n)], **spec}


def open_gate(gate: str, i: int) -> None:
    with open(os.path.join(gate, str(i)), "w"):
        pass


class Later:
    """A request made on another thread, so that the test can act while it waits."""

    def __init__(self, m: Meshd, path: str, timeout_s: float = 120.0) -> None:
        self.result: Any = None
        self.thread = threading.Thread(target=self._run, args=(m, path, timeout_s), daemon=True)
        self.thread.start()

    def _run(self, m: Meshd, path: str, timeout_s: float) -> None:
        self.result = m.request("GET", path, timeout_s=timeout_s)

    def get(self, timeout_s: float = 120.0) -> Any:
        self.thread.join(timeout_s)
        assert not self.thread.is_alive(), "the long-poll did not answer"
        return self.result


@pytest.fixture
def fleet3(tmp_path):
    members = make_fleet(str(tmp_path), voters=3)
    try:
        yield start_all(members)
    finally:
        for m in members:
            m.stop()


# --- versions and wait&since --------------------------------------------------------------------


def test_versions_grow_and_agree_on_every_member(fleet3, tmp_path) -> None:
    """A job's version grows with its changes and is the same number on the leader and the
    followers; a follower answers wait&since at an item's end, before the job ends, and its
    /events stream carries the job through to done with the same versions."""
    gate = str(tmp_path / "gate")
    streams = {m.name: EventStream(m) for m in fleet3}
    _, job_id = submit_anywhere(fleet3, gated(gate, 2))

    def versions() -> list[int]:
        return [m.request("GET", f"/jobs/{job_id}")[1]["version"] for m in fleet3]

    first = wait_until(lambda: (v := versions()) and len(set(v)) == 1
                       and fleet3[0].request("GET", f"/jobs/{job_id}")[1]["items_running"] == 2
                       and v, what="the same version everywhere with both items running")
    follower = next(m for m in fleet3 if not m.request("GET", "/healthz")[1]["is_leader"])
    later = Later(follower, f"/jobs/{job_id}?wait=200&since={first[0]}")
    open_gate(gate, 0)
    status, rec = later.get()
    assert status == 200, rec
    assert rec["version"] > first[0] and rec["items_done"] == 1 and rec["state"] == "running"
    open_gate(gate, 1)

    def done_versions() -> list[int] | None:
        # Each member's version and state from one answer: read apart, a version read before
        # the job's last change could be paired with a state read after it.
        recs = [m.request("GET", f"/jobs/{job_id}")[1] for m in fleet3]
        if all(r["state"] == "done" for r in recs) and len({r["version"] for r in recs}) == 1:
            return [r["version"] for r in recs]
        return None

    done = wait_until(done_versions, what="the job done everywhere, at one version")
    assert done[0] > rec["version"]
    for name, s in streams.items():
        ev, _ = s.until(lambda e: e["data"]["id"] == job_id and e["data"]["state"] == "done")
        assert int(ev["id"]) == ev["data"]["version"] == done[0], name
        s.close()
    # In the list rows too.
    for m in fleet3:
        status, rows = m.request("GET", "/jobs")
        assert [r["version"] for r in rows if r["id"] == job_id] == [done[0]]


def test_wait_since_answers_on_each_item(meshd_factory, tmp_path) -> None:
    """GET /jobs/{id}?wait=S&since=V answers at once when the job's version is past V, else at
    the job's next change (an item ended), long before the job ends; without since the wait
    still lasts until the end."""
    meshd = meshd_factory(slots=3)
    gate = str(tmp_path / "gate")
    status, rec = meshd.request("POST", "/jobs", gated(gate, 3))
    assert status == 201, rec
    job_id, v = rec["id"], rec["version"]
    assert isinstance(v, int) and v > 0
    status, now = meshd.request("GET", f"/jobs/{job_id}?wait=200&since={v - 1}")
    assert status == 200 and now["version"] >= v, "past since: at once"
    v = now["version"]
    if now["items_running"] < 3:  # the leases may come in an entry after the submit
        v = wait_until(lambda: (r := meshd.request("GET", f"/jobs/{job_id}")[1])["items_running"]
                       == 3 and r["version"], what="three items running")
    to_end = Later(meshd, f"/jobs/{job_id}?wait=200")
    for i in range(2):
        later = Later(meshd, f"/jobs/{job_id}?wait=200&since={v}")
        open_gate(gate, i)
        status, rec = later.get()
        assert status == 200, rec
        assert rec["items_done"] == i + 1 and rec["state"] == "running" and rec["version"] > v
        v = rec["version"]
    assert to_end.thread.is_alive(), "a wait without since lasts until the job ends"
    open_gate(gate, 2)
    status, rec = to_end.get()
    assert status == 200 and rec["state"] == "done" and rec["version"] > v
    # A finished job: at once, whatever since says.
    status, rec2 = meshd.request("GET", f"/jobs/{job_id}?wait=200&since={rec['version']}")
    assert status == 200 and rec2 == rec


@pytest.mark.parametrize("since", ["-1", "abc", "1.5", "", "9" * 30, str(limits.version_max + 1),
                                   "0x10", " 3"])
def test_bad_since_400(meshd, since: str) -> None:
    """since must be a whole number from 0 to version_max: anything else is 400, saying so."""
    status, rec = meshd.request("POST", "/jobs", {"argv": ["true"]})
    assert status == 201
    status, body = meshd.request("GET", f"/jobs/{rec['id']}?wait=1&since={since.replace(' ', '%20')}")
    assert status == 400 and "since" in body["error"] and "version" in body["error"], body


# --- meshctl job wait -------------------------------------------------------------------------


def ctl_on_pty(args: list[str], env: dict[str, str]) -> tuple[subprocess.Popen, int, list[bytes]]:
    """meshctl with its stderr on a terminal (progress is shown only there); a thread collects
    what it writes there."""
    master, slave = pty.openpty()
    p = subprocess.Popen([sys.executable, "-m", "meshjobs.cli", *args], stderr=slave,
                         stdout=subprocess.PIPE, env=env)
    os.close(slave)
    shown: list[bytes] = []

    def pump() -> None:
        while True:
            try:
                chunk = os.read(master, 4096)
            except OSError:
                return
            if not chunk:
                return
            shown.append(chunk)

    threading.Thread(target=pump, daemon=True).start()
    return p, master, shown


def test_job_wait_shows_true_progress(meshd_factory, tmp_path) -> None:
    """job wait's progress line moves as items end (running 1/3, 2/3) before the job ends, and
    the wait exits 0 with the job done."""
    meshd = meshd_factory(slots=3)
    gate = str(tmp_path / "gate")
    status, rec = meshd.request("POST", "/jobs", gated(gate, 3))
    assert status == 201
    job_id = rec["id"]
    p, master, shown = ctl_on_pty(["--at", meshd.url, "job", "wait", job_id], env_with_path())
    try:
        for i in range(2):
            want = f"{job_id}: running {i}/3".encode()
            wait_until(lambda want=want: want in b"".join(shown), what=f"progress {i}/3")
            open_gate(gate, i)
        wait_until(lambda: f"{job_id}: running 2/3".encode() in b"".join(shown), what="2/3")
        open_gate(gate, 2)
        out, _ = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
        os.close(master)
    assert p.returncode == 0
    text = b"".join(shown).decode()
    assert f"{job_id}: done 3/3" in text and text.endswith("\n")
    assert "running 2/3 done" in text


def test_job_wait_survives_a_member_restart(tmp_path) -> None:
    """job wait against a member that is killed (-9) and started again while the job runs: the
    wait asks again with backoff and ends 0 with the job done; the first of two --at being
    dead is passed over."""
    port = free_port()
    m = Meshd(str(tmp_path / "m1"), http=f"127.0.0.1:{port}")
    try:
        m.start()
        gate = str(tmp_path / "gate")
        status, rec = m.request("POST", "/jobs", gated(gate, 2))
        assert status == 201
        job_id = rec["id"]
        dead = f"http://127.0.0.1:{free_port()}"
        p, master, shown = ctl_on_pty(
            ["--at", f"{dead},{m.url}", "job", "wait", job_id, "--timeout", "200"],
            env_with_path())
        try:
            wait_until(lambda: f"{job_id}: running 0/2".encode() in b"".join(shown),
                       what="the wait following the job")
            m.kill9()
            wait_until(lambda: b"not answering" in b"".join(shown), what="the wait retrying")
            m.start()
            open_gate(gate, 0)
            open_gate(gate, 1)
            out, _ = p.communicate(timeout=120)
        finally:
            if p.poll() is None:
                p.kill()
            os.close(master)
        text = b"".join(shown).decode()
        assert p.returncode == 0, text
        assert f"{job_id}: done 2/2" in text
        # No error glued to a progress line: every line that says meshctl starts with it.
        assert "meshctl:" not in text
    finally:
        m.stop()


def test_job_wait_gives_up_on_its_own_line(tmp_path) -> None:
    """job wait whose members never answer retries until its --timeout, then exits 4 with the
    error on a line of its own."""
    dead = [f"http://127.0.0.1:{free_port()}" for _ in range(2)]
    p, master, shown = ctl_on_pty(["--at", dead[0], "--at", dead[1], "job", "wait", "j1",
                                   "--timeout", "2"], env_with_path())
    try:
        p.communicate(timeout=60)
    finally:
        os.close(master)
    text = b"".join(shown).decode().replace("\r\n", "\n")
    assert p.returncode == 4, text
    error = [line for line in text.split("\n") if "meshctl:" in line]
    assert error and all(line.startswith("meshctl: cannot reach") for line in error), text


# --- GET /events ------------------------------------------------------------------------------


def test_events_follow_a_job_to_its_end(meshd, tmp_path) -> None:
    """/events sends each committed change of a job as `id: <version>`, `event: job`, `data:`
    its list row (as GET /jobs has it), through to done; filters pass only what they name."""
    s = EventStream(meshd)
    assert s.status == 200 and s.headers["Content-Type"].startswith("text/event-stream")
    assert s.next() == {"comment": "keepalive"}
    by_tag = EventStream(meshd, "tag=t2,other&state=done")
    by_job = EventStream(meshd, "job=nosuch&job=alsonot")
    gate = str(tmp_path / "gate")
    status, rec = meshd.request("POST", "/jobs", gated(gate, 2, tags=["t1"]))
    job_id = rec["id"]
    first, _ = s.until(lambda e: e["data"]["id"] == job_id)
    assert first["event"] == "job" and int(first["id"]) == first["data"]["version"]
    open_gate(gate, 0)
    open_gate(gate, 1)
    done, seen = s.until(lambda e: e["data"]["state"] == "done")
    assert [int(e["id"]) for e in seen if "id" in e] == sorted(
        int(e["id"]) for e in seen if "id" in e)
    assert int(done["id"]) > int(first["id"])
    status, rows = meshd.request("GET", "/jobs")
    assert done["data"] == next(r for r in rows if r["id"] == job_id)
    assert {"id", "state", "version", "items_done", "items_failed", "items_total"} <= set(done["data"])
    # The filtered streams saw nothing of it: the first thing they see is a job they name.
    status, other = meshd.request("POST", "/jobs", {"argv": ["true"], "tags": ["t2"]})
    ev, _ = by_tag.until(lambda e: True)
    assert ev["data"]["id"] == other["id"] and ev["data"]["state"] == "done"
    status, named = meshd.request("POST", "/jobs", {"id": "nosuch", "argv": ["true"]})
    ev, _ = by_job.until(lambda e: True)
    assert ev["data"]["id"] == "nosuch"
    # Forgotten: an event of its own.
    meshd.wait_job("nosuch")
    status, _ = meshd.request("DELETE", "/jobs/nosuch")
    assert status == 200
    ev, _ = by_job.until(lambda e: e["event"] == "forget")
    assert ev["data"] == {"id": "nosuch", "version": int(ev["id"])}
    for st in (s, by_tag, by_job):
        st.close()


def test_events_resume_from_last_event_id(meshd, tmp_path) -> None:
    """A client that comes back with Last-Event-ID (or ?since=) gets every change after it,
    and nothing it had."""
    s = EventStream(meshd)
    gate = str(tmp_path / "gate")
    status, rec = meshd.request("POST", "/jobs", gated(gate, 1))
    job_id = rec["id"]
    first, _ = s.until(lambda e: e["data"]["id"] == job_id)
    s.close()
    open_gate(gate, 0)
    meshd.wait_job(job_id)
    for how in ({"headers": {"Last-Event-ID": first["id"]}}, {"query": f"since={first['id']}"},
                {"query": "since=1", "headers": {"Last-Event-ID": first["id"]}}):
        again = EventStream(meshd, **how)
        ev, _ = again.until(lambda e: e["data"]["state"] == "done")
        assert int(ev["id"]) > int(first["id"])
        again.close()


def test_events_reset_when_the_member_no_longer_has_since(meshd) -> None:
    """A since older than what the member keeps (here: its table came back from a dump after a
    restart) is answered `event: reset` with the current version; the stream goes on."""
    n = limits.log_compaction_bytes_min // 30
    status, rec = meshd.request("POST", "/jobs", {"argv": ["true"], "hold": True,
                                                  "items": [str(k) for k in range(n)]})
    assert status == 201
    for _ in range(2):
        assert meshd.request("POST", "/jobs", {"argv": ["true"], "hold": True})[0] == 201
    wait_until(lambda: os.path.exists(os.path.join(meshd.data, "raft.dump")), 60, "a dump")
    assert meshd.terminate() == 0
    meshd.start()
    s = EventStream(meshd, "since=1")
    ev, _ = s.until(lambda e: True)
    assert ev["event"] == "reset" and ev["data"]["version"] == int(ev["id"]) > 1
    status, new = meshd.request("POST", "/jobs", {"argv": ["true"]})
    ev, _ = s.until(lambda e: e["data"]["id"] == new["id"])
    assert int(ev["id"]) > ev["data"]["version"] - 1
    s.close()


@pytest.mark.parametrize("query,headers", [
    ("state=sleeping", {}), ("job=bad%20id", {}), ("pool=a/b", {}), ("since=-3", {}),
    ("since=x", {}), ("", {"Last-Event-ID": "yesterday"}), ("tag=" + "x" * 300, {}),
    ("&".join(f"tag=t{i}" for i in range(limits.events_filter_values_max + 1)), {}),
])
def test_events_bad_requests_400(meshd, query: str, headers: dict) -> None:
    """Malformed filters or starting versions are 400 with the API's JSON error, before any
    stream starts."""
    s = EventStream(meshd, query, headers)
    assert s.status == 400 and b'"error"' in s.body, s.body
    s.close()


def test_events_streams_bounded_and_ended_by_disconnect(meshd) -> None:
    """At most events_streams_max streams at once (503 beyond, saying so); a client that goes
    away frees its place; the member stops promptly with streams open."""
    streams = [EventStream(meshd) for _ in range(limits.events_streams_max)]
    assert all(s.status == 200 for s in streams)
    extra = EventStream(meshd)
    assert extra.status == 503 and b"event streams" in extra.body
    extra.close()
    for s in streams[:2]:
        s.close()

    def room() -> bool:
        s = EventStream(meshd)
        ok = s.status == 200
        s.close()
        return ok
    # A stream's place is free once its last long-poll ends (within events_keepalive_s).
    wait_until(room, limits.events_keepalive_s + 30, "a place freed by a client gone")
    assert meshd.terminate(timeout_s=20) == 0
    for s in streams[2:]:
        s.close()


def test_events_need_a_token_when_auth_is_on(tmp_path) -> None:
    """/events is a read: 401 without a token when [auth] is on, a stream with a read token."""
    cfg = tmp_path / "a.toml"
    cfg.write_text('name = "a"\n[pools.default]\nslots = 1\n[auth]\ntokens = [ '
                   + token_line("r", "read", "rtok") + " ]\n")
    m = Meshd(str(tmp_path / "a"), name="a", config=str(cfg), token="rtok")
    try:
        m.start()
        m.token = None
        s = EventStream(m)
        assert s.status == 401
        s.close()
        m.token = "rtok"
        s = EventStream(m)
        assert s.status == 200 and s.next() == {"comment": "keepalive"}
        s.close()
    finally:
        m.stop()
