"""Which clusters listeners and routes send traffic to (pilotfish.resources.refs): what
make-before-break holds back a cluster's removal for. Every way Envoy config names a cluster counts:
a route's cluster, weighted clusters, request mirrors, an inline route config of a connection
manager (in a filter chain, the default chain or an API listener), and a TCP proxy's cluster or
weighted clusters; a redirect, a direct response and an RDS reference name none themselves."""

from __future__ import annotations

from typing import Any

from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.listener.v3 import listener_pb2
from envoy.config.route.v3 import route_pb2
from google.protobuf import json_format

from pilotfish.resources.refs import (
    assignment_names,
    clusters_of_listener,
    clusters_of_route_config,
    connection_managers,
    referenced_clusters,
)

HCM = "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"
TCP = "type.googleapis.com/envoy.extensions.filters.network.tcp_proxy.v3.TcpProxy"


def routes(*actions: dict[str, Any]) -> dict[str, Any]:
    return {
        "name": "r",
        "virtual_hosts": [
            {
                "name": "all",
                "domains": ["*"],
                "routes": [{"match": {"prefix": f"/{i}"}, **action} for i, action in enumerate(actions)],
            }
        ],
    }


def route_config(*actions: dict[str, Any]) -> route_pb2.RouteConfiguration:
    return json_format.ParseDict(routes(*actions), route_pb2.RouteConfiguration())


def manager(**fields: Any) -> dict[str, Any]:
    return {"name": "hcm", "typed_config": {"@type": HCM, "stat_prefix": "x", **fields}}


def listener(**fields: Any) -> listener_pb2.Listener:
    return json_format.ParseDict({"name": "l", **fields}, listener_pb2.Listener())


def test_every_kind_of_route_action_names_its_clusters_and_the_others_none() -> None:
    config = route_config(
        {"route": {"cluster": "web"}},
        {"route": {"weighted_clusters": {"clusters": [{"name": "blue", "weight": 1}, {"name": "green", "weight": 3}]}}},
        {"route": {"cluster": "api", "request_mirror_policies": [{"cluster": "shadow"}]}},
        {"redirect": {"host_redirect": "example.com"}},
        {"direct_response": {"status": 200}},
        {"route": {"cluster_header": "x-cluster"}},  # chosen per request: no cluster to hold back
    )
    assert clusters_of_route_config(config) == {"web", "blue", "green", "api", "shadow"}


def test_a_listener_names_the_clusters_of_its_inline_routes_and_tcp_proxies_not_of_rds() -> None:
    inline = manager(route_config=routes({"route": {"cluster": "inline"}}))
    rds = manager(rds={"route_config_name": "r", "config_source": {"ads": {}}})
    tcp = {"name": "tcp", "typed_config": {"@type": TCP, "stat_prefix": "t", "cluster": "db"}}
    weighted = {
        "name": "tcp",
        "typed_config": {
            "@type": TCP,
            "stat_prefix": "t",
            "weighted_clusters": {"clusters": [{"name": "db-a", "weight": 1}, {"name": "db-b", "weight": 1}]},
        },
    }
    socket = listener(
        filter_chains=[{"filters": [inline]}, {"filters": [rds]}, {"filters": [tcp]}],
        default_filter_chain={"filters": [weighted]},
    )
    assert clusters_of_listener(socket) == {"inline", "db", "db-a", "db-b"}
    assert [where for where, _ in connection_managers(socket)] == [
        "filter_chains[0].filters[0]",
        "filter_chains[1].filters[0]",
    ]
    api = listener(
        api_listener={"api_listener": manager(route_config=routes({"route": {"cluster": "grpc"}}))["typed_config"]}
    )
    assert clusters_of_listener(api) == {"grpc"}
    assert [where for where, _ in connection_managers(api)] == ["api_listener"]


def test_referenced_clusters_are_those_of_every_listener_and_route_config() -> None:
    tcp = {"name": "tcp", "typed_config": {"@type": TCP, "stat_prefix": "t", "cluster": "db"}}
    assert referenced_clusters(
        [listener(filter_chains=[{"filters": [tcp]}])],
        [route_config({"route": {"cluster": "web"}}), route_config({"route": {"cluster": "api"}})],
    ) == {"db", "web", "api"}
    assert referenced_clusters([], []) == set()


def test_the_endpoints_an_eds_cluster_asks_for_are_named_by_its_service_name_else_its_own() -> None:
    """What the endpoint bridge keeps for a kept cluster (make before break)."""
    eds = {"type": "EDS", "eds_cluster_config": {"eds_config": {"ads": {}}}}
    clusters = [
        json_format.ParseDict({"name": "plain", **eds}, cluster_pb2.Cluster()),
        json_format.ParseDict(
            {"name": "named", "type": "EDS", "eds_cluster_config": {"service_name": "svc"}}, cluster_pb2.Cluster()
        ),
        json_format.ParseDict({"name": "dns", "type": "STRICT_DNS"}, cluster_pb2.Cluster()),
    ]
    assert assignment_names(clusters) == {"plain", "svc"}
