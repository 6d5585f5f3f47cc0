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

import pytest
import trustme
from aiohttp import web

from loopback import connect_from
from pilotfish.transport import aio
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


async def stall_in_handshakes(port: int, count: int) -> list[socket.socket]:
    """``count`` connections that send a ClientHello, get the ServerHello, then say nothing: held
    in their handshakes. The caller closes them."""
    stalled = []
    for _ in range(count):
        sock = await asyncio.to_thread(connect_from, port, "127.0.0.2", timeout=TIMEOUT)
        stalled.append(sock)
        sock.sendall(client_hello())
        assert await asyncio.to_thread(first_bytes, sock)  # a ServerHello
    return stalled


async def test_tls_handshakes_in_progress_are_bounded_and_the_ones_behind_are_served_in_turn(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A reconnect storm: past MAX_HANDSHAKES in progress the listener is not read, so the
    connections behind wait in the kernel's accept queue (no ServerHello yet) and get their
    handshakes once half of those in progress are done."""
    monkeypatch.setattr(aio, "MAX_HANDSHAKES", 2)
    monkeypatch.setattr(aio, "HANDSHAKE_SLOT_HOLD", 3600.0)  # (the next test lets them age)
    ca = trustme.CA()
    async with tls_server(ca, ConnectionLimits()) as (server, port):
        stalled = await stall_in_handshakes(port, 2)
        try:
            waiting = await asyncio.to_thread(connect_from, port, "127.0.0.2", timeout=TIMEOUT)
            waiting.sendall(client_hello())
            readable, _, _ = await asyncio.to_thread(select.select, [waiting], [], [], 0.5)
            assert not readable  # not accepted yet: no handshake, no byte
            assert len(server.connections) == 2
        finally:
            for sock in stalled:
                sock.close()  # their handshakes fail: room again
        with waiting:
            assert await asyncio.to_thread(first_bytes, waiting)  # its ServerHello, now
        # Whole handshakes go on being served while the bound holds.
        for source in ("127.0.0.3", "127.0.0.4", "127.0.0.5"):
            settings = await asyncio.to_thread(h2_over_tls, port, source, ca)
            assert settings[3] == 0x4  # a SETTINGS frame


async def test_peers_that_stall_in_their_handshakes_hold_their_slots_only_for_a_while(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A ClientHello and then nothing: each such peer holds a handshake slot for
    HANDSHAKE_SLOT_HOLD, not for the whole handshake timeout, so stalling peers cannot keep
    everyone else from being accepted."""
    monkeypatch.setattr(aio, "MAX_HANDSHAKES", 2)
    monkeypatch.setattr(aio, "HANDSHAKE_SLOT_HOLD", 0.3)
    ca = trustme.CA()
    async with tls_server(ca, ConnectionLimits()) as (server, port):
        stalled = await stall_in_handshakes(port, 2)
        try:
            # Accepted once their slots have aged, while they are still open and in their handshakes.
            settings = await asyncio.to_thread(h2_over_tls, port, "127.0.0.3", ca)
            assert settings[3] == 0x4
            assert len(server.connections) >= 2  # the stalled two are still there (the third may be gone)
        finally:
            for sock in stalled:
                sock.close()


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
