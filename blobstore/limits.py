"""Every limit of the blob store, named in one place, with its unit last.

The blob store is its own package and imports nothing of meshjobs, so its limits live here and
meshjobs/limits.py points to this file instead of repeating them.
"""

from __future__ import annotations

chunk_bytes = 1 << 20  # a new store cuts payloads into chunks of this size; a store keeps its own
txn_payload_bytes_max = 32 << 20  # payload bytes one streaming write transaction holds in memory
map_bytes_initial = 1 << 30  # the LMDB map starts this large
map_bytes_max = 1 << 40  # and doubles when full, but never grows past this
map_growth_slack_bytes = 1 << 20  # room added on top of what a transaction that did not fit needs
readers_max = 126  # LMDB reader slots: more than the threads that read at once
dbs_max = 8  # named LMDB databases (six are used)
owner_bytes_max = 256  # a pin owner's name, UTF-8 (LMDB keys are at most 511 bytes)
batch_blobs_max = 4096  # blobs one collect transaction, verify read or writers' batch holds
batch_pins_max = 65_536  # pins one unpin_owner transaction removes
batch_bytes_max = 16 << 20  # payload bytes in one writers' batch (a larger payload goes alone)
queue_items_max = 65_536  # payloads queued for the blob writers before a put raises StoreBusy
writer_threads = 3  # blob writer threads, each writing and syncing one batch at a time
