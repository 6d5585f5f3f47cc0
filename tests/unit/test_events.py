"""The event log: JSON lines, and the ``changes`` level that leaves out the routine conversation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pilotfish.events import CONVERSATION, EventLog, read_events


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
