"""The admin API (aiohttp, JSON): is the server up, is it ready, and did a change reach every proxy.

=======  ======================  =================================================================
GET      /healthz                200 while the process serves
GET      /readyz                 200 once every source has reported and a snapshot is published;
                                 503 naming what it waits for otherwise
GET      /v1/proxies             every connected proxy and, per type, what was sent, ACKed, NACKed
                                 (filters: ``node``, ``cluster``, ``group`` (globs), ``state``;
                                 ``all=true``: recently disconnected ones too)
GET      /v1/snapshots           per node group and type: the current version, how many proxies
                                 ACKed it, and the time from its publish to the last ACK; per
                                 type, responses, ACKs and NACKs so far; whether a change is
                                 waiting to be built (``pending``) or held
GET      /v1/config?node=ID      the configuration that proxy is being served, as Envoy JSON
                                 (SDS secrets by name only: their keys never leave)
GET      /v1/held                the snapshot the blast-radius guard holds back, if any
GET      /metrics                Prometheus metrics (:mod:`pilotfish.server.metrics`)
POST     /v1/held/confirm        publish it (as ``kill -USR1`` does; 404 when nothing is held)
=======  ======================  =================================================================

Everything here reads: :class:`~pilotfish.status.SyncStatus` (written by the xDS and REST
servers), the cache and the reconciler; the one write is the confirmation of a held snapshot,
which goes through :meth:`~pilotfish.reconcile.Reconciler.confirm` like the signal. The API is
plain HTTP and has no tokens: it binds to loopback by default, and pilotfish warns when it is
told to listen elsewhere. With the server's certificate (``--tls-cert``) it is served over TLS
only, and with ``--admin-client-ca`` its clients must present a certificate from that CA (mTLS),
as the registry API. The status page belongs here too: a route added to :meth:`AdminApi.app`.

Times are wall-clock seconds since the epoch (``*_at``), and ages in seconds (``*_for``). A
state is ``SYNCED``, ``STALE``, ``NACKED`` or ``NOT_SENT`` (:class:`~pilotfish.status.SyncState`).
"""

from __future__ import annotations

import fnmatch
import logging
import ssl
from collections.abc import Callable
from typing import Any

import orjson
from aiohttp import web

from pilotfish.bootstrap import split_address
from pilotfish.cache import NodeGroup, SnapshotCache
from pilotfish.reconcile import Reconciler
from pilotfish.resources import SECRET, type_by_url
from pilotfish.server.http_site import is_loopback, serve_app
from pilotfish.server.metrics import CONTENT_TYPE, Metrics
from pilotfish.server.rest import response_json
from pilotfish.status import ProxyStatus, SyncState, SyncStatus, TypeStatus

__all__ = ["AdminApi", "proxy_json", "short_type", "start_admin_server", "warn_if_exposed"]

_log = logging.getLogger("pilotfish.admin")
_STATES = {state.value for state in SyncState}


def short_type(type_url: str) -> str:
    """``CDS`` for the cluster type URL, and so on; the URL itself for a type not served."""
    rtype = type_by_url(type_url)
    return rtype.short if rtype is not None else type_url


def _type_json(status: TypeStatus, now: float) -> dict[str, Any]:
    state = status.state
    out: dict[str, Any] = {"state": state.value, "sent_version": status.sent_version,
                           "acked_version": status.acked_version}
    if status.sent_version is not None:
        out["sent_at"] = status.sent_at
    if status.acked_version is not None:
        out["acked_at"] = status.acked_at
    if state is SyncState.STALE:
        out["stale_for"] = round(max(0.0, now - status.sent_at), 3)
    if status.nack_error is not None:
        out["nack"] = {"version": status.nacked_version, "message": status.nack_error, "at": status.nacked_at}
    return out


def proxy_json(proxy: ProxyStatus, now: float) -> dict[str, Any]:
    """One proxy as ``/v1/proxies`` shows it."""
    info = proxy.info
    return {
        "node": proxy.node_id, "cluster": info.cluster, "group": info.group, "user_agent": info.user_agent,
        "user_agent_version": info.user_agent_version, "protocol": info.protocol, "address": info.address,
        "streams": proxy.streams,
        "connected": proxy.streams > 0, "connected_since": proxy.connected_since,
        "types": {short_type(url): _type_json(status, now) for url, status in sorted(proxy.types.items())},
    }


def warn_if_exposed(host: str) -> bool:
    """Warn (once, at start) that the admin API answers anyone who can reach it, unless ``host`` is
    loopback only. Whether it warned."""
    if is_loopback(host):
        return False
    _log.warning("the admin API on %s answers anyone who can reach it (the proxies' status and configuration, "
                 "and POST /v1/held/confirm): keep it on loopback or behind a firewall", host or "every address")
    return True


class AdminApi:
    """The admin API's handlers over the server's status, cache and reconciler.

    ``waiting``: what the server waits for before it can publish (each source not yet reported,
    with why), as :func:`pilotfish.server.run` says it in its log.
    """

    def __init__(self, status: SyncStatus, cache: SnapshotCache, reconciler: Reconciler, *,
                 waiting: Callable[[], list[str]] | None = None, metrics: Metrics | None = None) -> None:
        self.status = status
        self.cache = cache
        self.reconciler = reconciler
        self._waiting = waiting or reconciler.waiting_for
        self.metrics = metrics
        """What ``/metrics`` renders (None: no such route)."""

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/readyz", self._readyz)
        app.router.add_get("/v1/proxies", self._proxies)
        app.router.add_get("/v1/snapshots", self._snapshots)
        app.router.add_get("/v1/config", self._config)
        app.router.add_get("/v1/held", self._held)
        app.router.add_post("/v1/held/confirm", self._confirm)
        if self.metrics is not None:
            app.router.add_get("/metrics", self._metrics)
        return app

    async def _metrics(self, request: web.Request) -> web.Response:
        assert self.metrics is not None
        return web.Response(body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE})

    # -- health -------------------------------------------------------------------------------------

    async def _healthz(self, request: web.Request) -> web.Response:
        return _json({"status": "serving"})

    async def _readyz(self, request: web.Request) -> web.Response:
        waiting = self._waiting()
        published = bool(self.cache.groups())
        if not waiting and published:
            return _json({"ready": True})
        reasons = [f"waiting for {what}" for what in waiting]
        if not published and not waiting:
            error = self.reconciler.last_error
            reasons.append("no snapshot is published yet" + (f": {error.describe()}" if error else ""))
        return _json({"ready": False, "waiting_for": waiting, "reasons": reasons}, status=503)

    # -- proxies and snapshots ------------------------------------------------------------------------

    async def _proxies(self, request: web.Request) -> web.Response:
        query = request.query
        state = query.get("state", "").upper()
        if state and state not in _STATES:
            return _error(400, f"state must be one of {', '.join(sorted(_STATES))}, not {query['state']!r}")
        include_gone = query.get("all", "") in ("1", "true", "yes")
        patterns = [(key, query[key]) for key in ("node", "cluster", "group") if query.get(key)]
        now = self.status.now()
        out = []
        for proxy in self.status.proxies():
            if proxy.streams == 0 and not include_gone:
                continue
            fields = {"node": proxy.node_id, "cluster": proxy.info.cluster, "group": proxy.info.group}
            if any(not fnmatch.fnmatchcase(fields[key], pattern) for key, pattern in patterns):
                continue
            if state and all(status.state.value != state for status in proxy.types.values()):
                continue
            out.append(proxy_json(proxy, now))
        return _json({"proxies": out, "now": now})

    async def _snapshots(self, request: web.Request) -> web.Response:
        groups: dict[str, dict[str, Any]] = {}
        for group, current in self.status.groups.items():
            groups[group] = {"label": current.label, "published_at": current.published_at, "types": {}}
        for progress in self.status.progress():
            entry = groups[progress.group]["types"]
            version = progress.version
            entry[short_type(progress.type_url)] = {
                "version": version, "published_at": progress.published_at, "proxies": progress.proxies,
                "acked": progress.acked, "current": progress.current, "nacked": progress.nacked,
                "last_ack_at": progress.last_ack_at,
                "seconds_to_last_ack": progress.seconds_to_last_ack,
                "summary": f"{version}: {progress.acked} of {progress.proxies}",
            }
        counters = {short_type(url): {"responses": c.responses, "acks": c.acks, "nacks": c.nacks}
                    for url, c in sorted(self.status.counters.items())}
        return _json({"groups": groups, "connected": self.status.connected(), "counters": counters,
                      "pending": not self.reconciler.idle,
                      "held": self._held_json()["held"], "now": self.status.now()})

    async def _config(self, request: web.Request) -> web.Response:
        node_id = request.query.get("node")
        if not node_id:
            return _error(400, "give the proxy's node id: /v1/config?node=ID")
        proxy = self.status.get(node_id)
        if proxy is None:
            return _error(404, f"no proxy with node id {node_id!r} is connected (or was, recently)")
        group = proxy.info.group
        snapshot = self.cache.snapshot(NodeGroup(group))
        if snapshot is None:
            return _error(404, f"nothing is published for node group {group!r} yet")
        types: dict[str, Any] = {}
        for url, current in snapshot.types.items():
            if url == SECRET.url:  # names only: private keys do not leave through the admin API
                resources: list[Any] = [{"name": name, "redacted": True} for name in sorted(current.resources)]
            else:
                resources = orjson.loads(response_json(current.response(None))).get("resources", [])
            types[short_type(url)] = {"version": current.version, "resources": resources}
        return _json({"node": node_id, "group": group, "label": snapshot.label(), "types": types})

    # -- the blast-radius guard -----------------------------------------------------------------------

    def _held_json(self) -> dict[str, Any]:
        held = self.reconciler.held
        if held is None:
            return {"held": None}
        return {"held": {"version": held.snapshot.label(), "reasons": list(held.reasons),
                         "groups": {group: snapshot.label() for group, snapshot in held.snapshots.items()}}}

    async def _held(self, request: web.Request) -> web.Response:
        return _json(self._held_json())

    async def _confirm(self, request: web.Request) -> web.Response:
        held = self._held_json()
        if self.reconciler.confirm(by="admin API") is None:
            return _error(404, "no snapshot is held: nothing to confirm")
        _log.warning("the held snapshot was confirmed through the admin API by %s", request.remote)
        return _json({"confirmed": held["held"]})


async def start_admin_server(api: AdminApi, address: str, *,
                             tls: ssl.SSLContext | None = None) -> tuple[web.AppRunner, str]:
    """Serve ``api`` on ``address`` (``host:port``; port 0 = any free), over TLS when ``tls`` is
    given; returns the runner (``cleanup()`` stops it) and the bound ``host:port``. Warns when
    not on loopback."""
    warn_if_exposed(split_address(address)[0])
    return await serve_app(api.app(), address, tls=tls)


def _json(body: Any, *, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(body), status=status, content_type="application/json")


def _error(status: int, message: str) -> web.Response:
    return _json({"error": message}, status=status)
