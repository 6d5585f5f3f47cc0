"""The configuration the benchmarks serve: N services with M endpoints each, some with a listener.

Every benchmark (pilotfish, the naive baseline, Sovereign) serves content made here, so they all
serve the same clusters and endpoints. A snapshot file is written as JSON (fast to parse) and
replaced atomically (write to a temp file, then rename), as a deploy tool would.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

__all__ = ["Workload", "endpoint_address", "service_name", "write_atomically"]

_DUMPER: Any = getattr(yaml, "CSafeDumper", yaml.SafeDumper)


def service_name(index: int) -> str:
    return f"svc-{index:05d}"


def endpoint_address(service: int, endpoint: int) -> tuple[str, int]:
    """A distinct address per (service, endpoint); never dialled by simulated proxies."""
    return f"10.{(service >> 8) & 255}.{service & 255}.{1 + endpoint % 250}", 8000 + endpoint // 250


@dataclass(frozen=True, slots=True, kw_only=True)
class Workload:
    services: int = 100
    """Clusters (one per service)."""
    endpoints: int = 4
    """Endpoints per service."""
    listeners: int = 10
    """How many of the services get an HTTP listener (and so a route configuration)."""
    listen_base_port: int = 20000
    """Listener i listens on 127.0.0.1:(base + i); simulated proxies bind nothing."""
    raw: str = ""
    """The file's form: "" the ``services`` model (as JSON); ``json`` or ``yaml``: raw Envoy EDS
    clusters and their ClusterLoadAssignments, as a generated file writes them (no listeners)."""

    @property
    def suffix(self) -> str:
        """The snapshot file's suffix (pilotfish reads a ``.json`` file as JSON, others as YAML)."""
        return ".yaml" if self.raw == "yaml" else ".json"

    def describe(self) -> str:
        if self.raw:
            return f"{self.services} raw EDS clusters x {self.endpoints} endpoints in {self.raw}"
        return (
            f"{self.services} clusters x {self.endpoints} endpoints, {self.listeners} HTTP listeners "
            f"(+ {self.listeners} route configs)"
        )

    def services_section(
        self,
        *,
        extra_endpoint: tuple[str, int] | None = None,
        extra_services: int = 0,
        connect_timeout: str | None = None,
    ) -> dict[str, Any]:
        """The ``services:`` mapping; ``extra_endpoint`` is added to the first service, and so is
        ``connect_timeout`` (e.g. ``2s``: changing it changes that cluster and nothing else, a
        CDS-only change)."""
        out: dict[str, Any] = {}
        for i in range(self.services + extra_services):
            endpoints: list[Any] = [f"{h}:{p}" for h, p in (endpoint_address(i, e) for e in range(self.endpoints))]
            if i == 0 and extra_endpoint is not None:
                endpoints.append(f"{extra_endpoint[0]}:{extra_endpoint[1]}")
            service: dict[str, Any] = {"endpoints": endpoints}
            if i == 0 and connect_timeout is not None:
                service["connect_timeout"] = connect_timeout
            if i < self.listeners or i >= self.services:
                service["listen"] = f"127.0.0.1:{self.listen_base_port + i}"
            out[service_name(i)] = service
        return out

    def document(self, **kwargs: Any) -> dict[str, Any]:
        services = self.services_section(**kwargs)
        if not self.raw:
            return {"services": services}
        ads = {"eds_config": {"ads": {}, "resource_api_version": "V3"}}
        clusters, assignments = [], []
        for name, service in services.items():
            clusters.append(
                {
                    "name": name,
                    "type": "EDS",
                    "connect_timeout": service.get("connect_timeout", "1s"),
                    "eds_cluster_config": ads,
                }
            )
            hosts = [endpoint.rsplit(":", 1) for endpoint in service["endpoints"]]
            lb_endpoints = [
                {"endpoint": {"address": {"socket_address": {"address": host, "port_value": int(port)}}}}
                for host, port in hosts
            ]
            assignments.append({"cluster_name": name, "endpoints": [{"lb_endpoints": lb_endpoints}]})
        return {"clusters": clusters, "endpoints": assignments}

    def write(self, path: Path, **kwargs: Any) -> None:
        os.replace(self.write_beside(path, **kwargs), path)

    def write_beside(self, path: Path, **kwargs: Any) -> Path:
        """The file, written beside ``path`` (a temporary name in its directory): renaming it over
        ``path`` is the change."""
        document = self.document(**kwargs)
        text = yaml.dump(document, Dumper=_DUMPER, sort_keys=False) if self.raw == "yaml" else json.dumps(document)
        return _write_beside(path, text)


def _write_beside(path: Path, text: str) -> Path:
    """``text`` in a temp file beside ``path`` (in its directory, so a rename over it is atomic)."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    return tmp


def write_atomically(path: Path, text: str) -> None:
    """Write to a temp file beside ``path``, then rename it over ``path``."""
    os.replace(_write_beside(path, text), path)
