"""Immutable snapshots of the configuration to serve.

A :class:`Snapshot` holds, per resource type, every resource with its content hash and its
encoded ``Any`` bytes, and the type's version. Versions are content hashes unless the user set
one: identical content gives identical versions across restarts and replicas, so a proxy that
reconnects is not pushed what it already has. Encoded responses are memoized per subscribed
name set, so N streams cost one serialization.

A proxy holds the resources of EDS, RDS and SDS one by one (a state-of-the-world response of those
types need not carry what did not change: Envoy and gRPC keep what a response omits). So for a
stream that holds an earlier version, :meth:`TypeSnapshot.changes` encodes only the subscribed
resources whose content hash differs from that version's, plus those the proxy does not hold yet:
a change to one cluster's endpoints sends each proxy that one assignment. These responses are
memoized too, per (earlier version, name set, names held): streams at the same place share one.

The memos are bounded in bytes, in total (:class:`ResponseMemoLimits`): a peer that asks for ever
new name sets must not make the server grow. What a memo keeps has two parts:

- responses kept *for their own sake*, least recently used first out, within one byte and entry
  budget (a :class:`MemoBudget`) shared by every snapshot and type counted in it. The budget is an
  object, not a table of the module: the cache makes one (:class:`~pilotfish.cache.SnapshotCache`,
  made once by ``serve``) and counts every snapshot it serves in it, so two servers in one process
  keep two budgets. A snapshot served by no cache counts in the budget given to
  :meth:`Snapshot.build`, else in one of its own (default limits, per type). An entry costs the
  bytes of its encoded response and an estimate of its name set. A response larger than half the
  budget is never kept this way;
- responses some stream still *holds* (a stream keeps the last response it was sent of each type,
  :attr:`~pilotfish.protocol.sotw.TypeState.sent`): found again by weak reference, whatever the
  budget. So a fleet of proxies at one version shares one encoded response however many other
  sets were asked for meanwhile (a proxy connecting later finds the one its peers hold), and a
  response nobody holds any more (a peer asked for it, then left) costs nothing beyond the budget:
  it goes when it leaves the budget.

The response carrying everything (wildcard CDS/LDS) is the snapshot's own size, is always kept and
is not counted. Delta answers share the budget (they are held by nobody: a push answers the
streams at one place one after another, so the one they share is always the most recently used).
"""

from __future__ import annotations

import hashlib
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import InitVar, dataclass, field, replace
from types import MappingProxyType

from google.protobuf.message import Message

from pilotfish.resources import ENDPOINT, TYPES, ResourceType, TypeUrl, type_by_url
from pilotfish.resources.builders import encode_assignment
from pilotfish.resources.encoded import Resource  # re-exported: resources/ encodes, snapshots hold
from pilotfish.resources.services import Endpoint
from pilotfish.resources.wire import delta_discovery_response, discovery_response

__all__ = [
    "ABSENT",
    "DeltaChanges",
    "EncodedResponse",
    "MemoBudget",
    "Resource",
    "ResponseMemoLimits",
    "Snapshot",
    "SubsetPlan",
    "SubsetService",
    "TypeSnapshot",
    "with_kept",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class ResponseMemoLimits:
    """How much the snapshots keep of the responses they encoded for name sets, beyond those a
    stream holds (see the module's docstring): the limits of one :class:`MemoBudget`."""

    entries: int = 4096
    """Responses (and delta answers) kept that no stream holds, in all. Beyond it the least
    recently used goes (asked again, it is encoded again: correct, only slower)."""
    bytes: int = 8 * 1024 * 1024
    """Bytes of those responses (their bodies and an estimate of their name sets), in all. Beyond
    it the least recently used goes. A response larger than half of it is not kept this way."""


DEFAULT_MEMO_LIMITS = ResponseMemoLimits()

# What keeping a name set costs beyond its characters (str object, set slot), an estimate.
_PER_NAME = 100
_HEARTBEATS_KEPT = 64
"""Delta heartbeat bodies a type snapshot keeps (by what the clients have): a fleet at one version
shares one; beyond it they are made anew (correct, only slower)."""


@dataclass(frozen=True, slots=True, weakref_slot=True)
class EncodedResponse:
    """A DiscoveryResponse body shared by every stream that needs it; streams add a nonce."""

    type_url: TypeUrl
    version: str
    names: frozenset[str]
    """Names of the subscribed resources that exist: what the proxy holds, at ``version``, once it
    has this response (a response of changes carries fewer; see ``count``)."""
    body: bytes
    count: int = -1
    """How many resources the body carries (-1: all of ``names``)."""
    source: TypeSnapshot | None = field(default=None, compare=False, repr=False)
    """For a response of changes: the snapshot that made it, which can make the whole one."""
    expiring: TypeSnapshot | None = field(default=None, compare=False, repr=False)
    """The snapshot that made it, if any of its resources has a TTL (the stream that sends it
    renews those with heartbeats made by that snapshot); None: no TTLs."""

    def whole(self) -> EncodedResponse:
        """This response with every resource of ``names`` (itself if it has them all)."""
        return self if self.source is None else self.source.response(self.names)

    @property
    def carried(self) -> int:
        """How many resources the body carries."""
        return len(self.names) if self.count < 0 else self.count


ABSENT = ""
"""In what a delta client is known to have: the version of a resource it subscribed to by name and
was told does not exist (in ``removed_resources``), so it is not told again."""


@dataclass(frozen=True, slots=True)
class DeltaChanges:
    """What a delta client that is known to have some versions needs: a DeltaDiscoveryResponse body
    (without its nonce) and what the client has once it takes it."""

    type_url: TypeUrl
    version: str
    """The type's version (``system_version_info``)."""
    body: bytes
    sent: tuple[str, ...]
    removed: tuple[str, ...]
    known: Mapping[str, str]
    """Name -> version the client has afterwards (:data:`ABSENT`: told it does not exist). Shared
    between the streams it is given to: never changed in place."""
    expiring: TypeSnapshot | None = field(default=None, compare=False, repr=False)
    """As :attr:`EncodedResponse.expiring`: the snapshot that made it, if any resource has a TTL."""


@dataclass(frozen=True, slots=True, eq=False)
class TypeSnapshot:
    """The resources of one type and their version."""

    rtype: ResourceType
    version: str
    resources: Mapping[str, Resource]
    content_hash: str = ""
    """Hash of the resources alone (equal to ``version`` unless the user set a version)."""
    memo_budget: InitVar[MemoBudget | None] = None
    """The budget its memo counts in (None: the first cache that serves it gives one, see
    :meth:`count_in`)."""
    _memo: _ResponseMemo = field(default_factory=lambda: _ResponseMemo(), repr=False)

    def __post_init__(self, memo_budget: MemoBudget | None) -> None:
        self._memo.budget = memo_budget

    def count_in(self, budget: MemoBudget) -> None:
        """Count this type's memo in ``budget`` from now on, unless it counts in one already (a
        snapshot served by two caches counts in the first one's)."""
        if self._memo.budget is None:
            self._memo.budget = budget

    def renewed(self, version: str | None = None) -> TypeSnapshot:
        """The same resources in a snapshot of their own (its own memo of responses, in the same
        budget), at ``version`` (None: by content)."""
        renewed = TypeSnapshot(
            self.rtype,
            version if version is not None else self.content_hash,
            self.resources,
            self.content_hash,
            memo_budget=self._memo.budget,
        )
        renewed._memo.ttls = self._memo.ttls  # (the same resources: their TTLs, if found already)
        return renewed

    def response(self, names: frozenset[str] | None) -> EncodedResponse:
        """The encoded response carrying ``names`` (those that exist), or everything for None."""
        memo = self._memo
        if names is None:
            everything = memo.everything
            if everything is None:
                everything = memo.everything = self._encode(None)
            return everything
        cached = memo.kept.get(names)
        if cached is not None:
            memo.used(names)
            return cached
        return memo.miss(names, names, self._encode)

    def changes(self, names: frozenset[str], *, since: TypeSnapshot, held: frozenset[str]) -> EncodedResponse:
        """The response for a proxy that holds ``held`` (of ``names``, its subscription) at
        ``since``'s version: the subscribed resources whose content differs from ``since``'s, and
        those it does not hold. Its ``names`` are every subscribed resource that exists, as for
        :meth:`response`: what the proxy holds once it has it. Only for types whose responses need
        not be full state (EDS, RDS, SDS)."""
        key = (since.version, names, held)
        memo = self._memo
        cached = memo.kept.get(key)
        if cached is not None:
            memo.used(key)
            return cached

        def encode(_: object) -> EncodedResponse:
            resources, before = self.resources, since.resources
            # Unchanged resources are mostly the very objects of ``since``: the set operations
            # (in C) leave the few others, whose content is then compared.
            differ = resources.items() - before.items() if resources is not before else ()
            content = {
                name for name, resource in differ if (old := before.get(name)) is None or old.hash != resource.hash
            }
            changed = sorted((content & names) | (resources.keys() & (names - held)))
            body = discovery_response(self.version, self.rtype.url, (resources[n].encoded for n in changed))
            existing = names if resources.keys() >= names else frozenset(resources.keys() & names)
            return EncodedResponse(
                self.rtype.url, self.version, existing, body, len(changed), self, self._expiring_self()
            )

        return memo.miss(key, names, encode)

    def versions(self) -> Mapping[str, str]:
        """Name -> delta version of every resource (made once)."""
        memo = self._memo
        if memo.versions is None:
            memo.versions = MappingProxyType({name: r.version for name, r in self.resources.items()})
        return memo.versions

    def delta(self, known: Mapping[str, str], *, wildcard: bool, names: frozenset[str]) -> DeltaChanges | None:
        """What a delta client subscribed to everything (``wildcard``) and/or to ``names``, known
        to have ``known``, needs: None if nothing. Resources whose version differs are sent;
        those it has that are gone, and names it subscribed to that do not exist (once), are
        removed. Memoized by the identity of ``known``: streams that took the same responses share
        one ``known`` and one answer."""
        memo = self._memo
        entry = memo.delta.get(id(known))
        if entry is not None and entry[0] is known and entry[1] == wildcard and entry[2] is names:
            memo.used(id(known))
            return entry[3]
        versions = self.versions()
        have = known.get
        if versions is known:
            sent = []
        elif wildcard:
            sent = [name for name, version in versions.items() if have(name) != version]
        elif len(names) < len(versions):
            current = versions.get
            sent = [name for name in names if (version := current(name)) is not None and have(name) != version]
        else:
            sent = [name for name, version in versions.items() if have(name) != version and name in names]
        removed = (
            [name for name in known.keys() - versions.keys() if known[name] != ABSENT and name not in names]
            if wildcard
            else []
        )
        absent = names - versions.keys() if names and not versions.keys() >= names else frozenset()
        removed.extend(name for name in absent if have(name) != ABSENT)
        result = None
        if sent or removed:
            sent.sort()
            removed.sort()
            after: Mapping[str, str]
            if wildcard:
                after = versions if not absent else MappingProxyType({**versions, **dict.fromkeys(absent, ABSENT)})
            elif not absent and len(names) == len(versions):
                after = versions  # subscribed to every one: shared, as a wildcard client's
            else:
                after = MappingProxyType({name: versions.get(name, ABSENT) for name in names})
            resources = self.resources
            body = delta_discovery_response(
                self.version, self.rtype.url, (resources[n].delta_encoded() for n in sent), removed
            )
            result = DeltaChanges(
                self.rtype.url, self.version, body, tuple(sent), tuple(removed), after, self._expiring_self()
            )
        if type(known) is not dict or not known:
            # A mapping answers hand out (read-only, shared by the streams that took the answer).
            # A plain dict is one stream's own (what it stated on reconnecting, or had after
            # unsubscribing): no other stream asks with it, and keeping it would keep it alive.
            memo.keep_delta(known, wildcard, names, result)
        return result

    def retire(self) -> None:
        """Drop the memoized responses: this snapshot is no longer served, only compared with."""
        self._memo.clear()

    def memoized(self) -> tuple[int, int]:
        """(entries, bytes) this type's memo keeps for their own sake now (see the module's
        docstring): the everything response and those only streams hold left out."""
        memo = self._memo
        return len(memo.costs), sum(memo.costs.values())

    # -- TTLs ------------------------------------------------------------------------------------

    def ttls(self) -> Mapping[str, int]:
        """Name -> TTL (milliseconds) of each resource that has one (found once)."""
        memo = self._memo
        if memo.ttls is None:
            memo.ttls = MappingProxyType({n: r.ttl_ms for n, r in self.resources.items() if r.ttl_ms})
        return memo.ttls

    def _expiring_self(self) -> TypeSnapshot | None:
        return self if self.ttls() else None

    def plain(self) -> TypeSnapshot:
        """These resources without their TTLs, for clients that do not take TTLs (itself if none
        has one): the same version and content hash, made once."""
        if not self.ttls():
            return self
        memo = self._memo
        if memo.plain is None:
            resources = dict(self.resources)
            for name in self.ttls():
                resources[name] = resources[name].plain()
            memo.plain = TypeSnapshot(
                self.rtype, self.version, MappingProxyType(resources), self.content_hash, memo_budget=memo.budget
            )
        return memo.plain

    def refresh(self, names: frozenset[str]) -> EncodedResponse:
        """A SotW response at this version carrying those of ``names`` that have a TTL (for a
        proxy that holds them: sent again whole, they are renewed; shared by the streams that
        hold the same)."""
        return self.response(frozenset(names & self.ttls().keys()))

    def heartbeat(self, known: Mapping[str, str]) -> tuple[bytes, int] | None:
        """A DeltaDiscoveryResponse body (without its nonce) renewing the TTL of each resource with
        one that the client has at its current version (``known``): its name, version and TTL
        without the resource; and how many it names. None if it has none. Memoized by the
        identity of ``known`` (clients that took the same answers share it), a few at a time."""
        memo = self._memo
        found = memo.heartbeats.get(id(known))
        if found is not None and found[0] is known:
            return found[1]
        resources = self.resources
        names = sorted(n for n in self.ttls() if known.get(n) == resources[n].version)
        body = None
        if names:
            beats = (resources[n].heartbeat() for n in names)
            body = (delta_discovery_response(self.version, self.rtype.url, beats, ()), len(names))
        if len(memo.heartbeats) >= _HEARTBEATS_KEPT:
            memo.heartbeats.clear()
        memo.heartbeats[id(known)] = (known, body)
        return body

    def _encode(self, names: frozenset[str] | None) -> EncodedResponse:
        if names is None:
            chosen = sorted(self.resources)
        else:
            chosen = sorted(n for n in names if n in self.resources)
        body = discovery_response(self.version, self.rtype.url, (self.resources[n].encoded for n in chosen))
        # Keep the caller's set when it is exactly what was sent: streams can then compare by identity.
        carried = names if names is not None and len(chosen) == len(names) else frozenset(chosen)
        return EncodedResponse(self.rtype.url, self.version, carried, body, expiring=self._expiring_self())


_Key = frozenset[str] | tuple[str, frozenset[str], frozenset[str]] | int
"""A memo entry: a full response's name set, (since version, names, held) for a response of
changes, or the identity of what a delta client is known to have."""

_DeltaEntry = tuple[Mapping[str, str], bool, frozenset[str], DeltaChanges | None]


class MemoBudget:
    """The entries and bytes that the memos counted in it keep for their own sake, least
    recently used first, within ``limits`` (see the module's docstring). One per cache: made
    where the cache is, and handed to the snapshots it serves (:meth:`TypeSnapshot.count_in`)."""

    __slots__ = ("bytes", "limits", "order")

    def __init__(self, limits: ResponseMemoLimits = DEFAULT_MEMO_LIMITS) -> None:
        self.limits = limits
        self.order: OrderedDict[tuple[_ResponseMemo, _Key], int] = OrderedDict()
        """(memo, key) -> cost, least recently used first."""
        self.bytes = 0

    def admit(self, memo: _ResponseMemo, key: _Key, cost: int) -> bool:
        """Count a new entry of ``memo``; make room by dropping the least recently used. False
        (nothing counted) for an entry larger than half the budget: not to be kept."""
        limits = self.limits
        if cost > limits.bytes // 2:
            return False
        self.order[memo, key] = cost
        self.bytes += cost
        while self.bytes > limits.bytes or len(self.order) > limits.entries:
            (owner, old), size = self.order.popitem(last=False)
            self.bytes -= size
            owner.dropped(old)
        return True

    def forget(self, memo: _ResponseMemo, key: _Key) -> None:
        self.bytes -= self.order.pop((memo, key))


class _ResponseMemo:
    """One type snapshot's encoded responses and delta answers (see the module's docstring)."""

    __slots__ = ("budget", "costs", "delta", "everything", "heartbeats", "held", "kept", "plain", "ttls", "versions")

    def __init__(self) -> None:
        self.kept: dict[_Key, EncodedResponse] = {}
        """Responses counted in the budget."""
        self.costs: dict[_Key, int] = {}
        """What each entry (responses and delta answers) costs the budget."""
        self.held: weakref.WeakValueDictionary[_Key, EncodedResponse] | None = None
        """Every response encoded, while something (a stream, or ``kept``) holds it."""
        self.everything: EncodedResponse | None = None
        self.budget: MemoBudget | None = None
        """Where its entries are counted (None until one is given, or its first entry: then one of
        its own, with the default limits)."""
        self.versions: Mapping[str, str] | None = None
        self.delta: dict[int, _DeltaEntry] = {}
        self.ttls: Mapping[str, int] | None = None
        """Name -> TTL of the resources that have one (found when first asked)."""
        self.plain: TypeSnapshot | None = None
        """The same resources without their TTLs (made when first asked)."""
        self.heartbeats: dict[int, tuple[Mapping[str, str], tuple[bytes, int] | None]] = {}
        """Delta heartbeat bodies by the identity of what the clients have."""

    def used(self, key: _Key) -> None:
        """A kept entry was asked for: it is now the most recently used."""
        if self.budget is not None:
            self.budget.order.move_to_end((self, key))

    def miss(
        self,
        key: frozenset[str] | tuple[str, frozenset[str], frozenset[str]],
        names: frozenset[str],
        encode: Callable[[frozenset[str]], EncodedResponse],
    ) -> EncodedResponse:
        """Not kept: one a stream holds, or newly encoded; kept if the budget takes it. ``key``
        is ``names`` for a full response, or a tuple naming a response of changes."""
        held = self.held
        if held is None:
            held = self.held = weakref.WeakValueDictionary()
        found = held.get(key)
        if found is None:
            found = held[key] = encode(names)
        budget = self.budget
        if budget is None:
            budget = self.budget = MemoBudget()
        cost = _cost(names, found)
        if budget.admit(self, key, cost):
            self.kept[key] = found
            self.costs[key] = cost
        return found

    def keep_delta(
        self, known: Mapping[str, str], wildcard: bool, names: frozenset[str], result: DeltaChanges | None
    ) -> None:
        """Keep a delta answer by the identity of ``known`` (which the entry holds, so that the
        identity stays its own), if the budget takes it."""
        key = id(known)
        budget = self.budget
        if budget is None:
            budget = self.budget = MemoBudget()
        if key in self.costs:
            self.costs.pop(key)
            budget.forget(self, key)
        cost = _PER_NAME
        if result is not None:
            cost += len(result.body)
            if result.known is not self.versions:  # made for this answer (else the snapshot's own)
                cost += _PER_NAME * len(result.known)
        if budget.admit(self, key, cost):
            self.delta[key] = (known, wildcard, names, result)
            self.costs[key] = cost

    def dropped(self, key: _Key) -> None:
        """The budget let go of ``key`` (a response a stream holds is still found by ``held``)."""
        del self.costs[key]
        if type(key) is int:
            del self.delta[key]
        else:
            del self.kept[key]

    def clear(self) -> None:
        budget = self.budget
        if budget is not None:
            for key in self.costs:
                budget.forget(self, key)
        self.kept, self.costs, self.delta = {}, {}, {}
        self.held = None
        self.everything = None
        self.heartbeats = {}
        if self.plain is not None:
            self.plain.retire()


def _cost(names: frozenset[str], response: EncodedResponse) -> int:
    """Bytes a memo entry holds, estimated: the body and the name set it is keyed by."""
    return len(response.body) + sum(map(len, names)) + _PER_NAME * len(names)


def with_kept(current: TypeSnapshot, kept: Mapping[str, Resource]) -> TypeSnapshot:
    """``current`` plus resources ``kept`` from an earlier snapshot, versioned by content (its
    memo in ``current``'s budget)."""
    merged = {**kept, **current.resources}
    content = content_version(merged)
    return TypeSnapshot(current.rtype, content, MappingProxyType(merged), content, memo_budget=current._memo.budget)


def content_version(resources: Mapping[str, Resource]) -> str:
    """The version of a type's resources by their content (their names and hashes, in name order)."""
    digest = hashlib.sha256()
    for name in sorted(resources):
        digest.update(name.encode())
        digest.update(b"\0")
        digest.update(resources[name].hash.encode())
        digest.update(b"\n")
    return digest.hexdigest()[:16]


class _Overlay(Mapping[str, Resource]):
    """``base`` with some of its resources replaced by ``top`` (whose names are all in ``base``):
    one proxy's endpoints, sharing every assignment but its subsetted ones with the group's."""

    __slots__ = ("_base", "_top")

    def __init__(self, base: Mapping[str, Resource], top: Mapping[str, Resource]) -> None:
        self._base = base
        self._top = top

    def __getitem__(self, name: str) -> Resource:
        found = self._top.get(name)
        return found if found is not None else self._base[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._base)

    def __len__(self) -> int:
        return len(self._base)

    def __contains__(self, name: object) -> bool:
        return name in self._base


_SUBSET_VIEWS = 65_536
"""Per-proxy endpoint views kept per snapshot (by proxy index, and by distinct choice): beyond it
they are made again when asked (correct, only slower). Distinct choices are few: with Ringsteady a
service of n backends has at most n distinct subsets."""


@dataclass(frozen=True, slots=True, eq=False)
class SubsetService:
    """One subsetted service of a snapshot: its endpoints by backend index, and how a proxy's
    subset is chosen (:mod:`pilotfish.build.subsetting`)."""

    name: str
    """The assignment's (EDS resource's) name."""
    choose: Callable[[int], tuple[int, ...]]
    """Proxy index -> the backend indices of its subset."""
    endpoints: Mapping[int, Endpoint]
    _variants: dict[tuple[int, ...], Resource] = field(default_factory=dict, repr=False)

    def variant(self, chosen: tuple[int, ...]) -> Resource:
        """The assignment of the backends ``chosen`` (encoded once per distinct subset)."""
        found = self._variants.get(chosen)
        if found is None:
            if len(self._variants) >= _SUBSET_VIEWS:
                self._variants.clear()
            endpoints = [self.endpoints[index] for index in chosen]
            found = self._variants[chosen] = Resource(ENDPOINT, self.name, encode_assignment(self.name, endpoints))
        return found


@dataclass(frozen=True, slots=True, eq=False)
class SubsetPlan:
    """The subsetted services of a snapshot: each proxy's endpoints are the group's, with the
    assignments of these services replaced by its own subsets (:meth:`view`)."""

    services: Mapping[str, SubsetService]
    signature: str
    """A hash of what decides every subset (names, sizes, backends and their indices): equal
    plans give every proxy the same endpoints."""
    _by_proxy: dict[int, TypeSnapshot] = field(default_factory=dict, repr=False)
    _by_choice: dict[tuple[tuple[int, ...], ...], TypeSnapshot] = field(default_factory=dict, repr=False)
    _rest: list[tuple[TypeSnapshot, str]] = field(default_factory=list, repr=False)
    """(base, the content hash of its assignments that are not subsetted), made once."""

    def _rest_hash(self, base: TypeSnapshot) -> str:
        for known, digest in self._rest:
            if known is base:
                return digest
        digest = content_version({n: r for n, r in base.resources.items() if n not in self.services})
        self._rest[:] = [(base, digest)]
        return digest

    def chosen(self, proxy: int) -> dict[str, list[str]]:
        """Service -> the addresses of proxy ``proxy``'s subset (for operators: the admin API)."""
        return {
            name: [service.endpoints[i].address for i in service.choose(proxy)]
            for name, service in sorted(self.services.items())
        }

    def spread(self, proxies: Iterable[int]) -> dict[str, float]:
        """Service -> the busiest backend's share of ``proxies`` over the mean (1.0: perfectly
        even), counting every backend of the service (one no proxy uses counts as 0)."""
        indices = list(proxies)
        out: dict[str, float] = {}
        for name, service in self.services.items():
            load = dict.fromkeys(service.endpoints, 0)
            for proxy in indices:
                for backend in service.choose(proxy):
                    load[backend] += 1
            mean = sum(load.values()) / len(load)
            out[name] = max(load.values()) / mean if mean else 0.0
        return out

    def view(self, base: TypeSnapshot, proxy: int) -> TypeSnapshot:
        """The endpoints proxy ``proxy`` is served: ``base`` with its own subsets. Its version is
        a hash of what it holds (the same on every replica given the same indices), after the
        user's explicit version if there is one."""
        found = self._by_proxy.get(proxy)
        if found is not None:
            return found
        chosen = {name: service.choose(proxy) for name, service in self.services.items() if name in base.resources}
        choice = tuple(chosen.values())
        found = self._by_choice.get(choice)
        if found is None:
            top = {name: self.services[name].variant(backends) for name, backends in chosen.items()}
            # By content: the same assignments give the same version, whatever else changed in
            # the full pools (a proxy whose subset stayed is sent nothing).
            digest = hashlib.sha256(self._rest_hash(base).encode())
            for name in sorted(top):
                digest.update(f"|{name}={top[name].hash}".encode())
            content = digest.hexdigest()[:16]
            # An explicit version names the file's content; each proxy's subsets are its own, so
            # they are in its version too (a proxy with another subset is not "current").
            version = content if base.version == base.content_hash else f"{base.version}/{content}"
            found = TypeSnapshot(
                base.rtype, version, _Overlay(base.resources, top), content, memo_budget=base._memo.budget
            )
            # The base's TTLs but those of its subsetted assignments (found once, not per view).
            ttls = base.ttls()
            found._memo.ttls = (
                ttls
                if not ttls or not ttls.keys() & top.keys()
                else MappingProxyType({n: t for n, t in ttls.items() if n not in top})
            )
            if len(self._by_choice) >= _SUBSET_VIEWS:
                self._by_choice.clear()
            self._by_choice[choice] = found
        if len(self._by_proxy) >= _SUBSET_VIEWS:
            self._by_proxy.clear()
        self._by_proxy[proxy] = found
        return found


@dataclass(frozen=True, slots=True)
class Snapshot:
    """Everything to serve to one group of proxies, at one moment. Never changes once built."""

    types: Mapping[TypeUrl, TypeSnapshot]
    explicit_version: str | None = None
    subsets: SubsetPlan | None = None
    """Services whose endpoints each proxy gets a subset of (None: none)."""

    def endpoints_for(self, proxy: int | None) -> TypeSnapshot | None:
        """The endpoints a proxy with subsetting index ``proxy`` is served (None: no index)."""
        base = self.types.get(ENDPOINT.url)
        if base is None or proxy is None or self.subsets is None:
            return base
        return self.subsets.view(base, proxy)

    @classmethod
    def build(
        cls,
        resources: Mapping[ResourceType, Iterable[Message | Resource]],
        *,
        version: str | None = None,
        memo_budget: MemoBudget | None = None,
    ) -> Snapshot:
        """Encode and hash ``resources``; ``version`` (if given) becomes every type's version.
        ``memo_budget``: where each type's memo of encoded responses counts (None: in the budget
        of the cache that serves it, see :meth:`TypeSnapshot.count_in`)."""
        types: dict[TypeUrl, TypeSnapshot] = {}
        for rtype in TYPES:
            by_name = {}
            for item in resources.get(rtype, ()):
                resource = item if isinstance(item, Resource) else Resource.of(rtype, item)
                by_name[resource.name] = resource
            content = content_version(by_name)
            type_version = version if version is not None else content
            types[rtype.url] = TypeSnapshot(
                rtype, type_version, MappingProxyType(by_name), content, memo_budget=memo_budget
            )
        return cls(types=MappingProxyType(types), explicit_version=version)

    def same_content(self, other: Snapshot) -> bool:
        """Whether both hold exactly the same resources (whatever their versions say) and give
        every proxy the same subsets."""
        if (self.subsets and self.subsets.signature) != (other.subsets and other.subsets.signature):
            return False
        return all(
            other.types.get(url) is not None and other.types[url].content_hash == ts.content_hash
            for url, ts in self.types.items()
        )

    def keeping_versions_of(self, was: Snapshot) -> Snapshot:
        """This snapshot with each type whose content is the same as in ``was`` replaced by
        ``was``'s (its version, and its memo of encoded responses): with explicit versions, a
        new file version names the types that changed, and a type that did not keeps the version
        its proxies hold, so it is not sent again. Only when both set an explicit version (by
        content, an unchanged type has the same version anyway).

        So a type's version is the file version at which its content last changed: it names one
        content of that type, as the file version names one content of the file (docs/sources.md, explicit versions)."""
        if self.explicit_version is None or was.explicit_version is None:
            return self
        types = dict(self.types)
        kept = 0
        for url, ts in self.types.items():
            before = was.types.get(url)
            if before is not None and before is not ts and before.content_hash == ts.content_hash:
                types[url] = before
                kept += 1
        return self if not kept else replace(self, types=MappingProxyType(types))

    def get(self, type_url: str) -> TypeSnapshot | None:
        return self.types.get(TypeUrl(type_url))

    def version(self, type_url: str) -> str | None:
        ts = self.types.get(TypeUrl(type_url))
        return ts.version if ts is not None else None

    def versions(self) -> dict[str, str]:
        """Version per type, keyed by the short type name (CDS, EDS...)."""
        out = {}
        for url, ts in self.types.items():
            rtype = type_by_url(url)
            out[rtype.short if rtype else url] = ts.version
        return out

    def label(self) -> str:
        """One string naming this snapshot in logs: the explicit version, or the type hashes."""
        if self.explicit_version is not None:
            return self.explicit_version
        return hashlib.sha256("".join(sorted(ts.version for ts in self.types.values())).encode()).hexdigest()[:16]
