"""Errors, split by who is at fault, so that each message can say who must act.

- :class:`ConfigError`: the user's input (a snapshot file, an API call) is wrong. It carries
  every :class:`Problem` found, each naming where (file, resource, field) and what is wrong.
- :class:`PeerError`: a proxy sent something the protocol does not allow. ``xds/`` turns it
  into a gRPC status.
Anything else escaping is our own bug.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["ConfigError", "PeerError", "PilotfishError", "Problem", "shorten"]


class PilotfishError(Exception):
    """Base of the errors pilotfish raises on purpose."""


@dataclass(frozen=True, slots=True)
class Problem:
    """One thing wrong with the user's input."""

    where: str
    """Which resource and field, e.g. ``clusters[0] (name 'web').connect_timeout``."""
    message: str
    """What is wrong, and where possible what to do."""

    def __str__(self) -> str:
        return f"{self.where}: {self.message}" if self.where else self.message


class ConfigError(PilotfishError):
    """The user's configuration is invalid; nothing of it was applied."""

    def __init__(self, source: str, problems: Sequence[Problem]) -> None:
        self.source = source
        self.problems = tuple(problems)
        super().__init__(self.describe())

    def describe(self) -> str:
        lines = [f"{self.source}: {len(self.problems)} problem(s)"]
        lines += [f"  {p}" for p in self.problems]
        return "\n".join(lines)


class PeerError(PilotfishError):
    """A proxy broke the xDS protocol (e.g. an ADS request without a type URL)."""


def shorten(text: str, limit: int = 200, *, tail: int | None = None) -> str:
    """``text`` if at most ``limit`` characters, else its start and end around its length:
    ``"type.googleapis.com/xx... (17,000,000 characters) ...xx"``. For repeating a peer's value
    in an error message or a log line without repeating megabytes. ``tail``: characters of the
    end kept (default: a quarter of ``limit``; more for a message whose end says why)."""
    if len(text) <= limit:
        return text
    tail = limit // 4 if tail is None else min(tail, limit)
    return f"{text[: limit - tail]}... ({len(text):,} characters) ...{text[len(text) - tail :] if tail else ''}"
