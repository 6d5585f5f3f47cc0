"""The state-of-the-world (SotW) xDS stream state machine. No I/O.

Everything that changes what a SotW stream has seen lives here, so the rules read top to bottom:
a :class:`~envoy.service.discovery.v3.discovery_pb2.DiscoveryRequest` goes in through
:meth:`SotwStream.on_request` and a :class:`RequestOutcome` comes out (what kind of request it was
and which :class:`Watch` to open); a response the cache produced goes through
:meth:`SotwStream.on_response`, which gives it its nonce.

Per type, a stream remembers the last nonce it sent, the subscription, and what the proxy *holds*:
a version and the names it has at that version. That is the heart of deciding whether to answer.
The rules (docs/architecture.md, behaviours 2-13, https://www.envoyproxy.io/docs/envoy/latest/api-docs/xds_protocol):

- A request whose ``response_nonce`` is not the latest nonce sent for its type is stale: ignored.
- No nonce: the proxy has not seen a response of this type on this stream. On its first request
  of the type it states what it holds: ``version_info`` (empty on a fresh start) and, at that
  version, the names it requests. A proxy reconnecting with the current version is sent nothing.
- A response replaces what the proxy holds: the version and the names it carried (sent and
  rejected counts as held: a NACKed response is not re-sent, only newer content is).
- Every later request narrows it for EDS/RDS/SDS: a proxy drops a resource it unsubscribes from
  (Envoy does), so what it holds is the names of the last response (or of the first request)
  intersected with every subscription since. A name it requests and does not hold is sent, even
  at an unchanged version ("the server must resend any newly requested resources"), whether or
  not the stream has had a response yet. CDS and LDS responses are full state: the proxy's set
  changes only with a response, so theirs is not narrowed (a narrower subscription is answered
  with the narrower set instead).
- Nonce and ``error_detail``: a NACK. The proxy still runs the version in ``version_info``.
- Nonce and no error: an ACK of what was sent.
- After a CDS response, the next EDS request is answered even if nothing changed (a re-created
  cluster waits for its endpoints to warm); likewise RDS after LDS. This holds for a request with
  no nonce too: a proxy that reconnected and was sent new clusters asks again, nonce-less, for
  endpoints it already stated it holds.
- A cluster watch carries the stream, which the cache asks when it answers the watch whether the
  proxy's listeners and routes have moved: both the versions it says it runs (``version_info``)
  and the ones it was last sent (it may be running them already) are the snapshot's. Until then
  a removed cluster they used is kept; an ACK of LDS or RDS re-opens the cluster watch.

Decoding is part of it (:meth:`SotwStream.decode_request`): an EDS ACK from a proxy subscribed to
10,000 clusters repeats all 10,000 names (~110 KB) every time. When the request's names are, byte
for byte, those of the stream's previous request of that type, only its other fields are decoded
and the request is handled as "the same names as before": the same outcome, without decoding or
hashing the names. Anything else (other names, an odd layout, a malformed request) is decoded whole.

What a peer could make large is checked against the stream's :class:`~pilotfish.protocol.limits.XdsLimits`
first (names per request, node id and node size), or kept shortened (``version_info``, a NACK's
message); error messages repeat only the start and end of a peer's value.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import NamedTuple, NewType

from envoy.config.core.v3 import base_pb2
from envoy.service.discovery.v3 import discovery_pb2
from google.protobuf.message import DecodeError

from pilotfish.errors import PeerError
from pilotfish.protocol.limits import (
    DEFAULT_LIMITS,
    PeerOverLimit,
    XdsLimits,
    kept_node,
    requested_type,
    shorten,
    takes_ttls,
)
from pilotfish.protocol.subscription import ResourceState, Subscription, Watch, checked_wire, next_subscription
from pilotfish.resources import CLUSTER, ENDPOINT, LISTENER, ROUTE, TypeUrl
from pilotfish.resources.wire import is_plain_ack, request_names_span, split_request_names
from pilotfish.snapshot import EncodedResponse, Snapshot

__all__ = ["DecodedRequest", "Nonce", "RequestKind", "RequestOutcome", "SotwStream", "TypeState"]

Nonce = NewType("Nonce", str)

# After a response of the key type, the value type's next request is answered (behaviour 13).
_WARMS = {CLUSTER.url: ENDPOINT.url, LISTENER.url: ROUTE.url}
# ACKs of these types may release clusters held back for make-before-break (behaviour 12).
_ROUTING_TYPES = (LISTENER.url, ROUTE.url)
_ROUTING = frozenset(_ROUTING_TYPES)


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


class DecodedRequest(NamedTuple):
    """A request as :meth:`SotwStream.decode_request` read it, for :meth:`SotwStream.on_decoded`."""

    request: discovery_pb2.DiscoveryRequest | None
    """The request; without its ``resource_names`` if ``names_as_before``; None if ``acks``."""
    names_wire: bytes | None
    """The encoded ``resource_names``, if found without decoding them."""
    names_as_before: bool = False
    """The names are byte for byte those of the stream's previous request of the type, and were
    left undecoded."""
    acks: TypeUrl | None = None
    """The request is, byte for byte, the plain ACK of the latest response of this type (its
    version, the names as before, no node, no error): nothing of it was decoded."""


_TYPE_URL_CHARS = 256
"""Longer type URLs are none pilotfish serves (refused): no span is looked for."""


@dataclass(slots=True)
class TypeState:
    """What one stream has seen of one type."""

    type_url: TypeUrl
    wildcard_capable: bool
    subscription: Subscription | None = None
    """The latest request's subscription; None before the first request of this type."""
    names_wire: bytes | None = None
    """That request's encoded names (checked, interned), if known: the next request's names are
    compared with these bytes instead of being decoded."""
    ever_named: bool = False
    nonce: Nonce | None = None
    sent_version: str | None = None
    """The version of the last response: what a NACK rejects."""
    held_version: str | None = None
    """The version the proxy holds (or was sent and rejected); None: nothing."""
    held_names: frozenset[str] = frozenset()
    """Names the proxy holds at ``held_version``. For EDS/RDS/SDS always within the subscription
    (and usually the very subscription set, so an ACK compares them by identity)."""
    held_wildcard: bool = False
    """The proxy holds everything there was at ``held_version``."""
    acked_version: str | None = None
    running_version: str | None = None
    """The version the proxy says it runs: the ``version_info`` of its latest request of this type
    that was not stale (its first, an ACK or a NACK); None: nothing."""
    last_acked_nonce: Nonce | None = None
    rejected: bool = False
    """The latest response was NACKed."""
    warm_pending: bool = False
    """A CDS (for EDS) or LDS (for RDS) response went out since this type's last response."""
    sent: EncodedResponse | None = None
    """The last response sent. Held so that its snapshot's memo finds it for the next stream at
    the same place, however many other name sets were asked for meanwhile (the memo keeps what
    no stream holds only within its budget: :mod:`pilotfish.snapshot`)."""


@dataclass(slots=True)
class SotwStream:
    """One SotW stream: ADS (``type_url`` None, any type) or a per-type service."""

    type_url: TypeUrl | None = None
    node: base_pb2.Node | None = None
    types: dict[TypeUrl, TypeState] = field(default_factory=dict)
    limits: XdsLimits = DEFAULT_LIMITS
    ttl: bool = False
    """The client takes resources with TTLs (by the features its node announces,
    :func:`~pilotfish.protocol.limits.takes_ttls`): its watches say so."""
    _sent: int = 0

    def decode_request(self, data: bytes) -> DecodedRequest:
        """Decode an encoded DiscoveryRequest for :meth:`on_request`; raises :class:`PeerError`
        if it is not one.

        If its names are those of the stream's previous request of its type (the bytes are
        compared, :func:`~pilotfish.resources.wire.split_request_names`), only the rest of it is
        decoded, and ``names_as_before`` says so. Same outcome either way (a property test holds
        the two paths to it), at a fraction of the cost for a long list of names."""
        if self.node is not None:
            for seen in self.types.values():
                nonce, wire = seen.nonce, seen.names_wire
                if (
                    nonce is not None
                    and wire is not None
                    and nonce != seen.last_acked_nonce
                    and is_plain_ack(
                        data, version=seen.sent_version or "", names=wire, type_url=seen.type_url, nonce=nonce
                    )
                ):
                    return DecodedRequest(None, wire, True, seen.type_url)  # (by position: quicker)
        known = [wire for state in self.types.values() if (wire := state.names_wire)]
        split = split_request_names(data, known)
        request = None
        if split is not None:
            start, end = split
            try:
                request = discovery_pb2.DiscoveryRequest.FromString(data[:start] + data[end:] if end else data)
            except DecodeError:
                request = None  # decoded whole below, for the error
            else:
                state = self.types.get(TypeUrl(request.type_url or self.type_url or ""))
                wire = state.names_wire if state is not None else None
                if wire is not None and len(wire) == end - start and (not end or data.startswith(wire, start)):
                    return DecodedRequest(request, wire, names_as_before=True)
                if end:
                    request = None  # without its names
        if request is None:
            try:
                request = discovery_pb2.DiscoveryRequest.FromString(data)
            except DecodeError as exc:
                raise PeerError(f"undecodable DiscoveryRequest: {exc}") from None
        type_url = request.type_url
        # Not for a made-up type_url of megabytes: the span encodes (and caches a few) type URLs.
        names_wire = (
            request_names_span(data, type_url, request.response_nonce) if len(type_url) <= _TYPE_URL_CHARS else None
        )
        return DecodedRequest(request, names_wire)

    def on_decoded(self, decoded: DecodedRequest) -> RequestOutcome:
        """:meth:`on_request` for what :meth:`decode_request` read (a plain ACK that was not
        decoded: :meth:`on_plain_ack`)."""
        if decoded.acks is not None:
            return self.on_plain_ack(decoded.acks)
        assert decoded.request is not None
        return self.on_request(decoded.request, names_wire=decoded.names_wire, names_as_before=decoded.names_as_before)

    def on_plain_ack(self, type_url: TypeUrl) -> RequestOutcome:
        """What :meth:`on_request` does with the plain ACK of the latest response of
        ``type_url`` (as :meth:`decode_request` found it: its version, the names of the previous
        request of the type, no node, no error), without the request: the same outcome."""
        state = self.types[type_url]
        nonce, version_info = state.nonce, state.sent_version or ""
        assert nonce is not None and state.subscription is not None
        if len(version_info) > self.limits.max_version_chars:
            version_info = shorten(version_info, self.limits.max_version_chars)
        state.running_version = version_info or None
        return self._decided(state, RequestKind.ACK, version_info, nonce, None, state.subscription, changed=False)

    def on_request(
        self, request: discovery_pb2.DiscoveryRequest, *, names_wire: bytes | None = None, names_as_before: bool = False
    ) -> RequestOutcome:
        """Classify a request and decide what to watch. Raises :class:`PeerError` on bad input.

        ``names_wire``: the encoded bytes of the request's ``resource_names``, if the caller has
        them (:func:`~pilotfish.resources.wire.request_names_span`): a shortcut, same result.
        ``names_as_before``: only as :meth:`decode_request` says (the request's names are those
        of the previous request of its type, and were not decoded)."""
        limits = self.limits
        state, version_info, error = self._look_at(request)
        type_url = state.type_url
        nonce = request.response_nonce
        if nonce and nonce != state.nonce:
            return RequestOutcome(
                RequestKind.STALE, type_url, version_info, shorten(nonce, limits.echo_chars), error, ()
            )

        previous = state.subscription
        if names_as_before:
            # The very names of the request that made ``previous``: the same subscription (the
            # count was checked then; ever_named is as that request left it).
            assert previous is not None and names_wire is not None and names_wire is state.names_wire
            subscription = previous
        else:
            subscription = next_subscription(
                request.resource_names,
                wildcard_capable=state.wildcard_capable,
                ever_named=state.ever_named,
                wire=names_wire,
            )
            if subscription.names:
                state.ever_named = True
        changed = subscription is not previous and subscription != previous

        state.running_version = version_info or None
        stated = False
        if nonce:
            kind = RequestKind.NACK if error is not None else RequestKind.ACK
        else:
            kind = RequestKind.REQUEST
            if state.nonce is None:
                # Nothing sent on this stream yet: the proxy states what it holds (after
                # reconnecting, the names it asks for at version_info). A later request stating
                # another version is not trusted with names: it holds none that we know of.
                version = version_info or None
                if previous is None or version != state.held_version:
                    _held_from_request(state, subscription, version, first=previous is None)
                    stated = True
        if changed and not stated and not state.wildcard_capable:
            _narrow(state, subscription)
        if not names_as_before:
            state.names_wire = checked_wire(names_wire) if names_wire is not None else None
        return self._decided(state, kind, version_info, nonce, error, subscription, changed=changed)

    def _decided(
        self,
        state: TypeState,
        kind: RequestKind,
        version_info: str,
        nonce: str,
        error: str | None,
        subscription: Subscription,
        *,
        changed: bool,
    ) -> RequestOutcome:
        """The rest of a request that is not stale, once what the proxy holds is known: the ACK
        or NACK noted, the subscription kept, the watch to open."""
        type_url = state.type_url
        force = state.warm_pending and _answers_warming(state, nonce, changed)
        rejected = None
        if kind is RequestKind.ACK:
            state.acked_version = version_info
            state.last_acked_nonce = Nonce(nonce)
            state.rejected = False
        elif kind is RequestKind.NACK:
            rejected = state.sent_version
            state.rejected = True
        state.subscription = subscription

        # (By position: a NamedTuple of eleven fields is made several times faster so, and one
        # is made for every request of a fleet.)
        watch = Watch(
            type_url,
            subscription,
            state.held_version,  # known_version
            state.held_names,  # known_names
            state.held_wildcard,  # known_wildcard
            state.wildcard_capable,  # full_state
            force,
            self if type_url == CLUSTER.url else None,  # routing
            self.node.id if type_url == ENDPOINT.url and self.node is not None else None,  # proxy
            self.ttl,
            self.ttl and state.nonce is None and state.held_version is not None,  # renew
        )
        watches: tuple[Watch, ...] = (watch,)
        if kind is RequestKind.ACK and type_url in _ROUTING:
            # Routes moved: clusters held back for them (make before break) may now go.
            clusters = self._rewatch_clusters()
            if clusters is not None:
                watches += (clusters,)
        return RequestOutcome(kind, type_url, version_info, nonce, error, watches, rejected, changed)

    def _look_at(self, request: discovery_pb2.DiscoveryRequest) -> tuple[TypeState, str, str | None]:
        """The request's type state (made on its first request), its version_info and error
        message, both cut to their limits; its node kept if it is the stream's first. Raises
        :class:`PeerError` for an unknown type or too many names."""
        limits = self.limits
        type_url, rtype = requested_type(request.type_url, self.type_url, limits)
        count = len(request.resource_names)
        if count > limits.max_resource_names:
            raise PeerOverLimit(
                f"this {rtype.short} request names {count:,} resources, over the limit of "
                f"{limits.max_resource_names:,} per request (XdsLimits.max_resource_names): subscribe to "
                "fewer, or raise the limit"
            )
        if self.node is None:
            # Envoy may send the node only on a stream's first request.
            self.node = kept_node(request.node, limits) if request.HasField("node") else base_pb2.Node()
            self.ttl = takes_ttls(request.node, sotw=True)
        version_info = request.version_info
        if len(version_info) > limits.max_version_chars:
            version_info = shorten(version_info, limits.max_version_chars)
        state = self.types.get(type_url)
        if state is None:
            state = self.types[type_url] = TypeState(type_url, wildcard_capable=rtype.wildcard)
        error = (
            shorten(request.error_detail.message, limits.max_error_chars) if request.HasField("error_detail") else None
        )
        return state, version_info, error

    def routing_moved(self, snapshot: Snapshot) -> bool:
        """Whether the listeners and routes the proxy runs (as its latest request says) and those
        it was last sent (it may be running them already, or reject them) are ``snapshot``'s, so
        none uses a cluster ``snapshot`` removed (make before break, behaviour 12). Asked when a
        cluster watch is answered. A type the stream has not asked for counts as moved (a
        per-type CDS stream; a proxy that states its clusters before its routes)."""
        types = self.types
        for url in _ROUTING_TYPES:
            state = types.get(url)
            if state is not None:
                version = snapshot.version(url)
                if state.running_version not in (None, version) or state.held_version not in (None, version):
                    return False
        return True

    def _rewatch_clusters(self) -> Watch | None:
        state = self.types.get(CLUSTER.url)
        if state is None or state.subscription is None or state.held_version is None:
            return None
        return Watch(
            type_url=CLUSTER.url,
            subscription=state.subscription,
            known_version=state.held_version,
            known_names=state.held_names,
            known_wildcard=state.held_wildcard,
            full_state=True,
            routing=self,
            ttl=self.ttl,
        )

    def on_response(self, watch: Watch, response: EncodedResponse) -> tuple[Nonce, EncodedResponse]:
        """Record that ``response`` (or the whole of it: see below) goes out for ``watch``;
        return its nonce (unique per stream) and the response to send.

        A response of changes only (EDS, RDS, SDS) is sent whole if a cluster (for EDS) or
        listener (for RDS) response went out since this type's last one: a re-created cluster
        or listener waits for its endpoints or routes, changed or not (behaviour 13)."""
        state = self.types[response.type_url]
        if state.warm_pending:
            response = response.whole()
        self._sent += 1
        nonce = Nonce(str(self._sent))
        state.nonce = nonce
        state.sent_version = state.held_version = response.version
        state.held_names = response.names
        state.held_wildcard = watch.subscription.wildcard
        state.sent = response
        state.warm_pending = False
        state.rejected = False
        warmed = _WARMS.get(response.type_url)
        if warmed is not None:
            warmed_state = self.types.get(warmed)
            if warmed_state is None and self.type_url is None:
                # ADS: the proxy's first request of the warmed type may still be on its way,
                # stating what it held before it saw this response. (EDS and RDS are never
                # wildcard-capable.)
                warmed_state = self.types[warmed] = TypeState(warmed, wildcard_capable=False)
            if warmed_state is not None:
                warmed_state.warm_pending = True
        return nonce, response

    def on_refresh(self, type_url: TypeUrl) -> Nonce | None:
        """A response renewing the TTLs of what the proxy holds of ``type_url`` (the same
        version, its resources with a TTL sent again) is to go out: its nonce, or None if the
        type is not settled (a response is waiting for its ACK or NACK, or the last one was
        NACKed: what the proxy runs is not what it was sent). Nothing else changes: the proxy
        holds what it held, and the ACK of the refresh is an ACK of the same version."""
        state = self.types.get(type_url)
        if state is None or state.nonce is None or state.last_acked_nonce != state.nonce:
            return None
        self._sent += 1
        nonce = Nonce(str(self._sent))
        state.nonce = nonce
        return nonce

    def resource_states(self, type_url: TypeUrl) -> list[ResourceState]:
        """What the proxy has of each resource of ``type_url`` it subscribes to (a wildcard: of
        each it holds), by name, as CSDS says it: the version is the type's. A name it holds is
        ACKED, NACKED (it runs the version before; the version is that one) or UNKNOWN (not
        answered yet); one it asked for and does not hold is DOES_NOT_EXIST once a response
        without it was answered, else REQUESTED."""
        state = self.types.get(type_url)
        if state is None or state.subscription is None:
            return []
        subscription, held = state.subscription, state.held_names
        names = sorted(held | subscription.names if subscription.wildcard else subscription.names)
        # Settled: the latest response was ACKed, or none was sent and the proxy stated what it has.
        settled = state.last_acked_nonce == state.nonce if state.nonce is not None else state.held_version is not None
        if settled:
            status, version = "ACKED", state.held_version or ""
        elif state.rejected:
            status, version = "NACKED", state.running_version or ""
        else:
            status, version = "UNKNOWN", state.held_version or ""
        # A name the last response left out does not exist, once the proxy answered it.
        absent = "DOES_NOT_EXIST" if state.nonce is not None and (settled or state.rejected) else "REQUESTED"
        return [
            ResourceState(name, version, status) if name in held else ResourceState(name, "", absent) for name in names
        ]


def _answers_warming(state: TypeState, nonce: str, changed: bool) -> bool:
    """Whether a request of a type whose dependants changed (the proxy is warming and waits) is
    answered even at an unchanged version: a changed subscription or a repeated request (the same
    nonce again, or, before any response of this type on the stream, one without a nonce). Once a
    response is on its way, a nonce-less request needs nothing more: that response answers it."""
    if nonce:
        return changed or nonce == state.last_acked_nonce
    return state.nonce is None


def _held_from_request(state: TypeState, subscription: Subscription, version: str | None, *, first: bool) -> None:
    """What a proxy holds by its own statement, before any response on this stream."""
    state.held_version = version
    trusted = first and version is not None
    state.held_names = subscription.names if trusted else frozenset()
    state.held_wildcard = trusted and subscription.wildcard


def _narrow(state: TypeState, subscription: Subscription) -> None:
    """EDS/RDS/SDS: the proxy dropped what it no longer subscribes to."""
    if subscription.wildcard:
        return  # everything is wanted: nothing dropped
    state.held_wildcard = False
    held, names = state.held_names, subscription.names
    if held is names or not held:
        return
    kept = held & names
    # Equal to the subscription: keep the subscription's own (interned) set, compared by identity.
    state.held_names = names if len(kept) == len(names) else kept
