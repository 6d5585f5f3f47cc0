"""Cross references checked before a snapshot is served (pilotfish.build.validate.check_references).

What these refuse, Envoy would either reject (a filter chain that does not end in a terminal
filter, checked against ``envoy --mode validate`` 1.40) or accept and then fail every request
(a route to a cluster that does not exist: 503; an empty filter chain: every connection closed).
"""

from __future__ import annotations

from typing import Any

from envoy.config.listener.v3 import listener_pb2
from envoy.config.route.v3 import route_pb2
from google.protobuf import json_format
from google.protobuf.message import Message

from pilotfish.build.desired import DesiredState, build_snapshot, merge_states
from pilotfish.build.validate import check_references
from pilotfish.errors import ConfigError
from pilotfish.resources import CLUSTER, LISTENER, ROUTE, ResourceType
from pilotfish.resources.anytypes import ensure_types_in
from pilotfish.resources.services import Endpoint, ServiceSpec

HCM = "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"
ROUTER = {"name": "envoy.filters.http.router",
          "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}
BUFFER = {"name": "envoy.filters.http.buffer",
          "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.buffer.v3.Buffer",
                           "max_request_bytes": 1024}}
ECHO = {"name": "echo", "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.network.echo.v3.Echo"}}
CONNECTION_LIMIT = {"name": "limit", "typed_config": {
    "@type": "type.googleapis.com/envoy.extensions.filters.network.connection_limit.v3.ConnectionLimit",
    "stat_prefix": "limit", "max_connections": 10}}


def static_cluster(name: str) -> Message:
    return json_format.ParseDict({
        "name": name, "type": "STATIC", "connect_timeout": "1s",
        "load_assignment": {"cluster_name": name, "endpoints": [{"lb_endpoints": [{"endpoint": {"address": {
            "socket_address": {"address": "127.0.0.1", "port_value": 8080}}}}]}]},
    }, CLUSTER.message())


def routes(*actions: dict[str, Any]) -> dict[str, Any]:
    return {"name": "r", "virtual_hosts": [{"name": "v", "domains": ["*"], "routes": [
        {"match": {"prefix": f"/{i}"}, "route": action} for i, action in enumerate(actions)]}]}


def hcm(route_config: dict[str, Any] | None = None, http_filters: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    config: dict[str, Any] = {"@type": HCM, "stat_prefix": "in",
                              "http_filters": [ROUTER] if http_filters is None else http_filters}
    if route_config is None:
        config["rds"] = {"route_config_name": "r", "config_source": {"ads": {}, "resource_api_version": "V3"}}
    else:
        config["route_config"] = route_config
    return {"name": "envoy.filters.network.http_connection_manager", "typed_config": config}


def listener(*filters: dict[str, Any]) -> Message:
    document = {
        "name": "in", "address": {"socket_address": {"address": "127.0.0.1", "port_value": 10000}},
        "filter_chains": [{"filters": list(filters)}],
    }
    assert ensure_types_in(document) == []
    return json_format.ParseDict(document, listener_pb2.Listener())


def problems(**resources: list[Message]) -> list[str]:
    types: dict[str, ResourceType] = {"clusters": CLUSTER, "listeners": LISTENER, "routes": ROUTE}
    return [str(p) for p in check_references({types[k]: tuple(v) for k, v in resources.items()})]


# -- routes to clusters ---------------------------------------------------------------------------


def test_route_to_a_missing_cluster_is_refused_and_an_existing_one_is_not() -> None:
    config = json_format.ParseDict(routes({"cluster": "web"}, {"cluster": "gone"}), route_pb2.RouteConfiguration())
    assert problems(clusters=[static_cluster("web")], routes=[config]) == [
        "routes[0] (name 'r').virtual_hosts[0].routes[1].route.cluster: cluster 'gone' does not exist: add it "
        "under 'clusters' (or define service 'gone'); Envoy would answer 503"]


def test_weighted_clusters_are_checked_and_per_request_choices_are_not() -> None:
    config = json_format.ParseDict(routes(
        {"weighted_clusters": {"clusters": [{"name": "web", "weight": 1}, {"name": "canary", "weight": 1}]}},
        {"cluster_header": "x-cluster"},
    ), route_pb2.RouteConfiguration())
    assert problems(clusters=[static_cluster("web")], routes=[config]) == [
        "routes[0] (name 'r').virtual_hosts[0].routes[0].route.weighted_clusters.clusters[1].name: cluster 'canary' "
        "does not exist: add it under 'clusters' (or define service 'canary'); Envoy would answer 503"]


def test_inline_route_config_of_a_connection_manager_is_checked() -> None:
    found = problems(listeners=[listener(hcm(routes({"cluster": "gone"})))])
    assert found == [
        "listeners[0] (name 'in').filter_chains[0].filters[0].typed_config.route_config.virtual_hosts[0].routes[0]"
        ".route.cluster: cluster 'gone' does not exist: add it under 'clusters' (or define service 'gone'); Envoy "
        "would answer 503"]


def test_tcp_proxy_to_a_missing_cluster_is_refused() -> None:
    proxy = {"name": "tcp", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.network.tcp_proxy.v3.TcpProxy",
        "stat_prefix": "tcp", "cluster": "db"}}
    assert problems(listeners=[listener(proxy)]) == [
        "listeners[0] (name 'in').filter_chains[0].filters[0].typed_config.cluster: cluster 'db' does not exist: add "
        "it under 'clusters' (or define service 'db'); Envoy would answer 503"]
    assert problems(listeners=[listener(proxy)], clusters=[static_cluster("db")]) == []


def test_clusters_built_from_services_count_as_existing() -> None:
    config = json_format.ParseDict(routes({"cluster": "web"}), route_pb2.RouteConfiguration())
    state = DesiredState(services={"web": ServiceSpec(name="web")},
                         endpoints={"web": (Endpoint("10.0.0.1", 8080),)},
                         resources={ROUTE: (config,)})
    snapshot = build_snapshot(merge_states({"file": state}), "snap.yaml")
    assert set(snapshot.types[ROUTE.url].resources) == {"r"}

    lonely = DesiredState(resources={ROUTE: (config,)})
    try:
        build_snapshot(merge_states({"file": lonely}), "snap.yaml")
    except ConfigError as exc:
        assert [p.where for p in exc.problems] == ["routes[0] (name 'r').virtual_hosts[0].routes[0].route.cluster"]
    else:
        raise AssertionError("a route to a cluster nobody defines was accepted")


# -- terminal filters -----------------------------------------------------------------------------


def test_chain_ending_in_a_non_terminal_filter_is_refused() -> None:
    assert problems(listeners=[listener(CONNECTION_LIMIT)]) == [
        "listeners[0] (name 'in').filter_chains[0].filters[0] (name 'limit'): the last network filter must be a "
        "terminal filter (such as http_connection_manager or tcp_proxy), got envoy.extensions.filters.network."
        "connection_limit.v3.ConnectionLimit: Envoy would reject the listener"]


def test_terminal_filter_before_the_last_is_refused() -> None:
    assert problems(listeners=[listener(ECHO, CONNECTION_LIMIT)]) == [
        "listeners[0] (name 'in').filter_chains[0].filters[0] (name 'echo'): terminal filter envoy.extensions."
        "filters.network.echo.v3.Echo must be the last filter of its chain: Envoy would reject the listener",
        "listeners[0] (name 'in').filter_chains[0].filters[1] (name 'limit'): the last network filter must be a "
        "terminal filter (such as http_connection_manager or tcp_proxy), got envoy.extensions.filters.network."
        "connection_limit.v3.ConnectionLimit: Envoy would reject the listener"]


def test_non_terminal_then_terminal_filter_is_fine() -> None:
    assert problems(listeners=[listener(CONNECTION_LIMIT, ECHO)]) == []


def test_empty_filter_chain_is_refused() -> None:
    assert problems(listeners=[listener()]) == [
        "listeners[0] (name 'in').filter_chains[0].filters: has no filters, so every connection it matches would "
        "be closed: end it with a terminal filter such as envoy.filters.network.http_connection_manager or "
        "tcp_proxy"]


def test_http_filters_must_end_in_the_router() -> None:
    inline = {"name": "r", "virtual_hosts": [{"name": "v", "domains": ["*"], "routes": [
        {"match": {"prefix": "/"}, "direct_response": {"status": 200}}]}]}
    assert problems(listeners=[listener(hcm(inline, [ROUTER]))]) == []
    assert problems(listeners=[listener(hcm(inline, [BUFFER, ROUTER]))]) == []
    assert problems(listeners=[listener(hcm(inline, []))]) == [], "no filters: Envoy uses the router"
    assert problems(listeners=[listener(hcm(inline, [ROUTER, BUFFER]))]) == [
        "listeners[0] (name 'in').filter_chains[0].filters[0].typed_config.http_filters[0] (name "
        "'envoy.filters.http.router'): terminal HTTP filter envoy.extensions.filters.http.router.v3.Router must be "
        "the last one: Envoy would reject the listener",
        "listeners[0] (name 'in').filter_chains[0].filters[0].typed_config.http_filters[1] (name "
        "'envoy.filters.http.buffer'): the last HTTP filter must be the router (envoy.filters.http.router), got "
        "envoy.extensions.filters.http.buffer.v3.Buffer: Envoy would reject the listener"]


def test_a_filter_without_typed_config_is_refused() -> None:
    # What a half-written file can leave: a name and nothing else (Envoy: "Didn't find a
    # registered implementation for 'envoy.fil' with type URL: ''").
    untyped = {"name": "envoy.fil"}
    assert problems(listeners=[listener(untyped)]) == [
        "listeners[0] (name 'in').filter_chains[0].filters[0] (name 'envoy.fil'): has neither typed_config nor "
        "config_discovery: Envoy finds a filter by the @type of its typed_config (the name alone is not enough) "
        "and would reject the listener"]
    inline = {"name": "r", "virtual_hosts": [{"name": "v", "domains": ["*"], "routes": [
        {"match": {"prefix": "/"}, "direct_response": {"status": 200}}]}]}
    assert problems(listeners=[listener(hcm(inline, [{"name": "envoy.filters.http.rou"}]))]) == [
        "listeners[0] (name 'in').filter_chains[0].filters[0].typed_config.http_filters[0] (name "
        "'envoy.filters.http.rou'): has neither typed_config nor config_discovery: Envoy finds a filter by the "
        "@type of its typed_config (the name alone is not enough) and would reject the listener"]
