"""Snapshots: content-hash versions and shared encoded responses."""

from __future__ import annotations

from conftest import CDS, EDS, assignment, build, cluster
from envoy.config.cluster.v3 import cluster_pb2
from envoy.service.discovery.v3 import discovery_pb2

from pilotfish.resources.wire import nonce_field


def test_versions_ignore_order_and_follow_content() -> None:
    a = build(clusters=[cluster("a"), cluster("b")], endpoints=[assignment("a", 1), assignment("b", 2)])
    reordered = build(clusters=[cluster("b"), cluster("a")], endpoints=[assignment("b", 2), assignment("a", 1)])
    changed = build(clusters=[cluster("a"), cluster("b", "2s")], endpoints=[assignment("a", 1), assignment("b", 2)])
    assert a.versions() == reordered.versions()
    assert changed.version(CDS) != a.version(CDS)
    assert changed.version(EDS) == a.version(EDS)  # per type: endpoints did not change


def test_explicit_version_applies_to_all_types() -> None:
    snap = build(clusters=[cluster("a")], endpoints=[assignment("a", 1)], version="42")
    assert set(snap.versions().values()) == {"42"}
    assert snap.label() == "42"


def test_encoded_response_is_a_valid_discovery_response_with_any_nonce() -> None:
    snap = build(clusters=[cluster("a"), cluster("b")], endpoints=[assignment("a", 1), assignment("b", 2)])
    types = snap.get(CDS)
    assert types is not None
    body = types.response(None).body
    decoded = discovery_pb2.DiscoveryResponse.FromString(body + nonce_field("17"))
    assert decoded.nonce == "17"
    assert decoded.version_info == snap.version(CDS)
    assert decoded.type_url == CDS
    names = []
    for item in decoded.resources:
        message = cluster_pb2.Cluster()
        assert item.Unpack(message)
        names.append(message.name)
    assert names == ["a", "b"]


def test_responses_are_encoded_once_per_name_set() -> None:
    snap = build(clusters=[cluster("a")], endpoints=[assignment("a", 1), assignment("b", 2)])
    eds = snap.get(EDS)
    assert eds is not None
    one = eds.response(frozenset({"a", "missing"}))
    assert one is eds.response(frozenset({"a", "missing"}))
    assert one.names == frozenset({"a"})
    assert eds.response(None).names == frozenset({"a", "b"})


def test_request_names_span_finds_the_encoded_names_or_declines() -> None:
    from envoy.service.discovery.v3 import discovery_pb2

    from pilotfish.protocol.subscription import next_subscription
    from pilotfish.resources.wire import request_names_span

    eds = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"

    def span(**fields: object) -> bytes | None:
        request = discovery_pb2.DiscoveryRequest(type_url=eds, **fields)  # type: ignore[arg-type]
        data = request.SerializeToString()
        return request_names_span(data, request.type_url, request.response_nonce)

    ack = span(version_info="v1", resource_names=["a", "b"], response_nonce="7")
    assert ack is not None and discovery_pb2.DiscoveryRequest.FromString(ack).resource_names == ["a", "b"]
    # the same names under another version and nonce: the same span; other names: another one
    assert span(version_info="v2", resource_names=["a", "b"], response_nonce="12") == ack
    assert span(version_info="v1", resource_names=["a", "c"], response_nonce="7") != ack
    assert span(resource_names=[]) == b""
    # layouts it does not know: the caller decodes the names
    assert span(resource_names=["a"], node={"id": "n"}) is None
    assert span(resource_names=["a"], response_nonce="1", error_detail={"message": "no"}) is None
    # the shortcut gives the very set the decoded names give
    via_wire = next_subscription(["a", "b"], wildcard_capable=False, ever_named=True, wire=ack)
    assert via_wire is next_subscription(["a", "b"], wildcard_capable=False, ever_named=True)
