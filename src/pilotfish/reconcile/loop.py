"""The reconcile loop: the sources' states in, checked snapshots out to the cache.

:class:`Reconciler` composes the parts of this package and runs the loop. Sources report whole
views (:meth:`Reconciler.update`): the view is kept, :class:`~pilotfish.reconcile.damping.Damping`
sees which endpoints came and went, :class:`~pilotfish.reconcile.readiness.Readiness` that the
source is in, and the :class:`~pilotfish.reconcile.debounce.Debouncer` that a change arrived.
:meth:`Reconciler.run` builds when the debounce (or a flap hold) says so: merge every source's
view, take out what the damper holds back, build every node group's snapshot in one pass
(:func:`pilotfish.build.desired.build_snapshots`, in a worker thread: the event loop goes on
serving streams meanwhile), refuse it on any problem (the last good one keeps
serving), skip groups whose content did not change, ask the
:class:`~pilotfish.reconcile.guard.Guard` whether it removes too much, and publish. Nothing is
built while an expected source has not reported. :meth:`Reconciler.check`
(:class:`~pilotfish.reconcile.admission.Admission`) tries a proposed state without publishing;
:meth:`Reconciler.plan` says all a proposed state would do (:mod:`~pilotfish.reconcile.plan`).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import NoReturn

from pilotfish.build.desired import DesiredState, Merged, MergeMemo, View, build_snapshots, merge_states
from pilotfish.build.subsetting import IndexTable
from pilotfish.cache import DEFAULT_GROUP, NodeGroup, SnapshotPublisher
from pilotfish.errors import ConfigError, Problem
from pilotfish.events import ANNOUNCE, EventLog
from pilotfish.reconcile.admission import Admission
from pilotfish.reconcile.damping import Damping, EndpointKey, without_held
from pilotfish.reconcile.debounce import Clock, Debouncer, DebounceSettings, MonotonicClock
from pilotfish.reconcile.guard import EndpointCounter, Guard, GuardSettings, Held, endpoint_counts
from pilotfish.reconcile.names import Kept, LastGoodNames, NameSettings, Resolver, with_last_good
from pilotfish.reconcile.plan import GroupPlan, GuardVerdict, Plan, TypeDiff, diff_snapshots
from pilotfish.reconcile.readiness import Readiness
from pilotfish.reconcile.stats import ReconcileStats
from pilotfish.reconcile.tables import SubsetTables
from pilotfish.resources.bootstrap import DEFAULT_REST_REFRESH
from pilotfish.resources.builders import ResourceMemo
from pilotfish.snapshot import Snapshot
from pilotfish.status import SyncStatus

__all__ = ["BuildOptions", "Reconciler", "SubsetOptions"]

_log = logging.getLogger("pilotfish.reconcile")
_announce = logging.getLogger(ANNOUNCE)


@dataclass(frozen=True, slots=True, kw_only=True)
class BuildOptions:
    """What every build makes, beside the sources' state."""

    groups: Mapping[NodeGroup, View] | None = None
    """The node groups served, and what each is served (None: one group of Envoys)."""
    rules: bool = True
    """Check Envoy's validate.rules before publishing (False: let Envoy NACK what breaks them)."""
    labels: Mapping[str, str] = field(default_factory=dict)
    """How errors name each source (e.g. "file" -> the file's path)."""
    rest_refresh: float = DEFAULT_REST_REFRESH
    """Seconds between the EDS and RDS polls of ``rest`` groups."""
    grpc_load_reports: bool = False
    """The built clusters of ``grpc`` groups ask proxyless gRPC clients to report their load to
    this server (``lrs_server: {self: {}}``): on when a rollout judges its bakes by load reports."""
    names: NameSettings = field(default_factory=NameSettings)
    """How the host names of DNS services are looked up (their last good addresses kept)."""
    resolver: Resolver | None = None
    """What looks them up (None: the host's resolver)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class SubsetOptions:
    """Subsetting: the default subset size and the backend index tables builds use."""

    size: int | None = None
    """The subset size of services that set none (None: only those that set one are subsetted)."""
    tables: Mapping[str, IndexTable] | None = None
    """The backend index tables to start from (a state file's)."""
    shared: bool = False
    """The tables are shared by every replica (in etcd): builds take them as etcd has them."""
    ready_after: Mapping[str, str] | None = None
    """Sources that report only once another has (the indices in etcd after the etcd source)."""
    on_merged: Callable[[Merged], None] | None = None
    """Told the merged state of every build served (the replica that writes the shared tables)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class _PlanInputs:
    """What a plan's build starts from, read on the loop (:meth:`Reconciler.planner`): immutable
    values, or mappings the loop replaces and never changes in place."""

    states: Mapping[str, DesiredState]
    sources: str
    current: Mapping[NodeGroup, Snapshot | None]
    held: frozenset[EndpointKey]
    tables: Mapping[str, IndexTable]
    published_endpoints: Mapping[str, int]
    waiting: tuple[str, ...]
    kept: Kept


@dataclass(frozen=True, slots=True)
class _Inputs:
    """What one build starts from (:meth:`Reconciler._inputs`), read on the loop."""

    merged: Merged
    """What is built: every source's state merged, less what the damper holds back, kept
    addresses in place of the names that stopped resolving."""
    counted: Merged
    """What the guard counts (the names themselves)."""
    tables: Mapping[str, IndexTable]
    sources: str
    """How problems name the sources ("file + registry")."""


@dataclass(frozen=True, slots=True)
class _Built:
    """What one build found (:meth:`Reconciler._computed`)."""

    snapshots: dict[NodeGroup, Snapshot]
    endpoints: dict[str, int]
    """Endpoints per service, as the guard counts them."""


class Reconciler:
    """Turns the desired state of all sources into the cache's snapshots, debounced and checked
    (see the module docstring). Its parts are public: :attr:`readiness`, :attr:`guard`,
    :attr:`tables`, :attr:`damping`, :attr:`stats`."""

    def __init__(
        self,
        cache: SnapshotPublisher,
        *,
        settings: DebounceSettings | None = None,
        clock: Clock | None = None,
        events: EventLog | None = None,
        build: BuildOptions | None = None,
        expect: Iterable[str] = (),
        guard: GuardSettings | None = None,
        confirm_hint: str | Callable[[], str] = "",
        status: SyncStatus | None = None,
        subsets: SubsetOptions | None = None,
    ) -> None:
        self.cache = cache
        self.settings = settings or DebounceSettings()
        self._clock: Clock = clock or MonotonicClock()
        self._events = events or EventLog()
        build = build or BuildOptions()
        subsets = subsets or SubsetOptions()
        self._groups: dict[NodeGroup, View] = dict(build.groups or {DEFAULT_GROUP: View()})
        """The node groups served, and what each is served (default: one group of Envoys)."""
        self._rules = build.rules
        """Check Envoy's validate.rules before publishing (off: let Envoy NACK what breaks them)."""
        self._labels = dict(build.labels)
        """How errors name each source (e.g. "file" -> the file's path)."""
        self._rest_refresh = build.rest_refresh
        """Seconds between the EDS and RDS polls of ``rest`` groups."""
        self._grpc_load_reports = build.grpc_load_reports
        self._status = status
        """Told each group's versions as they are published (what proxies are measured against)."""
        self._on_merged = subsets.on_merged
        """Told the merged state of every build served (the replica that allocates shared indices)."""
        self._states: dict[str, DesiredState] = {}
        self.readiness = Readiness(expect, after=subsets.ready_after)
        self.guard = Guard(guard, current=cache.snapshot, events=self._events, confirm_hint=confirm_hint)
        self.tables = SubsetTables(subsets.tables, shared=subsets.shared, default_size=subsets.size)
        self.damping = Damping(flap_window=self.settings.flap_window, hold=self.settings.hold)
        self.stats = ReconcileStats()
        self.names = LastGoodNames(
            build.names, resolver=build.resolver, clock=self._clock, events=self._events, on_change=self._names_changed
        )
        """The host names of DNS services, looked up: the last good addresses of those that stopped
        resolving are served in their place (run :meth:`LastGoodNames.run` beside :meth:`run`)."""
        self._admission = Admission(self._states, self._trial, labels=self._labels)
        self._debouncer = Debouncer(
            quiet=self.settings.quiet,
            max_delay=self.settings.max_delay,
            min_interval=1.0 / self.settings.max_builds_per_s,
        )
        self._hold_until: float | None = None
        self._wake = asyncio.Event()
        self._memo = ResourceMemo()
        self._memo_lock = threading.Lock()
        """Held while a build (in :meth:`run`'s thread) or an admission trial (on the loop) uses
        :attr:`_memo`."""
        self._merge_memo = MergeMemo()
        self._endpoint_counts = EndpointCounter()
        self._published_endpoints: dict[str, int] = {}
        self._refused_input = False
        """An input was refused (where it was read, or by a build) and no build has been accepted
        since: the next accepted one is announced as the fix."""

    # -- what sources say -------------------------------------------------------------------------

    def update(self, source: str, state: DesiredState) -> None:
        """A source's whole current view. Equal to what it said before: nothing happens."""
        self.readiness.reported(source)
        previous = self._states.get(source)
        # What it touches, field by field: nothing means it equals what the source said before
        # (one comparison of the two states, not two).
        keys, endpoints_changed = _touched(source, previous, state)
        if not keys:
            if self._refused_input and self.stats.last_error is None:  # back to what is served
                self._announce_fix(self.cache.snapshot(DEFAULT_GROUP))
            return
        self._states[source] = state
        self.stats.changes += 1
        now = self._clock.now()
        self.damping.report(previous, state, now, changed=endpoints_changed)
        self._changed(now, keys)

    def source_error(self, source: str, reason: str = "") -> None:
        """``source``'s latest input was refused (and reported) where it was read, for ``reason``."""
        self.readiness.refused(source, reason)
        self._refused_input = True

    def set_subset_tables(self, tables: Mapping[str, IndexTable]) -> None:
        """Shared tables changed (etcd): build with them (and only them) from now on."""
        if self.tables.set_shared(tables):
            self.stats.changes += 1
            self._changed(self._clock.now(), (_SUBSET_TABLES,))

    def check(self, source: str, state: DesiredState) -> list[Problem]:
        """The problems ``state`` would add if ``source`` reported it now (see
        :class:`~pilotfish.reconcile.admission.Admission`); empty: safe to accept."""
        return self._admission.check(source, state)

    def plan(self, source: str, state: DesiredState, *, label: str | None = None) -> Plan:
        """What would happen if ``source`` reported ``state`` now, publishing nothing and changing
        nothing: :meth:`planner`'s plan, made here."""
        return self.planner(source, state, label=label)()

    def planner(self, source: str, state: DesiredState, *, label: str | None = None) -> Callable[[], Plan]:
        """Read now (on the loop) what a build would start from with ``state`` as ``source``'s
        state: every other source's state, each group's published snapshot, the endpoints the
        damper holds back, the subsetting tables. Returns the function that builds it as
        :meth:`run` does (merge, damp, build every group, refuse on any problem, skip the
        groups that did not change, ask the guard) and says what it found
        (:class:`~pilotfish.reconcile.plan.Plan`). That function reads only what was read here
        and settings that never change, and uses a memo of its own: it may run in another thread
        while the loop goes on building and publishing. ``label``: how problems name ``source``
        in this plan (default: as the server names it)."""
        labels = {**self._labels, **({source: label} if label else {})}
        states = {**self._states, source: state}
        # (held() forgets the holds that ended by now, as the next build would: nothing else moves)
        held, _ = self.damping.damper.held(self._clock.now())
        inputs = _PlanInputs(
            states=states,
            sources=" + ".join(labels.get(name, name) for name in sorted(states)),
            current={group: self.cache.snapshot(group) for group in self._groups},
            held=frozenset(held),
            tables=self.tables.tables,
            published_endpoints=self._published_endpoints,
            waiting=tuple(labels.get(name, name) for name in self.readiness.waiting_for() if name != source),
            kept=replace(self.names.kept(), services=None),  # (the plan's services may use kept names too)
        )
        return functools.partial(self._plan, inputs)

    def _plan(self, inputs: _PlanInputs) -> Plan:
        """The build of ``inputs``, and its assessment; publishes nothing (see :meth:`planner`)."""
        try:
            merged = with_last_good(without_held(merge_states(inputs.states), set(inputs.held)), inputs.kept)
            tables = self.tables.for_build(merged, inputs.tables)
            built = self._snapshots(merged, inputs.sources, tables, memo=ResourceMemo())
            snapshots = {group: built[group] for group in self._groups}
            changed = _changed_groups(snapshots, inputs.current.get, inputs.sources)
        except ConfigError as exc:
            return Plan(sources=inputs.sources, problems=exc.problems, waiting_for=inputs.waiting)
        diffs: dict[tuple[int, int], dict[str, TypeDiff]] = {}  # groups that share snapshots share a diff
        groups: dict[NodeGroup, GroupPlan] = {}
        for group, snapshot in snapshots.items():
            before = inputs.current.get(group)
            key = (id(before), id(snapshot))
            if group in changed and key not in diffs:
                diffs[key] = diff_snapshots(before, snapshot)
            groups[group] = GroupPlan(
                changed=group in changed,
                before=None if before is None else before.label(),
                after=snapshot.label(),
                types=diffs[key] if group in changed else {},
            )
        reasons, counts = (
            self.guard.assess(changed, inputs.published_endpoints, endpoint_counts(merged), current=inputs.current.get)
            if changed
            else ([], {})
        )
        return Plan(
            sources=inputs.sources,
            groups=groups,
            changed=changed,
            guard=GuardVerdict(enabled=self.guard.settings.enabled, reasons=tuple(reasons), counts=counts),
            waiting_for=inputs.waiting,
        )

    def confirm(self, *, by: str = "") -> Snapshot | None:
        """The operator says the held snapshot is meant: publish it. Returns it (None: nothing held)."""
        held = self.guard.confirm(by=by)
        if held is None:
            return None
        self._publish(held.snapshots, held.endpoints, held.tables)
        return held.snapshot

    # -- what readers see (PublishState) ------------------------------------------------------------

    @property
    def held(self) -> Held | None:
        return self.guard.held

    @property
    def held_count(self) -> int:
        return self.guard.held_count

    @property
    def confirm_hint(self) -> str:
        return self.guard.confirm_hint

    @property
    def last_error(self) -> ConfigError | None:
        return self.stats.last_error

    def waiting_for(self) -> list[str]:
        return self.readiness.waiting_for()

    @property
    def idle(self) -> bool:
        """Nothing is waiting to be built (no debounce or flap-hold deadline pending)."""
        return self._next_deadline() is None

    # -- the loop -----------------------------------------------------------------------------------

    def build_now(self) -> Snapshot | None:
        """Build and publish at once, skipping the debounce, all on the calling thread (at
        start-up). Returns the snapshot handed over, or None if nothing changed or a source has
        not reported yet; raises :class:`ConfigError` if it is refused."""
        self._debouncer.start_build(self._clock.now())
        started = time.perf_counter()
        try:
            inputs = self._inputs()
            return None if inputs is None else self._conclude(inputs, self._computed(inputs))
        finally:
            self.stats.build_seconds += time.perf_counter() - started
            self._debouncer.finish_build()

    @property
    def building(self) -> bool:
        """A build is under way (:meth:`run`'s, in its thread, or :meth:`build_now`'s)."""
        return self._debouncer.building

    async def run(self) -> None:
        """Build whenever the debounce (or a flap hold) says so, until cancelled. A change that
        arrives while the loop waits for a later deadline wakes it (it may be due at once).

        Each build's heavy part (:meth:`_computed`: every group's snapshot, the endpoint counts)
        runs in a worker thread, so the event loop keeps serving streams meanwhile: a thread that
        holds the GIL gives it up to the loop every ``sys.getswitchinterval()`` (5 ms), so a build
        of 20,000 raw resources stalls the loop for a few milliseconds at a time, not for the
        whole build. What it starts from is read on the loop before (:meth:`_inputs`), and what
        it found is checked and published on the loop after (:meth:`_conclude`); changes that
        arrive meanwhile are the next build's."""
        while True:
            deadline = self._next_deadline()
            now = self._clock.now()
            if deadline is None or now < deadline:
                self._wake.clear()
                await self._wait(None if deadline is None else deadline - now)
                continue
            self._hold_until = None
            self._debouncer.start_build(now)
            started = time.perf_counter()
            try:
                inputs = self._inputs()
                if inputs is not None:
                    self._conclude(inputs, await asyncio.to_thread(self._computed, inputs))
            except ConfigError:
                pass  # reported in _conclude; the last good snapshot keeps serving
            except Exception:
                _log.exception("building the snapshot failed; keeping the last good one")
                self._events.emit("snapshot_error", reason="internal error while building (see log)")
            finally:
                self.stats.build_seconds += time.perf_counter() - started
                self._debouncer.finish_build()

    def _names_changed(self) -> None:
        """A name stopped resolving, or resolves again: what is served in its place changes."""
        self.stats.changes += 1
        self._changed(self._clock.now(), (_DNS_NAMES,))

    async def _wait(self, seconds: float | None) -> None:
        """Until a change arrives, or ``seconds`` pass on the clock (None: no limit)."""
        if seconds is None:
            await self._wake.wait()
            return
        woken = asyncio.ensure_future(self._wake.wait())
        slept = asyncio.ensure_future(self._clock.sleep(seconds))
        try:
            await asyncio.wait((woken, slept), return_when=asyncio.FIRST_COMPLETED)
        finally:
            woken.cancel()
            slept.cancel()

    def _changed(self, now: float, keys: Iterable[str]) -> None:
        self._debouncer.change(now, keys)
        self._wake.set()

    def _next_deadline(self) -> float | None:
        deadlines = [d for d in (self._debouncer.deadline(), self._hold_until) if d is not None]
        return min(deadlines) if deadlines else None

    def _source_names(self) -> str:
        return " + ".join(self._labels.get(name, name) for name in sorted(self._states)) or "no sources"

    def _snapshots(
        self, merged: Merged, sources: str, tables: Mapping[str, IndexTable], *, memo: ResourceMemo
    ) -> dict[NodeGroup, Snapshot]:
        return build_snapshots(
            merged,
            sources,
            self._groups,
            memo=memo,
            rules=self._rules,
            rest_refresh=self._rest_refresh,
            grpc_load_reports=self._grpc_load_reports,
            subsets=tables,
            subset_size=self.tables.default_size,
        )

    def _trial(self, states: Mapping[str, DesiredState]) -> list[Problem]:
        """Build ``states`` merged, publishing nothing: the problems (admission's trial)."""
        try:
            merged = merge_states(states)
            tables = self.tables.for_build(merged)
            # (Waits for a build in its thread to be done with the memo: rare, and no longer than
            # the same build would have held the loop.)
            with self._memo_lock:
                self._snapshots(merged, ", ".join(sorted(states)), tables, memo=self._memo)
        except ConfigError as exc:
            return list(exc.problems)
        return []

    def _inputs(self) -> _Inputs | None:
        """What the next build starts from, read on the loop: every source's state merged, less
        what the damper holds back, kept addresses in place of names that stopped resolving, the
        subsetting tables. None: an expected source has not reported (publishing now would serve
        "empty because not yet known")."""
        if self.readiness.waiting_for():
            return None
        self.stats.builds += 1
        merged, self._hold_until = self.damping.damped(
            merge_states(self._states, memo=self._merge_memo), self._clock.now()
        )
        self.names.note(merged)
        # Kept addresses stand for their name: the guard counts the name, so its resolving again
        # (a name's addresses back to the name) is no removal.
        counted, merged = merged, self.names.served(merged)
        return _Inputs(merged, counted, self.tables.for_build(merged), self._source_names())

    def _computed(self, inputs: _Inputs) -> _Built | ConfigError:
        """The heavy part of a build: every group's snapshot, and the endpoints the guard counts;
        or the problems that refuse it. Reads only ``inputs`` and memos that only builds use (the
        resource memo also serves admission's trials, under a lock): it may run in a thread."""
        with self._memo_lock:
            try:
                built = self._snapshots(inputs.merged, inputs.sources, inputs.tables, memo=self._memo)
            except ConfigError as exc:
                return exc
        return _Built({group: built[group] for group in self._groups}, self._endpoint_counts(inputs.counted))

    def _conclude(self, inputs: _Inputs, built: _Built | ConfigError) -> Snapshot | None:
        """On the loop, after :meth:`_computed`: refuse the build on any problem, skip the groups
        that did not change, ask the guard, publish. Returns the snapshot handed over (None:
        nothing changed, or the guard holds it); raises :class:`ConfigError` when refused."""
        if isinstance(built, ConfigError):
            self._refuse(built)
        snapshots = built.snapshots
        try:
            changed = _changed_groups(snapshots, self.cache.snapshot, inputs.sources)
        except ConfigError as exc:
            self._refuse(exc)
        self.stats.last_error = None
        first = next(iter(snapshots.values()))
        self._announce_fix(snapshots.get(DEFAULT_GROUP, first))
        if not changed:
            self.guard.release("the sources are back to what is served")
            self._events.emit("snapshot_unchanged", version=first.label())
            self._merged_served(inputs.merged)
            return None
        reasons, counts = self.guard.assess(changed, self._published_endpoints, built.endpoints)
        if reasons:
            self.guard.hold(changed, reasons, counts, built.endpoints, inputs.tables)
            return None
        self.guard.release("a later change replaced it")
        self._publish(changed, built.endpoints, inputs.tables)
        self._merged_served(inputs.merged)
        return snapshots.get(DEFAULT_GROUP, first)

    def _merged_served(self, merged: Merged) -> None:
        """``merged`` is what is served now (published, or unchanged): tell ``on_merged``. A
        refused or held state is not (so shared indices are not freed for a removal held back)."""
        if self._on_merged is not None:
            self._on_merged(merged)

    def _announce_fix(self, snapshot: Snapshot | None) -> None:
        """After a refused input, the first one accepted (no source failing): say so, once."""
        if not self._refused_input or self.readiness.failing_sources:
            return
        self._refused_input = False
        _announce.info(
            "fixed: %s accepted again (snapshot %s); the refused input no longer stands",
            self._source_names(),
            "-" if snapshot is None else snapshot.label(),
        )

    def _refuse(self, error: ConfigError) -> NoReturn:
        self._refused_input = True
        self.stats.last_error = error
        self.stats.last_error_at = time.time()
        self.stats.refused += 1
        self._events.emit("snapshot_error", reason=error.describe())
        _log.error("%s\nstill serving the last good snapshot", error.describe())
        raise error

    def _publish(
        self, snapshots: Mapping[NodeGroup, Snapshot], endpoints: dict[str, int], tables: Mapping[str, IndexTable]
    ) -> None:
        """Hand each group's new snapshot to the cache; one ``snapshot_loaded`` event names the
        default group's (else the first changed group's) snapshot and, with several groups, each
        group's."""
        self.tables.published(tables)
        started = time.perf_counter()
        status = self._status
        if status is not None:  # before the fan-out: ACKs are measured from here
            for group, snapshot in snapshots.items():
                status.published(
                    group, label=snapshot.label(), versions={url: ts.version for url, ts in snapshot.types.items()}
                )
        answered = self.cache.publish(snapshots)
        pushed_ms = round((time.perf_counter() - started) * 1000, 3)
        self._published_endpoints = endpoints
        self.stats.published += 1
        shown = self.cache.snapshot(DEFAULT_GROUP) or next(iter(snapshots.values()))
        more = {"groups": {group: s.label() for group, s in snapshots.items()}} if len(self._groups) > 1 else {}
        self._events.emit(
            "snapshot_loaded",
            version=shown.label(),
            versions=shown.versions(),
            watches_answered=answered,
            push_ms=pushed_ms,
            **more,
        )
        _log.info(
            "snapshot %s published (%s)%s",
            shown.label(),
            shown.versions(),
            f", node groups {', '.join(sorted(snapshots))}" if len(self._groups) > 1 else "",
        )


_SUBSET_TABLES = "subset tables"
"""The debounce key of a change to the shared subsetting tables."""
_DNS_NAMES = "dns names"
"""The debounce key of a change in what is served for the host names of DNS services."""


def _touched(source: str, previous: DesiredState | None, state: DesiredState) -> tuple[set[str], list[str]]:
    """What a source's new state touches: the debounce keys (each service whose definition or
    endpoints changed; the source's raw resources and version as one key of its own; every field
    of the state is looked at, so no key means an equal state) and the services whose endpoints
    changed. Unchanged services are the very objects they were (sources reuse them), so this
    costs an identity check per service. (Raw resources' TTLs count with the resources.)"""
    before = previous or DesiredState()
    endpoints_changed = _differing(before.endpoints, state.endpoints)
    keys = set(endpoints_changed)
    keys.update(_differing(before.services, state.services))
    if (
        previous is None
        or before.resources != state.resources
        or before.version != state.version
        or before.ttls != state.ttls
    ):
        keys.add(f"{source} resources")  # (a source's first report is a change, even an empty one)
    return keys, endpoints_changed


def _differing(before: Mapping[str, object], after: Mapping[str, object]) -> list[str]:
    """The names whose values differ between ``before`` and ``after`` (present in one only included)."""
    if before is after:
        return []
    missing = object()
    return [
        name
        for name in before.keys() | after.keys()
        if (was := before.get(name, missing)) is not (now := after.get(name, missing)) and was != now
    ]


def _changed_groups(
    snapshots: Mapping[NodeGroup, Snapshot], current: Callable[[NodeGroup], Snapshot | None], sources: str
) -> dict[NodeGroup, Snapshot]:
    """The groups whose new snapshot differs from ``current``'s (the published one); raises
    :class:`ConfigError` when one changed and kept its explicit version. With explicit versions,
    the types that did not change keep the published version (not sent again)."""
    changed: dict[NodeGroup, Snapshot] = {}
    for group, snapshot in snapshots.items():
        was = current(group)
        same_version = was is not None and was.explicit_version == snapshot.explicit_version
        if was is not None and same_version and was.same_content(snapshot):
            continue
        if same_version and snapshot.explicit_version is not None:
            # Proxies at that version would never be sent the new content: refuse, loudly.
            raise ConfigError(
                sources,
                [
                    Problem(
                        "version",
                        f"the content changed but the version is still {snapshot.explicit_version!r}: "
                        "set a new version, or remove it to version by content",
                    )
                ],
            )
        changed[group] = snapshot if was is None else snapshot.keeping_versions_of(was)
    return changed
