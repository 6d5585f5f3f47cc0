"""The snapshot files the end-to-end tests feed to ``pilotfish serve``.

Two kinds: raw Envoy resources (:func:`write_snapshot`, below) and a ``services:`` section from
which pilotfish builds them (:func:`write_services`).

For raw resources, one builder makes every file the tests use, from a few parameters, so that
each test states only what it changes (an endpoint removed, a body, a version, a bad ``connect_timeout``). The
configuration is the smallest that exercises all four ADS types:

- listener ``ingress`` on 127.0.0.1:<listener_port>, HTTP connection manager using RDS
  ``local_route`` and the router filter;
- route ``/direct`` answers ``direct_body`` itself, ``/api`` goes to cluster ``api`` (rewritten to
  ``/``), everything else to cluster ``web``;
- clusters are EDS clusters over ADS (or REST); their endpoints are upstream ports on 127.0.0.1.

Files are replaced by rename (write a temp file in the same directory, then ``os.replace``), as a
deploy tool would, so the server never sees a half-written file.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from pilotfish.resources.bootstrap import rest_config_source

__all__ = ["LISTENER_NAME", "ROUTE_NAME", "snapshot_document", "write_document", "write_services", "write_snapshot"]

LISTENER_NAME = "ingress"
ROUTE_NAME = "local_route"
_HCM = "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"
_ROUTER = "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"


def snapshot_document(
    *,
    listener_port: int,
    endpoints: Mapping[str, Sequence[int]],
    direct_body: str = "direct v1",
    version: str | None = "1",
    connect_timeout: str = "1s",
    stat_prefix: str = "ingress",
    reordered: bool = False,
    rest_refresh: float | None = None,
) -> dict[str, Any]:
    """The snapshot as a plain mapping.

    ``endpoints`` maps each cluster name to its upstream ports; it must hold ``web`` and ``api``,
    the clusters the routes use. ``connect_timeout`` applies to every cluster. ``reordered``
    gives the same content with clusters and endpoint assignments in reverse order and every
    mapping's keys reversed: a different file, an equal snapshot. ``rest_refresh`` (seconds):
    clusters and the listener poll EDS and RDS over REST at that delay (for an Envoy on REST, which
    has no ADS stream), through the bootstrap's ``xds_cluster``; None: over ADS.
    """

    def source() -> dict[str, Any]:
        return _ads() if rest_refresh is None else rest_config_source(refresh=rest_refresh)

    clusters = [
        {
            "name": name,
            "type": "EDS",
            "connect_timeout": connect_timeout,
            "eds_cluster_config": {"eds_config": source()},
        }
        for name in endpoints
    ]
    assignments = [
        {
            "cluster_name": name,
            "endpoints": [{"lb_endpoints": [{"endpoint": {"address": _address(port)}} for port in ports]}],
        }
        for name, ports in endpoints.items()
    ]
    listener = {
        "name": LISTENER_NAME,
        "address": _address(listener_port),
        "filter_chains": [
            {
                "filters": [
                    {
                        "name": "envoy.filters.network.http_connection_manager",
                        "typed_config": {
                            "@type": _HCM,
                            "stat_prefix": stat_prefix,
                            "rds": {"route_config_name": ROUTE_NAME, "config_source": source()},
                            "http_filters": [{"name": "envoy.filters.http.router", "typed_config": {"@type": _ROUTER}}],
                        },
                    }
                ]
            }
        ],
    }
    route = {
        "name": ROUTE_NAME,
        "virtual_hosts": [
            {
                "name": "all",
                "domains": ["*"],
                "routes": [
                    {
                        "match": {"prefix": "/direct"},
                        "direct_response": {"status": 200, "body": {"inline_string": direct_body}},
                    },
                    {"match": {"prefix": "/api"}, "route": {"cluster": "api", "prefix_rewrite": "/"}},
                    {"match": {"prefix": "/"}, "route": {"cluster": "web"}},
                ],
            }
        ],
    }
    document: dict[str, Any] = {}
    if version is not None:
        document["version"] = version
    document |= {
        "clusters": clusters,
        "endpoints": assignments,
        "listeners": [listener],
        "routes": [route],
    }
    if reordered:
        document["clusters"].reverse()
        document["endpoints"].reverse()
        document = _reverse_keys(document)
    return document


def write_snapshot(path: Path, **params: Any) -> dict[str, Any]:
    """Build the snapshot (see :func:`snapshot_document`) and replace ``path`` with it by rename."""
    document = snapshot_document(**params)
    _replace(path, document)
    return document


def write_services(path: Path, services: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """Replace ``path`` (by rename) with a file holding only a ``services:`` section.

    ``services`` maps each service name to its settings as the file spells them (``listen``,
    ``protocol``, ``endpoints``, ...); pilotfish builds the Envoy resources from them.
    """
    document = {"services": {name: dict(spec) for name, spec in services.items()}}
    _replace(path, document)
    return document


def write_document(path: Path, document: Mapping[str, Any]) -> None:
    """Replace ``path`` (by rename) with ``document`` as YAML: any snapshot, raw resources or services."""
    _replace(path, document)


def many_services(listen_port: int, ports: Mapping[str, Sequence[int]]) -> dict[str, dict[str, Any]]:
    """A ``services:`` mapping: ``web`` listening on ``listen_port`` and every other service
    without a listener (a cluster and its endpoints); ``ports`` maps each name to its endpoints'
    ports on 127.0.0.1."""
    spec: dict[str, dict[str, Any]] = {
        "web": {"listen": f"127.0.0.1:{listen_port}", "endpoints": [f"127.0.0.1:{p}" for p in ports["web"]]}
    }
    for name, endpoints in ports.items():
        if name != "web":
            spec[name] = {"endpoints": [f"127.0.0.1:{p}" for p in endpoints]}
    return spec


def _replace(path: Path, document: Mapping[str, Any]) -> None:
    temp = path.with_name(f".{path.name}.tmp")
    temp.write_text(yaml.safe_dump(document, sort_keys=False))
    os.replace(temp, path)


def _ads() -> dict[str, Any]:
    # A fresh mapping each time: a shared one would be dumped as a YAML anchor and alias.
    return {"ads": {}, "resource_api_version": "V3"}


def _address(port: int) -> dict[str, Any]:
    return {"socket_address": {"address": "127.0.0.1", "port_value": port}}


def _reverse_keys(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: _reverse_keys(value[key]) for key in reversed(list(value))}
    if isinstance(value, list):
        return [_reverse_keys(item) for item in value]
    return value
