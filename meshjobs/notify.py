"""Finish hooks at the edge: POST a job's final record to its `--notify` URL.

The jobs thread hands a notice over with `offer`, which never blocks: a bounded queue, and a
notice that finds it full is dropped (counted, and said in the log). One sender thread (started
by the daemon, like every thread) POSTs each notice as JSON with an `Idempotency-Key` header
(the job id and its version: the same for a repeat of one notice, as a new leader sends after a
failover) and retries one the receiver refuses or does not answer (any status but 2xx, or no
answer within `notify_timeout_s`) with a doubling backoff, for at most `notify_retry_s_max`.
Notices waiting for a retry count against the same bound. Redirects are not followed.
"""

from __future__ import annotations

import heapq
import itertools
import json
import queue
import threading
import time
import urllib.error
import urllib.request
from typing import Any

import structlog

from meshjobs import limits

log = structlog.get_logger(__name__)


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, req, fp, code, msg, headers, newurl):  # noqa: ANN001
        return None  # a 3xx is a refusal like any other: retried, never followed


def _body(record: dict) -> bytes:
    body = json.dumps(record, separators=(",", ":")).encode()
    if len(body) > limits.notify_body_bytes_max:
        slim = {k: v for k, v in record.items() if k not in ("argv", "env")}
        slim["truncated"] = True
        body = json.dumps(slim, separators=(",", ":")).encode()
    if len(body) > limits.notify_body_bytes_max:
        # Still too long (huge tags?): what a receiver needs to look the job up itself.
        body = json.dumps({k: record.get(k) for k in ("id", "state", "version", "finished_at")}
                          | {"truncated": True}, separators=(",", ":")).encode()
    return body


class Notifier:
    """A bounded queue of finish notices and the loop of the one thread that sends them."""

    def __init__(self, member: str, clock: Any = time.monotonic) -> None:
        self.member = member
        self._clock = clock
        self._q: queue.Queue = queue.Queue(maxsize=limits.notify_queue_max)
        self._stop = threading.Event()
        self._opener = urllib.request.build_opener(_NoRedirect)
        self._seq = itertools.count()
        self.sent = 0
        self.retried = 0
        self.dropped = 0
        self.given_up = 0

    def offer(self, url: str, key: str, record: dict) -> bool:
        """Queue a notice (never blocks); False when the queue is full and it was dropped."""
        try:
            self._q.put_nowait((url, key, record))
            return True
        except queue.Full:
            self.dropped += 1
            log.warning("notify_dropped", key=key, url=url[:200], queue_max=limits.notify_queue_max,
                        why="the queue of finish notices is full (a slow or dead receiver?)")
            return False

    def stop(self) -> None:
        self._stop.set()
        try:
            self._q.put_nowait(None)
        except queue.Full:
            pass

    def numbers(self) -> dict[str, int]:
        return {"notify_sent": self.sent, "notify_retried": self.retried,
                "notify_dropped": self.dropped, "notify_given_up": self.given_up}

    def run(self) -> None:
        # Retries: (when due, seq, url, key, body, first try, tries), soonest first.
        waiting: list[tuple[float, int, str, str, bytes, float, int]] = []
        while not self._stop.is_set():
            now = self._clock()
            timeout = max(0.0, waiting[0][0] - now) if waiting else 1.0
            got = None
            if not waiting or timeout > 0:
                try:
                    got = self._q.get(timeout=min(timeout, 1.0))
                except queue.Empty:
                    got = None
            if self._stop.is_set():
                return
            if got is not None:
                url, key, record = got
                self._try(waiting, url, key, _body(record), self._clock(), 0)
                continue
            if waiting and waiting[0][0] <= self._clock():
                _due, _s, url, key, body, first, tries = heapq.heappop(waiting)
                self._try(waiting, url, key, body, first, tries)

    def _try(self, waiting: list, url: str, key: str, body: bytes, first: float, tries: int) -> None:
        why = self._post(url, key, body)
        if why is None:
            self.sent += 1
            log.info("notify_sent", key=key, url=url[:200], tries=tries + 1)
            return
        now = self._clock()
        delay = min(limits.notify_backoff_s_base * 2 ** tries, limits.notify_backoff_s_max)
        if now + delay - first > limits.notify_retry_s_max:
            self.given_up += 1
            log.warning("notify_given_up", key=key, url=url[:200], tries=tries + 1, why=why)
            return
        if len(waiting) + self._q.qsize() >= limits.notify_queue_max:
            self.dropped += 1
            log.warning("notify_dropped", key=key, url=url[:200], why="retries fill the queue")
            return
        self.retried += 1
        log.info("notify_retry", key=key, url=url[:200], in_s=delay, why=why)
        heapq.heappush(waiting, (now + delay, next(self._seq), url, key, body, first, tries + 1))

    def _post(self, url: str, key: str, body: bytes) -> str | None:
        """POST once; None when the receiver took it (2xx), else why not."""
        req = urllib.request.Request(url, data=body, method="POST", headers={
            "Content-Type": "application/json", "Idempotency-Key": key,
            "User-Agent": "meshjobs-notify", "X-Meshjobs-Member": self.member})
        try:
            with self._opener.open(req, timeout=limits.notify_timeout_s) as resp:
                resp.read(limits.notify_answer_bytes_max)
                if 200 <= resp.status < 300:
                    return None
                return f"status {resp.status}"
        except urllib.error.HTTPError as e:
            return f"status {e.code}"
        except (OSError, ValueError) as e:
            return f"{type(e).__name__}: {e}"[:200]
