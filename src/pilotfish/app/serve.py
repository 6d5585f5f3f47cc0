"""``pilotfish serve``: sources -> reconciler -> cache -> xDS, until stopped.

:func:`serve` builds every object from its part of :class:`ServeSettings` (:func:`_build`:
constructors only, each given its collaborators), then runs the list of components it made
(:mod:`pilotfish.app.components`: started in order, stopped in reverse) until SIGINT or SIGTERM.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import secrets
import socket
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pilotfish.api.admin import AdminApi, SourceStatus, start_admin_server
from pilotfish.api.metrics import DockerMetrics, Metrics, NameMetrics, RefreshMetrics
from pilotfish.api.registry import RegistryApi
from pilotfish.api.registry_etcd import EtcdRegistry
from pilotfish.api.tokens import AdminTokenFile, TokenFile, grpc_read_check, warn_if_open
from pilotfish.app.components import Component, Step, Task, running
from pilotfish.app.parts import (
    Announcement,
    ConfirmHint,
    Deciding,
    ElectionDuties,
    FileSource,
    HeapTidier,
    HttpListener,
    ReplicatedRollout,
    Runner,
    StopSignals,
    TlsReload,
    XdsListener,
    cluster_names,
    drive_rollout,
    keep_rollout,
    load_rollout,
    raise_descriptor_limit,
    say_what_we_wait_for,
    secret_grants,
    source_labels,
    warn_about_grants,
)
from pilotfish.app.settings import AdminSettings, RegistrySettings, RestSettings, ServeSettings
from pilotfish.build.subsetting import IndexTable, ProxyIndices
from pilotfish.cache import SnapshotCache
from pilotfish.errors import ConfigError, Problem
from pilotfish.etcd.client import EtcdClient
from pilotfish.etcd.election import Leadership
from pilotfish.events import EventLog, RecentEvents
from pilotfish.policy.authorize import NodeAuthorizer
from pilotfish.policy.grants import GrantsFile, SecretGrant
from pilotfish.policy.groups import NodeGroups
from pilotfish.reconcile import BuildOptions, Reconciler, SubsetOptions
from pilotfish.resources.bootstrap import split_address
from pilotfish.rollout.delivery import Delivery
from pilotfish.rollout.load import LoadStore
from pilotfish.rollout.stored import STATE_FILE as ROLLOUT_FILE
from pilotfish.sources.docker import DockerSource, client_tls
from pilotfish.sources.etcd import EtcdSource
from pilotfish.sources.registry import Registry
from pilotfish.status import SyncStatus
from pilotfish.subsets.etcd import READY_SOURCE as SUBSETS_READY
from pilotfish.subsets.etcd import BackendIndexWriter, EtcdProxyIndices, SubsetKeys
from pilotfish.subsets.state import STATE_FILE, SubsetState, keep_saving, load_or_start_fresh
from pilotfish.transport.aio import ConnectionLimits, GrpcServer
from pilotfish.transport.site import (
    ADMIN_API,
    ADMIN_GRPC,
    REGISTRY_API,
    REST_XDS,
    XDS,
    check_addresses,
    naming_failures,
    serve_app,
)
from pilotfish.transport.tls import ALPN_H2
from pilotfish.xds.csds import ClientStatus
from pilotfish.xds.lrs import LoadReporting
from pilotfish.xds.rest import RestXds, start_rest_server
from pilotfish.xds.server import GrantsInForce, XdsPolicy, XdsServer

__all__ = ["ServeSettings", "raise_descriptor_limit", "serve"]

_log = logging.getLogger("pilotfish")


async def serve(settings: ServeSettings, *, started: asyncio.Future[int] | None = None) -> None:
    """Serve until SIGINT/SIGTERM (or cancellation). ``started`` receives the bound xDS port.

    Raises :class:`ConfigError` if the settings contradict each other
    (:meth:`ServeSettings.validate`), or a file (the snapshot, a tokens or grants file, a
    certificate) is invalid at start-up: there is no last good configuration to fall back on yet.
    """
    settings.validate()
    raise_descriptor_limit()
    recent = RecentEvents(settings.events.recent)  # the admin API's /v1/events and status page
    events = EventLog(settings.events.log, level=settings.events.level, recent=recent)
    try:
        process = _build(settings, events, recent)
        async with running(process.components):
            if started is not None and not started.done():
                started.set_result(process.xds.port)
            await process.signals.stopped.wait()
    finally:
        events.close()


@dataclass(frozen=True, slots=True)
class _Process:
    components: list[Component]
    """In the order they start."""
    xds: XdsListener
    signals: StopSignals


def _build(settings: ServeSettings, events: EventLog, recent: RecentEvents) -> _Process:
    """Every object of the process, and the components that run them, in start order."""
    try:
        groups = NodeGroups(settings.policy.node_groups, rest=settings.rest.address is not None)
    except ValueError as exc:
        raise ConfigError("--node-group", [Problem("", str(exc))]) from None
    status = SyncStatus(limits=settings.status_limits)
    on_etcd = settings.etcd.address is not None
    state_dir = settings.subsets.state_dir or (settings.snapshot.resolve().parent if settings.snapshot else None)
    state_path = state_dir / STATE_FILE if state_dir is not None else None
    kept = load_or_start_fresh(state_path) if state_path is not None else SubsetState({}, IndexTable())
    leadership = Leadership()  # (the election needs the bound xDS address: it is made once that listens)

    subsets: list[Component] = []
    proxy_indices: ProxyIndices | EtcdProxyIndices
    writer: BackendIndexWriter | None = None
    if settings.etcd.address is not None:  # indices shared by every replica, in etcd (no state file)
        client = EtcdClient(settings.etcd.address)
        keys = SubsetKeys(settings.etcd.prefix)
        proxy_indices = EtcdProxyIndices(client, keys, grace=settings.subsets.grace, keepalive=settings.etcd.keepalive)
        writer = BackendIndexWriter(client, keys, leading=lambda: leadership.leader, default_size=settings.subsets.size)
    else:
        proxy_indices = ProxyIndices(kept.proxies, grace=settings.subsets.grace)
    cache = SnapshotCache(subset_of=proxy_indices.index)
    # Load reports on the xDS port, kept for the rollout's health gates (LoadStore bounds them).
    rollout = settings.rollout.settings()
    load = LoadStore(  # (counted by the proxy's wave, which its node id and group fix)
        settings.rollout.load_settings(),
        clock=time.time,
        classify=(lambda _node, _group: 0) if rollout is None else rollout.waves.assign,
    )
    deciding = Deciding()  # (on etcd: the elected replica decides, once it has read what is stored)
    replica_name = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"  # (two in a process: tests)
    # A single server keeps its rollout in the state directory (held candidates, the baseline).
    rollout_path = state_dir / ROLLOUT_FILE if rollout is not None and state_dir is not None and not on_etcd else None
    delivery = (
        None
        if rollout is None
        else Delivery(
            cache,
            rollout,
            status=status,
            events=events,
            loads=load if rollout.health else None,
            restored=load_rollout(rollout_path),
            deciding=deciding if on_etcd else None,
        )
    )  # between the reconciler and the cache: which proxies get each change
    hint = ConfirmHint()
    expected = [
        name for name, configured in (("file", settings.snapshot), ("etcd", settings.etcd.address)) if configured
    ] + [engine.source for engine in settings.docker.parsed()]
    reconciler = Reconciler(
        cache if delivery is None else delivery,
        settings=settings.debounce,
        events=events,
        expect=expected,
        guard=settings.guard,
        confirm_hint=hint.text,
        status=status,
        build=BuildOptions(
            groups=groups.views(),
            rules=settings.validate_rules,
            labels=source_labels(settings),
            rest_refresh=settings.rest.refresh,
            # Proxyless gRPC clients report load only for clusters that ask them to: the health
            # gate is the reports' one reader, so they are asked when it is on.
            grpc_load_reports=rollout is not None and rollout.health is not None,
            names=settings.dns,
        ),
        subsets=SubsetOptions(
            size=settings.subsets.size,
            tables=kept.backends,
            shared=on_etcd,
            ready_after={SUBSETS_READY: "etcd"} if on_etcd else None,
            on_merged=None if writer is None else writer.merged,
        ),
    )

    # A bad tokens or grants file is an error before anything listens (there is no last good one yet).
    registry_tokens = None if settings.registry.tokens is None else TokenFile(settings.registry.tokens, events=events)
    grants_file = (
        None
        if settings.policy.grants_file is None
        else GrantsFile(settings.policy.grants_file, events=events, mtls=settings.tls.client_ca is not None)
    )
    admin_tokens = None if settings.admin.tokens is None else AdminTokenFile(settings.admin.tokens, events=events)
    etcd = (
        None
        if settings.etcd.address is None
        else EtcdSource(
            settings.etcd.address,
            settings.etcd.prefix,
            on_event=events.emit,
            on_state=lambda state: reconciler.update("etcd", state),
            keepalive=settings.etcd.keepalive,
        )
    )

    docker_tls = (
        client_tls(
            *(
                None if f is None else str(f)
                for f in (settings.docker.tls_ca, settings.docker.tls_cert, settings.docker.tls_key)
            )
        )
        if settings.docker.uses_tls
        else None
    )
    dockers = [
        DockerSource(
            engine,
            on_state=functools.partial(reconciler.update, engine.source),
            on_event=events.emit,
            tls=docker_tls,
        )
        for engine in settings.docker.parsed()
    ]

    authorize = NodeAuthorizer(settings.policy.authorize_nodes).refusal if settings.policy.authorize_nodes else None
    grants = secret_grants(settings, () if grants_file is None else grants_file.value)
    policy = XdsPolicy(
        events=events,
        status=status,
        authorize=authorize,
        grants=GrantsInForce(grants),
        limits=settings.xds.limits,
        proxy_indices=proxy_indices,
    )  # gRPC and REST xDS share it
    xds = XdsServer(cache, policy, group_of=groups.group_of, routing=delivery)
    tls = settings.tls

    def tls_reload(name: str, client_ca: Path | None, alpn: tuple[str, ...]) -> TlsReload | None:
        files = tls.files(client_ca=client_ca, alpn=alpn)
        return None if files is None else TlsReload(name, files, events=events, every=tls.reload_every)

    xds_tls = tls_reload("xds", tls.client_ca, (ALPN_H2,))
    lrs = LoadReporting(
        load,
        settings=settings.xds.lrs,
        authorize=authorize,
        limits=settings.xds.limits,
        clusters_for=lambda node: cluster_names(cache, groups.group_of(node)),
        group_of=groups.group_of,
    )
    # (The admin API's tokens are not asked here: --csds-on-xds opens it to the port.)
    csds = ClientStatus(status, resources=xds.resource_states)
    xds_listener = XdsListener(
        xds, settings.xds, tls=xds_tls, events=events, lrs=lrs, csds=csds if settings.xds.csds else None
    )
    listening: list[Component | None] = [xds_tls, xds_listener]

    store = (
        None
        if etcd is None or settings.registry.address is None
        else EtcdRegistry(
            etcd,
            reconciler,
            limits=settings.registry.limits,
            election=leadership,
            events=events,
            self_preservation=lambda: settings.registry.self_preservation,
            lease_slack=settings.etcd.election_ttl * 4 / 3 + 2 * settings.registry.self_preservation.recheck,
        )
    )
    registry = _registry(
        settings.registry,
        reconciler,
        events,
        store=store,
        tokens=registry_tokens,
        tls=tls_reload("registry", tls.registry_client_ca, ("http/1.1",)),
    )
    listening += registry.components

    rest: RestXds | None = None
    rest_listener = None
    if settings.rest.address is not None:
        rest = RestXds(cache, policy, group_of=groups.rest_group_of)
        rest_listener = _rest(settings.rest, rest, tls=tls_reload("rest", tls.client_ca, ("http/1.1",)))
        listening += rest_listener.components

    if grants_file is not None:

        def regrant(granted: tuple[SecretGrant, ...]) -> None:
            new = secret_grants(settings, granted)
            warn_about_grants(settings, new, cache)
            policy.set_grants(new)  # gRPC streams and REST polls

        followed = grants_file
        listening.append(Task("grants-file", lambda: followed.follow(on_change=regrant)))

    admin = None
    if settings.admin.address is not None:
        admin_api = AdminApi(
            status,
            cache,
            reconciler,
            waiting=_waiting(settings, reconciler, etcd, dockers),
            recent=recent,
            sources=SourceStatus(
                etcd=None if etcd is None else store.status if store is not None else etcd.status,
                docker=[source.status for source in dockers],
                dns=reconciler.names.status if settings.dns.refresh > 0 else None,
            ),
            tokens=admin_tokens,
            events=events,
            rollout=delivery,
            metrics=Metrics(
                status,
                reconciler,
                cache=cache,
                open_streams=lambda: xds.open_streams,
                subset_of=proxy_indices.index,
                lrs=lrs,
                rollout=delivery,
                registry=None if registry.api is None else registry.api.figures,
                sources=[
                    RefreshMetrics(lambda: xds.heartbeats.sent),
                    *([DockerMetrics([source.figures for source in dockers])] if dockers else []),
                    *([NameMetrics(reconciler.names.figures)] if settings.dns.refresh > 0 else []),
                ],
            ),
        )
        admin = _admin(
            settings.admin,
            admin_api,
            hint,
            tokens=admin_tokens,
            tls=tls_reload("admin", tls.admin_client_ca, ("http/1.1",)),
            mtls=tls.admin_client_ca is not None,
        )
        listening += admin.components
    admin_grpc = None
    if settings.admin.grpc_address is not None:
        admin_grpc = _admin_grpc(
            settings.admin,
            ClientStatus(
                status,
                authorize=grpc_read_check(admin_tokens, what="CSDS on the admin gRPC port"),
                resources=xds.resource_states,
            ),
            tls=tls_reload("admin-grpc", tls.admin_client_ca, (ALPN_H2,)),
        )
        listening += admin_grpc.components

    if etcd is not None:
        assert isinstance(proxy_indices, EtcdProxyIndices) and writer is not None
        indices, backends = proxy_indices, writer
        subsets += [
            Task("etcd-source", etcd.run),
            ElectionDuties(
                settings.etcd,
                events,
                leadership,
                identity=lambda: f"xds {xds_listener.address}",
                guard=None if store is None else store.guard,
                writer=backends,
            ),
            Step("subset-client", stop=client.close),  # (stopped after the tasks that use it)
            Task(
                "subset-indices",
                lambda: indices.run(reconciler, on_moved=xds.refresh_endpoints, on_listed=backends.poke),
            ),
            Task("subset-grace", lambda: _expire_forever(indices)),
            Task("subset-backends", lambda: backends.run(indices)),
        ]
    elif state_path is not None and isinstance(proxy_indices, ProxyIndices):
        path, local = state_path, proxy_indices
        subsets.append(Task("subset-state", lambda: keep_saving(path, reconciler.tables, local)))

    signals = StopSignals(reconciler)
    components: list[Component | None] = [
        None if settings.snapshot is None else FileSource(settings.snapshot, reconciler, events),
        *(Task(f"docker {source.engine.url}", source.run) for source in dockers),
        # The first snapshot, before any proxy can connect (if every source is in).
        # On etcd, what the elected replica stored of the rollout is read before anything is built.
        None
        if delivery is None or settings.etcd.address is None
        else ReplicatedRollout(
            EtcdClient(settings.etcd.address),
            settings.etcd.prefix,
            delivery,
            leadership,
            deciding,
            replica=lambda: replica_name,
        ),
        Step("first-build", start=reconciler.build_now),
        Step("grant-warnings", start=lambda: warn_about_grants(settings, grants, cache)),
        Step(
            "addresses",
            start=lambda: check_addresses(
                [  # every address in use named at once, before any listens
                    (XDS, settings.xds.address),
                    (REGISTRY_API, settings.registry.address),
                    (REST_XDS, settings.rest.address),
                    (ADMIN_API, settings.admin.address),
                    (ADMIN_GRPC, settings.admin.grpc_address),
                ]
            ),
        ),
        *listening,
        Announcement(
            settings,
            events,
            xds_listener,
            registry=registry.listener,
            rest=None if rest_listener is None else rest_listener.listener,
            admin=None if admin is None else admin.listener,
            admin_grpc=None if admin_grpc is None else admin_grpc.listener,
        ),
        *subsets,
        Task("reconciler", reconciler.run),
        Task("dns-names", reconciler.names.run) if settings.dns.refresh > 0 else None,
        None
        if delivery is None
        else Task("rollout", lambda: drive_rollout(delivery, health_every=load.settings.bucket)),
        None
        if delivery is None or rollout_path is None
        else Task("rollout-state", lambda: keep_rollout(rollout_path, delivery)),
        HeapTidier(lambda: reconciler.idle),
        Task(
            "waiting",
            lambda: say_what_we_wait_for(
                reconciler, _waiting(settings, reconciler, etcd, dockers), events, every=settings.waiting_log_every
            ),
        ),
        signals,
    ]
    return _Process([c for c in components if c is not None], xds_listener, signals)


@dataclass(frozen=True, slots=True)
class _GrpcRunner:
    """A gRPC server as :class:`HttpListener` stops it."""

    server: GrpcServer

    async def cleanup(self) -> None:
        await self.server.stop(1.0)


def _admin_grpc(settings: AdminSettings, csds: ClientStatus, *, tls: TlsReload | None) -> _Part:
    """Client status (CSDS) on the admin gRPC port: the own HTTP/2 transport, the admin API's
    TLS (its client CA: mTLS) and connection caps; the tokens are checked per call by ``csds``."""
    address = settings.grpc_address
    assert address is not None
    total, per_address = settings.connections.caps(1 << 20)

    async def serve_grpc(context: ssl.SSLContext | None) -> tuple[_GrpcRunner, str]:
        server = GrpcServer(
            csds.methods(),
            connection_limits=ConnectionLimits(max_connections=total, max_connections_per_address=per_address),
        )
        host, _, port = address.rpartition(":")
        with naming_failures(ADMIN_GRPC, address):
            bound = await server.start(host.strip("[]"), int(port), tls=context)
        return _GrpcRunner(server), f"{host}:{bound}"

    listener = HttpListener("admin-grpc", serve_grpc, tls=tls)
    return _Part(listener, [tls, listener])


@dataclass(frozen=True, slots=True)
class _Part:
    """A listener (None: not configured) and the components it starts with, in order: its TLS
    reload before it, the background tasks it needs after it."""

    listener: HttpListener | None
    components: list[Component | None]
    api: RegistryApi | None = None
    """The registry API's, for the metrics."""


def _registry(
    settings: RegistrySettings,
    reconciler: Reconciler,
    events: EventLog,
    *,
    store: EtcdRegistry | None,
    tokens: TokenFile | None,
    tls: TlsReload | None,
) -> _Part:
    """The registry API (in memory, or on etcd's ``store``), with its TTL expiry and tokens file."""
    address = settings.address
    if address is None:
        return _Part(None, [])
    registry = Registry(clock=time.monotonic, self_preservation=settings.self_preservation, limits=settings.limits)
    if store is None:
        _log.warning(
            "the registry keeps registrations in this process's memory: a restart forgets them, "
            "and other replicas never see them. With --etcd they live in etcd"
        )
        # Its whole state, empty, is known at once: a source ready from the start (on etcd, its
        # registrations are the etcd source's).
        reconciler.readiness.reported("registry")
    api = RegistryApi(registry, reconciler, events=events, max_body=settings.max_body, tokens=tokens, store=store)
    if tokens is None:
        warn_if_open(split_address(address)[0])
    listener = HttpListener(
        "registry",
        lambda context: serve_app(api.app(), address, tls=context, listener=REGISTRY_API, limits=settings.connections),
        tls=tls,
    )
    return _Part(
        listener,
        [
            tls,
            listener,
            # (on etcd, leases end in etcd; self-preservation runs on the elected replica)
            Task("registry-expiry", api.expire_forever) if store is None else None,
            None if tokens is None else Task("registry-tokens", tokens.follow),
        ],
        api,
    )


def _rest(settings: RestSettings, rest: RestXds, *, tls: TlsReload | None) -> _Part:
    """REST xDS on its address."""
    address = settings.address
    assert address is not None
    listener = HttpListener(
        "rest", lambda context: start_rest_server(rest, address, tls=context, limits=settings.connections), tls=tls
    )
    return _Part(listener, [tls, listener])


def _admin(
    settings: AdminSettings,
    api: AdminApi,
    hint: ConfirmHint,
    *,
    tokens: AdminTokenFile | None,
    tls: TlsReload | None,
    mtls: bool,
) -> _Part:
    """The admin API on its address (it tells ``hint`` where it listens), with its tokens file."""
    address = settings.address
    assert address is not None

    async def serve_admin(context: ssl.SSLContext | None) -> tuple[Runner, str]:
        runner, bound = await start_admin_server(api, address, tls=context, limits=settings.connections)
        hint.admin_listens(bound, tls=context is not None, mtls=mtls, tokens=tokens is not None)
        return runner, bound

    listener = HttpListener("admin", serve_admin, tls=tls)
    return _Part(listener, [tls, listener, None if tokens is None else Task("admin-tokens", tokens.follow)])


def _waiting(
    settings: ServeSettings, reconciler: Reconciler, etcd: EtcdSource | None, dockers: list[DockerSource]
) -> Callable[[], list[str]]:
    """Why each source the reconciler waits for has not reported yet."""
    at = settings.etcd.address
    reasons: dict[str, Callable[[], str]] = {
        "etcd": lambda: f"etcd at {at}: {etcd.problem if etcd and etcd.problem else 'listing'}",
        SUBSETS_READY: lambda: f"the subsetting indices in etcd at {at}: listing",
    }
    for docker in dockers:
        reasons[docker.engine.source] = functools.partial(_docker_waiting, docker)

    def waiting() -> list[str]:
        return [reasons[name]() if name in reasons else name for name in reconciler.waiting_for()]

    return waiting


def _docker_waiting(docker: DockerSource) -> str:
    return f"the Docker engine at {docker.engine.url}: {docker.problem or 'listing'}"


async def _expire_forever(indices: EtcdProxyIndices, *, every: float = 1.0) -> None:
    """Free the indices of proxies whose grace period ended."""
    while True:
        await asyncio.sleep(every)
        indices.expire()
