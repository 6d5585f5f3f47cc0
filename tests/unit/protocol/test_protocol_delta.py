"""The delta (incremental) xDS state machine through the cache, no I/O: docs/architecture.md, behaviour 14.

A :class:`DeltaPair` is a client's delta stream wired to a real cache, as ``xds/server.py`` wires
it; each test states the client's requests and asserts exactly what it was sent and told removed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import pytest
from conftest import CDS, EDS, LDS, RDS, RTDS, assignment, build, cluster, layer, listener, route
from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.endpoint.v3 import endpoint_pb2
from envoy.service.discovery.v3 import discovery_pb2
from google.protobuf import json_format

from pilotfish.cache import Cancel, SnapshotCache
from pilotfish.errors import PeerError
from pilotfish.protocol import (
    DeltaKind,
    DeltaOutcome,
    DeltaStream,
    DeltaTypeState,
    DeltaWatch,
    PeerOverLimit,
    XdsLimits,
)
from pilotfish.resources import LISTENER as LISTENER_TYPE
from pilotfish.resources import TypeUrl
from pilotfish.resources.wire import nonce_field
from pilotfish.snapshot import DeltaChanges, Resource, Snapshot

V1 = build(
    clusters=[cluster("a"), cluster("b")],
    endpoints=[assignment("a", 1), assignment("b", 2)],
    listeners=[listener("l", "r")],
    routes=[route("r", "a")],
)


@dataclass
class Got:
    """A DeltaDiscoveryResponse as the client decodes it."""

    type_url: str
    nonce: str
    system_version: str
    versions: dict[str, str]
    """Name -> version of each resource it carries."""
    removed: list[str]

    @property
    def names(self) -> list[str]:
        return sorted(self.versions)


@dataclass
class DeltaPair:
    """A delta stream and the server side, wired through a real cache, with no I/O. Each request
    is encoded and read back by :meth:`DeltaStream.decode_request` (which may find a plain ACK by
    its bytes alone); a twin stream is fed it decoded (:meth:`DeltaStream.on_request`) and every
    response: after each request both must agree on the outcome and on what the stream has seen."""

    cache: SnapshotCache
    stream: DeltaStream = field(default_factory=DeltaStream)
    inbox: list[Got] = field(default_factory=list)
    outcomes: list[DeltaOutcome] = field(default_factory=list)
    _cancels: dict[TypeUrl, Cancel] = field(default_factory=dict)
    _current: dict[TypeUrl, DeltaWatch] = field(default_factory=dict)
    twin: DeltaStream = field(default_factory=DeltaStream)
    _twin_current: dict[TypeUrl, DeltaWatch] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.twin = DeltaStream(type_url=self.stream.type_url, limits=self.stream.limits)

    def _respond(self, watch: DeltaWatch, changes: DeltaChanges) -> None:
        if self._current.get(changes.type_url) is not watch:
            return
        twin_nonce, twin_again = self.twin.on_response(self._twin_current[changes.type_url], changes)
        self._twin_current.update((w.type_url, w) for w in twin_again)
        nonce, again = self.stream.on_response(watch, changes)
        assert nonce == twin_nonce
        decoded = discovery_pb2.DeltaDiscoveryResponse.FromString(changes.body + nonce_field(nonce))
        for resource in decoded.resources:  # every resource carries a decodable message of its type
            message = cluster_pb2.Cluster() if decoded.type_url == CDS else endpoint_pb2.ClusterLoadAssignment()
            if decoded.type_url in (CDS, EDS):
                assert resource.resource.Unpack(message)
                assert getattr(message, "name" if decoded.type_url == CDS else "cluster_name") == resource.name
        self.inbox.append(
            Got(
                decoded.type_url,
                decoded.nonce,
                decoded.system_version_info,
                {r.name: r.version for r in decoded.resources},
                list(decoded.removed_resources),
            )
        )
        for due in again:  # as xds/server.py: warming watches open at once
            self._open(due)

    def send(
        self,
        type_url: str,
        subscribe: Sequence[str] = (),
        unsubscribe: Sequence[str] = (),
        *,
        nonce: str = "",
        error: str | None = None,
        initial: Mapping[str, str] | None = None,
    ) -> list[Got]:
        request = discovery_pb2.DeltaDiscoveryRequest(
            type_url=type_url,
            resource_names_subscribe=list(subscribe),
            resource_names_unsubscribe=list(unsubscribe),
            response_nonce=nonce,
            initial_resource_versions=dict(initial or {}),
        )
        if error is not None:
            request.error_detail.message = error
        data = request.SerializeToString()
        try:
            outcome = self.stream.on_decoded(self.stream.decode_request(data))
        except PeerError as exc:
            with pytest.raises(type(exc)):
                self.twin.on_request(discovery_pb2.DeltaDiscoveryRequest.FromString(data))
            raise
        expected = self.twin.on_request(discovery_pb2.DeltaDiscoveryRequest.FromString(data))
        assert (outcome, self.stream.types, self.stream.node, self.stream.ttl) == (
            expected,
            self.twin.types,
            self.twin.node,
            self.twin.ttl,
        )
        self._twin_current.update((w.type_url, w) for w in expected.watches)
        self.outcomes.append(outcome)
        before = len(self.inbox)
        for watch in outcome.watches:
            self._open(watch)
        return self.inbox[before:]

    def _open(self, watch: DeltaWatch) -> None:
        previous = self._cancels.pop(watch.type_url, None)
        if previous:
            previous()
        self._current[watch.type_url] = watch
        self._cancels[watch.type_url] = self.cache.create_delta_watch(watch, self._respond)

    def ack(self, got: Got, *, error: str | None = None) -> list[Got]:
        return self.send(got.type_url, nonce=got.nonce, error=error)

    def publish(self, snapshot: Snapshot) -> list[Got]:
        before = len(self.inbox)
        self.cache.set_snapshot(snapshot)
        return self.inbox[before:]


@pytest.fixture
def pair(cache: SnapshotCache) -> DeltaPair:
    cache.set_snapshot(V1)
    return DeltaPair(cache)


def versions(snapshot: Snapshot, type_url: str) -> dict[str, str]:
    current = snapshot.get(type_url)
    assert current is not None
    return dict(current.versions())


# -- wildcard and explicit subscriptions ----------------------------------------------------------


def test_a_first_cds_request_naming_nothing_is_a_wildcard_subscription(pair: DeltaPair) -> None:
    [got] = pair.send(CDS)
    assert got.versions == versions(V1, CDS) and got.removed == []
    assert got.system_version == V1.version(CDS)
    assert pair.ack(got) == [], "an ACK of what it has needs nothing"
    assert pair.outcomes[-1].kind is DeltaKind.ACK and pair.outcomes[-1].version == V1.version(CDS)


def test_versions_are_content_hashes_the_same_in_every_snapshot_built_alike() -> None:
    again = build(clusters=[cluster("b"), cluster("a")], endpoints=[assignment("a", 1), assignment("b", 2)])
    assert versions(again, CDS) == versions(V1, CDS) and versions(again, EDS) == versions(V1, EDS)


def test_eds_is_sent_only_what_is_named_and_told_once_what_does_not_exist(pair: DeltaPair) -> None:
    [got] = pair.send(EDS, ["a", "missing"])
    assert got.names == ["a"] and got.removed == ["missing"], "a named resource that does not exist"
    assert pair.ack(got) == []
    assert pair.send(EDS, ["missing"]) == [], "subscribing to it again: already told"
    later = build(
        clusters=[cluster("a"), cluster("missing")],
        endpoints=[assignment("a", 1), assignment("b", 2), assignment("missing", 7)],
    )
    [appeared] = pair.publish(later)
    assert appeared.names == ["missing"] and appeared.removed == []


def test_one_changed_resource_is_all_that_is_sent_and_a_removed_one_is_removed(pair: DeltaPair) -> None:
    pair.ack(pair.send(CDS)[0])
    pair.ack(pair.send(EDS, ["a", "b"])[0])
    v2 = build(
        clusters=[cluster("a")],
        endpoints=[assignment("a", 1, 3)],
        listeners=[listener("l", "r")],
        routes=[route("r", "a")],
    )
    cds, eds = pair.publish(v2)
    assert (cds.type_url, cds.names, cds.removed) == (CDS, [], ["b"])
    assert (eds.type_url, eds.names, eds.removed) == (EDS, ["a"], ["b"])
    assert eds.versions["a"] == versions(v2, EDS)["a"] != versions(V1, EDS)["a"]


def test_wildcard_plus_names_and_leaving_the_wildcard(pair: DeltaPair) -> None:
    [got] = pair.send(CDS, ["*", "extra"])
    assert got.names == ["a", "b"] and got.removed == ["extra"]
    pair.ack(got)
    # Leaving the wildcard: the client drops what only the wildcard covered; nothing to send.
    assert pair.send(CDS, ["a"], ["*"], nonce=got.nonce) == []
    v2 = build(clusters=[cluster("a", "2s"), cluster("b", "2s")], endpoints=[assignment("a", 1)])
    [changed] = pair.publish(v2)
    assert changed.names == ["a"], "only the named one, now that the wildcard is gone"


def test_unsubscribed_names_are_forgotten_and_sent_again_when_subscribed_again(pair: DeltaPair) -> None:
    [got] = pair.send(EDS, ["a", "b"])
    assert pair.send(EDS, unsubscribe=["b"], nonce=got.nonce) == []
    [again] = pair.send(EDS, ["b"], nonce=got.nonce)
    assert again.names == ["b"]


def test_subscription_changes_apply_with_a_stale_nonce(pair: DeltaPair) -> None:
    [first] = pair.send(EDS, ["a"])
    [second] = pair.send(EDS, ["b"], nonce=first.nonce)
    assert second.names == ["b"]
    # A request carrying the first (now stale) nonce still subscribes: but it is no ACK.
    v2 = build(clusters=[cluster("a")], endpoints=[assignment("a", 1), assignment("b", 2), assignment("c", 3)])
    pair.publish(v2)
    [third] = pair.send(EDS, ["c"], nonce=first.nonce)
    assert pair.outcomes[-1].kind is DeltaKind.STALE
    assert third.names == ["c"]


# -- reconnecting ---------------------------------------------------------------------------------


def test_a_reconnecting_client_that_has_everything_is_sent_nothing(pair: DeltaPair) -> None:
    assert pair.send(CDS, initial=versions(V1, CDS)) == []
    assert pair.send(EDS, ["a", "b"], initial=versions(V1, EDS)) == []


def test_a_reconnecting_client_is_sent_what_differs_and_told_what_is_gone(pair: DeltaPair) -> None:
    had = {**versions(V1, CDS), "gone": "0123456789abcdef"}
    had["a"] = "stale-version"
    [got] = pair.send(CDS, initial=had)
    assert got.names == ["a"] and got.removed == ["gone"]


def test_initial_versions_count_only_on_the_first_request_of_a_type(pair: DeltaPair) -> None:
    [got] = pair.send(EDS, ["a"])
    assert pair.send(EDS, ["b"], nonce=got.nonce, initial={"b": versions(V1, EDS)["b"]})[0].names == ["b"]


# -- NACK -----------------------------------------------------------------------------------------


def test_a_nack_is_recorded_and_the_rejected_content_is_not_sent_again(pair: DeltaPair) -> None:
    pair.ack(pair.send(CDS)[0])
    v2 = build(clusters=[cluster("a", "2s"), cluster("b")], endpoints=[assignment("a", 1), assignment("b", 2)])
    [rejected] = pair.publish(v2)
    assert pair.ack(rejected, error="bad cluster") == []
    outcome = pair.outcomes[-1]
    assert outcome.kind is DeltaKind.NACK and outcome.version == v2.version(CDS) and outcome.error == "bad cluster"
    v3 = build(clusters=[cluster("a", "3s"), cluster("b")], endpoints=[assignment("a", 1), assignment("b", 2)])
    [fixed] = pair.publish(v3)
    assert fixed.names == ["a"]


# -- warming and make before break ----------------------------------------------------------------


def test_a_changed_cluster_is_followed_by_its_endpoints_even_if_they_did_not_change(pair: DeltaPair) -> None:
    pair.ack(pair.send(CDS)[0])
    pair.ack(pair.send(EDS, ["a", "b"])[0])
    v2 = build(
        clusters=[cluster("a", "2s"), cluster("b")],
        endpoints=[assignment("a", 1), assignment("b", 2)],
        listeners=[listener("l", "r")],
        routes=[route("r", "a")],
    )
    cds, eds = pair.publish(v2)
    assert cds.names == ["a"]
    assert eds.names == ["a"], "the re-created cluster's endpoints, unchanged, for its warming"


def test_a_removed_cluster_stays_until_the_routes_have_moved(pair: DeltaPair) -> None:
    """Cluster a, and its endpoints (the bridge keeps both), stay while route r sends traffic to
    it; once the client ACKs the route that no longer does, the cluster goes, then its endpoints."""
    for type_url, names in ((CDS, []), (EDS, ["a", "b"]), (LDS, []), (RDS, ["r"])):
        pair.ack(pair.send(type_url, names)[0])
    v2 = build(
        clusters=[cluster("b")],
        endpoints=[assignment("b", 2)],
        listeners=[listener("l", "r")],
        routes=[route("r", "b")],
    )
    [to_b] = pair.publish(v2)
    assert (to_b.type_url, to_b.names, to_b.removed) == (RDS, ["r"], []), (
        "cluster a and its endpoints stay while route r still sends traffic to it"
    )
    assert [(g.type_url, g.names, g.removed) for g in pair.ack(to_b)] == [(CDS, [], ["a"]), (EDS, [], ["a"])]


def test_a_cluster_on_its_way_to_the_routes_comes_even_if_the_next_snapshot_drops_it(cache: SnapshotCache) -> None:
    """A client reconnects with an older cluster a and has not ACKed the clusters answer (Envoy
    holds a clusters ACK while a cluster warms) when a snapshot adds cluster c with route r sending
    to it, and the next one drops c and points r back at a before the client ACKs. Its route went out first (a clusters
    answer waits for the ACK of the last one) and still sends to c: the next clusters answer brings
    c (the bridge: a later snapshot does not take it off its way), and c goes only once the route
    has moved and that is ACKed (make before break)."""
    cache.set_snapshot(V1)
    v2 = build(
        clusters=[cluster("a"), cluster("b"), cluster("c")],
        endpoints=[assignment("a", 1), assignment("b", 2), assignment("c", 3)],
        listeners=[listener("l", "r")],
        routes=[route("r", "c")],
    )
    pair = DeltaPair(cache)
    [clusters] = pair.send(CDS, initial={**versions(V1, CDS), "a": "an older a"})
    assert pair.send(RDS, ["r"], initial=versions(V1, RDS)) == []
    [to_c] = pair.publish(v2)
    assert (to_c.type_url, to_c.names) == (RDS, ["r"]), "the clusters answer waits for the client's ACK"
    assert pair.publish(V1) == []
    [bridge] = pair.ack(clusters)
    assert (bridge.names, bridge.removed) == (["c"], []), "route r still sends traffic to c"
    [to_a] = pair.ack(to_c)
    assert (to_a.type_url, to_a.versions) == (RDS, versions(V1, RDS))
    [final] = pair.ack(to_a)
    assert (final.type_url, final.names, final.removed) == (CDS, [], ["c"])


def test_a_kept_cluster_sent_again_warms_with_its_endpoints(cache: SnapshotCache) -> None:
    """The client has not ACKed its clusters when cluster a changes and the next snapshot drops
    it (route r, not yet moved, sends traffic to a): the clusters answer after its ACK brings the
    changed a (the bridge), which Envoy warms and waits for its endpoints. They come, the last
    ones a had: not a removal, which would leave the new a with no endpoints while r still sends
    traffic to it."""
    cache.set_snapshot(V1)
    pair = DeltaPair(cache)
    for type_url, names in ((EDS, ["a", "b"]), (LDS, []), (RDS, ["r"])):
        pair.ack(pair.send(type_url, names)[0])
    clusters, warming = pair.send(CDS)
    assert (clusters.type_url, warming.type_url) == (CDS, EDS)
    pair.ack(warming)
    a_changed = build(
        clusters=[cluster("a", "2s"), cluster("b")],
        endpoints=[assignment("a", 1), assignment("b", 2)],
        listeners=[listener("l", "r")],
        routes=[route("r", "a")],
    )
    assert pair.publish(a_changed) == [], "the clusters answer waits for the client's ACK"
    v3 = build(
        clusters=[cluster("b")],
        endpoints=[assignment("b", 2)],
        listeners=[listener("l", "r")],
        routes=[route("r", "b")],
    )
    [to_b] = pair.publish(v3)
    assert (to_b.type_url, to_b.removed) == (RDS, [])
    cds, eds = pair.ack(clusters)
    assert (cds.type_url, cds.versions, cds.removed) == (CDS, {"a": versions(a_changed, CDS)["a"]}, [])
    assert (eds.type_url, eds.versions, eds.removed) == (EDS, {"a": versions(V1, EDS)["a"]}, []), "a warms"
    pair.ack(cds)
    pair.ack(eds)
    assert [(g.type_url, g.removed) for g in pair.ack(to_b)] == [(CDS, ["a"]), (EDS, ["a"])]


# -- sharing and limits ----------------------------------------------------------------------------


def test_streams_at_the_same_place_share_one_encoded_answer(cache: SnapshotCache) -> None:
    cache.set_snapshot(V1)
    pairs = [DeltaPair(cache) for _ in range(3)]
    for p in pairs:
        p.ack(p.send(EDS, ["a", "b"])[0])
    seen: list[DeltaChanges] = []
    for p in pairs:
        original = p._respond

        def spy(watch: DeltaWatch, changes: DeltaChanges, original=original) -> None:  # type: ignore[no-untyped-def]
            seen.append(changes)
            original(watch, changes)

        p._respond = spy  # type: ignore[method-assign]
        p.ack(p.inbox[-1])
    cache.set_snapshot(build(clusters=[cluster("a")], endpoints=[assignment("a", 9), assignment("b", 2)]))
    assert len(seen) == 3 and all(s is seen[0] for s in seen), "one answer, encoded once, for all three"


def test_a_request_over_the_names_limit_is_refused(cache: SnapshotCache) -> None:
    cache.set_snapshot(V1)
    stream = DeltaStream(limits=XdsLimits(max_resource_names=10))
    request = discovery_pb2.DeltaDiscoveryRequest(type_url=EDS, resource_names_subscribe=[f"n{i}" for i in range(11)])
    with pytest.raises(PeerOverLimit, match="max_resource_names"):
        stream.on_request(request)
    # Nor can a stream grow its subscription past it ten names at a time.
    stream = DeltaStream(limits=XdsLimits(max_resource_names=10))
    ten = [f"a{i}" for i in range(10)]
    stream.on_request(discovery_pb2.DeltaDiscoveryRequest(type_url=EDS, resource_names_subscribe=ten))
    with pytest.raises(PeerOverLimit, match="subscribes to 11"):
        stream.on_request(discovery_pb2.DeltaDiscoveryRequest(type_url=EDS, resource_names_subscribe=["one more"]))


def test_an_ads_request_without_type_url_is_a_protocol_error() -> None:
    with pytest.raises(PeerError, match="type_url"):
        DeltaStream().on_request(discovery_pb2.DeltaDiscoveryRequest())


def test_runtime_layers_are_sent_by_name_and_a_removed_layer_is_removed(cache: SnapshotCache) -> None:
    cache.set_snapshot(build(clusters=[cluster("a")], runtime=[layer("flags", x=1), layer("other", y=2)]))
    p = DeltaPair(cache)
    [got] = p.send(RTDS, ["flags", "missing"])
    assert list(got.versions) == ["flags"] and got.removed == ["missing"]
    assert p.ack(got) == [] and p.outcomes[-1].kind is DeltaKind.ACK
    [changed] = p.publish(build(clusters=[cluster("a")], runtime=[layer("flags", x=0), layer("other", y=3)]))
    assert list(changed.versions) == ["flags"] and changed.versions["flags"] != got.versions["flags"]
    p.ack(changed)
    [gone] = p.publish(build(clusters=[cluster("a")], runtime=[layer("other", y=3)]))
    assert gone.versions == {} and gone.removed == ["flags"]


# -- what CSDS reads: each resource's state ---------------------------------------------------------


def test_each_resource_reads_requested_unknown_acked_nacked_or_does_not_exist(pair: DeltaPair) -> None:
    def states() -> list[tuple[str, str, str]]:
        return [tuple(state) for state in pair.stream.resource_states(TypeUrl(EDS))]  # type: ignore[misc]

    assert states() == []
    [got] = pair.send(EDS, ["a", "missing"])
    a = got.versions["a"]
    assert states() == [("a", a, "UNKNOWN"), ("missing", "", "DOES_NOT_EXIST")]
    pair.ack(got)
    assert states() == [("a", a, "ACKED"), ("missing", "", "DOES_NOT_EXIST")]
    [changed] = pair.publish(build(clusters=[cluster("a")], endpoints=[assignment("a", 9)]))
    pair.ack(changed, error="no")
    assert states() == [("a", a, "NACKED"), ("missing", "", "DOES_NOT_EXIST")], "NACKED: the version it runs"
    pair.stream.types[TypeUrl(EDS)].names = frozenset({"a", "missing", "new"})  # asked, not answered yet
    assert states()[-1] == ("new", "", "REQUESTED")


@pytest.mark.parametrize("ttl", [True, False])
def test_routes_with_a_ttl_count_as_moved_by_the_versions_the_client_was_served(ttl: bool) -> None:
    message = json_format.ParseDict(listener("l", "r"), LISTENER_TYPE.message())
    listeners = [Resource.of(LISTENER_TYPE, message, ttl_ms=30_000)]
    snapshot = Snapshot.build({LISTENER_TYPE: listeners})
    served = snapshot.types[TypeUrl(LDS)] if ttl else snapshot.types[TypeUrl(LDS)].plain()
    state = DeltaTypeState(TypeUrl(LDS), wildcard_capable=True, started=True, wildcard=True)
    state.known = state.acked_known = dict(served.versions())
    watch = DeltaWatch(TypeUrl(CDS), True, frozenset(), state, routing={TypeUrl(LDS): state}, ttl=ttl)
    assert watch.routing_moved(snapshot), "its listeners are the snapshot's, as it was served them"
