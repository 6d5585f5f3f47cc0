"""The status page at the admin root, in a real headless Chromium (:mod:`.browser`): it lists a real
Envoy as SYNCED, shows its NACK of a rejected change (``--validate off`` and ``connect_timeout:
0s``, the story of test_admin_status.py) without a reload, fits a phone's screen, shows what a
hostile peer says as text, never as markup, and says why a change was refused or is held.
"""

from __future__ import annotations

import queue
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2
from google.rpc import status_pb2

from .browser import Browser, Page, chromium_binary
from .event_log import CDS, is_event
from .processes import http_get, wait_until
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


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[Browser]:
    chromium_binary()  # fail before starting anything when Chromium is not installed
    started = Browser.start(tmp_path)
    try:
        yield started
    finally:
        started.close()


def _proxies(page: Page) -> dict[str, dict[str, Any]]:
    return {proxy["node"]: proxy for proxy in page.evaluate(PROXIES_JS)}


def _wait_on_page(page: Page, check: Any, what: str) -> Any:
    return wait_until(check, timeout=20, what=f"the status page to show {what}",
                      details=lambda: "page text:\n" + str(page.evaluate("document.body.innerText"))[-3000:])


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
    testbed.events.wait_for(is_event("nack", node="edge-1", type=CDS), what="edge-1's NACK of the clusters",
                            after=mark)

    def nacked() -> list[dict[str, Any]]:
        edge = _proxies(page).get("edge-1", {})
        if edge.get("types", {}).get("CDS") != "CDS NACKED 3":
            return []
        return [n for n in page.evaluate(NACKS_JS) if n["node"] == "edge-1" and "ConnectTimeout" in n["message"]]

    (nack,) = _wait_on_page(page, nacked, "edge-1's CDS NACKED at version 3 with Envoy's message")
    assert (nack["type"], nack["version"]) == ("CDS", "3"), nack
    assert nack["reason"].startswith("Proto constraint validation failed (ClusterValidationError.ConnectTimeout")
    assert page.evaluate("window.__sameDocument") == "marked before the change"  # no reload
    assert page.evaluate("document.querySelector('#summary .n.NACKED').textContent") == "1"
    assert "nack" in page.evaluate(EVENTS_JS)

    # On a phone's screen the page fits its width (tables scroll inside their own box).
    page.resize(390, 844, mobile=True)
    wait_until(lambda: page.evaluate("document.documentElement.scrollWidth <= window.innerWidth"), timeout=10,
               what="the page to fit a 390 px wide phone screen")
    assert page.evaluate("getComputedStyle(document.querySelector('#proxies tr.proxy')).display") == "block"


HOSTILE_NODE = '<img src=x onerror="window.__pwned=1">edge-evil'
HOSTILE_CLUSTER = "<script>window.__pwned=2</script>"
HOSTILE_NACK = '<img src=x onerror="window.__pwned=3"> rejected <b class="hostile">bold</b> & "quoted"'


class _AdsClient:
    """A grpcio ADS stream that sends what the test puts in its queue."""

    def __init__(self, address: str) -> None:
        self.channel = grpc.insecure_channel(address)
        self.requests: queue.Queue[discovery_pb2.DiscoveryRequest | None] = queue.Queue()
        stub = ads_pb2_grpc.AggregatedDiscoveryServiceStub(self.channel)
        self.responses = stub.StreamAggregatedResources(iter(self.requests.get, None), timeout=60)

    def close(self) -> None:
        self.requests.put(None)
        self.responses.cancel()
        self.channel.close()


def test_what_peers_say_shows_as_text_and_never_runs(testbed: Testbed, browser: Browser) -> None:
    testbed.write_snapshot(**V2)
    testbed.control_plane.start()
    client = _AdsClient(testbed.control_plane.address)
    try:
        first = discovery_pb2.DiscoveryRequest(type_url=CDS)
        first.node.id, first.node.cluster = HOSTILE_NODE, HOSTILE_CLUSTER
        client.requests.put(first)
        response = next(client.responses)
        client.requests.put(discovery_pb2.DiscoveryRequest(
            type_url=CDS, version_info="", response_nonce=response.nonce,
            error_detail=status_pb2.Status(code=3, message=HOSTILE_NACK)))
        testbed.events.wait_for(is_event("nack", node=HOSTILE_NODE), what="the hostile client's NACK")

        page = browser.open(f"http://{testbed.control_plane.admin}/")

        def shown() -> list[dict[str, Any]]:
            return [n for n in page.evaluate(NACKS_JS) if n["node"] == HOSTILE_NODE]

        (nack,) = _wait_on_page(page, shown, "the hostile node's NACK as text")
        assert nack["message"] == nack["reason"] == HOSTILE_NACK
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
        panel = page.evaluate("document.getElementById('refused').classList.contains('hidden') ? '' : "
                              "document.getElementById('refused-body').textContent")
        return str(panel) if "connect_timeout" in str(panel) else ""

    assert "The latest change" in _wait_on_page(page, refused, "the refused change and why")

    # A change that removes every listener: held, with how to publish it anyway.
    document = testbed.write_snapshot(**V2B)
    without_listeners = {key: value for key, value in document.items() if key != "listeners"}
    staged = testbed.snapshot_path.with_suffix(".staged")
    staged.write_text(yaml.safe_dump(without_listeners))
    staged.replace(testbed.snapshot_path)

    def held() -> str:
        panel = page.evaluate("document.getElementById('held').classList.contains('hidden') ? '' : "
                              "document.getElementById('held-body').textContent")
        return str(panel) if "pilotfish confirm --admin" in str(panel) else ""

    shown = _wait_on_page(page, held, "the held snapshot and how to confirm it")
    assert "removes every listener" in shown, shown
    assert page.evaluate("document.getElementById('refused').classList.contains('hidden')")  # the build was good
