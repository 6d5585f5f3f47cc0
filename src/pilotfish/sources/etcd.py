"""etcd as the source of truth, through etcd's v3 JSON gateway (``/v3/kv/range``, ``/v3/watch``).

Key layout under the prefix (default ``/pilotfish/``), values are JSON:

- ``{prefix}services/{name}``: a service definition, the same fields as a ``services:`` entry of
  the snapshot file (``listen``, ``protocol``, ``connect_timeout``, ``grpc``, ``zone_local``, ...;
  ``endpoints`` allowed);
- ``{prefix}instances/{service}/{id}``: one instance, ``{"address": ..., "port": ...,
  "weight"?: ..., "metadata"?: {...}, "zone"?: ..., "ttl"?: ...}``. An instance registered with a
  TTL (through the registry API with ``--etcd``) is attached to an etcd lease (its TTL plus a
  slack for the elected replica to decide on it, see :mod:`pilotfish.api.registry_etcd`): its
  heartbeats keep the lease alive, and the key goes when they stop; ``ttl`` in the value says
  what the instance registered with.

The source lists the prefix, then watches it from the listed revision + 1, so no change between
the two is missed. When the watch breaks (etcd restarts, the history was compacted, the network
fails), it lists again and resumes; the list replaces the whole view, so nothing is lost or
duplicated, and the last good configuration keeps serving meanwhile. A value that does not parse
is reported (with its key and why) and left out; everything else keeps serving.

The watch (and its keepalive probe, which notices a stalled etcd within ``keepalive`` seconds) is
:func:`pilotfish.etcd.client.follow_prefix`.

The view knows the revision it has applied (:attr:`EtcdView.revision`), so a writer can wait
until the change it made is in (:meth:`EtcdSource.caught_up`): read your writes.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from pilotfish.build.desired import DesiredState
from pilotfish.errors import Problem
from pilotfish.etcd.client import (
    DEFAULT_KEEPALIVE,
    Change,
    EtcdClient,
    EtcdUnavailable,
    KeyValue,
    Lease,
    follow_prefix,
)
from pilotfish.resources.services import Endpoint, ServiceSpec, parse_endpoint, parse_service

__all__ = ["EtcdSource", "EtcdView"]

_log = logging.getLogger("pilotfish.sources.etcd")


@dataclass(slots=True)
class EtcdView:
    """The parsed keys under the prefix. Pure: no I/O."""

    prefix: str
    services: dict[str, ServiceSpec] = field(default_factory=dict)
    service_endpoints: dict[str, tuple[Endpoint, ...]] = field(default_factory=dict)
    instances: dict[str, tuple[str, Endpoint]] = field(default_factory=dict)
    """key -> (service, endpoint)."""
    bad: dict[str, str] = field(default_factory=dict)
    """key -> why its value was left out."""
    raw: dict[str, tuple[str, Lease]] = field(default_factory=dict)
    """key -> (value, lease) of every key under the prefix, good or bad."""
    ttls: dict[str, float] = field(default_factory=dict)
    """Instance key -> the TTL its value says it was registered with."""
    revision: int = 0
    """The etcd revision this view has applied everything up to."""
    _by_service: dict[str, dict[str, Endpoint]] = field(default_factory=dict, repr=False, compare=False)
    """Service -> instance key -> endpoint (the instances, by service)."""
    _endpoints: dict[str, tuple[Endpoint, ...]] = field(default_factory=dict, repr=False, compare=False)
    """Each service's endpoints as :meth:`state` last reported them (sorted, one per address)."""
    _stale: set[str] = field(default_factory=set, repr=False, compare=False)
    """Services whose keys changed since: their entry in ``_endpoints`` is made again."""
    _last: DesiredState | None = field(default=None, repr=False, compare=False)

    def service_key(self, name: str) -> str:
        return f"{self.prefix}services/{name}"

    def instance_key(self, service: str, instance_id: str) -> str:
        return f"{self.prefix}instances/{service}/{instance_id}"

    def instances_prefix(self, service: str) -> str:
        return f"{self.prefix}instances/{service}/"

    def put(self, key: str, value: str, lease: Lease = 0) -> str | None:
        """Apply a key's new value; return the problem if it was left out."""
        self.delete(key)
        self.raw[key] = (value, lease)
        rest = key[len(self.prefix) :]
        kind, _, name = rest.partition("/")
        try:
            document: Any = json.loads(value)
        except json.JSONDecodeError as exc:
            return self._bad(key, f"not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}")
        problems: list[Problem] = []
        if kind == "services" and name and "/" not in name:
            spec, found, problems = parse_service(name, document, "")
            if spec is not None and not problems:
                self.services[name] = spec
                self.service_endpoints[name] = found
                return None
        elif kind == "instances" and name.count("/") == 1 and all(name.split("/")):
            service = name.split("/")[0]
            ttl = document.pop("ttl", None) if isinstance(document, dict) else None
            if ttl is not None and (
                isinstance(ttl, bool) or not isinstance(ttl, int | float) or not math.isfinite(ttl) or ttl <= 0
            ):
                problems.append(Problem("ttl", f"expected a positive number of seconds, got {ttl!r}"))
            endpoint = parse_endpoint(document, "", problems)
            if endpoint is not None and not problems:
                self.instances[key] = (service, endpoint)
                self._by_service.setdefault(service, {})[key] = endpoint
                if ttl is not None:
                    self.ttls[key] = float(ttl)
                return None
        else:
            return self._bad(
                key, f"unknown key: expected {self.prefix}services/NAME or {self.prefix}instances/SERVICE/ID"
            )
        return self._bad(key, "; ".join(f"{p.where.lstrip('.') or 'value'}: {p.message}" for p in problems))

    def _bad(self, key: str, reason: str) -> str:
        self.bad[key] = reason
        return reason

    def delete(self, key: str) -> None:
        self.raw.pop(key, None)
        self.bad.pop(key, None)
        self.ttls.pop(key, None)
        instance = self.instances.pop(key, None)
        if instance is not None:
            service = instance[0]
            by_key = self._by_service[service]
            del by_key[key]
            if not by_key:
                del self._by_service[service]
        rest = key[len(self.prefix) :]
        kind, _, name = rest.partition("/")
        self._stale.add(name if kind == "services" else name.partition("/")[0])
        if kind == "services":
            self.services.pop(name, None)
            self.service_endpoints.pop(name, None)

    def keys_under(self, prefix: str) -> list[str]:
        """Every key in the view that starts with ``prefix``."""
        return [key for key in self.raw if key.startswith(prefix)]

    def lease_of(self, key: str) -> Lease | None:
        """The lease ``key`` is attached to (0: none); None if the view has no such key."""
        found = self.raw.get(key)
        return None if found is None else found[1]

    def state_with(self, changes: Mapping[str, str | None]) -> DesiredState:
        """The state this view would have with ``changes`` (key -> new value, None: deleted)
        applied; the view itself is left as it was."""
        saved = {key: self.raw.get(key) for key in changes}
        try:
            for key, value in changes.items():
                if value is None:
                    self.delete(key)
                else:
                    self.put(key, value, self.raw.get(key, ("", 0))[1])
            return self.state()
        finally:
            for key, old in saved.items():
                if old is None:
                    self.delete(key)
                else:
                    self.put(key, *old)

    def state(self) -> DesiredState:
        """What the keys define: services, and each one's endpoints (those its definition lists,
        then its instances; one per address, the last). Only services whose keys changed since the
        last call are looked at again; the others keep their tuples (see :class:`DesiredState`)."""
        endpoints = self._endpoints
        for name in self._stale:
            listed, registered = self.service_endpoints.get(name), self._by_service.get(name)
            if listed is None and registered is None:
                endpoints.pop(name, None)
                continue
            found = [*(listed or ()), *(registered.values() if registered else ())]
            endpoints[name] = tuple(sorted({e.address: e for e in found}.values()))
        self._stale.clear()
        last = self._last
        self._last = DesiredState(
            services=dict(self.services), endpoints=dict(endpoints), known=last.endpoints if last is not None else None
        )
        return self._last


class EtcdSource:
    """Lists and watches a prefix in etcd, reporting the whole view on every change."""

    def __init__(
        self,
        endpoint: str,
        prefix: str,
        *,
        on_state: Callable[[DesiredState], None],
        on_event: Callable[..., None] | None = None,
        backoff: tuple[float, float] = (0.1, 2.0),
        keepalive: float = DEFAULT_KEEPALIVE,
    ) -> None:
        self.base = f"http://{endpoint}"
        self.keepalive = keepalive
        """Seconds within which a watch that stopped answering is noticed and made again."""
        self.client = EtcdClient(endpoint)
        """For the listing (and for writers sharing this source's etcd)."""
        self.prefix = prefix
        self._on_state = on_state
        self._emit = on_event or (lambda *_, **__: None)
        self._backoff = backoff
        self.view = EtcdView(prefix)
        self.connected = asyncio.Event()
        self.resyncs = 0
        self.problem: str | None = "not contacted yet"
        """Why etcd is not being followed right now (None: it is)."""
        self._advanced = asyncio.Condition()

    @property
    def revision(self) -> int:
        """The etcd revision applied so far (0: not listed yet)."""
        return self.view.revision

    async def caught_up(self, revision: int, timeout: float) -> bool:
        """Wait until the view has applied ``revision``; False if ``timeout`` seconds pass first."""

        async def reached() -> None:
            async with self._advanced:
                await self._advanced.wait_for(lambda: self.view.revision >= revision)

        if self.view.revision >= revision:
            return True
        try:
            await asyncio.wait_for(reached(), timeout)
        except TimeoutError:
            return False
        return True

    async def status(self) -> dict[str, Any]:
        """This replica's etcd revision, and how far it is behind etcd's latest change under the
        prefix (puts only: etcd keeps no record of deleted keys to compare with)."""
        out: dict[str, Any] = {
            "endpoint": self.client.endpoint,
            "prefix": self.prefix,
            "revision": self.revision,
            "connected": self.problem is None,
            "problem": self.problem,
        }
        try:  # (within the keepalive: a health check must answer while etcd is stalled)
            revision, latest = await self.client.latest(self.prefix, timeout=self.keepalive / 2)
        except EtcdUnavailable as exc:
            out["problem"] = str(exc)
            return out
        out["etcd_revision"] = revision
        out["lag"] = max(0, latest - self.revision)
        return out

    async def _advance(self, revision: int) -> None:
        if revision > self.view.revision:
            self.view.revision = revision
        async with self._advanced:
            self._advanced.notify_all()

    async def run(self) -> None:
        """List and watch until cancelled; on any failure, wait a little and start over."""
        try:
            await follow_prefix(
                self.client,
                self.prefix,
                listed=self._listed,
                changed=self._changed,
                lost=self._lost,
                backoff=self._backoff,
                keepalive=self.keepalive,
            )
        finally:
            await self.client.close()

    def _lost(self, exc: Exception) -> None:
        expected = isinstance(
            exc, EtcdUnavailable | aiohttp.ClientError | OSError | ValueError | KeyError | TimeoutError
        )
        reason = (str(exc) or type(exc).__name__) if expected else f"internal error: {exc!r}"
        if not expected:
            _log.exception("etcd at %s: unexpected error; retrying", self.base)
        if self.connected.is_set():
            _log.warning("etcd at %s: %s; serving the last good state and retrying", self.base, reason)
            self._emit("etcd_disconnected", reason=reason)
        self.problem = reason
        self.connected.clear()

    async def _listed(self, kvs: list[KeyValue], revision: int) -> None:
        view = EtcdView(self.prefix)
        for key, value, lease, _ in kvs:
            problem = view.put(key, value, lease)
            if problem:
                self._report_bad(key, problem)
        view.revision = self.view.revision
        self.view = view
        self.resyncs += 1
        self.problem = None
        self.connected.set()
        self._emit("etcd_synced", revision=revision, keys=len(kvs), bad=len(view.bad))
        self._on_state(view.state())
        await self._advance(revision)

    def _report_bad(self, key: str, reason: str) -> None:
        _log.error("etcd key %s left out: %s", key, reason)
        self._emit("etcd_bad_value", key=key, reason=reason)

    async def _changed(self, changes: list[Change], revision: int) -> None:
        for key, value, lease, _ in changes:
            if value is None:
                self.view.delete(key)
            else:
                problem = self.view.put(key, value, lease)
                if problem:
                    self._report_bad(key, problem)
        self._on_state(self.view.state())
        await self._advance(revision)
