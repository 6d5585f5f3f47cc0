"""Plans (``pilotfish plan``): what a proposed change would do, said before it is made.

:meth:`~pilotfish.reconcile.Reconciler.plan` builds the sources' states with a proposed one in
place of a source's, as a build would, publishing nothing, and gives a :class:`Plan`: the
problems that would refuse the build (all of them: then nothing else applies), else per node
group and type the resources added, removed and changed (:func:`diff_snapshots`, against what is
published), and whether the blast-radius guard would hold it and why. The rollout's decision and
the proxies connected are the admin API's to add (:meth:`Plan.to_json`).

A changed resource comes with its field-level differences: the paths in its Envoy JSON whose
values differ, with the old and the new value (:func:`field_changes`). Lists whose items all
carry a distinct ``name`` (filter chains, virtual hosts, filters) are matched by name
(``virtual_hosts[name=web].domains[0]``; a new order of the same names is a change of its own,
``routes (order of names)``), others by position. Everything is bounded: the first
:data:`MAX_FIELD_CHANGES` changes of a resource, the first :data:`MAX_RESOURCES` names of each
list of a type, values over :data:`MAX_VALUE_CHARS` characters of JSON summarized; the counts
say what was left out. SDS secrets' values are never shown (:data:`REDACTED`): a plan names the
fields that change, as ``/v1/config`` names the secrets, and no key leaves through it.

Pure: the functions read immutable snapshots only, so a plan can be made off the event loop.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import orjson

from pilotfish.cache import NodeGroup
from pilotfish.errors import Problem
from pilotfish.resources import SECRET, TYPES, ResourceType
from pilotfish.resources.anytypes import message_dict
from pilotfish.snapshot import Resource, Snapshot, TypeSnapshot

__all__ = [
    "HOLD",
    "MAX_FIELD_CHANGES",
    "MAX_RESOURCES",
    "MAX_VALUE_CHARS",
    "NOT_SERVED",
    "NO_CHANGE",
    "PUBLISH",
    "REDACTED",
    "REFUSE",
    "VERDICTS",
    "WAIT",
    "FieldChange",
    "GroupPlan",
    "GuardVerdict",
    "Plan",
    "ResourceChange",
    "TypeDiff",
    "diff_snapshots",
    "diff_type",
    "field_changes",
]

MAX_FIELD_CHANGES = 50
"""Field changes listed per changed resource (``changes_left_out`` counts the rest)."""
MAX_RESOURCES = 200
"""Names listed per type in each of added, removed and changed (``left_out`` counts the rest)."""
MAX_VALUE_CHARS = 300
"""A value whose JSON is longer is shown as a summary (``(an object of 3 fields, 5,120 characters
of JSON)``; a string: its start), and its change marked ``clipped``."""
REDACTED = "(redacted)"
"""What a plan shows of a secret's values."""

PUBLISH = "publish"
"""It would be published (with a rollout: offered to it, and served)."""
NO_CHANGE = "no change"
"""Every group would be built as it is published: nothing would happen."""
REFUSE = "refuse"
"""The build would be refused (its problems say why); the last good snapshot keeps serving."""
HOLD = "hold"
"""The blast-radius guard would hold it until the operator confirms it."""
WAIT = "wait"
"""Nothing would be published yet: an expected source has not reported."""
NOT_SERVED = "not served"
"""With a rollout: the change is a candidate that was rolled back and held; no proxy would get it."""
VERDICTS = (PUBLISH, NO_CHANGE, REFUSE, HOLD, WAIT, NOT_SERVED)

_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_MISSING: Any = object()


@dataclass(frozen=True, slots=True)
class FieldChange:
    """One path of a resource's Envoy JSON whose value differs (None: the field is absent)."""

    path: str
    old: Any
    new: Any
    clipped: bool = False
    """A value was too long to show whole (see :data:`MAX_VALUE_CHARS`)."""

    def to_json(self) -> dict[str, Any]:
        out = {"path": self.path, "old": self.old, "new": self.new}
        return {**out, "clipped": True} if self.clipped else out


@dataclass(frozen=True, slots=True)
class ResourceChange:
    """A resource in both snapshots whose content differs."""

    name: str
    changes: tuple[FieldChange, ...]
    """The first :data:`MAX_FIELD_CHANGES` of them."""
    total: int
    """How many field changes there are in all."""

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "changes": [change.to_json() for change in self.changes],
            "changes_left_out": self.total - len(self.changes),
        }


@dataclass(frozen=True, slots=True)
class TypeDiff:
    """What changes in one type: names in order, the first :data:`MAX_RESOURCES` of each list."""

    added: tuple[str, ...]
    removed: tuple[str, ...]
    changed: tuple[ResourceChange, ...]
    counts: Mapping[str, int]
    """``added``, ``removed``, ``changed``: how many in all."""

    def to_json(self) -> dict[str, Any]:
        listed = {"added": len(self.added), "removed": len(self.removed), "changed": len(self.changed)}
        return {
            "added": list(self.added),
            "removed": list(self.removed),
            "changed": [change.to_json() for change in self.changed],
            "counts": dict(self.counts),
            "left_out": {what: self.counts[what] - count for what, count in listed.items()},
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class GroupPlan:
    """One node group: what it is served now, and what it would be."""

    changed: bool
    """Its snapshot would change (its types below, or only which endpoints each proxy's subset holds)."""
    before: str | None
    """The label of its published snapshot (None: nothing is published for it yet)."""
    after: str
    types: Mapping[str, TypeDiff]
    """By short type name (CDS, EDS...), only the types that change."""

    def to_json(self, proxies: int | None) -> dict[str, Any]:
        return {
            "changed": self.changed,
            "before": self.before,
            "after": self.after,
            "proxies": proxies,
            "types": {short: diff.to_json() for short, diff in self.types.items()},
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class GuardVerdict:
    """What the blast-radius guard would say of it."""

    enabled: bool
    reasons: tuple[str, ...] = ()
    """Why it would be held (empty: it would not)."""
    counts: Mapping[str, Mapping[str, int]] = field(default_factory=dict)
    """Of what it removes: before, after, removed."""

    def to_json(self) -> dict[str, Any]:
        return {
            "enabled": self.enabled,
            "hold": bool(self.reasons),
            "reasons": list(self.reasons),
            "counts": {what: dict(count) for what, count in self.counts.items()},
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class Plan:
    """What a proposed change would do (see the module docstring)."""

    sources: str
    """The sources as the build names them (``snapshot.yaml + the registry``)."""
    problems: tuple[Problem, ...] = ()
    """Why the build would be refused (empty: it is valid); then nothing else is known."""
    groups: Mapping[NodeGroup, GroupPlan] = field(default_factory=dict)
    changed: Mapping[NodeGroup, Snapshot] = field(default_factory=dict)
    """The snapshots that would be published: those of the groups that change."""
    guard: GuardVerdict | None = None
    """None: not assessed (the build is refused, or an offline plan)."""
    waiting_for: tuple[str, ...] = ()
    """Expected sources that have not reported yet: nothing is published until they do."""

    @property
    def verdict(self) -> str:
        """:data:`REFUSE`, :data:`WAIT`, :data:`NO_CHANGE`, :data:`HOLD` or :data:`PUBLISH`."""
        if self.problems:
            return REFUSE
        if self.waiting_for:
            return WAIT
        if not self.changed:
            return NO_CHANGE
        if self.guard is not None and self.guard.reasons:
            return HOLD
        return PUBLISH

    def to_json(
        self,
        *,
        proxies: Mapping[str, int] | None = None,
        rollout: Mapping[str, Any] | None = None,
        offline: bool = False,
    ) -> dict[str, Any]:
        """The plan as ``POST /v1/plan`` answers it. ``proxies``: connected proxies per group (None:
        unknown, offline); ``rollout``: what the rollout would decide
        (:meth:`~pilotfish.rollout.delivery.Delivery.would_offer`; a held candidate makes the
        verdict :data:`NOT_SERVED`)."""
        verdict = self.verdict
        if verdict == PUBLISH and rollout is not None and rollout.get("decision") == "held":
            verdict = NOT_SERVED
        return {
            "verdict": verdict,
            "published": verdict == PUBLISH,
            "offline": offline,
            "sources": self.sources,
            "problems": [{"where": p.where, "message": p.message} for p in self.problems],
            "waiting_for": list(self.waiting_for),
            "groups": {
                group: plan.to_json(None if proxies is None else proxies.get(group, 0))
                for group, plan in sorted(self.groups.items())
            },
            "guard": None if self.guard is None else self.guard.to_json(),
            "rollout": None if rollout is None else dict(rollout),
        }


def diff_snapshots(before: Snapshot | None, after: Snapshot) -> dict[str, TypeDiff]:
    """Per type (short name, in ADS order) that changes from ``before`` (None: nothing published)
    to ``after``: what is added, removed and changed."""
    out: dict[str, TypeDiff] = {}
    for rtype in TYPES:
        found = diff_type(rtype, None if before is None else before.get(rtype.url), after.get(rtype.url))
        if found is not None:
            out[rtype.short] = found
    return out


def diff_type(rtype: ResourceType, before: TypeSnapshot | None, after: TypeSnapshot | None) -> TypeDiff | None:
    """What changes in ``rtype`` (None: nothing)."""
    if before is after:
        return None
    if before is not None and after is not None and before.content_hash and before.content_hash == after.content_hash:
        return None
    old: Mapping[str, Resource] = before.resources if before is not None else {}
    new: Mapping[str, Resource] = after.resources if after is not None else {}
    added = sorted(new.keys() - old.keys())
    removed = sorted(old.keys() - new.keys())
    changed = sorted(name for name in old.keys() & new.keys() if old[name].hash != new[name].hash)
    if not (added or removed or changed):
        return None
    secret = rtype is SECRET
    changes = []
    for name in changed[:MAX_RESOURCES]:
        found, total = field_changes(_json(rtype, old[name]), _json(rtype, new[name]), redact=secret)
        changes.append(ResourceChange(name, tuple(found), total))
    return TypeDiff(
        added=tuple(added[:MAX_RESOURCES]),
        removed=tuple(removed[:MAX_RESOURCES]),
        changed=tuple(changes),
        counts={"added": len(added), "removed": len(removed), "changed": len(changed)},
    )


def _json(rtype: ResourceType, resource: Resource) -> dict[str, Any]:
    # Decoded from its bytes afresh: the Resource of a served snapshot is not touched (its message
    # cache neither), so this may run beside the loop.
    return message_dict(rtype.message.FromString(resource.value))


def field_changes(
    old: Any, new: Any, *, limit: int = MAX_FIELD_CHANGES, redact: bool = False
) -> tuple[list[FieldChange], int]:
    """The first ``limit`` paths where JSON values ``old`` and ``new`` differ, and how many there
    are in all. ``redact``: show no value (a secret's), only whether the field is there."""
    found: list[FieldChange] = []
    total = 0
    for path, a, b in _differences("", old, new):
        total += 1
        if len(found) < limit:
            found.append(_change(path, a, b, redact=redact))
    return found, total


def _differences(path: str, a: Any, b: Any) -> Iterator[tuple[str, Any, Any]]:
    if a == b:
        return
    if isinstance(a, dict) and isinstance(b, dict):
        for key in [*a, *(k for k in b if k not in a)]:
            yield from _differences(_key(path, key), a.get(key, _MISSING), b.get(key, _MISSING))
        return
    if isinstance(a, list) and isinstance(b, list):
        old, new = _by_name(a), _by_name(b)
        if old is not None and new is not None:
            kept_old, kept_new = [n for n in old if n in new], [n for n in new if n in old]
            if kept_old != kept_new:  # the same items in another order (routes match first to last)
                yield f"{path} (order of names)", kept_old, kept_new
            for name in [*old, *(n for n in new if n not in old)]:
                yield from _differences(
                    f"{path}[name={_quoted(name)}]", old.get(name, _MISSING), new.get(name, _MISSING)
                )
            return
        for index in range(max(len(a), len(b))):
            yield from _differences(
                f"{path}[{index}]", a[index] if index < len(a) else _MISSING, b[index] if index < len(b) else _MISSING
            )
        return
    yield path, a, b


def _by_name(items: list[Any]) -> dict[str, Any] | None:
    """The items by their ``name`` if every one is an object with a distinct string name."""
    named: dict[str, Any] = {}
    for item in items:
        name = item.get("name") if isinstance(item, dict) else None
        if not isinstance(name, str) or name in named:
            return None
        named[name] = item
    return named or None


def _key(path: str, key: str) -> str:
    if _IDENTIFIER.fullmatch(key):
        return f"{path}.{key}" if path else key
    return f"{path}[{orjson.dumps(key).decode()}]"


def _quoted(name: str) -> str:
    return name if name and not set(name) & set('[]"= ') else orjson.dumps(name).decode()


def _change(path: str, a: Any, b: Any, *, redact: bool) -> FieldChange:
    if redact:
        return FieldChange(path or "(the secret)", _redacted(a), _redacted(b))
    old, clipped_old = _shown(a)
    new, clipped_new = _shown(b)
    return FieldChange(path or "(the resource)", old, new, clipped_old or clipped_new)


def _redacted(value: Any) -> Any:
    return None if value is _MISSING else REDACTED


def _shown(value: Any) -> tuple[Any, bool]:
    """``value`` as a plan shows it (None: absent), and whether it was summarized."""
    if value is _MISSING:
        return None, False
    if value is None or isinstance(value, bool | int | float):
        return value, False
    size = len(orjson.dumps(value))
    if size <= MAX_VALUE_CHARS:
        return value, False
    if isinstance(value, str):
        return value[: MAX_VALUE_CHARS - 3] + "...", True
    what = f"an object of {_count(value, 'field')}" if isinstance(value, dict) else f"a list of {_count(value, 'item')}"
    return f"({what}, {size:,} characters of JSON)", True


def _count(items: Iterable[Any], noun: str) -> str:
    count = len(list(items))
    return f"{count} {noun}{'' if count == 1 else 's'}"
