"""Subsets over every protocol a client may speak: ``pilotfish serve`` in this process,
a ``services:`` file with ``subset_size``, and real clients: grpcio on SotW ADS and on delta ADS,
and REST polls over HTTP. Each gets its own subset, the same one by every protocol for one node id
(its index is by node id), and the admin API names it."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp
import grpc
from envoy.config.endpoint.v3 import endpoint_pb2
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2
from google.protobuf import json_format
from inprocess import TIMEOUT, Running
from inprocess import serving as serve_in_process

from pilotfish.app import ServeSettings
from pilotfish.app.settings import RestSettings, SubsetSettings
from pilotfish.build.desired import DesiredState, View, build_snapshots, merge_states
from pilotfish.cache import DEFAULT_GROUP, SnapshotCache
from pilotfish.resources import ENDPOINT
from pilotfish.resources.anytypes import ensure_types_in
from pilotfish.resources.services import Endpoint, ServiceSpec
from pilotfish.xds.server import XdsServer, start_xds_server

PORTS = range(9000, 9012)
K = 3


def addresses(assignment: endpoint_pb2.ClusterLoadAssignment) -> set[str]:
    return {
        f"{e.endpoint.address.socket_address.address}:{e.endpoint.address.socket_address.port_value}"
        for group in assignment.endpoints
        for e in group.lb_endpoints
    }


async def sotw(running: Running, node: str) -> set[str]:
    async with grpc.aio.insecure_channel(running.xds) as channel, asyncio.timeout(TIMEOUT):
        call = ads_pb2_grpc.AggregatedDiscoveryServiceStub(channel).StreamAggregatedResources()
        await call.write(
            discovery_pb2.DiscoveryRequest(type_url=ENDPOINT.url, node={"id": node}, resource_names=["web"])
        )
        response = await call.read()
        call.cancel()
    assignment = endpoint_pb2.ClusterLoadAssignment()
    response.resources[0].Unpack(assignment)
    return addresses(assignment)


async def delta(running: Running, node: str) -> set[str]:
    async with grpc.aio.insecure_channel(running.xds) as channel, asyncio.timeout(TIMEOUT):
        call = ads_pb2_grpc.AggregatedDiscoveryServiceStub(channel).DeltaAggregatedResources()
        await call.write(
            discovery_pb2.DeltaDiscoveryRequest(
                type_url=ENDPOINT.url, node={"id": node}, resource_names_subscribe=["web"]
            )
        )
        response = await call.read()
        call.cancel()
    assignment = endpoint_pb2.ClusterLoadAssignment()
    response.resources[0].resource.Unpack(assignment)
    return addresses(assignment)


async def rest(running: Running, node: str) -> set[str]:
    body = {"version_info": "", "node": {"id": node}, "resource_names": ["web"]}
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=TIMEOUT)) as session,
        session.post(f"http://{running.rest}/v3/discovery:endpoints", json=body) as answer,
    ):
        assert answer.status == 200, await answer.text()
        message: dict[str, Any] = json.loads(await answer.read())
    ensure_types_in(message)
    response = json_format.ParseDict(message, discovery_pb2.DiscoveryResponse())
    assignment = endpoint_pb2.ClusterLoadAssignment()
    response.resources[0].Unpack(assignment)
    return addresses(assignment)


async def test_every_protocol_serves_a_node_its_own_subset(tmp_path: Path) -> None:
    snapshot = tmp_path / "services.yaml"
    snapshot.write_text(
        json.dumps({"services": {"web": {"subset_size": K, "endpoints": [f"127.0.0.1:{p}" for p in PORTS]}}})
    )
    settings = ServeSettings(
        snapshot=snapshot, rest=RestSettings(address="127.0.0.1:0"), subsets=SubsetSettings(state_dir=tmp_path)
    )
    async with serve_in_process(tmp_path, replace(settings)) as running:
        nodes = [f"edge-{n}" for n in range(4)]
        got = {node: await sotw(running, node) for node in nodes}
        assert all(len(chosen) == K for chosen in got.values())
        assert len({frozenset(chosen) for chosen in got.values()}) == len(nodes), "each its own subset"
        for node in nodes:  # one node id, one index: the same subset whatever the protocol
            assert await delta(running, node) == got[node]
            assert await rest(running, node) == got[node]
        async with (
            aiohttp.ClientSession() as session,
            session.get(f"http://{running.admin}/v1/config?node=edge-2") as answer,
        ):
            config = await answer.json()
        assert set(config["subsets"]["services"]["web"]) == got["edge-2"]
    saved = json.loads((tmp_path / "pilotfish-subsets.json").read_text())
    assert sorted(saved["proxies"]["indices"]) == nodes and len(saved["backends"]["web"]["indices"]) == len(PORTS)


async def test_a_proxy_whose_index_moves_is_sent_its_new_subset_on_the_same_stream(tmp_path: Path) -> None:
    """On etcd, the loser of an index race takes another index; its open streams, SotW and delta,
    are sent the subset of the new one without reconnecting (XdsServer.refresh_endpoints)."""
    merged = merge_states(
        {
            "file": DesiredState(
                services={"web": ServiceSpec(name="web", subset_size=K)},
                endpoints={"web": tuple(Endpoint("127.0.0.1", port) for port in PORTS)},
            )
        }
    )
    snapshot = build_snapshots(merged, "test", {DEFAULT_GROUP: View()})[DEFAULT_GROUP]
    index = {"edge-1": 0}
    cache = SnapshotCache(subset_of=index.get)
    cache.set_snapshot(snapshot)
    xds = XdsServer(cache)
    server, port = await start_xds_server(xds, "127.0.0.1:0")
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel, asyncio.timeout(TIMEOUT):
            stub = ads_pb2_grpc.AggregatedDiscoveryServiceStub(channel)
            sotw_call = stub.StreamAggregatedResources()
            await sotw_call.write(
                discovery_pb2.DiscoveryRequest(type_url=ENDPOINT.url, node={"id": "edge-1"}, resource_names=["web"])
            )
            first = await sotw_call.read()
            await sotw_call.write(
                discovery_pb2.DiscoveryRequest(
                    type_url=ENDPOINT.url,
                    resource_names=["web"],
                    version_info=first.version_info,
                    response_nonce=first.nonce,
                )
            )  # the ACK
            delta_call = stub.DeltaAggregatedResources()
            await delta_call.write(
                discovery_pb2.DeltaDiscoveryRequest(
                    type_url=ENDPOINT.url, node={"id": "edge-1"}, resource_names_subscribe=["web"]
                )
            )
            delta_first = await delta_call.read()

            index["edge-1"] = 5  # moved
            xds.refresh_endpoints("edge-1")
            second = await sotw_call.read()
            delta_second = await delta_call.read()

        def endpoints(response: Any) -> set[str]:
            assignment = endpoint_pb2.ClusterLoadAssignment()
            (
                response.resources[0].resource if hasattr(response.resources[0], "resource") else response.resources[0]
            ).Unpack(assignment)
            return addresses(assignment)

        own = {i: addresses(snapshot.endpoints_for(i).resources["web"].message) for i in (0, 5)}  # type: ignore[union-attr]
        assert own[0] != own[5]
        assert endpoints(first) == endpoints(delta_first) == own[0]
        assert endpoints(second) == endpoints(delta_second) == own[5]
        assert second.version_info != first.version_info
    finally:
        await server.stop(0)
