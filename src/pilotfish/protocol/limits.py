"""Limits on what one xDS request may carry and what a stream keeps of it. No I/O.

A proxy is trusted with nothing it could make large: the names it subscribes to are kept for the
life of its stream (and interned), its node for as long as well, and its ``version_info`` and NACK
messages go into the sync status and the event log. :meth:`SotwStream.on_request
<pilotfish.protocol.SotwStream.on_request>` checks each request against :class:`XdsLimits`:

- over a count or size the server would have to keep (names per request, the node's size):
  :class:`PeerOverLimit`, which the server answers with RESOURCE_EXHAUSTED;
- a node id longer than any real one: :class:`~pilotfish.errors.PeerError` (INVALID_ARGUMENT);
- ``version_info`` and ``error_detail.message`` are kept shortened (their start and end), never
  refused: a proxy stating a long version is only sent the current one again.

Every error message repeats at most :attr:`XdsLimits.echo_chars` of a peer's value (a 17 MB
``type_url`` must not come back in a gRPC status), names the limit and says what to do. The
defaults are far above what Envoy and gRPC send (node ids of tens of characters, a few KB of
metadata, names in the thousands) and far below what would hurt.
"""

from __future__ import annotations

from dataclasses import dataclass

from envoy.config.core.v3 import base_pb2

from pilotfish.errors import PeerError, shorten
from pilotfish.resources import ResourceType, TypeUrl, type_by_url
from pilotfish.resources.types import RESOURCE_IN_SOTW, SUPPORTS_TTL

__all__ = ["DEFAULT_LIMITS", "PeerOverLimit", "XdsLimits", "kept_node", "requested_type", "shorten", "takes_ttls"]


@dataclass(frozen=True, slots=True, kw_only=True)
class XdsLimits:
    """What one xDS request may carry, and how much of it a stream keeps."""

    max_resource_names: int = 100_000
    """Resource names one request may subscribe to; more: RESOURCE_EXHAUSTED, stream ended."""
    max_node_id_chars: int = 1024
    """Characters of ``node.id``; longer: INVALID_ARGUMENT (Envoy's ids are tens of characters)."""
    max_node_bytes: int = 32 * 1024
    """Encoded bytes of what a stream keeps of its node (id, cluster, metadata, locality, user
    agent; not Envoy's extension list, which is dropped); more: RESOURCE_EXHAUSTED."""
    max_version_chars: int = 1024
    """Characters of a request's ``version_info`` kept (status, event log); a longer one is kept
    shortened, which only means the proxy is sent the current version."""
    max_error_chars: int = 4096
    """Characters of a NACK's ``error_detail.message`` kept (status, event log, warning); a longer
    one keeps its start and its end (where Envoy writes the reason)."""
    echo_chars: int = 200
    """Characters of a peer's value an error message repeats."""


DEFAULT_LIMITS = XdsLimits()


class PeerOverLimit(PeerError):
    """A request over one of the :class:`XdsLimits` the server keeps memory by."""


def takes_ttls(node: base_pb2.Node, *, sotw: bool) -> bool:
    """Whether a client is sent resources with their TTLs: it announces :data:`SUPPORTS_TTL` and,
    over SotW, :data:`RESOURCE_IN_SOTW` (a TTL travels in a Resource wrapper there). A client that
    announces nothing gets them without: it keeps them until told otherwise, as it would any
    resource (pilotfish's ``bootstrap`` writes both features into the node)."""
    features = node.client_features
    if not features or SUPPORTS_TTL not in features:
        return False
    return not sotw or any(feature in features for feature in RESOURCE_IN_SOTW)


def kept_node(node: base_pb2.Node, limits: XdsLimits) -> base_pb2.Node:
    """What identifies a proxy, without the rest: Envoy's node lists every extension it was built
    with (tens of KB), which would otherwise be kept for the life of every stream. Raises
    :class:`PeerError` if what is kept is over ``limits``."""
    if len(node.id) > limits.max_node_id_chars:
        raise PeerError(
            f"node.id {shorten(node.id, limits.echo_chars)!r} is {len(node.id):,} characters long, over the "
            f"limit of {limits.max_node_id_chars:,} (XdsLimits.max_node_id_chars): give the proxy a shorter "
            "node id (Envoy: --service-node or node.id in its bootstrap)"
        )
    kept = base_pb2.Node(id=node.id, cluster=node.cluster, user_agent_name=node.user_agent_name)
    if node.HasField("metadata"):
        kept.metadata.CopyFrom(node.metadata)
    if node.HasField("locality"):
        kept.locality.CopyFrom(node.locality)
    agent_version = node.WhichOneof("user_agent_version_type")
    if agent_version == "user_agent_version":
        kept.user_agent_version = node.user_agent_version
    elif agent_version == "user_agent_build_version":  # Envoy's: its semantic version, not its build metadata
        kept.user_agent_build_version.version.CopyFrom(node.user_agent_build_version.version)
    size = kept.ByteSize()
    if size > limits.max_node_bytes:
        raise PeerOverLimit(
            f"node {shorten(node.id, limits.echo_chars)!r}: its id, cluster, metadata, locality and user agent "
            f"take {size:,} bytes, over the limit of {limits.max_node_bytes:,} (XdsLimits.max_node_bytes): "
            "send less node metadata, or raise the limit"
        )
    return kept


def requested_type(type_url: str, served: TypeUrl | None, limits: XdsLimits) -> tuple[TypeUrl, ResourceType]:
    """The type a request asks for: its ``type_url``, or the one a per-type stream (``served``)
    serves. Raises :class:`PeerError` if an ADS request has none, or names another type than the
    stream serves, or one pilotfish does not serve."""
    url = TypeUrl(type_url or (served or ""))
    if not url:
        raise PeerError("an aggregated (ADS) request must carry type_url")
    if served is not None and url != served:
        raise PeerError(
            f"this stream serves {served}, not {shorten(url, limits.echo_chars)!r}: "
            "send that type on its own service or on ADS"
        )
    rtype = type_by_url(url)
    if rtype is None:
        raise PeerError(
            f"unsupported type_url {shorten(url, limits.echo_chars)!r}: pilotfish serves "
            "the v3 Cluster, ClusterLoadAssignment, Listener, RouteConfiguration and Secret types"
        )
    return url, rtype
