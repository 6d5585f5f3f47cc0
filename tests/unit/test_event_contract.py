"""The event log's contract: ``pilotfish.events.EVENTS`` names every event and its fields, docs/operations.md's
table documents exactly those, and a record with an unknown event or field is caught."""

from __future__ import annotations

import re
from pathlib import Path

from pilotfish.events import EVENTS, check_event_log, contract_problems

TABLE = Path(__file__).resolve().parents[2] / "docs" / "operations.md"


def _table() -> dict[str, str]:
    """docs/operations.md's event table: event name -> its fields column."""
    text = TABLE.read_text()
    start = text.index("## The event log")
    end = text.find("\n## ", start + 1)
    section = text[start:end if end >= 0 else len(text)]
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
        "event 'sent' has fields not in its contract: ['colour']"]
    log = tmp_path / "events.jsonl"
    log.write_bytes(b'{"ts": 1, "event": "server_stopped"}\n{"ts": 2, "event": "nope"}\n{"ts": 3, "ev')
    assert check_event_log(log) == [f"{log}:2: unknown event 'nope'"], "a half-written last line is not read"
