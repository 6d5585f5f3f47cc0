"""Checks a snapshot must pass before any proxy sees it.

Cross references: an EDS cluster served over ADS needs its ClusterLoadAssignment, and a listener
whose HTTP connection manager uses RDS needs its RouteConfiguration. Without them Envoy waits
(the cluster never warms, the listener never becomes active) with no NACK to explain why, so we
refuse such a snapshot up front and name the resource.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.core.v3 import config_source_pb2
from envoy.config.listener.v3 import listener_pb2
from google.protobuf.message import Message

from pilotfish.errors import Problem
from pilotfish.resources import CLUSTER, ENDPOINT, LISTENER, ROUTE, ResourceType
from pilotfish.resources.refs import connection_managers

__all__ = ["check_references"]

def _served_by_xds(source: config_source_pb2.ConfigSource) -> bool:
    # Resources read from files on the proxy's disk are not ours to provide.
    return source.WhichOneof("config_source_specifier") not in ("path", "path_config_source")


def check_references(
    resources: Mapping[ResourceType, tuple[Message, ...]],
    *,
    more_endpoints: Iterable[str] = (),
    more_routes: Iterable[str] = (),
) -> list[Problem]:
    """Problems with references between resources (missing endpoints or route configs).

    ``more_endpoints`` and ``more_routes`` name resources that exist besides ``resources``
    (built from services, whose own references are right by construction).
    """
    problems: list[Problem] = []
    endpoint_names = {m.cluster_name for m in resources.get(ENDPOINT, ())}  # type: ignore[attr-defined]
    endpoint_names.update(more_endpoints)
    route_names = {m.name for m in resources.get(ROUTE, ())}  # type: ignore[attr-defined]
    route_names.update(more_routes)

    for index, cluster in enumerate(resources.get(CLUSTER, ())):
        assert isinstance(cluster, cluster_pb2.Cluster)
        if cluster.WhichOneof("cluster_discovery_type") != "type" or cluster.type != cluster_pb2.Cluster.EDS:
            continue
        eds = cluster.eds_cluster_config
        if eds.HasField("eds_config") and not _served_by_xds(eds.eds_config):
            continue
        wanted = eds.service_name or cluster.name
        if wanted not in endpoint_names:
            problems.append(Problem(
                f"clusters[{index}] (name {cluster.name!r})",
                f"EDS cluster needs endpoints: add an entry with cluster_name {wanted!r} under 'endpoints'",
            ))

    for index, listener in enumerate(resources.get(LISTENER, ())):
        assert isinstance(listener, listener_pb2.Listener)
        for where, hcm in connection_managers(listener):
            if hcm.WhichOneof("route_specifier") != "rds" or not _served_by_xds(hcm.rds.config_source):
                continue
            wanted = hcm.rds.route_config_name
            if wanted not in route_names:
                problems.append(Problem(
                    f"listeners[{index}] (name {listener.name!r}).{where}",
                    f"RDS route_config_name {wanted!r} has no route configuration: add it under 'routes'",
                ))
    return problems
