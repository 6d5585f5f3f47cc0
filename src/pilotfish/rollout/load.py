"""Load reports (LRS) in, request counts per window out: what the health gate reads.

Envoy's Load Reporting Service stream sends a ``LoadStatsRequest`` every reporting interval: per
cluster, per upstream locality, the requests completed successfully, failed, issued, and in
progress, *since the previous report* (``load_report_interval`` says over how long).
:func:`decode_load_report` turns one message into plain values (:class:`LoadReport`), so the gRPC
service that will receive them is a thin shell; :class:`LoadStore` keeps them per wave of the
rollout (the proxy's, fixed by its node id) and per cluster, in time buckets, and answers "how many
requests, and how many failed, did the proxies of these waves send to each cluster between
``start`` and ``end``". A proxy that is not connected over xDS still counts in its wave: it runs
what it was last sent, which its wave decides.

Replicas. A proxy's load reporting stream may go to another replica than its ADS stream; each
replica counts the reports it receives, and every one that does not decide the rollout exports its
recent buckets (:meth:`LoadStore.export`, in its report on etcd) to the one that does, which adds
them in (:meth:`LoadStore.merge`). Buckets are numbered from wall-clock time, so replicas agree on
them as far as their clocks do.

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

The control plane's own cluster is not the application's. Envoy reports every cluster it has
(``send_all_clusters``), the bootstrap's ``xds_cluster`` too, and counts a gRPC stream cut under
it as a failed request: a replica that dies or restarts under a wave would make the wave look
broken. Its load is left out (:attr:`LoadSettings.ignored`).

Windows. A report received at ``t`` covers ``[t - interval, t]``; it is filed in the bucket of its
*start*, ``floor((t - interval) / bucket)``, and a window ``[start, end)`` counts the buckets that
begin at or after ``start``. So a window never counts load from before it began (from before the
candidate was served), at the price of leaving out up to one bucket at its start.

Bounds (a proxy chooses what it reports): at most ``max_proxies`` proxies, with node ids of at most
``max_node_id`` characters (a proxy costs its id and two numbers); per wave at most
``max_clusters`` clusters and in all at most ``max_series`` (wave, cluster) series; a cluster
beyond those, or with an empty name or one longer than ``max_name``, is folded into its wave's
:data:`OTHER` series, so its requests still count in the wave's overall ratio (flooding the
store with names cannot hide errors) but it is not judged on its own. Each series is a ring of
``retention / bucket`` buckets of four counters (``array``, 8 bytes each): about
``(max_series + waves) * (retention / bucket + 1) * 40`` bytes at most per replica counted
(``max_replicas`` others): 6 MB each with the defaults.
A count above :data:`MAX_COUNT` in one report is taken as :data:`MAX_COUNT`. When ``max_proxies``
are known, a proxy that has reported nothing for ``retention`` makes room; otherwise a new proxy's
reports are refused (and counted) until one does.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from envoy.service.load_stats.v3 import lrs_pb2

from pilotfish.resources.bootstrap import XDS_CLUSTER
from pilotfish.rollout.gates import Counts

__all__ = [
    "MAX_COUNT",
    "MAX_EXPORTED",
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
MAX_EXPORTED = 500
"""Series kept apart in an :meth:`LoadStore.export` (a bucket's row is about 60 bytes)."""
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
    max_clusters: int = 1_000
    """Clusters kept apart per wave; more are folded into :data:`OTHER`."""
    max_series: int = 4_000
    """(wave, cluster) series in all, per replica; beyond, new clusters are folded into :data:`OTHER`."""
    max_replicas: int = 32
    """Other replicas whose exports are kept (:meth:`LoadStore.merge`)."""
    max_name: int = 256
    """Longest cluster name kept apart (characters)."""
    max_node_id: int = 1024
    """Longest node id whose reports are taken (characters); a longer one's are refused."""
    ignored: frozenset[str] = frozenset({XDS_CLUSTER})
    """Clusters whose load is not counted: the one ``pilotfish bootstrap`` names for the xDS and
    load reporting streams to pilotfish itself."""

    def __post_init__(self) -> None:
        if not (self.bucket > 0 and self.retention >= self.bucket and math.isfinite(self.retention)):
            raise ValueError(
                f"load store: bucket {self.bucket} s and retention {self.retention} s: both positive, "
                "retention at least one bucket"
            )
        if (
            min(
                self.max_proxies, self.max_clusters, self.max_series, self.max_name, self.max_node_id, self.max_replicas
            )
            < 1
        ):
            raise ValueError("load store: every bound must be at least 1")

    @property
    def slots(self) -> int:
        """Buckets per series."""
        return math.ceil(self.retention / self.bucket) + 1


class _Series:
    """One (proxy, cluster): a ring of buckets, each four counters, and which bucket each slot holds."""

    __slots__ = ("counts", "stamps")

    def __init__(self, slots: int) -> None:
        self.stamps = array("q", [-1]) * slots
        self.counts = array("Q", [0]) * (slots * _FIELDS)

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

    def put(self, bucket: int, successful: int, errors: int, issued: int, dropped: int) -> None:
        """Set ``bucket``'s counts (another replica's, as it exported them)."""
        slot = bucket % len(self.stamps)
        if self.stamps[slot] > bucket:
            return
        self.stamps[slot] = bucket
        base = slot * _FIELDS
        self.counts[base : base + _FIELDS] = array("Q", (successful, errors, issued, dropped))

    def buckets(self, first: int, last: int) -> Iterator[tuple[int, tuple[int, int, int, int]]]:
        """The buckets from ``first`` to ``last`` that hold counts, with them."""
        slots = len(self.stamps)
        for bucket in range(max(first, last - slots + 1), last + 1):
            slot = bucket % slots
            if self.stamps[slot] == bucket:
                base = slot * _FIELDS
                counts = tuple(self.counts[base : base + _FIELDS])
                if any(counts):
                    yield bucket, counts  # type: ignore[misc]

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
    wave: int
    last_report: float


@dataclass(slots=True)
class _Source:
    """The series of one source of counts: this replica's proxies, or another replica's export."""

    series: dict[tuple[int, str], _Series] = field(default_factory=dict)
    clusters: dict[int, int] = field(default_factory=dict)
    """Series per wave, :data:`OTHER` left out (each wave keeps ``max_clusters`` apart)."""
    updated: float = 0.0


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
    """Request counts per wave, per cluster, per time bucket, within fixed bounds.

    ``clock``: seconds, the same clock as the windows asked for (the rollout machine's), and the
    same on every replica (wall-clock time: other replicas' exports are filed by bucket number).
    ``classify(node_id, group)``: the wave a proxy's requests count in (a rollout's
    :meth:`~pilotfish.rollout.waves.WavePlan.assign`; fixed per node id and group, so it is asked
    once per proxy)."""

    def __init__(
        self,
        settings: LoadSettings | None = None,
        *,
        clock: Callable[[], float],
        classify: Callable[[str, str], int] = lambda _node, _group: 0,
    ) -> None:
        self.settings = settings or LoadSettings()
        self._clock = clock
        self._classify = classify
        self._proxies: dict[str, _Proxy] = {}
        self._own = _Source()
        self._others: dict[str, _Source] = {}
        """Other replicas' exports (:meth:`merge`), by replica."""
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
        """This replica's (wave, cluster) series, :data:`OTHER` left out."""
        return sum(self._own.clusters.values())

    def report(self, node_id: str, group: str, request: lrs_pb2.LoadStatsRequest) -> None:
        """One report as it arrived on ``node_id``'s load reporting stream (the LRS service's sink)."""
        self.ingest(node_id, decode_load_report(request), group=group)

    def ingest(self, node_id: str, report: LoadReport, *, group: str = "") -> Ingested:
        """Count one report of ``node_id`` (the stream's node, whatever ``report.node_id`` says)."""
        now = self._clock()
        proxy = self._proxies.get(node_id)
        if proxy is None:
            if len(node_id) > self.settings.max_node_id or (
                len(self._proxies) >= self.settings.max_proxies and not self._evict(now)
            ):
                self.refused += 1
                return Ingested(kept=0, folded=0, refused=True)
            proxy = self._proxies[node_id] = _Proxy(wave=self._classify(node_id, group), last_report=now)
        proxy.last_report = now
        kept = folded = 0
        for load in report.clusters:
            if load.cluster in self.settings.ignored:
                continue
            series, apart = self._series_for(self._own, proxy.wave, load.cluster)
            if apart:
                kept += 1
            else:
                folded += 1
            start = now - min(load.interval, self.settings.retention)
            series.add(
                math.floor(start / self.settings.bucket), load.successful, load.errors, load.issued, load.dropped
            )
        self.folded += folded
        return Ingested(kept=kept, folded=folded, refused=False)

    def _series_for(self, source: _Source, wave: int, cluster: str) -> tuple[_Series, bool]:
        """The series that counts ``cluster`` in ``wave``, and whether it is the cluster's own."""
        series = source.series.get((wave, cluster))
        if series is not None:
            return series, cluster != OTHER
        settings = self.settings
        if (
            cluster == OTHER
            or not cluster
            or len(cluster) > settings.max_name
            or source.clusters.get(wave, 0) >= settings.max_clusters
            or sum(source.clusters.values()) >= settings.max_series
        ):
            other = source.series.get((wave, OTHER))
            if other is None:  # one per wave, beside max_series
                other = source.series[(wave, OTHER)] = _Series(settings.slots)
            return other, False
        series = source.series[(wave, cluster)] = _Series(settings.slots)
        source.clusters[wave] = source.clusters.get(wave, 0) + 1
        return series, True

    def _evict(self, now: float) -> bool:
        stale = [n for n, p in self._proxies.items() if p.last_report < now - self.settings.retention]
        for node_id in stale:
            del self._proxies[node_id]
        return bool(stale)

    def _buckets(self, start: float, end: float | None) -> tuple[int, int]:
        """The buckets that begin in ``[start, end)`` and are still kept: first and last."""
        width, now = self.settings.bucket, self._clock()
        first = math.ceil(start / width)
        last = math.ceil((now if end is None else end) / width) - 1
        return max(first, math.floor(now / width) - self.settings.slots + 1), last

    def window(self, waves: Iterable[int], start: float, end: float | None = None) -> dict[str, Counts]:
        """Per cluster, the requests of the proxies of ``waves`` in the buckets that begin in
        ``[start, end)`` (``end``: now), here and in every other replica's export."""
        first, last = self._buckets(start, end)
        wanted = set(waves)
        sums: dict[str, list[int]] = {}
        for source in (self._own, *self._others.values()):
            for (wave, cluster), series in source.series.items():
                if wave not in wanted:
                    continue
                counts = series.total(first, last)
                if any(counts):
                    into = sums.get(cluster)
                    if into is None:
                        sums[cluster] = list(counts)
                    else:
                        for i, value in enumerate(counts):
                            into[i] += value
        return {cluster: Counts(*values) for cluster, values in sums.items()}

    # -- replicas: each counts its own proxies' reports, the deciding one reads them all ----------

    def export(self, start: float) -> dict[str, Any]:
        """This replica's counts in the buckets from ``start`` to now, for the replica that
        decides (JSON-able; :meth:`merge` takes it): ``bucket`` (seconds) and ``series``, rows of
        ``[wave, cluster, bucket, successful, errors, issued, dropped]``, buckets with counts only;
        series beyond the first :data:`MAX_EXPORTED` are folded into their wave's :data:`OTHER`
        (so an export stays far below etcd's request limit)."""
        first, last = self._buckets(start, None)
        rows: list[list[Any]] = []
        folded: dict[tuple[int, int], list[int]] = {}  # (wave, bucket) -> counts, beyond MAX_EXPORTED
        exported = 0
        for (wave, cluster), series in self._own.series.items():
            apart = cluster != OTHER and exported < MAX_EXPORTED
            exported += apart
            for bucket, counts in series.buckets(first, last):
                if apart:
                    rows.append([wave, cluster, bucket, *counts])
                else:
                    into = folded.setdefault((wave, bucket), [0] * _FIELDS)
                    for i, value in enumerate(counts):
                        into[i] = min(into[i] + value, _SATURATED)
        rows.extend([wave, OTHER, bucket, *counts] for (wave, bucket), counts in folded.items())
        return {"bucket": self.settings.bucket, "series": rows}

    def merge(self, replica: str, exported: Mapping[str, Any]) -> None:
        """Take another replica's :meth:`export`: its buckets replace what it said of them before
        (each export holds a bucket's counts so far). Bounded like this replica's own counts, and
        in replicas (:attr:`LoadSettings.max_replicas`: the one not heard from longest makes room).
        Raises ValueError for an export that is not one (nothing of it is taken)."""
        settings, now = self.settings, self._clock()
        if exported.get("bucket") != settings.bucket:
            raise ValueError(
                f"load counted in buckets of {exported.get('bucket')!r} s, here {settings.bucket:g} s "
                "(every replica must run with the same --rollout-bake)"
            )
        rows = exported.get("series")
        if not isinstance(rows, list) or not all(_is_row(row) for row in rows):
            raise ValueError("load export: 'series' must be rows of [wave, cluster, bucket, 4 counts]")
        source = self._others.get(replica)
        if source is None:
            while len(self._others) >= settings.max_replicas:
                del self._others[min(self._others, key=lambda r: self._others[r].updated)]
            source = self._others[replica] = _Source()
        source.updated = now
        newest = math.floor(now / settings.bucket) + 1  # (a clock a little ahead: one bucket)
        for wave, cluster, bucket, *counts in rows:
            if bucket <= newest:
                self._series_for(source, wave, cluster)[0].put(bucket, *(min(c, _SATURATED) for c in counts))


def _is_row(row: object) -> bool:
    return (
        isinstance(row, list)
        and len(row) == 3 + _FIELDS
        and isinstance(row[1], str)
        and all(type(v) is int and v >= 0 for i, v in enumerate(row) if i != 1)
    )
