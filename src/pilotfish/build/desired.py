"""Desired state, as sources report it, and how it becomes one checked snapshot.

Each source (the snapshot file, the registry API, etcd) reports a :class:`DesiredState`: service
definitions, endpoints per service, and raw Envoy resources. :func:`build_snapshot` merges the
states of all sources and builds the snapshot, refusing anything ambiguous:

- a service defined by two sources (endpoints may come from several: they are merged);
- a built resource whose name clashes with a raw resource;
- two listeners on the same address (Envoy would refuse one, or with SO_REUSEPORT silently split
  traffic between them);
- the cross-reference problems of :func:`pilotfish.build.validate.check_references`;
- any resource breaking Envoy's own ``validate.rules`` (:func:`pilotfish.build.validate.check_rules`).

Node groups (:func:`build_snapshots`): each group is served its own snapshot of the same merged
state, seen through its :class:`View`. Envoys (``ClientKind.ENVOY``) get socket listeners, proxyless
gRPC clients (``ClientKind.GRPC``) API listeners, both the same clusters and endpoints; raw listeners
go to the kind they are for (one with an ``api_listener`` to gRPC clients, others to Envoys). Envoys
polling REST (``ClientKind.REST``) get what Envoys get, except that built clusters and listeners
point EDS and RDS at the REST config source of their bootstrap
(:func:`pilotfish.resources.bootstrap.rest_config_source`, polled every ``rest_refresh`` seconds) instead of
ADS, which they do not speak; raw resources are served to them as they are (a raw cluster or
listener for them names its config sources itself). All
groups are built in one pass from one memo, so a resource common to several groups is encoded
(and checked) once and is the same object in each; a problem in any group refuses the whole pass
(the groups never serve different generations of the sources).

Subsetting (:func:`subset_tables`, ``subset_size`` of a service or the server's default): each
subsetted service's backends get stable dense indices (an :class:`~pilotfish.build.subsetting.IndexTable`
the caller keeps from build to build), and each group's snapshot carries a
:class:`~pilotfish.snapshot.SubsetPlan` that gives every proxy its own ``subset_size`` of the
endpoints the group would get (Ringsteady; within the group's zone first when it has one).
"""

from __future__ import annotations

import functools
import hashlib
import itertools
from collections.abc import Callable, Hashable, Mapping
from dataclasses import InitVar, dataclass, field
from types import MappingProxyType
from typing import Any, TypeVar

from envoy.config.core.v3 import config_source_pb2
from envoy.config.listener.v3 import listener_pb2
from google.protobuf import json_format
from google.protobuf.message import Message

from pilotfish.build.subsetting import IndexTable, Ring, ZoneRings
from pilotfish.build.validate import ReferenceNames, check_rules, extension_names, references_problems
from pilotfish.errors import ConfigError, Problem
from pilotfish.resources import TYPES, ParsedDocument, ResourceType, TypeUrl
from pilotfish.resources.bootstrap import DEFAULT_REST_REFRESH, rest_config_source
from pilotfish.resources.builders import ClientKind, RawPatch, ResourceMemo, ServicesPatch, encode_for_views
from pilotfish.resources.services import Endpoint, ServiceSpec, has_host_names
from pilotfish.resources.types import CLUSTER, ENDPOINT, EXTENSION_CONFIG, LISTENER, ROUTE
from pilotfish.snapshot import Resource, Snapshot, SubsetPlan, SubsetService, TypeSnapshot, content_version

G = TypeVar("G", bound=Hashable)
"""A node group's key."""

__all__ = [
    "DesiredState",
    "MergeMemo",
    "Merged",
    "View",
    "build_snapshot",
    "build_snapshots",
    "merge_states",
    "subset_tables",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class View:
    """What one node group is served of the merged state."""

    kind: ClientKind = ClientKind.ENVOY
    """Which listeners its clients get (socket listeners for Envoys, on ADS or REST; API listeners
    for proxyless gRPC clients) and how their EDS and RDS are reached (ADS, or REST polls)."""
    zone: str = ""
    """The zone its clients run in: of a service that asks for zone-local routing (``zone_local``)
    they get only the endpoints in this zone, while it has any. "": every endpoint."""


@dataclass(frozen=True, slots=True)
class DesiredState:
    """What one source wants served. Equal states mean no change."""

    services: Mapping[str, ServiceSpec] = field(default_factory=dict)
    endpoints: Mapping[str, tuple[Endpoint, ...]] = field(default_factory=dict)
    """Endpoints by service name; a service may be defined by another source."""
    resources: Mapping[ResourceType, tuple[Message, ...]] = field(default_factory=dict)
    """Raw Envoy resources, served as they are."""
    version: str | None = None
    """An explicit version for every type (snapshot files only)."""
    ttls: Mapping[ResourceType, Mapping[str, int]] = field(default_factory=dict)
    """The TTL in milliseconds of the raw resources that have one, by type and name."""
    known: InitVar[Mapping[str, tuple[Endpoint, ...]] | None] = None
    """The endpoints of the source's previous state: a tuple that is the very object found there
    is sorted already, and not looked at again (a source of 10,000 services that changed one
    sorts one). Not part of the state."""

    def __post_init__(self, known: Mapping[str, tuple[Endpoint, ...]] | None) -> None:
        # Endpoint order carries no meaning: normalize it so equal sets compare equal. A tuple that is
        # sorted already is kept as it is: consumers tell unchanged services by identity.
        known = known or {}
        ordered = {}
        for name, found in self.endpoints.items():
            if known.get(name) is found:
                ordered[name] = found
                continue
            in_order = sorted(found)
            ordered[name] = found if type(found) is tuple and list(found) == in_order else tuple(in_order)
        object.__setattr__(self, "endpoints", ordered)

    @classmethod
    def of_document(cls, document: ParsedDocument) -> DesiredState:
        return cls(
            services=dict(document.services),
            endpoints=dict(document.endpoints),
            resources=dict(document.resources),
            version=document.version,
            ttls=dict(document.ttls),
        )

    def is_empty(self) -> bool:
        return not self.services and not any(self.endpoints.values()) and not any(self.resources.values())


@dataclass(frozen=True, slots=True)
class Merged:
    """The states of every source, merged."""

    services: Mapping[str, ServiceSpec]
    endpoints: Mapping[str, tuple[Endpoint, ...]]
    resources: Mapping[ResourceType, tuple[Message, ...]]
    version: str | None
    problems: tuple[Problem, ...]
    ttls: Mapping[ResourceType, Mapping[str, int]] = field(default_factory=dict)
    """The TTLs of raw resources (milliseconds, by type and name)."""
    patch: ServicesPatch | None = field(default=None, compare=False)
    """How :attr:`services` and :attr:`endpoints` were made from the last merge's (None: not
    from it): a build that starts from that one looks at the changed services alone."""


_NO_STATE = DesiredState()
"""What a source that is not (yet, or any longer) among the merged ones contributes."""


class MergeMemo:
    """The last merge: the sources' states it merged and what it made of them. The next merge
    starts from it and redoes only the services a changed source changed: sources hand over the
    very same objects for what did not change, so a change to one service among 10,000 costs one
    service, not a pass over all of them."""

    __slots__ = ("_merged", "_states")

    def __init__(self) -> None:
        self._states: dict[str, DesiredState] = {}
        self._merged: Merged | None = None

    def patched(self, states: Mapping[str, DesiredState]) -> Merged | None:
        """The merge of ``states`` made from the last one, or None when it takes a full merge (a
        first merge, or problems to report in their order). A source that comes or goes counts
        as one that had (has) nothing: a registry's first registration costs what it adds."""
        last, before = self._merged, self._states
        if last is None or last.problems:
            return None
        names: set[str] = set()
        resources_changed = False
        for source in states.keys() | before.keys():
            old, state = before.get(source, _NO_STATE), states.get(source, _NO_STATE)
            if old is state:
                continue
            resources_changed = (
                resources_changed
                or (old.resources is not state.resources and old.resources != state.resources)
                or (old.ttls is not state.ttls and old.ttls != state.ttls)
            )
            _changed_keys(old.services, state.services, names)
            _changed_keys(old.endpoints, state.endpoints, names)
        services, endpoints = dict(last.services), dict(last.endpoints)
        ordered = [states[source] for source in sorted(states)]
        for name in names:
            spec: ServiceSpec | None = None
            parts = []
            for state in ordered:
                defined = state.services.get(name)
                if defined is not None:
                    if spec is not None and spec != defined:
                        return None  # defined twice, differently: the full merge reports it
                    spec = spec or defined
                found = state.endpoints.get(name)
                if found is not None:
                    parts.append(found)
            if spec is None and not parts:
                services.pop(name, None)
                endpoints.pop(name, None)
                continue
            if spec is None:  # endpoints of a service nobody defined (see merge_states)
                previous = last.services.get(name)
                spec = (
                    previous if previous is not None and previous == ServiceSpec(name=name) else ServiceSpec(name=name)
                )
            services[name] = spec
            if parts:
                endpoints[name] = _normalized(parts)
            else:
                endpoints.pop(name, None)
        resources = _merged_resources(ordered) if resources_changed else last.resources
        return Merged(
            services=services,
            endpoints=endpoints,
            resources=resources,
            version=_version(states),
            problems=(),
            ttls=_merged_ttls(ordered) if resources_changed else last.ttls,
            patch=ServicesPatch(last.services, last.endpoints, frozenset(names)),
        )

    def keep(self, states: Mapping[str, DesiredState], merged: Merged) -> None:
        self._states, self._merged = dict(states), merged


def _changed_keys(before: Mapping[str, object], after: Mapping[str, object], into: set[str]) -> None:
    """Add to ``into`` every key whose value in ``after`` is not the very object of ``before``."""
    if before is after:
        return
    for key, value in after.items():
        if before.get(key) is not value:
            into.add(key)
    into.update(key for key in before if key not in after)


def _normalized(parts: list[tuple[Endpoint, ...]]) -> tuple[Endpoint, ...]:
    """One service's endpoints from every source that has some: one per address (the first
    source's, in name order), sorted. A single source's tuple (sorted already, by
    :class:`DesiredState`) is kept as it is when its addresses are distinct: consumers tell
    unchanged services by identity."""
    if len(parts) == 1:
        found = parts[0]
        if all(a[:2] != b[:2] for a, b in itertools.pairwise(found)):
            return found
    by_address: dict[str, Endpoint] = {}
    for found in parts:
        for endpoint in found:
            by_address.setdefault(endpoint.address, endpoint)
    return tuple(sorted(by_address.values()))


def _merged_resources(ordered: list[DesiredState]) -> dict[ResourceType, tuple[Message, ...]]:
    """Every source's resources by type, in source order (a source's own tuple when it is the only
    one with resources of the type: consumers tell an unchanged list by identity)."""
    merged: dict[ResourceType, tuple[Message, ...]] = {}
    for rtype in TYPES:
        lists = [found for state in ordered if (found := state.resources.get(rtype))]
        merged[rtype] = tuple(lists[0]) if len(lists) == 1 else tuple(itertools.chain.from_iterable(lists))
    return merged


def _merged_ttls(ordered: list[DesiredState]) -> dict[ResourceType, dict[str, int]]:
    """Every source's TTLs by type (a raw resource's name is unique across the sources: two of
    one name are refused as a clash)."""
    out: dict[ResourceType, dict[str, int]] = {}
    for state in ordered:
        for rtype, found in state.ttls.items():
            out.setdefault(rtype, {}).update(found)
    return out


def _version(states: Mapping[str, DesiredState]) -> str | None:
    """The explicit version of the only source with something in it, if it set one. A source
    that sets a version contributes even when it serves nothing (``version: X`` with only
    ``clusters: []`` is served as X)."""
    contributing = [s for s in states.values() if not s.is_empty() or s.version is not None]
    versions = {s.version for s in contributing}
    return versions.pop() if len(contributing) == 1 and len(versions) == 1 else None


def merge_states(states: Mapping[str, DesiredState], *, memo: MergeMemo | None = None) -> Merged:
    """Merge sources (in name order, so the result does not depend on arrival order). ``memo``
    carries the last merge over, so only what changed since is merged again."""
    merged = memo.patched(states) if memo is not None else None
    if merged is None:
        merged = _merge_all(states)
    if memo is not None:
        memo.keep(states, merged)
    return merged


def _merge_all(states: Mapping[str, DesiredState]) -> Merged:
    problems: list[Problem] = []
    services: dict[str, ServiceSpec] = {}
    defined_by: dict[str, str] = {}
    parts: dict[str, list[tuple[Endpoint, ...]]] = {}
    for source in sorted(states):
        state = states[source]
        for name, spec in state.services.items():
            if name in services and services[name] != spec:
                problems.append(
                    Problem(
                        f"services.{name}", f"defined by both {defined_by[name]} and {source}; define it in one place"
                    )
                )
                continue
            services[name] = spec
            defined_by[name] = source
        for name, found in state.endpoints.items():
            if name in parts:
                parts[name].append(found)
            else:
                parts[name] = [found]
    # Endpoints of a service nobody defined: a cluster with default settings, for routes to use.
    for name in parts:
        if name not in services:
            services[name] = ServiceSpec(name=name)
    return Merged(
        services=services,
        endpoints={name: _normalized(found) for name, found in parts.items()},
        resources=_merged_resources([states[source] for source in sorted(states)]),
        version=_version(states),
        problems=tuple(problems),
        ttls=_merged_ttls([states[source] for source in sorted(states)]),
    )


def _listen_address(listener: Message) -> str | None:
    assert isinstance(listener, listener_pb2.Listener)
    socket = listener.address.socket_address
    return f"{socket.address}:{socket.port_value}" if socket.address else None


def _is_api_listener(listener: Message) -> bool:
    assert isinstance(listener, listener_pb2.Listener)
    return bool(listener.HasField("api_listener"))


def build_snapshot(
    merged: Merged,
    source: str,
    *,
    memo: ResourceMemo | None = None,
    rules: bool = True,
    view: View | None = None,
    rest_refresh: float = DEFAULT_REST_REFRESH,
) -> Snapshot:
    """Build the snapshot of merged desired state; raise :class:`ConfigError` naming every problem.

    ``memo`` carries encoded resources of unchanged services over from the previous build.
    ``rules``: check every resource, raw or built, against Envoy's ``validate.rules``
    (:func:`pilotfish.build.validate.check_rules`); off, such content goes out as it is (for Envoy to NACK).
    ``view``: what the clients are served (default: Envoys). ``rest_refresh``: see :func:`build_snapshots`.
    """
    chosen = view or View()
    return build_snapshots(merged, source, {chosen: chosen}, memo=memo, rules=rules, rest_refresh=rest_refresh)[chosen]


def subset_tables(
    merged: Merged, tables: Mapping[str, IndexTable], *, default_size: int | None = None, allocate: bool = True
) -> dict[str, IndexTable]:
    """The backend index table of every service that is subsetted (its ``subset_size``, else
    ``default_size``), updated from ``tables`` (the previous build's) for the endpoints it has now.
    A pure function: every replica with the same previous tables computes the same ones.
    ``allocate`` False: new endpoints get no index (they wait for the replica that allocates, on
    etcd), those that went keep theirs (it frees them)."""
    out = {}
    for name, spec in merged.services.items():
        if (spec.subset_size or default_size) is not None:
            if has_host_names(merged.endpoints.get(name, ())):
                continue  # Envoy resolves its names, each proxy all of them: not subsetted
            previous = tables.get(name, _NO_INDICES)
            out[name] = (
                previous.update(present=(e.address for e in merged.endpoints.get(name, ()))) if allocate else previous
            )
    return out


_NO_INDICES = IndexTable()


def _subset_plan(
    merged: Merged, view: View, tables: Mapping[str, IndexTable], default_size: int | None
) -> SubsetPlan | None:
    services: dict[str, SubsetService] = {}
    digest = hashlib.sha256()
    for name in sorted(tables):
        spec = merged.services.get(name)
        size = (spec.subset_size if spec is not None else None) or default_size
        if spec is None or size is None:
            continue
        found = merged.endpoints.get(name, ())
        if view.zone and spec.zone_local and any(e.zone == view.zone for e in found):
            found = tuple(e for e in found if e.zone == view.zone)  # what the group's assignment holds
        if len(found) <= size:
            continue
        table = tables[name]
        by_index: dict[int, Endpoint] = {}
        for endpoint in found:
            index = table.index(endpoint.address)
            if index is not None:
                by_index[index] = endpoint
        if len(by_index) <= size:
            continue  # (on etcd, a service whose indices are not allocated yet): served whole
        choose: Callable[[int], tuple[int, ...]]
        if view.zone:
            rings = ZoneRings({i: e.zone or None for i, e in by_index.items()}, k=size)
            choose = functools.partial(_zone_subset, rings, view.zone)
        else:
            choose = functools.partial(_ring_subset, Ring(by_index), size)
        services[name] = SubsetService(name, choose, MappingProxyType(by_index))
        digest.update(f"{name}|{size}|{view.zone}|".encode())
        for backend in sorted(by_index):
            digest.update(f"{backend}={by_index[backend]!r};".encode())
    return SubsetPlan(MappingProxyType(services), digest.hexdigest()[:16]) if services else None


def _zone_subset(rings: ZoneRings, zone: str, proxy: int) -> tuple[int, ...]:
    return rings.subset(proxy, zone=zone)


def _ring_subset(ring: Ring, k: int, proxy: int) -> tuple[int, ...]:
    return ring.subset(proxy, k)


def build_snapshots(
    merged: Merged,
    source: str,
    groups: Mapping[G, View],
    *,
    memo: ResourceMemo | None = None,
    rules: bool = True,
    rest_refresh: float = DEFAULT_REST_REFRESH,
    subsets: Mapping[str, IndexTable] | None = None,
    subset_size: int | None = None,
    grpc_load_reports: bool = False,
) -> dict[G, Snapshot]:
    """The snapshot of each group (by its :class:`View`), all from ``merged`` in one pass; raise
    :class:`ConfigError` naming every problem. Groups with equal views share one snapshot.

    Views differ only in their listeners, so the checks run once: on the raw resources as the
    sources gave them, and on the union of what was built (a resource shared by several views is
    one object, checked once).

    ``rest_refresh``: seconds between the polls of the EDS and RDS config sources of ``rest``
    views (what their bootstraps poll CDS and LDS with: ``pilotfish bootstrap --refresh-ms``).

    ``subsets``: the backend index tables of :func:`subset_tables` (None: made afresh, as for a
    first build); ``subset_size``: the size of services that do not set theirs (None: only those
    that do are subsetted).

    ``grpc_load_reports``: the built EDS clusters of ``grpc`` views ask their clients to report
    load to the server they have them from (``lrs_server: {self: {}}``); the rollout's health
    gate reads those reports. Raw clusters are served as they are.
    """
    views = list(dict.fromkeys(groups.values())) or [View()]
    memo = memo or ResourceMemo()
    rest_source = _rest_source(rest_refresh) if any(v.kind is ClientKind.REST for v in views) else None
    built = encode_for_views(
        merged.services,
        merged.endpoints,
        memo,
        views=[(v.kind, v.zone) for v in views],
        rest_source=rest_source,
        patch=merged.patch,
        grpc_load_reports=grpc_load_reports,
    )
    union: dict[ResourceType, list[Resource]] = {}
    for rtype in TYPES:
        # Views share lists (and resources in them): each distinct one is checked once.
        lists = {id(by_type[rtype]): by_type[rtype] for by_type in built.values() if rtype in by_type}
        if len(lists) == 1:
            union[rtype] = next(iter(lists.values()))
        else:
            union[rtype] = list({id(r): r for found in lists.values() for r in found}.values())
    # The user's own resources, encoded once for every check and view, with their messages.
    raw = {t: memo.raw(t, tuple(merged.resources.get(t, ())), merged.ttls.get(t)) for t in TYPES}
    problems = list(merged.problems)
    problems.extend(_name_clashes(raw, {kind: by_type for (kind, _), by_type in built.items()}))
    problems.extend(_api_listener_clashes(merged))
    problems.extend(_address_clashes(merged))
    problems.extend(_route_problems(merged))
    # Only raw clusters, listeners and route configurations refer to others (built ones are right
    # by construction): a build whose lists of those, and whose names, are the last build's has
    # the same reference problems. Without raw resources there is nothing to name or check.
    if any(merged.resources.values()):
        names: ReferenceNames = (
            *(_names_with(_raw_names(memo, rtype, raw[rtype]), union[rtype]) for rtype in (ENDPOINT, ROUTE, CLUSTER)),
            extension_names(merged.resources.get(EXTENSION_CONFIG, ())),
        )  # type: ignore[assignment]
        referring = tuple(merged.resources.get(t, ()) for t in (CLUSTER, LISTENER, ROUTE))
        check = functools.partial(references_problems, merged.resources, names)
        problems.extend(memo.derived(("references",), (*referring, names), check))
    if rules:
        for rtype, items in raw.items():  # (a type whose list is the last build's: its outcome)
            problems.extend(memo.derived(("rules", rtype), (items,), functools.partial(_raw_rules, memo, rtype, items)))
        problems.extend(check_rules({}, union))
    if problems:
        raise ConfigError(source, list(dict.fromkeys(problems)))
    snapshots: dict[View, Snapshot] = {}
    shared: dict[tuple[ResourceType, ClientKind | None, int], TypeSnapshot] = {}
    for view in views:
        by_type = built[view.kind, view.zone]
        types: dict[TypeUrl, TypeSnapshot] = {}
        for rtype in TYPES:
            # Views that serve the same list (and, for listeners, the same raw ones) share one
            # TypeSnapshot: hashed once, and a response encoded for one group serves every group.
            # (No list at all, or an empty one, is the same to every view.)
            listed = by_type.get(rtype)
            key = (rtype, view.kind if rtype is LISTENER else None, id(listed) if listed else 0)
            if key not in shared:
                # The resources and their hash, derived once from the same list as the last build's
                # (by identity: one endpoint changed leaves the clusters' list as it was).
                served = memo.derived(
                    ("served", rtype, view.kind),
                    (raw[rtype],),
                    functools.partial(_served, memo, raw[rtype], view.kind, rtype),
                )
                derived = (rtype, view.kind, view.zone)
                last = memo.derived(
                    derived,
                    (by_type.get(rtype), served),
                    functools.partial(_type_snapshot, memo, derived, raw, view, by_type, rtype),
                )
                # At the same version too, the very TypeSnapshot of the last build: the cache
                # then knows that nothing waiting on this type has news (and keeps its responses).
                shared[key] = memo.derived(
                    (*derived, "served"), (last, merged.version), functools.partial(last.renewed, merged.version)
                )
            types[rtype.url] = shared[key]
        snapshots[view] = Snapshot(
            MappingProxyType(types),
            explicit_version=merged.version,
            subsets=_subset_plan(
                merged,
                view,
                subsets if subsets is not None else subset_tables(merged, {}, default_size=subset_size),
                subset_size,
            ),
        )
    return {group: snapshots[view] for group, view in groups.items()}


@functools.lru_cache(maxsize=8)
def _rest_source(refresh: float) -> config_source_pb2.ConfigSource:
    """The bootstrap's REST config source as a message: one implementation of what it says."""
    source = config_source_pb2.ConfigSource()
    json_format.ParseDict(rest_config_source(refresh=refresh), source)
    return source


def _patch(memo: ResourceMemo, key: Hashable, rtype: ResourceType, items: _Pairs) -> tuple[RawPatch, Any] | None:
    """How a type's raw list ``items`` differs from the last build's, with what that build derived
    from the list before under ``key`` (its first input); None when ``items`` is not such a patch."""
    patch = memo.raw_patch(rtype, items)
    before = memo.derived_before(key) if patch is not None else None
    if patch is None or before is None or before[0][0] is not patch.before:
        return None
    return patch, before[1]


def _renames(patch: RawPatch, items: _Pairs) -> bool:
    """Whether any resource a patch changed has another name than the one in its place before."""
    return any(patch.before[i][0].name != items[i][0].name for i in patch.changed)


def _raw_rules(memo: ResourceMemo, rtype: ResourceType, items: _Pairs) -> list[Problem]:
    """:func:`check_rules` of a type's raw resources: of the changed ones alone when the list is
    a patch of the last build's and that one broke no rule."""
    patched = _patch(memo, ("rules", rtype), rtype, items)
    if patched is not None and not patched[1]:
        return check_rules({rtype: items}, positions={rtype: patched[0].changed})
    return check_rules({rtype: items})


def _raw_names(memo: ResourceMemo, rtype: ResourceType, items: _Pairs) -> frozenset[str]:
    """The names of a type's raw resources: the last build's set when the list is a patch of its
    list that renames nothing."""

    def make() -> frozenset[str]:
        patched = _patch(memo, key, rtype, items)
        if patched is not None and not _renames(patched[0], items):
            return patched[1]  # type: ignore[no-any-return]
        return frozenset(r.name for r, _ in items)

    key = ("names", rtype)
    return memo.derived(key, (items,), make)


def _names_with(names: frozenset[str], more: list[Resource]) -> frozenset[str]:
    return names.union(r.name for r in more) if more else names


def _served(memo: ResourceMemo, raw: _Pairs, kind: ClientKind, rtype: ResourceType) -> tuple[str, ...]:
    """The hashes of the raw resources of a type that clients of ``kind`` are served (patched,
    when the list is a patch of the last build's: every resource of a type other than listeners
    is served, so the places match)."""
    patched = _patch(memo, ("served", rtype, kind), rtype, raw) if rtype is not LISTENER else None
    if patched is not None:
        patch, before = patched
        hashes = list(before)
        for index in patch.changed:
            hashes[index] = raw[index][0].hash
        return tuple(hashes)
    return tuple(r.hash for r, m in raw if _serves(kind, rtype, m))


def _serves(view_kind: ClientKind, rtype: ResourceType, message: Message) -> bool:
    """Whether clients of a kind are served a raw resource: listeners go to the kind they are for."""
    return rtype is not LISTENER or _is_api_listener(message) == (view_kind is ClientKind.GRPC)


_Pairs = list[tuple[Resource, Message]]
_Raw = Mapping[ResourceType, _Pairs]


def _combined(
    raw: _Raw,
    view: View,
    built: Mapping[ResourceType, list[Resource]],
    types: tuple[ResourceType, ...] = TYPES,
) -> dict[ResourceType, tuple[Resource, ...]]:
    combined: dict[ResourceType, tuple[Resource, ...]] = {}
    for rtype in types:
        served = tuple(r for r, m in raw.get(rtype, ()) if _serves(view.kind, rtype, m))
        names = {r.name for r in served}
        combined[rtype] = (*served, *(r for r in built.get(rtype, []) if r.name not in names))
    return combined


def _type_snapshot(
    memo: ResourceMemo,
    key: Hashable,
    raw: _Raw,
    view: View,
    built: Mapping[ResourceType, list[Resource]],
    rtype: ResourceType,
) -> TypeSnapshot:
    """``rtype``'s resources as ``view`` is served them, versioned by content. When they are raw
    alone and a patch of the last build's that renames nothing, the last build's are patched."""
    items = raw[rtype]
    # The last build's snapshot was made from the served hashes of the list this one patches, with
    # no built list, one resource per name (a name twice: the last wins, made whole).
    served = _patch(memo, ("served", rtype, view.kind), rtype, items) if rtype is not LISTENER else None
    before = memo.derived_before(key) if served is not None and not built.get(rtype) else None
    if (
        served is None
        or before is None
        or before[0][0]
        or before[0][1] is not served[1]
        or len(before[1].resources) != len(items)
        or _renames(served[0], items)
    ):
        return Snapshot.build(_combined(raw, view, built, (rtype,))).types[rtype.url]
    resources = before[1].resources.copy()  # (a MappingProxyType's copy: its dict's, in C)
    for index in served[0].changed:
        resource = items[index][0]
        resources[resource.name] = resource
    content = content_version(resources)
    return TypeSnapshot(rtype, content, MappingProxyType(resources), content)


def _name_clashes(raw: _Raw, built: Mapping[ClientKind, Mapping[ResourceType, list[Resource]]]) -> list[Problem]:
    """Built resources named as a raw resource served to the same clients (only listeners differ
    between kinds: the other types are looked at once)."""
    problems: list[Problem] = []
    for number, (kind, by_type) in enumerate(built.items()):
        for rtype in TYPES if number == 0 else (LISTENER,):
            mine = by_type.get(rtype)
            if not mine:  # (a file of raw resources alone: nothing to walk them for)
                continue
            raw_names: dict[str, int] = {}
            for index, (resource, message) in enumerate(raw.get(rtype, ())):
                if _serves(kind, rtype, message):
                    raw_names.setdefault(resource.name, index)
            if not raw_names:
                continue
            for resource in mine:
                if resource.name in raw_names:
                    problems.append(
                        Problem(
                            f"services.{resource.name}",
                            f"its {rtype.key[:-1]} {resource.name!r} clashes with "
                            f"{rtype.key}[{raw_names[resource.name]}]; rename the service or the resource",
                        )
                    )
    return problems


def _api_listener_clashes(merged: Merged) -> list[Problem]:
    """Two services whose gRPC clients would resolve the same name."""
    problems = []
    owners: dict[str, str] = {}
    for name, target in sorted((name, spec.grpc) for name, spec in merged.services.items() if spec.grpc is not None):
        if target in owners:
            problems.append(
                Problem(
                    f"services.{name}.grpc",
                    f"gRPC clients of services.{owners[target]} resolve "
                    f"xds:///{target} already; give each its own name",
                )
            )
        else:
            owners[target] = name
    return problems


def _address_clashes(merged: Merged) -> list[Problem]:
    """Two listeners on one address (raw or built)."""
    problems = []
    owners: dict[str, str] = {}
    for index, listener in enumerate(merged.resources.get(LISTENER, ())):
        address = _listen_address(listener)
        if address:
            owners.setdefault(address, f"listeners[{index}] (name {listener.name!r})")  # type: ignore[attr-defined]
    for name, (host, port) in sorted(
        (name, spec.listen) for name, spec in merged.services.items() if spec.listen is not None
    ):
        address = f"{host}:{port}"
        if address in owners:
            problems.append(
                Problem(
                    f"services.{name}.listen",
                    f"{address} is already used by {owners[address]}; give each its own address",
                )
            )
        else:
            owners[address] = f"services.{name}"
    return problems


def _route_problems(merged: Merged) -> list[Problem]:
    """What a service's routes and DNS endpoints need of the other services (of every source):
    each route's ``to`` names a service, or a raw cluster; what gRPC clients are sent has no
    STRICT_DNS cluster (they take EDS clusters only); a DNS service asks for no subsetting or
    zone-local routing (Envoy resolves its names: pilotfish never sees their addresses)."""
    problems: list[Problem] = []
    concerned = sorted(
        name
        for name, spec in merged.services.items()
        if spec.routes or spec.grpc is not None or spec.subset_size is not None or spec.zone_local
    )
    if not concerned:  # (a build looks at its 10,000 services once here, and only at their settings)
        return problems
    clusters = {c.name for c in merged.resources.get(CLUSTER, ())}  # type: ignore[attr-defined]
    dns: dict[str, bool] = {}

    def is_dns(name: str) -> bool:
        if name not in dns:
            dns[name] = has_host_names(merged.endpoints.get(name, ()))
        return dns[name]

    for name in concerned:
        spec = merged.services[name]
        if spec.subset_size is not None or spec.zone_local or (spec.grpc is not None and not spec.routes):
            for field_name, value in (("subset_size", spec.subset_size), ("zone_local", spec.zone_local or None)):
                if value is not None and is_dns(name):
                    problems.append(
                        Problem(
                            f"services.{name}.{field_name}",
                            "its endpoints include host names, which Envoy resolves (a STRICT_DNS cluster): "
                            f"pilotfish cannot apply {field_name} to them; leave it out or list IP addresses",
                        )
                    )
            if spec.grpc is not None and not spec.routes and is_dns(name):
                problems.append(
                    Problem(
                        f"services.{name}.grpc",
                        "gRPC clients take EDS clusters only, and this service's endpoints include host names "
                        "(a STRICT_DNS cluster): list IP addresses",
                    )
                )
        for index, route in enumerate(spec.routes):
            for target in route.targets():
                where = f"services.{name}.routes[{index}].to"
                if target not in merged.services and target not in clusters:
                    problems.append(
                        Problem(
                            where,
                            f"services.{name} routes to {target!r}, which is no service (nor cluster): "
                            f"define services.{target} or fix the name",
                        )
                    )
                elif spec.grpc is not None and target in merged.services and is_dns(target):
                    problems.append(
                        Problem(
                            where,
                            f"gRPC clients (grpc: {spec.grpc}) take EDS clusters only, and services.{target}'s "
                            "endpoints include host names (a STRICT_DNS cluster)",
                        )
                    )
    return problems
