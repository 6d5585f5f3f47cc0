"""Ringsteady subsets and their index tables (src/pilotfish/build/subsetting.py).

The issue's properties, as hypothesis tests: a subset has exactly min(k, n) distinct backends and
does not depend on input order; adding a backend changes at most one entry per proxy; removing
backend j changes only the subsets that held j, one swap each; indices are reused after removal;
the index table is deterministic and order independent and round-trips through JSON.

Balance (the issue: "per-backend load <= 1.15 x mean when proxies >= backends") does NOT hold for
every (m proxies, n backends, k). Measured (tests below pin each part):

- n a power of two and m a multiple of n: every backend carries exactly m * k / n.
- m a multiple of N (the smallest power of two >= n): max / mean is exactly
  ``balance_limit(n, k)``, the limit as m grows. The ring has gaps of two sizes when n is not a
  power of two, and for small k one wide gap more in a window weighs a lot: k = 1, n = 7 gives
  1.75 (up to ~2 for n = 2**p - 1); over n <= 1,100 the limit exceeds 1.15 for some n at every
  k <= 9 and at k = 13 (k = 9: 40 of those n; k = 13: 15), and never at k = 10-12, 14-40, 50, 60,
  80 or 100 (the k tried).
- Any other m adds the van der Corput sequence's discrepancy: at most ~(2/3) log2(m) + 2
  proxies per backend above ``m * k / n * balance_limit(n, k)``; the excess shows most just past a
  power of two (m = 257, 513, ...). With m close to n that is a large share of a small mean: k = 1
  or 2 and m = n + 1 give ~2x.
- So "<= 1.15 x mean for every m >= n" held in the sweeps for every k >= 20 (n <= 200 with
  m <= 16 n, n = 401-1,100 (every 7th) with m <= 4 n; worst 1.133 at n = 639, m = 705), at k = 16
  it failed for some n (1.165 at n = 478, m = 513), at k = 13 for 18 of n <= 200, and at k <= 8
  for most n. The 1.15 test below covers k >= 20; smaller k are tested against the exact bound.
"""

from __future__ import annotations

import json
import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pilotfish.build.subsetting import INDEX_LIMIT, Index, IndexTable, Ring, ZoneRings, balance_limit, pos, subset
from pilotfish.errors import ConfigError

indices = st.integers(min_value=0, max_value=INDEX_LIMIT - 1)
backend_sets = st.sets(indices, max_size=60)
sizes = st.integers(min_value=1, max_value=70)


def loads(*, proxies: int, backends: int, k: int) -> list[int]:
    """Connections per backend 0..n-1 when proxies 0..m-1 each take their subset."""
    ring = Ring(range(backends))
    count = [0] * backends
    for proxy in range(proxies):
        for backend in ring.subset(proxy, k):
            count[backend] += 1
    return count


# --- pos ------------------------------------------------------------------------------------


def test_pos_reverses_32_bits() -> None:
    assert [pos(i) for i in (0, 1, 2, 3, 4)] == [0, 2**31, 2**30, 3 * 2**30, 2**29]
    assert pos(INDEX_LIMIT - 1) == INDEX_LIMIT - 1
    for bad in (-1, INDEX_LIMIT):
        with pytest.raises(ValueError, match="2\\*\\*32"):
            pos(bad)


@given(indices)
def test_pos_is_an_involution(i: int) -> None:
    assert pos(pos(i)) == i
    assert int(f"{i:032b}"[::-1], 2) == pos(i)


# --- subsets --------------------------------------------------------------------------------


@given(backend_sets, indices, sizes)
def test_a_subset_has_exactly_min_k_n_distinct_backends_of_the_set(backends: set[int], proxy: int, k: int) -> None:
    chosen = Ring(backends).subset(proxy, k)
    assert len(chosen) == len(set(chosen)) == min(k, len(backends))
    assert set(chosen) <= backends
    assert subset(proxy=proxy, backends=backends, k=k) == chosen


@given(st.lists(indices, unique=True, max_size=60), indices, sizes, st.randoms(use_true_random=False))
def test_a_subset_does_not_depend_on_the_order_of_the_backends(
    backends: list[int], proxy: int, k: int, rnd: random.Random
) -> None:
    shuffled = backends[:]
    rnd.shuffle(shuffled)
    assert Ring(backends).subset(proxy, k) == Ring(shuffled).subset(proxy, k)


def test_a_subset_is_the_k_backends_from_the_first_at_or_after_the_proxy_wrapping_around() -> None:
    # Backends 0..7 on the ring: positions pos(0) < pos(4) < pos(2) < pos(6) < pos(1) < ...
    ring = Ring(range(8))
    assert ring.order == (0, 4, 2, 6, 1, 5, 3, 7)
    assert ring.subset(0, 3) == (0, 4, 2)  # pos(0) = 0: starts at backend 0
    assert ring.subset(7, 3) == (7, 0, 4)  # the last one, then wraps around
    assert ring.subset(7, 20) == (7, 0, 4, 2, 6, 1, 5, 3)  # n <= k: all of them
    assert ring.subset(8, 2) == (4, 2)  # pos(8) = 2**28 is between pos(0) and pos(4) = 2**29
    assert Ring([]).subset(3, 2) == ()


def test_duplicate_backends_and_a_size_below_one_are_refused() -> None:
    with pytest.raises(ValueError, match="given twice"):
        Ring([1, 2, 1])
    with pytest.raises(ValueError, match="at least 1"):
        Ring([1, 2]).subset(0, 0)


@settings(max_examples=60)
@given(backend_sets, indices, sizes, st.lists(indices, max_size=40))
def test_adding_a_backend_changes_at_most_one_entry_per_proxy(
    backends: set[int], new: int, k: int, proxies: list[int]
) -> None:
    if new in backends:
        return
    before, after = Ring(backends), Ring(backends | {new})
    for proxy in [*proxies, *range(20)]:
        old, now = set(before.subset(proxy, k)), set(after.subset(proxy, k))
        assert len(now - old) <= 1 and len(old - now) <= 1
        assert now - old in (set(), {new})  # only the newcomer moves in
        if len(backends) < k:
            assert now == old | {new}


@settings(max_examples=60)
@given(backend_sets.filter(bool), sizes, st.lists(indices, max_size=40), st.data())
def test_removing_a_backend_changes_only_the_subsets_that_held_it_one_swap_each(
    backends: set[int], k: int, proxies: list[int], data: st.DataObject
) -> None:
    gone = data.draw(st.sampled_from(sorted(backends)))
    before, after = Ring(backends), Ring(backends - {gone})
    for proxy in [*proxies, *range(20)]:
        old, now = before.subset(proxy, k), after.subset(proxy, k)
        if gone not in old:
            assert now == old
        elif len(backends) - 1 >= k:
            assert set(old) - set(now) == {gone} and len(set(now) - set(old)) == 1
        else:
            assert set(now) == set(old) - {gone}


# --- balance --------------------------------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 7), st.integers(1, 4), st.data())
def test_a_power_of_two_of_backends_is_balanced_exactly(p: int, rounds: int, data: st.DataObject) -> None:
    n = 2**p
    k = data.draw(st.integers(1, n))
    assert set(loads(proxies=rounds * n, backends=n, k=k)) == {rounds * k}


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 120), st.integers(1, 3), st.data())
def test_with_proxies_a_multiple_of_the_next_power_of_two_max_over_mean_is_the_balance_limit(
    n: int, rounds: int, data: st.DataObject
) -> None:
    k = data.draw(st.integers(1, n))
    m = rounds * (1 << (n - 1).bit_length())
    load = loads(proxies=m, backends=n, k=k)
    mean = m * k / n
    assert max(load) / mean == pytest.approx(balance_limit(n, k))
    assert sum(load) == m * k


def test_small_subsets_of_a_ring_with_unequal_gaps_exceed_1_15_times_the_mean() -> None:
    # Not a bug of the code: the algorithm's balance for small k (module docstring). n = 7 puts
    # one wide gap on the ring; with k = 1 the backend after it carries 1.75x the mean.
    assert balance_limit(7, 1) == 1.75
    assert max(loads(proxies=800, backends=7, k=1)) / (800 / 7) == pytest.approx(1.75)
    assert balance_limit(1023, 1) > 1.99
    # And with m just above n the integer counts dominate: 2 connections where the mean is 1.1.
    assert max(loads(proxies=11, backends=10, k=1)) == 2


@settings(max_examples=100, deadline=None)
@given(st.integers(2, 120), st.data())
def test_no_backend_carries_more_than_the_limit_plus_the_sequences_discrepancy(n: int, data: st.DataObject) -> None:
    k = data.draw(st.integers(1, n), label="k")
    m = data.draw(st.integers(1, 8 * n), label="proxies")
    load = loads(proxies=m, backends=n, k=k)
    mean = m * min(k, n) / n
    # The van der Corput discrepancy: |count in an arc - m * length| <= 2 * (log2(m) / 3 + 1).
    assert max(load) <= mean * balance_limit(n, k) + 2 * (math.log2(m) / 3 + 1)


@settings(max_examples=40, deadline=None)
@given(st.integers(21, 300), st.data())
def test_per_backend_load_is_at_most_1_15_times_the_mean_for_k_of_20_or_more(n: int, data: st.DataObject) -> None:
    k = data.draw(st.integers(20, min(n, 40)), label="k")
    m = data.draw(st.integers(n, 4 * n), label="proxies")
    assert max(loads(proxies=m, backends=n, k=k)) <= 1.15 * m * k / n


def test_the_benchmark_grid_is_balanced_within_1_15() -> None:
    # The benchmark's largest row: 10,000 proxies, 1,000 backends, k = 20 (and 100).
    for k in (20, 100):
        load = loads(proxies=10_000, backends=1_000, k=k)
        assert max(load) <= 1.15 * 10_000 * k / 1_000


# --- zones ----------------------------------------------------------------------------------


def test_zone_rings_choose_within_the_proxys_zone_first() -> None:
    zones = {b: ("a" if b < 6 else "b" if b < 8 else None) for b in range(10)}  # a: 6, b: 2, None: 2
    rings = ZoneRings(zones, k=3)
    for proxy in range(50):
        in_a = rings.subset(proxy, zone="a")
        assert in_a == Ring(range(6)).subset(proxy, 3)  # enough in zone a: only zone a
        in_b = rings.subset(proxy, zone="b")
        assert len(set(in_b)) == 3 and in_b[:2] == (6, 7)  # zone b's two, then one of the rest
        assert in_b[2] == Ring([*range(6), 8, 9]).subset(proxy, 1)[0]
        assert rings.subset(proxy, zone="c") == Ring(range(10)).subset(proxy, 3)  # no backend there
        assert rings.subset(proxy, zone=None) == Ring(range(10)).subset(proxy, 3)  # zone unknown


@given(
    st.dictionaries(st.integers(0, 200), st.sampled_from(["a", "b", "c", None]), max_size=40),
    st.integers(1, 12),
    st.lists(st.tuples(indices, st.sampled_from(["a", "b", "c", "d", None])), max_size=20),
)
def test_zone_subsets_have_min_k_n_distinct_backends_the_own_zones_first(
    zones: dict[int, str | None], k: int, proxies: list[tuple[int, str | None]]
) -> None:
    rings = ZoneRings(zones, k=k)
    for proxy, zone in proxies:
        chosen = rings.subset(proxy, zone=zone)
        assert len(chosen) == len(set(chosen)) == min(k, len(zones))
        if zone is not None:
            own = {b for b, z in zones.items() if z == zone}
            assert len(own & set(chosen)) == min(k, len(own))


# --- index tables ---------------------------------------------------------------------------


def test_indices_are_the_lowest_free_kept_while_present_and_reused_lowest_first() -> None:
    table = IndexTable().update(present=["c", "a", "b"])
    assert dict(table.indices) == {"a": 0, "b": 1, "c": 2}  # new keys in sorted order
    table = table.update(present=["a", "c"])
    assert dict(table.indices) == {"a": 0, "c": 2}  # b's index freed, the others kept
    table = table.update(present=["a", "c", "z", "d"])
    assert dict(table.indices) == {"a": 0, "c": 2, "d": 1, "z": 3}  # 1 reused first
    assert table.update(present=["d", "z", "c", "a"]) is table  # nothing changed


def test_a_reserved_key_keeps_its_index_but_a_new_one_gets_none() -> None:
    table = IndexTable().update(present=["a", "b"])
    table = table.update(present=["b", "c"], reserved=["a", "x"])
    assert dict(table.indices) == {"a": 0, "b": 1, "c": 2}
    assert table.index("x") is None and "x" not in table
    assert dict(table.update(present=["b", "c", "a"]).indices) == {"a": 0, "b": 1, "c": 2}  # came back
    assert dict(table.update(present=["b", "c", "d"]).indices) == {"b": 1, "c": 2, "d": 0}  # grace over


keys = st.text(alphabet="abcdef:.0123456789", min_size=1, max_size=4)
key_sets = st.lists(st.sets(keys, max_size=12), min_size=1, max_size=8)


@given(key_sets, st.randoms(use_true_random=False))
def test_the_table_is_deterministic_order_independent_and_dense(history: list[set[str]], rnd: random.Random) -> None:
    table, twin, largest = IndexTable(), IndexTable(), 0
    for present in history:
        previous = table
        table = table.update(present=present)
        shuffled = list(present)
        rnd.shuffle(shuffled)
        twin = twin.update(present=iter(shuffled))
        assert table == twin  # another replica, keys in another order: the same table
        assert set(table.indices) == present
        values = list(table.indices.values())
        assert len(set(values)) == len(values)
        for key in present & set(previous.indices):
            assert table.indices[key] == previous.indices[key]  # kept while present
        # New keys take the lowest indices the kept ones leave free, in sorted key order.
        new = sorted(present - set(previous.indices))
        kept = {previous.indices[key] for key in present & set(previous.indices)}
        free = [i for i in range(len(present) + len(kept)) if i not in kept][: len(new)]
        assert [table.indices[key] for key in new] == free
        largest = max(largest, len(present))
        assert all(i < largest for i in values)  # holes are reused: never above the most keys seen


@given(key_sets)
def test_a_table_round_trips_through_json(history: list[set[str]]) -> None:
    table = IndexTable()
    for present in history:
        table = table.update(present=present)
    text = json.dumps(table.to_json())
    assert IndexTable.from_json(json.loads(text), source="state.json") == table
    assert json.dumps(IndexTable.from_json(json.loads(text), source="state.json").to_json()) == text


@pytest.mark.parametrize(
    ("data", "where", "what"),
    [
        ([1, 2], "", "expected an object"),
        ({"indices": {}}, "version", "expected 1, got None"),
        ({"version": 2, "indices": {}}, "version", "newer pilotfish"),
        ({"version": 1}, "indices", "expected an object of key -> index"),
        ({"version": 1, "indices": {}, "extra": 1}, "extra", "unknown field"),
        ({"version": 1, "indices": {"a": "1"}}, "indices['a']", "must be an integer, got str"),
        ({"version": 1, "indices": {"a": 1.0}}, "indices['a']", "must be an integer, got float"),
        ({"version": 1, "indices": {"a": True}}, "indices['a']", "must be an integer, got bool"),
        ({"version": 1, "indices": {"a": -1}}, "indices['a']", "outside [0, 2**32)"),
        ({"version": 1, "indices": {"a": 2**32}}, "indices['a']", "outside [0, 2**32)"),
        ({"version": 1, "indices": {"a": 3, "b": 3}}, "indices['b']", "also held by 'a'"),
        ({"version": 1, "indices": {4: 3}}, "indices[4]", "key must be a string"),
    ],
)
def test_a_corrupt_table_is_refused_naming_the_field(data: object, where: str, what: str) -> None:
    with pytest.raises(ConfigError) as caught:
        IndexTable.from_json(data, source="/var/lib/pilotfish/subsets.json")
    text = str(caught.value)
    assert text.startswith("/var/lib/pilotfish/subsets.json:")
    assert any(p.where == where and what in p.message for p in caught.value.problems), text


def test_a_huge_corrupt_table_gives_a_short_error() -> None:
    data = {"version": 1, "indices": {f"k{i}": -i - 1 for i in range(100_000)}}
    with pytest.raises(ConfigError) as caught:
        IndexTable.from_json(data, source="state.json")
    assert len(caught.value.problems) <= 13
    assert len(str(caught.value)) < 2000


def test_a_table_built_in_code_is_checked_too() -> None:
    with pytest.raises(ValueError, match="also held by"):
        IndexTable({"a": Index(1), "b": Index(1)})
    table = IndexTable.from_json({"version": 1, "indices": {"a": 5}}, source="s")
    assert dict(table.update(present=["a", "b", "c"]).indices) == {"a": 5, "b": 0, "c": 1}
