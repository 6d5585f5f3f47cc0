"""Envoy resources built from services (pilotfish.resources.builders): the hand encoding equals
protobuf's, durations are built in range."""

from __future__ import annotations

import pytest
from envoy.config.cluster.v3 import cluster_pb2

from pilotfish.build.desired import DesiredState, build_snapshot, merge_states
from pilotfish.resources import CLUSTER
from pilotfish.resources.services import Endpoint, ServiceSpec


def test_hand_encoded_resources_match_protobuf_encoding() -> None:
    from pilotfish.resources.builders import build_assignment, build_cluster, encode_assignment, encode_cluster
    from pilotfish.resources.services import HealthCheck

    endpoints = (
        Endpoint("10.1.2.3", 65535, 128),
        Endpoint("127.0.0.1", 9001),
        Endpoint("::1", 80, 3),
        Endpoint("h" * 119, 1, 1),
        Endpoint("h" * 120, 1, 1),
        Endpoint("host-" * 30, 8080, 70_000),
    )
    assert encode_assignment("web" * 50, endpoints) == build_assignment("web" * 50, endpoints).SerializeToString(
        deterministic=True
    )
    with_metadata = (Endpoint("127.0.0.1", 1, 1, (("zone", "a"),)),)
    assert encode_assignment("w", with_metadata) == build_assignment("w", with_metadata).SerializeToString(
        deterministic=True
    )
    for spec in (WEB, ServiceSpec(name="h2", upstream_protocol="http2", health_check=HealthCheck(path="/ok"))):
        assert encode_cluster(spec) == build_cluster(spec).SerializeToString(deterministic=True)


@pytest.mark.parametrize(
    ("seconds", "expected"), [(0.9999999999, (1, 0)), (1.5, (1, 500_000_000)), (0.25, (0, 250_000_000))]
)
def test_durations_are_built_in_range(seconds: float, expected: tuple[int, int]) -> None:
    spec = ServiceSpec(name="web", connect_timeout=seconds)
    snapshot = build_snapshot(merge_states({"file": DesiredState(services={"web": spec})}), "test")
    cluster = snapshot.get(CLUSTER.url).resources["web"].message  # type: ignore[union-attr]
    assert isinstance(cluster, cluster_pb2.Cluster)
    assert (cluster.connect_timeout.seconds, cluster.connect_timeout.nanos) == expected


WEB = ServiceSpec(name="web", listen=("127.0.0.1", 10000))
