"""The event log (pilotfish.events): JSON lines, the ``changes`` level that leaves out the routine
conversation, lines kept bounded whatever a peer puts in their fields, and the contract:
``EVENTS`` names every event and its fields, docs/operations.md's table documents exactly those,
and a record with an unknown event or field is caught."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from pilotfish.events import (
    CONVERSATION,
    EVENTS,
    MAX_FIELD,
    MAX_ITEMS,
    RECENT_LINE,
    EventLog,
    RecentEvents,
    check_event_log,
    contract_problems,
    read_events,
)


def lines(path: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def emit_one_of_each(log: EventLog) -> None:
    log.emit("stream_open", stream=1, node="edge-1")
    log.emit("request", stream=1, type="CDS")
    log.emit("sent", stream=1, type="CDS", version="v1", nonce="1")
    log.emit("ack", stream=1, type="CDS", version_info="v1")
    log.emit("nack", stream=1, type="CDS", error="bad cluster")
    log.emit("snapshot_loaded", version="v2")
    log.close()


def test_every_event_is_one_json_line_with_time_and_name(tmp_path: Path) -> None:
    emit_one_of_each(EventLog(tmp_path / "all.jsonl"))
    events = lines(tmp_path / "all.jsonl")
    assert [e["event"] for e in events] == ["stream_open", "request", "sent", "ack", "nack", "snapshot_loaded"]
    assert all(isinstance(e["ts"], float) for e in events)
    assert events[4]["error"] == "bad cluster"


def test_changes_level_keeps_what_an_operator_acts_on(tmp_path: Path) -> None:
    log = EventLog(tmp_path / "changes.jsonl", level="changes")
    assert log.enabled and not log.conversation
    emit_one_of_each(log)
    kept = [e["event"] for e in lines(tmp_path / "changes.jsonl")]
    assert kept == ["stream_open", "nack", "snapshot_loaded"]
    assert not CONVERSATION & set(kept)


def test_an_unknown_level_is_refused_by_name(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="all, changes"):
        EventLog(tmp_path / "x.jsonl", level="verbose")


def test_read_events_reads_complete_lines_only_and_goes_on_from_its_offset(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    assert read_events(path) == ([], 0)  # not created yet
    path.write_bytes(b'{"event": "server_started", "xds": "127.0.0.1:1"}\n{"event": "snapsh')
    first, offset = read_events(path)
    assert [e["event"] for e in first] == ["server_started"]
    assert read_events(path, offset) == ([], offset)  # the half-written line waits
    with path.open("ab") as file:
        file.write(b'ot_loaded"}\n\n{"event": "ack"}\n')
    rest, end = read_events(path, offset)
    assert [e["event"] for e in rest] == ["snapshot_loaded", "ack"]
    assert end == path.stat().st_size


def test_read_events_names_the_file_of_a_line_that_is_not_an_event(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    path.write_bytes(b'{"event": "ack"}\n[1, 2]\n')
    with pytest.raises(ValueError, match=r"events\.jsonl: an event log line is not a JSON object: \[1, 2\]"):
        read_events(path)


# -- the in-memory ring of recent events (the admin API's /v1/events) -----------------------------


def test_the_ring_keeps_the_latest_events_without_the_conversation_with_or_without_a_file(tmp_path: Path) -> None:
    for path in (None, tmp_path / "all.jsonl"):
        recent = RecentEvents(size=10)
        log = EventLog(path, recent=recent)
        assert log.enabled and log.conversation is (path is not None)  # the ring never asks for requests
        emit_one_of_each(log)
        kept = [json.loads(line) for _, line in recent]
        assert [e["event"] for e in kept] == ["stream_open", "nack", "snapshot_loaded"]
        assert kept[1]["error"] == "bad cluster" and isinstance(kept[1]["ts"], float)
        assert [seq for seq, _ in recent] == [1, 2, 3] and recent.last == 3
        assert all(not contract_problems(event) for event in kept)


def test_the_ring_is_bounded_in_events_and_in_bytes_whatever_a_peer_sends() -> None:
    recent = RecentEvents(size=50)
    log = EventLog(recent=recent)
    for n in range(200):
        log.emit("nack", stream=n, node="n" * 100_000, error="<b>" * 30_000, resource_names=["x" * 500] * 1_000)
    assert len(recent) == 50 and recent.last == 200
    assert [seq for seq, _ in recent] == list(range(151, 201))  # the latest, in order
    for _, line in recent:
        assert len(line) <= RECENT_LINE
        event = json.loads(line)
        assert event["event"] == "nack" and event["resource_names_omitted"] > 0
        assert event["error"].startswith("<b><b>")  # shortened, not dropped: its start and its end
    # Values that are not strings or lists (a map of many node groups) cannot break the bound either.
    log.emit("snapshot_loaded", version="v9", groups={f"group-{n}": "v9" * 10 for n in range(5_000)})
    _, line = list(recent)[-1]
    assert len(line) <= RECENT_LINE and json.loads(line)["version"] == "v9"


def test_since_answers_what_came_after_a_sequence_number_the_latest_first_when_limited() -> None:
    recent = RecentEvents(size=5)
    for n in range(8):
        recent.add({"ts": 1.0, "event": "snapshot_loaded", "version": str(n)})
    assert [seq for seq, _ in recent.since(0)] == [4, 5, 6, 7, 8]  # 1-3 fell out
    assert [seq for seq, _ in recent.since(6)] == [7, 8]
    assert [seq for seq, _ in recent.since(0, limit=2)] == [7, 8]
    assert recent.since(8) == [] and recent.since(100) == []
    with pytest.raises(ValueError, match="at least one"):
        RecentEvents(size=0)


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
    assert big["error"].endswith(reason[-MAX_FIELD // 4 :]) and f"{len(nack):,} characters" in big["error"]
    assert big["resource_names"] == names[:MAX_ITEMS] and big["resource_names_omitted"] == 100_000 - MAX_ITEMS
    assert small["node"] == "edge-1" and small["resource_names"] == ["a", "b"]  # a usual line is untouched


TABLE = Path(__file__).resolve().parents[2] / "docs" / "operations.md"


def _table() -> dict[str, str]:
    """docs/operations.md's event table: event name -> its fields column."""
    text = TABLE.read_text()
    start = text.index("## The event log")
    end = text.find("\n## ", start + 1)
    section = text[start : end if end >= 0 else len(text)]
    rows = {}
    for line in section.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0].startswith("`"):
            for name in re.findall(r"`([a-z_]+)`", cells[0]):
                rows[name] = cells[2]
    return rows


def test_the_readme_table_documents_every_event_and_no_other() -> None:
    documented = set(_table())
    assert documented - set(EVENTS) == set(), "docs/operations.md documents events pilotfish does not write"
    assert set(EVENTS) - documented == set(), "events missing from docs/operations.md's table"


def test_the_readme_table_names_every_field_of_each_event() -> None:
    table = _table()
    for name, spec in EVENTS.items():
        column = table[name]
        inherited = re.match(r"as `([a-z_]+)`", column)
        named = set(re.findall(r"`([a-z_]+)`", column))
        if inherited:
            named |= set(re.findall(r"`([a-z_]+)`", table[inherited.group(1)]))
        assert spec.fields <= named, f"docs/operations.md's row of {name!r} does not name {sorted(spec.fields - named)}"


def test_records_outside_the_contract_are_caught(tmp_path: Path) -> None:
    assert contract_problems({"ts": 1.0, "event": "sent", "stream": 1, "node": "a", "resources": 2}) == []
    assert contract_problems({"ts": 1.0, "event": "sent", "names": ["x"], "names_omitted": 5}) == []
    assert contract_problems({"ts": 1.0, "event": "snet"}) == ["unknown event 'snet'"]
    assert contract_problems({"ts": 1.0, "event": "sent", "colour": "red"}) == [
        "event 'sent' has fields not in its contract: ['colour']"
    ]
    log = tmp_path / "events.jsonl"
    log.write_bytes(b'{"ts": 1, "event": "server_stopped"}\n{"ts": 2, "event": "nope"}\n{"ts": 3, "ev')
    assert check_event_log(log) == [f"{log}:2: unknown event 'nope'"], "a half-written last line is not read"
