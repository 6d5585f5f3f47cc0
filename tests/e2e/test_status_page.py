"""The status page at the admin root, in a real headless Chromium (:mod:`.browser`): it lists a real
Envoy as SYNCED, shows its NACK of a rejected change (``--validate off`` and ``connect_timeout:
0s``, the story of test_admin_status.py) without a reload, fits a phone's screen, shows what a
hostile peer says as text, never as markup, and says why a change was refused or is held. With
10,000 proxies (the admin API over a status filled in-process) it counts them all, draws the worst
100 and filters through the server. With a rollout (a delivery in-process) it shows the wave, the
candidate and the pause, and a held candidate's reason (a hostile NACK) as text.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from aiohttp import web
from envoy.service.discovery.v3 import discovery_pb2
from google.rpc import status_pb2

from pilotfish.api.admin import AdminApi, SourceStatus
from pilotfish.cache import DEFAULT_GROUP, SnapshotCache
from pilotfish.events import EventLog, RecentEvents
from pilotfish.reconcile import Reconciler
from pilotfish.resources import CLUSTER
from pilotfish.resources.parse import parse_resource
from pilotfish.rollout.delivery import Delivery, candidate_group
from pilotfish.rollout.machine import RolloutSettings
from pilotfish.rollout.waves import parse_waves
from pilotfish.snapshot import Snapshot
from pilotfish.sources.docker import DockerSource, container_of_summary, parse_engine
from pilotfish.status import NodeInfo, SyncStatus
from pilotfish.transport.site import serve_app

from .ads_client import AdsClient
from .browser import Browser, Page
from .event_log import CDS, is_event
from .processes import http_get, wait_until
from .snapshot_file import write_document
from .test_admin_status import V2, V2B, V3
from .testbed import Testbed

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

ADS_TYPES = ("CDS", "EDS", "LDS", "RDS")

# What the page's own script draws, read back from the DOM as text.
PROXIES_JS = """Array.from(document.querySelectorAll('#proxies tr.proxy')).map(row => ({
  node: row.querySelector('.node').textContent, cluster: row.cells[1].textContent,
  types: Object.fromEntries(Array.from(row.querySelectorAll('.chip')).map(c => [c.dataset.type, c.textContent]))}))"""
NACKS_JS = """Array.from(document.querySelectorAll('#nacks tr.nack')).map(row => ({
  node: row.querySelector('.node').textContent, type: row.cells[1].textContent,
  version: row.cells[2].textContent, reason: row.querySelector('.reason').textContent,
  message: row.querySelector('pre').textContent}))"""
EVENTS_JS = "Array.from(document.querySelectorAll('#events li.event b')).map(b => b.textContent)"
VERSIONS_JS = "Array.from(document.querySelectorAll('#versions tbody tr')).map(row => row.textContent)"


def _proxies(page: Page) -> dict[str, dict[str, Any]]:
    return {proxy["node"]: proxy for proxy in page.evaluate(PROXIES_JS)}


def _wait_on_page(page: Page, check: Any, what: str) -> Any:
    return wait_until(
        check,
        timeout=20,
        what=f"the status page to show {what}",
        details=lambda: "page text:\n" + str(page.evaluate("document.body.innerText"))[-3000:],
    )


def test_the_page_lists_envoy_synced_then_its_nack_without_a_reload(testbed: Testbed, browser: Browser) -> None:
    testbed.control_plane.options = ("--validate", "off")
    testbed.start(**V2)
    admin = testbed.control_plane.admin
    status, html = http_get(f"http://{admin}/")
    assert status == 200 and '<meta name="viewport"' in html

    page = browser.open(f"http://{admin}/")
    page.evaluate("window.__sameDocument = 'marked before the change'")

    def synced() -> bool:
        edge = _proxies(page).get("edge-1")
        return edge is not None and all(edge["types"].get(t) == f"{t} SYNCED 2" for t in ADS_TYPES)

    _wait_on_page(page, synced, "edge-1 SYNCED at version 2 for every type")
    versions = page.evaluate(VERSIONS_JS)
    assert any(row.startswith("defaultCDS2") and "2: 1 of 1" in row for row in versions), versions
    assert page.evaluate("document.querySelector('#summary .n.SYNCED').textContent") == "1"

    # A change Envoy rejects: the page shows it NACKED, and Envoy's message, by itself.
    mark = testbed.events.mark()
    testbed.write_snapshot(**V3)
    testbed.events.wait_for(is_event("nack", node="edge-1", type=CDS), what="edge-1's NACK of the clusters", after=mark)

    def nacked() -> list[dict[str, Any]]:
        edge = _proxies(page).get("edge-1", {})
        if edge.get("types", {}).get("CDS") != "CDS NACKED 3":
            return []
        return [n for n in page.evaluate(NACKS_JS) if n["node"] == "edge-1" and "ConnectTimeout" in n["message"]]

    (nack,) = _wait_on_page(page, nacked, "edge-1's CDS NACKED at version 3 with Envoy's message")
    assert (nack["type"], nack["version"]) == ("CDS", "3"), nack
    # The rejected cluster's name, then Envoy's reason (its dump of the cluster left out).
    assert re.match(
        r"'(web|api)': Proto constraint validation failed \(ClusterValidationError.ConnectTimeout", nack["reason"]
    )
    assert page.evaluate("window.__sameDocument") == "marked before the change"  # no reload
    assert page.evaluate("document.querySelector('#summary .n.NACKED').textContent") == "1"
    assert "nack" in page.evaluate(EVENTS_JS)

    # On a phone's screen the page fits its width (tables scroll inside their own box).
    page.resize(390, 844, mobile=True)
    wait_until(
        lambda: page.evaluate("document.documentElement.scrollWidth <= window.innerWidth"),
        timeout=10,
        what="the page to fit a 390 px wide phone screen",
    )
    assert page.evaluate("getComputedStyle(document.querySelector('#proxies tr.proxy')).display") == "block"


HOSTILE_NODE = '<img src=x onerror="window.__pwned=1">edge-evil'
HOSTILE_CLUSTER = "<script>window.__pwned=2</script>"
HOSTILE_NACK = '<img src=x onerror="window.__pwned=3"> rejected <b class="hostile">bold</b> & "quoted"'


def test_what_peers_say_shows_as_text_and_never_runs(testbed: Testbed, browser: Browser) -> None:
    testbed.write_snapshot(**V2)
    testbed.control_plane.start()
    client = AdsClient(testbed.control_plane.address)
    try:
        first = discovery_pb2.DiscoveryRequest(type_url=CDS)
        first.node.id, first.node.cluster = HOSTILE_NODE, HOSTILE_CLUSTER
        client.requests.put(first)
        response = next(client.responses)
        client.requests.put(
            discovery_pb2.DiscoveryRequest(
                type_url=CDS,
                version_info="",
                response_nonce=response.nonce,
                error_detail=status_pb2.Status(code=3, message=HOSTILE_NACK),
            )
        )
        testbed.events.wait_for(is_event("nack", node=HOSTILE_NODE), what="the hostile client's NACK")

        page = browser.open(f"http://{testbed.control_plane.admin}/")

        def shown() -> list[dict[str, Any]]:
            return [n for n in page.evaluate(NACKS_JS) if n["node"] == HOSTILE_NODE]

        (nack,) = _wait_on_page(page, shown, "the hostile node's NACK as text")
        # After the names of the clusters it rejected (its message names none of them).
        assert nack["message"] == nack["reason"] and nack["message"].endswith(f": {HOSTILE_NACK}"), nack
        assert "'web'" in nack["message"].removesuffix(HOSTILE_NACK), nack
        proxy = _proxies(page)[HOSTILE_NODE]
        assert proxy["cluster"] == HOSTILE_CLUSTER and proxy["types"]["CDS"].startswith("CDS NACKED")
        # As text: no element of theirs exists, and nothing of theirs ran.
        assert page.evaluate("document.querySelectorAll('img, b.hostile').length") == 0
        assert page.evaluate("document.scripts.length") == 1  # the page's own
        assert page.evaluate("window.__pwned === undefined") is True
        assert "nack" in page.evaluate(EVENTS_JS)
        events_text = page.evaluate("document.getElementById('events').textContent")
        assert HOSTILE_NODE in events_text
    finally:
        client.close()


def test_refused_and_held_snapshots_are_shown_with_why_and_what_to_do(testbed: Testbed, browser: Browser) -> None:
    testbed.start(**V2)  # pilotfish checks Envoy's rules itself (--validate on)
    page = browser.open(f"http://{testbed.control_plane.admin}/")
    _wait_on_page(page, lambda: "edge-1" in _proxies(page), "edge-1")
    assert page.evaluate("document.getElementById('refused').classList.contains('hidden')")

    # Clusters Envoy would reject: refused before any proxy sees them, and the page says why.
    testbed.write_snapshot(**V3)

    def refused() -> str:
        panel = page.evaluate(
            "document.getElementById('refused').classList.contains('hidden') ? '' : "
            "document.getElementById('refused-body').textContent"
        )
        return str(panel) if "connect_timeout" in str(panel) else ""

    assert "The latest change" in _wait_on_page(page, refused, "the refused change and why")

    # A change that removes every listener: held, with how to publish it anyway.
    document = testbed.snapshot_document(**V2B)
    without_listeners = {key: value for key, value in document.items() if key != "listeners"}
    write_document(testbed.snapshot_path, without_listeners)

    def held() -> str:
        panel = page.evaluate(
            "document.getElementById('held').classList.contains('hidden') ? '' : "
            "document.getElementById('held-body').textContent"
        )
        return str(panel) if "pilotfish confirm --admin" in str(panel) else ""

    shown = _wait_on_page(page, held, "the held snapshot and how to confirm it")
    assert "removes every listener" in shown, shown
    assert page.evaluate("document.getElementById('refused').classList.contains('hidden')")  # the build was good


FLEET = 10_000
TYPE_URLS = {
    short: f"type.googleapis.com/envoy.{path}"
    for short, path in (
        ("CDS", "config.cluster.v3.Cluster"),
        ("EDS", "config.endpoint.v3.ClusterLoadAssignment"),
        ("LDS", "config.listener.v3.Listener"),
        ("RDS", "config.route.v3.RouteConfiguration"),
    )
}


def _fleet_status() -> SyncStatus:
    """10,000 proxies at version v7: every 100th rejected its clusters, every 250th has not ACKed yet."""
    status = SyncStatus()
    status.published("default", label="v7", versions=dict.fromkeys(TYPE_URLS.values(), "v7"))
    for n in range(FLEET):
        node = f"edge-{n:05d}"
        status.stream_opened(node, NodeInfo(cluster=f"zone-{n % 3}", user_agent="envoy"))
        for short, url in TYPE_URLS.items():
            status.sent(node, url, "v7")
            if short == "CDS" and n % 100 == 0:
                status.nacked(node, url, "v7", f"cluster web-{n}: value must be greater than 0s")
            elif n % 250 != 7:
                status.acked(node, url, "v7")
    return status


@contextmanager
def _admin_api_on_a_thread(api: AdminApi) -> Iterator[str]:
    """Serve ``api`` on its own event loop in a thread (the test blocks while it polls the page)."""
    loop = asyncio.new_event_loop()
    started: concurrent.futures.Future[tuple[web.AppRunner, str]] = concurrent.futures.Future()

    def run() -> None:
        asyncio.set_event_loop(loop)
        try:
            started.set_result(loop.run_until_complete(serve_app(api.app(), "127.0.0.1:0")))
        except BaseException as exc:
            started.set_exception(exc)
            return
        loop.run_forever()

    thread = threading.Thread(target=run, name="admin-api")
    thread.start()
    runner, address = started.result(timeout=20)
    try:
        yield address
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(timeout=20)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(20)
        loop.close()


def test_ten_thousand_proxies_counts_for_all_rows_for_the_worst_and_a_filter(browser: Browser) -> None:
    cache = SnapshotCache()
    api = AdminApi(_fleet_status(), cache, Reconciler(cache), recent=RecentEvents())
    with _admin_api_on_a_thread(api) as address:
        page = browser.open(f"http://{address}/")
        counts = (
            "Object.fromEntries(Array.from(document.querySelectorAll('#summary .n'))"
            ".map(n => [n.className, n.textContent]))"
        )
        expected = {"n": str(FLEET), "n NACKED": "100", "n STALE": "40", "n NOT_SENT": "0", "n SYNCED": "9860"}
        _wait_on_page(page, lambda: page.evaluate(counts) == expected, "the counts of all 10,000 proxies")
        rows = _proxies(page)
        assert len(rows) == 100  # drawn: the worst 100, the NACKED ones first
        assert all(proxy["types"]["CDS"].startswith("CDS NACKED") for proxy in rows.values())
        assert page.evaluate("document.getElementById('shown').textContent").startswith("Showing 100 of 10000")
        assert page.evaluate("document.querySelectorAll('#nacks tr.nack').length") == 20  # the latest only
        versions = page.evaluate(VERSIONS_JS)
        assert any(row.startswith("defaultCDSv7") and "v7: 9860 of 10000" in row for row in versions), versions

        # The filter asks the server: the ten proxies edge-0975x, the STALE one first.
        page.evaluate(
            "const box = document.getElementById('filter'); box.value = 'EDGE-0975';"
            "box.dispatchEvent(new Event('input'))"
        )
        _wait_on_page(page, lambda: len(_proxies(page)) == 10, "the ten proxies the filter matches")
        assert list(_proxies(page)) == ["edge-09757", *(f"edge-0975{n}" for n in (0, 1, 2, 3, 4, 5, 6, 8, 9))]
        assert page.evaluate("document.getElementById('shown').textContent").startswith("10 proxies matching")


def _clusters(*names: str) -> Snapshot:
    config = {"type": "EDS", "connect_timeout": "1s", "eds_cluster_config": {"eds_config": {"ads": {}}}}
    parsed = [parse_resource(CLUSTER, {"name": name, **config}, "")[0] for name in names]
    return Snapshot.build({CLUSTER: [message for message in parsed if message is not None]})


ROLLOUT_JS = (
    "document.getElementById('rollout').classList.contains('hidden') ? '' : "
    "document.getElementById('rollout-body').innerText"
)


def test_the_rollout_shows_its_wave_its_pause_and_why_a_candidate_is_held(browser: Browser) -> None:
    cache, status = SnapshotCache(), SyncStatus()
    settings = RolloutSettings(waves=parse_waves("canary=c-*,100%"), bake=600.0, health=None)
    delivery = Delivery(cache, settings, status=status, events=EventLog())
    for node in ("c-1", "edge-1"):
        status.stream_opened(node, NodeInfo(cluster="edge", user_agent="envoy"))
    delivery.publish({DEFAULT_GROUP: _clusters("web")})  # the baseline
    delivery.publish({DEFAULT_GROUP: _clusters("web", "api")})  # a candidate the canary NACKs: held
    candidate = cache.snapshot(candidate_group(DEFAULT_GROUP))
    assert candidate is not None
    version = candidate.version(CLUSTER.url)
    assert version is not None
    status.sent("c-1", CLUSTER.url, version)
    status.nacked("c-1", CLUSTER.url, version, HOSTILE_NACK)
    delivery.publish({DEFAULT_GROUP: _clusters("web", "db")})  # the next candidate, paused in the canary wave
    delivery.pause()
    shown = delivery.status()
    api = AdminApi(status, cache, Reconciler(cache), recent=RecentEvents(), rollout=delivery)
    with _admin_api_on_a_thread(api) as address:
        page = browser.open(f"http://{address}/")
        text = _wait_on_page(page, lambda: page.evaluate(ROLLOUT_JS), "the rollout section")
        assert "Wave canary (1 of 2): acking" in text, text
        assert f"Candidate {shown['candidate'][:12]} over baseline {shown['baseline'][:12]}: 0 of 2 proxies" in text
        assert "Waiting for 1 proxy to ACK: c-1" in text
        assert "Paused: by the operator. To go on: pilotfish rollout resume." in text
        assert "NACKed CDS: " + HOSTILE_NACK in text  # the held candidate's reason, as text
        assert page.evaluate("document.getElementById('rollout').classList.contains('paused')") is True
        assert page.evaluate("document.querySelectorAll('img, b.hostile').length") == 0
        assert page.evaluate("window.__pwned === undefined") is True


DOCKER_JS = """Array.from(document.querySelectorAll('#docker tr.container')).map(row => ({
  container: row.querySelector('.node').textContent, state: row.cells[2].textContent,
  serves: row.cells[3].textContent, problems: row.querySelector('.reason').textContent}))"""


def test_docker_engines_show_each_labelled_container_what_it_serves_and_its_bad_labels(browser: Browser) -> None:
    """A container's name and labels are whoever started it's: shown as text, never run."""
    source = DockerSource(parse_engine("unix:///run/pilotfish-e2e-no-such.sock"), on_state=lambda _: None)
    hostile = HOSTILE_NACK.replace(" ", "")
    source.view.replace(
        [
            container_of_summary(
                {
                    "Id": "a" * 64,
                    "Names": ["/web-1"],
                    "Labels": {"pilotfish.service": "web:8081"},
                    "State": "running",
                    "Status": "Up 2 minutes (healthy)",
                    "HostConfig": {"NetworkMode": "host"},
                }
            ),
            container_of_summary(
                {
                    "Id": "b" * 64,
                    "Names": [f"/{hostile}"],
                    "Labels": {"pilotfish.service": f"web:{hostile}"},
                    "State": "running",
                    "Status": "Up 1 second",
                    "HostConfig": {"NetworkMode": "host"},
                }
            ),
        ]
    )
    source.problem = None  # (listed: as after a listing of the engine)
    cache = SnapshotCache()
    api = AdminApi(
        SyncStatus(), cache, Reconciler(cache), recent=RecentEvents(), sources=SourceStatus(docker=[source.status])
    )
    with _admin_api_on_a_thread(api) as address:
        page = browser.open(f"http://{address}/")
        shown = _wait_on_page(page, lambda: page.evaluate(DOCKER_JS), "the Docker section")
        by_name = {row["container"]: row for row in shown}
        assert by_name["web-1"]["state"] == "healthy" and by_name["web-1"]["serves"] == "web 127.0.0.1:8081"
        bad = by_name[hostile]
        assert bad["serves"] == "nothing" and "label pilotfish.service" in bad["problems"], bad
        assert "unix:///run/pilotfish-e2e-no-such.sock" in page.evaluate(
            "document.getElementById('docker-engines').innerText"
        )
        assert page.evaluate("document.querySelectorAll('img, b.hostile').length") == 0
        assert page.evaluate("window.__pwned === undefined") is True
