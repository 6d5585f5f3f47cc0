"""Hand-assembled protobuf wire encoding for discovery responses.

Serialize once, send many (docs/architecture.md): a response body is the concatenation of encoded fields,
so it is built once per (type, version, subscribed names) and every stream appends only its own
nonce field. Protobuf parsers accept fields in any order, so appending is valid encoding.
"""

from __future__ import annotations

import functools
from collections.abc import Collection, Iterable

__all__ = [
    "any_bytes",
    "cluster_load_assignment",
    "delta_discovery_response",
    "delta_resource",
    "discovery_response",
    "duration_bytes",
    "is_plain_ack",
    "is_plain_delta_ack",
    "lb_endpoint",
    "length_delimited",
    "names_run_count",
    "nonce_field",
    "request_names_span",
    "response_names",
    "split_request_names",
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


# envoy.service.discovery.v3.DeltaDiscoveryResponse and Resource field numbers.
_DELTA_SYSTEM_VERSION = 1
_DELTA_RESOURCES = 2
_DELTA_TYPE_URL = 4
_DELTA_REMOVED = 6
_RESOURCE_VERSION = 1
_RESOURCE_ANY = 2
_RESOURCE_NAME = 3
_RESOURCE_TTL = 6
RESOURCE_URL = "type.googleapis.com/envoy.service.discovery.v3.Resource"
"""The type URL of ``discovery.v3.Resource``: an Any of it in a SotW response wraps a resource
with its TTL (clients that announce ``xds.config.resource-in-sotw`` unwrap it)."""


def duration_bytes(milliseconds: int) -> bytes:
    """An encoded ``google.protobuf.Duration`` of ``milliseconds``."""
    seconds, millis = divmod(milliseconds, 1000)
    return (_varint_field(1, seconds) if seconds else b"") + (_varint_field(2, millis * 1_000_000) if millis else b"")


def delta_resource(name: str, version: str, encoded_any: bytes | None, ttl_ms: int = 0) -> bytes:
    """An encoded ``discovery.v3.Resource``: name, version, the resource as an encoded Any
    (None: none, a heartbeat) and its TTL (0: none)."""
    out = length_delimited(_RESOURCE_NAME, name.encode())
    if version:
        out += length_delimited(_RESOURCE_VERSION, version.encode())
    if encoded_any is not None:
        out += length_delimited(_RESOURCE_ANY, encoded_any)
    if ttl_ms:
        out += length_delimited(_RESOURCE_TTL, duration_bytes(ttl_ms))
    return out


def delta_discovery_response(
    system_version: str, type_url: str, resources: Iterable[bytes], removed: Iterable[str]
) -> bytes:
    """A DeltaDiscoveryResponse without its nonce (field 5, as in a DiscoveryResponse: a stream
    appends :func:`nonce_field`); ``resources`` are encoded ``Resource`` messages."""
    parts = [length_delimited(_DELTA_SYSTEM_VERSION, system_version.encode())]
    parts.extend(length_delimited(_DELTA_RESOURCES, r) for r in resources)
    parts.append(length_delimited(_DELTA_TYPE_URL, type_url.encode()))
    parts.extend(length_delimited(_DELTA_REMOVED, name.encode()) for name in removed)
    return b"".join(parts)


@functools.lru_cache(maxsize=4096)
def nonce_field(nonce: str) -> bytes:
    """The nonce field a stream appends to a shared response body (the same field number as a
    request's ``response_nonce``). Streams count their nonces alike, so most are made once."""
    return length_delimited(_NONCE, nonce.encode())


@functools.lru_cache(maxsize=4096)
def _string_field(field: int, value: str) -> bytes:
    """A string field, made once (the fields a request is compared with: versions, type URLs,
    nonces; the cache is bounded, and a peer's made-up values only push out others)."""
    return length_delimited(field, value.encode())


def _varint_field(field: int, value: int) -> bytes:
    return _varint(field << 3) + _varint(value)


_EMPTY_LOCALITY = length_delimited(1, b"")
_LOCALITY_WEIGHT_1 = length_delimited(3, _varint_field(1, 1))


_LB_ENDPOINT = b"\x0a%c\x0a%c\x0a%c\x12%c%b\x18%b\x22%c\x08%b"


def lb_endpoint(host: str, port: int, weight: int) -> bytes:
    """An encoded ``LbEndpoint`` with a socket address and a load-balancing weight."""
    # Written out (tags as literals) because a large fleet has hundreds of thousands of these:
    # LbEndpoint{1: Endpoint{1: Address{1: SocketAddress{2: host, 3: port}}}, 4: UInt32Value{1: weight}}
    small = _SMALL
    raw_host = host.encode()
    port_bytes, weight_bytes = _varint(port), _varint(weight)
    size = 3 + len(raw_host) + len(port_bytes)  # of the SocketAddress
    if size < 124:  # every length below fits one byte: one formatting, no intermediate bytes
        return _LB_ENDPOINT % (
            size + 4,
            size + 2,
            size,
            len(raw_host),
            raw_host,
            port_bytes,
            len(weight_bytes) + 1,
            weight_bytes,
        )
    socket = b"\x12" + small[len(raw_host)] + raw_host + b"\x18" + port_bytes
    address = b"\x0a" + small[len(socket)] + socket
    endpoint = b"\x0a" + small[len(address)] + address
    weight_value = b"\x08" + weight_bytes
    return b"\x0a" + small[len(endpoint)] + endpoint + b"\x22" + small[len(weight_value)] + weight_value


def cluster_load_assignment(name: str, lb_endpoints: Iterable[bytes]) -> bytes:
    """An encoded ``ClusterLoadAssignment``: one locality (weight 1) holding ``lb_endpoints``.

    Field for field the bytes protobuf's deterministic serialization gives (a unit test checks),
    at a fraction of the cost: endpoints are the bulk of a large configuration.
    """
    group = _EMPTY_LOCALITY + b"".join(length_delimited(2, e) for e in lb_endpoints) + _LOCALITY_WEIGHT_1
    return length_delimited(1, name.encode()) + length_delimited(2, group)


_REQUEST_VERSION_TAG = 0x0A  # DiscoveryRequest.version_info (field 1, length-delimited)
_REQUEST_NAMES_TAG = 0x1A  # DiscoveryRequest.resource_names (field 3)


def request_names_span(data: bytes, type_url: str, nonce: str) -> bytes | None:
    """The encoded ``resource_names`` of a DiscoveryRequest, found without decoding them.

    Only for the layout serializers write for an ACK or a plain request (fields in their order):
    whatever comes first (``version_info``, ``node``), then the names, then ``type_url`` and
    ``response_nonce`` (the parsed request's values, given here) and nothing else; b"" if it has
    no names. None for any other layout (an error detail, other fields after the names): the
    caller decodes the names instead. The span is found by the request's ends: before equal
    spans may stand for equal names, it must be checked to hold nothing but whole names
    (:func:`names_run_count`).
    """
    start, end = 0, len(data)
    try:
        while start < end:
            tag, after = _next_field(data, start)
            if tag == _REQUEST_NAMES_TAG or tag >> 3 > _REQUEST_NAMES_TAG >> 3:
                break
            start = after
    except (IndexError, ValueError):
        return None
    tail = _request_tail(type_url, nonce)
    end -= len(tail)
    if end < start or not data.endswith(tail):
        return None
    if end > start and data[start] != _REQUEST_NAMES_TAG:
        return None
    return data[start:end]


def _request_tail(type_url: str, nonce: str) -> bytes:
    """A DiscoveryRequest's last fields as serializers write them: ``type_url``, ``response_nonce``."""
    tail = _string_field(_TYPE_URL, type_url) if type_url else b""
    return tail + nonce_field(nonce) if nonce else tail


def is_plain_ack(data: bytes, *, version: str, names: bytes, type_url: str, nonce: str) -> bool:
    """Whether ``data`` is, byte for byte, the DiscoveryRequest of a proxy that ACKs the response
    of ``type_url`` at ``version`` sent with ``nonce``, asking for the names it asked for before
    (``names``, encoded): ``version_info``, the names, ``type_url`` and ``response_nonce``, in
    field order, and nothing else (no node, no error detail), as protobuf's serializers write
    such an ACK (Envoy's, with ``set_node_on_first_message_only``). Found by comparing bytes,
    nothing decoded: the reader of a fleet's ACKs need not parse any of them."""
    last, before = nonce_field(nonce), _string_field(_TYPE_URL, type_url)
    end = len(data) - len(last) - len(before)
    head = end - len(names)
    if head < 0 or not data.endswith(last) or not data.startswith(before, end) or not data.startswith(names, head):
        return False
    return data[:head] == (_string_field(_VERSION_INFO, version) if version else b"")


# DeltaDiscoveryRequest field numbers.
_DELTA_REQUEST_TYPE_URL = 2
_DELTA_REQUEST_NONCE = 6


def is_plain_delta_ack(data: bytes, *, type_url: str, nonce: str) -> bool:
    """Whether ``data`` is, byte for byte, the DeltaDiscoveryRequest of a client that ACKs the
    response of ``type_url`` sent with ``nonce`` and says nothing else (no node, no subscription
    change, no error detail): ``type_url`` and ``response_nonce``, as protobuf's serializers write
    it."""
    first, last = _string_field(_DELTA_REQUEST_TYPE_URL, type_url), _string_field(_DELTA_REQUEST_NONCE, nonce)
    return len(data) == len(first) + len(last) and data.startswith(first) and data.endswith(last)


def names_run_count(span: bytes) -> int | None:
    """How many ``resource_names`` records ``span`` is made of, or None unless it is nothing but
    whole records of that field (tag 0x1A, a length, that many bytes).

    What :func:`split_request_names` may skip as a known run must be checked once this way:
    :func:`request_names_span` finds its span by the request's ends, so a name's bytes could in
    principle run past it. A walk over every name, in Python: done once per distinct list (the
    subscription intern tables keep the result), not per request.
    """
    count = pos = 0
    end = len(span)
    try:
        while pos < end:
            if span[pos] != _REQUEST_NAMES_TAG:
                return None
            length = span[pos + 1]
            if length < 0x80:
                pos += 2 + length
            else:
                length, pos = _decode_varint(span, pos + 1)
                pos += length
            count += 1
    except IndexError:
        return None
    return count if pos == end else None


_MAX_TAG = 0xFFFFFFFF


def split_request_names(data: bytes, known: Collection[bytes]) -> tuple[int, int] | None:
    """Where the ``resource_names`` of an encoded DiscoveryRequest lie, if they are one of the
    ``known`` runs of names: (start, end), found without decoding a name; (0, 0) if it has none.

    Walks the top-level fields by their tags and lengths. The names must be one contiguous run,
    byte for byte one of ``known`` (each a checked :func:`names_run_count` span), compared where
    the first name starts; the rest of the request (``data[:start] + data[end:]``) is then a
    request of its own with every other field as it was, for protobuf to decode: a few small
    fields instead of thousands of names. None for anything else (names that are not one of
    ``known``, or in two runs; a truncated or odd field: a group, field 0, a varint over 10
    bytes): the caller decodes the whole request, which also says what is wrong with it.
    """
    pos, end = 0, len(data)
    try:
        while pos < end and data[pos] != _REQUEST_NAMES_TAG:
            tag, pos = _next_field(data, pos)
            if tag == _REQUEST_NAMES_TAG:
                return None  # the names' tag written in more bytes than it needs
        if pos >= end:
            return (0, 0) if pos == end else None
        # One known run may begin another (a stream's routes named as its first clusters): the
        # longest that is followed by no other name is the one (a shorter one is followed by the
        # rest of the longer).
        for run in sorted((run for run in known if run and data.startswith(run, pos)), key=len, reverse=True):
            if _no_names_from(data, pos + len(run)):
                return pos, pos + len(run)
    except (IndexError, ValueError):
        pass  # truncated, or a varint over its length
    return None


def _no_names_from(data: bytes, pos: int) -> bool:
    """Whether ``data`` from ``pos`` on is whole fields, none of them a name."""
    end = len(data)
    while pos < end:
        tag, pos = _next_field(data, pos)
        if tag == _REQUEST_NAMES_TAG:
            return False
    return pos == end


def _next_field(data: bytes, pos: int) -> tuple[int, int]:
    """(tag, offset after the field) of the field at ``pos``, skipped by its wire type without
    decoding it. ValueError for what protobuf's parsers refuse or pilotfish does not skip (field
    0, a tag over 32 bits, a group, a wire type that does not exist, a varint over 10 bytes);
    IndexError if the data ends in a varint. (The offset may be past the data's end: truncated.)"""
    tag = data[pos]
    if tag < 0x80:
        pos += 1
    else:
        tag, pos = _decode_varint(data, pos, 5)
        if tag > _MAX_TAG:
            raise ValueError("tag over 32 bits")
    kind = tag & 7
    if tag >> 3 == 0:
        raise ValueError("field 0")
    if kind == 2:
        length, pos = _decode_varint(data, pos)
        return tag, pos + length
    if kind == 0:
        return tag, _decode_varint(data, pos)[1]
    if kind == 1:
        return tag, pos + 8
    if kind == 5:
        return tag, pos + 4
    raise ValueError(f"wire type {kind}")  # groups (deprecated) and wire types that do not exist


def _decode_varint(data: bytes, offset: int, limit: int = 10) -> tuple[int, int]:
    """(value, offset after it) of the varint at ``offset``; ValueError if it is longer than
    ``limit`` bytes (protobuf's parsers refuse those), IndexError if the data ends first."""
    value = shift = 0
    last = offset + limit
    while offset < last:
        byte = data[offset]
        offset += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, offset
        shift += 7
    raise ValueError("varint too long")


def _fields(data: bytes) -> Iterable[tuple[int, bytes]]:
    """(tag, payload) of each length-delimited field of ``data``, the others skipped; stops at
    what it cannot read."""
    pos, end = 0, len(data)
    while pos < end:
        start = pos
        try:
            tag, pos = _next_field(data, pos)
        except (ValueError, IndexError):
            return
        if pos > end:
            return
        if tag & 7 == 2:
            _, payload_at = _decode_varint(data, start + (1 if data[start] < 0x80 else len(_varint(tag))))
            yield tag, data[payload_at:pos]


_LEN = 2
_WRAPPED = length_delimited(_ANY_TYPE_URL, RESOURCE_URL.encode())
"""How an Any wrapping a ``discovery.v3.Resource`` starts."""
_NAME_TAG = 1 << 3 | _LEN
"""Field 1, length-delimited: the name of every resource type pilotfish serves (Cluster.name,
ClusterLoadAssignment.cluster_name, Listener.name, RouteConfiguration.name, Secret.name)."""


def response_names(body: bytes, limit: int) -> tuple[list[str], int]:
    """The names of the first ``limit`` resources a DiscoveryResponse ``body`` carries, and how
    many it carries: read off the wire (each resource's field 1), nothing decoded. For naming
    what a proxy rejected when its message does not."""
    names: list[str] = []
    count = 0
    for tag, resource in _fields(body):
        if tag != (_RESOURCES << 3 | _LEN):
            continue
        count += 1
        if len(names) >= limit:
            continue
        value = next((payload for t, payload in _fields(resource) if t == (_ANY_VALUE << 3 | _LEN)), b"")
        if resource.startswith(_WRAPPED):  # a resource with its TTL: the Any inside the Resource
            inner = next((payload for t, payload in _fields(value) if t == (_RESOURCE_ANY << 3 | _LEN)), b"")
            value = next((payload for t, payload in _fields(inner) if t == (_ANY_VALUE << 3 | _LEN)), b"")
        name = next((payload for t, payload in _fields(value) if t == _NAME_TAG), None)
        if name is not None:
            names.append(name.decode("utf-8", "replace"))
    return names, count
