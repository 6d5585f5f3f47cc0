"""Serving an aiohttp application on ``host:port``, over TLS when given a context, and the
loopback test the HTTP APIs (registry, admin) warn by. Shared by the registry API, the admin API
and REST xDS, which are served the same way."""

from __future__ import annotations

import ipaddress
import socket
import ssl

from aiohttp import web

from pilotfish.bootstrap import split_address

__all__ = ["is_loopback", "serve_app"]


def is_loopback(host: str) -> bool:
    """Whether ``host`` only answers on the loopback interface (``localhost``, 127.0.0.0/8, ::1)."""
    try:
        return host == "localhost" or ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


async def serve_app(app: web.Application, address: str, *,
                    tls: ssl.SSLContext | None = None) -> tuple[web.AppRunner, str]:
    """Serve ``app`` on ``address`` (``host:port``; port 0 = any free), over TLS when ``tls`` is
    given; returns the runner (``cleanup()`` stops it) and the bound ``host:port``."""
    host, port = split_address(address)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        sock = socket.create_server((host, port), reuse_port=False)
        await web.SockSite(runner, sock, ssl_context=tls).start()
    except BaseException:
        await runner.cleanup()
        raise
    return runner, f"{host}:{sock.getsockname()[1]}"
