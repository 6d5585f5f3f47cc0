"""Prometheus metrics (``GET /metrics`` on the admin port), read when scraped.

Nothing here sits on the xDS hot path: the server and the reconciler keep plain counters (in
:class:`~pilotfish.status.SyncStatus` and on the :class:`~pilotfish.reconcile.Reconciler`), and a
collector turns them into metric families at scrape time. Names and labels follow Prometheus'
conventions (``pilotfish_`` prefix, base units, ``_total`` counters); there is no label per
proxy (a fleet of 10,000 would make 10,000 series): proxies are counted per node group, and
everything per type is labelled by the short type name (CDS, EDS, LDS, RDS, SDS).

Beside pilotfish's own families, the standard ``process_*`` ones of every Prometheus client library
(:class:`ProcessMetrics`: CPU, memory, open files against their limit, start time), read from
``/proc/self`` alone, and ``pilotfish_build_info``.
"""

from __future__ import annotations

import os
import platform
import resource
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
    SummaryMetricFamily,
)
from prometheus_client.registry import Collector

from pilotfish.cache import NodeGroup, SnapshotCache
from pilotfish.reconcile import NameFigures, PublishState
from pilotfish.resources import type_by_url
from pilotfish.rollout.delivery import WAVE_BUCKETS, Delivery
from pilotfish.sources.docker import DockerFigures
from pilotfish.sources.registry import RegistryFigures
from pilotfish.status import ACK_BUCKETS, SyncStatus
from pilotfish.xds.lrs import LoadReporting

__all__ = [
    "CONTENT_TYPE",
    "DockerMetrics",
    "Metrics",
    "NameMetrics",
    "ProcessMetrics",
    "RefreshMetrics",
    "build_version",
]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
"""The Prometheus text exposition format."""


def _short(type_url: str) -> str:
    rtype = type_by_url(type_url)
    return rtype.short if rtype is not None else type_url.rsplit(".", 1)[-1]


def _histogram(
    name: str, documentation: str, bounds: Sequence[float], counts: Sequence[int], total: float
) -> HistogramMetricFamily:
    """A histogram from per-bucket ``counts`` (one per bound, then +Inf): Prometheus's buckets are cumulative."""
    buckets, running = [], 0
    for bound, count in zip((*map(str, bounds), "+Inf"), counts, strict=True):
        running += count
        buckets.append((bound, running))
    return HistogramMetricFamily(name, documentation, buckets=buckets, sum_value=total)


def build_version() -> str:
    """pilotfish's version, as installed (its package metadata), as ``pilotfish --version`` says it."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("pilotfish")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown (not installed)"


class ProcessMetrics(Collector):
    """The ``process_*`` families every Prometheus client library exports, under their standard
    names, read at scrape time from ``proc`` (this process's ``/proc/self``) and ``getrusage`` /
    ``getrlimit``.

    Not prometheus_client's own ``ProcessCollector``: that one needs ``/proc/stat`` (the boot
    time) and reports nothing at all without it, and the systemd unit's ``ProcSubset=pid`` hides
    it. The boot time is the wall clock less ``CLOCK_BOOTTIME`` instead, the clock the kernel
    counts a process's start in. Without a ``/proc`` (not Linux) only CPU time and the file limit
    are reported. A scrape lists ``proc/fd``: at 10,000 proxies, 10,000 entries (milliseconds).
    """

    def __init__(self, proc: Path = Path("/proc/self")) -> None:
        self._proc = proc
        self._ticks = os.sysconf("SC_CLK_TCK")
        self._page = resource.getpagesize()

    def collect(self) -> Iterator[Metric]:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        yield CounterMetricFamily(
            "process_cpu_seconds",
            "Total user and system CPU time spent in seconds.",
            value=usage.ru_utime + usage.ru_stime,
        )
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        yield GaugeMetricFamily(
            "process_max_fds",
            "Maximum number of open file descriptors (the soft limit, which serve raises to the hard one).",
            value=float("inf") if soft == resource.RLIM_INFINITY else soft,
        )
        try:
            open_fds = len(os.listdir(self._proc / "fd"))
            # Fields after the command name, which is in parentheses and may hold anything.
            fields = (self._proc / "stat").read_bytes().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            return
        yield GaugeMetricFamily("process_open_fds", "Number of open file descriptors.", value=open_fds)
        # proc(5): fields 22 (starttime, clock ticks after boot), 23 (vsize, bytes), 24 (rss, pages);
        # ``fields`` starts at field 3.
        yield GaugeMetricFamily("process_virtual_memory_bytes", "Virtual memory size in bytes.", value=int(fields[20]))
        yield GaugeMetricFamily(
            "process_resident_memory_bytes", "Resident memory size in bytes.", value=int(fields[21]) * self._page
        )
        booted = time.time() - time.clock_gettime(time.CLOCK_BOOTTIME)
        yield GaugeMetricFamily(
            "process_start_time_seconds",
            "Start time of the process since unix epoch in seconds.",
            value=booted + int(fields[19]) / self._ticks,
        )


class _Collector(Collector):
    def __init__(
        self,
        status: SyncStatus,
        reconciler: PublishState,
        cache: SnapshotCache,
        open_streams: Callable[[], int],
        subset_of: Callable[[str], int | None],
        lrs: LoadReporting | None,
        rollout: Delivery | None,
        registry: Callable[[], RegistryFigures] | None,
    ) -> None:
        self._registry = registry
        self._lrs = lrs
        self._rollout = rollout
        self._subset_of = subset_of
        self._status = status
        self._reconciler = reconciler
        self._cache = cache
        self._open_streams = open_streams
        self._sources = reconciler.readiness.sources
        self._build = [build_version(), platform.python_version()]

    def collect(self) -> Iterator[Metric]:
        status, stats = self._status, self._reconciler.stats
        readiness = self._reconciler.readiness
        build = GaugeMetricFamily(
            "pilotfish_build_info", "1, labelled with pilotfish's version and Python's", labels=["version", "python"]
        )
        build.add_metric(self._build, 1)
        yield build
        proxies = GaugeMetricFamily(
            "pilotfish_proxies_connected",
            "Proxies with an open stream (or a REST poll being answered), per node group",
            labels=["group"],
        )
        by_state = GaugeMetricFamily(
            "pilotfish_proxies_by_state",
            "Connected proxies per node group and sync state: each at its worst over its types "
            "(NACKED, STALE: sent and not yet ACKed, NOT_SENT, SYNCED), as the status page counts them",
            labels=["group", "state"],
        )
        for group, states in sorted(status.connected_states().items()):
            proxies.add_metric([group], sum(states.values()))
            for state, count in states.items():
                by_state.add_metric([group, state.value], count)
        yield proxies
        yield by_state
        yield GaugeMetricFamily(
            "pilotfish_xds_streams", "Open gRPC xDS streams (SotW and delta)", value=self._open_streams()
        )
        responses = CounterMetricFamily("pilotfish_xds_responses", "xDS responses sent, per type", labels=["type"])
        acks = CounterMetricFamily("pilotfish_xds_acks", "ACKs received, per type", labels=["type"])
        nacks = CounterMetricFamily(
            "pilotfish_xds_nacks", "NACKs received (a proxy rejected a response), per type", labels=["type"]
        )
        for type_url, counts in sorted(status.counters.items()):
            short = _short(type_url)
            responses.add_metric([short], counts.responses)
            acks.add_metric([short], counts.acks)
            nacks.add_metric([short], counts.nacks)
        yield responses
        yield acks
        yield nacks
        if self._lrs is not None:
            lrs = self._lrs
            yield GaugeMetricFamily(
                "pilotfish_lrs_streams", "Open load reporting (LRS) streams", value=lrs.open_streams
            )
            yield CounterMetricFamily("pilotfish_lrs_reports", "Load reports taken", value=lrs.reports)
            yield CounterMetricFamily(
                "pilotfish_lrs_reports_dropped",
                "Load reports dropped unparsed: they came sooner than a quarter of the interval after the last one",
                value=lrs.dropped,
            )
        if self._rollout is not None:
            yield from self._rollouts(self._rollout)
        if self._registry is not None:
            yield from self._registry_families(self._registry())
        histogram = status.ack_latency
        yield _histogram(
            "pilotfish_publish_to_ack_seconds",
            "Seconds from a version's publish to each proxy's first ACK of it",
            ACK_BUCKETS,
            histogram.counts,
            histogram.total,
        )
        yield SummaryMetricFamily(
            "pilotfish_snapshot_build_seconds",
            "Time spent building and checking snapshots (validation included)",
            count_value=stats.builds,
            sum_value=stats.build_seconds,
        )
        yield CounterMetricFamily(
            "pilotfish_source_changes", "Source updates that changed what a source says", value=stats.changes
        )
        yield CounterMetricFamily(
            "pilotfish_debounce_coalesced_changes",
            "Source changes that did not make a build of their own (the debounce merged them into another)",
            value=max(0, stats.changes - stats.builds),
        )
        yield CounterMetricFamily(
            "pilotfish_snapshots_published", "Snapshots handed to the proxies", value=stats.published
        )
        yield CounterMetricFamily(
            "pilotfish_snapshots_refused",
            "Builds refused as invalid (the last good snapshot kept serving)",
            value=stats.refused,
        )
        yield CounterMetricFamily(
            "pilotfish_snapshots_held", "Snapshots the blast-radius guard held back", value=self._reconciler.held_count
        )
        yield GaugeMetricFamily(
            "pilotfish_snapshot_held",
            "1 while a snapshot is held back for confirmation",
            value=1 if self._reconciler.held is not None else 0,
        )
        ready = GaugeMetricFamily(
            "pilotfish_source_ready", "1 once a source has reported its first complete state", labels=["source"]
        )
        for source in self._sources():
            ready.add_metric([source], 1 if readiness.has_reported(source) else 0)
        yield ready
        failing = GaugeMetricFamily(
            "pilotfish_source_failing",
            "1 while a source's latest input is refused (its last good state keeps serving)",
            labels=["source"],
        )
        errors = CounterMetricFamily(
            "pilotfish_source_errors",
            "Inputs of a source refused where they were read (an unreadable or invalid file)",
            labels=["source"],
        )
        for source in self._sources():
            failing.add_metric([source], 1 if source in readiness.failing_sources else 0)
            errors.add_metric([source], readiness.source_errors.get(source, 0))
        yield failing
        yield errors
        yield GaugeMetricFamily(
            "pilotfish_snapshot_refused",
            "1 while the latest build is refused (the merged sources are invalid)",
            value=1 if stats.last_error is not None else 0,
        )
        yield self._subset_spread()

    @staticmethod
    def _registry_families(figures: RegistryFigures) -> Iterator[Metric]:
        """The registry API (``serve --registry``): its size, what it took, expired and refused."""
        yield GaugeMetricFamily(
            "pilotfish_registry_services",
            "Services the registry holds (defined or with instances)",
            value=figures.services,
        )
        yield GaugeMetricFamily(
            "pilotfish_registry_instances", "Instances registered, over all services", value=figures.instances
        )
        yield CounterMetricFamily(
            "pilotfish_registry_registrations",
            "Registrations accepted by this process (a re-registration counts again)",
            value=figures.registrations,
        )
        yield CounterMetricFamily(
            "pilotfish_registry_expired_instances",
            "Instances removed as their TTL lapsed without a heartbeat (on etcd: by the elected replica)",
            value=figures.expired,
        )
        refused = CounterMetricFamily(
            "pilotfish_registry_refused_requests",
            "Registry API requests answered with an error, per HTTP status (401/403: tokens; 409: a conflict)",
            labels=["code"],
        )
        for code, count in sorted(figures.refused.items()):
            refused.add_metric([str(code)], count)
        yield refused
        yield GaugeMetricFamily(
            "pilotfish_registry_self_preservation",
            "1 while self-preservation keeps lapsed instances instead of expiring them",
            value=1 if figures.preserving else 0,
        )

    def _rollouts(self, rollout: Delivery) -> Iterator[Metric]:
        """Progressive delivery: rollouts by outcome, where the current one is, its waves' durations
        and the health gate's latest judgement."""
        stats, machine = rollout.stats, rollout.machine
        ended = CounterMetricFamily("pilotfish_rollouts", "Rollouts that ended, by outcome", labels=["outcome"])
        for outcome, count in sorted(stats.outcomes.items()):
            ended.add_metric([outcome], count)
        yield ended
        yield CounterMetricFamily(
            "pilotfish_rollout_held_offers",
            "Times a held candidate was offered again and not served",
            value=stats.held_offers,
        )
        yield GaugeMetricFamily(
            "pilotfish_rollout_running", "1 while a candidate rolls out", value=1 if machine.running else 0
        )
        yield GaugeMetricFamily(
            "pilotfish_rollout_wave",
            "The wave the candidate is in (0: the first), -1 with no rollout",
            value=machine.wave if machine.running else -1,
        )
        yield GaugeMetricFamily(
            "pilotfish_rollout_held", "Candidates held (remembered, never served again)", value=len(machine.held)
        )
        yield _histogram(
            "pilotfish_rollout_wave_seconds",
            "Seconds from a wave's start to its pass (its ACKs and its bake)",
            WAVE_BUCKETS,
            stats.wave_counts,
            stats.wave_seconds,
        )
        health = machine.last_health
        if health is not None:
            ratio = GaugeMetricFamily(
                "pilotfish_rollout_error_ratio",
                "The health gate's latest error ratios over the bake so far: the wave's and its reference's",
                labels=["side"],
            )
            ratio.add_metric(["wave"], health.wave.ratio)
            ratio.add_metric(["baseline"], health.reference.ratio)
            yield ratio

    def _subset_spread(self) -> Metric:
        """Per subsetted service and node group: the busiest backend's connected proxies over the mean."""
        spread = GaugeMetricFamily(
            "pilotfish_subset_load_spread",
            "Subsetting balance: connected proxies of the busiest backend over the mean (1 = even)",
            labels=["group", "service"],
        )
        by_group: dict[str, list[int]] = {}
        for proxy in self._status.proxies():
            index = self._subset_of(proxy.node_id) if proxy.streams else None
            if index is not None:
                by_group.setdefault(proxy.info.group, []).append(index)
        for group, indices in sorted(by_group.items()):
            snapshot = self._cache.snapshot(NodeGroup(group))
            if snapshot is not None and snapshot.subsets is not None:
                for service, value in sorted(snapshot.subsets.spread(indices).items()):
                    spread.add_metric([group, service], value)
        return spread


class RefreshMetrics(Collector):
    """The refreshes that renew the TTLs streams hold (:mod:`pilotfish.xds.heartbeats`)."""

    def __init__(self, refreshes: Callable[[], int]) -> None:
        self._refreshes = refreshes

    def collect(self) -> Iterator[Metric]:
        yield CounterMetricFamily(
            "pilotfish_xds_ttl_refreshes",
            "Refreshes sent to renew the TTLs streams hold (delta heartbeats, SotW resources sent again)",
            value=self._refreshes(),
        )


class DockerMetrics(Collector):
    """Each Docker engine followed (``serve --docker``), labelled by its URL."""

    def __init__(self, engines: Sequence[Callable[[], DockerFigures]]) -> None:
        self._engines = engines

    def collect(self) -> Iterator[Metric]:
        figures = [engine() for engine in self._engines]
        families = (
            (
                GaugeMetricFamily,
                "pilotfish_docker_connected",
                "1 while the engine's event stream is followed",
                "connected",
            ),
            (GaugeMetricFamily, "pilotfish_docker_containers", "Running containers followed", "containers"),
            (GaugeMetricFamily, "pilotfish_docker_endpoints", "Endpoints its serving containers give", "endpoints"),
            (
                GaugeMetricFamily,
                "pilotfish_docker_bad_label_containers",
                "Containers whose labels cannot be used",
                "bad",
            ),
            (CounterMetricFamily, "pilotfish_docker_events", "Container events read from the engine", "events"),
            (CounterMetricFamily, "pilotfish_docker_listings", "Times the engine's containers were listed", "listings"),
        )
        for kind, name, documentation, field in families:
            family = kind(name, documentation, labels=["engine"])
            for engine in figures:
                family.add_metric([engine.engine], float(getattr(engine, field)))
            yield family


class NameMetrics(Collector):
    """The host names of DNS services pilotfish looks up (``serve --dns-refresh``)."""

    def __init__(self, figures: Callable[[], NameFigures]) -> None:
        self._figures = figures

    def collect(self) -> Iterator[Metric]:
        figures = self._figures()
        names = GaugeMetricFamily(
            "pilotfish_dns_names",
            "Host names of DNS services looked up: resolving; kept (served by their last good addresses); "
            "unresolved (never resolved, served as names); left_out (beyond the names looked up)",
            labels=["state"],
        )
        for state in ("resolving", "kept", "unresolved", "left_out"):
            names.add_metric([state], float(getattr(figures, state)))
        yield names
        yield CounterMetricFamily("pilotfish_dns_lookups", "Lookups of those names", value=figures.lookups)
        yield CounterMetricFamily(
            "pilotfish_dns_lookup_failures",
            "Lookups that found no address, failed or timed out",
            value=figures.failures,
        )


class Metrics:
    """The registry ``/metrics`` renders: pilotfish's collector, and the process metrics
    (``process=False``: none, for tests that compare whole scrapes)."""

    def __init__(
        self,
        status: SyncStatus,
        reconciler: PublishState,
        *,
        cache: SnapshotCache,
        open_streams: Callable[[], int],
        subset_of: Callable[[str], int | None] | None = None,
        lrs: LoadReporting | None = None,
        rollout: Delivery | None = None,
        registry: Callable[[], RegistryFigures] | None = None,
        sources: Sequence[Collector] = (),
        process: bool = True,
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(
            _Collector(status, reconciler, cache, open_streams, subset_of or (lambda _: None), lrs, rollout, registry)
        )
        for collector in sources:  # (Docker engines, DNS names)
            self.registry.register(collector)
        if process:
            self.registry.register(ProcessMetrics())

    def render(self) -> bytes:
        return generate_latest(self.registry)
