"""The rollout state machine: each transition, each superseding change, each operator command,
endpoint-only changes bypassing the waves, and its state round-tripping through a dict
(docs/rollout.md)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pilotfish.resources import CLUSTER, ENDPOINT, EXTENSION_CONFIG, LISTENER, ROUTE, RUNTIME, SECRET
from pilotfish.rollout.gates import AckSettings, HealthSettings
from pilotfish.rollout.load import ClusterLoad, LoadReport, LoadSettings, LoadStore
from pilotfish.rollout.machine import (
    DEFAULT_TYPES,
    EVENTS,
    CommandRefused,
    Decision,
    Phase,
    RolloutMachine,
    RolloutSettings,
    Step,
    parse_rollout_types,
)
from pilotfish.rollout.waves import parse_waves

CDS, EDS, LDS, RDS = CLUSTER.url, ENDPOINT.url, LISTENER.url, ROUTE.url
ALL = {CDS, EDS, LDS, RDS}
# canary-* first, then 50 % of the rest, then the rest: with these ids, wave 1 and wave 2 are
NODES = ["canary-1", "canary-2", *(f"edge-{i}" for i in range(10))]


def phase_of(machine: RolloutMachine) -> Phase:
    """The machine's phase, read anew (mypy would otherwise keep what an earlier assert narrowed it to)."""
    return machine.phase


def plan_waves(machine: RolloutMachine) -> dict[int, list[str]]:
    waves: dict[int, list[str]] = {}
    for node in NODES:
        waves.setdefault(machine.wave_of(node), []).append(node)
    return waves


def make(
    waves: str = "canary=canary-*,50%,100%", *, loads: LoadStore | None = None, connect: bool = True, **kw: Any
) -> RolloutMachine:
    kw.setdefault("health", None)
    machine = RolloutMachine(RolloutSettings(waves=parse_waves(waves), **kw), loads=loads)
    if connect:
        for node in NODES:
            machine.connected(node, "default", 0.0)
    step = machine.offer("v1", ALL, 0.0)
    assert step.decision is Decision.INITIAL
    return machine


def ack(
    machine: RolloutMachine, nodes: list[str], change: str = "v2", now: float = 1.0, types: tuple[str, ...] = (CDS, LDS)
) -> list[Step]:
    steps = []
    for node in nodes:
        for t in types:
            steps.append(machine.sent(node, t, change, now))
        for t in types:
            steps.append(machine.acked(node, t, change, now))
    return steps


def kinds(steps: list[Step]) -> list[str]:
    return [k for s in steps for k in s.kinds]


def served(machine: RolloutMachine) -> dict[str, str | None]:
    return {n: machine.serves(n) for n in NODES}


def test_every_event_is_declared_with_its_fields() -> None:
    machine = make(bake=0.0)
    steps = [machine.offer("v2", {CDS}, 0.0), machine.pause(0.1), machine.resume(0.2), machine.promote(0.3)]
    steps += [machine.offer("v3", {CDS}, 0.4), machine.abort(0.5), machine.offer("v3", {CDS}, 0.6)]
    steps += [machine.offer("v4", {CDS}, 0.7), *ack(machine, NODES, "v4", 0.8)]
    while machine.running:
        steps.append(machine.promote(0.85))
    steps += [machine.offer("v5", {CDS}, 0.9), machine.nacked("canary-1", CDS, "v5", "no", 1.0)]
    seen = set()
    for step in steps:
        for event in step.events:
            assert set(event.fields) <= EVENTS[event.kind].fields, event
            seen.add(event.kind)
    assert seen == set(EVENTS) - {"rollout_baseline_set"}  # (make() saw that one)


def test_the_first_change_is_the_baseline_for_every_proxy() -> None:
    machine = RolloutMachine(RolloutSettings(waves=parse_waves("100%"), health=None))
    machine.connected("a", "default", 0.0)
    assert machine.serves("a") is None
    step = machine.offer("v1", ALL, 0.0)
    assert step.decision is Decision.INITIAL and step.kinds == ["rollout_baseline_set"]
    assert step.wake == {"a"} and machine.serves("a") == "v1" and phase_of(machine) is Phase.IDLE


def test_a_change_to_endpoints_only_reaches_baseline_and_candidate_alike() -> None:
    machine = make()
    machine.offer("v2", {CDS, EDS}, 1.0)
    before = machine.to_dict()
    step = machine.offer("v2-other-endpoints", {EDS}, 2.0)
    assert step.decision is Decision.BOTH and step.events == () and step.wake == frozenset()
    assert machine.to_dict() == before  # the rollout goes on untouched


def test_rollout_types_are_configurable_and_parsed_with_a_clear_error() -> None:
    assert parse_rollout_types("CDS, lds,routes") == {CDS, LDS, RDS}
    assert {CDS, EXTENSION_CONFIG.url, LDS, RDS, SECRET.url, RUNTIME.url} == DEFAULT_TYPES
    with pytest.raises(ValueError, match="--rollout-types 'CDS,XDS': 'xds' is not a type"):
        parse_rollout_types("CDS,XDS")
    machine = make(types=parse_rollout_types("CDS"))
    assert machine.offer("v2", {LDS, RDS}, 1.0).decision is Decision.BOTH
    assert machine.offer("v2", {CDS}, 1.0).decision is Decision.ROLL_OUT


def test_a_new_candidate_goes_to_the_first_wave_only() -> None:
    machine = make()
    waves = plan_waves(machine)
    step = machine.offer("v2", {CDS, LDS}, 1.0)
    assert step.decision is Decision.ROLL_OUT
    assert step.kinds == ["rollout_started", "rollout_wave_started"]
    assert step.events[0].fields == {
        "candidate": "v2",
        "baseline": "v1",
        "waves": ["canary", "50%", "100%"],
        "types": ["CDS", "LDS"],
    }
    assert step.events[1].fields["proxies"] == 2 and step.events[1].fields["wave"] == "canary"
    assert step.wake == {"canary-1", "canary-2"} == set(waves[0])
    assert {n for n, v in served(machine).items() if v == "v2"} == {"canary-1", "canary-2"}
    assert phase_of(machine) is Phase.ACKING


def test_waves_proceed_on_acks_and_bake_time_to_completion() -> None:
    machine = make(bake=30.0)
    waves = plan_waves(machine)
    assert set(waves) == {0, 1, 2}
    machine.offer("v2", {CDS}, 0.0)
    steps = ack(machine, waves[0], now=1.0)
    assert kinds(steps) == ["rollout_wave_acked"]
    assert phase_of(machine) is Phase.BAKING and machine.deadline() == 31.0
    assert machine.tick(30.9).events == ()
    step = machine.tick(31.0)
    assert step.kinds == ["rollout_wave_passed", "rollout_wave_started"]
    assert step.events[0].fields["result"] == "baked"
    assert step.wake == set(waves[1])
    ack(machine, waves[1], now=32.0)
    step = machine.tick(62.0)
    assert step.wake == set(waves[2])
    ack(machine, waves[2], now=63.0)
    step = machine.tick(93.0)
    assert step.kinds == ["rollout_wave_passed", "rollout_completed"]
    assert step.events[1].fields == {"candidate": "v2", "previous": "v1"}
    assert step.wake == frozenset()  # every proxy had it already
    assert machine.baseline == "v2" and machine.candidate is None and phase_of(machine) is Phase.IDLE
    assert set(served(machine).values()) == {"v2"}


def test_a_nack_rolls_back_holds_the_candidate_and_it_is_never_sent_again() -> None:
    machine = make()
    machine.offer("v2", {CDS}, 0.0)
    machine.sent("canary-1", CDS, "v2", 1.0)
    step = machine.nacked(
        "canary-1",
        CDS,
        "v2",
        "Proto constraint validation failed (ClusterValidationError.ConnectTimeout: value must be greater than 0s)",
        2.0,
    )
    assert step.kinds == ["rollout_failed", "rollout_rolled_back"]
    reason = step.events[0].fields["reason"]
    assert reason.startswith("wave canary: canary-1 NACKed CDS: Proto constraint validation failed")
    assert step.wake == {"canary-1", "canary-2"}
    assert machine.held["v2"].reason == reason
    assert set(served(machine).values()) == {"v1"}
    machine.connected("canary-9", "default", 3.0)
    assert machine.serves("canary-9") == "v1"  # a proxy that connects later gets the baseline
    step = machine.offer("v2", {CDS}, 4.0)
    assert step.decision is Decision.HELD and step.kinds == ["rollout_held"] and step.wake == frozenset()
    assert step.events[0].fields["reason"] == reason
    assert set(served(machine).values()) == {"v1"}


def test_a_nack_from_an_earlier_wave_fails_a_later_one_and_nacks_of_other_versions_do_not() -> None:
    machine = make(bake=0.0)
    waves = plan_waves(machine)
    machine.offer("v2", {CDS}, 0.0)
    ack(machine, waves[0], now=1.0)
    assert machine.wave == 1  # no bake time: on at once
    assert machine.nacked("edge-1", CDS, "v1", "old", 2.0).events == ()  # the baseline's business, not ours
    step = machine.nacked(waves[0][0], RDS, "v2", "late", 2.0)
    assert step.kinds == ["rollout_failed", "rollout_rolled_back"]
    assert step.events[0].fields["reason"] == f"wave 50%: {waves[0][0]} NACKed RDS: late"
    assert step.wake == set(waves[0]) | set(waves[1])


def test_a_proxy_that_does_not_ack_within_the_timeout_fails_the_wave() -> None:
    machine = make(ack=AckSettings(timeout=30.0))
    machine.offer("v2", {CDS}, 0.0)
    ack(machine, ["canary-1"], now=1.0)
    machine.sent("canary-2", CDS, "v2", 1.0)
    assert machine.tick(29.0).events == ()
    step = machine.tick(30.0)
    assert step.kinds == ["rollout_failed", "rollout_rolled_back"]
    assert step.events[0].fields["reason"] == "wave canary: canary-2 did not ACK CDS within 30 s"


def test_a_wave_that_loses_too_many_proxies_before_they_ack_fails() -> None:
    machine = make(ack=AckSettings(timeout=30.0, max_lost=0.1))
    machine.offer("v2", {CDS}, 0.0)
    ack(machine, ["canary-1"], now=1.0)
    machine.sent("canary-2", CDS, "v2", 1.0)
    machine.disconnected("canary-2", 2.0)  # and never comes back: one of two is more than 10 %
    step = machine.tick(30.0)
    assert step.kinds == ["rollout_failed", "rollout_rolled_back"]
    assert step.events[0].fields["reason"] == (
        "wave canary: 1 of 2 proxies disconnected before ACKing (canary-2); at most 10% may"
    )
    assert step.wake == {"canary-1"}  # canary-2 is gone; it gets the baseline when it connects


def test_a_wave_forgives_a_lost_proxy_within_its_share_and_names_it() -> None:
    machine = make(waves="50%,100%", ack=AckSettings(timeout=30.0, max_lost=0.5))
    members = [n for n in NODES if machine.wave_of(n) == 0]
    machine.offer("v2", {CDS}, 0.0)
    ack(machine, members[1:], now=1.0)
    machine.sent(members[0], CDS, "v2", 1.0)
    machine.disconnected(members[0], 2.0)
    step = machine.tick(30.0)
    assert step.kinds == ["rollout_wave_acked"]
    assert step.events[0].fields["lost_proxies"] == [members[0]]


def test_a_wave_with_no_connected_proxy_passes_at_once_and_reports_who_it_skipped() -> None:
    machine = make()
    machine.disconnected("canary-1", 0.5)
    machine.disconnected("canary-2", 0.5)
    step = machine.offer("v2", {CDS}, 1.0)
    assert step.kinds == ["rollout_started", "rollout_wave_started", "rollout_wave_passed", "rollout_wave_started"]
    assert step.events[1].fields["skipped"] == 2
    assert step.events[1].fields["skipped_proxies"] == ["canary-1", "canary-2"]
    assert step.events[2].fields["result"] == "no connected proxy in the wave"
    assert machine.wave == 1
    machine.connected("canary-1", "default", 2.0)
    assert machine.serves("canary-1") == "v2"  # it is in a wave that started


def test_a_proxy_that_connects_while_its_wave_waits_for_acks_joins_the_gate() -> None:
    machine = make()
    machine.disconnected("canary-2", 0.0)
    machine.offer("v2", {CDS}, 0.0)
    ack(machine, ["canary-1"], now=1.0)
    assert phase_of(machine) is Phase.BAKING
    machine2 = make()
    machine2.disconnected("canary-2", 0.0)
    machine2.offer("v2", {CDS}, 0.0)
    machine2.connected("canary-2", "default", 0.5)
    ack(machine2, ["canary-1"], now=1.0)
    assert phase_of(machine2) is Phase.ACKING  # canary-2 joined: awaited
    assert machine2.status()["waiting_proxies"] == ["canary-2"]
    ack(machine2, ["canary-2"], now=2.0)
    assert phase_of(machine2) is Phase.BAKING


def test_a_proxy_that_disconnects_mid_wave_may_come_back_and_ack() -> None:
    machine = make()
    machine.offer("v2", {CDS}, 0.0)
    ack(machine, ["canary-1"], now=1.0)
    machine.sent("canary-2", CDS, "v2", 1.0)
    machine.disconnected("canary-2", 2.0)
    assert machine.tick(10.0).events == ()
    machine.connected("canary-2", "default", 11.0)
    assert kinds(ack(machine, ["canary-2"], now=12.0)) == ["rollout_wave_acked"]


@settings(max_examples=30, deadline=None)
@given(st.permutations(NODES), st.lists(st.sampled_from(NODES), max_size=6))
def test_the_proxies_of_a_wave_do_not_depend_on_the_order_they_connect_or_reconnect_in(
    order: list[str], reconnects: list[str]
) -> None:
    machine = make(connect=False)
    for node in order:
        machine.connected(node, "default", 0.0)
    for node in reconnects:
        machine.disconnected(node, 0.0)
        machine.connected(node, "default", 0.0)
    step = machine.offer("v2", {CDS}, 1.0)
    assert step.wake == {"canary-1", "canary-2"}
    reference = make()
    assert {n: machine.wave_of(n) for n in NODES} == {n: reference.wave_of(n) for n in NODES}


def test_two_streams_of_one_node_id_are_one_proxy() -> None:
    machine = make()
    machine.connected("canary-1", "default", 0.0)  # a hot restart: a second Envoy with the same id
    machine.disconnected("canary-1", 0.0)
    machine.offer("v2", {CDS}, 0.0)
    assert machine.status()["waiting"] == 2


# -- superseding ---------------------------------------------------------------------------------------


def test_a_newer_change_supersedes_a_rollout_in_progress_and_starts_from_the_baseline() -> None:
    machine = make(bake=0.0)
    waves = plan_waves(machine)
    machine.offer("v2", {CDS}, 0.0)
    ack(machine, waves[0], now=1.0)
    assert machine.wave == 1
    step = machine.offer("v3", {LDS}, 2.0)
    assert step.decision is Decision.ROLL_OUT
    assert step.kinds == ["rollout_superseded", "rollout_started", "rollout_wave_started"]
    assert step.events[0].fields == {"candidate": "v2", "by": "v3", "wave": "50%", "baseline": "v1"}
    assert step.events[1].fields["baseline"] == "v1"  # the last fully promoted, never v2
    assert step.wake == set(waves[0]) | set(waves[1])  # canaries to v3, wave 1 back to v1
    assert {n: v for n, v in served(machine).items() if v != "v1"} == dict.fromkeys(waves[0], "v3")
    assert "v2" not in machine.held  # superseded is not failed


def test_going_back_to_the_baseline_ends_the_rollout() -> None:
    machine = make()
    machine.offer("v2", {CDS}, 0.0)
    step = machine.offer("v1", {CDS}, 1.0)
    assert step.decision is Decision.BASELINE and step.kinds == ["rollout_superseded"]
    assert step.wake == {"canary-1", "canary-2"} and set(served(machine).values()) == {"v1"}
    assert machine.offer("v1", {CDS}, 2.0).events == ()  # the baseline again, nothing running


def test_an_operators_pause_outlives_a_superseded_rollout_a_pause_for_traffic_does_not() -> None:
    machine = make(bake=0.0)
    machine.offer("v2", {CDS}, 0.0)
    machine.pause(0.5)
    step = machine.offer("v3", {CDS}, 1.0)
    assert step.kinds == ["rollout_superseded", "rollout_started", "rollout_wave_started", "rollout_paused"]
    assert machine.paused == "operator" and machine.candidate == "v3"
    ack(machine, ["canary-1", "canary-2"], "v3", now=2.0)
    assert machine.wave == 0 and phase_of(machine) is Phase.BAKING  # the first wave, and no further
    machine.resume(3.0)
    assert machine.wave == 1
    healthy, _, _, waves = healthy_setup()
    healthy.offer("v2", {CDS}, 0.0)
    ack(healthy, waves[0], now=1.0)
    assert healthy.tick(31.0).kinds == ["rollout_paused"]  # no traffic at all
    assert healthy.offer("v3", {CDS}, 32.0).kinds == ["rollout_superseded", "rollout_started", "rollout_wave_started"]
    assert healthy.paused is None


def test_the_same_candidate_offered_again_changes_nothing() -> None:
    machine = make()
    machine.offer("v2", {CDS}, 0.0)
    step = machine.offer("v2", {CDS}, 1.0)
    assert step.decision is Decision.UNCHANGED and step.events == ()


def test_a_held_candidate_offered_during_another_rollout_supersedes_it_and_stays_held() -> None:
    machine = make()
    machine.offer("v2", {CDS}, 0.0)
    machine.nacked("canary-1", CDS, "v2", "bad", 1.0)
    step = machine.offer("v3", {CDS}, 2.0)  # a newer change supersedes a held candidate
    assert step.decision is Decision.ROLL_OUT and "rollout_superseded" not in step.kinds
    step = machine.offer("v2", {CDS}, 3.0)
    assert step.decision is Decision.HELD and step.kinds == ["rollout_superseded", "rollout_held"]
    assert set(served(machine).values()) == {"v1"}


# -- operator commands ---------------------------------------------------------------------------------


def test_promote_skips_the_ack_wait_and_the_bake_and_completes_from_the_last_wave() -> None:
    machine = make(bake=300.0)
    waves = plan_waves(machine)
    machine.offer("v2", {CDS}, 0.0)
    step = machine.promote(1.0)
    assert step.kinds == ["rollout_promoted", "rollout_wave_passed", "rollout_wave_started"]
    assert step.events[1].fields["result"] == "promoted by the operator"
    assert step.wake == set(waves[1])
    ack(machine, waves[1], now=2.0)
    assert phase_of(machine) is Phase.BAKING
    machine.promote(3.0)
    step = machine.promote(4.0)
    assert step.kinds == ["rollout_promoted", "rollout_wave_passed", "rollout_completed"]
    assert machine.baseline == "v2"
    with pytest.raises(CommandRefused, match="promote: no rollout in progress; a new change starts one"):
        machine.promote(5.0)


def test_pause_stops_the_next_wave_and_resume_goes_on() -> None:
    machine = make(bake=30.0)
    waves = plan_waves(machine)
    machine.offer("v2", {CDS}, 0.0)
    step = machine.pause(0.5)
    assert step.kinds == ["rollout_paused"] and step.events[0].fields["reason"] == "paused by the operator"
    ack(machine, waves[0], now=1.0)
    assert phase_of(machine) is Phase.BAKING  # acks are still taken while paused
    assert machine.tick(100.0).events == () and machine.deadline() is None
    with pytest.raises(CommandRefused, match="already paused"):
        machine.pause(101.0)
    step = machine.resume(102.0)
    assert step.kinds == ["rollout_resumed", "rollout_wave_passed", "rollout_wave_started"]
    with pytest.raises(CommandRefused, match="not paused"):
        machine.resume(103.0)


def test_a_paused_rollout_still_rolls_back_on_a_nack() -> None:
    machine = make()
    machine.offer("v2", {CDS}, 0.0)
    machine.pause(0.5)
    step = machine.nacked("canary-2", LDS, "v2", "no", 1.0)
    assert step.kinds == ["rollout_failed", "rollout_rolled_back"] and machine.paused is None


def test_abort_rolls_back_to_the_baseline_and_holds_the_candidate() -> None:
    machine = make(bake=0.0)
    waves = plan_waves(machine)
    machine.offer("v2", {CDS}, 0.0)
    ack(machine, waves[0], now=1.0)
    step = machine.abort(2.0, "latency looks off")
    assert step.kinds == ["rollout_aborted", "rollout_rolled_back"]
    assert step.wake == set(waves[0]) | set(waves[1])
    assert machine.held["v2"].reason == "wave 50%: aborted by the operator: latency looks off"
    with pytest.raises(CommandRefused, match=r"abort: no rollout in progress \(held: v2\)"):
        machine.abort(3.0)


# -- health --------------------------------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def traffic(
    store: LoadStore, clock: Clock, nodes: list[str], at: float, requests: int, errors: int, cluster: str = "web"
) -> None:
    clock.now = at
    for node in nodes:
        store.ingest(
            node,
            LoadReport(
                node_id=node,
                clusters=(
                    ClusterLoad(
                        cluster=cluster,
                        service="",
                        successful=requests - errors,
                        errors=errors,
                        issued=requests,
                        in_progress=0,
                        dropped=0,
                        interval=5.0,
                    ),
                ),
            ),
        )


def healthy_setup(**kw: Any) -> tuple[RolloutMachine, LoadStore, Clock, dict[int, list[str]]]:
    clock = Clock()
    made: list[RolloutMachine] = []  # (the store counts by the machine's waves; the machine reads the store)
    store = LoadStore(
        LoadSettings(bucket=1.0, retention=300.0),
        clock=clock,
        classify=lambda n, g: made[0].settings.waves.assign(n, g),
    )
    made.append(make(loads=store, bake=30.0, health=HealthSettings(min_requests=100), **kw))
    return made[0], store, clock, plan_waves(made[0])


def test_a_load_store_that_forgets_before_a_wave_is_judged_is_refused() -> None:
    store = LoadStore(LoadSettings(retention=50.0), clock=Clock())
    settings = RolloutSettings(waves=parse_waves("100%"), bake=30.0)
    with pytest.raises(ValueError, match=r"keeps 50 s of load reports.*\(60 s\)"):
        RolloutMachine(settings, loads=store)


def test_a_wave_whose_error_ratio_exceeds_the_baselines_fails_as_soon_as_it_shows() -> None:
    machine, store, clock, waves = healthy_setup()
    machine.offer("v2", {CDS}, 0.0)
    ack(machine, waves[0], now=1.0)
    traffic(store, clock, waves[0], 11.0, requests=500, errors=62)  # 12.4 %, began at 6
    traffic(store, clock, waves[1] + waves[2], 11.0, requests=1000, errors=2)  # 0.2 %
    step = machine.tick(11.0)  # before the bake is over
    assert step.kinds == ["rollout_failed", "rollout_rolled_back"]
    assert step.events[0].fields["reason"] == "wave canary: error ratio 12.4 % vs 0.2 % baseline on cluster web"


def test_a_healthy_wave_passes_with_its_figures() -> None:
    machine, store, clock, waves = healthy_setup()
    machine.offer("v2", {CDS}, 0.0)
    ack(machine, waves[0], now=1.0)
    traffic(store, clock, waves[0], 11.0, requests=500, errors=1)
    traffic(store, clock, waves[1] + waves[2], 11.0, requests=1000, errors=2)
    step = machine.tick(31.0)
    assert step.kinds == ["rollout_wave_passed", "rollout_wave_started"]
    assert step.events[0].fields == {
        "candidate": "v2",
        "wave": "canary",
        "result": "healthy",
        "error_ratio": 0.002,
        "baseline_error_ratio": 0.002,
        "requests": 1000,
    }


def test_load_from_before_the_bake_is_not_the_waves() -> None:
    machine, store, clock, waves = healthy_setup()
    machine.offer("v2", {CDS}, 0.0)
    traffic(store, clock, waves[0], 5.0, requests=500, errors=400)  # began at 0, before the ACKs
    ack(machine, waves[0], now=1.0)
    traffic(store, clock, waves[1] + waves[2], 11.0, requests=1000, errors=2)
    assert machine.tick(11.0).events == ()


def test_too_little_traffic_pauses_and_resume_bakes_again() -> None:
    machine, store, clock, waves = healthy_setup()
    machine.offer("v2", {CDS}, 0.0)
    ack(machine, waves[0], now=1.0)
    traffic(store, clock, waves[0], 11.0, requests=3, errors=3)  # three requests decide nothing
    traffic(store, clock, waves[1] + waves[2], 11.0, requests=1000, errors=0)
    step = machine.tick(31.0)
    assert step.kinds == ["rollout_paused"]
    assert step.events[0].fields["reason"] == (
        "wave canary: the wave completed 6 requests, at least 100 are needed "
        "to judge; promote to go on, abort to roll back"
    )
    assert machine.tick(40.0).events == ()
    machine.resume(41.0)
    assert machine.bake_started == 41.0 and machine.deadline() == 71.0


def test_too_little_traffic_may_pass_on_acks_alone() -> None:
    machine, _, _, waves = healthy_setup(too_little_traffic="pass")
    machine.offer("v2", {CDS}, 0.0)
    ack(machine, waves[0], now=1.0)
    step = machine.tick(31.0)
    assert step.kinds == ["rollout_wave_passed", "rollout_wave_started"]
    assert step.events[0].fields["result"].startswith("health not judged: the baseline completed 0 requests")


def test_the_last_wave_is_judged_against_the_baseline_before_it_began() -> None:
    machine, store, clock, waves = healthy_setup()
    machine.offer("v2", {CDS}, 0.0)
    machine.promote(1.0)
    traffic(store, clock, waves[2], 10.0, requests=1000, errors=1)  # [5, 10]: on v1 still
    step = machine.promote(10.0)
    assert step.kinds[-1] == "rollout_wave_started" and machine.wave == 2
    ack(machine, waves[2], now=11.0)
    traffic(store, clock, waves[2], 21.0, requests=1000, errors=100)  # [16, 21]: 10 % on v2, no baseline left
    step = machine.tick(21.0)
    assert step.kinds == ["rollout_failed", "rollout_rolled_back"]
    assert step.events[0].fields["reason"] == (
        "wave 100%: error ratio 10.0 % vs 0.1 % baseline before the wave on cluster web"
    )


# -- state -----------------------------------------------------------------------------------------------


def round_trip(machine: RolloutMachine) -> RolloutMachine:
    data = json.loads(json.dumps(machine.to_dict()))
    again = RolloutMachine.from_dict(data, machine.settings)
    assert again.to_dict() == machine.to_dict()
    return again


def test_the_state_round_trips_through_json_at_every_phase() -> None:
    machine = make(bake=30.0)
    waves = plan_waves(machine)
    round_trip(machine)
    machine.offer("v2", {CDS}, 0.0)
    ack(machine, waves[0][:1], now=1.0)
    again = round_trip(machine)
    for node in NODES:
        again.connected(node, "default", 2.0)
    assert served(again) == served(machine)
    ack(again, waves[0][1:], now=2.0)  # the restored ACK gate remembers who ACKed
    assert phase_of(again) is Phase.BAKING
    machine.pause(3.0)
    round_trip(machine)
    machine.nacked(waves[0][0], CDS, "v2", "bad", 4.0)
    restored = round_trip(machine)
    assert restored.serves("canary-1", "default") == "v1"
    assert restored.offer("v2", {CDS}, 5.0).decision is Decision.HELD  # a restart never sends a held candidate


def test_a_stored_state_of_another_version_or_shape_is_refused_clearly() -> None:
    settings = RolloutSettings(waves=parse_waves("100%"), health=None)
    with pytest.raises(ValueError, match="stored rollout state: version 9, this pilotfish reads version 1"):
        RolloutMachine.from_dict({"version": 9}, settings)
    with pytest.raises(ValueError, match="stored rollout state: KeyError"):
        RolloutMachine.from_dict({"version": 1}, settings)


def test_a_stored_rollout_of_other_waves_starts_again_but_keeps_what_is_held() -> None:
    machine = make()
    machine.offer("v2", {CDS}, 0.0)
    machine.nacked("canary-1", CDS, "v2", "bad", 1.0)
    machine.offer("v3", {CDS}, 2.0)
    other = RolloutSettings(waves=parse_waves("10%,100%"), health=None)
    restored = RolloutMachine.from_dict(machine.to_dict(), other)
    assert restored.candidate is None and restored.baseline == "v1" and "v2" in restored.held
    assert restored.offer("v3", {CDS}, 3.0).decision is Decision.ROLL_OUT


def test_held_candidates_are_bounded_the_newest_kept() -> None:
    machine = make(max_held=3)
    for i in range(5):
        machine.offer(f"bad-{i}", {CDS}, float(i))
        machine.nacked("canary-1", CDS, f"bad-{i}", "no", float(i))
    assert list(machine.held) == ["bad-2", "bad-3", "bad-4"]


# -- properties ------------------------------------------------------------------------------------------

commands = st.lists(
    st.tuples(
        st.sampled_from(["offer", "ack", "nack", "tick", "promote", "pause", "resume", "abort", "drop", "join"]),
        st.integers(0, 4),
        st.sampled_from(NODES),
    ),
    max_size=40,
)


@settings(max_examples=150, deadline=None)
@given(commands)
def test_no_proxy_is_ever_served_a_held_candidate_and_wake_says_who_moved(script: list[tuple[str, int, str]]) -> None:
    machine = make(bake=5.0)
    now = 0.0
    for command, number, node in script:
        now += 1.0
        before = {n: machine.serves(n) for n in NODES}
        connected = set(machine._connected)
        try:
            if command == "offer":
                step = machine.offer(f"v{number + 2}", {CDS}, now)
            elif command == "ack":
                step = ack(machine, [node], change=machine.candidate or "none", now=now)[-1]
            elif command == "nack":
                step = machine.nacked(node, CDS, machine.candidate or "none", "no", now)
            elif command == "tick":
                step = machine.tick(now + number * 10)
            elif command == "drop":
                step = machine.disconnected(node, now)
            elif command == "join":
                step = machine.connected(node, "default", now)
            else:
                step = getattr(machine, command)(now)
        except CommandRefused:
            assert not machine.running or command in ("pause", "resume")
            continue
        after = {n: machine.serves(n) for n in NODES}
        for event in step.events:
            assert set(event.fields) <= EVENTS[event.kind].fields, event
            json.dumps(dict(event.fields))
        for n in NODES:
            assert after[n] in (machine.baseline, machine.candidate)
            assert after[n] not in machine.held
        if command not in ("ack",):  # ack() returns only its last step
            moved = {n for n in connected & set(machine._connected) if before[n] != after[n]}
            assert moved <= step.wake
        assert round_trip(machine).serves(node) == machine.serves(node) or node not in machine._connected


# -- what an offer would decide (pilotfish plan) ---------------------------------------------------------


def test_would_offer_says_what_offer_decides_and_changes_nothing() -> None:
    fresh = RolloutMachine(RolloutSettings(waves=parse_waves("canary=canary-*,50%,100%"), health=None))
    assert fresh.would_offer("v1", {CDS}) is Decision.INITIAL and fresh.baseline is None
    machine = make()
    before = machine.to_dict()
    assert machine.would_offer("v2", {EDS}) is Decision.BOTH
    assert machine.would_offer("v2", {CDS, EDS}) is Decision.ROLL_OUT
    assert machine.to_dict() == before and not machine.running
    assert machine.offer("v2", {CDS}, 0.0).decision is Decision.ROLL_OUT
    assert machine.would_offer("v2", {CDS}) is Decision.UNCHANGED
    assert machine.would_offer("v1", {CDS}) is Decision.BASELINE
    machine.sent("canary-1", CDS, "v2", 1.0)
    machine.nacked("canary-1", CDS, "v2", "no", 2.0)
    assert machine.would_offer("v2", {CDS}) is Decision.HELD
    sizes = machine.wave_sizes()
    assert len(sizes) == 3 and sizes[0] == 2 and sum(sizes) == len(NODES)
    assert sizes == [len(plan_waves(machine).get(index, [])) for index in range(3)]


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.sampled_from([{CDS}, {EDS}, {CDS, EDS}]), st.booleans()), max_size=20))
def test_would_offer_always_agrees_with_the_offer_that_follows(script: list[tuple[int, set[str], bool]]) -> None:
    machine = make(bake=5.0)
    now = 0.0
    for number, changed, nack in script:
        now += 1.0
        change = f"v{number + 1}"
        state = machine.to_dict()
        expected = machine.would_offer(change, changed)
        assert machine.to_dict() == state
        assert machine.offer(change, changed, now).decision is expected
        if nack and machine.candidate is not None:
            machine.nacked("canary-1", CDS, machine.candidate, "no", now)
