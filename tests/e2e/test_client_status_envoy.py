"""CSDS with two real Envoys: a grpcio client of envoy.service.status.v3 (the stubs of
xds-protos) reads each Envoy's types, versions and ACKED/NACKED states, and they match
``/v1/proxies``, a NACK with Envoy's message included; on the xDS port (``--csds-on-xds``) and on
the admin gRPC port (``--admin-grpc``, with the admin tokens: refused without one).

The snapshot story is test_admin_status.py's: version "2" is good, "3" has ``connect_timeout:
0s``, which Envoy rejects and, with ``--validate off``, reaches the Envoys.
"""

from __future__ import annotations

import json
import urllib.request
from typing import Any

import grpc
import pytest
import yaml
from envoy.admin.v3 import config_dump_shared_pb2
from envoy.service.status.v3 import csds_pb2, csds_pb2_grpc

from pilotfish.api.tokens import hash_token
from pilotfish.envoy import free_port

from .event_log import CDS, is_event
from .processes import pilotfish
from .testbed import Testbed, wait_for_acks

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

NODES = ("edge-1", "edge-2")
V2: dict[str, Any] = {"version": "2", "web": ["web-a"], "direct_body": "direct v2"}
V3: dict[str, Any] = V2 | {"version": "3", "connect_timeout": "0s", "stat_prefix": "ingress_v3"}
READER = "csds-reader-token-0123456789abcdef"
Status = config_dump_shared_pb2.ClientResourceStatus


def _csds(address: str, metadata: tuple[tuple[str, str], ...] = ()) -> csds_pb2.ClientStatusResponse:
    with grpc.insecure_channel(address) as channel:
        stub = csds_pb2_grpc.ClientStatusDiscoveryServiceStub(channel)
        response: csds_pb2.ClientStatusResponse = stub.FetchClientStatus(
            csds_pb2.ClientStatusRequest(), metadata=metadata, timeout=10
        )
        return response


def _matches(response: csds_pb2.ClientStatusResponse, proxies: dict[str, Any], clusters: set[str]) -> None:
    """Every type of every Envoy reads in CSDS as ``/v1/proxies`` has it, a resource at a time:
    each resource of a type has the type's state and the version the Envoy runs; the clusters
    are the snapshot file's."""
    assert {config.node.id for config in response.config} == set(proxies)
    for config in response.config:
        proxy = proxies[config.node.id]
        assert config.node.cluster == proxy["cluster"] and config.node.user_agent_name == "envoy"
        by_type: dict[str, list[Any]] = {}
        for xds in config.generic_xds_configs:
            by_type.setdefault(xds.type_url, []).append(xds)
        assert len(by_type) == len(proxy["types"]), (by_type.keys(), proxy["types"].keys())
        for short, status in proxy["types"].items():
            (entries,) = [found for url, found in by_type.items() if url.endswith(_TYPE_NAMES[short])]
            assert all(xds.name for xds in entries), "a resource at a time"
            expected = {"SYNCED": Status.ACKED, "NACKED": Status.NACKED, "STALE": Status.UNKNOWN}[status["state"]]
            for xds in entries:
                assert xds.version_info == (status["acked_version"] or ""), (config.node.id, short, xds.name)
                assert xds.client_status == expected, (config.node.id, short, xds.name, status)
                if status["state"] == "NACKED":
                    assert xds.error_state.details == status["nack"]["message"]
                    assert xds.error_state.version_info == status["nack"]["version"]
        assert {xds.name for xds in by_type[CDS]} == clusters


_TYPE_NAMES = {
    "CDS": ".Cluster",
    "EDS": ".ClusterLoadAssignment",
    "LDS": ".Listener",
    "RDS": ".RouteConfiguration",
    "SDS": ".Secret",
}


def test_a_csds_client_reads_two_envoys_acks_and_nacks_as_v1_proxies_has_them(testbed: Testbed) -> None:
    tokens = testbed.control_plane.group.workdir / "admin-tokens.yaml"
    tokens.write_text(yaml.safe_dump({"tokens": {"reader": {"sha256": hash_token(READER), "read": True}}}))
    admin_grpc = f"127.0.0.1:{free_port()}"
    testbed.control_plane.options = (
        "--validate",
        "off",
        "--csds-on-xds",
        "--admin-grpc",
        admin_grpc,
        "--admin-tokens",
        str(tokens),
    )
    testbed.start(**V2)
    testbed.start_envoy(name="envoy-2", node_id="edge-2", cluster="edge-pool")
    events = testbed.events
    wait_for_acks(events, node="edge-2", what="the second Envoy's initial configuration")
    xds = testbed.control_plane.address
    reader = (("authorization", f"Bearer {READER}"),)

    # Both synced: every resource of every type ACKED at the version /v1/proxies has.
    clusters = {c["name"] for c in yaml.safe_load(testbed.snapshot_path.read_text())["clusters"]}
    proxies = _admin_proxies(testbed)
    _matches(_csds(xds), proxies, clusters)
    _matches(_csds(admin_grpc, reader), proxies, clusters)

    # A change Envoy rejects: NACKED, with Envoy's message, on both ports.
    mark = events.mark()
    testbed.write_snapshot(**V3)
    for node in NODES:
        events.wait_for(is_event("nack", node=node, type=CDS), what=f"{node}'s NACK of the clusters", after=mark)
    proxies = _admin_proxies(testbed)
    response = _csds(xds)
    # (The rejected response carried version 3's clusters: those are the ones listed now.)
    clusters = {c["name"] for c in yaml.safe_load(testbed.snapshot_path.read_text())["clusters"]}
    _matches(response, proxies, clusters)
    for config in response.config:
        for cds in [x for x in config.generic_xds_configs if x.type_url == CDS]:
            assert cds.client_status == Status.NACKED and cds.version_info == "2"
            assert cds.error_state.version_info == "3" and "ConnectTimeout" in cds.error_state.details
    _matches(_csds(admin_grpc, reader), proxies, clusters)

    # The admin gRPC port wants its token.
    for metadata, code in (
        ((), grpc.StatusCode.UNAUTHENTICATED),
        ((("authorization", "Bearer wrong"),), grpc.StatusCode.UNAUTHENTICATED),
    ):
        with pytest.raises(grpc.RpcError) as refused:
            _csds(admin_grpc, metadata)
        assert refused.value.code() is code

    # `pilotfish status --csds` reads the same.
    table = pilotfish("status", "--csds", admin_grpc, check=False, env={"PILOTFISH_ADMIN_TOKEN": READER})
    assert table.returncode == 1, table.stdout + table.stderr
    for node in NODES:
        assert f"{node} NACKED Cluster: " in table.stderr and "ConnectTimeout" in table.stderr


def _admin_proxies(testbed: Testbed) -> dict[str, Any]:
    """``/v1/proxies`` with the reader's token."""
    request = urllib.request.Request(f"http://{testbed.control_plane.admin}/v1/proxies")
    request.add_header("Authorization", f"Bearer {READER}")
    with urllib.request.urlopen(request, timeout=5) as response:
        body = json.loads(response.read())
    return {proxy["node"]: proxy for proxy in body["proxies"]}
