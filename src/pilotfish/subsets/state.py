"""The subsetting indices kept across restarts: a state file (``serve --state-dir``).

Subsets are stable only if indices are: a restarted pilotfish that numbered backends or proxies
afresh would give every proxy a new subset and push it. So the backend index table of each
subsetted service (kept by the reconciler) and the proxies' table (kept by the xDS server) are
written to ``DIR/pilotfish-subsets.json`` when they change (at most once per ``every`` seconds,
replacing the file atomically), and read back at start. Without ``--state-dir`` the directory of
the snapshot file is used; with neither, the indices live in memory only.

A state file that cannot be read or does not hold valid tables is reported (naming the file and
the field), renamed to ``*.bad`` for a look later, and pilotfish starts with fresh indices:
subsets re-balance once, which moves connections but fails no request.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from pilotfish.build.subsetting import IndexTable, ProxyIndices
from pilotfish.errors import ConfigError, Problem

__all__ = [
    "STATE_FILE",
    "BackendTables",
    "SubsetState",
    "keep_saving",
    "load_or_start_fresh",
    "load_subset_state",
    "save_subset_state",
]

_log = logging.getLogger("pilotfish.subsets")

STATE_FILE = "pilotfish-subsets.json"
_FORMAT = 1


@dataclass(frozen=True, slots=True)
class SubsetState:
    backends: Mapping[str, IndexTable]
    """Service -> its backends' indices."""
    proxies: IndexTable
    """Node id -> proxy index."""


def load_subset_state(path: Path) -> SubsetState:
    """The state in ``path`` (empty if there is none); :class:`ConfigError` naming what is wrong."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return SubsetState({}, IndexTable())
    except OSError as exc:
        raise ConfigError(str(path), [Problem("", f"cannot read it: {exc.strerror or exc}")]) from None
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise ConfigError(str(path), [Problem("", f"not valid JSON: {exc}")]) from None
    if not isinstance(data, dict) or data.get("version") != _FORMAT or not isinstance(data.get("backends"), dict):
        raise ConfigError(
            str(path),
            [
                Problem(
                    "",
                    f"expected {{'version': {_FORMAT}, 'backends': {{...}}, "
                    "'proxies': {...}} as pilotfish writes it",
                )
            ],
        )
    backends = {
        str(service): IndexTable.from_json(table, source=f"{path}: backends[{service!r}]")
        for service, table in data["backends"].items()
    }
    proxies = IndexTable.from_json(data.get("proxies"), source=f"{path}: proxies")
    return SubsetState(backends, proxies)


def save_subset_state(path: Path, state: SubsetState) -> None:
    """Write ``state`` to ``path`` atomically (a temporary file renamed over it)."""
    document = {
        "version": _FORMAT,
        "backends": {service: state.backends[service].to_json() for service in sorted(state.backends)},
        "proxies": state.proxies.to_json(),
    }
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(json.dumps(document, indent=1) + "\n")
    os.replace(temporary, path)


def load_or_start_fresh(path: Path) -> SubsetState:
    """:func:`load_subset_state`, or (reported, the bad file set aside) an empty state."""
    try:
        return load_subset_state(path)
    except ConfigError as exc:
        aside = path.with_name(path.name + ".bad")
        _log.error(
            "%s\nstarting with fresh subsetting indices (subsets re-balance once); the file is kept as %s",
            exc.describe(),
            aside,
        )
        try:
            os.replace(path, aside)
        except OSError as move:
            _log.error("could not rename %s to %s: %s", path, aside, move)
        return SubsetState({}, IndexTable())


class BackendTables(Protocol):
    """The backend index tables as the reconciler last published them
    (:class:`pilotfish.reconcile.tables.SubsetTables`), and a count of their changes."""

    @property
    def tables(self) -> Mapping[str, IndexTable]: ...

    @property
    def changed(self) -> int: ...


async def keep_saving(path: Path, backends: BackendTables, proxies: ProxyIndices, *, every: float = 1.0) -> None:
    """Write the state whenever it changed, at most once per ``every`` seconds; free the indices
    of proxies whose grace period ended. Runs until cancelled (and then writes a last time)."""
    saved = (backends.changed, proxies.changes)

    def save() -> None:
        nonlocal saved
        now = (backends.changed, proxies.changes)
        if now == saved:
            return
        try:
            save_subset_state(path, SubsetState(backends.tables, proxies.table()))
        except OSError as exc:
            _log.error("could not write the subsetting state to %s: %s (retrying)", path, exc)
            return
        saved = now

    try:
        while True:
            await asyncio.sleep(every)
            proxies.expire()
            if backends.tables:  # nothing is subsetted: nothing worth keeping
                save()
    finally:
        if backends.tables:
            save()
