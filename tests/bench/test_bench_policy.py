"""bench/bench_policy.py at a tiny size, so the policy benchmark cannot rot.

Asserts what the tables promise (their rows and columns, each refusal a refusal), never a timing.
"""

from __future__ import annotations

import sys
from pathlib import Path

_ROOT = str(Path(__file__).resolve().parents[2])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from bench.bench_policy import AUTHORIZE_COLUMNS, GRANTS_COLUMNS, main, run_authorize, run_grants  # noqa: E402


def test_the_policy_tables_have_their_rows_and_columns() -> None:
    rows = run_authorize(1_000, 1)
    assert [(row[0], row[1]) for row in rows] == [
        (rule, shape) for rule in ("capture", "plain") for shape in ("'a' x N (no 'c')", "'/' x N")
    ]
    assert all(len(row) == len(AUTHORIZE_COLUMNS) and row[3] == "1,000" for row in rows)
    grants = run_grants(50, 3, 1)
    assert [row[2] for row in grants] == ["50", "100"] and all(len(row) == len(GRANTS_COLUMNS) for row in grants)
    assert main(["--length", "100", "--proxies", "10", "--grants", "2", "--repeat", "1"]) == 0
