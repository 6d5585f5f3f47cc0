"""``pilotfish serve``: sources -> reconciler -> cache -> xDS, until stopped."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import resource
import signal
import socket
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from pilotfish.api.admin import AdminApi, start_admin_server
from pilotfish.api.metrics import Metrics
from pilotfish.api.registry import RegistryApi
from pilotfish.api.registry_etcd import EtcdRegistry, LeaseGuard
from pilotfish.api.tokens import AdminTokenFile, TokenFile, warn_if_open
from pilotfish.app.settings import ServeSettings
from pilotfish.build.subsetting import IndexTable, ProxyIndices
from pilotfish.cache import SnapshotCache
from pilotfish.errors import ConfigError, Problem
from pilotfish.etcd.client import EtcdClient
from pilotfish.etcd.election import Election
from pilotfish.events import EventLog, RecentEvents
from pilotfish.policy.authorize import NodeAuthorizer
from pilotfish.policy.grants import GrantsFile, SecretGrant, SecretGrants, Subject
from pilotfish.policy.groups import NodeGroups
from pilotfish.reconcile import Reconciler
from pilotfish.resources import SECRET
from pilotfish.resources.bootstrap import split_address
from pilotfish.sources import FileSignature, file_signature, load_desired, watch_file
from pilotfish.sources.etcd import EtcdSource
from pilotfish.sources.registry import Registry
from pilotfish.status import SyncStatus
from pilotfish.subsets.etcd import READY_SOURCE as SUBSETS_READY
from pilotfish.subsets.etcd import BackendIndexWriter, EtcdProxyIndices, SubsetKeys
from pilotfish.subsets.state import STATE_FILE, SubsetState, keep_saving, load_or_start_fresh
from pilotfish.transport.site import (
    ADMIN_API,
    REGISTRY_API,
    REST_XDS,
    XDS,
    check_addresses,
    naming_failures,
    serve_app,
)
from pilotfish.transport.tls import ALPN_H2, ReloadingServerContext
from pilotfish.xds.rest import RestXds, start_rest_server
from pilotfish.xds.server import GrantsInForce, XdsPolicy, XdsServer, start_xds_server

__all__ = ["ServeSettings", "serve"]

_log = logging.getLogger("pilotfish")


async def serve(settings: ServeSettings, *, started: asyncio.Future[int] | None = None) -> None:
    """Serve until SIGINT/SIGTERM (or cancellation). ``started`` receives the bound xDS port.

    Raises :class:`ConfigError` if the snapshot file is invalid at start-up: there is no last
    good configuration to fall back on yet.
    """
    raise_descriptor_limit()
    recent = RecentEvents(settings.recent_events)  # the admin API's /v1/events and status page
    events = EventLog(settings.event_log, level=settings.event_log_level, recent=recent)
    cache = SnapshotCache()
    try:
        groups = NodeGroups(settings.node_groups, rest=settings.rest is not None)
    except ValueError as exc:
        raise ConfigError("--node-group", [Problem("", str(exc))]) from None
    expected = [name for name, configured in (("file", settings.snapshot), ("etcd", settings.etcd)) if configured]
    status = SyncStatus(limits=settings.status_limits)
    confirm_hint = f"kill -USR1 {os.getpid()}"
    state_dir = settings.state_dir or (settings.snapshot.resolve().parent if settings.snapshot else None)
    state_path = state_dir / STATE_FILE if state_dir is not None else None
    kept = load_or_start_fresh(state_path) if state_path is not None else SubsetState({}, IndexTable())
    reconciler = Reconciler(cache, settings=settings.debounce, events=events, expect=expected,
                            guard=settings.guard, confirm_hint=confirm_hint,
                            rules=settings.validate, labels=_source_labels(settings), groups=groups.views(),
                            rest_refresh=settings.rest_refresh, status=status, subset_size=settings.subset_size,
                            subset_tables=kept.backends)
    xds_holder: list[XdsServer] = []  # (the xDS server, made below: told to restart a moved proxy's streams)
    proxy_indices: ProxyIndices | EtcdProxyIndices
    subset_writer: BackendIndexWriter | None = None
    subset_client: EtcdClient | None = None
    if settings.etcd is not None:  # indices shared by every replica, in etcd (no state file)
        state_path = None
        subset_client = EtcdClient(settings.etcd)
        keys = SubsetKeys(settings.etcd_prefix)
        proxy_indices = EtcdProxyIndices(
            subset_client, keys, reconciler, grace=settings.subset_grace, keepalive=settings.etcd_keepalive,
            on_moved=lambda node: _refresh_endpoints(xds_holder, node))
        reconciler.subset_tables_shared = True
        reconciler.expect_after(SUBSETS_READY, "etcd")
        subset_writer = BackendIndexWriter(subset_client, keys, proxy_indices, reconciler,
                                           leading=lambda: election is not None and election.leader)
        reconciler.on_merged = subset_writer.merged
        proxy_indices.on_listed = subset_writer.poke
    else:
        proxy_indices = ProxyIndices(kept.proxies, grace=settings.subset_grace)
    election: Election | None = None
    etcd: EtcdSource | None = None
    reasons = {"etcd": lambda: f"etcd at {settings.etcd}: {etcd.problem if etcd and etcd.problem else 'listing'}",
               SUBSETS_READY: lambda: f"the subsetting indices in etcd at {settings.etcd}: listing"}

    def waiting() -> list[str]:
        return [reasons[name]() if name in reasons else name for name in reconciler.waiting_for()]

    tasks: list[asyncio.Task[None]] = []
    cleanups: list[Callable[[], Awaitable[None]]] = []
    try:
        # A bad tokens file is an error before anything listens (there is no last good one yet).
        tokens = None if settings.registry_tokens is None else TokenFile(settings.registry_tokens, events=events)
        grants_file = None if settings.grants_file is None else GrantsFile(
            settings.grants_file, events=events, mtls=settings.client_ca is not None)
        admin_tokens = None if settings.admin_tokens is None else AdminTokenFile(settings.admin_tokens, events=events)
        loaded = None
        if settings.snapshot is not None:
            loaded = file_signature(settings.snapshot)
            try:
                reconciler.update("file", load_desired(settings.snapshot))
            except ConfigError as exc:
                events.emit("snapshot_error", file=str(settings.snapshot), reason=exc.describe())
                raise
        reconciler.build_now()  # the first snapshot, before any proxy can connect (if every source is in)

        check_addresses([(XDS, settings.xds), (REGISTRY_API, settings.registry), (REST_XDS, settings.rest),
                         (ADMIN_API, settings.admin)])  # every address in use named at once, before any listens
        xds_tls_files = settings.tls_files(client_ca=settings.client_ca, alpn=(ALPN_H2,))
        registry_tls_files = settings.tls_files(client_ca=settings.registry_client_ca, alpn=("http/1.1",))
        admin_tls_files = settings.tls_files(client_ca=settings.admin_client_ca, alpn=("http/1.1",))
        xds_tls = None if xds_tls_files is None else ReloadingServerContext(xds_tls_files, on_event=events.emit,
                                                                            name="xds")
        if settings.authorize_nodes and settings.client_ca is None:
            raise ConfigError("--authorize-node", [Problem("", "node rules bind certificate identities to node "
                                                               "ids: they need mTLS, give --client-ca FILE too")])
        authorize = NodeAuthorizer(settings.authorize_nodes).refusal if settings.authorize_nodes else None
        grants = _secret_grants(settings, cache, () if grants_file is None else grants_file.value)
        policy = XdsPolicy(events=events, status=status, authorize=authorize, grants=GrantsInForce(grants),
                           limits=settings.xds_limits, proxy_indices=proxy_indices)  # gRPC and REST xDS share it
        xds = XdsServer(cache, policy, group_of=groups.group_of)
        xds_holder.append(xds)
        cache.subset_of = proxy_indices.index
        with naming_failures(XDS, settings.xds):
            server, port = await start_xds_server(xds, settings.xds, tls=None if xds_tls is None else xds_tls.context,
                                                  connection_limits=settings.xds_connections)
        cleanups.append(server.stop)  # (stopped gracefully below; this one is for a failed start)
        host = settings.xds.rsplit(":", 1)[0]
        if xds_tls is not None:
            tasks.append(asyncio.create_task(xds_tls.run(every=settings.tls_reload_every), name="xds-tls-reload"))
        if settings.etcd is not None:
            etcd = EtcdSource(settings.etcd, settings.etcd_prefix, on_event=events.emit,
                              on_state=lambda state: reconciler.update("etcd", state),
                              keepalive=settings.etcd_keepalive)
        registry_address = None
        store: EtcdRegistry | None = None
        if settings.registry is not None:
            registry = Registry(clock=time.monotonic, self_preservation=settings.registry_self_preservation,
                                limits=settings.registry_limits)
            store = None if etcd is None else EtcdRegistry(
                etcd, reconciler, limits=settings.registry_limits,
                lease_slack=settings.election_ttl * 4 / 3 + 2 * settings.registry_self_preservation.recheck)
            if store is None:
                _log.warning("the registry keeps registrations in this process's memory: a restart forgets them, "
                             "and other replicas never see them. With --etcd they live in etcd")
            api = RegistryApi(registry, reconciler, events=events, max_body=settings.registry_max_body, tokens=tokens,
                              store=store)
            if tokens is None:
                warn_if_open(split_address(settings.registry)[0])
            registry_tls = None
            if registry_tls_files is not None:
                registry_tls = ReloadingServerContext(registry_tls_files, on_event=events.emit, name="registry")
                tasks.append(asyncio.create_task(registry_tls.run(every=settings.tls_reload_every),
                                                 name="registry-tls-reload"))
            runner, registry_address = await serve_app(
                api.app(), settings.registry, tls=None if registry_tls is None else registry_tls.context,
                listener=REGISTRY_API, limits=settings.registry_connections)
            cleanups.append(runner.cleanup)
            if store is None:
                tasks.append(asyncio.create_task(api.expire_forever(), name="registry-expiry"))
            else:  # on etcd, leases end in etcd; self-preservation runs on the elected replica
                store.guard = LeaseGuard(store, lambda: registry.self_preservation, events=events)
            if tokens is not None:
                tasks.append(asyncio.create_task(tokens.follow(), name="registry-tokens"))
        rest_address = None
        if settings.rest is not None:
            rest_tls_files = settings.tls_files(client_ca=settings.client_ca, alpn=("http/1.1",))
            rest_tls = None
            if rest_tls_files is not None:
                rest_tls = ReloadingServerContext(rest_tls_files, on_event=events.emit, name="rest")
                tasks.append(asyncio.create_task(rest_tls.run(every=settings.tls_reload_every), name="rest-tls-reload"))
            rest = RestXds(cache, policy, group_of=groups.rest_group_of)
            rest_runner, rest_address = await start_rest_server(
                rest, settings.rest, tls=None if rest_tls is None else rest_tls.context,
                limits=settings.rest_connections)
            cleanups.append(rest_runner.cleanup)
        if grants_file is not None:
            def regrant(granted: tuple[SecretGrant, ...]) -> None:
                policy.set_grants(_secret_grants(settings, cache, granted))  # gRPC streams and REST polls

            grants_file.on_change = regrant
            tasks.append(asyncio.create_task(grants_file.follow(), name="grants-file"))
        admin_address = None
        if settings.admin is not None:
            admin_tls = None
            if admin_tls_files is not None:
                admin_tls = ReloadingServerContext(admin_tls_files, on_event=events.emit, name="admin")
                tasks.append(asyncio.create_task(admin_tls.run(every=settings.tls_reload_every),
                                                 name="admin-tls-reload"))
            admin_runner, admin_address = await start_admin_server(
                AdminApi(status, cache, reconciler, waiting=waiting, recent=recent,
                         etcd=None if etcd is None else store.status if store is not None else etcd.status,
                         subset_of=proxy_indices.index, tokens=admin_tokens, events=events,
                         metrics=Metrics(status, reconciler, open_streams=lambda: xds.open_streams,
                                         subset_of=proxy_indices.index)), settings.admin,
                tls=None if admin_tls is None else admin_tls.context, limits=settings.admin_connections)
            cleanups.append(admin_runner.cleanup)
            tls_options = "" if admin_tls is None else " --tls-ca CA-FILE" + (
                " --tls-cert FILE --tls-key FILE" if settings.admin_client_ca is not None else "")
            if admin_tokens is not None:
                tasks.append(asyncio.create_task(admin_tokens.follow(), name="admin-tokens"))
                tls_options += " --token-file FILE"
            reconciler.confirm_hint = (f"pilotfish confirm --admin {admin_address}{tls_options}, "
                                       f"or {confirm_hint}")
        tls = "off" if xds_tls_files is None else "mtls" if settings.client_ca is not None else "tls"
        events.emit("server_started", xds=f"{host}:{port}", registry=registry_address,
                    snapshot=str(settings.snapshot) if settings.snapshot else None, tls=tls,
                    **({"rest": rest_address} if rest_address else {}),
                    **({"admin": admin_address} if admin_address else {}))
        scheme = "http" if registry_tls_files is None else "https"
        _log.info("serving xDS on %s:%d (TLS: %s; at most %d connections, %d per address)%s%s", host, port, tls,
                  server.max_connections, server.max_connections_per_address,
                  f", registry API on {scheme}://{registry_address}" if registry_address else "",
                  f", REST xDS on {'http' if xds_tls_files is None else 'https'}://{rest_address}"
                  if rest_address else "")
        if admin_address:
            scheme = "http" if admin_tls_files is None else "https"
            _log.info("admin API on %s://%s (status page at /; /healthz, /readyz, /v1/proxies, /v1/snapshots, "
                      "/v1/config, /v1/held, /v1/events)", scheme, admin_address)

        if etcd is not None:
            tasks.append(asyncio.create_task(etcd.run(), name="etcd-source"))
            assert isinstance(proxy_indices, EtcdProxyIndices) and subset_writer is not None
            election = _election(settings, events, f"xds {host}:{port}", guard=store.guard if store else None,
                                 writer=subset_writer)
            if store is not None:
                store.election = election
            tasks.append(asyncio.create_task(_campaign(election), name="election"))
            tasks.append(asyncio.create_task(proxy_indices.run(), name="subset-indices"))
            tasks.append(asyncio.create_task(_expire_forever(proxy_indices), name="subset-grace"))
            tasks.append(asyncio.create_task(subset_writer.run(), name="subset-backends"))
        tasks.append(asyncio.create_task(reconciler.run(), name="reconciler"))
        if state_path is not None and isinstance(proxy_indices, ProxyIndices):
            tasks.append(asyncio.create_task(keep_saving(state_path, reconciler, proxy_indices), name="subset-state"))
        tasks.append(asyncio.create_task(_tidy_heap_when_idle(lambda: reconciler.idle), name="gc"))
        if settings.snapshot is not None:
            tasks.append(asyncio.create_task(_follow_file(settings.snapshot, loaded, reconciler, events),
                                             name="file-source"))
        if reconciler.waiting_for():
            tasks.append(asyncio.create_task(_say_what_we_wait_for(reconciler, waiting, events,
                                                                   every=settings.waiting_log_every),
                                             name="waiting"))

        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, stop.set)
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(signal.SIGUSR1, _confirm_held, reconciler)
        # Long-lived objects (the API modules, snapshots, streams) need no cyclic collection; a
        # fan-out allocates many short-lived ones, so collect the young generation less often.
        # _tidy_heap_when_idle keeps freezing what lives on.
        gc.freeze()
        gc.set_threshold(50_000, 20, 100)
        for task in tasks:  # a background task that dies says so at once, not at shutdown
            task.add_done_callback(_report_death)
        if started is not None and not started.done():
            started.set_result(port)
        try:
            await stop.wait()
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):
                with contextlib.suppress(NotImplementedError, RuntimeError):
                    loop.remove_signal_handler(sig)
            await server.stop(settings.grace_seconds)
            events.emit("server_stopped")
    finally:
        for task in tasks:
            task.remove_done_callback(_report_death)
            task.cancel()
        for task in tasks:
            with contextlib.suppress(Exception, asyncio.CancelledError):  # (a death was reported)
                await task
        for cleanup in cleanups:
            await cleanup()
        if subset_client is not None:  # (after the tasks that use it, cancelled above)
            await subset_client.close()
        events.close()


def _secret_grants(settings: ServeSettings, cache: SnapshotCache, from_file: tuple[SecretGrant, ...]) -> SecretGrants:
    """The SDS grants (the flags', then the grants file's), checked against the other settings;
    warns about what they leave open or shut."""
    grants = SecretGrants(settings.secret_grants + from_file)
    if grants.of(Subject.IDENTITY) and settings.client_ca is None:
        raise ConfigError("--grant-secret", [Problem("", "identity: grants name certificate identities: they "
                                                         "need mTLS, give --client-ca FILE too")])
    if grants.of(Subject.NODE) and not settings.authorize_nodes:
        _log.warning("node: grants trust the node id a proxy claims, and without --authorize-node "
                     "any peer that reaches the xDS port can claim any node id and receive these secrets: %s",
                     ", ".join(map(str, grants.of(Subject.NODE))))
    snapshot = cache.snapshot()
    secrets = snapshot.get(SECRET.url) if snapshot is not None else None
    ungranted = grants.ungranted(secrets.resources) if secrets is not None else []
    if ungranted:
        _log.warning("no grant (--grant-secret, --grants-file) covers these secrets: no proxy will receive them: %s",
                     ", ".join(ungranted))
    return grants


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
            _log.warning("could not raise the open-file limit from %d to %d (%s): at most about %d proxies "
                         "can connect; raise it with `ulimit -n` or LimitNOFILE=", soft, target, exc, soft)
            return soft
        _log.info("open-file limit (RLIMIT_NOFILE) raised from %d to %d", soft, target)
        return target
    _log.info("open-file limit (RLIMIT_NOFILE): %d", soft)
    return soft


def _election(settings: ServeSettings, events: EventLog, address: str, *, guard: LeaseGuard | None,
              writer: BackendIndexWriter) -> Election:
    """The election for the singleton duties on etcd: TTL expiry with self-preservation (with the
    registry) and the subsetting backend indices; the duties start and stop with leadership."""
    assert settings.etcd is not None
    guarding: list[asyncio.Task[None]] = []

    def changed(leader: bool) -> None:
        for task in guarding:
            task.cancel()
        guarding.clear()
        if leader and guard is not None:
            guarding.append(asyncio.create_task(guard.run(), name="registry-lease-guard"))
        writer.poke()

    ttl = settings.election_ttl
    return Election(EtcdClient(settings.etcd, timeout=ttl / 3), settings.etcd_prefix.rstrip("/") + ".leader",
                    f"{socket.gethostname()}:{os.getpid()} ({address})", ttl=ttl, on_event=events.emit,
                    on_change=changed)


def _report_death(task: asyncio.Task[None]) -> None:
    """A background task failed while the server runs: our bug (each handles what it expects)."""
    if task.cancelled() or task.exception() is None:
        return  # (some end by design: the wait for sources, once they are in)
    error = task.exception()
    _log.critical("background task %s failed with %r: a bug in pilotfish, please report it; restart this replica",
                  task.get_name(), error, exc_info=error)


def _refresh_endpoints(servers: list[XdsServer], node: str) -> None:
    for server in servers:
        server.refresh_endpoints(node)


async def _campaign(election: Election) -> None:
    try:
        await election.run()
    finally:
        await election.client.close()


async def _expire_forever(indices: EtcdProxyIndices, *, every: float = 1.0) -> None:
    """Free the indices of proxies whose grace period ended."""
    while True:
        await asyncio.sleep(every)
        indices.expire()


def _source_labels(settings: ServeSettings) -> dict[str, str]:
    labels = {"registry": "the registry"}
    if settings.snapshot is not None:
        labels["file"] = str(settings.snapshot)
    if settings.etcd is not None:
        labels["etcd"] = f"etcd at {settings.etcd}"
        labels[SUBSETS_READY] = f"the subsetting indices in etcd at {settings.etcd}"
    return labels


def _confirm_held(reconciler: Reconciler) -> None:
    """SIGUSR1: the operator confirms the snapshot the blast-radius guard holds."""
    if reconciler.confirm(by="signal") is None:
        _log.warning("SIGUSR1: no snapshot is held, nothing to confirm")


async def _follow_file(path: Path, loaded: FileSignature | None, reconciler: Reconciler, events: EventLog,
                       *, retry: float = 1.0) -> None:
    """Feed the file's changes to the reconciler; report every bad one. Supervised: if the watch
    itself fails (e.g. the directory went away), say so and start it again; nothing ends it."""
    while True:
        try:
            async for item in watch_file(path, loaded=loaded):
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
            _log.error("watching %s failed (%r); still serving the last good snapshot, watching again in %.0f s",
                       path, exc, retry)
        loaded = None  # a restarted watch reads the file at once
        await asyncio.sleep(retry)


async def _say_what_we_wait_for(reconciler: Reconciler, waiting: Callable[[], list[str]], events: EventLog,
                                *, first: float = 0.5, every: float = 10.0) -> None:
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


async def _tidy_heap_when_idle(idle: Callable[[], bool], *, every: float = 1.0, young_limit: int = 20_000,
                               full_every: float = 3600.0, busy_after: float = 0.02) -> None:
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
