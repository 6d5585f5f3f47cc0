"""Did a change reach every proxy? The admin API, ``pilotfish status`` and ``pilotfish wait``,
with two real Envoys.

The snapshot story is test_envoy_snapshot.py's: version "2" is good; "3" breaks the clusters
(``connect_timeout: 0s``, which Envoy rejects) and, with ``--validate off``, reaches the Envoys.
"""

from __future__ import annotations

from typing import Any

import pytest

from .event_log import CDS, is_event
from .processes import http_json, pilotfish
from .testbed import Testbed, wait_for_acks

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

NODES = ("edge-1", "edge-2")
V2: dict[str, Any] = {"version": "2", "web": ["web-a"], "direct_body": "direct v2"}
V2B: dict[str, Any] = V2 | {"version": "2b", "web": ["web-a", "web-b"], "direct_body": "direct v2b"}
V3: dict[str, Any] = V2B | {"version": "3", "connect_timeout": "0s", "stat_prefix": "ingress_v3"}
ADS_TYPES = ("CDS", "EDS", "LDS", "RDS")


def _proxies(testbed: Testbed) -> dict[str, Any]:
    status, body = http_json("GET", f"http://{testbed.control_plane.admin}/v1/proxies")
    assert status == 200, body
    return {proxy["node"]: proxy for proxy in body["proxies"]}


def test_wait_and_status_after_a_good_change_and_a_rejected_one(testbed: Testbed) -> None:
    testbed.control_plane.options = ("--validate", "off")
    testbed.start(**V2)
    testbed.start_envoy(name="envoy-2", node_id="edge-2", cluster="edge-pool")
    events = testbed.events
    wait_for_acks(events, node="edge-2", what="the second Envoy's initial configuration")
    admin = testbed.control_plane.admin

    # A good change: `wait` returns 0 once both Envoys ACKed every type at the new version.
    mark = events.mark()
    testbed.write_snapshot(**V2B)
    done = pilotfish(
        "wait", "--admin", admin, "--version", "2b", "--timeout", "20", "--min-proxies", "2", check=False, timeout=60
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "2 proxies have 2b" in done.stdout
    proxies = _proxies(testbed)
    assert set(proxies) == set(NODES)
    for node in NODES:
        proxy = proxies[node]
        assert proxy["user_agent"] == "envoy" and proxy["user_agent_version"].count(".") == 2, proxy
        assert proxy["streams"] == 1 and proxy["group"] == "default" and proxy["protocol"] == "sotw"
        for short in ADS_TYPES:
            assert proxy["types"][short]["state"] == "SYNCED", (node, short, proxy["types"][short])
            assert proxy["types"][short]["acked_version"] == "2b"
    assert proxies["edge-2"]["cluster"] == "edge-pool"
    status, snapshots = http_json("GET", f"http://{admin}/v1/snapshots")
    assert status == 200
    cds = snapshots["groups"]["default"]["types"]["CDS"]
    assert (cds["version"], cds["acked"], cds["proxies"], cds["summary"]) == ("2b", 2, 2, "2b: 2 of 2")
    assert cds["seconds_to_last_ack"] is not None and cds["seconds_to_last_ack"] >= 0
    assert events.find(is_event("snapshot_loaded", version="2b"), after=mark) is not None

    # A change Envoy rejects: the proxies show NACKED with Envoy's message; `wait` names them.
    testbed.write_snapshot(**V3)
    for node in NODES:
        events.wait_for(is_event("nack", node=node, type=CDS), what=f"{node}'s NACK of the clusters", after=mark)
    failed = pilotfish("wait", "--admin", admin, "--version", "3", "--timeout", "20", check=False, timeout=60)
    assert failed.returncode == 1, failed.stdout + failed.stderr
    assert "a proxy rejected the configuration" in failed.stderr
    for node in NODES:
        assert f"{node}: CDS NACKED 3: " in failed.stderr and "ConnectTimeout" in failed.stderr, failed.stderr
    proxies = _proxies(testbed)
    for node in NODES:
        cds_status = proxies[node]["types"]["CDS"]
        assert cds_status["state"] == "NACKED" and cds_status["acked_version"] == "2b", cds_status
        assert cds_status["nack"]["version"] == "3" and "ConnectTimeout" in cds_status["nack"]["message"]
    table = pilotfish("status", "--admin", admin, "--state", "nacked", check=False)
    assert table.returncode == 1 and "edge-1: CDS NACKED 3" in table.stderr, table.stderr  # a script sees the NACK
    lines = table.stdout.splitlines()
    assert lines[0].split()[:4] == ["NAME", "CLUSTER", "GROUP", "CDS"]
    assert any(line.startswith("edge-1 ") and "NACKED 3" in line for line in lines), table.stdout
    assert any(line.startswith("edge-2 ") and "edge-pool" in line for line in lines), table.stdout
    assert "edge-1 rejected CDS 3: " in table.stdout and "ConnectTimeout" in table.stdout
    only_one = pilotfish("status", "--admin", admin, "--node", "edge-2", check=False)
    assert "edge-1" not in only_one.stdout and "edge-2" in only_one.stdout

    # What edge-1 is being served: the snapshot of version 3, as Envoy JSON.
    status, config = http_json("GET", f"http://{admin}/v1/config?node=edge-1")
    assert status == 200 and config["group"] == "default" and config["label"] == "3"
    clusters = config["types"]["CDS"]["resources"]
    assert {cluster["name"] for cluster in clusters} >= {"web", "api"}
    assert all(cluster["@type"].endswith("envoy.config.cluster.v3.Cluster") for cluster in clusters)
    assert clusters[0]["connect_timeout"] == "0s"
