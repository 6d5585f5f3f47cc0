"""bench/h2client.py (pilotfish's HTTP/2 connection in the client role) against a grpc core server
(grpc.aio, raw bytes) and against a scripted HTTP/2 peer that sends what grpc core seldom does
(padding, CONTINUATION, PINGs, small windows).

What the fleet simulator relies on: messages arrive whole and in order however they are framed,
both send and receive flow control hold with any server settings, and every way a call can end
is reported by its gRPC status name.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import cast

import grpc
import hpack
import pytest
import trustme

_ROOT = str(Path(__file__).resolve().parents[2])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from bench.h2client import H2Channel, H2Error, client_context  # noqa: E402
from bench.procs import free_port  # noqa: E402

from pilotfish.transport import frames as http2  # noqa: E402
from pilotfish.transport.aio import Call, GrpcServer  # noqa: E402
from pilotfish.transport.tls import TlsFiles, build_context  # noqa: E402

_SERVICE = "envoy.service.discovery.v3.AggregatedDiscoveryService"
_PATH = f"/{_SERVICE}/StreamAggregatedResources"


async def _servicer(requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
    """Each request is a command: ``echo:X`` answers X, ``big:N`` N bytes, ``many:N`` N small
    messages, ``len`` the length of the next request, ``fail`` aborts (INVALID_ARGUMENT), ``end``
    ends with OK."""
    measure = False
    async for request in requests:
        if measure:
            yield str(len(request)).encode()
            measure = False
            continue
        command, _, arg = request.partition(b":")
        if command == b"echo":
            yield arg
        elif command == b"big":
            yield bytes(range(256)) * (int(arg) // 256) + b"x" * (int(arg) % 256)
        elif command == b"many":
            for n in range(int(arg)):
                yield b"m%d" % n
        elif command == b"len":
            measure = True
        elif command == b"fail":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "bad request: 100% ☃\nsecond line")
        elif command == b"end":
            return


@pytest.fixture
async def grpc_port() -> AsyncIterator[int]:
    server = grpc.aio.server()
    server.add_generic_rpc_handlers(
        [
            grpc.method_handlers_generic_handler(
                _SERVICE, {"StreamAggregatedResources": grpc.stream_stream_rpc_method_handler(_servicer)}
            )
        ]
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield port
    finally:
        await server.stop(None)


async def test_messages_of_any_size_arrive_whole_and_in_order(grpc_port: int) -> None:
    channel = await H2Channel.connect("127.0.0.1", grpc_port)
    call = channel.call(_PATH)
    call.write(b"echo:hello")
    assert await call.read() == b"hello"
    call.write(b"big:3000000")  # about 183 frames of 16 KiB
    big = await call.read()
    assert big is not None and len(big) == 3_000_000 and big[:256] == bytes(range(256))
    call.write(b"many:500")  # several messages per DATA frame
    assert [await call.read() for _ in range(500)] == [b"m%d" % n for n in range(500)]
    call.write(b"end")
    assert await call.read() is None
    assert await call.read() is None
    channel.close()


async def test_a_large_request_waits_for_the_servers_window(grpc_port: int) -> None:
    channel = await H2Channel.connect("127.0.0.1", grpc_port)
    call = channel.call(_PATH)
    call.write(b"len")
    call.write(b"r" * 2_000_000)  # far beyond a fresh connection's 65,535-byte window
    call.write(b"echo:after")
    assert await call.read() == b"2000000"
    assert await call.read() == b"after"
    channel.close()


async def test_messages_can_go_to_a_callback(grpc_port: int) -> None:
    channel = await H2Channel.connect("127.0.0.1", grpc_port)
    got: list[bytes] = []

    def on_message(message: bytes) -> None:
        got.append(message)
        if message == b"one":
            call.write(b"echo:two")  # writing from the callback, as the simulated proxy does
        elif message == b"two":
            call.write(b"end")

    call = channel.call(_PATH, on_message=on_message)
    call.write(b"echo:one")
    await asyncio.wait_for(call.wait_closed(), 10)
    assert got == [b"one", b"two"]
    channel.close()


async def test_a_callback_that_raises_ends_the_call_with_its_exception(grpc_port: int) -> None:
    channel = await H2Channel.connect("127.0.0.1", grpc_port)

    def on_message(message: bytes) -> None:
        raise KeyError(message)

    call = channel.call(_PATH, on_message=on_message)
    call.write(b"echo:boom")
    with pytest.raises(KeyError):
        await asyncio.wait_for(call.wait_closed(), 10)
    channel.close()


@pytest.mark.parametrize("first", [False, True], ids=["trailers", "trailers-only"])
async def test_a_status_and_its_percent_encoded_message_are_reported(grpc_port: int, first: bool) -> None:
    channel = await H2Channel.connect("127.0.0.1", grpc_port)
    call = channel.call(_PATH)
    if not first:
        call.write(b"echo:ok")
        assert await call.read() == b"ok"
    call.write(b"fail")
    with pytest.raises(H2Error) as caught:
        await call.read()
    assert caught.value.code == "INVALID_ARGUMENT"
    assert caught.value.details == "bad request: 100% ☃\nsecond line"
    channel.close()


async def test_an_unknown_method_is_unimplemented(grpc_port: int) -> None:
    channel = await H2Channel.connect("127.0.0.1", grpc_port)
    call = channel.call("/no.Such/Method")
    with pytest.raises(H2Error) as caught:
        await call.read()
    assert caught.value.code == "UNIMPLEMENTED"
    channel.close()


async def test_a_server_going_away_ends_the_call_unavailable_or_cancelled() -> None:
    server = grpc.aio.server()
    server.add_generic_rpc_handlers(
        [
            grpc.method_handlers_generic_handler(
                _SERVICE, {"StreamAggregatedResources": grpc.stream_stream_rpc_method_handler(_servicer)}
            )
        ]
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = await H2Channel.connect("127.0.0.1", port)
    call = channel.call(_PATH)
    call.write(b"echo:up")
    assert await call.read() == b"up"
    await server.stop(None)
    with pytest.raises(H2Error) as caught:
        await asyncio.wait_for(call.read(), 10)
    assert caught.value.code in ("UNAVAILABLE", "CANCELLED")
    channel.close()


async def test_no_server_is_unavailable() -> None:
    with pytest.raises(H2Error) as caught:
        await H2Channel.connect("127.0.0.1", free_port())
    assert caught.value.code == "UNAVAILABLE"


async def test_cancel_ends_the_call_cancelled(grpc_port: int) -> None:
    channel = await H2Channel.connect("127.0.0.1", grpc_port)
    call = channel.call(_PATH)
    call.write(b"echo:x")
    assert await call.read() == b"x"
    call.cancel()
    with pytest.raises(H2Error) as caught:
        await call.read()
    assert caught.value.code == "CANCELLED"
    with pytest.raises(H2Error):
        call.write(b"echo:y")
    channel.close()


# --------------------------------------------------------------------------------------------
# A scripted peer: raw frames both ways
# --------------------------------------------------------------------------------------------


class _Peer:
    """The server end of one connection, frame by frame."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.encoder = hpack.Encoder()
        self.preface = b""

    async def frame(self) -> tuple[int, int, int, bytes]:
        """The client's next frame: (type, flags, stream id, payload)."""
        header = await self.reader.readexactly(9)
        length, kind, flags, stream_id = http2.parse_frame_header(header, 0)
        return kind, flags, stream_id, await self.reader.readexactly(length)

    async def expect(self, kind: int) -> tuple[int, int, bytes]:
        """Skip to the client's next frame of type ``kind``: (flags, stream id, payload)."""
        while True:
            got, flags, stream_id, payload = await self.frame()
            if got == kind:
                return flags, stream_id, payload

    def send(self, kind: int, flags: int, stream_id: int, payload: bytes = b"") -> None:
        self.writer.write(http2.frame(kind, flags, stream_id, payload))

    def headers(self, headers: list[tuple[str, str]], *, end_stream: bool) -> None:
        """A header block (Huffman, indexed into the dynamic table) in a padded HEADERS frame
        and two CONTINUATIONs."""
        block = self.encoder.encode(headers, huffman=True)
        third = max(1, len(block) // 3)
        padded = bytes([7]) + block[:third] + b"\0" * 7
        self.send(http2.HEADERS, http2.PADDED | (http2.END_STREAM if end_stream else 0), 1, padded)
        self.send(http2.CONTINUATION, 0, 1, block[third : 2 * third])
        self.send(http2.CONTINUATION, http2.END_HEADERS, 1, block[2 * third :])


@contextlib.asynccontextmanager
async def _scripted_server() -> AsyncIterator[tuple[int, asyncio.Queue[_Peer]]]:
    peers: asyncio.Queue[_Peer] = asyncio.Queue()

    async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = _Peer(reader, writer)
        peer.preface = await reader.readexactly(len(http2.CONNECTION_PREFACE))
        await peers.put(peer)

    server = await asyncio.start_server(accept, "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1], peers
    finally:
        server.close()


async def test_padding_continuation_huffman_ping_and_both_flow_controls() -> None:
    window = 100_000
    async with _scripted_server() as (port, peers):
        channel = await H2Channel.connect("127.0.0.1", port, window=window)
        call = channel.call(_PATH)
        peer = await peers.get()
        assert peer.preface == http2.CONNECTION_PREFACE
        kind, flags, _, payload = await peer.frame()
        assert kind == http2.SETTINGS
        assert dict(http2.parse_settings(payload))[http2.Setting.INITIAL_WINDOW_SIZE] == window
        kind, _, stream_id, payload = await peer.frame()
        assert (kind, stream_id, http2.unpack_u32(payload)) == (http2.WINDOW_UPDATE, 0, window - 65_535)
        flags, stream_id, block = await peer.expect(http2.HEADERS)
        assert stream_id == 1 and flags & http2.END_HEADERS
        request = dict(cast(list[tuple[str, str]], hpack.Decoder().decode(block)))  # str: raw=False
        assert request[":path"] == _PATH and request["te"] == "trailers" and request[":method"] == "POST"
        assert request["content-type"] == "application/grpc" and request[":authority"] == f"127.0.0.1:{port}"

        # Our SETTINGS: a 10-byte stream window, so the client's request must wait for a WINDOW_UPDATE.
        peer.send(http2.SETTINGS, 0, 0, http2.settings({http2.Setting.INITIAL_WINDOW_SIZE: 10})[9:])
        assert (await peer.expect(http2.SETTINGS))[0] == http2.ACK
        call.write(b"q" * 95)
        _, _, payload = await peer.expect(http2.DATA)
        assert len(payload) == 10
        peer.writer.write(http2.window_update(1, 1000))
        _, _, payload = await peer.expect(http2.DATA)
        assert len(payload) == 90 and payload.endswith(b"q" * 90)

        peer.send(http2.PING, 0, 0, b"12345678")
        assert await peer.expect(http2.PING) == (http2.ACK, 0, b"12345678")

        peer.headers([(":status", "200"), ("content-type", "application/grpc")], end_stream=False)
        # Two messages and the start of a third in one padded frame, the rest of the third in another.
        messages = [b"first", b"second", b"third" * 1000]
        wire = b"".join(http2.grpc_prefix(len(m)) + m for m in messages)
        peer.send(http2.DATA, http2.PADDED, 1, bytes([3]) + wire[:40] + b"\0\0\0")
        peer.send(http2.DATA, 0, 1, wire[40:])
        assert [await call.read() for _ in messages] == messages
        # More than half our window: the client gives it back, for the stream and the connection.
        chunk = http2.grpc_prefix(60_000) + b"z" * 60_000
        for offset in range(0, len(chunk), 16_384):
            peer.send(http2.DATA, 0, 1, chunk[offset : offset + 16_384])
        assert await call.read() == b"z" * 60_000
        received = (1 + 40 + 3) + (len(wire) - 40) + len(chunk)  # padding counts too
        updates: dict[int, int] = {}
        while len(updates) < 2:
            _, stream_id, payload = await peer.expect(http2.WINDOW_UPDATE)
            updates[stream_id] = http2.unpack_u32(payload)
        assert window // 2 <= updates[1] == updates[0] <= received

        peer.headers([("grpc-status", "0"), ("grpc-message", "")], end_stream=True)
        assert await call.read() is None
        channel.close()
        peer.writer.close()


@pytest.mark.parametrize(
    ("frames", "code"),
    [
        ([(http2.RST_STREAM, 0, 1, (7).to_bytes(4, "big"))], "UNAVAILABLE"),  # REFUSED_STREAM
        ([(http2.RST_STREAM, 0, 1, (8).to_bytes(4, "big"))], "CANCELLED"),
        ([(http2.GOAWAY, 0, 0, (0).to_bytes(4, "big") + (0).to_bytes(4, "big") + b"bye")], "UNAVAILABLE"),
        ([(http2.PUSH_PROMISE, http2.END_HEADERS, 1, (2).to_bytes(4, "big"))], "INTERNAL"),
        ([], "UNAVAILABLE"),  # the connection closes
    ],
)
async def test_resets_goaway_protocol_errors_and_connection_loss_end_the_call(
    frames: list[tuple[int, int, int, bytes]], code: str
) -> None:
    async with _scripted_server() as (port, peers):
        channel = await H2Channel.connect("127.0.0.1", port)
        call = channel.call(_PATH)
        peer = await peers.get()
        await peer.expect(http2.HEADERS)
        peer.send(http2.SETTINGS, 0, 0)  # a server's preface (RFC 9113 section 3.4)
        for kind, flags, stream_id, payload in frames:
            peer.send(kind, flags, stream_id, payload)
        if not frames:
            peer.writer.close()
        with pytest.raises(H2Error) as caught:
            await asyncio.wait_for(call.read(), 10)
        assert caught.value.code == code
        channel.close()
        peer.writer.close()


async def test_a_reader_that_does_not_read_gets_no_window_back_until_it_reads() -> None:
    window = 100_000
    async with _scripted_server() as (port, peers):
        channel = await H2Channel.connect("127.0.0.1", port, window=window)
        call = channel.call(_PATH)
        peer = await peers.get()
        peer.send(http2.SETTINGS, 0, 0)
        await peer.expect(http2.HEADERS)
        peer.headers([(":status", "200"), ("content-type", "application/grpc")], end_stream=False)
        messages = [bytes([n]) * 15_000 for n in range(4)]  # more than half the window, one frame each
        for message in messages:
            peer.send(http2.DATA, 0, 1, http2.grpc_prefix(len(message)) + message)
        # The client answers frames in order: everything it sent before this PING's ACK is all it
        # sends for the messages so far. None of it gives the stream's window back.
        peer.send(http2.PING, 0, 0, b"unread!!")
        while True:
            kind, flags, stream_id, payload = await peer.frame()
            if kind == http2.PING and flags & http2.ACK:
                assert payload == b"unread!!"
                break
            assert kind != http2.WINDOW_UPDATE, (stream_id, http2.unpack_u32(payload))
        assert [await call.read() for _ in messages] == messages
        updates: dict[int, int] = {}
        while len(updates) < 2:
            _, stream_id, payload = await peer.expect(http2.WINDOW_UPDATE)
            updates[stream_id] = http2.unpack_u32(payload)
        assert updates == {0: 4 * 15_005, 1: 4 * 15_005}
        channel.close()
        peer.writer.close()


# --------------------------------------------------------------------------------------------
# TLS and mTLS, against pilotfish's own gRPC server
# --------------------------------------------------------------------------------------------


class _WhoAmI:
    """Answers each request with the identity the server verified in the client's certificate."""

    def __init__(self, call: Call) -> None:
        self.call = call

    def on_message(self, data: bytes) -> None:
        self.call.send(self.call.peer_identity.encode() or b"(none)")

    def on_half_close(self) -> None:
        self.call.finish()

    def on_closed(self, reason: str) -> None:
        pass


@contextlib.asynccontextmanager
async def _tls_server(
    tmp_path: Path, ca: trustme.CA, *, mtls: bool, alpn: tuple[str, ...] = ("h2",)
) -> AsyncIterator[int]:
    leaf = ca.issue_cert("localhost")
    cert, key, ca_file = tmp_path / "server.pem", tmp_path / "server.key", tmp_path / "ca.pem"
    leaf.cert_chain_pems[0].write_to_path(str(cert))
    leaf.private_key_pem.write_to_path(str(key))
    ca.cert_pem.write_to_path(str(ca_file))
    context = build_context(TlsFiles(cert=cert, key=key, client_ca=ca_file if mtls else None, alpn=alpn))
    server = GrpcServer({_PATH: _WhoAmI})
    port = await server.start("127.0.0.1", 0, tls=context)
    try:
        yield port
    finally:
        await server.stop(0)


def _client_files(tmp_path: Path, ca: trustme.CA, identity: str | None = None) -> dict[str, Path]:
    files = {"ca": tmp_path / "client-ca.pem"}
    ca.cert_pem.write_to_path(str(files["ca"]))
    if identity is not None:
        leaf = ca.issue_cert(identity)
        files["cert"], files["key"] = tmp_path / "client.pem", tmp_path / "client.key"
        leaf.cert_chain_pems[0].write_to_path(str(files["cert"]))
        leaf.private_key_pem.write_to_path(str(files["key"]))
    return files


async def _ask(port: int, context: ssl.SSLContext) -> bytes | None:
    channel = await H2Channel.connect("127.0.0.1", port, tls=context, server_hostname="localhost")
    try:
        call = channel.call(_PATH)
        call.write(b"who")
        return await asyncio.wait_for(call.read(), 10)
    finally:
        channel.close()


async def test_tls_with_alpn_h2_reaches_pilotfish(tmp_path: Path) -> None:
    ca = trustme.CA()
    async with _tls_server(tmp_path, ca, mtls=False) as port:
        assert await _ask(port, client_context(**_client_files(tmp_path, ca))) == b"(none)"


async def test_mtls_presents_the_client_certificate_and_without_one_is_refused(tmp_path: Path) -> None:
    ca = trustme.CA()
    async with _tls_server(tmp_path, ca, mtls=True) as port:
        context = client_context(**_client_files(tmp_path, ca, "proxy-7.bench.test"))
        assert await _ask(port, context) == b"proxy-7.bench.test"
        # Without a certificate: the handshake fails (TLS 1.3: the client learns it at its first read).
        with pytest.raises(H2Error) as caught:
            await _ask(port, client_context(**_client_files(tmp_path, ca)))
        assert caught.value.code == "UNAVAILABLE"


async def test_a_server_certificate_from_another_ca_is_unavailable(tmp_path: Path) -> None:
    async with _tls_server(tmp_path, trustme.CA(), mtls=False) as port:
        with pytest.raises(H2Error) as caught:
            await _ask(port, client_context(**_client_files(tmp_path, trustme.CA())))
        assert caught.value.code == "UNAVAILABLE"
        assert "CERTIFICATE_VERIFY_FAILED" in caught.value.details


async def test_a_tls_server_that_does_not_choose_h2_is_unavailable(tmp_path: Path) -> None:
    ca = trustme.CA()
    async with _tls_server(tmp_path, ca, mtls=False, alpn=()) as port:
        with pytest.raises(H2Error) as caught:
            await _ask(port, client_context(**_client_files(tmp_path, ca)))
        assert caught.value.code == "UNAVAILABLE"
        assert "ALPN" in caught.value.details
