"""Snapshots per node group, and the watches streams hold on them.

The cache owns what exists; a stream owns what it has seen. They meet at one narrow interface
(as go-control-plane's ``ConfigWatcher``): :meth:`SnapshotCache.create_watch` takes a
:class:`~pilotfish.protocol.Watch` and a callback and returns a function that cancels it. A watch
is answered at most once: immediately if the current snapshot already has something for it, or
later by :meth:`SnapshotCache.set_snapshot`. Watches are answered type by type in ADS order (CDS,
EDS, LDS, RDS, SDS), so on an aggregated stream what is referred to arrives before what refers
to it.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import NewType

from pilotfish.protocol import Watch, needs_response
from pilotfish.resources import ADS_ORDER, TypeUrl
from pilotfish.snapshot import EncodedResponse, Snapshot

__all__ = ["DEFAULT_GROUP", "Cancel", "NodeGroup", "Respond", "SnapshotCache"]

NodeGroup = NewType("NodeGroup", str)
"""Proxies in one group are served the same snapshot."""

DEFAULT_GROUP = NodeGroup("default")

Respond = Callable[[Watch, EncodedResponse], None]
"""Called once, synchronously, with the response a watch waited for."""
Cancel = Callable[[], None]


def _nothing() -> None:
    return None


class SnapshotCache:
    """The current snapshot of each node group, and the open watches on it."""

    def __init__(self) -> None:
        self._snapshots: dict[NodeGroup, Snapshot] = {}
        # group -> type -> watch id -> (watch, respond); dicts keep insertion (arrival) order.
        self._watches: dict[NodeGroup, dict[TypeUrl, dict[int, tuple[Watch, Respond]]]] = {}
        self._ids = itertools.count()

    def snapshot(self, group: NodeGroup = DEFAULT_GROUP) -> Snapshot | None:
        return self._snapshots.get(group)

    def groups(self) -> list[NodeGroup]:
        return list(self._snapshots)

    def watch_count(self) -> int:
        return sum(len(w) for by_type in self._watches.values() for w in by_type.values())

    def set_snapshot(self, snapshot: Snapshot, group: NodeGroup = DEFAULT_GROUP) -> int:
        """Make ``snapshot`` current for ``group``; answer the watches it satisfies.

        Returns how many watches were answered.
        """
        self._snapshots[group] = snapshot
        by_type = self._watches.get(group)
        if not by_type:
            return 0
        answered = 0
        for type_url in ADS_ORDER:
            watches = by_type.get(type_url)
            current = snapshot.get(type_url)
            if not watches or current is None:
                continue
            due = [(wid, w, r) for wid, (w, r) in watches.items() if needs_response(w, current)]
            for wid, watch, respond in due:
                del watches[wid]
                respond(watch, current.response(watch.subscription.names_to_send()))
            answered += len(due)
        return answered

    def create_watch(self, watch: Watch, respond: Respond, group: NodeGroup = DEFAULT_GROUP) -> Cancel:
        """Answer ``watch`` now if the snapshot has something for it, else when it does."""
        snapshot = self._snapshots.get(group)
        current = snapshot.get(watch.type_url) if snapshot is not None else None
        if current is not None and needs_response(watch, current):
            respond(watch, current.response(watch.subscription.names_to_send()))
            return _nothing
        watches = self._watches.setdefault(group, {}).setdefault(watch.type_url, {})
        wid = next(self._ids)
        watches[wid] = (watch, respond)

        def cancel() -> None:
            watches.pop(wid, None)

        return cancel
