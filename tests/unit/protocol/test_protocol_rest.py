"""REST polls with no I/O: what a poll asks for, and when its client is current (304)."""

from __future__ import annotations

import pytest
from conftest import EDS, assignment, build, cluster
from envoy.service.discovery.v3 import discovery_pb2

from pilotfish.cache import SnapshotCache
from pilotfish.errors import PeerError
from pilotfish.protocol import PeerOverLimit, XdsLimits
from pilotfish.protocol.rest import RestPoll, is_current, read_poll
from pilotfish.resources import CLUSTER, ENDPOINT
from pilotfish.resources.bootstrap import BootstrapSettings, bootstrap
from pilotfish.snapshot import Snapshot

LIMITS = XdsLimits(max_resource_names=3, max_node_id_chars=8, max_version_chars=40)


def request(*names: str, version: str = "", node: str = "edge-1", type_url: str = "") -> discovery_pb2.DiscoveryRequest:
    message = discovery_pb2.DiscoveryRequest(version_info=version, resource_names=names, type_url=type_url)
    message.node.id = node
    return message


def snapshots(*steps: dict[str, int]) -> list[Snapshot]:
    """One snapshot per step: clusters and their endpoint port, versioned by content."""
    return [
        build(clusters=[cluster(n) for n in ports], endpoints=[assignment(n, p) for n, p in ports.items()])
        for ports in steps
    ]


def test_no_names_is_everything_for_clusters_and_nothing_for_endpoints() -> None:
    assert read_poll(request(), CLUSTER, LIMITS).subscription.wildcard
    endpoints = read_poll(request(), ENDPOINT, LIMITS).subscription
    assert not endpoints.wildcard and endpoints.names == frozenset()
    named = read_poll(request("a", "b"), ENDPOINT, LIMITS)
    assert named.subscription.names == {"a", "b"} and named.node.id == "edge-1"
    assert read_poll(request("*", "a"), CLUSTER, LIMITS).subscription.wildcard


def test_a_poll_over_a_limit_or_of_another_type_is_refused_naming_the_field() -> None:
    with pytest.raises(PeerOverLimit, match=r"resource_names.*max_resource_names"):
        read_poll(request("a", "b", "c", "d"), ENDPOINT, LIMITS)
    with pytest.raises(PeerError, match=r"node\.id"):
        read_poll(request(node="x" * 9), CLUSTER, LIMITS)
    with pytest.raises(PeerError, match="type_url"):
        read_poll(request(type_url=EDS), CLUSTER, LIMITS)
    assert read_poll(request(type_url=EDS), ENDPOINT, LIMITS).rtype is ENDPOINT
    long = read_poll(request(version="v" * 100), CLUSTER, LIMITS)
    assert len(long.version_info) < 100, "a long version is kept shortened, not refused"


def test_current_at_the_current_version_never_at_none() -> None:
    [first] = snapshots({"a": 1})
    clusters = first.types[CLUSTER.url]
    assert is_current(read_poll(request(version=clusters.version), CLUSTER, LIMITS), clusters, None)
    assert not is_current(read_poll(request(), CLUSTER, LIMITS), clusters, None), "a first poll is answered"
    assert not is_current(read_poll(request(version="other"), CLUSTER, LIMITS), clusters, None)


def test_a_named_poll_is_current_while_what_it_names_is_unchanged_since_its_version() -> None:
    cache = SnapshotCache()
    v1, v2 = snapshots({"a": 1, "b": 2}, {"a": 1, "b": 3})
    cache.set_snapshot(v1)
    old = v1.types[ENDPOINT.url].version
    cache.set_snapshot(v2)
    current = v2.types[ENDPOINT.url]
    stated = cache.kept(ENDPOINT.url, old)
    assert stated is not None and stated.version == old

    def current_for(*names: str) -> bool:
        poll = read_poll(request(*names, version=old), ENDPOINT, LIMITS)
        return is_current(poll, current, stated)

    assert current_for("a"), "a's endpoints did not change"
    assert not current_for("b"), "b's did"
    assert not current_for("a", "b")
    assert current_for("gone"), "absent then and now: nothing to send"
    # A version no longer kept: answered in full.
    assert not is_current(read_poll(request("a", version=old), ENDPOINT, LIMITS), current, None)


def test_everything_is_current_only_at_the_current_version() -> None:
    cache = SnapshotCache()
    v1, v2 = snapshots({"a": 1}, {"a": 1, "b": 2})
    cache.set_snapshot(v1)
    old = v1.types[CLUSTER.url].version
    cache.set_snapshot(v2)
    stated, current = cache.kept(CLUSTER.url, old), v2.types[CLUSTER.url]
    assert stated is not None and current.version != old
    assert not is_current(read_poll(request(version=old), CLUSTER, LIMITS), current, stated), "b is new"
    assert is_current(read_poll(request("a", version=old), CLUSTER, LIMITS), current, stated), "a is the same"


def test_a_resource_that_appears_or_disappears_is_news() -> None:
    cache = SnapshotCache()
    v1, v2 = snapshots({"a": 1}, {"b": 2})
    cache.set_snapshot(v1)
    old = v1.types[ENDPOINT.url].version
    cache.set_snapshot(v2)
    stated, current = cache.kept(ENDPOINT.url, old), v2.types[ENDPOINT.url]
    for name in ("a", "b"):
        poll = RestPoll(ENDPOINT, request().node, old, read_poll(request(name), ENDPOINT, LIMITS).subscription)
        assert not is_current(poll, current, stated), name


def test_bootstrap_rest_polls_clusters_and_listeners_over_http1() -> None:
    config = bootstrap(BootstrapSettings(node_id="n", rest="127.0.0.1:18001", refresh=0.5, tls_ca="/ca.pem"))
    dynamic = config["dynamic_resources"]
    assert "ads_config" not in dynamic
    for key in ("cds_config", "lds_config"):
        source = dynamic[key]["api_config_source"]
        assert source == {
            "api_type": "REST",
            "transport_api_version": "V3",
            "cluster_names": ["xds_cluster"],
            "refresh_delay": "0.5s",
        }
    [xds] = config["static_resources"]["clusters"]
    assert xds["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["socket_address"] == {
        "address": "127.0.0.1",
        "port_value": 18001,
    }
    assert "typed_extension_protocol_options" not in xds, "HTTP/1.1, not HTTP/2"
    assert xds["transport_socket"]["typed_config"]["common_tls_context"]["alpn_protocols"] == ["http/1.1"]
    with pytest.raises(ValueError, match="--rest and --delta"):
        BootstrapSettings(node_id="n", rest="127.0.0.1:1", delta=True)
