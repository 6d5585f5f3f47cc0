"""The service registry: instances registered over an API, kept alive by heartbeats.

This module is the registry's state, without I/O (the HTTP API lives in
:mod:`pilotfish.api.registry`, which also checks every change against the merged state of
all sources before it accepts it: :meth:`Registry.undo_point` lets it take a change back).
Services may be defined here (listen address, protocol, settings) or elsewhere (the snapshot
file); instances may be registered for either. An instance registered with a TTL must heartbeat
within it or it is removed; one without a TTL stays until deregistered. Instance ids are
``address:port``, so registering again is idempotent (it updates weight, metadata and TTL). The
numbers of services and instances are bounded (:class:`RegistryLimits`).

**Self-preservation** (after Eureka's). Instances that stop heartbeating one at a time are
normal churn, and they expire. But when many stop at once, the likelier cause is a network
partition between them and pilotfish, not a fleet that died; emptying their services would turn
a partition into an outage. So an expiry pass (:meth:`Registry.expire`) counts the instances
*lost within one window*: those lapsed now (TTL passed, not yet removed) plus those expired in the
last ``window`` seconds. If that count is at least ``min_lapsed`` and more than ``share`` of all
TTL instances (current plus those expired in the window), expiry pauses for every service; if it
is so only within one service (its lapsed plus recently expired, against its TTL instances plus
recently expired), expiry pauses for that service. Paused instances stay registered and served;
a heartbeat renews them as usual. Expiry resumes by itself once the rule no longer holds
(heartbeats came back, or the window passed with the share below the limit), and at once when
the operator turns self-preservation off. Consequences worth knowing: in a partition, up to
``share`` of the instances may expire before the pause starts (each looked like churn), and a
service with fewer than ``min_lapsed`` instances is never preserved. Entering and leaving the
mode is reported by the API (log warning, event ``registry_self_preservation``).
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from pilotfish.build.desired import DesiredState
from pilotfish.errors import ConfigError, Problem
from pilotfish.resources.routes import route_document
from pilotfish.resources.services import Endpoint, ServiceSpec, parse_endpoint, parse_service

__all__ = [
    "Conflict",
    "ExpiryPass",
    "Instance",
    "Preservation",
    "Registry",
    "RegistryFigures",
    "RegistryFull",
    "RegistryLimits",
    "SelfPreservation",
    "StoreUnavailable",
    "UnknownInstance",
    "describe_services",
    "endpoint_document",
    "parse_definition",
    "parse_registration",
]

MAX_TTL = 24 * 3600.0
MAX_METADATA_CHARS = 4096
"""An instance's metadata keys and values together, in characters."""


class StoreUnavailable(Exception):
    """The store that holds the registrations (etcd) could not be reached or did not do what was
    asked; the message says which and why."""


class UnknownInstance(LookupError):
    """No such instance (never registered, deregistered, or expired): register it again."""


class Conflict(Exception):
    """The request is well formed but would make the merged state of all sources invalid."""

    def __init__(self, problems: list[Problem]) -> None:
        self.problems = problems
        super().__init__("; ".join(str(p) for p in problems))


class RegistryFull(Exception):
    """The registry holds as many services or instances as its limits allow."""


@dataclass(frozen=True, slots=True, kw_only=True)
class SelfPreservation:
    """When TTL expiry pauses because too many instances lapse at once (see the module docstring)."""

    enabled: bool = True
    """Off: every lapsed instance expires, however many lapse together."""
    share: float = 0.5
    """Pause when more than this share of the TTL instances (overall, or of one service) is lost
    within one window."""
    window: float = 30.0
    """Seconds within which lapsing instances count as lapsing at once. Make it longer than the
    clients' heartbeat interval: in a partition, instances lapse spread over that interval."""
    min_lapsed: int = 3
    """Never pause for fewer lost instances than this: one or two instances going is churn."""
    recheck: float = 1.0
    """While paused, look again this often (seconds), besides on every heartbeat and change."""

    def verdict(
        self, lapsed: Counter[str], ttl_instances: Counter[str], recently_expired: Counter[str]
    ) -> tuple[bool, list[str], int, int]:
        """Which services' lapsed instances to keep (the rule of the module docstring), from the
        counts per service of lapsed instances, of TTL instances (lapsed included) and of those
        expired within the window: (everywhere, the services held, instances lost within the
        window, TTL instances counted with those expired in the window)."""
        if not self.enabled or not lapsed:
            return False, [], 0, 0
        lost = sum(lapsed.values()) + sum(recently_expired.values())
        total = sum(ttl_instances.values()) + sum(recently_expired.values())
        if lost >= self.min_lapsed and lost > self.share * total:
            return True, sorted(lapsed), lost, total
        held = sorted(
            service
            for service, count in lapsed.items()
            if count + recently_expired[service] >= self.min_lapsed
            and count + recently_expired[service] > self.share * (ttl_instances[service] + recently_expired[service])
        )
        return False, held, lost, total


@dataclass(frozen=True, slots=True, kw_only=True)
class RegistryLimits:
    """Bounds on what clients of the registry API can make it hold."""

    max_services: int = 20_000
    """Services defined or holding instances."""
    max_instances: int = 200_000
    """Instances, over all services."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RegistryFigures:
    """What the metrics show of the registry (``pilotfish_registry_*``): its size now, and counts
    since this process started."""

    services: int
    """Services defined or holding instances."""
    instances: int
    """Instances registered, over all services."""
    registrations: int
    """Registrations accepted by this process (a re-registration counts again)."""
    expired: int
    """Instances whose TTL lapsed and that this process removed (on etcd: the elected replica)."""
    refused: Mapping[int, int]
    """Requests answered with an error, per HTTP status (400, 401, 403, 404, 409, 413, 503, ...)."""
    preserving: bool
    """Self-preservation in force: lapsed instances are kept instead of expired."""


@dataclass(frozen=True, slots=True)
class Instance:
    service: str
    endpoint: Endpoint
    ttl: float | None
    expires: float | None

    @property
    def id(self) -> str:
        return self.endpoint.address

    def describe(self, now: float) -> dict[str, Any]:
        return {
            "id": self.id,
            "service": self.service,
            "address": self.endpoint.host,
            "port": self.endpoint.port,
            "weight": self.endpoint.weight,
            "metadata": dict(self.endpoint.metadata),
            "zone": self.endpoint.zone,
            "ttl": self.ttl,
            "expires_in": None if self.expires is None else round(max(0.0, self.expires - now), 3),
        }


@dataclass(frozen=True, slots=True)
class Preservation:
    """Self-preservation in force: lapsed instances kept instead of expired."""

    everywhere: bool
    """True: expiry paused for every service; False: only for ``services``."""
    services: tuple[str, ...]
    """The services whose lapsed instances are kept."""
    lapsed: int
    """Lapsed instances kept."""
    lost_in_window: int
    """Lapsed plus expired within the window (overall)."""
    ttl_instances: int
    """TTL instances, current plus expired within the window (overall)."""

    def describe(self) -> dict[str, Any]:
        return {
            "everywhere": self.everywhere,
            "services": list(self.services[:20]),
            "service_count": len(self.services),
            "lapsed": self.lapsed,
            "lost_in_window": self.lost_in_window,
            "ttl_instances": self.ttl_instances,
        }


@dataclass(frozen=True, slots=True)
class ExpiryPass:
    """What one :meth:`Registry.expire` did."""

    expired: list[Instance] = field(default_factory=list)
    preservation: Preservation | None = None
    """Self-preservation in force after the pass (None: not in force)."""
    entered: bool = False
    """Self-preservation started with this pass."""
    exited: bool = False
    """Self-preservation ended with this pass."""


def _spec_fields(spec: ServiceSpec) -> dict[str, Any]:
    return {
        "listen": f"{spec.listen[0]}:{spec.listen[1]}" if spec.listen else None,
        "protocol": spec.protocol,
        "connect_timeout": spec.connect_timeout,
        "timeout": spec.timeout,
        "retries": spec.retries,
        "upstream_protocol": spec.upstream_protocol,
        "health_check": None
        if spec.health_check is None
        else {
            "path": spec.health_check.path,
            "interval": spec.health_check.interval,
            "timeout": spec.health_check.timeout,
        },
        "grpc": spec.grpc,
        "zone_local": spec.zone_local,
        "subset_size": spec.subset_size,
        "routes": [route_document(route) for route in spec.routes] or None,
    }


def parse_definition(name: str, body: Any) -> ServiceSpec:
    """A service definition sent to the registry API; :class:`ConfigError` naming the bad field."""
    if isinstance(body, dict) and "endpoints" in body:
        raise ConfigError("request", [Problem("endpoints", "register instances at /v1/services/NAME/instances")])
    spec, _, problems = parse_service(name, body, "")
    if problems or spec is None:
        raise ConfigError("request", [Problem(p.where.lstrip("."), p.message) for p in problems])
    return spec


def parse_registration(service: str, body: Any) -> tuple[Endpoint, float | None]:
    """An instance registration sent to the registry API: (its endpoint, its TTL or None);
    :class:`ConfigError` naming the bad field."""
    problems: list[Problem] = []
    if not service or not all(c.isalnum() or c in "-_." for c in service):
        problems.append(Problem("service", "a service name uses letters, digits, '-', '_' and '.' only"))
    ttl: float | None = None
    fields = body
    if isinstance(body, dict):
        fields = {k: v for k, v in body.items() if k != "ttl"}
        raw_ttl = body.get("ttl")
        if raw_ttl is not None:
            if isinstance(raw_ttl, bool) or not isinstance(raw_ttl, int | float) or not 0 < raw_ttl <= MAX_TTL:
                problems.append(Problem("ttl", f"must be a number of seconds from 0 to {MAX_TTL:.0f}"))
            else:
                ttl = float(raw_ttl)
        metadata = body.get("metadata")
        if (
            isinstance(metadata, dict)
            and sum(len(str(k)) + len(str(v)) for k, v in metadata.items()) > MAX_METADATA_CHARS
        ):
            problems.append(
                Problem(
                    "metadata",
                    f"keys and values may hold {MAX_METADATA_CHARS} characters in all; keep large data elsewhere",
                )
            )
    if not isinstance(body, dict):
        problems.append(Problem("", "the body must be a JSON object with address and port"))
        endpoint = None
    else:
        endpoint = parse_endpoint(fields, "", problems)
    if problems or endpoint is None:
        raise ConfigError("request", [Problem(p.where.lstrip("."), p.message) for p in problems])
    return endpoint, ttl


def endpoint_document(endpoint: Endpoint, ttl: float | None) -> dict[str, Any]:
    """An instance as the JSON the registry stores in etcd (what :func:`parse_registration` reads)."""
    document: dict[str, Any] = {"address": endpoint.host, "port": endpoint.port}
    if endpoint.weight != 1:
        document["weight"] = endpoint.weight
    if endpoint.metadata:
        document["metadata"] = dict(endpoint.metadata)
    if endpoint.zone:
        document["zone"] = endpoint.zone
    if ttl is not None:
        document["ttl"] = ttl
    return document


def describe_services(
    names: list[str], specs: dict[str, ServiceSpec], instances: dict[str, list[Instance]], now: float
) -> dict[str, Any]:
    """The registry API's view of ``names``: definition fields and instances (sorted by id)."""
    out = {}
    for service in names:
        spec = specs.get(service)
        out[service] = {
            "defined": spec is not None,
            **(_spec_fields(spec) if spec else {}),
            "instances": [i.describe(now) for i in sorted(instances.get(service, ()), key=lambda i: i.id)],
        }
    return out


class Registry:
    """Registered services and instances."""

    def __init__(
        self,
        *,
        clock: Callable[[], float],
        self_preservation: SelfPreservation | None = None,
        limits: RegistryLimits | None = None,
    ) -> None:
        self._clock = clock
        self.self_preservation = self_preservation or SelfPreservation()
        self.limits = limits or RegistryLimits()
        self._specs: dict[str, ServiceSpec] = {}
        self._instances: dict[str, dict[str, Instance]] = {}
        self._instance_count = 0
        self._endpoints: dict[str, tuple[Endpoint, ...]] = {}
        """Each service's endpoints as :meth:`state` reports them; a changed service's entry is dropped."""
        self._last: DesiredState | None = None
        """The last state made: its endpoint tuples, reused, need no sorting again."""
        self._recent: deque[tuple[float, str]] = deque(maxlen=self.limits.max_instances)
        """(when, service) of each expiry within the self-preservation window, oldest first."""
        self._preservation: Preservation | None = None
        self.expired_count = 0
        """Instances :meth:`expire` removed since this registry was made."""
        self._recheck_at = 0.0
        """While self-preservation is in force: when to look again."""

    def now(self) -> float:
        return self._clock()

    # -- services --------------------------------------------------------------------------

    def define(self, name: str, body: Any) -> ServiceSpec:
        """Define (or redefine) a service; raise :class:`ConfigError` naming the bad field."""
        spec = parse_definition(name, body)
        self._make_room_for_service(name)
        self._specs[name] = spec
        return spec

    def undefine(self, name: str) -> bool:
        """Forget a service's definition and its instances; False if it was unknown."""
        known = name in self._specs or name in self._instances
        self._specs.pop(name, None)
        self._instance_count -= len(self._instances.pop(name, {}))
        self._endpoints.pop(name, None)
        return known

    def _make_room_for_service(self, name: str) -> None:
        if not self.knows(name) and len(set(self._specs) | set(self._instances)) >= self.limits.max_services:
            raise RegistryFull(
                f"the registry holds its limit of {self.limits.max_services} services "
                "(max_services): remove unused services or raise the limit"
            )

    # -- instances -------------------------------------------------------------------------

    def register(self, service: str, body: Any) -> Instance:
        """Register (or re-register) an instance; raise :class:`ConfigError` naming the bad field."""
        endpoint, ttl = parse_registration(service, body)
        by_id = self._instances.get(service, {})
        if endpoint.address not in by_id:
            self._make_room_for_service(service)
            if self._instance_count >= self.limits.max_instances:
                raise RegistryFull(
                    f"the registry holds its limit of {self.limits.max_instances} instances "
                    "(max_instances): deregister unused instances or raise the limit"
                )
        now = self._clock()
        instance = Instance(service, endpoint, ttl, None if ttl is None else now + ttl)
        self._put(instance)
        return instance

    def heartbeat(self, service: str, instance_id: str) -> Instance:
        instance = self._instances.get(service, {}).get(instance_id)
        if instance is None:
            raise UnknownInstance(f"no instance {instance_id} of service {service!r}: register it again")
        if instance.ttl is not None:
            instance = replace(instance, expires=self._clock() + instance.ttl)
            self._instances[service][instance_id] = instance
        return instance

    def deregister(self, service: str, instance_id: str) -> None:
        instances = self._instances.get(service, {})
        if instance_id not in instances:
            raise UnknownInstance(f"no instance {instance_id} of service {service!r}")
        del instances[instance_id]
        self._instance_count -= 1
        self._endpoints.pop(service, None)
        if not instances:
            del self._instances[service]

    def keep_known(self, service: str) -> None:
        """Keep ``service`` in the registry's state with no instances (its cluster stays, empty)."""
        self._instances.setdefault(service, {})
        self._endpoints.pop(service, None)

    def _put(self, instance: Instance) -> None:
        by_id = self._instances.setdefault(instance.service, {})
        if instance.id not in by_id:
            self._instance_count += 1
        by_id[instance.id] = instance
        self._endpoints.pop(instance.service, None)

    def undo_point(self, service: str) -> Callable[[], None]:
        """A function that puts ``service`` (definition and instances) back as it is now.

        Every change through this class touches one service, so this is what taking a change
        back needs; it costs a copy of that service's instances.
        """
        spec = self._specs.get(service)
        instances = self._instances.get(service)
        saved = None if instances is None else dict(instances)

        def undo() -> None:
            if spec is None:
                self._specs.pop(service, None)
            else:
                self._specs[service] = spec
            self._instance_count -= len(self._instances.pop(service, {}))
            self._endpoints.pop(service, None)
            if saved is not None:
                self._instances[service] = dict(saved)
                self._instance_count += len(saved)

        return undo

    # -- expiry ----------------------------------------------------------------------------

    def set_self_preservation(self, enabled: bool) -> None:
        """Turn self-preservation on or off (the next :meth:`expire` applies it)."""
        self.self_preservation = replace(self.self_preservation, enabled=enabled)

    @property
    def preservation(self) -> Preservation | None:
        """Self-preservation in force since the last :meth:`expire` (None: not in force)."""
        return self._preservation

    def expire(self) -> ExpiryPass:
        """Remove instances whose TTL lapsed, unless self-preservation keeps them (module docstring)."""
        now = self._clock()
        rule = self.self_preservation
        while self._recent and self._recent[0][0] <= now - rule.window:
            self._recent.popleft()
        lapsed: dict[str, list[Instance]] = {}
        ttl_per_service: Counter[str] = Counter()
        for service, by_id in self._instances.items():
            for instance in by_id.values():
                if instance.expires is not None:
                    ttl_per_service[service] += 1
                    if instance.expires <= now:
                        lapsed.setdefault(service, []).append(instance)
        everywhere, held, lost, ttl_total = rule.verdict(
            Counter({service: len(found) for service, found in lapsed.items()}),
            ttl_per_service,
            Counter(service for _, service in self._recent),
        )
        expired: list[Instance] = []
        for service, found in lapsed.items():
            if service in held:
                continue
            for instance in found:
                self.deregister(service, instance.id)
                self._recent.append((now, service))
                expired.append(instance)
        self.expired_count += len(expired)
        before = self._preservation
        self._recheck_at = now + rule.recheck
        self._preservation = (
            None
            if not held
            else Preservation(
                everywhere=everywhere,
                services=tuple(held),
                lapsed=sum(len(lapsed[s]) for s in held),
                lost_in_window=lost,
                ttl_instances=ttl_total,
            )
        )
        return ExpiryPass(
            expired,
            self._preservation,
            entered=before is None and self._preservation is not None,
            exited=before is not None and self._preservation is None,
        )

    def next_expiry(self) -> float | None:
        """When :meth:`expire` next has something to do (None: nothing until a change)."""
        now = self._clock()
        times = [
            i.expires
            for by_id in self._instances.values()
            for i in by_id.values()
            if i.expires is not None and (self._preservation is None or i.expires > now)
        ]
        if self._preservation is not None:
            times.append(self._recheck_at)
        return min(times) if times else None

    # -- views -----------------------------------------------------------------------------

    def state(self) -> DesiredState:
        """The registry's whole desired state (the endpoint lists of unchanged services are reused)."""
        cached = self._endpoints
        for name, by_id in self._instances.items():
            if name not in cached:
                cached[name] = tuple(sorted(i.endpoint for i in by_id.values()))
        last = self._last
        self._last = DesiredState(
            services=dict(self._specs), endpoints=dict(cached), known=last.endpoints if last is not None else None
        )
        return self._last

    def describe(self, name: str | None = None) -> dict[str, Any]:
        names = sorted(set(self._specs) | set(self._instances)) if name is None else [name]
        return describe_services(
            names,
            self._specs,
            {n: list(by_id.values()) for n, by_id in self._instances.items() if n in names},
            self._clock(),
        )

    def knows(self, name: str) -> bool:
        return name in self._specs or name in self._instances

    def census(self) -> tuple[int, int]:
        """(services defined or holding instances, instances)."""
        return len(self._specs.keys() | self._instances.keys()), self._instance_count
