"""The simulated proxies: one connection and one ADS stream each, SotW (:class:`SotwProxy`) or
delta (:class:`DeltaProxy`), reconnecting forever; see :mod:`bench.fleet` for how they talk.

A proxy runs inside a worker process (:mod:`bench.fleet.worker`), which it reaches through a
small seam (:class:`ProxyHost`): the names parsed once per worker, the delta holdings its proxies
share, where to report ACKs and errors, and the worker's TLS context.
"""

from __future__ import annotations

import asyncio
import functools
import random
import ssl
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

from bench.fleet.messages import CDS, EDS, LDS, RDS, RTDS, TTL_FEATURES, FleetTls

if TYPE_CHECKING:  # for annotations only: the workers import protobuf where they use it
    from google.protobuf.message import Message

__all__ = ["DeltaHoldings", "DeltaProxy", "Names", "ProxyHost", "SotwProxy", "envoy_like_node"]

ADS_METHOD = "/envoy.service.discovery.v3.AggregatedDiscoveryService/StreamAggregatedResources"
_HCM_URL = "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"
_MB = 1024 * 1024

# Each channel gets its own connection (grpc shares subchannels between channels by default) and
# reconnects as fast as Envoy with pilotfish's bootstrap would.
CHANNEL_OPTIONS: list[tuple[str, Any]] = [
    ("grpc.use_local_subchannel_pool", 1),
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    # Not grpc.min_reconnect_backoff_ms: grpc also uses it as the connect timeout (default 20 s),
    # and a 100 ms one fails handshakes that a busy server answers a little later.
    ("grpc.max_receive_message_length", 512 * _MB),
    ("grpc.enable_retries", 0),
]
BACKOFF_BASE = 0.1
BACKOFF_MAX = 1.0


class ProxyHost(Protocol):
    """What a proxy needs from the worker process it runs in."""

    names: Names
    """CDS / LDS versions' names, parsed once per worker."""
    holdings: DeltaHoldings
    """The delta proxies' holdings, shared by the worker's proxies."""
    error_details: dict[str, str]
    """One example message per gRPC status seen."""

    def on_ack(self, proxy: SotwProxy) -> None:
        """``proxy`` sent an ACK (waiters may be done)."""

    def tls_context(self, tls: FleetTls) -> ssl.SSLContext:
        """The worker's client TLS context for ``tls``."""


def _cluster_eds_name(value: bytes) -> str | None:
    """The EDS resource an encoded Cluster names (None: not an EDS cluster)."""
    from envoy.config.cluster.v3 import cluster_pb2

    cluster = cluster_pb2.Cluster.FromString(value)
    if cluster.type == cluster_pb2.Cluster.EDS:
        return str(cluster.eds_cluster_config.service_name or cluster.name)
    return None


def _listener_route_names(value: bytes) -> set[str]:
    """The RDS route configurations an encoded Listener's HTTP connection managers name."""
    from envoy.config.listener.v3 import listener_pb2
    from envoy.extensions.filters.network.http_connection_manager.v3 import (
        http_connection_manager_pb2 as hcm_pb2,
    )

    names = set()
    listener = listener_pb2.Listener.FromString(value)
    chains = [*listener.filter_chains]
    if listener.HasField("default_filter_chain"):
        chains.append(listener.default_filter_chain)
    configs = [f.typed_config for chain in chains for f in chain.filters]
    if listener.HasField("api_listener"):
        configs.append(listener.api_listener.api_listener)
    for config in configs:
        if config.type_url == _HCM_URL:
            manager = hcm_pb2.HttpConnectionManager.FromString(config.value)
            if manager.HasField("rds"):
                names.add(manager.rds.route_config_name)
    return names


class Names:
    """What a CDS / LDS version names (EDS clusters / RDS route configs), parsed once per worker."""

    def __init__(self) -> None:
        self._by_version: dict[tuple[str, str], frozenset[str]] = {}

    def eds(self, response: Any) -> frozenset[str]:
        key = (CDS, response.version_info)
        found = self._by_version.get(key)
        if found is None:
            names = {name for name in (_cluster_eds_name(r.value) for r in response.resources) if name is not None}
            found = self._by_version[key] = frozenset(names)
        return found

    def rds(self, response: Any) -> frozenset[str]:
        key = (LDS, response.version_info)
        found = self._by_version.get(key)
        if found is None:
            names: set[str] = set()
            for resource in response.resources:
                names |= _listener_route_names(resource.value)
            found = self._by_version[key] = frozenset(names)
        return found


@functools.cache
def _in_order(names: frozenset[str] | None) -> tuple[str, ...]:
    """Resource names as a request lists them, sorted once per set: the sets come from
    :class:`Names`, so a worker's proxies share the same few."""
    return tuple(sorted(names or ()))


class _Req(NamedTuple):
    """A DiscoveryRequest to send, before encoding."""

    type_url: str
    version_info: str
    response_nonce: str
    resource_names: tuple[str, ...]
    node: Message | None
    """The proxy's node on a stream's first request, else None."""


_Send = tuple["_Req | _DeltaReq", bool]
"""A request to write (SotW or delta), and whether it is an ACK (its send time is then recorded)."""

_PREFIXES: dict[tuple[str, str, int], tuple[tuple[str, ...], bytes]] = {}
"""(type, version, id of the names tuple) -> (that tuple, the request's bytes without a nonce)."""


def _encode(request: _Req) -> tuple[bytes, ...]:
    """The request's bytes, in parts (sent as they are: no copy of the names to append a nonce),
    as protobuf lays them out (field order: version_info, node,
    resource_names, type_url, response_nonce). A worker's proxies send the same ACK but for the
    nonce, so all but the nonce is encoded once per (type, version, names). The names tuples
    come from :func:`_in_order`, shared: found by identity (hashing a tuple of 10,000 names for
    every ACK cost the simulator ~80 us per ACK, which a real proxy does not spend on these cores)."""
    from envoy.service.discovery.v3 import discovery_pb2

    from pilotfish.resources.wire import nonce_field  # DiscoveryRequest's nonce is field 5 too

    if request.node is not None:
        return (_message(request).SerializeToString(),)
    names = request.resource_names
    key = (request.type_url, request.version_info, id(names))
    found = _PREFIXES.get(key)
    if found is None or found[0] is not names:
        if len(_PREFIXES) > 4096:
            _PREFIXES.clear()
        found = _PREFIXES[key] = (
            names,
            discovery_pb2.DiscoveryRequest(
                type_url=request.type_url, version_info=request.version_info, resource_names=names
            ).SerializeToString(),
        )
    prefix = found[1]
    return (prefix, nonce_field(request.response_nonce)) if request.response_nonce else (prefix,)


def _message(request: _Req) -> Message:
    from envoy.service.discovery.v3 import discovery_pb2

    # xds-protos ships no type stubs: name the message's type here (node=None leaves it unset).
    message: Message = discovery_pb2.DiscoveryRequest(
        type_url=request.type_url,
        version_info=request.version_info,
        response_nonce=request.response_nonce,
        resource_names=request.resource_names,
        node=request.node,
    )
    return message


class SotwProxy:
    """One simulated Envoy: one connection, one ADS stream at a time, reconnecting forever.

    The xDS conversation (:meth:`open_stream`, :meth:`on_response`, :meth:`acked`) does no I/O: it
    says what to send; ``_converse_h2`` / ``_converse_grpc`` move the bytes with either client.
    """

    def __init__(self, index: int, node_id: str, worker: ProxyHost) -> None:
        from envoy.config.core.v3 import base_pb2

        self.index = index
        self.node = base_pb2.Node(id=node_id, cluster="bench-fleet", user_agent_name="pilotfish-fleet-sim")
        self.worker = worker
        self.versions: dict[str, str] = {}
        """Last ACKed version per type."""
        self.nonces: dict[str, str] = {}
        self.names: dict[str, frozenset[str] | None] = {EDS: None, RDS: None}
        self.acks: dict[str, dict[str, float]] = {}
        """type -> version -> when its first ACK was sent (the latest few versions)."""
        self.synced_at: float | None = None
        self.errors: list[tuple[float, str]] = []
        """(when the failed stream was opened, its gRPC status)."""
        self.streams = 0
        self.responses = 0
        self.bytes_received = 0
        """Bytes of the response messages received (gRPC message bodies), over all streams."""
        self._first = True
        """The stream's first request carries the node (``set_node_on_first_message_only``)."""
        self.node_every_request = False
        """Every request carries the node, as Envoy's do by default (``set_node_on_first_message_only``
        false; pilotfish's bootstraps set it true)."""
        self._lds_requested = False
        self.on_synced: asyncio.Event | None = None
        """Set once the proxy is synced (churn proxies leave then)."""

    def synced(self) -> bool:
        v = self.versions
        return CDS in v and LDS in v and (not self.names[EDS] or EDS in v) and (not self.names[RDS] or RDS in v)

    # -- the xDS conversation ------------------------------------------------------------------

    def _request(
        self, type_url: str, version: str, nonce: str, resource_names: tuple[str, ...] = (), ack: bool = False
    ) -> _Send:
        node = None
        if self._first or self.node_every_request:
            node = self.node
            self._first = False
        return _Req(type_url, version, nonce, resource_names, node), ack

    def _listeners_subscribed(self) -> bool:
        # Once CDS was ACKed the listener subscription exists (Envoy makes it when its clusters
        # have warmed), and a new stream re-sends it, answered or not: a stream that ended between
        # the LDS request and its response must not leave the proxy without listeners for good
        # (at an unchanged version its CDS request gets no response to trigger LDS again).
        return LDS in self.versions or CDS in self.versions

    def open_stream(self) -> list[_Send]:
        """A new stream (re)subscribes to everything it had, with the versions it has (no nonces)."""
        self._first = True
        self.nonces = {}  # nonces belong to a stream
        names = self.names
        sends = [self._request(CDS, self.versions.get(CDS, ""), "")]
        if names[EDS]:
            sends.append(self._request(EDS, self.versions.get(EDS, ""), "", _in_order(names[EDS])))
        self._lds_requested = self._listeners_subscribed()
        if self._lds_requested:
            sends.append(self._request(LDS, self.versions.get(LDS, ""), ""))
        if names[RDS]:
            sends.append(self._request(RDS, self.versions.get(RDS, ""), "", _in_order(names[RDS])))
        if names.get(RTDS):
            sends.append(self._request(RTDS, self.versions.get(RTDS, ""), "", _in_order(names[RTDS])))
        return sends

    def subscribe_runtime(self, layers: tuple[str, ...]) -> None:
        """Ask for these runtime layers (RTDS) on every stream, and announce that TTLs are taken
        (as an Envoy bootstrapped by ``pilotfish bootstrap --runtime-layer``)."""
        self.names[RTDS] = frozenset(layers)
        self.node.client_features.extend(TTL_FEATURES)

    method = ADS_METHOD
    """The gRPC method the proxy's stream calls."""

    @staticmethod
    def decoder() -> Any:
        """Decodes a response message."""
        from envoy.service.discovery.v3 import discovery_pb2

        return discovery_pb2.DiscoveryResponse.FromString

    @staticmethod
    def encode(request: Any) -> tuple[bytes, ...]:
        return _encode(request)

    @staticmethod
    def message(request: Any) -> Message:
        return _message(request)

    def on_response(self, response: Any) -> list[_Send]:
        """What Envoy sends on a response: new EDS / RDS subscriptions it implies, then its ACK,
        then (after the first CDS) the LDS request."""
        self.responses += 1
        names, versions, nonces = self.names, self.versions, self.nonces
        type_url, version, nonce = response.type_url, response.version_info, response.nonce
        nonces[type_url] = nonce
        sends = []
        if type_url in (CDS, LDS):
            # The clusters name their EDS resources, the listeners their RDS ones: subscribe to
            # what changed before ACKing, as Envoy does.
            dependent = EDS if type_url == CDS else RDS
            wanted = self.worker.names.eds(response) if type_url == CDS else self.worker.names.rds(response)
            if wanted != names[dependent]:
                names[dependent] = wanted
                sends.append(
                    self._request(dependent, versions.get(dependent, ""), nonces.get(dependent, ""), _in_order(wanted))
                )
            sends.append(self._request(type_url, version, nonce, ack=True))
            if type_url == CDS and not self._lds_requested:
                self._lds_requested = True
                sends.append(self._request(LDS, "", ""))
        else:
            sends.append(self._request(type_url, version, nonce, _in_order(names.get(type_url)), ack=True))
        return sends

    def acked(self, request: Any) -> None:
        """An ACK has just been handed to the client: record when, per type and version."""
        type_url, version = request.type_url, request.version_info
        now = time.time()
        seen = self.acks.setdefault(type_url, {})
        if self.versions.get(type_url) != version or version not in seen:
            # A version ACKed again after another one (e.g. an endpoint added, then removed) counts anew.
            seen.pop(version, None)
            seen[version] = now
            if len(seen) > 8:
                del seen[next(iter(seen))]
        self.versions[type_url] = version
        if self.synced_at is None and self.synced():
            self.synced_at = now
        self.worker.on_ack(self)

    # -- streams and reconnects ----------------------------------------------------------------

    async def run(self, target: str, client: str, tls: FleetTls | None) -> None:
        """Stream after stream, forever: a new stream after a jittered backoff when one ends."""
        channel: Any = None
        if client == "grpc":
            import grpc

            # One channel for the proxy's life: grpc reconnects it (a new connection) itself.
            if tls is None:
                channel = grpc.aio.insecure_channel(target, options=CHANNEL_OPTIONS)
            else:
                credentials = grpc.ssl_channel_credentials(
                    Path(tls.ca).read_bytes(),
                    Path(tls.key).read_bytes() if tls.key else None,
                    Path(tls.cert).read_bytes() if tls.cert else None,
                )
                channel = grpc.aio.secure_channel(
                    target, credentials, options=[*CHANNEL_OPTIONS, ("grpc.ssl_target_name_override", tls.server_name)]
                )
            method = channel.stream_stream(
                self.method, request_serializer=lambda m: m.SerializeToString(), response_deserializer=self.decoder()
            )

            async def converse() -> tuple[str, str]:
                return await self._converse_grpc(method)
        else:
            host, _, port = target.rpartition(":")

            async def converse() -> tuple[str, str]:
                return await self._converse_h2(host, int(port), tls)

        attempt = 0
        try:
            while True:
                opened = time.time()
                self.streams += 1
                before = self.responses
                code, details = await converse()
                self.errors.append((opened, code))
                if details:
                    self.worker.error_details.setdefault(code, details[:300])
                if self.responses > before:
                    attempt = 0
                interval = min(BACKOFF_MAX, BACKOFF_BASE * 2**attempt)
                attempt += 1
                await asyncio.sleep(random.uniform(0, interval))
        finally:
            if channel is not None:
                await channel.close(None)

    async def _converse_h2(self, host: str, port: int, tls: FleetTls | None) -> tuple[str, str]:
        """One stream on a new connection (bench/h2client.py), as Envoy makes one per reconnect;
        how it ended: (gRPC status name or CLOSED_BY_SERVER, details). Each response is handled in
        the connection's data callback: no task or coroutine per message."""
        from bench.h2client import H2Channel, H2Error

        try:
            if tls is None:
                channel = await H2Channel.connect(host, port)
            else:
                channel = await H2Channel.connect(
                    host, port, tls=self.worker.tls_context(tls), server_hostname=tls.server_name
                )
        except H2Error as exc:
            return exc.code, exc.details
        decode, encode = self.decoder(), self.encode

        def on_message(data: bytes) -> None:
            self.bytes_received += len(data)
            for request, ack in self.on_response(decode(data)):
                call.write(*encode(request))
                if ack:
                    self.acked(request)

        try:
            call = channel.call(self.method, on_message=on_message)
            for request, _ in self.open_stream():
                call.write(*encode(request))
            await call.wait_closed()
            return "CLOSED_BY_SERVER", ""
        except H2Error as exc:
            return exc.code, exc.details
        finally:
            channel.close()

    async def _converse_grpc(self, method: Any) -> tuple[str, str]:
        """One stream on the proxy's grpc.aio channel; how it ended, as :meth:`_converse_h2`."""
        import grpc

        call = method()
        try:
            for request, _ in self.open_stream():
                await call.write(self.message(request))
            while True:
                response = await call.read()
                if response is grpc.aio.EOF:
                    return "CLOSED_BY_SERVER", ""
                self.bytes_received += response.ByteSize()
                for request, ack in self.on_response(response):
                    await call.write(self.message(request))  # the ACK's time is taken once grpc has it
                    if ack:
                        self.acked(request)
        except grpc.aio.AioRpcError as exc:
            return exc.code().name, str(exc.details())
        except asyncio.CancelledError:
            call.cancel()
            raise


# -- delta (incremental) xDS ---------------------------------------------------------------------

DELTA_ADS_METHOD = "/envoy.service.discovery.v3.AggregatedDiscoveryService/DeltaAggregatedResources"
_NO_VERSIONS: dict[str, str] = {}


class _Held(NamedTuple):
    """What a delta proxy has of one type: name -> resource version, and what those resources
    name (a CDS holding's EDS service names, an LDS holding's RDS route names). Shared by every
    proxy of a worker that took the same responses: never changed in place."""

    versions: dict[str, str]
    names: frozenset[str]


_EMPTY = _Held({}, frozenset())


class _DeltaReq(NamedTuple):
    """A DeltaDiscoveryRequest to send, before encoding."""

    type_url: str
    response_nonce: str
    subscribe: tuple[str, ...]
    unsubscribe: tuple[str, ...]
    initial: dict[str, str] | None
    """``initial_resource_versions`` (a stream's first request of the type), else None."""
    node: Message | None
    version_info: str = ""
    """Not sent: the ``system_version_info`` an ACK accepts, for :meth:`SotwProxy.acked`."""


class DeltaHoldings:
    """A worker's memo of delta holdings: (holding, response) -> the next holding, so a worker's
    proxies at one version share one mapping and a response is applied once per worker, not once
    per proxy (1,000 proxies x 10,000 clusters would otherwise hold 10 million entries)."""

    def __init__(self) -> None:
        self._next: dict[tuple[Any, ...], tuple[_Held, _Held]] = {}
        self._refers: dict[tuple[str, str, str], frozenset[str]] = {}
        """(type, name, version) -> what that resource names (EDS / RDS names)."""

    def after(self, held: _Held, response: Any) -> _Held:
        type_url = response.type_url
        sent = tuple((r.name, r.version) for r in response.resources)
        removed = tuple(response.removed_resources)
        key = (type_url, id(held), sent, removed)
        found = self._next.get(key)
        if found is not None and found[0] is held:
            return found[1]
        versions = dict(held.versions)
        for name in removed:
            versions.pop(name, None)
        versions.update(sent)
        refers = self._refers
        if type_url in (CDS, LDS):
            for resource in response.resources:
                rkey = (type_url, resource.name, resource.version)
                if rkey not in refers:
                    value = resource.resource.value
                    if type_url == CDS:
                        eds = _cluster_eds_name(value)
                        refers[rkey] = frozenset(() if eds is None else (eds,))
                    else:
                        refers[rkey] = frozenset(_listener_route_names(value))
            names: set[str] = set()
            for name, version in versions.items():
                names |= refers[(type_url, name, version)]
            after = _Held(versions, frozenset(names))
        else:
            after = _Held(versions, frozenset())
        if len(self._next) > 256:
            self._next.clear()
        self._next[key] = (held, after)  # the key's id() stays valid while its holding is kept here
        return after


_DELTA_PREFIXES: dict[tuple[str, tuple[str, ...], tuple[str, ...]], bytes] = {}


def _delta_message(request: _DeltaReq) -> Message:
    from envoy.service.discovery.v3 import discovery_pb2

    message: Message = discovery_pb2.DeltaDiscoveryRequest(
        type_url=request.type_url,
        response_nonce=request.response_nonce,
        resource_names_subscribe=request.subscribe,
        resource_names_unsubscribe=request.unsubscribe,
        initial_resource_versions=request.initial,
        node=request.node,
    )
    return message


def _delta_encode(request: _DeltaReq) -> tuple[bytes, ...]:
    """The request's bytes, in parts; all but the nonce (field 6) encoded once per (type, subscription
    change), as :func:`_encode` does for SotW."""
    if request.node is not None or request.initial:
        return (_delta_message(request).SerializeToString(),)
    key = (request.type_url, request.subscribe, request.unsubscribe)
    prefix = _DELTA_PREFIXES.get(key)
    if prefix is None:
        if len(_DELTA_PREFIXES) > 4096:
            _DELTA_PREFIXES.clear()
        prefix = _DELTA_PREFIXES[key] = _delta_message(request._replace(response_nonce="")).SerializeToString()
    if not request.response_nonce:
        return (prefix,)
    nonce = request.response_nonce.encode()
    return prefix, b"\x32" + _varint(len(nonce)) + nonce  # field 6, length-delimited


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


class DeltaProxy(SotwProxy):
    """A simulated Envoy on incremental xDS (``DeltaAggregatedResources``), as Envoy's
    ``DELTA_GRPC`` ADS does:

    - CDS and LDS are wildcard subscriptions (a first request naming nothing); on a CDS (LDS)
      response it subscribes to the EDS (RDS) names it did not have and unsubscribes from those
      no longer named, then ACKs (``response_nonce`` only);
    - it keeps name -> version per type (a response carries only what changed, and removals), and
      forgets what it unsubscribes from;
    - on a new stream it re-subscribes with ``initial_resource_versions`` (what it has), so a
      server that has nothing newer sends nothing.

    ACK times are recorded per type under the response's ``system_version_info``, so the
    coordinator's waits work as for SotW. A proxy whose subscriptions saw no change gets no
    response, and so records no ACK.
    """

    method = DELTA_ADS_METHOD

    def __init__(self, index: int, node_id: str, worker: ProxyHost) -> None:
        super().__init__(index, node_id, worker)
        self.held: dict[str, _Held] = {CDS: _EMPTY, EDS: _EMPTY, LDS: _EMPTY, RDS: _EMPTY, RTDS: _EMPTY}
        self.subscribed: dict[str, frozenset[str]] = {EDS: frozenset(), RDS: frozenset()}

    @staticmethod
    def decoder() -> Any:
        from envoy.service.discovery.v3 import discovery_pb2

        return discovery_pb2.DeltaDiscoveryResponse.FromString

    @staticmethod
    def encode(request: Any) -> tuple[bytes, ...]:
        return _delta_encode(request)

    @staticmethod
    def message(request: Any) -> Message:
        return _delta_message(request)

    def _delta(
        self,
        type_url: str,
        *,
        nonce: str = "",
        subscribe: tuple[str, ...] = (),
        unsubscribe: tuple[str, ...] = (),
        initial: dict[str, str] | None = None,
        version: str = "",
        ack: bool = False,
    ) -> _Send:
        node = None
        if self._first or self.node_every_request:
            node = self.node
            self._first = False
        return _DeltaReq(type_url, nonce, subscribe, unsubscribe, initial or None, node, version), ack

    def open_stream(self) -> list[_Send]:
        self._first = True
        self.nonces = {}
        held, subscribed = self.held, self.subscribed
        sends = [self._delta(CDS, initial=held[CDS].versions)]
        if subscribed[EDS]:
            sends.append(self._delta(EDS, subscribe=_in_order(subscribed[EDS]), initial=held[EDS].versions))
        self._lds_requested = self._listeners_subscribed()
        if self._lds_requested:
            sends.append(self._delta(LDS, initial=held[LDS].versions))
        if subscribed[RDS]:
            sends.append(self._delta(RDS, subscribe=_in_order(subscribed[RDS]), initial=held[RDS].versions))
        if self.names.get(RTDS):
            sends.append(self._delta(RTDS, subscribe=_in_order(self.names[RTDS]), initial=held[RTDS].versions))
        return sends

    def on_response(self, response: Any) -> list[_Send]:
        self.responses += 1
        type_url, nonce = response.type_url, response.nonce
        self.nonces[type_url] = nonce
        held = self.held[type_url] = self.worker.holdings.after(self.held[type_url], response)
        sends = []
        if type_url in (CDS, LDS):
            dependent = EDS if type_url == CDS else RDS
            had = self.subscribed[dependent]
            if held.names != had:
                self.names[dependent] = self.subscribed[dependent] = held.names
                gone = had - held.names
                if gone:  # Envoy forgets what it unsubscribes from
                    kept = self.held[dependent]
                    self.held[dependent] = _Held({n: v for n, v in kept.versions.items() if n not in gone}, kept.names)
                sends.append(self._delta(dependent, subscribe=_in_order(held.names - had), unsubscribe=_in_order(gone)))
            sends.append(self._delta(type_url, nonce=nonce, version=response.system_version_info, ack=True))
            if type_url == CDS and not self._lds_requested:
                self._lds_requested = True
                sends.append(self._delta(LDS))
        else:
            sends.append(self._delta(type_url, nonce=nonce, version=response.system_version_info, ack=True))
        return sends


ENVOY_EXTENSIONS = 400
"""Extensions an Envoy-like node lists (Envoy 1.40's node lists several hundred: about 60 KB)."""


def envoy_like_node(node_id: str) -> Message:
    """A node as large as Envoy's: its build version, some metadata (a few KB, as a mesh puts
    there), a locality, and the list of every extension it was built with (about 60 KB), sent on a
    stream's first request as Envoy with ``set_node_on_first_message_only`` does."""
    from envoy.config.core.v3 import base_pb2
    from google.protobuf import struct_pb2

    node = base_pb2.Node(id=node_id, cluster="bench-churn", user_agent_name="envoy")
    node.user_agent_build_version.version.major_number = 1
    node.user_agent_build_version.version.minor_number = 40
    node.locality.region, node.locality.zone = "bench-region", f"zone-{sum(node_id.encode()) % 3}"
    metadata = {f"label.{k}": f"{node_id}-value-{k}-" + "x" * 40 for k in range(40)}
    node.metadata.CopyFrom(struct_pb2.Struct(fields={k: struct_pb2.Value(string_value=v) for k, v in metadata.items()}))
    for k in range(ENVOY_EXTENSIONS):
        category = ("envoy.filters.http", "envoy.filters.network", "envoy.transport_sockets", "envoy.clusters")[k % 4]
        node.extensions.add(
            name=f"{category}.extension_number_{k:03d}",
            category=category,
            type_urls=[f"envoy.extensions.{category}.v3.ExtensionNumber{k:03d}Config"],
        )
    made: Message = node
    return made
