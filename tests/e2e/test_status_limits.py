"""The memories an operator sizes, set on a real ``pilotfish serve``: how many departed proxies
``/v1/proxies?all=true`` remembers and for how long (``--status-max-disconnected``,
``--status-forget-after``), and how many events ``/v1/events`` keeps (``--recent-events``).

grpcio ADS clients play the proxies: each connects under its own node id, ACKs its clusters (or
NACKs them) and leaves, as pods that are replaced do.
"""

from __future__ import annotations

from typing import Any

import pytest
from envoy.service.discovery.v3 import discovery_pb2
from google.rpc import status_pb2

from .ads_client import AdsClient
from .event_log import CDS, is_event
from .processes import ControlPlane, ProcessGroup, free_port, http_json, wait_until
from .snapshot_file import write_snapshot

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

REASON = "Proto constraint validation failed (ClusterValidationError.ConnectTimeout: value must be greater than 0s)"


def _serve(processes: ProcessGroup, *options: str) -> ControlPlane:
    path = processes.workdir / "snapshot.yaml"
    write_snapshot(path, listener_port=free_port(), endpoints={"web": [free_port()], "api": [free_port()]})
    control_plane = ControlPlane(processes, path, free_port(), options=options)
    control_plane.start()
    return control_plane


def _visit(control_plane: ControlPlane, node: str, *, nack: str | None = None) -> None:
    """``node`` connects, ACKs (or NACKs) its clusters, and leaves."""
    client = AdsClient(control_plane.address)
    try:
        first = discovery_pb2.DiscoveryRequest(type_url=CDS)
        first.node.id, first.node.cluster, first.node.user_agent_name = node, "pods", "envoy"
        first.node.metadata.update({f"label-{k}": "v" * 500 for k in range(20)})  # not what is kept
        response = client.ask(first)
        answer = discovery_pb2.DiscoveryRequest(
            type_url=CDS, version_info=response.version_info, response_nonce=response.nonce
        )
        if nack is not None:
            answer.version_info = ""
            answer.error_detail.CopyFrom(status_pb2.Status(code=3, message=nack))
        client.requests.put(answer)
        control_plane.events.wait_for(is_event("nack" if nack else "ack", node=node), what=f"{node}'s answer")
    finally:
        client.close()
    control_plane.events.wait_for(is_event("stream_closed", node=node), what=f"{node} to leave")


def _departed(control_plane: ControlPlane) -> dict[str, Any]:
    status, body = http_json("GET", f"http://{control_plane.admin}/v1/proxies?all=true")
    assert status == 200, body
    return {proxy["node"]: proxy for proxy in body["proxies"] if not proxy["connected"]}


def test_at_most_max_disconnected_departed_proxies_are_listed_and_the_events_ring_has_its_size(
    processes: ProcessGroup,
) -> None:
    control_plane = _serve(processes, "--status-max-disconnected", "2", "--recent-events", "5")
    _visit(control_plane, "pod-1")
    _visit(control_plane, "pod-2", nack="dump " * 5000 + REASON)
    departed = _departed(control_plane)
    assert sorted(departed) == ["pod-1", "pod-2"]
    # What a departed proxy shows: its node's fields, its versions and its NACK, shortened to the reason.
    pod2 = departed["pod-2"]
    assert (pod2["cluster"], pod2["user_agent"], pod2["streams"], pod2["left_at"] > 0) == ("pods", "envoy", 0, True)
    nack = pod2["types"]["CDS"]["nack"]
    assert pod2["types"]["CDS"]["state"] == "NACKED" and nack["message"].endswith(REASON[-40:])
    assert len(nack["message"]) < 300
    assert departed["pod-1"]["types"]["CDS"]["state"] == "SYNCED"
    _visit(control_plane, "pod-3")
    assert sorted(_departed(control_plane)) == ["pod-2", "pod-3"]  # the one gone longest is forgotten
    status, events = http_json("GET", f"http://{control_plane.admin}/v1/events?limit=5")
    assert status == 200 and events["size"] == 5 and events["kept"] == 5 and events["last"] > 5


def test_departed_proxies_are_forgotten_after_status_forget_after(processes: ProcessGroup) -> None:
    control_plane = _serve(processes, "--status-forget-after", "5")
    _visit(control_plane, "pod-1")
    assert "pod-1" in _departed(control_plane)  # (asked within 5 s of its leaving)
    wait_until(
        lambda: "pod-1" not in _departed(control_plane), timeout=30, what="pod-1 to be forgotten 5 s after it left"
    )
