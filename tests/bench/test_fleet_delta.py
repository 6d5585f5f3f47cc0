"""The fleet simulator's delta proxies against a real pilotfish: they sync, count what they
receive, take a one-endpoint change as one resource, and reconnect with what they have.

Assertions are about bytes and resources, never about how fast anything was.
"""

from __future__ import annotations

import json
import sys
import urllib.request
from pathlib import Path

import pytest

_ROOT = str(Path(__file__).resolve().parents[2])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from bench.fleet import EDS, Fleet  # noqa: E402
from bench.procs import EventTail, free_port, start_pilotfish  # noqa: E402
from bench.workload import Workload  # noqa: E402

pytestmark = pytest.mark.e2e

WORKLOAD = Workload(services=60, endpoints=3, listeners=4)


def _add_endpoint(registry: str, service: str, port: int) -> None:
    """Register one more instance of ``service`` through the registry API."""
    body = json.dumps({"address": "10.255.0.1", "port": port}).encode()
    request = urllib.request.Request(
        f"http://{registry}/v1/services/{service}/instances",
        data=body,
        method="POST",
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=10):
        pass


def test_delta_fleet_syncs_takes_one_change_and_reconnects_without_a_resend(tmp_path: Path) -> None:
    snapshot = tmp_path / "snapshot.json"
    WORKLOAD.write(snapshot)
    port = free_port()
    server = start_pilotfish(tmp_path, snapshot=snapshot, xds_port=port, registry=True, name="first")
    fleet = Fleet(target=f"127.0.0.1:{port}", proxies=3, workers=1, xds="delta")
    try:
        fleet.start()
        assert fleet.wait_synced(timeout=60).failures == 0
        synced = fleet.bytes_received()
        # Everything: 60 clusters, 60 assignments, 4 listeners and routes, each proxy alike.
        assert len(set(synced)) == 1 and synced[0] > 60 * 100

        # One endpoint changed: every proxy ACKs the new EDS version, having received one small response.
        assert server.registry is not None and server.tail is not None
        server.tail.skip_to_end()
        _add_endpoint(server.registry, "svc-00000", 9001)
        loaded = server.tail.wait_for("snapshot_loaded", timeout=30, alive=server.alive)
        assert fleet.wait_acked({EDS: loaded["versions"]["EDS"]}, since=0.0, timeout=30).failures == 0
        changed = fleet.bytes_received()
        per_change = [b - a for a, b in zip(synced, changed, strict=True)]
        assert all(0 < b < 1024 for b in per_change), per_change
        sent = [
            e
            for e in EventTail(server.event_log).read(b'"event":"sent"')
            if e["type"] == EDS and e["version"] == loaded["versions"]["EDS"]
        ]
        assert len(sent) == 3 and all(e["names"] == ["svc-00000"] for e in sent)

        # The server restarts with the same configuration: the proxies reconnect with
        # initial_resource_versions and are sent nothing they have; the next change still arrives.
        server.stop()
        server = start_pilotfish(tmp_path, snapshot=snapshot, xds_port=port, registry=True, name="second")
        assert server.registry is not None and server.tail is not None
        log = EventTail(server.event_log)
        requests = log.wait_for("request", timeout=30, where=lambda e: bool(e.get("initial_resources")))
        assert requests["delta"] is True
        server.tail.skip_to_end()
        _add_endpoint(server.registry, "svc-00001", 9002)
        loaded = server.tail.wait_for("snapshot_loaded", timeout=30, alive=server.alive)
        assert fleet.wait_acked({EDS: loaded["versions"]["EDS"]}, since=0.0, timeout=60).failures == 0
        after = fleet.bytes_received()
        resent = [b - a for a, b in zip(changed, after, strict=True)]
        # The first server's endpoint is gone (a new registry) and svc-00001 has one more: two
        # assignments, never the whole state again.
        assert all(0 < b < 2048 for b in resent), resent
    finally:
        fleet.close()
        server.stop()
