"""Progressive delivery with real Envoys under real load (wrk): ``serve --rollout 'canary=c-*,100%'``.

Six Envoys report their load over LRS (``pilotfish bootstrap --lrs``); ``c-1`` is the canary. Each
has a static listener of its own whose routes (route table ``edge``), cluster and endpoints come
over ADS, so the test loads each proxy apart. Service ``web`` is defined in the snapshot file and
its instances come from the registry API. Three changes, each valid to pilotfish's checks:

1. a route whose RE2 pattern does not compile: the canary NACKs it, it is rolled back and held, the
   other Envoys are never sent it, ``pilotfish wait`` says so, and an Envoy started afterwards is
   served the baseline;
2. a good change (a route timeout) under load, with an instance deregistered while the canary's
   wave bakes: the endpoint change reaches all six at once, the route change the canary first and
   then everyone; not one request fails, and ``pilotfish wait`` returns 0 once every Envoy has
   ACKed the candidate (their status says so when it returns);
3. a route moved to a new service ``broken`` whose upstream answers 503 to everything: the canary
   ACKs it, its load reports show the errors on the new cluster, which no baseline proxy uses, so
   the health gate judges it against the baseline's overall ratio, fails the canary's wave and
   rolls it back; by the event log's clock the canary is back on the baseline's routes within a
   bake (plus one reporting interval) of ACKing the candidate; no other Envoy is sent it, and
   their load sees no error.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import yaml

from .event_log import EDS, NEW_CLUSTER_JUDGED, RDS, Event, EventLog
from .processes import (
    ControlPlane,
    Envoy,
    ProcessGroup,
    Upstream,
    free_port,
    front_listener,
    http_get,
    http_json,
    pilotfish,
    wait_until,
)
from .registry_client import RegistryClient
from .testbed import WEB, Testbed
from .wrk import Wrk

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

FLEET = ("c-1", "p-1", "p-2", "p-3", "p-4", "p-5")
OTHERS = FLEET[1:]
GOOD = {"match": {"prefix": "/"}, "route": {"cluster": "web"}}
ROUTES = "edge"
"""The route table the test changes, which each Envoy's own listener uses (the service's is ``web``)."""
BAKE = 6.0
LRS_INTERVAL = 0.5


def document(listen: int, *routes: dict[str, Any], more: dict[str, Any] | None = None) -> dict[str, Any]:
    """Service ``web`` (its instances from the registry), the services ``more``, and the route
    table ``edge`` of ``routes``."""
    return {
        "services": {"web": {"listen": f"127.0.0.1:{listen}", "protocol": "http"}, **(more or {})},
        "routes": [{"name": ROUTES, "virtual_hosts": [{"name": "all", "domains": ["*"], "routes": list(routes)}]}],
    }


def serving(port: int) -> Callable[[], bool]:
    return lambda: http_get(f"http://127.0.0.1:{port}/")[0] == 200


def eds_ack(node: str) -> Callable[[Event], bool]:
    return lambda e: e["event"] == "ack" and e.get("node") == node and e.get("type") == EDS


def rds_sent_to(events: EventLog, node: str, *, after: int) -> list[Event]:
    return events.select(lambda e: e["event"] == "sent" and e.get("node") == node and e.get("type") == RDS, after=after)


def kinds(events: EventLog, *, after: int) -> list[str]:
    return [e["event"] for e in events.read()[after:] if e["event"].startswith("rollout_")]


def load(group: ProcessGroup, ports: dict[str, int], seconds: int) -> dict[str, Wrk]:
    """A wrk through every Envoy for at most ``seconds`` (each is ended once its step is done)."""
    return {
        node: Wrk.start(group, f"http://127.0.0.1:{port}/", duration_s=seconds, threads=1, connections=4)
        for node, port in ports.items()
    }


def start_envoy(group: ProcessGroup, plane: ControlPlane, node: str, port: int) -> Envoy:
    envoy = Envoy.start(
        group,
        name=node,
        node_id=node,
        xds_address=plane.address,
        bootstrap_options=("--lrs",),
        bootstrap_edit=front_listener(port, ROUTES),
    )
    wait_until(serving(port), timeout=20, what=f"{node} to serve through its own listener", details=envoy.log_tail)
    return envoy


def wait_command(plane: ControlPlane) -> tuple[int, str]:
    done = pilotfish("wait", "--admin", plane.admin, "--timeout", "60", check=False, timeout=90)
    return done.returncode, done.stdout + done.stderr


def wait_then_routes(plane: ControlPlane) -> tuple[int, str, dict[str, str]]:
    """``pilotfish wait``, then at once the RDS version each connected proxy has ACKed (their
    status the moment it returned)."""
    code, said = wait_command(plane)
    status, answer = http_json("GET", f"http://{plane.admin}/v1/proxies")
    assert status == 200, answer
    return code, said, {proxy["node"]: proxy["types"]["RDS"]["acked_version"] for proxy in answer["proxies"]}


def test_a_bad_change_stops_at_the_canary_and_a_good_one_reaches_everyone(testbed: Testbed) -> None:
    group = testbed.group
    listen = free_port()  # (the service's own listener, which this test does not load)
    testbed.snapshot_path.write_text(yaml.safe_dump(document(listen, GOOD)))
    plane = ControlPlane(
        group,
        testbed.snapshot_path,
        free_port(),
        registry_port=free_port(),
        options=(
            "--rollout", "canary=c-*,100%",
            "--rollout-bake", str(BAKE),
            "--rollout-ack-timeout", "30",
            "--rollout-min-requests", "50",
            "--lrs-interval-ms", str(round(LRS_INTERVAL * 1000)),
            "--quiet-ms", "50",
        ),
    )  # fmt: skip
    plane.start()
    registry = RegistryClient(plane.registry_url)
    instances = {name: registry.register("web", "127.0.0.1", testbed.upstreams[name].port) for name in WEB}
    ports = {node: free_port() for node in FLEET}
    envoys = {node: start_envoy(group, plane, node, port) for node, port in ports.items()}
    events = plane.events
    events.wait_for(lambda e: e["event"] == "rollout_baseline_set", what="the first snapshot as the baseline")
    baseline_rds = rds_sent_to(events, "p-1", after=0)[-1]["version"]

    # 1. A route Envoy rejects (RE2 does not compile "(("): the canary NACKs it; nobody else gets it.
    mark = events.mark()
    broken = {"match": {"safe_regex": {"regex": "(("}}, "route": {"cluster": "web"}}
    testbed.snapshot_path.write_text(yaml.safe_dump(document(listen, broken, GOOD)))
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
    for node in OTHERS:
        assert rds_sent_to(events, node, after=mark) == [], f"{node} was sent the candidate"
    code, said = wait_command(plane)
    assert code == 1 and "rolled back and is held" in said, said
    late = start_envoy(group, plane, "c-2", free_port())  # a canary, started after: the baseline
    assert {e["version"] for e in rds_sent_to(events, "c-2", after=mark)} == {baseline_rds}
    assert all(http_get(f"http://127.0.0.1:{port}/")[0] == 200 for port in ports.values())
    late.process.stop()

    # 2. A good change under load, and an instance leaving while the canary bakes: not one request fails.
    mark = events.mark()
    running = load(group, ports, 90)
    testbed.snapshot_path.write_text(
        yaml.safe_dump(document(listen, {**GOOD, "route": {"cluster": "web", "timeout": "7s"}}))
    )
    events.wait_for(lambda e: e["event"] == "rollout_started", after=mark, what="the good change's rollout to start")
    pool = ThreadPoolExecutor(max_workers=1)
    waited = pool.submit(wait_then_routes, plane)  # from the first wave on: it must not return before the last
    events.wait_for(lambda e: e["event"] == "rollout_wave_acked", after=mark, what="the canary's wave to bake")
    churn = events.mark()
    registry.deregister("web", instances["web-b"])
    for node in FLEET:  # every Envoy, on the baseline or the candidate, gets the endpoint change
        events.wait_for(
            eds_ack(node),
            after=churn,
            what=f"{node} to ACK the endpoints without web-b",
        )
    for node in OTHERS:  # ...on the baseline still: the endpoints did not wait for their wave
        acked = events.find(eds_ack(node), after=churn)
        candidate = rds_sent_to(events, node, after=mark)
        assert acked is not None and (not candidate or events.index_of(acked) < events.index_of(candidate[0]))
    testbed.upstreams["web-b"].retire()
    code, said, routes_then = waited.result(timeout=120)
    pool.shutdown()
    assert code == 0, said
    # It returned once every Envoy had ACKed the candidate's routes, not before: their status then says so.
    candidate_rds = rds_sent_to(events, "c-1", after=mark)[-1]["version"]
    assert routes_then == dict.fromkeys(FLEET, candidate_rds), (said, routes_then)
    events.wait_for(
        lambda e: e["event"] == "rollout_completed", after=mark, what="the good change's rollout", timeout=60
    )
    started = [e["wave"] for e in events.select(lambda e: e["event"] == "rollout_wave_started", after=mark)]
    assert started == ["canary", "100%"]
    first_to = {node: events.index_of(rds_sent_to(events, node, after=mark)[0]) for node in FLEET}
    canary_passed = events.wait_for(lambda e: e["event"] == "rollout_wave_passed", after=mark, what="the canary's pass")
    assert first_to["c-1"] < events.index_of(canary_passed) < min(first_to[node] for node in OTHERS)
    for node, wrk in running.items():
        envoys[node].wait_for_requests("web", at_least=50)  # the load goes on through the last wave
        assert wrk.running(), f"{node}: the rollout took longer than the load run"
        result = wrk.stop()
        assert not result.problems(), f"{node}: {result.summary()}\n{envoys[node].log_tail()}"

    # 3. A route to a new cluster that fails: the canary ACKs it, its load reports show 503s, its wave fails.
    answers_503 = Upstream.start(group, "broken", status=503)
    mark = events.mark()
    running = load(group, ports, 90)
    failing = {"match": {"prefix": "/"}, "route": {"cluster": "broken"}}
    testbed.snapshot_path.write_text(
        yaml.safe_dump(document(listen, failing, more={"broken": {"endpoints": [f"127.0.0.1:{answers_503.port}"]}}))
    )
    failed = events.wait_for(
        lambda e: e["event"] == "rollout_failed", after=mark, what="the health gate to fail the canary", timeout=40
    )
    # No baseline proxy uses cluster broken: it is judged against the baseline's overall ratio (the
    # same window's, or the window before the wave's when the baseline had too few requests yet).
    assert failed["wave"] == "canary" and NEW_CLUSTER_JUDGED.search(failed["reason"]), failed
    rolled = events.wait_for(lambda e: e["event"] == "rollout_rolled_back", after=mark, what="the rollback")
    assert "rollout_wave_acked" in kinds(events, after=mark)  # it was ACKed: only the load showed it
    # The canary served errors from its ACK of the candidate until it ACKed the baseline's routes
    # again: at most the bake (a failing ratio fails the wave as soon as a report shows it, and at
    # the latest when the bake ends) and one reporting interval, by the event log's own clock.
    acked = events.find(lambda e: e["event"] == "rollout_wave_acked", after=mark)
    assert acked is not None
    back = events.wait_for(
        lambda e: e["event"] == "ack" and e.get("node") == "c-1" and e.get("type") == RDS,
        after=events.index_of(rolled),
        what="the canary to ACK the baseline's routes after the rollback",
    )
    assert back["version_info"] == candidate_rds  # the baseline now: the good change of step 2
    errors_for = back["ts"] - acked["ts"]
    assert errors_for <= BAKE + LRS_INTERVAL, (errors_for, failed, rolled)
    for node in OTHERS:
        assert rds_sent_to(events, node, after=mark) == [], f"{node} was sent the failing route"
        result = running[node].stop()
        assert not result.problems(), f"{node}: {result.summary()}"
    canary = running["c-1"].stop()
    assert canary.non_2xx_3xx > 0, canary.summary()  # (it served the failures until its wave was rolled back)
    wait_until(serving(ports["c-1"]), timeout=20, what="the canary to serve again after the rollback")
    print(f"\n{failed['reason']}; the canary served errors for at most {errors_for:.2f} s (bake {BAKE:g} s)")
