"""Source readiness (docs/architecture.md, publishing rule 1): nothing is published before every
expected source has reported its first complete state, since a snapshot built while etcd is still
unreachable would be "empty because not yet known" and take every proxy's configuration away.

A source may be expected only once another has reported (something read from the same place: the
subsetting indices in etcd are awaited once etcd is, and while etcd is away, etcd is what is
awaited). :class:`Readiness` also keeps which sources' latest input was refused where it was read
(an unreadable or invalid file), and why: the admin API and metrics show them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from typing import Protocol

__all__ = ["Readiness", "ReadinessView"]


class ReadinessView(Protocol):
    """What the admin API and metrics read of the sources' readiness."""

    def expected_sources(self) -> list[str]: ...

    def sources(self) -> list[str]: ...

    def has_reported(self, source: str) -> bool: ...

    def waiting_for(self) -> list[str]: ...

    @property
    def failing_sources(self) -> set[str]: ...

    @property
    def source_errors(self) -> Mapping[str, int]: ...

    @property
    def source_problems(self) -> Mapping[str, tuple[str, float]]: ...


class Readiness:
    """Which expected sources have reported, and which are failing (see the module docstring).
    ``after``: source -> the source it is awaited after; ``wall_clock``: when a refusal happened."""

    def __init__(
        self,
        expect: Iterable[str] = (),
        *,
        after: Mapping[str, str] | None = None,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self._after = dict(after or {})
        self._expected = frozenset(expect) | self._after.keys()
        self._reported: set[str] = set()
        self._wall_clock = wall_clock
        self.source_errors: dict[str, int] = {}
        """Per source: how many of its inputs were refused before reaching the reconciler."""
        self.failing_sources: set[str] = set()
        """Sources whose latest input was refused (the last good state of each keeps serving)."""
        self.source_problems: dict[str, tuple[str, float]] = {}
        """Per failing source: why its latest input was refused, and when (wall-clock seconds)."""

    def reported(self, source: str) -> None:
        """``source`` delivered a (whole) state: it is in, and no longer failing."""
        self._reported.add(source)
        self.failing_sources.discard(source)
        self.source_problems.pop(source, None)

    def refused(self, source: str, reason: str = "") -> None:
        """``source``'s latest input was refused (and reported) where it was read, for ``reason``."""
        self.source_errors[source] = self.source_errors.get(source, 0) + 1
        self.failing_sources.add(source)
        self.source_problems[source] = (reason, self._wall_clock())

    def expected_sources(self) -> list[str]:
        """Every source awaited before anything is published (file, etcd, ...)."""
        return sorted(self._expected)

    def sources(self) -> list[str]:
        """Every source known: those awaited, and those that reported or were refused without
        being awaited (the registry, whose state starts empty: it reports at start)."""
        return sorted(self._expected | self._reported | self.source_errors.keys())

    def has_reported(self, source: str) -> bool:
        """Whether ``source`` has delivered a whole state (it is in)."""
        return source in self._reported

    def waiting_for(self) -> list[str]:
        """The expected sources that have not reported their first complete state yet (one
        awaited after another only once that one has)."""
        missing = self._expected - self._reported
        return sorted(name for name in missing if self._after.get(name) not in missing)
