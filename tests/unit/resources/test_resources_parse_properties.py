"""Property tests of the snapshot file boundary: whatever a file holds, reading it gives a snapshot
or a :class:`ConfigError` naming the problems, never any other exception (which would kill the
file watcher or print a traceback from ``pilotfish validate``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml
from conftest import assignment, cluster, listener, route
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pilotfish.errors import ConfigError
from pilotfish.sources import load_snapshot

GOOD: dict[str, Any] = {
    "services": {
        "api": {
            "listen": "127.0.0.1:10001",
            "endpoints": ["127.0.0.1:9101", {"address": "127.0.0.1", "port": 9102, "weight": 2}],
            "health_check": {"path": "/healthz", "interval": "2s"},
        }
    },
    "clusters": [cluster("web")],
    "endpoints": [assignment("web", 9001, 9002)],
    "listeners": [listener("http", "local")],
    "routes": [route("local", "web")],
}
GOOD_TEXTS = {".yaml": yaml.safe_dump(GOOD).encode(), ".json": json.dumps(GOOD).encode()}

# Keys that reach deep into the parsers: sections, service fields, and Envoy field names.
KEYS = st.sampled_from(
    [
        "version",
        "services",
        "clusters",
        "endpoints",
        "listeners",
        "routes",
        "secrets",
        "name",
        "cluster_name",
        "listen",
        "protocol",
        "connect_timeout",
        "timeout",
        "retries",
        "upstream_protocol",
        "health_check",
        "path",
        "interval",
        "address",
        "port",
        "weight",
        "metadata",
        "type",
        "lb_endpoints",
        "endpoint",
        "socket_address",
        "port_value",
        "filter_chains",
        "filters",
        "typed_config",
        "@type",
        "virtual_hosts",
        "domains",
        "web",
    ]
) | st.text(max_size=8)
SCALARS = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats()
    | st.text(max_size=12)
    | st.sampled_from(["1s", "0s", "-1s", "nan", "infs", "1e999s", "127.0.0.1:9001", "::1", "EDS", "*", "V3"])
)
VALUES = st.recursive(
    SCALARS, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(KEYS, inner, max_size=5), max_leaves=30
)
TOP = st.dictionaries(KEYS, VALUES, max_size=6)

CHECKS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def load(tmp_path: Path, data: bytes, suffix: str) -> None:
    path = tmp_path / f"snapshot{suffix}"
    path.write_bytes(data)
    try:
        load_snapshot(path)
    except ConfigError as exc:
        assert exc.problems, "a ConfigError names at least one problem"
        assert all(str(p) for p in exc.problems)


@CHECKS
@given(data=st.binary(max_size=300), suffix=st.sampled_from([".yaml", ".json"]))
def test_random_bytes_only_give_reported_problems(tmp_path: Path, data: bytes, suffix: str) -> None:
    load(tmp_path, data, suffix)


@CHECKS
@given(
    suffix=st.sampled_from([".yaml", ".json"]),
    cuts=st.lists(
        st.tuples(
            st.integers(min_value=0, max_value=10_000), st.integers(min_value=0, max_value=8), st.binary(max_size=4)
        ),
        min_size=1,
        max_size=4,
    ),
)
def test_mutated_good_files_only_give_reported_problems(
    tmp_path: Path, suffix: str, cuts: list[tuple[int, int, bytes]]
) -> None:
    data = bytearray(GOOD_TEXTS[suffix])
    for at, remove, insert in cuts:  # delete some bytes and insert others, anywhere (truncation included)
        at %= len(data) + 1
        data[at : at + remove] = insert
    load(tmp_path, bytes(data), suffix)


@CHECKS
@given(document=TOP, as_json=st.booleans())
def test_random_documents_only_give_reported_problems(tmp_path: Path, document: dict[Any, Any], as_json: bool) -> None:
    if as_json:
        load(tmp_path, json.dumps(document, allow_nan=True).encode(), ".json")
    else:
        load(tmp_path, yaml.safe_dump(document, allow_unicode=True).encode(), ".yaml")


@CHECKS
@given(section=st.sampled_from(["clusters", "endpoints", "listeners", "routes", "services"]), value=VALUES)
def test_random_values_in_a_good_document_only_give_reported_problems(tmp_path: Path, section: str, value: Any) -> None:
    document = dict(GOOD)
    if section == "services":
        document["services"] = {"api": value}
    else:
        document[section] = [value, *GOOD[section]]
    load(tmp_path, yaml.safe_dump(document, allow_unicode=True).encode(), ".yaml")


def test_a_deeply_nested_file_is_a_reported_problem(tmp_path: Path) -> None:
    for suffix, text in ((".json", "[" * 100_000), (".yaml", "clusters: " + "[" * 100_000)):
        path = tmp_path / f"deep{suffix}"
        path.write_text(text)
        try:
            load_snapshot(path)
        except ConfigError as exc:
            assert exc.problems
        else:
            raise AssertionError(f"{suffix}: a deeply nested file must be refused")


def test_a_type_name_outside_the_protobuf_packages_imports_nothing() -> None:
    import sys

    from pilotfish.resources.anytypes import ensure_type

    assert "tabnanny" not in sys.modules
    assert not ensure_type("type.googleapis.com/tabnanny.Thing")
    assert not ensure_type("type.googleapis.com/.extensions.filters.http.router.v3.Router")
    assert "tabnanny" not in sys.modules
    assert ensure_type("type.googleapis.com/envoy.extensions.filters.http.router.v3.Router")
