"""Snapshots of EDS clusters by name, for tests that need a cache with something in it (a test
helper shared by the unit and the integration tests, imported by module name)."""

from __future__ import annotations

from typing import Any

from pilotfish.resources import CLUSTER
from pilotfish.resources.parse import parse_resource
from pilotfish.snapshot import Snapshot

__all__ = ["clusters", "eds_document"]


def clusters(*names: str) -> Snapshot:
    """A snapshot of EDS clusters ``names`` (nothing else)."""
    parsed = [
        parse_resource(
            CLUSTER,
            {"name": name, "type": "EDS", "connect_timeout": "1s", "eds_cluster_config": {"eds_config": {"ads": {}}}},
            "",
        )[0]
        for name in names
    ]
    return Snapshot.build({CLUSTER: [message for message in parsed if message is not None]})


def eds_document(clusters: dict[str, str], *, port: int = 80) -> dict[str, Any]:
    """A snapshot file's content: EDS clusters (name -> connect timeout), each with one endpoint
    at 10.0.0.1:``port``."""
    endpoint = {"endpoint": {"address": {"socket_address": {"address": "10.0.0.1", "port_value": port}}}}
    return {
        "clusters": [
            {"name": n, "type": "EDS", "connect_timeout": t, "eds_cluster_config": {"eds_config": {"ads": {}}}}
            for n, t in clusters.items()
        ],
        "endpoints": [{"cluster_name": n, "endpoints": [{"lb_endpoints": [endpoint]}]} for n in clusters],
    }
