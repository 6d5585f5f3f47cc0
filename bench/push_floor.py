"""The floor of a push on pilotfish's own transport, beside pilotfish's fan-out, in turn.

What a push cannot cost less than, on this machine, with pilotfish's HTTP/2 and gRPC transport
(:class:`pilotfish.transport.aio.GrpcServer`) and the same simulated fleet (bench/fleet/) as
``bench.fanout``: the same number of connections, each an ADS stream (SotW or delta); per push,
one shared pre-encoded response (an EDS response carrying one ClusterLoadAssignment, as a
one-endpoint change does) written to every connection, and one ACK per connection read and
parsed (``DiscoveryRequest`` / ``DeltaDiscoveryRequest``). Nothing else: no snapshot, no build,
no watches, no state machine, no status, no event log lines per request. ``bench.grpc_floor``
is the same idea for grpc.aio.

Theory of operation
-------------------
The floor server (``--serve``) runs in its own process, on uvloop as ``pilotfish serve`` does.
It answers a stream's first CDS and LDS requests with empty responses (the simulated proxy is
then synced, subscribed to no EDS name) and ignores other requests but parses each; SIGUSR1
makes it push version ``k`` (the k-th push) to every stream. Its CPU seconds per push are read
from /proc as ``bench.fanout`` reads pilotfish's: before the push, and once the server has gone
quiet after every proxy ACKed it. ``rounds`` times, for each xDS variant, the floor and
pilotfish (:func:`bench.fanout.run_fanout`, one registry endpoint change per push, event log
level ``changes`` and ``all``) run in turn, the order flipped every round; a row gives the
median over the rounds of each run's mean CPU seconds per push, the range, and the ratio to
the floor, with the p99 of the ACKs (from the push to each proxy's ACK, pooled over a run's
pushes; the median over the rounds).

With ``--clusters N`` the floor serves N EDS clusters and every proxy subscribes to their N
endpoint names, so each SotW ACK repeats the N names (about 110 KB at 10,000), as on the
incremental benchmark's snapshot, which pilotfish then serves (N services of 10 endpoints). The
floor checks such an ACK the cheapest way a server can: one compare of its bytes with the ACK it
expects (the same for every proxy at one version), parsing it only when they differ.

    .venv/bin/python -m bench.push_floor --proxies 1000 --rounds 3 --pushes 10
    .venv/bin/python -m bench.push_floor --proxies 10000 --clusters 10000 --xds sotw --event-log-levels changes
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import math
import os
import signal
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from bench.bench_incremental import RAMP_ABOVE, RAMP_RATE
from bench.checkout import checkout, pythonpath_env
from bench.fanout import FanoutOptions, run_fanout
from bench.fleet import EDS, XDS_VARIANTS, Fleet, WaitResult
from bench.fleet.messages import CDS, LDS
from bench.procs import REPO, ServerProcess, work_dir
from bench.report import fmt_loads, fmt_ms, print_table
from bench.stats import load_1min, percentile, ratio, spread
from bench.workload import Workload

if TYPE_CHECKING:
    from pilotfish.transport.aio import Call

__all__ = ["COLUMNS", "FloorRun", "floor_response", "run_floor", "run_push_floor"]

_ADS = "/envoy.service.discovery.v3.AggregatedDiscoveryService/"


def floor_response(xds: str, version: str, endpoints: int) -> bytes:
    """The pushed message: an EDS response (SotW or delta) with one ClusterLoadAssignment of
    ``endpoints`` endpoints, as pilotfish sends for one endpoint changed in ``svc-00000``."""
    from envoy.config.endpoint.v3 import endpoint_pb2
    from envoy.service.discovery.v3 import discovery_pb2
    from google.protobuf import any_pb2

    assignment = endpoint_pb2.ClusterLoadAssignment(cluster_name="svc-00000")
    locality = assignment.endpoints.add()
    for n in range(endpoints):
        address = locality.lb_endpoints.add().endpoint.address.socket_address
        address.address, address.port_value = f"10.0.{n // 250}.{n % 250 + 1}", 8080
    packed = any_pb2.Any(type_url=EDS, value=assignment.SerializeToString())
    if xds == "delta":
        delta = discovery_pb2.DeltaDiscoveryResponse(system_version_info=version, type_url=EDS, nonce=version)
        delta.resources.add(name="svc-00000", version=version, resource=packed)
        return bytes(delta.SerializeToString())
    sotw = discovery_pb2.DiscoveryResponse(version_info=version, type_url=EDS, nonce=version, resources=[packed])
    return bytes(sotw.SerializeToString())


def _cluster_names(clusters: int) -> list[str]:
    return [f"svc-{n:05d}" for n in range(clusters)]


def _initial_responses(clusters: int) -> dict[str, dict[str, bytes]]:
    """Per xDS variant, the first response to CDS, LDS and EDS: version "0", with ``clusters``
    EDS clusters (their endpoints over ADS) and nothing else."""
    from envoy.config.cluster.v3 import cluster_pb2
    from envoy.service.discovery.v3 import discovery_pb2
    from google.protobuf import any_pb2

    packed = []
    for name in _cluster_names(clusters):
        cluster = cluster_pb2.Cluster(name=name, type=cluster_pb2.Cluster.EDS)
        cluster.eds_cluster_config.eds_config.ads.SetInParent()
        packed.append((name, any_pb2.Any(type_url=CDS, value=cluster.SerializeToString())))
    sotw, delta = {}, {}
    for t in (CDS, LDS, EDS):
        resources = packed if t == CDS else []
        sotw[t] = discovery_pb2.DiscoveryResponse(
            version_info="0", type_url=t, nonce="0", resources=[r for _, r in resources]
        ).SerializeToString()
        response = discovery_pb2.DeltaDiscoveryResponse(system_version_info="0", type_url=t, nonce="0")
        for name, resource in resources:
            response.resources.add(name=name, version="0", resource=resource)
        delta[t] = response.SerializeToString()
    return {"sotw": sotw, "delta": delta}


def expected_ack(version: str, clusters: int) -> bytes:
    """The SotW ACK of push ``version`` from a proxy subscribed to the ``clusters`` names (in the
    order a simulated proxy sends them)."""
    from envoy.service.discovery.v3 import discovery_pb2

    request = discovery_pb2.DiscoveryRequest(
        version_info=version, resource_names=_cluster_names(clusters), type_url=EDS, response_nonce=version
    )
    return bytes(request.SerializeToString())


REFRESH_TICK = 0.25
"""Seconds between two batches of the floor's refreshes (as pilotfish's heartbeat timer batches them)."""


class _Refresher:
    """Sends every stream the shared response once per ``period`` seconds, in batches every
    :data:`REFRESH_TICK`, stream after stream (the floor of heartbeats)."""

    def __init__(self, calls: dict[str, set[Call]], period: float, bodies: dict[str, bytes]) -> None:
        self.calls, self.period, self.bodies = calls, period, bodies
        self.turn = 0
        self.streams: list[tuple[Call, bytes]] = []

    def start(self) -> None:
        # The heap as pilotfish keeps it once the fleet is connected (app/parts.py, "gc"): what
        # exists frozen, the youngest generation collected every 50,000 allocations.
        gc.freeze()
        gc.set_threshold(50_000, 20, 100)
        self._tick(asyncio.get_running_loop().time())

    def _tick(self, at: float) -> None:
        if len(self.streams) != sum(map(len, self.calls.values())):  # (made anew when the fleet changed)
            self.streams = [(call, self.bodies[xds]) for xds, group in self.calls.items() for call in group]
        streams = self.streams
        for _ in range(math.ceil(len(streams) * REFRESH_TICK / self.period) if streams else 0):
            self.turn = (self.turn + 1) % len(streams)
            call, body = streams[self.turn]
            call.send(body)
        asyncio.get_running_loop().call_at(at + REFRESH_TICK, self._tick, at + REFRESH_TICK)


async def _serve(event_log: Path, endpoints: int, clusters: int, refresh: float = 0.0) -> None:
    """The floor server: see the module docstring (``refresh``: see :func:`run_refresh_floor`)."""
    import uvloop  # noqa: F401 (the loop is chosen by the caller: uvloop.run)
    from envoy.service.discovery.v3 import discovery_pb2

    from pilotfish.events import EventLog
    from pilotfish.transport.aio import ConnectionLimits, GrpcServer

    initial = _initial_responses(clusters)
    expected = b""  # the SotW ACK of the last push, with clusters (compared, not parsed)
    decoders = {
        "sotw": discovery_pb2.DiscoveryRequest.FromString,
        "delta": discovery_pb2.DeltaDiscoveryRequest.FromString,
    }
    calls: dict[str, set[Call]] = {"sotw": set(), "delta": set()}
    acks = 0

    class Stream:
        __slots__ = ("call", "decode", "first", "xds")

        def __init__(self, call: Call, xds: str) -> None:
            self.call, self.xds, self.decode = call, xds, decoders[xds]
            calls[xds].add(call)

        def on_message(self, data: bytes) -> None:
            nonlocal acks
            if data == expected:
                acks += 1
                return
            request = self.decode(data)  # every other request read and parsed
            if request.response_nonce:
                acks += 1
            elif request.type_url in (CDS, LDS, EDS):
                self.call.send(initial[self.xds][request.type_url])

        def on_half_close(self) -> None:
            calls[self.xds].discard(self.call)

        def on_closed(self, reason: str) -> None:
            calls[self.xds].discard(self.call)

    server = GrpcServer(
        {
            _ADS + "StreamAggregatedResources": lambda call: Stream(call, "sotw"),
            _ADS + "DeltaAggregatedResources": lambda call: Stream(call, "delta"),
        },
        # Every simulated proxy connects from 127.0.0.1: lift the per-address cap (4,096 by
        # default), as bench.procs does for pilotfish.
        connection_limits=ConnectionLimits(max_connections_per_address=1_000_000),
    )
    port = await server.start("127.0.0.1", 0)
    pushes = 0

    def push() -> None:
        nonlocal pushes, expected
        pushes += 1
        if clusters:
            expected = expected_ack(str(pushes), clusters)
        for xds, streams in calls.items():
            body = floor_response(xds, str(pushes), endpoints)  # encoded once per push
            for call in streams:
                call.send(body)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGUSR1, push)
    if refresh > 0:
        refresher = _Refresher(calls, refresh, {x: floor_response(x, "refresh", endpoints) for x in calls})
        loop.add_signal_handler(signal.SIGUSR2, refresher.start)
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    parent = os.getppid()

    def orphaned() -> None:  # the benchmark was killed (e.g. a test's timeout): do not outlive it
        if os.getppid() != parent:
            stop.set()
        else:
            loop.call_later(1.0, orphaned)

    orphaned()
    events = EventLog(event_log)
    events.emit("server_started", xds=f"127.0.0.1:{port}")
    events.flush()
    await stop.wait()
    await server.stop(0.5)


@dataclass
class FloorRun:
    """One floor run: CPU seconds of the floor server per push, and the bytes each proxy got."""

    xds: str
    proxies: int
    cpu_per_push: list[float] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)
    """Seconds from each push to each proxy's ACK of it, every push's."""
    bytes_per_push: float = 0.0
    failures: int = 0

    @property
    def cpu(self) -> float:
        return sum(self.cpu_per_push) / len(self.cpu_per_push) if self.cpu_per_push else float("nan")


def _rate(proxies: int) -> float:
    """Proxies started per second per client process: as the incremental benchmark ramps a large fleet."""
    return RAMP_RATE if proxies > RAMP_ABOVE else 0.0


def _floor_and_fleet(
    stack: contextlib.ExitStack, workdir: Path, args: Sequence[str], *, proxies: int, xds: str, sync_timeout: float
) -> tuple[ServerProcess, Fleet, WaitResult]:
    """The floor server (with ``args``) and a fleet of ``proxies`` connected to it, both stopped
    when ``stack`` closes; how the fleet synced."""
    event_log = workdir / "floor-events.jsonl"
    argv = [sys.executable, "-m", "bench.push_floor", "--serve", str(event_log), *args]
    server = ServerProcess(name="floor", argv=argv, workdir=workdir, event_log=event_log)
    server.start()
    stack.callback(server.stop)
    fleet = Fleet(target=server.xds, proxies=proxies, xds=xds, rate=_rate(proxies))
    fleet.start()
    stack.callback(fleet.close)
    return server, fleet, fleet.wait_synced(timeout=sync_timeout)


def run_floor(
    *,
    proxies: int,
    xds: str,
    pushes: int = 5,
    endpoints: int = 5,
    clusters: int = 0,
    workdir: Path | None = None,
    gap: float = 0.3,
) -> FloorRun:
    """One run of the floor server under a fleet of ``proxies`` (subscribed to ``clusters``
    endpoint names): ``pushes`` pushes, each timed until every proxy ACKed it."""
    run = FloorRun(xds=xds, proxies=proxies)
    with contextlib.ExitStack() as stack:
        server, fleet, synced = _floor_and_fleet(
            stack,
            work_dir(stack, workdir, "pilotfish-push-floor-"),
            ("--endpoints", str(endpoints), "--clusters", str(clusters)),
            proxies=proxies,
            xds=xds,
            sync_timeout=max(60.0, proxies / 10 if clusters else proxies / 100),
        )
        if synced.failures:
            run.failures = synced.failures
            return run
        server.settle_cpu(quiet=0.3, limit=5)
        received = sum(fleet.bytes_received())
        for k in range(1, pushes + 1):
            before = server.cpu_seconds()
            t0 = time.time()
            os.kill(server.pid, signal.SIGUSR1)
            acked = fleet.wait_acked({EDS: str(k)}, since=t0, timeout=60)
            run.cpu_per_push.append(server.settle_cpu() - before)
            run.latencies += acked.latencies(t0)
            run.failures = max(run.failures, acked.failures)
            time.sleep(gap)
        run.bytes_per_push = (sum(fleet.bytes_received()) - received) / pushes / proxies
    return run


REFRESH_COLUMNS = [
    "server",
    "xds",
    "proxies",
    "load 1 min",
    "period s",
    "refreshes / s",
    "received / s",
    "CPU % of a core",
    "CPU per refresh (us)",
]


def run_refresh_floor(
    *, proxies: int, xds: str, period: float, seconds: float = 40.0, workdir: Path | None = None
) -> list[object]:
    """The floor of heartbeats: the floor server sends every stream the shared response once per
    ``period`` seconds, in batches every :data:`REFRESH_TICK` (as pilotfish renews TTLs), and
    reads each ACK; its CPU over ``seconds`` once every proxy synced, as a share of a core and per
    refresh (the row of :data:`REFRESH_COLUMNS`)."""
    with contextlib.ExitStack() as stack:
        server, fleet, synced = _floor_and_fleet(
            stack,
            work_dir(stack, workdir, "pilotfish-refresh-floor-"),
            ("--refresh", str(period)),
            proxies=proxies,
            xds=xds,
            sync_timeout=max(60.0, proxies / 100),
        )
        if synced.failures:
            raise RuntimeError(f"refresh floor: {synced.failures} of {proxies} proxies never synced")
        server.settle_cpu(quiet=0.3, limit=5)
        load = load_1min()
        os.kill(server.pid, signal.SIGUSR2)
        time.sleep(min(period, 5.0))  # (the refreshes' ACKs flowing)
        before, received, t0 = server.cpu_seconds(), sum(fleet.bytes_received()), time.monotonic()
        time.sleep(seconds)
        cpu, elapsed = server.cpu_seconds() - before, time.monotonic() - t0
        received = sum(fleet.bytes_received()) - received
        rate = proxies / period
        return [
            "floor",
            xds,
            proxies,
            round(load, 2),
            period,
            round(rate),
            round(received / len(floor_response(xds, "refresh", 5)) / elapsed),
            round(100 * cpu / elapsed, 2),
            round(1e6 * cpu / (rate * elapsed), 1),
        ]


COLUMNS = [
    "server",
    "xds",
    "proxies",
    "runs",
    "load 1 min (each run)",
    "CPU s / push (median)",
    "CPU s / push (range)",
    "p99 ms (median)",
    "bytes / proxy / push",
    "x floor",
    "failures",
]


def run_push_floor(
    *,
    proxies: int,
    rounds: int = 3,
    pushes: int = 5,
    xds: Sequence[str] = XDS_VARIANTS,
    levels: Sequence[str] = ("changes", "all"),
    workdir: Path | None = None,
    before: str | None = None,
    clusters: int = 0,
) -> list[list[object]]:
    """The floor and pilotfish (at each event log level in ``levels``; and the commit ``before``,
    checked out beside this one, likewise) in turn, ``rounds`` times per xDS variant: the
    table's rows (:data:`COLUMNS`); see the module docstring."""
    workload = Workload(services=clusters, endpoints=10) if clusters else Workload()
    servers = ["floor", *(f"pilotfish ({level})" for level in levels)]
    if before is not None:
        servers += [f"{before} ({level})" for level in levels]
    cpus: dict[tuple[str, str], list[float]] = {}
    loads: dict[tuple[str, str], list[float]] = {}
    sizes: dict[tuple[str, str], list[float]] = {}
    p99s: dict[tuple[str, str], list[float]] = {}
    failures: dict[tuple[str, str], int] = {}
    with contextlib.ExitStack() as stack:
        workdir = work_dir(stack, workdir, "pilotfish-push-floor-")
        before_env = pythonpath_env(stack.enter_context(checkout(before))) if before is not None else None
        for round_ in range(rounds):
            order = servers if round_ % 2 == 0 else list(reversed(servers))
            for variant in xds:
                for who in order:
                    key, load = (who, variant), load_1min()
                    where = workdir / f"{who.split()[0]}-{variant}-{round_}-{len(cpus.get(key, []))}"
                    if who == "floor":
                        floor = run_floor(proxies=proxies, xds=variant, pushes=pushes, clusters=clusters, workdir=where)
                        cpu, size, failed = floor.cpu, floor.bytes_per_push, floor.failures
                        p99 = percentile(floor.latencies, 99)
                    else:
                        result = run_fanout(
                            FanoutOptions(
                                proxies=proxies,
                                changes=pushes,
                                workload=workload,
                                xds=variant,
                                event_log_level=who.split("(")[1].rstrip(")"),
                                workdir=where,
                                server_env=None if who.startswith("pilotfish") else before_env,
                                rate=_rate(proxies),
                                sync_timeout=max(60.0, proxies / 10) if clusters else None,
                            )
                        )
                        cpu, failed, p99 = result.cpu, result.failures, result.p(99)
                        size = sum(map(sum, result.change_bytes)) / max(1, len(result.change_bytes)) / proxies
                    cpus.setdefault(key, []).append(cpu)
                    loads.setdefault(key, []).append(load)
                    sizes.setdefault(key, []).append(size)
                    failures[key] = failures.get(key, 0) + failed
                    p99s.setdefault(key, []).append(p99)
                    print(
                        f"  {who} {variant} round {round_ + 1} (load {load:.2f}): CPU {cpu:.4f} s/push, "
                        f"p99 {fmt_ms(p99)} ms",
                        flush=True,
                    )
    rows: list[list[object]] = []
    for variant in xds:
        floor_cpu = spread(cpus[("floor", variant)])[0]
        for who in servers:
            key = (who, variant)
            median, low, high = spread(cpus[key])
            rows.append(
                [
                    who,
                    variant,
                    proxies,
                    len(cpus[key]),
                    fmt_loads(loads[key]),
                    round(median, 4),
                    f"{low:.4f}-{high:.4f}",
                    fmt_ms(spread(p99s[key])[0]),
                    round(spread(sizes[key])[0]),
                    "-" if who == "floor" else ratio(median, floor_cpu),
                    failures[key],
                ]
            )
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.push_floor", description=__doc__.split("\n\n")[0])
    parser.add_argument("--proxies", type=int, default=1000, help="simulated proxies (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=3, help="times each server runs, in turn (default: %(default)s)")
    parser.add_argument("--pushes", type=int, default=10, help="pushes (changes) per run (default: %(default)s)")
    parser.add_argument(
        "--xds", nargs="*", choices=XDS_VARIANTS, default=list(XDS_VARIANTS), help="variants (default: %(default)s)"
    )
    parser.add_argument(
        "--event-log-levels",
        nargs="*",
        choices=("changes", "all"),
        default=["changes", "all"],
        help="pilotfish's --event-log-level, one run per level (none: the floor alone; default: %(default)s)",
    )
    parser.add_argument("--workdir", type=Path, default=None, help="keep the servers' files here")
    parser.add_argument("--before", metavar="COMMIT", help="also run pilotfish at this commit, in turn with the others")
    parser.add_argument("--serve", type=Path, help=argparse.SUPPRESS)  # internal: the floor server, its event log
    parser.add_argument("--endpoints", type=int, default=5, help=argparse.SUPPRESS)
    parser.add_argument(
        "--refresh",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="instead: the floor of heartbeats, every stream sent the shared response once per SECONDS "
        "(pilotfish renews a 30 s TTL every 22.5-25 s), its CPU over --seconds",
    )
    parser.add_argument("--seconds", type=float, default=40.0, help="with --refresh: the window (default: %(default)s)")
    parser.add_argument(
        "--clusters",
        type=int,
        default=0,
        help="EDS clusters every proxy subscribes to (0: none, and pilotfish on the default workload)",
    )
    args = parser.parse_args(argv)
    if args.serve:
        import uvloop

        uvloop.run(_serve(args.serve, args.endpoints, args.clusters, args.refresh))
        return 0
    if args.refresh > 0:
        rows = [
            run_refresh_floor(proxies=args.proxies, xds=x, period=args.refresh, seconds=args.seconds) for x in args.xds
        ]
        print_table(REFRESH_COLUMNS, rows)
        return 0
    rows = run_push_floor(
        proxies=args.proxies,
        rounds=args.rounds,
        pushes=args.pushes,
        xds=args.xds,
        levels=args.event_log_levels,
        workdir=args.workdir,
        before=args.before,
        clusters=args.clusters,
    )
    workload = Workload(services=args.clusters, endpoints=10) if args.clusters else Workload()
    print(f"\nworkload (pilotfish): {workload.describe()}; load now {load_1min():.2f}")
    print_table(COLUMNS, rows)
    return 0 if all(row[-1] == 0 for row in rows) else 1


if __name__ == "__main__":
    os.chdir(REPO)
    sys.exit(main())
