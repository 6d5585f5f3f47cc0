"""bench/bench_subsetting.py at a tiny grid, so the subsetting comparison cannot rot.

Asserts what the table promises (every algorithm on every row, the columns it names) and what
Ringsteady guarantees in it (at most one entry changed per proxy on an add or a removal), never
a timing.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

_ROOT = str(Path(__file__).resolve().parents[2])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from bench.bench_subsetting import ALGORITHMS, SUBSETTING_COLUMNS, run_subsetting  # noqa: E402
from bench.procs import REPO  # noqa: E402


def test_every_algorithm_gets_a_row_and_ringsteady_changes_one_entry_at_most() -> None:
    grid = ((20, 5, 2), (40, 10, 3), (64, 16, 20))
    rows = run_subsetting(grid=grid, removals=3)
    col = SUBSETTING_COLUMNS.index
    assert [(row[col("algorithm")], row[col("proxies")], row[col("backends")], row[col("k")]) for row in rows] == [
        (name, m, n, k) for m, n, k in grid for name in ALGORITHMS
    ]
    for row in rows:
        assert len(row) == len(SUBSETTING_COLUMNS)
        proxies, backends, k = row[col("proxies")], row[col("backends")], row[col("k")]
        assert row[col("conns / backend (mean)")] == round(proxies * min(k, backends) / backends, 1)
        assert row[col("min")] <= row[col("max")]
        if row[col("algorithm")] == "ringsteady":
            assert row[col("add 1: most changed")] <= 1 and row[col("remove 1: most changed")] <= 1
    # n <= k: every proxy holds every backend, whichever the algorithm.
    for row in rows[-len(ALGORITHMS) :]:
        assert row[col("min")] == row[col("max")] == 64


def test_the_command_prints_its_table() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "bench.bench_subsetting", "--grid", "20:5:2", "--removals", "1"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert "| " + " | ".join(SUBSETTING_COLUMNS) + " |" in lines
    assert {line.split("|")[1].strip() for line in lines if line.startswith("| ") and "| 20 | 5 | 2 |" in line} == set(
        ALGORITHMS
    )
