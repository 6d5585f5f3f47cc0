"""Reading pilotfish's JSON-lines event log while the server is writing it.

The server flushes one JSON object per line. :class:`EventLog` reads the file incrementally with
:func:`pilotfish.events.read_events` (complete lines only), so a line caught half-written is parsed
on the next read. Events are kept in file order and addressed by their index, which lets a test
take a :meth:`EventLog.mark` before an action and then look only at what came after it.

Never read the log straight after an action to see what it caused: pilotfish writes an event on
the turn of its event loop after the one that caused it, so an HTTP answer (or Envoy's reaction)
can reach the test first. Wait for the event (:meth:`EventLog.wait_for`,
:meth:`EventLog.wait_for_count`). To show that something did NOT happen, wait for a later event
that proves the server is past the point where it would have happened (a ``snapshot_unchanged``,
or the event of a marker change made afterwards), then look at what lies before it.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from pilotfish.events import read_events

__all__ = [
    "CDS",
    "EDS",
    "LDS",
    "RDS",
    "TYPE_URLS",
    "Event",
    "EventLog",
    "Predicate",
    "is_event",
    "is_registry_change",
    "short_type",
    "streams_of",
    "wait_until_built",
]

CDS = "type.googleapis.com/envoy.config.cluster.v3.Cluster"
EDS = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"
LDS = "type.googleapis.com/envoy.config.listener.v3.Listener"
RDS = "type.googleapis.com/envoy.config.route.v3.RouteConfiguration"
TYPE_URLS = (CDS, EDS, LDS, RDS)
_SHORT = {CDS: "CDS", EDS: "EDS", LDS: "LDS", RDS: "RDS"}

Event = dict[str, Any]
Predicate = Callable[[Event], bool]


def short_type(type_url: str) -> str:
    return _SHORT.get(type_url, type_url.rsplit(".", 1)[-1])


@dataclass
class EventLog:
    """The events of one pilotfish run, read from its ``--event-log`` file."""

    path: Path
    _events: list[Event] = field(default_factory=list)
    _offset: int = 0

    def read(self) -> list[Event]:
        """All events so far (reads what was appended since the last call)."""
        events, self._offset = read_events(self.path, self._offset)
        self._events += events
        return self._events

    def mark(self) -> int:
        """The index the next event will have: pass it as ``after`` to see only newer events."""
        return len(self.read())

    def select(self, predicate: Predicate, *, after: int = 0) -> list[Event]:
        return [e for e in self.read()[after:] if predicate(e)]

    def find(self, predicate: Predicate, *, after: int = 0) -> Event | None:
        for event in self.read()[after:]:
            if predicate(event):
                return event
        return None

    def index_of(self, event: Event) -> int:
        """The position of an event returned by find/select/wait_for (identity, not equality)."""
        for i, candidate in enumerate(self.read()):
            if candidate is event:
                return i
        raise ValueError("event not in this log")

    def wait_for(self, predicate: Predicate, *, what: str, after: int = 0, timeout: float = 10.0) -> Event:
        """The first event (from index ``after``) matching ``predicate``; fail after ``timeout``."""
        deadline = time.monotonic() + timeout
        while True:
            event = self.find(predicate, after=after)
            if event is not None:
                return event
            if time.monotonic() >= deadline:
                pytest.fail(
                    f"timed out after {timeout:g}s waiting for event: {what}\n" + self.describe(after=after),
                    pytrace=False,
                )
            time.sleep(0.05)

    def wait_for_count(
        self, predicate: Predicate, count: int, *, what: str, after: int = 0, timeout: float = 10.0
    ) -> list[Event]:
        """The first ``count`` events (from index ``after``) matching ``predicate``, once that many
        are logged; fail after ``timeout``.

        The server writes its log on the turn of its event loop after the one that caused the
        events, so an HTTP answer can reach the test before the event the request caused is on
        disk: wait for it, never read straight after the answer.
        """
        found: list[Event] = []

        def enough() -> bool:
            found[:] = self.select(predicate, after=after)[:count]
            return len(found) >= count

        deadline = time.monotonic() + timeout
        while not enough():
            if time.monotonic() >= deadline:
                pytest.fail(
                    f"timed out after {timeout:g}s waiting for {count} events ({len(found)} so far): {what}\n"
                    + self.describe(after=after),
                    pytrace=False,
                )
            time.sleep(0.05)
        return found

    def describe(self, *, after: int = 0, limit: int = 60) -> str:
        """The events (from ``after``) one short line each, for failure messages."""
        events = self.read()[after:]
        lines = [f"--- {self.path.name}: {len(events)} events from #{after} ---"]
        for i, event in enumerate(events[-limit:], start=after + max(0, len(events) - limit)):
            lines.append(f"#{i} " + _one_line(event))
        return "\n".join(lines)


def _one_line(event: Event) -> str:
    fields = []
    for key, value in event.items():
        if key == "ts":
            continue
        if key == "type" and isinstance(value, str):
            value = short_type(value)
        text = json.dumps(value)
        if len(text) > 120:
            # Envoy's NACK message starts with a dump of the resource and ends with the reason.
            text = "..." + text[-117:] if key == "error" else text[:117] + "..."
        fields.append(f"{key}={text}")
    return " ".join(fields)


# -- predicates -----------------------------------------------------------------------------------


def is_event(kind: str, **fields: Any) -> Predicate:
    """A predicate: ``event == kind`` and each given field equal."""

    def predicate(event: Event) -> bool:
        if event.get("event") != kind:
            return False
        return all(event.get(key) == value for key, value in fields.items())

    return predicate


def streams_of(events: Iterable[Event]) -> list[Any]:
    """Distinct stream ids in order of first appearance."""
    seen: dict[Any, None] = {}
    for event in events:
        if "stream" in event:
            seen.setdefault(event["stream"], None)
    return list(seen)


def is_registry_change(event: Event) -> bool:
    return str(event["event"]).startswith("registry_")


def wait_until_built(events: EventLog, *, changes: int, after: int, what: str) -> Event:
    """Wait until the first ``changes`` registry changes logged from index ``after`` are built into
    a served snapshot; return its ``snapshot_loaded``.

    A 2xx from the registry API comes before the server has written the change's event (it writes
    its log on the next turn of its event loop), so the changes are waited for by count.
    """
    logged = events.wait_for_count(is_registry_change, changes, what=f"{what}: the registry changes", after=after)
    return events.wait_for(is_event("snapshot_loaded"), what=what, after=events.index_of(logged[-1]) + 1)


NEW_CLUSTER_JUDGED = re.compile(
    r"error ratio [\d.]+ % vs [\d.]+ % baseline (before the wave )?overall on cluster broken$"
)
"""The gate's reason when it fails the new cluster ``broken`` against the baseline's overall ratio."""
