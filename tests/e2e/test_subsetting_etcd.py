"""Subsetting indices in etcd (subsetting with replicas on etcd): replicas on one etcd give a proxy the same
subset whichever of them it asks, and restarting every replica changes nobody's subset.

A real etcd holds service ``web`` (``subset_size: 3``) and its instances; two ``pilotfish serve
--etcd`` replicas serve it; proxies are raw grpcio ADS streams asking for ``web``'s endpoints.
"""

from __future__ import annotations

import base64
import functools
import json

import pytest
from envoy.service.discovery.v3 import discovery_pb2

from .ads_client import AdsClient, endpoints_of
from .etcd import Etcd
from .event_log import is_event
from .processes import ControlPlane, ProcessGroup, free_port, http_json, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

EDS = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"
NODES = [f"edge-{n}" for n in range(4)]


def subset(replica: ControlPlane, node: str) -> tuple[set[str], str]:
    """``node``'s endpoints of ``web`` as ``replica`` serves them, and their version."""
    client = AdsClient(replica.address)
    try:
        request = discovery_pb2.DiscoveryRequest(type_url=EDS, resource_names=["web"])
        request.node.id = node
        response = client.ask(request)
    finally:
        client.close()
    return endpoints_of(response)["web"], response.version_info


def put_instance(etcd: Etcd, port: int) -> None:
    etcd.put_json(f"/pilotfish/instances/web/{port}", {"address": "127.0.0.1", "port": port})


def backend_table(etcd: Etcd) -> dict[str, int]:
    table = etcd.get_json("/pilotfish.subsets/backends/web")
    return {} if table is None else dict(table["indices"])


def test_replicas_share_the_indices_in_etcd_and_a_restart_keeps_every_subset(processes: ProcessGroup) -> None:
    etcd = Etcd.start(processes)
    etcd.put_json("/pilotfish/services/web", {"subset_size": 3})
    for port in range(9000, 9012):
        put_instance(etcd, port)
    replicas = [
        ControlPlane(processes, None, free_port(), etcd=etcd.address, name=f"replica{n}", options=("--quiet-ms", "50"))
        for n in range(2)
    ]
    for replica in replicas:
        replica.start().wait_for(is_event("etcd_synced"), what="the first list of etcd")
    wait_until(
        lambda: len(backend_table(etcd)) == 12,
        timeout=15,
        what="the elected replica to write web's backend indices to etcd",
    )

    def served(node: str) -> list[tuple[set[str], str]]:
        return [subset(replica, node) for replica in replicas]

    def same_everywhere(node: str) -> bool:
        return len({(frozenset(s), v) for s, v in served(node)}) == 1

    def agreed() -> dict[str, tuple[set[str], str]]:
        """Each node's subset and version, once every replica serves it the same (polled: a
        replica applies etcd's keys a moment after another)."""
        out = {}
        for node in NODES:
            wait_until(
                functools.partial(same_everywhere, node),
                timeout=15,
                what=f"both replicas to serve {node} the same subset",
                details=functools.partial(lambda n: str(served(n)), node),
            )
            out[node] = served(node)[0]
        return out

    first = agreed()
    assert all(len(chosen) == 3 for chosen, _ in first.values())
    assert len({frozenset(chosen) for chosen, _ in first.values()}) == len(NODES), "each node its own subset"
    indices = {
        node: int(base64.b64decode(kv["value"]))
        for node in NODES
        for kv in [etcd_kv(etcd, f"/pilotfish.subsets/proxies/{node}")]
        if kv
    }
    assert sorted(indices.values()) == list(range(len(NODES))), indices

    # A 13th backend: indexed once, in etcd; every replica still agrees.
    put_instance(etcd, 9012)
    wait_until(lambda: len(backend_table(etcd)) == 13, timeout=15, what="the 13th backend's index in etcd")
    second = agreed()
    for node in NODES:
        before, after = first[node][0], second[node][0]
        assert len(before - after) <= 1 and len(after - before) <= 1, (node, before, after)

    # Every replica restarted: the same indices, so the same subsets and versions.
    for replica in replicas:
        replica.stop()
    for replica in replicas:
        replica.start().wait_for(is_event("etcd_synced"), what="etcd listed after the restart")
    assert agreed() == second
    # After the restart (a fresh listing), a new backend is still indexed by the elected replica.
    put_instance(etcd, 9013)
    wait_until(lambda: len(backend_table(etcd)) == 14, timeout=15, what="a backend added after the restart indexed")
    agreed()
    status, health = http_json("GET", f"http://{replicas[0].admin}/healthz")
    assert status == 200 and health["etcd"]["revision"] > 0, health


def etcd_kv(etcd: Etcd, key: str) -> dict[str, str] | None:
    status, answer = http_json(
        "POST", f"http://{etcd.address}/v3/kv/range", {"key": base64.b64encode(key.encode()).decode()}
    )
    assert status == 200, answer
    kvs = answer.get("kvs", [])
    return kvs[0] if kvs else None


def test_a_corrupt_index_table_in_etcd_is_reported_and_rewritten(processes: ProcessGroup) -> None:
    """Found corrupt when a replica starts (no other change follows): named in the log, the
    service served whole meanwhile, and written again by the elected replica."""
    etcd = Etcd.start(processes)
    etcd.put_json("/pilotfish/services/web", {"subset_size": 3})
    for port in range(9000, 9006):
        put_instance(etcd, port)
    replica = ControlPlane(processes, None, free_port(), etcd=etcd.address, options=("--quiet-ms", "50"))
    replica.start()
    wait_until(lambda: len(backend_table(etcd)) == 6, timeout=15, what="web's backend indices in etcd")
    replica.stop()
    etcd.put("/pilotfish.subsets/backends/web", json.dumps({"version": 1, "indices": {"127.0.0.1:9000": -1}}))
    etcd.put("/pilotfish.subsets/proxies/edge-9", "not an index")
    replica.start()
    wait_until(
        lambda: len(backend_table(etcd)) == 6 and min(backend_table(etcd).values()) == 0,
        timeout=15,
        what="the elected replica to write a good table again",
    )
    log = replica.process.output_tail(400)
    assert "/pilotfish.subsets/backends/web is not a backend index table" in log
    assert "/pilotfish.subsets/proxies/edge-9 is not a proxy index" in log
    # Subsets again once the replica has the good table; the node with the bad key gets an index.
    wait_until(lambda: len(subset(replica, "edge-0")[0]) == 3, timeout=15, what="edge-0's subset of 3 again")
    wait_until(lambda: len(subset(replica, "edge-9")[0]) == 3, timeout=15, what="edge-9 indexed again")
    assert "critical" not in log.lower(), log
