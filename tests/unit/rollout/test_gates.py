"""The gates between waves: the ACK gate's timeout and lost proxies, and the error-ratio arithmetic
against the baseline (docs/rollout.md, "Gates")."""

from __future__ import annotations

import pytest

from pilotfish.resources import CLUSTER, LISTENER, ROUTE
from pilotfish.rollout.gates import AckGate, AckSettings, Counts, Gate, HealthSettings, judge_health

CDS, LDS, RDS = CLUSTER.url, LISTENER.url, ROUTE.url


def ok(n: int) -> Counts:
    return Counts(successful=n)


def mixed(n: int, errors: int) -> Counts:
    return Counts(successful=n - errors, errors=errors)


# -- ACK gate ----------------------------------------------------------------------------------------


def test_a_wave_passes_once_every_member_acked_every_type_it_was_sent() -> None:
    gate = AckGate(["a", "b"], 0.0, AckSettings())
    gate.sent("a", CDS)
    gate.sent("a", LDS)
    gate.acked("a", CDS)
    gate.sent("b", CDS)
    gate.acked("b", CDS)
    result = gate.judge(1.0)
    assert result.verdict is Gate.PENDING and result.waiting == ("a",)
    gate.acked("a", LDS)
    assert gate.judge(1.0).verdict is Gate.PASS


def test_a_member_sent_nothing_yet_is_waited_for_until_the_timeout_then_passes_as_not_sent() -> None:
    gate = AckGate(["a"], 0.0, AckSettings(timeout=30))
    assert gate.judge(29.9).verdict is Gate.PENDING
    result = gate.judge(30.0)
    assert result.verdict is Gate.PASS and result.not_sent == ("a",)


def test_a_connected_member_that_does_not_ack_in_time_fails_the_wave() -> None:
    gate = AckGate(["edge-3", "edge-4"], 0.0, AckSettings(timeout=30))
    for node in ("edge-3", "edge-4"):
        gate.sent(node, CDS)
        gate.sent(node, RDS)
    gate.acked("edge-4", CDS)
    gate.acked("edge-4", RDS)
    gate.acked("edge-3", CDS)
    result = gate.judge(30.0)
    assert result.verdict is Gate.FAIL
    assert result.reason == "edge-3 did not ACK RDS within 30 s"


def test_a_member_that_disconnects_is_waited_for_and_may_reconnect_and_ack() -> None:
    gate = AckGate(["a"], 0.0, AckSettings(timeout=30))
    gate.sent("a", CDS)
    gate.leave("a")
    assert gate.judge(10).verdict is Gate.PENDING
    gate.join("a")
    gate.sent("a", CDS)
    gate.acked("a", CDS)
    assert gate.judge(11).verdict is Gate.PASS


def test_a_few_lost_members_are_dropped_and_reported_too_many_fail_the_wave() -> None:
    members = [f"edge-{i}" for i in range(20)]
    gate = AckGate(members, 0.0, AckSettings(timeout=30, max_lost=0.1))
    for node in members:
        gate.sent(node, CDS)
    for node in members[2:]:
        gate.acked(node, CDS)
    gate.leave("edge-0")
    gate.leave("edge-1")
    result = gate.judge(30)
    assert result.verdict is Gate.PASS and result.lost == ("edge-0", "edge-1")  # 2 of 20: 10 %
    gate.leave("edge-2")
    gate.join("edge-2")  # connected again, but it did ACK before
    assert gate.judge(30).verdict is Gate.PASS
    crashed = AckGate(members, 0.0, AckSettings(timeout=30, max_lost=0.1))
    for node in members:
        crashed.sent(node, CDS)
        crashed.leave(node)  # a candidate that crashes Envoy: every proxy disconnects
    result = crashed.judge(30)
    assert result.verdict is Gate.FAIL
    assert result.reason.startswith("20 of 20 proxies disconnected before ACKing (edge-0, edge-1, edge-10, ...)")


def test_a_lone_canary_that_is_lost_fails_its_wave() -> None:
    gate = AckGate(["canary-1"], 0.0, AckSettings())
    gate.sent("canary-1", CDS)
    gate.leave("canary-1")
    assert gate.judge(30).verdict is Gate.FAIL


def test_a_member_joining_while_the_gate_waits_is_awaited_and_an_empty_gate_passes() -> None:
    assert AckGate([], 0.0, AckSettings()).judge(0).verdict is Gate.PASS
    gate = AckGate([], 0.0, AckSettings())
    gate.join("late")
    gate.sent("late", CDS)
    assert gate.judge(1).verdict is Gate.PENDING


def test_the_ack_gate_round_trips_through_a_dict() -> None:
    gate = AckGate(["a", "b"], 5.0, AckSettings())
    gate.sent("a", CDS)
    gate.acked("a", CDS)
    gate.leave("b")
    again = AckGate.from_dict(gate.to_dict(), AckSettings())
    assert again.to_dict() == gate.to_dict()
    assert again.judge(6).waiting == ("b",)


def test_ack_settings_refuse_nonsense() -> None:
    with pytest.raises(ValueError, match="ACK timeout"):
        AckSettings(timeout=0)
    with pytest.raises(ValueError, match="lost proxies"):
        AckSettings(max_lost=1)


# -- health gate -------------------------------------------------------------------------------------

SETTINGS = HealthSettings(max_increase=0.01, min_requests=100)


def test_a_wave_much_worse_than_the_baseline_on_a_cluster_fails_and_says_where() -> None:
    wave = {"web": mixed(1000, 124), "api": ok(1000)}
    baseline = {"web": mixed(10_000, 20), "api": ok(10_000)}
    result = judge_health(wave, baseline, SETTINGS)
    assert result.verdict is Gate.FAIL
    assert result.reason == "error ratio 12.4 % vs 0.2 % baseline on cluster web"


def test_a_wave_like_the_baseline_passes_even_when_both_fail_a_lot() -> None:
    wave = {"web": mixed(1000, 300)}
    baseline = {"web": mixed(10_000, 2950)}  # a backend failing for everybody: not the candidate's doing
    assert judge_health(wave, baseline, SETTINGS).verdict is Gate.PASS


def test_the_margin_is_absolute_and_the_optional_factor_is_required_too() -> None:
    baseline = {"web": mixed(100_000, 100)}  # 0.1 %
    assert judge_health({"web": mixed(1000, 11)}, baseline, SETTINGS).verdict is Gate.PASS  # 1.1 %: +1.0 pp
    assert judge_health({"web": mixed(1000, 12)}, baseline, SETTINGS).verdict is Gate.FAIL  # 1.2 %: +1.1 pp
    factor = HealthSettings(max_increase=0.0, max_factor=3.0, min_requests=100)
    assert judge_health({"web": mixed(1000, 3)}, baseline, factor).verdict is Gate.PASS  # 3x exactly
    assert judge_health({"web": mixed(1000, 4)}, baseline, factor).verdict is Gate.FAIL  # 4x, +0.3 pp


def test_too_few_requests_decide_nothing() -> None:
    baseline = {"web": ok(10_000)}
    result = judge_health({"web": mixed(3, 3)}, baseline, SETTINGS)  # three errors out of three
    assert result.verdict is Gate.NOT_ENOUGH
    assert result.reason == "the wave completed 3 requests, at least 100 are needed to judge"
    assert judge_health({"web": mixed(100, 3)}, baseline, SETTINGS).verdict is Gate.FAIL


def test_in_progress_and_issued_requests_are_not_completed_ones() -> None:
    wave = {"web": Counts(successful=50, errors=0, issued=10_000)}
    assert judge_health(wave, {"web": ok(10_000)}, SETTINGS).verdict is Gate.NOT_ENOUGH


def test_a_cluster_the_baseline_does_not_use_is_judged_against_the_baseline_overall() -> None:
    baseline = {"web": mixed(10_000, 20)}  # 0.2 %
    wave = {"web": mixed(1000, 2), "new": mixed(200, 20)}  # the candidate's new cluster fails 10 %
    result = judge_health(wave, baseline, SETTINGS)
    assert result.verdict is Gate.FAIL
    assert result.reason == "error ratio 10.0 % vs 0.2 % baseline overall on cluster new"
    quiet = {"web": mixed(10_000, 20), "new": mixed(50, 0)}  # too few on the baseline to stand alone
    assert "baseline overall on cluster new" in judge_health(wave, quiet, SETTINGS).reason


def test_a_small_cluster_of_the_wave_still_counts_in_its_overall_ratio() -> None:
    baseline = {"web": ok(10_000)}
    wave = {f"c{i}": mixed(50, 5) for i in range(10)}  # each cluster too small, together 10 % of 500
    result = judge_health(wave, baseline, SETTINGS)
    assert result.verdict is Gate.FAIL and result.reason == "error ratio 10.0 % vs 0.0 % baseline overall"


def test_without_a_baseline_in_the_window_the_reference_is_the_window_before_the_wave() -> None:
    wave = {"web": mixed(1000, 50)}
    before = {"web": mixed(5000, 5)}
    result = judge_health(wave, {}, SETTINGS, before=before)
    assert result.verdict is Gate.FAIL
    assert result.reason == "error ratio 5.0 % vs 0.1 % baseline before the wave on cluster web"
    result = judge_health(wave, {}, SETTINGS)
    assert result.verdict is Gate.NOT_ENOUGH and result.reason.startswith("the baseline completed 0 requests")


def test_health_settings_refuse_nonsense() -> None:
    with pytest.raises(ValueError, match="percentage point"):
        HealthSettings(max_increase=1.5)
    with pytest.raises(ValueError, match="factor"):
        HealthSettings(max_factor=0.5)
    with pytest.raises(ValueError, match="minimum request count"):
        HealthSettings(min_requests=0)
