"""Property tests of what a snapshot answers a stream: a state-of-the-world response carries the
subscribed resources that differ from, or are not among, what the stream holds; a delta answer
sends what differs and removes what is gone."""

from __future__ import annotations

from collections.abc import Mapping

from hypothesis import given, settings
from hypothesis import strategies as st

from pilotfish.resources import ENDPOINT
from pilotfish.resources.encoded import Resource
from pilotfish.resources.wire import cluster_load_assignment, lb_endpoint
from pilotfish.snapshot import Snapshot


def _eds(name: str, body: str) -> Resource:
    port = {"x": 1, "y": 2, "z": 3}[body]
    return Resource(ENDPOINT, name, cluster_load_assignment(name, [lb_endpoint("127.0.0.1", port, 1)]))


universe = st.sampled_from(["a", "b", "c", "d", "e"])


@settings(max_examples=200, deadline=None)
@given(
    before=st.dictionaries(universe, st.sampled_from(["x", "y"])),
    after=st.dictionaries(universe, st.sampled_from(["x", "y", "same object", "z"])),
    names=st.frozensets(st.sampled_from(["a", "b", "c", "d", "e", "f"])),
    held=st.frozensets(universe),
)
def test_changes_carry_the_subscribed_resources_that_differ_or_are_not_held(
    before: dict[str, str], after: dict[str, str], names: frozenset[str], held: frozenset[str]
) -> None:
    old = {name: _eds(name, body) for name, body in before.items()}
    # "same object": the resource of ``before`` itself, as a build that left it alone hands it on.
    new = {
        name: old[name] if body == "same object" and name in old else _eds(name, body.replace("same object", "x"))
        for name, body in after.items()
    }
    since = Snapshot.build({ENDPOINT: list(old.values())}).types[ENDPOINT.url]
    now = Snapshot.build({ENDPOINT: list(new.values())}).types[ENDPOINT.url]
    response = now.changes(names, since=since, held=held)
    expected = sorted(
        name
        for name in names
        if name in new and (name not in held or name not in old or old[name].hash != new[name].hash)
    )
    assert _sent_names(response.body) == expected
    assert response.carried == len(expected)
    assert response.names == frozenset(n for n in names if n in new)


@settings(max_examples=300, deadline=None)
@given(
    current=st.dictionaries(universe, st.sampled_from(["x", "y", "z"])),
    known=st.dictionaries(
        st.sampled_from(["a", "b", "c", "d", "e", "f"]), st.sampled_from(["x", "y", "z", "absent", "other"])
    ),
    names=st.frozensets(st.sampled_from(["a", "b", "c", "d", "e", "f"])),
    wildcard=st.booleans(),
    shared=st.booleans(),
)
def test_a_delta_answer_sends_what_differs_and_removes_what_is_gone(
    current: dict[str, str], known: dict[str, str], names: frozenset[str], wildcard: bool, shared: bool
) -> None:
    from pilotfish.snapshot import ABSENT

    snapshot = Snapshot.build({ENDPOINT: [_eds(name, body) for name, body in current.items()]}).types[ENDPOINT.url]
    versions = snapshot.versions()
    ids = {"x": _eds("_", "x").version}  # a version that is no resource's here
    had: Mapping[str, str] = (
        versions
        if shared
        else {
            name: versions[name]
            if body == "x" and name in versions
            else ABSENT
            if body == "absent"
            else ids["x"] + body
            for name, body in known.items()
        }
    )
    answer = snapshot.delta(had, wildcard=wildcard, names=names)
    # What behaviour 14 asks, worked out name by name.
    sent = sorted(
        name for name, version in versions.items() if (wildcard or name in names) and had.get(name) != version
    )
    removed = sorted(
        {
            name
            for name, version in had.items()
            if wildcard and name not in versions and version != ABSENT and name not in names
        }
        | {name for name in names if name not in versions and had.get(name) != ABSENT}
    )
    if not sent and not removed:
        assert answer is None
        return
    assert answer is not None
    assert (list(answer.sent), list(answer.removed)) == (sent, removed)
    after = {
        **{name: versions[name] for name in versions if wildcard or name in names},
        **{name: ABSENT for name in names if name not in versions},
    }
    assert dict(answer.known) == after


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
