"""Admission: checking a source's proposed state before the source accepts it (the registry API
answers 409 to a change that would make the merged state invalid), without publishing anything.

The proposed state is merged with every other source's current state and built (``trial``: the
reconciler's build, with its memo, so a build that changes little costs little). Only problems the
change *introduces* count: when the merged state is already invalid because of another source (a
clash between the file and etcd, say), a change that adds nothing new is still acceptable, so one
broken source cannot freeze the others. Each problem says which source each service and raw
resource it names comes from.

A change to the endpoint lists alone that leaves the merged set of services as it was (the same
definitions and raw resources; endpoints only for services that exist anyway) is accepted without
a build: endpoints were checked when they were parsed, and which endpoints a service has cannot
make a build fail; so registering and deregistering instances of known services stays cheap in
large fleets.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping

from pilotfish.build.desired import DesiredState
from pilotfish.errors import Problem
from pilotfish.resources import TYPES, type_by_key

__all__ = ["Admission"]

Trial = Callable[[Mapping[str, DesiredState]], list[Problem]]
"""Build the merged state of these sources' states without publishing; the problems found."""


class Admission:
    """Checks proposed states against ``states`` (every source's current state, as the reconciler
    holds it). ``labels``: how problems name each source (e.g. "file" -> the file's path)."""

    def __init__(
        self, states: Mapping[str, DesiredState], trial: Trial, *, labels: Mapping[str, str] | None = None
    ) -> None:
        self._states = states
        self._trial = trial
        self._labels = dict(labels or {})

    def check(self, source: str, state: DesiredState) -> list[Problem]:
        """The problems ``state`` would add if ``source`` reported it now; empty: safe to accept.
        Unexpected exceptions (our bugs) propagate: the caller must then accept nothing."""
        current = self._states.get(source, DesiredState())
        if self._only_endpoints_differ(source, current, state):
            return []
        after = self._trial({**self._states, source: state})
        if not after:
            return []
        before = set(self._trial({**self._states, source: current}))
        new = list(dict.fromkeys(p for p in after if p not in before))
        states = {**self._states, source: state}
        return [_attributed(problem, states, self._labels) for problem in new]

    def _only_endpoints_differ(self, source: str, a: DesiredState, b: DesiredState) -> bool:
        """Whether ``source`` going from ``a`` to ``b`` changes endpoints only, not which services
        the merge has (a service gets a cluster if any source defines it or lists endpoints for it)."""
        if a.services != b.services or a.version != b.version or a.resources != b.resources:
            return False
        others = [state for name, state in self._states.items() if name != source]
        return all(
            name in b.services or any(name in o.services or name in o.endpoints for o in others)
            for name in a.endpoints.keys() ^ b.endpoints.keys()
        )


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
