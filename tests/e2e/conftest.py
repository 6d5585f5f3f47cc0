"""Fixtures of the end-to-end tests: real processes in the test's temp dir, on OS-chosen ports."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from pilotfish.events import check_event_log

from .browser import Browser, chromium_binary
from .processes import ProcessGroup, envoy_binary
from .testbed import Testbed

HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test of tests/e2e carries the ``e2e`` marker (``-m "not e2e"`` leaves out what starts
    real Envoys, etcd or pilotfish processes), whether or not its module says ``pytestmark``.
    The hook sees the whole session's items: only those collected from this folder are marked."""
    for item in items:
        if item.path.is_relative_to(HERE):
            item.add_marker(pytest.mark.e2e)


@pytest.fixture(autouse=True)
def event_log_contract(request: pytest.FixtureRequest) -> Iterator[None]:
    """After each test: every event its servers wrote is one of ``pilotfish.events.EVENTS``, with
    only the fields the contract names (README's table documents the same)."""
    if "tmp_path" not in request.fixturenames:
        yield
        return
    tmp_path: Path = request.getfixturevalue("tmp_path")  # now: it must outlive this fixture
    yield
    problems = [p for log in sorted(tmp_path.rglob("*.jsonl")) for p in check_event_log(log)]
    assert not problems, "the event log broke its contract:\n" + "\n".join(problems[:20])


@pytest.fixture
def processes(tmp_path: Path) -> Iterator[ProcessGroup]:
    """Every process the test starts; killed by PID and reaped at teardown."""
    group = ProcessGroup(tmp_path)
    try:
        yield group
    finally:
        group.close()


@pytest.fixture
def testbed(processes: ProcessGroup) -> Testbed:
    """Upstreams started, nothing else yet: the test calls ``testbed.start(...)``."""
    envoy_binary()  # fail before starting anything when Envoy is not installed
    return Testbed.create(processes)


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[Browser]:
    """A real headless Chromium, driven over the DevTools protocol; closed at teardown."""
    chromium_binary()  # fail before starting anything when Chromium is not installed
    started = Browser.start(tmp_path)
    try:
        yield started
    finally:
        started.close()
