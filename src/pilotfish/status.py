"""Per-proxy, per-type sync status: what was sent, ACKed and NACKed, and when.

The server writes here as requests and responses pass; the CLI, admin API and metrics only read.
A NACK is kept with its message until the proxy ACKs a later version, so an operator can see
which proxy rejects what, and why.

Per proxy: what its node said when its latest stream opened (:class:`NodeInfo`: cluster, user
agent, address, node group), how many streams it holds and since when. Per proxy and type: the
version last sent (and when), the version last ACKed (and when it was first ACKed: the moment the
proxy took it), the last NACK (version, message, when). :attr:`TypeStatus.state` turns these into
the state an operator reads (:class:`SyncState`). For the whole server: per type, how many
responses, ACKs and NACKs (:class:`TypeCounters`), and per node group the current version of each
type and when it was published (:meth:`SyncStatus.published`, called by the reconciler), so that
"version v7 is ACKed by 48 of 50 proxies, the last 1.2 s after it was published" can be answered
by reading, without anything on the path of an ACK beyond a few assignments: a fan-out to
thousands of proxies passes here once per response and once per ACK.

A proxy is remembered while it has a stream open, and for a grace period after its last stream
closed (a proxy that reconnects, or hot-restarts, finds its history), then forgotten: node ids
come and go (pods are replaced), and a peer can connect under ever new ones. At most
:attr:`StatusLimits.max_disconnected` disconnected proxies are kept; past it, the longest gone
is forgotten first. Disconnected proxies are kept in the order they went, so forgetting looks
only at the oldest. What a node says about itself is shortened to :data:`MAX_NODE_FIELD`
characters; types are only those the server serves.
"""

from __future__ import annotations

import bisect
import enum
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from pilotfish.errors import shorten

__all__ = ["ACK_BUCKETS", "MAX_NACK_MESSAGE", "MAX_NODE_FIELD", "GroupVersions", "LatencyHistogram", "NodeInfo",
           "ProxyStatus", "StatusLimits", "SyncState", "SyncStatus", "TypeCounters", "TypeStatus", "VersionProgress"]

MAX_NODE_FIELD = 256
"""Characters kept of each field a node says about itself (cluster, user agent, ...)."""
MAX_NACK_MESSAGE = 4096
"""Characters kept of a NACK's message (its start, and its end, where Envoy puts the reason)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class StatusLimits:
    """How long, and how many, proxies that have disconnected are remembered."""

    forget_after: float = 600.0
    """Seconds after a proxy's last stream closed before its status is forgotten."""
    max_disconnected: int = 10_000
    """Disconnected proxies remembered at most; past it the one gone longest is forgotten."""


class SyncState(enum.Enum):
    """Where a proxy stands with one type, as ``istioctl proxy-status`` says it."""

    SYNCED = "SYNCED"
    """It ACKed the latest version sent to it."""
    STALE = "STALE"
    """A version was sent and is neither ACKed nor NACKed yet."""
    NACKED = "NACKED"
    """It rejected the latest version sent to it (and keeps running an older one)."""
    NOT_SENT = "NOT_SENT"
    """Nothing of this type was sent to it (it did not ask, or nothing is published yet)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeInfo:
    """What a proxy's node says about itself, and where it connects from."""

    cluster: str = ""
    user_agent: str = ""
    """``user_agent_name``: ``envoy``, ``grpc-python``, ..."""
    user_agent_version: str = ""
    """``user_agent_version``, or Envoy's ``user_agent_build_version`` as ``1.40.0``."""
    address: str = ""
    """The peer address of its latest stream."""
    group: str = "default"
    """The node group it is served (see :mod:`pilotfish.server.groups`)."""
    protocol: str = "sotw"
    """``sotw``, ``delta`` (sent only what changed for it) or ``rest`` (polls)."""

    def bounded(self) -> NodeInfo:
        """The same, each field shortened to :data:`MAX_NODE_FIELD` characters (peers choose them)."""
        return NodeInfo(cluster=shorten(self.cluster, MAX_NODE_FIELD),
                        user_agent=shorten(self.user_agent, MAX_NODE_FIELD),
                        user_agent_version=shorten(self.user_agent_version, MAX_NODE_FIELD),
                        address=shorten(self.address, MAX_NODE_FIELD), group=self.group,
                        protocol=self.protocol)


@dataclass(slots=True)
class TypeStatus:
    """One proxy's standing with one type. Times are wall-clock seconds (``time.time()``)."""

    sent_version: str | None = None
    acked_version: str | None = None
    nacked_version: str | None = None
    nack_error: str | None = None
    updated: float = 0.0
    """When anything here last changed."""
    sent_at: float = 0.0
    """When :attr:`sent_version` was last sent."""
    acked_at: float = 0.0
    """When :attr:`acked_version` was first ACKed (a repeated ACK of it does not move it)."""
    nacked_at: float = 0.0
    """When the NACK was received."""

    @property
    def in_sync(self) -> bool:
        return self.sent_version is not None and self.sent_version == self.acked_version

    @property
    def state(self) -> SyncState:
        sent = self.sent_version
        if sent is None:
            return SyncState.NOT_SENT
        if self.nack_error is not None and self.nacked_version in (sent, None):
            return SyncState.NACKED
        if sent == self.acked_version:
            return SyncState.SYNCED
        return SyncState.STALE


@dataclass(slots=True)
class ProxyStatus:
    node_id: str
    streams: int = 0
    types: dict[str, TypeStatus] = field(default_factory=dict)
    disconnected_at: float | None = None
    """When its last stream closed (the status clock, monotonic); None while connected."""
    info: NodeInfo = field(default_factory=NodeInfo)
    """What its node said when its latest stream opened."""
    connected_since: float = 0.0
    """Wall-clock time its streams went from none to one."""


@dataclass(slots=True)
class TypeCounters:
    """Counts for one type since the server started (for metrics: they only grow)."""

    responses: int = 0
    acks: int = 0
    nacks: int = 0


@dataclass(frozen=True, slots=True)
class GroupVersions:
    """What a node group is served now: the snapshot's label, and per type its version and when
    that version was first published (wall-clock seconds)."""

    label: str
    published_at: float
    types: Mapping[str, tuple[str, float]]


@dataclass(slots=True, kw_only=True)
class VersionProgress:
    """How many of a node group's connected proxies that were sent a type have ACKed its current
    version."""

    group: str
    type_url: str
    version: str
    published_at: float
    """When this version was first published (wall clock)."""
    proxies: int = 0
    """Connected proxies of the group that were sent this type (any version)."""
    acked: int = 0
    """...of them, those whose ACKed version is :attr:`version`."""
    current: int = 0
    """...those that have what they are meant to: they ACKed :attr:`version`, or they are on
    incremental xDS and ACKed all they were sent (a delta stream is sent nothing when none of its
    resources changed, and keeps the version of its last response)."""
    nacked: int = 0
    """...those that NACKed :attr:`version`."""
    last_ack_at: float | None = None
    """When the latest of those ACKs came (each proxy's first ACK of it)."""

    @property
    def complete(self) -> bool:
        return self.current == self.proxies

    @property
    def seconds_to_last_ack(self) -> float | None:
        """From publish to the last ACK, once every proxy has ACKed (None before; 0 if the
        proxies had it already)."""
        if not self.complete or self.last_ack_at is None:
            return None
        return max(0.0, self.last_ack_at - self.published_at)


ACK_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
"""Upper bounds (seconds) of the publish-to-ACK histogram's buckets, as Prometheus' defaults
stretched to a minute (a fleet of 10,000 ACKs within about a second; a stuck proxy much later)."""


@dataclass(slots=True)
class LatencyHistogram:
    """Counts of observations per bucket of :data:`ACK_BUCKETS` (the last: above them all), and
    their sum: what a Prometheus histogram needs, kept with an index and an add per observation."""

    counts: list[int] = field(default_factory=lambda: [0] * (len(ACK_BUCKETS) + 1))
    total: float = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(ACK_BUCKETS, seconds)] += 1
        self.total += seconds


class SyncStatus:
    """What every connected (or recently connected) proxy has, by node id and type URL.

    ``clock`` (monotonic seconds) decides when a disconnected proxy is forgotten; ``wall_clock``
    stamps the times people read (``sent_at``, ``acked_at``, ...).
    """

    def __init__(self, *, limits: StatusLimits | None = None, clock: Callable[[], float] = time.monotonic,
                 wall_clock: Callable[[], float] = time.time) -> None:
        self._proxies: dict[str, ProxyStatus] = {}
        self._gone: dict[str, float] = {}
        """Disconnected proxies, by node id, in the order they went (value: when)."""
        self._limits = limits or StatusLimits()
        self._clock = clock
        self._wall = wall_clock
        self.counters: dict[str, TypeCounters] = {}
        self.ack_latency = LatencyHistogram()
        """Seconds from a version's publish to each proxy's first ACK of it (the metrics read it)."""
        """Per type URL: responses sent, ACKs and NACKs received."""
        self.groups: dict[str, GroupVersions] = {}
        """Per node group: what is published for it now (see :meth:`published`)."""

    def _went(self, proxy: ProxyStatus) -> None:
        now = self._clock()
        proxy.disconnected_at = now
        self._gone.pop(proxy.node_id, None)
        self._gone[proxy.node_id] = now
        self.forget_gone()

    def forget_gone(self) -> int:
        """Forget the proxies gone longer than the grace period, and the oldest gone past the
        cap; return how many. Called as streams open and close, and before reading."""
        gone, limits = self._gone, self._limits
        deadline = self._clock() - limits.forget_after
        forgotten = 0
        while gone:
            node_id, when = next(iter(gone.items()))
            if when > deadline and len(gone) <= limits.max_disconnected:
                break
            del gone[node_id]
            del self._proxies[node_id]
            forgotten += 1
        return forgotten

    def stream_opened(self, node_id: str, info: NodeInfo | None = None) -> None:
        """A stream of ``node_id`` opened; ``info``: what its node says (None: as before)."""
        proxy = self._proxies.get(node_id)
        if proxy is None:
            proxy = self._proxies[node_id] = ProxyStatus(node_id)
        elif proxy.disconnected_at is not None:
            proxy.disconnected_at = None
            self._gone.pop(node_id, None)
        if proxy.streams == 0:
            proxy.connected_since = self._wall()
        if info is not None:
            proxy.info = info.bounded()
        proxy.streams += 1
        self.forget_gone()

    def stream_closed(self, node_id: str) -> None:
        proxy = self._proxies.get(node_id)
        if proxy is None or proxy.streams == 0:
            return
        proxy.streams -= 1
        if proxy.streams == 0:
            self._went(proxy)

    def _slow_type(self, node_id: str, type_url: str) -> TypeStatus:
        """The status of ``type_url`` of ``node_id``, made if new (off the hot path: once per
        proxy and type)."""
        proxy = self._proxies.get(node_id)
        if proxy is None:
            # Written to without an open stream (not what the server does): counts as gone now.
            proxy = self._proxies[node_id] = ProxyStatus(node_id)
            self._went(proxy)
        status = proxy.types.get(type_url)
        if status is None:
            status = proxy.types[type_url] = TypeStatus()
        if type_url not in self.counters:
            self.counters[type_url] = TypeCounters()
        return status

    # The three below run once per response and per request of every proxy: lookups inline.

    def sent(self, node_id: str, type_url: str, version: str) -> None:
        proxy = self._proxies.get(node_id)
        status = proxy.types.get(type_url) if proxy is not None else None
        if status is None:
            status = self._slow_type(node_id, type_url)
        status.sent_version = version
        status.sent_at = status.updated = self._wall()
        self.counters[type_url].responses += 1

    def acked(self, node_id: str, type_url: str, version: str) -> None:
        proxy = self._proxies.get(node_id)
        status = proxy.types.get(type_url) if proxy is not None else None
        if status is None:
            status = self._slow_type(node_id, type_url)
        status.updated = now = self._wall()
        if status.acked_version != version:
            status.acked_version = version
            status.acked_at = now
            group = self.groups.get(proxy.info.group) if proxy is not None else None
            current = group.types.get(type_url) if group is not None else None
            if current is not None and current[0] == version:
                self.ack_latency.observe(now - current[1])
        if status.nacked_version is not None and status.nacked_version != version:
            status.nacked_version = status.nack_error = None
        self.counters[type_url].acks += 1

    def nacked(self, node_id: str, type_url: str, version: str | None, error: str) -> None:
        status = self._slow_type(node_id, type_url)
        status.updated = status.nacked_at = self._wall()
        status.nacked_version = version
        status.nack_error = shorten(error, MAX_NACK_MESSAGE)
        self.counters[type_url].nacks += 1

    def published(self, group: str, *, label: str, versions: Mapping[str, str]) -> None:
        """The reconciler handed ``group`` a new snapshot: its label and version per type URL. A
        type whose version did not change keeps the time that version was first published."""
        now = self._wall()
        before = self.groups.get(group)
        types = {}
        for type_url, version in versions.items():
            kept = before.types.get(type_url) if before is not None else None
            types[type_url] = kept if kept is not None and kept[0] == version else (version, now)
        self.groups[group] = GroupVersions(label, now, types)

    def progress(self) -> list[VersionProgress]:
        """Per node group and type, how far the current version has reached: read by walking
        every proxy once (an admin request, not the ACK path)."""
        self.forget_gone()
        out: dict[tuple[str, str], VersionProgress] = {}
        for group, current in self.groups.items():
            for type_url, (version, published_at) in current.types.items():
                out[group, type_url] = VersionProgress(group=group, type_url=type_url, version=version,
                                                       published_at=published_at)
        for proxy in self._proxies.values():
            if proxy.streams == 0:
                continue
            group = proxy.info.group
            for type_url, status in proxy.types.items():
                progress = out.get((group, type_url))
                if progress is None or status.sent_version is None:
                    continue
                progress.proxies += 1
                if status.acked_version == progress.version:
                    progress.acked += 1
                    progress.current += 1
                    progress.last_ack_at = max(progress.last_ack_at or 0.0, status.acked_at)
                    continue
                state = status.state
                if state is SyncState.NACKED and status.nacked_version == progress.version:
                    progress.nacked += 1
                elif state is SyncState.SYNCED and proxy.info.protocol == "delta":
                    progress.current += 1
        return [out[key] for key in sorted(out)]

    def connected(self) -> dict[str, int]:
        """Connected proxies per node group."""
        counts: dict[str, int] = {}
        for proxy in self._proxies.values():
            if proxy.streams:
                counts[proxy.info.group] = counts.get(proxy.info.group, 0) + 1
        return counts

    def proxies(self) -> list[ProxyStatus]:
        self.forget_gone()
        return sorted(self._proxies.values(), key=lambda p: p.node_id)

    def get(self, node_id: str) -> ProxyStatus | None:
        self.forget_gone()
        return self._proxies.get(node_id)

    def now(self) -> float:
        """The wall clock the times here are read against."""
        return self._wall()

    def __len__(self) -> int:
        """Proxies remembered now (connected, and disconnected within the grace period)."""
        return len(self._proxies)
