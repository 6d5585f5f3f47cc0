"""Did a change reach every proxy? The admin API, ``pilotfish status`` and ``pilotfish wait``,
with two real Envoys.

The snapshot story is test_envoy_snapshot.py's: version "2" is good; "3" breaks the clusters
(``connect_timeout: 0s``, which Envoy rejects) and, with ``--validate off``, reaches the Envoys.
"""

from __future__ import annotations

import re
from typing import Any

import pytest

from .event_log import CDS, RDS, is_event
from .processes import http_json, pilotfish, wait_until
from .snapshot_file import ROUTE_NAME, write_document
from .testbed import Testbed, wait_for_acks

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

NODES = ("edge-1", "edge-2")
V2: dict[str, Any] = {"version": "2", "web": ["web-a"], "direct_body": "direct v2"}
V2B: dict[str, Any] = V2 | {"version": "2b", "web": ["web-a", "web-b"], "direct_body": "direct v2b"}
V3: dict[str, Any] = V2B | {"version": "3", "connect_timeout": "0s", "stat_prefix": "ingress_v3"}
ADS_TYPES = ("CDS", "EDS", "LDS", "RDS")
V2B_VERSIONS = {"CDS": "2", "EDS": "2b", "LDS": "2", "RDS": "2b"}


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
            # Versions are per type: 2b changed the endpoints and the routes; the rest stay at 2.
            assert proxy["types"][short]["acked_version"] == V2B_VERSIONS[short], (node, short)
    assert proxies["edge-2"]["cluster"] == "edge-pool"
    status, snapshots = http_json("GET", f"http://{admin}/v1/snapshots")
    assert status == 200
    assert snapshots["groups"]["default"]["label"] == "2b"
    eds = snapshots["groups"]["default"]["types"]["EDS"]
    assert (eds["version"], eds["acked"], eds["proxies"], eds["summary"]) == ("2b", 2, 2, "2b: 2 of 2")
    cds = snapshots["groups"]["default"]["types"]["CDS"]
    assert (cds["version"], cds["acked"], cds["proxies"], cds["summary"]) == ("2", 2, 2, "2: 2 of 2")
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
        assert cds_status["state"] == "NACKED" and cds_status["acked_version"] == "2", cds_status
        assert cds_status["nack"]["version"] == "3" and "ConnectTimeout" in cds_status["nack"]["message"]
    table = pilotfish("status", "--admin", admin, "--state", "nacked", check=False)
    assert table.returncode == 1 and "edge-1: CDS NACKED 3" in table.stderr, table.stderr  # a script sees the NACK
    lines = table.stdout.splitlines()
    assert lines[0].split()[:4] == ["NAME", "CLUSTER", "GROUP", "CDS"]
    assert any(line.startswith("edge-1 ") and "NACKED 3" in line for line in lines), table.stdout
    assert any(line.startswith("edge-2 ") and "edge-pool" in line for line in lines), table.stdout
    assert "edge-1 rejected CDS 3: " in table.stdout and "ConnectTimeout" in table.stdout
    # Envoy's message is a dump of the rejected cluster, then the reason: the line shows the
    # cluster's name and the reason, on one line.
    nack_lines = [line for line in lines if " rejected CDS 3: " in line]
    assert len(nack_lines) == 2, table.stdout
    for line in nack_lines:
        assert re.search(r"rejected CDS 3: '(web|api)': Proto constraint validation failed \(", line), line
        assert line.endswith("ConnectTimeout: value must be greater than 0s)"), line
    for node in NODES:  # the admin API's one-line summary, as the status page shows it
        summary = proxies[node]["types"]["CDS"]["nack"]["summary"]
        assert summary == nack_lines[0].split(": ", 1)[1], (summary, nack_lines)
    only_one = pilotfish("status", "--admin", admin, "--node", "edge-2", check=False)
    assert "edge-1" not in only_one.stdout and "edge-2" in only_one.stdout

    # What edge-1 is being served: the snapshot of version 3, as Envoy JSON.
    status, config = http_json("GET", f"http://{admin}/v1/config?node=edge-1")
    assert status == 200 and config["group"] == "default" and config["label"] == "3"
    clusters = config["types"]["CDS"]["resources"]
    assert {cluster["name"] for cluster in clusters} >= {"web", "api"}
    assert all(cluster["@type"].endswith("envoy.config.cluster.v3.Cluster") for cluster in clusters)
    assert clusters[0]["connect_timeout"] == "0s"


def test_a_nack_whose_message_names_no_resource_is_shown_with_the_rejected_ones(testbed: Testbed) -> None:
    """Envoy rejects a route whose regex RE2 does not compile with only ``missing ): ((``: the
    status names the route configuration the rejected response carried."""
    testbed.control_plane.options = ("--validate", "off")
    testbed.start(version="1")
    mark = testbed.events.mark()
    document = testbed.snapshot_document(version="2")
    routes = document["routes"][0]["virtual_hosts"][0]["routes"]
    routes.insert(0, {"match": {"safe_regex": {"regex": "(("}}, "route": {"cluster": "web"}})
    write_document(testbed.snapshot_path, document)
    nack = testbed.events.wait_for(is_event("nack", node="edge-1", type=RDS), after=mark, what="Envoy's NACK of RDS")
    assert nack["error"] == "missing ): ((", "the event log keeps Envoy's own message"
    table = pilotfish("status", "--admin", testbed.control_plane.admin, check=False)
    assert table.returncode == 1, "a NACKED proxy fails the status"
    assert f"edge-1 rejected RDS 2: '{ROUTE_NAME}': missing ): ((" in table.stdout.splitlines(), table.stdout
    rds = _proxies(testbed)["edge-1"]["types"]["RDS"]
    assert rds["state"] == "NACKED" and rds["nack"]["summary"] == f"'{ROUTE_NAME}': missing ): ((", rds
    # The warning on stderr: one line, with the name and the reason.
    stderr = testbed.control_plane.process.stderr_path

    def warned() -> list[str]:
        return [line for line in stderr.read_text().splitlines() if "rejected" in line]

    wait_until(lambda: bool(warned()), timeout=10, what="the NACK's warning on stderr")
    [line] = warned()
    assert line.endswith(f"edge-1 rejected RouteConfiguration version 2: '{ROUTE_NAME}': missing ): (("), line
