"""Bytes encoded per push: does a fleet at one version still share one encoded response?

In one process, with no I/O: N proxies (real SotW state machines on a real cache, as
``xds/server.py`` wires them) subscribe to the endpoints of every service and ACK what they get;
then ``pushes`` endpoint changes are published one after another. Every DiscoveryResponse body the
snapshots encode is counted (``pilotfish.snapshot.discovery_response`` is wrapped): at the initial
sync (the proxies connecting one by one) and per push. With ``--peer``, a peer asks for a new
random half of the services before each proxy connects and before each push, 40 at a time: far
more than the memo's budget.

Run it on this checkout, and on another one for a side-by-side (``PYTHONPATH=OTHER/src``)::

    .venv/bin/python -m bench.bench_memo --proxies 1000
    .venv/bin/python -m bench.bench_memo --proxies 1000 --peer
"""

from __future__ import annotations

import argparse
import random
import time
from typing import Any

from envoy.service.discovery.v3 import discovery_pb2
from google.protobuf.message import Message

import pilotfish.snapshot as snapshot_module
from pilotfish.cache import SnapshotCache
from pilotfish.protocol import SotwStream
from pilotfish.resources import CLUSTER, ENDPOINT
from pilotfish.resources.parse import parse_resource
from pilotfish.snapshot import Snapshot

EDS = ENDPOINT.url
_encoded: list[int] = []


def _count_encodings() -> None:
    namespace = vars(snapshot_module)  # where TypeSnapshot looks the encoder up
    original = namespace["discovery_response"]

    def counting(*args: Any, **kwargs: Any) -> bytes:
        body: bytes = original(*args, **kwargs)
        _encoded.append(len(body))
        return body

    namespace["discovery_response"] = counting


def build(services: list[str], change: int) -> Snapshot:
    """Every service with 4 endpoints; service ``change % len`` (after the first build) on other ports."""
    assignments: list[Message] = []
    for i, name in enumerate(services):
        base = 20000 if change and i == change % len(services) else 10000
        ports = [base + change * 4 + k if base == 20000 else base + k for k in range(4)]
        message, problems = parse_resource(
            ENDPOINT,
            {
                "cluster_name": name,
                "endpoints": [
                    {
                        "lb_endpoints": [
                            {"endpoint": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": p}}}}
                            for p in ports
                        ]
                    }
                ],
            },
            "",
        )
        assert message is not None, problems
        assignments.append(message)
    return Snapshot.build({ENDPOINT: assignments, CLUSTER: []})


class Proxy:
    __slots__ = ("cache", "cancel", "last", "stream")

    def __init__(self, cache: SnapshotCache) -> None:
        self.cache = cache
        self.stream = SotwStream()
        self.last: tuple[str, str] | None = None
        self.cancel: Any = None

    def respond(self, watch: Any, response: Any) -> None:
        nonce, sent = self.stream.on_response(watch, response)
        self.last = (sent.version, nonce)

    def ask(self, names: list[str], version: str = "", nonce: str = "") -> None:
        request = discovery_pb2.DiscoveryRequest(
            type_url=EDS, resource_names=names, version_info=version, response_nonce=nonce
        )
        request.node.id = "proxy"
        for watch in self.stream.on_request(request).watches:
            if self.cancel is not None:
                self.cancel()
            self.cancel = self.cache.create_watch(watch, self.respond)


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.bench_memo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--proxies", type=int, default=1000)
    parser.add_argument("--services", type=int, default=1000)
    parser.add_argument("--pushes", type=int, default=5)
    parser.add_argument("--peer", action="store_true", help="a peer asks for 40 new random halves between")
    args = parser.parse_args()
    services = [f"svc-{i:05d}" for i in range(args.services)]
    rng = random.Random(19)
    cache = SnapshotCache()
    cache.set_snapshot(build(services, 0))
    _count_encodings()
    peer = Proxy(cache)

    def churn(sets: int) -> None:
        for _ in range(sets):
            peer.ask(rng.sample(services, len(services) // 2))

    mark = len(_encoded)
    started = time.perf_counter()
    fleet = []
    for _ in range(args.proxies):
        if args.peer:
            churn(1)
        proxy = Proxy(cache)
        proxy.ask(services)
        fleet.append(proxy)
    peer_encoded = 0
    sync = _encoded[mark:]
    print(
        f"initial sync of {args.proxies} proxies{' (a peer asking for a new half before each)' if args.peer else ''}:"
        f" {len(sync) - (args.proxies if args.peer else 0)} fleet encodings, "
        f"{time.perf_counter() - started:.2f} s"
    )
    for push in range(1, args.pushes + 1):
        for proxy in fleet:
            assert proxy.last is not None
            proxy.ask(services, *proxy.last)
        if args.peer:
            mark = len(_encoded)
            churn(40)
            peer_encoded = len(_encoded) - mark
        snapshot = build(services, push)
        mark = len(_encoded)
        started = time.perf_counter()
        cache.set_snapshot(snapshot)
        elapsed = time.perf_counter() - started
        pushed = _encoded[mark:]
        print(
            f"push {push}: {len(pushed)} encodings, {sum(pushed):,} bytes encoded for {args.proxies} proxies "
            f"({elapsed * 1000:.1f} ms)"
            + (f"; the peer's 40 sets before it: {peer_encoded} encodings" if args.peer else "")
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
