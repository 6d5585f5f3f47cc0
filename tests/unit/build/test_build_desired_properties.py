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

from hypothesis import given, settings
from hypothesis import strategies as st

from pilotfish.build.desired import DesiredState, MergeMemo, View, build_snapshots, merge_states
from pilotfish.errors import ConfigError
from pilotfish.resources import ENDPOINT
from pilotfish.resources.builders import ClientKind, ResourceMemo
from pilotfish.resources.encoded import Resource
from pilotfish.resources.services import Endpoint, ServiceSpec
from pilotfish.resources.wire import cluster_load_assignment, lb_endpoint
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
        name=name, listen=("127.0.0.1", port) if port else None, protocol=protocol,
        grpc=name if grpc else None, zone_local=zone_local, timeout=timeout),
    st.sampled_from(NAMES), st.sampled_from([0, 10001, 10002]), st.sampled_from(["http", "tcp"]), st.booleans(),
    st.booleans(), st.sampled_from([5.0, 15.0]),
)
endpoint_tuples = st.lists(
    st.builds(Endpoint, st.just("127.0.0.1"), st.integers(9001, 9006), st.sampled_from([1, 2]),
              zone=st.sampled_from(["", "z1", "z2"])),
    max_size=4,
).map(tuple)
edits = st.one_of(
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
    return {**states, source: DesiredState(services=services, endpoints=endpoints)}


def _content(snapshots: Mapping[str, Snapshot]) -> dict[str, dict[str, tuple[str, dict[str, str]]]]:
    return {group: {url: (ts.version, {name: r.hash for name, r in ts.resources.items()})
                    for url, ts in snapshot.types.items()}
            for group, snapshot in snapshots.items()}


def _build(states: Mapping[str, DesiredState], memo: ResourceMemo | None, merge_memo: MergeMemo | None,
           ) -> object:
    merged = merge_states(states, memo=merge_memo)
    try:
        return merged, _content(build_snapshots(merged, "test", GROUPS, memo=memo))
    except ConfigError as exc:
        return merged, ("refused", exc.problems)


@settings(max_examples=150, deadline=None)
@given(st.lists(edits, min_size=1, max_size=12))
def test_a_build_from_the_last_one_equals_a_build_from_nothing(steps: list[tuple[object, ...]]) -> None:
    memo, merge_memo = ResourceMemo(), MergeMemo()
    states: dict[str, DesiredState] = {SOURCES[0]: DesiredState()}  # the others come with their first edit
    for edit in steps:
        states = _apply(states, edit)
        assert _build(states, memo, merge_memo) == _build(states, None, None), edit


def test_one_changed_endpoint_makes_one_resource_and_keeps_the_other_types() -> None:
    """What makes a change cheap: the other 199 services and the other types are reused as they are."""
    file = DesiredState(
        services={f"s{i}": ServiceSpec(name=f"s{i}", listen=("127.0.0.1", 20000 + i)) for i in range(200)},
        endpoints={f"s{i}": (Endpoint("127.0.0.1", 9000 + i),) for i in range(200)})
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
    eds = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"
    assert after[eds].resources["s8"] is before[eds].resources["s8"], "an unchanged assignment is the same object"
    assert merged.endpoints["s8"] is file.endpoints["s8"], "an unchanged service keeps its endpoint tuple"


# -- sources report only what changed as changed ---------------------------------------------------

etcd_keys = st.sampled_from(["/pf/services/web", "/pf/services/api", "/pf/instances/web/a", "/pf/instances/web/b",
                             "/pf/instances/api/a", "/pf/instances/db/a", "/pf/other"])
etcd_values = st.sampled_from([
    '{"address": "127.0.0.1", "port": 9001}', '{"address": "127.0.0.1", "port": 9002, "weight": 3}',
    '{"endpoints": ["127.0.0.1:9001", "127.0.0.1:9003"]}', '{"listen": "127.0.0.1:10000"}', "{oops",
])
etcd_edits = st.one_of(st.tuples(st.just("put"), etcd_keys, etcd_values), st.tuples(st.just("delete"), etcd_keys))


@settings(max_examples=150, deadline=None)
@given(st.lists(etcd_edits, min_size=1, max_size=15))
def test_the_etcd_view_redoes_changed_services_only_and_says_what_its_keys_say(steps: list[tuple[str, ...]]) -> None:
    from pilotfish.sources.etcd import EtcdView

    view = EtcdView("/pf/")
    last = view.state()
    for step in steps:
        if step[0] == "put":
            view.put(step[1], step[2])
        else:
            view.delete(step[1])
        if len(step) == 3 and step[2] == "{oops":
            view.state_with({step[1]: None})  # a hypothetical state in between changes nothing
        state = view.state()
        # What the keys say, worked out from the parsed keys alone: listed endpoints, then instances.
        expected: dict[str, dict[str, Endpoint]] = {
            name: {e.address: e for e in found} for name, found in view.service_endpoints.items()}
        for name, endpoint in view.instances.values():
            expected.setdefault(name, {})[endpoint.address] = endpoint
        assert state == DesiredState(services=view.services, endpoints={
            name: tuple(found.values()) for name, found in expected.items()})
        service = [*step[1].split("/"), ""][3]  # /pf/KIND/SERVICE[/ID]
        for name, found in state.endpoints.items():
            if name != service and name in last.endpoints:
                assert found is last.endpoints[name], f"{name}: unchanged, yet made again"
        last = state


# -- a state-of-the-world response carries what changed since what the stream has ----------------

def _eds(name: str, body: str) -> Resource:
    port = {"x": 1, "y": 2, "z": 3}[body]
    return Resource(ENDPOINT, name, cluster_load_assignment(name, [lb_endpoint("127.0.0.1", port, 1)]))


universe = st.sampled_from(["a", "b", "c", "d", "e"])


@settings(max_examples=200, deadline=None)
@given(before=st.dictionaries(universe, st.sampled_from(["x", "y"])),
       after=st.dictionaries(universe, st.sampled_from(["x", "y", "same object", "z"])),
       names=st.frozensets(st.sampled_from(["a", "b", "c", "d", "e", "f"])),
       held=st.frozensets(universe))
def test_changes_carry_the_subscribed_resources_that_differ_or_are_not_held(
        before: dict[str, str], after: dict[str, str], names: frozenset[str], held: frozenset[str]) -> None:
    old = {name: _eds(name, body) for name, body in before.items()}
    # "same object": the resource of ``before`` itself, as a build that left it alone hands it on.
    new = {name: old[name] if body == "same object" and name in old else _eds(name, body.replace("same object", "x"))
           for name, body in after.items()}
    since = Snapshot.build({ENDPOINT: list(old.values())}).types[ENDPOINT.url]
    now = Snapshot.build({ENDPOINT: list(new.values())}).types[ENDPOINT.url]
    response = now.changes(names, since=since, held=held)
    expected = sorted(name for name in names if name in new and (
        name not in held or name not in old or old[name].hash != new[name].hash))
    assert _sent_names(response.body) == expected
    assert response.carried == len(expected)
    assert response.names == frozenset(n for n in names if n in new)


def _sent_names(body: bytes) -> list[str]:
    from envoy.config.endpoint.v3 import endpoint_pb2
    from envoy.service.discovery.v3 import discovery_pb2

    response = discovery_pb2.DiscoveryResponse.FromString(body)
    out = []
    for packed in response.resources:
        assignment = endpoint_pb2.ClusterLoadAssignment()
        packed.Unpack(assignment)
        out.append(assignment.cluster_name)
    return out


@settings(max_examples=300, deadline=None)
@given(current=st.dictionaries(universe, st.sampled_from(["x", "y", "z"])),
       known=st.dictionaries(st.sampled_from(["a", "b", "c", "d", "e", "f"]),
                             st.sampled_from(["x", "y", "z", "absent", "other"])),
       names=st.frozensets(st.sampled_from(["a", "b", "c", "d", "e", "f"])),
       wildcard=st.booleans(), shared=st.booleans())
def test_a_delta_answer_sends_what_differs_and_removes_what_is_gone(
        current: dict[str, str], known: dict[str, str], names: frozenset[str], wildcard: bool,
        shared: bool) -> None:
    from pilotfish.snapshot import ABSENT

    snapshot = Snapshot.build({ENDPOINT: [_eds(name, body) for name, body in current.items()]}).types[ENDPOINT.url]
    versions = snapshot.versions()
    ids = {"x": _eds("_", "x").version}  # a version that is no resource's here
    had: Mapping[str, str] = versions if shared else {
        name: versions[name] if body == "x" and name in versions else ABSENT if body == "absent"
        else ids["x"] + body for name, body in known.items()}
    answer = snapshot.delta(had, wildcard=wildcard, names=names)
    # What behaviour 14 asks, worked out name by name.
    sent = sorted(name for name, version in versions.items()
                  if (wildcard or name in names) and had.get(name) != version)
    removed = sorted({name for name, version in had.items()
                      if wildcard and name not in versions and version != ABSENT and name not in names}
                     | {name for name in names if name not in versions and had.get(name) != ABSENT})
    if not sent and not removed:
        assert answer is None
        return
    assert answer is not None
    assert (list(answer.sent), list(answer.removed)) == (sent, removed)
    after = {**{name: versions[name] for name in versions if wildcard or name in names},
             **{name: ABSENT for name in names if name not in versions}}
    assert dict(answer.known) == after
