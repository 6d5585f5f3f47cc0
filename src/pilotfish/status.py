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

A departed proxy is compacted: when its last stream closes, its :class:`ProxyStatus` (an object
per type, a float per time, the strings its requests carried) is replaced by a
:class:`DepartedProxy`, one frozen object holding what the admin API and the status page show of
it and nothing else: the node's fields shortened to :data:`DEPARTED_NODE_FIELD` characters and
interned (thousands of proxies share a cluster and a user agent), per type the versions sent and
ACKed (the ACKed one the same string as the sent one when they are equal: the sent one is the
snapshot's, shared by every proxy; a REST poll's, interned), the last NACK with its message
shortened to share :data:`DEPARTED_NACK` characters between the types (its start, and as much of
its end, where Envoy puts the reason), and the times packed as doubles in one bytes object: a
tuple, a bytes object and the strings only it holds. An Envoy (a node of ~60 KB, a NACK or two
of any length) leaves at most :data:`DEPARTED_BYTES` behind, about 600 bytes without a NACK; a
peer that makes every field, version and NACK long, at most :data:`DEPARTED_BYTES_MAX`. A proxy
that reconnects gets a :class:`ProxyStatus` back from it (:meth:`DepartedProxy.revived`). A REST
poller has no stream between its polls: it is compacted after each (its NACK messages shown as a
departed proxy's; the event log and the warning keep them whole).
"""

from __future__ import annotations

import bisect
import enum
import re
import struct
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import ClassVar, Protocol, TypeAlias

from pilotfish.errors import shorten

__all__ = [
    "ACK_BUCKETS",
    "DEPARTED_BYTES",
    "DEPARTED_BYTES_MAX",
    "DEPARTED_NACK",
    "DEPARTED_NODE_FIELD",
    "DEPARTED_VERSION",
    "MAX_NACK_MESSAGE",
    "MAX_NODE_FIELD",
    "NACK_SUMMARY",
    "WORST_FIRST",
    "DepartedProxy",
    "GroupVersions",
    "LatencyHistogram",
    "NodeInfo",
    "ProxyRecord",
    "ProxyStatus",
    "StatusLimits",
    "StatusObserver",
    "SyncState",
    "SyncStatus",
    "TypeCounters",
    "TypeStatus",
    "VersionProgress",
    "nack_summary",
    "worst_state",
]

MAX_NODE_FIELD = 256
"""Characters kept of each field a node says about itself (cluster, user agent, ...)."""
MAX_NACK_MESSAGE = 4096
"""Characters kept of a NACK's message (its start, and its end, where Envoy puts the reason)."""
DEPARTED_NODE_FIELD = 48
"""Characters kept of each field a node said about itself, once the proxy has departed."""
DEPARTED_VERSION = 64
"""Characters kept of a departed proxy's ACKed or NACKed version when it is not the one it was
sent (a peer chose it; the server's own versions are 16 characters, or a snapshot file's version
and 17 more)."""
DEPARTED_NACK = 200
"""Characters of NACK messages kept of a departed proxy, shared between its NACKed types."""
DEPARTED_BYTES = 1024
"""Bytes a departed Envoy's record takes at most (a node id of up to 64 characters, up to two
NACKed types), beside what every record shares (type URLs, the snapshot's versions, interned
node fields): what the unit tests hold :class:`DepartedProxy` to."""
DEPARTED_BYTES_MAX = 2048
"""...and whatever a peer sends (every field, version and type's NACK long)."""


NACK_SUMMARY = 300
"""Characters of a NACK's one-line summary (:func:`nack_summary`)."""
_DUMPED_NAME = re.compile(r'^(?:name|cluster_name): "((?:[^"\\]|\\.){1,256})"', re.MULTILINE)
"""The rejected resource's name in Envoy's dump of it (its ``name`` field, or an assignment's
``cluster_name``), at the start of a line: a nested message's ``name`` is indented."""


def nack_summary(message: str, limit: int = NACK_SUMMARY) -> str:
    """A NACK's message in one line of at most ``limit`` characters that keeps which resource
    was rejected and Envoy's reason: what ``pilotfish status``, the status page and the warning
    show (the event log and ``/v1/proxies`` keep the message whole).

    Envoy writes two shapes. A resource that breaks its proto rules is dumped whole (many lines)
    and followed by ``\n: `` and the reason: the summary is the resource's name and the reason
    (``'api': Proto constraint validation failed (ClusterValidationError.ConnectTimeout: ...)``).
    Anything else (``Error adding/updating listener(s) ingress: ...``, an invalid regex) names
    the resource first and the reason last: it is kept whole if short, else shortened in the
    middle, so both ends stay."""
    text = message.strip()
    head, dumped, reason = text.rpartition("\n: ")
    if dumped:
        found = _DUMPED_NAME.search(head)
        text = f"{found[1]!r}: {reason}" if found else reason
    text = " ".join(text.split())
    if text.endswith(" ."):
        text = text[:-2]
    return shorten(text, limit, tail=limit // 2)


@dataclass(frozen=True, slots=True, kw_only=True)
class StatusLimits:
    """How long, and how many, proxies that have disconnected are remembered."""

    forget_after: float = 600.0
    """Seconds after a proxy's last stream closed before its status is forgotten
    (``serve --status-forget-after``)."""
    max_disconnected: int = 10_000
    """Disconnected proxies remembered at most; past it the one gone longest is forgotten
    (``serve --status-max-disconnected``; 0: none, a proxy is forgotten as it leaves)."""

    def __post_init__(self) -> None:
        if not self.forget_after >= 0:  # (NaN too)
            raise ValueError(f"forget_after must be 0 or more seconds, not {self.forget_after!r}")
        if self.max_disconnected < 0:
            raise ValueError(f"max_disconnected must be 0 or more, not {self.max_disconnected!r}")


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


WORST_FIRST = (SyncState.NACKED, SyncState.STALE, SyncState.NOT_SENT, SyncState.SYNCED)
"""The states, worst first: a proxy stands where its worst type does (the status page, the metrics)."""


def worst_state(types: Mapping[str, TypeStatus]) -> SyncState:
    """A proxy's state over all its types: the worst of theirs (``NOT_SENT`` with none)."""
    if not types:
        return SyncState.NOT_SENT
    states = {status.state for status in types.values()}
    return next(state for state in WORST_FIRST if state in states)


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
    """The node group it is served (see :mod:`pilotfish.policy.groups`)."""
    protocol: str = "sotw"
    """``sotw``, ``delta`` (sent only what changed for it) or ``rest`` (polls)."""

    def bounded(self) -> NodeInfo:
        """The same, each field shortened to :data:`MAX_NODE_FIELD` characters (peers choose them)."""
        return NodeInfo(
            cluster=shorten(self.cluster, MAX_NODE_FIELD),
            user_agent=shorten(self.user_agent, MAX_NODE_FIELD),
            user_agent_version=shorten(self.user_agent_version, MAX_NODE_FIELD),
            address=shorten(self.address, MAX_NODE_FIELD),
            group=self.group,
            protocol=self.protocol,
        )


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


_TIMES = struct.Struct("<3d")
"""connected_since, disconnected_at (monotonic), left_at (wall clock); then per type :data:`_TYPE_TIMES`."""
_TYPE_TIMES = struct.Struct("<3d")
"""sent_at, acked_at, nacked_at."""
_NODE_ITEMS = 6
"""Items of :attr:`DepartedProxy.kept` before the types': the fields of :class:`NodeInfo`, in order."""
_PER_TYPE = 5
"""Items per type in :attr:`DepartedProxy.kept`: type URL, sent, ACKed and NACKed versions, NACK message."""


def _kept_version(version: str | None, sent: str | None) -> str | None:
    """A version of a departed proxy's type: the sent one's string when equal (the snapshot's,
    shared by every proxy), else shortened and interned (a peer chose it)."""
    if version is None or version == sent:
        return sent if version is not None else None
    return sys.intern(shorten(version, DEPARTED_VERSION))


@dataclass(frozen=True, slots=True)
class DepartedProxy:
    """What is remembered of a proxy whose last stream closed: what the admin API and the status
    page show of it, compacted into two containers (see the module docstring). It reads as a
    :class:`ProxyStatus` with no streams; :attr:`info` and :attr:`types` are made anew on each
    read (changing them changes nothing here)."""

    node_id: str
    kept: tuple[str | None, ...]
    """The node's fields (:data:`_NODE_ITEMS`: cluster, user agent, its version, address, group,
    protocol), then per type, flat (:data:`_PER_TYPE`): type URL, sent version, ACKed version,
    NACKed version, NACK message."""
    times: bytes
    """:data:`_TIMES` then :data:`_TYPE_TIMES` per type, packed."""

    streams: ClassVar[int] = 0

    @classmethod
    def of(cls, proxy: ProxyStatus, *, left_at: float) -> DepartedProxy:
        """The record of ``proxy``, which has just lost its last stream (``disconnected_at`` set)."""
        info = proxy.info
        field_chars = DEPARTED_NODE_FIELD
        kept: list[str | None] = [
            sys.intern(shorten(text, field_chars)) for text in (info.cluster, info.user_agent, info.user_agent_version)
        ]
        kept += (shorten(info.address, field_chars), sys.intern(info.group), sys.intern(info.protocol))
        nacks = sum(1 for status in proxy.types.values() if status.nack_error is not None)
        nack_chars = DEPARTED_NACK // max(1, nacks)
        times = [_TIMES.pack(proxy.connected_since, proxy.disconnected_at or 0.0, left_at)]
        for type_url, status in proxy.types.items():
            sent = None if status.sent_version is None else sys.intern(status.sent_version)
            error = None if status.nack_error is None else shorten(status.nack_error, nack_chars, tail=nack_chars // 2)
            kept += (
                sys.intern(type_url),
                sent,
                _kept_version(status.acked_version, sent),
                _kept_version(status.nacked_version, sent),
                error,
            )
            times.append(_TYPE_TIMES.pack(status.sent_at, status.acked_at, status.nacked_at))
        return cls(proxy.node_id, tuple(kept), b"".join(times))

    @property
    def info(self) -> NodeInfo:
        """What its node said when its latest stream opened (each field shortened)."""
        cluster, user_agent, version, address, group, protocol = self.kept[:_NODE_ITEMS]
        return NodeInfo(
            cluster=cluster or "",
            user_agent=user_agent or "",
            user_agent_version=version or "",
            address=address or "",
            group=group or "",
            protocol=protocol or "",
        )

    @property
    def connected_since(self) -> float:
        """Wall-clock time its streams went from none to one, the last time."""
        return float(_TIMES.unpack_from(self.times)[0])

    @property
    def disconnected_at(self) -> float:
        """When its last stream closed (the status clock, monotonic)."""
        return float(_TIMES.unpack_from(self.times)[1])

    @property
    def left_at(self) -> float:
        """When its last stream closed (wall clock)."""
        return float(_TIMES.unpack_from(self.times)[2])

    @property
    def types(self) -> dict[str, TypeStatus]:
        """Its standing with each type, as when it left."""
        out: dict[str, TypeStatus] = {}
        kept = self.kept
        for n in range((len(kept) - _NODE_ITEMS) // _PER_TYPE):
            at = _NODE_ITEMS + n * _PER_TYPE
            type_url, sent, acked, nacked, error = kept[at : at + _PER_TYPE]
            sent_at, acked_at, nacked_at = _TYPE_TIMES.unpack_from(self.times, _TIMES.size + n * _TYPE_TIMES.size)
            out[type_url or ""] = TypeStatus(
                sent_version=sent,
                acked_version=acked,
                nacked_version=nacked,
                nack_error=error,
                updated=max(sent_at, acked_at, nacked_at),
                sent_at=sent_at,
                acked_at=acked_at,
                nacked_at=nacked_at,
            )
        return out

    def revived(self) -> ProxyStatus:
        """A :class:`ProxyStatus` with what was kept, for the proxy that reconnects (no streams yet)."""
        return ProxyStatus(self.node_id, types=self.types, info=self.info, connected_since=self.connected_since)


ProxyRecord: TypeAlias = ProxyStatus | DepartedProxy
"""What :meth:`SyncStatus.proxies` and :meth:`SyncStatus.get` give: a connected proxy's status, or
what is remembered of a departed one."""


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


class StatusObserver(Protocol):
    """Told what :class:`SyncStatus` is told, as it is told (a rollout's delivery: its gates)."""

    def stream_opened(self, node_id: str, info: NodeInfo) -> None: ...

    def stream_closed(self, node_id: str, streams_left: int) -> None: ...

    def sent(self, node_id: str, type_url: str, version: str) -> None: ...

    def acked(self, node_id: str, type_url: str, version: str) -> None: ...

    def nacked(self, node_id: str, type_url: str, version: str | None, error: str) -> None: ...


class SyncStatus:
    """What every connected (or recently connected) proxy has, by node id and type URL.

    ``clock`` (monotonic seconds) decides when a disconnected proxy is forgotten; ``wall_clock``
    stamps the times people read (``sent_at``, ``acked_at``, ...).
    """

    def __init__(
        self,
        *,
        limits: StatusLimits | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self._proxies: dict[str, ProxyStatus] = {}
        """Proxies with a stream open (and, until the next :meth:`forget_gone`, those written to
        without one: :attr:`_loose`)."""
        self._gone: dict[str, DepartedProxy] = {}
        """Departed proxies, by node id, in the order they went."""
        self._loose: list[str] = []
        """Node ids written to with no stream open (not what the server does), compacted by the
        next :meth:`forget_gone`."""
        self._limits = limits or StatusLimits()
        self._clock = clock
        self._wall = wall_clock
        self.counters: dict[str, TypeCounters] = {}
        """Per type URL: responses sent, ACKs and NACKs received."""
        self.ack_latency = LatencyHistogram()
        """Seconds from a version's publish to each proxy's first ACK of it (the metrics read it)."""
        self.groups: dict[str, GroupVersions] = {}
        """Per node group: what is published for it now (see :meth:`published`)."""
        self._observer: StatusObserver | None = None

    def observe(self, observer: StatusObserver) -> None:
        """Tell ``observer`` everything recorded from now on (one observer: a rollout's delivery)."""
        if self._observer is not None:
            raise ValueError("the status has an observer already")
        self._observer = observer

    @property
    def limits(self) -> StatusLimits:
        return self._limits

    def _went(self, proxy: ProxyStatus) -> None:
        """``proxy`` has no stream left: keep its compact record instead."""
        proxy.disconnected_at = self._clock()
        del self._proxies[proxy.node_id]
        self._gone.pop(proxy.node_id, None)
        self._gone[proxy.node_id] = DepartedProxy.of(proxy, left_at=self._wall())

    def forget_gone(self) -> int:
        """Forget the proxies gone longer than the grace period, and the oldest gone past the
        cap; return how many. Called as streams open and close, and before reading."""
        while self._loose:
            proxy = self._proxies.get(self._loose.pop())
            if proxy is not None and proxy.streams == 0:
                self._went(proxy)
        gone, limits = self._gone, self._limits
        deadline = self._clock() - limits.forget_after
        forgotten = 0
        while gone:
            node_id, record = next(iter(gone.items()))
            if record.disconnected_at > deadline and len(gone) <= limits.max_disconnected:
                break
            del gone[node_id]
            forgotten += 1
        return forgotten

    def _revived(self, node_id: str) -> ProxyStatus:
        """``node_id``'s status to write to: its live one, the one it left behind, or a new one."""
        proxy = self._proxies.get(node_id)
        if proxy is None:
            record = self._gone.pop(node_id, None)
            proxy = self._proxies[node_id] = ProxyStatus(node_id) if record is None else record.revived()
        return proxy

    def stream_opened(self, node_id: str, info: NodeInfo | None = None) -> None:
        """A stream of ``node_id`` opened; ``info``: what its node says (None: as before)."""
        proxy = self._revived(node_id)
        proxy.disconnected_at = None
        if proxy.streams == 0:
            proxy.connected_since = self._wall()
        if info is not None:
            proxy.info = info.bounded()
        proxy.streams += 1
        self.forget_gone()
        if self._observer is not None:
            self._observer.stream_opened(node_id, proxy.info)

    def stream_closed(self, node_id: str) -> None:
        proxy = self._proxies.get(node_id)
        if proxy is None or proxy.streams == 0:
            return
        proxy.streams -= 1
        if proxy.streams == 0:
            self._went(proxy)
            self.forget_gone()
        if self._observer is not None:
            self._observer.stream_closed(node_id, proxy.streams)

    def _slow_type(self, node_id: str, type_url: str) -> TypeStatus:
        """The status of ``type_url`` of ``node_id``, made if new (off the hot path: once per
        proxy and type)."""
        proxy = self._proxies.get(node_id)
        if proxy is None or proxy.streams == 0:
            # Written to without an open stream (not what the server does): counts as gone.
            proxy = self._revived(node_id)
            self._loose.append(node_id)
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
        if self._observer is not None:
            self._observer.sent(node_id, type_url, version)

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
        if self._observer is not None:
            self._observer.acked(node_id, type_url, version)

    def resumed(self, node_id: str, type_url: str, version: str) -> None:
        """A new stream's first request of ``type_url`` states that the proxy holds ``version``
        (docs/architecture.md, behaviour 11): if it is what was last sent to it, an ACK that its
        broken stream never delivered."""
        proxy = self._proxies.get(node_id)
        status = proxy.types.get(type_url) if proxy is not None else None
        if status is not None and status.sent_version == version and status.acked_version != version:
            self.acked(node_id, type_url, version)

    def nacked(self, node_id: str, type_url: str, version: str | None, error: str) -> None:
        status = self._slow_type(node_id, type_url)
        status.updated = status.nacked_at = self._wall()
        status.nacked_version = version
        status.nack_error = shorten(error, MAX_NACK_MESSAGE)
        self.counters[type_url].nacks += 1
        if self._observer is not None:
            self._observer.nacked(node_id, type_url, version, error)

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
                out[group, type_url] = VersionProgress(
                    group=group, type_url=type_url, version=version, published_at=published_at
                )
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

    def connected_states(self) -> dict[str, dict[SyncState, int]]:
        """Connected proxies per node group and state (each at its :func:`worst_state`), every
        state counted (0 included) for each group with a connected proxy."""
        counts: dict[str, dict[SyncState, int]] = {}
        for proxy in self._proxies.values():
            if proxy.streams:
                group = counts.get(proxy.info.group)
                if group is None:
                    group = counts[proxy.info.group] = dict.fromkeys(WORST_FIRST, 0)
                group[worst_state(proxy.types)] += 1
        return counts

    def proxies(self) -> list[ProxyRecord]:
        """Every proxy remembered (connected, and departed within the grace period), by node id."""
        self.forget_gone()
        records: list[ProxyRecord] = [*self._proxies.values(), *self._gone.values()]
        return sorted(records, key=lambda p: p.node_id)

    def get(self, node_id: str) -> ProxyRecord | None:
        self.forget_gone()
        return self._proxies.get(node_id) or self._gone.get(node_id)

    def now(self) -> float:
        """The wall clock the times here are read against."""
        return self._wall()

    def __len__(self) -> int:
        """Proxies remembered now (connected, and disconnected within the grace period)."""
        return len(self._proxies) + len(self._gone)
