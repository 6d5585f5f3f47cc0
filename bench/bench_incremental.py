"""What incremental xDS sends on a large snapshot: pilotfish over state of the world and over delta,
side by side in one run (the incremental xDS targets).

Theory of operation
-------------------
The snapshot is :class:`~bench.workload.Workload` at the incremental benchmark's size: 10,000 services x 10
endpoints (10,000 clusters, 100,000 endpoints), a few with an HTTP listener and route. Each row is
one :func:`bench.fanout.run_fanout`: start the server, connect N simulated proxies
(bench/fleet/) and wait until every one is synced, then change one endpoint through the
registry API ``changes`` times, each timed until every proxy ACKed the new EDS version. The rows:

- SotW: proxies on ``StreamAggregatedResources`` (EDS, RDS and SDS responses carry only what changed);
- delta: proxies on ``DeltaAggregatedResources``.

Every proxy subscribes to every cluster's endpoints, so every proxy receives each change. The
simulator counts the bytes of the response messages each proxy receives (gRPC message bodies,
without HTTP/2 framing): until all were synced (``KB / proxy, initial sync``), and per change
(after the server has gone quiet, minus before: mean and max over proxies and changes). The
server's event log is at ``changes`` level for every row (a line per request and response would
name 10,000 resources per proxy at the initial sync, which is logging, not xDS). The load average
is read before each row: the simulator shares the server's cores.

The row of pilotfish before incremental responses (commit de14338, every SotW EDS response full
state) is no longer run: that commit's ``serve`` has neither ``--max-connections-per-address``
nor ``--admin``, which every server of the benchmarks is started with now
(:func:`bench.procs.start_pilotfish`). Its numbers stand in BENCHMARKS.md as measured then.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.fanout import FanoutOptions, FanoutResult, run_fanout, stream_error_notes, stream_errors_cell
from bench.fleet import XDS_VARIANTS
from bench.procs import REPO, work_dir
from bench.report import fmt_ms
from bench.stats import load_1min, percentile
from bench.workload import Workload

__all__ = ["INCREMENTAL_COLUMNS", "LARGE_WORKLOAD", "VARIANTS", "run_incremental"]

RAMP_ABOVE = 2500
RAMP_RATE = 25.0
"""Fleets of more than :data:`RAMP_ABOVE` proxies connect at this many proxies per second per
client process (2,500 proxies each) instead of all at once: every proxy holds its initial
responses (~5 MB) until they are complete, and 10,000 of them at once in the simulator's four
processes outgrew this machine's 24 GiB (the server itself stayed under 1 GB)."""

LARGE_WORKLOAD = Workload(services=10000, endpoints=10, listeners=10)
"""The fleet-sized snapshot: 10,000 clusters, 100,000 endpoints."""

INCREMENTAL_COLUMNS = [
    "xds",
    "proxies",
    "load 1 min",
    "all synced s",
    "KB / proxy, initial sync",
    "bytes / proxy / change (mean)",
    "bytes / proxy / change (max)",
    "p50 ms",
    "p99 ms",
    "max ms",
    "p99 after publish ms",
    "CPU s / push",
    "simulator CPU s / push",
    "server RSS MB (synced)",
    "simulator RSS MB",
    "failures",
    "stream errors",
]


VARIANTS = XDS_VARIANTS
"""The rows at each fleet size: the proxies' xDS variants (``sotw``, ``delta``)."""


def row(result: FanoutResult, load: float) -> list[Any]:
    """The table's row for one run."""
    per_change = [b for change in result.change_bytes for b in change]
    sync = result.sync_bytes
    return [
        result.xds,
        result.proxies,
        f"{load:.2f}",
        round(result.sync_seconds, 2),
        round(sum(sync) / len(sync) / 1024, 1) if sync else "-",
        round(sum(per_change) / len(per_change)) if per_change else "-",
        max(per_change, default="-"),
        fmt_ms(result.p(50)),
        fmt_ms(result.p(99)),
        fmt_ms(max(result.latencies, default=float("nan"))),
        fmt_ms(percentile(result.after_publish, 99)),
        round(result.cpu, 3),
        round(sum(result.client_cpu_per_push) / max(1, len(result.client_cpu_per_push)), 3),
        round(result.rss_idle_kb / 1024),
        round(result.simulator_rss_kb / 1024),
        result.failures,
        stream_errors_cell([result]),
    ]


def notes(result: FanoutResult) -> list[str]:
    """One line per gRPC status the run's proxies saw: how many, how many during the changes, an example."""
    return stream_error_notes(f"{result.xds}, {result.proxies} proxies", [result])


def run_incremental(
    *,
    runs: Sequence[tuple[str, int]],
    changes: int,
    workload: Workload,
    workdir: Path | None = None,
    change_timeout: float = 120.0,
    ramp_above: int = RAMP_ABOVE,
    ramp_rate: float = RAMP_RATE,
) -> tuple[list[list[Any]], list[FanoutResult]]:
    """One row per (xDS variant, proxies) in ``runs``, in that order; and each run's result. Fleets
    larger than ``ramp_above`` connect at ``ramp_rate`` proxies per second per client process."""
    with contextlib.ExitStack() as stack:
        workdir = work_dir(stack, workdir, "pilotfish-incremental-")
        rows: list[list[Any]] = []
        results: list[FanoutResult] = []
        for xds, n in runs:
            load = load_1min()
            result = run_fanout(
                FanoutOptions(
                    proxies=n,
                    changes=changes,
                    workload=workload,
                    quiet_ms=100,
                    change="registry",
                    workdir=workdir / f"{xds}-{n}",
                    event_log_level="changes",
                    xds=xds,
                    change_timeout=change_timeout,
                    sync_timeout=max(300.0, n / 10),
                    rate=ramp_rate if n > ramp_above else 0.0,
                )
            )
            rows.append(row(result, load))
            results.append(result)
            per_change = [b for c in result.change_bytes for b in c]
            print(
                f"  {xds} {n} proxies (load {load:.2f}): synced in "
                f"{result.sync_seconds:.1f} s, p99 {fmt_ms(result.p(99))} ms, "
                f"{percentile([float(b) for b in per_change], 50)} B/proxy/change, failures {result.failures}",
                *notes(result),
                sep="\n    ",
                flush=True,
            )
        return rows, results


def main(argv: list[str] | None = None) -> int:
    import argparse

    from bench.report import print_table

    parser = argparse.ArgumentParser(prog="python -m bench.bench_incremental", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--proxies",
        type=int,
        nargs="*",
        default=[1000, 10000],
        help="fleet sizes, every variant at each (default: %(default)s)",
    )
    parser.add_argument("--changes", type=int, default=3)
    parser.add_argument("--services", type=int, default=LARGE_WORKLOAD.services)
    parser.add_argument("--endpoints", type=int, default=LARGE_WORKLOAD.endpoints)
    parser.add_argument("--listeners", type=int, default=LARGE_WORKLOAD.listeners)
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--workdir", type=Path, default=None, help="keep the servers' files here (default: a temp dir)")
    args = parser.parse_args(argv)
    workload = Workload(services=args.services, endpoints=args.endpoints, listeners=args.listeners)
    runs = [(xds, n) for n in args.proxies for xds in VARIANTS if xds in args.variants]
    started = time.strftime("%H:%M:%S")
    rows, results = run_incremental(runs=runs, changes=args.changes, workload=workload, workdir=args.workdir)
    print(f"\nworkload: {workload.describe()}; started {started}, load now {load_1min():.2f}")
    print_table(INCREMENTAL_COLUMNS, rows)
    for result in results:
        for line in notes(result):
            print(line)
    return 0 if all(r[INCREMENTAL_COLUMNS.index("failures")] == 0 for r in rows) else 1


if __name__ == "__main__":
    os.chdir(REPO)
    sys.exit(main())
