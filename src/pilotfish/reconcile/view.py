"""What the reconcile loop shows those who only read it (the admin API, metrics): :class:`PublishState`."""

from __future__ import annotations

from typing import Protocol

from pilotfish.reconcile.guard import Held
from pilotfish.reconcile.readiness import ReadinessView
from pilotfish.reconcile.stats import ReconcileStats

__all__ = ["PublishState"]


class PublishState(Protocol):
    """A read-only view of the loop: its counters, the sources' readiness, what the guard holds."""

    @property
    def stats(self) -> ReconcileStats: ...

    @property
    def readiness(self) -> ReadinessView: ...

    @property
    def held(self) -> Held | None:
        """The snapshots the guard holds back (None: nothing held)."""
        ...

    @property
    def held_count(self) -> int:
        """How many snapshots the guard held back."""
        ...

    @property
    def confirm_hint(self) -> str:
        """How the operator confirms a held snapshot."""
        ...

    @property
    def idle(self) -> bool:
        """Nothing is waiting to be built."""
        ...
