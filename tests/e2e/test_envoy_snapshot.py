"""A real Envoy, configured only by ``pilotfish serve`` from a snapshot file.

Each test gets its own temp dir, ports, upstreams, server and Envoy (see testbed.py). The
snapshot versions follow one story: "1" is the first file, "2" drops endpoint web-b and changes
the direct response, "3" breaks the clusters (``connect_timeout: 0s``, which Envoy rejects) while
changing the listener, "4" fixes them. Tests that need a later state start from version "2"
instead of replaying the story, so each stays short and independent.
"""

from __future__ import annotations

import threading
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from .event_log import CDS, EDS, LDS, RDS, TYPE_URLS, is_event, short_type, streams_of
from .processes import free_port, http_get, pilotfish, random_base_id, wait_until
from .snapshot_file import write_snapshot
from .testbed import Testbed, wait_for_acks

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(90)]

NODE = "edge-1"

V2: dict[str, Any] = {"version": "2", "web": ["web-a"], "direct_body": "direct v2"}
V3: dict[str, Any] = V2 | {"version": "3", "connect_timeout": "0s", "stat_prefix": "ingress_v3"}
V4: dict[str, Any] = V3 | {"version": "4", "connect_timeout": "1s", "direct_body": "direct v4"}
WITHOUT_VALIDATION = ("--validate", "off")
"""V3 breaks Envoy's own rules, which pilotfish checks before serving; the tests of Envoy's NACK
turn that off so the content reaches Envoy (tests/e2e/test_never_break_the_fleet.py has it on)."""


def sent_then_acked(testbed: Testbed, type_url: str, version: str, *, after: int) -> None:
    """The server sent ``type_url`` at ``version`` and Envoy ACKed that very response."""
    events = testbed.events
    sent = events.wait_for(
        is_event("sent", node=NODE, type=type_url, version=version),
        what=f"sent {type_url} at version {version!r}",
        after=after,
    )
    events.wait_for(
        is_event("ack", node=NODE, type=type_url, version_info=version, response_nonce=sent["nonce"]),
        what=f"ack of the response {sent['nonce']!r} ({type_url} at version {version!r})",
        after=events.index_of(sent) + 1,
    )


# -- tests ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "params",
    [{"version": "1"}, V2, V4, {"version": None, "reordered": True}],
    ids=["v1", "v2", "v4", "unversioned-reordered"],
)
def test_snapshot_files_of_this_suite_validate(tmp_path: Path, params: dict[str, Any]) -> None:
    """The files fed to the server are valid in its own eyes (V3 is meant to be rejected by Envoy)."""
    path = tmp_path / "snapshot.yaml"
    params = dict(params)  # the V* dicts are shared with other tests
    web = params.pop("web", ["web-a", "web-b"])
    endpoints = {"web": [free_port() for _ in web], "api": [free_port()]}
    write_snapshot(path, listener_port=free_port(), endpoints=endpoints, **params)
    result = pilotfish("validate", str(path), check=False)
    assert result.returncode == 0, result.stdout + result.stderr


def test_envoy_acks_every_type_and_routes_requests(testbed: Testbed) -> None:
    envoy = testbed.start(version="1")
    events = testbed.events

    acks = wait_for_acks(events, node=NODE, what="initial configuration", version="1")
    assert len({ack["stream"] for ack in acks.values()}) == 1, "one ADS stream carries all types"
    assert envoy.stat("control_plane.connected_state") == 1
    assert envoy.stat("cluster_manager.cds.version_text") == "1"
    assert envoy.stat("listener_manager.lds.version_text") == "1"

    envoy.wait_for_endpoints("web", [testbed.address_of("web-a"), testbed.address_of("web-b")])
    bodies = {testbed.request("/") for _ in range(8)}
    assert bodies == {(200, "web-a"), (200, "web-b")}, "round robin over both endpoints of web"
    assert testbed.request("/api") == (200, "api")
    assert testbed.request("/direct") == (200, "direct v1")


def test_renamed_snapshot_is_applied_without_restart(testbed: Testbed) -> None:
    envoy = testbed.start(version="1")
    pid = envoy.process.pid
    mark = testbed.events.mark()

    testbed.write_snapshot(**V2)

    wait_until(
        lambda: envoy.cluster_endpoints("web") == [testbed.address_of("web-a")],
        timeout=10,
        what="Envoy to drop endpoint web-b from cluster web",
        details=lambda: testbed.events.describe(after=mark),
    )
    wait_until(
        lambda: testbed.request("/direct") == (200, "direct v2"),
        timeout=10,
        what="the new direct response body",
    )
    assert {testbed.request("/") for _ in range(6)} == {(200, "web-a")}
    for type_url in (EDS, RDS):  # the two types whose content changed
        sent_then_acked(testbed, type_url, "2", after=mark)
    assert envoy.process.alive() and envoy.process.pid == pid, "applied live, not by a restart"


def test_with_explicit_versions_only_the_types_that_changed_are_sent(testbed: Testbed) -> None:
    """A file's ``version`` is per type: an edit of the clusters alone sends Envoy the clusters at
    the new version; its listeners stay at the version they had and are not sent again."""
    envoy = testbed.start(version="1")
    events = testbed.events
    mark = events.mark()

    testbed.write_snapshot(version="2", connect_timeout="2s")  # only the clusters change
    sent_then_acked(testbed, CDS, "2", after=mark)
    testbed.write_snapshot(version="3", connect_timeout="2s", direct_body="direct v3")  # only the routes
    sent_then_acked(testbed, RDS, "3", after=mark)
    wait_until(lambda: testbed.request("/direct") == (200, "direct v3"), timeout=10, what="the new direct body")

    # LDS goes out before RDS (ADS order): a re-send of the listeners would be in the log by now.
    assert events.select(is_event("sent", node=NODE, type=LDS), after=mark) == [], events.describe(after=mark)
    assert envoy.stat("listener_manager.lds.version_text") == "1"
    assert envoy.stat("cluster_manager.cds.version_text") == "2"
    done = pilotfish("wait", "--admin", testbed.control_plane.admin, "--version", "3", "--timeout", "20", check=False)
    assert done.returncode == 0, done.stdout + done.stderr


def test_rejected_clusters_keep_last_good_version(testbed: Testbed) -> None:
    testbed.control_plane.options = WITHOUT_VALIDATION
    envoy = testbed.start(**V2)
    events = testbed.events
    mark = events.mark()

    testbed.write_snapshot(**V3)

    nack = events.wait_for(is_event("nack", node=NODE, type=CDS), what="Envoy's NACK of the clusters", after=mark)
    assert nack["version_info"] == "2", "a NACK carries the last version Envoy accepted"
    assert "ConnectTimeout" in (nack["error"] or ""), nack["error"]
    wait_for_acks(events, node=NODE, what="the changed listener", types=[LDS], version="3", after=mark)

    wait_until(
        lambda: envoy.stat("listener_manager.lds.version_text") == "3",
        timeout=10,
        what="listener_manager.lds.version_text == '3'",
    )
    assert envoy.stat("cluster_manager.cds.version_text") == "2"
    assert envoy.stat("cluster_manager.cds.update_rejected") == 1
    # The new listener (stat prefix ingress_v3) routes over the clusters of version 2.
    wait_until(
        lambda: testbed.request("/") == (200, "web-a") and envoy.stat("http.ingress_v3.downstream_rq_completed"),
        timeout=10,
        what="a request through the listener of version 3",
    )

    # A marker: fixed clusters (version 4). A resend of the rejected ones after the NACK would be
    # logged before the marker is sent.
    marker_mark = events.mark()
    testbed.write_snapshot(**V4)
    sent_then_acked(testbed, CDS, "4", after=marker_mark)
    fixed = events.find(is_event("sent", type=CDS, version="4"), after=marker_mark)
    assert fixed is not None
    sent_v3 = events.select(is_event("sent", type=CDS, version="3"), after=mark)
    per_stream = Counter(event["stream"] for event in sent_v3)
    assert list(per_stream.values()) == [1] and events.index_of(sent_v3[0]) < events.index_of(fixed), (
        "the rejected clusters are sent once on Envoy's one stream, not again after the NACK\n"
        + events.describe(after=mark)
    )
    wait_until(
        lambda: envoy.stat("cluster_manager.cds.version_text") == "4",
        timeout=10,
        what="Envoy to accept the fixed clusters",
    )


@pytest.mark.parametrize("kill", [False, True], ids=["sigterm", "sigkill"])
def test_envoy_keeps_serving_and_reconnects_across_server_restart(testbed: Testbed, kill: bool) -> None:
    testbed.control_plane.options = WITHOUT_VALIDATION
    envoy = testbed.start(**V2)
    mark = testbed.events.mark()
    testbed.write_snapshot(**V3)
    testbed.events.wait_for(is_event("nack", node=NODE, type=CDS), what="NACK of v3", after=mark)
    wait_for_acks(testbed.events, node=NODE, what="v3 listener", types=[LDS], version="3", after=mark)

    testbed.control_plane.stop(kill=kill)
    wait_until(
        lambda: envoy.stat("control_plane.connected_state") == 0,
        timeout=10,
        what="control_plane.connected_state == 0",
    )
    assert testbed.request("/") == (200, "web-a"), "Envoy serves its last config meanwhile"
    assert testbed.request("/direct") == (200, "direct v2")

    testbed.write_snapshot(**V4)
    events = testbed.control_plane.start()  # same port, a fresh event log

    first_cds = events.wait_for(
        lambda e: e.get("event") in ("request", "ack", "nack") and e.get("type") == CDS,
        what="Envoy's first CDS request to the restarted server",
    )
    assert first_cds["event"] == "request", events.describe()
    assert first_cds["version_info"] == "2", "the last ACCEPTED cluster version, not the NACKed 3"
    acks = wait_for_acks(events, node=NODE, what="v4 after reconnecting", types=[CDS, LDS], version="4")
    assert acks[CDS]["stream"] == first_cds["stream"]

    wait_until(
        lambda: (
            envoy.stat("cluster_manager.cds.version_text") == "4"
            and envoy.stat("listener_manager.lds.version_text") == "4"
            and envoy.stat("control_plane.connected_state") == 1
        ),
        timeout=10,
        what="cds and lds version_text '4' and connected_state 1",
    )
    wait_until(
        lambda: testbed.request("/direct") == (200, "direct v4"),
        timeout=10,
        what="the direct response of v4",
    )


@pytest.mark.parametrize("variant", ["sotw", "delta"])
def test_hot_restart_finishes_in_flight_request_and_child_gets_everything(
    testbed: Testbed,
    variant: str,
) -> None:
    base_id = random_base_id()
    # The parent must outlive the slow request: the child ends it after parent_shutdown_time_s.
    hot_restart: dict[str, Any] = {
        "base_id": base_id,
        "drain_time_s": 2,
        "parent_shutdown_time_s": 15,
        "bootstrap_options": ("--delta",) if variant == "delta" else (),
    }
    parent = testbed.start(version="1", envoy_options=hot_restart | {"restart_epoch": 0})
    events = testbed.events

    result: dict[str, Any] = {}

    def slow_request() -> None:
        try:
            # Long enough to outlast the child's start on a busy machine (3 s did not, beside a
            # benchmark), short enough to end before the child ends the parent (15 s after it starts).
            result["response"] = testbed.request("/slow?ms=10000", timeout=20)
        except Exception as exc:
            result["error"] = exc

    client = threading.Thread(target=slow_request, name="slow-request")
    client.start()
    try:
        wait_until(
            lambda: parent.stat("http.ingress.downstream_rq_active"),
            timeout=5,
            what="the slow request to be in flight in the parent Envoy",
        )
        mark = events.mark()
        old_streams = set(streams_of(events.read()))
        child = testbed.start_envoy(name="envoy-epoch1", restart_epoch=1, **hot_restart)
        assert client.is_alive(), f"the slow request must still be in flight once the child is up: {result}"
    finally:
        client.join(timeout=20)

    assert result.get("response") in {(200, "web-a"), (200, "web-b")}, (
        f"the request in flight through the parent completes: {result}"
    )

    def new_stream() -> Any:
        fresh = [s for s in streams_of(events.read()[mark:]) if s not in old_streams]
        return fresh[0] if fresh else None

    stream = wait_until(new_stream, timeout=10, what="the child's own ADS stream")
    first_cds = events.wait_for(
        lambda e: e.get("stream") == stream and e.get("event") in ("request", "ack", "nack") and e.get("type") == CDS,
        what="the child's first CDS request",
        after=mark,
    )
    assert first_cds["event"] == "request", first_cds
    if variant == "sotw":
        assert first_cds["version_info"] == "", first_cds
    else:  # a delta child states nothing it has: it starts empty
        assert first_cds.get("delta") is True and not first_cds.get("initial_resources"), first_cds
    assert first_cds["node"] == NODE
    wait_for_acks(events, node=NODE, what="the child's configuration", stream=stream, after=mark)
    for type_url in TYPE_URLS:
        sent = events.select(is_event("sent", stream=stream, type=type_url), after=mark)
        assert sent and sent[0]["resources"] >= 1, f"child got {type_url}: {sent}"

    wait_until(child.is_live, timeout=10, what="the child Envoy to be LIVE")
    assert child.stat("cluster_manager.cds.version_text") == "1"
    assert testbed.request("/direct") == (200, "direct v1")
    # The parent drains until the child ends it (parent_shutdown_time_s); its admin API is
    # already closed: a hot-restart child asks its parent to shut admin down when it starts.
    assert parent.process.alive()
    with pytest.raises(OSError):
        http_get(f"http://127.0.0.1:{parent.admin_port}/ready")


def test_equal_content_without_version_sends_nothing(testbed: Testbed) -> None:
    testbed.start(version=None)
    events = testbed.events

    # A real change is pushed: this is what the test would see if equal content were pushed too.
    mark = events.mark()
    testbed.write_snapshot(version=None, direct_body="direct changed")
    loaded = events.wait_for(is_event("snapshot_loaded"), what="the changed file loaded", after=mark)
    sent = events.wait_for(is_event("sent", node=NODE, type=RDS), what="the changed route pushed", after=mark)
    assert sent["version"], "an unversioned snapshot still gets a (content) version"
    wait_until(
        lambda: testbed.request("/direct") == (200, "direct changed"),
        timeout=10,
        what="the changed direct response",
    )
    events.wait_for(
        is_event("ack", node=NODE, type=RDS, response_nonce=sent["nonce"]),
        what="ack of the changed route",
        after=mark,
    )

    # The same content with clusters in another order and every YAML key reordered.
    mark = events.mark()
    testbed.write_snapshot(version=None, direct_body="direct changed", reordered=True)
    # The server read the new file (so the silence below is not a watcher that missed it)...
    unchanged = events.wait_for(is_event("snapshot_unchanged"), what="the rewritten file read as unchanged", after=mark)
    assert unchanged["version"] == loaded["version"]
    assert testbed.request("/direct") == (200, "direct changed")
    # ...and pushes nothing. A marker change after it: whatever the rewrite (wrongly) caused is
    # logged before the marker's own pushes, which carry the marker's new route version.
    marker_mark = events.mark()
    testbed.write_snapshot(version=None, direct_body="direct marker")
    marker = events.wait_for(is_event("snapshot_loaded"), what="the marker change loaded", after=marker_mark)
    assert events.select(is_event("snapshot_loaded"), after=mark) == [marker], events.describe(after=mark)
    assert events.select(is_event("snapshot_error"), after=mark) == [], events.describe(after=mark)
    resent = [
        e
        for e in events.select(is_event("sent"), after=mark)
        if e["version"] == loaded["versions"][short_type(e["type"])]
    ]
    assert resent == [], "equal content was pushed again\n" + events.describe(after=mark)
    wait_until(
        lambda: testbed.request("/direct") == (200, "direct marker"),
        timeout=10,
        what="the marker's direct response",
    )
