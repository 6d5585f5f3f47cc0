"""The settings of ``pilotfish serve`` (:class:`ServeSettings`), one frozen keyword-only dataclass
per part of the process (xDS, REST xDS, the registry API, the admin API, etcd, TLS, access policy,
subsetting, the event log), each field with its docstring.

Every check that spans fields (TLS files given in pairs, a client CA needs TLS, node rules and
identity grants need mTLS, at least one source) is made in one place, :meth:`ServeSettings.validate`,
which names the flag and what to do; ``pilotfish serve`` only parses flags into these classes and
lets it speak. :func:`pilotfish.app.serve.serve` calls it too.

The settings file of ``serve --config FILE`` (:func:`read_settings_file`) is a flat mapping of
``serve``'s flags without their ``--`` (``xds: 0.0.0.0:18000``, ``quiet: 100ms``, a list for a
repeatable flag); ``pilotfish serve`` feeds it through its own flag parser
(:mod:`pilotfish.commands.flags`), so it is checked exactly as the flags are, and the command
line wins over it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from pilotfish.api.registry import DEFAULT_MAX_BODY
from pilotfish.errors import ConfigError, Problem
from pilotfish.etcd.client import DEFAULT_KEEPALIVE
from pilotfish.events import RECENT_EVENTS
from pilotfish.followed_file import read_document
from pilotfish.policy.authorize import NodeRule
from pilotfish.policy.grants import SecretGrant, Subject
from pilotfish.policy.groups import NodeGroupRule
from pilotfish.reconcile import DebounceSettings, GuardSettings, NameSettings
from pilotfish.resources.bootstrap import DEFAULT_REST_REFRESH
from pilotfish.rollout.gates import AckSettings, HealthSettings
from pilotfish.rollout.load import LoadSettings
from pilotfish.rollout.machine import RolloutSettings, parse_rollout_types
from pilotfish.rollout.waves import parse_waves
from pilotfish.sources.docker import DockerEngine, parse_engine
from pilotfish.sources.registry import RegistryLimits, SelfPreservation
from pilotfish.status import StatusLimits
from pilotfish.transport.aio import ConnectionLimits
from pilotfish.transport.site import ADMIN_CONNECTIONS, HttpConnectionLimits
from pilotfish.transport.tls import TlsFiles
from pilotfish.xds.lrs import LrsSettings
from pilotfish.xds.server import XdsLimits

__all__ = [
    "AdminSettings",
    "EtcdSettings",
    "EventSettings",
    "PolicySettings",
    "RegistrySettings",
    "RestSettings",
    "RolloutFlags",
    "ServeSettings",
    "SubsetSettings",
    "TlsSettings",
    "XdsSettings",
    "read_settings_file",
]

MAX_SETTINGS_BYTES = 256 * 1024
"""The largest settings file read (a file of every flag is a few KB)."""
MAX_IGNORED_CLUSTERS = 64
"""The most clusters ``--rollout-ignore-cluster`` names (the control plane's own: one or two)."""
_LOAD_DEFAULTS = LoadSettings()


def read_settings_file(path: Path) -> dict[str, object]:
    """The settings file of ``serve --config`` (YAML, or JSON when it ends in ``.json``): a
    mapping of flag names (without ``--``) to values. :class:`ConfigError` naming the file when
    it cannot be read or is not a mapping; its keys are checked by the flag parser."""
    document = read_document(
        path, max_bytes=MAX_SETTINGS_BYTES, empty="write serve's flags in it as keys, e.g. 'xds: 127.0.0.1:18000'"
    )
    if not isinstance(document, dict):
        raise ConfigError(
            str(path),
            [Problem("", f"the file must be a mapping of serve's flags (without '--'), not {type(document).__name__}")],
        )
    return document


@dataclass(frozen=True, slots=True, kw_only=True)
class XdsSettings:
    """The xDS gRPC server."""

    address: str = "127.0.0.1:18000"
    """``host:port`` it listens on (port 0: any free port; ``--xds``)."""
    limits: XdsLimits = field(default_factory=XdsLimits)
    """What one xDS request may carry (names, node size) and how much of it a stream keeps."""
    connections: ConnectionLimits = field(default_factory=ConnectionLimits)
    """How many xDS connections are held (in total, per source address), and how long one may
    go without its HTTP/2 preface or without streams (``--max-connections`` ...)."""
    grace: float = 1.0
    """On shutdown, how long open streams get to finish (seconds)."""
    lrs: LrsSettings = field(default_factory=LrsSettings)
    """Load reports (LRS) on the same port: how often a client reports (``--lrs-interval-ms``)."""
    csds: bool = False
    """Serve client status (CSDS) on this port too (``--csds-on-xds``). Off by default: it shows
    every proxy's config versions and NACK messages to anyone who can open a stream here."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RestSettings:
    """REST xDS (JSON polls, :mod:`pilotfish.xds.rest`). Uses the xDS TLS settings (certificate,
    client CA, grants). Polls join node groups of kind rest (built in: ``rest``), whose clusters
    and listeners poll EDS and RDS over REST too."""

    address: str | None = None
    """``host:port`` it listens on (port 0: any free port); None: gRPC only (``--rest``)."""
    refresh: float = DEFAULT_REST_REFRESH
    """Seconds between the EDS and RDS polls that clusters and listeners served to REST pollers
    ask for: give it the ``--refresh-ms`` of their bootstraps (``--rest-refresh-ms``)."""
    connections: HttpConnectionLimits = field(default_factory=HttpConnectionLimits)
    """How many REST xDS connections are held (in total, per source address)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RegistrySettings:
    """The registry HTTP API (in memory, or on etcd with :class:`EtcdSettings`)."""

    address: str | None = None
    """``host:port`` it listens on (port 0: any free port); None: no registry (``--registry``)."""
    tokens: Path | None = None
    """Its tokens file (see :mod:`pilotfish.api.tokens`), followed as it changes; None: the API
    takes reads and writes from anyone who can reach it (``--registry-tokens``)."""
    self_preservation: SelfPreservation = field(default_factory=SelfPreservation)
    """When its TTL expiry pauses because too many instances lapse at once."""
    limits: RegistryLimits = field(default_factory=RegistryLimits)
    """How many services and instances it accepts."""
    max_body: int = DEFAULT_MAX_BODY
    """The largest request body accepted (bytes)."""
    connections: HttpConnectionLimits = field(default_factory=HttpConnectionLimits)
    """How many registry API connections are held (in total, per source address)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class AdminSettings:
    """The admin API (:mod:`pilotfish.api.admin`: health, readiness, the proxies' sync status,
    confirming a held snapshot). ``pilotfish serve`` serves it on
    :data:`~pilotfish.commands.cli.DEFAULT_ADMIN` unless told ``--admin off``."""

    address: str | None = None
    """``host:port`` it listens on (port 0: any free port); None: no admin API (``--admin``)."""
    tokens: Path | None = None
    """Its tokens file (the registry's format; ``read: true`` reads, ``admin: true`` also confirms
    a held snapshot; see :data:`pilotfish.api.admin.ROUTES`), followed as it changes; None: it
    answers anyone who can reach it (``--admin-tokens``)."""
    connections: HttpConnectionLimits = ADMIN_CONNECTIONS
    """How many admin API connections are held (in total, per source address)."""
    grpc_address: str | None = None
    """``host:port`` of the admin gRPC port: client status (CSDS) with the admin API's TLS,
    client CA and tokens, and its connection caps (``--admin-grpc``); None: not served."""


@dataclass(frozen=True, slots=True, kw_only=True)
class EtcdSettings:
    """etcd as a source (and, with a registry, its store; and the subsetting indices' home)."""

    address: str | None = None
    """``host:port`` of etcd's client API to read services and instances from; None: no etcd."""
    prefix: str = "/pilotfish/"
    """The key prefix (see :mod:`pilotfish.sources.etcd` for the layout)."""
    keepalive: float = DEFAULT_KEEPALIVE
    """Seconds within which a watch on etcd that stopped answering (a stalled etcd, a half-open
    connection) is noticed, reported as etcd lost and made again (see :mod:`pilotfish.sources.etcd`)."""
    election_ttl: float = 6.0
    """The lease (seconds) of the election for the singleton duties; a replica that dies hands
    them over within about 4/3 of it."""


@dataclass(frozen=True, slots=True, kw_only=True)
class DockerSettings:
    """Docker engines as sources (see :mod:`pilotfish.sources.docker`)."""

    engines: tuple[str, ...] = ()
    """``--docker URL[@ADDRESS]`` values, as given (checked by :meth:`problems`)."""
    tls_ca: Path | None = None
    """The CA that signs ``tcp://`` engines' certificates (None: the system's)."""
    tls_cert: Path | None = None
    """A client certificate for ``tcp://`` engines (with :attr:`tls_key`)."""
    tls_key: Path | None = None
    tls: bool = False
    """Speak TLS to ``tcp://`` engines (implied by any of the files)."""

    def parsed(self) -> list[DockerEngine]:
        """The engines (ValueError naming the first bad one; :meth:`problems` names them all)."""
        return [parse_engine(text) for text in self.engines]

    @property
    def uses_tls(self) -> bool:
        return self.tls or any(f is not None for f in (self.tls_ca, self.tls_cert, self.tls_key))

    def problems(self) -> list[Problem]:
        problems = []
        urls = set()
        for text in self.engines:
            try:
                engine = parse_engine(text)
            except ValueError as exc:
                problems.append(Problem("--docker", str(exc)))
                continue
            if engine.url in urls:
                problems.append(Problem("--docker", f"--docker {engine.url} is given twice"))
            urls.add(engine.url)
        if (self.tls_cert is None) != (self.tls_key is None):
            problems.append(Problem("--docker-tls-cert", "--docker-tls-cert and --docker-tls-key go together"))
        for flag, path in (
            ("--docker-tls-ca", self.tls_ca),
            ("--docker-tls-cert", self.tls_cert),
            ("--docker-tls-key", self.tls_key),
        ):
            if path is not None and not path.is_file():
                problems.append(Problem(flag, f"{flag} {path}: no such file"))
        return problems


@dataclass(frozen=True, slots=True, kw_only=True)
class TlsSettings:
    """TLS on every listener: with :attr:`cert` and :attr:`key`, xDS, REST xDS, the registry API
    and the admin API are served over TLS only; the files are reloaded as they change."""

    cert: Path | None = None
    """PEM certificate chain (``--tls-cert``); None: plaintext."""
    key: Path | None = None
    """PEM private key of :attr:`cert` (``--tls-key``)."""
    client_ca: Path | None = None
    """PEM CA bundle: xDS (and REST xDS) clients must present a certificate from it (mTLS,
    ``--client-ca``); None: not asked for."""
    registry_client_ca: Path | None = None
    """PEM CA bundle: registry API clients must present a certificate from it; None: not asked for.
    Separate from :attr:`client_ca`: the registry's clients (deploy tools, agents) are not proxies."""
    admin_client_ca: Path | None = None
    """PEM CA bundle: admin API clients must present a certificate from it; None: not asked for."""
    reload_every: float = 1.0
    """How often the certificate, key and CA files are checked for changes (seconds)."""

    @property
    def mode(self) -> str:
        """``off``, ``tls`` or ``mtls`` (xDS), as the ``server_started`` event says."""
        return "off" if self.cert is None else "mtls" if self.client_ca is not None else "tls"

    def files(self, *, client_ca: Path | None, alpn: tuple[str, ...]) -> TlsFiles | None:
        """The TLS files of one listener, or None for plaintext (the settings are valid:
        :meth:`ServeSettings.validate`)."""
        if self.cert is None or self.key is None:
            return None
        return TlsFiles(cert=self.cert, key=self.key, client_ca=client_ca, alpn=alpn)

    def problems(self) -> list[Problem]:
        problems = []
        if (self.cert is None) != (self.key is None):
            problems.append(Problem("--tls-cert", "give both --tls-cert FILE and --tls-key FILE, or neither"))
        elif self.cert is None and any(
            ca is not None for ca in (self.client_ca, self.registry_client_ca, self.admin_client_ca)
        ):
            problems.append(
                Problem(
                    "--client-ca",
                    "--client-ca, --registry-client-ca and --admin-client-ca need "
                    "TLS: give --tls-cert and --tls-key too",
                )
            )
        return problems


@dataclass(frozen=True, slots=True, kw_only=True)
class PolicySettings:
    """Who may get what: node-id rules for certificate identities, SDS grants, node groups."""

    authorize_nodes: tuple[NodeRule, ...] = ()
    """Which node ids each certificate identity may claim (needs :attr:`TlsSettings.client_ca`);
    empty: any (``--authorize-node``)."""
    secret_grants: tuple[SecretGrant, ...] = ()
    """Which proxies may receive which SDS secrets (``identity:`` grants need
    :attr:`TlsSettings.client_ca`); empty: no proxy receives any secret (see
    :mod:`pilotfish.policy.grants`; ``--grant-secret``)."""
    grants_file: Path | None = None
    """A file of more SDS grants (YAML, or JSON when it ends in ``.json``: ``grants: [SECRET=...]``),
    in force beside :attr:`secret_grants` and followed as it changes (a bad version is reported
    and the last good grants kept); None: the flags' grants only (``--grants-file``)."""
    node_groups: tuple[NodeGroupRule, ...] = ()
    """Which node group a client joins (first match; see :mod:`pilotfish.policy.groups`); after them
    the built-in rules: gRPC clients to ``grpc``, everyone else to ``default`` (``--node-group``)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class SubsetSettings:
    """Subsetting: which endpoints of a service each proxy gets, and where the indices are kept."""

    size: int | None = None
    """Give each proxy this many endpoints of every service that sets no ``subset_size`` of its own
    (None: only services that set one are subsetted; ``--subset-size``)."""
    state_dir: Path | None = None
    """Where the indices are kept across restarts (``pilotfish-subsets.json``); None: the snapshot
    file's directory, or (without a snapshot file) memory only. On etcd they live in etcd."""
    grace: float = 300.0
    """Seconds a disconnected proxy keeps its index (a hot restart gets the same subset)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class EventSettings:
    """The JSON-lines event log and the events kept in memory."""

    log: Path | None = None
    """Where to append the event log; None: no event log (``--event-log``)."""
    level: str = "all"
    """``all``: every request and response too; ``changes``: snapshots, NACKs, streams, sources."""
    recent: int = RECENT_EVENTS
    """Events kept in memory for the admin API's ``/v1/events`` and the status page (at most
    :data:`~pilotfish.events.RECENT_LINE` bytes each)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RolloutFlags:
    """Progressive delivery (docs/rollout.md), as the flags give it; :meth:`settings` makes the
    machine's :class:`~pilotfish.rollout.machine.RolloutSettings` of it."""

    waves: str | None = None
    """The waves, e.g. ``canary=edge-canary-*,5%,25%,100%`` (``--rollout``); None: every change
    reaches every proxy at once."""
    types: str = "CDS,ECDS,LDS,RDS,SDS,RTDS"
    """The types whose changes roll out in waves (``--rollout-types``); the others reach every
    proxy at once."""
    ack_timeout: float = 30.0
    """Seconds a wave's proxies have to ACK the candidate (``--rollout-ack-timeout``)."""
    bake: float = 30.0
    """Seconds a wave bakes after it ACKed, its health watched (``--rollout-bake``)."""
    health: bool = True
    """Judge a bake by the proxies' load reports (``--rollout-health on|off``); off: a bake is
    only time."""
    min_requests: int = 100
    """Requests a side needs before its error ratio decides anything (``--rollout-min-requests``)."""
    max_error_increase: float = 1.0
    """Percentage points a wave's error ratio may exceed the baseline's (``--rollout-max-error-increase``)."""
    too_little_traffic: str = "pause"
    """``pause`` or ``pass`` a wave whose bake saw too few requests (``--rollout-too-little-traffic``)."""
    ignore_clusters: tuple[str, ...] = ()
    """Clusters whose load reports the health gate leaves out, besides the bootstrap's
    ``xds_cluster`` (``--rollout-ignore-cluster``): the control plane's own, under another name."""

    def settings(self) -> RolloutSettings | None:
        """The machine's settings (None: no rollout); ValueError naming the flag at fault."""
        if self.waves is None:
            return None
        try:
            waves = parse_waves(self.waves)
        except ValueError as exc:
            message = str(exc)
            raise ValueError(
                message if message.startswith("--rollout") else f"--rollout {self.waves!r}: {message}"
            ) from None
        types = parse_rollout_types(self.types)
        try:
            ack = AckSettings(timeout=self.ack_timeout)
        except ValueError as exc:
            raise ValueError(f"--rollout-ack-timeout: {exc}") from None
        if not 0 <= self.bake <= 86_400:
            raise ValueError(f"--rollout-bake: a bake lasts 0 s to a day, not {self.bake:g} s")
        try:
            health = (
                HealthSettings(max_increase=self.max_error_increase / 100, min_requests=self.min_requests)
                if self.health
                else None
            )
        except ValueError as exc:
            raise ValueError(f"--rollout-max-error-increase / --rollout-min-requests: {exc}") from None
        if self.too_little_traffic not in ("pause", "pass"):
            raise ValueError(f"--rollout-too-little-traffic is pause or pass, not {self.too_little_traffic!r}")
        if len(self.ignore_clusters) > MAX_IGNORED_CLUSTERS:
            raise ValueError(f"--rollout-ignore-cluster: at most {MAX_IGNORED_CLUSTERS} clusters")
        for name in self.ignore_clusters:
            if not name.strip() or len(name) > _LOAD_DEFAULTS.max_name:
                raise ValueError(
                    f"--rollout-ignore-cluster {name!r}: a cluster's name, 1 to {_LOAD_DEFAULTS.max_name} characters"
                )
        return RolloutSettings(
            waves=waves,
            types=types,
            ack=ack,
            bake=self.bake,
            health=health,
            too_little_traffic="pause" if self.too_little_traffic == "pause" else "pass",
        )

    def load_settings(self) -> LoadSettings:
        """A load store that keeps what the gates read: an ACK timeout and two bakes (the wave's, and
        the baseline's before it), in buckets of a sixth of a bake (at most 5 s)."""
        bucket = max(0.1, min(5.0, self.bake / 6))
        return LoadSettings(
            bucket=bucket,
            retention=max(180.0, self.ack_timeout + 2 * self.bake + 2 * bucket),
            ignored=_LOAD_DEFAULTS.ignored | frozenset(self.ignore_clusters),
        )

    def problems(self) -> list[Problem]:
        try:
            self.settings()
        except ValueError as exc:
            flag = str(exc).split(" ", 1)[0].split(":", 1)[0]
            return [Problem(flag if flag.startswith("--") else "--rollout", str(exc))]
        return []


@dataclass(frozen=True, slots=True, kw_only=True)
class ServeSettings:
    """How ``pilotfish serve`` runs: one part per component of the process."""

    snapshot: Path | None = None
    """The snapshot file (JSON or YAML) to serve and watch; None: no file source."""
    xds: XdsSettings = field(default_factory=XdsSettings)
    rest: RestSettings = field(default_factory=RestSettings)
    registry: RegistrySettings = field(default_factory=RegistrySettings)
    admin: AdminSettings = field(default_factory=AdminSettings)
    etcd: EtcdSettings = field(default_factory=EtcdSettings)
    docker: DockerSettings = field(default_factory=DockerSettings)
    tls: TlsSettings = field(default_factory=TlsSettings)
    policy: PolicySettings = field(default_factory=PolicySettings)
    subsets: SubsetSettings = field(default_factory=SubsetSettings)
    events: EventSettings = field(default_factory=EventSettings)
    status_limits: StatusLimits = field(default_factory=StatusLimits)
    """How long, and how many, proxies that have disconnected are remembered (``/v1/proxies?all=true``)."""
    debounce: DebounceSettings = field(default_factory=DebounceSettings)
    """How bursts of changes are batched and flapping endpoints damped."""
    dns: NameSettings = field(default_factory=NameSettings)
    """How the host names of DNS services are looked up, and their last good addresses kept."""
    guard: GuardSettings = field(default_factory=GuardSettings)
    """Which snapshots remove too much at once to publish without the operator's confirmation."""
    validate_rules: bool = True
    """Check every resource against Envoy's own validate.rules before publishing; False lets such
    content through, for Envoy to NACK (``--validate``)."""
    waiting_log_every: float = 10.0
    """While a source has not reported its first state, say which and why this often (seconds)."""
    rollout: RolloutFlags = field(default_factory=RolloutFlags)
    """Progressive delivery: waves, gates (``--rollout`` and its companions)."""

    def problems(self) -> list[Problem]:
        """Every way the parts contradict each other (empty: none), each naming its flag."""
        problems = []
        if (
            self.snapshot is None
            and self.registry.address is None
            and self.etcd.address is None
            and not self.docker.engines
        ):
            problems.append(
                Problem(
                    "--snapshot",
                    "give at least one source: --snapshot FILE, --registry HOST:PORT, --etcd HOST:PORT or --docker URL",
                )
            )
        problems += self.docker.problems()
        problems += self.tls.problems()
        problems += self.rollout.problems()
        if self.policy.authorize_nodes and self.tls.client_ca is None:
            problems.append(
                Problem(
                    "--authorize-node",
                    "--authorize-node binds certificate identities to node ids: "
                    "it needs mTLS, give --client-ca FILE (and --tls-cert, "
                    "--tls-key) too",
                )
            )
        if self.tls.client_ca is None and any(g.subject is Subject.IDENTITY for g in self.policy.secret_grants):
            problems.append(
                Problem(
                    "--grant-secret",
                    "--grant-secret ...=identity: names certificate identities: "
                    "it needs mTLS, give --client-ca FILE (and --tls-cert, "
                    "--tls-key) too",
                )
            )
        if not 0.1 <= self.xds.lrs.interval <= 3600:
            problems.append(
                Problem(
                    "--lrs-interval",
                    f"--lrs-interval asks proxies to report load every 100ms to 1h, not every "
                    f"{self.xds.lrs.interval * 1000:g}ms",
                )
            )
        return problems

    def validate(self) -> None:
        """Raise :class:`ConfigError` naming every contradiction (:meth:`problems`)."""
        problems = self.problems()
        if problems:
            raise ConfigError("pilotfish serve", problems)
