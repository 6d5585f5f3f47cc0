"""The registry's HTTP + JSON API (aiohttp), on the same event loop as xDS.

=======  =========================================  =============================================
GET      /v1/services                               every service with its instances
PUT      /v1/services/{service}                     define a service: listen, protocol, settings
GET      /v1/services/{service}                     one service
DELETE   /v1/services/{service}                     forget a service and its instances
POST     /v1/services/{service}/instances           register: address, port, weight?, metadata?, zone?, ttl?
PUT      /v1/services/{service}/instances/{id}/heartbeat  keep a TTL instance alive
DELETE   /v1/services/{service}/instances/{id}      deregister (id is ``address:port``)
GET      /v1/self-preservation                      whether TTL expiry is paused, and why
PUT      /v1/self-preservation                      ``{"enabled": false}``: let every lapsed instance expire
GET      /healthz                                   200 when serving
=======  =========================================  =============================================

With a tokens file (:class:`~pilotfish.api.tokens.TokenFile`), the middleware of
:class:`~pilotfish.api.tokens.TokenGate` decides every request before its handler runs
(and before its body is read): each route is classed in :data:`ROUTES` as open, read, write (to
the ``{service}`` of its path) or admin, and :func:`~pilotfish.api.tokens.authorize`
answers 401 or 403 in the error shape below, with ``WWW-Authenticate: Bearer``. Refusals are
logged and recorded (event ``registry_denied``) at most once per ``deny_report_every`` seconds,
with the count of those left out, so a client guessing tokens cannot fill the log.

Every answer to a refused request is ``{"error": ..., "problems": [{"field": ..., "message": ...}]}``
and the request changed nothing:

- **400**: the request itself is wrong (a bad field, a body that is not JSON or is nested deeper
  than ``max_depth``); **413**: the body is larger than ``max_body`` bytes;
- **409**: the request is fine on its own but conflicts with the state pilotfish serves. Before
  answering, a change is applied to the registry, and the merged state of *every* source (the
  snapshot file, etcd, the registry) is built with it, without publishing
  (:meth:`pilotfish.reconcile.Reconciler.check`). If the build has a problem the change
  introduced (a ``listen`` address another service uses, a service another source defines
  differently, a cluster name a raw resource uses...), the change is taken back and the problems
  are returned, each naming the field and where the other party comes from. Problems the merged
  state already had (another source is broken) do not refuse a change. So the registry never
  holds a state that blocks every later change from being served.
- **500**: our bug; the traceback is logged and the answer is still JSON. A change that fails
  before it is accepted is taken back.

Accepted changes are handed to the reconciler as the registry's whole state. TTL expiry runs
in :meth:`RegistryApi.expire_forever`, with self-preservation (see
:mod:`pilotfish.sources.registry`): entering and leaving it is logged as a warning and recorded
as the event ``registry_self_preservation``. An expiry that would leave the merged state broken
(a route of another source pointing at a service whose last instance lapsed) keeps the service
known with no instances, so its cluster stays, empty. ``PUT /v1/self-preservation`` turns it on or
off in the store (:meth:`RegistryStore.set_self_preservation`): this process's memory, or etcd,
where it applies to every replica (:mod:`pilotfish.api.registry_etcd`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from aiohttp import web

from pilotfish.api.tokens import Access, TokenFile, TokenGate
from pilotfish.build.desired import DesiredState
from pilotfish.errors import ConfigError, Problem
from pilotfish.events import EventLog
from pilotfish.sources.registry import (
    Conflict,
    Preservation,
    Registry,
    RegistryFigures,
    RegistryFull,
    SelfPreservation,
    StoreUnavailable,
    UnknownInstance,
)

__all__ = [
    "DEFAULT_MAX_BODY",
    "DEFAULT_MAX_DEPTH",
    "ROUTES",
    "Admitting",
    "Conflict",
    "MemoryRegistry",
    "RegistryApi",
    "RegistryStore",
    "Written",
]

_log = logging.getLogger("pilotfish.registry")
_SOURCE = "registry"
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
T = TypeVar("T")

DEFAULT_MAX_BODY = 1 << 20
"""Bytes a request body may have (1 MiB: a service definition or an instance is well under 4 KiB)."""
DEFAULT_MAX_DEPTH = 32
"""How deeply a JSON body may nest arrays and objects (the registry's own bodies need 3)."""

ROUTES: tuple[tuple[str, str, str, Access], ...] = (
    ("GET", "/healthz", "_healthz", Access.OPEN),
    ("GET", "/v1/services", "_list", Access.READ),
    ("GET", "/v1/services/{service}", "_get", Access.READ),
    ("PUT", "/v1/services/{service}", "_define", Access.WRITE),
    ("DELETE", "/v1/services/{service}", "_undefine", Access.WRITE),
    ("POST", "/v1/services/{service}/instances", "_register", Access.WRITE),
    ("PUT", "/v1/services/{service}/instances/{id}/heartbeat", "_heartbeat", Access.WRITE),
    ("DELETE", "/v1/services/{service}/instances/{id}", "_deregister", Access.WRITE),
    ("GET", "/v1/self-preservation", "_preservation", Access.READ),
    ("PUT", "/v1/self-preservation", "_set_preservation", Access.ADMIN),
)
"""Every route: method, path, handler (a method of :class:`RegistryApi`) and what it needs when
there is a tokens file. A write needs a token whose scope covers the ``{service}`` of the path."""


def _error(status: int, message: str, problems: list[dict[str, str]] | None = None) -> web.Response:
    return web.json_response({"error": message, "problems": problems or []}, status=status)


def _problems(problems: tuple[Problem, ...] | list[Problem]) -> list[dict[str, str]]:
    return [{"field": p.where, "message": p.message} for p in problems]


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number; use a finite number")


def _too_deep(value: Any, limit: int) -> bool:
    """Whether ``value`` nests lists and dicts more than ``limit`` deep (iterative: no recursion)."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        if depth > limit:
            return True
        stack.extend((child, depth + 1) for child in children if isinstance(child, dict | list))
    return False


@dataclass(frozen=True, slots=True)
class Written:
    """What a write did: the service or instance as it now reads (None: gone), and the etcd
    revision that holds it (None: the in-memory registry)."""

    body: dict[str, Any] | None
    revision: int | None = None


class Admitting(Protocol):
    """What the registry needs of the reconcile loop: to check a proposed state of the registry
    against the other sources' without publishing (409 when it adds a problem), and to hand over
    the state it accepted (see :class:`~pilotfish.reconcile.admission.Admission`)."""

    def check(self, source: str, state: DesiredState) -> list[Problem]: ...

    def update(self, source: str, state: DesiredState) -> None: ...


class RegistryStore(Protocol):
    """Where registrations live: this process's memory (:class:`MemoryRegistry`) or etcd
    (:class:`~pilotfish.api.registry_etcd.EtcdRegistry`). A write checks the request, the
    limits and the merged state of every source with the change (raising ``ConfigError``,
    :class:`RegistryFull`, :class:`Conflict` or :class:`UnknownInstance`, having changed nothing),
    then makes the change."""

    @property
    def revision(self) -> int | None:
        """The etcd revision this replica has applied (None: not on etcd)."""

    def knows(self, name: str) -> bool: ...
    def describe(self, name: str | None = None) -> dict[str, Any]: ...

    def census(self) -> tuple[int, int]:
        """(services defined or holding instances, instances), as this replica sees them."""

    @property
    def expired(self) -> int:
        """Instances this process expired (TTL lapsed) since it started."""

    async def caught_up(self, revision: int, timeout: float) -> bool:
        """Wait until this replica has applied ``revision``; False if ``timeout`` passes first."""

    async def status(self) -> dict[str, Any] | None:
        """The store's health for ``/healthz`` (None: nothing to say)."""

    @property
    def preservation(self) -> Preservation | None:
        """Self-preservation in force (None: not in force, or not run by this replica)."""

    def duties(self) -> dict[str, Any]:
        """Who runs the singleton duties (self-preservation), for ``/v1/self-preservation``."""

    async def self_preservation(self, configured: SelfPreservation) -> SelfPreservation:
        """The self-preservation rule in force: ``configured`` (the flags) as ``PUT
        /v1/self-preservation`` last turned it on or off, wherever that was sent."""

    async def set_self_preservation(self, enabled: bool) -> None:
        """Turn self-preservation on or off for every replica that shares this store."""

    async def define(self, name: str, body: Any) -> Written: ...
    async def undefine(self, name: str) -> Written: ...
    async def register(self, service: str, body: Any) -> Written: ...
    async def heartbeat(self, service: str, instance_id: str) -> Written: ...
    async def deregister(self, service: str, instance_id: str) -> Written: ...


class MemoryRegistry:
    """Registrations in this process's memory (a :class:`Registry`): lost when it stops."""

    def __init__(self, registry: Registry, reconciler: Admitting, *, changed: Callable[[], None]) -> None:
        self.registry = registry
        self.reconciler = reconciler
        self._changed = changed
        """Called after every accepted change (wakes the TTL expiry)."""

    @property
    def revision(self) -> int | None:
        return None

    def knows(self, name: str) -> bool:
        return self.registry.knows(name)

    def census(self) -> tuple[int, int]:
        return self.registry.census()

    @property
    def expired(self) -> int:
        return self.registry.expired_count

    async def caught_up(self, revision: int, timeout: float) -> bool:
        return True  # one process: every read already sees every write

    async def status(self) -> dict[str, Any] | None:
        return None

    @property
    def preservation(self) -> Preservation | None:
        return self.registry.preservation

    def duties(self) -> dict[str, Any]:
        return {}

    async def self_preservation(self, configured: SelfPreservation) -> SelfPreservation:
        return self.registry.self_preservation  # (one process: the flags, as the API last set them)

    async def set_self_preservation(self, enabled: bool) -> None:
        self.registry.set_self_preservation(enabled)

    def describe(self, name: str | None = None) -> dict[str, Any]:
        return self.registry.describe(name)

    def _apply(self, service: str, change: Callable[[], T]) -> T:
        """Make ``change`` (to ``service`` only) if the merged state stays valid, and hand the
        registry's new state to the reconciler; else take it back and raise :class:`Conflict`.
        Synchronous: nothing else runs between the check and the update."""
        undo = self.registry.undo_point(service)
        try:
            result = change()
            state = self.registry.state()
            problems = self.reconciler.check(_SOURCE, state)
        except BaseException:
            undo()
            raise
        if problems:
            undo()
            raise Conflict(problems)
        self.reconciler.update(_SOURCE, state)
        self._changed()
        return result

    async def define(self, name: str, body: Any) -> Written:
        self._apply(name, lambda: self.registry.define(name, body))
        return Written(self.registry.describe(name)[name])

    async def undefine(self, name: str) -> Written:
        self._apply(name, lambda: self.registry.undefine(name))
        return Written(None)

    async def register(self, service: str, body: Any) -> Written:
        instance = self._apply(service, lambda: self.registry.register(service, body))
        return Written(instance.describe(self.registry.now()))

    async def heartbeat(self, service: str, instance_id: str) -> Written:
        instance = self.registry.heartbeat(service, instance_id)
        self._changed()
        return Written(instance.describe(self.registry.now()))

    async def deregister(self, service: str, instance_id: str) -> Written:
        self._apply(service, lambda: self.registry.deregister(service, instance_id))
        return Written(None)


class RegistryApi:
    """Serves a :class:`Registry` over HTTP; checks changes with the reconciler, then reports them."""

    def __init__(
        self,
        registry: Registry,
        reconciler: Admitting,
        *,
        events: EventLog | None = None,
        max_body: int = DEFAULT_MAX_BODY,
        max_depth: int = DEFAULT_MAX_DEPTH,
        tokens: TokenFile | None = None,
        deny_report_every: float = 10.0,
        store: RegistryStore | None = None,
        max_revision_wait: float = 30.0,
    ) -> None:
        self.registry = registry
        """The in-memory registry (TTL expiry and self-preservation run on it)."""
        self.reconciler = reconciler
        self.events = events or EventLog()
        self.max_body = max_body
        self.max_depth = max_depth
        self._expiry_wake = asyncio.Event()
        self.store: RegistryStore = store or MemoryRegistry(registry, reconciler, changed=self._expiry_wake.set)
        """Where writes go and reads come from: memory, or etcd (``serve --etcd``)."""
        self.max_revision_wait = max_revision_wait
        """The longest a ``GET ...?revision=N`` waits for this replica to catch up (seconds)."""
        self.tokens = tokens
        """Who may do what; None: anyone may do anything (the API without ``--registry-tokens``)."""
        self.registrations = 0
        """Registrations accepted (the metrics' ``pilotfish_registry_registrations_total``)."""
        self.refused: Counter[int] = Counter()
        """Requests answered with an error, per HTTP status (``pilotfish_registry_refused_requests_total``)."""
        self._gate = (
            None
            if tokens is None
            else TokenGate(
                tokens,
                {(method, path): access for method, path, _, access in ROUTES},
                events=self.events,
                report_every=deny_report_every,
            )
        )

    def app(self) -> web.Application:
        middlewares = [self._errors] if self._gate is None else [self._errors, self._gate.middleware]
        app = web.Application(middlewares=middlewares, client_max_size=self.max_body)
        for method, path, handler, _ in ROUTES:
            app.router.add_route(method, path, getattr(self, handler))
            if method == "GET":
                app.router.add_route("HEAD", path, getattr(self, handler))
        return app

    def _changed(self, what: str, **fields: Any) -> None:
        self.events.emit("registry_" + what, **fields)

    def figures(self) -> RegistryFigures:
        """What the metrics show of the registry (read when scraped)."""
        services, instances = self.store.census()
        return RegistryFigures(
            services=services,
            instances=instances,
            registrations=self.registrations,
            expired=self.store.expired,
            refused=dict(self.refused),
            preserving=self.store.preservation is not None,
        )

    async def expire_forever(self) -> None:
        """Remove instances whose TTL lapsed, as they lapse (self-preservation permitting)."""
        while True:
            self._expiry_wake.clear()
            due = self.registry.next_expiry()
            if due is None:
                await self._expiry_wake.wait()
                continue
            delay = due - self.registry.now()
            if delay > 0:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._expiry_wake.wait(), delay)
                continue
            try:
                self.expire_once()
            except Exception:
                _log.exception("registry expiry failed (our bug); retrying in a second")
                self.events.emit("registry_error", reason="internal error during TTL expiry (see log)")
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._expiry_wake.wait(), 1.0)

    def expire_once(self) -> None:
        """One expiry pass: remove lapsed instances and report it (what :meth:`expire_forever` runs)."""
        done = self.registry.expire()
        if done.entered and done.preservation is not None:
            kept = done.preservation
            _log.warning(
                "registry self-preservation: %d of %d TTL instances stopped heartbeating within %.0fs; "
                "keeping %d lapsed instance(s) of %s instead of expiring them (a network partition is likelier "
                "than a dead fleet). Expiry resumes when heartbeats come back; PUT /v1/self-preservation "
                '{"enabled": false} lets them expire now',
                kept.lost_in_window,
                kept.ttl_instances,
                self.registry.self_preservation.window,
                kept.lapsed,
                "every service" if kept.everywhere else ", ".join(kept.services[:20]),
            )
            self.events.emit("registry_self_preservation", state="entered", **kept.describe())
        if done.exited:
            _log.warning("registry self-preservation over: TTL expiry resumed")
            self.events.emit("registry_self_preservation", state="exited", expired_now=len(done.expired))
        if not done.expired:
            return
        gone = sorted({i.service for i in done.expired if not self.registry.knows(i.service)})
        problems: list[Problem] = []
        if gone:
            try:
                problems = self.reconciler.check(_SOURCE, self.registry.state())
            except Exception:
                _log.exception("checking the registry after expiry failed (our bug); the build will report it")
        if problems:
            # The instances are gone either way; keep their services' clusters (empty) so that
            # what refers to them stays valid, and say why.
            for service in gone:
                self.registry.keep_known(service)
            _log.warning(
                "kept service(s) %s with no instances after their last instance expired, because "
                "removing them would break the merged state:\n  %s\nDELETE /v1/services/NAME once "
                "nothing refers to them",
                ", ".join(gone),
                "\n  ".join(str(p) for p in problems),
            )
        for instance in done.expired:
            _log.info(
                "instance %s of %s expired (no heartbeat within %ss)", instance.id, instance.service, instance.ttl
            )
            self.events.emit("registry_expired", service=instance.service, instance=instance.id)
        self.reconciler.update(_SOURCE, self.registry.state())

    @web.middleware
    async def _errors(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """Every error as JSON (the module docstring), each refusal counted by its status (those of
        the token gate, inside this middleware, included)."""
        response = await self._answer_errors(request, handler)
        if response.status >= 400:
            self.refused[response.status] += 1
        return response

    async def _answer_errors(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except ConfigError as exc:
            return _error(400, "; ".join(str(p) for p in exc.problems), _problems(exc.problems))
        except Conflict as exc:
            return _error(
                409,
                f"{request.method} {request.path} conflicts with the state pilotfish serves; "
                f"nothing was changed: {exc}",
                _problems(exc.problems),
            )
        except RegistryFull as exc:
            return _error(409, str(exc))
        except UnknownInstance as exc:
            return _error(404, str(exc))
        except StoreUnavailable as exc:
            return _error(
                503,
                f"{request.method} {request.path}: {exc}. A read or a refused write changed nothing; a "
                "write whose answer was lost may have been made: retrying it is safe",
            )
        except web.HTTPRequestEntityTooLarge:
            return _error(413, f"the body of {request.method} {request.path} is larger than {self.max_body} bytes")
        except web.HTTPException as exc:
            if exc.status >= 400:
                return _error(exc.status, exc.reason)
            raise
        except Exception as exc:
            _log.exception("%s %s failed: a bug in pilotfish, please report it", request.method, request.path)
            return _error(
                500,
                f"internal error handling {request.method} {request.path}: "
                f"{type(exc).__name__} (a bug in pilotfish; the server log has the details)",
            )

    async def _body(self, request: web.Request) -> Any:
        if not request.can_read_body:
            return {}
        raw = await request.read()  # raises HTTPRequestEntityTooLarge past client_max_size
        try:
            value = json.loads(raw, parse_constant=_reject_constant)
        except RecursionError as exc:
            raise ConfigError(
                "request",
                [Problem("", f"the body nests arrays or objects too deeply (at most {self.max_depth} levels)")],
            ) from exc
        except (UnicodeDecodeError, ValueError) as exc:  # JSONDecodeError is a ValueError
            raise ConfigError("request", [Problem("", f"the body is not valid JSON: {exc}")]) from exc
        if _too_deep(value, self.max_depth):
            raise ConfigError(
                "request",
                [Problem("", f"the body nests arrays or objects too deeply (at most {self.max_depth} levels)")],
            )
        return value

    def _answer(self, body: Any, *, status: int = 200, revision: int | None = None) -> web.Response:
        """A JSON answer; on etcd, with the revision this replica has applied (and that of the write)."""
        applied = self.store.revision
        if revision is not None and isinstance(body, dict):
            body = {**body, "revision": revision}
        response = web.json_response(body, status=status) if body is not None else web.Response(status=204)
        if applied is not None:
            response.headers["Pilotfish-Etcd-Revision"] = str(max(applied, revision or 0))
        return response

    async def _read_revision(self, request: web.Request) -> web.Response | None:
        """``?revision=N``: wait (up to ``?wait=S`` seconds, default 5) until this replica has
        applied revision N; an error answer if it has not, None when it has (or nothing was asked)."""
        raw = request.query.get("revision")
        if raw is None:
            return None
        try:
            wanted = int(raw)
            wait = min(float(request.query.get("wait", "5")), self.max_revision_wait)
        except ValueError:
            raise ConfigError(
                "request",
                [
                    Problem(
                        "revision",
                        "expected ?revision=N (an etcd revision, as a write answered) and optionally &wait=SECONDS",
                    )
                ],
            ) from None
        if not await self.store.caught_up(wanted, max(0.0, wait)):
            return _error(
                503,
                f"this replica has applied etcd revision {self.store.revision}, not yet {wanted}; "
                "retry, or read from another replica",
            )
        return None

    async def _healthz(self, request: web.Request) -> web.Response:
        status = await self.store.status()
        return self._answer({"status": "serving", **({"etcd": status} if status is not None else {})})

    async def _list(self, request: web.Request) -> web.Response:
        return await self._read_revision(request) or self._answer(
            {"services": self.store.describe()}, revision=self.store.revision
        )

    async def _get(self, request: web.Request) -> web.Response:
        name = request.match_info["service"]
        waited = await self._read_revision(request)
        if waited is not None:
            return waited
        if not self.store.knows(name):
            return _error(404, f"no service {name!r}")
        return self._answer(self.store.describe(name)[name])

    async def _define(self, request: web.Request) -> web.Response:
        name = request.match_info["service"]
        written = await self.store.define(name, await self._body(request))
        self._changed("service_defined", service=name)
        return self._answer(written.body, revision=written.revision)

    async def _undefine(self, request: web.Request) -> web.Response:
        name = request.match_info["service"]
        if not self.store.knows(name):
            return _error(404, f"no service {name!r}")
        written = await self.store.undefine(name)
        self._changed("service_removed", service=name)
        return self._answer(written.body, status=204, revision=written.revision)

    async def _register(self, request: web.Request) -> web.Response:
        name = request.match_info["service"]
        written = await self.store.register(name, await self._body(request))
        assert written.body is not None
        self.registrations += 1
        self._changed("registered", service=name, instance=written.body["id"], ttl=written.body["ttl"])
        return self._answer(written.body, status=201, revision=written.revision)

    async def _heartbeat(self, request: web.Request) -> web.Response:
        written = await self.store.heartbeat(request.match_info["service"], request.match_info["id"])
        return self._answer(written.body)

    async def _deregister(self, request: web.Request) -> web.Response:
        name, instance_id = request.match_info["service"], request.match_info["id"]
        written = await self.store.deregister(name, instance_id)
        self._changed("deregistered", service=name, instance=instance_id)
        return self._answer(written.body, status=204, revision=written.revision)

    async def _preservation(self, request: web.Request) -> web.Response:
        return web.json_response(await self._preservation_view())

    async def _set_preservation(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        if not isinstance(body, dict) or set(body) != {"enabled"} or not isinstance(body["enabled"], bool):
            raise ConfigError("request", [Problem("enabled", 'send {"enabled": true} or {"enabled": false}')])
        await self.store.set_self_preservation(body["enabled"])
        _log.warning("registry self-preservation turned %s through the API", "on" if body["enabled"] else "off")
        self.events.emit("registry_self_preservation", state="enabled" if body["enabled"] else "disabled")
        self._expiry_wake.set()
        return web.json_response(await self._preservation_view())

    async def _preservation_view(self) -> dict[str, Any]:
        kept = self.store.preservation
        rule = await self.store.self_preservation(self.registry.self_preservation)
        return {
            "enabled": rule.enabled,
            "active": kept is not None,
            **self.store.duties(),
            **({"kept": kept.describe()} if kept is not None else {}),
        }
