"""The response memo's budget against a fleet: a peer asking for ever new name sets (far over the
budget) must not make 1,000 proxies at one version each get their own encoding of one response.

The proxies are real SotW state machines wired to a real cache, as ``xds/server.py`` wires them
(:class:`conftest.StreamPair`): each response goes through the stream's ``on_response``, which
keeps what it sent, as the server's streams do."""

from __future__ import annotations

import random

from conftest import EDS, StreamPair, assignment

from pilotfish.cache import SnapshotCache
from pilotfish.resources import CLUSTER, ENDPOINT
from pilotfish.resources.parse import parse_resource
from pilotfish.snapshot import MemoBudget, ResponseMemoLimits, Snapshot

LIMITS = ResponseMemoLimits(bytes=16 * 1024, entries=4)
"""Small: the peer's sets overflow it between any two proxies joining."""
SERVICES = [f"svc-{i:04d}" for i in range(1000)]
FLEET_NAMES = SERVICES[:20]


def snapshot(port: int) -> Snapshot:
    endpoints = [
        message for name in SERVICES if (message := parse_resource(ENDPOINT, assignment(name, port), "")[0]) is not None
    ]
    return Snapshot.build({ENDPOINT: endpoints, CLUSTER: []})  # counted in the cache's budget


def test_a_fleet_at_one_version_shares_one_encoded_response_while_a_peer_cycles_sets() -> None:
    cache = SnapshotCache(memo_budget=MemoBudget(LIMITS))
    cache.set_snapshot(snapshot(8000))
    rng = random.Random(19)
    peer = StreamPair(cache)
    fleet: list[StreamPair] = []
    for _ in range(1000):  # the fleet connects one by one; between two, the peer asks for 4 new sets
        for _ in range(4):
            peer.send(EDS, rng.sample(SERVICES, 30))
        proxy = StreamPair(cache)
        proxy.send(EDS, FLEET_NAMES)
        fleet.append(proxy)
    first = {id(body) for proxy in fleet for body in proxy.bodies}
    assert len(first) == 1, f"1,000 proxies at one version got {len(first)} encodings of their response"
    current = cache.snapshot()
    assert current is not None
    eds = current.get(EDS)
    assert eds is not None
    assert eds.memoized()[1] <= LIMITS.bytes  # the peer's sets: within the budget

    for proxy in fleet:
        proxy.ack(proxy.inbox[-1], FLEET_NAMES)
    peer.send(EDS, rng.sample(SERVICES, 30))
    cache.set_snapshot(snapshot(8001))  # a push: every proxy is sent the new version
    pushed = {id(proxy.bodies[-1]) for proxy in fleet if len(proxy.bodies) == 2}
    assert sum(len(proxy.bodies) == 2 for proxy in fleet) == 1000
    assert len(pushed) == 1, f"one push to 1,000 proxies was encoded {len(pushed)} times"


def test_two_caches_in_one_process_keep_budgets_of_their_own() -> None:
    """The budget is an object each cache makes (``serve`` makes the cache once), not a table the
    module keeps: a peer cycling sets on one server evicts nothing another server memoized, and
    each stays within its own bound."""
    quiet, busy = SnapshotCache(memo_budget=MemoBudget(LIMITS)), SnapshotCache(memo_budget=MemoBudget(LIMITS))
    assert quiet.memo_budget is not busy.memo_budget
    quiet.set_snapshot(snapshot(8000))
    busy.set_snapshot(snapshot(8000))
    kept = StreamPair(quiet)
    kept.send(EDS, FLEET_NAMES)
    quiet_eds = quiet.snapshot()
    assert quiet_eds is not None
    memoized = quiet_eds.get(EDS)
    assert memoized is not None and memoized.memoized()[0] == 1
    rng = random.Random(7)
    peer = StreamPair(busy)
    for _ in range(50):  # far over the busy server's budget
        peer.send(EDS, rng.sample(SERVICES, 30))
    assert memoized.memoized()[0] == 1, "another server's peer evicted this server's memoized response"
    assert busy.memo_budget.bytes <= LIMITS.bytes and len(busy.memo_budget.order) <= LIMITS.entries
    assert quiet.memo_budget.bytes <= LIMITS.bytes


def test_one_push_answers_each_proxy_with_what_it_lacks_though_responses_are_shared() -> None:
    # One pass of set_snapshot answers every waiting watch, and watches made alike (one
    # subscription at one version) share the response looked up for the first of them; a
    # proxy subscribed to other names gets its own.
    def built(changed: dict[str, int]) -> Snapshot:
        endpoints = [parse_resource(ENDPOINT, assignment(n, changed.get(n, 8000)), "")[0] for n in SERVICES[:40]]
        return Snapshot.build({ENDPOINT: [e for e in endpoints if e is not None], CLUSTER: []})

    cache = SnapshotCache()
    cache.set_snapshot(built({}))
    names, other = SERVICES[:20], SERVICES[10:30]
    fleet = {"a": StreamPair(cache), "b": StreamPair(cache), "other": StreamPair(cache)}
    for key, pair in fleet.items():
        subscribed = other if key == "other" else names
        pair.send(EDS, subscribed)
        pair.ack(pair.inbox[-1], subscribed)
    cache.set_snapshot(built({SERVICES[1]: 8001, SERVICES[15]: 8015}))
    got = {key: pair.inbox[-1] for key, pair in fleet.items()}
    assert got["a"].names == got["b"].names == [SERVICES[1], SERVICES[15]]
    assert fleet["a"].bodies[-1] is fleet["b"].bodies[-1]  # one response, shared
    assert got["other"].names == [SERVICES[15]]  # of its names, only svc-0015 changed
    assert got["a"].version == got["other"].version
