"""pilotfish's own HTTP/2 transport for gRPC.

:mod:`~pilotfish.transport.frames` encodes and decodes frames; :mod:`~pilotfish.transport.h2` is
one sans-IO HTTP/2 connection (server or client role) that enforces RFC 9113 and explicit limits:
bytes in, events out, bytes to send. Neither imports asyncio: an I/O adapter moves the bytes.
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
    "Connection", "ConnectionTerminated", "Event", "HeadersReceived", "Limits", "MessageReceived",
    "MessageRejected", "Role", "StreamEnded", "StreamReset",
]
