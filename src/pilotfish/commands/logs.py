"""The logs on stderr: text lines (the default), or one JSON object a line for log shippers.

A JSON line has ``time`` (ISO 8601, UTC), ``level``, ``logger`` and ``message``, then the
record's structured fields where it has them (``extra={LOG_FIELDS: {...}}``, as the startup
block's addresses and sources: :data:`pilotfish.events.LOG_FIELDS`), and ``exception`` with the traceback
when there is one. A multi-line message (a refused file's problems) stays one JSON line.

At the default verbosity only warnings and errors are logged, and the announcements that are
for the operator whatever the verbosity: the startup block and "fixed" lines (logger
:data:`pilotfish.events.ANNOUNCE`, always at INFO).
"""

from __future__ import annotations

import json
import logging
import sys
from datetime import UTC, datetime
from typing import Any

from pilotfish.events import ANNOUNCE, LOG_FIELDS

__all__ = ["JsonFormatter", "configure_logging"]

_TEXT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_RESERVED = frozenset(("time", "level", "logger", "message", "exception"))


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line (see the module docstring)."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        fields = getattr(record, LOG_FIELDS, None)
        if isinstance(fields, dict):
            line.update({key: value for key, value in fields.items() if key not in _RESERVED})
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str, ensure_ascii=False)


def configure_logging(*, verbose: int, json_lines: bool) -> None:
    """Log to stderr: warnings (``verbose`` 0), info (1) or everything (2); as text or JSON lines."""
    level = logging.WARNING if verbose == 0 else logging.INFO if verbose == 1 else logging.DEBUG
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if json_lines else logging.Formatter(_TEXT))
    logging.basicConfig(level=level, handlers=[handler], force=False)
    logging.getLogger("watchfiles").setLevel(logging.WARNING)
    logging.getLogger(ANNOUNCE).setLevel(min(level, logging.INFO))
