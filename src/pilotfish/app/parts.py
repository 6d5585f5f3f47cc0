"""The components :func:`pilotfish.app.serve.serve` is made of (see :mod:`pilotfish.app.components`):
the listeners and the TLS context each serves with, the file source, the election and its duties,
the heap tidier, the stop signals, and the ``server_started`` announcement.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import resource
import signal
import socket
import ssl
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Protocol

import orjson

from pilotfish.api.registry_etcd import LeaseGuard
from pilotfish.app.components import Task
from pilotfish.app.settings import EtcdSettings, ServeSettings, XdsSettings
from pilotfish.cache import NodeGroup, SnapshotCache
from pilotfish.errors import ConfigError, Problem
from pilotfish.etcd.client import EtcdClient, EtcdUnavailable, unb64
from pilotfish.etcd.election import Election, Leadership
from pilotfish.events import ANNOUNCE, LOG_FIELDS, EventLog
from pilotfish.policy.grants import SecretGrant, SecretGrants, Subject
from pilotfish.reconcile import Reconciler
from pilotfish.resources import CLUSTER, SECRET, ParseMemo
from pilotfish.rollout.delivery import Delivery
from pilotfish.rollout.stored import Stored, decode, decode_snapshots
from pilotfish.sources import FileSignature, file_signature, load_desired, watch_file
from pilotfish.subsets.etcd import READY_SOURCE as SUBSETS_READY
from pilotfish.subsets.etcd import BackendIndexWriter
from pilotfish.transport.site import XDS, naming_failures
from pilotfish.transport.tls import ReloadingServerContext, TlsFiles
from pilotfish.xds.csds import ClientStatus
from pilotfish.xds.lrs import LoadReporting
from pilotfish.xds.server import XdsServer, start_xds_server

__all__ = [
    "Announcement",
    "ConfirmHint",
    "ElectionDuties",
    "FileSource",
    "HeapTidier",
    "HttpListener",
    "Runner",
    "StopSignals",
    "TlsReload",
    "XdsListener",
    "cluster_names",
    "raise_descriptor_limit",
    "say_what_we_wait_for",
    "secret_grants",
    "source_labels",
    "tidy_heap_when_idle",
    "warn_about_grants",
]

_log = logging.getLogger("pilotfish")
_announce = logging.getLogger(ANNOUNCE)


# -- TLS and the listeners -------------------------------------------------------------------------


class TlsReload:
    """The TLS context of one listener, following its certificate, key and CA files: the
    context is built at :meth:`start` (a bad file is an error then: nothing to fall back on) and
    rebuilt every ``every`` seconds a file changed, without dropping open connections."""

    def __init__(self, name: str, files: TlsFiles, *, events: EventLog, every: float) -> None:
        self.name = f"{name}-tls-reload"
        self._listener = name
        self._files = files
        self._events = events
        self._every = every
        self._reloading: ReloadingServerContext | None = None
        self._task: Task | None = None

    @property
    def context(self) -> ssl.SSLContext:
        assert self._reloading is not None, "started before the listener that serves with it"
        return self._reloading.context

    async def start(self) -> None:
        reloading = self._reloading = ReloadingServerContext(
            self._files, on_event=self._events.emit, name=self._listener
        )
        self._task = Task(self.name, lambda: reloading.run(every=self._every))
        await self._task.start()

    async def stop(self) -> None:
        if self._task is not None:
            await self._task.stop()


class XdsListener:
    """The xDS gRPC server on its address; stopped gracefully (open streams get
    :attr:`XdsSettings.grace` to finish), then ``server_stopped``."""

    name = "xds"

    def __init__(
        self,
        xds: XdsServer,
        settings: XdsSettings,
        *,
        tls: TlsReload | None,
        events: EventLog,
        lrs: LoadReporting | None = None,
        csds: ClientStatus | None = None,
    ) -> None:
        self.xds = xds
        self.lrs = lrs
        """Load reporting, served on the same port."""
        self.csds = csds
        """Client status (CSDS), served on the same port when asked for (``--csds-on-xds``)."""
        self._settings = settings
        self._tls = tls
        self._events = events
        self.port = 0
        self.max_connections = 0
        self.max_connections_per_address = 0
        self._stop: Callable[[float], Awaitable[None]] | None = None

    @property
    def address(self) -> str:
        """``host:port`` as bound (once started)."""
        return f"{self._settings.address.rsplit(':', 1)[0]}:{self.port}"

    async def start(self) -> None:
        with naming_failures(XDS, self._settings.address):
            server, self.port = await start_xds_server(
                self.xds,
                self._settings.address,
                tls=None if self._tls is None else self._tls.context,
                connection_limits=self._settings.connections,
                beside={
                    **({} if self.lrs is None else self.lrs.methods()),
                    **({} if self.csds is None else self.csds.methods()),
                },
            )
        self.max_connections = server.max_connections
        self.max_connections_per_address = server.max_connections_per_address
        self._stop = server.stop

    async def stop(self) -> None:
        if self._stop is not None:
            await self._stop(self._settings.grace)
            self._events.emit("server_stopped")


class Runner(Protocol):
    """What serving an aiohttp app hands back (a ``web.AppRunner``): how to stop it."""

    async def cleanup(self) -> None: ...


class HttpListener:
    """An aiohttp API (registry, REST xDS, admin) on its address: ``serve(tls)`` starts it and
    returns its runner and bound ``host:port``."""

    def __init__(
        self,
        name: str,
        serve: Callable[[ssl.SSLContext | None], Awaitable[tuple[Runner, str]]],
        *,
        tls: TlsReload | None,
    ) -> None:
        self.name = name
        self._serve = serve
        self.tls = tls
        self.address: str | None = None
        """``host:port`` as bound (once started)."""
        self._cleanup: Callable[[], Awaitable[None]] | None = None

    async def start(self) -> None:
        runner, self.address = await self._serve(None if self.tls is None else self.tls.context)
        self._cleanup = runner.cleanup

    async def stop(self) -> None:
        if self._cleanup is not None:
            await self._cleanup()


class ConfirmHint:
    """How the operator confirms a held snapshot, as the reconciler prints it: ``kill -USR1``,
    and once the admin API listens, ``pilotfish confirm`` with the options it needs. Built first
    (the reconciler is given :meth:`text`), told the admin address when that listens."""

    def __init__(self) -> None:
        self.signal = f"kill -USR1 {os.getpid()}"
        self._admin = ""

    def admin_listens(self, address: str, *, tls: bool, mtls: bool, tokens: bool) -> None:
        options = "" if not tls else " --tls-ca CA-FILE" + (" --tls-cert FILE --tls-key FILE" if mtls else "")
        if tokens:
            options += " --token-file FILE"
        self._admin = f"pilotfish confirm --admin {address}{options}, or "

    def text(self) -> str:
        return self._admin + self.signal


def _url(listener: HttpListener | None) -> str:
    if listener is None or listener.address is None:
        return ""
    return f"{'http' if listener.tls is None else 'https'}://{listener.address}"


def startup_block(
    settings: ServeSettings,
    xds: XdsListener,
    *,
    registry: HttpListener | None,
    rest: HttpListener | None,
    admin: HttpListener | None,
) -> tuple[str, dict[str, object]]:
    """What ``serve`` says once everything listens, at any verbosity: one line per address it
    bound (the real ports, when ``:0`` was asked for) and per source; and the same as fields
    (``--log-format json``)."""
    tls = settings.tls.mode
    on_etcd = settings.etcd.address is not None
    bound: list[tuple[str, str, str]] = [
        (
            "xDS",
            xds.address,
            f"gRPC, TLS {tls}; load reports (LRS) too; at most {xds.max_connections} connections, "
            f"{xds.max_connections_per_address} per address",
        )
    ]
    if admin is not None:
        bound.append(("admin API", _url(admin), "the status page at /; /healthz, /readyz, /v1/proxies, /metrics"))
    if registry is not None:
        bound.append(("registry API", _url(registry), "registrations in " + ("etcd" if on_etcd else "memory")))
    if rest is not None:
        bound.append(("REST xDS", _url(rest), "POST /v3/discovery:clusters ..."))
    sources: list[tuple[str, str, str]] = []
    if settings.snapshot is not None:
        sources.append(("file", str(settings.snapshot), "followed as it changes"))
    if settings.etcd.address is not None:
        sources.append(("etcd", settings.etcd.address, f"prefix {settings.etcd.prefix}, watched"))
    if registry is not None:
        sources.append(("registry", _url(registry), "instances registered with TTLs"))
    for engine in settings.docker.engines:
        sources.append(("docker", engine, "labelled containers, followed"))
    rows = [(f"{what} on", where, note) for what, where, note in bound]
    rows += [(f"source {what}", where, note) for what, where, note in sources]
    width = max(len(label) for label, _, _ in rows)
    where_width = max(len(where) for _, where, _ in rows)
    lines = [f"  {label.ljust(width)}  {where.ljust(where_width)}  ({note})" for label, where, note in rows]
    fields: dict[str, object] = {
        "xds": xds.address,
        "tls": tls,
        "admin": None if admin is None else admin.address,
        "registry": None if registry is None else registry.address,
        "rest": None if rest is None else rest.address,
        "sources": [{"kind": what, "at": where} for what, where, _ in sources],
    }
    return f"pilotfish serve started (pid {os.getpid()}):\n" + "\n".join(lines), fields


class Announcement:
    """Once everything listens: the ``server_started`` event and the startup block naming every
    listener and source (:func:`startup_block`)."""

    name = "announcement"

    def __init__(
        self,
        settings: ServeSettings,
        events: EventLog,
        xds: XdsListener,
        *,
        registry: HttpListener | None,
        rest: HttpListener | None,
        admin: HttpListener | None,
        admin_grpc: HttpListener | None = None,
    ) -> None:
        self._settings = settings
        self._admin_grpc = admin_grpc
        self._events = events
        self._xds = xds
        self._registry = registry
        self._rest = rest
        self._admin = admin

    async def start(self) -> None:
        settings, xds = self._settings, self._xds
        registry = None if self._registry is None else self._registry.address
        rest = None if self._rest is None else self._rest.address
        admin = None if self._admin is None else self._admin.address
        admin_grpc = None if self._admin_grpc is None else self._admin_grpc.address
        tls = settings.tls.mode
        self._events.emit(
            "server_started",
            xds=xds.address,
            registry=registry,
            snapshot=str(settings.snapshot) if settings.snapshot else None,
            tls=tls,
            **({"rest": rest} if rest else {}),
            **({"admin": admin} if admin else {}),
            **({"admin_grpc": admin_grpc} if admin_grpc else {}),
        )
        text, fields = startup_block(settings, xds, registry=self._registry, rest=self._rest, admin=self._admin)
        _announce.info("%s", text, extra={LOG_FIELDS: fields})

    async def stop(self) -> None:
        pass


# -- sources ------------------------------------------------------------------------------------------


class FileSource:
    """The snapshot file: read at :meth:`start` (a bad file stops the start: there is no last
    good configuration yet), then followed (:func:`follow_file`)."""

    name = "file-source"

    def __init__(self, path: Path, reconciler: Reconciler, events: EventLog) -> None:
        self._path = path
        self._reconciler = reconciler
        self._events = events
        self._task: Task | None = None
        self._memo = ParseMemo()
        """The file's resources as last parsed: an edit costs the resources it changed."""

    async def start(self) -> None:
        path = self._path
        loaded = file_signature(path)
        memo = self._memo
        try:
            self._reconciler.update("file", load_desired(path, memo=memo))
        except ConfigError as exc:
            self._events.emit("snapshot_error", file=str(path), reason=exc.describe())
            raise
        self._task = Task(self.name, lambda: follow_file(path, loaded, self._reconciler, self._events, memo=memo))
        await self._task.start()

    async def stop(self) -> None:
        if self._task is not None:
            await self._task.stop()


async def follow_file(
    path: Path,
    loaded: FileSignature | None,
    reconciler: Reconciler,
    events: EventLog,
    *,
    retry: float = 1.0,
    memo: ParseMemo | None = None,
) -> None:
    """Feed the file's changes to the reconciler; report every bad one. Supervised: if the watch
    itself fails (e.g. the directory went away), say so and start it again; nothing ends it."""
    while True:
        try:
            async for item in watch_file(path, loaded=loaded, memo=memo):
                if isinstance(item, ConfigError):
                    reconciler.source_error("file", item.describe())
                    events.emit("snapshot_error", file=str(path), reason=item.describe())
                    _log.error("%s\nstill serving the last good snapshot", item.describe())
                else:
                    loaded = None
                    reconciler.update("file", item)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            events.emit("snapshot_error", file=str(path), reason=f"watching the file failed: {exc!r}")
            _log.error(
                "watching %s failed (%r); still serving the last good snapshot, watching again in %.0f s",
                path,
                exc,
                retry,
            )
        loaded = None  # a restarted watch reads the file at once
        await asyncio.sleep(retry)


def source_labels(settings: ServeSettings) -> dict[str, str]:
    """How errors and snapshots name each source."""
    labels = {"registry": "the registry"}
    if settings.snapshot is not None:
        labels["file"] = str(settings.snapshot)
    if settings.etcd.address is not None:
        labels["etcd"] = f"etcd at {settings.etcd.address}"
        labels[SUBSETS_READY] = f"the subsetting indices in etcd at {settings.etcd.address}"
    return labels


async def say_what_we_wait_for(
    reconciler: Reconciler,
    waiting: Callable[[], list[str]],
    events: EventLog,
    *,
    first: float = 0.5,
    every: float = 10.0,
) -> None:
    """Until every source has reported, say which ones are awaited and why: soon after start,
    then every ``every`` seconds. Proxies that connect meanwhile are held (they keep what they have)."""
    loop = asyncio.get_running_loop()
    await asyncio.sleep(first)
    said_at: float | None = None
    while sources := reconciler.waiting_for():
        if said_at is None or loop.time() - said_at >= every:
            why = waiting()
            events.emit("waiting_for_sources", sources=sources, reasons=why)
            _log.warning("not serving any configuration yet: waiting for %s", "; ".join(why))
            said_at = loop.time()
        await asyncio.sleep(0.1)
    if said_at is not None:
        _log.warning("every source has reported: serving")


# -- policy -----------------------------------------------------------------------------------------


def cluster_names(cache: SnapshotCache, group: NodeGroup) -> list[str]:
    """The names of the clusters ``group`` is served (what a client that cannot be told "all"
    reports load on)."""
    snapshot = cache.snapshot(group)
    clusters = snapshot.get(CLUSTER.url) if snapshot is not None else None
    return [] if clusters is None else sorted(clusters.resources)


def secret_grants(settings: ServeSettings, from_file: tuple[SecretGrant, ...]) -> SecretGrants:
    """The SDS grants: the flags', then the grants file's (both checked where they are read)."""
    return SecretGrants(settings.policy.secret_grants + from_file)


def warn_about_grants(settings: ServeSettings, grants: SecretGrants, cache: SnapshotCache) -> None:
    """Say what ``grants`` leave open (node: grants without node rules) or shut (secrets of the
    current snapshot that no grant covers)."""
    if grants.of(Subject.NODE) and not settings.policy.authorize_nodes:
        _log.warning(
            "node: grants trust the node id a proxy claims, and without --authorize-node "
            "any peer that reaches the xDS port can claim any node id and receive these secrets: %s",
            ", ".join(map(str, grants.of(Subject.NODE))),
        )
    snapshot = cache.snapshot()
    secrets = snapshot.get(SECRET.url) if snapshot is not None else None
    ungranted = grants.ungranted(secrets.resources) if secrets is not None else []
    if ungranted:
        _log.warning(
            "no grant (--grant-secret, --grants-file) covers these secrets: no proxy will receive them: %s",
            ", ".join(ungranted),
        )


# -- the election -------------------------------------------------------------------------------------


class ElectionDuties:
    """The election for the singleton duties on etcd (TTL expiry with self-preservation, with the
    registry; the subsetting backend indices): campaigns from :meth:`start` (the replica is named
    by its bound xDS address, ``identity()``), and starts and stops the duties with leadership.
    ``leadership`` answers for it to those built before it (the registry's store, the writer)."""

    name = "election"

    def __init__(
        self,
        settings: EtcdSettings,
        events: EventLog,
        leadership: Leadership,
        *,
        identity: Callable[[], str],
        guard: LeaseGuard | None,
        writer: BackendIndexWriter,
    ) -> None:
        assert settings.address is not None
        self._settings = settings
        self._events = events
        self._leadership = leadership
        self._identity = identity
        self._guard = guard
        self._writer = writer
        self._guarding: list[asyncio.Task[None]] = []
        self._task: Task | None = None

    def _changed(self, leader: bool) -> None:
        for task in self._guarding:
            task.cancel()
        self._guarding.clear()
        if leader and self._guard is not None:
            self._guarding.append(asyncio.create_task(self._guard.run(), name="registry-lease-guard"))
        self._writer.poke()

    async def start(self) -> None:
        settings = self._settings
        assert settings.address is not None
        ttl = settings.election_ttl
        election = Election(
            EtcdClient(settings.address, timeout=ttl / 3),
            settings.prefix.rstrip("/") + ".leader",
            f"{socket.gethostname()}:{os.getpid()} ({self._identity()})",
            ttl=ttl,
            on_event=self._events.emit,
            on_change=self._changed,
            leadership=self._leadership,
        )

        async def campaign() -> None:
            try:
                await election.run()
            finally:
                await election.client.close()

        self._task = Task(self.name, campaign)
        await self._task.start()

    async def stop(self) -> None:
        if self._task is not None:
            await self._task.stop()
        for task in self._guarding:
            task.cancel()


# -- the process ------------------------------------------------------------------------------------


class StopSignals:
    """SIGINT and SIGTERM set :attr:`stopped`; SIGUSR1 confirms the snapshot the guard holds."""

    name = "signals"

    def __init__(self, reconciler: Reconciler) -> None:
        self._reconciler = reconciler
        self.stopped = asyncio.Event()

    def _confirm_held(self) -> None:
        if self._reconciler.confirm(by="signal") is None:
            _log.warning("SIGUSR1: no snapshot is held, nothing to confirm")

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, self.stopped.set)
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(signal.SIGUSR1, self._confirm_held)

    async def stop(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.remove_signal_handler(sig)


class HeapTidier:
    """Long-lived objects (the API modules, snapshots, streams) need no cyclic collection; a
    fan-out allocates many short-lived ones, so collect the young generation less often, and
    keep freezing what lives on (:func:`tidy_heap_when_idle`)."""

    name = "gc"

    def __init__(self, idle: Callable[[], bool]) -> None:
        self._task = Task(self.name, lambda: tidy_heap_when_idle(idle))

    async def start(self) -> None:
        await self._task.start()
        gc.freeze()
        gc.set_threshold(50_000, 20, 100)

    async def stop(self) -> None:
        await self._task.stop()


async def tidy_heap_when_idle(
    idle: Callable[[], bool],
    *,
    every: float = 1.0,
    young_limit: int = 20_000,
    full_every: float = 3600.0,
    busy_after: float = 0.02,
) -> None:
    """Keep cyclic GC pauses off the path of a change.

    A GC pass costs time in proportion to the objects it looks at, and thousands of streams are
    hundreds of thousands of long-lived objects: left to itself, a collection that happens to
    start during a fan-out stalls it for tens of milliseconds (measured: 40 ms at 1,000 proxies).
    So when nothing is waiting to be built and the event loop is not busy, freeze what exists
    (``gc.freeze``: constant time), so that later passes look only at newer objects; first, if
    the youngest generation is small enough for it to be quick, collect it. Streams leave no
    reference cycles behind, so little garbage is frozen; once every ``full_every`` seconds, at
    such a moment, everything is unfrozen and collected (at 10,000 streams, a pause of a few
    hundred milliseconds), so none stays for long. The loop counts as busy when a sleep of
    ``every`` overshot by more than ``busy_after``.
    """
    loop = asyncio.get_running_loop()
    last_full = loop.time()
    while True:
        start = loop.time()
        await asyncio.sleep(every)
        if loop.time() - start > every + busy_after or not idle():
            continue  # the loop is busy, or a build is coming: not now
        if loop.time() - last_full >= full_every:
            gc.unfreeze()
            gc.collect()
            last_full = loop.time()
        elif gc.get_count()[0] <= young_limit:  # about the size of the youngest generation
            gc.collect(0)
        gc.freeze()


def raise_descriptor_limit() -> int:
    """Raise this process's open-file soft limit (RLIMIT_NOFILE) to its hard limit, as servers
    do: each proxy holds a connection, and the usual soft limit of 1,024 would refuse proxies
    long before memory or CPU runs out. Logs and returns the limit in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard
    if hard == resource.RLIM_INFINITY:
        target = 1 << 20  # Linux refuses an infinite soft limit (above fs.nr_open)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError) as exc:
            _log.warning(
                "could not raise the open-file limit from %d to %d (%s): at most about %d proxies "
                "can connect; raise it with `ulimit -n` or LimitNOFILE=",
                soft,
                target,
                exc,
                soft,
            )
            return soft
        _log.info("open-file limit (RLIMIT_NOFILE) raised from %d to %d", soft, target)
        return target
    _log.info("open-file limit (RLIMIT_NOFILE): %d", soft)
    return soft


async def drive_rollout(delivery: Delivery, *, health_every: float, every: float = 1.0) -> None:
    """Run the rollout's timers: tick it at its deadline (an ACK timeout, the end of a bake), at
    least every ``every`` seconds, and while a wave bakes every ``health_every`` seconds (its
    health gate reads the load store, which costs more than a timer)."""
    while True:
        step = health_every if delivery.baking else every
        deadline = delivery.deadline()
        if deadline is not None:
            step = min(step, deadline - time.time())
        await asyncio.sleep(max(step, 0.01))
        delivery.tick()


def load_rollout(path: Path | None) -> Stored | None:
    """The rollout kept in ``path`` (None: no file, or no path); ConfigError naming the file when
    it cannot be read: a rollout's held candidates must not be forgotten by accident."""
    if path is None:
        return None
    try:
        return decode(orjson.loads(path.read_bytes()), where=str(path))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        message = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ConfigError(
            str(path),
            [
                Problem(
                    "",
                    f"the kept rollout cannot be read ({message}); move it away to start again from the "
                    "next change as the baseline (its held candidates would be forgotten)",
                )
            ],
        ) from None


async def keep_rollout(path: Path, delivery: Delivery, *, every: float = 1.0) -> None:
    """Write the rollout to ``path`` (atomically) whenever it changed, at most once per ``every``
    seconds, and a last time when stopped."""
    saved = -1

    def save() -> None:
        nonlocal saved
        if delivery.changes == saved:
            return
        changes = delivery.changes
        temporary = path.with_name(path.name + ".tmp")
        try:
            temporary.write_bytes(orjson.dumps(delivery.stored()))
            os.replace(temporary, path)
        except OSError as exc:
            _log.error("could not write the rollout to %s: %s (retrying)", path, exc)
            return
        saved = changes

    try:
        while True:
            save()
            await asyncio.sleep(every)
    finally:
        save()


ROLLOUT_CHUNK = 512 * 1024
"""Characters per etcd value of a stored baseline (etcd refuses requests over 1.5 MiB by default)."""


class Deciding:
    """Whether this replica decides the rollout: made before the delivery that asks it, set by the
    :class:`ReplicatedRollout` that takes the decisions over (after reading the stored ones)."""

    def __init__(self) -> None:
        self.now = False

    def __call__(self) -> bool:
        return self.now


class ReplicatedRollout:
    """``serve --rollout --etcd``: the elected replica decides the rollout and stores it in etcd;
    every other replica serves from what is stored and reports its own proxies' sends, ACKs and
    NACKs there for the elected one to count (docs/rollout.md, "Replicas").

    Keys, beside the etcd prefix (like the election's ``<prefix>.leader``): ``<prefix>.rollout``
    (the machine's state and the baseline's change id), ``<prefix>.rollout.baseline.<id>.<n>``
    (the baseline's resources, in chunks) and ``<prefix>.rollout.replica.<replica>`` (a replica's
    report, written when it changed and every ``heartbeat`` seconds, with the load its proxies
    reported to it lately; one older than ``stale`` is taken as gone). Each replica looks every ``every`` seconds."""

    name = "rollout-etcd"

    def __init__(
        self,
        client: EtcdClient,
        prefix: str,
        delivery: Delivery,
        leadership: Leadership,
        deciding: Deciding,
        *,
        replica: Callable[[], str],
        every: float = 0.25,
        heartbeat: float = 2.0,
        stale: float = 6.0,
    ) -> None:
        self._client = client
        self._base = prefix.rstrip("/") + ".rollout"
        self._delivery = delivery
        self._leadership = leadership
        self._deciding = deciding
        self._replica = replica
        self._every, self._heartbeat, self._stale = every, heartbeat, stale
        self._leading = False
        self._state_revision = 0
        self._stored = -1  # delivery.changes when its state was last stored
        self._stored_baseline: str | None = None
        self._reported: tuple[str, float] = ("", 0.0)
        self._reports: dict[str, int] = {}  # replica -> mod revision of its report taken
        self._changed = asyncio.Event()
        delivery.on_change(self._changed.set)  # a decision is stored at once, not at the next look
        self._warned = 0.0
        self._task: Task | None = None

    async def start(self) -> None:
        """Read the stored rollout before anything is built (a replica must not serve a guess), then
        follow it."""
        try:
            await self._follow_state()
        except EtcdUnavailable as exc:
            _log.error("the rollout stored in etcd could not be read (%s): serving nothing until it is", exc)
        self._task = Task(self.name, self._run)
        await self._task.start()

    async def stop(self) -> None:
        if self._task is not None:
            await self._task.stop()
        if self._leading:  # what was decided last (an operator's command a moment ago) is not lost
            with contextlib.suppress(EtcdUnavailable):
                await self._store()
        await self._client.close()

    async def _run(self) -> None:
        while True:
            try:
                await self._turn()
            except (EtcdUnavailable, ValueError) as exc:
                now = time.monotonic()
                if now - self._warned > 10:
                    self._warned = now
                    _log.error("the rollout in etcd: %s (retrying)", exc)
            with contextlib.suppress(TimeoutError):  # a decision is stored at once, else look again soon
                await asyncio.wait_for(self._changed.wait(), self._every)
            self._changed.clear()

    async def _turn(self) -> None:
        leader = self._leadership.leader
        if leader and not self._leading:
            await self._follow_state()  # the last decisions stored, then this replica's own
            self._leading = self._deciding.now = True
            self._delivery.take_over()
            status = self._delivery.machine.status()
            _log.warning(
                "this replica now decides the rollout: phase %s, candidate %s, wave %s",
                status["phase"],
                status["candidate"],
                status["wave"],
            )
        elif not leader:
            self._leading = self._deciding.now = False
        if self._leading:
            await self._store()
            await self._absorb_reports()
        else:
            await self._follow_state()
            await self._report()

    async def _follow_state(self) -> None:
        kvs = (await self._client.range(self._base)).get("kvs", [])
        if not kvs:
            return
        revision = int(kvs[0].get("mod_revision", 0))
        if revision == self._state_revision:
            return
        document = orjson.loads(unb64(kvs[0].get("value", "")))
        baseline_id = document.get("baseline")
        baseline = None
        if baseline_id is not None and self._delivery.baseline_change != baseline_id:
            chunks = [
                await self._client.get(f"{self._base}.baseline.{baseline_id}.{n}") for n in range(document["chunks"])
            ]
            if any(chunk is None for chunk in chunks):
                return  # (being written: looked at again next turn)
            baseline = decode_snapshots(orjson.loads("".join(c or "" for c in chunks)), where=f"etcd {self._base}")
        self._delivery.adopt(document["machine"], baseline)
        self._state_revision = revision

    async def _store(self) -> None:
        delivery = self._delivery
        if delivery.changes == self._stored:
            return
        changes = delivery.changes
        baseline = delivery.baseline_change
        chunks = 0
        if baseline is not None:
            text = orjson.dumps(delivery.baseline_document()).decode()
            chunks = max(1, -(-len(text) // ROLLOUT_CHUNK))
            if baseline != self._stored_baseline:
                for n in range(chunks):
                    await self._client.put(
                        f"{self._base}.baseline.{baseline}.{n}", text[n * ROLLOUT_CHUNK : (n + 1) * ROLLOUT_CHUNK]
                    )
        document = {
            "machine": delivery.machine.to_dict(),
            "baseline": baseline,
            "chunks": chunks,
            "by": self._replica(),
        }
        self._state_revision = await self._client.put(self._base, orjson.dumps(document).decode())
        if baseline != self._stored_baseline and self._stored_baseline is not None:
            await self._client.delete(prefixes=(f"{self._base}.baseline.{self._stored_baseline}.",))
        self._stored_baseline, self._stored = baseline, changes

    async def _report(self) -> None:
        report = self._delivery.report()
        text = orjson.dumps({k: v for k, v in report.items() if k != "at"}).decode()
        now = time.monotonic()
        if text == self._reported[0] and now - self._reported[1] < self._heartbeat:
            return
        load = self._delivery.load_report()  # (new load is reported at heartbeats, not at every look)
        if load is not None:
            report["load"] = load
        await self._client.put(f"{self._base}.replica.{self._replica()}", orjson.dumps(report).decode())
        self._reported = (text, now)

    async def _absorb_reports(self) -> None:
        prefix = f"{self._base}.replica."
        kvs = (await self._client.range(prefix, prefix=True)).get("kvs", [])
        own, seen, now = self._replica(), set(), time.time()
        for kv in kvs:
            replica = unb64(kv["key"])[len(prefix) :]
            if replica == own:
                continue
            report = orjson.loads(unb64(kv.get("value", "")))
            if now - float(report.get("at", 0)) > self._stale:
                continue  # its replica is gone (or stalled): its proxies count as disconnected
            seen.add(replica)
            revision = int(kv.get("mod_revision", 0))
            if self._reports.get(replica) != revision:
                self._reports[replica] = revision
                self._delivery.absorb(replica, report)
        for replica in set(self._reports) - seen:
            del self._reports[replica]
            self._delivery.absorb(replica, None)
