"""A real Envoy on REST polling (``pilotfish bootstrap --rest``, ``serve --rest``).

Envoy polls clusters and listeners (its bootstrap) and endpoints and routes (the snapshot points
EDS and RDS at REST too) every 0.2 s with JSON DiscoveryRequests, and holds no gRPC stream. It gets
every type and routes traffic; a change to the snapshot file reaches it by its next polls; polls
of a current Envoy are answered 304; an endpoint change of one cluster answers the polls of the
other cluster 304 (only what changed is sent). Over mTLS, the poller's certificate identity is what
``--authorize-node`` checks its node id against. From a file with only a ``services:`` section,
the poller (in the built-in node group ``rest``) is built clusters and listeners whose EDS and RDS
it polls over REST too, and routes traffic with them.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from .event_log import EventLog, is_event
from .processes import ControlPlane, Envoy, ProcessGroup, Upstream, free_port, http_get, wait_until
from .snapshot_file import write_services, write_snapshot
from .test_tls_envoy import Pki

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

NODE = "edge-rest"
CDS = "type.googleapis.com/envoy.config.cluster.v3.Cluster"
EDS = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"
LDS = "type.googleapis.com/envoy.config.listener.v3.Listener"
RDS = "type.googleapis.com/envoy.config.route.v3.RouteConfiguration"
REFRESH_S = 0.2


def answered(events: EventLog, type_url: str, answer: int, *, after: int = 0, what: str, **fields: object) -> int:
    """Wait for a poll of ``type_url`` answered ``answer``; return the index after it."""
    event = events.wait_for(
        is_event("rest_request", node=NODE, type=type_url, answer=answer, **fields), what=what, after=after, timeout=15
    )
    return events.index_of(event) + 1


def test_an_envoy_on_rest_polling_is_served_every_type_and_every_change(processes: ProcessGroup) -> None:
    a, b = Upstream.start(processes, "a"), Upstream.start(processes, "b")
    listener_port = free_port()
    path = processes.workdir / "snapshot.yaml"

    def write(*, web: int, api: int, body: str, version: str) -> None:
        write_snapshot(
            path,
            listener_port=listener_port,
            endpoints={"web": [web], "api": [api]},
            direct_body=body,
            version=version,
            rest_refresh=REFRESH_S,
        )

    def through_envoy(route: str) -> str:
        status, text = http_get(f"http://127.0.0.1:{listener_port}{route}")
        return text if status == 200 else f"<{status}>"

    write(web=a.port, api=a.port, body="direct v1", version="1")
    rest = f"127.0.0.1:{free_port()}"
    control_plane = ControlPlane(processes, path, free_port(), options=("--rest", rest, "--quiet-ms", "20"))
    events = control_plane.start()
    envoy = Envoy.start(
        processes,
        name="envoy",
        node_id=NODE,
        xds_address=control_plane.address,
        bootstrap_options=("--rest", rest, "--refresh-ms", str(int(REFRESH_S * 1000))),
    )

    # Every type arrives over REST, and Envoy routes with it: the listener and route (LDS, RDS)
    # answer /direct, the clusters and their endpoints (CDS, EDS) reach the upstream.
    wait_until(
        lambda: through_envoy("/direct") == "direct v1",
        timeout=15,
        what="Envoy to serve /direct",
        details=envoy.log_tail,
    )
    wait_until(
        lambda: through_envoy("/") == "a", timeout=15, what="Envoy to route / to upstream a", details=envoy.log_tail
    )
    for type_url in (CDS, LDS):
        answered(events, type_url, 200, what=f"a 200 to the first {type_url} poll", version_info="")
    answered(events, EDS, 200, what="endpoints of web over REST", resource_names=["web"])
    answered(events, RDS, 200, what="the route over REST", resource_names=["local_route"])
    # A current Envoy's polls are answered 304 (no body), for every type.
    mark = events.mark()
    for type_url in (CDS, EDS, LDS, RDS):
        answered(events, type_url, 304, after=mark, what=f"a 304 to a current {type_url} poll", version_info="1")
    assert events.find(is_event("stream_open"), after=0) is None, "REST only: Envoy opened no gRPC stream"

    # A change to the file arrives by Envoy's next polls: a new route body and web's endpoint moves.
    mark = events.mark()
    write(web=b.port, api=a.port, body="direct v2", version="2")
    wait_until(
        lambda: through_envoy("/direct") == "direct v2",
        timeout=15,
        what="the new route to arrive",
        details=envoy.log_tail,
    )
    wait_until(
        lambda: through_envoy("/") == "b", timeout=15, what="web's new endpoint to arrive", details=envoy.log_tail
    )
    answered(
        events, EDS, 200, after=mark, what="web's endpoints at version 2", resource_names=["web"], version_info="1"
    )
    # Versions are per type: the clusters and the listener did not change, and stay at "1".
    mark = events.mark()
    for type_url, version in ((CDS, "1"), (EDS, "2"), (LDS, "1"), (RDS, "2")):
        answered(events, type_url, 304, after=mark, what=f"a 304 to {type_url} at {version}", version_info=version)
    assert through_envoy("/api") == "a", "api's endpoints, unchanged, still route"

    # Only web's endpoints change (version 3): web's poll is answered 200, api's 304: it states
    # version 1 (its assignment was the same at version 2, so it was never sent that one), and
    # api's assignment is the same at version 3 as at version 1.
    mark = events.mark()
    write(web=a.port, api=a.port, body="direct v2", version="3")
    wait_until(
        lambda: through_envoy("/") == "a", timeout=15, what="web's endpoint to move back", details=envoy.log_tail
    )
    published = answered(
        events, EDS, 200, after=mark, what="web's endpoints at version 3", resource_names=["web"], version_info="2"
    )
    answered(
        events,
        EDS,
        304,
        after=published,
        what="api's poll, unchanged since the version it has",
        resource_names=["api"],
        version_info="1",
    )
    assert not events.select(
        is_event("rest_request", node=NODE, type=EDS, answer=200, resource_names=["api"]), after=mark
    ), "api's unchanged endpoints were not sent again"

    rejected = {
        name: envoy.stat(name)
        for name in ("cluster_manager.cds.update_rejected", "listener_manager.lds.update_rejected")
    }
    assert all(value in (0, None) for value in rejected.values()), rejected


def test_an_envoy_polls_over_mtls_and_its_node_id_is_checked_against_its_certificate(
    processes: ProcessGroup, tmp_path: Path
) -> None:
    pki = Pki(tmp_path)
    upstream = Upstream.start(processes, "a")
    listener_port = free_port()
    path = processes.workdir / "snapshot.yaml"
    write_snapshot(
        path,
        listener_port=listener_port,
        endpoints={"web": [upstream.port], "api": [upstream.port]},
        rest_refresh=REFRESH_S,
    )
    rest = f"127.0.0.1:{free_port()}"
    control_plane = ControlPlane(
        processes,
        path,
        free_port(),
        options=("--rest", rest, *pki.serve_options(mtls=True), "--authorize-node", f"{NODE}.pilotfish.test={NODE}"),
    )
    events = control_plane.start()
    rest_options = ("--rest", rest, "--refresh-ms", str(int(REFRESH_S * 1000)))
    envoy = Envoy.start(
        processes,
        name="envoy",
        node_id=NODE,
        xds_address=control_plane.address,
        bootstrap_options=(*rest_options, *pki.client(NODE, f"{NODE}.pilotfish.test")),
    )
    wait_until(
        lambda: http_get(f"http://127.0.0.1:{listener_port}/")[1] == "a",
        timeout=15,
        what="Envoy on REST over mTLS to route / to the upstream",
        details=envoy.log_tail,
    )
    assert int(envoy.stat("cluster.xds_cluster.ssl.handshake") or 0) >= 1
    for type_url in (CDS, EDS, LDS, RDS):
        answered(events, type_url, 200, what=f"{type_url} over REST on mTLS")

    # Another proxy's certificate may not claim this node id: refused (403), nothing served.
    impostor = Envoy.start(
        processes,
        name="impostor",
        node_id=NODE,
        xds_address=control_plane.address,
        bootstrap_options=(*rest_options, *pki.client("impostor", "impostor.pilotfish.test")),
    )
    refused = events.wait_for(
        is_event("node_refused", identity="impostor.pilotfish.test"), what="the impostor's claim refused", timeout=15
    )
    assert refused["rest"] is True
    wait_until(
        lambda: int(impostor.stat("cluster_manager.cds.update_failure") or 0) >= 1,
        timeout=15,
        what="the impostor's CDS poll to fail",
    )
    assert int(impostor.stat("cluster_manager.cds.update_success") or 0) == 0


def test_an_envoy_on_rest_polling_is_served_a_services_file(processes: ProcessGroup) -> None:
    """No raw resources: pilotfish builds the cluster, endpoints, listener and route of ``web``,
    and those served to a REST poller name the REST config source of ``pilotfish bootstrap
    --rest`` (``xds_cluster``, the same refresh delay) instead of ``ads: {}``."""
    a, b = Upstream.start(processes, "a"), Upstream.start(processes, "b")
    listener_port = free_port()
    path = processes.workdir / "services.yaml"

    def write(upstream: Upstream) -> None:
        write_services(
            path, {"web": {"listen": f"127.0.0.1:{listener_port}", "endpoints": [f"127.0.0.1:{upstream.port}"]}}
        )

    def through_envoy() -> str:
        status, text = http_get(f"http://127.0.0.1:{listener_port}/")
        return text if status == 200 else f"<{status}>"

    write(a)
    rest, refresh_ms = f"127.0.0.1:{free_port()}", str(int(REFRESH_S * 1000))
    control_plane = ControlPlane(
        processes, path, free_port(), options=("--rest", rest, "--rest-refresh-ms", refresh_ms, "--quiet-ms", "20")
    )
    events = control_plane.start()
    envoy = Envoy.start(
        processes,
        name="envoy",
        node_id=NODE,
        xds_address=control_plane.address,
        bootstrap_options=("--rest", rest, "--refresh-ms", refresh_ms),
    )

    # Envoy routes / to the upstream: it has the listener (LDS), its route (RDS), the cluster
    # (CDS) and its endpoints (EDS), every one polled over REST.
    wait_until(
        lambda: through_envoy() == "a", timeout=15, what="Envoy to route / to upstream a", details=envoy.log_tail
    )
    for type_url in (CDS, LDS):
        answered(events, type_url, 200, what=f"a 200 to the first {type_url} poll", version_info="")
    answered(events, EDS, 200, what="web's endpoints over REST", resource_names=["web"])
    answered(events, RDS, 200, what="web's route over REST", resource_names=["web"])

    # An endpoint change in the services file reaches Envoy by its next EDS poll.
    mark = events.mark()
    write(b)
    wait_until(lambda: through_envoy() == "b", timeout=15, what="web's new endpoint to arrive", details=envoy.log_tail)
    answered(events, EDS, 200, after=mark, what="web's new endpoints over REST", resource_names=["web"])

    assert events.find(is_event("stream_open"), after=0) is None, "REST only: Envoy opened no gRPC stream"
    counters = {
        name: envoy.stat(name)
        for name in (
            "cluster_manager.cds.update_rejected",
            "listener_manager.lds.update_rejected",
            "cluster.web.update_rejected",
            "http.web.rds.web.update_rejected",
        )
    }
    assert all(value in (0, None) for value in counters.values()), counters
    assert int(envoy.stat("cluster.web.update_success") or 0) >= 2, "web's EDS subscription took both versions"
