"""Runtime layers (RTDS) with a real Envoy, over state of the world and delta.

The snapshot file's ``runtime`` section holds a layer ``flags`` whose key sets the abort
percentage of the listener's HTTP fault filter; Envoy asks for the layer by name
(``pilotfish bootstrap --runtime-layer flags``). At 100 every request through the listener is
aborted with 503, at 0 none is, under wrk: the key takes effect without any listener change.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from .event_log import TYPE_URLS, is_event
from .processes import ProcessGroup, wait_until
from .snapshot_file import snapshot_document, write_document
from .testbed import Testbed, wait_for_acks
from .wrk import Wrk

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

KEY = "pilotfish_e2e.abort_percent"
RTDS = "type.googleapis.com/envoy.service.runtime.v3.Runtime"
_FAULT = "type.googleapis.com/envoy.extensions.filters.http.fault.v3.HTTPFault"


def document(bed: Testbed, percent: int) -> dict[str, Any]:
    doc = snapshot_document(
        listener_port=bed.listener_port,
        endpoints={
            "web": [bed.upstreams[name].port for name in ("web-a", "web-b")],
            "api": [bed.upstreams["api"].port],
        },
    )
    doc["version"] = f"abort-{percent}"
    manager = doc["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    manager["http_filters"].insert(
        0,
        {
            "name": "envoy.filters.http.fault",
            "typed_config": {
                "@type": _FAULT,
                "abort": {"http_status": 503, "percentage": {"numerator": 0, "denominator": "HUNDRED"}},
                "abort_percent_runtime": KEY,
            },
        },
    )
    doc["runtime"] = {"flags": {KEY: percent, "pilotfish_e2e": {"note": "set by the snapshot file"}}}
    return doc


def runtime_value(bed: Testbed, key: str) -> str | None:
    entries = json.loads(bed.envoys[0].admin("/runtime"))["entries"]
    entry = entries.get(key)
    return None if entry is None else str(entry.get("final_value"))


@pytest.mark.parametrize("variant", ["sotw", "delta"])
def test_a_runtime_key_in_the_snapshot_file_reaches_envoy_and_takes_effect(
    processes: ProcessGroup, variant: str
) -> None:
    bed = Testbed.create(processes)
    write_document(bed.snapshot_path, document(bed, 100))
    bed.control_plane.start()
    options = ("--runtime-layer", "flags", *(("--delta",) if variant == "delta" else ()))
    envoy = bed.start_envoy(bootstrap_options=options)
    wait_for_acks(bed.events, node="edge-1", what="Envoy's configuration", types=(*TYPE_URLS, RTDS))
    wait_until(
        lambda: runtime_value(bed, KEY) == "100",
        timeout=15,
        what=f"Envoy's /runtime to show {KEY} = 100",
        details=envoy.log_tail,
    )
    assert runtime_value(bed, "pilotfish_e2e.note") == "set by the snapshot file"  # nested keys join with dots
    wait_until(lambda: bed.request("/direct")[0] == 503, timeout=10, what="the listener to abort requests")
    aborted = Wrk.start(processes, f"http://127.0.0.1:{bed.listener_port}/direct", duration_s=2).result()
    assert aborted.requests > 0 and aborted.non_2xx_3xx == aborted.requests, aborted.summary()

    mark = len(bed.events.read())
    write_document(bed.snapshot_path, document(bed, 0))
    bed.events.wait_for(is_event("ack", node="edge-1", type=RTDS), what="the new layer's ACK", after=mark)
    wait_until(lambda: runtime_value(bed, KEY) == "0", timeout=10, what=f"Envoy's /runtime to show {KEY} = 0")
    served = Wrk.start(processes, f"http://127.0.0.1:{bed.listener_port}/direct", duration_s=2).result()
    assert served.requests > 0 and not served.problems(), served.summary()
    # Only the runtime layer changed: Envoy was not sent a listener again.
    assert not [e for e in bed.events.read()[mark:] if is_event("sent", node="edge-1")(e) and e.get("type") != RTDS]
