"""The gRPC server's asyncio adapter over the sans-IO HTTP/2 connection, fed bytes the way TCP
may deliver them: whole, or cut anywhere. The transport under it is a recorder (named as such):
these tests are about framing, and tests/integration/test_grpc_transport.py runs the same code
over real sockets (the connection's own rules: tests/unit/transport/test_transport_h2.py). Last, the
connection caps (ConnectionLimits): defaults from the open-file limit."""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable
from typing import Any

import hpack
import pytest

from pilotfish.transport import frames as h2
from pilotfish.transport.aio import KEEPALIVE_IDLE, Call, ConnectionLimits, GrpcServer, _Connection


class RecordingTransport:
    """Stands in for a socket transport: keeps what is written."""

    def __init__(self) -> None:
        self.written = bytearray()
        self.closed = False
        self.aborted = False
        self.reading = True
        self.buffered = 0
        """Bytes the peer has not taken yet (``get_write_buffer_size``)."""

    def write(self, data: bytes) -> None:
        self.written += data

    def writelines(self, data: list[bytes]) -> None:
        for piece in data:
            self.written += piece

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.closed = self.aborted = True

    def get_write_buffer_size(self) -> int:
        return self.buffered

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return ("127.0.0.1", 5555) if name == "peername" else default


class Recorder:
    """A method handler that records its callbacks."""

    def __init__(self, call: Call) -> None:
        self.call = call
        self.messages: list[bytes] = []
        self.half_closed = False
        self.closed_reason: str | None = None
        calls.append(self)

    def on_message(self, data: bytes) -> None:
        self.messages.append(data)
        if data == b"echo":
            self.call.send(b"echo", b"ed")

    def on_half_close(self) -> None:
        self.half_closed = True

    def on_closed(self, reason: str) -> None:
        self.closed_reason = reason


calls: list[Recorder] = []


def message(body: bytes) -> bytes:
    return h2.grpc_prefix(len(body)) + body


def client_bytes() -> bytes:
    """A client conversation using what grpc core seldom does: Huffman-coded and indexed headers
    split over CONTINUATION, padding, several messages in one frame, a message over two frames."""
    block = hpack.Encoder().encode(
        [
            (":method", "POST"),
            (":scheme", "http"),
            (":path", "/svc/Method"),
            (":authority", "localhost"),
            ("content-type", "application/grpc"),
            ("te", "trailers"),
        ],
        huffman=True,
    )
    first, rest = block[:10], block[10:]
    two = message(b"one") + message(b"two")
    big = message(b"x" * 30_000)
    padded = bytes([7]) + two + b"\0" * 7
    return (
        h2.CONNECTION_PREFACE
        + h2.settings({h2.Setting.INITIAL_WINDOW_SIZE: 1 << 20})
        + h2.frame(h2.HEADERS, 0, 1, first)
        + h2.frame(h2.CONTINUATION, h2.END_HEADERS, 1, rest)
        + h2.frame(h2.DATA, h2.PADDED, 1, padded)
        + h2.frame(h2.DATA, 0, 1, big[:16_000])
        + h2.frame(h2.DATA, 0, 1, big[16_000:])
        + h2.frame(h2.PING, 0, 0, b"pingpong")
        + h2.frame(h2.DATA, h2.END_STREAM, 1, message(b"echo"))
    )


def frames(data: bytes | bytearray) -> list[tuple[int, int, int, bytes]]:
    out, offset = [], 0
    while offset < len(data):
        length, kind, flags, stream = h2.parse_frame_header(data, offset)
        out.append((kind, flags, stream, bytes(data[offset + 9 : offset + 9 + length])))
        offset += 9 + length
    return out


@pytest.mark.parametrize("chunk", [1, 7, 4096, 1 << 20], ids=["1 byte", "7 bytes", "4 KB", "all at once"])
async def test_messages_arrive_whole_however_the_bytes_are_cut(chunk: int) -> None:
    calls.clear()
    server = GrpcServer({"/svc/Method": Recorder})
    conn = _Connection(server)
    transport = RecordingTransport()
    conn.connection_made(transport)  # type: ignore[arg-type]
    data = client_bytes()
    for offset in range(0, len(data), chunk):
        conn.data_received(data[offset : offset + chunk])
    await asyncio.sleep(0)  # writes go out at the end of the loop turn
    [handler] = calls
    assert handler.messages == [b"one", b"two", b"x" * 30_000, b"echo"]
    assert handler.half_closed and handler.closed_reason == "finished"
    sent = frames(transport.written)
    kinds = [(kind, flags, stream) for kind, flags, stream, _ in sent]
    assert (h2.SETTINGS, h2.ACK, 0) in kinds
    assert (h2.PING, h2.ACK, 0, b"pingpong") in sent
    [data_frame] = [payload for kind, _, stream, payload in sent if kind == h2.DATA]
    assert data_frame == message(b"echoed")
    # the call ended OK after the client half-closed: trailers with END_STREAM
    last = [f for f in sent if f[0] == h2.HEADERS][-1]
    assert last[1] & h2.END_STREAM
    assert (b"grpc-status", b"0") in list(hpack.Decoder().decode(last[3], raw=True))


async def test_a_response_waits_for_window_and_goes_out_in_peer_sized_frames() -> None:
    calls.clear()
    server = GrpcServer({"/svc/Method": Recorder})
    conn = _Connection(server)
    transport = RecordingTransport()
    conn.connection_made(transport)  # type: ignore[arg-type]
    conn.data_received(client_bytes()[: len(client_bytes()) - 9 - len(message(b"echo"))])
    [handler] = calls
    conn.flush_out()
    transport.written.clear()
    body = bytes(range(256)) * 400  # 102,400 bytes; the connection window is 65,535
    handler.call.send(body)
    conn.flush_out()
    first = [p for kind, _, _, p in frames(transport.written) if kind == h2.DATA]
    assert sum(map(len, first)) == h2.DEFAULT_WINDOW and max(map(len, first)) <= h2.DEFAULT_MAX_FRAME
    transport.written.clear()
    conn.data_received(h2.window_update(0, 1 << 20))
    conn.flush_out()
    rest = [p for kind, _, _, p in frames(transport.written) if kind == h2.DATA]
    assert b"".join(first + rest) == message(body)


async def test_a_bad_preface_is_a_connection_error() -> None:
    conn = _Connection(GrpcServer({}))
    transport = RecordingTransport()
    conn.connection_made(transport)  # type: ignore[arg-type]
    conn.data_received(b"GET / HTTP/1.1\r\n")
    assert transport.closed
    goaway = [p for kind, _, _, p in frames(transport.written) if kind == h2.GOAWAY]
    assert goaway and h2.unpack_u32(goaway[0], 4) == h2.ErrorCode.PROTOCOL_ERROR


async def test_a_large_response_within_the_windows_is_cut_at_the_peer_frame_size() -> None:
    calls.clear()
    conn = _Connection(GrpcServer({"/svc/Method": Recorder}))
    transport = RecordingTransport()
    conn.connection_made(transport)  # type: ignore[arg-type]
    opening = client_bytes()[: len(client_bytes()) - 9 - len(message(b"echo"))]
    conn.data_received(opening + h2.window_update(0, 1 << 24))
    [handler] = calls
    conn.flush_out()
    transport.written.clear()
    first, second = bytes(range(256)) * 70, b"\x07" * 20_000  # 17,920 + 20,000 bytes, two parts
    handler.call.send(first, second)
    conn.flush_out()
    data = [(flags, p) for kind, flags, _, p in frames(transport.written) if kind == h2.DATA]
    assert [len(p) for _, p in data] == [16_384, 16_384, 17_920 + 20_000 + 5 - 2 * 16_384]
    assert b"".join(p for _, p in data) == message(first + second)


async def test_a_client_that_does_not_read_is_still_read_and_its_answers_wait() -> None:
    calls.clear()
    conn = _Connection(GrpcServer({"/svc/Method": Recorder}))
    transport = RecordingTransport()
    conn.connection_made(transport)  # type: ignore[arg-type]
    conn.data_received(client_bytes()[: len(client_bytes()) - 9 - len(message(b"echo"))])
    [handler] = calls
    conn.flush_out()
    transport.written.clear()
    conn.pause_writing()  # the socket buffer is full: the client does not read
    assert transport.reading  # (what it sends may be what must end the connection)
    handler.call.send(b"held")
    conn.flush_out()
    assert not [p for kind, _, _, p in frames(transport.written) if kind == h2.DATA]
    conn.resume_writing()
    conn.flush_out()
    assert [p for kind, _, _, p in frames(transport.written) if kind == h2.DATA] == [message(b"held")]


async def test_a_connection_error_is_logged_answered_with_goaway_and_frees_the_calls(
    caplog: pytest.LogCaptureFixture,
) -> None:
    calls.clear()
    conn = _Connection(GrpcServer({"/svc/Method": Recorder}))
    transport = RecordingTransport()
    conn.connection_made(transport)  # type: ignore[arg-type]
    conn.data_received(client_bytes()[: len(client_bytes()) - 9 - len(message(b"echo"))])
    conn.data_received(h2.frame(h2.RST_STREAM, 0, 1, b"\0\0"))  # 2 bytes: once a struct.error
    assert transport.closed
    goaway = [p for kind, _, _, p in frames(transport.written) if kind == h2.GOAWAY]
    assert goaway and h2.unpack_u32(goaway[0], 4) == h2.ErrorCode.FRAME_SIZE_ERROR
    assert any(
        "RST_STREAM of 2 bytes" in r.getMessage() and "ipv4:127.0.0.1:5555" in r.getMessage() for r in caplog.records
    )
    conn.connection_lost(None)  # what the event loop does once the transport has closed
    [handler] = calls
    assert handler.closed_reason == "connection lost"


async def until(condition: Callable[[], bool], timeout: float = 5.0) -> bool:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition() and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.005)
    return bool(condition())


@pytest.mark.parametrize("peer_reads", [True, False], ids=["peer-takes-it", "peer-never-reads"])
async def test_an_ended_connection_closes_once_the_peer_has_its_goaway_and_at_the_latest_on_time(
    peer_reads: bool,
) -> None:
    calls.clear()
    server = GrpcServer({"/svc/Method": Recorder}, connection_limits=ConnectionLimits(close_timeout=0.3))
    conn = _Connection(server)
    transport = RecordingTransport()
    conn.connection_made(transport)  # type: ignore[arg-type]
    conn.data_received(client_bytes()[: len(client_bytes()) - 9 - len(message(b"echo"))])
    transport.buffered = 10_000  # answers the peer has not taken yet
    started = asyncio.get_running_loop().time()
    conn.data_received(h2.frame(h2.DATA, 0, 1) * 2)  # an empty DATA flood: GOAWAY
    assert [h2.unpack_u32(p, 4) for kind, _, _, p in frames(transport.written) if kind == h2.GOAWAY] == [
        h2.ErrorCode.ENHANCE_YOUR_CALM
    ]
    assert not transport.reading and not transport.closed  # the GOAWAY is still behind the answers
    if peer_reads:
        transport.buffered = 0
        assert await until(lambda: transport.closed)
        assert not transport.aborted  # closed, not cut off: the peer had it all
    else:
        assert await until(lambda: transport.closed)
        assert transport.aborted and asyncio.get_running_loop().time() - started >= 0.3  # cut off on time
    conn.connection_lost(None)


@pytest.mark.parametrize(
    ("descriptors", "total", "per_address"),
    [
        (1024, 896, 448),  # the usual soft limit: 128 kept for the process, one address half of the rest
        (20_000, 18_000, 4096),
        (1 << 20, 943_719, 4096),  # a tenth kept
        (200, 100, 50),  # a tiny limit: half of it, never less
    ],
)
def test_default_caps_leave_descriptors_for_the_process_and_no_address_takes_all(
    descriptors: int, total: int, per_address: int
) -> None:
    assert ConnectionLimits().caps(descriptors) == (total, per_address)


def test_given_caps_are_kept() -> None:
    limits = ConnectionLimits(max_connections=10, max_connections_per_address=10)
    assert limits.caps(1024) == (10, 10)
    assert ConnectionLimits(max_connections=10).caps(1 << 20) == (10, 5)
    assert ConnectionLimits(max_connections_per_address=10_000).caps(1024) == (896, 10_000)


def test_refusals_are_logged_at_most_once_per_interval_with_how_many_were_not(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from pilotfish.transport.aio import WARN_EVERY, RateLimitedLog

    now = [100.0]
    warnings = RateLimitedLog(logging.getLogger("pilotfish.server"), what="such streams", clock=lambda: now[0])
    with caplog.at_level("WARNING", logger="pilotfish.server"):
        for i in range(300):  # a peer refused in a loop, 16 times per second
            warnings.log("stream %d ended: %s", i, "too many names")
            now[0] += 0.0625
        warnings.flush()  # the interval is not over: nothing yet
        now[0] += WARN_EVERY
        warnings.flush()  # the flood stopped: what was left out is still counted
        warnings.flush()
    assert WARN_EVERY == 10.0
    messages = [r.getMessage() for r in caplog.records]
    assert messages == [
        "stream 0 ended: too many names",
        "stream 160 ended: too many names (and 159 more such streams since the last one logged)",
        "139 more such streams not logged in the last 10 s",
    ]


async def test_each_accepted_connection_waits_its_own_idle_time_before_keepalive_probes() -> None:
    # A fleet that connected at once must not be probed at one instant: each accepted socket
    # draws its TCP keepalive idle time from KEEPALIVE_IDLE (aligned probes of 10,000 idle
    # connections overflowed the kernel's queues, and 13 % were closed as dead peers).
    server = GrpcServer({"/svc/Method": Recorder})
    port = await server.start("127.0.0.1", 0)
    loop = asyncio.get_running_loop()
    clients = []
    try:
        for _ in range(24):
            sock = socket.socket()
            sock.setblocking(False)
            await loop.sock_connect(sock, ("127.0.0.1", port))
            clients.append(sock)
        assert await until(lambda: len(server.connections) == len(clients))
        idle = [
            conn.transport.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE)
            for conn in server.connections
        ]
        assert all(KEEPALIVE_IDLE[0] <= seconds <= KEEPALIVE_IDLE[1] for seconds in idle), idle
        assert len(set(idle)) > 1, f"24 connections, one idle time: {idle}"
    finally:
        for sock in clients:
            sock.close()
        await server.stop()
