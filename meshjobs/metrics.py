"""/metrics by the book: a member's numbers as typed, described Prometheus families.

Theory of operation. The node, the table and the edges keep plain counts in dicts (the node is
pure and must stay so); the control op "metrics" hands them over as one flat dict of numbers,
plus `jobs_by_state_pool`, a nested dict. This module maps that dict to Prometheus families with
one table, `RULES`: each key (or key prefix) says its family, its type, its HELP text and, for a
prefix, the label its rest becomes (`node_frames_in_F_CTL` -> `meshjobs_frames_in_total{type=
"F_CTL"}`). A key no rule knows still shows, as an undescribed gauge, so nothing counted is lost.

Latencies are measured at the edges where clocks are allowed (the jobs thread, the HTTP thread)
with prometheus_client histograms in a registry of the member's own (`MemberMetrics`), never the
global one: several members may live in one process (tests). A scrape renders the registry
(histograms, process metrics) and the families of that moment's numbers, built fresh each time.

Rules:
- Counters count up from the member's start and end in `_total`; gauges go up and down.
- Every family has HELP text; a family has one type.
- Label values come from our own code (frame types, reasons, ops) or from jobs (pools); the
  client library escapes them.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import prometheus_client
from prometheus_client import CollectorRegistry, Histogram, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

# Timestamps of creation (`*_created` samples) are noise for our counters and histograms.
prometheus_client.disable_created_metrics()

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
COUNTER = "counter"
GAUGE = "gauge"
_NAME_BAD = re.compile(r"[^a-zA-Z0-9_]")


@dataclass(frozen=True)
class Rule:
    """How one key, or every key starting with `key` when `label` is set, is shown."""

    key: str
    kind: str  # COUNTER or GAUGE
    family: str  # without `_total` (counters get it when rendered)
    help: str
    # For a prefix rule: the label the rest of the key becomes, or "" for a family per key
    # (named family_<rest>, its HELP the text with {rest} filled in).
    label: str | None = None


def _c(key: str, family: str, help: str, label: str | None = None) -> Rule:
    return Rule(key, COUNTER, family, help, label)


def _g(key: str, family: str, help: str, label: str | None = None) -> Rule:
    return Rule(key, GAUGE, family, help, label)


# The one table. Exact keys first; then prefix rules (label set), the longest prefix wins.
RULES: tuple[Rule, ...] = (
    # --- the job node (meshjobs/node), counts since the member started ---
    _c("node_frames_in_", "meshjobs_frames_in", "Frames from other members handed to the job node, by frame type.", "type"),
    _c("node_frames_bad_", "meshjobs_frames_bad", "Frames from other members the job node dropped as garbage, by kind.", "kind"),
    _c("node_frames_unhandled", "meshjobs_node_frames_unhandled", "Frames of a type the job node does not handle in its role, dropped."),
    _c("node_ctl_bad", "meshjobs_node_ctl_bad", "Control requests refused as malformed."),
    _c("node_ctl_rid_reused", "meshjobs_node_ctl_rid_reused", "Changes whose request id was used before with another body, refused."),
    _c("node_ctl_refused_disk_full", "meshjobs_node_ctl_refused_disk_full", "Changes refused because the member's disk is full."),
    _c("node_ctl_no_leader", "meshjobs_node_ctl_no_leader", "Changes refused because no leader was known."),
    _c("node_ctl_timeouts", "meshjobs_node_ctl_timeouts", "Changes not committed in time (answered 503)."),
    _c("node_ctl_forwarded", "meshjobs_node_ctl_forwarded", "Changes a follower or worker forwarded to the leader."),
    _c("node_ctl_not_known_yet", "meshjobs_node_ctl_not_known_yet", "Changes a new leader answered 503 because it had not heard from every member yet (unknown pool or member, fan-out)."),
    _c("node_ctl_not_known_yet_retried", "meshjobs_node_ctl_not_known_yet_retried", "Forwarded changes asked of the leader again because it had not heard from every member yet."),
    _c("node_item_records_built", "meshjobs_node_item_records_built", "Item records the jobs thread built to answer reads (the HTTP edge builds those of GET /jobs/ID?items itself)."),
    _c("node_ctl_", "meshjobs_ctl_requests", "Well-formed control requests taken by the job node, by op.", "op"),
    _c("node_pressure_on", "meshjobs_node_pressure_on", "Times blob write pressure began (leases are held back)."),
    _c("node_pressure_off", "meshjobs_node_pressure_off", "Times blob write pressure ended."),
    _c("node_disk_full_on", "meshjobs_node_disk_full_on", "Times the member's disk was found full (read-only)."),
    _c("node_disk_full_off", "meshjobs_node_disk_full_off", "Times the member's disk had room again."),
    _c("node_batches_proposed", "meshjobs_node_batches_proposed", "Batches of changes the node proposed to Raft."),
    _c("node_ends_unknown", "meshjobs_node_ends_unknown", "Item ends for a lease the node no longer knows, dropped."),
    _c("node_inputs_not_copied", "meshjobs_node_inputs_not_copied", "Submits whose input blobs could not be copied to enough members."),
    _c("node_runs_started", "meshjobs_node_runs_started", "Items this member was told to run."),
    _c("node_state_snapshots_installed", "meshjobs_node_state_snapshots_installed", "Table snapshots from the leader installed (workers)."),
    _c("node_state_snapshots_sent", "meshjobs_node_state_snapshots_sent", "Table snapshots sent to workers (leader)."),
    _c("node_state_dumps_sent", "meshjobs_node_state_dumps_sent", "Dumps (the snapshot file) sent to workers as their whole table (leader)."),
    _c("node_state_dumps_asked", "meshjobs_node_state_dumps_asked", "New dumps asked for, the recent entries no longer reaching back to the latest (leader)."),
    _c("node_state_dumps_installed", "meshjobs_node_state_dumps_installed", "Dumps from the leader checked and installed as the whole table (workers)."),
    _c("node_state_dumps_stale", "meshjobs_node_state_dumps_stale", "Dumps from the leader refused as older than the table or than meant (workers)."),
    _c("node_state_snapshots_waiting", "meshjobs_node_state_snapshots_waiting", "Workers told who leads while their whole table waits its turn (leader)."),
    _c("node_state_gaps", "meshjobs_node_state_gaps", "Gaps found in the leader's table updates (a snapshot is asked for)."),
    _c("node_leader_lost", "meshjobs_node_leader_lost", "Times a worker lost sight of the leader."),
    _c("node_revokes_proposed", "meshjobs_node_revokes_proposed", "Leases the leader proposed to revoke."),
    _c("node_leases_proposed", "meshjobs_node_leases_proposed", "Leases the leader proposed."),
    _c("node_results_proposed", "meshjobs_node_results_proposed", "Item results the leader proposed."),
    _c("node_expiries_proposed", "meshjobs_node_expiries_proposed", "Job expiries the leader proposed."),
    _c("node_cron_fires_proposed", "meshjobs_node_cron_fires_proposed", "Due runs of schedules the leader proposed to fire."),
    _c("node_recopy_walks", "meshjobs_node_recopy_walks", "Walks of the table for outputs a lost member held (leader)."),
    _c("node_recopies_", "meshjobs_node_recopies", "Outputs copied again after a member was lost, by step.", "step"),
    _c("node_state_hints", "meshjobs_node_state_hints", "Table updates from a member other than the leader (hints: who leads; never freshness)."),
    _c("node_ctl_replies_of_another_request", "meshjobs_node_ctl_replies_of_another_request", "Forwarded answers whose request id names another request, dropped."),
    _c("node_feed_gaps", "meshjobs_node_feed_gaps", "Times the feed of changes (/events) restarted after a snapshot was installed."),
    _c("node_feed_resets", "meshjobs_node_feed_resets", "Answers of the changes op that told a client to reload (since older than the ring)."),
    _c("node_changes_waiters_full", "meshjobs_node_changes_waiters_full", "Changes long-polls refused because events_waiters_max waited already."),
    _c("node_", "meshjobs_node", "The job node's count {rest} (not yet described here).", ""),
    # --- the job table (meshjobs/table.py), counts of applied entries ---
    _c("table_refused_", "meshjobs_table_refused", "Log entries the job table refused, by reason.", "reason"),
    _c("table_entries", "meshjobs_table_entries", "Log entries applied to the job table."),
    _c("table_duplicate_rids", "meshjobs_table_duplicate_rids", "Changes applied twice (same request id), answered from the first."),
    _c("table_jobs_submitted", "meshjobs_table_jobs_submitted", "Jobs submitted."),
    _c("table_items_submitted", "meshjobs_table_items_submitted", "Items submitted."),
    _c("table_leases_granted", "meshjobs_table_leases_granted", "Item leases granted."),
    _c("table_leases_refused", "meshjobs_table_leases_refused", "Item leases refused (item no longer pending)."),
    _c("table_leases_revoked", "meshjobs_table_leases_revoked", "Item leases revoked (member gone or lease expired)."),
    _c("table_items_retried", "meshjobs_table_items_retried", "Items put back to pending for another attempt."),
    _c("table_results_accepted", "meshjobs_table_results_accepted", "Item results accepted."),
    _c("table_results_refused", "meshjobs_table_results_refused", "Item results refused (stale lease)."),
    _c("table_jobs_cancelled", "meshjobs_table_jobs_cancelled", "Jobs cancelled."),
    _c("table_jobs_forgotten", "meshjobs_table_jobs_forgotten", "Jobs forgotten on request."),
    _c("table_jobs_expired", "meshjobs_table_jobs_expired", "Finished jobs expired."),
    _c("table_tombstones_dropped", "meshjobs_table_tombstones_dropped", "Forgotten ids dropped past forgotten_ids_max, oldest first."),
    _c("table_bulk_changes", "meshjobs_table_bulk_changes", "Bulk changes (cancel, forget, tone of many jobs) applied, one per entry."),
    _c("table_crons_added", "meshjobs_table_crons_added", "Schedules added."),
    _c("table_crons_replaced", "meshjobs_table_crons_replaced", "Schedules replaced by another of the same name."),
    _c("table_crons_removed", "meshjobs_table_crons_removed", "Schedules removed."),
    _c("table_cron_runs_fired", "meshjobs_table_cron_runs_fired", "Runs of schedules fired (jobs made)."),
    _c("table_cron_runs_skipped", "meshjobs_table_cron_runs_skipped", "Due runs passed over while the last still ran (overlap skip)."),
    _c("table_cron_fires_stale", "meshjobs_table_cron_fires_stale", "Fires of a due time settled already or not due (a repeat, or a stale leader's), refused."),
    _c("table_", "meshjobs_table", "The job table's count {rest} (not yet described here).", ""),
    # --- the node's state now ---
    _g("jobs_forgotten_total", "meshjobs_jobs_forgotten", "Forgotten job ids the table remembers (to refuse their reuse)."),
    _g("items_leased", "meshjobs_items_leased", "Items leased to a member now, fleet-wide."),
    _g("items_running", "meshjobs_items_running", "Items running on this member now."),
    _g("changes_in_flight", "meshjobs_changes_in_flight", "Changes proposed or forwarded and not yet answered."),
    _g("raft_term", "meshjobs_raft_term", "The Raft term this member is in."),
    _g("is_leader", "meshjobs_is_leader", "1 if this member is the Raft leader, else 0."),
    _g("applied_index", "meshjobs_applied_index", "Index of the last log entry applied to the job table."),
    _g("members_known", "meshjobs_members_known", "Members this member has heard of."),
    _g("blob_pressure", "meshjobs_blob_pressure", "1 while blob writes lag (new leases held back), else 0."),
    _g("disk_full", "meshjobs_disk_full", "1 while the member's disk is full (read-only), else 0."),
    _g("disk_free_bytes", "meshjobs_disk_free_bytes", "Free bytes on the member's data disk when last looked at."),
    # --- the edges (meshjobs/jobsd.py edge_metrics) ---
    _c("journal_syncs", "meshjobs_journal_syncs", "fsyncs of the Raft journal by the jobs thread."),
    _c("history_written", "meshjobs_history_written", "Records of dropped jobs appended to history.jsonl."),
    _c("history_dropped", "meshjobs_history_dropped", "History records dropped because the writer's queue was full."),
    _c("history_", "meshjobs_history", "The history writer's count {rest} (see meshjobs/history.py).", ""),
    _c("notify_sent", "meshjobs_notify_sent", "Finish notices (--notify) the receiver took."),
    _c("notify_retried", "meshjobs_notify_retried", "Finish notices sent again after a refusal or no answer."),
    _c("notify_dropped", "meshjobs_notify_dropped", "Finish notices dropped because the sender's queue was full."),
    _c("notify_given_up", "meshjobs_notify_given_up", "Finish notices given up after notify_retry_s_max."),
    _c("notify_refused", "meshjobs_notify_refused", "Finish notices not sent: their destination resolved to an address [notify] allow does not allow."),
    _c("driver_orphans_reaped", "meshjobs_driver_orphans_reaped", "Zombies of orphaned processes reaped (meshd as PID 1 or a subreaper)."),
    _c("journal_compactions", "meshjobs_journal_compactions", "Compactions of the Raft journal."),
    _c("dumps_written", "meshjobs_dumps_written", "Raft snapshots (dumps) written."),
    _c("dump_failures", "meshjobs_dump_failures", "Raft snapshots (dumps) that failed and were retried."),
    _c("dumps_sent", "meshjobs_dumps_sent", "Dumps sent whole to new workers by the sender thread (leader)."),
    _c("dumps_dropped_queue", "meshjobs_dumps_dropped_queue", "Dumps to send dropped: too many waiting for the sender thread."),
    _c("dumps_dropped_link", "meshjobs_dumps_dropped_link", "Dumps to send dropped part way: the link was down or had no room in time."),
    _c("dumps_failed", "meshjobs_dumps_failed", "Dumps that could not be sent (no file, too large)."),
    _c("dump_bytes_sent", "meshjobs_dump_bytes_sent", "Bytes of dumps sent to new workers."),
    _c("frames_inbox_dropped", "meshjobs_frames_inbox_dropped", "Frames dropped because the jobs thread's inbox was full."),
    _c("raft_dropped_", "meshjobs_raft_dropped", "Messages on the Raft port dropped, by reason.", "reason"),
    _c("raft_", "meshjobs_raft", "Raft seam decisions: {rest} (see replica.RAFT_COUNTERS).", ""),
    _c("links_dropped_", "meshjobs_links_dropped", "Connections or frames from peers dropped, by reason.", "reason"),
    _c("links_send_dropped_", "meshjobs_links_send_dropped", "Frames to peers dropped before sending, by reason.", "reason"),
    _g("links_peers_up", "meshjobs_links_peers_up", "Peers this member has a working link to."),
    _g("links_clock_skew_ms_", "meshjobs_links_clock_skew_ms", "Each peer's wall clock minus this member's, in ms, as its hello said at the last handshake (only shown: nothing depends on it).", "peer"),
    _g("blobs_blobs", "meshjobs_blobs", "Blobs in the member's blob store."),
    _g("blobs_bytes", "meshjobs_blobs_bytes", "Bytes of blobs in the member's blob store."),
    _g("blobs_pins", "meshjobs_blobs_pins", "Pins (blob, owner) in the member's blob store."),
    _g("blobs_map_bytes", "meshjobs_blobs_map_bytes", "Size of the blob store's memory map."),
    _c("blobs_puts", "meshjobs_blobs_puts", "Blobs put into the blob store."),
    _c("blobs_fsyncs", "meshjobs_blobs_fsyncs", "fsyncs of the blob store."),
    _g("blobs_", "meshjobs_blobs", "The blob store's number {rest} (not yet described here).", ""),
    _c("blob_writers_batches", "meshjobs_blob_writers_batches", "Batches the blob writer threads wrote."),
    _c("blob_writers_payloads", "meshjobs_blob_writers_payloads", "Payloads the blob writer threads wrote."),
    _c("blob_writers_fsyncs", "meshjobs_blob_writers_fsyncs", "fsyncs by the blob writer threads."),
    _g("blob_writers_pending_bytes", "meshjobs_blob_writers_pending_bytes", "Bytes waiting to be written by the blob writers."),
    _g("blob_writers_peak_pending_bytes", "meshjobs_blob_writers_peak_pending_bytes", "Most bytes ever waiting for the blob writers."),
    _g("blob_writers_queued", "meshjobs_blob_writers_queued", "Payloads queued for the blob writers."),
    _g("blob_writers_", "meshjobs_blob_writers", "The blob writers' number {rest} (not yet described here).", ""),
    _c("blob_mover_dropped_", "meshjobs_blob_mover_dropped", "Blob copy frames the mover dropped, by reason.", "reason"),
    _g("blob_mover_inbox", "meshjobs_blob_mover_inbox", "Blob frames waiting for the mover."),
    _g("blob_mover_inbox_bytes", "meshjobs_blob_mover_inbox_bytes", "Bytes of blob frames waiting for the mover."),
    _g("blob_mover_fetching", "meshjobs_blob_mover_fetching", "Blob fetches from peers in progress."),
    _g("blob_mover_assemblies", "meshjobs_blob_mover_assemblies", "Blobs being assembled from received chunks."),
    _g("blob_mover_sending", "meshjobs_blob_mover_sending", "Blob copies waiting or being streamed to peers."),
    _g("blob_mover_inflight", "meshjobs_blob_mover_inflight", "Blob copies sent and not yet acknowledged."),
    _g("blob_mover_copies_waiting", "meshjobs_blob_mover_copies_waiting", "Blob copies asked of this member and not yet acknowledged by their peer."),
    _c("blob_mover_copies_asked", "meshjobs_blob_mover_copies_asked", "Blob copies to peers asked of the mover."),
    _c("blob_mover_copies_completed", "meshjobs_blob_mover_copies_completed", "Blob copies to peers completed (acknowledged)."),
    _c("blob_mover_chunks_sent", "meshjobs_blob_mover_chunks_sent", "Blob chunks sent to peers."),
    _c("blob_mover_chunks_received", "meshjobs_blob_mover_chunks_received", "Blob chunks received from peers."),
    _c("blob_mover_blobs_sent", "meshjobs_blob_mover_blobs_sent", "Whole blobs sent to peers."),
    _c("blob_mover_blobs_received", "meshjobs_blob_mover_blobs_received", "Whole blobs received from peers and stored."),
    _c("blob_mover_acks_sent", "meshjobs_blob_mover_acks_sent", "Blob digests acknowledged to peers."),
    _c("blob_mover_acks_received", "meshjobs_blob_mover_acks_received", "Blob digests peers acknowledged."),
    _c("blob_mover_fetches", "meshjobs_blob_mover_fetches", "Fetches of a blob from peers started."),
    _c("blob_mover_fetches_found", "meshjobs_blob_mover_fetches_found", "Fetches of a blob from peers that found it."),
    _c("blob_mover_fetches_failed", "meshjobs_blob_mover_fetches_failed", "Fetches of a blob from peers that failed."),
    _c("blob_mover_gets_served", "meshjobs_blob_mover_gets_served", "Blob gets from peers answered with the blob."),
    _c("blob_mover_gets_missing", "meshjobs_blob_mover_gets_missing", "Blob gets from peers for a blob this member lacks."),
    _c("blob_mover_", "meshjobs_blob_mover", "The blob mover's count {rest} (not yet described here).", ""),
    _c("item_logs_asks", "meshjobs_item_logs_asks", "Asks for a running item's output sent to the member running it (F_LOG_GET)."),
    _c("item_logs_answers", "meshjobs_item_logs_answers", "Answers to those asks received (F_LOG_PUT)."),
    _c("item_logs_asks_timed_out", "meshjobs_item_logs_asks_timed_out", "Asks for running output not answered in time (log_ask_ms_max)."),
    _c("item_logs_served", "meshjobs_item_logs_served", "Asks of other members for running output served here."),
    _c("item_logs_served_bytes", "meshjobs_item_logs_served_bytes", "Bytes of running output served to other members."),
    _g("item_logs_waiting", "meshjobs_item_logs_waiting", "Asks for running output waiting for their answer."),
    _c("item_logs_dropped_", "meshjobs_item_logs_dropped", "Live output frames dropped, by reason (bad bodies, unasked answers, a full inbox).", "reason"),
)

# Families of the HTTP thread's own numbers (built by `http_families`).
HTTP_RULES: Mapping[str, tuple[str, str, str | None]] = {
    "meshjobs_http_requests": (COUNTER, "HTTP requests answered, by status class.", "class"),
    "meshjobs_http_bad_requests": (COUNTER, "HTTP requests refused as malformed (4xx of ours).", None),
    "meshjobs_http_auth_refused": (COUNTER, "HTTP requests refused by the trust checks, by reason.", "reason"),
    "meshjobs_http_blobs_damaged": (COUNTER, "Blobs found damaged while serving, and repaired, by what.", "what"),
    "meshjobs_http_conns_open": (GAUGE, "HTTP connections open now.", None),
    "meshjobs_http_conns_max": (GAUGE, "HTTP connections allowed at once.", None),
    "meshjobs_http_conns_accepted": (COUNTER, "HTTP connections accepted.", None),
    "meshjobs_http_conns_shed": (COUNTER, "HTTP connections closed by the gate, by reason.", "reason"),
    "meshjobs_http_accept_errors": (COUNTER, "Errors accepting HTTP connections (out of descriptors...).", None),
    "meshjobs_http_item_streams": (GAUGE, "Answers of an item's output (GET /jobs/{id}/items/{n}/stdout) being sent now.", None),
}

JOBS_FAMILY = "meshjobs_jobs"
JOBS_HELP = "Jobs in the job table now, by state and pool."

_EXACT = {r.key: r for r in RULES if r.label is None}
_PREFIXES = sorted((r for r in RULES if r.label is not None), key=lambda r: -len(r.key))

# Bucket bounds, in seconds.
SUBMIT_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
LEASE_START_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 60.0)
RUN_BUCKETS_S = (0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 3600.0, 4 * 3600.0, 24 * 3600.0)
FSYNC_BUCKETS_S = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


def rule_for(key: str) -> tuple[Rule, str | None] | None:
    """The rule of a key and, for a prefix rule, the label value (the rest of the key)."""
    rule = _EXACT.get(key)
    if rule is not None:
        return rule, None
    for r in _PREFIXES:
        if key.startswith(r.key) and len(key) > len(r.key):
            return r, key[len(r.key):]
    return None


class _Families:
    """Families being built, by name: one type, one HELP, one set of label names each."""

    def __init__(self) -> None:
        self._by_name: dict[str, Metric] = {}

    def add(self, kind: str, family: str, help: str, labels: tuple[str, ...],
            values: tuple[str, ...], value: float) -> None:
        fam = self._by_name.get(family)
        if fam is None:
            cls = CounterMetricFamily if kind == COUNTER else GaugeMetricFamily
            fam = self._by_name[family] = cls(family, help, labels=list(labels))
        fam.add_metric(list(values), value)

    def declare(self, kind: str, family: str, help: str, labels: tuple[str, ...]) -> None:
        if family not in self._by_name:
            cls = CounterMetricFamily if kind == COUNTER else GaugeMetricFamily
            self._by_name[family] = cls(family, help, labels=list(labels))

    def __iter__(self) -> Iterator[Metric]:
        return iter(self._by_name.values())


def _number(v: Any) -> float | None:
    if isinstance(v, bool):
        return float(v)
    if isinstance(v, (int, float)):
        return float(v)
    return None


def member_families(values: Mapping[str, Any]) -> list[Metric]:
    """The families of the numbers the control op "metrics" answered."""
    fams = _Families()
    fams.declare(GAUGE, JOBS_FAMILY, JOBS_HELP, ("state", "pool"))
    by = values.get("jobs_by_state_pool")
    if isinstance(by, Mapping):
        for state, pools in sorted(by.items()):
            if isinstance(pools, Mapping):
                for pool, n in sorted(pools.items()):
                    v = _number(n)
                    if v is not None:
                        fams.add(GAUGE, JOBS_FAMILY, JOBS_HELP, ("state", "pool"),
                                 (str(state), str(pool)), v)
    for key in sorted(values, key=str):
        if key == "jobs":
            continue  # the sum of meshjobs_jobs{state,pool}
        v = _number(values[key])
        if v is None:
            continue  # only numbers are metrics; nested dicts are handled above
        found = rule_for(str(key))
        if found is None:
            name = _NAME_BAD.sub("_", str(key))
            name = name if name.startswith("meshjobs_") else "meshjobs_" + name
            fams.add(GAUGE, name, f"{key}: a number of the member not yet described in "
                     "meshjobs/metrics.py.", (), (), v)
            continue
        rule, rest = found
        if rest is None:
            fams.add(rule.kind, rule.family, rule.help, (), (), v)
        elif rule.label == "":
            name = rule.family + "_" + _NAME_BAD.sub("_", rest)
            fams.add(rule.kind, name, rule.help.format(rest=rest), (), (), v)
        else:
            assert rule.label is not None
            fams.add(rule.kind, rule.family, rule.help, (rule.label,), (rest,), v)
    return list(fams)


def http_families(numbers: Mapping[str, float | Mapping[str, float]]) -> list[Metric]:
    """The families of the HTTP thread's numbers: family name -> a number, or label value ->
    number for a family with a label (see HTTP_RULES)."""
    fams = _Families()
    for family, (kind, help, label) in HTTP_RULES.items():
        if family not in numbers:
            continue
        got = numbers[family]
        if label is None:
            v = _number(got)
            if v is not None:
                fams.add(kind, family, help, (), (), v)
            continue
        fams.declare(kind, family, help, (label,))
        if isinstance(got, Mapping):
            for lv, n in sorted(got.items()):
                v = _number(n)
                if v is not None:
                    fams.add(kind, family, help, (label,), (str(lv),), v)
    return list(fams)


@dataclass
class MemberMetrics:
    """The member's registry: latency histograms observed at the edges, and process metrics.

    Observing is one `Histogram.observe` (prometheus_client's own lock, per histogram); nothing
    else is shared between the threads that observe and the scrape.
    """

    registry: CollectorRegistry = field(default_factory=lambda: CollectorRegistry(auto_describe=True))

    def __post_init__(self) -> None:
        r = self.registry
        self.submit_commit_s = Histogram(
            "meshjobs_submit_commit_seconds",
            "From the jobs thread taking a submit to its answer being released (committed, "
            "journal synced), for submits answered 2xx.", buckets=SUBMIT_BUCKETS_S, registry=r)
        self.lease_start_s = Histogram(
            "meshjobs_lease_start_seconds",
            "From a lease reaching the member that runs it to the driver starting its item "
            "(observed when the item ends).", buckets=LEASE_START_BUCKETS_S, registry=r)
        self.item_run_s = Histogram(
            "meshjobs_item_run_seconds",
            "Run time of items on this member, from the process start to its end (items that "
            "could not start are not counted).", buckets=RUN_BUCKETS_S, registry=r)
        self.journal_fsync_s = Histogram(
            "meshjobs_journal_fsync_seconds",
            "Time of one fsync of the Raft journal by the jobs thread.",
            buckets=FSYNC_BUCKETS_S, registry=r)
        ProcessCollector(registry=r)

    def render(self, *families: Iterable[Metric]) -> bytes:
        """The text exposition of the registry and the given families."""
        return generate_latest(_Union(self.registry, [f for fs in families for f in fs]))


class _Union:
    """What generate_latest reads: the registry's families, then the numbers of the moment."""

    def __init__(self, registry: CollectorRegistry, extra: list[Metric]) -> None:
        self._registry = registry
        self._extra = extra

    def collect(self) -> Iterator[Metric]:
        yield from self._registry.collect()
        yield from self._extra
