"""The snapshot file source: a JSON or YAML file of Envoy resources, watched for changes.

The file's directory is watched (inotify through watchfiles), not the file itself, so an editor's
or deploy tool's write-to-temp-then-rename is seen like an in-place write. Each change is read,
parsed and checked in full; a half-written or invalid file is reported and ignored, and whatever
was last good keeps serving. Rewriting the same content gives a snapshot with the same versions,
which the caller can drop.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from pathlib import Path

from pilotfish.errors import ConfigError
from pilotfish.resources import parse_document, read_document
from pilotfish.snapshot import Snapshot
from pilotfish.validate import check_references

__all__ = ["load_snapshot", "watch_snapshot_file"]

_log = logging.getLogger("pilotfish.sources.file")


def load_snapshot(path: Path) -> Snapshot:
    """Read, parse and check a snapshot file; raise :class:`ConfigError` naming every problem."""
    source = str(path)
    parsed = parse_document(read_document(path), source)
    problems = check_references(parsed.resources)
    if problems:
        raise ConfigError(source, problems)
    return Snapshot.build(parsed.resources, version=parsed.version)


async def watch_snapshot_file(
    path: Path, *, quiet_ms: int = 20
) -> AsyncIterator[Snapshot | ConfigError]:
    """Yield a new snapshot (or the error that kept it out) each time the file changes.

    ``quiet_ms``: how long the directory must be quiet before a burst of writes is read.
    """
    from watchfiles import awatch  # imported here: only the file source needs it

    path = path.absolute()
    target = str(path)
    def only_target(_change: object, changed: str) -> bool:
        return changed == target

    async for _changes in awatch(
        path.parent, watch_filter=only_target, step=quiet_ms, debounce=1_000, recursive=False
    ):
        if not path.exists():
            continue  # deleted or mid-rename; the rename's arrival is another change
        try:
            snapshot = await asyncio.to_thread(load_snapshot, path)
        except ConfigError as exc:
            yield exc
        else:
            yield snapshot
