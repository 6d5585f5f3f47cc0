"""The elected replica's TTL guard over many leases: in this process, against a real
etcd, with instances registered through the registry on etcd (``EtcdRegistry``) and a guard that
may ask etcd about only a few leases per pass (``max_asks``), as a large fleet makes it.

What a user relies on: an instance that heartbeats is never expired, however many leases the
guard has not asked about yet; one that stops heartbeating is expired once its TTL is known to
have passed."""

from __future__ import annotations

import asyncio

import pytest

from pilotfish.api.registry_etcd import EtcdRegistry, LeaseGuard
from pilotfish.cache import SnapshotCache
from pilotfish.events import EventLog
from pilotfish.reconcile import Reconciler
from pilotfish.sources.etcd import EtcdSource
from pilotfish.sources.registry import SelfPreservation

from .etcd import Etcd
from .processes import ProcessGroup

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

INSTANCES = 40
TTL = 6.0


def test_the_guard_never_expires_an_instance_it_has_not_asked_about(processes: ProcessGroup) -> None:
    etcd = Etcd.start(processes)
    asyncio.run(_scenario(etcd.address))


async def _scenario(address: str) -> None:
    reconciler = Reconciler(SnapshotCache())
    source = EtcdSource(address, "/pilotfish/", on_state=lambda state: reconciler.update("etcd", state))
    following = asyncio.create_task(source.run())
    try:
        async with asyncio.timeout(60):
            while source.problem is not None:
                await asyncio.sleep(0.05)
            registry = EtcdRegistry(source, reconciler, lease_slack=10.0)
            for n in range(INSTANCES):
                await registry.register(f"svc{n % 7}", {"address": "127.0.0.1", "port": 9000 + n, "ttl": TTL})
            # Self-preservation off: every lapsed instance would be expired, so any expiry of a
            # heartbeating one shows.
            events = EventLog()
            guard = LeaseGuard(
                registry, lambda: SelfPreservation(enabled=False, recheck=0.2), events=events, max_asks=3
            )
            silent = "127.0.0.1:9000"
            for _ in range(int(2.5 * TTL / 0.2)):  # 2.5 TTLs of passes, heartbeating all but one
                for service, endpoint in list(source.view.instances.values()):
                    if endpoint.address != silent:
                        await registry.heartbeat(service, endpoint.address)
                await guard.once()
                await asyncio.sleep(0.2)
            left = sorted(endpoint.address for _, endpoint in source.view.instances.values())
            assert len(left) == INSTANCES - 1 and silent not in left, left
    finally:
        following.cancel()
        with pytest.raises(asyncio.CancelledError):
            await following


def test_the_stored_self_preservation_setting_decides_and_a_bad_one_is_reported(
    processes: ProcessGroup, caplog: pytest.LogCaptureFixture
) -> None:
    """What ``PUT /v1/self-preservation`` stores in etcd is the rule the guard applies; a value
    someone else wrote there that does not parse is named in the log and the flags decide."""
    etcd = Etcd.start(processes)
    asyncio.run(_stored_setting(etcd, caplog))


async def _stored_setting(etcd: Etcd, caplog: pytest.LogCaptureFixture) -> None:
    source = EtcdSource(etcd.address, "/pilotfish/", on_state=lambda _: None)
    registry = EtcdRegistry(source, Reconciler(SnapshotCache()))
    flags = SelfPreservation(enabled=True, share=0.3)
    try:
        assert await registry.self_preservation(flags) == flags, "nothing stored: the flags decide"
        await registry.set_self_preservation(False)
        assert etcd.get_json("/pilotfish.self-preservation") == {"enabled": False}
        assert await registry.self_preservation(flags) == SelfPreservation(enabled=False, share=0.3)
        await asyncio.to_thread(etcd.put, "/pilotfish.self-preservation", "off")
        assert await registry.self_preservation(flags) == flags
        assert "/pilotfish.self-preservation holds 'off'" in caplog.text, caplog.text
    finally:
        await source.client.close()
