"""TLS on the xDS port without asyncio's TLS: OpenSSL reads and writes the socket itself.

Why: asyncio and uvloop run TLS as an ``ssl.SSLObject`` between two memory BIOs, and uvloop gives
every connection a read buffer of 256 KiB whose pages stay resident once records have touched
them. Measured here (2,000 idle connections that had exchanged a few KB, OpenSSL 3.0): 47 KB per
connection that way, 17 KB with a non-blocking :class:`ssl.SSLSocket`, whose record buffers
OpenSSL frees while the connection is idle (CPython sets ``SSL_MODE_RELEASE_BUFFERS``). At 10,000
proxies that is 300 MB. Decrypted bytes are read into one buffer shared by every connection (a
read begins and ends inside one callback of the event loop, so no two connections use it at once)
and handed to the protocol as one ``bytes`` per readable event, as asyncio does.

:class:`TlsHandshake` runs a server handshake on the event loop, step by step as the socket
becomes readable or writable, and bounded in time; when it completes, the protocol gets a
:class:`TlsTransport`: the part of asyncio's transport interface the gRPC server uses
(``writelines``, ``close``, ``abort``, ``pause_reading``, write-buffer size and the
``pause_writing`` / ``resume_writing`` calls at :data:`HIGH_WATER` / :data:`LOW_WATER`,
``get_extra_info``). Handshakes start when their connection is accepted, in accept order, so a
storm of thousands of handshakes completes first-come first-served instead of all of them slowly
at once (each client's own connect timeout keeps running meanwhile).

Writes: OpenSSL requires that a write it could not finish (``SSL_ERROR_WANT_WRITE``) be retried with
the same bytes, so the object being written is kept until it is through; what is written meanwhile
waits behind it and is joined into one write (one TLS record per 16 KiB, not one per piece).
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections import deque
from collections.abc import Callable, Hashable
from typing import Any

__all__ = ["HIGH_WATER", "LOW_WATER", "HandshakeSlots", "TlsHandshake", "TlsTransport"]

HIGH_WATER = 64 * 1024
"""Bytes waiting to be written above which the protocol is told to pause writing (asyncio's default)."""
LOW_WATER = 16 * 1024
"""...and below which it is told to resume."""

_RECORD = 16 * 1024
"""The largest TLS record's plaintext (RFC 8446, 5.1): one read returns at most this much."""
_BUFFER = bytearray(16 * _RECORD)
"""Where every connection's decrypted bytes are read to, then copied out (see the module docstring)."""
_VIEW = memoryview(_BUFFER)
_READ_LIMIT = len(_BUFFER) - _RECORD
"""A readable event reads records until less than this room is left (256 KiB less one record);
what is left is read on the next one, after other connections had their turn."""

_NONE, _READER, _WRITER = 0, 1, 2


class TlsTransport:
    """A TLS connection after its handshake, as an asyncio-style transport for ``protocol``."""

    __slots__ = (
        "_closing",
        "_fd",
        "_loop",
        "_lost",
        "_out",
        "_out_size",
        "_paused",
        "_peername",
        "_protocol",
        "_reading",
        "_sock",
        "_wants_write",
        "_writing",
        "_written",
    )  # one per TLS proxy: no __dict__

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        sock: ssl.SSLSocket,
        protocol: asyncio.Protocol,
        *,
        registered: bool = False,
    ) -> None:
        """``registered``: the socket is registered for reading already (by the handshake), so
        an end before :meth:`start` unregisters it."""
        self._loop = loop
        self._sock = sock
        self._fd = sock.fileno()
        self._protocol = protocol
        self._peername: Any = None
        with contextlib.suppress(OSError):
            self._peername = sock.getpeername()
        self._written: bytes | None = None
        """The bytes OpenSSL could not finish writing: retried as they are."""
        self._out: list[bytes] = []
        """What was written after them, joined into the next write."""
        self._out_size = 0
        self._writing = False
        """A writer callback is registered (output is waiting for the socket)."""
        self._reading = registered
        self._wants_write = False
        """A read needs the socket to be writable first (OpenSSL's WANT_WRITE while reading)."""
        self._paused = False
        """The protocol was told to pause writing."""
        self._closing = False
        self._lost = False

    # -- asyncio's transport interface (the part the gRPC server uses) ---------------------------

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        if name == "peername":
            return self._peername
        if name in ("socket", "ssl_object"):
            return self._sock
        if name == "peercert":
            with contextlib.suppress(ValueError, OSError):
                return self._sock.getpeercert()
            return default
        return default

    def is_closing(self) -> bool:
        return self._closing

    def pause_reading(self) -> None:
        if self._reading:
            self._reading = False
            self._loop.remove_reader(self._fd)

    def resume_reading(self) -> None:
        if not self._reading and not self._closing:
            self._reading = True
            self._loop.add_reader(self._fd, self._on_readable)
            if self._sock.pending():  # decrypted bytes OpenSSL holds make the socket no more readable
                self._loop.call_soon(self._on_readable)

    def get_write_buffer_size(self) -> int:
        return self._out_size + (len(self._written) if self._written is not None else 0)

    def write(self, data: bytes) -> None:
        self.writelines((data,))

    def writelines(self, chunks: Any) -> None:
        if self._closing:
            return
        if self._written is None and not self._writing:
            data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
            if data:
                self._send(data)
            return
        for chunk in chunks:
            self._out.append(chunk)
            self._out_size += len(chunk)
        self._check_high_water()

    def close(self) -> None:
        """Stop reading; once what was written is out, say goodbye (TLS close_notify) and close."""
        if self._closing:
            return
        self._closing = True
        self.pause_reading()
        if self._written is None and not self._out:
            self._finish(None, polite=True)

    def abort(self) -> None:
        """Close at once: what was not written is dropped."""
        self._finish(None, polite=False)

    # -- reading --------------------------------------------------------------------------------

    def start(self) -> None:
        """The handshake is done and the protocol knows this transport: read. The socket may be
        registered for reading already (for the handshake): its callback is replaced, not
        removed and added again (which costs the poller two changes per connection)."""
        if self._closing:
            return  # ended in connection_made (which unregistered the socket)
        self._reading = True
        self._loop.add_reader(self._fd, self._on_readable)
        if self._sock.pending():
            self._loop.call_soon(self._on_readable)

    def _on_readable(self) -> None:
        if self._closing:
            return
        sock, view, got = self._sock, _VIEW, 0
        error: Exception | None = None
        eof = False
        try:
            while got < _READ_LIMIT:
                n = sock.recv_into(view[got:])
                if n == 0:
                    eof = True
                    break
                got += n
        except ssl.SSLWantReadError:
            pass
        except ssl.SSLWantWriteError:
            self._wants_write = True
            self._want_writable()
        except ssl.SSLZeroReturnError:
            eof = True
        except (ssl.SSLError, OSError) as exc:
            error = exc
        if got:
            self._protocol.data_received(bytes(view[:got]))
        if error is not None:
            self._finish(error, polite=False)
        elif eof:
            self._finish(None, polite=False)
        elif got >= _READ_LIMIT and sock.pending() and not self._closing:
            self._loop.call_soon(self._on_readable)

    # -- writing --------------------------------------------------------------------------------

    def _send(self, data: bytes) -> None:
        """Write ``data`` (nothing else waits); what cannot be written now waits for the socket."""
        try:
            self._sock.send(data)
        except (ssl.SSLWantWriteError, ssl.SSLWantReadError):
            self._written = data
            self._want_writable()
            self._check_high_water()
        except (ssl.SSLError, OSError) as exc:
            self._finish(exc, polite=False)

    def _want_writable(self) -> None:
        if not self._writing:
            self._writing = True
            self._loop.add_writer(self._fd, self._on_writable)

    def _on_writable(self) -> None:
        if self._lost:
            return
        if self._wants_write:
            self._wants_write = False
            self._on_readable()
            if self._lost:
                return
        sock = self._sock
        while True:
            if self._written is None:
                if not self._out:
                    break
                out, self._out, self._out_size = self._out, [], 0
                self._written = out[0] if len(out) == 1 else b"".join(out)
            try:
                sock.send(self._written)
            except (ssl.SSLWantWriteError, ssl.SSLWantReadError):
                return
            except (ssl.SSLError, OSError) as exc:
                self._finish(exc, polite=False)
                return
            self._written = None
        self._writing = False
        self._loop.remove_writer(self._fd)
        if self._paused:
            self._paused = False
            self._protocol.resume_writing()
        if self._closing:
            self._finish(None, polite=True)

    def _check_high_water(self) -> None:
        if not self._paused and self.get_write_buffer_size() > HIGH_WATER:
            self._paused = True
            self._protocol.pause_writing()
        elif self._paused and self.get_write_buffer_size() <= LOW_WATER:
            self._paused = False
            self._protocol.resume_writing()

    # -- ending ---------------------------------------------------------------------------------

    def _finish(self, exc: Exception | None, *, polite: bool) -> None:
        """Close the socket (after TLS close_notify when ``polite``) and tell the protocol, once,
        on the next turn of the loop as asyncio does."""
        if self._lost:
            return
        self._lost = self._closing = True
        loop, fd = self._loop, self._fd
        if self._reading:
            self._reading = False
            loop.remove_reader(fd)
        if self._writing:
            self._writing = False
            loop.remove_writer(fd)
        self._written, self._out, self._out_size = None, [], 0
        if polite:
            with contextlib.suppress(ssl.SSLError, OSError, ValueError):
                self._sock.unwrap()  # sends close_notify; does not wait for the peer's
        self._sock.close()
        loop.call_soon(self._protocol.connection_lost, exc)


class TlsHandshake:
    """A server TLS handshake on ``sock`` (wrapped, not yet shaken), driven by the event loop.

    On success ``protocol.connection_made`` gets a :class:`TlsTransport`; on failure (the peer's
    error, or not done within ``timeout`` seconds) the socket is closed and ``on_failed(reason)``
    is called. ``on_end(self)`` is called either way, first.
    """

    __slots__ = ("_armed", "_fd", "_loop", "_on_end", "_on_failed", "_protocol", "_sock", "_timer")

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        sock: ssl.SSLSocket,
        protocol: asyncio.Protocol,
        *,
        timeout: float,
        on_failed: Callable[[str], None],
        on_end: Callable[[TlsHandshake], None],
    ) -> None:
        self._loop = loop
        self._sock = sock
        self._fd = sock.fileno()
        self._protocol = protocol
        self._on_failed = on_failed
        self._on_end = on_end
        self._armed = _NONE
        self._timer: asyncio.TimerHandle | None = loop.call_later(timeout, self._expire, timeout)

    def step(self) -> None:
        """Go as far as the peer's bytes allow; then wait for the socket, or end."""
        if self._timer is None:
            return
        try:
            self._sock.do_handshake()
        except ssl.SSLWantReadError:
            self._arm(_READER)
            return
        except ssl.SSLWantWriteError:
            self._arm(_WRITER)
            return
        except (ssl.SSLError, OSError, ValueError) as exc:
            self._fail(str(exc) or type(exc).__name__)
            return
        reading = self._armed == _READER
        if not reading:
            self._disarm()
        self._armed = _NONE  # a reader stays registered: the transport takes it over
        self._end()
        transport = TlsTransport(self._loop, self._sock, self._protocol, registered=reading)
        self._protocol.connection_made(transport)  # type: ignore[arg-type]  # the interface it uses
        transport.start()

    def cancel(self) -> None:
        """Drop the handshake (the server stops): the socket is closed, no callback."""
        if self._timer is not None:
            self._end()
            self._sock.close()

    def _arm(self, which: int) -> None:
        if self._armed == which:
            return
        self._disarm()
        self._armed = which
        if which == _READER:
            self._loop.add_reader(self._fd, self.step)
        else:
            self._loop.add_writer(self._fd, self.step)

    def _disarm(self) -> None:
        if self._armed == _READER:
            self._loop.remove_reader(self._fd)
        elif self._armed == _WRITER:
            self._loop.remove_writer(self._fd)
        self._armed = _NONE

    def _end(self) -> None:
        self._disarm()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._on_end(self)

    def _fail(self, reason: str) -> None:
        self._end()
        self._sock.close()
        self._on_failed(reason)

    def _expire(self, timeout: float) -> None:
        if self._timer is not None:
            self._fail(f"not done within {timeout:g} s")


class HandshakeSlots:
    """How many handshakes hold a slot: those in progress that started less than ``hold``
    seconds ago. A server bounds that number (and stops accepting past it), so that a storm of
    connections is handshaken a bounded number at a time; a handshake that takes longer than
    ``hold`` (a peer that stalls in it) gives its slot up, so stalling peers cannot keep the
    server from accepting for longer than ``hold`` (they are ended by the handshake timeout).
    Sans-IO: the caller gives the time. O(1) amortized per handshake."""

    __slots__ = ("_holding", "_started", "hold")

    def __init__(self, hold: float) -> None:
        self.hold = hold
        self._holding: set[Hashable] = set()
        self._started: deque[tuple[float, Hashable]] = deque()
        """In the order they started; an entry whose handshake ended waits to be dropped until
        those before it are (at most ``hold`` seconds of starts)."""

    def take(self, handshake: Hashable, now: float) -> None:
        self._holding.add(handshake)
        self._started.append((now, handshake))

    def release(self, handshake: Hashable) -> None:
        self._holding.discard(handshake)

    def in_use(self, now: float) -> int:
        cutoff, holding, started = now - self.hold, self._holding, self._started
        while started:
            at, handshake = started[0]
            if at > cutoff and handshake in holding:
                break
            started.popleft()
            if at <= cutoff:
                holding.discard(handshake)
        return len(holding)
