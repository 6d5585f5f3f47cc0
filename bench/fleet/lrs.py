"""The simulated proxies' load reports: one Load Reporting Service (LRS) stream per proxy, as
Envoy keeps one with ``cluster_manager.load_stats_config`` (``pilotfish bootstrap --lrs``).

What a :class:`LoadReporter` does, as Envoy's ``LoadStatsReporter`` does:

1. it opens ``envoy.service.load_stats.v3.LoadReportingService/StreamLoadStats`` with a
   ``LoadStatsRequest`` carrying its proxy's node (with the client feature
   ``envoy.lrs.supports_send_all_clusters``) and no stats;
2. on the server's ``LoadStatsResponse`` it takes the reporting interval
   (``load_reporting_interval``) and what to report on (``send_all_clusters``, or the clusters
   named), and (re)starts its timer: a later response restarts it, as Envoy's does;
3. every interval it sends a report: for :attr:`~bench.fleet.messages.LrsLoad.clusters` of the
   clusters it has (its proxy's EDS clusters, from CDS; a cluster is named after its EDS service
   in the benchmarks' snapshots), one ``upstream_locality_stats`` each with the requests that
   succeeded, failed, were issued and are in progress since its last report
   (:class:`~bench.fleet.messages.LrsLoad` says how many), and ``load_report_interval``, the time
   since its last report. Each report carries the node again, as Envoy's do (its reporter keeps
   one request message, node set, and refills the stats);
4. when the stream breaks it reconnects after a jittered backoff (0.1 s doubling to 1 s).

Where it differs from Envoy, and why:

- the stream has a connection of its own (bench/h2client.py carries one call per connection);
  Envoy multiplexes it on its ``xds_cluster`` connection beside the ADS stream. So a reporting
  proxy costs the server two connections here;
- the first report comes after a random 0.3 to 1.3 intervals instead of exactly one: the
  simulated proxies open their streams within a second of each other, where a real fleet's
  Envoys started at different times. So the reports of a fleet arrive evenly over the interval
  from 0.3 interval on, not in one burst per interval. (A report is no sooner than 0.3 interval
  after the stream's first message: pilotfish drops unparsed those sooner than a quarter.)

Only the ``h2`` client carries load reports (:class:`~bench.fleet.worker` refuses them with
``grpc``). The reporter does no I/O of its own but through the call it is given; its counts are
read by the worker (``lrs_counts``).
"""

from __future__ import annotations

import asyncio
import random
import ssl
import time
from typing import TYPE_CHECKING, Any, Protocol

from bench.fleet.messages import EDS, LrsLoad

if TYPE_CHECKING:
    from bench.fleet.proxy import SotwProxy
    from bench.h2client import H2Call

__all__ = ["LRS_METHOD", "SEND_ALL_FEATURE", "LoadReporter", "ReporterHost"]

LRS_METHOD = "/envoy.service.load_stats.v3.LoadReportingService/StreamLoadStats"
SEND_ALL_FEATURE = "envoy.lrs.supports_send_all_clusters"
"""The client feature Envoy announces: told ``send_all_clusters``, it reports every cluster it has."""
FIRST_REPORT = (0.3, 1.3)
"""The first report of a stream comes after a random share of the interval in this range."""
BACKOFF_BASE = 0.1
BACKOFF_MAX = 1.0


class ReporterHost(Protocol):
    """What a reporter needs from the worker process it runs in."""

    error_details: dict[str, str]

    def on_lrs_answered(self, reporter: LoadReporter) -> None:
        """``reporter``'s stream has just been answered (waiters may be done)."""


class LoadReporter:
    """One proxy's load reporting stream, reconnecting until cancelled (see the module docstring)."""

    def __init__(self, proxy: SotwProxy, load: LrsLoad, host: ReporterHost) -> None:
        from envoy.config.core.v3 import base_pb2

        self.proxy = proxy
        self.load = load
        self.host = host
        node = base_pb2.Node()
        node.CopyFrom(proxy.node)
        node.client_features.append(SEND_ALL_FEATURE)
        self.node = node
        self.locality = base_pb2.Locality(region="bench", zone=f"zone-{proxy.index % 3}")
        self.answered = False
        """The current stream has the server's response."""
        self.streams = 0
        self.reports = 0
        self.report_bytes = 0
        self.errors: list[str] = []
        """How each stream ended (gRPC status name)."""
        self._interval = 0.0
        self._send_all = False
        self._named: tuple[str, ...] = ()
        self._last = 0.0
        self._timer: asyncio.TimerHandle | None = None
        self._call: H2Call | None = None

    # -- the conversation ----------------------------------------------------------------------

    def first_request(self) -> bytes:
        from envoy.service.load_stats.v3 import lrs_pb2

        message: Any = lrs_pb2.LoadStatsRequest(node=self.node)
        return bytes(message.SerializeToString())

    def on_response(self, data: bytes) -> None:
        """The server said what to report and how often: (re)start the timer."""
        from envoy.service.load_stats.v3 import lrs_pb2

        response: Any = lrs_pb2.LoadStatsResponse.FromString(data)
        duration = response.load_reporting_interval
        self._interval = max(0.001, duration.seconds + duration.nanos / 1e9)
        self._send_all = bool(response.send_all_clusters)
        self._named = tuple(response.clusters)
        now = time.monotonic()
        if not self.answered:
            self.answered = True
            self._last = now
            self._schedule(self._interval * random.uniform(*FIRST_REPORT))
            self.host.on_lrs_answered(self)
        else:
            self._schedule(self._interval)

    def clusters(self) -> list[str]:
        """The clusters this report covers: a few of those the proxy has (the ones the server named,
        if it named some), starting at the proxy's index so the fleet covers every cluster."""
        have = sorted(self.proxy.names.get(EDS) or ())
        if not self._send_all:
            named = set(self._named)
            have = [c for c in have if c in named]
        if not have:
            return []
        count = min(self.load.clusters, len(have))
        start = self.proxy.index % len(have)
        return [have[(start + k) % len(have)] for k in range(count)]

    def report(self, elapsed: float) -> bytes:
        """One report of the requests of the last ``elapsed`` seconds."""
        from envoy.service.load_stats.v3 import lrs_pb2

        message: Any = lrs_pb2.LoadStatsRequest(node=self.node)
        for name in self.clusters():
            total = round(self.load.rps * elapsed)
            errors = min(total, int(total * self.load.error_ratio + random.random()))
            stats = message.cluster_stats.add(cluster_name=name, cluster_service_name=name)
            stats.upstream_locality_stats.add(
                locality=self.locality,
                total_successful_requests=total - errors,
                total_error_requests=errors,
                total_issued_requests=total,
                total_requests_in_progress=random.randint(0, 2),
            )
            stats.load_report_interval.FromNanoseconds(round(elapsed * 1e9))
        return bytes(message.SerializeToString())

    def _schedule(self, delay: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = asyncio.get_running_loop().call_later(delay, self._tick)

    def _tick(self) -> None:
        self._timer = None
        call = self._call
        if call is None or call.done:
            return
        now = time.monotonic()
        data = self.report(now - self._last)
        self._last = now
        call.write(data)
        self.reports += 1
        self.report_bytes += len(data)
        self._schedule(self._interval)

    # -- the stream ----------------------------------------------------------------------------

    async def run(self, target: str, tls: ssl.SSLContext | None, server_hostname: str | None) -> None:
        """Stream after stream until cancelled, a jittered backoff between them."""
        host, _, port = target.rpartition(":")
        attempt = 0
        try:
            while True:
                self.streams += 1
                code, details = await self._converse(host, int(port), tls, server_hostname)
                self.errors.append(code)
                if details:
                    self.host.error_details.setdefault(f"LRS {code}", details[:300])
                if self.answered:
                    attempt = 0
                self.answered = False
                await asyncio.sleep(random.uniform(0, min(BACKOFF_MAX, BACKOFF_BASE * 2**attempt)))
                attempt += 1
        finally:
            self.answered = False
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

    async def _converse(
        self, host: str, port: int, tls: ssl.SSLContext | None, server_hostname: str | None
    ) -> tuple[str, str]:
        from bench.h2client import H2Channel, H2Error

        try:
            channel = await H2Channel.connect(host, port, tls=tls, server_hostname=server_hostname)
        except H2Error as exc:
            return exc.code, exc.details
        try:
            call = self._call = channel.call(LRS_METHOD, on_message=self.on_response)
            call.write(self.first_request())
            await call.wait_closed()
            return "CLOSED_BY_SERVER", ""
        except H2Error as exc:
            return exc.code, exc.details
        finally:
            self._call = None
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            channel.close()
