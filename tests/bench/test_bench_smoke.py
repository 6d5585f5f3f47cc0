"""A tiny run of the fleet simulator and of every benchmark, so the harness cannot rot.

These assert behaviour (every simulated proxy converged, nothing failed, each table has the
columns it promises), never how fast anything was: timings belong in BENCHMARKS.md. Sovereign is
left out (it lives in its own venv, installed by `make bench`); a real Envoy is not.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

# bench/ lives at the repository root (not a conftest.py: tests/unit imports its own as `conftest`).
_ROOT = str(Path(__file__).resolve().parents[2])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from bench.procs import REPO  # noqa: E402
from bench.run_all import QUICK, run_all  # noqa: E402

from bench import (  # noqa: E402
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
    bench_status,
    bench_storm,
    bench_subsetting,
    bench_ttl,
    fanout,
    push_floor,
)

pytestmark = pytest.mark.e2e


def _header(columns: list[str]) -> str:
    return "| " + " | ".join(columns) + " |"


@pytest.mark.parametrize("client", ["h2", "grpc"])
def test_fanout_command_converges_every_proxy_and_prints_its_table(client: str) -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.fanout",
            "--proxies",
            "5",
            "--changes",
            "2",
            "--services",
            "20",
            "--listeners",
            "3",
            "--client",
            client,
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert _header(fanout.FANOUT_COLUMNS) in lines
    row = next(line for line in lines if line.startswith("| pilotfish | 5 |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[fanout.FANOUT_COLUMNS.index("failures")] == "0"
    assert cells[fanout.FANOUT_COLUMNS.index("stream errors")] == "0"


# Every benchmark in turn, each starting its servers and simulated fleets: ~110 s on an idle 2-core
# machine, past the default 180 s hang guard with a fan-out running beside it. The guard is for hangs.
@pytest.mark.timeout(600)
def test_every_benchmark_runs_at_smoke_scale(tmp_path: Path) -> None:
    out = tmp_path / "BENCHMARKS.md"
    results = run_all(QUICK, out=out, workdir=tmp_path)

    assert results.errors == []
    # Fan-out (pilotfish through the registry, with either event log level; pilotfish and the
    # naive server through the file): every proxy ACKed every change, and nothing broke.
    assert set(results.fanouts) == {("pilotfish", 5), ("pilotfish-changes", 5), ("pilotfish-file", 5), ("naive", 5)}
    for key, result in results.fanouts.items():
        assert result.failures == 0
        assert len(result.latencies) == 5 * QUICK.changes
        assert len(result.cpu_per_push) == QUICK.changes
        assert sum(result.errors_during_changes.values()) == 0, (
            key,
            result.errors_during_changes,
            result.error_examples,
        )
    # HTTP/2 cores: both served every proxy every change, both held the attack run.
    comparison = results.core_comparison
    assert comparison is not None
    assert sorted(run.core for run in comparison.runs) == ["h2", "own"]
    for run in comparison.runs:
        assert run.result.failures == 0
        assert len(run.result.latencies) == 5 * QUICK.changes
    assert {core: [t["held"] for t in tests.values()] for core, tests in comparison.abuse.items()} == {
        "own": [True],
        "h2": [True],
    }
    # Reconnect storm: both phases synced every proxy; the server broke no stream.
    assert [row[0] for row in results.storm_rows] == ["cold connect", "restart (all 4 types changed)"]
    for row in results.storm_rows:
        assert row[bench_storm.STORM_COLUMNS.index("failures")] == 0
        assert row[bench_storm.STORM_COLUMNS.index("streams broken by the server")] == 0
    # Build: one row per size.
    clusters, endpoints = (bench_build.BUILD_COLUMNS.index(c) for c in ("clusters", "endpoints"))
    assert [[row[clusters], row[endpoints]] for row in results.build_rows] == [list(s) for s in QUICK.build_sizes]
    # Hardening and TLS: plaintext, TLS and mTLS, every proxy served.
    col = bench_hardening.HARDENING_COLUMNS.index
    assert [row[col("transport")] for row in results.hardening_rows] == ["plaintext", "TLS", "mTLS"]
    for row in results.hardening_rows:
        assert row[col("failures")] == 0 and row[col("stream errors")] == 0
    # Incremental xDS: SotW and delta, every proxy served; a one-endpoint change costs one
    # assignment, on either protocol (a full-state EDS response of the 50 here would be > 2 KB).
    col = bench_incremental.INCREMENTAL_COLUMNS.index
    assert [row[col("xds")] for row in results.incremental_rows] == ["sotw", "delta"]
    for row in results.incremental_rows:
        assert row[col("failures")] == 0 and row[col("stream errors")] == 0
        assert 0 < row[col("bytes / proxy / change (max)")] <= 2048
    # Status tracking: the admin API on, and a status page polling it, every proxy served every
    # change; with every proxy connected, each admin endpoint answered and counted them all SYNCED.
    col = bench_status.STATUS_COLUMNS.index
    assert [row[col("admin API")] for row in results.status_rows] == ["on", "page open"]
    for row in results.status_rows:
        assert row[col("failures")] == 0 and row[col("stream errors")] == 0
    assert int(results.status_rows[-1][col("page polls")]) >= 1
    col = bench_status.ADMIN_COLUMNS.index
    assert [row[col("endpoint")] for row in results.status_admin_rows] == [f"`{p}`" for p in bench_status.ENDPOINTS]
    for row in results.status_admin_rows:
        assert row[col("requests")] >= 1 and row[col("response KB")] > 0
        assert row[col("proxies SYNCED when asked")] == "5 of 5 (each of 1 runs)"
    worktrees = subprocess.run(["git", "worktree", "list"], cwd=REPO, capture_output=True, text=True).stdout
    assert "pilotfish-before-" not in worktrees
    # Subsetting: every algorithm on every (proxies, backends, k) of the grid.
    assert [row[:4] for row in results.subsetting_rows] == [
        [name, m, n, k] for m, n, k in QUICK.subsetting_grid for name in bench_subsetting.ALGORITHMS
    ]
    # Replicas on etcd: one etcd-backed replica, three on one etcd (the proxies spread
    # over them), the in-memory registry; every proxy ACKed every write, none broke during them.
    assert [(run.registry, run.replicas) for run in results.replica_runs] == list(bench_replicas.FANOUT_VARIANTS)
    for replica_run in results.replica_runs:
        assert replica_run.result.replicas == replica_run.replicas
        assert replica_run.result.failures == 0
        assert len(replica_run.result.latencies) == QUICK.replicas_proxies * QUICK.replicas_writes
        assert sum(replica_run.result.errors_during_changes.values()) == 0
        assert len(replica_run.result.etcd_cpu_per_push) == (
            QUICK.replicas_writes if replica_run.registry == "etcd" else 0
        )
    # ... and the write rate: every registration answered 2xx, in memory and on etcd.
    assert [w.registry for w in results.write_rates] == ["memory", "etcd"]
    for rate in results.write_rates:
        assert rate.failed == {} and len(rate.latencies) == QUICK.write_count
    # Churn: now with a cap and before, every churning proxy synced and left; the server
    # remembers at most the cap of them (the one before: all, under its fixed 10,000).
    churn_count = int(QUICK.churn_rate * QUICK.churn_seconds)
    assert [(r.server, r.max_disconnected) for r in results.churn] == [("now", 20), ("before", None)]
    for churned in results.churn:
        assert (churned.departed, churned.never_synced) == (churn_count, 0)
        assert churned.samples and all(rss > 0 for _, _, rss in churned.samples)
    assert [r.remembered for r in results.churn] == [20, churn_count]
    _check_rollout(results.rollout)
    _check_memo(results.memo)
    assert [(p.source, p.phase) for p in results.docker] == [
        ("docker", "start"),
        ("docker", "stop"),
        ("registry", "register"),
        ("registry", "deregister"),
    ]
    for phase in results.docker:  # every round reached Envoy, the burst in at least one build
        assert len(phase.to_envoy) == QUICK.docker_rounds and min(phase.builds) >= 1, phase
    # The snapshot file: an edit of one endpoint parses that one resource, in each format.
    assert [(row[1], row[-1]) for row in results.file] == [("json", 1), ("yaml", 1)]
    # Real Envoy: every change applied and ACKed.
    (envoy,) = results.envoy
    assert envoy.missed == 0
    assert len(envoy.acks) == len(envoy.applied) == QUICK.envoy_changes

    text = out.read_text()
    for columns in (
        fanout.FANOUT_COLUMNS,
        bench_build.BUILD_COLUMNS,
        bench_storm.STORM_COLUMNS,
        bench_envoy.ENVOY_COLUMNS,
        bench_replicas.REPLICA_COLUMNS,
        bench_replicas.WRITE_COLUMNS,
        bench_memo.MEMO_COLUMNS,
        bench_churn.CHURN_COLUMNS,
        bench_rollout.LRS_COLUMNS,
        bench_rollout.WAVE_COLUMNS,
        bench_rollout.ROLLOUT_COLUMNS,
        bench_rollout.EDS_COLUMNS,
        bench_rollout.GATE_COLUMNS,
        bench_docker.COLUMNS,
        bench_file.COLUMNS,
        bench_ttl.TtlBench.COLUMNS,
    ):
        assert _header(columns) in text
    for heading in (
        "## Machine",
        "## Targets",
        "## Fan-out",
        "## Memory",
        "## Snapshot build",
        "## Reconnect storm",
        "## File change to a real Envoy",
        "## Side by side",
        "## Ratios",
        "## HTTP/2 core",
        "## Hardening and TLS",
        "## Incremental xDS",
        "## Subsetting",
        "## Status tracking",
        "## Admin API with 5 connected proxies",
        "## Replicas on etcd",
        "## Registry write rate",
        "## Response memos",
        "## Churn",
        "## Rollout: load reports (LRS)",
        "## Rollout: a CDS change in four waves",
        "## Rollout: server CPU per CDS change",
        "## Rollout: an endpoint change while a canary wave bakes",
        "## Rollout: load reports from 5 proxies every 0.5 s to a server with --rollout and its health gate on",
        "## TTLs: heartbeats for 5 proxies at a 1.5 s TTL",
    ):
        assert heading in text
    # TTLs: both protocols measured, and the server with the TTL renewed it (counted by the server).
    assert results.ttl is not None and {w.xds for w in results.ttl.windows} == {"sotw", "delta"}
    assert all(w.refreshes > 0 for w in results.ttl.windows)
    assert _header(bench_status.ADMIN_COLUMNS) in text
    assert "Status page polls that failed" not in text
    # The machine is stated: cores, CPU, memory, OS, Python, the Envoy binary's version, the load during the run.
    for fact in (
        "- cores: ",
        "- CPU model: ",
        "- memory: ",
        "- OS: ",
        "- Python: ",
        "- Envoy: 1.",
        "- load average (1 min) during the run: ",
    ):
        assert fact in text, fact
    assert "load average (1 min) during the run: not sampled" not in text


def _check_rollout(rollout: bench_rollout.RolloutBench | None) -> None:
    """Rollout: each fleet's load reports all taken, none dropped, in both LRS windows; the CDS
    change went out in its four waves, every proxy ACKing the candidate in its own wave and not
    before it; every endpoint change reached every proxy, with and without a rollout baking."""
    assert rollout is not None
    assert [w.reporting for w in rollout.lrs] == [bench_rollout.PLAIN, bench_rollout.OTHER]
    for window in rollout.lrs:
        assert window.answered == QUICK.rollout_proxies
        assert window.sent > 0 and window.dropped == 0
        assert window.total_taken == window.total_sent >= window.sent
    assert [r.outcome for r in rollout.rollouts] == ["rollout_completed"] * QUICK.rollout_rollouts
    waves = rollout.waves()
    assert [w.wave for w in waves] == ["canary", "5%", "25%", "100%"]
    assert sum(w.members for w in waves) == QUICK.rollout_proxies
    assert waves[0].members == 1  # the canary: sim-00000
    for wave in waves:
        assert (wave.early, wave.missing, wave.announced) == (0, 0, wave.members)
        assert len(wave.latencies) == wave.members * QUICK.rollout_rollouts
    assert all(r.failures == 0 for r in rollout.plain_pushes)
    assert rollout.still_baking
    for runs in rollout.eds.values():
        assert len(runs) == QUICK.rollout_rounds
        assert all(r.failures == 0 and len(r.latencies) == QUICK.rollout_proxies for r in runs)
    assert rollout.stream_errors == {}
    # LRS beside a health gate: the plain server and the rollout server took their fleets'
    # reports over the same window while the canary wave baked, the gate's verdict read.
    assert [w.server for w in rollout.gate] == [bench_rollout.PLAIN, bench_rollout.GATED]
    for gated in rollout.gate:
        assert gated.answered == QUICK.rollout_proxies
        assert gated.sent > 0 and gated.taken > 0 and gated.dropped == 0 and gated.errors == {}
    assert rollout.gate_baking
    assert rollout.gate[1].health is not None and "verdict" in rollout.gate[1].health


def _check_memo(runs: list[bench_memo.MemoRun]) -> None:
    """Response memos: the fleet at one version shares one encoding per push, with a peer asking for
    name sets beside it or not, the same bytes either way."""
    assert [run.peer for run in runs] == [False, True]
    for run in runs:
        assert run.encodings == [1] * QUICK.memo_pushes and run.sync_encodings == 1
    assert runs[0].encoded_bytes == runs[1].encoded_bytes


def test_grpc_floor_runs_every_round_to_completion() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "bench.grpc_floor", "--proxies", "5", "--rounds", "2"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    rows = [line for line in done.stdout.splitlines() if line.startswith("| 5 |")]
    assert [row.split("|")[2].strip() for row in rows] == ["1", "2"]  # both rounds: every stream answered


def test_push_floor_pushes_to_every_proxy_beside_pilotfish_sotw_and_delta() -> None:
    """The floor server (pilotfish's own transport, shared bytes out, ACKs compared or parsed) is
    ACKed by every simulated proxy on every push, over SotW and delta, with every proxy subscribed
    to the endpoints of 20 clusters, and pilotfish's fan-out runs beside it. (run_all's smoke runs
    the floor without clusters.)"""
    done = subprocess.run(
        [
            *(sys.executable, "-m", "bench.push_floor", "--proxies", "5", "--rounds", "1", "--pushes", "2"),
            *("--event-log-levels", "changes", "--clusters", "20"),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr  # 0: no proxy missed a push
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in done.stdout.splitlines()]
    col = push_floor.COLUMNS.index
    table = {(row[0], row[1]): row for row in rows if len(row) == len(push_floor.COLUMNS) and row[2] == "5"}
    assert set(table) == {(s, x) for s in ("floor", "pilotfish (changes)") for x in ("sotw", "delta")}
    for row in table.values():
        assert row[col("failures")] == "0"  # every proxy ACKed every push
        assert float(row[col("CPU s / push (median)")]) >= 0 and float(row[col("p99 ms (median)")]) > 0
        assert float(row[col("bytes / proxy / push")]) > 100  # an EDS response each


def test_the_refresh_floor_sends_every_proxy_its_refreshes() -> None:
    """The floor of heartbeats (``push_floor --refresh``) sends each proxy the shared response once
    per period, and the proxies receive them, over SotW and delta."""
    done = subprocess.run(
        [
            *(sys.executable, "-m", "bench.push_floor", "--proxies", "5", "--refresh", "0.5", "--seconds", "2"),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    col = push_floor.REFRESH_COLUMNS.index
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in done.stdout.splitlines()]
    table = {row[1]: row for row in rows if len(row) == len(push_floor.REFRESH_COLUMNS) and row[0] == "floor"}
    assert set(table) == {"sotw", "delta"}, done.stdout
    for row in table.values():
        assert row[col("refreshes / s")] == "10"  # 5 proxies, each every 0.5 s
        assert float(row[col("received / s")]) >= 5, row  # they arrive (a margin for a busy machine)


def test_bench_memo_counts_one_encoding_per_push_for_a_fleet() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "bench.bench_memo", "--proxies", "20", "--services", "30", "--pushes", "2", "--peer"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    pushes = [line for line in done.stdout.splitlines() if line.startswith("push ")]
    assert len(pushes) == 2 and all(line.split(": ")[1].startswith("1 encodings") for line in pushes), done.stdout
