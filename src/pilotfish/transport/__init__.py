"""pilotfish's own HTTP/2 transport for gRPC.

:mod:`~pilotfish.transport.frames` encodes and decodes frames; :mod:`~pilotfish.transport.h2` is
one sans-IO HTTP/2 connection (server or client role) that enforces RFC 9113 and explicit limits:
bytes in, events out, bytes to send. Neither imports asyncio: an I/O adapter moves the bytes.
:mod:`~pilotfish.transport.aio` is that adapter on asyncio (and the gRPC server on it),
:mod:`~pilotfish.transport.tls` the TLS contexts and peer identities, :mod:`~pilotfish.transport.tlsio`
TLS on the event loop with OpenSSL on the socket, :mod:`~pilotfish.transport.site`
serving an aiohttp app with the same accept and connection caps as the xDS port.

The core (frames, h2) imports nothing but the standard library; the adapters may import ``events``,
``resources`` and ``errors``; nothing here imports protocol or a service.
"""

from __future__ import annotations

from pilotfish.transport.h2 import (
    Connection,
    ConnectionTerminated,
    Event,
    HeadersReceived,
    Limits,
    MessageReceived,
    MessageRejected,
    Role,
    StreamEnded,
    StreamReset,
)

__all__ = [
    "Connection",
    "ConnectionTerminated",
    "Event",
    "HeadersReceived",
    "Limits",
    "MessageReceived",
    "MessageRejected",
    "Role",
    "StreamEnded",
    "StreamReset",
]
