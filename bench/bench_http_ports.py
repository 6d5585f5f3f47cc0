"""What the HTTP ports' own accept (connection caps, src/pilotfish/transport/site.py) costs: pilotfish
before it and now, side by side in one run.

Theory of operation
-------------------
Before, the registry API, REST xDS and the admin API were aiohttp sites on a socket asyncio
accepted from; now each is a :class:`~pilotfish.transport.site.CappedSite` that accepts itself
(counting every connection in and out) and puts a thin protocol in front of aiohttp's, one more
Python call per chunk read. Both show in two loads:

- **keep-alive**: ``clients`` connections, each sending requests one after another for
  ``seconds`` (what REST pollers and registry agents do);
- **new connection per request**: the same with ``Connection: close`` (the accept path, each
  request a connection counted in and out).

Each load asks the registry API's ``GET /healthz`` and REST xDS's ``POST /v3/discovery:clusters``
(one poll of a node that has the current version: a 304 after the first). The client is aiohttp in
this process; what is compared is the *server's* CPU per request (utime + stime from /proc, the
server idle otherwise) and the requests per second and latency the client saw, per variant. The
"before" server is pilotfish at :data:`BEFORE_COMMIT` from a temporary ``git worktree``
(:func:`bench.checkout.checkout`); variants run in turn ``rounds`` times, and a row
pools a variant's runs (median of the runs' CPU per request, latencies pooled).
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aiohttp

from bench.checkout import checkout, pythonpath_env
from bench.procs import REPO, start_pilotfish
from bench.stats import load_1min, percentile

__all__ = ["BEFORE_COMMIT", "COLUMNS", "run_http_ports"]

BEFORE_COMMIT = "ebbcf00"
"""pilotfish before the HTTP ports accepted connections themselves."""
COLUMNS = [
    "server",
    "route",
    "connections",
    "runs",
    "load 1 min",
    "requests/s",
    "p50 ms",
    "p99 ms",
    "server CPU us / request",
    "CPU x",
]
_SNAPSHOT = REPO / "examples" / "demo.yaml"


async def _load(
    url: str, *, method: str, body: bytes | None, clients: int, seconds: float, keep_alive: bool
) -> tuple[int, list[float]]:
    """(requests answered, latencies) of ``clients`` loops asking ``url`` for ``seconds``."""
    latencies: list[float] = []
    deadline = time.monotonic() + seconds
    headers = {"Content-Type": "application/json", **({} if keep_alive else {"Connection": "close"})}
    connector = aiohttp.TCPConnector(limit=clients, force_close=not keep_alive)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def client() -> None:
            while time.monotonic() < deadline:
                start = time.perf_counter()
                async with session.request(method, url, data=body, headers=headers) as response:
                    await response.read()
                    if response.status >= 400:
                        raise RuntimeError(f"{method} {url}: HTTP {response.status}")
                latencies.append(time.perf_counter() - start)

        await asyncio.gather(*(client() for _ in range(clients)))
    return len(latencies), latencies


def _run(
    variant: str, env: dict[str, str] | None, workdir: Path, *, clients: int, seconds: float
) -> list[dict[str, Any]]:
    server = start_pilotfish(
        workdir, snapshot=_SNAPSHOT, name=f"pilotfish-{variant}", env=env, extra=("--rest", "127.0.0.1:0")
    )
    results = []
    try:
        registry, rest = server.started["registry"], server.started["rest"]
        routes = [
            ("GET /healthz (registry)", f"http://{registry}/healthz", "GET", None),
            (
                "POST /v3/discovery:clusters",
                f"http://{rest}/v3/discovery:clusters",
                "POST",
                b'{"node": {"id": "bench", "cluster": "bench"}}',
            ),
        ]
        for keep_alive in (True, False):
            for route, url, method, body in routes:
                load = load_1min()
                before = server.settle_cpu()
                started = time.monotonic()
                count, latencies = asyncio.run(
                    _load(url, method=method, body=body, clients=clients, seconds=seconds, keep_alive=keep_alive)
                )
                elapsed = time.monotonic() - started
                cpu = server.settle_cpu() - before
                results.append(
                    {
                        "variant": variant,
                        "route": route,
                        "keep_alive": keep_alive,
                        "load": load,
                        "rate": count / elapsed,
                        "latencies": latencies,
                        "cpu_per_request": cpu / count,
                    }
                )
    finally:
        server.stop()
    return results


def run_http_ports(
    *, clients: int = 16, seconds: float = 5.0, rounds: int = 3, commit: str = BEFORE_COMMIT
) -> list[list[Any]]:
    """The table's rows (see the module docstring)."""
    runs: list[dict[str, Any]] = []
    with checkout(commit) as before, tempfile.TemporaryDirectory(prefix="bench-http-") as tmp:
        before_env = pythonpath_env(before)
        now_env = pythonpath_env(REPO)
        for _ in range(rounds):
            for variant, env in (("before", before_env), ("now", now_env)):
                runs += _run(variant, env, Path(tmp), clients=clients, seconds=seconds)
    rows = []
    baseline: dict[tuple[str, bool], float] = {}
    for keep_alive in (True, False):
        for route in dict.fromkeys(run["route"] for run in runs):
            for variant in ("before", "now"):
                mine = [r for r in runs if (r["variant"], r["route"], r["keep_alive"]) == (variant, route, keep_alive)]
                latencies = [latency for r in mine for latency in r["latencies"]]
                cpu = statistics.median(r["cpu_per_request"] for r in mine)
                if variant == "before":
                    baseline[(route, keep_alive)] = cpu
                ratio = cpu / baseline[(route, keep_alive)] if baseline.get((route, keep_alive)) else float("nan")
                rows.append(
                    [
                        variant,
                        route,
                        f"{clients} {'keep-alive' if keep_alive else 'new per request'}",
                        len(mine),
                        " ".join(f"{r['load']:.1f}" for r in mine),
                        f"{statistics.median(r['rate'] for r in mine):.0f}",
                        f"{percentile(latencies, 50) * 1e3:.2f}",
                        f"{percentile(latencies, 99) * 1e3:.2f}",
                        f"{cpu * 1e6:.0f}",
                        "" if variant == "before" else f"{ratio:.2f}",
                    ]
                )
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    import argparse

    from bench.report import print_table

    parser = argparse.ArgumentParser(prog="python -m bench.bench_http_ports", description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--commit", default=BEFORE_COMMIT, help="the 'before' pilotfish (default: %(default)s)")
    args = parser.parse_args(argv)
    rows = run_http_ports(clients=args.clients, seconds=args.seconds, rounds=args.rounds, commit=args.commit)
    print(f"\nbefore = {args.commit}; load now {load_1min():.2f}")
    print_table(COLUMNS, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
