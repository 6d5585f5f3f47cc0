"""An edit of a followed snapshot file is read by what it changed (``read_parsed`` with a memo).

When a file differs from its last good content only inside one resource list's items, only the
items there now are decoded and parsed; the rest is the last document's. Whatever the edit, what
is served (or the problems that refuse it) is what reading the file alone gives.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import assignment, cluster

from pilotfish.errors import ConfigError
from pilotfish.resources import CLUSTER, ENDPOINT, ParseMemo
from pilotfish.resources.text_diff import changed_region
from pilotfish.sources import load_desired


def raw(ports: dict[str, int], *, ttl: str | None = None) -> dict[str, Any]:
    clusters = [cluster(name) for name in ports]
    if ttl is not None:
        clusters[0]["ttl"] = ttl
    return {"version": "7", "clusters": clusters, "endpoints": [assignment(n, p) for n, p in ports.items()]}


def write(path: Path, document: dict[str, Any]) -> Path:
    if path.suffix == ".json":
        path.write_text(json.dumps(document, indent=1))
    else:
        path.write_text(yaml.safe_dump(document, sort_keys=False))
    return path


def loaded(path: Path, memo: ParseMemo | None) -> Any:
    """What the file serves (resources, TTLs and version), or the problems that refuse it."""
    try:
        desired = load_desired(path, memo=memo) if memo is not None else load_desired(path)
    except ConfigError as exc:
        return sorted(str(p) for p in exc.problems)
    return desired.resources, desired.ttls, desired.version


@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_an_edit_of_one_resource_decodes_and_parses_that_resource_alone(tmp_path: Path, suffix: str) -> None:
    path = tmp_path / f"snapshot{suffix}"
    ports = {f"c{i}": 9000 + i for i in range(30)}
    memo = ParseMemo()
    first = load_desired(write(path, raw(ports)), memo=memo)
    assert (memo.decoded, memo.parsed, memo.edits) == (60, 60, 0)
    second = load_desired(write(path, raw({**ports, "c4": 4444})), memo=memo)
    assert (memo.decoded, memo.parsed, memo.edits) == (61, 61, 1)
    assert second.resources[ENDPOINT][4].endpoints[0].lb_endpoints[0].endpoint.address.socket_address.port_value == 4444  # type: ignore[attr-defined]
    assert all(a is b for a, b in zip(first.resources[CLUSTER], second.resources[CLUSTER], strict=True))
    assert loaded(path, memo) == loaded(path, None)
    # A resource added, and one removed, in two edits: each is read alone too.
    document = raw({**ports, "c4": 4444})
    document["clusters"].insert(7, cluster("new"))
    load_desired(write(path, document), memo=memo)
    del document["endpoints"][9]
    load_desired(write(path, document), memo=memo)
    assert (memo.decoded, memo.parsed, memo.edits) == (62, 62, 3) and loaded(path, memo) == loaded(path, None)
    assert len(memo) == 60  # the resources of the last document, no more


@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_an_edit_that_makes_a_name_twice_is_refused_as_reading_it_whole_refuses_it(tmp_path: Path, suffix: str) -> None:
    path = tmp_path / f"snapshot{suffix}"
    ports = {f"c{i}": 9000 + i for i in range(5)}
    memo = ParseMemo()
    load_desired(write(path, raw(ports)), memo=memo)
    document = raw(ports)
    document["clusters"][3]["name"] = "c1"
    write(path, document)
    with pytest.raises(ConfigError, match="duplicate name"):
        load_desired(path, memo=memo)
    assert loaded(path, memo) == loaded(path, None)
    load_desired(write(path, raw({**ports, "c2": 1})), memo=memo)  # the last good one is what an edit is read against
    assert memo.edits == 1 and loaded(path, memo) == loaded(path, None)


def test_the_changed_region_is_the_run_between_the_common_prefix_and_suffix() -> None:
    rng = random.Random(7)
    for _ in range(3000):
        old = "".join(rng.choice("ab\n") for _ in range(rng.randrange(60)))
        at = rng.randrange(len(old) + 1)
        new = old[:at] + rng.choice(["", "a", "b\n", "xyz"]) + old[at + rng.randrange(4) :]
        start, old_end, new_end = changed_region(old, new)
        assert old[:start] + new[start:new_end] + old[old_end:] == new
        assert start == len(old) or start == len(new) or old[start] != new[start]
        assert old_end == start or new_end == start or old[old_end - 1] != new[new_end - 1]


_PIECES = [
    "", "- ", "\n", "\n- name: z\n  type: STATIC\n", "]", "},{", '"', ",", "&a ", "*a", "#", "  ", "\t",
    "ttl: 2s\n  ", '"ttl": "2s", ', "9", "c1", "name", "{}", "[", "\n---\n", "\r", "0x", "\u2028",
    '{"name": "q", "type": "STATIC"}, ', "- cluster_name: c2\n  endpoints: []\n", "endpoints:\n",
    "&id001 ", "*id001", " &id001 {}",
]  # fmt: skip


def _mutated(rng: random.Random, text: str, suffix: str) -> str:
    """``text`` with one edit: a random run replaced by a tricky piece, or one number changed."""
    if rng.random() < 0.5:
        digits = [i for i, c in enumerate(text) if c.isdigit()]
        at = rng.choice(digits)
        return text[:at] + str(rng.randrange(10)) + text[at + 1 :]
    at = rng.randrange(len(text) + 1)
    return text[:at] + rng.choice(_PIECES) + text[at + rng.randrange(6) :]


@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_whatever_the_edit_reading_it_with_the_memo_serves_what_reading_it_alone_serves(
    tmp_path: Path, suffix: str
) -> None:
    path = tmp_path / f"snapshot{suffix}"
    edits = 0
    for seed in range(40):
        rng = random.Random(seed)
        document = raw({f"c{i}": 9000 + i for i in range(rng.randrange(1, 6))}, ttl=rng.choice([None, "30s"]))
        if rng.random() < 0.5:  # one object twice: PyYAML writes an anchor and an alias
            document["clusters"][-1]["metadata"] = document["clusters"][0]["metadata"] = {"filter_metadata": {}}
        memo = ParseMemo()
        write(path, document)
        good = path.read_text()
        assert loaded(path, memo) == loaded(path, None)
        for _ in range(12):
            text = _mutated(rng, good if rng.random() < 0.5 else path.read_text(), suffix)
            path.write_text(text, newline="")
            served = loaded(path, memo)
            assert served == loaded(path, None), text
            if not isinstance(served, list):
                good = text
        edits += memo.edits
    assert edits >= 100, f"only {edits} documents were read as edits: the test no longer tests that path"


_HEAD = "clusters:\n- name: a\n  type: STATIC\n  connect_timeout: &t 1s\n"
_MIDDLE = "- name: b\n  type: STATIC\n  connect_timeout: 3s\n"
_TAIL = "- name: c\n  type: STATIC\n  connect_timeout: *t\n"


@pytest.mark.parametrize(
    "edited",
    [
        _HEAD + _MIDDLE.replace("3s", "&t 5s") + _TAIL,  # the anchor again (an error, as when read whole)
        _HEAD + _MIDDLE.replace("3s", "*t") + _TAIL,  # the other item's anchor: its value
        _HEAD.replace("&t ", "") + _MIDDLE + _TAIL,  # the anchor gone (an error: c names it)
        _HEAD.replace("1s", "2s") + _MIDDLE + _TAIL,  # the anchor's value changed: c's too
    ],
)
def test_an_edit_that_names_or_defines_an_anchor_is_read_as_reading_it_whole_reads_it(
    tmp_path: Path, edited: str
) -> None:
    path = tmp_path / "snapshot.yaml"
    memo = ParseMemo()
    path.write_text(_HEAD + _MIDDLE + _TAIL)
    assert loaded(path, memo) == loaded(path, None)
    path.write_text(edited)
    assert loaded(path, memo) == loaded(path, None)


def test_an_edit_nested_too_deeply_is_refused_as_reading_it_whole_refuses_it(tmp_path: Path) -> None:
    path = tmp_path / "snapshot.json"
    memo = ParseMemo()
    path.write_text('{"clusters": [{"name": "a", "type": "STATIC"}, {"name": "b", "type": "STATIC"}]}')
    load_desired(path, memo=memo)
    deep = "[" * 5000 + "]" * 5000
    edited = '{"clusters": [{"name": "a", "type": "STATIC"}, {"name": "b", "x": ' + deep + ', "type": "STATIC"}]}'
    path.write_text(edited)
    assert loaded(path, memo) == loaded(path, None)
    assert any("nested too deeply" in problem for problem in loaded(path, memo))


@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_edits_keep_the_memo_within_its_bound(tmp_path: Path, suffix: str) -> None:
    path = tmp_path / f"snapshot{suffix}"
    memo = ParseMemo(max_entries=12)
    document = raw({f"c{i}": 9000 + i for i in range(5)})
    load_desired(write(path, document), memo=memo)
    for i in range(20):  # one cluster more each time
        document["clusters"].append(cluster(f"x{i}"))
        load_desired(write(path, document), memo=memo)
        assert len(memo) <= len(document["clusters"]) + len(document["endpoints"])  # (the document's, no more)
        assert loaded(path, memo) == loaded(path, None)
    assert memo.edits == 2  # while the document fits the bound; past it, it is read whole
