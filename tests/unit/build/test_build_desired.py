"""Building snapshots for node groups from the desired state (pilotfish.build.desired): what each
kind of client is served, and resources shared between groups.

Envoys on ADS get socket listeners, proxyless gRPC clients an API listener of the same name,
zone groups only their zone's endpoints of a zone-local service. Node groups of kind rest: Envoys
polling REST xDS are built clusters and listeners whose EDS and RDS name the REST config source of
their bootstrap (an ``ads: {}`` source needs an ADS stream they do not have); everything else is
what Envoys on ADS get, shared."""

from __future__ import annotations

import pytest
from conftest import ADS_SOURCE, bootstrap_source, eds_source
from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.core.v3 import config_source_pb2
from envoy.config.endpoint.v3 import endpoint_pb2
from envoy.config.listener.v3 import listener_pb2
from envoy.config.route.v3 import route_pb2
from envoy.extensions.filters.http.router.v3 import router_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import http_connection_manager_pb2 as hcm_pb2

from pilotfish.build.desired import DesiredState, View, build_snapshot, build_snapshots, merge_states
from pilotfish.errors import ConfigError
from pilotfish.resources import CLUSTER, ENDPOINT, LISTENER, ROUTE
from pilotfish.resources.bootstrap import XDS_CLUSTER
from pilotfish.resources.builders import ClientKind, ResourceMemo
from pilotfish.resources.parse import parse_document
from pilotfish.resources.services import Endpoint, ServiceSpec, parse_services
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


def test_a_rest_group_polls_eds_and_rds_like_its_bootstrap_polls_cds_and_lds() -> None:
    snapshots = _build({"rest": REST}, refresh=0.25)
    rest = snapshots["rest"]
    expected = bootstrap_source(0.25)
    assert list(expected.api_config_source.cluster_names) == [XDS_CLUSTER]
    assert eds_source(_cluster(rest, "web")) == expected
    assert eds_source(_cluster(rest, "db")) == expected
    assert _rds_source(_listener(rest, "web")) == expected
    # Socket listeners, as Envoys on ADS get: no API listener, and the TCP one as it is.
    assert sorted(rest.types[LISTENER.url].resources) == ["db", "web"]
    assert _listener(rest, "web").address.socket_address.port_value == 10000


def test_envoy_and_grpc_groups_still_follow_ads_beside_a_rest_group() -> None:
    snapshots = _build({"default": ENVOYS, "grpc": GRPC, "rest": REST})
    for group in ("default", "grpc"):
        assert eds_source(_cluster(snapshots[group], "web")) == ADS_SOURCE, group
        assert _rds_source(_listener(snapshots[group], "web")) == ADS_SOURCE, group
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
    assert eds_source(_cluster(slower, "web")).api_config_source.refresh_delay.seconds == 2
    assert slower.types[CLUSTER.url].version != first.types[CLUSTER.url].version


_TYPES = "type.googleapis.com/"


def _state(section: dict[str, object], **resources: list[dict[str, object]]) -> DesiredState:
    specs, endpoints, problems = parse_services(section)
    assert problems == []
    raw = parse_document(dict(resources), "test").resources if resources else {}
    return DesiredState(services=specs, endpoints=endpoints, resources=raw)


def _names(snapshot: Snapshot) -> dict[str, list[str]]:
    return {ts.rtype.key: sorted(ts.resources) for ts in snapshot.types.values() if ts.resources}


WEB = {"listen": "127.0.0.1:10000", "grpc": True, "endpoints": ["127.0.0.1:9001", "127.0.0.1:9002"]}


def test_envoys_get_the_socket_listener_and_grpc_clients_an_api_listener_of_the_same_name() -> None:
    snapshots = build_snapshots(merge_states({"file": _state({"web": WEB})}), "test", {"envoy": ENVOYS, "grpc": GRPC})
    envoy, grpc = snapshots["envoy"], snapshots["grpc"]
    assert (
        _names(envoy)
        == _names(grpc)
        == {"clusters": ["web"], "endpoints": ["web"], "listeners": ["web"], "routes": ["web"]}
    )
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
    state = _state(
        {
            "rpc": {"grpc": True, "endpoints": ["127.0.0.1:9001"]},
            "web": {"listen": "127.0.0.1:10000", "endpoints": ["127.0.0.1:9002"]},
        }
    )
    snapshots = build_snapshots(merge_states({"file": state}), "test", {"envoy": ENVOYS, "grpc": GRPC})
    assert sorted(snapshots["envoy"].get(LISTENER.url).resources) == ["web"]  # type: ignore[union-attr]
    assert sorted(snapshots["grpc"].get(LISTENER.url).resources) == ["rpc"]  # type: ignore[union-attr]


def test_raw_listeners_go_to_the_kind_they_are_for() -> None:
    router = {"name": "router", "typed_config": {"@type": f"{_TYPES}{router_pb2.Router.DESCRIPTOR.full_name}"}}
    api: dict[str, object] = {
        "name": "raw-api",
        "api_listener": {
            "api_listener": {
                "@type": f"{_TYPES}{hcm_pb2.HttpConnectionManager.DESCRIPTOR.full_name}",
                "stat_prefix": "x",
                "rds": {"route_config_name": "web", "config_source": {"ads": {}}},
                "http_filters": [router],
            }
        },
    }
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


def test_with_grpc_load_reports_only_grpc_groups_clusters_ask_for_load_reports_to_this_server() -> None:
    # A proxyless gRPC client reports load only for a cluster with lrs_server, and only to
    # "self" (the server it has the cluster from): the rollout's health gate reads those reports.
    state = _state({"web": WEB, "names": {"listen": "127.0.0.1:10002", "endpoints": ["localhost:9003"]}})
    groups = {"envoy": ENVOYS, "grpc": GRPC, "grpc-east": View(kind=ClientKind.GRPC, zone="east"), "rest": REST}
    memo = ResourceMemo()
    built = build_snapshots(merge_states({"file": state}), "test", groups, memo=memo, grpc_load_reports=True)
    for group in ("grpc", "grpc-east"):
        cluster = _cluster(built[group], "web")
        assert cluster.lrs_server.WhichOneof("config_source_specifier") == "self", group
        assert cluster.lrs_server.resource_api_version == config_source_pb2.V3
        cluster.ClearField("lrs_server")
        assert cluster == _cluster(built["envoy"], "web")  # the same cluster otherwise
        # The STRICT_DNS cluster of a service with host names (no gRPC client can use one) as it is.
        assert not _cluster(built[group], "names").HasField("lrs_server")
    for group in ("envoy", "rest"):  # Envoys report from their bootstrap (bootstrap --lrs)
        assert not _cluster(built[group], "web").HasField("lrs_server"), group
    assert built["grpc"].get(CLUSTER.url) is built["grpc-east"].get(CLUSTER.url)  # one list for every gRPC view
    # Off (the default): every group on ADS gets the very same clusters, none with lrs_server; the
    # memo does not hand over the clusters made for load reports.
    plain = build_snapshots(merge_states({"file": state}), "test", groups, memo=memo)
    assert plain["grpc"].get(CLUSTER.url) is plain["envoy"].get(CLUSTER.url)
    assert not _cluster(plain["grpc"], "web").HasField("lrs_server")


ZONED = {
    "zone_local": True,
    "grpc": True,
    "endpoints": [
        {"address": "127.0.0.1", "port": 9001, "zone": "east"},
        {"address": "127.0.0.1", "port": 9002, "zone": "east", "weight": 3},
        {"address": "127.0.0.1", "port": 9003, "zone": "west"},
    ],
}


def _ports(snapshot: Snapshot, name: str) -> dict[str, tuple[int, list[int]]]:
    """Per locality zone: its weight and its endpoints' ports."""
    assignment = snapshot.get(ENDPOINT.url).resources[name].message  # type: ignore[union-attr]
    assert isinstance(assignment, endpoint_pb2.ClusterLoadAssignment)
    return {
        group.locality.zone: (
            group.load_balancing_weight.value,
            [e.endpoint.address.socket_address.port_value for e in group.lb_endpoints],
        )
        for group in assignment.endpoints
    }


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


WEB_SPEC = ServiceSpec(name="web", listen=("127.0.0.1", 10000))


def built(*states: tuple[str, DesiredState]) -> dict[str, list[str]]:
    snapshot = build_snapshot(merge_states(dict(states)), "test")
    return {ts.rtype.key: sorted(ts.resources) for ts in snapshot.types.values() if ts.resources}


def test_an_http_service_becomes_listener_route_cluster_and_endpoints() -> None:
    state = DesiredState(services={"web": WEB_SPEC}, endpoints={"web": (Endpoint("127.0.0.1", 9001),)})
    snapshot = build_snapshot(merge_states({"file": state}), "test")
    names = {ts.rtype.key: sorted(ts.resources) for ts in snapshot.types.values() if ts.resources}
    assert names == {"clusters": ["web"], "endpoints": ["web"], "listeners": ["web"], "routes": ["web"]}
    cluster = snapshot.get(CLUSTER.url).resources["web"].message  # type: ignore[union-attr]
    assert isinstance(cluster, cluster_pb2.Cluster)
    assert cluster.type == cluster_pb2.Cluster.EDS and cluster.ignore_health_on_host_removal
    assignment = snapshot.get(ENDPOINT.url).resources["web"].message  # type: ignore[union-attr]
    assert isinstance(assignment, endpoint_pb2.ClusterLoadAssignment)
    assert assignment.endpoints[0].load_balancing_weight.value == 1
    route = snapshot.get(ROUTE.url).resources["web"].message  # type: ignore[union-attr]
    assert isinstance(route, route_pb2.RouteConfiguration)
    assert "connect-failure" in route.virtual_hosts[0].routes[0].route.retry_policy.retry_on


def test_a_tcp_service_has_no_route_configuration() -> None:
    tcp = ServiceSpec(name="db", listen=("127.0.0.1", 15432), protocol="tcp")
    assert built(("file", DesiredState(services={"db": tcp}))) == {
        "clusters": ["db"],
        "endpoints": ["db"],
        "listeners": ["db"],
    }


def test_endpoints_from_several_sources_are_merged() -> None:
    file = DesiredState(services={"web": WEB_SPEC}, endpoints={"web": (Endpoint("127.0.0.1", 9001),)})
    registry = DesiredState(endpoints={"web": (Endpoint("127.0.0.1", 9002),), "api": (Endpoint("127.0.0.1", 7000),)})
    merged = merge_states({"file": file, "registry": registry})
    assert [e.port for e in merged.endpoints["web"]] == [9001, 9002]
    assert merged.services["api"] == ServiceSpec(name="api")  # instances alone: a cluster with defaults


def test_a_service_defined_twice_is_an_error_naming_both_sources() -> None:
    other = ServiceSpec(name="web", listen=("127.0.0.1", 10001))
    with pytest.raises(ConfigError, match="defined by both etcd and file"):
        built(("file", DesiredState(services={"web": WEB_SPEC})), ("etcd", DesiredState(services={"web": other})))


def test_two_services_on_one_address_are_an_error() -> None:
    api = ServiceSpec(name="api", listen=("127.0.0.1", 10000))
    with pytest.raises(ConfigError, match=r"services.web.listen: 127.0.0.1:10000 is already used by services.api"):
        built(("file", DesiredState(services={"web": WEB_SPEC, "api": api})))


def test_a_service_clashing_with_a_raw_resource_is_an_error() -> None:
    raw = listener_pb2.Listener(name="web")
    raw.address.socket_address.address = "127.0.0.1"
    raw.address.socket_address.port_value = 11000
    with pytest.raises(ConfigError, match=r"its listener 'web' clashes with listeners\[0\]"):
        built(("file", DesiredState(services={"web": WEB_SPEC}, resources={LISTENER: (raw,)})))


def test_the_same_services_give_the_same_versions() -> None:
    a = DesiredState(
        services={"web": WEB_SPEC}, endpoints={"web": (Endpoint("127.0.0.1", 2), Endpoint("127.0.0.1", 1))}
    )
    b = DesiredState(
        services={"web": WEB_SPEC}, endpoints={"web": (Endpoint("127.0.0.1", 1), Endpoint("127.0.0.1", 2))}
    )
    assert a == b
    assert (
        build_snapshot(merge_states({"x": a}), "t").versions() == build_snapshot(merge_states({"y": b}), "t").versions()
    )


def test_an_explicit_version_is_honoured_for_a_file_that_serves_nothing() -> None:
    document = parse_document({"version": "X", "clusters": []}, "test")
    snapshot = build_snapshot(merge_states({"file": DesiredState.of_document(document)}), "t")
    assert snapshot.label() == "X" and set(snapshot.versions().values()) == {"X"}
    # Beside an empty registry too; a registry with content makes versions content hashes.
    both = merge_states({"file": DesiredState.of_document(document), "registry": DesiredState()})
    assert build_snapshot(both, "t").label() == "X"
    filled = merge_states({"file": DesiredState.of_document(document), "registry": _merged()})
    assert build_snapshot(filled, "t").explicit_version is None


def test_a_raw_resource_handed_over_again_is_not_encoded_again() -> None:
    clusters = [
        cluster_pb2.Cluster(name=f"c{i}", type=cluster_pb2.Cluster.STATIC, connect_timeout={"seconds": 1})
        for i in range(10)
    ]
    memo = ResourceMemo()
    groups = {"envoy": ENVOYS}
    first = build_snapshots(
        merge_states({"file": DesiredState(resources={CLUSTER: tuple(clusters)})}), "t", groups, memo=memo
    )
    assert memo.made == 10
    changed = cluster_pb2.Cluster(name="c4", type=cluster_pb2.Cluster.STATIC, connect_timeout={"seconds": 2})
    again = tuple(changed if c.name == "c4" else c for c in clusters)  # the same messages but one
    second = build_snapshots(merge_states({"file": DesiredState(resources={CLUSTER: again})}), "t", groups, memo=memo)
    assert memo.made == 11
    before, after = (b["envoy"].types[CLUSTER.url].resources for b in (first, second))
    assert [n for n in after if after[n] is not before[n]] == ["c4"]
    assert after["c4"].message.connect_timeout.seconds == 2  # type: ignore[attr-defined]


def test_reference_and_rule_problems_follow_each_build_when_parts_are_reused() -> None:
    """Reused per build (a list that is the last build's, names that are the same): a later build
    that removes what a cluster needs, or breaks a rule, is refused all the same."""
    eds = {"eds_config": {"ads": {}, "resource_api_version": "V3"}}
    document = {
        "clusters": [
            {"name": f"c{i}", "type": "EDS", "connect_timeout": "1s", "eds_cluster_config": eds} for i in range(3)
        ],
        "endpoints": [{"cluster_name": f"c{i}"} for i in range(3)],
    }
    memo = ResourceMemo()
    groups = {"envoy": ENVOYS}
    good = DesiredState.of_document(parse_document(document, "t"))

    def build(state: DesiredState) -> None:
        build_snapshots(merge_states({"file": state}), "t", groups, memo=memo)

    build(good)
    without_c1 = DesiredState(
        resources={**good.resources, ENDPOINT: tuple(m for m in good.resources[ENDPOINT] if m.cluster_name != "c1")}  # type: ignore[attr-defined]
    )
    with pytest.raises(ConfigError) as caught:
        build(without_c1)  # the clusters' list is the last build's; the names are not
    assert [p.where for p in caught.value.problems] == ["clusters[1] (name 'c1')"]
    build(good)
    zero = cluster_pb2.Cluster()
    zero.CopyFrom(good.resources[CLUSTER][2])
    zero.connect_timeout.seconds = 0
    broken = DesiredState(resources={**good.resources, CLUSTER: (*good.resources[CLUSTER][:2], zero)})
    with pytest.raises(ConfigError, match="connect_timeout"):
        build(broken)
    build(good)


def test_the_raw_encodings_kept_across_builds_stay_within_twice_the_resources() -> None:
    memo = ResourceMemo()
    groups = {"envoy": ENVOYS}
    clusters = [
        cluster_pb2.Cluster(name=f"c{i}", type=cluster_pb2.Cluster.STATIC, connect_timeout={"seconds": 1})
        for i in range(20)
    ]
    for edit in range(200):  # each build hands over one new message: the old ones must not pile up
        clusters[edit % 20] = cluster_pb2.Cluster(
            name=f"c{edit % 20}", type=cluster_pb2.Cluster.STATIC, connect_timeout={"seconds": 1 + edit}
        )
        build_snapshots(
            merge_states({"file": DesiredState(resources={CLUSTER: tuple(clusters)})}), "t", groups, memo=memo
        )
        assert len(memo._raw[CLUSTER].encoded) <= 2 * 20 + 16
    assert memo.made == 20 + 199  # (the first build's 20, then the one new message of each later build)
