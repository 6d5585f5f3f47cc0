"""HTTP/2 and gRPC framing codecs (pilotfish.transport.frames), against RFC 9113, RFC 7541's
examples and the ``hpack`` package's decoder as an oracle: what either end of pilotfish's own gRPC
transport puts on the wire, a standard peer reads as meant."""

from __future__ import annotations

import hpack
import pytest

from pilotfish.transport import frames as h2


@pytest.mark.parametrize(
    ("value", "prefix", "encoded"),
    [
        (10, 5, b"\x0a"),  # RFC 7541 C.1.1
        (1337, 5, b"\x1f\x9a\x0a"),  # C.1.2
        (42, 8, b"\x2a"),  # C.1.3
        (31, 5, b"\x1f\x00"),  # exactly the prefix's limit: a zero continuation byte
    ],
)
def test_hpack_integers_are_encoded_as_rfc_7541_shows(value: int, prefix: int, encoded: bytes) -> None:
    assert h2.hpack_int(value, prefix) == encoded


def test_a_header_block_of_literals_decodes_as_sent_and_leaves_the_peers_table_empty() -> None:
    headers = [(b":status", b"200"), (b"content-type", b"application/grpc"), (b"x-long", b"v" * 300)]
    decoder = hpack.Decoder()
    assert decoder.decode(h2.header_block(headers), raw=True) == headers
    assert len(decoder.header_table.dynamic_entries) == 0  # nothing for the peer to keep
    decoder.decode(h2.table_size_update(0) + h2.header_block(headers), raw=True)
    assert decoder.header_table.maxsize == 0


def test_frames_and_their_headers_round_trip() -> None:
    encoded = h2.frame(h2.HEADERS, h2.END_HEADERS | h2.END_STREAM, 7, b"block")
    assert len(encoded) == h2.FRAME_HEADER_SIZE + 5
    assert h2.parse_frame_header(encoded, 0) == (5, h2.HEADERS, h2.END_HEADERS | h2.END_STREAM, 7)
    assert h2.parse_frame_header(b"\0" * 3 + encoded, 3) == (5, h2.HEADERS, 5, 7)
    values = {h2.Setting.INITIAL_WINDOW_SIZE: h2.MAX_WINDOW, h2.Setting.MAX_FRAME_SIZE: h2.MAX_FRAME_SIZE_LIMIT}
    length, kind, flags, stream = h2.parse_frame_header(h2.settings(values), 0)
    assert (length, kind, flags, stream) == (12, h2.SETTINGS, 0, 0)
    assert h2.parse_settings(h2.settings(values)[h2.FRAME_HEADER_SIZE :]) == list(values.items())
    update = h2.window_update(3, 1000)
    assert h2.parse_frame_header(update, 0) == (4, h2.WINDOW_UPDATE, 0, 3) and h2.unpack_u32(update, 9) == 1000
    goaway = h2.goaway(5, h2.ErrorCode.ENHANCE_YOUR_CALM, b"too many")
    assert h2.unpack_u32(goaway, 9) == 5 and h2.unpack_u32(goaway, 13) == h2.ErrorCode.ENHANCE_YOUR_CALM
    assert goaway[17:] == b"too many"


def test_grpc_messages_carry_a_five_byte_prefix_with_their_length() -> None:
    assert h2.grpc_prefix(300) == b"\x00\x00\x00\x01\x2c"
    assert h2.parse_grpc_prefix(b"x" + h2.grpc_prefix(70_000, compressed=True), 1) == (1, 70_000)
    header = h2.data_frame_header_and_prefix(9, 300)
    assert h2.parse_frame_header(header, 0) == (305, h2.DATA, 0, 9) and header[9:] == h2.grpc_prefix(300)


def test_grpc_message_is_percent_encoded_as_grpc_says() -> None:
    assert h2.percent_encode("no such type: 50% é") == b"no such type: 50%25 %C3%A9"
    assert h2.percent_encode("line\nbreak") == b"line%0Abreak"


def test_frame_content_strips_padding_and_priority_or_refuses_bad_padding() -> None:
    padded = memoryview(bytes([3]) + b"abc" + b"\0\0\0")
    assert bytes(h2.frame_content(h2.DATA, h2.PADDED, padded) or b"?") == b"abc"
    with_priority = memoryview(bytes([1]) + b"\0\0\0\x01\x10" + b"block" + b"\0")
    assert bytes(h2.frame_content(h2.HEADERS, h2.PADDED | h2.PRIORITY_FLAG, with_priority) or b"?") == b"block"
    assert bytes(h2.frame_content(h2.DATA, 0, memoryview(b"as is")) or b"?") == b"as is"
    assert h2.frame_content(h2.DATA, h2.PADDED, memoryview(bytes([5]) + b"abc")) is None
    assert h2.frame_content(h2.HEADERS, h2.PADDED, memoryview(b"")) is None
