"""The fleet's coordinator: :class:`Fleet` starts the worker processes, shards the proxies over
them and gathers their answers (synchronous; no grpc and no protobuf in this process).
"""

from __future__ import annotations

import math
import os
import socket
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from bench.fleet.messages import (
    CLIENTS,
    MAX_PER_WORKER,
    XDS_VARIANTS,
    ChurnCounts,
    ErrorReport,
    FleetError,
    FleetTls,
    LrsCounts,
    LrsLoad,
    StreamReport,
)
from bench.procs import REPO, cpu_seconds, rss_kb

__all__ = ["Fleet", "WaitResult"]


@dataclass
class WaitResult:
    """When each proxy reached what was waited for (epoch seconds; None: never, within the timeout)."""

    times: list[float | None]

    @property
    def failures(self) -> int:
        return sum(1 for t in self.times if t is None)

    def latencies(self, since: float) -> list[float]:
        return sorted(t - since for t in self.times if t is not None)


@dataclass
class Fleet:
    """N simulated proxies spread over worker processes."""

    target: str
    """The server's xDS address (``host:port``)."""
    proxies: int
    workers: int = 0
    """0: one per :data:`MAX_PER_WORKER` proxies, and at least one per core for 250 proxies or more."""
    rate: float = 0.0
    """Proxies started per second in each worker (0: all at once)."""
    client: str = "h2"
    """The proxies' gRPC client: ``h2`` (bench/h2client.py, lean) or ``grpc`` (grpc.aio channels)."""
    xds: str = "sotw"
    """The proxies' xDS variant (:data:`XDS_VARIANTS`): state of the world or delta."""
    node_prefix: str = "sim"
    tls: FleetTls | None = None
    """Connect over TLS (or mTLS) as this says; None: plaintext."""
    replicas: tuple[str, ...] = ()
    """More servers' xDS addresses: the proxies are spread evenly, proxy i connecting to
    ``(target, *replicas)[i % (1 + len(replicas))]``."""
    runtime_layers: tuple[str, ...] = ()
    """RTDS layers every proxy asks for, announcing that it takes resources with TTLs (as
    ``pilotfish bootstrap --runtime-layer`` writes an Envoy's node)."""
    error_examples: dict[str, str] = field(default_factory=dict)
    """One example message per gRPC status seen (filled by :meth:`errors`)."""
    _conns: list[Connection] = field(default_factory=list)
    _procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.client not in CLIENTS:
            raise ValueError(f"client {self.client!r}: one of {', '.join(CLIENTS)}")
        if self.xds not in XDS_VARIANTS:
            raise ValueError(f"xds {self.xds!r}: one of {', '.join(XDS_VARIANTS)}")
        if self.workers <= 0:
            # Real proxies run in parallel: use every core for a fleet big enough to keep them busy.
            self.workers = max(
                min(os.cpu_count() or 1, math.ceil(self.proxies / 250)), math.ceil(self.proxies / MAX_PER_WORKER), 1
            )
        self.workers = min(self.workers, max(1, self.proxies))

    def node_id(self, index: int) -> str:
        """The node id of proxy ``index`` (``{node_prefix}-00042``)."""
        return f"{self.node_prefix}-{index:05d}"

    def start(self) -> None:
        # Workers are fresh interpreters (``python -m bench.fleet.worker FD``) talking over a
        # socketpair: no fork of a process with threads, no dependence on how __main__ was run.
        for _ in range(self.workers):
            ours, theirs = socket.socketpair()
            fd = theirs.detach()
            proc = subprocess.Popen(
                [sys.executable, "-m", "bench.fleet.worker", str(fd)],
                pass_fds=(fd,),
                cwd=REPO,
                stdin=subprocess.DEVNULL,
            )
            os.close(fd)
            self._conns.append(Connection(ours.detach()))
            self._procs.append(proc)
        shards: list[list[tuple[int, str]]] = [[] for _ in range(self.workers)]
        for i in range(self.proxies):
            shards[i % self.workers].append((i, self.node_id(i)))
        tls = self.tls.as_dict() if self.tls is not None else None
        targets = [self.target, *self.replicas]
        # A worker answers once it has started its last proxy: with a ramp, after len(shard) / rate
        # seconds, longer when its event loop is busy syncing the ones it started first (10,000
        # delta proxies at 10 per second per worker: past the usual two minutes).
        ramp = max(map(len, shards)) / self.rate if self.rate > 0 else 0.0
        self._all(
            "start",
            per_worker=[
                {
                    "targets": targets,
                    "ids": s,
                    "rate": self.rate,
                    "client": self.client,
                    "tls": tls,
                    "xds": self.xds,
                    "runtime_layers": list(self.runtime_layers),
                }
                for s in shards
            ],
            timeout=max(60.0, 2 * ramp),
        )

    def _all(self, command: str, *, per_worker: list[dict[str, Any]] | None = None, **args: Any) -> list[Any]:
        for n, conn in enumerate(self._conns):
            conn.send((command, per_worker[n] if per_worker is not None else args))
        results = []
        for n, conn in enumerate(self._conns):
            if not conn.poll(args.get("timeout", 60) + 60):
                raise FleetError(f"worker {n} did not answer {command!r}")
            status, result = conn.recv()
            if status != "ok":
                raise FleetError(f"worker {n}: {command}: {result}")
            results.append(result)
        return results

    def _gather(self, results: list[list[tuple[int, float | None]]]) -> WaitResult:
        times: list[float | None] = [None] * self.proxies
        for shard in results:
            for index, at in shard:
                times[index] = at
        return WaitResult(times)

    def wait_synced(self, timeout: float) -> WaitResult:
        """Until every proxy has ACKed CDS, EDS, LDS and RDS at least once."""
        return self._gather(self._all("wait", versions=None, since=0.0, timeout=timeout))

    def wait_acked(
        self, versions: dict[str, str], *, since: float, timeout: float, synced_only: bool = False
    ) -> WaitResult:
        """Until every proxy has ACKed these versions (type URL -> version) at or after ``since``
        (``synced_only``: every proxy that had synced when the wait began; the others are counted
        as they are, usually as failures)."""
        return self._gather(self._all("wait", versions=versions, since=since, timeout=timeout, synced_only=synced_only))

    def errors(self, since: float = 0.0) -> dict[str, int]:
        """Errors, by gRPC status code, of streams opened since ``since`` (epoch seconds)."""
        total: Counter[str] = Counter()
        reports: list[ErrorReport] = self._all("errors", since=since)
        for result in reports:
            total.update(result["counts"])
            self.error_examples.update(result["examples"])
        return dict(total)

    def cpu_seconds(self) -> float:
        """CPU seconds the simulator's worker processes have used (they share the server's cores)."""
        return sum(cpu_seconds(proc.pid) for proc in self._procs)

    def bytes_received(self) -> list[int]:
        """Bytes of response messages each proxy has received so far (by proxy index)."""
        received = [0] * self.proxies
        for shard in self._all("bytes"):
            for index, count in shard:
                received[index] = count
        return received

    def rss_kb(self) -> int:
        """Resident memory of the simulator's worker processes, summed (KiB)."""
        return sum(rss_kb(proc.pid) for proc in self._procs)

    def streams_opened(self) -> int:
        reports: list[StreamReport] = self._all("streams")
        return sum(r["streams"] for r in reports)

    def lrs_start(self, load: LrsLoad | None = None, *, timeout: float = 60.0) -> int:
        """Every proxy opens a load reporting (LRS) stream and reports ``load`` as the server asks
        (:mod:`bench.fleet.lrs`; h2 client only); returns once every stream has the server's
        response, or after ``timeout`` s: how many have."""
        load = load or LrsLoad()
        return sum(self._all("lrs_start", load=load.as_dict(), timeout=timeout))

    def lrs_stop(self) -> LrsCounts:
        """Close every proxy's load reporting stream; the counts until then (:meth:`lrs_counts`)."""
        return self._lrs_sum(self._all("lrs_stop"))

    def lrs_counts(self) -> LrsCounts:
        """Load reporting so far, over all the workers: streams, reports sent, how streams ended."""
        return self._lrs_sum(self._all("lrs_counts"))

    @staticmethod
    def _lrs_sum(results: list[dict[str, Any]]) -> LrsCounts:
        total = LrsCounts()
        for counts in results:
            total.add(LrsCounts(**counts))
        return total

    def churn(
        self,
        *,
        count: int,
        rate: float,
        prefix: str = "churn",
        envoy_node: bool = False,
        sync_timeout: float = 30.0,
        max_active: int = 0,
        node_every_request: bool = False,
    ) -> None:
        """Start ``count`` more proxies, node ids ``{prefix}-N``, ``rate`` per second over all the
        workers, each leaving for good once synced (beside this fleet's steady proxies, which stay),
        at most ``max_active`` at once over all the workers (0: no limit), their node on every request
        (``node_every_request``, Envoy's default) or on a stream's first only; it runs in the
        background: :meth:`churned` says how far it got."""
        ids = [f"{prefix}-{n:06d}" for n in range(count)]
        shards = [ids[n :: self.workers] for n in range(self.workers)]
        self._all(
            "churn",
            per_worker=[
                {
                    "targets": [self.target, *self.replicas],
                    "ids": shard,
                    "rate": rate / self.workers,
                    "client": self.client,
                    "xds": self.xds,
                    "envoy_node": envoy_node,
                    "sync_timeout": sync_timeout,
                    "max_active": math.ceil(max_active / self.workers) if max_active else 0,
                    "node_every_request": node_every_request,
                }
                for shard in shards
            ],
        )

    def churned(self) -> ChurnCounts:
        """How far :meth:`churn` got, over all the workers."""
        total = ChurnCounts()
        for counts in self._all("churned"):
            for name, value in counts.items():
                setattr(total, name, getattr(total, name) + value)
        return total

    def close(self) -> None:
        for conn in self._conns:
            try:
                conn.send(("stop", {}))
            except (BrokenPipeError, OSError):
                continue
        for conn in self._conns:
            try:
                if conn.poll(20):
                    conn.recv()
            except (EOFError, OSError):
                pass
        for proc in self._procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()  # by its PID
                proc.wait(5)
        self._conns.clear()
        self._procs.clear()

    def __enter__(self) -> Fleet:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
