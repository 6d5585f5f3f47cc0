"""The sans-IO HTTP/2 connection: every RFC 9113 rule a peer can trip, and every limit.

Two kinds of peer: a :class:`Pair` of our own connections (client and server role) wired back to
back in memory, as h11's ConnectionPair does, for what well-behaved peers do; and raw frames built
by hand and fed to a server connection, for what a broken or hostile peer does. Each rule's test
asserts what the peer gets back: GOAWAY with the RFC's code (connection error) or RST_STREAM with
it (stream error), and that the connection keeps serving otherwise.
"""

from __future__ import annotations

import struct
import time
from collections.abc import Iterable

import hpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pilotfish.transport import frames as f
from pilotfish.transport.frames import ErrorCode, GrpcStatus, Setting
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

REQUEST = [
    (b":method", b"POST"),
    (b":scheme", b"http"),
    (b":path", b"/pkg.Service/Method"),
    (b":authority", b"pilotfish"),
    (b"content-type", b"application/grpc"),
    (b"te", b"trailers"),
]
RESPONSE = [(b":status", b"200"), (b"content-type", b"application/grpc")]
Frame = tuple[int, int, int, bytes]


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def parse_frames(data: bytes) -> list[Frame]:
    """(type, flags, stream id, payload) of each frame in ``data`` (a client preface skipped)."""
    if data.startswith(f.CONNECTION_PREFACE):
        data = data[len(f.CONNECTION_PREFACE) :]
    out, offset = [], 0
    while offset < len(data):
        length, kind, flags, stream_id = f.parse_frame_header(data, offset)
        out.append((kind, flags, stream_id, data[offset + 9 : offset + 9 + length]))
        offset += 9 + length
    assert offset == len(data), "a frame was cut short"
    return out


class Pair:
    """A client and a server connection of ours, connected in memory."""

    def __init__(self, *, client_limits: Limits | None = None, server_limits: Limits | None = None) -> None:
        self.client = Connection(role=Role.CLIENT, limits=client_limits)
        self.server = Connection(role=Role.SERVER, limits=server_limits)
        self.server_events: list[Event] = []
        self.client_events: list[Event] = []
        self.pump()

    def pump(self) -> None:
        """Move bytes both ways until neither side has anything to send."""
        while True:
            to_server, to_client = self.client.data_to_send(), self.server.data_to_send()
            if not to_server and not to_client:
                return
            if to_server:
                self.server_events += self.server.receive(to_server)
            if to_client:
                self.client_events += self.client.receive(to_client)


def raw_server(
    *, limits: Limits | None = None, clock: FakeClock | None = None, settings: dict[int, int] | None = None
) -> Connection:
    """A server connection past the client's preface and SETTINGS, its own output taken."""
    server = Connection(role=Role.SERVER, limits=limits, clock=clock or FakeClock())
    assert server.receive(f.CONNECTION_PREFACE + f.settings(settings or {})) == []
    server.data_to_send()
    return server


def headers(
    stream_id: int,
    fields: Iterable[tuple[bytes, bytes]] = REQUEST,
    *,
    end_stream: bool = False,
    end_headers: bool = True,
) -> bytes:
    flags = (f.END_STREAM if end_stream else 0) | (f.END_HEADERS if end_headers else 0)
    return f.frame(f.HEADERS, flags, stream_id, f.header_block(fields))


def message(body: bytes) -> bytes:
    return f.grpc_prefix(len(body)) + body


def data(stream_id: int, payload: bytes, *, end_stream: bool = False) -> bytes:
    return f.frame(f.DATA, f.END_STREAM if end_stream else 0, stream_id, payload)


def goaway_code(conn: Connection) -> int | None:
    for kind, _, _, payload in parse_frames(conn.data_to_send()):
        if kind == f.GOAWAY:
            return f.unpack_u32(payload, 4)
    return None


def resets(output: bytes) -> dict[int, int]:
    return {sid: f.unpack_u32(payload) for kind, _, sid, payload in parse_frames(output) if kind == f.RST_STREAM}


# -- well-behaved peers -----------------------------------------------------------------------------


def test_a_call_runs_from_request_to_trailers_between_our_two_roles() -> None:
    pair = Pair()
    stream = pair.client.open_stream()
    pair.client.send_headers(stream, REQUEST)
    pair.client.send_message(stream, b"hello")
    pair.client.end_stream(stream)
    pair.pump()
    kinds = [type(e) for e in pair.server_events]
    assert kinds == [HeadersReceived, MessageReceived, StreamEnded]
    assert pair.server_events[0] == HeadersReceived(stream, REQUEST, False, False)
    assert pair.server_events[1] == MessageReceived(stream, b"hello", 10)

    pair.server.send_headers(stream, RESPONSE)
    pair.server.send_message(stream, b"wor", b"ld")
    pair.server.send_headers(stream, [(b"grpc-status", b"0")], end_stream=True)
    pair.pump()
    assert pair.client_events == [
        HeadersReceived(stream, RESPONSE, False, False),
        MessageReceived(stream, b"world", 10),
        HeadersReceived(stream, [(b"grpc-status", b"0")], True, True),
        StreamEnded(stream, False),
    ]
    assert pair.client.open_streams == pair.server.open_streams == 0


def test_messages_cut_anywhere_across_frames_and_reads_arrive_whole() -> None:
    server = raw_server()
    bodies = [b"a" * 3, b"", b"b" * 40_000, b"c"]
    stream_bytes = b"".join(message(body) for body in bodies)
    wire = headers(1)
    for start in range(0, len(stream_bytes), 7_001):  # frames that cut prefixes and bodies
        wire += data(1, stream_bytes[start : start + 7_001])
    events: list[Event] = []
    for start in range(0, len(wire), 13):  # and reads that cut frames
        events += server.receive(wire[start : start + 13])
    assert [e.data for e in events if isinstance(e, MessageReceived)] == bodies


@settings(max_examples=200, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 40_000), min_size=1, max_size=4),
    frame_cuts=st.lists(st.integers(1, 16_384), min_size=1, max_size=8),
    read_cuts=st.lists(st.integers(1, 20_000), min_size=1, max_size=8),
)
def test_messages_cut_at_random_across_frames_and_reads_arrive_whole(
    sizes: list[int], frame_cuts: list[int], read_cuts: list[int]
) -> None:
    # Reads that end inside a frame header, right after one, inside a prefix or a body, and
    # empty DATA frames: each message arrives once, whole, as sent.
    server = raw_server()
    bodies = [bytes([i % 251]) * size for i, size in enumerate(sizes)]
    stream_bytes = b"".join(message(body) for body in bodies)
    wire, start, i = headers(1), 0, 0
    while start < len(stream_bytes):
        cut = frame_cuts[i % len(frame_cuts)]
        wire += data(1, stream_bytes[start : start + cut]) + (data(1, b"") if cut % 5 == 0 else b"")
        start, i = start + cut, i + 1
    events: list[Event] = []
    start = i = 0
    while start < len(wire):
        cut = read_cuts[i % len(read_cuts)]
        events += server.receive(wire[start : start + cut])
        start, i = start + cut, i + 1
    assert [e.data for e in events if isinstance(e, MessageReceived)] == bodies
    assert not server.closed


def test_a_header_block_larger_than_the_peers_max_frame_size_goes_out_in_continuation_frames() -> None:
    pair = Pair()
    stream = pair.client.open_stream()
    pair.client.send_headers(stream, REQUEST, end_stream=True)
    pair.pump()
    long_message = b"x" * 40_000
    pair.server.send_headers(
        stream, [*RESPONSE, (b"grpc-status", b"13"), (b"grpc-message", long_message)], end_stream=True
    )
    out = pair.server.data_to_send()
    sent = parse_frames(out)
    assert [kind for kind, *_ in sent] == [f.HEADERS, f.CONTINUATION, f.CONTINUATION]
    assert all(len(payload) <= f.DEFAULT_MAX_FRAME for *_, payload in sent)
    events = pair.client.receive(out)
    assert isinstance(events[0], HeadersReceived)
    assert (b"grpc-message", long_message) in events[0].headers


def test_data_waits_for_the_peers_window_and_trailers_wait_behind_it() -> None:
    pair = Pair(client_limits=Limits(initial_window_size=20_000))
    stream = pair.client.open_stream()
    pair.client.send_headers(stream, REQUEST)
    pair.pump()
    body = bytes(range(256)) * 200  # 51,200 bytes: more than the client's 20,000-byte window
    pair.server.send_headers(stream, RESPONSE)
    pair.server.send_message(stream, body)
    pair.server.send_headers(stream, [(b"grpc-status", b"0")], end_stream=True)
    first = parse_frames(pair.server.data_to_send())
    assert sum(len(p) for kind, _, _, p in first if kind == f.DATA) == 20_000
    assert [kind for kind, *_ in first][-1] == f.DATA  # the trailers wait
    pair.client_events += pair.client.receive(b"".join(f.frame_header(len(p), k, fl, s) + p for k, fl, s, p in first))
    pair.pump()  # the client consumes what it got as the partial message grows: the windows reopen
    messages = [e for e in pair.client_events if isinstance(e, MessageReceived)]
    assert [m.data for m in messages] == [body]
    assert StreamEnded(stream, False) in pair.client_events
    assert pair.client.open_streams == pair.server.open_streams == 0


def test_the_receive_window_reopens_only_as_the_application_consumes_messages() -> None:
    pair = Pair(server_limits=Limits(initial_window_size=10_000))
    stream = pair.client.open_stream()
    pair.client.send_headers(stream, REQUEST)
    for _ in range(6):
        pair.client.send_message(stream, b"m" * 2_995)  # 3,000 bytes each with the prefix
    pair.pump()
    delivered = [e for e in pair.server_events if isinstance(e, MessageReceived)]
    assert len(delivered) == 3  # 9,000 bytes delivered; 1,000 more of the 4th fit the window
    assert pair.client.send_window(stream) == 0
    for event in delivered:
        pair.server.acknowledge(event.stream_id, event.flow_controlled_length)
    pair.pump()
    assert len([e for e in pair.server_events if isinstance(e, MessageReceived)]) == 6


def test_a_peer_that_lowers_its_hpack_table_hears_a_table_size_update() -> None:
    server = raw_server(settings={Setting.HEADER_TABLE_SIZE: 0})
    server.receive(headers(1))
    server.send_headers(1, RESPONSE)
    ((kind, _, _, block),) = parse_frames(server.data_to_send())
    assert kind == f.HEADERS
    assert block[0] == 0x20  # size update to 0, first in the block
    decoder = hpack.Decoder()
    assert decoder.decode(block, raw=True) == RESPONSE


def test_a_goaway_from_the_peer_is_reported() -> None:
    server = raw_server()
    events = server.receive(f.goaway(0, ErrorCode.NO_ERROR, b"bye"))
    assert events == [ConnectionTerminated(ErrorCode.NO_ERROR, 0, True, "GOAWAY from the peer: bye")]


# -- connection errors ------------------------------------------------------------------------------

U32 = struct.Struct(">L").pack
CONNECTION_ERRORS: list[tuple[str, bytes, int]] = [
    ("DATA on stream 0", data(0, b"x"), ErrorCode.PROTOCOL_ERROR),
    ("HEADERS on stream 0", headers(0), ErrorCode.PROTOCOL_ERROR),
    ("PRIORITY on stream 0", f.frame(f.PRIORITY, 0, 0, U32(3) + b"\x10"), ErrorCode.PROTOCOL_ERROR),
    ("RST_STREAM on stream 0", f.rst_stream(0, ErrorCode.CANCEL), ErrorCode.PROTOCOL_ERROR),
    ("PING on a stream", headers(1) + f.frame(f.PING, 0, 1, b"\0" * 8), ErrorCode.PROTOCOL_ERROR),
    ("SETTINGS on a stream", headers(1) + f.frame(f.SETTINGS, 0, 1), ErrorCode.PROTOCOL_ERROR),
    ("GOAWAY on a stream", headers(1) + f.frame(f.GOAWAY, 0, 1, U32(0) + U32(0)), ErrorCode.PROTOCOL_ERROR),
    ("3-byte WINDOW_UPDATE", f.frame(f.WINDOW_UPDATE, 0, 0, b"\0\0\1"), ErrorCode.FRAME_SIZE_ERROR),
    ("2-byte RST_STREAM", headers(1) + f.frame(f.RST_STREAM, 0, 1, b"\0\0"), ErrorCode.FRAME_SIZE_ERROR),
    ("SETTINGS ACK with a payload", f.frame(f.SETTINGS, f.ACK, 0, b"\0" * 6), ErrorCode.FRAME_SIZE_ERROR),
    ("SETTINGS of 7 bytes", f.frame(f.SETTINGS, 0, 0, b"\0" * 7), ErrorCode.FRAME_SIZE_ERROR),
    ("ENABLE_PUSH 2", f.settings({Setting.ENABLE_PUSH: 2}), ErrorCode.PROTOCOL_ERROR),
    ("INITIAL_WINDOW_SIZE 2^31", f.settings({Setting.INITIAL_WINDOW_SIZE: 2**31}), ErrorCode.FLOW_CONTROL_ERROR),
    ("MAX_FRAME_SIZE below 16384", f.settings({Setting.MAX_FRAME_SIZE: 16_383}), ErrorCode.PROTOCOL_ERROR),
    ("MAX_FRAME_SIZE over 2^24-1", f.settings({Setting.MAX_FRAME_SIZE: 2**24}), ErrorCode.PROTOCOL_ERROR),
    ("7-byte PING", f.frame(f.PING, 0, 0, b"\0" * 7), ErrorCode.FRAME_SIZE_ERROR),
    ("7-byte GOAWAY", f.frame(f.GOAWAY, 0, 0, b"\0" * 7), ErrorCode.FRAME_SIZE_ERROR),
    ("WINDOW_UPDATE of 0 on the connection", f.window_update(0, 0), ErrorCode.PROTOCOL_ERROR),
    ("WINDOW_UPDATE past 2^31-1 on the connection", f.window_update(0, 2**31 - 1), ErrorCode.FLOW_CONTROL_ERROR),
    ("DATA on an idle stream", data(1, message(b"x")), ErrorCode.PROTOCOL_ERROR),
    ("RST_STREAM on an idle stream", f.rst_stream(1, ErrorCode.CANCEL), ErrorCode.PROTOCOL_ERROR),
    ("WINDOW_UPDATE on an idle stream", f.window_update(1, 1), ErrorCode.PROTOCOL_ERROR),
    ("a client opening an even stream", headers(2), ErrorCode.PROTOCOL_ERROR),
    ("a lower stream id after a higher", headers(5) + headers(3), ErrorCode.PROTOCOL_ERROR),
    ("CONTINUATION without HEADERS", f.frame(f.CONTINUATION, f.END_HEADERS, 1, b""), ErrorCode.PROTOCOL_ERROR),
    (
        "a header block interrupted",
        headers(1, end_headers=False) + f.frame(f.PING, 0, 0, b"\0" * 8),
        ErrorCode.PROTOCOL_ERROR,
    ),
    (
        "CONTINUATION of another stream",
        headers(1, end_headers=False) + f.frame(f.CONTINUATION, f.END_HEADERS, 3, b""),
        ErrorCode.PROTOCOL_ERROR,
    ),
    ("PUSH_PROMISE", headers(1) + f.frame(f.PUSH_PROMISE, f.END_HEADERS, 1, U32(2)), ErrorCode.PROTOCOL_ERROR),
    ("a frame over SETTINGS_MAX_FRAME_SIZE", data(1, b"x" * 16_385), ErrorCode.FRAME_SIZE_ERROR),
    (
        "an undecodable header block",
        f.frame(f.HEADERS, f.END_HEADERS, 1, b"\xff\xff\xff\xff"),
        ErrorCode.COMPRESSION_ERROR,
    ),
    (
        "DATA padding longer than the frame",
        headers(1) + f.frame(f.DATA, f.PADDED, 1, b"\x09abc"),
        ErrorCode.PROTOCOL_ERROR,
    ),
    (
        "HEADERS padding longer than the frame",
        f.frame(f.HEADERS, f.PADDED | f.END_HEADERS, 1, b"\x09abc"),
        ErrorCode.PROTOCOL_ERROR,
    ),
]


@pytest.mark.parametrize(
    ("frames", "code"), [(fr, c) for _, fr, c in CONNECTION_ERRORS], ids=[name for name, _, _ in CONNECTION_ERRORS]
)
def test_a_connection_error_is_goaway_with_the_rfcs_code(frames: bytes, code: int) -> None:
    server = raw_server()
    events = server.receive(frames)
    assert isinstance(events[-1], ConnectionTerminated) and not events[-1].remote
    assert events[-1].error_code == code
    assert goaway_code(server) == code
    assert server.closed and not server.wants_to_read
    assert server.receive(headers(101)) == []  # nothing more is read


def test_a_connection_that_does_not_start_with_the_preface_is_refused() -> None:
    server = Connection(role=Role.SERVER)
    server.data_to_send()
    events = server.receive(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    assert [e.error_code for e in events if isinstance(e, ConnectionTerminated)] == [ErrorCode.PROTOCOL_ERROR]


def test_a_first_frame_other_than_settings_is_a_connection_error() -> None:
    server = Connection(role=Role.SERVER)
    server.receive(f.CONNECTION_PREFACE + f.frame(f.PING, 0, 0, b"\0" * 8))
    assert goaway_code(server) == ErrorCode.PROTOCOL_ERROR


def test_data_past_the_connection_window_is_a_flow_control_error() -> None:
    server = raw_server(limits=Limits(connection_window_size=f.DEFAULT_WINDOW, initial_window_size=2**20))
    wire = headers(1) + b"".join(data(1, b"\0" * 16_000) for _ in range(5))  # 80,000 > 65,535
    server.receive(wire)
    assert goaway_code(server) == ErrorCode.FLOW_CONTROL_ERROR


def test_a_client_must_not_accept_a_server_opened_stream_or_push() -> None:
    client = Connection(role=Role.CLIENT)
    client.data_to_send()
    client.receive(f.settings({}) + headers(2, RESPONSE))
    assert goaway_code(client) == ErrorCode.PROTOCOL_ERROR
    client = Connection(role=Role.CLIENT)
    client.receive(f.settings({Setting.ENABLE_PUSH: 1}))
    assert goaway_code(client) == ErrorCode.PROTOCOL_ERROR


def test_a_client_resets_a_malformed_response_and_data_before_headers() -> None:
    client = Connection(role=Role.CLIENT)
    first, second = client.open_stream(), client.open_stream()
    client.send_headers(first, REQUEST)
    client.send_headers(second, REQUEST)
    client.data_to_send()
    events = client.receive(
        f.settings({}) + headers(first, [(b"content-type", b"application/grpc")]) + data(second, message(b"x"))
    )
    assert [(e.stream_id, e.error_code) for e in events if isinstance(e, StreamReset)] == [
        (first, ErrorCode.PROTOCOL_ERROR),
        (second, ErrorCode.PROTOCOL_ERROR),
    ]
    assert "without :status" in events[0].reason  # type: ignore[union-attr]
    assert not client.closed


# -- stream errors ------------------------------------------------------------------------------------

STREAM_ERRORS: list[tuple[str, bytes, int]] = [
    (
        "DATA after the stream's END_STREAM",
        headers(1, end_stream=True) + data(1, message(b"x")),
        ErrorCode.STREAM_CLOSED,
    ),
    (
        "HEADERS after the stream's END_STREAM",
        headers(1, end_stream=True) + headers(1, [(b"x", b"y")], end_stream=True),
        ErrorCode.STREAM_CLOSED,
    ),
    ("WINDOW_UPDATE of 0 on a stream", headers(1) + f.window_update(1, 0), ErrorCode.PROTOCOL_ERROR),
    ("WINDOW_UPDATE past 2^31-1 on a stream", headers(1) + f.window_update(1, 2**31 - 1), ErrorCode.FLOW_CONTROL_ERROR),
    ("4-byte PRIORITY", headers(1) + f.frame(f.PRIORITY, 0, 1, U32(0)), ErrorCode.FRAME_SIZE_ERROR),
    ("PRIORITY on itself", headers(1) + f.frame(f.PRIORITY, 0, 1, U32(1) + b"\x10"), ErrorCode.PROTOCOL_ERROR),
    (
        "HEADERS depending on itself",
        f.frame(f.HEADERS, f.END_HEADERS | f.PRIORITY_FLAG, 1, U32(1) + b"\x10" + f.header_block(REQUEST)),
        ErrorCode.PROTOCOL_ERROR,
    ),
    ("trailers without END_STREAM", headers(1) + headers(1, [(b"x", b"y")]), ErrorCode.PROTOCOL_ERROR),
    (
        "DATA after the trailers",
        headers(1) + headers(1, [(b"x", b"y")], end_stream=True) + data(1, b""),
        ErrorCode.STREAM_CLOSED,
    ),
]
MALFORMED_REQUESTS: list[tuple[str, list[tuple[bytes, bytes]]]] = [
    ("an uppercase header name", [*REQUEST, (b"X-Trace", b"1")]),
    ("a connection header", [*REQUEST, (b"connection", b"keep-alive")]),
    ("a transfer-encoding header", [*REQUEST, (b"transfer-encoding", b"chunked")]),
    ("te other than trailers", [*REQUEST[:-1], (b"te", b"gzip")]),
    ("a pseudo-header after a regular one", [*REQUEST[1:], REQUEST[0]]),
    ("a duplicate pseudo-header", [*REQUEST[:3], (b":path", b"/other"), *REQUEST[3:]]),
    ("an unknown pseudo-header", [(b":protocol", b"x"), *REQUEST]),
    ("a response pseudo-header in a request", [(b":status", b"200"), *REQUEST]),
    ("no :path", [h for h in REQUEST if h[0] != b":path"]),
    ("no :method", [h for h in REQUEST if h[0] != b":method"]),
    ("an empty :path", [(b":path", b"") if h[0] == b":path" else h for h in REQUEST]),
    ("a value with a newline", [*REQUEST, (b"x-a", b"1\r\nx-b: 2")]),
    ("a value with surrounding space", [*REQUEST, (b"x-a", b" 1")]),
    ("an empty header name", [*REQUEST, (b"", b"1")]),
]
STREAM_ERRORS += [(name, headers(1, fields), ErrorCode.PROTOCOL_ERROR) for name, fields in MALFORMED_REQUESTS]
STREAM_ERRORS.append(
    (
        "a pseudo-header in trailers",
        headers(1) + headers(1, [(b":path", b"/x")], end_stream=True),
        ErrorCode.PROTOCOL_ERROR,
    )
)


@pytest.mark.parametrize(
    ("frames", "code"), [(fr, c) for _, fr, c in STREAM_ERRORS], ids=[name for name, _, _ in STREAM_ERRORS]
)
def test_a_stream_error_is_rst_stream_with_the_rfcs_code_and_the_connection_goes_on(frames: bytes, code: int) -> None:
    server = raw_server()
    events = server.receive(frames)
    assert StreamReset(1, code, False, events[-1].reason) == events[-1]  # type: ignore[union-attr]
    assert resets(server.data_to_send()) == {1: code}
    assert not server.closed
    later = server.receive(headers(3, end_stream=True))
    assert [type(e) for e in later] == [HeadersReceived, StreamEnded]


def test_a_stream_error_reset_stream_ignores_the_frames_already_in_flight() -> None:
    server = raw_server()
    server.receive(headers(1, [*REQUEST, (b"connection", b"close")]))
    server.data_to_send()
    assert server.receive(data(1, message(b"late")) + f.window_update(1, 5)) == []
    assert server.data_to_send() == b""  # not answered: the peer had not seen our RST_STREAM yet


def test_data_past_a_streams_window_resets_the_stream() -> None:
    server = raw_server(limits=Limits(initial_window_size=f.DEFAULT_WINDOW))
    server.receive(headers(1) + b"".join(data(1, b"\0" * 16_384) for _ in range(4)))
    assert resets(server.data_to_send()) == {1: ErrorCode.FLOW_CONTROL_ERROR}
    assert not server.closed


def test_a_peer_reset_ends_the_stream_and_is_reported() -> None:
    server = raw_server()
    events = server.receive(headers(1) + f.rst_stream(1, ErrorCode.CANCEL))
    assert events[-1] == StreamReset(1, ErrorCode.CANCEL, True, "reset by the peer (error code 8)")
    assert server.open_streams == 0


# -- limits -------------------------------------------------------------------------------------------


def test_rapid_reset_is_answered_with_enhance_your_calm() -> None:
    clock = FakeClock()
    server = raw_server(limits=Limits(reset_burst=10, reset_rate=1.0), clock=clock)
    wire = b"".join(headers(s) + f.rst_stream(s, ErrorCode.CANCEL) for s in range(1, 21, 2))  # 10 resets
    server.receive(wire)
    assert not server.closed
    clock.now += 2.0  # two tokens back
    server.receive(b"".join(headers(s) + f.rst_stream(s, ErrorCode.CANCEL) for s in (21, 23)))
    assert not server.closed
    server.receive(headers(25) + f.rst_stream(25, ErrorCode.CANCEL))
    assert goaway_code(server) == ErrorCode.ENHANCE_YOUR_CALM


def test_a_settings_flood_is_answered_with_enhance_your_calm() -> None:
    clock = FakeClock()
    # The preface's SETTINGS took one token of the five.
    server = raw_server(limits=Limits(settings_burst=5, settings_rate=1.0), clock=clock)
    server.receive(f.settings({}) * 4)
    assert not server.closed
    clock.now += 1.0  # one token back
    server.receive(f.settings({}))
    assert not server.closed
    server.receive(f.settings({}))
    assert goaway_code(server) == ErrorCode.ENHANCE_YOUR_CALM


def test_rapid_reset_with_default_limits_ends_within_the_nghttp2_burst() -> None:
    server = raw_server()
    wire = b"".join(headers(s) + f.rst_stream(s, ErrorCode.CANCEL) for s in range(1, 4002, 2))  # 2,001 resets
    events = server.receive(wire)
    terminated = [e for e in events if isinstance(e, ConnectionTerminated)]
    assert [e.error_code for e in terminated] == [ErrorCode.ENHANCE_YOUR_CALM]
    assert sum(isinstance(e, StreamReset) for e in events) == Limits().reset_burst


def test_streams_our_errors_reset_count_as_resets_too() -> None:
    server = raw_server(limits=Limits(reset_burst=5, reset_rate=0.001))
    server.receive(b"".join(headers(s, [*REQUEST, (b"connection", b"x")]) for s in range(1, 13, 2)))
    assert goaway_code(server) == ErrorCode.ENHANCE_YOUR_CALM


def test_refused_streams_count_as_resets_and_so_do_the_peers_resets_of_them() -> None:
    server = raw_server(limits=Limits(max_concurrent_streams=1, reset_burst=6, reset_rate=0.001))
    server.receive(headers(1))  # held open: every stream after it is refused
    server.receive(b"".join(headers(s) + f.rst_stream(s, ErrorCode.CANCEL) for s in (3, 5, 7)))  # 3 x 2 tokens
    assert not server.closed
    server.receive(headers(9))
    assert goaway_code(server) == ErrorCode.ENHANCE_YOUR_CALM


def test_empty_data_frames_in_a_row_are_a_flood() -> None:
    server = raw_server()
    server.receive(headers(1) + headers(3) + data(1, b"") + data(1, message(b"x")) + data(1, b""))
    assert not server.closed  # one at a time, between frames with data
    server.receive(data(3, b"", end_stream=True) + data(1, b""))
    assert not server.closed  # an empty frame with END_STREAM means something
    server.receive(data(1, b""))
    assert goaway_code(server) == ErrorCode.ENHANCE_YOUR_CALM


def test_a_continuation_flood_is_cut_at_the_frame_limit_without_buffering_it() -> None:
    server = raw_server()
    flood = headers(1, end_headers=False) + b"".join(
        f.frame(f.CONTINUATION, 0, 1, b"\0" * 100) for _ in range(Limits().max_continuation_frames + 1)
    )
    events = server.receive(flood)
    assert [e.error_code for e in events if isinstance(e, ConnectionTerminated)] == [ErrorCode.ENHANCE_YOUR_CALM]


def test_a_header_block_over_the_size_limit_is_enhance_your_calm() -> None:
    server = raw_server(limits=Limits(max_header_block_size=20_000, max_continuation_frames=100))
    big = (
        headers(1, end_headers=False)
        + f.frame(f.CONTINUATION, 0, 1, b"\0" * 16_000)
        + f.frame(f.CONTINUATION, 0, 1, b"\0" * 16_000)
    )
    server.receive(big)
    assert goaway_code(server) == ErrorCode.ENHANCE_YOUR_CALM


def test_a_header_list_that_decodes_past_its_limit_is_enhance_your_calm() -> None:
    server = raw_server(limits=Limits(max_header_list_size=1_000))
    server.receive(headers(1, [*REQUEST, (b"x-big", b"v" * 2_000)]))
    assert goaway_code(server) == ErrorCode.ENHANCE_YOUR_CALM


@pytest.mark.parametrize(("updates", "allowed"), [(2, True), (3, False), (10_000, False)])
def test_hpack_table_size_updates_per_block_are_limited(updates: int, allowed: bool) -> None:
    server = raw_server()
    block = f.table_size_update(0) * updates + f.header_block(REQUEST)
    started = time.perf_counter()
    events = server.receive(f.frame(f.HEADERS, f.END_HEADERS, 1, block[:16_384]))
    assert time.perf_counter() - started < 1.0
    if allowed:
        assert isinstance(events[0], HeadersReceived)
    else:
        assert goaway_code(server) == ErrorCode.ENHANCE_YOUR_CALM


@pytest.mark.parametrize(("entries", "allowed"), [(32, True), (33, False), (2_000, False)])
def test_settings_with_too_many_entries_is_enhance_your_calm(entries: int, allowed: bool) -> None:
    server = raw_server()
    payload = struct.pack(">HL", Setting.MAX_CONCURRENT_STREAMS, 10) * entries
    server.receive(f.frame(f.SETTINGS, 0, 0, payload[: 16_384 - 16_384 % 6]))
    assert (goaway_code(server) is None) == allowed


@pytest.mark.parametrize("flood", [f.frame(f.PING, 0, 0, b"\0" * 8), f.settings({})], ids=["PING", "SETTINGS"])
def test_a_control_frame_flood_from_a_peer_that_does_not_read_ends_the_connection(flood: bytes) -> None:
    # SETTINGS also have a rate limit of their own (test_a_settings_flood_...): lifted here, to see
    # the rule about control frames owed to a peer that does not read.
    limits = Limits(settings_burst=1_000_000)
    limit = limits.max_queued_control_frames
    reading = raw_server(limits=limits)
    for _ in range(3):
        reading.receive(flood * limit)
        reading.data_to_send()  # a peer that reads: its ACKs are written as they come
    assert not reading.closed
    stuck = raw_server(limits=limits)
    stuck.writing_paused = True
    stuck.receive(flood * (limit // 2))
    stuck.data_to_send()  # into a socket buffer that does not drain: still owed
    stuck.receive(flood * (limit - limit // 2))
    assert not stuck.closed
    events = stuck.receive(flood)
    assert [e.error_code for e in events if isinstance(e, ConnectionTerminated)] == [ErrorCode.ENHANCE_YOUR_CALM]


def test_responses_owed_to_a_peer_that_grants_no_window_end_the_connection() -> None:
    limits = Limits(max_owed_bytes=1_000_000)
    stuck = raw_server(limits=limits, settings={Setting.INITIAL_WINDOW_SIZE: 0})
    stuck.receive(headers(1))
    stuck.send_headers(1, RESPONSE)
    body = b"r" * 10_000
    sent = 0
    while not stuck.closed and sent < 1_000:
        stuck.send_message(1, body)
        sent += 1
    assert stuck.closed and 90 <= sent <= 100, sent  # each owes 10,005 bytes and its two pieces
    assert stuck.terminated is not None and "Limits.max_owed_bytes" in stuck.terminated.reason
    assert goaway_code(stuck) == ErrorCode.ENHANCE_YOUR_CALM


def test_a_peer_that_reads_what_it_is_owed_never_reaches_the_owed_limit() -> None:
    # Small windows: every message waits in its stream, and leaves it as the client consumes.
    pair = Pair(client_limits=Limits(initial_window_size=20_000), server_limits=Limits(max_owed_bytes=300_000))
    stream = pair.client.open_stream()
    pair.client.send_headers(stream, REQUEST)
    pair.pump()
    pair.server.send_headers(stream, RESPONSE)
    for _ in range(200):  # 20 MB in all, 100 KB at a time
        pair.server.send_message(stream, b"r" * 100_000)
        pair.pump()
        for event in pair.client_events:
            if isinstance(event, MessageReceived):
                pair.client.acknowledge(event.stream_id, event.flow_controlled_length)
        pair.client_events.clear()
        pair.pump()
    assert not pair.server.closed and pair.server.terminated is None


def test_data_waits_while_the_peer_does_not_read_and_the_peer_is_still_read() -> None:
    server = raw_server()
    server.receive(headers(1))
    server.send_headers(1, RESPONSE)
    server.data_to_send()
    server.writing_paused = True
    assert server.wants_to_read  # what must end the connection is seen (a flood, an error)
    server.send_message(1, b"r" * 50)
    assert server.data_to_send() == b""  # the DATA waits for the peer to read
    server.receive(data(1, b"") * 2)
    assert goaway_code(server) == ErrorCode.ENHANCE_YOUR_CALM
    assert not server.wants_to_read


def test_messages_queued_for_a_peer_that_does_not_read_are_bounded() -> None:
    server = raw_server(limits=Limits(max_queued_messages=3))
    server.receive(headers(1))
    server.send_headers(1, RESPONSE)
    server.writing_paused = True
    for _ in range(3):
        server.send_message(1, b"r" * 50)
    server.resume_writing()  # the peer read: the count starts again
    assert b"".join(p for k, _, _, p in parse_frames(server.data_to_send()) if k == f.DATA) == message(b"r" * 50) * 3
    server.writing_paused = True
    for _ in range(3):
        server.send_message(1, b"r" * 50)
    assert not server.closed
    server.send_message(1, b"r" * 50)
    assert server.closed and server.terminated is not None
    assert server.terminated.error_code == ErrorCode.ENHANCE_YOUR_CALM
    assert goaway_code(server) == ErrorCode.ENHANCE_YOUR_CALM


def test_streams_past_max_concurrent_streams_are_refused_and_the_others_go_on() -> None:
    server = raw_server(limits=Limits(max_concurrent_streams=2))
    events = server.receive(headers(1) + headers(3) + headers(5))
    assert [e.stream_id for e in events if isinstance(e, HeadersReceived)] == [1, 3]
    assert resets(server.data_to_send()) == {5: ErrorCode.REFUSED_STREAM}
    events = server.receive(data(1, message(b"still here")))
    assert [e.data for e in events if isinstance(e, MessageReceived)] == [b"still here"]


def test_the_server_announces_its_limits_in_its_settings() -> None:
    limits = Limits(max_concurrent_streams=7, initial_window_size=12_345, max_header_list_size=4_321)
    server = Connection(role=Role.SERVER, limits=limits)
    (kind, _, _, payload), *_ = parse_frames(server.data_to_send())
    assert kind == f.SETTINGS
    assert dict(f.parse_settings(payload)) == {
        Setting.MAX_CONCURRENT_STREAMS: 7,
        Setting.INITIAL_WINDOW_SIZE: 12_345,
        Setting.MAX_HEADER_LIST_SIZE: 4_321,
        Setting.ENABLE_PUSH: 0,
    }


def test_a_message_over_the_size_limit_is_rejected_before_it_is_buffered() -> None:
    server = raw_server(limits=Limits(max_message_size=1_000))
    events = server.receive(headers(1) + data(1, f.grpc_prefix(1_001) + b"x" * 500))
    rejected = [e for e in events if isinstance(e, MessageRejected)]
    assert [(e.stream_id, e.grpc_status) for e in rejected] == [(1, GrpcStatus.RESOURCE_EXHAUSTED)]
    assert "1001" in rejected[0].reason and "Limits.max_message_size" in rejected[0].reason
    # the rest of the stream's data is discarded, and its window comes back
    events = server.receive(data(1, b"x" * 501 + message(b"next"), end_stream=True))
    assert [type(e) for e in events] == [StreamEnded]


def test_the_default_message_limit_is_grpc_cores_4_mib() -> None:
    assert Limits().max_message_size == 4 * 1024 * 1024


def test_a_compressed_message_is_rejected_as_unimplemented() -> None:
    server = raw_server()
    events = server.receive(headers(1) + data(1, f.grpc_prefix(3, compressed=True) + b"abc"))
    assert events[-1] == MessageRejected(1, GrpcStatus.UNIMPLEMENTED, events[-1].reason)  # type: ignore[union-attr]


def test_message_reassembly_is_linear_in_the_bytes_received() -> None:
    """The attack the transport is hardened against: a large message, then thousands of one-byte frames. Re-copying the
    partial message on every frame takes seconds; appending takes milliseconds."""
    size = 4 * 1024 * 1024
    limits = Limits(initial_window_size=2 * size, connection_window_size=2 * size)
    server = raw_server(limits=limits)
    body = b"\7" * size
    wire = f.grpc_prefix(size) + body
    head, tail = wire[:-8_000], wire[-8_000:]
    server.receive(headers(1) + b"".join(data(1, head[i : i + 16_384]) for i in range(0, len(head), 16_384)))
    one_byte_frames = b"".join(data(1, tail[i : i + 1]) for i in range(len(tail)))
    started = time.perf_counter()
    events = server.receive(one_byte_frames)
    elapsed = time.perf_counter() - started
    assert [len(e.data) for e in events if isinstance(e, MessageReceived)] == [size]
    assert elapsed < 1.0, f"8,000 one-byte frames onto a 4 MiB message took {elapsed:.2f} s"


def test_a_message_trickled_in_one_byte_frames_is_held_in_about_its_own_size() -> None:
    """A peer sending a large message a byte per DATA frame must not make the server keep an
    object per byte (tens of bytes each): the partial message stays about as large as it is."""
    import tracemalloc

    size = 200_000
    limits = Limits(initial_window_size=2 * size, connection_window_size=2 * size)
    server = raw_server(limits=limits)
    wire = f.grpc_prefix(size + 1) + b"\7" * size  # one byte short: held, not delivered
    frames = headers(1) + data(1, wire[:16_000]) + b"".join(data(1, wire[i : i + 1]) for i in range(16_000, len(wire)))
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for start in range(0, len(frames), 65_536):
            assert not [e for e in server.receive(frames[start : start + 65_536]) if isinstance(e, MessageReceived)]
            server.data_to_send()  # (the window updates we owe: read, as a well-behaved peer does)
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert held < 2 * size + 100_000, f"{held:,} bytes held for a {size:,}-byte partial message"
    assert [len(e.data) for e in server.receive(data(1, b"\7")) if isinstance(e, MessageReceived)] == [size + 1]


# -- what the adapter's time-outs read ---------------------------------------------------------------


def test_the_preface_is_received_only_with_the_magic_and_the_first_settings() -> None:
    server = Connection(role=Role.SERVER)
    assert not server.preface_received
    server.receive(f.CONNECTION_PREFACE[:10])
    assert not server.preface_received
    server.receive(f.CONNECTION_PREFACE[10:])
    assert not server.preface_received  # the magic alone is not the preface (RFC 9113 section 3.4)
    settings = f.settings({})
    server.receive(settings[:5])
    assert not server.preface_received
    server.receive(settings[5:])
    assert server.preface_received
    assert not [e for e in server.receive(f.frame(f.PING, 0, 0, b"\0" * 8)) if isinstance(e, ConnectionTerminated)]


def test_last_peer_stream_tells_streams_that_came_and_went() -> None:
    pair = Pair()
    assert pair.server.last_peer_stream == 0 and pair.server.open_streams == 0
    stream_id = pair.client.open_stream()
    pair.client.send_headers(stream_id, REQUEST, end_stream=True)
    pair.pump()
    pair.server.send_headers(stream_id, [*RESPONSE, (b"grpc-status", b"0")], end_stream=True)
    pair.pump()
    # No stream open before or after, but one was opened in between: not idle all along.
    assert pair.server.open_streams == 0
    assert pair.server.last_peer_stream == stream_id
