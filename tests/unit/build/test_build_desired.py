"""Node groups of kind rest: Envoys polling REST xDS are built clusters and listeners whose EDS and
RDS name the REST config source of their bootstrap (an ``ads: {}`` source needs an ADS stream they do
not have); everything else is what Envoys on ADS get, shared."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.core.v3 import base_pb2, config_source_pb2
from envoy.config.listener.v3 import listener_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import http_connection_manager_pb2 as hcm_pb2
from google.protobuf import json_format

from pilotfish.build.desired import DesiredState, View, build_snapshots, merge_states
from pilotfish.cache import DEFAULT_GROUP, SnapshotCache
from pilotfish.commands.cli import main
from pilotfish.policy.groups import GRPC_GROUP, MAX_GROUPS, REST_GROUP, NodeGroups, parse_node_group
from pilotfish.reconcile import Reconciler
from pilotfish.resources import CLUSTER, ENDPOINT, LISTENER, ROUTE
from pilotfish.resources.bootstrap import XDS_CLUSTER, BootstrapSettings, bootstrap
from pilotfish.resources.builders import ClientKind, ResourceMemo
from pilotfish.resources.services import parse_services
from pilotfish.snapshot import Snapshot

ENVOYS, GRPC, REST = View(), View(kind=ClientKind.GRPC), View(kind=ClientKind.REST)
SERVICES = {
    "web": {"listen": "127.0.0.1:10000", "grpc": True, "endpoints": ["127.0.0.1:9001", "127.0.0.1:9002"]},
    "db": {"listen": "127.0.0.1:10001", "protocol": "tcp", "endpoints": ["127.0.0.1:5432"]},
}


def _merged(section: dict[str, object] = SERVICES) -> DesiredState:
    specs, endpoints, problems = parse_services(section)
    assert problems == []
    return DesiredState(services=specs, endpoints=endpoints)


def _build(groups: dict[str, View], *, refresh: float = 1.0, memo: ResourceMemo | None = None) -> dict[str, Snapshot]:
    return build_snapshots(merge_states({"file": _merged()}), "test", groups, rest_refresh=refresh, memo=memo)


def _cluster(snapshot: Snapshot, name: str) -> cluster_pb2.Cluster:
    return cluster_pb2.Cluster.FromString(snapshot.types[CLUSTER.url].resources[name].value)


def _listener(snapshot: Snapshot, name: str) -> listener_pb2.Listener:
    return listener_pb2.Listener.FromString(snapshot.types[LISTENER.url].resources[name].value)


def _rds_source(listener: listener_pb2.Listener) -> config_source_pb2.ConfigSource:
    manager = hcm_pb2.HttpConnectionManager()
    if listener.HasField("api_listener"):
        listener.api_listener.api_listener.Unpack(manager)
    else:
        listener.filter_chains[0].filters[0].typed_config.Unpack(manager)
    return manager.rds.config_source


def _eds_source(cluster: cluster_pb2.Cluster) -> config_source_pb2.ConfigSource:
    return cluster.eds_cluster_config.eds_config


def _bootstrap_source(refresh: float) -> config_source_pb2.ConfigSource:
    """What ``pilotfish bootstrap --rest`` polls CDS and LDS with."""
    config = bootstrap(BootstrapSettings(node_id="n", rest="127.0.0.1:18001", refresh=refresh))
    cds, lds = (json_format.ParseDict(config["dynamic_resources"][key], config_source_pb2.ConfigSource())
                for key in ("cds_config", "lds_config"))
    assert cds == lds
    return cds


ADS = json_format.ParseDict({"ads": {}, "resource_api_version": "V3"}, config_source_pb2.ConfigSource())


def test_a_rest_group_polls_eds_and_rds_like_its_bootstrap_polls_cds_and_lds() -> None:
    snapshots = _build({"rest": REST}, refresh=0.25)
    rest = snapshots["rest"]
    expected = _bootstrap_source(0.25)
    assert list(expected.api_config_source.cluster_names) == [XDS_CLUSTER]
    assert _eds_source(_cluster(rest, "web")) == expected
    assert _eds_source(_cluster(rest, "db")) == expected
    assert _rds_source(_listener(rest, "web")) == expected
    # Socket listeners, as Envoys on ADS get: no API listener, and the TCP one as it is.
    assert sorted(rest.types[LISTENER.url].resources) == ["db", "web"]
    assert _listener(rest, "web").address.socket_address.port_value == 10000


def test_envoy_and_grpc_groups_still_follow_ads_beside_a_rest_group() -> None:
    snapshots = _build({"default": ENVOYS, "grpc": GRPC, "rest": REST})
    for group in ("default", "grpc"):
        assert _eds_source(_cluster(snapshots[group], "web")) == ADS, group
        assert _rds_source(_listener(snapshots[group], "web")) == ADS, group
    alone = _build({"default": ENVOYS})["default"]
    for rtype in (CLUSTER, ENDPOINT, LISTENER, ROUTE):
        assert snapshots["default"].types[rtype.url].version == alone.types[rtype.url].version, rtype


def test_endpoints_routes_and_tcp_listeners_are_shared_with_the_other_groups() -> None:
    snapshots = _build({"default": ENVOYS, "grpc": GRPC, "rest": REST})
    envoy, rest = snapshots["default"], snapshots["rest"]
    # One encoded object, so one response encoding serves every group.
    for rtype in (ENDPOINT, ROUTE):
        assert rest.types[rtype.url] is envoy.types[rtype.url], rtype
    assert rest.types[LISTENER.url].resources["db"] is envoy.types[LISTENER.url].resources["db"]
    # Clusters differ only in their EDS config source.
    ads_cluster, rest_cluster = _cluster(envoy, "web"), _cluster(rest, "web")
    rest_cluster.eds_cluster_config.eds_config.CopyFrom(ads_cluster.eds_cluster_config.eds_config)
    assert rest_cluster == ads_cluster


def test_the_refresh_delay_shapes_the_rest_clusters_and_an_unchanged_build_reuses_them() -> None:
    memo = ResourceMemo()
    first = _build({"rest": REST}, refresh=0.5, memo=memo)["rest"]
    again = _build({"rest": REST}, refresh=0.5, memo=memo)["rest"]
    assert again.types[CLUSTER.url].resources["web"] is first.types[CLUSTER.url].resources["web"]
    slower = _build({"rest": REST}, refresh=2.0, memo=memo)["rest"]
    assert _eds_source(_cluster(slower, "web")).api_config_source.refresh_delay.seconds == 2
    assert slower.types[CLUSTER.url].version != first.types[CLUSTER.url].version


def _node(**fields: str) -> base_pb2.Node:
    return base_pb2.Node(**fields)  # type: ignore[arg-type]


def test_rest_polls_join_rest_groups_and_grpc_streams_the_others() -> None:
    groups = NodeGroups([parse_node_group("edge:rest=cluster:rest-*"), parse_node_group("front=cluster:*-1")],
                        rest=True)
    views = groups.views()
    assert views[REST_GROUP] == REST and views["edge"] == REST and views["front"] == ENVOYS
    # A poll is matched against the rules of rest groups only, else joins the built-in one.
    assert groups.rest_group_of(_node(cluster="rest-1")) == "edge"
    assert groups.rest_group_of(_node(cluster="other")) == REST_GROUP
    assert groups.rest_group_of(_node(cluster="x", user_agent_name="gRPC C-core")) == REST_GROUP
    # A gRPC stream never joins a rest group, whatever its node says.
    assert groups.group_of(_node(cluster="rest-1")) == "front"
    assert groups.group_of(_node(user_agent_name="gRPC C-core", cluster="")) == GRPC_GROUP
    assert NodeGroups([], rest=True).group_of(_node(cluster="rest-1")) == DEFAULT_GROUP


def test_rest_groups_need_rest_served_and_the_built_in_rest_group_is_of_kind_rest() -> None:
    assert REST_GROUP not in NodeGroups([]).views()  # no --rest: no snapshot built for pollers
    with pytest.raises(ValueError, match=re.escape("give --rest HOST:PORT too")):
        NodeGroups([parse_node_group("edge:rest=cluster:rest-*")])
    with pytest.raises(ValueError, match="of kind rest"):
        NodeGroups([parse_node_group("rest=cluster:x")], rest=True)
    assert parse_node_group("e:rest@us-east-1=zone:us-east-*").view == View(kind=ClientKind.REST, zone="us-east-1")


def test_the_built_in_rest_group_counts_against_the_bound() -> None:
    rules = [parse_node_group(f"g{i}=id:n{i}") for i in range(MAX_GROUPS - 3)]
    NodeGroups(rules, rest=True)
    with pytest.raises(ValueError, match=f"more than the {MAX_GROUPS}"):
        NodeGroups([*rules, parse_node_group("one-more=id:x")], rest=True)


def test_serve_refuses_a_rest_group_without_rest(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "services.yaml"
    path.write_text("services:\n  web:\n    endpoints: ['127.0.0.1:9001']\n")
    assert main(["serve", "--snapshot", str(path), "--xds", "127.0.0.1:0",
                 "--node-group", "edge:rest=cluster:rest-*"]) != 0
    assert "give --rest HOST:PORT too" in capsys.readouterr().err


def test_the_reconciler_builds_the_rest_group_with_the_servers_refresh_delay_and_guards_it() -> None:
    cache = SnapshotCache()
    rec = Reconciler(cache, groups={DEFAULT_GROUP: ENVOYS, REST_GROUP: REST}, rest_refresh=0.5)
    rec.update("file", _merged())
    rec.build_now()
    rest, envoy = cache.snapshot(REST_GROUP), cache.snapshot(DEFAULT_GROUP)
    assert rest is not None and envoy is not None
    assert _eds_source(_cluster(rest, "web")) == _bootstrap_source(0.5)
    assert _eds_source(_cluster(envoy, "web")) == ADS
    # The blast-radius guard holds a change that would take the pollers' listeners away.
    rec.update("file", _merged({name: {**spec, "listen": None} for name, spec in SERVICES.items()}))
    assert rec.build_now() is None
    assert rec.held is not None and "it removes every listener (2)" in rec.held.reasons
    assert cache.snapshot(REST_GROUP) is rest
