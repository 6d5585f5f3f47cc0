"""What the fleet's coordinator and its workers say to each other, and the names both use.

The coordinator (:mod:`bench.fleet.coordinator`) sends each worker a command and a dict of
arguments over a socketpair; the answers are plain values, typed here. Type URLs and the choices
of client and xDS variant live here too, so the coordinator imports no proxy code.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TypedDict

__all__ = [
    "BY_SHORT",
    "CDS",
    "CLIENTS",
    "EDS",
    "LDS",
    "MAX_PER_WORKER",
    "RDS",
    "RTDS",
    "SHORT",
    "TTL_FEATURES",
    "XDS_VARIANTS",
    "ChurnCounts",
    "ErrorReport",
    "FleetError",
    "FleetTls",
    "LrsCounts",
    "LrsLoad",
    "StreamReport",
]


CDS = "type.googleapis.com/envoy.config.cluster.v3.Cluster"
EDS = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"
LDS = "type.googleapis.com/envoy.config.listener.v3.Listener"
RDS = "type.googleapis.com/envoy.config.route.v3.RouteConfiguration"
RTDS = "type.googleapis.com/envoy.service.runtime.v3.Runtime"
SHORT = {CDS: "CDS", EDS: "EDS", LDS: "LDS", RDS: "RDS"}
"""The four types every simulated proxy asks for (and a benchmark waits for); RTDS only when told."""
TTL_FEATURES = ("xds.config.supports-resource-ttl", "xds.config.resource-in-sotw")
"""The client features of a node that takes resources with TTLs (as ``pilotfish bootstrap``
writes them): proxies with runtime layers announce them."""
BY_SHORT = {v: k for k, v in SHORT.items()}
MAX_PER_WORKER = 2500
"""Proxies one worker process drives at most (more: more workers)."""
CLIENTS = ("h2", "grpc")
"""The simulated proxies' gRPC clients: bench/h2client.py (default), grpc.aio."""
XDS_VARIANTS = ("sotw", "delta")
"""The protocol the simulated proxies speak: state of the world (``StreamAggregatedResources``,
default) or incremental (``DeltaAggregatedResources``)."""


class FleetError(RuntimeError):
    """A worker process failed."""


@dataclass(frozen=True, slots=True, kw_only=True)
class FleetTls:
    """How the simulated proxies reach the server over TLS (paths are read by each worker)."""

    ca: str
    """PEM CA bundle the server's certificate must chain to."""
    cert: str | None = None
    """mTLS: PEM certificate chain each proxy presents (None: no client certificate)."""
    key: str | None = None
    """mTLS: PEM private key of ``cert``."""
    server_name: str = "localhost"
    """The name the server's certificate is verified against (and sent as SNI)."""

    def as_dict(self) -> dict[str, str | None]:
        return {"ca": self.ca, "cert": self.cert, "key": self.key, "server_name": self.server_name}


@dataclass(frozen=True, slots=True, kw_only=True)
class LrsLoad:
    """What each simulated proxy reports on its load reporting stream (:mod:`bench.fleet.lrs`)."""

    clusters: int = 3
    """Clusters per report (of those the proxy has, from its CDS), each with one locality."""
    rps: float = 20.0
    """Requests per second per cluster: a report's counts are this times the seconds it covers."""
    error_ratio: float = 0.001
    """Share of those requests counted as ``total_error_requests`` (rounded at random, so the
    share holds on average)."""

    def as_dict(self) -> dict[str, float]:
        return {"clusters": self.clusters, "rps": self.rps, "error_ratio": self.error_ratio}


@dataclass(slots=True)
class LrsCounts:
    """How the proxies' load reporting went (:meth:`Fleet.lrs_counts`), in one worker or summed."""

    reporting: int = 0
    """Proxies with a load reporting stream (started and not stopped)."""
    answered: int = 0
    """...of them, those whose current stream has the server's ``LoadStatsResponse``."""
    streams: int = 0
    """Load reporting streams opened (reconnects included)."""
    reports: int = 0
    """``LoadStatsRequest`` messages with stats sent (not counting each stream's first)."""
    report_bytes: int = 0
    """Bytes of those messages (gRPC message bodies)."""
    errors: dict[str, int] = field(default_factory=dict)
    """Streams that ended, by gRPC status (``CLOSED_BY_SERVER``: ended with status OK)."""

    def add(self, other: LrsCounts) -> None:
        self.reporting += other.reporting
        self.answered += other.answered
        self.streams += other.streams
        self.reports += other.reports
        self.report_bytes += other.report_bytes
        for code, n in other.errors.items():
            self.errors[code] = self.errors.get(code, 0) + n


class ErrorReport(TypedDict):
    """A worker's answer to ``errors``."""

    counts: dict[str, int]
    """Streams that broke, by gRPC status."""
    examples: dict[str, str]
    """One example message per gRPC status seen."""


class StreamReport(TypedDict):
    """A worker's answer to ``streams``."""

    streams: int
    """Streams its proxies opened (reconnects included)."""
    proxies: int


@dataclass(slots=True)
class ChurnCounts:
    """How far a churn got (:meth:`Fleet.churn`), in one worker or summed over all."""

    started: int = 0
    """Proxies that began to connect."""
    synced: int = 0
    """...of them, those that synced before they left."""
    never_synced: int = 0
    """...those that left after the sync timeout without having synced."""
    departed: int = 0
    """...those that have left (synced or not)."""
    active: int = 0
    """...those connected (or connecting) now."""
