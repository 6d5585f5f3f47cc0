"""Envoy bootstraps that get everything from pilotfish over ADS (or by REST polling).

The bootstrap holds only what cannot come over xDS: the node identity, the admin address and the
static ``xds_cluster`` that reaches pilotfish. Two settings matter in production:
``set_node_on_first_message_only`` (Envoy's node, ~60 KB with its extension list, is otherwise
sent on every request), and a short ``retry_back_off`` on the gRPC service, so a restarted
control plane is found again within about a second instead of Envoy's default backoff of up to
~30 s.

With ``tls_ca`` the ``xds_cluster`` speaks TLS (an ``UpstreamTlsContext`` on its transport socket:
ALPN ``h2``, TLS 1.2+, SNI) and checks pilotfish's certificate against that CA *and* its name: a
SAN equal to ``tls_server_name`` (default: the host of ``xds``; an IP address is matched as an IP
SAN). Without the name check any certificate from the CA would do, e.g. another service's. With
``tls_cert`` and ``tls_key`` Envoy presents its own certificate (mTLS). The files are read by Envoy
at start-up: restart (or hot-restart) Envoy to rotate them.

With ``rest`` Envoy polls CDS and LDS over REST (``api_type: REST``, HTTP/1.1 + JSON) every
``refresh`` seconds instead of holding an ADS stream; the clusters and listeners it receives must
point EDS and RDS at REST too (:func:`rest_config_source`), as ``ads: {}`` needs an ADS stream.
Clusters and listeners built from ``services:`` do, for the node group of REST pollers
(:mod:`pilotfish.server.groups`): with :data:`XDS_CLUSTER` and the server's refresh delay
(``serve --rest-refresh-ms``, default :data:`DEFAULT_REST_REFRESH` as here), through this very
function.

:func:`grpc_bootstrap` is the same for a proxyless gRPC client (the JSON file ``GRPC_XDS_BOOTSTRAP``
names, gRFC A27): the xDS server (``xds_v3``; insecure, or TLS with A65's certificate files), and
the node with its locality (grpc-js insists on one; a node group may select on its zone).
"""

from __future__ import annotations

import ipaddress
import json
from dataclasses import dataclass
from typing import Any

import yaml

__all__ = ["DEFAULT_REST_REFRESH", "XDS_CLUSTER", "BootstrapSettings", "bootstrap", "bootstrap_yaml",
           "grpc_bootstrap", "grpc_bootstrap_json", "rest_config_source", "split_address"]

XDS_CLUSTER = "xds_cluster"
"""The static cluster of a bootstrap that reaches pilotfish; REST config sources name it."""
DEFAULT_REST_REFRESH = 1.0
"""Seconds between REST polls, in a bootstrap (``--refresh-ms``) and in the EDS and RDS config
sources served to REST pollers (``serve --rest-refresh-ms``) alike."""


def split_address(address: str) -> tuple[str, int]:
    """``host:port`` (``[v6]:port`` too) -> (host, port); ValueError naming what is wrong."""
    host, sep, port = address.rpartition(":")
    if not sep or not host:
        raise ValueError(f"{address!r} is not HOST:PORT")
    host = host.strip("[]")
    if not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"{address!r}: port must be a number from 0 to 65535")
    return host, int(port)


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
    xds: str = "127.0.0.1:18000"
    """Where pilotfish serves xDS."""
    admin_port: int = 9901
    """Envoy's admin interface port, on 127.0.0.1."""
    tls_ca: str | None = None
    """PEM CA bundle that pilotfish's certificate must chain to; None: plaintext xDS."""
    tls_cert: str | None = None
    """PEM certificate chain Envoy presents to pilotfish (mTLS); needs :attr:`tls_key`."""
    tls_key: str | None = None
    """PEM private key of :attr:`tls_cert`."""
    tls_server_name: str | None = None
    """SNI sent, and the SAN pilotfish's certificate must carry; None: the host of :attr:`xds`."""
    delta: bool = False
    """Incremental xDS (``DELTA_GRPC``): each response carries only what changed, and a
    reconnecting Envoy says what it has. Otherwise state of the world (``GRPC``)."""
    rest: str | None = None
    """Poll pilotfish's REST xDS at this ``host:port`` for clusters and listeners (``api_type:
    REST``) instead of ADS over gRPC; :attr:`xds` is then not used."""
    refresh: float = DEFAULT_REST_REFRESH
    """With :attr:`rest`: seconds between polls (Envoy adds up to as much again of jitter)."""
    region: str = ""
    """The node's locality region (gRPC bootstraps)."""
    zone: str = ""
    """The node's locality zone (gRPC bootstraps; ``--node-group NAME=zone:PATTERN`` selects on it)."""

    def __post_init__(self) -> None:
        if self.rest is not None and self.delta:
            raise ValueError("--rest and --delta exclude each other: REST polls are state of the world")
        if not self.refresh > 0:
            raise ValueError("the REST refresh delay must be positive")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("give both a TLS certificate and key (--tls-cert, --tls-key), or neither")
        if self.tls_ca is None and (self.tls_cert is not None or self.tls_server_name is not None):
            raise ValueError("a client certificate or server name needs TLS: give --tls-ca FILE (the CA of "
                             "pilotfish's certificate) too")


def _tls_transport_socket(settings: BootstrapSettings, host: str) -> dict[str, Any]:
    name = settings.tls_server_name or host
    common: dict[str, Any] = {
        "alpn_protocols": ["h2"] if settings.rest is None else ["http/1.1"],
        "tls_params": {"tls_minimum_protocol_version": "TLSv1_2"},
        "validation_context": {
            "trusted_ca": {"filename": settings.tls_ca},
            "match_typed_subject_alt_names": [{
                "san_type": "IP_ADDRESS" if _is_ip(name) else "DNS",
                "matcher": {"exact": name},
            }],
        },
    }
    if settings.tls_cert is not None:
        common["tls_certificates"] = [{
            "certificate_chain": {"filename": settings.tls_cert},
            "private_key": {"filename": settings.tls_key},
        }]
    tls: dict[str, Any] = {
        "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext",
        "common_tls_context": common,
    }
    if not _is_ip(name):  # SNI carries host names only (RFC 6066 section 3)
        tls["sni"] = name
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


def bootstrap(settings: BootstrapSettings) -> dict[str, Any]:
    """The bootstrap as plain values (Envoy's JSON shape)."""
    if settings.rest is not None:
        return _rest_bootstrap(settings)
    host, port = split_address(settings.xds)
    config: dict[str, Any] = {
        "node": {"id": settings.node_id, "cluster": settings.cluster},
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": settings.admin_port}}},
        "dynamic_resources": {
            "ads_config": {
                "api_type": "DELTA_GRPC" if settings.delta else "GRPC",
                "transport_api_version": "V3",
                "set_node_on_first_message_only": True,
                "grpc_services": [{
                    "envoy_grpc": {
                        "cluster_name": XDS_CLUSTER,
                        "retry_policy": {"retry_back_off": {"base_interval": "0.1s", "max_interval": "1s"}},
                    },
                }],
            },
            "cds_config": {"ads": {}, "resource_api_version": "V3"},
            "lds_config": {"ads": {}, "resource_api_version": "V3"},
        },
        "static_resources": {
            "clusters": [{
                "name": XDS_CLUSTER,
                "type": "STATIC" if _is_ip(host) else "STRICT_DNS",
                "connect_timeout": "1s",
                "typed_extension_protocol_options": {
                    "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                        "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                        "explicit_http_config": {
                            "http2_protocol_options": {
                                "connection_keepalive": {"interval": "30s", "timeout": "5s"},
                            },
                        },
                    },
                },
                "load_assignment": {
                    "cluster_name": XDS_CLUSTER,
                    "endpoints": [{"lb_endpoints": [{"endpoint": {"address": {
                        "socket_address": {"address": host, "port_value": port},
                    }}}]}],
                },
            }],
        },
    }
    if settings.tls_ca is not None:
        config["static_resources"]["clusters"][0]["transport_socket"] = _tls_transport_socket(settings, host)
    return config


def _rest_bootstrap(settings: BootstrapSettings) -> dict[str, Any]:
    """CDS and LDS polled over REST (HTTP/1.1 + JSON) from the static ``xds_cluster``."""
    assert settings.rest is not None
    host, port = split_address(settings.rest)
    cluster: dict[str, Any] = {
        "name": XDS_CLUSTER,
        "type": "STATIC" if _is_ip(host) else "STRICT_DNS",
        "connect_timeout": "1s",
        "load_assignment": {
            "cluster_name": XDS_CLUSTER,
            "endpoints": [{"lb_endpoints": [{"endpoint": {"address": {
                "socket_address": {"address": host, "port_value": port},
            }}}]}],
        },
    }
    if settings.tls_ca is not None:
        cluster["transport_socket"] = _tls_transport_socket(settings, host)
    return {
        "node": {"id": settings.node_id, "cluster": settings.cluster},
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": settings.admin_port}}},
        "dynamic_resources": {
            "cds_config": rest_config_source(refresh=settings.refresh),
            "lds_config": rest_config_source(refresh=settings.refresh),
        },
        "static_resources": {"clusters": [cluster]},
    }


def bootstrap_yaml(settings: BootstrapSettings) -> str:
    return yaml.safe_dump(bootstrap(settings), sort_keys=False)


def grpc_bootstrap(settings: BootstrapSettings) -> dict[str, Any]:
    """The gRPC xDS bootstrap (``GRPC_XDS_BOOTSTRAP``) as plain values. gRPC has no setting for a
    TLS server name (it checks the host of ``xds``), so :attr:`BootstrapSettings.tls_server_name`
    is refused here."""
    if settings.tls_server_name is not None:
        raise ValueError("a gRPC bootstrap cannot set the TLS server name: gRPC checks pilotfish's certificate "
                         "against the host of --xds")
    split_address(settings.xds)
    creds: dict[str, Any] = {"type": "insecure"}
    if settings.tls_ca is not None:
        config = {"ca_certificate_file": settings.tls_ca}
        if settings.tls_cert is not None and settings.tls_key is not None:
            config.update(certificate_file=settings.tls_cert, private_key_file=settings.tls_key)
        creds = {"type": "tls", "config": config}
    return {
        "xds_servers": [{"server_uri": settings.xds, "channel_creds": [creds], "server_features": ["xds_v3"]}],
        "node": {
            "id": settings.node_id,
            "cluster": settings.cluster,
            "locality": {"region": settings.region, "zone": settings.zone},
        },
    }


def grpc_bootstrap_json(settings: BootstrapSettings) -> str:
    return json.dumps(grpc_bootstrap(settings), indent=2) + "\n"
