"""The incremental (delta) xDS stream state machine. No I/O.

Everything that changes what a delta stream has seen lives here: a
:class:`~envoy.service.discovery.v3.discovery_pb2.DeltaDiscoveryRequest` goes in through
:meth:`DeltaStream.on_request` and a :class:`DeltaOutcome` comes out (what kind of request it was,
and the :class:`DeltaWatch` to open); an answer the cache found goes through
:meth:`DeltaStream.on_response`, which gives it its nonce and records what the client now has.

Per type, a stream remembers what the client subscribes to (everything, ``*``, and/or names)
and what it is *known to have*: name -> version, where versions are content hashes (the same on
every replica and after restarts). The cache answers a watch with the resources whose version
differs from what the client has and the names it has that are gone (docs/architecture.md, behaviour 14,
https://www.envoyproxy.io/docs/envoy/latest/api-docs/xds_protocol#incremental-xds):

- The first request of a type may carry ``initial_resource_versions`` (a client that reconnects):
  that is what it has, so only what differs is sent, and what it has that is gone is removed.
- Wildcard: ``*`` subscribes to everything (and unsubscribing from ``*`` ends that); a first
  CDS or LDS request that subscribes to nothing is a wildcard subscription too (the legacy form).
- Subscribing and unsubscribing apply whatever the request's nonce: a client may change its
  subscription at any time. A name unsubscribed from is forgotten by the client (unless the
  wildcard still covers it), so it is sent again if it is subscribed to again.
- A name subscribed to that does not exist is put in ``removed_resources`` once: the client
  knows it does not exist instead of waiting out a timeout; it is sent when it appears.
- ``response_nonce`` equal to the last nonce sent for the type: an ACK, or with ``error_detail``
  a NACK. What was sent counts as had either way: rejected content is not sent again, only a newer
  version of it. Any other nonce: stale for ACK/NACK purposes (the subscription still applies).
- What a client is known to have is shared, never changed in place: after a response it is the
  answer's own mapping (the same for every stream that took the same answer), so a fleet at one
  version holds one mapping and a change costs one diff, not one per stream.
- After a response that changes clusters, the next endpoints answer carries those clusters'
  endpoints even if unchanged (a re-created cluster waits for them: warming); likewise every
  subscribed route configuration after a listener change.
- Make before break (behaviour 12): a removed cluster that the client's routes, ACKed or only
  sent, still use is kept (the cache's bridge), and so are its endpoints: not told removed until
  the routes have moved and the cluster has gone.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

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
from pilotfish.protocol.sotw import Nonce
from pilotfish.protocol.subscription import WILDCARD, ResourceState, intern_names
from pilotfish.resources import CLUSTER, ENDPOINT, LISTENER, ROUTE, TypeUrl
from pilotfish.resources.wire import is_plain_delta_ack
from pilotfish.snapshot import ABSENT, DeltaChanges, Snapshot, TypeSnapshot

__all__ = ["DecodedDeltaRequest", "DeltaKind", "DeltaOutcome", "DeltaStream", "DeltaTypeState", "DeltaWatch"]

_NOTHING: Mapping[str, str] = {}
_RESEND = "resend"
"""A version no resource has (theirs are hex digests): what the client has, to be sent again."""
# ACKs of these types may release clusters held back for make-before-break (behaviour 12).
_ROUTING_TYPES = (LISTENER.url, ROUTE.url)
_NO_STATES: Mapping[TypeUrl, DeltaTypeState] = {}
_ROUTING = frozenset(_ROUTING_TYPES)
_HELD_BACK = frozenset({CLUSTER.url, ENDPOINT.url})
"""Types whose removals wait for the routes to move (make before break)."""


class DeltaKind(enum.Enum):
    REQUEST = "request"
    """No response_nonce: a first request, or a subscription change."""
    ACK = "ack"
    NACK = "nack"
    STALE = "stale"
    """A response_nonce that is not the latest sent: no ACK or NACK (subscriptions still apply)."""


@dataclass(slots=True)
class DeltaTypeState:
    """What one delta stream has seen of one type."""

    type_url: TypeUrl
    wildcard_capable: bool
    started: bool = False
    wildcard: bool = False
    names: frozenset[str] = frozenset()
    """Names subscribed to explicitly (interned: equal sets are usually one object)."""
    known: Mapping[str, str] = field(default_factory=lambda: _NOTHING)
    """Name -> version the client has (``snapshot.ABSENT``: told it does not exist). Shared:
    replaced, never changed in place."""
    nonce: Nonce | None = None
    sent_version: str | None = None
    """The type version (``system_version_info``) of the last response: what an ACK accepts."""
    acked_version: str | None = None
    acked_known: Mapping[str, str] = field(default_factory=lambda: _NOTHING)
    """What the client had when it last ACKed (``known`` then)."""
    settled: bool = False
    """The latest response was ACKed: the client has ``known`` (not after a NACK, nor while a
    response waits for its answer)."""
    rejected: bool = False
    """The latest response was NACKed."""


class DeltaWatch(NamedTuple):
    """A delta stream's standing question to the cache: tell me when the client lacks something.
    What the client has is read from its state when the cache asks (it changes with every
    response of the stream, including the cluster response just before an endpoints one)."""

    type_url: TypeUrl
    wildcard: bool
    names: frozenset[str]
    state: DeltaTypeState
    routing: Mapping[TypeUrl, DeltaTypeState] | None = None
    """CDS and EDS: the stream's states by type (read when asked: the stream may subscribe to
    routes after the watch was made), for make-before-break: until the routes moved, a removed
    cluster they use is kept, and so is its assignment (not told removed)."""
    proxy: str | None = None
    """EDS: the node id whose own subsets of subsetted services are served (its index is looked up
    when the watch is answered: it may be given after the watch was made); None: the group's."""
    ttl: bool = False
    """The client takes resources with their TTLs; False: it is served them without."""

    def changes(self, current: TypeSnapshot) -> DeltaChanges | None:
        """What ``current`` has for the client; None if nothing. A client that takes TTLs and was
        sent nothing of this type on this stream is sent again what it says it has with a TTL
        (a client that reconnects to a restarted server renews them so, and their heartbeats start)."""
        known = self.state.known
        if self.ttl and self.state.nonce is None and known:
            ttls = current.ttls()
            held = [name for name in ttls if known.get(name, ABSENT) != ABSENT] if ttls else []
            if held:
                known = {**known, **dict.fromkeys(held, _RESEND)}
        return current.delta(known, wildcard=self.wildcard, names=self.names)

    def holds_any(self, type_url: TypeUrl, names: Iterable[str]) -> bool:
        """Whether the client has (or was sent) any of ``names`` of ``type_url`` on this stream."""
        state = (self.routing or _NO_STATES).get(type_url)
        return state is not None and any(state.known.get(name, ABSENT) != ABSENT for name in names)

    def routing_moved(self, snapshot: Snapshot) -> bool:
        """Whether the listeners and routes the client has ACKed are ``snapshot``'s (so none of
        them uses a cluster ``snapshot`` removed). By content: a delta client is sent nothing,
        and so ACKs nothing, when what it subscribes to did not change."""
        # Types the stream has not asked for count as moved (as on a SotW stream): a client that
        # reconnects after a cluster was removed and states its clusters before its routes can
        # lack it until its routes, stated right after, are answered.
        for url in _ROUTING_TYPES:
            state = (self.routing or _NO_STATES).get(url)
            if state is None or not state.started:
                continue
            current = snapshot.get(state.type_url)
            # (What a client that takes no TTLs has are the versions of the resources without them.)
            versions = (current if self.ttl else current.plain()).versions() if current is not None else _NOTHING
            # What it ACKed, and what it was sent since (it may be running that already).
            for known in (state.acked_known, state.known):
                if any(v != ABSENT and versions.get(n) != v for n, v in known.items()):
                    return False
                if any(known.get(n) != v for n, v in versions.items() if state.wildcard or n in state.names):
                    return False
        return True


class DecodedDeltaRequest(NamedTuple):
    """A request as :meth:`DeltaStream.decode_request` read it, for :meth:`DeltaStream.on_decoded`."""

    request: discovery_pb2.DeltaDiscoveryRequest | None
    """The request; None if ``acks``."""
    acks: TypeUrl | None = None
    """The request is, byte for byte, the plain ACK of the latest response of this type (its
    type and nonce, nothing else): nothing of it was decoded."""


class DeltaOutcome(NamedTuple):
    """What a request meant, and what the server should do about it."""

    kind: DeltaKind
    type_url: TypeUrl
    response_nonce: str
    error: str | None
    subscribed: tuple[str, ...]
    unsubscribed: tuple[str, ...]
    watches: tuple[DeltaWatch, ...]
    """Open these watches, each replacing the stream's current one for its type."""
    version: str | None = None
    """For an ACK the version accepted, for a NACK the one rejected."""


@dataclass(slots=True)
class DeltaStream:
    """One delta stream: ADS (``type_url`` None, any type) or a per-type service."""

    type_url: TypeUrl | None = None
    node: base_pb2.Node | None = None
    types: dict[TypeUrl, DeltaTypeState] = field(default_factory=dict)
    limits: XdsLimits = DEFAULT_LIMITS
    ttl: bool = False
    """The client takes resources with TTLs (its node announces ``xds.config.supports-resource-ttl``)."""
    _sent: int = 0

    def decode_request(self, data: bytes) -> DecodedDeltaRequest:
        """Decode an encoded DeltaDiscoveryRequest for :meth:`on_decoded`; raises
        :class:`PeerError` if it is not one. A plain ACK of a type's latest response (what a
        fleet sends after every push and heartbeat) is found by its bytes and not decoded."""
        if self.node is not None:
            for seen in self.types.values():
                nonce = seen.nonce
                if nonce is not None and is_plain_delta_ack(data, type_url=seen.type_url, nonce=nonce):
                    return DecodedDeltaRequest(None, seen.type_url)
        try:
            return DecodedDeltaRequest(discovery_pb2.DeltaDiscoveryRequest.FromString(data))
        except DecodeError as exc:
            raise PeerError(f"undecodable DeltaDiscoveryRequest: {exc}") from None

    def on_decoded(self, decoded: DecodedDeltaRequest) -> DeltaOutcome:
        """:meth:`on_request` for what :meth:`decode_request` read."""
        if decoded.acks is not None:
            state = self.types[decoded.acks]
            assert state.nonce is not None and state.started
            return self._decided(state, state.nonce, None, (), ())
        assert decoded.request is not None
        return self.on_request(decoded.request)

    def on_request(self, request: discovery_pb2.DeltaDiscoveryRequest) -> DeltaOutcome:
        """Classify a request, apply its subscription changes and say what to watch. Raises
        :class:`PeerError` on bad input."""
        limits = self.limits
        type_url, rtype = requested_type(request.type_url, self.type_url, limits)
        subscribe, unsubscribe = request.resource_names_subscribe, request.resource_names_unsubscribe
        initial = request.initial_resource_versions
        count = len(subscribe) + len(unsubscribe) + len(initial)
        if count > limits.max_resource_names:
            raise PeerOverLimit(
                f"this {rtype.short} delta request names {count:,} resources, over the limit of "
                f"{limits.max_resource_names:,} per request (XdsLimits.max_resource_names): subscribe to "
                "fewer at a time, or raise the limit"
            )
        if self.node is None:
            self.node = kept_node(request.node, limits) if request.HasField("node") else base_pb2.Node()
            self.ttl = takes_ttls(request.node, sotw=False)

        state = self.types.get(type_url)
        if state is None:
            state = self.types[type_url] = DeltaTypeState(type_url, wildcard_capable=rtype.wildcard)
        if not state.started:
            state.started = True
            if initial:
                state.known = state.acked_known = dict(initial)  # what it runs, by its own account
            if state.wildcard_capable and not subscribe:
                state.wildcard = True  # the legacy wildcard: a first CDS/LDS request naming nothing
        if subscribe or unsubscribe:
            self._subscribe(state, subscribe, unsubscribe)
        error = (
            shorten(request.error_detail.message, limits.max_error_chars) if request.HasField("error_detail") else None
        )
        return self._decided(state, request.response_nonce, error, subscribe, unsubscribe)

    def _decided(
        self, state: DeltaTypeState, nonce: str, error: str | None, subscribe: Iterable[str], unsubscribe: Iterable[str]
    ) -> DeltaOutcome:
        """The rest of a request, once its subscription changes are applied: what kind it is
        (the ACK or NACK noted) and the watches to open."""
        type_url = state.type_url
        version = None
        if not nonce:
            kind = DeltaKind.REQUEST
        elif nonce != state.nonce:
            kind = DeltaKind.STALE
        elif error is not None:
            kind, version = DeltaKind.NACK, state.sent_version
            state.settled = False
            state.rejected = True
        else:
            kind, version = DeltaKind.ACK, state.sent_version
            state.acked_version = version
            state.acked_known = state.known
            state.settled = True
            state.rejected = False
        watches: tuple[DeltaWatch, ...] = (self._watch(state),)
        if kind is DeltaKind.ACK and type_url in _ROUTING:
            clusters = self.types.get(CLUSTER.url)
            if clusters is not None and clusters.started:
                watches += (self._watch(clusters),)  # clusters held back for the routes may now go
        return DeltaOutcome(
            kind,
            type_url,
            shorten(nonce, self.limits.echo_chars),
            error,
            tuple(subscribe),
            tuple(unsubscribe),
            watches,
            version,
        )

    def _subscribe(self, state: DeltaTypeState, subscribe: Iterable[str], unsubscribe: Iterable[str]) -> None:
        names = set(state.names)
        forgotten: list[str] = []
        for name in subscribe:
            if name == WILDCARD:
                state.wildcard = True
            else:
                names.add(name)
        for name in unsubscribe:
            if name == WILDCARD:
                if state.wildcard:
                    state.wildcard = False
                    # The client drops what only the wildcard covered.
                    forgotten.extend(n for n in state.known if n not in names)
            elif name in names:
                names.discard(name)
                if not state.wildcard:
                    forgotten.append(name)  # the client drops it (the wildcard would have kept it)
        if len(names) > self.limits.max_resource_names:
            raise PeerOverLimit(
                f"this stream subscribes to {len(names):,} {state.type_url.rsplit('.', 1)[-1]} names, over "
                f"the limit of {self.limits.max_resource_names:,} (XdsLimits.max_resource_names): "
                "unsubscribe from some, or raise the limit"
            )
        if forgotten:
            # The client no longer runs what it unsubscribed from: it counts neither as had nor as
            # ACKed (a listener it dropped must not hold back the removal of a cluster it used,
            # behaviour 12, since no answer of that listener will ever be ACKed again).
            state.known = _without(state.known, forgotten)
            state.acked_known = _without(state.acked_known, forgotten)
        if names != state.names:
            state.names = intern_names(frozenset(names))

    def _watch(self, state: DeltaTypeState) -> DeltaWatch:
        routing = None
        if state.type_url in _HELD_BACK:
            routing = self.types
        proxy = self.node.id if state.type_url == ENDPOINT.url and self.node is not None else None
        return DeltaWatch(state.type_url, state.wildcard, state.names, state, routing, proxy, self.ttl)

    def on_response(self, watch: DeltaWatch, changes: DeltaChanges) -> tuple[Nonce, tuple[DeltaWatch, ...]]:
        """Record that ``changes`` go out for ``watch``; return the response's nonce (unique per
        stream) and the watches to open again now: after changed clusters (listeners), the
        endpoints (routes) to send again for warming are due at once, not at the next request;
        after removed clusters, the removal of their endpoints (kept with them: make before
        break)."""
        state = watch.state
        self._sent += 1
        nonce = Nonce(str(self._sent))
        state.nonce = nonce
        state.sent_version = changes.version
        state.known = changes.known
        state.settled = False
        state.rejected = False
        again = None
        if changes.type_url == CLUSTER.url:
            if changes.sent:
                again = self._resend(ENDPOINT.url, changes.sent)
            if again is None and changes.removed:
                # The endpoints of removed clusters, kept while they were, may go now.
                endpoints = self.types.get(ENDPOINT.url)
                again = endpoints if endpoints is not None and endpoints.started else None
        elif changes.type_url == LISTENER.url and changes.sent:
            again = self._resend(ROUTE.url, None)
        return nonce, (() if again is None else (self._watch(again),))

    def on_refresh(self, type_url: TypeUrl) -> Nonce | None:
        """A heartbeat renewing the TTLs of what the client has of ``type_url`` is to go out: its
        nonce, or None if the type is not settled (:attr:`DeltaTypeState.settled`). What the
        client has does not change; the heartbeat's ACK is an ACK of the same."""
        state = self.types.get(type_url)
        if state is None or not state.settled:
            return None
        self._sent += 1
        nonce = Nonce(str(self._sent))
        state.nonce = nonce
        state.settled = False
        return nonce

    def resource_states(self, type_url: TypeUrl) -> list[ResourceState]:
        """What the client has of each resource of ``type_url`` it subscribes to (by name, and
        with a wildcard each it was sent), as CSDS says it: ACKED at the version it ACKed, NACKED
        (the version it had before, "" if none), UNKNOWN (sent, not answered yet),
        DOES_NOT_EXIST (it was told so) or REQUESTED (nothing sent yet)."""
        state = self.types.get(type_url)
        if state is None or not state.started:
            return []
        known, acked = state.known, state.acked_known
        names = state.names | known.keys() if state.wildcard else state.names
        out = []
        for name in sorted(names):
            version = known.get(name)
            if version is None:
                out.append(ResourceState(name, "", "REQUESTED"))
            elif version == ABSENT:
                out.append(ResourceState(name, "", "DOES_NOT_EXIST"))
            elif acked.get(name) == version:
                out.append(ResourceState(name, version, "ACKED"))
            elif state.rejected:
                had = acked.get(name)
                out.append(ResourceState(name, had if had not in (None, ABSENT) else "", "NACKED"))
            else:
                out.append(ResourceState(name, version if version != _RESEND else acked.get(name, ""), "UNKNOWN"))
        return out

    def _resend(self, type_url: TypeUrl, names: Iterable[str] | None) -> DeltaTypeState | None:
        """Make the next answer of ``type_url`` send ``names`` (None: all) again, whatever their
        version: what the client has of them is marked with a version no resource has (they still
        count as had, so one that is gone is still removed). Returns the state if anything is
        to be sent again."""
        state = self.types.get(type_url)
        if state is None or not state.known or not state.started:
            return None
        known = dict(state.known)
        marked = False
        for name in known if names is None else names:
            if known.get(name, ABSENT) != ABSENT:
                known[name] = _RESEND
                marked = True
        if not marked:
            return None
        state.known = known
        return state


def _without(known: Mapping[str, str], names: Iterable[str]) -> Mapping[str, str]:
    """``known`` without ``names``: a new mapping if any was in it (shared mappings are never
    changed in place), else ``known`` itself."""
    gone = [name for name in names if name in known]
    if not gone:
        return known
    kept = dict(known)
    for name in gone:
        del kept[name]
    return kept
