"""The debounce: when to build, given when changes arrived.

A change whose content differs from what is pending starts (or extends) a burst; the burst is
built once the sources have been quiet for ``quiet`` seconds, or ``max_delay`` after its first
change, whichever comes first. Builds never overlap; a change that arrives during a build belongs
to the next burst, built right after. :class:`Debouncer` is pure (every method takes ``now``);
time comes from a :class:`Clock`, a seam tests replace with a fake.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Protocol

__all__ = ["Clock", "DebounceSettings", "Debouncer", "MonotonicClock"]


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
    """Build once no change has arrived for this long (seconds)."""
    max_delay: float = 1.0
    """...or once this long has passed since the first change of a burst, whatever comes first."""
    flap_window: float = 30.0
    """An endpoint that returns within this long of its removal counts as flapping (seconds)."""
    hold: float = 1.0
    """A flapping endpoint is re-added once it has been present this long without a break."""


@dataclass(slots=True)
class Debouncer:
    """When to build, given when changes arrived. Pure: every method takes ``now``."""

    quiet: float
    max_delay: float
    first: float | None = None
    """When the first change of the pending burst arrived (None: nothing pending)."""
    last: float | None = None
    building: bool = False

    def change(self, now: float) -> None:
        """A change whose content differs from what is pending arrived."""
        if self.first is None:
            self.first = now
        self.last = now

    def deadline(self) -> float | None:
        """When the pending burst is due to build (None: nothing pending)."""
        if self.first is None or self.last is None:
            return None
        return min(self.last + self.quiet, self.first + self.max_delay)

    def due(self, now: float) -> bool:
        deadline = self.deadline()
        return deadline is not None and not self.building and now >= deadline

    def start_build(self) -> None:
        """Take the pending burst: changes from now on belong to the next one."""
        self.first = self.last = None
        self.building = True

    def finish_build(self) -> None:
        self.building = False
