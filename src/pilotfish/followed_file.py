"""A settings file that is followed as it changes: the last good version stays in force.

Operators change access rules (the registry's tokens, SDS grants) without restarting ``serve``.
:class:`FollowedFile` holds the last good value read from one file and looks at the file at most
once per ``every`` seconds (a ``stat``; the file is read only when its inode, mtime or size
changed, or while its mtime is too recent to tell two writes apart). A version that cannot be
read or is invalid leaves the last good value in force: the problem is logged once per version
of the file, naming the file and field, and recorded as the event ``<event>_error``; a good one
is logged and recorded as ``<event>_loaded``. At start-up there is no last good value, so a bad
file is a :class:`~pilotfish.errors.ConfigError` (``serve`` stops before it listens).

A kind of file is a subclass: how to turn the file into a value (:meth:`FollowedFile.parse`,
given the file's YAML or JSON document, see :func:`read_document`), what an event says of a value
(:meth:`FollowedFile.summary`), and the words its messages use.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, ClassVar, Generic, TypeVar

import yaml

from pilotfish.errors import ConfigError, Problem
from pilotfish.events import EventLog

__all__ = ["MAX_FILE_BYTES", "FollowedFile", "read_document"]

_log = logging.getLogger("pilotfish.server")

MAX_FILE_BYTES = 1 << 20
"""A followed file larger than this (1 MiB) is refused: it is not a settings file."""
_RECENT_NS = 2_000_000_000
"""A file modified less than this before it was read is read again at the next look: a second
write within the file system's timestamp granularity may leave inode, mtime and size unchanged."""

T = TypeVar("T")


def read_document(path: Path, *, max_bytes: int = MAX_FILE_BYTES, empty: str) -> Any:
    """The plain values of a YAML file (JSON when its name ends in ``.json``); ConfigError naming
    the file, and line and column. ``empty`` says what to write in an empty file instead."""
    source = str(path)
    try:
        with path.open("rb") as file:
            data = file.read(max_bytes + 1)
    except OSError as exc:
        raise ConfigError(source, [Problem("", f"cannot read: {exc.strerror or exc}")]) from exc
    if len(data) > max_bytes:
        raise ConfigError(source, [Problem("", f"larger than {max_bytes} bytes: not a settings file?")])
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(source, [Problem(f"byte {exc.start}", "not UTF-8: save the file as UTF-8")]) from exc
    try:
        document = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(
            source, [Problem(f"line {exc.lineno}, column {exc.colno}", f"invalid JSON: {exc.msg}")]
        ) from exc
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(source, [Problem(where, f"invalid YAML: {getattr(exc, 'problem', None) or exc}")]) from exc
    except RecursionError as exc:
        raise ConfigError(source, [Problem("", "nested too deeply to read")]) from exc
    if document is None:
        raise ConfigError(source, [Problem("", f"the file is empty; {empty}")])
    return document


Signature = tuple[int, int, int]


def _signature(path: Path) -> Signature | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns, st.st_size


class FollowedFile(Generic[T]):
    """The last good value of a file, re-read when the file changes.

    :meth:`current` looks at the file at most once per ``every`` seconds (of ``clock``), so a
    change takes effect within about that long, and a caller asking often costs a clock read.
    :attr:`on_change` (if set) is called with each new good value.
    """

    what: ClassVar[str] = "file"
    """What the file is, in messages (``registry tokens file``)."""
    event: ClassVar[str] = "file"
    """The events' prefix: ``<event>_loaded`` and ``<event>_error``."""
    keeper: ClassVar[str] = "the last good version stays in force"
    """What happens while the file is bad, in messages (``the registry API keeps ...``)."""
    empty: ClassVar[str] = "write the settings into it"
    """What to write instead of an empty file."""

    def __init__(
        self,
        path: Path,
        *,
        events: EventLog | None = None,
        every: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
        on_change: Callable[[T], None] | None = None,
    ) -> None:
        self.path = path
        self.events = events or EventLog()
        self.every = every
        self.clock = clock
        self.on_change = on_change
        """Called with each new good value (after it is in force)."""
        signature = _signature(path)
        self.value: T = self.load()  # at start-up, a bad file is an error: nothing good to fall back on
        self._read_as = signature
        self._read_at_ns = time.time_ns()
        self._looked_at = clock()
        self.problem: ConfigError | None = None
        """Why the file's current version is not in use (None when it is)."""
        _log.info("%s %s: %s", self.what, path, self._summary_text(self.value))

    # -- what a kind of file says -------------------------------------------------------------------

    def parse(self, document: Any, source: str) -> T:
        """The value of the file's plain values; ConfigError naming every problem."""
        raise NotImplementedError

    def summary(self, value: T) -> Mapping[str, object]:
        """What the ``<event>_loaded`` event (and the log) says of ``value``, besides the file."""
        return {}

    def load(self) -> T:
        """Read and parse the file now; ConfigError naming the file, and line or field."""
        return self.parse(read_document(self.path, empty=self.empty), str(self.path))

    # -- following --------------------------------------------------------------------------------

    def current(self) -> T:
        """The value to decide with now (looking at the file if ``every`` has passed)."""
        now = self.clock()
        if now - self._looked_at >= self.every:
            self._looked_at = now
            self.refresh()
        return self.value

    def refresh(self) -> bool:
        """Look at the file now; re-read it if it changed. Whether the value changed."""
        signature = _signature(self.path)
        racy = signature is not None and self._read_at_ns - signature[1] < _RECENT_NS
        if signature == self._read_as and not racy:
            return False
        read_at = time.time_ns()
        try:
            value = self.load()
        except ConfigError as exc:
            if signature != self._read_as or self.problem is None:
                self._report(exc)
            self._read_as, self._read_at_ns = signature, read_at
            return False
        except Exception as exc:  # our bug: keep the last good value, and say so
            _log.exception("reading %s failed unexpectedly", self.path)
            self._report(ConfigError(str(self.path), [Problem("", f"internal error while reading ({exc!r})")]))
            self._read_as, self._read_at_ns = signature, read_at
            return False
        self._read_as, self._read_at_ns = signature, read_at
        if self.problem is not None:
            _log.warning("%s %s is valid again", self.what, self.path)
            self.problem = None
        if value == self.value:
            return False
        self.value = value
        _log.warning("%s %s reloaded: %s", self.what, self.path, self._summary_text(value))
        self.events.emit(f"{self.event}_loaded", file=str(self.path), **self.summary(value))
        self._tell(self.on_change, value)
        return True

    def _tell(self, on_change: Callable[[T], None] | None, value: T) -> None:
        if on_change is not None:
            try:
                on_change(value)
            except Exception:  # our bug: say so, and keep following the file
                _log.exception("applying %s %s failed unexpectedly", self.what, self.path)

    async def follow(self, on_change: Callable[[T], None] | None = None) -> None:
        """Look at the file every ``every`` seconds, so a change applies (and a bad version is
        reported) even while nobody asks (:meth:`current`). ``on_change`` (for whoever was built
        after this file was read, from its first value) is called with each new good value too."""
        while True:
            await asyncio.sleep(self.every)
            before = self.value
            self.current()
            if self.value is not before:
                self._tell(on_change, self.value)

    def _summary_text(self, value: T) -> str:
        return ", ".join(f"{key} {item}" for key, item in self.summary(value).items()) or "loaded"

    def _report(self, exc: ConfigError) -> None:
        self.problem = exc
        _log.error("%s\n%s until the file is fixed (%s)", exc.describe(), self.keeper, self._summary_text(self.value))
        self.events.emit(f"{self.event}_error", file=str(self.path), reason=exc.describe())
