"""RFC 9113 rules a broken or hostile peer can trip, each answered with the error the RFC names.

Each test sends one offending frame sequence on a raw connection to ``pilotfish serve`` and then a
PING (:meth:`RawClient.barrier`): by the time its ACK is back (or the connection is gone), the
server has answered the offence. A *connection error* must be a GOAWAY with the RFC's code and the
end of the connection; a *stream error* an RST_STREAM with the code on that stream (a GOAWAY with
the same code is accepted too: an implementation may treat a stream error as a connection error).
Meanwhile the good client (grpcio) must get the change made during the test, the server write no
traceback and its memory stay bounded (:meth:`Target.harm`).

These tests share one server per module (started again when a test leaves it dead or with a
traceback): each is cheap, and the server must not be changed by any of them.
"""

from __future__ import annotations

import struct

import pytest

from .target import Target, discovery_request
from .wire import (
    ACK,
    END_HEADERS,
    END_STREAM,
    FrameType,
    H2Code,
    RawClient,
    frame,
    grpc_message,
    headers_frame,
    literal_block,
    request_headers,
    rst_stream,
    settings_frame,
    window_update,
)

MAX_WINDOW = 2**31 - 1
OPEN_1 = headers_frame(1)
"""Stream 1 opened with a valid gRPC request's headers, the client's side still open."""
REQUEST_1 = OPEN_1 + frame(FrameType.DATA, 0, 1, grpc_message(discovery_request()))
"""Stream 1 opened and its first xDS request sent (the server answers it and watches)."""


def connection_error(client: RawClient, code: int) -> list[str]:
    """Problems unless the server sent GOAWAY with ``code`` and closed the connection."""
    client.barrier()
    goaway = client.got.goaway
    if goaway is None or goaway.code != code:
        return [f"expected a connection error {H2Code.name(code)} (GOAWAY, then close); " + client.got.describe()]
    if client.wait_for(lambda got: got.closed is not None, timeout=5.0) is None:
        return [f"{goaway} was sent, but the connection stayed open"]
    return []


def stream_error(client: RawClient, stream_id: int, code: int) -> list[str]:
    """Problems unless the server reset ``stream_id`` with ``code`` (or sent GOAWAY with it)."""
    client.barrier()
    got = client.got
    if got.resets.get(stream_id) == code or (got.goaway is not None and got.goaway.code == code):
        return []
    return [f"expected a stream error {H2Code.name(code)} on stream {stream_id} (RST_STREAM); " + got.describe()]


def attack(target: Target, offence: bytes, *, preface: bool = True) -> RawClient:
    """Connect, make the change the good client must get, send ``offence``."""
    client = target.attacker(preface=preface).start_reader()
    target.change_snapshot()
    client.send(offence)
    return client


# -- connection errors: (offence, RFC 9113 error code) --------------------------------------------

CONNECTION_ERRORS = [
    pytest.param(frame(FrameType.DATA, 0, 0, b"x"), H2Code.PROTOCOL_ERROR, id="DATA-on-stream-0"),
    pytest.param(frame(FrameType.PRIORITY, 0, 0, b"\0\0\0\3\x10"), H2Code.PROTOCOL_ERROR, id="PRIORITY-on-stream-0"),
    pytest.param(rst_stream(0, H2Code.CANCEL), H2Code.PROTOCOL_ERROR, id="RST_STREAM-on-stream-0"),
    pytest.param(frame(FrameType.PING, 0, 1, b"12345678"), H2Code.PROTOCOL_ERROR, id="PING-on-a-stream"),
    pytest.param(settings_frame([], stream_id=1), H2Code.PROTOCOL_ERROR, id="SETTINGS-on-a-stream"),
    pytest.param(
        frame(FrameType.GOAWAY, 0, 1, struct.pack(">II", 0, 0)), H2Code.PROTOCOL_ERROR, id="GOAWAY-on-a-stream"
    ),
    pytest.param(headers_frame(0), H2Code.PROTOCOL_ERROR, id="HEADERS-on-stream-0"),
    pytest.param(
        frame(FrameType.CONTINUATION, END_HEADERS, 1, literal_block(request_headers())),
        H2Code.PROTOCOL_ERROR,
        id="CONTINUATION-without-HEADERS",
    ),
    pytest.param(
        frame(FrameType.HEADERS, 0, 1, literal_block(request_headers())) + frame(FrameType.PING, 0, 0, b"x" * 8),
        H2Code.PROTOCOL_ERROR,
        id="header-block-interrupted",
    ),
    pytest.param(headers_frame(2), H2Code.PROTOCOL_ERROR, id="even-stream-id-from-a-client"),
    pytest.param(headers_frame(5) + headers_frame(3), H2Code.PROTOCOL_ERROR, id="lower-stream-id-after-higher"),
    pytest.param(frame(FrameType.DATA, 0, 7, b"x"), H2Code.PROTOCOL_ERROR, id="DATA-on-an-idle-stream"),
    pytest.param(
        frame(FrameType.PUSH_PROMISE, END_HEADERS, 1, b"\0\0\0\2"),
        H2Code.PROTOCOL_ERROR,
        id="PUSH_PROMISE-from-a-client",
    ),
    pytest.param(window_update(0, MAX_WINDOW), H2Code.FLOW_CONTROL_ERROR, id="connection-window-over-2^31-1"),
    pytest.param(window_update(0, 0), H2Code.PROTOCOL_ERROR, id="WINDOW_UPDATE-of-0-on-the-connection"),
    pytest.param(frame(FrameType.WINDOW_UPDATE, 0, 0, b"\0\0\1"), H2Code.FRAME_SIZE_ERROR, id="3-byte-WINDOW_UPDATE"),
    pytest.param(frame(FrameType.PING, 0, 0, b"1234567"), H2Code.FRAME_SIZE_ERROR, id="7-byte-PING"),
    pytest.param(
        frame(FrameType.SETTINGS, ACK, 0, b"\0\4\0\0\0\1"), H2Code.FRAME_SIZE_ERROR, id="SETTINGS-ACK-with-a-payload"
    ),
    pytest.param(
        frame(FrameType.SETTINGS, 0, 0, b"\0\4\0\0\0"),
        H2Code.FRAME_SIZE_ERROR,
        id="SETTINGS-length-not-a-multiple-of-6",
    ),
    pytest.param(settings_frame([(0x2, 2)]), H2Code.PROTOCOL_ERROR, id="ENABLE_PUSH-of-2"),
    pytest.param(
        settings_frame([(0x4, MAX_WINDOW + 1)]), H2Code.FLOW_CONTROL_ERROR, id="INITIAL_WINDOW_SIZE-over-2^31-1"
    ),
    pytest.param(settings_frame([(0x5, 1000)]), H2Code.PROTOCOL_ERROR, id="MAX_FRAME_SIZE-below-16384"),
    pytest.param(
        OPEN_1 + frame(FrameType.DATA, 0, 1, b"x" * 16_385), H2Code.FRAME_SIZE_ERROR, id="frame-over-MAX_FRAME_SIZE"
    ),
    pytest.param(
        REQUEST_1 + frame(FrameType.RST_STREAM, 0, 1, b"\0\x08"), H2Code.FRAME_SIZE_ERROR, id="2-byte-RST_STREAM"
    ),
]


@pytest.mark.parametrize(("offence", "code"), CONNECTION_ERRORS)
def test_connection_error(shared_target: Target, offence: bytes, code: int, request: pytest.FixtureRequest) -> None:
    client = attack(shared_target, offence)
    shared_target.conclude(request.node.name, connection_error(client, code))


def test_not_a_connection_preface(shared_target: Target, request: pytest.FixtureRequest) -> None:
    client = attack(shared_target, b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n", preface=False)
    problems = []
    if client.wait_for(lambda got: got.closed is not None, timeout=5.0) is None:
        problems.append("an HTTP/1.1 request was not refused (the connection stayed open); " + client.got.describe())
    shared_target.conclude(request.node.name, problems)


# -- stream errors: (offence, stream, RFC 9113 error code) ----------------------------------------


def malformed(headers: list[tuple[bytes, bytes]]) -> bytes:
    """Stream 1 opened with ``headers`` and a whole xDS request: a server that takes the headers
    serves the request (its answer shows in the failure)."""
    return frame(FrameType.HEADERS, END_HEADERS, 1, literal_block(headers)) + frame(
        FrameType.DATA, END_STREAM, 1, grpc_message(discovery_request())
    )


GOOD = request_headers()
PSEUDO = [h for h in GOOD if h[0].startswith(b":")]
REGULAR = [h for h in GOOD if not h[0].startswith(b":")]

STREAM_ERRORS = [
    pytest.param(OPEN_1 + window_update(1, MAX_WINDOW), 1, H2Code.FLOW_CONTROL_ERROR, id="stream-window-over-2^31-1"),
    pytest.param(frame(FrameType.PRIORITY, 0, 3, b"\0\0\0\1"), 3, H2Code.FRAME_SIZE_ERROR, id="4-byte-PRIORITY"),
    pytest.param(
        malformed([*PSEUDO, (b"Content-Type", b"application/grpc"), (b"te", b"trailers")]),
        1,
        H2Code.PROTOCOL_ERROR,
        id="uppercase-header-name",
    ),
    pytest.param(malformed([*GOOD, (b"connection", b"keep-alive")]), 1, H2Code.PROTOCOL_ERROR, id="connection-header"),
    pytest.param(
        malformed([*PSEUDO, (b"content-type", b"application/grpc"), (b"te", b"gzip")]),
        1,
        H2Code.PROTOCOL_ERROR,
        id="te-other-than-trailers",
    ),
    pytest.param(
        malformed([*PSEUDO[:2], *REGULAR, *PSEUDO[2:]]),
        1,
        H2Code.PROTOCOL_ERROR,
        id="pseudo-header-after-a-regular-one",
    ),
    pytest.param(
        malformed([*PSEUDO, (b":path", b"/other"), *REGULAR]), 1, H2Code.PROTOCOL_ERROR, id="duplicate-pseudo-header"
    ),
    pytest.param(malformed([*PSEUDO, (b":foo", b"x"), *REGULAR]), 1, H2Code.PROTOCOL_ERROR, id="unknown-pseudo-header"),
]


@pytest.mark.parametrize(("offence", "stream_id", "code"), STREAM_ERRORS)
def test_stream_error(
    shared_target: Target, offence: bytes, stream_id: int, code: int, request: pytest.FixtureRequest
) -> None:
    client = attack(shared_target, offence)
    shared_target.conclude(request.node.name, stream_error(client, stream_id, code))


def test_data_on_a_closed_stream(shared_target: Target, request: pytest.FixtureRequest) -> None:
    client = attack(shared_target, OPEN_1 + frame(FrameType.DATA, END_STREAM, 1, grpc_message(discovery_request())))
    client.wait_for(lambda got: 1 in got.ended or got.closed is not None, timeout=5.0)
    problems = [] if 1 in client.got.ended else ["stream 1 was not answered and ended; " + client.got.describe()]
    client.send(frame(FrameType.DATA, 0, 1, grpc_message(discovery_request())))
    problems += stream_error(client, 1, H2Code.STREAM_CLOSED)
    shared_target.conclude(request.node.name, problems)


def test_header_blocks_are_cut_at_the_clients_max_frame_size(
    shared_target: Target, request: pytest.FixtureRequest
) -> None:
    # An unknown method of 40 KB: the answer's grpc-message names it, so the trailers are large.
    path = b"/no.such.Service/" + b"m" * 40_000
    client = attack(
        shared_target, headers_frame(1, [(k, path if k == b":path" else v) for k, v in GOOD], end_stream=True)
    )
    client.wait_for(lambda got: 1 in got.ended or 1 in got.resets or got.closed is not None, timeout=5.0)
    problems = []
    if client.got.largest_frame > 16_384:
        problems.append(
            f"a frame of {client.got.largest_frame} bytes was sent, over the client's MAX_FRAME_SIZE of 16,384 (4.2)"
        )
    if not (1 in client.got.ended or 1 in client.got.resets):
        problems.append("the call with a 40 KB path was not ended; " + client.got.describe())
    shared_target.conclude(request.node.name, problems)
