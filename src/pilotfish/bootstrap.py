"""Envoy bootstraps that get everything from pilotfish over ADS.

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
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from typing import Any

import yaml

__all__ = ["BootstrapSettings", "bootstrap", "bootstrap_yaml", "split_address"]


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

    def __post_init__(self) -> None:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("give both a TLS certificate and key (--tls-cert, --tls-key), or neither")
        if self.tls_ca is None and (self.tls_cert is not None or self.tls_server_name is not None):
            raise ValueError("a client certificate or server name needs TLS: give --tls-ca FILE (the CA of "
                             "pilotfish's certificate) too")


def _tls_transport_socket(settings: BootstrapSettings, host: str) -> dict[str, Any]:
    name = settings.tls_server_name or host
    common: dict[str, Any] = {
        "alpn_protocols": ["h2"],
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


def bootstrap(settings: BootstrapSettings) -> dict[str, Any]:
    """The bootstrap as plain values (Envoy's JSON shape)."""
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
                        "cluster_name": "xds_cluster",
                        "retry_policy": {"retry_back_off": {"base_interval": "0.1s", "max_interval": "1s"}},
                    },
                }],
            },
            "cds_config": {"ads": {}, "resource_api_version": "V3"},
            "lds_config": {"ads": {}, "resource_api_version": "V3"},
        },
        "static_resources": {
            "clusters": [{
                "name": "xds_cluster",
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
                    "cluster_name": "xds_cluster",
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


def bootstrap_yaml(settings: BootstrapSettings) -> str:
    return yaml.safe_dump(bootstrap(settings), sort_keys=False)
