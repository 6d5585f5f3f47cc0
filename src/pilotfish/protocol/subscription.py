"""What a stream subscribes to, per type, and when it needs a response.

The rules follow the xDS protocol
(https://www.envoyproxy.io/docs/envoy/latest/api-docs/xds_protocol#how-the-client-specifies-what-resources-to-return):

- CDS and LDS are wildcard-capable: a stream that has never named a resource and sends no names
  gets everything; ``*`` among names means everything plus those names; an explicit empty list
  after names means nothing.
- EDS, RDS and SDS get only the named resources.

Equal subscriptions are usually the same object (interned, in bounded tables: see below).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from pilotfish.resources import TypeUrl
from pilotfish.resources.wire import names_run_count
from pilotfish.snapshot import TypeSnapshot

__all__ = ["WILDCARD", "Subscription", "Watch", "checked_wire", "intern_names", "needs_response", "next_subscription"]

WILDCARD = "*"


@dataclass(frozen=True, slots=True)
class Subscription:
    """The resources one stream wants of one type."""

    wildcard: bool
    names: frozenset[str]

    def names_to_send(self) -> frozenset[str] | None:
        """The argument for :meth:`TypeSnapshot.response`: None means every resource."""
        return None if self.wildcard else self.names


# Intern tables. Thousands of proxies ask for the same names: they share one frozenset per
# distinct list (memory per stream, and needs_response compares sets by identity) and one
# Subscription per distinct set. A peer can send ever new lists, so the tables are bounded, in
# two generations as a cheap LRU: a lookup is one dict hit in the current generation; when it is
# full (sets, or the estimated bytes they hold), it becomes the previous one and the one before
# is dropped; what is found in the previous generation moves back. So what many proxies ask for
# stays shared while a peer cycles sets, and the tables never hold more than two generations.
# A set too large for a quarter of a generation is not interned: the stream that asked keeps it.
_INTERNED_MAX = 4096
"""Distinct name lists per generation."""
_INTERNED_BYTES = 32 * 1024 * 1024
"""Estimated bytes of names (and their encoded lists) per generation."""
_PER_NAME = 100
"""What a name costs in the tables beyond its characters (tuple and set slots, str header)."""

_NAME_SETS: dict[tuple[str, ...], frozenset[str]] = {}
_BY_WIRE: dict[bytes, tuple[frozenset[str], int, bytes]] = {}
"""Encoded name lists (checked: nothing but whole names) -> (their set, how many, the key itself)."""
_SUBSCRIPTIONS: dict[tuple[bool, frozenset[str]], Subscription] = {}
_interned_bytes = 0
_OLD_NAME_SETS: dict[tuple[str, ...], frozenset[str]] = {}
_OLD_BY_WIRE: dict[bytes, tuple[frozenset[str], int, bytes]] = {}
"""Encoded name lists (checked: nothing but whole names) -> (their set, how many, the key itself)."""
_OLD_SUBSCRIPTIONS: dict[tuple[bool, frozenset[str]], Subscription] = {}


def _make_room(cost: int) -> bool:
    """Account ``cost`` bytes in the current generation (starting a new one if it is full);
    False if an entry that large is not to be interned at all."""
    global _NAME_SETS, _BY_WIRE, _SUBSCRIPTIONS, _OLD_NAME_SETS, _OLD_BY_WIRE, _OLD_SUBSCRIPTIONS
    global _interned_bytes
    if cost > _INTERNED_BYTES // 4:
        return False
    if (_interned_bytes + cost > _INTERNED_BYTES or len(_NAME_SETS) >= _INTERNED_MAX
            or len(_BY_WIRE) >= _INTERNED_MAX or len(_SUBSCRIPTIONS) >= _INTERNED_MAX):
        _OLD_NAME_SETS, _OLD_BY_WIRE, _OLD_SUBSCRIPTIONS = _NAME_SETS, _BY_WIRE, _SUBSCRIPTIONS
        _NAME_SETS, _BY_WIRE, _SUBSCRIPTIONS = {}, {}, {}
        _interned_bytes = 0
    _interned_bytes += cost
    return True


def _list_cost(names: Collection[str]) -> int:
    return sum(map(len, names)) + _PER_NAME * len(names)


def interned_size() -> tuple[int, int]:
    """(entries, estimated bytes) the intern tables hold now, both generations: for tests and
    metrics."""
    entries = (len(_NAME_SETS) + len(_BY_WIRE) + len(_SUBSCRIPTIONS)
               + len(_OLD_NAME_SETS) + len(_OLD_BY_WIRE) + len(_OLD_SUBSCRIPTIONS))
    old = (sum(_list_cost(key) for key in _OLD_NAME_SETS)
           + sum(len(key) + _PER_NAME * count for key, (_, count, _) in _OLD_BY_WIRE.items())
           + sum(_list_cost(names) for _, names in _OLD_SUBSCRIPTIONS))
    return entries, _interned_bytes + old


def _name_set(requested: Sequence[str], wire: bytes | None) -> frozenset[str]:
    # ``wire`` (the names' encoded bytes, when the transport has them) finds the set without
    # decoding a name: for 100 names that is 1 us instead of 15.
    if wire is not None:
        found = _BY_WIRE.get(wire)
        if found is not None and found[1] == len(requested):
            return found[0]
        found = _OLD_BY_WIRE.pop(wire, None)
        if found is not None and found[1] == len(requested):
            if _make_room(len(wire) + _PER_NAME * found[1]):
                _BY_WIRE[wire] = found
            return found[0]
    key = tuple(requested)
    names = _NAME_SETS.get(key)
    if names is None:
        names = _OLD_NAME_SETS.pop(key, None)
        if names is None:
            names = frozenset(key)
        if not _make_room(_list_cost(key)):
            return names
        _NAME_SETS[key] = names
    # Costed with its set, which it keeps alive even when the set's own entry is gone. Only a
    # span of nothing but these names is kept: equal bytes then mean equal names, and a stream
    # may compare the next request's names with it (SotwStream.decode_request).
    if (wire is not None and names_run_count(wire) == len(key)
            and _make_room(len(wire) + _PER_NAME * len(key))):
        _BY_WIRE[wire] = (names, len(key), wire)
    return names


def checked_wire(wire: bytes) -> bytes | None:
    """The interned copy of an encoded name list if the tables hold it (then it was checked to
    be nothing but whole names, see :func:`~pilotfish.resources.wire.names_run_count`), else None.
    Streams keep this one object, not a copy each."""
    found = _BY_WIRE.get(wire) or _OLD_BY_WIRE.get(wire)
    return found[2] if found is not None else None


def _subscription(wildcard: bool, names: frozenset[str]) -> Subscription:
    found = _SUBSCRIPTIONS.get((wildcard, names))
    if found is None:
        found = _OLD_SUBSCRIPTIONS.pop((wildcard, names), None)
        if found is None:
            found = Subscription(wildcard, names)
        # Costed with its set, which it keeps alive even when the set's own entry is gone.
        if _make_room(_list_cost(names)):
            _SUBSCRIPTIONS[(wildcard, names)] = found
    return found


def intern_names(names: frozenset[str]) -> frozenset[str]:
    """The interned set equal to ``names`` (the same bounded tables): for delta streams, whose
    subscriptions are sets built name by name, not lists; no sorting needed."""
    return _subscription(False, names).names


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
    routing_acked: tuple[str | None, str | None] | None = None
    """CDS only: the LDS and RDS versions the proxy has ACKed (None: never), for make-before-break."""
    proxy: str | None = None
    """EDS: the node id whose own subsets of subsetted services are served (its index is looked up
    when the watch is answered: it may be given after the watch was made); None: the group's."""


def needs_response(watch: Watch, current: TypeSnapshot) -> bool:
    """Whether ``current`` has something for the stream behind ``watch`` (behaviours 7, 10, 13)."""
    if watch.force or watch.known_version != current.version:
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
