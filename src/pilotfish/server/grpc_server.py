"""A gRPC server on asyncio's Protocol API: pilotfish's own HTTP/2 transport for xDS.

Why not grpc.aio: every message a grpc.aio server writes or reads crosses from Python into grpc
core and back through a completion queue and an asyncio future, about 150 us of CPU each here. A
fan-out is one write and one read per proxy, so 1,000 proxies cost ~0.35 CPU-s before pilotfish
does any work of its own (``python -m bench.grpc_floor``). xDS needs a small part of gRPC:
bidirectional streams of length-prefixed messages, no compression, no deadlines. Done on the
event loop directly, a response is one socket write of bytes the cache already shared
between streams, and a request is parsed inside ``data_received``: no task, future or thread per
message or per stream.

HTTP/2 itself (RFC 9113: framing, HPACK, flow control, every rule a peer can trip and the limits
of :class:`~pilotfish.transport.h2.Limits`) is the sans-IO :class:`pilotfish.transport.h2.Connection`;
this module is its asyncio adapter: it moves bytes between the socket and the connection, turns
the connection's events into calls of the registered methods, writes each connection's output
once per turn of the event loop (batched, see :meth:`GrpcServer.mark_dirty`), and stops reading a
peer while it does not read (``pause_writing``). What gRPC adds: trailers-only responses for
unknown methods, UNIMPLEMENTED for compressed messages, graceful stop, TLS and mTLS (an
``ssl.SSLContext`` given to :meth:`GrpcServer.start`; the peer's verified identity is
:attr:`Call.peer_identity`, see :mod:`pilotfish.server.tls`). Not implemented: compression. TCP
keepalive finds dead peers at no Python cost.

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
from collections.abc import Callable, Mapping
from typing import Protocol

from pilotfish.server.tls import peer_identity
from pilotfish.transport import frames as h2
from pilotfish.transport.frames import ErrorCode, GrpcStatus
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

__all__ = ["Call", "GrpcServer", "Handler", "MethodFactory", "RpcError"]

_log = logging.getLogger("pilotfish.server.grpc")

FLUSH_BATCH = 32
"""Connections with output that wait for one flush, at most (see :meth:`GrpcServer.mark_dirty`).
Measured at 1,000 proxies (p99 of an endpoint change): 8-32 ~210-230 ms, 128 ~265 ms, 512 ~255 ms."""
TLS_HANDSHAKE_TIMEOUT = 10.0  # seconds a TLS client gets to finish its handshake
LISTEN_BACKLOG = 65_535  # the kernel caps it at net.core.somaxconn; a reconnect storm needs it
# TCP keepalive: an idle peer that vanished (no FIN, no RST) is found within ~60 s.
_KEEPALIVE = ((socket.TCP_KEEPIDLE, 30), (socket.TCP_KEEPINTVL, 10), (socket.TCP_KEEPCNT, 3))

_RESPONSE_HEADERS = h2.header_block([(b":status", b"200"), (b"content-type", b"application/grpc")])
_REASON_LIMIT = 200
"""Characters of a peer-caused reason kept in a log line (a peer must not fill the log)."""


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

    __slots__ = ("_conn", "_h2", "_headers_sent", "closed", "handler", "id")

    def __init__(self, conn: _Connection, stream_id: int) -> None:
        self._conn = conn
        self._h2 = conn.h2
        self.id = stream_id
        self.handler: Handler | None = None
        self.closed = False
        """We have ended the call (trailers queued) or it was reset."""
        self._headers_sent = False

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
        not allow yet waits in the stream (as views of ``parts``, never copied) and goes out as
        the peer opens its window."""
        if self.closed:
            return
        if not self._headers_sent:
            self._headers_sent = True
            self._h2.send_header_block(self.id, _RESPONSE_HEADERS)
        self._h2.send_message(self.id, *parts)

    def finish(self, code: int = GrpcStatus.OK, message: str = "", *, abandon_pending: bool = False) -> None:
        """End the call with ``code`` (the trailers go out after any DATA still waiting for
        window, or at once, that DATA dropped, with ``abandon_pending``) and tell the handler,
        if it is still there."""
        if self.closed:
            return
        self.closed = True
        if self._headers_sent:
            block = h2.header_block(_trailers(code, message))
        else:  # trailers-only response
            block = _RESPONSE_HEADERS + h2.header_block(_trailers(code, message))
            self._headers_sent = True
        self._h2.send_header_block(self.id, block, end_stream=True, abandon_pending=abandon_pending)
        self._conn.forget(self)
        self.release_handler("finished" if code == GrpcStatus.OK else f"finished with gRPC status {code}: {message}")

    def release_handler(self, reason: str) -> None:
        """Tell the handler, once, that the call is over, and drop it: the handler holds the
        call, so no reference cycle is left for the GC to find."""
        handler, self.handler = self.handler, None
        if handler is not None:
            try:
                handler.on_closed(reason)
            except Exception:
                _log.exception("on_closed of stream %d failed", self.id)


class _Connection(asyncio.Protocol):
    """One client connection: the asyncio side of a :class:`~pilotfish.transport.h2.Connection`."""

    def __init__(self, server: GrpcServer) -> None:
        self._server = server
        self.transport: asyncio.Transport = None  # type: ignore[assignment]  # set in connection_made
        self._dirty = False
        self._reading = True
        self.h2 = server.connection_factory(role=Role.SERVER, limits=server.limits, on_output=self._output_ready)
        self.peer = ""
        self.identity = ""
        """The client's identity from its verified certificate (mTLS), else ``""``."""
        self._calls: dict[int, Call] = {}

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
        self._output_ready()  # the SETTINGS queued when the connection was made

    def connection_lost(self, exc: Exception | None) -> None:
        self._server.connections.discard(self)
        reason = "connection lost" if exc is None else f"connection lost: {exc}"
        calls, self._calls = self._calls, {}
        for call in calls.values():
            call.closed = True
            call.release_handler(reason)

    def pause_writing(self) -> None:
        self.h2.writing_paused = True
        self._set_reading(False)  # a peer that does not read gets no more of its requests read

    def resume_writing(self) -> None:
        self.h2.resume_writing()
        self._set_reading(self.h2.wants_to_read)

    def _set_reading(self, reading: bool) -> None:
        if reading == self._reading or self.transport.is_closing():
            return
        self._reading = reading
        with contextlib.suppress(RuntimeError, NotImplementedError):
            if reading:
                self.transport.resume_reading()
            else:
                self.transport.pause_reading()

    def data_received(self, data: bytes) -> None:
        conn = self.h2
        calls = self._calls
        for event in conn.receive(data):  # in the order of how often they come
            if isinstance(event, MessageReceived):
                call = calls.get(event.stream_id)
                if call is not None and call.handler is not None:
                    try:
                        call.handler.on_message(event.data)
                    except RpcError as exc:
                        call.finish(exc.code, exc.message)
                conn.acknowledge(event.stream_id, event.flow_controlled_length)  # consumed: reopen the window
            elif isinstance(event, HeadersReceived):
                if not event.trailers:  # (a gRPC client sends none; its END_STREAM follows as StreamEnded)
                    self._open_call(event.stream_id, event.headers)
            elif isinstance(event, StreamEnded):
                call = calls.get(event.stream_id)
                if call is not None:
                    self._on_remote_end(call, event.incomplete_message)
            elif isinstance(event, StreamReset):
                call = calls.pop(event.stream_id, None)
                if call is not None:
                    call.closed = True
                    call.release_handler(f"reset by the client (error code {event.error_code})" if event.remote
                                         else f"stream error: {event.reason[:_REASON_LIMIT]}")
            elif isinstance(event, MessageRejected):
                call = calls.get(event.stream_id)
                if call is not None:
                    call.finish(event.grpc_status, event.reason)
            elif isinstance(event, ConnectionTerminated) and not event.remote:
                _log.warning("closing HTTP/2 connection from %s: %s", self.peer, event.reason[:_REASON_LIMIT])
        if conn.closed:
            self._close()

    # -- calls ------------------------------------------------------------------------------------

    def _open_call(self, stream_id: int, headers: list[tuple[bytes, bytes]]) -> None:
        call = self._calls[stream_id] = Call(self, stream_id)
        fields = dict(headers)
        method = self._server.methods.get(fields.get(b":path", b""))
        content_type = fields.get(b"content-type", b"")
        if fields.get(b":method") != b"POST" or not content_type.startswith(b"application/grpc"):
            call.finish(GrpcStatus.UNIMPLEMENTED, "pilotfish serves gRPC only (POST, content-type application/grpc)")
        elif method is None:
            path = fields.get(b":path", b"")[:_REASON_LIMIT].decode(errors="replace")
            call.finish(GrpcStatus.UNIMPLEMENTED, f"unknown method {path}")
        else:
            try:
                call.handler = method(call)
            except RpcError as exc:
                call.finish(exc.code, exc.message)

    def _on_remote_end(self, call: Call, incomplete_message: bool) -> None:
        if call.closed:
            return
        if incomplete_message:
            call.finish(GrpcStatus.INTERNAL, "the stream ended inside a message")
        elif call.handler is not None:
            call.handler.on_half_close()
            if not call.closed:
                call.finish()  # a handler that keeps nothing open after the client is done

    def forget(self, call: Call) -> None:
        """``call`` has ended on our side; the connection ends its stream."""
        if self._calls.get(call.id) is call:
            del self._calls[call.id]

    # -- sending --------------------------------------------------------------------------------

    def _output_ready(self) -> None:
        """The HTTP/2 connection has output: write it at the end of this turn of the event loop,
        with every other connection's (a loopback send costs ~15 us of CPU, most of a small
        response)."""
        if not self._dirty and self.transport is not None:
            self._dirty = True
            self._server.mark_dirty(self)

    def flush_out(self) -> None:
        self._dirty = False
        out = self.h2.take_output()
        if out and not self.transport.is_closing():
            self.transport.writelines(out)  # uvloop: one writev, no joined copy

    # -- ending ---------------------------------------------------------------------------------

    def _close(self) -> None:
        """The HTTP/2 connection is over (GOAWAY sent or received): write what is left, close
        (every call is cancelled in connection_lost)."""
        if not self.transport.is_closing():
            self.flush_out()
            self.transport.close()

    def shut_down(self, message: str) -> None:
        """Stop: every call ends UNAVAILABLE (so clients reconnect elsewhere or later), GOAWAY."""
        if self.transport.is_closing():
            return
        for call in list(self._calls.values()):
            call.release_handler(message)
            call.finish(GrpcStatus.UNAVAILABLE, message, abandon_pending=True)
        self.h2.close(ErrorCode.NO_ERROR, message)
        self.flush_out()
        self.transport.close()


class GrpcServer:
    """Listens on one address and serves the registered ``methods`` ({path: factory})."""

    def __init__(self, methods: Mapping[str, MethodFactory], *, limits: Limits | None = None,
                 connection_factory: Callable[..., Connection] = Connection) -> None:
        self.limits = limits or Limits()
        """What each connection lets a peer do (see :class:`~pilotfish.transport.h2.Limits`)."""
        self.connection_factory = connection_factory
        """Makes each connection's HTTP/2 core (keywords ``role``, ``limits``, ``on_output``): the own
        one; bench/h2_core_compare.py measures the `h2` package's state machine in its place."""
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
