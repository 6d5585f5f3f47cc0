"""Hand-assembled protobuf wire encoding for discovery responses.

Serialize once, send many (DESIGN.md): a response body is the concatenation of encoded fields,
so it is built once per (type, version, subscribed names) and every stream appends only its own
nonce field. Protobuf parsers accept fields in any order, so appending is valid encoding.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = [
    "any_bytes",
    "cluster_load_assignment",
    "discovery_response",
    "lb_endpoint",
    "length_delimited",
    "nonce_field",
]

# DiscoveryResponse field numbers (envoy/service/discovery/v3/discovery.proto).
_VERSION_INFO = 1
_RESOURCES = 2
_TYPE_URL = 4
_NONCE = 5
# google.protobuf.Any field numbers.
_ANY_TYPE_URL = 1
_ANY_VALUE = 2


def _encode_varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


# Lengths, tags and most numbers are small: look their encodings up.
_SMALL = tuple(_encode_varint(i) for i in range(1 << 14))


def _varint(value: int) -> bytes:
    return _SMALL[value] if value < 16384 else _encode_varint(value)


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


def _varint_field(field: int, value: int) -> bytes:
    return _varint(field << 3) + _varint(value)


_EMPTY_LOCALITY = length_delimited(1, b"")
_LOCALITY_WEIGHT_1 = length_delimited(3, _varint_field(1, 1))


def lb_endpoint(host: str, port: int, weight: int) -> bytes:
    """An encoded ``LbEndpoint`` with a socket address and a load-balancing weight."""
    # Written out (tags as literals) because a large fleet has hundreds of thousands of these:
    # LbEndpoint{1: Endpoint{1: Address{1: SocketAddress{2: host, 3: port}}}, 4: UInt32Value{1: weight}}
    small = _SMALL
    raw_host = host.encode()
    socket = b"\x12" + small[len(raw_host)] + raw_host + b"\x18" + _varint(port)
    address = b"\x0a" + small[len(socket)] + socket
    endpoint = b"\x0a" + small[len(address)] + address
    weight_value = b"\x08" + _varint(weight)
    return b"\x0a" + small[len(endpoint)] + endpoint + b"\x22" + small[len(weight_value)] + weight_value


def cluster_load_assignment(name: str, lb_endpoints: Iterable[bytes]) -> bytes:
    """An encoded ``ClusterLoadAssignment``: one locality (weight 1) holding ``lb_endpoints``.

    Field for field the bytes protobuf's deterministic serialization gives (a unit test checks),
    at a fraction of the cost: endpoints are the bulk of a large configuration.
    """
    group = _EMPTY_LOCALITY + b"".join(length_delimited(2, e) for e in lb_endpoints) + _LOCALITY_WEIGHT_1
    return length_delimited(1, name.encode()) + length_delimited(2, group)
