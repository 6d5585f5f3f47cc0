"""Reconnect, unsubscribe and resubscribe on a SotW stream, for EDS and RDS, through the cache.

What the proxy holds of a type decides whether a request is answered at an unchanged version:
the names of the last response (or, before any response on the stream, the names its first
request stated at its ``version_info``), minus every name it has since unsubscribed from. A
name it requests and does not hold is sent, "even at an unchanged version", whether or not the
stream has had a response yet; a name it holds is not sent again (no response loops), and a
response at a new version carries only what changed since the version the proxy holds (EDS and
RDS responses need not be full state). Each test states the proxy's requests and asserts exactly
what the server sent.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from conftest import CDS, EDS, LDS, RDS, Received, StreamPair, assignment, build, cluster, listener, route

from pilotfish.cache import SnapshotCache
from pilotfish.snapshot import Snapshot

V1 = build(
    clusters=[cluster("a"), cluster("b")],
    endpoints=[assignment("a", 1), assignment("b", 2)],
    listeners=[listener("l", "r"), listener("m", "s", port=10001)],
    routes=[route("r", "a"), route("s", "b")],
)
NAMES: dict[str, list[str]] = {EDS: ["a", "b"], RDS: ["r", "s"]}
"""Per type, two resources of V1: the proxy keeps the first and drops and re-adds the second."""

TYPES = pytest.mark.parametrize("type_url", [EDS, RDS], ids=["eds", "rds"])


def current(type_url: str, snapshot: Snapshot = V1) -> str:
    version = snapshot.version(type_url)
    assert version is not None
    return version


class Proxy:
    """One type of a proxy's stream: the subscription it states, and the nonce it last received."""

    def __init__(self, pair: StreamPair, type_url: str) -> None:
        self.pair = pair
        self.type_url = type_url
        self.version = ""
        self.nonce = ""

    def request(self, names: Sequence[str]) -> list[Received]:
        """Request ``names`` as Envoy does: its accepted version and the last nonce it received."""
        sent = self.pair.send(self.type_url, names, version=self.version, nonce=self.nonce)
        for response in sent:
            self.accept(response)
        return sent

    def accept(self, response: Received) -> None:
        assert response.type_url == self.type_url
        self.version, self.nonce = response.version, response.nonce


def names_sent(sent: list[Received]) -> list[list[str]]:
    return [r.names for r in sent]


@pytest.fixture
def pair(cache: SnapshotCache) -> StreamPair:
    cache.set_snapshot(V1)
    return StreamPair(cache)


# -- the first request of a stream ------------------------------------------------------------


@TYPES
@pytest.mark.parametrize("named", [True, False], ids=["names", "no-names"])
@pytest.mark.parametrize("version", ["current", "old", "fresh"])
def test_first_request_then_subscribing_to_everything(
    pair: StreamPair, type_url: str, named: bool, version: str
) -> None:
    """A first request with or without names, at the current, an old or no version; then a
    request for both names: the proxy ends up having been sent each name it does not hold."""
    proxy = Proxy(pair, type_url)
    proxy.version = {"current": current(type_url), "old": "old", "fresh": ""}[version]
    first = NAMES[type_url] if named else []
    sent = proxy.request(first)
    if version == "current":
        assert sent == [], "a proxy at the current version is sent nothing it holds"
    else:
        assert names_sent(sent) == [first]
        assert sent[0].version == current(type_url)

    both = proxy.request(NAMES[type_url])
    if named:
        assert both == [], "nothing new was named"
    else:
        # It stated no names: it holds none, whatever its version, and gets both.
        assert names_sent(both) == [NAMES[type_url]]
        assert both[0].version == current(type_url)
    assert proxy.request(NAMES[type_url]) == [], "the same request again: no loop"


# -- unsubscribe, then resubscribe --------------------------------------------------------------


def start(pair: StreamPair, type_url: str, how: str) -> Proxy:
    """A proxy subscribed to both names of ``type_url`` and holding both, reached in one of three
    ways: reconnected at the current version (no response on the stream), fresh (one response),
    or reconnected and then sent a response at the unchanged version for a newly named resource."""
    proxy = Proxy(pair, type_url)
    keep, other = NAMES[type_url]
    if how == "reconnected":
        proxy.version = current(type_url)
        assert proxy.request([keep, other]) == []
    elif how == "fresh":
        assert names_sent(proxy.request([keep, other])) == [[keep, other]]
    else:
        proxy.version = current(type_url)
        assert proxy.request([keep]) == []
        assert names_sent(proxy.request([keep, other])) == [[other]], "only the name it does not hold"
    return proxy


STARTS = pytest.mark.parametrize("how", ["reconnected", "fresh", "reconnected-then-sent"])
DROPS = pytest.mark.parametrize("drop", ["one", "all"])


@TYPES
@STARTS
@DROPS
def test_a_dropped_name_requested_again_is_sent_again(pair: StreamPair, type_url: str, how: str, drop: str) -> None:
    proxy = start(pair, type_url, how)
    keep, other = NAMES[type_url]
    # A listener (or cluster) goes away: the proxy unsubscribes and drops the resource.
    assert proxy.request([keep] if drop == "one" else []) == [], "unsubscribing needs no response"
    # It comes back: the proxy asks again at the same version, and must get it.
    [back] = proxy.request([keep, other])
    assert back.names == ([other] if drop == "one" else [keep, other]), "what it no longer holds"
    assert back.version == current(type_url), "same version: the content did not change"
    assert proxy.request([keep, other]) == [], "held again: the ACK is answered by nothing"


@TYPES
@STARTS
@DROPS
def test_dropping_and_adding_a_name_in_one_request(pair: StreamPair, type_url: str, how: str, drop: str) -> None:
    """Dropped names are forgotten even when the same request names nothing new."""
    proxy = start(pair, type_url, how)
    keep, other = NAMES[type_url]
    remaining = [keep] if drop == "one" else []
    assert proxy.request([*remaining, "missing"]) == [], "a name that does not exist is not sent"
    assert names_sent(proxy.request([*remaining, other, "missing"])) == [[other]]


@TYPES
@STARTS
def test_a_name_dropped_twice_is_sent_once_per_return(pair: StreamPair, type_url: str, how: str) -> None:
    proxy = start(pair, type_url, how)
    keep, other = NAMES[type_url]
    for _ in range(3):
        assert proxy.request([keep]) == []
        assert names_sent(proxy.request([keep, other])) == [[other]]
    assert proxy.request([keep, other]) == []


@TYPES
@STARTS
def test_the_kept_name_is_never_resent(pair: StreamPair, type_url: str, how: str) -> None:
    proxy = start(pair, type_url, how)
    keep, other = NAMES[type_url]
    assert proxy.request([keep]) == []
    assert proxy.request([keep]) == []
    assert proxy.request([other, keep]) != [], "the order of names does not matter"
    assert proxy.request([keep, other]) == []


@TYPES
@STARTS
def test_a_resource_changed_while_unsubscribed_comes_back_new(pair: StreamPair, type_url: str, how: str) -> None:
    proxy = start(pair, type_url, how)
    keep, other = NAMES[type_url]
    assert proxy.request([keep]) == []
    v2 = build(
        clusters=[cluster("a"), cluster("b")],
        endpoints=[assignment("a", 1), assignment("b", 3)],
        listeners=[listener("l", "r"), listener("m", "s", port=10001)],
        routes=[route("r", "a"), route("s", "a")],
    )
    # Only the dropped resource changed: the proxy is sent the new version, with nothing in it
    # (what it keeps did not change), and the new content of the other when it names it again.
    [pushed] = pair.publish(v2)
    proxy.accept(pushed)
    assert pushed.names == [] and pushed.version == current(type_url, v2)
    [back] = proxy.request([keep, other])
    assert back.names == [other] and back.version == current(type_url, v2)


@TYPES
def test_a_name_that_does_not_exist_when_requested_again_is_sent_when_it_appears(
    pair: StreamPair, type_url: str
) -> None:
    proxy = Proxy(pair, type_url)
    proxy.version = current(type_url)
    keep = NAMES[type_url][0]
    assert proxy.request([keep, "later"]) == []
    assert proxy.request([keep]) == []
    assert proxy.request([keep, "later"]) == [], "it still does not exist"
    v2 = build(
        clusters=[cluster("a"), cluster("b"), cluster("later")],
        endpoints=[assignment("a", 1), assignment("b", 2), assignment("later", 3)],
        listeners=[listener("l", "r"), listener("m", "s", port=10001)],
        routes=[route("r", "a"), route("s", "b"), route("later", "b")],
    )
    [appeared] = pair.publish(v2)
    assert appeared.names == ["later"], "what appeared, not what the proxy holds unchanged"


# -- requests crossing a response ------------------------------------------------------------------


@TYPES
def test_requests_sent_before_a_response_arrived(pair: StreamPair, type_url: str) -> None:
    """Requests without a nonce after a response was sent: the proxy has not seen it yet. Names it
    drops are dropped; what it names again is sent again (once more than needed, never less)."""
    keep, other = NAMES[type_url]
    [first] = pair.send(type_url, [keep, other])
    assert pair.send(type_url, [keep, other]) == [], "the response on its way answers it"
    assert pair.send(type_url, [keep]) == []
    [again] = pair.send(type_url, [keep, other])
    assert again.names == [other] and again.version == first.version
    assert pair.ack(first, [keep, other]) == [], "the first response's ACK is stale"
    assert pair.ack(again, [keep, other]) == []


@TYPES
def test_stale_requests_change_nothing(pair: StreamPair, type_url: str) -> None:
    keep, other = NAMES[type_url]
    [first] = pair.send(type_url, [keep, other])
    pair.ack(first, [keep])
    [second] = pair.send(type_url, [keep, other], version=first.version, nonce=first.nonce)
    # A late request carrying the first nonce is ignored, whatever it names.
    assert pair.send(type_url, [keep], version=first.version, nonce="1") == []
    assert pair.send(type_url, [keep, other], version=first.version, nonce="1") == []
    assert pair.ack(second, [keep, other]) == []


# -- NACK ----------------------------------------------------------------------------------------


@TYPES
def test_rejected_content_is_not_resent_but_a_name_named_again_is(pair: StreamPair, type_url: str) -> None:
    proxy = Proxy(pair, type_url)
    keep, other = NAMES[type_url]
    proxy.version = current(type_url)
    assert proxy.request([keep, other]) == []
    v2 = build(
        clusters=[cluster("a"), cluster("b")],
        endpoints=[assignment("a", 5), assignment("b", 6)],
        listeners=[listener("l", "r"), listener("m", "s", port=10001)],
        routes=[route("r", "b"), route("s", "a")],
    )
    [rejected] = pair.publish(v2)
    nack = pair.send(type_url, [keep, other], version=proxy.version, nonce=rejected.nonce, error="bad")
    assert nack == [], "the rejected content is not sent again"
    # Envoy's later requests carry the rejected nonce, its accepted version, and no error.
    assert pair.send(type_url, [keep, other], version=proxy.version, nonce=rejected.nonce) == []
    assert pair.send(type_url, [keep], version=proxy.version, nonce=rejected.nonce) == []
    [again] = pair.send(type_url, [keep, other], version=proxy.version, nonce=rejected.nonce)
    assert again.names == [other] and again.version == rejected.version, "a dropped name is named anew"


# -- warming on a reconnect --------------------------------------------------------------------


def changed_clusters_and_listeners() -> Snapshot:
    """V1 with every cluster and listener changed and the same endpoints and routes."""
    return build(
        clusters=[cluster("a", "2s"), cluster("b", "2s")],
        endpoints=[assignment("a", 1), assignment("b", 2)],
        listeners=[listener("l", "r", port=11000), listener("m", "s", port=11001)],
        routes=[route("r", "a"), route("s", "b")],
    )


WARMING = pytest.mark.parametrize(("parent", "child"), [(CDS, EDS), (LDS, RDS)], ids=["cds-eds", "lds-rds"])


@WARMING
@pytest.mark.parametrize("order", ["child-first", "parent-first"])
def test_reconnect_after_a_change_answers_the_repeated_child_request(
    cache: SnapshotCache, parent: str, child: str, order: str
) -> None:
    """The proxy reconnects with the old clusters (listeners) and the current endpoints (routes).
    Its new clusters re-subscribe to their endpoints at the same version, without a nonce: they
    warm and wait for an answer, which must come."""
    cache.set_snapshot(V1)
    v2 = changed_clusters_and_listeners()
    cache.set_snapshot(v2)
    assert v2.version(child) == V1.version(child)
    pair = StreamPair(cache)
    names = NAMES[child]
    if order == "child-first":
        # Envoy sends every type's first request at once; the server reads the child's first.
        assert pair.send(child, names, version=current(child)) == []
        [new] = pair.send(parent, version=current(parent))
        assert new.version == v2.version(parent)
        [warm] = pair.send(child, names, version=current(child))
    else:
        [new] = pair.send(parent, version=current(parent))
        # The child's first request was on its way before the proxy saw the parent's response.
        [warm] = pair.send(child, names, version=current(child))
    assert warm.names == names and warm.version == current(child)
    assert pair.ack(warm, names) == []
    assert pair.send(child, names, version=warm.version, nonce=warm.nonce) == []


def test_reconnect_at_the_current_version_of_every_type_sends_nothing(pair: StreamPair) -> None:
    for _ in range(2):  # first requests, then the same requests again (no warming without a change)
        assert pair.send(CDS, version=current(CDS)) == []
        assert pair.send(EDS, NAMES[EDS], version=current(EDS)) == []
        assert pair.send(LDS, version=current(LDS)) == []
        assert pair.send(RDS, NAMES[RDS], version=current(RDS)) == []


def test_a_restored_listener_gets_its_routes_after_a_reconnect(cache: SnapshotCache) -> None:
    """The issue's story, on an ADS stream: reconnect at the current versions, a listener goes
    away and comes back; its route configuration (unchanged) is sent again at once."""
    cache.set_snapshot(V1)
    pair = StreamPair(cache)
    assert pair.send(CDS, version=current(CDS)) == []
    assert pair.send(EDS, ["a", "b"], version=current(EDS)) == []
    assert pair.send(LDS, version=current(LDS)) == []
    assert pair.send(RDS, ["r", "s"], version=current(RDS)) == []
    without_m = build(
        clusters=[cluster("a"), cluster("b")],
        endpoints=[assignment("a", 1), assignment("b", 2)],
        listeners=[listener("l", "r")],
        routes=[route("r", "a"), route("s", "b")],
    )
    [lds] = pair.publish(without_m)
    assert lds.names == ["l"]
    assert pair.ack(lds) == []
    # Listener m's route is dropped. After a listener change the next route request is answered
    # (behaviour 13: a re-created listener waits for its routes), at the same version.
    [warm] = pair.send(RDS, ["r"], version=current(RDS))
    assert warm.names == ["r"] and warm.version == current(RDS)
    assert pair.ack(warm, ["r"]) == []
    [lds_back] = pair.publish(V1)
    assert lds_back.names == ["l", "m"]
    assert pair.ack(lds_back) == []
    [routes] = pair.ack(warm, ["r", "s"])
    assert routes.names == ["r", "s"] and routes.version == current(RDS)
    assert pair.ack(routes, ["r", "s"]) == []
