"""Envoy bootstraps that get everything from pilotfish over ADS (or by REST polling).

The bootstrap holds only what cannot come over xDS: the node identity, the admin address and the
static ``xds_cluster`` that reaches pilotfish. Two settings matter in production:
``set_node_on_first_message_only`` (Envoy's node, ~60 KB with its extension list, is otherwise
sent on every request), and a short ``retry_back_off`` on the gRPC service, so a restarted
control plane is found again within about a second instead of Envoy's default backoff of up to
~30 s.

Several replicas: ``xds`` (and ``rest``) may name several ``host:port`` (a tuple, or one string
separated by commas). Every one becomes an endpoint of the ``xds_cluster``; the ADS stream is one
gRPC stream on one HTTP/2 connection to one of them (round-robin picks it). When that replica dies
the stream ends, and outlier detection (:data:`FAILOVER_OUTLIER_DETECTION`) ejects the replica at
once: Envoy 1.40 counts a connection reset under an open stream, like a refused or timed-out
connection (``connect_timeout`` 1 s), as a local-origin failure. The retry, ``retry_back_off``
later, so goes to a live replica. Versions are content hashes, identical on every replica, so the
replica Envoy lands on sends it nothing it already has (tests/e2e/test_replica_failover.py).

With ``tls_ca`` the ``xds_cluster`` speaks TLS (an ``UpstreamTlsContext`` on its transport socket:
ALPN ``h2``, TLS 1.2+, SNI) and checks pilotfish's certificate against that CA *and* its name: a
SAN equal to ``tls_server_name`` (default: the host of ``xds``; an IP address is matched as an IP
SAN). Without the name check any certificate from the CA would do, e.g. another service's. With
several replicas give ``tls_server_name``, a name every replica's certificate carries; without it
each distinct host is an accepted SAN (any replica's certificate passes on a connection to any
replica, all of them being the same control plane), and for host names Envoy sends each
endpoint's own name as SNI (``auto_host_sni``). With
``tls_cert`` and ``tls_key`` Envoy presents its own certificate (mTLS). The files are read by Envoy
at start-up: restart (or hot-restart) Envoy to rotate them.

With ``rest`` Envoy polls CDS and LDS over REST (``api_type: REST``, HTTP/1.1 + JSON) every
``refresh`` seconds instead of holding an ADS stream; the clusters and listeners it receives must
point EDS and RDS at REST too (:func:`rest_config_source`), as ``ads: {}`` needs an ADS stream.
Clusters and listeners built from ``services:`` do, for the node group of REST pollers
(:mod:`pilotfish.policy.groups`): with :data:`XDS_CLUSTER` and the server's refresh delay
(``serve --rest-refresh-ms``, default :data:`DEFAULT_REST_REFRESH` as here), through this very
function.

:func:`grpc_bootstrap` is the same for a proxyless gRPC client (the JSON file ``GRPC_XDS_BOOTSTRAP``
names, gRFC A27): the xDS server (``xds_v3``; insecure, or TLS with A65's certificate files), and
the node with its locality (grpc-js insists on one; a node group may select on its zone). Several
addresses become several ``xds_servers`` entries, in order. gRPC treats them as gRFC A71 says
(grpcio 1.85 does, with no opt-in: tests/e2e/test_replica_failover.py): it talks to the first,
turns to the next only while the first is unreachable *and* a channel watches a resource it has
not got yet, and goes back to the first once that answers again. So a client that has its
configuration keeps it, without updates, while its first server is down. One name that resolves
to every replica (its channel to the xDS server may then reconnect to another address; not tested
here) or a load balancer in front of the replicas avoids that.
"""

from __future__ import annotations

import ipaddress
import json
from dataclasses import dataclass
from typing import Any

import yaml

from pilotfish.resources.types import RESOURCE_IN_SOTW, SUPPORTS_TTL

__all__ = [
    "DEFAULT_REST_REFRESH",
    "FAILOVER_OUTLIER_DETECTION",
    "XDS_CLUSTER",
    "BootstrapSettings",
    "bootstrap",
    "bootstrap_yaml",
    "grpc_bootstrap",
    "grpc_bootstrap_json",
    "rest_config_source",
    "split_address",
    "split_addresses",
]

XDS_CLUSTER = "xds_cluster"
"""The static cluster of a bootstrap that reaches pilotfish; REST config sources name it."""
DEFAULT_REST_REFRESH = 1.0
"""Seconds between REST polls, in a bootstrap (``--refresh-ms``) and in the EDS and RDS config
sources served to REST pollers (``serve --rest-refresh-ms``) alike."""

FAILOVER_OUTLIER_DETECTION: dict[str, Any] = {
    "split_external_local_origin_errors": True,
    "consecutive_local_origin_failure": 1,
    "enforcing_consecutive_local_origin_failure": 100,
    "base_ejection_time": "5s",
    "max_ejection_time": "30s",
    "max_ejection_percent": 100,
    "consecutive_5xx": 0,
    "enforcing_consecutive_5xx": 0,
    "enforcing_success_rate": 0,
    "enforcing_consecutive_gateway_failure": 0,
}
"""Outlier detection of a ``xds_cluster`` with several replicas: one local-origin failure (a refused
or timed-out connection, or the connection reset under the ADS stream: the replica is down) ejects
that replica for 5 s (5 s more each time it is ejected again, up
to 30 s), so the retries of the ADS stream go to live ones; replies are never counted (an ADS
stream has no status to judge until it ends, and a replica's gRPC error is not a dead replica).
``max_ejection_percent`` 100: with every replica down all may be ejected, and Envoy then balances
over all of them anyway (below its panic threshold, 50 % healthy), so it keeps trying."""


def split_address(address: str) -> tuple[str, int]:
    """``host:port`` (``[v6]:port`` too) -> (host, port); ValueError naming what is wrong."""
    host, sep, port = address.rpartition(":")
    if not sep or not host:
        raise ValueError(f"{address!r} is not HOST:PORT")
    host = host.strip("[]")
    if not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"{address!r}: port must be a number from 0 to 65535")
    return host, int(port)


def split_addresses(value: str | tuple[str, ...]) -> tuple[str, ...]:
    """One or more ``host:port``, as a tuple or one string separated by commas; each checked by
    :func:`split_address`. ValueError on none, a malformed one or one given twice."""
    parts = value.split(",") if isinstance(value, str) else value
    addresses = tuple(part.strip() for part in parts)
    if not addresses or any(not address for address in addresses):
        raise ValueError(f"{value!r}: give one or more HOST:PORT, separated by commas")
    for address in addresses:
        split_address(address)
    if len(set(addresses)) != len(addresses):
        raise ValueError(f"{value!r}: an address is given twice")
    return addresses


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


@dataclass(frozen=True, slots=True, kw_only=True)
class BootstrapSettings:
    node_id: str
    """The proxy's node id (unique per proxy; shown in pilotfish's logs and status)."""
    cluster: str = "pilotfish"
    """The node's service cluster (``--service-cluster``)."""
    xds: str | tuple[str, ...] = "127.0.0.1:18000"
    """Where pilotfish serves xDS: one ``host:port``, or every replica's (a tuple, or separated by
    commas); Envoy fails over between them."""
    admin_port: int = 9901
    """Envoy's admin interface port, on 127.0.0.1."""
    tls_ca: str | None = None
    """PEM CA bundle that pilotfish's certificate must chain to; None: plaintext xDS."""
    tls_cert: str | None = None
    """PEM certificate chain Envoy presents to pilotfish (mTLS); needs :attr:`tls_key`."""
    tls_key: str | None = None
    """PEM private key of :attr:`tls_cert`."""
    tls_server_name: str | None = None
    """SNI sent, and the SAN pilotfish's certificate must carry; None: the host of :attr:`xds` (with
    several replicas: the host of each)."""
    delta: bool = False
    """Incremental xDS (``DELTA_GRPC``): each response carries only what changed, and a
    reconnecting Envoy says what it has. Otherwise state of the world (``GRPC``)."""
    rest: str | tuple[str, ...] | None = None
    """Poll pilotfish's REST xDS at this ``host:port`` (or these, like :attr:`xds`) for clusters and
    listeners (``api_type: REST``) instead of ADS over gRPC; :attr:`xds` is then not used."""
    refresh: float = DEFAULT_REST_REFRESH
    """With :attr:`rest`: seconds between polls (Envoy adds up to as much again of jitter)."""
    lrs: bool = False
    """Report load to pilotfish (LRS, on the xDS port: ``cluster_manager.load_stats_config``):
    per cluster, the requests that succeeded, failed and are in flight, every interval the
    server asks for (a rollout's gates compare a wave's error ratio with the baseline's)."""
    runtime_layers: tuple[str, ...] = ()
    """RTDS layers to ask pilotfish for (the snapshot file's ``runtime`` section), in order, each
    overriding the ones before it; after them an admin layer, so that ``/runtime_modify`` on
    Envoy's admin port still overrides for a test."""
    region: str = ""
    """The node's locality region (gRPC bootstraps)."""
    zone: str = ""
    """The node's locality zone (gRPC bootstraps; ``--node-group NAME=zone:PATTERN`` selects on it)."""

    @property
    def xds_addresses(self) -> tuple[str, ...]:
        """:attr:`xds`, one ``host:port`` each."""
        return split_addresses(self.xds)

    @property
    def rest_addresses(self) -> tuple[str, ...]:
        """:attr:`rest`, one ``host:port`` each (none without REST)."""
        return () if self.rest is None else split_addresses(self.rest)

    def __post_init__(self) -> None:
        self.xds_addresses  # noqa: B018  (checks every address: a bad one is a ValueError now, not later)
        self.rest_addresses  # noqa: B018
        if self.rest is not None and self.delta:
            raise ValueError("--rest and --delta exclude each other: REST polls are state of the world")
        if not self.refresh > 0:
            raise ValueError("the REST refresh delay must be positive")
        if self.rest is not None and self.lrs:
            raise ValueError(
                "--lrs needs a gRPC connection to the xDS port (load reports are a gRPC stream): "
                "it does not go with --rest"
            )
        if self.runtime_layers and self.rest is not None:
            raise ValueError(
                "--runtime-layer needs ADS (runtime layers are served over gRPC): it does not go with --rest"
            )
        if len(set(self.runtime_layers)) != len(self.runtime_layers) or "admin" in self.runtime_layers:
            raise ValueError("--runtime-layer names must differ from each other and from 'admin' (the admin layer)")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("give both a TLS certificate and key (--tls-cert, --tls-key), or neither")
        if self.tls_ca is None and (self.tls_cert is not None or self.tls_server_name is not None):
            raise ValueError(
                "a client certificate or server name needs TLS: give --tls-ca FILE (the CA of "
                "pilotfish's certificate) too"
            )


def _tls_transport_socket(settings: BootstrapSettings, hosts: list[str]) -> dict[str, Any]:
    names = [settings.tls_server_name] if settings.tls_server_name else list(dict.fromkeys(hosts))
    common: dict[str, Any] = {
        "alpn_protocols": ["h2"] if settings.rest is None else ["http/1.1"],
        "tls_params": {"tls_minimum_protocol_version": "TLSv1_2"},
        "validation_context": {
            "trusted_ca": {"filename": settings.tls_ca},
            "match_typed_subject_alt_names": [
                {"san_type": "IP_ADDRESS" if _is_ip(name) else "DNS", "matcher": {"exact": name}} for name in names
            ],
        },
    }
    if settings.tls_cert is not None:
        common["tls_certificates"] = [
            {
                "certificate_chain": {"filename": settings.tls_cert},
                "private_key": {"filename": settings.tls_key},
            }
        ]
    tls: dict[str, Any] = {
        "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext",
        "common_tls_context": common,
    }
    # SNI carries host names only (RFC 6066 section 3).
    if len(names) == 1 and not _is_ip(names[0]):
        tls["sni"] = names[0]
    elif not all(_is_ip(name) for name in names):
        tls["auto_host_sni"] = True  # each replica's own host name (STRICT_DNS knows it), none for an IP
    return {"name": "envoy.transport_sockets.tls", "typed_config": tls}


def rest_config_source(*, cluster: str = XDS_CLUSTER, refresh: float = DEFAULT_REST_REFRESH) -> dict[str, Any]:
    """A ``ConfigSource`` polling pilotfish's REST xDS through the static ``cluster`` every
    ``refresh`` seconds: what CDS and LDS use in a REST bootstrap, and what the EDS and RDS
    config sources of clusters and listeners served to a REST-only Envoy must say (``ads: {}``
    needs an ADS stream it does not have)."""
    return {
        "api_config_source": {
            "api_type": "REST",
            "transport_api_version": "V3",
            "cluster_names": [cluster],
            "refresh_delay": f"{refresh:g}s",
        },
        "resource_api_version": "V3",
    }


def _xds_cluster(settings: BootstrapSettings, addresses: tuple[str, ...], *, http2: bool) -> dict[str, Any]:
    """The static cluster reaching pilotfish at every one of ``addresses`` (see the module doc)."""
    hosts = [split_address(address) for address in addresses]
    cluster: dict[str, Any] = {
        "name": XDS_CLUSTER,
        "type": "STATIC" if all(_is_ip(host) for host, _ in hosts) else "STRICT_DNS",
        "connect_timeout": "1s",
    }
    if cluster["type"] == "STRICT_DNS":
        # Envoy's default (AUTO) takes a name's IPv6 address when there is one: `localhost` became
        # [::1], refused by a pilotfish listening on 127.0.0.1. IPv4 first; IPv6 if that is all.
        cluster["dns_lookup_family"] = "V4_PREFERRED"
    if http2:
        cluster["typed_extension_protocol_options"] = {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                "explicit_http_config": {
                    "http2_protocol_options": {
                        "connection_keepalive": {"interval": "30s", "timeout": "5s"},
                    },
                },
            },
        }
    cluster["load_assignment"] = {
        "cluster_name": XDS_CLUSTER,
        "endpoints": [
            {
                "lb_endpoints": [
                    {"endpoint": {"address": {"socket_address": {"address": host, "port_value": port}}}}
                    for host, port in hosts
                ]
            }
        ],
    }
    if len(hosts) > 1:
        cluster["outlier_detection"] = dict(FAILOVER_OUTLIER_DETECTION)
    if settings.tls_ca is not None:
        cluster["transport_socket"] = _tls_transport_socket(settings, [host for host, _ in hosts])
    return cluster


def bootstrap(settings: BootstrapSettings) -> dict[str, Any]:
    """The bootstrap as plain values (Envoy's JSON shape)."""
    if settings.rest is not None:
        return _rest_bootstrap(settings)
    config: dict[str, Any] = {
        # Envoy announces no client features of its own: these say it takes resources with TTLs
        # (wrapped in a Resource over SotW), so pilotfish sends the TTLs the snapshot file sets.
        "node": {
            "id": settings.node_id,
            "cluster": settings.cluster,
            "client_features": [SUPPORTS_TTL, RESOURCE_IN_SOTW[0]],
        },
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": settings.admin_port}}},
        "dynamic_resources": {
            "ads_config": {
                "api_type": "DELTA_GRPC" if settings.delta else "GRPC",
                "transport_api_version": "V3",
                "set_node_on_first_message_only": True,
                "grpc_services": [
                    {
                        "envoy_grpc": {
                            "cluster_name": XDS_CLUSTER,
                            "retry_policy": {"retry_back_off": {"base_interval": "0.1s", "max_interval": "1s"}},
                        },
                    }
                ],
            },
            "cds_config": {"ads": {}, "resource_api_version": "V3"},
            "lds_config": {"ads": {}, "resource_api_version": "V3"},
        },
        "static_resources": {"clusters": [_xds_cluster(settings, settings.xds_addresses, http2=True)]},
    }
    if settings.runtime_layers:
        config["layered_runtime"] = {
            "layers": [
                *(
                    {
                        "name": name,
                        "rtds_layer": {"name": name, "rtds_config": {"ads": {}, "resource_api_version": "V3"}},
                    }
                    for name in settings.runtime_layers
                ),
                {"name": "admin", "admin_layer": {}},
            ]
        }
    if settings.lrs:
        config["cluster_manager"] = {
            "load_stats_config": {
                "api_type": "GRPC",
                "transport_api_version": "V3",
                "grpc_services": [{"envoy_grpc": {"cluster_name": XDS_CLUSTER}}],
            }
        }
    return config


def _rest_bootstrap(settings: BootstrapSettings) -> dict[str, Any]:
    """CDS and LDS polled over REST (HTTP/1.1 + JSON) from the static ``xds_cluster``."""
    cluster = _xds_cluster(settings, settings.rest_addresses, http2=False)
    return {
        "node": {"id": settings.node_id, "cluster": settings.cluster},
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": settings.admin_port}}},
        "dynamic_resources": {
            "cds_config": rest_config_source(refresh=settings.refresh),
            "lds_config": rest_config_source(refresh=settings.refresh),
        },
        "static_resources": {"clusters": [cluster]},
    }


class _EnvoyYamlDumper(yaml.SafeDumper):
    """PyYAML writes ``y`` and ``n`` bare (its resolver follows YAML 1.2 there), but Envoy's YAML
    parser reads them as booleans, as YAML 1.1 does: a node id ``n`` became ``false``. Those are
    quoted too."""


def _string(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "'" if value in _YAML11_BOOLEANS else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_YAML11_BOOLEANS = frozenset({"y", "Y", "n", "N"})
_EnvoyYamlDumper.add_representer(str, _string)


def bootstrap_yaml(settings: BootstrapSettings) -> str:
    return yaml.dump(bootstrap(settings), Dumper=_EnvoyYamlDumper, sort_keys=False)


def grpc_bootstrap(settings: BootstrapSettings) -> dict[str, Any]:
    """The gRPC xDS bootstrap (``GRPC_XDS_BOOTSTRAP``) as plain values. gRPC has no setting for a
    TLS server name (it checks the host of ``xds``), so :attr:`BootstrapSettings.tls_server_name`
    is refused here."""
    if settings.tls_server_name is not None:
        raise ValueError(
            "a gRPC bootstrap cannot set the TLS server name: gRPC checks pilotfish's certificate "
            "against the host of --xds"
        )
    if settings.lrs:
        raise ValueError(
            "a gRPC client reports load for the clusters that ask it to (lrs_server in CDS, which "
            "serve --rollout gives the clusters of gRPC node groups), not from its bootstrap: "
            "leave out --lrs with --grpc"
        )
    creds: dict[str, Any] = {"type": "insecure"}
    if settings.tls_ca is not None:
        config = {"ca_certificate_file": settings.tls_ca}
        if settings.tls_cert is not None and settings.tls_key is not None:
            config.update(certificate_file=settings.tls_cert, private_key_file=settings.tls_key)
        creds = {"type": "tls", "config": config}
    return {
        "xds_servers": [
            {"server_uri": address, "channel_creds": [creds], "server_features": ["xds_v3"]}
            for address in settings.xds_addresses
        ],
        "node": {
            "id": settings.node_id,
            "cluster": settings.cluster,
            "locality": {"region": settings.region, "zone": settings.zone},
        },
    }


def grpc_bootstrap_json(settings: BootstrapSettings) -> str:
    return json.dumps(grpc_bootstrap(settings), indent=2) + "\n"
