"""The resource types pilotfish serves (pilotfish.resources.types): looked up by type URL and by
snapshot-file section, in the order ADS sends them (clusters before their endpoints, listeners
before their routes); CDS and LDS are the wildcard types."""

from __future__ import annotations

from envoy.config.cluster.v3 import cluster_pb2

from pilotfish.resources.types import (
    ADS_ORDER,
    CLUSTER,
    ENDPOINT,
    EXTENSION_CONFIG,
    LISTENER,
    ROUTE,
    RUNTIME,
    SECRET,
    TYPES,
    type_by_key,
    type_by_url,
)


def test_each_type_is_found_by_its_url_and_its_section_and_nothing_else_is() -> None:
    for rtype in TYPES:
        assert type_by_url(rtype.url) is rtype and type_by_key(rtype.key) is rtype
        assert rtype.url == "type.googleapis.com/" + rtype.message.DESCRIPTOR.full_name
    assert CLUSTER.url == "type.googleapis.com/envoy.config.cluster.v3.Cluster"
    assert CLUSTER.message is cluster_pb2.Cluster
    assert type_by_url("type.googleapis.com/envoy.config.cluster.v3.Clusters") is None
    assert type_by_url("envoy.config.cluster.v3.Cluster") is None  # the prefix is part of the URL
    assert type_by_key("cluster") is None


def test_ads_sends_clusters_before_endpoints_and_listeners_before_routes() -> None:
    assert (CLUSTER.url, ENDPOINT.url, EXTENSION_CONFIG.url, LISTENER.url, ROUTE.url, SECRET.url, RUNTIME.url) == (
        ADS_ORDER
    )
    assert [t.short for t in TYPES] == ["CDS", "EDS", "ECDS", "LDS", "RDS", "SDS", "RTDS"]
    assert [t.key for t in TYPES if t.wildcard] == ["clusters", "listeners"]
    assert (ENDPOINT.name_field, CLUSTER.name_field) == ("cluster_name", "name")
