"""Proxyless gRPC from the services model, node groups and the gRPC bootstrap."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from envoy.config.core.v3 import base_pb2
from envoy.config.endpoint.v3 import endpoint_pb2
from envoy.config.listener.v3 import listener_pb2
from envoy.extensions.filters.http.router.v3 import router_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import http_connection_manager_pb2 as hcm_pb2
from google.protobuf import struct_pb2
from hypothesis import given, settings
from hypothesis import strategies as st

from pilotfish.build.desired import DesiredState, View, build_snapshots, merge_states
from pilotfish.cache import DEFAULT_GROUP, SnapshotCache
from pilotfish.commands.cli import main
from pilotfish.errors import ConfigError
from pilotfish.policy.authorize import compile_pattern, glob_match
from pilotfish.policy.groups import GRPC_GROUP, MAX_GROUPS, NodeGroups, parse_node_group
from pilotfish.reconcile import Reconciler
from pilotfish.resources import CLUSTER, ENDPOINT, LISTENER, ROUTE
from pilotfish.resources.bootstrap import BootstrapSettings, grpc_bootstrap
from pilotfish.resources.builders import ClientKind, ResourceMemo
from pilotfish.resources.parse import parse_document
from pilotfish.resources.services import parse_services
from pilotfish.snapshot import Snapshot
from pilotfish.sources.etcd import EtcdView

ENVOYS, GRPC = View(), View(kind=ClientKind.GRPC)
_TYPES = "type.googleapis.com/"


def _state(section: dict[str, object], **resources: list[dict[str, object]]) -> DesiredState:
    specs, endpoints, problems = parse_services(section)
    assert problems == []
    raw = parse_document(dict(resources), "test").resources if resources else {}
    return DesiredState(services=specs, endpoints=endpoints, resources=raw)


def _names(snapshot: Snapshot) -> dict[str, list[str]]:
    return {ts.rtype.key: sorted(ts.resources) for ts in snapshot.types.values() if ts.resources}


WEB = {"listen": "127.0.0.1:10000", "grpc": True, "endpoints": ["127.0.0.1:9001", "127.0.0.1:9002"]}


# -- the service field ----------------------------------------------------------------------------


def test_grpc_true_names_the_target_after_the_service_and_a_string_names_it() -> None:
    specs, _, problems = parse_services({"web": {"grpc": True}, "api": {"grpc": "api.prod:8080"}, "db": {}})
    assert problems == []
    assert (specs["web"].grpc, specs["api"].grpc, specs["db"].grpc) == ("web", "api.prod:8080", None)


@pytest.mark.parametrize(
    ("service", "words"),
    [
        ({"grpc": 1}, "expected true, false or the name"),
        ({"grpc": "a b"}, "letters, digits"),
        ({"grpc": "x" * 254}, "at most 253"),
        ({"grpc": True, "protocol": "tcp"}, "need protocol http"),
    ],
)
def test_a_bad_grpc_field_is_named(service: dict[str, object], words: str) -> None:
    _, _, problems = parse_services({"web": service})
    assert [p.where for p in problems] == ["services.web.grpc"] and words in problems[0].message, problems


def test_etcd_defines_grpc_services_too() -> None:
    view = EtcdView("/pf/")
    assert view.put("/pf/services/echo", '{"grpc": true}') is None
    assert "grpc: expected true, false or the name" in (view.put("/pf/services/bad", '{"grpc": 7}') or "")
    assert view.state().services["echo"].grpc == "echo" and "bad" not in view.state().services


# -- what each kind of client is served -----------------------------------------------------------


def test_envoys_get_the_socket_listener_and_grpc_clients_an_api_listener_of_the_same_name() -> None:
    snapshots = build_snapshots(merge_states({"file": _state({"web": WEB})}), "test",
                                {"envoy": ENVOYS, "grpc": GRPC})
    envoy, grpc = snapshots["envoy"], snapshots["grpc"]
    assert _names(envoy) == _names(grpc) == {"clusters": ["web"], "endpoints": ["web"], "listeners": ["web"],
                                             "routes": ["web"]}
    socket = envoy.get(LISTENER.url).resources["web"].message  # type: ignore[union-attr]
    assert isinstance(socket, listener_pb2.Listener) and socket.address.socket_address.port_value == 10000
    api = grpc.get(LISTENER.url).resources["web"].message  # type: ignore[union-attr]
    assert isinstance(api, listener_pb2.Listener)
    # What gRPC needs (gRFC A27): no address, an api_listener with an HTTP connection manager that
    # gets its routes over RDS (ADS) and ends in the router filter.
    assert not api.HasField("address") and not api.filter_chains
    manager = hcm_pb2.HttpConnectionManager()
    assert api.api_listener.api_listener.Unpack(manager)
    assert manager.rds.route_config_name == "web" and manager.rds.config_source.HasField("ads")
    assert [f.name for f in manager.http_filters] == ["envoy.filters.http.router"]
    assert manager.http_filters[0].typed_config.Is(router_pb2.Router.DESCRIPTOR)
    # Clusters, endpoints and routes are the very same objects in both groups (built and hashed
    # once; a response encoded for one group serves the other).
    for rtype in (CLUSTER, ENDPOINT, ROUTE):
        assert envoy.get(rtype.url) is grpc.get(rtype.url)


def test_grpc_endpoints_carry_a_locality_with_a_non_zero_weight() -> None:
    # Without a locality weight a gRPC client's calls time out, and nothing is NACKed.
    snapshot = build_snapshots(merge_states({"file": _state({"web": WEB})}), "test", {"g": GRPC})["g"]
    assignment = snapshot.get(ENDPOINT.url).resources["web"].message  # type: ignore[union-attr]
    assert isinstance(assignment, endpoint_pb2.ClusterLoadAssignment)
    [locality] = assignment.endpoints
    assert locality.HasField("locality") and locality.load_balancing_weight.value > 0
    assert sorted(e.endpoint.address.socket_address.port_value for e in locality.lb_endpoints) == [9001, 9002]


def test_a_grpc_only_service_has_no_socket_listener_and_an_envoy_only_one_no_api_listener() -> None:
    state = _state({"rpc": {"grpc": True, "endpoints": ["127.0.0.1:9001"]},
                    "web": {"listen": "127.0.0.1:10000", "endpoints": ["127.0.0.1:9002"]}})
    snapshots = build_snapshots(merge_states({"file": state}), "test", {"envoy": ENVOYS, "grpc": GRPC})
    assert sorted(snapshots["envoy"].get(LISTENER.url).resources) == ["web"]  # type: ignore[union-attr]
    assert sorted(snapshots["grpc"].get(LISTENER.url).resources) == ["rpc"]  # type: ignore[union-attr]


def test_raw_listeners_go_to_the_kind_they_are_for() -> None:
    router = {"name": "router", "typed_config": {"@type": f"{_TYPES}{router_pb2.Router.DESCRIPTOR.full_name}"}}
    api = {"name": "raw-api", "api_listener": {"api_listener": {
        "@type": f"{_TYPES}{hcm_pb2.HttpConnectionManager.DESCRIPTOR.full_name}", "stat_prefix": "x",
        "rds": {"route_config_name": "web", "config_source": {"ads": {}}}, "http_filters": [router]}}}
    state = _state({"web": WEB}, listeners=[api])
    snapshots = build_snapshots(merge_states({"file": state}), "test", {"envoy": ENVOYS, "grpc": GRPC})
    assert sorted(snapshots["envoy"].get(LISTENER.url).resources) == ["web"]  # type: ignore[union-attr]
    assert sorted(snapshots["grpc"].get(LISTENER.url).resources) == ["raw-api", "web"]  # type: ignore[union-attr]


def test_two_services_resolved_by_one_grpc_name_are_an_error() -> None:
    state = _state({"a": {"grpc": "shared"}, "b": {"grpc": "shared"}})
    with pytest.raises(ConfigError) as caught:
        build_snapshots(merge_states({"file": state}), "test", {"g": GRPC})
    assert [(p.where, "services.a" in p.message) for p in caught.value.problems] == [("services.b.grpc", True)]


def test_building_two_groups_encodes_each_resource_once() -> None:
    memo = ResourceMemo()
    state = _state({"web": WEB})
    built = build_snapshots(merge_states({"file": state}), "test", {"envoy": ENVOYS, "grpc": GRPC}, memo=memo)
    assert memo.made == 5  # cluster, endpoints, route, two listeners: each made once for both groups
    for url in (CLUSTER.url, ENDPOINT.url, ROUTE.url):
        assert built["envoy"].types[url].resources["web"] is built["grpc"].types[url].resources["web"]
    build_snapshots(merge_states({"file": state}), "test", {"envoy": ENVOYS, "grpc": GRPC}, memo=memo)
    assert memo.made == 5  # the next pass reuses every one of them


# -- the reconciler serves every group ------------------------------------------------------------


def test_the_reconciler_publishes_each_group_and_leaves_an_unchanged_one_alone() -> None:
    cache = SnapshotCache()
    rec = Reconciler(cache, groups={DEFAULT_GROUP: ENVOYS, GRPC_GROUP: GRPC}, guard=None)
    rec.update("file", _state({"web": WEB, "rpc": {"grpc": True}}))
    rec.build_now()
    envoy, grpc = cache.snapshot(DEFAULT_GROUP), cache.snapshot(GRPC_GROUP)
    assert envoy is not None and grpc is not None
    assert sorted(grpc.get(LISTENER.url).resources) == ["rpc", "web"]  # type: ignore[union-attr]
    # Only an Envoy listener changes: the gRPC group's snapshot stays the very same object.
    rec.update("file", _state({"web": {**WEB, "listen": "127.0.0.1:10001"}, "rpc": {"grpc": True}}))
    rec.build_now()
    assert cache.snapshot(DEFAULT_GROUP) is not envoy and cache.snapshot(GRPC_GROUP) is grpc


def test_the_guard_holds_every_group_when_one_would_lose_all_its_listeners() -> None:
    cache = SnapshotCache()
    rec = Reconciler(cache, groups={DEFAULT_GROUP: ENVOYS, GRPC_GROUP: GRPC})
    rec.update("file", _state({"web": WEB, "rpc": {"grpc": True}}))
    rec.build_now()
    before = cache.snapshot(GRPC_GROUP), cache.snapshot(DEFAULT_GROUP)
    rec.update("file", _state({"web": {**WEB, "grpc": False}, "rpc": {}}))  # no API listener left
    assert rec.build_now() is None
    assert rec.held is not None and rec.held.reasons == ("node group grpc: it removes every listener (2)",)
    assert (cache.snapshot(GRPC_GROUP), cache.snapshot(DEFAULT_GROUP)) == before
    rec.confirm()
    assert not cache.snapshot(GRPC_GROUP).get(LISTENER.url).resources  # type: ignore[union-attr]


# -- zone-local routing ---------------------------------------------------------------------------

ZONED = {"zone_local": True, "grpc": True, "endpoints": [
    {"address": "127.0.0.1", "port": 9001, "zone": "east"},
    {"address": "127.0.0.1", "port": 9002, "zone": "east", "weight": 3},
    {"address": "127.0.0.1", "port": 9003, "zone": "west"}]}


def _ports(snapshot: Snapshot, name: str) -> dict[str, tuple[int, list[int]]]:
    """Per locality zone: its weight and its endpoints' ports."""
    assignment = snapshot.get(ENDPOINT.url).resources[name].message  # type: ignore[union-attr]
    assert isinstance(assignment, endpoint_pb2.ClusterLoadAssignment)
    return {group.locality.zone: (group.load_balancing_weight.value,
                                  [e.endpoint.address.socket_address.port_value for e in group.lb_endpoints])
            for group in assignment.endpoints}


def test_a_zone_group_gets_only_its_zones_endpoints_of_a_zone_local_service() -> None:
    state = _state({"web": ZONED, "plain": {**ZONED, "zone_local": False}})
    groups = {"all": GRPC, "east": View(kind=ClientKind.GRPC, zone="east"), "north": View(zone="north")}
    snapshots = build_snapshots(merge_states({"file": state}), "test", groups)
    # Without a zone: every endpoint, one locality per zone, weighted by its endpoints' weights.
    assert _ports(snapshots["all"], "web") == {"east": (4, [9001, 9002]), "west": (1, [9003])}
    assert _ports(snapshots["east"], "web") == {"east": (4, [9001, 9002])}
    # A service that does not ask for it, or a zone with none of its endpoints: every endpoint.
    assert _ports(snapshots["east"], "plain") == _ports(snapshots["north"], "web") == _ports(snapshots["all"], "web")
    every = snapshots["all"].get(ENDPOINT.url).resources  # type: ignore[union-attr]
    assert snapshots["east"].get(ENDPOINT.url).resources["plain"] is every["plain"]  # type: ignore[union-attr]
    # Without a zone-local service, a zone's endpoints are the very ones of every other view.
    plain = build_snapshots(merge_states({"file": _state({"plain": {**ZONED, "zone_local": False}})}), "test", groups)
    assert plain["east"].get(ENDPOINT.url) is plain["all"].get(ENDPOINT.url)
    # The gRPC views share their listeners; the Envoy view has none (no service has listen).
    assert snapshots["all"].get(LISTENER.url) is snapshots["east"].get(LISTENER.url)
    assert not snapshots["north"].get(LISTENER.url).resources  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("service", "where", "words"),
    [
        ({"zone_local": "yes"}, "services.web.zone_local", "true or false"),
        ({"endpoints": [{"address": "127.0.0.1", "port": 1, "zone": "a/b"}]}, "services.web.endpoints[0].zone",
         "zone name"),
        ({"endpoints": [{"address": "127.0.0.1", "port": 1, "zone": "z" * 129}]}, "services.web.endpoints[0].zone",
         "at most 128"),
    ],
)
def test_bad_zone_settings_are_named(service: dict[str, object], where: str, words: str) -> None:
    _, _, problems = parse_services({"web": service})
    assert [p.where for p in problems] == [where] and words in problems[0].message, problems


# -- group rules ----------------------------------------------------------------------------------


def _node(**fields: object) -> base_pb2.Node:
    metadata = fields.pop("metadata", {})
    node = base_pb2.Node(**fields)  # type: ignore[arg-type]
    node.metadata.CopyFrom(struct_pb2.Struct())
    node.metadata.update(metadata)  # type: ignore[arg-type]
    return node


def test_the_first_matching_rule_picks_the_group_then_the_built_in_ones() -> None:
    groups = NodeGroups([
        parse_node_group("proxyless:grpc=cluster:payments-*"),
        parse_node_group("edge=id:edge-*"),
        parse_node_group("east=metadata:zone=us-east-*"),
        parse_node_group("zonal=zone:eu-*"),
        parse_node_group("canary=agent:envoy"),
    ])
    assert groups.group_of(_node(cluster="payments-web", id="edge-1")) == "proxyless"
    assert groups.group_of(_node(cluster="other", id="edge-1")) == "edge"
    assert groups.group_of(_node(id="edge/1")) == DEFAULT_GROUP  # '*' does not cross '/'
    assert groups.group_of(_node(metadata={"zone": "us-east-1"})) == "east"
    assert groups.group_of(_node(metadata={"zone": 3})) == DEFAULT_GROUP  # not a string: no match
    assert groups.group_of(_node(locality=base_pb2.Locality(zone="eu-west"))) == "zonal"
    assert groups.group_of(_node(user_agent_name="envoy")) == "canary"
    assert groups.group_of(_node(user_agent_name="gRPC Python")) == GRPC_GROUP
    assert groups.group_of(_node(user_agent_name="curl")) == DEFAULT_GROUP
    views = groups.views()
    assert list(views) == [DEFAULT_GROUP, GRPC_GROUP, "proxyless", "edge", "east", "zonal", "canary"]
    assert views["proxyless"] == views[GRPC_GROUP] == GRPC and views["edge"] == ENVOYS


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("proxyless", "NAME[:KIND][@ZONE]=RULE"),
        ("p@=id:x", "a zone uses"),
        ("p@a b=id:x", "a zone uses"),
        ("a b=id:x", "group name"),
        ("p:udp=id:x", "envoy, grpc or rest"),
        ("p=node:x", "cluster:PATTERN"),
        ("p=metadata:zone", "metadata:KEY=PATTERN"),
        ("p=id:", "pattern is empty"),
    ],
)
def test_a_bad_rule_says_what_is_wrong(text: str, words: str) -> None:
    with pytest.raises(ValueError, match=re.escape(words)):
        parse_node_group(text)


def test_a_group_has_one_kind_and_zone() -> None:
    assert parse_node_group("e:grpc@us-east-1=zone:us-east-*").view == View(kind=ClientKind.GRPC, zone="us-east-1")
    with pytest.raises(ValueError, match="in zone 'a'"):
        NodeGroups([parse_node_group("p@a=id:a"), parse_node_group("p@b=id:b")])
    with pytest.raises(ValueError, match="of kind envoy"):
        NodeGroups([parse_node_group("p=id:a"), parse_node_group("p:grpc=id:b")])
    with pytest.raises(ValueError, match="of kind grpc"):
        NodeGroups([parse_node_group("grpc=id:a")])  # the built-in group is of kind grpc


@pytest.mark.timeout(30)
def test_a_long_node_value_against_a_pattern_of_many_stars_is_matched_at_once() -> None:
    # As a regular expression, '*a*a*a*a*a*b' against 100 'a's backtracks for seconds, and a peer
    # chooses its node id: 60,000 would not end within the timeout.
    groups = NodeGroups([parse_node_group("slow=id:*a*a*a*a*a*b")])
    assert groups.group_of(_node(id="a" * 60_000)) == DEFAULT_GROUP
    assert groups.group_of(_node(id="a" * 60_000 + "b")) == "slow"


@settings(max_examples=500, deadline=None)
@given(st.text("ab/*", max_size=8), st.text("ab/", max_size=10))
def test_glob_match_agrees_with_the_pattern_expression(pattern: str, value: str) -> None:
    assert glob_match(pattern, value) == (compile_pattern(pattern).fullmatch(value) is not None)


def test_the_number_of_groups_is_bounded() -> None:
    # Each group is one more snapshot per build: a limit, with the two built-in groups counted.
    NodeGroups([parse_node_group(f"g{i}=id:n{i}") for i in range(MAX_GROUPS - 2)])
    with pytest.raises(ValueError, match=f"more than the {MAX_GROUPS}"):
        NodeGroups([parse_node_group(f"g{i}=id:n{i}") for i in range(MAX_GROUPS - 1)])


def test_serve_refuses_a_bad_node_group_before_starting(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["serve", "--snapshot", "x.yaml", "--node-group", "p:udp=id:x"])
    assert "envoy, grpc or rest" in capsys.readouterr().err


# -- the gRPC bootstrap -----------------------------------------------------------------------------


def test_the_grpc_bootstrap_names_the_server_and_a_node_with_a_locality(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bootstrap", "--grpc", "--node-id", "client-1", "--xds", "127.0.0.1:18001", "--zone", "z1"]) == 0
    config = json.loads(capsys.readouterr().out)
    assert config == {
        "xds_servers": [{"server_uri": "127.0.0.1:18001", "channel_creds": [{"type": "insecure"}],
                         "server_features": ["xds_v3"]}],
        "node": {"id": "client-1", "cluster": "pilotfish", "locality": {"region": "", "zone": "z1"}},
    }


def test_the_grpc_bootstrap_over_tls_names_the_files() -> None:
    config = grpc_bootstrap(BootstrapSettings(node_id="c", tls_ca="ca.pem", tls_cert="c.pem", tls_key="c.key"))
    assert config["xds_servers"][0]["channel_creds"] == [{"type": "tls", "config": {
        "ca_certificate_file": "ca.pem", "certificate_file": "c.pem", "private_key_file": "c.key"}}]
    with pytest.raises(ValueError, match="server name"):
        grpc_bootstrap(BootstrapSettings(node_id="c", tls_ca="ca.pem", tls_server_name="x"))



def test_the_example_file_validates(capsys: pytest.CaptureFixture[str]) -> None:
    example = Path(__file__).resolve().parents[2] / "examples" / "proxyless-grpc.yaml"
    assert main(["validate", str(example)]) == 0, capsys.readouterr().err
