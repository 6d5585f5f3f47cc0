"""The debounce (:mod:`pilotfish.reconcile.debounce`), with time as plain numbers (no sleeping)."""

from __future__ import annotations

import itertools
from collections.abc import Iterable

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pilotfish.reconcile.debounce import ANY_CHANGE, Debouncer

Change = tuple[float, str]


def run_debounce(
    changes: Iterable[float | Change],
    *,
    quiet: float = 0.1,
    max_delay: float = 1.0,
    min_interval: float = 0.0,
    build_time: float = 0.0,
    until: float = 10.0,
    step: float = 0.001,
) -> list[float]:
    """Feed changes (a time, or a (time, key) pair) in order; return when builds started (to
    the ``step``: a deadline a float's rounding puts just past a step is met at the next one)."""
    debouncer = Debouncer(quiet=quiet, max_delay=max_delay, min_interval=min_interval)
    builds: list[float] = []
    pending = sorted(c if isinstance(c, tuple) else (c, ANY_CHANGE) for c in changes)
    busy_until = -1.0
    t = 0.0
    while t <= until:
        while pending and pending[0][0] <= t:
            at, key = pending.pop(0)
            debouncer.change(at, (key,))
        if debouncer.building and t >= busy_until:
            debouncer.finish_build()
        if debouncer.due(t):
            debouncer.start_build(t)
            builds.append(round(t, 3))
            busy_until = round(t + build_time, 6)
        t = round(t + step, 6)
    return builds


def test_a_lone_change_is_built_at_once() -> None:
    assert run_debounce([1.0]) == [1.0]
    assert run_debounce([1.0, 5.0]) == [1.0, 5.0]  # each alone in a quiet stretch


def test_a_burst_is_built_at_its_start_and_once_more_when_it_ends() -> None:
    # Leading edge for the first change, then the other 99 gathered into one trailing build.
    assert run_debounce([1.0 + i * 0.0005 for i in range(100)]) == pytest.approx([1.0, 1.15], abs=0.0015)


def test_a_steady_stream_of_changes_builds_every_max_delay() -> None:
    builds = run_debounce([i * 0.05 for i in range(1, 61)], until=4.0)  # every 50 ms for 3 s
    # At once, then max delay after each later burst's first change, then once it went quiet.
    assert builds == pytest.approx([0.05, 1.1, 2.15, 3.1], abs=0.0015)


def test_a_change_during_a_build_is_built_right_after() -> None:
    builds = run_debounce([1.0, 1.15], build_time=0.3)
    assert builds == [1.0, 1.3]  # 1.15 arrived mid-build (quiet before it): due at once, after the build


def test_builds_are_rate_limited_however_many_keys_change() -> None:
    changes = [(1.0 + i * 0.001, f"svc-{i}") for i in range(1000)]  # 1,000 services in 1 s, each once
    builds = run_debounce(changes, min_interval=0.1, until=3.0)
    assert len(builds) <= 11, builds
    assert all(b - a >= 0.1 - 1e-9 for a, b in itertools.pairwise(builds)), builds
    # Every change is built within the interval: the last, at 1.999, by 2.1.
    assert builds[0] == 1.0 and builds[-1] <= 1.999 + 0.1 + 1e-9, builds


def test_a_noisy_service_does_not_delay_a_quiet_one() -> None:
    noisy = [(1.0 + i * 0.01, "noisy") for i in range(500)]  # 100 changes a second for 5 s
    quiet = [(2.5, "quiet"), (3.7, "quiet")]
    builds = run_debounce(noisy + quiet, until=7.0)
    assert 2.5 in builds and 3.7 in builds, builds  # the quiet service's changes are built at once
    # The noisy one is batched on its own clock: at once, then once per max delay, then at its end.
    alone = run_debounce(noisy, until=7.0)
    assert len(alone) <= 7, alone
    assert len(builds) <= len(alone) + len(quiet), builds


def test_a_key_that_changes_again_soon_is_gathered_not_built_each_time() -> None:
    # Changes 60 ms apart: each is within the quiet period of the one before.
    assert run_debounce([(1.0, "a"), (1.06, "a"), (1.12, "a")]) == pytest.approx([1.0, 1.22], abs=0.0015)


def test_nothing_pending_means_no_build() -> None:
    debouncer = Debouncer(quiet=0.1, max_delay=1.0)
    assert debouncer.deadline() is None and not debouncer.due(100.0)


def test_what_the_debouncer_remembers_is_bounded_by_what_changed_within_the_quiet_period() -> None:
    debouncer = Debouncer(quiet=0.1, max_delay=1.0)
    for i in range(10_000):
        debouncer.change(i * 1.0, (f"svc-{i}",))  # a second apart: each forgotten by the next
        debouncer.start_build(i * 1.0)
        debouncer.finish_build()
    assert len(debouncer._seen) == 1  # (the last one only)


@given(
    st.lists(
        st.tuples(st.integers(0, 3000).map(lambda ms: ms / 1000), st.sampled_from(["a", "b", "c", "d"])),
        min_size=1,
        max_size=60,
    ),
    st.sampled_from([0.0, 0.05, 0.2]),
)
def test_every_change_is_built_within_the_max_delay_and_builds_respect_the_rate(
    changes: list[Change], min_interval: float
) -> None:
    builds = run_debounce(changes, min_interval=min_interval, until=6.0, step=0.005)
    assert all(b - a >= min_interval - 1e-9 for a, b in itertools.pairwise(builds)), builds
    for at, _ in changes:
        # Built by the first build at or after it, no later than max delay (+ the rate limit and a step).
        assert any(at <= b <= at + 1.0 + min_interval + 0.011 for b in builds), (at, builds)
