"""Resources with TTLs in snapshots: the wrapped encodings, the view without TTLs for clients that
do not take them (same versions), the refresh and heartbeat bodies, the cache choosing between the
two by what the watch says of its client, and the rollout's stored baseline keeping TTLs."""

from __future__ import annotations

from envoy.service.discovery.v3 import discovery_pb2
from envoy.service.runtime.v3 import rtds_pb2
from google.protobuf import any_pb2, struct_pb2

from pilotfish.cache import SnapshotCache
from pilotfish.protocol import DeltaTypeState, DeltaWatch, Watch, next_subscription
from pilotfish.resources import RUNTIME, TypeUrl
from pilotfish.resources.wire import RESOURCE_URL, response_names
from pilotfish.rollout.stored import decode_snapshots, encode_snapshots
from pilotfish.snapshot import DeltaChanges, EncodedResponse, Resource, Snapshot


def layer(name: str, value: float, ttl_ms: int = 0) -> Resource:
    runtime = rtds_pb2.Runtime(name=name, layer=struct_pb2.Struct(fields={"k": struct_pb2.Value(number_value=value)}))
    return Resource.of(RUNTIME, runtime, ttl_ms=ttl_ms)


def snapshot() -> Snapshot:
    return Snapshot.build({RUNTIME: [layer("gameday", 1, ttl_ms=30_000), layer("base", 2)]})


def test_a_resource_with_a_ttl_is_wrapped_in_sotw_and_carries_it_in_delta() -> None:
    resource = layer("gameday", 1, ttl_ms=30_500)
    wrapped = any_pb2.Any.FromString(resource.encoded)
    assert wrapped.type_url == RESOURCE_URL
    inner = discovery_pb2.Resource.FromString(wrapped.value)
    assert inner.name == "gameday" and inner.ttl.seconds == 30 and inner.ttl.nanos == 500_000_000
    assert inner.resource.type_url == RUNTIME.url and inner.resource.value == resource.value
    delta = discovery_pb2.Resource.FromString(resource.delta_encoded())
    assert delta.version == resource.version and delta.ttl.ToMilliseconds() == 30_500 and delta.HasField("resource")
    beat = discovery_pb2.Resource.FromString(resource.heartbeat())
    assert (beat.name, beat.version, beat.HasField("resource")) == ("gameday", resource.version, False)
    plain = resource.plain()
    assert plain.ttl_ms == 0 and any_pb2.Any.FromString(plain.encoded).type_url == RUNTIME.url
    assert plain.plain() is plain and resource.plain() is plain


def test_the_view_without_ttls_has_the_same_versions_and_no_wrappers() -> None:
    ts = snapshot().types[RUNTIME.url]
    plain = ts.plain()
    assert plain is not ts and ts.plain() is plain
    assert (plain.version, plain.content_hash) == (ts.version, ts.content_hash)
    assert plain.resources["base"] is ts.resources["base"]
    assert not plain.ttls() and dict(ts.ttls()) == {"gameday": 30_000}
    body = discovery_pb2.DiscoveryResponse.FromString(plain.response(None).body)
    assert {r.type_url for r in body.resources} == {RUNTIME.url}
    assert ts.response(None).expiring is ts and plain.response(None).expiring is None
    # The names of a response's resources are read through the wrapper (a NACK names them).
    assert response_names(ts.response(None).body, 10) == (["base", "gameday"], 2)


def test_a_refresh_carries_the_held_resources_with_a_ttl_and_a_heartbeat_the_ones_at_their_version() -> None:
    ts = snapshot().types[RUNTIME.url]
    refresh = ts.refresh(frozenset({"gameday", "base"}))
    assert refresh.names == {"gameday"} and refresh.version == ts.version
    assert ts.refresh(frozenset({"base"})).carried == 0
    known = dict(ts.versions())
    found = ts.heartbeat(known)
    assert found is not None and found[1] == 1
    beat = discovery_pb2.DeltaDiscoveryResponse.FromString(found[0])
    assert [(r.name, r.HasField("resource")) for r in beat.resources] == [("gameday", False)]
    assert ts.heartbeat(known) is found, "memoized by what the clients have"
    assert ts.heartbeat({**known, "gameday": "another"}) is None, "a version the client does not have is not renewed"


def test_the_cache_serves_a_watch_of_a_client_that_takes_ttls_the_wrapped_resources_and_others_the_plain() -> None:
    cache = SnapshotCache()
    cache.set_snapshot(snapshot())
    got: dict[bool, list[str]] = {}
    answers: dict[bool, list[bool]] = {}

    def respond(watch: Watch, response: EncodedResponse) -> None:
        got[watch.ttl] = [a.type_url for a in discovery_pb2.DiscoveryResponse.FromString(response.body).resources]

    def respond_delta(watch: DeltaWatch, changes: DeltaChanges) -> None:
        resources = discovery_pb2.DeltaDiscoveryResponse.FromString(changes.body).resources
        answers[watch.ttl] = [r.HasField("ttl") for r in resources]

    for ttl in (True, False):
        subscription = next_subscription(["gameday"], wildcard_capable=False, ever_named=False)
        cache.create_watch(Watch(RUNTIME.url, subscription, None, frozenset(), False, ttl=ttl), respond)
        state = DeltaTypeState(TypeUrl(RUNTIME.url), wildcard_capable=False, started=True)
        cache.create_delta_watch(DeltaWatch(RUNTIME.url, False, frozenset({"gameday"}), state, ttl=ttl), respond_delta)
    assert got == {True: [RESOURCE_URL], False: [RUNTIME.url]}
    assert answers == {True: [True], False: [False]}


def test_a_stored_baseline_keeps_the_ttls() -> None:
    stored = decode_snapshots(encode_snapshots({"default": snapshot()}), where="test")  # type: ignore[dict-item]
    ts = stored["default"].types[RUNTIME.url]  # type: ignore[index]
    original = snapshot().types[RUNTIME.url]
    assert dict(ts.ttls()) == {"gameday": 30_000} and ts.version == original.version


def test_heartbeat_bodies_kept_per_type_snapshot_are_bounded() -> None:
    ts = snapshot().types[RUNTIME.url]
    versions = dict(ts.versions())
    # Streams at as many distinct places as a peer likes: each its own mapping of what it has.
    held = [dict(versions) for _ in range(500)]
    for known in held:
        assert ts.heartbeat(known) is not None
    assert len(ts._memo.heartbeats) <= 64
