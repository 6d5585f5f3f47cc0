"""The services model: what users describe instead of Envoy internals.

A service has a name, optionally an address where Envoy accepts its traffic (``listen``), a
protocol (``http``: connection manager + router; ``tcp``: tcp_proxy), settings, an HTTP
listener's route table (``routes``, :mod:`pilotfish.resources.routes`; none: every request to the
service itself), and endpoints: IP addresses, or host names that Envoy resolves (a service with
one is built as a STRICT_DNS cluster holding its endpoints, see :func:`has_host_names`).
Every source (snapshot file, registry API, etcd) produces this shape; the builders in
:mod:`pilotfish.resources.builders` turn it into listeners, routes, clusters and endpoints.

Parsing is strict and reports every problem with where it is (``services.web.endpoints[1].port``).
"""

from __future__ import annotations

import ipaddress
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

from pilotfish.errors import Problem

if TYPE_CHECKING:
    from pilotfish.resources.routes import Route

__all__ = [
    "MAX_WEIGHT",
    "MAX_ZONE",
    "UNRESOLVED_NAME",
    "Endpoint",
    "HealthCheck",
    "ServiceSpec",
    "has_host_names",
    "host_names",
    "is_host_name",
    "is_service_name",
    "is_zone",
    "parse_endpoint",
    "parse_int",
    "parse_seconds",
    "parse_service",
    "parse_services",
]

PROTOCOLS = ("http", "tcp")
MAX_SECONDS = 86400.0
"""The longest duration a setting accepts."""
UPSTREAM_PROTOCOLS = ("http1", "http2")


class Endpoint(NamedTuple):
    """One instance of a service.

    A named tuple rather than a dataclass: fleets have hundreds of thousands of endpoints, and
    tuple hashing, equality and ordering run in C. Endpoints are kept sorted as tuples: by host,
    then port (an address is unique within a service).
    """

    host: str
    port: int
    weight: int = 1
    metadata: tuple[tuple[str, str], ...] = ()
    """Sorted (key, value) pairs, published as Envoy endpoint metadata under ``pilotfish``."""
    zone: str = ""
    """The zone the endpoint runs in (its locality); "": none. See :attr:`ServiceSpec.zone_local`."""

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"


@dataclass(frozen=True, slots=True)
class HealthCheck:
    """Active HTTP health checking of a service's endpoints."""

    path: str = "/healthz"
    interval: float = 5.0
    timeout: float = 1.0
    unhealthy_threshold: int = 2
    healthy_threshold: int = 1


@dataclass(frozen=True, slots=True, kw_only=True)
class ServiceSpec:
    """A service's definition, without its endpoints (they may come from other sources)."""

    name: str
    listen: tuple[str, int] | None = None
    """Where Envoy accepts the service's traffic; None: a cluster only (for routes to use)."""
    protocol: str = "http"
    connect_timeout: float = 1.0
    """Seconds to establish an upstream connection."""
    timeout: float = 15.0
    """HTTP: seconds for a whole request (0 = no limit)."""
    retries: int = 2
    """HTTP: retries of requests that never reached an upstream (connect failure, refused stream)."""
    upstream_protocol: str = "http1"
    """HTTP: how Envoy talks to the endpoints: ``http1`` or ``http2`` (h2c)."""
    health_check: HealthCheck | None = None
    zone_local: bool = False
    """Clients of a node group that has a zone get only the endpoints in that zone (all of them
    while the zone has none, so the service stays reachable)."""
    grpc: str | None = None
    """The name proxyless gRPC clients resolve (``xds:///NAME``): an LDS listener of that name with
    an ``api_listener`` is built for them; None: none (see :mod:`pilotfish.resources.builders`)."""
    subset_size: int | None = None
    """Each proxy gets its own ``subset_size`` endpoints of the service (Ringsteady subsetting,
    :mod:`pilotfish.build.subsetting`); None: every endpoint (or the server's ``--subset-size``)."""
    routes: tuple[Route, ...] = ()
    """HTTP: the listener's route table, first match wins (:mod:`pilotfish.resources.routes`);
    empty: every request to the service itself."""


def _where(prefix: str, key: str) -> str:
    return f"{prefix}.{key}" if prefix else key


def _seconds(value: Any, where: str, problems: list[Problem], *, allow_zero: bool = False) -> float | None:
    if isinstance(value, str) and value.endswith("ms"):
        text, scale = value[:-2], 0.001
    elif isinstance(value, str) and value.endswith("s"):
        text, scale = value[:-1], 1.0
    else:
        text, scale = value, 1.0
    try:
        seconds = float(text) * scale
    except (TypeError, ValueError, OverflowError):
        seconds = math.nan
    if isinstance(value, bool) or not math.isfinite(seconds):
        problems.append(Problem(where, f"expected a duration such as 250ms, 1.5s or 2, got {value!r}"))
        return None
    if seconds > MAX_SECONDS:
        problems.append(Problem(where, f"must be at most {MAX_SECONDS:.0f}s (a day), got {value!r}"))
        return None
    if seconds < 0 or (seconds == 0 and not allow_zero):
        problems.append(Problem(where, f"must be {'>= 0' if allow_zero else '> 0'}, got {value!r}"))
        return None
    return seconds


def _int(value: Any, where: str, problems: list[Problem], low: int, high: int) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int):
        problems.append(Problem(where, f"expected a whole number from {low} to {high}, got {value!r}"))
        return None
    if not low <= value <= high:
        problems.append(Problem(where, f"must be from {low} to {high}, got {value}"))
        return None
    return value


parse_seconds = _seconds
parse_int = _int


def is_ip(host: str) -> bool:
    """Whether ``host`` is an IP address (else an endpoint's host is a name Envoy resolves)."""
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


UNRESOLVED_NAME = "unresolved_name"
"""Endpoint metadata of an IP address served in place of a host name that stopped resolving (its
last good address, :mod:`pilotfish.reconcile.names`): the name. Its service stays STRICT_DNS."""


def _is_name(host: str) -> bool:
    """Whether a host :func:`parse_endpoint` accepted is a name, without parsing it (``ipaddress``
    costs 0.3 s per 100,000 endpoints, this 0.02 s): an IPv6 address has a ':', an IPv4 address
    is digits and dots only, and a name's last label is never all digits."""
    return ":" not in host and not host.replace(".", "").isdigit()


def has_host_names(endpoints: Iterable[Endpoint]) -> bool:
    """Whether any of a service's endpoints is a host name (or the last good address of one,
    :data:`UNRESOLVED_NAME`): its cluster is then STRICT_DNS, with the endpoints in it (Envoy
    resolves them), not EDS (see :mod:`pilotfish.resources.builders`). Builds ask this of many
    services: it parses no address."""
    for endpoint in endpoints:
        if _is_name(endpoint.host) or (
            endpoint.metadata and any(key == UNRESOLVED_NAME for key, _ in endpoint.metadata)
        ):
            return True
    return False


def host_names(endpoints: Iterable[Endpoint]) -> set[str]:
    """The host names among a service's endpoints."""
    return {endpoint.host for endpoint in endpoints if _is_name(endpoint.host)}


def is_host_name(value: Any) -> bool:
    """Whether ``value`` is a DNS host name: dot-separated labels of letters, digits and '-' (not
    first or last), at most 63 each and 253 in all, an optional final dot; the last label not all
    digits (``10.0.0.300`` is a mistyped IP address, not a name)."""
    if not isinstance(value, str) or not value or len(value) > 253:
        return False
    labels = (value[:-1] if value.endswith(".") else value).split(".")
    for label in labels:
        if not 0 < len(label) <= 63 or label[0] == "-" or label[-1] == "-":
            return False
        if not all(c.isascii() and (c.isalnum() or c == "-") for c in label):
            return False
    return not labels[-1].isdigit()


def _host(value: Any, where: str, problems: list[Problem], *, names: bool = False) -> str | None:
    expected = "an IP address or a host name" if names else "an IP address"
    if not isinstance(value, str) or not value:
        problems.append(Problem(where, f"expected {expected}, got {value!r}"))
        return None
    if is_ip(value) or (names and is_host_name(value)):
        return value
    if names and value.rsplit(".", 1)[-1].isdigit():
        reason = (
            f"not an IP address (four numbers from 0 to 255), nor a host name (its last label is a number): {value!r}"
        )
    elif names:
        reason = (
            "expected an IP address or a host name (dot-separated labels of letters, digits and '-', "
            f"at most 63 each, 253 in all; not ending in a number), got {value!r}"
        )
    else:
        reason = f"expected an IP address (Envoy binds listeners to addresses, not names), got {value!r}"
    problems.append(Problem(where, reason))
    return None


def _host_port(value: Any, where: str, problems: list[Problem], *, names: bool = False) -> tuple[str, int] | None:
    if not isinstance(value, str) or ":" not in value:
        problems.append(Problem(where, f"expected HOST:PORT such as 127.0.0.1:9001, got {value!r}"))
        return None
    host, _, port_text = value.rpartition(":")
    host = host.strip("[]")
    found = len(problems)
    checked_host = _host(host, where, problems, names=names)
    port = _int(int(port_text) if port_text.isdigit() else port_text, where + " port", problems, 1, 65535)
    if len(problems) > found or checked_host is None or port is None:
        return None
    return checked_host, port


def parse_endpoint(value: Any, where: str, problems: list[Problem]) -> Endpoint | None:
    """``"host:port"`` or ``{address, port, weight?, metadata?}``."""
    if isinstance(value, str):
        parsed = _host_port(value, where, problems, names=True)
        return Endpoint(*parsed) if parsed else None
    if not isinstance(value, dict):
        problems.append(Problem(where, f"expected HOST:PORT or a mapping with address and port, got {value!r}"))
        return None
    found = len(problems)
    unknown = sorted(set(map(str, value)) - {"address", "port", "weight", "metadata", "zone"})
    if unknown:
        expected = "address, port, weight, metadata, zone"
        problems.append(Problem(where, f"unknown field(s) {', '.join(unknown)}; expected {expected}"))
    if "address" not in value:
        problems.append(Problem(_where(where, "address"), "is required"))
    if "port" not in value:
        problems.append(Problem(_where(where, "port"), "is required"))
    host = _host(value.get("address"), _where(where, "address"), problems, names=True) if "address" in value else None
    port = _int(value.get("port"), _where(where, "port"), problems, 1, 65535) if "port" in value else None
    weight = _int(value.get("weight", 1), _where(where, "weight"), problems, 1, MAX_WEIGHT)
    metadata_value = value.get("metadata", {})
    metadata: tuple[tuple[str, str], ...] = ()
    if not isinstance(metadata_value, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata_value.items()
    ):
        problems.append(Problem(_where(where, "metadata"), "expected a mapping of strings to strings"))
    elif UNRESOLVED_NAME in metadata_value:
        problems.append(
            Problem(
                _where(where, f"metadata.{UNRESOLVED_NAME}"),
                "pilotfish's own key (it marks the last good address of a name that stopped resolving): use another",
            )
        )
    else:
        metadata = tuple(sorted(metadata_value.items()))
    zone = value.get("zone", "")
    if not is_zone(zone):
        problems.append(
            Problem(
                _where(where, "zone"),
                f"expected a zone name (letters, digits, '-', '_', '.', at most {MAX_ZONE}), got {zone!r}",
            )
        )
    if len(problems) > found or host is None or port is None or weight is None:
        return None
    return Endpoint(host, port, weight, metadata, zone)


MAX_ZONE = 128
"""The longest zone name accepted."""
MAX_WEIGHT = 128
"""The largest endpoint weight accepted (Envoy's load balancers take 1 to 128)."""


def is_zone(value: Any) -> bool:
    """Whether ``value`` is a zone name ("" included: no zone)."""
    return isinstance(value, str) and len(value) <= MAX_ZONE and all(c.isalnum() or c in "-_." for c in value)


_SERVICE_FIELDS = (
    "listen",
    "protocol",
    "endpoints",
    "connect_timeout",
    "timeout",
    "retries",
    "upstream_protocol",
    "health_check",
    "grpc",
    "zone_local",
    "subset_size",
    "routes",
)
MAX_SUBSET = 1000
"""The largest ``subset_size`` accepted (a proxy connecting to more endpoints gains nothing by a subset)."""
MAX_NAME = 253
"""The longest service or gRPC target name accepted (a DNS name's limit)."""


def is_service_name(name: Any) -> bool:
    """Whether ``name`` may name a service (and so its cluster, listener and route)."""
    return isinstance(name, str) and 0 < len(name) <= MAX_NAME and all(c.isalnum() or c in "-_." for c in name)


def _grpc_target(value: Any, name: str, where: str, problems: list[Problem]) -> str | None:
    """``grpc: true`` -> the service's own name; ``grpc: NAME`` -> NAME; false/null -> None."""
    if value is None or value is False:
        return None
    if value is True:
        return name
    if (
        not isinstance(value, str)
        or not value
        or len(value) > MAX_NAME
        or not all(c.isalnum() or c in "-_.:" for c in value)
    ):
        problems.append(
            Problem(
                where,
                "expected true, false or the name gRPC clients resolve (xds:///NAME): "
                f"letters, digits, '-', '_', '.' and ':', at most {MAX_NAME}, got {value!r}",
            )
        )
        return None
    return value


def parse_service(name: str, value: Any, where: str) -> tuple[ServiceSpec | None, tuple[Endpoint, ...], list[Problem]]:
    """One service: its definition, its endpoints, and the problems found."""
    problems: list[Problem] = []
    if value is None:
        value = {}
    if not isinstance(value, dict):
        return None, (), [Problem(where, f"expected a mapping of service settings, got {type(value).__name__}")]
    unknown = sorted(set(map(str, value)) - set(_SERVICE_FIELDS))
    if unknown:
        problems.append(Problem(where, f"unknown field(s) {', '.join(unknown)}; expected {', '.join(_SERVICE_FIELDS)}"))
    if not is_service_name(name):
        problems.append(
            Problem(where, f"a service name uses letters, digits, '-', '_' and '.' only, at most {MAX_NAME} of them")
        )
    listen = None
    if value.get("listen") is not None:
        listen = _host_port(value["listen"], _where(where, "listen"), problems)
    protocol = value.get("protocol", "http")
    if protocol not in PROTOCOLS:
        problems.append(Problem(_where(where, "protocol"), f"must be one of {', '.join(PROTOCOLS)}, got {protocol!r}"))
    upstream = value.get("upstream_protocol", "http1")
    if upstream not in UPSTREAM_PROTOCOLS:
        problems.append(
            Problem(
                _where(where, "upstream_protocol"), f"must be one of {', '.join(UPSTREAM_PROTOCOLS)}, got {upstream!r}"
            )
        )
    connect_timeout = _seconds(value.get("connect_timeout", 1.0), _where(where, "connect_timeout"), problems)
    timeout = _seconds(value.get("timeout", 15.0), _where(where, "timeout"), problems, allow_zero=True)
    retries = _int(value.get("retries", 2), _where(where, "retries"), problems, 0, 10)
    grpc = _grpc_target(value.get("grpc"), name, _where(where, "grpc"), problems)
    if grpc is not None and protocol == "tcp":
        problems.append(
            Problem(_where(where, "grpc"), "gRPC clients need protocol http (gRPC runs over HTTP/2), not tcp")
        )
    zone_local = value.get("zone_local", False)
    if not isinstance(zone_local, bool):
        problems.append(Problem(_where(where, "zone_local"), f"expected true or false, got {zone_local!r}"))
    subset_size = None
    if value.get("subset_size") is not None:
        subset_size = _int(value["subset_size"], _where(where, "subset_size"), problems, 1, MAX_SUBSET)
    health = None
    if value.get("health_check") is not None:
        health = _health_check(value["health_check"], _where(where, "health_check"), problems)
    routes = _routes(value, protocol, grpc, where, problems)
    endpoints = _endpoints(value.get("endpoints", []), where, problems)
    if problems or connect_timeout is None or timeout is None or retries is None:
        return None, (), problems
    spec = ServiceSpec(
        name=name,
        listen=listen,
        protocol=protocol,
        connect_timeout=connect_timeout,
        timeout=timeout,
        retries=retries,
        upstream_protocol=upstream,
        health_check=health,
        grpc=grpc,
        zone_local=zone_local is True,
        subset_size=subset_size,
        routes=routes,
    )
    return spec, endpoints, problems


def _routes(
    value: dict[str, Any], protocol: Any, grpc: str | None, where: str, problems: list[Problem]
) -> tuple[Route, ...]:
    from pilotfish.resources.routes import parse_routes

    if value.get("routes") is None:
        return ()
    at = _where(where, "routes")
    if protocol != "http":
        problems.append(Problem(at, "routes need protocol http (a tcp listener forwards connections, not requests)"))
        return ()
    if value.get("listen") is None and grpc is None:
        problems.append(Problem(at, "routes are a listener's: give the service listen (or grpc) to use them"))
    return parse_routes(value["routes"], at, problems)


def _endpoints(raw: Any, where: str, problems: list[Problem]) -> tuple[Endpoint, ...]:
    """A service's ``endpoints`` list, sorted; each one listed twice is a problem."""
    if not isinstance(raw, list):
        problems.append(Problem(_where(where, "endpoints"), "must be a list of HOST:PORT or mappings"))
        return ()
    endpoints: list[Endpoint] = []
    seen: dict[str, int] = {}
    for index, item in enumerate(raw):
        endpoint = parse_endpoint(item, f"{where}.endpoints[{index}]", problems)
        if endpoint is None:
            continue
        if endpoint.address in seen:
            first = seen[endpoint.address]
            problems.append(
                Problem(
                    f"{where}.endpoints[{index}]", f"{endpoint.address} is listed twice (first at endpoints[{first}])"
                )
            )
            continue
        seen[endpoint.address] = index
        endpoints.append(endpoint)
    return tuple(sorted(endpoints))


_HEALTH_CHECK_FIELDS = ("path", "interval", "timeout")


def _health_check(value: Any, where: str, problems: list[Problem]) -> HealthCheck | None:
    if value is True:
        return HealthCheck()
    if not isinstance(value, dict):
        problems.append(Problem(where, f"expected true or a mapping with {', '.join(_HEALTH_CHECK_FIELDS)}"))
        return None
    unknown = sorted(set(map(str, value)) - set(_HEALTH_CHECK_FIELDS))
    if unknown:
        problems.append(
            Problem(where, f"unknown field(s) {', '.join(unknown)}; expected {', '.join(_HEALTH_CHECK_FIELDS)}")
        )
        return None
    path = value.get("path", "/healthz")
    if not isinstance(path, str) or not path.startswith("/"):
        problems.append(Problem(_where(where, "path"), f"must start with '/', got {path!r}"))
    interval = _seconds(value.get("interval", 5.0), _where(where, "interval"), problems)
    timeout = _seconds(value.get("timeout", 1.0), _where(where, "timeout"), problems)
    if interval is None or timeout is None or not isinstance(path, str):
        return None
    return HealthCheck(path=path, interval=interval, timeout=timeout)


def parse_services(
    section: Any, prefix: str = "services"
) -> tuple[dict[str, ServiceSpec], dict[str, tuple[Endpoint, ...]], list[Problem]]:
    """A ``services:`` mapping: definitions and endpoints by service name, and problems."""
    if section is None:
        return {}, {}, []
    if not isinstance(section, Mapping):
        return {}, {}, [Problem(prefix, f"must be a mapping of service name to settings, got {type(section).__name__}")]
    specs: dict[str, ServiceSpec] = {}
    endpoints: dict[str, tuple[Endpoint, ...]] = {}
    problems: list[Problem] = []
    for name, value in section.items():
        spec, found, service_problems = parse_service(str(name), value, f"{prefix}.{name}")
        problems.extend(service_problems)
        if spec is not None:
            specs[spec.name] = spec
            endpoints[spec.name] = found
    return specs, endpoints, problems
