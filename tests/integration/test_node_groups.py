"""Node groups, in-process: one service defined through the registry API is served to an Envoy
as a socket listener and to proxyless gRPC clients as an API listener of the same name."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import grpc
from envoy.config.listener.v3 import listener_pb2
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2
from inprocess import TIMEOUT, Running, serving

from pilotfish.app import ServeSettings
from pilotfish.app.settings import PolicySettings
from pilotfish.policy.groups import parse_node_group

LDS = "type.googleapis.com/envoy.config.listener.v3.Listener"


@contextlib.asynccontextmanager
async def ads(xds: str) -> AsyncIterator[Any]:
    async with grpc.aio.insecure_channel(xds) as channel:
        call = ads_pb2_grpc.AggregatedDiscoveryServiceStub(channel).StreamAggregatedResources()
        yield call
        await call.done_writing()


async def listeners(running: Running, node: dict[str, Any], names: list[str]) -> dict[str, listener_pb2.Listener]:
    """The listeners a client with ``node`` is sent (``names``: what it asks for; empty: all), once
    there are some (the registry's change is built after a debounce)."""
    found: dict[str, listener_pb2.Listener] = {}
    async with ads(running.xds) as call, asyncio.timeout(TIMEOUT):
        await call.write(discovery_pb2.DiscoveryRequest(type_url=LDS, resource_names=names, node=node))
        while not found:
            response = await call.read()
            for item in response.resources:
                listener = listener_pb2.Listener()
                item.Unpack(listener)
                found[listener.name] = listener
            await call.write(
                discovery_pb2.DiscoveryRequest(
                    type_url=LDS,
                    resource_names=names,
                    version_info=response.version_info,
                    response_nonce=response.nonce,
                )
            )
    return found


async def test_envoys_and_grpc_clients_get_their_own_listeners_of_a_registry_service(tmp_path: Path) -> None:
    settings = ServeSettings(policy=PolicySettings(node_groups=(parse_node_group("mesh:grpc=cluster:mesh-*"),)))
    async with serving(tmp_path, settings) as running, aiohttp.ClientSession() as http:
        put = await http.put(running.url("/v1/services/web"), json={"listen": "127.0.0.1:10000", "grpc": True})
        assert put.status == 200, await put.text()
        created = await http.post(
            running.url("/v1/services/web/instances"), json={"address": "127.0.0.1", "port": 9001}
        )
        assert created.status == 201
        shown = await (await http.get(running.url("/v1/services/web"))).json()
        assert shown["grpc"] == "web", shown

        # An Envoy asks for every listener: it gets the socket listener, and no API listener.
        envoy = await listeners(running, {"id": "edge-1", "user_agent_name": "envoy"}, [])
        assert list(envoy) == ["web"] and envoy["web"].address.socket_address.port_value == 10000
        # A gRPC client resolving xds:///web asks for "web": it gets the API listener (built-in
        # group, by its user agent), and so does a node the operator's rule puts in a grpc group.
        for node in ({"id": "client-1", "user_agent_name": "gRPC Python"}, {"id": "c-2", "cluster": "mesh-a"}):
            grpc_client = await listeners(running, node, ["web"])
            assert list(grpc_client) == ["web"], node
            assert grpc_client["web"].HasField("api_listener") and not grpc_client["web"].HasField("address")

        # A second service claiming the same gRPC name is refused, naming both.
        clash = await http.put(running.url("/v1/services/other"), json={"grpc": "web"})
        assert clash.status == 409, await clash.text()
        assert "xds:///web" in await clash.text()
