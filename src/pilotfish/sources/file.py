"""The snapshot file source: a JSON or YAML file of services and Envoy resources, watched.

The file's directory is watched (inotify through watchfiles), not the file itself, so an editor's
or deploy tool's write-to-temp-then-rename is seen like an in-place write. Each change is read
whole and costs what it changed: a resource whose text is the one it was is not parsed again, and
an edit inside one resource list is found by comparing the text with the last good one, so only
the items there are decoded at all (:func:`~pilotfish.resources.read_parsed`). A half-written,
undecodable, empty or invalid file is reported and ignored, and whatever was last good keeps
serving. So is a deleted file: deleting the file is not a way to remove everything (write the
empty sections for that). Reading never ends the watch: any error while reading, decoding or
parsing becomes a reported :class:`ConfigError`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from pathlib import Path
from typing import Any

from pilotfish.build.desired import DesiredState, build_snapshot, merge_states
from pilotfish.build.validate import rule_problems
from pilotfish.errors import ConfigError, Problem
from pilotfish.resources import ParseMemo, decode_document, parse_document, read_document, read_parsed
from pilotfish.resources.parse import without_collections
from pilotfish.snapshot import Snapshot

__all__ = [
    "SOURCE",
    "FileSignature",
    "file_signature",
    "load_desired",
    "load_snapshot",
    "parse_desired",
    "read_desired",
    "watch_file",
    "watch_snapshot_file",
]

_log = logging.getLogger("pilotfish.sources.file")

SOURCE = "file"
"""The name the snapshot file's state is reported under to the reconciler."""


def load_desired(path: Path, *, memo: ParseMemo | None = None) -> DesiredState:
    """Read and parse a snapshot file; raise :class:`ConfigError` naming every problem.
    ``memo``: the resources of the file's last good content, not parsed again where their text
    is the same (:class:`~pilotfish.resources.ParseMemo`: what a followed file keeps), and an
    edit inside one resource list decodes and parses only the items there."""
    if memo is None:
        return _desired(lambda: read_document(path), str(path), None)
    with without_collections():
        return DesiredState.of_document(read_parsed(path, rules=rule_problems, memo=memo))


def parse_desired(data: bytes, name: str, *, as_json: bool | None = None) -> DesiredState:
    """Parse a snapshot file's bytes, as :func:`load_desired` parses the file: as JSON when
    ``as_json`` says so (None: when ``name`` ends in ``.json``, as a file is read), else YAML;
    raise :class:`ConfigError` (naming ``name``) with every problem."""
    json = name.endswith(".json") if as_json is None else as_json
    return _desired(lambda: decode_document(data, name, as_json=json), name, None)


def _desired(decode: Callable[[], Any], name: str, memo: ParseMemo | None) -> DesiredState:
    """The desired state of the document ``decode`` gives, decoded and parsed with no garbage
    collection meanwhile (see :func:`~pilotfish.resources.parse.without_collections`)."""
    with without_collections():
        return DesiredState.of_document(parse_document(decode(), name, rules=rule_problems, memo=memo))


def load_snapshot(path: Path) -> Snapshot:
    """Read, parse, build and check a snapshot file on its own (``pilotfish validate``)."""
    return build_snapshot(merge_states({"file": load_desired(path)}), str(path))


FileSignature = tuple[int, int, int]
"""(inode, mtime in ns, size): what tells a changed file from the one read before."""


def file_signature(path: Path) -> FileSignature | None:
    """The file's signature now (None if it does not exist). Take it *before* reading the file:
    a change during the read then shows as a difference later."""
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns, st.st_size


async def watch_file(
    path: Path, *, quiet_ms: int = 20, loaded: FileSignature | None = None, memo: ParseMemo | None = None
) -> AsyncGenerator[DesiredState | ConfigError, None]:
    """Yield the file's new desired state (or the error that kept it out) on each change.

    ``quiet_ms``: how long the directory must be quiet before a burst of writes is read.
    ``loaded``: the :func:`file_signature` of the file the caller already read. Once the watch is
    in place, a file that differs from it is read at once: a change made between the caller's read
    and the start of the watch is not lost. ``memo``: see :func:`load_desired` (one per file).
    """
    from watchfiles import awatch  # imported here: only the file source needs it

    path = path.absolute()
    target = str(path)
    caught_up = loaded is None

    def only_target(_change: object, changed: str) -> bool:
        return changed == target

    # With yield_on_timeout, an (empty) batch arrives each second without changes: the first one
    # says the watch is in place.
    async for changes in awatch(
        path.parent,
        watch_filter=only_target,
        step=quiet_ms,
        debounce=1_000,
        recursive=False,
        rust_timeout=1_000,
        yield_on_timeout=not caught_up,
    ):
        if not caught_up:
            caught_up = True
            if not changes and file_signature(path) == loaded:
                continue
        elif not changes:
            continue
        if not path.exists():
            yield ConfigError(
                target,
                [
                    Problem(
                        "",
                        (
                            "the file was deleted or moved away; still serving its last good content. Put it back to "
                            "change what is served (to serve nothing, write the empty sections, e.g. 'clusters: []')"
                        ),
                    )
                ],
            )
            continue
        yield await asyncio.to_thread(read_desired, path, memo=memo)


def read_desired(path: Path, *, memo: ParseMemo | None = None) -> DesiredState | ConfigError:
    """:func:`load_desired`, with every failure returned as a :class:`ConfigError`: a bug in a
    parser must not end the watch (it is logged with its traceback, and reported)."""
    try:
        return load_desired(path, memo=memo)
    except ConfigError as exc:
        return exc
    except Exception as exc:
        _log.exception("reading %s failed unexpectedly", path)
        return ConfigError(
            str(path),
            [Problem("", f"internal error while reading the file ({exc!r}); still serving the last good content")],
        )


async def watch_snapshot_file(path: Path, *, quiet_ms: int = 20) -> AsyncIterator[Snapshot | ConfigError]:
    """Like :func:`watch_file`, but each state built into a snapshot of the file on its own."""
    async for item in watch_file(path, quiet_ms=quiet_ms):
        if isinstance(item, ConfigError):
            yield item
            continue
        try:
            yield build_snapshot(merge_states({"file": item}), str(path))
        except ConfigError as exc:
            yield exc
