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
once per turn of the event loop (batched, see :meth:`GrpcServer.mark_dirty`), and goes on reading a
peer that does not read (``pause_writing``), as nghttp2 and Envoy do, what it makes us owe then
bounded by the connection's limits. What gRPC adds: trailers-only responses for unknown methods,
UNIMPLEMENTED for compressed messages, graceful stop, TLS and mTLS (an ``ssl.SSLContext`` given to
:meth:`GrpcServer.start`; the peer's verified identity is :attr:`Call.peer_identity`, see
:mod:`pilotfish.transport.tls`). Not implemented: compression. TCP keepalive finds dead peers at no
Python cost.

Connections are bounded here (:class:`ConnectionLimits`), since each holds a descriptor and
memory before it has said a word. One over :attr:`~ConnectionLimits.max_connections` (all
peers) or :attr:`~ConnectionLimits.max_connections_per_address` (one source IP) is refused the
way Envoy refuses one over a listener's limit: accepted, then closed at once, before any HTTP/2
(or TLS) byte, with a reset so that the kernel keeps no TIME_WAIT state. To a gRPC client that
is a failed connection attempt: grpc-core and Envoy retry it with exponential backoff (measured
with grpcio: attempts at 0, 1.0, 2.3 and 5.3 s). A GOAWAY after our SETTINGS would not do:
grpc-core then reports the channel READY (a connection made), which resets its backoff, so a
refused client would come back at once. On plaintext, asyncio accepts (in C, on uvloop) and the
caps are checked in :meth:`_Connection.connection_made` (no HTTP/2 connection is made for a
refused one). With TLS, :meth:`GrpcServer._accept` accepts itself, checks the caps, and runs the
handshake on the event loop with OpenSSL on the socket (:mod:`pilotfish.transport.tlsio`, a
third of the memory per connection of asyncio's TLS): a refused client gets no handshake, one in
its handshake counts (bounded by :data:`TLS_HANDSHAKE_TIMEOUT`), and handshakes start in accept order.

A connection that has not completed its HTTP/2 preface (magic and SETTINGS)
:attr:`~ConnectionLimits.handshake_timeout` after it was accepted (after its TLS handshake, if
any) gets GOAWAY PROTOCOL_ERROR and is closed; one without streams
for :attr:`~ConnectionLimits.idle_timeout` gets GOAWAY NO_ERROR and is closed (Envoy's HTTP
``idle_timeout``; an xDS client keeps its ADS stream open, so it is never idle). Time-outs cost
no timer per connection: one periodic sweep (:meth:`GrpcServer._sweep`) pops expired handshake
deadlines from a queue in arrival order, and now and then looks at every connection for
idleness; the sans-IO connection has no clock for them.

A connection that ends (GOAWAY for a protocol error or a limit, for idleness, or the peer's own
GOAWAY with an error) stops being read and is closed once the peer has taken everything written
to it, the GOAWAY last: the kernel resets a socket closed with input unread, and that reset throws
away whatever of ours is still queued, so closing at once would lose the GOAWAY exactly when it
matters (a flooder whose earlier answers are still in flight). Whatever the peer does, the socket
is cut off :attr:`~ConnectionLimits.close_timeout` after the GOAWAY (a peer that does not read
cannot keep a closing connection, its descriptor and its output, alive). Envoy does the same
with ``delayed_close_timeout`` (1 s; it stops reading and closes once flushed or on the timer), Go's
net/http2 server with ``goAwayTimeout`` (1 s).

What a peer can make happen in a loop (refusals, time-outs, protocol errors) is logged through
:class:`RateLimitedLog`: a line per kind per :data:`WARN_EVERY` seconds at most, then how many
were left out, never a traceback.

Applications register *methods*: ``path -> factory(call) -> handler``. A handler is called back
synchronously: ``on_message(bytes)``, ``on_half_close()`` (the client has sent all it will),
``on_closed(reason)`` (the call is over, however it ended: exactly once). It answers through the
:class:`Call`: ``send(*parts)`` writes one message made of ``parts``, ``finish(code, message)``
ends the call with trailers.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import random
import resource
import socket
import ssl
import struct
import termios
import time
import weakref
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

from pilotfish.events import ReportGate
from pilotfish.transport import frames as h2
from pilotfish.transport.frames import ErrorCode, GrpcStatus
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
from pilotfish.transport.tls import peer_identity
from pilotfish.transport.tlsio import HandshakeSlots, TlsHandshake

__all__ = [
    "LISTEN_BACKLOG",
    "WARN_EVERY",
    "Call",
    "ConnectionLimits",
    "GrpcServer",
    "HTTP2Core",
    "Handler",
    "MethodFactory",
    "RateLimitedLog",
    "RpcError",
    "accept_waiting",
    "listening_sockets",
    "refuse",
    "reset",
    "source_address",
]

_log = logging.getLogger("pilotfish.server.grpc")

FLUSH_BATCH = 32
"""Connections with output that wait for one flush, at most (see :meth:`GrpcServer.mark_dirty`).
Measured at 1,000 proxies (p99 of an endpoint change): 8-32 ~210-230 ms, 128 ~265 ms, 512 ~255 ms."""
TLS_HANDSHAKE_TIMEOUT = 10.0  # seconds a TLS client gets to finish its handshake
LISTEN_BACKLOG = 65_535  # the kernel caps it at net.core.somaxconn; a reconnect storm needs it
ACCEPT_BATCH = 128  # connections accepted per readiness of a listening socket (then other work runs)
MAX_HANDSHAKES = 256
"""TLS handshakes in progress at most (counting those started within the last
:data:`HANDSHAKE_SLOT_HOLD` seconds). Past it the listener is not read until half of them are
done: the connections behind wait in the kernel's accept queue (their ClientHello with them), so
each handshake that starts finishes well within :data:`TLS_HANDSHAKE_TIMEOUT`, instead of ten
thousand of them crawling together past it (measured: 10,000 mTLS proxies connecting at once
on 2 cores, 370 handshakes timed out and were retried without this bound)."""
HANDSHAKE_SLOT_HOLD = 2.0
"""Seconds a handshake in progress counts against :data:`MAX_HANDSHAKES`: peers that stall in
their handshakes (a ClientHello, then nothing) cannot keep the listener unread for longer."""
ACCEPT_RETRY = 1.0  # seconds without accepting after the process ran out of descriptors (as asyncio)
KEEPALIVE_IDLE = (30, 45)
"""Seconds (least, most) a connection is idle before TCP keepalive probes it; each connection
draws its own. An idle peer that vanished (no FIN, no RST) is found within 60-75 s. Drawn, not
one value: a fleet that connected at once (a restart) would otherwise be probed at the same
instant, 10,000 probes in one burst, and the kernel drops what overflows its queues (measured:
on loopback, 1,334 of 10,000 idle connections lost all three probes of their aligned bursts
and were closed as dead)."""
_KEEPALIVE = ((socket.TCP_KEEPINTVL, 10), (socket.TCP_KEEPCNT, 3))

_RESPONSE_HEADERS = h2.header_block([(b":status", b"200"), (b"content-type", b"application/grpc")])
_REASON_LIMIT = 200
"""Characters of a peer-caused reason kept in a log line (a peer must not fill the log)."""
_AUTHORIZATION_LIMIT = 1024
"""Characters of a call's ``authorization`` metadata kept (a bearer token is far shorter; the
header block itself is bounded by the HTTP/2 limits)."""
_RESET_ON_CLOSE = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s: close() sends RST, keeps no TIME_WAIT

WARN_EVERY = 10.0
"""Seconds between two log lines of one kind about peers (see :class:`RateLimitedLog`)."""

DEFAULT_MAX_CONNECTIONS_PER_ADDRESS = 4096
"""Connections from one source address, unless half of the total cap is less (see
:attr:`ConnectionLimits.max_connections_per_address`)."""
_DESCRIPTOR_RESERVE = 128
"""Descriptors at least kept out of the xDS connection cap for the rest of the process."""
_UNLIMITED_DESCRIPTORS = 1 << 20  # what serve sets when the hard limit is infinite


class RateLimitedLog:
    """Log lines of one kind, at most one per ``every`` seconds: for what a peer can make happen
    in a loop (refused connections, protocol errors, refused streams), which must neither fill the
    log nor cost a formatted line each. The next line logged, or :meth:`flush` once the interval
    is over, says how many were left out."""

    __slots__ = ("_clock", "_every", "_gate", "_level", "_logger", "_what")

    def __init__(
        self,
        logger: logging.Logger,
        *,
        what: str,
        level: int = logging.WARNING,
        every: float = WARN_EVERY,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._logger = logger
        self._what = what
        """What a left-out line is about, in the plural ("such streams")."""
        self._level = level
        self._every = every
        self._clock = clock
        self._gate = ReportGate(every)

    def log(self, message: str, *args: object) -> bool:
        """Log ``message % args`` unless a line was logged less than ``every`` seconds ago
        (then only count it); True when it was logged."""
        left_out = self._gate.admit(self._clock())
        if left_out is None:
            return False
        if left_out:
            message += " (and %d more %s since the last one logged)"
            args += (left_out, self._what)
        self._logger.log(self._level, message, *args)
        return True

    def flush(self) -> None:
        """Say how many lines were left out, if any and the interval is over (so a flood that
        stopped is still counted in the log)."""
        now = self._clock()
        if self._gate.held and self._gate.ready(now):
            left_out = self._gate.admit(now)
            self._logger.log(self._level, "%d more %s not logged in the last %g s", left_out, self._what, self._every)


def descriptor_limit() -> int:
    """This process's open-file soft limit (RLIMIT_NOFILE), as ``serve`` left it."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return _UNLIMITED_DESCRIPTORS if soft == resource.RLIM_INFINITY else soft


@dataclass(frozen=True, slots=True, kw_only=True)
class ConnectionLimits:
    """How many connections the server holds, and how long one may hold a descriptor while
    doing nothing. Each default says which stack it follows; see the module docstring for what
    a refused or timed-out peer sees."""

    max_connections: int | None = None
    """Connections held at once, from all peers; the next is refused (accepted and closed at
    once, as Envoy does over a listener's ``max_connections`` or the overload manager's
    ``max_active_downstream_connections``). None: the open-file limit (RLIMIT_NOFILE, which
    ``serve`` raises to its hard limit) less a tenth of it, at least 128, kept for the rest of the
    process (event log, snapshot file, registry API, etcd, TLS files); with the usual 1,024 that
    is 896, with 1,048,576 it is 943,719. Envoy sets no default and tells operators to set one;
    grpc-core has none."""
    max_connections_per_address: int | None = None
    """Connections held at once from one source IP address; the next is refused the same way,
    so one host (or a flood from it) cannot take every connection while others get none.
    None: 4,096 (a fleet behind one NAT address, e.g. a cluster's egress, is served), or half of
    :attr:`max_connections` if that is less. Neither Envoy nor grpc-core has one (nginx's
    ``limit_conn`` is the usual tool); raise it for a larger fleet behind one address."""
    handshake_timeout: float = 10.0
    """Seconds a client gets, once accepted (and past its TLS handshake), to complete the HTTP/2
    preface (the magic and its SETTINGS); then GOAWAY PROTOCOL_ERROR and closed. Go's
    net/http2 server waits 10 s; grpc-core's handshake timeout is 120 s (too long to hold
    descriptors for silent connections); Envoy bounds the same with ``listener_filters_timeout``
    (15 s) and the HTTP ``idle_timeout``."""
    idle_timeout: float | None = 3600.0
    """Seconds a connection may have no open stream; then GOAWAY NO_ERROR and closed. Envoy's
    ``common_http_protocol_options.idle_timeout`` (1 hour); grpc-core's
    ``GRPC_ARG_MAX_CONNECTION_IDLE_MS`` does the same and is off by default. An xDS client
    keeps its ADS stream open, so only a connection that stopped asking for anything is closed.
    None: never. Checked every tenth of it (at most every minute), so it may take up to that much
    longer."""
    close_timeout: float = 0.5
    """Seconds a connection that has sent its last GOAWAY (a protocol error or a limit, idleness)
    may take to hand the peer what is left; then it is cut off, whether or not the peer read it.
    A peer that reads gets the GOAWAY at once and the socket closes as soon as it has; only a peer
    that does not read waits this long (a flooder, or one that stopped reading). Envoy's
    ``delayed_close_timeout`` (1 s) and Go's ``goAwayTimeout`` (1 s) bound the same; half of that
    here, so that such a socket is gone within a second of the GOAWAY even on a busy event loop."""

    def caps(self, descriptors: int) -> tuple[int, int]:
        """(total, per address) with the defaults resolved for a process that may open
        ``descriptors`` files."""
        total = self.max_connections
        if total is None:
            total = max(descriptors // 2, descriptors - max(_DESCRIPTOR_RESERVE, descriptors // 10), 1)
        per_address = self.max_connections_per_address
        if per_address is None:
            per_address = max(1, min(DEFAULT_MAX_CONNECTIONS_PER_ADDRESS, total // 2))
        return total, per_address


def listening_sockets(host: str, port: int) -> list[socket.socket]:
    """Bound, listening, non-blocking sockets for ``host:port`` (every address of ``host``; all
    interfaces when it is empty), as ``loop.create_server`` makes them."""
    infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    sockets: list[socket.socket] = []
    try:
        for family, kind, proto, _, address in dict.fromkeys(infos):
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)  # the IPv4 socket takes IPv4
            try:
                sock.bind(address)
            except OSError as exc:
                raise OSError(
                    exc.errno,
                    f"error while attempting to bind on address {address!r}: "
                    f"{exc.strerror.lower() if exc.strerror else exc}",
                ) from None
            sock.listen(LISTEN_BACKLOG)
            sock.setblocking(False)
    except BaseException:
        for sock in sockets:
            sock.close()
        raise
    return sockets


def _keep_alive(sock: socket.socket) -> None:
    """TCP keepalive on an accepted socket: a peer that vanished is found at no Python cost
    (probed after an idle time of its own, :data:`KEEPALIVE_IDLE`)."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, random.randint(*KEEPALIVE_IDLE))
    for option, value in _KEEPALIVE:
        sock.setsockopt(socket.IPPROTO_TCP, option, value)


CLOSE_POLL = 0.01
"""Seconds between two looks at whether the peer has taken what a closing connection wrote."""


def _unsent(transport: asyncio.BaseTransport) -> int:
    """Bytes written to ``transport``'s socket that the peer has not acknowledged yet (the kernel's
    send queue, SIOCOUTQ on Linux); 0 where the kernel does not say."""
    sock = transport.get_extra_info("socket")
    if sock is None:
        return 0
    try:
        queued: int = struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0"))[0]
    except (OSError, ValueError, AttributeError):
        return 0
    return queued


def accept_waiting(
    listener: socket.socket,
    take: Callable[[socket.socket, str], None],
    *,
    log: RateLimitedLog,
    what: str,
    listen_again: Callable[[socket.socket], None],
    batch: int = ACCEPT_BATCH,
) -> None:
    """Accept what waits on a listening socket, ``batch`` at most (then other work runs), giving
    each socket and its source address to ``take``. Out of descriptors (EMFILE,
    ENFILE) or memory: stop reading the listener for :data:`ACCEPT_RETRY` seconds, as asyncio
    does, then ``listen_again(listener)``; ``what`` names the listener in the log line."""
    loop = asyncio.get_running_loop()
    for _ in range(batch):
        try:
            sock, peer = listener.accept()
        except (BlockingIOError, InterruptedError, ConnectionAbortedError):
            return
        except OSError as exc:
            log.log("%s: cannot accept connections (%s): accepting again in %g s", what, exc, ACCEPT_RETRY)
            loop.remove_reader(listener)
            loop.call_later(ACCEPT_RETRY, listen_again, listener)
            return
        take(sock, source_address(peer))


def refuse(sock: socket.socket) -> None:
    """Close an accepted socket with a reset, before any byte: a failed connection attempt to
    the client, and no TIME_WAIT state kept here."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _RESET_ON_CLOSE)
    sock.close()


def reset(transport: asyncio.Transport) -> None:
    """Close a connection asyncio accepted with a reset, before any byte (as :func:`refuse`)."""
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _RESET_ON_CLOSE)
    transport.abort()


def source_address(peer: object) -> str:
    """The IP address a connection comes from (an IPv4 address mapped into IPv6 as itself)."""
    if isinstance(peer, tuple) and peer:
        host = str(peer[0])
        return host[7:] if host.startswith("::ffff:") and "." in host else host
    return ""


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


class HTTP2Core(Protocol):
    """What this adapter drives of a connection's sans-IO HTTP/2 core: the own
    :class:`~pilotfish.transport.h2.Connection`, or another state machine under the same adapter
    (bench/h2_package_core.py puts the `h2` package's there, to compare the two)."""

    writing_paused: bool
    """The socket is full: queue, do not write (see :meth:`resume_writing`)."""

    @property
    def closed(self) -> bool:
        """We have ended the connection (GOAWAY sent) or its socket is gone."""

    @property
    def terminated(self) -> ConnectionTerminated | None:
        """Why we ended it, once we have."""

    @property
    def preface_received(self) -> bool:
        """The peer's preface (magic and first SETTINGS) has arrived."""

    @property
    def open_streams(self) -> int: ...
    @property
    def last_peer_stream(self) -> int: ...
    def receive(self, data: bytes) -> list[Event]: ...
    def take_output(self) -> list[bytes | bytearray | memoryview]: ...
    def acknowledge(self, stream_id: int, size: int) -> None: ...
    def send_header_block(
        self, stream_id: int, block: bytes, *, end_stream: bool = False, abandon_pending: bool = False
    ) -> None: ...
    def send_message(self, stream_id: int, *parts: bytes) -> None: ...
    def close(self, code: int = ..., reason: str = "") -> None: ...
    def resume_writing(self) -> None: ...
    def discard(self) -> None: ...


class Call:
    """One gRPC call: one HTTP/2 stream of a connection."""

    __slots__ = ("_conn", "_h2", "_headers_sent", "authorization", "closed", "handler", "id")

    def __init__(self, conn: _Connection, stream_id: int) -> None:
        self._conn = conn
        self._h2 = conn.h2
        self.id = stream_id
        self.handler: Handler | None = None
        self.closed = False
        """We have ended the call (trailers queued) or it was reset."""
        self._headers_sent = False
        self.authorization: str | None = None
        """The call's ``authorization`` metadata (a bearer token), for services that check one."""

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

    __slots__ = (
        "__weakref__",
        "_calls",
        "_closer",
        "_dirty",
        "_reading",
        "_server",
        "address",
        "goaway_at",
        "h2",
        "identity",
        "idle_mark",
        "idle_since",
        "peer",
        "transport",
    )  # one per proxy: no __dict__

    def __init__(self, server: GrpcServer, address: str = "") -> None:
        self._server = server
        self.transport: asyncio.Transport = None  # type: ignore[assignment]  # set in connection_made
        self._dirty = False
        self._reading = True
        self.h2: HTTP2Core = None  # type: ignore[assignment]  # made in connection_made, if admitted
        self.peer = ""
        self.address = address
        """The source IP address: what :attr:`ConnectionLimits.max_connections_per_address` counts."""
        self.identity = ""
        """The client's identity from its verified certificate (mTLS), else ``""``."""
        self._calls: dict[int, Call] = {}
        self.idle_since = 0.0
        """When the connection was last seen without streams (event-loop time); -1: it has some."""
        self.idle_mark = 0
        """:attr:`Connection.last_peer_stream` when :attr:`idle_since` was taken."""
        self.goaway_at = -1.0
        """When we began closing it (GOAWAY for idleness or a protocol error); -1: not yet."""
        self._closer: asyncio.TimerHandle | None = None
        """While closing: the next look at whether the peer has taken what is left (see :meth:`_close`)."""

    # -- asyncio.Protocol -------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        """HTTP/2 starts: on a plaintext listener once the caps admit it (refused: reset at once);
        on a TLS one, admitted at accept (:meth:`GrpcServer._accept`), after the handshake."""
        self.transport = transport  # type: ignore[assignment]  # a stream transport (uvloop's is no subclass)
        peer = transport.get_extra_info("peername")
        server = self._server
        if not self.address:  # plaintext: asyncio accepted it
            self.address = source_address(peer)
            sock = transport.get_extra_info("socket")
            refusal = server.admit(self)
            if refusal:  # closed before any HTTP/2 byte: a failed connection attempt to the client
                server.refused_log.log("refused a connection from %s: %s", self.address, refusal)
                reset(self.transport)
                return
            if sock is not None:
                with contextlib.suppress(OSError):
                    _keep_alive(sock)
        if isinstance(peer, tuple):
            family = "ipv6" if ":" in peer[0] else "ipv4"
            self.peer = f"{family}:{peer[0]}:{peer[1]}"
        self.identity = peer_identity(transport.get_extra_info("peercert"))
        self.h2 = server.connection_factory(role=Role.SERVER, limits=server.limits, on_output=self._output_ready)
        self.idle_since = server.now()
        server.await_preface(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self._server.release(self)
        if self._closer is not None:
            self._closer.cancel()
            self._closer = None
        if self.h2 is not None:
            self.h2.discard()
        reason = "connection lost" if exc is None else f"connection lost: {exc}"
        calls, self._calls = self._calls, {}
        for call in calls.values():
            call.closed = True
            call.release_handler(reason)

    def pause_writing(self) -> None:
        # Still read (as nghttp2 and Envoy): what a peer that does not read makes us owe is
        # bounded by the HTTP/2 connection's limits, which it could not trip if it were not read.
        self.h2.writing_paused = True

    def resume_writing(self) -> None:
        self.h2.resume_writing()

    def _stop_reading(self) -> None:
        if not self._reading or self.transport.is_closing():
            return
        self._reading = False
        with contextlib.suppress(RuntimeError, NotImplementedError):
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
                    call.release_handler(
                        f"reset by the client (error code {event.error_code})"
                        if event.remote
                        else f"stream error: {event.reason[:_REASON_LIMIT]}"
                    )
            elif isinstance(event, MessageRejected):
                call = calls.get(event.stream_id)
                if call is not None:
                    call.finish(event.grpc_status, event.reason)
            elif isinstance(event, ConnectionTerminated) and not event.remote:
                self._server.error_log.log(
                    "closing HTTP/2 connection from %s: %s", self.peer, event.reason[:_REASON_LIMIT]
                )
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
            authorization = fields.get(b"authorization")
            if authorization is not None:
                call.authorization = authorization[:_AUTHORIZATION_LIMIT].decode(errors="replace")
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
        h2 = self.h2
        out = h2.take_output()
        if out and not self.transport.is_closing():
            self.transport.writelines(out)  # uvloop: one writev, no joined copy
        if h2.closed and self.goaway_at < 0:  # ended by what we sent (a limit), not by a read
            if h2.terminated is not None:
                self._server.error_log.log(
                    "closing HTTP/2 connection from %s: %s", self.peer, h2.terminated.reason[:_REASON_LIMIT]
                )
            self._close()

    # -- ending ---------------------------------------------------------------------------------

    def _close(self) -> None:
        """The HTTP/2 connection is over (GOAWAY sent or received): write what is left and stop
        reading; close once the peer has taken all of it, or cut it off
        :attr:`ConnectionLimits.close_timeout` after the GOAWAY (see the module docstring). Every
        call is cancelled in connection_lost."""
        if self.goaway_at >= 0 or self.transport.is_closing():
            return
        self.goaway_at = self._server.now()
        self.flush_out()
        self._stop_reading()
        self._check_closing()

    def _check_closing(self) -> None:
        """One look at a closing connection: closed once nothing of ours is left unacknowledged
        (neither in the transport's buffer nor in the kernel's), cut off at its deadline."""
        self._closer = None
        transport, server = self.transport, self._server
        now = server.now()
        deadline = self.goaway_at + server.connection_limits.close_timeout
        if now >= deadline:
            transport.abort()  # the peer did not take what was left: its loss
            return
        if not transport.is_closing() and not transport.get_write_buffer_size() and not _unsent(transport):
            transport.close()  # the peer has the GOAWAY: whatever it sent since is not read
        loop = asyncio.get_running_loop()
        # Closed (TLS may still say goodbye): at the deadline; else look again soon.
        self._closer = (
            loop.call_at(deadline, self._check_closing)
            if transport.is_closing()
            else loop.call_later(CLOSE_POLL, self._check_closing)
        )

    def end_handshake_timed_out(self, timeout: float) -> None:
        """No HTTP/2 preface within ``timeout``: GOAWAY PROTOCOL_ERROR and the descriptor is
        released at once (what the kernel holds of the GOAWAY still goes out, then FIN)."""
        if self.transport.is_closing() or self.h2.preface_received:
            return
        self._server.timeout_log.log(
            "closed a connection from %s: no HTTP/2 connection preface within %g s "
            "(ConnectionLimits.handshake_timeout)",
            self.peer,
            timeout,
        )
        self.h2.close(ErrorCode.PROTOCOL_ERROR, f"no HTTP/2 connection preface within {timeout:g} s")
        self.flush_out()
        self.transport.abort()

    def check_idle(self, now: float, timeout: float | None) -> None:
        """One look of the idle sweep. A connection without streams since the last look (and
        none opened in between) for ``timeout`` gets GOAWAY NO_ERROR and is closed (the GOAWAY
        written first: the client knows no stream was lost, and reconnects when it needs one)."""
        transport, h2 = self.transport, self.h2
        if h2 is None:
            return  # in its TLS handshake (bounded by TLS_HANDSHAKE_TIMEOUT)
        if self.goaway_at >= 0 or transport.is_closing() or not h2.preface_received:
            return  # closing already (on its own deadline), or the handshake deadline's
        if h2.open_streams:
            self.idle_since = -1.0
            return
        mark = h2.last_peer_stream
        if self.idle_since < 0 or mark != self.idle_mark:
            self.idle_since, self.idle_mark = now, mark
            return
        if timeout is None or now - self.idle_since < timeout:
            return
        self._server.idle_log.log(
            "closed a connection from %s: no streams for %g s (ConnectionLimits.idle_timeout)", self.peer, timeout
        )
        h2.close(ErrorCode.NO_ERROR, f"idle: no streams for {timeout:g} s")
        self._close()

    def shut_down(self, message: str) -> None:
        """Stop: every call ends UNAVAILABLE (so clients reconnect elsewhere or later), GOAWAY."""
        if self.transport is None or self.transport.is_closing():
            return  # (in its TLS handshake: its task is cancelled)
        for call in list(self._calls.values()):
            call.release_handler(message)
            call.finish(GrpcStatus.UNAVAILABLE, message, abandon_pending=True)
        self.h2.close(ErrorCode.NO_ERROR, message)
        self.flush_out()
        self.transport.close()


class GrpcServer:
    """Listens on one address and serves the registered ``methods`` ({path: factory})."""

    def __init__(
        self,
        methods: Mapping[str, MethodFactory],
        *,
        limits: Limits | None = None,
        connection_limits: ConnectionLimits | None = None,
        connection_factory: Callable[..., HTTP2Core] = Connection,
    ) -> None:
        self.limits = limits or Limits()
        """What each connection lets a peer do (see :class:`~pilotfish.transport.h2.Limits`)."""
        self.connection_factory = connection_factory
        """Makes each connection's HTTP/2 core (keywords ``role``, ``limits``, ``on_output``): the own
        one; bench/h2_core_compare.py measures the `h2` package's state machine in its place."""
        self.connection_limits = connection_limits or ConnectionLimits()
        self.max_connections, self.max_connections_per_address = self.connection_limits.caps(descriptor_limit())
        """The caps in force (:meth:`ConnectionLimits.caps` of this process's open-file limit)."""
        self.methods: dict[bytes, MethodFactory] = {path.encode(): f for path, f in methods.items()}
        self.connections: set[_Connection] = set()
        self._per_address: dict[str, int] = {}
        self._handshakes: deque[tuple[float, weakref.ref[_Connection]]] = deque()
        """(deadline, connection) of connections admitted, in order: their preface deadlines. Weak:
        a connection that came and went is not kept for the rest of its deadline (a flood of
        short connections would be)."""
        self._server: asyncio.Server | None = None
        self._listeners: list[socket.socket] = []
        self._handshaking: set[TlsHandshake] = set()
        """Accepted TLS connections in their handshakes."""
        self._slots = HandshakeSlots(HANDSHAKE_SLOT_HOLD)
        self._accept_paused = False
        """:data:`MAX_HANDSHAKES` are in progress: the listeners are not read."""
        self._resume_check: asyncio.TimerHandle | None = None
        """While paused: the next look at whether slots were given up by age."""
        self.tls: ssl.SSLContext | None = None
        self._dirty: list[_Connection] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._sweeper: asyncio.TimerHandle | None = None
        idle = self.connection_limits.idle_timeout
        self._idle_every = min(idle / 10, 60.0) if idle else 60.0
        """Seconds between two looks at every connection for idleness."""
        self._next_idle_look = 0.0
        self._tick = min(max(min(self.connection_limits.handshake_timeout, self._idle_every) / 10, 0.01), 1.0)
        """Seconds between two sweeps: a tenth of the handshake timeout or of the idle look
        interval, whichever is less, from 10 ms to 1 s."""
        self.refused_log = RateLimitedLog(_log, what="refused connections")
        self.timeout_log = RateLimitedLog(_log, what="connections without a preface")
        self.error_log = RateLimitedLog(_log, what="connections closed for protocol errors")
        self.idle_log = RateLimitedLog(_log, what="idle connections closed", level=logging.INFO)
        self.tls_log = RateLimitedLog(_log, what="failed TLS handshakes", level=logging.INFO)

    def now(self) -> float:
        return (self._loop or asyncio.get_running_loop()).time()

    # -- connections ------------------------------------------------------------------------------

    def _accept(self, listener: socket.socket) -> None:
        """A TLS listening socket is readable: accept what waits (a batch, and no more than
        :data:`MAX_HANDSHAKES` in their handshakes), refuse what is over a cap (closed with a
        reset, nothing else made for it), start the others' handshakes."""
        room = min(ACCEPT_BATCH, MAX_HANDSHAKES - self._slots.in_use(self.now()))
        if room > 0:
            accept_waiting(
                listener, self._take, log=self.refused_log, what="xDS", listen_again=self._listen_again, batch=room
            )
        if not self._accept_paused and self._slots.in_use(self.now()) >= MAX_HANDSHAKES:
            self._accept_paused = True
            loop = self._loop or asyncio.get_running_loop()
            for waiting in self._listeners:
                loop.remove_reader(waiting)
            self._maybe_resume()

    def _handshake_ended(self, handshake: TlsHandshake) -> None:
        self._handshaking.discard(handshake)
        self._slots.release(handshake)
        if self._accept_paused:
            self._maybe_resume()

    def _resume_tick(self) -> None:
        self._resume_check = None
        self._maybe_resume()

    def _maybe_resume(self) -> None:
        """While paused: read the listeners again once half the slots are free (handshakes
        ended, or held too long); else look again in a while."""
        if not self._accept_paused:
            return
        if self._slots.in_use(self.now()) > MAX_HANDSHAKES // 2:
            if self._resume_check is None:
                loop = self._loop or asyncio.get_running_loop()
                self._resume_check = loop.call_later(self._slots.hold / 4, self._resume_tick)
            return
        self._accept_paused = False
        if self._resume_check is not None:
            self._resume_check.cancel()
            self._resume_check = None
        for listener in self._listeners:  # (none once stopping)
            self._listen_again(listener)

    def _take(self, sock: socket.socket, address: str) -> None:
        conn = _Connection(self, address)
        refusal = self.admit(conn)
        if refusal:  # a failed connection attempt to the client (it backs off), and no TLS handshake
            self.refused_log.log("refused a connection from %s: %s", conn.address, refusal)
            refuse(sock)
            return
        loop = self._loop or asyncio.get_running_loop()
        try:
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            _keep_alive(sock)
            tls = self.tls
            assert tls is not None  # only a TLS listener accepts here
            wrapped = tls.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
        except (OSError, ValueError) as exc:  # the peer is gone already
            self.release(conn)
            sock.close()
            self.tls_log.log("TLS connection from %s failed: %s", conn.address, str(exc)[:_REASON_LIMIT])
            return
        handshake = TlsHandshake(
            loop,
            wrapped,
            conn,
            timeout=TLS_HANDSHAKE_TIMEOUT,
            on_failed=lambda reason: self._handshake_failed(conn, reason),
            on_end=self._handshake_ended,
        )
        self._handshaking.add(handshake)
        self._slots.take(handshake, self.now())
        handshake.step()  # its ClientHello is most likely here already: in accept order

    def _listen_again(self, listener: socket.socket) -> None:
        if listener in self._listeners and listener.fileno() >= 0:
            (self._loop or asyncio.get_running_loop()).add_reader(listener, self._accept, listener)

    def _handshake_failed(self, conn: _Connection, reason: str) -> None:
        """A failed TLS handshake is the peer's doing: logged (rate limited) and counted out."""
        self.tls_log.log("TLS handshake with %s failed: %s", conn.address, reason[:_REASON_LIMIT])
        self.release(conn)

    def admit(self, conn: _Connection) -> str:
        """Count ``conn`` in, or say why it is refused (``""``: admitted)."""
        if len(self.connections) >= self.max_connections:
            return (
                f"{len(self.connections)} connections are open, the limit "
                f"(--max-connections / ConnectionLimits.max_connections)"
            )
        count = self._per_address.get(conn.address, 0)
        if count >= self.max_connections_per_address:
            return (
                f"{count} connections from this address are open, the limit "
                f"(--max-connections-per-address / ConnectionLimits.max_connections_per_address)"
            )
        self._per_address[conn.address] = count + 1
        self.connections.add(conn)
        return ""

    def await_preface(self, conn: _Connection) -> None:
        """``conn`` has started HTTP/2: its preface is due within the handshake timeout."""
        self._handshakes.append((self.now() + self.connection_limits.handshake_timeout, weakref.ref(conn)))

    def release(self, conn: _Connection) -> bool:
        """Count ``conn`` out when it is gone; False if it was already."""
        if conn not in self.connections:
            return False
        self.connections.discard(conn)
        count = self._per_address.get(conn.address, 0) - 1
        if count > 0:
            self._per_address[conn.address] = count
        else:
            self._per_address.pop(conn.address, None)
        return True

    def _sweep(self) -> None:
        """Close connections past their handshake deadline (a queue in deadline order: a look at
        its head), and every :attr:`_idle_every` seconds, idle ones; say what was left out of
        the log. Again every :attr:`_tick` seconds."""
        loop = self._loop or asyncio.get_running_loop()
        self._sweeper = loop.call_later(self._tick, self._sweep)  # first: nothing below may end the sweeps
        now = loop.time()
        handshakes = self._handshakes
        timeout = self.connection_limits.handshake_timeout
        while handshakes and handshakes[0][0] <= now:
            conn = handshakes.popleft()[1]()
            if conn is not None and conn in self.connections:
                conn.end_handshake_timed_out(timeout)
        if now >= self._next_idle_look:
            self._next_idle_look = now + self._idle_every
            idle = self.connection_limits.idle_timeout
            for conn in list(self.connections):
                conn.check_idle(now, idle)
        for log in (self.refused_log, self.timeout_log, self.error_log, self.idle_log, self.tls_log):
            log.flush()

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
        self.tls = tls
        if tls is None:  # asyncio's accept (in C on uvloop); the caps are checked in connection_made
            self._server = await loop.create_server(
                lambda: _Connection(self), host or None, port, backlog=LISTEN_BACKLOG, reuse_address=True
            )
            bound: int = self._server.sockets[0].getsockname()[1]
        else:  # our accept: the caps are checked before the TLS handshake
            self._listeners = await loop.run_in_executor(None, listening_sockets, host, port)
            for listener in self._listeners:
                loop.add_reader(listener, self._accept, listener)
            bound = self._listeners[0].getsockname()[1]
        self._next_idle_look = loop.time() + self._idle_every
        self._sweeper = loop.call_later(self._tick, self._sweep)
        return bound

    async def stop(self, grace: float | None = None) -> None:
        """Stop listening, end every call with UNAVAILABLE and close the connections, waiting up
        to ``grace`` seconds for the peers to take what was written."""
        if self._server is None and not self._listeners:
            return
        loop = asyncio.get_running_loop()
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        listeners, self._listeners = self._listeners, []
        if self._server is not None:
            self._server.close()
        for listener in listeners:
            loop.remove_reader(listener)
            listener.close()
        if self._resume_check is not None:
            self._resume_check.cancel()
            self._resume_check = None
        for handshake in list(self._handshaking):
            handshake.cancel()
        for conn in list(self.connections):
            if conn.h2 is None:  # was in its TLS handshake
                self.release(conn)
        for conn in list(self.connections):
            conn.shut_down("pilotfish is shutting down")
        deadline = asyncio.get_running_loop().time() + (grace or 0.0)
        while self.connections and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.01)
        for conn in list(self.connections):
            if conn.transport is not None:
                conn.transport.abort()
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), timeout=1.0)
            self._server = None
