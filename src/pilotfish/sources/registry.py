"""The service registry: instances registered over an API, kept alive by heartbeats.

This module is the registry's state, without I/O (the HTTP API lives in
:mod:`pilotfish.server.registry_api`). Services may be defined here (listen address, protocol,
settings) or elsewhere (the snapshot file); instances may be registered for either. An instance
registered with a TTL must heartbeat within it or it is removed; one without a TTL stays until
deregistered. Instance ids are ``address:port``, so registering again is idempotent (it updates
weight, metadata and TTL).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pilotfish.desired import DesiredState
from pilotfish.errors import ConfigError, Problem
from pilotfish.resources.services import Endpoint, ServiceSpec, parse_endpoint, parse_service

__all__ = ["Instance", "Registry", "UnknownInstance"]

MAX_TTL = 24 * 3600.0


class UnknownInstance(LookupError):
    """No such instance (never registered, deregistered, or expired): register it again."""


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
            "ttl": self.ttl,
            "expires_in": None if self.expires is None else round(max(0.0, self.expires - now), 3),
        }


def _spec_fields(spec: ServiceSpec) -> dict[str, Any]:
    return {
        "listen": f"{spec.listen[0]}:{spec.listen[1]}" if spec.listen else None,
        "protocol": spec.protocol,
        "connect_timeout": spec.connect_timeout,
        "timeout": spec.timeout,
        "retries": spec.retries,
        "upstream_protocol": spec.upstream_protocol,
        "health_check": None if spec.health_check is None else {
            "path": spec.health_check.path, "interval": spec.health_check.interval,
            "timeout": spec.health_check.timeout},
    }


class Registry:
    """Registered services and instances. Every mutation returns whether the state changed."""

    def __init__(self, *, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._specs: dict[str, ServiceSpec] = {}
        self._instances: dict[str, dict[str, Instance]] = {}

    def now(self) -> float:
        return self._clock()

    # -- services --------------------------------------------------------------------------

    def define(self, name: str, body: Any) -> ServiceSpec:
        """Define (or redefine) a service; raise :class:`ConfigError` naming the bad field."""
        if isinstance(body, dict) and "endpoints" in body:
            raise ConfigError("request", [Problem("endpoints", "register instances at /v1/services/NAME/instances")])
        spec, _, problems = parse_service(name, body, "")
        if problems or spec is None:
            raise ConfigError("request", [Problem(p.where.lstrip("."), p.message) for p in problems])
        self._specs[name] = spec
        return spec

    def undefine(self, name: str) -> bool:
        """Forget a service's definition and its instances; False if it was unknown."""
        known = name in self._specs or name in self._instances
        self._specs.pop(name, None)
        self._instances.pop(name, None)
        return known

    # -- instances -------------------------------------------------------------------------

    def register(self, service: str, body: Any) -> Instance:
        """Register (or re-register) an instance; raise :class:`ConfigError` naming the bad field."""
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
        if not isinstance(body, dict):
            problems.append(Problem("", "the body must be a JSON object with address and port"))
            endpoint = None
        else:
            endpoint = parse_endpoint(fields, "", problems)
        if problems or endpoint is None:
            raise ConfigError("request", [Problem(p.where.lstrip("."), p.message) for p in problems])
        now = self._clock()
        instance = Instance(service, endpoint, ttl, None if ttl is None else now + ttl)
        self._instances.setdefault(service, {})[instance.id] = instance
        return instance

    def heartbeat(self, service: str, instance_id: str) -> Instance:
        instance = self._instances.get(service, {}).get(instance_id)
        if instance is None:
            raise UnknownInstance(f"no instance {instance_id} of service {service!r}: register it again")
        if instance.ttl is not None:
            instance = Instance(instance.service, instance.endpoint, instance.ttl, self._clock() + instance.ttl)
            self._instances[service][instance_id] = instance
        return instance

    def deregister(self, service: str, instance_id: str) -> None:
        instances = self._instances.get(service, {})
        if instance_id not in instances:
            raise UnknownInstance(f"no instance {instance_id} of service {service!r}")
        del instances[instance_id]
        if not instances:
            del self._instances[service]

    def expire(self) -> list[Instance]:
        """Remove instances whose TTL lapsed; return them."""
        now = self._clock()
        expired = [i for by_id in self._instances.values() for i in by_id.values()
                   if i.expires is not None and i.expires <= now]
        for instance in expired:
            self.deregister(instance.service, instance.id)
        return expired

    def next_expiry(self) -> float | None:
        times = [i.expires for by_id in self._instances.values() for i in by_id.values() if i.expires is not None]
        return min(times) if times else None

    # -- views -----------------------------------------------------------------------------

    def state(self) -> DesiredState:
        return DesiredState(
            services=dict(self._specs),
            endpoints={name: tuple(i.endpoint for i in by_id.values()) for name, by_id in self._instances.items()},
        )

    def describe(self, name: str | None = None) -> dict[str, Any]:
        now = self._clock()
        names = sorted(set(self._specs) | set(self._instances)) if name is None else [name]
        out = {}
        for service in names:
            spec = self._specs.get(service)
            out[service] = {
                "defined": spec is not None,
                **(_spec_fields(spec) if spec else {}),
                "instances": [i.describe(now) for _, i in sorted(self._instances.get(service, {}).items())],
            }
        return out

    def knows(self, name: str) -> bool:
        return name in self._specs or name in self._instances
