"""The services model: parsing, building Envoy resources, merging sources."""

from __future__ import annotations

import pytest

from pilotfish.resources.services import Endpoint, parse_services


def test_services_section_parses_endpoints_and_settings() -> None:
    specs, endpoints, problems = parse_services(
        {
            "playback": {
                "listen": "127.0.0.1:10000",
                "protocol": "http",
                "timeout": "2.5s",
                "retries": 3,
                "endpoints": ["127.0.0.1:9002", {"address": "127.0.0.1", "port": 9001, "weight": 5}],
            },
            "db": {"listen": "127.0.0.1:15432", "protocol": "tcp", "endpoints": ["127.0.0.1:5432"]},
        }
    )
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


@pytest.mark.parametrize(
    ("service", "where", "words"),
    [
        ({"zone_local": "yes"}, "services.web.zone_local", "true or false"),
        (
            {"endpoints": [{"address": "127.0.0.1", "port": 1, "zone": "a/b"}]},
            "services.web.endpoints[0].zone",
            "zone name",
        ),
        (
            {"endpoints": [{"address": "127.0.0.1", "port": 1, "zone": "z" * 129}]},
            "services.web.endpoints[0].zone",
            "at most 128",
        ),
    ],
)
def test_bad_zone_settings_are_named(service: dict[str, object], where: str, words: str) -> None:
    _, _, problems = parse_services({"web": service})
    assert [p.where for p in problems] == [where] and words in problems[0].message, problems
