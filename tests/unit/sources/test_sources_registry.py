"""TTL expiry and self-preservation, on a fake clock: churn expires, a mass lapse pauses expiry."""

from __future__ import annotations

import asyncio

import pytest

from pilotfish.api.registry import RegistryApi
from pilotfish.build.desired import DesiredState
from pilotfish.cache import SnapshotCache
from pilotfish.errors import ConfigError
from pilotfish.reconcile import Reconciler
from pilotfish.resources.parse import parse_document
from pilotfish.sources.registry import Registry, RegistryFull, RegistryLimits, SelfPreservation


class Clock:
    def __init__(self) -> None:
        self.time = 1000.0

    def __call__(self) -> float:
        return self.time


@pytest.fixture
def clock() -> Clock:
    return Clock()


def fleet(
    clock: Clock,
    count: int,
    *,
    service: str = "web",
    ttl: float = 10.0,
    first_port: int = 9000,
    registry: Registry | None = None,
    **rule: float,
) -> Registry:
    registry = registry or Registry(clock=clock, self_preservation=SelfPreservation(**rule))  # type: ignore[arg-type]
    for port in range(first_port, first_port + count):
        registry.register(service, {"address": "127.0.0.1", "port": port, "ttl": ttl})
    return registry


def ports(registry: Registry, service: str = "web") -> list[int]:
    return [i["port"] for i in registry.describe(service)[service]["instances"]]


def beat(registry: Registry, *ports: int, service: str = "web") -> None:
    for port in ports:
        registry.heartbeat(service, f"127.0.0.1:{port}")


def test_an_instance_that_stops_alone_expires(clock: Clock) -> None:
    registry = fleet(clock, 10)
    clock.time += 9
    beat(registry, *range(9001, 9010))  # all but 9000
    clock.time += 1.5
    done = registry.expire()
    assert [i.id for i in done.expired] == ["127.0.0.1:9000"]
    assert done.preservation is None and not done.entered
    assert ports(registry) == list(range(9001, 9010))


def test_a_lone_instance_with_nobody_else_still_expires(clock: Clock) -> None:
    registry = fleet(clock, 1)
    clock.time += 11
    assert len(registry.expire().expired) == 1
    assert not registry.knows("web")


def test_when_most_instances_lapse_at_once_none_expire_until_heartbeats_return(clock: Clock) -> None:
    registry = fleet(clock, 10)
    clock.time += 11  # a partition: nobody's heartbeats arrive
    done = registry.expire()
    assert done.expired == [] and done.entered
    assert done.preservation is not None and done.preservation.everywhere
    assert (done.preservation.lapsed, done.preservation.ttl_instances) == (10, 10)
    assert ports(registry) == list(range(9000, 9010))
    # While paused, expiry looks again soon: not never, not in a busy loop, not always later.
    assert registry.next_expiry() == pytest.approx(clock.time + 1.0)
    clock.time += 0.5
    assert registry.next_expiry() == pytest.approx(clock.time + 0.5)
    clock.time += 30
    assert registry.expire().expired == []  # still partitioned: still kept
    # The partition heals: all but two come back. Those two expire now, as churn.
    beat(registry, *range(9000, 9008))
    done = registry.expire()
    assert done.exited and done.preservation is None
    assert sorted(i.id for i in done.expired) == ["127.0.0.1:9008", "127.0.0.1:9009"]
    assert ports(registry) == list(range(9000, 9008))


def test_instances_lapsing_one_after_another_pause_once_half_are_gone(clock: Clock) -> None:
    registry = fleet(clock, 10, ttl=10, window=30)
    expired = []
    for step in range(1, 25):  # instance 9000+j sends its last heartbeat at second j
        clock.time += 1
        beat(registry, *(p for p in ports(registry) if p - 9000 >= step))
        expired += [i.endpoint.port for i in registry.expire().expired]
    # The first five lapses looked like churn; a sixth within the window would be more than half.
    assert expired == [9000, 9001, 9002, 9003, 9004]
    assert ports(registry) == [9005, 9006, 9007, 9008, 9009]
    assert registry.preservation is not None and registry.preservation.lapsed == 5


def test_lapses_spread_wider_than_the_window_are_churn(clock: Clock) -> None:
    registry = fleet(clock, 10, ttl=10, window=30)
    for gone in range(10):  # one instance stops every 31 seconds
        clock.time += 31
        beat(registry, *range(9000 + gone + 1, 9010))
        done = registry.expire()
        assert [i.endpoint.port for i in done.expired] == [9000 + gone]
        assert registry.preservation is None


def test_one_service_losing_most_of_its_instances_pauses_only_that_service(clock: Clock) -> None:
    registry = fleet(clock, 20, service="big")
    fleet(clock, 4, service="api", registry=registry, first_port=8000)
    fleet(clock, 1, service="solo", registry=registry, first_port=7000)
    clock.time += 9
    beat(registry, *range(9000, 9020), service="big")
    beat(registry, 8000, service="api")  # api loses three of four; solo its only one
    clock.time += 1.5
    done = registry.expire()
    assert [i.id for i in done.expired] == ["127.0.0.1:7000"]  # one instance alone is churn
    assert done.entered and done.preservation is not None
    assert not done.preservation.everywhere and done.preservation.services == ("api",)
    assert ports(registry, "api") == [8000, 8001, 8002, 8003]


def test_turning_self_preservation_off_lets_lapsed_instances_expire(clock: Clock) -> None:
    registry = fleet(clock, 10)
    clock.time += 11
    assert registry.expire().entered
    registry.set_self_preservation(False)
    done = registry.expire()
    assert done.exited and len(done.expired) == 10
    assert not registry.knows("web")


def test_with_self_preservation_off_a_mass_lapse_expires_everything(clock: Clock) -> None:
    registry = fleet(clock, 10, enabled=False)
    clock.time += 11
    done = registry.expire()
    assert len(done.expired) == 10 and done.preservation is None and not done.entered


def test_a_small_loss_below_the_minimum_is_never_paused(clock: Clock) -> None:
    registry = fleet(clock, 2, min_lapsed=3)
    clock.time += 11
    assert len(registry.expire().expired) == 2


def test_instances_without_ttl_never_expire_and_do_not_count(clock: Clock) -> None:
    registry = fleet(clock, 3)
    for port in range(9100, 9150):
        registry.register("web", {"address": "127.0.0.1", "port": port})
    clock.time += 11
    done = registry.expire()
    assert done.expired == [] and done.preservation is not None  # 3 of 3 TTL instances: paused
    assert len(ports(registry)) == 53


def test_limits_refuse_more_services_and_instances_and_keep_what_is_there(clock: Clock) -> None:
    registry = Registry(clock=clock, limits=RegistryLimits(max_services=2, max_instances=3))
    for port in (1, 2):
        registry.register("a", {"address": "127.0.0.1", "port": port})
    registry.define("b", {})
    with pytest.raises(RegistryFull, match="max_services"):
        registry.define("c", {})
    registry.register("b", {"address": "127.0.0.1", "port": 3})
    with pytest.raises(RegistryFull, match="max_instances"):
        registry.register("a", {"address": "127.0.0.1", "port": 4})
    registry.register("a", {"address": "127.0.0.1", "port": 1, "weight": 5})  # re-registering is fine
    registry.deregister("a", "127.0.0.1:2")
    registry.register("a", {"address": "127.0.0.1", "port": 4})
    assert ports(registry, "a") == [1, 4]


def test_huge_metadata_is_refused(clock: Clock) -> None:
    registry = Registry(clock=clock)
    with pytest.raises(ConfigError, match="metadata"):
        registry.register("a", {"address": "127.0.0.1", "port": 1, "metadata": {"k": "v" * 5000}})


def test_an_undo_point_puts_a_service_back(clock: Clock) -> None:
    registry = fleet(clock, 2)
    registry.define("web", {"listen": "127.0.0.1:10000"})
    before = registry.state()
    for change in (
        lambda: registry.undefine("web"),
        lambda: registry.define("web", {"listen": "127.0.0.1:10001"}),
        lambda: registry.register("web", {"address": "127.0.0.1", "port": 1}),
        lambda: registry.deregister("web", "127.0.0.1:9000"),
    ):
        undo = registry.undo_point("web")
        change()
        assert registry.state() != before
        undo()
        assert registry.state() == before
    # The instance count came back too: the limit still counts right.
    limited = Registry(clock=clock, limits=RegistryLimits(max_instances=1))
    undo = limited.undo_point("x")
    limited.register("x", {"address": "127.0.0.1", "port": 1})
    undo()
    limited.register("y", {"address": "127.0.0.1", "port": 1})


def test_a_last_instance_whose_expiry_would_break_the_merged_state_leaves_its_cluster_empty(clock: Clock) -> None:
    # The file's cluster takes its endpoints (EDS service name "web") from the registry.
    document = parse_document(
        {
            "clusters": [
                {
                    "name": "legacy-web",
                    "type": "EDS",
                    "connect_timeout": "1s",
                    "eds_cluster_config": {
                        "service_name": "web",
                        "eds_config": {"ads": {}, "resource_api_version": "V3"},
                    },
                }
            ]
        },
        "snapshot.yaml",
    )
    reconciler = Reconciler(SnapshotCache())
    reconciler.update("file", DesiredState.of_document(document))
    registry = Registry(clock=clock)
    api = RegistryApi(registry, reconciler)
    asyncio.run(api.store.register("web", {"address": "127.0.0.1", "port": 1, "ttl": 5}))
    assert reconciler.build_now() is not None
    clock.time += 6
    api.expire_once()
    assert registry.describe("web")["web"]["instances"] == []  # the instance is gone...
    published = reconciler.build_now()  # ...and the merged state still builds: "web" has no endpoints
    assert published is not None and reconciler.last_error is None


def test_the_registry_counts_its_services_instances_and_expiries(clock: Clock) -> None:
    registry = Registry(clock=clock, self_preservation=SelfPreservation(enabled=False))
    registry.define("empty", {})
    for port in (9000, 9001, 9002):
        registry.register("web", {"address": "127.0.0.1", "port": port, "ttl": 5})
    assert registry.census() == (2, 3) and registry.expired_count == 0
    clock.time += 6
    assert len(registry.expire().expired) == 3  # (self-preservation off: all at once expire)
    assert registry.census() == (1, 0) and registry.expired_count == 3
