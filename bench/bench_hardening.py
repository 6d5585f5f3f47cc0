"""What TLS and mTLS cost on the hardened transport: pilotfish plaintext, TLS and mTLS, side by
side in one run (the hardening targets).

Theory of operation
-------------------
The simulated fleet (bench/fleet/) is the same for every row, so rows differ only in how the
proxies connect to this checkout's pilotfish:

- plaintext;
- TLS (``--tls-cert/--tls-key``; the proxies verify the server against a test CA);
- mTLS (``--client-ca`` too; each proxy presents a client certificate).

Certificates come from a throwaway CA (:mod:`bench.tls_certs`) in a temporary directory. Each row is one
:func:`bench.fanout.run_fanout` (registry change, event log ``all``), with the load average read
before it; ``--rounds`` repeats the variants in turn and pools each variant's results (latencies
pooled, CPU averaged; RSS per idle stream is the lowest run's, each run's in brackets, since noise
in RSS only adds), which evens out a machine whose load drifts. ``all synced s`` is the slowest
run's time from starting every proxy at once to the last one synced, TLS handshakes included. The
ratio columns compare TLS and mTLS with plaintext; with ``--before COMMIT``, TLS and mTLS also run
on that commit's server (:mod:`bench.checkout`) and this checkout's are compared with those.

The comparison with pilotfish before the hardening (commit b4fb69c, the hardening's cost in
plaintext) is no longer run: that commit's ``serve`` has neither ``--max-connections-per-address``
nor ``--admin``, which every server of the benchmarks is started with now
(:func:`bench.procs.start_pilotfish`). Its numbers stand in BENCHMARKS.md as measured then.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from bench.checkout import checkout, pythonpath_env
from bench.fanout import FanoutOptions, FanoutResult, run_fanout, stream_error_notes, stream_errors_cell
from bench.procs import REPO, work_dir
from bench.report import fmt_loads, fmt_ms
from bench.stats import load_1min, percentile, ratio
from bench.tls_certs import make_certs
from bench.workload import Workload

__all__ = ["HARDENING_COLUMNS", "VARIANTS", "Variant", "run_hardening"]

HARDENING_COLUMNS = [
    "server",
    "transport",
    "proxies",
    "runs",
    "load 1 min",
    "all synced s",
    "p50 ms",
    "p99 ms",
    "CPU s / push",
    "simulator CPU s / push",
    "RSS KB / idle stream",
    "failures",
    "stream errors",
    "compared with",
    "p99 x",
    "CPU x",
    "RSS x",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class Variant:
    """One way of connecting to the server."""

    transport: str
    """``plaintext``, ``TLS`` or ``mTLS``."""
    mode: str
    """The transport as :data:`bench.tls_certs.TLS_MODES` names it."""
    baseline: str | None
    """The transport this row's ratios compare with; None: none."""
    server: str = "now"
    """``now`` (this checkout) or ``before`` (``--before COMMIT``, run from a checkout of it)."""

    @property
    def key(self) -> str:
        return f"{self.server} {self.transport}"


VARIANTS = (
    Variant(transport="plaintext", mode="off", baseline=None),
    Variant(transport="TLS", mode="tls", baseline="plaintext"),
    Variant(transport="mTLS", mode="mtls", baseline="plaintext"),
)


@dataclass
class _Pooled:
    """One variant's runs at one fleet size."""

    variant: Variant
    proxies: int
    runs: list[FanoutResult] = field(default_factory=list)
    loads: list[float] = field(default_factory=list)

    def latencies(self) -> list[float]:
        return [x for r in self.runs for x in r.latencies]

    def p(self, q: float) -> float:
        return percentile(self.latencies(), q)

    def cpu(self) -> float:
        values = [x for r in self.runs for x in r.cpu_per_push]
        return sum(values) / len(values) if values else float("nan")

    def client_cpu(self) -> float:
        values = [x for r in self.runs for x in r.client_cpu_per_push]
        return sum(values) / len(values) if values else float("nan")

    def rss(self) -> float:
        """The lowest run's: noise in RSS only adds (a burst's memory the allocator has not
        returned yet when it is read)."""
        return min((r.rss_per_stream_kb for r in self.runs if r.rss_per_stream_kb), default=float("nan"))

    def rss_cell(self) -> str:
        values = [f"{r.rss_per_stream_kb:.1f}" for r in self.runs]
        return values[0] if len(values) == 1 else f"{self.rss():.1f} ({' / '.join(values)})"

    def notes(self) -> list[str]:
        """One line per gRPC status the proxies saw, with an example and how many came during the changes."""
        return stream_error_notes(f"{self.variant.key}, {self.proxies} proxies", self.runs)

    def row(self, baseline: _Pooled | None) -> list[Any]:
        ratios: list[Any] = ["-", "-", "-", "-"]
        if baseline is not None:
            ratios = [
                baseline.variant.key,
                ratio(self.p(99), baseline.p(99)),
                ratio(self.cpu(), baseline.cpu()),
                ratio(self.rss(), baseline.rss()),
            ]
        return [
            self.variant.server,
            self.variant.transport,
            self.proxies,
            len(self.runs),
            fmt_loads(self.loads),
            round(max(r.sync_seconds for r in self.runs), 2),
            fmt_ms(self.p(50)),
            fmt_ms(self.p(99)),
            round(self.cpu(), 3),
            round(self.client_cpu(), 3),
            self.rss_cell(),
            sum(r.failures for r in self.runs),
            stream_errors_cell(self.runs),
            *ratios,
        ]


def run_hardening(
    *,
    proxies: Sequence[int],
    changes: int,
    workload: Workload,
    rounds: int = 1,
    workdir: Path | None = None,
    variants: Sequence[Variant] = VARIANTS,
    before: str | None = None,
) -> tuple[list[list[Any]], list[str]]:
    """The table (see the module docstring): one row per variant and fleet size, its runs pooled;
    and notes on the stream errors the proxies saw. ``before``: the encrypted variants also run
    on that commit's server, and this checkout's are compared with those."""
    with contextlib.ExitStack() as stack:
        workdir = work_dir(stack, workdir, "pilotfish-hardening-")
        certs = make_certs(Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="pilotfish-certs-"))))
        envs: dict[str, Mapping[str, str] | None] = {"now": None}
        if before is not None:
            envs["before"] = pythonpath_env(stack.enter_context(checkout(before)))
            variants = [
                *(replace(v, server="before") for v in variants if v.mode != "off"),
                *(replace(v, baseline=f"before {v.transport}") if v.mode != "off" else v for v in variants),
            ]
        rows: list[list[Any]] = []
        notes: list[str] = []
        for n in proxies:
            pooled = {v.key: _Pooled(v, n) for v in variants}
            for round_ in range(rounds):
                for variant in variants:
                    key = variant.key
                    load = load_1min()
                    result = run_fanout(
                        FanoutOptions(
                            proxies=n,
                            changes=changes,
                            workload=workload,
                            quiet_ms=100,
                            change="registry",
                            workdir=workdir / f"{variant.server}-{variant.transport}-{n}-{round_}",
                            server_env=envs[variant.server],
                            server_args=certs.server_args(variant.mode),
                            tls=certs.fleet(variant.mode),
                        )
                    )
                    pooled[key].runs.append(result)
                    pooled[key].loads.append(load)
                    print(
                        f"  {variant.key} {n} proxies (round {round_ + 1}, load {load:.2f}): "
                        f"p99 {fmt_ms(result.p(99))} ms, CPU {result.cpu:.3f} s/push, "
                        f"{result.rss_per_stream_kb:.1f} KB/stream, failures {result.failures}",
                        flush=True,
                    )
            for variant in variants:
                base = None
                if variant.baseline is not None:
                    base = pooled.get(variant.baseline) or pooled.get(f"now {variant.baseline}")
                rows.append(pooled[variant.key].row(base))
                notes += pooled[variant.key].notes()
        return rows, notes


def main(argv: list[str] | None = None) -> int:
    import argparse

    from bench.report import print_table

    parser = argparse.ArgumentParser(prog="python -m bench.bench_hardening", description=__doc__.split("\n\n")[0])
    parser.add_argument("--proxies", type=int, nargs="+", default=[1000, 10000])
    parser.add_argument("--changes", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=1, help="run the three variants in turn this many times")
    parser.add_argument("--services", type=int, default=100)
    parser.add_argument("--endpoints", type=int, default=4)
    parser.add_argument("--listeners", type=int, default=10)
    names = [v.mode for v in VARIANTS]
    parser.add_argument(
        "--variants", nargs="+", choices=names, default=names, help="which rows to measure (default: all)"
    )
    parser.add_argument(
        "--before",
        metavar="COMMIT",
        help="also run TLS and mTLS on this commit's server; compare this checkout's with them",
    )
    args = parser.parse_args(argv)
    workload = Workload(services=args.services, endpoints=args.endpoints, listeners=args.listeners)
    started = time.strftime("%H:%M:%S")
    rows, notes = run_hardening(
        proxies=args.proxies,
        changes=args.changes,
        workload=workload,
        rounds=args.rounds,
        variants=[v for v in VARIANTS if v.mode in args.variants],
        before=args.before,
    )
    print(f"\nworkload: {workload.describe()}; started {started}, load now {load_1min():.2f}")
    print_table(HARDENING_COLUMNS, rows)
    for note in notes:
        print(note)
    return 0 if all(row[HARDENING_COLUMNS.index("failures")] == 0 for row in rows) else 1


if __name__ == "__main__":
    os.chdir(REPO)
    sys.exit(main())
