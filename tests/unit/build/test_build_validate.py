"""Envoy's own ``validate.rules`` checked before anything is served (pilotfish.build.validate).

Each case is a rule taken from a real Envoy proto, with a value that passes and one that breaks
it; the problem must name the field path, the rule and the value. Then: every rule kind used by
any message reachable from the five resource types is one the checker understands (so a new
Envoy release with a new kind fails here, loudly), the checks run inside ``build_snapshot`` for
raw and built resources, and ``pilotfish validate`` refuses a cluster Envoy would NACK.

Cross references (``check_references``), last: what these refuse, Envoy would either reject (a
filter chain that does not end in a terminal filter, checked against ``envoy --mode validate``
1.40) or accept and then fail every request (a route to a cluster that does not exist: 503; an
empty filter chain: every connection closed).
"""

from __future__ import annotations

import importlib
import pkgutil
import sys
import time
from collections.abc import Callable
from typing import Any, cast

import pytest
import validate.validate_pb2 as pgv
from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.core.v3 import address_pb2, base_pb2, health_check_pb2, protocol_pb2
from envoy.config.endpoint.v3 import endpoint_components_pb2, endpoint_pb2
from envoy.config.listener.v3 import listener_components_pb2, listener_pb2
from envoy.config.route.v3 import route_components_pb2, route_pb2
from envoy.extensions.filters.http.buffer.v3 import buffer_pb2
from envoy.extensions.filters.http.router.v3 import router_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import (
    http_connection_manager_pb2 as hcm_pb2,
)
from envoy.extensions.transport_sockets.tls.v3 import secret_pb2
from envoy.type.v3 import percent_pb2
from google.protobuf import any_pb2, descriptor, duration_pb2, json_format, wrappers_pb2
from google.protobuf.descriptor import Descriptor
from google.protobuf.message import Message

from pilotfish.build.desired import DesiredState, build_snapshot, merge_states
from pilotfish.build.validate import RuleChecker, RuleNotUnderstood, check_references, understands
from pilotfish.errors import ConfigError
from pilotfish.resources import CLUSTER, ENDPOINT, EXTENSION_CONFIG, LISTENER, ROUTE, SECRET, ResourceType
from pilotfish.resources.anytypes import ensure_types_in
from pilotfish.resources.services import Endpoint, ServiceSpec

# -- helpers --------------------------------------------------------------------------------------


def problems_of(message: Message) -> list[str]:
    """Each violation as ``path: message`` (a fresh checker: nothing remembered)."""
    return [f"{v.path}: {v.message()}" for v in RuleChecker().check_message(message)]


def packed(message: Message) -> any_pb2.Any:
    out = any_pb2.Any()
    out.Pack(message)
    return out


def good_cluster(**changes: object) -> cluster_pb2.Cluster:
    cluster = cluster_pb2.Cluster(
        name="web", type=cluster_pb2.Cluster.STATIC, connect_timeout=duration_pb2.Duration(seconds=1)
    )
    for key, value in changes.items():
        if isinstance(value, Message):
            getattr(cluster, key).CopyFrom(value)
        else:
            setattr(cluster, key, value)
    return cluster


def socket(address: str = "10.0.0.1", port: int = 8080) -> address_pb2.Address:
    return address_pb2.Address(socket_address=address_pb2.SocketAddress(address=address, port_value=port))


def route_config(**host_changes: object) -> route_pb2.RouteConfiguration:
    host = route_components_pb2.VirtualHost(
        name="web",
        domains=["*"],
        routes=[
            route_components_pb2.Route(
                match=route_components_pb2.RouteMatch(prefix="/"), route=route_components_pb2.RouteAction(cluster="web")
            )
        ],
    )
    for key, value in host_changes.items():
        field = getattr(host, key)
        del field[:]
        field.extend(value)
    return route_pb2.RouteConfiguration(name="r", virtual_hosts=[host])


def manager(*http_filters: hcm_pb2.HttpFilter, stat_prefix: str = "in") -> hcm_pb2.HttpConnectionManager:
    return hcm_pb2.HttpConnectionManager(
        stat_prefix=stat_prefix, route_config=route_config(), http_filters=list(http_filters)
    )


ROUTER = hcm_pb2.HttpFilter(name="envoy.filters.http.router", typed_config=packed(router_pb2.Router()))


# -- one rule kind at a time, from real Envoy protos ----------------------------------------------

# (rule id, message with a passing value, message with a failing value, expected problem text)
Case = tuple[str, Callable[[], Message], Callable[[], Message], str]


def _lb_endpoint(weight: int | None = None, port: int = 8080, address: str = "10.0.0.1") -> Message:
    endpoint = endpoint_components_pb2.LbEndpoint(
        endpoint=endpoint_components_pb2.Endpoint(address=socket(address, port))
    )
    if weight is not None:
        endpoint.load_balancing_weight.value = weight
    return cast(
        Message,
        endpoint_pb2.ClusterLoadAssignment(
            cluster_name="web", endpoints=[endpoint_components_pb2.LocalityLbEndpoints(lb_endpoints=[endpoint])]
        ),
    )


def _health(method: int) -> Message:
    return cast(
        Message,
        health_check_pb2.HealthCheck(
            timeout=duration_pb2.Duration(seconds=1),
            interval=duration_pb2.Duration(seconds=1),
            unhealthy_threshold=wrappers_pb2.UInt32Value(value=1),
            healthy_threshold=wrappers_pb2.UInt32Value(value=1),
            http_health_check=health_check_pb2.HealthCheck.HttpHealthCheck(path="/", method=method),
        ),
    )


def _redirect(headers: list[str]) -> Message:
    config = route_config()
    config.virtual_hosts[0].routes[0].route.internal_redirect_policy.response_headers_to_copy.extend(headers)
    return cast(Message, config)


def _with_metadata(key: str) -> Message:
    cluster = good_cluster()
    cluster.metadata.filter_metadata[key].update({"a": "b"})
    return cast(Message, cluster)


def _listener_with(http_filter: hcm_pb2.HttpFilter) -> Message:
    return cast(
        Message,
        listener_pb2.Listener(
            name="in",
            address=socket("0.0.0.0", 80),
            filter_chains=[
                listener_components_pb2.FilterChain(
                    filters=[
                        listener_components_pb2.Filter(name="hcm", typed_config=packed(manager(http_filter, ROUTER)))
                    ]
                )
            ],
        ),
    )


def _buffer(size: int) -> hcm_pb2.HttpFilter:
    config = buffer_pb2.Buffer(max_request_bytes=wrappers_pb2.UInt32Value(value=size))
    return hcm_pb2.HttpFilter(name="envoy.filters.http.buffer", typed_config=packed(config))


def _hits_addend(text: str) -> Message:
    config = route_config()
    limit = config.virtual_hosts[0].rate_limits.add()
    limit.actions.add().generic_key.descriptor_value = "x"
    limit.hits_addend.format = text
    return cast(Message, config)


def _http2(window: int) -> Message:
    return cast(
        Message, protocol_pb2.Http2ProtocolOptions(initial_stream_window_size=wrappers_pb2.UInt32Value(value=window))
    )


def _path_separated_prefix(prefix: str) -> Message:
    config = route_config()
    match = config.virtual_hosts[0].routes[0].match
    match.path_separated_prefix = prefix
    return cast(Message, config)


def _secret(name: str) -> Message:
    secret = secret_pb2.Secret(name="tls")
    secret.tls_certificate.certificate_chain.filename = name
    return cast(Message, secret)


def _header_value(raw: bytes) -> Message:
    return cast(Message, base_pb2.HeaderValue(key="x-a", raw_value=raw))


CASES: list[Case] = [
    (
        "duration.gt",
        lambda: good_cluster(),
        lambda: good_cluster(connect_timeout=duration_pb2.Duration()),
        ".connect_timeout: must be greater than 0s (validate rule duration.gt), got 0s",
    ),
    (
        "enum.defined_only",
        lambda: good_cluster(lb_policy=cluster_pb2.Cluster.RING_HASH),
        lambda: good_cluster(lb_policy=99),
        ".lb_policy: must be a defined value of envoy.config.cluster.v3.Cluster.LbPolicy (ROUND_ROBIN, ",
    ),
    (
        "string.min_len",
        lambda: _lb_endpoint(),
        lambda: _lb_endpoint(address=""),
        ".endpoints[0].lb_endpoints[0].endpoint.address.socket_address.address: must not be empty "
        "(validate rule string.min_len), got ''",
    ),
    (
        "uint32.lte",
        lambda: _lb_endpoint(port=65535),
        lambda: _lb_endpoint(port=65536),
        ".endpoints[0].lb_endpoints[0].endpoint.address.socket_address.port_value: must be less than or equal to "
        "65535 (validate rule uint32.lte), got 65536",
    ),
    (
        "uint32.gte on a wrapper",
        lambda: _lb_endpoint(weight=1),
        lambda: _lb_endpoint(weight=0),
        ".endpoints[0].lb_endpoints[0].load_balancing_weight: must be greater than or equal to 1 "
        "(validate rule uint32.gte), got 0",
    ),
    (
        "repeated.min_items",
        lambda: route_config(),
        lambda: route_config(domains=[]),
        ".virtual_hosts[0].domains: must have at least 1 item(s) (validate rule repeated.min_items), got 0 item(s)",
    ),
    (
        "repeated.items.string.well_known_regex",
        lambda: route_config(domains=["a.example"]),
        lambda: route_config(domains=["a.example", "b\nexample"]),
        ".virtual_hosts[0].domains[1]: must not contain NUL, CR or LF (validate rule string.well_known_regex), "
        "got 'b\\nexample'",
    ),
    (
        "message.required",
        lambda: route_config(),
        lambda: route_config(routes=[route_components_pb2.Route(route=route_components_pb2.RouteAction(cluster="w"))]),
        ".virtual_hosts[0].routes[0].match: is required: set it (validate rule message.required)",
    ),
    (
        "oneof required",
        lambda: _lb_endpoint(),
        lambda: endpoint_pb2.ClusterLoadAssignment(
            cluster_name="web",
            endpoints=[
                endpoint_components_pb2.LocalityLbEndpoints(
                    lb_endpoints=[
                        endpoint_components_pb2.LbEndpoint(
                            endpoint=endpoint_components_pb2.Endpoint(address=address_pb2.Address())
                        )
                    ]
                )
            ],
        ),
        ".endpoints[0].lb_endpoints[0].endpoint.address.address: exactly one of socket_address, pipe, "
        "envoy_internal_address must be set (validate rule oneof.required)",
    ),
    (
        "repeated.unique",
        lambda: _redirect(["x-a", "x-b"]),
        lambda: _redirect(["x-a", "x-b", "x-a"]),
        ".virtual_hosts[0].routes[0].route.internal_redirect_policy.response_headers_to_copy[2]: must not repeat an "
        "earlier item (validate rule repeated.unique), got 'x-a'",
    ),
    (
        "map.keys.string.min_len",
        lambda: _with_metadata("envoy.lb"),
        lambda: _with_metadata(""),
        ".metadata.filter_metadata['']: must not be empty (validate rule string.min_len), got ''",
    ),
    (
        "Any in an HttpFilter's typed_config",
        lambda: _listener_with(_buffer(1024)),
        lambda: _listener_with(_buffer(0)),
        ".filter_chains[0].filters[0].typed_config.http_filters[0].typed_config.max_request_bytes: must be greater "
        "than 0 (validate rule uint32.gt), got 0",
    ),
    (
        "string.prefix with ignore_empty",
        lambda: _hits_addend(""),
        lambda: _hits_addend("abc%"),
        ".virtual_hosts[0].rate_limits[0].hits_addend.format: must start with '%' (validate rule string.prefix), "
        "got 'abc%'",
    ),
    (
        "double.gte+lte",
        lambda: percent_pb2.Percent(value=100.0),
        lambda: percent_pb2.Percent(value=100.5),
        ".value: must be inside range [0.0, 100.0] (validate rule double.gte+lte), got 100.5",
    ),
    (
        "uint32.gte+lte on a wrapper",
        lambda: _http2(65535),
        lambda: _http2(100),
        ".initial_stream_window_size: must be inside range [65535, 2147483647] (validate rule uint32.gte+lte), got 100",
    ),
    (
        "string.pattern",
        lambda: _path_separated_prefix("/api"),
        lambda: _path_separated_prefix("/api/"),
        ".virtual_hosts[0].routes[0].match.path_separated_prefix: must match the regular expression "
        "'^[^?#]+[^?#/]$' (validate rule string.pattern), got '/api/'",
    ),
    (
        "enum.not_in",
        lambda: _health(base_pb2.GET),
        lambda: _health(base_pb2.CONNECT),
        ".http_health_check.method: must not be any of CONNECT (validate rule enum.not_in), got CONNECT",
    ),
    (
        "bytes.max_len",
        lambda: _header_value(b"v" * 16384),
        lambda: _header_value(b"v" * 16385),
        ".raw_value: must be at most 16384 bytes long (validate rule bytes.max_len), got b'vvvv",
    ),
    (
        "string.min_len in an SDS secret",
        lambda: _secret("/etc/cert.pem"),
        lambda: _secret(""),
        ".tls_certificate.certificate_chain.filename: must not be empty (validate rule string.min_len), got ''",
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_rule_passes_good_value_and_names_path_rule_and_value_of_bad_one(case: Case) -> None:
    _, good, bad, expected = case
    assert problems_of(good()) == []
    found = problems_of(bad())
    assert len(found) == 1, found
    assert found[0].startswith(expected), found[0]


def test_any_of_an_unknown_type_is_a_problem_naming_the_type() -> None:
    unknown = hcm_pb2.HttpFilter(
        name="mystery", typed_config=any_pb2.Any(type_url="type.googleapis.com/acme.filters.v1.Mystery", value=b"")
    )
    found = problems_of(_listener_with(unknown))
    assert found == [
        ".filter_chains[0].filters[0].typed_config.http_filters[0].typed_config: must hold a message "
        "type of the Envoy API (check its @type and package) so that its rules can be checked, got "
        "'type.googleapis.com/acme.filters.v1.Mystery'"
    ]


def test_unset_duration_passes_and_set_only_rules_apply_when_set() -> None:
    # connect_timeout has duration.gt 0s but is optional: unset it defaults in Envoy and passes.
    assert problems_of(cluster_pb2.Cluster(name="web")) == []


def test_every_problem_of_a_resource_is_reported_not_just_the_first() -> None:
    cluster = good_cluster(name="", connect_timeout=duration_pb2.Duration(nanos=-1), lb_policy=42)
    found = problems_of(cluster)
    assert [p.split(":")[0] for p in found] == [".name", ".connect_timeout", ".lb_policy"], found


# -- every rule kind Envoy uses is understood -----------------------------------------------------


def _import_api() -> None:
    for root in ("envoy", "xds", "udpa"):
        package = importlib.import_module(root)
        for info in pkgutil.walk_packages(package.__path__, f"{root}."):
            if info.name.endswith("_pb2"):
                importlib.import_module(info.name)


def _all_messages() -> dict[str, Descriptor]:
    found: dict[str, Descriptor] = {}
    for module in list(sys.modules.values()):
        file = getattr(module, "DESCRIPTOR", None)
        if not isinstance(file, descriptor.FileDescriptor):
            continue
        stack = list(file.message_types_by_name.values())
        while stack:
            desc = stack.pop()
            found[desc.full_name] = desc
            stack.extend(desc.nested_types)
    return found


def _reachable(roots: list[Descriptor], every: dict[str, Descriptor]) -> dict[str, Descriptor]:
    """Message types reachable through fields; an Any field reaches every message (any extension
    can sit in a typed_config)."""
    seen: dict[str, Descriptor] = {}
    stack = list(roots)
    while stack:
        desc = stack.pop()
        if desc.full_name in seen:
            continue
        seen[desc.full_name] = desc
        for field in desc.fields:
            if field.message_type is None:
                continue
            if field.message_type.full_name == "google.protobuf.Any":
                stack.extend(every.values())
            stack.append(field.message_type)
    return seen


def _kinds(rules: Message, prefix: str = "") -> set[str]:
    kinds: set[str] = set()
    for kind_field, kind_rules in rules.ListFields():
        for rule_field, value in kind_rules.ListFields():
            name = f"{prefix}{kind_field.name}.{rule_field.name}"
            if rule_field.message_type is not None and rule_field.message_type.full_name == "validate.FieldRules":
                kinds |= _kinds(value, name + ".")
            else:
                kinds.add(name)
    return kinds


def test_every_rule_kind_reachable_from_the_five_resource_types_is_understood() -> None:
    started = time.monotonic()
    _import_api()  # every extension registered, so every typed_config type is reachable
    every = _all_messages()
    roots = [cast(Descriptor, t.message.DESCRIPTOR) for t in (CLUSTER, ENDPOINT, LISTENER, ROUTE, SECRET)]
    reachable = _reachable(roots, every)
    kinds: set[str] = set()
    for desc in reachable.values():
        options = desc.GetOptions()
        for flag in (pgv.disabled, pgv.ignored):
            if options.HasExtension(flag):
                kinds.add(f"message option {flag.name}")
        for field in desc.fields:
            field_options = field.GetOptions()
            if field_options.HasExtension(pgv.rules):
                kinds |= _kinds(field_options.Extensions[pgv.rules])
    assert len(reachable) > 1500, "the whole API should be reachable through typed_config"
    assert {"duration.gt", "enum.defined_only", "string.well_known_regex", "repeated.min_items"} <= kinds
    not_understood = sorted(k for k in kinds if not k.startswith("message option") and not understands(k))
    assert not_understood == [], f"validate rules pilotfish does not apply: {not_understood}"

    checker = RuleChecker()
    failures = []
    for desc in reachable.values():
        try:
            checker.compile(desc)
        except RuleNotUnderstood as exc:
            failures.append(str(exc))
    assert failures == []
    assert time.monotonic() - started < 60


def test_a_rule_kind_the_checker_does_not_know_fails_loudly() -> None:
    assert not understands("string.is_palindrome")
    assert not understands("repeated.items.string.is_palindrome")
    assert understands("repeated.items.string.min_len")
    assert understands("map.values.double.lte")


# -- inside build_snapshot ------------------------------------------------------------------------


def _state(**resources: list[Message]) -> DesiredState:
    types = {"clusters": CLUSTER, "endpoints": ENDPOINT, "listeners": LISTENER, "routes": ROUTE}
    return DesiredState(resources={types[k]: tuple(v) for k, v in resources.items()})


def test_build_snapshot_refuses_a_raw_resource_breaking_a_rule_and_names_it() -> None:
    bad = good_cluster(connect_timeout=duration_pb2.Duration())
    with pytest.raises(ConfigError) as raised:
        build_snapshot(merge_states({"file": _state(clusters=[good_cluster(name="ok"), bad])}), "snap.yaml")
    assert [str(p) for p in raised.value.problems] == [
        "clusters[1] (name 'web').connect_timeout: must be greater than 0s (validate rule duration.gt), got 0s"
    ]
    # With the rules off the same content builds (for Envoy to NACK).
    snapshot = build_snapshot(merge_states({"file": _state(clusters=[bad])}), "snap.yaml", rules=False)
    assert "web" in snapshot.types[CLUSTER.url].resources


def test_build_snapshot_checks_resources_built_from_services() -> None:
    state = DesiredState(
        services={"web": ServiceSpec(name="web", connect_timeout=0.0)}, endpoints={"web": (Endpoint("10.0.0.1", 8080),)}
    )
    with pytest.raises(ConfigError) as raised:
        build_snapshot(merge_states({"registry": state}), "registry")
    assert [str(p) for p in raised.value.problems] == [
        "services.web (its cluster 'web').connect_timeout: must be greater than 0s (validate rule duration.gt), got 0s"
    ]


def test_an_unchanged_resource_is_checked_once_across_builds() -> None:
    checker = RuleChecker()
    cluster = good_cluster()
    first = checker.check_resource(CLUSTER, _Encoded(cluster))
    assert first == () and checker.remembered() == 1
    # The same content (a new object, same hash) is not decoded or checked again: a message that
    # would fail to decode proves it.
    again = _Encoded(cluster)
    again.value = b"\xff not a cluster"
    assert checker.check_resource(CLUSTER, again) == ()


class _Encoded:
    def __init__(self, message: cluster_pb2.Cluster) -> None:
        import hashlib

        self.value = message.SerializeToString(deterministic=True)
        self.hash = hashlib.sha256(self.value).hexdigest()
        self.name = message.name


class _Stumped(RuleChecker):
    """Stands in for a checker meeting a rule it cannot apply: a real one cannot be made on demand
    (every rule kind reachable from the five resource types is understood, tested above)."""

    def check_resource(self, rtype: Any, resource: Any, message: Message | None = None) -> tuple[Any, ...]:
        raise RuleNotUnderstood(f"a rule of {rtype.key}")


def test_a_rule_that_cannot_be_applied_refuses_the_resource_by_name() -> None:
    """Raw and built resources alike: the snapshot is refused, naming the resource, never served unchecked."""
    from pilotfish.build.validate import check_rules
    from pilotfish.resources.encoded import Resource

    raw_cluster = good_cluster()
    raw = {CLUSTER: [(Resource.of(CLUSTER, raw_cluster), raw_cluster)]}
    built = {ROUTE: [Resource.of(ROUTE, route_pb2.RouteConfiguration(name="api"))]}
    problems = check_rules(raw, built, checker=_Stumped())
    assert [(p.where, p.message) for p in problems] == [
        (
            "clusters[0] (name 'web')",
            "internal error: pilotfish cannot check the validate rules here (a rule of "
            "clusters); please report it, or serve with validation off to let it through",
        ),
        (
            "services.api (its route 'api')",
            "internal error: pilotfish cannot check the validate rules here (a rule "
            "of routes); please report it, or serve with validation off to let it "
            "through",
        ),
    ]


# -- cross references (check_references) ---------------------------------------------------------


HCM = "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"


ROUTER_FILTER = {
    "name": "envoy.filters.http.router",
    "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"},
}


BUFFER = {
    "name": "envoy.filters.http.buffer",
    "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.buffer.v3.Buffer",
        "max_request_bytes": 1024,
    },
}


ECHO = {"name": "echo", "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.network.echo.v3.Echo"}}


CONNECTION_LIMIT = {
    "name": "limit",
    "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.network.connection_limit.v3.ConnectionLimit",
        "stat_prefix": "limit",
        "max_connections": 10,
    },
}


def static_cluster(name: str) -> Message:
    return json_format.ParseDict(
        {
            "name": name,
            "type": "STATIC",
            "connect_timeout": "1s",
            "load_assignment": {
                "cluster_name": name,
                "endpoints": [
                    {
                        "lb_endpoints": [
                            {"endpoint": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": 8080}}}}
                        ]
                    }
                ],
            },
        },
        CLUSTER.message(),
    )


def routes(*actions: dict[str, Any]) -> dict[str, Any]:
    return {
        "name": "r",
        "virtual_hosts": [
            {
                "name": "v",
                "domains": ["*"],
                "routes": [{"match": {"prefix": f"/{i}"}, "route": action} for i, action in enumerate(actions)],
            }
        ],
    }


def hcm(route_config: dict[str, Any] | None = None, http_filters: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    config: dict[str, Any] = {
        "@type": HCM,
        "stat_prefix": "in",
        "http_filters": [ROUTER_FILTER] if http_filters is None else http_filters,
    }
    if route_config is None:
        config["rds"] = {"route_config_name": "r", "config_source": {"ads": {}, "resource_api_version": "V3"}}
    else:
        config["route_config"] = route_config
    return {"name": "envoy.filters.network.http_connection_manager", "typed_config": config}


def listener(*filters: dict[str, Any]) -> Message:
    document = {
        "name": "in",
        "address": {"socket_address": {"address": "127.0.0.1", "port_value": 10000}},
        "filter_chains": [{"filters": list(filters)}],
    }
    assert ensure_types_in(document) == []
    return cast(Message, json_format.ParseDict(document, listener_pb2.Listener()))


def problems(**resources: list[Message]) -> list[str]:
    types: dict[str, ResourceType] = {
        "clusters": CLUSTER,
        "listeners": LISTENER,
        "routes": ROUTE,
        "extension_configs": EXTENSION_CONFIG,
    }
    return [str(p) for p in check_references({types[k]: tuple(v) for k, v in resources.items()})]


def test_route_to_a_missing_cluster_is_refused_and_an_existing_one_is_not() -> None:
    config = json_format.ParseDict(routes({"cluster": "web"}, {"cluster": "gone"}), route_pb2.RouteConfiguration())
    assert problems(clusters=[static_cluster("web")], routes=[config]) == [
        "routes[0] (name 'r').virtual_hosts[0].routes[1].route.cluster: cluster 'gone' does not exist: add it "
        "under 'clusters' (or define service 'gone'); Envoy would answer 503"
    ]


def test_weighted_clusters_are_checked_and_per_request_choices_are_not() -> None:
    config = json_format.ParseDict(
        routes(
            {"weighted_clusters": {"clusters": [{"name": "web", "weight": 1}, {"name": "canary", "weight": 1}]}},
            {"cluster_header": "x-cluster"},
        ),
        route_pb2.RouteConfiguration(),
    )
    assert problems(clusters=[static_cluster("web")], routes=[config]) == [
        "routes[0] (name 'r').virtual_hosts[0].routes[0].route.weighted_clusters.clusters[1].name: cluster 'canary' "
        "does not exist: add it under 'clusters' (or define service 'canary'); Envoy would answer 503"
    ]


def test_inline_route_config_of_a_connection_manager_is_checked() -> None:
    found = problems(listeners=[listener(hcm(routes({"cluster": "gone"})))])
    assert found == [
        "listeners[0] (name 'in').filter_chains[0].filters[0].typed_config.route_config.virtual_hosts[0].routes[0]"
        ".route.cluster: cluster 'gone' does not exist: add it under 'clusters' (or define service 'gone'); Envoy "
        "would answer 503"
    ]


_HEADER_MUTATION = "type.googleapis.com/envoy.extensions.filters.http.header_mutation.v3.HeaderMutation"
_LUA = "type.googleapis.com/envoy.extensions.filters.http.lua.v3.Lua"


def extension_config(name: str, kind: str = _HEADER_MUTATION) -> Message:
    document = {"name": name, "typed_config": {"@type": kind}}
    assert ensure_types_in(document) == []
    message: Message = json_format.ParseDict(document, EXTENSION_CONFIG.message())
    return message


def test_an_http_filter_from_ecds_needs_its_extension_config_of_a_type_it_accepts() -> None:
    def discovered(name: str, *, default: bool = False) -> dict[str, Any]:
        discovery: dict[str, Any] = {
            "config_source": {"ads": {}, "resource_api_version": "V3"},
            "type_urls": [_HEADER_MUTATION],
        }
        if default:
            discovery["default_config"] = {"@type": _HEADER_MUTATION}
        return {"name": name, "config_discovery": discovery}

    config = json_format.ParseDict(routes({"cluster": "web"}), route_pb2.RouteConfiguration())
    filters = [discovered("headers"), discovered("fallback", default=True), discovered("script"), ROUTER_FILTER]
    found = problems(
        listeners=[listener(hcm(http_filters=filters))],
        routes=[config],
        clusters=[static_cluster("web")],
        extension_configs=[extension_config("script", _LUA)],
    )
    where = "listeners[0] (name 'in').filter_chains[0].filters[0].typed_config.http_filters"
    assert found == [
        f"{where}[0] (name 'headers'): extension config 'headers' does not exist: add it under 'extension_configs' "
        "(or give the filter a default_config); Envoy would hold the listener until it arrives",
        f"{where}[2] (name 'script'): extension config 'script' is a envoy.extensions.filters.http.lua.v3.Lua, but "
        "the filter accepts only envoy.extensions.filters.http.header_mutation.v3.HeaderMutation "
        "(config_discovery.type_urls): Envoy would reject it",
    ]
    assert (
        problems(
            listeners=[listener(hcm(http_filters=filters))],
            routes=[config],
            clusters=[static_cluster("web")],
            extension_configs=[extension_config("headers"), extension_config("script")],
        )
        == []
    )


_RBAC = "type.googleapis.com/envoy.extensions.filters.network.rbac.v3.RBAC"
_TLS_INSPECTOR = "type.googleapis.com/envoy.extensions.filters.listener.tls_inspector.v3.TlsInspector"


def test_listener_and_network_filters_from_ecds_need_their_extension_configs_too() -> None:
    def discovered(name: str, kind: str) -> dict[str, Any]:
        source = {"config_source": {"ads": {}, "resource_api_version": "V3"}, "type_urls": [kind]}
        return {"name": name, "config_discovery": source}

    message = listener(discovered("authz", _RBAC), hcm(routes({"cluster": "web"})))
    assert isinstance(message, listener_pb2.Listener)
    json_format.ParseDict(discovered("inspect", _TLS_INSPECTOR), message.listener_filters.add())
    found = problems(
        listeners=[message], clusters=[static_cluster("web")], extension_configs=[extension_config("authz", _LUA)]
    )
    assert found == [
        "listeners[0] (name 'in').listener_filters[0] (name 'inspect'): extension config 'inspect' does not exist: "
        "add it under 'extension_configs' (or give the filter a default_config); Envoy would hold the listener "
        "until it arrives",
        "listeners[0] (name 'in').filter_chains[0].filters[0] (name 'authz'): extension config 'authz' is a "
        "envoy.extensions.filters.http.lua.v3.Lua, but the filter accepts only "
        "envoy.extensions.filters.network.rbac.v3.RBAC (config_discovery.type_urls): Envoy would reject it",
    ]


def test_tcp_proxy_to_a_missing_cluster_is_refused() -> None:
    proxy = {
        "name": "tcp",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.network.tcp_proxy.v3.TcpProxy",
            "stat_prefix": "tcp",
            "cluster": "db",
        },
    }
    assert problems(listeners=[listener(proxy)]) == [
        "listeners[0] (name 'in').filter_chains[0].filters[0].typed_config.cluster: cluster 'db' does not exist: add "
        "it under 'clusters' (or define service 'db'); Envoy would answer 503"
    ]
    assert problems(listeners=[listener(proxy)], clusters=[static_cluster("db")]) == []


def test_clusters_built_from_services_count_as_existing() -> None:
    config = json_format.ParseDict(routes({"cluster": "web"}), route_pb2.RouteConfiguration())
    state = DesiredState(
        services={"web": ServiceSpec(name="web")},
        endpoints={"web": (Endpoint("10.0.0.1", 8080),)},
        resources={ROUTE: (config,)},
    )
    snapshot = build_snapshot(merge_states({"file": state}), "snap.yaml")
    assert set(snapshot.types[ROUTE.url].resources) == {"r"}

    lonely = DesiredState(resources={ROUTE: (config,)})
    try:
        build_snapshot(merge_states({"file": lonely}), "snap.yaml")
    except ConfigError as exc:
        assert [p.where for p in exc.problems] == ["routes[0] (name 'r').virtual_hosts[0].routes[0].route.cluster"]
    else:
        raise AssertionError("a route to a cluster nobody defines was accepted")


def test_chain_ending_in_a_non_terminal_filter_is_refused() -> None:
    assert problems(listeners=[listener(CONNECTION_LIMIT)]) == [
        "listeners[0] (name 'in').filter_chains[0].filters[0] (name 'limit'): the last network filter must be a "
        "terminal filter (such as http_connection_manager or tcp_proxy), got envoy.extensions.filters.network."
        "connection_limit.v3.ConnectionLimit: Envoy would reject the listener"
    ]


def test_terminal_filter_before_the_last_is_refused() -> None:
    assert problems(listeners=[listener(ECHO, CONNECTION_LIMIT)]) == [
        "listeners[0] (name 'in').filter_chains[0].filters[0] (name 'echo'): terminal filter envoy.extensions."
        "filters.network.echo.v3.Echo must be the last filter of its chain: Envoy would reject the listener",
        "listeners[0] (name 'in').filter_chains[0].filters[1] (name 'limit'): the last network filter must be a "
        "terminal filter (such as http_connection_manager or tcp_proxy), got envoy.extensions.filters.network."
        "connection_limit.v3.ConnectionLimit: Envoy would reject the listener",
    ]


def test_non_terminal_then_terminal_filter_is_fine() -> None:
    assert problems(listeners=[listener(CONNECTION_LIMIT, ECHO)]) == []


def test_empty_filter_chain_is_refused() -> None:
    assert problems(listeners=[listener()]) == [
        "listeners[0] (name 'in').filter_chains[0].filters: has no filters, so every connection it matches would "
        "be closed: end it with a terminal filter such as envoy.filters.network.http_connection_manager or "
        "tcp_proxy"
    ]


def test_http_filters_must_end_in_the_router() -> None:
    inline = {
        "name": "r",
        "virtual_hosts": [
            {"name": "v", "domains": ["*"], "routes": [{"match": {"prefix": "/"}, "direct_response": {"status": 200}}]}
        ],
    }
    assert problems(listeners=[listener(hcm(inline, [ROUTER_FILTER]))]) == []
    assert problems(listeners=[listener(hcm(inline, [BUFFER, ROUTER_FILTER]))]) == []
    assert problems(listeners=[listener(hcm(inline, []))]) == [], "no filters: Envoy uses the router"
    assert problems(listeners=[listener(hcm(inline, [ROUTER_FILTER, BUFFER]))]) == [
        "listeners[0] (name 'in').filter_chains[0].filters[0].typed_config.http_filters[0] (name "
        "'envoy.filters.http.router'): terminal HTTP filter envoy.extensions.filters.http.router.v3.Router must be "
        "the last one: Envoy would reject the listener",
        "listeners[0] (name 'in').filter_chains[0].filters[0].typed_config.http_filters[1] (name "
        "'envoy.filters.http.buffer'): the last HTTP filter must be the router (envoy.filters.http.router), got "
        "envoy.extensions.filters.http.buffer.v3.Buffer: Envoy would reject the listener",
    ]


def test_a_filter_without_typed_config_is_refused() -> None:
    # What a half-written file can leave: a name and nothing else (Envoy: "Didn't find a
    # registered implementation for 'envoy.fil' with type URL: ''").
    untyped = {"name": "envoy.fil"}
    assert problems(listeners=[listener(untyped)]) == [
        "listeners[0] (name 'in').filter_chains[0].filters[0] (name 'envoy.fil'): has neither typed_config nor "
        "config_discovery: Envoy finds a filter by the @type of its typed_config (the name alone is not enough) "
        "and would reject the listener"
    ]
    inline = {
        "name": "r",
        "virtual_hosts": [
            {"name": "v", "domains": ["*"], "routes": [{"match": {"prefix": "/"}, "direct_response": {"status": 200}}]}
        ],
    }
    assert problems(listeners=[listener(hcm(inline, [{"name": "envoy.filters.http.rou"}]))]) == [
        "listeners[0] (name 'in').filter_chains[0].filters[0].typed_config.http_filters[0] (name "
        "'envoy.filters.http.rou'): has neither typed_config nor config_discovery: Envoy finds a filter by the "
        "@type of its typed_config (the name alone is not enough) and would reject the listener"
    ]
