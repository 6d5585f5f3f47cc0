"""The debounce (:mod:`pilotfish.reconcile.debounce`), with time as plain numbers (no sleeping)."""

from __future__ import annotations

from pilotfish.reconcile.debounce import Debouncer


def run_debounce(
    change_times: list[float],
    quiet: float = 0.1,
    max_delay: float = 1.0,
    build_time: float = 0.0,
    until: float = 10.0,
    step: float = 0.001,
) -> list[float]:
    """Feed changes at the given times; return when builds started."""
    debouncer = Debouncer(quiet=quiet, max_delay=max_delay)
    builds: list[float] = []
    pending = sorted(change_times)
    busy_until = -1.0
    t = 0.0
    while t <= until:
        while pending and pending[0] <= t:
            debouncer.change(pending.pop(0))
        if debouncer.building and t >= busy_until:
            debouncer.finish_build()
        if debouncer.due(t):
            debouncer.start_build()
            builds.append(round(t, 3))
            busy_until = round(t + build_time, 6)
        t = round(t + step, 6)
    return builds


def test_one_change_builds_after_the_quiet_period() -> None:
    assert run_debounce([1.0]) == [1.1]


def test_a_hundred_changes_within_50ms_make_one_build() -> None:
    assert run_debounce([1.0 + i * 0.0005 for i in range(100)]) == [1.15]


def test_a_steady_stream_of_changes_builds_every_max_delay() -> None:
    builds = run_debounce([i * 0.05 for i in range(1, 61)], until=4.0)  # every 50 ms for 3 s
    # Max delay 1 s after each burst's first change (the change at a build's instant joins it).
    assert builds == [1.05, 2.1, 3.1]


def test_a_change_during_a_build_is_built_right_after() -> None:
    builds = run_debounce([1.0, 1.15], build_time=0.3)
    assert builds == [1.1, 1.4]  # 1.15 arrived mid-build; its quiet period ended at 1.25


def test_nothing_pending_means_no_build() -> None:
    debouncer = Debouncer(quiet=0.1, max_delay=1.0)
    assert debouncer.deadline() is None and not debouncer.due(100.0)
