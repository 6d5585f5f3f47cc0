"""Replicas of ``pilotfish serve`` on one etcd, and the Envoys spread over them: what the replica tests
(test_registry_etcd.py, test_replicas_etcd.py) share.

Where an Envoy holds its stream is read from each replica's admin API (``/v1/proxies``), as an
operator would; what a replica serves from its ``/v1/snapshots`` and ``/healthz`` (etcd revision).

Several Envoys on one machine cannot each own the service's listener address (they would share the
port through SO_REUSEPORT and the kernel would pick one per connection), so each Envoy gets a
listener of its own in its bootstrap (:func:`~e2e.processes.front_listener`): on a port of its own, with the very
routes pilotfish serves for the service (RDS over the same ADS stream), so load sent to that port
goes through that one Envoy and the clusters and endpoints the fleet is given.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from .etcd import Etcd
from .event_log import is_event
from .processes import ControlPlane, ProcessGroup, free_port, http_json

__all__ = [
    "connected_nodes",
    "etcd_replicas",
    "etcd_revision",
    "snapshot_versions",
    "where_connected",
]


def etcd_replicas(
    group: ProcessGroup,
    etcd: Etcd,
    count: int,
    *,
    options: tuple[str, ...] = ("--quiet-ms", "50"),
) -> list[ControlPlane]:
    """``count`` replicas (``replica-0``, ...) on one etcd, each with its registry API, started and
    synced. Each has a name of its own, so each writes an event log of its own."""
    planes = [
        ControlPlane(
            group, None, free_port(), registry_port=free_port(), etcd=etcd.address, options=options, name=f"replica-{i}"
        )
        for i in range(count)
    ]
    for plane in planes:
        plane.start().wait_for(is_event("etcd_synced"), what=f"the first list of etcd by {plane.name}")
    return planes


def _admin(plane: ControlPlane, path: str) -> Any:
    status, answer = http_json("GET", f"http://{plane.admin}{path}")
    if status != 200:
        raise RuntimeError(f"{plane.name} admin {path} answered {status}: {answer}")
    return answer


def connected_nodes(plane: ControlPlane) -> dict[str, dict[str, Any]]:
    """Node id -> its entry in the replica's ``/v1/proxies`` (proxies with a stream open on it)."""
    return {proxy["node"]: proxy for proxy in _admin(plane, "/v1/proxies")["proxies"]}


def where_connected(planes: Iterable[ControlPlane], nodes: Iterable[str]) -> dict[str, ControlPlane] | None:
    """Node id -> the live replica it holds its stream on, once each of ``nodes`` is on exactly one
    live replica; None until then (one not connected yet, or still on two while it moves)."""
    found: dict[str, list[ControlPlane]] = {node: [] for node in nodes}
    for plane in planes:
        if not plane.process.alive():
            continue
        for node in connected_nodes(plane):
            if node in found:
                found[node].append(plane)
    if any(len(on) != 1 for on in found.values()):
        return None
    return {node: on[0] for node, on in found.items()}


def snapshot_versions(plane: ControlPlane, group: str = "default") -> dict[str, str]:
    """Type (``CDS``, ...) -> the version the replica serves to ``group`` (its ``/v1/snapshots``)."""
    types = _admin(plane, "/v1/snapshots")["groups"].get(group, {}).get("types", {})
    return {kind: entry["version"] for kind, entry in types.items()}


def etcd_revision(plane: ControlPlane) -> int:
    """The etcd revision the replica has applied (its admin ``/healthz``)."""
    return int(_admin(plane, "/healthz")["etcd"]["revision"])
