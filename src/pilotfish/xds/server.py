"""xDS over gRPC: the aggregated service and the per-type services, SotW and incremental (delta).

This layer only moves bytes. Each stream pairs a :class:`~pilotfish.protocol.SotwStream` or a
:class:`~pilotfish.protocol.DeltaStream` (what the stream has seen) with watches on the
:class:`~pilotfish.cache.SnapshotCache` (what exists). A request is parsed and fed to the state
machine as it arrives, and the watches it asks for are opened; a response the cache hands back is
written at once (the cache hands them over in ADS order). Responses are shared pre-encoded bytes
(a delta answer is shared by the streams that are known to have the same); a stream appends only
its nonce. Everything runs in the
callbacks of pilotfish's own gRPC transport (:mod:`pilotfish.transport.aio`): an idle stream
is this object and its watches, with no task or coroutine.

A request a peer should not have sent ends its stream, never the server: a protocol error with
INVALID_ARGUMENT, a request over :class:`~pilotfish.protocol.XdsLimits` with RESOURCE_EXHAUSTED,
each with a short message (a peer's values are repeated shortened), a ``stream_closed`` event
and a warning logged at most once per :data:`WARN_EVERY` seconds (with how many were not).

SDS secrets go only to the proxies they are granted to (:mod:`pilotfish.policy.grants`): before an
SDS watch reaches the cache, the names the stream's proxy (its certificate identity, its node id)
is not granted are taken out of its subscription, and a wildcard is dropped. So the cache never
produces an ungranted secret for that stream, responses stay shared between streams with the same
granted set, and the proxy waits for a denied secret as for one that does not exist. New grants
(:meth:`XdsServer.set_grants`, an edited grants file) are applied to every open stream's SDS
watch at once: a proxy waiting for a secret it is now granted receives it without asking again.
Each denied
name is recorded once per stream (a ``secret_denied`` event, up to :data:`MAX_DENIED_RECORDED`
names) and warned about at most once per :data:`WARN_EVERY` seconds.
"""

from __future__ import annotations

import itertools
import logging
import ssl
from collections.abc import Callable
from typing import Any, Generic, NoReturn, TypeVar

from envoy.config.core.v3 import base_pb2
from envoy.service.discovery.v3 import discovery_pb2
from google.protobuf.message import DecodeError

from pilotfish.build.subsetting import ProxyIndexer, ProxyIndices
from pilotfish.cache import DEFAULT_GROUP, Cancel, NodeGroup, SnapshotCache
from pilotfish.errors import PeerError
from pilotfish.events import EventLog
from pilotfish.policy.grants import ProxyGrants, SecretGrants
from pilotfish.protocol import (
    DEFAULT_LIMITS,
    WILDCARD,
    DeltaKind,
    DeltaStream,
    DeltaWatch,
    PeerOverLimit,
    RequestKind,
    SotwStream,
    Subscription,
    Watch,
    XdsLimits,
    next_subscription,
)
from pilotfish.protocol.limits import shorten
from pilotfish.resources import CLUSTER, ENDPOINT, LISTENER, ROUTE, SECRET, TypeUrl
from pilotfish.resources.wire import nonce_field
from pilotfish.snapshot import DeltaChanges, EncodedResponse
from pilotfish.status import NodeInfo, SyncStatus
from pilotfish.transport.aio import (
    WARN_EVERY,
    Call,
    ConnectionLimits,
    GrpcServer,
    MethodFactory,
    RateLimitedLog,
    RpcError,
)
from pilotfish.transport.frames import GrpcStatus

__all__ = ["MAX_DENIED_RECORDED", "WARN_EVERY", "XdsLimits", "XdsServer", "node_info", "start_xds_server"]

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


_DELTA_METHODS: tuple[tuple[str, str, TypeUrl | None], ...] = (
    ("envoy.service.discovery.v3.AggregatedDiscoveryService", "DeltaAggregatedResources", None),
    ("envoy.service.cluster.v3.ClusterDiscoveryService", "DeltaClusters", CLUSTER.url),
    ("envoy.service.endpoint.v3.EndpointDiscoveryService", "DeltaEndpoints", ENDPOINT.url),
    ("envoy.service.listener.v3.ListenerDiscoveryService", "DeltaListeners", LISTENER.url),
    ("envoy.service.route.v3.RouteDiscoveryService", "DeltaRoutes", ROUTE.url),
    ("envoy.service.secret.v3.SecretDiscoveryService", "DeltaSecrets", SECRET.url),
)


_W = TypeVar("_W")
_R = TypeVar("_R")
_Watch = TypeVar("_Watch", Watch, DeltaWatch)


def _default_group(node: base_pb2.Node) -> NodeGroup:
    return DEFAULT_GROUP


def node_info(node: base_pb2.Node, *, address: str, group: str, protocol: str) -> NodeInfo:
    """What the status keeps of a node (shortened there): cluster, user agent and its version."""
    version = node.user_agent_version
    if not version and node.HasField("user_agent_build_version"):
        semver = node.user_agent_build_version.version
        version = f"{semver.major_number}.{semver.minor_number}.{semver.patch}"
    return NodeInfo(cluster=node.cluster, user_agent=node.user_agent_name, user_agent_version=version,
                    address=address, group=group, protocol=protocol)


MAX_DENIED_RECORDED = 100
"""Distinct denied secret names a stream records as ``secret_denied`` events; a peer cycling
through made-up names gets no more events (it is still denied every one)."""
_DENIED_SHOWN = 10
"""Denied names a warning repeats."""
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
        grants: SecretGrants | None = None,
        limits: XdsLimits = DEFAULT_LIMITS,
        proxy_indices: ProxyIndexer | None = None,
    ) -> None:
        self.cache = cache
        self.proxy_indices: ProxyIndexer = proxy_indices if proxy_indices is not None else ProxyIndices()
        """Each connected proxy's subsetting index (by node id): which subset of a subsetted
        service's endpoints it gets."""
        self.events = events or EventLog()
        self.status = status if status is not None else SyncStatus()  # (an empty one is falsy)
        self.limits = limits
        self._group_of = group_of
        self.authorize = authorize
        """(identity, node id) -> why the claim is refused, or None (see :mod:`pilotfish.policy.authorize`)."""
        self.grants = grants if grants is not None else SecretGrants()
        """Which proxies may receive which secrets; none by default (fail closed). Checked at every
        SDS request: a replacement takes effect at each stream's next one (:meth:`set_grants`: at once)."""
        self._warnings = RateLimitedLog(_log, what="such streams")
        """A peer that breaks the rules in a loop must not fill the log (the event log has a
        ``stream_closed`` line per stream)."""
        self._denials = RateLimitedLog(_log, what="such requests for secrets")
        self._stream_ids = itertools.count(1)
        self.open_streams = 0
        self._by_node: dict[str, set[_Stream[Any]]] = {}
        """Open streams by node id (to end them when the node's subsetting index moved)."""

    def refresh_endpoints(self, node: str) -> None:
        """``node``'s subsetting index changed: answer its streams' endpoint watches again (its
        own endpoints are looked up anew, so it is sent its new subset on the same stream)."""
        for stream in list(self._by_node.get(node, ())):
            stream.rewatch(ENDPOINT.url)

    def set_grants(self, grants: SecretGrants) -> None:
        """Serve under ``grants`` from now on: every open stream's SDS watch is opened again with
        what the new grants let its proxy have (a secret newly granted is sent at once; one no
        longer granted gets no later version)."""
        self.grants = grants
        for streams in list(self._by_node.values()):
            for stream in list(streams):
                stream.regrant()

    def methods(self) -> dict[str, MethodFactory]:
        """``{path: factory}`` for every xDS method pilotfish serves, SotW and delta."""
        def factory(kind: type[_Stream[Any]], type_url: TypeUrl | None) -> MethodFactory:
            return lambda call: kind(self, call, type_url)  # type: ignore[return-value]  # a Handler

        methods = {f"/{service}/{method}": factory(_SotwConnection, type_url)
                   for service, method, type_url in _SOTW_METHODS}
        methods.update((f"/{service}/{method}", factory(_DeltaConnection, type_url))
                       for service, method, type_url in _DELTA_METHODS)
        return methods


class _Stream(Generic[_Watch]):
    """What SotW and delta streams share: the call, the proxy's node and group, the watches, the
    refusals, the secrets granted, the NACK warnings and the end."""

    __slots__ = ("_asked_secrets", "_call", "_cancels", "_current", "_denied", "_grants", "_last_nack", "_server",
                 "closed", "group", "id", "node_id", "opened", "type_url")

    service = "ads"
    """How ``stream_open`` names an aggregated stream of this kind."""
    protocol = "sotw"
    """How the status names its variant of xDS."""

    def __init__(self, server: XdsServer, call: Call, type_url: TypeUrl | None) -> None:
        self._server = server
        self._call = call
        self.type_url = type_url
        self.id = next(server._stream_ids)
        self.node_id = ""
        self.group = DEFAULT_GROUP
        self.closed = False
        self.opened = False
        """The first request (with the node) has been taken."""
        self._cancels: dict[TypeUrl, Cancel] = {}
        self._current: dict[TypeUrl, _Watch] = {}
        """The newest watch per type: a response to an older one is dropped unsent."""
        self._asked_secrets: _Watch | None = None
        """The newest SDS watch as the proxy asked for it (before grants): for :meth:`regrant`."""
        self._last_nack: tuple[TypeUrl, str | None] | None = None
        """The type and version of the last NACK warned about: a repeated one is not warned again."""
        self._grants: tuple[SecretGrants, ProxyGrants] | None = None
        """The server's grants, and what of them is this stream's proxy's (its node id and identity
        do not change)."""
        self._denied: set[str] = set()
        """Secret names denied on this stream so far (recorded once each, up to a bound)."""
        server.open_streams += 1

    # -- the call's callbacks -------------------------------------------------------------------

    def on_half_close(self) -> None:
        self._close("closed by client")

    def on_closed(self, reason: str) -> None:
        self._close(reason)

    def _refuse(self, code: int, message: str) -> NoReturn:
        """End the stream with ``code``: the peer broke the protocol or a limit."""
        message = shorten(message, _MESSAGE_CHARS)
        what = "over a limit" if code == GrpcStatus.RESOURCE_EXHAUSTED else "protocol error"
        self._server._warnings.log("stream %d from %s (node %r) ended, %s: %s", self.id, self._call.peer,
                                    shorten(self.node_id, 200), what, message)
        self._close(f"{what}: {message}")
        raise RpcError(code, message)

    # -- the first request ------------------------------------------------------------------------

    def _authorize(self, node_id: str) -> None:
        """Refuse the stream (PERMISSION_DENIED) if the proxy's certificate may not claim ``node_id``."""
        server = self._server
        if server.authorize is None:
            return
        refusal = server.authorize(self._call.peer_identity, node_id)
        if refusal is not None:
            server.events.emit("node_refused", stream=self.id, identity=self._call.peer_identity,
                               peer=self._call.peer, reason=refusal)
            _log.warning("%s: %s", self._call.peer, refusal)
            self._close(f"permission denied: {refusal}")
            raise RpcError(GrpcStatus.PERMISSION_DENIED, refusal)

    def _open(self, node: base_pb2.Node) -> None:
        """The stream's proxy is known: its group, its status, the ``stream_open`` event."""
        server = self._server
        self.opened = True
        self.node_id = node.id
        self.group = server._group_of(node)
        server.proxy_indices.acquire(self.node_id)  # (its index is looked up when its endpoints are answered)
        server._by_node.setdefault(self.node_id, set()).add(self)
        server.status.stream_opened(self.node_id, node_info(node, address=self._call.peer, group=self.group,
                                                              protocol=self.protocol))
        identity = self._call.peer_identity  # from the client's certificate (mTLS), else ""
        server.events.emit("stream_open", stream=self.id, node=self.node_id, peer=self._call.peer,
                           service=self.service if self.type_url is None else self.type_url, group=self.group,
                           **({"identity": identity} if identity else {}))

    def _record_nack(self, type_url: TypeUrl, version: str | None, error: str | None) -> None:
        self._server.status.nacked(self.node_id, type_url, version, error or "")
        nack = (type_url, version)
        if nack != self._last_nack:  # a peer repeating its NACK does not fill the log
            self._last_nack = nack
            _log.warning("%s rejected %s version %s: %s", self.node_id or f"stream {self.id}",
                         type_url.rsplit(".", 1)[-1], version, error)

    def _replace_watch(self, type_url: TypeUrl, create: Callable[[_W, Callable[[_W, _R], None], NodeGroup], Cancel],
                       watch: _W, respond: Callable[[_W, _R], None]) -> None:
        """Cancel the stream's watch of ``type_url`` and open ``watch`` in its place (the cache
        may answer it at once, through ``respond``)."""
        previous = self._cancels.pop(type_url, None)
        if previous is not None:
            previous()
        self._cancels[type_url] = create(watch, respond, self.group)

    # -- secrets ----------------------------------------------------------------------------------

    def _proxy_grants(self) -> ProxyGrants:
        server_grants = self._server.grants
        if self._grants is None or self._grants[0] is not server_grants:
            self._grants = (server_grants, server_grants.for_proxy(identity=self._call.peer_identity,
                                                                   node_id=self.node_id))
        return self._grants[1]

    def _record_denied(self, names: list[str]) -> None:
        server, identity = self._server, self._call.peer_identity
        for name in names:
            if len(self._denied) >= MAX_DENIED_RECORDED:
                break
            if name in self._denied:
                continue
            self._denied.add(name)
            server.events.emit("secret_denied", stream=self.id, node=self.node_id, identity=identity,
                               peer=self._call.peer, secret=name)
        shown = shorten(", ".join(names[:_DENIED_SHOWN]), 400)
        if len(names) > _DENIED_SHOWN:
            shown += f" and {len(names) - _DENIED_SHOWN:,} more"
        server._denials.log("node %r (identity %r, %s) asked for secrets not granted to it, not sent: %s",
                             shorten(self.node_id, 200), identity, self._call.peer, shown)

    # -- the end ----------------------------------------------------------------------------------

    def rewatch(self, type_url: TypeUrl) -> None:
        """Open the stream's latest watch of ``type_url`` again (the cache looks at it anew)."""
        raise NotImplementedError

    def _granted_only(self, watch: _Watch) -> _Watch:
        """``watch`` asking only for the secrets granted to this stream's proxy (no wildcard)."""
        raise NotImplementedError

    def regrant(self) -> None:
        """The server's grants changed: open the stream's SDS watch again, with what its proxy
        last asked for filtered by them (unless that leaves the same names)."""
        asked = self._asked_secrets
        if asked is None or self.closed:
            return
        watch = self._granted_only(asked)
        if watch != self._current.get(SECRET.url):
            self._current[SECRET.url] = watch
            self.rewatch(SECRET.url)

    def _forget_watches(self) -> None:
        """Drop what the stream waits for (subclasses drop their own state too)."""
        for cancel in self._cancels.values():
            cancel()
        self._cancels.clear()
        self._current.clear()
        self._asked_secrets = None

    def _close(self, reason: str) -> None:
        if self.closed:
            return
        self.closed = True
        server = self._server
        server.open_streams -= 1
        self._forget_watches()
        if self.opened:
            server.status.stream_closed(self.node_id)
            server.proxy_indices.release(self.node_id)
            streams = server._by_node.get(self.node_id)
            if streams is not None:
                streams.discard(self)
                if not streams:
                    del server._by_node[self.node_id]
        server.events.emit("stream_closed", stream=self.id, node=self.node_id, reason=reason)


class _SotwConnection(_Stream[Watch]):
    """One SotW stream, driven by its call's callbacks: a request is handled as it arrives, and
    the cache's responses are written as it hands them over."""

    __slots__ = ("_granted", "state")

    def __init__(self, server: XdsServer, call: Call, type_url: TypeUrl | None) -> None:
        super().__init__(server, call, type_url)
        self.state = SotwStream(type_url=type_url, limits=server.limits)
        self._granted: tuple[ProxyGrants, Subscription, Subscription] | None = None
        """The last SDS subscription asked for and what of it is granted (under those grants)."""

    def on_message(self, data: bytes) -> None:
        if self.closed:
            return
        try:
            self._on_request(data)
        except PeerOverLimit as exc:
            self._refuse(GrpcStatus.RESOURCE_EXHAUSTED, str(exc))
        except PeerError as exc:
            self._refuse(GrpcStatus.INVALID_ARGUMENT, str(exc))

    def _on_request(self, data: bytes) -> None:
        server, state = self._server, self.state
        decoded = state.decode_request(data)
        request = decoded.request
        first = state.node is None
        if first:
            self._authorize(request.node.id)
        outcome = state.on_request(request, names_wire=decoded.names_wire, names_as_before=decoded.names_as_before)
        if first:
            assert state.node is not None
            self._open(state.node)
        kind = outcome.kind
        if kind is RequestKind.NACK or server.events.conversation:
            # Names only when they say something new: an ACK repeats the names it subscribed to.
            names = None
            if kind is not RequestKind.ACK or outcome.subscription_changed:
                # (Left undecoded if they were the previous request's: decoded for the record.)
                names = list((discovery_pb2.DiscoveryRequest.FromString(data) if decoded.names_as_before
                              else request).resource_names)
            server.events.emit(
                "stale" if kind is RequestKind.STALE else kind.value,
                stream=self.id, node=self.node_id, type=outcome.type_url,
                version_info=outcome.version_info, response_nonce=outcome.response_nonce,
                error=outcome.error, **({"resource_names": names} if names is not None else {}),
            )
        if kind is RequestKind.ACK:
            server.status.acked(self.node_id, outcome.type_url, outcome.version_info)
        elif kind is RequestKind.NACK:
            self._record_nack(outcome.type_url, outcome.rejected_version, outcome.error)
        for watch in outcome.watches:
            if watch.type_url == SECRET.url:
                self._asked_secrets = watch
                watch = self._granted_only(watch)
            elif watch.type_url == ENDPOINT.url:
                watch = watch._replace(proxy=self.node_id)
            self._current[watch.type_url] = watch
            self._replace_watch(watch.type_url, server.cache.create_watch, watch, self._send)

    def rewatch(self, type_url: TypeUrl) -> None:
        """Open the stream's latest watch of ``type_url`` again (the cache looks at it anew)."""
        watch = self._current.get(type_url)
        if watch is not None and not self.closed:
            self._replace_watch(type_url, self._server.cache.create_watch, watch, self._send)

    def _granted_only(self, watch: Watch) -> Watch:
        """``watch`` asking only for the secrets granted to this stream's proxy (no wildcard)."""
        subscription = watch.subscription
        grants = self._proxy_grants()
        memo = self._granted
        if memo is not None and memo[0] is grants and memo[1] is subscription:
            granted = memo[2]
        else:
            names, denied = grants.split(subscription.names)
            if len(denied) <= MAX_DENIED_RECORDED:
                denied.sort()  # events in a stable order (when there are many, which are recorded is moot)
            if subscription.wildcard:
                denied.append(WILDCARD)
            granted = subscription if not denied else next_subscription(
                names, wildcard_capable=False, ever_named=True)
            self._granted = (grants, subscription, granted)
            if denied:
                self._record_denied(denied)
        return watch if granted is subscription else watch._replace(subscription=granted)

    def _send(self, watch: Watch, response: EncodedResponse) -> None:
        """The cache's callback: write the response now (the transport queues what flow control
        holds back), unless a newer request superseded the watch it answers."""
        if self.closed or self._current.get(response.type_url) is not watch:
            return
        server = self._server
        nonce, response = self.state.on_response(watch, response)
        self._call.send(response.body, nonce_field(nonce))
        server.status.sent(self.node_id, response.type_url, response.version)
        if server.events.conversation:
            server.events.emit("sent", stream=self.id, node=self.node_id, type=response.type_url,
                               version=response.version, nonce=nonce, resources=response.carried)


class _DeltaConnection(_Stream[DeltaWatch]):
    """One incremental (delta) stream: as a SotW one, with :class:`~pilotfish.protocol.DeltaStream`
    deciding and the cache answering with what the client lacks."""

    __slots__ = ("state",)

    service = "delta-ads"
    protocol = "delta"

    def __init__(self, server: XdsServer, call: Call, type_url: TypeUrl | None) -> None:
        super().__init__(server, call, type_url)
        self.state = DeltaStream(type_url=type_url, limits=server.limits)

    def on_message(self, data: bytes) -> None:
        if self.closed:
            return
        try:
            request = discovery_pb2.DeltaDiscoveryRequest.FromString(data)
        except DecodeError as exc:
            self._refuse(GrpcStatus.INVALID_ARGUMENT, f"undecodable DeltaDiscoveryRequest: {exc}")
        try:
            self._on_request(request)
        except PeerOverLimit as exc:
            self._refuse(GrpcStatus.RESOURCE_EXHAUSTED, str(exc))
        except PeerError as exc:
            self._refuse(GrpcStatus.INVALID_ARGUMENT, str(exc))

    def _on_request(self, request: discovery_pb2.DeltaDiscoveryRequest) -> None:
        server, state = self._server, self.state
        first = state.node is None
        if first:
            self._authorize(request.node.id)
        outcome = state.on_request(request)
        if first:
            assert state.node is not None
            self._open(state.node)
        kind = outcome.kind
        if kind is DeltaKind.NACK or server.events.conversation:
            changes: dict[str, object] = {}
            if outcome.subscribed:
                changes["subscribe"] = list(outcome.subscribed)
            if outcome.unsubscribed:
                changes["unsubscribe"] = list(outcome.unsubscribed)
            if request.initial_resource_versions:
                changes["initial_resources"] = len(request.initial_resource_versions)
            server.events.emit(kind.value, stream=self.id, node=self.node_id, type=outcome.type_url, delta=True,
                               version=outcome.version, response_nonce=outcome.response_nonce,
                               error=outcome.error, **changes)
        if kind is DeltaKind.ACK:
            server.status.acked(self.node_id, outcome.type_url, outcome.version or "")
        elif kind is DeltaKind.NACK:
            self._record_nack(outcome.type_url, outcome.version, outcome.error)
        for watch in outcome.watches:
            if watch.type_url == SECRET.url:
                self._asked_secrets = watch
                watch = self._granted_only(watch)
            elif watch.type_url == ENDPOINT.url:
                watch = watch._replace(proxy=self.node_id)
            self._current[watch.type_url] = watch
            self._replace_watch(watch.type_url, server.cache.create_delta_watch, watch, self._send)

    def rewatch(self, type_url: TypeUrl) -> None:
        """Open the stream's latest watch of ``type_url`` again (the cache looks at it anew)."""
        watch = self._current.get(type_url)
        if watch is not None and not self.closed:
            self._replace_watch(type_url, self._server.cache.create_delta_watch, watch, self._send)

    def _granted_only(self, watch: DeltaWatch) -> DeltaWatch:
        """``watch`` asking only for the secrets granted to this stream's proxy (no wildcard)."""
        names, denied = self._proxy_grants().split(watch.names)
        if watch.wildcard:
            denied.append(WILDCARD)
        if not denied:
            return watch
        denied = [name for name in denied if name not in self._denied]
        if denied:
            if len(denied) <= MAX_DENIED_RECORDED:
                denied.sort()
            self._record_denied(denied)
        granted = next_subscription(names, wildcard_capable=False, ever_named=True).names
        return watch._replace(wildcard=False, names=granted)

    def _send(self, watch: DeltaWatch, changes: DeltaChanges) -> None:
        """The cache's callback: write what the client lacks, unless a newer request superseded
        the watch."""
        if self.closed or self._current.get(changes.type_url) is not watch:
            return
        server = self._server
        nonce, again = self.state.on_response(watch, changes)
        self._call.send(changes.body, nonce_field(nonce))
        server.status.sent(self.node_id, changes.type_url, changes.version)
        if server.events.conversation:
            server.events.emit("sent", stream=self.id, node=self.node_id, type=changes.type_url, delta=True,
                               version=changes.version, nonce=nonce, resources=len(changes.sent),
                               names=list(changes.sent), removed=list(changes.removed))
        for due in again:  # warming: what the clusters (listeners) just sent wait for, now
            self._current[due.type_url] = due
            self._replace_watch(due.type_url, server.cache.create_delta_watch, due, self._send)


async def start_xds_server(xds: XdsServer, address: str, *, tls: ssl.SSLContext | None = None,
                           connection_limits: ConnectionLimits | None = None) -> tuple[GrpcServer, int]:
    """Serve ``xds`` on ``address`` (``host:port``; port 0 = any free), over TLS when ``tls`` is
    given, holding connections within ``connection_limits``; returns (server, port)."""
    host, _, port = address.rpartition(":")
    server = GrpcServer(xds.methods(), connection_limits=connection_limits)
    bound = await server.start(host.strip("[]"), int(port), tls=tls)
    return server, bound
