"""The etcd client's key arithmetic (pilotfish.etcd.client): the end of a prefix range."""

from __future__ import annotations

from pilotfish.etcd.client import prefix_end


def test_prefix_end() -> None:
    assert prefix_end("/pilotfish/") == "/pilotfish0"
