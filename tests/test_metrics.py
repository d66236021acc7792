"""/metrics by the book: typed and described families, labels, histograms, process metrics."""

from __future__ import annotations

import os

import pytest
from prometheus_client.parser import text_string_to_metric_families

from meshjobs.metrics import RULES, MemberMetrics, http_families, member_families, rule_for
from tests.helpers import Meshd, member_config, wait_until

HISTOGRAMS = ("meshjobs_submit_commit_seconds", "meshjobs_lease_start_seconds",
              "meshjobs_item_run_seconds", "meshjobs_journal_fsync_seconds")


def families(text: str) -> dict:
    """Family name -> parsed family; a name parsed twice fails (one family, one type)."""
    out: dict = {}
    for fam in text_string_to_metric_families(text):
        assert fam.name not in out, f"family {fam.name} appears twice"
        out[fam.name] = fam
    return out


def check_by_the_book(text: str) -> dict:
    """Every family has HELP and a known type; counters' samples end in _total; no sample
    name belongs to two families."""
    fams = families(text)
    owner: dict[str, str] = {}
    for fam in fams.values():
        assert fam.documentation, f"{fam.name} has no HELP"
        assert fam.type in ("counter", "gauge", "histogram"), (fam.name, fam.type)
        for s in fam.samples:
            assert owner.setdefault(s.name, fam.name) == fam.name, f"{s.name} in two families"
            if fam.type == "counter":
                assert s.name.endswith("_total"), s.name
            else:
                assert not s.name.endswith("_total"), f"{fam.type} {s.name} ends in _total"
    assert "# HELP" in text and "# TYPE" in text
    return fams


def value(fams: dict, family: str, sample: str | None = None, **labels: str) -> float:
    for s in fams[family].samples:
        if s.name == (sample or family) and all(s.labels.get(k) == v for k, v in labels.items()):
            return s.value
    raise KeyError((family, sample, labels))


def test_rule_table_is_consistent() -> None:
    """Each rule's key is unique, its HELP is text, and counters' families carry no _total
    (the client adds it)."""
    keys = [r.key for r in RULES]
    assert len(keys) == len(set(keys))
    for r in RULES:
        assert r.help.strip() and r.kind in ("counter", "gauge"), r
        assert not r.family.endswith("_total") or r.kind == "gauge", r
        assert r.family.startswith("meshjobs_"), r


def test_keys_map_to_families() -> None:
    """Exact keys beat prefixes; the longest prefix wins; a prefix alone is no key."""
    assert rule_for("node_ctl_rid_reused")[0].family == "meshjobs_node_ctl_rid_reused"
    assert rule_for("node_ctl_submit") == (rule_for("node_ctl_get")[0], "submit")
    assert rule_for("raft_dropped_garbage")[1] == "garbage"
    assert rule_for("raft_term")[0].kind == "gauge"
    assert rule_for("node_frames_in_F_CTL")[0].family == "meshjobs_frames_in"
    assert rule_for("links_dropped_") is None or rule_for("links_dropped_")[0].key != "links_dropped_"


def test_member_families_from_numbers() -> None:
    """Counters get _total, prefixes become labels, jobs get state and pool labels, unknown
    numbers still show (as described gauges), and what is not a number is left out."""
    numbers = {"node_frames_in_F_CTL": 3, "node_ctl_get": 2, "table_leases_granted": 5,
               "is_leader": True, "links_dropped_mac": 1, "raft_pre_votes_won": 0,
               "mystery": 7.5, "note": "not a number", "jobs": 3,
               "jobs_by_state_pool": {"running": {"gpu": 2}, "held": {"de\"fault\n": 1},
                                      "bad": "not a dict"}}
    mm = MemberMetrics()
    text = mm.render(member_families(numbers), http_families({
        "meshjobs_http_requests": {"2xx": 4}, "meshjobs_http_bad_requests": 1})).decode()
    fams = check_by_the_book(text)
    assert value(fams, "meshjobs_frames_in", "meshjobs_frames_in_total", type="F_CTL") == 3
    assert value(fams, "meshjobs_ctl_requests", "meshjobs_ctl_requests_total", op="get") == 2
    assert value(fams, "meshjobs_table_leases_granted", "meshjobs_table_leases_granted_total") == 5
    assert value(fams, "meshjobs_links_dropped", "meshjobs_links_dropped_total", reason="mac") == 1
    assert value(fams, "meshjobs_raft_pre_votes_won", "meshjobs_raft_pre_votes_won_total") == 0
    assert value(fams, "meshjobs_is_leader") == 1
    assert value(fams, "meshjobs_mystery") == 7.5 and "not yet described" in fams["meshjobs_mystery"].documentation
    assert value(fams, "meshjobs_jobs", state="running", pool="gpu") == 2
    assert value(fams, "meshjobs_jobs", state="held", pool="de\"fault\n") == 1
    assert value(fams, "meshjobs_http_requests", "meshjobs_http_requests_total", **{"class": "2xx"}) == 4
    assert "note" not in text and 'state="bad"' not in text
    assert "process_cpu_seconds" in fams
    for h in HISTOGRAMS:
        assert fams[h].type == "histogram" and value(fams, h, h + "_count") == 0


def test_registries_are_per_member() -> None:
    """Two members in one process keep their own histograms (no global registry)."""
    a, b = MemberMetrics(), MemberMetrics()
    a.item_run_s.observe(1.0)
    fa, fb = families(a.render().decode()), families(b.render().decode())
    assert value(fa, "meshjobs_item_run_seconds", "meshjobs_item_run_seconds_count") == 1
    assert value(fb, "meshjobs_item_run_seconds", "meshjobs_item_run_seconds_count") == 0


def test_node_counts_jobs_by_state_and_pool() -> None:
    """The node's metrics answer breaks its jobs down by state, then pool (meshjobs_jobs)."""
    from tests.helpers import Fleet1, submitted

    f = Fleet1()
    assert f.node.metrics()["jobs_by_state_pool"] == {}
    submitted(f, token=1, rid="r1", job_id="j1")
    submitted(f, token=2, rid="r2", job_id="j2", hold=True)
    assert f.node.metrics()["jobs_by_state_pool"] == {"queued": {"default": 1},
                                                      "held": {"default": 1}}


# --- a real member ---------------------------------------------------------------------------


@pytest.fixture
def two_pools(tmp_path):
    cfg = member_config(str(tmp_path), "m1", "[pools.default]\nslots = 2\n[pools.batch]\nslots = 1\n")
    m = Meshd(os.path.join(str(tmp_path), "m1"), config=cfg)
    try:
        yield m.start()
    finally:
        m.stop()


def scrape(m: Meshd, path: str = "/metrics") -> dict:
    status, text = m.request("GET", path)
    assert status == 200, (status, text)
    return check_by_the_book(text.decode())


@pytest.mark.fleet
def test_real_member_metrics_by_the_book(two_pools: Meshd) -> None:
    """A real meshd's /metrics parses with prometheus_client; every family has HELP and a
    type; after jobs ran in two pools, jobs by state and pool are right and the histograms of
    submit->commit, lease->start, item run time and journal fsync have moved."""
    m = two_pools
    before = scrape(m)
    for h in HISTOGRAMS:
        assert [s for s in before[h].samples if s.name == h + "_bucket"], h
    done = []
    for pool, n in (("default", 2), ("batch", 1)):
        for _ in range(n):
            status, rec = m.request("POST", "/jobs", {"argv": ["true"], "pool": pool,
                                                      "items": ["a", "b"]})
            assert status in (200, 201), rec
            done.append(rec["id"])
    status, held = m.request("POST", "/jobs", {"argv": ["true"], "pool": "batch", "hold": True})
    assert status in (200, 201), held
    for job in done:
        assert m.wait_job(job)["state"] == "done"

    def ran() -> dict | None:
        # The items' ends reach the jobs thread before the table says done; wait on the count.
        fams = scrape(m)
        runs = value(fams, "meshjobs_item_run_seconds", "meshjobs_item_run_seconds_count")
        return fams if runs >= 6 else None

    fams = wait_until(ran, what="6 item run times observed")
    assert value(fams, "meshjobs_jobs", state="done", pool="default") == 2
    assert value(fams, "meshjobs_jobs", state="done", pool="batch") == 1
    assert value(fams, "meshjobs_jobs", state="held", pool="batch") == 1
    assert not [s for s in fams["meshjobs_jobs"].samples if s.labels["state"] == "running"]
    assert value(fams, "meshjobs_submit_commit_seconds", "meshjobs_submit_commit_seconds_count") >= 4
    assert value(fams, "meshjobs_lease_start_seconds", "meshjobs_lease_start_seconds_count") >= 6
    assert value(fams, "meshjobs_journal_fsync_seconds", "meshjobs_journal_fsync_seconds_count") > \
        value(before, "meshjobs_journal_fsync_seconds", "meshjobs_journal_fsync_seconds_count")
    for h in HISTOGRAMS:
        inf = value(fams, h, h + "_bucket", le="+Inf")
        assert inf == value(fams, h, h + "_count") and value(fams, h, h + "_sum") >= 0
    assert value(fams, "meshjobs_table_jobs_submitted", "meshjobs_table_jobs_submitted_total") == 4
    assert value(fams, "meshjobs_ctl_requests", "meshjobs_ctl_requests_total", op="submit") >= 4
    assert value(fams, "process_resident_memory_bytes") > 0
    assert value(fams, "meshjobs_http_requests", "meshjobs_http_requests_total",
                 **{"class": "2xx"}) >= 4
    # Every number of a real member has a rule of its own (none falls back to an untyped gauge).
    undescribed = [f.name for f in fams.values() if "not yet described in" in f.documentation]
    assert undescribed == [], undescribed
    # The old flat names a dashboard may know are gone in favour of labels.
    assert "meshjobs_node_frames_in_F_CTL" not in fams


@pytest.mark.fleet
@pytest.mark.parametrize("query", [
    "?name[]=meshjobs_jobs", "?format=openmetrics", "?%00%ff=%0a%0d", "?" + "a=" + "x" * 4000,
    "?collect[]=process&collect[]=../../etc/passwd", "?le=+Inf&{}=1",
])
def test_hostile_queries_on_metrics_are_harmless(meshd: Meshd, query: str) -> None:
    """/metrics ignores its query string: any query gets the same well-formed text."""
    fams = scrape(meshd, "/metrics" + query)
    assert "meshjobs_jobs" in fams and "meshjobs_journal_fsync_seconds" in fams
    assert scrape(meshd)  # and the member still answers
