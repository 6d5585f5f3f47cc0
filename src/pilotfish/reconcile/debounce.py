"""The debounce: when to build, given what changed and when.

Each change names what it touched (its *keys*: the services whose definition or endpoints
changed, or a key for a source's raw resources). Every key keeps its own clock:

- **leading edge**: a key that had been quiet for ``quiet`` seconds is due at once. A lone change
  in a quiet minute is built the moment it arrives, not after a quiet period.
- **trailing edge**: a key that changes again within ``quiet`` of its last change is gathered:
  due once it has been quiet for ``quiet``, or ``max_delay`` after the first change of its burst,
  whichever comes first. A burst still becomes one build.
- **a budget per key**: a key that keeps changing (an endpoint flapping many times a second) is
  batched on its own clock, and never holds back another key: a change to a quiet service is
  due at once even while a noisy one is mid-burst (one global quiet period would make every
  service wait for the noisiest).
- **a rate limit on builds**: builds start at least ``min_interval`` apart (``--max-builds-per-s``),
  so a storm of changes to ever new keys does not build continuously.

A build takes everything pending (it is built from the sources' whole current state); builds
never overlap, and a change that arrives during one belongs to the next. :class:`Debouncer` is
pure (every method takes ``now``) and costs O(1) amortized per key changed: the earliest
deadlines are read off dicts kept in order of time. Time comes from a :class:`Clock`, a seam tests
replace with a fake.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

__all__ = ["ANY_CHANGE", "Clock", "DebounceSettings", "Debouncer", "MonotonicClock"]

ANY_CHANGE = "*"
"""The key of a change that does not say what it touched (one key: it has a clock like any other)."""


class Clock(Protocol):
    """Time, behind a seam so tests can use a fake."""

    def now(self) -> float: ...

    async def sleep(self, seconds: float) -> None: ...


class MonotonicClock:
    """The real clock: ``time.monotonic`` and ``asyncio.sleep``."""

    def now(self) -> float:
        return time.monotonic()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


@dataclass(frozen=True, slots=True, kw_only=True)
class DebounceSettings:
    """How changes are batched into builds, and how flapping endpoints are damped."""

    quiet: float = 0.1
    """A service quiet this long is built at once when it changes; one that changed within it is
    built once it has been quiet this long (seconds)."""
    max_delay: float = 1.0
    """...or once this long has passed since the first change of its burst, whatever comes first."""
    max_builds_per_s: float = 10.0
    """Builds start at most this many times a second, however many services change."""
    flap_window: float = 30.0
    """An endpoint that returns within this long of its removal counts as flapping (seconds)."""
    hold: float = 1.0
    """A flapping endpoint is re-added once it has been present this long without a break."""


@dataclass(slots=True)
class Debouncer:
    """When to build, given which keys changed when. Pure: every method takes ``now``."""

    quiet: float
    max_delay: float
    min_interval: float = 0.0
    """Builds start at least this long apart (seconds; 0: no limit)."""
    building: bool = False
    last_build: float | None = None
    """When the last build started (None: none yet)."""
    _leading: set[str] = field(default_factory=set)
    """Keys pending whose burst began after a quiet period: due at :attr:`_leading_first`."""
    _leading_first: float | None = None
    _trailing_first: float | None = None
    """The earliest first change among the pending trailing bursts (None: none pending)."""
    _trailing_last: dict[str, float] = field(default_factory=dict)
    """Each pending trailing key's last change, oldest first (a key that changes moves to the end)."""
    _seen: dict[str, float] = field(default_factory=dict)
    """When each key changed last, oldest first, for as long as it counts as recent (``quiet``)."""

    def change(self, now: float, keys: Iterable[str] = (ANY_CHANGE,)) -> None:
        """A change touching ``keys`` arrived (its content differs from what is pending)."""
        self._forget_before(now - self.quiet)
        seen = self._seen
        for key in keys:
            if key in self._leading:
                pass  # due at once already: the build takes this change too
            elif key in self._trailing_last:
                del self._trailing_last[key]  # (moved to the end: the newest last change)
                self._trailing_last[key] = now
            elif key in seen:  # changed within `quiet`: gather what follows
                self._trailing_last[key] = now
                if self._trailing_first is None:
                    self._trailing_first = now
            else:
                self._leading.add(key)
                if self._leading_first is None:
                    self._leading_first = now
            seen.pop(key, None)
            seen[key] = now

    def deadline(self) -> float | None:
        """When what is pending is due to build (None: nothing pending)."""
        due: float | None = self._leading_first
        if self._trailing_last:
            oldest_last = next(iter(self._trailing_last.values()))
            assert self._trailing_first is not None
            trailing = min(oldest_last + self.quiet, self._trailing_first + self.max_delay)
            due = trailing if due is None else min(due, trailing)
        if due is not None and self.last_build is not None:
            due = max(due, self.last_build + self.min_interval)
        return due

    def due(self, now: float) -> bool:
        deadline = self.deadline()
        return deadline is not None and not self.building and now >= deadline

    def start_build(self, now: float) -> None:
        """Take everything pending: changes from now on belong to the next build."""
        self._leading.clear()
        self._trailing_last.clear()
        self._leading_first = self._trailing_first = None
        self.last_build = now
        self.building = True
        self._forget_before(now - self.quiet)

    def finish_build(self) -> None:
        self.building = False

    def _forget_before(self, cutoff: float) -> None:
        """Keys last changed at or before ``cutoff`` are quiet again (O(what is forgotten))."""
        seen = self._seen
        while seen:
            key, at = next(iter(seen.items()))
            if at > cutoff:
                break
            del seen[key]
