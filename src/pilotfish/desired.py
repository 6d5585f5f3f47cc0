"""Desired state, as sources report it, and how it becomes one checked snapshot.

Each source (the snapshot file, the registry API, etcd) reports a :class:`DesiredState`: service
definitions, endpoints per service, and raw Envoy resources. :func:`build_snapshot` merges the
states of all sources and builds the snapshot, refusing anything ambiguous:

- a service defined by two sources (endpoints may come from several: they are merged);
- a built resource whose name clashes with a raw resource;
- two listeners on the same address (Envoy would refuse one, or with SO_REUSEPORT silently split
  traffic between them);
- the cross-reference problems of :func:`pilotfish.validate.check_references`;
- any resource breaking Envoy's own ``validate.rules`` (:func:`pilotfish.validate.check_rules`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from envoy.config.listener.v3 import listener_pb2
from google.protobuf.message import Message

from pilotfish.errors import ConfigError, Problem
from pilotfish.resources import TYPES, ParsedDocument, ResourceType
from pilotfish.resources.builders import ResourceMemo, encode_services
from pilotfish.resources.services import Endpoint, ServiceSpec
from pilotfish.resources.types import CLUSTER, ENDPOINT, LISTENER, ROUTE
from pilotfish.snapshot import Resource, Snapshot
from pilotfish.validate import check_references, check_rules

__all__ = ["DesiredState", "Merged", "build_snapshot", "merge_states"]


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

    def __post_init__(self) -> None:
        # Endpoint order carries no meaning: normalize it so equal sets compare equal. A tuple that is
        # sorted already is kept as it is: consumers tell unchanged services by identity.
        ordered = {}
        for name, found in self.endpoints.items():
            in_order = sorted(found)
            ordered[name] = found if type(found) is tuple and list(found) == in_order else tuple(in_order)
        object.__setattr__(self, "endpoints", ordered)

    @classmethod
    def of_document(cls, document: ParsedDocument) -> DesiredState:
        return cls(services=dict(document.services), endpoints=dict(document.endpoints),
                   resources=dict(document.resources), version=document.version)

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


def merge_states(states: Mapping[str, DesiredState]) -> Merged:
    """Merge sources (in name order, so the result does not depend on arrival order)."""
    problems: list[Problem] = []
    services: dict[str, ServiceSpec] = {}
    defined_by: dict[str, str] = {}
    endpoints: dict[str, dict[str, Endpoint]] = {}
    resources: dict[ResourceType, list[Message]] = {t: [] for t in TYPES}
    for source in sorted(states):
        state = states[source]
        for name, spec in state.services.items():
            if name in services and services[name] != spec:
                problems.append(Problem(f"services.{name}",
                                        f"defined by both {defined_by[name]} and {source}; define it in one place"))
                continue
            services[name] = spec
            defined_by[name] = source
        for name, found in state.endpoints.items():
            by_address = endpoints.setdefault(name, {})
            for endpoint in found:
                by_address.setdefault(endpoint.address, endpoint)
        for rtype, messages in state.resources.items():
            resources[rtype].extend(messages)
    # Endpoints of a service nobody defined: a cluster with default settings, for routes to use.
    for name in endpoints:
        if name not in services:
            services[name] = ServiceSpec(name=name)
    contributing = [s for s in states.values() if not s.is_empty()]
    versions = {s.version for s in contributing}
    version = versions.pop() if len(contributing) == 1 and len(versions) == 1 else None
    return Merged(
        services=services,
        endpoints={name: tuple(sorted(by.values())) for name, by in endpoints.items()},
        resources={t: tuple(m) for t, m in resources.items()},
        version=version,
        problems=tuple(problems),
    )


def _listen_address(listener: Message) -> str | None:
    assert isinstance(listener, listener_pb2.Listener)
    socket = listener.address.socket_address
    return f"{socket.address}:{socket.port_value}" if socket.address else None


def build_snapshot(
    merged: Merged, source: str, *, memo: ResourceMemo | None = None, rules: bool = True
) -> Snapshot:
    """Build the snapshot of merged desired state; raise :class:`ConfigError` naming every problem.

    ``memo`` carries encoded resources of unchanged services over from the previous build.
    ``rules``: check every resource, raw or built, against Envoy's ``validate.rules``
    (:func:`pilotfish.validate.check_rules`); off, such content goes out as it is (for Envoy to NACK).
    """
    problems = list(merged.problems)
    built = encode_services(merged.services, merged.endpoints, memo)
    combined: dict[ResourceType, tuple[Resource, ...]] = {}
    raw_encoded: dict[ResourceType, list[tuple[Resource, Message]]] = {}
    for rtype in TYPES:
        raw = tuple(Resource.of(rtype, m) for m in merged.resources.get(rtype, ()))
        raw_encoded[rtype] = list(zip(raw, merged.resources.get(rtype, ()), strict=True))
        raw_names = {r.name: i for i, r in enumerate(raw)}
        ours = built.get(rtype, [])
        for resource in ours:
            if resource.name in raw_names:
                problems.append(Problem(
                    f"services.{resource.name}",
                    f"its {rtype.key[:-1]} {resource.name!r} clashes with {rtype.key}[{raw_names[resource.name]}]; "
                    "rename the service or the resource"))
        combined[rtype] = (*raw, *(r for r in ours if r.name not in raw_names))

    owners: dict[str, str] = {}
    for index, listener in enumerate(merged.resources.get(LISTENER, ())):
        address = _listen_address(listener)
        if address:
            owners.setdefault(address, f"listeners[{index}] (name {listener.name!r})")  # type: ignore[attr-defined]
    for name in sorted(merged.services):
        spec = merged.services[name]
        if spec.listen is None:
            continue
        address = f"{spec.listen[0]}:{spec.listen[1]}"
        if address in owners:
            problems.append(Problem(f"services.{name}.listen",
                                    f"{address} is already used by {owners[address]}; give each its own address"))
        else:
            owners[address] = f"services.{name}"

    problems.extend(check_references(
        merged.resources,
        more_endpoints=(r.name for r in built.get(ENDPOINT, [])),
        more_routes=(r.name for r in built.get(ROUTE, [])),
        more_clusters=(r.name for r in built.get(CLUSTER, [])),
    ))
    if rules:
        problems.extend(check_rules(raw_encoded, built))
    if problems:
        raise ConfigError(source, problems)
    return Snapshot.build(combined, version=merged.version)
