"""Subsets as proxies receive them: the snapshot's plan, the cache's per-proxy endpoints,
the proxies' indices and the state file. The arithmetic itself is tested in
tests/unit/build/test_build_subsetting.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from envoy.config.endpoint.v3 import endpoint_pb2
from envoy.service.discovery.v3 import discovery_pb2

from pilotfish.build.desired import DesiredState, View, build_snapshots, merge_states, subset_tables
from pilotfish.build.subsetting import IndexTable, ProxyIndices
from pilotfish.cache import SnapshotCache
from pilotfish.errors import ConfigError
from pilotfish.protocol import Subscription, Watch
from pilotfish.resources import ENDPOINT
from pilotfish.resources.services import Endpoint, ServiceSpec
from pilotfish.snapshot import EncodedResponse, Snapshot
from pilotfish.subsets.state import (
    STATE_FILE,
    SubsetState,
    load_or_start_fresh,
    load_subset_state,
    save_subset_state,
)


def state(ports: range, *, k: int | None = 3, zones: dict[int, str] | None = None) -> DesiredState:
    endpoints = tuple(Endpoint("127.0.0.1", port, zone=(zones or {}).get(port, "")) for port in ports)
    return DesiredState(
        services={"web": ServiceSpec(name="web", subset_size=k), "db": ServiceSpec(name="db")},
        endpoints={"web": endpoints, "db": (Endpoint("127.0.0.1", 5432),)},
    )


def build(
    desired: DesiredState, tables: dict[str, IndexTable] | None = None, *, view: View | None = None
) -> tuple[Snapshot, dict[str, IndexTable]]:
    merged = merge_states({"file": desired})
    tables = subset_tables(merged, tables or {})
    return build_snapshots(merged, "test", {"g": view or View()}, subsets=tables)["g"], tables


def addresses(snapshot: Snapshot, proxy: int | None, name: str = "web") -> set[str]:
    endpoints = snapshot.endpoints_for(proxy)
    assert endpoints is not None
    assignment = endpoints.resources[name].message
    assert isinstance(assignment, endpoint_pb2.ClusterLoadAssignment)
    return {
        f"{e.endpoint.address.socket_address.address}:{e.endpoint.address.socket_address.port_value}"
        for group in assignment.endpoints
        for e in group.lb_endpoints
    }


def test_each_proxy_gets_its_own_k_endpoints_and_together_they_use_every_backend() -> None:
    snapshot, _ = build(state(range(9000, 9012)))
    subsets = [addresses(snapshot, proxy) for proxy in range(6)]
    assert all(len(chosen) == 3 for chosen in subsets)
    assert set().union(*subsets) == {f"127.0.0.1:{port}" for port in range(9000, 9012)}
    assert len(addresses(snapshot, None)) == 12, "a proxy without an index gets every endpoint"
    assert addresses(snapshot, 0, "db") == {"127.0.0.1:5432"}, "services without subset_size are whole"
    assert snapshot.endpoints_for(0) is snapshot.endpoints_for(0), "one view per proxy, made once"


def test_a_service_with_k_or_fewer_endpoints_is_not_subsetted() -> None:
    snapshot, _ = build(state(range(9000, 9003)))
    assert snapshot.subsets is None
    assert len(addresses(snapshot, 5)) == 3


def test_a_new_backend_changes_at_most_one_endpoint_per_proxy_and_versions_follow_content() -> None:
    before, tables = build(state(range(9000, 9012)))
    after, _ = build(state(range(9000, 9013)), tables)
    changed = 0
    for proxy in range(64):
        old, new = addresses(before, proxy), addresses(after, proxy)
        assert len(old - new) <= 1 and len(new - old) <= 1
        same = old == new
        changed += not same
        assert (before.endpoints_for(proxy).version == after.endpoints_for(proxy).version) == same  # type: ignore[union-attr]
    assert changed, "the 13th backend is some proxies' subset"
    assert not before.same_content(after)


def test_the_same_indices_give_the_same_subsets_and_versions_after_a_restart() -> None:
    first, tables = build(state(range(9000, 9012)))
    # A restart with the saved tables: another order of arrival changes nothing.
    again, _ = build(
        state(range(9011, 8999, -1)),
        {name: IndexTable.from_json(json.loads(json.dumps(t.to_json())), source="test") for name, t in tables.items()},
    )
    assert again.same_content(first)
    assert all(first.endpoints_for(p).version == again.endpoints_for(p).version for p in range(20))  # type: ignore[union-attr]


def test_the_cache_answers_a_proxy_with_its_subset_and_later_only_what_changed_for_it() -> None:
    cache = SnapshotCache(subset_of=lambda node: {"edge-4": 4}.get(node))
    snapshot, tables = build(state(range(9000, 9012)))
    cache.set_snapshot(snapshot)
    answers: list[EncodedResponse] = []
    names = frozenset({"web", "db"})
    watch = Watch(ENDPOINT.url, Subscription(wildcard=False, names=names), None, frozenset(), False, proxy="edge-4")
    cache.create_watch(watch, lambda _, response: answers.append(response))
    (first,) = answers
    own = snapshot.endpoints_for(4)
    assert own is not None and first.version == own.version != snapshot.version(ENDPOINT.url)
    assert first.carried == 2

    # A backend outside proxy 4's subset goes: nothing for it. One inside: one assignment.
    held = addresses(snapshot, 4)
    outside = next(p for p in range(9000, 9012) if f"127.0.0.1:{p}" not in held)
    later, tables = build(state(p for p in range(9000, 9012) if p != outside), tables)  # type: ignore[arg-type]
    cache.create_watch(
        watch._replace(known_version=first.version, known_names=names), lambda _, response: answers.append(response)
    )
    cache.set_snapshot(later)
    assert addresses(later, 4) == held, "removing a backend changes only the subsets that held it"
    assert len(answers) == 1, "its subset did not change: nothing is sent"
    inside = int(sorted(addresses(later, 4))[0].rsplit(":", 1)[1])
    last, _ = build(state(p for p in range(9000, 9012) if p not in (outside, inside)), tables)  # type: ignore[arg-type]
    version = answers[-1].version
    cache.create_watch(
        watch._replace(known_version=version, known_names=names), lambda _, response: answers.append(response)
    )
    cache.set_snapshot(last)
    response = discovery_pb2.DiscoveryResponse.FromString(answers[-1].body)
    assert [r.type_url for r in response.resources] == [ENDPOINT.url], "only web's assignment, not db's"
    assert len(addresses(last, 4)) == 3 and f"127.0.0.1:{inside}" not in addresses(last, 4)


def test_a_zone_group_gets_its_zone_first() -> None:
    zones = {port: "a" if port < 9004 else "b" for port in range(9000, 9012)}
    snapshot, _ = build(state(range(9000, 9012), zones=zones), view=View(zone="a"))
    for proxy in range(8):
        assert addresses(snapshot, proxy) <= {f"127.0.0.1:{p}" for p in range(9000, 9004)}


def test_proxy_indices_lowest_free_grace_and_limit() -> None:
    now = [0.0]
    indices = ProxyIndices(grace=10, limit=3, clock=lambda: now[0])
    assert [indices.acquire(n) for n in ("a", "b", "c")] == [0, 1, 2]
    assert indices.acquire("d") is None, "the table is full: no index, so every endpoint"
    indices.acquire("b")  # a hot restart: two streams of one node
    indices.release("b")
    indices.release("b")
    now[0] = 5
    assert indices.acquire("b") == 1, "back within its grace period: the same index"
    indices.release("b")
    now[0] = 16
    indices.expire()
    assert indices.acquire("e") == 1, "b's grace ended: its index is the lowest free one"
    restarted = ProxyIndices(indices.table(), grace=10, clock=lambda: now[0])
    assert restarted.acquire("c") == 2 and restarted.acquire("f") == 3
    now[0] = 27
    restarted.expire()
    assert restarted.table().indices.keys() == {"c", "f"}, "loaded ids that never came back are freed"


def test_the_state_file_round_trips_and_a_corrupt_one_is_set_aside(tmp_path: Path) -> None:
    path = tmp_path / STATE_FILE
    assert load_subset_state(path).backends == {}
    tables = {"web": IndexTable().update(present=["127.0.0.1:1", "127.0.0.1:2"])}
    save_subset_state(path, SubsetState(tables, IndexTable().update(present=["edge-1"])))
    loaded = load_subset_state(path)
    assert loaded.backends == tables and loaded.proxies.index("edge-1") == 0
    document = json.loads(path.read_text())
    document["backends"]["web"]["indices"]["127.0.0.1:2"] = 0
    path.write_text(json.dumps(document))
    with pytest.raises(ConfigError, match="also held by"):
        load_subset_state(path)
    assert load_or_start_fresh(path).backends == {}
    assert not path.exists() and (tmp_path / (STATE_FILE + ".bad")).exists()
