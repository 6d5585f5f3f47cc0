"""The fleet simulator: N simulated Envoy proxies, each with its own ADS stream, against a control
plane running in another process.

Theory of operation
-------------------
Each simulated proxy owns a TCP connection (as each Envoy has) and one ``StreamAggregatedResources``
stream on it, and talks like Envoy does:

1. it opens the stream with a wildcard CDS request carrying its node (only on the first message,
   as with ``set_node_on_first_message_only``);
2. on a CDS response it subscribes to EDS for the EDS clusters it got, then ACKs the CDS response,
   then (the first time) requests LDS; on an LDS response it subscribes to RDS for the route names
   in the listeners' HTTP connection managers (``rds.route_config_name``) and ACKs; EDS and RDS
   responses are ACKed (``version_info`` + ``response_nonce`` of the response);
3. when the stream breaks it reconnects after a jittered exponential backoff (0.1 s doubling to
   1 s, Envoy's ``retry_back_off`` in pilotfish's bootstrap) and re-sends every subscription with
   the last version it ACKed, as Envoy does.

With ``xds="delta"`` (``--xds delta``) each proxy speaks incremental xDS instead
(``DeltaAggregatedResources``, :class:`~bench.fleet.proxy.DeltaProxy`): wildcard CDS and LDS, EDS and RDS names
subscribed and unsubscribed as its clusters and listeners change, name -> version kept per type
(responses carry only changes and removals), ``initial_resource_versions`` on reconnect. A
worker's proxies share their holdings (:class:`~bench.fleet.proxy.DeltaHoldings`), as the server shares what its
streams are known to have. Every proxy counts the bytes of the response messages it receives
(``Fleet.bytes_received``), either variant.

The conversation (:meth:`~bench.fleet.proxy.SotwProxy.open_stream`,
:meth:`~bench.fleet.proxy.SotwProxy.on_response`) does no I/O; one of two clients carries it (``--client``):

- ``h2`` (default): bench/h2client.py, a thin asyncio adapter around pilotfish's own sans-IO
  HTTP/2 connection (:mod:`pilotfish.transport.h2`, client role: the server's code). Each
  response is decoded and answered inside the connection's data callback; each stream gets a new
  connection, as Envoy makes one per reconnect. It costs about a third of grpc.aio's CPU per push,
  so the simulator (on the server's cores) distorts the measurement less.
- ``grpc``: a grpc.aio channel per proxy (one subchannel each), which reconnects by itself.

With :class:`FleetTls` the proxies connect over TLS (ALPN ``h2``), trusting a CA file, and for
mTLS present a client certificate; each worker builds its TLS context once, from the files.

Each ACK's send time (``time.time()``, just after the write was handed to the client) is recorded per
type and version, so the coordinator can ask "when had every proxy ACKed EDS version V?" after a
change it made at time t0. Clocks are epoch seconds so they compare with the server's event log.

Load reports (:mod:`~bench.fleet.lrs`, :meth:`Fleet.lrs_start`): each proxy may also keep a Load
Reporting Service stream open, as Envoy with ``load_stats_config`` does: a ``LoadStatsRequest``
with its node first, then, per the server's ``LoadStatsResponse`` (``send_all_clusters``,
``load_reporting_interval``), a report every interval of a few of its clusters' request counts
(:class:`LrsLoad`). :meth:`Fleet.lrs_stop` closes those streams; :meth:`Fleet.lrs_counts` says
how many reports went out.

One Python process cannot drive 10,000 streams quickly, so proxies are sharded over worker
processes (``python -m bench.fleet.worker FD``, one socketpair each). The coordinator
(:class:`Fleet`, synchronous) sends each worker a command over its socket and gathers the
answers; workers never poll their proxies, they are told by each ACK (a waiter counts
down).

Modules: :mod:`~bench.fleet.proxy` (the simulated proxies' conversations, SotW and delta),
:mod:`~bench.fleet.lrs` (their load reporting streams),
:mod:`~bench.fleet.worker` (a worker process), :mod:`~bench.fleet.coordinator` (:class:`Fleet`),
:mod:`~bench.fleet.messages` (what crosses between them). This package is a library: the
command line that runs one fan-out with it is ``python -m bench.fanout``.
"""

from bench.fleet.coordinator import Fleet, WaitResult
from bench.fleet.messages import (
    BY_SHORT,
    CDS,
    CLIENTS,
    EDS,
    LDS,
    MAX_PER_WORKER,
    RDS,
    SHORT,
    XDS_VARIANTS,
    ChurnCounts,
    FleetError,
    FleetTls,
    LrsCounts,
    LrsLoad,
)
from bench.fleet.proxy import envoy_like_node

__all__ = [
    "BY_SHORT",
    "CDS",
    "CLIENTS",
    "EDS",
    "LDS",
    "MAX_PER_WORKER",
    "RDS",
    "SHORT",
    "XDS_VARIANTS",
    "ChurnCounts",
    "Fleet",
    "FleetError",
    "FleetTls",
    "LrsCounts",
    "LrsLoad",
    "WaitResult",
    "envoy_like_node",
]
