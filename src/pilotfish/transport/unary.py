"""One unary gRPC call from a command line tool, blocking, over the own HTTP/2 core.

``pilotfish status --csds`` asks a server's ClientStatusDiscoveryService for one answer; grpcio
is not a dependency of pilotfish, and the sans-IO core (:mod:`pilotfish.transport.h2`) plays the
client role, so this is the core over a blocking socket: connect (TLS with ALPN h2 when given a
context), send the preface, the request's headers (with the caller's metadata) and its one
message, read until the trailers, return the response message or raise :class:`CallFailed` with
the gRPC status and message. Bounded: one call, ``timeout`` seconds in all, the response at most
:data:`MAX_RESPONSE` bytes.
"""

from __future__ import annotations

import socket
import ssl
import time
import urllib.parse

from pilotfish.transport.h2 import (
    Connection,
    ConnectionTerminated,
    HeadersReceived,
    Limits,
    MessageReceived,
    MessageRejected,
    Role,
    StreamReset,
)

__all__ = ["MAX_RESPONSE", "CallFailed", "unary_call"]

MAX_RESPONSE = 64 << 20
"""Bytes of a response message at most (a CSDS answer for 1,000 proxies is a few MB)."""

UNAVAILABLE = 14
DEADLINE_EXCEEDED = 4


class CallFailed(Exception):
    """The call ended without status OK: ``code`` (gRPC's number) and the server's message."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(f"gRPC status {code}: {message}")
        self.code = code
        self.message = message


def unary_call(
    address: str,
    path: str,
    request: bytes,
    *,
    tls: ssl.SSLContext | None = None,
    metadata: tuple[tuple[str, str], ...] = (),
    timeout: float = 10.0,
) -> bytes:
    """The response message of the unary call ``path`` with ``request`` on ``address`` (``host:port``)."""
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    deadline = time.monotonic() + timeout
    try:
        raw = socket.create_connection((host, int(port)), timeout=timeout)
    except OSError as exc:
        raise CallFailed(UNAVAILABLE, f"cannot connect to {address}: {exc}") from None
    sock: socket.socket = raw
    try:
        if tls is not None:
            tls.set_alpn_protocols(["h2"])
            try:
                sock = tls.wrap_socket(raw, server_hostname=host)
            except (OSError, ssl.SSLError) as exc:
                raise CallFailed(UNAVAILABLE, f"TLS with {address} failed: {exc}") from None
        return _call(sock, f"{host}:{port}", path, request, metadata, deadline, tls is not None)
    finally:
        sock.close()


def _call(
    sock: socket.socket,
    authority: str,
    path: str,
    request: bytes,
    metadata: tuple[tuple[str, str], ...],
    deadline: float,
    secure: bool,
) -> bytes:
    h2 = Connection(role=Role.CLIENT, limits=Limits(max_message_size=MAX_RESPONSE))
    stream = h2.open_stream()
    h2.send_headers(
        stream,
        [
            (b":method", b"POST"),
            (b":scheme", b"https" if secure else b"http"),
            (b":path", urllib.parse.quote(path, safe="/.").encode()),
            (b":authority", authority.encode()),
            (b"content-type", b"application/grpc"),
            (b"te", b"trailers"),
            *((key.lower().encode(), value.encode()) for key, value in metadata),
        ],
    )
    h2.send_message(stream, request)
    h2.end_stream(stream)
    response: bytes | None = None
    status: tuple[int, str] | None = None
    while status is None:
        sock.sendall(h2.data_to_send())
        left = deadline - time.monotonic()
        if left <= 0:
            raise CallFailed(DEADLINE_EXCEEDED, "no answer in time")
        sock.settimeout(left)
        try:
            data = sock.recv(65536)
        except TimeoutError:
            raise CallFailed(DEADLINE_EXCEEDED, "no answer in time") from None
        except OSError as exc:
            raise CallFailed(UNAVAILABLE, f"the connection failed: {exc}") from None
        if not data:
            raise CallFailed(UNAVAILABLE, "the server closed the connection")
        for event in h2.receive(data):
            if isinstance(event, MessageReceived) and event.stream_id == stream:
                response = event.data
                h2.acknowledge(stream, event.flow_controlled_length)
            elif isinstance(event, HeadersReceived) and event.stream_id == stream and event.end_stream:
                fields = dict(event.headers)
                code = fields.get(b"grpc-status")
                if code is None:
                    raise CallFailed(
                        UNAVAILABLE, f"the server answered without a gRPC status ({fields.get(b':status')!r})"
                    )
                status = int(code), urllib.parse.unquote(fields.get(b"grpc-message", b"").decode(errors="replace"))
            elif isinstance(event, MessageRejected):
                raise CallFailed(event.grpc_status, event.reason)
            elif isinstance(event, StreamReset | ConnectionTerminated):
                raise CallFailed(UNAVAILABLE, f"the server ended the call: {event.reason}")
    if status[0] != 0:
        raise CallFailed(*status)
    if response is None:
        raise CallFailed(UNAVAILABLE, "the server answered OK without a message")
    return response
