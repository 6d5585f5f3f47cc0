"""The reconcile loop: desired state from sources -> checked snapshot in the cache.

Sources report whole views of what they know (:meth:`Reconciler.update`). The reconciler

1. **debounces**: a burst of changes becomes one build. A change whose content differs from what
   is pending starts (or extends) a window; the build runs once the sources have been quiet for
   ``quiet`` seconds, or ``max_delay`` after the first change of the burst, whichever is first.
   Builds never overlap; a change that arrives during a build is picked up right after it. A
   change that leaves the content as it was costs nothing. Worst case latency: max_delay plus
   two builds.
2. **damps flapping endpoints**: an endpoint that disappears is removed at once (traffic must
   stop going to it); one that comes back soon after is re-added only once it has stayed for
   ``hold`` seconds, so an endpoint flipping ten times a second makes two pushes, not fifty.
3. **builds and checks** the snapshot; one that fails keeps the last good snapshot serving and
   is reported. A snapshot whose content hash equals the current one is not handed over.
4. **waits for every source** named in ``expect`` to report its first complete state before
   anything is published: a snapshot built while etcd is still unreachable would be "empty
   because not yet known", and would take every proxy's configuration away.
5. **guards the blast radius** (:func:`blast_radius`): a snapshot that would remove every
   listener or every cluster, or more than a set share of a type's resources or of a service's
   endpoints at once, is held, reported loudly, and published only once the operator confirms
   (:meth:`Reconciler.confirm`) or a later change makes it harmless.
6. **serves every node group** its own snapshot (:func:`pilotfish.build.desired.build_snapshots`), all
   built in one pass from the same merged state: a group whose snapshot did not change is not
   touched; a problem, or a held snapshot, in any group stops the whole pass, so groups never
   serve different generations of the sources.

The timing logic (:class:`Debouncer`, :class:`FlapDamper`) is pure: it takes ``now`` as an
argument and never sleeps, so tests drive it with plain numbers.

This package may import the cache, status, the sources' data types and the layers below; never a
service, a store or an API.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import NoReturn, Protocol

from envoy.config.endpoint.v3 import endpoint_pb2

from pilotfish.build.desired import DesiredState, Merged, MergeMemo, View, build_snapshots, merge_states, subset_tables
from pilotfish.build.subsetting import IndexTable
from pilotfish.cache import DEFAULT_GROUP, NodeGroup, SnapshotCache
from pilotfish.errors import ConfigError, Problem
from pilotfish.events import EventLog
from pilotfish.resources import CLUSTER, ENDPOINT, LISTENER, TYPES, type_by_key
from pilotfish.resources.bootstrap import DEFAULT_REST_REFRESH
from pilotfish.resources.builders import ResourceMemo
from pilotfish.snapshot import Snapshot
from pilotfish.status import SyncStatus

__all__ = [
    "Clock",
    "DebounceSettings",
    "Debouncer",
    "FlapDamper",
    "GuardSettings",
    "Held",
    "MonotonicClock",
    "Reconciler",
    "blast_radius",
]

_log = logging.getLogger("pilotfish.reconcile")


class Clock(Protocol):
    """Time, behind a seam so tests can use a fake."""

    def now(self) -> float: ...

    async def sleep(self, seconds: float) -> None: ...


class MonotonicClock:
    def now(self) -> float:
        return time.monotonic()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


@dataclass(frozen=True, slots=True, kw_only=True)
class DebounceSettings:
    """How changes are batched into builds, and how flapping endpoints are damped."""

    quiet: float = 0.1
    """Build once no change has arrived for this long (seconds)."""
    max_delay: float = 1.0
    """...or once this long has passed since the first change of a burst, whatever comes first."""
    flap_window: float = 30.0
    """An endpoint that returns within this long of its removal counts as flapping (seconds)."""
    hold: float = 1.0
    """A flapping endpoint is re-added once it has been present this long without a break."""


@dataclass(slots=True)
class Debouncer:
    """When to build, given when changes arrived. Pure: every method takes ``now``."""

    quiet: float
    max_delay: float
    first: float | None = None
    """When the first change of the pending burst arrived (None: nothing pending)."""
    last: float | None = None
    building: bool = False

    def change(self, now: float) -> None:
        """A change whose content differs from what is pending arrived."""
        if self.first is None:
            self.first = now
        self.last = now

    def deadline(self) -> float | None:
        """When the pending burst is due to build (None: nothing pending)."""
        if self.first is None or self.last is None:
            return None
        return min(self.last + self.quiet, self.first + self.max_delay)

    def due(self, now: float) -> bool:
        deadline = self.deadline()
        return deadline is not None and not self.building and now >= deadline

    def start_build(self) -> None:
        """Take the pending burst: changes from now on belong to the next one."""
        self.first = self.last = None
        self.building = True

    def finish_build(self) -> None:
        self.building = False


EndpointKey = tuple[str, str]
"""(service, "host:port")."""


@dataclass(slots=True)
class FlapDamper:
    """Which endpoints to publish, given every change in which are present. Pure: takes ``now``.

    :meth:`observe` sees every change a source reports (not just what a build samples), so an
    endpoint that leaves and comes back between two builds still counts as flapping.
    """

    flap_window: float
    hold: float
    _present: set[EndpointKey] = field(default_factory=set)
    _removed_at: dict[EndpointKey, float] = field(default_factory=dict)
    """When an endpoint last disappeared."""
    _back_since: dict[EndpointKey, float] = field(default_factory=dict)
    """When a recently removed endpoint came back (it is held until ``hold`` has passed)."""

    def observe(self, present: set[EndpointKey], now: float) -> None:
        """The sources now report exactly ``present``."""
        self.change(present - self._present, self._present - present, now)

    def change(self, appeared: Iterable[EndpointKey], disappeared: Iterable[EndpointKey], now: float) -> None:
        """Endpoints ``appeared`` and ``disappeared`` since the last observation (a diff costs what
        changed, where :meth:`observe` costs every endpoint)."""
        for key in disappeared:
            self._present.discard(key)
            self._removed_at[key] = now
            self._back_since.pop(key, None)
        for key in appeared:
            self._present.add(key)
            removed = self._removed_at.get(key)
            if removed is not None and now - removed <= self.flap_window:
                self._back_since[key] = now  # back soon after leaving: flapping, hold it
            elif removed is not None:
                del self._removed_at[key]

    def held(self, now: float) -> tuple[set[EndpointKey], float | None]:
        """The present endpoints still held back (flapping), and when to ask again (when the
        first hold ends). Costs what is held and recently removed, not every endpoint: a build
        after a one-endpoint change among 100,000 must not walk them all."""
        for key, at in list(self._removed_at.items()):
            if key not in self._back_since and now - at > self.flap_window:
                del self._removed_at[key]  # long gone: a return is a fresh start
        held: set[EndpointKey] = set()
        wake: float | None = None
        for key, since in list(self._back_since.items()):
            if key not in self._present:
                continue
            if now - since >= self.hold:
                del self._back_since[key]
                del self._removed_at[key]
            else:
                held.add(key)
                wake = since + self.hold if wake is None else min(wake, since + self.hold)
        return held, wake

    def publishable(self, now: float) -> tuple[set[EndpointKey], float | None]:
        """The endpoints to publish now, and when to ask again (when a hold ends)."""
        held, wake = self.held(now)
        return self._present - held, wake

    def apply(self, present: set[EndpointKey], now: float) -> tuple[set[EndpointKey], float | None]:
        """:meth:`observe` then :meth:`publishable`."""
        self.observe(present, now)
        return self.publishable(now)


@dataclass(frozen=True, slots=True, kw_only=True)
class GuardSettings:
    """Which changes are too big to publish without the operator's say-so."""

    enabled: bool = True
    """False: publish every valid snapshot, however much it removes."""
    max_removed_share: float = 0.5
    """Hold a snapshot that removes more than this share of a type's resources, or of one service's
    endpoints, at once. Removing every listener or every cluster is always held."""
    min_count: int = 10
    """The share rule applies to types and services that had at least this many resources or
    endpoints (removing 2 of 3 endpoints is everyday churn, not a blast)."""


def endpoint_counts(merged: Merged) -> dict[str, int]:
    """Endpoints per cluster: the services' and those of raw ClusterLoadAssignments."""
    counts = {name: len(found) for name, found in merged.endpoints.items()}
    for assignment in merged.resources.get(ENDPOINT, ()):
        assert isinstance(assignment, endpoint_pb2.ClusterLoadAssignment)
        total = sum(len(group.lb_endpoints) for group in assignment.endpoints)
        counts[assignment.cluster_name] = counts.get(assignment.cluster_name, 0) + total
    return counts


def blast_radius(previous: Snapshot, new: Snapshot, previous_endpoints: dict[str, int],
                 new_endpoints: dict[str, int], settings: GuardSettings) -> tuple[list[str], dict[str, dict[str, int]]]:
    """Why publishing ``new`` over ``previous`` removes too much (empty: it does not), and the
    counts before and after of what it removes. Pure."""
    reasons: list[str] = []
    counts: dict[str, dict[str, int]] = {}
    for rtype in TYPES:
        old, current = previous.get(rtype.url), new.get(rtype.url)
        before = len(old.resources) if old is not None else 0
        after = len(current.resources) if current is not None else 0
        if old is None or (current is not None and current.resources is old.resources):
            removed = 0  # nothing, or the very same resources (a type nothing changed in)
        else:
            removed = len(old.resources.keys() - current.resources.keys()) if current is not None else before
        if not removed:
            continue
        counts[rtype.key] = {"before": before, "after": after, "removed": removed}
        if after == 0 and rtype in (LISTENER, CLUSTER):
            reasons.append(f"it removes every {rtype.key[:-1]} ({before})")
        elif before >= settings.min_count and removed > settings.max_removed_share * before:
            reasons.append(f"it removes {removed} of {before} {rtype.key} "
                           f"(more than {settings.max_removed_share:.0%} at once)")
    share, least = settings.max_removed_share, settings.min_count
    shrunk = [name for name, before in previous_endpoints.items()
              if before >= least and before - new_endpoints.get(name, 0) > share * before]
    for name in sorted(shrunk):
        before, after = previous_endpoints[name], new_endpoints.get(name, 0)
        counts[f"endpoints of {name}"] = {"before": before, "after": after, "removed": before - after}
        reasons.append(f"it removes {before - after} of the {before} endpoints of {name!r} "
                       f"(more than {settings.max_removed_share:.0%} at once)")
    return reasons, counts


@dataclass(frozen=True, slots=True)
class Held:
    """Snapshots the guard keeps from the proxies until the operator confirms them."""

    snapshots: Mapping[NodeGroup, Snapshot]
    """The new snapshot of each group that changed."""
    reasons: tuple[str, ...]
    endpoints: dict[str, int]
    tables: Mapping[str, IndexTable] = field(default_factory=dict)
    """The subsetting backend indices the snapshots were built with."""

    @property
    def snapshot(self) -> Snapshot:
        """The default group's snapshot (else the first group's): the one logs name."""
        return self.snapshots.get(DEFAULT_GROUP) or next(iter(self.snapshots.values()))

    def same_content(self, snapshots: Mapping[NodeGroup, Snapshot]) -> bool:
        return self.snapshots.keys() == snapshots.keys() and all(
            held.same_content(snapshots[group]) for group, held in self.snapshots.items())


class Reconciler:
    """Turns the desired state of all sources into the cache's snapshot, debounced and checked."""

    def __init__(
        self,
        cache: SnapshotCache,
        *,
        settings: DebounceSettings | None = None,
        clock: Clock | None = None,
        events: EventLog | None = None,
        groups: Mapping[NodeGroup, View] | None = None,
        expect: Iterable[str] = (),
        guard: GuardSettings | None = None,
        confirm_hint: str | Callable[[], str] = "",
        rules: bool = True,
        labels: Mapping[str, str] | None = None,
        rest_refresh: float = DEFAULT_REST_REFRESH,
        status: SyncStatus | None = None,
        subset_size: int | None = None,
        subset_tables: Mapping[str, IndexTable] | None = None,
        shared_subset_tables: bool = False,
        expect_after: Mapping[str, str] | None = None,
        on_merged: Callable[[Merged], None] | None = None,
    ) -> None:
        self.cache = cache
        self.subset_size = subset_size
        """The subset size of services that set none (None: only those that do are subsetted)."""
        self.subset_tables: Mapping[str, IndexTable] = dict(subset_tables or {})
        """The backend indices of each subsetted service, as last published (the state file and
        etcd keep them; :func:`pilotfish.build.desired.subset_tables`)."""
        self.subset_tables_changed = 0
        """Counts publications that changed :attr:`subset_tables` (whoever persists them watches it)."""
        self.subset_tables_shared = shared_subset_tables
        """True on etcd: the tables are set from outside (:meth:`set_subset_tables`), never allocated
        here, so every replica builds with the same ones."""
        self.on_merged = on_merged
        """Told the merged state of every build (the replica that allocates shared indices)."""
        self._status = status
        """Told each group's versions as they are published (what proxies are measured against)."""
        self.settings = settings or DebounceSettings()
        self.guard = guard or GuardSettings()
        self._confirm_hint = confirm_hint
        self._after: dict[str, str] = dict(expect_after or {})
        """Sources awaited only once another has reported (something read from the same place,
        e.g. the subsetting indices in etcd: while etcd is away, etcd is what is awaited)."""
        self._expected = frozenset(expect) | self._after.keys()
        self._rules = rules
        """Check Envoy's validate.rules before publishing (off: let Envoy NACK what breaks them)."""
        self._labels = dict(labels or {})
        """How errors name each source (e.g. "file" -> the file's path)."""
        self._rest_refresh = rest_refresh
        """Seconds between the EDS and RDS polls of ``rest`` groups (see
        :func:`~pilotfish.build.desired.build_snapshots`)."""
        self._published_endpoints: dict[str, int] = {}
        self.held: Held | None = None
        """The snapshot the blast-radius guard is holding back (None: nothing held)."""
        self._clock: Clock = clock or MonotonicClock()
        self._events = events or EventLog()
        self._groups: dict[NodeGroup, View] = dict(groups or {DEFAULT_GROUP: View()})
        """The node groups served, and what each is served (default: one group of Envoys)."""
        self._states: dict[str, DesiredState] = {}
        self._debouncer = Debouncer(quiet=self.settings.quiet, max_delay=self.settings.max_delay)
        self._damper = FlapDamper(flap_window=self.settings.flap_window, hold=self.settings.hold)
        self._providers: dict[EndpointKey, int] = {}
        """How many sources report each endpoint (it is present while one does)."""
        self._hold_until: float | None = None
        self._wake = asyncio.Event()
        self._memo = ResourceMemo()
        self._merge_memo = MergeMemo()
        self.builds = 0
        """How many builds ran (each may or may not hand over a snapshot)."""
        self.build_seconds = 0.0
        """Time spent building and checking snapshots, in all (the metrics read it)."""
        self.published = 0
        """How many snapshots were handed to the cache."""
        self.changes = 0
        """How many source updates changed what a source says (several may make one build)."""
        self.refused = 0
        """How many builds were refused (invalid input: the last good snapshot kept serving)."""
        self.held_count = 0
        """How many snapshots the blast-radius guard held back."""
        self.source_errors: dict[str, int] = {}
        """Per source: how many of its inputs were refused before reaching the reconciler (an
        unreadable or invalid file)."""
        self.failing_sources: set[str] = set()
        """Sources whose latest input was refused (the last good state of each keeps serving)."""
        self.source_problems: dict[str, tuple[str, float]] = {}
        """Per failing source: why its latest input was refused, and when (wall-clock seconds)."""
        self.last_error: ConfigError | None = None
        """Why the latest build was refused (None once a build succeeds)."""
        self.last_error_at = 0.0
        """When it was refused (wall-clock seconds)."""

    def source_error(self, source: str, reason: str = "") -> None:
        """``source``'s latest input was refused (and reported) where it was read, for ``reason``."""
        self.source_errors[source] = self.source_errors.get(source, 0) + 1
        self.failing_sources.add(source)
        self.source_problems[source] = (reason, time.time())

    def update(self, source: str, state: DesiredState) -> None:
        """A source's whole current view. Equal to what it said before: nothing happens."""
        self.failing_sources.discard(source)
        self.source_problems.pop(source, None)
        previous = self._states.get(source)
        if previous == state:
            return
        self._states[source] = state
        self.changes += 1
        now = self._clock.now()
        # Only which endpoints appeared or disappeared matters here, and only for the services whose
        # endpoints changed (sources reuse the tuples of unchanged ones): no full merge or scan of
        # every endpoint on each registry call.
        appeared, disappeared = [], []
        before_all = previous.endpoints if previous is not None else {}
        for name in before_all.keys() | state.endpoints.keys():
            before, after = before_all.get(name, ()), state.endpoints.get(name, ())
            if before is after or before == after:
                continue
            old_addresses = {e.address for e in before}
            new_addresses = {e.address for e in after}
            for address in new_addresses - old_addresses:
                key = (name, address)
                self._providers[key] = self._providers.get(key, 0) + 1
                if self._providers[key] == 1:
                    appeared.append(key)
            for address in old_addresses - new_addresses:
                key = (name, address)
                self._providers[key] -= 1
                if not self._providers[key]:
                    del self._providers[key]
                    disappeared.append(key)
        self._damper.change(appeared, disappeared, now)
        self._debouncer.change(now)
        self._wake.set()

    def set_subset_tables(self, tables: Mapping[str, IndexTable]) -> None:
        """Shared tables changed (etcd): build with them (and only them) from now on."""
        if tables == self.subset_tables:
            return
        self.subset_tables = dict(tables)
        self.subset_tables_changed += 1
        self.changes += 1
        self._debouncer.change(self._clock.now())
        self._wake.set()

    def expected_sources(self) -> list[str]:
        """Every source the reconciler waits for before it publishes (file, etcd, registry)."""
        return sorted(self._expected)

    def waiting_for(self) -> list[str]:
        """The expected sources that have not reported their first complete state yet (a source
        that follows another, ``expect_after``, only once that one has)."""
        missing = self._expected - self._states.keys()
        return sorted(name for name in missing if self._after.get(name) not in missing)

    @property
    def confirm_hint(self) -> str:
        """How the operator confirms a held snapshot (printed with it)."""
        hint = self._confirm_hint
        return hint if isinstance(hint, str) else hint()

    def confirm(self, *, by: str = "") -> Snapshot | None:
        """The operator says the held snapshot is meant: publish it. Returns it (None: nothing held).
        ``by``: how the operator said so (``signal``, ``admin API``), for the event."""
        held = self.held
        if held is None:
            return None
        self.held = None
        self._events.emit("snapshot_confirmed", version=held.snapshot.label(), reasons=list(held.reasons),
                          **({"by": by} if by else {}))
        _log.warning("publishing snapshot %s as confirmed by the operator (%s)", held.snapshot.label(),
                     "; ".join(held.reasons))
        self._publish(held.snapshots, held.endpoints, held.tables)
        return held.snapshot

    def build_now(self) -> Snapshot | None:
        """Build and publish at once, skipping the debounce (at start-up). Returns the snapshot
        handed over, or None if nothing changed or a source has not reported yet; raises
        :class:`ConfigError` if it is refused."""
        self._debouncer.start_build()
        started = time.perf_counter()
        try:
            return self._build()
        finally:
            self.build_seconds += time.perf_counter() - started
            self._debouncer.finish_build()

    async def run(self) -> None:
        """Build whenever the debounce (or a flap hold) says so, until cancelled."""
        while True:
            deadline = self._next_deadline()
            if deadline is None:
                self._wake.clear()
                await self._wake.wait()
                continue
            now = self._clock.now()
            if now < deadline:
                await self._clock.sleep(deadline - now)
                continue
            self._hold_until = None
            self._debouncer.start_build()
            started = time.perf_counter()
            try:
                self._build()
            except ConfigError:
                pass  # reported in _build; the last good snapshot keeps serving
            except Exception:
                _log.exception("building the snapshot failed; keeping the last good one")
                self._events.emit("snapshot_error", reason="internal error while building (see log)")
            finally:
                self.build_seconds += time.perf_counter() - started
                self._debouncer.finish_build()

    @property
    def idle(self) -> bool:
        """Nothing is waiting to be built (no debounce or flap-hold deadline pending)."""
        return self._next_deadline() is None

    def _next_deadline(self) -> float | None:
        deadlines = [d for d in (self._debouncer.deadline(), self._hold_until) if d is not None]
        return min(deadlines) if deadlines else None

    def _damped(self, merged: Merged) -> Merged:
        """``merged`` without the endpoints the flap damper holds back (only the services that
        have one are rebuilt)."""
        held, wake = self._damper.held(self._clock.now())
        self._hold_until = wake
        if not held:
            return merged
        services = {name for name, _ in held}
        endpoints = dict(merged.endpoints)
        for name in services & endpoints.keys():
            endpoints[name] = tuple(e for e in endpoints[name] if (name, e.address) not in held)
        return replace(merged, endpoints=endpoints, patch=None)  # (held ones differ from what it was made from)

    def _source_names(self) -> str:
        return " + ".join(self._labels.get(name, name) for name in sorted(self._states)) or "no sources"

    def _build(self) -> Snapshot | None:
        if self.waiting_for():
            return None  # publishing now would serve "empty because not yet known"
        self.builds += 1
        merged = self._damped(merge_states(self._states, memo=self._merge_memo))
        tables = subset_tables(merged, self.subset_tables, default_size=self.subset_size,
                               allocate=not self.subset_tables_shared)
        try:
            built = build_snapshots(merged, self._source_names(), self._groups, memo=self._memo, rules=self._rules,
                                    rest_refresh=self._rest_refresh, subsets=tables, subset_size=self.subset_size)
        except ConfigError as exc:
            self._refuse(exc)
        snapshots: dict[NodeGroup, Snapshot] = {group: built[group] for group in self._groups}
        changed: dict[NodeGroup, Snapshot] = {}
        for group, snapshot in snapshots.items():
            current = self.cache.snapshot(group)
            same_version = current is not None and current.explicit_version == snapshot.explicit_version
            if current is not None and same_version and current.same_content(snapshot):
                continue
            if same_version and snapshot.explicit_version is not None:
                # Proxies at that version would never be sent the new content: refuse, loudly.
                self._refuse(ConfigError(self._source_names(), [Problem(
                    "version", f"the content changed but the version is still {snapshot.explicit_version!r}: "
                               "set a new version, or remove it to version by content")]))
            changed[group] = snapshot
        self.last_error = None
        first = next(iter(snapshots.values()))
        if not changed:
            self._release_hold("the sources are back to what is served")
            self._events.emit("snapshot_unchanged", version=first.label())
            self._merged_served(merged)
            return None
        endpoints = endpoint_counts(merged)
        if self.guard.enabled:
            reasons: list[str] = []
            counts: dict[str, dict[str, int]] = {}
            seen: set[str] = set()
            # The default group first: a reason every group shares is said once, plainly.
            for group in sorted(changed, key=lambda g: g != DEFAULT_GROUP):
                current = self.cache.snapshot(group)
                if current is None:
                    continue
                found, found_counts = blast_radius(current, changed[group], self._published_endpoints, endpoints,
                                                   self.guard)
                prefix = "" if group == DEFAULT_GROUP else f"node group {group}: "
                reasons.extend(prefix + reason for reason in found if reason not in seen)
                seen.update(found)
                for what, count in found_counts.items():
                    counts.setdefault(what, count)
            if reasons:
                self._hold(changed, reasons, counts, endpoints, tables)
                return None
        self._release_hold("a later change replaced it")
        self._publish(changed, endpoints, tables)
        self._merged_served(merged)
        return snapshots.get(DEFAULT_GROUP, first)

    def _merged_served(self, merged: Merged) -> None:
        """``merged`` is what is served now (published, or unchanged): tell :attr:`on_merged`. A
        refused or held state is not (so shared indices are not freed for a removal held back)."""
        if self.on_merged is not None:
            self.on_merged(merged)

    def _refuse(self, error: ConfigError) -> NoReturn:
        self.last_error = error
        self.last_error_at = time.time()
        self.refused += 1
        self._events.emit("snapshot_error", reason=error.describe())
        _log.error("%s\nstill serving the last good snapshot", error.describe())
        raise error

    def _hold(self, snapshots: Mapping[NodeGroup, Snapshot], reasons: list[str], counts: dict[str, dict[str, int]],
              endpoints: dict[str, int], tables: Mapping[str, IndexTable]) -> None:
        if self.held is not None and self.held.same_content(snapshots):
            return  # already held and reported
        self.held = Held(dict(snapshots), tuple(reasons), endpoints, tables)
        self.held_count += 1
        snapshot = self.held.snapshot
        self._events.emit("snapshot_held", version=snapshot.label(), reasons=reasons, counts=counts)
        hint = f"\nto publish it anyway: {self.confirm_hint}" if self.confirm_hint else ""
        _log.error("snapshot %s is HELD, not published: %s.\nstill serving the last good snapshot; if this is "
                   "a mistake, fix the source and it is dropped%s", snapshot.label(), "; ".join(reasons), hint)

    def _release_hold(self, why: str) -> None:
        if self.held is not None:
            self._events.emit("snapshot_hold_released", version=self.held.snapshot.label(), reason=why)
            _log.warning("held snapshot %s dropped: %s", self.held.snapshot.label(), why)
            self.held = None

    def _publish(self, snapshots: Mapping[NodeGroup, Snapshot], endpoints: dict[str, int],
                 tables: Mapping[str, IndexTable]) -> None:
        """Hand each group's new snapshot to the cache; one ``snapshot_loaded`` event names the
        default group's (else the first changed group's) snapshot and, with several groups, each
        group's."""
        if tables != self.subset_tables and not self.subset_tables_shared:
            self.subset_tables = tables
            self.subset_tables_changed += 1
        started = time.perf_counter()
        status = self._status
        if status is not None:  # before the fan-out: ACKs are measured from here
            for group, snapshot in snapshots.items():
                status.published(group, label=snapshot.label(),
                                 versions={url: ts.version for url, ts in snapshot.types.items()})
        answered = sum(self.cache.set_snapshot(snapshot, group) for group, snapshot in snapshots.items())
        pushed_ms = round((time.perf_counter() - started) * 1000, 3)
        self._published_endpoints = endpoints
        self.published += 1
        shown = self.cache.snapshot(DEFAULT_GROUP) or next(iter(snapshots.values()))
        more = {"groups": {group: s.label() for group, s in snapshots.items()}} if len(self._groups) > 1 else {}
        self._events.emit("snapshot_loaded", version=shown.label(), versions=shown.versions(),
                          watches_answered=answered, push_ms=pushed_ms, **more)
        _log.info("snapshot %s published (%s)%s", shown.label(), shown.versions(),
                  f", node groups {', '.join(sorted(snapshots))}" if len(self._groups) > 1 else "")

    # -- checking a change before a source accepts it ------------------------------------------

    def check(self, source: str, state: DesiredState) -> list[Problem]:
        """The problems ``state`` would add if ``source`` reported it now; empty: safe to accept.

        The state is merged with every other source's current state and built, without
        publishing anything (encoded resources come from the reconciler's memo, so a build that
        changes little costs little). Only problems the change *introduces* are returned: when the
        merged state is already invalid because of another source (a clash between the file and
        etcd, say), a change that adds nothing new is still acceptable, so one broken source
        cannot freeze the others. Each problem says which source each service and raw resource it
        names comes from.

        A change to the endpoint lists alone that leaves the merged set of services as it was
        (the same definitions and raw resources; endpoints only for services that exist anyway)
        is accepted without a build: endpoints were checked when they were parsed, and which
        endpoints a service has cannot make a build fail; so registering and deregistering
        instances of known services stays cheap in large fleets. Unexpected exceptions (our
        bugs) propagate: the caller must then accept nothing.
        """
        current = self._states.get(source, DesiredState())
        if self._only_endpoints_differ(source, current, state):
            return []
        after = self._problems_with(source, state)
        if not after:
            return []
        before = set(self._problems_with(source, current))
        new = list(dict.fromkeys(p for p in after if p not in before))
        states = {**self._states, source: state}
        return [_attributed(problem, states, self._labels) for problem in new]

    def _only_endpoints_differ(self, source: str, a: DesiredState, b: DesiredState) -> bool:
        """Whether ``source`` going from ``a`` to ``b`` changes endpoints only, not which services
        the merge has (a service gets a cluster if any source defines it or lists endpoints for it)."""
        if a.services != b.services or a.version != b.version or a.resources != b.resources:
            return False
        others = [state for name, state in self._states.items() if name != source]
        return all(name in b.services or any(name in o.services or name in o.endpoints for o in others)
                   for name in a.endpoints.keys() ^ b.endpoints.keys())

    def _problems_with(self, source: str, state: DesiredState) -> list[Problem]:
        states = {**self._states, source: state}
        try:
            merged = merge_states(states)
            build_snapshots(merged, ", ".join(sorted(states)), self._groups, memo=self._memo,
                            rules=self._rules, rest_refresh=self._rest_refresh, subset_size=self.subset_size,
                            subsets=subset_tables(merged, self.subset_tables, default_size=self.subset_size,
                                                  allocate=not self.subset_tables_shared))
        except ConfigError as exc:
            return list(exc.problems)
        return []


_SERVICE_MENTION = re.compile(r"services\.([\w.-]+)")
_RESOURCE_MENTION = re.compile(r"\b(" + "|".join(t.key for t in TYPES) + r")\[(\d+)\]")


def _attributed(problem: Problem, states: Mapping[str, DesiredState], labels: Mapping[str, str]) -> Problem:
    """``problem`` with the sources of the services and raw resources it names appended."""
    def label(source: str) -> str:
        return labels.get(source, source)

    text = f"{problem.where} {problem.message}"
    notes: dict[str, str] = {}
    for match in _SERVICE_MENTION.finditer(text):
        # Service names may hold dots ("services.a.b.listen"): take the longest known prefix.
        parts = match.group(1).split(".")
        for end in range(len(parts), 0, -1):
            name = ".".join(parts[:end])
            defined = [label(s) for s in sorted(states) if name in states[s].services]
            listed = [label(s) for s in sorted(states) if name in states[s].endpoints]
            if defined or listed:
                origin = f"defined by {', '.join(defined)}" if defined else f"endpoints from {', '.join(listed)}"
                notes.setdefault(f"services.{name}", origin)
                break
    for match in _RESOURCE_MENTION.finditer(text):
        rtype, index = type_by_key(match.group(1)), int(match.group(2))
        assert rtype is not None  # the pattern names only type keys
        # merge_states concatenates raw resources source by source, in name order.
        for name in sorted(states):
            count = len(states[name].resources.get(rtype, ()))
            if index < count:
                notes.setdefault(match.group(0), f"{rtype.key}[{index}] of {label(name)}")
                break
            index -= count
    if not notes:
        return problem
    origins = "; ".join(f"{what}: {origin}" for what, origin in notes.items())
    return Problem(problem.where, f"{problem.message} [{origins}]")
