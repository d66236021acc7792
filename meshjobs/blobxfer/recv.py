"""The receiving half of the blob transfer protocol: blobs being assembled chunk by chunk,
small blobs staged to be kept together, acknowledgements once the store said they are
durable."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import blake3

from blobstore.digest import is_digest
from meshjobs.blobxfer.wire import (
    ACK_DIGESTS,
    Action,
    AsmKey,
    Found,
    Keep,
    KeepBatch,
    Source,
    SpoolWrite,
    Staged,
    Tally,
    Unspool,
    XferLimits,
    ack,
    owner_ok,
)


class _Assembly:
    """One blob being received from one peer."""

    __slots__ = ("peer", "d", "owner", "get", "size", "off", "hasher", "skip", "spooled",
                 "last_ms")

    def __init__(self, peer: str, d: str, owner: str | None, get: bool, size: int,
                 now: float) -> None:
        self.peer = peer
        self.d = d
        self.owner = owner
        self.get = get
        self.size = size
        self.off = 0
        self.hasher = blake3.blake3()
        self.skip = False  # the store already holds the blob: the data is not kept
        self.spooled = False  # a SpoolWrite was asked for it (its spool may exist)
        self.last_ms = now


@dataclass
class _Batch:
    blobs: list[Staged] = field(default_factory=list)
    keys: set[tuple[str, str, str | None, bool]] = field(default_factory=set)
    bytes: int = 0


class Receiver:
    """Blobs in: assemblies of chunks, small blobs staged and kept together, acknowledgements
    once durable."""

    def __init__(self, src: Source, lim: XferLimits, tally: Tally, log: Any) -> None:
        self.src = src
        self.lim = lim
        self.tally = tally
        self.log = log
        self.asm: dict[AsmKey, _Assembly] = {}
        self._batch = _Batch()
        self._tickets = 0
        self._pending: dict[int, list[Staged]] = {}

    def pack(self, peer: str, body: dict, now: float) -> list[Action]:
        """Whole blobs of one chunk each, `[d, o, data]`: each is taken as a chunk at offset 0
        that is also its last."""
        blobs = body.get("blobs")
        if not isinstance(blobs, list) or len(body) != 1:
            self.tally.drop("bad_body")
            return []
        actions: list[Action] = []
        for entry in blobs:
            if not isinstance(entry, list | tuple) or len(entry) != 3:
                self.tally.drop("bad_body")
                continue
            d, owner, data = entry
            actions += self.chunk(peer, {"d": d, "o": owner,
                                         "size": len(data) if isinstance(data, bytes) else None,
                                         "off": 0, "data": data, "last": True}, now)
        return actions

    def in_order(self, asm: _Assembly | None, off: int, size: int, owner: object,
                 get: bool) -> bool:
        """A chunk past the first follows on its assembly: same blob, owner and purpose, at the
        offset where the assembly ends."""
        return not (asm is None or asm.off != off or asm.size != size or asm.owner != owner
                    or asm.get != get)

    def chunk(self, peer: str, b: dict, now: float) -> list[Action]:
        d, size, off, data, last = (b.get(k) for k in ("d", "size", "off", "data", "last"))
        owner, get = b.get("o"), b.get("get", False)
        if not is_digest(d):
            self.tally.drop("bad_body")
            return []
        key = (peer, d)
        if not (type(size) is int and type(off) is int and isinstance(data, bytes)
                and type(last) is bool and type(get) is bool
                and owner_ok(owner, self.lim.owner_bytes_max)):
            return self._garbage(key, "bad_body")
        if size > self.lim.assembly_bytes_max:
            return self._garbage(key, "too_large")
        end = off + len(data)
        if (size < 0 or off < 0 or len(data) > self.lim.frame_bytes or end > size
                or last != (end == size) or (not last and not data)):
            return self._garbage(key, "bad_offset")
        actions: list[Action] = []
        asm = self.asm.get(key)
        if off == 0:
            if asm is not None:
                # A new transfer of the same blob: the earlier one was cut short.
                actions += self._close(key)
            skip = self.src.has(d)
            if get and not skip and not self.src.wanted(d):
                # Nobody waits for it any more (the fetch timed out).
                self.tally.drop("unasked")
                return actions
            if last:
                return actions + self._stage(Staged(peer, d, owner, get, data, skip))
            if len(self.asm) >= self.lim.assemblies_max:
                self.tally.drop("assemblies_full")
                return actions
            asm = self.asm[key] = _Assembly(peer, d, owner, get, size, now)
            # A blob already held is acknowledged at its last chunk without keeping its bytes.
            asm.skip = skip
        elif not self.in_order(asm, off, size, owner, get):
            return self._garbage(key, "out_of_order")
        assert asm is not None
        self.tally.count("chunks_received")
        asm.last_ms = now
        if not asm.skip:
            actions.append(SpoolWrite(key, d, off, data))
            asm.spooled = True
            asm.hasher.update(data)
        asm.off = end
        if last:
            actions += self._finish(key, asm)
        return actions

    def spool_failed(self, key: AsmKey) -> list[Action]:
        """Writing to the spool of `key` failed (the executor said why)."""
        return self._garbage(key, "spool_failed")

    def _stage(self, blob: Staged) -> list[Action]:
        """A whole blob of one chunk: checked now, kept with the rest of the turn's."""
        if blake3.blake3(blob.data).hexdigest() != blob.d:
            self.log.warning("blob_digest_mismatch", digest=blob.d, peer=blob.peer)
            self.tally.drop("digest_mismatch")
            return []
        self.tally.count("chunks_received")
        key = (blob.peer, blob.d, blob.owner, blob.get)
        batch = self._batch
        if key in batch.keys:
            return []  # sent twice in one turn: stored and acknowledged once
        batch.keys.add(key)
        batch.blobs.append(blob)
        batch.bytes += len(blob.data)
        if len(batch.blobs) >= self.lim.batch_blobs_max or batch.bytes >= self.lim.batch_bytes_max:
            return self.end_turn()
        return []

    def end_turn(self) -> list[Action]:
        """The staged blobs, to be kept in one transaction and one sync."""
        blobs = self._batch.blobs
        if not blobs:
            return []
        self._batch = _Batch()
        self._tickets += 1
        self._pending[self._tickets] = blobs
        return [KeepBatch(blobs, self._tickets)]

    def batch_kept(self, ticket: int, results: list[str | Exception] | None) -> list[Action]:
        """The store kept a batch (`results`: per blob, the digest it returned or the error) or
        failed it whole (None): acknowledge what is durable, one frame per peer and owner, and
        answer its fetches."""
        batch = self._pending.pop(ticket)
        if results is None:
            self.tally.drop("store_failed", len(batch))
            return []
        if len(results) != len(batch):
            raise AssertionError(f"the store answered {len(results)} of a batch of {len(batch)}")
        acks: dict[tuple[str, str | None], list[str]] = {}
        stored: set[str] = set()
        new = 0
        for b, r in zip(batch, results, strict=True):
            if isinstance(r, Exception):
                self.log.error("blob_store_failed", digest=b.d, peer=b.peer, error=str(r))
                self.tally.drop("store_failed")
                continue
            if r != b.d:
                # The bytes were checked before the batch: the store kept something else.
                self.log.error("blob_digest_mismatch", digest=b.d, stored=r, peer=b.peer)
                self.tally.drop("digest_mismatch")
                continue
            new += not b.held
            stored.add(b.d)
            acks.setdefault((b.peer, b.owner), []).append(b.d)
        self.tally.count("blobs_received", new)
        actions: list[Action] = [Found(d) for d in sorted(stored)]
        if self.asm:
            # Other transfers of the same blobs need not keep their bytes any more.
            actions += self._skip_others(stored)
        for (peer, owner), digests in acks.items():
            for i in range(0, len(digests), ACK_DIGESTS):
                actions.append(ack(peer, owner, digests[i:i + ACK_DIGESTS]))
        return actions

    def _finish(self, key: AsmKey, asm: _Assembly) -> list[Action]:
        """The last chunk arrived: check the bytes, then have the blob kept (and pinned)."""
        if not asm.skip and asm.hasher.hexdigest() != asm.d:
            self.log.warning("blob_digest_mismatch", digest=asm.d, peer=asm.peer)
            return self._garbage(key, "digest_mismatch")
        return [Keep(key, asm.d, asm.owner, spooled=not asm.skip)]

    def kept(self, act: Keep, got: str | Exception | None, held: bool | Exception | None
             ) -> list[Action]:
        """The executor of `act` stored the spool (`got`: the digest the store returned, or
        the error; None when not spooled) and then pinned it and looked it up (`held`; None
        when storing failed)."""
        asm = self.asm.get(act.key)
        assert asm is not None and asm.d == act.d, f"kept an assembly that is gone: {act}"
        asm.spooled = False  # the executor of a Keep removes the spool
        if act.spooled:
            if isinstance(got, Exception):
                self.log.error("blob_store_failed", digest=act.d, peer=asm.peer, error=str(got))
                return self._garbage(act.key, "store_failed")
            if got != act.d:
                # The spool file changed after it was hashed: its bytes are not the blob.
                self.log.error("blob_digest_mismatch", digest=act.d, stored=got, peer=asm.peer)
                return self._garbage(act.key, "digest_mismatch")
            self.tally.count("blobs_received")
        actions = self._close(act.key)
        if isinstance(held, Exception):
            self.log.error("blob_store_failed", digest=act.d, peer=asm.peer, error=str(held))
            self.tally.drop("store_failed")
            return actions
        if not held:
            # It was collected between its first chunk and its pin; the sender asks again.
            self.tally.drop("gone")
            return actions
        actions += self._skip_others({act.d})
        actions.append(ack(asm.peer, asm.owner, [act.d]))
        actions.append(Found(act.d))
        return actions

    def _skip_others(self, stored: set[str]) -> list[Action]:
        """Other transfers of blobs now stored need not keep their bytes any more."""
        actions: list[Action] = []
        for key, other in list(self.asm.items()):
            if other.d in stored and not other.skip:
                if other.spooled:
                    actions.append(Unspool(key))
                    other.spooled = False
                other.skip = True
        return actions

    def expire(self, now: float) -> list[Action]:
        actions: list[Action] = []
        for key, asm in list(self.asm.items()):
            if now - asm.last_ms > self.lim.assembly_idle_ms:
                self.log.info("blob_assembly_stale", digest=asm.d, peer=asm.peer,
                              received=asm.off, size=asm.size)
                actions += self._garbage(key, "stale")
        return actions

    def _garbage(self, key: AsmKey, reason: str) -> list[Action]:
        """Remote garbage or a failed assembly: drop the blob's assembly and count why."""
        actions = self._close(key)
        self.tally.drop(reason)
        return actions

    def _close(self, key: AsmKey) -> list[Action]:
        asm = self.asm.pop(key, None)
        return [Unspool(key)] if asm is not None and asm.spooled else []
