"""Node groups (pilotfish.policy.groups): the rules that put a proxy in a group, what a rule may
say, the kinds (envoy, grpc, rest) and zones of groups, and the bound on their number."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from envoy.config.core.v3 import base_pb2
from google.protobuf import struct_pb2

from pilotfish.build.desired import View
from pilotfish.cache import DEFAULT_GROUP, NodeGroup
from pilotfish.commands.cli import main
from pilotfish.policy.groups import GRPC_GROUP, MAX_GROUPS, REST_GROUP, NodeGroups, parse_node_group
from pilotfish.resources.builders import ClientKind

ENVOYS, GRPC, REST = View(), View(kind=ClientKind.GRPC), View(kind=ClientKind.REST)
_TYPES = "type.googleapis.com/"


# -- group rules ----------------------------------------------------------------------------------


def _node(**fields: object) -> base_pb2.Node:
    metadata = fields.pop("metadata", {})
    node = base_pb2.Node(**fields)
    node.metadata.CopyFrom(struct_pb2.Struct())
    node.metadata.update(metadata)
    return node


def test_the_first_matching_rule_picks_the_group_then_the_built_in_ones() -> None:
    groups = NodeGroups(
        [
            parse_node_group("proxyless:grpc=cluster:payments-*"),
            parse_node_group("edge=id:edge-*"),
            parse_node_group("east=metadata:zone=us-east-*"),
            parse_node_group("zonal=zone:eu-*"),
            parse_node_group("canary=agent:envoy"),
        ]
    )
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
    assert views[NodeGroup("proxyless")] == views[GRPC_GROUP] == GRPC and views[NodeGroup("edge")] == ENVOYS


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


def test_the_number_of_groups_is_bounded() -> None:
    # Each group is one more snapshot per build: a limit, with the two built-in groups counted.
    NodeGroups([parse_node_group(f"g{i}=id:n{i}") for i in range(MAX_GROUPS - 2)])
    with pytest.raises(ValueError, match=f"more than the {MAX_GROUPS}"):
        NodeGroups([parse_node_group(f"g{i}=id:n{i}") for i in range(MAX_GROUPS - 1)])


def test_serve_refuses_a_bad_node_group_before_starting(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["serve", "--snapshot", "x.yaml", "--node-group", "p:udp=id:x"])
    assert "envoy, grpc or rest" in capsys.readouterr().err


# -- rest groups: polls join them, gRPC streams never do -----------------------------------------


def test_rest_polls_join_rest_groups_and_grpc_streams_the_others() -> None:
    groups = NodeGroups(
        [parse_node_group("edge:rest=cluster:rest-*"), parse_node_group("front=cluster:*-1")], rest=True
    )
    views = groups.views()
    assert views[REST_GROUP] == REST and views[NodeGroup("edge")] == REST and views[NodeGroup("front")] == ENVOYS
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
    assert (
        main(["serve", "--snapshot", str(path), "--xds", "127.0.0.1:0", "--node-group", "edge:rest=cluster:rest-*"])
        != 0
    )
    assert "give --rest HOST:PORT too" in capsys.readouterr().err
