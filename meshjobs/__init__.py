"""meshjobs: a fault-tolerant, Raft-replicated job service (meshd, meshctl, HTTP)."""

__version__ = "0.1.0"
