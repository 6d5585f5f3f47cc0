"""A YAML snapshot file is decoded per resource: only an item whose text changed is decoded again,
and what comes out is always what decoding the whole document gives."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import assignment, cluster

from pilotfish.errors import ConfigError
from pilotfish.resources import CLUSTER, ENDPOINT, ParseMemo, decode_document
from pilotfish.resources.parse import Remembered
from pilotfish.resources.yaml_items import split_items
from pilotfish.sources import load_desired

LISTS = ("clusters", "endpoints", "runtime")


def raw(ports: dict[str, int]) -> dict[str, Any]:
    return {
        "version": "7",
        "clusters": [cluster(name) for name in ports],
        "endpoints": [assignment(name, port) for name, port in ports.items()],
    }


def test_block_lists_are_cut_into_their_items_and_the_rest_is_left_whole() -> None:
    text = (
        "# the fleet's file\n"
        "version: 3\n"
        "clusters:\n"
        "  # the first\n"
        "  - name: a\n"
        "    type: STATIC\n"
        "\n"
        "  - name: b   # a comment\n"
        "    script: |\n"
        "      - not an item\n"
        "endpoints: []\n"
        "runtime:\n"
        "  flags: {a: 1}\n"
    )
    cut = split_items(text, LISTS)
    assert cut is not None
    assert cut.items == {
        "clusters": [
            "  - name: a\n    type: STATIC\n\n",
            "  - name: b   # a comment\n    script: |\n      - not an item\n",
        ]
    }
    assert [yaml.safe_load(section) for section in cut.rest] == [
        {"version": 3},
        {"endpoints": []},
        {"runtime": {"flags": {"a": 1}}},
    ]


@pytest.mark.parametrize(
    "text",
    [
        "---\nclusters:\n- name: a\n",  # a document marker
        "%YAML 1.2\n---\nclusters:\n- name: a\n",  # a directive
        "clusters:\n- name: a\n\tport: 1\n",  # a tab in the indentation
        '"clusters":\n- name: a\n',  # a quoted key
        "clusters:\n- name: a\nclusters:\n- name: b\n",  # a key twice
        "clusters:\n  - name: a\n - name: b\n",  # less indented than the items, inside the list
        "clusters:\n- name: a\n-name: b\n",  # at the items' indentation, not an item
        "- name: a\n- name: b\n",  # a top-level sequence
        "version: 3\nservices: {}\n",  # no list to cut
    ],
)
def test_a_document_the_cut_does_not_know_to_be_safe_is_not_cut(text: str) -> None:
    assert split_items(text, LISTS) is None


TRICKY = [
    # A quoted value continued on a line that looks like a key: the cut leaves it open.
    'clusters:\n- name: "abc\nxyz: 1"\n',
    # A flow value continued at column 0.
    "clusters:\n- name: a\n  hosts: [1,\n2]\n",
    # Anchors in one item, aliases in later ones (as PyYAML writes shared objects), across lists.
    "clusters:\n- name: a\n  cfg: &x {ads: {}}\n- name: b\n  cfg: *x\nendpoints:\n- cluster_name: a\n  cfg: *x\n",
    # An anchor defined twice: each alias is the latest before it.
    "clusters:\n- &n {name: a}\n- *n\n- &n {name: b}\n- *n\n",
    # An alias to an anchor that comes later (an error, decoded whole: named there).
    "clusters:\n- *later\n- &later {name: a}\n",
    # '*' and '&' in plain strings.
    "clusters:\n- name: '*.example.com'\n  q: a&b\n- name: x*y\n",
    # Items with different indentation in different lists; comments and blank lines everywhere.
    "# head\nclusters:\n\n  - name: a\n    # inside\n  - name: b\n\n# between\nendpoints:\n- cluster_name: a\n",
    # A list in flow style, and one left empty.
    "clusters: [{name: a}]\nendpoints:\nversion: 2\n",
    # Block scalars whose lines look like items and keys.
    "clusters:\n- name: a\n  text: |\n    - b\n    c: d\n- name: e\n  folded: >-\n    x\n\n    y\n",
    # Merge keys.
    "clusters:\n- &base {type: EDS, name: a}\n- <<: *base\n  name: b\n",
    # (What an adversarial review found; each gave another document, or none, than decoding it whole.)
    # A list indented by one space; one with an item back at column 0.
    "clusters:\n - name: c1\n   type: STATIC\n",
    "clusters:\n - name: c1\n- name: c2\n",
    # A value left open in a section that is not cut, closed in a later one.
    'services: {}\nversion: "7\nclusters:\n- name: c1\nendpoints: []"\n',
    "version: [7,\nclusters:\n- name: c1\nendpoints: []]\n",
    # Line breaks YAML knows beside \n: a lone \r, \x85, \u2028.
    'clusters:\n- name: c0\r  type: STATIC\r- name: "c1\n- name: c2 #"\n',
    "clusters:\n- name: a\u2028- name: b\n",
    "clusters:\n- name: a\x85- name: b\n",
    # Something indented before the first key.
    ' version: "7"\nclusters:\n- name: c1\n',
    "#c\n  version: 7\nclusters:\n- name: c1\n",
    # An anchor twice: in a section decoded whole and in an item; after a colon in a flow mapping.
    "clusters:\n- name: a\n  t: &t 1s\nversion: &t 2s\nruntime:\n- name: f\n  layer: {a: *t}\n",
    'clusters:\n- name: a\n  t: &t 1s\n- {"name": "b", "t":&t 2s}\n- name: c\n  t: *t\n',
    # A control character where the cut does not decode: the key's line, a comment before the items.
    "clusters: # x\x01\n- name: c1\n",
    "clusters:\n# \x1b\n- name: c1\n",
    "clusters:\n# caf\u00e9 \x01\n- name: c1\n",  # (not ASCII: the other way of looking)
    "clusters:\n- name: caf\u00e9\n- name: \u4e2d\n",
    # (A second review.) Anchors where the first look did not see them: after `?`, twice outside the lists.
    "clusters:\n- name: a\n  t: &t 1s\n- name: b\n  m: {k: {?&t v: 1}}\n",
    'version: &t "7"\nservices: &t {}\nclusters:\n- name: c1\n',
    # A value libyaml cannot build, in an item before an error the whole read finds first; alone.
    'clusters:\n- name: c1\n  x: !!int 0x\nendpoints:\n- cluster_name: "c1\n',
    "clusters:\n- name: c1\n  x: !!int 0x\n- name: c2\n  d: 2001-02-30\n",
]


def _decoded(text: str, *, as_json: bool, memo: ParseMemo | None) -> Any:
    """The document, or the problems that refuse it."""
    try:
        return decode_document(text.encode(), "s.json" if as_json else "s.yaml", as_json=as_json, memo=memo)
    except ConfigError as exc:
        return [str(p) for p in exc.problems]


@pytest.mark.parametrize("text", TRICKY)
def test_whatever_the_text_decoding_by_items_gives_what_decoding_it_whole_gives(text: str) -> None:
    assert _decoded(text, as_json=False, memo=ParseMemo()) == _decoded(text, as_json=False, memo=None)


def test_a_generated_file_is_decoded_per_item_the_same_as_whole() -> None:
    document = raw({f"c{i}": 9000 + i for i in range(40)})
    shared = {"ads": {}, "resource_api_version": "V3"}  # PyYAML writes a shared object as an anchor
    for item in document["clusters"]:
        item["eds_cluster_config"] = {"eds_config": shared}
    text = yaml.safe_dump(document, sort_keys=False)
    assert "*id001" in text
    memo = ParseMemo()
    assert decode_document(text.encode(), "s.yaml", as_json=False, memo=memo) == yaml.safe_load(text)
    assert memo.decoded == 80


def _write(path: Path, document: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(document, sort_keys=False))
    return path


def test_an_item_whose_text_did_not_change_is_not_decoded_again(tmp_path: Path) -> None:
    path = tmp_path / "snapshot.yaml"
    ports = {f"c{i}": 9000 + i for i in range(30)}
    memo = ParseMemo()
    first = load_desired(_write(path, raw(ports)), memo=memo)
    assert (memo.decoded, memo.parsed) == (60, 60)
    second = load_desired(_write(path, raw({**ports, "c4": 4444})), memo=memo)
    assert (memo.decoded, memo.parsed) == (61, 61)  # the one assignment that changed
    assert all(a is b for a, b in zip(first.resources[CLUSTER], second.resources[CLUSTER], strict=True))
    assert second.resources[ENDPOINT][4].endpoints[0].lb_endpoints[0].endpoint.address.socket_address.port_value == 4444  # type: ignore[attr-defined]
    assert second.resources == load_desired(path).resources  # what decoding it whole gives


def test_a_changed_anchor_is_a_change_to_every_item_that_names_it(tmp_path: Path) -> None:
    path = tmp_path / "snapshot.yaml"
    head = "clusters:\n- name: a\n  type: STATIC\n  connect_timeout: &t 1s\n"
    users = "".join(f"- name: c{i}\n  type: STATIC\n  connect_timeout: *t\n" for i in range(5))
    memo = ParseMemo()
    path.write_text(head + users)
    load_desired(path, memo=memo)
    decoded = memo.decoded
    path.write_text(head.replace("1s", "2s") + users)
    desired = load_desired(path, memo=memo)
    assert memo.decoded == decoded + 6
    assert {c.connect_timeout.seconds for c in desired.resources[CLUSTER]} == {2}  # type: ignore[attr-defined]


def test_a_ttl_is_known_with_its_item(tmp_path: Path) -> None:
    path = tmp_path / "snapshot.yaml"
    document = raw({"c1": 9001})
    document["clusters"][0]["ttl"] = "30s"
    memo = ParseMemo()
    load_desired(_write(path, document), memo=memo)
    document["endpoints"][0]["cluster_name"] = "c1"  # (unchanged; the file is written again)
    again = load_desired(_write(path, document), memo=memo)
    assert memo.decoded == 2 and again.ttls == {CLUSTER: {"c1": 30_000}}


def test_a_broken_edit_names_its_line_and_the_next_good_one_decodes_only_what_changed(tmp_path: Path) -> None:
    path = tmp_path / "snapshot.yaml"
    ports = {f"c{i}": 9000 + i for i in range(10)}
    memo = ParseMemo()
    load_desired(_write(path, raw(ports)), memo=memo)
    decoded = memo.decoded
    good = path.read_text()
    path.write_text(good.replace("- cluster_name: c3\n", '- cluster_name: "c3\n', 1))
    with pytest.raises(ConfigError) as caught:
        load_desired(path, memo=memo)
    assert "invalid YAML" in str(caught.value) and "line " in caught.value.problems[0].where
    path.write_text(good.replace("port_value: 9005", "port_value: 5555"))
    load_desired(path, memo=memo)
    assert memo.decoded == decoded + 1


def test_a_remembered_item_is_what_the_memo_holds() -> None:
    memo = ParseMemo()
    text = yaml.safe_dump(raw({"c1": 9001}), sort_keys=False).encode()
    from pilotfish.resources import parse_document

    parse_document(decode_document(text, "s.yaml", as_json=False, memo=memo), "s.yaml", memo=memo)
    again = decode_document(text, "s.yaml", as_json=False, memo=memo)
    assert all(isinstance(item, Remembered) for item in again["clusters"] + again["endpoints"])
    assert again["version"] == "7"


def _value(rng: random.Random, depth: int, shared: list[Any]) -> Any:
    roll = rng.random()
    if depth > 3 or roll < 0.3:
        return rng.choice(["a", "*.x", "a&b", "- b", "c: d", "x\ny", 'q"r', "", "#h", 3, 2.5, True, None, "&z"])
    if roll < 0.4 and shared:
        return rng.choice(shared)  # the same object again: PyYAML writes an anchor and aliases
    if roll < 0.7:
        made: Any = {rng.choice(["k", "name", "- k", "x y"]) + str(i): _value(rng, depth + 1, shared) for i in range(3)}
    else:
        made = [_value(rng, depth + 1, shared) for _ in range(rng.randrange(3))]
    shared.append(made)
    return made


def test_random_documents_decode_by_items_as_whole() -> None:
    by_items = 0
    for seed in range(60):
        rng = random.Random(seed)
        shared: list[Any] = []
        document: dict[str, Any] = {key: [_value(rng, 0, shared) for _ in range(rng.randrange(6))] for key in LISTS}
        document["version"] = str(seed)
        style = rng.choice([False, None])
        text = yaml.safe_dump(document, sort_keys=False, default_flow_style=style, indent=rng.choice([2, 4]))
        memo = ParseMemo()
        assert decode_document(text.encode(), "s.yaml", as_json=False, memo=memo) == yaml.safe_load(text), text
        by_items += memo.decoded > 0
    assert by_items >= 40, "the documents must mostly be decoded by items for this to test that"


JSON_TEXTS = [
    '{"clusters": [{"name": "a"}, {"name": "b"}], "version": "3"}',
    ' \n{ "clusters" : [ ] , "endpoints":[{"cluster_name":"a","x":[1,{"y":"]}"}]}]}\n ',
    '{"clusters": [{"name": "a"},], "version": "3"}',  # a trailing comma: an error, named whole
    '{"clusters": [{"name": "a"}], "clusters": []}',  # a key twice: the last one, as json.loads
    '{"clusters": [{"name": "a"}]} {"x": 1}',  # extra data
    '{"clusters": {"name": "a"}}',  # not a list: left to the parse to name
    '[{"name": "a"}]',
    '{"clusters": [NaN, {"a": Infinity}]}',
    '{"clusters": [{"name": "a", "x": ' + "9" * 5000 + "}]}",  # (more digits than Python converts)
]


@pytest.mark.parametrize("text", JSON_TEXTS)
def test_a_json_document_decoded_by_items_is_what_decoding_it_whole_gives(text: str) -> None:
    assert _decoded(text, as_json=True, memo=ParseMemo()) == _decoded(text, as_json=True, memo=None)


def test_a_json_resource_whose_text_did_not_change_is_not_keyed_or_parsed_again(tmp_path: Path) -> None:
    path = tmp_path / "snapshot.json"
    ports = {f"c{i}": 9000 + i for i in range(30)}
    memo = ParseMemo()
    path.write_text(json.dumps(raw(ports)))
    first = load_desired(path, memo=memo)
    assert (memo.decoded, memo.parsed) == (60, 60)
    path.write_text(json.dumps(raw({**ports, "c4": 4444})))
    second = load_desired(path, memo=memo)
    assert (memo.decoded, memo.parsed) == (61, 61)
    assert all(a is b for a, b in zip(first.resources[CLUSTER], second.resources[CLUSTER], strict=True))
    path.write_text(json.dumps(raw({**ports, "c4": 4444}), indent=2))  # reformatted: new texts, same content
    load_desired(path, memo=memo)
    assert (memo.decoded, memo.parsed) == (121, 61)


EDITS = [
    # Non-string keys: JSON writes 1 as "1", so their canonical JSON is the same; the parse is not.
    ['runtime:\n- name: flags\n  layer: {"1": a}\n', "runtime:\n- name: flags\n  layer: {1: a}\n"],
    [
        "clusters:\n- name: c\n  type: STATIC\n  metadata: {filter_metadata: {k: {'true': 1}}}\n",
        "clusters:\n- name: c\n  type: STATIC\n  metadata: {filter_metadata: {k: {true: 1}}}\n",
    ],
    # A text first seen in a document with a lone \r, then alone.
    [
        'clusters:\n- name: c0\r  type: STATIC\r  connect_timeout: 1s\r- name: "c1\n- name: c2 #"\n'
        "  type: STATIC\n  connect_timeout: 1s\n",
        'clusters:\n- name: c2 #"\n  type: STATIC\n  connect_timeout: 1s\n',
    ],
    # The order of keys inside an Any is kept in its bytes: another order is another resource.
    [
        "clusters:\n- name: c\n  type: STATIC\n  metadata:\n    typed_filter_metadata:\n      f: {'@type': "
        "type.googleapis.com/xds.type.v3.TypedStruct, type_url: x/y, value: {k0: 1, k1: 1}}\n",
        "clusters:\n- name: c\n  type: STATIC\n  metadata:\n    typed_filter_metadata:\n      f: {'@type': "
        "type.googleapis.com/xds.type.v3.TypedStruct, type_url: x/y, value: {k1: 1, k0: 1}}\n",
    ],
    # Keys that are not strings inside YAML's ordered pairs.
    [
        "clusters:\n- name: c\n  type: STATIC\n  metadata: {filter_metadata: {k: {v: !!omap [a: {'1': x}]}}}\n",
        "clusters:\n- name: c\n  type: STATIC\n  metadata: {filter_metadata: {k: {v: !!omap [a: {1: x}]}}}\n",
    ],
    # An item that is its own alias (refers to itself).
    ["runtime:\n- name: flags\n  layer: &m {a: *m}\n", "runtime:\n- name: flags\n  layer: {a: 1}\n"],
]


def _loaded(path: Path, memo: ParseMemo | None) -> Any:
    """What the file serves (resources and TTLs), or the problems that refuse it."""
    try:
        desired = load_desired(path, memo=memo) if memo is not None else load_desired(path)
    except ConfigError as exc:
        return sorted(str(p) for p in exc.problems)
    return desired.resources, desired.ttls


@pytest.mark.parametrize("edits", EDITS)
def test_every_edit_read_with_the_memo_serves_what_reading_it_alone_serves(tmp_path: Path, edits: list[str]) -> None:
    path = tmp_path / "snapshot.yaml"
    memo = ParseMemo()
    for text in edits:
        path.write_text(text, newline="")
        assert _loaded(path, memo) == _loaded(path, None), text


def test_the_texts_known_are_bounded_like_the_resources(tmp_path: Path) -> None:
    path = tmp_path / "snapshot.yaml"
    document = raw({f"c{i}": 9000 + i for i in range(10)})
    memo = ParseMemo(max_entries=5)  # a document larger than the bound is read; only 5 are kept
    load_desired(_write(path, document), memo=memo)
    assert (len(memo), memo.texts) == (5, 5)
    again = load_desired(path, memo=memo)
    assert memo.decoded == 20 + 15  # the 5 known by their text are not decoded again
    assert again.resources == load_desired(path).resources
    assert (len(memo), memo.texts) == (5, 5)
