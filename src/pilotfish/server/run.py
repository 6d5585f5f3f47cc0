"""``pilotfish serve``: sources -> reconciler -> cache -> xDS, until stopped."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from dataclasses import dataclass, field
from pathlib import Path

from pilotfish.cache import SnapshotCache
from pilotfish.errors import ConfigError
from pilotfish.events import EventLog
from pilotfish.reconcile import DebounceSettings, Reconciler
from pilotfish.server.xds import XdsServer, start_grpc_server
from pilotfish.sources import load_desired, watch_file

__all__ = ["ServeSettings", "serve"]

_log = logging.getLogger("pilotfish")


@dataclass(frozen=True, slots=True, kw_only=True)
class ServeSettings:
    """How ``pilotfish serve`` runs."""

    snapshot: Path | None = None
    """The snapshot file (JSON or YAML) to serve and watch; None: no file source."""
    xds: str = "127.0.0.1:18000"
    """``host:port`` the xDS gRPC server listens on (port 0: any free port)."""
    event_log: Path | None = None
    """Where to append the JSON-lines event log; None: no event log."""
    debounce: DebounceSettings = field(default_factory=DebounceSettings)
    """How bursts of changes are batched and flapping endpoints damped."""
    grace_seconds: float = 1.0
    """On shutdown, how long open streams get to finish."""


async def serve(settings: ServeSettings, *, started: asyncio.Future[int] | None = None) -> None:
    """Serve until SIGINT/SIGTERM (or cancellation). ``started`` receives the bound xDS port.

    Raises :class:`ConfigError` if the snapshot file is invalid at start-up: there is no last
    good configuration to fall back on yet.
    """
    events = EventLog(settings.event_log)
    cache = SnapshotCache()
    reconciler = Reconciler(cache, settings=settings.debounce, events=events)
    tasks: list[asyncio.Task[None]] = []
    try:
        if settings.snapshot is not None:
            try:
                reconciler.update("file", load_desired(settings.snapshot))
            except ConfigError as exc:
                events.emit("snapshot_error", file=str(settings.snapshot), reason=exc.describe())
                raise
        reconciler.build_now()  # the first snapshot, before any proxy can connect

        xds = XdsServer(cache, events=events)
        server, port = await start_grpc_server(xds, settings.xds)
        host = settings.xds.rsplit(":", 1)[0]
        events.emit("server_started", xds=f"{host}:{port}",
                    snapshot=str(settings.snapshot) if settings.snapshot else None)
        _log.info("serving xDS on %s:%d", host, port)

        async def follow_file(path: Path) -> None:
            async for item in watch_file(path):
                if isinstance(item, ConfigError):
                    events.emit("snapshot_error", file=str(path), reason=item.describe())
                    _log.error("%s\nstill serving the last good snapshot", item.describe())
                else:
                    reconciler.update("file", item)

        tasks.append(asyncio.create_task(reconciler.run(), name="reconciler"))
        if settings.snapshot is not None:
            tasks.append(asyncio.create_task(follow_file(settings.snapshot), name="file-source"))

        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, stop.set)
        if started is not None and not started.done():
            started.set_result(port)
        try:
            await stop.wait()
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM):
                with contextlib.suppress(NotImplementedError, RuntimeError):
                    loop.remove_signal_handler(sig)
            await server.stop(settings.grace_seconds)
            events.emit("server_stopped")
    finally:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        events.close()
