"""Load reports (LRS) in, request counts per window out: what the health gate reads.

Envoy's Load Reporting Service stream sends a ``LoadStatsRequest`` every reporting interval: per
cluster, per upstream locality, the requests completed successfully, failed, issued, and in
progress, *since the previous report* (``load_report_interval`` says over how long).
:func:`decode_load_report` turns one message into plain values (:class:`LoadReport`), so the gRPC
service that will receive them is a thin shell; :class:`LoadStore` keeps them per proxy and per
cluster, in time buckets, and answers "how many requests, and how many failed, did these proxies
send to each cluster between ``start`` and ``end``".

What the counts mean (``envoy.config.endpoint.v3.UpstreamLocalityStats`` and
``UpstreamEndpointStats``): ``total_error_requests`` are requests that failed *at the endpoint*: for
HTTP, responses with a 5xx status; for gRPC, the statuses DeadlineExceeded, Unimplemented,
Internal, Unavailable, Unknown and DataLoss; everything else that completed is
``total_successful_requests`` (a 4xx is a success here). Requests Envoy answers itself never reach
an upstream and are not counted at all (a route that no longer matches and yields a local 404, a
``direct_response``); nor are requests the load balancer dropped (``total_dropped_requests``:
``drop_overload`` and circuit breaking), which are kept apart. The gate's error ratio is
``errors / (successful + errors)``: completed requests only; ``total_issued_requests`` and
``total_requests_in_progress`` are kept for display. Localities are summed into their cluster.

Windows. A report received at ``t`` covers ``[t - interval, t]``; it is filed in the bucket of its
*start*, ``floor((t - interval) / bucket)``, and a window ``[start, end)`` counts the buckets that
begin at or after ``start``. So a window never counts load from before it began (from before the
candidate was served), at the price of leaving out up to one bucket at its start.

Bounds (a proxy chooses what it reports): at most ``max_proxies`` proxies, with node ids of at most
``max_node_id`` characters; per proxy at most
``max_clusters`` clusters and in all at most ``max_series`` (proxy, cluster) series; a cluster
beyond those, or with an empty name or one longer than ``max_name``, is folded into the proxy's
:data:`OTHER` series, so its requests still count in the proxy's overall ratio (flooding the
store with names cannot hide errors) but it is not judged on its own. Each series is a ring of
``retention / bucket`` buckets of four counters (``array``, 8 bytes each): about
``(max_series + max_proxies) * (retention / bucket + 1) * 40`` bytes at most: 44 MB with the defaults
(54 MB measured with Python's overheads, for 10,000 proxies reporting 100 clusters each).
A count above :data:`MAX_COUNT` in one report is taken as :data:`MAX_COUNT`. When ``max_proxies``
are known, a proxy that has reported nothing for ``retention`` makes room; otherwise a new proxy's
reports are refused (and counted) until one does.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from envoy.service.load_stats.v3 import lrs_pb2

from pilotfish.rollout.gates import Counts

__all__ = [
    "MAX_COUNT",
    "OTHER",
    "ClusterLoad",
    "Ingested",
    "LoadReport",
    "LoadSettings",
    "LoadStore",
    "decode_load_report",
]

OTHER = "(other clusters)"
"""The series that clusters beyond a proxy's bounds are counted in."""
MAX_COUNT = 2**40
"""The largest count one report may add to one counter (a trillion requests in one interval)."""
_FIELDS = 4  # successful, errors, issued, dropped
_SATURATED = 2**63  # a bucket's counter stops there (an unsigned 64-bit array holds it)


@dataclass(frozen=True, slots=True)
class ClusterLoad:
    """One cluster's load in one report, its localities summed."""

    cluster: str
    """``cluster_name``."""
    service: str
    """``cluster_service_name`` (the EDS service name; "" when the cluster has none)."""
    successful: int
    errors: int
    issued: int
    in_progress: int
    """A gauge: requests unfinished when the report was made."""
    dropped: int
    """``total_dropped_requests``: dropped by ``drop_overload`` or circuit breaking."""
    interval: float
    """Seconds the report covers (``load_report_interval``; 0 when absent)."""


@dataclass(frozen=True, slots=True)
class LoadReport:
    """One decoded ``LoadStatsRequest``."""

    node_id: str | None
    """The node's id when the message carries a node (the stream's first does), else None."""
    clusters: tuple[ClusterLoad, ...]


def _count(value: int) -> int:
    return min(int(value), MAX_COUNT)


def decode_load_report(message: lrs_pb2.LoadStatsRequest) -> LoadReport:
    """A ``LoadStatsRequest`` -> plain values (localities summed per cluster, counts bounded)."""
    clusters = []
    for stats in message.cluster_stats:
        successful = errors = issued = in_progress = 0
        for locality in stats.upstream_locality_stats:
            successful += locality.total_successful_requests
            errors += locality.total_error_requests
            issued += locality.total_issued_requests
            in_progress += locality.total_requests_in_progress
        interval = 0.0
        if stats.HasField("load_report_interval"):
            duration = stats.load_report_interval
            interval = max(0.0, duration.seconds + duration.nanos / 1e9)
        clusters.append(
            ClusterLoad(
                cluster=stats.cluster_name,
                service=stats.cluster_service_name,
                successful=_count(successful),
                errors=_count(errors),
                issued=_count(issued),
                in_progress=_count(in_progress),
                dropped=_count(stats.total_dropped_requests),
                interval=interval,
            )
        )
    node_id = message.node.id if message.HasField("node") else None
    return LoadReport(node_id=node_id, clusters=tuple(clusters))


@dataclass(frozen=True, slots=True, kw_only=True)
class LoadSettings:
    """Bounds and granularity of a :class:`LoadStore`."""

    bucket: float = 5.0
    """Seconds per time bucket: a window's start is rounded up to a bucket's."""
    retention: float = 180.0
    """Seconds of history kept; must cover the longest window asked for (an ACK timeout and a bake
    time; the reference window before a wave is a bake time)."""
    max_proxies: int = 10_000
    """Proxies whose load is kept."""
    max_clusters: int = 100
    """Clusters kept apart per proxy; more are folded into :data:`OTHER`."""
    max_series: int = 20_000
    """(proxy, cluster) series in all; beyond, new clusters are folded into :data:`OTHER`."""
    max_name: int = 256
    """Longest cluster name kept apart (characters)."""
    max_node_id: int = 1024
    """Longest node id whose reports are taken (characters); a longer one's are refused."""

    def __post_init__(self) -> None:
        if not (self.bucket > 0 and self.retention >= self.bucket and math.isfinite(self.retention)):
            raise ValueError(
                f"load store: bucket {self.bucket} s and retention {self.retention} s: both positive, "
                "retention at least one bucket"
            )
        if min(self.max_proxies, self.max_clusters, self.max_series, self.max_name, self.max_node_id) < 1:
            raise ValueError("load store: every bound must be at least 1")

    @property
    def slots(self) -> int:
        """Buckets per series."""
        return math.ceil(self.retention / self.bucket) + 1


class _Series:
    """One (proxy, cluster): a ring of buckets, each four counters, and which bucket each slot holds."""

    __slots__ = ("counts", "in_progress", "stamps")

    def __init__(self, slots: int) -> None:
        self.stamps = array("q", [-1]) * slots
        self.counts = array("Q", [0]) * (slots * _FIELDS)
        self.in_progress = 0

    def add(self, bucket: int, successful: int, errors: int, issued: int, dropped: int) -> None:
        slot = bucket % len(self.stamps)
        base = slot * _FIELDS
        counts = self.counts
        if self.stamps[slot] != bucket:
            if self.stamps[slot] > bucket:  # older than the ring remembers: gone already
                return
            self.stamps[slot] = bucket
            counts[base] = counts[base + 1] = counts[base + 2] = counts[base + 3] = 0
        counts[base] = min(counts[base] + successful, _SATURATED)
        counts[base + 1] = min(counts[base + 1] + errors, _SATURATED)
        counts[base + 2] = min(counts[base + 2] + issued, _SATURATED)
        counts[base + 3] = min(counts[base + 3] + dropped, _SATURATED)

    def total(self, first: int, last: int) -> tuple[int, int, int, int]:
        """The sums over buckets ``first`` to ``last`` inclusive (only the slots they map to are read)."""
        slots = len(self.stamps)
        successful = errors = issued = dropped = 0
        for bucket in range(max(first, last - slots + 1), last + 1):
            slot = bucket % slots
            if self.stamps[slot] == bucket:
                base = slot * _FIELDS
                successful += self.counts[base]
                errors += self.counts[base + 1]
                issued += self.counts[base + 2]
                dropped += self.counts[base + 3]
        return successful, errors, issued, dropped


@dataclass(slots=True)
class _Proxy:
    series: dict[str, _Series] = field(default_factory=dict)
    last_report: float = 0.0


@dataclass(frozen=True, slots=True)
class Ingested:
    """What one report did."""

    kept: int
    """Clusters counted in a series of their own."""
    folded: int
    """Clusters counted in :data:`OTHER` (beyond a bound, or a name not kept apart)."""
    refused: bool
    """The proxy was not taken: ``max_proxies`` are known and none is stale, or its node id is longer
    than ``max_node_id``."""


class LoadStore:
    """Request counts per proxy, per cluster, per time bucket, within fixed bounds.

    ``clock``: seconds, the same clock as the windows asked for (the rollout machine's)."""

    def __init__(self, settings: LoadSettings | None = None, *, clock: Callable[[], float]) -> None:
        self.settings = settings or LoadSettings()
        self._clock = clock
        self._proxies: dict[str, _Proxy] = {}
        self._series = 0
        self.refused = 0
        """Reports refused (``max_proxies`` were known, or the node id was too long)."""
        self.folded = 0
        """Cluster entries folded into :data:`OTHER`."""

    @property
    def retention(self) -> float:
        return self.settings.retention

    @property
    def proxies(self) -> int:
        return len(self._proxies)

    @property
    def series(self) -> int:
        return self._series

    def report(self, node_id: str, request: lrs_pb2.LoadStatsRequest) -> None:
        """One report as it arrived on ``node_id``'s load reporting stream (the LRS service's sink)."""
        self.ingest(node_id, decode_load_report(request))

    def ingest(self, node_id: str, report: LoadReport) -> Ingested:
        """Count one report of ``node_id`` (the stream's node, whatever ``report.node_id`` says)."""
        now = self._clock()
        proxy = self._proxies.get(node_id)
        if proxy is None:
            if len(node_id) > self.settings.max_node_id or (
                len(self._proxies) >= self.settings.max_proxies and not self._evict(now)
            ):
                self.refused += 1
                return Ingested(kept=0, folded=0, refused=True)
            proxy = self._proxies[node_id] = _Proxy()
        proxy.last_report = now
        kept = folded = 0
        for load in report.clusters:
            series = self._series_for(proxy, load.cluster)
            if series is None:
                series = self._other(proxy)
                folded += 1
            else:
                kept += 1
            start = now - min(load.interval, self.settings.retention)
            series.add(
                math.floor(start / self.settings.bucket), load.successful, load.errors, load.issued, load.dropped
            )
            series.in_progress = load.in_progress
        self.folded += folded
        return Ingested(kept=kept, folded=folded, refused=False)

    def _series_for(self, proxy: _Proxy, cluster: str) -> _Series | None:
        series = proxy.series.get(cluster)
        if series is not None or cluster == OTHER:
            return series
        if (
            not cluster
            or len(cluster) > self.settings.max_name
            or len(proxy.series) - (OTHER in proxy.series) >= self.settings.max_clusters
            or self._series >= self.settings.max_series
        ):
            return None
        series = proxy.series[cluster] = _Series(self.settings.slots)
        self._series += 1
        return series

    def _other(self, proxy: _Proxy) -> _Series:
        series = proxy.series.get(OTHER)
        if series is None:  # one per proxy, bounded by max_proxies, outside max_series
            series = proxy.series[OTHER] = _Series(self.settings.slots)
        return series

    def _evict(self, now: float) -> bool:
        stale = [n for n, p in self._proxies.items() if p.last_report < now - self.settings.retention]
        for node_id in stale:
            self.forget(node_id)
        return bool(stale)

    def forget(self, node_id: str) -> None:
        """Drop everything ``node_id`` reported."""
        proxy = self._proxies.pop(node_id, None)
        if proxy is not None:
            self._series -= len(proxy.series) - (OTHER in proxy.series)

    def window(self, nodes: Iterable[str], start: float, end: float | None = None) -> dict[str, Counts]:
        """Per cluster, the requests of ``nodes`` in the buckets that begin in ``[start, end)``
        (``end``: now), summed over the nodes. A proxy that reported nothing is absent."""
        width = self.settings.bucket
        first = math.ceil(start / width)
        last = math.ceil((self._clock() if end is None else end) / width) - 1
        oldest = math.floor(self._clock() / width) - self.settings.slots + 1
        first = max(first, oldest)
        sums: dict[str, list[int]] = {}
        for node_id in nodes:
            proxy = self._proxies.get(node_id)
            if proxy is None:
                continue
            for cluster, series in proxy.series.items():
                counts = series.total(first, last)
                if any(counts):
                    into = sums.get(cluster)
                    if into is None:
                        sums[cluster] = list(counts)
                    else:
                        for i, value in enumerate(counts):
                            into[i] += value
        return {cluster: Counts(*values) for cluster, values in sums.items()}

    def in_progress(self, node_id: str) -> Mapping[str, int]:
        """The latest requests-in-progress gauge per cluster of ``node_id``."""
        proxy = self._proxies.get(node_id)
        return {} if proxy is None else {c: s.in_progress for c, s in proxy.series.items()}
