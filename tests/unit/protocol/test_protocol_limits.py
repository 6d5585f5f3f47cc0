"""What one xDS request may carry (XdsLimits), and what a stream keeps of what a peer sends."""

from __future__ import annotations

import pytest
from conftest import CDS, EDS, StreamPair, assignment, build, cluster
from envoy.service.discovery.v3 import discovery_pb2

from pilotfish.cache import SnapshotCache
from pilotfish.errors import PeerError
from pilotfish.protocol import PeerOverLimit, SotwStream, XdsLimits

SHORT = 600
"""An error message repeating a peer's value is at most about this long."""


def request(type_url: str = EDS, names: list[str] | None = None, **fields: object) -> discovery_pb2.DiscoveryRequest:
    return discovery_pb2.DiscoveryRequest(type_url=type_url, resource_names=names or [], **fields)


def test_a_request_naming_more_resources_than_the_limit_is_refused_and_names_the_limit() -> None:
    limits = XdsLimits(max_resource_names=1000)
    names = [f"c{i}" for i in range(1000)]
    outcome = SotwStream(limits=limits).on_request(request(names=names))
    assert outcome.watches[0].subscription.names == frozenset(names)  # at the limit: served
    with pytest.raises(PeerOverLimit) as caught:
        SotwStream(limits=limits).on_request(request(names=[*names, "one-more"]))
    message = str(caught.value)
    assert "1,001" in message and "1,000" in message and "XdsLimits.max_resource_names" in message
    assert len(message) < SHORT


def test_the_default_limit_is_100000_names() -> None:
    with pytest.raises(PeerOverLimit):
        SotwStream().on_request(request(names=[str(i) for i in range(100_001)]))


def test_a_node_id_longer_than_the_limit_is_invalid_and_not_echoed() -> None:
    huge = request(names=["a"])
    huge.node.id = "n" * (64 * 1024)
    with pytest.raises(PeerError) as caught:
        SotwStream().on_request(huge)
    assert not isinstance(caught.value, PeerOverLimit)  # INVALID_ARGUMENT, not RESOURCE_EXHAUSTED
    message = str(caught.value)
    assert "XdsLimits.max_node_id_chars" in message and "65,536 characters" in message
    assert len(message) < SHORT
    fine = request(names=["a"])
    fine.node.id = "n" * 1024
    stream = SotwStream()
    stream.on_request(fine)
    assert stream.node is not None and stream.node.id == fine.node.id


def test_node_metadata_over_the_limit_is_refused_and_extensions_are_not_kept() -> None:
    big = request(names=["a"])
    big.node.id = "edge-1"
    big.node.metadata.update({"blob": "m" * 40_000})
    with pytest.raises(PeerOverLimit) as caught:
        SotwStream().on_request(big)
    assert "XdsLimits.max_node_bytes" in str(caught.value) and len(str(caught.value)) < SHORT
    envoy_like = request(names=["a"])
    envoy_like.node.id = "edge-1"
    envoy_like.node.metadata.update({"zone": "a"})
    for i in range(2000):  # Envoy lists every extension it was built with: tens of KB, dropped
        envoy_like.node.extensions.add(name=f"envoy.filters.http.extension_{i}", category="envoy.filters.http")
    assert envoy_like.node.ByteSize() > 32 * 1024
    stream = SotwStream()
    stream.on_request(envoy_like)
    assert stream.node is not None and stream.node.ByteSize() < 100


def test_a_huge_type_url_is_refused_with_a_short_message() -> None:
    for stream in (SotwStream(), SotwStream(type_url=CDS)):
        with pytest.raises(PeerError) as caught:
            stream.on_request(request(type_url="type.googleapis.com/" + "x" * 17_000_000))
        message = str(caught.value)
        assert len(message) < SHORT and "17,000,020 characters" in message


def test_long_versions_nonces_and_nack_messages_are_kept_shortened(pair: StreamPair) -> None:
    pair.publish(build(clusters=[cluster("a")], endpoints=[assignment("a", 1)]))
    [sent] = pair.send(EDS, ["a"], node_id="edge-1")
    reason = "Proto constraint validation failed (ClusterLoadAssignmentValidationError.ClusterName)"
    pair.send(EDS, ["a"], version="v" * 1_000_000, nonce=sent.nonce, error="dump " * 100_000 + reason)
    nack = pair.outcomes[-1]
    assert nack.error is not None and len(nack.error) < 4200 and nack.error.endswith(reason[-1000:])
    assert len(nack.version_info) < 1100
    pair.send(EDS, ["a"], version=sent.version, nonce="9" * 1_000_000)
    stale = pair.outcomes[-1]
    assert len(stale.response_nonce) < 300
    # an ACK with a made-up long version: kept shortened
    pair.send(EDS, ["a"], version="w" * 1_000_000, nonce=sent.nonce)
    assert len(pair.stream.types[EDS].acked_version or "") < 1100


def test_a_long_stated_version_is_only_sent_the_current_one_again() -> None:
    snapshot = build(clusters=[cluster("a")], endpoints=[assignment("a", 1)])
    pair = StreamPair(SnapshotCache())
    pair.publish(snapshot)
    [got] = pair.send(EDS, ["a"], version="x" * 5000)
    assert got.version == snapshot.version(EDS) and got.names == ["a"]
