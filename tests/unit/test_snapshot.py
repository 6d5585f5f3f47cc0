"""Snapshots: content-hash versions and shared encoded responses."""

from __future__ import annotations

import sys
import weakref
from types import MappingProxyType

import pytest
from conftest import CDS, EDS, assignment, build, cluster
from envoy.config.cluster.v3 import cluster_pb2
from envoy.service.discovery.v3 import discovery_pb2
from google.protobuf.message import Message

from pilotfish.resources.wire import nonce_field
from pilotfish.snapshot import DEFAULT_MEMO_LIMITS


def test_versions_ignore_order_and_follow_content() -> None:
    a = build(clusters=[cluster("a"), cluster("b")], endpoints=[assignment("a", 1), assignment("b", 2)])
    reordered = build(clusters=[cluster("b"), cluster("a")], endpoints=[assignment("b", 2), assignment("a", 1)])
    changed = build(clusters=[cluster("a"), cluster("b", "2s")], endpoints=[assignment("a", 1), assignment("b", 2)])
    assert a.versions() == reordered.versions()
    assert changed.version(CDS) != a.version(CDS)
    assert changed.version(EDS) == a.version(EDS)  # per type: endpoints did not change


def test_explicit_version_applies_to_all_types() -> None:
    snap = build(clusters=[cluster("a")], endpoints=[assignment("a", 1)], version="42")
    assert set(snap.versions().values()) == {"42"}
    assert snap.label() == "42"


def test_encoded_response_is_a_valid_discovery_response_with_any_nonce() -> None:
    snap = build(clusters=[cluster("a"), cluster("b")], endpoints=[assignment("a", 1), assignment("b", 2)])
    types = snap.get(CDS)
    assert types is not None
    body = types.response(None).body
    decoded = discovery_pb2.DiscoveryResponse.FromString(body + nonce_field("17"))
    assert decoded.nonce == "17"
    assert decoded.version_info == snap.version(CDS)
    assert decoded.type_url == CDS
    names = []
    for item in decoded.resources:
        message = cluster_pb2.Cluster()
        assert item.Unpack(message)
        names.append(message.name)
    assert names == ["a", "b"]


def test_responses_are_encoded_once_per_name_set() -> None:
    snap = build(clusters=[cluster("a")], endpoints=[assignment("a", 1), assignment("b", 2)])
    eds = snap.get(EDS)
    assert eds is not None
    one = eds.response(frozenset({"a", "missing"}))
    assert one is eds.response(frozenset({"a", "missing"}))
    assert one.names == frozenset({"a"})
    assert eds.response(None).names == frozenset({"a", "b"})


def _assignments(names: list[str]) -> list[Message]:
    """A parsed ClusterLoadAssignment per name, one endpoint each."""
    from pilotfish.resources import ENDPOINT
    from pilotfish.resources.parse import parse_resource

    parsed = [parse_resource(ENDPOINT, assignment(n, 8000), "")[0] for n in names]
    return [message for message in parsed if message is not None]


def _names_of(body: bytes) -> list[str]:
    from envoy.config.endpoint.v3 import endpoint_pb2

    decoded = discovery_pb2.DiscoveryResponse.FromString(body)
    out = []
    for item in decoded.resources:
        message = endpoint_pb2.ClusterLoadAssignment()
        assert item.Unpack(message)
        out.append(message.cluster_name)
    return out


def test_the_response_memo_stays_bounded_and_keeps_the_set_everyone_asks_for() -> None:
    from pilotfish.resources import CLUSTER, ENDPOINT
    from pilotfish.snapshot import MemoBudget, ResponseMemoLimits, Snapshot

    names = [f"svc-{i:03d}" for i in range(200)]
    limits = ResponseMemoLimits(entries=64, bytes=256 * 1024)
    snap = Snapshot.build({ENDPOINT: _assignments(names), CLUSTER: []}, memo_budget=MemoBudget(limits))
    eds = snap.get(EDS)
    assert eds is not None
    hot = frozenset(names[:10])
    hot_response = eds.response(hot)
    everything = eds.response(None)
    # A peer cycling through 5,000 distinct sets, each of 100 names (~2.6 KB encoded).
    for i in range(5000):
        wanted = frozenset(names[j % 200] for j in range(i, i + 100)) | {f"missing-{i}"}
        response = eds.response(wanted)
        assert sorted(_names_of(response.body)) == sorted(wanted - {f"missing-{i}"})
        entries, size = eds.memoized()
        assert entries <= limits.entries and size <= limits.bytes
        if i % 4 == 0:  # thousands of proxies keep asking for the hot set: it stays memoized
            assert eds.response(hot) is hot_response
    assert eds.response(None) is everything  # the whole type is always kept
    assert eds.memoized()[1] > limits.bytes // 4  # it did keep responses up to about its budget


def test_a_response_larger_than_the_memo_budget_is_answered_and_not_kept() -> None:
    from pilotfish.resources import ENDPOINT
    from pilotfish.snapshot import MemoBudget, ResponseMemoLimits, Snapshot

    names = [f"svc-{i:03d}" for i in range(100)]
    snap = Snapshot.build({ENDPOINT: _assignments(names)}, memo_budget=MemoBudget(ResponseMemoLimits(bytes=4096)))
    eds = snap.get(EDS)
    assert eds is not None
    big = frozenset(names)
    assert sorted(_names_of(eds.response(big).body)) == names
    assert eds.memoized() == (0, 0)
    small = frozenset(names[:1])
    assert eds.response(small) is eds.response(small)


def test_a_response_streams_hold_is_shared_whatever_the_budget_and_one_nobody_holds_goes() -> None:
    from pilotfish.resources import ENDPOINT
    from pilotfish.snapshot import MemoBudget, ResponseMemoLimits, Snapshot

    # Every proxy asks for the endpoints of every cluster by name: one response far over the
    # budget, which fan-outs must not encode again per proxy while proxies hold it.
    names = [f"svc-{i:04d}" for i in range(2000)]
    limits = ResponseMemoLimits(bytes=4096)
    snap = Snapshot.build({ENDPOINT: _assignments(names)}, memo_budget=MemoBudget(limits))
    eds = snap.get(EDS)
    assert eds is not None
    everyone = frozenset(names)
    response = eds.response(everyone)  # held, as a stream holds the last response it was sent
    for i in range(300):  # peers asking for other large sets meanwhile do not grow the memo
        eds.response(frozenset(names[i:]))
        assert eds.memoized()[1] <= limits.bytes
        assert eds.response(frozenset(everyone)) is response
    held = weakref.ref(response)
    del response
    eds.response(frozenset(names[1:]))
    assert held() is None, "a response no stream holds outlived the budget"


# -- delta answers ----------------------------------------------------------------------------------


def test_a_delta_answer_keeps_no_stream_s_own_record_of_what_it_has() -> None:
    """A reconnecting client states what it has (initial_resource_versions): that dict is its own,
    asked with once. Keeping it in the answers' memo would keep every such record alive (10,000
    reconnecting proxies with 10,000 clusters each: gigabytes) after the streams have moved on."""
    ts = build(clusters=[cluster("a"), cluster("b")]).get(CDS)
    assert ts is not None
    own = {"a": "an old version", "b": ts.versions()["b"]}
    held_before = sys.getrefcount(own)
    answer = ts.delta(own, wildcard=True, names=frozenset())
    assert answer is not None and answer.sent == ("a",)
    assert sys.getrefcount(own) == held_before, "the stream's own dict is still referenced after the answer"
    # What the answer hands out is shared, read-only, and answers the next stream at once.
    again = ts.delta(answer.known, wildcard=True, names=frozenset())
    assert again is None and ts.delta(answer.known, wildcard=True, names=frozenset()) is again
    with pytest.raises(TypeError):
        answer.known["a"] = "changed"  # type: ignore[index]


def test_the_delta_answer_memo_stays_bounded() -> None:
    """Shared mappings are remembered up to a bound; past it the least recently used are let go
    (each answer is still right), so clients cycling through subscriptions cannot grow it."""
    ts = build(clusters=[cluster("a"), cluster("b")]).get(CDS)
    assert ts is not None
    first = MappingProxyType({"a": "x"})
    baseline = sys.getrefcount(first)
    assert ts.delta(first, wildcard=True, names=frozenset()) is not None
    assert sys.getrefcount(first) > baseline, "a shared mapping is remembered"
    others = [MappingProxyType({"a": str(n)}) for n in range(DEFAULT_MEMO_LIMITS.entries)]
    for known in others:
        answer = ts.delta(known, wildcard=True, names=frozenset())
        assert answer is not None and set(answer.sent) == {"a", "b"}
    assert sys.getrefcount(first) == baseline, f"more than {DEFAULT_MEMO_LIMITS.entries} entries kept"
