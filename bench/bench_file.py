"""A snapshot file of raw Envoy resources at fleet size, one endpoint changed per edit.

The file holds N EDS clusters and their N ClusterLoadAssignments (raw Envoy JSON or YAML, the way
a hand-written or generated file is), read and built as ``pilotfish serve`` does it: the file is
read and parsed in a thread (``asyncio.to_thread``), then the reconciler builds and publishes it.
Each round changes the port of one endpoint and measures:

- **parse**: reading and parsing the file (the thread's wall time);
- **build**: from the reconciler's update to the change published (its own loop, :meth:`Reconciler.run`,
  builds it: in a worker thread since the build left the loop, on the loop before);
- **loop stall**: the longest gap a 1 ms ticker on the same loop saw while the edit was read and
  built (what every xDS stream waits at worst meanwhile), and of those while it was read and
  parsed (**parse stall**: what the parse thread takes from the loop; the rest is the build's);
- **parsed**: resources parsed per edit (pilotfish keeps the others' parse by their content).

``--before COMMIT`` measures that commit beside this checkout, in the same run, each in a child
process (the other's ``src`` on ``PYTHONPATH``, this module measuring), rounds interleaved. A
commit without the parse memo simply parses the whole file (the memo is passed only where the
file source takes one).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import gc
import inspect
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

__all__ = ["measure", "run_file_bench"]

NOTE = (
    "parse: the file read and parsed in a thread; build: the reconciler's build on the event loop; "
    "loop stall: the longest gap of a 1 ms ticker on that loop meanwhile (parse stall: while the file was read and "
    "parsed); medians over the edits. "
    "`--before COMMIT` measures another commit beside this one."
)

COLUMNS = [
    "variant",
    "format",
    "resources",
    "parse ms",
    "build ms",
    "loop stall ms",
    "parse stall ms",
    "parsed per edit",
]


def document(count: int, changed_port: int) -> dict[str, Any]:
    """``count`` EDS clusters and their assignments; the first assignment's port is ``changed_port``."""
    ads = {"eds_config": {"ads": {}, "resource_api_version": "V3"}}
    return {
        "clusters": [
            {"name": f"c{i}", "type": "EDS", "connect_timeout": "1s", "eds_cluster_config": ads} for i in range(count)
        ],
        "endpoints": [
            {
                "cluster_name": f"c{i}",
                "endpoints": [
                    {
                        "lb_endpoints": [
                            {
                                "endpoint": {
                                    "address": {
                                        "socket_address": {
                                            "address": "127.0.0.1",
                                            "port_value": changed_port if i == 0 else 20000 + i % 40000,
                                        }
                                    }
                                }
                            }
                        ]
                    }
                ],
            }
            for i in range(count)
        ],
    }


async def _edit(path: Path, memo: Any, reconciler: Any) -> tuple[float, float, float, float]:
    """Read and build the file as serve does (read in a thread, then the reconciler's own loop,
    :meth:`Reconciler.run`, builds and publishes it); (parse s, build s, longest loop gap s,
    longest loop gap while it was read and parsed s)."""
    from pilotfish.sources.file import read_desired

    gaps = [0.0]
    stop = asyncio.Event()

    async def tick() -> None:
        last = time.perf_counter()
        while not stop.is_set():
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    ticker = asyncio.create_task(tick())
    await asyncio.sleep(0.01)
    started = time.perf_counter()
    read = functools.partial(read_desired, path) if memo is None else functools.partial(read_desired, path, memo=memo)
    state = await asyncio.to_thread(read)
    parsed = time.perf_counter()
    parse_gaps = len(gaps)
    published = reconciler.stats.published
    reconciler.update("file", state)
    give_up = parsed + 60
    while reconciler.stats.published == published:
        if time.perf_counter() > give_up:
            raise RuntimeError(f"the edit was not published within 60 s: {reconciler.stats.last_error}")
        await asyncio.sleep(0.0005)
    built = time.perf_counter()
    await asyncio.sleep(0.01)
    stop.set()
    await ticker
    return parsed - started, built - parsed, max(gaps), max(gaps[:parse_gaps])


async def _edits(
    path: Path, memo: Any, reconciler: Any, write: Any, rounds: int
) -> tuple[int, list[tuple[float, float, float, float]]]:
    """The first read (everything new), then ``rounds`` edits, each measured by :func:`_edit`;
    (resources the memo had parsed after the first read, the edits' measures)."""
    building = asyncio.create_task(reconciler.run())
    try:
        await _edit(path, memo, reconciler)
        parsed_first = getattr(memo, "parsed", 0)
        results = []
        for edit in range(1, rounds + 1):
            write(9000 + edit)
            gc.collect()  # (the garbage of writing the file is the benchmark's, not the server's)
            results.append(await _edit(path, memo, reconciler))
        return parsed_first, results
    finally:
        building.cancel()


def measure(count: int, fmt: str, rounds: int) -> dict[str, Any]:
    """One variant (the pilotfish on ``sys.path``): medians over ``rounds`` edits after a first read."""
    from pilotfish.cache import SnapshotCache
    from pilotfish.reconcile import Reconciler
    from pilotfish.sources import file as file_source

    memo: Any = None
    if "memo" in inspect.signature(file_source.read_desired).parameters:
        from pilotfish.resources import ParseMemo  # type: ignore[attr-defined,unused-ignore]

        memo = ParseMemo()
    reconciler = Reconciler(SnapshotCache())
    with tempfile.TemporaryDirectory(prefix="pilotfish-bench-file-") as tmp:
        path = Path(tmp) / f"snapshot.{fmt}"

        def write(port: int) -> None:
            data = document(count, port)
            path.write_text(json.dumps(data) if fmt == "json" else yaml.safe_dump(data, sort_keys=False))

        write(9000)
        parsed_before, results = asyncio.run(_edits(path, memo, reconciler, write, rounds))
        per_edit = (getattr(memo, "parsed", 0) - parsed_before) / rounds if memo is not None else 2 * count
    parse, build, stall, parse_stall = (statistics.median(column) * 1000 for column in zip(*results, strict=True))
    return {
        "parse ms": parse,
        "build ms": build,
        "loop stall ms": stall,
        "parse stall ms": parse_stall,
        "parsed per edit": per_edit,
    }


def _in_child(src: Path, count: int, fmt: str, rounds: int) -> dict[str, Any]:
    from bench.checkout import pythonpath_env

    code = (
        "import json, sys; from bench.bench_file import measure; print(json.dumps(measure(*json.loads(sys.argv[1]))))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, json.dumps([count, fmt, rounds])],
        env=pythonpath_env(src),
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"bench_file with {src} failed:\n{done.stderr[-2000:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def run_file_bench(*, counts: list[int], formats: list[str], rounds: int, before: str | None = None) -> list[list[Any]]:
    """The table's rows: this checkout (and ``before``), for each count and format."""
    import contextlib

    from bench.checkout import checkout
    from bench.procs import REPO

    rows: list[list[Any]] = []
    with contextlib.ExitStack() as stack:
        variants = [("this tree", REPO)]
        if before is not None:
            variants.insert(0, (before, stack.enter_context(checkout(before))))
        for count in counts:
            for fmt in formats:
                for name, path in variants:
                    found = _in_child(path, count, fmt, rounds)
                    rows.append([name, fmt, 2 * count, *(found[c] for c in COLUMNS[3:])])
    return rows


def main(argv: list[str] | None = None) -> None:
    from bench.report import print_table

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--clusters", type=int, nargs="+", default=[10_000], help="clusters (and assignments) in the file"
    )
    parser.add_argument("--formats", nargs="+", choices=("json", "yaml"), default=["json", "yaml"])
    parser.add_argument("--rounds", type=int, default=5, help="edits measured per variant (medians)")
    parser.add_argument("--before", metavar="COMMIT", help="also measure this commit, beside this checkout")
    args = parser.parse_args(argv)
    rows = run_file_bench(counts=args.clusters, formats=args.formats, rounds=args.rounds, before=args.before)
    print_table(COLUMNS, rows)


if __name__ == "__main__":
    main()
