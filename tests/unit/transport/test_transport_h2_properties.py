"""The sans-IO connection against an oracle: the ``h2`` package's state machine (python-hyper).

Hypothesis draws sequences of frames a client might send, well-formed or not, from a vocabulary of
the rules both implementations have; each sequence is fed frame by frame to a server-role
:class:`~pilotfish.transport.h2.Connection` and to an ``h2`` server connection, and both must
find the first connection error at the same frame (or none).

Left out of the vocabulary, because RFC 9113 lets the two differ (and each documents its choice):
malformed request headers and streams past MAX_CONCURRENT_STREAMS (stream errors for pilotfish,
as RFC 9113 section 8.1.1 says; ``h2`` raises a connection-level ProtocolError), PRIORITY frames
of a wrong length (a stream error by section 6.3; ``h2``'s frame parser fails the connection),
GOAWAY (after which ``h2`` refuses all input), and flow-control windows large enough to matter.
"""

from __future__ import annotations

import struct

import h2.config
import h2.connection
import h2.exceptions
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pilotfish.transport import frames as f
from pilotfish.transport.frames import ErrorCode, Setting
from pilotfish.transport.h2 import Connection, ConnectionTerminated, Role

REQUEST = [
    (b":method", b"POST"),
    (b":scheme", b"http"),
    (b":path", b"/pkg.Service/Method"),
    (b":authority", b"pilotfish"),
    (b"content-type", b"application/grpc"),
    (b"te", b"trailers"),
]
STREAMS = st.sampled_from([0, 1, 3, 5])
U32 = struct.Struct(">L").pack


def _flags(end_stream: bool) -> int:
    return f.END_STREAM if end_stream else 0


headers_frames = st.builds(
    lambda sid, end: f.frame(f.HEADERS, f.END_HEADERS | _flags(end), sid, f.header_block(REQUEST)),
    st.sampled_from([1, 3, 5, 7]),
    st.booleans(),
)
# Never empty without END_STREAM: empty DATA frames in a row are a flood pilotfish limits
# (Limits.max_consecutive_empty_frames, as Envoy does) and h2 has no rule for.
data_frames = st.builds(
    lambda sid, payload, end: f.frame(f.DATA, _flags(end or not payload), sid, payload),
    STREAMS,
    st.binary(max_size=8),
    st.booleans(),
)
window_updates = st.builds(
    lambda sid, increment, size: f.frame(f.WINDOW_UPDATE, 0, sid, U32(increment)[:size]),
    STREAMS,
    st.sampled_from([0, 1, 1000, 2**31 - 1]),
    st.sampled_from([4, 4, 3]),
)
rst_streams = st.builds(
    lambda sid, size: f.frame(f.RST_STREAM, 0, sid, U32(ErrorCode.CANCEL)[:size]), STREAMS, st.sampled_from([4, 4, 2])
)
pings = st.builds(
    lambda sid, size, ack: f.frame(f.PING, f.ACK if ack else 0, sid, b"\0" * size),
    st.sampled_from([0, 0, 1]),
    st.sampled_from([8, 8, 7]),
    st.booleans(),
)
setting_entries = st.lists(
    st.sampled_from(
        [
            (Setting.ENABLE_PUSH, 0),
            (Setting.ENABLE_PUSH, 1),
            (Setting.ENABLE_PUSH, 2),
            (Setting.INITIAL_WINDOW_SIZE, 100),
            (Setting.INITIAL_WINDOW_SIZE, 2**31 - 1),
            (Setting.INITIAL_WINDOW_SIZE, 2**31),
            (Setting.MAX_FRAME_SIZE, 16_384),
            (Setting.MAX_FRAME_SIZE, 100),
            (Setting.MAX_FRAME_SIZE, 2**24),
            (Setting.HEADER_TABLE_SIZE, 0),
            (Setting.MAX_CONCURRENT_STREAMS, 10),
        ]
    ),
    max_size=3,
    unique_by=lambda entry: entry[0],
)  # h2 keeps the last value of a repeated one
settings_frames = st.builds(
    lambda sid, ack, entries, extra: f.frame(
        f.SETTINGS,
        f.ACK if ack else 0,
        sid,
        (b"" if ack else b"".join(struct.pack(">HL", k, v) for k, v in entries)) + b"\0" * extra,
    ),
    st.sampled_from([0, 0, 0, 1]),
    st.booleans(),
    setting_entries,
    st.sampled_from([0, 0, 0, 1, 6]),
)
priority_frames = st.builds(
    lambda sid, dependency: f.frame(f.PRIORITY, 0, sid, U32(dependency) + b"\x10"),
    st.sampled_from([0, 1, 3]),
    st.sampled_from([0, 5]),
)
# On a stream that was never opened: h2 ignores any frame on a stream it has reset, even a
# CONTINUATION outside a header block, which RFC 9113 section 6.10 makes a connection error.
strays = st.sampled_from(
    [
        f.frame(f.CONTINUATION, f.END_HEADERS, 9, b""),
        f.frame(f.PUSH_PROMISE, f.END_HEADERS, 9, U32(2) + f.header_block(REQUEST)),
        f.frame(0xA0, 0, 0, b"unknown frame type"),
    ]
)


def _where_both_have_a_rule(frames: list[bytes]) -> list[bytes]:
    """Drop the frames for which RFC 9113 and ``h2`` part ways:

    - a second header block on a stream is trailers, malformed here (pseudo-headers, or no
      END_STREAM): a stream error by section 8.1.1 that ``h2`` makes a connection error;
    - RST_STREAM on an idle stream is a connection error by section 6.4; ``h2`` ignores it;
    - WINDOW_UPDATE of 0 on a stream is a stream error by section 6.9; ``h2`` fails the connection.
    """
    seen: set[int] = set()
    kept = []
    for frame in frames:
        _, kind, _, stream_id = f.parse_frame_header(frame, 0)
        if kind == f.HEADERS:
            if stream_id in seen:
                continue
            seen.add(stream_id)
        elif stream_id and (
            (kind == f.RST_STREAM and stream_id > max(seen, default=0))
            or (kind == f.WINDOW_UPDATE and frame[9:] == b"\0\0\0\0")
        ):
            continue
        kept.append(frame)
    return kept


frame_sequences = st.lists(
    st.one_of(
        headers_frames, data_frames, window_updates, rst_streams, pings, settings_frames, priority_frames, strays
    ),
    max_size=12,
).map(_where_both_have_a_rule)


def first_error_ours(frames: list[bytes]) -> int | None:
    conn = Connection(role=Role.SERVER)
    conn.receive(f.CONNECTION_PREFACE + f.settings({}))
    for index, frame in enumerate(frames):
        if any(isinstance(e, ConnectionTerminated) for e in conn.receive(frame)):
            return index
    return None


def first_error_h2(frames: list[bytes]) -> int | None:
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False, header_encoding=None))
    conn.initiate_connection()
    conn.receive_data(f.CONNECTION_PREFACE + f.settings({}))
    for index, frame in enumerate(frames):
        try:
            conn.receive_data(frame)
        except h2.exceptions.ProtocolError:
            return index
    return None


@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(frame_sequences)
def test_the_same_frames_are_connection_errors_for_pilotfish_and_for_h2(frames: list[bytes]) -> None:
    assert first_error_ours(frames) == first_error_h2(frames)
