"""The election of one replica on etcd (pilotfish.etcd.election), on a real etcd: one of two
campaigning replicas holds the key and the other names it; a holder that stops hands over at once
(it revokes its lease); a holder whose renewals stopped steps down before its lease can end."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import AsyncIterator, Callable

import pytest

from pilotfish.etcd.client import EtcdClient, unb64
from pilotfish.etcd.election import Election

KEY = "/pilotfish.election/leader"
TTL = 3.0
TIMEOUT = 10.0


async def until(what: str, condition: Callable[[], bool]) -> None:
    deadline = time.monotonic() + TIMEOUT
    while not condition():
        assert time.monotonic() < deadline, f"timed out after {TIMEOUT:g}s waiting for {what}"
        await asyncio.sleep(0.02)


@contextlib.asynccontextmanager
async def campaigning(election: Election) -> AsyncIterator[asyncio.Task[None]]:
    task = asyncio.create_task(election.run())
    try:
        yield task
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


@pytest.mark.e2e
async def test_one_replica_holds_the_key_and_hands_over_when_it_stops(etcd: str) -> None:
    clients = [EtcdClient(etcd), EtcdClient(etcd)]
    changes: list[tuple[str, bool]] = []
    events: list[tuple[str, dict[str, object]]] = []
    a, b = (
        Election(
            client,
            KEY,
            name,
            ttl=TTL,
            on_change=functools.partial(lambda n, up: changes.append((n, up)), name),
            on_event=lambda event, **fields: events.append((event, fields)),
        )
        for client, name in zip(clients, ("replica-a", "replica-b"), strict=True)
    )
    try:
        async with campaigning(a) as task_a:
            await until("replica-a to take the key", lambda: a.leader)
            assert unb64((await clients[0].range(KEY))["kvs"][0]["value"]) == "replica-a"
            async with campaigning(b):
                await until("replica-b to see who holds it", lambda: b.holder == "replica-a")
                assert a.leader and not b.leader
                started = time.monotonic()
                task_a.cancel()  # replica-a stops: it revokes its lease on the way out
                with contextlib.suppress(asyncio.CancelledError):
                    await task_a
                assert not a.leader
                await until("replica-b to take over", lambda: b.leader)
                # At its next attempt (every ttl / 3), not after the ttl: the lease was revoked.
                assert time.monotonic() - started < TTL
                assert b.holder == "replica-b"
        assert changes == [("replica-a", True), ("replica-a", False), ("replica-b", True), ("replica-b", False)]
        assert [(e, f["replica"]) for e, f in events] == [
            ("leader_elected", "replica-a"),
            ("leader_lost", "replica-a"),
            ("leader_elected", "replica-b"),
            ("leader_lost", "replica-b"),
        ]
    finally:
        for client in clients:
            await client.close()


@pytest.mark.e2e
async def test_a_holder_whose_renewals_stopped_stops_believing_it_holds_the_key(etcd: str) -> None:
    now = [0.0]
    client = EtcdClient(etcd)
    election = Election(client, KEY, "replica-a", ttl=TTL, clock=lambda: now[0])
    try:
        async with campaigning(election):
            await until("the key to be taken", lambda: election.leader)
            now[0] += TTL * 2 / 3 - 0.01
            assert election.leader
            now[0] += 0.02  # no renewal sent for 2/3 of the ttl: its lease may end soon, so it is not leader
            assert not election.leader
    finally:
        await client.close()
