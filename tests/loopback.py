"""Connections from a chosen loopback source address, as another host would connect.

Linux routes all of 127.0.0.0/8 to the loopback interface, so a client socket bound to 127.0.0.2
(or .3, ...) before it connects reaches a server on 127.0.0.1 from an address of its own: what the
per-address connection caps count. Tests of those caps (tests/integration, tests/abuse, tests/e2e)
connect through :func:`connect_from`; the servers' ports come from the OS or from
:func:`pilotfish.envoy.free_port`, the one port picker of tests and bench.
"""

from __future__ import annotations

import socket

__all__ = ["connect_from"]


def connect_from(port: int, source: str, *, timeout: float = 10.0) -> socket.socket:
    """A TCP connection to 127.0.0.1:``port`` from the loopback address ``source`` (127.0.0.2,
    ...: a source address of its own, as another host would have), with ``timeout`` on its calls.
    The caller closes it."""
    sock = socket.socket()
    try:
        sock.bind((source, 0))
        sock.settimeout(timeout)
        sock.connect(("127.0.0.1", port))
    except OSError:
        sock.close()
        raise
    return sock
