"""The services model: parsing, building Envoy resources, merging sources."""

from __future__ import annotations

import pytest
from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.listener.v3 import listener_pb2

from pilotfish.build.desired import DesiredState, build_snapshot, merge_states
from pilotfish.errors import ConfigError
from pilotfish.etcd.client import prefix_end
from pilotfish.resources import CLUSTER, ENDPOINT, LISTENER, ROUTE
from pilotfish.resources.services import Endpoint, ServiceSpec, parse_services
from pilotfish.sources.etcd import EtcdView


def test_services_section_parses_endpoints_and_settings() -> None:
    specs, endpoints, problems = parse_services({
        "playback": {"listen": "127.0.0.1:10000", "protocol": "http", "timeout": "2.5s", "retries": 3,
                     "endpoints": ["127.0.0.1:9002", {"address": "127.0.0.1", "port": 9001, "weight": 5}]},
        "db": {"listen": "127.0.0.1:15432", "protocol": "tcp", "endpoints": ["127.0.0.1:5432"]},
    })
    assert problems == []
    assert specs["playback"].listen == ("127.0.0.1", 10000) and specs["playback"].timeout == 2.5
    assert endpoints["playback"] == (Endpoint("127.0.0.1", 9001, 5), Endpoint("127.0.0.1", 9002))
    assert specs["db"].protocol == "tcp"


@pytest.mark.parametrize(
    ("service", "where", "words"),
    [
        ({"listen": "10000"}, "services.web.listen", "HOST:PORT"),
        ({"protocol": "udp"}, "services.web.protocol", "http, tcp"),
        ({"endpoints": ["127.0.0.1:0"]}, "services.web.endpoints[0] port", "1 to 65535"),
        ({"endpoints": [{"address": "127.0.0.1"}]}, "services.web.endpoints[0].port", "required"),
        ({"endpoints": ["127.0.0.1:1", "127.0.0.1:1"]}, "services.web.endpoints[1]", "listed twice"),
        ({"connect_timeout": "0s"}, "services.web.connect_timeout", "> 0"),
        ({"retires": 2}, "services.web", "retires"),
    ],
)
def test_bad_services_name_the_field(service: dict[str, object], where: str, words: str) -> None:
    _, _, problems = parse_services({"web": service})
    assert any(p.where == where and words in p.message for p in problems), problems


def built(*states: tuple[str, DesiredState]) -> dict[str, list[str]]:
    snapshot = build_snapshot(merge_states(dict(states)), "test")
    return {ts.rtype.key: sorted(ts.resources) for ts in snapshot.types.values() if ts.resources}


WEB = ServiceSpec(name="web", listen=("127.0.0.1", 10000))


def test_an_http_service_becomes_listener_route_cluster_and_endpoints() -> None:
    state = DesiredState(services={"web": WEB}, endpoints={"web": (Endpoint("127.0.0.1", 9001),)})
    snapshot = build_snapshot(merge_states({"file": state}), "test")
    names = {ts.rtype.key: sorted(ts.resources) for ts in snapshot.types.values() if ts.resources}
    assert names == {"clusters": ["web"], "endpoints": ["web"], "listeners": ["web"], "routes": ["web"]}
    cluster = snapshot.get(CLUSTER.url).resources["web"].message  # type: ignore[union-attr]
    assert isinstance(cluster, cluster_pb2.Cluster)
    assert cluster.type == cluster_pb2.Cluster.EDS and cluster.ignore_health_on_host_removal
    assignment = snapshot.get(ENDPOINT.url).resources["web"].message  # type: ignore[union-attr]
    assert assignment.endpoints[0].load_balancing_weight.value == 1  # type: ignore[attr-defined]
    route = snapshot.get(ROUTE.url).resources["web"].message  # type: ignore[union-attr]
    assert "connect-failure" in route.virtual_hosts[0].routes[0].route.retry_policy.retry_on  # type: ignore[attr-defined]


def test_a_tcp_service_has_no_route_configuration() -> None:
    tcp = ServiceSpec(name="db", listen=("127.0.0.1", 15432), protocol="tcp")
    assert built(("file", DesiredState(services={"db": tcp}))) == {
        "clusters": ["db"], "endpoints": ["db"], "listeners": ["db"]}


def test_endpoints_from_several_sources_are_merged() -> None:
    file = DesiredState(services={"web": WEB}, endpoints={"web": (Endpoint("127.0.0.1", 9001),)})
    registry = DesiredState(endpoints={"web": (Endpoint("127.0.0.1", 9002),), "api": (Endpoint("127.0.0.1", 7000),)})
    merged = merge_states({"file": file, "registry": registry})
    assert [e.port for e in merged.endpoints["web"]] == [9001, 9002]
    assert merged.services["api"] == ServiceSpec(name="api")  # instances alone: a cluster with defaults


def test_a_service_defined_twice_is_an_error_naming_both_sources() -> None:
    other = ServiceSpec(name="web", listen=("127.0.0.1", 10001))
    with pytest.raises(ConfigError, match="defined by both etcd and file"):
        built(("file", DesiredState(services={"web": WEB})), ("etcd", DesiredState(services={"web": other})))


def test_two_services_on_one_address_are_an_error() -> None:
    api = ServiceSpec(name="api", listen=("127.0.0.1", 10000))
    with pytest.raises(ConfigError, match=r"services.web.listen: 127.0.0.1:10000 is already used by services.api"):
        built(("file", DesiredState(services={"web": WEB, "api": api})))


def test_a_service_clashing_with_a_raw_resource_is_an_error() -> None:
    raw = listener_pb2.Listener(name="web")
    raw.address.socket_address.address = "127.0.0.1"
    raw.address.socket_address.port_value = 11000
    with pytest.raises(ConfigError, match=r"its listener 'web' clashes with listeners\[0\]"):
        built(("file", DesiredState(services={"web": WEB}, resources={LISTENER: (raw,)})))


def test_the_same_services_give_the_same_versions() -> None:
    a = DesiredState(services={"web": WEB}, endpoints={"web": (Endpoint("127.0.0.1", 2), Endpoint("127.0.0.1", 1))})
    b = DesiredState(services={"web": WEB}, endpoints={"web": (Endpoint("127.0.0.1", 1), Endpoint("127.0.0.1", 2))})
    assert a == b
    assert (build_snapshot(merge_states({"x": a}), "t").versions()
            == build_snapshot(merge_states({"y": b}), "t").versions())


def test_etcd_view_parses_keys_and_reports_bad_values() -> None:
    view = EtcdView("/pf/")
    assert view.put("/pf/services/web", '{"listen": "127.0.0.1:10000"}') is None
    assert view.put("/pf/instances/web/a", '{"address": "127.0.0.1", "port": 9001}') is None
    assert "not valid JSON" in (view.put("/pf/instances/web/b", "{oops") or "")
    assert "port: is required" in (view.put("/pf/instances/web/c", '{"address": "127.0.0.1"}') or "")
    assert "1 to 65535" in (view.put("/pf/instances/web/d", '{"address": "127.0.0.1", "port": 70000}') or "")
    assert "unknown key" in (view.put("/pf/other", "{}") or "")
    state = view.state()
    assert state.services["web"].listen == ("127.0.0.1", 10000)
    assert [e.port for e in state.endpoints["web"]] == [9001]
    view.put("/pf/instances/web/b", '{"address": "127.0.0.1", "port": 9002}')  # fixed
    view.delete("/pf/instances/web/a")
    assert [e.port for e in view.state().endpoints["web"]] == [9002]
    assert set(view.bad) == {"/pf/instances/web/c", "/pf/instances/web/d", "/pf/other"}


def test_prefix_end() -> None:
    assert prefix_end("/pilotfish/") == "/pilotfish0"


def test_hand_encoded_resources_match_protobuf_encoding() -> None:
    from pilotfish.resources.builders import build_assignment, build_cluster, encode_assignment, encode_cluster
    from pilotfish.resources.services import HealthCheck

    endpoints = (Endpoint("10.1.2.3", 65535, 128), Endpoint("127.0.0.1", 9001), Endpoint("::1", 80, 3),
                 Endpoint("h" * 119, 1, 1), Endpoint("h" * 120, 1, 1), Endpoint("host-" * 30, 8080, 70_000))
    assert encode_assignment("web" * 50, endpoints) == build_assignment("web" * 50, endpoints).SerializeToString(
        deterministic=True)
    with_metadata = (Endpoint("127.0.0.1", 1, 1, (("zone", "a"),)),)
    assert encode_assignment("w", with_metadata) == build_assignment("w", with_metadata).SerializeToString(
        deterministic=True)
    for spec in (WEB, ServiceSpec(name="h2", upstream_protocol="http2", health_check=HealthCheck(path="/ok"))):
        assert encode_cluster(spec) == build_cluster(spec).SerializeToString(deterministic=True)


@pytest.mark.parametrize(("seconds", "expected"),
                         [(0.9999999999, (1, 0)), (1.5, (1, 500_000_000)), (0.25, (0, 250_000_000))])
def test_durations_are_built_in_range(seconds: float, expected: tuple[int, int]) -> None:
    spec = ServiceSpec(name="web", connect_timeout=seconds)
    snapshot = build_snapshot(merge_states({"file": DesiredState(services={"web": spec})}), "test")
    cluster = snapshot.get(CLUSTER.url).resources["web"].message  # type: ignore[union-attr]
    assert isinstance(cluster, cluster_pb2.Cluster)
    assert (cluster.connect_timeout.seconds, cluster.connect_timeout.nanos) == expected
