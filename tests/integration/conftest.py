"""Fixtures of the integration tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from pilotfish.events import check_event_log


@pytest.fixture(autouse=True)
def event_log_contract(request: pytest.FixtureRequest) -> Iterator[None]:
    """After each test: every event the in-process servers wrote is one of
    ``pilotfish.events.EVENTS``, with only the fields the contract names."""
    if "tmp_path" not in request.fixturenames:
        yield
        return
    tmp_path: Path = request.getfixturevalue("tmp_path")  # now: it must outlive this fixture
    yield
    problems = [p for log in sorted(tmp_path.rglob("*.jsonl")) for p in check_event_log(log)]
    assert not problems, "the event log broke its contract:\n" + "\n".join(problems[:20])
