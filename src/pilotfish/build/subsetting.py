"""Per-proxy endpoint subsets: stable dense indices and Ringsteady (docs/architecture.md, "Subsetting").

With thousands of proxies and hundreds of backends, full mesh costs every backend a connection
(and health checks) from every proxy. Subsetting gives each proxy k of a service's n backends.
This module is the arithmetic of it; it does no I/O, keeps no state between calls and knows
nothing of snapshots: the caller keeps weights, localities and zones of the chosen endpoints.

**Indices.** Every backend of a service, and every proxy, gets a dense index from an
:class:`IndexTable`: the lowest free non-negative integer, kept while its key (a backend address,
a proxy's node id) exists, freed when it goes, and reused lowest-first. :meth:`IndexTable.update`
is a pure function of the previous table and the new key set (keys new in one update get indices
in sorted key order), so every replica holding the same previous table computes the same next
one, whatever order its keys arrived in. Keys in ``reserved`` keep their index without being
present: the caller's grace period for a proxy that disconnected (a hot restart reconnects to the
same subset). Tables round-trip through plain JSON-able dicts (:meth:`IndexTable.to_json`,
:meth:`IndexTable.from_json`) for the state file and etcd; loading validates every field.

**Ringsteady** (Google, "Reinventing Backend Subsetting at Google", ACM Queue 2022). Index ``i``
sits at ring position :func:`pos` ``(i)``, the 32-bit bit reversal of ``i`` (the van der Corput
sequence: the first n indices spread evenly around the ring, and each new one splits one of the
largest gaps). Sort the backends by position; proxy ``c`` takes the k backends starting at the first
whose position is ``>= pos(c)``, wrapping around; all of them when ``n <= k``. Consequences (each a
property test in tests/unit/build/test_build_subsetting.py):

- a subset has exactly ``min(k, n)`` distinct backends and depends only on the index sets;
- adding a backend changes at most one entry of any subset (the newcomer joins a window and pushes
  out its last member, or lands outside it); removing backend j changes only the subsets that held
  j, each by one swap (the next backend on the ring moves in);
- balance: a backend's load is the number of proxies whose positions fall in the arc of the k
  gaps before it. For n a power of two the gaps are equal; otherwise the ring has gaps of two sizes
  (``1/N`` and ``2/N``, N the next power of two), so with m proxies, as m grows, a backend carries
  at most ``n * (k + w) / (k * N)`` times the mean, where w is the largest number of wide gaps among
  k consecutive ones (:func:`balance_limit`). That tends to 1 as k grows, but is up to ~2 for k = 1
  (n = 7: 1.75). A finite fleet adds at most the sequence's discrepancy, ``2 * (log2(m) / 3 + 1)``
  proxies per backend. "Max load <= 1.15 x mean" (the subsetting target) therefore needs k large enough and
  m * k / n large enough; where it holds, measured, is in the test module's docstring.

Rings are precomputed once per backend set (:class:`Ring`) and each proxy's subset is one bisect
and a slice: 10,000 proxies over 1,000 backends take tens of milliseconds (bench/bench_subsetting.py),
not a sort per proxy.

Zones: :class:`ZoneRings` chooses within the proxy's zone first (see there).
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, NewType, Protocol

from pilotfish.errors import ConfigError, Problem

__all__ = [
    "INDEX_LIMIT",
    "Index",
    "IndexTable",
    "Position",
    "Presence",
    "ProxyIndexer",
    "ProxyIndices",
    "Ring",
    "ZoneRings",
    "balance_limit",
    "pos",
    "subset",
]

Index = NewType("Index", int)
"""A dense, stable index of a backend of one service, or of a proxy (0, 1, 2, ...)."""

Position = NewType("Position", int)
"""Where an index sits on the ring: :func:`pos` of it, in ``[0, 2**32)``."""

INDEX_LIMIT = 2**32
"""Indices are below this: :func:`pos` reverses 32 bits. A loaded table is checked against it."""

_FORMAT = 1
"""``version`` of :meth:`IndexTable.to_json`'s dict; bump when its shape changes."""

_MAX_REPORTED = 10
"""A corrupt table names this many problems at most (a hostile file must not make a huge error)."""


def pos(index: int) -> Position:
    """The 32-bit bit reversal of ``index``: 0 -> 0, 1 -> 2**31, 2 -> 2**30, 3 -> 3 * 2**30, ..."""
    if not 0 <= index < INDEX_LIMIT:
        raise ValueError(f"index {index} is outside [0, 2**32): ring positions reverse 32 bits")
    x = index
    x = ((x >> 1) & 0x55555555) | ((x & 0x55555555) << 1)
    x = ((x >> 2) & 0x33333333) | ((x & 0x33333333) << 2)
    x = ((x >> 4) & 0x0F0F0F0F) | ((x & 0x0F0F0F0F) << 4)
    x = ((x >> 8) & 0x00FF00FF) | ((x & 0x00FF00FF) << 8)
    x = ((x >> 16) & 0x0000FFFF) | ((x & 0x0000FFFF) << 16)
    return Position(x)


# --------------------------------------------------------------------------------------------
# Indices


@dataclass(frozen=True, slots=True)
class IndexTable:
    """Keys (backend addresses of one service, or proxy node ids) and their dense indices.

    Immutable: :meth:`update` returns the next table. Build the first one with ``IndexTable()``
    and ``update``, or load one with :meth:`from_json`.
    """

    indices: Mapping[str, Index] = field(default_factory=lambda: MappingProxyType({}))
    """Key -> index; no two keys share an index. Read-only."""

    def __post_init__(self) -> None:
        problems = _problems(self.indices)
        if problems:
            raise ValueError("invalid IndexTable: " + "; ".join(str(p) for p in problems))
        if not isinstance(self.indices, MappingProxyType):
            object.__setattr__(self, "indices", MappingProxyType(dict(self.indices)))

    def __len__(self) -> int:
        return len(self.indices)

    def __contains__(self, key: object) -> bool:
        return key in self.indices

    def index(self, key: str) -> Index | None:
        """``key``'s index, or None if it has none."""
        return self.indices.get(key)

    def update(self, *, present: Iterable[str], reserved: Iterable[str] = ()) -> IndexTable:
        """The table for the keys that exist now.

        A key of this table keeps its index if it is in ``present`` or ``reserved``; the others
        are dropped and their indices freed. Keys in ``present`` without an index get the lowest
        free ones, in sorted key order (so the result does not depend on the order of
        ``present``). ``reserved`` only keeps: a reserved key that has no index gets none (a
        grace period for a proxy that went away, not a way to allocate).
        """
        present_set = frozenset(present)
        keep = present_set | frozenset(reserved)
        kept = {key: index for key, index in self.indices.items() if key in keep}
        new = sorted(present_set - kept.keys())
        if not new and len(kept) == len(self.indices):
            return self
        used = set(kept.values())
        candidate = 0
        for key in new:
            while candidate in used:
                candidate += 1
            if candidate >= INDEX_LIMIT:  # pragma: no cover - 2**32 keys do not fit in memory
                raise ValueError("no free index below 2**32")
            kept[key] = Index(candidate)
            candidate += 1
        return IndexTable(MappingProxyType(kept))

    def to_json(self) -> dict[str, object]:
        """A plain dict for ``json.dumps`` (keys sorted: equal tables give equal bytes)."""
        return {"version": _FORMAT, "indices": {key: self.indices[key] for key in sorted(self.indices)}}

    @classmethod
    def from_json(cls, data: object, *, source: str) -> IndexTable:
        """The table that :meth:`to_json` wrote, checked.

        ``source`` names where ``data`` came from (a file path, an etcd key) in the error.
        Raises :class:`~pilotfish.errors.ConfigError` naming each wrong field: not a dict, an
        unknown ``version``, an index that is not an integer, negative or >= 2**32, or held by
        two keys.
        """
        if not isinstance(data, dict):
            raise ConfigError(
                source, [Problem("", f"expected an object with 'version' and 'indices', got {type(data).__name__}")]
            )
        problems: list[Problem] = []
        if data.get("version") != _FORMAT:
            problems.append(
                Problem(
                    "version",
                    f"expected {_FORMAT}, got {data.get('version')!r}; was this written by a newer pilotfish?",
                )
            )
        unknown = sorted(str(key) for key in data if key not in ("version", "indices"))
        if unknown:
            problems.append(Problem(", ".join(unknown[:_MAX_REPORTED]), "unknown field(s)"))
        indices = data.get("indices")
        if not isinstance(indices, dict):
            problems.append(Problem("indices", f"expected an object of key -> index, got {type(indices).__name__}"))
        else:
            problems += _problems(indices)
        if problems:
            if len(problems) > _MAX_REPORTED:
                more = len(problems) - _MAX_REPORTED
                problems = [*problems[:_MAX_REPORTED], Problem("", f"... and {more} more problem(s)")]
            raise ConfigError(
                source,
                [
                    *problems,
                    Problem("", "fix or remove it: pilotfish then assigns indices afresh (subsets re-balance once)"),
                ],
            )
        assert isinstance(indices, dict)
        return cls(MappingProxyType({key: Index(value) for key, value in indices.items()}))


def _problems(indices: Mapping[Any, object]) -> list[Problem]:
    """What is wrong with a key -> index mapping, each naming its field."""
    problems: list[Problem] = []
    holder: dict[int, object] = {}
    for key, value in indices.items():
        where = f"indices[{key!r}]"
        if not isinstance(key, str):
            problems.append(Problem(where, f"key must be a string, got {type(key).__name__}"))
        if isinstance(value, bool) or not isinstance(value, int):
            problems.append(Problem(where, f"index must be an integer, got {type(value).__name__} {value!r}"))
        elif not 0 <= value < INDEX_LIMIT:
            problems.append(Problem(where, f"index {value} is outside [0, 2**32)"))
        elif value in holder:
            problems.append(Problem(where, f"index {value} is also held by {holder[value]!r}"))
        else:
            holder[value] = key
    return problems


class ProxyIndexer(Protocol):
    """What the xDS servers need of the proxies' indices: :class:`ProxyIndices` in one process,
    or the replicas' shared ones in etcd (:mod:`pilotfish.subsets.etcd`)."""

    def index(self, node: str) -> Index | None:
        """``node``'s index (None: it has none)."""

    def acquire(self, node: str) -> Index | None:
        """A stream (or poll) of ``node`` opened: its index (None: none can be given)."""

    def release(self, node: str) -> None:
        """A stream of ``node`` closed (with its last, its grace period starts)."""

    def touch(self, node: str) -> Index | None:
        """A poll (a stream of one request) of ``node``: its index (given if it has none)."""


class Presence:
    """Which nodes have streams, and since when those without any have been gone (oldest first):
    the grace-period bookkeeping of the proxies' indices."""

    __slots__ = ("_clock", "_gone", "_streams", "grace")

    def __init__(self, *, grace: float, clock: Callable[[], float]) -> None:
        self.grace = grace
        self._clock = clock
        self._streams: dict[str, int] = {}
        self._gone: dict[str, float] = {}

    def arrive(self, node: str) -> None:
        """A stream of ``node`` opened."""
        self._streams[node] = self._streams.get(node, 0) + 1
        self._gone.pop(node, None)

    def leave(self, node: str) -> bool:
        """A stream of ``node`` closed; True if it was its last (its grace period starts now)."""
        left = self._streams.get(node, 0) - 1
        if left > 0:
            self._streams[node] = left
            return False
        self._streams.pop(node, None)
        return True

    def gone(self, node: str, since: float | None = None) -> None:
        """``node`` has no streams, since ``since`` (default: now)."""
        self._gone[node] = self._clock() if since is None else since

    def present(self) -> list[str]:
        """The nodes with streams now."""
        return list(self._streams)

    def here(self, node: str) -> bool:
        """Whether ``node`` has streams or is in its grace period."""
        return node in self._streams or node in self._gone

    def expired(self) -> list[str]:
        """The nodes whose grace period ended (forgotten here)."""
        cutoff = self._clock() - self.grace
        out = []
        while self._gone:
            node, since = next(iter(self._gone.items()))
            if since > cutoff:
                break
            del self._gone[node]
            out.append(node)
        return out


class ProxyIndices:
    """The proxies' indices, as they connect and go: an :class:`IndexTable` kept up to date one
    proxy at a time (a table update per connection would copy the table: quadratic in a storm).

    A node id gets the lowest free index when its first stream opens, keeps it while it has
    streams and for ``grace`` seconds after its last one closed (an Envoy hot restart, a quick
    reconnect: the same subset), then its index is freed for the next newcomer. Ids loaded from a
    saved table start their grace when loaded, so a restarted control plane gives reconnecting
    proxies their old indices. At most ``limit`` ids hold an index (a peer choosing node ids must not
    grow the table without bound): past it a proxy gets none, and so every endpoint.
    """

    __slots__ = ("_free", "_indices", "_next", "_presence", "changes", "limit")

    def __init__(
        self,
        table: IndexTable | None = None,
        *,
        grace: float = 300.0,
        limit: int = 200_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.limit = limit
        self._indices: dict[str, Index] = dict(table.indices) if table is not None else {}
        self._presence = Presence(grace=grace, clock=clock)
        now = clock()
        for node in self._indices:  # loaded: their grace period starts now
            self._presence.gone(node, now)
        used = set(self._indices.values())
        self._next = max(used, default=-1) + 1
        """Every index from here on is free."""
        self._free = [i for i in range(self._next) if i not in used]
        heapq.heapify(self._free)
        self.changes = 0
        """Counts changes of :meth:`table` (whoever saves it watches this)."""

    def __len__(self) -> int:
        return len(self._indices)

    def index(self, node: str) -> Index | None:
        """``node``'s index (None: it has none)."""
        return self._indices.get(node)

    def acquire(self, node: str) -> Index | None:
        """A stream of ``node`` opened: its index (None: the table is full)."""
        self.expire()
        self._presence.arrive(node)
        found = self._indices.get(node)
        if found is not None:
            return found
        if len(self._indices) >= self.limit:
            return None
        if self._free:
            found = Index(heapq.heappop(self._free))
        else:
            found, self._next = Index(self._next), self._next + 1
        self._indices[node] = found
        self.changes += 1
        return found

    def release(self, node: str) -> None:
        """A stream of ``node`` closed; with its last one, its grace period starts."""
        if self._presence.leave(node) and node in self._indices:
            self._presence.gone(node)

    def touch(self, node: str) -> Index | None:
        """A poll of ``node``: its index, given if it has none; its grace period starts again."""
        index = self.acquire(node)
        self.release(node)
        return index

    def expire(self) -> None:
        """Free the indices of ids whose grace period is over."""
        for node in self._presence.expired():
            heapq.heappush(self._free, self._indices.pop(node))
            self.changes += 1

    def table(self) -> IndexTable:
        """The indices held now (connected proxies and those in their grace period)."""
        return IndexTable(MappingProxyType(dict(self._indices)))


# --------------------------------------------------------------------------------------------
# Ringsteady


class Ring:
    """The backends of one service sorted by ring position, for many proxies' subsets.

    Build once per backend index set; :meth:`subset` is then a bisect and a slice. Immutable.
    """

    __slots__ = ("_order", "_positions")

    def __init__(self, backends: Iterable[int]) -> None:
        placed = sorted((pos(b), Index(b)) for b in backends)
        for (a, b), (c, _) in itertools.pairwise(placed):
            if a == c:
                raise ValueError(f"backend index {b} given twice: each backend needs its own index")
        self._positions: tuple[Position, ...] = tuple(p for p, _ in placed)
        self._order: tuple[Index, ...] = tuple(b for _, b in placed)

    def __len__(self) -> int:
        return len(self._order)

    @property
    def order(self) -> tuple[Index, ...]:
        """The backends in ring order (by :func:`pos`)."""
        return self._order

    def subset(self, proxy: int, k: int) -> tuple[Index, ...]:
        """Proxy ``proxy``'s k backends, in ring order from the first at or after ``pos(proxy)``.

        All of them (still in ring order from there) when there are at most k.
        """
        if k < 1:
            raise ValueError(f"subset size must be at least 1, got {k}")
        n = len(self._order)
        if n == 0:
            return ()
        start = bisect.bisect_left(self._positions, pos(proxy))
        end = start + min(k, n)
        if end <= n:
            return self._order[start:end]
        return self._order[start:] + self._order[: end - n]


def subset(*, proxy: int, backends: Iterable[int], k: int) -> tuple[Index, ...]:
    """One proxy's subset (docs/architecture.md): ``Ring(backends).subset(proxy, k)``. For many proxies over
    the same backends, build the :class:`Ring` once."""
    return Ring(backends).subset(proxy, k)


class ZoneRings:
    """Subsets chosen within the proxy's zone first.

    The rule, for a proxy in zone Z with ``z`` backends of the service in Z:

    - ``z >= k``: Ringsteady over Z's backends only (every property above holds within the zone);
    - ``0 < z < k``: all of Z's backends, plus the proxy's Ringsteady subset of size ``k - z`` of
      the backends of all other zones together (one ring of "the rest", deterministic);
    - ``z == 0``, or the proxy's zone is unknown (None): Ringsteady over all backends, as without
      zones.

    So a zone that shrinks below k changes its proxies' subsets by more than one entry at that
    moment (the rest ring takes over part of the subset); within either regime the one-swap
    properties hold. Balance within a zone assumes its proxies' indices are dense too: index
    proxies with one :class:`IndexTable` per zone, not one for the whole fleet (a zone's share of
    a global table is an arbitrary subset of positions, and the ring balances only dense ones).
    Backends without a zone (None) are in no proxy's zone: they serve in the rings of "the rest"
    and of all. Immutable.
    """

    __slots__ = ("_all", "_k", "_rest", "_zones")

    def __init__(self, backends: Mapping[int, str | None], *, k: int) -> None:
        """``backends``: backend index -> its zone. ``k``: the subset size."""
        if k < 1:
            raise ValueError(f"subset size must be at least 1, got {k}")
        self._k = k
        self._all = Ring(backends)
        by_zone: dict[str | None, list[int]] = {}
        for backend, zone in backends.items():
            by_zone.setdefault(zone, []).append(backend)
        self._zones = {zone: Ring(members) for zone, members in by_zone.items()}
        # Only zones smaller than k ever read their "rest" ring.
        self._rest = {
            zone: Ring(b for b, z in backends.items() if z != zone)
            for zone, members in by_zone.items()
            if len(members) < k
        }

    def subset(self, proxy: int, *, zone: str | None) -> tuple[Index, ...]:
        """The backends of proxy ``proxy`` in ``zone``: its zone's first, in ring order."""
        own = self._zones.get(zone) if zone is not None else None
        if own is None:
            return self._all.subset(proxy, self._k)
        if len(own) >= self._k:
            return own.subset(proxy, self._k)
        return own.order + self._rest[zone].subset(proxy, self._k - len(own))


def balance_limit(n: int, k: int) -> float:
    """The most load a backend of ``n`` (indices 0..n-1) carries relative to the mean, as the
    number of proxies (dense indices) grows: ``n * (k + w) / (k * N)`` with N the smallest power
    of two >= n and w the most wide (``2/N``) gaps among k consecutive ring gaps. 1.0 when n is a
    power of two or k >= n."""
    if n < 1 or k < 1:
        raise ValueError("n and k must be at least 1")
    if k >= n:
        return 1.0
    big = 1 << (n - 1).bit_length()
    order = sorted(range(n), key=pos)
    # Gap before each ring slot, in units of 2**32 / N (1 or 2).
    unit = INDEX_LIMIT // big
    positions = [pos(i) for i in order]
    gaps = [((positions[j] - positions[j - 1]) % INDEX_LIMIT or INDEX_LIMIT) // unit for j in range(n)]
    # Sliding sums of k consecutive gaps around the ring.
    window = current = sum(gaps[n - k :])
    for j in range(n):
        current += gaps[j] - gaps[j - k]
        window = max(window, current)
    return n * window / (k * big)
