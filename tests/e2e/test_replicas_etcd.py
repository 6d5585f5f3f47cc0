"""Replicas on etcd with registrations through the registry API, under load: a replica dies, etcd
itself restarts, and no request fails.

Everything is real: one etcd, ``pilotfish serve --etcd ... --registry ...`` replicas with no
snapshot file (the services and instances are defined through the registry API), upstreams, Envoys
whose bootstraps list every replica, and wrk through every Envoy (each Envoy has a listener of its
own, with the routes pilotfish serves for ``web``: see :mod:`.replicas`).

Instances change the way a deployment changes them (test_endpoint_changes.py's module docstring):
**add** = start the upstream, then register it; **remove** = deregister, wait until every Envoy
dropped it, then stop the upstream.

Which replica an Envoy's stream lands on is Envoy's choice: round robin over the bootstrap's
addresses, which Envoy's load balancer starts at a random offset (``seed_ % hosts.size()`` picks
skipped at each refresh), so the order of the addresses cannot choose it. The tests read it from
each replica's ``/v1/proxies`` instead. Four Envoys on three replicas: at least one replica holds
two of them, and that one is SIGKILLed.
"""

from __future__ import annotations

import functools
from collections import Counter

import pytest

from .etcd import Etcd
from .event_log import CDS, EDS, LDS, RDS, is_event
from .processes import (
    ControlPlane,
    ProcessGroup,
    Upstream,
    envoy_binary,
    free_port,
    http_json,
    wait_until,
)
from .registry_client import RegistryClient
from .replicas import (
    SERVICE,
    Fleet,
    address,
    connected_nodes,
    etcd_replicas,
    etcd_revision,
    snapshot_versions,
    where_connected,
)
from .wrk import wrk_binary

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

OTHER = "api"
"""A second service (a cluster without a listener): an EDS answer that re-sent what did not
change would carry its assignment too."""
TYPES = ("CDS", "EDS", "LDS", "RDS")
TYPE_URLS = {"CDS": CDS, "EDS": EDS, "LDS": LDS, "RDS": RDS}


def served(plane: ControlPlane) -> dict[str, str] | None:
    """The CDS, EDS, LDS and RDS versions ``plane`` serves Envoys (None: not all of them yet)."""
    versions = snapshot_versions(plane)
    return {kind: versions[kind] for kind in TYPES} if all(kind in versions for kind in TYPES) else None


def synced(plane: ControlPlane, node: str) -> dict[str, str] | None:
    """The versions ``node`` ACKed on ``plane``, once they are every type ``plane`` serves."""
    proxy = connected_nodes(plane).get(node)
    current = served(plane)
    if proxy is None or current is None:
        return None
    acked = {kind: proxy["types"].get(kind, {}).get("acked_version") for kind in TYPES}
    return acked if acked == current else None


def same_versions(planes: list[ControlPlane]) -> dict[str, str] | None:
    """The versions every live replica serves, once they agree (and are idle: nothing pending)."""
    live = [plane for plane in planes if plane.process.alive()]
    seen = [served(plane) for plane in live]
    pending = [http_json("GET", f"http://{plane.admin}/v1/snapshots")[1]["pending"] for plane in live]
    if any(pending) or seen[0] is None or any(versions != seen[0] for versions in seen):
        return None
    return seen[0]


def check_sent_only_changes(
    plane: ControlPlane, node: str, *, had: dict[str, str], now: dict[str, str], delta: bool
) -> None:
    """``node``, which moved to ``plane`` holding the versions ``had`` (those of the replica that
    died), stated them on its new stream and was sent only web's changed assignment (never a
    cluster, listener or route, nor another service's assignment), up to ``now``."""
    events = plane.events
    opened = events.select(is_event("stream_open", node=node))[-1]
    after_open = events.index_of(opened)
    # Its ACK of the latest endpoints: everything sent to it is in the log before that.
    events.wait_for(
        lambda e: (
            is_event("ack", node=node, type=EDS)(e) and e.get("version" if delta else "version_info") == now["EDS"]
        ),
        after=after_open,
        what=f"{node}'s ACK of the latest endpoints on {plane.name}",
    )
    for kind in TYPES:  # it stated what it had
        request = events.find(
            functools.partial(
                lambda k, e: (
                    is_event("request", node=node, type=TYPE_URLS[k])(e) and (not delta or "initial_resources" in e)
                ),
                kind,
            ),
            after=after_open,
        )
        assert request is not None, (node, kind, events.describe(after=after_open))
        if delta:  # web and api; web's listener and route
            assert request["initial_resources"] == {"CDS": 2, "EDS": 2, "LDS": 1, "RDS": 1}[kind], (node, request)
        else:
            assert request["version_info"] == had[kind], (node, kind, request)
    sent = events.select(is_event("sent", node=node), after=after_open)
    if delta:  # an answer that carries nothing (the proxy was current) sends nothing it had
        sent = [e for e in sent if e["names"] or e["removed"]]
        resent = [e for e in sent if e["type"] != EDS or e["names"] != [SERVICE] or e["removed"]]
    else:
        resent = [e for e in sent if e["type"] != EDS or e["version"] == had["EDS"] or e["resources"] != 1]
    assert sent and not resent, (
        f"{node}, moved to {plane.name}, was sent more than web's changed endpoints:\n"
        + events.describe(after=after_open)
    )


def describe_snapshots(planes: list[ControlPlane]) -> str:
    """Each live replica's ``/v1/snapshots``, for a failure message."""
    return "\n".join(
        f"{plane.name}: {http_json('GET', f'http://{plane.admin}/v1/snapshots')[1]}"
        for plane in planes
        if plane.process.alive()
    )


@pytest.mark.parametrize("delta", [False, True], ids=["sotw", "delta"])
def test_a_replica_holding_two_envoys_is_killed_while_instances_change(processes: ProcessGroup, delta: bool) -> None:
    """Three replicas, four Envoys spread over them (SotW, or incremental xDS), wrk through each.
    The replica holding two (or more) Envoys is SIGKILLed; meanwhile an instance is registered and
    another deregistered through a live replica. The orphaned Envoys reconnect to live replicas and
    are sent only what changed; the killed replica, restarted, catches up and serves the same
    versions."""
    envoy_binary()
    wrk_binary()
    etcd = Etcd.start(processes)
    planes = etcd_replicas(processes, etcd, 3)
    u0, u1, u2 = (Upstream.start(processes, name) for name in ("u0", "u1", "u2"))  # u2: added under load
    registry = RegistryClient(planes[0].registry_url)
    registry.define(SERVICE, listen=f"127.0.0.1:{free_port()}", protocol="http")
    registry.define(OTHER)
    for upstream in (u0, u1):
        registry.register(SERVICE, "127.0.0.1", upstream.port)
    registry.register(OTHER, "127.0.0.1", u1.port)

    fleet = Fleet()
    xds = ",".join(plane.address for plane in planes)
    for i in range(4):
        fleet.start(processes, f"edge-{i}", xds, delta=delta)
    fleet.wait_for_endpoints([address(u0), address(u1)], timeout=20)
    placed = wait_until(
        lambda: where_connected(planes, fleet.envoys), timeout=15, what="every Envoy's stream on one replica"
    )
    had = wait_until(
        lambda: same_versions(planes),
        timeout=15,
        what="the replicas to serve the same versions",
        details=lambda: describe_snapshots(planes),
    )
    for node, plane in placed.items():
        wait_until(functools.partial(synced, plane, node), timeout=15, what=f"{node} to ACK every type on {plane.name}")
    held = Counter(plane.name for plane in placed.values())
    victim = next(plane for plane in planes if plane.name == held.most_common(1)[0][0])
    orphans = sorted(node for node, plane in placed.items() if plane is victim)
    assert len(orphans) >= 2, held  # four Envoys on three replicas
    writer = RegistryClient(next(plane for plane in planes if plane is not victim).registry_url)

    fleet.start_load(processes, duration_s=90)
    victim.process.stop(kill=True)

    # Meanwhile, through another replica: add u2 (already started), then remove u0.
    writer.register(SERVICE, "127.0.0.1", u2.port)
    fleet.wait_for_endpoints([address(u0), address(u1), address(u2)])
    fleet.wait_for_traffic_to(u2)
    writer.deregister(SERVICE, address(u0))
    final = sorted([address(u1), address(u2)])
    fleet.wait_for_endpoints(final)
    u0.retire()
    fleet.assert_under_load()

    # The orphans are on live replicas, and were sent only what changed: EDS with web's assignment.
    moved = wait_until(
        lambda: where_connected(planes, orphans), timeout=15, what="the orphaned Envoys' streams on live replicas"
    )
    assert all(plane is not victim and plane.process.alive() for plane in moved.values()), moved
    now = wait_until(lambda: same_versions(planes), timeout=15, what="the live replicas to agree")
    assert {kind: now[kind] == had[kind] for kind in TYPES} == {"CDS": True, "EDS": False, "LDS": True, "RDS": True}, (
        had,
        now,
    )
    for node, plane in moved.items():
        check_sent_only_changes(plane, node, had=had, now=now, delta=delta)

    fleet.check_loads()
    for envoy in fleet.envoys.values():
        assert envoy.cluster_endpoints(SERVICE) == final, envoy.name
    for plane in planes:
        if plane.process.alive():
            assert not plane.events.select(is_event("nack")), f"an Envoy rejected {plane.name}'s configuration"

    # The killed replica comes back: it lists etcd, reaches the others' revision, serves their versions.
    victim.start().wait_for(is_event("etcd_synced"), what="the restarted replica's list of etcd")
    live = [plane for plane in planes if plane is not victim]
    wait_until(
        lambda: etcd_revision(victim) >= max(etcd_revision(plane) for plane in live),
        timeout=15,
        what="the restarted replica to reach the others' etcd revision",
    )
    wait_until(
        lambda: same_versions(planes) == now,
        timeout=15,
        what="the restarted replica to serve the versions the others serve",
        details=lambda: str({plane.name: snapshot_versions(plane) for plane in planes}),
    )


def test_etcd_restarted_under_load(processes: ProcessGroup) -> None:
    """Two replicas, an Envoy on each, wrk through both; etcd stops and starts again. The load sees
    no error, no replica publishes anything while etcd is away or when it lists etcd again (the
    same state: no empty push), a write during the outage is refused with 503 naming etcd (and not
    made), and a write once etcd is back reaches both Envoys."""
    envoy_binary()
    wrk_binary()
    etcd = Etcd.start(processes)
    planes = etcd_replicas(processes, etcd, 2)
    u0, u1, u2 = (Upstream.start(processes, name) for name in ("u0", "u1", "u2"))
    registry = RegistryClient(planes[0].registry_url)
    registry.define(SERVICE, listen=f"127.0.0.1:{free_port()}", protocol="http")
    for upstream in (u0, u1):
        registry.register(SERVICE, "127.0.0.1", upstream.port)

    fleet = Fleet()
    for i, plane in enumerate(planes):
        fleet.start(processes, f"edge-{i}", plane.address)
    before = sorted([address(u0), address(u1)])
    fleet.wait_for_endpoints(before, timeout=20)
    wait_until(lambda: same_versions(planes), timeout=15, what="the replicas to serve the same versions")
    fleet.start_load(processes, duration_s=90)

    marks = {plane.name: plane.events.mark() for plane in planes}
    etcd.stop()
    for plane in planes:
        plane.events.wait_for(
            is_event("etcd_disconnected"), after=marks[plane.name], what=f"{plane.name} to notice etcd is gone"
        )
    for plane in planes:
        status, answer = http_json(
            "POST", plane.registry_url + f"/v1/services/{SERVICE}/instances", {"address": "127.0.0.1", "port": u2.port}
        )
        assert status == 503 and f"etcd at {etcd.address}" in answer["error"], answer
        status, answer = http_json("DELETE", plane.registry_url + f"/v1/services/{SERVICE}/instances/{address(u0)}")
        assert status == 503 and f"etcd at {etcd.address}" in answer["error"], answer
    for envoy in fleet.envoys.values():
        envoy.wait_for_requests(SERVICE, at_least=50)  # the fleet keeps serving without etcd

    etcd.run()
    for plane in planes:
        plane.events.wait_for(
            is_event("etcd_synced"), after=marks[plane.name], timeout=15, what=f"{plane.name} to list etcd again"
        )
    wait_until(lambda: same_versions(planes), timeout=15, what="the replicas idle after listing etcd again")
    assert etcd.get_json(f"/pilotfish/instances/{SERVICE}/{address(u2)}") is None, "a refused write was not made"
    for envoy in fleet.envoys.values():
        assert envoy.cluster_endpoints(SERVICE) == before, f"{envoy.name} lost endpoints across the etcd restart"

    # A write once etcd is back: the first snapshot either replica publishes since etcd went away.
    written = {plane.name: plane.events.mark() for plane in planes}
    RegistryClient(planes[1].registry_url).register(SERVICE, "127.0.0.1", u2.port)
    fleet.wait_for_endpoints([*before, address(u2)])
    fleet.wait_for_traffic_to(u2)
    fleet.assert_under_load()
    for plane in planes:
        events = plane.events
        loaded = events.wait_for(
            is_event("snapshot_loaded"), after=written[plane.name], what=f"{plane.name}'s snapshot with u2"
        )
        assert events.select(is_event("snapshot_loaded"), after=marks[plane.name]) == [loaded], (
            f"{plane.name} published while etcd was away or being listed again:\n"
            + events.describe(after=marks[plane.name])
        )
    fleet.check_loads()
