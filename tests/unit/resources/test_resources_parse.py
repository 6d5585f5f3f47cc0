"""Snapshot files are parsed strictly; every problem names the resource and field."""

from __future__ import annotations

import datetime
import gc
import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import assignment, cluster, listener, route
from envoy.service.runtime.v3 import rtds_pb2

from pilotfish.errors import ConfigError
from pilotfish.resources import CLUSTER, ENDPOINT, RUNTIME, ParseMemo, parse_document
from pilotfish.resources.parse import without_collections
from pilotfish.sources import load_desired, load_snapshot

GOOD = {
    "clusters": [cluster("web")],
    "endpoints": [assignment("web", 9001)],
    "listeners": [listener("http", "local")],
    "routes": [route("local", "web")],
}


def write(tmp_path: Path, document: object, name: str = "snap.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(document) if isinstance(document, dict) else str(document))
    return path


def problems(tmp_path: Path, document: object, name: str = "snap.yaml") -> list[str]:
    with pytest.raises(ConfigError) as caught:
        load_snapshot(write(tmp_path, document, name))
    assert caught.value.source.endswith(name)
    return [str(p) for p in caught.value.problems]


def test_good_file_loads_with_every_type(tmp_path: Path) -> None:
    snapshot = load_snapshot(write(tmp_path, GOOD))
    assert {ts.rtype.key: len(ts.resources) for ts in snapshot.types.values()} == {
        "clusters": 1,
        "endpoints": 1,
        "extension_configs": 0,
        "listeners": 1,
        "routes": 1,
        "secrets": 0,
        "runtime": 0,
    }


def test_runtime_layers_are_written_by_name_or_as_envoy_writes_them_and_bad_values_are_named(
    tmp_path: Path,
) -> None:
    by_name = load_snapshot(write(tmp_path, {**GOOD, "runtime": {"flags": {"a.b": 1, "c": {"d": "x"}, "e": True}}}))
    as_envoy = load_snapshot(
        write(tmp_path, {**GOOD, "runtime": [{"name": "flags", "layer": {"a.b": 1, "c": {"d": "x"}, "e": True}}]})
    )
    (encoded,) = by_name.get(RUNTIME.url).resources.values()  # type: ignore[union-attr]
    layer = encoded.message
    assert isinstance(layer, rtds_pb2.Runtime)
    assert layer.name == "flags" and layer.layer.fields["a.b"].number_value == 1
    assert by_name.get(RUNTIME.url).version == as_envoy.get(RUNTIME.url).version  # type: ignore[union-attr]
    assert problems(tmp_path, {**GOOD, "runtime": {"flags": {"a": [1], "b": {"c": None}}, "other": 3}}) == [
        "runtime.flags.a: a runtime value is a string, number or boolean, not a list",
        "runtime.flags.b.c: a runtime value is a string, number or boolean, not null",
        "runtime[1] (name 'other').layer: expected a mapping (a google.protobuf.Struct), got the number 3",
    ]


def test_json_files_are_read_as_json(tmp_path: Path) -> None:
    import json

    path = tmp_path / "snap.json"
    path.write_text(json.dumps({**GOOD, "version": "9"}))
    assert load_snapshot(path).version("type.googleapis.com/envoy.config.cluster.v3.Cluster") == "9"


def test_unknown_field_names_resource_and_field(tmp_path: Path) -> None:
    bad = {**GOOD, "clusters": [{**cluster("web"), "conect_timeout": "1s"}]}
    [problem] = problems(tmp_path, bad)
    assert problem.startswith("clusters[0] (name 'web')")
    assert "conect_timeout" in problem


def test_unknown_nested_field_gives_its_path(tmp_path: Path) -> None:
    endpoints = assignment("web", 9001)
    endpoints["endpoints"][0]["lb_endpoints"][0]["weight"] = 3
    [problem] = problems(tmp_path, {**GOOD, "endpoints": [endpoints]})
    assert "endpoints[0] (cluster_name 'web')" in problem
    assert "weight" in problem and "lb_endpoints[0]" in problem


def test_unknown_type_is_named(tmp_path: Path) -> None:
    bad_listener = listener("http", "local")
    bad_listener["filter_chains"][0]["filters"][0]["typed_config"]["@type"] = (
        "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConectionManager"
    )
    [problem] = problems(tmp_path, {**GOOD, "listeners": [bad_listener]})
    assert problem.startswith("listeners[0] (name 'http')")
    assert "HttpConectionManager" in problem and "unknown @type" in problem


def test_duplicate_names_are_refused(tmp_path: Path) -> None:
    [problem] = problems(tmp_path, {**GOOD, "clusters": [cluster("web"), cluster("web", "2s")]})
    assert problem.startswith("clusters[1] (name 'web')") and "duplicate" in problem and "clusters[0]" in problem


def test_eds_cluster_without_endpoints_is_refused(tmp_path: Path) -> None:
    [problem] = problems(tmp_path, {**GOOD, "clusters": [cluster("web"), cluster("api")]})
    assert problem.startswith("clusters[1] (name 'api')")
    assert "cluster_name 'api'" in problem


def test_listener_without_its_route_configuration_is_refused(tmp_path: Path) -> None:
    [problem] = problems(tmp_path, {**GOOD, "routes": [route("other", "web")]})
    assert problem.startswith("listeners[0] (name 'http')")
    assert "'local'" in problem and "routes" in problem


def test_every_problem_is_reported_at_once(tmp_path: Path) -> None:
    bad = {
        "version": "1",
        "clusters": [{**cluster("web"), "x": 1}, {"connect_timeout": "1s"}],
        "listeners": "not a list",
        "servces": {},
    }
    found = problems(tmp_path, bad)
    assert len(found) == 4
    joined = "\n".join(found)
    assert "servces: unknown section" in joined
    assert "listeners: must be a list" in joined
    assert "clusters[1]: name is required" in joined


@pytest.mark.parametrize(
    ("text", "where"),
    [
        ("clusters:\n  - name: web\n    connect_timeout: [1s\n", "line"),  # half-written YAML
        ("- just\n- a list\n", "top level"),
        ("version: [1]\n", "version"),
    ],
)
def test_malformed_documents_say_where(tmp_path: Path, text: str, where: str) -> None:
    assert any(where in p for p in problems(tmp_path, text))


def test_half_written_json_names_line_and_column(tmp_path: Path) -> None:
    [problem] = problems(tmp_path, '{"clusters": [{"name": "web"', name="snap.json")
    assert problem.startswith("line 1, column") and "invalid JSON" in problem


def test_missing_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_snapshot(tmp_path / "absent.yaml")


@pytest.mark.parametrize(
    ("text", "name", "words"),
    [
        ("", "snap.yaml", "the file is empty"),
        ("\n  \n", "snap.yaml", "the file is empty"),
        ("", "snap.json", "the file is empty"),
        ("# everything moved elsewhere\n# clusters: []\n", "snap.yaml", "only comments"),
        ("{}", "snap.json", "no section to serve"),
        ("version: '3'\n", "snap.yaml", "no section to serve"),
    ],
)
def test_an_empty_file_is_an_error_not_remove_everything(tmp_path: Path, text: str, name: str, words: str) -> None:
    [problem] = problems(tmp_path, text, name)
    assert words in problem and "clusters: []" in problem


def test_explicit_empty_sections_are_an_empty_snapshot(tmp_path: Path) -> None:
    snapshot = load_snapshot(write(tmp_path, "clusters: []\nlisteners: []\n"))
    assert all(not ts.resources for ts in snapshot.types.values())


def test_a_byte_that_is_not_utf8_names_its_offset(tmp_path: Path) -> None:
    path = tmp_path / "snap.yaml"
    data = b"clusters: []\nlisteners: [] # caf\xe9\n"
    path.write_bytes(data)
    with pytest.raises(ConfigError) as caught:
        load_snapshot(path)
    [problem] = caught.value.problems
    assert problem.where == f"byte {data.index(0xE9)} (line 2)" and "not UTF-8 (byte 0xe9)" in problem.message


def test_unknown_keys_inside_health_check_are_errors(tmp_path: Path) -> None:
    document = {
        "services": {"web": {"endpoints": ["127.0.0.1:9001"], "health_check": {"path": "/ready", "intervall": "2s"}}}
    }
    [problem] = problems(tmp_path, document)
    assert problem.startswith("services.web.health_check: unknown field(s) intervall")


# -- the parse memo: an edit costs the resources it changed -------------------------------------


def raw_document(ports: dict[str, int], **more: Any) -> dict[str, Any]:
    return {
        "clusters": [cluster(name) for name in ports],
        "endpoints": [assignment(name, port) for name, port in ports.items()],
        **more,
    }


def test_an_unchanged_resource_is_not_parsed_again_and_is_the_same_message() -> None:
    memo = ParseMemo()
    ports = {f"c{i}": 9000 + i for i in range(50)}
    first = parse_document(raw_document(ports), "snapshot.yaml", memo=memo)
    assert memo.parsed == 100
    second = parse_document(raw_document({**ports, "c7": 7777}), "snapshot.yaml", memo=memo)
    assert memo.parsed == 101  # the one assignment that changed
    before, after = first.resources[CLUSTER], second.resources[CLUSTER]
    assert all(a is b for a, b in zip(before, after, strict=True))  # (built from downstream by identity)
    changed = [a for a, b in zip(first.resources[ENDPOINT], second.resources[ENDPOINT], strict=True) if a is not b]
    assert [m.cluster_name for m in changed] == ["c7"]  # type: ignore[attr-defined]
    assert second.resources[ENDPOINT][7].endpoints[0].lb_endpoints[0].endpoint.address.socket_address.port_value == 7777  # type: ignore[attr-defined]


def test_a_refused_document_keeps_the_last_good_resources() -> None:
    memo = ParseMemo()
    ports = {f"c{i}": 9000 + i for i in range(10)}
    parse_document(raw_document(ports), "snapshot.yaml", memo=memo)
    broken = raw_document(ports)
    broken["clusters"][3]["conect_timeout"] = "1s"
    with pytest.raises(ConfigError, match="conect_timeout"):
        parse_document(broken, "snapshot.yaml", memo=memo)
    assert len(memo) == 20
    parsed = memo.parsed
    parse_document(raw_document(ports), "snapshot.yaml", memo=memo)  # fixed: nothing to parse again
    assert memo.parsed == parsed


def test_the_memo_holds_the_last_good_documents_resources_only() -> None:
    memo = ParseMemo()
    parse_document(raw_document({f"c{i}": 9000 + i for i in range(100)}), "snapshot.yaml", memo=memo)
    assert len(memo) == 200
    parse_document(raw_document({"c1": 9001}), "snapshot.yaml", memo=memo)
    assert len(memo) == 2
    small = ParseMemo(max_entries=5)  # a document larger than the bound is parsed; only 5 are kept
    parse_document(raw_document({f"c{i}": 9000 + i for i in range(10)}), "snapshot.yaml", memo=small)
    assert len(small) == 5


def test_a_value_with_no_json_form_is_parsed_every_time() -> None:
    memo = ParseMemo()
    document = raw_document({"c1": 9001})
    document["clusters"][0]["metadata"] = {"filter_metadata": {"x": {"when": datetime.date(2026, 1, 1)}}}
    with pytest.raises(ConfigError):  # (protobuf takes no date: refused, not a crash)
        parse_document(document, "snapshot.yaml", memo=memo)
    assert ParseMemo.key(CLUSTER, document["clusters"][0]) is None


def test_a_followed_file_is_parsed_per_resource(tmp_path: Path) -> None:
    path = tmp_path / "snapshot.json"
    memo = ParseMemo()
    ports = {f"c{i}": 9000 + i for i in range(20)}
    path.write_text(json.dumps(raw_document(ports)))
    first = load_desired(path, memo=memo)
    path.write_text(json.dumps(raw_document({**ports, "c3": 3333}), indent=2))  # reformatted too
    second = load_desired(path, memo=memo)
    assert memo.parsed == 41
    assert sum(a is not b for a, b in zip(first.resources[ENDPOINT], second.resources[ENDPOINT], strict=True)) == 1


def test_no_collection_runs_while_a_document_is_parsed_and_the_collector_comes_back_after() -> None:
    seen: list[bool] = []
    with without_collections():
        seen.append(gc.isenabled())
        with without_collections():  # (another thread's parse meanwhile)
            seen.append(gc.isenabled())
        seen.append(gc.isenabled())
    assert seen == [False, False, False] and gc.isenabled()
    with pytest.raises(ConfigError), without_collections():
        parse_document({"clusters": 3}, "snapshot.yaml")
    assert gc.isenabled()


def test_a_ttl_beside_a_resource_is_served_with_it_and_a_bad_one_is_named(tmp_path: Path) -> None:
    layer = {"name": "gameday", "layer": {"fault.abort": 100}}
    snapshot = load_snapshot(write(tmp_path, {**GOOD, "runtime": [{**layer, "ttl": "30s"}]}))
    without = load_snapshot(write(tmp_path, {**GOOD, "runtime": [layer]}))
    resource = snapshot.get(RUNTIME.url).resources["gameday"]  # type: ignore[union-attr]
    plain = without.get(RUNTIME.url).resources["gameday"]  # type: ignore[union-attr]
    assert resource.ttl_ms == 30_000 and plain.ttl_ms == 0
    assert resource.value == plain.value, "the TTL is not a field of the layer: it wraps it"
    assert resource.hash != plain.hash, "a TTL that changes is a change"
    # Any type may carry one; what the file says of each is kept by name.
    desired = load_desired(write(tmp_path, {**GOOD, "clusters": [{**cluster("web"), "ttl": "1.5s"}]}))
    assert desired.ttls == {CLUSTER: {"web": 1500}}

    bad = {**GOOD, "runtime": [{**layer, "ttl": "500ms"}, {"name": "b", "layer": {}, "ttl": "soon"}]}
    bad["clusters"] = [{**cluster("web"), "ttl": 90_000}]
    assert problems(tmp_path, bad) == [
        "clusters[0].ttl: must be at most 86400s (a day), got 90000",
        "runtime[0].ttl: must be at least 1s (heartbeats must have room to renew it), got '500ms'",
        "runtime[1].ttl: expected a duration such as 250ms, 1.5s or 2, got 'soon'",
    ]


def test_a_resource_whose_ttl_alone_changed_is_not_parsed_again(tmp_path: Path) -> None:
    memo = ParseMemo()
    layer = {"name": "gameday", "layer": {"fault.abort": 100}}
    first = load_desired(write(tmp_path, {**GOOD, "runtime": [{**layer, "ttl": "30s"}]}), memo=memo)
    parsed = memo.parsed
    second = load_desired(write(tmp_path, {**GOOD, "runtime": [{**layer, "ttl": "60s"}]}), memo=memo)
    assert memo.parsed == parsed
    assert second.resources[RUNTIME][0] is first.resources[RUNTIME][0]
    assert second.ttls[RUNTIME] == {"gameday": 60_000}
