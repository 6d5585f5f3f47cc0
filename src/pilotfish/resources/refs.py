"""Which clusters the listeners and routes of a configuration send traffic to.

Used for make-before-break: a cluster that routes still point at must not disappear from a
proxy before the routes that point at it have moved away.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.listener.v3 import listener_pb2
from envoy.config.route.v3 import route_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import (
    http_connection_manager_pb2 as hcm_pb2,
)
from envoy.extensions.filters.network.tcp_proxy.v3 import tcp_proxy_pb2

__all__ = [
    "assignment_names",
    "clusters_of_listener",
    "clusters_of_route_config",
    "connection_managers",
    "referenced_clusters",
]

_HCM = hcm_pb2.HttpConnectionManager.DESCRIPTOR.full_name
_TCP_PROXY = tcp_proxy_pb2.TcpProxy.DESCRIPTOR.full_name


def connection_managers(listener: listener_pb2.Listener) -> Iterator[tuple[str, hcm_pb2.HttpConnectionManager]]:
    """Every HTTP connection manager of a listener, with where it sits (for messages)."""
    chains = list(listener.filter_chains)
    if listener.HasField("default_filter_chain"):
        chains.append(listener.default_filter_chain)
    for ci, chain in enumerate(chains):
        for fi, network_filter in enumerate(chain.filters):
            if network_filter.typed_config.TypeName() == _HCM:
                hcm = hcm_pb2.HttpConnectionManager()
                network_filter.typed_config.Unpack(hcm)
                yield f"filter_chains[{ci}].filters[{fi}]", hcm
    if listener.HasField("api_listener") and listener.api_listener.api_listener.TypeName() == _HCM:
        hcm = hcm_pb2.HttpConnectionManager()
        listener.api_listener.api_listener.Unpack(hcm)
        yield "api_listener", hcm


def clusters_of_route_config(config: route_pb2.RouteConfiguration) -> set[str]:
    names: set[str] = set()
    for host in config.virtual_hosts:
        for route in host.routes:
            if not route.HasField("route"):
                continue
            action = route.route
            if action.cluster:
                names.add(action.cluster)
            names.update(c.name for c in action.weighted_clusters.clusters)
            names.update(m.cluster for m in action.request_mirror_policies if m.cluster)
    return names


def clusters_of_listener(listener: listener_pb2.Listener) -> set[str]:
    names: set[str] = set()
    for _, hcm in connection_managers(listener):
        if hcm.HasField("route_config"):
            names |= clusters_of_route_config(hcm.route_config)
    for chain in (*listener.filter_chains, listener.default_filter_chain):
        for network_filter in chain.filters:
            if network_filter.typed_config.TypeName() == _TCP_PROXY:
                proxy = tcp_proxy_pb2.TcpProxy()
                network_filter.typed_config.Unpack(proxy)
                if proxy.cluster:
                    names.add(proxy.cluster)
                names.update(c.name for c in proxy.weighted_clusters.clusters)
    return names


def referenced_clusters(
    listeners: Iterable[listener_pb2.Listener], route_configs: Iterable[route_pb2.RouteConfiguration]
) -> set[str]:
    """Clusters named by any of these listeners or route configurations."""
    names: set[str] = set()
    for listener in listeners:
        names |= clusters_of_listener(listener)
    for config in route_configs:
        names |= clusters_of_route_config(config)
    return names


def assignment_names(clusters: Iterable[cluster_pb2.Cluster]) -> set[str]:
    """The endpoint (ClusterLoadAssignment) names these EDS clusters ask for: each one's EDS
    service name, else its own name."""
    return {
        cluster.eds_cluster_config.service_name or cluster.name
        for cluster in clusters
        if cluster.WhichOneof("cluster_discovery_type") == "type" and cluster.type == cluster_pb2.Cluster.EDS
    }
