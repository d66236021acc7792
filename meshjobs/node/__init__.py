"""The job node (pure): events in, effects out. See `core.py` for its theory of operation."""

from meshjobs.node.core import JobNode
from meshjobs.node.events import (
    Applied,
    BlobBytes,
    BlobsCopied,
    CopyBlobs,
    Ctl,
    Cut,
    DiskFull,
    DumpReady,
    FetchBlobs,
    FrameIn,
    ItemEnded,
    NodeConfig,
    PeerLink,
    Pin,
    Pool,
    Pressure,
    Propose,
    Reply,
    Run,
    Send,
    SendDump,
    Tick,
    Unpin,
    UnpinAllBut,
    View,
    WantDump,
    spec_digest,
)
from meshjobs.node.members import Member
from meshjobs.node.ready import Ready, advance, dispatch, ignore, run_round

__all__ = [
    "Applied", "BlobBytes", "BlobsCopied", "CopyBlobs", "Ctl", "Cut", "DiskFull", "DumpReady", "FetchBlobs", "FrameIn", "ItemEnded", "JobNode",
    "Member", "NodeConfig", "PeerLink", "Pin", "Pool", "Pressure", "Propose", "Ready", "Reply",
    "Run", "Send", "SendDump", "Tick", "Unpin", "UnpinAllBut", "View", "WantDump", "advance", "dispatch", "ignore", "run_round",
    "spec_digest",
]
