"""Summaries of measured samples and of the machine's load while they were taken.

Every benchmark reports latencies as nearest-rank percentiles (:func:`percentile`: a reported p99
is a latency some proxy really saw, never an interpolation) and notes the 1-minute load average
beside its rows (:func:`load_1min`): the machine is shared, and a row measured under load says so.
Runs repeated in turn are summarized by their median and range (:func:`spread`), and a variant is
compared with its baseline as a plain quotient (:func:`ratio`).
"""

from __future__ import annotations

import math
import os
import statistics
from collections.abc import Sequence

__all__ = ["load_1min", "load_average", "percentile", "ratio", "spread"]


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100) by nearest rank; NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


def spread(values: Sequence[float]) -> tuple[float, float, float]:
    """(median, lowest, highest) of repeated runs' values; NaN for each when there are none."""
    if not values:
        return math.nan, math.nan, math.nan
    return statistics.median(values), min(values), max(values)


def ratio(value: float, baseline: float, *, digits: int = 2, suffix: str = "") -> str:
    """``value / baseline`` to ``digits`` places, then ``suffix``; ``-`` when either is missing, zero or NaN."""
    if not value or not baseline or math.isnan(value) or math.isnan(baseline):
        return "-"
    return f"{value / baseline:.{digits}f}{suffix}"


def load_average() -> tuple[float, float, float]:
    """The machine's load average over 1, 5 and 15 minutes."""
    return os.getloadavg()


def load_1min() -> float:
    """The machine's load average over the last minute."""
    return os.getloadavg()[0]
