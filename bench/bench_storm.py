"""Reconnect storm: N proxies connecting at once, cold and after a control-plane restart.

1. **cold**: N proxies with no state connect at once to a running server; each must get CDS, EDS,
   LDS and RDS and ACK them ("synced"). Time from the first connect to the last proxy synced.
2. **restart**: with all N synced, the server is stopped (SIGTERM), the snapshot file changes
   while it is down (one more service with a listener, so every type's version changes), and a new
   server starts on the same port. Every proxy reconnects (jittered backoff 0.1-1 s, like Envoy
   with pilotfish's bootstrap) carrying its last versions, and must be sent and ACK the new
   version of all four types. Time from the new server's ``server_started`` to the last ACK.

"failures" = proxies that never synced within the timeout. "streams broken by the server" = streams
the server's event log shows closing while the fleet still ran (refused, cancelled, errored).
"client stream errors" = streams the proxies opened after the server was up that failed. With the
default client (bench/h2client.py, a new connection per stream) there are normally none: a stream
opened while the server was down fails to connect (UNAVAILABLE) before ``up``. With ``--client
grpc`` a restart leaves some UNAVAILABLE from a channel still in its reconnect backoff (gRPC fails
a call at once in that state, carrying the old server's last message), which the proxy retries, as
Envoy does.
"""

from __future__ import annotations

import argparse
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from bench.fleet import BY_SHORT, CLIENTS, Fleet, WaitResult
from bench.procs import EventTail, ServerProcess, free_port, start_pilotfish, work_dir
from bench.stats import percentile
from bench.workload import Workload

__all__ = ["STORM_COLUMNS", "run_storm"]

STORM_COLUMNS = [
    "phase",
    "proxies",
    "all synced s",
    "p50 s",
    "p99 s",
    "failures",
    "streams broken by the server",
    "client stream errors (server up)",
    "server CPU s",
    "server RSS MB",
]


def _broken_streams(event_log: Path) -> int:
    """Streams the server saw end while the fleet was still running."""
    return len(EventTail(event_log).read(b'"event":"stream_closed"'))


def _errors_text(errors: dict[str, int]) -> str:
    total = sum(errors.values())
    return "0" if not total else f"{total} {errors}"


def run_storm(
    *,
    proxies: int,
    workload: Workload,
    workers: int = 0,
    timeout: float = 120.0,
    workdir: str | Path | None = None,
    client: str = "h2",
) -> tuple[list[list[Any]], dict[str, str]]:
    """Both phases; table rows and one example message per stream error status. ``client``: the
    simulated proxies' gRPC client (:data:`bench.fleet.CLIENTS`)."""
    rows: list[list[Any]] = []
    with ExitStack() as stack:
        workdir = work_dir(stack, workdir, "pilotfish-storm-")
        snapshot = workdir / "snapshot.json"
        workload.write(snapshot)
        port = free_port()
        first = start_pilotfish(workdir, snapshot=snapshot, xds_port=port, registry=False, name="pilotfish-a")
        stack.callback(first.stop)
        cpu0 = first.cpu_seconds()
        fleet = Fleet(target=f"127.0.0.1:{port}", proxies=proxies, workers=workers, client=client)
        started = time.time()
        fleet.start()
        stack.callback(fleet.close)
        cold = fleet.wait_synced(timeout=timeout)
        rows.append(_row("cold connect", cold, started, first, cpu0, fleet))

        first.stop()
        workload.write(snapshot, extra_services=1)
        second = start_pilotfish(workdir, snapshot=snapshot, xds_port=port, registry=False, name="pilotfish-b")
        stack.callback(second.stop)
        up = float(second.started["ts"])
        loaded = EventTail(second.event_log).wait_for("snapshot_loaded", timeout=10)
        versions = {BY_SHORT[short]: v for short, v in loaded["versions"].items() if short in BY_SHORT}
        cpu1 = second.cpu_seconds()
        restart = fleet.wait_acked(versions, since=up - 5, timeout=timeout)
        rows.append(_row("restart (all 4 types changed)", restart, up, second, cpu1, fleet))
        return rows, dict(fleet.error_examples)


def _row(
    phase: str, result: WaitResult, since: float, server: ServerProcess, cpu_before: float, fleet: Fleet
) -> list[Any]:
    """One table row: a phase's sync times from ``since``, and what it cost ``server``."""
    lat = result.latencies(since)
    return [
        phase,
        fleet.proxies,
        round(max(lat, default=float("nan")), 2),
        round(percentile(lat, 50), 2),
        round(percentile(lat, 99), 2),
        result.failures,
        _broken_streams(server.event_log),
        _errors_text(fleet.errors(since=since)),
        round(server.cpu_seconds() - cpu_before, 2),
        round(server.rss_kb() / 1024),
    ]


def main(argv: list[str] | None = None) -> int:
    from bench.report import print_table

    parser = argparse.ArgumentParser(prog="python -m bench.bench_storm", description=__doc__.split("\n\n")[0])
    parser.add_argument("--proxies", type=int, default=10000)
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--services", type=int, default=100)
    parser.add_argument("--endpoints", type=int, default=4)
    parser.add_argument("--listeners", type=int, default=10)
    parser.add_argument("--timeout", type=float, default=120.0)
    parser.add_argument(
        "--client",
        choices=CLIENTS,
        default="h2",
        help="the simulated proxies' gRPC client: bench/h2client.py or grpc.aio (default: %(default)s)",
    )
    args = parser.parse_args(argv)
    workload = Workload(services=args.services, endpoints=args.endpoints, listeners=args.listeners)
    rows, examples = run_storm(
        proxies=args.proxies, workload=workload, workers=args.workers, timeout=args.timeout, client=args.client
    )
    print(f"workload: {workload.describe()}; client: {args.client}")
    print_table(STORM_COLUMNS, rows)
    for code, example in examples.items():
        print(f"  e.g. {code}: {example}")
    return 0 if all(r[5] == 0 and r[6] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
