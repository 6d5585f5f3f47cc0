"""A tiny run of bench/bench_side_by_side.py against the commit before the package layout, so the
mechanism that runs another commit beside this one cannot rot: that commit's server takes the
options every benchmark server is started with, its own bench_build (whose imports are those of
its layout) gives the build rows, and the checkout is gone afterwards. No timing is asserted."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

_ROOT = str(Path(__file__).resolve().parents[2])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from bench.bench_side_by_side import BUILD_COLUMNS, FANOUT_COLUMNS, run_side_by_side  # noqa: E402
from bench.procs import REPO  # noqa: E402
from bench.workload import Workload  # noqa: E402

pytestmark = pytest.mark.e2e

BEFORE_LAYOUT = "586ca12"
"""The parent of the commit that moved the code into packages (server/ split into app/, api/, xds/, ...)."""


def test_the_commit_before_the_package_layout_runs_beside_this_one() -> None:
    done = run_side_by_side(
        commit=BEFORE_LAYOUT,
        proxies=[5],
        xds=["sotw"],
        rounds=1,
        changes=2,
        workload=Workload(services=20, endpoints=2, listeners=3),
        build_sizes=["50:200"],
        build_repeat=1,
    )

    col = FANOUT_COLUMNS.index
    assert [row[col("pilotfish")].split()[0] for row in done.fanout_rows] == [
        BEFORE_LAYOUT,
        subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True
        ).stdout.strip(),
    ]
    for row in done.fanout_rows:
        assert row[col("failures")] == 0 and row[col("stream errors")] == 0 and row[col("runs")] == 1
    # Two build rows (one per commit, each measured by its own bench_build) and their ratio.
    assert [row[BUILD_COLUMNS.index("runs")] for row in done.build_rows] == [1, 1, "-"]
    total = BUILD_COLUMNS.index("total s (median, range)")
    assert all(float(row[total].split()[0]) > 0 for row in done.build_rows[:2])
    # (Other benchmarks' checkouts, of other commits, may be there while they run.)
    worktrees = subprocess.run(["git", "worktree", "list"], cwd=REPO, capture_output=True, text=True).stdout
    assert not [line for line in worktrees.splitlines() if "pilotfish-before-" in line and BEFORE_LAYOUT in line]
