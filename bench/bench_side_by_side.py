"""This checkout beside another commit of pilotfish: fan-outs and snapshot builds, in turn.

Theory of operation
-------------------
The other commit is checked out into a temporary ``git worktree`` (:func:`bench.checkout.checkout`,
the one mechanism for a run beside a commit) and removed afterwards. ``rounds`` times, in turn
(the order of the two flips every round, so a drift in the machine's load falls on both alike):

- the snapshot build, in a child process per commit and size (:func:`bench.bench_build.rows_in_child`:
  each commit's own bench/bench_build.py on its own ``src``), each row the median of ``repeat``
  builds, with the child's CPU seconds (the whole child: imports and every build and rebuild of
  the row), which other work on the machine inflates less than wall times;
- for each xDS variant (``sotw``, ``delta``), one :func:`bench.fanout.run_fanout` per commit at
  each fleet size: the server ``python -m pilotfish serve`` of that commit (the other one with its
  ``src`` first on ``PYTHONPATH``), the same simulated fleet (bench/fleet/) and workload, one
  endpoint changed through the registry API ``changes`` times.

The other commit's ``serve`` must take the options this checkout's benchmarks pass
(:func:`bench.procs.start_pilotfish`); its bench_build must print ``--json`` rows. A row gives
each commit's median over the rounds, with the range (lowest-highest) beside the headline
numbers, and the ratio of this checkout's median to the other's; ``load 1 min`` is read before
each run (other work shares the machine's cores, and says so there).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.bench_build import rows_in_child
from bench.checkout import checkout, pythonpath_env, revision
from bench.fanout import FanoutOptions, FanoutResult, run_fanout, stream_error_notes, stream_errors_cell
from bench.fleet import XDS_VARIANTS
from bench.procs import REPO, work_dir
from bench.report import fmt_loads, fmt_ms, print_table
from bench.stats import load_1min, percentile, ratio, spread
from bench.workload import Workload

__all__ = ["BUILD_MEASURES", "FANOUT_COLUMNS", "SideBySide", "run_side_by_side"]

FANOUT_COLUMNS = [
    "pilotfish",
    "xds",
    "proxies",
    "runs",
    "load 1 min (each run)",
    "all synced s (median)",
    "p50 ms (median)",
    "p99 ms (median)",
    "p99 ms (range)",
    "p99 after publish ms (median)",
    "CPU s / push (median)",
    "CPU s / push (range)",
    "RSS KB / idle stream (median)",
    "failures",
    "stream errors",
    "p99 x",
    "CPU x",
]

BUILD_MEASURES = (
    "merge s",
    "build_snapshot s",
    "encode responses s",
    "total s",
    "rebuild after 1 change s",
    "Reconciler.update s",
    "Reconciler rebuild after 1 change s",
    "Reconciler rebuild, 1 service changed s",
)
"""The build's columns compared (bench/bench_build.py's names)."""

BUILD_COLUMNS = [
    "pilotfish",
    "clusters / endpoints",
    "runs",
    "load 1 min (each run)",
    "child CPU s (median, range)",
    *(f"{measure} (median, range)" for measure in BUILD_MEASURES),
]


@dataclass
class _FanoutRuns:
    label: str
    xds: str
    proxies: int
    results: list[FanoutResult] = field(default_factory=list)
    loads: list[float] = field(default_factory=list)

    def p99(self) -> float:
        return spread([r.p(99) for r in self.results])[0]

    def cpu(self) -> float:
        return spread([r.cpu for r in self.results])[0]

    def row(self, baseline: _FanoutRuns | None) -> list[Any]:
        p99s = [r.p(99) for r in self.results]
        cpus = [r.cpu for r in self.results]
        ratios = (
            ["-", "-"] if baseline is None else [ratio(self.p99(), baseline.p99()), ratio(self.cpu(), baseline.cpu())]
        )
        return [
            self.label,
            self.xds,
            self.proxies,
            len(self.results),
            fmt_loads(self.loads),
            round(spread([r.sync_seconds for r in self.results])[0], 2),
            fmt_ms(spread([r.p(50) for r in self.results])[0]),
            fmt_ms(spread(p99s)[0]),
            f"{fmt_ms(min(p99s))}-{fmt_ms(max(p99s))}",
            fmt_ms(spread([percentile(r.after_publish, 99) for r in self.results])[0]),
            round(spread(cpus)[0], 3),
            f"{min(cpus):.3f}-{max(cpus):.3f}",
            round(spread([r.rss_per_stream_kb for r in self.results])[0], 1),
            sum(r.failures for r in self.results),
            stream_errors_cell(self.results),
            *ratios,
        ]


@dataclass
class SideBySide:
    """What :func:`run_side_by_side` measured: the two tables, and notes on stream errors."""

    fanout_rows: list[list[Any]] = field(default_factory=list)
    build_rows: list[list[Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    fanouts: list[_FanoutRuns] = field(default_factory=list)


def _label(path: Path) -> str:
    head, dirty = revision(path)
    return head + (" with changes in src/" if dirty else "")


def run_side_by_side(
    *,
    commit: str,
    proxies: Sequence[int],
    xds: Sequence[str] = XDS_VARIANTS,
    rounds: int = 3,
    changes: int = 5,
    workload: Workload | None = None,
    build_sizes: Sequence[str] = (),
    build_repeat: int = 3,
    workdir: Path | None = None,
) -> SideBySide:
    """See the module docstring. ``build_sizes``: ``CLUSTERS:ENDPOINTS`` (none: no build rows)."""
    workload = workload or Workload()
    done = SideBySide()
    with contextlib.ExitStack() as stack:
        workdir = work_dir(stack, workdir, "pilotfish-side-by-side-")
        other = stack.enter_context(checkout(commit))
        labels = {"other": _label(other), "this": f"{_label(REPO)} (this checkout)"}
        envs = {"other": pythonpath_env(other), "this": None}
        paths = {"other": other, "this": REPO}
        fanouts = {
            (who, x, n): _FanoutRuns(labels[who], x, n) for x in xds for n in proxies for who in ("other", "this")
        }
        builds: dict[tuple[str, str], list[dict[str, Any]]] = {}
        build_loads: dict[tuple[str, str], list[float]] = {}
        build_cpu: dict[tuple[str, str], list[float]] = {}
        for round_ in range(rounds):
            order = ("other", "this") if round_ % 2 == 0 else ("this", "other")
            for who in order:
                for size in build_sizes:
                    load = load_1min()
                    (row,), cpu = rows_in_child(paths[who], [size], build_repeat)
                    builds.setdefault((who, size), []).append(row)
                    build_loads.setdefault((who, size), []).append(load)
                    build_cpu.setdefault((who, size), []).append(cpu)
                    print(
                        f"  build {labels[who]} {size} (round {round_ + 1}, load {load:.2f}): total s "
                        f"{row.get('total s')}, child CPU {cpu:.2f} s",
                        flush=True,
                    )
            for x in xds:
                for n in proxies:
                    for who in order:
                        runs = fanouts[(who, x, n)]
                        load = load_1min()
                        result = run_fanout(
                            FanoutOptions(
                                proxies=n,
                                changes=changes,
                                workload=workload,
                                quiet_ms=100,
                                change="registry",
                                xds=x,
                                server_env=envs[who],
                                workdir=workdir / f"{who}-{x}-{n}-{round_}",
                            )
                        )
                        runs.results.append(result)
                        runs.loads.append(load)
                        print(
                            f"  {labels[who]} {x} {n} proxies (round {round_ + 1}, load {load:.2f}): "
                            f"p99 {fmt_ms(result.p(99))} ms, CPU {result.cpu:.3f} s/push, "
                            f"failures {result.failures}",
                            flush=True,
                        )
        for x in xds:
            for n in proxies:
                base = fanouts[("other", x, n)]
                for who in ("other", "this"):
                    runs = fanouts[(who, x, n)]
                    done.fanout_rows.append(runs.row(None if who == "other" else base))
                    done.notes += stream_error_notes(f"{runs.label} {x}, {n} proxies", runs.results)
                    done.fanouts.append(runs)
        for size in build_sizes:
            medians: dict[str, list[float]] = {}
            for who in ("other", "this"):
                cells = []
                for values in (
                    build_cpu[(who, size)],
                    *(
                        [float(row[m]) for row in builds[(who, size)] if row.get(m) not in (None, "-")]
                        for m in BUILD_MEASURES
                    ),
                ):
                    median, low, high = spread(values)
                    medians.setdefault(who, []).append(median)
                    cells.append(f"{median:.4g} ({low:.4g}-{high:.4g})")
                done.build_rows.append(
                    [
                        labels[who],
                        size.replace(":", " / "),
                        len(builds[(who, size)]),
                        fmt_loads(build_loads[(who, size)]),
                        *cells,
                    ]
                )
            done.build_rows.append(
                [
                    "this / other",
                    size.replace(":", " / "),
                    "-",
                    "-",
                    *(ratio(a, b) for a, b in zip(medians["this"], medians["other"], strict=True)),
                ]
            )
    return done


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.bench_side_by_side", description=__doc__.split("\n\n")[0])
    parser.add_argument("--commit", required=True, help="the other pilotfish (a commit git knows)")
    parser.add_argument("--proxies", type=int, nargs="*", default=[1000], help="fleet sizes (default: %(default)s)")
    parser.add_argument(
        "--xds",
        nargs="*",
        choices=XDS_VARIANTS,
        default=list(XDS_VARIANTS),
        help="the proxies' xDS variants (default: %(default)s)",
    )
    parser.add_argument("--rounds", type=int, default=3, help="times both commits run in turn (default: %(default)s)")
    parser.add_argument("--changes", type=int, default=5, help="endpoint changes per fan-out (default: %(default)s)")
    parser.add_argument("--services", type=int, default=100)
    parser.add_argument("--endpoints", type=int, default=4)
    parser.add_argument("--listeners", type=int, default=10)
    parser.add_argument(
        "--build-sizes",
        nargs="*",
        default=["1000:10000", "10000:100000"],
        help="CLUSTERS:ENDPOINTS of the build rows (none: no build; default: %(default)s)",
    )
    parser.add_argument("--build-repeat", type=int, default=3, help="builds per row and run (default: %(default)s)")
    args = parser.parse_args(argv)
    workload = Workload(services=args.services, endpoints=args.endpoints, listeners=args.listeners)
    started = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    done = run_side_by_side(
        commit=args.commit,
        proxies=args.proxies,
        xds=args.xds,
        rounds=args.rounds,
        changes=args.changes,
        workload=workload,
        build_sizes=args.build_sizes,
        build_repeat=args.build_repeat,
    )
    print(f"\nworkload: {workload.describe()}; other = {args.commit}; started {started}, load now {load_1min():.2f}")
    if done.fanout_rows:
        print_table(FANOUT_COLUMNS, done.fanout_rows)
    if done.build_rows:
        print()
        print_table(BUILD_COLUMNS, done.build_rows)
    for note in done.notes:
        print(note)
    return 0 if all(row[FANOUT_COLUMNS.index("failures")] == 0 for row in done.fanout_rows) else 1


if __name__ == "__main__":
    os.chdir(REPO)
    sys.exit(main())
