"""Shared pieces for unit tests: snapshot builders, an in-memory stream pair, and a real etcd
member for the modules that talk to etcd."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import pytest
from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.core.v3 import config_source_pb2
from envoy.service.discovery.v3 import discovery_pb2
from google.protobuf import json_format

from pilotfish.cache import DEFAULT_GROUP, Cancel, NodeGroup, SnapshotCache
from pilotfish.errors import PeerError
from pilotfish.protocol import RequestOutcome, SotwStream, Watch
from pilotfish.resources import CLUSTER, ENDPOINT, LISTENER, ROUTE, RUNTIME, SECRET, TypeUrl, type_by_url
from pilotfish.resources.bootstrap import BootstrapSettings, bootstrap
from pilotfish.resources.parse import parse_resource
from pilotfish.resources.wire import nonce_field
from pilotfish.snapshot import EncodedResponse, Snapshot

CDS, EDS, LDS, RDS = CLUSTER.url, ENDPOINT.url, LISTENER.url, ROUTE.url
RTDS = RUNTIME.url


def cluster(name: str, timeout: str = "1s") -> dict[str, Any]:
    return {
        "name": name,
        "type": "EDS",
        "connect_timeout": timeout,
        "eds_cluster_config": {"eds_config": {"ads": {}, "resource_api_version": "V3"}},
    }


def assignment(name: str, *ports: int) -> dict[str, Any]:
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


HCM_TYPE = "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"


def listener(name: str, route: str, port: int = 10000) -> dict[str, Any]:
    return {
        "name": name,
        "address": {"socket_address": {"address": "127.0.0.1", "port_value": port}},
        "filter_chains": [
            {
                "filters": [
                    {
                        "name": "hcm",
                        "typed_config": {
                            "@type": HCM_TYPE,
                            "stat_prefix": name,
                            "rds": {
                                "route_config_name": route,
                                "config_source": {"ads": {}, "resource_api_version": "V3"},
                            },
                            "http_filters": [
                                {
                                    "name": "router",
                                    "typed_config": {
                                        "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"
                                    },
                                }
                            ],
                        },
                    }
                ]
            }
        ],
    }


def route(name: str, cluster_name: str) -> dict[str, Any]:
    return {
        "name": name,
        "virtual_hosts": [
            {
                "name": "all",
                "domains": ["*"],
                "routes": [{"match": {"prefix": "/"}, "route": {"cluster": cluster_name}}],
            }
        ],
    }


def layer(name: str, **keys: Any) -> dict[str, Any]:
    """A runtime layer (RTDS) as the snapshot file's ``runtime:`` section writes it."""
    return {"name": name, "layer": keys}


def build(
    clusters: Iterable[dict[str, Any]] = (),
    endpoints: Iterable[dict[str, Any]] = (),
    listeners: Iterable[dict[str, Any]] = (),
    routes: Iterable[dict[str, Any]] = (),
    version: str | None = None,
    runtime: Iterable[dict[str, Any]] = (),
) -> Snapshot:
    """A snapshot from resources in Envoy JSON shape."""

    def parse(rtype: Any, items: Iterable[dict[str, Any]]) -> list[Any]:
        parsed = [parse_resource(rtype, item, rtype.key) for item in items]
        assert all(not problems for _, problems in parsed), parsed
        return [message for message, _ in parsed]

    return Snapshot.build(
        {
            CLUSTER: parse(CLUSTER, clusters),
            ENDPOINT: parse(ENDPOINT, endpoints),
            LISTENER: parse(LISTENER, listeners),
            ROUTE: parse(ROUTE, routes),
            RUNTIME: parse(RUNTIME, runtime),
        },
        version=version,
    )


def mixes(pool: Sequence[Snapshot], rng: random.Random, count: int) -> list[Snapshot]:
    """``count`` snapshots each made type by type of the very TypeSnapshot objects of snapshots of
    ``pool``, as builds keep the object of a type nothing changed in (so the cache sees types it
    has served before, and answers only what is new). Only the first five types (CDS, EDS, LDS,
    RDS, SDS) are mixed; the others are ``pool[0]``'s: so the draws, and the examples property
    tests index by position, stay the same as types are added."""
    mixed = (CLUSTER.url, ENDPOINT.url, LISTENER.url, ROUTE.url, SECRET.url)
    return [
        Snapshot(
            MappingProxyType(
                {url: rng.choice(pool).types[url] if url in mixed else pool[0].types[url] for url in pool[0].types}
            )
        )
        for _ in range(count)
    ]


@dataclass
class Received:
    """A response as the proxy decodes it."""

    type_url: str
    version: str
    nonce: str
    names: list[str]


@dataclass
class StreamPair:
    """A proxy's stream and the server side, wired through a real cache, with no I/O.

    Mirrors what ``xds/server.py`` does per stream: each request is encoded and read back by
    :meth:`SotwStream.decode_request` (which may find a plain ACK by its bytes alone), each
    request's watch replaces the previous one of its type; responses get their nonce from the
    state machine and are decoded here. A twin stream is fed every request as a decoded message
    (:meth:`SotwStream.on_request`) and every response: after each request both must agree on
    the outcome and on what the stream has seen.
    """

    cache: SnapshotCache
    stream: SotwStream = field(default_factory=SotwStream)
    twin: SotwStream | None = None
    """Fed what ``stream`` is fed, the requests decoded (None: made like ``stream``)."""
    inbox: list[Received] = field(default_factory=list)
    bodies: list[bytes] = field(default_factory=list)
    """The body objects of the responses, as the cache shared them (for tests of sharing)."""
    outcomes: list[RequestOutcome] = field(default_factory=list)
    group: Callable[[], NodeGroup] = lambda: DEFAULT_GROUP
    """The cache group each watch is opened on (a rollout routes a proxy to its baseline or candidate)."""
    watches: dict[TypeUrl, Watch] = field(default_factory=dict)
    """The latest watch of each type."""
    _cancels: dict[TypeUrl, Cancel] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.twin is None:
            self.twin = SotwStream(type_url=self.stream.type_url, limits=self.stream.limits)

    def _respond(self, watch: Watch, response: EncodedResponse) -> None:
        assert self.twin is not None
        self.twin.on_response(watch, response)
        nonce, response = self.stream.on_response(watch, response)
        self.bodies.append(response.body)
        decoded = discovery_pb2.DiscoveryResponse.FromString(response.body + nonce_field(nonce))
        names = []
        for any_msg in decoded.resources:
            rtype = type_by_url(decoded.type_url)
            assert rtype is not None
            message = rtype.message()
            assert any_msg.Unpack(message)
            names.append(getattr(message, rtype.name_field))
        self.inbox.append(Received(decoded.type_url, decoded.version_info, decoded.nonce, names))

    def send(
        self,
        type_url: str,
        names: Sequence[str] = (),
        *,
        version: str = "",
        nonce: str = "",
        error: str | None = None,
        node_id: str | None = None,
    ) -> list[Received]:
        """Send a request; return the responses it caused at once."""
        request = discovery_pb2.DiscoveryRequest(
            type_url=type_url, resource_names=list(names), version_info=version, response_nonce=nonce
        )
        if node_id is not None:
            request.node.id = node_id
        if error is not None:
            request.error_detail.message = error
        outcome = self._step(request.SerializeToString())
        self.outcomes.append(outcome)
        before = len(self.inbox)
        for watch in outcome.watches:
            self.open(watch)
        return self.inbox[before:]

    def _step(self, data: bytes) -> RequestOutcome:
        """``data`` through the stream as the server reads it, and decoded through the twin: the
        same outcome, and the same state after (or the same error)."""
        twin = self.twin
        assert twin is not None
        try:
            outcome = self.stream.on_decoded(self.stream.decode_request(data))
        except PeerError as exc:
            with pytest.raises(type(exc)):
                twin.on_request(discovery_pb2.DiscoveryRequest.FromString(data))
            raise
        expected = twin.on_request(discovery_pb2.DiscoveryRequest.FromString(data))
        assert _seen(outcome, self.stream) == _seen(expected, twin)
        return outcome

    def open(self, watch: Watch) -> None:
        """Open ``watch`` in place of the stream's previous one of its type (as the server does)."""
        previous = self._cancels.pop(watch.type_url, None)
        if previous:
            previous()
        self.watches[watch.type_url] = watch
        self._cancels[watch.type_url] = self.cache.create_watch(watch, self._respond, self.group())

    def ack(self, received: Received, names: Sequence[str] = ()) -> list[Received]:
        return self.send(received.type_url, names, version=received.version, nonce=received.nonce)

    def publish(self, snapshot: Snapshot) -> list[Received]:
        """Set a new snapshot in the cache; return the responses this stream got."""
        before = len(self.inbox)
        self.cache.set_snapshot(snapshot)
        return self.inbox[before:]


def _seen(outcome: RequestOutcome, stream: SotwStream) -> tuple[object, ...]:
    """A request's outcome and what its stream has seen after it, comparable across two streams
    (a cluster watch carries its own stream; a response sent is known by its bytes; the names'
    bytes are kept only when read from bytes)."""
    watches = tuple((w._replace(routing=None), w.routing is stream) for w in outcome.watches)
    states = {
        url: tuple(
            (value.body, value.version, value.carried) if isinstance(value, EncodedResponse) else value
            for name, value in ((f.name, getattr(state, f.name)) for f in dataclasses.fields(state))
            if name != "names_wire"
        )
        for url, state in stream.types.items()
    }
    return outcome._replace(watches=()), watches, states, stream.node, stream.ttl


@pytest.fixture
def cache() -> SnapshotCache:
    return SnapshotCache()


@pytest.fixture
def pair(cache: SnapshotCache) -> StreamPair:
    return StreamPair(cache)


def eds_source(cluster: cluster_pb2.Cluster) -> config_source_pb2.ConfigSource:
    """Where a cluster gets its endpoints from."""
    return cluster.eds_cluster_config.eds_config


def bootstrap_source(refresh: float) -> config_source_pb2.ConfigSource:
    """What ``pilotfish bootstrap --rest`` polls CDS and LDS with."""
    config = bootstrap(BootstrapSettings(node_id="n", rest="127.0.0.1:18001", refresh=refresh))
    cds, lds = (
        json_format.ParseDict(config["dynamic_resources"][key], config_source_pb2.ConfigSource())
        for key in ("cds_config", "lds_config")
    )
    assert cds == lds
    return cds


ADS_SOURCE = json_format.ParseDict({"ads": {}, "resource_api_version": "V3"}, config_source_pb2.ConfigSource())
"""The config source of a resource that comes over the ADS stream."""
