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
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

from envoy.service.discovery.v3 import discovery_pb2
from google.protobuf.message import Message

import pilotfish.snapshot as snapshot_module
from bench.report import print_table
from pilotfish.cache import SnapshotCache
from pilotfish.protocol import SotwStream
from pilotfish.resources import CLUSTER, ENDPOINT
from pilotfish.resources.parse import parse_resource
from pilotfish.snapshot import Snapshot

EDS = ENDPOINT.url
_encoded: list[int] = []


def _count_encodings() -> None:
    """Count every body encoded from now on (once per process: later calls keep the one wrapper)."""
    namespace = vars(snapshot_module)  # where TypeSnapshot looks the encoder up
    original = namespace["discovery_response"]
    if getattr(original, "counting", False):
        return

    def counting(*args: Any, **kwargs: Any) -> bytes:
        body: bytes = original(*args, **kwargs)
        _encoded.append(len(body))
        return body

    counting.counting = True  # type: ignore[attr-defined]
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


MEMO_COLUMNS = [
    "peer",
    "proxies",
    "services",
    "pushes",
    "initial sync: fleet encodings",
    "initial sync s",
    "encodings / push",
    "bytes encoded / push",
    "push ms (median)",
    "peer's encodings before each push",
]
PEER_SETS = 40
"""Name sets the peer asks for before each push (far more than the memo's budget)."""


@dataclass
class MemoRun:
    """One run: the fleet's initial sync, then ``pushes`` endpoint changes."""

    proxies: int
    services: int
    peer: bool
    sync_encodings: int = 0
    """Bodies encoded while the fleet connected (the peer's own, one per proxy, left out)."""
    sync_seconds: float = 0.0
    encodings: list[int] = field(default_factory=list)
    """Bodies encoded per push."""
    encoded_bytes: list[int] = field(default_factory=list)
    """Their bytes, per push."""
    push_ms: list[float] = field(default_factory=list)
    peer_encodings: list[int] = field(default_factory=list)
    """Bodies encoded for the peer's name sets before each push."""

    def row(self) -> list[object]:
        low, high = min(self.encoded_bytes, default=0), max(self.encoded_bytes, default=0)
        return [
            f"{PEER_SETS} name sets before each push" if self.peer else "none",
            self.proxies,
            self.services,
            len(self.encodings),
            self.sync_encodings,
            round(self.sync_seconds, 2),
            _span(min(self.encodings, default=0), max(self.encodings, default=0)),
            _span(low, high),
            round(statistics.median(self.push_ms), 1) if self.push_ms else "-",
            _span(min(self.peer_encodings), max(self.peer_encodings)) if self.peer_encodings else "-",
        ]


def encodings_text(run: MemoRun) -> str:
    """``1 encoding of 264-438 B per push``: what a run's pushes encoded, for a sentence."""
    low, high = min(run.encoded_bytes, default=0), max(run.encoded_bytes, default=0)
    count = _span(min(run.encodings, default=0), max(run.encodings, default=0))
    return f"{count} encoding{'' if count == '1' else 's'} of {_span(low, high)} B per push"


def notes() -> list[str]:
    return [
        "In one process, no I/O: N proxies (real SotW state machines, `SotwStream`, on a real `SnapshotCache`, as "
        "the xDS server wires them) subscribe to the endpoints of every service and ACK what they get; then "
        "endpoint changes (one service's endpoints move) are published one after another. Every "
        "DiscoveryResponse body the snapshots encode is counted (`pilotfish.snapshot.discovery_response` "
        "wrapped): at the initial sync (the proxies connecting one by one) and per push. `peer`: before each "
        f"proxy connects, and {PEER_SETS} times before each push, a peer asks for a new random half of the "
        "services (and never ACKs): far more distinct name sets than the memo keeps. A fleet at one version "
        "shares one encoded response per push when `encodings / push` is 1 and `bytes encoded / push` is the "
        "same with and without the peer (a push sends the changed service's assignment only). `push ms`: "
        "`set_snapshot` until every proxy was handed its response "
        "(no sockets: the encoding and the watch bookkeeping only)."
    ]


def _span(low: int, high: int) -> str:
    return f"{low:,}" if low == high else f"{low:,}-{high:,}"


def run_memo(*, proxies: int = 1000, services: int = 1000, pushes: int = 5, peer: bool = False) -> MemoRun:
    """One run (see the module docstring), in this process, on a cache of its own."""
    _count_encodings()
    names = [f"svc-{i:05d}" for i in range(services)]
    rng = random.Random(19)
    cache = SnapshotCache()
    cache.set_snapshot(build(names, 0))
    asker = Proxy(cache)
    run = MemoRun(proxies=proxies, services=services, peer=peer)

    def churn(sets: int) -> None:
        for _ in range(sets):
            asker.ask(rng.sample(names, len(names) // 2))

    mark = len(_encoded)
    started = time.perf_counter()
    fleet = []
    for _ in range(proxies):
        if peer:
            churn(1)
        proxy = Proxy(cache)
        proxy.ask(names)
        fleet.append(proxy)
    run.sync_seconds = time.perf_counter() - started
    run.sync_encodings = len(_encoded) - mark - (proxies if peer else 0)
    for push in range(1, pushes + 1):
        for proxy in fleet:
            assert proxy.last is not None
            proxy.ask(names, *proxy.last)
        if peer:
            mark = len(_encoded)
            churn(PEER_SETS)
            run.peer_encodings.append(len(_encoded) - mark)
        snapshot = build(names, push)
        mark = len(_encoded)
        started = time.perf_counter()
        cache.set_snapshot(snapshot)
        run.push_ms.append((time.perf_counter() - started) * 1000)
        pushed = _encoded[mark:]
        run.encodings.append(len(pushed))
        run.encoded_bytes.append(sum(pushed))
    return run


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.bench_memo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--proxies", type=int, default=1000)
    parser.add_argument("--services", type=int, default=1000)
    parser.add_argument("--pushes", type=int, default=5)
    parser.add_argument("--peer", action="store_true", help=f"a peer asks for {PEER_SETS} new random halves between")
    args = parser.parse_args()
    run = run_memo(proxies=args.proxies, services=args.services, pushes=args.pushes, peer=args.peer)
    print(
        f"initial sync of {args.proxies} proxies{' (a peer asking for a new half before each)' if args.peer else ''}:"
        f" {run.sync_encodings} fleet encodings, {run.sync_seconds:.2f} s"
    )
    for push, (count, size, ms) in enumerate(zip(run.encodings, run.encoded_bytes, run.push_ms, strict=True), 1):
        print(
            f"push {push}: {count} encodings, {size:,} bytes encoded for {args.proxies} proxies ({ms:.1f} ms)"
            + (
                f"; the peer's {PEER_SETS} sets before it: {run.peer_encodings[push - 1]} encodings"
                if args.peer
                else ""
            )
        )
    print_table(MEMO_COLUMNS, [run.row()])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
