"""xDS request limits over real gRPC: a grpcio client sends what no proxy should (too many names,
a huge node id, a huge type_url, too much node metadata); its stream ends with the right status
and a short message, nothing huge reaches the event log, and the server goes on serving others."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2

from pilotfish.app import ServeSettings, serve
from pilotfish.app.settings import EventSettings, XdsSettings
from pilotfish.events import read_events

CDS = "type.googleapis.com/envoy.config.cluster.v3.Cluster"
EDS = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"
TIMEOUT = 20.0
SHORT = 1200
"""A status message is at most about this long, whatever the request carried."""


def snapshot_document() -> dict[str, Any]:
    return {
        "version": "1",
        "clusters": [
            {
                "name": "web",
                "type": "EDS",
                "connect_timeout": "1s",
                "eds_cluster_config": {"eds_config": {"ads": {}, "resource_api_version": "V3"}},
            }
        ],
        "endpoints": [
            {
                "cluster_name": "web",
                "endpoints": [
                    {
                        "lb_endpoints": [
                            {"endpoint": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": 9001}}}}
                        ]
                    }
                ],
            }
        ],
    }


class Served:
    def __init__(self, address: str, log: Path) -> None:
        self.address = address
        self.log = log

    def events(self) -> list[dict[str, Any]]:
        return read_events(self.log)[0]

    async def wait_for_closed(self, count: int) -> list[dict[str, Any]]:
        async with asyncio.timeout(TIMEOUT):
            while True:
                closed = [e for e in self.events() if e["event"] == "stream_closed"]
                if len(closed) >= count:
                    return closed
                await asyncio.sleep(0.02)


@pytest.fixture
async def served(tmp_path: Path) -> AsyncIterator[Served]:
    snapshot = tmp_path / "snap.yaml"
    snapshot.write_text(yaml.safe_dump(snapshot_document()))
    log = tmp_path / "events.jsonl"
    started: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(
        serve(
            ServeSettings(snapshot=snapshot, xds=XdsSettings(address="127.0.0.1:0"), events=EventSettings(log=log)),
            started=started,
        )
    )
    port = await asyncio.wait_for(started, TIMEOUT)
    yield Served(f"127.0.0.1:{port}", log)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def refused(channel: grpc.aio.Channel, request: discovery_pb2.DiscoveryRequest) -> grpc.aio.AioRpcError:
    """Send ``request`` on a new ADS stream; return how the server ended it."""
    call = ads_pb2_grpc.AggregatedDiscoveryServiceStub(channel).StreamAggregatedResources()
    await call.write(request)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await asyncio.wait_for(call.read(), TIMEOUT)
    return caught.value


async def test_requests_over_the_limits_end_their_stream_and_others_are_served(
    served: Served, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="pilotfish")
    options = [("grpc.max_send_message_length", 64 * 1024 * 1024)]
    async with grpc.aio.insecure_channel(served.address, options=options) as channel:
        # A well-behaved proxy, connected before and served after.
        good = ads_pb2_grpc.AggregatedDiscoveryServiceStub(channel).StreamAggregatedResources()
        await good.write(discovery_pb2.DiscoveryRequest(type_url=CDS, node={"id": "edge-1"}))
        clusters = await asyncio.wait_for(good.read(), TIMEOUT)
        assert clusters.version_info == "1"

        too_many = discovery_pb2.DiscoveryRequest(
            type_url=EDS, resource_names=[f"c{i}" for i in range(100_001)], node={"id": "greedy"}
        )
        error = await refused(channel, too_many)
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        details = error.details() or ""
        assert "100,001" in details and "max_resource_names" in details and len(details) < SHORT

        huge_node = discovery_pb2.DiscoveryRequest(type_url=CDS, node={"id": "n" * (64 * 1024)})
        error = await refused(channel, huge_node)
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        details = error.details() or ""
        assert "max_node_id_chars" in details and "65,536 characters" in details and len(details) < SHORT

        # 3 MB: under any gRPC message limit, so it is the xDS layer that answers.
        huge_type = discovery_pb2.DiscoveryRequest(
            type_url="type.googleapis.com/" + "x" * 3_000_000, node={"id": "odd"}
        )
        error = await refused(channel, huge_type)
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        details = error.details() or ""
        assert "unsupported type_url" in details and "3,000,020 characters" in details and len(details) < SHORT

        fat = discovery_pb2.DiscoveryRequest(type_url=CDS, node={"id": "fat"})
        fat.node.metadata.update({"blob": "m" * 100_000})
        error = await refused(channel, fat)
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "max_node_bytes" in (error.details() or "")

        # The well-behaved stream is still served: it subscribes to endpoints and gets them.
        await good.write(discovery_pb2.DiscoveryRequest(type_url=CDS, version_info="1", response_nonce=clusters.nonce))
        await good.write(discovery_pb2.DiscoveryRequest(type_url=EDS, resource_names=["web"]))
        endpoints = await asyncio.wait_for(good.read(), TIMEOUT)
        assert endpoints.type_url == EDS and len(endpoints.resources) == 1
        # And a new stream is too.
        fresh = ads_pb2_grpc.AggregatedDiscoveryServiceStub(channel).StreamAggregatedResources()
        await fresh.write(discovery_pb2.DiscoveryRequest(type_url=CDS, node={"id": "edge-2"}))
        assert (await asyncio.wait_for(fresh.read(), TIMEOUT)).version_info == "1"
        await fresh.done_writing()
        await good.done_writing()

    closed = await served.wait_for_closed(4)
    reasons = [e["reason"] for e in closed[:4]]
    assert sum("over a limit" in r for r in reasons) == 2 and sum("protocol error" in r for r in reasons) == 2
    # Nothing a peer sent reaches the event log whole.
    assert max(len(line) for line in served.log.read_bytes().splitlines()) < 20_000
    warnings = [r for r in caplog.records if r.name == "pilotfish.server" and "ended" in r.getMessage()]
    assert 1 <= len(warnings) <= 4  # rate limited: one per 10 s (more only on a very slow run)
    assert all(len(r.getMessage()) < 2 * SHORT for r in warnings)
    # No traceback from pilotfish. (grpcio's aio poller, shared by the process, may log one for the
    # event loop of an earlier test that has closed: the client library's, not the server's.)
    assert not [r for r in caplog.records if r.exc_info and r.name.startswith("pilotfish")], caplog.text


async def test_a_peer_repeating_a_huge_nack_is_recorded_shortened_and_warned_about_once(
    served: Served, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="pilotfish")
    reason = "Proto constraint validation failed (ClusterValidationError.ConnectTimeout: value must be greater than 0s)"
    options = [("grpc.max_send_message_length", 64 * 1024 * 1024)]
    async with grpc.aio.insecure_channel(served.address, options=options) as channel:
        call = ads_pb2_grpc.AggregatedDiscoveryServiceStub(channel).StreamAggregatedResources()
        await call.write(discovery_pb2.DiscoveryRequest(type_url=CDS, node={"id": "nacker"}))
        clusters = await asyncio.wait_for(call.read(), TIMEOUT)
        nack = discovery_pb2.DiscoveryRequest(type_url=CDS, response_nonce=clusters.nonce)
        nack.error_detail.message = "dump " * 400_000 + reason  # 2 MB, the reason at the end
        for _ in range(20):
            await call.write(nack)
        async with asyncio.timeout(TIMEOUT):
            while len([e for e in served.events() if e["event"] == "nack"]) < 20:
                await asyncio.sleep(0.02)
        # Still served: a request for endpoints is answered.
        await call.write(discovery_pb2.DiscoveryRequest(type_url=EDS, resource_names=["web"]))
        assert (await asyncio.wait_for(call.read(), TIMEOUT)).type_url == EDS
        await call.done_writing()
    nacks = [e for e in served.events() if e["event"] == "nack"]
    assert all(e["error"].endswith(reason) and len(e["error"]) < 5000 for e in nacks)
    warned = [r.getMessage() for r in caplog.records if "rejected" in r.getMessage()]
    assert len(warned) == 1 and warned[0].endswith(reason) and len(warned[0]) < 5000
