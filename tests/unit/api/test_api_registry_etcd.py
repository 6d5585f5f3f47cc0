"""The registry's store on etcd (pilotfish.api.registry_etcd), on a real etcd: a write is checked
as the in-memory registry checks it, then written to the keys the etcd source reads and answered
once this replica's view has it (read your writes); an instance with a TTL lives on a lease that
outlasts the TTL by the slack; a refused write leaves etcd as it was."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator

import pytest

from pilotfish.api.registry_etcd import EtcdRegistry
from pilotfish.build.desired import DesiredState
from pilotfish.cache import SnapshotCache
from pilotfish.reconcile import Reconciler
from pilotfish.resources.services import ServiceSpec
from pilotfish.sources.etcd import EtcdSource
from pilotfish.sources.registry import Conflict, UnknownInstance

PREFIX = "/pilotfish/"
FILE = DesiredState(services={"web": ServiceSpec(name="web", listen=("127.0.0.1", 10000))})
pytestmark = pytest.mark.e2e  # a real etcd


@contextlib.asynccontextmanager
async def on_etcd(address: str) -> AsyncIterator[tuple[EtcdRegistry, EtcdSource, Reconciler]]:
    reconciler = Reconciler(SnapshotCache(), guard=None)
    reconciler.update("file", FILE)
    source = EtcdSource(address, PREFIX, on_state=lambda state: reconciler.update("etcd", state))
    task = asyncio.create_task(source.run())
    try:
        await asyncio.wait_for(source.connected.wait(), 10)
        yield EtcdRegistry(source, reconciler, lease_slack=10.0), source, reconciler
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await source.client.close()


async def test_a_definition_is_written_to_the_source_key_and_read_back_at_once(etcd: str) -> None:
    async with on_etcd(etcd) as (store, source, reconciler):
        written = await store.define("api", {"listen": "127.0.0.1:10001", "protocol": "http"})
        assert written.revision is not None and source.revision >= written.revision  # its own view has it
        assert await source.client.get(f"{PREFIX}services/api") == json.dumps(
            {"listen": "127.0.0.1:10001", "protocol": "http"}, sort_keys=True
        )
        assert store.knows("api") and written.body is not None and written.body["listen"] == "127.0.0.1:10001"
        assert reconciler.build_now() is not None  # it reached the reconciler through the watch


async def test_a_clashing_write_is_refused_and_etcd_keeps_what_it_had(etcd: str) -> None:
    async with on_etcd(etcd) as (store, source, _):
        with pytest.raises(Conflict):
            await store.define("api", {"listen": "127.0.0.1:10000"})  # the file's web listens there
        assert await source.client.get(f"{PREFIX}services/api") is None
        assert not store.knows("api")


async def test_an_instance_with_a_ttl_lives_on_a_lease_that_outlasts_it_and_goes_with_it(etcd: str) -> None:
    async with on_etcd(etcd) as (store, source, _):
        await store.define("api", {"listen": "127.0.0.1:10001"})
        written = await store.register("api", {"address": "127.0.0.1", "port": 9001, "ttl": 5})
        key = f"{PREFIX}instances/api/127.0.0.1:9001"
        lease = source.view.lease_of(key)
        assert lease, "the instance is on a lease"
        assert 10 < await source.client.time_to_live(lease) <= 15  # ttl 5 + slack 10
        assert written.body is not None and written.body["ttl"] == 5
        beat = await store.heartbeat("api", "127.0.0.1:9001")  # renews the lease, on any replica
        assert beat.body is not None and 0 < beat.body["expires_in"] <= 5
        with pytest.raises(UnknownInstance, match="register it again"):
            await store.heartbeat("api", "127.0.0.1:9999")
        await store.deregister("api", "127.0.0.1:9001")
        assert await source.client.get(key) is None
        assert await source.client.time_to_live(lease) <= 0  # revoked, not left to run out


async def test_a_heartbeat_to_a_replica_that_has_not_seen_the_registration_yet_keeps_it_alive(etcd: str) -> None:
    async with on_etcd(etcd) as (store, source, _):
        await store.define("api", {"listen": "127.0.0.1:10001"})
        # Another replica registers it, and a client's first heartbeat comes here at once: this
        # replica's watch has (almost always) not delivered the write yet when it arrives.
        lease, _ = await source.client.grant(15)
        key = f"{PREFIX}instances/api/127.0.0.1:9002"
        await source.client.put(key, json.dumps({"address": "127.0.0.1", "port": 9002, "ttl": 5}), lease=lease)
        beat = await store.heartbeat("api", "127.0.0.1:9002")
        assert beat.body is not None and 0 < beat.body["expires_in"] <= 5
