"""Fixtures of the end-to-end tests: real processes in the test's temp dir, on OS-chosen ports."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from .processes import ProcessGroup, envoy_binary
from .testbed import Testbed


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
