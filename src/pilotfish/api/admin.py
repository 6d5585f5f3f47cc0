"""The admin API (aiohttp, JSON): is the server up, is it ready, did a change reach every proxy, and
where its rollout is.

=======  ======================  =================================================================
GET      /                       the status page: the fleet at a glance, updating itself
                                 (``status_page.html``, which polls the JSON routes below)
GET      /healthz                200 while the process serves (with ``--etcd``: this replica's etcd
                                 revision, its lag, and which replica leads)
GET      /readyz                 200 once every source has reported and a snapshot is published;
                                 503 naming what it waits for otherwise
GET      /v1/proxies             every connected proxy and, per type, what was sent, ACKed, NACKed
                                 (filters: ``node``, ``cluster``, ``group`` (globs), ``state``;
                                 ``all=true``: recently disconnected ones too, with ``left_at``)
GET      /v1/snapshots           per node group and type: the current version, how many proxies
                                 ACKed it, and the time from its publish to the last ACK; per
                                 type, responses, ACKs and NACKs so far; whether a change is
                                 waiting to be built (``pending``) or held; the rollout (as
                                 ``/v1/rollout``; null without ``--rollout``)
GET      /v1/config?node=ID      the configuration that proxy is being served, as Envoy JSON
                                 (SDS secrets by name only: their keys never leave)
GET      /v1/fleet               what the status page shows of the proxies: how many are in each
                                 state, the first ``limit`` of them worst first (``q``: only those
                                 whose node id, cluster or group contains it), the latest NACKs
GET      /v1/events              the latest events (``after=SEQ``: only newer ones; ``limit``),
                                 from the server's in-memory ring (:class:`~pilotfish.events.RecentEvents`)
GET      /v1/held                the snapshot the blast-radius guard holds back, if any
GET      /v1/docker              each Docker engine followed (``serve --docker``): connected or why
                                 not, and every labelled container with the endpoints it serves
                                 (or the problems with its labels)
GET      /v1/dns                 each host name of DNS services pilotfish looks up (``serve
                                 --dns-refresh``): its services, whether it resolves, its last
                                 good addresses, and what is served for it (the name, or those)
GET      /metrics                Prometheus metrics (:mod:`pilotfish.api.metrics`)
POST     /v1/held/confirm        publish it (as ``kill -USR1`` does; 404 when nothing is held)
GET      /v1/rollout             where the rollout is (``serve --rollout``, docs/rollout.md): phase,
                                 wave, candidate and baseline, who it waits for, the pause, the
                                 bake's health, the held candidates; 404 without ``--rollout``
POST     /v1/rollout/promote     the current wave passes now (the last: the rollout completes)
POST     /v1/rollout/pause       no further wave starts until resumed
POST     /v1/rollout/resume      go on after a pause
POST     /v1/rollout/abort       roll the candidate back and hold it; ``reason`` (JSON body
                                 ``{"reason": ...}`` or query, at most :data:`MAX_REASON`
                                 characters) is recorded with it. A command that does not apply
                                 now: 409 saying why and what does
POST     /v1/plan                what serving the body (a proposed snapshot file, at most
                                 :data:`MAX_PLAN_BODY` bytes; ``name=``: its file name, which
                                 names it in problems and makes it JSON when it ends in ``.json``)
                                 in place of the snapshot file would do, publishing nothing
                                 (``pilotfish plan``, :mod:`pilotfish.reconcile.plan`): per group
                                 and type what is added, removed, changed (field by field), the
                                 problems, the guard, the rollout's decision, the proxies. One at
                                 a time (429 while one is made); 413 over the bound
=======  ======================  =================================================================

Everything here reads: :class:`~pilotfish.status.SyncStatus` (written by the xDS and REST
servers), the cache and the reconciler (a plan builds, but publishes and changes nothing: its
build runs in a worker thread over what the reconciler read for it on the loop, with a memo of
its own, so the loop goes on serving meanwhile); the writes are the confirmation of a held snapshot,
which goes through :meth:`~pilotfish.reconcile.Reconciler.confirm` like the signal, and the
rollout's commands (:class:`RolloutControl`: the server's
:class:`~pilotfish.rollout.delivery.Delivery`). Each write records who gave it (``by``: ``admin
API``, with the token's name when there are tokens) in its event. It binds to
loopback by default, and pilotfish warns when it is told to listen elsewhere without tokens.
With the server's certificate (``--tls-cert``) it is served over TLS only, and with
``--admin-client-ca`` its clients must present a certificate from that CA (mTLS), as the
registry API. With a tokens file (``--admin-tokens``: the registry's format, followed as it
changes, :mod:`pilotfish.api.tokens`), each route needs what :data:`ROUTES` says: a
token with ``read: true`` reads, one with ``admin: true`` reads, confirms and commands the
rollout; a request without a usable token gets 401, one whose token's scope falls short 403
(event ``admin_denied``).

The status page is one static file of this package (HTML, CSS and a little JavaScript, no build
step, nothing loaded from elsewhere); its script polls ``/v1/fleet``, ``/v1/snapshots`` (with the
rollout in it) and ``/v1/events`` and writes what peers said (node ids, NACK messages, a held
candidate's reason) as text, never as markup. It
is served with a Content-Security-Policy that allows only its own script and style (by hash) and
requests to this origin, so even a mistake there could not run a peer's script. With 10,000
proxies it stays small: counts per state, then at most :data:`FLEET_ROWS` rows, worst first, and
a filter box that asks the server.

Times are wall-clock seconds since the epoch (``*_at``), and ages in seconds (``*_for``). A
state is ``SYNCED``, ``STALE``, ``NACKED`` or ``NOT_SENT`` (:class:`~pilotfish.status.SyncState`).
"""

from __future__ import annotations

import asyncio
import base64
import fnmatch
import hashlib
import heapq
import importlib.resources
import itertools
import logging
import re
import ssl
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import orjson
from aiohttp import ClientPayloadError, web
from aiohttp.http_exceptions import HttpProcessingError

from pilotfish.api.metrics import CONTENT_TYPE, Metrics
from pilotfish.api.tokens import TOKEN_NAME, Access, TokenFile, TokenGate
from pilotfish.build.desired import DesiredState
from pilotfish.cache import NodeGroup, SnapshotCache
from pilotfish.errors import ConfigError, shorten
from pilotfish.events import EventLog, RecentEvents
from pilotfish.reconcile import Plan, PublishState
from pilotfish.resources import ENDPOINT, SECRET, type_by_url
from pilotfish.resources.bootstrap import split_address
from pilotfish.rollout.machine import CommandRefused
from pilotfish.snapshot import Snapshot
from pilotfish.sources.file import SOURCE as FILE_SOURCE
from pilotfish.sources.file import parse_desired
from pilotfish.status import (
    WORST_FIRST,
    DepartedProxy,
    ProxyRecord,
    SyncState,
    SyncStatus,
    TypeStatus,
    nack_summary,
    worst_state,
)
from pilotfish.transport.site import ADMIN_API, ADMIN_CONNECTIONS, HttpConnectionLimits, is_loopback, serve_app
from pilotfish.xds.rest import response_json

__all__ = [
    "FLEET_NACKS",
    "FLEET_ROWS",
    "MAX_COMMAND_BODY",
    "MAX_FILTER",
    "MAX_PLAN_BODY",
    "MAX_REASON",
    "NO_ROLLOUT",
    "PLAN_READ_SECONDS",
    "ROLLOUT_COMMANDS",
    "ROUTES",
    "AdminApi",
    "HeldSnapshots",
    "RolloutControl",
    "SourceStatus",
    "proxy_json",
    "short_type",
    "start_admin_server",
    "status_page",
    "warn_if_exposed",
]

_log = logging.getLogger("pilotfish.admin")
_STATES = {state.value for state in SyncState}

FLEET_ROWS = 1000
"""Proxies ``/v1/fleet`` lists at most (``limit``; the status page asks for 100)."""
FLEET_NACKS = 20
"""The latest NACKs ``/v1/fleet`` lists."""
MAX_FILTER = 256
"""Characters a ``/v1/fleet`` filter (``q``) may have."""
MAX_REASON = 200
"""Characters an abort's ``reason`` may have (the rollout keeps as many)."""
MAX_COMMAND_BODY = 4096
"""Bytes a request body may have (the one body read is a rollout command's ``{"reason": ...}``)."""
MAX_PLAN_BODY = 16 * 1024 * 1024
"""Bytes a proposed file (``POST /v1/plan``) may have: read as it comes, refused (413) past it."""
PLAN_READ_SECONDS = 60.0
"""Seconds a proposed file may take to arrive (408 after: it holds the one plan slot)."""
ROLLOUT_COMMANDS = ("promote", "pause", "resume", "abort")
"""``POST /v1/rollout/<command>``."""
NO_ROLLOUT = (
    "this server runs no rollout: every change reaches every proxy at once. To roll changes out in "
    "waves, start it with --rollout WAVES, e.g. --rollout 'canary=edge-canary-*,5%,25%,100%' (docs/rollout.md)"
)
"""What the rollout routes answer (404) when ``serve`` was started without ``--rollout``."""
_RANKED = WORST_FIRST
_RANK = {state: rank for rank, state in enumerate(WORST_FIRST)}
"""A proxy's rank on the status page: its worst state over its types (:func:`~pilotfish.status.worst_state`)."""

ROUTES: dict[tuple[str, str], Access] = {
    ("GET", "/"): Access.OPEN,
    ("GET", "/healthz"): Access.OPEN,
    ("GET", "/readyz"): Access.OPEN,
    ("GET", "/v1/fleet"): Access.READ,
    ("GET", "/v1/events"): Access.READ,
    ("GET", "/v1/proxies"): Access.READ,
    ("GET", "/v1/snapshots"): Access.READ,
    ("GET", "/v1/config"): Access.READ,
    ("GET", "/v1/held"): Access.READ,
    ("GET", "/v1/docker"): Access.READ,
    ("GET", "/v1/dns"): Access.READ,
    ("GET", "/metrics"): Access.READ,
    ("POST", "/v1/held/confirm"): Access.ADMIN,
    ("GET", "/v1/rollout"): Access.READ,
    **{("POST", f"/v1/rollout/{command}"): Access.ADMIN for command in ROLLOUT_COMMANDS},
    ("POST", "/v1/plan"): Access.READ,
}
"""What each route needs when the API has tokens (``serve --admin-tokens``): the status page
itself (static; its data comes from the read routes), health and readiness are open (probes
carry no token); the proxies' status, configuration, events, metrics and the rollout's status are
reads (``read: true``, or none with ``reads: open``), and so is a plan (it changes nothing; what it
costs is bounded: one at a time, :data:`MAX_PLAN_BODY`); confirming a held snapshot and
commanding the rollout need ``admin: true``."""
_ADMIN_ACTIONS = {
    "/v1/held/confirm": "confirm a held snapshot",
    **{f"/v1/rollout/{command}": f"{command} the rollout" for command in ROLLOUT_COMMANDS},
}
"""What a 403 says the token may not do, per admin route."""


def status_page() -> tuple[bytes, str]:
    """The status page (``status_page.html`` of this package) and the Content-Security-Policy it
    is served with: its own inline script and style, by hash, and requests to this origin only."""
    page = importlib.resources.files("pilotfish.api").joinpath("status_page.html").read_bytes()
    hashes = {}
    for tag in ("script", "style"):
        bodies = re.findall(rb"<%s>(.*?)</%s>" % (tag.encode(), tag.encode()), page, re.DOTALL)
        if not bodies:  # a tag with attributes would go unhashed, and the browser would refuse it
            raise RuntimeError(f"status_page.html has no plain <{tag}> element to allow by hash")
        hashes[tag] = " ".join(
            f"'sha256-{base64.b64encode(hashlib.sha256(body).digest()).decode()}'" for body in bodies
        )
    policy = (
        f"default-src 'none'; script-src {hashes['script']}; style-src {hashes['style']}; "
        "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    )
    return page, policy


def short_type(type_url: str) -> str:
    """``CDS`` for the cluster type URL, and so on; the URL itself for a type not served."""
    rtype = type_by_url(type_url)
    return rtype.short if rtype is not None else type_url


def _type_json(status: TypeStatus, now: float) -> dict[str, Any]:
    state = status.state
    out: dict[str, Any] = {
        "state": state.value,
        "sent_version": status.sent_version,
        "acked_version": status.acked_version,
    }
    if status.sent_version is not None:
        out["sent_at"] = status.sent_at
    if status.acked_version is not None:
        out["acked_at"] = status.acked_at
    if state is SyncState.STALE:
        out["stale_for"] = round(max(0.0, now - status.sent_at), 3)
    if status.nack_error is not None:
        out["nack"] = {
            "version": status.nacked_version,
            "message": status.nack_error,
            "summary": nack_summary(status.nack_error),
            "at": status.nacked_at,
        }
    return out


def proxy_json(proxy: ProxyRecord, now: float) -> dict[str, Any]:
    """One proxy as ``/v1/proxies`` shows it."""
    info = proxy.info
    return {
        "node": proxy.node_id,
        "cluster": info.cluster,
        "group": info.group,
        "user_agent": info.user_agent,
        "user_agent_version": info.user_agent_version,
        "protocol": info.protocol,
        "address": info.address,
        "streams": proxy.streams,
        "connected": proxy.streams > 0,
        "connected_since": proxy.connected_since,
        "types": {short_type(url): _type_json(status, now) for url, status in sorted(proxy.types.items())},
        **({"left_at": proxy.left_at} if isinstance(proxy, DepartedProxy) else {}),
    }


def warn_if_exposed(host: str) -> bool:
    """Warn (once, at start) that the admin API answers anyone who can reach it, unless ``host`` is
    loopback only. Whether it warned."""
    if is_loopback(host):
        return False
    _log.warning(
        "the admin API on %s answers anyone who can reach it (the proxies' status and configuration, "
        "and POST /v1/held/confirm): keep it on loopback or behind a firewall",
        host or "every address",
    )
    return True


class HeldSnapshots(PublishState, Protocol):
    """What the admin API needs of the reconcile loop: to read it, to plan a proposed state
    (:meth:`~pilotfish.reconcile.Reconciler.planner`: read on the loop, the returned function run
    in a worker thread), and to publish the snapshot its guard holds, as the operator confirms
    (the one write)."""

    def confirm(self, *, by: str = "") -> Snapshot | None: ...

    def planner(self, source: str, state: DesiredState, *, label: str | None = None) -> Callable[[], Plan]: ...


class RolloutControl(Protocol):
    """What the admin API needs of a rollout (``serve --rollout``: the server's
    :class:`~pilotfish.rollout.delivery.Delivery`): its status, JSON-able and bounded, and the
    operator's commands, each raising :class:`~pilotfish.rollout.machine.CommandRefused` (saying
    why, and what applies) when it does not apply now. ``by``: who gave the command, for its event."""

    def status(self) -> dict[str, Any]: ...

    def promote(self, *, by: str = "") -> None: ...

    def pause(self, *, by: str = "") -> None: ...

    def resume(self, *, by: str = "") -> None: ...

    def abort(self, reason: str = "", *, by: str = "") -> None: ...

    def would_offer(self, snapshots: Mapping[NodeGroup, Snapshot]) -> dict[str, Any]:
        """What publishing ``snapshots`` would make the rollout decide, changing nothing (a plan)."""
        ...


@dataclass(frozen=True, slots=True)
class SourceStatus:
    """How the sources that have a status of their own are doing (``serve`` gives what it runs)."""

    etcd: Callable[[], Awaitable[dict[str, Any]]] | None = None
    """This replica's etcd revision and lag (and who leads), for ``/healthz``; None: no etcd."""
    docker: Sequence[Callable[[], dict[str, Any]]] = ()
    """Each Docker engine's status (``/v1/docker``)."""
    dns: Callable[[], list[dict[str, Any]]] | None = None
    """The host names looked up (``/v1/dns``); None: none are (``--dns-refresh 0s``)."""


class AdminApi:
    """The admin API's handlers over the server's status, cache and reconcile loop.

    ``waiting``: what the server waits for before it can publish (each source not yet reported,
    with why), as :func:`pilotfish.app.serve` says it in its log. ``rollout``: the rollout its
    ``/v1/rollout`` routes show and command (None: ``serve`` runs none, and they answer 404).
    """

    def __init__(
        self,
        status: SyncStatus,
        cache: SnapshotCache,
        reconciler: HeldSnapshots,
        *,
        waiting: Callable[[], list[str]] | None = None,
        metrics: Metrics | None = None,
        recent: RecentEvents | None = None,
        sources: SourceStatus | None = None,
        tokens: TokenFile | None = None,
        events: EventLog | None = None,
        rollout: RolloutControl | None = None,
    ) -> None:
        self.status = status
        self.tokens = tokens
        """Who may read and who may confirm (``serve --admin-tokens``); None: anyone who can reach it."""
        self._gate = (
            None
            if tokens is None
            else TokenGate(
                tokens,
                ROUTES,
                events=events or EventLog(),
                api="admin",
                admin_action="confirm a held snapshot",
                admin_actions=_ADMIN_ACTIONS,
            )
        )
        self.rollout = rollout
        """The rollout (``serve --rollout``); None: none."""
        self._subset_of = cache.subset_of
        """Node id -> its subsetting index (None: none): which endpoints the cache serves it."""
        self._sources = sources or SourceStatus()
        self.cache = cache
        self.reconciler = reconciler
        self._waiting = waiting or reconciler.readiness.waiting_for
        self.metrics = metrics
        """What ``/metrics`` renders (None: no such route)."""
        self.recent = recent
        """The latest events (the server's :class:`~pilotfish.events.EventLog` keeps them there);
        None: ``/v1/events`` answers 404."""
        self._page, self._policy = status_page()
        self._planning = False
        """A plan is being made (its body read, or its build run): the next waits (429)."""

    def app(self) -> web.Application:
        app = web.Application(
            middlewares=[] if self._gate is None else [self._gate.middleware], client_max_size=MAX_COMMAND_BODY
        )
        app.router.add_get("/", self._status_page)
        app.router.add_get("/v1/fleet", self._fleet)
        app.router.add_get("/v1/events", self._events)
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/readyz", self._readyz)
        app.router.add_get("/v1/proxies", self._proxies)
        app.router.add_get("/v1/snapshots", self._snapshots)
        app.router.add_get("/v1/config", self._config)
        app.router.add_get("/v1/held", self._held)
        app.router.add_get("/v1/docker", self._docker_engines)
        app.router.add_get("/v1/dns", self._dns_names)
        app.router.add_post("/v1/held/confirm", self._confirm)
        app.router.add_get("/v1/rollout", self._rollout_status)
        for command in ROLLOUT_COMMANDS:
            app.router.add_post(f"/v1/rollout/{command}", self._rollout_command)
        app.router.add_post("/v1/plan", self._plan)
        if self.metrics is not None:
            app.router.add_get("/metrics", self._metrics)
        return app

    async def _metrics(self, request: web.Request) -> web.Response:
        assert self.metrics is not None
        return web.Response(body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE})

    # -- the status page ------------------------------------------------------------------------------

    async def _status_page(self, request: web.Request) -> web.Response:
        return web.Response(
            body=self._page,
            headers={
                "Content-Type": "text/html; charset=utf-8",
                "Content-Security-Policy": self._policy,
                "X-Content-Type-Options": "nosniff",
                "Referrer-Policy": "no-referrer",
                "Cache-Control": "no-store",
            },
        )

    def _with_subset(self, row: dict[str, Any]) -> dict[str, Any]:
        """A proxy row, with its subsets (index, addresses per service) when its group has any."""
        index = self._subset_of(row["node"])
        snapshot = self.cache.snapshot(NodeGroup(row["group"])) if index is not None else None
        if index is not None and snapshot is not None and snapshot.subsets is not None:
            row["subset"] = {"index": index, "services": snapshot.subsets.chosen(index)}
        return row

    async def _fleet(self, request: web.Request) -> web.Response:
        query = request.query
        limit = _int_param(query, "limit", default=100, low=0, high=FLEET_ROWS)
        if isinstance(limit, web.Response):
            return limit
        needle = query.get("q", "")
        if len(needle) > MAX_FILTER:
            return _error(400, f"q (the filter) may have at most {MAX_FILTER} characters, not {len(needle)}")
        needle = needle.casefold()
        now = self.status.now()
        ranked: list[list[ProxyRecord]] = [[] for _ in _RANKED]
        counts = dict.fromkeys((state.value for state in _RANKED), 0)
        nacks: list[tuple[float, str, str, TypeStatus]] = []
        for proxy in self.status.proxies():  # by node id
            if proxy.streams == 0:
                continue
            rank = _RANK[worst_state(proxy.types)]
            for url, status in proxy.types.items():
                if status.nack_error is not None:
                    nacks.append((status.nacked_at, proxy.node_id, url, status))
            counts[_RANKED[rank].value] += 1
            info = proxy.info
            if needle and not any(needle in text.casefold() for text in (proxy.node_id, info.cluster, info.group)):
                continue
            ranked[rank].append(proxy)
        matched = sum(len(proxies) for proxies in ranked)
        shown = [
            self._with_subset(proxy_json(proxy, now)) for proxy in itertools.islice(itertools.chain(*ranked), limit)
        ]
        latest = heapq.nlargest(FLEET_NACKS, nacks, key=lambda nack: nack[0])
        return _json(
            {
                "now": now,
                "connected": sum(counts.values()),
                "states": counts,
                "matched": matched,
                "limit": limit,
                "proxies": shown,
                "nacks": [
                    {
                        "node": node,
                        "type": short_type(url),
                        "version": status.nacked_version,
                        "message": status.nack_error,
                        "summary": nack_summary(status.nack_error or ""),
                        "at": at,
                        "state": status.state.value,
                    }
                    for at, node, url, status in latest
                ],
            }
        )

    async def _events(self, request: web.Request) -> web.Response:
        recent = self.recent
        if recent is None:
            return _error(404, "this server keeps no recent events")
        limit = _int_param(request.query, "limit", default=100, low=1, high=recent.size)
        if isinstance(limit, web.Response):
            return limit
        after = _int_param(request.query, "after", default=0, low=0, high=None)
        if isinstance(after, web.Response):
            return after
        # Kept as JSON already: each event is its object with its sequence number put first.
        events = b",".join(b'{"seq":%d,%s' % (seq, line[1:]) for seq, line in recent.since(after, limit=limit))
        body = b'{"events":[%s],"last":%d,"kept":%d,"size":%d}' % (events, recent.last, len(recent), recent.size)
        return web.Response(body=body, content_type="application/json")

    # -- health -------------------------------------------------------------------------------------

    async def _healthz(self, request: web.Request) -> web.Response:
        return _json(
            {"status": "serving", **({"etcd": await self._sources.etcd()} if self._sources.etcd is not None else {})}
        )

    async def _readyz(self, request: web.Request) -> web.Response:
        waiting = self._waiting()
        published = bool(self.cache.groups())
        if not waiting and published:
            return _json({"ready": True})
        reasons = [f"waiting for {what}" for what in waiting]
        if not published and not waiting:
            error = self.reconciler.stats.last_error
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
                "version": version,
                "published_at": progress.published_at,
                "proxies": progress.proxies,
                "acked": progress.acked,
                "current": progress.current,
                "nacked": progress.nacked,
                "last_ack_at": progress.last_ack_at,
                "seconds_to_last_ack": progress.seconds_to_last_ack,
                "summary": f"{version}: {progress.acked} of {progress.proxies}",
            }
        counters = {
            short_type(url): {"responses": c.responses, "acks": c.acks, "nacks": c.nacks}
            for url, c in sorted(self.status.counters.items())
        }
        return _json(
            {
                "groups": groups,
                "connected": self.status.connected(),
                "counters": counters,
                "pending": not self.reconciler.idle,
                "held": self._held_json()["held"],
                "refused": self._refused_json(),
                "rollout": None if self.rollout is None else self.rollout.status(),
                "now": self.status.now(),
            }
        )

    def _refused_json(self) -> dict[str, Any]:
        """What was refused and still is: the latest build (invalid resources, broken references),
        and each source whose latest input could not be read; the last good snapshot serves."""
        stats, readiness = self.reconciler.stats, self.reconciler.readiness
        error = stats.last_error
        return {
            "count": stats.refused,
            "build": None if error is None else {"reason": error.describe(), "at": stats.last_error_at},
            "sources": {
                source: {"reason": reason, "at": at}
                for source, (reason, at) in sorted(readiness.source_problems.items())
            },
        }

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
        index = self._subset_of(node_id)
        for url, current in snapshot.types.items():
            if url == ENDPOINT.url:
                current = snapshot.endpoints_for(index) or current  # its own subsets, if any
            if url == SECRET.url:  # names only: private keys do not leave through the admin API
                resources: list[Any] = [{"name": name, "redacted": True} for name in sorted(current.resources)]
            else:
                resources = orjson.loads(response_json(current.response(None))).get("resources", [])
            types[short_type(url)] = {"version": current.version, "resources": resources}
        subsets = (
            {}
            if snapshot.subsets is None or index is None
            else {"subsets": {"index": index, "services": snapshot.subsets.chosen(index)}}
        )
        return _json({"node": node_id, "group": group, "label": snapshot.label(), **subsets, "types": types})

    # -- the blast-radius guard -----------------------------------------------------------------------

    def _held_json(self) -> dict[str, Any]:
        held = self.reconciler.held
        if held is None:
            return {"held": None}
        return {
            "held": {
                "version": held.snapshot.label(),
                "reasons": list(held.reasons),
                "groups": {group: snapshot.label() for group, snapshot in held.snapshots.items()},
                "confirm": self.reconciler.confirm_hint,
            }
        }

    async def _held(self, request: web.Request) -> web.Response:
        return _json(self._held_json())

    async def _docker_engines(self, request: web.Request) -> web.Response:
        return _json({"engines": [status() for status in self._sources.docker]})

    async def _dns_names(self, request: web.Request) -> web.Response:
        names = self._sources.dns
        return _json({"looked_up": names is not None, "names": [] if names is None else names()})

    async def _confirm(self, request: web.Request) -> web.Response:
        held = self._held_json()
        if self.reconciler.confirm(by=_by(request)) is None:
            return _error(404, "no snapshot is held: nothing to confirm")
        _log.warning("the held snapshot was confirmed through the %s from %s", _by(request), request.remote)
        return _json({"confirmed": held["held"]})

    # -- the rollout ----------------------------------------------------------------------------------

    async def _rollout_status(self, request: web.Request) -> web.Response:
        if self.rollout is None:
            return _error(404, NO_ROLLOUT)
        return _json(self.rollout.status())

    async def _rollout_command(self, request: web.Request) -> web.Response:
        command = request.path.rsplit("/", 1)[-1]
        rollout = self.rollout
        if rollout is None:
            return _error(404, NO_ROLLOUT)
        reason = await _reason(request, command)
        if isinstance(reason, web.Response):
            return reason
        before = rollout.status()
        by = _by(request)
        try:
            if command == "promote":
                rollout.promote(by=by)
            elif command == "pause":
                rollout.pause(by=by)
            elif command == "resume":
                rollout.resume(by=by)
            else:
                rollout.abort(reason, by=by)
        except CommandRefused as exc:
            return _error(409, str(exc))
        _log.warning(
            "rollout %s (candidate %s) through the %s from %s%s",
            command,
            before["candidate"],
            by,
            request.remote,
            f": {reason}" if reason else "",
        )
        return _json({"command": command, "candidate": before["candidate"], "rollout": rollout.status()})

    # -- plans ----------------------------------------------------------------------------------------

    async def _plan(self, request: web.Request) -> web.Response:
        if self._planning:
            return web.Response(
                body=orjson.dumps({"error": "POST /v1/plan: a plan is being made; one at a time: try again shortly"}),
                status=429,
                content_type="application/json",
                headers={"Retry-After": "1"},
            )
        self._planning = True  # before the body is read: at most one proposed file in memory at once
        try:
            return await self._make_plan(request)
        finally:
            # (aiohttp does not cancel a handler whose client left: the slot is held until the build ends)
            self._planning = False

    async def _make_plan(self, request: web.Request) -> web.Response:
        name = request.query.get("name", "")
        if len(name) > MAX_FILTER:
            return _error(400, f"name (the file's name) may have at most {MAX_FILTER} characters, not {len(name)}")
        body = await _bounded_body(request, MAX_PLAN_BODY)
        if isinstance(body, web.Response):
            return body
        label = name or "the proposed file"
        as_json = True if request.content_type == "application/json" else None
        try:
            try:
                state = await asyncio.to_thread(parse_desired, body, label, as_json=as_json)
            except ConfigError as exc:
                plan = Plan(sources=label, problems=exc.problems)
            else:
                plan = await asyncio.to_thread(self.reconciler.planner(FILE_SOURCE, state, label=label))
            rollout = None
            if self.rollout is not None and plan.changed and not plan.problems:
                rollout = self.rollout.would_offer(plan.changed)
        except Exception:  # our bug: say so as JSON (the CLI reads JSON), with the traceback in the log
            _log.exception("planning %s failed", label)
            return _error(500, "internal error while making the plan (see the server's log)")
        answer = plan.to_json(proxies=self.status.connected(), rollout=rollout)
        _log.info("plan of %s from %s: %s", label, request.remote, answer["verdict"])
        return _json(answer)


async def _bounded_body(request: web.Request, limit: int) -> bytes | web.Response:
    """The request's body, read as it arrives and never more than ``limit`` bytes of it (a
    declared length over it is refused before anything is read); a 413 or 408 response when it
    is too large or too slow."""
    where = f"POST {request.path}"
    too_large = _error(
        413, f"{where}: the proposed file may have at most {limit:,} bytes; split the configuration across sources"
    )
    if request.content_length is not None and request.content_length > limit:
        return too_large
    chunks: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(PLAN_READ_SECONDS):
            while chunk := await request.content.read(1 << 16):
                size += len(chunk)
                if size > limit:
                    return too_large
                chunks.append(chunk)
    except TimeoutError:
        return _error(408, f"{where}: the proposed file did not arrive within {PLAN_READ_SECONDS:g} s")
    except (OSError, HttpProcessingError, ClientPayloadError) as exc:  # the client went, or broke the framing
        _log.info("%s from %s: the body did not arrive whole (%s)", where, request.remote, exc)
        return _error(400, f"{where}: the proposed file did not arrive whole ({exc})")
    return b"".join(chunks)


async def start_admin_server(
    api: AdminApi, address: str, *, tls: ssl.SSLContext | None = None, limits: HttpConnectionLimits = ADMIN_CONNECTIONS
) -> tuple[web.AppRunner, str]:
    """Serve ``api`` on ``address`` (``host:port``; port 0 = any free), over TLS when ``tls`` is
    given, holding at most ``limits`` connections; returns the runner (``cleanup()`` stops it)
    and the bound ``host:port``. Warns when not on loopback without tokens."""
    if api.tokens is None:
        warn_if_exposed(split_address(address)[0])
    return await serve_app(api.app(), address, tls=tls, listener=ADMIN_API, limits=limits)


def _int_param(query: Any, name: str, *, default: int, low: int, high: int | None) -> int | web.Response:
    """The integer query parameter ``name`` (``default`` when absent), or a 400 response saying
    what it must be."""
    raw = query.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        value = None
    if value is None or value < low or (high is not None and value > high):
        bound = f"from {low} to {high}" if high is not None else f"at least {low}"
        return _error(400, f"{name} must be a whole number {bound}, not {shorten(raw, 40)!r}")
    return value


def _by(request: web.Request) -> str:
    """Who gave a command, as its event records it: ``admin API``, with the token's name when the
    API has tokens (``admin API (token ops)``)."""
    token = request.get(TOKEN_NAME)
    return "admin API" if token is None else f"admin API (token {token})"


async def _reason(request: web.Request, command: str) -> str | web.Response:
    """An abort's reason, from the query (``reason=``) or the JSON body (``{"reason": ...}``),
    its whitespace collapsed ("" when none); a 400 or 413 response saying what is wrong."""
    where = f"POST {request.path}"
    try:
        raw = await request.read() if request.can_read_body else b""
    except web.HTTPRequestEntityTooLarge:
        return _error(413, f"{where}: the body may have at most {MAX_COMMAND_BODY} bytes")
    given: list[Any] = []
    if "reason" in request.query:
        given.append(request.query["reason"])
    if raw.strip():
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError:
            return _error(400, f'{where}: the body must be JSON, e.g. {{"reason": "..."}}')
        if not isinstance(body, dict) or set(body) - {"reason"}:
            return _error(400, f'{where}: the body is an object with at most "reason", e.g. {{"reason": "..."}}')
        if "reason" in body:
            given.append(body["reason"])
    if not given:
        return ""
    if command != "abort":
        return _error(400, f"{where}: only abort takes a reason")
    if len(given) > 1:
        return _error(400, f"{where}: give the reason once, in the body or the query, not both")
    (reason,) = given
    if not isinstance(reason, str):
        return _error(400, f"{where}: the reason must be a string, not {type(reason).__name__}")
    reason = " ".join(reason.split())
    if len(reason) > MAX_REASON:
        return _error(400, f"{where}: the reason may have at most {MAX_REASON} characters, not {len(reason)}")
    return reason


def _json(body: Any, *, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(body), status=status, content_type="application/json")


def _error(status: int, message: str) -> web.Response:
    return _json({"error": message}, status=status)
