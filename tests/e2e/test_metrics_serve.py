"""``/metrics`` of a real ``pilotfish serve`` (a snapshot file and the registry API), parsed with
prometheus-client's own text parser: the standard process families, build info, every source,
the registry's gauges and counters, and connected proxies per sync state, each seen to move as a
registration comes and expires, requests are refused and a proxy (a grpcio ADS client) is sent
its clusters and ACKs them. The families one by one, on a fixed state: tests/unit/api/test_api_metrics.py.
"""

from __future__ import annotations

import platform
import resource
import time

import pytest
from envoy.service.discovery.v3 import discovery_pb2
from prometheus_client.parser import text_string_to_metric_families

from pilotfish.api.metrics import build_version

from .ads_client import AdsClient
from .event_log import CDS, is_event
from .processes import ControlPlane, ProcessGroup, free_port, http_get, http_json, wait_until
from .snapshot_file import write_snapshot

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(90)]

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(control_plane: ControlPlane) -> tuple[Samples, dict[str, str]]:
    """Every sample, (name, labels) -> value; and every family's type."""
    status, text = http_get(f"http://{control_plane.admin}/metrics")
    assert status == 200, text
    samples: Samples = {}
    types = {}
    for family in text_string_to_metric_families(text):
        types[family.name] = family.type
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples, types


def value(samples: Samples, name: str, **labels: str) -> float | None:
    return samples.get((name, tuple(sorted(labels.items()))))


def until(control_plane: ControlPlane, what: str, name: str, expected: float, **labels: str) -> Samples:
    """Scrape until ``name{labels}`` is ``expected``; the scrape that showed it."""

    def shown() -> Samples | None:
        samples, _ = scrape(control_plane)
        return samples if value(samples, name, **labels) == expected else None

    return wait_until(
        shown,
        timeout=60,
        what=what,
        details=lambda: "\n".join(
            f"{n}{dict(labels)} {v}" for (n, labels), v in sorted(scrape(control_plane)[0].items()) if n == name
        ),
    )


def test_metrics_of_a_real_serve_have_process_build_source_registry_and_per_state_series(
    processes: ProcessGroup,
) -> None:
    snapshot = processes.workdir / "snapshot.yaml"
    write_snapshot(snapshot, listener_port=free_port(), endpoints={"web": [free_port()], "api": [free_port()]})
    control_plane = ControlPlane(processes, snapshot, free_port(), registry_port=free_port())
    before_start = time.time()
    control_plane.start()
    registry = control_plane.registry_url

    samples, types = scrape(control_plane)
    # The standard process families, of the server's own process.
    for name, kind in (
        ("process_cpu_seconds", "counter"),
        ("process_resident_memory_bytes", "gauge"),
        ("process_virtual_memory_bytes", "gauge"),
        ("process_open_fds", "gauge"),
        ("process_max_fds", "gauge"),
        ("process_start_time_seconds", "gauge"),
    ):
        assert types.get(name) == kind, (name, types.get(name))
    assert (value(samples, "process_cpu_seconds_total") or 0) > 0
    assert (value(samples, "process_resident_memory_bytes") or 0) > 10 << 20
    assert before_start - 2 <= (value(samples, "process_start_time_seconds") or 0) <= time.time()
    # serve raises its open-file limit to the hard one (started from this process, it has ours).
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    assert value(samples, "process_max_fds") == (1 << 20 if hard == resource.RLIM_INFINITY else hard)
    assert 5 < (value(samples, "process_open_fds") or 0) < 200
    assert value(samples, "pilotfish_build_info", version=build_version(), python=platform.python_version()) == 1
    # Every source by name: the file, and the registry serving (its state, empty, known at once).
    assert value(samples, "pilotfish_source_ready", source="file") == 1
    assert value(samples, "pilotfish_source_ready", source="registry") == 1
    assert value(samples, "pilotfish_source_failing", source="registry") == 0
    assert value(samples, "pilotfish_registry_instances") == 0
    assert value(samples, "pilotfish_registry_services") == 0
    assert value(samples, "pilotfish_registry_registrations_total") == 0
    assert value(samples, "pilotfish_registry_expired_instances_total") == 0
    assert value(samples, "pilotfish_registry_self_preservation") == 0
    assert not [key for key in samples if key[0] == "pilotfish_proxies_by_state"]  # no proxy yet

    # A registration bumps the gauges; refused requests are counted by status.
    status, body = http_json(
        "POST", f"{registry}/v1/services/jobs/instances", {"address": "127.0.0.1", "port": 9, "ttl": 1}
    )
    assert status == 201, body
    assert http_json("POST", f"{registry}/v1/services/jobs/instances", {"address": "127.0.0.1"})[0] == 400
    assert http_json("PUT", f"{registry}/v1/services/jobs/instances/127.0.0.1:1/heartbeat")[0] == 404
    samples, _ = scrape(control_plane)
    assert value(samples, "pilotfish_registry_instances") == 1
    assert value(samples, "pilotfish_registry_services") == 1
    assert value(samples, "pilotfish_registry_registrations_total") == 1
    assert value(samples, "pilotfish_registry_refused_requests_total", code="400") == 1
    assert value(samples, "pilotfish_registry_refused_requests_total", code="404") == 1
    # No heartbeat within its TTL (one instance alone: churn, not a partition): it expires.
    samples = until(control_plane, "the instance to expire", "pilotfish_registry_expired_instances_total", 1)
    assert value(samples, "pilotfish_registry_instances") == 0

    # A proxy connects and is sent its clusters: STALE until it ACKs them, then SYNCED.
    client = AdsClient(control_plane.address)
    try:
        first = discovery_pb2.DiscoveryRequest(type_url=CDS)
        first.node.id, first.node.cluster = "edge-1", "edge"
        response = client.ask(first)
        samples = until(
            control_plane,
            "the proxy to count as STALE",
            "pilotfish_proxies_by_state",
            1,
            group="default",
            state="STALE",
        )
        assert value(samples, "pilotfish_proxies_by_state", group="default", state="SYNCED") == 0
        assert value(samples, "pilotfish_proxies_connected", group="default") == 1
        client.requests.put(
            discovery_pb2.DiscoveryRequest(
                type_url=CDS, version_info=response.version_info, response_nonce=response.nonce
            )
        )
        control_plane.events.wait_for(is_event("ack", node="edge-1"), what="edge-1's ACK")
        samples = until(
            control_plane,
            "the proxy to count as SYNCED",
            "pilotfish_proxies_by_state",
            1,
            group="default",
            state="SYNCED",
        )
        assert value(samples, "pilotfish_proxies_by_state", group="default", state="STALE") == 0
        assert value(samples, "pilotfish_proxies_by_state", group="default", state="NACKED") == 0
    finally:
        client.close()
    wait_until(  # a group without connected proxies has no series (as in pilotfish_proxies_connected)
        lambda: not [key for key in scrape(control_plane)[0] if key[0] == "pilotfish_proxies_by_state"],
        timeout=60,
        what="the proxy's leaving to take it out of the per-state series",
    )
