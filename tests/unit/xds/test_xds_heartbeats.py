"""Resource TTLs through the gRPC server: real grpcio clients, the real cache, a fake clock for the
heartbeats (the test runs them when it has moved the clock: nothing waits for wall time).

A client that announces ``xds.config.supports-resource-ttl`` (and over SotW
``xds.config.resource-in-sotw``) gets a runtime layer with its TTL and is refreshed a third of
the TTL before it runs out (a 3 s TTL: after 2 s) while its latest response is ACKed: over SotW
the layer again at the same version, over delta a heartbeat without the resource. A client that
announces nothing gets the layer without a TTL and no refresh."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2
from envoy.service.runtime.v3 import rtds_pb2
from google.protobuf import struct_pb2

from pilotfish.cache import SnapshotCache
from pilotfish.events import EventLog
from pilotfish.resources import RUNTIME
from pilotfish.resources.types import RESOURCE_IN_SOTW, SUPPORTS_TTL
from pilotfish.resources.wire import RESOURCE_URL
from pilotfish.snapshot import Resource, Snapshot
from pilotfish.xds import XdsServer, start_xds_server
from pilotfish.xds.heartbeats import Heartbeats
from pilotfish.xds.server import XdsPolicy

TIMEOUT = 10.0
TTL_MS = 3000
FEATURES = [SUPPORTS_TTL, RESOURCE_IN_SOTW[0]]


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def layer(value: str, *, ttl_ms: int = TTL_MS) -> Snapshot:
    runtime = rtds_pb2.Runtime(
        name="gameday", layer=struct_pb2.Struct(fields={"flag": struct_pb2.Value(string_value=value)})
    )
    return Snapshot.build({RUNTIME: [Resource.of(RUNTIME, runtime, ttl_ms=ttl_ms)]})


class Served:
    def __init__(self, cache: SnapshotCache, xds: XdsServer, clock: Clock, channel: grpc.aio.Channel, log: Path):
        self.cache, self.xds, self.clock, self.channel, self.log = cache, xds, clock, channel, log

    def events(self, kind: str) -> list[dict[str, object]]:
        return [e for e in map(json.loads, self.log.read_text().splitlines()) if e["event"] == kind]

    async def acked(self, count: int) -> None:
        """Wait until the server has taken ``count`` ACKs (a refresh waits for the last one)."""
        await until(lambda: len(self.events("ack")) >= count)

    def advance(self, seconds: float) -> int:
        """Move the clock on and run the heartbeats due: how many refreshes went out."""
        self.clock.now += seconds
        return self.xds.heartbeats.run()


@pytest.fixture
async def served(tmp_path: Path) -> AsyncIterator[Served]:
    cache = SnapshotCache()
    cache.set_snapshot(layer("on"))
    clock = Clock()
    log = tmp_path / "events.jsonl"
    events = EventLog(log)
    xds = XdsServer(cache, XdsPolicy(events=events), heartbeats=Heartbeats(clock=clock, spread=lambda: 0.0, tick=0))
    server, port = await start_xds_server(xds, "127.0.0.1:0")
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield Served(cache, xds, clock, channel, log)
    finally:
        await server.stop(0)
        events.close()


async def next_message(call: grpc.aio.StreamStreamCall) -> Any:
    return await asyncio.wait_for(call.read(), TIMEOUT)


async def until(predicate: Callable[[], bool]) -> None:
    async with asyncio.timeout(TIMEOUT):
        while not predicate():
            await asyncio.sleep(0.01)


def sotw_request(features: list[str], **fields: object) -> discovery_pb2.DiscoveryRequest:
    return discovery_pb2.DiscoveryRequest(
        type_url=RUNTIME.url, resource_names=["gameday"], node={"id": "edge-1", "client_features": features}, **fields
    )


PERIOD = TTL_MS / 1000 * 2 / 3  # (a 3 s TTL: renewed a third of it before it runs out)


async def test_sotw_a_layer_with_a_ttl_is_wrapped_and_sent_again_at_two_thirds_of_it(served: Served) -> None:
    xds = served.xds
    call = ads_pb2_grpc.AggregatedDiscoveryServiceStub(served.channel).StreamAggregatedResources()
    await call.write(sotw_request(FEATURES))
    first = await next_message(call)
    assert [r.type_url for r in first.resources] == [RESOURCE_URL]
    wrapped = discovery_pb2.Resource()
    first.resources[0].Unpack(wrapped)
    assert wrapped.name == "gameday" and wrapped.ttl.ToMilliseconds() == TTL_MS
    assert wrapped.resource.type_url == RUNTIME.url
    assert len(xds.heartbeats) == 1

    # Not ACKed yet: the refresh waits, and is tried again within a second.
    assert served.advance(PERIOD) == 0
    await call.write(sotw_request([], version_info=first.version_info, response_nonce=first.nonce))
    await served.acked(1)
    assert served.advance(0.1) == 0, "tried again later than this"
    assert served.advance(0.5) == 1
    refresh = await next_message(call)
    assert refresh.version_info == first.version_info and refresh.nonce != first.nonce
    assert list(refresh.resources) == list(first.resources), "the layer again, as it was, with its TTL"
    assert [e.get("refresh") for e in served.events("sent")] == [None, True]

    # ACKed: the next refresh is a period later, not before.
    await call.write(sotw_request([], version_info=refresh.version_info, response_nonce=refresh.nonce))
    await served.acked(2)
    assert served.advance(PERIOD - 0.1) == 0
    assert served.advance(0.2) == 1
    again = await next_message(call)
    assert again.version_info == first.version_info and list(again.resources) == list(first.resources)

    # The refreshes' ACKs leave the stream's watch standing: a change still goes out at once.
    await call.write(sotw_request([], version_info=again.version_info, response_nonce=again.nonce))
    await served.acked(3)
    served.cache.set_snapshot(layer("off"))
    changed = await next_message(call)
    assert changed.version_info != first.version_info and changed.resources != first.resources
    call.cancel()
    await until(lambda: xds.open_streams == 0)
    assert len(xds.heartbeats) == 0, "a stream that ended is forgotten"


async def test_sotw_a_layer_that_loses_its_ttl_is_renewed_no_more(served: Served) -> None:
    call = ads_pb2_grpc.AggregatedDiscoveryServiceStub(served.channel).StreamAggregatedResources()
    await call.write(sotw_request(FEATURES))
    first = await next_message(call)
    await call.write(sotw_request([], version_info=first.version_info, response_nonce=first.nonce))
    await served.acked(1)
    served.cache.set_snapshot(layer("on", ttl_ms=0))
    plain = await next_message(call)
    assert [r.type_url for r in plain.resources] == [RUNTIME.url], "sent as it is now: without a TTL"
    await call.write(sotw_request([], version_info=plain.version_info, response_nonce=plain.nonce))
    await served.acked(2)
    assert served.advance(60) == 0 and len(served.xds.heartbeats) == 0
    call.cancel()


async def delta_subscribed(served: Served) -> tuple[Any, Any]:
    """A delta stream of a client that takes TTLs, subscribed to the layer; its first response."""
    call = ads_pb2_grpc.AggregatedDiscoveryServiceStub(served.channel).DeltaAggregatedResources()
    node = {"id": "edge-1", "client_features": [SUPPORTS_TTL]}
    await call.write(
        discovery_pb2.DeltaDiscoveryRequest(type_url=RUNTIME.url, resource_names_subscribe=["gameday"], node=node)
    )
    return call, await next_message(call)


async def test_delta_a_heartbeat_names_the_layer_and_its_version_without_the_layer(served: Served) -> None:
    call, first = await delta_subscribed(served)
    (resource,) = first.resources
    assert resource.ttl.ToMilliseconds() == TTL_MS and resource.resource.type_url == RUNTIME.url
    await call.write(discovery_pb2.DeltaDiscoveryRequest(type_url=RUNTIME.url, response_nonce=first.nonce))
    await served.acked(1)
    assert served.advance(PERIOD) == 1
    beat = await next_message(call)
    (renewed,) = beat.resources
    assert renewed.name == "gameday" and renewed.version == resource.version
    assert renewed.ttl.ToMilliseconds() == TTL_MS and not renewed.HasField("resource")
    assert beat.nonce != first.nonce and not beat.removed_resources

    # A new version of the layer, with a longer TTL, goes out with the resource; renewed on from it.
    await call.write(discovery_pb2.DeltaDiscoveryRequest(type_url=RUNTIME.url, response_nonce=beat.nonce))
    await served.acked(2)
    served.cache.set_snapshot(layer("off", ttl_ms=6000))
    changed = await next_message(call)
    assert changed.resources[0].HasField("resource") and changed.resources[0].ttl.ToMilliseconds() == 6000
    await call.write(discovery_pb2.DeltaDiscoveryRequest(type_url=RUNTIME.url, response_nonce=changed.nonce))
    await served.acked(3)
    # (The refresh due before the change keeps its time: a new response need not carry every
    # resource with a TTL; renewing early is harmless.)
    assert served.advance(PERIOD) == 1
    second = await next_message(call)
    assert second.resources[0].version == changed.resources[0].version != resource.version
    assert not second.resources[0].HasField("resource") and second.resources[0].ttl.ToMilliseconds() == 6000
    await call.write(discovery_pb2.DeltaDiscoveryRequest(type_url=RUNTIME.url, response_nonce=second.nonce))
    await served.acked(4)
    assert served.advance(4.0 - 0.1) == 0, "then a period of the new TTL (6 s: 4 s)"
    assert served.advance(0.2) == 1
    third = await next_message(call)

    # The layer without a TTL: sent as it is now, and renewed no more.
    await call.write(discovery_pb2.DeltaDiscoveryRequest(type_url=RUNTIME.url, response_nonce=third.nonce))
    await served.acked(5)
    served.cache.set_snapshot(layer("off", ttl_ms=0))
    plain = await next_message(call)
    assert plain.resources[0].HasField("resource") and not plain.resources[0].HasField("ttl")
    await call.write(discovery_pb2.DeltaDiscoveryRequest(type_url=RUNTIME.url, response_nonce=plain.nonce))
    await served.acked(6)
    assert served.advance(60) == 0 and len(served.xds.heartbeats) == 0
    call.cancel()


async def test_delta_a_rejected_layer_is_not_renewed(served: Served) -> None:
    call, first = await delta_subscribed(served)
    await call.write(
        discovery_pb2.DeltaDiscoveryRequest(
            type_url=RUNTIME.url, response_nonce=first.nonce, error_detail={"message": "no"}
        )
    )
    await until(lambda: len(served.events("nack")) == 1)
    # What it runs is not what it was sent: a heartbeat of that version would not be one.
    assert served.advance(60) == 0 and served.advance(60) == 0
    call.cancel()


@pytest.mark.parametrize("features", [[], [SUPPORTS_TTL]], ids=["none", "ttl-without-resource-in-sotw"])
async def test_sotw_a_client_that_does_not_announce_ttls_gets_the_layer_plain_and_no_refresh(
    served: Served, features: list[str]
) -> None:
    call = ads_pb2_grpc.AggregatedDiscoveryServiceStub(served.channel).StreamAggregatedResources()
    await call.write(sotw_request(features))
    first = await next_message(call)
    assert [r.type_url for r in first.resources] == [RUNTIME.url]
    runtime = rtds_pb2.Runtime()
    first.resources[0].Unpack(runtime)
    assert runtime.layer.fields["flag"].string_value == "on"
    await call.write(sotw_request([], version_info=first.version_info, response_nonce=first.nonce))
    await served.acked(1)
    assert served.advance(3600) == 0 and len(served.xds.heartbeats) == 0
    call.cancel()


class StreamDouble:
    """A stream as the heartbeats see it: counts refreshes; settled or not as the test says."""

    def __init__(self) -> None:
        self.closed = False
        self.settled = True
        self.refreshed = 0

    def refresh(self, type_url: object, current: object) -> bool | None:
        if not self.settled:
            return False
        self.refreshed += 1
        return True


def test_one_timer_for_every_stream_armed_for_the_earliest_refresh_and_bounded_memory() -> None:
    clock = Clock()
    armed: list[float] = []
    cancelled: list[float] = []

    def arm(due: float, run: Callable[[], object]) -> Callable[[], None]:
        armed.append(due)
        return lambda: cancelled.append(due)

    beats = Heartbeats(clock=clock, arm=arm, spread=lambda: 0.0, tick=0)
    slow = layer("on", ttl_ms=60_000).types[RUNTIME.url]
    fast = layer("on", ttl_ms=3_000).types[RUNTIME.url]
    streams = [StreamDouble() for _ in range(100)]
    for stream in streams:
        beats.expect(stream, RUNTIME.url, slow)
    assert armed == [clock.now + 55.0], "one timer, however many streams (60 s TTL: 5 s before it)"
    beats.expect(streams[0], RUNTIME.url, fast)
    assert armed[-1] == clock.now + 2.0 and cancelled == [clock.now + 55.0], "re-armed earlier, the old one cancelled"
    # Streams answered again and again (every push) keep one entry each, and the heap stays bounded.
    for _ in range(50):
        clock.now += 1.0
        for stream in streams:
            beats.expect(stream, RUNTIME.url, fast)
        beats.run()
    assert len(beats) == 100 and len(beats._heap) <= 2 * len(beats) + 64
    assert all(stream.refreshed >= 20 for stream in streams)
    # A stream that is not settled is tried again within a second; one that ended is forgotten.
    streams[1].settled = False
    streams[2].closed = True
    before = streams[1].refreshed
    clock.now += 2.0
    beats.run()
    assert streams[1].refreshed == before and len(beats) == 99
    streams[1].settled = True
    clock.now += 0.5
    beats.run()
    assert streams[1].refreshed == before + 1
    beats.forget(streams[3], [RUNTIME.url])
    assert len(beats) == 98
    beats.close()
    assert len(beats) == 0 and cancelled[-1] == armed[-1]


async def test_a_proxy_that_reconnects_holding_the_current_version_is_sent_its_ttls_again(served: Served) -> None:
    """After a restart of the server, a proxy states what it has: at the current version it would
    be sent nothing, and its TTLs would run out while the server serves it. It is sent what has a
    TTL again (renewing it), and refreshed from then on; SotW and delta."""
    stub = ads_pb2_grpc.AggregatedDiscoveryServiceStub(served.channel)
    version = served.cache.snapshot().version(RUNTIME.url)  # type: ignore[union-attr]
    sotw = stub.StreamAggregatedResources()
    await sotw.write(sotw_request(FEATURES, version_info=version))
    again = await next_message(sotw)
    assert again.version_info == version and [r.type_url for r in again.resources] == [RESOURCE_URL]
    await sotw.write(sotw_request([], version_info=version, response_nonce=again.nonce))

    resource = served.cache.snapshot().types[RUNTIME.url].resources["gameday"]  # type: ignore[union-attr]
    delta = stub.DeltaAggregatedResources()
    node = {"id": "edge-2", "client_features": [SUPPORTS_TTL]}
    await delta.write(
        discovery_pb2.DeltaDiscoveryRequest(
            type_url=RUNTIME.url,
            resource_names_subscribe=["gameday"],
            initial_resource_versions={"gameday": resource.version},
            node=node,
        )
    )
    (resent,) = (await next_message(delta)).resources
    assert resent.version == resource.version and resent.HasField("resource") and resent.ttl.ToMilliseconds() == TTL_MS
    assert len(served.xds.heartbeats) == 2
    sotw.cancel()
    delta.cancel()


async def test_a_proxy_that_reconnects_at_the_current_version_without_ttls_is_sent_nothing(served: Served) -> None:
    served.cache.set_snapshot(layer("on", ttl_ms=0))
    call = ads_pb2_grpc.AggregatedDiscoveryServiceStub(served.channel).StreamAggregatedResources()
    version = served.cache.snapshot().version(RUNTIME.url)  # type: ignore[union-attr]
    await call.write(sotw_request(FEATURES, version_info=version))
    await until(lambda: served.cache.watch_count() == 1)  # taken, and waiting: nothing to send
    served.cache.set_snapshot(layer("off", ttl_ms=0))
    first = await next_message(call)
    assert first.version_info == served.cache.snapshot().version(RUNTIME.url) != version  # type: ignore[union-attr]
    call.cancel()
