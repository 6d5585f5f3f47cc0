"""What a Prometheus scrape of ``GET /metrics`` returns (pilotfish.api.metrics) for a given state:
the very text lines, from a real :class:`~pilotfish.status.SyncStatus` and a real reconciler.

The collector reads plain counters at scrape time: per type (CDS, EDS, ... by short name), per node
group and per source, never per proxy; the publish-to-ACK histogram is cumulative, in seconds. The
same endpoint over HTTP, with real ADS clients moving the counters: tests/integration/test_metrics.py.
"""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from pilotfish.api.metrics import CONTENT_TYPE, Metrics
from pilotfish.build.desired import DesiredState
from pilotfish.cache import SnapshotCache
from pilotfish.reconcile import Reconciler
from pilotfish.resources import CLUSTER, ENDPOINT
from pilotfish.resources.services import Endpoint, ServiceSpec
from pilotfish.status import ACK_BUCKETS, NodeInfo, SyncStatus

CDS, EDS = CLUSTER.url, ENDPOINT.url
UNKNOWN = "type.googleapis.com/envoy.config.foo.v3.Thing"
WEB = DesiredState(
    services={"web": ServiceSpec(name="web", listen=("127.0.0.1", 10000))},
    endpoints={"web": (Endpoint("127.0.0.1", 9001),)},
)


class Wall:
    def __init__(self) -> None:
        self.now = 1_700_000_000.0

    def __call__(self) -> float:
        return self.now


def scrape(status: SyncStatus, reconciler: Reconciler, *, streams: int = 0) -> list[str]:
    """The sample lines of one scrape (the ``# HELP`` and ``# TYPE`` lines left out)."""
    cache = reconciler.cache
    assert isinstance(cache, SnapshotCache)
    text = Metrics(status, reconciler, cache=cache, open_streams=lambda: streams).render().decode()
    return [line for line in text.splitlines() if not line.startswith("#")]


def test_a_scrape_counts_per_type_and_per_group_what_proxies_were_sent_acked_and_nacked() -> None:
    wall = Wall()
    status = SyncStatus(wall_clock=wall)
    status.stream_opened("edge-1", NodeInfo(group="default"))
    status.stream_opened("edge-2", NodeInfo(group="default"))
    status.stream_opened("grpc-1", NodeInfo(group="grpc"))
    for node in ("edge-1", "edge-2"):
        status.sent(node, CDS, "c1")
        status.acked(node, CDS, "c1")
    status.sent("edge-2", EDS, "e1")
    status.nacked("edge-2", EDS, "e1", "connect_timeout: value must be greater than 0s")
    status.sent("grpc-1", UNKNOWN, "t1")  # a type pilotfish has no short name for: the last part of its URL
    status.stream_closed("grpc-1")

    lines = scrape(status, Reconciler(SnapshotCache()), streams=2)

    assert [line for line in lines if line.startswith(("pilotfish_proxies", "pilotfish_xds"))] == [
        'pilotfish_proxies_connected{group="default"} 2.0',
        "pilotfish_xds_streams 2.0",
        'pilotfish_xds_responses_total{type="CDS"} 2.0',
        'pilotfish_xds_responses_total{type="EDS"} 1.0',
        'pilotfish_xds_responses_total{type="Thing"} 1.0',
        'pilotfish_xds_acks_total{type="CDS"} 2.0',
        'pilotfish_xds_acks_total{type="EDS"} 0.0',
        'pilotfish_xds_acks_total{type="Thing"} 0.0',
        'pilotfish_xds_nacks_total{type="CDS"} 0.0',
        'pilotfish_xds_nacks_total{type="EDS"} 1.0',
        'pilotfish_xds_nacks_total{type="Thing"} 0.0',
    ]
    # No series per proxy: a fleet of 10,000 would make 10,000 of them.
    assert not [line for line in lines if "edge-" in line or "grpc-1" in line]


def test_the_publish_to_ack_histogram_counts_each_proxys_first_ack_of_the_current_version() -> None:
    wall = Wall()
    status = SyncStatus(wall_clock=wall)
    status.published("default", label="v1", versions={CDS: "c1"})
    for node, after in (("edge-1", 0.02), ("edge-2", 0.3), ("edge-3", 7.0)):
        status.stream_opened(node, NodeInfo(group="default"))
        status.sent(node, CDS, "c1")
        wall.now += after
        status.acked(node, CDS, "c1")
        wall.now -= after
    wall.now += 100
    status.acked("edge-1", CDS, "c1")  # the same ACK again (an unchanged resend): not a second observation
    status.sent("edge-2", CDS, "c0")
    status.acked("edge-2", CDS, "c0")  # an ACK of a version that is not the group's current one: not observed

    lines = scrape(status, Reconciler(SnapshotCache()))

    histogram = [line for line in lines if line.startswith("pilotfish_publish_to_ack_seconds")]
    cumulative = {
        0.01: 0,
        0.025: 1,
        0.05: 1,
        0.1: 1,
        0.25: 1,
        0.5: 2,
        1.0: 2,
        2.5: 2,
        5.0: 2,
        10.0: 3,
        30.0: 3,
        60.0: 3,
    }
    assert tuple(cumulative) == ACK_BUCKETS
    assert histogram[:-1] == [
        *(
            f'pilotfish_publish_to_ack_seconds_bucket{{le="{bound}"}} {float(count)}'
            for bound, count in cumulative.items()
        ),
        'pilotfish_publish_to_ack_seconds_bucket{le="+Inf"} 3.0',
        "pilotfish_publish_to_ack_seconds_count 3.0",
    ]
    name, seconds = histogram[-1].split()
    assert name == "pilotfish_publish_to_ack_seconds_sum" and abs(float(seconds) - 7.32) < 1e-6


def test_a_scrape_says_what_the_reconciler_published_held_and_which_sources_report_or_fail() -> None:
    reconciler = Reconciler(SnapshotCache(), expect=("file", "etcd"))
    status = SyncStatus()
    reconciler.update("file", WEB)
    assert reconciler.build_now() is None  # etcd has not reported yet: nothing is published
    lines = scrape(status, reconciler)
    assert 'pilotfish_source_ready{source="etcd"} 0.0' in lines
    assert 'pilotfish_source_ready{source="file"} 1.0' in lines
    assert "pilotfish_snapshots_published_total 0.0" in lines

    reconciler.update("etcd", DesiredState())
    assert reconciler.build_now() is not None
    reconciler.source_error("etcd", "etcd unreachable")  # its last good state keeps serving
    reconciler.update("file", DesiredState())  # every cluster and listener gone at once: held
    assert reconciler.build_now() is None and reconciler.held is not None

    lines = scrape(status, reconciler)  # two builds: waiting for a source is not one
    for line in (
        "pilotfish_snapshots_published_total 1.0",
        "pilotfish_snapshots_held_total 1.0",
        "pilotfish_snapshot_held 1.0",
        "pilotfish_snapshots_refused_total 0.0",
        "pilotfish_snapshot_refused 0.0",
        "pilotfish_snapshot_build_seconds_count 2.0",
        'pilotfish_source_ready{source="etcd"} 1.0',
        'pilotfish_source_failing{source="etcd"} 1.0',
        'pilotfish_source_failing{source="file"} 0.0',
        'pilotfish_source_errors_total{source="etcd"} 1.0',
        'pilotfish_source_errors_total{source="file"} 0.0',
    ):
        assert line in lines, (line, lines)

    reconciler.confirm()
    lines = scrape(status, reconciler)
    assert "pilotfish_snapshot_held 0.0" in lines and "pilotfish_snapshots_published_total 2.0" in lines


def test_the_text_is_the_prometheus_exposition_format_its_own_parser_reads() -> None:
    status = SyncStatus()
    status.stream_opened("edge-1", NodeInfo(group="default"))
    status.sent("edge-1", CDS, "c1")
    cache = SnapshotCache()
    text = Metrics(status, Reconciler(cache), cache=cache, open_streams=lambda: 1).render().decode()
    families = {family.name: family for family in text_string_to_metric_families(text)}
    assert CONTENT_TYPE == "text/plain; version=0.0.4; charset=utf-8"
    assert families["pilotfish_xds_responses"].type == "counter"
    assert families["pilotfish_publish_to_ack_seconds"].type == "histogram"
    assert families["pilotfish_snapshot_build_seconds"].type == "summary"
    assert families["pilotfish_proxies_connected"].type == "gauge"
    assert all(name.startswith("pilotfish_") for name in families)  # none of the client library's own
