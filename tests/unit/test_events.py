"""The event log: JSON lines, and the ``changes`` level that leaves out the routine conversation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pilotfish.events import CONVERSATION, RECENT_LINE, EventLog, RecentEvents, contract_problems, read_events


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
