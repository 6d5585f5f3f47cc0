"""A gRPC server on asyncio's Protocol API: pilotfish's own HTTP/2 transport for xDS.

Why not grpc.aio: every message a grpc.aio server writes or reads crosses from Python into grpc
core and back through a completion queue and an asyncio future, about 150 us of CPU each here. A
fan-out is one write and one read per proxy, so 1,000 proxies cost ~0.35 CPU-s before pilotfish
does any work of its own (``python -m bench.grpc_floor``). xDS needs a small part of gRPC:
bidirectional streams of length-prefixed messages, no compression, no deadlines. Done on the
event loop directly, a response is one socket write of bytes the cache already shared
between streams, and a request is parsed inside ``data_received``: no task, future or thread per
message or per stream.

What is implemented (RFC 9113, and gRPC over HTTP/2): connection preface and SETTINGS, HPACK
header decoding (the ``hpack`` package), streams with both directions of flow control, DATA
split at the peer's max frame size, PING answers, RST_STREAM, GOAWAY, trailers-only responses for
unknown methods and refused streams, graceful stop, TLS and mTLS (an ``ssl.SSLContext`` given to
:meth:`GrpcServer.start`; the peer's verified identity is :attr:`Call.peer_identity`, see
:mod:`pilotfish.server.tls`). Not implemented: server push (gRPC never uses it), compression (a
compressed message is answered with UNIMPLEMENTED). TCP keepalive finds dead peers at no Python cost.

Applications register *methods*: ``path -> factory(call) -> handler``. A handler is called back
synchronously: ``on_message(bytes)``, ``on_half_close()`` (the client has sent all it will),
``on_closed(reason)`` (the call is over, however it ended: exactly once). It answers through the
:class:`Call`: ``send(*parts)`` writes one message made of ``parts``, ``finish(code, message)``
ends the call with trailers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
from collections import deque
from collections.abc import Callable, Mapping
from typing import Protocol

import hpack

from pilotfish.server import http2 as h2
from pilotfish.server.http2 import ErrorCode, GrpcStatus, Setting
from pilotfish.server.tls import peer_identity

__all__ = ["Call", "GrpcServer", "Handler", "MethodFactory", "RpcError"]

_log = logging.getLogger("pilotfish.server.grpc")

_MB = 1024 * 1024
# What pilotfish offers its peers. Requests are small, so big receive windows cost nothing (data
# is consumed as it arrives) and spare the peer from waiting on WINDOW_UPDATEs.
STREAM_WINDOW = 4 * _MB
CONNECTION_WINDOW = 64 * _MB
MAX_CONCURRENT_STREAMS = 256
MAX_HEADER_LIST = 64 * 1024
MAX_RECEIVE_MESSAGE = 64 * _MB
FLUSH_BATCH = 32
"""Connections with output that wait for one flush, at most (see :meth:`GrpcServer.mark_dirty`).
Measured at 1,000 proxies (p99 of an endpoint change): 8-32 ~210-230 ms, 128 ~265 ms, 512 ~255 ms."""
TLS_HANDSHAKE_TIMEOUT = 10.0  # seconds a TLS client gets to finish its handshake
LISTEN_BACKLOG = 65_535  # the kernel caps it at net.core.somaxconn; a reconnect storm needs it
# TCP keepalive: an idle peer that vanished (no FIN, no RST) is found within ~60 s.
_KEEPALIVE = ((socket.TCP_KEEPIDLE, 30), (socket.TCP_KEEPINTVL, 10), (socket.TCP_KEEPCNT, 3))

_SERVER_SETTINGS = h2.settings({
    Setting.MAX_CONCURRENT_STREAMS: MAX_CONCURRENT_STREAMS,
    Setting.INITIAL_WINDOW_SIZE: STREAM_WINDOW,
    Setting.MAX_HEADER_LIST_SIZE: MAX_HEADER_LIST,
    Setting.ENABLE_PUSH: 0,
})
_SETTINGS_ACK = h2.frame(h2.SETTINGS, h2.ACK, 0)
_OPENING = (_SERVER_SETTINGS
            + h2.window_update(0, CONNECTION_WINDOW - h2.DEFAULT_WINDOW))
_RESPONSE_HEADERS = h2.header_block([(b":status", b"200"), (b"content-type", b"application/grpc")])


class RpcError(Exception):
    """Raised by a handler to end its call with a gRPC status other than OK."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class Handler(Protocol):
    """What a method's factory returns: the callbacks of one call."""

    def on_message(self, data: bytes) -> None: ...

    def on_half_close(self) -> None: ...

    def on_closed(self, reason: str) -> None: ...


MethodFactory = Callable[["Call"], Handler]


def _trailers(code: int, message: str) -> list[tuple[bytes, bytes]]:
    trailers = [(b"grpc-status", str(code).encode())]
    if message:
        trailers.append((b"grpc-message", h2.percent_encode(message)))
    return trailers


class Call:
    """One gRPC call: one HTTP/2 stream of a connection."""

    __slots__ = ("_conn", "_headers_sent", "_pending", "_received", "_trailers", "closed",
                 "handler", "id", "remote_closed", "unacked", "window")

    def __init__(self, conn: _Connection, stream_id: int) -> None:
        self._conn = conn
        self.id = stream_id
        self.window = conn.peer_initial_window
        """How many DATA bytes the peer lets us send on this stream now."""
        self.unacked = 0
        """DATA bytes received and not yet given back with a WINDOW_UPDATE."""
        self.handler: Handler | None = None
        self.closed = False
        """We have ended the stream (trailers queued or sent) or it was reset."""
        self.remote_closed = False
        self._headers_sent = False
        self._pending: deque[memoryview] | None = None
        """DATA waiting for flow-control window (views of shared bytes: nothing is copied)."""
        self._received: bytearray | None = None
        """A message's bytes so far, when one spans DATA frames."""
        self._trailers: tuple[bytes, str] | None = None
        """The trailers' header block (and why the call ends), when they wait behind pending DATA."""

    @property
    def peer(self) -> str:
        return self._conn.peer

    @property
    def peer_identity(self) -> str:
        """The identity in the client's verified TLS certificate (SPIFFE URI SAN, else DNS SAN);
        ``""`` without mTLS."""
        return self._conn.identity

    def send(self, *parts: bytes) -> None:
        """Send one message, the concatenation of ``parts``. Never blocks: what flow control does
        not allow yet waits in the call and goes out as the peer opens its window."""
        if self.closed:
            return
        conn = self._conn
        if not self._headers_sent:
            self._headers_sent = True
            conn.write_headers(self.id, _RESPONSE_HEADERS, end_stream=False)
        length = 0
        for part in parts:
            length += len(part)
        size = length + 5
        if (self._pending is None and size <= self.window and size <= conn.window
                and size <= conn.peer_max_frame and not conn.paused):
            # The usual case: one frame the peer's windows take whole (Envoy opens 256 MiB ones).
            self.window -= size
            conn.window -= size
            write = conn.write
            write(h2.frame_header(size, h2.DATA, 0, self.id))
            write(h2.grpc_prefix(length))
            for part in parts:
                write(part)
            return
        # Larger, or held back by flow control: frames cut from views of the shared parts (no
        # copy of the response per stream), as many as the windows allow now.
        if self._pending is None:
            self._pending = deque()
        self._pending.append(memoryview(h2.grpc_prefix(length)))
        self._pending.extend(memoryview(p) for p in parts if p)
        conn.flush(self)

    def finish(self, code: int = GrpcStatus.OK, message: str = "") -> None:
        """End the call with ``code`` (after any DATA still waiting for window)."""
        if self.closed:
            return
        self.closed = True
        if self._headers_sent:
            block = h2.header_block(_trailers(code, message))
        else:  # trailers-only response
            block = _RESPONSE_HEADERS + h2.header_block(_trailers(code, message))
            self._headers_sent = True
        reason = "finished" if code == GrpcStatus.OK else f"finished with gRPC status {code}: {message}"
        if self._pending:
            self._trailers = (block, reason)
        else:
            self._conn.end_call(self, block, reason)

    def release_handler(self, reason: str) -> None:
        """Tell the handler, once, that the call is over, and drop it: the handler holds the
        call, so no reference cycle is left for the GC to find."""
        handler, self.handler = self.handler, None
        if handler is not None:
            try:
                handler.on_closed(reason)
            except Exception:
                _log.exception("on_closed of stream %d failed", self.id)

    def drain(self) -> bool:
        """Send what flow control allows of the pending DATA. True when all of it has gone."""
        pending, conn = self._pending, self._conn
        if pending is None:
            return True
        write, header, max_frame = conn.write, h2.frame_header, conn.peer_max_frame
        while pending:
            budget = min(self.window, conn.window, max_frame)
            if conn.paused or budget <= 0:
                return False
            size = 0
            parts = []
            while pending and size < budget:  # one frame may carry several pieces
                chunk = pending[0]
                take = min(len(chunk), budget - size)
                if take == len(chunk):
                    parts.append(chunk)
                    pending.popleft()
                else:
                    parts.append(chunk[:take])
                    pending[0] = chunk[take:]
                size += take
            write(header(size, h2.DATA, 0, self.id))
            for part in parts:
                write(part)
            self.window -= size
            conn.window -= size
        self._pending = None
        if self._trailers is not None:
            (block, reason), self._trailers = self._trailers, None
            conn.end_call(self, block, reason)
        return True


class _Connection(asyncio.Protocol):
    """One client connection: the HTTP/2 state machine and its calls."""

    def __init__(self, server: GrpcServer) -> None:
        self._server = server
        self.transport: asyncio.Transport = None  # type: ignore[assignment]  # set in connection_made
        self.peer = ""
        self.identity = ""
        """The client's identity from its verified certificate (mTLS), else ``""``."""
        self._buffer = bytearray()
        self._preface_seen = False
        self._decoder = hpack.Decoder(max_header_list_size=MAX_HEADER_LIST)
        self._calls: dict[int, Call] = {}
        self._last_stream = 0
        self._headers_stream = 0
        """The stream whose header block continues in CONTINUATION frames (0: none)."""
        self._header_fragments: list[bytes] = []
        self._headers_flags = 0
        self.window = h2.DEFAULT_WINDOW
        """Connection-level send window."""
        self.peer_initial_window = h2.DEFAULT_WINDOW
        self.peer_max_frame = h2.DEFAULT_MAX_FRAME
        self._unacked = 0
        self._waiting: dict[Call, None] = {}
        """Calls with pending DATA held back by the connection (its window, or paused writing)."""
        self._table_update = b""
        self._out: list[bytes | memoryview] | None = None
        """What was written this turn of the event loop (see :meth:`write`)."""
        self.paused = False
        self.closing = False

    # -- asyncio.Protocol -------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # a stream transport (uvloop's is no subclass)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
                for option, value in _KEEPALIVE:
                    sock.setsockopt(socket.IPPROTO_TCP, option, value)
        peer = transport.get_extra_info("peername")
        if isinstance(peer, tuple):
            family = "ipv6" if ":" in peer[0] else "ipv4"
            self.peer = f"{family}:{peer[0]}:{peer[1]}"
        self.identity = peer_identity(transport.get_extra_info("peercert"))
        self._server.connections.add(self)
        self.write(_OPENING)

    def connection_lost(self, exc: Exception | None) -> None:
        self._server.connections.discard(self)
        reason = "connection lost" if exc is None else f"connection lost: {exc}"
        calls, self._calls = self._calls, {}
        self._waiting.clear()
        for call in calls.values():
            self._cancel(call, reason)

    def pause_writing(self) -> None:
        self.paused = True

    def resume_writing(self) -> None:
        self.paused = False
        self._drain_waiting()

    def data_received(self, data: bytes) -> None:
        if self._buffer:  # a frame (or the preface) was cut short by the previous read
            data = bytes(self._buffer) + data
            self._buffer.clear()
        offset, end = 0, len(data)
        if not self._preface_seen:
            size = len(h2.CONNECTION_PREFACE)
            if not h2.CONNECTION_PREFACE.startswith(data[:size]):
                self._fail(ErrorCode.PROTOCOL_ERROR, "not an HTTP/2 connection preface")
                return
            if end < size:
                self._buffer += data
                return
            self._preface_seen = True
            offset = size
        view = memoryview(data)
        on_frame, parse = self._on_frame, h2.parse_frame_header
        while end - offset >= 9:
            length, kind, flags, stream_id = parse(data, offset)
            if length > h2.DEFAULT_MAX_FRAME:  # we never raise SETTINGS_MAX_FRAME_SIZE
                self._fail(ErrorCode.FRAME_SIZE_ERROR, f"frame of {length} bytes")
                return
            if end - offset < 9 + length:
                break
            start = offset + 9
            offset = start + length
            on_frame(kind, flags, stream_id, view[start:offset])
            if self.transport.is_closing():
                return
        if offset < end:
            self._buffer += view[offset:]

    # -- frames -------------------------------------------------------------------------------

    def _on_frame(self, kind: int, flags: int, stream_id: int, payload: memoryview) -> None:
        if self._headers_stream and kind != h2.CONTINUATION:
            self._fail(ErrorCode.PROTOCOL_ERROR, "header block interrupted")
        elif kind == h2.DATA:
            self._on_data(flags, stream_id, payload)
        elif kind == h2.HEADERS:
            self._on_headers(flags, stream_id, payload)
        elif kind == h2.CONTINUATION:
            if stream_id != self._headers_stream or not stream_id:
                self._fail(ErrorCode.PROTOCOL_ERROR, "unexpected CONTINUATION")
                return
            self._header_fragments.append(bytes(payload))
            if flags & h2.END_HEADERS:
                self._headers_stream = 0
                self._on_header_block(stream_id, self._headers_flags, b"".join(self._header_fragments))
                self._header_fragments = []
        elif kind == h2.WINDOW_UPDATE:
            self._on_window_update(stream_id, payload)
        elif kind == h2.PING:
            if not flags & h2.ACK and len(payload) == 8:
                self.write(h2.frame(h2.PING, h2.ACK, 0, bytes(payload)))
        elif kind == h2.SETTINGS:
            if not flags & h2.ACK:
                self._on_settings(payload)
        elif kind == h2.RST_STREAM:
            call = self._calls.pop(stream_id, None)
            if call is not None:
                self._waiting.pop(call, None)
                self._cancel(call, f"reset by the client (error code {h2.unpack_u32(payload) if payload else 0})")
        elif kind == h2.GOAWAY:
            pass  # the client opens no more streams; the ones it has run to their end
        elif kind == h2.PUSH_PROMISE:
            self._fail(ErrorCode.PROTOCOL_ERROR, "a client cannot push")
        # PRIORITY and unknown frame types are ignored (RFC 9113 section 5.5)

    def _on_settings(self, payload: memoryview) -> None:
        if len(payload) % 6:
            self._fail(ErrorCode.FRAME_SIZE_ERROR, "SETTINGS length not a multiple of 6")
            return
        for key, value in h2.parse_settings(payload):
            if key == Setting.INITIAL_WINDOW_SIZE:
                if value > h2.MAX_WINDOW:
                    self._fail(ErrorCode.FLOW_CONTROL_ERROR, "INITIAL_WINDOW_SIZE too large")
                    return
                delta, self.peer_initial_window = value - self.peer_initial_window, value
                for call in self._calls.values():
                    call.window += delta
            elif key == Setting.MAX_FRAME_SIZE:
                if not h2.DEFAULT_MAX_FRAME <= value <= 16_777_215:
                    self._fail(ErrorCode.PROTOCOL_ERROR, "MAX_FRAME_SIZE out of range")
                    return
                self.peer_max_frame = value
            elif key == Setting.HEADER_TABLE_SIZE:
                # We never index, but a decoder that shrank its table expects to hear it.
                self._table_update = h2.table_size_update(value)
        self.write(_SETTINGS_ACK)
        for call in list(self._calls.values()):
            if call.drain():
                self._waiting.pop(call, None)

    def _on_window_update(self, stream_id: int, payload: memoryview) -> None:
        increment = h2.unpack_u32(payload) & 0x7FFF_FFFF if len(payload) == 4 else 0
        if increment == 0:
            self._fail(ErrorCode.PROTOCOL_ERROR, "WINDOW_UPDATE of 0")
            return
        if stream_id == 0:
            self.window += increment
            self._drain_waiting()
            return
        call = self._calls.get(stream_id)
        if call is not None:
            call.window += increment
            if call.drain():
                self._waiting.pop(call, None)

    def _on_headers(self, flags: int, stream_id: int, payload: memoryview) -> None:
        if not stream_id:
            self._fail(ErrorCode.PROTOCOL_ERROR, "HEADERS on stream 0")
            return
        content = h2.frame_content(h2.HEADERS, flags, payload)
        if content is None:
            self._fail(ErrorCode.PROTOCOL_ERROR, "HEADERS padding too long")
            return
        fragment = bytes(content)
        if flags & h2.END_HEADERS:
            self._on_header_block(stream_id, flags, fragment)
        else:
            self._headers_stream, self._headers_flags, self._header_fragments = stream_id, flags, [fragment]

    def _on_header_block(self, stream_id: int, flags: int, block: bytes) -> None:
        try:
            headers = self._decoder.decode(block, raw=True)
        except hpack.HPACKError as exc:
            self._fail(ErrorCode.COMPRESSION_ERROR, f"bad header block: {exc}")
            return
        call = self._calls.get(stream_id)
        if call is not None:  # trailers from the client: gRPC clients send none, but they end the stream
            if flags & h2.END_STREAM:
                self._on_remote_end(call)
            return
        if not stream_id % 2:
            self._fail(ErrorCode.PROTOCOL_ERROR, f"a client cannot open even-numbered stream {stream_id}")
            return
        if stream_id <= self._last_stream:
            return  # a stream that has ended (decoding its headers kept HPACK in step)
        self._last_stream = stream_id
        self._open_call(stream_id, flags, {name: value for name, value in headers})

    def _open_call(self, stream_id: int, flags: int, headers: Mapping[bytes, bytes]) -> None:
        if self.closing or len(self._calls) >= MAX_CONCURRENT_STREAMS:
            self.write(h2.rst_stream(stream_id, ErrorCode.REFUSED_STREAM))
            return
        call = self._calls[stream_id] = Call(self, stream_id)
        method = self._server.methods.get(headers.get(b":path", b""))
        content_type = headers.get(b"content-type", b"")
        if headers.get(b":method") != b"POST" or not content_type.startswith(b"application/grpc"):
            call.finish(GrpcStatus.UNIMPLEMENTED, "pilotfish serves gRPC only (POST, content-type application/grpc)")
        elif method is None:
            path = headers.get(b":path", b"").decode(errors="replace")
            call.finish(GrpcStatus.UNIMPLEMENTED, f"unknown method {path}")
        else:
            try:
                call.handler = method(call)
            except RpcError as exc:
                call.finish(exc.code, exc.message)
        if flags & h2.END_STREAM and stream_id in self._calls:
            self._on_remote_end(call)

    def _on_data(self, flags: int, stream_id: int, payload: memoryview) -> None:
        size = len(payload)
        self._unacked += size
        if self._unacked >= CONNECTION_WINDOW // 2:
            self.write(h2.window_update(0, self._unacked))
            self._unacked = 0
        call = self._calls.get(stream_id)
        if call is None or call.remote_closed:
            if stream_id > self._last_stream:
                self._fail(ErrorCode.PROTOCOL_ERROR, f"DATA on idle stream {stream_id}")
            return  # a stream we already ended: its data is dropped
        call.unacked += size
        if call.unacked >= STREAM_WINDOW // 2:
            self.write(h2.window_update(stream_id, call.unacked))
            call.unacked = 0
        if flags & h2.PADDED:
            content = h2.frame_content(h2.DATA, flags, payload)
            if content is None:
                self._fail(ErrorCode.PROTOCOL_ERROR, "DATA padding too long")
                return
            payload = content
        if payload and call.handler is not None and not call.closed:
            self._on_messages(call, payload)
        if flags & h2.END_STREAM and not call.remote_closed:
            self._on_remote_end(call)

    def _on_messages(self, call: Call, payload: memoryview) -> None:
        """Hand the handler every whole message in ``payload`` (after what an earlier frame left)."""
        if call._received is not None:
            call._received += payload
            data: bytes | bytearray | memoryview = call._received
        else:
            data = payload
        offset, end = 0, len(data)
        handler = call.handler
        assert handler is not None
        while end - offset >= 5:
            compressed, length = h2.parse_grpc_prefix(data, offset)
            if compressed:
                call.finish(GrpcStatus.UNIMPLEMENTED, "pilotfish accepts uncompressed messages only")
                break
            if length > MAX_RECEIVE_MESSAGE:
                call.finish(GrpcStatus.RESOURCE_EXHAUSTED, f"message of {length} bytes is over the limit")
                break
            if end - offset - 5 < length:
                break
            start = offset + 5
            offset = start + length
            try:
                handler.on_message(bytes(data[start:offset]))
            except RpcError as exc:
                call.finish(exc.code, exc.message)
            if call.closed:
                break
        if call.closed:
            call._received = None
        elif offset < end:
            call._received = bytearray(data[offset:])
        else:
            call._received = None

    def _on_remote_end(self, call: Call) -> None:
        call.remote_closed = True
        if call.closed:
            return
        if call._received:
            call.finish(GrpcStatus.INTERNAL, "the stream ended inside a message")
        elif call.handler is not None:
            call.handler.on_half_close()
            if not call.closed:
                call.finish()  # a handler that keeps nothing open after the client is done

    # -- sending --------------------------------------------------------------------------------

    def write(self, data: bytes | memoryview) -> None:
        """Queue ``data``; everything a connection is given in one turn of the event loop goes
        out in one ``send`` (a loopback send costs ~15 us of CPU, most of a small response)."""
        out = self._out
        if out is None:
            self._out = [data]
            self._server.mark_dirty(self)
        else:
            out.append(data)

    def flush_out(self) -> None:
        out, self._out = self._out, None
        if out and not self.transport.is_closing():
            self.transport.writelines(out)  # uvloop: one writev, no joined copy

    def write_headers(self, stream_id: int, block: bytes, *, end_stream: bool) -> None:
        if self._table_update:
            block, self._table_update = self._table_update + block, b""
        flags = h2.END_HEADERS | (h2.END_STREAM if end_stream else 0)
        self.write(h2.frame(h2.HEADERS, flags, stream_id, block))

    def end_call(self, call: Call, block: bytes, reason: str) -> None:
        """Write ``call``'s final header block; the stream is done on our side."""
        if self._calls.get(call.id) is not call or self.transport.is_closing():
            return
        self.write_headers(call.id, block, end_stream=True)
        del self._calls[call.id]
        self._waiting.pop(call, None)
        # Tell a handler that did not end the call itself (a no-op for one that did).
        call.release_handler(reason)
        if not call.remote_closed:  # tell the client to stop sending (RFC 9113 section 8.1)
            self.write(h2.rst_stream(call.id, ErrorCode.NO_ERROR))

    def flush(self, call: Call) -> None:
        if not call.drain() and (self.paused or self.window <= 0):
            self._waiting[call] = None

    def _drain_waiting(self) -> None:
        while self._waiting and not self.paused and self.window > 0:
            call = next(iter(self._waiting))
            del self._waiting[call]
            if not call.drain() and (self.paused or self.window <= 0):
                self._waiting[call] = None
                return

    # -- ending ---------------------------------------------------------------------------------

    def _cancel(self, call: Call, reason: str) -> None:
        call.closed = True
        call._pending = None
        call.release_handler(reason)

    def _fail(self, code: int, reason: str) -> None:
        """A connection error: GOAWAY, then close (every call is cancelled in connection_lost)."""
        _log.warning("closing HTTP/2 connection from %s: %s", self.peer, reason)
        if not self.transport.is_closing():
            self.write(h2.goaway(self._last_stream, code, reason.encode()[:200]))
            self.flush_out()
            self.transport.close()

    def shut_down(self, message: str) -> None:
        """Stop: every call ends UNAVAILABLE (so clients reconnect elsewhere or later), GOAWAY."""
        self.closing = True
        if self.transport.is_closing():
            return
        for call in list(self._calls.values()):
            call._pending = None
            call._trailers = None
            call.release_handler(message)
            call.finish(GrpcStatus.UNAVAILABLE, message)
        self.write(h2.goaway(self._last_stream, ErrorCode.NO_ERROR, message.encode()))
        self.flush_out()
        self.transport.close()


class GrpcServer:
    """Listens on one address and serves the registered ``methods`` ({path: factory})."""

    def __init__(self, methods: Mapping[str, MethodFactory]) -> None:
        self.methods: dict[bytes, MethodFactory] = {path.encode(): f for path, f in methods.items()}
        self.connections: set[_Connection] = set()
        self._server: asyncio.Server | None = None
        self._dirty: list[_Connection] = []
        self._loop: asyncio.AbstractEventLoop | None = None

    def mark_dirty(self, conn: _Connection) -> None:
        """``conn`` has output this turn: flush it (with every other such one) at the turn's end,
        or sooner once :data:`FLUSH_BATCH` connections wait, so that in a fan-out to thousands the
        first proxies get their response while the rest are still being written."""
        dirty = self._dirty
        if not dirty:
            (self._loop or asyncio.get_running_loop()).call_soon(self._flush)
        elif len(dirty) >= FLUSH_BATCH:
            self._dirty = []
            for waiting in dirty:
                waiting.flush_out()
            self._dirty.append(conn)
            return
        dirty.append(conn)

    def _flush(self) -> None:
        dirty, self._dirty = self._dirty, []
        for conn in dirty:
            conn.flush_out()

    async def start(self, host: str, port: int, *, tls: ssl.SSLContext | None = None) -> int:
        """Listen on ``host:port`` (0: any free port); returns the port. With ``tls``, only TLS
        connections are served (the context should offer ALPN ``h2``)."""
        loop = self._loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _Connection(self), host or None, port,
                                                backlog=LISTEN_BACKLOG, reuse_address=True, ssl=tls,
                                                ssl_handshake_timeout=TLS_HANDSHAKE_TIMEOUT if tls else None)
        bound: int = self._server.sockets[0].getsockname()[1]
        return bound

    async def stop(self, grace: float | None = None) -> None:
        """Stop listening, end every call with UNAVAILABLE and close the connections, waiting up
        to ``grace`` seconds for the peers to take what was written."""
        if self._server is None:
            return
        self._server.close()
        for conn in list(self.connections):
            conn.shut_down("pilotfish is shutting down")
        deadline = asyncio.get_running_loop().time() + (grace or 0.0)
        while self.connections and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.01)
        for conn in list(self.connections):
            conn.transport.abort()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._server.wait_closed(), timeout=1.0)
        self._server = None
