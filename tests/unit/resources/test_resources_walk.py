"""The walk of a raw resource's JSON against its message (pilotfish.resources.walk): every mistake,
each at its path, where protobuf's parser stops at the first."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.listener.v3 import listener_pb2
from envoy.config.route.v3 import route_pb2
from google.protobuf import json_format
from google.protobuf.message import Message

from pilotfish.build.desired import DesiredState, build_snapshot, merge_states
from pilotfish.errors import ConfigError
from pilotfish.resources import TYPES
from pilotfish.resources.anytypes import message_dict
from pilotfish.resources.parse import parse_document
from pilotfish.resources.services import parse_services
from pilotfish.resources.walk import MAX_PROBLEMS, json_problems, path_text, without

HCM = "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"


def found(message: type[Message], value: dict[str, Any]) -> list[tuple[str, str]]:
    """The walk's problems, paths as text; the value must also fail protobuf's own parse."""
    problems = [(path_text(path), what) for path, what in json_problems(message, value)]
    if problems:
        with pytest.raises((json_format.ParseError, TypeError, ValueError)):
            json_format.ParseDict(value, message())
    return problems


def cluster(**fields: Any) -> dict[str, Any]:
    return {"name": "web", "type": "STATIC", "connect_timeout": "1s", **fields}


def endpoint(**socket_address: Any) -> dict[str, Any]:
    address = {"address": "127.0.0.1", "port_value": 8080} | socket_address
    return {
        "cluster_name": "web",
        "endpoints": [{"lb_endpoints": [{"endpoint": {"address": {"socket_address": address}}}]}],
    }


def test_a_valid_resource_has_no_problems() -> None:
    value = cluster(lb_policy="ROUND_ROBIN", load_assignment=endpoint(), metadata={"filter_metadata": {"a": {"b": 1}}})
    assert found(cluster_pb2.Cluster, value) == []
    json_format.ParseDict(value, cluster_pb2.Cluster())


def test_an_unknown_field_is_named_with_the_closest_ones() -> None:
    [(path, what)] = found(cluster_pb2.Cluster, {"name": "web", "conect_timeout": "1s"})
    assert path == "conect_timeout"
    assert what == "unknown field of envoy.config.cluster.v3.Cluster (did you mean 'connect_timeout'?)"
    [(_, far)] = found(cluster_pb2.Cluster, {"name": "web", "zzzz": 1})
    assert "did you mean" not in far


def test_an_enum_name_that_does_not_exist_lists_the_close_ones() -> None:
    [(path, what)] = found(cluster_pb2.Cluster, cluster(lb_policy="ROUND_ROBN"))
    assert (path, what) == (
        "lb_policy",
        "'ROUND_ROBN' is not a value of envoy.config.cluster.v3.Cluster.LbPolicy (did you mean 'ROUND_ROBIN'?)",
    )
    [(_, listed)] = found(cluster_pb2.Cluster, cluster(type="NOPE"))
    assert "one of STATIC, STRICT_DNS, LOGICAL_DNS, EDS, ORIGINAL_DST" in listed
    [(_, kind)] = found(cluster_pb2.Cluster, cluster(lb_policy=["ROUND_ROBIN"]))
    assert kind.startswith("expected a name of envoy.config.cluster.v3.Cluster.LbPolicy")
    # A number is taken as protobuf's parser takes it (an open enum: any number).
    assert found(cluster_pb2.Cluster, cluster(lb_policy=1)) == found(cluster_pb2.Cluster, cluster(lb_policy="1")) == []


@pytest.mark.parametrize(
    ("fields", "where", "message"),
    [
        ({"name": 7}, "name", "expected a string, got the number 7 (quote it)"),
        ({"respect_dns_ttl": "yes"}, "respect_dns_ttl", "expected true or false (unquoted), got the string 'yes'"),
        ({"per_connection_buffer_limit_bytes": "lots"}, "per_connection_buffer_limit_bytes.", "expected an integer"),
        ({"per_connection_buffer_limit_bytes": True}, "per_connection_buffer_limit_bytes.", "got the boolean true"),
        ({"dns_lookup_family": [1]}, "dns_lookup_family", "expected a name of"),
        ({"load_assignment": "web"}, "load_assignment", "expected a mapping (envoy.config.endpoint.v3"),
    ],
)
def test_a_value_of_the_wrong_json_type_says_what_was_expected(
    fields: dict[str, Any], where: str, message: str
) -> None:
    [(path, what)] = found(cluster_pb2.Cluster, cluster(**fields))
    assert path == where.rstrip(".") and message in what, (path, what)


def test_integers_out_of_their_fields_range_are_named_with_the_range() -> None:
    problems = found(
        cluster_pb2.Cluster,
        cluster(
            load_assignment=endpoint(port_value=-1),
            per_connection_buffer_limit_bytes=2**32,  # a UInt32Value
            common_lb_config={"healthy_panic_threshold": {"value": {"percent": 1}}},
        ),
    )
    assert problems == [
        (
            "load_assignment.endpoints[0].lb_endpoints[0].endpoint.address.socket_address.port_value",
            "-1 is out of range: port_value must be from 0 to 4294967295",
        ),
        ("per_connection_buffer_limit_bytes", "4294967296 is out of range: the value must be from 0 to 4294967295"),
        ("common_lb_config.healthy_panic_threshold.value", "expected a number, got a mapping"),
    ]
    # Integers may be strings, or floats with no fraction, as protobuf's parser takes them.
    assert found(cluster_pb2.Cluster, cluster(load_assignment=endpoint(port_value="8080"))) == []
    assert found(cluster_pb2.Cluster, cluster(load_assignment=endpoint(port_value=8080.0))) == []


def test_well_known_types_are_checked_as_their_json_forms() -> None:
    problems = found(
        cluster_pb2.Cluster,
        cluster(
            connect_timeout="5",  # a Duration is "5s"
            dns_refresh_rate=5,
            metadata={"filter_metadata": {"envoy.lb": ["not", "a", "struct"]}},
            per_connection_buffer_limit_bytes={"value": 5},  # a wrapper is its bare value
        ),
    )
    assert [path for path, _ in problems] == [
        "connect_timeout",
        "dns_refresh_rate",
        "metadata.filter_metadata['envoy.lb']",
        "per_connection_buffer_limit_bytes",
    ]
    assert problems[0][1].startswith("'5' is not a string of seconds such as \"5s\"")
    assert problems[1][1] == 'expected a string of seconds such as "5s" or "0.250s", got the number 5'
    assert problems[2][1] == "expected a mapping (a google.protobuf.Struct), got a list"
    assert problems[3][1] == "expected an integer, got a mapping (a UInt32Value is its bare value)"


def test_an_any_of_an_unknown_type_is_named_at_its_path_and_a_known_one_is_walked() -> None:
    def chain(typed_config: dict[str, Any]) -> dict[str, Any]:
        filters = [{"name": "hcm", "typed_config": typed_config}]
        return {"name": "l", "filter_chains": [{"filters": filters}]}

    [(path, what)] = found(listener_pb2.Listener, chain({"@type": "type.googleapis.com/envoy.Nope"}))
    assert path == "filter_chains[0].filters[0].typed_config"
    assert what.startswith("unknown @type 'type.googleapis.com/envoy.Nope': no such message")
    [(path, what)] = found(listener_pb2.Listener, chain({"stat_prefix": "x"}))
    assert path == "filter_chains[0].filters[0].typed_config" and "needs '@type'" in what
    walked = found(listener_pb2.Listener, chain({"@type": HCM, "stat_prefx": "x", "codec_type": "HTTP9"}))
    assert [path for path, _ in walked] == [
        "filter_chains[0].filters[0].typed_config.stat_prefx",
        "filter_chains[0].filters[0].typed_config.codec_type",
    ]
    assert "did you mean 'stat_prefix'?" in walked[0][1]


def test_repeated_fields_and_maps_must_have_their_shapes() -> None:
    problems = found(
        route_pb2.RouteConfiguration,
        {
            "name": "r",
            "virtual_hosts": {"name": "all"},
            "response_headers_to_remove": ["x-a", None, 3],
            "typed_per_filter_config": ["not a map"],
        },
    )
    assert problems == [
        ("virtual_hosts", "expected a list (repeated virtual_hosts), got a mapping"),
        ("response_headers_to_remove[1]", "null is not allowed in a list"),
        ("response_headers_to_remove[2]", "expected a string, got the number 3 (quote it)"),
        ("typed_per_filter_config", "expected a mapping (a map of typed_per_filter_config), got a list"),
    ]


def test_two_fields_of_one_oneof() -> None:
    value = endpoint()
    value["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["socket_address"]["named_port"] = "http"
    [(path, what)] = found(cluster_pb2.Cluster, cluster(load_assignment=value))
    assert path.endswith("socket_address.named_port")
    assert what == "'port_value' is set too; only one field of the oneof 'port_specifier' may be"
    assert found(cluster_pb2.Cluster, cluster(connectTimeout="2s")) == [], "JSON names are names too"
    # null is "not set": neither a problem nor a oneof's one field.
    assert found(cluster_pb2.Cluster, cluster(lb_policy=None)) == []


def test_the_problems_of_one_resource_are_bounded() -> None:
    value = {"name": "web", **{f"nope{i}": 1 for i in range(MAX_PROBLEMS + 5)}}
    problems = json_problems(cluster_pb2.Cluster, value)
    assert len(problems) == MAX_PROBLEMS + 1
    assert problems[-1] == ((), f"... and 5 more problem(s) (the first {MAX_PROBLEMS} are shown)")


def test_without_drops_each_wrong_part_and_keeps_the_rest() -> None:
    value = {"a": [1, 2, 3, 4], "b": {"c": 1, "d": 2}, "e": 5}
    assert without(value, [("a", 1), ("a", 3), ("b", "c"), ("e",)]) == {"a": [1, 3], "b": {"d": 2}}
    assert value == {"a": [1, 2, 3, 4], "b": {"c": 1, "d": 2}, "e": 5}, "a copy"
    assert without(value, [()]) is None


def test_a_document_reports_every_mistake_and_the_rules_broken_by_what_parses() -> None:
    def rules(message: Message) -> list[tuple[str, str, bool]]:
        assert isinstance(message, cluster_pb2.Cluster)  # what is left parses
        if message.name != "web":
            return []
        return [
            (
                ".load_assignment.endpoints[0].lb_endpoints[0].endpoint.address.socket_address.port_value",
                "too big",
                False,
            ),
            (".lb_policy", "is required", True),  # missing because it was dropped: not reported again
        ]

    document = {
        "clusters": [
            cluster(conect_timeout="1s", lb_policy="ROUND_ROBN", load_assignment=endpoint(port_value=99999)),
            cluster(name="api", type="STATICK"),
        ]
    }
    with pytest.raises(ConfigError) as caught:
        parse_document(document, "test.yaml", rules=rules)
    assert [str(p) for p in caught.value.problems] == [
        "clusters[0] (name 'web').conect_timeout: unknown field of envoy.config.cluster.v3.Cluster "
        "(did you mean 'connect_timeout'?)",
        "clusters[0] (name 'web').lb_policy: 'ROUND_ROBN' is not a value of envoy.config.cluster.v3.Cluster.LbPolicy "
        "(did you mean 'ROUND_ROBIN'?)",
        "clusters[0] (name 'web').load_assignment.endpoints[0].lb_endpoints[0].endpoint.address.socket_address"
        ".port_value: too big",
        "clusters[1] (name 'api').type: 'STATICK' is not a value of envoy.config.cluster.v3.Cluster.DiscoveryType "
        "(did you mean 'STATIC'?)",
    ]


def test_when_the_walk_finds_nothing_protobufs_own_message_is_shown() -> None:
    # An unpaired surrogate: a string to the walk, refused by protobuf's parser.
    with pytest.raises(ConfigError) as caught:
        parse_document({"clusters": [cluster(alt_stat_name="\ud800")]}, "test.yaml")
    [problem] = caught.value.problems
    assert problem.where == "clusters[0] (name 'web')" and "surrogate" in problem.message.lower()


def test_the_walk_finds_nothing_in_resources_protobuf_parses() -> None:
    """No false alarms: every raw resource of the demo file, and every resource pilotfish builds
    from services (as Envoy JSON), walks clean."""
    document = yaml.safe_load((Path(__file__).parents[3] / "examples" / "demo.yaml").read_text())
    walked = 0
    for rtype in TYPES:
        for value in document.get(rtype.key) or ():
            json_format.ParseDict(value, rtype.message())
            assert json_problems(rtype.message, value) == [], (rtype.key, value)
            walked += 1
    specs, endpoints, _ = parse_services(
        {"web": {"listen": "127.0.0.1:10000", "grpc": True, "health_check": True, "endpoints": ["127.0.0.1:9001"]}}
    )
    snapshot = build_snapshot(merge_states({"file": DesiredState(services=specs, endpoints=endpoints)}), "t")
    for ts in snapshot.types.values():
        for resource in ts.resources.values():
            value = message_dict(ts.rtype.message.FromString(resource.value))
            assert json_problems(ts.rtype.message, value) == [], (ts.rtype.key, value)
            walked += 1
    assert walked >= 8


def test_a_deeply_nested_value_beside_a_mistake_is_reported_not_a_crash() -> None:
    deep: Any = 1
    for _ in range(900):
        deep = {"k": deep}
    value = cluster(lb_policy="ROUND_ROBN", metadata={"filter_metadata": {"x": deep}})
    with pytest.raises(ConfigError) as caught:
        parse_document({"clusters": [value]}, "test.yaml", rules=lambda message: [])
    assert [p.where for p in caught.value.problems] == ["clusters[0] (name 'web').lb_policy"]
