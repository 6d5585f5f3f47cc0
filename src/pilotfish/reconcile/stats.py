"""The reconcile loop's counters and its latest refusal, for metrics and the admin API."""

from __future__ import annotations

from dataclasses import dataclass

from pilotfish.errors import ConfigError

__all__ = ["ReconcileStats"]


@dataclass(slots=True)
class ReconcileStats:
    """What the loop did, counted (plain numbers: nothing here is on the hot path)."""

    builds: int = 0
    """How many builds ran (each may or may not hand over a snapshot)."""
    build_seconds: float = 0.0
    """Time spent building and checking snapshots, in all."""
    published: int = 0
    """How many snapshots were handed to the cache."""
    changes: int = 0
    """How many source updates changed what a source says (several may make one build)."""
    refused: int = 0
    """How many builds were refused (invalid input: the last good snapshot kept serving)."""
    last_error: ConfigError | None = None
    """Why the latest build was refused (None once a build succeeds)."""
    last_error_at: float = 0.0
    """When it was refused (wall-clock seconds)."""
