"""A part of the job node: what this member's own storage says of it.

Theory of operation. The edge tells the node when its blob store holds more payload bytes in
memory than it may (`Pressure`), when its disk is full or has room again (`DiskFull`), and how
many payload bytes its blob store holds (`BlobBytes`). While either pressure or a full disk is
on, this member takes no new leases (`takes_no_work`); while its disk is full it is read-only:
it takes no submits either, and says so in its health. The node reports all of it to the
leader (F_JOB_HAVE) and in its fleet view and metrics.

Rule: pure, like the rest of the node; it owns these four facts and is given the node's counter.
"""

from __future__ import annotations

from collections.abc import Callable

from meshjobs.node.events import BlobBytes, DiskFull, Pressure


class Storage:
    """Blob memory pressure, a full disk (and the bytes free), and the blob store's bytes."""

    def __init__(self, count: Callable[[str], None]) -> None:
        self._count = count
        self.pressure = False
        self.disk_full = False  # read-only: no leases, no submits (DiskFull)
        self.disk_free = 0
        self.blob_bytes = 0

    def on_pressure(self, ev: Pressure) -> None:
        self.pressure = ev.on
        self._count("pressure_on" if ev.on else "pressure_off")

    def on_disk_full(self, ev: DiskFull) -> None:
        if ev.on != self.disk_full:
            self._count("disk_full_on" if ev.on else "disk_full_off")
        self.disk_full, self.disk_free = ev.on, ev.free_bytes

    def on_blob_bytes(self, ev: BlobBytes) -> None:
        self.blob_bytes = ev.n

    def takes_no_work(self) -> bool:
        """Blob memory pressure or a full disk: this member takes no new leases."""
        return self.pressure or self.disk_full
