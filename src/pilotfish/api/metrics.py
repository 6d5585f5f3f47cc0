"""Prometheus metrics (``GET /metrics`` on the admin port), read when scraped.

Nothing here sits on the xDS hot path: the server and the reconciler keep plain counters (in
:class:`~pilotfish.status.SyncStatus` and on the :class:`~pilotfish.reconcile.Reconciler`), and a
collector turns them into metric families at scrape time. Names and labels follow Prometheus'
conventions (``pilotfish_`` prefix, base units, ``_total`` counters); there is no label per
proxy (a fleet of 10,000 would make 10,000 series): proxies are counted per node group, and
everything per type is labelled by the short type name (CDS, EDS, LDS, RDS, SDS).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

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
from pilotfish.reconcile import PublishState
from pilotfish.resources import type_by_url
from pilotfish.rollout.delivery import WAVE_BUCKETS, Delivery
from pilotfish.status import ACK_BUCKETS, SyncStatus
from pilotfish.xds.lrs import LoadReporting

__all__ = ["CONTENT_TYPE", "Metrics"]

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
    ) -> None:
        self._lrs = lrs
        self._rollout = rollout
        self._subset_of = subset_of
        self._status = status
        self._reconciler = reconciler
        self._cache = cache
        self._open_streams = open_streams
        self._sources = reconciler.readiness.expected_sources

    def collect(self) -> Iterator[Metric]:
        status, stats = self._status, self._reconciler.stats
        readiness = self._reconciler.readiness
        proxies = GaugeMetricFamily(
            "pilotfish_proxies_connected",
            "Proxies with an open stream (or a REST poll being answered), per node group",
            labels=["group"],
        )
        for group, count in sorted(status.connected().items()):
            proxies.add_metric([group], count)
        yield proxies
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
        waiting = set(readiness.waiting_for())
        ready = GaugeMetricFamily(
            "pilotfish_source_ready", "1 once a source has reported its first complete state", labels=["source"]
        )
        for source in self._sources():
            ready.add_metric([source], 0 if source in waiting else 1)
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


class Metrics:
    """The registry ``/metrics`` renders: pilotfish's collector only (no process metrics of the
    client library's own, which would read /proc at every scrape)."""

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
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(
            _Collector(status, reconciler, cache, open_streams, subset_of or (lambda _: None), lrs, rollout)
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
