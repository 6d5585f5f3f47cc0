"""The registry's HTTP + JSON API (aiohttp), on the same event loop as xDS.

=======  =========================================  =============================================
GET      /v1/services                               every service with its instances
PUT      /v1/services/{service}                     define a service: listen, protocol, settings
GET      /v1/services/{service}                     one service
DELETE   /v1/services/{service}                     forget a service and its instances
POST     /v1/services/{service}/instances           register: address, port, weight?, metadata?, ttl?
PUT      /v1/services/{service}/instances/{id}/heartbeat  keep a TTL instance alive
DELETE   /v1/services/{service}/instances/{id}      deregister (id is ``address:port``)
GET      /healthz                                   200 when serving
=======  =========================================  =============================================

A bad request gets a 4xx with ``{"error": ..., "problems": [{"field": ..., "message": ...}]}``
and changes nothing. Every change is handed to the reconciler as the registry's whole state.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from pilotfish.errors import ConfigError, Problem
from pilotfish.events import EventLog
from pilotfish.reconcile import Reconciler
from pilotfish.sources.registry import Registry, UnknownInstance

__all__ = ["RegistryApi"]

_log = logging.getLogger("pilotfish.registry")
_SOURCE = "registry"
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _error(status: int, message: str, problems: list[dict[str, str]] | None = None) -> web.Response:
    return web.json_response({"error": message, "problems": problems or []}, status=status)


class RegistryApi:
    """Serves a :class:`Registry` over HTTP and reports its changes to the reconciler."""

    def __init__(self, registry: Registry, reconciler: Reconciler, *, events: EventLog | None = None) -> None:
        self.registry = registry
        self.reconciler = reconciler
        self.events = events or EventLog()
        self._expiry_wake = asyncio.Event()

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._errors])
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/v1/services", self._list)
        app.router.add_get("/v1/services/{service}", self._get)
        app.router.add_put("/v1/services/{service}", self._define)
        app.router.add_delete("/v1/services/{service}", self._undefine)
        app.router.add_post("/v1/services/{service}/instances", self._register)
        app.router.add_put("/v1/services/{service}/instances/{id}/heartbeat", self._heartbeat)
        app.router.add_delete("/v1/services/{service}/instances/{id}", self._deregister)
        return app

    def _changed(self, what: str, **fields: Any) -> None:
        self.events.emit("registry_" + what, **fields)
        self.reconciler.update(_SOURCE, self.registry.state())
        self._expiry_wake.set()

    async def expire_forever(self) -> None:
        """Remove instances whose TTL lapsed, as they lapse."""
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
            for instance in self.registry.expire():
                _log.info("instance %s of %s expired (no heartbeat within %ss)",
                          instance.id, instance.service, instance.ttl)
                self._changed("expired", service=instance.service, instance=instance.id)

    @web.middleware
    async def _errors(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except ConfigError as exc:
            problems = [{"field": p.where, "message": p.message} for p in exc.problems]
            return _error(400, "; ".join(str(p) for p in exc.problems), problems)
        except UnknownInstance as exc:
            return _error(404, str(exc))
        except web.HTTPException as exc:
            if exc.status >= 400:
                return _error(exc.status, exc.reason)
            raise

    async def _body(self, request: web.Request) -> Any:
        if not request.can_read_body:
            return {}
        try:
            return json.loads(await request.read())
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ConfigError("request", [Problem("", f"the body is not valid JSON: {exc}")]) from exc

    async def _healthz(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "serving"})

    async def _list(self, request: web.Request) -> web.Response:
        return web.json_response({"services": self.registry.describe()})

    async def _get(self, request: web.Request) -> web.Response:
        name = request.match_info["service"]
        if not self.registry.knows(name):
            return _error(404, f"no service {name!r}")
        return web.json_response(self.registry.describe(name)[name])

    async def _define(self, request: web.Request) -> web.Response:
        name = request.match_info["service"]
        self.registry.define(name, await self._body(request))
        self._changed("service_defined", service=name)
        return web.json_response(self.registry.describe(name)[name])

    async def _undefine(self, request: web.Request) -> web.Response:
        name = request.match_info["service"]
        if not self.registry.undefine(name):
            return _error(404, f"no service {name!r}")
        self._changed("service_removed", service=name)
        return web.Response(status=204)

    async def _register(self, request: web.Request) -> web.Response:
        name = request.match_info["service"]
        instance = self.registry.register(name, await self._body(request))
        self._changed("registered", service=name, instance=instance.id, ttl=instance.ttl)
        return web.json_response(instance.describe(self.registry.now()), status=201)

    async def _heartbeat(self, request: web.Request) -> web.Response:
        instance = self.registry.heartbeat(request.match_info["service"], request.match_info["id"])
        self._expiry_wake.set()
        return web.json_response(instance.describe(self.registry.now()))

    async def _deregister(self, request: web.Request) -> web.Response:
        name, instance_id = request.match_info["service"], request.match_info["id"]
        self.registry.deregister(name, instance_id)
        self._changed("deregistered", service=name, instance=instance_id)
        return web.Response(status=204)

