"""The simulator running blob copies through the real transfer protocol (SimConfig.xfer): the
members' `blobxfer.Transfer`s exchange their frames over the lossy network (lost, late, cut by
partitions and crashes), and the simulator checks what they ask of their stores. Planted
receivers show that its checks catch a protocol that writes a chunk at the wrong offset or
acknowledges a blob before it is durable."""

from __future__ import annotations

from dataclasses import replace

import pytest

from meshjobs.blobxfer import Action, Receiver, ack
from meshjobs.sim import SimConfig, SimFailure, run

XFER = SimConfig(xfer=True)
FIXED_SEEDS = (1, 2, 3, 5, 8)


@pytest.mark.parametrize("seed", FIXED_SEEDS)
def test_copies_through_the_protocol_safe_and_live(seed: int) -> None:
    """Safety under faults, then liveness once healed, with every copy of a blob with bytes
    made by the protocol: the copies complete and every committed result's blobs are on
    blob_copies members (the simulator's own checks)."""
    c = run(seed, XFER).counts
    assert c.get("xfer_copies", 0) > 0 and c.get("copies_done", 0) > 0, (seed, c)
    assert c.get("xframes_sent", 0) > 0 and c.get("results_accepted", 0) > 0, (seed, c)


def test_copies_through_the_protocol_under_harsh_faults() -> None:
    """More loss, lateness, partitions and crashes: still safe, and live once healed."""
    harsh = replace(XFER, steps=4000, crash=0.006, partition=0.008, frame_drop=0.15,
                    frame_late=0.1)
    c = run(4, harsh).counts
    assert c.get("xframes_dropped", 0) > 0 and c.get("copies_done", 0) > 0, c


def test_copies_through_the_protocol_replay() -> None:
    """Rule 1 of the simulator: with the protocol in, one seed still gives one report."""
    assert run(6, XFER) == run(6, XFER)


def test_protocol_off_draws_nothing() -> None:
    """Without `xfer` the simulator draws what it drew before: recorded seeds replay."""
    plain = run(5)
    assert "xfer_copies" not in plain.counts and plain.counts.get("copies_done", 0) > 0


class AnyOffsetReceiver(Receiver):
    """Planted bug: a chunk past the first is taken wherever it says it goes (a receiver that
    does not check that it follows on its assembly)."""

    def in_order(self, asm, off, size, owner, get) -> bool:  # noqa: ANN001
        return asm is not None


class EarlyAckReceiver(Receiver):
    """Planted bug: a blob is acknowledged at its last chunk, before the store kept it."""

    def _finish(self, key, asm) -> list[Action]:  # noqa: ANN001
        return [ack(asm.peer, asm.owner, [asm.d]), *super()._finish(key, asm)]


def caught(receiver_cls: type[Receiver], *words: str) -> str:
    """The first failure, on seeds 1 to 8, naming its seed and one of `words`."""
    quick = replace(XFER, liveness_ms_max=1_000)
    for seed in range(1, 9):
        try:
            run(seed, quick, receiver_cls=receiver_cls)
        except SimFailure as e:
            msg = str(e)
            assert msg.startswith(f"seed={seed} "), msg
            if any(w in msg for w in words):
                return msg
    raise AssertionError(f"no seed caught {receiver_cls.__name__}")


def test_planted_chunk_at_wrong_offset_is_caught() -> None:
    """A receiver that accepts a chunk that does not follow on (after a lost frame) writes it
    past the end of its spool: the simulator stops it and names the seed."""
    assert "at offset" in caught(AnyOffsetReceiver, "at offset")


def test_planted_ack_before_keeping_is_caught() -> None:
    """A receiver that acknowledges before the blob is durable is caught."""
    assert "before it was durable" in caught(EarlyAckReceiver, "before it was durable")
