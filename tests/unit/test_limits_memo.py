"""The response memo's budget against a fleet: a peer asking for ever new name sets (far over the
budget) must not make 1,000 proxies at one version each get their own encoding of one response.

The proxies are real SotW state machines wired to a real cache, as ``server/xds.py`` wires them:
each request's watches go to the cache, and each response goes through the stream's
``on_response`` (which keeps what it sent, as the server's streams do)."""

from __future__ import annotations

import random

from conftest import EDS, assignment
from envoy.service.discovery.v3 import discovery_pb2

from pilotfish.cache import SnapshotCache
from pilotfish.protocol import SotwStream, Watch
from pilotfish.resources import CLUSTER, ENDPOINT
from pilotfish.resources.parse import parse_resource
from pilotfish.snapshot import EncodedResponse, ResponseMemoLimits, Snapshot

LIMITS = ResponseMemoLimits(bytes=64 * 1024, entries=64)
"""Small, so that the peer's sets overflow it many times over."""
SERVICES = [f"svc-{i:04d}" for i in range(1000)]
FLEET_NAMES = SERVICES[:200]


def snapshot(port: int) -> Snapshot:
    endpoints = [parse_resource(ENDPOINT, assignment(name, port), "")[0] for name in SERVICES]
    return Snapshot.build({ENDPOINT: endpoints, CLUSTER: []}, memo_limits=LIMITS)


class Proxy:
    """One stream: what it was sent (the bodies, as objects) and its latest response."""

    def __init__(self, cache: SnapshotCache) -> None:
        self.cache = cache
        self.stream = SotwStream()
        self.bodies: list[bytes] = []
        self.last: tuple[str, str] | None = None
        self._cancel = None

    def _respond(self, watch: Watch, response: EncodedResponse) -> None:
        nonce, sent = self.stream.on_response(watch, response)
        self.bodies.append(sent.body)
        self.last = (sent.version, nonce)

    def ask(self, names: list[str], *, version: str = "", nonce: str = "") -> None:
        request = discovery_pb2.DiscoveryRequest(type_url=EDS, resource_names=names, version_info=version,
                                                 response_nonce=nonce)
        request.node.id = "proxy"
        for watch in self.stream.on_request(request).watches:
            if self._cancel is not None:
                self._cancel()
            self._cancel = self.cache.create_watch(watch, self._respond)

    def ack(self, names: list[str]) -> None:
        assert self.last is not None
        self.ask(names, version=self.last[0], nonce=self.last[1])


def test_a_fleet_at_one_version_shares_one_encoded_response_while_a_peer_cycles_sets() -> None:
    cache = SnapshotCache()
    cache.set_snapshot(snapshot(8000))
    rng = random.Random(19)
    peer = Proxy(cache)
    fleet: list[Proxy] = []
    for _ in range(1000):  # the fleet connects one by one; between two, the peer asks for a new set
        peer.ask(rng.sample(SERVICES, 300))
        proxy = Proxy(cache)
        proxy.ask(FLEET_NAMES)
        fleet.append(proxy)
    first = {id(body) for proxy in fleet for body in proxy.bodies}
    assert len(first) == 1, f"1,000 proxies at one version got {len(first)} encodings of their response"
    current = cache.snapshot()
    assert current is not None
    eds = current.get(EDS)
    assert eds is not None
    assert eds.memoized()[1] <= LIMITS.bytes  # the peer's sets: within the budget

    for proxy in fleet:
        proxy.ack(FLEET_NAMES)
    peer.ask(rng.sample(SERVICES, 300))
    cache.set_snapshot(snapshot(8001))  # a push: every proxy is sent the new version
    pushed = {id(proxy.bodies[-1]) for proxy in fleet if len(proxy.bodies) == 2}
    assert sum(len(proxy.bodies) == 2 for proxy in fleet) == 1000
    assert len(pushed) == 1, f"one push to 1,000 proxies was encoded {len(pushed)} times"
