"""One resource, encoded once (pilotfish.resources.encoded): its Any and delta encodings decode as
protobuf's own, its version is the start of its content hash (the same on every replica and after
every restart), and its message is decoded from its bytes only when asked for."""

from __future__ import annotations

import hashlib

from envoy.config.cluster.v3 import cluster_pb2
from envoy.service.discovery.v3 import discovery_pb2
from google.protobuf import any_pb2, duration_pb2

from pilotfish.resources import CLUSTER
from pilotfish.resources.encoded import Resource


def web(seconds: int = 1) -> cluster_pb2.Cluster:
    return cluster_pb2.Cluster(
        name="web", type=cluster_pb2.Cluster.EDS, connect_timeout=duration_pb2.Duration(seconds=seconds)
    )


def test_the_encodings_are_protobufs_own_and_the_version_follows_the_content() -> None:
    resource = Resource.of(CLUSTER, web())
    value = web().SerializeToString(deterministic=True)
    assert resource.name == "web" and resource.value == value
    assert resource.hash == hashlib.sha256(value).hexdigest() and resource.version == resource.hash[:16]
    packed = any_pb2.Any.FromString(resource.encoded)
    assert packed.type_url == CLUSTER.url and packed.value == value
    delta = discovery_pb2.Resource.FromString(resource.delta_encoded())
    assert (delta.name, delta.version, delta.resource) == ("web", resource.version, packed)
    assert resource.delta_encoded() is resource.delta_encoded()  # made once
    assert Resource.of(CLUSTER, web()).version == resource.version
    assert Resource.of(CLUSTER, web(seconds=2)).version != resource.version


def test_bytes_a_builder_encoded_are_decoded_only_when_the_message_is_asked_for() -> None:
    value = web().SerializeToString(deterministic=True)
    resource = Resource(CLUSTER, "web", value)
    assert resource.version == Resource.of(CLUSTER, web()).version
    message = resource.message
    assert message == web() and resource.message is message
