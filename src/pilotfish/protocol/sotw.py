"""The state-of-the-world (SotW) xDS stream state machine. No I/O.

Everything that changes what a SotW stream has seen lives here, so the rules read top to bottom:
a :class:`~envoy.service.discovery.v3.discovery_pb2.DiscoveryRequest` goes in through
:meth:`SotwStream.on_request` and a :class:`RequestOutcome` comes out (what kind of request it was
and which :class:`Watch` to open); a response the cache produced goes through
:meth:`SotwStream.on_response`, which gives it its nonce.

Per type, a stream remembers the last nonce it sent, the version and names that response
carried, and the subscription. The rules (DESIGN.md behaviours 2-13,
https://www.envoyproxy.io/docs/envoy/latest/api-docs/xds_protocol):

- A request whose ``response_nonce`` is not the latest nonce sent for its type is stale: ignored.
- No nonce: a first request; the proxy has ``version_info`` (empty on a fresh start). A proxy
  reconnecting with the current version is sent nothing it already has.
- Nonce and ``error_detail``: a NACK. The proxy still runs the version in ``version_info``; the
  rejected content is not re-sent, only newer content is.
- Nonce and no error: an ACK of what was sent.
- After a CDS response, the next EDS request is answered even if nothing changed (a re-created
  cluster waits for its endpoints to warm); likewise RDS after LDS.
- A cluster watch carries the LDS and RDS versions the proxy has ACKed, so the cache can keep a
  removed cluster until the routes that used it have moved; an ACK of LDS or RDS re-opens it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import NamedTuple, NewType

from envoy.config.core.v3 import base_pb2
from envoy.service.discovery.v3 import discovery_pb2

from pilotfish.errors import PeerError
from pilotfish.protocol.subscription import Subscription, Watch, next_subscription
from pilotfish.resources import CLUSTER, ENDPOINT, LISTENER, ROUTE, TypeUrl, type_by_url
from pilotfish.snapshot import EncodedResponse

__all__ = ["Nonce", "RequestKind", "RequestOutcome", "SotwStream", "TypeState"]

Nonce = NewType("Nonce", str)

# After a response of the key type, the value type's next request is answered (behaviour 13).
_WARMS = {CLUSTER.url: ENDPOINT.url, LISTENER.url: ROUTE.url}
# ACKs of these types may release clusters held back for make-before-break (behaviour 12).
_ROUTING = frozenset({LISTENER.url, ROUTE.url})


def _identity(node: base_pb2.Node) -> base_pb2.Node:
    """What identifies a proxy, without the rest: Envoy's node lists every extension it was built
    with (tens of KB), which would otherwise be kept for the life of every stream."""
    kept = base_pb2.Node(id=node.id, cluster=node.cluster, user_agent_name=node.user_agent_name)
    if node.HasField("metadata"):
        kept.metadata.CopyFrom(node.metadata)
    if node.HasField("locality"):
        kept.locality.CopyFrom(node.locality)
    if node.WhichOneof("user_agent_version_type") == "user_agent_version":
        kept.user_agent_version = node.user_agent_version
    return kept


class RequestKind(enum.Enum):
    REQUEST = "request"
    """No response_nonce: the first request of this type on the stream."""
    ACK = "ack"
    NACK = "nack"
    STALE = "stale"
    """A response_nonce that is not the latest sent: ignored."""


class RequestOutcome(NamedTuple):
    """What a request meant, and what the server should do about it."""

    kind: RequestKind
    type_url: TypeUrl
    version_info: str
    response_nonce: str
    error: str | None
    watches: tuple[Watch, ...]
    """Open these watches, each replacing the stream's current one for its type."""
    rejected_version: str | None = None
    """For a NACK: the version the proxy rejected."""
    subscription_changed: bool = False
    """The request named other resources than the stream's previous request of its type."""


@dataclass(slots=True)
class TypeState:
    """What one stream has seen of one type."""

    type_url: TypeUrl
    wildcard_capable: bool
    subscription: Subscription | None = None
    ever_named: bool = False
    nonce: Nonce | None = None
    sent_version: str | None = None
    sent_names: frozenset[str] = frozenset()
    sent_wildcard: bool = False
    acked_version: str | None = None
    last_acked_nonce: Nonce | None = None
    warm_pending: bool = False


@dataclass(slots=True)
class SotwStream:
    """One SotW stream: ADS (``type_url`` None, any type) or a per-type service."""

    type_url: TypeUrl | None = None
    node: base_pb2.Node | None = None
    types: dict[TypeUrl, TypeState] = field(default_factory=dict)
    _sent: int = 0

    def on_request(self, request: discovery_pb2.DiscoveryRequest, *, names_wire: bytes | None = None) -> RequestOutcome:
        """Classify a request and decide what to watch. Raises :class:`PeerError` on bad input.

        ``names_wire``: the encoded bytes of the request's ``resource_names``, if the caller has
        them (:func:`~pilotfish.resources.wire.request_names_span`): a shortcut, same result."""
        type_url = TypeUrl(request.type_url or (self.type_url or ""))
        if not type_url:
            raise PeerError("an aggregated (ADS) request must carry type_url")
        if self.type_url is not None and type_url != self.type_url:
            raise PeerError(f"this stream serves {self.type_url}, not {type_url}")
        rtype = type_by_url(type_url)
        if rtype is None:
            raise PeerError(f"unsupported type_url {type_url!r}")
        if self.node is None:
            # Envoy may send the node only on a stream's first request.
            self.node = _identity(request.node) if request.HasField("node") else base_pb2.Node()

        state = self.types.get(type_url)
        if state is None:
            state = self.types[type_url] = TypeState(type_url, wildcard_capable=rtype.wildcard)
        nonce = request.response_nonce
        error = request.error_detail.message if request.HasField("error_detail") else None

        if nonce and nonce != state.nonce:
            return RequestOutcome(RequestKind.STALE, type_url, request.version_info, nonce, error, ())

        subscription = next_subscription(
            request.resource_names, wildcard_capable=state.wildcard_capable, ever_named=state.ever_named,
            wire=names_wire,
        )
        if subscription.names:
            state.ever_named = True

        if not nonce:
            kind = RequestKind.REQUEST
            # The proxy has version_info (e.g. after reconnecting); assume it has what it names.
            known_version = request.version_info or None
            known_names = subscription.names
            known_wildcard = subscription.wildcard
        else:
            kind = RequestKind.NACK if error is not None else RequestKind.ACK
            known_version = state.sent_version
            known_names = state.sent_names
            known_wildcard = state.sent_wildcard

        changed = subscription is not state.subscription and subscription != state.subscription
        force = False
        if state.warm_pending and nonce:
            # A repeated request for the same response (or a changed subscription) after the
            # resources depending on this type changed: the proxy is warming and waits.
            force = nonce == state.last_acked_nonce or changed
        rejected = None
        if kind is RequestKind.ACK:
            state.acked_version = request.version_info
            state.last_acked_nonce = Nonce(nonce)
        elif kind is RequestKind.NACK:
            rejected = state.sent_version
        state.subscription = subscription

        watch = Watch(
            type_url=type_url,
            subscription=subscription,
            known_version=known_version,
            known_names=known_names,
            known_wildcard=known_wildcard,
            full_state=state.wildcard_capable,
            force=force,
            routing_acked=self._routing_acked() if type_url == CLUSTER.url else None,
        )
        watches: tuple[Watch, ...] = (watch,)
        if kind is RequestKind.ACK and type_url in _ROUTING:
            # Routes moved: clusters held back for them (make before break) may now go.
            clusters = self._rewatch_clusters()
            if clusters is not None:
                watches += (clusters,)
        return RequestOutcome(kind, type_url, request.version_info, nonce, error, watches, rejected, changed)

    def _routing_acked(self) -> tuple[str | None, str | None]:
        listeners, routes = self.types.get(LISTENER.url), self.types.get(ROUTE.url)
        return (listeners.acked_version if listeners else None, routes.acked_version if routes else None)

    def _rewatch_clusters(self) -> Watch | None:
        state = self.types.get(CLUSTER.url)
        if state is None or state.subscription is None or state.sent_version is None:
            return None
        return Watch(
            type_url=CLUSTER.url,
            subscription=state.subscription,
            known_version=state.sent_version,
            known_names=state.sent_names,
            known_wildcard=state.sent_wildcard,
            full_state=True,
            routing_acked=self._routing_acked(),
        )

    def on_response(self, watch: Watch, response: EncodedResponse) -> Nonce:
        """Record that ``response`` goes out for ``watch``; return its nonce (unique per stream)."""
        state = self.types[response.type_url]
        self._sent += 1
        nonce = Nonce(str(self._sent))
        state.nonce = nonce
        state.sent_version = response.version
        state.sent_names = response.names
        state.sent_wildcard = watch.subscription.wildcard
        state.warm_pending = False
        warmed = _WARMS.get(response.type_url)
        if warmed is not None and warmed in self.types:
            self.types[warmed].warm_pending = True
        return nonce
