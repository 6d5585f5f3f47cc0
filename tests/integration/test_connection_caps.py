"""Connection caps over TLS, in-process: a connection is counted from accept, TLS handshake
included, and one over a cap is refused before the server sends a TLS byte; on the xDS port and
on the HTTP ports (:class:`~pilotfish.transport.site.CappedSite`).

(The plaintext caps, the handshake and idle timeouts are exercised against a real ``pilotfish
serve`` in tests/abuse/test_connections.py.)
"""

from __future__ import annotations

import asyncio
import contextlib
import select
import socket
import ssl
import time
from collections.abc import AsyncIterator

import trustme
from aiohttp import web

from loopback import connect_from
from pilotfish.transport.aio import ConnectionLimits, GrpcServer
from pilotfish.transport.site import REGISTRY_API, CappedSite, HttpConnectionLimits, serve_app

TIMEOUT = 5.0


@contextlib.asynccontextmanager
async def tls_server(ca: trustme.CA, limits: ConnectionLimits) -> AsyncIterator[tuple[GrpcServer, int]]:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ca.issue_cert("127.0.0.1").configure_cert(context)
    context.set_alpn_protocols(["h2"])
    server = GrpcServer({}, connection_limits=limits)
    port = await server.start("127.0.0.1", 0, tls=context)
    try:
        yield server, port
    finally:
        await server.stop()


def first_bytes(sock: socket.socket) -> bytes | None:
    """What the server sends first (None: it closed or reset the connection, sending nothing)."""
    if not select.select([sock], [], [], TIMEOUT)[0]:
        raise AssertionError("the server neither answered nor closed")
    try:
        return sock.recv(4096) or None
    except ConnectionResetError:
        return None


def client_hello() -> bytes:
    """A real TLS ClientHello (from an in-memory handshake)."""
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = ssl.create_default_context().wrap_bio(incoming, outgoing, server_hostname="127.0.0.1")
    with contextlib.suppress(ssl.SSLWantReadError):
        tls.do_handshake()
    return outgoing.read()


def h2_over_tls(port: int, source: str, ca: trustme.CA) -> bytes:
    """The first bytes of HTTP/2 the server sends a TLS client (its SETTINGS frame header)."""
    context = ssl.create_default_context()
    ca.configure_trust(context)
    context.set_alpn_protocols(["h2"])
    with context.wrap_socket(connect_from(port, source, timeout=TIMEOUT), server_hostname="127.0.0.1") as tls:
        tls.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0]))
        return tls.recv(9)


async def test_connections_in_their_tls_handshake_count_and_one_over_the_cap_gets_no_tls_byte() -> None:
    ca = trustme.CA()
    async with tls_server(ca, ConnectionLimits(max_connections_per_address=2)) as (server, port):
        silent = [
            await asyncio.to_thread(connect_from, port, "127.0.0.2", timeout=TIMEOUT) for _ in range(2)
        ]  # no ClientHello
        try:
            deadline = time.monotonic() + TIMEOUT
            while len(server.connections) < 2 and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            assert len(server.connections) == 2  # held in their TLS handshakes, and counted

            try:
                over = await asyncio.to_thread(connect_from, port, "127.0.0.2", timeout=TIMEOUT)
            except ConnectionResetError:
                pass  # reset before connect() returned (a busy machine): refused, no byte sent
            else:
                with over:
                    with contextlib.suppress(OSError):  # (it may be reset already)
                        over.sendall(client_hello())
                    assert await asyncio.to_thread(first_bytes, over) is None  # no ServerHello: no handshake

            # Another address is served over TLS meanwhile.
            settings = await asyncio.to_thread(h2_over_tls, port, "127.0.0.3", ca)
            assert settings[3] == 0x4  # a SETTINGS frame
        finally:
            for sock in silent:
                sock.close()
        deadline = time.monotonic() + TIMEOUT
        while server.connections and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert not server.connections  # failed handshakes and closed connections are counted out


async def test_the_http_ports_count_tls_handshakes_too_and_refuse_over_the_cap_before_any_tls_byte() -> None:
    ca = trustme.CA()
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ca.issue_cert("127.0.0.1").configure_cert(context)

    async def healthz(request: web.Request) -> web.Response:
        return web.Response(text="serving")

    app = web.Application()
    app.router.add_get("/healthz", healthz)
    runner, address = await serve_app(
        app,
        "127.0.0.1:0",
        tls=context,
        listener=REGISTRY_API,
        limits=HttpConnectionLimits(max_connections_per_address=2),
    )
    (site,) = runner.sites
    assert isinstance(site, CappedSite)
    port = int(address.rsplit(":", 1)[1])
    try:
        silent = [
            await asyncio.to_thread(connect_from, port, "127.0.0.2", timeout=TIMEOUT) for _ in range(2)
        ]  # no ClientHello
        try:
            deadline = time.monotonic() + TIMEOUT
            while site.connections < 2 and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            assert site.connections == 2  # held in their TLS handshakes, and counted
            try:
                over = await asyncio.to_thread(connect_from, port, "127.0.0.2", timeout=TIMEOUT)
            except ConnectionResetError:
                pass  # reset before connect() returned: refused, no byte sent
            else:
                with over:
                    with contextlib.suppress(OSError):
                        over.sendall(client_hello())
                    assert await asyncio.to_thread(first_bytes, over) is None  # no ServerHello

            def https_get() -> bytes:
                client = ssl.create_default_context()
                ca.configure_trust(client)
                sock = connect_from(port, "127.0.0.3", timeout=TIMEOUT)
                with client.wrap_socket(sock, server_hostname="127.0.0.1") as tls:
                    tls.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                    return tls.recv(4096)

            assert (await asyncio.to_thread(https_get)).startswith(b"HTTP/1.1 200")  # another address is served
        finally:
            for sock in silent:
                sock.close()
        deadline = time.monotonic() + TIMEOUT
        while site.connections and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert site.connections == 0  # failed handshakes and closed connections are counted out
    finally:
        await runner.cleanup()
