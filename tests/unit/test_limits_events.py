"""Event-log lines stay bounded whatever a peer puts in their fields."""

from __future__ import annotations

import json
from pathlib import Path

from pilotfish.events import MAX_FIELD, MAX_ITEMS, EventLog, shorten


def test_fields_a_peer_makes_huge_are_shortened_and_the_line_stays_bounded(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    log = EventLog(path)
    node = "n" * (64 * 1024)
    reason = "Proto constraint validation failed (ClusterValidationError.ConnectTimeout)"
    nack = "dump " * 200_000 + reason  # Envoy puts the resource first and the reason last
    names = [f"cluster-{i}" for i in range(100_000)]
    log.emit("nack", stream=1, node=node, error=nack, resource_names=names)
    log.emit("ack", stream=2, node="edge-1", resource_names=["a", "b"])
    log.close()
    raw = path.read_bytes().splitlines()
    assert all(len(line) <= 4 * MAX_FIELD + MAX_ITEMS * 64 for line in raw)
    big, small = (json.loads(line) for line in raw)
    assert big["node"].startswith("nnnn") and "65,536 characters" in big["node"]
    assert big["error"].endswith(reason[-MAX_FIELD // 4:]) and f"{len(nack):,} characters" in big["error"]
    assert big["resource_names"] == names[:MAX_ITEMS] and big["resource_names_omitted"] == 100_000 - MAX_ITEMS
    assert small["node"] == "edge-1" and small["resource_names"] == ["a", "b"]  # a usual line is untouched


def test_shorten_keeps_start_end_and_says_how_long() -> None:
    assert shorten("short") == "short"
    url = "type.googleapis.com/" + "x" * 17_000_000
    short = shorten(url)
    assert len(short) < 250 and short.startswith("type.googleapis.com/xx") and "17,000,020 characters" in short
