"""Replicas on etcd: one registry write to 3,000 proxies on one replica vs three, and write rates.

Two measurements, reported side by side (nothing is asserted):

1. **Fan-out over replicas.** The fan-out of bench/fanout.py (one instance registered or
   deregistered through the registry API, timed until every simulated proxy has ACKed the new EDS
   version) with the same N proxies served by

   - ``etcd x1``: one ``pilotfish serve --etcd`` (the registry stores the write in etcd, the
     replica sees it through its watch);
   - ``etcd x3``: three replicas on the same etcd, the proxies spread evenly (N/3 each), the write
     made through the first replica's API, every replica pushing from its own watch;
   - ``memory x1``: one replica with the in-memory registry (no etcd): the baseline.

   Each run starts its own etcd (fresh data dir, free ports) and its own replicas. Variants run in
   turn, round after round (etcd x1, etcd x3, memory x1, etcd x1, ...), so a load on the machine
   (it is shared) falls on each alike; each run records the 1-minute load average before it. CPU:
   utime + stime of every replica per write, until all are idle again, summed, and divided by the
   replicas (``per replica``); etcd's own CPU per write apart.

2. **Registry write rate.** One replica, no proxies, the same snapshot file; ``--clients``
   concurrent HTTP clients (aiohttp, keep-alive, in this process) register ``--count`` distinct
   instances (``POST /v1/services/svc-NNNNN/instances``, spread over the services) as fast as it
   answers. Registrations per second = count / (last answer - first request); latency per
   request (p50, p99, max); the replica's and etcd's CPU per registration. In-memory vs on etcd.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.fanout import FanoutOptions, FanoutResult, run_fanout
from bench.procs import REPO, EtcdProcess, start_etcd, start_pilotfish
from bench.report import fmt_ms, print_table
from bench.stats import load_1min, percentile, ratio
from bench.workload import Workload, service_name

__all__ = [
    "FANOUT_VARIANTS",
    "REPLICA_COLUMNS",
    "WRITE_COLUMNS",
    "FanoutRun",
    "WriteRate",
    "run_replica_fanouts",
    "run_write_rate",
    "run_write_rates",
]

REPLICA_COLUMNS = [
    "registry",
    "replicas",
    "proxies (each)",
    "run",
    "load 1 min",
    "all synced s",
    "indices in etcd s",
    "stream errors while syncing",
    "never synced",
    "p50 ms",
    "p99 ms",
    "max ms",
    "p99 after publish ms",
    "p99 of each write ms",
    "p99 vs etcd x1",
    "CPU s / replica / write",
    "CPU s / write (all replicas)",
    "etcd CPU s / write",
    "simulator CPU s / write",
    "failures",
    "stream errors during writes",
]
WRITE_COLUMNS = [
    "registry",
    "clients",
    "registrations",
    "load 1 min",
    "seconds",
    "writes / s",
    "p50 ms",
    "p99 ms",
    "max ms",
    "server CPU ms / write",
    "etcd CPU ms / write",
    "non-2xx",
]

FANOUT_VARIANTS: tuple[tuple[str, int], ...] = (("etcd", 1), ("etcd", 3), ("memory", 1))
"""(registry, replicas) of the fan-out comparison, in the order each round runs them."""


@dataclass
class FanoutRun:
    registry: str
    """``etcd`` or ``memory``."""
    replicas: int
    round: int
    load: float
    """The 1-minute load average just before the run."""
    result: FanoutResult


def _mean(values: Sequence[float]) -> float:
    return statistics.fmean(values) if values else float("nan")


def _fanout_row(
    registry: str,
    replicas: int,
    proxies: int,
    label: str,
    loads: Sequence[float],
    results: Sequence[FanoutResult],
    base_p99: float,
) -> list[Any]:
    latencies = [x for r in results for x in r.latencies]
    after = [x for r in results for x in r.after_publish]
    cpu = [c for r in results for c in r.cpu_per_push]
    etcd = [c for r in results for c in r.etcd_cpu_per_push]
    sim = [c for r in results for c in r.client_cpu_per_push]
    p99 = percentile(latencies, 99)
    sync_errors = sum(sum(r.stream_errors.values()) - sum(r.errors_during_changes.values()) for r in results)
    during = sum(sum(r.errors_during_changes.values()) for r in results)
    indexed = [r.indexed_seconds for r in results if r.indexed_seconds is not None]
    return [
        registry,
        replicas,
        proxies // replicas,
        label,
        " / ".join(f"{x:.1f}" for x in loads),
        round(max(r.sync_seconds for r in results), 2),
        round(max(indexed), 2) if len(indexed) == len(results) and registry == "etcd" else "-",
        sync_errors,
        sum(r.never_synced for r in results),
        fmt_ms(percentile(latencies, 50)),
        fmt_ms(p99),
        fmt_ms(max(latencies, default=float("nan"))),
        fmt_ms(percentile(after, 99)),
        " / ".join(fmt_ms(x) for x in results[0].change_p99) if len(results) == 1 else "-",
        ratio(p99, base_p99, suffix="x") if base_p99 == base_p99 else "-",
        round(_mean(cpu) / replicas, 3),
        round(_mean(cpu), 3),
        round(_mean(etcd), 3) if etcd else "-",
        round(_mean(sim), 3),
        sum(r.failures for r in results),
        during,
    ]


def run_replica_fanouts(
    *,
    proxies: int,
    writes: int,
    rounds: int,
    workload: Workload,
    workdir: Path,
    variants: Sequence[tuple[str, int]] = FANOUT_VARIANTS,
    quiet_ms: int = 100,
    sync_timeout: float = 20.0,
    on_run: Callable[[FanoutRun], None] | None = None,
) -> tuple[list[list[Any]], list[FanoutRun]]:
    """Every variant ``rounds`` times, interleaved; rows of :data:`REPLICA_COLUMNS`: each run, then
    each variant pooled over its runs. Proxies not synced within ``sync_timeout`` seconds (on etcd:
    twice, before and after etcd holds every proxy's index) are left out of the writes and counted
    as failures of each."""
    runs: list[FanoutRun] = []
    for round_ in range(rounds):
        for registry, replicas in variants:
            with ExitStack() as stack:
                where = workdir / f"{registry}-x{replicas}-{round_ + 1}"
                where.mkdir(parents=True, exist_ok=True)
                etcd: EtcdProcess | None = None
                if registry == "etcd":
                    etcd = start_etcd(where)
                    stack.callback(etcd.stop)
                load = load_1min()
                result = run_fanout(
                    FanoutOptions(
                        proxies=proxies,
                        changes=writes,
                        workload=workload,
                        quiet_ms=quiet_ms,
                        change="registry",
                        event_log_level="changes",
                        workdir=where,
                        etcd=etcd,
                        replicas=replicas,
                        keep_going=True,
                        sync_timeout=sync_timeout,
                    )
                )
            run = FanoutRun(registry, replicas, round_ + 1, load, result)
            runs.append(run)
            if on_run is not None:
                on_run(run)
    rows: list[list[Any]] = []

    def base(rs: Sequence[FanoutRun]) -> float:
        return percentile([x for r in rs if (r.registry, r.replicas) == ("etcd", 1) for x in r.result.latencies], 99)

    for run in runs:
        same_round = [r for r in runs if r.round == run.round]
        rows.append(
            _fanout_row(run.registry, run.replicas, proxies, str(run.round), [run.load], [run.result], base(same_round))
        )
    if rounds > 1:
        for registry, replicas in variants:
            mine = [r for r in runs if (r.registry, r.replicas) == (registry, replicas)]
            rows.append(
                _fanout_row(
                    registry, replicas, proxies, "all", [r.load for r in mine], [r.result for r in mine], base(runs)
                )
            )
    return rows, runs


@dataclass
class WriteRate:
    registry: str
    clients: int
    count: int
    load: float
    seconds: float = 0.0
    latencies: list[float] = field(default_factory=list)
    server_cpu: float = 0.0
    etcd_cpu: float | None = None
    failed: dict[int, int] = field(default_factory=dict)
    """Answers other than 2xx, by status (0: no answer)."""
    example: str = ""
    """One failed answer's body."""

    @property
    def rate(self) -> float:
        return self.count / self.seconds if self.seconds else float("nan")

    def row(self) -> list[Any]:
        return [
            self.registry,
            self.clients,
            self.count,
            round(self.load, 1),
            round(self.seconds, 2),
            round(self.rate),
            fmt_ms(percentile(self.latencies, 50)),
            fmt_ms(percentile(self.latencies, 99)),
            fmt_ms(max(self.latencies, default=float("nan"))),
            round(self.server_cpu / self.count * 1000, 2),
            "-" if self.etcd_cpu is None else round(self.etcd_cpu / self.count * 1000, 2),
            sum(self.failed.values()) if not self.failed else f"{sum(self.failed.values())} {self.failed}",
        ]


async def _register_all(base: str, *, count: int, clients: int, services: int, out: WriteRate) -> None:
    import aiohttp  # only this benchmark's client needs it

    next_index = iter(range(count))

    async def client(session: aiohttp.ClientSession) -> None:
        for i in next_index:
            # A distinct address per registration: 10.254.0.0/16 (the workload uses 10.0-?.x.y:8000+).
            body = {"address": f"10.254.{(i >> 8) & 255}.{i & 255}", "port": 9000 + (i >> 16)}
            started = time.perf_counter()
            try:
                async with session.post(
                    f"{base}/v1/services/{service_name(i % services)}/instances", json=body
                ) as answer:
                    text = await answer.text()
                    status = answer.status
            except aiohttp.ClientError as exc:
                status, text = 0, f"{type(exc).__name__}: {exc}"
            out.latencies.append(time.perf_counter() - started)
            if not 200 <= status < 300:
                out.failed[status] = out.failed.get(status, 0) + 1
                out.example = out.example or text[:300]

    connector = aiohttp.TCPConnector(limit=clients)
    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        await asyncio.gather(*(client(session) for _ in range(clients)))


def run_write_rate(*, registry: str, count: int, clients: int, workload: Workload, workdir: Path) -> WriteRate:
    """One replica (``registry``: ``memory`` or ``etcd``), ``count`` registrations from ``clients``
    concurrent clients; see the module docstring."""
    workdir.mkdir(parents=True, exist_ok=True)
    with ExitStack() as stack:
        etcd: EtcdProcess | None = None
        if registry == "etcd":
            etcd = start_etcd(workdir)
            stack.callback(etcd.stop)
        snapshot = workdir / "snapshot.json"
        workload.write(snapshot)
        server = start_pilotfish(
            workdir,
            snapshot=snapshot,
            extra=("--event-log-level", "changes", *(("--etcd", etcd.address) if etcd else ())),
        )
        stack.callback(server.stop)
        server.settle_cpu(quiet=0.3, limit=5)
        out = WriteRate(registry, clients, count, load_1min())
        cpu_before = server.cpu_seconds()
        etcd_before = etcd.cpu_seconds() if etcd is not None else 0.0
        started = time.perf_counter()
        asyncio.run(
            _register_all(
                f"http://{server.registry}", count=count, clients=clients, services=workload.services, out=out
            )
        )
        out.seconds = time.perf_counter() - started
        # CPU until the writes' builds and pushes are done too.
        out.server_cpu = server.settle_cpu(quiet=0.3, limit=10) - cpu_before
        if etcd is not None:
            out.etcd_cpu = etcd.cpu_seconds() - etcd_before
    return out


def run_write_rates(
    *,
    count: int,
    clients: int,
    workload: Workload,
    workdir: Path,
    rounds: int = 1,
    on_run: Callable[[WriteRate], None] | None = None,
) -> list[WriteRate]:
    """In-memory and etcd in turn, ``rounds`` times."""
    done = []
    for round_ in range(rounds):
        for registry in ("memory", "etcd"):
            done.append(
                run_write_rate(
                    registry=registry,
                    count=count,
                    clients=clients,
                    workload=workload,
                    workdir=workdir / f"writes-{registry}-{round_ + 1}",
                )
            )
            if on_run is not None:
                on_run(done[-1])
    return done


def notes(*, proxies: int, workload: Workload, clients: int, count: int) -> list[str]:
    return [
        f"Fan-out: {proxies:,} simulated proxies (bench/fleet/, SotW, h2 client) on {workload.describe()}, served "
        f"by one replica or by three ({proxies // 3:,} each, spread evenly); a write registers or deregisters one "
        "instance of `svc-00000` through the first replica's `POST/DELETE /v1/services/svc-00000/instances`; t0 is "
        "just before the HTTP call, so the 100 ms quiet period is included; latencies of every proxy over every "
        "write pooled (`p99 of each write`: each write's own, in order). `p99 after publish`: from when the "
        "first replica began its push (its `snapshot_loaded` "
        "minus `push_ms`). `CPU s / write (all replicas)`: every replica's utime+stime per write until all are "
        "idle, summed; `per replica`: that / replicas. `etcd CPU s / write`: etcd's. Event log "
        "`--event-log-level changes`. Each run has its own etcd and replicas; the variants are interleaved and "
        "`load 1 min` is the load average before each (the 2 cores are shared with other work). `p99 vs etcd x1`: "
        "against the etcd x1 run of the same round (`all`: of all rounds). `stream errors while syncing`: streams "
        "the replicas ended while the fleet connected (on etcd, replicas that both gave a new proxy the same "
        "lowest free subsetting index end the loser's stream: `its subsetting index moved; reconnect`). "
        "`indices in etcd s`: from the fleet's start until etcd held every proxy's subsetting index (one "
        "transaction per proxy, written by the replica it connected to); the writes begin after that. "
        "`never synced`: proxies that had not ACKed CDS, EDS, LDS and RDS 20 s after that; the writes are "
        "timed for the others, and each write counts them in `failures`.",
        f"Write rate: one replica, no proxies, {clients} concurrent clients (aiohttp keep-alive connections, one "
        f"process on the same cores) register {count:,} distinct instances over the {workload.services} services "
        "of the snapshot file, as fast as the replica answers. `writes / s` = registrations / (last answer - first "
        "request); latency per request; CPU per registration of the replica (until idle, builds and pushes "
        "included) and of etcd. On etcd a write is answered once etcd has it and this replica's watch has seen "
        'its revision (README, "Registrations in etcd").',
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.bench_replicas", description=__doc__.split("\n\n")[0])
    parser.add_argument("--proxies", type=int, default=3000)
    parser.add_argument("--writes", type=int, default=5, help="registry writes per fan-out run")
    parser.add_argument("--rounds", type=int, default=2, help="times each fan-out variant runs (interleaved)")
    parser.add_argument(
        "--variants",
        nargs="+",
        default=[f"{r}:{n}" for r, n in FANOUT_VARIANTS],
        help="REGISTRY:REPLICAS fan-out variants, each round in this order (default: %(default)s)",
    )
    parser.add_argument("--count", type=int, default=2000, help="registrations per write-rate run")
    parser.add_argument("--clients", type=int, default=16, help="concurrent HTTP clients of the write-rate runs")
    parser.add_argument("--write-rounds", type=int, default=1)
    parser.add_argument("--services", type=int, default=100)
    parser.add_argument("--endpoints", type=int, default=4)
    parser.add_argument("--listeners", type=int, default=10)
    parser.add_argument("--skip-fanout", action="store_true")
    parser.add_argument("--skip-writes", action="store_true")
    args = parser.parse_args(argv)
    workload = Workload(services=args.services, endpoints=args.endpoints, listeners=args.listeners)
    variants = []
    for variant in args.variants:
        registry, _, replicas = variant.partition(":")
        if registry not in ("etcd", "memory") or not replicas.isdigit() or (registry == "memory" and replicas != "1"):
            parser.error(f"--variants {variant!r}: etcd:N or memory:1")
        variants.append((registry, int(replicas)))
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="pilotfish-bench-replicas-") as tmp:
        if not args.skip_fanout:

            def show_run(run: FanoutRun) -> None:
                r = run.result
                print(
                    f"  {run.registry} x{run.replicas} round {run.round} (load {run.load:.2f}): synced "
                    f"{r.sync_seconds:.1f} s, indices in etcd {r.indexed_seconds} s, p99 {fmt_ms(r.p(99))} ms, "
                    f"CPU {r.cpu:.3f} s / write, failures {r.failures}, errors {r.stream_errors} "
                    f"{r.error_examples}",
                    flush=True,
                )

            rows, _ = run_replica_fanouts(
                proxies=args.proxies,
                writes=args.writes,
                rounds=args.rounds,
                workload=workload,
                workdir=Path(tmp),
                variants=variants,
                on_run=show_run,
            )
            print_table(REPLICA_COLUMNS, rows)
        if not args.skip_writes:
            rates = run_write_rates(
                count=args.count,
                clients=args.clients,
                workload=workload,
                workdir=Path(tmp),
                rounds=args.write_rounds,
                on_run=lambda w: print_table(WRITE_COLUMNS, [w.row()]),
            )
            print_table(WRITE_COLUMNS, [w.row() for w in rates])
            for w in rates:
                if w.example:
                    print(f"{w.registry}: e.g. {w.example}")
    for note in notes(proxies=args.proxies, workload=workload, clients=args.clients, count=args.count):
        print(note)
    print(f"\n{time.monotonic() - started:.0f} s; load now {load_1min():.2f}")
    return 0


if __name__ == "__main__":
    os.chdir(REPO)
    sys.exit(main())
