"""HTTP/2 framing for gRPC: the constants of RFC 9113, frame encoding, the literal HPACK header
blocks a gRPC peer sends, and gRPC's length-prefixed messages.

Pure codecs, no state: the rules of a connection live in :mod:`pilotfish.transport.h2`. Both ends
of pilotfish's own gRPC transport use this module: the server (:mod:`pilotfish.transport.aio`)
and the fleet simulator's client (``bench/h2client.py``).
Header blocks are *sent* as literals that never touch the HPACK dynamic table (so a sender keeps
no HPACK state); they are *received* with the ``hpack`` package's decoder, since a peer may use
Huffman coding and the dynamic table.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable

__all__ = [
    "ACK",
    "CONNECTION_PREFACE",
    "CONTINUATION",
    "DATA",
    "DEFAULT_MAX_FRAME",
    "DEFAULT_WINDOW",
    "END_HEADERS",
    "END_STREAM",
    "FRAME_HEADER_SIZE",
    "GOAWAY",
    "HEADERS",
    "MAX_FRAME_SIZE_LIMIT",
    "MAX_WINDOW",
    "PADDED",
    "PING",
    "PRIORITY",
    "PRIORITY_FLAG",
    "PUSH_PROMISE",
    "RST_STREAM",
    "SETTINGS",
    "WINDOW_UPDATE",
    "ErrorCode",
    "GrpcStatus",
    "Setting",
    "data_frame_header_and_prefix",
    "frame",
    "frame_content",
    "frame_header",
    "goaway",
    "grpc_prefix",
    "header_block",
    "hpack_int",
    "parse_frame_header",
    "parse_grpc_prefix",
    "parse_settings",
    "percent_encode",
    "rst_stream",
    "settings",
    "table_size_update",
    "unpack_u32",
    "window_update",
]

CONNECTION_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"

# Frame types (RFC 9113 section 6).
DATA = 0x0
HEADERS = 0x1
PRIORITY = 0x2
RST_STREAM = 0x3
SETTINGS = 0x4
PUSH_PROMISE = 0x5
PING = 0x6
GOAWAY = 0x7
WINDOW_UPDATE = 0x8
CONTINUATION = 0x9

# Frame flags.
END_STREAM = 0x1
ACK = 0x1  # SETTINGS, PING
END_HEADERS = 0x4
PADDED = 0x8
PRIORITY_FLAG = 0x20

DEFAULT_WINDOW = 65_535
DEFAULT_MAX_FRAME = 16_384
MAX_WINDOW = 2**31 - 1
MAX_FRAME_SIZE_LIMIT = 2**24 - 1
"""The largest SETTINGS_MAX_FRAME_SIZE a peer may announce (RFC 9113 section 6.5.2)."""
FRAME_HEADER_SIZE = 9


class Setting:
    """SETTINGS parameter identifiers."""

    HEADER_TABLE_SIZE = 0x1
    ENABLE_PUSH = 0x2
    MAX_CONCURRENT_STREAMS = 0x3
    INITIAL_WINDOW_SIZE = 0x4
    MAX_FRAME_SIZE = 0x5
    MAX_HEADER_LIST_SIZE = 0x6


class ErrorCode:
    """RST_STREAM / GOAWAY error codes (RFC 9113 section 7)."""

    NO_ERROR = 0x0
    PROTOCOL_ERROR = 0x1
    INTERNAL_ERROR = 0x2
    FLOW_CONTROL_ERROR = 0x3
    SETTINGS_TIMEOUT = 0x4
    STREAM_CLOSED = 0x5
    FRAME_SIZE_ERROR = 0x6
    REFUSED_STREAM = 0x7
    CANCEL = 0x8
    COMPRESSION_ERROR = 0x9
    CONNECT_ERROR = 0xA
    ENHANCE_YOUR_CALM = 0xB
    INADEQUATE_SECURITY = 0xC
    HTTP_1_1_REQUIRED = 0xD


class GrpcStatus:
    """The gRPC status codes pilotfish sends."""

    OK = 0
    CANCELLED = 1
    UNKNOWN = 2
    INVALID_ARGUMENT = 3
    PERMISSION_DENIED = 7
    RESOURCE_EXHAUSTED = 8
    UNIMPLEMENTED = 12
    INTERNAL = 13
    UNAVAILABLE = 14
    UNAUTHENTICATED = 16


# length (24 bits, as a high byte and a low 16-bit word), type, flags, stream id (31 bits)
_FRAME_HEADER = struct.Struct(">BHBBL")
_GRPC_PREFIX = struct.Struct(">BL")
_DATA_AND_PREFIX = struct.Struct(">BHBBLBL")  # a DATA frame's header, then a gRPC message's prefix
_SETTING = struct.Struct(">HL")
_U32 = struct.Struct(">L")
_GOAWAY = struct.Struct(">LL")


def frame_header(length: int, kind: int, flags: int, stream_id: int) -> bytes:
    """The 9-byte header of a frame whose payload is ``length`` bytes."""
    return _FRAME_HEADER.pack(length >> 16, length & 0xFFFF, kind, flags, stream_id)


def parse_frame_header(buffer: bytes | bytearray | memoryview, offset: int) -> tuple[int, int, int, int]:
    """(payload length, type, flags, stream id) of the frame header at ``offset``."""
    high, low, kind, flags, stream_id = _FRAME_HEADER.unpack_from(buffer, offset)
    return (high << 16) | low, kind, flags, stream_id & 0x7FFF_FFFF


def frame(kind: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    """One whole frame."""
    return frame_header(len(payload), kind, flags, stream_id) + payload


def settings(values: dict[int, int]) -> bytes:
    """A SETTINGS frame with ``values`` ({identifier: value})."""
    return frame(SETTINGS, 0, 0, b"".join(_SETTING.pack(k, v) for k, v in values.items()))


def parse_settings(payload: bytes | memoryview) -> list[tuple[int, int]]:
    """The (identifier, value) pairs of a SETTINGS payload (its length must be a multiple of 6)."""
    return [_SETTING.unpack_from(payload, offset) for offset in range(0, len(payload), 6)]


def window_update(stream_id: int, increment: int) -> bytes:
    return frame(WINDOW_UPDATE, 0, stream_id, _U32.pack(increment))


def rst_stream(stream_id: int, code: int) -> bytes:
    return frame(RST_STREAM, 0, stream_id, _U32.pack(code))


def goaway(last_stream_id: int, code: int, debug: bytes = b"") -> bytes:
    return frame(GOAWAY, 0, 0, _GOAWAY.pack(last_stream_id, code) + debug)


def unpack_u32(payload: bytes | memoryview, offset: int = 0) -> int:
    """A 32-bit big-endian value (a WINDOW_UPDATE increment, an error code, a GOAWAY stream id)."""
    value: int = _U32.unpack_from(payload, offset)[0]
    return value


def frame_content(kind: int, flags: int, payload: memoryview) -> memoryview | None:
    """A DATA or HEADERS frame's content: ``payload`` without its padding (PADDED) and, for
    HEADERS, its priority fields (PRIORITY). None when the padding is longer than the frame:
    a connection error (PROTOCOL_ERROR)."""
    start, end = 0, len(payload)
    if flags & PADDED:
        if not end:
            return None
        start, end = 1, end - payload[0]
    if kind == HEADERS and flags & PRIORITY_FLAG:
        start += 5
    return payload[start:end] if start <= end else None


def grpc_prefix(length: int, compressed: bool = False) -> bytes:
    """The 5-byte prefix of a gRPC message of ``length`` bytes."""
    return _GRPC_PREFIX.pack(1 if compressed else 0, length)


def data_frame_header_and_prefix(stream_id: int, length: int) -> bytes:
    """The header of a DATA frame holding exactly one uncompressed gRPC message of ``length``
    bytes, and that message's prefix: 14 bytes, packed at once (the hot path of a push)."""
    size = length + 5
    return _DATA_AND_PREFIX.pack(size >> 16, size & 0xFFFF, DATA, 0, stream_id, 0, length)


def parse_grpc_prefix(buffer: bytes | bytearray | memoryview, offset: int) -> tuple[int, int]:
    """(compressed flag, message length) of the gRPC message prefix at ``offset``."""
    flag, length = _GRPC_PREFIX.unpack_from(buffer, offset)
    return flag, length


def hpack_int(value: int, prefix_bits: int, first_byte: int = 0) -> bytes:
    """An HPACK integer (RFC 7541 section 5.1) with ``first_byte``'s high bits as its pattern."""
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes([first_byte | value])
    out = bytearray([first_byte | limit])
    value -= limit
    while value >= 128:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def header_block(headers: Iterable[tuple[bytes, bytes]]) -> bytes:
    """An HPACK header block of literals without indexing, new names, no Huffman coding: valid for
    any decoder and leaves both dynamic tables as they are, so the sender keeps no HPACK state."""
    out = bytearray()
    for name, value in headers:
        out.append(0x00)
        out += hpack_int(len(name), 7)
        out += name
        out += hpack_int(len(value), 7)
        out += value
    return bytes(out)


def table_size_update(size: int) -> bytes:
    """A dynamic table size update (RFC 7541 section 6.3), owed after the peer changes
    SETTINGS_HEADER_TABLE_SIZE, at the start of the next header block."""
    return hpack_int(size, 5, 0x20)


_UNRESERVED = frozenset(range(0x20, 0x7F)) - {ord("%")}


def percent_encode(message: str) -> bytes:
    """``grpc-message`` encoding: UTF-8, with bytes outside printable ASCII (and ``%``) as %XX."""
    return b"".join(bytes([b]) if b in _UNRESERVED else b"%%%02X" % b for b in message.encode())
