"""Services -> Envoy resources, with production defaults.

For each service: an EDS cluster and its ClusterLoadAssignment (a service with an endpoint that is
a host name: a STRICT_DNS cluster holding its endpoints, which Envoy resolves, and no assignment);
with ``listen``, a listener (HTTP: connection manager using RDS plus a route configuration: the
service's ``routes``, or one route sending everything to the service; TCP: tcp_proxy); with ``grpc``, an
*API listener* for proxyless gRPC clients: a Listener named as the target a client resolves
(``xds:///NAME``) with no address, only an ``api_listener`` holding an HTTP connection manager
that uses RDS (the service's route configuration) and the router filter, which is what gRPC
requires of it (gRFC A27).

Which listeners a client gets depends on what it is (:class:`ClientKind`): an Envoy binds every
listener it is sent and has no use for API listeners; a gRPC client asks for listeners by target
name and drops one with an address. So the two kinds are served different listener sets (node
groups, :mod:`pilotfish.build.desired`), and a service's socket listener keeps the service's name for
Envoys (stat prefixes stay as they are) while its API listener takes the same name for gRPC
clients: ``xds:///web`` finds the API listener, never the socket one. An Envoy that polls over
REST (``ClientKind.REST``) gets the socket listeners too, but it holds no ADS stream to follow
``ads: {}`` with: its clusters' EDS and its connection managers' RDS name the REST config source
it polls (``rest_source``: the one of its bootstrap, :func:`pilotfish.resources.bootstrap.rest_config_source`);
endpoints and routes, which name no config source, are the same objects for every kind.
Defaults, and why:

- ``ignore_health_on_host_removal``: an endpoint removed from EDS leaves at once, even when
  active health checks still pass it (Envoy otherwise keeps it until a check fails).
- retries on ``connect-failure,refused-stream,reset-before-request``: a request that never reached
  an upstream (e.g. an endpoint that just went away) is retried on another; never a request an
  upstream may have acted on. Circuit-breaker thresholds are raised so retries are not capped at
  Envoy's default of 3 concurrent retries under load.
- outlier detection: endpoints returning consecutive 5xx/gateway errors are ejected for a while.
- one locality with ``load_balancing_weight`` 1: proxyless gRPC clients need a non-zero locality
  weight (without one their calls time out, and nothing is NACKed).
- with ``grpc_load_reports`` (``serve --rollout`` with its health gate on), the EDS clusters of
  gRPC views carry ``lrs_server: {self: {}}``: a proxyless gRPC client reports load only for
  clusters that ask it to, to the server it has its xDS from (gRFC A27); Envoys report from
  their bootstrap (``load_stats_config``) instead, so theirs stay as they are.

Messages are built directly (no JSON round trip) and endpoints are sorted, so the same services
always give the same bytes and so the same versions. :func:`encode_services` goes further for
large fleets: endpoints are wire-encoded by hand (:mod:`pilotfish.resources.wire`), a cluster is a
cached per-settings template with its name prepended, and a :class:`ResourceMemo` carries the
encoded resources of unchanged services from one build to the next.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import operator
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from types import MappingProxyType
from typing import Any, NamedTuple, TypeVar

from envoy.config.cluster.v3 import circuit_breaker_pb2, cluster_pb2, outlier_detection_pb2
from envoy.config.core.v3 import address_pb2, base_pb2, config_source_pb2, health_check_pb2
from envoy.config.endpoint.v3 import endpoint_components_pb2, endpoint_pb2
from envoy.config.listener.v3 import api_listener_pb2, listener_components_pb2, listener_pb2
from envoy.config.route.v3 import route_components_pb2, route_pb2
from envoy.extensions.filters.http.router.v3 import router_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import (
    http_connection_manager_pb2 as hcm_pb2,
)
from envoy.extensions.filters.network.tcp_proxy.v3 import tcp_proxy_pb2
from envoy.extensions.upstreams.http.v3 import http_protocol_options_pb2
from envoy.type.matcher.v3 import regex_pb2, string_pb2
from google.protobuf import any_pb2, duration_pb2, struct_pb2, wrappers_pb2
from google.protobuf.message import Message

from pilotfish.resources.encoded import Resource
from pilotfish.resources.routes import Route, host_regex
from pilotfish.resources.services import Endpoint, ServiceSpec, has_host_names
from pilotfish.resources.types import CLUSTER, ENDPOINT, LISTENER, ROUTE, ResourceType
from pilotfish.resources.wire import cluster_load_assignment, lb_endpoint, length_delimited

__all__ = [
    "ClientKind",
    "RawPatch",
    "ResourceMemo",
    "ServicesPatch",
    "build_api_listener",
    "build_assignment",
    "build_cluster",
    "build_listener",
    "changed_places",
    "encode_for_views",
    "encode_services",
]


class ClientKind(enum.Enum):
    """What kind of xDS client a node group serves: which listeners (and routes) it is built."""

    ENVOY = "envoy"
    """Socket listeners of services with ``listen`` (and raw listeners with an address)."""
    GRPC = "grpc"
    """API listeners of services with ``grpc`` (and raw listeners with an ``api_listener``)."""
    REST = "rest"
    """Envoys polling REST xDS: what ``ENVOY`` gets, with EDS and RDS through the REST config
    source instead of ADS."""


_RETRY_ON = "connect-failure,refused-stream,reset-before-request"
_HTTP_OPTIONS_KEY = "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"


def _duration(seconds: float) -> duration_pb2.Duration:
    # Round to whole nanoseconds first: 0.9999999999 s is 1 s, not 0 s and 10^9 ns (invalid).
    whole, nanos = divmod(round(seconds * 1e9), 1_000_000_000)
    return duration_pb2.Duration(seconds=whole, nanos=nanos)


def _ads() -> config_source_pb2.ConfigSource:
    return config_source_pb2.ConfigSource(
        ads=config_source_pb2.AggregatedConfigSource(), resource_api_version=config_source_pb2.V3
    )


def _packed(message: Message) -> any_pb2.Any:
    packed = any_pb2.Any()
    packed.Pack(message)
    return packed


def _socket(host: str, port: int) -> address_pb2.Address:
    return address_pb2.Address(socket_address=address_pb2.SocketAddress(address=host, port_value=port))


DNS_REFRESH = 5.0
"""Seconds between Envoy's lookups of a STRICT_DNS cluster's names (Envoy's default, said explicitly)."""


def _self_source() -> config_source_pb2.ConfigSource:
    """``{self: {}}``: the server the client has this resource from."""
    return config_source_pb2.ConfigSource(
        self=config_source_pb2.SelfConfigSource(), resource_api_version=config_source_pb2.V3
    )


def build_cluster(
    spec: ServiceSpec,
    *,
    eds: config_source_pb2.ConfigSource | None = None,
    dns_endpoints: tuple[Endpoint, ...] | None = None,
    load_reports: bool = False,
) -> cluster_pb2.Cluster:
    """The service's EDS cluster; its endpoints come over ``eds`` (default: ADS). With
    ``dns_endpoints`` (a service some of whose endpoints are host names) a STRICT_DNS cluster
    instead, holding them: Envoy resolves the names itself (IPv4 first, every
    :data:`DNS_REFRESH` seconds) and balances over every address they resolve to. With
    ``load_reports`` the cluster asks its (gRPC) clients to report its load to the server they
    have it from (``lrs_server: {self: {}}``)."""
    cluster = cluster_pb2.Cluster(
        name=spec.name,
        connect_timeout=_duration(spec.connect_timeout),
        lb_policy=cluster_pb2.Cluster.ROUND_ROBIN,
        ignore_health_on_host_removal=True,
        circuit_breakers=circuit_breaker_pb2.CircuitBreakers(
            thresholds=[
                circuit_breaker_pb2.CircuitBreakers.Thresholds(
                    max_connections=wrappers_pb2.UInt32Value(value=100_000),
                    max_pending_requests=wrappers_pb2.UInt32Value(value=100_000),
                    max_requests=wrappers_pb2.UInt32Value(value=100_000),
                    max_retries=wrappers_pb2.UInt32Value(value=1_000),
                ),
            ]
        ),
        outlier_detection=outlier_detection_pb2.OutlierDetection(
            consecutive_5xx=wrappers_pb2.UInt32Value(value=5),
            interval=_duration(5),
            base_ejection_time=_duration(30),
            max_ejection_percent=wrappers_pb2.UInt32Value(value=50),
        ),
    )
    if dns_endpoints is None:
        cluster.type = cluster_pb2.Cluster.EDS
        cluster.eds_cluster_config.CopyFrom(cluster_pb2.Cluster.EdsClusterConfig(eds_config=eds or _ads()))
    else:
        # V4_PREFERRED, not Envoy's AUTO (IPv6 first): a name such as localhost that resolves to
        # both ::1 and 127.0.0.1 would otherwise reach only ::1, where most services do not listen.
        cluster.type = cluster_pb2.Cluster.STRICT_DNS
        cluster.dns_lookup_family = cluster_pb2.Cluster.V4_PREFERRED
        cluster.dns_refresh_rate.CopyFrom(_duration(DNS_REFRESH))
        cluster.load_assignment.CopyFrom(build_assignment(spec.name, dns_endpoints))
    if spec.protocol == "http" and spec.upstream_protocol == "http2":
        options = http_protocol_options_pb2.HttpProtocolOptions(
            explicit_http_config=http_protocol_options_pb2.HttpProtocolOptions.ExplicitHttpConfig(
                http2_protocol_options={},
            ),
        )
        cluster.typed_extension_protocol_options[_HTTP_OPTIONS_KEY].CopyFrom(_packed(options))
    if spec.health_check is not None:
        check = spec.health_check
        cluster.health_checks.append(
            health_check_pb2.HealthCheck(
                timeout=_duration(check.timeout),
                interval=_duration(check.interval),
                unhealthy_threshold=wrappers_pb2.UInt32Value(value=check.unhealthy_threshold),
                healthy_threshold=wrappers_pb2.UInt32Value(value=check.healthy_threshold),
                http_health_check=health_check_pb2.HealthCheck.HttpHealthCheck(path=check.path),
            )
        )
    if load_reports:
        cluster.lrs_server.CopyFrom(_self_source())
    return cluster


def build_assignment(name: str, endpoints: Iterable[Endpoint]) -> endpoint_pb2.ClusterLoadAssignment:
    """Endpoints without a zone: one locality of weight 1. With zones: one locality per zone (in
    zone order), weighted by the sum of its endpoints' weights, so that a client balancing across
    localities first (gRPC does) still gives each endpoint its share."""
    by_zone: dict[str, list[endpoint_components_pb2.LbEndpoint]] = {}
    weights: dict[str, int] = {}
    ordered = sorted(endpoints)
    for endpoint in ordered:
        lb_endpoint = endpoint_components_pb2.LbEndpoint(
            endpoint=endpoint_components_pb2.Endpoint(address=_socket(endpoint.host, endpoint.port)),
            load_balancing_weight=wrappers_pb2.UInt32Value(value=endpoint.weight),
        )
        if endpoint.metadata:
            fields = struct_pb2.Struct()
            fields.update(dict(endpoint.metadata))
            lb_endpoint.metadata.filter_metadata["pilotfish"].CopyFrom(fields)
        by_zone.setdefault(endpoint.zone, []).append(lb_endpoint)
        weights[endpoint.zone] = weights.get(endpoint.zone, 0) + endpoint.weight
    if not any(e.zone for e in ordered):
        weights = {"": 1}
    return endpoint_pb2.ClusterLoadAssignment(
        cluster_name=name,
        endpoints=[
            endpoint_components_pb2.LocalityLbEndpoints(
                locality=base_pb2.Locality(zone=zone),
                lb_endpoints=by_zone[zone],
                load_balancing_weight=wrappers_pb2.UInt32Value(value=weights[zone]),
            )
            for zone in sorted(by_zone)
        ]
        if ordered
        else [
            endpoint_components_pb2.LocalityLbEndpoints(
                locality=base_pb2.Locality(), load_balancing_weight=wrappers_pb2.UInt32Value(value=1)
            )
        ],
    )


def _route_action(cluster: str, timeout: float, retries: int) -> route_components_pb2.RouteAction:
    action = route_components_pb2.RouteAction(cluster=cluster, timeout=_duration(timeout))
    if retries:
        action.retry_policy.CopyFrom(
            route_components_pb2.RetryPolicy(
                retry_on=_RETRY_ON,
                num_retries=wrappers_pb2.UInt32Value(value=retries),
            )
        )
    return action


def _route_config(spec: ServiceSpec) -> route_pb2.RouteConfiguration:
    if spec.routes:
        routes = [_route(spec, route) for route in spec.routes]
    else:  # every request to the service itself
        routes = [
            route_components_pb2.Route(
                match=route_components_pb2.RouteMatch(prefix="/"),
                route=_route_action(spec.name, spec.timeout, spec.retries),
            )
        ]
    return route_pb2.RouteConfiguration(
        name=spec.name,
        virtual_hosts=[route_components_pb2.VirtualHost(name=spec.name, domains=["*"], routes=routes)],
    )


def _regex(pattern: str) -> regex_pb2.RegexMatcher:
    return regex_pb2.RegexMatcher(regex=pattern)


_REDIRECT_CODES = {
    301: route_components_pb2.RedirectAction.MOVED_PERMANENTLY,
    302: route_components_pb2.RedirectAction.FOUND,
    303: route_components_pb2.RedirectAction.SEE_OTHER,
    307: route_components_pb2.RedirectAction.TEMPORARY_REDIRECT,
    308: route_components_pb2.RedirectAction.PERMANENT_REDIRECT,
}


def _route_match(route: Route) -> route_components_pb2.RouteMatch:
    match = route_components_pb2.RouteMatch()
    if route.match_kind == "regex":
        match.safe_regex.CopyFrom(_regex(route.match))
    else:
        setattr(match, route.match_kind, route.match)
    if route.hosts:
        # On ``:authority`` rather than virtual hosts: the list's order alone decides (see routes.py).
        match.headers.append(
            route_components_pb2.HeaderMatcher(
                name=":authority", string_match=string_pb2.StringMatcher(safe_regex=_regex(host_regex(route.hosts)))
            )
        )
    for header in route.headers:
        matcher = route_components_pb2.HeaderMatcher(name=header.name)
        if header.kind in ("present", "absent"):
            matcher.present_match = True
            matcher.invert_match = header.kind == "absent"
        elif header.kind == "regex":
            matcher.string_match.safe_regex.CopyFrom(_regex(header.value))
        else:
            setattr(matcher.string_match, header.kind, header.value)
        match.headers.append(matcher)
    return match


def _route(spec: ServiceSpec, route: Route) -> route_components_pb2.Route:
    """One route of a service's table (see :mod:`pilotfish.resources.routes`)."""
    built = route_components_pb2.Route(match=_route_match(route))
    if route.direct_response is not None:
        built.direct_response.status = route.direct_response.status
        if route.direct_response.body:
            built.direct_response.body.inline_string = route.direct_response.body
    elif route.redirect is not None:
        redirect = route.redirect
        action = built.redirect
        if redirect.scheme is not None:
            action.scheme_redirect = redirect.scheme
        if redirect.host is not None:
            action.host_redirect = redirect.host
        if redirect.port is not None:
            action.port_redirect = redirect.port
        if redirect.path is not None:
            action.path_redirect = redirect.path
        if redirect.prefix is not None:
            action.prefix_rewrite = redirect.prefix
        action.response_code = _REDIRECT_CODES[redirect.code]
        action.strip_query = redirect.strip_query
    else:
        timeout = spec.timeout if route.timeout is None else route.timeout
        retries = spec.retries if route.retries is None else route.retries
        forward = _route_action(route.to[0][0], timeout, retries)
        if route.split:
            forward.ClearField("cluster")
            forward.weighted_clusters.clusters.extend(
                route_components_pb2.WeightedCluster.ClusterWeight(
                    name=name, weight=wrappers_pb2.UInt32Value(value=weight)
                )
                for name, weight in route.to
            )
        if route.prefix_rewrite is not None:
            forward.prefix_rewrite = route.prefix_rewrite
        built.route.CopyFrom(forward)
    return built


def _connection_manager(
    spec: ServiceSpec,
    rds: config_source_pb2.ConfigSource | None = None,
) -> hcm_pb2.HttpConnectionManager:
    return hcm_pb2.HttpConnectionManager(
        stat_prefix=spec.name,
        rds=hcm_pb2.Rds(route_config_name=spec.name, config_source=rds or _ads()),
        http_filters=[hcm_pb2.HttpFilter(name="envoy.filters.http.router", typed_config=_packed(router_pb2.Router()))],
    )


def build_api_listener(spec: ServiceSpec) -> listener_pb2.Listener:
    """The listener a proxyless gRPC client resolving ``xds:///{spec.grpc}`` needs."""
    assert spec.grpc is not None
    return listener_pb2.Listener(
        name=spec.grpc,
        api_listener=api_listener_pb2.ApiListener(api_listener=_packed(_connection_manager(spec))),
    )


def build_listener(spec: ServiceSpec, *, rds: config_source_pb2.ConfigSource | None = None) -> listener_pb2.Listener:
    """The socket listener of a service with ``listen``; an HTTP one gets its routes over ``rds``
    (default: ADS)."""
    assert spec.listen is not None
    if spec.protocol == "tcp":
        network_filter = listener_components_pb2.Filter(
            name="envoy.filters.network.tcp_proxy",
            typed_config=_packed(tcp_proxy_pb2.TcpProxy(stat_prefix=spec.name, cluster=spec.name)),
        )
    else:
        network_filter = listener_components_pb2.Filter(
            name="envoy.filters.network.http_connection_manager", typed_config=_packed(_connection_manager(spec, rds))
        )
    return listener_pb2.Listener(
        name=spec.name,
        address=_socket(*spec.listen),
        filter_chains=[listener_components_pb2.FilterChain(filters=[network_filter])],
    )


@functools.lru_cache(maxsize=256)
def _cluster_template(settings: ServiceSpec, eds: bytes, load_reports: bool) -> bytes:
    # ``settings`` has an empty name; the name (field 1) is prepended per cluster, which is
    # exactly where deterministic serialization puts it. ``eds``: the encoded config source
    # (b"": ADS), as a message is no cache key.
    source = config_source_pb2.ConfigSource.FromString(eds) if eds else None
    encoded: bytes = build_cluster(settings, eds=source, load_reports=load_reports).SerializeToString(
        deterministic=True
    )
    return encoded


def encode_cluster(
    spec: ServiceSpec, eds: config_source_pb2.ConfigSource | None = None, *, load_reports: bool = False
) -> bytes:
    # What does not shape the cluster (its listeners and routes) is left out of the template's key.
    settings = dataclasses.replace(spec, name="", listen=None, grpc=None, routes=())
    source = b"" if eds is None else eds.SerializeToString(deterministic=True)
    return length_delimited(1, spec.name.encode()) + _cluster_template(settings, source, load_reports)


def encode_assignment(name: str, endpoints: Iterable[Endpoint]) -> bytes:
    ordered = sorted(endpoints)
    if any(e.metadata or e.zone for e in ordered):
        encoded: bytes = build_assignment(name, ordered).SerializeToString(deterministic=True)
        return encoded
    return cluster_load_assignment(name, [lb_endpoint(e.host, e.port, e.weight) for e in ordered])


class _Service:
    """One service's resources for the views of a build, and what they were made from."""

    __slots__ = (
        "api",
        "cluster",
        "every",
        "found",
        "grpc_cluster",
        "rest_cluster",
        "rest_socket",
        "route",
        "socket",
        "spec",
        "zonal",
    )

    def __init__(self, spec: ServiceSpec, found: tuple[Endpoint, ...]) -> None:
        self.spec = spec
        self.found = found
        """The endpoints as given (the key: sources hand over the same tuple while they are unchanged)."""
        self.cluster: Resource | None = None
        self.grpc_cluster: Resource | None = None
        """The cluster of gRPC views when they report load (``lrs_server``); else None."""
        self.rest_cluster: Resource | None = None
        self.every: Resource | None = None
        self.zonal: tuple[Resource | None, ...] = ()
        """Per zone of the build's views (in their order): the assignment its clients get (None,
        as :attr:`every`, for a STRICT_DNS cluster: its endpoints are in the cluster)."""
        self.socket: Resource | None = None
        self.rest_socket: Resource | None = None
        self.api: Resource | None = None
        self.route: Resource | None = None

    def changed_lists(self, old: _Service) -> set[_ListKey]:
        """The output lists (see :func:`encode_for_views`) in which this entry differs from ``old``."""
        changed: set[_ListKey] = {key for key in _LISTS if getattr(self, key) is not getattr(old, key)}
        changed.update(number for number, (a, b) in enumerate(zip(self.zonal, old.zonal, strict=True)) if a is not b)
        return changed


class ServicesPatch(NamedTuple):
    """How one pair of (definitions, endpoints) mappings was made from another: from ``specs`` and
    ``endpoints``, changing only ``names`` (every other name's values are the very objects found
    there). A build that knows it starts from the mappings of the last one looks at those names
    alone."""

    specs: Mapping[str, ServiceSpec]
    endpoints: Mapping[str, tuple[Endpoint, ...]]
    names: frozenset[str]


class _RawList(NamedTuple):
    """A type's raw resources as one build had them (see :meth:`ResourceMemo.raw`)."""

    messages: tuple[Message, ...]
    pairs: list[tuple[Resource, Message]]
    encoded: dict[int, tuple[Message, Resource]]
    ttls: Mapping[str, int]
    patch: RawPatch | None = None
    """How :attr:`pairs` differs from the list before it, when only in some places."""


class RawPatch(NamedTuple):
    """A type's raw list that differs from the one before it (``before``, as long) only at
    ``changed`` (positions, ascending): what is derived from the one before can be patched."""

    before: list[tuple[Resource, Message]]
    changed: tuple[int, ...]


_PATCHED_SHARE = 0.25
"""A raw list is patched (see :class:`RawPatch`) when at most this share of it changed (or one
resource); more, and it is made whole."""


def changed_places(before: Sequence[object], after: Sequence[object]) -> tuple[int, ...] | None:
    """The places (ascending) where ``after`` holds another object than ``before``, when it is as
    long and at most :data:`_PATCHED_SHARE` of it (or one) changed; None otherwise: derive from
    ``after`` whole rather than patch what was derived from ``before``."""
    if len(before) != len(after):
        return None
    changed = tuple(i for i, (was, now) in enumerate(zip(before, after, strict=True)) if was is not now)
    return changed if len(changed) <= max(1, _PATCHED_SHARE * len(after)) else None


_NO_TTLS: Mapping[str, int] = MappingProxyType({})


_ListKey = str | int
"""An output list of :func:`encode_for_views`: the :class:`_Service` attribute it is made of, or for
the assignments of a zone, that zone's number (its place in :attr:`_Service.zonal`)."""
_LISTS = ("cluster", "grpc_cluster", "rest_cluster", "every", "socket", "api", "rest_socket", "route")

_T = TypeVar("_T")


class ResourceMemo:
    """What the last build made of each service, reused by the next one when its input is the same.

    A service whose definition and endpoint tuple are the very objects of the last build (sources
    hand over the same ones while they are unchanged) costs a lookup; one that is merely equal
    costs a comparison; one that changed is made again, reusing each of its resources whose own
    input did not change (a new endpoint leaves the cluster, listener and route as they were). An
    output list in which nothing changed is the very list of the last build, so what is built from
    it downstream can be reused by identity too. Only the latest build's services are kept, so
    memory follows the current configuration.
    """

    def __init__(self) -> None:
        self._views: tuple[object, ...] | None = None
        """What the entries were made for: the views, the REST config source, and whether gRPC
        views report load."""
        self._services: dict[str, _Service] = {}
        self._names: tuple[str, ...] = ()
        """The last build's service names, sorted."""
        self._lists: dict[_ListKey, list[Resource]] = {}
        """The last build's output lists (see :func:`encode_for_views`)."""
        self.made = 0
        """Resources made (not reused) in all: the tests count them."""
        self._derived: dict[Hashable, tuple[tuple[object, ...], Any]] = {}
        self._derived_before: dict[Hashable, tuple[tuple[object, ...], Any]] = {}
        self._made_from: tuple[Mapping[str, ServiceSpec], Mapping[str, Iterable[Endpoint]]] | None = None
        """The mappings the last build was made from (a patch of them needs only its names looked at)."""
        self._raw: dict[ResourceType, _RawList] = {}
        """The user's own resources of each type as the last build had them: the messages, each
        with its encoding, and the encodings by the identity of their message (held with it, so
        the id is not reused)."""

    def make(self, make: Callable[..., Resource], *args: Any) -> Resource:
        """``make(*args)``: one resource made because its input changed (counted in :attr:`made`)."""
        self.made += 1
        return make(*args)

    def start(self, views: tuple[object, ...]) -> None:
        """A build for ``views`` begins: entries made for other views are of no use."""
        self._derived_before, self._derived = self._derived, {}
        if views != self._views:
            self._views = views
            self._services = {}
            self._lists = {}
            self._made_from = None

    def names(self, specs: Mapping[str, ServiceSpec]) -> tuple[str, ...]:
        """``specs``' names, sorted (the last build's tuple when they are the same names)."""
        names = self._names
        if len(names) != len(specs) or specs.keys() != self._services.keys():
            names = tuple(sorted(specs))
        return names

    def last_names(self) -> tuple[str, ...]:
        """The last build's service names, sorted."""
        return self._names

    def same_names(self, names: tuple[str, ...]) -> bool:
        """Whether ``names`` (from :meth:`names`) are the last build's."""
        return names is self._names

    def continues(self, patch: ServicesPatch | None) -> bool:
        """Whether ``patch`` starts from the very mappings the last build was made from."""
        made_from = self._made_from
        return (
            patch is not None
            and made_from is not None
            and made_from[0] is patch.specs
            and made_from[1] is patch.endpoints
        )

    def services(self) -> Mapping[str, _Service]:
        """What the last build made of each service."""
        return self._services

    def finish(
        self,
        names: tuple[str, ...],
        services: dict[str, _Service],
        lists: dict[_ListKey, list[Resource]],
        made_from: tuple[Mapping[str, ServiceSpec], Mapping[str, Iterable[Endpoint]]],
    ) -> None:
        """End a build: its services and lists (and the mappings they were made from) are what
        the next one starts from."""
        self._names, self._services, self._lists, self._made_from = names, services, lists, made_from

    def previous_list(self, key: _ListKey) -> list[Resource] | None:
        return self._lists.get(key)

    def raw(
        self, rtype: ResourceType, messages: tuple[Message, ...], ttls: Mapping[str, int] | None = None
    ) -> list[tuple[Resource, Message]]:
        """The raw resources of a type, each encoded with its message (and its TTL in ``ttls``, by
        name, if it has one). A message that is the very one an earlier build had (a source that
        parsed nothing again hands over the same messages) keeps its encoding; the very list of
        the last build when every message (and TTL) is (compared in one pass, by identity first).
        The encodings are indexed by message across builds: the index is made anew once it holds
        twice the type's resources (amortized O(1) a resource; memory: at most twice the current
        ones)."""
        ttls = ttls or _NO_TTLS
        last = self._raw.get(rtype)
        if last is not None and (last.messages is messages or last.messages == messages) and last.ttls == ttls:
            return last.pairs
        encoded = last.encoded if last is not None else {}
        patch = None
        changed = changed_places(last.messages, messages) if last is not None and last.ttls == ttls else None
        if last is not None and changed is not None:
            pairs = last.pairs.copy()
            for index in changed:
                pairs[index] = self._raw_pair(rtype, messages[index], ttls, encoded)
            patch = RawPatch(last.pairs, changed)
        if patch is None:
            pairs = [self._raw_pair(rtype, message, ttls, encoded) for message in messages]
        if len(encoded) > 2 * len(pairs) + 16:  # (the stale ones go)
            encoded = {id(message): (message, resource) for resource, message in pairs}
        self._raw[rtype] = _RawList(messages, pairs, encoded, ttls, patch)
        return pairs

    def _raw_pair(
        self,
        rtype: ResourceType,
        message: Message,
        ttls: Mapping[str, int],
        encoded: dict[int, tuple[Message, Resource]],
    ) -> tuple[Resource, Message]:
        """``message`` with its encoding: the one in ``encoded`` (by its identity) if it has the same TTL."""
        entry = encoded.get(id(message))
        ttl = ttls.get(getattr(message, rtype.name_field), 0) if ttls else 0
        if entry is None or entry[0] is not message or entry[1].ttl_ms != ttl:
            self.made += 1
            entry = encoded[id(message)] = (message, Resource.of(rtype, message, ttl_ms=ttl))
        return entry[1], message

    def raw_patch(self, rtype: ResourceType, pairs: list[tuple[Resource, Message]]) -> RawPatch | None:
        """How ``pairs`` (what :meth:`raw` gave for ``rtype``) differs from the list before it,
        when it was made by patching that one (None: made whole, or not the latest)."""
        last = self._raw.get(rtype)
        return last.patch if last is not None and last.pairs is pairs else None

    def derived_before(self, key: Hashable) -> tuple[tuple[object, ...], Any] | None:
        """What the build before derived under ``key``: (its inputs, the result), if it did."""
        return self._derived_before.get(key)

    def derived(self, key: Hashable, inputs: tuple[object, ...], make: Callable[[], _T]) -> _T:
        """``make()``, which derives something from ``inputs`` (e.g. this memo's output lists), or
        what the last build derived under ``key`` from equal inputs (the very lists, compared by
        identity first). Kept for one build."""
        entry = self._derived.get(key) or self._derived_before.get(key)
        if entry is None or not (entry[0] is inputs or entry[0] == inputs):
            entry = (inputs, make())
        self._derived[key] = entry
        result: _T = entry[1]
        return result


def encode_services(
    specs: Mapping[str, ServiceSpec],
    endpoints: Mapping[str, Iterable[Endpoint]],
    memo: ResourceMemo | None = None,
    *,
    kind: ClientKind = ClientKind.ENVOY,
    zone: str = "",
    rest_source: config_source_pb2.ConfigSource | None = None,
    grpc_load_reports: bool = False,
) -> dict[ResourceType, list[Resource]]:
    """The encoded resources of every service, by type (the bytes protobuf would give the messages
    :func:`build_cluster`, :func:`build_assignment` and the listener/route builders make), for
    clients of ``kind`` in ``zone`` ("": none); ``rest_source``, ``grpc_load_reports``: see
    :func:`encode_for_views`."""
    return encode_for_views(
        specs, endpoints, memo, views=((kind, zone),), rest_source=rest_source, grpc_load_reports=grpc_load_reports
    )[kind, zone]


ViewKey = tuple[ClientKind, str]
"""What a node group is built: the kind of its clients, and their zone ("": none)."""


def encode_for_views(
    specs: Mapping[str, ServiceSpec],
    endpoints: Mapping[str, Iterable[Endpoint]],
    memo: ResourceMemo | None = None,
    *,
    views: Iterable[ViewKey] = ((ClientKind.ENVOY, ""),),
    rest_source: config_source_pb2.ConfigSource | None = None,
    patch: ServicesPatch | None = None,
    grpc_load_reports: bool = False,
) -> dict[ViewKey, dict[ResourceType, list[Resource]]]:
    """:func:`encode_services` for several views in one pass over the services. Views share the
    very same lists where they do not differ: routes always; clusters between views that follow
    ADS (``envoy``, ``grpc``; not when ``grpc_load_reports`` gives the EDS clusters of ``grpc``
    views ``lrs_server: {self: {}}``) and between ``rest`` views; listeners between views of one kind;
    assignments between views of one zone, and the assignment of a service that is not
    ``zone_local`` (or has no endpoint in the zone) is the same object in every view.
    ``rest_source``: the config source ``rest`` views get EDS and RDS from (needed for them).
    ``patch``: how ``specs`` and ``endpoints`` were made from earlier ones; when those are what
    ``memo`` last built from, only the patch's names are looked at (a change to one service
    among 10,000 costs that service and the output lists it is in)."""
    build = _ViewsBuild(
        memo or ResourceMemo(), tuple(dict.fromkeys(views)), rest_source, endpoints, grpc_load_reports=grpc_load_reports
    )
    build.visit_services(specs, patch)
    return build.outputs(specs, endpoints)


class _ViewsBuild:
    """One :func:`encode_for_views`: what its views want, the services visited, the output lists."""

    def __init__(
        self,
        memo: ResourceMemo,
        wanted: tuple[ViewKey, ...],
        rest_source: config_source_pb2.ConfigSource | None,
        endpoints: Mapping[str, Iterable[Endpoint]],
        *,
        grpc_load_reports: bool = False,
    ) -> None:
        if rest_source is None and any(kind is ClientKind.REST for kind, _ in wanted):
            raise ValueError("a rest view needs the REST config source its clients poll (rest_source)")
        self.memo, self.wanted, self.rest_source, self.endpoints = memo, wanted, rest_source, endpoints
        kinds = {kind for kind, _ in wanted}
        self.want_ads = bool(kinds - {ClientKind.REST})
        self.want_rest = ClientKind.REST in kinds
        self.want_sockets, self.want_apis = ClientKind.ENVOY in kinds, ClientKind.GRPC in kinds
        self.want_grpc_reports = grpc_load_reports and self.want_apis
        """gRPC views get clusters of their own, which ask for load reports."""
        self.zones = tuple(dict.fromkeys(zone for _, zone in wanted if zone))
        memo.start(
            (
                wanted,
                b"" if rest_source is None else rest_source.SerializeToString(deterministic=True),
                self.want_grpc_reports,
            )
        )
        self.last = memo.services()
        self.changed: set[_ListKey] = set()
        """The output lists in which some visited service's entry differs from the last build's."""
        self.services: dict[str, _Service] = {}
        self.names: tuple[str, ...] = ()
        self._entries: list[_Service] | None = None
        self._all_changed = False
        self._lists: dict[_ListKey, list[Resource]] = {}

    # -- the resources of one service ------------------------------------------------------------

    def _cluster(self, spec: ServiceSpec) -> Resource:
        return Resource(CLUSTER, spec.name, encode_cluster(spec))

    @staticmethod
    def _dns_cluster(spec: ServiceSpec, found: tuple[Endpoint, ...]) -> Resource:
        return Resource.of(CLUSTER, build_cluster(spec, dns_endpoints=found))

    def _rest_cluster(self, spec: ServiceSpec) -> Resource:
        return Resource(CLUSTER, spec.name, encode_cluster(spec, self.rest_source))

    @staticmethod
    def _grpc_cluster(spec: ServiceSpec) -> Resource:
        return Resource(CLUSTER, spec.name, encode_cluster(spec, load_reports=True))

    @staticmethod
    def _assignment(name: str, found: tuple[Endpoint, ...]) -> Resource:
        return Resource(ENDPOINT, name, encode_assignment(name, found))

    @staticmethod
    def _listener(spec: ServiceSpec) -> Resource:
        return Resource.of(LISTENER, build_listener(spec))

    def _rest_listener(self, spec: ServiceSpec) -> Resource:
        return Resource.of(LISTENER, build_listener(spec, rds=self.rest_source))

    @staticmethod
    def _api_listener(spec: ServiceSpec) -> Resource:
        return Resource.of(LISTENER, build_api_listener(spec))

    @staticmethod
    def _route(spec: ServiceSpec) -> Resource:
        return Resource.of(ROUTE, _route_config(spec))

    def _make_config(self, entry: _Service, spec: ServiceSpec, old: _Service | None) -> None:
        """The service's clusters, listeners and route, made again (its definition changed)."""
        make = self.memo.make
        if self.want_ads:
            entry.cluster = make(self._cluster, spec)
        if self.want_rest:
            entry.rest_cluster = make(self._rest_cluster, spec)
        if self.want_grpc_reports:
            entry.grpc_cluster = make(self._grpc_cluster, spec)
        if spec.listen is not None and self.want_sockets:
            entry.socket = make(self._listener, spec)
        if spec.listen is not None and self.want_rest:
            if spec.protocol == "tcp":  # no RDS: the very listener Envoys on ADS get
                entry.rest_socket = entry.socket or make(self._listener, spec)
            else:
                entry.rest_socket = make(self._rest_listener, spec)
        if spec.grpc is not None and self.want_apis:
            entry.api = make(self._api_listener, spec)
        if spec.protocol == "http" and (spec.listen is not None or spec.grpc is not None):
            # Every kind gets the same routes (clients ask for routes by name, so one no listener
            # of theirs uses is never sent); made of the name, timeout and retries only, so a
            # change of listener settings keeps the route object.
            if (
                old is not None
                and old.route is not None
                and (old.spec.timeout, old.spec.retries, old.spec.routes) == (spec.timeout, spec.retries, spec.routes)
            ):
                entry.route = old.route
            else:
                entry.route = make(self._route, spec)

    def _make(self, name: str, spec: ServiceSpec, found: tuple[Endpoint, ...], old: _Service | None) -> _Service:
        """The service's resources, each taken from ``old`` (its last build) where its input is the same."""
        entry = _Service(spec, found)
        same_spec = old is not None and old.spec == spec
        dns = has_host_names(found)
        if old is not None and same_spec:
            entry.cluster, entry.rest_cluster, entry.grpc_cluster = old.cluster, old.rest_cluster, old.grpc_cluster
            entry.socket, entry.rest_socket, entry.api, entry.route = old.socket, old.rest_socket, old.api, old.route
        else:
            self._make_config(entry, spec, old)
        if dns:
            # Envoy resolves the names: the endpoints are in a STRICT_DNS cluster, the same for
            # every view (no config source in it; not zone-local, not subsetted), and no EDS. Not
            # one for load reports: gRPC clients take EDS clusters only (build.desired refuses
            # a gRPC service on one).
            cluster = self.memo.make(self._dns_cluster, spec, found)
            entry.cluster = cluster if self.want_ads else None
            entry.rest_cluster = cluster if self.want_rest else None
            entry.grpc_cluster = cluster if self.want_grpc_reports else None
            entry.every, entry.zonal = None, (None,) * len(self.zones)
            return entry
        if old is not None and old.every is None:  # it was a DNS service: its clusters were STRICT_DNS
            entry.cluster = self.memo.make(self._cluster, spec) if self.want_ads else None
            entry.rest_cluster = self.memo.make(self._rest_cluster, spec) if self.want_rest else None
            entry.grpc_cluster = self.memo.make(self._grpc_cluster, spec) if self.want_grpc_reports else None
        if (
            old is not None
            and old.every is not None
            and old.found == found
            and (same_spec or old.spec.zone_local == spec.zone_local)
        ):
            entry.every, entry.zonal = old.every, old.zonal
            return entry
        ordered = tuple(sorted(found))
        every = entry.every = self.memo.make(self._assignment, name, ordered)
        zonal = []
        for zone in self.zones:
            local = tuple(e for e in ordered if e.zone == zone) if spec.zone_local else ()
            zonal.append(self.memo.make(self._assignment, name, local) if local else every)
        entry.zonal = tuple(zonal)
        return entry

    def _visit(self, name: str, spec: ServiceSpec) -> _Service:
        """The service's entry: the last build's if its input is the same, else made again."""
        found = self.endpoints.get(name, ())
        if type(found) is not tuple:
            found = tuple(found)
        old = self.last.get(name)
        if old is not None and (old.spec is spec or old.spec == spec) and (old.found is found or old.found == found):
            return old
        entry = self._make(name, spec, found, old)
        if old is not None:
            self.changed.update(entry.changed_lists(old))
        return entry

    # -- every service, then the lists -----------------------------------------------------------

    def visit_services(self, specs: Mapping[str, ServiceSpec], patch: ServicesPatch | None) -> None:
        memo, last = self.memo, self.last
        if memo.continues(patch):
            assert patch is not None
            # Every other name's input is the very object the last build had: its entry stands.
            services = self.services = dict(last)
            came_or_went = False
            for name in patch.names:
                spec = specs.get(name)
                if spec is not None:
                    came_or_went = came_or_went or name not in last
                    services[name] = self._visit(name, spec)
                elif services.pop(name, None) is not None:
                    came_or_went = True
            self.names = memo.names(specs) if came_or_went else memo.last_names()
        else:
            self.names = memo.names(specs)
            self.services = {name: self._visit(name, specs[name]) for name in self.names}
        self._all_changed = not memo.same_names(self.names)  # a service came or went: every list is made again

    def _output(self, key: _ListKey) -> list[Resource]:
        """One output list: the last build's when no resource in it changed (kept by identity)."""
        previous = self.memo.previous_list(key)
        if previous is not None and not self._all_changed and key not in self.changed:
            made = previous
        else:
            entries = self._entries
            if entries is None:
                entries = self._entries = list(map(self.services.__getitem__, self.names))
            picked = (
                map(operator.attrgetter(key), entries)
                if isinstance(key, str)
                else (entry.zonal[key] for entry in entries)
            )
            made = [r for r in picked if r is not None]
        self._lists[key] = made
        return made

    def outputs(
        self,
        specs: Mapping[str, ServiceSpec],
        endpoints: Mapping[str, Iterable[Endpoint]],
    ) -> dict[ViewKey, dict[ResourceType, list[Resource]]]:
        output = self._output
        ads_clusters = output("cluster") if self.want_ads else []
        rest_clusters = output("rest_cluster") if self.want_rest else []
        grpc_clusters = output("grpc_cluster") if self.want_grpc_reports else ads_clusters
        every_list = output("every")
        by_zone: dict[str, list[Resource]] = {"": every_list}
        for number, zone in enumerate(self.zones):
            in_zone = output(number)
            # Nothing zone-local in this zone: the same list, shared.
            by_zone[zone] = every_list if all(map(operator.is_, in_zone, every_list)) else in_zone
        by_kind = {
            ClientKind.ENVOY: output("socket") if self.want_sockets else [],
            ClientKind.GRPC: output("api") if self.want_apis else [],
            ClientKind.REST: output("rest_socket") if self.want_rest else [],
        }
        routes = output("route")
        self.memo.finish(self.names, self.services, self._lists, (specs, endpoints))
        return {
            (kind, zone): {
                CLUSTER: rest_clusters
                if kind is ClientKind.REST
                else grpc_clusters
                if kind is ClientKind.GRPC
                else ads_clusters,
                ENDPOINT: by_zone[zone],
                LISTENER: by_kind[kind],
                ROUTE: routes,
            }
            for kind, zone in self.wanted
        }
