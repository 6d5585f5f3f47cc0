"""Snapshots of EDS clusters by name, for tests that need a cache with something in it (a test
helper shared by the unit and the integration tests, imported by module name)."""

from __future__ import annotations

from pilotfish.resources import CLUSTER
from pilotfish.resources.parse import parse_resource
from pilotfish.snapshot import Snapshot

__all__ = ["clusters"]


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
