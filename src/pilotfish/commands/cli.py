"""The ``pilotfish`` command: ``serve``, ``status``, ``wait``, ``confirm``, ``rollout``, ``plan``,
``validate``, ``bootstrap``, ``token``, ``demo``."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import math
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from pilotfish.commands.flags import (
    Deprecated,
    Repeatable,
    SettingsFileError,
    duration,
    duration_or_zero,
    format_duration,
    read_settings,
    report_warnings,
    seconds_or_zero,
)
from pilotfish.commands.flags import seconds as _seconds
from pilotfish.commands.logs import configure_logging
from pilotfish.errors import ConfigError
from pilotfish.etcd.client import DEFAULT_KEEPALIVE
from pilotfish.events import RECENT_EVENTS
from pilotfish.resources.bootstrap import (
    DEFAULT_REST_REFRESH,
    BootstrapSettings,
    bootstrap_yaml,
    grpc_bootstrap_json,
    split_address,
    split_addresses,
)

if TYPE_CHECKING:
    from pilotfish.policy.authorize import NodeRule
    from pilotfish.policy.grants import SecretGrant
    from pilotfish.policy.groups import NodeGroupRule

__all__ = ["main"]

EXIT_OK = 0
EXIT_INVALID = 1
EXIT_USAGE = 2
ROLLOUT_ACTIONS = ("status", "promote", "pause", "resume", "abort")
"""``pilotfish rollout ACTION`` (as :data:`pilotfish.commands.operate.ROLLOUT_ACTIONS`)."""


def _address(value: str) -> str:
    try:
        split_address(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc
    return value


DEFAULT_ADMIN = "127.0.0.1:18001"
"""Where ``serve`` serves the admin API, and where ``status``, ``wait``, ``confirm``, ``rollout`` and
``plan`` look for it."""
ADMIN_VARIABLES = {
    "admin": "PILOTFISH_ADMIN",
    "tls_ca": "PILOTFISH_TLS_CA",
    "tls_cert": "PILOTFISH_TLS_CERT",
    "tls_key": "PILOTFISH_TLS_KEY",
    "token_file": "PILOTFISH_TOKEN_FILE",
}
"""The environment variables the admin API's clients (status, wait, confirm, rollout, plan) take
their flags' defaults from; a flag given wins. (The token itself: ``PILOTFISH_ADMIN_TOKEN``.)"""


def _addresses(value: str) -> list[str]:
    """``--xds`` / ``--rest`` of ``bootstrap``: one or more HOST:PORT separated by commas (the
    option may be repeated too)."""
    try:
        return list(split_addresses(value))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def _admin_address(value: str) -> str | None:
    return None if value == "off" else _address(value)


def _positive_int(value: str) -> int:
    if not value.isdigit() or int(value) <= 0:
        raise argparse.ArgumentTypeError(f"{value!r} is not a positive whole number")
    return int(value)


MAX_BUILDS_PER_S = (0.1, 1000.0)
"""The range ``--max-builds-per-s`` takes: a build every 10 s at the slowest, a thousand a second at most."""


def _builds_per_second(value: str) -> float:
    low, high = MAX_BUILDS_PER_S
    try:
        rate = float(value)
    except ValueError:
        rate = math.nan
    if not low <= rate <= high:  # (NaN fails both)
        raise argparse.ArgumentTypeError(f"{value!r} is not a number of builds a second from {low:g} to {high:g}")
    return rate


def _whole_number(value: str) -> int:
    if not value.isdigit():
        raise argparse.ArgumentTypeError(f"{value!r} is not a whole number (0 or more)")
    return int(value)


MAX_RECENT_EVENTS = 100_000
"""The most ``--recent-events`` takes (at 4 KB an event: 400 MB)."""


def _recent_events(value: str) -> int:
    count = _positive_int(value)
    if count > MAX_RECENT_EVENTS:
        raise argparse.ArgumentTypeError(
            f"{value!r} is more than {MAX_RECENT_EVENTS:,} events (each up to 4 KB of memory)"
        )
    return count


def _share(value: str) -> float:
    try:
        share = float(value)
    except ValueError:
        share = -1.0
    if not 0 < share <= 1:
        raise argparse.ArgumentTypeError(f"{value!r} is not a share between 0 and 1 (e.g. 0.5)")
    return share


def _node_rule(value: str) -> NodeRule:
    from pilotfish.policy.authorize import parse_rule  # the server package is heavy to import: only for serve

    try:
        return parse_rule(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def _grant(value: str) -> SecretGrant:
    from pilotfish.policy.grants import parse_grant

    try:
        return parse_grant(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def _node_group(value: str) -> NodeGroupRule:
    from pilotfish.policy.groups import parse_node_group

    try:
        return parse_node_group(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def _ms(value: int) -> float:
    return value / 1000


def _renamed(
    group: argparse._ActionsContainer, old: str, new: str, *, unit: str, metavar: str = "MS", whole: bool = False
) -> None:
    """``old`` (a number of ``unit``: ``ms`` or ``s``) kept as a deprecated alias of the duration flag ``new``."""
    group.add_argument(
        old,
        dest=new[2:].replace("-", "_"),
        action=Deprecated,
        instead=new,
        type=(_whole_number if whole else _positive_int) if unit == "ms" else seconds_or_zero,
        convert=_ms if unit == "ms" else float,
        shown=format_duration,
        metavar=metavar,
        help=f"deprecated: {new} (this one takes {'milliseconds' if unit == 'ms' else 'seconds'})",
    )


def version() -> str:
    """pilotfish's version, as installed (its package metadata)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return installed("pilotfish")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown (not installed)"


def _parser() -> argparse.ArgumentParser:
    return _parsers()[0]


def _parsers() -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    """The ``pilotfish`` parser, and its ``serve`` subparser (which ``--config`` files feed)."""
    parser = argparse.ArgumentParser(prog="pilotfish", description="An Envoy control plane (xDS over gRPC).")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-vv: every event)")
    parser.add_argument(
        "--version", action="version", version=f"pilotfish {version()}", help="print pilotfish's version and exit"
    )
    parser.add_argument(
        "--log-format",
        choices=("text", "json"),
        default="text",
        help="the logs on stderr: text lines, or one JSON object a line (time, level, logger, message "
        "and the record's fields) for log shippers (default: %(default)s)",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = commands.add_parser("serve", help="serve a snapshot file over xDS, following its changes")
    serve.add_argument(
        "--config",
        type=Path,
        metavar="FILE",
        help="read serve's settings from this YAML (or .json) file: its keys are these flags without "
        "'--' (quiet: 100ms, node-group: [a=cluster:a]); flags given here win over it; an unknown key "
        "is refused",
    )
    serve.add_argument(
        "--print-settings",
        action="store_true",
        help="print the settings in effect (the file's and the flags', checked) as JSON and exit, serving nothing",
    )
    serve.add_argument(
        "--snapshot",
        type=Path,
        metavar="FILE",
        help="JSON or YAML file of services and Envoy resources (clusters, endpoints, listeners, "
        "routes, secrets), watched for changes",
    )
    serve.add_argument(
        "--registry",
        type=_address,
        metavar="HOST:PORT",
        help="serve the registry HTTP API here (register instances, heartbeats, TTLs); with --etcd "
        "registrations are stored in etcd (TTLs as leases), otherwise in memory and lost on "
        "restart",
    )
    serve.add_argument(
        "--registry-tokens",
        type=Path,
        metavar="FILE",
        help="require bearer tokens on the registry API, with the scopes this file gives them "
        "(followed as it changes; see `pilotfish token`)",
    )
    serve.add_argument(
        "--registry-self-preservation",
        choices=("on", "off"),
        default="on",
        help="pause TTL expiry when more than --registry-self-preservation-share of the instances "
        "lapse at once, as in a network partition (default: %(default)s)",
    )
    serve.add_argument(
        "--registry-self-preservation-share",
        type=_share,
        default=0.5,
        metavar="SHARE",
        help="the share of instances lapsing at once that pauses TTL expiry (default: %(default)s)",
    )
    serve.add_argument(
        "--etcd",
        type=_address,
        metavar="HOST:PORT",
        help="read services and instances from etcd's client API here, watched (and with "
        "--registry, store registrations there: replicas on one etcd serve one fleet)",
    )
    serve.add_argument(
        "--etcd-prefix",
        default="/pilotfish/",
        metavar="PREFIX",
        help="etcd key prefix: PREFIX/services/NAME, PREFIX/instances/SERVICE/ID (default: %(default)s)",
    )
    serve.add_argument(
        "--etcd-keepalive",
        type=duration,
        default=format_duration(DEFAULT_KEEPALIVE),
        metavar="DURATION",
        help="notice an etcd watch that stopped answering (a stalled etcd, a half-open connection) "
        "within this long: after half of it in silence etcd is probed, and must answer within the "
        "other half; then the watch is made again (default: %(default)s)",
    )
    _renamed(serve, "--etcd-keepalive-s", "--etcd-keepalive", unit="s", metavar="S")
    serve.add_argument(
        "--docker",
        action=Repeatable,
        default=[],
        metavar="URL[@ADDRESS]",
        help="discover endpoints from a Docker engine's labelled containers (repeatable): "
        "unix:///var/run/docker.sock, or tcp://HOST:PORT; @ADDRESS is the address its containers "
        "are reached at (default: 127.0.0.1 for a socket, HOST for tcp). Labels: docs/sources.md",
    )
    serve.add_argument(
        "--docker-tls",
        action="store_true",
        help="speak TLS to tcp:// Docker engines (implied by the --docker-tls-* files)",
    )
    serve.add_argument(
        "--docker-tls-ca",
        type=Path,
        metavar="FILE",
        help="the CA that signs tcp:// Docker engines' certificates (default: the system's)",
    )
    serve.add_argument(
        "--docker-tls-cert", type=Path, metavar="FILE", help="client certificate for tcp:// Docker engines"
    )
    serve.add_argument("--docker-tls-key", type=Path, metavar="FILE", help="the key of --docker-tls-cert")
    serve.add_argument(
        "--quiet",
        type=duration,
        default="100ms",
        metavar="DURATION",
        help="debounce: build once changes have been quiet this long (default: %(default)s)",
    )
    _renamed(serve, "--quiet-ms", "--quiet", unit="ms")
    serve.add_argument(
        "--max-delay",
        type=duration,
        default="1s",
        metavar="DURATION",
        help="debounce: build at the latest this long after a burst began (default: %(default)s)",
    )
    _renamed(serve, "--max-delay-ms", "--max-delay", unit="ms")
    serve.add_argument(
        "--max-builds-per-s",
        type=_builds_per_second,
        default=10.0,
        metavar="N",
        help="debounce: start at most N builds a second, however many services change (default: %(default)g)",
    )
    serve.add_argument(
        "--flap-hold",
        type=duration,
        default="1s",
        metavar="DURATION",
        help="an endpoint that comes back soon after leaving is re-added after staying this "
        "long (default: %(default)s)",
    )
    _renamed(serve, "--flap-hold-ms", "--flap-hold", unit="ms")
    serve.add_argument(
        "--dns-refresh",
        type=duration_or_zero,
        default="2s",
        metavar="DURATION",
        help="look up the host names of DNS services this often; one that stops resolving is reported "
        "and served by its last good addresses (0s: off; default: %(default)s)",
    )
    serve.add_argument(
        "--validate",
        choices=("on", "off"),
        default="on",
        help="check every resource against Envoy's own proto rules (validate.rules) before it is "
        "served; off lets it through for Envoy to NACK (default: %(default)s)",
    )
    serve.add_argument(
        "--guard",
        choices=("on", "off"),
        default="on",
        help="hold a snapshot that removes every listener or cluster, or too much at once, until "
        "confirmed (`pilotfish confirm`, or SIGUSR1) (default: %(default)s)",
    )
    serve.add_argument(
        "--guard-max-removed",
        type=_share,
        default=0.5,
        metavar="SHARE",
        help="the guard holds a snapshot removing more than this share of a type's resources or of "
        "a service's endpoints at once (default: %(default)s)",
    )
    serve.add_argument(
        "--guard-min-count",
        type=_positive_int,
        default=10,
        metavar="N",
        help="...of a type or service that had at least N of them (default: %(default)s)",
    )
    serve.add_argument(
        "--xds",
        type=_address,
        default="127.0.0.1:18000",
        metavar="HOST:PORT",
        help="where to serve xDS over gRPC (default: %(default)s); load reports (LRS) are taken on the same port",
    )
    serve.add_argument(
        "--lrs-interval",
        type=duration,
        metavar="DURATION",
        help="how often proxies that report load (bootstrap --lrs) are asked to report (default: 10s)",
    )
    _renamed(serve, "--lrs-interval-ms", "--lrs-interval", unit="ms")
    serve.add_argument(
        "--csds-on-xds",
        action="store_true",
        help="serve client status (CSDS) on the xDS port too: any client of that port may then read every "
        "proxy's status (see docs/security.md)",
    )
    _rollout_flags(serve)
    serve.add_argument(
        "--admin",
        type=_admin_address,
        default=DEFAULT_ADMIN,
        metavar="HOST:PORT|off",
        help="serve the admin API here (HTTP; without --admin-tokens keep it on loopback): the status "
        "page at /, and JSON: /healthz, /readyz, /v1/proxies, /v1/snapshots, /v1/config, "
        "/v1/held, /v1/fleet, /v1/events (default: %(default)s)",
    )
    serve.add_argument(
        "--admin-grpc",
        type=_address,
        metavar="HOST:PORT",
        help="serve client status (CSDS, envoy.service.status.v3) over gRPC here, with the admin API's "
        "TLS, client CA and tokens (read: true) (default: not served)",
    )
    serve.add_argument(
        "--admin-tokens",
        type=Path,
        metavar="FILE",
        help="require bearer tokens on the admin API (the --registry-tokens format, followed as it "
        "changes): read: true to read status and config, admin: true to confirm a held snapshot "
        "too; /, /healthz and /readyz stay open",
    )
    serve.add_argument(
        "--rest",
        type=_address,
        metavar="HOST:PORT",
        help="also serve REST xDS here: POST /v3/discovery:clusters (:endpoints, :listeners, :routes, "
        ":secrets) with a JSON DiscoveryRequest, for Envoy's api_type REST (same TLS, grants); "
        "polls join the node groups of kind rest (built in: 'rest')",
    )
    serve.add_argument(
        "--rest-refresh",
        type=duration,
        default=format_duration(DEFAULT_REST_REFRESH),
        metavar="DURATION",
        help="with --rest: clusters and listeners served to REST pollers poll their endpoints and "
        "routes this often; give the --refresh of their bootstraps (default: %(default)s)",
    )
    _renamed(serve, "--rest-refresh-ms", "--rest-refresh", unit="ms")
    serve.add_argument(
        "--event-log",
        type=Path,
        metavar="FILE",
        help="append every xDS request, response and snapshot change here, as JSON lines",
    )
    serve.add_argument(
        "--event-log-level",
        choices=("all", "changes"),
        default="all",
        help="all: every request and response too; changes: only snapshots, NACKs, streams and "
        "sources, for large fleets (default: %(default)s)",
    )
    serve.add_argument(
        "--subset-size",
        type=_positive_int,
        metavar="K",
        help="give each proxy its own K endpoints of every service (Ringsteady subsetting; a "
        "service's subset_size overrides it); default: only services that set subset_size",
    )
    serve.add_argument(
        "--state-dir",
        type=Path,
        metavar="DIR",
        help="keep the subsetting indices in DIR/pilotfish-subsets.json across restarts (default: "
        "the snapshot file's directory)",
    )
    serve.add_argument(
        "--subset-grace",
        type=duration_or_zero,
        default="5m",
        metavar="DURATION",
        help="a disconnected proxy keeps its subset this long, e.g. for a hot restart (default: %(default)s)",
    )
    _renamed(serve, "--subset-grace-s", "--subset-grace", unit="s", metavar="S")
    serve.add_argument(
        "--status-forget-after",
        type=_seconds,
        default="10m",
        metavar="DURATION",
        help="a disconnected proxy's status (/v1/proxies?all=true) is forgotten this long after its "
        "last stream closed (a bare number: seconds; default: %(default)s)",
    )
    serve.add_argument(
        "--status-max-disconnected",
        type=_whole_number,
        default=10_000,
        metavar="N",
        help="remember at most N disconnected proxies, about 1 KB each; past it the one gone longest "
        "is forgotten (0: none; default: %(default)s)",
    )
    serve.add_argument(
        "--recent-events",
        type=_recent_events,
        default=RECENT_EVENTS,
        metavar="N",
        help="events kept in memory for /v1/events and the status page, up to 4 KB each "
        f"(1 to {MAX_RECENT_EVENTS:,}; default: %(default)s)",
    )
    serve.add_argument(
        "--node-group",
        type=_node_group,
        action=Repeatable,
        default=[],
        metavar="NAME[:KIND][@ZONE]=RULE",
        help="clients whose node matches RULE (cluster:PATTERN, id:PATTERN, metadata:KEY=PATTERN, "
        "agent:PATTERN, zone:PATTERN; '*': any characters but '/') are served the snapshot of "
        "group NAME, of KIND envoy (socket listeners; the default), grpc (API listeners for "
        "proxyless gRPC) or rest (for REST polls: EDS and RDS over REST too), in ZONE (they "
        "get only that zone's endpoints of zone_local "
        "services); repeatable, first match wins (REST polls: among rest groups; gRPC streams: "
        "among the others); then built in: gRPC clients to 'grpc', REST polls to 'rest', "
        "others to 'default'",
    )
    tls = serve.add_argument_group(
        "TLS",
        "serve xDS (and the registry API) over TLS; the files are reloaded when they change, without "
        "dropping open streams",
    )
    tls.add_argument(
        "--tls-cert",
        type=Path,
        metavar="FILE",
        help="PEM certificate chain the server presents (with --tls-key: TLS only, ALPN h2, TLS 1.2+)",
    )
    tls.add_argument("--tls-key", type=Path, metavar="FILE", help="PEM private key of --tls-cert")
    tls.add_argument(
        "--client-ca",
        type=Path,
        metavar="FILE",
        help="mTLS on xDS: proxies must present a certificate issued by this PEM CA bundle",
    )
    tls.add_argument(
        "--registry-client-ca",
        type=Path,
        metavar="FILE",
        help="mTLS on the registry API: its clients must present a certificate issued by this CA",
    )
    tls.add_argument(
        "--admin-client-ca",
        type=Path,
        metavar="FILE",
        help="mTLS on the admin API: its clients (`pilotfish status --tls-cert ...`) must present a "
        "certificate issued by this CA",
    )
    tls.add_argument(
        "--authorize-node",
        type=_node_rule,
        action=Repeatable,
        default=[],
        metavar="IDENTITY=NODE",
        help="with --client-ca: a proxy whose certificate identity (SPIFFE URI SAN, else DNS SAN) "
        "matches IDENTITY may claim node ids matching NODE ('*': any characters but '/'; a "
        "capture {name} in IDENTITY takes a non-empty run without '/', and in NODE stands for "
        "what it took: 'spiffe://mesh/ns/{ns}/sa/{sa}={sa}'); repeatable; once given, any other "
        "claim is refused (PERMISSION_DENIED)",
    )
    tls.add_argument(
        "--grant-secret",
        type=_grant,
        action=Repeatable,
        default=[],
        metavar="SECRET=identity:PATTERN|SECRET=node:PATTERN",
        help="SDS secrets whose names match SECRET go to proxies whose certificate identity (needs "
        "--client-ca) or claimed node id (proven only with --authorize-node) matches PATTERN "
        "('*': any characters but '/'); repeatable; a secret no grant covers goes to no proxy",
    )
    tls.add_argument(
        "--grants-file",
        type=Path,
        metavar="FILE",
        help="more SDS grants, in force beside --grant-secret: YAML (JSON if it ends in .json) "
        "'grants: [SECRET=identity:PATTERN, SECRET=node:PATTERN, ...]'; followed as it changes "
        "(within a second; a bad edit is reported, grants_error, and the last good grants kept)",
    )
    tls.add_argument(
        "--tls-reload",
        type=duration,
        default="1s",
        metavar="DURATION",
        help="check the certificate, key and CA files for changes this often (default: %(default)s)",
    )
    _renamed(tls, "--tls-reload-ms", "--tls-reload", unit="ms")
    conns = serve.add_argument_group(
        "xDS connections",
        "what one peer, or all of them, may hold; a connection over a cap is accepted and closed "
        "at once (a failed connection attempt: gRPC clients and Envoy back off)",
    )
    conns.add_argument(
        "--max-connections",
        type=_positive_int,
        metavar="N",
        help="xDS connections held at once, from all peers (default: the open-file limit, which "
        "serve raises to its hard limit, less a tenth of it, at least 128)",
    )
    conns.add_argument(
        "--max-connections-per-address",
        type=_positive_int,
        metavar="N",
        help="xDS connections held at once from one source IP address (default: 4096, or half of "
        "--max-connections if less; raise it for a larger fleet behind one NAT address)",
    )
    conns.add_argument(
        "--handshake-timeout",
        type=duration,
        default="10s",
        metavar="DURATION",
        help="close a connection that has not sent the HTTP/2 preface (magic and SETTINGS) this long "
        "after it was accepted (default: %(default)s)",
    )
    _renamed(conns, "--handshake-timeout-ms", "--handshake-timeout", unit="ms")
    conns.add_argument(
        "--idle-timeout",
        type=duration_or_zero,
        default="1h",
        metavar="DURATION",
        help="close (GOAWAY NO_ERROR) a connection without streams for this long; 0s: never "
        "(default: %(default)s, as Envoy's idle_timeout)",
    )
    _renamed(conns, "--idle-timeout-ms", "--idle-timeout", unit="ms", whole=True)
    http_conns = serve.add_argument_group(
        "HTTP connections",
        "what one peer, or all of them, may hold on the registry API, REST xDS and the admin "
        "API; over a cap a connection is accepted and closed at once (as on the xDS port)",
    )
    for port, what, total, per_address in (
        ("registry", "registry API", "as --max-connections", "as xDS"),
        ("rest", "REST xDS", "as --max-connections", "as xDS"),
        ("admin", "admin API", "256", "64"),
    ):
        http_conns.add_argument(
            f"--{port}-max-connections",
            type=_positive_int,
            metavar="N",
            help=f"{what} connections held at once, from all peers (default: {total})",
        )
        http_conns.add_argument(
            f"--{port}-max-connections-per-address",
            type=_positive_int,
            metavar="N",
            help=f"{what} connections held at once from one source IP address (default: {per_address})",
        )
    serve.add_argument(
        "--event-loop",
        choices=("uvloop", "asyncio"),
        default="uvloop",
        help="uvloop (libuv, faster sockets) or Python's own asyncio loop (default: %(default)s)",
    )

    admin_client = argparse.ArgumentParser(add_help=False)
    environ = os.environ
    admin_client.add_argument(
        "--admin",
        type=_address,
        default=environ.get(ADMIN_VARIABLES["admin"]) or DEFAULT_ADMIN,
        metavar="HOST:PORT",
        help="the admin API of `pilotfish serve` (default: $PILOTFISH_ADMIN, else 127.0.0.1:18001)",
    )
    for flag, key, what in (
        ("--tls-ca", "tls_ca", "the admin API is served over TLS (serve --tls-cert): trust this PEM CA bundle (its "
         "certificate must name HOST)"),
        ("--tls-cert", "tls_cert", "mTLS (serve --admin-client-ca): the PEM certificate chain to present"),
        ("--tls-key", "tls_key", "the PEM private key of --tls-cert"),
        ("--token-file", "token_file", "the admin API wants a token (serve --admin-tokens): send the one in FILE (its "
         "first line); without one, the token in $PILOTFISH_ADMIN_TOKEN"),
    ):  # fmt: skip
        admin_client.add_argument(
            flag,
            type=Path,
            default=environ.get(ADMIN_VARIABLES[key]) or None,
            metavar="FILE",
            help=f"{what} (default: ${ADMIN_VARIABLES[key]})",
        )

    status = commands.add_parser(
        "status",
        parents=[admin_client],
        help="print every connected proxy and, per type, whether it has the latest "
        "configuration (SYNCED, STALE, NACKED, NOT_SENT)",
    )
    status.add_argument("--node", metavar="GLOB", help="only proxies whose node id matches ('*' any characters)")
    status.add_argument("--cluster", metavar="GLOB", help="only proxies whose node cluster matches")
    status.add_argument(
        "--state",
        choices=("SYNCED", "STALE", "NACKED", "NOT_SENT"),
        type=str.upper,
        help="only proxies with a type in this state",
    )
    status.add_argument(
        "--stale-grace",
        type=duration_or_zero,
        default="30s",
        metavar="DURATION",
        help="exit 1 when a proxy has NACKED, or has been STALE (sent a version it has not ACKed) "
        "longer than this (default: %(default)s)",
    )
    status.add_argument(
        "--csds",
        type=_address,
        metavar="HOST:PORT",
        help="read the proxies from this CSDS server (serve --admin-grpc, or the xDS port with --csds-on-xds) "
        "instead of the admin API: what any CSDS client sees (--tls-* and the token as for the admin API; "
        "--node only)",
    )
    status.add_argument(
        "-o",
        "--output",
        choices=("table", "json"),
        default="table",
        help="table, or json: the proxies as the admin API gives them and the problems found (default: %(default)s)",
    )

    wait = commands.add_parser(
        "wait",
        parents=[admin_client],
        help="wait until every connected proxy has ACKed the configuration; exit non-zero "
        "naming the laggards and NACK reasons otherwise",
    )
    target = wait.add_mutually_exclusive_group()
    target.add_argument(
        "--version",
        metavar="V",
        help="wait for the snapshot labelled V (a snapshot file's `version`) to be served and ACKed",
    )
    target.add_argument(
        "--for-current",
        action="store_true",
        help="wait for the current snapshot (the default), once a change being debounced is built",
    )
    wait.add_argument(
        "--timeout",
        type=_seconds,
        default="60s",
        metavar="DURATION",
        help="give up after this long (a bare number: seconds; default: %(default)s)",
    )
    wait.add_argument(
        "--min-proxies",
        type=_whole_number,
        default=1,
        metavar="N",
        help="and until at least N proxies are connected: fewer at the timeout is a failure "
        "(0: none needed; default: %(default)s)",
    )

    commands.add_parser("confirm", parents=[admin_client], help="publish the snapshot the blast-radius guard holds")

    rollout = commands.add_parser(
        "rollout",
        parents=[admin_client],
        help="show where the rollout (serve --rollout) is, or promote, pause, resume or abort it",
    )
    rollout.add_argument(
        "action",
        nargs="?",
        choices=ROLLOUT_ACTIONS,
        default="status",
        help="status (the default): phase, wave, candidate and baseline, who it waits for, what is "
        "held; promote: the current wave passes now; pause: no further wave starts; resume: go on; "
        "abort: roll the candidate back and hold it",
    )
    rollout.add_argument(
        "--reason", metavar="TEXT", help="abort: why (at most 200 characters), recorded with the held candidate"
    )
    rollout.add_argument("--json", action="store_true", help="print the admin API's JSON answer as it is")

    plan = commands.add_parser(
        "plan",
        parents=[admin_client],
        help="show what serving FILE in place of the server's snapshot file would do, publishing "
        "nothing: per node group and type what is added, removed and changed (field by field), "
        "the problems, whether the guard would hold it, what the rollout would do; exit 1 if it "
        "would not be published",
    )
    plan.add_argument("file", type=Path, metavar="FILE", help="the proposed snapshot file (YAML, or JSON: *.json)")
    plan.add_argument(
        "--against",
        type=Path,
        metavar="OLD_FILE",
        help="offline, asking no server (CI): compare with OLD_FILE as a server serving it alone "
        "would; the diff and the validation only",
    )
    plan.add_argument("--json", action="store_true", help="print the plan as JSON (the admin API's answer)")

    validate = commands.add_parser("validate", help="check a snapshot file; print every problem")
    validate.add_argument(
        "--snapshot", type=Path, metavar="FILE", help="the snapshot file to check (as serve --snapshot takes it)"
    )
    validate.add_argument(
        "file", type=Path, nargs="?", metavar="FILE", help="the snapshot file, given without --snapshot"
    )

    boot = commands.add_parser("bootstrap", help="print an Envoy bootstrap that gets everything over ADS (or REST)")
    boot.add_argument(
        "--node-id", required=True, metavar="ID", help="the Envoy's node id (what status and node groups match)"
    )
    boot.add_argument("--cluster", default="pilotfish", metavar="NAME", help="node cluster (default: %(default)s)")
    boot.add_argument(
        "--xds",
        type=_addresses,
        action="extend",
        metavar="HOST:PORT[,HOST:PORT...]",
        help="where pilotfish serves xDS (default: 127.0.0.1:18000); several replicas: repeat "
        "the option or separate them by commas, and Envoy fails over between them",
    )
    boot.add_argument(
        "--envoy-admin-port",
        type=int,
        default=9901,
        metavar="N",
        help="the Envoy's own admin port, on 127.0.0.1 (default: %(default)s)",
    )
    boot.add_argument(
        "--admin-port",
        dest="envoy_admin_port",
        action=Deprecated,
        instead="--envoy-admin-port",
        type=int,
        metavar="N",
        help="deprecated: --envoy-admin-port (--admin is pilotfish's admin API everywhere else)",
    )
    boot.add_argument(
        "--tls-ca",
        metavar="FILE",
        help="reach pilotfish over TLS, trusting this PEM CA bundle for its certificate (path as Envoy sees it)",
    )
    boot.add_argument("--tls-cert", metavar="FILE", help="mTLS: the PEM certificate chain Envoy presents")
    boot.add_argument("--tls-key", metavar="FILE", help="mTLS: the PEM private key of --tls-cert")
    boot.add_argument(
        "--tls-server-name",
        metavar="NAME",
        help="SNI, and the name pilotfish's certificate must carry (default: the host of --xds; "
        "with several replicas give a name every replica's certificate carries)",
    )
    boot.add_argument(
        "--delta",
        action="store_true",
        help="incremental xDS (DELTA_GRPC): only what changed is sent (default: state of the world)",
    )
    boot.add_argument(
        "--rest",
        type=_addresses,
        action="extend",
        metavar="HOST:PORT[,HOST:PORT...]",
        help="poll pilotfish's REST xDS here for clusters and listeners (api_type REST) instead "
        "of ADS over gRPC (--xds is then not used); several replicas as for --xds",
    )
    boot.add_argument(
        "--refresh",
        type=duration,
        default=format_duration(DEFAULT_REST_REFRESH),
        metavar="DURATION",
        help="with --rest: poll this often, plus up to as much again of jitter (default: %(default)s)",
    )
    _renamed(boot, "--refresh-ms", "--refresh", unit="ms")
    boot.add_argument(
        "--lrs",
        action="store_true",
        help="report load to pilotfish over LRS on the xDS port (per cluster: requests that "
        "succeeded, failed and are in flight), which rollouts gate on",
    )
    boot.add_argument(
        "--grpc",
        action="store_true",
        help="print the JSON bootstrap of a proxyless gRPC client (GRPC_XDS_BOOTSTRAP) instead; it "
        "then resolves xds:///NAME to the services with 'grpc: true' (or 'grpc: NAME')",
    )
    boot.add_argument(
        "--runtime-layer",
        action="append",
        default=[],
        metavar="NAME",
        help="ask pilotfish for this runtime layer (RTDS: the snapshot file's runtime section); "
        "repeat for several, later ones override earlier ones; an admin layer comes last",
    )
    boot.add_argument("--zone", default="", metavar="ZONE", help="--grpc: the node's locality zone")
    boot.add_argument("--region", default="", metavar="REGION", help="--grpc: the node's locality region")

    token = commands.add_parser("token", help="make a registry API token, or hash one for --registry-tokens")
    token.add_argument(
        "action",
        choices=("new", "hash"),
        help="new: a fresh token and its tokens-file entry (YAML on stdout, the token in it as a "
        "comment; what to do on stderr); hash: print the sha256 of the token read from stdin (one line)",
    )
    token.add_argument(
        "--name", metavar="NAME", help="new: the token's name in the tokens file (default: NAME, to edit)"
    )
    token.add_argument(
        "--write",
        action="append",
        default=[],
        metavar="SERVICE",
        help="new: the token may register and deregister instances of SERVICE ('*' any characters); repeatable",
    )
    token.add_argument("--read", action="store_true", help="new: the token may read (status, config, the registry)")
    token.add_argument(
        "--admin", action="store_true", help="new: an admin API token that may also confirm and command rollouts"
    )

    demo = commands.add_parser("demo", help="run pilotfish, two upstreams and a real Envoy on examples/demo.yaml")
    demo.add_argument(
        "--snapshot",
        type=Path,
        default=Path("examples/demo.yaml"),
        metavar="FILE",
        help="the snapshot file the demo serves (default: %(default)s)",
    )
    return parser, serve


def _rollout_flags(serve: argparse.ArgumentParser) -> None:
    """``serve --rollout`` and its companions (docs/rollout.md)."""
    group = serve.add_argument_group("progressive delivery (docs/rollout.md)")
    group.add_argument(
        "--rollout",
        metavar="WAVES",
        help="roll each change out in waves, e.g. 'canary=edge-canary-*,5%%,25%%,100%%' (NAME=GLOB, "
        "NAME=group:GROUP, then cumulative shares by a stable hash of the node id, the last 100%%); "
        "default: every change reaches every proxy at once",
    )
    group.add_argument(
        "--rollout-types",
        default="CDS,ECDS,LDS,RDS,SDS,RTDS",  # = RolloutFlags.types
        metavar="TYPES",
        help="the types whose changes roll out in waves; changes to the others reach every proxy at once "
        "(default: %(default)s)",
    )
    group.add_argument(
        "--rollout-ack-timeout",
        type=_seconds,
        default="30s",
        metavar="DURATION",
        help="how long a wave's proxies have to ACK the candidate (a bare number: seconds; default: %(default)s)",
    )
    group.add_argument(
        "--rollout-bake",
        type=_seconds,
        default="30s",
        metavar="DURATION",
        help="how long a wave bakes after it ACKed, its error ratio compared with the baseline's "
        "(a bare number: seconds; default: %(default)s)",
    )
    group.add_argument(
        "--rollout-health",
        choices=["on", "off"],
        default="on",
        help="judge a bake by the proxies' load reports (bootstrap --lrs); off: a bake is only time "
        "(default: %(default)s)",
    )
    group.add_argument(
        "--rollout-min-requests",
        type=_positive_int,
        default=100,
        metavar="N",
        help="requests a side needs before its error ratio decides anything (default: %(default)s)",
    )
    group.add_argument(
        "--rollout-max-error-increase",
        type=float,
        default=1.0,
        metavar="POINTS",
        help="percentage points a wave's error ratio may exceed the baseline's (default: %(default)s)",
    )
    group.add_argument(
        "--rollout-too-little-traffic",
        choices=["pause", "pass"],
        default="pause",
        help="a bake that saw too few requests to judge pauses the rollout, or passes on its ACKs "
        "(default: %(default)s)",
    )
    group.add_argument(
        "--rollout-ignore-cluster",
        action=Repeatable,
        default=[],
        metavar="NAME",
        help="leave this cluster's load reports out of the health gate, as the bootstrap's xds_cluster "
        "always is: the cluster of a hand-written bootstrap's streams to pilotfish (a stream cut there "
        "counts as a failed request); repeatable",
    )


def _validate(path: Path) -> int:
    from pilotfish.sources import load_snapshot

    try:
        snapshot = load_snapshot(path)
    except ConfigError as exc:
        print(exc.describe(), file=sys.stderr)
        return EXIT_INVALID
    except Exception as exc:  # our bug, not the file's: say so in one line, no traceback
        print(f"{path}: pilotfish failed to check this file ({exc!r}); please report it", file=sys.stderr)
        return EXIT_INVALID
    counts = ", ".join(f"{len(ts.resources)} {ts.rtype.key}" for ts in snapshot.types.values())
    print(f"{path}: ok ({counts}; version {snapshot.label()})")
    return EXIT_OK


def _loop_factory(name: str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    if name == "uvloop":
        import uvloop

        return uvloop.new_event_loop
    return None


def _serve(args: argparse.Namespace) -> int:
    from pilotfish.app import ServeSettings, serve
    from pilotfish.app.settings import (
        AdminSettings,
        DockerSettings,
        EtcdSettings,
        EventSettings,
        PolicySettings,
        RegistrySettings,
        RestSettings,
        RolloutFlags,
        SubsetSettings,
        TlsSettings,
        XdsSettings,
    )
    from pilotfish.reconcile import DebounceSettings, GuardSettings, NameSettings
    from pilotfish.sources.registry import SelfPreservation
    from pilotfish.status import StatusLimits
    from pilotfish.transport.aio import ConnectionLimits
    from pilotfish.transport.site import ADMIN_CONNECTIONS, HttpConnectionLimits
    from pilotfish.xds.lrs import LrsSettings

    settings = ServeSettings(
        snapshot=args.snapshot,
        xds=XdsSettings(
            address=args.xds,
            csds=args.csds_on_xds,
            lrs=LrsSettings() if args.lrs_interval is None else LrsSettings(interval=args.lrs_interval),
            connections=ConnectionLimits(
                max_connections=args.max_connections,
                max_connections_per_address=args.max_connections_per_address,
                handshake_timeout=args.handshake_timeout,
                idle_timeout=args.idle_timeout or None,
            ),
        ),
        rest=RestSettings(
            address=args.rest,
            refresh=args.rest_refresh,
            connections=HttpConnectionLimits(
                max_connections=args.rest_max_connections,
                max_connections_per_address=args.rest_max_connections_per_address,
            ),
        ),
        registry=RegistrySettings(
            address=args.registry,
            tokens=args.registry_tokens,
            self_preservation=SelfPreservation(
                enabled=args.registry_self_preservation == "on", share=args.registry_self_preservation_share
            ),
            connections=HttpConnectionLimits(
                max_connections=args.registry_max_connections,
                max_connections_per_address=args.registry_max_connections_per_address,
            ),
        ),
        admin=AdminSettings(
            address=args.admin,
            grpc_address=args.admin_grpc,
            tokens=args.admin_tokens,
            connections=HttpConnectionLimits(
                max_connections=args.admin_max_connections or ADMIN_CONNECTIONS.max_connections,
                max_connections_per_address=args.admin_max_connections_per_address
                or ADMIN_CONNECTIONS.max_connections_per_address,
            ),
        ),
        etcd=EtcdSettings(address=args.etcd, prefix=args.etcd_prefix, keepalive=args.etcd_keepalive),
        docker=DockerSettings(
            engines=tuple(args.docker),
            tls=args.docker_tls,
            tls_ca=args.docker_tls_ca,
            tls_cert=args.docker_tls_cert,
            tls_key=args.docker_tls_key,
        ),
        tls=TlsSettings(
            cert=args.tls_cert,
            key=args.tls_key,
            client_ca=args.client_ca,
            registry_client_ca=args.registry_client_ca,
            admin_client_ca=args.admin_client_ca,
            reload_every=args.tls_reload,
        ),
        policy=PolicySettings(
            authorize_nodes=tuple(args.authorize_node),
            secret_grants=tuple(args.grant_secret),
            grants_file=args.grants_file,
            node_groups=tuple(args.node_group),
        ),
        subsets=SubsetSettings(size=args.subset_size, state_dir=args.state_dir, grace=args.subset_grace),
        events=EventSettings(log=args.event_log, level=args.event_log_level, recent=args.recent_events),
        status_limits=StatusLimits(
            forget_after=args.status_forget_after, max_disconnected=args.status_max_disconnected
        ),
        debounce=DebounceSettings(
            quiet=args.quiet, max_delay=args.max_delay, max_builds_per_s=args.max_builds_per_s, hold=args.flap_hold
        ),
        dns=NameSettings(refresh=args.dns_refresh),
        guard=GuardSettings(
            enabled=args.guard == "on", max_removed_share=args.guard_max_removed, min_count=args.guard_min_count
        ),
        validate_rules=args.validate == "on",
        rollout=RolloutFlags(
            waves=args.rollout,
            types=args.rollout_types,
            ack_timeout=args.rollout_ack_timeout,
            bake=args.rollout_bake,
            health=args.rollout_health == "on",
            min_requests=args.rollout_min_requests,
            max_error_increase=args.rollout_max_error_increase,
            too_little_traffic=args.rollout_too_little_traffic,
            ignore_clusters=tuple(args.rollout_ignore_cluster),
        ),
    )
    try:
        settings.validate()
    except ConfigError as exc:
        for problem in exc.problems:
            print(f"pilotfish serve: {problem.message}", file=sys.stderr)
        return EXIT_USAGE
    if args.print_settings:
        shown = {**dataclasses.asdict(settings), "event_loop": args.event_loop}
        print(json.dumps(shown, indent=2, sort_keys=True, default=str))
        return EXIT_OK
    try:
        with asyncio.Runner(loop_factory=_loop_factory(args.event_loop)) as runner:
            runner.run(serve(settings))
    except ConfigError as exc:
        print(f"{exc.describe()}\nfix the file and start again", file=sys.stderr)
        return EXIT_INVALID
    except OSError as exc:
        print(f"pilotfish: {exc}", file=sys.stderr)
        return EXIT_INVALID
    except KeyboardInterrupt:
        pass
    return EXIT_OK


def _operate(args: argparse.Namespace) -> int:
    """``status``, ``wait``, ``confirm``, ``rollout`` and ``plan``: the commands asking the admin API."""
    from pilotfish.commands import operate

    if args.command == "plan" and args.against is not None:
        return operate.plan_offline(args.file, args.against, as_json=args.json, out=sys.stdout, err=sys.stderr)
    if args.command == "rollout" and args.reason is not None and args.action != "abort":
        print(f"pilotfish rollout {args.action}: --reason is for abort", file=sys.stderr)
        return EXIT_USAGE
    try:
        tls = operate.client_context(ca=args.tls_ca, cert=args.tls_cert, key=args.tls_key)
        token = operate.admin_token(args.token_file, os.environ)
    except (OSError, ValueError) as exc:
        print(f"pilotfish {args.command}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    admin = operate.AdminClient(args.admin, tls=tls, token=token)
    if args.command == "status" and args.csds is not None:
        return operate.csds_command(
            args.csds,
            tls=tls,
            token=token,
            node=args.node,
            as_json=args.output == "json",
            out=sys.stdout,
            err=sys.stderr,
        )
    if args.command == "status":
        return operate.status_command(
            admin,
            node=args.node,
            cluster=args.cluster,
            state=args.state,
            stale_grace=args.stale_grace,
            as_json=args.output == "json",
            out=sys.stdout,
            err=sys.stderr,
        )
    if args.command == "wait":
        return operate.wait_command(
            admin,
            version=args.version,
            timeout=args.timeout,
            min_proxies=args.min_proxies,
            out=sys.stdout,
            err=sys.stderr,
        )
    if args.command == "rollout":
        return operate.rollout_command(
            admin, args.action, reason=args.reason, as_json=args.json, out=sys.stdout, err=sys.stderr
        )
    if args.command == "plan":
        return operate.plan_command(admin, args.file, as_json=args.json, out=sys.stdout, err=sys.stderr)
    return operate.confirm_command(admin, out=sys.stdout, err=sys.stderr)


def _with_settings_file(
    parser: argparse.ArgumentParser, serve: argparse.ArgumentParser, argv: Sequence[str] | None, config: Path
) -> argparse.Namespace | None:
    """``argv`` parsed again over the settings of ``serve --config FILE`` (the command line wins);
    None (the reason printed) when the file cannot be used."""
    try:
        from_file = read_settings(config, serve)
    except SettingsFileError as exc:
        print(f"pilotfish serve: --config {config}: {exc}", file=sys.stderr)
        return None
    serve.set_defaults(**vars(from_file))
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    parser, serve = _parsers()
    args = parser.parse_args(argv)
    if args.command == "serve" and args.config is not None:
        with_file = _with_settings_file(parser, serve, argv, args.config)
        if with_file is None:
            return EXIT_USAGE
        args = with_file
    configure_logging(verbose=args.verbose, json_lines=args.log_format == "json")
    report_warnings(logging.getLogger("pilotfish"))
    if args.command == "validate":
        given = [path for path in (args.snapshot, args.file) if path is not None]
        if len(given) != 1:
            print("pilotfish validate: give the file once: --snapshot FILE (or FILE)", file=sys.stderr)
            return EXIT_USAGE
        return _validate(given[0])
    if args.command == "bootstrap":
        try:
            settings = BootstrapSettings(
                node_id=args.node_id,
                cluster=args.cluster,
                xds=tuple(args.xds or ("127.0.0.1:18000",)),
                admin_port=args.envoy_admin_port,
                tls_ca=args.tls_ca,
                tls_cert=args.tls_cert,
                tls_key=args.tls_key,
                tls_server_name=args.tls_server_name,
                delta=args.delta,
                rest=None if args.rest is None else tuple(args.rest),
                refresh=args.refresh,
                lrs=args.lrs,
                runtime_layers=tuple(args.runtime_layer),
                zone=args.zone,
                region=args.region,
            )
            if args.grpc and (args.delta or args.rest):
                raise ValueError(
                    "--delta and --rest are for Envoy bootstraps; gRPC clients choose their xDS variant themselves"
                )
            text = grpc_bootstrap_json(settings) if args.grpc else bootstrap_yaml(settings)
        except ValueError as exc:
            print(f"pilotfish bootstrap: {exc}", file=sys.stderr)
            return EXIT_USAGE
        sys.stdout.write(text)
        return EXIT_OK
    if args.command == "serve":
        return _serve(args)
    if args.command in ("status", "wait", "confirm", "rollout", "plan"):
        return _operate(args)
    if args.command == "token":
        from pilotfish.api.tokens import NewToken, token_command

        if args.action == "hash" and (args.name or args.write or args.read or args.admin):
            print("pilotfish token hash: --name, --write, --read and --admin are for `token new`", file=sys.stderr)
            return EXIT_USAGE
        new = NewToken(name=args.name or "NAME", write=tuple(args.write), read=args.read, admin=args.admin)
        return token_command(args.action, sys.stdin, sys.stdout, new=new, stderr=sys.stderr)
    if args.command == "demo":
        from pilotfish.commands.demo import run_demo

        return run_demo(args.snapshot)
    return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
