"""REST xDS polls: what a JSON ``DiscoveryRequest`` asks for, and whether the client is current. No I/O.

A REST client (Envoy with ``api_type: REST``) has no stream: it POSTs its whole state every
refresh delay (its node, the names it wants, and ``version_info``, the version of the last
response it *accepted*; Envoy sets it only after applying a response) and the server answers each
poll on its own, with the full subscribed set or with 304 Not Modified
(https://www.envoyproxy.io/docs/envoy/latest/api-docs/xds_protocol#rest-json-polling-subscriptions).
So there are no nonces, no ACK and no NACK: a response Envoy rejects shows only in its own log
and stats (``update_rejected``), and in its next poll still stating the older version.

The rules, per poll:

- Names follow the SotW rules of a first request (:func:`~pilotfish.protocol.next_subscription`):
  CDS and LDS with no names (or ``*``) get everything; EDS, RDS and SDS get the named resources.
- **Current** (answered 304): ``version_info`` is the type's current version; or, for a poll that
  names its resources (not everything), it is a version the cache still keeps and every named
  resource is the same there as now (same content, or absent from both). So a change to one
  cluster's endpoints answers the polls for that cluster with 200 and every other cluster's
  with 304, as incremental SotW sends only what changed. A poll stating a version no longer kept
  gets the full response, which is always correct.
- Otherwise: 200 with every subscribed resource that exists, at the type's current version.

What a peer could make large is checked against :class:`~pilotfish.protocol.XdsLimits`, as on a
gRPC stream: names per poll (:class:`~pilotfish.protocol.PeerOverLimit`), node id and node size
(:func:`~pilotfish.protocol.limits.kept_node`); ``version_info`` is kept shortened.
"""

from __future__ import annotations

from dataclasses import dataclass

from envoy.config.core.v3 import base_pb2
from envoy.service.discovery.v3 import discovery_pb2

from pilotfish.errors import PeerError
from pilotfish.protocol.limits import PeerOverLimit, XdsLimits, kept_node, shorten
from pilotfish.protocol.subscription import Subscription, next_subscription
from pilotfish.resources import ResourceType
from pilotfish.snapshot import TypeSnapshot

__all__ = ["RestPoll", "is_current", "read_poll"]


@dataclass(frozen=True, slots=True)
class RestPoll:
    """One REST poll, checked."""

    rtype: ResourceType
    node: base_pb2.Node
    """The poll's node, without Envoy's extension list (what a gRPC stream keeps)."""
    version_info: str
    """The version the client says it has applied ("" on its first poll), shortened if long."""
    subscription: Subscription


def read_poll(request: discovery_pb2.DiscoveryRequest, rtype: ResourceType, limits: XdsLimits) -> RestPoll:
    """Check a request POSTed to ``rtype``'s path. Raises :class:`PeerError` naming the field at
    fault (:class:`PeerOverLimit` when over a limit)."""
    if request.type_url and request.type_url != rtype.url:
        raise PeerError(
            f"type_url {shorten(request.type_url, limits.echo_chars)!r} is not the type of this path "
            f"({rtype.url}): POST it to the path of its type, or leave type_url out"
        )
    count = len(request.resource_names)
    if count > limits.max_resource_names:
        raise PeerOverLimit(
            f"resource_names: this {rtype.short} poll names {count:,} resources, over the limit of "
            f"{limits.max_resource_names:,} per request (XdsLimits.max_resource_names): subscribe to fewer, "
            "or raise the limit"
        )
    node = kept_node(request.node, limits)
    version_info = request.version_info
    if len(version_info) > limits.max_version_chars:
        version_info = shorten(version_info, limits.max_version_chars)
    subscription = next_subscription(request.resource_names, wildcard_capable=rtype.wildcard, ever_named=False)
    return RestPoll(rtype, node, version_info, subscription)


def is_current(poll: RestPoll, current: TypeSnapshot, stated: TypeSnapshot | None) -> bool:
    """Whether the client already has what ``current`` would send it (answer 304). ``stated``: the
    type as it was at the poll's ``version_info``, if the cache still keeps that version."""
    if not poll.version_info:
        return False
    if poll.version_info == current.version:
        return True
    if stated is None or poll.subscription.wildcard:
        return False
    now, then = current.resources, stated.resources
    for name in poll.subscription.names:
        resource, before = now.get(name), then.get(name)
        if resource is None or before is None:
            if resource is not before:
                return False
        elif resource.hash != before.hash:
            return False
    return True
