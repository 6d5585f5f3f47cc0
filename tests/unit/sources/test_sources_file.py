"""The snapshot file source (pilotfish.sources.file), on a real file watched through inotify: each
change is read in full, a bad or deleted file is reported (the last good content keeps serving),
and a change made between the caller's read and the start of the watch is not lost."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from pathlib import Path

from pilotfish.build.desired import DesiredState
from pilotfish.errors import ConfigError
from pilotfish.sources.file import file_signature, load_desired, watch_file

TIMEOUT = 10.0


def write(path: Path, text: str) -> None:
    """As an editor or a deploy tool writes: to a temporary file, renamed over the old one."""
    temp = path.with_name(path.name + ".tmp")
    temp.write_text(text)
    os.replace(temp, path)


def services(*names: str) -> str:
    return "services:\n" + "".join(f"  {name}:\n    endpoints: ['127.0.0.1:900{i}']\n" for i, name in enumerate(names))


async def next_item(watch: AsyncIterator[DesiredState | ConfigError]) -> DesiredState | ConfigError:
    return await asyncio.wait_for(anext(watch), TIMEOUT)


def test_the_signature_changes_with_the_file_and_is_none_without_one(tmp_path: Path) -> None:
    path = tmp_path / "snapshot.yaml"
    assert file_signature(path) is None
    write(path, services("web"))
    first = file_signature(path)
    assert first is not None and file_signature(path) == first
    write(path, services("web"))  # the same bytes, a new file: a change to read
    assert file_signature(path) != first


async def test_changes_are_read_and_a_bad_or_deleted_file_is_reported(tmp_path: Path) -> None:
    path = tmp_path / "snapshot.yaml"
    write(path, services("web"))
    loaded = file_signature(path)
    assert sorted(load_desired(path).services) == ["web"]
    write(path, services("web", "api"))  # before the watch starts: it must not be lost
    watch = watch_file(path, quiet_ms=20, loaded=loaded)
    try:
        state = await next_item(watch)
        assert isinstance(state, DesiredState) and sorted(state.services) == ["api", "web"]

        write(path, "services:\n  web:\n    colour: red\n")
        error = await next_item(watch)
        assert isinstance(error, ConfigError) and error.source == str(path)
        assert [p.where for p in error.problems] == ["services.web"] and "colour" in str(error), error

        path.unlink()
        gone = await next_item(watch)
        assert isinstance(gone, ConfigError) and "still serving its last good content" in str(gone)

        write(path, services("db"))
        back = await next_item(watch)
        assert isinstance(back, DesiredState) and sorted(back.services) == ["db"]
    finally:
        await watch.aclose()
