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
