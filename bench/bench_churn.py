"""What proxies that come and go cost a long-running server: a churn soak with RSS sampled.

Theory of operation
-------------------
One real ``pilotfish serve`` (:func:`bench.procs.start_pilotfish`, a snapshot of
:class:`~bench.workload.Workload`, the admin API on) and the fleet simulator (bench/fleet/):
``steady`` proxies connect, sync and stay; then :meth:`bench.fleet.Fleet.churn` starts new node ids
at ``rate`` per second beside them, each with a node as large as Envoy's
(:func:`bench.fleet.envoy_like_node`: metadata, locality, ~400 extensions), and each leaves for
good (stream and connection closed) once it has synced CDS, EDS, LDS and RDS (at most
:data:`MAX_ACTIVE` at once). The server remembers
each departed proxy (``/v1/proxies?all=true``, the status page) for ``--status-forget-after`` s,
at most ``--status-max-disconnected`` of them.

Every ``every`` seconds the server's RSS (``VmRSS`` of /proc/PID/status) is read with how many
proxies have departed so far. Two numbers come out of the samples:

- ``KB / remembered proxy``: the least-squares slope of RSS against departures while every
  departed proxy is still remembered (from :data:`WARMUP` departures, so the first arenas and
  the ring of recent events are filled, up to the cap, or the end), in KB per departed proxy;
- ``MiB / 1,000 departed past the cap``: the slope once ``max_disconnected`` proxies are
  remembered (from 1.5 x the cap on: the server forgets one for each that leaves), in MiB per
  1,000 departures: flat means the memory of a forgotten proxy is reused.

``server`` ``before`` runs a checkout of :data:`BEFORE_COMMIT` (a temporary ``git worktree``), the
last commit before the status limits were settings (``--status-*`` flags are then left out, and
its cap is fixed at 10,000).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from bench.checkout import checkout, pythonpath_env
from bench.fleet import Fleet
from bench.procs import REPO, start_pilotfish, work_dir
from bench.report import print_table
from bench.stats import load_1min
from bench.workload import Workload

__all__ = ["BEFORE_COMMIT", "CHURN_COLUMNS", "VARIANTS", "ChurnResult", "ChurnVariant", "main", "notes", "run_churn"]

BEFORE_COMMIT = "ebbcf002030737f998cafde0bdcf88ed86a6879a"
"""pilotfish before the status limits were settings and a departed proxy's record was compacted."""

WARMUP = 500
"""Departures before the per-proxy slope starts (the first arenas, the recent-events ring)."""

CHURN_COLUMNS = [
    "server",
    "max disconnected",
    "subset grace s",
    "node on",
    "steady",
    "churn / s",
    "departed",
    "never synced",
    "seconds",
    "RSS before MiB",
    "RSS end MiB",
    "RSS max MiB",
    "KB / remembered proxy",
    "MiB / 1,000 departed past the cap",
    "remembered at end",
]

MAX_ACTIVE = 100
"""Churning proxies connected at once at most: when other work slows the server, the next wait
(a burst of thousands of half-synced connections would set the RSS high-water mark instead)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ChurnVariant:
    """One soak's server and limits."""

    server: str
    """``now`` or ``before`` (:data:`BEFORE_COMMIT`)."""
    max_disconnected: int | None
    """``--status-max-disconnected`` (None: the default)."""
    subset_grace: float | None
    """``--subset-grace-s`` (None: the default)."""
    node_every_request: bool = False
    """The churning proxies send their node on every request (Envoy's default), not on a stream's
    first only (``set_node_on_first_message_only``, as pilotfish's bootstraps set it)."""


VARIANTS = (
    ChurnVariant(server="now", max_disconnected=1000, subset_grace=None),
    ChurnVariant(server="now", max_disconnected=None, subset_grace=None),
    ChurnVariant(server="before", max_disconnected=None, subset_grace=None),
)
"""What ``make bench`` runs, every other limit at its default: the cap at 1,000 (RSS flat past it?),
and the defaults (RSS per remembered proxy) now and before."""


def notes(*, rate: float, seconds: float) -> list[str]:
    return [
        f"{rate:g} new node ids a second for {seconds:g} s beside 100 steady proxies, each with an Envoy-sized "
        "node (~56 KB: 400 extensions, 40 metadata labels, a locality), connecting, syncing CDS, EDS, LDS and "
        f"RDS, and leaving for good (at most {MAX_ACTIVE} connected at once). `KB / remembered proxy`: the "
        f"least-squares slope of the server's RSS against departures from {WARMUP} departures up to the cap "
        "(all of them remembered); `MiB / 1,000 departed past the cap`: the slope from 1.5 x the cap on "
        "(one forgotten for each that leaves: flat means a forgotten proxy's memory is reused). `subset grace "
        "s`: `--subset-grace-s`, how long a departed proxy keeps its subsetting index (every proxy has one, "
        "subsetting configured or not). `node on`: the churning proxies send their node on a stream's first "
        "request only (`set_node_on_first_message_only`, as pilotfish's bootstraps set it) or on every request "
        "(Envoy's default, `--node-every-request`). `before`: the commit before departed proxies were compacted (its "
        "limits fixed at 10 minutes and 10,000). RSS is noisy on a shared machine: other work's load moves "
        "it by a few MiB."
    ]


WORKLOAD = Workload(services=20, endpoints=2, listeners=4)
"""A small snapshot: the churn is about proxies, not configuration."""


@dataclass
class ChurnResult:
    server: str
    max_disconnected: int | None
    """``--status-max-disconnected`` (None: the server's default)."""
    subset_grace: float | None
    """``--subset-grace-s`` (None: the server's default, 300 s)."""
    steady: int
    rate: float
    node_every_request: bool = False
    """The churning proxies sent their node on every request (else on a stream's first only)."""
    departed: int = 0
    never_synced: int = 0
    seconds: float = 0.0
    rss_before_kb: int = 0
    samples: list[tuple[float, int, int]] = field(default_factory=list)
    """(seconds since the churn began, proxies departed, RSS KiB)."""
    remembered: int | None = None
    """``/v1/proxies?all=true`` minus the steady ones, at the end (None: not asked)."""

    @property
    def cap(self) -> int:
        return self.max_disconnected if self.max_disconnected is not None else 10_000

    def _slope(self, low: float, high: float) -> float | None:
        """Least-squares KiB per departure over the samples with ``low <= departed <= high``."""
        points = [(d, rss) for _, d, rss in self.samples if low <= d <= high]
        if len(points) < 3 or points[-1][0] - points[0][0] < 100:
            return None
        mx = sum(d for d, _ in points) / len(points)
        my = sum(r for _, r in points) / len(points)
        den = sum((d - mx) ** 2 for d, _ in points)
        return sum((d - mx) * (r - my) for d, r in points) / den if den else None

    @property
    def kb_per_remembered(self) -> float | None:
        return self._slope(min(WARMUP, self.cap / 2), self.cap)

    @property
    def mib_per_1000_past_cap(self) -> float | None:
        slope = self._slope(1.5 * self.cap, float("inf"))
        return None if slope is None else slope * 1000 / 1024

    def row(self) -> list[object]:
        rss = [r for _, _, r in self.samples] or [0]
        per, past = self.kb_per_remembered, self.mib_per_1000_past_cap
        grace = "default (300)" if self.subset_grace is None else f"{self.subset_grace:g}"
        cap = "default (10,000)" if self.max_disconnected is None else self.max_disconnected
        return [
            self.server,
            cap,
            grace,
            "every request" if self.node_every_request else "first request",
            self.steady,
            f"{self.rate:g}",
            self.departed,
            self.never_synced,
            f"{self.seconds:.0f}",
            f"{self.rss_before_kb / 1024:.1f}",
            f"{rss[-1] / 1024:.1f}",
            f"{max(rss) / 1024:.1f}",
            "-" if per is None else f"{per:.2f}",
            "-" if past is None else f"{past:.3f}",
            "-" if self.remembered is None else self.remembered,
        ]


@contextlib.contextmanager
def _server_env(server: str) -> Iterator[dict[str, str] | None]:
    if server == "now":
        yield None
        return
    with checkout(BEFORE_COMMIT) as before:
        yield pythonpath_env(before)


def _remembered(admin: str) -> int:
    with urllib.request.urlopen(f"http://{admin}/v1/proxies?all=true", timeout=60) as response:
        proxies = json.loads(response.read())["proxies"]
    return sum(1 for proxy in proxies if not proxy["connected"])


def run_churn(
    *,
    server: str = "now",
    steady: int = 100,
    rate: float = 60.0,
    seconds: float = 60.0,
    max_disconnected: int | None = None,
    subset_grace: float | None = None,
    every: float = 1.0,
    workdir: Path | None = None,
    server_args: Sequence[str] = (),
    node_every_request: bool = False,
) -> ChurnResult:
    """One soak (see the module docstring): ``steady`` proxies stay, ``rate`` new ones a second for
    ``seconds`` connect, sync and leave; ``max_disconnected``: ``--status-max-disconnected`` (None:
    the default, and the only choice for ``server="before"``); ``subset_grace``:
    ``--subset-grace-s`` (None: the default), how long a departed proxy keeps its subsetting index
    (every proxy gets one, subsetting configured or not: the other memory a departure leaves);
    ``node_every_request``: the churning proxies send their node on every request, as Envoy does
    by default, not on a stream's first only."""
    if server == "before" and max_disconnected is not None:
        raise ValueError("the server before has no --status-max-disconnected")
    result = ChurnResult(
        server=server,
        max_disconnected=max_disconnected,
        subset_grace=subset_grace,
        steady=steady,
        rate=rate,
        node_every_request=node_every_request,
    )
    count = int(rate * seconds)
    with contextlib.ExitStack() as stack:
        workdir = work_dir(stack, workdir, "pilotfish-churn-")
        env = stack.enter_context(_server_env(server))
        snapshot = workdir / "snapshot.json"
        WORKLOAD.write(snapshot)
        limits: list[str] = []
        if max_disconnected is not None:
            limits += ("--status-max-disconnected", str(max_disconnected))
        if subset_grace is not None:
            limits += ("--subset-grace-s", f"{subset_grace:g}")
        proc = start_pilotfish(
            workdir,
            snapshot=snapshot,
            registry=False,
            env=env,
            admin="127.0.0.1:0",
            extra=("--event-log-level", "changes", *limits, *server_args),
        )
        stack.callback(proc.stop)
        admin = proc.started["admin"]
        fleet = Fleet(target=proc.xds, proxies=steady, workers=2, client="h2")
        fleet.start()
        stack.callback(fleet.close)
        synced = fleet.wait_synced(timeout=120)
        if synced.failures:
            raise RuntimeError(f"{synced.failures} of {steady} steady proxies never synced")
        proc.settle_cpu(quiet=0.3, limit=5)
        result.rss_before_kb = proc.rss_kb()
        began = time.monotonic()
        fleet.churn(
            count=count, rate=rate, envoy_node=True, max_active=MAX_ACTIVE, node_every_request=node_every_request
        )
        while True:
            counts = fleet.churned()
            result.samples.append((time.monotonic() - began, counts.departed, proc.rss_kb()))
            if counts.departed >= count:
                break
            if not proc.alive():
                raise RuntimeError(f"the server died during the churn:\n{proc.log_tail()}")
            if time.monotonic() - began > 3 * seconds + 120:
                raise RuntimeError(f"the churn did not finish: {counts}")
            time.sleep(every)
        result.seconds = time.monotonic() - began
        result.departed, result.never_synced = counts.departed, counts.never_synced
        result.remembered = _remembered(admin)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.bench_churn", description=__doc__.split("\n\n")[0])
    parser.add_argument("--server", choices=("now", "before"), default="now")
    parser.add_argument("--steady", type=int, default=100, help="proxies that stay (default: %(default)s)")
    parser.add_argument("--rate", type=float, default=60.0, help="new node ids a second (default: %(default)s)")
    parser.add_argument("--seconds", type=float, default=60.0, help="how long they come (default: %(default)s)")
    parser.add_argument("--max-disconnected", type=int, help="--status-max-disconnected (default: the server's)")
    parser.add_argument("--subset-grace", type=float, help="--subset-grace-s (default: the server's)")
    parser.add_argument(
        "--node-every-request",
        action="store_true",
        help="the churning proxies send their node on every request, as Envoy does by default "
        "(default: on a stream's first only, as with pilotfish's bootstraps)",
    )
    parser.add_argument("--samples", type=Path, help="write the (seconds, departed, RSS KiB) samples here as JSON")
    args = parser.parse_args(argv)
    os.chdir(REPO)
    result = run_churn(
        server=args.server,
        steady=args.steady,
        rate=args.rate,
        seconds=args.seconds,
        max_disconnected=args.max_disconnected,
        subset_grace=args.subset_grace,
        node_every_request=args.node_every_request,
    )
    print(f"load 1 min: {load_1min():.2f}")
    print_table(CHURN_COLUMNS, [result.row()])
    if args.samples is not None:
        args.samples.write_text(json.dumps(result.samples))
    return 0 if result.never_synced == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
