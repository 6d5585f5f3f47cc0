"""Flap damping (:mod:`pilotfish.reconcile.damping`), with time as plain numbers (no sleeping)."""

from __future__ import annotations

from pilotfish.build.desired import DesiredState, merge_states
from pilotfish.reconcile.damping import Damping, FlapDamper
from pilotfish.resources.services import Endpoint, ServiceSpec

A = ("web", "127.0.0.1:9001")
B = ("web", "127.0.0.1:9002")


def test_new_endpoints_are_published_at_once_and_removed_at_once() -> None:
    damper = FlapDamper(flap_window=30.0, hold=1.0)
    assert damper.apply({A, B}, 0.0) == ({A, B}, None)
    assert damper.apply({A}, 1.0) == ({A}, None)


def test_a_returning_endpoint_waits_for_its_hold() -> None:
    damper = FlapDamper(flap_window=30.0, hold=1.0)
    damper.apply({A, B}, 0.0)
    damper.apply({A}, 1.0)
    assert damper.apply({A, B}, 1.5) == ({A}, 2.5)
    assert damper.apply({A, B}, 2.4) == ({A}, 2.5)
    assert damper.apply({A, B}, 2.5) == ({A, B}, None)


def test_flapping_10_times_a_second_for_5_seconds_publishes_twice() -> None:
    damper = FlapDamper(flap_window=30.0, hold=1.0)
    published = [frozenset(damper.apply({A, B}, 0.0)[0])]
    t = 0.0
    for flip in range(50):  # B flips every 100 ms
        t = round(t + 0.1, 3)
        state, _ = damper.apply({A, B} if flip % 2 else {A}, t)
        if frozenset(state) != published[-1]:
            published.append(frozenset(state))
    # Flapping ends with B present; it is re-added after the hold.
    while t < 8.0:
        t = round(t + 0.1, 3)
        state, _ = damper.apply({A, B}, t)
        if frozenset(state) != published[-1]:
            published.append(frozenset(state))
    # One removal at the first flip, one re-add after it settled: 2 changes, not 50.
    assert published == [frozenset({A, B}), frozenset({A}), frozenset({A, B})]


def test_an_endpoint_returning_after_the_window_is_new_again() -> None:
    damper = FlapDamper(flap_window=5.0, hold=1.0)
    damper.apply({A}, 0.0)
    damper.apply(set(), 1.0)
    assert damper.apply({A}, 7.0) == ({A}, None)


WEB = ServiceSpec(name="web", listen=("127.0.0.1", 10000))


def reported(*ports: int) -> DesiredState:
    return DesiredState(services={"web": WEB}, endpoints={"web": tuple(Endpoint("127.0.0.1", p) for p in ports)})


def addresses(damping: Damping, states: dict[str, DesiredState], now: float) -> tuple[list[str], float | None]:
    merged, wake = damping.damped(merge_states(states), now)
    return sorted(e.address for e in merged.endpoints.get("web", ())), wake


def test_an_endpoint_is_present_while_any_source_reports_it() -> None:
    damping = Damping(flap_window=30.0, hold=1.0)
    states = {"file": reported(9001), "registry": reported(9001)}
    damping.report(None, states["file"], 0.0)
    damping.report(None, states["registry"], 0.0)
    states["file"] = reported()
    damping.report(reported(9001), states["file"], 1.0)  # the registry still reports it: not removed
    states["file"] = reported(9001)
    damping.report(reported(), states["file"], 1.5)
    assert addresses(damping, states, 1.5) == (["127.0.0.1:9001"], None), "it never left: nothing to damp"


def test_a_returning_endpoint_is_taken_out_of_the_merged_state_until_its_hold_ends() -> None:
    damping = Damping(flap_window=30.0, hold=1.0)
    damping.report(None, reported(9001, 9002), 0.0)
    damping.report(reported(9001, 9002), reported(9001), 1.0)
    damping.report(reported(9001), reported(9001, 9002), 1.5)
    states = {"file": reported(9001, 9002)}
    assert addresses(damping, states, 1.6) == (["127.0.0.1:9001"], 2.5)
    assert addresses(damping, states, 2.5) == (["127.0.0.1:9001", "127.0.0.1:9002"], None)


def test_an_unchanged_endpoint_list_costs_no_diff() -> None:
    damping = Damping(flap_window=30.0, hold=1.0)
    same = reported(9001)
    damping.report(None, same, 0.0)
    damping.report(same, DesiredState(services={"web": WEB}, endpoints=same.endpoints, version="2"), 1.0)
    assert damping.damper.held(1.0) == (set(), None)
