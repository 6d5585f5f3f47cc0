"""Per-proxy, per-type sync status: what was sent, ACKed and NACKed.

The server writes here as requests and responses pass; the CLI, admin API and metrics only read.
A NACK is kept with its message until the proxy ACKs a later version, so an operator can see
which proxy rejects what, and why.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

__all__ = ["ProxyStatus", "SyncStatus", "TypeStatus"]


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


class SyncStatus:
    """What every connected (or once connected) proxy has, by node id and type URL."""

    def __init__(self) -> None:
        self._proxies: dict[str, ProxyStatus] = {}

    def _type(self, node_id: str, type_url: str) -> TypeStatus:
        proxy = self._proxies.get(node_id)
        if proxy is None:
            proxy = self._proxies[node_id] = ProxyStatus(node_id)
        status = proxy.types.get(type_url)
        if status is None:
            status = proxy.types[type_url] = TypeStatus()
        status.updated = time.time()
        return status

    def stream_opened(self, node_id: str) -> None:
        self._proxies.setdefault(node_id, ProxyStatus(node_id)).streams += 1

    def stream_closed(self, node_id: str) -> None:
        proxy = self._proxies.get(node_id)
        if proxy is not None:
            proxy.streams = max(0, proxy.streams - 1)

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
        return sorted(self._proxies.values(), key=lambda p: p.node_id)

    def get(self, node_id: str) -> ProxyStatus | None:
        return self._proxies.get(node_id)
