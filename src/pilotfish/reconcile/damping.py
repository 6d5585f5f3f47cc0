"""Flap damping: an endpoint that disappears is removed at once (traffic must stop going to it);
one that comes back soon after is re-added only once it has stayed for ``hold`` seconds, so an
endpoint flipping ten times a second makes two pushes, not fifty.

:class:`FlapDamper` is the pure rule (it takes ``now``). :class:`Damping` feeds it from the
sources' reports (an endpoint is present while any source reports it) and takes what it holds
back out of a merged state before a build.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace

from pilotfish.build.desired import DesiredState, Merged
from pilotfish.resources.services import Endpoint

__all__ = ["Damping", "EndpointKey", "FlapDamper", "without_held"]

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


class Damping:
    """The damper fed from the sources: :meth:`report` each source's new state as it comes,
    :meth:`damped` a merged state before it is built."""

    def __init__(self, *, flap_window: float, hold: float) -> None:
        self.damper = FlapDamper(flap_window=flap_window, hold=hold)
        self._providers: dict[EndpointKey, int] = {}
        """How many sources report each endpoint (it is present while one does)."""

    def report(
        self, previous: DesiredState | None, state: DesiredState, now: float, *, changed: Iterable[str] | None = None
    ) -> None:
        """A source went from ``previous`` to ``state``. Only which endpoints appeared or
        disappeared matters, and only for the services whose endpoints changed (sources reuse
        the tuples of unchanged ones): no full merge or scan of every endpoint on each call.
        ``changed``: the services whose endpoints may differ, when the caller knows (None: any)."""
        appeared, disappeared = [], []
        before_all: Mapping[str, tuple[Endpoint, ...]] = previous.endpoints if previous is not None else {}
        names = before_all.keys() | state.endpoints.keys() if changed is None else changed
        for name in names:
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
        self.damper.change(appeared, disappeared, now)

    def damped(self, merged: Merged, now: float) -> tuple[Merged, float | None]:
        """``merged`` without the endpoints the damper holds back (only the services that have
        one are rebuilt), and when a hold ends (None: nothing held)."""
        held, wake = self.damper.held(now)
        return without_held(merged, held), wake


def without_held(merged: Merged, held: set[EndpointKey]) -> Merged:
    """``merged`` without the ``held`` endpoints (only the services that have one are rebuilt). Pure."""
    if not held:
        return merged
    services = {name for name, _ in held}
    endpoints = dict(merged.endpoints)
    for name in services & endpoints.keys():
        endpoints[name] = tuple(e for e in endpoints[name] if (name, e.address) not in held)
    return replace(merged, endpoints=endpoints, patch=None)  # (held ones differ from what it was made from)
