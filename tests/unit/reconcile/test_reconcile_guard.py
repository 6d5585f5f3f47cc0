"""docs/architecture.md, publishing rule 3: a snapshot that removes too much at once is held until
the operator confirms it (:mod:`pilotfish.reconcile.guard`, alone and in the loop)."""

from __future__ import annotations

import random

import pytest
from envoy.config.endpoint.v3 import endpoint_pb2

from pilotfish.build.desired import DesiredState, merge_states
from pilotfish.cache import DEFAULT_GROUP, SnapshotCache
from pilotfish.events import EventLog
from pilotfish.reconcile import GuardSettings, Reconciler
from pilotfish.reconcile.guard import EndpointCounter, Guard, endpoint_counts
from pilotfish.resources import ENDPOINT, LISTENER
from pilotfish.resources.services import Endpoint, ServiceSpec
from pilotfish.snapshot import Snapshot


class Recorder(EventLog):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[dict[str, object]] = []

    def emit(self, event: str, **fields: object) -> None:
        self.records.append({"event": event, **fields})

    def named(self, event: str) -> list[dict[str, object]]:
        return [r for r in self.records if r["event"] == event]


def services(*names: str, ports: int = 1, listen: bool = True) -> DesiredState:
    specs = {n: ServiceSpec(name=n, listen=("127.0.0.1", 10000 + i) if listen else None) for i, n in enumerate(names)}
    return DesiredState(
        services=specs, endpoints={n: tuple(Endpoint("127.0.0.1", 9000 + p) for p in range(ports)) for n in names}
    )


def reconciler(**kwargs: object) -> tuple[Reconciler, SnapshotCache, Recorder]:
    cache, events = SnapshotCache(), Recorder()
    return Reconciler(cache, events=events, **kwargs), cache, events  # type: ignore[arg-type]


def names(cache: SnapshotCache, url: str) -> set[str]:
    snapshot = cache.snapshot()
    assert snapshot is not None
    found = snapshot.get(url)
    return set(found.resources) if found else set()


# -- the blast-radius guard -------------------------------------------------------------------


def test_removing_every_listener_is_held_and_reported() -> None:
    rec, cache, events = reconciler(confirm_hint="kill -USR1 1234")
    rec.update("file", services("web", "api"))
    first = rec.build_now()
    rec.update("file", services("web", "api", listen=False))
    assert rec.build_now() is None
    assert cache.snapshot() is first, "the last good snapshot keeps serving"
    assert rec.held is not None and rec.held.reasons == ("it removes every listener (2)",)
    [held] = events.named("snapshot_held")
    assert held["counts"] == {
        "listeners": {"before": 2, "after": 0, "removed": 2},
        "routes": {"before": 2, "after": 0, "removed": 2},
    }
    # The same content again is not reported again.
    rec.update("file", services("web", "api", listen=False, ports=1))
    rec.build_now()
    assert len(events.named("snapshot_held")) == 1


def test_removing_every_cluster_is_held() -> None:
    rec, cache, _ = reconciler()
    rec.update("file", services("web"))
    rec.build_now()
    rec.update("file", DesiredState(resources={}))
    rec.build_now()
    assert rec.held is not None and "it removes every cluster (1)" in rec.held.reasons
    assert names(cache, LISTENER.url) == {"web"}


def test_a_confirmed_hold_is_published() -> None:
    rec, cache, events = reconciler()
    rec.update("file", services("web"))
    rec.build_now()
    rec.update("file", services("web", listen=False))
    rec.build_now()
    held = rec.held
    assert held is not None
    assert rec.confirm() is held.snapshot
    assert cache.snapshot() is held.snapshot and rec.held is None
    assert names(cache, LISTENER.url) == set()
    assert [e["event"] for e in events.records][-2:] == ["snapshot_confirmed", "snapshot_loaded"]
    assert rec.confirm() is None, "nothing left to confirm"


def test_a_hold_is_dropped_when_the_source_goes_back() -> None:
    rec, cache, events = reconciler()
    rec.update("file", services("web"))
    first = rec.build_now()
    rec.update("file", services("web", listen=False))
    rec.build_now()
    assert rec.held is not None
    rec.update("file", services("web"))
    assert rec.build_now() is None and rec.held is None and cache.snapshot() is first
    assert events.named("snapshot_hold_released")


def test_a_hold_is_replaced_by_a_harmless_change() -> None:
    rec, cache, _ = reconciler()
    rec.update("file", services("web", "api"))
    rec.build_now()
    rec.update("file", services("web", "api", listen=False))
    rec.build_now()
    rec.update("file", services("web"))  # drops api, keeps web's listener: allowed
    assert rec.build_now() is not None and rec.held is None
    assert names(cache, LISTENER.url) == {"web"}


@pytest.mark.parametrize(("before", "after", "held"), [(20, 10, False), (20, 9, True), (9, 1, False), (10, 4, True)])
def test_removing_more_than_the_share_of_a_type_is_held(before: int, after: int, held: bool) -> None:
    rec, _, _ = reconciler(guard=GuardSettings(max_removed_share=0.5, min_count=10))
    rec.update("file", services(*(f"s{i}" for i in range(before)), listen=False))
    rec.build_now()
    rec.update("file", services(*(f"s{i}" for i in range(after)), listen=False))
    try:
        rec.build_now()
    finally:
        assert (rec.held is not None) is held
    if held:
        assert rec.held is not None
        assert f"it removes {before - after} of {before} clusters (more than 50% at once)" in rec.held.reasons


@pytest.mark.parametrize(("after", "held"), [(5, True), (6, False)])
def test_removing_most_endpoints_of_a_service_is_held(after: int, held: bool) -> None:
    rec, _, _ = reconciler()
    rec.update("registry", services("web", ports=12))
    rec.build_now()
    rec.update("registry", services("web", ports=after))
    published = rec.build_now()
    if held:
        assert published is None and rec.held is not None
        assert rec.held.reasons == ("it removes 7 of the 12 endpoints of 'web' (more than 50% at once)",)
    else:
        assert published is not None and rec.held is None, "removing half is not more than half"


def test_the_guard_can_be_turned_off() -> None:
    rec, cache, events = reconciler(guard=GuardSettings(enabled=False))
    rec.update("file", services("web"))
    rec.build_now()
    rec.update("file", services("web", listen=False))
    assert rec.build_now() is not None and names(cache, LISTENER.url) == set()
    assert not events.named("snapshot_held")


# -- the guard alone ------------------------------------------------------------------------------


def snapshot_of(state: DesiredState) -> Snapshot:
    cache = SnapshotCache()
    rec = Reconciler(cache)
    rec.update("file", state)
    rec.build_now()
    found = cache.snapshot()
    assert found is not None
    return found


def test_the_guard_holds_reports_and_hands_back_what_the_operator_confirms() -> None:
    served, emptied = snapshot_of(services("web", "api")), snapshot_of(services("web", "api", listen=False))
    events = Recorder()
    guard = Guard(GuardSettings(), current=lambda group: served, events=events, confirm_hint=lambda: "say so")
    reasons, counts = guard.assess({DEFAULT_GROUP: emptied}, {}, {})
    assert reasons == ["it removes every listener (2)"] and counts["listeners"]["removed"] == 2
    guard.hold({DEFAULT_GROUP: emptied}, reasons, counts, {}, {})
    guard.hold({DEFAULT_GROUP: emptied}, reasons, counts, {}, {})
    assert guard.held is not None and guard.held_count == 1, "held (and said) once"
    assert [e["event"] for e in events.records] == ["snapshot_held"]
    held = guard.confirm(by="signal")
    assert held is not None and held.snapshot is emptied and guard.held is None
    assert events.named("snapshot_confirmed")[0]["by"] == "signal"
    assert guard.confirm() is None, "nothing held any more"


def test_the_guard_off_or_with_nothing_served_finds_nothing_to_hold() -> None:
    emptied = snapshot_of(services("web", listen=False))
    off = Guard(GuardSettings(enabled=False), current=lambda group: snapshot_of(services("web")))
    assert off.assess({DEFAULT_GROUP: emptied}, {}, {}) == ([], {})
    first = Guard(GuardSettings(), current=lambda group: None)
    assert first.assess({DEFAULT_GROUP: emptied}, {}, {}) == ([], {})


def test_a_released_hold_is_said_to_be_dropped() -> None:
    served, emptied = snapshot_of(services("web")), snapshot_of(services("web", listen=False))
    events = Recorder()
    guard = Guard(current=lambda group: served, events=events)
    guard.release("nothing held: nothing said")
    guard.hold({DEFAULT_GROUP: emptied}, ["why"], {}, {}, {})
    guard.release("the source went back")
    assert guard.held is None
    assert events.named("snapshot_hold_released") == [
        {"event": "snapshot_hold_released", "version": emptied.label(), "reason": "the source went back"}
    ]


def test_endpoint_counts_patched_from_the_last_call_are_the_counts_of_a_fresh_count() -> None:
    """The counter patches its last counts when a few raw assignments changed in place; whatever
    changed, its counts are what counting everything afresh gives."""

    def assignment(name: str, endpoints: int) -> endpoint_pb2.ClusterLoadAssignment:
        made = endpoint_pb2.ClusterLoadAssignment(cluster_name=name)
        for port in range(endpoints):
            made.endpoints.add().lb_endpoints.add().endpoint.address.socket_address.port_value = 9000 + port
        return made

    rng = random.Random(5)
    counter = EndpointCounter()
    found = [assignment(f"c{i}", 2) for i in range(12)]
    for _ in range(300):
        at = rng.randrange(len(found) + 1)
        roll = rng.random()
        if roll < 0.6 and at < len(found):  # in place: more or fewer endpoints, rarely another name
            name = found[at].cluster_name if rng.random() < 0.9 else rng.choice(["c1", "x", "y"])
            found[at] = assignment(name, rng.randrange(4))
        elif roll < 0.8:
            found.insert(at, assignment(rng.choice(["c2", "z"]), 1))
        elif found:
            del found[min(at, len(found) - 1)]
        state = DesiredState(resources={ENDPOINT: tuple(found)}, services={}, endpoints={"svc": ()})
        merged = merge_states({"file": state})
        assert counter(merged) == endpoint_counts(merged)
