"""What a Prometheus scrape of ``GET /metrics`` returns (pilotfish.api.metrics) for a given state:
the very text lines, from a real :class:`~pilotfish.status.SyncStatus` and a real reconciler.

The collector reads plain counters at scrape time: per type (CDS, EDS, ... by short name), per node
group and per source, never per proxy; the publish-to-ACK histogram is cumulative, in seconds. The
same endpoint over HTTP, with real ADS clients moving the counters: tests/integration/test_metrics.py.
"""

from __future__ import annotations

import os
import platform
import resource
import time
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from pilotfish.api.metrics import CONTENT_TYPE, DockerMetrics, Metrics, NameMetrics, ProcessMetrics, build_version
from pilotfish.build.desired import DesiredState, build_snapshot, merge_states
from pilotfish.cache import DEFAULT_GROUP, SnapshotCache
from pilotfish.events import EventLog
from pilotfish.reconcile import NameFigures, Reconciler, SubsetOptions
from pilotfish.resources import CLUSTER, ENDPOINT
from pilotfish.resources.services import Endpoint, ServiceSpec
from pilotfish.rollout.delivery import Delivery, candidate_group
from pilotfish.rollout.gates import HealthSettings
from pilotfish.rollout.load import ClusterLoad, LoadReport, LoadSettings, LoadStore
from pilotfish.rollout.machine import RolloutSettings
from pilotfish.rollout.waves import parse_waves
from pilotfish.snapshot import Snapshot
from pilotfish.sources.docker import Container, DockerSource, container_of_summary, parse_engine
from pilotfish.sources.registry import RegistryFigures
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
    text = Metrics(status, reconciler, cache=cache, open_streams=lambda: streams, process=False).render().decode()
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
        # Each connected proxy at its worst state over its types: edge-2 NACKED EDS (its CDS is SYNCED).
        'pilotfish_proxies_by_state{group="default",state="NACKED"} 1.0',
        'pilotfish_proxies_by_state{group="default",state="STALE"} 0.0',
        'pilotfish_proxies_by_state{group="default",state="NOT_SENT"} 0.0',
        'pilotfish_proxies_by_state{group="default",state="SYNCED"} 1.0',
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
    assert families["process_cpu_seconds"].type == "counter"
    assert families["pilotfish_build_info"].type == "gauge"
    assert CONTENT_TYPE == "text/plain; version=0.0.4; charset=utf-8"
    assert families["pilotfish_xds_responses"].type == "counter"
    assert families["pilotfish_publish_to_ack_seconds"].type == "histogram"
    assert families["pilotfish_snapshot_build_seconds"].type == "summary"
    assert families["pilotfish_proxies_connected"].type == "gauge"
    # pilotfish's and the standard process families only (none of the client library's python_* ones).
    assert all(name.startswith(("pilotfish_", "process_")) for name in families), sorted(families)


def families(metrics: Metrics) -> dict[str, Any]:
    """The scrape parsed by prometheus-client's own parser: family name -> family."""
    return {family.name: family for family in text_string_to_metric_families(metrics.render().decode())}


def test_build_info_names_pilotfishs_version_and_pythons() -> None:
    cache = SnapshotCache()
    found = families(Metrics(SyncStatus(), Reconciler(cache), cache=cache, open_streams=lambda: 0, process=False))
    [sample] = found["pilotfish_build_info"].samples
    assert sample.labels == {"version": build_version(), "python": platform.python_version()} and sample.value == 1
    assert build_version().split(".")[0].isdigit()


def test_the_process_metrics_are_the_standard_ones_read_from_this_process() -> None:
    cache = SnapshotCache()
    started = time.time()
    found = families(Metrics(SyncStatus(), Reconciler(cache), cache=cache, open_streams=lambda: 0))
    value = {name: family.samples[0].value for name, family in found.items() if name.startswith("process_")}
    assert sorted(value) == [
        "process_cpu_seconds",
        "process_max_fds",
        "process_open_fds",
        "process_resident_memory_bytes",
        "process_start_time_seconds",
        "process_virtual_memory_bytes",
    ]
    assert found["process_cpu_seconds"].type == "counter" and value["process_cpu_seconds"] > 0
    assert value["process_max_fds"] == resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    assert 3 <= value["process_open_fds"] <= len(os.listdir("/proc/self/fd")) + 5
    assert 10 << 20 < value["process_resident_memory_bytes"] < value["process_virtual_memory_bytes"]
    # The start time as /proc/stat's boot time gives it (what prometheus-client's collector reads).
    btime = next(
        int(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines() if line.startswith("btime")
    )
    ticks = int(Path("/proc/self/stat").read_bytes().rsplit(b")", 1)[1].split()[19])
    assert abs(value["process_start_time_seconds"] - (btime + ticks / os.sysconf("SC_CLK_TCK"))) < 2
    assert value["process_start_time_seconds"] <= started


def test_the_process_metrics_need_nothing_of_proc_but_this_process_s_own_files(tmp_path: Path) -> None:
    """The systemd unit's ProcSubset=pid hides /proc/stat (prometheus-client's collector reports
    nothing without it): the start time needs no boot time from /proc. A command name with a
    parenthesis and spaces does not shift the fields."""
    fake = tmp_path / "self"
    (fake / "fd").mkdir(parents=True)
    for n in range(7):
        (fake / "fd" / str(n)).touch()
    after_name = ["S", *["0"] * 18, "4200", "123456789", "2500"]  # fields 3..24: starttime, vsize, rss
    (fake / "stat").write_bytes(b"42 (py (odd) name) " + " ".join(after_name).encode() + b" 0 0\n")
    collected = {family.name: family.samples[0].value for family in ProcessMetrics(fake).collect()}
    assert collected["process_open_fds"] == 7
    assert collected["process_virtual_memory_bytes"] == 123456789
    assert collected["process_resident_memory_bytes"] == 2500 * resource.getpagesize()
    booted = time.time() - time.clock_gettime(time.CLOCK_BOOTTIME)
    assert abs(collected["process_start_time_seconds"] - (booted + 4200 / os.sysconf("SC_CLK_TCK"))) < 1

    # No /proc at all (not Linux, or hidden): CPU time and the file limit still.
    assert sorted(f.name for f in ProcessMetrics(tmp_path / "missing").collect()) == [
        "process_cpu_seconds",
        "process_max_fds",
    ]


def test_every_source_is_listed_the_registry_too_and_one_awaited_after_another_is_not_ready_before_it() -> None:
    reconciler = Reconciler(
        SnapshotCache(), expect=("file", "etcd"), subsets=SubsetOptions(ready_after={"etcd-subsets": "etcd"})
    )
    reconciler.readiness.reported("registry")  # (what serve does for the in-memory registry)
    reconciler.update("file", WEB)
    lines = scrape(SyncStatus(), reconciler)
    assert [line for line in lines if line.startswith("pilotfish_source_ready")] == [
        'pilotfish_source_ready{source="etcd"} 0.0',
        'pilotfish_source_ready{source="etcd-subsets"} 0.0',  # (waiting_for leaves it out until etcd is in)
        'pilotfish_source_ready{source="file"} 1.0',
        'pilotfish_source_ready{source="registry"} 1.0',
    ]
    assert 'pilotfish_source_failing{source="registry"} 0.0' in lines


def test_the_registry_families_show_its_figures_and_are_absent_without_a_registry() -> None:
    figures = RegistryFigures(
        services=2, instances=5, registrations=9, expired=3, refused={409: 1, 400: 2}, preserving=True
    )
    cache = SnapshotCache()
    reconciler = Reconciler(cache)
    status = SyncStatus()
    text = Metrics(status, reconciler, cache=cache, open_streams=lambda: 0, registry=lambda: figures, process=False)
    lines = [line for line in text.render().decode().splitlines() if line.startswith("pilotfish_registry")]
    assert lines == [
        "pilotfish_registry_services 2.0",
        "pilotfish_registry_instances 5.0",
        "pilotfish_registry_registrations_total 9.0",
        "pilotfish_registry_expired_instances_total 3.0",
        'pilotfish_registry_refused_requests_total{code="400"} 2.0',
        'pilotfish_registry_refused_requests_total{code="409"} 1.0',
        "pilotfish_registry_self_preservation 1.0",
    ]
    assert not [line for line in scrape(status, reconciler) if line.startswith("pilotfish_registry")]


def test_each_docker_engine_has_its_containers_endpoints_bad_labels_and_events() -> None:
    def running(container_id: str, labels: dict[str, str]) -> Container:
        return container_of_summary(
            {"Id": container_id, "Labels": labels, "State": "running", "HostConfig": {"NetworkMode": "host"}}
        )

    near = DockerSource(parse_engine("unix:///run/docker.sock"), on_state=lambda _: None)
    near.view.replace(
        [
            running("a" * 64, {"pilotfish.service": "web:8081,api:9091"}),
            running("b" * 64, {"pilotfish.service": "web:no"}),
            running("c" * 64, {"com.example": "not ours"}),
        ]
    )
    near.problem, near.events, near.listings = None, 7, 2
    far = DockerSource(parse_engine("tcp://10.0.0.5:2376"), on_state=lambda _: None)  # never reached
    cache = SnapshotCache()
    metrics = Metrics(
        SyncStatus(),
        Reconciler(cache),
        cache=cache,
        open_streams=lambda: 0,
        sources=[DockerMetrics([near.figures, far.figures])],
    )
    found = families(metrics)

    def values(name: str) -> dict[str, float]:
        return {sample.labels["engine"]: sample.value for sample in found[name].samples}

    near_url, far_url = "unix:///run/docker.sock", "tcp://10.0.0.5:2376"
    assert values("pilotfish_docker_connected") == {near_url: 1, far_url: 0}
    assert values("pilotfish_docker_containers") == {near_url: 3, far_url: 0}
    assert values("pilotfish_docker_endpoints") == {near_url: 2, far_url: 0}
    assert values("pilotfish_docker_bad_label_containers") == {near_url: 1, far_url: 0}
    assert values("pilotfish_docker_events") == {near_url: 7, far_url: 0}
    assert found["pilotfish_docker_listings"].type == "counter"
    plain = families(Metrics(SyncStatus(), Reconciler(cache), cache=cache, open_streams=lambda: 0))
    assert not [name for name in plain if name.startswith("pilotfish_docker")], "no --docker: no such families"


def _web(connect_timeout: float) -> Snapshot:
    state = DesiredState(
        services={"web": ServiceSpec(name="web", listen=("127.0.0.1", 10000), connect_timeout=connect_timeout)},
        endpoints=WEB.endpoints,
    )
    return build_snapshot(merge_states({"file": state}), "test")


def test_the_rollout_error_ratio_is_the_health_gates_latest_judgement_while_a_wave_bakes() -> None:
    wall = Wall()
    settings = RolloutSettings(waves=parse_waves("canary=c-*,100%"), bake=60.0, health=HealthSettings(min_requests=10))
    loads = LoadStore(LoadSettings(bucket=1.0, retention=300.0), clock=wall, classify=settings.waves.assign)
    status, cache = SyncStatus(wall_clock=wall), SnapshotCache()
    delivery = Delivery(cache, settings, status=status, events=EventLog(), loads=loads, clock=wall)
    metrics = Metrics(status, Reconciler(cache), cache=cache, open_streams=lambda: 2, process=False, rollout=delivery)

    def error_ratio() -> list[str]:
        return [line for line in metrics.render().decode().splitlines() if line.startswith("pilotfish_rollout_error")]

    def report(node: str, requests: int, errors: int) -> None:
        load = ClusterLoad("web", "", requests - errors, errors, requests, in_progress=0, dropped=0, interval=5.0)
        loads.ingest(node, LoadReport(node, (load,)))

    for node in ("c-1", "p-1"):
        status.stream_opened(node, NodeInfo(group="default"))
    delivery.publish({DEFAULT_GROUP: _web(1.0)})  # the baseline
    delivery.publish({DEFAULT_GROUP: _web(2.0)})  # a cluster change: the canary's wave is sent it
    assert error_ratio() == []  # nothing judged yet: no series at all (not a made-up 0)
    candidate = cache.snapshot(candidate_group(DEFAULT_GROUP))
    version = None if candidate is None else candidate.version(CDS)
    assert version is not None
    status.sent("c-1", CDS, version)
    status.acked("c-1", CDS, version)  # the ACK gate passes: the bake starts now
    wall.now += 10
    report("c-1", 100, 2)  # 2 %
    report("p-1", 400, 4)  # 1 %: within the default margin of one point, so the wave bakes on
    wall.now += 1
    delivery.tick()
    assert error_ratio() == [
        'pilotfish_rollout_error_ratio{side="wave"} 0.02',
        'pilotfish_rollout_error_ratio{side="baseline"} 0.01',
    ]
    delivery.promote()  # the wave passes, the last one: the rollout completes, nothing is being judged
    assert error_ratio() == []


def test_the_host_names_looked_up_are_counted_by_state() -> None:
    figures = NameFigures(resolving=3, kept=1, unresolved=2, left_out=0, lookups=40, failures=6)
    cache = SnapshotCache()
    found = families(
        Metrics(
            SyncStatus(), Reconciler(cache), cache=cache, open_streams=lambda: 0, sources=[NameMetrics(lambda: figures)]
        )
    )
    states = {sample.labels["state"]: sample.value for sample in found["pilotfish_dns_names"].samples}
    assert states == {"resolving": 3, "kept": 1, "unresolved": 2, "left_out": 0}
    assert found["pilotfish_dns_lookups"].samples[0].value == 40
    assert found["pilotfish_dns_lookup_failures"].samples[0].value == 6
