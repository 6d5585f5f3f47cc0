"""xDS over gRPC: the aggregated service and the per-type services, SotW.

This layer only moves bytes. Each stream pairs a :class:`~pilotfish.protocol.SotwStream` (what the
stream has seen) with watches on the :class:`~pilotfish.cache.SnapshotCache` (what exists). A
request is parsed and fed to the state machine as it arrives, and the watches it asks for are
opened; a response the cache hands back is written at once (the cache hands them over in ADS order).
Responses are shared pre-encoded bytes; a stream appends only its nonce. Everything runs in the
callbacks of pilotfish's own gRPC transport (:mod:`pilotfish.server.grpc_server`): an idle stream
is this object and its watches, with no task or coroutine.

A request a peer should not have sent ends its stream, never the server: a protocol error with
INVALID_ARGUMENT, a request over :class:`~pilotfish.protocol.XdsLimits` with RESOURCE_EXHAUSTED,
each with a short message (a peer's values are repeated shortened), a ``stream_closed`` event
and a warning logged at most once per :data:`WARN_EVERY` seconds (with how many were not).
"""

from __future__ import annotations

import itertools
import logging
import ssl
from collections.abc import Callable
from typing import NoReturn

from envoy.config.core.v3 import base_pb2
from envoy.service.discovery.v3 import discovery_pb2
from google.protobuf.message import DecodeError

from pilotfish.cache import DEFAULT_GROUP, Cancel, NodeGroup, SnapshotCache
from pilotfish.errors import PeerError
from pilotfish.events import EventLog
from pilotfish.protocol import DEFAULT_LIMITS, PeerOverLimit, RequestKind, SotwStream, Watch, XdsLimits
from pilotfish.protocol.limits import shorten
from pilotfish.resources import CLUSTER, ENDPOINT, LISTENER, ROUTE, SECRET, TypeUrl
from pilotfish.resources.wire import nonce_field, request_names_span
from pilotfish.server.grpc_server import (
    WARN_EVERY,
    Call,
    ConnectionLimits,
    GrpcServer,
    MethodFactory,
    RateLimitedLog,
    RpcError,
)
from pilotfish.snapshot import EncodedResponse
from pilotfish.status import SyncStatus
from pilotfish.transport.frames import GrpcStatus

__all__ = ["WARN_EVERY", "XdsLimits", "XdsServer", "start_xds_server"]

_log = logging.getLogger("pilotfish.server")

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


_TYPE_URL_CHARS = 256
_MESSAGE_CHARS = 1024
"""A gRPC status message is at most about this long (the limits' messages are shorter)."""


class XdsServer:
    """Serves the cache's snapshots to xDS streams and records the conversation."""

    def __init__(
        self,
        cache: SnapshotCache,
        *,
        events: EventLog | None = None,
        status: SyncStatus | None = None,
        group_of: Callable[[base_pb2.Node], NodeGroup] = _default_group,
        authorize: Callable[[str, str], str | None] | None = None,
        limits: XdsLimits = DEFAULT_LIMITS,
    ) -> None:
        self.cache = cache
        self.events = events or EventLog()
        self.status = status or SyncStatus()
        self.limits = limits
        self._group_of = group_of
        self.authorize = authorize
        """(identity, node id) -> why the claim is refused, or None (see :mod:`pilotfish.server.authorize`)."""
        self._warnings = RateLimitedLog(_log, what="such streams")
        """A peer that breaks the rules in a loop must not fill the log (the event log has a
        ``stream_closed`` line per stream)."""
        self._stream_ids = itertools.count(1)
        self.open_streams = 0

    def methods(self) -> dict[str, MethodFactory]:
        """``{path: factory}`` for every xDS method pilotfish serves."""
        def factory(type_url: TypeUrl | None) -> MethodFactory:
            return lambda call: _SotwConnection(self, call, type_url)

        return {f"/{service}/{method}": factory(type_url) for service, method, type_url in _SOTW_METHODS}


class _SotwConnection:
    """One SotW stream, driven by its call's callbacks: a request is handled as it arrives, and
    the cache's responses are written as it hands them over."""

    __slots__ = ("_call", "_cancels", "_current", "_last_nack", "_server", "closed", "group", "id",
                 "node_id", "state", "type_url")

    def __init__(self, server: XdsServer, call: Call, type_url: TypeUrl | None) -> None:
        self._server = server
        self._call = call
        self.type_url = type_url
        self.id = next(server._stream_ids)
        self.state = SotwStream(type_url=type_url, limits=server.limits)
        self.node_id = ""
        self.group = DEFAULT_GROUP
        self.closed = False
        self._cancels: dict[TypeUrl, Cancel] = {}
        self._current: dict[TypeUrl, Watch] = {}
        """The newest watch per type: a response to an older one is dropped unsent."""
        self._last_nack: tuple[TypeUrl, str | None] | None = None
        """The type and version of the last NACK warned about: a repeated one is not warned again."""
        server.open_streams += 1

    # -- the call's callbacks -------------------------------------------------------------------

    def on_message(self, data: bytes) -> None:
        if self.closed:
            return
        try:
            request = discovery_pb2.DiscoveryRequest.FromString(data)
        except DecodeError as exc:
            self._refuse(GrpcStatus.INVALID_ARGUMENT, f"undecodable DiscoveryRequest: {exc}")
        type_url = request.type_url
        # Not for a made-up type_url of megabytes: the span encodes (and caches a few) type URLs.
        # (Those we serve are < 100 characters; any other is refused just below.)
        names_wire = (request_names_span(data, type_url, request.response_nonce)
                      if len(type_url) <= _TYPE_URL_CHARS else None)
        try:
            self._on_request(request, names_wire)
        except PeerOverLimit as exc:
            self._refuse(GrpcStatus.RESOURCE_EXHAUSTED, str(exc))
        except PeerError as exc:
            self._refuse(GrpcStatus.INVALID_ARGUMENT, str(exc))

    def _refuse(self, code: int, message: str) -> NoReturn:
        """End the stream with ``code``: the peer broke the protocol or a limit."""
        message = shorten(message, _MESSAGE_CHARS)
        what = "over a limit" if code == GrpcStatus.RESOURCE_EXHAUSTED else "protocol error"
        self._server._warnings.log("stream %d from %s (node %r) ended, %s: %s", self.id, self._call.peer,
                                    shorten(self.node_id, 200), what, message)
        self._close(f"{what}: {message}")
        raise RpcError(code, message)

    def on_half_close(self) -> None:
        self._close("closed by client")

    def on_closed(self, reason: str) -> None:
        self._close(reason)

    # -- requests and responses -----------------------------------------------------------------

    def _on_request(self, request: discovery_pb2.DiscoveryRequest, names_wire: bytes | None) -> None:
        server, state = self._server, self.state
        first = state.node is None
        if first and server.authorize is not None:
            refusal = server.authorize(self._call.peer_identity, request.node.id)
            if refusal is not None:
                server.events.emit("node_refused", stream=self.id, identity=self._call.peer_identity,
                                   peer=self._call.peer, reason=refusal)
                _log.warning("%s: %s", self._call.peer, refusal)
                self._close(f"permission denied: {refusal}")
                raise RpcError(GrpcStatus.PERMISSION_DENIED, refusal)
        outcome = state.on_request(request, names_wire=names_wire)
        if first:
            assert state.node is not None
            self.node_id = state.node.id
            self.group = server._group_of(state.node)
            server.status.stream_opened(self.node_id)
            identity = self._call.peer_identity  # from the client's certificate (mTLS), else ""
            server.events.emit("stream_open", stream=self.id, node=self.node_id, peer=self._call.peer,
                               service="ads" if self.type_url is None else self.type_url,
                               **({"identity": identity} if identity else {}))
        kind = outcome.kind
        if kind is RequestKind.NACK or server.events.conversation:
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
            nack = (outcome.type_url, outcome.rejected_version)
            if nack != self._last_nack:  # a peer repeating its NACK does not fill the log
                self._last_nack = nack
                _log.warning("%s rejected %s version %s: %s", self.node_id or f"stream {self.id}",
                             outcome.type_url.rsplit(".", 1)[-1], outcome.rejected_version, outcome.error)
        for watch in outcome.watches:
            url = watch.type_url
            previous = self._cancels.pop(url, None)
            if previous is not None:
                previous()
            self._current[url] = watch
            self._cancels[url] = server.cache.create_watch(watch, self._send, self.group)

    def _send(self, watch: Watch, response: EncodedResponse) -> None:
        """The cache's callback: write the response now (the transport queues what flow control
        holds back), unless a newer request superseded the watch it answers."""
        if self.closed or self._current.get(response.type_url) is not watch:
            return
        server = self._server
        nonce = self.state.on_response(watch, response)
        self._call.send(response.body, nonce_field(nonce))
        server.status.sent(self.node_id, response.type_url, response.version)
        if server.events.conversation:
            server.events.emit("sent", stream=self.id, node=self.node_id, type=response.type_url,
                               version=response.version, nonce=nonce, resources=len(response.names))

    def _close(self, reason: str) -> None:
        if self.closed:
            return
        self.closed = True
        server = self._server
        server.open_streams -= 1
        for cancel in self._cancels.values():
            cancel()
        self._cancels.clear()
        self._current.clear()
        if self.state.node is not None:
            server.status.stream_closed(self.node_id)
        server.events.emit("stream_closed", stream=self.id, node=self.node_id, reason=reason)


async def start_xds_server(xds: XdsServer, address: str, *, tls: ssl.SSLContext | None = None,
                           connection_limits: ConnectionLimits | None = None) -> tuple[GrpcServer, int]:
    """Serve ``xds`` on ``address`` (``host:port``; port 0 = any free), over TLS when ``tls`` is
    given, holding connections within ``connection_limits``; returns (server, port)."""
    host, _, port = address.rpartition(":")
    server = GrpcServer(xds.methods(), connection_limits=connection_limits)
    bound = await server.start(host.strip("[]"), int(port), tls=tls)
    return server, bound
