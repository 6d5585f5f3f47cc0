"""What an open status page costs the fan-out: pilotfish with the admin API on, and with a page
polling it, side by side in one run; and the admin API's answers with a large fleet connected
(the status tracking targets).

Theory of operation
-------------------
Every row is one :func:`bench.fanout.run_fanout` (registry change of one endpoint, event log
``all``, as the fan-out table of BENCHMARKS.md): start the server, connect N simulated proxies
(bench/fleet/), wait until each is synced, then change one endpoint ``changes`` times, each timed
until every proxy ACKed it. The variants:

- ``on``: this checkout with the admin API on (a free port on 127.0.0.1), nobody asking it;
- ``page open``: the same while a client asks what one open status page asks: ``/v1/fleet``
  (100 rows), ``/v1/snapshots`` and ``/v1/events`` together, then again 1.5 s after the answers (the
  page's rate), for as long as the changes run. Only at the fleet sizes in ``poll_proxies``.

The variants run in turn (on, [page open]) ``rounds`` times per fleet size, so load from other
work on the machine falls on each alike; the load average is read before each run and shown. A
row gives each variant's median over its runs of the run's p99 (all proxies' latencies over the
run's changes) and of its mean server CPU seconds per push, with the range over runs; the ratio
columns divide the medians by ``on``'s.

After the changes of every ``on`` run at a size in ``admin_proxies`` (every proxy connected and
synced), each admin endpoint is asked ``requests`` times in turn: wall time per request (client
side, urllib over loopback), the server's CPU for it (utime + stime, the server idle otherwise)
and the response's size; the table pools the requests over the runs. ``/v1/fleet``'s ``states``
confirms every proxy counts as ``SYNCED`` when they are asked.

The comparison with pilotfish before the status work (commit 24bc0c1: no admin API, metrics or
status bookkeeping) is no longer run: that commit's ``serve`` has no ``--admin``, which every
server of the benchmarks is started with now (:func:`bench.procs.start_pilotfish`). Its numbers
stand in BENCHMARKS.md as measured then.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import statistics
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.fanout import FanoutOptions, FanoutResult, run_fanout, stream_error_notes, stream_errors_cell
from bench.procs import REPO, ServerProcess, work_dir
from bench.report import fmt_loads, fmt_ms
from bench.stats import load_1min, percentile, ratio
from bench.workload import Workload

__all__ = [
    "ADMIN_COLUMNS",
    "ENDPOINTS",
    "PAGE_EVERY",
    "STATUS_COLUMNS",
    "VARIANTS",
    "AdminTimings",
    "StatusVariant",
    "run_status",
]

PAGE_EVERY = 1.5
"""Seconds between the status page's polls (``EVERY_MS`` in src/pilotfish/api/status_page.html)."""

PAGE_PATHS = ("/v1/fleet?limit=100&q=", "/v1/snapshots", "/v1/events?limit=100&after=0")
"""What one poll of the status page asks, together (the events: the latest 100 every time, where the
page asks only for those after the last it saw once it has some)."""

ENDPOINTS = ("/v1/proxies", "/v1/fleet?limit=100", "/v1/snapshots", "/v1/events?limit=100", "/metrics")
"""The admin endpoints timed with every proxy connected."""

STATUS_COLUMNS = [
    "admin API",
    "proxies",
    "runs",
    "load 1 min (each run)",
    "p99 ms (median)",
    "p99 ms (range)",
    "p50 ms (median)",
    "p99 after publish ms (median)",
    "CPU s / push (median)",
    "CPU s / push (range)",
    "page polls",
    "failures",
    "stream errors",
    "p99 x on",
    "CPU x on",
]

ADMIN_COLUMNS = [
    "endpoint",
    "proxies",
    "requests",
    "median ms",
    "max ms",
    "server CPU ms (median)",
    "response KB",
    "proxies SYNCED when asked",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class StatusVariant:
    """What asks the server's admin API."""

    admin: str
    """``on`` (nobody asks it) or ``page open`` (polled as the status page does)."""


VARIANTS = (StatusVariant(admin="on"), StatusVariant(admin="page open"))


class _PagePoller:
    """Asks the admin API what an open status page asks, every :data:`PAGE_EVERY` s after the answers."""

    def __init__(self) -> None:
        self.admin = ""
        self.polls = 0
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="status-page-poller", daemon=True)

    def _poll_once(self) -> None:
        results: list[BaseException | None] = [None] * len(PAGE_PATHS)

        def get(index: int, path: str) -> None:
            try:
                with urllib.request.urlopen(f"http://{self.admin}{path}", timeout=30) as response:
                    json.loads(response.read())
            except Exception as exc:  # counted and reported
                results[index] = exc

        # The page asks the three at once (Promise.all).
        threads = [threading.Thread(target=get, args=(i, path)) for i, path in enumerate(PAGE_PATHS)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        self.polls += 1
        self.errors += [f"{path}: {exc}" for path, exc in zip(PAGE_PATHS, results, strict=True) if exc is not None]

    def _run(self) -> None:
        while not self._stop.is_set():
            self._poll_once()
            self._stop.wait(PAGE_EVERY)

    @contextlib.contextmanager
    def running(self, server: ServerProcess) -> Iterator[None]:
        """Polls ``server``'s admin API while the context lasts."""
        self.admin = server.started["admin"]
        self._thread.start()
        try:
            yield
        finally:
            self._stop.set()
            self._thread.join(60)


@dataclass
class AdminTimings:
    """One endpoint's requests, pooled over runs."""

    path: str
    proxies: int
    seconds: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)
    synced: list[str] = field(default_factory=list)
    """Per run: ``SYNCED`` proxies of those connected, from /v1/fleet when the endpoints were asked."""

    def row(self) -> list[Any]:
        return [
            f"`{self.path}`",
            self.proxies,
            len(self.seconds),
            fmt_ms(statistics.median(self.seconds)),
            fmt_ms(max(self.seconds)),
            round(statistics.median(self.cpu) * 1000),
            round(statistics.median(self.sizes) / 1024, 1),
            f"{self.synced[0]} (each of {len(self.synced)} runs)"
            if len(set(self.synced)) == 1
            else " / ".join(self.synced),
        ]


def _time_endpoints(server: ServerProcess, *, timings: dict[str, AdminTimings], requests: int) -> None:
    """Each of :data:`ENDPOINTS` ``requests`` times, in turn; the fleet's states first."""
    admin = server.started["admin"]
    with urllib.request.urlopen(f"http://{admin}/v1/fleet?limit=0", timeout=30) as response:
        fleet = json.loads(response.read())
    synced = f"{fleet['states'].get('SYNCED', 0)} of {fleet['connected']}"
    for path in ENDPOINTS:
        timings[path].synced.append(synced)
    for _ in range(requests):
        for path in ENDPOINTS:
            cpu_before = server.settle_cpu(quiet=0.05, limit=2)
            started = time.perf_counter()
            with urllib.request.urlopen(f"http://{admin}{path}", timeout=60) as response:
                body = response.read()
            elapsed = time.perf_counter() - started
            timings[path].seconds.append(elapsed)
            timings[path].cpu.append(server.settle_cpu(quiet=0.05, limit=2) - cpu_before)
            timings[path].sizes.append(len(body))


@dataclass
class _Runs:
    variant: StatusVariant
    proxies: int
    results: list[FanoutResult] = field(default_factory=list)
    loads: list[float] = field(default_factory=list)
    polls: list[int] = field(default_factory=list)
    poll_errors: list[str] = field(default_factory=list)

    def p99s(self) -> list[float]:
        return [r.p(99) for r in self.results]

    def cpus(self) -> list[float]:
        return [r.cpu for r in self.results]

    def row(self, base: _Runs | None) -> list[Any]:
        p99s, cpus = self.p99s(), self.cpus()
        ratios: list[Any] = ["-", "-"]
        if base is not None and base is not self and base.results:
            ratios = [
                ratio(statistics.median(p99s), statistics.median(base.p99s())),
                ratio(statistics.median(cpus), statistics.median(base.cpus())),
            ]
        return [
            self.variant.admin,
            self.proxies,
            len(self.results),
            fmt_loads(self.loads),
            fmt_ms(statistics.median(p99s)),
            f"{fmt_ms(min(p99s))}-{fmt_ms(max(p99s))}",
            fmt_ms(statistics.median([r.p(50) for r in self.results])),
            fmt_ms(statistics.median([percentile(r.after_publish, 99) for r in self.results])),
            round(statistics.median(cpus), 3),
            f"{min(cpus):.3f}-{max(cpus):.3f}",
            " / ".join(str(n) for n in self.polls) if self.polls else "-",
            sum(r.failures for r in self.results),
            stream_errors_cell(self.results),
            *ratios,
        ]

    def notes(self) -> list[str]:
        lines = stream_error_notes(f"admin API {self.variant.admin}, {self.proxies} proxies", self.results)
        if self.poll_errors:
            lines.append(
                f"Status page polls that failed, {self.proxies} proxies: {len(self.poll_errors)}, e.g. "
                f"`{self.poll_errors[0][:200]}`"
            )
        return lines


def run_status(
    *,
    proxies: Sequence[int],
    changes: int,
    workload: Workload,
    rounds: int = 3,
    poll_proxies: Sequence[int] = (10000,),
    admin_proxies: Sequence[int] = (10000,),
    requests: int = 3,
    workdir: Path | None = None,
) -> tuple[list[list[Any]], list[list[Any]], list[str]]:
    """The fan-out table (one row per variant and fleet size), the admin endpoints' table, and
    notes (stream errors, failed polls); see the module docstring."""
    with contextlib.ExitStack() as stack:
        workdir = work_dir(stack, workdir, "pilotfish-status-")
        rows: list[list[Any]] = []
        admin_rows: list[list[Any]] = []
        notes: list[str] = []
        for n in proxies:
            variants = [v for v in VARIANTS if v.admin != "page open" or n in poll_proxies]
            runs = {v: _Runs(v, n) for v in variants}
            timings = {path: AdminTimings(path, n) for path in ENDPOINTS}
            for round_ in range(rounds):
                for variant in variants:
                    load = load_1min()
                    poller = _PagePoller() if variant.admin == "page open" else None
                    endpoints = (
                        functools.partial(_time_endpoints, timings=timings, requests=requests)
                        if variant.admin == "on" and n in admin_proxies
                        else None
                    )
                    result = run_fanout(
                        FanoutOptions(
                            proxies=n,
                            changes=changes,
                            workload=workload,
                            quiet_ms=100,
                            change="registry",
                            workdir=workdir / f"{variant.admin.replace(' ', '-')}-{n}-{round_}",
                            admin="127.0.0.1:0",
                            during_changes=poller.running if poller is not None else None,
                            after_changes=endpoints,
                        )
                    )
                    runs[variant].results.append(result)
                    runs[variant].loads.append(load)
                    if poller is not None:
                        runs[variant].polls.append(poller.polls)
                        runs[variant].poll_errors += poller.errors
                    print(
                        f"  admin API {variant.admin}, {n} proxies (round {round_ + 1}, load {load:.2f}): "
                        f"p99 {fmt_ms(result.p(99))} ms, CPU {result.cpu:.3f} s/push, failures {result.failures}"
                        + (f", {poller.polls} page polls" if poller is not None else ""),
                        flush=True,
                    )
            base = runs[VARIANTS[0]]
            for variant in variants:
                rows.append(runs[variant].row(base))
                notes += runs[variant].notes()
            admin_rows += [t.row() for t in timings.values() if t.seconds]
        return rows, admin_rows, notes


def main(argv: list[str] | None = None) -> int:
    import argparse

    from bench.report import print_table

    parser = argparse.ArgumentParser(prog="python -m bench.bench_status", description=__doc__.split("\n\n")[0])
    parser.add_argument("--proxies", type=int, nargs="+", default=[1000, 10000])
    parser.add_argument(
        "--poll-proxies",
        type=int,
        nargs="*",
        default=[10000],
        help="fleet sizes that also run with the status page open (default: %(default)s)",
    )
    parser.add_argument(
        "--admin-proxies",
        type=int,
        nargs="*",
        default=[10000],
        help="fleet sizes whose `on` runs time the admin endpoints (default: %(default)s)",
    )
    parser.add_argument("--requests", type=int, default=3, help="requests per endpoint per run (default: %(default)s)")
    parser.add_argument("--changes", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3, help="times the variants run in turn (default: %(default)s)")
    parser.add_argument("--services", type=int, default=100)
    parser.add_argument("--endpoints", type=int, default=4)
    parser.add_argument("--listeners", type=int, default=10)
    args = parser.parse_args(argv)
    workload = Workload(services=args.services, endpoints=args.endpoints, listeners=args.listeners)
    started = time.strftime("%H:%M:%S")
    rows, admin_rows, notes = run_status(
        proxies=args.proxies,
        changes=args.changes,
        workload=workload,
        rounds=args.rounds,
        poll_proxies=args.poll_proxies,
        admin_proxies=args.admin_proxies,
        requests=args.requests,
    )
    print(f"\nworkload: {workload.describe()}; started {started}, load now {load_1min():.2f}")
    print_table(STATUS_COLUMNS, rows)
    print()
    print_table(ADMIN_COLUMNS, admin_rows)
    for note in notes:
        print(note)
    return 0 if all(row[STATUS_COLUMNS.index("failures")] == 0 for row in rows) else 1


if __name__ == "__main__":
    os.chdir(REPO)
    sys.exit(main())
