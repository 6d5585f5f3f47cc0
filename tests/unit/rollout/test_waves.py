"""Waves: ``--rollout`` parsing with errors that say what to write, and a stable, proportional
assignment of proxies to waves (docs/rollout.md, "Waves")."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pilotfish.rollout.waves import MAX_WAVES, WavePlan, parse_waves, position

node_ids = st.text(st.characters(exclude_categories=["Cs"]), min_size=1, max_size=40)


def test_a_plan_of_named_and_share_waves() -> None:
    plan = parse_waves("canary=edge-canary-*, beta=group:beta, 5%, 25%, 100%")
    assert [w.name for w in plan.waves] == ["canary", "beta", "5%", "25%", "100%"]
    assert [w.share for w in plan.waves] == [0.0, 0.0, 0.05, 0.25, 1.0]
    assert str(plan) == "canary=edge-canary-*,beta=group:beta,5%,25%,100%"
    assert plan.assign("edge-canary-7") == 0
    assert plan.assign("edge-canary-7", "beta") == 0  # the first named wave that matches
    assert plan.assign("edge-1", "beta") == 1
    assert plan.assign("edge/canary-1") >= 2  # '*' does not cross '/', as in --authorize-node


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("", "an empty wave"),
        ("5%,,100%", "an empty wave"),
        ("5%,25%", "the last wave must be '100%'"),
        ("canary=edge-*", "the last wave must be '100%'"),
        ("25%,5%,100%", "shares are cumulative and must increase"),
        ("5%,5%,100%", "must increase"),
        ("0%,100%", "above 0% and at most 100%"),
        ("150%", "above 0% and at most 100%"),
        ("nan%,100%", "above 0% and at most 100%"),
        ("five%,100%", "is not a share"),
        ("canary,100%", "neither NAME=PATTERN"),
        ("=edge-*,100%", "neither NAME=PATTERN"),
        ("can ary=edge-*,100%", "letters, digits"),
        ("5%,canary=edge-*,100%", "named waves come first"),
        ("a=x,a=y,100%", "two waves are called 'a'"),
        ("a=group:,100%", "a group name"),
        (",".join(f"w{i}=x{i}" for i in range(MAX_WAVES)) + ",100%", f"at most {MAX_WAVES}"),
    ],
)
def test_a_bad_plan_names_the_flag_and_what_to_write(text: str, says: str) -> None:
    with pytest.raises(ValueError, match="--rollout") as error:
        parse_waves(text)
    assert says in str(error.value)


def test_positions_are_fractions_of_the_node_id_alone() -> None:
    assert position("edge-1") == position("edge-1")
    assert 0 <= position("edge-1") < 1
    assert position("edge-1") != position("edge-2")


@settings(max_examples=50, deadline=None)
@given(st.lists(node_ids, min_size=1, max_size=60, unique=True), st.randoms(use_true_random=False))
def test_a_proxy_lands_in_the_same_wave_whatever_order_proxies_arrive_in(ids: list[str], rnd: random.Random) -> None:
    plan = parse_waves("canary=edge-canary-*,5%,25%,100%")
    first = {n: plan.assign(n) for n in ids}
    shuffled = list(ids)
    rnd.shuffle(shuffled)
    again = parse_waves("canary=edge-canary-*,5%,25%,100%")  # another replica, another restart
    assert {n: again.assign(n) for n in shuffled} == first


@settings(max_examples=8, deadline=None)
@given(st.text(st.characters(exclude_categories=["Cs"]), max_size=12), st.sampled_from(["", ".pod", "-x/y"]))
def test_shares_are_proportional_for_10000_ids(prefix: str, suffix: str) -> None:
    plan = parse_waves("5%,25%,100%")
    waves = Counter(plan.assign(f"{prefix}{i}{suffix}") for i in range(10_000))
    # within five standard deviations of the binomial counts: 500 (5 %), 2,000 (the next 20 %), 7,500
    for wave, expected, share in ((0, 500, 0.05), (1, 2000, 0.20), (2, 7500, 0.75)):
        assert abs(waves[wave] - expected) <= 5 * (10_000 * share * (1 - share)) ** 0.5, waves


def test_shares_are_of_the_proxies_outside_the_named_waves() -> None:
    plan = parse_waves("canary=canary-*,50%,100%")
    ids = [f"canary-{i}" for i in range(1000)] + [f"edge-{i}" for i in range(4000)]
    waves = Counter(plan.assign(n) for n in ids)
    assert waves[0] == 1000
    assert abs(waves[1] - 2000) < 130


@settings(max_examples=100, deadline=None)
@given(node_ids, st.floats(1, 98), st.floats(0.5, 50))
def test_raising_a_share_only_moves_proxies_into_earlier_waves(node_id: str, share: float, more: float) -> None:
    low = share
    high = min(share + more, 99)
    before = parse_waves(f"{low:.3f}%,{99.5:.1f}%,100%").assign(node_id)
    after = parse_waves(f"{high:.3f}%,{99.5:.1f}%,100%").assign(node_id)
    assert after <= before


def test_every_id_gets_a_wave_and_the_last_takes_the_rest() -> None:
    plan = WavePlan(parse_waves("100%").waves)
    assert {plan.assign(f"n{i}") for i in range(100)} == {0}
