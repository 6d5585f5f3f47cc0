"""The benchmarks' one summary of broken streams (bench/fanout.py ``stream_error_notes``): what a
reader of BENCHMARKS.md learns about failures must add up over the runs it pools."""

from __future__ import annotations

import sys
from pathlib import Path

_ROOT = str(Path(__file__).resolve().parents[2])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from bench.fanout import FanoutResult, stream_error_notes  # noqa: E402


def _run(errors: dict[str, int], during: dict[str, int], examples: dict[str, str]) -> FanoutResult:
    return FanoutResult(
        server="pilotfish",
        proxies=10,
        change="registry",
        quiet_ms=100,
        sync_seconds=1.0,
        stream_errors=errors,
        errors_during_changes=during,
        error_examples=examples,
    )


def test_runs_are_pooled_per_status_with_an_example() -> None:
    runs = [
        _run({"UNAVAILABLE": 2}, {"UNAVAILABLE": 1}, {"UNAVAILABLE": "connection reset"}),
        _run({"UNAVAILABLE": 3, "CANCELLED": 1}, {}, {"CANCELLED": "cancelled"}),
    ]
    assert stream_error_notes("now TLS, 10 proxies", runs) == [
        "Stream errors, now TLS, 10 proxies: 5 x UNAVAILABLE over 2 runs (during the changes: 1), "
        "e.g. `connection reset`",
        "Stream errors, now TLS, 10 proxies: 1 x CANCELLED over 2 runs (during the changes: 0), e.g. `cancelled`",
    ]


def test_a_single_clean_run_says_nothing_and_a_long_example_is_cut() -> None:
    assert stream_error_notes("x", [_run({}, {}, {})]) == []
    [line] = stream_error_notes("x", [_run({"INTERNAL": 1}, {"INTERNAL": 1}, {"INTERNAL": "y" * 500})])
    assert line == f"Stream errors, x: 1 x INTERNAL (during the changes: 1), e.g. `{'y' * 200}`"
