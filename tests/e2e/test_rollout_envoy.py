"""Progressive delivery with real Envoys under real load (wrk): ``serve --rollout 'canary=c-*,100%'``.

Three Envoys report their load over LRS (``pilotfish bootstrap --lrs``); ``c-1`` is the canary.
Each has a static listener of its own (its route table, clusters and endpoints come over ADS), so
the test can load each proxy apart. Three changes, each valid to pilotfish's checks:

1. a route whose RE2 pattern does not compile: the canary NACKs it, it is rolled back and held,
   and the other Envoys are never sent it;
2. a good change (a route timeout) under load: it reaches the canary, then everyone; not one
   request fails, and ``pilotfish wait`` returns 0;
3. a route that rewrites every request to an upstream path answering 503: the canary ACKs it, and
   its load reports show the errors, so the health gate fails the canary's wave and rolls it back
   before any other Envoy is sent it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import yaml

from .event_log import RDS, Event, EventLog
from .processes import Envoy, ProcessGroup, free_port, http_get, pilotfish, wait_until
from .testbed import Testbed
from .wrk import Wrk

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

_HCM = "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"
_ROUTER = "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"
_ADS = {"ads": {}, "resource_api_version": "V3"}
FLEET = ("c-1", "p-1", "p-2")
GOOD = {"match": {"prefix": "/"}, "route": {"cluster": "web"}}


def document(web_port: int, *routes: dict[str, Any]) -> dict[str, Any]:
    return {
        "clusters": [
            {"name": "web", "type": "EDS", "connect_timeout": "1s", "eds_cluster_config": {"eds_config": _ADS}}
        ],
        "endpoints": [
            {
                "cluster_name": "web",
                "endpoints": [
                    {
                        "lb_endpoints": [
                            {
                                "endpoint": {
                                    "address": {"socket_address": {"address": "127.0.0.1", "port_value": web_port}}
                                }
                            }
                        ]
                    }
                ],
            }
        ],
        "routes": [{"name": "local", "virtual_hosts": [{"name": "all", "domains": ["*"], "routes": list(routes)}]}],
    }


def own_listener(port: int) -> Callable[[dict[str, Any]], None]:
    """A bootstrap edit: a static listener on ``port`` whose routes come over ADS (route ``local``)."""

    def edit(bootstrap: dict[str, Any]) -> None:
        hcm = {
            "@type": _HCM,
            "stat_prefix": "own",
            "rds": {"route_config_name": "local", "config_source": _ADS},
            "http_filters": [{"name": "envoy.filters.http.router", "typed_config": {"@type": _ROUTER}}],
        }
        listener = {
            "name": "own",
            "address": {"socket_address": {"address": "127.0.0.1", "port_value": port}},
            "filter_chains": [
                {"filters": [{"name": "envoy.filters.network.http_connection_manager", "typed_config": hcm}]}
            ],
        }
        bootstrap.setdefault("static_resources", {}).setdefault("listeners", []).append(listener)

    return edit


def serving(port: int) -> Callable[[], bool]:
    return lambda: http_get(f"http://127.0.0.1:{port}/")[0] == 200


def rds_sent_to(events: EventLog, node: str, *, after: int) -> list[Event]:
    return events.select(lambda e: e["event"] == "sent" and e.get("node") == node and e.get("type") == RDS, after=after)


def kinds(events: EventLog, *, after: int) -> list[str]:
    return [e["event"] for e in events.read()[after:] if e["event"].startswith("rollout_")]


def load(group: ProcessGroup, ports: dict[str, int], seconds: int) -> dict[str, Wrk]:
    return {
        node: Wrk.start(group, f"http://127.0.0.1:{port}/", duration_s=seconds, threads=1, connections=4)
        for node, port in ports.items()
    }


def test_a_bad_change_stops_at_the_canary_and_a_good_one_reaches_everyone(testbed: Testbed) -> None:
    web = testbed.upstreams["web-a"].port
    testbed.snapshot_path.write_text(yaml.safe_dump(document(web, GOOD)))
    plane = testbed.control_plane
    plane.options = (
        "--rollout", "canary=c-*,100%",
        "--rollout-bake", "4",
        "--rollout-ack-timeout", "20",
        "--rollout-min-requests", "50",
        "--lrs-interval-ms", "500",
        "--quiet-ms", "50",
    )  # fmt: skip
    plane.start()
    ports = {node: free_port() for node in FLEET}
    envoys: dict[str, Envoy] = {
        node: testbed.start_envoy(
            name=node, node_id=node, bootstrap_options=("--lrs",), bootstrap_edit=own_listener(ports[node])
        )
        for node in FLEET
    }
    for node, port in ports.items():
        wait_until(
            serving(port),
            timeout=20,
            what=f"{node} to serve through its own listener",
            details=envoys[node].log_tail,
        )
    events = plane.events
    events.wait_for(lambda e: e["event"] == "rollout_baseline_set", what="the first snapshot as the baseline")

    # 1. A route Envoy rejects (RE2 does not compile "(("): the canary NACKs it; nobody else gets it.
    mark = events.mark()
    broken = {"match": {"safe_regex": {"regex": "(("}}, "route": {"cluster": "web"}}
    testbed.snapshot_path.write_text(yaml.safe_dump(document(web, broken, GOOD)))
    rolled = events.wait_for(lambda e: e["event"] == "rollout_rolled_back", after=mark, what="the NACK's rollback")
    failed = events.wait_for(lambda e: e["event"] == "rollout_failed", after=mark, what="the failed gate")
    assert failed["wave"] == "canary" and "c-1 NACKed RDS" in failed["reason"], failed
    assert rolled["proxies"] == 1
    assert kinds(events, after=mark) == [
        "rollout_started",
        "rollout_wave_started",
        "rollout_failed",
        "rollout_rolled_back",
    ]
    for node in ("p-1", "p-2"):
        assert rds_sent_to(events, node, after=mark) == [], f"{node} was sent the candidate"
    assert all(http_get(f"http://127.0.0.1:{port}/")[0] == 200 for port in ports.values())

    # 2. A good change under load: canary first, then everyone, and not one request fails.
    mark = events.mark()
    running = load(testbed.group, ports, 14)
    testbed.snapshot_path.write_text(
        yaml.safe_dump(document(web, {**GOOD, "route": {"cluster": "web", "timeout": "7s"}}))
    )
    waited = pilotfish("wait", "--admin", plane.admin, "--timeout", "60", check=False, timeout=90)
    assert waited.returncode == 0, waited.stdout + waited.stderr
    events.wait_for(
        lambda e: e["event"] == "rollout_completed", after=mark, what="the good change's rollout", timeout=60
    )
    started = [e["wave"] for e in events.select(lambda e: e["event"] == "rollout_wave_started", after=mark)]
    assert started == ["canary", "100%"]
    first_to = {node: events.index_of(rds_sent_to(events, node, after=mark)[0]) for node in FLEET}
    canary_passed = events.wait_for(lambda e: e["event"] == "rollout_wave_passed", after=mark, what="the canary's pass")
    assert first_to["c-1"] < events.index_of(canary_passed) < min(first_to["p-1"], first_to["p-2"])
    for node, wrk in running.items():
        result = wrk.result()
        assert not result.problems(), f"{node}: {result.summary()}"

    # 3. A route to a failure: the canary ACKs it, its load reports show 503s, its wave fails.
    mark = events.mark()
    running = load(testbed.group, ports, 14)
    failing = {"match": {"prefix": "/"}, "route": {"cluster": "web", "prefix_rewrite": "/status/503"}}
    testbed.snapshot_path.write_text(yaml.safe_dump(document(web, failing)))
    failed = events.wait_for(
        lambda e: e["event"] == "rollout_failed", after=mark, what="the health gate to fail the canary", timeout=40
    )
    assert failed["wave"] == "canary" and "error ratio" in failed["reason"], failed
    events.wait_for(lambda e: e["event"] == "rollout_rolled_back", after=mark, what="the rollback")
    assert "rollout_wave_acked" in kinds(events, after=mark)  # it was ACKed: only the load showed it
    for node in ("p-1", "p-2"):
        assert rds_sent_to(events, node, after=mark) == [], f"{node} was sent the failing route"
        result = running[node].result()
        assert not result.problems(), f"{node}: {result.summary()}"
    running["c-1"].result()  # (the canary served the failures until its wave was rolled back)
    wait_until(
        serving(ports["c-1"]),
        timeout=20,
        what="the canary to serve again after the rollback",
    )
