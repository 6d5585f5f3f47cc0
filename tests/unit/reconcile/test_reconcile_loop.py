"""The reconciler end to end on a fake clock: sources in, snapshots out, nothing sleeps (but a
build, which runs in a thread, is waited for)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import heapq
import itertools
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from pilotfish.build.desired import DesiredState, build_snapshots
from pilotfish.cache import SnapshotCache
from pilotfish.events import ANNOUNCE
from pilotfish.reconcile import DebounceSettings, Reconciler
from pilotfish.reconcile import loop as loop_module
from pilotfish.resources import ENDPOINT, LISTENER
from pilotfish.resources.services import Endpoint, ServiceSpec


class FakeClock:
    """Virtual time: ``sleep`` waits until a test ``advance``s past its deadline. Each step of
    ``advance`` also waits, in real time, for ``building`` (the reconciler's build, which runs in
    a thread) to be false."""

    def __init__(self) -> None:
        self.time = 1000.0
        self._sleepers: list[tuple[float, int, asyncio.Future[None]]] = []
        self._order = itertools.count()
        self.building: Callable[[], bool] = lambda: False

    def now(self) -> float:
        return self.time

    async def sleep(self, seconds: float) -> None:
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._sleepers, (self.time + seconds, next(self._order), future))
        await future

    async def advance(self, seconds: float) -> None:
        target = self.time + seconds
        await settle(self.building)
        while self._sleepers and self._sleepers[0][0] <= target:
            deadline, _, future = heapq.heappop(self._sleepers)
            self.time = max(self.time, deadline)
            if not future.done():
                future.set_result(None)
            await settle(self.building)
        self.time = target
        await settle(self.building)


async def settle(building: Callable[[], bool] = lambda: False) -> None:
    """Let every task run until it waits, and a build under way (``building``) finish."""
    give_up = time.monotonic() + 30
    while True:
        for _ in range(10):
            await asyncio.sleep(0)
        if not building():
            return
        assert time.monotonic() < give_up, "a build did not finish within 30 s"
        await asyncio.sleep(0.001)


WEB = ServiceSpec(name="web", listen=("127.0.0.1", 10000))


def state(*ports: int) -> DesiredState:
    return DesiredState(services={"web": WEB}, endpoints={"web": tuple(Endpoint("127.0.0.1", p) for p in ports)})


def published_ports(cache: SnapshotCache) -> list[int]:
    snapshot = cache.snapshot()
    assert snapshot is not None
    eds = snapshot.get(ENDPOINT.url)
    assert eds is not None
    assignment = eds.resources["web"].message
    return sorted(
        lb.endpoint.address.socket_address.port_value
        for group in assignment.endpoints  # type: ignore[attr-defined]
        for lb in group.lb_endpoints
    )


Running = tuple[Reconciler, FakeClock, SnapshotCache]


@pytest.fixture
async def running() -> AsyncIterator[Running]:
    clock = FakeClock()
    cache = SnapshotCache()
    reconciler = Reconciler(cache, clock=clock, settings=DebounceSettings(quiet=0.1, max_delay=1.0, hold=1.0))
    reconciler.update("registry", state(9001, 9002))
    reconciler.build_now()
    clock.building = lambda: reconciler.building
    task = asyncio.create_task(reconciler.run())
    await settle()
    yield reconciler, clock, cache
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def test_a_change_right_after_another_is_published_after_the_quiet_period(running: Running) -> None:
    reconciler, clock, cache = running  # (the start-up state of "web" changed just now)
    reconciler.update("registry", state(9001))
    await clock.advance(0.09)
    assert published_ports(cache) == [9001, 9002]
    await clock.advance(0.02)
    assert published_ports(cache) == [9001]
    assert reconciler.stats.published == 2


async def test_a_build_runs_beside_the_event_loop(running: Running, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every xDS stream is served on the event loop: a build (20,000 resources take tens of
    milliseconds) must not hold it. Here the build waits until the loop, still running, lets it go."""
    reconciler, clock, cache = running
    release = threading.Event()
    build_threads: list[int] = []

    def build_when_released(*args: Any, **kwargs: Any) -> Any:
        build_threads.append(threading.get_ident())
        assert release.wait(30), "never let go: the event loop did not run while the build waited"
        return build_snapshots(*args, **kwargs)

    monkeypatch.setattr(loop_module, "build_snapshots", build_when_released)
    await clock.advance(60.0)
    reconciler.update("registry", state(9001))
    give_up = time.monotonic() + 30
    while not build_threads:  # (the loop turns: the build starts)
        assert time.monotonic() < give_up, "the build did not start"
        await asyncio.sleep(0.001)
    assert build_threads[0] != threading.get_ident()
    assert reconciler.building
    assert published_ports(cache) == [9001, 9002]
    release.set()
    await clock.advance(0)  # (waits for the build)
    assert published_ports(cache) == [9001]


async def test_a_lone_change_is_published_at_once(running: Running) -> None:
    reconciler, clock, cache = running
    await clock.advance(60.0)  # a quiet minute
    reconciler.update("registry", state(9001))
    await clock.advance(0)
    assert published_ports(cache) == [9001]
    # One right after it is gathered: published once the service has been quiet for 100 ms.
    reconciler.update("registry", state(9001, 9003))
    await clock.advance(0.09)
    assert published_ports(cache) == [9001]
    await clock.advance(0.02)
    assert published_ports(cache) == [9001, 9003]
    assert reconciler.stats.published == 3


API = ServiceSpec(name="api", listen=("127.0.0.1", 10001))


def two_services(web_port: int, api_port: int) -> DesiredState:
    return DesiredState(
        services={"web": WEB, "api": API},
        endpoints={"web": (Endpoint("127.0.0.1", web_port),), "api": (Endpoint("127.0.0.1", api_port),)},
    )


def api_port(cache: SnapshotCache) -> int:
    snapshot = cache.snapshot()
    assert snapshot is not None
    eds = snapshot.get(ENDPOINT.url)
    assert eds is not None
    assignment = eds.resources["api"].message
    (lb,) = (lb for group in assignment.endpoints for lb in group.lb_endpoints)  # type: ignore[attr-defined]
    return int(lb.endpoint.address.socket_address.port_value)


async def test_a_noisy_service_does_not_delay_another() -> None:
    clock = FakeClock()
    cache = SnapshotCache()
    reconciler = Reconciler(
        cache, clock=clock, settings=DebounceSettings(quiet=0.1, max_delay=1.0, max_builds_per_s=20)
    )
    reconciler.update("registry", two_services(20000, 9000))
    reconciler.build_now()
    clock.building = lambda: reconciler.building
    task = asyncio.create_task(reconciler.run())
    try:
        await clock.advance(5.0)
        delays = []
        for tick in range(1, 301):  # "web" moves to a new port every 10 ms for 3 s
            api = 9000 + tick // 50  # "api" changes every 500 ms
            reconciler.update("registry", two_services(20000 + tick, api))
            if tick % 50 == 0:
                changed_at = clock.now()
                while api_port(cache) != api:
                    await clock.advance(0.005)
                delays.append(clock.now() - changed_at)
            else:
                await clock.advance(0.01)
        # Each of api's changes went out within the build rate's interval (50 ms), never waiting
        # for web's burst to end (it never does) or for the max delay (1 s).
        assert delays and max(delays) <= 0.05 + 1e-9, delays
        # web is built on its own clock meanwhile: at most every max delay when alone, plus the
        # builds api's changes made: far fewer than its 300 changes.
        assert reconciler.stats.published <= 1 + 1 + 3 + len(delays) + 1, reconciler.stats.published
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def test_100_changes_within_50ms_make_one_push(running: Running) -> None:
    reconciler, clock, cache = running
    for i in range(100):
        reconciler.update("registry", state(9001, 9100 + i))
        await clock.advance(0.0005)
    await clock.advance(0.2)
    assert reconciler.stats.published == 2  # the start-up snapshot, then one for the whole burst
    assert published_ports(cache) == [9001, 9199]


async def test_the_same_state_again_builds_nothing(running: Running) -> None:
    reconciler, clock, _ = running
    reconciler.update("registry", state(9002, 9001))
    await clock.advance(2.0)
    assert (reconciler.stats.builds, reconciler.stats.published) == (1, 1)


async def test_a_flapping_endpoint_makes_a_bounded_number_of_pushes(running: Running) -> None:
    reconciler, clock, cache = running
    for flip in range(50):  # 10 flips a second for 5 seconds
        reconciler.update("registry", state(9001) if flip % 2 == 0 else state(9001, 9002))
        await clock.advance(0.1)
    reconciler.update("registry", state(9001, 9002))
    await clock.advance(3.0)
    # Removal at once (1), re-added once it stayed for the hold (1): 2 pushes after start-up.
    assert reconciler.stats.published - 1 <= 2
    assert published_ports(cache) == [9001, 9002]


async def test_a_bad_state_keeps_the_last_good_snapshot(running: Running) -> None:
    reconciler, clock, cache = running
    before = cache.snapshot()
    clash = DesiredState(services={"api": ServiceSpec(name="api", listen=("127.0.0.1", 10000))})
    reconciler.update("file", clash)
    await clock.advance(0.5)
    assert cache.snapshot() is before
    assert reconciler.last_error is not None
    assert "127.0.0.1:10000 is already used by services.api" in reconciler.last_error.describe()
    reconciler.update("file", DesiredState())
    reconciler.update("registry", state(9003))
    await clock.advance(0.5)
    assert published_ports(cache) == [9003]
    assert reconciler.last_error is None


async def test_changed_content_under_an_unchanged_explicit_version_is_refused(running: Running) -> None:
    reconciler, clock, cache = running
    reconciler.update("registry", DesiredState())
    reconciler.update(
        "file", DesiredState(services={"web": WEB}, endpoints={"web": (Endpoint("127.0.0.1", 1),)}, version="7")
    )
    await clock.advance(0.5)
    first = cache.snapshot()
    assert first is not None and first.explicit_version == "7"
    reconciler.update(
        "file", DesiredState(services={"web": WEB}, endpoints={"web": (Endpoint("127.0.0.1", 2),)}, version="7")
    )
    await clock.advance(0.5)
    assert cache.snapshot() is first  # proxies at "7" would never get it: kept out, and said so
    assert reconciler.last_error is not None and "still '7'" in reconciler.last_error.describe()


def versioned(version: str, *, connect_timeout: float = 1.0) -> DesiredState:
    web = dataclasses.replace(WEB, connect_timeout=connect_timeout)
    return DesiredState(services={"web": web}, endpoints=state(9001, 9002).endpoints, version=version)


async def test_with_explicit_versions_a_type_that_did_not_change_keeps_its_version(running: Running) -> None:
    reconciler, clock, cache = running
    reconciler.update("file", state(9001, 9002))  # the file takes over the registry's endpoints
    reconciler.update("registry", DesiredState())
    await clock.advance(3.0)  # past the damping's hold
    reconciler.update("file", versioned("1"))
    await clock.advance(0.5)
    first = cache.snapshot()
    assert first is not None and set(first.versions().values()) == {"1"}, reconciler.last_error
    reconciler.update("file", versioned("2", connect_timeout=2.0))  # only the cluster changes
    await clock.advance(0.5)
    second = cache.snapshot()
    assert second is not None and second.label() == "2", reconciler.last_error
    assert second.versions() == {"CDS": "2", "EDS": "1", "ECDS": "1", "LDS": "1", "RDS": "1", "SDS": "1", "RTDS": "1"}
    # The very published TypeSnapshot: nothing waiting on the listeners is answered again.
    assert second.get(LISTENER.url) is first.get(LISTENER.url)
    reconciler.update("file", versioned("3", connect_timeout=2.0))  # nothing changes
    await clock.advance(0.5)
    third = cache.snapshot()
    assert third is not None and third.label() == "3" and third.versions() == second.versions()
    reconciler.update("file", versioned("4"))  # back to the clusters of "1"
    await clock.advance(0.5)
    fourth = cache.snapshot()
    assert fourth is not None and fourth.versions()["CDS"] == "4", "a new version, never an old one reused"


async def test_a_refused_edit_does_not_lend_its_version_to_the_next(running: Running) -> None:
    reconciler, clock, cache = running
    reconciler.update("registry", DesiredState())
    reconciler.update("file", dataclasses.replace(state(9001), version="1"))
    await clock.advance(0.5)
    reconciler.update("file", dataclasses.replace(state(9002), version="1"))  # refused: still "1"
    await clock.advance(2.0)
    assert reconciler.last_error is not None
    reconciler.update("file", dataclasses.replace(state(9002), version="2"))
    await clock.advance(2.0)
    snapshot = cache.snapshot()
    assert snapshot is not None and snapshot.versions()["EDS"] == "2", "proxies hold EDS '1' with port 9001"


def _fixed_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == ANNOUNCE and r.getMessage().startswith("fixed:")]


async def test_the_first_input_accepted_after_a_refused_one_is_announced_once(
    running: Running, caplog: pytest.LogCaptureFixture
) -> None:
    reconciler, clock, cache = running
    caplog.set_level(logging.INFO, logger=ANNOUNCE)
    reconciler.update("registry", DesiredState())

    def file(port: int, version: str) -> DesiredState:
        return DesiredState(services={"web": WEB}, endpoints={"web": (Endpoint("127.0.0.1", port),)}, version=version)

    reconciler.update("file", file(1, "7"))
    await clock.advance(0.5)
    assert _fixed_lines(caplog) == []  # nothing was refused: nothing to announce
    reconciler.update("file", file(2, "7"))  # new content under the same version: refused
    await clock.advance(0.5)
    assert reconciler.last_error is not None and _fixed_lines(caplog) == []
    reconciler.update("file", file(2, "8"))
    await clock.advance(0.5)
    served = cache.snapshot()
    assert served is not None and served.label() == "8"
    assert len(_fixed_lines(caplog)) == 1 and "(snapshot 8)" in _fixed_lines(caplog)[0]
    # A file refused where it was read, then back to what is served: announced too, once.
    reconciler.source_error("file", "invalid YAML")
    reconciler.update("file", file(2, "8"))
    await clock.advance(0.5)
    assert len(_fixed_lines(caplog)) == 2
    reconciler.update("file", file(2, "8"))
    assert len(_fixed_lines(caplog)) == 2


def endpoints_only(*ports: int) -> DesiredState:
    return DesiredState(endpoints={"web": tuple(Endpoint("127.0.0.1", p) for p in ports)})


async def test_an_endpoint_two_sources_report_stays_while_either_does(running: Running) -> None:
    reconciler, clock, cache = running  # the registry reports 9001 and 9002
    reconciler.update("file", endpoints_only(9002, 9003))
    await clock.advance(0.2)
    assert published_ports(cache) == [9001, 9002, 9003]
    reconciler.update("registry", state(9001))  # 9002: the file still reports it
    await clock.advance(0.2)
    assert published_ports(cache) == [9001, 9002, 9003]
    reconciler.update("file", endpoints_only(9003))  # now nobody does
    await clock.advance(0.2)
    assert published_ports(cache) == [9001, 9003]
    reconciler.update("registry", state(9001, 9002))  # back soon after it left: held for a while
    await clock.advance(0.2)
    assert published_ports(cache) == [9001, 9003]
    await clock.advance(1.0)
    assert published_ports(cache) == [9001, 9002, 9003]


def test_a_merge_with_the_memo_equals_a_fresh_merge_as_sources_change() -> None:
    """The merge memo reuses what an unchanged endpoint tuple became; it must never change the result."""
    from pilotfish.build.desired import DesiredState, MergeMemo, merge_states
    from pilotfish.resources.services import Endpoint

    def eps(*ports: int) -> tuple[Endpoint, ...]:
        return tuple(Endpoint("127.0.0.1", p) for p in ports)

    memo = MergeMemo()
    web, api = eps(2, 1), eps(5)  # a source may hand over an unsorted tuple
    steps = [
        {"file": DesiredState(endpoints={"web": web, "api": api})},
        {"file": DesiredState(endpoints={"web": web, "api": eps(5, 6)})},  # one tuple changed
        {"file": DesiredState(endpoints={"web": web}), "registry": DesiredState(endpoints={"web": eps(1, 3)})},
        {"file": DesiredState(endpoints={"web": web, "api": api})},  # back: the old tuple again
    ]
    for states in steps:
        assert merge_states(states, memo=memo) == merge_states(states)
    assert merge_states(steps[0], memo=memo).endpoints["web"] == eps(1, 2), "sorted, as without the memo"


async def test_a_source_whose_first_report_is_empty_lets_the_waiting_build_go_out() -> None:
    clock = FakeClock()
    cache = SnapshotCache()
    reconciler = Reconciler(cache, clock=clock, expect=("registry", "etcd"))
    clock.building = lambda: reconciler.building
    task = asyncio.create_task(reconciler.run())
    try:
        reconciler.update("registry", state(9001))
        await clock.advance(5.0)
        assert cache.snapshot() is None  # etcd has not reported: nothing may be published
        reconciler.update("etcd", DesiredState())  # etcd holds nothing: that is its first report
        await clock.advance(0)
        assert published_ports(cache) == [9001]
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def test_a_change_of_a_resource_ttl_alone_is_published(running: Running) -> None:
    from envoy.service.runtime.v3 import rtds_pb2

    from pilotfish.resources import RUNTIME

    reconciler, clock, cache = running
    layer = rtds_pb2.Runtime(name="gameday")
    with_ttl = DesiredState(resources={RUNTIME: (layer,)}, ttls={RUNTIME: {"gameday": 30_000}})
    reconciler.update("file", with_ttl)
    await clock.advance(2.0)
    runtime = cache.snapshot().get(RUNTIME.url)  # type: ignore[union-attr]
    assert runtime is not None and runtime.resources["gameday"].ttl_ms == 30_000
    # The same layer (the very message: it was not parsed again), its TTL changed.
    reconciler.update("file", dataclasses.replace(with_ttl, ttls={RUNTIME: {"gameday": 60_000}}))
    await clock.advance(2.0)
    runtime = cache.snapshot().get(RUNTIME.url)  # type: ignore[union-attr]
    assert runtime is not None and runtime.resources["gameday"].ttl_ms == 60_000
    reconciler.update("file", dataclasses.replace(with_ttl, ttls={}))
    await clock.advance(2.0)
    runtime = cache.snapshot().get(RUNTIME.url)  # type: ignore[union-attr]
    assert runtime is not None and runtime.resources["gameday"].ttl_ms == 0
