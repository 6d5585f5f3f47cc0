"""Resource TTLs at fleet scale: what renewing them costs the server.

Theory of operation
-------------------
Two ``pilotfish serve`` processes started alike (:func:`bench.procs.start_pilotfish`: the
snapshot of :class:`~bench.workload.Workload` plus a ``runtime`` section with one layer, the event
log at ``changes``, the admin API on for its ``/metrics``), each with a fleet of its own of
``proxies`` simulated proxies (bench/fleet/, over bench/h2client.py) that ask for the layer and
announce that they take TTLs (``xds.config.supports-resource-ttl`` and, over SotW,
``xds.config.resource-in-sotw``, as ``pilotfish bootstrap`` writes them). The only difference:
the layer of the first server has ``ttl: TTL`` (``--ttl``, 30 s by default), the second's none.
So the first server renews every proxy's layer 5 s before its TTL runs out (a third of the TTL
before for TTLs under 15 s), less up to a tenth of that period at random (over
delta a heartbeat naming the layer's version, over SotW the layer sent again), and each proxy
ACKs each refresh; the second is idle.

Once both fleets have synced (and the first refreshes are spread: a first period passes), both
servers' CPU (utime + stime) is read over the same ``seconds`` of wall time, ``rounds`` times
(then the servers swap their files: a window with the TTL on the other process, so what differs
between the two processes cancels out). The heartbeat cost is on minus off, per second, as a
share of one core; refreshes are counted by the server (``pilotfish_xds_ttl_refreshes_total``),
so CPU per refresh is that cost over their rate. The target (issue 25): under 1 % of a core for
10,000 proxies with a 30 s TTL. Run over SotW and over delta (``--xds``), one after the other.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import urllib.request
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from bench.fleet import Fleet
from bench.fleet.messages import RTDS
from bench.procs import ServerProcess, raise_fd_limit, start_pilotfish, work_dir
from bench.report import print_table
from bench.stats import load_1min
from bench.workload import Workload, write_atomically
from pilotfish.xds.heartbeats import MARGIN

LAYER = "gameday"
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


@dataclass(frozen=True, slots=True)
class TtlOptions:
    proxies: int = 10_000
    ttl: float = 30.0
    """The layer's TTL, seconds."""
    seconds: float = 60.0
    """Length of one measured window."""
    rounds: int = 2
    """Windows (the TTL on one process, then on the other, alternating)."""
    xds: tuple[str, ...] = ("sotw", "delta")
    workers: int = 0
    workload: Workload = field(default_factory=lambda: Workload(services=100))


@dataclass(slots=True)
class Window:
    xds: str
    seconds: float
    cpu_on: float
    cpu_off: float
    refreshes: int

    @property
    def core_share(self) -> float:
        """What the refreshes cost, as a share of one core (on minus off, per second)."""
        return (self.cpu_on - self.cpu_off) / self.seconds

    @property
    def per_refresh_us(self) -> float:
        return (self.cpu_on - self.cpu_off) / self.refreshes * 1e6 if self.refreshes else float("nan")


@dataclass(slots=True)
class TtlBench:
    options: TtlOptions
    windows: list[Window] = field(default_factory=list)
    loads: list[float] = field(default_factory=list)

    def rows(self) -> list[list[Any]]:
        out = []
        for xds in self.options.xds:
            found = [w for w in self.windows if w.xds == xds]
            if not found:
                continue
            rate = statistics.median(w.refreshes / w.seconds for w in found)
            out.append(
                [
                    xds,
                    f"{self.options.proxies:,}",
                    f"{self.options.ttl:g} s",
                    round(rate, 1),
                    round(statistics.median(w.cpu_on / w.seconds * 100 for w in found), 2),
                    round(statistics.median(w.cpu_off / w.seconds * 100 for w in found), 2),
                    round(statistics.median(w.core_share * 100 for w in found), 2),
                    round(statistics.median(w.per_refresh_us for w in found), 1),
                    ", ".join(f"{w.core_share * 100:.2f}" for w in found),
                ]
            )
        return out

    COLUMNS: ClassVar[list[str]] = [
        "xDS",
        "proxies",
        "TTL",
        "refreshes/s",
        "server CPU, TTL on (% core)",
        "TTL off (% core)",
        "heartbeats (% core)",
        "CPU per refresh (us)",
        "each window (% core)",
    ]

    def notes(self) -> list[str]:
        o = self.options
        return [
            f"Two servers, {o.proxies:,} simulated proxies each (bench/h2client.py), every proxy asking for one "
            f"runtime layer and announcing that it takes TTLs; the layer has `ttl: {o.ttl:g}s` on one server and "
            "none on the other. Both servers' CPU is read over the same window of "
            f"{o.seconds:g} s, {o.rounds} windows per protocol, the TTL moving to the other process each window; "
            "heartbeats = on minus off, medians. Refreshes as the server counts them "
            "(`pilotfish_xds_ttl_refreshes_total`): one per proxy every TTL less min(TTL / 3, 5 s), "
            "less up to a tenth of that. "
            "Target: under 1 % of a core for 10,000 proxies at a 30 s TTL.",
        ]


def _document(workload: Workload, ttl: float | None) -> dict[str, Any]:
    document = workload.document()
    entry: dict[str, Any] = {"name": LAYER, "layer": {"gameday.abort_percent": 0}}
    if ttl is not None:
        entry["ttl"] = f"{ttl:g}s"
    document["runtime"] = [entry]
    return document


def _refreshes(server: ServerProcess) -> int:
    with _OPENER.open(f"http://{server.started['admin']}/metrics", timeout=10) as response:
        for line in response.read().decode().splitlines():
            if line.startswith("pilotfish_xds_ttl_refreshes_total "):
                return int(float(line.split()[1]))
    return 0


@dataclass(slots=True)
class _Side:
    server: ServerProcess
    snapshot: Path
    fleet: Fleet


def _side(stack: ExitStack, workdir: Path, name: str, options: TtlOptions, xds: str, ttl: float | None) -> _Side:
    snapshot = workdir / f"{name}-{xds}.json"
    write_atomically(snapshot, json.dumps(_document(options.workload, ttl)))
    server = start_pilotfish(
        workdir,
        snapshot=snapshot,
        registry=False,
        admin="127.0.0.1:0",
        name=f"{name}-{xds}",
        extra=("--event-log-level", "changes"),
    )
    stack.callback(server.stop)
    fleet = Fleet(target=server.xds, proxies=options.proxies, workers=options.workers, xds=xds, runtime_layers=(LAYER,))
    stack.callback(fleet.close)
    fleet.start()
    synced = fleet.wait_synced(timeout=max(60.0, options.proxies / 100))
    if synced.failures:
        raise RuntimeError(f"{name}: {synced.failures} of {options.proxies} proxies never synced")
    return _Side(server, snapshot, fleet)


def _set_ttl(side: _Side, options: TtlOptions, ttl: float | None) -> None:
    """Write the side's file with the TTL on or off, and wait until its proxies ACKed the layer."""
    server = side.server
    assert server.tail is not None
    server.tail.skip_to_end()
    since = time.time()
    write_atomically(side.snapshot, json.dumps(_document(options.workload, ttl)))
    loaded = server.tail.wait_for("snapshot_loaded", timeout=30, alive=server.alive)
    version = loaded["versions"]["RTDS"]
    done = side.fleet.wait_acked({RTDS: version}, since=since, timeout=max(60.0, options.proxies / 100))
    if done.failures:
        raise RuntimeError(f"{server.name}: {done.failures} proxies did not ACK the layer's change")


def run_ttl_bench(options: TtlOptions, workdir: Path | None = None) -> TtlBench:
    raise_fd_limit()
    result = TtlBench(options)
    with ExitStack() as stack:
        root = work_dir(stack, workdir, "pilotfish-bench-ttl-")
        for xds in options.xds:
            with ExitStack() as sides:
                a = _side(sides, root, "a", options, xds, options.ttl)
                b = _side(sides, root, "b", options, xds, None)
                on, off = a, b
                for round_ in range(options.rounds):
                    if round_:
                        _set_ttl(on, options, None)
                        _set_ttl(off, options, options.ttl)
                        on, off = off, on
                    # The first refreshes of a fleet pushed at once come together: one period on
                    # they are spread over a tenth of it, as in a long run.
                    time.sleep(options.ttl - min(options.ttl / 3, MARGIN))
                    on.server.settle_cpu(quiet=0.3, limit=5)
                    result.loads.append(load_1min())
                    sent0 = _refreshes(on.server)
                    opened = time.time()
                    cpu_on, cpu_off, began = on.server.cpu_seconds(), off.server.cpu_seconds(), time.monotonic()
                    time.sleep(options.seconds)
                    cpu_on, cpu_off = on.server.cpu_seconds() - cpu_on, off.server.cpu_seconds() - cpu_off
                    seconds = time.monotonic() - began
                    result.windows.append(Window(xds, seconds, cpu_on, cpu_off, _refreshes(on.server) - sent0))
                    # (Streams that broke while 2 x N proxies connected at once are not the window's.)
                    errors = on.fleet.errors(since=opened) or off.fleet.errors(since=opened)
                    if errors:
                        raise RuntimeError(f"streams broke during the window: {errors}")
    return result


def main(argv: Sequence[str] | None = None) -> int:
    d = TtlOptions()
    parser = argparse.ArgumentParser(prog="python -m bench.bench_ttl", description=__doc__.split("\n\n")[0])
    parser.add_argument("--proxies", type=int, default=d.proxies, help="proxies per server (default: %(default)s)")
    parser.add_argument("--ttl", type=float, default=d.ttl, help="the layer's TTL, seconds (default: %(default)s)")
    parser.add_argument("--seconds", type=float, default=d.seconds, help="one window (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=d.rounds, help="windows per protocol (default: %(default)s)")
    parser.add_argument("--xds", nargs="+", choices=("sotw", "delta"), default=list(d.xds))
    parser.add_argument("--workers", type=int, default=d.workers, help="client processes per fleet (default: auto)")
    parser.add_argument("--services", type=int, default=d.workload.services, help="clusters (default: %(default)s)")
    parser.add_argument(
        "--endpoints", type=int, default=d.workload.endpoints, help="per service (default: %(default)s)"
    )
    parser.add_argument("--listeners", type=int, default=d.workload.listeners, help="(default: %(default)s)")
    parser.add_argument("--workdir", type=Path, default=None, help="keep the servers' files here")
    args = parser.parse_args(argv)
    options = TtlOptions(
        proxies=args.proxies,
        ttl=args.ttl,
        seconds=args.seconds,
        rounds=args.rounds,
        xds=tuple(args.xds),
        workers=args.workers,
        workload=Workload(services=args.services, endpoints=args.endpoints, listeners=args.listeners),
    )
    result = run_ttl_bench(options, args.workdir)
    print_table(TtlBench.COLUMNS, result.rows())
    for note in result.notes():
        print(note)
    print(f"load (1 min) at each window: {', '.join(f'{x:.1f}' for x in result.loads)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
