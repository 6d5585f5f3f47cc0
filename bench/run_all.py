"""Run every benchmark and write BENCHMARKS.md (``make bench``).

Each section prints its table as it finishes and names the standalone command that makes it.
``--quick`` runs everything at smoke scale (a few proxies, a small snapshot), which is what
tests/bench/test_bench_smoke.py does so the harness cannot rot; it never skips a section, except
Sovereign, which only the full run includes (``--no-sovereign`` leaves it out there too).
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import pickle
import shlex
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from bench import (
    bench_build,
    bench_churn,
    bench_docker,
    bench_envoy,
    bench_file,
    bench_hardening,
    bench_incremental,
    bench_memo,
    bench_replicas,
    bench_rollout,
    bench_side_by_side,
    bench_status,
    bench_storm,
    bench_subsetting,
    bench_ttl,
    fanout,
    h2_core_compare,
    push_floor,
)
from bench.checkout import revision
from bench.fleet import CLIENTS
from bench.procs import REPO
from bench.profiles import summary_table
from bench.report import load_line, machine_facts, markdown_table, print_table
from bench.stats import load_1min, percentile, ratio
from bench.workload import Workload

__all__ = ["Scale", "main", "run_all"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Scale:
    """How large each benchmark of one run is (:data:`FULL`: ``make bench``; :data:`QUICK`: the smoke run)."""

    fanout_proxies: tuple[int, ...] = (100, 1000, 10000)
    """Fleet sizes of the fan-out table (each at both event log levels)."""
    changes: int = 5
    """Endpoint changes per fan-out run."""
    workload: Workload = field(default_factory=Workload)
    """The snapshot every fan-out serves."""
    build_sizes: tuple[tuple[int, int], ...] = ((1000, 10000), (10000, 100000))
    """(clusters, endpoints) of the snapshot build rows."""
    build_repeat: int = 3
    """Builds per row (the median is shown)."""
    storm_proxies: int = 10000
    """Proxies of the reconnect storm."""
    envoy_changes: int = 20
    """File changes to a real Envoy."""
    envoy_quiet_ms: tuple[int, ...] = (100, 20)
    """pilotfish's debounce in those runs, one run each."""
    baseline_proxies: tuple[int, ...] = (100, 1000)
    """Fleet sizes of pilotfish vs the naive server."""
    profile_proxies: int = 1000
    """Proxies of the py-spy profiled fan-out (0: none)."""
    push_floor_rounds: int = 3
    """Rounds of the push floor beside pilotfish (bench/push_floor.py), at the grpc.aio floor's fleet size."""
    push_floor_pushes: int = 10
    """Pushes per run of the push floor and of pilotfish beside it."""
    sovereign: bool = True
    """Run Sovereign beside the real Envoy (from bench/.venv-sovereign)."""
    client: str = "h2"
    """The simulated proxies' gRPC client (:data:`bench.fleet.CLIENTS`)."""
    core_proxies: int = 1000
    """Proxies of the HTTP/2 core comparison (own core vs the `h2` package)."""
    core_rounds: int = 2
    """Fan-outs per core in that comparison, interleaved."""
    core_abuse: str = "all"
    """The attacks of tests/abuse run against each core: ``all`` or a pytest ``-k`` expression."""
    hardening_proxies: tuple[int, ...] = (1000, 10000)
    """Fleet sizes of the plaintext/TLS/mTLS comparison."""
    hardening_rounds: int = 1
    """Times the three variants of that comparison run in turn (pooled)."""
    incremental_proxies: tuple[int, ...] = (1000, 10000)
    """Fleet sizes of the incremental xDS comparison (SotW and delta at each)."""
    incremental_workload: Workload = field(default_factory=lambda: bench_incremental.LARGE_WORKLOAD)
    """The fleet-sized snapshot (10,000 clusters x 10 endpoints)."""
    incremental_changes: int = 3
    subsetting_grid: tuple[tuple[int, int, int], ...] = bench_subsetting.DEFAULT_GRID
    """(proxies, backends, k) of the subsetting comparison."""
    subsetting_removals: int = 5
    """Backends removed in turn (averaged) for that comparison's churn."""
    status_proxies: tuple[int, ...] = (1000, 10000)
    """Fleet sizes of the status tracking comparison (admin API on, a status page polling it)."""
    status_poll_proxies: tuple[int, ...] = (10000,)
    """Of those, the sizes that also run with a status page polling the admin API."""
    status_admin_proxies: tuple[int, ...] = (10000,)
    """Of those, the sizes whose ``on`` runs time the admin endpoints."""
    status_rounds: int = 3
    """Times the variants of that comparison run in turn."""
    replicas_proxies: int = 3000
    """Proxies of the replicas' fan-out: one replica on etcd vs three (a third each) vs in-memory."""
    replicas_writes: int = 5
    """Registry writes per run of that fan-out."""
    replicas_rounds: int = 2
    """Times each of its variants runs, interleaved."""
    write_count: int = 2000
    """Registrations per run of the replicas' write rate (in-memory vs etcd)."""
    write_clients: int = 16
    """Concurrent HTTP clients of that write rate."""
    memo_proxies: int = 1000
    """Proxies at one version of the response memo benchmark (bench/bench_memo.py, in-process)."""
    memo_services: int = 1000
    """Clusters whose endpoints each of them subscribes to."""
    memo_pushes: int = 5
    """Endpoint changes pushed to them."""
    churn_rate: float = 60.0
    """New node ids a second in the churn soak (bench/bench_churn.py)."""
    churn_seconds: float = 300.0
    """How long they come."""
    churn_variants: tuple[bench_churn.ChurnVariant, ...] = bench_churn.VARIANTS
    """The servers and limits of that soak."""
    rollout_proxies: int = 1000
    """Proxies per server of the rollout benchmark (bench/bench_rollout.py)."""
    rollout_lrs_seconds: float = 60.0
    """Each of its LRS windows."""
    rollout_lrs_interval: float = 10.0
    """The load reporting interval its servers ask for."""
    rollout_bake: float = 2.0
    """The bake of its rollouts in waves."""
    rollout_rollouts: int = 3
    """CDS changes it rolls out."""
    rollout_rounds: int = 10
    """Endpoint changes per server during a bake (and without a rollout), interleaved."""
    rollout_canary: str = "sim-0000*"
    """Its canary wave's node-id glob."""
    docker_containers: int = 200
    """Containers started and stopped in a burst (bench/bench_docker.py)."""
    docker_rounds: int = 3
    file_clusters: int = 10_000
    """Raw clusters (and as many assignments) in the snapshot file of bench/bench_file.py."""
    file_rounds: int = 5
    ttl_proxies: int = 10_000
    """Proxies per server of the TTL heartbeat benchmark (bench/bench_ttl.py)."""
    ttl_seconds: float = 30.0
    """Its layer's TTL."""
    ttl_window: float = 60.0
    """Its measured windows (two per protocol)."""
    side_by_side: str | None = None
    """Another commit to run beside this checkout (bench/bench_side_by_side.py: fan-outs, SotW and
    delta, and the snapshot build, in turn); None (the default, and in the smoke run): not run."""
    side_by_side_title: str = ""
    """That section's title (empty: named after the commit)."""
    side_by_side_proxies: tuple[int, ...] = (1000,)
    """Fleet sizes of those fan-outs."""
    side_by_side_rounds: int = 3
    """Times both commits run in turn."""


HISTORICAL = (
    "The comparison with {what} (commit {commit}) is no longer run: that commit's `serve` has neither "
    "{lacks}, which every server of the benchmarks is started with now. Its numbers stand as measured "
    "then, in BENCHMARKS.md at commit 685690b."
)
"""The note of a section whose comparison with an earlier commit was dropped ({what}, {commit}, {lacks})."""

FULL = Scale()
QUICK = Scale(
    fanout_proxies=(5,),
    changes=2,
    workload=Workload(services=50, endpoints=2, listeners=5),
    build_sizes=((50, 200),),
    build_repeat=1,
    storm_proxies=5,
    envoy_changes=2,
    envoy_quiet_ms=(20,),
    baseline_proxies=(5,),
    profile_proxies=0,
    push_floor_rounds=1,
    push_floor_pushes=2,
    sovereign=False,
    core_proxies=5,
    core_rounds=1,
    # (one attack: the four-connection rapid resets are their own tests)
    core_abuse="test_rapid_reset and not four_connections",
    hardening_proxies=(5,),
    incremental_proxies=(5,),
    incremental_workload=Workload(services=50, endpoints=2, listeners=5),
    incremental_changes=2,
    subsetting_grid=((20, 5, 2), (40, 10, 3)),
    subsetting_removals=2,
    status_proxies=(5,),
    status_poll_proxies=(5,),
    status_admin_proxies=(5,),
    status_rounds=1,
    replicas_proxies=6,
    replicas_writes=2,
    replicas_rounds=1,
    write_count=40,
    write_clients=4,
    memo_proxies=20,
    memo_services=30,
    memo_pushes=2,
    churn_rate=20.0,
    churn_seconds=5.0,
    churn_variants=(
        bench_churn.ChurnVariant(server="now", max_disconnected=20, subset_grace=2.0),
        bench_churn.ChurnVariant(server="before", max_disconnected=None, subset_grace=None),
    ),
    rollout_proxies=5,
    rollout_lrs_seconds=1.0,
    rollout_lrs_interval=0.5,
    rollout_bake=0.5,
    rollout_rollouts=1,
    rollout_rounds=2,
    rollout_canary="sim-00000",
    docker_containers=3,
    docker_rounds=1,
    file_clusters=100,
    file_rounds=1,
    ttl_proxies=5,
    ttl_seconds=1.5,
    ttl_window=1.0,
)


@dataclass
class Section:
    title: str
    command: str
    columns: list[str]
    rows: list[list[Any]]
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0
    commit: str = ""
    """What pilotfish was when the section started (servers start fresh from the working tree)."""
    load: tuple[float, float] = (math.nan, math.nan)
    """The load average (1 min) when the section started and when it ended."""
    skipped: bool = False
    """Not run (``run_all(only=...)``): left out of the file."""


@dataclass
class Results:
    sections: list[Section] = field(default_factory=list)
    fanouts: dict[tuple[str, int], fanout.FanoutResult] = field(default_factory=dict)
    build_rows: list[list[Any]] = field(default_factory=list)
    storm_rows: list[list[Any]] = field(default_factory=list)
    envoy: list[bench_envoy.PropagationResult] = field(default_factory=list)
    profiles: list[tuple[str, str]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    core_comparison: h2_core_compare.Comparison | None = None
    hardening_rows: list[list[Any]] = field(default_factory=list)
    incremental_rows: list[list[Any]] = field(default_factory=list)
    subsetting_rows: list[list[Any]] = field(default_factory=list)
    status_rows: list[list[Any]] = field(default_factory=list)
    status_admin_rows: list[list[Any]] = field(default_factory=list)
    replica_runs: list[bench_replicas.FanoutRun] = field(default_factory=list)
    write_rates: list[bench_replicas.WriteRate] = field(default_factory=list)
    memo: list[bench_memo.MemoRun] = field(default_factory=list)
    churn: list[bench_churn.ChurnResult] = field(default_factory=list)
    rollout: bench_rollout.RolloutBench | None = None
    ttl: bench_ttl.TtlBench | None = None
    docker: list[bench_docker.Phase] = field(default_factory=list)
    file: list[list[Any]] = field(default_factory=list)
    """The rows of bench/bench_file.py."""
    side_by_side: bench_side_by_side.SideBySide | None = None


def _cmd(*args: Any) -> str:
    return ".venv/bin/python -m " + " ".join(shlex.quote(str(a)) for a in args)


def _wl(workload: Workload) -> list[str]:
    return [
        "--services",
        str(workload.services),
        "--endpoints",
        str(workload.endpoints),
        "--listeners",
        str(workload.listeners),
    ]


def run_all(scale: Scale, *, out: Path | None, workdir: Path, only: Sequence[str] = ()) -> Results:
    """Every section at ``scale`` (``only``: just the sections whose title contains one of these
    words, case-insensitive; the others are neither run nor written)."""
    results = Results()
    wl = scale.workload
    client = scale.client
    # Commands name the client only when it is not the default.
    cl = [] if client == "h2" else ["--client", client]

    def section(
        title: str,
        command: str,
        columns: list[str],
        body: Callable[[], list[list[Any]]],
        notes: list[str] | None = None,
    ) -> None:
        if only and not any(word.lower() in title.lower() for word in only):
            results.sections.append(Section(title, command, columns, [], skipped=True))  # (notes added after)
            return
        print(f"\n## {title}\n$ {command}", flush=True)
        commit = _git_describe()
        load_before = load_1min()
        started = time.monotonic()
        try:
            rows = body()
        except Exception as exc:
            traceback.print_exc()
            results.errors.append(f"{title}: {type(exc).__name__}: {exc}")
            rows = []
            notes = [*(notes or []), f"**failed**: `{type(exc).__name__}: {exc}`"]
        item = Section(
            title, command, columns, rows, notes or [], time.monotonic() - started, commit, (load_before, load_1min())
        )
        results.sections.append(item)
        print_table(columns, rows)

    # 1. fan-out through the registry API, pilotfish defaults.
    def fan() -> list[list[Any]]:
        rows = []
        for n in scale.fanout_proxies:
            # The event log with every request and response (the default), and with changes only
            # (what a large fleet would run: 10,000 proxies make 20,000 lines per push otherwise).
            for level, server in (("all", "pilotfish"), ("changes", "pilotfish-changes")):
                r = fanout.run_fanout(
                    fanout.FanoutOptions(
                        proxies=n,
                        changes=scale.changes,
                        workload=wl,
                        quiet_ms=100,
                        change="registry",
                        client=client,
                        event_log_level=level,
                    )
                )
                results.fanouts[(server, n)] = r
                rows.append(r.row())
                print_table(fanout.FANOUT_COLUMNS, [rows[-1]])
                fan_notes.extend(_error_notes(r))
        return rows

    fan_notes: list[str] = []

    section(
        "Fan-out: one endpoint change (registry API) to N connected proxies",
        _cmd("bench.fanout", "--proxies", *scale.fanout_proxies, "--changes", scale.changes, *_wl(wl), *cl)
        + " (and again with `--event-log-level changes`)",
        fanout.FANOUT_COLUMNS,
        fan,
        [
            f"Snapshot: {wl.describe()}. Each change registers (or deregisters) one instance of `svc-00000` "
            "through `POST/DELETE /v1/services/svc-00000/instances`; t0 is just before the HTTP call, so the "
            "latencies include the debounce quiet period (`quiet ms`). `p99 after publish` is measured from "
            "when the server began pushing the new snapshot instead (its `snapshot_loaded` event, written once "
            "every response is handed to the transport, minus that event's `push_ms`). "
            "Latencies of all proxies over all changes are pooled. `event log`: the server's "
            "`--event-log-level`: `all` writes a line for every request and response (two per proxy per "
            "push), `changes` only snapshots, NACKs, streams and sources. "
            "CPU s / push: server utime+stime per change, until it is idle again. `all synced s`: N proxies "
            "connecting at once until each has ACKed CDS, EDS, LDS, RDS. The simulator's client processes run "
            "on the same 2 cores as the server (`simulator CPU s / push`); its proxies use "
            + (
                "bench/h2client.py, a lean gRPC client on pilotfish's own HTTP/2 connection (client role; "
                "`--client grpc`: grpc.aio channels)."
                if client == "h2"
                else "grpc.aio channels (`--client grpc`)."
            )
        ],
    )
    results.sections[-1].notes.extend(fan_notes)

    # 1b. what bare grpc.aio costs on this machine: the floor under any Python gRPC fan-out.
    floor_n = 1000 if 1000 in scale.fanout_proxies else scale.fanout_proxies[0]

    def floor() -> list[list[Any]]:
        done = subprocess.run(
            [sys.executable, "-m", "bench.grpc_floor", "--proxies", str(floor_n), "--rounds", "5"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=600,
            check=True,
        )
        return [
            [cell.strip() for cell in line.strip("|").split("|")]
            for line in done.stdout.splitlines()
            if line.startswith(f"| {floor_n} |")
        ]

    section(
        "The grpc.aio floor: a bare server sends N streams 4 KB and reads N answers",
        _cmd("bench.grpc_floor", "--proxies", floor_n, "--rounds", 5),
        ["streams", "round", "all answered ms", "server CPU s"],
        floor,
        [
            "No xDS at all: a grpc.aio server with N streams (each on its own connection) writes one 4 KB "
            "message to every stream and waits until each has written back. This is what pilotfish would pay "
            "for the transport alone on grpc.aio, about 300 us of CPU per proxy per push; its own HTTP/2 "
            "transport (src/pilotfish/transport/aio.py) does the whole fan-out, xDS included, for less "
            "(`CPU s / push` above)."
        ],
    )

    # 1c. the floor of a push on pilotfish's own transport, beside pilotfish (in turn).
    section(
        "The push floor: pilotfish's own transport writing shared bytes and reading ACKs, beside pilotfish",
        _cmd(
            "bench.push_floor",
            "--proxies",
            floor_n,
            "--rounds",
            scale.push_floor_rounds,
            "--pushes",
            scale.push_floor_pushes,
        ),
        push_floor.COLUMNS,
        lambda: push_floor.run_push_floor(
            proxies=floor_n, rounds=scale.push_floor_rounds, pushes=scale.push_floor_pushes
        ),
        [
            "The floor: pilotfish's HTTP/2 and gRPC transport with N ADS streams (the same simulated fleet, "
            "SotW or delta), one shared pre-encoded EDS response written to every stream per push and one ACK "
            "per stream read and parsed; nothing else. pilotfish: one registry endpoint change per push "
            f"({Workload().describe()}), at both event log levels. Runs in turn, the order flipped every "
            "round; `x floor` is the ratio of the medians (issue 24's target: <= 2x)."
        ],
    )

    # 2. memory, from the fan-out runs.
    def memory() -> list[list[Any]]:
        return [
            [n, round(r.rss_base_kb / 1024, 1), round(r.rss_idle_kb / 1024, 1), round(r.rss_per_stream_kb, 1)]
            for (server, n), r in sorted(results.fanouts.items())
            if server == "pilotfish"
        ]

    section(
        "Memory: server RSS per idle stream",
        "(from the fan-out runs above)",
        ["proxies", "RSS before any stream MB", "RSS with N idle synced streams MB", "KB per stream"],
        memory,
        [
            "(RSS with N idle streams - RSS with none) / N, VmRSS of the server process, read after all N "
            "proxies synced and the server went idle."
        ],
    )

    # 3. snapshot build.
    def build() -> list[list[Any]]:
        rows = []
        for n, (clusters, endpoints) in enumerate(scale.build_sizes):
            last = n == len(scale.build_sizes) - 1
            profile = workdir / "build.prof" if last else None
            rows.append(bench_build.run_build(clusters, endpoints, repeat=scale.build_repeat, profile=profile))
            print_table(bench_build.BUILD_COLUMNS, [rows[-1]])
            if profile is not None and profile.exists():
                results.profiles.append(
                    (
                        f"cProfile: build + encode of {clusters} clusters / {endpoints} endpoints (top 20 by own time)",
                        "```\n" + bench_build.top_functions(profile, 20).strip() + "\n```",
                    )
                )
        results.build_rows = rows
        return rows

    section(
        "Snapshot build: source state to encoded responses (in-process)",
        _cmd(
            "bench.bench_build", "--sizes", *(f"{c}:{e}" for c, e in scale.build_sizes), "--repeat", scale.build_repeat
        ),
        bench_build.BUILD_COLUMNS,
        build,
        [
            "Registry-like DesiredState (one ServiceSpec per cluster, endpoints spread evenly) -> "
            "`merge_states` -> `build_snapshot` (builders, reference checks, Envoy's validate.rules, per-resource "
            "encode + sha256) -> "
            "`TypeSnapshot.response(None)` for every type. Median of the repeats. `rebuild after 1 change`: the "
            "same path from scratch for the state with one more endpoint. `Reconciler.update`: what one "
            "registry API call costs synchronously before any build (which endpoints appeared or disappeared, for "
            "the flap damper; here every service's endpoint tuple is new, so all are compared, where a registry "
            "call that changes one service compares that one). `rules off`: the same with `serve --validate off`. "
            "`Reconciler rebuild after 1 change`: the reconciler's `build_now()` after that update (reusing "
            "the previous build's encoded resources) plus encoding the responses: the server's cost per change."
        ],
    )

    # 4. reconnect storm.
    def storm() -> list[list[Any]]:
        rows, examples = bench_storm.run_storm(
            proxies=scale.storm_proxies, workload=wl, workdir=workdir / "storm", client=client
        )
        results.storm_rows = rows
        if examples:
            print("examples:", examples)
        return rows

    section(
        f"Reconnect storm: {scale.storm_proxies} proxies at once",
        _cmd("bench.bench_storm", "--proxies", scale.storm_proxies, *_wl(wl), *cl),
        bench_storm.STORM_COLUMNS,
        storm,
        [bench_storm.__doc__.split("\n\n", 1)[1].strip().replace("\n", " ")],
    )

    # 5. real Envoy: pilotfish, and Sovereign.
    def envoy() -> list[list[Any]]:
        rows = []
        for q in scale.envoy_quiet_ms:
            r = bench_envoy.run_pilotfish_envoy(changes=scale.envoy_changes, quiet_ms=q)
            results.envoy.append(r)
            rows.append(r.row())
        if scale.sovereign:
            r = bench_envoy.run_sovereign_envoy(changes=scale.envoy_changes)
            results.envoy.append(r)
            rows.append(r.row())
        return rows

    sovereign_flag = ["--sovereign"] if scale.sovereign else []
    section(
        "File change to a real Envoy (pilotfish ADS vs Sovereign REST)",
        _cmd(
            "bench.bench_envoy", "--changes", scale.envoy_changes, "--quiet-ms", *scale.envoy_quiet_ms, *sovereign_flag
        ),
        bench_envoy.ENVOY_COLUMNS,
        envoy,
        [
            "One Envoy 1.40 per control plane, 10 EDS clusters x 2 endpoints. A change renames a new snapshot "
            "file into place with one more endpoint in `svc-00000`. ACK = the event log's `ack` of the new EDS "
            "version (ts) - t0. applied = Envoy admin `/clusters` lists the new endpoint (polled every 5 ms) - t0. "
            "Sovereign's file source refresh is whole seconds (1 s is its minimum), and Envoy polls it over REST "
            "every `refresh_delay` (1 s): its latency is bounded by those two periods, not by its speed."
        ],
    )

    # 6. side by side: pilotfish vs the naive baseline.
    def baseline() -> list[list[Any]]:
        rows = []
        for n in scale.baseline_proxies:
            p = fanout.run_fanout(
                fanout.FanoutOptions(
                    server="pilotfish",
                    proxies=n,
                    changes=scale.changes,
                    workload=wl,
                    quiet_ms=1,
                    change="file",
                    client=client,
                )
            )
            b = fanout.run_fanout(
                fanout.FanoutOptions(
                    server="naive", proxies=n, changes=scale.changes, workload=wl, change="file", client=client
                )
            )
            results.fanouts[("pilotfish-file", n)] = p
            results.fanouts[("naive", n)] = b
            rows += [p.row(), b.row()]
            side_notes.extend(_error_notes(p) + _error_notes(b))
            print_table(fanout.FANOUT_COLUMNS, rows[-2:])
        return rows

    side_notes: list[str] = []
    section(
        "Side by side: pilotfish vs a naive sync-grpcio server (same snapshot, file change)",
        _cmd(
            "bench.fanout",
            "--server",
            "pilotfish",
            "--change",
            "file",
            "--quiet-ms",
            1,
            "--proxies",
            *scale.baseline_proxies,
            *_wl(wl),
            *cl,
        )
        + "  and  "
        + _cmd("bench.fanout", "--server", "naive", "--proxies", *scale.baseline_proxies, *_wl(wl), *cl),
        fanout.FANOUT_COLUMNS,
        baseline,
        [
            "The naive server (bench/naive_server.py): sync grpcio, a thread per stream, every response built "
            "and serialized per stream, file polled every 20 ms, no debounce. pilotfish runs with "
            "`--quiet-ms 1` here so neither waits on purpose; both see the same file rename."
        ],
    )
    results.sections[-1].notes.extend(side_notes)

    def ratios() -> list[list[Any]]:
        rows = []
        for n in scale.baseline_proxies:
            p, b = results.fanouts.get(("pilotfish-file", n)), results.fanouts.get(("naive", n))
            if p is None or b is None:
                continue
            rows.append(
                [
                    n,
                    _ratio(b.p(99), p.p(99)),
                    _ratio(percentile(b.after_publish, 99), percentile(p.after_publish, 99)),
                    _ratio(b.cpu, p.cpu),
                    _ratio(b.rss_per_stream_kb, p.rss_per_stream_kb),
                ]
            )
        envoy_p = next((r for r in results.envoy if r.control_plane == "pilotfish"), None)
        envoy_s = next((r for r in results.envoy if r.control_plane == "Sovereign"), None)
        if envoy_p is not None and envoy_s is not None:
            rows.append(
                [
                    "1 Envoy (vs Sovereign)",
                    "-",
                    "-",
                    "-",
                    "-",
                    _ratio(percentile(envoy_s.applied, 50), percentile(envoy_p.applied, 50)),
                ]
            )
        return rows

    section(
        "Ratios (how many times better pilotfish is)",
        "(from the tables above)",
        [
            "proxies",
            "naive / pilotfish p99 (from change)",
            "naive / pilotfish p99 (after publish)",
            "naive / pilotfish CPU per push",
            "naive / pilotfish RSS per stream",
            "Sovereign / pilotfish applied p50",
        ],
        lambda: [r + ["-"] * (6 - len(r)) for r in ratios()],
    )

    # 6b. the HTTP/2 core: pilotfish's own against the `h2` package's state machine.
    def cores() -> list[list[Any]]:
        comparison = h2_core_compare.compare(
            proxies=scale.core_proxies,
            changes=scale.changes,
            rounds=scale.core_rounds,
            workload=wl,
            abuse=scale.core_abuse,
        )
        results.core_comparison = comparison
        core_notes.extend(h2_core_compare.notes(comparison))
        return comparison.summary()

    core_notes: list[str] = []
    section(
        "HTTP/2 core: pilotfish's own vs the `h2` package's state machine",
        _cmd(
            "bench.h2_core_compare",
            "--proxies",
            scale.core_proxies,
            "--changes",
            scale.changes,
            "--rounds",
            scale.core_rounds,
            "--abuse",
            scale.core_abuse,
            *_wl(wl),
        ),
        h2_core_compare.SUMMARY_COLUMNS,
        cores,
        [
            "The same `pilotfish serve` and `GrpcServer` adapter on either core (bench/h2_core_launch.py): "
            "`own` is src/pilotfish/transport/h2.py, `h2` is bench/h2_package_core.py (python-hyper's "
            "H2Connection with gRPC reassembly, send queues and the limits the package lacks added around it). "
            "Fan-out as above (registry change, `--event-log-level changes`), cores interleaved; the "
            "attacks are tests/abuse with `PILOTFISH_ABUSE_CORE` set."
        ],
    )
    results.sections[-1].notes.extend(core_notes)

    # 6c. what TLS and mTLS cost on the hardened transport.
    def hardening() -> list[list[Any]]:
        rows, notes = bench_hardening.run_hardening(
            proxies=scale.hardening_proxies,
            changes=scale.changes,
            workload=wl,
            rounds=scale.hardening_rounds,
            workdir=workdir / "hardening",
        )
        results.hardening_rows = rows
        hardening_notes.extend(notes)
        return rows

    hardening_notes: list[str] = []
    section(
        "Hardening and TLS: pilotfish plaintext, TLS and mTLS",
        _cmd(
            "bench.bench_hardening",
            "--proxies",
            *scale.hardening_proxies,
            "--changes",
            scale.changes,
            "--rounds",
            scale.hardening_rounds,
            *_wl(wl),
        ),
        bench_hardening.HARDENING_COLUMNS,
        hardening,
        [
            "This checkout's pilotfish; the fleet simulator is the same for every row (through the registry "
            "API, event log `all`). TLS: `--tls-cert/--tls-key` from a throwaway CA, the proxies verify it "
            "(ALPN h2); mTLS: `--client-ca` too, every proxy presents a client certificate. `load 1 min`: the "
            "load average before each run (the machine is shared). Ratios compare with the row named in "
            "`compared with` (TLS and mTLS vs plaintext: TLS's cost). RSS per idle stream: the lowest run's "
            "(each run's in brackets; noise in RSS only adds); it includes each connection's TLS state.",
            HISTORICAL.format(
                what="pilotfish before the hardened transport",
                commit="b4fb69c",
                lacks="`--max-connections-per-address` nor `--admin`",
            ),
        ],
    )
    results.sections[-1].notes.extend(hardening_notes)

    # 6d. incremental responses, SotW and delta, on a large snapshot.
    def incremental() -> list[list[Any]]:
        runs = [(xds, n) for n in scale.incremental_proxies for xds in bench_incremental.VARIANTS]
        rows, done = bench_incremental.run_incremental(
            runs=runs,
            changes=scale.incremental_changes,
            workload=scale.incremental_workload,
            workdir=workdir / "incremental",
        )
        results.incremental_rows = rows
        for result in done:
            incremental_notes.extend(bench_incremental.notes(result))
        return rows

    incremental_notes: list[str] = []

    section(
        "Incremental xDS: pilotfish over SotW and delta",
        _cmd(
            "bench.bench_incremental",
            "--proxies",
            *scale.incremental_proxies,
            "--changes",
            scale.incremental_changes,
            *_wl(scale.incremental_workload),
        ),
        bench_incremental.INCREMENTAL_COLUMNS,
        incremental,
        [
            "This checkout's pilotfish, proxies on SotW (`StreamAggregatedResources`) or delta "
            "(`DeltaAggregatedResources`). One endpoint changed through the registry API per change; "
            "every proxy subscribes to every cluster's endpoints. Bytes: response message bodies each proxy "
            "received (no HTTP/2 framing). Event log `changes` for every row. The targets at 1,000 "
            "proxies: <= 2 KB per proxy per change, p99 <= 300 ms (including the 100 ms quiet period).",
            HISTORICAL.format(
                what="pilotfish before incremental responses (SotW, every EDS response full state)",
                commit="de14338",
                lacks="`--max-connections-per-address` nor `--admin`",
            ),
        ],
    )
    results.sections[-1].notes.extend(incremental_notes)

    # 6e. subsetting, Ringsteady vs the SRE book's deterministic subsetting vs random (in-process).
    def subsetting() -> list[list[Any]]:
        rows = bench_subsetting.run_subsetting(grid=scale.subsetting_grid, removals=scale.subsetting_removals)
        results.subsetting_rows = rows
        return rows

    section(
        "Subsetting: Ringsteady vs the SRE book's deterministic subsetting vs random subsets",
        _cmd(
            "bench.bench_subsetting",
            "--grid",
            *(f"{m}:{n}:{k}" for m, n, k in scale.subsetting_grid),
            "--removals",
            scale.subsetting_removals,
        ),
        bench_subsetting.SUBSETTING_COLUMNS,
        subsetting,
        bench_subsetting.notes(scale.subsetting_removals),
    )

    # 6f. status tracking and the admin API: a status page open; the admin API at 10,000 proxies.
    def status() -> list[list[Any]]:
        rows, admin_rows, notes = bench_status.run_status(
            proxies=scale.status_proxies,
            changes=scale.changes,
            workload=wl,
            rounds=scale.status_rounds,
            poll_proxies=scale.status_poll_proxies,
            admin_proxies=scale.status_admin_proxies,
            workdir=workdir / "status",
        )
        results.status_rows, results.status_admin_rows = rows, admin_rows
        status_notes.extend(notes)
        return rows

    status_notes: list[str] = []
    status_command = _cmd(
        "bench.bench_status",
        "--proxies",
        *scale.status_proxies,
        "--poll-proxies",
        *scale.status_poll_proxies,
        "--admin-proxies",
        *scale.status_admin_proxies,
        "--changes",
        scale.changes,
        "--rounds",
        scale.status_rounds,
        *_wl(wl),
    )
    section(
        "Status tracking: pilotfish with the admin API on, and with a status page open",
        status_command,
        bench_status.STATUS_COLUMNS,
        status,
        [
            "This checkout's pilotfish with the admin API on, nobody asking it (`on`), or asked what one open "
            "status page asks (`/v1/fleet?limit=100`, "
            f"`/v1/snapshots`, `/v1/events` together, again {bench_status.PAGE_EVERY} s after the answers) while "
            "the changes run (`page open`; `page polls`: how many per run). Fan-out as in the first table "
            "(registry change, event log `all`). The variants run in turn, `rounds` times; each row gives the "
            "median over its runs of the run's p99 (all proxies over the run's changes) and of its mean server "
            "CPU per push, with the range; the ratios divide medians by `on`'s. `load 1 min`: the load "
            "average before each run: other work shares this machine's 2 cores.",
            HISTORICAL.format(what="pilotfish before status tracking", commit="24bc0c1", lacks="`--admin`"),
        ],
    )
    results.sections[-1].notes.extend(status_notes)

    admin_n = ", ".join(f"{n:,}" for n in scale.status_admin_proxies)
    section(
        f"Admin API with {admin_n} connected proxies",
        f"(from the `now` runs above: {status_command})",
        bench_status.ADMIN_COLUMNS,
        lambda: results.status_admin_rows,
        [
            "After the changes of each `on` run (admin API on, nobody else asking), every proxy connected and "
            "synced: each endpoint asked in turn, requests pooled over the runs. Wall time per request (urllib "
            "over loopback, client side); the server's CPU for it (utime + stime, read once the server is idle "
            "before and after); response size. `proxies SYNCED when asked`: `/v1/fleet`'s counts, per run."
        ],
    )

    # 6f. replicas on etcd: one write to N proxies on one replica vs three; registry write rates.
    def replicas() -> list[list[Any]]:
        rows, runs = bench_replicas.run_replica_fanouts(
            proxies=scale.replicas_proxies,
            writes=scale.replicas_writes,
            rounds=scale.replicas_rounds,
            workload=wl,
            workdir=workdir / "replicas",
        )
        results.replica_runs = runs
        return rows

    replica_notes = bench_replicas.notes(
        proxies=scale.replicas_proxies, workload=wl, clients=scale.write_clients, count=scale.write_count
    )
    replicas_cmd = _cmd(
        "bench.bench_replicas",
        "--proxies",
        scale.replicas_proxies,
        "--writes",
        scale.replicas_writes,
        "--rounds",
        scale.replicas_rounds,
        "--count",
        scale.write_count,
        "--clients",
        scale.write_clients,
        *_wl(wl),
    )
    section(
        "Replicas on etcd: one registry write to N proxies, one replica vs three",
        replicas_cmd + " --skip-writes",
        bench_replicas.REPLICA_COLUMNS,
        replicas,
        replica_notes[:1],
    )

    def write_rates() -> list[list[Any]]:
        done = bench_replicas.run_write_rates(
            count=scale.write_count, clients=scale.write_clients, workload=wl, workdir=workdir / "replicas"
        )
        results.write_rates = done
        return [w.row() for w in done]

    section(
        "Registry write rate: one replica, in-memory vs on etcd",
        replicas_cmd + " --skip-fanout",
        bench_replicas.WRITE_COLUMNS,
        write_rates,
        replica_notes[1:],
    )

    # 6g. response memos (in-process): does a fleet at one version share one encoded response per push,
    # also while a peer asks for name sets by the dozen?
    def memo() -> list[list[Any]]:
        results.memo = [
            bench_memo.run_memo(
                proxies=scale.memo_proxies, services=scale.memo_services, pushes=scale.memo_pushes, peer=peer
            )
            for peer in (False, True)
        ]
        return [run.row() for run in results.memo]

    section(
        f"Response memos: bodies encoded per push to {scale.memo_proxies:,} proxies at one version, with and "
        "without a peer asking for distinct name sets",
        _cmd(
            "bench.bench_memo",
            "--proxies",
            scale.memo_proxies,
            "--services",
            scale.memo_services,
            "--pushes",
            scale.memo_pushes,
        )
        + " (and again with --peer)",
        bench_memo.MEMO_COLUMNS,
        memo,
        bench_memo.notes(),
    )

    # 6h. proxies that come and go, RSS sampled (a departed proxy's record, the limits).
    def churn() -> list[list[Any]]:
        for variant in scale.churn_variants:
            result = bench_churn.run_churn(
                server=variant.server,
                rate=scale.churn_rate,
                seconds=scale.churn_seconds,
                max_disconnected=variant.max_disconnected,
                subset_grace=variant.subset_grace,
                node_every_request=variant.node_every_request,
            )
            results.churn.append(result)
            print_table(bench_churn.CHURN_COLUMNS, [result.row()])
        return [r.row() for r in results.churn]

    section(
        "Churn: new node ids connecting, syncing and leaving beside steady proxies, server RSS",
        _cmd(
            "bench.bench_churn",
            "--rate",
            scale.churn_rate,
            "--seconds",
            scale.churn_seconds,
            "[--server before] [--max-disconnected N] [--subset-grace S] [--node-every-request]",
        ),
        bench_churn.CHURN_COLUMNS,
        churn,
        bench_churn.notes(rate=scale.churn_rate, seconds=scale.churn_seconds),
    )

    # 6i. progressive delivery: load report ingest, a rollout's waves, endpoint changes during a bake.
    def rollout() -> list[list[Any]]:
        done = bench_rollout.run_rollout_bench(
            bench_rollout.RolloutOptions(
                proxies=scale.rollout_proxies,
                workload=wl,
                lrs_seconds=scale.rollout_lrs_seconds,
                lrs_interval=scale.rollout_lrs_interval,
                canary=scale.rollout_canary,
                bake=scale.rollout_bake,
                rollouts=scale.rollout_rollouts,
                rounds=scale.rollout_rounds,
                workdir=workdir / "rollout",
            )
        )
        results.rollout = done
        rollout_notes[:] = done.common_notes() + done.lrs_notes()
        return done.lrs_rows()

    rollout_notes: list[str] = []
    rollout_cmd = _cmd(
        "bench.bench_rollout",
        "--proxies",
        scale.rollout_proxies,
        "--lrs-seconds",
        scale.rollout_lrs_seconds,
        "--lrs-interval",
        scale.rollout_lrs_interval,
        "--canary",
        scale.rollout_canary,
        "--bake",
        scale.rollout_bake,
        "--rollouts",
        scale.rollout_rollouts,
        "--rounds",
        scale.rollout_rounds,
        *_wl(wl),
    )
    section(
        f"Rollout: load reports (LRS) from {scale.rollout_proxies:,} proxies every "
        f"{scale.rollout_lrs_interval:g} s, server CPU with and without",
        rollout_cmd,
        bench_rollout.LRS_COLUMNS,
        rollout,
    )
    results.sections[-1].notes.extend(rollout_notes)

    def rollout_part(rows: Callable[[bench_rollout.RolloutBench], list[list[Any]]]) -> Callable[[], list[list[Any]]]:
        return lambda: rows(results.rollout) if results.rollout is not None else []

    for title, columns, rows, notes in (
        (
            "Rollout: a CDS change in four waves, each wave's start to its members' ACKs",
            bench_rollout.WAVE_COLUMNS,
            bench_rollout.RolloutBench.wave_rows,
            bench_rollout.RolloutBench.wave_notes,
        ),
        (
            "Rollout: server CPU per CDS change, in waves vs to every proxy at once",
            bench_rollout.ROLLOUT_COLUMNS,
            bench_rollout.RolloutBench.rollout_rows,
            bench_rollout.RolloutBench.cpu_notes,
        ),
        (
            "Rollout: an endpoint change while a canary wave bakes vs without a rollout",
            bench_rollout.EDS_COLUMNS,
            bench_rollout.RolloutBench.eds_rows,
            bench_rollout.RolloutBench.eds_notes,
        ),
        (
            f"Rollout: load reports from {scale.rollout_proxies:,} proxies every {scale.rollout_lrs_interval:g} s "
            "to a server with --rollout and its health gate on vs without --rollout, server CPU",
            bench_rollout.GATE_COLUMNS,
            bench_rollout.RolloutBench.gate_rows,
            bench_rollout.RolloutBench.gate_notes,
        ),
    ):
        section(title, f"(from the same run: {rollout_cmd})", columns, rollout_part(rows))
        if results.rollout is not None:
            results.sections[-1].notes.extend(notes(results.rollout))

    # 6j. resource TTLs: what renewing them costs the server (heartbeats), beside a server without.
    ttl_options = bench_ttl.TtlOptions(
        proxies=scale.ttl_proxies, ttl=scale.ttl_seconds, seconds=scale.ttl_window, rounds=2, workload=wl
    )

    def ttl() -> list[list[Any]]:
        results.ttl = bench_ttl.run_ttl_bench(ttl_options, workdir / "ttl")
        return results.ttl.rows()

    section(
        f"TTLs: heartbeats for {scale.ttl_proxies:,} proxies at a {scale.ttl_seconds:g} s TTL, server CPU "
        "beside a server without the TTL",
        _cmd(
            "bench.bench_ttl",
            "--proxies",
            scale.ttl_proxies,
            "--ttl",
            scale.ttl_seconds,
            "--seconds",
            scale.ttl_window,
            *_wl(wl),
        ),
        bench_ttl.TtlBench.COLUMNS,
        ttl,
    )
    if results.ttl is not None:
        results.sections[-1].notes.extend(results.ttl.notes())

    # 6k. Docker discovery: a burst of containers started and stopped, beside the registry.
    docker_options = bench_docker.DockerOptions(
        containers=scale.docker_containers, rounds=scale.docker_rounds, workdir=workdir / "docker"
    )

    def docker() -> list[list[Any]]:
        results.docker = bench_docker.run_docker_bench(docker_options)
        return [phase.row() for phase in results.docker]

    section(
        f"Docker: {scale.docker_containers} containers started, then stopped, in a burst on one engine "
        f"(vs {scale.docker_containers} registry registrations)",
        _cmd("bench.bench_docker", "--containers", scale.docker_containers, "--rounds", scale.docker_rounds),
        bench_docker.COLUMNS,
        docker,
        bench_docker.notes(docker_options),
    )

    # 6j. a snapshot file of raw resources at fleet size, one endpoint changed per edit.
    def file_rows() -> list[list[Any]]:
        results.file = bench_file.run_file_bench(
            counts=[scale.file_clusters], formats=["json", "yaml"], rounds=scale.file_rounds
        )
        return results.file

    section(
        f"A snapshot file of {scale.file_clusters} raw clusters and {scale.file_clusters} assignments, "
        "one endpoint changed per edit",
        _cmd("bench.bench_file", "--clusters", scale.file_clusters, "--rounds", scale.file_rounds),
        bench_file.COLUMNS,
        file_rows,
        [bench_file.NOTE],
    )

    # 6k. another commit beside this checkout (only when asked for: --side-by-side COMMIT).
    if scale.side_by_side is not None:
        _side_by_side(scale, scale.side_by_side, results, section)

    # 7. profile of the server under the 1,000-proxy fan-out (py-spy).
    if scale.profile_proxies:

        def profile() -> list[list[Any]]:
            raw = workdir / f"py-spy-fanout-{scale.profile_proxies}.txt"
            r = fanout.run_fanout(
                fanout.FanoutOptions(
                    proxies=scale.profile_proxies,
                    changes=scale.changes,
                    workload=wl,
                    quiet_ms=100,
                    change="registry",
                    profile=raw,
                    client=client,
                )
            )
            results.profiles.insert(
                0,
                (
                    f"py-spy: pilotfish server during {scale.changes} endpoint changes to "
                    f"{scale.profile_proxies} proxies (sampled at 250 Hz, Python frames only; "
                    "time in C (uvloop, socket calls, protobuf) is charged to the calling "
                    "Python frame: `flush_out` is the sends, `Runner.run` uvloop's own loop "
                    "and reads)",
                    summary_table(raw, 20),
                ),
            )
            return [r.row()]

        section(
            f"Profiled fan-out run ({scale.profile_proxies} proxies, py-spy attached)",
            f".venv/bin/py-spy record --pid <server pid> --format raw --rate 250 (during "
            f"{_cmd('bench.fanout', '--proxies', scale.profile_proxies, *cl)})",
            fanout.FANOUT_COLUMNS,
            profile,
            ["py-spy slows the server; these numbers are not the benchmark."],
        )

    with open(workdir / "results.pickle", "wb") as f:
        pickle.dump((results, scale), f)
    if out is not None:
        out.write_text(render(results, scale))
        print(f"\nwrote {out}")
    return results


def _side_by_side(scale: Scale, commit: str, results: Results, section: Callable[..., None]) -> None:
    """Two sections: the fan-outs and the builds of one interleaved run beside ``commit``."""
    title = scale.side_by_side_title or f"Beside commit {commit}"
    sizes = [f"{c}:{e}" for c, e in scale.build_sizes]

    def fanouts() -> list[list[Any]]:
        results.side_by_side = bench_side_by_side.run_side_by_side(
            commit=commit,
            proxies=scale.side_by_side_proxies,
            rounds=scale.side_by_side_rounds,
            changes=scale.changes,
            workload=scale.workload,
            build_sizes=sizes,
            build_repeat=scale.build_repeat,
        )
        notes.extend(results.side_by_side.notes)
        return results.side_by_side.fanout_rows

    notes: list[str] = []
    command = _cmd(
        "bench.bench_side_by_side",
        "--commit",
        commit,
        "--proxies",
        *scale.side_by_side_proxies,
        "--rounds",
        scale.side_by_side_rounds,
        "--changes",
        scale.changes,
        *_wl(scale.workload),
        "--build-sizes",
        *sizes,
        "--build-repeat",
        scale.build_repeat,
    )
    section(
        f"{title}: fan-out",
        command,
        bench_side_by_side.FANOUT_COLUMNS,
        fanouts,
        [
            f"This checkout's pilotfish and commit {commit}'s (a temporary `git worktree`, its `src` first on "
            "`PYTHONPATH`), the same simulated fleet and snapshot, in turn `rounds` times (the order flips every "
            "round): one endpoint changed through the registry API per change, SotW and delta. Each row: the "
            "median over the runs (each run's p99 over all proxies and changes), the range beside it; the "
            "ratios divide this checkout's medians by the other's. `load 1 min`: before each run."
        ],
    )
    results.sections[-1].notes.extend(notes)
    section(
        f"{title}: snapshot build",
        f"(from the same run: {command})",
        bench_side_by_side.BUILD_COLUMNS,
        lambda: results.side_by_side.build_rows if results.side_by_side is not None else [],
        [
            "bench/bench_build.py's rows, each commit's own copy of it on its own `src` in a child process per "
            "size, in turn with the fan-outs; each run's value the median of `--build-repeat` builds, the cell the "
            "median over runs (lowest-highest). `child CPU s`: that child's user + system CPU seconds (imports and "
            "every repeat), which other work on the machine inflates less than wall times. `this / other`: this "
            "checkout's median over the other's."
        ],
    )


def _error_notes(r: fanout.FanoutResult) -> list[str]:
    """One line per gRPC status the proxies saw, with an example message."""
    return fanout.stream_error_notes(f"{r.server}, {r.proxies} proxies", [r])


def _ratio(a: float, b: float) -> str:
    return ratio(a, b, digits=1, suffix="x")


def targets(results: Results) -> list[list[Any]]:
    rows: list[list[Any]] = []

    def add(what: str, target: str, measured: str, ok: bool | None) -> None:
        rows.append([what, target, measured, "-" if ok is None else ("met" if ok else "NOT met")])

    for (n, limit), (server, level) in itertools.product(
        ((1000, 0.25), (10000, 3.0)), (("pilotfish", "all"), ("pilotfish-changes", "changes"))
    ):
        r = results.fanouts.get((server, n))
        if r is not None:
            p99 = r.p(99)
            add(
                f"endpoint change ACKed by {n:,} proxies (event log: {level})",
                f"p99 <= {limit * 1000:.0f} ms",
                f"p99 {p99 * 1000:.0f} ms (after publish {percentile(r.after_publish, 99) * 1000:.0f} ms), "
                f"failures {r.failures}",
                p99 <= limit and r.failures == 0,
            )
    big = max((n for s, n in results.fanouts if s == "pilotfish"), default=None)
    if big is not None:
        r = results.fanouts[("pilotfish", big)]
        add(
            "idle stream memory",
            "<= 50 KB RSS each",
            f"{r.rss_per_stream_kb:.1f} KB (at {big:,} streams)",
            r.rss_per_stream_kb <= 50,
        )
    if results.storm_rows:
        col = bench_storm.STORM_COLUMNS.index
        row = results.storm_rows[-1]
        synced, failures = row[col("all synced s")], row[col("failures")]
        broken = row[col("streams broken by the server")]
        add(
            f"{row[col('proxies')]:,} proxies reconnecting at once (after a restart)",
            "0 failures, all synced within 30 s",
            f"{failures} never synced, {broken} streams broken by the server, last synced after {synced} s",
            failures == 0 and broken == 0 and synced <= 30,
        )
    col = bench_incremental.INCREMENTAL_COLUMNS.index
    for row in results.incremental_rows:
        if row[col("proxies")] == 1000:
            worst, p99 = row[col("bytes / proxy / change (max)")], row[col("p99 ms")]
            ok = None if "-" in (worst, p99) else int(worst) <= 2048 and float(p99) <= 300 and row[col("failures")] == 0
            add(
                f"one endpoint of 10,000 clusters changed, 1,000 proxies, {row[col('xds')]}",
                "<= 2 KB per proxy per change, p99 <= 300 ms",
                f"max {worst} B, p99 {p99} ms",
                ok,
            )
    col = bench_status.ADMIN_COLUMNS.index
    for row in results.status_admin_rows:
        if row[col("proxies")] == 10000 and row[col("endpoint")] in ("`/v1/proxies`", "`/metrics`"):
            add(
                f"GET {row[col('endpoint')].strip('`')} with 10,000 connected proxies",
                "answers",
                f"median {row[col('median ms')]} ms, max {row[col('max ms')]} ms, {row[col('response KB')]} KB",
                True,
            )
    memo = {run.peer: run for run in results.memo}
    if False in memo and True in memo:
        alone, beside = memo[False], memo[True]
        add(
            f"{alone.proxies:,} proxies at one version, a peer asking for {bench_memo.PEER_SETS} distinct name sets "
            "before each push",
            "one encoded response per push, bytes encoded per push unchanged by the peer",
            f"{bench_memo.encodings_text(beside)} with the peer, {bench_memo.encodings_text(alone)} without "
            f"({len(beside.encodings)} pushes each)",
            set(alone.encodings) == set(beside.encodings) == {1} and alone.encoded_bytes == beside.encoded_bytes,
        )
    for churned in results.churn:
        # The targets are the defaults' (every limit but the cap): a variant with a shorter
        # --subset-grace-s, or nodes on every request, is a comparison beside them.
        if churned.server != "now" or churned.subset_grace is not None or churned.node_every_request:
            continue
        run = f"{churned.departed:,} departed in {churned.seconds:.0f} s"
        if churned.max_disconnected is not None:
            past = churned.mib_per_1000_past_cap
            add(
                f"churn, --status-max-disconnected {churned.max_disconnected:,}, other limits at their defaults",
                "RSS flat: < 0.25 MiB per 1,000 departed past the cap",
                "-" if past is None else f"{past:.3f} MiB per 1,000 ({run})",
                None if past is None else past < 0.25,
            )
        else:
            per = churned.kb_per_remembered
            add(
                "churn, default limits: RSS per remembered proxy",
                "<= 1 KB",
                "-" if per is None else f"{per:.2f} KB ({run}, {churned.remembered} remembered at the end)",
                None if per is None else per <= 1.0,
            )
    if results.rollout is not None:
        measured, met = results.rollout.target()
        add(
            f"endpoint change ACKed by {results.rollout.options.proxies:,} proxies while a rollout's canary wave "
            "bakes, vs no rollout",
            f"p99 <= {bench_rollout.TARGET_RATIO:.2f}x (medians of interleaved rounds)",
            measured,
            met,
        )
    if results.build_rows:
        col = bench_build.BUILD_COLUMNS.index
        row = max(results.build_rows, key=lambda r: r[col("endpoints")])
        clusters, endpoints, total = row[col("clusters")], row[col("endpoints")], row[col("total s")]
        at_target = (clusters, endpoints) == (10000, 100000)
        add(
            f"{clusters:,} clusters / {endpoints:,} endpoints built and encoded",
            "<= 1 s" if at_target else "<= 1 s (at 10,000 / 100,000)",
            f"{total} s",
            total <= 1.0 if at_target else None,
        )
    for prop in results.envoy:
        if prop.control_plane == "pilotfish" and prop.acks and prop.target_ms is not None:
            p50 = percentile(prop.acks, 50) * 1000
            add(
                f"file change to real Envoy ACK ({prop.settings})",
                f"p50 <= {prop.target_ms:.0f} ms",
                f"p50 {p50:.0f} ms",
                p50 <= prop.target_ms,
            )
    return rows


def _git_describe() -> str:
    """The commit the run measured, and whether src/ had uncommitted changes."""
    try:
        head, dirty = revision(REPO)
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout)"
    return f"commit {head}" + (" with uncommitted changes in src/" if dirty else "")


def render(results: Results, scale: Scale) -> str:
    """BENCHMARKS.md: what made it, the machine, the targets, then one section per benchmark
    (its command, its table, where and how long it ran, its notes), then the profiles."""
    loads = [x for s in results.sections for x in s.load if not math.isnan(x)]
    lines = [
        "# Benchmarks",
        "",
        "Generated by `make bench` (`.venv/bin/python -m bench.run_all`; do not edit by hand). Each section "
        "names the command that makes its table alone; `bench/README.md` says what each benchmark measures. "
        "Server and simulated proxies share the machine's cores, and a latency is a nearest-rank percentile "
        "over every proxy of every change.",
        "",
        "## Machine",
        "",
    ]
    lines += [f"- {k}: {v}" for k, v in machine_facts().items()]
    lines += [
        f"- load average (1 min) during the run: {load_line(loads)}",
        f"- pilotfish: {_git_describe()} at the end of the run (each section names the commit it started on)",
        f"- run finished {time.strftime('%Y-%m-%d %H:%M:%S %Z')}",
        "",
        "## Targets",
        "",
        markdown_table(["measure", "target", "measured", "status"], targets(results)),
        "",
    ]
    for s in results.sections:
        if s.skipped:
            continue
        lines += [
            f"## {s.title}",
            "",
            f"`{s.command}`" if s.command.startswith(".venv") else s.command,
            "",
            markdown_table(s.columns, s.rows) if s.rows else "(no rows)",
            "",
        ]
        ran = [f"{s.seconds:.0f} s"]
        if s.commit:
            ran.insert(0, f"pilotfish {s.commit}")
        if not math.isnan(s.load[0]):
            ran.append(f"load {s.load[0]:.2f} -> {s.load[1]:.2f}")
        lines += [f"Ran on {', '.join(ran)}.", ""]
        lines += [*s.notes, ""] if s.notes else []
    if results.profiles:
        lines += ["## Profiles", ""]
        for title, body in results.profiles:
            lines += [f"### {title}", "", body, ""]
    if results.errors:
        lines += ["## Errors during the run", ""] + [f"- {e}" for e in results.errors] + [""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.run_all", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=REPO / "BENCHMARKS.md")
    parser.add_argument("--quick", action="store_true", help="smoke scale (seconds, not minutes)")
    parser.add_argument("--no-sovereign", action="store_true")
    parser.add_argument(
        "--client",
        choices=CLIENTS,
        default="h2",
        help="the simulated proxies' gRPC client: bench/h2client.py or grpc.aio (default: %(default)s)",
    )
    parser.add_argument("--workdir", type=Path, help="keep profiles and server files here (default: a temp dir)")
    parser.add_argument(
        "--side-by-side",
        metavar="COMMIT",
        help="also run this checkout beside COMMIT (bench/bench_side_by_side.py; default: not run)",
    )
    parser.add_argument(
        "--side-by-side-title",
        default="",
        metavar="TITLE",
        help="that section's title (default: named after the commit)",
    )
    parser.add_argument(
        "--only",
        nargs="+",
        default=[],
        metavar="WORD",
        help="run only the sections whose title contains one of these words (case-insensitive), e.g. "
        "`--only Churn Rollout`; the file then has those sections and the targets they measure",
    )
    args = parser.parse_args(argv)
    scale = replace(
        QUICK if args.quick else FULL,
        client=args.client,
        side_by_side=args.side_by_side,
        side_by_side_title=args.side_by_side_title,
    )
    if args.no_sovereign:
        scale = replace(scale, sovereign=False)
    os.chdir(REPO)
    if args.workdir is not None:
        args.workdir.mkdir(parents=True, exist_ok=True)
        results = run_all(scale, out=args.out, workdir=args.workdir, only=args.only)
    else:
        with tempfile.TemporaryDirectory(prefix="pilotfish-bench-all-") as tmp:
            results = run_all(scale, out=args.out, workdir=Path(tmp), only=args.only)
    return 1 if results.errors else 0


if __name__ == "__main__":
    sys.exit(main())
