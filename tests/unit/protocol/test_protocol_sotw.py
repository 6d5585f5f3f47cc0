"""The SotW state machine and cache, driven through docs/architecture.md, behaviours 2-13 with no I/O."""

from __future__ import annotations

import pytest
from conftest import CDS, EDS, LDS, RDS, RTDS, Received, StreamPair, assignment, build, cluster, layer, listener, route
from envoy.service.discovery.v3 import discovery_pb2

from pilotfish.cache import SnapshotCache
from pilotfish.errors import PeerError
from pilotfish.protocol import RequestKind, SotwStream
from pilotfish.resources import TypeUrl

V1 = build(
    clusters=[cluster("a"), cluster("b")],
    endpoints=[assignment("a", 1), assignment("b", 2)],
    listeners=[listener("l", "r")],
    routes=[route("r", "a")],
)


@pytest.fixture
def pair(cache: SnapshotCache) -> StreamPair:
    cache.set_snapshot(V1)
    return StreamPair(cache)


# 2. type URL and node ---------------------------------------------------------------------


def test_ads_request_without_type_url_is_a_protocol_error() -> None:
    with pytest.raises(PeerError, match="type_url"):
        SotwStream().on_request(discovery_pb2.DiscoveryRequest())


def test_per_type_stream_fills_in_its_type_and_refuses_others() -> None:
    stream = SotwStream(type_url=CDS)
    assert stream.on_request(discovery_pb2.DiscoveryRequest()).type_url == CDS
    with pytest.raises(PeerError, match="serves"):
        stream.on_request(discovery_pb2.DiscoveryRequest(type_url=LDS))


def test_node_comes_from_the_first_request_only(pair: StreamPair) -> None:
    [cds] = pair.send(CDS, node_id="envoy-1")
    pair.ack(cds)  # Envoy omits the node after the first message
    pair.send(EDS, ["a"], node_id="someone-else")
    assert pair.stream.node is not None and pair.stream.node.id == "envoy-1"


def test_two_streams_with_the_same_node_id_are_both_served(cache: SnapshotCache) -> None:
    cache.set_snapshot(V1)
    old, new = StreamPair(cache), StreamPair(cache)  # hot restart: two processes, one node id
    assert old.send(CDS, node_id="n")[0].names == ["a", "b"]
    assert new.send(CDS, node_id="n")[0].names == ["a", "b"]
    v2 = build(
        clusters=[cluster("a")],
        endpoints=[assignment("a", 1)],
        listeners=[listener("l", "r")],
        routes=[route("r", "a")],
    )
    old.ack(old.inbox[-1])
    new.ack(new.inbox[-1])
    cache.set_snapshot(v2)
    assert old.inbox[-1].names == new.inbox[-1].names == ["a"]


# 3. versions per type, nonces unique per stream -----------------------------------------


def test_versions_are_per_type_and_nonces_unique(pair: StreamPair) -> None:
    [cds] = pair.send(CDS)
    [eds] = pair.send(EDS, ["a", "b"])
    [lds] = pair.send(LDS)
    [rds] = pair.send(RDS, ["r"])
    assert len({cds.version, eds.version, lds.version, rds.version}) == 4
    assert len({cds.nonce, eds.nonce, lds.nonce, rds.nonce}) == 4


def test_explicit_version_is_every_types_version(cache: SnapshotCache) -> None:
    cache.set_snapshot(build(clusters=[cluster("a")], endpoints=[assignment("a", 1)], version="7"))
    p = StreamPair(cache)
    assert p.send(CDS)[0].version == "7"
    assert p.send(EDS, ["a"])[0].version == "7"


# 4-5. ACK and NACK --------------------------------------------------------------------


def test_ack_is_recognised_and_nothing_is_resent(pair: StreamPair) -> None:
    [cds] = pair.send(CDS)
    assert pair.ack(cds) == []
    assert pair.outcomes[-1].kind is RequestKind.ACK
    assert pair.stream.types[CDS].acked_version == cds.version


def test_nack_is_recorded_and_the_rejected_content_not_resent(pair: StreamPair, cache: SnapshotCache) -> None:
    [cds] = pair.send(CDS)
    pair.ack(cds)
    bad = build(clusters=[cluster("a", timeout="0s")], endpoints=[assignment("a", 1)])
    [rejected] = pair.publish(bad)
    # The proxy keeps running the last version it accepted and says so in version_info.
    reason = "ConnectTimeout: value must be greater than 0s"
    again = pair.send(CDS, version=cds.version, nonce=rejected.nonce, error=reason)
    outcome = pair.outcomes[-1]
    assert outcome.kind is RequestKind.NACK
    assert outcome.rejected_version == rejected.version
    assert outcome.error is not None and "ConnectTimeout" in outcome.error
    assert again == []  # not resent: no loop
    fixed = build(clusters=[cluster("a", timeout="2s")], endpoints=[assignment("a", 1)])
    [resent] = pair.publish(fixed)
    assert resent.version == fixed.version(CDS) != rejected.version


# 6. stale nonces ----------------------------------------------------------------------


def test_request_with_a_stale_nonce_is_ignored(pair: StreamPair, cache: SnapshotCache) -> None:
    [first] = pair.send(CDS)
    pair.ack(first)
    v2 = build(clusters=[cluster("a")], endpoints=[assignment("a", 1)])
    [second] = pair.publish(v2)
    # A late request answering the first response, even a NACK, changes nothing.
    assert pair.send(CDS, version=first.version, nonce=first.nonce, error="late") == []
    assert pair.outcomes[-1].kind is RequestKind.STALE
    assert pair.stream.types[CDS].acked_version == first.version
    pair.ack(second)
    assert pair.stream.types[CDS].acked_version == second.version


# 7. respond only on a new version or newly named resources ------------------------------


def test_new_names_are_sent_at_an_unchanged_version(pair: StreamPair) -> None:
    [eds] = pair.send(EDS, ["a"])
    assert eds.names == ["a"]
    [more] = pair.ack(eds, names=["a", "b"])
    assert more.version == eds.version
    assert more.names == ["b"], "only the newly named one: the proxy holds the other"
    assert pair.ack(more, names=["a"]) == []  # dropping a name needs no response


# 8. wildcard ------------------------------------------------------------------------


def test_wildcard_rules_for_clusters(pair: StreamPair) -> None:
    [everything] = pair.send(CDS)
    assert everything.names == ["a", "b"]
    [named] = pair.ack(everything, names=["a"])
    assert named.names == ["a"]
    [empty] = pair.ack(named, names=[])  # empty list after names: nothing
    assert empty.names == []
    [star] = pair.ack(empty, names=["*", "zzz"])
    assert star.names == ["a", "b"]


def test_a_wildcard_after_names_that_already_cover_everything_sends_nothing(pair: StreamPair) -> None:
    [named] = pair.send(CDS, ["a", "b"])
    assert named.names == ["a", "b"]
    # The proxy holds every cluster there is: switching to the wildcard changes nothing it holds,
    # and resending would repeat the very response (one it may have rejected).
    assert pair.ack(named, names=["*"]) == []
    assert pair.ack(named, names=["*", "a"]) == []
    v2 = build(
        clusters=[cluster("a"), cluster("b"), cluster("c")],
        endpoints=[assignment("a", 1), assignment("b", 2), assignment("c", 3)],
    )
    [everything] = pair.publish(v2)
    assert everything.names == ["a", "b", "c"]


def test_empty_endpoint_request_is_not_a_wildcard(pair: StreamPair) -> None:
    [eds] = pair.send(EDS, [])
    assert eds.names == []


# 9. full state for CDS/LDS ---------------------------------------------------------------


def test_cluster_responses_are_full_state(pair: StreamPair) -> None:
    [cds] = pair.send(CDS)
    pair.ack(cds)
    [after] = pair.publish(build(clusters=[cluster("b")], endpoints=[assignment("b", 2)]))
    assert after.names == ["b"]  # "a" omitted = removed


# 10. names that do not exist yet -----------------------------------------------------------


def test_requested_names_are_sent_when_they_appear(pair: StreamPair) -> None:
    [eds] = pair.send(EDS, ["a", "later"])
    assert eds.names == ["a"]
    assert pair.ack(eds, names=["a", "later"]) == []
    [appeared] = pair.publish(
        build(clusters=[cluster("a"), cluster("later")], endpoints=[assignment("a", 1), assignment("later", 3)])
    )
    assert appeared.names == ["later"], "what appeared: the proxy holds the other, unchanged"


# 11. reconnect -----------------------------------------------------------------------------


def test_reconnect_at_the_current_version_sends_nothing(cache: SnapshotCache) -> None:
    cache.set_snapshot(V1)
    assert StreamPair(cache).send(CDS, version=V1.version(CDS) or "") == []
    assert StreamPair(cache).send(EDS, ["a"], version=V1.version(EDS) or "") == []


def test_reconnect_with_an_older_version_gets_the_current_one(cache: SnapshotCache) -> None:
    cache.set_snapshot(V1)
    [cds] = StreamPair(cache).send(CDS, version="old")
    assert cds.version == V1.version(CDS)


# 12. ADS order -------------------------------------------------------------------------------


def test_one_change_is_sent_in_ads_order(pair: StreamPair) -> None:
    # Open watches on every type, in reverse order of ADS, at the current version.
    for type_url, names in ((RDS, ["r"]), (LDS, []), (EDS, ["a", "b"]), (CDS, [])):
        [response] = pair.send(type_url, names)
        pair.ack(response, names)
    v2 = build(
        clusters=[cluster("a", "3s"), cluster("b")],
        endpoints=[assignment("a", 5), assignment("b", 2)],
        listeners=[listener("l", "r", port=10001)],
        routes=[route("r", "b")],
    )
    assert [r.type_url for r in pair.publish(v2)] == [CDS, EDS, LDS, RDS]


# 13. warming --------------------------------------------------------------------------------


def test_endpoint_request_after_a_cluster_change_is_answered(pair: StreamPair) -> None:
    [cds] = pair.send(CDS)
    pair.ack(cds)
    [eds] = pair.send(EDS, ["a", "b"])
    pair.ack(eds, ["a", "b"])
    # Only cluster "a" changes; its endpoints do not.
    v2 = build(
        clusters=[cluster("a", "5s"), cluster("b")],
        endpoints=[assignment("a", 1), assignment("b", 2)],
        listeners=[listener("l", "r")],
        routes=[route("r", "a")],
    )
    [cds2] = pair.publish(v2)
    pair.ack(cds2)
    # Envoy re-creates "a" and asks for its endpoints again, repeating the last EDS nonce.
    [warm] = pair.send(EDS, ["a", "b"], version=eds.version, nonce=eds.nonce)
    assert warm.version == eds.version and warm.names == ["a", "b"]
    # Once answered, the same request is an ordinary ACK again.
    assert pair.ack(warm, ["a", "b"]) == []


def test_route_request_after_a_listener_change_is_answered(pair: StreamPair) -> None:
    [lds] = pair.send(LDS)
    pair.ack(lds)
    [rds] = pair.send(RDS, ["r"])
    pair.ack(rds, ["r"])
    v2 = build(
        clusters=[cluster("a"), cluster("b")],
        endpoints=[assignment("a", 1), assignment("b", 2)],
        listeners=[listener("l", "r", port=10002)],
        routes=[route("r", "a")],
    )
    [lds2] = pair.publish(v2)
    pair.ack(lds2)
    [warm] = pair.send(RDS, ["r"], version=rds.version, nonce=rds.nonce)
    assert warm.names == ["r"]


def test_a_watch_is_answered_when_the_snapshot_changes(pair: StreamPair) -> None:
    [cds] = pair.send(CDS)
    assert pair.ack(cds) == []
    assert pair.cache.watch_count() == 1
    [pushed] = pair.publish(build(clusters=[cluster("c")], endpoints=[assignment("c", 9)]))
    assert pushed.names == ["c"]
    assert pair.cache.watch_count() == 0  # answered once; the ACK opens the next one


# 12. make before break --------------------------------------------------------------------


def synced(pair: StreamPair) -> None:
    """Bring every type on the stream to the current snapshot, ACKed."""
    for type_url, names in ((CDS, []), (EDS, ["a", "b"]), (LDS, []), (RDS, ["r"])):
        [response] = pair.send(type_url, names)
        pair.ack(response, names)


def test_a_removed_cluster_stays_until_routes_have_moved(pair: StreamPair) -> None:
    synced(pair)  # route "r" sends traffic to cluster "a"
    v2 = build(
        clusters=[cluster("b")],
        endpoints=[assignment("b", 2)],
        listeners=[listener("l", "r")],
        routes=[route("r", "b")],
    )
    pushed = pair.publish(v2)
    # The clusters the proxy has ("a" and "b") stay as they are: its routes still use "a". The
    # endpoints of "b" did not change: the EDS response is the new version, carrying nothing.
    assert [(r.type_url, r.names) for r in pushed] == [(EDS, []), (RDS, ["r"])]
    eds, rds = pushed
    pair.ack(eds, ["a", "b"])
    # Once the proxy runs the new routes, "a" goes.
    [final] = pair.ack(rds, ["r"])
    assert final.type_url == CDS and final.names == ["b"]
    assert final.version == v2.version(CDS)
    assert pair.ack(final) == []


def test_a_proxy_that_rejects_the_new_routes_keeps_the_cluster(pair: StreamPair) -> None:
    synced(pair)
    v2 = build(
        clusters=[cluster("b")],
        endpoints=[assignment("b", 2)],
        listeners=[listener("l", "r")],
        routes=[route("r", "b")],
    )
    eds, rds = pair.publish(v2)
    pair.ack(eds, ["a", "b"])
    assert pair.send(RDS, ["r"], version=rds.version, nonce=rds.nonce, error="rejected") == []
    assert [r.names for r in pair.inbox if r.type_url == CDS] == [["a", "b"]]  # only the first


def test_unused_clusters_are_removed_at_once(pair: StreamPair) -> None:
    synced(pair)  # nothing routes to "b"
    v2 = build(
        clusters=[cluster("a")],
        endpoints=[assignment("a", 1)],
        listeners=[listener("l", "r")],
        routes=[route("r", "a")],
    )
    cds, eds = pair.publish(v2)
    assert (cds.type_url, cds.names) == (CDS, ["a"])
    assert (eds.type_url, eds.names) == (EDS, ["a"])


def test_a_new_proxy_gets_the_final_clusters(cache: SnapshotCache) -> None:
    cache.set_snapshot(V1)
    cache.set_snapshot(
        build(
            clusters=[cluster("b")],
            endpoints=[assignment("b", 2)],
            listeners=[listener("l", "r")],
            routes=[route("r", "b")],
        )
    )
    [cds] = StreamPair(cache).send(CDS)
    assert cds.names == ["b"]


def test_changed_clusters_arrive_at_once_while_a_used_one_is_kept(pair: StreamPair) -> None:
    synced(pair)
    v2 = build(
        clusters=[cluster("b", "4s")],
        endpoints=[assignment("b", 2)],
        listeners=[listener("l", "r")],
        routes=[route("r", "b")],
    )
    cds, _eds, rds = pair.publish(v2)
    assert (cds.type_url, cds.names) == (CDS, ["a", "b"])  # new "b", old "a" kept
    assert cds.version != v2.version(CDS)
    pair.ack(cds)
    [final] = pair.ack(rds, ["r"])
    assert (final.names, final.version) == (["b"], v2.version(CDS))


ROUTES_TO_C = build(
    clusters=[cluster("a"), cluster("b"), cluster("c")],
    endpoints=[assignment("a", 1), assignment("b", 2), assignment("c", 3)],
    listeners=[listener("l", "r")],
    routes=[route("r", "c")],
)
"""V1 plus cluster c, and route r sends traffic to it."""
ROUTES_TO_B = build(
    clusters=[cluster("a"), cluster("b")],
    endpoints=[assignment("a", 1), assignment("b", 2)],
    listeners=[listener("l", "r")],
    routes=[route("r", "b")],
)
"""No cluster c again, and route r sends traffic to b: routes neither V1's nor ROUTES_TO_C's."""


def clusters_sent(sent: list[Received]) -> list[list[str]]:
    return [r.names for r in sent if r.type_url == CDS]


def test_a_cluster_that_sent_routes_use_stays_though_the_acked_routes_are_the_new_ones(pair: StreamPair) -> None:
    """The proxy ACKs the clusters that bring c but not yet the routes sent with them (r -> c)
    when a snapshot drops c and points r back at a: the very routes the proxy ACKed before. It
    may be running r -> c already: c stays until it has ACKed routes that no longer use it."""
    synced(pair)
    cds, eds, rds = pair.publish(ROUTES_TO_C)
    assert (cds.names, rds.names) == (["a", "b", "c"], ["r"])
    pair.ack(cds)
    pair.ack(eds, ["a", "b", "c"])
    since = len(pair.inbox)
    pushed = pair.publish(V1)
    assert all("c" in names for names in clusters_sent(pushed)), "route r -> c was sent and may be in use"
    [back_to_a] = pair.ack(rds, ["r"])  # r -> c ACKed: r -> a (V1's) goes out
    assert (back_to_a.type_url, back_to_a.version) == (RDS, V1.version(RDS))
    assert all("c" in names for names in clusters_sent(pair.inbox[since:])), "not ACKed: it may reject r -> a"
    [final] = pair.ack(back_to_a, ["r"])
    assert (final.type_url, final.names, final.version) == (CDS, ["a", "b"], V1.version(CDS))
    assert pair.ack(final) == []


def test_a_proxy_that_acked_no_routes_yet_keeps_the_clusters_its_sent_routes_use(cache: SnapshotCache) -> None:
    """A new proxy ACKs its clusters before any listener or route: routes sent to it, not yet
    ACKed, still count (r -> c here), and c stays when the next snapshot drops it."""
    cache.set_snapshot(ROUTES_TO_C)
    pair = StreamPair(cache)
    [cds] = pair.send(CDS)
    pair.ack(cds)
    [lds] = pair.send(LDS)
    [to_c] = pair.send(RDS, ["r"])
    assert (cds.names, to_c.type_url) == (["a", "b", "c"], RDS)
    since = len(pair.inbox)
    pushed = pair.publish(ROUTES_TO_B)
    assert all("c" in names for names in clusters_sent(pushed)), "route r -> c was sent and may be in use"
    pair.ack(lds)
    [to_b] = pair.ack(to_c, ["r"])
    assert (to_b.type_url, to_b.version) == (RDS, ROUTES_TO_B.version(RDS))
    assert all("c" in names for names in clusters_sent(pair.inbox[since:]))
    [final] = pair.ack(to_b, ["r"])
    assert (final.type_url, final.names) == (CDS, ["a", "b"])


def test_routes_a_reconnecting_proxy_states_count_until_it_acks_others(cache: SnapshotCache) -> None:
    """A proxy reconnects stating routes that use c (r -> c), which the current snapshot removed:
    it is sent the current routes at once, but runs its own until it ACKs them, so its clusters
    keep c until then."""
    cache.set_snapshot(ROUTES_TO_C)
    cache.set_snapshot(ROUTES_TO_B)
    pair = StreamPair(cache)
    [to_b] = pair.send(RDS, ["r"], version=ROUTES_TO_C.version(RDS) or "")
    assert to_b.version == ROUTES_TO_B.version(RDS)
    # The clusters it states (a, b and c) are the bridge's: nothing to send, c is not taken away.
    assert pair.send(CDS, version=ROUTES_TO_C.version(CDS) or "") == [], "the proxy runs r -> c until it ACKs r -> b"
    [final] = pair.ack(to_b, ["r"])
    assert (final.type_url, final.names) == (CDS, ["a", "b"])


def test_the_stream_keeps_the_nodes_identity_not_its_extension_list() -> None:
    request = discovery_pb2.DiscoveryRequest(type_url=CDS)
    request.node.id, request.node.cluster = "edge-1", "edge"
    request.node.metadata.update({"zone": "a"})
    for i in range(500):  # Envoy lists every extension it was built with
        request.node.extensions.add(name=f"envoy.extension.{i}", category="envoy.filters")
    stream = SotwStream()
    stream.on_request(request)
    assert stream.node is not None
    assert (stream.node.id, stream.node.cluster, stream.node.metadata["zone"]) == ("edge-1", "edge", "a")
    assert len(stream.node.extensions) == 0


# runtime layers (RTDS): named, never wildcard, sent last on ADS --------------------------


def test_runtime_layers_are_sent_by_name_changed_at_once_and_nacks_are_kept(cache: SnapshotCache) -> None:
    cache.set_snapshot(build(clusters=[cluster("a")], runtime=[layer("flags", x=1), layer("other", y=2)]))
    p = StreamPair(cache)
    [empty] = p.send(RTDS)
    assert empty.names == [], "a runtime request naming nothing is not a wildcard"
    [got] = p.send(RTDS, ["flags", "missing"])
    assert got.type_url == RTDS and got.names == ["flags"]
    names = ["flags", "missing"]
    assert p.send(RTDS, names, version=got.version, nonce=got.nonce) == []
    assert [o.kind for o in p.outcomes][-1] is RequestKind.ACK
    [changed] = p.publish(build(clusters=[cluster("a")], runtime=[layer("flags", x=0), layer("other", y=2)]))
    assert changed.names == ["flags"] and changed.version != got.version
    assert p.send(RTDS, names, version=got.version, nonce=changed.nonce, error="bad layer") == []
    assert [o.kind for o in p.outcomes][-1] is RequestKind.NACK
    [appeared] = p.publish(build(clusters=[cluster("a")], runtime=[layer("flags", x=5), layer("missing", z=1)]))
    assert sorted(appeared.names) == ["flags", "missing"]


def test_one_change_sends_runtime_after_everything_else(pair: StreamPair) -> None:
    seen = [pair.send(CDS)[0], pair.send(EDS, ["a", "b"])[0], pair.send(LDS)[0], pair.send(RDS, ["r"])[0]]
    for got in seen:
        pair.ack(got, ["a", "b"] if got.type_url == EDS else ["r"] if got.type_url == RDS else [])
    [none] = pair.send(RTDS, ["flags"])
    assert none.names == [], "a layer that does not exist yet"
    pair.send(RTDS, ["flags"], version=none.version, nonce=none.nonce)
    v2 = build(
        clusters=[cluster("a", "2s"), cluster("b")],
        endpoints=[assignment("a", 3), assignment("b", 2)],
        listeners=[listener("l", "r", port=10001)],
        routes=[route("r", "b")],
        runtime=[layer("flags", on=True)],
    )
    sent = pair.publish(v2)
    assert [g.type_url for g in sent][-1] == RTDS and sent[-1].names == ["flags"]


# what CSDS reads: each resource's state ---------------------------------------------------------


def test_each_resource_reads_as_its_types_state_or_requested_or_does_not_exist(pair: StreamPair) -> None:
    def states() -> list[tuple[str, str, str]]:
        return [tuple(state) for state in pair.stream.resource_states(TypeUrl(EDS))]  # type: ignore[misc]

    [eds] = pair.send(EDS, ["a", "missing"])
    assert states() == [("a", eds.version, "UNKNOWN"), ("missing", "", "REQUESTED")]
    pair.ack(eds, names=["a", "missing"])
    assert states() == [("a", eds.version, "ACKED"), ("missing", "", "DOES_NOT_EXIST")]
    [changed] = pair.publish(build(clusters=[cluster("a")], endpoints=[assignment("a", 9)]))
    pair.send(EDS, ["a", "missing"], version=eds.version, nonce=changed.nonce, error="no")
    assert states() == [("a", eds.version, "NACKED"), ("missing", "", "DOES_NOT_EXIST")], "the version it runs"
    [cds] = pair.send(CDS)
    pair.ack(cds)
    assert [s.name for s in pair.stream.resource_states(TypeUrl(CDS))] == ["a"], "a wildcard: what it holds"
