"""A runtime layer with a TTL, with a real Envoy, over state of the world and delta.

The layer ``gameday`` sets a key with ``ttl: 3s``. While pilotfish serves Envoy, it renews the
TTL (SotW: the layer sent again at the same version; delta: a heartbeat without the resource),
so the key stays however long that is; once pilotfish is stopped, Envoy drops the layer when the
TTL runs out. Envoy learns that it may take TTLs from the node ``pilotfish bootstrap`` writes
(``client_features``); a proxy that announces nothing is sent the layer without a TTL and keeps it.
"""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from .event_log import TYPE_URLS, is_event
from .processes import ProcessGroup, wait_until
from .snapshot_file import snapshot_document, write_document
from .testbed import Testbed, wait_for_acks

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

KEY = "pilotfish_e2e.gameday"
RTDS = "type.googleapis.com/envoy.service.runtime.v3.Runtime"
TTL_S = 3
RESTART_TTL_S = 10
"""The layer's TTL in the restart test: long enough for pilotfish to stop and start again on a
busy machine, and for Envoy's reconnect backoff, before the renewal the old server made last
runs out."""


def document(bed: Testbed, *, ttl_s: int = TTL_S) -> dict[str, Any]:
    doc = snapshot_document(
        listener_port=bed.listener_port,
        endpoints={
            "web": [bed.upstreams[name].port for name in ("web-a", "web-b")],
            "api": [bed.upstreams["api"].port],
        },
    )
    doc["runtime"] = [{"name": "gameday", "layer": {KEY: "on"}, "ttl": f"{ttl_s}s"}]
    return doc


def runtime_value(bed: Testbed) -> str | None:
    entries = json.loads(bed.envoys[0].admin("/runtime"))["entries"]
    entry = entries.get(KEY)
    return None if entry is None else str(entry.get("final_value"))


def refreshes(bed: Testbed, after: int) -> int:
    return sum(1 for e in bed.events.read()[after:] if is_event("sent", node="edge-1", type=RTDS, refresh=True)(e))


def acks(bed: Testbed, after: int) -> int:
    return sum(1 for e in bed.events.read()[after:] if is_event("ack", node="edge-1", type=RTDS)(e))


@pytest.mark.parametrize("variant", ["sotw", "delta"])
def test_a_runtime_layer_with_a_ttl_lives_while_pilotfish_serves_and_expires_after(
    processes: ProcessGroup, variant: str
) -> None:
    bed = Testbed.create(processes)
    write_document(bed.snapshot_path, document(bed))
    bed.control_plane.start()
    options = ("--runtime-layer", "gameday", *(("--delta",) if variant == "delta" else ()))
    envoy = bed.start_envoy(bootstrap_options=options)
    wait_for_acks(bed.events, node="edge-1", what="Envoy's configuration", types=(*TYPE_URLS, RTDS))
    wait_until(
        lambda: runtime_value(bed) == "on", timeout=15, what=f"Envoy's /runtime to show {KEY}", details=envoy.log_tail
    )
    opened = next(e for e in bed.events.read() if is_event("stream_open", node="edge-1")(e))
    assert opened.get("ttls") is True, opened  # the bootstrap's node announces it takes TTLs

    # Kept while pilotfish serves: three refreshes (one every 2 s), each ACKed, span more than
    # the TTL; the key is there at every look meanwhile.
    mark = len(bed.events.read())
    started = time.monotonic()

    missing: list[float] = []

    def renewed_three_times() -> bool:
        if runtime_value(bed) != "on":
            missing.append(time.monotonic() - started)
        return refreshes(bed, mark) >= 3 and acks(bed, mark) >= 3

    wait_until(renewed_three_times, timeout=30, what="three refreshes of the layer, ACKed", details=envoy.log_tail)
    assert not missing, f"{KEY} left Envoy's runtime while pilotfish served it ({missing[0]:.1f}s in)"
    assert time.monotonic() - started > TTL_S
    assert runtime_value(bed) == "on"

    # Gone once pilotfish is: Envoy drops the layer when its TTL runs out.
    bed.control_plane.stop()
    stopped = time.monotonic()
    wait_until(
        lambda: runtime_value(bed) is None,
        timeout=TTL_S + 15,
        what=f"Envoy to drop the layer {TTL_S}s after pilotfish stopped",
        details=envoy.log_tail,
    )
    assert time.monotonic() - stopped >= TTL_S - 2.5  # not before the last refresh's TTL ran out


def test_a_proxy_that_does_not_announce_ttls_keeps_the_layer(processes: ProcessGroup) -> None:
    bed = Testbed.create(processes)
    write_document(bed.snapshot_path, document(bed))
    bed.control_plane.start()

    def without_features(config: dict[str, Any]) -> None:
        config["node"].pop("client_features", None)

    bed.start_envoy(bootstrap_options=("--runtime-layer", "gameday"), bootstrap_edit=without_features)
    wait_for_acks(bed.events, node="edge-1", what="Envoy's configuration", types=(*TYPE_URLS, RTDS))
    wait_until(lambda: runtime_value(bed) == "on", timeout=15, what=f"Envoy's /runtime to show {KEY}")
    opened = next(e for e in bed.events.read() if is_event("stream_open", node="edge-1")(e))
    assert "ttls" not in opened, opened
    bed.control_plane.stop()
    stopped = time.monotonic()
    # It was sent no TTL: the layer stays (looked at until well past the TTL).
    deadline = stopped + 2 * TTL_S
    while time.monotonic() < deadline:
        assert runtime_value(bed) == "on", "the layer expired on a proxy that was sent it without a TTL"
        time.sleep(0.2)


@pytest.mark.parametrize("variant", ["sotw", "delta"])
def test_a_layer_with_a_ttl_outlives_a_restart_of_pilotfish(processes: ProcessGroup, variant: str) -> None:
    """Envoy reconnects to the restarted server holding the current version: it is sent the
    layer again (renewing its TTL) and refreshed from then on, so the layer stays past the TTL
    of the old server's last renewal."""
    bed = Testbed.create(processes)
    write_document(bed.snapshot_path, document(bed, ttl_s=RESTART_TTL_S))
    bed.control_plane.start()
    options = ("--runtime-layer", "gameday", *(("--delta",) if variant == "delta" else ()))
    envoy = bed.start_envoy(bootstrap_options=options)
    wait_until(lambda: runtime_value(bed) == "on", timeout=15, what=f"Envoy's /runtime to show {KEY}")
    # Stopped right after the layer was sent and ACKed: the restart has the whole TTL.
    acked = acks(bed, 0)
    wait_until(lambda: acks(bed, 0) > acked, timeout=2 * RESTART_TTL_S, what="the layer sent again, ACKed")
    renewed = time.monotonic()
    bed.control_plane.stop()
    bed.control_plane.start()  # a new event log: its own conversation
    missing: list[float] = []

    def renewed_by_the_new_server() -> bool:
        if runtime_value(bed) != "on":
            missing.append(time.monotonic() - renewed)
        # Sent on reconnecting and refreshed since, each ACKed; the old renewal has run out.
        return refreshes(bed, 0) >= 1 and acks(bed, 0) >= 2 and time.monotonic() - renewed > RESTART_TTL_S + 1

    wait_until(
        renewed_by_the_new_server, timeout=60, what="the restarted server to renew the layer", details=envoy.log_tail
    )
    assert not missing, f"{KEY} left Envoy's runtime {missing[0]:.1f}s after its last renewal before the restart"
