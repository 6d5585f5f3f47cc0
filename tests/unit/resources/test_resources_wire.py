"""Decoding a SotW request without its names (SotwStream.decode_request, resources/wire.py).

An EDS ACK from a proxy subscribed to 10,000 clusters repeats all 10,000 names. When they are
byte for byte the previous request's, the stream decodes only the other fields. These tests hold
that shortcut to the full decode: the field walk on its own (known layouts, odd ones, malformed
bytes), and, with hypothesis, two streams fed the same arbitrary bytes (fields in any order,
repeated, unknown, split name runs, truncated or corrupted, and plain ACKs, which the shortcut
takes by their bytes alone), one decoding the shortcut's way and one decoding every request
whole, which must agree on every outcome, every refusal and every bit of state.
"""

from __future__ import annotations

import dataclasses

import pytest
from conftest import CDS, EDS, LDS, RDS, assignment, build, cluster, listener, route
from envoy.config.endpoint.v3 import endpoint_pb2
from envoy.config.route.v3 import route_pb2
from envoy.service.discovery.v3 import discovery_pb2
from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pilotfish.errors import PeerError
from pilotfish.protocol import RequestKind, RequestOutcome, SotwStream, XdsLimits
from pilotfish.resources.wire import (
    any_bytes,
    discovery_response,
    names_run_count,
    request_names_span,
    response_names,
    split_request_names,
)


def fields(**values: object) -> bytes:
    """The encoded fields of a DiscoveryRequest with these values (protobuf's own encoding)."""
    encoded: bytes = discovery_pb2.DiscoveryRequest(**values).SerializeToString()
    return encoded


NAMES = [f"svc-{i:05d}" for i in range(300)]


# -- the field walk ---------------------------------------------------------------------------


def test_an_ack_repeating_known_names_is_split_around_them() -> None:
    names = fields(resource_names=NAMES)
    data = fields(version_info="v1") + names + fields(type_url=EDS, response_nonce="7")
    start, end = split_request_names(data, [names]) or (-1, -1)
    assert data[start:end] == names
    rest = discovery_pb2.DiscoveryRequest.FromString(data[:start] + data[end:])
    assert (rest.version_info, rest.type_url, rest.response_nonce, list(rest.resource_names)) == ("v1", EDS, "7", [])


@pytest.mark.parametrize("layout", ["node first", "names first", "type before names", "error detail", "unknown"])
def test_other_fields_anywhere_are_walked_over(layout: str) -> None:
    names = fields(resource_names=NAMES)
    parts = {
        "node first": [fields(node={"id": "n"}), names, fields(type_url=EDS)],
        "names first": [names, fields(version_info="v", type_url=EDS, response_nonce="3")],
        "type before names": [fields(type_url=EDS), names, fields(version_info="v")],
        "error detail": [names, fields(response_nonce="3", error_detail={"message": "no"})],
        "unknown": [b"\x98\x06\x05", names, b"\x25\x01\x02\x03\x04\x29" + bytes(8), fields(type_url=EDS)],
    }[layout]
    data = b"".join(parts)
    split = split_request_names(data, [names])
    assert split is not None and data[split[0] : split[1]] == names


def test_a_known_run_that_begins_another_does_not_hide_it() -> None:
    # An ADS stream whose routes are named as its first ten clusters: both runs are known, and
    # an ACK of either is found.
    clusters, routes = fields(resource_names=NAMES), fields(resource_names=NAMES[:10])
    tail = fields(type_url=EDS, response_nonce="3")
    for names in (clusters, routes):
        data = fields(version_info="v1") + names + tail
        start, end = split_request_names(data, [routes, clusters]) or (-1, -1)
        assert data[start:end] == names
    # eleven names: neither
    assert split_request_names(fields(resource_names=NAMES[:11]) + tail, [routes, clusters]) is None
    stream = SotwStream()
    for type_url, names_ in ((EDS, NAMES), (RDS, NAMES[:10])):
        first = stream.decode_request(fields(node={"id": "p"}, resource_names=names_, type_url=type_url))
        stream.on_request(first.request, names_wire=first.names_wire)
    for type_url, names_ in ((EDS, NAMES), (RDS, NAMES[:10])):
        again = stream.decode_request(fields(version_info="v", resource_names=names_, type_url=type_url))
        assert again.names_as_before and again.request is not None and again.request.type_url == type_url


def test_no_names_at_all_is_an_empty_run() -> None:
    assert split_request_names(fields(type_url=CDS, version_info="v"), []) == (0, 0)
    assert split_request_names(b"", [fields(resource_names=["a"])]) == (0, 0)


@pytest.mark.parametrize(
    "case",
    [
        "other names",
        "more names",
        "fewer names",
        "two runs",
        "the known run twice",
        "a name's tag in two bytes",
        "truncated",
        "group",
        "field 0",
        "wire type 7",
        "varint of 11 bytes",
        "length past the end",
    ],
)
def test_anything_else_is_left_to_the_full_decode(case: str) -> None:
    names = fields(resource_names=NAMES)
    tail = fields(type_url=EDS, response_nonce="3")
    data = {
        "other names": fields(resource_names=[*NAMES[:-1], "svc-99999"]) + tail,
        "more names": names + fields(resource_names=["x"]) + tail,
        "fewer names": fields(resource_names=NAMES[:-1]) + tail,
        "two runs": names + tail + fields(resource_names=["x"]),
        "the known run twice": names + tail + names,
        "a name's tag in two bytes": b"\x9a\x00" + names[1:] + tail,
        "truncated": names + tail[:-1],
        "group": names + b"\x3b\x08\x01\x3c" + tail,  # field 7, start group ... end group
        "field 0": names + b"\x00\x01" + tail,
        "wire type 7": names + b"\x3f" + tail,
        "varint of 11 bytes": names + b"\x38" + b"\x80" * 10 + b"\x01" + tail,
        "length past the end": names + b"\x3a\x7f\x01" + tail,
    }[case]
    assert split_request_names(data, [names]) is None


def test_a_run_is_kept_only_if_it_is_nothing_but_whole_names() -> None:
    assert names_run_count(fields(resource_names=NAMES)) == len(NAMES)
    assert names_run_count(b"") == 0
    long_name = "x" * 300  # a two-byte length
    assert names_run_count(fields(resource_names=[long_name, "a"])) == 2
    assert names_run_count(fields(resource_names=["a", "b"])[:-1]) is None  # a name cut short
    assert names_run_count(fields(resource_names=["a"], type_url=EDS)) is None  # another field in it
    assert names_run_count(b"\x1a") is None


def test_a_span_found_by_the_requests_ends_must_still_be_whole_names() -> None:
    # A last "name" whose bytes run on into what looks like the type_url and nonce fields: the
    # span found by the ends is not a run of whole names, so it is never trusted as one.
    tail = fields(type_url=EDS, response_nonce="3")
    tricky = fields(resource_names=["a"]) + tail + b"\x1a" + bytes([len(tail) + 2]) + b"zz" + tail
    request = discovery_pb2.DiscoveryRequest.FromString(tricky)
    span = request_names_span(tricky, request.type_url, request.response_nonce)
    assert span is not None and names_run_count(span) is None


# -- the stream ---------------------------------------------------------------------------------


def test_an_envoy_like_conversation_takes_the_shortcut_from_the_second_ack() -> None:
    stream = SotwStream()
    names = NAMES
    first = stream.decode_request(fields(node={"id": "proxy-1", "cluster": "c"}, resource_names=names, type_url=EDS))
    assert not first.names_as_before and first.names_wire is not None
    outcome = stream.on_request(first.request, names_wire=first.names_wire)
    assert outcome.kind is RequestKind.REQUEST and stream.node is not None and stream.node.id == "proxy-1"
    ack = stream.decode_request(fields(version_info="v1", resource_names=names, type_url=EDS, response_nonce="1"))
    assert ack.names_as_before  # the first request's names, found behind its node
    outcome = stream.on_request(ack.request, names_wire=ack.names_wire, names_as_before=True)
    assert outcome.kind is RequestKind.STALE  # (nothing was sent: "1" is not a nonce of this stream)
    assert outcome.watches == ()
    changed = stream.decode_request(fields(version_info="v1", resource_names=names[:10], type_url=EDS))
    assert not changed.names_as_before and changed.request is not None
    assert list(changed.request.resource_names) == names[:10]


def test_an_undecodable_request_is_refused_as_before() -> None:
    stream = SotwStream()
    with pytest.raises(PeerError, match="undecodable DiscoveryRequest"):
        stream.decode_request(b"\x0a\x05ab")


# -- the property -------------------------------------------------------------------------------

SNAPSHOT = build(
    clusters=[cluster(c) for c in "abc"],
    endpoints=[assignment(c, 1) for c in "abc"],
    listeners=[listener("l", "r")],
    routes=[route("r", "a")],
)
LISTS = [
    (),
    ("a",),
    ("a", "b"),
    ("b", "a"),
    ("a", "b", "c"),
    ("*",),
    ("*", "a"),
    ("r",),
    ("l",),
    ("zz",),
    tuple(f"n{i}" for i in range(12)),
]
"""Name lists, few enough that a request often repeats the previous one's (the shortcut)."""
TYPE_URLS = [CDS, EDS, LDS, RDS, "", "type.googleapis.com/not.a.Type"]


def _field(data: st.DataObject, previous: list[int]) -> bytes:
    kind = data.draw(
        st.sampled_from(
            ["version", "names", "names", "names", "type", "type", "nonce", "nonce", "error", "node", "unknown"]
        )
    )
    if kind == "version":
        return fields(version_info=data.draw(st.sampled_from(["", "v1", SNAPSHOT.version(EDS) or "x"])))
    if kind == "names":
        return fields(resource_names=list(data.draw(st.sampled_from(LISTS))))
    if kind == "type":
        return fields(type_url=data.draw(st.sampled_from(TYPE_URLS)))
    if kind == "nonce":
        nonce = data.draw(st.sampled_from(["", "1", "bogus", *(str(n) for n in previous[-3:])]))
        return fields(response_nonce=nonce)
    if kind == "error":
        return fields(error_detail={"message": data.draw(st.sampled_from(["", "rejected"])), "code": 3})
    if kind == "node":
        return fields(node={"id": data.draw(st.sampled_from(["p1", "p2", "x" * 40]))})
    return data.draw(
        st.sampled_from(
            [
                b"\x98\x06\x05",
                b"\x18\x01",
                b"\x25\x01\x02\x03\x04",
                b"\xfa\x3e\x02hi",
                b"\x09" + bytes(8),
                b"\x32\x03\x0a\x01a",
            ]
        )
    )


def _message(data: st.DataObject, previous: list[int], last: bytes | None) -> bytes:
    if last is not None and data.draw(st.integers(0, 3)) == 0:
        message = last  # the same request again (what an ACK mostly is)
    else:
        message = b"".join(_field(data, previous) for _ in range(data.draw(st.integers(0, 7))))
    damage = data.draw(st.sampled_from(["none"] * 6 + ["truncate", "flip", "insert"]))
    if damage != "none" and message:
        at = data.draw(st.integers(0, len(message) - 1))
        if damage == "truncate":
            message = message[:at]
        elif damage == "flip":
            message = message[:at] + bytes([message[at] ^ data.draw(st.integers(1, 255))]) + message[at + 1 :]
        else:
            message = message[:at] + data.draw(st.binary(min_size=1, max_size=3)) + message[at:]
    return message


def _state(stream: SotwStream) -> object:
    types = {
        url: {f.name: getattr(state, f.name) for f in dataclasses.fields(state) if f.name != "names_wire"}
        for url, state in stream.types.items()
    }
    return stream.node, types, stream._sent


def _decided(outcome: object, stream: SotwStream) -> object:
    """``outcome`` without its cluster watches' reference to their stream (each stream's own,
    asked when the watch is answered: compared by :func:`_state`)."""
    if not isinstance(outcome, RequestOutcome):
        return outcome
    assert all(watch.routing is None or watch.routing is stream for watch in outcome.watches)
    return outcome._replace(watches=tuple(watch._replace(routing=None) for watch in outcome.watches))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), per_type=st.booleans(), few_names=st.booleans())
def test_the_shortcut_decides_exactly_as_the_full_decode(data: st.DataObject, per_type: bool, few_names: bool) -> None:
    limits = XdsLimits(max_resource_names=4 if few_names else 100_000)
    served = EDS if per_type else None
    fast = SotwStream(type_url=served, limits=limits)
    full = SotwStream(type_url=served, limits=limits)
    nonces: list[int] = []
    last: bytes | None = None
    for _ in range(data.draw(st.integers(1, 12))):
        answered = [state for state in fast.types.values() if state.nonce is not None and state.names_wire is not None]
        if answered and data.draw(st.integers(0, 2)) == 0:
            # The plain ACK of a type's latest response, as Envoy writes it (found by its bytes).
            state = data.draw(st.sampled_from(answered))
            assert state.names_wire is not None and state.nonce is not None
            version = fields(version_info=state.sent_version or "")
            message = version + state.names_wire + fields(type_url=state.type_url, response_nonce=state.nonce)
        else:
            message = _message(data, nonces, last)
        last = message
        try:
            decoded = fast.decode_request(message)
            got: object = fast.on_decoded(decoded)
        except PeerError as exc:
            got = (type(exc), str(exc))
        try:
            try:
                request = discovery_pb2.DiscoveryRequest.FromString(message)
            except DecodeError as exc:
                raise PeerError(f"undecodable DiscoveryRequest: {exc}") from None
            expected: object = full.on_request(request)
        except PeerError as exc:
            expected = (type(exc), str(exc))
        assert _decided(got, fast) == _decided(expected, full)
        assert _state(fast) == _state(full)
        # (An outcome is a named tuple: a refusal is a plain one.)
        if not isinstance(got, RequestOutcome) or not data.draw(st.booleans()):
            continue
        # The server answers: the same response on both streams, so nonces become current.
        for stream in (fast, full):
            for watch in got.watches:
                typed = SNAPSHOT.get(watch.type_url)
                assert typed is not None
                nonce, _ = stream.on_response(watch, typed.response(watch.subscription.names_to_send()))
                if stream is fast:
                    nonces.append(int(nonce))


# -- the names of an encoded response, as a request repeats them ---------------------------------


def test_request_names_span_finds_the_encoded_names_or_declines() -> None:
    from envoy.service.discovery.v3 import discovery_pb2

    from pilotfish.protocol.subscription import next_subscription
    from pilotfish.resources.wire import request_names_span

    eds = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"

    def span(**fields: object) -> bytes | None:
        request = discovery_pb2.DiscoveryRequest(type_url=eds, **fields)
        data = request.SerializeToString()
        return request_names_span(data, request.type_url, request.response_nonce)

    ack = span(version_info="v1", resource_names=["a", "b"], response_nonce="7")
    assert ack is not None and discovery_pb2.DiscoveryRequest.FromString(ack).resource_names == ["a", "b"]
    # the same names under another version and nonce: the same span; other names: another one
    assert span(version_info="v2", resource_names=["a", "b"], response_nonce="12") == ack
    assert span(version_info="v1", resource_names=["a", "c"], response_nonce="7") != ack
    assert span(resource_names=[]) == b""
    # a node before the names (a stream's first request) is skipped
    assert span(resource_names=["a", "b"], node={"id": "n"}) == span(resource_names=["a", "b"])
    # layouts it does not know: the caller decodes the names
    assert span(resource_names=["a"], response_nonce="1", error_detail={"message": "no"}) is None
    # the shortcut gives the very set the decoded names give
    via_wire = next_subscription(["a", "b"], wildcard_capable=False, ever_named=True, wire=ack)
    assert via_wire is next_subscription(["a", "b"], wildcard_capable=False, ever_named=True)


def test_the_names_a_response_carries_are_read_off_the_wire() -> None:
    resources = [
        any_bytes(
            "t", route_pb2.RouteConfiguration(name="local_route", validate_clusters={"value": True}).SerializeToString()
        ),
        any_bytes("t", endpoint_pb2.ClusterLoadAssignment(cluster_name="w" * 300).SerializeToString()),
        any_bytes("t", b""),  # no name at all
    ]
    body = discovery_response("7", "t", resources) + b"\x2a\x03abc"  # and a nonce field after
    assert response_names(body, 16) == (["local_route", "w" * 300], 3)
    assert response_names(body, 1) == (["local_route"], 3)
    assert response_names(body[:-10], 16)[1] == 2, "a truncated body: what could be read"
