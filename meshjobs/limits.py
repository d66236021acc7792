"""Every limit of meshjobs, named in one place, with its unit last.

A limit protects the member from input it did not choose (a client, a peer, a disk) or bounds a
queue between two threads. Changing one here changes it everywhere; nothing else hard-codes a
size, a count or a time.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

# --- Job specs (checked by control.py before anything is stored or proposed) --------------------
job_id_chars_max = 128  # a job id: [A-Za-z0-9._-], 1..128 characters
argv_items_max = 4096  # arguments of one job's program
argv_bytes_max = 256 * 1024  # all arguments together, UTF-8
env_items_max = 256  # extra environment variables of one job
env_bytes_max = 64 * 1024  # all of them together
env_name_chars_max = 256  # the name of one of them
tags_max = 32  # tags of one job
tag_chars_max = 64  # one tag
pool_chars_max = 64  # a pool name
cwd_chars_max = 4096  # a working directory
user_chars_max = 32  # a user name a job runs as (--user NAME; Linux useradd allows 32)
run_as_users_max = 64  # users one token's jobs may run as ([auth] tokens run_as)
uid_max = 2**32 - 2  # a uid or gid a job runs as (--user UID:GID; 2**32-1 is "no id" to the kernel)
items_max = 1_000_000  # items of one job (an array job)
quota_items_max = 1_000_000_000  # the largest pending_items_max / running_items_max of a token
item_name_chars_max = 255  # the name of one item (its input file's name, from --items-from DIR)
priority_abs_max = 1_000_000  # priorities range over [-max, +max]
retries_max = 100  # re-runs of one failing item
runtime_s_max = 30 * 24 * 3600  # the longest runtime limit a job may ask for
max_leases_max = 1_000_000  # "at most N items of this job at once"
deps_max = 64  # parent jobs one job may wait for (`--after`, the spec's "after")

# --- HTTP and the control path -----------------------------------------------------------------
http_body_bytes_max = 64 * 1024 * 1024  # one request body (inline item payloads included)
http_wait_s_max = 300  # the longest long-poll a client may ask for
jobs_list_default = 100  # jobs in one page of GET /jobs when the client names no limit
jobs_list_max = 1000  # the most jobs one page of GET /jobs may ask for
jobs_cursor_chars_max = 20  # a paging cursor (the submit seq of the last job shown, decimal)
status_stderr_bytes_max = 4096  # the tail of a failed item's stderr `job status` reads
status_stderr_lines_max = 5  # lines of that tail shown
results_sep_bytes_max = 4096  # the separator `job results --sep` writes between items
status_stderr_read_bytes_max = 1024 * 1024  # a longer stderr is not read for its tail (it is named)
status_items_shown_max = 20  # failed items `job status` and the job page explain one by one
webui_items_shown_max = 200  # items one page of a job's web page lists (links page the rest)
# Item records the HTTP edge builds and encodes at a time for GET /jobs/ID?items (each slice a
# few milliseconds: the jobs thread gets the interpreter between two).
items_json_slice_max = 200
# Reads of a job's items that do not build every item record on the jobs thread: a page of item
# records one control read answers (the job page asks webui_items_shown_max of them), and the
# output digests one read of a results download answers (the edge asks slice after slice, the
# jobs thread serving others between two; a slice to a peer fits one frame).
items_page_max = 1_000
results_slice_max = 65_536
webui_preview_bytes_max = 16 * 1024  # the head of an item's stdout or stderr a job page shows
webui_live_reads_max = 8  # reads of a running item's output for its page's tail (log_frame_bytes_max each)
webui_poll_ms = 2000  # how often the web UI's script polls when /events does not stream
webui_sse_retry_ms = 60_000  # polling that long, the script tries /events again
http_header_s_max = 10  # a connection must send a request's whole head within this (default)
http_idle_s_max = 60  # a kept-alive connection with no request for this long is closed (default)
# An answer of blobs up to this size is checked whole before its headers go out, so damage is
# a clear 500 (or repaired) instead of a transfer cut short; larger ones are checked as they go.
http_check_before_send_bytes_max = 16 * 1024 * 1024
http_repaired_remembered_max = 4096  # digests repaired lately, for ?check=1 to say so
http_body_s_max = 120  # a request's whole body must arrive within this of its head (default)
http_conns_max = 100_000  # the most a config may allow; the default comes from the fd limit
http_token_chars_max = 4096  # a bearer token or session id; a longer one is refused unhashed
http_sessions_max = 1024  # browser sessions (POST /login) a member keeps; the oldest goes first
http_session_s_max = 12 * 3600  # a browser session ends this long after its login
http_sessions_per_identity_max = 64  # sessions one identity keeps; its own oldest goes first
http_login_burst_max = 30  # logins (POST /login) one client address may make at once...
http_login_refill_s = 1.0  # ...and one more each time this long has passed (then 429)
http_login_clients_max = 4_096  # client addresses whose logins are counted; the longest idle goes
http_login_body_bytes_max = 16 * 1024  # the body of POST /login (a form or JSON with a token)
# Request bodies read by orjson rather than the standard library (meshjobs/jsonbody.py): only
# those small enough, without a number of more digits, nor this many brackets (nesting depth).
json_fast_bytes_max = 1 << 20
json_fast_digits_max = 18
json_fast_brackets_max = 512
# Host headers found good, remembered so that the next request with one is not parsed again.
http_hosts_remembered_max = 64
http_refusal_logs_per_s_max = 5  # refused requests (401/403/415/421) logged per second; more are counted
# The default connection limit: the soft fd limit (RLIMIT_NOFILE) less what the rest of meshd may
# open (LMDB, journal, spool files, item and python-worker pipes, member links): a quarter of the
# fds, and at least this many, stay out of HTTP's reach (see connbook.conns_limit).
http_fds_reserved = 256
http_conns_min = 16  # the default is never below this, however low the fd limit
http_backlog_conns = 128  # connections the kernel queues before meshd accepts them
http_accept_batch_max = 64  # connections accepted per wakeup of the listening socket
http_evict_scan_max = 64  # connections looked at to find one to close for a newcomer
http_emfile_evict_conns = 32  # connections closed (oldest waiting first) when accept says EMFILE
http_accept_backoff_ms = 100  # and accepting pauses this long, instead of spinning
http_log_records_max = 10  # accept errors (and asyncio's own messages) logged per window...
http_log_window_s = 10  # ...of this length; the rest are counted and summed up in one line
ctl_commit_ms_max = 10_000  # a change not committed by then is answered 503 (no leader/quorum)
ctl_pending_max = 100_000  # changes waiting for their commit at once; more are answered 503
ctl_queue_max = 10_000  # requests queued from HTTP to the jobs thread
# The shortest wait of HTTP for an answer of the jobs thread: a change may wait up to
# ctl_commit_ms_max for its commit, so the HTTP side waits that long plus this slack.
http_ctl_slack_ms = 2_000
http_shutdown_s = 1.0  # at stop, requests being answered get this long to finish
http_login_fields_max = 8  # fields of a login form (token, next and a few a browser may add)
http_json_thread_bytes_min = 1 << 20  # a JSON body this large is parsed off the event loop
http_fqdn_s_max = 2.0  # looking up this machine's fully qualified name (a resolver may hang)
history_since_chars_max = 32  # a history query's since= (seconds since the epoch, a number)
rid_chars_max = 128  # a request id (idempotency key)
rids_remembered_max = 100_000  # request ids the table remembers to dedupe retried changes
forgotten_ids_max = 100_000  # tombstones of forgotten job ids the table keeps (oldest dropped first)

# --- The jobs thread ---------------------------------------------------------------------------
events_batch_max = 1024  # events stepped between two gate syncs
lease_batch_max = 4096  # grants in one lease entry
result_batch_max = 4096  # results in one result entry
# Leasing ahead: a member is leased more items than it has slots when a pool's items are short,
# so that its next items are there when one ends instead of a Raft round later.
lease_ahead_ms = 50  # per slot, items expected to run this long in all are leased ahead
lease_ahead_per_slot_max = 32  # and never more than this many items per slot
lease_ahead_run_ms_max = 1_000  # a pool whose items run longer than this is leased no further ahead
proposal_retry_ms = 5_000  # a proposal not seen committed by then may be proposed again
# The leader's entries in flight: while this many are proposed and not applied, what comes next
# waits and goes into the next entry together (fewer, larger Raft rounds under load).
proposals_in_flight_max = 1
changes_in_flight_max = 4  # and while fewer than this are, changes that arrived go at once
proposal_wait_ms = 1_000  # an entry not applied by then no longer holds the next one back
publish_ms = 250  # status, programs and jobs view are published this often
retry_backoff_ms_base = 500  # first retry of a failed item waits this long
retry_backoff_ms_max = 60_000  # and no retry waits longer than this

# --- The driver --------------------------------------------------------------------------------
driver_queue_max = 100_000  # commands queued to the driver
driver_events_max = 100_000  # item ends queued back to the jobs thread
cut_grace_ms = 2_000  # SIGTERM to a cut item's group, then SIGKILL after this
env_pass_names_max = 256  # [items] env_pass: names of meshd's variables items may see
orphan_reap_ms = 1_000  # a member that is PID 1 or a subreaper reaps orphans' zombies this often
item_error_chars_max = 1_024  # why an item failed without running, kept with its result (longer: cut)
# What an earlier run of meshd left running (meshjobs/leftovers.py): a log of the processes it
# started, ended at the next start before any lease.
leftover_log_bytes_max = 1024 * 1024  # a log this large, twice what still runs, starts anew
leftover_file_bytes_max = 64 * 1024 * 1024  # a log read at start; a larger one is refused
leftover_line_bytes_max = 256  # one line of a log; a longer one is refused
leftover_files_max = 1_000  # files in running/; more and none is read
leftover_environ_bytes_max = 4 * 1024 * 1024  # /proc/PID/environ read to tell an item's process
leftover_batch_max = 256  # processes signalled and waited for at once (one pidfd each)
leftover_passes_max = 4  # looks at /proc while processes of leftovers are still found
leftover_end_wait_ms = 5_000  # how long meshd waits for them to end before it goes on
# Lease times of runs remembered for the lease->start histogram (one per run not yet ended)
run_stamps_max = driver_queue_max
# Command items' pipes (meshjobs/driver.py, meshjobs/capture.py)
item_stdin_pipe_bytes_max = 64 * 1024  # a stdin payload up to this goes through a pipe; larger: a spool file
item_output_memory_bytes_max = 64 * 1024  # output of one stream kept in memory; past it, in a spool file
item_pipe_read_bytes = 256 * 1024  # one read (or splice) from an item's stdout or stderr pipe
item_drain_reads_max = 64  # reads of each output pipe once the item's group is killed (escapees write on)
# The wall around items (meshjobs/wall.py): its allow rules are the launcher's arguments, one
# path each, beside the item's own argv and environment in the kernel's limit on them (2 MiB
# under the usual 8 MiB stack). More than this and items do not start: the data folder sits in
# a folder with too many neighbours, and must move to a folder of its own.
wall_rules_bytes_max = 1024 * 1024
exec_args_bytes_max = 2 * 1024 * 1024  # argv and environment of one exec (the kernel's ARG_MAX)

# Blob store limits live in blobstore/limits.py: that package stands alone.

# --- The journal and snapshots -----------------------------------------------------------------
journal_record_bytes_max = 256 * 1024 * 1024  # one journal record (one committed entry)
# Commands at least this large are written apart from their header instead of being joined to
# it, so a big entry is not copied once more only to save a write call.
journal_join_bytes_max = 64 * 1024
entry_bytes_max = 64 * 1024 * 1024  # one proposed entry
snapshot_bytes_max = 16 * 1024 * 1024 * 1024  # one full dump of the table
log_compaction_entries_min = 20_000  # compact the log past this many entries
log_compaction_s_min = 600  # or past this age
log_compaction_bytes_min = 4 * 1024 * 1024  # or past this many bytes of entries (all held in memory)
dump_sync_bytes = 4 * 1024 * 1024  # a dump is written and fdatasynced this much at a time (dumpfile.py)
log_compaction_force_s_min = 1  # compactions asked for by size come at most this often
dump_retry_ms_min = 500  # a dump that failed is tried again after this, doubling each failure
dump_retry_ms_max = 60_000  # and no retry of a dump waits longer than this

# --- The disk (diskspace.py) -------------------------------------------------------------------
disk_free_min_bytes_default = 1 << 30  # [blobs] disk_free_min when unset: 1 GiB,
disk_free_min_pct_default = 5  # or this percentage of the disk when that is smaller
disk_reserve_bytes = 4 << 20  # the reserve file freed when the disk runs low (journal room)
disk_full_bytes_max = 1 << 20  # an EIO with less free than this is taken for ENOSPC
disk_poll_s = 1.0  # free space is checked this often

# --- Frames and links between members (frames.py, links.py) -----------------------------------
frame_bytes_max = 4 * 1024 * 1024  # one frame, header and tag included (a 1 MiB blob chunk fits)
link_handshake_bytes_max = 4096  # one handshake frame (hello, challenge, proof), MAC included
link_protocol_max = 65535  # a protocol number in a hello (proto, proto_min; meshjobs/versions.py)
link_version_chars_max = 64  # a hello's version string, as logged (longer is cut)
# A peer's hello this far off our wall clock is logged, and a member this far off the leader's
# is warned of in the fleet view (meshctl fleet, the fleet page); never a reason to refuse.
link_clock_skew_warn_ms = 30_000
link_queue_frames_max = 1024  # frames queued to one peer (and as many table frames waiting)
link_queue_bytes_max = 8 * 1024 * 1024  # bytes queued to one peer (and as many waiting)
table_frame_wait_ms = 2_000  # a table frame waits this long for room, then its batch's rest drops
link_connect_backoff_ms_base = 100  # first redial of a peer that is down waits this long
link_connect_backoff_ms_max = 5_000  # and no redial waits longer than this
link_idle_ms = 1_000  # a connection with nothing to send gets an F_PING this often
link_silent_ms_max = 10_000  # a connection that received nothing for this long is closed
link_hello_ms_max = 5_000  # a new connection must complete its handshake within this
link_pending_conns_max = 64  # accepted connections that have not completed their handshake
link_io_bytes = 256 * 1024  # one recv or send call on a member link
link_reads_per_turn_max = 16  # reads of one connection per loop turn (no busy peer starves the rest)
link_tick_s = 0.05  # the links loop wakes at least this often to run its timers
link_discover_s_max = 5.0  # a joining worker's ask for the fleet's voters waits this long for the answer
link_voters_send_s_max = 1.0  # sending the voters to a joining worker blocks at most this long
link_discover_read_bytes = 64 * 1024  # one recv of that answer

# --- Live item output (GET /jobs/{id}/items/{n}/stdout, F_LOG_GET/F_LOG_PUT, itemlogs.py) -----
log_frame_bytes_max = 256 * 1024  # output bytes in one F_LOG_PUT (one read of a spool file)
log_offset_bytes_max = 1 << 50  # the largest ?offset= a client may give (bytes to skip)
log_poll_ms = 200  # a follow (?follow=1) looks for new output this often
log_ask_ms_max = 5_000  # a member that does not answer an F_LOG_GET within this is taken as down
log_asks_max = 1_024  # F_LOG_GET asks of one member waiting for their answer; more: 503
log_inbox_max = 256  # F_LOG_GET frames queued to the item-log thread; more are dropped, counted
log_start_wait_s_max = 60  # ?follow=1 waits this long for an item that has not started
log_settle_ms_max = 5_000  # an answer without follow waits this long for output between spool and blob
log_follow_s_max = 24 * 3600  # a follow ends after this long (a client resumes with ?offset=)
item_logs_idle_s = 0.5  # the item-log thread wakes this often when idle (to notice stop)

# --- The fleet ---------------------------------------------------------------------------------
member_dead_ms = 3_000  # a member not heard from for this long has its leases revoked
member_lost_ms = 60_000  # and for this long, the copies of outputs it held are made again elsewhere
recopy_retry_ms = 10_000  # a re-copy not confirmed by then is asked again (the table walked again)
blob_copies = 2  # members that hold a result's blobs before the result is proposed
copy_spares = 1  # members asked for a copy at once beyond the blob_copies - 1 needed (one silent delays nothing)
result_holders_max = 16  # members a result row names as holding copies of its outputs
recopy_items_per_round_max = 4_096  # items the leader looks at per round for copies lost with a member
recopies_in_flight_max = 256  # copies the leader has asked for (or fetches) to restore blob_copies
state_entries_max = 512  # committed entries in one F_JOB_STATE frame
state_ring_entries_max = 2_048  # committed entries a voter keeps to catch workers up (further behind: a snapshot)
state_ring_rows_max = 65_536  # and item rows in them (grants, results, submitted items) together
member_names_max = 4_096  # distinct member names the table shares one string for
have_ms = 250  # members report what they have (F_JOB_HAVE) this often
have_keepalive_ms = 1_000  # but to a known leader, with nothing new but position and running items, this often
state_push_ms = 50  # a worker is sent new entries this often, at once when they hold leases of its own
state_keepalive_ms = 1_000  # a caught-up worker is told this often who leads (an empty F_JOB_STATE)
state_snapshots_max = 4  # whole tables a leader sends per state_resend_ms (more behind wait their turn)
dump_sends_queued_max = 8  # dumps waiting for the thread that sends them to new workers (dumpsend.py)
state_dump_wait_ms = 30_000  # a new dump asked for a worker is waited for this long; then the table is built
# A worker that has not heard the leader for this long (one and a half keep-alives) sends its reports
# to the voters too (they answer who leads): under dead_ms, which a new leader gives unheard
# members to report.
leader_quiet_ms = 3 * state_keepalive_ms // 2
frame_parts_max = 256  # a body too large for one frame travels in at most this many parts
frame_assemblies_max = 8  # bodies in parts being put back together at once
# A body whose msgpack is larger than this travels in parts of this size (frames.Chunker); the
# room left in its frame is for the part's own fields, the header and the tag.
frame_part_room_bytes = 64 * 1024
frame_part_bytes = frame_bytes_max - frame_part_room_bytes

# --- Blob copies and fetches between members (blobmover.py) -----------------------------------
blob_frame_bytes = 1 << 20  # blob bytes in one F_BLOB_PUT frame (one chunk)
blob_window_frames = 4  # frames (chunks or packs of small blobs) handed to the links at a time
blob_ack_wait_ms = 5_000  # a blob sent and not acknowledged by then leaves the peer's window
blob_inflight_max = 256  # blobs sent to one peer and not yet acknowledged
blob_inflight_bytes_max = 16 << 20  # and their bytes (a larger blob goes alone)
blob_send_queue_max = 200_000  # blobs waiting to be sent, all peers together (~200 bytes each)
blob_fetch_s_max = 30  # the longest a fetch of a blob this member lacks waits for a peer's copy
blob_assemblies_max = 64  # blobs being received at once, each in its own spool file
blob_assembly_bytes_max = 64 << 30  # the largest blob a member accepts from a peer
blob_assembly_idle_ms = 30_000  # a blob being received with no chunk for this long is removed
blob_mover_queue_max = 1024  # frames and copy requests queued to the mover; also fetches, copies
blob_mover_queue_bytes_max = 64 << 20  # chunk bytes queued to the mover
blob_copy_wait_ms = 600_000  # a copy not acknowledged by then is forgotten (the node asks again)
join_s_max = 60  # a worker member keeps trying to reach the member it joins through this long
join_retry_s = 0.5  # and tries again this often
http_start_s_max = 10  # meshd stops (exit 2) if HTTP does not listen within this of its start
thread_join_s_max = 10  # at a clean stop, each thread gets this long to end
# Raft election timeouts (seconds, drawn between the two): a voter alone elects itself at once.
raft_election_s = (0.4, 0.8)
raft_election_alone_s = (0.05, 0.1)
# One sealed frame on the Raft port (raftlink.py): a batch of entries up to about twice the
# largest entry (pysyncobj adds entries to a message until it holds a batch's worth), in msgpack.
raft_message_bytes_max = 3 * entry_bytes_max
# Bytes of entries a leader puts in one AppendEntries (pysyncobj's `appendEntriesBatchSizeBytes`:
# it adds entries until they reach it, so a message holds up to about twice this). Above the
# largest entry with pysyncobj's few bytes around it, so no entry is ever split.
raft_batch_bytes = entry_bytes_max + 4096
# Entries in one AppendEntries message from a peer (ours hold as many as fit a batch's bytes).
raft_message_entries_max = 1_000_000
# Bytes waiting to be written to one voter's Raft connection; a voter that does not read them
# is cut off (Raft sends again once it is back). Two whole messages fit.
raft_send_queue_bytes_max = 2 * raft_message_bytes_max
raft_ping_s = 1.0  # an idle Raft connection carries a ping this often
raft_idle_s_max = 3.5  # a Raft connection that brings nothing for this long is closed
raft_connect_retry_s = 0.25  # a voter dials a voter it is not connected to this often
# A voter's host name is looked up again this often (a voter back on another address is found
# within it), and a failed lookup is tried again this often (pysyncobj's defaults: 600 s, 30 s).
raft_dns_cache_s = 5.0
raft_dns_retry_s = 1.0
raft_read_bytes = 1 << 18  # one recv on the Raft port
raft_reads_per_event_max = 16  # recvs per poll event, so that one busy peer cannot starve the others
fleet_ask_ms = 2_000  # the fleet view asked of the leader; unanswered by then, a member gives its own
ctl_resend_ms = 500  # a forwarded change not answered by then is sent to the leader again
py_request_bytes_max = 64 << 20  # an item's stdin payload handed to a python worker
py_result_bytes_max = 64 << 20  # a python call's output and captured prints together
py_prints_chars_max = 1 << 20  # prints kept of one python call (the rest dropped, with a note)
py_frame_overhead_bytes_max = 1 << 20  # a python frame's fields around its payload or result
py_worker_start_s_max = 30  # a python worker not ready this long after its spawn is killed
py_worker_respawn_ms = 1_000  # a python worker that failed to start is replaced after this
py_workers_max = 256  # worker processes of one member's python pools together
py_read_bytes = 1 << 20  # one read of a python worker's answer pipe; a frame may take many
ctl_batch_max = 1024  # control changes the leader puts in one entry
state_resend_ms = 1_000  # a worker behind what was sent, not moving this long, is sent it again
state_snapshot_resend_ms = 10_000  # but not the whole table again sooner than this after the last
http_store_batch_max = 4_096  # distinct inline payloads of a submit stored per write transaction

# --- Following committed changes (GET /jobs/{id}?since=, GET /events) ------------------------
version_max = 2**53 - 1  # the largest job version a client may name in since= (JSON's safe integers)
events_ring_changes_max = 8_192  # recent (version, job) changes a member keeps for /events to resume from
events_answer_max = 256  # job events in one answer of the node's "changes" op (the rest come next)
events_filter_values_max = 32  # values of one /events filter (job, tag, state or pool)
events_waiters_max = 1_024  # "changes" long-polls waiting in the node at once; more are answered 503
events_streams_max = 64  # /events streams one member serves at once; more are answered 503
events_keepalive_s = 15  # an /events stream with nothing to say sends a comment this often
events_check_ms = 500  # an /events stream looks this often for its client gone or the member stopping
cli_busy_retry_s_max = 10  # meshctl asks members that answer 502/503/504 (an election) again this long
cli_wait_retry_s_max = 120  # `job wait` without --timeout asks members that cannot answer this long in a row
cli_wait_backoff_s_base = 0.2  # the first retry of `job wait` waits this long, then twice as long...
cli_wait_backoff_s_max = 5  # ...but never longer than this
cli_wait_poll_s = 30  # one ask of `job wait` waits this long for the job to end (then asks again)
cli_timeout_slack_s = 5  # meshctl waits for a change ctl_commit_ms_max and this much more
cli_copy_chunk_bytes = 1 << 20  # one read of a blob meshctl copies to a file or stdout
cli_error_bytes_max = 64 * 1024  # of an error answer, meshctl reads this much for its message

# --- Many jobs at once (cancel, forget, tone, status by ids or a filter) ----------------------
bulk_jobs_max = 500  # jobs one bulk request names or touches (more ids: 400; a filter: a page)
bulk_body_bytes_max = 256 * 1024  # the JSON body of one bulk request (500 ids of 128 fit)

# --- History of forgotten and expired jobs (history.jsonl in the data folder) -----------------
history_bytes_max = 16 << 20  # [history] bytes_max default: history.jsonl is rotated past this
history_keep_files = 3  # [history] keep default: rotated files kept (history.1.jsonl ...)
history_keep_files_max = 100  # the most rotated files [history] keep may ask for
history_line_bytes_max = 64 * 1024  # one record's line; a longer one drops its argv and env
history_queue_max = 4_096  # records waiting for the history writer; more are dropped, counted
history_read_max = 1_000  # records one GET /history answers at most (its limit=)
history_read_default = 100  # records GET /history and `meshctl history` give without a limit
epoch_s_max = 253_402_300_800  # the first second of year 10000: a --since / since= past it is refused
history_read_bytes_max = 64 << 20  # bytes of history files one read looks at, newest first

# --- Placement: which members a job's items go to (placement.py) ------------------------------
member_selector_chars_max = 128  # a job's member selector: a name, a glob or "*"
fanout_members_max = 1_024  # members a fan-out job (member "*") runs on: one item each
# --- Pools and members under command; finish hooks (meshjobs/fleetctl.py, meshjobs/notify.py) -
ctl_orders_max = 4_096  # pool holds/drains and member drains/stops the table keeps at once
stop_grace_s_max = 7 * 24 * 3600  # the longest `meshctl member stop --grace` a member waits
stop_poll_ms = 500  # a stopping member looks this often whether its runs have ended
notify_url_chars_max = 2_048  # a job's --notify URL
notify_allow_max = 256  # entries of [notify] allow (CIDRs and host names notices may go to)
notify_allow_chars_max = 253  # one of them (the longest host name)
notify_queue_max = 1_024  # finish notices waiting for the sender (and retrying); more are dropped
notify_send_timeout_s = 10  # one POST of a finish notice, whole: connect, send, status line
notify_senders_max = 8  # threads sending finish notices at once (to all destinations)
notify_inflight_per_dest_max = 2  # of them sending to one destination (scheme, host, port)
notify_retry_s_max = 300  # a notice the receiver refuses is retried this long, then dropped
notify_backoff_s_base = 0.5  # the first retry of a notice waits this long, then twice as long...
notify_backoff_s_max = 30  # ...but never longer than this
notify_sent_max = 4_096  # (job, version) notices a leader remembers sending (not sent twice)
notify_body_bytes_max = 256 * 1024  # a notice's JSON body; a longer record drops argv and env
notify_answer_bytes_max = 4_096  # of a receiver's answer to a notice, read (and thrown away)
items_warning_chars_max = 1000  # a member's warning that its items are not walled (/fleet)
boot_chars_max = 64  # a member's boot id in a stop order (as in its F_JOB_HAVE reports)
have_pools_max = 256  # pools one member's F_JOB_HAVE report names; a longer report is garbage
# The weight of the newest committed result in the leader's moving average of a pool's run
# times (what it leases ahead by, node/leader.py).
run_ms_average_weight_fraction = 0.2
# --- Re-running finished jobs (rerun, --restart, --resubmit, --stdout/--stderr PATH) ----------
restart_max = 10_000  # automatic re-runs after success a job may ask for (--restart N; or "forever")
resubmit_max = 100  # whole-job re-runs after it ends (--resubmit N)
restart_delay_s_max = 7 * 86_400  # the wait before an automatic re-run (--restart-delay S)
# Restarts bounded (a `true` with restart forever must not rerun a hundred times a second): a
# submit asking for a shorter delay is refused (a spec committed before the minimum existed is
# run with the minimum), and a job's automatic re-runs (restart and resubmit) within any minute
# are at most `restarts_per_minute_max`: the next one is due when the minute allows it.
restart_delay_s_min = 1  # the shortest wait before an automatic re-run (--restart-delay S)
restarts_per_minute_max = 6  # automatic re-runs of one job within any 60 s
restarts_window_ms = 60_000  # the window restarts_per_minute_max counts in
job_runs_kept_max = 16  # summaries of earlier runs a job's record keeps (the oldest dropped first)
item_attempts_kept_max = 8  # reasons of an item's earlier attempts kept (the oldest dropped first)
waiting_names_shown_max = 10  # parents or members a job's waiting_for names (the rest counted)
output_path_chars_max = 4096  # a --stdout / --stderr path, before {index} is filled in
output_path_write_s_max = 60  # writing one item's output to its path as another user
# --- Schedules (meshctl cron; meshjobs/cron.py) -------------------------------------------------
cron_schedules_max = 1_000  # schedules one fleet keeps (a cron add past it is refused)
cron_name_chars_max = 64  # a schedule's name: [A-Za-z0-9._-]; its runs' ids add 22 characters
cron_spec_chars_max = 200  # a schedule's spec text: five cron fields, or @every / @daily ...
cron_every_s_max = 366 * 24 * 3600  # the longest period of `@every`
cron_search_years_max = 30  # how far ahead (or back) a due time is looked for; none: it never fires
cron_late_ms_max = 60_000  # with --catch-up none, a run fired later than this after its due time is skipped
cron_body_bytes_max = 1 << 20  # the JSON body of PUT /cron/{name} (a job spec's argv and env fit)
# --- Pool slots set while running (meshctl pool slots; meshjobs/fleetctl.py) -------------------
pool_slots_max = 100_000  # slots a `pool slots` order may give a pool on a member (as the config)
# --- Watching folders (meshctl watch; meshjobs/watchplan.py, meshjobs/watch.py) ---------------
watch_config_bytes_max = 1 << 20  # one config file (JSON or TOML), read whole
watch_overrides_max = 256  # key.subkey=value overrides on one command line
watch_key_depth_max = 8  # parts of one override key (watch.NAME.jobs is three)
watches_max = 256  # watches one config defines
watch_name_chars_max = 64  # a watch's (or template's) name; the full name joins root and templates
watch_full_name_chars_max = 200  # root name, template names and watch name joined by '-'
watch_templates_max = 16  # templates one watch applies
watch_globs_max = 16  # file lists (globs) of one watch
watch_jobs_max = 64  # job indexes (jobs[n]) of one watch, and job specs at one index
watch_split_chars_max = 8  # the `split` separator
watch_match_max = 64  # filename parts `match` may join into a fileset key
watch_files_max = 100_000  # files one scan of one path considers; the rest wait (and are counted)
watch_state_bytes_max = 256 * 1024  # one hidden state file (a job's result) written or read back
watch_attempts_max = 100  # a failing file's job is submitted this often, then left failed
watch_period_s_max = 7 * 24 * 3600  # the longest refresh, rescan, min_age or max_age
watch_count_max = 10**9  # the largest `count`
watch_inflight_max = 10_000  # jobs one watcher follows at once; more wait for a later scan
watch_id_hash_chars = 16  # hex digits of the digest that ends every derived job id
watch_state_name_bytes_max = 255  # NAME_MAX: a file whose state file name is longer is not run
watch_xattr_bytes_max = 1024  # a state kept in an xattr (ext4 keeps one block for all of a file's)
watch_tick_s_max = 1.0  # a running watcher looks at its refresh and rescan times at least this often
watch_feed_ids_max = 20_000  # job ends heard on the change feed and not yet taken (more: dropped, polled)
watch_feed_retry_s = 2.0  # a watcher's change feed that broke is opened again after this
watch_feed_read_s = 60.0  # a change feed silent this long (no keep-alive) is opened again

# --- meshd's config file (meshd --config FILE, meshd check-config FILE; meshjobs/config.py) ------
config_file_bytes_max = 1 << 20  # one TOML config file, read whole (a real one is a few KiB)

# --- How the limits relate ----------------------------------------------------------------------
# Checked when this module is imported: a change of one limit that contradicts another stops
# every program at once, instead of showing as a frame that never fits or a timer that never
# fires. Each relation: what it says, the limit that breaks it when grown (tests/test_limits.py
# grows each in a copy of the values and sees it refused), and the check.
RELATIONS: tuple[tuple[str, str, Callable[[dict[str, Any]], bool]], ...] = (
    ("a part of a body in parts, with its room, fits one frame", "frame_part_bytes",
     lambda v: v["frame_part_bytes"] + v["frame_part_room_bytes"] <= v["frame_bytes_max"]),
    ("a blob chunk with its fields fits one frame", "blob_frame_bytes",
     lambda v: v["blob_frame_bytes"] + v["frame_part_room_bytes"] <= v["frame_bytes_max"]),
    ("a piece of live output with its fields fits one frame", "log_frame_bytes_max",
     lambda v: v["log_frame_bytes_max"] + v["frame_part_room_bytes"] <= v["frame_bytes_max"]),
    ("a handshake frame is no larger than a frame", "link_handshake_bytes_max",
     lambda v: v["link_handshake_bytes_max"] <= v["frame_bytes_max"]),
    ("a whole frame fits the bytes queued to a peer", "frame_bytes_max",
     lambda v: v["frame_bytes_max"] <= v["link_queue_bytes_max"]),
    ("a blob window's chunks fit the bytes in flight to a peer", "blob_window_frames",
     lambda v: v["blob_frame_bytes"] * v["blob_window_frames"] <= v["blob_inflight_bytes_max"]),
    ("a Raft batch holds the largest entry (no entry is split)", "entry_bytes_max",
     lambda v: v["entry_bytes_max"] < v["raft_batch_bytes"]),
    ("a Raft message holds two batches (pysyncobj fills one past a batch)", "raft_batch_bytes",
     lambda v: 2 * v["raft_batch_bytes"] <= v["raft_message_bytes_max"]),
    ("a Raft message fits the bytes queued to a voter", "raft_message_bytes_max",
     lambda v: v["raft_message_bytes_max"] <= v["raft_send_queue_bytes_max"]),
    ("a journal record holds the largest entry", "entry_bytes_max",
     lambda v: v["journal_record_bytes_max"] >= v["entry_bytes_max"]),
    ("an idle Raft connection pings before it is taken as dead", "raft_ping_s",
     lambda v: v["raft_ping_s"] < v["raft_idle_s_max"]),
    ("an idle member link pings before it is taken as silent", "link_idle_ms",
     lambda v: v["link_idle_ms"] < v["link_silent_ms_max"]),
    ("members report more often than a silent one is taken as dead", "have_ms",
     lambda v: v["have_ms"] < v["member_dead_ms"]),
    ("members with nothing new report more often than a silent one is taken as dead",
     "have_keepalive_ms", lambda v: v["have_keepalive_ms"] < v["member_dead_ms"]),
    ("the leader tells caught-up workers it leads before they give it up", "state_keepalive_ms",
     lambda v: v["state_keepalive_ms"] < v["member_dead_ms"]),
    ("new entries go out to workers more often than keep-alives", "state_push_ms",
     lambda v: v["state_push_ms"] <= v["state_keepalive_ms"]),
    ("a worker takes its leader as quiet only after missing a keep-alive", "state_keepalive_ms",
     lambda v: v["state_keepalive_ms"] < v["leader_quiet_ms"]),
    ("a quiet leader's workers ask the voters before a new leader revokes them", "leader_quiet_ms",
     lambda v: v["leader_quiet_ms"] + v["have_ms"] < v["member_dead_ms"]),
    ("a member is dead before its copies are lost", "member_dead_ms",
     lambda v: v["member_dead_ms"] < v["member_lost_ms"]),
    ("a forwarded change is resent before its commit wait ends", "ctl_resend_ms",
     lambda v: v["ctl_resend_ms"] < v["ctl_commit_ms_max"]),
    ("a followed item's output is polled before its ask times out", "log_poll_ms",
     lambda v: v["log_poll_ms"] < v["log_ask_ms_max"]),
    ("a redial backoff starts below its cap", "link_connect_backoff_ms_base",
     lambda v: v["link_connect_backoff_ms_base"] <= v["link_connect_backoff_ms_max"]),
    ("a retry backoff starts below its cap", "retry_backoff_ms_base",
     lambda v: v["retry_backoff_ms_base"] <= v["retry_backoff_ms_max"]),
    ("a dump retry starts below its cap", "dump_retry_ms_min",
     lambda v: v["dump_retry_ms_min"] <= v["dump_retry_ms_max"]),
    ("one slow notice destination leaves senders for the others", "notify_inflight_per_dest_max",
     lambda v: 1 <= v["notify_inflight_per_dest_max"] < v["notify_senders_max"]),
    ("a notice's backoff starts below its cap, within its retry time", "notify_backoff_s_base",
     lambda v: v["notify_backoff_s_base"] <= v["notify_backoff_s_max"] <= v["notify_retry_s_max"]),
    ("`job wait`'s backoff starts below its cap", "cli_wait_backoff_s_base",
     lambda v: v["cli_wait_backoff_s_base"] <= v["cli_wait_backoff_s_max"]),
    ("a page of jobs by default is no larger than the largest", "jobs_list_default",
     lambda v: v["jobs_list_default"] <= v["jobs_list_max"]),
    ("a history read by default is no larger than the largest", "history_read_default",
     lambda v: v["history_read_default"] <= v["history_read_max"]),
    ("history keeps by default no more files than it may", "history_keep_files",
     lambda v: v["history_keep_files"] <= v["history_keep_files_max"]),
    ("one F_JOB_STATE frame's entries fit the ring that catches workers up", "state_entries_max",
     lambda v: v["state_entries_max"] <= v["state_ring_entries_max"]),
    ("a watcher's change feed is not given up between two keep-alives", "events_keepalive_s",
     lambda v: v["watch_feed_read_s"] > 2 * v["events_keepalive_s"]),
    ("one answer of changes fits the ring it resumes from", "events_answer_max",
     lambda v: v["events_answer_max"] <= v["events_ring_changes_max"]),
    ("the fewest HTTP connections are no more than the most", "http_conns_min",
     lambda v: v["http_conns_min"] <= v["http_conns_max"]),
    ("one identity's sessions are no more than all sessions", "http_sessions_per_identity_max",
     lambda v: 1 <= v["http_sessions_per_identity_max"] <= v["http_sessions_max"]),
    ("a login body is no larger than any body", "http_login_body_bytes_max",
     lambda v: v["http_login_body_bytes_max"] <= v["http_body_bytes_max"]),
    ("a failed item's stderr tail is within what is read of it", "status_stderr_bytes_max",
     lambda v: v["status_stderr_bytes_max"] <= v["status_stderr_read_bytes_max"]),
    ("the links loop runs its timers more often than it pings", "link_tick_s",
     lambda v: v["link_tick_s"] * 1000 < v["link_idle_ms"]),
    ("a joining worker tries more than once before it gives up", "join_retry_s",
     lambda v: v["join_retry_s"] < v["join_s_max"]),
    ("a job page's items are no more than one read of a page answers", "webui_items_shown_max",
     lambda v: v["webui_items_shown_max"] <= v["items_page_max"]),
    ("a job page's failed items are no more than one read of a page answers",
     "status_items_shown_max", lambda v: v["status_items_shown_max"] <= v["items_page_max"]),
    ("a slice of output digests (32 bytes and room for each) fits one frame", "results_slice_max",
     lambda v: v["results_slice_max"] * 40 + v["frame_part_room_bytes"] <= v["frame_bytes_max"]),
    ("a result's copies are no more than the holders its row names", "blob_copies",
     lambda v: 1 <= v["blob_copies"] <= v["result_holders_max"]),
    ("the shortest restart delay is within the longest", "restart_delay_s_min",
     lambda v: 0 < v["restart_delay_s_min"] <= v["restart_delay_s_max"]),
    ("the cap of a minute's restarts binds before the shortest delay does",
     "restarts_per_minute_max",
     lambda v: 1 <= v["restarts_per_minute_max"]
     < v["restarts_window_ms"] / (v["restart_delay_s_min"] * 1000)),
    ("a log of running processes starts anew well before it is too large to be read",
     "leftover_log_bytes_max",
     lambda v: 4 * v["leftover_log_bytes_max"] <= v["leftover_file_bytes_max"]),
    ("the wall's rules, an item's argv and its environment fit one exec together",
     "wall_rules_bytes_max",
     lambda v: v["wall_rules_bytes_max"] + v["argv_bytes_max"] + v["env_bytes_max"]
     + 64 * 1024 <= v["exec_args_bytes_max"]),
)


def broken(values: dict[str, Any]) -> list[str]:
    """What each relation of `values` (this module's, or a copy) that does not hold says."""
    return [says for says, _grown, holds in RELATIONS if not holds(values)]


_broken = broken(globals())
if _broken:  # not `assert`: python -O must not start with limits that contradict each other
    raise AssertionError("meshjobs.limits contradict each other: " + "; ".join(_broken))
del _broken
