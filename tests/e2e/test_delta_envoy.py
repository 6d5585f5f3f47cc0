"""Incremental (delta) xDS with a real Envoy on ``DELTA_GRPC`` (``pilotfish bootstrap --delta``).

What changed is all that is sent: one service's endpoints among 200 is one resource, a removed
cluster goes in ``removed_resources``, and traffic through Envoy meanwhile sees no error. Envoy
rejecting a cluster keeps the listener it accepted and is not sent the rejected content again;
a restarted pilotfish sends a reconnecting Envoy nothing (it says what it has).
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from .event_log import EventLog, is_event
from .processes import ControlPlane, Envoy, ProcessGroup, Upstream, free_port, wait_until
from .snapshot_file import many_services, write_services
from .test_envoy_snapshot import V2, V3, V4, WITHOUT_VALIDATION
from .testbed import Testbed, wait_for_acks
from .wrk import Wrk, wrk_binary

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(150)]

NODE = "edge-1"
CDS = "type.googleapis.com/envoy.config.cluster.v3.Cluster"
EDS = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"
LDS = "type.googleapis.com/envoy.config.listener.v3.Listener"
SERVICES = 200
DELTA = ("--delta",)


def cluster_names(envoy: Envoy) -> set[str]:
    data = json.loads(envoy.admin("/clusters?format=json"))
    return {status["name"] for status in data.get("cluster_statuses", [])}


def delta_sent(events: EventLog, type_url: str, *, after: int) -> list[dict[str, Any]]:
    return events.select(
        lambda e: is_event("sent", node=NODE, type=type_url)(e) and e.get("delta") is True, after=after
    )


def test_only_what_changed_reaches_a_delta_envoy_under_load(processes: ProcessGroup) -> None:
    wrk_binary()
    a, b = Upstream.start(processes, "a"), Upstream.start(processes, "b")
    names = [f"svc-{i:03d}" for i in range(SERVICES)]
    ports: dict[str, list[int]] = {"web": [a.port], **{name: [a.port] for name in names}}
    listen_port = free_port()
    path = processes.workdir / "services.yaml"
    write_services(path, many_services(listen_port, ports))
    control_plane = ControlPlane(processes, path, free_port(), options=("--quiet-ms", "20"))
    events = control_plane.start()
    envoy = Envoy.start(
        processes, name="envoy", node_id=NODE, xds_address=control_plane.address, bootstrap_options=DELTA
    )
    wait_for_acks(events, node=NODE, what="Envoy's initial configuration over delta xDS", types=[CDS, EDS, LDS])
    opened = events.wait_for(is_event("stream_open", node=NODE), what="Envoy's stream")
    assert opened["service"] == "delta-ads"
    first = delta_sent(events, EDS, after=0)
    assert sum(e["resources"] for e in first) == SERVICES + 1, "every assignment, once"
    wait_until(
        lambda: envoy.cluster_endpoints("svc-150") == [f"127.0.0.1:{a.port}"],
        timeout=10,
        what="Envoy to have the endpoints of every cluster",
    )
    load = Wrk.start(processes, f"http://127.0.0.1:{listen_port}/", duration_s=90, connections=10)

    # One service's endpoints change: exactly that one assignment goes out.
    mark = events.mark()
    ports["svc-017"] = [a.port, b.port]
    write_services(path, many_services(listen_port, ports))
    envoy.wait_for_endpoints("svc-017", [f"127.0.0.1:{a.port}", f"127.0.0.1:{b.port}"])
    [sent] = delta_sent(events, EDS, after=mark)
    assert sent["names"] == ["svc-017"] and sent["removed"] == [], sent
    assert delta_sent(events, CDS, after=mark) == [], "no cluster changed"
    events.wait_for(
        is_event("ack", node=NODE, type=EDS, version=sent["version"]),
        after=mark,
        what="Envoy's ACK of the changed endpoints",
    )

    # A service goes away: its cluster is removed, by name.
    mark = events.mark()
    del ports["svc-030"]
    write_services(path, many_services(listen_port, ports))
    wait_until(lambda: "svc-030" not in cluster_names(envoy), timeout=10, what="Envoy to remove cluster svc-030")
    [removed] = delta_sent(events, CDS, after=mark)
    assert removed["removed"] == ["svc-030"] and removed["names"] == [], removed
    assert envoy.cluster_endpoints("svc-150") == [f"127.0.0.1:{a.port}"], "the other clusters keep theirs"

    # Churn under the load itself: web's endpoints move from a to b and back, one step at a time
    # (add, wait until Envoy lists it; remove, wait until it does not), each step one resource.
    for step in ([a.port, b.port], [b.port], [a.port, b.port], [a.port]):
        mark = events.mark()
        ports["web"] = step
        write_services(path, many_services(listen_port, ports))
        envoy.wait_for_endpoints("web", [f"127.0.0.1:{port}" for port in step])
        assert [e["names"] for e in delta_sent(events, EDS, after=mark)] == [["web"]]

    assert load.running(), "the changes took longer than the load run: they were not all under load"
    result = load.stop()
    problems = result.problems()
    assert not problems, f"traffic through web while services changed: {'; '.join(problems)}\n{result.output}"
    assert not events.select(is_event("nack")), "Envoy rejected nothing"

    # pilotfish restarts: Envoy reconnects saying what it has, and is sent nothing.
    control_plane.stop()
    events = control_plane.start()
    wait_until(
        lambda: (
            envoy.stat("control_plane.connected_state") == 1
            and bool(
                events.select(
                    lambda e: is_event("request", node=NODE, type=EDS)(e) and bool(e.get("initial_resources"))
                )
            )
        ),
        timeout=15,
        what="Envoy to reconnect and state the endpoints it has",
    )
    stated = events.select(lambda e: is_event("request", node=NODE)(e) and "initial_resources" in e)
    assert {e["type"] for e in stated} >= {CDS, EDS}, events.describe()
    new = [e for e in events.select(is_event("sent", node=NODE)) if e["names"] or e["removed"]]
    assert not new, f"a reconnecting Envoy that has everything was sent {new}"


def test_a_delta_envoy_keeps_its_listener_when_it_rejects_clusters(testbed: Testbed) -> None:
    testbed.control_plane.options = WITHOUT_VALIDATION
    envoy = testbed.start(envoy_options={"bootstrap_options": DELTA}, **V2)
    events = testbed.events
    mark = events.mark()
    testbed.write_snapshot(**V3)

    nack = events.wait_for(is_event("nack", node=NODE, type=CDS), what="Envoy's NACK of the clusters", after=mark)
    assert "ConnectTimeout" in (nack["error"] or ""), nack["error"]
    wait_for_acks(events, node=NODE, what="the changed listener", types=[LDS], after=mark)
    wait_until(
        lambda: testbed.request("/") == (200, "web-a") and envoy.stat("http.ingress_v3.downstream_rq_completed"),
        timeout=10,
        what="a request through the listener of version 3 over the clusters of version 2",
    )
    assert envoy.stat("cluster_manager.cds.update_rejected") == 1

    marker = events.mark()
    testbed.write_snapshot(**V4)
    events.wait_for(is_event("ack", node=NODE, type=CDS), after=marker, what="Envoy's ACK of the fixed clusters")
    rejected = [e for e in delta_sent(events, CDS, after=mark) if e["version"] == "3"]
    assert len(rejected) == 1, "the rejected clusters are sent once, not again after the NACK\n" + events.describe(
        after=mark
    )
