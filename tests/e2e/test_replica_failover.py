"""Replicas: an Envoy whose bootstrap lists every replica moves to a live one when its replica dies.

Three ``pilotfish serve`` processes read the same snapshot file; versions are content hashes, so
they serve identical versions without talking to each other. Envoy (``pilotfish bootstrap --xds
A,B,C``) holds its ADS stream on one of them. That one is SIGKILLed under load: Envoy reconnects to
a live replica, states the versions it has (SotW: ``version_info`` and the names it holds; delta:
``initial_resource_versions``), and is sent nothing, as it has everything; a change made afterwards
reaches it through the live replica, and the load through Envoy sees no error throughout.

Under TLS, with no common server name, each replica's certificate is checked against the names of
the replicas (one by host name, one by IP address here); a replica whose certificate carries
neither is never trusted, even when it is the only one left.

A proxyless grpcio client given several ``xds_servers`` follows gRFC A71, observed here: it falls
back to the next server only while the first is unreachable and it lacks configuration, returns
to the first when that answers, and keeps its cached configuration, without updates, while the
first is down.
"""

from __future__ import annotations

import functools
import signal
from pathlib import Path
from typing import Any

import pytest
import trustme

from .event_log import CDS, EDS, LDS, RDS, EventLog, is_event, short_type
from .processes import (
    ControlPlane,
    Envoy,
    GrpcBackend,
    GrpcClient,
    ProcessGroup,
    Upstream,
    free_port,
    pilotfish,
    wait_until,
)
from .snapshot_file import many_services, write_services
from .testbed import wait_for_acks
from .wrk import Wrk, wrk_binary

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

NODE = "edge-1"
REPLICAS = 3
SERVICES = 20
"""Services besides ``web``: clusters with endpoints, so the EDS subscription names many."""


def _replica_with_stream(replicas: list[ControlPlane]) -> ControlPlane | None:
    """The live replica on which Envoy's latest stream is open (not closed since)."""
    for replica in replicas:
        if not replica.process.alive():
            continue
        events = replica.events
        opened = events.select(is_event("stream_open", node=NODE))
        closed = {e["stream"] for e in events.select(is_event("stream_closed", node=NODE))}
        if any(e["stream"] not in closed for e in opened):
            return replica
    return None


def _sent_to_node(events: EventLog, *, after: int = 0) -> list[dict[str, Any]]:
    return events.select(is_event("sent", node=NODE), after=after)


@pytest.mark.parametrize("delta", [False, True], ids=["sotw", "delta"])
def test_envoy_fails_over_to_a_live_replica_and_is_sent_nothing_it_has(processes: ProcessGroup, delta: bool) -> None:
    wrk_binary()
    a, b = Upstream.start(processes, "a"), Upstream.start(processes, "b")
    names = [f"svc-{i:02d}" for i in range(SERVICES)]
    ports: dict[str, list[int]] = {"web": [a.port], **{name: [a.port] for name in names}}
    listen_port = free_port()
    path = processes.workdir / "services.yaml"
    write_services(path, many_services(listen_port, ports))
    replicas = [
        ControlPlane(processes, path, free_port(), options=("--quiet-ms", "20"), name=f"replica-{i}")
        for i in range(REPLICAS)
    ]
    for replica in replicas:
        replica.start()
    versions = {
        replica.name: replica.events.wait_for(is_event("snapshot_loaded"), what="the first snapshot")["versions"]
        for replica in replicas
    }
    assert len({repr(v) for v in versions.values()}) == 1, f"every replica serves the same versions: {versions}"

    envoy = Envoy.start(
        processes,
        name="envoy",
        node_id=NODE,
        xds_address=",".join(r.address for r in replicas),
        bootstrap_options=("--delta",) if delta else (),
    )
    first = wait_until(lambda: _replica_with_stream(replicas), timeout=15, what="Envoy's ADS stream on a replica")
    types = [CDS, EDS, LDS, RDS]  # web's listener takes its routes over RDS
    wait_for_acks(first.events, node=NODE, what="Envoy's initial configuration", types=types)
    wait_until(
        lambda: envoy.cluster_endpoints("web") == [f"127.0.0.1:{a.port}"],
        timeout=10,
        what="Envoy to route web to upstream a",
    )
    load = Wrk.start(processes, f"http://127.0.0.1:{listen_port}/", duration_s=90, connections=10)

    # The replica holding Envoy's stream dies.
    first.process.popen.send_signal(signal.SIGKILL)
    first.process.popen.wait()
    survivor = wait_until(
        lambda: _replica_with_stream(replicas),
        timeout=15,
        what="Envoy's stream on a live replica",
        details=envoy.log_tail,
    )
    assert survivor is not first
    events = survivor.events
    opened = events.find(is_event("stream_open", node=NODE))
    assert opened is not None
    after_open = events.index_of(opened)

    # Envoy states what it has, type by type; the live replica answers none of it.
    def stated(type_url: str) -> dict[str, Any] | None:
        if delta:
            return events.find(
                lambda e: is_event("request", node=NODE, type=type_url)(e) and "initial_resources" in e,
                after=after_open,
            )
        return events.find(is_event("request", node=NODE, type=type_url), after=after_open)

    requests = {
        t: wait_until(
            functools.partial(stated, t),
            timeout=10,
            what=f"Envoy's first {t} request to the live replica",
            details=lambda: events.describe(after=after_open),
        )
        for t in types
    }
    wait_until(
        lambda: envoy.stat("control_plane.connected_state") == 1,
        timeout=10,
        what="Envoy to count itself connected again",
    )
    loaded = events.find(is_event("snapshot_loaded"))
    assert loaded is not None
    current = loaded["versions"]
    if delta:  # it states every resource it has: web and the other services, web's listener and route
        stated_counts = {short_type(t): r["initial_resources"] for t, r in requests.items()}
        assert stated_counts == {"CDS": SERVICES + 1, "EDS": SERVICES + 1, "LDS": 1, "RDS": 1}, stated_counts
    else:
        for type_url, request in requests.items():
            assert request["version_info"] == current[short_type(type_url)], (
                f"the reconnecting Envoy carried the current {type_url} version",
                request,
                current,
            )

    # A change made now reaches Envoy through the live replica. The stream's events are in order:
    # anything re-sent in answer to the requests above would come before the change's response.
    mark = events.mark()
    ports["web"] = [a.port, b.port]
    write_services(path, many_services(listen_port, ports))
    envoy.wait_for_endpoints("web", [f"127.0.0.1:{a.port}", f"127.0.0.1:{b.port}"])
    events.wait_for(is_event("sent", node=NODE, type=EDS), after=mark, what="the change sent by the live replica")
    sent = _sent_to_node(events, after=after_open)
    if delta:
        sent = [e for e in sent if e["names"] or e["removed"]]
        resent = [e for e in sent if e["names"] != ["web"] or e["type"] != EDS]
    else:
        resent = [e for e in sent if e["version"] == current[short_type(e["type"])]]
    assert not resent and len(sent) == 1, (
        f"a proxy that moved replicas was sent what it had: {resent}\n{events.describe(after=after_open)}"
    )
    assert events.index_of(sent[0]) >= mark and sent[0]["type"] == EDS
    assert sent[0]["names"] == ["web"] if delta else sent[0]["resources"] == 1, sent[0]
    events.wait_for(is_event("ack", node=NODE, type=EDS), after=mark, what="Envoy's ACK of the change")
    envoy.wait_for_requests("web")  # the load goes on through the change

    assert load.running(), "the failover took longer than the load run"
    result = load.stop()
    problems = result.problems()
    assert not problems, f"traffic through Envoy while its replica died: {'; '.join(problems)}\n{result.output}"
    assert not events.select(is_event("nack")), "Envoy rejected nothing"


def test_under_tls_each_replica_is_checked_against_the_replicas_names(processes: ProcessGroup, tmp_path: Path) -> None:
    upstream = Upstream.start(processes, "a")
    listen_port = free_port()
    path = processes.workdir / "services.yaml"
    write_services(path, many_services(listen_port, {"web": [upstream.port]}))
    ca = trustme.CA()
    ca_path = tmp_path / "ca.pem"
    ca_path.write_bytes(ca.cert_pem.bytes())
    replicas = []
    # Reached as localhost (a DNS SAN), as 127.0.0.1 (an IP SAN), and one whose certificate, from
    # the same CA, names neither.
    for name, identity in (("by-name", "localhost"), ("by-ip", "127.0.0.1"), ("impostor", "other.example")):
        leaf = ca.issue_cert(identity)
        cert, key = tmp_path / f"{name}.pem", tmp_path / f"{name}.key"
        cert.write_bytes(leaf.cert_chain_pems[0].bytes())
        key.write_bytes(leaf.private_key_pem.bytes())
        replica = ControlPlane(
            processes, path, free_port(), name=name, options=("--tls-cert", str(cert), "--tls-key", str(key))
        )
        replica.start()
        replicas.append(replica)
    by_name, by_ip, impostor = replicas
    xds = f"localhost:{by_name.port},127.0.0.1:{by_ip.port},127.0.0.1:{impostor.port}"
    envoy = Envoy.start(
        processes, name="envoy", node_id=NODE, xds_address=xds, bootstrap_options=("--tls-ca", str(ca_path))
    )

    first = wait_until(
        lambda: _replica_with_stream(replicas), timeout=15, what="Envoy's stream on a replica", details=envoy.log_tail
    )
    assert first is not impostor
    wait_for_acks(first.events, node=NODE, what="Envoy's configuration over TLS", types=[CDS, EDS, LDS])
    first.process.popen.send_signal(signal.SIGKILL)
    first.process.popen.wait()
    second = wait_until(
        lambda: _replica_with_stream(replicas),
        timeout=15,
        what="Envoy's stream on the other replica",
        details=lambda: envoy.admin("/clusters") + envoy.log_tail(),
    )
    assert second in (by_name, by_ip) and second is not first
    wait_until(lambda: envoy.stat("control_plane.connected_state") == 1, timeout=10, what="Envoy connected again")

    # Only the impostor is left: Envoy refuses its certificate, whatever the CA says. (It may have
    # tried the impostor already while failing over: count the refusals from here.)
    refused_before = int(envoy.stat("cluster.xds_cluster.ssl.fail_verify_san") or 0)
    second.process.popen.send_signal(signal.SIGKILL)
    second.process.popen.wait()
    wait_until(
        lambda: int(envoy.stat("cluster.xds_cluster.ssl.fail_verify_san") or 0) >= refused_before + 2,
        timeout=20,
        what="Envoy to refuse the impostor's certificate (twice more)",
        details=envoy.log_tail,
    )
    wait_until(lambda: envoy.stat("control_plane.connected_state") == 0, timeout=10, what="Envoy disconnected")
    assert not impostor.events.select(is_event("stream_open")), "no stream on a replica with another name"
    assert envoy.cluster_endpoints("web") == [f"127.0.0.1:{upstream.port}"], "Envoy keeps what it had"


def _grpc_stream_open(replica: ControlPlane, *, after: int = 0) -> bool:
    return bool(replica.events.select(is_event("stream_open", node="client-1"), after=after))


def test_a_proxyless_grpc_client_uses_its_replicas_as_grfc_a71_says(processes: ProcessGroup, tmp_path: Path) -> None:
    """grpcio with two ``xds_servers`` (``pilotfish bootstrap --grpc --xds PRIMARY,SECOND``): it
    falls back to the second only while the primary is unreachable and it lacks configuration,
    returns to the primary when that answers, and with its configuration cached stays on it
    (without updates) while it is down. What a user of several replicas must know about gRPC."""
    a, b = GrpcBackend.start(processes, "a"), GrpcBackend.start(processes, "b")
    path = tmp_path / "services.yaml"
    write_services(path, {"echo": {"grpc": True, "endpoints": [a.address]}})
    primary, second = (
        ControlPlane(processes, path, free_port(), options=("--quiet-ms", "20"), name=name)
        for name in ("primary", "second")
    )
    second.start()
    bootstrap = tmp_path / "grpc-bootstrap.json"
    bootstrap.write_text(
        pilotfish("bootstrap", "--grpc", "--node-id", "client-1", "--xds", f"{primary.address},{second.address}").stdout
    )
    client = GrpcClient.start(processes, "grpc-client", target="xds:///echo", bootstrap=bootstrap)

    # The primary is down and the client has nothing: it falls back to the second.
    wait_until(
        lambda: _grpc_stream_open(second),
        timeout=60,
        what="the client's stream on the second server",
        details=client.process.output_tail,
    )
    wait_until(lambda: len(client.calls()) >= 20, timeout=30, what="calls answered through the second's config")
    # The primary comes up: the client goes back to it.
    before_primary = second.events.mark()
    primary.start()
    wait_until(
        lambda: _grpc_stream_open(primary),
        timeout=90,
        what="the client back on the primary",
        details=client.process.output_tail,
    )
    # Back means answered: the primary's config ACKed and the fallback stream closed (killed before
    # that, the client still holds its stream to the second, and the change comes through it).
    wait_for_acks(
        primary.events, node="client-1", what="the client on the primary", types=[LDS, RDS, CDS, EDS], timeout=60
    )
    second.events.wait_for(
        is_event("stream_closed", node="client-1"),
        what="the client's fallback stream closed",
        after=before_primary,
        timeout=60,
    )
    # The primary dies; the client has everything and stays with it: its calls go on, and no stream
    # opens on the second although it is up and serving a change.
    opened_on_second = second.events.mark()
    primary.process.popen.send_signal(signal.SIGKILL)
    primary.process.popen.wait()
    mark = second.events.mark()
    write_services(path, {"echo": {"grpc": True, "endpoints": [a.address, b.address]}})
    second.events.wait_for(is_event("snapshot_loaded"), after=mark, what="the change on the second")
    calls_at = len(client.calls())
    wait_until(lambda: len(client.calls()) >= calls_at + 10_000, timeout=90, what="10,000 more calls (a few seconds)")
    calls = client.calls()[calls_at:]
    assert set(calls) == {"a"}, "cached configuration serves; the change did not reach the client"
    assert not _grpc_stream_open(second, after=opened_on_second), "no fallback with everything cached"
    # The primary back: the change arrives through it.
    primary.start()
    wait_until(
        lambda: "b" in client.calls()[calls_at:],
        timeout=90,
        what="the change through the restarted primary",
        details=client.process.output_tail,
    )
    assert not [c for c in client.calls() if c.startswith("ERROR")], "no call failed"


def test_an_envoy_polling_rest_from_several_replicas_moves_its_polls_to_a_live_one(processes: ProcessGroup) -> None:
    """REST pollers (``pilotfish bootstrap --rest A,B``) spread their polls over the replicas; one
    SIGKILLed under load is ejected at its first refused poll (that poll fails: REST polls are not
    retried; seen: one failed poll per subscription, Envoy keeping what it had), the polls go on
    to the other, answered 304 while Envoy is current, and a change arrives through it."""
    wrk_binary()
    a, b = Upstream.start(processes, "a"), Upstream.start(processes, "b")
    listen_port = free_port()
    path = processes.workdir / "services.yaml"
    write_services(path, many_services(listen_port, {"web": [a.port]}))
    refresh_ms = "200"
    replicas = [
        ControlPlane(
            processes,
            path,
            free_port(),
            name=f"replica-{i}",
            options=("--rest", f"127.0.0.1:{free_port()}", "--rest-refresh-ms", refresh_ms, "--quiet-ms", "20"),
        )
        for i in range(2)
    ]
    for replica in replicas:
        replica.start()
    rest = ",".join(replica.options[1] for replica in replicas)
    envoy = Envoy.start(
        processes,
        name="envoy",
        node_id=NODE,
        xds_address=replicas[0].address,
        bootstrap_options=("--rest", rest, "--refresh-ms", refresh_ms),
    )
    wait_until(
        lambda: envoy.cluster_endpoints("web") == [f"127.0.0.1:{a.port}"],
        timeout=15,
        what="Envoy to route web to upstream a",
        details=envoy.log_tail,
    )
    for replica in replicas:  # round robin: both are polled
        replica.events.wait_for(is_event("rest_request", node=NODE, answer=304), what=f"a 304 from {replica.name}")
    load = Wrk.start(processes, f"http://127.0.0.1:{listen_port}/", duration_s=90, connections=10)

    dead, survivor = replicas
    dead.process.popen.send_signal(signal.SIGKILL)
    dead.process.popen.wait()
    mark = survivor.events.mark()
    survivor.events.wait_for_count(
        is_event("rest_request", node=NODE, answer=304), 8, after=mark, what="polls answered by the survivor"
    )
    write_services(path, many_services(listen_port, {"web": [a.port, b.port]}))
    envoy.wait_for_endpoints("web", [f"127.0.0.1:{a.port}", f"127.0.0.1:{b.port}"], timeout=15)
    survivor.events.wait_for(
        is_event("rest_request", node=NODE, type=EDS, answer=200),
        after=mark,
        what="the change polled from the survivor",
    )
    envoy.wait_for_requests("web")  # the load goes on through the change
    assert load.running(), "the failover took longer than the load run"
    result = load.stop()
    assert not result.problems(), f"traffic while a REST replica died: {result.problems()}\n{result.output}"
    assert int(envoy.stat("cluster.xds_cluster.outlier_detection.ejections_enforced_total") or 0) >= 1
