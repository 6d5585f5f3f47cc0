"""Hand-assembled protobuf wire encoding for discovery responses.

Serialize once, send many (DESIGN.md): a response body is the concatenation of encoded fields,
so it is built once per (type, version, subscribed names) and every stream appends only its own
nonce field. Protobuf parsers accept fields in any order, so appending is valid encoding.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["any_bytes", "discovery_response", "length_delimited", "nonce_field"]

# DiscoveryResponse field numbers (envoy/service/discovery/v3/discovery.proto).
_VERSION_INFO = 1
_RESOURCES = 2
_TYPE_URL = 4
_NONCE = 5
# google.protobuf.Any field numbers.
_ANY_TYPE_URL = 1
_ANY_VALUE = 2


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def length_delimited(field: int, payload: bytes) -> bytes:
    """One length-delimited field (wire type 2): tag, length, bytes."""
    return _varint(field << 3 | 2) + _varint(len(payload)) + payload


def any_bytes(type_url: str, value: bytes) -> bytes:
    """An encoded ``google.protobuf.Any`` wrapping an already encoded message."""
    return length_delimited(_ANY_TYPE_URL, type_url.encode()) + length_delimited(_ANY_VALUE, value)


def discovery_response(version: str, type_url: str, resources: Iterable[bytes]) -> bytes:
    """A DiscoveryResponse without its nonce; ``resources`` are encoded Any messages."""
    parts = [length_delimited(_VERSION_INFO, version.encode())]
    parts.extend(length_delimited(_RESOURCES, r) for r in resources)
    parts.append(length_delimited(_TYPE_URL, type_url.encode()))
    return b"".join(parts)


def nonce_field(nonce: str) -> bytes:
    """The nonce field a stream appends to a shared response body."""
    return length_delimited(_NONCE, nonce.encode())
