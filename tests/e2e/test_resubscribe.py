"""A real Envoy, under wrk load, gets back a listener's routes and a cluster's endpoints at once
when they are removed and restored after pilotfish restarted.

The restart story: pilotfish restarts; Envoy reconnects at its current versions and is rightly
sent nothing. A listener then goes away and comes back: Envoy asks again for its route
configuration, at the same version (versions are content hashes, and the routes did not change),
with no nonce yet on that stream. That request must be answered at once: otherwise the listener
waits out Envoy's 15 s initial fetch timeout and then serves 404 for every request. Likewise a
cluster removed and restored must get its (unchanged) endpoints at once, or it warms for 15 s and
then has no endpoints (503).

The snapshot here has a second listener, ``side`` (its own route configuration ``side_route``),
and a third cluster, ``spare`` (routed from ``side`` at ``/spare``). Removing ``side`` keeps
``side_route``; removing ``spare`` keeps its endpoints: only the subscriptions change, never the
versions of the routes or endpoints. Load runs on the main listener throughout (it must never
fail), and on the restored listener and cluster once Envoy shows them active.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from .event_log import EDS, RDS, TYPE_URLS, Event, EventLog, is_event, short_type
from .processes import Envoy, ProcessGroup, free_port, http_get, wait_until
from .testbed import Testbed, wait_for_acks
from .wrk import Wrk, WrkResult, wrk_binary

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

NODE = "edge-1"
SIDE = "side"
SIDE_ROUTE = "side_route"
SPARE = "spare"

APPLY_TIMEOUT_S = 10.0
"""How long a restored listener or cluster may take to serve: a debounce (at most 1 s), a push
and Envoy applying it take well under 2 s on a busy machine. Below Envoy's 15 s initial fetch
timeout, so an unanswered request fails the wait instead of passing after the timeout."""
LOAD_S = 120
"""The longest the main listener's load run may take: long enough for the restart and both
remove/restore rounds on a busy machine; it is ended once they are done."""
CHECK_LOAD_S = 3
"""The load run on the restored listener and cluster."""

_HCM = "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"
_ROUTER = "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"


# -- the snapshot ---------------------------------------------------------------------------------


def _address(port: int) -> dict[str, Any]:
    return {"socket_address": {"address": "127.0.0.1", "port_value": port}}


def _ads() -> dict[str, Any]:
    return {"ads": {}, "resource_api_version": "V3"}


def _listener(name: str, port: int, route_name: str) -> dict[str, Any]:
    return {
        "name": name,
        "address": _address(port),
        "filter_chains": [
            {
                "filters": [
                    {
                        "name": "envoy.filters.network.http_connection_manager",
                        "typed_config": {
                            "@type": _HCM,
                            "stat_prefix": name,
                            "rds": {"route_config_name": route_name, "config_source": _ads()},
                            "http_filters": [{"name": "envoy.filters.http.router", "typed_config": {"@type": _ROUTER}}],
                        },
                    }
                ]
            }
        ],
    }


def _route(name: str, routes: list[tuple[str, str]]) -> dict[str, Any]:
    return {
        "name": name,
        "virtual_hosts": [
            {
                "name": "all",
                "domains": ["*"],
                "routes": [
                    {"match": {"prefix": prefix}, "route": {"cluster": cluster, "prefix_rewrite": "/"}}
                    for prefix, cluster in routes
                ],
            }
        ],
    }


def document(testbed: Testbed, side_port: int, *, side: bool = True, spare: bool = True) -> dict[str, Any]:
    """The snapshot, without a version (versions are content hashes).

    ``side=False`` removes listener ``side`` but keeps its route configuration; ``spare=False``
    removes cluster ``spare`` and the route to it, but keeps its endpoints.
    """
    ports = {name: upstream.port for name, upstream in testbed.upstreams.items()}
    endpoints = {"web": [ports["web-a"], ports["web-b"]], "api": [ports["api"]], SPARE: [ports["web-a"]]}
    clusters = ["web", "api", *([SPARE] if spare else [])]
    side_routes = [*([("/spare", SPARE)] if spare else []), ("/", "api")]
    return {
        "clusters": [
            {"name": name, "type": "EDS", "connect_timeout": "1s", "eds_cluster_config": {"eds_config": _ads()}}
            for name in clusters
        ],
        "endpoints": [
            {
                "cluster_name": name,
                "endpoints": [{"lb_endpoints": [{"endpoint": {"address": _address(port)}} for port in upstream_ports]}],
            }
            for name, upstream_ports in endpoints.items()
        ],
        "listeners": [
            _listener("ingress", testbed.listener_port, "local_route"),
            *([_listener(SIDE, side_port, SIDE_ROUTE)] if side else []),
        ],
        "routes": [_route("local_route", [("/", "web")]), _route(SIDE_ROUTE, side_routes)],
    }


def write(path: Path, doc: dict[str, Any]) -> None:
    """Replace the snapshot file by rename, as a deploy tool would."""
    temp = path.with_name(f".{path.name}.tmp")
    temp.write_text(yaml.safe_dump(doc, sort_keys=False))
    os.replace(temp, path)


# -- what Envoy shows -----------------------------------------------------------------------------


def listener_names(envoy: Envoy) -> set[str]:
    """Names of the listeners Envoy has (active, warming or draining), from /listeners."""
    data = json.loads(envoy.admin("/listeners?format=json"))
    return {status["name"] for status in data.get("listener_statuses", [])}


def cluster_names(envoy: Envoy) -> set[str]:
    """Names of the clusters Envoy has made active, from /clusters."""
    data = json.loads(envoy.admin("/clusters?format=json"))
    return {status["name"] for status in data.get("cluster_statuses", [])}


def get(port: int, path: str) -> tuple[int, str]:
    return http_get(f"http://127.0.0.1:{port}{path}", timeout=5)


def requested_names(events: EventLog, type_url: str, names: list[str], *, after: int, what: str) -> Event:
    """Wait for a request (or ACK/NACK) from Envoy naming exactly ``names`` of ``type_url``."""
    return events.wait_for(
        lambda e: (
            e.get("event") in ("request", "ack", "nack")
            and e.get("node") == NODE
            and e.get("type") == type_url
            and sorted(e.get("resource_names") or []) == sorted(names)
            and "resource_names" in e
        ),
        what=what,
        after=after,
        timeout=APPLY_TIMEOUT_S,
    )


def check_clean(result: WrkResult, label: str) -> None:
    print(f"\n{label}: {result.summary()}")
    problems = result.problems()
    assert not problems, f"{label}: {'; '.join(problems)}\n{result.output}"


# -- the test -------------------------------------------------------------------------------------


def test_restored_listener_and_cluster_are_served_at_once_after_a_restart(
    testbed: Testbed, processes: ProcessGroup
) -> None:
    wrk_binary()
    side_port = free_port()
    control_plane = testbed.control_plane
    write(testbed.snapshot_path, document(testbed, side_port))
    control_plane.start()
    envoy = testbed.start_envoy(node_id=NODE)
    wait_for_acks(control_plane.events, node=NODE, what="the first configuration")
    wait_until(
        lambda: get(side_port, "/spare")[0] == 200 and get(testbed.listener_port, "/")[0] == 200,
        timeout=APPLY_TIMEOUT_S,
        what="both listeners and every cluster to serve",
        details=envoy.log_tail,
    )
    before = {t: control_plane.events.select(is_event("ack", node=NODE, type=t))[-1]["version_info"] for t in TYPE_URLS}

    main_load = Wrk.start(processes, f"http://127.0.0.1:{testbed.listener_port}/", duration_s=LOAD_S, connections=20)
    envoy.wait_for_more("http.ingress.downstream_rq_completed", at_least=100, timeout=10)

    # pilotfish restarts; Envoy reconnects at the versions it has and is sent nothing.
    control_plane.stop()
    wait_until(
        lambda: envoy.stat("control_plane.connected_state") == 0, timeout=10, what="Envoy to see the control plane gone"
    )
    events = control_plane.start()
    events.wait_for(is_event("stream_open", node=NODE), what="Envoy's new stream", timeout=APPLY_TIMEOUT_S)
    for type_url in TYPE_URLS:
        request = events.wait_for(
            is_event("request", node=NODE, type=type_url),
            timeout=APPLY_TIMEOUT_S,
            what=f"Envoy's reconnect request for {short_type(type_url)}",
        )
        assert request["version_info"] == before[type_url], "Envoy reconnects with the versions it has"
    wait_until(lambda: envoy.stat("control_plane.connected_state") == 1, timeout=10, what="Envoy to be connected again")

    # A listener goes away: Envoy drops its route configuration (unsubscribes) ...
    mark = events.mark()
    write(testbed.snapshot_path, document(testbed, side_port, side=False))
    wait_until(
        lambda: SIDE not in listener_names(envoy),
        timeout=APPLY_TIMEOUT_S,
        what=f"Envoy to remove listener {SIDE}",
        details=lambda: events.describe(after=mark),
    )
    requested_names(events, RDS, ["local_route"], after=mark, what=f"Envoy to unsubscribe from {SIDE_ROUTE}")

    # ... and comes back: Envoy asks for the same route configuration, at the same version.
    mark, written = events.mark(), time.monotonic()
    write(testbed.snapshot_path, document(testbed, side_port))
    wait_until(
        lambda: get(side_port, "/")[0] == 200,
        timeout=APPLY_TIMEOUT_S,
        what=f"the restored listener {SIDE} to route requests",
        details=lambda: events.describe(after=mark) + "\n" + envoy.log_tail(),
    )
    print(f"\nlistener {SIDE} restored and routing {time.monotonic() - written:.2f} s after the file was written")
    routes = events.wait_for(is_event("sent", node=NODE, type=RDS), what="the routes sent again", after=mark)
    assert routes["version"] == before[RDS] and routes["resources"] == 2, (
        "the unchanged route configurations, both, at their unchanged version"
    )
    assert envoy.stat(f"http.{SIDE}.rds.{SIDE_ROUTE}.init_fetch_timeout") == 0
    side_load = Wrk.start(processes, f"http://127.0.0.1:{side_port}/", duration_s=CHECK_LOAD_S, connections=10)
    check_clean(side_load.result(), f"restored listener {SIDE}")

    # A cluster goes away (with the route to it): Envoy unsubscribes from its endpoints ...
    mark = events.mark()
    write(testbed.snapshot_path, document(testbed, side_port, spare=False))
    wait_until(
        lambda: SPARE not in cluster_names(envoy),
        timeout=APPLY_TIMEOUT_S,
        what=f"Envoy to remove cluster {SPARE}",
        details=lambda: events.describe(after=mark),
    )
    requested_names(events, EDS, ["api", "web"], after=mark, what=f"Envoy to unsubscribe from {SPARE}'s endpoints")

    # ... and comes back: its endpoints (unchanged) must arrive at once.
    mark, written = events.mark(), time.monotonic()
    write(testbed.snapshot_path, document(testbed, side_port))
    wait_until(
        lambda: get(side_port, "/spare")[0] == 200,
        timeout=APPLY_TIMEOUT_S,
        what=f"the restored cluster {SPARE} to serve",
        details=lambda: events.describe(after=mark) + "\n" + envoy.log_tail(),
    )
    print(f"\ncluster {SPARE} restored and serving {time.monotonic() - written:.2f} s after the file was written")
    endpoints = events.wait_for(is_event("sent", node=NODE, type=EDS), what="the endpoints sent again", after=mark)
    assert endpoints["version"] == before[EDS] and endpoints["resources"] == 3, (
        "every endpoint assignment, at its unchanged version"
    )
    assert envoy.stat(f"cluster.{SPARE}.init_fetch_timeout") == 0
    spare_load = Wrk.start(processes, f"http://127.0.0.1:{side_port}/spare", duration_s=CHECK_LOAD_S, connections=10)
    check_clean(spare_load.result(), f"restored cluster {SPARE}")

    assert main_load.running(), "the restart and the changes took longer than the main load run"
    check_clean(main_load.stop(), "main listener across the restart and every change")
    assert not events.select(is_event("nack")), "Envoy rejected nothing"
