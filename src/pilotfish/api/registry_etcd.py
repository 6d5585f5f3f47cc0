"""The registry API's store when pilotfish runs on etcd: every write goes to etcd, every read comes
from this replica's view of it.

With ``serve --etcd``, registrations must outlive the process and be the same on every replica,
so the registry keeps nothing of its own. A write is checked the way the in-memory registry
checks it (the request's fields, the registry's limits, and the merged state of every source with
the change applied, :meth:`~pilotfish.reconcile.Reconciler.check`), then written to the keys the
etcd source reads (:mod:`pilotfish.sources.etcd`); it is acknowledged only once etcd has it. The
change reaches the snapshot the way any etcd change does: through the watch, on every replica
alike, so replicas build the same snapshots from the same revision.

- An instance with a TTL is attached to an etcd lease (etcd counts whole seconds and grants at
  least about 2 s). A heartbeat, on any replica, renews the lease. TTL expiry, with Eureka-style
  self-preservation, is the one duty that must run once: the replica holding the etcd election runs
  it (:class:`LeaseGuard`), and if it dies another takes over within the lease time. The lease
  outlasts the TTL by a slack longer than that hand-over, so a decision is never lost to a dead
  leader; with no leader at all, etcd ends the lease when the slack runs out. No replica has to be
  the one that saw the registration, and a restart of every replica forgets nothing.
- Self-preservation turned on or off (``PUT /v1/self-preservation``, on any replica) is stored in
  etcd (key ``{prefix without /}.self-preservation``, ``{"enabled": true|false}``), not in the
  replica: the elected replica reads it on every pass of its guard, so the setting applies
  fleet-wide and survives the election moving and every replica restarting. Without the key,
  ``--registry-self-preservation`` decides.
- **Read your writes**: a write answers with the etcd revision it made (``revision`` in the body and
  the ``Pilotfish-Etcd-Revision`` header on every answer). The replica that took the write waits
  (briefly) until its own view has that revision before it answers; a ``GET`` on any replica with
  ``?revision=N`` waits until that replica has caught up to ``N`` (or answers 503 saying how far
  behind it is).
- etcd unreachable: a write answers 503 with the reason, and the last good configuration keeps
  serving. A write whose answer was lost may or may not have been made: retrying is safe (every
  write is idempotent).
- Checks and writes are not one transaction: two replicas may each accept a change that conflicts
  with the other's. The reconciler's publishing rules still refuse a merged state that does not
  build, so the last good configuration keeps serving; the registry's check is what makes the
  common case answer 409.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
from collections import Counter, deque
from collections.abc import Callable, Coroutine
from dataclasses import replace
from typing import Any, ParamSpec, TypeVar

from pilotfish.api.registry import Admitting, Written
from pilotfish.etcd.client import EtcdUnavailable, Lease
from pilotfish.etcd.election import Leadership
from pilotfish.events import EventLog
from pilotfish.resources.services import Endpoint
from pilotfish.sources.etcd import EtcdSource
from pilotfish.sources.registry import (
    Conflict,
    Instance,
    Preservation,
    RegistryFull,
    RegistryLimits,
    SelfPreservation,
    StoreUnavailable,
    UnknownInstance,
    describe_services,
    endpoint_document,
    parse_definition,
    parse_registration,
)

__all__ = ["EtcdRegistry", "LeaseGuard"]

_log = logging.getLogger("pilotfish.registry")

_P = ParamSpec("_P")
_T = TypeVar("_T")
_SOURCE = "etcd"


def _store_errors(method: Callable[_P, Coroutine[Any, Any, _T]]) -> Callable[_P, Coroutine[Any, Any, _T]]:
    """A store method whose etcd could not be reached raises :class:`StoreUnavailable` (same message):
    the registry API answers 503 for any store, knowing nothing of etcd."""

    @functools.wraps(method)
    async def call(*args: _P.args, **kwargs: _P.kwargs) -> _T:
        try:
            return await method(*args, **kwargs)
        except EtcdUnavailable as exc:
            raise StoreUnavailable(str(exc)) from exc

    return call


class EtcdRegistry:
    """Registry operations on etcd keys (see the module docstring)."""

    def __init__(
        self,
        source: EtcdSource,
        reconciler: Admitting,
        *,
        limits: RegistryLimits | None = None,
        local_wait: float = 2.0,
        lease_slack: float = 10.0,
        election: Leadership | None = None,
        self_preservation: Callable[[], SelfPreservation] | None = None,
        events: EventLog | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.source = source
        self.client = source.client
        self.reconciler = reconciler
        self.limits = limits or RegistryLimits()
        self.election = election
        """Who runs the singleton duties (None: no election; this replica decides alone)."""
        self.guard = (
            None if self_preservation is None else LeaseGuard(self, self_preservation, events=events or EventLog())
        )
        """The duty itself (:meth:`LeaseGuard.run` while this replica leads), given the flags'
        self-preservation rule; None: nobody expires leases but etcd."""
        self.lease_slack = lease_slack
        """Seconds an instance's lease outlasts its TTL: the elected replica's time to decide (see
        :class:`LeaseGuard`); longer than an election hand-over."""
        self.local_wait = local_wait
        """How long a write waits for this replica's view to show it before answering anyway."""
        self._clock = clock
        self._bad_preservation: str | None = None
        """The unparsable value of :attr:`preservation_key` last reported (each is reported once)."""

    # -- reads -----------------------------------------------------------------------------

    @property
    def revision(self) -> int:
        return self.source.revision

    def knows(self, name: str) -> bool:
        view = self.source.view
        return name in view.services or any(service == name for service, _ in view.instances.values())

    def census(self) -> tuple[int, int]:
        view = self.source.view
        services = view.services.keys() | {service for service, _ in view.instances.values()}
        return len(services), len(view.instances)

    @property
    def expired(self) -> int:
        return 0 if self.guard is None else self.guard.expired

    def _instances(self) -> dict[str, list[Instance]]:
        view = self.source.view
        found: dict[str, list[Instance]] = {}
        for key, (service, endpoint) in view.instances.items():
            found.setdefault(service, []).append(Instance(service, endpoint, view.ttls.get(key), None))
        return found

    def describe(self, name: str | None = None) -> dict[str, Any]:
        view = self.source.view
        instances = self._instances()
        names = sorted(set(view.services) | set(instances)) if name is None else [name]
        return describe_services(names, view.services, instances, self._clock())

    @_store_errors
    async def caught_up(self, revision: int, timeout: float) -> bool:
        return await self.source.caught_up(revision, timeout)

    @property
    def preservation(self) -> Preservation | None:
        return None if self.guard is None else self.guard.preservation

    @property
    def preservation_key(self) -> str:
        """Where ``PUT /v1/self-preservation`` stores the fleet's setting."""
        return self.source.prefix.rstrip("/") + ".self-preservation"

    @_store_errors
    async def self_preservation(self, configured: SelfPreservation) -> SelfPreservation:
        """``configured`` (the flags), turned on or off as etcd's :attr:`preservation_key` says. A
        value that does not parse is reported and ignored (the flags decide)."""
        value = await self.client.get(self.preservation_key)
        if value is None:
            return configured
        try:
            stored = json.loads(value)
        except json.JSONDecodeError:
            stored = None
        if not (isinstance(stored, dict) and isinstance(stored.get("enabled"), bool)):
            if value != self._bad_preservation:
                _log.error(
                    'etcd key %s holds %.200r, not {"enabled": true|false}: ignored (the flags decide); '
                    "PUT /v1/self-preservation writes it again",
                    self.preservation_key,
                    value,
                )
                self._bad_preservation = value
            return configured
        return replace(configured, enabled=stored["enabled"])

    @_store_errors
    async def set_self_preservation(self, enabled: bool) -> None:
        await self.client.put(self.preservation_key, json.dumps({"enabled": enabled}))

    def duties(self) -> dict[str, Any]:
        election = self.election
        if election is None or not election.elected:
            return {}
        return {"leader": election.leader, "leader_replica": election.holder}

    @_store_errors
    async def status(self) -> dict[str, Any]:
        return {**await self.source.status(), **self.duties()}

    # -- writes ----------------------------------------------------------------------------

    def _check(self, changes: dict[str, str | None]) -> None:
        problems = self.reconciler.check(_SOURCE, self.source.view.state_with(changes))
        if problems:
            raise Conflict(problems)

    def _room_for(self, service: str, *, instance_key: str | None = None) -> None:
        view = self.source.view
        if not self.knows(service) and len(self.describe()) >= self.limits.max_services:
            raise RegistryFull(
                f"the registry holds its limit of {self.limits.max_services} services "
                "(max_services): remove unused services or raise the limit"
            )
        if (
            instance_key is not None
            and instance_key not in view.instances
            and len(view.instances) >= self.limits.max_instances
        ):
            raise RegistryFull(
                f"the registry holds its limit of {self.limits.max_instances} instances "
                "(max_instances): deregister unused instances or raise the limit"
            )

    async def _settled(self, revision: int) -> Written:
        if not await self.source.caught_up(revision, self.local_wait):
            _log.warning(
                "registry write at etcd revision %d not yet seen by this replica's watch after %.1fs "
                "(at %d); answering anyway",
                revision,
                self.local_wait,
                self.revision,
            )
        return Written(None, revision)

    @_store_errors
    async def define(self, name: str, body: Any) -> Written:
        parse_definition(name, body)
        key = self.source.view.service_key(name)
        value = json.dumps(body, sort_keys=True)
        self._room_for(name)
        self._check({key: value})
        revision = await self.client.put(key, value)
        await self._settled(revision)
        return Written(self.describe(name)[name], revision)

    @_store_errors
    async def undefine(self, name: str) -> Written:
        view = self.source.view
        key, instances = view.service_key(name), view.instances_prefix(name)
        self._check({key: None, **dict.fromkeys(view.keys_under(instances))})
        return await self._settled(await self.client.delete(key, prefixes=(instances,)))

    @_store_errors
    async def register(self, service: str, body: Any) -> Written:
        endpoint, ttl = parse_registration(service, body)
        view = self.source.view
        key = view.instance_key(service, endpoint.address)
        value = json.dumps(endpoint_document(endpoint, ttl), sort_keys=True)
        self._room_for(service, instance_key=key)
        self._check({key: value})
        old_lease = view.lease_of(key) or 0
        lease = (await self.client.grant(ttl + self.lease_slack))[0] if ttl is not None else 0
        revision = await self.client.put(key, value, lease=lease)
        if old_lease and old_lease != lease:
            await self._forget_lease(old_lease)
        await self._settled(revision)
        instance = Instance(service, endpoint, ttl, None if ttl is None else self._clock() + ttl)
        return Written(instance.describe(self._clock()), revision)

    @_store_errors
    async def heartbeat(self, service: str, instance_id: str) -> Written:
        key = self.source.view.instance_key(service, instance_id)
        lease, found = await self._instance(key)
        if lease is None or found is None:
            raise UnknownInstance(f"no instance {instance_id} of service {service!r}: register it again")
        view = self.source.view
        ttl = view.ttls.get(key)
        left: float | None = None
        if lease:
            left = await self.client.keepalive(lease) - self.lease_slack
            if left <= -self.lease_slack:
                raise UnknownInstance(
                    f"instance {instance_id} of service {service!r} expired (its etcd lease ended): register it again"
                )
        expires = None if left is None else self._clock() + left
        return Written(Instance(service, found[1], ttl, expires).describe(self._clock()))

    async def _instance(self, key: str) -> tuple[int | None, tuple[str, Endpoint] | None]:
        """The lease and the instance at ``key`` in this replica's view. One the view has not
        seen may have just been registered through another replica (its heartbeats may come
        here at once): then the view is given until it has caught up with etcd's newest change
        under the prefix (at most :attr:`local_wait`) before the instance is called unknown."""
        view = self.source.view
        if key not in view.instances:
            _, newest = await self.client.latest(self.source.prefix, timeout=self.local_wait)
            await self.source.caught_up(newest, self.local_wait)
            view = self.source.view
        return view.lease_of(key), view.instances.get(key)

    @_store_errors
    async def deregister(self, service: str, instance_id: str) -> Written:
        view = self.source.view
        key = view.instance_key(service, instance_id)
        lease = view.lease_of(key)
        if lease is None:
            raise UnknownInstance(f"no instance {instance_id} of service {service!r}")
        self._check({key: None})
        revision = await self.client.delete(key)
        if lease:
            await self._forget_lease(lease)
        return await self._settled(revision)

    async def _forget_lease(self, lease: int) -> None:
        """Revoke a lease no key needs any more; if that fails, it just runs out."""
        try:
            await self.client.revoke(lease)
        except EtcdUnavailable as exc:
            _log.info("could not revoke etcd lease %x (it expires by itself): %s", lease, exc)


class LeaseGuard:
    """TTL expiry with self-preservation for instances on etcd leases: the registry's singleton
    duty, run by the replica that holds the election (:class:`~pilotfish.etcd.election.Election`).

    The rule is the flags' (``configured``), on or off as etcd says (read every pass: a ``PUT
    /v1/self-preservation`` on any replica applies at the leader's next pass).

    An instance's lease is granted for its TTL plus :attr:`EtcdRegistry.lease_slack` (longer than
    an election hand-over), and every heartbeat renews all of it. So an instance whose TTL passed
    still has its slack left, and the guard decides what happens to it, as the in-memory registry
    does (:meth:`~pilotfish.sources.registry.SelfPreservation.verdict`): alone, it lapsed, and the
    guard revokes its lease (etcd deletes the key: every replica drops it); with many others at
    once (a partition between them and pilotfish is likelier than a dead fleet), the guard renews
    its lease instead, and counts it as lapsed until a heartbeat renews it again. If no replica
    leads, etcd itself ends the lease when the slack runs out too: nothing lingers for long.

    Every ``recheck`` seconds the guard asks etcd how long the leases near their TTL have left (it
    estimates the others from the last answer, so it asks about a lease about once per TTL, and at
    most ``max_asks`` per pass).
    """

    def __init__(
        self,
        registry: EtcdRegistry,
        configured: Callable[[], SelfPreservation],
        *,
        events: EventLog,
        clock: Callable[[], float] = time.monotonic,
        max_asks: int = 512,
    ) -> None:
        self.registry = registry
        self._configured = configured
        """The flags' rule; whether it is on comes from etcd (:meth:`EtcdRegistry.self_preservation`)."""
        self._events = events
        self._clock = clock
        self.max_asks = max_asks
        self._deadline: dict[Lease, float] = {}
        """Lease -> when it ends, as last heard from etcd."""
        self._kept: dict[str, tuple[str, Lease]] = {}
        """Instance key -> (service, lease) whose lease this guard renewed, not heartbeated since."""
        self._expired: deque[tuple[float, str]] = deque(maxlen=registry.limits.max_instances)
        """(when, service) of each instance this guard expired, within the window."""
        self.preservation: Preservation | None = None
        self.expired = 0
        """Instances this guard expired (revoked their lease) since the process started."""

    async def run(self) -> None:
        """Guard until cancelled (when this replica stops leading)."""
        self._deadline.clear()
        self._kept.clear()
        try:
            while True:
                try:
                    await self.once()
                except EtcdUnavailable as exc:
                    _log.info("lease guard: %s; trying again", exc)
                await asyncio.sleep(self._configured().recheck)
        finally:
            self.preservation = None

    async def once(self) -> None:
        """One pass: learn which leases passed their TTL, then expire or keep them."""
        election = self.registry.election
        if election is not None and not election.leader:
            return  # (a stalled replica whose lease may have ended: its successor decides)
        rule = await self.registry.self_preservation(self._configured())
        now = self._clock()
        view, client, slack = self.registry.source.view, self.registry.client, self.registry.lease_slack
        leased = {
            key: (view.instances[key][0], lease)
            for key in view.ttls
            if key in view.instances and (lease := view.lease_of(key))
        }
        while self._expired and self._expired[0][0] <= now - rule.window:
            self._expired.popleft()
        live = {lease for _, lease in leased.values()}
        for lease in [lease for lease in self._deadline if lease not in live]:
            del self._deadline[lease]
        unknown = float("-inf")
        soon = now + slack + 2 * rule.recheck
        due = sorted(
            (self._deadline.get(lease, unknown), lease) for lease in live if self._deadline.get(lease, unknown) <= soon
        )[: self.max_asks]
        asked = set()
        for _, lease in due:
            self._deadline[lease] = now + await client.time_to_live(lease)
            asked.add(lease)
        # Lapsed: asked this pass, and past its TTL. (A lease not asked yet, or estimated from an
        # older answer, is not known to be: a heartbeat may have renewed it since.)
        lapsed = {
            key: found for key, found in leased.items() if found[1] in asked and self._deadline[found[1]] <= now + slack
        }
        # Counted with them: those that lapse before the next pass (instances that stopped
        # heartbeating together lapse together, not one pass apart), and the kept ones, until etcd
        # shows their lease renewed by a heartbeat.
        lapsing = {
            key: found
            for key, found in leased.items()
            if self._deadline.get(found[1], float("inf")) <= now + slack + rule.recheck
        }
        self._kept = {
            key: found
            for key, found in self._kept.items()
            if key in leased and not (found[1] in asked and self._deadline[found[1]] > now + slack)
        }
        everywhere, held, lost, total = rule.verdict(
            Counter(service for service, _ in (lapsing | self._kept).values()),
            Counter(service for service, _ in leased.values()),
            Counter(service for _, service in self._expired),
        )
        self._kept = {key: found for key, found in self._kept.items() if found[0] in held}
        for key, (service, lease) in lapsed.items():
            if service in held:
                if (left := await client.keepalive(lease)) > 0:
                    self._deadline[lease] = self._clock() + left
                    self._kept[key] = (service, lease)
                continue
            await client.revoke(lease)
            self.expired += 1
            self._deadline.pop(lease, None)
            self._expired.append((now, service))
            instance_id = key.rsplit("/", 1)[1]
            _log.info("instance %s of %s expired (no heartbeat within %ss)", instance_id, service, view.ttls.get(key))
            self._events.emit("registry_expired", service=service, instance=instance_id)
        self._report(rule, everywhere, held, lost, total)

    def _report(self, rule: SelfPreservation, everywhere: bool, held: list[str], lost: int, total: int) -> None:
        before = self.preservation
        self.preservation = (
            None
            if not held
            else Preservation(
                everywhere=everywhere,
                services=tuple(held),
                lapsed=len(self._kept),
                lost_in_window=lost,
                ttl_instances=total,
            )
        )
        if before is None and self.preservation is not None:
            _log.warning(
                "registry self-preservation: %d of %d TTL instances stopped heartbeating within %.0fs; "
                "renewing the leases of %d lapsed instance(s) of %s instead of expiring them",
                lost,
                total,
                rule.window,
                len(self._kept),
                "every service" if everywhere else ", ".join(held[:20]),
            )
            self._events.emit("registry_self_preservation", state="entered", **self.preservation.describe())
        elif before is not None and self.preservation is None:
            _log.warning("registry self-preservation over: TTL expiry resumed")
            self._events.emit("registry_self_preservation", state="exited", expired_now=0)
