"""Type URLs of the xDS resources pilotfish serves, in ADS order.

ADS order (CDS, EDS, ECDS, LDS, RDS, SDS, then RTDS) is the order in which responses for one change go out
on an aggregated stream, so that everything a resource refers to exists before it does
(https://www.envoyproxy.io/docs/envoy/latest/api-docs/xds_protocol#eventual-consistency-considerations).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NewType

from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.core.v3 import extension_pb2
from envoy.config.endpoint.v3 import endpoint_pb2
from envoy.config.listener.v3 import listener_pb2
from envoy.config.route.v3 import route_pb2
from envoy.extensions.transport_sockets.tls.v3 import secret_pb2
from envoy.service.runtime.v3 import rtds_pb2
from google.protobuf.message import Message

__all__ = [
    "ADS_ORDER",
    "CLUSTER",
    "ENDPOINT",
    "EXTENSION_CONFIG",
    "LISTENER",
    "RESOURCE_IN_SOTW",
    "ROUTE",
    "RUNTIME",
    "SECRET",
    "SUPPORTS_TTL",
    "TYPES",
    "ResourceType",
    "TypeUrl",
    "type_by_key",
    "type_by_url",
]

TypeUrl = NewType("TypeUrl", str)
"""A resource type URL, e.g. ``type.googleapis.com/envoy.config.cluster.v3.Cluster``."""

_PREFIX = "type.googleapis.com/"


@dataclass(frozen=True, slots=True)
class ResourceType:
    """One kind of xDS resource and how pilotfish treats it."""

    key: str
    """Its section name in a snapshot file (``clusters``, ``endpoints``...)."""
    url: TypeUrl
    message: type[Message]
    name_field: str
    """The field holding the resource's name (``cluster_name`` for endpoints)."""
    wildcard: bool
    """CDS and LDS: a stream that names nothing gets everything, and responses are full state."""
    short: str
    """CDS, EDS...: for logs and messages."""


def _make(key: str, message: type[Message], name_field: str, wildcard: bool, short: str) -> ResourceType:
    return ResourceType(
        key=key,
        url=TypeUrl(_PREFIX + message.DESCRIPTOR.full_name),
        message=message,
        name_field=name_field,
        wildcard=wildcard,
        short=short,
    )


CLUSTER = _make("clusters", cluster_pb2.Cluster, "name", True, "CDS")
ENDPOINT = _make("endpoints", endpoint_pb2.ClusterLoadAssignment, "cluster_name", False, "EDS")
EXTENSION_CONFIG = _make("extension_configs", extension_pb2.TypedExtensionConfig, "name", False, "ECDS")
"""Extension configs (ECDS): a filter's config by name. Before LDS: a listener whose filter takes
its config from ECDS waits (warming) until that config has arrived."""
LISTENER = _make("listeners", listener_pb2.Listener, "name", True, "LDS")
ROUTE = _make("routes", route_pb2.RouteConfiguration, "name", False, "RDS")
SECRET = _make("secrets", secret_pb2.Secret, "name", False, "SDS")
RUNTIME = _make("runtime", rtds_pb2.Runtime, "name", False, "RTDS")
"""Runtime layers (RTDS): last in ADS order, since nothing else refers to them; Envoy asks for
each ``rtds_layer`` of its bootstrap by name."""

TYPES: tuple[ResourceType, ...] = (CLUSTER, ENDPOINT, EXTENSION_CONFIG, LISTENER, ROUTE, SECRET, RUNTIME)
ADS_ORDER: tuple[TypeUrl, ...] = tuple(t.url for t in TYPES)

_BY_URL = {t.url: t for t in TYPES}
_BY_KEY = {t.key: t for t in TYPES}


def type_by_url(url: str) -> ResourceType | None:
    """The resource type for a type URL, or None when pilotfish does not serve it."""
    return _BY_URL.get(TypeUrl(url))


def type_by_key(key: str) -> ResourceType | None:
    """The resource type for a snapshot-file section name, or None."""
    return _BY_KEY.get(key)


SUPPORTS_TTL = "xds.config.supports-resource-ttl"
"""The client feature (``Node.client_features``) of a client that honours a resource's TTL and
renews it from heartbeats."""
RESOURCE_IN_SOTW = ("xds.config.resource-in-sotw", "xds.config.supports-resource-in-sotw")
"""The client feature of a client that unwraps a ``discovery.v3.Resource`` in a SotW response
(as Envoy's list of well-known features spells it, and the longer spelling some write)."""
