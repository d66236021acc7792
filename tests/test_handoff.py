"""Hand-offs between the HTTP thread and the jobs thread: how many wake-ups they cost, and that
none is lost.

- meshjobs.http.Handoff: a round's answers reach the event loop with one wake-up, each waiter
  with its own answer; a cancelled or failed control future is a 503 or its error.
- JobsThread._wake: requests queued while a wake-up is on its way add no write to the
  notifier; a request queued after a round took its events wakes the thread again.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import random
import sys
import threading
import time

import pytest

from meshjobs import http
from meshjobs.control import Answer
from meshjobs.jobsd import JobsThread
from meshjobs.node import JobNode, NodeConfig
from meshjobs.replica import WorkerReplica
from meshjobs.table import JobTable

WAIT_S = 30.0


def _waiters(loop, handoff, futs):
    waiters = []
    for f in futs:
        w = loop.create_future()
        f.add_done_callback(functools.partial(handoff.put, loop, w))
        waiters.append(w)
    return waiters


def test_one_wakeup_for_a_rounds_answers() -> None:
    """Answers given together (one round of the jobs thread) wake the loop once, and each
    waiter gets the answer of its own request, in order."""
    loop = asyncio.new_event_loop()
    handoff = http.Handoff()
    futs = [concurrent.futures.Future() for _ in range(50)]

    async def main() -> list:
        waiters = _waiters(loop, handoff, futs)
        t = threading.Thread(target=lambda: [f.set_result(Answer(200, {"i": i}))
                                             for i, f in enumerate(futs)])
        t.start()
        t.join()  # the loop is held while all 50 are answered: they are one batch
        return await asyncio.wait_for(asyncio.gather(*waiters), WAIT_S)

    try:
        answers = loop.run_until_complete(main())
    finally:
        loop.close()
    assert [a.body["i"] for a in answers] == list(range(50))
    assert handoff.wakeups == 1


def test_cancelled_failed_and_abandoned() -> None:
    """A cancelled control future is a 503 ("member busy"), a failed one its own error, and a
    waiter already done (timed out, or its request cancelled) is left alone."""
    loop = asyncio.new_event_loop()
    handoff = http.Handoff()
    cancelled, failed, abandoned, fine = (concurrent.futures.Future() for _ in range(4))

    async def main() -> tuple:
        w_cancel, w_fail, w_gone, w_fine = _waiters(loop, handoff,
                                                    [cancelled, failed, abandoned, fine])
        w_gone.cancel()
        cancelled.cancel()
        failed.set_exception(KeyError("boom"))
        abandoned.set_result(Answer(200, {}))
        fine.set_result(Answer(201, {"ok": True}))
        done = await asyncio.wait_for(asyncio.gather(w_cancel, w_fail, w_fine,
                                                     return_exceptions=True), WAIT_S)
        return done, w_gone.cancelled()

    try:
        (e_cancel, e_fail, ok), gone_cancelled = loop.run_until_complete(main())
    finally:
        loop.close()
    assert isinstance(e_cancel, http.HttpError) and e_cancel.status == 503
    assert "member busy" in e_cancel.message
    assert isinstance(e_fail, KeyError)
    assert ok == Answer(201, {"ok": True})
    assert gone_cancelled


def test_no_answer_lost_when_answers_race_the_drain() -> None:
    """Answers given one by one from several threads while the loop drains: every waiter is
    answered (none stranded by a drain that had just looked)."""
    loop = asyncio.new_event_loop()
    handoff = http.Handoff()
    futs = [concurrent.futures.Future() for _ in range(2000)]
    rng = random.Random(7)
    order = list(range(len(futs)))
    rng.shuffle(order)

    def answer(part: list[int]) -> None:
        for n, i in enumerate(part):
            futs[i].set_result(Answer(200, {"i": i}))
            if n % 7 == 0:
                time.sleep(0)  # sleep-ok: yields the GIL, so that answers interleave

    async def main() -> list:
        waiters = _waiters(loop, handoff, futs)
        threads = [threading.Thread(target=answer, args=(order[k::4],)) for k in range(4)]
        for t in threads:
            t.start()
        try:
            return await asyncio.wait_for(asyncio.gather(*waiters), WAIT_S)
        finally:
            for t in threads:
                t.join()

    try:
        answers = loop.run_until_complete(main())
    finally:
        loop.close()
    assert [a.body["i"] for a in answers] == list(range(len(futs)))
    assert 1 <= handoff.wakeups <= len(futs)


class CountingReplica(WorkerReplica):
    """A worker member's replica that counts the wake-ups written to its pipe, and whose wait
    lasts until one comes (no timer cuts it short): a missed wake-up strands a request for
    longer than any test waits, instead of for one publish period."""

    def __init__(self) -> None:
        super().__init__()
        self.notifies = 0

    def notify(self) -> None:
        self.notifies += 1
        super().notify()

    def wait(self, timeout_s: float) -> None:
        super().wait(10 * WAIT_S)


def _worker_thread() -> tuple[JobsThread, CountingReplica]:
    node = JobNode(JobTable(), NodeConfig(member="w1", boot="b", role="worker",
                                          voters={"m1": "x"}), random.Random(1))
    replica = CountingReplica()
    return JobsThread(node, replica, driver=None, blobs=_NoBlobs()), replica


class _NoBlobs:
    """A worker member with an empty blob store (the thread only asks how many bytes)."""

    def stats(self) -> dict:
        return {"bytes": 0}


def test_requests_queued_together_wake_the_jobs_thread_once() -> None:
    """Requests queued while a wake-up is due add no write to the pipe; all are answered by the
    round it wakes; a request after that round wakes the thread again."""
    jobs, replica = _worker_thread()
    futs = [jobs.call({"op": "get", "id": f"j{i}"}) for i in range(5)]
    assert replica.notifies == 1
    t = threading.Thread(target=jobs.run, name="jobs")
    t.start()
    try:
        answers = [f.result(WAIT_S) for f in futs]
        assert [a.status for a in answers] == [503] * 5  # a worker that knows no leader yet
        later = jobs.call({"op": "get", "id": "j9"})
        assert later.result(WAIT_S).status == 503
        assert replica.notifies == 2
    finally:
        jobs.stop()
        t.join(WAIT_S)
        replica.close()
    assert not t.is_alive()


@pytest.mark.parametrize("threads", [1, 4])
def test_no_request_stranded_without_a_wakeup(threads: int) -> None:
    """Requests from several threads while the jobs thread runs rounds: every one is answered
    (none waits for a wake-up that was skipped because another seemed due)."""
    jobs, replica = _worker_thread()
    t = threading.Thread(target=jobs.run, name="jobs")
    # Threads switch as often as the interpreter allows, so that a request comes in at every
    # point of a round, and between a round's last step and its wait.
    switch_s = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    t.start()
    futs: list[concurrent.futures.Future] = []
    lock = threading.Lock()

    def ask(k: int) -> None:
        for i in range(300):
            f = jobs.call({"op": "get", "id": f"j{k}-{i}"})
            with lock:
                futs.append(f)
            if i % 5 == 0:
                f.result(WAIT_S)  # a pause: the jobs thread goes back to waiting

    try:
        askers = [threading.Thread(target=ask, args=(k,)) for k in range(threads)]
        for a in askers:
            a.start()
        for a in askers:
            a.join(WAIT_S)
        assert all(f.result(WAIT_S).status == 503 for f in futs)
        assert len(futs) == 300 * threads
        assert replica.notifies <= len(futs)
    finally:
        sys.setswitchinterval(switch_s)
        jobs.stop()
        t.join(WAIT_S)
        replica.close()
