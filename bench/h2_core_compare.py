"""pilotfish's own HTTP/2 core against the `h2` package's, under the same adapter.

Theory of operation. The question: does pilotfish's transport stay its own sans-IO code
(:class:`pilotfish.transport.h2.Connection`) or sit on python-hyper's ``h2`` state machine
(:class:`bench.h2_package_core.H2PackageConnection`, the same interface, with what the package
lacks added on top)? Both run inside the same ``GrpcServer`` and the same ``pilotfish serve``
(bench/h2_core_launch.py), so the only difference between the two servers is the core.

Two measures, side by side:

- **Fan-out** (bench/fanout.py): one endpoint change through the registry API to N connected
  simulated proxies (1,000 by default), ``changes`` times; server CPU seconds per push, p50/p99 of
  the proxies' ACKs, RSS per idle stream, failures. The machine is shared (2 cores, other work),
  so the cores are run interleaved (own, h2, own, h2, ...), each run with the load average at its
  start, and every run is reported, not only the best.
- **Abuse** (tests/abuse, the attacks the transport is hardened against, against a real ``pilotfish serve``): run once
  per core (``PILOTFISH_ABUSE_CORE``); for each attack, whether it held, with the server's CPU
  seconds and peak memory growth.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.fanout import FanoutOptions, FanoutResult, run_fanout, stream_errors_cell
from bench.h2_core_launch import CORES
from bench.procs import REPO
from bench.report import fmt_ms, markdown_table
from bench.stats import load_1min, percentile
from bench.workload import Workload

__all__ = [
    "ABUSE_COLUMNS",
    "FANOUT_COLUMNS",
    "SUMMARY_COLUMNS",
    "Comparison",
    "CoreRun",
    "compare",
    "notes",
    "run_abuse",
    "run_compare",
]

FANOUT_COLUMNS = [
    "core",
    "round",
    "load avg (1 min) at start",
    "proxies",
    "CPU s / push",
    "p50 ms",
    "p99 ms",
    "RSS KB / idle stream",
    "failures",
    "stream errors",
]
SUMMARY_COLUMNS = [
    "core",
    "runs",
    "CPU s / push (mean of runs)",
    "CPU s / push (best run)",
    "p50 ms (pooled)",
    "p99 ms (pooled)",
    "RSS KB / idle stream",
    "failures",
    "attacks held",
]
ABUSE_COLUMNS = [
    "attack (tests/abuse)",
    "own: held",
    "own: CPU s",
    "own: peak RSS MiB",
    "h2: held",
    "h2: CPU s",
    "h2: peak RSS MiB",
]


@dataclass
class CoreRun:
    core: str
    round: int
    load: float
    result: FanoutResult

    def row(self) -> list[Any]:
        r = self.result
        return [
            self.core,
            self.round,
            round(self.load, 2),
            r.proxies,
            round(r.cpu, 3),
            fmt_ms(r.p(50)),
            fmt_ms(r.p(99)),
            round(r.rss_per_stream_kb, 1),
            r.failures,
            stream_errors_cell([r]),
        ]


@dataclass
class Comparison:
    runs: list[CoreRun] = field(default_factory=list)
    abuse: dict[str, dict[str, dict[str, Any]]] = field(default_factory=dict)
    """core -> test -> its line of the abuse report (``held``, ``cpu_s``, ``peak_rss_growth_mib``...)."""

    def of(self, core: str) -> list[CoreRun]:
        return [run for run in self.runs if run.core == core]

    def cpu(self, core: str) -> float:
        runs = self.of(core)
        return sum(run.result.cpu for run in runs) / len(runs) if runs else float("nan")

    def summary(self) -> list[list[Any]]:
        rows = []
        for core in CORES:
            runs = self.of(core)
            if not runs:
                continue
            latencies = [x for run in runs for x in run.result.latencies]
            held = self.abuse.get(core, {})
            rows.append(
                [
                    core,
                    len(runs),
                    round(self.cpu(core), 3),
                    round(min(run.result.cpu for run in runs), 3),
                    fmt_ms(percentile(latencies, 50)),
                    fmt_ms(percentile(latencies, 99)),
                    round(sum(run.result.rss_per_stream_kb for run in runs) / len(runs), 1),
                    sum(run.result.failures for run in runs),
                    f"{sum(1 for t in held.values() if t['held'])} / {len(held)}" if held else "-",
                ]
            )
        return rows

    def abuse_rows(self) -> list[list[Any]]:
        tests = sorted({name for per_core in self.abuse.values() for name in per_core})
        rows = []
        for name in tests:
            row: list[Any] = [name]
            for core in CORES:
                line = self.abuse.get(core, {}).get(name)
                if line is None:
                    row += ["-", "-", "-"]
                else:
                    row += [
                        "yes" if line["held"] else "**no**: " + "; ".join(line.get("problems", []))[:160],
                        line.get("cpu_s", "-"),
                        line.get("peak_rss_growth_mib", "-"),
                    ]
            rows.append(row)
        return rows


def run_compare(
    *,
    proxies: int = 1000,
    changes: int = 5,
    rounds: int = 2,
    workload: Workload,
    event_log_level: str = "changes",
    quiet_ms: int = 100,
) -> list[CoreRun]:
    """``rounds`` fan-outs per core, interleaved (own, h2, own, h2, ...)."""
    runs = []
    for round_ in range(1, rounds + 1):
        for core in CORES:
            load = load_1min()
            result = run_fanout(
                FanoutOptions(
                    proxies=proxies,
                    changes=changes,
                    workload=workload,
                    quiet_ms=quiet_ms,
                    change="registry",
                    event_log_level=event_log_level,
                    core=core,
                )
            )
            runs.append(CoreRun(core, round_, load, result))
            print(
                f"core {core} round {round_}: load {load:.2f}, CPU s / push {result.cpu:.3f}, "
                f"p99 {fmt_ms(result.p(99))} ms, failures {result.failures}",
                flush=True,
            )
    return runs


def run_abuse(core: str, *, select: str = "", timeout: float = 900.0) -> dict[str, dict[str, Any]]:
    """Run tests/abuse against a server on ``core``; each test's line of the abuse report."""
    with tempfile.TemporaryDirectory(prefix="pilotfish-abuse-") as tmp:
        report = Path(tmp) / f"abuse-{core}.jsonl"
        env = dict(os.environ, PILOTFISH_ABUSE_CORE=core, PILOTFISH_ABUSE_REPORT=str(report))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO / "src"), str(REPO), env.get("PYTHONPATH")) if p)
        argv = [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "--basetemp",
            str(Path(tmp) / "t"),
            "tests/abuse",
        ]
        if select:
            argv += ["-k", select]
        done = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
        lines = report.read_text().splitlines() if report.exists() else []
        if not lines:
            raise RuntimeError(f"the abuse suite on the {core} core reported nothing:\n{done.stdout[-3000:]}")
        tests = {}
        for line in lines:
            record = json.loads(line)
            tests[record.pop("test")] = record
        return tests


def compare(
    *,
    proxies: int = 1000,
    changes: int = 5,
    rounds: int = 2,
    workload: Workload,
    event_log_level: str = "changes",
    abuse: str = "all",
) -> Comparison:
    """The fan-outs (interleaved) and, unless ``abuse`` is ``none``, the abuse suite on each core
    (``all``, or a pytest ``-k`` expression)."""
    comparison = Comparison()
    comparison.runs = run_compare(
        proxies=proxies, changes=changes, rounds=rounds, workload=workload, event_log_level=event_log_level
    )
    if abuse != "none":
        for core in CORES:
            comparison.abuse[core] = run_abuse(core, select="" if abuse == "all" else abuse)
    return comparison


def notes(comparison: Comparison) -> list[str]:
    """The tables behind the summary: every fan-out run, every attack, and the CPU ratio."""
    own, h2 = comparison.cpu("own"), comparison.cpu("h2")
    lines = [
        "Every fan-out run, in the order run:",
        "",
        markdown_table(FANOUT_COLUMNS, [r.row() for r in comparison.runs]),
        "",
    ]
    if comparison.abuse:
        lines += [
            "The abuse suite (tests/abuse) against each core:",
            "",
            markdown_table(ABUSE_COLUMNS, comparison.abuse_rows()),
            "",
        ]
    if own == own and h2 == h2 and own:
        lines.append(f"h2 / own server CPU per push (mean of runs): **{h2 / own:.2f}x**.")
    return lines


def main() -> int:
    import argparse

    from bench.report import print_table

    parser = argparse.ArgumentParser(prog="python -m bench.h2_core_compare", description=__doc__.split("\n\n")[0])
    parser.add_argument("--proxies", type=int, default=1000)
    parser.add_argument("--changes", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2, help="fan-outs per core, interleaved (default: %(default)s)")
    parser.add_argument("--services", type=int, default=100)
    parser.add_argument("--endpoints", type=int, default=4)
    parser.add_argument("--listeners", type=int, default=10)
    parser.add_argument(
        "--event-log-level",
        choices=("all", "changes"),
        default="changes",
        help="the servers' --event-log-level (default: %(default)s: the transport's share of a push "
        "is not diluted by a line per request and response)",
    )
    parser.add_argument("--abuse", default="all", help="'all', 'none', or a pytest -k expression of tests/abuse")
    args = parser.parse_args()
    workload = Workload(services=args.services, endpoints=args.endpoints, listeners=args.listeners)
    comparison = compare(
        proxies=args.proxies,
        changes=args.changes,
        rounds=args.rounds,
        workload=workload,
        event_log_level=args.event_log_level,
        abuse=args.abuse,
    )
    print(f"\nworkload: {workload.describe()}")
    print("\n".join(notes(comparison)))
    print_table(SUMMARY_COLUMNS, comparison.summary())
    return 0


if __name__ == "__main__":
    os.chdir(REPO)
    sys.exit(main())
