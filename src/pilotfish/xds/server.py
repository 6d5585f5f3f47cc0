"""xDS over gRPC: the aggregated service and the per-type services, SotW and incremental (delta).

This layer only moves bytes. Each stream pairs a :class:`~pilotfish.protocol.SotwStream` or a
:class:`~pilotfish.protocol.DeltaStream` (what the stream has seen) with watches on the cache
(what exists), seen through the narrow :class:`~pilotfish.cache.ConfigWatcher` (create a watch,
cancel it): the :class:`~pilotfish.cache.SnapshotCache`, or anything else that answers watches.
A request is parsed and fed to the state machine as it arrives, and the watches it asks for are
opened; a response the cache hands back is written at once (the cache hands them over in ADS
order). Responses are shared pre-encoded bytes (a delta answer is shared by the streams that are
known to have the same); a stream appends only its nonce. Everything runs in the callbacks of
pilotfish's own gRPC transport (:mod:`pilotfish.transport.aio`): an idle stream is this object and
its watches, with no task or coroutine.

One stream core (``_Stream``) serves both variants: the call's callbacks, the first request (the
node claim checked, the group, the ``stream_open`` record), the ACK and NACK records, the watches
opened (secrets filtered by the grants, endpoints per proxy), the refusals and the end. A variant
says only how its requests are decoded and fed to its state machine, what is recorded of a request
and a response, and what of a secrets watch is granted.

What the gRPC services share with REST xDS is one :class:`XdsPolicy`: node authorization, the
secret grants in force (:class:`GrantsInForce`), the request limits, the subsetting indices, the
status and the event log.

A request a peer should not have sent ends its stream, never the server: a protocol error with
INVALID_ARGUMENT, a request over :class:`~pilotfish.protocol.XdsLimits` with RESOURCE_EXHAUSTED,
each with a short message (a peer's values are repeated shortened), a ``stream_closed`` event
and a warning logged at most once per :data:`WARN_EVERY` seconds (with how many were not).

SDS secrets go only to the proxies they are granted to (:mod:`pilotfish.policy.grants`): before an
SDS watch reaches the cache, the names the stream's proxy (its certificate identity, its node id)
is not granted are taken out of its subscription, and a wildcard is dropped. So the cache never
produces an ungranted secret for that stream, responses stay shared between streams with the same
granted set, and the proxy waits for a denied secret as for one that does not exist. New grants
(:meth:`XdsPolicy.set_grants`, an edited grants file) are applied to every open stream's SDS
watch at once: a proxy waiting for a secret it is now granted receives it without asking again.
Each denied
name is recorded once per stream (a ``secret_denied`` event, up to :data:`MAX_DENIED_RECORDED`
names) and warned about at most once per :data:`WARN_EVERY` seconds.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import ssl
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, NoReturn, Protocol, TypeVar

from envoy.config.core.v3 import base_pb2
from envoy.service.discovery.v3 import discovery_pb2

from pilotfish.build.subsetting import ProxyIndexer, ProxyIndices
from pilotfish.cache import DEFAULT_GROUP, Cancel, ConfigWatcher, NodeGroup, WatchRouting
from pilotfish.errors import PeerError
from pilotfish.events import EventLog
from pilotfish.policy.grants import ProxyGrants, SecretGrants
from pilotfish.protocol import (
    DEFAULT_LIMITS,
    WILDCARD,
    DeltaKind,
    DeltaOutcome,
    DeltaStream,
    DeltaWatch,
    PeerOverLimit,
    RequestKind,
    RequestOutcome,
    ResourceState,
    SotwStream,
    Subscription,
    Watch,
    XdsLimits,
    next_subscription,
)
from pilotfish.protocol.delta import DecodedDeltaRequest
from pilotfish.protocol.limits import shorten
from pilotfish.protocol.sotw import DecodedRequest
from pilotfish.resources import (
    ADS_ORDER,
    CLUSTER,
    ENDPOINT,
    EXTENSION_CONFIG,
    LISTENER,
    ROUTE,
    RUNTIME,
    SECRET,
    TypeUrl,
)
from pilotfish.resources.wire import nonce_field, response_names
from pilotfish.snapshot import DeltaChanges, EncodedResponse, TypeSnapshot
from pilotfish.status import NodeInfo, SyncStatus, nack_summary
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
from pilotfish.xds.heartbeats import Heartbeats

__all__ = [
    "MAX_DENIED_RECORDED",
    "WARN_EVERY",
    "GrantsInForce",
    "XdsLimits",
    "XdsPolicy",
    "XdsServer",
    "node_info",
    "start_xds_server",
]

_log = logging.getLogger("pilotfish.server")

_SERVICES: tuple[tuple[str, str, TypeUrl | None], ...] = (
    ("envoy.service.discovery.v3.AggregatedDiscoveryService", "AggregatedResources", None),
    ("envoy.service.cluster.v3.ClusterDiscoveryService", "Clusters", CLUSTER.url),
    ("envoy.service.endpoint.v3.EndpointDiscoveryService", "Endpoints", ENDPOINT.url),
    ("envoy.service.listener.v3.ListenerDiscoveryService", "Listeners", LISTENER.url),
    ("envoy.service.route.v3.RouteDiscoveryService", "Routes", ROUTE.url),
    ("envoy.service.secret.v3.SecretDiscoveryService", "Secrets", SECRET.url),
    ("envoy.service.runtime.v3.RuntimeDiscoveryService", "Runtime", RUNTIME.url),
    ("envoy.service.extension.v3.ExtensionConfigDiscoveryService", "ExtensionConfigs", EXTENSION_CONFIG.url),
)
"""(service, what its methods serve, type served; None = any, i.e. aggregated): each has a SotW
method ``Stream<what>`` and a delta one ``Delta<what>``."""


_Watch = TypeVar("_Watch", Watch, DeltaWatch)
_Decoded = TypeVar("_Decoded")
"""A request as the variant decoded it."""
_Answer = TypeVar("_Answer", EncodedResponse, DeltaChanges)
"""What the cache answers a watch of the variant with."""


def _default_group(node: base_pb2.Node) -> NodeGroup:
    return DEFAULT_GROUP


def _arm_timer(due: float, run: Callable[[], object]) -> Callable[[], object]:
    """A timer on the running event loop that calls ``run`` at ``due`` (``time.monotonic``)."""
    return asyncio.get_running_loop().call_later(max(0.0, due - time.monotonic()), run).cancel


def node_info(node: base_pb2.Node, *, address: str, group: str, protocol: str) -> NodeInfo:
    """What the status keeps of a node (shortened there): cluster, user agent and its version."""
    version = node.user_agent_version
    if not version and node.HasField("user_agent_build_version"):
        semver = node.user_agent_build_version.version
        version = f"{semver.major_number}.{semver.minor_number}.{semver.patch}"
    return NodeInfo(
        cluster=node.cluster,
        user_agent=node.user_agent_name,
        user_agent_version=version,
        address=address,
        group=group,
        protocol=protocol,
    )


MAX_DENIED_RECORDED = 100
"""Distinct denied secret names a stream records as ``secret_denied`` events; a peer cycling
through made-up names gets no more events (it is still denied every one)."""
_NACK_NAMES = 16
"""A NACK whose message names no resource is shown after the names of the resources of the
response it rejects, when that response carried at most this many (EDS, RDS and SDS responses
carry what changed: usually one or a few)."""
_DENIED_SHOWN = 10
"""Denied names a warning repeats."""
_MESSAGE_CHARS = 1024
"""A gRPC status message is at most about this long (the limits' messages are shorter)."""


class GrantsInForce:
    """The SDS grants in force, one for every service of an :class:`XdsPolicy`: read at every SDS
    request and REST poll, replaced (:meth:`XdsPolicy.set_grants`) when the grants file changes.
    Those who follow it (the gRPC server, :meth:`follow`) are told of each replacement."""

    __slots__ = ("_followers", "value")

    def __init__(self, grants: SecretGrants | None = None) -> None:
        self.value = grants if grants is not None else SecretGrants()
        """Which proxies may receive which secrets; none by default (fail closed)."""
        self._followers: list[Callable[[], None]] = []

    def follow(self, on_change: Callable[[], None]) -> None:
        """Call ``on_change`` after every :meth:`replace`."""
        self._followers.append(on_change)

    def replace(self, grants: SecretGrants) -> None:
        """Serve under ``grants`` from now on, and tell the followers."""
        self.value = grants
        for on_change in list(self._followers):
            on_change()


@dataclass(frozen=True, slots=True, kw_only=True)
class XdsPolicy:
    """What the gRPC services (:class:`XdsServer`) and REST xDS (:class:`~pilotfish.xds.rest.RestXds`)
    share: who may claim which node, who may get which secrets, the limits on a peer's requests,
    the subsetting indices, and where the conversation is recorded. One object, made once
    (``serve``) and given to both, so a change of grants is made in one place. Not in it: which
    group's snapshot answers a node, which each service is given (REST answers from the groups of
    kind rest)."""

    events: EventLog = field(default_factory=EventLog)
    """Where the conversation is recorded (``stream_open``, ACKs, NACKs, refusals...)."""
    status: SyncStatus = field(default_factory=SyncStatus)
    """What each proxy was sent, ACKed and NACKed."""
    authorize: Callable[[str, str], str | None] | None = None
    """(identity, node id) -> why the claim is refused, or None (see :mod:`pilotfish.policy.authorize`);
    None: any claim is taken."""
    grants: GrantsInForce = field(default_factory=GrantsInForce)
    """Which proxies may receive which secrets (none by default: fail closed). Checked at every SDS
    request and poll; :meth:`set_grants` replaces them and opens every stream's SDS watch again."""
    limits: XdsLimits = DEFAULT_LIMITS
    """What a peer's request may hold (node id, names, types...)."""
    proxy_indices: ProxyIndexer = field(default_factory=ProxyIndices)
    """Each connected proxy's subsetting index (by node id): which subset of a subsetted service's
    endpoints it gets. A stream holds its proxy's index while open; a poll touches it (kept the
    grace period between polls)."""

    def set_grants(self, grants: SecretGrants) -> None:
        """Serve under ``grants`` from now on, over gRPC and REST: every open stream's SDS watch is
        opened again with what the new grants let its proxy have (a secret newly granted is sent at
        once; one no longer granted gets no later version), and the next poll is answered by them."""
        self.grants.replace(grants)


class XdsServer:
    """Serves the cache's snapshots to xDS streams and records the conversation."""

    def __init__(
        self,
        cache: ConfigWatcher,
        policy: XdsPolicy | None = None,
        *,
        group_of: Callable[[base_pb2.Node], NodeGroup] = _default_group,
        routing: WatchRouting | None = None,
        heartbeats: Heartbeats | None = None,
    ) -> None:
        self.cache = cache
        self.policy = policy if policy is not None else XdsPolicy()
        self._group_of = group_of
        """A stream's node -> the group whose snapshot answers it."""
        self._route = routing.route if routing is not None else None
        """(node id, its group) -> the cache group that answers its watches now (a rollout's
        baseline or candidate); None: its group."""
        if routing is not None:
            routing.follow(self.reroute)
        self._warnings = RateLimitedLog(_log, what="such streams")
        """A peer that breaks the rules in a loop must not fill the log (the event log has a
        ``stream_closed`` line per stream)."""
        self._denials = RateLimitedLog(_log, what="such requests for secrets")
        self.nack_log = RateLimitedLog(_log, what="NACKs (each is in the event log and the status)")
        """One line per NACK (the resource's name and Envoy's reason), not a fleet's worth at once."""
        self._stream_ids = itertools.count(1)
        self.open_streams = 0
        self._by_node: dict[str, set[_Stream[Any, Any, Any]]] = {}
        """Open streams by node id (to end them when the node's subsetting index moved)."""
        self.policy.grants.follow(self._regrant)
        self.heartbeats = heartbeats if heartbeats is not None else Heartbeats(clock=time.monotonic, arm=_arm_timer)
        """Renews the TTLs the streams hold (:mod:`pilotfish.xds.heartbeats`)."""

    def refresh_endpoints(self, node: str) -> None:
        """``node``'s subsetting index changed: answer its streams' endpoint watches again (its
        own endpoints are looked up anew, so it is sent its new subset on the same stream)."""
        for stream in list(self._by_node.get(node, ())):
            stream.rewatch(ENDPOINT.url)

    def reroute(self, nodes: Iterable[str]) -> None:
        """The routing answers otherwise for ``nodes``: their streams open every watch again."""
        for node in nodes:
            for stream in list(self._by_node.get(node, ())):
                stream.rewatch_all()

    def _regrant(self) -> None:
        """The policy's grants were replaced: every open stream opens its SDS watch again."""
        for streams in list(self._by_node.values()):
            for stream in list(streams):
                stream.regrant()

    def resource_states(self, node_id: str) -> dict[str, list[ResourceState]] | None:
        """What ``node_id`` has of each resource it asked for, by type, as its open streams know
        it (:meth:`~pilotfish.protocol.SotwStream.resource_states`); None if it has no open
        stream. With several streams (per-type services), each type from the newest that has it."""
        streams = self._by_node.get(node_id)
        if not streams:
            return None
        out: dict[str, list[ResourceState]] = {}
        for stream in sorted(streams, key=lambda s: s.id):
            for type_url in stream.state.types:
                found = stream.state.resource_states(type_url)
                if found or type_url not in out:
                    out[type_url] = found
        return out

    def methods(self) -> dict[str, MethodFactory]:
        """``{path: factory}`` for every xDS method pilotfish serves, SotW and delta."""

        def factory(kind: type[_SotwConnection | _DeltaConnection], type_url: TypeUrl | None) -> MethodFactory:
            return lambda call: kind(self, call, type_url)

        return {
            f"/{service}/{kind.method_prefix}{what}": factory(kind, type_url)
            for kind in (_SotwConnection, _DeltaConnection)
            for service, what, type_url in _SERVICES
        }


class _State(Protocol):
    """What the stream core reads of its state machine (:class:`~pilotfish.protocol.SotwStream`,
    :class:`~pilotfish.protocol.DeltaStream`)."""

    @property
    def node(self) -> base_pb2.Node | None: ...

    @property
    def types(self) -> Mapping[TypeUrl, object]: ...

    @property
    def ttl(self) -> bool: ...

    def resource_states(self, type_url: TypeUrl) -> list[ResourceState]: ...

    def on_refresh(self, type_url: TypeUrl) -> str | None: ...


class _Stream(Generic[_Watch, _Decoded, _Answer]):
    """The stream core, what SotW and delta streams share: the call's callbacks, the first request
    (the node claim checked, the group, the ``stream_open`` record), the request's record (ACK,
    NACK), its watches opened on the cache (secrets filtered by the grants, endpoints per proxy),
    the responses' record, the refusals and the end. A variant (:class:`_SotwConnection`,
    :class:`_DeltaConnection`) says how a request is decoded and fed to its state machine, how a
    request and a response are recorded, and what of a secrets watch is granted."""

    __slots__ = (
        "_asked_secrets",
        "_call",
        "_cancels",
        "_create",
        "_current",
        "_denied",
        "_grants",
        "_held",
        "_last_nack",
        "_server",
        "closed",
        "group",
        "id",
        "node_id",
        "opened",
        "type_url",
    )

    service = "ads"
    """How ``stream_open`` names an aggregated stream of this kind."""
    protocol = "sotw"
    """How the status names its variant of xDS."""
    method_prefix = "Stream"
    """Its methods' names: ``StreamClusters``... (see :data:`_SERVICES`)."""
    state: _State

    def __init__(
        self,
        server: XdsServer,
        call: Call,
        type_url: TypeUrl | None,
        create: Callable[[_Watch, Callable[[_Watch, _Answer], None], NodeGroup], Cancel],
    ) -> None:
        self._server = server
        self._call = call
        self.type_url = type_url
        self._create: Callable[[_Watch, Callable[[_Watch, _Answer], None], NodeGroup], Cancel] = create
        """The cache's ``create_watch`` of the variant."""
        self.id = next(server._stream_ids)
        self.node_id = ""
        self.group = DEFAULT_GROUP
        self.closed = False
        self.opened = False
        """The first request (with the node) has been taken."""
        self._cancels: dict[TypeUrl, Cancel] = {}
        self._current: dict[TypeUrl, _Watch] = {}
        """The newest watch per type: a response to an older one is dropped unsent."""
        self._held: dict[TypeUrl, _Watch] = {}
        """The watch per type that the cache holds open now (one it answered leaves)."""
        self._asked_secrets: _Watch | None = None
        """The newest SDS watch as the proxy asked for it (before grants): for :meth:`regrant`."""
        self._last_nack: tuple[TypeUrl, str | None] | None = None
        """The type and version of the last NACK warned about: a repeated one is not warned again."""
        self._grants: tuple[SecretGrants, ProxyGrants] | None = None
        """The policy's grants, and what of them is this stream's proxy's (its node id and identity
        do not change)."""
        self._denied: set[str] = set()
        """Secret names denied on this stream so far (recorded once each, up to a bound)."""
        server.open_streams += 1

    # -- the call's callbacks -------------------------------------------------------------------

    def on_message(self, data: bytes) -> None:
        if self.closed:
            return
        try:
            self._on_request(data)
        except PeerOverLimit as exc:
            self._refuse(GrpcStatus.RESOURCE_EXHAUSTED, str(exc))
        except PeerError as exc:
            self._refuse(GrpcStatus.INVALID_ARGUMENT, str(exc))

    def on_half_close(self) -> None:
        self._close("closed by client")

    def on_closed(self, reason: str) -> None:
        self._close(reason)

    def _refuse(self, code: int, message: str) -> NoReturn:
        """End the stream with ``code``: the peer broke the protocol or a limit."""
        message = shorten(message, _MESSAGE_CHARS)
        what = "over a limit" if code == GrpcStatus.RESOURCE_EXHAUSTED else "protocol error"
        self._server._warnings.log(
            "stream %d from %s (node %r) ended, %s: %s",
            self.id,
            self._call.peer,
            shorten(self.node_id, 200),
            what,
            message,
        )
        self._close(f"{what}: {message}")
        raise RpcError(code, message)

    # -- a request ------------------------------------------------------------------------------

    def _on_request(self, data: bytes) -> None:
        decoded = self._decode(data)
        first = self.state.node is None
        if first:
            self._authorize(self._node_id(decoded))
        outcome = self._step(decoded)
        if first:
            node = self.state.node
            assert node is not None
            self._open(node)
        for watch in self._record(data, decoded, outcome):
            self._watch(watch, again=watch.type_url != outcome.type_url)

    def _decode(self, data: bytes) -> _Decoded:
        """The request (raises :class:`PeerError` for one that does not decode)."""
        raise NotImplementedError

    def _node_id(self, decoded: _Decoded) -> str:
        raise NotImplementedError

    def _step(self, decoded: _Decoded) -> Any:
        """Feed the request to the state machine: its outcome."""
        raise NotImplementedError

    def _record(self, data: bytes, decoded: _Decoded, outcome: Any) -> Sequence[_Watch]:
        """Record the request (its event; an ACK or NACK through :meth:`_acked`, :meth:`_nacked`);
        the watches it asks for."""
        raise NotImplementedError

    def _authorize(self, node_id: str) -> None:
        """Refuse the stream (PERMISSION_DENIED) if the proxy's certificate may not claim ``node_id``."""
        policy = self._server.policy
        if policy.authorize is None:
            return
        refusal = policy.authorize(self._call.peer_identity, node_id)
        if refusal is not None:
            policy.events.emit(
                "node_refused", stream=self.id, identity=self._call.peer_identity, peer=self._call.peer, reason=refusal
            )
            _log.warning("%s: %s", self._call.peer, refusal)
            self._close(f"permission denied: {refusal}")
            raise RpcError(GrpcStatus.PERMISSION_DENIED, refusal)

    def _open(self, node: base_pb2.Node) -> None:
        """The stream's proxy is known: its group, its status, the ``stream_open`` event."""
        server, policy = self._server, self._server.policy
        self.opened = True
        self.node_id = node.id
        self.group = server._group_of(node)
        policy.proxy_indices.acquire(self.node_id)  # (its index is looked up when its endpoints are answered)
        server._by_node.setdefault(self.node_id, set()).add(self)
        policy.status.stream_opened(
            self.node_id, node_info(node, address=self._call.peer, group=self.group, protocol=self.protocol)
        )
        identity = self._call.peer_identity  # from the client's certificate (mTLS), else ""
        policy.events.emit(
            "stream_open",
            stream=self.id,
            node=self.node_id,
            peer=self._call.peer,
            service=self.service if self.type_url is None else self.type_url,
            group=self.group,
            **({"identity": identity} if identity else {}),
            **({"ttls": True} if self.state.ttl else {}),
        )

    def _acked(self, type_url: TypeUrl, version: str) -> None:
        self._server.policy.status.acked(self.node_id, type_url, version)

    def _rejected_body(self, type_url: TypeUrl) -> bytes | None:
        """The body of the response a NACK of ``type_url`` rejects, if known and small enough to
        name its resources (None: not known)."""
        return None

    def _named(self, type_url: TypeUrl, error: str) -> str:
        """Envoy's message, after the names of the rejected resources when it names none of them:
        an RDS NACK for an invalid regex says only ``missing ): ((``, not which route config."""
        body = self._rejected_body(type_url)
        if body is None:
            return error
        names, count = response_names(body, _NACK_NAMES)
        if not names or any(name in error for name in names):
            return error
        shown = ", ".join(repr(name) for name in names[:3])
        return f"{shown}{f' (and {count - 3} more)' if count > 3 else ''}: {error}"

    def _nacked(self, type_url: TypeUrl, version: str | None, error: str | None) -> None:
        error = self._named(type_url, error or "")
        self._server.policy.status.nacked(self.node_id, type_url, version, error)
        nack = (type_url, version)
        if nack != self._last_nack:  # a peer repeating its NACK does not fill the log
            self._last_nack = nack
            self._server.nack_log.log(
                "%s rejected %s version %s: %s",
                self.node_id or f"stream {self.id}",
                type_url.rsplit(".", 1)[-1],
                version,
                nack_summary(error or ""),
            )

    # -- watches --------------------------------------------------------------------------------

    def _watch(self, watch: _Watch, *, again: bool = False) -> None:
        """Open a watch the request asks for, in place of the stream's previous one of its type:
        a secrets watch only for what is granted, an endpoints watch for this proxy's own.

        A watch equal to the one the cache holds open for the type is left open, unless
        ``again`` (a watch of another type than the request's, opened so that the cache looks
        again now at what the request changed: the clusters held back for the routes just
        ACKed). So the ACK of a heartbeat, which changes nothing the cache reads, costs no new
        watch; an open watch is looked at on every publish anyway."""
        type_url = watch.type_url
        if type_url == SECRET.url:
            self._asked_secrets = watch
            watch = self._granted_only(watch)
        elif type_url == ENDPOINT.url and watch.proxy != self.node_id:
            watch = watch._replace(proxy=self.node_id)  # (the state machines name it already)
        if not again:
            held = self._held.get(type_url)
            if held is not None and held == watch:
                self._current[type_url] = held
                return
        self._current[type_url] = watch
        self._replace_watch(watch)

    def _replace_watch(self, watch: _Watch) -> None:
        """Cancel the stream's watch of ``watch``'s type and open ``watch`` in its place (the
        cache may answer it at once, through :meth:`_send`)."""
        type_url = watch.type_url
        previous = self._cancels.pop(type_url, None)
        if previous is not None:
            previous()
        route = self._server._route
        group = self.group if route is None else route(self.node_id, self.group)
        self._held[type_url] = watch  # (before: the cache may answer it at once)
        self._cancels[type_url] = self._create(watch, self._send, group)

    def _send(self, watch: _Watch, answer: _Answer) -> None:
        """The cache's callback: write the answer now (the transport queues what flow control
        holds back) and record it, unless a newer request superseded the watch it answers; then
        open the watches it made due."""
        if self._held.get(watch.type_url) is watch:
            del self._held[watch.type_url]  # (answered: the cache no longer holds it)
        if self.closed or self._current.get(answer.type_url) is not watch:
            return
        nonce, sent, due = self._on_response(watch, answer)
        self._call.send(sent.body, nonce_field(nonce))
        policy = self._server.policy
        policy.status.sent(self.node_id, sent.type_url, sent.version)
        if policy.events.conversation:
            policy.events.emit("sent", **self._sent_event(sent, nonce))
        if sent.expiring is not None:
            # (A later response without TTLs needs no word: its refresh finds nothing to renew.)
            self._server.heartbeats.expect(self, sent.type_url, sent.expiring)
        for again in due:
            self._current[again.type_url] = again
            self._replace_watch(again)

    def refresh(self, type_url: TypeUrl, current: TypeSnapshot) -> bool | None:
        """Send what renews the TTLs this (open) stream holds of ``type_url`` (see
        :class:`~pilotfish.xds.heartbeats.Refreshable`)."""
        found = self._refresh_body(type_url, current)
        if found is None:
            return None
        nonce = self.state.on_refresh(type_url)
        if nonce is None:
            return False
        body, count = found
        self._call.send(body, nonce_field(nonce))
        events = self._server.policy.events
        if events.conversation:
            events.emit(
                "sent",
                stream=self.id,
                node=self.node_id,
                type=type_url,
                version=current.version,
                nonce=nonce,
                resources=count,
                refresh=True,
                **({"delta": True} if self.protocol == "delta" else {}),
            )
        return True

    def _refresh_body(self, type_url: TypeUrl, current: TypeSnapshot) -> tuple[bytes, int] | None:
        """The body renewing what the stream holds of ``type_url`` with a TTL, and how many
        resources it names; None if it holds none."""
        raise NotImplementedError

    def _on_response(self, watch: _Watch, answer: _Answer) -> tuple[str, _Answer, Sequence[_Watch]]:
        """Tell the state machine: the nonce, what is sent (the answer, or what it became), and
        the watches that are due now."""
        raise NotImplementedError

    def _sent_event(self, sent: _Answer, nonce: str) -> dict[str, object]:
        """The fields of the ``sent`` event."""
        raise NotImplementedError

    def rewatch_all(self) -> None:
        """Open every watch of the stream again (in ADS order: what is referred to first)."""
        for type_url in ADS_ORDER:
            if type_url in self._current:
                self.rewatch(type_url)

    def rewatch(self, type_url: TypeUrl) -> None:
        """Open the stream's latest watch of ``type_url`` again (the cache looks at it anew)."""
        watch = self._current.get(type_url)
        if watch is not None and not self.closed:
            self._replace_watch(watch)

    # -- secrets ----------------------------------------------------------------------------------

    def _proxy_grants(self) -> ProxyGrants:
        grants = self._server.policy.grants.value
        if self._grants is None or self._grants[0] is not grants:
            self._grants = (grants, grants.for_proxy(identity=self._call.peer_identity, node_id=self.node_id))
        return self._grants[1]

    def _granted_only(self, watch: _Watch) -> _Watch:
        """``watch`` asking only for the secrets granted to this stream's proxy (no wildcard)."""
        raise NotImplementedError

    def _record_denied(self, names: list[str]) -> None:
        server, identity = self._server, self._call.peer_identity
        for name in names:
            if len(self._denied) >= MAX_DENIED_RECORDED:
                break
            if name in self._denied:
                continue
            self._denied.add(name)
            server.policy.events.emit(
                "secret_denied", stream=self.id, node=self.node_id, identity=identity, peer=self._call.peer, secret=name
            )
        shown = shorten(", ".join(names[:_DENIED_SHOWN]), 400)
        if len(names) > _DENIED_SHOWN:
            shown += f" and {len(names) - _DENIED_SHOWN:,} more"
        server._denials.log(
            "node %r (identity %r, %s) asked for secrets not granted to it, not sent: %s",
            shorten(self.node_id, 200),
            identity,
            self._call.peer,
            shown,
        )

    def regrant(self) -> None:
        """The policy's grants changed: open the stream's SDS watch again, with what its proxy
        last asked for filtered by them (unless that leaves the same names)."""
        asked = self._asked_secrets
        if asked is None or self.closed:
            return
        watch = self._granted_only(asked)
        if watch != self._current.get(SECRET.url):
            self._current[SECRET.url] = watch
            self.rewatch(SECRET.url)

    # -- the end ----------------------------------------------------------------------------------

    def _close(self, reason: str) -> None:
        if self.closed:
            return
        self.closed = True
        server, policy = self._server, self._server.policy
        server.open_streams -= 1
        for cancel in self._cancels.values():
            cancel()
        self._cancels.clear()
        self._held.clear()
        if server.heartbeats:  # (streams of a server that renews no TTL need not look)
            server.heartbeats.forget(self, self.state.types)
        self._current.clear()
        self._asked_secrets = None
        if self.opened:
            policy.status.stream_closed(self.node_id)
            policy.proxy_indices.release(self.node_id)
            streams = server._by_node.get(self.node_id)
            if streams is not None:
                streams.discard(self)
                if not streams:
                    del server._by_node[self.node_id]
        policy.events.emit("stream_closed", stream=self.id, node=self.node_id, reason=reason)


class _SotwConnection(_Stream[Watch, DecodedRequest, EncodedResponse]):
    """One SotW stream: :class:`~pilotfish.protocol.SotwStream` decides, and the cache answers
    with shared encoded responses."""

    __slots__ = ("_granted", "state")

    state: SotwStream

    def __init__(self, server: XdsServer, call: Call, type_url: TypeUrl | None) -> None:
        super().__init__(server, call, type_url, server.cache.create_watch)
        self.state = SotwStream(type_url=type_url, limits=server.policy.limits)
        self._granted: tuple[ProxyGrants, Subscription, Subscription] | None = None
        """The last SDS subscription asked for and what of it is granted (under those grants)."""

    def _decode(self, data: bytes) -> DecodedRequest:
        return self.state.decode_request(data)

    def _rejected_body(self, type_url: TypeUrl) -> bytes | None:
        state = self.state.types.get(type_url)
        sent = state.sent if state is not None else None
        # A NACK's nonce is the latest: the last response sent of its type is the one rejected.
        return sent.body if sent is not None and 0 < sent.carried <= _NACK_NAMES else None

    def _node_id(self, decoded: DecodedRequest) -> str:
        assert decoded.request is not None  # (a stream's first request is decoded)
        node_id: str = decoded.request.node.id
        return node_id

    def _step(self, decoded: DecodedRequest) -> RequestOutcome:
        return self.state.on_decoded(decoded)

    def _record(self, data: bytes, decoded: DecodedRequest, outcome: RequestOutcome) -> Sequence[Watch]:
        events = self._server.policy.events
        kind = outcome.kind
        if kind is RequestKind.NACK or events.conversation:
            # Names only when they say something new: an ACK repeats the names it subscribed to.
            names = None
            if kind is not RequestKind.ACK or outcome.subscription_changed:
                # (Left undecoded if they were the previous request's: decoded for the record.)
                request = decoded.request
                if request is None or decoded.names_as_before:
                    request = discovery_pb2.DiscoveryRequest.FromString(data)
                names = list(request.resource_names)
            events.emit(
                "stale" if kind is RequestKind.STALE else kind.value,
                stream=self.id,
                node=self.node_id,
                type=outcome.type_url,
                version_info=outcome.version_info,
                response_nonce=outcome.response_nonce,
                error=outcome.error,
                **({"resource_names": names} if names is not None else {}),
            )
        if kind is RequestKind.REQUEST and outcome.version_info:
            self._server.policy.status.resumed(self.node_id, outcome.type_url, outcome.version_info)
        elif kind is RequestKind.ACK:
            self._acked(outcome.type_url, outcome.version_info)
        elif kind is RequestKind.NACK:
            self._nacked(outcome.type_url, outcome.rejected_version, outcome.error)
        return outcome.watches

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
            granted = subscription if not denied else next_subscription(names, wildcard_capable=False, ever_named=True)
            self._granted = (grants, subscription, granted)
            if denied:
                self._record_denied(denied)
        return watch if granted is subscription else watch._replace(subscription=granted)

    def _on_response(self, watch: Watch, response: EncodedResponse) -> tuple[str, EncodedResponse, Sequence[Watch]]:
        nonce, response = self.state.on_response(watch, response)
        return nonce, response, ()

    def _refresh_body(self, type_url: TypeUrl, current: TypeSnapshot) -> tuple[bytes, int] | None:
        # The resources again, at the same version: Envoy's SotW client renews a TTL only from
        # the resource (module docstring of pilotfish.xds.heartbeats).
        state = self.state.types.get(type_url)
        if state is None or state.sent is None or state.held_version != current.version:
            return None
        if state.wildcard_capable:
            response = state.sent.whole()  # full state: what it holds, as it was sent
        else:
            response = current.refresh(state.held_names)
        return (response.body, response.carried) if response.carried else None

    def _sent_event(self, response: EncodedResponse, nonce: str) -> dict[str, object]:
        return {
            "stream": self.id,
            "node": self.node_id,
            "type": response.type_url,
            "version": response.version,
            "nonce": nonce,
            "resources": response.carried,
        }


class _DeltaConnection(_Stream[DeltaWatch, DecodedDeltaRequest, DeltaChanges]):
    """One incremental (delta) stream: :class:`~pilotfish.protocol.DeltaStream` decides, and the
    cache answers with what the client lacks."""

    __slots__ = ("state",)

    service = "delta-ads"
    protocol = "delta"
    method_prefix = "Delta"
    state: DeltaStream

    def __init__(self, server: XdsServer, call: Call, type_url: TypeUrl | None) -> None:
        super().__init__(server, call, type_url, server.cache.create_delta_watch)
        self.state = DeltaStream(type_url=type_url, limits=server.policy.limits)

    def _decode(self, data: bytes) -> DecodedDeltaRequest:
        return self.state.decode_request(data)

    def _node_id(self, decoded: DecodedDeltaRequest) -> str:
        assert decoded.request is not None  # (a stream's first request is decoded)
        node_id: str = decoded.request.node.id
        return node_id

    def _step(self, decoded: DecodedDeltaRequest) -> DeltaOutcome:
        return self.state.on_decoded(decoded)

    def _record(self, data: bytes, decoded: DecodedDeltaRequest, outcome: DeltaOutcome) -> Sequence[DeltaWatch]:
        events = self._server.policy.events
        kind = outcome.kind
        if kind is DeltaKind.NACK or events.conversation:
            changes: dict[str, object] = {}
            if outcome.subscribed:
                changes["subscribe"] = list(outcome.subscribed)
            if outcome.unsubscribed:
                changes["unsubscribe"] = list(outcome.unsubscribed)
            request = decoded.request
            if request is not None and request.initial_resource_versions:
                changes["initial_resources"] = len(request.initial_resource_versions)
            events.emit(
                kind.value,
                stream=self.id,
                node=self.node_id,
                type=outcome.type_url,
                delta=True,
                version=outcome.version,
                response_nonce=outcome.response_nonce,
                error=outcome.error,
                **changes,
            )
        if kind is DeltaKind.ACK:
            self._acked(outcome.type_url, outcome.version or "")
        elif kind is DeltaKind.NACK:
            self._nacked(outcome.type_url, outcome.version, outcome.error)
        return outcome.watches

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

    def _on_response(self, watch: DeltaWatch, changes: DeltaChanges) -> tuple[str, DeltaChanges, Sequence[DeltaWatch]]:
        nonce, again = self.state.on_response(watch, changes)  # again: warming, what the clusters
        return nonce, changes, again  # (listeners) just sent wait for, now

    def _refresh_body(self, type_url: TypeUrl, current: TypeSnapshot) -> tuple[bytes, int] | None:
        state = self.state.types.get(type_url)
        return current.heartbeat(state.known) if state is not None else None

    def _sent_event(self, changes: DeltaChanges, nonce: str) -> dict[str, object]:
        return {
            "stream": self.id,
            "node": self.node_id,
            "type": changes.type_url,
            "delta": True,
            "version": changes.version,
            "nonce": nonce,
            "resources": len(changes.sent),
            "names": list(changes.sent),
            "removed": list(changes.removed),
        }


async def start_xds_server(
    xds: XdsServer,
    address: str,
    *,
    tls: ssl.SSLContext | None = None,
    connection_limits: ConnectionLimits | None = None,
    beside: Mapping[str, MethodFactory] | None = None,
) -> tuple[GrpcServer, int]:
    """Serve ``xds`` on ``address`` (``host:port``; port 0 = any free), over TLS when ``tls`` is
    given, holding connections within ``connection_limits``, and the methods ``beside`` on the
    same port (load reporting); returns (server, port)."""
    host, _, port = address.rpartition(":")
    server = GrpcServer({**xds.methods(), **(beside or {})}, connection_limits=connection_limits)
    bound = await server.start(host.strip("[]"), int(port), tls=tls)
    return server, bound
