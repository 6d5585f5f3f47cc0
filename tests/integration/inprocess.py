"""``pilotfish serve`` in the test's own event loop, for the integration tests of its HTTP APIs.

:func:`serving` starts :func:`pilotfish.app.serve` with the xDS server, the registry API and
the admin API on ports the OS picks (REST xDS too, when the settings ask for it) and a fast debounce, waits until it
listens, and finds the registry's, the admin API's (and REST's) address in its event log (``server_started``);
leaving the block stops it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from pathlib import Path

from pilotfish.app import ServeSettings, serve
from pilotfish.events import check_event_log, read_events
from pilotfish.reconcile import DebounceSettings

__all__ = ["TIMEOUT", "Running", "serving"]

TIMEOUT = 10.0


@dataclass
class Running:
    xds: str
    """``host:port`` of the xDS server."""
    registry: str
    """``host:port`` of the registry API."""
    events: Path
    """The event log."""
    rest: str | None = None
    """``host:port`` of REST xDS, when the settings ask for it (``rest``: any port is chosen)."""
    admin: str = ""
    """``host:port`` of the admin API."""

    def url(self, path: str) -> str:
        return f"http://{self.registry}{path}"


@contextlib.asynccontextmanager
async def serving(
    tmp_path: Path, settings: ServeSettings | None = None, *, timeout: float = TIMEOUT
) -> AsyncIterator[Running]:
    """Serve (``settings`` may set sources and options; addresses and the event log are set here);
    ``timeout``: how long it may take to listen (a large snapshot takes longer to build)."""
    log = tmp_path / "events.jsonl"
    settings = settings or ServeSettings()
    settings = replace(
        settings,
        xds=replace(settings.xds, address="127.0.0.1:0"),
        registry=replace(settings.registry, address="127.0.0.1:0"),
        admin=replace(settings.admin, address="127.0.0.1:0"),
        events=replace(settings.events, log=log),
        rest=replace(settings.rest, address=None if settings.rest.address is None else "127.0.0.1:0"),
        debounce=DebounceSettings(quiet=0.02, max_delay=0.2),
    )
    started: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(serve(settings, started=started))
    port = await asyncio.wait_for(started, timeout)
    line = next(e for e in read_events(log)[0] if e["event"] == "server_started")
    try:
        yield Running(f"127.0.0.1:{port}", line["registry"], log, line.get("rest"), line["admin"])
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    # Every event the server wrote is in the event log's contract (pilotfish.events.EVENTS).
    problems = check_event_log(log)
    assert not problems, "the event log broke its contract:\n" + "\n".join(problems[:20])
