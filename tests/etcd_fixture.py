"""The ``etcd`` fixture, for every kind of test: a pytest plugin (``-p etcd_fixture`` in pyproject.toml's
``addopts``), so a test asks for ``etcd`` by name wherever it is."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[str]:
    """A real etcd member's client address (``host:port``), started by the launcher of tests/e2e on
    OS-picked ports in the test's temp dir, and stopped by PID at teardown. Tests using it carry
    the ``e2e`` marker: they need the etcd binary."""
    from e2e.etcd import Etcd
    from e2e.processes import ProcessGroup

    group = ProcessGroup(tmp_path)
    try:
        yield Etcd.start(group).address
    finally:
        group.close()
