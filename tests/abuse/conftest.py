"""Fixtures of the abuse tests: a ``pilotfish serve`` under attack, with a good client beside it."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from .target import Target

StartTarget = Callable[..., Target]


@pytest.fixture
def start_target(tmp_path: Path) -> Iterator[StartTarget]:
    """Start a server of the test's own (options as :class:`Target`'s); stopped at teardown."""
    started: list[Target] = []

    def start(**options: object) -> Target:
        target = Target(tmp_path / f"server{len(started)}", **options)  # type: ignore[arg-type]
        started.append(target)
        return target.start()

    try:
        yield start
    finally:
        for target in started:
            target.stop()


@pytest.fixture
def target(start_target: StartTarget) -> Target:
    """A fresh server: for attacks whose memory and CPU are measured."""
    return start_target()


@pytest.fixture(scope="module")
def _shared() -> Iterator[list[Target]]:
    servers: list[Target] = []
    try:
        yield servers
    finally:
        for server in servers:
            server.stop()


@pytest.fixture
def shared_target(_shared: list[Target], tmp_path_factory: pytest.TempPathFactory) -> Target:
    """A server shared by the cheap protocol-rule tests of a module: started again when the
    previous test left it dead, with a traceback, or bigger."""
    if not _shared or not _shared[-1].healthy():
        if _shared:
            _shared[-1].stop()
        _shared.append(Target(tmp_path_factory.mktemp("shared-server")).start())
    return _shared[-1].begin()
