"""Endpoint subsetting with real Envoys under load.

Six Envoys and twelve upstreams; service ``web`` (a cluster only, from the snapshot file) sets
``subset_size: 3``. Each Envoy takes load from its own ``wrk`` on a static listener of its own
(Envoys on one machine cannot share the service's listener: SO_REUSEPORT would split the load)
that routes to the dynamic cluster ``web``. What a user relies on:

- every Envoy lists exactly 3 endpoints, and together they use all 12 backends;
- a 13th backend changes at most one endpoint per Envoy; removing a backend replaces it in the
  Envoys that had it, and only there;
- no request fails meanwhile (the add/remove rules of test_endpoint_changes.py: start an upstream
  before it is listed; stop it only once no Envoy lists it);
- pilotfish restarted on the same state (its indices in the state file) sends nothing new.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from .browser import Browser
from .event_log import TYPE_URLS, is_event, short_type
from .processes import (
    ControlPlane,
    Envoy,
    ProcessGroup,
    Upstream,
    envoy_binary,
    free_port,
    front_listener,
    http_get,
    http_json,
    wait_until,
)
from .snapshot_file import write_services
from .testbed import wait_for_acks
from .wrk import Wrk, wrk_binary

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

ENVOYS = 6
BACKENDS = 12
K = 3
LOAD_S = 120
"""The longest the load runs may take (they are ended once the subsets changed under them)."""
TYPES = [t for t in TYPE_URLS if short_type(t) in ("CDS", "EDS", "LDS")]
"""What these Envoys ask for: no route configuration (their listener's routes are static)."""


def address(upstream: Upstream) -> str:
    return f"127.0.0.1:{upstream.port}"


def write(path: Path, upstreams: list[Upstream]) -> None:
    write_services(path, {"web": {"protocol": "http", "subset_size": K, "endpoints": [address(u) for u in upstreams]}})


def test_six_envoys_get_balanced_stable_subsets_under_load(processes: ProcessGroup, browser: Browser) -> None:
    envoy_binary()
    wrk_binary()
    state_dir = processes.workdir / "state"
    state_dir.mkdir()
    upstreams = [Upstream.start(processes, f"u{n}") for n in range(BACKENDS + 1)]
    serving = upstreams[:BACKENDS]
    snapshot = processes.workdir / "services.yaml"
    write(snapshot, serving)
    control_plane = ControlPlane(
        processes, snapshot, free_port(), options=("--state-dir", str(state_dir), "--quiet-ms", "50")
    )
    events = control_plane.start()

    envoys: list[Envoy] = []
    ports: list[int] = []
    for n in range(ENVOYS):
        ports.append(free_port())
        envoys.append(
            Envoy.start(
                processes,
                name=f"envoy{n}",
                node_id=f"edge-{n}",
                xds_address=control_plane.address,
                bootstrap_edit=front_listener(ports[-1], "web", rds=False),
            )
        )
        wait_for_acks(events, node=f"edge-{n}", what=f"edge-{n}'s configuration", types=TYPES)

    def subsets() -> list[set[str]]:
        return [set(envoy.cluster_endpoints("web")) for envoy in envoys]

    wait_until(
        lambda: all(len(s) == K for s in subsets()),
        timeout=15,
        what=f"every Envoy to list {K} endpoints",
        details=lambda: str(subsets()),
    )
    first = subsets()
    assert set().union(*first) == {address(u) for u in serving}, "together they use every backend"
    # The admin API says which subset each proxy is served; /metrics how even the load is.
    for n, envoy_subset in enumerate(first):
        status, config = http_json("GET", f"http://{control_plane.admin}/v1/config?node=edge-{n}")
        assert status == 200 and set(config["subsets"]["services"]["web"]) == envoy_subset, config.get("subsets")
    status, metrics = http_get(f"http://{control_plane.admin}/metrics")
    spread = [line for line in metrics.splitlines() if line.startswith("pilotfish_subset_load_spread{")]
    assert status == 200 and len(spread) == 1 and 'service="web"' in spread[0], spread
    assert 1.0 <= float(spread[0].rsplit(" ", 1)[1]) <= 2.0, spread
    # The status page shows each proxy's subset.
    page = browser.open(f"http://{control_plane.admin}/")
    wait_until(
        lambda: page.evaluate("document.body.innerText").count("subset #") == ENVOYS,
        timeout=15,
        what="the status page to show every proxy's subset",
    )
    text = page.evaluate("document.body.innerText")
    assert all(address in text for address in set().union(*first))

    loads = [
        Wrk.start(processes, f"http://127.0.0.1:{port}/", duration_s=LOAD_S, threads=1, connections=4) for port in ports
    ]

    # A 13th backend: at most one endpoint changes per Envoy.
    write(snapshot, upstreams)
    wait_until(
        lambda: any(s != f for s, f in zip(subsets(), first, strict=True)) and all(len(s) == K for s in subsets()),
        timeout=15,
        what="the 13th backend to join some subsets",
        details=lambda: str(subsets()),
    )
    second = subsets()
    for before, after in zip(first, second, strict=True):
        assert len(before - after) <= 1 and len(after - before) <= 1, (before, after)
    assert address(upstreams[BACKENDS]) in set().union(*second)

    # Remove a backend some Envoys hold: it is replaced there, and nothing changes elsewhere.
    gone = next(u for u in upstreams if sum(address(u) in s for s in second) >= 1)
    serving = [u for u in upstreams if u is not gone]
    write(snapshot, serving)
    wait_until(
        lambda: all(address(gone) not in s and len(s) == K for s in subsets()),
        timeout=15,
        what=f"every Envoy to drop {address(gone)}",
        details=lambda: str(subsets()),
    )
    third = subsets()
    for before, after in zip(second, third, strict=True):
        if address(gone) in before:
            assert len(before - after) == 1 and len(after - before) == 1, (before, after)
        else:
            assert before == after, "an Envoy that did not hold the removed backend keeps its subset"
    gone.retire()
    assert all(load.running() for load in loads), "the changes took longer than the load run"

    for envoy, load in zip(envoys, loads, strict=True):
        envoy.wait_for_requests("web", at_least=50)  # the load goes on through the last change
        result = load.stop()
        assert not result.problems(), f"{envoy.name}: {result.summary()}\n{result.output}"

    # Restart pilotfish on the same state: the Envoys reconnect with what they have; nothing is sent.
    acked = {
        (f"edge-{n}", short_type(t)): events.select(is_event("ack", node=f"edge-{n}", type=t))[-1]["version_info"]
        for n in range(ENVOYS)
        for t in TYPES
    }
    control_plane.stop()
    second_run = control_plane.start()
    for n in range(ENVOYS):
        for type_url in TYPES:
            second_run.wait_for(
                is_event("request", node=f"edge-{n}", type=type_url),
                timeout=15,
                what=f"edge-{n}'s reconnect request for {short_type(type_url)}",
            )
    mark = second_run.mark()
    # A marker change: whatever the restarted server (wrongly) sent on reconnect is logged before it.
    marker = Upstream.start(processes, "marker")
    write(snapshot, [*serving, marker])
    second_run.wait_for(is_event("snapshot_loaded"), what="the marker change", after=mark)
    sent = second_run.select(is_event("sent"))
    assert [e for e in sent if second_run.index_of(e) < mark] == [], (
        "a restart on the same state sent something before the marker change:\n" + second_run.describe()
    )
    resent = [e for e in sent if e["version"] == acked[(e["node"], short_type(e["type"]))]]
    assert resent == [], "a restart on the same state re-sent what the Envoys had:\n" + second_run.describe()
