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

import functools
from collections.abc import Iterable
from typing import Any

from .etcd import Etcd
from .event_log import is_event
from .processes import ControlPlane, Envoy, ProcessGroup, Upstream, free_port, front_listener, http_json, wait_until
from .wrk import Wrk, WrkResult

__all__ = [
    "CHANGE_TIMEOUT_S",
    "SERVICE",
    "Fleet",
    "address",
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
    options: tuple[str, ...] = ("--quiet", "50ms"),
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


SERVICE = "web"
"""The service the fleet's Envoys take load for."""
CHANGE_TIMEOUT_S = 10.0
"""How long every Envoy may take to show an endpoint change (debounce, push, apply; under load,
with Envoys reconnecting at the same time)."""


def address(upstream: Upstream) -> str:
    return f"127.0.0.1:{upstream.port}"


class Fleet:
    """Envoys, each with a listener of its own for ``web`` on ``ports[node]``, and wrk through each."""

    def __init__(self) -> None:
        self.envoys: dict[str, Envoy] = {}
        self.ports: dict[str, int] = {}
        self.loads: dict[str, Wrk] = {}

    def start(self, processes: ProcessGroup, node: str, xds: str, *, delta: bool = False, lrs: bool = False) -> Envoy:
        """``lrs``: the Envoy reports its load (``pilotfish bootstrap --lrs``, to the replicas it has ADS from)."""
        port = free_port()
        envoy = Envoy.start(
            processes,
            name=f"envoy-{node}",
            node_id=node,
            xds_address=xds,
            bootstrap_options=("--delta",) * delta + ("--lrs",) * lrs,
            bootstrap_edit=front_listener(port, SERVICE),
        )
        self.envoys[node], self.ports[node] = envoy, port
        return envoy

    def wait_for_endpoints(self, expected: list[str], *, timeout: float = CHANGE_TIMEOUT_S) -> None:
        for envoy in self.envoys.values():
            envoy.wait_for_endpoints(SERVICE, expected, timeout=timeout)

    def start_load(self, processes: ProcessGroup, duration_s: int) -> None:
        """A wrk through every Envoy, for at most ``duration_s`` (:meth:`check_loads` ends them)."""
        for node, port in self.ports.items():
            self.loads[node] = Wrk.start(
                processes, f"http://127.0.0.1:{port}/", duration_s=duration_s, threads=1, connections=4
            )
        for envoy in self.envoys.values():
            envoy.wait_for_requests(SERVICE, at_least=50)

    def wait_for_traffic_to(self, upstream: Upstream, *, at_least: int = 10) -> None:
        for envoy in self.envoys.values():
            wait_until(
                functools.partial(lambda e: e.host_requests(SERVICE).get(address(upstream), 0) >= at_least, envoy),
                timeout=CHANGE_TIMEOUT_S,
                what=f"{envoy.name} to send requests to {upstream.name}",
                details=functools.partial(lambda e: str(e.host_requests(SERVICE)), envoy),
            )

    def assert_under_load(self) -> None:
        """Every wrk is still running: what the test did so far happened under load."""
        assert all(load.running() for load in self.loads.values()), (
            "the changes took longer than the load runs: they were not all made under load"
        )

    def check_loads(self) -> dict[str, WrkResult]:
        """Every wrk, still running (what the test did happened under load), is ended and was
        clean: no non-2xx, no socket error."""
        self.assert_under_load()
        results = {node: load.stop() for node, load in self.loads.items()}
        for node, result in results.items():
            print(f"\nwrk through {node}: {result.summary()}")
        problems = {node: result.problems() for node, result in results.items() if result.problems()}
        assert not problems, f"traffic through the Envoys: {problems}\n" + "\n".join(
            results[node].output for node in problems
        )
        return results
