"""Per-proxy, per-type sync status: what was sent, ACKed and NACKed.

The server writes here as requests and responses pass; the CLI, admin API and metrics only read.
A NACK is kept with its message until the proxy ACKs a later version, so an operator can see
which proxy rejects what, and why.

A proxy is remembered while it has a stream open, and for a grace period after its last stream
closed (a proxy that reconnects, or hot-restarts, finds its history), then forgotten: node ids
come and go (pods are replaced), and a peer can connect under ever new ones. At most
:attr:`StatusLimits.max_disconnected` disconnected proxies are kept; past it, the longest gone
is forgotten first. Disconnected proxies are kept in the order they went, so forgetting looks
only at the oldest.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = ["ProxyStatus", "StatusLimits", "SyncStatus", "TypeStatus"]


@dataclass(frozen=True, slots=True, kw_only=True)
class StatusLimits:
    """How long, and how many, proxies that have disconnected are remembered."""

    forget_after: float = 600.0
    """Seconds after a proxy's last stream closed before its status is forgotten."""
    max_disconnected: int = 10_000
    """Disconnected proxies remembered at most; past it the one gone longest is forgotten."""


@dataclass(slots=True)
class TypeStatus:
    sent_version: str | None = None
    acked_version: str | None = None
    nacked_version: str | None = None
    nack_error: str | None = None
    updated: float = 0.0

    @property
    def in_sync(self) -> bool:
        return self.sent_version is not None and self.sent_version == self.acked_version


@dataclass(slots=True)
class ProxyStatus:
    node_id: str
    streams: int = 0
    types: dict[str, TypeStatus] = field(default_factory=dict)
    disconnected_at: float | None = None
    """When its last stream closed (the status clock, monotonic); None while connected."""


class SyncStatus:
    """What every connected (or recently connected) proxy has, by node id and type URL.

    ``clock`` (monotonic seconds) decides when a disconnected proxy is forgotten; ``updated``
    fields are wall-clock times, for people.
    """

    def __init__(self, *, limits: StatusLimits | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self._proxies: dict[str, ProxyStatus] = {}
        self._gone: dict[str, float] = {}
        """Disconnected proxies, by node id, in the order they went (value: when)."""
        self._limits = limits or StatusLimits()
        self._clock = clock

    def _type(self, node_id: str, type_url: str) -> TypeStatus:
        proxy = self._proxies.get(node_id)
        if proxy is None:
            # Written to without an open stream (not what the server does): counts as gone now.
            proxy = self._proxies[node_id] = ProxyStatus(node_id)
            self._went(proxy)
        status = proxy.types.get(type_url)
        if status is None:
            status = proxy.types[type_url] = TypeStatus()
        status.updated = time.time()
        return status

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

    def stream_opened(self, node_id: str) -> None:
        proxy = self._proxies.get(node_id)
        if proxy is None:
            proxy = self._proxies[node_id] = ProxyStatus(node_id)
        elif proxy.disconnected_at is not None:
            proxy.disconnected_at = None
            self._gone.pop(node_id, None)
        proxy.streams += 1
        self.forget_gone()

    def stream_closed(self, node_id: str) -> None:
        proxy = self._proxies.get(node_id)
        if proxy is None or proxy.streams == 0:
            return
        proxy.streams -= 1
        if proxy.streams == 0:
            self._went(proxy)

    def sent(self, node_id: str, type_url: str, version: str) -> None:
        self._type(node_id, type_url).sent_version = version

    def acked(self, node_id: str, type_url: str, version: str) -> None:
        status = self._type(node_id, type_url)
        status.acked_version = version
        if status.nacked_version is not None and status.nacked_version != version:
            status.nacked_version = status.nack_error = None

    def nacked(self, node_id: str, type_url: str, version: str | None, error: str) -> None:
        status = self._type(node_id, type_url)
        status.nacked_version = version
        status.nack_error = error

    def proxies(self) -> list[ProxyStatus]:
        self.forget_gone()
        return sorted(self._proxies.values(), key=lambda p: p.node_id)

    def get(self, node_id: str) -> ProxyStatus | None:
        self.forget_gone()
        return self._proxies.get(node_id)

    def __len__(self) -> int:
        """Proxies remembered now (connected, and disconnected within the grace period)."""
        return len(self._proxies)
