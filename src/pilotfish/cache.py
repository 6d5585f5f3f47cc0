"""Snapshots per node group, and the watches streams hold on them.

The cache owns what exists; a stream owns what it has seen. They meet at one narrow interface,
:class:`ConfigWatcher` (as go-control-plane's): :meth:`SnapshotCache.create_watch` takes a
:class:`~pilotfish.protocol.Watch` and a callback and returns a function that cancels it
(:meth:`~SnapshotCache.create_delta_watch` likewise for delta). REST xDS, which has no streams,
reads through :class:`ConfigFetcher` instead: the current snapshot of a group and a kept version.
The services in :mod:`pilotfish.xds` are typed against these Protocols, not this class. A watch
is answered at most once: immediately if the current snapshot already has something for it, or
later by :meth:`SnapshotCache.set_snapshot`. Watches are answered type by type in ADS order (CDS,
EDS, LDS, RDS, SDS), so on an aggregated stream what is referred to arrives before what refers
to it.

Send what changed: EDS, RDS and SDS responses need not be full state, so a proxy that holds an
earlier version of such a type is answered with :meth:`~pilotfish.snapshot.TypeSnapshot.changes`
since that version: the cache keeps the last :data:`HISTORY` versions of each type to compare
with. A proxy at a version no longer kept (or warming, or stating a version it never had from us)
gets the full set of what it subscribes to, which is always correct.

A new snapshot looks only at the watches of types that may have news: a build keeps the very
object of a type nothing changed in, and nothing waiting on an object the cache served before can
be due (each waiting watch was found to lack nothing in it), unless clusters are bridged or
endpoints are per proxy (subsetting). So an endpoint change wakes the endpoint watches alone, not
every stream's cluster, listener and route watches.

Make before break (behaviour 12): when a new snapshot removes clusters that the previous one's
listeners or routes used, the cache also keeps a *bridge* cluster set (new clusters plus those).
A proxy whose listeners and routes, those it runs and those it was last sent, are not all the new
ones gets the bridge, so no route points at a missing cluster: the watch's stream says so when the
watch is answered (``routing_moved``), not when it was made. Once the proxy ACKs the new routing,
its cluster watch is re-opened and it gets the final set. A delta proxy's endpoint watches are
answered likewise from an endpoint bridge, the new endpoints plus the last assignments of the
clusters the bridge keeps: a delta response would otherwise tell it they are removed (and a kept
cluster sent again, which warms, would get none). A SotW response removes no assignment; a proxy
served its own endpoints (subsetting) is not bridged.

Response memos: the cache makes one :class:`~pilotfish.snapshot.MemoBudget` (or is given one) and
counts every snapshot it serves in it (:meth:`~pilotfish.snapshot.TypeSnapshot.count_in`), so the
memos of every group and version it serves share one bound, and another cache in the process
(another server, a test) has its own.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Mapping
from typing import NewType, Protocol

from pilotfish.protocol import DeltaWatch, Watch, holds_ttls, needs_response
from pilotfish.resources import ADS_ORDER, CLUSTER, ENDPOINT, LISTENER, ROUTE, TypeUrl
from pilotfish.resources.refs import assignment_names, referenced_clusters
from pilotfish.snapshot import DeltaChanges, EncodedResponse, MemoBudget, Resource, Snapshot, TypeSnapshot, with_kept

__all__ = [
    "DEFAULT_GROUP",
    "Cancel",
    "ConfigFetcher",
    "ConfigWatcher",
    "DeltaRespond",
    "NodeGroup",
    "Respond",
    "SnapshotCache",
    "SnapshotPublisher",
    "WatchRouting",
]

NodeGroup = NewType("NodeGroup", str)
"""Proxies in one group are served the same snapshot."""

DEFAULT_GROUP = NodeGroup("default")

HISTORY = 16
"""Versions of each type kept per node group to answer with changes since them. Old versions
share every unchanged resource with the current one, and their memoized responses are dropped,
so each costs its name-to-resource table and the resources that changed since."""

OWN_HISTORY = 8_192
"""Per-proxy endpoint versions (subsetting) kept per node group to answer with changes since them;
beyond it the oldest half goes (a proxy at one of those is sent its whole subscription)."""

Respond = Callable[[Watch, EncodedResponse], None]
"""Called once, synchronously, with the response a watch waited for."""
DeltaRespond = Callable[[DeltaWatch, DeltaChanges], None]
"""Called once, synchronously, with what a delta watch waited for."""
_Entry = tuple[Watch, Respond] | tuple[DeltaWatch, DeltaRespond]
Cancel = Callable[[], None]


class ConfigWatcher(Protocol):
    """What the gRPC xDS services need of the cache: watches (go-control-plane's ``ConfigWatcher``).

    A watch is answered at most once, synchronously through its callback: at once if there is
    something for it, else when a snapshot has. The returned function cancels it (an answered
    watch's is a no-op)."""

    def create_watch(self, watch: Watch, respond: Respond, group: NodeGroup) -> Cancel:
        """Answer a SotW ``watch`` of ``group``'s snapshot when it is due (now, or later)."""
        ...

    def create_delta_watch(self, watch: DeltaWatch, respond: DeltaRespond, group: NodeGroup) -> Cancel:
        """Answer a delta ``watch`` of ``group``'s snapshot when the client lacks something."""
        ...


class ConfigFetcher(Protocol):
    """What REST xDS needs of the cache: no watches (a poll is answered at once), the current
    snapshot and the versions kept to compare with (go-control-plane's ``ConfigFetcher``)."""

    def snapshot(self, group: NodeGroup) -> Snapshot | None:
        """``group``'s current snapshot (None before the first is published)."""
        ...

    def kept(self, type_url: TypeUrl, version: str, group: NodeGroup) -> TypeSnapshot | None:
        """``type_url`` as it was at ``version`` in ``group``, if that version is still kept."""
        ...


class SnapshotPublisher(Protocol):
    """Where the reconciler hands its builds: the cache itself, or a rollout's delivery in front of
    it (:class:`~pilotfish.rollout.delivery.Delivery`), which decides which proxies get them."""

    def snapshot(self, group: NodeGroup = DEFAULT_GROUP) -> Snapshot | None:
        """What was published last for ``group`` (the next build is compared with it)."""
        ...

    def publish(self, snapshots: Mapping[NodeGroup, Snapshot]) -> int:
        """Serve the groups' new snapshots; how many watches were answered."""
        ...


class WatchRouting(Protocol):
    """Which cache group answers a proxy's watches, when that is not simply its node group (a
    rollout: its baseline or its candidate, :class:`~pilotfish.rollout.delivery.Delivery`)."""

    def route(self, node_id: str, group: NodeGroup) -> NodeGroup:
        """The cache group whose snapshot answers ``node_id`` (of node group ``group``) now."""
        ...

    def follow(self, on_moved: Callable[[frozenset[str]], None]) -> None:
        """Call ``on_moved`` with the proxies that :meth:`route` answers otherwise for from now on."""
        ...


def _nothing() -> None:
    return None


class _Cancel:
    """Cancels one open watch (an object rather than a closure: one per open watch, so small)."""

    __slots__ = ("_watches", "_wid")

    def __init__(self, watches: dict[int, _Entry], wid: int) -> None:
        self._watches = watches
        self._wid = wid

    def __call__(self) -> None:
        self._watches.pop(self._wid, None)


class SnapshotCache:
    """The current snapshot of each node group, and the open watches on it."""

    def __init__(
        self, *, subset_of: Callable[[str], int | None] | None = None, memo_budget: MemoBudget | None = None
    ) -> None:
        self.subset_of: Callable[[str], int | None] = subset_of or (lambda _: None)
        """Node id -> its subsetting index (None: none): which of a snapshot's per-proxy endpoint
        views answers its EDS watches (set by the wiring)."""
        self.memo_budget = memo_budget if memo_budget is not None else MemoBudget()
        """The budget every snapshot served here counts its memoized responses in (this cache's
        own unless given one)."""
        self._snapshots: dict[NodeGroup, Snapshot] = {}
        # group -> type -> watch id -> (watch, respond); dicts keep insertion (arrival) order.
        self._watches: dict[NodeGroup, dict[TypeUrl, dict[int, _Entry]]] = {}
        self._ids = itertools.count()
        self._bridges: dict[NodeGroup, TypeSnapshot] = {}
        self._endpoint_bridges: dict[NodeGroup, TypeSnapshot] = {}
        self._bridged_clusters: dict[NodeGroup, frozenset[str]] = {}
        """Per group, the removed clusters its cluster bridge keeps (their endpoints are bridged only
        to a delta client that holds one of them)."""
        # group -> type -> version -> its resources, oldest first (see HISTORY)
        self._history: dict[NodeGroup, dict[TypeUrl, dict[str, TypeSnapshot]]] = {}
        # id of a kept listener or route TypeSnapshot -> (it, the clusters it uses)
        self._uses: dict[int, tuple[TypeSnapshot, frozenset[str]]] = {}
        # group -> version -> a proxy's own endpoints (subsetting), oldest first (see OWN_HISTORY)
        self._own: dict[NodeGroup, dict[str, TypeSnapshot]] = {}
        # group -> ((CDS, LDS, RDS versions), the bridge made for them, the assignments it keeps)
        self._last_bridge: dict[
            NodeGroup, tuple[tuple[str | None, str | None, str | None], TypeSnapshot | None, Mapping[str, Resource]]
        ] = {}
        # group -> (endpoints, assignments kept, the endpoint bridge made of them)
        self._last_endpoint_bridge: dict[NodeGroup, tuple[TypeSnapshot, Mapping[str, Resource], TypeSnapshot]] = {}

    def snapshot(self, group: NodeGroup = DEFAULT_GROUP) -> Snapshot | None:
        return self._snapshots.get(group)

    def groups(self) -> list[NodeGroup]:
        return list(self._snapshots)

    def kept(self, type_url: TypeUrl, version: str, group: NodeGroup = DEFAULT_GROUP) -> TypeSnapshot | None:
        """``type_url`` as it was at ``version`` in ``group``, if that version is one of the last
        :data:`HISTORY` kept (a REST poll states the version it has: compared with this)."""
        return self._kept(group, type_url, version)

    def watch_count(self) -> int:
        return sum(len(w) for by_type in self._watches.values() for w in by_type.values())

    def set_snapshot(self, snapshot: Snapshot, group: NodeGroup = DEFAULT_GROUP) -> int:
        """Make ``snapshot`` current for ``group``; answer the watches it satisfies.

        Returns how many watches were answered.
        """
        previous = self._snapshots.get(group)
        for served in snapshot.types.values():
            served.count_in(self.memo_budget)
        self._snapshots[group] = snapshot
        self._remember(group, previous, snapshot)
        for own in self._own.get(group, {}).values():
            own.retire()  # kept to compare with; no longer served (the new snapshot makes its own)
        bridged = group in self._bridges
        endpoints_bridged = group in self._endpoint_bridges
        bridge, endpoint_bridge = self._bridge(group, snapshot)
        _put(self._bridges, group, bridge)
        _put(self._endpoint_bridges, group, endpoint_bridge)
        bridged |= bridge is not None
        endpoints_bridged |= endpoint_bridge is not None
        by_type = self._watches.get(group)
        if not by_type:
            return 0
        answered = 0
        for type_url in ADS_ORDER:
            watches = by_type.get(type_url)
            if not watches or (
                previous is not None
                and _nothing_new(type_url, previous, snapshot, bridged=bridged, endpoints_bridged=endpoints_bridged)
            ):
                continue
            due: list[tuple[int, _Entry, TypeSnapshot]] = []
            # What answers a watch is the same for all of the type unless it depends on the
            # stream (a bridge, per-proxy endpoints): then it is looked up per watch.
            shared = self._shared_source(group, snapshot, type_url)
            sources = {True: shared, False: shared.plain()} if shared is not None else None
            for wid, entry in watches.items():
                watch = entry[0]
                current = self._current(group, snapshot, watch) if sources is None else sources[watch.ttl]
                if current is not None and (isinstance(watch, DeltaWatch) or needs_response(watch, current)):
                    due.append((wid, entry, current))
            # The SotW responses made in this pass, by what makes them: watches of one
            # subscription at one version (the usual case) share one, looked up once.
            responses: dict[tuple[object, ...], EncodedResponse] = {}
            for wid, entry, current in due:
                if isinstance(entry[0], DeltaWatch):
                    # What a delta client lacks is read when it is its turn: an answer of an
                    # earlier type on its stream (clusters before endpoints) may have changed it.
                    changes = entry[0].changes(current)
                    if changes is None:
                        continue
                    del watches[wid]
                    entry[1](entry[0], changes)
                else:
                    watch = entry[0]
                    del watches[wid]
                    # (Every object keyed by its id is alive until the pass ends.)
                    key = (
                        id(current),
                        id(watch.subscription),
                        watch.known_version,
                        id(watch.known_names),
                        watch.known_wildcard,
                        watch.full_state,
                        watch.force,
                        watch.renew,
                        watch.ttl,
                    )
                    response = responses.get(key)
                    if response is None:
                        response = responses[key] = self._response(group, current, watch)
                    entry[1](entry[0], response)
                answered += 1
        return answered

    def publish(self, snapshots: Mapping[NodeGroup, Snapshot]) -> int:
        """:meth:`set_snapshot` for each group, in order; how many watches were answered."""
        return sum(self.set_snapshot(snapshot, group) for group, snapshot in snapshots.items())

    def adopt(self, *, into: NodeGroup, source: NodeGroup) -> None:
        """Keep ``source``'s kept versions in ``into``'s history as well (as older than its own), and
        make ``into``'s cluster bridge anew: proxies about to move from ``source``'s snapshot to
        ``into``'s may run the listeners and routes of any of them (a rollout moving a wave between
        its baseline and its candidate), and must not lose a cluster those still use."""
        theirs = self._history.get(source)
        if not theirs:
            return
        history = self._history.setdefault(into, {})
        for url, versions in theirs.items():
            own = history.get(url, {})
            merged = {v: ts for v, ts in versions.items() if v not in own}
            merged.update(own)
            while len(merged) > HISTORY:
                self._uses.pop(id(merged.pop(next(iter(merged)))), None)  # (found again if still kept elsewhere)
            history[url] = merged
        self._last_bridge.pop(into, None)
        snapshot = self._snapshots.get(into)
        if snapshot is not None:
            bridge, endpoint_bridge = self._bridge(into, snapshot)
            _put(self._bridges, into, bridge)
            _put(self._endpoint_bridges, into, endpoint_bridge)

    def create_watch(self, watch: Watch, respond: Respond, group: NodeGroup = DEFAULT_GROUP) -> Cancel:
        """Answer ``watch`` now if the snapshot has something for it, else when it does."""
        snapshot = self._snapshots.get(group)
        current = self._current(group, snapshot, watch) if snapshot is not None else None
        if current is not None and needs_response(watch, current):
            respond(watch, self._response(group, current, watch))
            return _nothing
        return self._add(group, (watch, respond))

    def create_delta_watch(self, watch: DeltaWatch, respond: DeltaRespond, group: NodeGroup = DEFAULT_GROUP) -> Cancel:
        """Answer a delta ``watch`` now if the client lacks something the snapshot has, else when
        it does."""
        snapshot = self._snapshots.get(group)
        current = self._current(group, snapshot, watch) if snapshot is not None else None
        if current is not None:
            changes = watch.changes(current)
            if changes is not None:
                respond(watch, changes)
                return _nothing
        return self._add(group, (watch, respond))

    def _add(self, group: NodeGroup, entry: _Entry) -> Cancel:
        watches = self._watches.setdefault(group, {}).setdefault(entry[0].type_url, {})
        wid = next(self._ids)
        watches[wid] = entry
        return _Cancel(watches, wid)

    def _remember(self, group: NodeGroup, previous: Snapshot | None, snapshot: Snapshot) -> None:
        """Keep each type's new version to compare with later; retire what is no longer served."""
        history = self._history.setdefault(group, {})
        for url, current in snapshot.types.items():
            if previous is not None:
                old = previous.types.get(url)
                if old is not None and old is not current:
                    old.retire()
            versions = history.setdefault(url, {})
            versions.pop(current.version, None)  # (re)entered as the newest
            versions[current.version] = current
            if url in (LISTENER.url, ROUTE.url):
                self._used_by(current)
            while len(versions) > HISTORY:
                gone = versions.pop(next(iter(versions)))
                self._uses.pop(id(gone), None)

    def _bridge(self, group: NodeGroup, new: Snapshot) -> tuple[TypeSnapshot | None, TypeSnapshot | None]:
        """The cluster bridge, the new clusters plus the removed ones that the listeners or
        routes of any kept version use (a proxy may still run any of them, not just the previous
        one's: it can lag behind by more than one change), and the endpoint bridge, the new
        endpoints plus the last assignments of those kept clusters; None if there are none."""
        current = new.get(CLUSTER.url)
        history = self._history.get(group, {})
        if current is None or len(history.get(CLUSTER.url, ())) < 2:
            return None, None
        key = (new.version(CLUSTER.url), new.version(LISTENER.url), new.version(ROUTE.url))
        last = self._last_bridge.get(group)
        if last is not None and last[0] == key:
            # Nothing the clusters kept depend on changed (an endpoint change).
            return last[1], self._endpoint_bridge(group, new, last[2])
        removed: dict[str, Resource] = {}
        for old in history[CLUSTER.url].values():  # oldest first: the newest resource of a name wins
            for name in old.resources.keys() - current.resources.keys():
                removed[name] = old.resources[name]
        bridge = None
        assignments: Mapping[str, Resource] = {}
        if removed:
            used: set[str] = set()
            for url in (LISTENER.url, ROUTE.url):
                for kept in history.get(url, {}).values():
                    used |= self._used_by(kept)
            kept_clusters = {name: resource for name, resource in removed.items() if name in used}
            if kept_clusters:
                bridge = with_kept(current, kept_clusters)
                assignments = _kept_assignments(history, new, kept_clusters.values())
        self._last_bridge[group] = (key, bridge, assignments)
        self._bridged_clusters[group] = frozenset(kept_clusters) if bridge is not None else frozenset()
        return bridge, self._endpoint_bridge(group, new, assignments)

    def _endpoint_bridge(
        self, group: NodeGroup, new: Snapshot, assignments: Mapping[str, Resource]
    ) -> TypeSnapshot | None:
        """``new``'s endpoints plus ``assignments`` (made again only when either changed)."""
        endpoints = new.get(ENDPOINT.url)
        if not assignments or endpoints is None:
            self._last_endpoint_bridge.pop(group, None)
            return None
        last = self._last_endpoint_bridge.get(group)
        if last is not None and last[0] is endpoints and last[1] is assignments:
            return last[2]
        bridge = with_kept(endpoints, assignments)
        self._last_endpoint_bridge[group] = (endpoints, assignments, bridge)
        return bridge

    def _used_by(self, routing: TypeSnapshot) -> frozenset[str]:
        """The clusters a kept listener or route version uses (found once per version)."""
        entry = self._uses.get(id(routing))
        if entry is not None and entry[0] is routing:
            return entry[1]
        resources = (r.message for r in routing.resources.values())
        if routing.rtype.url == LISTENER.url:
            used = frozenset(referenced_clusters(resources, ()))
        else:
            used = frozenset(referenced_clusters((), resources))
        self._uses[id(routing)] = (routing, used)
        return used

    def _response(self, group: NodeGroup, current: TypeSnapshot, watch: Watch) -> EncodedResponse:
        """What answers ``watch``: for EDS/RDS/SDS, the changes since the version the proxy holds,
        if that one is still kept; otherwise (and for CDS/LDS, which are full state) everything
        it subscribes to."""
        names = watch.subscription.names_to_send()
        if names is None or watch.full_state or watch.force or watch.known_version is None:
            return current.response(names)
        if watch.renew and holds_ttls(watch, current):
            return current.response(names)  # (whole: what it holds with a TTL is renewed)
        since = self._kept(group, watch.type_url, watch.known_version)
        if since is None:
            return current.response(names)
        return current.changes(names, since=since if watch.ttl else since.plain(), held=watch.known_names)

    def _shared_source(self, group: NodeGroup, snapshot: Snapshot, type_url: TypeUrl) -> TypeSnapshot | None:
        """What answers every watch of ``type_url`` (as :meth:`_source`), if that does not depend
        on the watch: not for clusters while a cluster bridge stands, nor for endpoints that are
        served per proxy or bridged. None: look it up per watch (or the type is not served)."""
        if type_url == CLUSTER.url and group in self._bridges:
            return None
        if type_url == ENDPOINT.url and (snapshot.subsets is not None or self._endpoint_bridges):
            return None
        return snapshot.get(type_url)

    def _current(self, group: NodeGroup, snapshot: Snapshot, watch: Watch | DeltaWatch) -> TypeSnapshot | None:
        """What ``watch`` should be answered from (:meth:`_source`), without TTLs for a proxy
        that does not take them."""
        current = self._source(group, snapshot, watch)
        return current if current is None or watch.ttl else current.plain()

    def _source(self, group: NodeGroup, snapshot: Snapshot, watch: Watch | DeltaWatch) -> TypeSnapshot | None:
        """What ``watch`` should be answered from: the snapshot's type, the cluster bridge, the
        proxy's own endpoints (subsetting), or for a delta stream the endpoint bridge."""
        if watch.type_url == CLUSTER.url:
            bridge = self._bridges.get(group)
            if bridge is not None and not watch.routing_moved(snapshot):
                return bridge
        elif watch.type_url == ENDPOINT.url:
            if watch.proxy is not None and snapshot.subsets is not None:
                own = snapshot.endpoints_for(self.subset_of(watch.proxy))
                if own is not None:
                    self._remember_own(group, own)
                return own
            if self._endpoint_bridges:
                bridge = self._endpoint_bridges.get(group)
                if (
                    bridge is not None
                    and isinstance(watch, DeltaWatch)
                    and watch.holds_any(CLUSTER.url, self._bridged_clusters.get(group, frozenset()))
                    and not watch.routing_moved(snapshot)
                ):
                    return bridge
        return snapshot.get(watch.type_url)

    def _remember_own(self, group: NodeGroup, own: TypeSnapshot) -> None:
        """Keep a proxy's own endpoints by version, to answer it with changes since them later."""
        kept = self._own.setdefault(group, {})
        if own.version not in kept:
            if len(kept) >= OWN_HISTORY:
                for version in list(kept)[: len(kept) // 2]:  # the oldest half
                    del kept[version]
            kept[own.version] = own

    def _kept(self, group: NodeGroup, type_url: TypeUrl, version: str) -> TypeSnapshot | None:
        found = self._history.get(group, {}).get(type_url, {}).get(version)
        if found is None and type_url == ENDPOINT.url:
            found = self._own.get(group, {}).get(version)
        return found


def _put(bridges: dict[NodeGroup, TypeSnapshot], group: NodeGroup, bridge: TypeSnapshot | None) -> None:
    if bridge is None:
        bridges.pop(group, None)
    else:
        bridges[group] = bridge


def _kept_assignments(
    history: Mapping[TypeUrl, Mapping[str, TypeSnapshot]], new: Snapshot, clusters: Iterable[Resource]
) -> Mapping[str, Resource]:
    """The last assignment, among the kept endpoint versions, of each of ``clusters`` that
    ``new`` has none of."""
    names = assignment_names(resource.message for resource in clusters)
    endpoints = new.get(ENDPOINT.url)
    if endpoints is not None:
        names -= endpoints.resources.keys()
    kept: dict[str, Resource] = {}
    for old in history.get(ENDPOINT.url, {}).values():  # oldest first: the newest of a name wins
        for name in names:
            found = old.resources.get(name)
            if found is not None:
                kept[name] = found
    return kept


def _nothing_new(
    type_url: TypeUrl, previous: Snapshot, snapshot: Snapshot, *, bridged: bool, endpoints_bridged: bool
) -> bool:
    """Whether ``snapshot`` answers every watch of ``type_url`` as ``previous`` did, so none that
    waited on ``previous`` is due: the very same resources (a build keeps an unchanged type's
    object), and neither a cluster or endpoint bridge (``bridged``, ``endpoints_bridged``: before
    or now) nor per-proxy endpoints (subsetting), which depend on more than the type. An endpoint
    change then wakes no stream's cluster, listener or route watch."""
    if previous.types.get(type_url) is not snapshot.types.get(type_url):
        return False
    if type_url == CLUSTER.url:
        return not bridged
    if type_url == ENDPOINT.url:
        return not endpoints_bridged and previous.subsets is None and snapshot.subsets is None
    return True
