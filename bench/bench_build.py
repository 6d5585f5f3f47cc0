"""Snapshot build: source state -> merged -> built, checked snapshot -> one encoded response per type.

In-process (no gRPC): a registry-like :class:`~pilotfish.build.desired.DesiredState` with C services
(ServiceSpec) and E endpoints spread evenly over them is merged (``merge_states``), built
(``build_snapshot``: builders, cross-reference checks, Envoy's ``validate.rules``, per-resource
encoding and hashing) and encoded into one full response per type (``TypeSnapshot.response(None)``,
what the first proxy to ask costs). Each phase is timed ``--repeat`` times; the table shows the
median. ``build_snapshot`` is a first build of the content (the rule checker remembers no result:
every resource is decoded and checked; its per-type plans are compiled before timing); ``rules
off`` is the same build without the rule checks, side by side.

Also measured, because it is what an operator's registry sees on every call at this size:

- rebuild after one endpoint changed (the same path again, with one more endpoint, from scratch;
  the rule checker remembers unchanged resources by content hash, so only the changed one is
  checked), with and without the rule checks;
- ``Reconciler.update`` alone: what one registry API call costs before any build (it merges all
  sources' states and observes every endpoint for flap damping);
- the reconciler's rebuild after that change (``build_now``, reusing the previous build's encoded
  resources through its memo) plus encoding the responses: what the server does per change;
- the same for a registry-style change (``1 service changed``): the snapshot's services come from
  one source, and a second source (as the registry does on an instance registration) reports one
  more endpoint of one service, every other object left as it was. This is what a one-endpoint
  change costs the server in the fan-out benchmarks (``p99 after publish`` starts after it).

``--before COMMIT`` runs the same rows with that commit's pilotfish (a temporary ``git worktree``)
in a child process, with that commit's own copy of this module (whose imports match its
``src``), and prints both, side by side (bench/bench_side_by_side.py repeats both in turn).

``--profile FILE`` writes a cProfile of one full build + encode (``pstats`` format) and prints the
top functions.
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import gc
import io
import json
import pstats
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from pilotfish.build.desired import DesiredState, build_snapshot, merge_states
from pilotfish.build.validate import default_checker
from pilotfish.cache import SnapshotCache
from pilotfish.reconcile import Reconciler
from pilotfish.resources import TYPES
from pilotfish.resources.services import Endpoint, ServiceSpec
from pilotfish.snapshot import Snapshot

__all__ = ["BUILD_COLUMNS", "make_state", "rows_in_child", "run_build", "top_functions"]

BUILD_COLUMNS = [
    "pilotfish",
    "clusters",
    "endpoints",
    "merge s",
    "build_snapshot s",
    "build_snapshot, rules off s",
    "encode responses s",
    "total s",
    "response bytes (CDS / EDS)",
    "rebuild after 1 change s",
    "rebuild after 1 change, rules off s",
    "Reconciler.update s",
    "Reconciler rebuild after 1 change s",
    "Reconciler rebuild, 1 service changed s",
]


def make_state(clusters: int, endpoints: int, *, extra: int = 0) -> DesiredState:
    """C services, E endpoints spread evenly; ``extra`` more endpoints on the first service."""
    per, rest = divmod(endpoints, clusters)
    services = {}
    found: dict[str, tuple[Endpoint, ...]] = {}
    for i in range(clusters):
        name = f"svc-{i:05d}"
        services[name] = ServiceSpec(name=name)
        count = per + (1 if i < rest else 0) + (extra if i == 0 else 0)
        found[name] = tuple(
            Endpoint(f"10.{(i >> 8) & 255}.{i & 255}.{1 + e % 250}", 8000 + e // 250) for e in range(count)
        )
    return DesiredState(services=services, endpoints=found)


_T = TypeVar("_T")


def _timed(fn: Callable[[], _T]) -> tuple[float, _T]:
    gc.collect()
    start = time.perf_counter()
    value = fn()
    return time.perf_counter() - start, value


def _encode_all(snapshot: Snapshot) -> dict[str, int]:
    return {ts.rtype.short: len(ts.response(None).body) for ts in snapshot.types.values()}


def _rebuild_and_encode(reconciler: Reconciler) -> dict[str, int]:
    """The reconciler's rebuild after a change, then the responses the first proxy asks for."""
    snapshot = reconciler.build_now()
    if snapshot is None:
        raise RuntimeError(
            "the reconciler published nothing after an endpoint change: "
            "make_state(extra=1) no longer changes the snapshot"
        )
    return _encode_all(snapshot)


def _one_service_changed(clusters: int, endpoints: int, repeat: int) -> list[float]:
    """A registry-style change, ``repeat`` times: one more endpoint of one service, reported by a
    second source; every other object as it was. The reconciler's rebuild plus the responses."""
    reconciler = Reconciler(SnapshotCache(), expect=("file", "registry"))
    reconciler.update("file", make_state(clusters, endpoints))
    reconciler.update("registry", DesiredState())
    reconciler.build_now()
    times = []
    for n in range(repeat):
        reconciler.update("registry", DesiredState(endpoints={"svc-00000": (Endpoint("10.255.255.1", 1000 + n),)}))
        times.append(_timed(functools.partial(_rebuild_and_encode, reconciler))[0])
    return times


def run_build(clusters: int, endpoints: int, *, repeat: int = 3, profile: Path | None = None) -> list[Any]:
    """One table row (see :data:`BUILD_COLUMNS`)."""
    state = make_state(clusters, endpoints)
    changed = make_state(clusters, endpoints, extra=1)
    merge_t, build_t, encode_t, total_t, rebuild_t, update_t, incremental_t = ([] for _ in range(7))
    bare_t: list[float] = []
    bare_rebuild_t: list[float] = []
    sizes: dict[str, int] = {}
    # The rule checker's plans (compiled once per message type and process) are made before
    # timing: the columns show checking, not compiling.
    for rtype in TYPES:
        default_checker().compile(rtype.message.DESCRIPTOR)
    for _ in range(repeat):
        t_merge, merged = _timed(lambda: merge_states({"registry": state}))
        t_bare, _ = _timed(functools.partial(build_snapshot, merged, "bench", rules=False))
        default_checker().forget()  # a first build of this content: no result remembered
        t_build, snapshot = _timed(functools.partial(build_snapshot, merged, "bench"))
        t_encode, sizes = _timed(functools.partial(_encode_all, snapshot))
        merge_t.append(t_merge)
        bare_t.append(t_bare)
        build_t.append(t_build)
        encode_t.append(t_encode)
        total_t.append(t_merge + t_build + t_encode)
        t_bare_rebuild, _ = _timed(
            lambda: _encode_all(build_snapshot(merge_states({"registry": changed}), "bench", rules=False))
        )
        bare_rebuild_t.append(t_bare_rebuild)
        t_rebuild, _ = _timed(lambda: _encode_all(build_snapshot(merge_states({"registry": changed}), "bench")))
        rebuild_t.append(t_rebuild)
        reconciler = Reconciler(SnapshotCache())
        reconciler.update("registry", state)
        reconciler.build_now()
        t_update, _ = _timed(functools.partial(reconciler.update, "registry", changed))
        update_t.append(t_update)
        # What the server does next: build with the reconciler's memo of the previous build's
        # resources, then encode the responses the first proxy asks for.
        t_incremental, _ = _timed(functools.partial(_rebuild_and_encode, reconciler))
        incremental_t.append(t_incremental)
    if profile is not None:
        profiler = cProfile.Profile()
        profiler.enable()
        _encode_all(build_snapshot(merge_states({"registry": state}), "bench"))
        profiler.disable()
        profiler.dump_stats(profile)
    one_t = _one_service_changed(clusters, endpoints, max(repeat, 5))
    med = statistics.median
    return [
        _revision(),
        clusters,
        endpoints,
        round(med(merge_t), 3),
        round(med(build_t), 3),
        round(med(bare_t), 3),
        round(med(encode_t), 3),
        round(med(total_t), 3),
        f"{sizes.get('CDS', 0):,} / {sizes.get('EDS', 0):,}",
        round(med(rebuild_t), 3),
        round(med(bare_rebuild_t), 3),
        round(med(update_t), 3),
        round(med(incremental_t), 3),
        round(med(one_t), 4),
    ]


def _revision() -> str:
    """The commit of the pilotfish imported (its checkout's HEAD), with ``+`` when it has changes."""
    import pilotfish
    from bench.checkout import revision

    try:
        head, dirty = revision(Path(pilotfish.__file__).resolve().parents[2])
    except (OSError, subprocess.CalledProcessError):
        return "?"
    return head + ("+" if dirty else "")


def top_functions(profile: Path, limit: int = 15) -> str:
    """The top functions of a cProfile dump by own time, with cumulative time, as text."""
    out = io.StringIO()
    stats = pstats.Stats(str(profile), stream=out)
    stats.sort_stats("tottime").print_stats(limit)
    return out.getvalue()


_CHILD = (
    "import json, sys; from bench import bench_build as b; print(json.dumps(b.BUILD_COLUMNS)); "
    "sys.exit(b.main(sys.argv[1:]))"
)
"""What :func:`rows_in_child` runs: the checkout's own columns, then its rows as JSON (``--json``)."""


def rows_in_child(path: Path, sizes: list[str], repeat: int) -> tuple[list[dict[str, Any]], float]:
    """The rows of ``sizes`` measured in a child process by the checkout at ``path`` (its own
    bench/bench_build.py and ``src``: :func:`bench.checkout.pythonpath_env` with ``own_bench``),
    each a mapping column -> value, since another commit's columns may differ from these; and the
    child's CPU seconds (user + system, the whole run: imports and every repeat of every size),
    which a busy machine inflates less than the rows' wall times."""
    from bench.checkout import pythonpath_env

    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, "--json", "--repeat", str(repeat), "--sizes", *sizes],
        cwd=path,
        env=pythonpath_env(path, own_bench=True),
        capture_output=True,
        text=True,
        check=False,
    )
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise RuntimeError(f"bench_build in {path} failed:\n{done.stderr[-2000:]}")
    lines = done.stdout.strip().splitlines()
    columns: list[str] = json.loads(lines[0])
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return [dict(zip(columns, row, strict=True)) for row in json.loads(lines[-1])], cpu


def _rows_at(commit: str, sizes: list[str], repeat: int) -> list[list[Any]]:
    """The rows of ``sizes`` measured with ``commit``'s pilotfish (:func:`rows_in_child`), in these columns."""
    from bench.checkout import checkout

    with checkout(commit) as before:
        rows, _ = rows_in_child(before, sizes, repeat)
    return [[row.get(column, "-") for column in BUILD_COLUMNS] for row in rows]


def main(argv: list[str] | None = None) -> int:
    from bench.report import print_table

    parser = argparse.ArgumentParser(prog="python -m bench.bench_build", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--sizes",
        nargs="+",
        default=["1000:10000", "10000:100000"],
        help="CLUSTERS:ENDPOINTS pairs (default: %(default)s)",
    )
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--profile", type=Path, help="cProfile dump of the largest size's build + encode")
    parser.add_argument("--before", metavar="COMMIT", help="also run the rows with this commit's pilotfish")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON (what --before reads)")
    args = parser.parse_args(argv)
    rows = []
    if args.before:
        rows.extend(_rows_at(args.before, args.sizes, args.repeat))
    for n, size in enumerate(args.sizes):
        clusters, endpoints = (int(x) for x in size.split(":"))
        last = n == len(args.sizes) - 1
        rows.append(run_build(clusters, endpoints, repeat=args.repeat, profile=args.profile if last else None))
    if args.json:
        print(json.dumps(rows))
        return 0
    print_table(BUILD_COLUMNS, sorted(rows, key=lambda row: (row[1], row[2])))
    if args.profile is not None:
        print(top_functions(args.profile))
    return 0


if __name__ == "__main__":
    sys.exit(main())
