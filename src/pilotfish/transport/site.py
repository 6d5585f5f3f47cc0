"""Serving an aiohttp application on ``host:port``, over TLS when given a context, with its
connections capped; what to say when a listener cannot bind; and the loopback test the HTTP APIs
(registry, admin) warn by. Shared by the registry API, the admin API and REST xDS, which are
served the same way.

Every listener of ``serve`` (xDS, the admin API, REST xDS, the registry API) is a
:class:`Listener`: its name and its flag. A listener that cannot bind (its address in use, not an
address of this host, a privileged port) is started inside :func:`naming_failures`, which turns
the ``OSError`` into a :class:`ListenError` naming the listener, the address and the flag to
change ("admin API: 127.0.0.1:18001 is in use (pass --admin HOST:PORT, or --admin off)"). This is
the one place those messages are written. ``serve`` first tries every fixed address
(:func:`check_addresses`), so that a second server started with the defaults hears of both the
xDS and the admin port at once.

Connections are capped as on the xDS port (:class:`~pilotfish.transport.aio.ConnectionLimits`:
the same meaning, the same defaults, resolved by the same function): at most
:attr:`HttpConnectionLimits.max_connections` from all peers and
:attr:`HttpConnectionLimits.max_connections_per_address` from one source IP
(:class:`CappedSite`). One over a cap is closed with a reset at once, before any byte (and
before a TLS handshake: one in its handshake counts), as the xDS port refuses one; an HTTP client
sees a failed connection attempt. As on the xDS port, a plaintext site lets asyncio accept (in C,
on uvloop) and counts a connection in when it is made; a TLS site accepts itself, counts, and
hands what it admits to asyncio (``connect_accepted_socket``) for the handshake. aiohttp's
protocol is wrapped only to count the connection in and out. Refusals are logged through
:class:`~pilotfish.transport.aio.RateLimitedLog` (a line per
:data:`~pilotfish.transport.aio.WARN_EVERY` seconds at most). Idle keep-alive
connections are closed by aiohttp after its keep-alive timeout (75 s).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import ipaddress
import logging
import socket
import ssl
from collections.abc import Iterator
from dataclasses import dataclass

from aiohttp import web

from pilotfish.resources.bootstrap import split_address
from pilotfish.transport.aio import (
    LISTEN_BACKLOG,
    TLS_HANDSHAKE_TIMEOUT,
    ConnectionLimits,
    RateLimitedLog,
    accept_waiting,
    descriptor_limit,
    listening_sockets,
    refuse,
    reset,
    source_address,
)

__all__ = [
    "ADMIN_API",
    "ADMIN_CONNECTIONS",
    "REGISTRY_API",
    "REST_XDS",
    "XDS",
    "CappedSite",
    "HttpConnectionLimits",
    "ListenError",
    "Listener",
    "check_addresses",
    "is_loopback",
    "naming_failures",
    "serve_app",
]

_log = logging.getLogger("pilotfish.http")


@dataclass(frozen=True, slots=True)
class Listener:
    """One of the ports ``serve`` listens on, as an operator knows it."""

    name: str
    """What it is called in messages: ``admin API``."""
    flag: str
    """The ``serve`` flag giving its address: ``--admin``."""
    alternative: str = ""
    """What else the operator may do than pick another address: ``--admin off``."""
    caps_flag: str = ""
    """The prefix of its connection-cap flags; empty: :attr:`flag` (``--admin`` ->
    ``--admin-max-connections``); ``-`` for xDS, whose flags have none (``--max-connections``)."""

    def cap_flags(self) -> tuple[str, str]:
        """The flags of its total and per-address connection caps."""
        prefix = self.caps_flag or self.flag
        return f"{prefix}-max-connections", f"{prefix}-max-connections-per-address"


XDS = Listener("xDS", "--xds", caps_flag="-")
ADMIN_API = Listener("admin API", "--admin", "--admin off")
ADMIN_GRPC = Listener("admin gRPC (CSDS)", "--admin-grpc", "leave out --admin-grpc", caps_flag="--admin")
REST_XDS = Listener("REST xDS", "--rest", "leave out --rest")
REGISTRY_API = Listener("registry API", "--registry", "leave out --registry")


def _why(cause: OSError) -> str:
    code = cause.errno
    if code == errno.EADDRINUSE:
        return "is in use"
    if code == errno.EADDRNOTAVAIL:
        return "is not an address of this host"
    if code == errno.EACCES:
        return "may not be listened on by this user (ports below 1024 need privileges)"
    if isinstance(cause, socket.gaierror):
        return f"cannot be resolved ({cause.strerror or cause})"
    return f"cannot be listened on ({(cause.strerror or str(cause)).lower()})"


class ListenError(OSError):
    """Listeners could not bind: says which, where, why and which flag to change, one line each."""

    def __init__(self, failures: list[tuple[Listener, str, OSError]]) -> None:
        super().__init__(failures[0][2].errno, failures[0][2].strerror)
        self.failures = failures
        lines = []
        for listener, address, cause in failures:
            other = f", or {listener.alternative}" if listener.alternative else ""
            lines.append(f"{listener.name}: {address} {_why(cause)} (pass {listener.flag} HOST:PORT{other})")
        self.message = "\n".join(lines)

    def __str__(self) -> str:
        return self.message


@contextlib.contextmanager
def naming_failures(listener: Listener, address: str) -> Iterator[None]:
    """Turn an ``OSError`` raised while ``listener`` starts on ``address`` into a :class:`ListenError`."""
    try:
        yield
    except ListenError:
        raise
    except OSError as exc:
        raise ListenError([(listener, address, exc)]) from None


def check_addresses(wanted: list[tuple[Listener, str | None]]) -> None:
    """Before anything listens: try to bind each listener's address (port 0 and None: nothing to
    try) and let go at once, so that one :class:`ListenError` names every listener that cannot
    bind, not only the first. (Each start still names its own failure: an address may be taken
    in between.)"""
    failures: list[tuple[Listener, str, OSError]] = []
    for listener, address in wanted:
        if address is None:
            continue
        host, port = split_address(address)
        if port == 0:
            continue
        try:
            for sock in listening_sockets(host, port):
                sock.close()
        except OSError as exc:
            failures.append((listener, address, exc))
    if failures:
        raise ListenError(failures)


def is_loopback(host: str) -> bool:
    """Whether ``host`` only answers on the loopback interface (``localhost``, 127.0.0.0/8, ::1)."""
    try:
        return host == "localhost" or ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True, slots=True, kw_only=True)
class HttpConnectionLimits:
    """How many connections an HTTP port (registry API, REST xDS, admin API) holds at once. The
    same caps as the xDS port's (:class:`~pilotfish.transport.aio.ConnectionLimits`), with
    the same defaults; a connection over one is accepted and closed at once with a reset."""

    max_connections: int | None = None
    """Connections held at once, from all peers. None: as the xDS port, the open-file limit
    less a tenth of it (at least 128 kept for the rest of the process)."""
    max_connections_per_address: int | None = None
    """Connections held at once from one source IP address. None: as the xDS port, 4,096, or
    half of :attr:`max_connections` if that is less."""

    def caps(self, descriptors: int) -> tuple[int, int]:
        """(total, per address) with the defaults resolved, as :meth:`ConnectionLimits.caps`."""
        return ConnectionLimits(
            max_connections=self.max_connections, max_connections_per_address=self.max_connections_per_address
        ).caps(descriptors)


ADMIN_CONNECTIONS = HttpConnectionLimits(max_connections=256, max_connections_per_address=64)
"""The admin API's default caps: its clients are operators, scripts (``pilotfish wait``), status
pages and a metrics scraper, never a fleet; a busy client holds a handful of keep-alive
connections."""


class _Counted(asyncio.Protocol):
    """aiohttp's protocol for one connection, counted in by the site (on plaintext: here, as
    asyncio made the connection) and out when it closes."""

    __slots__ = ("_inner", "_site", "address", "counted", "made")

    def __init__(self, inner: asyncio.Protocol, site: CappedSite, address: str = "") -> None:
        self._inner = inner
        self._site = site
        self.address = address
        """The source IP address; ``""`` until :meth:`connection_made` on plaintext."""
        self.counted = bool(address)
        """Counted in (TLS: at accept, by the site)."""
        self.made = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        if not self.counted:  # plaintext: asyncio accepted it (in C, on uvloop)
            self.address = source_address(transport.get_extra_info("peername"))
            if not self._site.admitted(self.address):
                reset(transport)  # type: ignore[arg-type]  # (a stream transport; connection_lost follows)
                return
            self.counted = True
        self.made = True
        self._inner.connection_made(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.made:
            return
        self._site.release(self.address)
        self._inner.connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received()

    def pause_writing(self) -> None:
        self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._inner.resume_writing()


class CappedSite(web.BaseSite):
    """An aiohttp site on listening sockets of its own that holds at most so many connections; one
    over a cap is refused before any byte (see the module docstring)."""

    def __init__(
        self,
        runner: web.BaseRunner,
        listeners: list[socket.socket],
        *,
        listener: Listener,
        limits: HttpConnectionLimits,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        super().__init__(runner, ssl_context=ssl_context)
        self._listeners = listeners
        self._listener = listener
        self.max_connections, self.max_connections_per_address = limits.caps(descriptor_limit())
        """The caps in force."""
        self.connections = 0
        """Connections held now (TLS handshakes included)."""
        self._per_address: dict[str, int] = {}
        self._setting_up: set[asyncio.Task[None]] = set()
        self._servers: list[asyncio.Server] = []
        self.refused_log = RateLimitedLog(_log, what=f"connections the {listener.name} refused")
        self._tls_log = RateLimitedLog(_log, what=f"failed TLS handshakes on the {listener.name}", level=logging.INFO)
        host, port = listeners[0].getsockname()[:2]
        self._name = f"{'https' if ssl_context else 'http'}://{host}:{port}"

    @property
    def name(self) -> str:
        return self._name

    async def start(self) -> None:
        await super().start()
        loop = asyncio.get_running_loop()
        server = self._runner.server
        assert server is not None
        for sock in self._listeners:
            if self._ssl_context is None:  # asyncio's accept (in C on uvloop); counted in connection_made
                self._servers.append(
                    await loop.create_server(lambda: _Counted(server(), self), sock=sock, backlog=LISTEN_BACKLOG)
                )
            else:  # our accept: the caps are checked before the TLS handshake
                loop.add_reader(sock, self._accept, sock)

    async def stop(self) -> None:
        loop = asyncio.get_running_loop()
        listeners, self._listeners = self._listeners, []
        servers, self._servers = self._servers, []
        for server in servers:
            server.close()
        for sock in listeners:
            if self._ssl_context is not None:
                loop.remove_reader(sock)
            sock.close()
        for task in list(self._setting_up):
            task.cancel()
        await super().stop()

    def admitted(self, address: str) -> bool:
        """Count a connection from ``address`` in; or log why it is refused (rate limited) and
        say so (False)."""
        refusal = self._admit(address)
        if refusal:
            self.refused_log.log("the %s refused a connection from %s: %s", self._listener.name, address, refusal)
        return not refusal

    def _admit(self, address: str) -> str:
        """Count a connection from ``address`` in, or say why it is refused (``""``: admitted)."""
        total, per_address = self._listener.cap_flags()
        if self.connections >= self.max_connections:
            return f"{self.connections} connections are open, the limit ({total})"
        count = self._per_address.get(address, 0)
        if count >= self.max_connections_per_address:
            return f"{count} connections from this address are open, the limit ({per_address})"
        self._per_address[address] = count + 1
        self.connections += 1
        return ""

    def release(self, address: str) -> None:
        """Count a connection from ``address`` out."""
        self.connections -= 1
        count = self._per_address.get(address, 0) - 1
        if count > 0:
            self._per_address[address] = count
        else:
            self._per_address.pop(address, None)

    def _accept(self, listener: socket.socket) -> None:
        self.refused_log.flush()
        accept_waiting(
            listener, self._take, log=self.refused_log, what=self._listener.name, listen_again=self._listen_again
        )

    def _take(self, sock: socket.socket, address: str) -> None:
        if not self.admitted(address):
            refuse(sock)
            return
        with contextlib.suppress(OSError):
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        task = asyncio.get_running_loop().create_task(self._set_up(sock, address))
        self._setting_up.add(task)
        task.add_done_callback(self._setting_up.discard)

    def _listen_again(self, listener: socket.socket) -> None:
        if listener in self._listeners and listener.fileno() >= 0:
            asyncio.get_running_loop().add_reader(listener, self._accept, listener)

    async def _set_up(self, sock: socket.socket, address: str) -> None:
        """Hand an admitted socket to asyncio (for TLS: its handshake) and aiohttp."""
        loop = asyncio.get_running_loop()
        server = self._runner.server
        assert server is not None
        protocol = _Counted(server(), self, address)
        try:
            await loop.connect_accepted_socket(
                lambda: protocol,
                sock,
                ssl=self._ssl_context,
                ssl_handshake_timeout=TLS_HANDSHAKE_TIMEOUT if self._ssl_context is not None else None,
            )
        except Exception as exc:
            self._tls_log.log(
                "TLS handshake with %s on the %s failed: %s",
                address,
                self._listener.name,
                (str(exc) or type(exc).__name__)[:200],
            )
        finally:
            if not protocol.made:  # no connection_lost will come: count it out here
                self.release(address)
                with contextlib.suppress(OSError):
                    sock.close()


async def serve_app(
    app: web.Application,
    address: str,
    *,
    tls: ssl.SSLContext | None = None,
    listener: Listener = ADMIN_API,
    limits: HttpConnectionLimits | None = None,
) -> tuple[web.AppRunner, str]:
    """Serve ``app`` on ``address`` (``host:port``; port 0 = any free), over TLS when ``tls`` is
    given, holding at most ``limits`` connections (default: :class:`HttpConnectionLimits`'s);
    returns the runner (``cleanup()`` stops it) and the bound ``host:port``. A failure to bind is
    a :class:`ListenError` naming ``listener``."""
    host, port = split_address(address)
    with naming_failures(listener, address):
        listeners = listening_sockets(host, port)
    runner = web.AppRunner(app, access_log=None)
    try:
        await runner.setup()
        await CappedSite(
            runner, listeners, listener=listener, limits=limits or HttpConnectionLimits(), ssl_context=tls
        ).start()
    except BaseException:
        for sock in listeners:
            sock.close()
        await runner.cleanup()
        raise
    return runner, f"{host}:{listeners[0].getsockname()[1]}"
