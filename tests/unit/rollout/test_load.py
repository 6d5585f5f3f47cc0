"""Load reports: the LoadStatsRequest decoder, and the windowed load store within its bounds, which
a hostile proxy tries to cross (docs/rollout.md, "Health from load reports")."""

from __future__ import annotations

import re
import tracemalloc

import pytest
from envoy.config.core.v3 import base_pb2
from envoy.config.endpoint.v3 import load_report_pb2
from envoy.service.load_stats.v3 import lrs_pb2

from pilotfish.app.settings import MAX_IGNORED_CLUSTERS, RolloutFlags
from pilotfish.resources.bootstrap import XDS_CLUSTER
from pilotfish.rollout.gates import Counts
from pilotfish.rollout.load import (
    MAX_COUNT,
    MAX_EXPORTED,
    OTHER,
    ClusterLoad,
    LoadReport,
    LoadSettings,
    LoadStore,
    decode_load_report,
)


class Clock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def load(cluster: str, successful: int = 0, errors: int = 0, interval: float = 5.0, issued: int = 0) -> ClusterLoad:
    return ClusterLoad(
        cluster=cluster,
        service="",
        successful=successful,
        errors=errors,
        issued=issued,
        in_progress=0,
        dropped=0,
        interval=interval,
    )


def report(*clusters: ClusterLoad) -> LoadReport:
    return LoadReport(node_id=None, clusters=clusters)


def test_a_load_stats_request_becomes_plain_values_with_localities_summed() -> None:
    message = lrs_pb2.LoadStatsRequest(node=base_pb2.Node(id="edge-1"))
    stats = message.cluster_stats.add(cluster_name="web", cluster_service_name="web-eds", total_dropped_requests=4)
    stats.load_report_interval.FromNanoseconds(2_500_000_000)
    for zone, ok, bad in (("a", 90, 10), ("b", 5, 1)):
        stats.upstream_locality_stats.append(
            load_report_pb2.UpstreamLocalityStats(
                locality=base_pb2.Locality(zone=zone),
                total_successful_requests=ok,
                total_error_requests=bad,
                total_issued_requests=ok + bad + 2,
                total_requests_in_progress=2,
            )
        )
    message.cluster_stats.add(cluster_name="api")  # no localities, no interval
    decoded = decode_load_report(lrs_pb2.LoadStatsRequest.FromString(message.SerializeToString()))
    assert decoded.node_id == "edge-1"
    assert decoded.clusters == (
        ClusterLoad(
            cluster="web",
            service="web-eds",
            successful=95,
            errors=11,
            issued=110,
            in_progress=4,
            dropped=4,
            interval=2.5,
        ),
        ClusterLoad(
            cluster="api", service="", successful=0, errors=0, issued=0, in_progress=0, dropped=0, interval=0.0
        ),
    )
    assert decode_load_report(lrs_pb2.LoadStatsRequest()).node_id is None  # later messages leave the node out


def test_counts_beyond_reason_are_bounded() -> None:
    message = lrs_pb2.LoadStatsRequest()
    stats = message.cluster_stats.add(cluster_name="web")
    for _ in range(3):
        stats.upstream_locality_stats.add(total_error_requests=2**64 - 1)
    assert decode_load_report(message).clusters[0].errors == MAX_COUNT


WAVES = {"a": 0, "b": 1, "c": 1}


def by_name(node_id: str, group: str) -> int:
    """A wave per proxy as a rollout's plan would assign it (here: by a table; unknown: the last)."""
    return WAVES.get(node_id, 2)


def test_a_window_counts_the_reports_that_began_in_it_per_cluster_summed_over_a_waves_proxies() -> None:
    clock = Clock(1000.0)
    store = LoadStore(LoadSettings(bucket=1.0, retention=120.0), clock=clock, classify=by_name)
    clock.now = 1010.0
    store.ingest("a", report(load("web", 90, 10, interval=10)))  # covers [1000, 1010]
    clock.now = 1020.0
    store.ingest("a", report(load("web", 50, 0, interval=10)))  # [1010, 1020]
    store.ingest("b", report(load("web", 100, 0, interval=10), load("api", 7, 1, interval=10)))
    store.ingest("c", report(load("web", 1, 1, interval=10)))
    assert store.window([0], 1000.0) == {"web": Counts(successful=140, errors=10)}
    assert store.window([0], 1005.0) == {"web": Counts(successful=50)}  # began before 1005: not counted
    assert store.window([1], 1010.0) == {"web": Counts(successful=101, errors=1), "api": Counts(successful=7, errors=1)}
    assert store.window([0, 1], 1010.0)["web"] == Counts(successful=151, errors=1)
    assert store.window([0], 1000.0, 1010.0) == {"web": Counts(successful=90, errors=10)}
    assert store.window([2], 0.0) == {}


def test_the_control_planes_own_cluster_is_not_the_applications_load() -> None:
    """Envoy reports its bootstrap's ``xds_cluster`` too, and counts a cut xDS stream (a replica
    killed) as a failed request there: that must not make a wave look broken."""
    store = LoadStore(LoadSettings(bucket=1.0), clock=Clock())
    store.ingest("a", report(load("web", 90, 0, interval=1), load(XDS_CLUSTER, 0, 1, interval=1)))
    assert store.window([0], 0.0) == {"web": Counts(successful=90)}
    store = LoadStore(LoadSettings(bucket=1.0, ignored=frozenset()), clock=Clock())
    store.ingest("a", report(load(XDS_CLUSTER, 0, 1, interval=1)))
    assert store.window([0], 0.0) == {XDS_CLUSTER: Counts(errors=1)}


def test_a_bootstraps_own_cluster_under_another_name_is_left_out_when_named() -> None:
    """A hand-written bootstrap may call the cluster of its streams to pilotfish otherwise
    (``--rollout-ignore-cluster``): named, its cut streams are not the application's errors either;
    unnamed, they are counted."""
    named = RolloutFlags(waves="canary=c-*,100%", ignore_clusters=("xds-grpc",)).load_settings()
    assert named.ignored == {XDS_CLUSTER, "xds-grpc"}
    cut = report(
        load("web", 90, 0, interval=1), load("xds-grpc", 0, 1, interval=1), load(XDS_CLUSTER, 0, 1, interval=1)
    )
    store = LoadStore(named, clock=Clock())
    store.ingest("a", cut)
    assert store.window([0], 0.0) == {"web": Counts(successful=90)}
    store = LoadStore(RolloutFlags(waves="canary=c-*,100%").load_settings(), clock=Clock())
    store.ingest("a", cut)
    assert store.window([0], 0.0) == {"web": Counts(successful=90), "xds-grpc": Counts(errors=1)}


@pytest.mark.parametrize(
    ("names", "said"),
    [
        (("",), "--rollout-ignore-cluster '': a cluster's name, 1 to 256 characters"),
        (("x" * 257,), "1 to 256 characters"),
        (tuple(f"c{i}" for i in range(MAX_IGNORED_CLUSTERS + 1)), f"at most {MAX_IGNORED_CLUSTERS} clusters"),
    ],
)
def test_a_cluster_to_leave_out_is_a_name_and_they_are_few(names: tuple[str, ...], said: str) -> None:
    with pytest.raises(ValueError, match=re.escape(said)):
        RolloutFlags(waves="canary=c-*,100%", ignore_clusters=names).settings()


def test_a_proxys_wave_is_asked_once_with_its_group() -> None:
    asked: list[tuple[str, str]] = []

    def classify(node_id: str, group: str) -> int:
        asked.append((node_id, group))
        return 1 if group == "canary" else 0

    store = LoadStore(LoadSettings(bucket=1.0), clock=Clock(), classify=classify)
    for _ in range(3):
        store.ingest("edge-1", report(load("web", 1, interval=1)), group="canary")
    assert asked == [("edge-1", "canary")]
    assert store.window([1], 0.0) == {"web": Counts(successful=3)}


def test_a_window_never_counts_load_from_before_it_began() -> None:
    clock = Clock(1002.5)
    store = LoadStore(LoadSettings(bucket=5.0, retention=60.0), clock=clock)
    clock.now = 1012.5
    store.ingest("a", report(load("web", 10, 0, interval=10)))  # began at 1002.5, bucket [1000, 1005)
    assert store.window([0], 1001.0) == {}  # a window from 1001 starts counting at the bucket of 1005
    assert store.window([0], 1000.0) == {"web": Counts(successful=10)}


def test_history_older_than_the_retention_is_gone() -> None:
    clock = Clock(0.0)
    store = LoadStore(LoadSettings(bucket=1.0, retention=30.0), clock=clock)
    clock.now = 10.0
    store.ingest("a", report(load("web", 5, 0, interval=1)))
    assert store.window([0], 0.0) == {"web": Counts(successful=5)}
    clock.now = 100.0
    store.ingest("a", report(load("web", 1, 0, interval=1)))
    assert store.window([0], 0.0) == {"web": Counts(successful=1)}


def test_clusters_beyond_a_waves_bound_are_folded_so_they_still_count() -> None:
    clock = Clock(100.0)
    store = LoadStore(LoadSettings(max_clusters=3, max_name=20), clock=clock)
    clusters = [load(f"c{i}", 10, 1) for i in range(10)] + [load("x" * 21, 10, 1), load("", 10, 1)]
    done = store.ingest("hostile", report(*clusters))
    assert (done.kept, done.folded, done.refused) == (3, 9, False)
    assert store.series == 3
    totals = store.window([0], 0.0)
    assert set(totals) == {"c0", "c1", "c2", OTHER}
    assert totals[OTHER] == Counts(successful=90, errors=9)
    assert sum(c.errors for c in totals.values()) == 12  # flooding with names hides no error
    done = store.ingest("other", report(load("c1", 1, 1), load("new", 1, 1)))
    assert (done.kept, done.folded) == (1, 1)  # the wave's three are taken: a new name is folded


def test_the_store_keeps_at_most_max_series_in_all() -> None:
    clock = Clock(100.0)
    store = LoadStore(LoadSettings(max_series=50, max_clusters=40), clock=clock, classify=lambda n, _: int(n[1:]) % 3)
    for p in range(20):
        store.ingest(f"p{p}", report(*(load(f"c{p}-{i}", 1) for i in range(10))))
    assert store.series == 50
    assert store.folded == 150
    assert sum(c.successful for c in store.window(range(3), 0.0).values()) == 200


def test_a_proxy_beyond_max_proxies_is_refused_until_a_stale_one_makes_room() -> None:
    clock = Clock(100.0)
    store = LoadStore(LoadSettings(max_proxies=3, retention=60.0), clock=clock)
    for p in range(3):
        store.ingest(f"p{p}", report(load("web", 1)))
    assert store.ingest("p3", report(load("web", 1))).refused
    assert store.refused == 1 and store.proxies == 3
    clock.now = 150.0
    store.ingest("p0", report(load("web", 1)))
    clock.now = 200.0  # p1 and p2 reported nothing for 100 s: stale
    assert not store.ingest("p3", report(load("web", 1))).refused
    assert store.proxies == 2


def test_a_node_id_beyond_reason_is_refused() -> None:
    store = LoadStore(LoadSettings(max_node_id=64), clock=Clock())
    assert store.ingest("n" * 65, report(load("web", 1))).refused
    assert not store.ingest("n" * 64, report(load("web", 1))).refused
    assert store.proxies == 1 and store.refused == 1


def test_a_flood_of_proxies_and_clusters_stays_within_the_memory_bound() -> None:
    clock = Clock(100.0)
    settings = LoadSettings(max_proxies=2_000, max_clusters=100, max_series=300, bucket=5.0, retention=300.0)
    store = LoadStore(settings, clock=clock, classify=lambda n, _: hash(n) % 4)
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        for step in range(2):
            clock.now = 100.0 + step * 5
            for p in range(2_500):  # beyond max_proxies, each naming clusters of its own: beyond max_series
                store.ingest(f"p{p}-{'x' * 100}", report(*(load(f"cluster-{p}-{i}", 10, 1) for i in range(20))))
        used = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    assert store.proxies == 2_000 and store.series == 300
    # the bound the module states: (max_series + waves) series of slots * 40 bytes, plus overheads,
    # and a proxy's id and two numbers
    bound = (settings.max_series + 4) * (settings.slots * 40 + 400) + settings.max_proxies * 500
    assert used < bound, (used, bound)


def test_another_replicas_export_counts_in_the_windows_and_replaces_what_it_said_before() -> None:
    clock = Clock(1000.0)
    follower = LoadStore(LoadSettings(bucket=1.0, retention=120.0), clock=clock, classify=by_name)
    leader = LoadStore(LoadSettings(bucket=1.0, retention=120.0), clock=clock, classify=by_name)
    clock.now = 1010.0
    follower.ingest("a", report(load("web", 90, 10, interval=1)))
    leader.ingest("b", report(load("web", 5, 0, interval=1)))
    leader.merge("follower", follower.export(1000.0))
    assert leader.window([0], 1000.0) == {"web": Counts(successful=90, errors=10)}
    assert leader.window([1], 1000.0) == {"web": Counts(successful=5)}
    follower.ingest("a", report(load("web", 10, 0, interval=1)))  # the same bucket, later
    for _ in range(2):  # (taking the same export twice counts it once)
        leader.merge("follower", follower.export(1000.0))
    assert leader.window([0], 1000.0) == {"web": Counts(successful=100, errors=10)}
    assert follower.window([1], 1000.0) == {}  # (the follower counts only its own)


def test_an_export_is_bounded_and_what_it_leaves_out_still_counts_in_other() -> None:
    clock = Clock(1000.0)
    follower = LoadStore(LoadSettings(bucket=1.0, max_clusters=5_000, max_series=5_000), clock=clock)
    follower.ingest("a", report(*(load(f"c{i}", 1, 1, interval=1) for i in range(MAX_EXPORTED + 100))))
    exported = follower.export(0.0)
    assert len(exported["series"]) == MAX_EXPORTED + 1
    leader = LoadStore(LoadSettings(bucket=1.0), clock=clock)
    leader.merge("follower", exported)
    totals = leader.window([0], 0.0)
    assert totals[OTHER] == Counts(successful=100, errors=100)
    assert sum(c.errors for c in totals.values()) == MAX_EXPORTED + 100


def test_an_export_that_is_not_one_is_refused_whole() -> None:
    leader = LoadStore(LoadSettings(bucket=1.0), clock=Clock())
    good = [0, "web", 1000, 1, 0, 1, 0]
    for bad in (
        {"bucket": 5.0, "series": [good]},  # another bucket width: counts would be misfiled
        {"bucket": 1.0, "series": "web"},
        {"bucket": 1.0, "series": [good, [0, "web", 1000, -1, 0, 0, 0]]},
        {"bucket": 1.0, "series": [good, [0, 7, 1000, 1, 0, 0, 0]]},
        {"bucket": 1.0, "series": [good, [0, "web", 1000, 1.5, 0, 0, 0]]},
        {"bucket": 1.0, "series": [good, [0, "web", 1000]]},
    ):
        with pytest.raises(ValueError):
            leader.merge("r", bad)
    assert leader.window([0], 0.0) == {}


def test_the_exports_of_at_most_max_replicas_are_kept() -> None:
    clock = Clock(1000.0)
    leader = LoadStore(LoadSettings(bucket=1.0, max_replicas=3), clock=clock)
    for r in range(5):
        clock.now = 1000.0 + r
        leader.merge(f"r{r}", {"bucket": 1.0, "series": [[0, "web", 999, 1, 0, 1, 0]]})
    assert leader.window([0], 0.0) == {"web": Counts(successful=3, issued=3)}  # r2, r3, r4
