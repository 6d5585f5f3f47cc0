"""A build that starts from the last one (merge memo, resource memo) must equal a build from nothing.

The reconciler keeps what its last build made so that a change costs what changed: the merge
redoes only the services a changed source changed, the encoder only the services whose definition
or endpoints changed, and a type whose resources are the very ones of the last build keeps its
hash. These tests drive both through random sequences of source changes, as sources make them
(untouched services keep their objects; a file reload makes equal new ones), over every kind of
node group, and compare every result with a fresh build: the merged state, each group's versions,
and each resource's hash. A refused build must be refused with the same problems.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import cast

from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.endpoint.v3 import endpoint_pb2
from google.protobuf.message import Message
from hypothesis import example, given, settings
from hypothesis import strategies as st

from pilotfish.build.desired import DesiredState, MergeMemo, View, build_snapshots, merge_states
from pilotfish.errors import ConfigError
from pilotfish.resources import CLUSTER, ENDPOINT, ResourceType
from pilotfish.resources.builders import ClientKind, ResourceMemo
from pilotfish.resources.services import Endpoint, ServiceSpec
from pilotfish.snapshot import Snapshot

NAMES = ("a", "b", "c", "d")
SOURCES = ("file", "registry")
GROUPS = {
    "envoy": View(),
    "grpc": View(kind=ClientKind.GRPC),
    "rest": View(kind=ClientKind.REST),
    "zone-1": View(zone="z1"),
    "zone-2": View(kind=ClientKind.GRPC, zone="z2"),
}

specs = st.builds(
    lambda name, port, protocol, grpc, zone_local, timeout: ServiceSpec(
        name=name,
        listen=("127.0.0.1", port) if port else None,
        protocol=protocol,
        grpc=name if grpc else None,
        zone_local=zone_local,
        timeout=timeout,
    ),
    st.sampled_from(NAMES),
    st.sampled_from([0, 10001, 10002]),
    st.sampled_from(["http", "tcp"]),
    st.booleans(),
    st.booleans(),
    st.sampled_from([5.0, 15.0]),
)
endpoint_tuples = st.lists(
    st.builds(
        Endpoint,
        st.just("127.0.0.1"),
        st.integers(9001, 9006),
        st.sampled_from([1, 2]),
        zone=st.sampled_from(["", "z1", "z2"]),
    ),
    max_size=4,
).map(tuple)
RAW_NAMES = ("a", "r1", "r2", "r3")
"""Names of raw resources (one is a service's name too: a clash, refused as a fresh build refuses it)."""


def _raw(rtype: ResourceType, name: str, port: int) -> Message:
    """A raw EDS cluster, or an assignment of one endpoint at ``port``."""
    if rtype is CLUSTER:  # (r1 an EDS cluster, which needs r1's assignment; the others static)
        kind = cluster_pb2.Cluster.EDS if name == "r1" else cluster_pb2.Cluster.STATIC
        cluster = cluster_pb2.Cluster(name=name, type=kind)
        cluster.connect_timeout.seconds = port % 3 + 1 if port else -1  # (-1: a rule says it must be positive)
        if name == "r1":
            cluster.eds_cluster_config.eds_config.ads.SetInParent()
        return cast(Message, cluster)
    assignment = endpoint_pb2.ClusterLoadAssignment(cluster_name=name)
    address = assignment.endpoints.add().lb_endpoints.add().endpoint.address.socket_address
    address.address, address.port_value = "127.0.0.1", port
    return cast(Message, assignment)


raw_edits = st.one_of(
    # One raw resource replaced (or added at the end), as a followed file's edit hands it over:
    # every other message of the list is the very one it was.
    st.tuples(
        st.just("raw"),
        st.sampled_from(SOURCES),
        st.sampled_from([CLUSTER, ENDPOINT]),
        st.integers(0, 7),
        st.sampled_from(("", *RAW_NAMES)),  # ("": the name of the one it replaces, if any)
        st.sampled_from([9001, 9002, 9003, 0]),  # (0: a cluster's timeout no rule allows)
    ),
    st.tuples(st.just("raw delete"), st.sampled_from(SOURCES), st.sampled_from([CLUSTER, ENDPOINT]), st.integers(0, 7)),
    st.tuples(st.just("raw ttl"), st.sampled_from(SOURCES), st.sampled_from(RAW_NAMES), st.sampled_from([None, 5000])),
)
edits = st.one_of(
    raw_edits,
    st.tuples(st.just("define"), st.sampled_from(SOURCES), specs),
    st.tuples(st.just("undefine"), st.sampled_from(SOURCES), st.sampled_from(NAMES)),
    st.tuples(st.just("endpoints"), st.sampled_from(SOURCES), st.sampled_from(NAMES), endpoint_tuples),
    st.tuples(st.just("no endpoints"), st.sampled_from(SOURCES), st.sampled_from(NAMES)),
    st.tuples(st.just("reload"), st.sampled_from(SOURCES)),
    st.tuples(st.just("gone"), st.sampled_from(SOURCES)),
)


def _apply(states: dict[str, DesiredState], edit: tuple[object, ...]) -> dict[str, DesiredState]:
    """``edit`` made as a source makes it: a new state that keeps every untouched object."""
    what, source = edit[0], edit[1]
    assert isinstance(source, str)
    if what == "gone":  # the source is no longer merged (the next edit of it brings it back)
        return {name: state for name, state in states.items() if name != source}
    state = states.get(source, DesiredState())
    if str(what).startswith("raw"):
        return {**states, source: _raw_edit(state, edit)}
    services, endpoints = dict(state.services), dict(state.endpoints)
    if what == "define":
        spec = edit[2]
        assert isinstance(spec, ServiceSpec)
        services[spec.name] = spec
    elif what == "undefine":
        services.pop(str(edit[2]), None)
    elif what == "endpoints":
        endpoints[str(edit[2])] = edit[3]  # type: ignore[assignment]
    elif what == "no endpoints":
        endpoints.pop(str(edit[2]), None)
    else:  # a reload: equal content, every object new
        services = {name: replace(spec) for name, spec in services.items()}
        endpoints = {name: tuple(Endpoint(*e) for e in found) for name, found in endpoints.items()}
        resources = {rtype: tuple(_copy(m) for m in found) for rtype, found in state.resources.items()}
        return {**states, source: replace(state, services=services, endpoints=endpoints, resources=resources)}
    return {**states, source: replace(state, services=services, endpoints=endpoints)}


def _copy(message: Message) -> Message:
    copy = type(message)()
    copy.CopyFrom(message)
    return copy


def _raw_edit(state: DesiredState, edit: tuple[object, ...]) -> DesiredState:
    what = edit[0]
    if what == "raw ttl":
        name, ttl = str(edit[2]), edit[3]
        ttls = {rtype: dict(found) for rtype, found in state.ttls.items()}
        if ttl is None:
            ttls.get(CLUSTER, {}).pop(name, None)
        else:
            ttls.setdefault(CLUSTER, {})[name] = ttl  # type: ignore[assignment]
        return replace(state, ttls={rtype: found for rtype, found in ttls.items() if found})
    rtype = edit[2]
    assert isinstance(rtype, ResourceType)
    found = list(state.resources.get(rtype, ()))
    at = edit[3]
    assert isinstance(at, int)
    if what == "raw delete":
        if at < len(found):
            del found[at]
    elif at < len(found):
        name = str(edit[4]) or getattr(found[at], rtype.name_field)
        found[at] = _raw(rtype, name, int(edit[5]))  # type: ignore[call-overload]
    else:
        found.append(_raw(rtype, str(edit[4]) or f"r{len(found)}", int(edit[5])))  # type: ignore[call-overload]
    return replace(state, resources={**state.resources, rtype: tuple(found)})


def _content(snapshots: Mapping[str, Snapshot]) -> dict[str, dict[str, tuple[str, dict[str, str]]]]:
    return {
        group: {
            url: (ts.version, {name: r.hash for name, r in ts.resources.items()}) for url, ts in snapshot.types.items()
        }
        for group, snapshot in snapshots.items()
    }


def _build(
    states: Mapping[str, DesiredState],
    memo: ResourceMemo | None,
    merge_memo: MergeMemo | None,
) -> object:
    merged = merge_states(states, memo=merge_memo)
    try:
        return merged, _content(build_snapshots(merged, "test", GROUPS, memo=memo))
    except ConfigError as exc:
        return merged, ("refused", exc.problems)


@settings(max_examples=300, deadline=None)
@given(st.lists(edits, min_size=1, max_size=12))
def test_a_build_from_the_last_one_equals_a_build_from_nothing(steps: list[tuple[object, ...]]) -> None:
    memo, merge_memo = ResourceMemo(), MergeMemo()
    states: dict[str, DesiredState] = {SOURCES[0]: DesiredState()}  # the others come with their first edit
    for edit in steps:
        states = _apply(states, edit)
        assert _build(states, memo, merge_memo) == _build(states, None, None), edit


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.one_of(raw_edits, st.tuples(st.just("reload"), st.sampled_from(SOURCES))),
        min_size=1,
        max_size=16,
    )
)
# A build refused for one resource, then another one changed: the first is still wrong.
@example([("raw", "file", CLUSTER, 2, "", 0), ("raw", "file", CLUSTER, 3, "", 9002)])
# The assignment an EDS cluster needs renamed in place.
@example([("raw", "file", ENDPOINT, 5, "a", 9001)])
def test_a_build_of_raw_resources_alone_from_the_last_one_equals_a_build_from_nothing(
    steps: list[tuple[object, ...]],
) -> None:
    """Raw resources alone: a list that differs from the last build's in a few places is patched
    (its rule checks, names, hashes and type snapshot), which must give what a fresh build gives."""
    memo, merge_memo = ResourceMemo(), MergeMemo()
    names = [*(f"s{i}" for i in range(5)), "r1"]  # (static clusters but r1, whose assignment r1 is needed)
    first = DesiredState(resources={rtype: tuple(_raw(rtype, n, 9001) for n in names) for rtype in (CLUSTER, ENDPOINT)})
    states: dict[str, DesiredState] = {SOURCES[0]: first}
    assert _build(states, memo, merge_memo) == _build(states, None, None)
    for edit in steps:
        states = _apply(states, edit)
        assert _build(states, memo, merge_memo) == _build(states, None, None), edit


def test_one_changed_endpoint_makes_one_resource_and_keeps_the_other_types() -> None:
    """What makes a change cheap: the other 199 services and the other types are reused as they are."""
    file = DesiredState(
        services={f"s{i}": ServiceSpec(name=f"s{i}", listen=("127.0.0.1", 20000 + i)) for i in range(200)},
        endpoints={f"s{i}": (Endpoint("127.0.0.1", 9000 + i),) for i in range(200)},
    )
    memo, merge_memo = ResourceMemo(), MergeMemo()
    first = build_snapshots(merge_states({"file": file}, memo=merge_memo), "t", {"envoy": View()}, memo=memo)
    made = memo.made
    registry = DesiredState(endpoints={"s7": (Endpoint("127.0.0.1", 8000),)})
    merged = merge_states({"file": file, "registry": registry}, memo=merge_memo)
    second = build_snapshots(merged, "t", {"envoy": View()}, memo=memo)
    assert memo.made - made == 1, "only s7's assignment is made again"
    before, after = first["envoy"].types, second["envoy"].types
    changed = {url for url in before if before[url].version != after[url].version}
    assert changed == {"type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"}
    for url in before.keys() - changed:
        # The very type served before: the cache knows nothing waiting on it is due.
        assert after[url] is before[url], f"{url}: the same type snapshot, not rebuilt"
    eds = ENDPOINT.url
    assert after[eds].resources["s8"] is before[eds].resources["s8"], "an unchanged assignment is the same object"
    assert merged.endpoints["s8"] is file.endpoints["s8"], "an unchanged service keeps its endpoint tuple"
