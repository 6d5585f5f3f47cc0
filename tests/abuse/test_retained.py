"""What a hostile peer makes the server hold: while it is connected, and once it has gone.

A peer that subscribes to many distinct name sets makes the server encode a response for each,
and the memos that let thousands of proxies share one encoded response could keep them all. The
peer of the first test opens 40 streams on one connection with an initial window of 0 (so it is
sent no byte of DATA: every response stays owed to it), each subscribing to its own random half of
5,000 clusters, then disconnects. Afterwards less than :data:`RETAINED_BOUND` may stay allocated.

How "retained" is measured: the server (:func:`pilotfish.app.serve`, as ``pilotfish serve``
runs it) runs in the test's own process (``tests/integration/inprocess.py``), and tracemalloc
counts the bytes Python still has allocated once the server has closed the peer's 40 streams
(their ``stream_closed`` events are in its event log) and the garbage is collected, against what it
had allocated just before the attack. The resident set of a ``pilotfish serve`` process would not
do: the allocator keeps freed memory for reuse, so it stays at the attack's peak (it does, before
and after the memos were bounded) and says what was used, not what is held.

While it is connected, a peer that grants no window is owed every response it is sent; it fills
no socket buffer, so the server keeps reading its requests. The second test (on a real ``pilotfish
serve``, :mod:`.target`) keeps changing its subscription, each change leaving one more response
owed: the connection must end (GOAWAY ENHANCE_YOUR_CALM, ``Limits.max_owed_bytes``) before the
server's memory grows past :data:`~.target.RSS_BOUND`, and the good client must keep being served.
"""

from __future__ import annotations

import asyncio
import gc
import json
import random
import time
import tracemalloc
from pathlib import Path

import pytest
from inprocess import serving

from pilotfish.app import ServeSettings
from pilotfish.events import read_events

from .target import CDS, Target, discovery_request
from .test_exhaustion import goaway_with, names_field
from .wire import FrameType, H2Code, RawClient, frame, grpc_message, headers_frame

MIB = 1024 * 1024
RETAINED_BOUND = 16 * MIB
"""Bytes the peer may leave allocated in the server after it has gone."""
CLUSTERS = 5000
ENDPOINTS = 8
"""Per cluster: a cluster is about 400 bytes encoded, half of them about 1 MiB."""
SETS = 40
INITIAL_WINDOW_SIZE = 0x4


def write_snapshot(path: Path) -> None:
    clusters = [
        {
            "name": f"c{i:04d}",
            "type": "STATIC",
            "connect_timeout": "1s",
            "load_assignment": {
                "cluster_name": f"c{i:04d}",
                "endpoints": [
                    {
                        "lb_endpoints": [
                            {
                                "endpoint": {
                                    "address": {"socket_address": {"address": "127.0.0.1", "port_value": 9000 + e}}
                                }
                            }
                            for e in range(ENDPOINTS)
                        ]
                    }
                ],
            },
        }
        for i in range(CLUSTERS)
    ]
    path.write_text(json.dumps({"version": "v1", "clusters": clusters}))


def subscribe_and_leave(port: int) -> tuple[int, int, str]:
    """The peer: 40 streams, each a CDS request for its own random half of the clusters; it never
    reads a byte of DATA (window 0). Leaves once the server has handled every request (a PING
    answered after them). Returns (bytes sent, bytes the server had allocated meanwhile, what it
    saw)."""
    client = RawClient(port, settings=[(INITIAL_WINDOW_SIZE, 0)]).start_reader()
    rng = random.Random(19)
    names = [b"c%04d" % i for i in range(CLUSTERS)]
    sent = 0
    try:
        for n in range(SETS):
            body = grpc_message(discovery_request(CDS) + names_field(rng.sample(names, CLUSTERS // 2)))
            client.send(headers_frame(2 * n + 1))
            if not client.send_data(2 * n + 1, body, timeout=20.0):
                break
            sent += len(body)
        client.barrier(timeout=30.0)
        answered = client.wait_for(lambda got: len(got.headers) >= SETS, timeout=30.0)
        held = tracemalloc.get_traced_memory()[0]
        # serve() freezes what lives whenever it is idle (and collects frozen cycles once an hour):
        # freeze now, as it may while the peer is connected, so what the peer leaves must be freed
        # without a cyclic collection.
        gc.freeze()
        return sent, held, "" if answered else f"not every stream was answered: {client.got.describe()}"
    finally:
        client.close()


async def closed_streams(log: Path, node: str) -> int:
    return sum(1 for event in read_events(log)[0] if event["event"] == "stream_closed" and event.get("node") == node)


async def test_40_distinct_subscriptions_from_one_peer_leave_little_behind(tmp_path: Path) -> None:
    snapshot = tmp_path / "snapshot.json"
    write_snapshot(snapshot)
    # 5,000 clusters take a few seconds to build, more on a busy machine.
    async with serving(tmp_path, ServeSettings(snapshot=snapshot), timeout=120.0) as running:
        port = int(running.xds.rsplit(":", 1)[1])
        loop = asyncio.get_running_loop()
        gc.collect()
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            sent, held, problem = await loop.run_in_executor(None, subscribe_and_leave, port)
            assert not problem, problem
            deadline = time.monotonic() + 30.0
            while await closed_streams(running.events, "attacker") < SETS and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert await closed_streams(running.events, "attacker") == SETS, "the server did not close the streams"
            # Its connection may outlive its streams by ConnectionLimits.close_timeout (what it is
            # owed cannot be flushed to a window of 0): wait for what it held to be let go.
            deadline = time.monotonic() + 10.0
            while True:
                gc.collect()
                retained = tracemalloc.get_traced_memory()[0] - before
                if retained < RETAINED_BOUND or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.1)
        finally:
            tracemalloc.stop()
            gc.unfreeze()
    numbers = (
        f"{SETS} sets in {sent / MIB:.2f} MiB of requests; {(held - before) / MIB:.1f} MiB allocated "
        f"while the peer was connected, {retained / MIB:.1f} MiB left after it had gone"
    )
    print(numbers)
    assert held - before > RETAINED_BOUND // 2, f"the attack cost the server less than expected: {numbers}"
    assert retained < RETAINED_BOUND, f"over the bound of {RETAINED_BOUND / MIB:.0f} MiB: {numbers}"


def test_responses_owed_to_a_peer_that_grants_no_window_are_bounded(
    target: Target, request: pytest.FixtureRequest
) -> None:
    client = target.attacker(settings=[(INITIAL_WINDOW_SIZE, 0)]).start_reader()
    client.send(headers_frame(1))
    client.send(frame(FrameType.DATA, 0, 1, grpc_message(discovery_request(CDS))))
    changes = [
        frame(FrameType.DATA, 0, 1, grpc_message(discovery_request(CDS, resource_names=names)))
        for names in (["*"], ["cluster-000"])
    ]  # everything (2.6 KB owed), then one cluster
    sent = 0
    for batch in range(100):  # up to 100 x 1,000 changes of subscription
        if batch == 1:
            target.change_snapshot()
        if not client.send(b"".join(changes[n % 2] for n in range(1000))) or not client.barrier():
            break
        sent += 1000
    problems = goaway_with(
        client, {H2Code.ENHANCE_YOUR_CALM}, "responses owed to a peer that grants no window", barrier=False
    )
    target.conclude(request.node.name, problems, requests_sent=sent)
