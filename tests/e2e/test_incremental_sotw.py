"""State of the world, incremental where the protocol allows it: a real Envoy on ADS.

EDS responses carry only the assignments that changed since the version the proxy holds (Envoy
keeps what a response omits), so changing one service's endpoints among many sends one
resource. A cluster change still sends every assignment the proxy subscribes to: a re-created
cluster waits for its endpoints (warming). Throughout, Envoy keeps every other cluster's endpoints
and the traffic through it sees no error.
"""

from __future__ import annotations

import json

import pytest

from .event_log import is_event
from .processes import ControlPlane, Envoy, ProcessGroup, Upstream, free_port, wait_until
from .snapshot_file import many_services, write_services
from .testbed import wait_for_acks
from .wrk import Wrk, wrk_binary

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

NODE = "edge-1"
EDS = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"
SERVICES = 40
"""Services besides ``web``, each a cluster with its own endpoint assignment."""


def endpoints_by_cluster(envoy: Envoy) -> dict[str, list[str]]:
    """Every cluster Envoy has and its endpoints (``host:port``), from one /clusters read."""
    data = json.loads(envoy.admin("/clusters?format=json"))
    found: dict[str, list[str]] = {}
    for status in data.get("cluster_statuses", []):
        hosts = status.get("host_statuses", [])
        found[status["name"]] = sorted(
            f"{h['address']['socket_address']['address']}:{h['address']['socket_address']['port_value']}" for h in hosts
        )
    return found


def test_one_service_changed_among_many_sends_one_assignment(processes: ProcessGroup) -> None:
    wrk_binary()
    a, b = Upstream.start(processes, "a"), Upstream.start(processes, "b")
    names = [f"svc-{i:02d}" for i in range(SERVICES)]
    ports: dict[str, list[int]] = {"web": [a.port], **{name: [a.port] for name in names}}
    listen_port = free_port()
    path = processes.workdir / "services.yaml"
    write_services(path, many_services(listen_port, ports))
    control_plane = ControlPlane(processes, path, free_port(), options=("--quiet-ms", "20"))
    events = control_plane.start()
    envoy = Envoy.start(processes, name="envoy", node_id=NODE, xds_address=control_plane.address)
    wait_for_acks(events, node=NODE, what="Envoy's initial configuration")
    first = events.select(is_event("sent", node=NODE, type=EDS))
    assert [e["resources"] for e in first] == [SERVICES + 1], "the first response carries every assignment"
    wait_until(
        lambda: all(endpoints_by_cluster(envoy).get(n) == [f"127.0.0.1:{a.port}"] for n in ["web", *names]),
        timeout=10,
        what="Envoy to have every cluster's endpoint",
    )
    load = Wrk.start(processes, f"http://127.0.0.1:{listen_port}/", duration_s=60, connections=10)

    # One service's endpoints change: one assignment is sent, and Envoy keeps every other one.
    mark = events.mark()
    ports["svc-17"] = [a.port, b.port]
    write_services(path, many_services(listen_port, ports))
    envoy.wait_for_endpoints("svc-17", [f"127.0.0.1:{a.port}", f"127.0.0.1:{b.port}"])
    sent = events.wait_for(is_event("sent", node=NODE, type=EDS), after=mark, what="the EDS response")
    events.wait_for(
        is_event("ack", node=NODE, type=EDS, version_info=sent["version"]),
        after=mark,
        what="Envoy's ACK of the new endpoints",
    )
    assert sent["resources"] == 1, f"one changed assignment, not {sent['resources']}"
    have = endpoints_by_cluster(envoy)
    lost = [n for n in ["web", *names] if n != "svc-17" and have.get(n) != [f"127.0.0.1:{a.port}"]]
    assert not lost, f"Envoy lost the endpoints of {lost} after a response that did not carry them"

    # A new cluster: the clusters response is followed by every assignment (warming), at once.
    mark = events.mark()
    ports["svc-new"] = [b.port]
    write_services(path, many_services(listen_port, ports))
    envoy.wait_for_endpoints("svc-new", [f"127.0.0.1:{b.port}"])
    warm = events.wait_for(is_event("sent", node=NODE, type=EDS), after=mark, what="the EDS response after CDS")
    # Every assignment Envoy subscribed to when the clusters went out (the new cluster's follows
    # when Envoy names it).
    assert warm["resources"] == SERVICES + 1, "after a cluster response, the whole set subscribed to"
    assert envoy.stat("cluster.svc-new.init_fetch_timeout") in (0, None), "the new cluster did not wait out a timeout"

    assert load.running(), "the changes took longer than the load run: they were not all under load"
    result = load.stop()
    problems = result.problems()
    assert not problems, f"traffic through web while other services changed: {'; '.join(problems)}\n{result.output}"
    assert not events.select(is_event("nack")), "Envoy rejected nothing"
