"""The shared Envoy launcher (``pilotfish.envoy``) with a real Envoy: what the demo, these tests and
bench rely on when they start one.

- Two Envoys started at once each pick their own base id and admin port (parallel runs never
  collide), and stopping one (by PID) removes its shared memory and leaves the other's.
- An Envoy that cannot start fails the wait at once with its log's reason, not after the timeout.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest

from pilotfish.envoy import EnvoyError, EnvoySettings, envoy_shared_memory_files, start_envoy

from .processes import envoy_binary, pilotfish

pytestmark = pytest.mark.e2e


def _bootstrap(node: str) -> dict[str, Any]:
    return {
        "node": {"id": node, "cluster": "e2e"},
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": 0}}},
    }


def test_two_envoys_each_clean_up_their_own_shared_memory(tmp_path: Path) -> None:
    binary = envoy_binary()
    first = start_envoy(_bootstrap("a"), EnvoySettings(work_dir=tmp_path, name="a", concurrency=1, binary=binary))
    second = start_envoy(_bootstrap("b"), EnvoySettings(work_dir=tmp_path, name="b", concurrency=1, binary=binary))
    try:
        addresses = {first.wait_for_admin(timeout=20), second.wait_for_admin(timeout=20)}
        assert len(addresses) == 2, "each Envoy has an admin port of its own"
        assert first.admin_get("/ready")[0] == 200
        assert first.base_id is not None and second.base_id is not None and first.base_id != second.base_id
        assert envoy_shared_memory_files(first.base_id) and envoy_shared_memory_files(second.base_id)

        first.stop()
        assert not first.alive()
        assert not envoy_shared_memory_files(first.base_id)
        assert envoy_shared_memory_files(second.base_id), "another Envoy's shared memory stays"
        assert second.alive() and second.admin_get("/ready")[0] == 200
    finally:
        first.stop()
        second.stop()
    assert not envoy_shared_memory_files(second.base_id)


def test_an_envoy_that_cannot_start_fails_the_wait_with_its_reason(tmp_path: Path) -> None:
    bad = _bootstrap("c") | {"static_resources": {"clusters": [{"name": "x", "type": "NO_SUCH_TYPE"}]}}
    envoy = start_envoy(bad, EnvoySettings(work_dir=tmp_path, name="bad", binary=envoy_binary()))
    try:
        with pytest.raises(EnvoyError, match=r"(?s)bad \(pid \d+\) exited \(code \d+\).*NO_SUCH_TYPE"):
            envoy.wait_for_admin(timeout=60)
    finally:
        envoy.stop()


@pytest.mark.parametrize("node_id", ["n", "Y", "on", "null", "0x1F", "edge-1"])
def test_envoy_takes_every_node_id_pilotfish_bootstrap_writes_as_a_string(tmp_path: Path, node_id: str) -> None:
    """Envoy's YAML parser reads ``n``, ``y``, ``on``, ``null`` ... bare as booleans and nulls
    (YAML 1.1): ``pilotfish bootstrap`` must quote them, or Envoy refuses the bootstrap."""
    path = tmp_path / "bootstrap.yaml"
    path.write_text(pilotfish("bootstrap", "--node-id", node_id).stdout)
    checked = subprocess.run(
        [envoy_binary(), "--mode", "validate", "-c", str(path), "--use-dynamic-base-id"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
