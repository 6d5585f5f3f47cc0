"""The JSON-lines event log: one object per line, written and flushed as it happens.

Every request a proxy sends (``request``, ``ack``, ``nack``), every response sent (``sent``), and
the life of the server, its streams and its snapshots are recorded, so an operator can read the
whole xDS conversation after the fact (``jq`` friendly). Events are also passed to the
``pilotfish.events`` logger at DEBUG level.

Many fields come from peers (node ids, resource names, NACK messages, type URLs), and a peer can
make them megabytes long. So a line is bounded: one longer than :data:`MAX_LINE` is written
again with every string shortened to :data:`MAX_FIELD` characters (:func:`shorten`: its start and
its end, where Envoy puts a NACK's reason, and its length) and every list cut to
:data:`MAX_ITEMS` items (``<field>_omitted`` says how many more there were). A usual line is
checked with one ``len``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import IO, Any

import orjson

from pilotfish.errors import shorten

__all__ = ["CONVERSATION", "MAX_FIELD", "MAX_ITEMS", "MAX_LINE", "EventLog", "shorten"]

CONVERSATION = frozenset({"request", "ack", "sent", "stale", "rest_request"})
"""Events of the routine xDS conversation: a line per request and response of every proxy (and
per REST poll).
``level="changes"`` leaves them out and keeps the rest (snapshots, NACKs, streams, sources)."""
LEVELS = ("all", "changes")

MAX_LINE = 16 * 1024
"""Bytes of an event line beyond which its fields are shortened."""
MAX_FIELD = 2048
"""Characters a string field keeps in a shortened line."""
MAX_ITEMS = 100
"""Items a list field keeps in a shortened line."""


def _bounded(record: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in record.items():
        if isinstance(value, str):
            value = shorten(value, MAX_FIELD)
        elif isinstance(value, list | tuple):
            if len(value) > MAX_ITEMS:
                out[f"{key}_omitted"] = len(value) - MAX_ITEMS
            value = [shorten(v, MAX_FIELD) if isinstance(v, str) else v for v in value[:MAX_ITEMS]]
        out[key] = value
    return out

_log = logging.getLogger("pilotfish.events")


class EventLog:
    """Appends events to a file (or nowhere, when no path is given).

    Lines are flushed once per turn of the event loop rather than one by one: an event is on disk
    as soon as the code that caused it yields, and a fan-out to thousands of proxies costs one
    write, not thousands. Without a running loop every line is flushed at once.
    """

    def __init__(self, path: Path | None = None, *, level: str = "all", clock: Any = time.time) -> None:
        if level not in LEVELS:
            raise ValueError(f"event log level must be one of {', '.join(LEVELS)}, not {level!r}")
        self._file: IO[bytes] | None = open(path, "ab") if path else None  # noqa: SIM115
        self._skip = CONVERSATION if level == "changes" else frozenset()
        self._clock = clock
        self._lines: list[bytes] = []
        self._flush_scheduled = False

    @property
    def enabled(self) -> bool:
        """Whether events go anywhere (callers may skip building costly fields if not)."""
        return self._file is not None or _log.isEnabledFor(logging.DEBUG)

    @property
    def conversation(self) -> bool:
        """Whether the routine request and response events (:data:`CONVERSATION`) are recorded."""
        return not self._skip and self.enabled

    def emit(self, event: str, **fields: Any) -> None:
        """Record one event; ``fields`` must be JSON-serializable."""
        debug = _log.isEnabledFor(logging.DEBUG)
        if event in self._skip or (self._file is None and not debug):
            return
        record = {"ts": self._clock(), "event": event, **fields}
        # orjson: a fan-out to 10,000 proxies logs 20,000 lines, and the json module spends ~10x longer.
        line = orjson.dumps(record, default=str, option=orjson.OPT_APPEND_NEWLINE)
        if len(line) > MAX_LINE:
            line = orjson.dumps(_bounded(record), default=str, option=orjson.OPT_APPEND_NEWLINE)
        if self._file is not None:
            self._lines.append(line)
            if not self._flush_scheduled:
                try:
                    asyncio.get_running_loop().call_soon(self.flush)
                    self._flush_scheduled = True
                except RuntimeError:
                    self.flush()
        if debug:
            _log.debug("%s", line.decode().rstrip())

    def flush(self) -> None:
        """Write out the buffered lines."""
        self._flush_scheduled = False
        if self._file is not None and self._lines:
            self._file.write(b"".join(self._lines))
            self._file.flush()
        self._lines.clear()

    def close(self) -> None:
        self.flush()
        if self._file is not None:
            self._file.close()
            self._file = None
