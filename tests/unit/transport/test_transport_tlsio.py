"""TLS on the event loop (pilotfish.transport.tlsio): real OpenSSL on both ends over loopback.

The server side is :class:`TlsHandshake` and :class:`TlsTransport` under a recording protocol; the
clients are Python's blocking ``ssl`` sockets in threads, so they can send, stop reading and read
as a slow or hostile peer would.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import ssl
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import trustme

from pilotfish.transport.tlsio import HIGH_WATER, HandshakeSlots, TlsHandshake, TlsTransport

TIMEOUT = 10.0


class Recorder(asyncio.Protocol):
    """What the server side of one connection saw."""

    def __init__(self) -> None:
        self.transport: TlsTransport | None = None
        self.data = bytearray()
        self.lost: list[BaseException | None] = []
        self.pauses = 0
        self.resumes = 0

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.data += data

    def connection_lost(self, exc: BaseException | None) -> None:
        self.lost.append(exc)

    def pause_writing(self) -> None:
        self.pauses += 1

    def resume_writing(self) -> None:
        self.resumes += 1


@dataclass
class Server:
    port: int
    ca: trustme.CA
    protocols: list[Recorder] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    handshakes: set[TlsHandshake] = field(default_factory=set)

    def client(self) -> ssl.SSLSocket:
        """A blocking TLS client, handshake done."""
        context = ssl.create_default_context()
        self.ca.configure_trust(context)
        sock = socket.create_connection(("127.0.0.1", self.port), timeout=TIMEOUT)
        return context.wrap_socket(sock, server_hostname="127.0.0.1")


@contextlib.asynccontextmanager
async def tls_server(handshake_timeout: float = TIMEOUT) -> AsyncIterator[Server]:
    loop = asyncio.get_running_loop()
    ca = trustme.CA()
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ca.issue_cert("127.0.0.1").configure_cert(context)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    listener.setblocking(False)
    server = Server(listener.getsockname()[1], ca)

    def accept() -> None:
        with contextlib.suppress(BlockingIOError):
            sock, _ = listener.accept()
            sock.setblocking(False)
            protocol = Recorder()
            server.protocols.append(protocol)
            handshake = TlsHandshake(
                loop,
                context.wrap_socket(sock, server_side=True, do_handshake_on_connect=False),
                protocol,
                timeout=handshake_timeout,
                on_failed=server.failures.append,
                on_end=server.handshakes.discard,
            )
            server.handshakes.add(handshake)
            handshake.step()

    loop.add_reader(listener, accept)
    try:
        yield server
    finally:
        loop.remove_reader(listener)
        listener.close()
        for handshake in list(server.handshakes):
            handshake.cancel()
        for protocol in server.protocols:
            if protocol.transport is not None:
                protocol.transport.abort()


async def until(condition: Callable[[], bool], what: str) -> None:
    deadline = asyncio.get_running_loop().time() + TIMEOUT
    while not condition():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


def read_exactly(sock: ssl.SSLSocket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = sock.recv(min(65536, n - len(out)))
        if not chunk:
            break
        out += chunk
    return bytes(out)


async def test_bytes_both_ways_arrive_whole_in_order_and_each_connection_gets_only_its_own() -> None:
    """Megabytes each way on two connections at once: many records per read (the shared buffer
    filled and handed on), writes OpenSSL cannot finish at once (retried with the same bytes)."""
    async with tls_server() as server:
        payloads = [os.urandom(3_000_000), os.urandom(2_000_000)]
        clients = [await asyncio.to_thread(server.client) for _ in payloads]
        await until(lambda: len(server.protocols) == 2 and all(p.transport for p in server.protocols), "handshakes")
        senders = [asyncio.to_thread(c.sendall, p) for c, p in zip(clients, payloads, strict=True)]
        await asyncio.gather(*senders)
        by_port = {p.transport.get_extra_info("peername")[1]: p for p in server.protocols if p.transport}
        mine = [by_port[c.getsockname()[1]] for c in clients]
        await until(lambda: all(len(m.data) == len(p) for m, p in zip(mine, payloads, strict=True)), "all bytes")
        assert [bytes(m.data) for m in mine] == payloads

        replies = [os.urandom(1_500_000), os.urandom(700_000)]
        for protocol, reply in zip(mine, replies, strict=True):
            assert protocol.transport is not None
            third = len(reply) // 3
            protocol.transport.writelines([reply[:third], reply[third : 2 * third]])
            protocol.transport.write(reply[2 * third :])
        got = await asyncio.gather(
            *(asyncio.to_thread(read_exactly, c, len(r)) for c, r in zip(clients, replies, strict=True))
        )
        assert got == replies
        for client in clients:
            client.close()
        await until(lambda: all(m.lost == [None] for m in mine), "connection_lost once each")


async def test_a_peer_that_does_not_read_pauses_the_protocol_and_resumes_it_once_it_has_read() -> None:
    async with tls_server() as server:
        client = await asyncio.to_thread(server.client)
        await until(lambda: bool(server.protocols) and server.protocols[0].transport is not None, "handshake")
        protocol = server.protocols[0]
        transport = protocol.transport
        assert transport is not None
        reply = os.urandom(8 * 1024 * 1024)  # more than loopback's socket buffers hold
        transport.write(reply)
        await until(lambda: protocol.pauses == 1, "pause_writing")
        assert transport.get_write_buffer_size() > HIGH_WATER
        got = await asyncio.to_thread(read_exactly, client, len(reply))
        assert got == reply
        await until(lambda: protocol.resumes == 1 and transport.get_write_buffer_size() == 0, "resume_writing")
        client.close()


async def test_close_writes_what_is_left_then_says_goodbye_and_abort_does_not_wait() -> None:
    async with tls_server() as server:
        polite, rude = [await asyncio.to_thread(server.client) for _ in range(2)]
        await until(lambda: len(server.protocols) == 2 and all(p.transport for p in server.protocols), "handshakes")
        by_port = {p.transport.get_extra_info("peername")[1]: p for p in server.protocols if p.transport}
        closing, aborted = by_port[polite.getsockname()[1]], by_port[rude.getsockname()[1]]
        assert closing.transport is not None and aborted.transport is not None
        reply = os.urandom(4 * 1024 * 1024)
        closing.transport.write(reply)
        closing.transport.close()
        assert closing.transport.is_closing() and not closing.lost  # still writing
        aborted.transport.write(reply)
        aborted.transport.abort()
        await until(lambda: aborted.lost == [None], "connection_lost after abort")

        def read_to_end(sock: ssl.SSLSocket) -> bytes:
            out = bytearray()
            while chunk := sock.recv(65536):  # b"": the server's close_notify (a reset would raise)
                out += chunk
            return bytes(out)

        assert await asyncio.to_thread(read_to_end, polite) == reply
        await until(lambda: closing.lost == [None], "connection_lost after close")
        cut = await asyncio.to_thread(read_exactly, rude, len(reply))
        assert len(cut) < len(reply)  # what was not written went with the abort
        polite.close()
        rude.close()


async def test_a_client_that_sends_no_client_hello_is_cut_off_at_the_handshake_timeout() -> None:
    async with tls_server(handshake_timeout=0.3) as server:
        silent = await asyncio.to_thread(socket.create_connection, ("127.0.0.1", server.port), TIMEOUT)
        await until(lambda: bool(server.failures), "the handshake to fail")
        assert server.failures == ["not done within 0.3 s"]
        assert await asyncio.to_thread(silent.recv, 10) == b""  # closed: no TLS byte was ever sent
        assert not server.handshakes and server.protocols[0].transport is None
        silent.close()


async def test_a_client_that_does_not_speak_tls_fails_its_handshake_with_a_reason() -> None:
    async with tls_server() as server:
        plain = await asyncio.to_thread(socket.create_connection, ("127.0.0.1", server.port), TIMEOUT)
        await asyncio.to_thread(plain.sendall, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        await until(lambda: bool(server.failures), "the handshake to fail")
        assert "http request" in server.failures[0].lower() or "wrong version" in server.failures[0].lower()
        assert server.protocols[0].transport is None and not server.handshakes
        plain.close()


@pytest.mark.parametrize("how", ["close", "reset"])
async def test_a_client_that_goes_away_is_lost_once(how: str) -> None:
    async with tls_server() as server:
        client = await asyncio.to_thread(server.client)
        await until(lambda: bool(server.protocols) and server.protocols[0].transport is not None, "handshake")
        protocol = server.protocols[0]
        await asyncio.to_thread(client.sendall, b"hello")
        await until(lambda: protocol.data == b"hello", "the bytes")
        if how == "reset":
            client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        thread = threading.Thread(target=client.close)
        thread.start()
        thread.join(TIMEOUT)
        await until(lambda: len(protocol.lost) == 1, "connection_lost")
        assert protocol.transport is not None and protocol.transport.is_closing()
        protocol.transport.abort()  # after the end: nothing more happens
        await asyncio.sleep(0)
        assert len(protocol.lost) == 1


def test_a_handshake_holds_its_slot_until_it_ends_or_has_held_it_for_the_hold_time() -> None:
    slots = HandshakeSlots(hold=2.0)
    slots.take("a", 0.0)
    slots.take("b", 0.5)
    slots.take("c", 1.0)
    assert slots.in_use(1.0) == 3
    slots.release("b")  # ended
    assert slots.in_use(1.5) == 2
    assert slots.in_use(2.0) == 1  # "a" has held its slot for 2 s: given up
    slots.release("a")  # ending after that changes nothing
    assert slots.in_use(2.0) == 1
    slots.take("d", 2.5)
    assert slots.in_use(3.0) == 1  # "c" aged out, "d" holds
    assert slots.in_use(4.5) == 0
    assert not slots._started  # what it remembers is what started within the hold time
