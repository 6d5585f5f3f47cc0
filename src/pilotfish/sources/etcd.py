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

**A watch that stops answering is noticed.** A watch is a long HTTP stream that is silent while
nothing changes, so a stalled etcd (a paused process, a hung disk) or a half-open connection (a
middlebox dropped it without a reset) looks like a quiet one. etcd's Go client finds these with
gRPC keepalive pings on its connection (HTTP/2 PINGs); the JSON gateway has no pings, and a
progress request cannot be sent on its stream (a watch there is one HTTP/1.1 request), so the
watch keeps alive its own way, every ``keepalive`` seconds at most: after ``keepalive / 2`` of
silence on the stream it *probes* etcd with a read on another connection (the newest key under
the prefix, ``limit 1``), which must answer within ``keepalive / 2``. A probe that fails or hangs
ends the watch: the stall is reported as etcd being lost (log warning, event
``etcd_disconnected``, the ``problem`` of ``/healthz``) within ``keepalive`` seconds of the last
word from etcd, and the source lists again until etcd answers (then ``etcd_synced``: what changed
meanwhile is in the listing). A probe that answers but shows a
key changed at a revision the watch has not delivered by the next probe means the stream itself is
dead (etcd is fine): the watch is ended and made again the same way. (Only a put shows: etcd keeps
no record of a deleted key to compare with, so a dead stream that misses only deletes is found at
the next put. The probe sorts the keys by revision, which costs etcd a pass over the prefix's keys:
about one probe per ``keepalive / 2`` per watch while nothing changes, none while changes flow.)
The watch also asks for etcd's progress notifications (``progress_notify``), so an etcd run with a
short ``--experimental-watch-progress-notify-interval`` keeps the stream talking and needs fewer
probes.

The view knows the revision it has applied (:attr:`EtcdView.revision`), so a writer can wait
until the change it made is in (:meth:`EtcdSource.caught_up`): read your writes.

:class:`EtcdClient` is the few calls pilotfish makes (range, put, delete, transactions, leases);
every failure to reach etcd or get an answer from it is an :class:`EtcdUnavailable` naming what
failed. The JSON gateway was chosen over a gRPC etcd client: it needs only aiohttp, and the
asyncio etcd clients on PyPI pin protobuf versions older than the Envoy API modules need.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import math
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from pilotfish.build.desired import DesiredState
from pilotfish.errors import Problem
from pilotfish.resources.services import Endpoint, ServiceSpec, parse_endpoint, parse_service

__all__ = [
    "DEFAULT_KEEPALIVE",
    "Change",
    "Election",
    "EtcdClient",
    "EtcdSource",
    "EtcdUnavailable",
    "EtcdView",
    "KeyValue",
    "Lease",
    "follow_prefix",
    "prefix_end",
]

_log = logging.getLogger("pilotfish.sources.etcd")


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def _unb64(text: str) -> str:
    return base64.b64decode(text).decode("utf-8", errors="replace")


def prefix_end(prefix: str) -> str:
    """The end of the key range holding every key that starts with ``prefix``."""
    raw = bytearray(prefix.encode())
    while raw and raw[-1] == 0xFF:
        raw.pop()
    raw[-1] += 1
    return raw.decode("latin-1")


Lease = int
"""An etcd lease id (0: none)."""

DEFAULT_KEEPALIVE = 10.0
"""Seconds within which a watch that stopped answering is noticed (see the module docstring)."""


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
        rest = key[len(self.prefix):]
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
            if ttl is not None and (isinstance(ttl, bool) or not isinstance(ttl, int | float)
                                    or not math.isfinite(ttl) or ttl <= 0):
                problems.append(Problem("ttl", f"expected a positive number of seconds, got {ttl!r}"))
            endpoint = parse_endpoint(document, "", problems)
            if endpoint is not None and not problems:
                self.instances[key] = (service, endpoint)
                self._by_service.setdefault(service, {})[key] = endpoint
                if ttl is not None:
                    self.ttls[key] = float(ttl)
                return None
        else:
            return self._bad(key, f"unknown key: expected {self.prefix}services/NAME or "
                                  f"{self.prefix}instances/SERVICE/ID")
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
        rest = key[len(self.prefix):]
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
        self._last = DesiredState(services=dict(self.services), endpoints=dict(endpoints),
                                  known=last.endpoints if last is not None else None)
        return self._last


class EtcdUnavailable(Exception):
    """etcd could not be reached, or did not do what was asked; the message says which and why."""


class EtcdClient:
    """The etcd v3 calls pilotfish makes, over the JSON gateway, on one aiohttp session.

    Keys and values are text here and base64 on the wire. Each call either returns etcd's answer
    or raises :class:`EtcdUnavailable` (connection refused, timeout, an error status, an answer
    that is not what etcd sends).
    """

    def __init__(self, endpoint: str, *, timeout: float = 5.0) -> None:
        self.endpoint = endpoint
        self.base = f"http://{endpoint}"
        self._timeout = aiohttp.ClientTimeout(total=timeout, connect=min(2.0, timeout))
        self._http: aiohttp.ClientSession | None = None

    def session(self) -> aiohttp.ClientSession:
        if self._http is None or self._http.closed:
            self._http = aiohttp.ClientSession(timeout=self._timeout)
        return self._http

    async def close(self) -> None:
        if self._http is not None:
            await self._http.close()

    async def call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """POST ``body`` to ``path``; etcd's answer, or :class:`EtcdUnavailable`."""
        try:
            async with self.session().post(self.base + path, json=body) as response:
                answer = await response.json(content_type=None)
                if response.status != 200 or not isinstance(answer, dict):
                    message = answer.get("message") if isinstance(answer, dict) else None
                    raise EtcdUnavailable(f"etcd at {self.endpoint} answered {path} with HTTP {response.status}"
                                          + (f": {message}" if message else ""))
                return answer
        except (aiohttp.ClientError, OSError, TimeoutError, ValueError) as exc:
            raise EtcdUnavailable(f"etcd at {self.endpoint} unreachable ({path}): "
                                  f"{str(exc) or type(exc).__name__}") from exc

    @staticmethod
    def revision(answer: dict[str, Any]) -> int:
        return int(answer.get("header", {}).get("revision", 0))

    async def range(self, key: str, *, prefix: bool = False, **options: Any) -> dict[str, Any]:
        body: dict[str, Any] = {"key": _b64(key), **options}
        if prefix:
            body["range_end"] = _b64(prefix_end(key))
        return await self.call("/v3/kv/range", body)

    async def latest(self, prefix: str, *, timeout: float) -> tuple[int, int]:
        """(etcd's revision, the revision the newest key under ``prefix`` was changed at; 0: no
        key), answered within ``timeout`` seconds or :class:`EtcdUnavailable`."""
        try:
            answer = await asyncio.wait_for(self.range(prefix, prefix=True, keys_only=True, limit=1,
                                                       sort_order="DESCEND", sort_target="MOD"), timeout)
        except TimeoutError:
            raise EtcdUnavailable(f"etcd at {self.endpoint} did not answer within {timeout:g}s "
                                  "(stalled, or the network dropped it)") from None
        newest = max((int(kv.get("mod_revision", 0)) for kv in answer.get("kvs", [])), default=0)
        return self.revision(answer), newest

    async def get(self, key: str) -> str | None:
        """The value of ``key`` (None: no such key)."""
        kvs = (await self.range(key)).get("kvs", [])
        return _unb64(kvs[0].get("value", "")) if kvs else None

    async def put(self, key: str, value: str, *, lease: Lease = 0) -> int:
        """Set ``key``; the revision of the write."""
        body: dict[str, Any] = {"key": _b64(key), "value": _b64(value)}
        if lease:
            body["lease"] = str(lease)
        return self.revision(await self.call("/v3/kv/put", body))

    async def delete(self, *keys: str, prefixes: tuple[str, ...] = ()) -> int:
        """Delete ``keys`` and every key under ``prefixes`` in one transaction; its revision."""
        ops = [{"request_delete_range": {"key": _b64(key)}} for key in keys]
        ops += [{"request_delete_range": {"key": _b64(p), "range_end": _b64(prefix_end(p))}} for p in prefixes]
        return self.revision(await self.call("/v3/kv/txn", {"success": ops}))

    async def create(self, key: str, value: str, *, lease: Lease = 0) -> tuple[bool, dict[str, Any]]:
        """Put ``key`` only if it does not exist. (True, answer) if it was created; otherwise
        (False, the existing key-value)."""
        put: dict[str, Any] = {"key": _b64(key), "value": _b64(value)}
        if lease:
            put["lease"] = str(lease)
        answer = await self.call("/v3/kv/txn", {
            "compare": [{"key": _b64(key), "target": "CREATE", "create_revision": "0"}],
            "success": [{"request_put": put}],
            "failure": [{"request_range": {"key": _b64(key)}}],
        })
        if answer.get("succeeded"):
            return True, answer
        kvs = answer.get("responses", [{}])[0].get("response_range", {}).get("kvs", [])
        return False, kvs[0] if kvs else {}

    async def grant(self, ttl: float) -> tuple[Lease, int]:
        """A new lease of ``ttl`` seconds (etcd counts whole seconds, and grants at least its
        minimum, about 2 s): (its id, the TTL granted)."""
        answer = await self.call("/v3/lease/grant", {"TTL": max(1, math.ceil(ttl))})
        if "ID" not in answer:
            raise EtcdUnavailable(f"etcd at {self.endpoint} granted no lease: {answer.get('error', answer)}")
        return int(answer["ID"]), int(answer.get("TTL", 0))

    async def keepalive(self, lease: Lease) -> int:
        """Renew ``lease``; the seconds it now has left (0: it expired or never existed)."""
        answer = await self.call("/v3/lease/keepalive", {"ID": str(lease)})
        return int(answer.get("result", {}).get("TTL", 0))

    async def time_to_live(self, lease: Lease) -> int:
        """The seconds ``lease`` has left (0: it ended or never existed)."""
        answer = await self.call("/v3/lease/timetolive", {"ID": str(lease)})
        return max(0, int(answer.get("TTL", 0)))

    async def revoke(self, lease: Lease) -> None:
        """End ``lease`` now (its keys are deleted); one that is already gone is fine."""
        try:
            await self.call("/v3/lease/revoke", {"ID": str(lease)})
        except EtcdUnavailable as exc:
            if "lease not found" not in str(exc):
                raise


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
        out: dict[str, Any] = {"endpoint": self.client.endpoint, "prefix": self.prefix, "revision": self.revision,
                               "connected": self.problem is None, "problem": self.problem}
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
            await follow_prefix(self.client, self.prefix, listed=self._listed, changed=self._changed, lost=self._lost,
                                backoff=self._backoff, keepalive=self.keepalive)
        finally:
            await self.client.close()

    def _lost(self, exc: Exception) -> None:
        expected = isinstance(exc, EtcdUnavailable | aiohttp.ClientError | OSError | ValueError | KeyError
                              | TimeoutError)
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


KeyValue = tuple[str, str, Lease, int]
"""A key, its value, its lease (0: none) and the revision it was last changed at."""
Change = tuple[str, str | None, Lease, int]
"""A key, its new value (None: deleted), its lease and the revision of the change."""


async def follow_prefix(
    client: EtcdClient, prefix: str, *,
    listed: Callable[[list[KeyValue], int], Awaitable[None]],
    changed: Callable[[list[Change], int], Awaitable[None]],
    lost: Callable[[Exception], None],
    backoff: tuple[float, float] = (0.1, 2.0),
    keepalive: float = DEFAULT_KEEPALIVE,
) -> None:
    """List every key under ``prefix`` (``listed(kvs, revision)``), then watch from the next
    revision (``changed(changes, revision)`` per batch of events, with the highest revision among
    them), so no change between the two is missed. When the watch breaks (etcd restarts, the
    history was compacted, the network fails) or stops answering (no word from etcd, probes
    included, for ``keepalive`` seconds: see the module docstring), ``lost(why)`` is called and,
    after a backoff that doubles from ``backoff[0]`` to ``backoff[1]``, it lists again: the listing
    replaces the whole view, so nothing is lost or duplicated. Runs until cancelled."""
    if not (math.isfinite(keepalive) and keepalive > 0):
        raise ValueError(f"keepalive must be a positive number of seconds, got {keepalive!r}")
    delay = backoff[0]
    timeout = aiohttp.ClientTimeout(total=None, connect=2.0, sock_read=None)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        while True:
            try:
                answer = await client.range(prefix, prefix=True)
                revision = int(answer["header"]["revision"])
                await listed([(_unb64(kv["key"]), _unb64(kv.get("value", "")), int(kv.get("lease", 0)),
                               int(kv.get("mod_revision", 0))) for kv in answer.get("kvs", [])], revision)
                delay = backoff[0]
                await _Watch(http, client, prefix, revision, changed, keepalive).run()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                lost(exc)
            await asyncio.sleep(delay)
            delay = min(delay * 2, backoff[1])


class _Watch:
    """One watch stream from ``listed + 1``, kept alive by probes (see the module docstring); ends
    by raising why."""

    def __init__(self, http: aiohttp.ClientSession, client: EtcdClient, prefix: str, listed: int,
                 changed: Callable[[list[Change], int], Awaitable[None]], keepalive: float) -> None:
        self.http, self.client, self.prefix, self.changed = http, client, prefix, changed
        self.half = keepalive / 2
        self.delivered = listed
        """Every change up to this revision has come (listed, or through the stream)."""
        self.owed = 0
        """A revision the last probe showed a key changed at, not delivered then (0: none)."""

    async def run(self) -> None:
        body = {"create_request": {"key": _b64(self.prefix), "range_end": _b64(prefix_end(self.prefix)),
                                   "start_revision": self.delivered + 1, "progress_notify": True}}
        async with self.http.post(self.client.base + "/v3/watch", json=body) as response:
            response.raise_for_status()
            # One read at a time, never cancelled while the stream lives (a cancelled readline
            # loses the part of a line it had taken); a probe runs while it waits.
            reading: asyncio.Task[bytes] | None = None
            try:
                while True:
                    if reading is None:
                        reading = asyncio.ensure_future(response.content.readline())
                    done, _ = await asyncio.wait({reading}, timeout=self.half)
                    if not done:
                        await self.probe()
                        continue
                    line, reading = reading.result(), None
                    if not line:
                        break
                    if line.strip():
                        await self.handle(json.loads(line))
            finally:
                if reading is not None:
                    reading.cancel()
        raise ValueError("the watch stream ended")

    async def probe(self) -> None:
        """The stream was silent for ``keepalive / 2``: etcd must answer a read within as long, and
        a change the last probe saw must have come through the stream by now."""
        _, newest = await self.client.latest(self.prefix, timeout=self.half)
        if self.owed and self.delivered < self.owed:
            raise EtcdUnavailable(f"the watch on etcd at {self.client.endpoint} did not deliver the change at "
                                  f"revision {self.owed} within {self.half * 2:g}s (its connection is dead); "
                                  "watching again")
        self.owed = newest if newest > self.delivered else 0

    async def handle(self, message: dict[str, Any]) -> None:
        if "error" in message:
            raise ValueError(f"watch failed: {message['error']}")
        result = message.get("result", {})
        if result.get("compact_revision") not in (None, "0"):
            raise ValueError(f"history compacted to revision {result['compact_revision']}; listing again")
        if result.get("canceled"):
            raise ValueError(f"watch canceled: {result.get('cancel_reason', 'no reason given')}")
        events = result.get("events", [])
        if not events:
            if not result.get("created"):  # a progress notification: everything up to its revision came
                self.delivered = max(self.delivered, self.client.revision(result))
            return
        changes: list[Change] = []
        revision = 0
        for event in events:
            kv = event["kv"]
            # The events' own revisions, not the header's: a header may be ahead of events
            # still to come.
            modified = int(kv.get("mod_revision", 0))
            revision = max(revision, modified)
            deleted = event.get("type") == "DELETE"
            changes.append((_unb64(kv["key"]), None if deleted else _unb64(kv.get("value", "")),
                            int(kv.get("lease", 0)), modified))
        self.delivered = max(self.delivered, revision)
        await self.changed(changes, revision)


class Election:
    """Holds ``key`` in etcd for this replica while it can: the replica holding it runs the duties
    that must run once (see :mod:`pilotfish.api.registry_etcd`).

    The key is created (only if absent) attached to a lease of ``ttl`` seconds that this replica
    keeps alive every ``ttl / 3``; its value names the holder. A holder that dies stops renewing,
    etcd ends the lease and deletes the key, and the next attempt of another replica (every
    ``ttl / 3``) takes it: a hand-over within about ``ttl * 4 / 3``. A holder that cannot renew for
    ``ttl * 2 / 3`` (etcd unreachable) steps down before its lease can have ended, so two replicas
    never both believe they hold it for longer than a renewal round trip.
    """

    def __init__(self, client: EtcdClient, key: str, identity: str, *, ttl: float = 6.0,
                 on_event: Callable[..., None] | None = None,
                 on_change: Callable[[bool], None] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.client = client
        self.key = key
        self.identity = identity
        self.ttl = ttl
        self._leader = False
        self._renewed = 0.0
        """When the last successful renewal was *sent* (etcd counts the lease from no earlier)."""
        self.holder: str | None = None
        """Who holds the key, as last seen (None: nobody, or not known)."""
        self._emit = on_event or (lambda *_, **__: None)
        self._on_change = on_change or (lambda _: None)
        self._clock = clock

    @property
    def leader(self) -> bool:
        """Whether this replica holds the key now: it took it, and its last renewal was sent less
        than ``ttl * 2 / 3`` ago (a replica whose loop stalled stops believing it before its lease
        can have ended, even before its next renewal attempt fails)."""
        return self._leader and self._clock() - self._renewed < self.ttl * 2 / 3

    def _set(self, leader: bool, reason: str) -> None:
        if leader == self._leader:
            return
        self._leader = leader
        if leader:
            self.holder = self.identity
        _log.warning("%s %s (%s)", self.identity, "now runs the singleton duties" if leader else
                     "no longer runs the singleton duties", reason)
        self._emit("leader_elected" if leader else "leader_lost", replica=self.identity, reason=reason)
        self._on_change(leader)

    async def run(self) -> None:
        """Campaign, hold and renew until cancelled; steps down on the way out."""
        every = self.ttl / 3
        lease: Lease = 0
        try:
            while True:
                try:
                    sent = self._clock()
                    if not lease:
                        lease, _ = await self.client.grant(self.ttl)
                        self._renewed = sent
                    elif await self.client.keepalive(lease) > 0:
                        self._renewed = sent
                    else:  # the lease ended (etcd was away longer than the ttl): start over
                        lease = 0
                        self._set(False, "its lease ended")
                        continue
                    created, held = await self.client.create(self.key, self.identity, lease=lease)
                    if created:
                        self._set(True, "took the election key")
                    else:
                        self.holder = _unb64(held.get("value", "")) or None
                        if int(held.get("lease", 0)) == lease:  # ours (taken before, or an answer lost)
                            self._set(True, "holds the election key")
                        else:  # someone else's: the key went (deleted, or our lease ended) and was taken
                            self._set(False, f"the election key is held by {self.holder!r}")
                except EtcdUnavailable as exc:
                    if self._leader and not self.leader:
                        self._set(False, f"could not renew: {exc}")
                await asyncio.sleep(every)
        finally:
            if self._leader:
                self._set(False, "stopping")
                if lease:
                    with contextlib.suppress(EtcdUnavailable):
                        await self.client.revoke(lease)  # hand over now, not after the ttl
