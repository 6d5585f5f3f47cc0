"""The registry HTTP API in-process: registrations reach xDS; bad requests change nothing."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest
from envoy.config.endpoint.v3 import endpoint_pb2
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2

from pilotfish.reconcile import DebounceSettings
from pilotfish.server import ServeSettings, serve

EDS = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"
TIMEOUT = 10.0


@dataclass
class Running:
    xds: str
    registry: str
    events: Path

    def url(self, path: str) -> str:
        return f"http://{self.registry}{path}"


@pytest.fixture
async def running(tmp_path: Path) -> AsyncIterator[Running]:
    log = tmp_path / "events.jsonl"
    settings = ServeSettings(xds="127.0.0.1:0", registry="127.0.0.1:0", event_log=log,
                             debounce=DebounceSettings(quiet=0.02, max_delay=0.2))
    started: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(serve(settings, started=started))
    port = await asyncio.wait_for(started, TIMEOUT)
    line = next(json.loads(x) for x in log.read_text().splitlines() if '"server_started"' in x)
    yield Running(f"127.0.0.1:{port}", line["registry"], log)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


class EdsWatcher:
    """An ADS stream subscribed to one service's endpoints, ACKing what it gets."""

    def __init__(self, call: Any, service: str) -> None:
        self.call, self.service = call, service

    async def next_ports(self) -> list[int]:
        response = await asyncio.wait_for(self.call.read(), TIMEOUT)
        await self.call.write(discovery_pb2.DiscoveryRequest(
            type_url=EDS, resource_names=[self.service], version_info=response.version_info,
            response_nonce=response.nonce))
        ports: list[int] = []
        for item in response.resources:
            assignment = endpoint_pb2.ClusterLoadAssignment()
            item.Unpack(assignment)
            ports += [lb.endpoint.address.socket_address.port_value
                      for group in assignment.endpoints for lb in group.lb_endpoints]
        return sorted(ports)

    async def until(self, expected: list[int]) -> list[list[int]]:
        """Read responses until the endpoints are ``expected``; return every set seen."""
        seen: list[list[int]] = []
        async with asyncio.timeout(TIMEOUT):
            while not seen or seen[-1] != expected:
                seen.append(await self.next_ports())
        return seen


@contextlib.asynccontextmanager
async def eds_watch(xds: str, service: str) -> AsyncIterator[EdsWatcher]:
    async with grpc.aio.insecure_channel(xds) as channel:
        call = ads_pb2_grpc.AggregatedDiscoveryServiceStub(channel).StreamAggregatedResources()
        await call.write(discovery_pb2.DiscoveryRequest(type_url=EDS, resource_names=[service], node={"id": "t"}))
        yield EdsWatcher(call, service)
        await call.done_writing()


async def test_registered_instances_reach_xds_and_leave_on_deregister(running: Running) -> None:
    async with aiohttp.ClientSession() as http:
        put = await http.put(running.url("/v1/services/web"), json={"listen": "127.0.0.1:10000"})
        assert put.status == 200, await put.text()
        for port in (9001, 9002):
            created = await http.post(running.url("/v1/services/web/instances"),
                                      json={"address": "127.0.0.1", "port": port, "weight": 2})
            assert created.status == 201
            assert (await created.json())["id"] == f"127.0.0.1:{port}"
        async with eds_watch(running.xds, "web") as eds:
            await eds.until([9001, 9002])
            gone = await http.delete(running.url("/v1/services/web/instances/127.0.0.1:9001"))
            assert gone.status == 204
            assert (await eds.until([9002])) == [[9002]]  # straight there, nothing between
        listing = await (await http.get(running.url("/v1/services"))).json()
        assert [i["port"] for i in listing["services"]["web"]["instances"]] == [9002]


@pytest.mark.parametrize(
    ("body", "field", "words"),
    [
        ({"address": "127.0.0.1"}, "port", "required"),
        ({"address": "127.0.0.1", "port": 70000}, "port", "65535"),
        ({"address": "127.0.0.1", "port": "80"}, "port", "whole number"),
        ({"address": "not-an-ip", "port": 80}, "address", "IP address"),
        ({"address": "127.0.0.1", "port": 80, "ttl": -1}, "ttl", "seconds"),
        ({"address": "127.0.0.1", "port": 80, "colour": "red"}, "", "colour"),
    ],
)
async def test_bad_registrations_name_the_field_and_lose_nothing(
    running: Running, body: dict[str, Any], field: str, words: str
) -> None:
    async with aiohttp.ClientSession() as http:
        ok = await http.post(running.url("/v1/services/web/instances"), json={"address": "127.0.0.1", "port": 9001})
        assert ok.status == 201
        bad = await http.post(running.url("/v1/services/web/instances"), json=body)
        assert bad.status == 400
        error = await bad.json()
        assert any(p["field"] == field and words in p["message"] for p in error["problems"]), error
        still = await (await http.get(running.url("/v1/services/web"))).json()
        assert [i["id"] for i in still["instances"]] == ["127.0.0.1:9001"]


async def test_malformed_json_and_unknown_ids(running: Running) -> None:
    async with aiohttp.ClientSession() as http:
        bad = await http.post(running.url("/v1/services/web/instances"), data=b"{not json",
                              headers={"Content-Type": "application/json"})
        assert bad.status == 400 and "not valid JSON" in (await bad.json())["error"]
        missing = await http.put(running.url("/v1/services/web/instances/127.0.0.1:1/heartbeat"))
        assert missing.status == 404 and "register it again" in (await missing.json())["error"]
        bad_service = await http.put(running.url("/v1/services/web"), json={"protocol": "udp"})
        assert bad_service.status == 400
        assert (await bad_service.json())["problems"][0]["field"] == "protocol"


async def test_an_instance_without_heartbeats_expires_after_its_ttl(running: Running) -> None:
    async with aiohttp.ClientSession() as http:
        await http.post(running.url("/v1/services/web/instances"), json={"address": "127.0.0.1", "port": 9001})
        await http.post(running.url("/v1/services/web/instances"),
                        json={"address": "127.0.0.1", "port": 9002, "ttl": 0.6})
        async with eds_watch(running.xds, "web") as eds:
            await eds.until([9001, 9002])
            # Heartbeats keep it for longer than its TTL...
            for _ in range(4):
                await asyncio.sleep(0.3)
                beat = await http.put(running.url("/v1/services/web/instances/127.0.0.1:9002/heartbeat"))
                assert beat.status == 200
            listing = await (await http.get(running.url("/v1/services/web"))).json()
            assert len(listing["instances"]) == 2
            # ...and without them it goes.
            assert (await eds.until([9001])) == [[9001]]
        expired = [json.loads(x) for x in running.events.read_text().splitlines() if "registry_expired" in x]
        assert [e["instance"] for e in expired] == ["127.0.0.1:9002"]
