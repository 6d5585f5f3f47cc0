"""xDS over gRPC (grpc.aio): the aggregated service and the per-type services, SotW.

This layer only moves bytes. Each stream pairs a :class:`~pilotfish.protocol.SotwStream` (what the
stream has seen) with watches on the :class:`~pilotfish.cache.SnapshotCache` (what exists). The
handler reads requests, feeds them to the state machine and opens the watches it asks for; the
responses the cache hands back are written in the order they were produced (ADS order for one
change) by a writer task that lives only while something is queued. Responses are shared
pre-encoded bytes; a stream appends only its nonce, which is why the methods are registered with
a pass-through response serializer.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable

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
    # ...and calls the application has not picked up within 30 s (the default) are cancelled,
    # which a storm of 10,000 reconnecting proxies reaches: they would only retry and add load.
    ("grpc.server_max_unrequested_time_in_server", 600),
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
    ) -> Callable[[AsyncIterator[discovery_pb2.DiscoveryRequest], grpc.aio.ServicerContext], Awaitable[None]]:
        async def handler(
            requests: AsyncIterator[discovery_pb2.DiscoveryRequest], context: grpc.aio.ServicerContext
        ) -> None:
            await _SotwConnection(self, context, type_url).run(requests)

        return handler


class _SotwConnection:
    """One SotW stream: requests are read in the handler's own coroutine; responses are written
    by a task that exists only while there is something to write, so an idle stream costs one
    suspended coroutine and this object."""

    __slots__ = (
        "_cancels", "_context", "_current", "_pending", "_respond", "_server", "_writer",
        "group", "id", "node_id", "reason", "state", "type_url",
    )

    def __init__(self, server: XdsServer, context: grpc.aio.ServicerContext, type_url: TypeUrl | None) -> None:
        self._server = server
        self._context = context
        self.type_url = type_url
        self.id = next(server._stream_ids)
        self.state = SotwStream(type_url=type_url)
        self.node_id = ""
        self.group = DEFAULT_GROUP
        self.reason = "closed by client"
        self._cancels: dict[TypeUrl, Cancel] = {}
        self._current: dict[TypeUrl, Watch] = {}
        """The newest watch per type: a response to an older one is dropped unsent."""
        # Made when something is queued and dropped when drained: an idle stream holds none.
        self._pending: deque[tuple[Watch, EncodedResponse]] | None = None
        self._writer: asyncio.Task[None] | None = None
        self._respond = self._queue  # one bound method for every watch of the stream

    async def run(self, requests: AsyncIterator[discovery_pb2.DiscoveryRequest]) -> None:
        server = self._server
        server.open_streams += 1
        try:
            async for request in requests:
                self._on_request(request)
        except PeerError as exc:
            self.reason = f"protocol error: {exc}"
            await self._context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except asyncio.CancelledError:
            self.reason = "cancelled"
            raise
        finally:
            server.open_streams -= 1
            if self._writer is not None:
                self._writer.cancel()
            for cancel in self._cancels.values():
                cancel()
            if self.state.node is not None:
                server.status.stream_closed(self.node_id)
            server.events.emit("stream_closed", stream=self.id, node=self.node_id, reason=self.reason)

    def _on_request(self, request: discovery_pb2.DiscoveryRequest) -> None:
        server, state = self._server, self.state
        first = state.node is None
        outcome = state.on_request(request)
        if first:
            assert state.node is not None
            self.node_id = state.node.id
            self.group = server._group_of(state.node)
            server.status.stream_opened(self.node_id)
            server.events.emit("stream_open", stream=self.id, node=self.node_id, peer=self._context.peer(),
                               service="ads" if self.type_url is None else self.type_url)
        kind = outcome.kind
        if server.events.enabled:
            # Names only when they say something new: an ACK repeats the names it subscribed to.
            names = (list(request.resource_names)
                     if kind is not RequestKind.ACK or outcome.subscription_changed else None)
            server.events.emit(
                "stale" if kind is RequestKind.STALE else kind.value,
                stream=self.id, node=self.node_id, type=outcome.type_url,
                version_info=outcome.version_info, response_nonce=outcome.response_nonce,
                error=outcome.error, **({"resource_names": names} if names is not None else {}),
            )
        if kind is RequestKind.ACK:
            server.status.acked(self.node_id, outcome.type_url, outcome.version_info)
        elif kind is RequestKind.NACK:
            server.status.nacked(self.node_id, outcome.type_url, outcome.rejected_version, outcome.error or "")
            _log.warning("%s rejected %s version %s: %s", self.node_id or f"stream {self.id}",
                         outcome.type_url.rsplit(".", 1)[-1], outcome.rejected_version, outcome.error)
        for watch in outcome.watches:
            url = watch.type_url
            previous = self._cancels.pop(url, None)
            if previous is not None:
                previous()
            self._current[url] = watch
            self._cancels[url] = server.cache.create_watch(watch, self._respond, self.group)

    def _queue(self, watch: Watch, response: EncodedResponse) -> None:
        """The cache's callback (synchronous): queue the response, start a writer if none runs."""
        if self._pending is None:
            self._pending = deque()
        self._pending.append((watch, response))
        if self._writer is None:
            self._writer = asyncio.get_running_loop().create_task(self._write())

    async def _write(self) -> None:
        server, state, current = self._server, self.state, self._current
        try:
            while self._pending:
                watch, response = self._pending.popleft()
                if current.get(response.type_url) is not watch:
                    continue  # a newer request superseded the watch this answered
                nonce = state.on_response(watch, response)
                await self._context.write(response.body + nonce_field(nonce))
                server.status.sent(self.node_id, response.type_url, response.version)
                server.events.emit("sent", stream=self.id, node=self.node_id, type=response.type_url,
                                   version=response.version, nonce=nonce, resources=len(response.names))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the stream is gone (peer reset, cancelled RPC)
            self.reason = f"write failed: {exc!r}"
        finally:
            self._writer = None
            self._pending = None


async def start_grpc_server(xds: XdsServer, address: str) -> tuple[grpc.aio.Server, int]:
    """Start a grpc.aio server for ``xds`` on ``address`` (``host:port``; port 0 = any free)."""
    server = grpc.aio.server(options=GRPC_OPTIONS, maximum_concurrent_rpcs=None)
    server.add_generic_rpc_handlers(xds.handlers())
    port = server.add_insecure_port(address)
    if port == 0:
        raise OSError(f"cannot listen on {address}")
    await server.start()
    return server, port
