"""Docker discovery (``serve --docker``) with a real engine, a real Envoy and real load.

The engine runs with no network of its own (:mod:`tests.e2e.docker_engine`): every container is on
the host network and serves HTTP on a port of 127.0.0.1, labelled with the service it serves. The
snapshot file gives the service its listener and nothing else; its endpoints are the containers.
Under wrk, every request must succeed while containers start, stop (removed from EDS before they
exit, so Envoy drains them), turn healthy, carry bad labels, and while the engine itself restarts.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import trustme
from prometheus_client.parser import text_string_to_metric_families

from .docker_engine import DockerDaemon, TlsFiles
from .event_log import is_event
from .processes import ControlPlane, Envoy, ProcessGroup, free_port, http_get, http_json, wait_until
from .snapshot_file import write_services
from .testbed import wait_for_acks
from .wrk import Wrk, wrk_binary

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

NODE = "edge-1"


@pytest.fixture
def docker(processes: ProcessGroup) -> Iterator[DockerDaemon]:
    daemon = DockerDaemon.start(processes)
    try:
        yield daemon
    finally:
        daemon.close()


def _labels(port: int) -> dict[str, str]:
    return {"pilotfish.service": f"web:{port}", "pilotfish.zone": "local"}


def _fleet(
    processes: ProcessGroup, docker: DockerDaemon, listen: int, *, more: tuple[str, ...] = ()
) -> tuple[ControlPlane, Envoy]:
    """pilotfish with the file (``web``'s listener) and the engine (``more``: further options);
    an Envoy on it."""
    path = processes.workdir / "services.yaml"
    write_services(path, {"web": {"listen": f"127.0.0.1:{listen}"}})
    options = ("--docker", docker.url, "--quiet-ms", "20", *more)
    control_plane = ControlPlane(processes, path, free_port(), options=options)
    control_plane.start()
    envoy = Envoy.start(processes, name="envoy", node_id=NODE, xds_address=control_plane.address)
    return control_plane, envoy


def test_labelled_containers_serve_and_leave_without_a_failed_request(
    processes: ProcessGroup, docker: DockerDaemon
) -> None:
    wrk_binary()
    ports = {f"web-{i}": free_port() for i in range(1, 4)}
    for name, port in ports.items():
        docker.run_httpd(name, port, _labels(port), drain_s=4.0)
    listen = free_port()
    control_plane, envoy = _fleet(processes, docker, listen)
    every = [f"127.0.0.1:{p}" for p in ports.values()]
    envoy.wait_for_endpoints("web", every, timeout=30)
    wait_for_acks(control_plane.events, node=NODE, what="Envoy's configuration")

    # /v1/config says which engine and container each endpoint came from.
    status, config = http_json("GET", f"http://{control_plane.admin}/v1/config?node={NODE}")
    assert status == 200, config
    (web,) = [a for a in config["types"]["EDS"]["resources"] if a["cluster_name"] == "web"]
    origins = {
        (
            f"{e['endpoint']['address']['socket_address']['address']}:"
            f"{e['endpoint']['address']['socket_address']['port_value']}"
        ): e["metadata"]["filter_metadata"]["pilotfish"]
        for locality in web["endpoints"]
        for e in locality["lb_endpoints"]
    }
    assert origins == {
        f"127.0.0.1:{port}": {"container": name, "engine": docker.url} for name, port in ports.items()
    }, origins

    wrk = Wrk.start(processes, f"http://127.0.0.1:{listen}/", duration_s=120, connections=4, threads=1)
    wait_until(
        lambda: all(envoy.host_requests("web").get(address, 0) > 0 for address in every),
        timeout=15,
        what="requests to each of the three containers",
        details=lambda: str(envoy.host_requests("web")),
    )
    # A container being stopped leaves EDS on the kill, while it still runs and drains.
    stopping = docker.cli_in_background("stop", "web-2")
    envoy.wait_for_endpoints("web", [every[0], every[2]], timeout=10)
    assert docker.running("web-2"), "removed before it exited: Envoy drains it while it finishes"
    assert stopping.wait(60) == 0

    # A container with a HEALTHCHECK serves only once healthy.
    checked = free_port()
    docker.run_httpd("web-checked", checked, _labels(checked), health=True)
    wait_until(lambda: docker.health("web-checked") == "unhealthy", timeout=30, what="web-checked unhealthy")
    assert envoy.cluster_endpoints("web") == sorted([every[0], every[2]])
    assert envoy.host_requests("web").get(f"127.0.0.1:{checked}", 0) == 0, "no request before it is healthy"
    docker.set_healthy("web-checked", True)
    envoy.wait_for_endpoints("web", [every[0], every[2], f"127.0.0.1:{checked}"], timeout=30)
    wait_until(
        lambda: envoy.host_requests("web").get(f"127.0.0.1:{checked}", 0) > 0,
        timeout=15,
        what="requests to web-checked once healthy",
    )

    # A container with a bad label is reported, naming it and the label; the others serve on.
    mark = control_plane.events.mark()
    docker.run_httpd("web-bad", free_port(), {"pilotfish.service": "web:notaport"})
    bad = control_plane.events.wait_for(is_event("docker_bad_label"), after=mark, what="the bad label reported")
    assert (bad["container"], bad["label"]) == ("web-bad", "label pilotfish.service"), bad
    assert envoy.cluster_endpoints("web") == sorted([every[0], every[2], f"127.0.0.1:{checked}"])

    assert wrk.running(), "the containers took longer than the load run: they did not all come and go under it"
    result = wrk.stop()
    print(f"\nwrk through Envoy while containers came and went: {result.summary()}")
    assert not result.problems(), (result.summary(), envoy.stats(r"cluster\.web\.upstream_(cx|rq)_"))
    status, body = http_get(f"http://{control_plane.admin}/v1/docker")
    assert status == 200 and '"container":"web-bad"' in body and '"serving":false' in body, body
    status, text = http_get(f"http://{control_plane.admin}/metrics")
    figures = {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.labels.get("engine") == docker.url
    }
    # web-1, web-3, web-checked and web-bad run; three serve; web-bad's labels are bad
    assert figures["pilotfish_docker_containers"] == 4, figures
    assert figures["pilotfish_docker_endpoints"] == 3 and figures["pilotfish_docker_bad_label_containers"] == 1
    assert figures["pilotfish_docker_connected"] == 1 and figures["pilotfish_docker_events_total"] > 0


def _tls_files(directory: Path, ca: trustme.CA, who: str) -> TlsFiles:
    leaf = ca.issue_cert(who)
    files = TlsFiles(directory / "ca.pem", directory / f"{who}.pem", directory / f"{who}.key")
    ca.cert_pem.write_to_path(str(files.ca))
    leaf.cert_chain_pems[0].write_to_path(str(files.cert))
    leaf.private_key_pem.write_to_path(str(files.key))
    return files


def test_engines_are_independent_and_one_that_restarts_keeps_its_endpoints_and_is_listed_again(
    processes: ProcessGroup, docker: DockerDaemon
) -> None:
    """Two engines, the second over TCP with mutual TLS: while the first restarts (its containers
    run on, --live-restore), its endpoints stay, the second's changes go on reaching Envoy, and
    once back the first is listed again and followed. A container started while pilotfish could
    not reach the first engine (it ran on a socket pilotfish does not know) is found by that
    listing: its start was never in an event stream pilotfish read."""
    wrk_binary()
    ca = trustme.CA()
    remote = DockerDaemon.start(processes, name="docker-tcp", tls=_tls_files(processes.workdir, ca, "127.0.0.1"))
    try:
        client = _tls_files(processes.workdir, ca, "pilotfish")
        first, far = free_port(), free_port()
        docker.run_httpd("web-1", first, _labels(first))
        remote.run_httpd("web-far-1", far, _labels(far))
        listen = free_port()
        tls = (
            "--docker-tls-ca",
            str(client.ca),
            "--docker-tls-cert",
            str(client.cert),
            "--docker-tls-key",
            str(client.key),
        )
        control_plane, envoy = _fleet(processes, docker, listen, more=("--docker", remote.tcp_url, *tls))
        serving = [f"127.0.0.1:{first}", f"127.0.0.1:{far}"]
        envoy.wait_for_endpoints("web", serving, timeout=30)

        wrk = Wrk.start(processes, f"http://127.0.0.1:{listen}/", duration_s=120, connections=4, threads=1)
        mark = control_plane.events.mark()
        docker.stop()  # (its containers run on: --live-restore)
        lost = control_plane.events.wait_for(
            is_event("docker_disconnected"), after=mark, what="the engine lost", timeout=20
        )
        assert lost["engine"] == docker.url
        far_2 = free_port()
        remote.run_httpd("web-far-2", far_2, _labels(far_2))
        serving.append(f"127.0.0.1:{far_2}")
        envoy.wait_for_endpoints("web", serving, timeout=30)  # the first's endpoint kept, the second's added
        # The engine runs again where pilotfish cannot reach it; a container starts there.
        docker.run(unseen=True)
        second = free_port()
        docker.run_httpd("web-2", second, _labels(second))
        docker.stop()
        assert envoy.cluster_endpoints("web") == sorted(serving), "nothing of web-2 reached pilotfish"
        back = control_plane.events.mark()
        docker.run()
        synced = control_plane.events.wait_for(
            is_event("docker_synced", engine=docker.url), after=back, what="the engine listed again", timeout=30
        )
        # The listing, read before any event, has web-1 and web-2: the relist found it.
        assert (synced["containers"], synced["endpoints"]) == (2, 2), synced
        serving.append(f"127.0.0.1:{second}")
        envoy.wait_for_endpoints("web", serving, timeout=30)
        assert wrk.running(), "the engine's restart took longer than the load run: it was not all under load"
        result = wrk.stop()
        print(f"\nwrk through Envoy while an engine restarted: {result.summary()}")
        assert not result.problems(), result.summary()
    finally:
        remote.close()


def test_nothing_is_published_until_an_engine_that_is_down_answers(processes: ProcessGroup) -> None:
    daemon = DockerDaemon.start(processes)
    try:
        port = free_port()
        daemon.run_httpd("web-1", port, _labels(port))
        daemon.stop()
        listen = free_port()
        path = processes.workdir / "services.yaml"
        write_services(path, {"web": {"listen": f"127.0.0.1:{listen}"}})
        control_plane = ControlPlane(processes, path, free_port(), options=("--docker", daemon.url))
        control_plane.start()
        status, body = http_get(f"http://{control_plane.admin}/readyz")
        assert status == 503 and daemon.url in body, body
        assert not control_plane.events.select(is_event("snapshot_loaded"))
        daemon.run()
        control_plane.events.wait_for(is_event("snapshot_loaded"), what="the first publish", timeout=30)
        envoy = Envoy.start(processes, name="envoy", node_id=NODE, xds_address=control_plane.address)
        envoy.wait_for_endpoints("web", [f"127.0.0.1:{port}"], timeout=30)
    finally:
        daemon.close()
