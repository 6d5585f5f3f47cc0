"""The Load Reporting Service (LRS): the proxies say how their traffic went.

Envoy (with ``cluster_manager.load_stats_config``, ``pilotfish bootstrap --lrs``) and proxyless
gRPC clients (clusters with ``lrs_server: self``) open one bidirectional stream,
``envoy.service.load_stats.v3.LoadReportingService/StreamLoadStats``, on the xDS port. Their
first ``LoadStatsRequest`` carries the node; the server answers with one ``LoadStatsResponse``
saying what to report and how often (:attr:`LrsSettings.interval`), and from then on the client
sends a report every interval: per cluster (and locality), the requests that succeeded, failed,
were issued and are in flight since its previous report. Each report goes to a
:class:`LoadSink` (the rollout's gates compare a wave's error ratio with the baseline's from
them); this module only speaks the protocol.

What to report: every cluster. A client that announces the client feature
:data:`SEND_ALL_FEATURE` (Envoy does) is told ``send_all_clusters``; one that does not (gRPC) is
given the names of the clusters its node group is served (``clusters_for``), which is the same
set.

A report is evidence that decides whether a change reaches the rest of the fleet, so who may
send it is checked like an ADS stream: with ``authorize`` (``--authorize-node``), a certificate
may report only as a node id it may claim, and a stream never changes its node id. Each report
is parsed (protobuf) before anything else is known of it, so its cost is bounded twice: in size
by the transport's message limit, and in rate here, per stream: a report that comes sooner than
a quarter of the interval after the last one taken is dropped unparsed (counted in
:attr:`LoadReporting.dropped`), so a client that floods reports costs a length check each.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import NoReturn, Protocol

from envoy.config.core.v3 import base_pb2
from envoy.service.load_stats.v3 import lrs_pb2
from google.protobuf.message import DecodeError

from pilotfish.errors import PeerError, shorten
from pilotfish.protocol import XdsLimits
from pilotfish.protocol.limits import kept_node
from pilotfish.transport.aio import Call, Handler, MethodFactory, RateLimitedLog, RpcError
from pilotfish.transport.frames import GrpcStatus

__all__ = ["LRS_METHOD", "SEND_ALL_FEATURE", "LoadReporting", "LoadSink", "LrsSettings"]

_log = logging.getLogger("pilotfish.lrs")

LRS_METHOD = "/envoy.service.load_stats.v3.LoadReportingService/StreamLoadStats"
SEND_ALL_FEATURE = "envoy.lrs.supports_send_all_clusters"
"""The client feature of a client that reports every cluster it has when told ``send_all_clusters``."""
_MESSAGE_CHARS = 300


@dataclass(frozen=True, slots=True, kw_only=True)
class LrsSettings:
    """How load is reported."""

    interval: float = 10.0
    """Seconds between a client's reports (``load_reporting_interval``; 0.1 to 3600, checked with
    the rest of the settings). Shorter: a rollout's bake sees more, finer windows, at the cost of a
    report per proxy per interval."""
    min_gap_share: float = 0.25
    """A report sooner than this share of :attr:`interval` after the last one taken on its
    stream is dropped unparsed."""


class LoadSink(Protocol):
    """Where reports go (the rollout's load store)."""

    def report(self, node_id: str, group: str, request: lrs_pb2.LoadStatsRequest) -> None:
        """One report of ``node_id``'s clusters (``request.cluster_stats``), as it arrived;
        ``group``: the node group its node belongs to (``group_of``)."""


class LoadReporting:
    """The LRS service: :meth:`methods` for the gRPC server."""

    def __init__(
        self,
        sink: LoadSink,
        *,
        settings: LrsSettings | None = None,
        authorize: Callable[[str, str], str | None] | None = None,
        limits: XdsLimits | None = None,
        clusters_for: Callable[[base_pb2.Node], Sequence[str]] = lambda _: (),
        group_of: Callable[[base_pb2.Node], str] = lambda _: "",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.sink = sink
        self.settings = settings or LrsSettings()
        self.authorize = authorize
        """(identity, node id) -> why the claim is refused, or None (see :mod:`pilotfish.policy.authorize`)."""
        self.limits = limits or XdsLimits()
        self.clusters_for = clusters_for
        """The names of the clusters a client that cannot be told "all" reports on."""
        self.group_of = group_of
        """The node group of a stream's node (the xDS server's: a rollout's waves may name groups)."""
        self.clock = clock
        self.open_streams = 0
        self.reports = 0
        """Reports taken (given to the sink)."""
        self.dropped = 0
        """Reports dropped unparsed: they came too soon after the last one of their stream."""
        self._warnings = RateLimitedLog(_log, what="such load reporting streams")

    def methods(self) -> Mapping[str, MethodFactory]:
        return {LRS_METHOD: self._open}

    def _open(self, call: Call) -> Handler:
        return _LoadStream(self, call)


class _LoadStream:
    """One client's stream of reports."""

    __slots__ = ("_call", "_last", "_server", "closed", "group", "node_id")

    def __init__(self, server: LoadReporting, call: Call) -> None:
        self._server = server
        self._call = call
        self.node_id: str | None = None
        self.group = ""
        self._last = 0.0
        self.closed = False
        server.open_streams += 1

    def on_message(self, data: bytes) -> None:
        server = self._server
        now = server.clock()
        if self.node_id is not None and now - self._last < server.settings.interval * server.settings.min_gap_share:
            server.dropped += 1
            return
        request = lrs_pb2.LoadStatsRequest()
        try:
            request.ParseFromString(data)
        except DecodeError as exc:
            self._refuse(GrpcStatus.INVALID_ARGUMENT, f"not a LoadStatsRequest: {exc}")
        if self.node_id is None:
            self._first(request)
        elif request.HasField("node") and request.node.id != self.node_id:
            self._refuse(
                GrpcStatus.INVALID_ARGUMENT,
                f"node.id {shorten(request.node.id, 100)!r} on a stream opened as "
                f"{shorten(self.node_id, 100)!r}: a load reporting stream reports for one node",
            )
        self._last = now
        if request.cluster_stats:
            server.reports += 1
            assert self.node_id is not None
            server.sink.report(self.node_id, self.group, request)

    def _first(self, request: lrs_pb2.LoadStatsRequest) -> None:
        """Who reports (the node, as the policy lets its certificate claim), and what it is to report."""
        server = self._server
        if not request.HasField("node") or not request.node.id:
            self._refuse(GrpcStatus.INVALID_ARGUMENT, "the first LoadStatsRequest of a stream must carry node.id")
        try:
            node = kept_node(request.node, server.limits)
        except PeerError as exc:
            self._refuse(GrpcStatus.INVALID_ARGUMENT, str(exc))
        if server.authorize is not None:
            refusal = server.authorize(self._call.peer_identity, node.id)
            if refusal is not None:
                self._refuse(GrpcStatus.PERMISSION_DENIED, refusal)
        self.node_id, self.group = node.id, str(server.group_of(node))
        response = lrs_pb2.LoadStatsResponse()
        response.load_reporting_interval.FromNanoseconds(round(server.settings.interval * 1e9))
        if SEND_ALL_FEATURE in request.node.client_features:
            response.send_all_clusters = True
        else:
            response.clusters.extend(server.clusters_for(node))
        self._call.send(response.SerializeToString())

    def _refuse(self, code: int, message: str) -> NoReturn:
        message = shorten(message, _MESSAGE_CHARS)
        self._server._warnings.log(
            "load reporting stream from %s (node %r) refused: %s",
            self._call.peer,
            shorten(self.node_id or "", 200),
            message,
        )
        self._end()
        raise RpcError(code, message)

    def on_half_close(self) -> None:
        self._end()
        self._call.finish()

    def on_closed(self, reason: str) -> None:
        self._end()

    def _end(self) -> None:
        if not self.closed:
            self.closed = True
            self._server.open_streams -= 1
