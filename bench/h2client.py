"""A lean gRPC client for the fleet simulator: one bidirectional streaming call per HTTP/2
connection, on an asyncio Protocol.

Why
---
The simulator's proxies used grpc.aio channels, and at 1,000 proxies those cost about as much CPU
per push as the server being measured, on the same cores. A real Envoy's (C++) client costs a
small fraction of that. This client does what a correct HTTP/2 gRPC client must and nothing more,
so the simulator's CPU stays small next to the server's.

Theory of operation
-------------------
:class:`H2Channel` is one TCP connection (an :class:`asyncio.Protocol`); :class:`H2Call` is the one
stream on it (stream 1). Bytes from the socket are cut into frames in ``data_received`` and each
frame is handled there and then: connection frames (SETTINGS, PING, WINDOW_UPDATE, GOAWAY) by the
channel, the stream's (HEADERS + CONTINUATION, DATA, RST_STREAM) by the call. No task runs per
connection or per stream. A complete gRPC message (5-byte prefix + bytes; a DATA frame may hold
several, a message may span many frames) goes to the ``on_message`` callback, called from
``data_received`` (no coroutine per message), or when there is none, to a queue that
``await call.read()`` drains. Writes are synchronous: frames go to the transport at once.

- Framing and header blocks come from :mod:`pilotfish.transport.frames` (shared with the server). Our
  header block is HPACK literals that never touch the dynamic table; the server's are decoded with
  ``hpack.Decoder`` (grpc core uses Huffman coding and the dynamic table). Every block is decoded,
  even for a stream already ended, so the decoder's table stays in step with the server's encoder.
- Flow control (RFC 9113 section 5.2): we receive with Envoy's default windows (256 MiB, stream
  and connection) and send WINDOW_UPDATEs once half a window is used; the stream's half waits
  until ``read()``'s queue is empty, so a slow reader holds the server back. We send within the
  server's windows and frame size, queueing what does not fit until its WINDOW_UPDATE or SETTINGS.
- The call ends with its trailers (or a trailers-only response): ``grpc-status`` 0 is a clean end
  (``read()`` returns None); anything else raises :class:`H2Error`, whose ``code`` is the gRPC
  status name (as ``grpc.StatusCode.X.name``). RST_STREAM, GOAWAY (for a stream the server will
  not process), connection loss and protocol errors map to names the way gRPC's
  PROTOCOL-HTTP2.md and http-grpc-status-mapping.md say.

Not here, on purpose: TLS, compression, deadlines, more than one stream per connection, transport
write backpressure (the simulator writes small requests), server push (disabled in our SETTINGS).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from typing import cast
from urllib.parse import unquote_to_bytes

import hpack

from pilotfish.transport.frames import (
    ACK,
    CONNECTION_PREFACE,
    CONTINUATION,
    DATA,
    DEFAULT_MAX_FRAME,
    DEFAULT_WINDOW,
    END_HEADERS,
    END_STREAM,
    GOAWAY,
    HEADERS,
    MAX_WINDOW,
    PADDED,
    PING,
    PRIORITY,
    PUSH_PROMISE,
    RST_STREAM,
    SETTINGS,
    WINDOW_UPDATE,
    ErrorCode,
    Setting,
    frame,
    frame_content,
    frame_header,
    goaway,
    grpc_prefix,
    header_block,
    parse_frame_header,
    parse_grpc_prefix,
    parse_settings,
    rst_stream,
    settings,
    table_size_update,
    unpack_u32,
    window_update,
)

__all__ = ["STATUS_NAMES", "H2Call", "H2Channel", "H2Error"]

STATUS_NAMES = ("OK", "CANCELLED", "UNKNOWN", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED", "NOT_FOUND",
                "ALREADY_EXISTS", "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION", "ABORTED",
                "OUT_OF_RANGE", "UNIMPLEMENTED", "INTERNAL", "UNAVAILABLE", "DATA_LOSS", "UNAUTHENTICATED")
"""gRPC status names by code, as ``grpc.StatusCode`` names them."""

WINDOW = 256 * 1024 * 1024
"""Our receive window, stream and connection: Envoy's defaults (``initial_stream_window_size``,
``initial_connection_window_size``), so the server is never held back by a proxy."""
USER_AGENT = b"pilotfish-bench-h2client/1"
_STREAM_ID = 1  # the one stream a channel carries (client streams are odd, starting at 1)
_HPACK_DEFAULT_TABLE = 4096
_MAX_FRAME_LIMIT = 2**24 - 1
_ENHANCE_YOUR_CALM = 0xB
_INADEQUATE_SECURITY = 0xC

# RST_STREAM error code -> gRPC status (PROTOCOL-HTTP2.md, "Errors"); any other code: INTERNAL.
_RESET_STATUS = {ErrorCode.REFUSED_STREAM: "UNAVAILABLE", ErrorCode.CANCEL: "CANCELLED",
                 _ENHANCE_YOUR_CALM: "RESOURCE_EXHAUSTED", _INADEQUATE_SECURITY: "PERMISSION_DENIED"}
# HTTP status of a response without grpc-status -> gRPC status (http-grpc-status-mapping.md).
_HTTP_STATUS = {400: "INTERNAL", 401: "UNAUTHENTICATED", 403: "PERMISSION_DENIED", 404: "UNIMPLEMENTED",
                429: "UNAVAILABLE", 502: "UNAVAILABLE", 503: "UNAVAILABLE", 504: "UNAVAILABLE"}


def _http_status_name(status: bytes | None) -> str:
    """The gRPC status of a response that has an HTTP status other than 200 and no grpc-status."""
    return _HTTP_STATUS.get(int(status), "UNKNOWN") if status and status.isdigit() else "UNKNOWN"


class H2Error(Exception):
    """A call that ended without status OK. ``code``: the gRPC status name (``UNAVAILABLE``,
    ``CANCELLED``, ``INTERNAL``, ...); ``details``: the server's grpc-message or what went wrong."""

    def __init__(self, code: str, details: str = "") -> None:
        super().__init__(f"{code}: {details}" if details else code)
        self.code = code
        self.details = details


class _ConnectionError(Exception):
    """An HTTP/2 connection error (RFC 9113 section 5.4.1): GOAWAY with ``code``, then close."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


class H2Channel(asyncio.Protocol):
    """One HTTP/2 connection to a gRPC server, carrying one call (see the module docstring).

    ``await H2Channel.connect(host, port)``, then :meth:`call` once; :meth:`close` when done.
    """

    def __init__(self, authority: bytes, *, window: int = WINDOW) -> None:
        self._authority = authority
        self.window = window
        """Our receive window (stream and connection; at least the default 65,535 for the connection)."""
        self._transport: asyncio.Transport | None = None
        """None once closed (by us or the peer): nothing more is written."""
        self._buffer = b""
        """Received bytes not yet handled: at most one partial frame."""
        self._decoder = hpack.Decoder()
        self._call: H2Call | None = None
        self._block: bytearray | None = None
        """A header block still waiting for its CONTINUATION frames (on ``_block_stream``)."""
        self._block_stream = 0
        self._block_end_stream = False
        self._goaway = ""
        """What the server's GOAWAY said, for the error of a call the connection loss ends."""
        self._table_size: int | None = None
        """A dynamic table size update owed at the start of our next header block."""
        # Send side: the server's settings and the connection's send window.
        self.max_frame = DEFAULT_MAX_FRAME
        self.initial_window = DEFAULT_WINDOW
        self.send_window = DEFAULT_WINDOW
        # Receive side: the connection's window and bytes received since our last WINDOW_UPDATE.
        self.recv_window = max(window, DEFAULT_WINDOW)
        self._unreported = 0
        # Frame handlers indexed by frame type (types 0-9; others are ignored, RFC 9113 section 4.1).
        by_type = {DATA: self._on_data, HEADERS: self._on_headers, PRIORITY: self._on_priority,
                   RST_STREAM: self._on_rst_stream, SETTINGS: self._on_settings, PUSH_PROMISE: self._on_push_promise,
                   PING: self._on_ping, GOAWAY: self._on_goaway, WINDOW_UPDATE: self._on_window_update,
                   CONTINUATION: self._on_continuation}
        self._handlers = tuple(by_type[kind] for kind in range(len(by_type)))

    @classmethod
    async def connect(cls, host: str, port: int, *, timeout: float = 20.0, window: int = WINDOW) -> H2Channel:
        """A new connection (its preface and SETTINGS already written); :class:`H2Error`
        UNAVAILABLE if it cannot be made within ``timeout`` seconds. ``window``: our receive window."""
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(timeout):
                _, channel = await loop.create_connection(lambda: cls(f"{host}:{port}".encode(), window=window),
                                                           host, port)
        except OSError as exc:  # refused, unreachable, timed out (TimeoutError is an OSError)
            raise H2Error("UNAVAILABLE", f"connect to {host}:{port}: {str(exc) or type(exc).__name__}") from None
        return channel

    def call(self, path: str, *, on_message: Callable[[bytes], None] | None = None,
             metadata: tuple[tuple[bytes, bytes], ...] = ()) -> H2Call:
        """Start the channel's one call to ``path`` (``/package.Service/Method``). Messages go to
        ``on_message`` as they arrive, or (without it) to :meth:`H2Call.read`."""
        if self._call is not None:
            raise RuntimeError("an H2Channel carries one call")
        call = self._call = H2Call(self, _STREAM_ID, self.initial_window, self.window, on_message)
        if self._transport is None or self._goaway:  # no new stream after a GOAWAY (RFC 9113 section 6.8)
            call._finish(H2Error("UNAVAILABLE", self._goaway or "connection closed"))
            return call
        block = header_block([
            (b":method", b"POST"), (b":scheme", b"http"), (b":path", path.encode()),
            (b":authority", self._authority), (b"content-type", b"application/grpc"), (b"te", b"trailers"),
            (b"user-agent", USER_AGENT), *metadata,
        ])
        if self._table_size is not None:
            block = table_size_update(self._table_size) + block
            self._table_size = None
        # HEADERS, then CONTINUATIONs if the block is larger than a frame (it never is in practice).
        size = self.max_frame
        chunks = [block[i:i + size] for i in range(0, len(block), size)] or [b""]
        out = [frame(HEADERS, END_HEADERS if len(chunks) == 1 else 0, _STREAM_ID, chunks[0])]
        out += [frame(CONTINUATION, END_HEADERS if n == len(chunks) - 1 else 0, _STREAM_ID, chunk)
                for n, chunk in enumerate(chunks) if n > 0]
        self._transport.write(b"".join(out))
        return call

    def close(self) -> None:
        """Cancel the call if it is still going, say GOAWAY and close the connection."""
        if self._call is not None and not self._call.done:
            self._call.cancel()
        if self._transport is not None:
            self._transport.write(goaway(0, ErrorCode.NO_ERROR))
            self._transport.close()
            self._transport = None

    # -- asyncio.Protocol ----------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream transport (uvloop's does not subclass asyncio.Transport, hence no isinstance check).
        self._transport = cast(asyncio.Transport, transport)
        # No push, our stream window; then the connection window raised to match. Frame and header
        # table sizes stay at their defaults (16 KiB, 4 KiB), as Envoy's do.
        preface = CONNECTION_PREFACE + settings({Setting.ENABLE_PUSH: 0, Setting.INITIAL_WINDOW_SIZE: self.window})
        if self.window > DEFAULT_WINDOW:
            preface += window_update(0, self.window - DEFAULT_WINDOW)
        self._transport.write(preface)

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport = None
        if self._call is not None and not self._call.done:
            reason = self._goaway or "connection closed" + (f": {exc}" if exc else "")
            self._call._finish(H2Error("UNAVAILABLE", reason))

    def data_received(self, data: bytes) -> None:
        if self._buffer:
            data = self._buffer + data
        end = len(data)
        offset = 0
        view = memoryview(data)
        handlers = self._handlers
        try:
            while end - offset >= 9 and self._transport is not None:
                length, kind, flags, stream_id = parse_frame_header(data, offset)
                if length > DEFAULT_MAX_FRAME:  # our SETTINGS_MAX_FRAME_SIZE
                    raise _ConnectionError(ErrorCode.FRAME_SIZE_ERROR, f"a {length}-byte frame")
                start = offset + 9
                stop = start + length
                if stop > end:
                    break
                offset = stop
                if self._block is not None and kind != CONTINUATION:
                    raise _ConnectionError(ErrorCode.PROTOCOL_ERROR, "a header block interrupted")
                if kind < len(handlers):
                    handlers[kind](flags, stream_id, view[start:stop])
            self._replenish()
        except _ConnectionError as exc:
            self._connection_error(exc.code, str(exc))
        self._buffer = data[offset:] if offset < end and self._transport is not None else b""

    # -- frames --------------------------------------------------------------------------------

    def _on_data(self, flags: int, stream_id: int, payload: memoryview) -> None:
        size = len(payload)
        self.recv_window -= size
        self._unreported += size
        if self.recv_window < 0:
            raise _ConnectionError(ErrorCode.FLOW_CONTROL_ERROR, "DATA beyond the connection window")
        call = self._stream(stream_id)
        if call is not None:
            call._on_data(flags, payload)

    def _on_headers(self, flags: int, stream_id: int, payload: memoryview) -> None:
        content = frame_content(HEADERS, flags, payload)
        if stream_id == 0 or content is None:
            raise _ConnectionError(ErrorCode.PROTOCOL_ERROR, "a malformed HEADERS frame")
        self._block = bytearray(content)
        self._block_stream = stream_id
        self._block_end_stream = bool(flags & END_STREAM)
        if flags & END_HEADERS:
            self._end_block()

    def _on_continuation(self, flags: int, stream_id: int, payload: memoryview) -> None:
        if self._block is None or stream_id != self._block_stream:
            raise _ConnectionError(ErrorCode.PROTOCOL_ERROR, "CONTINUATION without a header block")
        self._block += payload
        if flags & END_HEADERS:
            self._end_block()

    def _end_block(self) -> None:
        assert self._block is not None
        block, self._block = bytes(self._block), None
        try:
            headers = self._decoder.decode(block, raw=True)
        except hpack.HPACKError as exc:
            raise _ConnectionError(ErrorCode.COMPRESSION_ERROR, f"header block: {exc}") from None
        call = self._stream(self._block_stream)
        if call is not None:
            call._on_headers(dict(headers), self._block_end_stream)

    def _on_priority(self, flags: int, stream_id: int, payload: memoryview) -> None:
        pass  # advice for a server's scheduler; a client has nothing to do

    def _on_rst_stream(self, flags: int, stream_id: int, payload: memoryview) -> None:
        if len(payload) != 4:
            raise _ConnectionError(ErrorCode.FRAME_SIZE_ERROR, "RST_STREAM of the wrong size")
        call = self._stream(stream_id)
        if call is not None:
            call._on_reset(unpack_u32(payload))

    def _on_settings(self, flags: int, stream_id: int, payload: memoryview) -> None:
        if stream_id != 0:
            raise _ConnectionError(ErrorCode.PROTOCOL_ERROR, "SETTINGS on a stream")
        if flags & ACK:  # the server applied ours
            if payload:
                raise _ConnectionError(ErrorCode.FRAME_SIZE_ERROR, "SETTINGS ACK with a payload")
            return
        if len(payload) % 6:
            raise _ConnectionError(ErrorCode.FRAME_SIZE_ERROR, "SETTINGS of the wrong size")
        call = self._call
        for identifier, value in parse_settings(payload):
            if identifier == Setting.INITIAL_WINDOW_SIZE:
                if value > MAX_WINDOW:
                    raise _ConnectionError(ErrorCode.FLOW_CONTROL_ERROR, "INITIAL_WINDOW_SIZE too large")
                # Changes the window of open streams by the difference (RFC 9113 section 6.9.2).
                if call is not None:
                    call.send_window += value - self.initial_window
                    if call.send_window > MAX_WINDOW:
                        raise _ConnectionError(ErrorCode.FLOW_CONTROL_ERROR, "stream window overflow")
                self.initial_window = value
            elif identifier == Setting.MAX_FRAME_SIZE:
                if not DEFAULT_MAX_FRAME <= value <= _MAX_FRAME_LIMIT:
                    raise _ConnectionError(ErrorCode.PROTOCOL_ERROR, f"MAX_FRAME_SIZE {value}")
                self.max_frame = value
            elif identifier == Setting.HEADER_TABLE_SIZE and call is None and value < _HPACK_DEFAULT_TABLE:
                # The server's decoder allows a smaller table than the default: our next (and only)
                # header block must start by saying ours is no larger (RFC 7541 section 4.2).
                self._table_size = value
        self._write(frame(SETTINGS, ACK, 0))
        if call is not None:
            call._flush()

    def _on_push_promise(self, flags: int, stream_id: int, payload: memoryview) -> None:
        raise _ConnectionError(ErrorCode.PROTOCOL_ERROR, "PUSH_PROMISE with push disabled")

    def _on_ping(self, flags: int, stream_id: int, payload: memoryview) -> None:
        if stream_id != 0:
            raise _ConnectionError(ErrorCode.PROTOCOL_ERROR, "PING on a stream")
        if len(payload) != 8:
            raise _ConnectionError(ErrorCode.FRAME_SIZE_ERROR, "PING of the wrong size")
        if not flags & ACK:
            self._write(frame(PING, ACK, 0, bytes(payload)))

    def _on_goaway(self, flags: int, stream_id: int, payload: memoryview) -> None:
        if stream_id != 0 or len(payload) < 8:
            raise _ConnectionError(ErrorCode.PROTOCOL_ERROR, "a malformed GOAWAY")
        last_stream = unpack_u32(payload) & 0x7FFF_FFFF
        code = unpack_u32(payload, 4)
        debug = bytes(payload[8:]).decode("utf-8", "replace")
        self._goaway = f"GOAWAY (HTTP/2 error {code}){': ' + debug if debug else ''}"
        # Streams up to last_stream may still complete; a later one was never processed.
        call = self._call
        if call is not None and not call.done and call.stream_id > last_stream:
            call._finish(H2Error("UNAVAILABLE", self._goaway))

    def _on_window_update(self, flags: int, stream_id: int, payload: memoryview) -> None:
        if len(payload) != 4:
            raise _ConnectionError(ErrorCode.FRAME_SIZE_ERROR, "WINDOW_UPDATE of the wrong size")
        increment = unpack_u32(payload) & 0x7FFF_FFFF
        if stream_id == 0:
            if increment == 0:
                raise _ConnectionError(ErrorCode.PROTOCOL_ERROR, "a zero WINDOW_UPDATE")
            self.send_window += increment
            if self.send_window > MAX_WINDOW:
                raise _ConnectionError(ErrorCode.FLOW_CONTROL_ERROR, "connection window overflow")
            call = self._call
        else:
            call = self._stream(stream_id)
            if call is None:
                return
            if increment == 0:
                call._stream_error(ErrorCode.PROTOCOL_ERROR, "a zero WINDOW_UPDATE")
                return
            call.send_window += increment
            if call.send_window > MAX_WINDOW:
                call._stream_error(ErrorCode.FLOW_CONTROL_ERROR, "stream window overflow")
                return
        if call is not None:
            call._flush()

    # -- helpers -------------------------------------------------------------------------------

    def _stream(self, stream_id: int) -> H2Call | None:
        """The live call a stream frame is for; None for our ended stream (frames still in flight
        are ignored); a connection error for a stream we never opened."""
        call = self._call
        if call is None or stream_id != call.stream_id:
            raise _ConnectionError(ErrorCode.PROTOCOL_ERROR, f"a frame on stream {stream_id}, never opened")
        return None if call.done else call

    def _replenish(self) -> None:
        """WINDOW_UPDATEs for what was received, once half a window is used (fewer frames than
        one per DATA frame). The stream's waits until ``read()``'s queue is drained."""
        out = b""
        call = self._call
        half = self.window // 2
        if call is not None and call._unreported >= half and not call._messages and not call.done:
            out += window_update(call.stream_id, call._unreported)
            call.recv_window += call._unreported
            call._unreported = 0
        if self._unreported >= half:
            out += window_update(0, self._unreported)
            self.recv_window += self._unreported
            self._unreported = 0
        if out:
            self._write(out)

    def _write(self, data: bytes) -> None:
        if self._transport is not None:
            self._transport.write(data)

    def _connection_error(self, code: int, message: str) -> None:
        """GOAWAY and close: the server broke HTTP/2 (or hpack could not decode it)."""
        if self._call is not None and not self._call.done:
            self._call._finish(H2Error("INTERNAL", f"HTTP/2 connection error {code}: {message}"))
        if self._transport is not None:
            self._transport.write(goaway(0, code, message.encode()))
            self._transport.close()
            self._transport = None


class H2Call:
    """The one bidirectional streaming call of an :class:`H2Channel` (made by :meth:`H2Channel.call`)."""

    def __init__(self, channel: H2Channel, stream_id: int, send_window: int, recv_window: int,
                 on_message: Callable[[bytes], None] | None) -> None:
        self.stream_id = stream_id
        self.send_window = send_window
        self.recv_window = recv_window
        self.done = False
        """True once the call has ended (trailers, reset, cancel, connection loss)."""
        self._channel = channel
        self._on_message = on_message
        self._messages: deque[bytes] = deque()
        """Received messages not yet read (only without ``on_message``)."""
        self._waiter: asyncio.Future[None] | None = None
        self._error: BaseException | None = None
        self._rx = bytearray()
        """Received bytes of a message not complete yet."""
        self._unreported = 0
        self._headers_seen = False
        self._remote_closed = False
        self._pending: deque[memoryview] = deque()
        """Prefixed messages (or their rests) waiting for send window."""
        self._writes_ended = False
        """After :meth:`done_writing`: END_STREAM follows whatever is still queued."""
        self._end_sent = False

    # -- the caller's side ---------------------------------------------------------------------

    def write(self, message: bytes) -> None:
        """Send one message (serialized protobuf); queued if the server's windows are exhausted."""
        if self.done or self._writes_ended:
            raise self._error or RuntimeError("write after the call's end")
        channel = self._channel
        size = len(message) + 5
        if (not self._pending and size <= self.send_window and size <= channel.send_window
                and size <= channel.max_frame and channel._transport is not None):
            self.send_window -= size
            channel.send_window -= size
            channel._transport.write(frame_header(size, DATA, 0, self.stream_id) + grpc_prefix(size - 5) + message)
            return
        self._pending.append(memoryview(grpc_prefix(size - 5) + message))
        self._flush()

    def done_writing(self) -> None:
        """Half-close: no more messages from us (END_STREAM after whatever is still queued)."""
        if not self.done and not self._writes_ended:
            self._writes_ended = True
            self._flush()

    async def read(self) -> bytes | None:
        """The next message; None when the call ended with status OK; :class:`H2Error` otherwise."""
        while True:
            if self._messages:
                message = self._messages.popleft()
                if not self._messages:
                    self._channel._replenish()  # caught up: the server may send more
                return message
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
            if not self._remote_closed:
                self._channel._write(rst_stream(self.stream_id, ErrorCode.CANCEL))
            self._messages.clear()
            self._finish(H2Error("CANCELLED", "cancelled by the client"))

    # -- frames from the channel ---------------------------------------------------------------

    def _on_data(self, flags: int, payload: memoryview) -> None:
        size = len(payload)
        self.recv_window -= size
        self._unreported += size
        if self.recv_window < 0:
            return self._stream_error(ErrorCode.FLOW_CONTROL_ERROR, "DATA beyond the stream window")
        if flags & PADDED:
            content = frame_content(DATA, flags, payload)
            if content is None:
                raise _ConnectionError(ErrorCode.PROTOCOL_ERROR, "padding longer than the frame")
            payload = content
        if payload:
            if not self._headers_seen:
                return self._stream_error(ErrorCode.PROTOCOL_ERROR, "DATA before the response headers")
            self._receive(payload)
        if flags & END_STREAM and not self.done:
            self._remote_closed = True
            self._finish(H2Error("INTERNAL", "the server ended the stream without trailers"))

    def _receive(self, payload: memoryview) -> None:
        """Cut complete messages out of ``_rx`` + ``payload`` and hand them over."""
        rx = self._rx
        if not rx:
            # Common case: the frame starts with a message, often holds it whole: no copy into _rx.
            offset, end = 0, len(payload)
            while end - offset >= 5:
                flag, length = parse_grpc_prefix(payload, offset)
                if end - offset - 5 < length:
                    break
                start = offset + 5
                offset = start + length
                if not self._deliver(flag, bytes(payload[start:offset])):
                    return
            if offset < end:
                rx += payload[offset:]
            return
        rx += payload
        while len(rx) >= 5:
            flag, length = parse_grpc_prefix(rx, 0)
            if len(rx) - 5 < length:
                return
            with memoryview(rx) as view:
                message = view[5:5 + length].tobytes()
            del rx[:5 + length]
            if not self._deliver(flag, message):
                return

    def _deliver(self, compressed: int, message: bytes) -> bool:
        """One message to its reader; False if the call ended meanwhile."""
        if compressed:  # we never offered an encoding (no grpc-accept-encoding)
            self._stream_error(ErrorCode.CANCEL, "a compressed message, no encoding was offered", "INTERNAL")
            return False
        if self._on_message is None:
            self._messages.append(message)
            self._wake()
            return True
        try:
            self._on_message(message)
        except Exception as exc:  # the caller's bug: ends the call, raised by wait_closed()
            if not self.done:
                self._channel._write(rst_stream(self.stream_id, ErrorCode.CANCEL))
                self._finish(exc)
        return not self.done

    def _on_headers(self, headers: dict[bytes, bytes], end_stream: bool) -> None:
        if not self._headers_seen:
            self._headers_seen = True
            status = headers.get(b":status")
            if end_stream:  # trailers-only: status and grpc-status in one block
                return self._on_trailers(headers, status)
            if status != b"200":
                return self._stream_error(ErrorCode.CANCEL, f"HTTP status {status!r}", _http_status_name(status))
            if not headers.get(b"content-type", b"").startswith(b"application/grpc"):
                return self._stream_error(ErrorCode.CANCEL, "not a gRPC response (content-type)", "UNKNOWN")
            return None
        if not end_stream:
            return self._stream_error(ErrorCode.PROTOCOL_ERROR, "a second header block not ending the stream")
        return self._on_trailers(headers, None)

    def _on_trailers(self, trailers: dict[bytes, bytes], http_status: bytes | None) -> None:
        self._remote_closed = True
        status = trailers.get(b"grpc-status")
        message = unquote_to_bytes(trailers.get(b"grpc-message", b"")).decode("utf-8", "replace")
        if status is None:
            if http_status not in (None, b"200"):
                return self._finish(H2Error(_http_status_name(http_status), message or f"HTTP status {http_status!r}"))
            return self._finish(H2Error("UNKNOWN", "the trailers have no grpc-status"))
        number = int(status) if status.isdigit() else -1
        code = STATUS_NAMES[number] if 0 <= number < len(STATUS_NAMES) else "UNKNOWN"
        if code == "OK" and self._rx:
            return self._finish(H2Error("INTERNAL", "the stream ended inside a message"))
        return self._finish(None if code == "OK" else H2Error(code, message))

    def _on_reset(self, code: int) -> None:
        self._remote_closed = True
        self._finish(H2Error(_RESET_STATUS.get(code, "INTERNAL"), f"stream reset by the server (HTTP/2 error {code})"))

    # -- internals -----------------------------------------------------------------------------

    def _flush(self) -> None:
        """Send what is queued as far as both send windows and the frame size allow."""
        channel = self._channel
        pending = self._pending
        out: list[bytes | memoryview] = []
        while pending and not self.done:
            size = min(self.send_window, channel.send_window, channel.max_frame, len(pending[0]))
            if size <= 0:
                break
            head = pending[0]
            if size == len(head):
                pending.popleft()
            else:
                pending[0] = head[size:]
            out += (frame_header(size, DATA, 0, self.stream_id), head[:size])
            self.send_window -= size
            channel.send_window -= size
        if self._writes_ended and not self._end_sent and not pending and not self.done:
            out.append(frame_header(0, DATA, END_STREAM, self.stream_id))
            self._end_sent = True
        if out:
            channel._write(b"".join(out))

    def _stream_error(self, http2_code: int, message: str, status: str = "INTERNAL") -> None:
        """End the call because of something the server sent: RST_STREAM ``http2_code``."""
        if not self.done:
            if not self._remote_closed:
                self._channel._write(rst_stream(self.stream_id, http2_code))
            self._finish(H2Error(status, message))

    def _finish(self, error: BaseException | None) -> None:
        if self.done:
            return
        self.done = True
        self._error = error
        self._pending.clear()
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
