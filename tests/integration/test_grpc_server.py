"""The xDS gRPC server in-process, spoken to by a gRPC client, serving a watched file."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from envoy.service.cluster.v3 import cds_pb2_grpc
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2
from envoy.service.runtime.v3 import rtds_pb2, rtds_pb2_grpc

from pilotfish.app import ServeSettings, serve
from pilotfish.app.settings import EventSettings, XdsSettings
from pilotfish.events import read_events
from pilotfish.sources import file_signature, load_desired, watch_file

CDS = "type.googleapis.com/envoy.config.cluster.v3.Cluster"
EDS = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"
RTDS = "type.googleapis.com/envoy.service.runtime.v3.Runtime"
TIMEOUT = 10.0


def document(version: str | None, *ports: int, timeout: str = "1s") -> dict[str, Any]:
    """Clusters "web" (endpoints on ``ports``) and "api" (one endpoint)."""

    def cluster(name: str) -> dict[str, Any]:
        return {
            "name": name,
            "type": "EDS",
            "connect_timeout": timeout,
            "eds_cluster_config": {"eds_config": {"ads": {}, "resource_api_version": "V3"}},
        }

    def endpoints(name: str, ports: tuple[int, ...]) -> dict[str, Any]:
        return {
            "cluster_name": name,
            "endpoints": [
                {
                    "lb_endpoints": [
                        {"endpoint": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": p}}}}
                        for p in ports
                    ]
                }
            ],
        }

    doc: dict[str, Any] = {
        "clusters": [cluster("web"), cluster("api")],
        "endpoints": [endpoints("web", ports), endpoints("api", (8000,))],
    }
    if version is not None:
        doc["version"] = version
    return doc


def replace(path: Path, text: str) -> None:
    """Write beside the file and rename over it, as deploy tools do."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


class Events:
    """The server's event log. It is written on the turn of the event loop after the one that
    caused an event, so a test waits for the event it needs (:meth:`wait_for`) rather than read
    the log straight after an action."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def all(self) -> list[dict[str, Any]]:
        """Every complete line so far."""
        return read_events(self.path)[0]

    async def wait_for(self, match: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
        async with asyncio.timeout(TIMEOUT):
            while True:
                for event in self.all():
                    if match(event):
                        return event
                await asyncio.sleep(0.02)


@pytest.fixture
async def server(tmp_path: Path) -> AsyncIterator[tuple[str, Path, Events]]:
    snapshot = tmp_path / "snap.yaml"
    snapshot.write_text(yaml.safe_dump(document("1", 9001, 9002)))
    log = tmp_path / "events.jsonl"
    started: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(
        serve(
            ServeSettings(snapshot=snapshot, xds=XdsSettings(address="127.0.0.1:0"), events=EventSettings(log=log)),
            started=started,
        )
    )
    port = await asyncio.wait_for(started, TIMEOUT)
    events = Events(log)
    # No wait for the file watcher: a change made before it is in place is still seen, as the
    # watcher compares the file with the one serve() read (test_a_change_between_...).
    yield f"127.0.0.1:{port}", snapshot, events
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def read(call: Any) -> discovery_pb2.DiscoveryResponse:
    response: discovery_pb2.DiscoveryResponse = await asyncio.wait_for(call.read(), TIMEOUT)
    return response


async def test_ads_request_without_type_url_is_invalid_argument(server: tuple[str, Path, Events]) -> None:
    address, _, _ = server
    async with grpc.aio.insecure_channel(address) as channel:
        call = ads_pb2_grpc.AggregatedDiscoveryServiceStub(channel).StreamAggregatedResources()
        await call.write(discovery_pb2.DiscoveryRequest())
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await read(call)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "type_url" in (caught.value.details() or "")


async def test_file_change_is_pushed_and_bad_file_keeps_last_good(server: tuple[str, Path, Events]) -> None:
    address, snapshot, events = server
    async with grpc.aio.insecure_channel(address) as channel:
        call = ads_pb2_grpc.AggregatedDiscoveryServiceStub(channel).StreamAggregatedResources()
        request = discovery_pb2.DiscoveryRequest(type_url=EDS, resource_names=["web"])
        request.node.id = "proxy-1"
        await call.write(request)
        first = await read(call)
        assert first.version_info == "1" and len(first.resources) == 1
        await call.write(
            discovery_pb2.DiscoveryRequest(
                type_url=EDS, resource_names=["web"], version_info="1", response_nonce=first.nonce
            )
        )

        # A broken (half-written) file is reported and not served.
        replace(snapshot, "endpoints:\n  - cluster_name: web\n    endpoints: [{lb_endpoints: [")
        error = await events.wait_for(lambda e: e["event"] == "snapshot_error")
        assert "invalid YAML" in error["reason"]

        # The next good file reaches the open stream without the client asking.
        replace(snapshot, yaml.safe_dump(document("2", 9001)))
        pushed = await read(call)
        assert pushed.version_info == "2" and pushed.nonce != first.nonce
        await call.write(
            discovery_pb2.DiscoveryRequest(
                type_url=EDS, resource_names=["web"], version_info="2", response_nonce=pushed.nonce
            )
        )
        ack = await events.wait_for(lambda e: e["event"] == "ack" and e["version_info"] == "2")
        assert ack["node"] == "proxy-1" and ack["type"] == EDS
        sent = [e for e in events.all() if e["event"] == "sent"]  # logged before the ack of the last
        assert [e["version"] for e in sent] == ["1", "2"]
        assert all(e["node"] == "proxy-1" and e["resources"] == 1 for e in sent)
        await call.done_writing()


async def test_per_type_cluster_service(server: tuple[str, Path, Events]) -> None:
    address, _, events = server
    async with grpc.aio.insecure_channel(address) as channel:
        call = cds_pb2_grpc.ClusterDiscoveryServiceStub(channel).StreamClusters()
        await call.write(discovery_pb2.DiscoveryRequest(node={"id": "cds-only"}))  # type_url implied
        response = await read(call)
        assert response.type_url == CDS and response.version_info == "1"
        await call.done_writing()
    closed = await events.wait_for(lambda e: e["event"] == "stream_closed")
    assert closed["node"] == "cds-only"


async def test_runtime_layers_over_the_per_type_rtds_service_sotw_and_delta(
    server: tuple[str, Path, Events],
) -> None:
    """RTDS as Envoy asks for it: a layer by name, SotW (StreamRuntime) and delta (DeltaRuntime).
    A layer named before it exists is sent when the file gains it; an ACK gets nothing more."""
    address, snapshot, events = server
    async with grpc.aio.insecure_channel(address) as channel:
        stub = rtds_pb2_grpc.RuntimeDiscoveryServiceStub(channel)
        sotw = stub.StreamRuntime()
        await sotw.write(discovery_pb2.DiscoveryRequest(node={"id": "rt-sotw"}, resource_names=["flags"]))
        delta = stub.DeltaRuntime()
        await delta.write(
            discovery_pb2.DeltaDiscoveryRequest(node={"id": "rt-delta"}, resource_names_subscribe=["flags"])
        )
        first = await read(sotw)  # nothing named "flags" yet: an empty response at the current version
        assert first.type_url == RTDS and not first.resources
        await sotw.write(
            discovery_pb2.DiscoveryRequest(
                resource_names=["flags"], version_info=first.version_info, response_nonce=first.nonce
            )
        )
        absent = await read(delta)
        assert list(absent.removed_resources) == ["flags"]  # told once that it does not exist
        await delta.write(discovery_pb2.DeltaDiscoveryRequest(response_nonce=absent.nonce))
        doc = {**document("2", 9001, 9002), "runtime": {"flags": {"feature.on": True, "percent": 25}}}
        replace(snapshot, yaml.safe_dump(doc))
        (layer,) = (await read(sotw)).resources
        runtime = rtds_pb2.Runtime.FromString(layer.value)
        assert runtime.name == "flags" and runtime.layer.fields["percent"].number_value == 25
        assert runtime.layer.fields["feature.on"].bool_value is True
        sent = await read(delta)
        assert [r.name for r in sent.resources] == ["flags"] and sent.type_url == RTDS
        await delta.write(discovery_pb2.DeltaDiscoveryRequest(response_nonce=sent.nonce))
        await events.wait_for(lambda e: e["event"] == "ack" and e.get("node") == "rt-delta" and e.get("type") == RTDS)
        await sotw.done_writing()
        await delta.done_writing()


async def test_nack_is_logged_and_not_answered_with_the_same_content(server: tuple[str, Path, Events]) -> None:
    address, snapshot, events = server
    async with grpc.aio.insecure_channel(address) as channel:
        call = ads_pb2_grpc.AggregatedDiscoveryServiceStub(channel).StreamAggregatedResources()
        await call.write(discovery_pb2.DiscoveryRequest(type_url=CDS, node={"id": "p"}))
        first = await read(call)
        nack = discovery_pb2.DiscoveryRequest(type_url=CDS, version_info="", response_nonce=first.nonce)
        nack.error_detail.message = "Proto constraint validation failed (ClusterValidationError.ConnectTimeout)"
        await call.write(nack)
        logged = await events.wait_for(lambda e: e["event"] == "nack")
        assert logged["error"].endswith("ConnectTimeout)") and logged["response_nonce"] == first.nonce
        # Nothing more is sent until the content changes.
        replace(snapshot, yaml.safe_dump(document("2", 9001, 9002, timeout="2s")))
        second = await read(call)
        assert second.version_info == "2"  # the next message on the stream: nothing was resent before it
        await events.wait_for(lambda e: e["event"] == "sent" and e["version"] == "2")
        assert [e["version"] for e in events.all() if e["event"] == "sent"] == ["1", "2"]
        await call.done_writing()


async def test_rewriting_equal_content_pushes_nothing(tmp_path: Path, server: tuple[str, Path, Events]) -> None:
    address, snapshot, events = server
    replace(snapshot, yaml.safe_dump(document(None, 9001, 9002)))
    await events.wait_for(lambda e: e["event"] == "snapshot_loaded" and e["version"] != "1")
    async with grpc.aio.insecure_channel(address) as channel:
        call = ads_pb2_grpc.AggregatedDiscoveryServiceStub(channel).StreamAggregatedResources()
        await call.write(discovery_pb2.DiscoveryRequest(type_url=EDS, resource_names=["web"], node={"id": "p"}))
        first = await read(call)
        await call.write(
            discovery_pb2.DiscoveryRequest(
                type_url=EDS, resource_names=["web"], version_info=first.version_info, response_nonce=first.nonce
            )
        )
        # The same content, resources and sections in another order, written as JSON: same hashes.
        original = document(None, 9001, 9002)
        reordered = {"endpoints": original["endpoints"][::-1], "clusters": original["clusters"][::-1]}
        replace(snapshot, json.dumps(reordered, indent=1))
        await events.wait_for(lambda e: e["event"] == "snapshot_unchanged")
        # A real change does push, proving the stream was listening.
        replace(snapshot, yaml.safe_dump(document(None, 9003)))
        changed = await read(call)  # the next message on the stream: nothing was pushed before it
        assert changed.version_info != first.version_info
        await events.wait_for(lambda e: e["event"] == "sent" and e["version"] == changed.version_info)
        assert sum(1 for e in events.all() if e["event"] == "sent") == 2
        await call.done_writing()


async def test_a_change_between_the_first_read_and_the_watch_is_not_lost(tmp_path: Path) -> None:
    # serve() reads the file, then starts watching it: a change in between must still be seen.
    snapshot = tmp_path / "snap.yaml"
    snapshot.write_text(yaml.safe_dump(document("1", 9001)))
    loaded = file_signature(snapshot)
    assert load_desired(snapshot) is not None
    replace(snapshot, yaml.safe_dump(document("2", 9001, 9002)))
    watch = watch_file(snapshot, loaded=loaded)
    state = await asyncio.wait_for(anext(watch), TIMEOUT)
    assert not isinstance(state, Exception) and state.version == "2"
    await watch.aclose()


async def test_an_idle_server_freezes_what_lives_on_and_a_busy_one_does_not() -> None:
    import gc

    from pilotfish.app.parts import tidy_heap_when_idle

    keep = [[n] for n in range(5_000)]  # long-lived containers the GC would keep looking at
    idle = False
    asked = 0

    def is_idle() -> bool:
        nonlocal asked
        asked += 1
        return idle

    # The tidier asks idle() only when its sleep did not overshoot by more than busy_after (else the
    # loop counts as busy). This test is about a pending build, not a busy loop, which a loaded machine
    # makes of every loop: with a wide busy_after only idle() decides.
    patience = 3 * TIMEOUT
    task = asyncio.create_task(tidy_heap_when_idle(is_idle, every=0.02, young_limit=1_000, busy_after=60.0))
    try:
        frozen = gc.get_freeze_count()
        # It looked (more than once) and found a build pending: it must leave the heap alone.
        async with asyncio.timeout(patience):
            while asked < 2:
                await asyncio.sleep(0.02)
        assert gc.get_freeze_count() == frozen
        idle = True
        async with asyncio.timeout(patience):
            while gc.get_freeze_count() < frozen + len(keep):
                await asyncio.sleep(0.02)
    finally:
        task.cancel()
        gc.unfreeze()
    assert keep
