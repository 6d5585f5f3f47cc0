"""The blast-radius guard (docs/architecture.md, publishing rule 3): a snapshot that would remove
every listener or every cluster, or more than a set share of a type's resources or of a service's
endpoints at once, is held, reported loudly, and published only once the operator confirms it
(:meth:`Guard.confirm`) or a later change makes it harmless (:meth:`Guard.release`).

:func:`blast_radius` is the pure rule; :class:`Guard` keeps what is held, says so (events, log),
and hands it back when confirmed. Publishing is the reconciler's.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from envoy.config.endpoint.v3 import endpoint_pb2
from google.protobuf.message import Message

from pilotfish.build.desired import Merged
from pilotfish.build.subsetting import IndexTable
from pilotfish.cache import DEFAULT_GROUP, NodeGroup
from pilotfish.events import EventLog
from pilotfish.resources import CLUSTER, ENDPOINT, LISTENER, TYPES
from pilotfish.resources.builders import changed_places
from pilotfish.snapshot import Snapshot

__all__ = ["EndpointCounter", "Guard", "GuardSettings", "Held", "blast_radius", "endpoint_counts"]

_log = logging.getLogger("pilotfish.reconcile")


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
    return EndpointCounter()(merged)


class EndpointCounter:
    """:func:`endpoint_counts`, remembering the count of each raw ClusterLoadAssignment by the
    identity of its message until the next call (a file whose one assignment changed hands over
    the very messages of the others: they are not walked again). When the assignments are the
    last call's but for a few in the same places, each naming the cluster its place named, the
    last counts are patched with those few."""

    def __init__(self) -> None:
        self._counted: dict[int, tuple[Message, str, int]] = {}
        self._assignments: tuple[Message, ...] = ()
        self._raw_counts: dict[str, int] = {}

    def __call__(self, merged: Merged) -> dict[str, int]:
        counts = {name: len(found) for name, found in merged.endpoints.items()}
        assignments = tuple(merged.resources.get(ENDPOINT, ()))
        raw_counts = self._patched(assignments)
        if raw_counts is None:
            raw_counts, counted = {}, {}
            for assignment in assignments:
                _, name, total = counted[id(assignment)] = self._entry(assignment)
                raw_counts[name] = raw_counts.get(name, 0) + total
            self._counted = counted
        self._assignments, self._raw_counts = assignments, raw_counts
        if not counts:
            return dict(raw_counts)
        for name, total in raw_counts.items():
            counts[name] = counts.get(name, 0) + total
        return counts

    def _entry(self, assignment: Message) -> tuple[Message, str, int]:
        entry = self._counted.get(id(assignment))
        if entry is None or entry[0] is not assignment:
            assert isinstance(assignment, endpoint_pb2.ClusterLoadAssignment)
            total = sum(len(group.lb_endpoints) for group in assignment.endpoints)
            entry = (assignment, assignment.cluster_name, total)
        return entry

    def _patched(self, assignments: tuple[Message, ...]) -> dict[str, int] | None:
        """The raw counts of ``assignments`` from the last call's, when only a few changed in
        place and none names another cluster (None: count them all)."""
        before = self._assignments
        changed = changed_places(before, assignments) if before else None
        if changed is None:
            return None
        entries = [(self._counted.get(id(before[i])), self._entry(assignments[i])) for i in changed]
        if any(
            old is None or old[0] is not before[i] or old[1] != new[1]
            for i, (old, new) in zip(changed, entries, strict=True)
        ):
            return None
        counts = dict(self._raw_counts)
        for old, new in entries:
            assert old is not None
            counts[new[1]] += new[2] - old[2]
            self._counted.pop(id(old[0]), None)
            self._counted[id(new[0])] = new
        return counts


def blast_radius(
    previous: Snapshot,
    new: Snapshot,
    previous_endpoints: Mapping[str, int],
    new_endpoints: Mapping[str, int],
    settings: GuardSettings,
) -> tuple[list[str], dict[str, dict[str, int]]]:
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
            reasons.append(
                f"it removes {removed} of {before} {rtype.key} (more than {settings.max_removed_share:.0%} at once)"
            )
    share, least = settings.max_removed_share, settings.min_count
    shrunk = [
        name
        for name, before in previous_endpoints.items()
        if before >= least and before - new_endpoints.get(name, 0) > share * before
    ]
    for name in sorted(shrunk):
        before, after = previous_endpoints[name], new_endpoints.get(name, 0)
        counts[f"endpoints of {name}"] = {"before": before, "after": after, "removed": before - after}
        reasons.append(
            f"it removes {before - after} of the {before} endpoints of {name!r} "
            f"(more than {settings.max_removed_share:.0%} at once)"
        )
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
            held.same_content(snapshots[group]) for group, held in self.snapshots.items()
        )


class Guard:
    """What the guard holds, and how the operator is told. ``current``: a group's published
    snapshot (the cache's); ``confirm_hint``: how the operator confirms (printed with a hold)."""

    def __init__(
        self,
        settings: GuardSettings | None = None,
        *,
        current: Callable[[NodeGroup], Snapshot | None],
        events: EventLog | None = None,
        confirm_hint: str | Callable[[], str] = "",
    ) -> None:
        self.settings = settings or GuardSettings()
        self._current = current
        self._events = events or EventLog()
        self._confirm_hint = confirm_hint
        self.held: Held | None = None
        """The snapshots held back (None: nothing held)."""
        self.held_count = 0
        """How many snapshots it held back."""

    @property
    def confirm_hint(self) -> str:
        """How the operator confirms a held snapshot (printed with it)."""
        hint = self._confirm_hint
        return hint if isinstance(hint, str) else hint()

    def assess(
        self,
        changed: Mapping[NodeGroup, Snapshot],
        published_endpoints: Mapping[str, int],
        endpoints: Mapping[str, int],
        *,
        current: Callable[[NodeGroup], Snapshot | None] | None = None,
    ) -> tuple[list[str], dict[str, dict[str, int]]]:
        """Why publishing ``changed`` (each group's new snapshot) removes too much (empty: it
        does not, or the guard is off), and the counts of what it removes. The default group
        first: a reason every group shares is said once, plainly. ``current``: each group's
        published snapshot, as read earlier (a plan; default: as the cache has it now). Reads
        nothing else but the settings: pure, given ``current``."""
        reasons: list[str] = []
        counts: dict[str, dict[str, int]] = {}
        if not self.settings.enabled:
            return reasons, counts
        published = current or self._current
        seen: set[str] = set()
        for group in sorted(changed, key=lambda g: g != DEFAULT_GROUP):
            current_snapshot = published(group)
            if current_snapshot is None:
                continue
            found, found_counts = blast_radius(
                current_snapshot, changed[group], published_endpoints, endpoints, self.settings
            )
            prefix = "" if group == DEFAULT_GROUP else f"node group {group}: "
            reasons.extend(prefix + reason for reason in found if reason not in seen)
            seen.update(found)
            for what, count in found_counts.items():
                counts.setdefault(what, count)
        return reasons, counts

    def hold(
        self,
        snapshots: Mapping[NodeGroup, Snapshot],
        reasons: list[str],
        counts: dict[str, dict[str, int]],
        endpoints: dict[str, int],
        tables: Mapping[str, IndexTable],
    ) -> None:
        """Keep ``snapshots`` back, and say so (once per content)."""
        if self.held is not None and self.held.same_content(snapshots):
            return  # already held and reported
        self.held = Held(dict(snapshots), tuple(reasons), endpoints, tables)
        self.held_count += 1
        snapshot = self.held.snapshot
        self._events.emit("snapshot_held", version=snapshot.label(), reasons=reasons, counts=counts)
        hint = self.confirm_hint
        hint = f"\nto publish it anyway: {hint}" if hint else ""
        _log.error(
            "snapshot %s is HELD, not published: %s.\nstill serving the last good snapshot; if this is "
            "a mistake, fix the source and it is dropped%s",
            snapshot.label(),
            "; ".join(reasons),
            hint,
        )

    def release(self, why: str) -> None:
        """Drop what is held (the sources changed again), saying ``why``."""
        if self.held is not None:
            self._events.emit("snapshot_hold_released", version=self.held.snapshot.label(), reason=why)
            _log.warning("held snapshot %s dropped: %s", self.held.snapshot.label(), why)
            self.held = None

    def confirm(self, *, by: str = "") -> Held | None:
        """The operator says the held snapshot is meant: hand it over, to publish (None: nothing
        held). ``by``: how the operator said so (``signal``, ``admin API``), for the event."""
        held = self.held
        if held is None:
            return None
        self.held = None
        self._events.emit(
            "snapshot_confirmed",
            version=held.snapshot.label(),
            reasons=list(held.reasons),
            **({"by": by} if by else {}),
        )
        _log.warning(
            "publishing snapshot %s as confirmed by the operator (%s)", held.snapshot.label(), "; ".join(held.reasons)
        )
        return held
