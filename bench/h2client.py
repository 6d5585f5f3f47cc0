"""The fleet simulator's gRPC client: an asyncio adapter around pilotfish's sans-IO HTTP/2
connection (:class:`pilotfish.transport.h2.Connection` in the client role), one bidirectional
streaming call per connection, plaintext or TLS.

Why
---
The simulator's proxies used grpc.aio channels, and at 1,000 proxies those cost about as much CPU
per push as the server being measured, on the same cores. A real Envoy's (C++) client costs a
small fraction of that. This client does what a gRPC client must and nothing more, so the
simulator's CPU stays small next to the server's. The HTTP/2 rules (framing, HPACK, flow
control, every RFC 9113 check) are the server's own code, run in the other role: there is one
HTTP/2 implementation in the repository, and the simulator exercises it from both ends.

Theory of operation
-------------------
:class:`H2Channel` is one TCP (or TLS) connection, an :class:`asyncio.Protocol` that owns a
``Connection(role=Role.CLIENT)``; :class:`H2Call` is the one stream on it. ``data_received``
hands the bytes to :meth:`Connection.receive` and maps its events to the call; whatever the
connection queued meanwhile (ACKs, WINDOW_UPDATEs, the requests ``on_message`` wrote) goes to the
socket in one ``writelines`` at the end. Calls made outside ``data_received`` (``write``,
``read``, ``cancel``) flush at once. No task runs per connection or per stream.

- A complete gRPC message goes to the ``on_message`` callback (called from ``data_received``, no
  coroutine per message) or, without one, to a queue that ``await call.read()`` drains. Its bytes
  are given back to the server's flow control once consumed (the callback returned, or ``read()``
  took it), so a slow reader holds the server back by exactly the windows it granted.
- Windows: Envoy's defaults (256 MiB, stream and connection), so the server is never held back by
  a simulated proxy; the message size limit is the simulator's grpc.aio one (512 MiB).
- The call ends with its trailers (or a trailers-only response): ``grpc-status`` 0 is a clean end
  (``read()`` returns None); anything else raises :class:`H2Error`, whose ``code`` is the gRPC
  status name (as ``grpc.StatusCode.X.name``). RST_STREAM, GOAWAY (for a stream the server will
  not process), connection loss and protocol errors map to names the way gRPC's
  PROTOCOL-HTTP2.md and http-grpc-status-mapping.md say.
- TLS: :meth:`H2Channel.connect` takes an :class:`ssl.SSLContext` (``client_context`` makes one
  with ALPN ``h2``, a CA to trust and, for mTLS, a client certificate); a server that does not
  choose ``h2`` by ALPN is refused (UNAVAILABLE), as grpc-core does.

Not here, on purpose: compression, deadlines, more than one stream per connection, server push
(disabled in our SETTINGS).
"""

from __future__ import annotations

import asyncio
import ssl
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import cast
from urllib.parse import unquote_to_bytes

from pilotfish.transport.frames import DEFAULT_WINDOW, ErrorCode
from pilotfish.transport.h2 import (
    Connection,
    ConnectionTerminated,
    HeadersReceived,
    Limits,
    MessageReceived,
    MessageRejected,
    Role,
    StreamEnded,
    StreamReset,
)

__all__ = ["STATUS_NAMES", "H2Call", "H2Channel", "H2Error", "client_context"]

STATUS_NAMES = (
    "OK",
    "CANCELLED",
    "UNKNOWN",
    "INVALID_ARGUMENT",
    "DEADLINE_EXCEEDED",
    "NOT_FOUND",
    "ALREADY_EXISTS",
    "PERMISSION_DENIED",
    "RESOURCE_EXHAUSTED",
    "FAILED_PRECONDITION",
    "ABORTED",
    "OUT_OF_RANGE",
    "UNIMPLEMENTED",
    "INTERNAL",
    "UNAVAILABLE",
    "DATA_LOSS",
    "UNAUTHENTICATED",
)
"""gRPC status names by code, as ``grpc.StatusCode`` names them."""

WINDOW = 256 * 1024 * 1024
"""Our receive window, stream and connection: Envoy's defaults (``initial_stream_window_size``,
``initial_connection_window_size``), so the server is never held back by a proxy."""
MAX_MESSAGE = 512 * 1024 * 1024
"""Largest message received: what the simulator's grpc.aio channels allow."""
USER_AGENT = b"pilotfish-bench-h2client/2"

# RST_STREAM error code -> gRPC status (PROTOCOL-HTTP2.md, "Errors"); any other code: INTERNAL.
_RESET_STATUS = {
    ErrorCode.REFUSED_STREAM: "UNAVAILABLE",
    ErrorCode.CANCEL: "CANCELLED",
    ErrorCode.ENHANCE_YOUR_CALM: "RESOURCE_EXHAUSTED",
    ErrorCode.INADEQUATE_SECURITY: "PERMISSION_DENIED",
}
# HTTP status of a response without grpc-status -> gRPC status (http-grpc-status-mapping.md).
_HTTP_STATUS = {
    400: "INTERNAL",
    401: "UNAUTHENTICATED",
    403: "PERMISSION_DENIED",
    404: "UNIMPLEMENTED",
    429: "UNAVAILABLE",
    502: "UNAVAILABLE",
    503: "UNAVAILABLE",
    504: "UNAVAILABLE",
}


def _http_status_name(status: bytes | None) -> str:
    """The gRPC status of a response that has an HTTP status other than 200 and no grpc-status."""
    return _HTTP_STATUS.get(int(status), "UNKNOWN") if status and status.isdigit() else "UNKNOWN"


def client_context(*, ca: str | Path, cert: str | Path | None = None, key: str | Path | None = None) -> ssl.SSLContext:
    """A TLS client context for gRPC: trusts ``ca`` (a PEM file), offers ALPN ``h2`` and, for
    mTLS, presents ``cert``/``key`` (PEM files)."""
    context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(ca))
    context.set_alpn_protocols(["h2"])
    if cert is not None:
        context.load_cert_chain(str(cert), str(key) if key is not None else None)
    return context


class H2Error(Exception):
    """A call that ended without status OK. ``code``: the gRPC status name (``UNAVAILABLE``,
    ``CANCELLED``, ``INTERNAL``, ...); ``details``: the server's grpc-message or what went wrong."""

    def __init__(self, code: str, details: str = "") -> None:
        super().__init__(f"{code}: {details}" if details else code)
        self.code = code
        self.details = details


class H2Channel(asyncio.Protocol):
    """One HTTP/2 connection to a gRPC server, carrying one call (see the module docstring).

    ``await H2Channel.connect(host, port)``, then :meth:`call` once; :meth:`close` when done.
    """

    def __init__(self, authority: bytes, *, window: int = WINDOW, scheme: bytes = b"http") -> None:
        self._authority = authority
        self._scheme = scheme
        self.h2 = Connection(
            role=Role.CLIENT,
            limits=Limits(
                initial_window_size=window,
                connection_window_size=max(window, DEFAULT_WINDOW),
                max_message_size=MAX_MESSAGE,
            ),
        )
        self._transport: asyncio.Transport | None = None
        """None once closed (by us or the peer): nothing more is written."""
        self._call: H2Call | None = None
        self._receiving = False
        """Inside ``data_received``: output waits for its end (one write for all of it)."""
        self._goaway = ""
        """What the server's GOAWAY said, for the error of a call the connection loss ends."""

    @classmethod
    async def connect(
        cls,
        host: str,
        port: int,
        *,
        timeout: float = 20.0,
        window: int = WINDOW,
        tls: ssl.SSLContext | None = None,
        server_hostname: str | None = None,
    ) -> H2Channel:
        """A new connection (its preface and SETTINGS already written); :class:`H2Error`
        UNAVAILABLE if it cannot be made within ``timeout`` seconds. ``window``: our receive
        window; ``tls``: connect over TLS with this context (``server_hostname``: the name to
        verify, default ``host``)."""
        loop = asyncio.get_running_loop()
        scheme = b"https" if tls is not None else b"http"
        try:
            async with asyncio.timeout(timeout):
                transport, channel = await loop.create_connection(
                    lambda: cls(f"{host}:{port}".encode(), window=window, scheme=scheme),
                    host,
                    port,
                    ssl=tls,
                    server_hostname=(server_hostname or host) if tls is not None else None,
                )
        except (OSError, ssl.SSLError) as exc:  # refused, unreachable, timed out, handshake failed
            raise H2Error("UNAVAILABLE", f"connect to {host}:{port}: {str(exc) or type(exc).__name__}") from None
        ssl_object = transport.get_extra_info("ssl_object")
        if ssl_object is not None and ssl_object.selected_alpn_protocol() != "h2":
            channel.close()
            raise H2Error("UNAVAILABLE", f"connect to {host}:{port}: the server did not choose ALPN h2")
        return channel

    def call(
        self,
        path: str,
        *,
        on_message: Callable[[bytes], None] | None = None,
        metadata: tuple[tuple[bytes, bytes], ...] = (),
    ) -> H2Call:
        """Start the channel's one call to ``path`` (``/package.Service/Method``). Messages go to
        ``on_message`` as they arrive, or (without it) to :meth:`H2Call.read`."""
        if self._call is not None:
            raise RuntimeError("an H2Channel carries one call")
        if self._transport is None or self._goaway or self.h2.closed:  # no new stream after a GOAWAY
            call = self._call = H2Call(self, 0, on_message)
            call._finish(H2Error("UNAVAILABLE", self._goaway or "connection closed"))
            return call
        stream_id = self.h2.open_stream()
        call = self._call = H2Call(self, stream_id, on_message)
        self.h2.send_headers(
            stream_id,
            [
                (b":method", b"POST"),
                (b":scheme", self._scheme),
                (b":path", path.encode()),
                (b":authority", self._authority),
                (b"content-type", b"application/grpc"),
                (b"te", b"trailers"),
                (b"user-agent", USER_AGENT),
                *metadata,
            ],
        )
        self._flush()
        return call

    def close(self) -> None:
        """Cancel the call if it is still going, say GOAWAY and close the connection."""
        if self._call is not None and not self._call.done:
            self._call.cancel()
        if self._transport is not None:
            self.h2.close(ErrorCode.NO_ERROR)
            self._flush(now=True)
            self._transport.close()
            self._transport = None

    # -- asyncio.Protocol ----------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream transport (uvloop's does not subclass asyncio.Transport, hence no isinstance check).
        self._transport = cast(asyncio.Transport, transport)
        self._flush()  # the preface, our SETTINGS and the connection window's WINDOW_UPDATE

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport = None
        call = self._call
        if call is not None and not call.done:
            call._finish(H2Error("UNAVAILABLE", self._goaway or "connection closed" + (f": {exc}" if exc else "")))

    def pause_writing(self) -> None:
        self.h2.writing_paused = True

    def resume_writing(self) -> None:
        self.h2.resume_writing()
        self._flush()

    def data_received(self, data: bytes) -> None:
        h2 = self.h2
        call = self._call
        self._receiving = True
        try:
            for event in h2.receive(data):  # in the order of how often they come
                if call is None or call.done:  # frames in flight after the call ended
                    if isinstance(event, MessageReceived):
                        h2.acknowledge(event.stream_id, event.flow_controlled_length)
                    elif isinstance(event, ConnectionTerminated):
                        self._on_terminated(event)
                    continue
                if isinstance(event, MessageReceived):
                    call._on_message_received(event)
                elif isinstance(event, HeadersReceived):
                    call._on_headers(event)
                elif isinstance(event, StreamEnded):
                    call._on_stream_ended(event.incomplete_message)
                elif isinstance(event, StreamReset):
                    if event.remote:
                        call._finish(
                            H2Error(
                                _RESET_STATUS.get(event.error_code, "INTERNAL"),
                                f"stream reset by the server (HTTP/2 error {event.error_code})",
                            )
                        )
                    else:  # the server broke a stream rule: we reset it
                        call._finish(H2Error("INTERNAL", f"HTTP/2 stream error {event.error_code}: {event.reason}"))
                elif isinstance(event, MessageRejected):
                    h2.reset_stream(call.stream_id, ErrorCode.CANCEL)
                    call._finish(H2Error(STATUS_NAMES[event.grpc_status], event.reason))
                elif isinstance(event, ConnectionTerminated):
                    self._on_terminated(event)
        finally:
            self._receiving = False
        self._flush()
        if h2.closed and self._transport is not None:
            self._transport.close()
            self._transport = None

    def _on_terminated(self, event: ConnectionTerminated) -> None:
        call = self._call
        if not event.remote:  # the server broke HTTP/2: our GOAWAY is queued
            if call is not None and not call.done:
                call._finish(H2Error("INTERNAL", f"HTTP/2 connection error {event.error_code}: {event.reason}"))
            return
        self._goaway = f"GOAWAY (HTTP/2 error {event.error_code}): {event.reason}"
        # Streams up to last_stream_id may still complete (unless the GOAWAY is for an error);
        # a later one was never processed.
        if call is not None and not call.done and (call.stream_id > event.last_stream_id or self.h2.closed):
            call._finish(H2Error("UNAVAILABLE", self._goaway))

    # -- output --------------------------------------------------------------------------------

    def _flush(self, *, now: bool = False) -> None:
        """Write what the connection queued (at the end of ``data_received`` when inside it)."""
        if self._receiving and not now:
            return
        out = self.h2.take_output()
        if out and self._transport is not None:
            if self._scheme == b"https":  # one TLS record per flush, as Envoy writes (not one per piece)
                self._transport.write(b"".join(out))
            else:
                self._transport.writelines(out)


class H2Call:
    """The one bidirectional streaming call of an :class:`H2Channel` (made by :meth:`H2Channel.call`)."""

    def __init__(self, channel: H2Channel, stream_id: int, on_message: Callable[[bytes], None] | None) -> None:
        self.stream_id = stream_id
        self.done = False
        """True once the call has ended (trailers, reset, cancel, connection loss)."""
        self._channel = channel
        self._h2 = channel.h2
        self._on_message = on_message
        self._messages: deque[MessageReceived] = deque()
        """Received messages not yet read (only without ``on_message``)."""
        self._waiter: asyncio.Future[None] | None = None
        self._error: BaseException | None = None
        self._headers_seen = False
        self._outcome: H2Error | None = None
        """What the trailers said (None: OK), applied when the stream ends."""
        self._trailers_seen = False
        self._writes_ended = False

    # -- the caller's side ---------------------------------------------------------------------

    def write(self, *parts: bytes) -> None:
        """Send one message (serialized protobuf, in one or more parts: they are sent as they are,
        not joined); queued if the server's windows are exhausted."""
        if self.done or self._writes_ended:
            raise self._error or RuntimeError("write after the call's end")
        self._h2.send_message(self.stream_id, *parts)
        self._channel._flush()

    def done_writing(self) -> None:
        """Half-close: no more messages from us (END_STREAM after whatever is still queued)."""
        if not self.done and not self._writes_ended:
            self._writes_ended = True
            self._h2.end_stream(self.stream_id)
            self._channel._flush()

    async def read(self) -> bytes | None:
        """The next message; None when the call ended with status OK; :class:`H2Error` otherwise."""
        while True:
            if self._messages:
                event = self._messages.popleft()
                self._h2.acknowledge(self.stream_id, event.flow_controlled_length)  # consumed
                self._channel._flush()
                return event.data
            if self.done:
                if self._error is not None:
                    raise self._error
                return None
            await self._wait()

    async def wait_closed(self) -> None:
        """Until the call ends: returns at status OK, raises :class:`H2Error` otherwise (or what
        ``on_message`` raised)."""
        while not self.done:
            await self._wait()
        if self._error is not None:
            raise self._error

    def cancel(self) -> None:
        """End the call now (RST_STREAM CANCEL): messages not read yet are dropped, ``read()``
        raises CANCELLED."""
        if not self.done:
            self._h2.reset_stream(self.stream_id, ErrorCode.CANCEL)
            self._channel._flush()
            self._messages.clear()
            self._finish(H2Error("CANCELLED", "cancelled by the client"))

    # -- events from the channel ---------------------------------------------------------------

    def _on_message_received(self, event: MessageReceived) -> None:
        on_message = self._on_message
        if on_message is None:
            self._messages.append(event)
            self._wake()
            return
        try:
            on_message(event.data)
        except Exception as exc:  # the caller's bug: ends the call, raised by wait_closed()
            if not self.done:
                self._h2.reset_stream(self.stream_id, ErrorCode.CANCEL)
                self._finish(exc)
            return
        self._h2.acknowledge(self.stream_id, event.flow_controlled_length)  # consumed

    def _on_headers(self, event: HeadersReceived) -> None:
        headers = dict(event.headers)
        if event.trailers:
            self._on_trailers(headers, None)
            return
        self._headers_seen = True
        status = headers.get(b":status")
        if event.end_stream:  # trailers-only: status and grpc-status in one block
            self._on_trailers(headers, status)
        elif status != b"200":
            self._stream_error(f"HTTP status {status!r}", _http_status_name(status))
        elif not headers.get(b"content-type", b"").startswith(b"application/grpc"):
            self._stream_error("not a gRPC response (content-type)", "UNKNOWN")

    def _on_trailers(self, trailers: dict[bytes, bytes], http_status: bytes | None) -> None:
        self._trailers_seen = True
        status = trailers.get(b"grpc-status")
        message = unquote_to_bytes(trailers.get(b"grpc-message", b"")).decode("utf-8", "replace")
        if status is None:
            if http_status not in (None, b"200"):
                self._outcome = H2Error(_http_status_name(http_status), message or f"HTTP status {http_status!r}")
            else:
                self._outcome = H2Error("UNKNOWN", "the trailers have no grpc-status")
            return
        number = int(status) if status.isdigit() else -1
        code = STATUS_NAMES[number] if 0 <= number < len(STATUS_NAMES) else "UNKNOWN"
        self._outcome = None if code == "OK" else H2Error(code, message)

    def _on_stream_ended(self, incomplete_message: bool) -> None:
        if not self._trailers_seen:
            self._finish(H2Error("INTERNAL", "the server ended the stream without trailers"))
        elif incomplete_message and self._outcome is None:
            self._finish(H2Error("INTERNAL", "the stream ended inside a message"))
        else:
            self._finish(self._outcome)

    # -- internals -----------------------------------------------------------------------------

    def _stream_error(self, message: str, status: str) -> None:
        """End the call because of what the server sent: RST_STREAM CANCEL."""
        if not self.done:
            self._h2.reset_stream(self.stream_id, ErrorCode.CANCEL)
            self._finish(H2Error(status, message))

    def _finish(self, error: BaseException | None) -> None:
        if self.done:
            return
        self.done = True
        self._error = error
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def _wait(self) -> None:
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None
