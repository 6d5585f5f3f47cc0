"""The gRPC xDS services see the cache only through :class:`~pilotfish.cache.ConfigWatcher` (create
a watch, cancel it): a watcher of the test's own, not the SnapshotCache, serves real gRPC clients,
SotW and delta, over pilotfish's own transport. What the server does around it (the node's group,
ACKs in the status, cancelling what a closed stream waited for) is the server's, not the cache's."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import grpc
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2

from cluster_snapshots import clusters
from pilotfish.cache import Cancel, ConfigWatcher, DeltaRespond, NodeGroup, Respond
from pilotfish.protocol import DeltaWatch, Watch, needs_response
from pilotfish.resources import CLUSTER
from pilotfish.snapshot import Snapshot
from pilotfish.status import ProxyStatus, SyncStatus
from pilotfish.xds import XdsServer, start_xds_server
from pilotfish.xds.server import XdsPolicy

TIMEOUT = 10.0


class WatcherDouble:
    """A test double of :class:`~pilotfish.cache.ConfigWatcher`: one snapshot, every watch kept
    with its group; a watch is answered at once if it lacks something, else held until
    :meth:`publish`. Knows nothing of streams, grants or status."""

    def __init__(self, snapshot: Snapshot) -> None:
        self.current = snapshot
        self.opened: list[tuple[Watch | DeltaWatch, NodeGroup]] = []
        self.held: dict[int, tuple[Watch, Respond] | tuple[DeltaWatch, DeltaRespond]] = {}
        self.cancelled = 0
        self._ids = 0

    def create_watch(self, watch: Watch, respond: Respond, group: NodeGroup) -> Cancel:
        self.opened.append((watch, group))
        current = self.current.get(watch.type_url)
        if current is not None and needs_response(watch, current):
            respond(watch, current.response(watch.subscription.names_to_send()))
            return lambda: None
        return self._hold((watch, respond))

    def create_delta_watch(self, watch: DeltaWatch, respond: DeltaRespond, group: NodeGroup) -> Cancel:
        self.opened.append((watch, group))
        current = self.current.get(watch.type_url)
        changes = watch.changes(current) if current is not None else None
        if changes is not None:
            respond(watch, changes)
            return lambda: None
        return self._hold((watch, respond))

    def publish(self, snapshot: Snapshot) -> None:
        self.current = snapshot
        held, self.held = self.held, {}
        for entry in held.values():
            if isinstance(entry[0], DeltaWatch):
                self.create_delta_watch(entry[0], entry[1], NodeGroup("replayed"))
            else:
                self.create_watch(entry[0], entry[1], NodeGroup("replayed"))

    def _hold(self, entry: tuple[Watch, Respond] | tuple[DeltaWatch, DeltaRespond]) -> Cancel:
        self._ids += 1
        wid = self._ids
        self.held[wid] = entry

        def cancel() -> None:
            if self.held.pop(wid, None) is not None:
                self.cancelled += 1

        return cancel


def _is_a_config_watcher(watcher: WatcherDouble) -> ConfigWatcher:
    return watcher  # (mypy checks the double against the Protocol)


def blue(node: object) -> NodeGroup:
    return NodeGroup("blue")


async def wait_until(predicate: Callable[[], bool]) -> None:
    async with asyncio.timeout(TIMEOUT):
        while not predicate():
            await asyncio.sleep(0.01)


async def test_the_grpc_services_are_served_by_any_config_watcher() -> None:
    watcher = WatcherDouble(clusters("a"))
    status = SyncStatus()
    xds = XdsServer(_is_a_config_watcher(watcher), XdsPolicy(status=status), group_of=blue)
    server, port = await start_xds_server(xds, "127.0.0.1:0")
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel, asyncio.timeout(TIMEOUT):
            stub = ads_pb2_grpc.AggregatedDiscoveryServiceStub(channel)
            call = stub.StreamAggregatedResources()
            await call.write(discovery_pb2.DiscoveryRequest(type_url=CLUSTER.url, node={"id": "edge-1"}))
            first = await call.read()
            assert [r.type_url for r in first.resources] == [CLUSTER.url]
            assert first.version_info == watcher.current.version(CLUSTER.url)
            assert watcher.opened[0][1] == "blue", "the server chose the group and handed it to the watcher"
            await call.write(
                discovery_pb2.DiscoveryRequest(
                    type_url=CLUSTER.url, version_info=first.version_info, response_nonce=first.nonce
                )
            )  # the ACK
            await wait_until(lambda: len(watcher.held) == 1)  # nothing new: the watcher holds it
            record = status.get("edge-1")
            assert isinstance(record, ProxyStatus) and record.types[CLUSTER.url].acked_version == first.version_info

            watcher.publish(clusters("a", "b"))  # the double's own push
            second = await call.read()
            assert second.version_info == watcher.current.version(CLUSTER.url) != first.version_info
            assert len(second.resources) == 2
            await call.write(
                discovery_pb2.DiscoveryRequest(
                    type_url=CLUSTER.url, version_info=second.version_info, response_nonce=second.nonce
                )
            )
            await wait_until(lambda: len(watcher.held) == 1)

            delta = stub.DeltaAggregatedResources()
            await delta.write(discovery_pb2.DeltaDiscoveryRequest(type_url=CLUSTER.url, node={"id": "edge-2"}))
            answer = await delta.read()
            assert sorted(r.name for r in answer.resources) == ["a", "b"]
            await delta.write(
                discovery_pb2.DeltaDiscoveryRequest(type_url=CLUSTER.url, response_nonce=answer.nonce)
            )  # the ACK
            await wait_until(lambda: len(watcher.held) == 2)
            assert isinstance(watcher.opened[-1][0], DeltaWatch)

            call.cancel()
            delta.cancel()
            await wait_until(lambda: xds.open_streams == 0)
        assert watcher.cancelled == 2 and not watcher.held, "closed streams cancel what they waited for"
    finally:
        await server.stop(0.5)
