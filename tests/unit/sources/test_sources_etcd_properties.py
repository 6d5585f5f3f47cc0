"""Property test of the etcd source: a view redoes only the services its changed keys name, and
its state says what its keys say."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from pilotfish.build.desired import DesiredState
from pilotfish.resources.services import Endpoint

etcd_keys = st.sampled_from(
    [
        "/pf/services/web",
        "/pf/services/api",
        "/pf/instances/web/a",
        "/pf/instances/web/b",
        "/pf/instances/api/a",
        "/pf/instances/db/a",
        "/pf/other",
    ]
)


etcd_values = st.sampled_from(
    [
        '{"address": "127.0.0.1", "port": 9001}',
        '{"address": "127.0.0.1", "port": 9002, "weight": 3}',
        '{"endpoints": ["127.0.0.1:9001", "127.0.0.1:9003"]}',
        '{"listen": "127.0.0.1:10000"}',
        "{oops",
    ]
)


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
            name: {e.address: e for e in found} for name, found in view.service_endpoints.items()
        }
        for name, endpoint in view.instances.values():
            expected.setdefault(name, {})[endpoint.address] = endpoint
        assert state == DesiredState(
            services=view.services, endpoints={name: tuple(found.values()) for name, found in expected.items()}
        )
        service = [*step[1].split("/"), ""][3]  # /pf/KIND/SERVICE[/ID]
        for name, found in state.endpoints.items():
            if name != service and name in last.endpoints:
                assert found is last.endpoints[name], f"{name}: unchanged, yet made again"
        last = state
