"""The settings of ``pilotfish serve`` (:class:`ServeSettings`): one keyword-only field per flag,
each with its docstring; :func:`pilotfish.app.serve.serve` wires a process from them."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from pilotfish.api.registry import DEFAULT_MAX_BODY
from pilotfish.errors import ConfigError, Problem
from pilotfish.etcd.client import DEFAULT_KEEPALIVE
from pilotfish.events import RECENT_EVENTS
from pilotfish.policy.authorize import NodeRule
from pilotfish.policy.grants import SecretGrant
from pilotfish.policy.groups import NodeGroupRule
from pilotfish.reconcile import DebounceSettings, GuardSettings
from pilotfish.resources.bootstrap import DEFAULT_REST_REFRESH
from pilotfish.sources.registry import RegistryLimits, SelfPreservation
from pilotfish.status import StatusLimits
from pilotfish.transport.aio import ConnectionLimits
from pilotfish.transport.site import (
    ADMIN_CONNECTIONS,
    HttpConnectionLimits,
)
from pilotfish.transport.tls import TlsFiles
from pilotfish.xds.server import XdsLimits

__all__ = ["ServeSettings"]


@dataclass(frozen=True, slots=True, kw_only=True)
class ServeSettings:
    """How ``pilotfish serve`` runs."""

    snapshot: Path | None = None
    """The snapshot file (JSON or YAML) to serve and watch; None: no file source."""
    xds: str = "127.0.0.1:18000"
    """``host:port`` the xDS gRPC server listens on (port 0: any free port)."""
    event_log: Path | None = None
    """Where to append the JSON-lines event log; None: no event log."""
    event_log_level: str = "all"
    """``all``: every request and response too; ``changes``: snapshots, NACKs, streams, sources."""
    admin: str | None = None
    """``host:port`` for the admin API (:mod:`pilotfish.api.admin`: health, readiness, the
    proxies' sync status, confirming a held snapshot; port 0: any free port); None: no admin API.
    (``pilotfish serve`` serves it on :data:`~pilotfish.commands.cli.DEFAULT_ADMIN` unless told
    ``--admin off``.)"""
    registry: str | None = None
    """``host:port`` for the registry HTTP API (port 0: any free port); None: no registry."""
    rest: str | None = None
    """``host:port`` for REST xDS (JSON polls, :mod:`pilotfish.xds.rest`; port 0: any free
    port); None: gRPC only. Uses the xDS TLS settings (certificate, client CA, grants). Polls join
    node groups of kind rest (built in: ``rest``), whose clusters and listeners poll EDS and RDS
    over REST too."""
    rest_refresh: float = DEFAULT_REST_REFRESH
    """Seconds between the EDS and RDS polls that clusters and listeners served to REST pollers
    ask for: give it the ``--refresh-ms`` of their bootstraps (``pilotfish bootstrap --rest``)."""
    etcd: str | None = None
    """``host:port`` of etcd's client API to read services and instances from; None: no etcd."""
    etcd_prefix: str = "/pilotfish/"
    """The etcd key prefix (see :mod:`pilotfish.sources.etcd` for the layout)."""
    etcd_keepalive: float = DEFAULT_KEEPALIVE
    """Seconds within which a watch on etcd that stopped answering (a stalled etcd, a half-open
    connection) is noticed, reported as etcd lost and made again (see :mod:`pilotfish.sources.etcd`)."""
    subset_size: int | None = None
    """Give each proxy this many endpoints of every service that sets no ``subset_size`` of its own
    (None: only services that set one are subsetted)."""
    state_dir: Path | None = None
    """Where the subsetting indices are kept across restarts (``pilotfish-subsets.json``); None: the
    snapshot file's directory, or (without a snapshot file) memory only."""
    subset_grace: float = 300.0
    """Seconds a disconnected proxy keeps its subsetting index (a hot restart gets the same subset)."""
    status_limits: StatusLimits = field(default_factory=StatusLimits)
    """How long, and how many, proxies that have disconnected are remembered (``/v1/proxies?all=true``)."""
    recent_events: int = RECENT_EVENTS
    """Events kept in memory for the admin API's ``/v1/events`` and the status page (at most
    :data:`~pilotfish.events.RECENT_LINE` bytes each)."""
    election_ttl: float = 6.0
    """With the registry on etcd: the lease (seconds) of the election for the singleton duties; a
    replica that dies hands them over within about 4/3 of it."""
    debounce: DebounceSettings = field(default_factory=DebounceSettings)
    """How bursts of changes are batched and flapping endpoints damped."""
    validate: bool = True
    """Check every resource against Envoy's own validate.rules before publishing; False lets such
    content through, for Envoy to NACK."""
    guard: GuardSettings = field(default_factory=GuardSettings)
    """Which snapshots remove too much at once to publish without the operator's confirmation."""
    registry_self_preservation: SelfPreservation = field(default_factory=SelfPreservation)
    """When the registry's TTL expiry pauses because too many instances lapse at once."""
    registry_limits: RegistryLimits = field(default_factory=RegistryLimits)
    """How many services and instances the registry API accepts."""
    registry_max_body: int = DEFAULT_MAX_BODY
    """The largest registry API request body accepted (bytes)."""
    registry_tokens: Path | None = None
    """The registry API's tokens file (see :mod:`pilotfish.api.tokens`), followed as it
    changes; None: the API takes reads and writes from anyone who can reach it."""
    admin_tokens: Path | None = None
    """The admin API's tokens file (the registry's format; ``read: true`` reads, ``admin: true``
    also confirms a held snapshot; see :data:`pilotfish.api.admin.ROUTES`), followed as it
    changes; None: the admin API answers anyone who can reach it."""
    waiting_log_every: float = 10.0
    """While a source has not reported its first state, say which and why this often (seconds)."""
    grace_seconds: float = 1.0
    """On shutdown, how long open streams get to finish."""
    tls_cert: Path | None = None
    """PEM certificate chain: with :attr:`tls_key`, xDS (and the registry API) are served over TLS
    only. None: plaintext."""
    tls_key: Path | None = None
    """PEM private key of :attr:`tls_cert`."""
    client_ca: Path | None = None
    """PEM CA bundle: xDS clients must present a certificate from it (mTLS); None: not asked for."""
    admin_client_ca: Path | None = None
    """PEM CA bundle: admin API clients must present a certificate from it; None: not asked for.
    (With :attr:`tls_cert`, the admin API is served over TLS only, as the registry API is.)"""
    registry_client_ca: Path | None = None
    """PEM CA bundle: registry API clients must present a certificate from it; None: not asked for.
    Separate from :attr:`client_ca`: the registry's clients (deploy tools, agents) are not proxies."""
    tls_reload_every: float = 1.0
    """How often the certificate, key and CA files are checked for changes (seconds)."""
    authorize_nodes: tuple[NodeRule, ...] = ()
    """Which node ids each certificate identity may claim (needs :attr:`client_ca`); empty: any."""
    secret_grants: tuple[SecretGrant, ...] = ()
    """Which proxies may receive which SDS secrets (``identity:`` grants need :attr:`client_ca`);
    empty: no proxy receives any secret (see :mod:`pilotfish.policy.grants`)."""
    grants_file: Path | None = None
    """A file of more SDS grants (YAML, or JSON when it ends in ``.json``: ``grants: [SECRET=...]``),
    in force beside :attr:`secret_grants` and followed as it changes (a bad version is reported
    and the last good grants kept); None: the flags' grants only."""
    node_groups: tuple[NodeGroupRule, ...] = ()
    """Which node group a client joins (first match; see :mod:`pilotfish.policy.groups`); after them
    the built-in rules: gRPC clients to ``grpc``, everyone else to ``default``."""

    xds_limits: XdsLimits = field(default_factory=XdsLimits)
    """What one xDS request may carry (names, node size) and how much of it a stream keeps."""
    xds_connections: ConnectionLimits = field(default_factory=ConnectionLimits)
    """How many xDS connections are held (in total, per source address), and how long one may
    go without its HTTP/2 preface or without streams."""
    registry_connections: HttpConnectionLimits = field(default_factory=HttpConnectionLimits)
    """How many registry API connections are held (in total, per source address)."""
    rest_connections: HttpConnectionLimits = field(default_factory=HttpConnectionLimits)
    """How many REST xDS connections are held (in total, per source address)."""
    admin_connections: HttpConnectionLimits = ADMIN_CONNECTIONS
    """How many admin API connections are held (in total, per source address)."""

    def tls_files(self, *, client_ca: Path | None, alpn: tuple[str, ...]) -> TlsFiles | None:
        """The TLS files of one listener, or None for plaintext. Raises :class:`ConfigError` when
        the settings are incomplete."""
        if self.tls_cert is None and self.tls_key is None:
            if client_ca is not None:
                raise ConfigError(str(client_ca), [Problem("", "a client CA needs TLS: give --tls-cert and "
                                                               "--tls-key too")])
            return None
        if self.tls_cert is None or self.tls_key is None:
            raise ConfigError("TLS settings", [Problem("", "give both --tls-cert and --tls-key, or neither")])
        return TlsFiles(cert=self.tls_cert, key=self.tls_key, client_ca=client_ca, alpn=alpn)
