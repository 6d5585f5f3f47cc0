"""pilotfish's own HTTP/2 gRPC transport, spoken to by grpc core clients and by raw sockets.

What users rely on: any standard gRPC client gets whole messages however large (flow control and
frame splitting hold), mistakes are answered with a gRPC status that names them, a client that
goes away frees its stream, and a stopping server tells its clients to come back (UNAVAILABLE).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import grpc
import pytest
from envoy.config.cluster.v3 import cluster_pb2
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2

from pilotfish.cache import SnapshotCache
from pilotfish.sources import load_snapshot
from pilotfish.transport import frames as h2
from pilotfish.transport.aio import GrpcServer
from pilotfish.xds import XdsServer, start_xds_server

CDS = "type.googleapis.com/envoy.config.cluster.v3.Cluster"
TIMEOUT = 10.0
ADS_PATH = "/envoy.service.discovery.v3.AggregatedDiscoveryService/StreamAggregatedResources"


def write_snapshot(path: Path, clusters: int) -> None:
    """``clusters`` STATIC clusters with long names: about 200 bytes each once encoded."""
    doc = {
        "clusters": [
            {
                "name": f"cluster-{i:06d}-" + "x" * 120,
                "type": "STATIC",
                "connect_timeout": "1s",
                "load_assignment": {
                    "cluster_name": f"c{i}",
                    "endpoints": [
                        {
                            "lb_endpoints": [
                                {
                                    "endpoint": {
                                        "address": {
                                            "socket_address": {"address": "127.0.0.1", "port_value": 1000 + i % 5000}
                                        }
                                    }
                                }
                            ]
                        }
                    ],
                },
            }
            for i in range(clusters)
        ]
    }
    path.write_text(json.dumps(doc))


class Running:
    def __init__(self, cache: SnapshotCache, xds: XdsServer, server: GrpcServer, port: int) -> None:
        self.cache, self.xds, self.server, self.port = cache, xds, server, port
        self.address = f"127.0.0.1:{port}"


@pytest.fixture
async def running(tmp_path: Path) -> AsyncIterator[Running]:
    snapshot_file = tmp_path / "snap.json"
    write_snapshot(snapshot_file, 2000)
    cache = SnapshotCache()
    cache.set_snapshot(load_snapshot(snapshot_file))
    xds = XdsServer(cache)
    server, port = await start_xds_server(xds, "127.0.0.1:0")
    yield Running(cache, xds, server, port)
    await server.stop(0.5)


def cds_request(node: str = "n1", **fields: object) -> discovery_pb2.DiscoveryRequest:
    request = discovery_pb2.DiscoveryRequest(type_url=CDS, **fields)
    request.node.id = node
    return request


async def wait_until(predicate: Callable[[], bool]) -> None:
    async with asyncio.timeout(TIMEOUT):
        while not predicate():
            await asyncio.sleep(0.01)


async def test_a_response_larger_than_windows_and_frames_arrives_whole(running: Running) -> None:
    # 2,000 clusters: ~400 KB, over grpc core's initial 64 KB stream window and 16 KB frames.
    async with grpc.aio.insecure_channel(running.address) as channel:
        call = ads_pb2_grpc.AggregatedDiscoveryServiceStub(channel).StreamAggregatedResources()
        await call.write(cds_request())
        response = await asyncio.wait_for(call.read(), TIMEOUT)
        assert response.ByteSize() > 300_000
        names = [cluster_pb2.Cluster.FromString(r.value).name for r in response.resources]
        assert len(names) == 2000 and names[0].startswith("cluster-000000-")
        # ...and the stream goes on: the ACK is taken, a later request answered.
        await call.write(
            discovery_pb2.DiscoveryRequest(
                type_url=CDS, version_info=response.version_info, response_nonce=response.nonce
            )
        )
        await call.done_writing()
        assert await asyncio.wait_for(call.read(), TIMEOUT) == grpc.aio.EOF
        assert await call.code() == grpc.StatusCode.OK


async def test_many_streams_share_one_connection(running: Running) -> None:
    async with grpc.aio.insecure_channel(running.address) as channel:
        stub = ads_pb2_grpc.AggregatedDiscoveryServiceStub(channel)
        calls = [stub.StreamAggregatedResources() for _ in range(20)]
        for n, call in enumerate(calls):
            await call.write(cds_request(f"node-{n}"))
        responses = [await asyncio.wait_for(call.read(), TIMEOUT) for call in calls]
        assert {len(r.resources) for r in responses} == {2000}
        assert running.xds.open_streams == 20
        for call in calls:
            call.cancel()
        await wait_until(lambda: running.xds.open_streams == 0)


async def test_unknown_method_is_unimplemented_and_names_it(running: Running) -> None:
    async with grpc.aio.insecure_channel(running.address) as channel:
        method = channel.unary_unary("/no.such.Service/Method")
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await asyncio.wait_for(method(b""), TIMEOUT)
        assert caught.value.code() == grpc.StatusCode.UNIMPLEMENTED
        assert "/no.such.Service/Method" in (caught.value.details() or "")


async def test_compressed_messages_are_refused_with_a_reason(running: Running) -> None:
    async with grpc.aio.insecure_channel(running.address, compression=grpc.Compression.Gzip) as channel:
        call = ads_pb2_grpc.AggregatedDiscoveryServiceStub(channel).StreamAggregatedResources()
        request = cds_request()
        request.node.user_agent_name = "a" * 10_000  # grpc core leaves messages it cannot shrink alone
        with contextlib.suppress(grpc.aio.AioRpcError):  # the answer may come before the write is done
            await call.write(request)
        assert await asyncio.wait_for(call.code(), TIMEOUT) == grpc.StatusCode.UNIMPLEMENTED
        assert "uncompressed" in (await call.details() or "")
    # the transport ended the call: the xDS stream behind it is closed too, its watches gone
    await wait_until(lambda: running.xds.open_streams == 0)


async def test_a_cancelled_client_frees_its_stream_and_watches(running: Running) -> None:
    async with grpc.aio.insecure_channel(running.address) as channel:
        call = ads_pb2_grpc.AggregatedDiscoveryServiceStub(channel).StreamAggregatedResources()
        await call.write(cds_request())
        response = await asyncio.wait_for(call.read(), TIMEOUT)
        await call.write(
            discovery_pb2.DiscoveryRequest(
                type_url=CDS, version_info=response.version_info, response_nonce=response.nonce
            )
        )
        await wait_until(lambda: running.cache.watch_count() == 1)
        call.cancel()
        await wait_until(lambda: running.xds.open_streams == 0)
        assert running.cache.watch_count() == 0


async def test_stopping_the_server_ends_streams_unavailable(running: Running) -> None:
    async with grpc.aio.insecure_channel(running.address) as channel:
        call = ads_pb2_grpc.AggregatedDiscoveryServiceStub(channel).StreamAggregatedResources()
        await call.write(cds_request())
        await asyncio.wait_for(call.read(), TIMEOUT)
        await running.server.stop(1.0)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await asyncio.wait_for(call.read(), TIMEOUT)
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
        assert running.xds.open_streams == 0


def _frames(data: bytes) -> list[tuple[int, int, int, bytes]]:
    frames, offset = [], 0
    while len(data) - offset >= 9:
        length, kind, flags, stream = h2.parse_frame_header(data, offset)
        if len(data) - offset - 9 < length:
            break
        frames.append((kind, flags, stream, data[offset + 9 : offset + 9 + length]))
        offset += 9 + length
    return frames


async def _raw_exchange(port: int, send: bytes, until: int) -> list[tuple[int, int, int, bytes]]:
    """Send ``send`` and read frames until one of type ``until`` arrives (or the peer closes)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(send)
        data = b""
        async with asyncio.timeout(TIMEOUT):
            while not any(f[0] == until for f in _frames(data)):
                chunk = await reader.read(65536)
                if not chunk:
                    break
                data += chunk
        return _frames(data)
    finally:
        writer.close()


async def test_pings_are_answered_and_settings_acknowledged(running: Running) -> None:
    hello = h2.CONNECTION_PREFACE + h2.settings({}) + h2.frame(h2.PING, 0, 0, b"12345678")
    frames = await _raw_exchange(running.port, hello, h2.PING)
    kinds = [(kind, flags) for kind, flags, _, _ in frames]
    assert (h2.SETTINGS, 0) in kinds and (h2.SETTINGS, h2.ACK) in kinds
    assert (h2.PING, h2.ACK, 0, b"12345678") in frames


async def test_a_client_that_does_not_speak_http2_gets_goaway(running: Running) -> None:
    frames = await _raw_exchange(running.port, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", h2.GOAWAY)
    goaway = [payload for kind, _, _, payload in frames if kind == h2.GOAWAY]
    assert goaway and h2.unpack_u32(goaway[0], 4) == h2.ErrorCode.PROTOCOL_ERROR
    assert b"preface" in goaway[0][8:]


async def test_a_refused_port_is_reported(tmp_path: Path) -> None:
    taken = socket.create_server(("127.0.0.1", 0))
    try:
        with pytest.raises(OSError):
            await start_xds_server(XdsServer(SnapshotCache()), f"127.0.0.1:{taken.getsockname()[1]}")
    finally:
        taken.close()
