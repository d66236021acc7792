"""What one round of the job node asks of its edge, and the one order in which the edge does it.

Theory of operation (etcd raft's `Ready`/`Advance`). The node is stepped with a round's events;
then `JobNode.ready()` hands over a `Ready`: the entries to append to the log, the effects that
acknowledge nothing and may leave at once, and the effects that must wait for the sync. `advance`
is the round's second half, shared by every edge that drives a node (the jobs thread, the
simulator, the node tests):

1. `persist` each entry: it enters the log, written but perhaps not yet durable;
2. `release` the effects of `at_once`;
3. `sync`: one fsync that covers everything logged so far (the edge decides whether anything
   was written since the last one; pysyncobj may have logged a leader's entries too);
4. `release` the effects of `after_sync`: items to cut first, then items to run (so that a
   member's processes start while its answers and frames go out, and an item cut to make room
   is on its way out before the item that takes its slot starts), then the rest in order.

The gate is a type, not a habit: an effect is `at_once` only when its class says it
acknowledges nothing (`AT_ONCE`), or when it answers a request refused as malformed before
anything was proposed (status 400: it depends on the request alone). Everything else that can
tell another party what this member knows, an answer, a frame, an item started or cut, a copy,
a notice, an exit, waits for the sync. An effect of a class this module does not know is a bug of
ours: `Ready.of` raises.

Rule: pure. No IO, clock or threads; `advance` only calls what it is given.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from meshjobs.node.events import (
    CopyBlobs,
    Cut,
    Exit,
    FetchBlobs,
    Notify,
    Pin,
    Propose,
    Reply,
    Run,
    Send,
    SendDump,
    Unpin,
    UnpinAllBut,
    WantDump,
)

# Effects that acknowledge nothing: pinning more blobs only keeps them longer, fetching a blob
# only makes a copy here, asking for a dump only writes one. Each may happen before the round's
# entries are durable.
AT_ONCE: tuple[type, ...] = (Pin, FetchBlobs, WantDump)
# Effects that tell someone (a client, a member, an item, a hook) what this member holds, or
# give up what it holds: they leave only after the sync that covers this round's entries.
AFTER_SYNC: tuple[type, ...] = (Reply, Send, Run, Cut, CopyBlobs, Unpin, UnpinAllBut, Notify,
                                Exit, SendDump)
# The one answer that depends on the request alone: it was refused as malformed.
_REFUSED_AS_MALFORMED = 400


@dataclass(frozen=True)
class Ready:
    """One round's output: `entries` to log, then `at_once`, then the sync, then `after_sync`."""

    entries: tuple[dict, ...] = ()
    at_once: tuple[Any, ...] = ()
    after_sync: tuple[Any, ...] = ()

    @classmethod
    def of(cls, effects: Iterable[Any]) -> Ready:
        """Sort a round's effects by the gate. Items to cut, then items to run, come first in
        `after_sync`; the rest keep the order the node made them in."""
        entries: list[dict] = []
        at_once: list[Any] = []
        cuts: list[Any] = []
        runs: list[Any] = []
        rest: list[Any] = []
        for eff in effects:
            if isinstance(eff, Propose):
                entries.append(eff.entry)
            elif isinstance(eff, AT_ONCE) or (
                    isinstance(eff, Reply) and eff.answer.status == _REFUSED_AS_MALFORMED):
                at_once.append(eff)
            elif isinstance(eff, Cut):
                cuts.append(eff)
            elif isinstance(eff, Run):
                runs.append(eff)
            elif isinstance(eff, AFTER_SYNC):
                rest.append(eff)
            else:
                raise AssertionError(f"the gate does not know the effect {eff!r}")
        return cls(tuple(entries), tuple(at_once), tuple(cuts + runs + rest))

    def __bool__(self) -> bool:
        return bool(self.entries or self.at_once or self.after_sync)

    def effects(self) -> list[Any]:
        """Every effect, as it is released: the entries (as `Propose`), then at once, then after
        the sync."""
        return [Propose(e) for e in self.entries] + list(self.at_once) + list(self.after_sync)


def advance(ready: Ready, persist: Callable[[dict], None], sync: Callable[[], None],
            release: Callable[[Any], None]) -> None:
    """Carry out a round: log, release what acknowledges nothing, sync, release the rest.
    `sync` is always called: the edge knows whether anything was logged since the last sync
    (by this round or by Raft itself) and makes it durable, or stops the member."""
    for entry in ready.entries:
        persist(entry)
    for eff in ready.at_once:
        release(eff)
    sync()
    for eff in ready.after_sync:
        release(eff)


def dispatch(eff: Any, handlers: Mapping[type, Callable[..., None]], *args: Any) -> None:
    """Carry out one effect at an edge: the edge's handler for the effect's type, called with
    the effect (and `args`). Each edge (the jobs thread, the simulator, the node tests) has one
    table, type -> handler, with every effect type it may be given (`ignore` for those it has
    nothing to do with); an effect it has no handler for is a bug of ours: it crashes."""
    handler = handlers.get(type(eff))
    if handler is None:
        raise AssertionError(f"this edge has no handler for the effect {eff!r}")
    handler(eff, *args)


def ignore(eff: Any, *args: Any) -> None:
    """The handler of an effect an edge has nothing to do with (it is named, not forgotten)."""


def run_round(node: Any, events: Iterable[Any]) -> Ready:
    """Step `node` with a round's events, in order, and take what it asks of the edge."""
    for ev in events:
        node.step(ev)
    return node.ready()
