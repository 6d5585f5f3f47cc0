"""A tiny run of bench/bench_http_ports.py, so the harness cannot rot: every row there, each
variant answered every request (the load raises on an HTTP error), no timing asserted."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

_ROOT = str(Path(__file__).resolve().parents[2])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from bench.bench_http_ports import COLUMNS, run_http_ports  # noqa: E402

pytestmark = pytest.mark.e2e


def test_the_http_ports_benchmark_compares_before_and_now_on_each_route_and_load() -> None:
    rows = run_http_ports(clients=2, seconds=0.3, rounds=1)
    assert len(rows) == 8 and all(len(row) == len(COLUMNS) for row in rows)
    assert [row[0] for row in rows] == ["before", "now"] * 4
    assert {row[1] for row in rows} == {"GET /healthz (registry)", "POST /v3/discovery:clusters"}
    assert all(float(row[5]) > 0 for row in rows)  # requests per second: each variant answered
