"""``pilotfish serve``: a snapshot file, watched, served over xDS until stopped."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from dataclasses import dataclass
from pathlib import Path

from pilotfish.cache import SnapshotCache
from pilotfish.errors import ConfigError
from pilotfish.events import EventLog
from pilotfish.server.xds import XdsServer, start_grpc_server
from pilotfish.snapshot import Snapshot
from pilotfish.sources import load_snapshot, watch_snapshot_file

__all__ = ["ServeSettings", "serve"]

_log = logging.getLogger("pilotfish")


@dataclass(frozen=True, slots=True, kw_only=True)
class ServeSettings:
    """How ``pilotfish serve`` runs."""

    snapshot: Path
    """The snapshot file (JSON or YAML) to serve and watch."""
    xds: str = "127.0.0.1:18000"
    """``host:port`` the xDS gRPC server listens on (port 0: any free port)."""
    event_log: Path | None = None
    """Where to append the JSON-lines event log; None: no event log."""
    grace_seconds: float = 1.0
    """On shutdown, how long open streams get to finish."""


def _same_content(a: Snapshot, b: Snapshot) -> bool:
    return a.explicit_version == b.explicit_version and all(
        a.version(url) == ts.version for url, ts in b.types.items()
    )


async def serve(settings: ServeSettings, *, started: asyncio.Future[int] | None = None) -> None:
    """Serve until SIGINT/SIGTERM (or cancellation). ``started`` receives the bound port.

    Raises :class:`ConfigError` if the snapshot file is invalid at start-up: there is no last
    good configuration to fall back on yet.
    """
    events = EventLog(settings.event_log)
    try:
        snapshot = load_snapshot(settings.snapshot)
    except ConfigError as exc:
        events.emit("snapshot_error", file=str(settings.snapshot), reason=exc.describe())
        events.close()
        raise
    cache = SnapshotCache()
    cache.set_snapshot(snapshot)
    events.emit("snapshot_loaded", file=str(settings.snapshot), version=snapshot.label(),
                versions=snapshot.versions())
    xds = XdsServer(cache, events=events)
    server, port = await start_grpc_server(xds, settings.xds)
    host = settings.xds.rsplit(":", 1)[0]
    events.emit("server_started", xds=f"{host}:{port}", snapshot=str(settings.snapshot))
    _log.info("serving xDS on %s:%d from %s", host, port, settings.snapshot)

    async def follow_file() -> None:
        async for item in watch_snapshot_file(settings.snapshot):
            if isinstance(item, ConfigError):
                events.emit("snapshot_error", file=str(settings.snapshot), reason=item.describe())
                _log.error("%s\nstill serving the last good snapshot", item.describe())
                continue
            current = cache.snapshot()
            if current is not None and _same_content(current, item):
                events.emit("snapshot_unchanged", version=item.label())
                continue
            answered = cache.set_snapshot(item)
            events.emit("snapshot_loaded", file=str(settings.snapshot), version=item.label(),
                        versions=item.versions(), watches_answered=answered)
            _log.info("snapshot %s loaded (%s)", item.label(), item.versions())

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    watcher = asyncio.create_task(follow_file(), name="snapshot-file-watcher")
    if started is not None and not started.done():
        started.set_result(port)
    try:
        await stop.wait()
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.remove_signal_handler(sig)
        watcher.cancel()
        await server.stop(settings.grace_seconds)
        with contextlib.suppress(asyncio.CancelledError):
            await watcher
        events.emit("server_stopped")
        events.close()
