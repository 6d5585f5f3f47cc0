"""Real proxyless gRPC clients, served from nothing but a ``services:`` entry.

A service ``echo`` with ``grpc: true`` and two real gRPC backends is served by ``pilotfish serve``
from a snapshot file (or defined and registered through the registry API); a real grpcio client
(its own xDS resolver, configured by the bootstrap ``pilotfish bootstrap --grpc`` prints) calls
``xds:///echo`` in a loop. The calls spread over both backends. Then one backend is removed
following the rule deployments follow (remove it from the source, wait until the client no longer
calls it, only then stop it): every new call goes to the other backend, and not one call fails.

Zone-local routing: of a service with ``zone_local: true``, a client in a node group with a zone
calls only that zone's backends. And one service with both ``listen`` and ``grpc``: a real Envoy
proxies gRPC on its socket listener while a proxyless client resolves the API listener of the
same name.
"""

from __future__ import annotations

import functools
import json
from collections import Counter
from pathlib import Path

import pytest

from .event_log import wait_until_built
from .processes import (
    ControlPlane,
    Envoy,
    GrpcBackend,
    GrpcClient,
    ProcessGroup,
    free_port,
    pilotfish,
    port_accepts,
    wait_until,
)
from .registry_client import RegistryClient
from .snapshot_file import write_services

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

SPREAD_CALLS = 200
SETTLED = 100
"""Consecutive calls to the remaining backend after which a removal counts as seen by the client."""


def _after(client: GrpcClient, start: int, count: int) -> list[str] | None:
    calls = client.calls()
    return calls[start : start + count] if len(calls) >= start + count else None


@pytest.mark.parametrize("source", ["file", "registry"])
def test_calls_through_xds_spread_over_two_backends_and_follow_a_removal_without_a_failed_call(
    processes: ProcessGroup,
    tmp_path: Path,
    source: str,
) -> None:
    a, b = GrpcBackend.start(processes, "a"), GrpcBackend.start(processes, "b")
    snapshot = tmp_path / "services.yaml"  # the file source's
    if source == "file":
        write_services(snapshot, {"echo": {"grpc": True, "endpoints": [a.address, b.address]}})
        control = ControlPlane(processes, snapshot, free_port(), options=("--quiet-ms", "20"))
        events = control.start()
    else:
        control = ControlPlane(processes, None, free_port(), registry_port=free_port(), options=("--quiet-ms", "20"))
        events = control.start()
        registry = RegistryClient(control.registry_url)
        registry.define("echo", grpc=True)
        ids = {backend.name: registry.register("echo", "127.0.0.1", backend.port) for backend in (a, b)}
        # Both registered and built before the client asks (on a busy machine the build may lag).
        wait_until_built(events, changes=3, after=0, what="echo with both backends")
    bootstrap = tmp_path / "grpc-bootstrap.json"
    bootstrap.write_text(pilotfish("bootstrap", "--grpc", "--node-id", "client-1", "--xds", control.address).stdout)
    assert json.loads(bootstrap.read_text())["node"]["locality"] == {"region": "", "zone": ""}

    client = GrpcClient.start(processes, "grpc-client", target="xds:///echo", bootstrap=bootstrap)
    first = wait_until(
        lambda: _after(client, 0, SPREAD_CALLS),
        timeout=30,
        what=f"{SPREAD_CALLS} calls",
        details=lambda: client.process.output_tail() + "\n" + events.describe(),
    )
    # The client joined the built-in gRPC group (its user agent says gRPC) and so was sent the
    # API listener "echo", not a socket listener it would drop.
    opened = events.find(lambda e: e["event"] == "stream_open" and e["node"] == "client-1")
    assert opened is not None and opened["group"] == "grpc"
    counts = Counter(first)
    assert set(counts) == {"a", "b"}, counts
    assert min(counts.values()) >= SPREAD_CALLS // 4, counts  # round robin: about half each

    removed_at = len(client.calls())
    if source == "file":
        write_services(snapshot, {"echo": {"grpc": True, "endpoints": [a.address]}})
    else:
        registry.deregister("echo", ids["b"])

    def settled() -> int | None:
        calls = client.calls()[removed_at:]
        last_b = max((i for i, who in enumerate(calls) if who == "b"), default=-1)
        return removed_at + last_b + 1 if len(calls) - (last_b + 1) >= SETTLED else None

    moved_at = wait_until(
        settled,
        timeout=20,
        what=f"{SETTLED} calls in a row to backend a after removing b",
        details=lambda: "\n".join(client.calls()[-20:]) + "\n" + events.describe(),
    )
    b.process.stop()
    after = wait_until(
        lambda: _after(client, moved_at, 2 * SETTLED + SPREAD_CALLS), timeout=30, what="calls after stopping backend b"
    )
    assert set(after) == {"a"}, Counter(after)
    calls = client.calls()
    assert [c for c in calls if c.startswith("ERROR")] == [], "a call failed"
    print(
        f"\n{source}: {len(calls)} calls; spread before the removal {dict(counts)}; "
        f"{moved_at - removed_at} calls between the removal and the last call to b"
    )


def test_a_zone_group_calls_only_its_zones_backend_of_a_zone_local_service(
    processes: ProcessGroup,
    tmp_path: Path,
) -> None:
    east, west = GrpcBackend.start(processes, "east"), GrpcBackend.start(processes, "west")
    snapshot = tmp_path / "services.yaml"
    write_services(
        snapshot,
        {
            "echo": {
                "grpc": True,
                "zone_local": True,
                "endpoints": [
                    {"address": "127.0.0.1", "port": east.port, "zone": "east"},
                    {"address": "127.0.0.1", "port": west.port, "zone": "west"},
                ],
            }
        },
    )
    control = ControlPlane(
        processes, snapshot, free_port(), options=("--quiet-ms", "20", "--node-group", "east:grpc@east=zone:east")
    )
    events = control.start()
    clients = {}
    for zone in ("east", "west"):
        bootstrap = tmp_path / f"grpc-bootstrap-{zone}.json"
        bootstrap.write_text(
            pilotfish(
                "bootstrap", "--grpc", "--node-id", f"client-{zone}", "--zone", zone, "--xds", control.address
            ).stdout
        )
        clients[zone] = GrpcClient.start(processes, f"grpc-client-{zone}", target="xds:///echo", bootstrap=bootstrap)
    calls = {}
    for zone, client in clients.items():
        calls[zone] = wait_until(
            functools.partial(_after, client, 0, SPREAD_CALLS),
            timeout=30,
            what=f"{SPREAD_CALLS} calls of the {zone} client",
            details=functools.partial(client.process.output_tail),
        )
    # The east client's group has the zone east: only the east backend. No rule names west: that
    # client is in the built-in gRPC group, which sees every endpoint.
    assert Counter(calls["east"]) == {"east": SPREAD_CALLS}
    assert set(calls["west"]) == {"east", "west"}, Counter(calls["west"])
    groups = {e["node"]: e["group"] for e in events.read() if e["event"] == "stream_open"}
    assert groups == {"client-east": "east", "client-west": "grpc"}


def test_one_service_serves_an_envoy_its_socket_listener_and_grpc_clients_its_api_listener(
    processes: ProcessGroup,
    tmp_path: Path,
) -> None:
    # The clash of the issue: a client resolving xds:///web used to be sent the socket listener
    # "web" and drop it. Now the Envoy and the gRPC client are in different node groups, each
    # sent the listener "web" it can use, from one services entry.
    a, b = GrpcBackend.start(processes, "a"), GrpcBackend.start(processes, "b")
    listen = free_port()
    snapshot = tmp_path / "services.yaml"
    write_services(
        snapshot,
        {
            "web": {
                "listen": f"127.0.0.1:{listen}",
                "grpc": True,
                "upstream_protocol": "http2",
                "endpoints": [a.address, b.address],
            }
        },
    )
    control = ControlPlane(processes, snapshot, free_port(), options=("--quiet-ms", "20"))
    events = control.start()
    envoy = Envoy.start(processes, name="envoy", node_id="edge-1", xds_address=control.address)
    wait_until(
        lambda: port_accepts(listen), timeout=20, what=f"Envoy's listener web on port {listen}", details=envoy.log_tail
    )
    bootstrap = tmp_path / "grpc-bootstrap.json"
    bootstrap.write_text(pilotfish("bootstrap", "--grpc", "--node-id", "client-1", "--xds", control.address).stdout)
    clients = {
        "proxyless": GrpcClient.start(processes, "proxyless", target="xds:///web", bootstrap=bootstrap),
        "via-envoy": GrpcClient.start(processes, "via-envoy", target=f"ipv4:127.0.0.1:{listen}", bootstrap=bootstrap),
    }
    for name, client in clients.items():
        calls = wait_until(
            functools.partial(_after, client, 0, SPREAD_CALLS),
            timeout=30,
            what=f"{SPREAD_CALLS} calls of the {name} client",
            details=functools.partial(client.process.output_tail),
        )
        assert set(calls) == {"a", "b"}, (name, Counter(calls))
    groups = {e["node"]: e["group"] for e in events.read() if e["event"] == "stream_open"}
    assert groups == {"edge-1": "default", "client-1": "grpc"}
    assert "web::127.0.0.1:" in envoy.admin("/listeners")  # Envoy's listener keeps the service's name
