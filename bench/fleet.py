"""The fleet simulator: N simulated Envoy proxies, each with its own ADS stream, against a control
plane running in another process.

Theory of operation
-------------------
Each simulated proxy owns a TCP connection (as each Envoy has) and one ``StreamAggregatedResources``
stream on it, and talks like Envoy does:

1. it opens the stream with a wildcard CDS request carrying its node (only on the first message,
   as with ``set_node_on_first_message_only``);
2. on a CDS response it subscribes to EDS for the EDS clusters it got, then ACKs the CDS response,
   then (the first time) requests LDS; on an LDS response it subscribes to RDS for the route names
   in the listeners' HTTP connection managers (``rds.route_config_name``) and ACKs; EDS and RDS
   responses are ACKed (``version_info`` + ``response_nonce`` of the response);
3. when the stream breaks it reconnects after a jittered exponential backoff (0.1 s doubling to
   1 s, Envoy's ``retry_back_off`` in pilotfish's bootstrap) and re-sends every subscription with
   the last version it ACKed, as Envoy does.

With ``xds="delta"`` (``--xds delta``) each proxy speaks incremental xDS instead
(``DeltaAggregatedResources``, :class:`_DeltaProxy`): wildcard CDS and LDS, EDS and RDS names
subscribed and unsubscribed as its clusters and listeners change, name -> version kept per type
(responses carry only changes and removals), ``initial_resource_versions`` on reconnect. A
worker's proxies share their holdings (:class:`_DeltaHoldings`), as the server shares what its
streams are known to have. Every proxy counts the bytes of the response messages it receives
(``Fleet.bytes_received``), either variant.

The conversation (:meth:`_Proxy.open_stream`, :meth:`_Proxy.on_response`) does no I/O; one of two
clients carries it (``--client``):

- ``h2`` (default): bench/h2client.py, a thin asyncio adapter around pilotfish's own sans-IO
  HTTP/2 connection (:mod:`pilotfish.transport.h2`, client role: the server's code). Each
  response is decoded and answered inside the connection's data callback; each stream gets a new
  connection, as Envoy makes one per reconnect. It costs about a third of grpc.aio's CPU per push,
  so the simulator (on the server's cores) distorts the measurement less.
- ``grpc``: a grpc.aio channel per proxy (one subchannel each), which reconnects by itself.

With :class:`FleetTls` the proxies connect over TLS (ALPN ``h2``), trusting a CA file, and for
mTLS present a client certificate; each worker builds its TLS context once, from the files.

Each ACK's send time (``time.time()``, just after the write was handed to the client) is recorded per
type and version, so the coordinator can ask "when had every proxy ACKed EDS version V?" after a
change it made at time t0. Clocks are epoch seconds so they compare with the server's event log.

One Python process cannot drive 10,000 streams quickly, so proxies are sharded over worker
processes (``python -m bench.fleet --worker FD``, one socketpair each). The coordinator
(:class:`Fleet`, synchronous) sends each worker a command over its socket and gathers the
answers; workers never poll their proxies, they are told by each ACK (a :class:`_Waiter` counts
down).

Command line: ``python -m bench.fleet --proxies N`` starts a pilotfish server, connects N proxies,
makes ``--changes`` endpoint changes through the registry API and prints the results table.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import functools
import math
import os
import random
import socket
import ssl
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, TypedDict

from bench.procs import REPO, cpu_seconds, raise_fd_limit, rss_kb
from bench.stats import load_1min

if TYPE_CHECKING:  # for annotations only: the workers import protobuf where they use it
    from google.protobuf.message import Message

__all__ = ["CDS", "EDS", "LDS", "RDS", "XDS_VARIANTS", "ChurnCounts", "Fleet", "FleetError", "FleetTls",
           "envoy_like_node", "main"]

CDS = "type.googleapis.com/envoy.config.cluster.v3.Cluster"
EDS = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"
LDS = "type.googleapis.com/envoy.config.listener.v3.Listener"
RDS = "type.googleapis.com/envoy.config.route.v3.RouteConfiguration"
SHORT = {CDS: "CDS", EDS: "EDS", LDS: "LDS", RDS: "RDS"}
BY_SHORT = {v: k for k, v in SHORT.items()}
ADS_METHOD = "/envoy.service.discovery.v3.AggregatedDiscoveryService/StreamAggregatedResources"
_HCM_URL = ("type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3."
            "HttpConnectionManager")
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
MAX_PER_WORKER = 2500
CLIENTS = ("h2", "grpc")
"""The simulated proxies' gRPC clients: bench/h2client.py (default), grpc.aio."""
XDS_VARIANTS = ("sotw", "delta")
"""The protocol the simulated proxies speak: state of the world (``StreamAggregatedResources``,
default) or incremental (``DeltaAggregatedResources``)."""


class FleetError(RuntimeError):
    """A worker process failed."""


@dataclass(frozen=True, slots=True, kw_only=True)
class FleetTls:
    """How the simulated proxies reach the server over TLS (paths are read by each worker)."""

    ca: str
    """PEM CA bundle the server's certificate must chain to."""
    cert: str | None = None
    """mTLS: PEM certificate chain each proxy presents (None: no client certificate)."""
    key: str | None = None
    """mTLS: PEM private key of ``cert``."""
    server_name: str = "localhost"
    """The name the server's certificate is verified against (and sent as SNI)."""

    def as_dict(self) -> dict[str, str | None]:
        return {"ca": self.ca, "cert": self.cert, "key": self.key, "server_name": self.server_name}


# --------------------------------------------------------------------------------------------
# Worker side: simulated proxies (runs only in worker processes; imports grpc only for --client grpc)
# --------------------------------------------------------------------------------------------


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


class _Names:
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


class _Waiter:
    """Counts down proxies until each has ACKed ``versions`` (or is synced, when None)."""

    def __init__(self, versions: dict[str, str] | None, since: float, proxies: Iterable[_Proxy]) -> None:
        self.versions = versions
        self.since = since
        self.remaining = {p.index for p in proxies if not self.done(p)}
        self.event = asyncio.Event()
        if not self.remaining:
            self.event.set()

    def done(self, proxy: _Proxy) -> bool:
        return self.time_of(proxy) is not None

    def time_of(self, proxy: _Proxy) -> float | None:
        # Called for every ACK (and every proxy, twice per wait): plain loops, no temporaries.
        if self.versions is None:
            return proxy.synced_at
        latest = self.since
        for type_url, version in self.versions.items():
            at = proxy.acks.get(type_url, {}).get(version)
            if at is None or at < self.since:
                return None
            latest = max(latest, at)
        return latest

    def on_ack(self, proxy: _Proxy) -> None:
        if proxy.index in self.remaining and self.done(proxy):
            self.remaining.discard(proxy.index)
            if not self.remaining:
                self.event.set()


@functools.cache
def _in_order(names: frozenset[str] | None) -> tuple[str, ...]:
    """Resource names as a request lists them, sorted once per set: the sets come from
    :class:`_Names`, so a worker's proxies share the same few."""
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
        found = _PREFIXES[key] = (names, discovery_pb2.DiscoveryRequest(
            type_url=request.type_url, version_info=request.version_info,
            resource_names=names).SerializeToString())
    prefix = found[1]
    return (prefix, nonce_field(request.response_nonce)) if request.response_nonce else (prefix,)


def _message(request: _Req) -> Message:
    from envoy.service.discovery.v3 import discovery_pb2

    # xds-protos ships no type stubs: name the message's type here (node=None leaves it unset).
    message: Message = discovery_pb2.DiscoveryRequest(
        type_url=request.type_url, version_info=request.version_info, response_nonce=request.response_nonce,
        resource_names=request.resource_names, node=request.node)
    return message


class _Proxy:
    """One simulated Envoy: one connection, one ADS stream at a time, reconnecting forever.

    The xDS conversation (:meth:`open_stream`, :meth:`on_response`, :meth:`acked`) does no I/O: it
    says what to send; ``_converse_h2`` / ``_converse_grpc`` move the bytes with either client.
    """

    def __init__(self, index: int, node_id: str, worker: _Worker) -> None:
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
        self._lds_requested = False
        self.on_synced: asyncio.Event | None = None
        """Set once the proxy is synced (churn proxies leave then)."""

    def synced(self) -> bool:
        v = self.versions
        return (CDS in v and LDS in v and (not self.names[EDS] or EDS in v)
                and (not self.names[RDS] or RDS in v))

    # -- the xDS conversation ------------------------------------------------------------------

    def _request(self, type_url: str, version: str, nonce: str, resource_names: tuple[str, ...] = (),
                 ack: bool = False) -> _Send:
        node = None
        if self._first:
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
        return sends

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
                sends.append(self._request(dependent, versions.get(dependent, ""), nonces.get(dependent, ""),
                                           _in_order(wanted)))
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
                    Path(tls.ca).read_bytes(), Path(tls.key).read_bytes() if tls.key else None,
                    Path(tls.cert).read_bytes() if tls.cert else None)
                channel = grpc.aio.secure_channel(target, credentials, options=[
                    *CHANNEL_OPTIONS, ("grpc.ssl_target_name_override", tls.server_name)])
            method = channel.stream_stream(self.method, request_serializer=lambda m: m.SerializeToString(),
                                           response_deserializer=self.decoder())

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
                interval = min(BACKOFF_MAX, BACKOFF_BASE * 2 ** attempt)
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
                channel = await H2Channel.connect(host, port, tls=self.worker.tls_context(tls),
                                                  server_hostname=tls.server_name)
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
    """Not sent: the ``system_version_info`` an ACK accepts, for :meth:`_Proxy.acked`."""


class _DeltaHoldings:
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
        type_url=request.type_url, response_nonce=request.response_nonce,
        resource_names_subscribe=request.subscribe, resource_names_unsubscribe=request.unsubscribe,
        initial_resource_versions=request.initial, node=request.node)
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


class _DeltaProxy(_Proxy):
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

    def __init__(self, index: int, node_id: str, worker: _Worker) -> None:
        super().__init__(index, node_id, worker)
        self.held: dict[str, _Held] = {CDS: _EMPTY, EDS: _EMPTY, LDS: _EMPTY, RDS: _EMPTY}
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

    def _delta(self, type_url: str, *, nonce: str = "", subscribe: tuple[str, ...] = (),
               unsubscribe: tuple[str, ...] = (), initial: dict[str, str] | None = None, version: str = "",
               ack: bool = False) -> _Send:
        node = None
        if self._first:
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
                    self.held[dependent] = _Held({n: v for n, v in kept.versions.items() if n not in gone},
                                                 kept.names)
                sends.append(self._delta(dependent, subscribe=_in_order(held.names - had),
                                         unsubscribe=_in_order(gone)))
            sends.append(self._delta(type_url, nonce=nonce, version=response.system_version_info, ack=True))
            if type_url == CDS and not self._lds_requested:
                self._lds_requested = True
                sends.append(self._delta(LDS))
        else:
            sends.append(self._delta(type_url, nonce=nonce, version=response.system_version_info, ack=True))
        return sends


class _ErrorReport(TypedDict):
    """A worker's answer to ``errors``."""

    counts: dict[str, int]
    """Streams that broke, by gRPC status."""
    examples: dict[str, str]
    """One example message per gRPC status seen."""


class _StreamReport(TypedDict):
    """A worker's answer to ``streams``."""

    streams: int
    """Streams its proxies opened (reconnects included)."""
    proxies: int


@dataclass(slots=True)
class ChurnCounts:
    """How far a churn got (:meth:`Fleet.churn`), in one worker or summed over all."""

    started: int = 0
    """Proxies that began to connect."""
    synced: int = 0
    """...of them, those that synced before they left."""
    never_synced: int = 0
    """...those that left after the sync timeout without having synced."""
    departed: int = 0
    """...those that have left (synced or not)."""
    active: int = 0
    """...those connected (or connecting) now."""


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
        node.extensions.add(name=f"{category}.extension_number_{k:03d}", category=category,
                            type_urls=[f"envoy.extensions.{category}.v3.ExtensionNumber{k:03d}Config"])
    made: Message = node
    return made


class _Worker:
    """A worker process: some proxies, driven by commands from the coordinator's pipe."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.proxies: list[_Proxy] = []
        self.tasks: list[asyncio.Task[None]] = []
        self.names = _Names()
        self.holdings = _DeltaHoldings()
        self.waiters: list[_Waiter] = []
        self.error_details: dict[str, str] = {}
        """One example message per gRPC status seen."""
        self._tls_context: ssl.SSLContext | None = None
        self.churn = ChurnCounts()
        self._churn_task: asyncio.Task[None] | None = None

    def tls_context(self, tls: FleetTls) -> ssl.SSLContext:
        """The worker's one client TLS context (ALPN h2), built from ``tls``'s files on first use."""
        if self._tls_context is None:
            from bench.h2client import client_context

            self._tls_context = client_context(ca=tls.ca, cert=tls.cert, key=tls.key)
        return self._tls_context

    def on_ack(self, proxy: _Proxy) -> None:
        for waiter in self.waiters:
            waiter.on_ack(proxy)
        if proxy.on_synced is not None and proxy.synced_at is not None:
            proxy.on_synced.set()

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        inbox: asyncio.Queue[tuple[str, dict[str, Any]]] = asyncio.Queue()

        def receive() -> None:
            try:
                inbox.put_nowait(self.conn.recv())
            except (EOFError, OSError):  # the coordinator is gone: stop
                loop.remove_reader(self.conn.fileno())
                inbox.put_nowait(("stop", {}))

        loop.add_reader(self.conn.fileno(), receive)
        while True:
            command, args = await inbox.get()
            try:
                if command == "stop":
                    await self.stop()
                    with contextlib.suppress(OSError):
                        self.conn.send(("ok", None))
                    return
                result = await getattr(self, "cmd_" + command)(**args)
                self.conn.send(("ok", result))
            except Exception as exc:
                self.conn.send(("error", f"{type(exc).__name__}: {exc}"))

    async def cmd_start(self, targets: list[str], ids: list[tuple[int, str]], rate: float, client: str,
                        tls: dict[str, str | None] | None = None, xds: str = "sotw") -> int:
        """Start proxies ``ids`` (index, node id), proxy i connecting to ``targets[i % len(targets)]``;
        ``rate`` proxies per second (0: all at once); ``client``: ``h2`` or ``grpc``; ``tls``: a
        :class:`FleetTls` as a dict (None: plaintext); ``xds``: ``sotw`` or ``delta``."""
        settings = FleetTls(**tls) if tls is not None else None  # type: ignore[arg-type]
        kind = _DeltaProxy if xds == "delta" else _Proxy

        async def launch() -> None:
            for n, (index, node_id) in enumerate(ids):
                proxy = kind(index, node_id, self)
                self.proxies.append(proxy)
                target = targets[index % len(targets)]
                self.tasks.append(asyncio.create_task(proxy.run(target, client, settings)))
                if rate > 0 and n % 50 == 49:
                    await asyncio.sleep(50 / rate)

        await launch()
        return len(ids)

    async def cmd_wait(self, versions: dict[str, str] | None, since: float, timeout: float,
                       synced_only: bool = False) -> list[tuple[int, float | None]]:
        """Wait until every proxy (``synced_only``: every proxy that has synced) ACKed ``versions``
        at or after ``since`` (None: is synced); (index, when) per proxy."""
        waiter = _Waiter(versions, since,
                         [p for p in self.proxies if p.synced_at is not None] if synced_only else self.proxies)
        self.waiters.append(waiter)
        try:
            await asyncio.wait_for(waiter.event.wait(), timeout)
        except TimeoutError:
            pass
        finally:
            self.waiters.remove(waiter)
        return [(p.index, waiter.time_of(p)) for p in self.proxies]

    async def cmd_errors(self, since: float) -> _ErrorReport:
        """Errors (by gRPC status) of streams opened since ``since`` (epoch seconds), over all proxies."""
        counts: Counter[str] = Counter()
        for proxy in self.proxies:
            counts.update(code for at, code in proxy.errors if at >= since)
        return {"counts": dict(counts), "examples": self.error_details}

    async def cmd_bytes(self) -> list[tuple[int, int]]:
        """(index, bytes of responses received so far) per proxy."""
        return [(p.index, p.bytes_received) for p in self.proxies]

    async def cmd_churn(self, targets: list[str], ids: list[str], rate: float, client: str, xds: str = "sotw",
                        envoy_node: bool = False, sync_timeout: float = 30.0, max_active: int = 0) -> None:
        """Start churning in the background: proxies ``ids`` connect one after another, ``rate`` per
        second, and each leaves for good (its stream and connection closed) once it is synced, or
        after ``sync_timeout`` s; ``envoy_node``: their node is as large as Envoy's (see
        :func:`envoy_like_node`); ``max_active``: at most that many connected at once (0: no limit;
        the next waits, so a server slowed down by other work is not buried in connections).
        :meth:`cmd_churned` says how far it got."""
        if self._churn_task is not None:
            raise RuntimeError("this worker churns already")
        kind = _DeltaProxy if xds == "delta" else _Proxy
        counts = self.churn

        async def one(node_id: str, target: str) -> None:
            proxy = kind(-1, node_id, self)
            if envoy_node:
                proxy.node = envoy_like_node(node_id)
            proxy.on_synced = asyncio.Event()
            task = asyncio.create_task(proxy.run(target, client, None))
            counts.active += 1
            try:
                await asyncio.wait_for(proxy.on_synced.wait(), sync_timeout)
                counts.synced += 1
            except TimeoutError:
                counts.never_synced += 1
            finally:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                counts.active -= 1
                counts.departed += 1

        slots = asyncio.Semaphore(max_active) if max_active > 0 else None

        async def run() -> None:
            lives: set[asyncio.Task[None]] = set()
            begin = time.monotonic()
            try:
                for n, node_id in enumerate(ids):
                    delay = begin + n / rate - time.monotonic()
                    if delay > 0:
                        await asyncio.sleep(delay)
                    if slots is not None:
                        await slots.acquire()
                    life = asyncio.create_task(one(node_id, targets[n % len(targets)]))
                    lives.add(life)
                    life.add_done_callback(lives.discard)
                    if slots is not None:
                        life.add_done_callback(lambda _: slots.release())
                    counts.started += 1
                while lives:
                    await asyncio.wait(set(lives))
            finally:
                for life in lives:
                    life.cancel()
                await asyncio.gather(*lives, return_exceptions=True)

        self._churn_task = asyncio.create_task(run())

    async def cmd_churned(self) -> dict[str, int]:
        """How far the churn got (:class:`ChurnCounts` as a dict)."""
        return dataclasses.asdict(self.churn)

    async def cmd_streams(self) -> _StreamReport:
        return {"streams": sum(p.streams for p in self.proxies), "proxies": len(self.proxies)}

    async def stop(self) -> None:
        tasks = [*self.tasks, *([self._churn_task] if self._churn_task is not None else [])]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _worker_main(fd: int) -> None:
    raise_fd_limit()
    # asyncio's own loop: uvloop made no measurable difference to the workers' CPU (1,000 proxies,
    # h2 client: 0.11-0.12 CPU s per push either way; most of it is protobuf and socket syscalls).
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_Worker(Connection(fd)).run())


# --------------------------------------------------------------------------------------------
# Coordinator side (no grpc in this process)
# --------------------------------------------------------------------------------------------


@dataclass
class WaitResult:
    """When each proxy reached what was waited for (epoch seconds; None: never, within the timeout)."""

    times: list[float | None]

    @property
    def failures(self) -> int:
        return sum(1 for t in self.times if t is None)

    def latencies(self, since: float) -> list[float]:
        return sorted(t - since for t in self.times if t is not None)


@dataclass
class Fleet:
    """N simulated proxies spread over worker processes."""

    target: str
    """The server's xDS address (``host:port``)."""
    proxies: int
    workers: int = 0
    """0: one per :data:`MAX_PER_WORKER` proxies, and at least one per core for 250 proxies or more."""
    rate: float = 0.0
    """Proxies started per second in each worker (0: all at once)."""
    client: str = "h2"
    """The proxies' gRPC client: ``h2`` (bench/h2client.py, lean) or ``grpc`` (grpc.aio channels)."""
    xds: str = "sotw"
    """The proxies' xDS variant (:data:`XDS_VARIANTS`): state of the world or delta."""
    node_prefix: str = "sim"
    tls: FleetTls | None = None
    """Connect over TLS (or mTLS) as this says; None: plaintext."""
    replicas: tuple[str, ...] = ()
    """More servers' xDS addresses: the proxies are spread evenly, proxy i connecting to
    ``(target, *replicas)[i % (1 + len(replicas))]``."""
    error_examples: dict[str, str] = field(default_factory=dict)
    """One example message per gRPC status seen (filled by :meth:`errors`)."""
    _conns: list[Connection] = field(default_factory=list)
    _procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.client not in CLIENTS:
            raise ValueError(f"client {self.client!r}: one of {', '.join(CLIENTS)}")
        if self.xds not in XDS_VARIANTS:
            raise ValueError(f"xds {self.xds!r}: one of {', '.join(XDS_VARIANTS)}")
        if self.workers <= 0:
            # Real proxies run in parallel: use every core for a fleet big enough to keep them busy.
            self.workers = max(min(os.cpu_count() or 1, math.ceil(self.proxies / 250)),
                               math.ceil(self.proxies / MAX_PER_WORKER), 1)
        self.workers = min(self.workers, max(1, self.proxies))

    def start(self) -> None:
        # Workers are fresh interpreters (``python -m bench.fleet --worker FD``) talking over a
        # socketpair: no fork of a process with threads, no dependence on how __main__ was run.
        for _ in range(self.workers):
            ours, theirs = socket.socketpair()
            fd = theirs.detach()
            proc = subprocess.Popen([sys.executable, "-m", "bench.fleet", "--worker", str(fd)], pass_fds=(fd,),
                                    cwd=REPO, stdin=subprocess.DEVNULL)
            os.close(fd)
            self._conns.append(Connection(ours.detach()))
            self._procs.append(proc)
        shards: list[list[tuple[int, str]]] = [[] for _ in range(self.workers)]
        for i in range(self.proxies):
            shards[i % self.workers].append((i, f"{self.node_prefix}-{i:05d}"))
        tls = self.tls.as_dict() if self.tls is not None else None
        targets = [self.target, *self.replicas]
        # A worker answers once it has started its last proxy: with a ramp, after len(shard) / rate
        # seconds, longer when its event loop is busy syncing the ones it started first (10,000
        # delta proxies at 10 per second per worker: past the usual two minutes).
        ramp = max(map(len, shards)) / self.rate if self.rate > 0 else 0.0
        self._all("start", per_worker=[{"targets": targets, "ids": s, "rate": self.rate, "client": self.client,
                                        "tls": tls, "xds": self.xds} for s in shards], timeout=max(60.0, 2 * ramp))

    def _all(self, command: str, *, per_worker: list[dict[str, Any]] | None = None, **args: Any) -> list[Any]:
        for n, conn in enumerate(self._conns):
            conn.send((command, per_worker[n] if per_worker is not None else args))
        results = []
        for n, conn in enumerate(self._conns):
            if not conn.poll(args.get("timeout", 60) + 60):
                raise FleetError(f"worker {n} did not answer {command!r}")
            status, result = conn.recv()
            if status != "ok":
                raise FleetError(f"worker {n}: {command}: {result}")
            results.append(result)
        return results

    def _gather(self, results: list[list[tuple[int, float | None]]]) -> WaitResult:
        times: list[float | None] = [None] * self.proxies
        for shard in results:
            for index, at in shard:
                times[index] = at
        return WaitResult(times)

    def wait_synced(self, timeout: float) -> WaitResult:
        """Until every proxy has ACKed CDS, EDS, LDS and RDS at least once."""
        return self._gather(self._all("wait", versions=None, since=0.0, timeout=timeout))

    def wait_acked(self, versions: dict[str, str], *, since: float, timeout: float,
                   synced_only: bool = False) -> WaitResult:
        """Until every proxy has ACKed these versions (type URL -> version) at or after ``since``
        (``synced_only``: every proxy that had synced when the wait began; the others are counted
        as they are, usually as failures)."""
        return self._gather(self._all("wait", versions=versions, since=since, timeout=timeout,
                                      synced_only=synced_only))

    def errors(self, since: float = 0.0) -> dict[str, int]:
        """Errors, by gRPC status code, of streams opened since ``since`` (epoch seconds)."""
        total: Counter[str] = Counter()
        reports: list[_ErrorReport] = self._all("errors", since=since)
        for result in reports:
            total.update(result["counts"])
            self.error_examples.update(result["examples"])
        return dict(total)

    def cpu_seconds(self) -> float:
        """CPU seconds the simulator's worker processes have used (they share the server's cores)."""
        return sum(cpu_seconds(proc.pid) for proc in self._procs)

    def bytes_received(self) -> list[int]:
        """Bytes of response messages each proxy has received so far (by proxy index)."""
        received = [0] * self.proxies
        for shard in self._all("bytes"):
            for index, count in shard:
                received[index] = count
        return received

    def rss_kb(self) -> int:
        """Resident memory of the simulator's worker processes, summed (KiB)."""
        return sum(rss_kb(proc.pid) for proc in self._procs)

    def streams_opened(self) -> int:
        reports: list[_StreamReport] = self._all("streams")
        return sum(r["streams"] for r in reports)

    def churn(self, *, count: int, rate: float, prefix: str = "churn", envoy_node: bool = False,
              sync_timeout: float = 30.0, max_active: int = 0) -> None:
        """Start ``count`` more proxies, node ids ``{prefix}-N``, ``rate`` per second over all the
        workers, each leaving for good once synced (beside this fleet's steady proxies, which stay),
        at most ``max_active`` at once over all the workers (0: no limit); it runs in the
        background: :meth:`churned` says how far it got."""
        ids = [f"{prefix}-{n:06d}" for n in range(count)]
        shards = [ids[n::self.workers] for n in range(self.workers)]
        self._all("churn", per_worker=[{"targets": [self.target, *self.replicas], "ids": shard,
                                        "rate": rate / self.workers, "client": self.client, "xds": self.xds,
                                        "envoy_node": envoy_node, "sync_timeout": sync_timeout,
                                        "max_active": math.ceil(max_active / self.workers) if max_active else 0}
                                       for shard in shards])

    def churned(self) -> ChurnCounts:
        """How far :meth:`churn` got, over all the workers."""
        total = ChurnCounts()
        for counts in self._all("churned"):
            for name, value in counts.items():
                setattr(total, name, getattr(total, name) + value)
        return total

    def close(self) -> None:
        for conn in self._conns:
            try:
                conn.send(("stop", {}))
            except (BrokenPipeError, OSError):
                continue
        for conn in self._conns:
            try:
                if conn.poll(20):
                    conn.recv()
            except (EOFError, OSError):
                pass
        for proc in self._procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()  # by its PID
                proc.wait(5)
        self._conns.clear()
        self._procs.clear()

    def __enter__(self) -> Fleet:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()



# --------------------------------------------------------------------------------------------
# Command line: one fan-out run
# --------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        _worker_main(int(argv[1]))
        return 0
    from bench import fanout
    from bench.report import print_table
    from bench.workload import Workload

    parser = argparse.ArgumentParser(prog="python -m bench.fleet", description=__doc__.split("\n\n")[0])
    parser.add_argument("--proxies", type=int, default=100, help="simulated proxies (default: %(default)s)")
    parser.add_argument("--workers", type=int, default=0,
                        help=f"client processes (default: one per {MAX_PER_WORKER} proxies)")
    parser.add_argument("--changes", type=int, default=5, help="endpoint changes to time (default: %(default)s)")
    parser.add_argument("--services", type=int, default=100, help="clusters in the snapshot (default: %(default)s)")
    parser.add_argument("--endpoints", type=int, default=4, help="endpoints per cluster (default: %(default)s)")
    parser.add_argument("--listeners", type=int, default=10,
                        help="services with an HTTP listener + route config (default: %(default)s)")
    parser.add_argument("--quiet-ms", type=int, default=100, help="server debounce (default: %(default)s)")
    parser.add_argument("--server", choices=("pilotfish", "naive"), default="pilotfish")
    parser.add_argument("--change", choices=("registry", "file"), default="registry",
                        help="how the change is made (naive: file only)")
    parser.add_argument("--workdir", default=None, help="keep the server's files here (default: a temp dir)")
    parser.add_argument("--client", choices=CLIENTS, default="h2",
                        help="the proxies' gRPC client: bench/h2client.py or grpc.aio (default: %(default)s)")
    parser.add_argument("--xds", choices=XDS_VARIANTS, default="sotw",
                        help="the proxies' xDS: state of the world or delta (default: %(default)s)")
    args = parser.parse_args(argv)
    workload = Workload(services=args.services, endpoints=args.endpoints, listeners=min(args.listeners, args.services))
    result = fanout.run_fanout(server=args.server, proxies=args.proxies, changes=args.changes, workload=workload,
                               quiet_ms=args.quiet_ms, change=args.change, workers=args.workers,
                               workdir=args.workdir, client=args.client, xds=args.xds)
    print(f"workload: {workload.describe()}; change: {result.change}; client: {args.client}; xds: {args.xds}; "
          f"load before: {load_1min():.2f}")
    print_table(fanout.FANOUT_COLUMNS, [result.row()])
    if result.error_examples:
        print(f"stream errors during the changes: {result.errors_during_changes or 'none'}")
        for code, example in result.error_examples.items():
            print(f"  e.g. {code}: {example}")
    return 0 if result.failures == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
