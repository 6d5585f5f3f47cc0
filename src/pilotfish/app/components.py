"""The parts of a running ``pilotfish serve``, started in order and stopped in reverse.

Theory of operation. :func:`pilotfish.app.serve.serve` first *builds* every object of the process
from its settings (constructors only: nothing listens, nothing runs, and a bad tokens or grants
file is an error before anything starts). Each object that runs something is wrapped in a
:class:`Component`: ``start()`` makes it run (binds a port, starts a background task, installs a
signal handler) and returns once it does; ``stop()`` undoes that. :func:`running` starts the
components one after the other, in the order given, so that each may rely on what the ones before
it set up (the xDS server's bound address, the TLS context a listener serves with); if one fails to
start, the ones already started are stopped, in reverse, and the failure propagates. On the way
out (the stop signal, cancellation, or an error) every started component is stopped in reverse
order; a failure to stop one is logged and the others are still stopped.

A background task (:class:`Task`) that dies while the server runs is our bug: it says so at
once (a critical log line), not at shutdown, and the others keep going.

Some collaborators only exist once an earlier component has started (the election needs the
bound xDS address, the confirm hint names the bound admin address); they are small objects built
first and given to both sides (:class:`pilotfish.etcd.election.Leadership`,
:class:`pilotfish.app.parts.ConfirmHint`), never attributes patched onto a built object.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from typing import Any, Protocol

__all__ = ["Component", "Step", "Task", "running"]

_log = logging.getLogger("pilotfish")


class Component(Protocol):
    """A part of the process that runs: started once, stopped once (if it started)."""

    @property
    def name(self) -> str:
        """What it is, in log lines (``xds``, ``registry-tokens``)."""
        ...

    async def start(self) -> None:
        """Make it run; returns once it does. Raises if it cannot (nothing is left running)."""
        ...

    async def stop(self) -> None:
        """Undo :meth:`start`."""
        ...


class Step:
    """A component from two plain functions (either may be left out): ``start`` and ``stop``."""

    def __init__(
        self, name: str, start: Callable[[], object] | None = None, stop: Callable[[], object] | None = None
    ) -> None:
        self.name = name
        self._start = start
        self._stop = stop

    async def start(self) -> None:
        await _call(self._start)

    async def stop(self) -> None:
        await _call(self._stop)


async def _call(function: Callable[[], object] | None) -> None:
    """Call ``function`` (if any), and await what it returns if that is awaitable."""
    if function is not None:
        done = function()
        if inspect.isawaitable(done):
            await done


class Task:
    """A background task: ``run()`` is started as a task by :meth:`start` and cancelled (and
    awaited) by :meth:`stop`. A task that fails while the server runs is reported at once."""

    def __init__(self, name: str, run: Callable[[], Coroutine[Any, Any, None]]) -> None:
        self.name = name
        self._run = run
        self.task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self.task = asyncio.create_task(self._run(), name=self.name)
        self.task.add_done_callback(_report_death)

    async def stop(self) -> None:
        task = self.task
        if task is None:
            return
        task.remove_done_callback(_report_death)
        task.cancel()
        with contextlib.suppress(Exception, asyncio.CancelledError):  # (a death was reported)
            await task


def _report_death(task: asyncio.Task[None]) -> None:
    """A background task failed while the server runs: our bug (each handles what it expects)."""
    if task.cancelled() or task.exception() is None:
        return  # (some end by design: the wait for sources, once they are in)
    error = task.exception()
    _log.critical(
        "background task %s failed with %r: a bug in pilotfish, please report it; restart this replica",
        task.get_name(),
        error,
        exc_info=error,
    )


@contextlib.asynccontextmanager
async def running(components: Sequence[Component]) -> AsyncIterator[None]:
    """Start ``components`` in order; on leaving, stop those started, in reverse order."""
    started: list[Component] = []
    try:
        for component in components:
            await component.start()
            started.append(component)
        yield
    finally:
        for component in reversed(started):
            try:
                await component.stop()
            except Exception:
                _log.exception("stopping %s failed", component.name)
