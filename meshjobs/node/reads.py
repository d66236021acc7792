"""Reads of a job's items that cost the jobs thread what they return, not what the job holds.

A job may have a million items; the records of all of them (`record(job, items=True)`) are a
million dicts, seconds of the jobs thread and gigabytes of memory. What concerns one item, a
page of items or a slice of their outputs is answered here from the table's per-item arrays:

- `item`: one item's record (what `GET /jobs/{id}/items/{n}/stdout` follows);
- `items`: the job's record with a page of its item records and its first failed items (the
  job page: a page of items, the failed ones explained, the counts);
- `outputs`: a slice of its items' output digests, as the table holds them (raw 32 bytes, or
  None), for a results download that asks slice after slice.

The control requests are checked by control.parse_item_read.
"""

from __future__ import annotations

from typing import Any

from meshjobs import waits
from meshjobs.table import FAILED, TIMEOUT, JobTable

# Item records built for answers: the job node counts them (node_item_records_built), so that
# what a read costs the jobs thread can be seen from outside.
Built = int


def answer(table: JobTable, job: Any, req: dict, now_ms: int) -> tuple[int, Any, Built]:
    """(status, body, item records built) of an item read of `job` (a job the table holds)."""
    op = req["op"]
    if op == "item":
        i = req["index"]
        if i >= job.n:
            return 404, {"error": no_item(job.id, job.n, i)}, 0
        return 200, table.item_record(job, i), 1
    if op == "items":
        lo = req["from"]
        hi = min(job.n, lo + req["limit"])
        rec = table.record(job)
        rec.update(waits.fields(table, job, now_ms))  # why its pending items wait
        rec["items"] = [table.item_record(job, i) for i in range(lo, hi)]
        rec["items_from"] = lo
        failed = first_failed(job, req["failed"])
        rec["failed_items"] = [table.item_record(job, i) for i in failed]
        if job.names is not None:
            # The page shows each item's input file name: these items' names only, never the
            # whole list of a big job.
            for it in (*rec["items"], *rec["failed_items"]):
                it["name"] = job.names[it["index"]]
        return 200, rec, len(rec["items"]) + len(failed)
    lo = req["from"]
    column = job.out if req["stream"] == "stdout" else job.err
    return 200, {"n": job.n, "from": lo, "version": job.version,
                 "digests": column[lo:lo + req["limit"]]}, 0


def first_failed(job: Any, k: int) -> list[int]:
    """The indices of the first `k` items of `job` that failed or timed out, in order: found in
    the job's state bytes (a C-level search), not by looking at each item."""
    if k <= 0 or not job.n_failed:
        return []
    st = job.st
    out: list[int] = []
    a, b = st.find(FAILED), st.find(TIMEOUT)
    while len(out) < k and (a >= 0 or b >= 0):
        if b < 0 or 0 <= a < b:
            out.append(a)
            a = st.find(FAILED, a + 1)
        else:
            out.append(b)
            b = st.find(TIMEOUT, b + 1)
    return out


def no_item(job_id: str, n: int, i: int) -> str:
    have = "1 item (0)" if n == 1 else f"{n} items, numbered from 0"
    return f"job {job_id} has {have}: no item {i}"
