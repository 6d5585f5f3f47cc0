"""CSDS: node matchers select proxies, and each proxy's sync status reads as CSDS says it."""

from __future__ import annotations

import re

import pytest
from envoy.admin.v3 import config_dump_shared_pb2
from envoy.service.status.v3 import csds_pb2
from envoy.type.matcher.v3 import node_pb2, regex_pb2, string_pb2, struct_pb2

from pilotfish.protocol import ResourceState
from pilotfish.status import NodeInfo, SyncStatus
from pilotfish.xds.csds import ClientStatus, CsdsLimits, NodeSelector, client_config

CDS = "type.googleapis.com/envoy.config.cluster.v3.Cluster"
LDS = "type.googleapis.com/envoy.config.listener.v3.Listener"
RDS = "type.googleapis.com/envoy.config.route.v3.RouteConfiguration"
EDS = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"
Status = config_dump_shared_pb2.ClientResourceStatus
NODES = ["edge-1", "edge-2", "Edge-3", "mesh-a.sidecar", "mesh-b.sidecar"]


def by_id(**matcher: object) -> node_pb2.NodeMatcher:
    return node_pb2.NodeMatcher(node_id=string_pb2.StringMatcher(**matcher))


def selected(*matchers: node_pb2.NodeMatcher) -> list[str]:
    select = NodeSelector(list(matchers))
    return [node for node in NODES if select(node)]


def test_no_matcher_selects_every_proxy() -> None:
    assert selected() == NODES


@pytest.mark.parametrize(
    ("matcher", "expected"),
    [
        (by_id(exact="edge-2"), ["edge-2"]),
        (by_id(prefix="edge-"), ["edge-1", "edge-2"]),
        (by_id(prefix="edge-", ignore_case=True), ["edge-1", "edge-2", "Edge-3"]),
        (by_id(suffix=".sidecar"), ["mesh-a.sidecar", "mesh-b.sidecar"]),
        (by_id(contains="b.side"), ["mesh-b.sidecar"]),
        (by_id(safe_regex=regex_pb2.RegexMatcher(regex="mesh-[a-z]\\.sidecar")), ["mesh-a.sidecar", "mesh-b.sidecar"]),
        (by_id(safe_regex=regex_pb2.RegexMatcher(regex="edge")), []),  # a regex matches the whole id
        (
            by_id(safe_regex=regex_pb2.RegexMatcher(regex="(edge|mesh)-[0-9a-z]+(\\.sidecar)?")),
            ["edge-1", "edge-2", "mesh-a.sidecar", "mesh-b.sidecar"],
        ),
    ],
)
def test_a_node_id_matcher_selects_the_proxies_it_matches(matcher: node_pb2.NodeMatcher, expected: list[str]) -> None:
    assert selected(matcher) == expected


def test_any_of_several_matchers_selects() -> None:
    assert selected(by_id(exact="edge-1"), by_id(suffix="a.sidecar")) == ["edge-1", "mesh-a.sidecar"]


@pytest.mark.parametrize(
    ("matchers", "field"),
    [
        ([by_id()], "node_matchers[0].node_id sets no pattern"),
        (
            [by_id(safe_regex=regex_pb2.RegexMatcher(regex="("))],
            "node_matchers[0].node_id.safe_regex.regex does not compile",
        ),
        ([by_id(safe_regex=regex_pb2.RegexMatcher(regex="a" * 257))], "is 257 characters; at most 256"),
        ([by_id(exact="x")] * 17, "node_matchers holds 17 matchers; at most 16"),
        ([by_id(safe_regex=regex_pb2.RegexMatcher(regex="(a+)+$"))], "repeats a group that repeats or branches"),
        ([by_id(safe_regex=regex_pb2.RegexMatcher(regex="(edge|e)*"))], "repeats a group that repeats or branches"),
        ([by_id(safe_regex=regex_pb2.RegexMatcher(regex=".*-.*-x"))], "could backtrack too much"),
        ([by_id(safe_regex=regex_pb2.RegexMatcher(regex="a?" * 16))], "could backtrack too much"),
        ([by_id(safe_regex=regex_pb2.RegexMatcher(regex="(e)\\1"))], "holds a back-reference"),
        ([by_id(safe_regex=regex_pb2.RegexMatcher(regex="(?!mesh).*"))], "holds a look-around"),
        (
            [node_pb2.NodeMatcher(node_metadatas=[struct_pb2.StructMatcher()])],
            "node_matchers[0].node_metadatas: pilotfish does not keep node metadata",
        ),
    ],
)
def test_a_matcher_it_cannot_apply_is_refused_naming_the_field(
    matchers: list[node_pb2.NodeMatcher], field: str
) -> None:
    with pytest.raises(ValueError, match=re.escape(field)):
        NodeSelector(matchers)


def fleet() -> SyncStatus:
    status = SyncStatus(wall_clock=lambda: 1000.0)
    status.stream_opened("synced", NodeInfo(cluster="edge", user_agent="envoy", user_agent_version="1.40.0"))
    status.sent("synced", CDS, "v1")
    status.acked("synced", CDS, "v1")
    status.stream_opened("rejecting")
    status.sent("rejecting", LDS, "v1")
    status.acked("rejecting", LDS, "v1")
    status.sent("rejecting", LDS, "v2")
    status.nacked("rejecting", LDS, "v2", "listener 'web': bad port")
    status.sent("rejecting", RDS, "r1")  # neither ACKed nor NACKed yet
    return status


def configs(config: csds_pb2.ClientConfig) -> dict[str, csds_pb2.ClientConfig.GenericXdsConfig]:
    return {c.type_url: c for c in config.generic_xds_configs}


def test_an_acked_type_reads_acked_and_synced_at_its_version() -> None:
    proxy = fleet().get("synced")
    assert proxy is not None
    config = client_config(proxy)
    assert (config.node.id, config.node.cluster, config.node.user_agent_name) == ("synced", "edge", "envoy")
    cds = configs(config)[CDS]
    assert (cds.version_info, cds.client_status, cds.config_status) == ("v1", Status.ACKED, csds_pb2.SYNCED)
    assert cds.last_updated.ToSeconds() == 1000
    assert not cds.HasField("error_state")


def test_a_nacked_type_reads_nacked_with_the_rejected_version_and_the_message() -> None:
    proxy = fleet().get("rejecting")
    assert proxy is not None
    lds = configs(client_config(proxy))[LDS]
    assert (lds.version_info, lds.client_status, lds.config_status) == ("v1", Status.NACKED, csds_pb2.ERROR)
    assert lds.error_state.details == "listener 'web': bad port"
    assert lds.error_state.version_info == "v2"
    assert lds.error_state.last_update_attempt.ToSeconds() == 1000


def test_a_type_sent_and_not_answered_yet_is_stale_and_its_client_status_unknown() -> None:
    proxy = fleet().get("rejecting")
    assert proxy is not None
    rds = configs(client_config(proxy))[RDS]
    assert (rds.version_info, rds.client_status, rds.config_status) == ("", Status.UNKNOWN, csds_pb2.STALE)


def test_a_type_asked_for_and_never_sent_is_requested() -> None:
    status = SyncStatus()
    status.stream_opened("waiting")
    status.nacked("waiting", EDS, None, "")  # a type it answered before anything was sent
    proxy = status.get("waiting")
    assert proxy is not None
    eds = configs(client_config(proxy))[EDS]
    assert (eds.client_status, eds.config_status) == (Status.REQUESTED, csds_pb2.NOT_SENT)


def test_a_response_holds_the_matched_connected_proxies_up_to_its_bound() -> None:
    status = SyncStatus()
    for i in range(5):
        status.stream_opened(f"p{i}")
    status.stream_opened("gone")
    status.stream_closed("gone")  # remembered for a while, but not connected: not shown
    service = ClientStatus(status, limits=CsdsLimits(max_proxies=3))
    every = service.answer(csds_pb2.ClientStatusRequest())
    assert [c.node.id for c in every.config] == ["p0", "p1", "p2"]
    some = service.answer(csds_pb2.ClientStatusRequest(node_matchers=[by_id(prefix="p4")]))
    assert [c.node.id for c in some.config] == ["p4"]
    assert not service.answer(csds_pb2.ClientStatusRequest(node_matchers=[by_id(exact="gone")])).config


def test_a_connected_proxys_resources_are_listed_one_by_one_within_the_responses_bound() -> None:
    resources = {
        "synced": {
            CDS: [ResourceState("api", "v1", "ACKED"), ResourceState("web", "v1", "ACKED")],
            EDS: [ResourceState("web", "e1", "ACKED"), ResourceState("gone", "", "DOES_NOT_EXIST")],
        },
        "rejecting": {LDS: [ResourceState("http", "v1", "NACKED")], RDS: [ResourceState("r", "", "REQUESTED")]},
    }
    service = ClientStatus(fleet(), resources=resources.get)
    by_node = {c.node.id: c for c in service.answer(csds_pb2.ClientStatusRequest()).config}
    synced = [(c.type_url, c.name, c.version_info, c.client_status) for c in by_node["synced"].generic_xds_configs]
    assert synced == [
        (CDS, "api", "v1", Status.ACKED),
        (CDS, "web", "v1", Status.ACKED),
        (EDS, "web", "e1", Status.ACKED),
        (EDS, "gone", "", Status.DOES_NOT_EXIST),
    ]
    (lds, rds) = by_node["rejecting"].generic_xds_configs
    assert (lds.name, lds.client_status, lds.config_status) == ("http", Status.NACKED, csds_pb2.ERROR)
    assert lds.error_state.details == "listener 'web': bad port" and lds.error_state.version_info == "v2"
    assert (rds.name, rds.client_status) == ("r", Status.REQUESTED)
    # Past the bound, a proxy is listed a type at a time (by node id: the first, 2 resources, fits in 5).
    bounded = ClientStatus(fleet(), resources=resources.get, limits=CsdsLimits(max_resources=5))
    by_node = {c.node.id: c for c in bounded.answer(csds_pb2.ClientStatusRequest()).config}
    assert [c.name for c in by_node["rejecting"].generic_xds_configs] == ["http", "r"]
    assert [(c.type_url, c.name) for c in by_node["synced"].generic_xds_configs] == [(CDS, "")]
