"""Host names of DNS services, looked up by pilotfish too: the last good addresses are kept.

A service with an endpoint written as a host name is served as a STRICT_DNS cluster, and each Envoy
resolves the name itself (docs/sources.md). Envoy keeps the last hosts when a lookup *fails*, but a
lookup that *succeeds with no address* (the name was deleted, NXDOMAIN) empties the cluster, and
its requests get 503. So pilotfish looks the names up as well, every ``refresh`` seconds, and:

- while a name resolves, it is served as the name (Envoy follows DNS on its own);
- once a name that resolved stops resolving (no address, an error, no answer in ``timeout``), it
  is reported (``dns_unresolved``, a warning naming the services and the name) and its services'
  clusters are served with its last good addresses in its place: an IP address resolves to itself,
  so the cluster stays STRICT_DNS (those endpoints carry the name as metadata ``unresolved_name``,
  which is what keeps it so, and shows in ``/v1/config``);
- once it resolves again, it is reported (``dns_resolved``) and served as the name again;
- a name that never resolved here is served as the name (Envoy keeps trying) and reported.

Each state change is reported once, not at every lookup. The lookups use pilotfish's host's view of
DNS (``getaddrinfo``: its ``/etc/hosts``, its resolver), which is the proxies' view where they share
its resolver; what pilotfish cannot see is never taken out, only a name that stopped resolving for
pilotfish is pinned.

:class:`LastGoodNames` is the part: :meth:`~LastGoodNames.note` is told each build's merged state
(which names are in use), :meth:`~LastGoodNames.refresh` looks them up (through a
:class:`Resolver`, a seam: tests use a fake one; bounded in names, time per lookup and lookups at
once, run off the event loop) and tells the reconciler when what is served must change;
:func:`with_last_good` puts the kept addresses in place of their names in a merged state (pure).
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from pilotfish.build.desired import Merged
from pilotfish.events import EventLog
from pilotfish.reconcile.debounce import Clock, MonotonicClock
from pilotfish.resources.services import UNRESOLVED_NAME, Endpoint, host_names

__all__ = [
    "Kept",
    "LastGoodNames",
    "NameFigures",
    "NameSettings",
    "Resolver",
    "SystemResolver",
    "with_last_good",
]

_log = logging.getLogger("pilotfish.reconcile.names")


@dataclass(frozen=True, slots=True, kw_only=True)
class NameSettings:
    """How pilotfish looks up the host names of DNS services (``serve --dns-refresh``)."""

    refresh: float = 2.0
    """Seconds between two rounds of lookups (0: pilotfish looks nothing up, and keeps nothing)."""
    timeout: float = 5.0
    """A lookup that has not answered in this many seconds counts as failed."""
    max_names: int = 1_000
    """Names looked up at most (in name order); the others are served as names, unwatched."""
    concurrency: int = 4
    """Lookups at once (each holds a thread of the resolver's pool while it waits)."""


class Resolver(Protocol):
    """Looks a host name up: its IP addresses (empty: it has none); raises :class:`OSError` when
    the lookup fails."""

    async def addresses(self, name: str) -> tuple[str, ...]: ...


class SystemResolver:
    """The host's resolver (``getaddrinfo``, on a thread of the loop's: never on the event loop),
    IPv4 first as Envoy's ``V4_PREFERRED``: the IPv4 addresses if there are any, else the IPv6 ones."""

    async def addresses(self, name: str) -> tuple[str, ...]:
        found = await asyncio.get_running_loop().getaddrinfo(name, None, type=socket.SOCK_STREAM)
        v4 = sorted({str(info[4][0]) for info in found if info[0] == socket.AF_INET})
        v6 = sorted({str(info[4][0]) for info in found if info[0] == socket.AF_INET6})
        return tuple(v4 or v6)


@dataclass(frozen=True, slots=True)
class Kept:
    """The names served by their last good addresses, and the services that use them."""

    addresses: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    services: frozenset[str] | None = frozenset()
    """The services to look at (None: every one)."""


@dataclass(frozen=True, slots=True)
class NameFigures:
    """What ``/metrics`` shows of the names looked up."""

    resolving: int
    """Names that resolved at their last lookup."""
    kept: int
    """Names that stopped resolving, served by their last good addresses."""
    unresolved: int
    """Names that never resolved here, served as names."""
    left_out: int
    """Names beyond ``max_names``: not looked up."""
    lookups: int
    failures: int
    """Lookups that found no address, failed or timed out."""


@dataclass(slots=True)
class _Name:
    last_good: tuple[str, ...] = ()
    """The addresses of its last lookup that found some (empty: none yet)."""
    resolves: bool | None = None
    """Whether its last lookup found an address (None: not looked up yet)."""


def with_last_good(merged: Merged, kept: Kept) -> Merged:
    """``merged`` with each kept name's endpoints replaced by one per last good address (same port,
    weight, zone and metadata, and the name as metadata ``unresolved_name``); an address listed
    twice in a service is served once (the first, in the service's order). Pure."""
    if not kept.addresses:
        return merged
    names = kept.services if kept.services is not None else merged.endpoints.keys()
    endpoints = dict(merged.endpoints)
    touched = False
    for service in names:
        found = endpoints.get(service)
        if not found or not any(e.host in kept.addresses for e in found):
            continue
        by_address: dict[tuple[str, int], Endpoint] = {}
        for endpoint in found:
            pinned = kept.addresses.get(endpoint.host)
            if pinned is None:
                by_address.setdefault((endpoint.host, endpoint.port), endpoint)
                continue
            metadata = tuple(sorted({**dict(endpoint.metadata), UNRESOLVED_NAME: endpoint.host}.items()))
            for address in pinned:
                by_address.setdefault((address, endpoint.port), endpoint._replace(host=address, metadata=metadata))
        endpoints[service] = tuple(sorted(by_address.values()))
        touched = True
    return replace(merged, endpoints=endpoints, patch=None) if touched else merged


class LastGoodNames:
    """The names in use, what each last resolved to, and which are kept (see the module docstring)."""

    def __init__(
        self,
        settings: NameSettings | None = None,
        *,
        resolver: Resolver | None = None,
        clock: Clock | None = None,
        events: EventLog | None = None,
        on_change: Callable[[], None] = lambda: None,
    ) -> None:
        self.settings = settings or NameSettings()
        self._resolver: Resolver = resolver or SystemResolver()
        self._clock: Clock = clock or MonotonicClock()
        self._events = events or EventLog()
        self._on_change = on_change
        self._of_service: dict[str, tuple[tuple[Endpoint, ...], frozenset[str]]] = {}
        """The services with a host name among their endpoints: their endpoints as last noted, and
        the names among them (noted by identity)."""
        self._noted_from: Mapping[str, tuple[Endpoint, ...]] | None = None
        """The endpoints mapping last noted: a merge patched from it needs its changed names alone."""
        self._users: dict[str, list[str]] = {}
        """Each name in use (looked up), and the services that use it."""
        self._names: dict[str, _Name] = {}
        self._left_out = 0
        self._said_left_out = False
        self._kept = Kept()
        self._new_names = asyncio.Event()
        self.lookups = 0
        self.failures = 0

    # -- what the reconciler asks -----------------------------------------------------------------

    def note(self, merged: Merged) -> None:
        """The names ``merged`` uses (of every service with a host name among its endpoints). A
        name not seen before is looked up at once; one no longer used is forgotten."""
        if self.settings.refresh <= 0:
            return  # (looking nothing up: nothing to note)
        endpoints, patch = merged.endpoints, merged.patch
        before = self._of_service
        looked_at: Iterable[str]
        if patch is not None and patch.endpoints is self._noted_from:
            services, looked_at = before, patch.names  # (a build of one change costs that change)
        else:
            services, looked_at = {}, endpoints.keys()
        for service in looked_at:
            found = endpoints.get(service)
            noted = before.get(service)
            if found is None:
                services.pop(service, None)
            elif noted is not None and noted[0] is found:
                services[service] = noted
            elif hosts := frozenset(host_names(found)):
                services[service] = (found, hosts)
            else:
                services.pop(service, None)
        self._of_service, self._noted_from = services, endpoints
        users: dict[str, list[str]] = {}
        for service, (_, hosts) in services.items():
            for name in hosts:
                users.setdefault(name, []).append(service)
        watched = sorted(users)[: self.settings.max_names]
        self._left_out = len(users) - len(watched)
        if self._left_out and not self._said_left_out:
            _log.error(
                "%d host names beyond the %d looked up are served as names, not watched (first: %s)",
                self._left_out,
                self.settings.max_names,
                sorted(users)[self.settings.max_names],
            )
        self._said_left_out = self._left_out > 0
        self._users = {name: sorted(users[name]) for name in watched}
        if self._users.keys() - self._names.keys():
            self._new_names.set()
        for name in self._names.keys() - self._users.keys():
            del self._names[name]
        self._kept = self._kept_now()

    def kept(self) -> Kept:
        """What to serve in place of names now (immutable: a plan may read it off the loop)."""
        return self._kept

    def served(self, merged: Merged) -> Merged:
        """``merged`` (as just :meth:`note`d) with the kept names' last good addresses in their place."""
        return with_last_good(merged, self._kept)

    def figures(self) -> NameFigures:
        states = [n.resolves for n in self._names.values()]
        return NameFigures(
            resolving=sum(1 for s in states if s),
            kept=sum(1 for n in self._names.values() if n.resolves is False and n.last_good),
            unresolved=sum(1 for n in self._names.values() if n.resolves is False and not n.last_good),
            left_out=self._left_out,
            lookups=self.lookups,
            failures=self.failures,
        )

    def status(self) -> list[dict[str, Any]]:
        """Each name looked up: its services, whether it resolves, and what is served for it."""
        out: list[dict[str, Any]] = []
        for name, state in sorted(self._names.items()):
            out.append(
                {
                    "name": name,
                    "services": self._users.get(name, []),
                    "resolves": state.resolves,
                    "last_good": list(state.last_good),
                    "served": list(self._kept.addresses.get(name, ())) or name,
                }
            )
        return out

    # -- the lookups ------------------------------------------------------------------------------

    async def run(self) -> None:
        """Look every name up every ``refresh`` seconds (and new names at once), until cancelled."""
        while True:
            self._new_names.clear()
            await self.refresh()
            pause = asyncio.ensure_future(self._clock.sleep(self.settings.refresh))
            news = asyncio.ensure_future(self._new_names.wait())
            try:
                await asyncio.wait({pause, news}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                pause.cancel()
                news.cancel()

    async def refresh(self) -> None:
        """Look every name in use up once; report what changed; tell the reconciler when what is
        served must change."""
        gate = asyncio.Semaphore(max(1, self.settings.concurrency))

        async def look_up(name: str) -> tuple[str, tuple[str, ...], str]:
            async with gate:
                try:
                    found = await asyncio.wait_for(self._resolver.addresses(name), self.settings.timeout)
                except TimeoutError:
                    return name, (), f"no answer in {self.settings.timeout:g} s"
                except (OSError, UnicodeError) as exc:
                    return name, (), str(exc) or type(exc).__name__
                usable = tuple(sorted({a for a in found if _is_ip(a)}))  # (a rotated answer is the same)
                return name, usable, "" if usable else "no address"

        results = await asyncio.gather(*(look_up(name) for name in list(self._users)))
        before = self._kept
        for name, found, reason in results:
            self._observe(name, found, reason)
        self._kept = self._kept_now()
        if self._kept != before:
            self._on_change()

    def _observe(self, name: str, found: tuple[str, ...], reason: str) -> None:
        """One lookup's result: update the name, and report a change of whether it resolves."""
        state = self._names.get(name)
        if state is None:
            if name not in self._users:
                return  # (no longer used since the lookup started)
            state = self._names[name] = _Name()
        self.lookups += 1
        services = self._users.get(name, [])
        if found:
            if state.resolves is False:
                _log.warning("%s (services %s) resolves again: served as the name", name, ", ".join(services))
                self._events.emit("dns_resolved", name=name, services=services, addresses=list(found))
            state.resolves, state.last_good = True, found
            return
        self.failures += 1
        if state.resolves is False:
            return  # (said already)
        state.resolves = False
        if state.last_good:
            _log.warning(
                "%s (services %s) stopped resolving (%s): serving its last good addresses %s until it resolves again",
                name,
                ", ".join(services),
                reason,
                ", ".join(state.last_good),
            )
        else:
            _log.warning(
                "%s (services %s) does not resolve here (%s): served as the name, for the proxies to resolve",
                name,
                ", ".join(services),
                reason,
            )
        self._events.emit("dns_unresolved", name=name, services=services, reason=reason, kept=list(state.last_good))

    def _kept_now(self) -> Kept:
        addresses = {
            name: state.last_good
            for name, state in sorted(self._names.items())
            if state.resolves is False and state.last_good and name in self._users
        }
        services = frozenset(s for name in addresses for s in self._users[name])
        if (addresses, services) == (self._kept.addresses, self._kept.services):
            return self._kept
        return Kept(addresses, services)


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True
