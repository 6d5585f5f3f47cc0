"""The delivery between the reconciler and the cache: which snapshot a proxy's watches are answered
from, and make-before-break when a wave moves between the baseline and the candidate.

A SotW stream (the protocol's state machine, no I/O) is wired to a real cache through the
delivery's routing, as the xDS server wires it: each watch opened on the group the delivery names,
every watch opened again when the delivery says the proxy moved.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
from conftest import CDS, EDS, LDS, RDS, Received, StreamPair, assignment, build, cluster, listener, route

from pilotfish.cache import DEFAULT_GROUP, SnapshotCache
from pilotfish.events import EventLog
from pilotfish.rollout.delivery import Delivery, candidate_group, spliced
from pilotfish.rollout.gates import Counts
from pilotfish.rollout.load import ClusterLoad, LoadReport, LoadSettings, LoadStore
from pilotfish.rollout.machine import RolloutSettings
from pilotfish.rollout.waves import parse_waves
from pilotfish.snapshot import Snapshot
from pilotfish.status import NodeInfo, SyncStatus


@dataclass
class RoutedPair(StreamPair):
    """A stream of proxy ``node`` whose watches go where the delivery routes them."""

    node: str = "c-1"

    def moved(self, nodes: frozenset[str]) -> None:
        """The delivery moved ``nodes``: open every watch again (the server's ``rewatch_all``)."""
        if self.node in nodes:
            for type_url in (CDS, EDS, LDS, RDS):
                if type_url in self.watches:
                    self.open(self.watches[type_url])

    def latest(self, type_url: str) -> Received:
        return [r for r in self.inbox if r.type_url == type_url][-1]

    def sync(self) -> None:
        """ACK the latest response of each type (as a proxy that accepts everything)."""
        for type_url in (CDS, EDS, LDS, RDS):
            got = [r for r in self.inbox if r.type_url == type_url]
            if got:
                self.ack(got[-1], ["local"] if type_url == RDS else [])


def snapshot(clusters: list[str], routed_to: str) -> Snapshot:
    return build(
        clusters=[cluster(name) for name in clusters],
        endpoints=[assignment(name, 9000 + i) for i, name in enumerate(clusters)],
        listeners=[listener("http", "local")],
        routes=[route("local", routed_to)],
    )


def deliver(cache: SnapshotCache, status: SyncStatus) -> Delivery:
    settings = RolloutSettings(waves=parse_waves("canary=c-*,100%"), bake=3600.0, health=None)
    return Delivery(cache, settings, status=status, events=EventLog())


def connect(cache: SnapshotCache, delivery: Delivery, status: SyncStatus, node: str) -> RoutedPair:
    pair = RoutedPair(cache, node=node, group=lambda: delivery.route(node, DEFAULT_GROUP))
    delivery.follow(pair.moved)
    status.stream_opened(node, NodeInfo(group="default"))
    pair.send(CDS, node_id=node)
    pair.send(LDS)
    return pair


def test_endpoints_come_from_the_latest_build_and_a_removed_cluster_keeps_its_own() -> None:
    base = snapshot(["old", "web"], "old")
    latest = snapshot(["web", "new"], "new")
    served = spliced(base, latest, frozenset({CDS, LDS, RDS}))
    assert served.types[CDS] is base.types[CDS] and served.types[RDS] is base.types[RDS]
    assert set(served.types[EDS].resources) == {"old", "web", "new"}
    assert served.types[EDS].resources["web"] is latest.types[EDS].resources["web"]
    assert served.types[EDS].resources["old"] is base.types[EDS].resources["old"]


def test_a_wave_moved_to_the_candidate_keeps_the_cluster_its_routes_use_until_it_has_the_new_routes() -> None:
    cache, status = SnapshotCache(), SyncStatus()
    delivery = deliver(cache, status)
    delivery.publish({DEFAULT_GROUP: snapshot(["old"], "old")})
    canary = connect(cache, delivery, status, "c-1")
    other = connect(cache, delivery, status, "p-1")
    for pair in (canary, other):
        pair.send(RDS, ["local"])
        pair.sync()
        assert pair.latest(CDS).names == ["old"]

    # The candidate routes to a new cluster and drops the old one: the canary moves to it.
    delivery.publish({DEFAULT_GROUP: snapshot(["new"], "new")})
    assert sorted(canary.latest(CDS).names) == ["new", "old"]  # its routes still use old: bridged
    assert other.latest(CDS).names == ["old"]  # (the baseline: not moved)
    canary.ack(canary.latest(CDS))
    canary.ack(canary.latest(RDS), ["local"])  # it runs the new routes now
    assert canary.latest(CDS).names == ["new"]
    assert cache.snapshot(candidate_group(DEFAULT_GROUP)) is not None


def test_a_rollback_keeps_the_candidates_cluster_until_the_baselines_routes_are_back() -> None:
    cache, status = SnapshotCache(), SyncStatus()
    delivery = deliver(cache, status)
    delivery.publish({DEFAULT_GROUP: snapshot(["old"], "old")})
    canary = connect(cache, delivery, status, "c-1")
    canary.send(RDS, ["local"])
    canary.sync()
    delivery.publish({DEFAULT_GROUP: snapshot(["new"], "new")})
    canary.ack(canary.latest(CDS))
    canary.ack(canary.latest(RDS), ["local"])
    canary.ack(canary.latest(CDS))
    assert canary.latest(CDS).names == ["new"]

    delivery.abort("by hand")  # back to the baseline: its clusters lack new, which its routes use
    assert sorted(canary.latest(CDS).names) == ["new", "old"]
    canary.ack(canary.latest(CDS))
    canary.ack(canary.latest(RDS), ["local"])
    assert canary.latest(CDS).names == ["old"]


def test_another_replicas_load_counts_and_a_bad_export_is_said_once_and_loses_nothing_else(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = [1000.0]
    settings = RolloutSettings(waves=parse_waves("canary=c-*,100%"), bake=30.0)
    loads = LoadStore(LoadSettings(bucket=5.0), clock=lambda: clock[0], classify=settings.waves.assign)
    delivery = Delivery(
        SnapshotCache(), settings, status=SyncStatus(), events=EventLog(), loads=loads, clock=lambda: clock[0]
    )
    follower = LoadStore(LoadSettings(bucket=5.0), clock=lambda: clock[0], classify=settings.waves.assign)
    follower.ingest(
        "c-1",
        LoadReport(
            None, (ClusterLoad("web", "", successful=5, errors=5, issued=10, in_progress=0, dropped=0, interval=0),)
        ),
    )
    clock[0] = 1006.0  # (the bucket it began in, [1000, 1005), is over)
    good: dict[str, Any] = {"at": clock[0], "candidate": None, "proxies": {"p-1": ["default", [], []]}, "nacks": []}
    delivery.absorb("two", good | {"load": follower.export(900.0)})
    assert loads.window([0], 900.0) == {"web": Counts(successful=5, errors=5, issued=10)}
    for _ in range(3):
        delivery.absorb("three", good | {"load": {"bucket": 1.0, "series": []}})
    refused = [r.getMessage() for r in caplog.records if "not counted" in r.getMessage()]
    assert len(refused) == 1 and "replica three" in refused[0] and "--rollout-bake" in refused[0], refused
    assert delivery.status()["proxies_elsewhere"] == 2  # (both replicas' proxies are taken)
