"""Subsetting: balance and churn of Ringsteady vs the SRE book's algorithm vs random subsets.

In-process, no I/O. For each (proxies m, backends n, subset size k), proxies 0..m-1 each choose k of
backends 0..n-1 with three algorithms:

- ``ringsteady``: pilotfish.build.subsetting (:class:`~pilotfish.build.subsetting.Ring`, one ring per backend set);
- ``sre-book``: deterministic subsetting from *Site Reliability Engineering* (O'Reilly 2016), ch. 20:
  ``subset_count = n // k``; proxy c shuffles the backend list with ``random.seed(c // subset_count)``
  and takes slice ``c % subset_count`` of size k (backends listed by index, as a control plane would);
- ``random``: each proxy draws k backends at random, seeded by (seed, proxy): what a control plane
  without a subsetting algorithm does, re-drawn whenever the backend list changes.

Then measures:

- balance: connections per backend (how many proxies chose it): mean, min, max, max / mean and
  min / max;
- churn when one backend is added (index n, what a dense index table gives the next backend) and
  when one is removed (``--removals`` backends chosen at random, seeded, each removed from the
  original set in turn; averaged): the share of proxies whose subset changed, the mean number of
  entries changed per proxy (a backend out and another in counts one), the most for any proxy;
- the time to compute every proxy's subset once (the algorithm's own cost, median of 3).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pilotfish.build.subsetting import Ring

__all__ = ["ALGORITHMS", "DEFAULT_GRID", "SUBSETTING_COLUMNS", "Churn", "run_subsetting"]

SUBSETTING_COLUMNS = [
    "algorithm",
    "proxies",
    "backends",
    "k",
    "conns / backend (mean)",
    "min",
    "max",
    "max / mean",
    "min / max",
    "add 1: proxies changed %",
    "add 1: entries changed / proxy",
    "add 1: most changed",
    "remove 1: proxies changed %",
    "remove 1: entries changed / proxy",
    "remove 1: most changed",
    "all subsets ms",
]

DEFAULT_GRID: tuple[tuple[int, int, int], ...] = (
    (100, 10, 3),
    (1000, 100, 10),
    (10000, 1000, 3),
    (10000, 1000, 20),
    (10000, 1000, 100),
)
"""(proxies, backends, k) rows of the subsetting comparison, up to 10,000 x 1,000 (k = 3 as in its e2e test)."""

Subsets = list[frozenset[int]]
Algorithm = Callable[[int, Sequence[int], int, int], Subsets]
"""(proxies, backends sorted by index, k, seed) -> every proxy's subset."""


def ringsteady(proxies: int, backends: Sequence[int], k: int, seed: int) -> Subsets:
    ring = Ring(backends)
    return [frozenset(ring.subset(proxy, k)) for proxy in range(proxies)]


def sre_book(proxies: int, backends: Sequence[int], k: int, seed: int) -> Subsets:
    subset_count = max(1, len(backends) // k)
    rounds: dict[int, list[int]] = {}
    out = []
    for proxy in range(proxies):
        round_ = proxy // subset_count
        shuffled = rounds.get(round_)
        if shuffled is None:
            shuffled = rounds[round_] = list(backends)
            random.Random(round_).shuffle(shuffled)
        start = (proxy % subset_count) * k
        out.append(frozenset(shuffled[start : start + k]))
    return out


def random_subsets(proxies: int, backends: Sequence[int], k: int, seed: int) -> Subsets:
    size = min(k, len(backends))
    return [frozenset(random.Random(seed * 1_000_003 + proxy).sample(backends, size)) for proxy in range(proxies)]


ALGORITHMS: dict[str, Algorithm] = {"ringsteady": ringsteady, "sre-book": sre_book, "random": random_subsets}


@dataclass(frozen=True, slots=True)
class Churn:
    """What one change of the backend set did to the proxies' subsets."""

    changed_share: float
    """Share of proxies whose subset changed."""
    entries_per_proxy: float
    """Entries of a proxy's subset that changed (a backend out and another in counts one), mean over all
    proxies."""
    most: int
    """The most entries changed in any one proxy's subset."""


def churn(before: Subsets, after: Subsets) -> Churn:
    # A swap is one entry changed; so is a subset that only grew or only shrank by one.
    changes = [max(len(old - new), len(new - old)) for old, new in zip(before, after, strict=True)]
    return Churn(sum(1 for c in changes if c) / len(changes), statistics.fmean(changes), max(changes))


def _mean(values: Sequence[Churn]) -> Churn:
    return Churn(
        statistics.fmean(c.changed_share for c in values),
        statistics.fmean(c.entries_per_proxy for c in values),
        max(c.most for c in values),
    )


def run_one(name: str, *, proxies: int, backends: int, k: int, removals: int, seed: int) -> list[Any]:
    """One row of :data:`SUBSETTING_COLUMNS`."""
    algorithm = ALGORITHMS[name]
    base = list(range(backends))
    times = []
    for _ in range(3):
        started = time.perf_counter()
        subsets = algorithm(proxies, base, k, seed)
        times.append(time.perf_counter() - started)
    count = [0] * backends
    for chosen in subsets:
        for backend in chosen:
            count[backend] += 1
    mean = statistics.fmean(count)
    added = churn(subsets, algorithm(proxies, [*base, backends], k, seed))
    rnd = random.Random(seed)
    removed = _mean(
        [
            churn(subsets, algorithm(proxies, [b for b in base if b != gone], k, seed))
            for gone in rnd.sample(base, min(removals, backends))
        ]
    )
    return [
        name,
        proxies,
        backends,
        k,
        round(mean, 1),
        min(count),
        max(count),
        round(max(count) / mean, 3),
        round(min(count) / max(count), 3),
        round(100 * added.changed_share, 1),
        round(added.entries_per_proxy, 3),
        added.most,
        round(100 * removed.changed_share, 1),
        round(removed.entries_per_proxy, 3),
        removed.most,
        round(statistics.median(times) * 1000, 1),
    ]


def run_subsetting(
    *,
    grid: Sequence[tuple[int, int, int]] = DEFAULT_GRID,
    removals: int = 5,
    seed: int = 1,
    on_row: Callable[[list[Any]], None] | None = None,
) -> list[list[Any]]:
    """Every algorithm on every (proxies, backends, k) of ``grid``, side by side."""
    rows = []
    for proxies, backends, k in grid:
        for name in ALGORITHMS:
            rows.append(run_one(name, proxies=proxies, backends=backends, k=k, removals=removals, seed=seed))
            if on_row is not None:
                on_row(rows[-1])
    return rows


def notes(removals: int) -> list[str]:
    return [
        "In-process, no I/O (src/pilotfish/build/subsetting.py against two baselines in bench/bench_subsetting.py). "
        "Proxies 0..m-1 and backends 0..n-1 are dense indices, as pilotfish's index tables give them. "
        '`ringsteady`: Ringsteady (docs/architecture.md, "Subsetting"). `sre-book`: the deterministic subsetting of '
        "*Site Reliability Engineering*, ch. 20 (shuffle the backend list with seed `proxy // (n // k)`, take "
        "slice `proxy % (n // k)`). `random`: each proxy samples k backends, seeded per proxy, re-drawn on a "
        "change. Balance: connections per backend (proxies that chose it). Churn: `add 1` adds backend n; "
        f"`remove 1` removes one of {removals} backends picked at random (seeded), each in turn, averaged "
        "(`most changed`: the most for any proxy in any of them). `entries changed / proxy`: entries of a "
        "proxy's subset that changed (one backend out and another in counts one), mean over all proxies. "
        "`all subsets ms`: every proxy's subset computed once, as a set (Ringsteady: the ring is sorted once, "
        "then one bisect per proxy), median of 3.",
        "`random`'s small churn when a backend is added (for k well below n) is Python's `random.sample` at work, "
        "not a property of random subsetting one could rely on: it draws list positions from the same random bits "
        "while n and n + 1 have the same bit length, and the newcomer is last in the list, so only draws of "
        "position n change. Removing a backend shifts the positions after it, and most subsets are re-drawn.",
    ]


def main(argv: list[str] | None = None) -> int:
    from bench.report import print_table

    parser = argparse.ArgumentParser(prog="python -m bench.bench_subsetting", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--grid",
        nargs="+",
        default=[f"{m}:{n}:{k}" for m, n, k in DEFAULT_GRID],
        help="PROXIES:BACKENDS:K triples (default: %(default)s)",
    )
    parser.add_argument("--removals", type=int, default=5, help="backends removed in turn for the churn (averaged)")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    grid = []
    for triple in args.grid:
        m, n, k = (int(x) for x in triple.split(":"))
        grid.append((m, n, k))
    rows = run_subsetting(
        grid=grid, removals=args.removals, seed=args.seed, on_row=lambda row: print_table(SUBSETTING_COLUMNS, [row])
    )
    print()
    print_table(SUBSETTING_COLUMNS, rows)
    for note in notes(args.removals):
        print(note)
    return 0


if __name__ == "__main__":
    sys.exit(main())
