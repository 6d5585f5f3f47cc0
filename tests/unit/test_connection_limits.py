"""Connection caps of the xDS server (ConnectionLimits): defaults from the open-file limit."""

from __future__ import annotations

import pytest

from pilotfish.transport.aio import ConnectionLimits


@pytest.mark.parametrize(("descriptors", "total", "per_address"), [
    (1024, 896, 448),  # the usual soft limit: 128 kept for the process, one address half of the rest
    (20_000, 18_000, 4096),
    (1 << 20, 943_719, 4096),  # a tenth kept
    (200, 100, 50),  # a tiny limit: half of it, never less
])
def test_default_caps_leave_descriptors_for_the_process_and_no_address_takes_all(
    descriptors: int, total: int, per_address: int
) -> None:
    assert ConnectionLimits().caps(descriptors) == (total, per_address)


def test_given_caps_are_kept() -> None:
    limits = ConnectionLimits(max_connections=10, max_connections_per_address=10)
    assert limits.caps(1024) == (10, 10)
    assert ConnectionLimits(max_connections=10).caps(1 << 20) == (10, 5)
    assert ConnectionLimits(max_connections_per_address=10_000).caps(1024) == (896, 10_000)
