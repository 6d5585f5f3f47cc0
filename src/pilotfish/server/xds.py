"""xDS over gRPC (grpc.aio): the aggregated service and the per-type services, SotW.

This layer only moves bytes. Each stream pairs a :class:`~pilotfish.protocol.SotwStream` (what the
stream has seen) with watches on the :class:`~pilotfish.cache.SnapshotCache` (what exists). A
reader task feeds requests to the state machine and opens the watches it asks for; the handler
itself writes the responses the cache hands back, in the order they were produced (ADS order for
one change). Responses are shared pre-encoded bytes; a stream appends only its nonce, which is why
the methods are registered with a pass-through response serializer.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.service.discovery.v3 import discovery_pb2

from pilotfish.cache import DEFAULT_GROUP, Cancel, NodeGroup, SnapshotCache
from pilotfish.errors import PeerError
from pilotfish.events import EventLog
from pilotfish.protocol import RequestKind, SotwStream, Watch
from pilotfish.resources import CLUSTER, ENDPOINT, LISTENER, ROUTE, SECRET, TypeUrl
from pilotfish.resources.wire import nonce_field
from pilotfish.snapshot import EncodedResponse
from pilotfish.status import SyncStatus

__all__ = ["GRPC_OPTIONS", "XdsServer", "start_grpc_server"]

_log = logging.getLogger("pilotfish.server")

_MB = 1024 * 1024
GRPC_OPTIONS: list[tuple[str, int]] = [
    # A control-plane restart makes every proxy reconnect at once; the defaults cancel new
    # streams past a few thousand pending calls.
    ("grpc.server.max_pending_requests", 100_000),
    ("grpc.server.max_pending_requests_hard_limit", 200_000),
    ("grpc.max_concurrent_streams", 1_000_000),
    ("grpc.max_send_message_length", 512 * _MB),
    ("grpc.max_receive_message_length", 64 * _MB),
    # Find dead peers; let Envoy ping as its own keepalive settings say.
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 5_000),
    ("grpc.http2.max_ping_strikes", 0),
]

# (service, method, type served; None = any, i.e. aggregated)
_SOTW_METHODS: tuple[tuple[str, str, TypeUrl | None], ...] = (
    ("envoy.service.discovery.v3.AggregatedDiscoveryService", "StreamAggregatedResources", None),
    ("envoy.service.cluster.v3.ClusterDiscoveryService", "StreamClusters", CLUSTER.url),
    ("envoy.service.endpoint.v3.EndpointDiscoveryService", "StreamEndpoints", ENDPOINT.url),
    ("envoy.service.listener.v3.ListenerDiscoveryService", "StreamListeners", LISTENER.url),
    ("envoy.service.route.v3.RouteDiscoveryService", "StreamRoutes", ROUTE.url),
    ("envoy.service.secret.v3.SecretDiscoveryService", "StreamSecrets", SECRET.url),
)


def _default_group(node: base_pb2.Node) -> NodeGroup:
    return DEFAULT_GROUP


@dataclass(frozen=True, slots=True)
class _Queued:
    watch: Watch
    response: EncodedResponse
    generation: int


class XdsServer:
    """Serves the cache's snapshots to xDS streams and records the conversation."""

    def __init__(
        self,
        cache: SnapshotCache,
        *,
        events: EventLog | None = None,
        status: SyncStatus | None = None,
        group_of: Callable[[base_pb2.Node], NodeGroup] = _default_group,
    ) -> None:
        self.cache = cache
        self.events = events or EventLog()
        self.status = status or SyncStatus()
        self._group_of = group_of
        self._stream_ids = itertools.count(1)
        self.open_streams = 0

    def handlers(self) -> list[grpc.GenericRpcHandler]:
        """Generic handlers for every xDS service pilotfish serves."""
        by_service: dict[str, dict[str, grpc.RpcMethodHandler]] = {}
        for service, method, type_url in _SOTW_METHODS:
            by_service.setdefault(service, {})[method] = grpc.stream_stream_rpc_method_handler(
                self._sotw_handler(type_url),
                request_deserializer=discovery_pb2.DiscoveryRequest.FromString,
                response_serializer=None,  # the handler yields encoded bytes
            )
        return [grpc.method_handlers_generic_handler(s, m) for s, m in by_service.items()]

    def _sotw_handler(
        self, type_url: TypeUrl | None
    ) -> Callable[[AsyncIterator[discovery_pb2.DiscoveryRequest], grpc.aio.ServicerContext], AsyncIterator[bytes]]:
        async def handler(
            requests: AsyncIterator[discovery_pb2.DiscoveryRequest], context: grpc.aio.ServicerContext
        ) -> AsyncIterator[bytes]:
            async for chunk in self._sotw_stream(requests, context, type_url):
                yield chunk

        return handler

    async def _sotw_stream(
        self,
        requests: AsyncIterator[discovery_pb2.DiscoveryRequest],
        context: grpc.aio.ServicerContext,
        type_url: TypeUrl | None,
    ) -> AsyncIterator[bytes]:
        stream_id = next(self._stream_ids)
        state = SotwStream(type_url=type_url)
        queue: asyncio.Queue[_Queued | BaseException | None] = asyncio.Queue()
        cancels: dict[TypeUrl, Cancel] = {}
        generations: dict[TypeUrl, int] = {}
        node_id = ""
        group = DEFAULT_GROUP
        events = self.events

        def open_watch(watch: Watch) -> None:
            url = watch.type_url
            previous = cancels.pop(url, None)
            if previous is not None:
                previous()
            generation = generations[url] = generations.get(url, 0) + 1

            def respond(watch: Watch, response: EncodedResponse) -> None:
                queue.put_nowait(_Queued(watch, response, generation))

            cancels[url] = self.cache.create_watch(watch, respond, group)

        async def read() -> None:
            nonlocal node_id, group
            try:
                async for request in requests:
                    first = state.node is None
                    outcome = state.on_request(request)
                    if first:
                        assert state.node is not None
                        node_id = state.node.id
                        group = self._group_of(state.node)
                        self.status.stream_opened(node_id)
                        events.emit("stream_open", stream=stream_id, node=node_id, peer=context.peer(),
                                    service="ads" if type_url is None else type_url)
                    kind = outcome.kind
                    events.emit(
                        "stale" if kind is RequestKind.STALE else kind.value,
                        stream=stream_id, node=node_id, type=outcome.type_url,
                        version_info=outcome.version_info, response_nonce=outcome.response_nonce,
                        error=outcome.error, resource_names=list(request.resource_names),
                    )
                    if kind is RequestKind.ACK:
                        self.status.acked(node_id, outcome.type_url, outcome.version_info)
                    elif kind is RequestKind.NACK:
                        self.status.nacked(node_id, outcome.type_url, outcome.rejected_version, outcome.error or "")
                        _log.warning("%s rejected %s version %s: %s", node_id or f"stream {stream_id}",
                                     outcome.type_url.rsplit(".", 1)[-1], outcome.rejected_version, outcome.error)
                    for watch in outcome.watches:
                        open_watch(watch)
            except PeerError as exc:
                queue.put_nowait(exc)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the stream broke (peer gone, malformed message)
                queue.put_nowait(exc)
            else:
                queue.put_nowait(None)

        self.open_streams += 1
        reader = asyncio.create_task(read(), name=f"xds-reader-{stream_id}")
        reason = "closed by client"
        try:
            while True:
                item = await queue.get()
                if item is None:
                    return
                if isinstance(item, PeerError):
                    reason = f"protocol error: {item}"
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(item))
                if isinstance(item, BaseException):
                    reason = f"stream error: {item!r}"
                    return
                if generations.get(item.response.type_url) != item.generation:
                    continue  # a newer request superseded the watch this answered
                nonce = state.on_response(item.watch, item.response)
                yield item.response.body + nonce_field(nonce)
                self.status.sent(node_id, item.response.type_url, item.response.version)
                events.emit("sent", stream=stream_id, node=node_id, type=item.response.type_url,
                            version=item.response.version, nonce=nonce, resources=len(item.response.names))
        except asyncio.CancelledError:
            reason = "cancelled"
            raise
        finally:
            self.open_streams -= 1
            reader.cancel()
            for cancel in cancels.values():
                cancel()
            if state.node is not None:
                self.status.stream_closed(node_id)
            events.emit("stream_closed", stream=stream_id, node=node_id, reason=reason)


async def start_grpc_server(xds: XdsServer, address: str) -> tuple[grpc.aio.Server, int]:
    """Start a grpc.aio server for ``xds`` on ``address`` (``host:port``; port 0 = any free)."""
    server = grpc.aio.server(options=GRPC_OPTIONS, maximum_concurrent_rpcs=None)
    server.add_generic_rpc_handlers(xds.handlers())
    port = server.add_insecure_port(address)
    if port == 0:
        raise OSError(f"cannot listen on {address}")
    await server.start()
    return server, port
