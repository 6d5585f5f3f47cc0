"""Routes of the services model (pilotfish.resources.routes): what ``routes:`` parses into, each
mistake named with its path, and the Envoy route table built from it; and endpoints written as host
names, which make a STRICT_DNS cluster (pilotfish.resources.builders, pilotfish.build.desired)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.route.v3 import route_pb2
from google.protobuf import json_format

from lab_routes import lab_route_config
from pilotfish.build.desired import DesiredState, View, build_snapshot, build_snapshots, merge_states, subset_tables
from pilotfish.errors import ConfigError
from pilotfish.resources import CLUSTER, ENDPOINT, ROUTE
from pilotfish.resources.builders import ClientKind, ResourceMemo
from pilotfish.resources.routes import DirectResponse, HeaderMatch, Redirect, Route, regex_problem, route_document
from pilotfish.resources.services import Endpoint, parse_services
from pilotfish.snapshot import Snapshot

LAB: dict[str, Any] = {
    "edge": {
        "listen": "127.0.0.1:10000",
        "routes": [
            {"path": "/marker", "direct_response": {"status": 200, "body": "marker\n"}},
            {"prefix": "/slow", "to": "slow", "timeout": "30s"},
            {"to": "pool"},
        ],
    },
    "slow": {"endpoints": ["127.0.0.1:9003"]},
    "pool": {"endpoints": ["127.0.0.1:9001", "127.0.0.1:9002"]},
}


def _problems(routes: Any, **entry: Any) -> list[tuple[str, str]]:
    _, _, problems = parse_services({"edge": {"listen": "127.0.0.1:10000", "routes": routes, **entry}})
    return [(p.where, p.message) for p in problems]


def _snapshot(services: dict[str, Any], *, memo: ResourceMemo | None = None, **options: Any) -> Snapshot:
    specs, endpoints, problems = parse_services(services)
    assert problems == []
    state = DesiredState(services=specs, endpoints=endpoints)
    return build_snapshot(merge_states({"file": state}), "test", memo=memo, **options)


def _build_problems(services: dict[str, Any]) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        _snapshot(services)
    return [str(p) for p in caught.value.problems]


def _route_config(snapshot: Snapshot, name: str) -> route_pb2.RouteConfiguration:
    return route_pb2.RouteConfiguration.FromString(snapshot.types[ROUTE.url].resources[name].value)


def _cluster(snapshot: Snapshot, name: str) -> cluster_pb2.Cluster:
    return cluster_pb2.Cluster.FromString(snapshot.types[CLUSTER.url].resources[name].value)


# -- parsing ---------------------------------------------------------------------------------------


def test_the_lab_table_parses_into_its_routes() -> None:
    specs, _, problems = parse_services(LAB)
    assert problems == []
    assert specs["edge"].routes == (
        Route(match_kind="path", match="/marker", direct_response=DirectResponse(200, "marker\n")),
        Route(match_kind="prefix", match="/slow", to=(("slow", 1),), timeout=30.0),
        Route(to=(("pool", 1),)),
    )


def test_the_example_is_the_lab_and_builds() -> None:
    example = Path(__file__).resolve().parents[3] / "examples" / "routes.yaml"
    services = yaml.safe_load(example.read_text())["services"]
    lab_routes = [dict(r) for r in LAB["edge"]["routes"]]
    lab_routes[1]["timeout"] = "1s"
    assert services["edge"]["routes"] == lab_routes
    assert set(_snapshot(services).types[CLUSTER.url].resources) == {"edge", "slow", "pool"}


def test_every_matcher_and_action_parses() -> None:
    specs, _, problems = parse_services(
        {
            "edge": {
                "listen": "127.0.0.1:10000",
                "routes": [
                    {
                        "regex": "^/v[0-9]+/.*",
                        "host": ["API.example.com", "*.example.org"],
                        "headers": {"X-Canary": "1", "x-debug": True, "x-old": False, "cookie": {"regex": ".*b=1.*"}},
                        "to": {"pool": 90, "canary": 10},
                        "retries": 0,
                    },
                    {"prefix": "/old/", "redirect": {"scheme": "https", "prefix": "/new/", "code": 308}},
                    {"prefix": "/api/", "to": "pool", "prefix_rewrite": "/"},
                    {"path": "/healthz", "direct_response": 204},
                ],
            }
        }
    )
    assert problems == []
    first, redirect, rewrite, health = specs["edge"].routes
    assert first.hosts == ("api.example.com", "*.example.org")
    assert first.headers == (
        HeaderMatch("cookie", "regex", ".*b=1.*"),
        HeaderMatch("x-canary", "exact", "1"),
        HeaderMatch("x-debug", "present"),
        HeaderMatch("x-old", "absent"),
    )
    assert first.to == (("canary", 10), ("pool", 90)) and first.split and first.retries == 0
    assert redirect.redirect == Redirect(scheme="https", prefix="/new/", code=308)
    assert rewrite.prefix_rewrite == "/" and health.direct_response == DirectResponse(204)
    # The registry shows (and etcd round-trips) a definition in the shape it was written in.
    again, _, problems = parse_services(
        {"edge": {"listen": "127.0.0.1:10000", "routes": [route_document(r) for r in specs["edge"].routes]}}
    )
    assert problems == [] and again["edge"].routes == specs["edge"].routes


@pytest.mark.parametrize(
    ("routes", "where", "words"),
    [
        # a route to a bad target, bad weights
        ([{"to": "no such"}], "services.edge.routes[0].to", "a service name"),
        ([{"to": {"pool": -1, "canary": 1}}], "services.edge.routes[0].to.pool", "from 0 to 10000"),
        ([{"to": {"pool": 1.5}}], "services.edge.routes[0].to.pool", "whole number"),
        ([{"to": {"pool": True}}], "services.edge.routes[0].to.pool", "whole number"),
        ([{"to": {"pool": 0, "canary": 0}}], "services.edge.routes[0].to", "add up to 0"),
        ([{"to": {}}], "services.edge.routes[0].to", "mapping of service name to weight"),
        # conflicting matchers
        (
            [{"prefix": "/a", "path": "/a", "to": "pool"}],
            "services.edge.routes[0]",
            "conflicting matchers prefix and path",
        ),
        (
            [{"to": "pool"}, {"prefix": "/a", "to": "pool"}],
            "services.edge.routes[1]",
            "routes[0] before it matches every",
        ),
        ([{"prefix": "/a", "to": "x"}, {"path": "/a/b", "to": "y"}], "services.edge.routes[1]", "prefix '/a' matches"),
        ([{"path": "/a", "to": "x"}, {"path": "/a", "to": "y"}], "services.edge.routes[1]", "never used"),
        (
            [{"host": "a.com", "headers": {":authority": "a.com"}, "to": "x"}],
            "services.edge.routes[0].headers",
            "host and headers[':authority']",
        ),
        # bad regexes
        ([{"regex": "([a-z]", "to": "x"}], "services.edge.routes[0].regex", "not a valid regex"),
        ([{"regex": "/(?=api)", "to": "x"}], "services.edge.routes[0].regex", "no lookahead"),
        ([{"regex": r"/(a)\1", "to": "x"}], "services.edge.routes[0].regex", "no backreferences"),
        ([{"regex": "/a*+", "to": "x"}], "services.edge.routes[0].regex", "possessive"),
        (
            [{"headers": {"x-a": {"regex": "(?<!a)b"}}, "to": "x"}],
            "services.edge.routes[0].headers['x-a'].regex",
            "lookbehind",
        ),
        # actions and options
        ([{"prefix": "/a"}], "services.edge.routes[0]", "exactly one action"),
        ([{"to": "x", "direct_response": 200}], "services.edge.routes[0]", "got to and direct_response"),
        ([{"direct_response": 200, "timeout": "1s"}], "services.edge.routes[0]", "apply only to a route with to"),
        ([{"direct_response": {"status": 99}}], "services.edge.routes[0].direct_response.status", "200 to 599"),
        (
            [{"direct_response": {"status": 200, "body": "x" * 5000}}],
            "services.edge.routes[0].direct_response.body",
            "4096",
        ),
        ([{"redirect": {"code": 301}}], "services.edge.routes[0].redirect", "redirects nowhere"),
        (
            [{"redirect": {"path": "/a", "prefix": "/b"}}],
            "services.edge.routes[0].redirect",
            "conflicting path and prefix",
        ),
        ([{"redirect": {"host": "a.com", "code": 200}}], "services.edge.routes[0].redirect.code", "301, 302"),
        ([{"regex": "/a.*", "to": "x", "prefix_rewrite": "/"}], "services.edge.routes[0].prefix_rewrite", "not regex"),
        ([{"to": "x", "timeout": "soon"}], "services.edge.routes[0].timeout", "duration"),
        # matchers' values
        ([{"prefix": "a", "to": "x"}], "services.edge.routes[0].prefix", "starts with '/'"),
        ([{"host": "bad_host", "to": "x"}], "services.edge.routes[0].host", "host name"),
        ([{"headers": {"bad header": "1"}, "to": "x"}], "services.edge.routes[0].headers['bad header']", "header name"),
        ([{"headers": {"x-a": [1]}, "to": "x"}], "services.edge.routes[0].headers['x-a']", "true (present)"),
        ([{"prefx": "/a", "to": "x"}], "services.edge.routes[0]", "unknown field(s) prefx"),
        ([], "services.edge.routes", "non-empty list"),
    ],
)
def test_each_mistake_is_named_with_its_path(routes: Any, where: str, words: str) -> None:
    problems = _problems(routes)
    assert any(at == where and words in message for at, message in problems), problems


def test_every_mistake_is_reported_at_once() -> None:
    problems = _problems(
        [{"prefix": "a", "to": {"x": -1}}, {"path": "/b", "regex": "(", "to": "y"}, {"direct_response": 42}]
    )
    assert {where for where, _ in problems} >= {
        "services.edge.routes[0].prefix",
        "services.edge.routes[0].to.x",
        "services.edge.routes[1]",
        "services.edge.routes[2].direct_response.status",
    }, problems


def test_routes_need_an_http_listener() -> None:
    assert any("protocol http" in m for _, m in _problems([{"to": "x"}], protocol="tcp"))
    _, _, problems = parse_services({"edge": {"routes": [{"to": "x"}]}})
    assert [(p.where, "listen" in p.message) for p in problems] == [("services.edge.routes", True)]


def test_what_the_regex_check_takes_and_refuses() -> None:
    # RE2 spellings Python lacks are taken; Perl features RE2 lacks are refused.
    for good in (r"^/v[0-9]+/", r"\pL+", r"\p{Greek}", r"/a\z", "[[:alpha:]]+", "(?<name>a)", "(?i)/API"):
        assert regex_problem(good) is None, good
    for bad in ("(", "(?=a)", "(?!a)", "(?<=a)", "(?>a)", r"(a)\1", "a++", "x" * 2000):
        assert regex_problem(bad) is not None, bad


# -- building --------------------------------------------------------------------------------------


def test_the_lab_table_builds_what_its_hand_written_form_says() -> None:
    built = _route_config(_snapshot(LAB), "edge")
    retry = {"retry_on": "connect-failure,refused-stream,reset-before-request", "num_retries": 2}
    expected = json_format.ParseDict(
        lab_route_config(slow_timeout="30s", rest_timeout="15s", retry=retry), route_pb2.RouteConfiguration()
    )
    assert built == expected


def test_an_entry_without_routes_builds_what_it_always_did() -> None:
    plain = {"web": {"listen": "127.0.0.1:10000", "timeout": "2s", "retries": 0, "endpoints": ["127.0.0.1:9001"]}}
    built = _route_config(_snapshot(plain), "web")
    expected = json_format.ParseDict(
        {
            "name": "web",
            "virtual_hosts": [
                {
                    "name": "web",
                    "domains": ["*"],
                    "routes": [{"match": {"prefix": "/"}, "route": {"cluster": "web", "timeout": "2s"}}],
                }
            ],
        },
        route_pb2.RouteConfiguration(),
    )
    assert built == expected


def test_matchers_split_redirect_and_rewrite_are_built_as_envoy_spells_them() -> None:
    services: dict[str, Any] = {
        "edge": {
            "listen": "127.0.0.1:10000",
            "routes": [
                {
                    "regex": "/v[0-9]+/.*",
                    "host": ["api.example.com", "*.example.org"],
                    "headers": {"x-canary": "1", "x-old": False},
                    "to": {"pool": 3, "canary": 1},
                },
                {
                    "prefix": "/old/",
                    "redirect": {"scheme": "https", "prefix": "/new/", "code": 307, "strip_query": True},
                },
                {"prefix": "/api/", "to": "pool", "prefix_rewrite": "/", "retries": 0, "timeout": 0},
            ],
        },
        "pool": {"endpoints": ["127.0.0.1:9001"]},
        "canary": {"endpoints": ["127.0.0.1:9002"]},
    }
    routes = json_format.MessageToDict(_route_config(_snapshot(services), "edge"))["virtualHosts"][0]["routes"]
    assert routes[0]["match"] == {
        "safeRegex": {"regex": "/v[0-9]+/.*"},
        "headers": [
            {
                "name": ":authority",
                "stringMatch": {"safeRegex": {"regex": r"(?i)(api\.example\.com|[^:]+\.example\.org)(:[0-9]+)?"}},
            },
            {"name": "x-canary", "stringMatch": {"exact": "1"}},
            {"name": "x-old", "presentMatch": True, "invertMatch": True},
        ],
    }
    assert routes[0]["route"]["weightedClusters"] == {
        "clusters": [{"name": "canary", "weight": 1}, {"name": "pool", "weight": 3}]
    }
    assert routes[1]["redirect"] == {
        "schemeRedirect": "https",
        "prefixRewrite": "/new/",
        "responseCode": "TEMPORARY_REDIRECT",
        "stripQuery": True,
    }
    assert routes[2]["route"] == {"cluster": "pool", "timeout": "0s", "prefixRewrite": "/"}


def test_a_route_to_an_unknown_service_names_both() -> None:
    lab = {
        **LAB,
        "edge": {**LAB["edge"], "routes": [{"prefix": "/slow", "to": "slwo"}, {"to": {"pool": 1, "canry": 1}}]},
    }
    problems = _build_problems(lab)
    assert any(p.startswith("services.edge.routes[0].to: services.edge routes to 'slwo'") for p in problems), problems
    assert any(p.startswith("services.edge.routes[1].to: services.edge routes to 'canry'") for p in problems), problems


def test_a_route_may_name_a_service_of_another_source_or_a_raw_cluster() -> None:
    edge, _, _ = parse_services(
        {"edge": {"listen": "127.0.0.1:10000", "routes": [{"prefix": "/a", "to": "pool"}, {"to": "raw"}]}}
    )
    pool, found, _ = parse_services({"pool": {"endpoints": ["127.0.0.1:9001"]}})
    raw = cluster_pb2.Cluster(name="raw", type=cluster_pb2.Cluster.STATIC, connect_timeout={"seconds": 1})
    states = {
        "file": DesiredState(services=edge, resources={CLUSTER: (raw,)}),
        "registry": DesiredState(services=pool, endpoints=found),
    }
    snapshot = build_snapshot(merge_states(states), "test")
    assert set(snapshot.types[CLUSTER.url].resources) == {"edge", "pool", "raw"}


def test_a_change_of_routes_alone_changes_the_route_not_the_cluster() -> None:
    memo = ResourceMemo()
    first = _snapshot(LAB, memo=memo)
    changed = {**LAB, "edge": {**LAB["edge"], "routes": [{"prefix": "/slow", "to": "slow"}, {"to": "pool"}]}}
    second = _snapshot(changed, memo=memo)
    assert first.types[CLUSTER.url].resources["edge"].hash == second.types[CLUSTER.url].resources["edge"].hash
    assert len(_route_config(second, "edge").virtual_hosts[0].routes) == 2


# -- DNS endpoints ---------------------------------------------------------------------------------


def test_an_endpoint_may_be_a_host_name_and_a_bad_one_is_named() -> None:
    _, endpoints, problems = parse_services(
        {"api": {"endpoints": ["localhost:9001", {"address": "api.internal.example.com.", "port": 443}]}}
    )
    assert problems == [] and endpoints["api"] == (
        Endpoint("api.internal.example.com.", 443),
        Endpoint("localhost", 9001),
    )
    for bad, words in (
        ("under_score.example.com:80", "host name"),
        ("-lead.example.com:80", "host name"),
        ("10.0.0.300:80", "not an IP address"),
        (f"{'a' * 64}.com:80", "at most 63"),
    ):
        _, _, problems = parse_services({"api": {"endpoints": [bad]}})
        assert [p.where for p in problems] == ["services.api.endpoints[0]"] and words in problems[0].message, bad
    _, _, problems = parse_services({"api": {"listen": "localhost:10000"}})
    assert [p.where for p in problems] == ["services.api.listen"] and "not names" in problems[0].message


def test_a_service_with_host_names_is_a_strict_dns_cluster_holding_its_endpoints() -> None:
    services = {
        "api": {"endpoints": ["localhost:9001", {"address": "127.0.0.1", "port": 9002, "weight": 3}]},
        "web": {"endpoints": ["127.0.0.1:9003"]},
    }
    snapshot = _snapshot(services)
    cluster = _cluster(snapshot, "api")
    assert cluster.type == cluster_pb2.Cluster.STRICT_DNS and not cluster.HasField("eds_cluster_config")
    assert cluster.dns_lookup_family == cluster_pb2.Cluster.V4_PREFERRED
    addresses = [
        (
            e.endpoint.address.socket_address.address,
            e.endpoint.address.socket_address.port_value,
            e.load_balancing_weight.value,
        )
        for e in cluster.load_assignment.endpoints[0].lb_endpoints
    ]
    assert addresses == [("127.0.0.1", 9002, 3), ("localhost", 9001, 1)]
    assert set(snapshot.types[ENDPOINT.url].resources) == {"web"}, "no EDS for a DNS cluster"
    assert _cluster(snapshot, "web").type == cluster_pb2.Cluster.EDS


def test_a_service_that_turns_to_names_and_back_changes_its_cluster_type_each_time() -> None:
    memo = ResourceMemo()
    kinds = []
    for endpoints in (["127.0.0.1:9001"], ["localhost:9001"], ["localhost:9002"], ["127.0.0.1:9001"]):
        snapshot = _snapshot({"api": {"endpoints": endpoints}}, memo=memo)
        kinds.append(
            (
                cluster_pb2.Cluster.DiscoveryType.Name(_cluster(snapshot, "api").type),
                sorted(snapshot.types[ENDPOINT.url].resources),
            )
        )
    assert kinds == [("EDS", ["api"]), ("STRICT_DNS", []), ("STRICT_DNS", []), ("EDS", ["api"])]
    again = _snapshot({"api": {"endpoints": ["localhost:9002"]}}, memo=memo)
    assert (
        _cluster(again, "api").load_assignment.endpoints[0].lb_endpoints[0].endpoint.address.socket_address.port_value
        == 9002
    )


def test_a_dns_service_is_not_subsetted_and_refuses_what_needs_its_addresses() -> None:
    specs, endpoints, _ = parse_services({"api": {"endpoints": ["localhost:9001", "localhost:9002"]}})
    merged = merge_states({"file": DesiredState(services=specs, endpoints=endpoints)})
    assert subset_tables(merged, {}, default_size=1) == {}, "the server's --subset-size leaves it out"
    problems = _build_problems(
        {
            "api": {"subset_size": 1, "zone_local": True, "endpoints": ["localhost:9001"]},
            "echo": {"grpc": True, "endpoints": ["localhost:50051"]},
            "front": {"grpc": True, "routes": [{"to": "api"}]},
        }
    )
    assert [p.split(":")[0] for p in problems] == [
        "services.api.subset_size",
        "services.api.zone_local",
        "services.echo.grpc",
        "services.front.routes[0].to",
    ], problems


@pytest.mark.parametrize("page", ["README.md", "docs/sources.md"])
def test_the_route_tables_the_docs_show_build(page: str) -> None:
    text = (Path(__file__).resolve().parents[3] / page).read_text()
    blocks = [b for b in text.split("```yaml\n")[1:] if b.startswith("services:\n  edge:")]
    assert blocks, f"{page} shows no route table"
    for block in blocks:
        services = yaml.safe_load(block.split("```", 1)[0])["services"]
        snapshot = _snapshot(services)
        assert (
            _route_config(snapshot, "edge").virtual_hosts[0].routes[0].direct_response.body.inline_string == "marker\n"
        )


def test_every_view_gets_the_same_dns_cluster_rest_pollers_too() -> None:
    specs, endpoints, _ = parse_services(
        {
            "api": {"endpoints": ["localhost:9001"]},
            "web": {"listen": "127.0.0.1:10000", "endpoints": ["127.0.0.1:9002"]},
        }
    )
    merged = merge_states({"file": DesiredState(services=specs, endpoints=endpoints)})
    views = {"envoys": View(), "rest": View(kind=ClientKind.REST), "zone": View(zone="us-east-1a")}
    snapshots = build_snapshots(merged, "test", views)
    clusters = {name: s.types[CLUSTER.url].resources["api"] for name, s in snapshots.items()}
    assert clusters["envoys"] is clusters["rest"] is clusters["zone"], "one STRICT_DNS cluster, no config source in it"
    assert _cluster(snapshots["rest"], "api").type == cluster_pb2.Cluster.STRICT_DNS
    assert _cluster(snapshots["rest"], "web").eds_cluster_config.eds_config.HasField("api_config_source")
    assert all(set(s.types[ENDPOINT.url].resources) == {"web"} for s in snapshots.values())
