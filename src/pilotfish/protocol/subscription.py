"""What a stream subscribes to, per type, and when it needs a response.

The rules follow the xDS protocol
(https://www.envoyproxy.io/docs/envoy/latest/api-docs/xds_protocol#how-the-client-specifies-what-resources-to-return):

- CDS and LDS are wildcard-capable: a stream that has never named a resource and sends no names
  gets everything; ``*`` among names means everything plus those names; an explicit empty list
  after names means nothing.
- EDS, RDS and SDS get only the named resources.

Equal subscriptions are the same object while a stream holds one (interned: see below).
"""

from __future__ import annotations

import weakref
from collections.abc import Collection, Hashable, Sequence
from dataclasses import dataclass
from typing import Generic, NamedTuple, Protocol, TypeVar

from pilotfish.resources import TypeUrl
from pilotfish.resources.wire import names_run_count
from pilotfish.snapshot import Snapshot, TypeSnapshot

__all__ = [
    "WILDCARD",
    "ResourceState",
    "Routing",
    "Subscription",
    "Watch",
    "checked_wire",
    "holds_ttls",
    "intern_names",
    "needs_response",
    "next_subscription",
]

WILDCARD = "*"


@dataclass(frozen=True, slots=True, weakref_slot=True)
class Subscription:
    """The resources one stream wants of one type."""

    wildcard: bool
    names: frozenset[str]

    def names_to_send(self) -> frozenset[str] | None:
        """The argument for :meth:`TypeSnapshot.response`: None means every resource."""
        return None if self.wildcard else self.names


# Intern tables. Thousands of proxies ask for the same names: they share one frozenset per
# distinct list (memory per stream, and needs_response compares sets by identity) and one
# Subscription per distinct set. The tables refer to them weakly: an entry lives as long as
# something else holds its value (a stream's subscription, a memoized response keyed by the set),
# and goes with the last holder. So what many proxies ask for stays shared however many other
# lists a peer sends, and what a peer sent stays no longer than the peer does: the tables cost
# nothing of their own beyond the keys of live entries (bounded by what the streams hold).
_PER_NAME = 100
"""What a name costs in the tables beyond its characters (tuple and set slots, str header)."""

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class _Held(weakref.KeyedRef[K, V]):
    """An entry of an intern table: a weak reference to its value that knows its key (and, for
    an encoded name list, how many names it holds)."""

    __slots__ = ("count",)
    count: int


class _Table(Generic[K, V]):
    """Values by key while something else holds them."""

    __slots__ = ("_gone", "refs")

    def __init__(self) -> None:
        self.refs: dict[K, _Held[K, V]] = {}
        refs = self.refs

        def gone(ref: weakref.ref[V]) -> None:
            assert isinstance(ref, _Held)
            if refs.get(ref.key) is ref:
                del refs[ref.key]

        self._gone = gone

    def get(self, key: K) -> V | None:
        ref = self.refs.get(key)
        return None if ref is None else ref()

    def put(self, key: K, value: V, count: int = 0) -> None:
        ref = _Held(value, self._gone, key)
        ref.count = count
        self.refs[key] = ref


_NAME_SETS: _Table[tuple[str, ...], frozenset[str]] = _Table()
_BY_WIRE: _Table[bytes, frozenset[str]] = _Table()
"""Encoded name lists (checked: nothing but whole names) -> their set (``count``: how many)."""
_SUBSCRIPTIONS: _Table[tuple[bool, frozenset[str]], Subscription] = _Table()
_SETS: _Table[int, frozenset[str]] = _Table()
"""Sets by their hash (:func:`intern_names`)."""


def _list_cost(names: Collection[str]) -> int:
    return sum(map(len, names)) + _PER_NAME * len(names)


def interned_size() -> tuple[int, int]:
    """(entries, estimated bytes) the intern tables hold now, live entries: for tests and metrics."""
    entries = len(_NAME_SETS.refs) + len(_BY_WIRE.refs) + len(_SUBSCRIPTIONS.refs) + len(_SETS.refs)
    size = (
        sum(_list_cost(key) for key in list(_NAME_SETS.refs))
        + sum(len(key) + _PER_NAME * ref.count for key, ref in list(_BY_WIRE.refs.items()))
        + sum(_list_cost(names) for _, names in list(_SUBSCRIPTIONS.refs))
        + sum(_list_cost(names) for ref in list(_SETS.refs.values()) if (names := ref()) is not None)
    )
    return entries, size


def _name_set(requested: Sequence[str], wire: bytes | None) -> frozenset[str]:
    # ``wire`` (the names' encoded bytes, when the transport has them) finds the set without
    # decoding a name: for 100 names that is 1 us instead of 15.
    if wire is not None:
        ref = _BY_WIRE.refs.get(wire)
        if ref is not None and ref.count == len(requested):
            found = ref()
            if found is not None:
                return found
    key = tuple(requested)
    names = _NAME_SETS.get(key)
    if names is None:
        names = frozenset(key)
        _NAME_SETS.put(key, names)
    # Only a span of nothing but these names is kept: equal bytes then mean equal names, and a
    # stream may compare the next request's names with it (SotwStream.decode_request).
    if wire is not None and names_run_count(wire) == len(key):
        _BY_WIRE.put(wire, names, len(key))
    return names


def checked_wire(wire: bytes) -> bytes | None:
    """The interned copy of an encoded name list if the tables hold it (then it was checked to
    be nothing but whole names, see :func:`~pilotfish.resources.wire.names_run_count`), else None.
    Streams keep this one object, not a copy each."""
    ref = _BY_WIRE.refs.get(wire)
    return ref.key if ref is not None and ref() is not None else None


def _subscription(wildcard: bool, names: frozenset[str]) -> Subscription:
    found = _SUBSCRIPTIONS.get((wildcard, names))
    if found is None:
        found = Subscription(wildcard, names)
        _SUBSCRIPTIONS.put((wildcard, names), found)
    return found


def intern_names(names: frozenset[str]) -> frozenset[str]:
    """The interned set equal to ``names``: for delta streams, whose subscriptions are sets built
    name by name, not lists; no sorting needed. (By hash: a table keyed by the set itself would
    hold it. Of two sets with one hash, the later one is interned.)"""
    key = hash(names)
    found = _SETS.get(key)
    if found is not None and found == names:
        return found
    _SETS.put(key, names)
    return names


def next_subscription(
    requested: Sequence[str], *, wildcard_capable: bool, ever_named: bool, wire: bytes | None = None
) -> Subscription:
    """The subscription after a request naming ``requested`` (``wire``: those names' encoded
    bytes, if known; equal bytes mean equal names). Equal subscriptions are usually the same
    object."""
    names = _name_set(requested, wire)
    if WILDCARD in names:
        return _subscription(True, names - {WILDCARD})
    if not names and wildcard_capable and not ever_named:
        return _subscription(True, frozenset())
    return _subscription(False, names)


class Routing(Protocol):
    """What a cluster watch asks its stream when the cache answers it, for make-before-break
    (behaviour 12): read then, not copied into the watch (the proxy may have been sent listeners
    or routes since the watch was made)."""

    def routing_moved(self, snapshot: Snapshot) -> bool:
        """Whether every listener and route the proxy runs, or was sent and may run, is
        ``snapshot``'s (so none of them uses a cluster ``snapshot`` removed)."""
        ...


class ResourceState(NamedTuple):
    """What one proxy has of one resource, as its stream knows it now (for CSDS): the
    resource's name, the version it has (SotW: the type's; delta: the resource's; "": none), and
    how it stands, in CSDS's words (``ClientResourceStatus``): ``ACKED``, ``NACKED`` (the latest
    response was rejected), ``UNKNOWN`` (sent, not answered yet), ``REQUESTED`` (asked for,
    nothing sent yet) or ``DOES_NOT_EXIST`` (asked for, and the server has none)."""

    name: str
    version: str
    status: str


class Watch(NamedTuple):
    """A stream's standing question to the cache: tell me when I need a response of this type.
    (A NamedTuple: made for every request, and it is quicker to build than a frozen dataclass.)"""

    type_url: TypeUrl
    subscription: Subscription
    known_version: str | None
    """The version the proxy holds of this type (or was sent and rejected); None: nothing."""
    known_names: frozenset[str]
    """Names the proxy holds at ``known_version``: for EDS/RDS/SDS, those of the last response (or
    that the proxy stated on its first request) it has stayed subscribed to since. Usually the
    subscription's own set when it holds all of them, so the check below is one identity test."""
    known_wildcard: bool
    """The proxy holds everything there was at ``known_version``."""
    full_state: bool = False
    """CDS/LDS: every response carries the whole subscribed set, so a smaller set is news too."""
    force: bool = False
    """Answer even if nothing changed: a cluster or listener is warming and waits for it."""
    routing: Routing | None = None
    """CDS only: the stream, asked when the watch is answered whether the proxy's listeners and
    routes have moved (make before break); None: nothing to wait for."""
    proxy: str | None = None
    """EDS: the node id whose own subsets of subsetted services are served (its index is looked up
    when the watch is answered: it may be given after the watch was made); None: the group's."""
    ttl: bool = False
    """The proxy takes resources with their TTLs; False: it is served them without
    (:meth:`~pilotfish.snapshot.TypeSnapshot.plain`)."""
    renew: bool = False
    """Nothing was sent of this type on this stream, and the proxy (taking TTLs) says it holds
    ``known_version``: if what it holds has TTLs, it is sent again (whole), which renews them and
    starts their heartbeats. Else a proxy that reconnects to a restarted server at the current
    version would hold them unrenewed until they expire."""

    def routing_moved(self, snapshot: Snapshot) -> bool:
        """Whether the proxy behind this (cluster) watch runs ``snapshot``'s listeners and routes
        and was sent no others, as its stream says now."""
        routing = self.routing
        return routing is None or routing.routing_moved(snapshot)


def holds_ttls(watch: Watch, current: TypeSnapshot) -> bool:
    """Whether the proxy behind ``watch`` holds (by its statement) resources that have a TTL in ``current``."""
    ttls = current.ttls()
    if not ttls:
        return False
    return watch.known_wildcard or any(name in ttls for name in watch.known_names)


def needs_response(watch: Watch, current: TypeSnapshot) -> bool:
    """Whether ``current`` has something for the stream behind ``watch`` (behaviours 7, 10, 13)."""
    if watch.force or watch.known_version != current.version:
        return True
    if watch.renew and holds_ttls(watch, current):
        return True
    resources = current.resources
    known = watch.known_names
    if watch.subscription.wildcard:
        # Everything is wanted: news unless the proxy already holds every resource.
        return not watch.known_wildcard and not known.issuperset(resources)
    wanted = watch.subscription.names
    if wanted is known:
        return False
    if watch.full_state:
        # The response replaces the proxy's whole set: any difference in it is worth sending.
        held = resources.keys() if watch.known_wildcard else {n for n in known if n in resources}
        return {n for n in wanted if n in resources} != held
    # Same version: only names the proxy asks for and does not hold (newly named, or named again
    # after it dropped them), that exist, are worth a response.
    return any(name in resources for name in wanted - known)
