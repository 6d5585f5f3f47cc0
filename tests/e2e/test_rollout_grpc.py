"""Proxyless gRPC clients in a rollout: their own load reports feed the health gate.

``serve --rollout 'canary=grpc-c-*,100%'`` serves service ``echo`` (``grpc: true``) to two real
grpcio clients calling ``xds:///echo``: ``grpc-c-1``, the canary, and ``grpc-p-1``. With the
rollout's health gate on, the clusters of gRPC groups carry ``lrs_server: {self: {}}``, so each
client reports its load over LRS to the xDS port, as an Envoy bootstrapped with ``--lrs`` does;
no bootstrap option asks for it.

Then a change that passes every check and breaks the calls: ``echo``'s route moves to a new
service ``broken`` whose backend fails every call with UNAVAILABLE. The canary ACKs it, its calls
fail, its load reports show it, and the health gate fails its wave on the new cluster (judged
against the baseline's overall ratio, since no baseline client uses it) and rolls it back: the
canary's calls succeed again, and the other client was never sent the change and saw no error.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from .event_log import CDS, NEW_CLUSTER_JUDGED, RDS, Event
from .processes import (
    ControlPlane,
    GrpcBackend,
    GrpcClient,
    ProcessGroup,
    free_port,
    pilotfish,
    unlabelled_metrics,
    wait_until,
)
from .snapshot_file import write_services

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(150)]

CANARY, OTHER = "grpc-c-1", "grpc-p-1"
MIN_REQUESTS = 50
PAUSE_MS = 5
"""Between a client's calls: at most 200 calls a second each, plenty for the gate's minimum."""


def failures(client: GrpcClient, *, after: int = 0) -> list[str]:
    return [call for call in client.calls()[after:] if call.startswith("ERROR")]


def succeeded_in_a_row(client: GrpcClient, count: int, *, after: int) -> Callable[[], bool]:
    def check() -> bool:
        calls = client.calls()[after:]
        return len(calls) >= count and not any(call.startswith("ERROR") for call in calls[-count:])

    return check


def config_sent_to(node: str) -> Callable[[Event], bool]:
    return lambda e: e["event"] == "sent" and e.get("node") == node and e.get("type") in (CDS, RDS)


def test_grpc_clients_report_load_and_a_failing_canary_is_rolled_back_on_its_reports(
    processes: ProcessGroup, tmp_path: Path
) -> None:
    good, bad = GrpcBackend.start(processes, "good"), GrpcBackend.start(processes, "broken", fail="UNAVAILABLE")
    snapshot = tmp_path / "services.yaml"
    echo: dict[str, Any] = {"grpc": True, "endpoints": [good.address]}
    write_services(snapshot, {"echo": echo})
    plane = ControlPlane(
        processes,
        snapshot,
        free_port(),
        options=(
            "--rollout", "canary=grpc-c-*,100%",
            "--rollout-bake", "10",
            "--rollout-ack-timeout", "30",
            "--rollout-min-requests", str(MIN_REQUESTS),
            "--lrs-interval", "1s",
            "--quiet-ms", "20",
        ),
    )  # fmt: skip
    events = plane.start()
    events.wait_for(lambda e: e["event"] == "rollout_baseline_set", what="the first snapshot as the baseline")
    clients = {}
    for node in (CANARY, OTHER):
        bootstrap = tmp_path / f"{node}.json"
        bootstrap.write_text(pilotfish("bootstrap", "--grpc", "--node-id", node, "--xds", plane.address).stdout)
        clients[node] = GrpcClient.start(processes, node, target="xds:///echo", bootstrap=bootstrap, pause_ms=PAUSE_MS)
    for node, client in clients.items():
        wait_until(
            succeeded_in_a_row(client, MIN_REQUESTS, after=0),
            timeout=30,
            what=f"{node}: {MIN_REQUESTS} calls through xds:///echo",
            details=lambda client=client: client.process.output_tail() + "\n" + events.describe(),  # type: ignore[misc]
        )

    # Both clients report their load to the xDS port (nothing in their bootstraps asks them to).
    wait_until(
        lambda: (lambda m: m.get("pilotfish_lrs_streams") == 2 and m.get("pilotfish_lrs_reports", 0) >= 4)(
            unlabelled_metrics(plane.admin, "pilotfish_lrs")
        ),
        timeout=30,
        what="two load reporting streams, and reports from them, counted in /metrics",
        details=lambda: str(unlabelled_metrics(plane.admin, "pilotfish_lrs")) + "\n" + events.describe(),
    )

    # A route to a backend that fails every call: valid, ACKed, and wrong.
    mark = events.mark()
    calls_before = {node: len(client.calls()) for node, client in clients.items()}
    write_services(snapshot, {"echo": {**echo, "routes": [{"to": "broken"}]}, "broken": {"endpoints": [bad.address]}})
    failed = events.wait_for(
        lambda e: e["event"] == "rollout_failed", after=mark, what="the health gate to fail the canary", timeout=60
    )
    assert failed["wave"] == "canary", failed
    # Judged on the new cluster, against the baseline's overall ratio (no baseline client uses it):
    # the same window's, or the window before the wave's when the first judgement comes before the
    # baseline completed enough calls in this one.
    assert NEW_CLUSTER_JUDGED.search(failed["reason"]), failed
    rolled = events.wait_for(lambda e: e["event"] == "rollout_rolled_back", after=mark, what="the rollback")
    assert rolled["proxies"] == 1
    acked = events.find(lambda e: e["event"] == "rollout_wave_acked", after=mark)
    assert acked is not None  # it was ACKed: only its load showed what was wrong
    assert failures(clients[CANARY], after=calls_before[CANARY]), "the canary's calls never failed"
    back = len(clients[CANARY].calls())
    wait_until(
        succeeded_in_a_row(clients[CANARY], MIN_REQUESTS, after=back),
        timeout=30,
        what=f"the canary: {MIN_REQUESTS} calls in a row succeeding after the rollback",
        details=lambda: "\n".join(clients[CANARY].calls()[-5:]) + "\n" + events.describe(after=mark),
    )
    assert events.select(config_sent_to(OTHER), after=mark) == [], f"{OTHER} was sent the failing route"
    assert failures(clients[OTHER]) == [], f"{OTHER}'s calls failed"
    print(
        f"\n{failed['reason']}; the canary failed {len(failures(clients[CANARY]))} calls; "
        f"{rolled['ts'] - acked['ts']:.2f} s from its ACKs to the rollback"
    )
