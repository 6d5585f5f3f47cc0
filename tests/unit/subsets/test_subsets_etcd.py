"""Subsetting indices in etcd (pilotfish.subsets.etcd): the key layout, and what replicas sharing
one real etcd write there.

Each test starts its own etcd member (the ``etcd`` fixture of tests/unit/conftest.py) and runs
two replicas' :class:`EtcdProxyIndices` on it in this process, each with its own client, lease and
reconciler, as ``serve --etcd`` wires them. What a proxy's index is, every replica reads from etcd:
``proxies/{node}`` -> index and ``index/{i}`` -> node, on the lease of the replica serving the
proxy. The elected replica's :class:`BackendIndexWriter` keeps ``backends/{service}`` up to date
with the merged state, and only it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

import pytest

from pilotfish.build.desired import DesiredState, merge_states
from pilotfish.build.subsetting import Index, IndexTable
from pilotfish.cache import SnapshotCache
from pilotfish.etcd.client import EtcdClient, unb64
from pilotfish.reconcile import Reconciler, SubsetOptions
from pilotfish.resources.services import Endpoint, ServiceSpec
from pilotfish.subsets.etcd import READY_SOURCE, BackendIndexWriter, EtcdProxyIndices, SubsetKeys

T = TypeVar("T")
PREFIX = "/pilotfish/"
KEYS = SubsetKeys(PREFIX)
TIMEOUT = 10.0


def test_the_keys_sit_beside_the_source_prefix() -> None:
    assert KEYS.base == "/pilotfish.subsets/" == SubsetKeys("/pilotfish").base
    assert KEYS.backends("web") == "/pilotfish.subsets/backends/web"
    assert KEYS.proxy("edge-1") == "/pilotfish.subsets/proxies/edge-1"
    assert (KEYS.index(0), KEYS.index(12)) == ("/pilotfish.subsets/index/0", "/pilotfish.subsets/index/12")
    assert KEYS.index() == "/pilotfish.subsets/index/"  # the prefix of them all


# -- with a real etcd ---------------------------------------------------------------------------


class Clock:
    """The replicas' presence clock: grace periods pass when the test says so."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def until(what: str, condition: Callable[[], Awaitable[T | None]]) -> T:
    """Poll ``condition`` until it returns something truthy; fail naming ``what`` after TIMEOUT."""
    deadline = time.monotonic() + TIMEOUT
    while True:
        result = await condition()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {TIMEOUT:g}s waiting for {what}")
        await asyncio.sleep(0.02)


async def stored(client: EtcdClient, key: str) -> tuple[str, int] | None:
    """A key's value and lease as etcd has them (None: no such key)."""
    kvs = (await client.range(key)).get("kvs", [])
    return (unb64(kvs[0].get("value", "")), int(kvs[0].get("lease", 0))) if kvs else None


class Replica:
    """One replica's proxy indices on etcd, running, with the reconciler they feed."""

    def __init__(self, address: str, clock: Clock) -> None:
        self.client = EtcdClient(address)
        self.reconciler = Reconciler(SnapshotCache(), expect=(READY_SOURCE,), subsets=SubsetOptions(shared=True))
        self.moved: list[str] = []
        self.indices = EtcdProxyIndices(self.client, KEYS, grace=300.0, clock=clock)
        self.task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self.task = asyncio.create_task(self.indices.run(self.reconciler, on_moved=self.moved.append))

        async def ready() -> bool:
            return self.indices.connected and bool(self.indices.lease)

        await until("the replica to list the keys and hold a lease", ready)

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.task
        await self.client.close()

    async def settled(self, node: str) -> tuple[str, int] | None:
        """``node``'s key once etcd holds this replica's index of it on this replica's lease."""
        index = self.indices.index(node)
        found = await stored(self.client, KEYS.proxy(node))
        return found if found == (str(index), self.indices.lease) else None


@contextlib.asynccontextmanager
async def replicas(address: str, clock: Clock, count: int = 2) -> AsyncIterator[list[Replica]]:
    """``count`` replicas on one etcd, subsetting on (``web`` has a backend table in etcd)."""
    setup = EtcdClient(address)
    table = IndexTable().update(present=["127.0.0.1:9001", "127.0.0.1:9002"])
    await setup.put(KEYS.backends("web"), json.dumps(table.to_json()))
    started = [Replica(address, clock) for _ in range(count)]
    try:
        for replica in started:
            await replica.start()
            assert replica.reconciler.tables.tables == {"web": table}  # every replica builds with etcd's table
            assert replica.reconciler.waiting_for() == []  # the keys are listed: builds may start
        yield started
    finally:
        for replica in started:
            await replica.stop()
        await setup.close()


@pytest.mark.e2e
async def test_a_new_proxy_gets_the_lowest_free_index_at_once_and_etcd_holds_both_keys_on_its_lease(etcd: str) -> None:
    async with replicas(etcd, Clock()) as (a, b):
        assert a.indices.acquire("edge-1") == 0  # at once: its first response already carries its subset
        assert await until("edge-1's keys in etcd", lambda: a.settled("edge-1")) == ("0", a.indices.lease)
        assert await stored(a.client, KEYS.index(0)) == ("edge-1", a.indices.lease)

        async def seen_by_b() -> bool:
            return b.indices.index("edge-1") == 0

        await until("the other replica to read edge-1's index", seen_by_b)
        assert b.indices.acquire("edge-2") == 1  # 0 is taken, as etcd says
        assert await until("edge-2's keys in etcd", lambda: b.settled("edge-2")) == ("1", b.indices.lease)
        both = IndexTable({"edge-1": Index(0), "edge-2": Index(1)})

        async def seen_by_a() -> bool:  # through a's watch, a moment after etcd has the keys
            return a.indices.table() == both

        await until("the first replica to read edge-2's index", seen_by_a)
        assert b.indices.table() == both


@pytest.mark.e2e
async def test_a_proxy_that_moves_to_another_replica_keeps_its_index_on_that_replicas_lease(etcd: str) -> None:
    async with replicas(etcd, Clock()) as (a, b):
        a.indices.acquire("edge-1")
        await until("edge-1's keys on a's lease", lambda: a.settled("edge-1"))

        async def seen_by_b() -> bool:
            return b.indices.index("edge-1") == 0

        await until("b to read edge-1's index", seen_by_b)
        assert b.indices.acquire("edge-1") == 0  # it reconnected to b
        assert await until("edge-1's keys taken over", lambda: b.settled("edge-1")) == ("0", b.indices.lease)
        assert await stored(b.client, KEYS.index(0)) == ("edge-1", b.indices.lease)
        assert a.moved == b.moved == []


@pytest.mark.e2e
async def test_after_the_grace_period_a_departed_proxys_keys_are_deleted_only_by_the_replica_holding_them(
    etcd: str,
) -> None:
    clock = Clock()
    async with replicas(etcd, clock) as (a, b):
        a.indices.acquire("edge-1")
        await until("edge-1's keys in etcd", lambda: a.settled("edge-1"))
        a.indices.release("edge-1")
        clock.now += 299
        a.indices.expire()
        assert a.indices.index("edge-1") == 0  # within the grace period it keeps its index
        clock.now += 2
        b.indices.expire()  # not b's proxy: b deletes nothing

        async def gone_in_etcd() -> bool:
            return await stored(a.client, KEYS.proxy("edge-1")) is None

        assert await stored(b.client, KEYS.proxy("edge-1")) == ("0", a.indices.lease)
        a.indices.expire()
        await until("edge-1's keys deleted", gone_in_etcd)
        assert await stored(a.client, KEYS.index(0)) is None

        async def freed_everywhere() -> bool:
            return a.indices.index("edge-1") is None and b.indices.index("edge-1") is None

        await until("both replicas to read that edge-1 has no index", freed_everywhere)
        assert b.indices.acquire("edge-2") == 0  # the freed index is given again


@pytest.mark.e2e
async def test_two_replicas_giving_one_index_at_the_same_moment_agree_the_loser_moves_its_proxy(etcd: str) -> None:
    async with replicas(etcd, Clock()) as (a, b):
        # In the same instant: neither has heard of the other's proxy, both give the lowest free index.
        assert (a.indices.acquire("edge-a"), b.indices.acquire("edge-b")) == (0, 0)

        async def agreed() -> dict[str, tuple[str, int] | None] | None:
            held = await a.settled("edge-a") and await b.settled("edge-b")
            same_view = a.indices.table() == b.indices.table()
            if not (held and same_view):
                return None
            # Read once both hold their keys (read before, they could be from before the writes).
            return {node: await stored(a.client, KEYS.proxy(node)) for node in ("edge-a", "edge-b")}

        keys = await until("the replicas to settle the race", agreed)
        index_of = {node: found[0] for node, found in keys.items() if found is not None}
        assert sorted(index_of.values()) == ["0", "1"]
        loser = next(node for node, index in index_of.items() if index == "1")
        assert a.moved + b.moved == [loser]  # the loser's proxy is sent its new subset, on the streams it has
        for node, index in index_of.items():
            assert await stored(a.client, KEYS.index(int(index))) == (node, keys[node][1])  # type: ignore[index]


@pytest.mark.e2e
async def test_the_elected_replica_writes_the_backend_tables_the_merged_state_needs(etcd: str) -> None:
    async with replicas(etcd, Clock(), count=1) as [replica]:
        leading = False  # a replica that is not elected writes no table
        writer = BackendIndexWriter(replica.client, KEYS, leading=lambda: leading)
        task = asyncio.create_task(writer.run(replica.indices))
        try:
            endpoints = tuple(Endpoint("127.0.0.1", port) for port in (9001, 9002, 9003))
            merged = merge_states(
                {
                    "file": DesiredState(
                        services={"web": ServiceSpec(name="web", subset_size=2), "api": ServiceSpec(name="api")},
                        endpoints={"web": endpoints, "api": endpoints},
                    )
                }
            )
            writer.merged(merged)

            async def written() -> IndexTable | None:
                found = await stored(replica.client, KEYS.backends("web"))
                if found is None:
                    return None
                table = IndexTable.from_json(json.loads(found[0]), source="etcd")
                return table if len(table.indices) == 3 else None

            leading = True
            writer.poke()
            table = await until("the elected replica to write web's table", written)
            # The two backends etcd had keep their indices; the new one gets the next.
            assert dict(table.indices) == {"127.0.0.1:9001": 0, "127.0.0.1:9002": 1, "127.0.0.1:9003": 2}
            assert await stored(replica.client, KEYS.backends("api")) is None  # api is not subsetted

            async def read_back() -> bool:
                return bool(replica.reconciler.tables.tables.get("web") == table)

            await until("every replica to build with the written table", read_back)
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
